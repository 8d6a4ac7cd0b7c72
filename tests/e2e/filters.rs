//! End-to-end: subscription filters in the real Envoy running the built
//! `fanout.wasm`, with real subscribers on loopback. Run with `make test-e2e`, or
//! `cargo test --test e2e filters::` with ENVOY_BIN and FANOUT_WASM set (or their defaults
//! present).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness;

use std::collections::BTreeMap;
use std::time::Duration;

use harness::{assert_status, send, Client, Envoy, Reply, Subscriber};
use serde_json::{json, Value};

/// Two subscribers that want different event types.
fn by_type() -> Value {
    json!({ "channels": [{ "name": "default/orders", "hosts": ["*"], "subscribers": [
        { "cluster": "created", "path": "/created",
          "filters": [{ "exact": { "type": "com.example.order.created" } }] },
        { "cluster": "shipped", "path": "/shipped",
          "filter": { "attributes": { "type": "com.example.order.shipped", "source": "" } } }
    ] }] })
}

fn binary_event(envoy: &Envoy, event_type: &str, body: &str) -> Reply {
    send(
        Client::http1()
            .post(&envoy.url("/"))
            .header("content-type", "application/json")
            .header("ce-specversion", "1.0")
            .header("ce-type", event_type)
            .header("ce-source", "%2Forders%2Feu")
            .header("ce-id", "1")
            .body(body.to_string()),
    )
}

fn structured_event(envoy: &Envoy, body: &str) -> Reply {
    send(
        Client::http1()
            .post(&envoy.url("/"))
            .header(
                "content-type",
                "application/cloudevents+json; charset=utf-8",
            )
            .body(body.to_string()),
    )
}

#[test]
fn binary_mode_each_subscriber_gets_only_the_type_it_filters_on() {
    let created = Subscriber::ok("created");
    let shipped = Subscriber::ok("shipped");
    let envoy = Envoy::with_subscribers(&by_type(), &[&created, &shipped]);

    assert_status(
        &binary_event(&envoy, "com.example.order.created", r#"{"n": 1}"#),
        202,
    );
    assert_status(
        &binary_event(&envoy, "com.example.order.shipped", r#"{"n": 2}"#),
        202,
    );
    // Neither wants it: both skipped, still 202.
    assert_status(
        &binary_event(&envoy, "com.example.order.refunded", r#"{"n": 3}"#),
        202,
    );
    // Percent-encoded in the header, decoded before matching.
    assert_status(
        &binary_event(&envoy, "com.example.order%2Ecreated", r#"{"n": 4}"#),
        202,
    );

    let got = created.requests();
    assert_eq!(got.len(), 2, "{got:#?}");
    assert_eq!(got[0].path, "/created");
    assert_eq!(got[0].body, br#"{"n": 1}"#);
    assert_eq!(got[0].header("ce-type"), Some("com.example.order.created"));
    // Forwarded as received: filtering does not rewrite headers.
    assert_eq!(got[0].header("ce-source"), Some("%2Forders%2Feu"));
    assert_eq!(got[1].body, br#"{"n": 4}"#);
    let got = shipped.only_request();
    assert_eq!(got.path, "/shipped");
    assert_eq!(got.body, br#"{"n": 2}"#);
}

#[test]
fn structured_mode_each_subscriber_gets_only_the_type_it_filters_on() {
    let created = Subscriber::ok("created");
    let shipped = Subscriber::ok("shipped");
    let envoy = Envoy::with_subscribers(&by_type(), &[&created, &shipped]);

    // `data` has a `type` of its own: only the top-level member counts.
    let created_event = r#"{"specversion": "1.0", "type": "com.example.order.created",
        "source": "/orders/eu", "id": "1", "subject": "Bestellung für Zoë ✓",
        "data": {"type": "com.example.order.shipped", "items": [{"sku": "A-1", "qty": 2}]}}"#;
    let shipped_event = r#"{"specversion": "1.0", "type": "com.example.order.shipped",
        "source": "/orders/eu", "id": "2", "data": {"type": "com.example.order.created"}}"#;
    let refunded_event = r#"{"specversion": "1.0", "type": "com.example.order.refunded",
        "source": "/orders/eu", "id": "3", "data": null}"#;
    assert_status(&structured_event(&envoy, created_event), 202);
    assert_status(&structured_event(&envoy, shipped_event), 202);
    assert_status(&structured_event(&envoy, refunded_event), 202);

    let got = created.only_request();
    assert_eq!(got.body, created_event.as_bytes(), "the body byte for byte");
    assert_eq!(
        got.header("content-type"),
        Some("application/cloudevents+json; charset=utf-8")
    );
    assert_eq!(shipped.only_request().body, shipped_event.as_bytes());
}

#[test]
fn a_malformed_structured_body_is_400_when_a_filter_needs_it_and_passes_otherwise() {
    let created = Subscriber::ok("created");
    let shipped = Subscriber::ok("shipped");
    let plain = Subscriber::ok("plain");
    let config = json!({ "channels": [
        { "name": "filtered", "hosts": ["filtered.local"], "subscribers": [
            { "cluster": "created", "filters": [{ "exact": { "type": "com.example.order.created" } }] },
            { "cluster": "shipped", "filters": [{ "exact": { "type": "com.example.order.shipped" } }] }
        ] },
        { "name": "plain", "hosts": ["*"], "subscribers": [{ "cluster": "plain" }] }
    ] });
    let envoy = Envoy::with_subscribers(&config, &[&created, &shipped, &plain]);
    let filtered = Client::http1_resolving("filtered.local", envoy.addr());
    let url = format!("http://filtered.local:{}/", envoy.port());
    let malformed = r#"{"type": "com.example.order.created", "data": {"#;

    let reply = send(
        filtered
            .post(&url)
            .header("content-type", "application/cloudevents+json")
            .body(malformed),
    );
    assert_status(&reply, 400);
    let error = reply.json()["error"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(error.contains("not a structured CloudEvent"), "{error}");

    // A batch cannot be filtered per subscriber.
    let reply = send(
        filtered
            .post(&url)
            .header("content-type", "application/cloudevents-batch+json")
            .body("[]"),
    );
    assert_status(&reply, 415);
    assert_eq!(created.count() + shipped.count(), 0, "nobody is called");

    // A channel without filters never parses the body: it goes out as it came.
    let reply = send(
        Client::http1()
            .post(&envoy.url("/"))
            .header("content-type", "application/cloudevents+json")
            .body(malformed),
    );
    assert_status(&reply, 202);
    assert_eq!(plain.only_request().body, malformed.as_bytes());
}

#[test]
fn the_500_report_and_the_metrics_tell_skipped_from_failed() {
    let created = Subscriber::start("created", harness::Behavior::Status(503));
    let shipped = Subscriber::ok("shipped");
    let envoy = Envoy::with_subscribers(&by_type(), &[&created, &shipped]);

    let reply = binary_event(&envoy, "com.example.order.created", "{}");
    assert_status(&reply, 500);
    let report = reply.json();
    assert_eq!(report["subscribers"], 2, "{report:#}");
    assert_eq!(report["delivered"], 0, "{report:#}");
    assert_eq!(report["failed"][0]["cluster"], "created", "{report:#}");
    assert_eq!(report["skipped"], json!(["shipped"]), "{report:#}");
    assert_eq!(shipped.count(), 0);

    // Counted per worker and flushed to Envoy's stats on the root context's tick.
    let counted = |stats: &BTreeMap<String, u64>| {
        stats.get("wasmcustom.fanout.subscriber.shipped.skipped") == Some(&1)
            && stats.get("wasmcustom.fanout.subscriber.created.failed.status_5xx") == Some(&1)
    };
    let stats = envoy.wait_for_stats(
        "wasmcustom.fanout.subscriber.",
        counted,
        Duration::from_secs(10),
    );
    assert!(counted(&stats), "stats never showed it:\n{stats:#?}");
    assert_eq!(
        stats.get("wasmcustom.fanout.subscriber.shipped.calls"),
        Some(&0)
    );
}

#[test]
fn async_mode_delivers_only_to_matching_subscribers_after_the_202() {
    let created = Subscriber::ok("created");
    let shipped = Subscriber::ok("shipped");
    let mut config = by_type();
    config["mode"] = json!("async");
    let envoy = Envoy::with_subscribers(&config, &[&created, &shipped]);

    assert_status(
        &binary_event(&envoy, "com.example.order.refunded", "{}"),
        202,
    );
    assert_status(
        &binary_event(&envoy, "com.example.order.created", r#"{"n": 1}"#),
        202,
    );
    assert_eq!(created.wait_for(1, Duration::from_secs(10)), 1);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(created.only_request().body, br#"{"n": 1}"#);
    assert_eq!(shipped.count(), 0, "{:#?}", shipped.requests());
}
