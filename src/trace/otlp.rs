//! The part of OTLP's trace protocol fanout sends (`opentelemetry/proto/collector/trace/v1`,
//! `trace/v1/trace.proto`, `common/v1/common.proto`, `resource/v1/resource.proto` in
//! open-telemetry/opentelemetry-proto), as messages of the wire codec ([`crate::protowire`])
//! with OTLP's field numbers; fields fanout never sets (events, links, dropped counts, schema
//! URLs) are left out, which encodes exactly as if they were empty. The spans a request makes
//! are written field by field as they become known ([`attribute`], [`status`]) into one
//! buffer each, with no message built: an ended span is its encoded fields, and an export
//! wraps them ([`encode`]). The messages are what the tests decode.

use std::borrow::Cow;

pub use crate::protowire::Message;
use crate::protowire::{varint_len, DecodeError, Field, Writer};

/// What the collector's `/v1/traces` takes (OTLP/HTTP, `application/x-protobuf`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExportTraceServiceRequest {
    pub resource_spans: Vec<ResourceSpans>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ResourceSpans {
    pub resource: Option<Resource>,
    pub scope_spans: Vec<ScopeSpans>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Resource {
    pub attributes: Vec<KeyValue>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ScopeSpans {
    pub scope: Option<InstrumentationScope>,
    pub spans: Vec<Span>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct InstrumentationScope {
    pub name: String,
    pub version: String,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Span {
    pub trace_id: Vec<u8>,
    pub span_id: Vec<u8>,
    pub trace_state: String,
    /// Empty for a root span.
    pub parent_span_id: Vec<u8>,
    pub name: String,
    /// `Span.SpanKind`: [`SERVER`], [`CLIENT`], [`PRODUCER`].
    pub kind: i32,
    pub start_time_unix_nano: u64,
    pub end_time_unix_nano: u64,
    pub attributes: Vec<KeyValue>,
    pub status: Option<Status>,
    /// `SpanFlags`: bit 8 says whether the parent is known to be remote (bit 9).
    pub flags: u32,
}

/// `Span.SpanKind`.
pub const SERVER: i32 = 2;
pub const CLIENT: i32 = 3;
pub const PRODUCER: i32 = 4;

/// `SpanFlags`: the parent's remoteness is known (`HAS_IS_REMOTE`), and it is remote.
pub const PARENT_KNOWN_LOCAL: u32 = 0x100;
pub const PARENT_REMOTE: u32 = 0x300;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Status {
    pub message: String,
    /// `Status.StatusCode`: 0 unset, 1 ok, [`ERROR`].
    pub code: i32,
}

/// `Status.StatusCode.STATUS_CODE_ERROR`.
pub const ERROR: i32 = 2;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct KeyValue {
    /// A span's attribute names are the conventions' own, static; a resource's are the
    /// configuration's.
    pub key: Cow<'static, str>,
    pub value: Option<AnyValue>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct AnyValue {
    pub value: Option<Value>,
}

/// `AnyValue.value`, the kinds fanout's attributes have (fields 1, 2, 3).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    String(String),
    Bool(bool),
    Int(i64),
}

impl KeyValue {
    pub fn new(key: impl Into<Cow<'static, str>>, value: Value) -> KeyValue {
        KeyValue {
            key: key.into(),
            value: Some(AnyValue { value: Some(value) }),
        }
    }
}

/// `span` (a `Span`'s encoded fields) as one `ScopeSpans.spans` field, after `out`.
pub fn frame(out: &mut Vec<u8>, span: &[u8]) {
    out.reserve(1 + varint_len(span.len() as u64) + span.len());
    out.push(0x12);
    crate::protowire::push_varint(out, span.len() as u64);
    out.extend_from_slice(span);
}

/// The body of one export: `spans` (`ScopeSpans.spans` fields, [`frame`]d) under one
/// resource and fanout's instrumentation scope.
pub fn encode(resource: &[KeyValue], spans: &[u8]) -> Vec<u8> {
    let scope = InstrumentationScope {
        name: "fanout".into(),
        version: env!("CARGO_PKG_VERSION").into(),
    };
    let resource = Resource {
        attributes: resource.to_vec(),
    };
    let spans_len = spans.len();
    let mut out = Writer::with_capacity(spans_len + 256);
    // ExportTraceServiceRequest.resource_spans, then ResourceSpans.scope_spans: the spans'
    // bytes are written once, inside their known lengths.
    let scope_bytes = scope.encode_to_vec();
    let scope_spans_len = 1 + varint_len(scope_bytes.len() as u64) + scope_bytes.len() + spans_len;
    let resource_bytes = resource.encode_to_vec();
    let resource_spans_len = 1
        + varint_len(resource_bytes.len() as u64)
        + resource_bytes.len()
        + 1
        + varint_len(scope_spans_len as u64)
        + scope_spans_len;
    out.header(1, resource_spans_len);
    out.len_delimited(1, &resource_bytes);
    out.header(2, scope_spans_len);
    out.len_delimited(1, &scope_bytes);
    out.raw(spans);
    out.into_bytes()
}

/// A span attribute's value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AttributeValue<'a> {
    Str(&'a str),
    Int(i64),
    Bool(bool),
}

/// `Span.attributes` (field 9): one `KeyValue`, written as `KeyValue::encode_fields` would
/// write it, with no message built.
pub fn attribute(out: &mut Writer, key: &str, value: AttributeValue<'_>) {
    // AnyValue: its one member (written even at its default): its tag, and its length or
    // value.
    let (member, value_bytes): (u8, &[u8]) = match value {
        AttributeValue::Str(s) => (0x0a, s.as_bytes()),
        AttributeValue::Bool(b) => (0x10, if b { &[1] } else { &[0] }),
        AttributeValue::Int(_) => (0x18, &[]),
    };
    let int = match value {
        AttributeValue::Int(i) => Some(i as u64),
        _ => None,
    };
    let any_len = match (value, int) {
        (_, Some(i)) => 1 + varint_len(i),
        (AttributeValue::Str(s), _) => 1 + varint_len(s.len() as u64) + s.len(),
        _ => 2,
    };
    let key_len = if key.is_empty() {
        0
    } else {
        1 + varint_len(key.len() as u64) + key.len()
    };
    let kv_len = key_len + 1 + varint_len(any_len as u64) + any_len;
    out.reserve(1 + varint_len(kv_len as u64) + kv_len);
    // Field 9 (KeyValue), its key (field 1), its AnyValue (field 2) and the member's tag.
    let mut head = Head::default();
    head.byte(0x4a).varint(kv_len as u64);
    if !key.is_empty() {
        head.byte(0x0a).varint(key.len() as u64);
    }
    out.raw(head.bytes());
    out.raw(key.as_bytes());
    let mut head = Head::default();
    head.byte(0x12).varint(any_len as u64).byte(member);
    match (value, int) {
        (_, Some(i)) => {
            head.varint(i);
        }
        (AttributeValue::Str(s), _) => {
            head.varint(s.len() as u64);
        }
        _ => {}
    }
    out.raw(head.bytes());
    out.raw(value_bytes);
}

/// A few bytes of keys and lengths, gathered on the stack before they are written.
#[derive(Default)]
struct Head {
    bytes: [u8; 32],
    len: usize,
}

impl Head {
    fn byte(&mut self, byte: u8) -> &mut Head {
        if let Some(slot) = self.bytes.get_mut(self.len) {
            *slot = byte;
            self.len += 1;
        }
        self
    }

    fn varint(&mut self, mut value: u64) -> &mut Head {
        while value >= 0x80 {
            self.byte((value as u8) | 0x80);
            value >>= 7;
        }
        self.byte(value as u8)
    }

    fn bytes(&self) -> &[u8] {
        self.bytes.get(..self.len).unwrap_or_default()
    }
}

/// `Span.status` (field 15), written as `Status::encode_fields` would write it.
pub fn status(out: &mut Writer, message: &str, code: i32) {
    let message_len = if message.is_empty() {
        0
    } else {
        1 + varint_len(message.len() as u64) + message.len()
    };
    let code_len = if code == 0 {
        0
    } else {
        1 + varint_len(i64::from(code) as u64)
    };
    out.header(15, message_len + code_len);
    out.bytes(2, message.as_bytes());
    out.int32(3, code);
}

impl Message for ExportTraceServiceRequest {
    fn encode_fields(&self, out: &mut Writer) {
        self.resource_spans.iter().for_each(|m| out.message(1, m));
    }

    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
        if field.number == 1 {
            self.resource_spans.push(field.message()?);
        }
        Ok(())
    }
}

impl Message for ResourceSpans {
    fn encode_fields(&self, out: &mut Writer) {
        if let Some(resource) = &self.resource {
            out.message(1, resource);
        }
        self.scope_spans.iter().for_each(|m| out.message(2, m));
    }

    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
        match field.number {
            1 => field.merge_into(self.resource.get_or_insert_with(Resource::default))?,
            2 => self.scope_spans.push(field.message()?),
            _ => {}
        }
        Ok(())
    }
}

impl Message for Resource {
    fn encode_fields(&self, out: &mut Writer) {
        self.attributes.iter().for_each(|m| out.message(1, m));
    }

    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
        if field.number == 1 {
            self.attributes.push(field.message()?);
        }
        Ok(())
    }
}

impl Message for ScopeSpans {
    fn encode_fields(&self, out: &mut Writer) {
        if let Some(scope) = &self.scope {
            out.message(1, scope);
        }
        self.spans.iter().for_each(|m| out.message(2, m));
    }

    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
        match field.number {
            1 => field.merge_into(self.scope.get_or_insert_with(InstrumentationScope::default))?,
            2 => self.spans.push(field.message()?),
            _ => {}
        }
        Ok(())
    }
}

impl Message for InstrumentationScope {
    fn encode_fields(&self, out: &mut Writer) {
        out.bytes(1, self.name.as_bytes());
        out.bytes(2, self.version.as_bytes());
    }

    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
        match field.number {
            1 => self.name = field.string()?,
            2 => self.version = field.string()?,
            _ => {}
        }
        Ok(())
    }
}

impl Message for Span {
    fn encode_fields(&self, out: &mut Writer) {
        out.bytes(1, &self.trace_id);
        out.bytes(2, &self.span_id);
        out.bytes(3, self.trace_state.as_bytes());
        out.bytes(4, &self.parent_span_id);
        out.bytes(5, self.name.as_bytes());
        out.int32(6, self.kind);
        out.fixed64(7, self.start_time_unix_nano);
        out.fixed64(8, self.end_time_unix_nano);
        self.attributes.iter().for_each(|m| out.message(9, m));
        if let Some(status) = &self.status {
            out.message(15, status);
        }
        out.fixed32(16, self.flags);
    }

    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
        match field.number {
            1 => self.trace_id = field.bytes()?.to_vec(),
            2 => self.span_id = field.bytes()?.to_vec(),
            3 => self.trace_state = field.string()?,
            4 => self.parent_span_id = field.bytes()?.to_vec(),
            5 => self.name = field.string()?,
            6 => self.kind = field.int32()?,
            7 => self.start_time_unix_nano = field.fixed64()?,
            8 => self.end_time_unix_nano = field.fixed64()?,
            9 => self.attributes.push(field.message()?),
            15 => field.merge_into(self.status.get_or_insert_with(Status::default))?,
            16 => self.flags = field.fixed32()?,
            _ => {}
        }
        Ok(())
    }
}

impl Message for Status {
    fn encode_fields(&self, out: &mut Writer) {
        out.bytes(2, self.message.as_bytes());
        out.int32(3, self.code);
    }

    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
        match field.number {
            2 => self.message = field.string()?,
            3 => self.code = field.int32()?,
            _ => {}
        }
        Ok(())
    }
}

impl Message for KeyValue {
    fn encode_fields(&self, out: &mut Writer) {
        out.bytes(1, self.key.as_bytes());
        if let Some(value) = &self.value {
            out.message(2, value);
        }
    }

    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
        match field.number {
            1 => self.key = field.string()?.into(),
            2 => field.merge_into(self.value.get_or_insert_with(AnyValue::default))?,
            _ => {}
        }
        Ok(())
    }
}

impl Message for AnyValue {
    fn encode_fields(&self, out: &mut Writer) {
        // A oneof member is written even at its default.
        match &self.value {
            Some(Value::String(s)) => out.len_delimited(1, s.as_bytes()),
            Some(Value::Bool(b)) => out.varint(2, u64::from(*b)),
            Some(Value::Int(i)) => out.varint(3, *i as u64),
            None => {}
        }
    }

    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
        match field.number {
            1 => self.value = Some(Value::String(field.string()?)),
            2 => self.value = Some(Value::Bool(field.bool()?)),
            3 => self.value = Some(Value::Int(field.int64()?)),
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// OTLP's messages as prost derives them from the same field numbers: the reference.
    mod reference {
        /// What the collector's `/v1/traces` takes (OTLP/HTTP, `application/x-protobuf`).
        #[derive(Clone, PartialEq, prost::Message)]
        pub struct ExportTraceServiceRequest {
            #[prost(message, repeated, tag = "1")]
            pub resource_spans: Vec<ResourceSpans>,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct ResourceSpans {
            #[prost(message, optional, tag = "1")]
            pub resource: Option<Resource>,
            #[prost(message, repeated, tag = "2")]
            pub scope_spans: Vec<ScopeSpans>,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct Resource {
            #[prost(message, repeated, tag = "1")]
            pub attributes: Vec<KeyValue>,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct ScopeSpans {
            #[prost(message, optional, tag = "1")]
            pub scope: Option<InstrumentationScope>,
            #[prost(message, repeated, tag = "2")]
            pub spans: Vec<Span>,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct InstrumentationScope {
            #[prost(string, tag = "1")]
            pub name: String,
            #[prost(string, tag = "2")]
            pub version: String,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct Span {
            #[prost(bytes = "vec", tag = "1")]
            pub trace_id: Vec<u8>,
            #[prost(bytes = "vec", tag = "2")]
            pub span_id: Vec<u8>,
            #[prost(string, tag = "3")]
            pub trace_state: String,
            /// Empty for a root span.
            #[prost(bytes = "vec", tag = "4")]
            pub parent_span_id: Vec<u8>,
            #[prost(string, tag = "5")]
            pub name: String,
            #[prost(int32, tag = "6")]
            pub kind: i32,
            #[prost(fixed64, tag = "7")]
            pub start_time_unix_nano: u64,
            #[prost(fixed64, tag = "8")]
            pub end_time_unix_nano: u64,
            #[prost(message, repeated, tag = "9")]
            pub attributes: Vec<KeyValue>,
            #[prost(message, optional, tag = "15")]
            pub status: Option<Status>,
            #[prost(fixed32, tag = "16")]
            pub flags: u32,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct Status {
            #[prost(string, tag = "2")]
            pub message: String,
            #[prost(int32, tag = "3")]
            pub code: i32,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct KeyValue {
            #[prost(string, tag = "1")]
            pub key: String,
            #[prost(message, optional, tag = "2")]
            pub value: Option<AnyValue>,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct AnyValue {
            #[prost(oneof = "Value", tags = "1, 2, 3")]
            pub value: Option<Value>,
        }

        /// `AnyValue.value`, the kinds fanout's attributes have.
        #[derive(Clone, PartialEq, prost::Oneof)]
        pub enum Value {
            #[prost(string, tag = "1")]
            String(String),
            #[prost(bool, tag = "2")]
            Bool(bool),
            #[prost(int64, tag = "3")]
            Int(i64),
        }
    }

    /// Field numbers and wire types by hand, for one span: what the official protos decode
    /// (the e2e receiver decodes the same bytes with PyPI's `opentelemetry-proto`).
    #[test]
    fn a_span_encodes_with_otlp_field_numbers() {
        let span = Span {
            trace_id: vec![1; 16],
            span_id: vec![2; 8],
            name: "n".into(),
            kind: CLIENT,
            start_time_unix_nano: 5,
            ..Span::default()
        };
        let bytes = span.encode_to_vec();
        let mut want = vec![0x0a, 16];
        want.extend([1; 16]);
        want.extend([0x12, 8]);
        want.extend([2; 8]);
        want.extend([0x2a, 1, b'n', 0x30, 3, 0x39, 5, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(bytes, want);
    }

    /// What a span's fields written one by one ([`attribute`], [`status`]) are: the bytes of
    /// the messages they stand for.
    #[test]
    fn attributes_and_status_are_written_as_their_messages() {
        let long = "x".repeat(200);
        let values = [
            AttributeValue::Str(""),
            AttributeValue::Str("v"),
            AttributeValue::Str(&long),
            AttributeValue::Int(0),
            AttributeValue::Int(-1),
            AttributeValue::Int(i64::MAX),
            AttributeValue::Bool(false),
            AttributeValue::Bool(true),
        ];
        for key in ["", "k", long.as_str()] {
            for value in values {
                let mut direct = Writer::default();
                attribute(&mut direct, key, value);
                let message = KeyValue {
                    key: key.to_string().into(),
                    value: Some(AnyValue {
                        value: Some(match value {
                            AttributeValue::Str(s) => Value::String(s.to_string()),
                            AttributeValue::Int(i) => Value::Int(i),
                            AttributeValue::Bool(b) => Value::Bool(b),
                        }),
                    }),
                };
                let mut built = Writer::default();
                built.message(9, &message);
                assert_eq!(direct.into_bytes(), built.into_bytes(), "{key:?} {value:?}");
            }
        }
        for (message, code) in [("", 0), ("failed", ERROR), (long.as_str(), ERROR), ("m", 0)] {
            let mut direct = Writer::default();
            status(&mut direct, message, code);
            let mut built = Writer::default();
            built.message(
                15,
                &Status {
                    message: message.into(),
                    code,
                },
            );
            assert_eq!(
                direct.into_bytes(),
                built.into_bytes(),
                "{message:?} {code}"
            );
        }
    }

    #[test]
    fn an_export_round_trips() {
        let resource = [KeyValue::new(
            "service.name",
            Value::String("fanout".into()),
        )];
        let span = Span {
            trace_id: vec![7; 16],
            span_id: vec![8; 8],
            attributes: vec![
                KeyValue::new("a", Value::Int(-3)),
                KeyValue::new("b", Value::Bool(true)),
            ],
            status: Some(Status {
                message: "failed".into(),
                code: ERROR,
            }),
            ..Span::default()
        };
        let mut framed = Vec::new();
        frame(&mut framed, &span.encode_to_vec());
        let bytes = encode(&resource, &framed);
        let back = ExportTraceServiceRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(
            prost::Message::encode_to_vec(
                &<reference::ExportTraceServiceRequest as prost::Message>::decode(bytes.as_slice())
                    .unwrap()
            ),
            bytes,
            "the bytes prost writes for what it reads"
        );
        let rs = &back.resource_spans[0];
        assert_eq!(rs.resource.as_ref().unwrap().attributes, resource);
        assert_eq!(rs.scope_spans[0].scope.as_ref().unwrap().name, "fanout");
        assert_eq!(rs.scope_spans[0].spans, vec![span]);
    }
}
