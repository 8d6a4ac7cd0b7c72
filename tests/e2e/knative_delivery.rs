//! Knative's data-plane contract on the delivery side, in the real Envoy, with the
//! CloudEvents Python SDK as the sender and as the dead-letter consumer: replies asked for with
//! `Prefer: reply`; a `202`, or a 2xx body that is not a CloudEvent, is no reply; a reply
//! larger than `max_body_bytes` is a failed reply, never a truncated one; a reply that failed
//! for good sends the original event to the dead-letter target; dead letters carry Knative's
//! error attributes (`knativeerrordest`, `knativeerrorcode`, `knativeerrordata`) in binary
//! and structured mode; `Retry-After` (seconds or an HTTP date) on 429 and 503 lengthens the
//! backoff, never shortens it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness;

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

use harness::sdk::{b64, post_message, sdk_message, sdk_read};
use harness::timing::{assert_waited_about, assert_waited_at_least, poll_until};
use harness::{read_shipped_yaml, send, Behavior, Client, Envoy, Recorded, Subscriber};
use serde_json::{json, Value};

/// The headers of a valid binary-mode reply event: its required attributes.
const REPLY: &[(&str, &str)] = &[
    ("ce-specversion", "1.0"),
    ("ce-id", "r-1"),
    ("ce-source", "/answering"),
    ("ce-type", "com.example.reply"),
];

/// Asserts no more than `n` requests arrive at `sub` within `wait`. (A fixed wait: it looks for
/// something that must not happen; a loaded machine can only make it miss, never fail.)
fn stays_at(sub: &Subscriber, n: usize, wait: Duration) {
    std::thread::sleep(wait);
    assert_eq!(sub.count(), n, "{}: {:#?}", sub.name(), sub.requests());
}

/// A CloudEvent made by the SDK, as it would send it: `binary` or `structured` mode.
fn sdk_event(mode: &str, id: &str) -> (Vec<(String, String)>, Vec<u8>) {
    const MAKE: &str = r#"
import base64, json, sys
from cloudevents.core.bindings import http
from cloudevents.core.v1.event import CloudEvent
mode, id = sys.argv[1], sys.argv[2]
event = CloudEvent(
    attributes={"type": "com.example.order.created", "source": "/orders", "id": id,
                "datacontenttype": "application/json"},
    data={"order": 7, "note": "caf\u00e9"},
)
message = http.to_binary_event(event) if mode == "binary" else http.to_structured_event(event)
print(json.dumps({"headers": message.headers, "body": base64.b64encode(message.body).decode()}))
"#;
    sdk_message(MAKE, &[mode, id])
}

/// The dead letter as a CloudEvents SDK consumer reads it, with both of the SDK's APIs (the 2.x
/// `cloudevents.core` binding and the 1.x-compatible `cloudevents.v1.http`): each event's
/// attributes, its data, and `knativeerrordata` decoded. The two must agree.
fn sdk_reads(letter: &Recorded) -> Value {
    const READ: &str = r#"
import base64, json, sys
from cloudevents.core.bindings.http import HTTPMessage, from_http
from cloudevents.core.formats.json import JSONFormat
from cloudevents.v1.http import from_http as v1_from_http
letter = json.load(sys.stdin)
headers, body = letter["headers"], base64.b64decode(letter["body"])
def plain(value):
    return value.isoformat() if hasattr(value, "isoformat") else value
core = from_http(HTTPMessage(headers=headers, body=body), JSONFormat())
attributes = {k: plain(v) for k, v in core.get_attributes().items()}
v1 = v1_from_http(headers, body)
v1_attributes = {k: plain(v) for k, v in v1.get_attributes().items()}
data = attributes.get("knativeerrordata")
print(json.dumps({
    "attributes": attributes,
    "data": core.get_data(),
    "v1_attributes": v1_attributes,
    "v1_data": v1.get_data(),
    "error_data": None if data is None else base64.b64decode(data).decode("latin-1"),
}))
"#;
    let out = sdk_read(READ, letter);
    let (core, v1) = (&out["attributes"], &out["v1_attributes"]);
    for name in [
        "id",
        "source",
        "type",
        "knativeerrordest",
        "knativeerrordata",
    ] {
        assert_eq!(
            core[name], v1[name],
            "the SDK's two APIs differ on {name}: {out}"
        );
    }
    // The code is an Integer attribute: a JSON number in structured mode, a header's text
    // in binary mode; both APIs read it the same way.
    assert_eq!(
        core["knativeerrorcode"].to_string().trim_matches('"'),
        v1["knativeerrorcode"].to_string().trim_matches('"'),
        "{out}"
    );
    out
}

fn error_code(read: &Value) -> String {
    read["attributes"]["knativeerrorcode"]
        .to_string()
        .trim_matches('"')
        .to_string()
}

#[test]
fn replies_are_asked_for_with_prefer_reply_only_where_they_are_passed_on() {
    let answering = Subscriber::ok("answering");
    let plain = Subscriber::ok("plain");
    let replies = Subscriber::ok("replies");
    let config = json!({
        "subscribers": [
            { "cluster": "answering", "reply": { "cluster": "replies" } },
            { "cluster": "plain" }
        ]
    });
    let envoy = Envoy::with_subscribers(&config, &[&answering, &plain, &replies]);
    let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
    assert_eq!(reply.status, 202, "{}", reply.text());
    assert_eq!(answering.only_request().header_all("prefer"), ["reply"]);
    assert_eq!(plain.only_request().header("prefer"), None);
}

#[test]
fn a_202_is_never_processed_as_a_reply_even_when_it_looks_like_an_event() {
    let accepting = Subscriber::start(
        "accepting",
        Behavior::respond(
            202,
            &[
                ("ce-type", "com.example.reply"),
                ("ce-id", "r-1"),
                ("ce-source", "/s"),
                ("ce-specversion", "1.0"),
            ],
            "{\"would\":\"be a reply\"}",
        ),
    );
    let replies = Subscriber::ok("replies");
    let config = json!({
        "subscribers": [{ "cluster": "accepting", "reply": { "cluster": "replies" } }]
    });
    let envoy = Envoy::with_subscribers(&config, &[&accepting, &replies]);
    let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
    assert_eq!(reply.status, 202, "{}", reply.text());
    stays_at(&replies, 0, Duration::from_millis(300));
}

#[test]
fn a_2xx_body_that_is_not_a_cloudevent_is_discarded_counted_and_the_delivery_done() {
    let chatty = Subscriber::start(
        "chatty",
        Behavior::respond(
            200,
            &[("content-type", "application/json")],
            "{\"ok\":true}",
        ),
    );
    let replies = Subscriber::ok("replies");
    let config = json!({
        "subscribers": [{ "cluster": "chatty", "reply": { "cluster": "replies" } }]
    });
    let envoy = Envoy::with_subscribers(&config, &[&chatty, &replies]);
    for _ in 0..2 {
        let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
        assert_eq!(reply.status, 202, "{}", reply.text());
    }
    envoy.expect_stat(
        "wasmcustom.fanout.subscriber.chatty.reply_discarded",
        |n| n == 2,
        Duration::from_secs(10),
    );
    stays_at(&replies, 0, Duration::from_millis(200));
    // A structured event as the answer is a reply.
    chatty.set_behavior(Behavior::respond(
        200,
        &[("content-type", "application/cloudevents+json")],
        r#"{"specversion":"1.0","id":"r","source":"/s","type":"t"}"#,
    ));
    let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
    assert_eq!(reply.status, 202, "{}", reply.text());
    let forwarded = replies.only_request();
    assert_eq!(
        forwarded.body,
        br#"{"specversion":"1.0","id":"r","source":"/s","type":"t"}"#
    );
    assert_eq!(
        forwarded.header("content-type"),
        Some("application/cloudevents+json")
    );
}

#[test]
fn only_a_valid_cloudevent_is_a_reply_and_it_carries_knatives_pass_through_headers() {
    // Knative's SDK reads an answer as an event only with ce-specversion (binary) or a
    // CloudEvents content type (structured): the rest is discarded and counted.
    let answering = Subscriber::start("answering", Behavior::respond(200, &[("ce-abc", "x")], ""));
    let replies = Subscriber::ok("replies");
    let config = json!({
        "subscribers": [{ "cluster": "answering", "reply": { "cluster": "replies" } }]
    });
    let envoy = Envoy::with_subscribers(&config, &[&answering, &replies]);
    let not_events: [&[(&str, &str)]; 3] = [
        &[("ce-abc", "x")],
        &[("ce-id", "1"), ("ce-source", "/a"), ("ce-type", "t")],
        &[("content-type", "application/cloudevents-batch+json")],
    ];
    for (i, headers) in not_events.into_iter().enumerate() {
        answering.set_behavior(Behavior::respond(
            200,
            headers,
            if i == 2 { "[]" } else { "" },
        ));
        let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
        assert_eq!(reply.status, 202, "{}", reply.text());
    }
    envoy.expect_stat(
        "wasmcustom.fanout.subscriber.answering.reply_discarded",
        |n| n == 3,
        Duration::from_secs(10),
    );
    stays_at(&replies, 0, Duration::from_millis(200));

    // A valid binary event goes on with its event headers and Knative's pass-through ones.
    let mut headers = REPLY.to_vec();
    headers.extend([
        ("x-request-id", "answer-7"),
        ("knative-hop", "1"),
        ("x-b3-traceid", "80f198ee56343ba864fe8b2a57d3eff7"),
        ("retry-after", "5"),
        ("set-cookie", "secret=1"),
    ]);
    answering.set_behavior(Behavior::respond(200, &headers, "{\"answer\":1}"));
    let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
    assert_eq!(reply.status, 202, "{}", reply.text());
    let forwarded = replies.only_request();
    for (name, value) in REPLY.iter().chain(&headers[4..7]) {
        assert_eq!(forwarded.header(name), Some(*value), "{name}");
    }
    assert_eq!(forwarded.header("retry-after"), None);
    assert_eq!(forwarded.header("set-cookie"), None);
}

#[test]
fn a_reply_larger_than_max_body_bytes_fails_too_large_and_is_never_forwarded_cut_short() {
    let big = "x".repeat(5000);
    let answering = Subscriber::start("answering", Behavior::respond(200, REPLY, &big));
    let replies = Subscriber::ok("replies");
    let config = json!({
        "max_body_bytes": 4096,
        "subscribers": [{ "cluster": "answering", "reply": { "cluster": "replies" } }]
    });
    // The shipped stats_config, so the labels checked are the ones users get.
    let envoy = Envoy::builder()
        .fanout(&config)
        .subscribers(&[&answering, &replies])
        .bootstrap_field(
            "stats_config",
            read_shipped_yaml("envoy/envoy.yaml")["stats_config"].clone(),
        )
        .start();
    let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
    assert_eq!(reply.status, 500, "{}", reply.text());
    assert_eq!(reply.header("x-fanout-failed").as_deref(), Some("1"));
    let failed = &reply.json()["failed"][0];
    assert_eq!(failed["cluster"], "answering");
    assert_eq!(failed["leg"], "reply");
    assert_eq!(failed["outcome"], "too_large");
    assert_eq!(
        failed["detail"],
        "the reply of 5000 bytes is larger than max_body_bytes (4096): not passed on"
    );
    stays_at(&replies, 0, Duration::from_millis(300));
    // Counted by outcome, under the subscriber, with the shipped Prometheus labels.
    let want =
        "fanout_subscriber_reply_failed{fanout_cluster=\"answering\",fanout_reason=\"too_large\"}";
    let mut last = BTreeMap::new();
    let found = poll_until(Duration::from_secs(10), Duration::from_millis(100), || {
        last = envoy.prometheus("fanout_subscriber_reply");
        (last.get(want) == Some(&1.0)).then_some(())
    });
    assert!(found.is_some(), "no `{want} 1` in {last:#?}");
    // At the limit, a reply is passed on whole.
    answering.set_behavior(Behavior::respond(200, REPLY, &"y".repeat(4096)));
    let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
    assert_eq!(reply.status, 202, "{}", reply.text());
    assert_eq!(replies.only_request().body, "y".repeat(4096).as_bytes());
}

#[test]
fn a_reply_that_failed_for_good_sends_the_original_event_to_the_dead_letter_target() {
    let answering = Subscriber::start(
        "answering",
        Behavior::respond(
            200,
            &[
                ("ce-type", "com.example.reply"),
                ("ce-id", "r-1"),
                ("ce-source", "/a"),
                ("ce-specversion", "1.0"),
            ],
            "{\"answer\":42}",
        ),
    );
    let replies = Subscriber::start("replies", Behavior::respond(503, &[], "replies are down"));
    let dlq = Subscriber::ok("dlq");
    let config = json!({
        "forward_headers": ["content-type", "ce-*"],
        "delivery": { "retry": 1, "backoff_delay_ms": 20,
                      "dead_letter": { "cluster": "dlq", "path": "/dead" } },
        "subscribers": [{ "cluster": "answering",
                          "reply": { "cluster": "replies", "authority": "replies.local",
                                     "path": "/in" } }]
    });
    let envoy = Envoy::with_subscribers(&config, &[&answering, &replies, &dlq]);
    let (headers, body) = sdk_event("binary", "order-1");
    let reply = post_message(&envoy, &headers, &body);
    assert_eq!(reply.status, 202, "{}", reply.text());
    assert_eq!(reply.header("x-fanout-dead-lettered").as_deref(), Some("1"));
    assert_eq!(answering.count(), 1, "the subscriber took the event once");
    assert_eq!(replies.count(), 2, "the reply is retried like the event");
    let letter = dlq.only_request();
    assert_eq!(letter.body, body, "the original event, not the reply");
    assert_eq!(letter.header("x-fanout-failed-cluster"), Some("answering"));
    assert_eq!(letter.header("x-fanout-failed-leg"), Some("reply"));
    assert_eq!(letter.header("x-fanout-failed-status"), Some("503"));
    let read = sdk_reads(&letter);
    assert_eq!(read["attributes"]["id"], "order-1");
    assert_eq!(read["attributes"]["type"], "com.example.order.created");
    assert_eq!(
        read["attributes"]["knativeerrordest"],
        "http://replies.local/in"
    );
    assert_eq!(error_code(&read), "503");
    assert_eq!(read["error_data"], "replies are down");

    // A reply too large to pass on goes there too, with the code 413.
    answering.set_behavior(Behavior::respond(200, REPLY, &"z".repeat(2_000_000)));
    let reply = post_message(&envoy, &headers, &body);
    assert_eq!(reply.status, 202, "{}", reply.text());
    assert_eq!(dlq.wait_for(2, Duration::from_secs(10)), 2);
    let letter = dlq.requests().pop().unwrap();
    assert_eq!(letter.header("x-fanout-failed-outcome"), Some("too_large"));
    let read = sdk_reads(&letter);
    assert_eq!(error_code(&read), "413");
    assert!(
        read["error_data"]
            .as_str()
            .unwrap()
            .starts_with("the reply of 2000000 bytes is larger than max_body_bytes"),
        "{read}"
    );
    assert_eq!(replies.count(), 2, "a reply too large was forwarded");
}

#[test]
fn a_binary_dead_letter_carries_knatives_error_attributes_as_ce_headers() {
    let body_text = format!("{}{}", "database unavailable; ", "e".repeat(2000));
    let down = Subscriber::start("down", Behavior::respond(503, &[], &body_text));
    let dlq = Subscriber::ok("dlq");
    let config = json!({
        "forward_headers": ["content-type", "ce-*"],
        "delivery": { "dead_letter": { "cluster": "dlq" } },
        "subscribers": [{ "cluster": "down", "authority": "down.default.svc", "path": "/events" }]
    });
    let envoy = Envoy::with_subscribers(&config, &[&down, &dlq]);
    let (headers, body) = sdk_event("binary", "order-2");
    let reply = post_message(&envoy, &headers, &body);
    assert_eq!(reply.status, 202, "{}", reply.text());
    let letter = dlq.only_request();
    assert_eq!(letter.body, body, "the event's body, byte for byte");
    for (name, value) in &headers {
        assert_eq!(letter.header(name), Some(value.as_str()), "{name}");
    }
    // fanout's own headers stay.
    assert_eq!(letter.header("x-fanout-failed-cluster"), Some("down"));
    assert_eq!(letter.header("x-fanout-failed-leg"), Some("event"));
    assert_eq!(letter.header("x-fanout-failed-outcome"), Some("status"));
    assert_eq!(letter.header("x-fanout-failed-status"), Some("503"));
    assert_eq!(letter.header("x-fanout-failed-attempts"), Some("1"));
    let read = sdk_reads(&letter);
    assert_eq!(read["attributes"]["id"], "order-2");
    assert_eq!(read["attributes"]["source"], "/orders");
    assert_eq!(read["data"], json!({"order": 7, "note": "caf\u{e9}"}));
    assert_eq!(
        read["attributes"]["knativeerrordest"],
        "http://down.default.svc/events"
    );
    assert_eq!(error_code(&read), "503");
    assert_eq!(
        read["error_data"].as_str().unwrap(),
        &body_text[..1024],
        "at most 1024 bytes of the answer, before base64"
    );
}

#[test]
fn a_structured_dead_letter_carries_them_as_members_of_the_event_and_keeps_the_rest() {
    let down = Subscriber::start("down", Behavior::respond(400, &[], "bad order"));
    let dlq = Subscriber::ok("dlq");
    let config = json!({
        "forward_headers": ["content-type", "ce-*"],
        "delivery": { "dead_letter": { "cluster": "dlq" } },
        "subscribers": [{ "cluster": "down", "path": "/events" }]
    });
    let envoy = Envoy::with_subscribers(&config, &[&down, &dlq]);
    let (headers, body) = sdk_event("structured", "order-3");
    assert_eq!(
        headers,
        [(
            "content-type".to_string(),
            "application/cloudevents+json".to_string()
        )]
    );
    let reply = post_message(&envoy, &headers, &body);
    assert_eq!(reply.status, 202, "{}", reply.text());
    let letter = dlq.only_request();
    assert!(
        !letter.headers.iter().any(|(n, _)| n.starts_with("ce-")),
        "{:?}",
        letter.headers
    );
    // The event's bytes up to its closing brace, then the three members.
    let close = body.iter().rposition(|&b| b == b'}').unwrap();
    assert_eq!(&letter.body[..close], &body[..close]);
    let added = String::from_utf8(letter.body[close..].to_vec()).unwrap();
    assert_eq!(
        added,
        format!(
            ",\"knativeerrordest\":\"http://down/events\",\"knativeerrorcode\":400,\
             \"knativeerrordata\":\"{}\"{}",
            b64(b"bad order"),
            String::from_utf8(body[close..].to_vec()).unwrap()
        )
    );
    assert_eq!(letter.header("x-fanout-failed-status"), Some("400"));
    let read = sdk_reads(&letter);
    assert_eq!(read["attributes"]["id"], "order-3");
    assert_eq!(read["data"], json!({"order": 7, "note": "caf\u{e9}"}));
    assert_eq!(read["attributes"]["knativeerrordest"], "http://down/events");
    assert_eq!(read["attributes"]["knativeerrorcode"], 400);
    assert_eq!(read["error_data"], "bad order");

    // A structured body that is not one JSON object has nothing to put them in: it goes as it
    // came, with fanout's headers only.
    let reply = post_message(&envoy, &headers, b"[1, 2]");
    assert_eq!(reply.status, 202, "{}", reply.text());
    assert_eq!(dlq.wait_for(2, Duration::from_secs(10)), 2);
    let letter = dlq.requests().pop().unwrap();
    assert_eq!(letter.body, b"[1, 2]");
    assert!(!letter.headers.iter().any(|(n, _)| n.starts_with("ce-")));
    assert_eq!(letter.header("x-fanout-failed-status"), Some("400"));
}

#[test]
fn a_timeout_dead_letter_says_500_and_why_as_knative_does_for_a_call_without_an_answer() {
    let slow = Subscriber::start("slow", Behavior::Delay(Duration::from_millis(1500), 200));
    let dlq = Subscriber::ok("dlq");
    let config = json!({
        "forward_headers": ["content-type", "ce-*"],
        "delivery": { "dead_letter": { "cluster": "dlq" } },
        "subscribers": [{ "cluster": "slow", "timeout_ms": 300 }]
    });
    let envoy = Envoy::with_subscribers(&config, &[&slow, &dlq]);
    let (headers, body) = sdk_event("binary", "order-4");
    let reply = post_message(&envoy, &headers, &body);
    assert_eq!(reply.status, 202, "{}", reply.text());
    let letter = dlq.only_request();
    assert_eq!(letter.header("x-fanout-failed-outcome"), Some("timeout"));
    let read = sdk_reads(&letter);
    assert_eq!(read["attributes"]["knativeerrordest"], "http://slow/");
    assert_eq!(error_code(&read), "500");
    assert_eq!(read["error_data"], "no answer within the timeout of 300 ms");
}

/// The gap between the first two attempts a subscriber received.
fn first_gap(sub: &Subscriber) -> Duration {
    assert_eq!(
        sub.wait_for(2, Duration::from_secs(15)),
        2,
        "{:#?}",
        sub.requests()
    );
    let attempts = sub.requests();
    attempts[1].at - attempts[0].at
}

#[test]
fn retry_after_zero_never_shortens_the_backoff() {
    let busy = Subscriber::start(
        "busy",
        Behavior::Sequence(vec![
            Behavior::respond(503, &[("retry-after", "0")], ""),
            Behavior::Status(200),
        ]),
    );
    let config = json!({
        "delivery": { "retry": 2, "backoff_policy": "linear", "backoff_delay_ms": 600 },
        "subscribers": [{ "cluster": "busy" }]
    });
    let envoy = Envoy::with_subscribers(&config, &[&busy]);
    let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
    assert_eq!(reply.status, 202, "{}", reply.text());
    let gap = first_gap(&busy);
    assert_waited_at_least(
        gap,
        Duration::from_millis(600),
        "the backoff after retry-after: 0",
    );
}

#[test]
fn retry_after_in_seconds_on_429_lengthens_the_wait_and_on_500_is_ignored() {
    let throttled = Subscriber::start(
        "throttled",
        Behavior::Sequence(vec![
            Behavior::respond(429, &[("retry-after", "2")], ""),
            Behavior::Status(200),
        ]),
    );
    let failing = Subscriber::start(
        "failing",
        Behavior::Sequence(vec![
            Behavior::respond(500, &[("retry-after", "5")], ""),
            Behavior::Status(200),
        ]),
    );
    let config = json!({
        "delivery": { "retry": 2, "backoff_policy": "linear", "backoff_delay_ms": 50,
                      "backoff_max_ms": 10000 },
        "subscribers": [{ "cluster": "throttled" }, { "cluster": "failing" }]
    });
    let envoy = Envoy::with_subscribers(&config, &[&throttled, &failing]);
    let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
    assert_eq!(reply.status, 202, "{}", reply.text());
    let gap = first_gap(&throttled);
    assert_waited_about(gap, Duration::from_secs(2), "a 429's retry-after: 2");
    // The backoff alone, far from the 5 s the ignored retry-after asks for.
    let gap = first_gap(&failing);
    assert_waited_about(gap, Duration::from_millis(50), "a 500's backoff");
}

#[test]
fn retry_after_as_an_http_date_on_503_is_honoured() {
    let busy = Subscriber::ok("busy");
    let config = json!({
        "delivery": { "retry": 1, "backoff_delay_ms": 10, "backoff_max_ms": 10000 },
        "subscribers": [{ "cluster": "busy" }]
    });
    let envoy = Envoy::with_subscribers(&config, &[&busy]);
    // Three seconds from now, to the second (an HTTP date has no finer unit).
    let (wall, mono) = (SystemTime::now(), Instant::now());
    let date = httpdate::fmt_http_date(wall + Duration::from_secs(3));
    let at = httpdate::parse_http_date(&date).unwrap();
    busy.set_behavior(Behavior::Sequence(vec![
        Behavior::respond(503, &[("retry-after", &date)], ""),
        Behavior::Status(200),
    ]));
    let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
    assert_eq!(reply.status, 202, "{}", reply.text());
    let gap = first_gap(&busy);
    // Envoy reads the date against its wall clock (this machine's) when the 503 comes back:
    // the retry is due at the date, whenever the first attempt arrived.
    let first = wall + (busy.requests()[0].at - mono);
    let nominal = at.duration_since(first).unwrap();
    assert!(
        nominal > Duration::from_secs(1),
        "the first attempt came late: {nominal:?}"
    );
    assert_waited_about(gap, nominal, &format!("a 503's retry-after: {date}"));
}
