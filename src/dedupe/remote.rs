//! The etcd store's side of one VM, kept by the root context: the leases granted ahead of
//! need, the settles owed (queued by whichever context ended a fan-out, sent by the root's
//! timer, since Envoy cancels a stream's calls when the stream ends), and the store-error
//! warnings (one per 10 s at most).
//!
//! The timer runs at [`SETTLE_TICK`] only while something is owed: settles queued or in
//! flight, a lease grant pending. Otherwise every [`LEASE_TICK`], enough to ask for the next
//! bucket's lease in time (buckets are at least a second wide). A settle queued while the
//! timer is slow asks for the fast one from the context that queues it ([`Remote::queue`]).
//! The settles queued at one tick go out as one txn per lease (up to
//! [`MAX_SETTLES_PER_TXN`] events each, no key twice): under load an event costs its claim and
//! a share of a settle.

use std::cell::RefCell;
use std::time::Duration;

use super::claim::{etcd_headers, etcd_reply};
use super::etcd::{self, Family, Leases, SettleOp, StoreError, MAX_SETTLES_PER_TXN};
use super::settle::RemoteSettle;
use super::CLAIM_MARGIN_MS;
use crate::call::Failure;
use crate::config::{Config, EtcdStore, Store};
use crate::host::Host;
use crate::telemetry::Telemetry;

/// At most one store-error warning per this long.
const WARNING_EVERY_MS: u64 = 10_000;
/// The root's timer while settles are owed or a grant is pending (the plugin's delivery
/// tick): the most a settle waits before it goes out.
pub const SETTLE_TICK: Duration = Duration::from_millis(10);
/// The root's timer when the etcd store owes nothing: a quarter of the narrowest lease
/// bucket (1 s), so that every bucket sees ticks to ask for the next one's lease.
pub const LEASE_TICK: Duration = Duration::from_millis(250);

/// The VM's etcd state.
#[derive(Default)]
pub struct Remote {
    pub leases: Leases,
    families: Vec<Family>,
    /// Settles to send at the next tick.
    queued: Vec<RemoteSettle>,
    /// Settle txns sent: token, and the settles in it: context id (for log lines), whether
    /// counted in the metrics.
    in_flight: Vec<(u32, Vec<(u32, bool)>)>,
    last_warning_ms: Option<u64>,
    unlogged: u32,
    /// Whether the root's timer runs at [`SETTLE_TICK`] (kept by the plugin; set when a
    /// queued settle asks for it).
    fast_timer: bool,
}

/// What an answer to one of the root's etcd calls came to.
pub enum Answered {
    /// A lease grant: nothing to count.
    Grant,
    /// A settle txn: `counted` settles in it (of configurations with metrics on) applied,
    /// or (`failed`) each a store error.
    Settles { counted: u32, failed: bool },
}

/// Settles that ended at once when sent (no lease, refused at dispatch), each a store error:
/// how many, of configurations with metrics on.
pub struct NotSent {
    pub counted: u32,
}

impl Remote {
    /// The lease kinds of a (new) configuration: records (`ttl_ms`) and claims (the longest
    /// delivery and a margin). Leases of other kinds are dropped (they expire in etcd).
    pub fn configure(&mut self, families: Vec<Family>) {
        if self.families != families {
            self.leases.forget();
            self.families = families;
        }
    }

    /// A settle owed, sent at the next tick. If the root's timer is slow, asks for the fast
    /// one (`host` in whichever context queues it: a stream's timer calls set its root's).
    pub fn queue<H: Host>(&mut self, host: &H, settle: RemoteSettle) {
        self.queued.push(settle);
        self.wake(host);
    }

    /// Asks for the fast timer (from any context), if it is not running.
    pub fn wake<H: Host>(&mut self, host: &H) {
        if !self.fast_timer {
            host.set_tick_period(SETTLE_TICK);
            self.fast_timer = true;
        }
    }

    /// Settles queued or in flight: work the process still owes.
    pub fn owed(&self) -> usize {
        self.queued.len()
            + self
                .in_flight
                .iter()
                .map(|(_, settles)| settles.len())
                .sum::<usize>()
    }

    /// Whether the timer must run at [`SETTLE_TICK`]: settles owed, or leases not held yet
    /// (a grant pending, or none granted).
    pub fn wants_fast_timer(&self) -> bool {
        self.owed() > 0 || !self.families.is_empty() && !self.leases.all_granted()
    }

    /// The timer the plugin set: fast or not.
    pub fn timer_is(&mut self, fast: bool) {
        self.fast_timer = fast;
    }

    /// Whether to log a store-error warning now; if so, how many were not logged since.
    pub fn warn(&mut self, now_ms: u64) -> Option<u32> {
        match self.last_warning_ms {
            Some(last) if now_ms.saturating_sub(last) < WARNING_EVERY_MS => {
                self.unlogged = self.unlogged.saturating_add(1);
                None
            }
            _ => {
                self.last_warning_ms = Some(now_ms);
                Some(std::mem::take(&mut self.unlogged))
            }
        }
    }

    /// Asks for the leases due (the root context is the current one). Returns the first
    /// refusal at dispatch (`on_configure` refuses a cluster Envoy does not have).
    pub fn grant<H: Host>(
        &mut self,
        host: &H,
        now_ms: u64,
        store: &EtcdStore,
    ) -> Result<(), crate::call::Failure> {
        let families = self.families.clone();
        for grant in self.leases.wanted(now_ms, &families) {
            let headers = etcd_headers(&store.cluster, etcd::GRANT_PATH);
            let timeout = Duration::from_millis(u64::from(store.timeout_ms));
            match host.dispatch(&store.cluster, headers, &grant.body, timeout) {
                Ok(token) => self.leases.asked(grant.until_ms, token),
                Err(failure) => {
                    self.leases.not_sent(now_ms);
                    return Err(failure);
                }
            }
        }
        Ok(())
    }

    /// Sends the settles queued (the root context is the current one), as few txns as
    /// their leases, clusters and etcd's limits allow; returns those that failed at once
    /// (no lease, refused at dispatch), each counted as a store error.
    pub fn send_settles<H: Host>(&mut self, host: &H, now_ms: u64) -> NotSent {
        let mut failed = 0;
        let mut batches: Vec<Batch> = Vec::new();
        for settle in std::mem::take(&mut self.queued) {
            let lease = if settle.records.is_none() {
                Some(0)
            } else {
                self.leases.pick(settle.until_ms)
            };
            let Some(lease) = lease else {
                self.settle_failed(
                    settle.log_id,
                    &StoreError("no etcd lease for the records".into()),
                    now_ms,
                );
                failed += u32::from(settle.metrics);
                continue;
            };
            match batches.iter_mut().find(|b| b.takes(&settle, lease)) {
                Some(batch) => batch.settles.push(settle),
                None => batches.push(Batch {
                    lease,
                    settles: vec![settle],
                }),
            }
        }
        for batch in batches {
            let Some(first) = batch.settles.first() else {
                continue;
            };
            let (cluster, timeout_ms) = (first.cluster.clone(), first.timeout_ms);
            let ops: Vec<SettleOp<'_>> = batch
                .settles
                .iter()
                .map(|s| SettleOp {
                    claim_key: &s.claim.0,
                    claim: &s.claim.1,
                    records: s.records.as_ref().map(|(k, v)| (k.as_slice(), v.as_str())),
                })
                .collect();
            let body = etcd::settle_body(&ops, batch.lease);
            let timeout = Duration::from_millis(u64::from(timeout_ms));
            let settles: Vec<(u32, bool)> = batch
                .settles
                .iter()
                .map(|s| (s.log_id, s.metrics))
                .collect();
            let headers = etcd_headers(&cluster, etcd::TXN_PATH);
            match host.dispatch(&cluster, headers, &body, timeout) {
                Ok(token) => self.in_flight.push((token, settles)),
                Err(failure) => {
                    let error = StoreError(format!("refused at dispatch: {failure}"));
                    for (log_id, metrics) in settles {
                        self.settle_failed(log_id, &error, now_ms);
                        failed += u32::from(metrics);
                    }
                }
            }
        }
        NotSent { counted: failed }
    }

    fn settle_failed(&mut self, log_id: u32, error: &StoreError, now_ms: u64) {
        if error.lease_lost() {
            self.leases.forget();
        }
        if let Some(unlogged) = self.warn(now_ms) {
            let earlier = if unlogged > 0 {
                format!(" ({unlogged} more since the last warning)")
            } else {
                String::new()
            };
            log::warn!(
                "[#{log_id}] dedupe: could not record the outcome in etcd: {error}; its \
                 claims lapse on their own, its deliveries may be repeated{earlier}"
            );
        }
    }

    /// The answer to call `token`, if it is one of the root's etcd calls (`reply` reads it).
    pub fn on_response(
        &mut self,
        token: u32,
        reply: impl FnOnce() -> etcd::Reply,
        now: impl FnOnce() -> u64,
    ) -> Option<Answered> {
        if self.leases.is_grant(token) {
            let result = etcd::read_answer(&reply()).and_then(etcd::read_grant);
            if let Err(error) = &result {
                log::debug!("dedupe: etcd lease grant failed: {error}");
            }
            let failed = result.is_err();
            self.leases
                .granted(token, result, if failed { now() } else { 0 });
            return Some(Answered::Grant);
        }
        let at = self.in_flight.iter().position(|(t, _)| *t == token)?;
        let (_, settles) = self.in_flight.swap_remove(at);
        let counted = settles.iter().filter(|(_, metrics)| *metrics).count();
        let counted = u32::try_from(counted).unwrap_or(u32::MAX);
        match etcd::read_answer(&reply()).and_then(etcd::read_txn_ok) {
            Ok(()) => Some(Answered::Settles {
                counted,
                failed: false,
            }),
            Err(error) => {
                let now = now();
                for (log_id, _) in settles {
                    self.settle_failed(log_id, &error, now);
                }
                Some(Answered::Settles {
                    counted,
                    failed: true,
                })
            }
        }
    }
}

/// Settles sent as one txn: the same lease (or none needed), cluster and timeout, at most
/// [`MAX_SETTLES_PER_TXN`] of them, and no key twice (etcd refuses a txn that names a key in
/// two operations; an event's records key follows from its claim key, so comparing the claim
/// keys is enough).
struct Batch {
    lease: i64,
    settles: Vec<RemoteSettle>,
}

impl Batch {
    fn takes(&self, settle: &RemoteSettle, lease: i64) -> bool {
        let Some(first) = self.settles.first() else {
            return false;
        };
        lease == self.lease
            && first.cluster == settle.cluster
            && first.timeout_ms == settle.timeout_ms
            && self.settles.len() < MAX_SETTLES_PER_TXN
            && !self.settles.iter().any(|s| s.claim.0 == settle.claim.0)
    }
}

/// At configure time: the etcd store's lease kinds of `config`; the leases are granted by the
/// timer. (Not here: Envoy's main-thread VM is configured before its clusters are ready, and
/// refuses a call to any cluster then, known or not; so a cluster Envoy does not have cannot
/// be told at configure time, and is reported by the timer instead.)
pub fn prepare(remote: &mut Remote, config: &Config) {
    let Some(dedupe) = &config.dedupe else {
        return;
    };
    if !matches!(dedupe.store, Store::Etcd(_)) {
        return;
    }
    let longest = config
        .channels
        .iter()
        .flat_map(|c| &c.subscribers)
        .map(|s| s.worst_case_ms())
        .max()
        .unwrap_or(0);
    let families = vec![
        Family::for_horizon(dedupe.ttl_ms),
        Family::for_horizon(longest.saturating_add(CLAIM_MARGIN_MS)),
    ];
    remote.configure(families);
}

/// The root context's timer (the root is the current context): the leases due, the settles
/// owed. Nothing unless `config` uses the etcd store.
pub fn tick<H: Host>(
    host: &H,
    now: u64,
    config: Option<&Config>,
    remote: &mut Remote,
    telemetry: &RefCell<Telemetry>,
) {
    let Some(Store::Etcd(store)) = config.and_then(|c| c.dedupe.as_ref()).map(|d| &d.store) else {
        return;
    };
    if let Err(Failure::DispatchError { detail }) = remote.grant(host, now, store) {
        if remote.warn(now).is_some() {
            log::error!(
                "dedupe.store.etcd.cluster: Envoy refused a call to \"{}\" ({detail}); \
                 every event is treated as a store error (on_store_error)",
                store.cluster
            );
        }
    }
    let failed = remote.send_settles(host, now).counted;
    if failed > 0 {
        if let Ok(mut telemetry) = telemetry.try_borrow_mut() {
            for _ in 0..failed {
                telemetry.tally.dedupe_store_error();
                telemetry.tally.owed(-1);
            }
        }
    }
}

/// An answer delivered to the root context: taken if it is one of the etcd store's calls (a
/// lease grant, a settle), and false if it is not.
pub fn on_response<H: Host>(
    host: &H,
    token: u32,
    num_headers: usize,
    body_size: usize,
    remote: &mut Remote,
    telemetry: &RefCell<Telemetry>,
) -> bool {
    let answered = remote.on_response(
        token,
        || etcd_reply(host, num_headers, body_size),
        || host.now_ms(),
    );
    let (counted, failed) = match answered {
        None => return false,
        Some(Answered::Grant) => return true,
        Some(Answered::Settles { counted, failed }) => (counted, failed),
    };
    if counted > 0 {
        if let Ok(mut telemetry) = telemetry.try_borrow_mut() {
            for _ in 0..counted {
                telemetry.tally.owed(-1);
                if failed {
                    telemetry.tally.dedupe_store_error();
                }
            }
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settle(event: &str, cluster: &str) -> RemoteSettle {
        RemoteSettle {
            cluster: cluster.into(),
            timeout_ms: 250,
            claim: (format!("{event}/c").into_bytes(), "c".into()),
            records: Some((format!("{event}/d").into_bytes(), "d".into())),
            until_ms: 0,
            log_id: 1,
            metrics: true,
        }
    }

    #[test]
    fn a_batch_takes_the_same_lease_and_cluster_no_key_twice_and_at_most_126_settles() {
        let batch = Batch {
            lease: 7,
            settles: vec![settle("a", "etcd")],
        };
        assert!(batch.takes(&settle("b", "etcd"), 7));
        assert!(!batch.takes(&settle("b", "etcd"), 8), "another lease");
        assert!(!batch.takes(&settle("b", "other"), 7), "another cluster");
        assert!(!batch.takes(&settle("a", "etcd"), 7), "a's keys twice");
        let full = |n: usize| Batch {
            lease: 7,
            settles: (0..n).map(|i| settle(&format!("e{i}"), "etcd")).collect(),
        };
        assert!(full(125).takes(&settle("x", "etcd"), 7), "the 126th");
        assert!(!full(126).takes(&settle("x", "etcd"), 7), "a 127th");
    }
}
