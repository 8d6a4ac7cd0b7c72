//! Knative's `event_dispatcher_test.go`: TestEventFormats (`delivery.format`), replayed.

use super::*;

/// sdk-go's `binding.Encoding` of a request, as its HTTP message reads it
/// (`NewMessageFromHttpRequest`, `ReadEncoding`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Encoding {
    Binary,
    Structured,
    Unknown,
}

/// The event's data in a format case: sdk-go's `test.FullEvent()`'s, or (in the variants
/// below Knative's two subtests) the same event with other data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FormatData {
    /// `SetData("text/json", "hello")`: the Go string encoded as JSON, quotes and all.
    FullEvent,
    /// Text under `text/plain`.
    Text,
    /// JSON under a `+json` media type.
    PlusJson,
    /// JSON without a `datacontenttype`.
    Untyped,
}

impl FormatData {
    const fn content_type(self) -> Option<&'static str> {
        match self {
            FormatData::FullEvent => Some("text/json"),
            FormatData::Text => Some("text/plain"),
            FormatData::PlusJson => Some("application/vnd.order+json"),
            FormatData::Untyped => None,
        }
    }

    const fn bytes(self) -> &'static str {
        match self {
            FormatData::FullEvent => "\"hello\"",
            FormatData::Text => "hello",
            FormatData::PlusJson | FormatData::Untyped => "{\"order\":7}",
        }
    }
}

/// What Knative's destination finds in a delivery (its `expectedEncoding`, then the event's
/// data as sdk-go's `binding.ToEvent` reads it, or the error it reads instead, and its
/// `datacontenttype`). Knative's test also compares the id: every case's is the event's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FormatRead {
    encoding: Encoding,
    data: Result<&'static str, &'static str>,
    datacontenttype: Option<&'static str>,
}

/// One of TestEventFormats' subtests, from one of the two modes a sender can send in.
pub(super) struct FormatCase {
    pub(super) knative: &'static str,
    /// Knative's `v1.FormatType` (`DeliveryFormatBinary`, `DeliveryFormatJson`): the
    /// DeliverySpec's `format`, through the import.
    format: &'static str,
    /// The mode the sender sends the event in. Knative's test hands its dispatcher a Go event,
    /// which has none; over HTTP an event always has one: both are replayed.
    sent: Encoding,
    data: FormatData,
    /// What Knative's destination reads (the variants: what Knative's dispatcher, sdk-go
    /// v2.16.1's `binding.Write` with `WithForceStructured`, sends, read back by sdk-go).
    knative_expects: FormatRead,
    fanout: FormatRead,
    /// The member that carries the data in fanout's structured delivery.
    member: Option<&'static str>,
    pub(super) verdict: Verdict,
}

/// A [`FormatRead`] of the data of `sent`, with its `datacontenttype`.
const fn read(encoding: Encoding, sent: FormatData) -> FormatRead {
    FormatRead {
        encoding,
        data: Ok(sent.bytes()),
        datacontenttype: sent.content_type(),
    }
}

/// sdk-go's error, reading `data` that is not a string under a type it holds not JSON.
const NOT_A_STRING: &str = "unexpected data payload for media type, expected a string";

const PLUS_JSON_WHY: &str = "fanout embeds data under a +json type as JSON, as the JSON event \
     format says (v1.0.2, 3.1: */json and */*+json are JSON); sdk-go v2.16.1, Knative's, holds \
     only application/json and text/json JSON: Knative's dispatcher writes such data as a JSON \
     string, and a Go destination cannot read fanout's (sdk-go's main branch, 5693be0f, not in \
     a release, reads */*+json as JSON, as fanout does)";

pub(super) const FORMAT_CASES: &[FormatCase] = &[
    FormatCase {
        knative: "TestEventFormats/BinaryFormat, sent in binary mode",
        format: "binary",
        sent: Encoding::Binary,
        data: FormatData::FullEvent,
        knative_expects: read(Encoding::Binary, FormatData::FullEvent),
        fanout: read(Encoding::Binary, FormatData::FullEvent),
        member: None,
        verdict: Verdict::Agrees,
    },
    FormatCase {
        knative: "TestEventFormats/BinaryFormat, sent in structured mode",
        format: "binary",
        sent: Encoding::Structured,
        data: FormatData::FullEvent,
        knative_expects: read(Encoding::Binary, FormatData::FullEvent),
        fanout: read(Encoding::Binary, FormatData::FullEvent),
        member: None,
        verdict: Verdict::Agrees,
    },
    FormatCase {
        knative: "TestEventFormats/JsonFormat, sent in binary mode",
        format: "json",
        sent: Encoding::Binary,
        data: FormatData::FullEvent,
        knative_expects: read(Encoding::Structured, FormatData::FullEvent),
        fanout: read(Encoding::Structured, FormatData::FullEvent),
        member: Some("data"),
        verdict: Verdict::Agrees,
    },
    FormatCase {
        knative: "TestEventFormats/JsonFormat, sent in structured mode",
        format: "json",
        sent: Encoding::Structured,
        data: FormatData::FullEvent,
        knative_expects: read(Encoding::Structured, FormatData::FullEvent),
        fanout: read(Encoding::Structured, FormatData::FullEvent),
        member: Some("data"),
        verdict: Verdict::Agrees,
    },
    FormatCase {
        knative: "TestEventFormats/JsonFormat, sent in binary mode, text/plain data",
        format: "json",
        sent: Encoding::Binary,
        data: FormatData::Text,
        knative_expects: read(Encoding::Structured, FormatData::Text),
        fanout: read(Encoding::Structured, FormatData::Text),
        member: Some("data_base64"),
        verdict: Verdict::Agrees,
    },
    FormatCase {
        knative: "TestEventFormats/JsonFormat, sent in binary mode, +json data",
        format: "json",
        sent: Encoding::Binary,
        data: FormatData::PlusJson,
        knative_expects: read(Encoding::Structured, FormatData::PlusJson),
        fanout: FormatRead {
            encoding: Encoding::Structured,
            data: Err(NOT_A_STRING),
            datacontenttype: FormatData::PlusJson.content_type(),
        },
        member: Some("data"),
        verdict: Verdict::Differs(PLUS_JSON_WHY),
    },
    FormatCase {
        knative: "TestEventFormats/JsonFormat, sent in binary mode, no content-type",
        format: "json",
        sent: Encoding::Binary,
        data: FormatData::Untyped,
        knative_expects: read(Encoding::Structured, FormatData::Untyped),
        fanout: read(Encoding::Structured, FormatData::Untyped),
        member: Some("data_base64"),
        verdict: Verdict::Agrees,
    },
    FormatCase {
        knative: "TestEventFormats/BinaryFormat, sent in structured mode, no datacontenttype",
        format: "binary",
        sent: Encoding::Structured,
        data: FormatData::Untyped,
        knative_expects: read(Encoding::Binary, FormatData::Untyped),
        fanout: FormatRead {
            datacontenttype: Some("application/json"),
            ..read(Encoding::Binary, FormatData::Untyped)
        },
        member: None,
        verdict: Verdict::Differs(IMPLIED_JSON_WHY),
    },
];

const IMPLIED_JSON_WHY: &str = "without datacontenttype, fanout's binary delivery says \
     content-type: application/json, the implied type the JSON event format says a re-encoded \
     event SHOULD state (v1.0.2, 3.1.2; docs/delivery.md, Content mode per subscriber); \
     Knative's dispatcher (sdk-go v2.16.1) sends no content-type, so its destination reads no \
     datacontenttype";

/// sdk-go's `test.FullEvent()`, each attribute as its canonical string (CloudEvents 1.0.2,
/// 2 type system: a Boolean `true`, an Integer `42`, Binary in base64, a Timestamp in RFC
/// 3339), but `datacontenttype`.
const FULL_EVENT_ATTRIBUTES: &[(&str, &str)] = &[
    ("specversion", "1.0"),
    ("id", "full-event"),
    ("source", "http://example.com/source"),
    ("type", "com.example.FullEvent"),
    ("time", "2020-03-21T12:34:56.78Z"),
    ("dataschema", "http://example.com/schema"),
    ("subject", "topic"),
    ("exbool", "true"),
    ("exint", "42"),
    ("exstring", "exstring"),
    ("exbinary", "AAECAw=="),
    ("exurl", "http://example.com/source"),
    ("extime", "2020-03-21T12:34:56.78Z"),
];

/// The attributes of `test.FullEvent()` with `data`, as canonical strings.
fn full_event_attributes(data: FormatData) -> BTreeMap<String, String> {
    let mut attributes: BTreeMap<String, String> = FULL_EVENT_ATTRIBUTES
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
    if let Some(content_type) = data.content_type() {
        attributes.insert("datacontenttype".to_owned(), content_type.to_owned());
    }
    attributes
}

/// `test.FullEvent()` with `data` as sdk-go writes it in `mode` (its HTTP binding's
/// `WriteRequest`): in binary mode `ce-*` headers, `content-type` and the data; in structured
/// mode one JSON object with the typed extensions (`exbool` a JSON boolean, `exint` a number)
/// and the JSON data embedded.
pub(super) fn full_event_in(mode: Encoding, data: FormatData) -> (Vec<(String, String)>, String) {
    match mode {
        Encoding::Binary => {
            let mut headers: Vec<(String, String)> = FULL_EVENT_ATTRIBUTES
                .iter()
                .map(|(name, value)| (format!("ce-{name}"), value.to_string()))
                .collect();
            if let Some(content_type) = data.content_type() {
                headers.push(("content-type".to_owned(), content_type.to_owned()));
            }
            (headers, data.bytes().to_owned())
        }
        Encoding::Structured => {
            assert_ne!(data, FormatData::Text, "sent structured: JSON data only");
            let mut event = serde_json::Map::new();
            for (name, value) in FULL_EVENT_ATTRIBUTES {
                let value = match *name {
                    "exbool" => json!(true),
                    "exint" => json!(42),
                    _ => json!(value),
                };
                event.insert(name.to_string(), value);
            }
            if let Some(content_type) = data.content_type() {
                event.insert("datacontenttype".to_owned(), json!(content_type));
            }
            let value: Value = serde_json::from_str(data.bytes()).unwrap();
            event.insert("data".to_owned(), value);
            let headers = vec![(
                "content-type".to_owned(),
                "application/cloudevents+json".to_owned(),
            )];
            (headers, Value::Object(event).to_string())
        }
        Encoding::Unknown => unreachable!("an event is sent in one of the two modes"),
    }
}

/// What one request is to sdk-go v2.16.1 (Knative's) at Knative's destination.
struct GoRead {
    /// `NewMessageFromHttpRequest(...).ReadEncoding()`: structured when `content-type` is
    /// `application/cloudevents+json`, binary when there is `ce-specversion`.
    encoding: Encoding,
    /// The attributes as canonical strings.
    attributes: BTreeMap<String, String>,
    /// The data as `binding.ToEvent` reads it (`Event.Data()`), or its error.
    data: Result<Vec<u8>, String>,
    /// In structured mode, the member that carried the data.
    member: Option<String>,
}

/// sdk-go v2.16.1's `isJSON` (`v2/event/content_type.go`): these media types, or none.
fn go_is_json(content_type: Option<&str>) -> bool {
    let media = content_type
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    matches!(
        media.as_str(),
        "" | "application/json"
            | "text/json"
            | "application/cloudevents+json"
            | "application/cloudevents-batch+json"
    )
}

/// A request as sdk-go's HTTP message and `binding.ToEvent` read it: in structured mode (its
/// `consumeData`) `data` under a JSON type is its JSON text, under another type it must be a
/// string (its value), `data_base64` is decoded; in binary mode the data is the body.
fn go_reads(request: &Recorded) -> GoRead {
    let structured = request
        .header("content-type")
        .and_then(|ct| ct.split(';').next())
        .is_some_and(|media| {
            media
                .trim()
                .eq_ignore_ascii_case("application/cloudevents+json")
        });
    let mut read = GoRead {
        encoding: Encoding::Unknown,
        attributes: BTreeMap::new(),
        data: Ok(request.body.clone()),
        member: None,
    };
    if structured {
        read.encoding = Encoding::Structured;
        let event: BTreeMap<String, Box<serde_json::value::RawValue>> =
            serde_json::from_slice(&request.body).unwrap();
        for (name, raw) in &event {
            let value: Value = serde_json::from_str(raw.get()).unwrap();
            match (name.as_str(), value) {
                ("data" | "data_base64", _) => {}
                (_, Value::String(text)) => {
                    read.attributes.insert(name.clone(), text);
                }
                (_, Value::Null) => {}
                (_, other) => {
                    read.attributes.insert(name.clone(), other.to_string());
                }
            }
        }
        read.data = Ok(Vec::new());
        if let Some(raw) = event.get("data_base64") {
            read.member = Some("data_base64".to_owned());
            let text: String = serde_json::from_str(raw.get()).unwrap();
            read.data = Ok(base64::engine::general_purpose::STANDARD
                .decode(text)
                .unwrap());
        } else if let Some(raw) = event.get("data") {
            read.member = Some("data".to_owned());
            let json = go_is_json(read.attributes.get("datacontenttype").map(String::as_str));
            read.data = match serde_json::from_str::<Value>(raw.get()).unwrap() {
                _ if json => Ok(raw.get().as_bytes().to_vec()),
                Value::String(text) => Ok(text.into_bytes()),
                _ => Err(NOT_A_STRING.to_owned()),
            };
        }
        return read;
    }
    if request.header("ce-specversion").is_none() {
        return read;
    }
    read.encoding = Encoding::Binary;
    for (name, value) in &request.headers {
        if let Some(attribute) = name.strip_prefix("ce-") {
            let decoded = percent_encoding::percent_decode_str(value)
                .decode_utf8()
                .unwrap()
                .into_owned();
            read.attributes.insert(attribute.to_owned(), decoded);
        } else if name == "content-type" {
            read.attributes
                .insert("datacontenttype".to_owned(), value.clone());
        }
    }
    read
}

#[test]
fn event_dispatcher_event_formats() {
    // Knative's DeliverySpec formats, through the import as its users write them.
    let (code, stderr, imported) = import_deliveries(
        &FORMAT_CASES
            .iter()
            .map(|c| json!({ "format": c.format }))
            .collect::<Vec<_>>(),
    );
    assert_eq!(code, 0, "{stderr}");
    let servers: Vec<Subscriber> = (0..FORMAT_CASES.len())
        .map(|i| Subscriber::ok(&format!("f{i}-destination")))
        .collect();
    let mut builder = Envoy::builder();
    let mut channels = Vec::new();
    for (i, ((case, sub), server)) in FORMAT_CASES.iter().zip(&imported).zip(&servers).enumerate() {
        assert_verdict_is_honest(
            case.knative,
            case.verdict,
            &case.knative_expects,
            &case.fanout,
        );
        assert_eq!(
            sub["delivery"],
            json!({ "format": case.format }),
            "{}: the import carries the format over",
            case.knative
        );
        builder = builder.cluster(server.name(), server.port());
        channels.push(
            json!({ "name": format!("f{i}"), "hosts": [format!("f{i}.replay")],
            "subscribers": [{ "cluster": server.name(), "delivery": sub["delivery"] }] }),
        );
    }
    let envoy = builder.fanout(&json!({ "channels": channels })).start();
    for (i, case) in FORMAT_CASES.iter().enumerate() {
        let (headers, body) = full_event_in(case.sent, case.data);
        // What is sent is what the case means: sdk-go finds the mode and the event in it.
        let sent = go_reads(&Recorded {
            method: "POST".to_owned(),
            path: "/".to_owned(),
            version: "HTTP/1.1".to_owned(),
            headers: headers.clone(),
            body: body.clone().into_bytes(),
            at: Instant::now(),
        });
        assert_eq!(sent.encoding, case.sent, "{}", case.knative);
        assert_eq!(
            sent.attributes,
            full_event_attributes(case.data),
            "{}",
            case.knative
        );
        assert_eq!(
            sent.data,
            Ok(case.data.bytes().as_bytes().to_vec()),
            "{}",
            case.knative
        );
        // Knative: no error, the destination's 200. fanout: 202.
        let reply = post(&envoy, &format!("f{i}.replay"), &headers, &body);
        assert_eq!(reply.status, 202, "{}: {}", case.knative, reply.text());
    }
    std::thread::sleep(SETTLE);
    for (case, server) in FORMAT_CASES.iter().zip(&servers) {
        let what = case.knative;
        has_exactly(server, 1, what);
        let got = server.only_request();
        let read = go_reads(&got);
        // What Knative's test asserts: the encoding, the event's id and its data.
        let data = read
            .data
            .as_ref()
            .map(|d| String::from_utf8_lossy(d).into_owned())
            .map_err(Clone::clone);
        let want = case.fanout;
        assert_eq!(read.encoding, want.encoding, "{what}: encoding: {got:#?}");
        assert_eq!(
            data,
            want.data.map(str::to_owned).map_err(str::to_owned),
            "{what}: data: {got:#?}"
        );
        assert_eq!(
            read.attributes.get("datacontenttype").map(String::as_str),
            want.datacontenttype,
            "{what}: {got:#?}"
        );
        assert_eq!(
            read.attributes.get("id").map(String::as_str),
            Some("full-event"),
            "{what}: {got:#?}"
        );
        // And what fanout's docs say beyond it: the data's member, and every other attribute
        // as it was sent (as canonical strings: a binary-mode header has no JSON type).
        assert_eq!(read.member.as_deref(), case.member, "{what}: {got:#?}");
        let mut attributes = read.attributes.clone();
        let mut sent = full_event_attributes(case.data);
        attributes.remove("datacontenttype");
        sent.remove("datacontenttype");
        assert_eq!(attributes, sent, "{what}: attributes: {got:#?}");
        if case.sent == Encoding::Binary && case.fanout.encoding == Encoding::Structured {
            // Converted from headers, the extensions are strings, as in Knative's dispatcher.
            let event: Value = serde_json::from_slice(&got.body).unwrap();
            assert_eq!(event["exbool"], json!("true"), "{what}: {event}");
            assert_eq!(event["exint"], json!("42"), "{what}: {event}");
        }
    }
}
