//! FanoutChannel status: what Knative's controller reads to turn Subscriptions Ready. The
//! pure half, [`desired`], says what a channel's status is from the channel, what is served
//! for it and what every connected Envoy has ACKed; [`super::Writer`] (one replica at a time, by
//! [`super::lease`]) writes it when it differs, and keeps each channel's
//! `<name>-kn-channel` Service and Knative's `subscribable` annotation.

use super::crd::{Addressable, Condition, FanoutChannel, FanoutChannelStatus, SubscriberStatus};
use crate::model::Problem;
use crate::render::{ServedChannel, Serving};
use serde_json::Value;
use std::collections::BTreeSet;

/// Everything one channel's status is decided from.
pub struct Observed<'a> {
    pub channel: &'a FanoutChannel,
    /// The problems of this generation of the channel, as the mapper reports them.
    pub problems: &'a [Problem],
    /// What is served for it now.
    pub served: Option<&'a ServedChannel>,
    /// Whether what is served is what this generation maps to.
    pub served_is_current: bool,
    /// The ledger's report of the channel (`/state`'s `channels.<name>`).
    pub report: &'a Value,
    /// The Envoys connected now, by node id.
    pub connected: &'a BTreeSet<String>,
    /// `spec.delivery.deadLetterSink` resolved, or why it is not.
    pub dead_letter: Option<Result<String, String>>,
    /// RFC 3339, for the conditions that change now.
    pub now: &'a str,
}

/// The value at `path` in `value`, or null.
pub fn at<'a>(value: &'a Value, path: &[&str]) -> &'a Value {
    static NULL: Value = Value::Null;
    path.iter()
        .try_fold(value, |v, key| v.get(key))
        .unwrap_or(&NULL)
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

/// Whether the Envoys serve the channel as it is now: (status, reason, message).
fn dispatcher(o: &Observed) -> (&'static str, &'static str, String) {
    if o.connected.is_empty() {
        let message = "no fanout Envoy is connected to fanout-control".to_owned();
        return ("False", "NoEnvoys", message);
    }
    if !o.served_is_current || o.served.is_none_or(|s| s.serving != Serving::Current) {
        let message = "this generation is not served yet".to_owned();
        return ("Unknown", "Pending", message);
    }
    let state = |node: &String| {
        at(o.report, &["envoys", node, "state"])
            .as_str()
            .unwrap_or("behind")
    };
    let nacked: Vec<&String> = o
        .connected
        .iter()
        .filter(|n| state(n) == "nacked")
        .collect();
    if !nacked.is_empty() {
        let message = format!("refused by {nacked:?}: see fanout-control's /state");
        return ("False", "EnvoyRefused", message);
    }
    let current = o.connected.iter().filter(|n| state(n) == "current").count();
    if current < o.connected.len() {
        let message = format!(
            "{current} of {} connected Envoys serve it",
            o.connected.len()
        );
        return ("Unknown", "EnvoysBehind", message);
    }
    ("True", "", String::new())
}

/// Each subscriber of `spec.subscribers`: ready once every connected Envoy serves it.
fn subscribers(o: &Observed, channel_problems: &[&Problem]) -> Vec<SubscriberStatus> {
    let live_on = |uri: &str| -> BTreeSet<String> {
        let entries = at(o.report, &["subscribers"])
            .as_array()
            .cloned()
            .unwrap_or_default();
        let entry = entries.iter().find(|s| at(s, &["uri"]) == uri);
        let nodes = entry.and_then(|e| at(e, &["live_on"]).as_array().cloned());
        let nodes = nodes.unwrap_or_default();
        nodes
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect()
    };
    let (dispatcher, _, why) = dispatcher(o);
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
            let uri = s.subscriber_uri.as_deref().unwrap_or_default();
            let (ready, message) = if !own.is_empty() || !channel_problems.is_empty() {
                let mut all = own;
                all.extend(channel_problems);
                ("False", words(&all))
            } else if dispatcher == "True" && o.connected.is_subset(&live_on(uri)) {
                ("True", String::new())
            } else if dispatcher == "True" {
                (
                    "Unknown",
                    "not every connected Envoy calls it yet".to_owned(),
                )
            } else {
                ("Unknown", why.clone())
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
    use crate::model::ChannelSpec;
    use serde_json::json;

    fn channel() -> FanoutChannel {
        serde_json::from_value(json!({
            "apiVersion": "messaging.fanout.dev/v1alpha1", "kind": "FanoutChannel",
            "metadata": { "name": "orders", "namespace": "shop", "generation": 3 },
            "spec": { "subscribers": [
                { "uid": "a", "generation": 1, "subscriberUri": "http://a.shop/" },
                { "uid": "b", "generation": 2, "subscriberUri": "http://b.shop/" } ] }
        }))
        .unwrap()
    }

    fn served() -> ServedChannel {
        ServedChannel {
            serving: Serving::Current,
            spec: ChannelSpec::default(),
            digest: "d".into(),
            problems: Vec::new(),
            warnings: Vec::new(),
        }
    }

    fn decide(report: Value, connected: &[&str], problems: &[Problem]) -> FanoutChannelStatus {
        let channel = channel();
        let served = served();
        let connected = connected.iter().map(|s| (*s).to_owned()).collect();
        desired(&Observed {
            channel: &channel,
            problems,
            served: Some(&served),
            served_is_current: true,
            report: &report,
            connected: &connected,
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

    #[test]
    fn a_subscriber_is_ready_once_every_connected_envoy_has_it_live() {
        let report = json!({
            "envoys": { "e1": { "state": "current" }, "e2": { "state": "current" } },
            "subscribers": [ { "uri": "http://a.shop/", "live_on": ["e1", "e2"] },
                             { "uri": "http://b.shop/", "live_on": ["e1"] } ]
        });
        let status = decide(report, &["e1", "e2"], &[]);
        assert_eq!(ready(&status, "a"), ("True".into(), Some(1)));
        assert_eq!(ready(&status, "b"), ("Unknown".into(), Some(2)));
        assert_eq!(status.observed_generation, Some(3));
        let url = "http://orders-kn-channel.shop.svc.cluster.local";
        assert_eq!(status.address.unwrap().url.as_deref(), Some(url));
        let types: Vec<(&str, &str)> = status
            .conditions
            .iter()
            .map(|c| (c.type_.as_str(), c.status.as_str()))
            .collect();
        assert_eq!(
            types,
            [
                ("Ready", "True"),
                ("Addressable", "True"),
                ("DispatcherReady", "True")
            ]
        );
    }

    #[test]
    fn no_envoy_or_a_problem_is_never_ready() {
        let report = json!({ "subscribers": [ { "uri": "http://a.shop/", "live_on": ["e1"] } ] });
        let status = decide(report.clone(), &[], &[]);
        assert_eq!(ready(&status, "a").0, "Unknown");
        let reason = status.conditions[0].reason.as_deref();
        assert_eq!(
            (status.conditions[0].status.as_str(), reason),
            ("False", Some("NoEnvoys"))
        );
        let problem = Problem::new(
            "FanoutChannel shop/orders",
            "spec.subscribers[1].subscriberUri",
            "bad",
        );
        let status = decide(report, &["e1"], &[problem]);
        assert_eq!(ready(&status, "b").0, "False");
        let message = status.subscribers[1].message.clone().unwrap();
        assert!(
            message.contains("spec.subscribers[1].subscriberUri: bad"),
            "{message}"
        );
        assert_eq!(status.conditions[0].reason.as_deref(), Some("InvalidSpec"));
    }
}
