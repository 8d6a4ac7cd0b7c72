//! `delivery.format` in the real Envoy, with the CloudEvents Python SDK on both sides: the SDK
//! makes an event in binary or structured mode, fanout delivers it to a subscriber that takes
//! it as it came, one that asks for binary and one that asks for structured (Knative's word,
//! `json`), and the SDK reads each delivery back and finds the same event (id, source, type,
//! extensions, the data's bytes). A request that cannot be converted exactly gets 400 and no
//! subscriber is called. The dead letter of such a subscriber is in its mode too, with
//! Knative's error attributes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness;

use std::time::Duration;

use harness::sdk::{b64, post_message, sdk_message, sdk_read};
use harness::{send, Client, Envoy, Recorded, Subscriber};
use serde_json::{json, Value};

/// An event made by the SDK in `mode`: JSON data (`json`) or bytes under a non-JSON type
/// (`bytes`), with string and integer extensions, one of them non-ASCII.
fn sdk_event(mode: &str, data: &str, id: &str) -> (Vec<(String, String)>, Vec<u8>) {
    const MAKE: &str = r#"
import base64, json, sys
from cloudevents.core.bindings import http
from cloudevents.core.v1.event import CloudEvent
mode, kind, id = sys.argv[1], sys.argv[2], sys.argv[3]
attributes = {"type": "com.example.order.created", "source": "/orders/eu", "id": id,
              "subject": "invoice 7.pdf", "greeting": "gr\u00fc\u00dfe aus K\u00f6ln \"100%\"",
              "sequence": 7}
if kind == "json":
    attributes["datacontenttype"] = "application/json"
    data = {"order": 7, "note": "caf\u00e9", "list": [1, 2.5, None]}
else:
    attributes["datacontenttype"] = "application/octet-stream"
    data = bytes([0, 1, 2, 0xff, 0xfe, 0x80, 10])
event = CloudEvent(attributes=attributes, data=data)
message = http.to_binary_event(event) if mode == "binary" else http.to_structured_event(event)
print(json.dumps({"headers": message.headers, "body": base64.b64encode(message.body).decode()}))
"#;
    sdk_message(MAKE, &[mode, data, id])
}

/// The delivery as the SDK's `from_http` reads it: the mode it found, the attributes (every
/// value as text) and the data as bytes (JSON data re-serialized canonically, so that the
/// two modes compare).
fn sdk_reads(request: &Recorded) -> Value {
    const READ: &str = r#"
import base64, json, sys
from cloudevents.core.bindings.http import HTTPMessage, from_http
from cloudevents.core.formats.json import JSONFormat
got = json.load(sys.stdin)
headers, body = got["headers"], base64.b64decode(got["body"])
event = from_http(HTTPMessage(headers=headers, body=body), JSONFormat())
attributes = {k: (v.isoformat() if hasattr(v, "isoformat") else str(v))
              for k, v in event.get_attributes().items()}
data = event.get_data()
if isinstance(data, (bytes, bytearray)):
    data = {"bytes": base64.b64encode(bytes(data)).decode()}
else:
    data = {"json": json.dumps(data, sort_keys=True)}
mode = "structured" if headers.get("content-type", "").startswith("application/cloudevents+json") else "binary"
print(json.dumps({"mode": mode, "attributes": attributes, "data": data}))
"#;
    sdk_read(READ, request)
}

fn formats_config() -> Value {
    json!({
        "subscribers": [
            { "cluster": "as-is" },
            { "cluster": "bin", "delivery": { "format": "binary" } },
            { "cluster": "structured", "delivery": { "format": "json" } }
        ]
    })
}

#[test]
fn each_subscriber_reads_the_same_event_in_the_mode_it_asked_for() {
    let (as_is, bin, structured) = (
        Subscriber::ok("as-is"),
        Subscriber::ok("bin"),
        Subscriber::ok("structured"),
    );
    let envoy = Envoy::with_subscribers(&formats_config(), &[&as_is, &bin, &structured]);
    let mut sent = 0;
    for mode in ["binary", "structured"] {
        for data in ["json", "bytes"] {
            let id = format!("{mode}-{data}");
            let (headers, body) = sdk_event(mode, data, &id);
            let reply = post_message(&envoy, &headers, &body);
            assert_eq!(reply.status, 202, "{mode} {data}: {}", reply.text());
            sent += 1;
            let read: Vec<Value> = [&as_is, &bin, &structured]
                .iter()
                .map(|sub| {
                    let requests = sub.requests();
                    assert_eq!(requests.len(), sent, "{}", sub.name());
                    sdk_reads(requests.last().unwrap())
                })
                .collect();
            assert_eq!(read[0]["mode"], mode, "as-is: {}", read[0]);
            assert_eq!(read[1]["mode"], "binary", "{}", read[1]);
            assert_eq!(read[2]["mode"], "structured", "{}", read[2]);
            for got in &read {
                let attributes = &got["attributes"];
                assert_eq!(attributes["id"], id.as_str(), "{got}");
                assert_eq!(attributes["source"], "/orders/eu");
                assert_eq!(attributes["type"], "com.example.order.created");
                assert_eq!(attributes["subject"], "invoice 7.pdf");
                assert_eq!(attributes["greeting"], "grüße aus Köln \"100%\"", "{got}");
                assert_eq!(attributes["sequence"], "7");
                assert_eq!(got["data"], read[0]["data"], "{mode} {data}");
            }
            let want = if data == "json" {
                json!({"json": r#"{"list": [1, 2.5, null], "note": "caf\u00e9", "order": 7}"#})
            } else {
                json!({"bytes": b64(&[0, 1, 2, 0xff, 0xfe, 0x80, 10])})
            };
            assert_eq!(read[0]["data"], want, "{mode} {data}");
        }
    }
}

#[test]
fn a_request_that_cannot_be_converted_gets_400_and_nobody_is_called() {
    let (as_is, bin, structured) = (
        Subscriber::ok("as-is"),
        Subscriber::ok("bin"),
        Subscriber::ok("structured"),
    );
    let envoy = Envoy::with_subscribers(&formats_config(), &[&as_is, &bin, &structured]);
    let not_an_event = send(
        Client::http1()
            .post(&envoy.url("/"))
            .header("content-type", "text/plain")
            .body("hello"),
    );
    assert_eq!(not_an_event.status, 400, "{}", not_an_event.text());
    let error: Value = serde_json::from_str(&not_an_event.text()).unwrap();
    assert!(
        error["error"]
            .as_str()
            .unwrap()
            .starts_with("subscriber bin (#1) takes events in binary mode (delivery.format)"),
        "{error}"
    );
    // An extension that is an object has no exact ce- header.
    let object_extension = send(
        Client::http1()
            .post(&envoy.url("/"))
            .header("content-type", "application/cloudevents+json")
            .body(
                r#"{"specversion": "1.0", "id": "1", "source": "/s", "type": "t",
                    "nested": {"a": 1}, "data": {}}"#,
            ),
    );
    assert_eq!(object_extension.status, 400, "{}", object_extension.text());
    assert!(
        object_extension
            .text()
            .contains("member nested is an object"),
        "{}",
        object_extension.text()
    );
    let batch = send(
        Client::http1()
            .post(&envoy.url("/"))
            .header("content-type", "application/cloudevents-batch+json")
            .body("[]"),
    );
    assert_eq!(batch.status, 400, "{}", batch.text());
    for sub in [&as_is, &bin, &structured] {
        sub.stays_at(0, Duration::from_millis(300));
    }
    envoy.expect_stat(
        "wasmcustom.fanout.requests.rejected.400",
        |n| n == 3,
        Duration::from_secs(10),
    );
}

#[test]
fn the_dead_letter_of_a_subscriber_with_a_format_is_in_that_mode_with_knatives_attributes() {
    let failing = Subscriber::start("structured", harness::Behavior::Status(503));
    let dlq = Subscriber::ok("dlq");
    let config = json!({
        "subscribers": [{ "cluster": "structured",
                          "delivery": { "format": "json", "dead_letter": { "cluster": "dlq" } } }]
    });
    let envoy = Envoy::with_subscribers(&config, &[&failing, &dlq]);
    let (headers, body) = sdk_event("binary", "json", "dead-1");
    let reply = post_message(&envoy, &headers, &body);
    assert_eq!(reply.status, 202, "{}", reply.text());
    let letter = dlq.only_request();
    let read = sdk_reads(&letter);
    assert_eq!(read["mode"], "structured", "{read}");
    let attributes = &read["attributes"];
    assert_eq!(attributes["id"], "dead-1");
    assert_eq!(attributes["greeting"], "grüße aus Köln \"100%\"");
    assert_eq!(attributes["knativeerrorcode"], "503", "{read}");
    assert_eq!(
        read["data"],
        json!({"json": r#"{"list": [1, 2.5, null], "note": "caf\u00e9", "order": 7}"#})
    );
    // The subscriber itself got the same structured event, without the error attributes.
    let got = sdk_reads(&failing.only_request());
    assert_eq!(got["mode"], "structured");
    assert_eq!(got["attributes"].get("knativeerrorcode"), None, "{got}");
}

/// A `ce-*` value sent as a quoted-string (as older senders write it, and the binding says a
/// receiver must read) is one value to every reader in the real Envoy: `require_cloudevents`
/// takes it, a filter on it matches, the structured delivery carries it unquoted, and the same
/// event sent percent-encoded is the same event to dedupe.
#[test]
fn a_quoted_header_value_is_one_value_to_every_reader() {
    let (filtered, structured) = (Subscriber::ok("filtered"), Subscriber::ok("structured"));
    let config = json!({
        "require_cloudevents": true,
        "dedupe": {},
        "subscribers": [
            { "cluster": "filtered", "filters": [{ "exact": { "id": "a b\"c" } }] },
            { "cluster": "structured", "delivery": { "format": "json" } }
        ]
    });
    let envoy = Envoy::with_subscribers(&config, &[&filtered, &structured]);
    let post = |specversion: &str, id: &str, source: &str| {
        send(
            Client::http1()
                .post(&envoy.url("/"))
                .header("content-type", "application/json")
                .header("ce-specversion", specversion)
                .header("ce-type", "t")
                .header("ce-source", source)
                .header("ce-id", id)
                .body("{}"),
        )
    };
    let quoted = post(r#""1.0""#, r#""a b\"c""#, r#""/s""#);
    assert_eq!(quoted.status, 202, "{}", quoted.text());
    assert_eq!(filtered.count(), 1, "the filter on id matched");
    assert_eq!(
        filtered.requests()[0].header("ce-id"),
        Some(r#""a b\"c""#),
        "a subscriber that takes the event as it came gets the header as it came"
    );
    let delivered: Value = serde_json::from_slice(&structured.requests()[0].body).unwrap();
    assert_eq!(delivered["id"], "a b\"c", "{delivered}");
    assert_eq!(delivered["source"], "/s", "{delivered}");
    assert_eq!(delivered["specversion"], "1.0", "{delivered}");

    let encoded = post("1.0", "a%20b%22c", "%2Fs");
    assert_eq!(encoded.status, 202, "{}", encoded.text());
    assert_eq!(
        encoded.header("x-fanout-already-delivered").as_deref(),
        Some("2"),
        "the percent-encoded copy is the same event: {}",
        encoded.text()
    );
    assert_eq!((filtered.count(), structured.count()), (1, 1));
}
