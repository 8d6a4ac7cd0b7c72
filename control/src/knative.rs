//! Knative objects (as `kubectl get -o yaml|json` prints them) -> fanout channels: the pure
//! mapping, with each problem charged to the channel it concerns. The same mapping as
//! `envoy/knative-import.py` for what both carry over: Channels and InMemoryChannels matched
//! by the hosts of their addresses, their `spec.subscribers` and the Subscriptions of the
//! input, deliveries (retries, backoff, timeout, dead letter, format), replies, and with
//! OIDC (the server's `--oidc-issuer`) the EventPolicies: who may send ([`policy`]).
//!
//! Unlike the import, a problem does not stop the rest: it is reported for its channel (the
//! server keeps serving that channel's last good version) and every other channel is served.
//! What the import reports as a warning is a warning here too: the channel is served. Without
//! OIDC, an EventPolicy is a problem for each channel of its namespace: serving the channel
//! without its sender checks would let every sender send.

mod policy;
mod warnings;

use crate::model::{
    ChannelMapping, ChannelSpec, ClusterSpec, MapOptions, Problem, Snapshot, SubscriberSpec,
};
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, BTreeSet};

const MESSAGING: &str = "messaging.knative.dev";
const EVENTING: &str = "eventing.knative.dev";
/// fanout's own channel kind, FanoutChannel (crate::kubernetes::crd).
const FANOUT: &str = "messaging.fanout.dev";
/// The channel kinds served at their conventional host `<name>-kn-channel.<namespace>...`.
const CONVENTIONAL_HOST: [&str; 2] = ["InMemoryChannel", "FanoutChannel"];
/// fanout's limits (src/config): milliseconds are u32, retries at most 100.
const MAX_RETRY: u64 = 100;
const DELIVERY_FIELDS: [&str; 7] = [
    "deadLetterSink",
    "retry",
    "timeout",
    "backoffPolicy",
    "backoffDelay",
    "retryAfterMax",
    "format",
];

/// One Kubernetes object of the input.
#[derive(Clone, Debug)]
struct KObject {
    kind: String,
    group: String,
    namespace: String,
    name: String,
    uid: Option<String>,
    label: String,
    doc: Value,
}

impl KObject {
    fn new(doc: Value) -> KObject {
        let kind = text(&doc, &["kind"]).unwrap_or_default();
        let api_version = text(&doc, &["apiVersion"]).unwrap_or_default();
        let group = api_version.rsplit_once('/').map(|(g, _)| g.to_owned());
        let namespace = text(&doc, &["metadata", "namespace"]).unwrap_or_else(|| "default".into());
        let name = text(&doc, &["metadata", "name"]).unwrap_or_default();
        KObject {
            label: format!("{kind} {namespace}/{name}"),
            uid: text(&doc, &["metadata", "uid"]),
            kind,
            group: group.unwrap_or_default(),
            namespace,
            name,
            doc,
        }
    }

    fn at(&self, path: &[&str]) -> Option<&Value> {
        dig(&self.doc, path)
    }
}

fn dig<'a>(value: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter().try_fold(value, |v, key| v.get(key))
}

fn text(value: &Value, path: &[&str]) -> Option<String> {
    dig(value, path)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

/// Flatten documents (objects, `List`s, arrays) into the Kubernetes objects they hold.
pub fn objects_of(document: Value, out: &mut Vec<Value>) {
    match document {
        Value::Array(items) => items.into_iter().for_each(|d| objects_of(d, out)),
        Value::Object(mut fields) if fields.get("items").is_some_and(Value::is_array) => {
            if let Some(Value::Array(items)) = fields.remove("items") {
                items.into_iter().for_each(|d| objects_of(d, out));
            }
        }
        Value::Null => {}
        other => out.push(other),
    }
}

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

type Place = (String, String, String);

#[derive(Default)]
struct TlsUse {
    with_ca: Vec<(Place, String)>,
    without_ca: Option<Place>,
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
    check_hosts(&specs, &mut report);
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
            let mapping = ChannelMapping {
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
                    "EventPolicy: who may send is enforced only with --oidc-issuer; without \
                     it every sender could send, so the channels of its namespace stay as they \
                     were",
                ),
            );
        }
    }
}

type Sorted = (Vec<KObject>, Vec<KObject>, Vec<KObject>);

fn sort_objects(documents: Vec<Value>, report: &mut Report) -> Sorted {
    let (mut channels, mut subscriptions, mut policies) = (Vec::new(), Vec::new(), Vec::new());
    let mut seen = BTreeSet::new();
    for doc in documents {
        let obj = KObject::new(doc);
        let known = matches!(
            (obj.group.as_str(), obj.kind.as_str()),
            (MESSAGING, "Channel" | "InMemoryChannel" | "Subscription")
                | (EVENTING, "EventPolicy")
                | (FANOUT, "FanoutChannel")
        );
        if !known {
            if obj.at(&["spec", "subscribers"]).is_some() {
                report.other.push(Problem::new(
                    &obj.label,
                    "kind",
                    format!(
                        "{} ({}) is not a kind fanout serves (Channel, InMemoryChannel, \
                         FanoutChannel, Subscription): its subscribers get no events from fanout",
                        obj.kind, obj.group
                    ),
                ));
            } else {
                let group = if obj.group.is_empty() {
                    "core"
                } else {
                    &obj.group
                };
                let message = format!("{} ({group}) is not served; ignored", obj.kind);
                report.warn(None, Problem::new(&obj.label, "kind", message));
            }
            continue;
        }
        if obj.name.is_empty() {
            report
                .other
                .push(Problem::new(&obj.label, "metadata.name", "missing"));
            continue;
        }
        if !seen.insert((obj.kind.clone(), obj.namespace.clone(), obj.name.clone())) {
            let message = "listed twice in the source; the first is used";
            report.warn(None, Problem::new(&obj.label, "metadata", message));
            continue;
        }
        match obj.kind.as_str() {
            "Subscription" => subscriptions.push(obj),
            "EventPolicy" => policies.push(obj),
            _ => channels.push(obj),
        }
    }
    channels
        .sort_by(|a, b| (&a.namespace, &a.name, &a.kind).cmp(&(&b.namespace, &b.name, &b.kind)));
    subscriptions.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    (channels, subscriptions, policies)
}

/// A fanout channel: a Channel or InMemoryChannel, or a Channel with its backing channel.
struct Group {
    name: String,
    primary: KObject,
    /// The backing channel (what the dispatcher delivers from) first.
    members: Vec<KObject>,
}

impl Group {
    fn has(&self, kind: &str, namespace: &str, name: &str) -> bool {
        self.members
            .iter()
            .any(|m| m.kind == kind && m.namespace == namespace && m.name == name)
    }
}

fn group_channels(channels: Vec<KObject>) -> Vec<Group> {
    let backing_key = |c: &KObject| -> Option<(String, String, String)> {
        if c.kind != "Channel" {
            return None;
        }
        let kind = text(&c.doc, &["status", "channel", "kind"]).unwrap_or("InMemoryChannel".into());
        let ns = text(&c.doc, &["status", "channel", "namespace"]).unwrap_or(c.namespace.clone());
        let name = text(&c.doc, &["status", "channel", "name"]).unwrap_or(c.name.clone());
        Some((kind, ns, name))
    };
    let key = |c: &KObject| (c.kind.clone(), c.namespace.clone(), c.name.clone());
    let keys: BTreeSet<_> = channels.iter().map(key).collect();
    let backed: BTreeSet<_> = channels
        .iter()
        .filter_map(backing_key)
        .filter(|k| keys.contains(k))
        .collect();
    let mut groups = Vec::new();
    for obj in channels.iter().filter(|c| !backed.contains(&key(c))) {
        let mut members: Vec<KObject> = backing_key(obj)
            .and_then(|k| channels.iter().find(|c| key(c) == k))
            .into_iter()
            .cloned()
            .collect();
        members.push(obj.clone());
        groups.push(Group {
            name: format!("{}/{}", obj.namespace, obj.name),
            primary: obj.clone(),
            members,
        });
    }
    groups
}

fn channel_hosts(group: &Group, options: &MapOptions, report: &mut Report) -> Vec<String> {
    // Each host with whether a sender reaches it over plain http too.
    let mut hosts: Vec<(String, bool)> = Vec::new();
    for member in &group.members {
        let mut urls: Vec<String> = text(&member.doc, &["status", "address", "url"])
            .into_iter()
            .collect();
        if let Some(Value::Array(addresses)) = member.at(&["status", "addresses"]) {
            urls.extend(addresses.iter().filter_map(|a| text(a, &["url"])));
        }
        for url in urls {
            let Some(host) = url_host(&url) else { continue };
            let plain = !url.to_ascii_lowercase().starts_with("https://");
            match hosts.iter_mut().find(|(h, _)| *h == host) {
                Some((_, p)) => *p |= plain,
                None => hosts.push((host, plain)),
            }
        }
        let audience = text(&member.doc, &["status", "address", "audience"]);
        if let Some(audience) = audience.filter(|_| options.senders.is_none()) {
            let message = format!(
                "senders' OIDC tokens (audience {audience:?}) are not checked: run the server \
                 with --oidc-issuer to enforce who may send"
            );
            let warning = Problem::new(&member.label, "status.address.audience", message);
            report.warn(Some(&group.name), warning);
        }
    }
    for (host, _) in hosts.iter().filter(|(_, plain)| !plain) {
        let message = format!(
            "senders reach this channel over https ({host}); the bootstrap's listener is \
             plain HTTP: terminate TLS in front of it"
        );
        let warning = Problem::new(&group.primary.label, "status.address.url", message);
        report.warn(Some(&group.name), warning);
    }
    if !hosts.is_empty() {
        return hosts.into_iter().map(|(h, _)| h).collect();
    }
    if let Some(host) = conventional_host(group, report) {
        return vec![host];
    }
    report.channel(
        &group.name,
        Problem::new(
            &group.primary.label,
            "status.address.url",
            "missing, and the channel is not an InMemoryChannel whose conventional host could \
             stand in: fanout could not tell which requests are for it",
        ),
    );
    Vec::new()
}

/// `<name>-kn-channel.<namespace>.svc.cluster.local` for an InMemoryChannel (with a warning:
/// its address is missing) or a FanoutChannel (whose address that is by definition).
fn conventional_host(group: &Group, report: &mut Report) -> Option<String> {
    let name = in_memory_name(group)?;
    let host = format!(
        "{name}-kn-channel.{}.svc.cluster.local",
        group.primary.namespace
    );
    if group.members.iter().all(|m| m.kind != "FanoutChannel") {
        let message = format!("missing: matched by the InMemoryChannel's conventional host {host}");
        let warning = Problem::new(&group.primary.label, "status.address.url", message);
        report.warn(Some(&group.name), warning);
    }
    Some(host)
}

/// The name of the InMemoryChannel behind `group`, if it is one: a member, or what a
/// Channel's status (or template) says backs it.
fn in_memory_name(group: &Group) -> Option<String> {
    let conventional = |kind: &str| CONVENTIONAL_HOST.contains(&kind);
    if let Some(imc) = group.members.iter().find(|m| conventional(&m.kind)) {
        return Some(imc.name.clone());
    }
    let primary = &group.primary;
    let backing = primary
        .at(&["status", "channel"])
        .or_else(|| primary.at(&["spec", "channelTemplate"]));
    let kind = backing.and_then(|b| text(b, &["kind"]));
    (primary.kind == "Channel" && kind.as_deref().is_none_or(conventional))
        .then(|| text(&primary.doc, &["status", "channel", "name"]).unwrap_or(primary.name.clone()))
}

/// The https clusters whose URIs disagree on the CA certificates: the cluster trusts the
/// ones named, all of them.
fn check_tls(report: &mut Report) {
    let mut found = Vec::new();
    for (cluster, uses) in &report.tls {
        let Some(((channel, object, field), _)) = uses.with_ca.first() else {
            continue;
        };
        if let Some((without_channel, without_object, without_field)) = &uses.without_ca {
            let message = format!(
                "names no CA certificates, but {object} {field} does, for the same cluster \
                 {cluster}: the cluster trusts only the named ones"
            );
            let warning = Problem::new(without_object, without_field, message);
            found.push((without_channel.clone(), warning));
        }
        let sets: BTreeSet<&String> = uses.with_ca.iter().map(|(_, ca)| ca).collect();
        if sets.len() > 1 {
            let message = format!(
                "the URIs of cluster {cluster} name {} different sets of CA certificates: the \
                 cluster trusts all of them",
                sets.len()
            );
            found.push((channel.clone(), Problem::new(object, field, message)));
        }
    }
    for (channel, warning) in found {
        report.warn(Some(&channel), warning);
    }
}

fn check_hosts(specs: &BTreeMap<String, ChannelSpec>, report: &mut Report) {
    let mut owner: BTreeMap<&str, &str> = BTreeMap::new();
    for (name, spec) in specs {
        for host in &spec.hosts {
            if let Some(first) = owner.get(host.as_str()) {
                report.channel(
                    name,
                    Problem::new(
                        name,
                        "status.address.url",
                        format!("host {host} is also {first}'s"),
                    ),
                );
            } else {
                owner.insert(host, name);
            }
        }
    }
}

/// The channel's `spec.subscribers`: what Knative's dispatcher delivers to.
fn channel_subscribers(
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
                let problem =
                    Problem::new(&member.label, &format!("{at}.subscriberUri"), "missing");
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

/// The channel's own `spec.delivery`, for subscribers without one of their own, with its
/// dead letter as Knative resolved it into the channel's status.
fn channel_delivery<'a>(group: &'a Group, report: &mut Report) -> Delivery<'a> {
    let member = group
        .members
        .iter()
        .find(|m| m.at(&["spec", "delivery"]).is_some())?;
    let spec = member.at(&["spec", "delivery"])?;
    let source = Source {
        channel: &group.name,
        object: &member.label,
    };
    let dead_letter = resolved_dead_letter(&member.doc, &["status"], &source, report);
    let at = "spec.delivery".to_owned();
    Some((spec, member.label.clone(), at, dead_letter))
}

/// The dead letter Knative resolved into the status object at `path` (`deadLetterSinkUri`,
/// `-CACerts`, `-Audience`).
fn resolved_dead_letter(
    doc: &Value,
    path: &[&str],
    source: &Source,
    report: &mut Report,
) -> Option<Reply> {
    let status = dig(doc, path)?;
    let uri = text(status, &["deadLetterSinkUri"])?;
    let at = path.join(".");
    let audience = text(status, &["deadLetterSinkAudience"]);
    warnings::audience(
        report,
        source,
        &format!("{at}.deadLetterSinkAudience"),
        audience,
    );
    let ca = text(status, &["deadLetterSinkCACerts"]);
    Some((uri, format!("{at}.deadLetterSinkUri"), ca))
}

/// A Subscription the channel's `spec.subscribers` does not list (yet), as Knative's
/// reconciler will add it.
fn attach_subscription(
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
        let message = "not resolved to a URI: neither status.physicalSubscription.subscriberUri \
                       nor an absolute spec.subscriber.uri";
        report.channel(
            &group.name,
            Problem::new(&sub.label, "spec.subscriber", message),
        );
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
type Listed = BTreeMap<String, (String, String)>;

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
        let message =
            format!("{kind} {ns}/{name} is not in the source: the Subscription is not served");
        report
            .other
            .push(Problem::new(&sub.label, "spec.channel", message));
    }
    group
}

/// Where a subscriber comes from, for its problems.
struct Source<'a> {
    channel: &'a str,
    object: &'a str,
}

type Reply = (String, String, Option<String>);
/// A DeliverySpec, the object and field it is written at, and its dead letter as Knative
/// resolved it (URI, field, CA certificates), if it did.
type Delivery<'a> = Option<(&'a Value, String, String, Option<Reply>)>;

fn subscriber(
    source: &Source,
    (uri, field, ca): (&str, &str, Option<String>),
    reply: Option<Reply>,
    delivery: Delivery,
    spec: &mut ChannelSpec,
    report: &mut Report,
) -> Option<SubscriberSpec> {
    let before = report.by_channel.get(source.channel).map_or(0, Vec::len);
    let mut config = target(source, uri, field, ca, spec, report)?;
    let mut timeout = None;
    if let Some((value, object, at, dead_letter)) = delivery {
        let here = Source {
            channel: source.channel,
            object: &object,
        };
        let (mapped, t) = map_delivery(&here, (value, &at, dead_letter), spec, report);
        timeout = t;
        if let Some(t) = t {
            config.insert("timeout_ms".into(), json!(t));
        }
        if !mapped.is_empty() {
            config.insert("delivery".into(), Value::Object(mapped));
        }
    }
    if let Some((reply_uri, reply_field, reply_ca)) = reply {
        let mut reply_target = target(source, &reply_uri, &reply_field, reply_ca, spec, report)?;
        if let Some(t) = timeout {
            reply_target.insert("timeout_ms".into(), json!(t));
        }
        config.insert("reply".into(), Value::Object(reply_target));
    }
    let after = report.by_channel.get(source.channel).map_or(0, Vec::len);
    (after == before).then(|| SubscriberSpec {
        uri: uri.to_owned(),
        config: Value::Object(config),
    })
}

/// A call target (`cluster`, `authority`, `path`) for `uri`, its cluster added to `spec`.
fn target(
    source: &Source,
    uri: &str,
    field: &str,
    ca: Option<String>,
    spec: &mut ChannelSpec,
    report: &mut Report,
) -> Option<Map<String, Value>> {
    let parsed = match parse_uri(uri) {
        Ok(parsed) => parsed,
        Err(why) => {
            let problem = Problem::new(source.object, field, format!("{uri:?}: {why}"));
            report.channel(source.channel, problem);
            return None;
        }
    };
    let scheme = if parsed.tls { "https" } else { "http" };
    let name = format!("{scheme}|{}|{}", parsed.host, parsed.port);
    let cluster = spec
        .clusters
        .entry(name.clone())
        .or_insert_with(|| ClusterSpec {
            name: name.clone(),
            tls: parsed.tls,
            host: parsed.host.clone(),
            port: parsed.port,
            ca_certs: Vec::new(),
        });
    let ca = ca.map(|c| c.trim().to_owned()).filter(|c| !c.is_empty());
    if parsed.tls {
        let place = (
            source.channel.to_owned(),
            source.object.to_owned(),
            field.to_owned(),
        );
        let uses = report.tls.entry(name.clone()).or_default();
        match &ca {
            Some(ca) => uses.with_ca.push((place, ca.clone())),
            None => {
                uses.without_ca.get_or_insert(place);
            }
        }
    }
    if let Some(ca) = ca.filter(|_| parsed.tls) {
        if !cluster.ca_certs.contains(&ca) {
            cluster.ca_certs.push(ca);
        }
    }
    let mut out = Map::new();
    out.insert("cluster".into(), json!(name));
    out.insert("authority".into(), json!(parsed.authority));
    out.insert("path".into(), json!(parsed.path));
    Some(out)
}

/// An http(s) URI as fanout calls it.
#[derive(Debug, PartialEq)]
pub struct Uri {
    pub tls: bool,
    pub host: String,
    pub port: u16,
    pub authority: String,
    pub path: String,
}

/// Parse an absolute http or https URI; the error says why fanout cannot call it.
pub fn parse_uri(uri: &str) -> Result<Uri, String> {
    let (scheme, rest) = uri.split_once("://").ok_or("not an absolute URI")?;
    let tls = match scheme.to_ascii_lowercase().as_str() {
        "http" => false,
        "https" => true,
        _ => return Err("fanout calls absolute http and https URIs only".into()),
    };
    let (authority, path) = match rest.find(['/', '?', '#']) {
        Some(i) => rest.split_at(i),
        None => (rest, "/"),
    };
    if authority.contains('@') {
        return Err("credentials in a URI are not carried over".into());
    }
    let path = path.split('#').next().unwrap_or("/");
    let path = if path.starts_with('?') {
        format!("/{path}")
    } else {
        path.to_owned()
    };
    if path.bytes().any(|b| b <= 0x20 || b >= 0x7f) {
        return Err("the path has characters that must be percent-encoded".into());
    }
    let (host, port) = split_host_port(authority)?;
    let host = host.to_ascii_lowercase();
    let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_' | ':');
    if host.is_empty() || !host.chars().all(valid) {
        return Err("no valid host name".into());
    }
    let shown = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.clone()
    };
    Ok(Uri {
        tls,
        authority: port.map_or(shown.clone(), |p| format!("{shown}:{p}")),
        port: port.unwrap_or(if tls { 443 } else { 80 }),
        host,
        path,
    })
}

fn split_host_port(authority: &str) -> Result<(&str, Option<u16>), String> {
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or("an unclosed [ in the host")?;
        (host, after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    let port = match port {
        None | Some("") => None,
        Some(p) => match p.parse::<u16>() {
            Ok(p) if p > 0 => Some(p),
            _ => return Err(format!("port {p:?} is not a port")),
        },
    };
    Ok((host, port))
}

fn url_host(url: &str) -> Option<String> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next()?;
    split_host_port(authority)
        .ok()
        .map(|(h, _)| h.to_ascii_lowercase())
        .filter(|h| !h.is_empty())
}

/// Knative's DeliverySpec -> fanout's `delivery` and the per-call timeout.
fn map_delivery(
    source: &Source,
    (delivery, at, resolved): (&Value, &str, Option<Reply>),
    spec: &mut ChannelSpec,
    report: &mut Report,
) -> (Map<String, Value>, Option<u32>) {
    let mut out = Map::new();
    let mut problem = |field: &str, message: String| {
        let problem = Problem::new(source.object, &format!("{at}.{field}"), message);
        report.channel(source.channel, problem);
    };
    let Some(fields) = delivery.as_object() else {
        problem("", "is not a DeliverySpec".into());
        return (out, None);
    };
    let checked = check_delivery(fields, &mut problem);
    if let Some(format) = checked.format {
        out.insert("format".into(), format);
    }
    if checked.retry > 0 {
        let (policy, delay, cap) = (
            checked.policy.as_deref(),
            checked.delay,
            checked.retry_after_max,
        );
        let longest = retries(&mut out, checked.retry, policy, delay, cap);
        let given = (policy.is_some(), delay.is_some(), cap);
        warnings::backoff(report, source, at, given, longest);
    }
    let own = || {
        let uri = text(delivery, &["deadLetterSink", "uri"])?;
        let ca = text(delivery, &["deadLetterSink", "CACerts"]);
        Some((uri, format!("{at}.deadLetterSink.uri"), ca))
    };
    if resolved.is_none() {
        let field = format!("{at}.deadLetterSink.audience");
        let audience = text(delivery, &["deadLetterSink", "audience"]);
        warnings::audience(report, source, &field, audience);
    }
    if let Some((uri, field, ca)) = resolved.or_else(own) {
        if let Some(mut t) = target(source, &uri, &field, ca, spec, report) {
            if let Some(ms) = checked.timeout {
                t.insert("timeout_ms".into(), json!(ms));
            }
            out.insert("dead_letter".into(), Value::Object(t));
        }
    } else if delivery.get("deadLetterSink").is_some() {
        let message = "not resolved to a URI: fanout takes an absolute deadLetterSink.uri";
        let problem = Problem::new(source.object, &format!("{at}.deadLetterSink"), message);
        report.channel(source.channel, problem);
    }
    (out, checked.timeout)
}

/// A DeliverySpec's fields, checked.
#[derive(Default)]
struct Checked {
    retry: u64,
    timeout: Option<u32>,
    delay: Option<u32>,
    retry_after_max: Option<u32>,
    policy: Option<String>,
    format: Option<Value>,
}

fn check_delivery(fields: &Map<String, Value>, problem: &mut dyn FnMut(&str, String)) -> Checked {
    for name in fields
        .keys()
        .filter(|n| !DELIVERY_FIELDS.contains(&n.as_str()))
    {
        problem(
            name,
            "not a field of Knative's DeliverySpec that fanout knows".into(),
        );
    }
    let mut checked = Checked::default();
    if let Some(v) = fields.get("retry") {
        match v.as_u64() {
            Some(n) if n <= MAX_RETRY => checked.retry = n,
            _ => problem(
                "retry",
                format!("{v}: a whole number from 0 to {MAX_RETRY}"),
            ),
        }
    }
    let mut duration = |name: &str, zero: bool| {
        let v = fields.get(name)?;
        match v.as_str().map(duration_ms) {
            Some(Some(ms)) if zero || ms > 0 => Some(ms),
            _ => {
                problem(
                    name,
                    format!("{v}: not an ISO-8601 duration fanout takes (e.g. PT0.2S, PT1M)"),
                );
                None
            }
        }
    };
    checked.timeout = duration("timeout", false);
    checked.delay = duration("backoffDelay", true);
    checked.retry_after_max = duration("retryAfterMax", true);
    match fields.get("backoffPolicy") {
        Some(Value::String(p)) if p == "linear" || p == "exponential" => {
            checked.policy = Some(p.clone())
        }
        Some(p) => problem(
            "backoffPolicy",
            format!("{p}: must be linear or exponential"),
        ),
        None => {}
    }
    match fields.get("format") {
        Some(f) if matches!(f.as_str(), Some("json" | "binary")) => {
            checked.format = Some(f.clone())
        }
        Some(f) => problem(
            "format",
            format!("{f}: Knative's formats are json and binary"),
        ),
        None => {}
    }
    checked
}

/// Knative waits delay * 2^(n-1) (exponential) or delay * (n-1) (linear) before retry n;
/// fanout waits delay * 2^n or delay * n: exponential maps with half the delay. Returns the
/// longest backoff (ms).
fn retries(
    out: &mut Map<String, Value>,
    retry: u64,
    policy: Option<&str>,
    delay: Option<u32>,
    cap: Option<u32>,
) -> u32 {
    out.insert("retry".into(), json!(retry));
    let (delay, longest) = match (policy, delay) {
        (Some("exponential"), Some(d)) => {
            let half = d.div_ceil(2);
            (half, u64::from(half).saturating_mul(1u64 << retry.min(62)))
        }
        (Some("linear"), Some(d)) => (d, u64::from(d).saturating_mul(retry)),
        _ => (0, 0),
    };
    if delay > 0 {
        out.insert("backoff_policy".into(), json!(policy));
    }
    out.insert("backoff_delay_ms".into(), json!(delay));
    let longest = u32::try_from(longest).unwrap_or(u32::MAX);
    out.insert(
        "backoff_max_ms".into(),
        json!(cap.filter(|c| *c >= longest).unwrap_or(longest)),
    );
    longest
}

/// An ISO-8601 duration (`PT0.2S`, `PT1M`, `PT1H30M`, `P1D`) in whole milliseconds.
pub fn duration_ms(value: &str) -> Option<u32> {
    let rest = value.strip_prefix('P')?;
    let (days, time) = match rest.split_once('T') {
        Some((d, t)) if !t.is_empty() => (d, t),
        Some(_) => return None,
        None => (rest, ""),
    };
    let mut total = 0f64;
    let mut any = false;
    for (part, units) in [
        (days, &[('W', 604_800_000f64), ('D', 86_400_000f64)][..]),
        (
            time,
            &[('H', 3_600_000f64), ('M', 60_000f64), ('S', 1000f64)][..],
        ),
    ] {
        let mut number = String::new();
        let mut next = 0;
        for c in part.chars() {
            if c.is_ascii_digit() || c == '.' || c == ',' {
                number.push(if c == ',' { '.' } else { c });
                continue;
            }
            let at = units.iter().skip(next).position(|(u, _)| *u == c)? + next;
            let (_, ms) = units.get(at)?;
            total += number.parse::<f64>().ok()? * ms;
            number.clear();
            next = at + 1;
            any = true;
        }
        if !number.is_empty() {
            return None;
        }
    }
    let ms = (total + 0.5).floor();
    (any && ms <= f64::from(u32::MAX)).then_some(ms as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(documents: Vec<Value>) -> Snapshot {
        super::map(&MapOptions::default(), documents)
    }

    fn channel(name: &str, subscribers: Value) -> Value {
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
        let first = &orders.spec.subscribers[0].config;
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
        let second = &orders.spec.subscribers[1].config;
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

    #[test]
    fn a_channel_with_its_backing_channel_is_one() {
        let mut imc = channel("orders", json!([{ "subscriberUri": "http://a.example/" }]));
        imc["metadata"]["ownerReferences"] = json!([]);
        let parent = json!({
            "apiVersion": "messaging.knative.dev/v1", "kind": "Channel",
            "metadata": { "name": "orders", "namespace": "default" },
            "status": { "channel": { "kind": "InMemoryChannel", "name": "orders" },
                        "address": { "url": "http://orders-kn-channel.default.svc.cluster.local" } }
        });
        let snapshot = map(vec![parent, imc]);
        assert_eq!(snapshot.channels.len(), 1);
        assert!(snapshot.channels["default/orders"].problems.is_empty());
        assert_eq!(
            snapshot.channels["default/orders"].spec.subscribers.len(),
            1
        );
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
        let configs: Vec<&Value> = orders.spec.subscribers.iter().map(|s| &s.config).collect();
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

    #[test]
    fn durations() {
        assert_eq!(duration_ms("PT0.2S"), Some(200));
        assert_eq!(duration_ms("PT1H30M"), Some(5_400_000));
        assert_eq!(duration_ms("P1D"), Some(86_400_000));
        assert_eq!(duration_ms("PT"), None);
        assert_eq!(duration_ms("1s"), None);
        assert_eq!(duration_ms("PT1S1M"), None);
    }

    #[test]
    fn uris() {
        let u = parse_uri("https://[::1]:8443/p?q=1").unwrap();
        assert_eq!(
            (
                u.host.as_str(),
                u.port,
                u.authority.as_str(),
                u.path.as_str()
            ),
            ("::1", 8443, "[::1]:8443", "/p?q=1")
        );
        assert!(parse_uri("http://user:pw@h/").is_err());
        assert!(parse_uri("http://h:0/").is_err());
        assert_eq!(parse_uri("http://H.example").unwrap().path, "/");
    }
}
