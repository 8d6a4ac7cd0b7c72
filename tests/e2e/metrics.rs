//! Observability in the real Envoy: after a known sequence of requests, fanout's counters in
//! `/stats/prometheus` (with the Prometheus labels of the shipped `stats_config`) are exactly
//! what happened, the histograms have one sample per fan-out and per call, and Envoy's log
//! has a line for the failing subscriber.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use harness::{read_shipped_yaml, send, Behavior, Client, Envoy, Subscriber};
use serde_json::{json, Value};

/// The `stats_config` of the shipped demo configuration, so the labels tested are the ones
/// users get.
fn shipped_stats_config() -> Value {
    let stats = read_shipped_yaml("envoy/envoy.yaml")["stats_config"].clone();
    assert!(
        stats["stats_tags"].is_array(),
        "envoy/envoy.yaml has no stats_tags"
    );
    stats
}

#[test]
fn prometheus_counts_equal_what_happened() {
    let steady = Subscriber::ok("steady");
    let flaky = Subscriber::ok("flaky");
    let config = json!({
        "max_body_bytes": 1000,
        "channels": [{ "name": "default/orders", "hosts": ["orders.default"], "subscribers": [
            { "cluster": "steady" }, { "cluster": "flaky" }
        ] }]
    });
    let envoy = Envoy::builder()
        .fanout(&config)
        .cluster("steady", steady.port())
        .cluster("flaky", flaky.port())
        .bootstrap_field("stats_config", shipped_stats_config())
        // Histograms reach /stats/prometheus at Envoy's stats flush (5 s by default).
        .bootstrap_field("stats_flush_interval", json!("0.2s"))
        .start();
    let orders = Client::http1_resolving("orders.default", envoy.addr());
    let url = format!("http://orders.default:{}/", envoy.port());

    for _ in 0..3 {
        assert_eq!(send(orders.post(&url).body("{}")).status, 202);
    }
    flaky.set_behavior(Behavior::Status(503));
    let failed = send(orders.post(&url).body("{}"));
    assert_eq!(failed.status, 500);
    let report = failed.json();
    assert_eq!(report["failed"][0]["cluster"], "flaky");
    assert_eq!(report["failed"][0]["outcome"], "status");
    assert_eq!(report["failed"][0]["status"], 503);
    // A host with no channel, and a body over max_body_bytes.
    assert_eq!(
        send(Client::http1().post(&envoy.url("/")).body("{}")).status,
        404
    );
    assert_eq!(send(orders.post(&url).body(vec![b'x'; 2000])).status, 413);

    let expected: BTreeMap<&str, f64> = [
        ("fanout_requests_received{}", 6.0),
        ("fanout_requests_accepted{}", 3.0),
        ("fanout_requests_failed{}", 1.0),
        ("fanout_requests_rejected{fanout_status=\"404\"}", 1.0),
        ("fanout_requests_rejected{fanout_status=\"413\"}", 1.0),
        ("fanout_requests_reached_router{}", 0.0),
        ("fanout_in_flight{}", 0.0),
        ("fanout_subscriber_calls{fanout_cluster=\"steady\"}", 4.0),
        (
            "fanout_subscriber_delivered{fanout_cluster=\"steady\"}",
            4.0,
        ),
        ("fanout_subscriber_calls{fanout_cluster=\"flaky\"}", 4.0),
        ("fanout_subscriber_delivered{fanout_cluster=\"flaky\"}", 3.0),
        (
            "fanout_subscriber_failed{fanout_cluster=\"flaky\",fanout_reason=\"status_5xx\"}",
            1.0,
        ),
        (
            "fanout_subscriber_failed{fanout_cluster=\"flaky\",fanout_reason=\"timeout\"}",
            0.0,
        ),
        (
            "fanout_subscriber_failed{fanout_cluster=\"steady\",fanout_reason=\"status_5xx\"}",
            0.0,
        ),
        // One sample per fan-out (the 404 and the 413 never fanned out) and per call.
        ("fanout_duration_ms_count{}", 4.0),
        ("fanout_call_duration_ms_count{}", 8.0),
    ]
    .into_iter()
    .collect();

    // The filter hands its counts to Envoy once a second; wait for them, bounded.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut scraped = envoy.prometheus("fanout_");
    while expected.iter().any(|(k, v)| scraped.get(*k) != Some(v)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        scraped = envoy.prometheus("fanout_");
    }
    for (name, value) in &expected {
        assert_eq!(
            scraped.get(*name),
            Some(value),
            "{name} in /stats/prometheus; fanout's lines:\n{scraped:#?}"
        );
    }

    // One warning for the failing subscriber, naming it and why.
    assert!(
        envoy.wait_for_log(
            "channel default/orders: subscriber flaky failed: status 503",
            Duration::from_secs(5)
        ),
        "{}",
        envoy.log()
    );
    // Nothing above debug for the successful requests.
    let steady_lines = envoy
        .log()
        .lines()
        .filter(|l| l.contains("[wasm]") && l.contains("steady"))
        .count();
    assert_eq!(steady_lines, 0, "{}", envoy.log());
}

#[test]
fn metrics_off_defines_no_fanout_stats() {
    let sub = Subscriber::ok("sub");
    let envoy = Envoy::builder()
        .fanout(&json!({ "metrics": false, "subscribers": [{ "cluster": "sub" }] }))
        .cluster("sub", sub.port())
        .start();
    assert_eq!(
        send(Client::http1().post(&envoy.url("/")).body("{}")).status,
        202
    );
    std::thread::sleep(Duration::from_millis(1500));
    let stats = envoy.stats_text("wasmcustom.fanout");
    assert!(
        stats.is_empty(),
        "metrics are off but fanout stats exist:\n{stats:#?}"
    );
}

/// The 500 body is the documented document, field for field (README "What a request gets").
#[test]
fn the_failure_report_matches_the_documented_schema() {
    let good = Subscriber::ok("good");
    let bad = Subscriber::start("bad", Behavior::Status(503));
    let envoy = Envoy::builder()
        .fanout(&json!({
            "report": "full",
            "channels": [{ "name": "default/orders", "subscribers": [
                { "cluster": "good", "path": "/in" },
                { "cluster": "bad", "authority": "bad.local", "path": "/events" },
                { "cluster": "missing" }
            ] }]
        }))
        .cluster("good", good.port())
        .cluster("bad", bad.port())
        .start();
    let reply = send(Client::http1().post(&envoy.url("/")).body("{}"));
    assert_eq!(reply.status, 500);
    assert_eq!(reply.header("x-fanout-failed").as_deref(), Some("2"));
    let doc = reply.json();
    let keys = |v: &Value| -> Vec<String> {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    assert_eq!(
        keys(&doc),
        [
            "channel",
            "dead_lettered",
            "delivered",
            "failed",
            "skipped",
            "subscribers",
            "succeeded"
        ]
    );
    assert_eq!(doc["channel"], "default/orders");
    assert_eq!(doc["subscribers"], 3);
    assert_eq!(doc["delivered"], 1);
    let bad_entry = &doc["failed"][0];
    assert_eq!(
        keys(bad_entry),
        [
            "attempts",
            "authority",
            "cluster",
            "detail",
            "elapsed_ms",
            "leg",
            "outcome",
            "path",
            "status"
        ]
    );
    assert_eq!(bad_entry["cluster"], "bad");
    assert_eq!(bad_entry["authority"], "bad.local");
    assert_eq!(bad_entry["path"], "/events");
    assert_eq!(bad_entry["leg"], "event");
    assert_eq!(bad_entry["outcome"], "status");
    assert_eq!(bad_entry["status"], 503);
    assert_eq!(bad_entry["attempts"], 1);
    assert!(bad_entry["elapsed_ms"].as_u64().is_some());
    let missing = &doc["failed"][1];
    assert_eq!(missing["cluster"], "missing");
    assert_eq!(missing["outcome"], "dispatch_error");
    assert!(missing.get("status").is_none());
    assert_eq!(
        doc["succeeded"],
        json!([{ "cluster": "good", "authority": "good", "path": "/in",
                 "dead_lettered": false, "attempts": 1 }])
    );
}
