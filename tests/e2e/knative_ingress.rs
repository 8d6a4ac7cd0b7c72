//! Knative's data plane at the ingress, in the real Envoy, with the CloudEvents Python SDK as
//! the client that makes the events (binary and structured mode, CloudEvents 1.0 and 0.3) and
//! as the consumer that reads what a subscriber received:
//! - `dedupe` names an event by its (`source`, `id`), as data-plane.md requires: the same id
//!   from two sources is two events, a copy of either is a duplicate, in both modes alike;
//! - `require_cloudevents`: what is not a valid CloudEvent gets 400 naming what is wrong and
//!   reaches nobody; a valid one is fanned out unchanged (its version kept);
//! - OPTIONS gets 200 with `allow: POST, OPTIONS` and the CloudEvents webhook validation
//!   headers, and reaches nobody; other methods keep their 405, with the same `allow`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness;

use std::time::Duration;

use harness::sdk::run_sdk;
use harness::{send, Behavior, Client, Envoy, Recorded, Reply, Subscriber};
use reqwest::Method;
use serde_json::{json, Value};

/// Makes HTTP messages of events with the SDK: reads a JSON list of `{"mode": "binary" |
/// "structured", "specversion": "1.0" | "0.3", "attributes": {...}, "data": ...}` and prints
/// a JSON list of `{"headers": {...}, "body": "..."}`, as the SDK's bindings encode them (the
/// bodies are JSON, so text).
const ENCODE: &str = r#"
import json, sys
from cloudevents.core.bindings import http
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent as CloudEvent10
from cloudevents.core.v03.event import CloudEvent as CloudEvent03

out = []
for spec in json.load(sys.stdin):
    make = CloudEvent10 if spec["specversion"] == "1.0" else CloudEvent03
    event = make(attributes=spec["attributes"], data=spec["data"])
    encode = http.to_binary if spec["mode"] == "binary" else http.to_structured
    message = encode(event, JSONFormat())
    out.append({"headers": message.headers, "body": message.body.decode()})
print(json.dumps(out))
"#;

/// Reads HTTP messages (a JSON list of `{"headers": {...}, "body": "..."}`) as the SDK's
/// `from_http` does, and prints each event's `specversion`, `source`, `id`, `type` and data.
const DECODE: &str = r#"
import json, sys
from cloudevents.core.bindings import http
from cloudevents.core.formats.json import JSONFormat

out = []
for m in json.load(sys.stdin):
    message = http.HTTPMessage(headers=m["headers"], body=m["body"].encode())
    event = http.from_http(message, JSONFormat())
    a = event.get_attributes()
    out.append({k: a.get(k) for k in ("specversion", "source", "id", "type")} | {"data": event.get_data()})
print(json.dumps(out))
"#;

/// How long a test waits for fanout's counts to reach Envoy's stats (handed over once a
/// second).
const STATS_WAIT: Duration = Duration::from_secs(10);

/// One HTTP message of an event, as the SDK made it.
#[derive(Debug, Clone)]
struct Message {
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

/// What an event is: its mode, version, source and id (type `com.example.reading`, a small
/// JSON payload).
fn spec(mode: &str, specversion: &str, source: &str, id: &str) -> Value {
    json!({
        "mode": mode,
        "specversion": specversion,
        "attributes": {
            "type": "com.example.reading", "source": source, "id": id,
            "datacontenttype": "application/json"
        },
        "data": { "reading": 21.5, "id": "not the event's" }
    })
}

/// The SDK's HTTP messages of these events, one Python run for all.
fn encode(specs: &[Value]) -> Vec<Message> {
    let out = run_sdk(ENCODE, &[], &serde_json::to_vec(specs).unwrap());
    let list: Vec<Value> = serde_json::from_str(&out).unwrap();
    list.iter()
        .map(|m| Message {
            headers: m["headers"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(n, v)| (n.clone(), v.as_str().unwrap().to_string()))
                .collect(),
            body: m["body"].as_str().unwrap().as_bytes().to_vec(),
        })
        .collect()
}

/// The events the SDK reads from what subscribers received.
fn decode(received: &[Recorded]) -> Vec<Value> {
    let messages: Vec<Value> = received
        .iter()
        .map(|r| {
            let headers: serde_json::Map<String, Value> = r
                .headers
                .iter()
                .map(|(name, value)| (name.clone(), json!(value)))
                .collect();
            json!({ "headers": headers, "body": String::from_utf8(r.body.clone()).unwrap() })
        })
        .collect();
    let out = run_sdk(DECODE, &[], &serde_json::to_vec(&messages).unwrap());
    serde_json::from_str(&out).unwrap()
}

/// The `id` and `specversion` of each event the SDK reads from what a subscriber received.
fn ids_and_versions(received: &[Recorded]) -> Vec<[String; 2]> {
    decode(received)
        .iter()
        .map(|e| ["id", "specversion"].map(|a| e[a].as_str().unwrap().to_string()))
        .collect()
}

fn post(client: &Client, envoy: &Envoy, message: &Message) -> Reply {
    let mut request = client.post(&envoy.url("/")).body(message.body.clone());
    for (name, value) in &message.headers {
        request = request.header(name, value);
    }
    let reply = send(request);
    reply.assert_not_tripwire();
    reply
}

fn envoy(config: Value, subscribers: &[&Subscriber]) -> Envoy {
    let mut config = config;
    config["subscribers"] = subscribers
        .iter()
        .map(|s| json!({ "cluster": s.name() }))
        .collect();
    Envoy::with_subscribers(&config, subscribers)
}

fn counts(subs: &[&Subscriber]) -> Vec<usize> {
    subs.iter().map(|s| s.count()).collect()
}

/// A message with one header left out, or with its value replaced.
fn without(message: &Message, name: &str) -> Message {
    let mut m = message.clone();
    m.headers.retain(|(n, _)| n != name);
    m
}

fn with_header(message: &Message, name: &str, value: &str) -> Message {
    let mut m = without(message, name);
    m.headers.push((name.to_string(), value.to_string()));
    m
}

/// A structured message whose JSON body `change` edits.
fn with_body(message: &Message, change: impl FnOnce(&mut Value)) -> Message {
    let mut doc: Value = serde_json::from_slice(&message.body).unwrap();
    change(&mut doc);
    Message {
        headers: message.headers.clone(),
        body: serde_json::to_vec(&doc).unwrap(),
    }
}

/// Unchanged by this issue, shown with the SDK: without any option an event reaches every
/// subscriber as it was sent, in both modes and both versions: every `ce-*` header, the
/// content type, the W3C trace context and the body byte for byte; 0.3 stays 0.3.
#[test]
fn a_cloudevent_reaches_subscribers_as_sent_in_both_modes_and_versions() {
    let (a, b) = (Subscriber::ok("a"), Subscriber::ok("b"));
    let subs = [&a, &b];
    let envoy = envoy(json!({}), &subs);
    let client = Client::http1();
    let events = encode(&[
        spec("binary", "1.0", "/s", "1"),
        spec("binary", "0.3", "/s", "2"),
        spec("structured", "1.0", "/s", "3"),
        spec("structured", "0.3", "/s", "4"),
    ]);
    let trace = [
        (
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ),
        ("tracestate", "congo=t61rcWkgMzE"),
    ];
    for event in &events {
        let mut event = event.clone();
        event
            .headers
            .extend(trace.iter().map(|(n, v)| (n.to_string(), v.to_string())));
        let reply = post(&client, &envoy, &event);
        assert_eq!(reply.status, 202, "{}", reply.text());
        assert!(reply.body.is_empty());
    }
    for sub in subs {
        let received = sub.requests();
        assert_eq!(received.len(), 4);
        for (sent, got) in events.iter().zip(&received) {
            assert_eq!(got.body, sent.body, "the body was changed");
            for (name, value) in &sent.headers {
                assert_eq!(got.header_all(name), [value.as_str()], "{name}: {got:#?}");
            }
            for (name, value) in trace {
                assert_eq!(got.header_all(name), [value], "{name}");
            }
        }
        assert_eq!(
            ids_and_versions(&received),
            [["1", "1.0"], ["2", "0.3"], ["3", "1.0"], ["4", "0.3"]]
        );
    }
}

#[test]
fn dedupe_names_an_event_by_its_source_and_id_in_binary_and_structured_mode() {
    let (a, b) = (Subscriber::ok("a"), Subscriber::ok("b"));
    let subs = [&a, &b];
    let envoy = envoy(json!({ "dedupe": {} }), &subs);
    let client = Client::http1();
    // Counters restart at "1" on every sensor: four different events share the id.
    let events = encode(&[
        spec("binary", "1.0", "/sensors/kitchen", "1"),
        spec("binary", "1.0", "/sensors/garage", "1"),
        spec("structured", "1.0", "/sensors/attic", "1"),
        spec("structured", "1.0", "/sensors/cellar", "1"),
        // The kitchen's event again, in structured mode: the same event.
        spec("structured", "1.0", "/sensors/kitchen", "1"),
        // A source the binding percent-encodes in binary mode, then the same in structured.
        spec("binary", "1.0", "/sensors/living room %1", "1"),
        spec("structured", "1.0", "/sensors/living room %1", "1"),
    ]);
    assert_eq!(
        events[5].headers.iter().find(|(n, _)| n == "ce-source"),
        Some(&(
            "ce-source".to_string(),
            "/sensors/living%20room%20%251".to_string()
        )),
        "the SDK percent-encodes the source in binary mode"
    );
    for (i, event) in events[..4].iter().enumerate() {
        let reply = post(&client, &envoy, event);
        assert_eq!(reply.status, 202, "event {i}: {}", reply.text());
        assert_eq!(
            reply.header("x-fanout-already-delivered"),
            None,
            "event {i}"
        );
    }
    assert_eq!(
        counts(&subs),
        [4, 4],
        "an event was taken for another's duplicate"
    );

    // Every copy, in either mode, reaches nobody.
    for (i, event) in events[..5].iter().enumerate() {
        let reply = post(&client, &envoy, event);
        assert_eq!(reply.status, 202, "copy {i}: {}", reply.text());
        assert_eq!(
            reply.header("x-fanout-already-delivered").as_deref(),
            Some("2"),
            "copy {i}"
        );
    }
    assert_eq!(counts(&subs), [4, 4]);
    assert_eq!(post(&client, &envoy, &events[5]).status, 202);
    let copy = post(&client, &envoy, &events[6]);
    assert_eq!(
        copy.header("x-fanout-already-delivered").as_deref(),
        Some("2")
    );
    assert_eq!(counts(&subs), [5, 5]);

    // What the subscribers got is each event, as the SDK reads it.
    let got = decode(&a.requests());
    let sources: Vec<&str> = got.iter().map(|e| e["source"].as_str().unwrap()).collect();
    assert_eq!(
        sources,
        [
            "/sensors/kitchen",
            "/sensors/garage",
            "/sensors/attic",
            "/sensors/cellar",
            "/sensors/living room %1"
        ]
    );
    assert!(got
        .iter()
        .all(|e| e["id"] == "1" && e["data"]["reading"] == 21.5));
    envoy.expect_stat("wasmcustom.fanout.dedupe.entries", |n| n == 5, STATS_WAIT);
    envoy.expect_stat(
        "wasmcustom.fanout.dedupe.missing_key",
        |n| n == 0,
        STATS_WAIT,
    );
}

#[test]
fn dedupe_a_structured_redelivery_reaches_only_the_subscriber_that_failed() {
    let ok = Subscriber::ok("ok");
    let flaky = Subscriber::start(
        "flaky",
        Behavior::Sequence(vec![Behavior::Status(503), Behavior::Status(200)]),
    );
    let subs = [&ok, &flaky];
    let envoy = envoy(json!({ "dedupe": {} }), &subs);
    let client = Client::http1();
    let events = encode(&[
        spec("structured", "1.0", "/orders", "A-1"),
        spec("structured", "1.0", "/refunds", "A-1"),
    ]);
    let first = post(&client, &envoy, &events[0]);
    assert_eq!(first.status, 500, "{}", first.text());
    assert_eq!(first.json()["failed"][0]["cluster"], "flaky");
    let retry = post(&client, &envoy, &events[0]);
    assert_eq!(retry.status, 202, "{}", retry.text());
    assert_eq!(retry.json()["already_delivered"], json!(["ok"]));
    assert_eq!(counts(&subs), [1, 2]);
    // The same id from another source goes to both.
    assert_eq!(post(&client, &envoy, &events[1]).status, 202);
    assert_eq!(counts(&subs), [2, 3]);
}

#[test]
fn dedupe_without_an_identity_fans_out_to_everyone_and_counts_it() {
    let a = Subscriber::ok("a");
    let envoy = envoy(json!({ "dedupe": {} }), &[&a]);
    let client = Client::http1();
    let event = &encode(&[spec("binary", "1.0", "/s", "1")])[0];
    // The id alone (no source), a plain JSON request, a structured body without a source.
    let structured = &encode(&[spec("structured", "1.0", "/s", "2")])[0];
    let no_source = with_body(structured, |doc| {
        doc.as_object_mut().unwrap().remove("source");
    });
    let plain = Message {
        headers: vec![("content-type".into(), "application/json".into())],
        body: b"{}".to_vec(),
    };
    for message in [without(event, "ce-source"), plain, no_source] {
        for _ in 0..2 {
            assert_eq!(post(&client, &envoy, &message).status, 202);
        }
    }
    assert_eq!(a.count(), 6);
    envoy.expect_stat(
        "wasmcustom.fanout.dedupe.missing_key",
        |n| n == 6,
        STATS_WAIT,
    );
}

#[test]
fn require_cloudevents_rejects_what_is_not_a_valid_cloudevent_with_400() {
    let (a, b) = (Subscriber::ok("a"), Subscriber::ok("b"));
    let subs = [&a, &b];
    let envoy = envoy(json!({ "require_cloudevents": true }), &subs);
    let client = Client::http1();
    let valid = encode(&[
        spec("binary", "1.0", "/s", "b-10"),
        spec("binary", "0.3", "/s", "b-03"),
        spec("structured", "1.0", "/s", "s-10"),
        spec("structured", "0.3", "/s", "s-03"),
    ]);
    for (i, event) in valid.iter().enumerate() {
        let reply = post(&client, &envoy, event);
        assert_eq!(reply.status, 202, "event {i}: {}", reply.text());
    }
    assert_eq!(counts(&subs), [4, 4]);
    // The subscribers got them as they were sent: the version kept, structured stays
    // structured.
    assert_eq!(
        ids_and_versions(&b.requests()),
        [
            ["b-10", "1.0"],
            ["b-03", "0.3"],
            ["s-10", "1.0"],
            ["s-03", "0.3"]
        ]
    );
    for (sent, received) in valid.iter().zip(b.requests()) {
        assert_eq!(received.body, sent.body, "the event was changed");
    }

    let (binary, structured) = (&valid[0], &valid[2]);
    let invalid: Vec<(Message, &str)> = vec![
        (
            Message {
                headers: vec![("content-type".into(), "application/json".into())],
                body: br#"{"order": 7}"#.to_vec(),
            },
            "not a CloudEvent",
        ),
        (without(binary, "ce-source"), "ce-source is missing"),
        (without(binary, "ce-type"), "ce-type is missing"),
        (with_header(binary, "ce-id", ""), "ce-id is empty"),
        (
            with_header(binary, "ce-specversion", "2.0"),
            "ce-specversion is \"2.0\", not one of 1.0, 0.3",
        ),
        (
            with_body(structured, |doc| {
                doc.as_object_mut().unwrap().remove("source");
            }),
            "member source is missing",
        ),
        (
            with_body(structured, |doc| doc["id"] = json!(7)),
            "member id is not a string",
        ),
        (
            with_body(structured, |doc| doc["specversion"] = json!("0.2")),
            "member specversion is \"0.2\", not one of 1.0, 0.3",
        ),
        (
            Message {
                headers: structured.headers.clone(),
                body: b"{\"specversion\": \"1.0\"".to_vec(),
            },
            "the body is not a structured CloudEvent",
        ),
        (
            Message {
                headers: vec![(
                    "content-type".into(),
                    "application/cloudevents-batch+json".into(),
                )],
                body: format!("[{}]", String::from_utf8_lossy(&structured.body)).into_bytes(),
            },
            "not one valid CloudEvent",
        ),
    ];
    for (message, want) in &invalid {
        let reply = post(&client, &envoy, message);
        assert_eq!(reply.status, 400, "{message:?}: {}", reply.text());
        let error = reply.json()["error"].as_str().unwrap().to_string();
        assert!(
            error.contains(want),
            "{message:?}\n  gave: {error}\n  want: {want}"
        );
    }
    assert_eq!(
        counts(&subs),
        [4, 4],
        "a subscriber got what is not a CloudEvent"
    );
    let rejected = invalid.len() as u64;
    envoy.expect_stat(
        "wasmcustom.fanout.requests.rejected.400",
        |n| n == rejected,
        STATS_WAIT,
    );
    envoy.expect_stat(
        "wasmcustom.fanout.requests.accepted",
        |n| n == 4,
        STATS_WAIT,
    );
}

#[test]
fn options_gets_200_with_allow_and_the_webhook_headers_and_reaches_nobody() {
    let a = Subscriber::ok("a");
    let envoy = envoy(json!({}), &[&a]);
    for client in [Client::http1(), Client::h2c()] {
        let reply = send(
            client
                .http
                .request(Method::OPTIONS, envoy.url("/"))
                .header("WebHook-Request-Origin", "eventemitter.example.com"),
        );
        reply.assert_not_tripwire();
        assert_eq!(reply.status, 200, "{:?}: {}", reply.version, reply.text());
        assert_eq!(reply.header("allow").as_deref(), Some("POST, OPTIONS"));
        assert_eq!(
            reply.header("webhook-allowed-origin").as_deref(),
            Some("eventemitter.example.com")
        );
        assert_eq!(reply.header("webhook-allowed-rate").as_deref(), Some("*"));
        assert!(reply.body.is_empty(), "{}", reply.text());

        // Without an origin: any origin.
        let reply = send(client.http.request(Method::OPTIONS, envoy.url("/")));
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("webhook-allowed-origin").as_deref(), Some("*"));

        // Other methods keep their 405, with the same allow.
        for method in [Method::GET, Method::PUT, Method::DELETE] {
            let reply = send(
                client
                    .http
                    .request(method.clone(), envoy.url("/"))
                    .body("{}"),
            );
            assert_eq!(reply.status, 405, "{method}: {}", reply.text());
            assert_eq!(
                reply.header("allow").as_deref(),
                Some("POST, OPTIONS"),
                "{method}"
            );
        }
    }
    assert_eq!(
        a.count(),
        0,
        "OPTIONS or another method reached a subscriber"
    );
    envoy.expect_stat("wasmcustom.fanout.requests.options", |n| n == 4, STATS_WAIT);
    envoy.expect_stat(
        "wasmcustom.fanout.requests.rejected.405",
        |n| n == 6,
        STATS_WAIT,
    );
}
