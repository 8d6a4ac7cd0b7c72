//! The CloudEvents attributes of a request, as far as subscription filters, dedupe's event
//! identity, `require_cloudevents`, `delivery.format` and the spans need them: read once, at
//! admission, for all of them.
//!
//! Where they come from, after the CloudEvents HTTP protocol binding (v1.0.2):
//! - **binary mode**: every `ce-<name>` header is the attribute `<name>`, its value decoded
//!   by the binding's rule (a quoted-string unquoted, then percent-decoded:
//!   [`decode_attribute`], the one decoder of this crate; [`encode_attribute`] its inverse);
//!   `content-type` is the `datacontenttype` attribute. A request is a binary
//!   CloudEvent when it has a `ce-type` header.
//! - **structured mode** (`content-type: application/cloudevents+json`): the top-level members
//!   of the JSON body. Strings are taken as they are, numbers and booleans in their canonical
//!   text (`7`, `-1`, `1.5`, `true`); `data` and `data_base64` are the payload, not
//!   attributes, and are skipped without being copied.
//! - **batched mode** (`application/cloudevents-batch+json`) and other structured formats
//!   cannot be filtered: [`EventError::Unsupported`].
//!
//! The headers decide the mode. They are read once, into a [`HeaderView`] (the mode, every
//! `ce-*` header decoded, which ones cannot be), from which each reader takes its part:
//! [`HeaderView::content_mode`], [`HeaderView::identity`], [`HeaderView::validate`]. The body
//! is parsed only for structured mode and only when asked ([`parse_structured_event`]), once
//! the body is complete.
//!
//! Reading does not validate: a missing attribute simply matches no filter that names it.
//! Validation (the required attributes, `specversion`) is asked for separately, for
//! `require_cloudevents`: [`HeaderView::validate`] from the headers,
//! [`StructuredEvent::validate`] once a structured body is parsed. This module knows nothing
//! of proxy-wasm.

use std::borrow::Cow;
use std::fmt;

use percent_encoding::{utf8_percent_encode, AsciiSet, CONTROLS};
use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::Deserialize;

use crate::headers::HeaderMap;
use crate::json::{number_text, Node, OnlyObject};

/// `content-type` of a structured CloudEvent in the JSON event format.
pub const STRUCTURED_JSON: &str = "application/cloudevents+json";
/// What every CloudEvents event format's media type starts with (structured mode in any format,
/// batches): a request with such a `content-type` carries its event in the body.
pub const EVENT_FORMAT_PREFIX: &str = "application/cloudevents";
/// What every batch format's media type starts with.
pub const BATCH_PREFIX: &str = "application/cloudevents-batch";
/// The context attributes every CloudEvent has, in CloudEvents 1.0 and 0.3 alike.
pub const REQUIRED_ATTRIBUTES: [&str; 4] = ["specversion", "id", "source", "type"];
/// The `specversion` values of the CloudEvents versions a channel must accept.
pub const SPEC_VERSIONS: [&str; 2] = ["1.0", "0.3"];

/// An event's context attributes, by name. Events have a handful, so a list searched in
/// order beats a map.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attributes(Vec<(String, String)>);

impl Attributes {
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Sets an attribute; a later value for the same name replaces the earlier one (as a JSON
    /// parser keeping the last duplicate member would).
    pub fn insert(&mut self, name: String, value: String) {
        match self.0.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = value,
            None => self.0.push((name, value)),
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.0.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<const N: usize> From<[(&str, &str); N]> for Attributes {
    fn from(pairs: [(&str, &str); N]) -> Self {
        let mut attributes = Attributes::default();
        for (name, value) in pairs {
            attributes.insert(name.to_string(), value.to_string());
        }
        attributes
    }
}

/// How a request carries its event, as its headers tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContentMode {
    /// Neither `ce-type` nor a CloudEvents content type: not a CloudEvent.
    NotCloudEvent,
    /// Binary mode: the attributes were in the headers, already decoded.
    Binary(Attributes),
    /// Structured JSON: the attributes are in the body.
    Structured,
}

/// A request whose attributes cannot be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventError {
    /// A content type whose events cannot be filtered (batches, non-JSON event formats).
    Unsupported(String),
    /// A `ce-*` header or a structured body that is not what the binding says.
    Malformed(String),
}

impl fmt::Display for EventError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EventError::Unsupported(message) | EventError::Malformed(message) => {
                f.write_str(message)
            }
        }
    }
}

/// The mode of a request, from its headers (lower-case names, as Envoy gives them), every
/// attribute read: [`read_headers_for`] a reader of all of them.
pub fn read_headers(headers: &HeaderMap) -> Result<ContentMode, EventError> {
    read_headers_for(headers, |_| true)
}

/// The mode of a request, from its headers: [`HeaderView::content_mode`] of their view.
pub fn read_headers_for(
    headers: &HeaderMap,
    reads: impl Fn(&str) -> bool,
) -> Result<ContentMode, EventError> {
    HeaderView::read(headers).content_mode(reads)
}

/// What a request's headers tell of its event, read once at admission for every reader: the
/// mode its `content-type` gives, and every `ce-*` header decoded by the binding's rule
/// ([`decode_attribute`]). Each reader takes its part: [`HeaderView::content_mode`] (filters,
/// `delivery.format`, spans), [`HeaderView::identity`] (dedupe's CloudEvents identity),
/// [`HeaderView::validate`] (`require_cloudevents`). Reading refuses nothing: a reader says
/// what it cannot take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderView {
    /// What the `content-type` says; `Err`: it is not text (the 400's message).
    carriage: Result<Carriage, String>,
    /// The attributes of the `ce-*` headers whose value decodes, and `datacontenttype` (the
    /// `content-type`); not read for a structured event, whose attributes are in its body.
    attributes: Attributes,
    /// The `ce-*` headers whose value is not UTF-8 once decoded, in order: the header's name
    /// and its attribute (`None`: the name is no attribute).
    unreadable: Vec<(String, Option<String>)>,
    /// Which [`REQUIRED_ATTRIBUTES`] have a header (bit `i`: the `i`-th).
    present: u8,
}

/// What a request's `content-type` says of its event.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Carriage {
    /// No CloudEvents content type: binary mode, or no CloudEvent.
    Headers,
    /// `application/cloudevents+json`.
    Structured,
    /// A batch format (its media type).
    Batch(String),
    /// Another structured event format (its media type).
    OtherFormat(String),
}

impl HeaderView {
    /// Reads the headers, once.
    pub fn read(headers: &HeaderMap) -> HeaderView {
        let content_type = headers.get("content-type");
        let carriage = match content_type {
            None => Ok(Carriage::Headers),
            Some(value) => text_value("content-type", value).map(|_| {
                let media = media_type(value);
                if media == STRUCTURED_JSON {
                    Carriage::Structured
                } else if media.starts_with(BATCH_PREFIX) {
                    Carriage::Batch(media.into_owned())
                } else if media.starts_with(EVENT_FORMAT_PREFIX) {
                    Carriage::OtherFormat(media.into_owned())
                } else {
                    Carriage::Headers
                }
            }),
        };
        let mut view = HeaderView {
            carriage,
            attributes: Attributes::default(),
            unreadable: Vec::new(),
            present: 0,
        };
        if matches!(view.carriage, Ok(Carriage::Structured) | Err(_)) {
            return view;
        }
        for (name, value) in headers.iter() {
            let Some(attribute) = name.strip_prefix(b"ce-") else {
                continue;
            };
            let attribute = std::str::from_utf8(attribute)
                .ok()
                .filter(|a| !a.is_empty());
            if let Some(i) =
                attribute.and_then(|a| REQUIRED_ATTRIBUTES.iter().position(|r| *r == a))
            {
                view.present |= 1 << i;
            }
            match (attribute, decode_attribute(value)) {
                (Some(attribute), Some(decoded)) => view
                    .attributes
                    .insert(attribute.to_string(), decoded.into_owned()),
                (_, Some(_)) => {}
                (attribute, None) => view.unreadable.push((
                    String::from_utf8_lossy(name).into_owned(),
                    attribute.map(str::to_string),
                )),
            }
        }
        // The binding maps `datacontenttype` to the content-type header in binary mode.
        if let Some(Ok(value)) = content_type.map(std::str::from_utf8) {
            view.attributes
                .insert("datacontenttype".to_string(), value.to_string());
        }
        view
    }

    /// Whether the request is a structured CloudEvent in JSON (its event is in the body).
    pub fn is_structured(&self) -> bool {
        self.carriage == Ok(Carriage::Structured)
    }

    /// Whether `attribute` (one of [`REQUIRED_ATTRIBUTES`]) has a header.
    fn has(&self, attribute: &str) -> bool {
        REQUIRED_ATTRIBUTES
            .iter()
            .position(|r| *r == attribute)
            .is_some_and(|i| self.present & (1 << i) != 0)
    }

    /// Whether `attribute`'s header is not UTF-8 once decoded.
    fn unreadable(&self, attribute: &str) -> bool {
        self.unreadable
            .iter()
            .any(|(_, a)| a.as_deref() == Some(attribute))
    }

    /// The mode, binary attributes decoded. A request is a binary CloudEvent when it has a
    /// `ce-type` header. `reads` tells which attributes someone reads (a channel's filters
    /// name them): one of those whose header is not UTF-8 once percent-decoded is a
    /// [`EventError::Malformed`] naming the header; any other such header is no attribute,
    /// only carried. The `content-type` decides the mode: it must be UTF-8.
    pub fn content_mode(self, reads: impl Fn(&str) -> bool) -> Result<ContentMode, EventError> {
        match self
            .carriage
            .as_ref()
            .map_err(|message| EventError::Malformed(message.clone()))?
        {
            Carriage::Structured => return Ok(ContentMode::Structured),
            Carriage::Batch(media_type) => {
                return Err(EventError::Unsupported(format!(
                    "a batch of CloudEvents ({media_type}) cannot be filtered or converted per \
                     subscriber: send each event on its own, in binary mode or as \
                     {STRUCTURED_JSON}"
                )))
            }
            Carriage::OtherFormat(media_type) => {
                return Err(EventError::Unsupported(format!(
                    "the structured event format {media_type} is not supported: its events \
                     cannot be converted or filtered; send {STRUCTURED_JSON} or binary mode \
                     (ce-* headers)"
                )))
            }
            Carriage::Headers => {}
        }
        if !self.has("type") {
            return Ok(ContentMode::NotCloudEvent);
        }
        let read = self
            .unreadable
            .iter()
            .find(|(_, attribute)| attribute.as_deref().is_some_and(&reads));
        if let Some((name, _)) = read {
            return Err(EventError::Malformed(not_utf8(name.as_bytes())));
        }
        Ok(ContentMode::Binary(self.attributes))
    }

    /// A binary event's identity for dedupe: its `source` and `id` (decoded, as the binding
    /// encodes them), when it has both headers. `Err`: the 400's message naming a header that
    /// cannot be read (the `content-type`, which tells where the identity is, or one of the
    /// two). A structured event's is in its body ([`HeaderView::is_structured`]).
    pub fn identity(&self) -> Result<Option<(&str, &str)>, String> {
        self.carriage.as_ref().map_err(Clone::clone)?;
        if !(self.has("source") && self.has("id")) {
            return Ok(None);
        }
        let text = |attribute: &str| {
            if self.unreadable(attribute) {
                return Err(not_utf8(format!("ce-{attribute}").as_bytes()));
            }
            Ok(self.attributes.get(attribute).unwrap_or_default())
        };
        Ok(Some((text("source")?, text("id")?)))
    }

    /// Whether the headers are those of a valid CloudEvent, as far as headers can tell:
    /// binary mode's required attributes (`ce-specversion`, `ce-id`, `ce-source`, `ce-type`,
    /// present, not empty, UTF-8 once percent-decoded, `specversion` 1.0 or 0.3) and every
    /// other `ce-*` header readable, or the content type of a structured JSON event, whose
    /// body [`StructuredEvent::validate`] checks. `Err`: what is missing or wrong, as a sender
    /// can read it.
    pub fn validate(&self) -> Result<(), String> {
        match self.carriage.as_ref().map_err(Clone::clone)? {
            Carriage::Structured => return Ok(()),
            Carriage::Batch(media_type) | Carriage::OtherFormat(media_type) => {
                return Err(format!(
                    "not one valid CloudEvent: {media_type} is not accepted here; send each \
                     event on its own, in binary mode (ce-* headers) or as {STRUCTURED_JSON}"
                ))
            }
            Carriage::Headers => {}
        }
        if self.present == 0 {
            return Err(format!(
                "not a CloudEvent: neither the headers ce-specversion, ce-id, ce-source and \
                 ce-type of binary mode nor the content-type {STRUCTURED_JSON} of structured mode"
            ));
        }
        check_required("binary", |name| {
            let member = if !self.has(name) {
                Member::Missing
            } else if self.unreadable(name) {
                Member::NotUtf8
            } else {
                self.attributes
                    .get(name)
                    .map_or(Member::Missing, |text| Member::Text(Cow::Borrowed(text)))
            };
            (format!("ce-{name}"), member)
        })?;
        // Every other attribute too (extensions, `subject`, ...): the binding's rule is the
        // same for all, and a valid event has only readable attributes.
        match self.unreadable.first() {
            Some((name, _)) => Err(format!(
                "not a valid CloudEvent (binary mode): {}",
                not_utf8(name.as_bytes())
            )),
            None => Ok(()),
        }
    }
}

/// A header value fanout must read, as text, by the CloudEvents HTTP binding's rule: a `ce-*`
/// value decoded as an attribute ([`decode_attribute`]), any other as it is, which must be
/// UTF-8. `Err`: the message of the 400, naming the header.
pub fn text_value<'v>(name: &str, value: &'v [u8]) -> Result<Cow<'v, str>, String> {
    if name.starts_with("ce-") {
        return decode_attribute(value).ok_or_else(|| not_utf8(name.as_bytes()));
    }
    std::str::from_utf8(value).map(Cow::Borrowed).map_err(|_| {
        format!(
            "header {name} is not UTF-8: fanout reads it, and can read only UTF-8 text \
             (HTTP allows other bytes; fanout carries them only in headers it does not read)"
        )
    })
}

/// The 400's message for a `ce-*` header that is not UTF-8 once percent-decoded.
fn not_utf8(name: &[u8]) -> String {
    format!(
        "header {} is not UTF-8 once percent-decoded, as the CloudEvents HTTP binding \
         requires (a non-ASCII attribute value is sent percent-encoded UTF-8)",
        String::from_utf8_lossy(name)
    )
}

impl ContentMode {
    /// A binary event's attributes when they state its `specversion`: binary mode as
    /// `delivery.format` and the spans take it (a `ce-type` alone makes a request binary for
    /// filters, which read any attribute it has).
    pub fn binary_event(&self) -> Option<&Attributes> {
        match self {
            ContentMode::Binary(attributes) if attributes.get("specversion").is_some() => {
                Some(attributes)
            }
            _ => None,
        }
    }

    /// The event's attributes once the body is complete: `None` for a request that is not a
    /// CloudEvent. Parses the body in structured mode only.
    pub fn attributes(self, body: &[u8]) -> Result<Option<Attributes>, EventError> {
        match self {
            ContentMode::NotCloudEvent => Ok(None),
            ContentMode::Binary(attributes) => Ok(Some(attributes)),
            ContentMode::Structured => parse_structured(body).map(Some),
        }
    }
}

/// Whether the request is a structured CloudEvent in JSON (its event is in the body), by the
/// copying definition of the media type.
#[cfg(test)]
fn is_structured_json(headers: &HeaderMap) -> bool {
    headers
        .get("content-type")
        .is_some_and(|value| media_type(value) == STRUCTURED_JSON)
}

/// Whether the headers are those of a valid CloudEvent, as far as headers can tell:
/// [`HeaderView::validate`] of their view.
pub fn validate_headers(headers: &HeaderMap) -> Result<(), String> {
    HeaderView::read(headers).validate()
}

/// What one required attribute is, for [`check_required`].
pub enum Member<'v> {
    Missing,
    Text(Cow<'v, str>),
    /// A structured member that is not a JSON string.
    NotString,
    /// A binary header that is not UTF-8 once decoded.
    NotUtf8,
}

/// Binary mode's required attributes, each `ce-<name>` header as `header` finds it (present,
/// decoded as [`decode_attribute`] does): [`check_required`].
pub fn check_binary_required<'h>(header: impl Fn(&str) -> Option<&'h [u8]>) -> Result<(), String> {
    check_required("binary", |name| {
        let spelled = format!("ce-{name}");
        let member = match header(&spelled) {
            None => Member::Missing,
            Some(value) => decode_attribute(value).map_or(Member::NotUtf8, Member::Text),
        };
        (spelled, member)
    })
}

/// The one check of the [`REQUIRED_ATTRIBUTES`]: each present, a non-empty string, and
/// `specversion` one of [`SPEC_VERSIONS`], as `lookup` finds it (its spelling in the request,
/// and what it is). `Err` says everything wrong at once, in `mode`'s words (`binary`,
/// `structured`).
pub fn check_required<'v>(
    mode: &str,
    lookup: impl Fn(&'static str) -> (String, Member<'v>),
) -> Result<(), String> {
    let mut problems = Vec::new();
    for name in REQUIRED_ATTRIBUTES {
        let (spelled, member) = lookup(name);
        match member {
            Member::Missing => problems.push(format!("{spelled} is missing")),
            Member::NotString => problems.push(format!("{spelled} is not a string")),
            Member::NotUtf8 => {
                problems.push(format!("{spelled} is not UTF-8 once percent-decoded"))
            }
            Member::Text(text) if text.is_empty() => problems.push(format!("{spelled} is empty")),
            Member::Text(text) if name == "specversion" && !SPEC_VERSIONS.contains(&&*text) => {
                problems.push(format!(
                    "{spelled} is \"{}\", not one of {}",
                    text.escape_debug(),
                    SPEC_VERSIONS.join(", ")
                ))
            }
            Member::Text(_) => {}
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "not a valid CloudEvent ({mode} mode): {}",
            problems.join(", ")
        ))
    }
}

/// The media type of a content-type value: lower case, without parameters.
pub fn media_type(value: &[u8]) -> Cow<'_, str> {
    let value = value.split(|&b| b == b';').next().unwrap_or(value);
    match std::str::from_utf8(value) {
        // The usual value, already trimmed and lower-case: no copy.
        Ok(text) if !text.bytes().any(|b| b.is_ascii_uppercase()) => Cow::Borrowed(text.trim()),
        _ => Cow::Owned(String::from_utf8_lossy(value).trim().to_ascii_lowercase()),
    }
}

/// A `ce-*` header value decoded into its attribute's value, as the HTTP binding says
/// (3.1.3.2), the one decoder every reader uses (filters, `require_cloudevents`, dedupe's
/// identity, `delivery.format`): a quoted-string (RFC 7230 3.2.6) is first unquoted, its
/// backslash escapes undone (older senders quote rather than percent-encode); then one round
/// of percent-decoding, `%XX` (either case of hex digit) becoming the byte XX, a `%` not
/// followed by two hex digits staying as it is. `None`: the result is not UTF-8, which the
/// binding rejects. A value that only starts or ends with `"` is no quoted-string and is taken
/// as it is. Borrowed when there is nothing to decode.
pub fn decode_attribute(value: &[u8]) -> Option<Cow<'_, str>> {
    let decoded = match unquote(value) {
        Some(unquoted) => Cow::Owned(percent_decode(&unquoted).into_owned()),
        None => percent_decode(value),
    };
    match decoded {
        Cow::Borrowed(raw) => std::str::from_utf8(raw).ok().map(Cow::Borrowed),
        Cow::Owned(bytes) => String::from_utf8(bytes).ok().map(Cow::Owned),
    }
}

/// The inside of a quoted-string, `\x` read as `x`; `None` when `value` is no quoted-string
/// (no `"` at both ends, an unescaped `"` inside, or the closing one escaped).
fn unquote(value: &[u8]) -> Option<Vec<u8>> {
    let inner = value.strip_prefix(b"\"")?.strip_suffix(b"\"")?;
    let mut bytes = Vec::with_capacity(inner.len());
    let mut escaped = false;
    for &b in inner {
        match (escaped, b) {
            (false, b'\\') => escaped = true,
            (false, b'"') => return None,
            _ => {
                bytes.push(b);
                escaped = false;
            }
        }
    }
    (!escaped).then_some(bytes)
}

/// One round of percent-decoding. Borrowed when there is nothing to decode.
fn percent_decode(value: &[u8]) -> Cow<'_, [u8]> {
    percent_encoding::percent_decode(value).into()
}

/// What the binding (3.1.3.2) percent-encodes in a `ce-*` header value: space, `"`, `%`, the
/// controls (which it recommends encoding); non-ASCII is always encoded.
const HEADER_VALUE: &AsciiSet = &CONTROLS.add(b' ').add(b'"').add(b'%');

/// An attribute's value as its `ce-*` header value (3.1.3.2): [`decode_attribute`]'s inverse,
/// with upper-case hex digits.
pub fn encode_attribute(value: &str) -> String {
    utf8_percent_encode(value, HEADER_VALUE).to_string()
}

/// The attributes of a structured JSON event: its top-level members but the payload.
pub fn parse_structured(body: &[u8]) -> Result<Attributes, EventError> {
    parse_structured_event(body).map(|event| event.attributes)
}

/// A structured JSON event: its attributes, and which required ones were not JSON strings.
pub fn parse_structured_event(body: &[u8]) -> Result<StructuredEvent, EventError> {
    serde_json::from_slice::<StructuredEvent>(body).map_err(|e| {
        EventError::Malformed(format!(
            "the body is not a structured CloudEvent ({STRUCTURED_JSON} must be one JSON \
             object): {e}"
        ))
    })
}

/// A parsed structured event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StructuredEvent {
    /// Its top-level members but the payload, as filters match them.
    pub attributes: Attributes,
    /// The [`REQUIRED_ATTRIBUTES`] whose member is there but not a JSON string (CloudEvents
    /// requires strings; [`Attributes`] holds numbers and booleans as text).
    not_strings: Vec<&'static str>,
}

impl StructuredEvent {
    /// A required attribute's value, when its member is a JSON string.
    pub fn required(&self, name: &str) -> Option<&str> {
        if self.not_strings.contains(&name) {
            return None;
        }
        self.attributes.get(name)
    }

    /// Whether it is a valid CloudEvent: every required attribute a non-empty string,
    /// `specversion` 1.0 or 0.3. `Err`: what is missing or wrong.
    pub fn validate(&self) -> Result<(), String> {
        check_required("structured", |name| {
            let member = if self.not_strings.contains(&name) {
                Member::NotString
            } else {
                match self.attributes.get(name) {
                    Some(value) => Member::Text(Cow::Borrowed(value)),
                    None => Member::Missing,
                }
            };
            (format!("member {name}"), member)
        })
    }
}

impl<'de> Deserialize<'de> for StructuredEvent {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(OnlyObject(EventVisitor))
    }
}

struct EventVisitor;

impl<'de> Visitor<'de> for EventVisitor {
    type Value = StructuredEvent;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<StructuredEvent, A::Error> {
        let mut attributes = Attributes::default();
        let mut not_strings = Vec::new();
        while let Some(name) = map.next_key::<String>()? {
            if name == "data" || name == "data_base64" {
                // Scanned (the body must be valid JSON) but never copied.
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            let value = map.next_value::<Node>()?;
            if let Some(required) = REQUIRED_ATTRIBUTES.into_iter().find(|r| *r == name) {
                // A later duplicate member wins, for its type as for its value.
                not_strings.retain(|r| *r != required);
                if !matches!(value, Node::Str(_)) {
                    not_strings.push(required);
                }
            }
            if let Some(text) = attribute_text(value) {
                attributes.insert(name, text);
            }
        }
        Ok(StructuredEvent {
            attributes,
            not_strings,
        })
    }
}

/// A member's value as attribute text: strings as they are, numbers and booleans in their
/// canonical text (an f64 in Rust's shortest round-trip form: `1.5`, and `1` for `1.0` or
/// `1e0`). Attributes are scalars: `null`, objects and arrays are no attribute value. Read
/// through [`Node`], the configuration's reader too: one serde_json instance for both
/// (bench/README.md: module size).
fn attribute_text(value: Node) -> Option<String> {
    match value {
        Node::Str(text) => Some(text),
        Node::Bool(b) => Some(b.to_string()),
        Node::Unsigned(n) => Some(n.to_string()),
        Node::Signed(n) => Some(n.to_string()),
        Node::Float(n) => Some(number_text(n)),
        Node::Null | Node::Array(_) | Node::Object(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_is_read_by_the_bindings_rule_and_a_refusal_names_the_header() {
        assert_eq!(text_value("ce-id", b"a%20b").unwrap(), "a b");
        assert_eq!(
            text_value("ce-greeting", b"gr%C3%BC%C3%9Fe").unwrap(),
            "grüße"
        );
        assert_eq!(text_value("ce-id", "grüße".as_bytes()).unwrap(), "grüße");
        assert!(matches!(
            text_value("ce-id", b"plain"),
            Ok(Cow::Borrowed("plain"))
        ));
        // Only ce-* values are percent-decoded.
        assert_eq!(text_value("x-key", b"a%20b").unwrap(), "a%20b");
        assert_eq!(text_value(":authority", b"a%FF").unwrap(), "a%FF");
        for (name, value) in [
            ("ce-greeting", &b"gr\xfc\xdfe"[..]),
            ("ce-greeting", b"gr%FCn"),
            ("ce-id", b"%C3"),
        ] {
            let error = text_value(name, value).unwrap_err();
            assert!(
                error.starts_with(&format!("header {name} is not UTF-8 once percent-decoded")),
                "{error}"
            );
        }
        let error = text_value("content-type", b"text/plain; x=K\xf6ln").unwrap_err();
        assert!(
            error.starts_with("header content-type is not UTF-8"),
            "{error}"
        );
    }

    #[test]
    fn only_the_attributes_someone_reads_must_be_readable() {
        let map = |extra: &[(&str, &[u8])]| {
            let mut pairs: Vec<(&str, &[u8])> = vec![("ce-type", b"t"), ("ce-id", b"1")];
            pairs.extend_from_slice(extra);
            HeaderMap::from_pairs(&pairs)
        };
        let latin1 = map(&[("ce-greeting", b"gr\xfc\xdfe")]);
        // Nobody reads `greeting`: no attribute, no error.
        let reads_type = |name: &str| name == "type";
        assert_eq!(
            read_headers_for(&latin1, reads_type),
            Ok(ContentMode::Binary(Attributes::from([
                ("type", "t"),
                ("id", "1")
            ])))
        );
        // A reader of `greeting` (or of everything) gets a 400 naming the header.
        for error in [
            read_headers_for(&latin1, |name| name == "greeting").unwrap_err(),
            read_headers(&latin1).unwrap_err(),
        ] {
            assert!(matches!(&error, EventError::Malformed(m) if m.contains("ce-greeting")));
        }
        // The content type decides the mode: it must be text.
        let ct = map(&[("content-type", b"text/plain; name=K\xf6ln")]);
        let error = read_headers_for(&ct, reads_type).unwrap_err();
        assert!(matches!(&error, EventError::Malformed(m) if m.contains("content-type")));
    }

    /// One read of the headers answers every reader, each by its own rule: filters see a
    /// binary event only with `ce-type`, dedupe's identity needs `ce-source` and `ce-id`
    /// alone, `require_cloudevents` every required header, and an unreadable value is refused
    /// only by a reader that reads it.
    #[test]
    fn one_view_of_the_headers_serves_every_reader() {
        let view = |pairs: &[(&str, &[u8])]| HeaderView::read(&HeaderMap::from_pairs(pairs));
        let identity_only = view(&[("ce-source", b"%2Fs"), ("ce-id", b"\"1\"")]);
        assert_eq!(identity_only.identity(), Ok(Some(("/s", "1"))));
        assert_eq!(
            identity_only.clone().content_mode(|_| true),
            Ok(ContentMode::NotCloudEvent)
        );
        let error = identity_only.validate().unwrap_err();
        assert!(error.contains("ce-specversion is missing"), "{error}");

        let latin1 = view(&[
            ("ce-type", b"t"),
            ("ce-source", b"/s"),
            ("ce-id", b"%FF"),
            ("ce-greeting", b"gr\xfc\xdfe"),
        ]);
        let error = latin1.identity().unwrap_err();
        assert!(error.starts_with("header ce-id is not UTF-8"), "{error}");
        let error = latin1.validate().unwrap_err();
        assert!(error.contains("ce-id is not UTF-8"), "{error}");
        assert_eq!(
            latin1.clone().content_mode(|name| name == "type"),
            Ok(ContentMode::Binary(Attributes::from([
                ("type", "t"),
                ("source", "/s")
            ])))
        );
        let error = latin1.content_mode(|name| name == "greeting").unwrap_err();
        assert!(matches!(&error, EventError::Malformed(m) if m.contains("ce-greeting")));

        // A structured event's attributes are in its body: its headers are not decoded.
        let structured = view(&[
            ("content-type", b"application/cloudevents+json"),
            ("ce-id", b"%FF"),
        ]);
        assert!(structured.is_structured());
        assert_eq!(structured.identity(), Ok(None));
        assert_eq!(structured.validate(), Ok(()));
        assert_eq!(
            structured.content_mode(|_| true),
            Ok(ContentMode::Structured)
        );
    }

    #[test]
    fn require_cloudevents_refuses_any_attribute_that_is_not_utf8() {
        let valid: [(&str, &[u8]); 4] = [
            ("ce-specversion", b"1.0"),
            ("ce-id", b"1"),
            ("ce-source", b"/s"),
            ("ce-type", b"t"),
        ];
        let with = |extra: (&str, &[u8])| {
            let mut pairs = valid.to_vec();
            pairs.push(extra);
            validate_headers(&HeaderMap::from_pairs(&pairs))
        };
        assert_eq!(with(("ce-greeting", b"gr%C3%BC%C3%9Fe")), Ok(()));
        assert_eq!(with(("x-other", b"\xff")), Ok(()), "not an attribute");
        let error = with(("ce-greeting", b"gr\xfc\xdfe")).unwrap_err();
        assert!(
            error.starts_with(
                "not a valid CloudEvent (binary mode): header ce-greeting is not UTF-8 once \
                 percent-decoded"
            ),
            "{error}"
        );
        let error = with(("content-type", b"text/\xff")).unwrap_err();
        assert!(
            error.contains("header content-type is not UTF-8"),
            "{error}"
        );
    }

    /// The media type as the copying definition gives it: up to `;`, lossily decoded, trimmed,
    /// lower-cased.
    fn media_type_by_copy(value: &[u8]) -> String {
        let end = value.iter().position(|&b| b == b';').unwrap_or(value.len());
        String::from_utf8_lossy(&value[..end])
            .trim()
            .to_ascii_lowercase()
    }

    #[test]
    fn structured_json_is_told_as_the_copying_media_type_tells_it() {
        let values: [&[u8]; 9] = [
            b"application/cloudevents+json",
            b"Application/CloudEvents+JSON; charset=utf-8",
            b"  application/cloudevents+json\x0b;x",
            b"application/cloudevents-batch+json",
            b"application/json",
            b"",
            b";application/cloudevents+json",
            "\u{a0}application/cloudevents+json".as_bytes(),
            b"application/cloudevents+json\xff",
        ];
        for value in values {
            assert_eq!(media_type(value), media_type_by_copy(value), "{value:?}");
            let headers = HeaderMap::from_pairs(&[("content-type".as_bytes(), value)]);
            assert_eq!(
                is_structured_json(&headers),
                media_type_by_copy(value) == STRUCTURED_JSON,
                "{value:?}"
            );
        }
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        HeaderMap::from_pairs(pairs)
    }

    fn binary(pairs: &[(&str, &str)]) -> Attributes {
        match read_headers(&headers(pairs)) {
            Ok(ContentMode::Binary(attributes)) => attributes,
            other => panic!("not binary mode: {other:?}"),
        }
    }

    #[test]
    fn binary_mode_takes_every_ce_header() {
        let a = binary(&[
            (":method", "POST"),
            ("ce-specversion", "1.0"),
            ("ce-type", "com.example.order.created"),
            ("ce-source", "/orders/eu"),
            ("ce-id", "42"),
            ("ce-subject", "invoice.pdf"),
            ("ce-extension1", "x"),
            ("x-other", "no"),
            ("content-type", "application/json; charset=utf-8"),
        ]);
        assert_eq!(a.get("type"), Some("com.example.order.created"));
        assert_eq!(a.get("source"), Some("/orders/eu"));
        assert_eq!(a.get("id"), Some("42"));
        assert_eq!(a.get("subject"), Some("invoice.pdf"));
        assert_eq!(a.get("extension1"), Some("x"));
        assert_eq!(a.get("specversion"), Some("1.0"));
        assert_eq!(
            a.get("datacontenttype"),
            Some("application/json; charset=utf-8")
        );
        assert_eq!(a.get("other"), None);
        assert_eq!(a.get("method"), None);
    }

    #[test]
    fn binary_values_are_percent_decoded() {
        let a = binary(&[
            ("ce-type", "order%20created"),
            ("ce-source", "%2Forders%2fEU"),
            ("ce-subject", "caf%C3%A9 %E2%82%AC"),
            // not an escape: stays as it is
            ("ce-ext1", "100%"),
            ("ce-ext2", "%zz%4"),
            ("ce-ext3", "a%%41"),
            // decoded once only
            ("ce-ext4", "%2541"),
        ]);
        assert_eq!(a.get("type"), Some("order created"));
        assert_eq!(a.get("source"), Some("/orders/EU"));
        assert_eq!(a.get("subject"), Some("café €"));
        assert_eq!(a.get("ext1"), Some("100%"));
        assert_eq!(a.get("ext2"), Some("%zz%4"));
        assert_eq!(a.get("ext3"), Some("a%A"));
        assert_eq!(a.get("ext4"), Some("%41"));
    }

    #[test]
    fn a_quoted_string_is_unquoted_before_percent_decoding() {
        let decoded = |value: &[u8]| decode_attribute(value).map(Cow::into_owned);
        let cases: [(&[u8], Option<&str>); 12] = [
            (br#""abc""#, Some("abc")),
            (br#""a b""#, Some("a b")),
            (br#""say \"hi\" 100%25""#, Some(r#"say "hi" 100%"#)),
            (br#""a\\b""#, Some(r"a\b")),
            (br#""\x""#, Some("x")),
            (br#""""#, Some("")),
            (br#""%C3%A9""#, Some("é")),
            // No quoted-string: taken as it is, then percent-decoded.
            (br#""abc"#, Some(r#""abc"#)),
            (br#"abc""#, Some(r#"abc""#)),
            (br#"""#, Some(r#"""#)),
            (br#""a"b""#, Some(r#""a"b""#)),
            (br#""a\""#, Some(r#""a\""#)),
        ];
        for (value, want) in cases {
            let value_text = String::from_utf8_lossy(value);
            assert_eq!(decoded(value).as_deref(), want, "{value_text}");
        }
        assert_eq!(decode_attribute(br#""%FF""#), None);
        assert!(matches!(decode_attribute(b"plain"), Some(Cow::Borrowed(_))));
        // Every reader of the headers goes through it.
        assert_eq!(text_value("ce-id", br#""a b""#).unwrap(), "a b");
        assert_eq!(text_value("x-key", br#""a b""#).unwrap(), r#""a b""#);
        let a = binary(&[("ce-type", r#""t""#), ("ce-id", r#""1""#)]);
        assert_eq!((a.get("type"), a.get("id")), (Some("t"), Some("1")));
    }

    #[test]
    fn encoding_is_decodings_inverse() {
        for value in ["abc", "a b", r#"say "hi" 100%"#, "grüße\n", "", "%41"] {
            let encoded = encode_attribute(value);
            assert!(
                encoded.bytes().all(|b| b.is_ascii_graphic() && b != b'"'),
                "{encoded}"
            );
            assert_eq!(decode_attribute(encoded.as_bytes()).as_deref(), Some(value));
        }
        assert_eq!(encode_attribute("a b\"%é"), "a%20b%22%25%C3%A9");
    }

    #[test]
    fn percent_decoding_at_the_end_of_a_value() {
        assert_eq!(percent_decode(b"%41").as_ref(), b"A");
        assert_eq!(percent_decode(b"x%4").as_ref(), b"x%4");
        assert_eq!(percent_decode(b"x%").as_ref(), b"x%");
        assert_eq!(percent_decode(b"%").as_ref(), b"%");
        assert_eq!(percent_decode(b"").as_ref(), b"");
        assert!(matches!(percent_decode(b"plain"), Cow::Borrowed(_)));
    }

    #[test]
    fn a_percent_escape_that_is_not_utf8_is_malformed() {
        let err = read_headers(&headers(&[("ce-type", "t"), ("ce-source", "%FF")])).unwrap_err();
        assert!(
            matches!(&err, EventError::Malformed(m) if m.contains("ce-source")),
            "{err}"
        );
        let raw = HeaderMap::from_pairs(&[
            ("ce-type".as_bytes(), "t".as_bytes()),
            ("ce-subject".as_bytes(), &[0xc3, 0x28]),
        ]);
        assert!(matches!(read_headers(&raw), Err(EventError::Malformed(_))));
    }

    #[test]
    fn without_ce_type_or_cloudevents_content_type_it_is_not_a_cloudevent() {
        let cases: &[&[(&str, &str)]] = &[
            &[],
            &[("content-type", "application/json")],
            &[("ce-source", "/x"), ("ce-id", "1")],
            &[("content-type", "text/plain"), ("ce-specversion", "1.0")],
        ];
        for pairs in cases {
            assert_eq!(
                read_headers(&headers(pairs)),
                Ok(ContentMode::NotCloudEvent),
                "{pairs:?}"
            );
        }
    }

    #[test]
    fn content_type_decides_structured_and_batched() {
        let mode = |ct: &str| read_headers(&headers(&[("content-type", ct), ("ce-type", "t")]));
        assert_eq!(
            mode("application/cloudevents+json"),
            Ok(ContentMode::Structured)
        );
        assert_eq!(
            mode("Application/CloudEvents+JSON; charset=UTF-8"),
            Ok(ContentMode::Structured)
        );
        let batch = mode("application/cloudevents-batch+json").unwrap_err();
        assert!(
            matches!(&batch, EventError::Unsupported(m) if m.contains("batch")),
            "{batch}"
        );
        assert!(matches!(
            mode("application/cloudevents+avro"),
            Err(EventError::Unsupported(_))
        ));
        // Any other content type with ce-type is binary mode.
        assert!(matches!(
            mode("application/json"),
            Ok(ContentMode::Binary(_))
        ));
    }

    #[test]
    fn structured_members_are_the_attributes_but_data() {
        let body = br#"{
            "specversion": "1.0", "type": "com.example.order.created", "source": "/orders",
            "id": "A234-1234-1234", "time": "2018-04-05T17:31:00Z",
            "datacontenttype": "application/json",
            "sequence": 7, "negative": -3, "ratio": 1.5, "whole": 2.0, "big": 1e3,
            "flag": true, "off": false, "nothing": null,
            "nested": {"type": "inner"}, "list": ["a", 1],
            "data": {"type": "not me", "items": [{"deep": {"deeper": [1, 2, {"x": null}]}}]},
            "data_base64": "aGVsbG8="
        }"#;
        let a = parse_structured(body).unwrap();
        assert_eq!(a.get("type"), Some("com.example.order.created"));
        assert_eq!(a.get("source"), Some("/orders"));
        assert_eq!(a.get("time"), Some("2018-04-05T17:31:00Z"));
        assert_eq!(a.get("sequence"), Some("7"));
        assert_eq!(a.get("negative"), Some("-3"));
        assert_eq!(a.get("ratio"), Some("1.5"));
        assert_eq!(a.get("whole"), Some("2"));
        assert_eq!(a.get("big"), Some("1000"));
        assert_eq!(a.get("flag"), Some("true"));
        assert_eq!(a.get("off"), Some("false"));
        assert_eq!(a.get("nothing"), None);
        assert_eq!(a.get("nested"), None);
        assert_eq!(a.get("list"), None);
        assert_eq!(a.get("data"), None);
        assert_eq!(a.get("data_base64"), None);
        assert_eq!(a.get("items"), None);
        assert_eq!(a.len(), 13);
    }

    /// The words of serde_json's messages, for a body that is not an object, as serde_json
    /// itself gave them.
    #[test]
    fn a_body_that_is_not_an_object_is_refused_in_serde_jsons_words() {
        for (body, kind) in [
            ("null", "null"),
            ("true", "boolean `true`"),
            ("7", "integer `7`"),
            ("-3", "integer `-3`"),
            ("1.5", "floating point `1.5`"),
            ("1e300", "floating point `1e+300`"),
            ("\"a\\\"b\"", "string \"a\\\"b\""),
            ("[1]", "sequence"),
        ] {
            let Err(EventError::Malformed(message)) = parse_structured(body.as_bytes()) else {
                panic!("{body} was read");
            };
            assert!(
                message.contains(&format!("invalid type: {kind}, expected a JSON object")),
                "{body}: {message}"
            );
            let serde_json_says =
                serde_json::from_str::<std::collections::BTreeMap<String, u8>>(body)
                    .unwrap_err()
                    .to_string();
            assert!(
                serde_json_says.starts_with(&format!("invalid type: {kind}, expected")),
                "{serde_json_says}"
            );
        }
    }

    #[test]
    fn structured_unicode_and_escapes() {
        let body = r#"{"type": "ordre.créé", "source": "\u00e9v\u00e9nement/\ud83d\ude00",
                       "subject": "line\nbreak \"quoted\"", "ünïcödé": "ja 日本",
                       "data": "データ 🎉"}"#;
        let a = parse_structured(body.as_bytes()).unwrap();
        assert_eq!(a.get("type"), Some("ordre.créé"));
        assert_eq!(a.get("source"), Some("événement/😀"));
        assert_eq!(a.get("subject"), Some("line\nbreak \"quoted\""));
        assert_eq!(a.get("ünïcödé"), Some("ja 日本"));
    }

    #[test]
    fn a_later_duplicate_member_wins() {
        let a = parse_structured(br#"{"type": "a", "type": "b"}"#).unwrap();
        assert_eq!(a.get("type"), Some("b"));
        assert_eq!(a.len(), 1);
    }

    #[test]
    fn required_attributes_are_taken_only_as_json_strings() {
        let event = parse_structured_event(
            br#"{"specversion": "1.0", "id": 7, "source": "/s", "type": null, "time": 1}"#,
        )
        .unwrap();
        assert_eq!(event.required("specversion"), Some("1.0"));
        assert_eq!(event.required("source"), Some("/s"));
        // Filters still see a number as its text; the identity does not.
        assert_eq!(event.attributes.get("id"), Some("7"));
        assert_eq!(event.required("id"), None);
        assert_eq!(event.required("type"), None);
        let error = event.validate().unwrap_err();
        assert_eq!(
            error,
            "not a valid CloudEvent (structured mode): member id is not a string, member type \
             is not a string"
        );
        // A later duplicate decides the type as well as the value.
        let event = parse_structured_event(br#"{"id": 7, "id": "x"}"#).unwrap();
        assert_eq!(event.required("id"), Some("x"));
        let event = parse_structured_event(br#"{"id": "x", "id": 7}"#).unwrap();
        assert_eq!(event.required("id"), None);
    }

    #[test]
    fn valid_binary_headers_and_what_is_wrong_otherwise() {
        let valid = [
            ("ce-specversion", "0.3"),
            ("ce-id", "1"),
            ("ce-source", "%2Fs"),
            ("ce-type", "t"),
        ];
        assert_eq!(validate_headers(&headers(&valid)), Ok(()));
        let structured = [(
            "content-type",
            "Application/CloudEvents+JSON; charset=utf-8",
        )];
        assert_eq!(validate_headers(&headers(&structured)), Ok(()));
        assert_eq!(
            validate_headers(&headers(&[("ce-specversion", ""), ("ce-id", "1")])),
            Err(
                "not a valid CloudEvent (binary mode): ce-specversion is empty, ce-source is \
                 missing, ce-type is missing"
                    .to_string()
            )
        );
    }

    #[test]
    fn malformed_structured_bodies_are_errors() {
        let cases: &[&[u8]] = &[
            b"",
            b"   ",
            b"not json",
            b"[]",
            b"\"type\"",
            b"{\"type\": \"a\"",
            b"{\"type\": \"a\"} trailing",
            b"{\"type\": \"a\", \"data\": {\"x\": }}",
            b"{\"type\": \"\xff\"}",
            b"{\"type\": \"a\"}{}",
        ];
        for body in cases {
            let err = parse_structured(body).unwrap_err();
            assert!(
                matches!(&err, EventError::Malformed(m) if m.contains("structured CloudEvent")),
                "{:?}: {err}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn attributes_are_read_from_the_body_only_in_structured_mode() {
        assert_eq!(
            ContentMode::NotCloudEvent.attributes(b"{not json"),
            Ok(None)
        );
        let binary = Attributes::from([("type", "t")]);
        assert_eq!(
            ContentMode::Binary(binary.clone()).attributes(b"{not json"),
            Ok(Some(binary))
        );
        assert_eq!(
            ContentMode::Structured.attributes(br#"{"type": "t", "data": 1}"#),
            Ok(Some(Attributes::from([("type", "t")])))
        );
        assert!(ContentMode::Structured.attributes(b"{not json").is_err());
    }
}
