//! The raw types written as JSON, as the reader ([`super::read`]) reads them: what a control
//! plane serializes when it builds the configuration from these types (the `serialize`
//! feature; the filter itself never writes its configuration).

use serde::ser::{SerializeMap, SerializeSeq, Serializer};
use serde::Serialize;

use super::{Node, RawHeaders, RawSubscriber, RawTarget};
use crate::retry::BackoffPolicy;

impl RawHeaders {
    /// No headers: the field is left out.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A subscriber that calls `target` (its cluster, authority, path, timeout and headers).
impl From<RawTarget> for RawSubscriber {
    fn from(target: RawTarget) -> RawSubscriber {
        RawSubscriber {
            cluster: target.cluster,
            authority: target.authority,
            path: target.path,
            timeout_ms: target.timeout_ms,
            headers: target.headers,
            ..RawSubscriber::default()
        }
    }
}

/// A JSON object of the names and values, in their order.
impl Serialize for RawHeaders {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (name, value) in &self.0 {
            map.serialize_entry(name, value)?;
        }
        map.end()
    }
}

/// A filter as written: the JSON value it was read from.
struct Written<'a>(&'a Node);

impl Serialize for Written<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            Node::Null => serializer.serialize_unit(),
            Node::Bool(b) => serializer.serialize_bool(*b),
            Node::Unsigned(n) => serializer.serialize_u64(*n),
            Node::Signed(n) => serializer.serialize_i64(*n),
            Node::Float(f) => serializer.serialize_f64(*f),
            Node::Str(s) => serializer.serialize_str(s),
            Node::Array(items) => {
                let mut seq = serializer.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(&Written(item))?;
                }
                seq.end()
            }
            Node::Object(entries) => {
                let mut map = serializer.serialize_map(Some(entries.len()))?;
                for (name, value) in entries {
                    map.serialize_entry(name, &Written(value))?;
                }
                map.end()
            }
        }
    }
}

/// `filter` (skipped when `None`).
pub(super) fn node<S: Serializer>(node: &Option<Node>, serializer: S) -> Result<S::Ok, S::Error> {
    node.as_ref().map(Written).serialize(serializer)
}

/// `filters` (skipped when `None`).
pub(super) fn nodes<S: Serializer>(
    nodes: &Option<Vec<Node>>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    nodes
        .as_ref()
        .map(|list| list.iter().map(Written).collect::<Vec<_>>())
        .serialize(serializer)
}

/// `backoff_policy`: its word in lower case, as the reader takes it.
pub(super) fn policy<S: Serializer>(
    policy: &Option<BackoffPolicy>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    let word = policy.map(|p| match p {
        BackoffPolicy::Linear => "linear",
        BackoffPolicy::Exponential => "exponential",
    });
    word.serialize(serializer)
}

/// Two filters are equal when they are the same JSON, written the same way (a float and an
/// integer are not; entries compare in order).
impl PartialEq for Node {
    fn eq(&self, other: &Node) -> bool {
        match (self, other) {
            (Node::Null, Node::Null) => true,
            (Node::Bool(a), Node::Bool(b)) => a == b,
            (Node::Unsigned(a), Node::Unsigned(b)) => a == b,
            (Node::Signed(a), Node::Signed(b)) => a == b,
            (Node::Float(a), Node::Float(b)) => a == b,
            (Node::Str(a), Node::Str(b)) => a == b,
            (Node::Array(a), Node::Array(b)) => a == b,
            (Node::Object(a), Node::Object(b)) => a == b,
            _ => false,
        }
    }
}
