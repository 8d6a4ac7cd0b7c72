//! One writer among the replicas: a `coordination.k8s.io` Lease. A replica holds it while it
//! renews it within its duration; another takes it over only once it has expired. Every
//! change is a replace at the read resourceVersion, so two replicas never both win.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, PostParams};
use std::time::Duration;

/// How long a holder that stopped renewing keeps the lease.
pub const DURATION: Duration = Duration::from_secs(10);
/// How often the holder renews it (and the others look whether it expired).
pub const RENEW: Duration = Duration::from_secs(2);

/// What `me` writes into the lease as it is at `now`, or None when another holds it.
pub fn next_spec(current: Option<&LeaseSpec>, me: &str, now: Timestamp) -> Option<LeaseSpec> {
    let seconds = i32::try_from(DURATION.as_secs()).unwrap_or(i32::MAX);
    let fresh = LeaseSpec {
        holder_identity: Some(me.to_owned()),
        lease_duration_seconds: Some(seconds),
        acquire_time: Some(MicroTime(now)),
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(0),
        ..LeaseSpec::default()
    };
    let Some(current) = current else {
        return Some(fresh);
    };
    let holder = current.holder_identity.as_deref().filter(|h| !h.is_empty());
    if holder == Some(me) {
        return Some(LeaseSpec {
            renew_time: Some(MicroTime(now)),
            lease_duration_seconds: Some(seconds),
            ..current.clone()
        });
    }
    let duration =
        SignedDuration::from_secs(i64::from(current.lease_duration_seconds.unwrap_or(seconds)));
    let expired = holder.is_none()
        || current
            .renew_time
            .as_ref()
            .is_none_or(|renewed| renewed.0.saturating_add(duration).unwrap_or(renewed.0) < now);
    expired.then(|| LeaseSpec {
        lease_transitions: Some(current.lease_transitions.unwrap_or(0).saturating_add(1)),
        ..fresh
    })
}

/// The lease `name` in the namespace of `api`, held as `identity`.
pub struct Elector {
    pub api: Api<Lease>,
    pub name: String,
    pub identity: String,
}

impl Elector {
    /// Take or renew the lease: whether this replica holds it now.
    pub async fn hold(&self) -> bool {
        let current = match self.api.get_opt(&self.name).await {
            Ok(current) => current,
            Err(e) => {
                log::warn!("lease {}: cannot read it: {e}", self.name);
                return false;
            }
        };
        let Some(spec) = next_spec(
            current.as_ref().and_then(|l| l.spec.as_ref()),
            &self.identity,
            Timestamp::now(),
        ) else {
            return false;
        };
        let written = match current {
            Some(mut lease) => {
                lease.spec = Some(spec);
                self.api
                    .replace(&self.name, &PostParams::default(), &lease)
                    .await
            }
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.name.clone()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(spec),
                };
                self.api.create(&PostParams::default(), &lease).await
            }
        };
        match written {
            Ok(_) => true,
            // Another replica wrote it first.
            Err(kube::Error::Api(status)) if status.code == 409 => false,
            Err(e) => {
                log::warn!("lease {}: cannot write it: {e}", self.name);
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + seconds).unwrap()
    }

    #[test]
    fn a_lease_is_taken_when_free_or_expired_and_kept_by_renewing() {
        let mine = next_spec(None, "a", at(0)).unwrap();
        assert_eq!(mine.holder_identity.as_deref(), Some("a"));
        // Another replica waits while it is renewed within its duration.
        assert_eq!(next_spec(Some(&mine), "b", at(9)), None);
        let renewed = next_spec(Some(&mine), "a", at(9)).unwrap();
        assert_eq!(renewed.acquire_time, mine.acquire_time);
        assert_eq!(renewed.renew_time, Some(MicroTime(at(9))));
        assert_eq!(next_spec(Some(&renewed), "b", at(18)), None);
        // Not renewed for longer than its duration: taken over.
        let taken = next_spec(Some(&renewed), "b", at(20)).unwrap();
        assert_eq!(taken.holder_identity.as_deref(), Some("b"));
        assert_eq!(taken.lease_transitions, Some(1));
        assert_eq!(taken.acquire_time, Some(MicroTime(at(20))));
    }
}
