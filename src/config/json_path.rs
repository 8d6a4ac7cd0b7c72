//! Reads the plugin configuration's JSON into the config's raw types and, when the document
//! does not fit them, says where: the field path (`channels[0].subscribers[1].timeout_ms`)
//! and serde_json's message for it.
//!
//! The document is first parsed into a [`Node`] tree (one small visitor; a syntax error is
//! serde_json's, with its position), then the raw types are read from the tree by hand
//! (`read.rs`) through [`At`], a value and its path, whose readers put the path on any error.
//! Why by hand rather than serde's derived readers under a path-tracking wrapper: the module's
//! size (bench/README.md, "Size").
//!
//! Each reader accepts the kinds of value serde's readers accept from serde_json (a
//! non-negative integer as u64, a negative one as i64, `null` as none), and every message is
//! serde_json's: made by `serde_json::Error` (`unknown field`, `missing field`, `duplicate
//! field`, `unknown variant`), or in its words by [`crate::json::kind`] (`invalid type: null,
//! expected u32`, `floating point `1.5``). A map value or key adds `.key` to the path, a
//! sequence element `[i]`, an enum's content `.variant`; an error of a struct itself (a
//! missing or duplicate field) has the struct's path; the root is `.`. The tests hold both
//! against serde_path_to_error over the derived readers.
//!
//! The whole document is parsed first, so a document that is not valid JSON is reported as
//! such even where a field error comes before the syntax error. An enum field (`mode`,
//! `body_wait`, `report`, `backoff_policy`) holding neither a string nor a one-entry object is
//! refused with its path and type (`mode: invalid type: integer `7`, expected enum
//! AnswerMode`). A struct (a target, `delivery`, `dedupe`, a channel) must be a JSON object:
//! an array of its fields is refused (`reply: invalid type: sequence, expected struct
//! RawTarget`).

use std::fmt;

use serde::de;

use crate::json::kind as json_kind;
pub use crate::json::Node;

/// Why a document could not be read.
#[derive(Debug)]
pub enum ReadError {
    /// Not JSON (serde_json's error, with line and column).
    Syntax(serde_json::Error),
    /// JSON that does not fit: the field path and serde's message.
    Data { path: String, message: String },
}

/// Parses `bytes` (one JSON document, nothing after it) and reads a value from its root with
/// `read`.
pub fn read<T>(
    bytes: &[u8],
    read: impl FnOnce(At) -> Result<T, PathError>,
) -> Result<T, ReadError> {
    let node: Node = serde_json::from_slice(bytes).map_err(ReadError::Syntax)?;
    read(At {
        node: &node,
        chain: &Chain::Root,
    })
    .map_err(|e| ReadError::Data {
        path: e.path,
        message: e.message,
    })
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

/// serde's message (made by serde_json, so worded as serde_json words it) and where it
/// happened.
#[derive(Debug)]
pub struct PathError {
    path: String,
    message: String,
}

/// A value of the tree and where it is. Each reader takes the kinds of value serde's reader
/// of that type took from serde_json, and refuses the rest with the message serde_json gave.
#[derive(Clone, Copy)]
pub struct At<'n, 'c> {
    node: &'n Node,
    chain: &'c Chain<'c>,
}

impl<'n, 'c> At<'n, 'c> {
    /// `error` (made by serde_json, for its wording) at this value's path.
    pub fn fail(self, error: serde_json::Error) -> PathError {
        PathError {
            path: self.chain.to_string(),
            message: error.to_string(),
        }
    }

    /// Not the kind of value `expected` names (`u32`, `a string`, `struct RawTarget`).
    fn wrong_type(self, expected: &str) -> PathError {
        self.message(json_kind::invalid_type(&self.node.kind(), expected))
    }

    fn message(self, message: String) -> PathError {
        PathError {
            path: self.chain.to_string(),
            message,
        }
    }

    /// The value itself.
    pub fn node(self) -> &'n Node {
        self.node
    }

    /// A required field that is not there: the error of the struct at `self`.
    pub fn missing(self, field: &'static str) -> PathError {
        self.fail(de::Error::missing_field(field))
    }

    /// `null` is `None`, anything else is read by `read`.
    pub fn option<T>(
        self,
        read: impl FnOnce(Self) -> Result<T, PathError>,
    ) -> Result<Option<T>, PathError> {
        match self.node {
            Node::Null => Ok(None),
            _ => read(self).map(Some),
        }
    }

    pub fn bool(self) -> Result<bool, PathError> {
        match self.node {
            Node::Bool(v) => Ok(*v),
            _ => Err(self.wrong_type("a boolean")),
        }
    }

    pub fn u32(self) -> Result<u32, PathError> {
        self.unsigned(u32::MAX.into(), "u32").map(|v| v as u32)
    }

    pub fn u64(self) -> Result<u64, PathError> {
        self.unsigned(u64::MAX, "u64")
    }

    /// An integer up to `max`: serde_json has a non-negative one as u64, a negative one as
    /// i64; out of range is the wrong value, anything else the wrong type.
    fn unsigned(self, max: u64, expected: &str) -> Result<u64, PathError> {
        match *self.node {
            Node::Unsigned(v) if v <= max => Ok(v),
            Node::Unsigned(v) => {
                Err(self.message(json_kind::invalid_value(&json_kind::integer(v), expected)))
            }
            Node::Signed(v) => {
                Err(self.message(json_kind::invalid_value(&json_kind::integer(v), expected)))
            }
            _ => Err(self.wrong_type(expected)),
        }
    }

    /// Any number.
    pub fn f64(self) -> Result<f64, PathError> {
        match *self.node {
            Node::Unsigned(v) => Ok(v as f64),
            Node::Signed(v) => Ok(v as f64),
            Node::Float(v) => Ok(v),
            _ => Err(self.wrong_type("f64")),
        }
    }

    pub fn string(self) -> Result<String, PathError> {
        match self.node {
            Node::Str(v) => Ok(v.clone()),
            _ => Err(self.wrong_type("a string")),
        }
    }

    /// An array, each element read by `read` at `[i]`.
    pub fn list<T>(
        self,
        mut read: impl FnMut(At<'n, '_>) -> Result<T, PathError>,
    ) -> Result<Vec<T>, PathError> {
        let Node::Array(items) = self.node else {
            return Err(self.wrong_type("a sequence"));
        };
        let mut list = Vec::with_capacity(items.len());
        for (index, node) in items.iter().enumerate() {
            let chain = Chain::Seq {
                parent: self.chain,
                index,
            };
            list.push(read(At {
                node,
                chain: &chain,
            })?);
        }
        Ok(list)
    }

    /// An object (else the wrong type for `expected`), each entry given to `entry` in
    /// document order, its value at `.key`.
    pub fn map(
        self,
        expected: &str,
        entry: &mut dyn FnMut(&'n str, At<'n, '_>) -> Result<(), PathError>,
    ) -> Result<(), PathError> {
        let Node::Object(entries) = self.node else {
            return Err(self.wrong_type(expected));
        };
        for (key, node) in entries {
            let chain = Chain::Map {
                parent: self.chain,
                key,
            };
            entry(
                key,
                At {
                    node,
                    chain: &chain,
                },
            )?;
        }
        Ok(())
    }

    /// A struct of `fields`, as serde derives its reader with `deny_unknown_fields`: an
    /// object whose entries are given to `field` in document order; an unknown field is
    /// refused at its own path, a field given twice at the struct's. Missing fields are the
    /// caller's (see [`At::missing`]).
    pub fn object(
        self,
        expected: &str,
        fields: &'static [&'static str],
        field: &mut dyn FnMut(&'static str, At<'n, '_>) -> Result<(), PathError>,
    ) -> Result<(), PathError> {
        let mut seen: Vec<&str> = Vec::new();
        self.map(expected, &mut |key, value| {
            let Some(name) = fields.iter().copied().find(|name| *name == key) else {
                return Err(value.fail(de::Error::unknown_field(key, fields)));
            };
            if seen.contains(&name) {
                return Err(self.fail(de::Error::duplicate_field(name)));
            }
            seen.push(name);
            field(name, value)
        })
    }

    /// [`At::object`] into a `T` that starts as its default: `field` sets each field given.
    pub fn fields<T: Default>(
        self,
        expected: &str,
        fields: &'static [&'static str],
        mut field: impl FnMut(&mut T, &'static str, At<'n, '_>) -> Result<(), PathError>,
    ) -> Result<T, PathError> {
        let mut value = T::default();
        self.object(expected, fields, &mut |name, at| {
            field(&mut value, name, at)
        })?;
        Ok(value)
    }

    /// A unit variant of an enum, as serde derives its reader: its name as a string, or an
    /// object of one entry, the name and `null`. `variants` are the names of `values`.
    pub fn variant<E: Copy>(
        self,
        expected: &str,
        variants: &'static [&'static str],
        values: &[E],
    ) -> Result<E, PathError> {
        let (name, content) = match self.node {
            Node::Str(name) => (name, None),
            Node::Object(entries) => match entries.as_slice() {
                [(name, content)] => (name, Some(content)),
                _ => return Err(self.wrong_type(expected)),
            },
            _ => return Err(self.wrong_type(expected)),
        };
        let Some(value) = variants
            .iter()
            .position(|variant| variant == name)
            .and_then(|i| values.get(i))
        else {
            return Err(self.fail(de::Error::unknown_variant(name, variants)));
        };
        match content {
            Some(node) if !matches!(node, Node::Null) => {
                let chain = Chain::Enum {
                    parent: self.chain,
                    variant: name,
                };
                Err(At {
                    node,
                    chain: &chain,
                }
                .wrong_type("unit"))
            }
            _ => Ok(*value),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The reader against the reference: serde_path_to_error over serde_json's streaming
    //! deserializer and the derived readers, on every field of a configuration that uses them
    //! all, each replaced by values of every JSON kind, removed, given twice, and joined by an
    //! unknown field. Both must accept the same documents with the same values, and refuse
    //! the rest with the same path and message.

    use serde_json::{json, Value};

    use super::super::{read, RawConfig};
    use super::ReadError;

    /// serde_path_to_error's path and serde_json's message without its position.
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
        read::config(bytes)
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
               "backoff_max_ms": 100, "dead_letter": target(), "format": "binary"})
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
            "report": "full", "dedupe": {"key": "ce-id", "ttl_ms": 1000, "max_entries": 10},
            "tracing": {"collector": target(), "sampling_ratio": 0.5, "resource": {"k": "v"},
                        "max_queue_spans": 10, "max_batch_spans": 5, "max_batch_delay_ms": 100}
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
                matches!(read::config(doc.as_bytes()), Err(ReadError::Syntax(_))),
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
            match read::config(doc.as_bytes()) {
                Err(ReadError::Data { path, message }) => {
                    assert_eq!(path, "reply");
                    assert_eq!(message, "invalid type: sequence, expected struct RawTarget");
                }
                other => panic!("{other:?}"),
            }
        }
    }
}
