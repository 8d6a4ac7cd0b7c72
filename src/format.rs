//! `delivery.format`: one event converted between the CloudEvents HTTP binding's two content
//! modes, once per request, for the subscribers that want the other one.
//!
//! The mode the event came in is the request's event view's ([`incoming`]: its headers read
//! once at admission); the input converted is the message as a subscriber would get it (its
//! forwarded header pairs, as bytes, and its body); the output is the same message in the
//! other mode, as header pairs and a body. Nothing here knows of proxy-wasm, the
//! configuration or the calls.
//!
//! The rules, after the CloudEvents HTTP protocol binding (v1.0.2, 3.1 binary mode, 3.2
//! structured mode) and the JSON event format (v1.0.2, 2.2 type system, 3.1 handling of data):
//! - **binary → structured**: every `ce-<name>` header is the attribute `<name>`, its value
//!   decoded as every reader of the crate decodes it
//!   ([`cloudevents::decode_attribute`](crate::cloudevents::decode_attribute): a quoted-string
//!   unquoted, then percent-decoded once); a value that is not UTF-8 then cannot be converted. `content-type` is `datacontenttype`. The
//!   body: under a JSON media type (`*/json`, `*/*+json`) and valid JSON, `data`, embedded as
//!   the body's exact text; any other non-empty body is bytes (the JSON format's `Binary`
//!   runtime type: an HTTP body has no other), so `data_base64`; an empty body, no data. The
//!   members are written in the order of their headers, `data` last. `ce-*` and
//!   `content-type` give way to `content-type: application/cloudevents+json`, where the first
//!   of them was; the other headers stay as they are.
//! - **structured → binary**: every member but `data`/`data_base64` becomes `ce-<name>`, its
//!   canonical string percent-encoded as the binding says (space, `"`, `%`, controls and
//!   everything outside printable ASCII); `datacontenttype` becomes `content-type`. Strings
//!   as they are, integers and booleans as written, `null` as unset. `data` under a JSON
//!   type: its exact text; without `datacontenttype` the same, with `content-type:
//!   application/json` (the JSON format says a re-serialized event SHOULD state the implied
//!   type); under another type it must be a string, sent as its UTF-8 bytes. `data_base64`:
//!   its decoded bytes. The block of headers goes where `content-type` was; stale `ce-*`
//!   headers are dropped.
//! - **Refused**, never changed silently: a request that is neither mode (not a CloudEvent, a
//!   batch, another event format), an event that lacks a required attribute or is not
//!   CloudEvents 1.0 (0.3 encodes binary data otherwise), an attribute name that is not
//!   lower-case letters and digits, an attribute given twice, an object, array or
//!   non-integer number as an attribute value, both `data` and `data_base64`, invalid base64,
//!   a non-string `data` under a non-JSON type, a `datacontenttype` that cannot be a header
//!   or that would make the binary message another mode (`application/cloudevents*`).

use std::borrow::Cow;
use std::fmt;

use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig, STANDARD};
use base64::engine::DecodePaddingMode;
use base64::Engine;
use serde::de::IgnoredAny;

use crate::cloudevents::{
    check_binary_required, check_required, decode_attribute, encode_attribute, media_type,
    text_value, Attributes, EventError, Member, EVENT_FORMAT_PREFIX, STRUCTURED_JSON,
};
#[cfg(any(test, feature = "testing"))]
use crate::cloudevents::{read_headers_for, ContentMode};
use crate::json::{members, string as json_string};

/// A subscriber's content mode (`delivery.format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Attributes in `ce-*` headers, the data as the body.
    Binary,
    /// One JSON object, `application/cloudevents+json` (Knative's word: `json`).
    Structured,
}

impl Format {
    /// The configuration's words: `binary`, `structured`, and Knative's `json`.
    pub fn parse(word: &str) -> Option<Format> {
        match word {
            "binary" => Some(Format::Binary),
            "structured" | "json" => Some(Format::Structured),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Format::Binary => "binary",
            Format::Structured => "structured",
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One header: name and value, as bytes.
pub type Pair = (Vec<u8>, Vec<u8>);

/// A message converted into `format`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Converted {
    pub format: Format,
    pub headers: Vec<Pair>,
    pub body: Vec<u8>,
}

/// Base64 as RFC 4648 writes it, padded or not.
const BASE64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// The content mode an event came in, as the request's one event view tells it
/// ([`cloudevents::read_headers_for`](crate::cloudevents::read_headers_for) at admission):
/// `structured` (`application/cloudevents+json`), or binary when its header attributes
/// (`binary`) state a `specversion`. `Err`: it is neither (`unreadable`: why its headers tell
/// no mode), and cannot be converted.
pub fn incoming(
    structured: bool,
    binary: Option<&Attributes>,
    unreadable: Option<&EventError>,
) -> Result<Format, String> {
    if let Some(error) = unreadable {
        return Err(error.to_string());
    }
    if structured {
        return Ok(Format::Structured);
    }
    match binary {
        Some(attributes) if attributes.get("specversion").is_some() => Ok(Format::Binary),
        _ => Err(format!(
            "not a CloudEvent: neither ce-type and ce-specversion (binary mode) nor \
             content-type {STRUCTURED_JSON} (structured mode)"
        )),
    }
}

/// The content mode of a message, from its header pairs (lower-case names), read as a
/// request's are: [`incoming`] of the view of its headers.
#[cfg(any(test, feature = "testing"))]
pub fn mode(headers: &[(&[u8], &[u8])]) -> Result<Format, String> {
    let map = crate::headers::HeaderMap::from_pairs(headers);
    match read_headers_for(&map, |_| false) {
        Ok(ContentMode::Structured) => incoming(true, None, None),
        Ok(ContentMode::Binary(attributes)) => incoming(false, Some(&attributes), None),
        Ok(ContentMode::NotCloudEvent) => incoming(false, None, None),
        Err(error) => incoming(false, None, Some(&error)),
    }
}

/// The message of `headers` and `body`, which is in the other mode, converted into `to`.
pub fn convert(to: Format, headers: &[(&[u8], &[u8])], body: &[u8]) -> Result<Converted, String> {
    match to {
        Format::Structured => to_structured(headers, body),
        Format::Binary => to_binary(headers, body),
    }
}

/// Whether a media type declares JSON-formatted data: `*/json` or `*/*+json`.
pub fn is_json_media(content_type: &[u8]) -> bool {
    let media = media_type(content_type);
    let subtype = media.split_once('/').map_or("", |(_, subtype)| subtype);
    subtype == "json" || subtype.ends_with("+json")
}

/// A CloudEvents attribute name: lower-case ASCII letters and digits (spec 1.0.2, 3.1.1).
fn is_attribute_name(name: &[u8]) -> bool {
    !name.is_empty()
        && name
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// Binary mode into structured mode.
fn to_structured(headers: &[(&[u8], &[u8])], body: &[u8]) -> Result<Converted, String> {
    let mut json = String::with_capacity(body.len().saturating_mul(4) / 3 + 256);
    json.push('{');
    let mut names: Vec<&str> = Vec::with_capacity(headers.len());
    let mut out = Vec::with_capacity(headers.len());
    for &(name, value) in headers {
        let Some((attribute, text)) = binary_attribute(name, value)? else {
            out.push((name.to_vec(), value.to_vec()));
            continue;
        };
        if names.is_empty() {
            // The new content type takes the place of the first header it replaces.
            out.push((
                b"content-type".to_vec(),
                STRUCTURED_JSON.as_bytes().to_vec(),
            ));
        }
        if names.contains(&attribute) {
            return Err(format!(
                "header {} is given twice",
                String::from_utf8_lossy(name)
            ));
        }
        if !names.is_empty() {
            json.push(',');
        }
        names.push(attribute);
        push_member(&mut json, attribute, &text);
    }
    let header = |wanted: &str| {
        headers
            .iter()
            .find(|(name, _)| *name == wanted.as_bytes())
            .map(|(_, value)| *value)
    };
    check_binary_required(header)?;
    if header("ce-specversion")
        .and_then(decode_attribute)
        .as_deref()
        != Some(SPEC_VERSION)
    {
        return Err(not_spec_version());
    }
    if !body.is_empty() {
        push_data(&mut json, header("content-type"), body);
    }
    json.push('}');
    Ok(Converted {
        format: Format::Structured,
        headers: out,
        body: json.into_bytes(),
    })
}

/// The attribute a binary-mode header carries, and its value decoded: `ce-<name>` is
/// `<name>`, `content-type` is `datacontenttype`; `None` for any other header. `Err`: a header
/// that cannot be an attribute of a structured event.
fn binary_attribute<'h>(
    name: &'h [u8],
    value: &'h [u8],
) -> Result<Option<(&'h str, Cow<'h, str>)>, String> {
    if name == b"content-type" {
        let text = text_value("content-type", value)?;
        return Ok(Some(("datacontenttype", text)));
    }
    let Some(attribute) = name.strip_prefix(b"ce-") else {
        return Ok(None);
    };
    let spelled = String::from_utf8_lossy(name);
    let attribute = std::str::from_utf8(attribute)
        .ok()
        .filter(|a| is_attribute_name(a.as_bytes()) && *a != "data")
        .ok_or_else(|| {
            format!(
                "header {spelled} names no CloudEvents attribute (lower-case letters and \
                 digits): it has no place in a structured event"
            )
        })?;
    if attribute == "datacontenttype" {
        return Err(format!(
            "header {spelled}: binary mode carries datacontenttype as content-type"
        ));
    }
    Ok(Some((attribute, text_value(&spelled, value)?)))
}

/// The body as the structured event's data: under a JSON `content_type` and valid JSON,
/// `data`, its exact text; otherwise `data_base64`.
fn push_data(json: &mut String, content_type: Option<&[u8]>, body: &[u8]) {
    let json_data = content_type
        .is_some_and(is_json_media)
        .then(|| std::str::from_utf8(body).ok())
        .flatten()
        .filter(|text| serde_json::from_slice::<IgnoredAny>(text.as_bytes()).is_ok());
    match json_data {
        Some(text) => {
            json.push_str(",\"data\":");
            json.push_str(text);
        }
        None => {
            json.push_str(",\"data_base64\":\"");
            STANDARD.encode_string(body, json);
            json.push('"');
        }
    }
}

/// `"name":"value"`, the value a JSON string.
fn push_member(json: &mut String, name: &str, value: &str) {
    json.push('"');
    json.push_str(name);
    json.push_str("\":");
    // A `str` always serializes; the fallback is never taken.
    json.push_str(&serde_json::to_string(value).unwrap_or_else(|_| "\"\"".to_string()));
}

/// The one `specversion` converted: 0.3 encodes binary data in another member.
const SPEC_VERSION: &str = "1.0";

fn not_spec_version() -> String {
    format!(
        "specversion is not {SPEC_VERSION}: only CloudEvents {SPEC_VERSION} events are converted \
         (0.3 encodes binary data otherwise)"
    )
}

/// Structured mode into binary mode.
fn to_binary(headers: &[(&[u8], &[u8])], body: &[u8]) -> Result<Converted, String> {
    let members = members(body)?;
    let mut block: Vec<Pair> = Vec::with_capacity(members.len() + 1);
    let mut names: Vec<&str> = Vec::with_capacity(members.len());
    let (mut data, mut data_base64) = (None, None);
    for (name, raw) in &members {
        let name = name.as_ref();
        if names.contains(&name) {
            return Err(format!("member {name} is given twice"));
        }
        names.push(name);
        match name {
            "data" => data = Some(*raw),
            "data_base64" => data_base64 = Some(*raw),
            _ => block.extend(attribute_header(name, raw)?),
        }
    }
    check_required("structured", |name| {
        let member = match members.iter().find(|(n, _)| n == name) {
            None => Member::Missing,
            Some((_, raw)) => {
                json_string(raw).map_or(Member::NotString, |s| Member::Text(s.into()))
            }
        };
        (format!("member {name}"), member)
    })?;
    let specversion = members.iter().find(|(n, _)| n == "specversion");
    if specversion.and_then(|(_, raw)| json_string(raw)).as_deref() != Some(SPEC_VERSION) {
        return Err(not_spec_version());
    }
    let payload = payload(data, data_base64, &mut block)?;
    Ok(Converted {
        format: Format::Binary,
        headers: in_place_of_content_type(headers, block),
        body: payload,
    })
}

/// The header of one attribute member (`name`, its JSON text `raw`): `ce-<name>`, or
/// `content-type` for `datacontenttype`; `None` for `null` (unset). `Err`: a member that has
/// no exact header.
fn attribute_header(name: &str, raw: &str) -> Result<Option<Pair>, String> {
    if !is_attribute_name(name.as_bytes()) {
        return Err(format!(
            "member {:?} is not a CloudEvents attribute name (lower-case letters and digits): \
             it has no ce- header",
            name
        ));
    }
    let Some(value) = attribute_text(name, raw)? else {
        return Ok(None); // null: unset
    };
    if name != "datacontenttype" {
        let header = [b"ce-", name.as_bytes()].concat();
        return Ok(Some((header, encode_attribute(&value).into_bytes())));
    }
    if !raw.starts_with('"') || !value.bytes().all(|b| (b' '..=b'~').contains(&b)) {
        return Err(format!(
            "member datacontenttype {} cannot be a content-type header (printable ASCII)",
            raw
        ));
    }
    // A receiver would read such a message as the structured (or batch) event its body is not.
    let media = media_type(value.as_bytes());
    if media.starts_with(EVENT_FORMAT_PREFIX) {
        return Err(format!(
            "member datacontenttype {media} cannot be a binary-mode content-type: a receiver \
             would read the message as a structured event"
        ));
    }
    Ok(Some((b"content-type".to_vec(), value.as_bytes().to_vec())))
}

/// The binary body, from the `data` or `data_base64` member's JSON text, by the content type
/// the `block` of headers has (and, for JSON data without one, states).
fn payload(
    data: Option<&str>,
    data_base64: Option<&str>,
    block: &mut Vec<Pair>,
) -> Result<Vec<u8>, String> {
    let content_type = block
        .iter()
        .find(|(name, _)| name == b"content-type")
        .map(|(_, value)| value.as_slice());
    match (data, data_base64) {
        (Some(_), Some(_)) => {
            Err("both data and data_base64 are given: the JSON format allows one".into())
        }
        (None, Some(raw)) => {
            let text = json_string(raw).ok_or_else(|| "data_base64 is not a string".to_string())?;
            BASE64
                .decode(text.as_bytes())
                .map_err(|e| format!("data_base64 is not valid base64: {e}"))
        }
        (Some(raw), None) => match content_type {
            None => {
                // The JSON format's implied type, stated (3.1.2).
                block.push((b"content-type".to_vec(), b"application/json".to_vec()));
                Ok(raw.as_bytes().to_vec())
            }
            Some(ct) if is_json_media(ct) => Ok(raw.as_bytes().to_vec()),
            Some(ct) => json_string(raw).map(String::into_bytes).ok_or_else(|| {
                format!(
                    "data is not a string, and datacontenttype {} is not JSON: it has no exact \
                     binary body",
                    String::from_utf8_lossy(ct)
                )
            }),
        },
        (None, None) => Ok(Vec::new()),
    }
}

/// The structured message's headers with the `block` of binary-mode headers where its
/// `content-type` was (at the end without one); its stale `ce-*` headers dropped.
fn in_place_of_content_type(headers: &[(&[u8], &[u8])], block: Vec<Pair>) -> Vec<Pair> {
    let mut out = Vec::with_capacity(headers.len() + block.len());
    let mut block = Some(block);
    for &(name, value) in headers {
        if name == b"content-type" {
            if let Some(block) = block.take() {
                out.extend(block);
            }
        } else if !name.starts_with(b"ce-") {
            out.push((name.to_vec(), value.to_vec()));
        }
    }
    if let Some(block) = block {
        out.extend(block);
    }
    out
}

/// An attribute's canonical string, from its JSON value: a string as it is, a boolean or an
/// integer as written; `None` for `null` (unset). Anything else has no exact header.
fn attribute_text<'r>(name: &str, text: &'r str) -> Result<Option<Cow<'r, str>>, String> {
    match text.as_bytes().first() {
        Some(b'"') => json_string(text)
            .map(|text| Some(Cow::Owned(text)))
            .ok_or_else(|| format!("member {name} is not a JSON string")),
        Some(b'n') => Ok(None),
        Some(b't' | b'f') => Ok(Some(Cow::Borrowed(text))),
        Some(b'-' | b'0'..=b'9') => {
            let digits = text.strip_prefix('-').unwrap_or(text);
            if digits.bytes().all(|b| b.is_ascii_digit()) {
                Ok(Some(Cow::Borrowed(text)))
            } else {
                Err(format!(
                    "member {name} is {text}, not an integer: a number with a fraction or an \
                     exponent has no exact canonical string"
                ))
            }
        }
        _ => Err(format!(
            "member {name} is an object or an array: attributes are scalars, it has no exact \
             header"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs<'a>(headers: &'a [(&'a str, &'a [u8])]) -> Vec<(&'a [u8], &'a [u8])> {
        headers.iter().map(|(n, v)| (n.as_bytes(), *v)).collect()
    }

    fn text_pairs<'a>(headers: &'a [(&'a str, &'a str)]) -> Vec<(&'a [u8], &'a [u8])> {
        headers
            .iter()
            .map(|(n, v)| (n.as_bytes(), v.as_bytes()))
            .collect()
    }

    fn owned(headers: &[(&str, &str)]) -> Vec<Pair> {
        headers
            .iter()
            .map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec()))
            .collect()
    }

    fn borrowed(headers: &[Pair]) -> Vec<(&[u8], &[u8])> {
        headers
            .iter()
            .map(|(n, v)| (n.as_slice(), v.as_slice()))
            .collect()
    }

    const BINARY: &[(&str, &str)] = &[
        ("x-request-id", "r1"),
        ("ce-specversion", "1.0"),
        ("ce-id", "A-1"),
        ("ce-source", "/orders%20eu"),
        ("ce-type", "com.example.created"),
        ("ce-greeting", "gr%C3%BC%C3%9Fe%20aus%20K%C3%B6ln"),
        ("ce-sequence", "7"),
        ("content-type", "application/json"),
        ("traceparent", "00-abc-def-01"),
    ];

    fn structured(headers: &[(&str, &str)], body: &[u8]) -> Result<Converted, String> {
        convert(Format::Structured, &text_pairs(headers), body)
    }

    fn binary(body: &str) -> Result<Converted, String> {
        let headers = [
            ("x-request-id", "r1"),
            (
                "content-type",
                "application/cloudevents+json; charset=utf-8",
            ),
            ("ce-stale", "x"),
            ("traceparent", "t"),
        ];
        convert(Format::Binary, &text_pairs(&headers), body.as_bytes())
    }

    fn text(bytes: &[u8]) -> &str {
        std::str::from_utf8(bytes).unwrap()
    }

    #[test]
    fn the_words_of_the_configuration() {
        assert_eq!(Format::parse("binary"), Some(Format::Binary));
        assert_eq!(Format::parse("structured"), Some(Format::Structured));
        assert_eq!(Format::parse("json"), Some(Format::Structured));
        assert_eq!(Format::parse("JSON"), None);
        assert_eq!(Format::parse(""), None);
    }

    #[test]
    fn the_mode_is_told_by_the_headers_and_the_rest_is_refused() {
        let mode_of = |h: &[(&str, &str)]| mode(&text_pairs(h));
        assert_eq!(mode_of(BINARY), Ok(Format::Binary));
        assert_eq!(
            mode_of(&[(
                "content-type",
                "Application/CloudEvents+JSON; charset=utf-8"
            )]),
            Ok(Format::Structured)
        );
        let batch = mode_of(&[("content-type", "application/cloudevents-batch+json")]);
        assert!(batch.unwrap_err().contains("batch"));
        let avro = mode_of(&[("content-type", "application/cloudevents+avro")]);
        assert!(avro.unwrap_err().contains("cannot be converted"));
        // ce-type alone is no binary event: the binding's marker is ce-specversion.
        for h in [
            &[][..],
            &[("ce-type", "t"), ("content-type", "application/json")],
        ] {
            assert!(
                mode_of(h).unwrap_err().starts_with("not a CloudEvent"),
                "{h:?}"
            );
        }
    }

    #[test]
    fn binary_to_structured_decodes_every_ce_header_and_embeds_json_data_as_it_is() {
        let body = br#"{"order": 7, "note": "caf\u00e9"}"#;
        let converted = structured(BINARY, body).unwrap();
        assert_eq!(converted.format, Format::Structured);
        assert_eq!(
            converted.headers,
            owned(&[
                ("x-request-id", "r1"),
                ("content-type", "application/cloudevents+json"),
                ("traceparent", "00-abc-def-01"),
            ])
        );
        assert_eq!(
            text(&converted.body),
            r#"{"specversion":"1.0","id":"A-1","source":"/orders eu","type":"com.example.created","greeting":"grüße aus Köln","sequence":"7","datacontenttype":"application/json","data":{"order": 7, "note": "caf\u00e9"}}"#
        );
        let parsed: serde_json::Value = serde_json::from_slice(&converted.body).unwrap();
        assert_eq!(parsed["data"]["note"], "café");
    }

    #[test]
    fn binary_data_that_is_not_json_goes_as_data_base64() {
        let with_type = |ct: &str, body: &[u8]| {
            let mut headers = BINARY[..5].to_vec();
            headers.push(("content-type", ct));
            let converted = structured(&headers, body).unwrap();
            serde_json::from_slice::<serde_json::Value>(&converted.body).unwrap()
        };
        // +json is JSON; a JSON type whose body is not JSON is bytes, kept exact.
        let v = with_type("application/vnd.order+json", b"[1,2]");
        assert_eq!(v["data"], serde_json::json!([1, 2]));
        let v = with_type("application/json; charset=utf-8", b"{not json");
        assert_eq!(v["data_base64"], STANDARD.encode(b"{not json"));
        assert!(v.get("data").is_none());
        // A text under a non-JSON type is bytes: an HTTP body has no other runtime type.
        let v = with_type("text/plain", "grüße".as_bytes());
        assert_eq!(v["data_base64"], STANDARD.encode("grüße"));
        assert_eq!(v["datacontenttype"], "text/plain");
        let v = with_type("application/octet-stream", &[0, 0xff, 0xfe]);
        assert_eq!(v["data_base64"], "AP/+");
        // No content type: no datacontenttype, and no assumption of JSON.
        let v = serde_json::from_slice::<serde_json::Value>(
            &structured(&BINARY[..5], b"{}").unwrap().body,
        )
        .unwrap();
        assert_eq!(v["data_base64"], "e30=");
        assert!(v.get("datacontenttype").is_none());
        // An empty body: no data at all.
        let v = with_type("application/json", b"");
        assert!(v.get("data").is_none() && v.get("data_base64").is_none());
    }

    #[test]
    fn quoted_header_values_are_unquoted_before_percent_decoding() {
        let mut headers = BINARY[..5].to_vec();
        headers.push(("ce-note", r#""say \"hi\" 100%25""#));
        let v: serde_json::Value =
            serde_json::from_slice(&structured(&headers, b"").unwrap().body).unwrap();
        assert_eq!(v["note"], r#"say "hi" 100%"#);
    }

    #[test]
    fn binary_events_that_cannot_be_converted_exactly_are_refused() {
        let refused = |extra: &[(&str, &[u8])], drop: usize| {
            let mut headers: Vec<(&str, &[u8])> = BINARY[1..5]
                .iter()
                .skip(drop)
                .map(|(n, v)| (*n, v.as_bytes()))
                .collect();
            headers.extend_from_slice(extra);
            convert(Format::Structured, &pairs(&headers), b"").unwrap_err()
        };
        // Extra headers, how many required ones to leave out, the refusal's words.
        type Case<'a> = (&'a [(&'a str, &'a [u8])], usize, &'a str);
        let cases: &[Case] = &[
            (
                &[("ce-x", b"%FF")],
                0,
                "ce-x is not UTF-8 once percent-decoded",
            ),
            (&[("ce-x", b"\xc3\x28")], 0, "ce-x is not UTF-8"),
            (
                &[("content-type", b"text/\xff")],
                0,
                "content-type is not UTF-8",
            ),
            (
                &[("ce-my-ext", b"1")],
                0,
                "ce-my-ext names no CloudEvents attribute",
            ),
            (
                &[("ce-data", b"1")],
                0,
                "ce-data names no CloudEvents attribute",
            ),
            (
                &[("ce-datacontenttype", b"a/b")],
                0,
                "carries datacontenttype as content-type",
            ),
            (&[("ce-id", b"2")], 0, "ce-id is given twice"),
            (
                &[],
                1,
                "not a valid CloudEvent (binary mode): ce-specversion is missing",
            ),
            (&[("ce-specversion", b"0.3")], 1, "specversion is not 1.0"),
            (&[("ce-type", b"")], 0, "ce-type is given twice"),
        ];
        for (extra, drop, want) in cases {
            let error = refused(extra, *drop);
            assert!(error.contains(want), "{extra:?}: {error}");
        }
        let mut no_type = BINARY[..4].to_vec();
        no_type.push(("ce-type", ""));
        let error = structured(&no_type, b"").unwrap_err();
        assert_eq!(
            error,
            "not a valid CloudEvent (binary mode): ce-type is empty"
        );
    }

    #[test]
    fn structured_to_binary_percent_encodes_attributes_and_sends_data_as_it_is() {
        let converted = binary(
            r#"{"specversion": "1.0", "id": "A-1", "source": "/orders eu",
                "type": "com.example.created", "greeting": "grüße \"aus\" 100%",
                "sequence": 7, "negative": -3, "flag": true, "subject": null,
                "datacontenttype": "application/json",
                "data": {"order": 7,  "note": "caf\u00e9"}}"#,
        )
        .unwrap();
        assert_eq!(converted.format, Format::Binary);
        assert_eq!(
            converted.headers,
            owned(&[
                ("x-request-id", "r1"),
                ("ce-specversion", "1.0"),
                ("ce-id", "A-1"),
                ("ce-source", "/orders%20eu"),
                ("ce-type", "com.example.created"),
                ("ce-greeting", "gr%C3%BC%C3%9Fe%20%22aus%22%20100%25"),
                ("ce-sequence", "7"),
                ("ce-negative", "-3"),
                ("ce-flag", "true"),
                ("content-type", "application/json"),
                ("traceparent", "t"),
            ])
        );
        assert_eq!(
            text(&converted.body),
            r#"{"order": 7,  "note": "caf\u00e9"}"#
        );
    }

    #[test]
    fn structured_data_by_its_content_type() {
        let event = |rest: &str| {
            binary(&format!(
                r#"{{"specversion": "1.0", "id": "1", "source": "/s", "type": "t"{rest}}}"#
            ))
        };
        let header = |c: &Converted, name: &str| {
            c.headers
                .iter()
                .find(|(n, _)| n == name.as_bytes())
                .map(|(_, v)| text(v).to_string())
        };
        // No datacontenttype: JSON, stated as application/json.
        let c = event(r#", "data": [1, "x"]"#).unwrap();
        assert_eq!(text(&c.body), r#"[1, "x"]"#);
        assert_eq!(
            header(&c, "content-type").as_deref(),
            Some("application/json")
        );
        // A JSON string under a JSON type is JSON text, quotes and all.
        let c = event(r#", "datacontenttype": "application/json", "data": "x""#).unwrap();
        assert_eq!(text(&c.body), r#""x""#);
        // A string under a non-JSON type: its UTF-8 bytes.
        let c = event(r#", "datacontenttype": "text/plain", "data": "gr\u00fc\u00dfe\n""#).unwrap();
        assert_eq!(c.body, "grüße\n".as_bytes());
        assert_eq!(header(&c, "content-type").as_deref(), Some("text/plain"));
        // data_base64: the bytes, padded or not.
        let c = event(r#", "datacontenttype": "image/png", "data_base64": "AP/+""#).unwrap();
        assert_eq!(c.body, [0, 0xff, 0xfe]);
        let c = event(r#", "data_base64": "AP8""#).unwrap();
        assert_eq!(c.body, [0, 0xff]);
        assert_eq!(header(&c, "content-type"), None);
        // No data: an empty body; a null data under JSON is the JSON null.
        assert!(event("").unwrap().body.is_empty());
        assert_eq!(event(r#", "data": null"#).unwrap().body, b"null");
        // A stale ce-* header of the structured request is not kept.
        assert_eq!(header(&event("").unwrap(), "ce-stale"), None);
    }

    #[test]
    fn structured_events_that_cannot_be_converted_exactly_are_refused() {
        let base = r#""specversion": "1.0", "id": "1", "source": "/s", "type": "t""#;
        let cases = [
            (
                r#", "ext": {"a": 1}"#,
                "member ext is an object or an array",
            ),
            (r#", "ext": [1]"#, "member ext is an object or an array"),
            (r#", "ext": 1.5"#, "member ext is 1.5, not an integer"),
            (r#", "ext": 1e3"#, "member ext is 1e3, not an integer"),
            (
                r#", "myExt": "x""#,
                "member \"myExt\" is not a CloudEvents attribute name",
            ),
            (r#", "my_ext": "x""#, "is not a CloudEvents attribute name"),
            (r#", "id": "2""#, "member id is given twice"),
            (
                r#", "data": 1, "data_base64": "AA==""#,
                "both data and data_base64",
            ),
            (
                r#", "data_base64": "not base64!""#,
                "data_base64 is not valid base64",
            ),
            (r#", "data_base64": 7"#, "data_base64 is not a string"),
            (
                r#", "datacontenttype": "text/plain", "data": {"a": 1}"#,
                "data is not a string, and datacontenttype text/plain is not JSON",
            ),
            (
                r#", "datacontenttype": 7"#,
                "member datacontenttype 7 cannot be a content-type",
            ),
            (
                r#", "datacontenttype": "a\nb""#,
                "cannot be a content-type header",
            ),
            // Found writing the fuzz target's property that `mode` tells the converted
            // message's mode (fuzz/README.md, Findings): sent as content-type, these made the
            // binary message a structured event (or a batch) to its receiver.
            (
                r#", "datacontenttype": "application/cloudevents+json", "data": {}"#,
                "cannot be a binary-mode content-type",
            ),
            (
                r#", "datacontenttype": "Application/CloudEvents-Batch+JSON; x=1""#,
                "member datacontenttype application/cloudevents-batch+json cannot be",
            ),
            (
                r#", "datacontenttype": "application/cloudevents+avro""#,
                "a receiver would read the message as a structured event",
            ),
        ];
        for (rest, want) in cases {
            let error = binary(&format!("{{{base}{rest}}}")).unwrap_err();
            assert!(error.contains(want), "{rest}: {error}");
        }
        for (body, want) in [
            (
                r#"{"id": "1", "source": "/s", "type": "t"}"#,
                "member specversion is missing",
            ),
            (
                r#"{"specversion": "1.0", "id": 1, "source": "/s", "type": "t"}"#,
                "member id",
            ),
            (
                r#"{"specversion": "0.3", "id": "1", "source": "/s", "type": "t"}"#,
                "specversion is not 1.0",
            ),
            ("[1]", "the body is not one JSON object"),
            ("{\"id\": ", "the body is not one JSON object"),
            ("{} {}", "the body is not one JSON object"),
        ] {
            let error = binary(body).unwrap_err();
            assert!(error.contains(want), "{body}: {error}");
        }
    }

    /// Binary → structured → binary gives back every header and the body byte for byte, for
    /// a canonically encoded event (upper-case escapes, only what the binding encodes).
    #[test]
    fn binary_to_structured_to_binary_is_byte_for_byte() {
        let bodies: [(&str, &[u8]); 5] = [
            (
                "application/json",
                br#"{"order":7,"list":[1,2.5,"x"],"n":null}"#,
            ),
            ("application/vnd.example+json", b"\"just a string\""),
            ("text/plain; charset=utf-8", "grüße aus Köln\n".as_bytes()),
            ("application/octet-stream", &[0, 1, 2, 0xff, 0x80, b'\n']),
            ("application/json", b""),
        ];
        for (content_type, body) in bodies {
            let mut headers: Vec<(&str, &str)> = BINARY.to_vec();
            headers.retain(|(n, _)| *n != "content-type");
            headers.insert(7, ("content-type", content_type));
            headers.insert(5, ("ce-time", "2018-04-05T17:31:00Z"));
            headers.insert(6, ("ce-quote", "%22a%22%25b%0Ac"));
            let original = text_pairs(&headers);
            let there = convert(Format::Structured, &original, body).unwrap();
            assert_eq!(
                mode(&borrowed(&there.headers)),
                Ok(Format::Structured),
                "{content_type}"
            );
            let back = convert(Format::Binary, &borrowed(&there.headers), &there.body).unwrap();
            assert_eq!(borrowed(&back.headers), original, "{content_type}");
            assert_eq!(back.body, body, "{content_type}");
        }
    }

    #[test]
    fn json_media_types() {
        for (value, json) in [
            ("application/json", true),
            ("Application/JSON; charset=utf-8", true),
            ("text/json", true),
            ("application/vnd.api+json", true),
            ("application/jsonl", false),
            ("text/plain", false),
            ("json", false),
            ("", false),
        ] {
            assert_eq!(is_json_media(value.as_bytes()), json, "{value}");
        }
    }
}
