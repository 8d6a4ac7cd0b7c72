//! What a replica's connected Envoys serve, per channel: the pure half of readiness across
//! replicas. Each replica sums up its own Envoys ([`local`]) into a [`Report`] it publishes
//! ([`super::reports`]); the Lease holder decides a subscriber Ready only when the Envoys
//! of every fresh report serve it ([`super::status`]). A subscriber is named by a key that
//! every replica computes alike from what it serves ([`subscriber_key`]), so a report says
//! "this exact subscriber", not just "this URI".
//!
//! Deliberately not here: talking to the API (reports.rs) and deciding statuses (status.rs).

use crate::model::SubscriberSpec;
use crate::render::{digest, Served, Serving};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

/// What the connected Envoys of one replica have of one channel.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Acked {
    /// How many of them have the channel at each digest (as served by some version).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub digests: BTreeMap<String, u32>,
    /// How many refused the version that serves it now.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub refused: u32,
    /// The subscribers (by [`subscriber_key`]) every one of them calls.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub subscribers: BTreeSet<String>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// One replica's report: its connected Envoys and what they all have, by channel.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    pub envoys: u32,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub channels: BTreeMap<String, Acked>,
}

/// A subscriber of `channel` as served: the same on every replica that serves it alike.
pub fn subscriber_key(channel: &str, subscriber: &SubscriberSpec) -> String {
    let config = serde_json::to_string(&subscriber.config).unwrap_or_default();
    digest(&format!("{channel}\n{}\n{config}", subscriber.uri))
}

/// One channel in one served version: its digest and its subscribers (key, URI).
#[derive(Debug, Default, PartialEq)]
struct ChannelVersion {
    digest: String,
    subscribers: Vec<(String, String)>,
}

/// The served versions this replica has seen (by filter version), as far as the status
/// needs them: which channel digest and which subscribers each one serves.
#[derive(Default)]
pub struct Versions {
    by_version: BTreeMap<String, Arc<BTreeMap<String, ChannelVersion>>>,
    order: VecDeque<String>,
}

/// Versions kept besides those some Envoy has.
const KEPT: usize = 16;

impl Versions {
    /// Remember what `served` serves (once per version).
    pub fn record(&mut self, served: &Served) {
        if self.by_version.contains_key(&served.ecds_version) {
            return;
        }
        let channels = served
            .channels
            .iter()
            .filter(|(_, c)| c.serving != Serving::NotServed)
            .map(|(name, c)| {
                let subscribers = c
                    .spec
                    .subscribers
                    .iter()
                    .map(|s| (subscriber_key(name, s), s.uri.clone()))
                    .collect();
                let version = ChannelVersion {
                    digest: c.digest.clone(),
                    subscribers,
                };
                (name.clone(), version)
            })
            .collect();
        self.by_version
            .insert(served.ecds_version.clone(), Arc::new(channels));
        self.order.push_back(served.ecds_version.clone());
    }

    /// Forget old versions, keeping those in `keep` (what the Envoys have).
    fn prune(&mut self, keep: &BTreeSet<&str>) {
        let mut excess = self.order.len().saturating_sub(KEPT);
        let by_version = &mut self.by_version;
        self.order.retain(|version| {
            if excess == 0 || keep.contains(version.as_str()) {
                return true;
            }
            excess -= 1;
            by_version.remove(version);
            false
        });
    }
}

/// The value at `path` in `value`, or null.
pub fn at<'a>(value: &'a Value, path: &[&str]) -> &'a Value {
    static NULL: Value = Value::Null;
    path.iter()
        .try_fold(value, |v, key| v.get(key))
        .unwrap_or(&NULL)
}

/// This replica's report, from the ledger's (`/state`'s) report: for each connected Envoy,
/// the channel as the version it ACKed has it; a subscriber counts where that version has
/// it and the Envoy has its clusters (the ledger's `live_on`).
pub fn local(ledger: &Value, versions: &mut Versions) -> Report {
    let empty = serde_json::Map::new();
    let envoys = at(ledger, &["envoys"]).as_object().unwrap_or(&empty);
    let connected: Vec<(&String, &str)> = envoys
        .iter()
        .filter(|(_, e)| at(e, &["streams"]).as_u64().unwrap_or(0) > 0)
        .map(|(node, e)| {
            let acked = at(e, &["filter", "acked"]).as_str().unwrap_or_default();
            (node, acked)
        })
        .collect();
    versions.prune(&connected.iter().map(|(_, v)| *v).collect());
    let mut report = Report {
        envoys: u32::try_from(connected.len()).unwrap_or(u32::MAX),
        channels: BTreeMap::new(),
    };
    if connected.is_empty() {
        return report;
    }
    let channels = at(ledger, &["channels"]).as_object().unwrap_or(&empty);
    for (name, channel) in channels {
        let acked = channel_acked(name, channel, &connected, versions);
        if acked != Acked::default() {
            report.channels.insert(name.clone(), acked);
        }
    }
    report
}

/// One channel over the connected Envoys (node, the filter version it ACKed).
fn channel_acked(
    name: &str,
    channel: &Value,
    connected: &[(&String, &str)],
    versions: &Versions,
) -> Acked {
    let live_on = |uri: &str, node: &str| {
        at(channel, &["subscribers"])
            .as_array()
            .and_then(|subs| subs.iter().find(|s| at(s, &["uri"]) == uri))
            .and_then(|s| at(s, &["live_on"]).as_array())
            .is_some_and(|nodes| nodes.iter().any(|n| n == node))
    };
    let mut acked = Acked::default();
    let mut common: Option<BTreeSet<String>> = None;
    for (node, version) in connected {
        if at(channel, &["envoys", node, "state"]) == "nacked" {
            acked.refused += 1;
        }
        let has = versions.by_version.get(*version).and_then(|v| v.get(name));
        if let Some(has) = has {
            *acked.digests.entry(has.digest.clone()).or_default() += 1;
        }
        let calls: BTreeSet<String> = has
            .map(|h| h.subscribers.as_slice())
            .unwrap_or_default()
            .iter()
            .filter(|(_, uri)| live_on(uri, node))
            .map(|(key, _)| key.clone())
            .collect();
        common = Some(match common {
            None => calls,
            Some(before) => before.intersection(&calls).cloned().collect(),
        });
    }
    acked.subscribers = common.unwrap_or_default();
    acked
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ChannelSpec, SubscriberSpec};
    use crate::render::ServedChannel;
    use fanout::config::{RawSubscriber, RawTarget};
    use serde_json::json;

    fn subscriber(uri: &str, timeout_ms: u32) -> SubscriberSpec {
        SubscriberSpec {
            uri: uri.to_owned(),
            config: RawSubscriber::from(RawTarget {
                cluster: format!("c-{uri}"),
                timeout_ms: Some(timeout_ms),
                ..RawTarget::default()
            }),
            object: String::new(),
            field: String::new(),
        }
    }

    fn served(version: &str, subscribers: Vec<SubscriberSpec>) -> Served {
        let channel = ServedChannel {
            serving: Serving::Current,
            spec: ChannelSpec {
                subscribers,
                ..ChannelSpec::default()
            },
            digest: format!("digest-{version}"),
            problems: Vec::new(),
            warnings: Vec::new(),
        };
        Served::of_channels([("shop/orders".to_owned(), channel)].into(), version)
    }

    fn ledger(envoys: &[(&str, &str)], live_on: &[(&str, &[&str])]) -> Value {
        let envoys: serde_json::Map<String, Value> = envoys
            .iter()
            .map(|(n, v)| {
                (
                    (*n).to_owned(),
                    json!({ "streams": 1, "filter": { "acked": v } }),
                )
            })
            .collect();
        let subscribers: Vec<Value> = live_on
            .iter()
            .map(|(uri, nodes)| json!({ "uri": uri, "live_on": nodes }))
            .collect();
        json!({ "envoys": envoys,
                "channels": { "shop/orders": { "subscribers": subscribers, "envoys": {} } } })
    }

    /// A subscriber counts only where the version an Envoy ACKed has it as it is now: the
    /// same URI with another configuration is another subscriber.
    #[test]
    fn a_subscriber_counts_where_every_envoys_version_has_it_as_it_is() {
        let (a1, a2, b) = (
            subscriber("http://a/", 100),
            subscriber("http://a/", 200),
            subscriber("http://b/", 100),
        );
        let mut versions = Versions::default();
        versions.record(&served("v1", vec![a1.clone()]));
        versions.record(&served("v2", vec![a2.clone(), b.clone()]));
        let key = |s: &SubscriberSpec| subscriber_key("shop/orders", s);
        assert_ne!(key(&a1), key(&a2));

        // e1 has v2, e2 still v1: only what both call is common, and nothing is.
        let live = [("http://a/", &["e1", "e2"][..]), ("http://b/", &["e1"][..])];
        let report = local(&ledger(&[("e1", "v2"), ("e2", "v1")], &live), &mut versions);
        assert_eq!(report.envoys, 2);
        let acked = &report.channels["shop/orders"];
        assert_eq!(acked.subscribers, BTreeSet::new());
        let digests: Vec<(&str, u32)> = acked
            .digests
            .iter()
            .map(|(d, n)| (d.as_str(), *n))
            .collect();
        assert_eq!(digests, [("digest-v1", 1), ("digest-v2", 1)]);

        // Both on v2, b's clusters not yet on e2: a2 only.
        let report = local(&ledger(&[("e1", "v2"), ("e2", "v2")], &live), &mut versions);
        let acked = &report.channels["shop/orders"];
        assert_eq!(acked.subscribers, [key(&a2)].into());
    }

    /// No Envoy: nothing to report but that; a version this replica never saw counts for
    /// nothing.
    #[test]
    fn without_envoys_or_a_known_version_nothing_is_served() {
        let mut versions = Versions::default();
        let report = local(&ledger(&[], &[]), &mut versions);
        assert_eq!(report, Report::default());
        let report = local(
            &ledger(&[("e1", "v9")], &[("http://a/", &["e1"])]),
            &mut versions,
        );
        assert_eq!(report.envoys, 1);
        assert!(report.channels.is_empty(), "{report:?}");
    }
}
