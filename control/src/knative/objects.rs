//! The intake: the Kubernetes objects of the input, sorted into the kinds fanout serves
//! (Channels, InMemoryChannels, Subscriptions, EventPolicies), and each Channel grouped with
//! its backing channel. An object of another kind is reported here; nothing is mapped here.

use super::{Report, EVENTING, FANOUT, MESSAGING};
use crate::model::Problem;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::sync::Arc;

/// One Kubernetes object of the input.
#[derive(Clone, Debug)]
pub(super) struct KObject {
    pub(super) kind: String,
    pub(super) group: String,
    pub(super) namespace: String,
    pub(super) name: String,
    pub(super) uid: Option<String>,
    pub(super) label: String,
    pub(super) doc: Value,
}

impl KObject {
    pub(super) fn new(doc: Value) -> KObject {
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

    pub(super) fn at(&self, path: &[&str]) -> Option<&Value> {
        dig(&self.doc, path)
    }
}

pub(super) fn dig<'a>(value: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter().try_fold(value, |v, key| v.get(key))
}

pub(super) fn text(value: &Value, path: &[&str]) -> Option<String> {
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

type Sorted = (Vec<KObject>, Vec<KObject>, Vec<KObject>);

/// An object of a kind fanout does not map: an error when it has subscribers (they would get
/// nothing), else a warning.
fn unknown_kind(obj: &KObject, report: &mut Report) {
    let group = if obj.group.is_empty() {
        "core"
    } else {
        &obj.group
    };
    let present = |field: &str| {
        obj.at(&["spec", field])
            .is_some_and(|v| !v.is_null() && v != &json!([]) && v != &json!({}))
    };
    let field = ["subscribers", "subscriber"]
        .into_iter()
        .find(|f| present(f));
    if let Some(field) = field {
        report.other.push(Problem::new(
            &obj.label,
            &format!("spec.{field}"),
            format!(
                "{} ({group}) is not a kind this command imports (Channel, InMemoryChannel, \
                 FanoutChannel, Subscription): its subscribers would get no events from fanout",
                obj.kind
            ),
        ));
    } else {
        let message = format!("{} ({group}) is not imported; ignored", obj.kind);
        report.warn(None, Problem::new(&obj.label, "kind", message));
    }
}

pub(super) fn sort_objects(documents: Vec<Value>, report: &mut Report) -> Sorted {
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
            unknown_kind(&obj, report);
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
pub(super) struct Group {
    pub(super) name: String,
    /// Shared with `members` (a channel's objects are read, never changed, by the mapping).
    pub(super) primary: Arc<KObject>,
    /// The backing channel (what the dispatcher delivers from) first.
    pub(super) members: Vec<Arc<KObject>>,
}

impl Group {
    pub(super) fn has(&self, kind: &str, namespace: &str, name: &str) -> bool {
        self.members
            .iter()
            .any(|m| m.kind == kind && m.namespace == namespace && m.name == name)
    }
}

pub(super) fn group_channels(channels: Vec<KObject>) -> Vec<Group> {
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
    let channels: Vec<Arc<KObject>> = channels.into_iter().map(Arc::new).collect();
    let keys: BTreeSet<_> = channels.iter().map(|c| key(c)).collect();
    let backed: BTreeSet<_> = channels
        .iter()
        .filter_map(|c| backing_key(c))
        .filter(|k| keys.contains(k))
        .collect();
    let mut groups = Vec::new();
    for obj in channels.iter().filter(|c| !backed.contains(&key(c))) {
        let mut members: Vec<Arc<KObject>> = backing_key(obj)
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

#[cfg(test)]
mod tests {
    use crate::knative::tests::{channel, map};
    use serde_json::json;

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
}
