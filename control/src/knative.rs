//! Knative objects (as `kubectl get -o yaml|json` prints them) -> fanout channels: the pure
//! mapping, with each problem charged to the channel it concerns, for the server and for
//! `fanout-control render` alike: Channels and InMemoryChannels matched by the hosts of their addresses, their `spec.subscribers` and the Subscriptions of the
//! input, deliveries (retries, backoff, timeout, dead letter, format), replies, and with
//! OIDC (the server's `--oidc-issuer`) the EventPolicies: who may send ([`policy`]).
//!
//! A problem does not stop the rest: it is reported for its channel (the server keeps serving
//! that channel's last good version; render writes nothing) and every other channel is mapped.
//! A warning says what is served differently from Knative: the channel is served. Without
//! OIDC, an EventPolicy is a problem for each channel of its namespace: serving the channel
//! without its sender checks would let every sender send.

mod delivery;
mod destination;
mod duration;
mod hosts;
mod objects;
mod policy;
mod subscriptions;
mod uris;
mod warnings;

use crate::model::{ChannelMapping, ChannelSpec, MapOptions, Problem, Snapshot};
use hosts::channel_hosts;
use objects::{group_channels, sort_objects, Group, KObject};
use serde_json::Value;
use std::collections::BTreeMap;
use subscriptions::{attach_subscription, channel_subscribers, Listed};
use uris::{check_tls, TlsUse};

pub use objects::objects_of;
// What the submodules share (warnings.rs, policy.rs).
use objects::{dig, text};
use uris::Source;

const MESSAGING: &str = "messaging.knative.dev";
const EVENTING: &str = "eventing.knative.dev";
/// fanout's own channel kind, FanoutChannel (crate::kubernetes::crd).
const FANOUT: &str = "messaging.fanout.dev";
/// The channel kinds served at their conventional host `<name>-kn-channel.<namespace>...`.
const CONVENTIONAL_HOST: [&str; 2] = ["InMemoryChannel", "FanoutChannel"];
/// The problems and warnings charged so far, by channel (`other`: of no channel).
#[derive(Default)]
struct Report {
    by_channel: BTreeMap<String, Vec<Problem>>,
    other: Vec<Problem>,
    warnings: BTreeMap<String, Vec<Problem>>,
    other_warnings: Vec<Problem>,
    /// By https cluster: the targets that name CA certificates (with them) and the first
    /// that names none, as (channel, object, field).
    tls: BTreeMap<String, TlsUse>,
}

impl Report {
    fn channel(&mut self, channel: &str, problem: Problem) {
        let list = self.by_channel.entry(channel.to_owned()).or_default();
        if !list.contains(&problem) {
            list.push(problem);
        }
    }

    /// A warning: what is served differs from what Knative does; the channel is served.
    fn warn(&mut self, channel: Option<&str>, warning: Problem) {
        let list = match channel {
            Some(channel) => self.warnings.entry(channel.to_owned()).or_default(),
            None => &mut self.other_warnings,
        };
        if !list.contains(&warning) {
            list.push(warning);
        }
    }
}

/// Map Knative objects to the channels fanout serves.
pub fn map(options: &MapOptions, documents: Vec<Value>) -> Snapshot {
    let mut report = Report::default();
    let (channels, subscriptions, policies) = sort_objects(documents, &mut report);
    let groups = group_channels(channels);
    let mut specs: BTreeMap<String, ChannelSpec> = BTreeMap::new();
    let mut seen_uids: BTreeMap<String, Listed> = BTreeMap::new();
    for group in &groups {
        let mut spec = ChannelSpec {
            hosts: channel_hosts(group, options, &mut report),
            ..ChannelSpec::default()
        };
        let uids = seen_uids.entry(group.name.clone()).or_default();
        channel_subscribers(group, &mut spec, uids, &mut report);
        specs.insert(group.name.clone(), spec);
    }
    for sub in &subscriptions {
        attach_subscription(sub, &groups, &mut specs, &seen_uids, &mut report);
    }
    check_tls(&mut report);
    match options.senders {
        Some(mode) => {
            for (name, senders) in policy::senders(&groups, &policies, mode, &mut report) {
                if let Some(spec) = specs.get_mut(&name) {
                    spec.senders = Some(senders);
                }
            }
        }
        None => unchecked_policies(&groups, &policies, &mut report),
    }
    let channels = specs
        .into_iter()
        .map(|(name, spec)| {
            let problems = report.by_channel.remove(&name).unwrap_or_default();
            let warnings = report.warnings.remove(&name).unwrap_or_default();
            let object = groups
                .iter()
                .find(|g| g.name == name)
                .map_or_else(|| name.clone(), |g| g.primary.label.clone());
            let mapping = ChannelMapping {
                object,
                spec,
                problems,
                warnings,
            };
            (name, mapping)
        })
        .collect();
    Snapshot {
        channels,
        problems: report.other,
        warnings: report.other_warnings,
    }
}

/// Without OIDC, an EventPolicy is a problem for every channel of its namespace.
fn unchecked_policies(groups: &[Group], policies: &[KObject], report: &mut Report) {
    for policy in policies {
        for group in groups
            .iter()
            .filter(|g| g.primary.namespace == policy.namespace)
        {
            report.channel(
                &group.name,
                Problem::new(
                    &policy.label,
                    "kind",
                    "EventPolicy: who may send is enforced only with --oidc-issuer (and \
                     --jwks); without it every sender could send",
                ),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    pub(super) fn map(documents: Vec<Value>) -> Snapshot {
        super::map(&MapOptions::default(), documents)
    }

    pub(super) fn channel(name: &str, subscribers: Value) -> Value {
        json!({
            "apiVersion": "messaging.knative.dev/v1", "kind": "InMemoryChannel",
            "metadata": { "name": name, "namespace": "default" },
            "spec": { "subscribers": subscribers },
            "status": { "address": { "url": format!("http://{name}-kn-channel.default.svc.cluster.local") } }
        })
    }

    #[test]
    fn channels_subscribers_and_clusters() {
        let snapshot = map(vec![channel(
            "orders",
            json!([{ "uid": "a", "subscriberUri": "http://billing.default.svc.cluster.local/events",
                     "delivery": { "retry": 3, "backoffPolicy": "exponential", "backoffDelay": "PT0.2S",
                                   "timeout": "PT2S",
                                   "deadLetterSink": { "uri": "https://dlq.example.com:8443/x" } } },
                   { "uid": "b", "subscriberUri": "http://127.0.0.1:9000", "replyUri": "http://127.0.0.1:9001/r" }]),
        )]);
        let orders = &snapshot.channels["default/orders"];
        assert_eq!(orders.problems, vec![]);
        assert_eq!(
            orders.spec.hosts,
            vec!["orders-kn-channel.default.svc.cluster.local"]
        );
        let first = serde_json::to_value(&orders.spec.subscribers[0].config).unwrap();
        assert_eq!(
            first["cluster"],
            "http|billing.default.svc.cluster.local|80"
        );
        assert_eq!(first["path"], "/events");
        assert_eq!(first["timeout_ms"], 2000);
        assert_eq!(first["delivery"]["backoff_delay_ms"], 100);
        assert_eq!(first["delivery"]["backoff_max_ms"], 800);
        assert_eq!(
            first["delivery"]["dead_letter"]["cluster"],
            "https|dlq.example.com|8443"
        );
        assert_eq!(first["delivery"]["dead_letter"]["timeout_ms"], 2000);
        let second = serde_json::to_value(&orders.spec.subscribers[1].config).unwrap();
        assert_eq!(second["authority"], "127.0.0.1:9000");
        assert_eq!(second["reply"]["path"], "/r");
        let names: Vec<_> = orders.spec.clusters.keys().cloned().collect();
        assert_eq!(names.len(), 4);
        assert!(orders.spec.clusters["https|dlq.example.com|8443"].tls);
    }

    #[test]
    fn a_bad_object_is_charged_to_its_channel_only() {
        let snapshot = map(vec![
            channel("good", json!([{ "subscriberUri": "http://a.example/" }])),
            channel(
                "bad",
                json!([{ "subscriberUri": "ftp://a.example/" },
                                  { "subscriberUri": "http://b.example/", "delivery": { "retries": 2 } }]),
            ),
        ]);
        assert!(snapshot.channels["default/good"].problems.is_empty());
        let bad = &snapshot.channels["default/bad"].problems;
        assert_eq!(bad.len(), 2, "{bad:?}");
        assert_eq!(bad[0].field, "spec.subscribers[0].subscriberUri");
        assert!(bad[0].message.contains("http and https"), "{bad:?}");
        assert_eq!(bad[1].field, "spec.subscribers[1].delivery.retries");
    }

    /// The import's warnings, one per kind: each names its object and field, and the
    /// channel is served (warnings are not problems).
    #[test]
    fn what_is_served_unlike_knative_is_a_warning_and_the_channel_is_served() {
        let mut orders = channel(
            "orders",
            json!([
                { "subscriberUri": "http://a.example/", "subscriberAudience": "a-aud",
                  "auth": { "serviceAccountName": "orders-oidc" },
                  "delivery": { "retry": 2, "backoffPolicy": "exponential", "retryAfterMax": "PT0S" } },
                { "subscriberUri": "http://b.example/",
                  "delivery": { "retry": 3, "backoffPolicy": "linear", "backoffDelay": "PT1S",
                                "retryAfterMax": "PT2S" } },
                { "subscriberUri": "https://c.example/", "subscriberCACerts": "CA-1" },
                { "subscriberUri": "https://c.example/x", "subscriberCACerts": "CA-2" },
                { "subscriberUri": "https://c.example/y" }
            ]),
        );
        orders["status"]["address"] = json!({ "url": "https://orders.example", "audience": "o" });
        let mut bare = channel("bare", json!([{ "subscriberUri": "http://d.example/" }]));
        bare["status"] = json!({});
        let broker = json!({ "apiVersion": "eventing.knative.dev/v1", "kind": "Broker",
                             "metadata": { "name": "b", "namespace": "default" } });
        let snapshot = map(vec![orders.clone(), orders, bare, broker]);
        let fields = |channel: &str| -> Vec<String> {
            let mapping = &snapshot.channels[channel];
            assert!(mapping.problems.is_empty(), "{:?}", mapping.problems);
            mapping.warnings.iter().map(|w| w.field.clone()).collect()
        };
        let orders = fields("default/orders");
        for field in [
            "status.address.audience",
            "status.address.url",
            "spec.subscribers[0].subscriberAudience",
            "spec.subscribers[0].auth",
            "spec.subscribers[0].delivery.backoffPolicy",
            "spec.subscribers[0].delivery.retryAfterMax",
            "spec.subscribers[1].delivery.retryAfterMax",
            "spec.subscribers[2].subscriberUri",
            "spec.subscribers[4].subscriberUri",
        ] {
            assert!(orders.contains(&field.to_owned()), "{field}: {orders:?}");
        }
        assert_eq!(orders.len(), 9, "{orders:?}");
        assert_eq!(fields("default/bare"), vec!["status.address.url"]);
        assert_eq!(
            snapshot.channels["default/bare"].spec.hosts,
            vec!["bare-kn-channel.default.svc.cluster.local"]
        );
        let other: Vec<_> = snapshot
            .warnings
            .iter()
            .map(|w| (w.object.as_str(), w.field.as_str()))
            .collect();
        assert_eq!(
            other,
            vec![
                ("InMemoryChannel default/orders", "metadata"),
                ("Broker default/b", "kind")
            ]
        );
    }

    /// Dead letters and CA certificates as Knative resolved them into the statuses, and a
    /// Subscription the channel lists (by uid or name) joined once, warned when its resolved
    /// URI is not the listed one.
    #[test]
    fn what_knative_resolved_into_statuses_is_used() {
        let mut orders = channel(
            "orders",
            json!([{ "uid": "u1", "subscriberUri": "http://listed.example/" },
                   { "name": "by-name", "subscriberUri": "http://named.example/" }]),
        );
        orders["spec"]["delivery"] = json!({ "retry": 1,
            "deadLetterSink": { "ref": { "kind": "Service", "name": "dlq" } } });
        orders["status"]["deadLetterSinkUri"] = json!("http://dlq.default.svc.cluster.local/");
        let sub = |name: &str, uid: &str, status: Value| {
            json!({
                "apiVersion": "messaging.knative.dev/v1", "kind": "Subscription",
                "metadata": { "name": name, "namespace": "default", "uid": uid },
                "spec": { "channel": { "apiVersion": "messaging.knative.dev/v1",
                                       "kind": "InMemoryChannel", "name": "orders" },
                          "subscriber": { "ref": { "kind": "Service", "name": name } },
                          "delivery": { "deadLetterSink": { "ref": { "kind": "Service", "name": "x" } } } },
                "status": { "physicalSubscription": status }
            })
        };
        let snapshot = map(vec![
            orders,
            sub(
                "listed",
                "u1",
                json!({ "subscriberUri": "http://moved.example/" }),
            ),
            sub(
                "by-name",
                "u2",
                json!({ "subscriberUri": "http://named.example/" }),
            ),
            sub(
                "new",
                "u3",
                json!({ "subscriberUri": "https://new.example/", "subscriberCACerts": "CA",
                        "deadLetterSinkUri": "http://sub-dlq.example/" }),
            ),
        ]);
        let orders = &snapshot.channels["default/orders"];
        assert!(orders.problems.is_empty(), "{:?}", orders.problems);
        let configs: Vec<Value> = orders
            .spec
            .subscribers
            .iter()
            .map(|s| serde_json::to_value(&s.config).unwrap())
            .collect();
        assert_eq!(configs.len(), 3, "{configs:?}");
        assert_eq!(
            configs[0]["delivery"]["dead_letter"]["cluster"],
            "http|dlq.default.svc.cluster.local|80"
        );
        assert_eq!(configs[2]["cluster"], "https|new.example|443");
        assert_eq!(
            configs[2]["delivery"]["dead_letter"]["cluster"],
            "http|sub-dlq.example|80"
        );
        assert_eq!(
            orders.spec.clusters["https|new.example|443"].ca_certs,
            vec!["CA"]
        );
        let warned: Vec<_> = orders
            .warnings
            .iter()
            .map(|w| (w.object.as_str(), w.field.as_str()))
            .collect();
        assert_eq!(
            warned,
            vec![(
                "Subscription default/listed",
                "status.physicalSubscription.subscriberUri"
            )]
        );
    }
}
