//! Reads the plugin configuration's JSON into the config's raw types and, when the document
//! does not fit them, says where: the field path (`channels[0].subscribers[1].timeout_ms`)
//! with serde's own message, exactly as `serde_path_to_error` over `serde_json` gave them.
//!
//! Why not that crate: it wraps every visitor of every type it reads, and those wrappers
//! were about 60 KB of the 460 KB module. Here the document is first parsed into a [`Node`]
//! tree (one small visitor; a syntax error is serde_json's, with its position), then the raw
//! types are read from the tree by [`At`], a deserializer that knows its own path and puts it
//! on the first error that comes out of it.
//!
//! What stays as it was, and why it does: a value is offered to a visitor the way serde_json
//! offers it (unsigned, signed and float numbers, borrowed strings, maps and sequences in
//! document order, `null` as unit or none), and every message is made by `serde_json::Error`,
//! so the texts are serde_json's (`invalid type: null, expected u32`, `floating point `1.5``).
//! The path is built as serde_path_to_error builds it: a map value or key adds `.key`, a
//! sequence element `[i]`, an enum's content `.variant`; an error raised by a struct's own
//! visitor (a missing or duplicate field) has the struct's path; the root is `.`.
//! What differs: a document that is not valid JSON is reported as such even where a field
//! error comes before the syntax error (the whole document is parsed first); and an enum
//! field (`mode`, `body_wait`, `report`, `backoff_policy`) holding neither a string nor a
//! one-entry object is refused with its path and type (`mode: invalid type: integer `7`,
//! expected enum Mode`), where serde_json's streaming reader said "not valid JSON: expected
//! value at line 1 column 14"; and a struct (a target, `delivery`, `dedupe`, a channel) must
//! be an object: serde_json also reads an array of its fields in order (`"reply": ["c", null,
//! null, null, {}]`), which is refused here (`reply: invalid type: sequence, expected struct
//! RawTarget`).

use std::fmt;

use serde::de::value::BorrowedStrDeserializer;
use serde::de::{self, Deserialize, DeserializeSeed, Unexpected, Visitor};
use serde::forward_to_deserialize_any;

/// Why a document could not be read.
#[derive(Debug)]
pub enum ReadError {
    /// Not JSON (serde_json's error, with line and column).
    Syntax(serde_json::Error),
    /// JSON that does not fit: the field path and serde's message.
    Data { path: String, message: String },
}

/// Parses `bytes` (one JSON document, nothing after it) and reads a `T` from it.
pub fn from_slice<T: de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ReadError> {
    let node: Node = serde_json::from_slice(bytes).map_err(ReadError::Syntax)?;
    T::deserialize(At {
        node: &node,
        chain: &Chain::Root,
    })
    .map_err(|e| ReadError::Data {
        path: e.path.unwrap_or_else(|| ".".to_string()),
        message: e.message,
    })
}

/// A parsed JSON value. Objects keep their entries in document order, duplicates included, so
/// that a struct still sees (and refuses) a field given twice.
#[derive(Debug)]
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
    fn unexpected(&self) -> Unexpected<'_> {
        match self {
            Node::Null => Unexpected::Unit,
            Node::Bool(b) => Unexpected::Bool(*b),
            Node::Unsigned(n) => Unexpected::Unsigned(*n),
            Node::Signed(n) => Unexpected::Signed(*n),
            Node::Float(n) => Unexpected::Float(*n),
            Node::Str(s) => Unexpected::Str(s),
            Node::Array(_) => Unexpected::Seq,
            Node::Object(_) => Unexpected::Map,
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

/// Where a value is, as serde_path_to_error's `Chain`: built on the stack as the reading goes
/// down, turned into text only for an error.
enum Chain<'a> {
    Root,
    Seq {
        parent: &'a Chain<'a>,
        index: usize,
    },
    Map {
        parent: &'a Chain<'a>,
        key: &'a str,
    },
    Enum {
        parent: &'a Chain<'a>,
        variant: &'a str,
    },
}

impl fmt::Display for Chain<'_> {
    /// `a.b[2].c`; the root alone is `.`.
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        fn write(chain: &Chain, f: &mut fmt::Formatter) -> Result<bool, fmt::Error> {
            let (parent, text) = match chain {
                Chain::Root => return Ok(false),
                Chain::Seq { parent, index } => {
                    write(parent, f)?;
                    write!(f, "[{index}]")?;
                    return Ok(true);
                }
                Chain::Map { parent, key } => (parent, key),
                Chain::Enum { parent, variant } => (parent, variant),
            };
            if write(parent, f)? {
                f.write_str(".")?;
            }
            f.write_str(text)?;
            Ok(true)
        }
        if !write(self, f)? {
            f.write_str(".")?;
        }
        Ok(())
    }
}

/// serde's message (made by serde_json, so worded as serde_json words it) and, once known,
/// where it happened.
#[derive(Debug)]
pub struct PathError {
    path: Option<String>,
    message: String,
}

impl PathError {
    /// The innermost path wins: an error keeps the first path put on it.
    fn at(mut self, chain: &Chain) -> PathError {
        if self.path.is_none() {
            self.path = Some(chain.to_string());
        }
        self
    }

    fn from_json(error: serde_json::Error) -> PathError {
        PathError {
            path: None,
            message: error.to_string(),
        }
    }
}

impl fmt::Display for PathError {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for PathError {}

impl de::Error for PathError {
    fn custom<T: fmt::Display>(message: T) -> PathError {
        PathError::from_json(de::Error::custom(message))
    }
    fn invalid_type(unexpected: Unexpected, expected: &dyn de::Expected) -> PathError {
        PathError::from_json(de::Error::invalid_type(unexpected, expected))
    }
    fn invalid_value(unexpected: Unexpected, expected: &dyn de::Expected) -> PathError {
        PathError::from_json(de::Error::invalid_value(unexpected, expected))
    }
}

/// A value of the tree and where it is.
struct At<'de, 'c> {
    node: &'de Node,
    chain: &'c Chain<'c>,
}

/// The wrong kind of value for `expected` (one copy for every visitor: it takes them as
/// `dyn Expected`).
fn wrong_type(node: &Node, expected: &dyn de::Expected) -> PathError {
    de::Error::invalid_type(node.unexpected(), expected)
}

impl<'de, 'c> At<'de, 'c> {
    /// Each kind of value is offered to the visitor as serde_json offers it; what the visitor
    /// does not take it refuses with the message serde_json's deserializer would give.
    fn visit<V: Visitor<'de>>(
        self,
        visitor: V,
        offer: impl FnOnce(Self, V) -> Result<V::Value, PathError>,
    ) -> Result<V::Value, PathError> {
        let chain = self.chain;
        offer(self, visitor).map_err(|e| e.at(chain))
    }

    /// A JSON array to `visitor`. A visitor that stops early (a struct read from a longer
    /// array) leaves elements unread: refused, as serde_json refuses them, not dropped.
    fn array<V: Visitor<'de>>(
        items: &'de [Node],
        chain: &'c Chain<'c>,
        visitor: V,
    ) -> Result<V::Value, PathError> {
        let mut items = Items {
            items: items.iter(),
            index: 0,
            chain,
        };
        let value = visitor.visit_seq(&mut items)?;
        match items.items.len() {
            0 => Ok(value),
            left => Err(de::Error::invalid_length(left, &"fewer elements in array")),
        }
    }

    /// A JSON object to `visitor`, its entries in document order.
    fn object<V: Visitor<'de>>(
        entries: &'de [(String, Node)],
        chain: &'c Chain<'c>,
        visitor: V,
    ) -> Result<V::Value, PathError> {
        let mut entries = Entries {
            entries: entries.iter(),
            value: None,
            chain,
        };
        let value = visitor.visit_map(&mut entries)?;
        match entries.entries.len() {
            0 => Ok(value),
            left => Err(de::Error::invalid_length(left, &"fewer elements in map")),
        }
    }
}

/// The integer types: serde_json offers a non-negative integer as u64, a negative one as i64
/// (the visitor checks the range), and refuses anything else as the wrong type.
macro_rules! integers {
    ($($method:ident)*) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, PathError> {
            self.visit(visitor, |at, visitor| match at.node {
                Node::Unsigned(v) => visitor.visit_u64(*v),
                Node::Signed(v) => visitor.visit_i64(*v),
                other => Err(wrong_type(other, &visitor)),
            })
        }
    )*};
}

impl<'de> de::Deserializer<'de> for At<'de, '_> {
    type Error = PathError;

    /// Whatever the value is (what `serde_json::Value` reads).
    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, PathError> {
        self.visit(visitor, |at, visitor| match at.node {
            Node::Null => visitor.visit_unit(),
            Node::Bool(v) => visitor.visit_bool(*v),
            Node::Unsigned(v) => visitor.visit_u64(*v),
            Node::Signed(v) => visitor.visit_i64(*v),
            Node::Float(v) => visitor.visit_f64(*v),
            Node::Str(v) => visitor.visit_borrowed_str(v),
            Node::Array(items) => At::array(items, at.chain, visitor),
            Node::Object(entries) => At::object(entries, at.chain, visitor),
        })
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, PathError> {
        self.visit(visitor, |at, visitor| match at.node {
            Node::Bool(v) => visitor.visit_bool(*v),
            other => Err(wrong_type(other, &visitor)),
        })
    }

    integers! { deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64 deserialize_i8
    deserialize_i16 deserialize_i32 deserialize_i64 }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, PathError> {
        self.visit(visitor, |at, visitor| match at.node {
            Node::Str(v) => visitor.visit_borrowed_str(v),
            other => Err(wrong_type(other, &visitor)),
        })
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, PathError> {
        self.deserialize_str(visitor)
    }

    fn deserialize_identifier<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, PathError> {
        self.deserialize_str(visitor)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, PathError> {
        self.visit(visitor, |at, visitor| match at.node {
            Node::Null => visitor.visit_none(),
            _ => visitor.visit_some(at),
        })
    }

    fn deserialize_unit<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, PathError> {
        self.visit(visitor, |at, visitor| match at.node {
            Node::Null => visitor.visit_unit(),
            other => Err(wrong_type(other, &visitor)),
        })
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, PathError> {
        self.visit(visitor, |at, visitor| match at.node {
            Node::Array(items) => At::array(items, at.chain, visitor),
            other => Err(wrong_type(other, &visitor)),
        })
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, PathError> {
        self.visit(visitor, |at, visitor| match at.node {
            Node::Object(entries) => At::object(entries, at.chain, visitor),
            other => Err(wrong_type(other, &visitor)),
        })
    }

    /// An object. Not, as serde_json also takes, an array of the fields in order: nobody
    /// writes a configuration so, and serde's readers for that form were ~12 KB of the module.
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, PathError> {
        self.visit(visitor, |at, visitor| match at.node {
            Node::Object(entries) => At::object(entries, at.chain, visitor),
            other => Err(wrong_type(other, &visitor)),
        })
    }

    /// As serde_json: a string is a unit variant, an object of one entry a variant and its
    /// content, anything else the wrong type.
    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, PathError> {
        self.visit(visitor, |at, visitor| match at.node {
            Node::Str(variant) => visitor.visit_enum(Variant {
                variant,
                content: None,
                chain: at.chain,
            }),
            Node::Object(entries) if entries.len() == 1 => visitor.visit_enum(Variant {
                variant: &entries[0].0,
                content: Some(&entries[0].1),
                chain: at.chain,
            }),
            other => Err(wrong_type(other, &visitor)),
        })
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, PathError> {
        self.visit(visitor, |at, visitor| visitor.visit_newtype_struct(at))
    }

    forward_to_deserialize_any! {
        i128 u128 f32 f64 char bytes byte_buf unit_struct tuple tuple_struct ignored_any
    }
}

/// A JSON array's elements, each at `[index]`.
struct Items<'de, 'c> {
    items: std::slice::Iter<'de, Node>,
    index: usize,
    chain: &'c Chain<'c>,
}

impl<'de> de::SeqAccess<'de> for Items<'de, '_> {
    type Error = PathError;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, PathError> {
        let Some(node) = self.items.next() else {
            return Ok(None);
        };
        let chain = Chain::Seq {
            parent: self.chain,
            index: self.index,
        };
        self.index += 1;
        seed.deserialize(At {
            node,
            chain: &chain,
        })
        .map(Some)
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.items.len())
    }
}

/// A JSON object's entries, in document order; key and value at `.key`.
struct Entries<'de, 'c> {
    entries: std::slice::Iter<'de, (String, Node)>,
    /// The entry whose key was just read.
    value: Option<&'de (String, Node)>,
    chain: &'c Chain<'c>,
}

impl<'de> de::MapAccess<'de> for Entries<'de, '_> {
    type Error = PathError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, PathError> {
        let Some(entry) = self.entries.next() else {
            return Ok(None);
        };
        self.value = Some(entry);
        let key = BorrowedStrDeserializer::<PathError>::new(&entry.0);
        seed.deserialize(key).map(Some).map_err(|e| {
            e.at(&Chain::Map {
                parent: self.chain,
                key: &entry.0,
            })
        })
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, PathError> {
        let Some((key, node)) = self.value.take() else {
            return Err(de::Error::custom("a map value was read before its key"));
        };
        seed.deserialize(At {
            node,
            chain: &Chain::Map {
                parent: self.chain,
                key,
            },
        })
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.entries.len())
    }
}

/// An enum value: its variant's name and, for the `{"variant": content}` form, the content.
struct Variant<'de, 'c> {
    variant: &'de str,
    content: Option<&'de Node>,
    chain: &'c Chain<'c>,
}

impl<'de, 'c> de::EnumAccess<'de> for Variant<'de, 'c> {
    type Error = PathError;
    type Variant = Variant<'de, 'c>;

    fn variant_seed<V: DeserializeSeed<'de>>(
        self,
        seed: V,
    ) -> Result<(V::Value, Variant<'de, 'c>), PathError> {
        let name = seed.deserialize(BorrowedStrDeserializer::<PathError>::new(self.variant))?;
        Ok((name, self))
    }
}

impl<'de> de::VariantAccess<'de> for Variant<'de, '_> {
    type Error = PathError;

    fn unit_variant(self) -> Result<(), PathError> {
        match self.content {
            None => Ok(()),
            Some(node) => {
                let chain = Chain::Enum {
                    parent: self.chain,
                    variant: self.variant,
                };
                <()>::deserialize(At {
                    node,
                    chain: &chain,
                })
            }
        }
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, PathError> {
        let chain = Chain::Enum {
            parent: self.chain,
            variant: self.variant,
        };
        match self.content {
            Some(node) => seed.deserialize(At {
                node,
                chain: &chain,
            }),
            None => Err(de::Error::invalid_type(
                Unexpected::UnitVariant,
                &"newtype variant",
            )),
        }
    }

    fn tuple_variant<V: Visitor<'de>>(
        self,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value, PathError> {
        self.struct_variant(&[], visitor)
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, PathError> {
        let chain = Chain::Enum {
            parent: self.chain,
            variant: self.variant,
        };
        match self.content {
            Some(node) => de::Deserializer::deserialize_any(
                At {
                    node,
                    chain: &chain,
                },
                visitor,
            ),
            None => Err(de::Error::invalid_type(Unexpected::UnitVariant, &visitor)),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The reader against what the filter used before it: serde_path_to_error over
    //! serde_json's streaming deserializer, on every field of a configuration that uses them
    //! all, each replaced by values of every JSON kind, removed, given twice, and joined by an
    //! unknown field. Both must accept the same documents with the same values, and refuse
    //! the rest with the same path and message.

    use serde_json::{json, Value};

    use super::super::RawConfig;
    use super::{from_slice, ReadError};

    /// serde_path_to_error's path and serde_json's message without its position, as the
    /// filter reported them.
    fn reference(bytes: &[u8]) -> Result<String, String> {
        let de = &mut serde_json::Deserializer::from_slice(bytes);
        let raw: RawConfig = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if !inner.is_data() {
                return format!("not JSON: {inner}");
            }
            let text = inner.to_string();
            let message = match text.rfind(" at line ") {
                Some(i) if inner.line() > 0 => text[..i].to_string(),
                _ => text,
            };
            format!("{path}: {message}")
        })?;
        de.end().map_err(|e| format!("not JSON: {e}"))?;
        Ok(format!("{raw:?}"))
    }

    fn ours(bytes: &[u8]) -> Result<String, String> {
        from_slice::<RawConfig>(bytes)
            .map(|raw| format!("{raw:?}"))
            .map_err(|e| match e {
                ReadError::Syntax(inner) => format!("not JSON: {inner}"),
                ReadError::Data { path, message } => format!("{path}: {message}"),
            })
    }

    fn target() -> Value {
        json!({"cluster": "dlq", "authority": "dlq.svc", "path": "/d", "timeout_ms": 5,
               "headers": {"x-b": "2"}})
    }

    fn delivery() -> Value {
        json!({"retry": 2, "backoff_policy": "exponential", "backoff_delay_ms": 10,
               "backoff_max_ms": 100, "dead_letter": target()})
    }

    /// Every field of every raw type, each with a valid value.
    fn every_field() -> Vec<Value> {
        let subscriber = json!({
            "cluster": "a", "authority": "a.svc", "path": "/p", "timeout_ms": 5,
            "headers": {"x-a": "1"}, "delivery": delivery(), "reply": target(),
            "filters": [{"exact": {"type": "t"}}], "filter": {"attributes": {"type": "t"}}
        });
        let top = json!({
            "timeout_ms": 1000, "max_body_bytes": 2048, "methods": ["POST"],
            "forward_headers": ["ce-*"], "metrics": true, "body_wait": "pause",
            "delivery": delivery(), "reply": target(), "mode": "sync", "max_in_flight": 10,
            "report": "full", "dedupe": {"key": "ce-id", "ttl_ms": 1000, "max_entries": 10}
        });
        let mut channels = top.clone();
        channels["channels"] = json!([{"name": "c", "hosts": ["a.example"],
                                       "subscribers": [subscriber.clone()]}]);
        let mut shorthand = top;
        shorthand["subscribers"] = json!([subscriber]);
        vec![channels, shorthand]
    }

    /// Values of every JSON kind, and the shapes serde treats specially (an enum as an
    /// object, a struct as an array, numbers out of a field's range).
    fn replacements() -> Vec<Value> {
        vec![
            json!(null),
            json!(true),
            json!(0),
            json!(7),
            json!(-3),
            json!(4294967296u64),
            json!(1.5),
            json!(1e300),
            json!("s"),
            json!("linear"),
            json!(""),
            json!([]),
            json!(["x"]),
            json!([1, 2]),
            json!(["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"]),
            json!({}),
            json!({"x": 1}),
            json!({"linear": null}),
            json!({"linear": 5}),
            json!({"cluster": "c"}),
        ]
    }

    /// JSON text of `value` with the object at `target` (a JSON pointer) given its first
    /// key twice, which `serde_json::Value` cannot hold.
    fn with_duplicate(value: &Value, pointer: &str, at: &str) -> String {
        match value {
            Value::Object(map) => {
                let mut parts: Vec<String> = map
                    .iter()
                    .map(|(k, v)| {
                        format!(
                            "{}:{}",
                            json!(k),
                            with_duplicate(v, pointer, &format!("{at}/{k}"))
                        )
                    })
                    .collect();
                if at == pointer {
                    if let Some(first) = parts.first().cloned() {
                        parts.push(first);
                    }
                }
                format!("{{{}}}", parts.join(","))
            }
            Value::Array(items) => {
                let parts: Vec<String> = items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| with_duplicate(v, pointer, &format!("{at}/{i}")))
                    .collect();
                format!("[{}]", parts.join(","))
            }
            other => other.to_string(),
        }
    }

    fn pointers(value: &Value, at: String, out: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                for (k, v) in map {
                    pointers(v, format!("{at}/{k}"), out);
                }
            }
            Value::Array(items) => {
                for (i, v) in items.iter().enumerate() {
                    pointers(v, format!("{at}/{i}"), out);
                }
            }
            _ => {}
        }
        out.push(at);
    }

    fn variants() -> Vec<String> {
        let mut docs = Vec::new();
        for base in every_field() {
            docs.push(base.to_string());
            let mut all = Vec::new();
            pointers(&base, String::new(), &mut all);
            for pointer in all {
                let node = base.pointer(&pointer).cloned().unwrap_or(Value::Null);
                if !pointer.is_empty() {
                    for value in replacements() {
                        let mut doc = base.clone();
                        *doc.pointer_mut(&pointer).unwrap() = value;
                        docs.push(doc.to_string());
                    }
                }
                if let Value::Object(map) = &node {
                    let mut doc = base.clone();
                    doc.pointer_mut(&pointer).unwrap()["zz_unknown"] = json!(1);
                    docs.push(doc.to_string());
                    for key in map.keys() {
                        let mut doc = base.clone();
                        doc.pointer_mut(&pointer)
                            .unwrap()
                            .as_object_mut()
                            .unwrap()
                            .remove(key);
                        docs.push(doc.to_string());
                    }
                    docs.push(with_duplicate(&base, &pointer, ""));
                }
                if let Value::Array(items) = &node {
                    let mut doc = base.clone();
                    let copy = items.first().cloned().unwrap_or(json!(1));
                    doc.pointer_mut(&pointer)
                        .unwrap()
                        .as_array_mut()
                        .unwrap()
                        .push(copy);
                    docs.push(doc.to_string());
                }
            }
        }
        docs
    }

    #[test]
    fn paths_and_messages_are_serde_path_to_errors() {
        let docs = variants();
        assert!(docs.len() > 1000, "{} documents", docs.len());
        let mut refused = 0;
        let mut differ = Vec::new();
        for doc in &docs {
            let want = reference(doc.as_bytes());
            refused += usize::from(want.is_err());
            let got = ours(doc.as_bytes());
            // One change: serde_json's streaming reader answers an enum field holding
            // neither a string nor a one-entry object with a syntax error ("expected value at
            // line 1 column 14") although the document is valid JSON; this reader names the
            // field and the type, as for any other field.
            let enum_field = matches!((&got, &want), (Err(g), Err(w))
                if w.starts_with("not JSON: expected value at line 1")
                    && g.contains(": invalid type: ") && g.contains(", expected enum "));
            // The other: a struct given as an array of its fields, which serde_json reads and
            // this reader refuses as the wrong type, at the struct's own path (the reference
            // refused every such variant too: at that path or inside it, or as the enum field
            // above when an element landed in one).
            let struct_array = matches!((&got, &want), (Err(g), Err(w))
                if g.split_once(": invalid type: sequence, expected struct ")
                    .is_some_and(|(path, _)| w.starts_with(path)
                        || w.starts_with("not JSON: expected value at line 1")));
            if got != want && !enum_field && !struct_array {
                differ.push(format!("{doc}\n  got:  {got:?}\n  want: {want:?}"));
            }
        }
        assert!(
            differ.is_empty(),
            "{} differ:\n{}",
            differ.len(),
            differ.join("\n")
        );
        // Most variants must be refused, or the comparison says little about errors.
        assert!(
            refused * 2 > docs.len(),
            "{refused} of {} refused",
            docs.len()
        );
    }

    #[test]
    fn the_document_must_be_json_and_end() {
        for doc in [
            "{\"timeout_ms\": 1",
            "{} {}",
            "{\"timeout_ms\": 1,}",
            "{\"a\" 1}",
        ] {
            assert!(
                matches!(
                    from_slice::<RawConfig>(doc.as_bytes()),
                    Err(ReadError::Syntax(_))
                ),
                "{doc}"
            );
        }
    }

    #[test]
    fn a_struct_from_an_array_is_refused() {
        // serde_json took the first as a target `c`, refused the second for its extra element.
        for doc in [
            r#"{"reply": ["c", null, null, null, {}]}"#,
            r#"{"reply": ["c", null, null, null, {}, "more"]}"#,
        ] {
            match from_slice::<RawConfig>(doc.as_bytes()) {
                Err(ReadError::Data { path, message }) => {
                    assert_eq!(path, "reply");
                    assert_eq!(message, "invalid type: sequence, expected struct RawTarget");
                }
                other => panic!("{other:?}"),
            }
        }
    }
}
