//! The leases the etcd store writes its keys with: one per time bucket and kind of key
//! (records, claims), granted ahead of need by the root context's timer, so that no event
//! waits for a grant and a key is gone at most a bucket width (and a second of rounding)
//! after its value lapsed.

use super::{grant_body, StoreError};

/// A lease fanout holds, or asked for: until when the keys written with it may live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Lease {
    /// The end of the bucket it serves plus its horizon: every key written with it must
    /// lapse by then.
    until_ms: u64,
    /// `None` while the grant is in flight (its call's token).
    id: Option<i64>,
    token: Option<u32>,
}

/// A kind of lease: keys that must live `horizon_ms`, bucketed by `width_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Family {
    pub horizon_ms: u64,
    pub width_ms: u64,
}

impl Family {
    /// Buckets of a tenth of the horizon, from 1 s to 60 s.
    pub fn for_horizon(horizon_ms: u64) -> Family {
        Family {
            horizon_ms,
            width_ms: (horizon_ms / 10).clamp(1_000, 60_000),
        }
    }

    /// The `until` of the lease serving the bucket of `at_ms`.
    fn until_for(&self, at_ms: u64) -> u64 {
        let width = self.width_ms.max(1);
        (at_ms / width)
            .saturating_add(1)
            .saturating_mul(width)
            .saturating_add(self.horizon_ms)
    }
}

/// The leases of the etcd store, granted ahead of need by the root context's timer.
#[derive(Debug, Default)]
pub struct Leases {
    leases: Vec<Lease>,
    /// No grant is asked for before this (after a failed one).
    quiet_until_ms: u64,
}

/// A grant to send: its body, and the `until` it serves.
pub struct Grant {
    pub until_ms: u64,
    pub body: Vec<u8>,
}

impl Leases {
    /// Whether every lease asked for is granted, and there is one (no grant pending).
    pub fn all_granted(&self) -> bool {
        !self.leases.is_empty() && self.leases.iter().all(|l| l.id.is_some())
    }

    /// The granted lease that lives the least long while covering `until_ms`.
    pub fn pick(&self, until_ms: u64) -> Option<i64> {
        self.leases
            .iter()
            .filter(|l| l.until_ms >= until_ms)
            .filter_map(|l| l.id.map(|id| (l.until_ms, id)))
            .min()
            .map(|(_, id)| id)
    }

    /// The grants to ask for now: for each family, the leases of this bucket and the next
    /// that are neither held nor asked for. Forgets those past their `until`.
    pub fn wanted(&mut self, now_ms: u64, families: &[Family]) -> Vec<Grant> {
        self.leases.retain(|l| l.until_ms > now_ms);
        if now_ms < self.quiet_until_ms {
            return Vec::new();
        }
        let mut grants = Vec::new();
        for family in families {
            for at in [now_ms, now_ms.saturating_add(family.width_ms)] {
                let until_ms = family.until_for(at);
                if self.leases.iter().any(|l| l.until_ms == until_ms)
                    || grants.iter().any(|g: &Grant| g.until_ms == until_ms)
                {
                    continue;
                }
                // Counted from now (etcd counts from when it grants, later), rounded up,
                // plus a second.
                let ttl_s = until_ms.saturating_sub(now_ms).div_ceil(1000) + 1;
                grants.push(Grant {
                    until_ms,
                    body: grant_body(ttl_s),
                });
            }
        }
        grants
    }

    /// A grant for `until_ms` went out as call `token`.
    pub fn asked(&mut self, until_ms: u64, token: u32) {
        self.leases.push(Lease {
            until_ms,
            id: None,
            token: Some(token),
        });
    }

    /// The answer to grant `token`.
    pub fn granted(&mut self, token: u32, result: Result<i64, StoreError>, now_ms: u64) {
        match result {
            Ok(id) => {
                for lease in self.leases.iter_mut().filter(|l| l.token == Some(token)) {
                    lease.id = Some(id);
                    lease.token = None;
                }
            }
            Err(_) => self.failed(token, now_ms),
        }
    }

    /// Grant `token` failed (or could not be sent): asked again in a second.
    pub fn failed(&mut self, token: u32, now_ms: u64) {
        self.leases.retain(|l| l.token != Some(token));
        self.quiet_until_ms = now_ms.saturating_add(1_000);
    }

    /// A grant could not even be sent.
    pub fn not_sent(&mut self, now_ms: u64) {
        self.quiet_until_ms = now_ms.saturating_add(1_000);
    }

    /// etcd lost them (a restored cluster): grant all again.
    pub fn forget(&mut self) {
        self.leases.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_are_granted_per_bucket_ahead_and_picked_shortest() {
        let mut leases = Leases::default();
        let family = Family::for_horizon(10_000);
        assert_eq!(family.width_ms, 1_000);
        let grants = leases.wanted(500, &[family]);
        let untils: Vec<u64> = grants.iter().map(|g| g.until_ms).collect();
        assert_eq!(untils, [11_000, 12_000]);
        assert_eq!(grants[0].body, grant_body(12));
        leases.asked(11_000, 1);
        leases.asked(12_000, 2);
        assert!(leases.wanted(600, &[family]).is_empty());
        assert_eq!(leases.pick(10_600), None, "not granted yet");
        leases.granted(1, Ok(41), 600);
        leases.granted(2, Ok(42), 600);
        assert_eq!(leases.pick(10_600), Some(41));
        assert_eq!(leases.pick(11_500), Some(42));
        assert_eq!(leases.pick(12_001), None);
        // The next bucket: one more grant; the first lease is kept until it ends.
        let grants = leases.wanted(1_000, &[family]);
        assert_eq!(grants.len(), 1);
        assert_eq!(grants[0].until_ms, 13_000);
        // A failed grant is asked again after a second.
        leases.asked(13_000, 3);
        leases.granted(3, Err(StoreError::new("down")), 1_000);
        assert!(leases.wanted(1_500, &[family]).is_empty());
        assert_eq!(leases.wanted(2_000, &[family]).len(), 2);
        leases.forget();
        assert_eq!(leases.pick(0), None);
    }
}
