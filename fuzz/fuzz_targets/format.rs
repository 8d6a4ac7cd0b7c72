//! `delivery.format`'s conversion (`fanout::format`) on what senders can send: any header
//! pairs (any bytes) and any body, JSON objects of any shape, and events encoded as the
//! CloudEvents HTTP binding says, in either mode.
//!
//! The first byte picks the part; properties:
//! - **raw**: `mode` and `convert` (both ways) never panic on any headers and body; what
//!   `convert` gives is well-formed: the headers it did not make are the input's others, in
//!   order, unchanged; `mode` tells the mode converted into from them; the ones it made are `content-type` or `ce-<lower-case letters and
//!   digits>` with values free of CR, LF and NUL; a structured body is one JSON object that
//!   serde_json reads, whose members are attributes (lower-case names, each once, the required
//!   ones there) and `data`/`data_base64` last;
//! - **members**: on any text serde_json reads as a JSON object, the hand-written scan
//!   (`json::members`) gives exactly serde_json's members, in order, duplicates
//!   included, each text parsing to the same value; on any other text (and on an object whose
//!   names serde_json cannot read, such as a lone surrogate escape) it refuses;
//! - **binary round trip**: an event encoded as the binding says (canonical percent-encoding,
//!   its `ce-*` and `content-type` headers together) goes binary → structured → binary to the
//!   same headers byte for byte, and the same body (a JSON body without the whitespace around
//!   it, as `docs/delivery.md` says);
//! - **structured round trip**: an event object with any members (strings, integers,
//!   booleans, null, floats, objects; `data` or `data_base64` or both) that converts to binary
//!   converts back to structured, with the same attributes in order (each as its canonical
//!   string; null unset; `datacontenttype: application/json` stated when it was implied) and
//!   the same data bytes.
#![no_main]

use std::fmt;

use arbitrary::{Arbitrary, Result, Unstructured};
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig, STANDARD};
use base64::engine::DecodePaddingMode;
use base64::Engine;
use fanout::format::{convert, is_json_media, mode, Converted, Format, Pair};
use fanout::json::members as object_members;
use libfuzzer_sys::fuzz_target;
use percent_encoding::{utf8_percent_encode, AsciiSet, CONTROLS};
use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::Value;

/// Base64 padded or not, as the filter reads `data_base64`.
const BASE64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);
const STRUCTURED: &[u8] = b"application/cloudevents+json";
const REQUIRED: [&str; 4] = ["specversion", "id", "source", "type"];
/// What the binding percent-encodes (3.1.3.2), as the filter does: space, `"`, `%`, controls.
const HEADER_VALUE: &AsciiSet = &CONTROLS.add(b' ').add(b'"').add(b'%');

const CONTENT_TYPES: &[&str] = &[
    "application/json",
    "application/json; charset=utf-8",
    "Application/JSON",
    "text/json",
    "application/vnd.order+json",
    "text/plain",
    "application/octet-stream",
    "image/png",
    "application/cloudevents+json",
    "application/jsonl",
    "",
];
const NAMES: &[&str] = &[
    "specversion",
    "id",
    "source",
    "type",
    "datacontenttype",
    "data",
    "data_base64",
    "subject",
    "time",
    "dataschema",
    "ext1",
    "Ext",
    "my-ext",
    "",
];
const STRINGS: &[&str] = &[
    "1.0",
    "0.3",
    "",
    "A-1",
    "/s",
    "t",
    "é",
    "\u{0}",
    "\r\n",
    "%",
    "%2",
    "%41",
    "\"",
    "\\",
    " ",
    "AP/+",
    "e30=",
    "AP8",
    "not base64!",
    "\u{7f}",
    "\u{fffd}",
    "\u{1f600}",
];

fuzz_target!(|data: &[u8]| {
    let Some((&head, rest)) = data.split_first() else {
        return;
    };
    match head % 4 {
        0 => {
            let mut u = Unstructured::new(rest);
            if let Ok(raw) = Raw::arbitrary(&mut u) {
                raw.check();
            }
        }
        1 => check_members(rest),
        2 => {
            let mut u = Unstructured::new(rest);
            if let Ok(event) = binary_event(&mut u) {
                event.check();
            }
        }
        _ => {
            let mut u = Unstructured::new(rest);
            if let Ok(event) = structured_event(&mut u) {
                event.check();
            }
        }
    }
});

fn borrowed(headers: &[Pair]) -> Vec<(&[u8], &[u8])> {
    headers
        .iter()
        .map(|(n, v)| (n.as_slice(), v.as_slice()))
        .collect()
}

/// A name the conversion makes or consumes: `content-type` and `ce-*`.
fn is_event_header(name: &[u8]) -> bool {
    name == b"content-type" || name.starts_with(b"ce-")
}

fn is_attribute_name(name: &[u8]) -> bool {
    !name.is_empty()
        && name
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// Any headers, any bytes; the body any bytes or, after a flag, a generated JSON object.
#[derive(Debug)]
struct Raw {
    headers: Vec<Pair>,
    body: Vec<u8>,
}

impl<'a> Arbitrary<'a> for Raw {
    fn arbitrary(u: &mut Unstructured<'a>) -> Result<Self> {
        let mut headers = Vec::new();
        for _ in 0..u.int_in_range(0..=12)? {
            let name = match u.int_in_range(0..=3)? {
                0 => Vec::arbitrary(u)?,
                1 => u
                    .choose(&["content-type", "x-request-id", "ce-", "Content-Type"])?
                    .as_bytes()
                    .to_vec(),
                _ => format!("ce-{}", u.choose(NAMES)?).into_bytes(),
            };
            let value = match u.int_in_range(0..=2)? {
                0 => Vec::arbitrary(u)?,
                1 => u.choose(CONTENT_TYPES)?.as_bytes().to_vec(),
                _ => u.choose(STRINGS)?.as_bytes().to_vec(),
            };
            headers.push((name, value));
        }
        let body = if u.arbitrary()? {
            let mut text = String::new();
            json_object(u, 0, &mut text)?;
            text.into_bytes()
        } else {
            Vec::arbitrary(u)?
        };
        Ok(Raw { headers, body })
    }
}

impl Raw {
    fn check(&self) {
        let headers = borrowed(&self.headers);
        let _ = mode(&headers);
        for to in [Format::Structured, Format::Binary] {
            if let Ok(converted) = convert(to, &headers, &self.body) {
                assert_eq!(converted.format, to);
                check_well_formed(&self.headers, &converted);
            }
        }
    }
}

/// What `convert` gave is a message a subscriber can be sent.
fn check_well_formed(input: &[Pair], converted: &Converted) {
    let others = |h: &[Pair]| -> Vec<Pair> {
        h.iter()
            .filter(|(n, _)| !is_event_header(n))
            .cloned()
            .collect()
    };
    assert_eq!(others(&converted.headers), others(input), "{converted:?}");
    // A receiver tells the mode from the headers: it must be the one converted into.
    assert_eq!(
        mode(&borrowed(&converted.headers)),
        Ok(converted.format),
        "{converted:?}"
    );
    for (name, value) in converted.headers.iter().filter(|(n, _)| is_event_header(n)) {
        let made = name
            .strip_prefix(b"ce-")
            .map_or(name == b"content-type", is_attribute_name);
        assert!(made, "{:?}", String::from_utf8_lossy(name));
        assert!(
            !value.iter().any(|b| matches!(b, b'\r' | b'\n' | 0)),
            "{:?}: {:?}",
            String::from_utf8_lossy(name),
            String::from_utf8_lossy(value)
        );
    }
    let event: Vec<&Pair> = converted
        .headers
        .iter()
        .filter(|(n, _)| is_event_header(n))
        .collect();
    match converted.format {
        Format::Structured => {
            assert_eq!(event.len(), 1);
            assert_eq!(event[0], &(b"content-type".to_vec(), STRUCTURED.to_vec()));
            let members = serde_members(&converted.body).unwrap_or_else(|e| {
                panic!(
                    "structured body is not a JSON object serde_json reads: {e}: {:?}",
                    String::from_utf8_lossy(&converted.body)
                )
            });
            let names: Vec<&str> = members.iter().map(|(n, _)| n.as_str()).collect();
            let attributes: Vec<&str> = names
                .iter()
                .copied()
                .filter(|n| *n != "data" && *n != "data_base64")
                .collect();
            assert!(names.len() <= attributes.len() + 1, "{names:?}");
            assert_eq!(&names[..attributes.len()], attributes, "data is last");
            for (i, name) in attributes.iter().enumerate() {
                assert!(is_attribute_name(name.as_bytes()), "{name:?}");
                assert!(!attributes[..i].contains(name), "{name} twice");
            }
            for name in REQUIRED {
                assert!(attributes.contains(&name), "{name} missing");
            }
            // It converts back: the filter's own reader finds the same members.
            let found = object_members(&converted.body).expect("members of its own output");
            let found: Vec<&str> = found.iter().map(|(n, _)| n.as_ref()).collect();
            assert_eq!(found, names);
        }
        Format::Binary => {
            assert!(
                event.iter().filter(|(n, _)| n == b"content-type").count() <= 1,
                "{event:?}"
            );
        }
    }
}

/// A JSON object's members in order, duplicates kept, each value a `Value` (None: a value
/// serde_json's `Value` cannot hold, such as a number out of f64's range).
fn serde_members(text: &[u8]) -> std::result::Result<Vec<(String, Option<Value>)>, String> {
    serde_json::from_slice::<IgnoredAny>(text).map_err(|e| e.to_string())?;
    let mut de = serde_json::Deserializer::from_slice(text);
    de.deserialize_any(Members).map_err(|e| e.to_string())
}

struct Members;

/// A member's value: its text as serde_json delimits it, read as a `Value` when it can be.
struct Member(Option<Value>);

impl<'de> serde::Deserialize<'de> for Member {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let raw = <&'de serde_json::value::RawValue>::deserialize(d)?;
        Ok(Member(serde_json::from_str(raw.get()).ok()))
    }
}

impl<'de> Visitor<'de> for Members {
    type Value = Vec<(String, Option<Value>)>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        let mut members = Vec::new();
        while let Some((name, Member(value))) = map.next_entry::<String, Member>()? {
            members.push((name, value));
        }
        Ok(members)
    }
}

fn check_members(text: &[u8]) {
    let ours = object_members(text);
    let object = std::str::from_utf8(text).is_ok()
        && serde_json::from_slice::<IgnoredAny>(text).is_ok()
        && text
            .iter()
            .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
            == Some(&b'{');
    let Ok(theirs) = serde_members(text) else {
        // Not an object, or one serde_json validates (`IgnoredAny`) but whose names it cannot
        // read (a lone surrogate escape, `"\udc00"`): refused either way.
        assert!(ours.is_err(), "{:?}", String::from_utf8_lossy(text));
        return;
    };
    assert!(object, "{:?}", String::from_utf8_lossy(text));
    let ours = ours.unwrap_or_else(|e| panic!("{e}: {:?}", String::from_utf8_lossy(text)));
    assert_eq!(
        ours.len(),
        theirs.len(),
        "{:?}",
        String::from_utf8_lossy(text)
    );
    for ((name, raw), (their_name, their_value)) in ours.iter().zip(&theirs) {
        assert_eq!(name, their_name);
        assert_eq!(raw.trim(), *raw, "{raw:?} has the space around it");
        serde_json::from_str::<IgnoredAny>(raw)
            .unwrap_or_else(|e| panic!("member {name}: {raw:?} is not one JSON value: {e}"));
        if let Some(value) = their_value {
            let value_of_ours: Value =
                serde_json::from_str(raw).unwrap_or_else(|e| panic!("member {name}: {raw:?}: {e}"));
            assert_eq!(&value_of_ours, value, "member {name}");
        }
    }
}

/// JSON text with any whitespace between tokens.
fn space(u: &mut Unstructured, out: &mut String) -> Result<()> {
    for _ in 0..u.int_in_range(0..=2)? {
        out.push(*u.choose(&[' ', '\t', '\n', '\r'])?);
    }
    Ok(())
}

fn json_string(u: &mut Unstructured, out: &mut String) -> Result<()> {
    let text: String = match u.int_in_range(0..=2)? {
        0 => String::arbitrary(u)?,
        _ => (*u.choose(STRINGS)?).to_string(),
    };
    if u.arbitrary()? {
        // Every character escaped as \uXXXX (surrogate pairs too).
        out.push('"');
        for unit in text.encode_utf16() {
            out.push_str(&format!("\\u{unit:04x}"));
        }
        out.push('"');
    } else {
        out.push_str(&serde_json::to_string(&text).unwrap_or_default());
    }
    Ok(())
}

fn json_value(u: &mut Unstructured, depth: usize, out: &mut String) -> Result<()> {
    let kinds = if depth > 6 { 5 } else { 7 };
    match u.int_in_range(0..=kinds)? {
        0 => json_string(u, out)?,
        1 => out.push_str(&i64::arbitrary(u)?.to_string()),
        2 => out.push_str(u.choose(&["true", "false", "null"])?),
        3 => out.push_str(u.choose(&[
            "1.5",
            "-0",
            "1e3",
            "-1.5E-3",
            "0.0",
            "1e400",
            "123456789012345678901234567890",
        ])?),
        4 => out.push_str(
            &f64::arbitrary(u)?
                .to_string()
                .replace("inf", "1e999")
                .replace("NaN", "0"),
        ),
        5 => {
            // Deep nesting, to serde_json's recursion limit and past it.
            let n = u.int_in_range(0..=140)?;
            out.push_str(&"[".repeat(n));
            out.push_str(&"]".repeat(n));
        }
        6 => json_object(u, depth + 1, out)?,
        _ => {
            out.push('[');
            for i in 0..u.int_in_range(0..=3)? {
                if i > 0 {
                    out.push(',');
                }
                space(u, out)?;
                json_value(u, depth + 1, out)?;
                space(u, out)?;
            }
            out.push(']');
        }
    }
    Ok(())
}

fn json_object(u: &mut Unstructured, depth: usize, out: &mut String) -> Result<()> {
    out.push('{');
    for i in 0..u.int_in_range(0..=6)? {
        if i > 0 {
            out.push(',');
        }
        space(u, out)?;
        if u.arbitrary()? {
            out.push_str(&serde_json::to_string(*u.choose(NAMES)?).unwrap_or_default());
        } else {
            json_string(u, out)?;
        }
        space(u, out)?;
        out.push(':');
        space(u, out)?;
        json_value(u, depth, out)?;
        space(u, out)?;
    }
    out.push('}');
    Ok(())
}

/// A binary-mode event encoded as the binding says.
#[derive(Debug)]
struct BinaryEvent {
    headers: Vec<Pair>,
    body: Vec<u8>,
}

fn attribute_name(u: &mut Unstructured) -> Result<String> {
    let bytes: Vec<u8> = Vec::arbitrary(u)?;
    Ok(bytes
        .iter()
        .take(20)
        .map(|b| char::from(b"abcdefghijklmnopqrstuvwxyz0123456789"[usize::from(b % 36)]))
        .collect())
}

fn binary_event(u: &mut Unstructured) -> Result<BinaryEvent> {
    let mut block: Vec<(String, String)> = Vec::new();
    let value = |u: &mut Unstructured, required: bool| -> Result<String> {
        let mut text = match u.int_in_range(0..=1)? {
            0 => String::arbitrary(u)?,
            _ => (*u.choose(STRINGS)?).to_string(),
        };
        if required && text.is_empty() {
            text.push('x');
        }
        Ok(utf8_percent_encode(&text, HEADER_VALUE).to_string())
    };
    block.push(("ce-specversion".into(), "1.0".into()));
    for name in &REQUIRED[1..] {
        let v = value(u, true)?;
        block.push((format!("ce-{name}"), v));
    }
    for _ in 0..u.int_in_range(0..=4)? {
        let name = attribute_name(u)?;
        let taken = REQUIRED.contains(&name.as_str()) || block.iter().any(|(n, _)| n[3..] == name);
        if name.is_empty() || taken || name == "data" || name == "datacontenttype" {
            continue;
        }
        let v = value(u, false)?;
        block.push((format!("ce-{name}"), v));
    }
    let content_type = match u.int_in_range(0..=3)? {
        0 => None,
        1 => {
            let bytes: Vec<u8> = Vec::arbitrary(u)?;
            Some(bytes.iter().map(|b| char::from(b' ' + b % 95)).collect())
        }
        _ => Some((*u.choose(CONTENT_TYPES)?).to_string()),
    };
    if let Some(ct) = content_type {
        block.push(("content-type".into(), ct));
    }
    // Any order within the block.
    for i in (1..block.len()).rev() {
        let j = u.int_in_range(0..=i)?;
        block.swap(i, j);
    }
    let other = |u: &mut Unstructured| -> Result<Pair> {
        let name = match u.int_in_range(0..=1)? {
            0 => Vec::arbitrary(u)?,
            _ => u
                .choose(&["x-request-id", "traceparent", "Content-Type", "CE-ID"])?
                .as_bytes()
                .to_vec(),
        };
        Ok((name, Vec::arbitrary(u)?))
    };
    // The others are no event headers: the generated block is the only one, all together.
    let (mut before, mut after) = (Vec::new(), Vec::new());
    for _ in 0..u.int_in_range(0..=2)? {
        before.push(other(u)?);
    }
    for _ in 0..u.int_in_range(0..=2)? {
        after.push(other(u)?);
    }
    let mut headers: Vec<Pair> = before
        .into_iter()
        .filter(|(n, _)| !is_event_header(n))
        .collect();
    headers.extend(
        block
            .into_iter()
            .map(|(n, v)| (n.into_bytes(), v.into_bytes())),
    );
    headers.extend(after.into_iter().filter(|(n, _)| !is_event_header(n)));
    let body = match u.int_in_range(0..=2)? {
        0 => Vec::arbitrary(u)?,
        1 => {
            let mut text = String::new();
            space(u, &mut text)?;
            json_value(u, 0, &mut text)?;
            space(u, &mut text)?;
            text.into_bytes()
        }
        _ => {
            let mut text = String::new();
            json_object(u, 0, &mut text)?;
            text.into_bytes()
        }
    };
    Ok(BinaryEvent { headers, body })
}

impl BinaryEvent {
    fn check(&self) {
        let original = borrowed(&self.headers);
        // A content type such as application/cloudevents+json makes it another mode.
        if mode(&original) != Ok(Format::Binary) {
            return;
        }
        let there = convert(Format::Structured, &original, &self.body)
            .unwrap_or_else(|e| panic!("a canonical binary event is refused: {e}: {self:?}"));
        check_well_formed(&self.headers, &there);
        assert_eq!(mode(&borrowed(&there.headers)), Ok(Format::Structured));
        let back =
            convert(Format::Binary, &borrowed(&there.headers), &there.body).unwrap_or_else(|e| {
                panic!(
                    "its structured form is refused: {e}: {:?}",
                    String::from_utf8_lossy(&there.body)
                )
            });
        check_well_formed(&there.headers, &back);
        assert_eq!(
            back.headers,
            self.headers,
            "{:?}",
            String::from_utf8_lossy(&there.body)
        );
        let content_type = self
            .headers
            .iter()
            .find(|(n, _)| n == b"content-type")
            .map(|(_, v)| v.as_slice());
        let json = content_type.is_some_and(is_json_media)
            && std::str::from_utf8(&self.body).is_ok()
            && serde_json::from_slice::<IgnoredAny>(&self.body).is_ok();
        let want: &[u8] = if json {
            self.body.trim_ascii()
        } else {
            &self.body
        };
        assert_eq!(
            String::from_utf8_lossy(&back.body),
            String::from_utf8_lossy(want)
        );
        assert_eq!(back.body, want);
    }
}

/// An event object with members of any kind, in any order.
#[derive(Debug)]
struct StructuredEvent {
    headers: Vec<Pair>,
    body: String,
}

fn structured_event(u: &mut Unstructured) -> Result<StructuredEvent> {
    let mut members: Vec<(String, String)> = Vec::new();
    let string = |u: &mut Unstructured| -> Result<String> {
        let mut text = String::new();
        json_string(u, &mut text)?;
        Ok(text)
    };
    members.push(("specversion".into(), "\"1.0\"".into()));
    for name in &REQUIRED[1..] {
        let v = if u.ratio(1, 16)? {
            let mut text = String::new();
            json_value(u, 0, &mut text)?;
            text
        } else {
            string(u)?
        };
        members.push(((*name).into(), v));
    }
    for _ in 0..u.int_in_range(0..=4)? {
        let name = if u.arbitrary()? {
            (*u.choose(NAMES)?).to_string()
        } else {
            attribute_name(u)?
        };
        let mut v = String::new();
        match u.int_in_range(0..=3)? {
            0 => json_value(u, 0, &mut v)?,
            1 => v.push_str(
                u.choose(CONTENT_TYPES)
                    .map(|ct| format!("{ct:?}"))?
                    .as_str(),
            ),
            2 if name == "data_base64" => {
                let bytes: Vec<u8> = Vec::arbitrary(u)?;
                v = format!("\"{}\"", STANDARD.encode(bytes));
            }
            _ => v = string(u)?,
        }
        members.push((name, v));
    }
    // The members that decide the body, often, so that many events convert.
    if u.arbitrary()? {
        let ct = *u.choose(CONTENT_TYPES)?;
        members.push((
            "datacontenttype".into(),
            serde_json::to_string(ct).unwrap_or_default(),
        ));
    }
    match u.int_in_range(0..=2)? {
        0 => {}
        1 => {
            let mut v = String::new();
            json_value(u, 0, &mut v)?;
            members.push(("data".into(), v));
        }
        _ => {
            let bytes: Vec<u8> = Vec::arbitrary(u)?;
            members.push((
                "data_base64".into(),
                format!("\"{}\"", STANDARD.encode(bytes)),
            ));
        }
    }
    for i in (1..members.len()).rev() {
        let j = u.int_in_range(0..=i)?;
        members.swap(i, j);
    }
    let mut body = String::new();
    space(u, &mut body)?;
    body.push('{');
    for (i, (name, value)) in members.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        space(u, &mut body)?;
        body.push_str(&serde_json::to_string(name).unwrap_or_default());
        space(u, &mut body)?;
        body.push(':');
        space(u, &mut body)?;
        body.push_str(value);
        space(u, &mut body)?;
    }
    body.push('}');
    space(u, &mut body)?;
    let content_type = *u.choose(&[
        "application/cloudevents+json",
        "application/cloudevents+json; charset=utf-8",
        "Application/CloudEvents+JSON",
    ])?;
    let mut headers = vec![(b"content-type".to_vec(), content_type.as_bytes().to_vec())];
    if u.arbitrary()? {
        headers.insert(0, (b"x-request-id".to_vec(), Vec::arbitrary(u)?));
    }
    if u.arbitrary()? {
        headers.push((b"ce-stale".to_vec(), b"x".to_vec()));
    }
    Ok(StructuredEvent { headers, body })
}

/// A JSON string's value, from its text.
fn string_value(raw: &str) -> Option<String> {
    match serde_json::from_str::<Value>(raw) {
        Ok(Value::String(s)) => Some(s),
        _ => None,
    }
}

impl StructuredEvent {
    fn check(&self) {
        let headers = borrowed(&self.headers);
        assert_eq!(mode(&headers), Ok(Format::Structured));
        let Ok(binary) = convert(Format::Binary, &headers, self.body.as_bytes()) else {
            return;
        };
        check_well_formed(&self.headers, &binary);
        let back = convert(Format::Structured, &borrowed(&binary.headers), &binary.body)
            .unwrap_or_else(|e| panic!("its binary form is refused: {e}: {binary:?}"));
        check_well_formed(&binary.headers, &back);
        let Ok(original) = object_members(self.body.as_bytes()) else {
            panic!("converted, yet no members");
        };
        // The attributes expected back, in order, each its canonical string.
        let mut want: Vec<(String, String)> = Vec::new();
        let (mut data, mut data_base64) = (None, None);
        for (name, raw) in &original {
            match name.as_ref() {
                "data" => data = Some(*raw),
                "data_base64" => data_base64 = Some(*raw),
                _ if *raw == "null" => {}
                _ => {
                    let text = string_value(raw).unwrap_or_else(|| raw.to_string());
                    want.push((name.to_string(), text));
                }
            }
        }
        let content_type = want
            .iter()
            .find(|(n, _)| n == "datacontenttype")
            .map(|(_, v)| v.clone());
        let payload: Vec<u8> = match (data, data_base64) {
            (Some(raw), None) => match &content_type {
                None => {
                    want.push(("datacontenttype".into(), "application/json".into()));
                    raw.as_bytes().to_vec()
                }
                Some(ct) if is_json_media(ct.as_bytes()) => raw.as_bytes().to_vec(),
                Some(_) => string_value(raw)
                    .expect("a non-JSON type's data is a string")
                    .into_bytes(),
            },
            (None, Some(raw)) => {
                let text = string_value(raw).expect("data_base64 is a string");
                BASE64.decode(text.as_bytes()).expect("data_base64 decodes")
            }
            (None, None) => Vec::new(),
            (Some(_), Some(_)) => panic!("both data and data_base64 converted"),
        };
        assert_eq!(binary.body, payload, "{binary:?}");
        let content_type = want
            .iter()
            .find(|(n, _)| n == "datacontenttype")
            .map(|(_, v)| v.clone());
        let found = object_members(&back.body).expect("members of its own output");
        let mut got: Vec<(String, String)> = Vec::new();
        let mut got_data = None;
        for (name, raw) in &found {
            match name.as_ref() {
                "data" => got_data = Some(("data", raw.to_string())),
                "data_base64" => {
                    got_data = Some(("data_base64", string_value(raw).unwrap_or_default()))
                }
                _ => got.push((
                    name.to_string(),
                    string_value(raw).expect("an attribute string"),
                )),
            }
        }
        assert_eq!(got, want, "{:?}", String::from_utf8_lossy(&back.body));
        let json = content_type
            .as_deref()
            .is_some_and(|ct| is_json_media(ct.as_bytes()))
            && std::str::from_utf8(&payload).is_ok()
            && serde_json::from_slice::<IgnoredAny>(&payload).is_ok();
        let want_data = if payload.is_empty() {
            None
        } else if json {
            // Embedded as the JSON value: the whitespace around it is not kept (docs).
            Some((
                "data",
                String::from_utf8_lossy(payload.trim_ascii()).into_owned(),
            ))
        } else {
            Some(("data_base64", STANDARD.encode(&payload)))
        };
        assert_eq!(got_data, want_data);
    }
}
