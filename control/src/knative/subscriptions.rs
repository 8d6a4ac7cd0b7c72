//! Who gets a channel's events: the entries of its `spec.subscribers` (what Knative's
//! dispatcher delivers to) and the Subscriptions of the input it does not list yet, each
//! with its reply and delivery, as the filter's subscribers.

use super::delivery::{channel_delivery, map_delivery, resolved_dead_letter, Delivery};
use super::objects::{text, Group, KObject};
use super::uris::{parse_uri, target, Reply, Source};
use super::{destination, warnings, Report};
use crate::model::{ChannelSpec, Problem, SubscriberSpec};
use fanout::config::{RawSubscriber, RawTarget};
use serde_json::Value;
use std::collections::BTreeMap;

/// The channel's `spec.subscribers`: what Knative's dispatcher delivers to.
pub(super) fn channel_subscribers(
    group: &Group,
    spec: &mut ChannelSpec,
    listed: &mut Listed,
    report: &mut Report,
) {
    for member in &group.members {
        let Some(entries) = member.at(&["spec", "subscribers"]) else {
            continue;
        };
        let Some(entries) = entries.as_array() else {
            let problem = Problem::new(&member.label, "spec.subscribers", "is not a list");
            report.channel(&group.name, problem);
            continue;
        };
        for (i, entry) in entries.iter().enumerate() {
            let at = format!("spec.subscribers[{i}]");
            if !list(listed, member, entry, &at) {
                continue; // the same Subscription, listed by the Channel and its backing channel
            }
            let Some(uri) = text(entry, &["subscriberUri"]) else {
                let problem = Problem::new(
                    &member.label,
                    &format!("{at}.subscriberUri"),
                    no_subscriber_uri(entry),
                );
                report.channel(&group.name, problem);
                continue;
            };
            // Knative's reconciler has put the resolved dead letter into the entry's delivery.
            let delivery = match entry.get("delivery") {
                Some(d) => Some((d, member.label.clone(), format!("{at}.delivery"), None)),
                None => channel_delivery(group, report),
            };
            let reply = text(entry, &["replyUri"])
                .map(|u| (u, format!("{at}.replyUri"), text(entry, &["replyCACerts"])));
            let source = Source {
                channel: &group.name,
                object: &member.label,
            };
            warnings::subscriber_entry(report, &source, &at, entry);
            let ca = text(entry, &["subscriberCACerts"]);
            let uri_field = format!("{at}.subscriberUri");
            if let Some(sub) = subscriber(
                &source,
                (&uri, &uri_field, ca),
                reply,
                delivery,
                spec,
                report,
            ) {
                spec.subscribers.push(sub);
            }
        }
    }
}

/// Record the Subscription a channel's subscriber entry stands for; false when it is listed
/// already.
fn list(listed: &mut Listed, member: &KObject, entry: &Value, at: &str) -> bool {
    let uid = text(entry, &["uid"]).map(|u| format!("uid:{u}"));
    if uid.as_ref().is_some_and(|u| listed.contains_key(u)) {
        return false;
    }
    let place = (
        text(entry, &["subscriberUri"]).unwrap_or_default(),
        format!("{} {at}.subscriberUri", member.label),
    );
    if let Some(name) = text(entry, &["name"]) {
        let namespace = text(entry, &["namespace"]).unwrap_or(member.namespace.clone());
        listed.insert(format!("name:{namespace}/{name}"), place.clone());
    }
    if let Some(uid) = uid {
        listed.insert(uid, place);
    }
    true
}

/// A Subscription the channel's `spec.subscribers` does not list (yet), as Knative's
/// reconciler will add it.
pub(super) fn attach_subscription(
    sub: &KObject,
    groups: &[Group],
    specs: &mut BTreeMap<String, ChannelSpec>,
    seen_uids: &BTreeMap<String, Listed>,
    report: &mut Report,
) {
    let Some(group) = subscription_channel(sub, groups, report) else {
        return;
    };
    let by_uid = sub.uid.as_ref().map(|u| format!("uid:{u}"));
    let by_name = format!("name:{}/{}", sub.namespace, sub.name);
    let listed_as = seen_uids.get(&group.name).and_then(|listed| {
        by_uid
            .and_then(|k| listed.get(&k))
            .or_else(|| listed.get(&by_name))
    });
    if let Some((listed_uri, listed_at)) = listed_as {
        differs_from_listed(sub, &group.name, listed_uri, listed_at, report);
        return;
    }
    let Some(spec) = specs.get_mut(&group.name) else {
        return;
    };
    let source = Source {
        channel: &group.name,
        object: &sub.label,
    };
    warnings::subscription(report, &source, &sub.doc);
    let Some((uri, uri_field, ca)) = subscription_uri(sub, "subscriber") else {
        let (field, message) = match sub.at(&["spec", "subscriber"]) {
            None | Some(Value::Null) => (
                "spec.subscriber".to_owned(),
                "missing: the Knative spec requires a subscriber, and fanout has no reply-only \
                 subscriber"
                    .to_owned(),
            ),
            destination => destination::unresolved(
                destination,
                &sub.namespace,
                "spec.subscriber",
                "status.physicalSubscription.subscriberUri",
            ),
        };
        report.channel(&group.name, Problem::new(&sub.label, &field, message));
        return;
    };
    let reply = subscription_uri(sub, "reply");
    let delivery = subscription_delivery(sub, group, &source, report);
    if let Some(mapped) = subscriber(
        &source,
        (&uri, &uri_field, ca),
        reply,
        delivery,
        spec,
        report,
    ) {
        spec.subscribers.push(mapped);
    }
}

/// A Subscription's `role` (subscriber, reply): its URI as Knative resolved it (else the
/// spec's absolute one), the field it is read from, and its CA certificates.
fn subscription_uri(sub: &KObject, role: &str) -> Option<Reply> {
    let physical = |field: &str| {
        text(
            &sub.doc,
            &["status", "physicalSubscription", &format!("{role}{field}")],
        )
    };
    let (uri, field) = physical("Uri")
        .map(|u| (u, format!("status.physicalSubscription.{role}Uri")))
        .or_else(|| {
            text(&sub.doc, &["spec", role, "uri"]).map(|u| (u, format!("spec.{role}.uri")))
        })?;
    let ca = physical("CACerts").or_else(|| text(&sub.doc, &["spec", role, "CACerts"]));
    Some((uri, field, ca))
}

/// A Subscription's own delivery, or else its channel's, with the dead letter Knative
/// resolved into its `status.physicalSubscription`.
fn subscription_delivery<'a>(
    sub: &'a KObject,
    group: &'a Group,
    source: &Source,
    report: &mut Report,
) -> Delivery<'a> {
    let physical_path = ["status", "physicalSubscription"];
    let dead_letter = resolved_dead_letter(&sub.doc, &physical_path, source, report);
    match sub.at(&["spec", "delivery"]) {
        Some(d) => {
            let at = "spec.delivery".to_owned();
            Some((d, sub.label.clone(), at, dead_letter))
        }
        None => channel_delivery(group, report).map(|(d, object, at, channel_dead_letter)| {
            (d, object, at, dead_letter.or(channel_dead_letter))
        }),
    }
}

/// The Subscriptions a channel's `spec.subscribers` lists, by `uid:UID` and
/// `name:NAMESPACE/NAME`: the entry's subscriberUri and where it is written.
pub(super) type Listed = BTreeMap<String, (String, String)>;

/// A Subscription the channel lists whose resolved URI is not the one listed: the listed one
/// is what Knative's dispatcher calls, and so does fanout.
fn differs_from_listed(
    sub: &KObject,
    channel: &str,
    listed_uri: &str,
    listed_at: &str,
    report: &mut Report,
) {
    let field = "status.physicalSubscription.subscriberUri";
    let Some(physical) = text(
        &sub.doc,
        &["status", "physicalSubscription", "subscriberUri"],
    ) else {
        return;
    };
    let call = |u: &str| parse_uri(u).ok().map(|u| (u.authority, u.path));
    if call(&physical).is_some() && call(&physical) != call(listed_uri) {
        let message =
            format!("differs from {listed_at}, which Knative's dispatcher uses and so does fanout");
        report.warn(Some(channel), Problem::new(&sub.label, field, message));
    }
}

/// The fanout channel a Subscription's `spec.channel` names, or a problem.
fn subscription_channel<'a>(
    sub: &KObject,
    groups: &'a [Group],
    report: &mut Report,
) -> Option<&'a Group> {
    let kind = text(&sub.doc, &["spec", "channel", "kind"]).unwrap_or("Channel".into());
    let ns = text(&sub.doc, &["spec", "channel", "namespace"]).unwrap_or(sub.namespace.clone());
    let Some(name) = text(&sub.doc, &["spec", "channel", "name"]) else {
        let problem = Problem::new(&sub.label, "spec.channel", "missing or without a name");
        report.other.push(problem);
        return None;
    };
    let group = groups.iter().find(|g| g.has(&kind, &ns, &name));
    if group.is_none() {
        // A channel missing beside others of its namespace would lose this subscriber; one of
        // a namespace the source leaves out is somebody else's.
        let beside = groups
            .iter()
            .any(|g| g.members.iter().any(|m| m.namespace == ns));
        if beside && matches!(kind.as_str(), "Channel" | "InMemoryChannel") {
            let message = format!(
                "{kind} {ns}/{name} is not in the input, though other channels of namespace \
                 {ns} are: its subscriber would be left out. Add the channel, or leave the \
                 Subscription out of the input"
            );
            report
                .other
                .push(Problem::new(&sub.label, "spec.channel", message));
        } else {
            let message =
                format!("{kind} {ns}/{name} is not in the input; the Subscription is not imported");
            report.warn(None, Problem::new(&sub.label, "spec.channel", message));
        }
    }
    group
}

/// Why a channel's subscriber entry without a `subscriberUri` cannot be delivered to.
fn no_subscriber_uri(entry: &Value) -> String {
    let why = if text(entry, &["replyUri"]).is_some() {
        "the subscriber has only a replyUri: Knative's dispatcher cannot deliver to it either, \
         and fanout has no reply-only subscriber"
    } else {
        "no URI to deliver to"
    };
    let name = text(entry, &["name"]).unwrap_or_else(|| "unnamed".into());
    format!("missing ({name}): {why}")
}

fn subscriber(
    source: &Source,
    (uri, field, ca): (&str, &str, Option<String>),
    reply: Option<Reply>,
    delivery: Delivery,
    spec: &mut ChannelSpec,
    report: &mut Report,
) -> Option<SubscriberSpec> {
    let before = report.by_channel.get(source.channel).map_or(0, Vec::len);
    let mut config = RawSubscriber::from(target(source, uri, field, ca, spec, report)?);
    if let Some((value, object, at, dead_letter)) = delivery {
        let here = Source {
            channel: source.channel,
            object: &object,
        };
        (config.delivery, config.timeout_ms) =
            map_delivery(&here, (value, &at, dead_letter), spec, report);
    }
    if let Some((reply_uri, reply_field, reply_ca)) = reply {
        let reply_target = target(source, &reply_uri, &reply_field, reply_ca, spec, report)?;
        config.reply = Some(RawTarget {
            timeout_ms: config.timeout_ms,
            ..reply_target
        });
    }
    let after = report.by_channel.get(source.channel).map_or(0, Vec::len);
    // A channel's entry is charged as a whole (`spec.subscribers[0]`), a Subscription by
    // its spec.
    let entry = field.strip_suffix(".subscriberUri").unwrap_or("spec");
    (after == before).then(|| SubscriberSpec {
        uri: uri.to_owned(),
        config,
        object: source.object.to_owned(),
        field: entry.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use crate::knative::tests::{channel, map};
    use serde_json::json;

    #[test]
    fn subscriptions_join_their_channel_once() {
        let sub = |name: &str, uid: &str, channel: &str| {
            json!({
                "apiVersion": "messaging.knative.dev/v1", "kind": "Subscription",
                "metadata": { "name": name, "namespace": "default", "uid": uid },
                "spec": { "channel": { "apiVersion": "messaging.knative.dev/v1", "kind": "InMemoryChannel", "name": channel },
                          "subscriber": { "uri": format!("http://{name}.example/") } }
            })
        };
        let snapshot = map(vec![
            channel(
                "orders",
                json!([{ "uid": "listed", "subscriberUri": "http://listed.example/" }]),
            ),
            sub("listed", "listed", "orders"),
            sub("new", "new", "orders"),
            sub("lost", "lost", "nowhere"),
        ]);
        let uris: Vec<_> = snapshot.channels["default/orders"]
            .spec
            .subscribers
            .iter()
            .map(|s| s.uri.clone())
            .collect();
        assert_eq!(uris, vec!["http://listed.example/", "http://new.example/"]);
        assert_eq!(snapshot.problems.len(), 1);
        assert_eq!(snapshot.problems[0].object, "Subscription default/lost");
    }
}
