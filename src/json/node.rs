//! A parsed JSON value: the tree the configuration is read from, and a subscription filter
//! as written in it. Its own type, so that neither needs serde_json's `Value` (and its map
//! and serializer in the module).

use std::fmt;

use serde::de::{self, Deserialize, Visitor};

use super::kind;

/// A parsed JSON value. Objects keep their entries in document order, duplicates included, so
/// that a struct still sees (and refuses) a field given twice.
#[derive(Debug, Clone)]
pub enum Node {
    Null,
    Bool(bool),
    Unsigned(u64),
    Signed(i64),
    Float(f64),
    Str(String),
    Array(Vec<Node>),
    Object(Vec<(String, Node)>),
}

impl Node {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Node::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Node]> {
        match self {
            Node::Array(items) => Some(items),
            _ => None,
        }
    }

    /// An object's members as a JSON parser that keeps the last of duplicate names reads
    /// them (serde_json's `Value` does): each name once, with its last value, in the order of
    /// those last values.
    pub fn as_object(&self) -> Option<Vec<(&str, &Node)>> {
        let Node::Object(entries) = self else {
            return None;
        };
        Some(
            entries
                .iter()
                .enumerate()
                .filter(|(i, (name, _))| {
                    let later = entries.get(i + 1..).unwrap_or_default();
                    !later.iter().any(|(n, _)| n == name)
                })
                .map(|(_, (name, node))| (name.as_str(), node))
                .collect(),
        )
    }

    /// What serde_json calls this value in its messages (`integer `7``, `string "s"`, `null`).
    pub fn kind(&self) -> String {
        match self {
            Node::Null => kind::null(),
            Node::Bool(b) => kind::bool(*b),
            Node::Unsigned(n) => kind::integer(n),
            Node::Signed(n) => kind::integer(n),
            Node::Float(n) => kind::float(*n),
            Node::Str(s) => kind::string(s),
            Node::Array(_) => kind::sequence(),
            Node::Object(_) => kind::map(),
        }
    }
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Node, D::Error> {
        deserializer.deserialize_any(NodeVisitor)
    }
}

struct NodeVisitor;

impl<'de> Visitor<'de> for NodeVisitor {
    type Value = Node;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_unit<E>(self) -> Result<Node, E> {
        Ok(Node::Null)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Node, E> {
        Ok(Node::Bool(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Node, E> {
        Ok(Node::Unsigned(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Node, E> {
        Ok(Node::Signed(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Node, E> {
        Ok(Node::Float(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Node, E> {
        Ok(Node::Str(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Node, E> {
        Ok(Node::Str(v))
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Node::Array(items))
    }
    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
        let mut entries = Vec::new();
        while let Some(entry) = map.next_entry()? {
            entries.push(entry);
        }
        Ok(Node::Object(entries))
    }
}
