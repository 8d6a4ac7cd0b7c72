//! FanoutChannel status: what Knative's controller reads to turn Subscriptions Ready. The
//! pure half, [`desired`], says what a channel's status is from the channel, what is served
//! for it and what the connected Envoys of every replica serve ([`super::acks`]);
//! [`super::Writer`] (one replica at a time, by [`super::lease`]) writes it when it
//! differs, and keeps each channel's `<name>-kn-channel` Service and Knative's
//! `subscribable` annotation.
//!
//! A subscriber is Ready when what is served calls it as this generation says and every
//! connected Envoy (of any replica) has ACKed a version that calls it so: a change to
//! another subscriber, or another subscriber's problem, leaves it Ready.

use super::acks::{subscriber_key, Acked};
use super::crd::{Addressable, Condition, FanoutChannel, FanoutChannelStatus, SubscriberStatus};
use crate::model::{ChannelSpec, Problem};
use crate::render::{ServedChannel, Serving};
use std::collections::BTreeSet;

/// What the Envoys connected to one replica have of the channel (from its fresh report).
#[derive(Debug)]
pub struct Fleet<'a> {
    pub envoys: u32,
    /// None: none of them has any version of it.
    pub acked: Option<&'a Acked>,
}

/// Everything one channel's status is decided from.
pub struct Observed<'a> {
    pub channel: &'a FanoutChannel,
    /// The problems of this generation of the channel, as the mapper reports them.
    pub problems: &'a [Problem],
    /// What this generation maps to (the channel mapped on its own).
    pub mapped: Option<&'a ChannelSpec>,
    /// What is served for it now.
    pub served: Option<&'a ServedChannel>,
    /// Whether what is served is what this generation maps to.
    pub served_is_current: bool,
    /// Each replica's Envoys (this one's and those of every fresh report).
    pub fleets: &'a [Fleet<'a>],
    /// `spec.delivery.deadLetterSink` resolved, or why it is not.
    pub dead_letter: Option<Result<String, String>>,
    /// RFC 3339, for the conditions that change now.
    pub now: &'a str,
}

/// `http://<name>-kn-channel.<namespace>.svc.cluster.local`.
pub fn address(name: &str, namespace: &str) -> String {
    format!("http://{name}-kn-channel.{namespace}.svc.cluster.local")
}

fn condition(type_: &str, status: &str, reason: &str, message: String) -> Condition {
    Condition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: (!reason.is_empty()).then(|| reason.to_owned()),
        message: (!message.is_empty()).then_some(message),
        ..Condition::default()
    }
}

fn words(problems: &[&Problem]) -> String {
    let each: Vec<String> = problems
        .iter()
        .map(|p| format!("{}: {}", p.field, p.message))
        .collect();
    each.join("; ")
}

/// The Envoys connected to any replica.
fn envoys(o: &Observed) -> u32 {
    o.fleets.iter().map(|f| f.envoys).sum()
}

/// Whether the Envoys serve the channel as it is now: (status, reason, message).
fn dispatcher(o: &Observed) -> (&'static str, &'static str, String) {
    let envoys = envoys(o);
    if envoys == 0 {
        let message = "no fanout Envoy is connected to fanout-control".to_owned();
        return ("False", "NoEnvoys", message);
    }
    let Some(served) = o
        .served
        .filter(|s| o.served_is_current && s.serving == Serving::Current)
    else {
        let message = "this generation is not served yet".to_owned();
        return ("Unknown", "Pending", message);
    };
    let acked = o.fleets.iter().filter_map(|f| f.acked);
    let refused: u32 = acked.clone().map(|a| a.refused).sum();
    if refused > 0 {
        let message =
            format!("refused by {refused} connected Envoy(s): see fanout-control's /state");
        return ("False", "EnvoyRefused", message);
    }
    let current: u32 = acked.filter_map(|a| a.digests.get(&served.digest)).sum();
    if current < envoys {
        let message = format!("{current} of {envoys} connected Envoys serve it");
        return ("Unknown", "EnvoysBehind", message);
    }
    ("True", "", String::new())
}

/// Whether subscriber `key` is served on every connected Envoy: (ready, message).
fn called_everywhere(o: &Observed, key: &str) -> (&'static str, String) {
    if envoys(o) == 0 {
        let message = "no fanout Envoy is connected to fanout-control".to_owned();
        return ("Unknown", message);
    }
    let everywhere = o
        .fleets
        .iter()
        .filter(|f| f.envoys > 0)
        .all(|f| f.acked.is_some_and(|a| a.subscribers.contains(key)));
    if everywhere {
        ("True", String::new())
    } else {
        let message = "not every connected Envoy calls it yet".to_owned();
        ("Unknown", message)
    }
}

/// Each subscriber of `spec.subscribers`: ready once every connected Envoy calls it as it is.
fn subscribers(o: &Observed, channel_problems: &[&Problem]) -> Vec<SubscriberStatus> {
    let meta = &o.channel.metadata;
    let name = format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or_default(),
        meta.name.as_deref().unwrap_or_default()
    );
    let served: BTreeSet<String> = o
        .served
        .filter(|s| s.serving != Serving::NotServed)
        .map(|s| s.spec.subscribers.iter())
        .into_iter()
        .flatten()
        .map(|s| subscriber_key(&name, s))
        .collect();
    let spec = &o.channel.spec.subscribers;
    spec.iter()
        .enumerate()
        .map(|(i, s)| {
            let at = format!("spec.subscribers[{i}]");
            let own: Vec<&Problem> = o
                .problems
                .iter()
                .filter(|p| p.field.starts_with(&at))
                .collect();
            let mapped = o
                .mapped
                .and_then(|m| m.subscribers.iter().find(|s| s.field == at));
            let key = mapped.map(|m| subscriber_key(&name, m));
            let (ready, message) = if !own.is_empty() || !channel_problems.is_empty() {
                let mut all = own;
                all.extend(channel_problems);
                ("False", words(&all))
            } else if let Some(key) = key.filter(|k| served.contains(k)) {
                called_everywhere(o, &key)
            } else if !o.problems.is_empty() {
                let all: Vec<&Problem> = o.problems.iter().collect();
                let message = format!(
                    "not served until the channel's other subscribers are fixed: {}",
                    words(&all)
                );
                ("False", message)
            } else {
                ("Unknown", "this generation is not served yet".to_owned())
            };
            SubscriberStatus {
                uid: s.uid.clone(),
                observed_generation: s.generation,
                ready: Some(ready.to_owned()),
                message: (!message.is_empty()).then_some(message),
                auth: None,
            }
        })
        .collect()
}

/// The status the channel should have (conditions keep their transition time while their
/// status holds).
pub fn desired(o: &Observed) -> FanoutChannelStatus {
    let meta = &o.channel.metadata;
    let name = meta.name.as_deref().unwrap_or_default();
    let namespace = meta.namespace.as_deref().unwrap_or_default();
    let url = address(name, namespace);
    let subscriber_field = |p: &&Problem| p.field.starts_with("spec.subscribers[");
    let channel_problems: Vec<&Problem> =
        o.problems.iter().filter(|p| !subscriber_field(p)).collect();
    let (status, reason, message) = dispatcher(o);
    let mut conditions = vec![
        condition("Addressable", "True", "", String::new()),
        condition("DispatcherReady", status, reason, message.clone()),
    ];
    let dead_letter = o.dead_letter.clone();
    let ready = if !o.problems.is_empty() {
        let all: Vec<&Problem> = o.problems.iter().collect();
        condition("Ready", "False", "InvalidSpec", words(&all))
    } else if let Some(Err(why)) = &dead_letter {
        condition("Ready", "False", "DeadLetterSinkResolveFailed", why.clone())
    } else {
        condition("Ready", status, reason, message)
    };
    conditions.insert(0, ready);
    let previous = o
        .channel
        .status
        .as_ref()
        .map(|s| s.conditions.as_slice())
        .unwrap_or_default();
    for c in &mut conditions {
        let kept = previous
            .iter()
            .find(|p| p.type_ == c.type_ && p.status == c.status);
        c.last_transition_time = kept
            .and_then(|p| p.last_transition_time.clone())
            .or_else(|| Some(o.now.to_owned()));
    }
    let addressable = Addressable {
        name: Some("http".to_owned()),
        url: Some(url.clone()),
        ..Addressable::default()
    };
    FanoutChannelStatus {
        observed_generation: meta.generation,
        conditions,
        address: Some(Addressable {
            url: Some(url),
            ..Addressable::default()
        }),
        addresses: vec![addressable],
        subscribers: subscribers(o, &channel_problems),
        dead_letter_sink_uri: dead_letter.and_then(Result::ok),
        ..FanoutChannelStatus::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::SubscriberSpec;
    use fanout::config::{RawSubscriber, RawTarget};
    use serde_json::{json, Value};

    fn channel(uris: &[&str]) -> FanoutChannel {
        let subscribers: Vec<Value> = uris
            .iter()
            .enumerate()
            .map(|(i, uri)| json!({ "uid": format!("u{i}"), "generation": i + 1, "subscriberUri": uri }))
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "messaging.fanout.dev/v1alpha1", "kind": "FanoutChannel",
            "metadata": { "name": "orders", "namespace": "shop", "generation": 3 },
            "spec": { "subscribers": subscribers }
        }))
        .unwrap()
    }

    /// Entry `i` as the mapper has it.
    fn mapped(i: usize, uri: &str) -> SubscriberSpec {
        SubscriberSpec {
            uri: uri.to_owned(),
            config: RawSubscriber::from(RawTarget {
                cluster: format!("c-{uri}"),
                ..RawTarget::default()
            }),
            object: "FanoutChannel shop/orders".to_owned(),
            field: format!("spec.subscribers[{i}]"),
        }
    }

    fn spec(subscribers: Vec<SubscriberSpec>) -> ChannelSpec {
        ChannelSpec {
            subscribers,
            ..ChannelSpec::default()
        }
    }

    fn served(serving: Serving, subscribers: Vec<SubscriberSpec>) -> ServedChannel {
        ServedChannel {
            serving,
            spec: spec(subscribers),
            digest: "d".into(),
            problems: Vec::new(),
            warnings: Vec::new(),
        }
    }

    fn key(s: &SubscriberSpec) -> String {
        subscriber_key("shop/orders", s)
    }

    /// What `envoys` Envoys of one replica have: all at digest `d`, calling `calls`.
    fn acked(envoys: u32, calls: &[&SubscriberSpec]) -> Acked {
        Acked {
            digests: [("d".to_owned(), envoys)].into(),
            refused: 0,
            subscribers: calls.iter().map(|s| key(s)).collect(),
        }
    }

    struct Case<'a> {
        channel: FanoutChannel,
        problems: &'a [Problem],
        mapped: ChannelSpec,
        served: ServedChannel,
        served_is_current: bool,
    }

    fn decide(case: &Case, fleets: &[(u32, Option<&Acked>)]) -> FanoutChannelStatus {
        let fleets: Vec<Fleet> = fleets
            .iter()
            .map(|(envoys, acked)| Fleet {
                envoys: *envoys,
                acked: *acked,
            })
            .collect();
        desired(&Observed {
            channel: &case.channel,
            problems: case.problems,
            mapped: Some(&case.mapped),
            served: Some(&case.served),
            served_is_current: case.served_is_current,
            fleets: &fleets,
            dead_letter: None,
            now: "2026-01-01T00:00:00Z",
        })
    }

    fn ready(status: &FanoutChannelStatus, uid: &str) -> (String, Option<i64>) {
        let entry = status
            .subscribers
            .iter()
            .find(|s| s.uid.as_deref() == Some(uid));
        let entry = entry.unwrap();
        (entry.ready.clone().unwrap(), entry.observed_generation)
    }

    fn conditions(status: &FanoutChannelStatus) -> Vec<(&str, &str)> {
        status
            .conditions
            .iter()
            .map(|c| (c.type_.as_str(), c.status.as_str()))
            .collect()
    }

    fn both() -> Case<'static> {
        let (a, b) = (mapped(0, "http://a.shop/"), mapped(1, "http://b.shop/"));
        Case {
            channel: channel(&["http://a.shop/", "http://b.shop/"]),
            problems: &[],
            mapped: spec(vec![a.clone(), b.clone()]),
            served: served(Serving::Current, vec![a, b]),
            served_is_current: true,
        }
    }

    #[test]
    fn a_subscriber_is_ready_once_every_connected_envoy_calls_it() {
        let case = both();
        let (a, b) = (&case.mapped.subscribers[0], &case.mapped.subscribers[1]);
        let (all, only_a) = (acked(2, &[a, b]), acked(1, &[a]));
        let status = decide(&case, &[(2, Some(&all)), (1, Some(&only_a))]);
        assert_eq!(ready(&status, "u0"), ("True".into(), Some(1)));
        assert_eq!(ready(&status, "u1"), ("Unknown".into(), Some(2)));
        assert_eq!(status.observed_generation, Some(3));
        let url = "http://orders-kn-channel.shop.svc.cluster.local";
        assert_eq!(status.address.clone().unwrap().url.as_deref(), Some(url));
        assert_eq!(
            conditions(&status),
            [
                ("Ready", "True"),
                ("Addressable", "True"),
                ("DispatcherReady", "True")
            ]
        );
        // Another replica's Envoy has none of it: nothing is Ready, the dispatcher behind.
        let status = decide(&case, &[(2, Some(&all)), (1, None)]);
        assert_eq!(ready(&status, "u0").0, "Unknown");
        let reason = status.conditions[0].reason.as_deref();
        assert_eq!(reason, Some("EnvoysBehind"), "{status:?}");
        // A replica without Envoys does not count.
        let status = decide(&case, &[(2, Some(&all)), (0, None)]);
        assert_eq!(ready(&status, "u1").0, "True");
    }

    /// While another version of the channel is on its way, a subscriber every Envoy still
    /// calls as it is stays Ready.
    #[test]
    fn a_change_to_another_subscriber_leaves_one_ready() {
        let mut case = both();
        case.served_is_current = false;
        let a = case.mapped.subscribers[0].clone();
        let status = decide(&case, &[(1, Some(&acked(1, &[&a])))]);
        assert_eq!(ready(&status, "u0").0, "True");
        assert_eq!(ready(&status, "u1").0, "Unknown");
        assert_eq!(status.conditions[0].reason.as_deref(), Some("Pending"));
    }

    /// One subscriber fanout cannot call: False with its problem; the one served (the last
    /// good version) stays Ready; one added since is not served until the problem is gone.
    #[test]
    fn another_subscribers_problem_leaves_one_ready() {
        let uris = ["http://a.shop/", "ftp://bad.shop/", "http://c.shop/"];
        let (a, c) = (mapped(0, uris[0]), mapped(2, uris[2]));
        let problem = Problem::new(
            "FanoutChannel shop/orders",
            "spec.subscribers[1].subscriberUri",
            "bad",
        );
        let problems = [problem];
        let case = Case {
            channel: channel(&uris),
            problems: &problems,
            mapped: spec(vec![a.clone(), c]),
            served: served(Serving::LastGood, vec![a.clone()]),
            served_is_current: false,
        };
        let status = decide(&case, &[(1, Some(&acked(1, &[&a])))]);
        assert_eq!(ready(&status, "u0").0, "True");
        assert_eq!(ready(&status, "u1").0, "False");
        let message = status.subscribers[1].message.clone().unwrap();
        assert!(
            message.contains("spec.subscribers[1].subscriberUri: bad"),
            "{message}"
        );
        assert_eq!(ready(&status, "u2").0, "False");
        assert_eq!(status.conditions[0].reason.as_deref(), Some("InvalidSpec"));
    }

    #[test]
    fn no_envoy_or_a_channel_problem_is_never_ready() {
        let case = both();
        let status = decide(&case, &[]);
        assert_eq!(ready(&status, "u0").0, "Unknown");
        let reason = status.conditions[0].reason.as_deref();
        assert_eq!(
            (status.conditions[0].status.as_str(), reason),
            ("False", Some("NoEnvoys"))
        );
        let problems = [Problem::new(
            "FanoutChannel shop/orders",
            "spec.delivery",
            "bad",
        )];
        let case = Case {
            problems: &problems,
            ..both()
        };
        let a = case.mapped.subscribers[0].clone();
        let status = decide(&case, &[(1, Some(&acked(1, &[&a])))]);
        assert_eq!(ready(&status, "u0").0, "False");
        assert_eq!(status.conditions[0].reason.as_deref(), Some("InvalidSpec"));
    }
}
