//! Readiness across replicas, after Istio's distribution reports: every replica publishes
//! what its connected Envoys serve ([`super::acks::Report`]) as a ConfigMap named after it in
//! the Lease's namespace, when it changes (at most every [`MIN_INTERVAL`]) and at least
//! every [`HEARTBEAT`]; the Lease holder watches them all and counts those renewed within
//! [`FRESH`], so a replica that is gone stops counting after that, and deletes those not
//! renewed for [`FORGET`].

use super::acks::Report;
use super::watch::Retry;
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, ResourceExt};
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A report unchanged is renewed this often.
pub const HEARTBEAT: Duration = Duration::from_secs(3);
/// A report not renewed for this long is not counted (its replica is gone).
pub const FRESH: Duration = Duration::from_secs(10);
/// A changed report is written at most this often.
const MIN_INTERVAL: Duration = Duration::from_millis(250);
/// A report not renewed for this long is deleted by the Lease holder.
const FORGET: Duration = Duration::from_secs(300);
/// The label every report carries (what the holder watches).
const LABEL: &str = "messaging.fanout.dev/replica-report";
/// When the replica last renewed its report (RFC 3339).
const RENEWED: &str = "messaging.fanout.dev/renewed";
/// The report itself, JSON.
const DATA: &str = "report.json";

/// The report's name: `<lease>-<identity>` as a DNS subdomain.
pub fn name(lease: &str, identity: &str) -> String {
    let raw = format!("{lease}-{identity}").to_ascii_lowercase();
    let name: String = raw
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '-' | '.' => c,
            _ => '-',
        })
        .take(253)
        .collect();
    name.trim_matches(|c| c == '-' || c == '.').to_owned()
}

/// Whether a report renewed at `renewed` (RFC 3339) is younger than `within` at `now`.
fn younger(renewed: Option<&str>, now: Timestamp, within: Duration) -> bool {
    let within = SignedDuration::try_from(within).unwrap_or(SignedDuration::MAX);
    renewed
        .and_then(|r| r.parse::<Timestamp>().ok())
        .is_some_and(|at| at.saturating_add(within).is_ok_and(|until| now < until))
}

/// This replica's report, written when due.
pub struct Publisher {
    api: Api<ConfigMap>,
    name: String,
    /// What was last written, and when.
    last: Option<(Report, Instant)>,
    failing: bool,
}

impl Publisher {
    pub fn new(client: Client, namespace: &str, name: String) -> Publisher {
        Publisher {
            api: Api::namespaced(client, namespace),
            name,
            last: None,
            failing: false,
        }
    }

    /// Write `report` if it changed (and the last write is [`MIN_INTERVAL`] old) or the
    /// last write is [`HEARTBEAT`] old.
    pub async fn publish(&mut self, report: &Report) {
        let due = self.last.as_ref().is_none_or(|(last, at)| {
            (last != report && at.elapsed() >= MIN_INTERVAL) || at.elapsed() >= HEARTBEAT
        });
        if !due {
            return;
        }
        let renewed = Timestamp::now().to_string();
        let body = json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {
                "name": self.name,
                "labels": { LABEL: "true", "app.kubernetes.io/name": "fanout-control" },
                "annotations": { RENEWED: renewed },
            },
            "data": { DATA: serde_json::to_string(report).unwrap_or_default() },
        });
        let params = PatchParams::apply("fanout-control").force();
        let written = self
            .api
            .patch(&self.name, &params, &Patch::Apply(&body))
            .await;
        match written {
            Ok(_) => {
                if std::mem::take(&mut self.failing) {
                    log::info!("replica report {}: written again", self.name);
                }
                self.last = Some((report.clone(), Instant::now()));
            }
            Err(e) => {
                if !std::mem::replace(&mut self.failing, true) {
                    log::warn!(
                        "replica report {}: cannot write it ({e}); the status writer does not \
                         count this replica's Envoys until it can",
                        self.name
                    );
                }
                // Tried again after MIN_INTERVAL.
                let retry = Instant::now().checked_sub(HEARTBEAT - MIN_INTERVAL);
                self.last = retry.map(|at| (report.clone(), at));
            }
        }
    }
}

/// Every replica's report, as watched.
pub struct Reports {
    api: Api<ConfigMap>,
    store: Store<ConfigMap>,
    /// Reports read, by name: the resourceVersion read and what it says.
    parsed: BTreeMap<String, (String, Option<Arc<Report>>)>,
    last_forget: Instant,
}

impl Reports {
    /// Watch the reports in `namespace`.
    pub fn watch(client: Client, namespace: &str) -> Reports {
        let api: Api<ConfigMap> = Api::namespaced(client, namespace);
        let cache = reflector::store::Writer::<ConfigMap>::default();
        let store = cache.as_reader();
        let config = watcher::Config::default().labels(&format!("{LABEL}=true"));
        let stream = watcher(api.clone(), config).backoff(Retry::default());
        tokio::spawn(reflector::reflector(cache, stream).for_each(|_| async {}));
        Reports {
            api,
            store,
            parsed: BTreeMap::new(),
            last_forget: Instant::now(),
        }
    }

    /// The reports renewed within [`FRESH`] at `now`, but `own`'s.
    pub fn fresh(&mut self, own: &str, now: Timestamp) -> Vec<Arc<Report>> {
        let mut fresh = Vec::new();
        let mut seen = Vec::new();
        for map in self.store.state() {
            let name = map.name_any();
            let renewed = map.annotations().get(RENEWED).map(String::as_str);
            if name == own || !younger(renewed, now, FRESH) {
                continue;
            }
            let version = map.resource_version().unwrap_or_default();
            let known = self.parsed.get(&name).filter(|(v, _)| *v == version);
            let report = match known {
                Some((_, report)) => report.clone(),
                None => {
                    let text = map.data.as_ref().and_then(|d| d.get(DATA));
                    let report = text.and_then(|t| match serde_json::from_str::<Report>(t) {
                        Ok(report) => Some(Arc::new(report)),
                        Err(e) => {
                            log::warn!("replica report {name}: {DATA}: {e}; not counted");
                            None
                        }
                    });
                    self.parsed.insert(name.clone(), (version, report.clone()));
                    report
                }
            };
            fresh.extend(report);
            seen.push(name);
        }
        self.parsed.retain(|name, _| seen.contains(name));
        fresh
    }

    /// Delete the reports not renewed for [`FORGET`] (a minute apart at most).
    pub async fn forget_gone(&mut self, now: Timestamp) {
        if self.last_forget.elapsed() < Duration::from_secs(60) {
            return;
        }
        self.last_forget = Instant::now();
        for map in self.store.state() {
            let renewed = map.annotations().get(RENEWED).map(String::as_str);
            if younger(renewed, now, FORGET) {
                continue;
            }
            let name = map.name_any();
            match self.api.delete(&name, &DeleteParams::default()).await {
                Ok(_) => log::info!("replica report {name}: deleted (not renewed for {FORGET:?})"),
                Err(e) => log::warn!("replica report {name}: cannot delete it: {e}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_counts_while_renewed_within_its_freshness() {
        let at = |s: i64| Timestamp::from_second(1_800_000_000 + s).unwrap();
        let renewed = at(0).to_string();
        assert!(younger(Some(&renewed), at(9), FRESH));
        assert!(!younger(Some(&renewed), at(11), FRESH));
        assert!(!younger(None, at(0), FRESH));
        assert!(!younger(Some("yesterday"), at(0), FRESH));
    }

    #[test]
    fn a_reports_name_is_a_dns_subdomain() {
        assert_eq!(
            name("fanout-control", "Fanout_Control-7f9c-1234"),
            "fanout-control-fanout-control-7f9c-1234"
        );
    }
}
