//! End-to-end: the real Envoy runs the built `fanout.wasm` in front of real subscriber
//! servers on loopback. One test per behaviour of the
//! contract. Run with `make test-e2e`, which builds the filter and
//! installs Envoy first; or `cargo test --test e2e` with ENVOY_BIN and FANOUT_WASM set (or
//! their defaults present).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness;

use std::collections::BTreeSet;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use harness::timing::{assert_host_measured_about, assert_waited_about, poll_until};
use harness::{
    assert_202_empty, assert_rejected, assert_status, chunked_body, send, Behavior, Client, Envoy,
    Recorded, Reply, Subscriber,
};
use serde_json::{json, Value};

// ---------------------------------------------------------------------------------------
// Helpers

/// A channel matching every host, named "default/orders".
fn one_channel(subscribers: Value) -> Value {
    json!({ "channels": [{ "name": "default/orders", "hosts": ["*"], "subscribers": subscribers }] })
}

/// Every byte value, a few times: the body must arrive byte for byte.
fn binary_body() -> Vec<u8> {
    (0..1024u32).map(|i| (i % 256) as u8).collect()
}

/// The 500 failure report: status, content type, x-fanout-failed, and the JSON body.
fn failure_report(reply: &Reply, failed: usize) -> Value {
    assert_status(reply, 500);
    assert_eq!(
        reply.header("content-type").as_deref(),
        Some("application/json"),
        "{reply:?}"
    );
    assert_eq!(
        reply.header("x-fanout-failed"),
        Some(failed.to_string()),
        "{reply:?}"
    );
    let report = reply.json();
    let entries = report["failed"]
        .as_array()
        .unwrap_or_else(|| panic!("report without a failed list: {report}"));
    assert_eq!(entries.len(), failed, "{report:#}");
    report
}

/// The report's entry for `cluster`.
fn failed_entry<'a>(report: &'a Value, cluster: &str) -> &'a Value {
    report["failed"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["cluster"] == cluster)
        .unwrap_or_else(|| panic!("no failed entry for cluster {cluster}: {report:#}"))
}

/// What every subscriber call must look like.
fn assert_call(got: &Recorded, path: &str, authority: &str, body: &[u8]) {
    assert_eq!(got.method, "POST", "{got:#?}");
    assert_eq!(got.path, path, "{got:#?}");
    assert_eq!(got.authority(), Some(authority), "{got:#?}");
    assert!(
        got.body == body,
        "the body differs from the one sent: {got:#?}"
    );
    if let Some(len) = got.header("content-length") {
        assert_eq!(len, body.len().to_string(), "{got:#?}");
    }
}

fn assert_nobody_called(subscribers: &[&Subscriber]) {
    for s in subscribers {
        assert_eq!(
            s.count(),
            0,
            "subscriber {} was called: {:#?}",
            s.name(),
            s.requests()
        );
    }
}

// ---------------------------------------------------------------------------------------
// 1. All subscribers answer 2xx.

#[test]
fn three_subscribers_answering_200_give_202_and_each_gets_one_identical_post() {
    let billing = Subscriber::ok("billing");
    let shipping = Subscriber::start("shipping", Behavior::Status(204));
    let audit = Subscriber::ok("audit");
    let envoy = Envoy::with_subscribers(
        &one_channel(json!([
            { "cluster": "billing", "authority": "billing.default.svc.cluster.local",
              "path": "/events", "headers": { "x-tenant": "acme" } },
            { "cluster": "shipping", "authority": "shipping.local",
              "path": "/in/orders?source=fanout", "headers": { "x-team": "logistics" } },
            { "cluster": "audit", "authority": "audit.example",
              "path": "/", "headers": { "x-audit": "on", "x-tenant": "internal" } }
        ])),
        &[&billing, &shipping, &audit],
    );
    let body = binary_body();
    let reply = send(
        Client::http1()
            .post(&envoy.url("/"))
            .header("content-type", "application/octet-stream")
            .body(body.clone()),
    );
    assert_202_empty(&reply);

    let got = billing.only_request();
    assert_call(&got, "/events", "billing.default.svc.cluster.local", &body);
    assert_eq!(got.header("content-type"), Some("application/octet-stream"));
    assert_eq!(got.header_all("x-tenant"), ["acme"]);

    let got = shipping.only_request();
    assert_call(&got, "/in/orders?source=fanout", "shipping.local", &body);
    assert_eq!(got.header("content-type"), Some("application/octet-stream"));
    assert_eq!(got.header_all("x-team"), ["logistics"]);
    assert_eq!(got.header("x-tenant"), None);

    let got = audit.only_request();
    assert_call(&got, "/", "audit.example", &body);
    assert_eq!(got.header("content-type"), Some("application/octet-stream"));
    assert_eq!(got.header_all("x-audit"), ["on"]);
    assert_eq!(got.header_all("x-tenant"), ["internal"]);
}

#[test]
fn a_subscriber_without_path_or_authority_gets_slash_and_its_cluster_name() {
    let plain = Subscriber::ok("plain");
    let envoy = Envoy::with_subscribers(
        &json!({ "subscribers": [{ "cluster": "plain" }] }),
        &[&plain],
    );
    let reply = send(Client::http1().post(&envoy.url("/ignored/path")).body("x"));
    assert_202_empty(&reply);
    assert_call(&plain.only_request(), "/", "plain", b"x");
}

// ---------------------------------------------------------------------------------------
// 2. One subscriber fails with a status.

#[test]
fn one_subscriber_answering_500_gives_500_naming_it_and_the_others_still_get_the_event() {
    let billing = Subscriber::ok("billing");
    let inventory = Subscriber::start("inventory", Behavior::Status(500));
    let audit = Subscriber::ok("audit");
    let envoy = Envoy::with_subscribers(
        &one_channel(json!([
            { "cluster": "billing", "path": "/b" },
            { "cluster": "inventory", "authority": "inventory.local", "path": "/inv" },
            { "cluster": "audit", "path": "/a" }
        ])),
        &[&billing, &inventory, &audit],
    );
    let reply = send(Client::http1().post(&envoy.url("/")).body("order 42"));
    let report = failure_report(&reply, 1);
    assert_eq!(report["channel"], "default/orders", "{report:#}");
    assert_eq!(report["subscribers"], 3, "{report:#}");
    assert_eq!(report["delivered"], 2, "{report:#}");
    let entry = failed_entry(&report, "inventory");
    assert_eq!(entry["outcome"], "status", "{report:#}");
    assert_eq!(entry["status"], 500, "{report:#}");
    assert_eq!(entry["authority"], "inventory.local", "{report:#}");
    assert_eq!(entry["path"], "/inv", "{report:#}");
    assert_eq!(entry["attempts"], 1, "{report:#}");
    assert!(entry["elapsed_ms"].is_u64(), "{report:#}");

    assert_call(&billing.only_request(), "/b", "billing", b"order 42");
    assert_call(&audit.only_request(), "/a", "audit", b"order 42");
    assert_call(
        &inventory.only_request(),
        "/inv",
        "inventory.local",
        b"order 42",
    );
}

// ---------------------------------------------------------------------------------------
// 3. A subscriber slower than its timeout.

#[test]
fn a_subscriber_slower_than_its_timeout_gives_500_at_the_timeout_not_later() {
    let fast = Subscriber::ok("fast");
    let slow = Subscriber::start("slow", Behavior::Delay(Duration::from_secs(10), 200));
    let envoy = Envoy::with_subscribers(
        &json!({
            "timeout_ms": 20000,
            "subscribers": [
                { "cluster": "fast" },
                { "cluster": "slow", "timeout_ms": 300 }
            ]
        }),
        &[&fast, &slow],
    );
    let reply = send(Client::http1().post(&envoy.url("/")).body("tick"));
    let report = failure_report(&reply, 1);
    // Envoy's timer may fire a coarse-clock tick early, and late by what the load makes of it;
    // about 300 ms either way, far from the subscriber's 10 s and the channel's 20 s.
    let timeout = Duration::from_millis(300);
    assert_waited_about(reply.elapsed, timeout, "the client's wait");
    let entry = failed_entry(&report, "slow");
    assert_eq!(entry["outcome"], "timeout", "{report:#}");
    assert!(entry.get("status").is_none_or(Value::is_null), "{report:#}");
    let elapsed_ms = entry["elapsed_ms"].as_u64().expect("elapsed_ms");
    assert_host_measured_about(
        Duration::from_millis(elapsed_ms),
        timeout,
        &format!("the report's elapsed_ms in {report:#}"),
    );
    assert_eq!(report["delivered"], 1, "{report:#}");
    assert_eq!(fast.count(), 1);
    assert_eq!(slow.count(), 1);
}

// ---------------------------------------------------------------------------------------
// 4. Reset connection and unknown cluster.

#[test]
fn a_reset_connection_and_an_unknown_cluster_give_500_and_the_healthy_subscriber_still_gets_the_event(
) {
    let healthy = Subscriber::ok("healthy");
    let broken = Subscriber::start("broken", Behavior::Reset);
    let envoy = Envoy::with_subscribers(
        &one_channel(json!([
            { "cluster": "broken", "path": "/r" },
            { "cluster": "ghost", "path": "/g" },
            { "cluster": "healthy", "path": "/h" }
        ])),
        &[&healthy, &broken],
    );
    let reply = send(Client::http1().post(&envoy.url("/")).body("payload"));
    let report = failure_report(&reply, 2);
    assert_eq!(report["subscribers"], 3, "{report:#}");
    assert_eq!(report["delivered"], 1, "{report:#}");
    assert_eq!(
        failed_entry(&report, "broken")["outcome"],
        "reset",
        "{report:#}"
    );
    assert_eq!(
        failed_entry(&report, "ghost")["outcome"],
        "dispatch_error",
        "{report:#}"
    );
    assert_call(&healthy.only_request(), "/h", "healthy", b"payload");
    assert_call(&broken.only_request(), "/r", "broken", b"payload");
}

#[test]
fn a_refused_connection_is_reported_as_reset() {
    // A port with nobody listening: bind, note the port, close.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let healthy = Subscriber::ok("healthy");
    let envoy = Envoy::builder()
        .fanout(&json!({ "subscribers": [{ "cluster": "healthy" }, { "cluster": "closed" }] }))
        .cluster("healthy", healthy.port())
        .cluster("closed", port)
        .start();
    let reply = send(Client::http1().post(&envoy.url("/")).body("x"));
    let report = failure_report(&reply, 1);
    assert_eq!(
        failed_entry(&report, "closed")["outcome"],
        "reset",
        "{report:#}"
    );
    assert_eq!(healthy.count(), 1);
}

#[test]
fn only_unknown_clusters_give_500_at_once() {
    let envoy = Envoy::builder()
        .fanout(&json!({ "subscribers": [{ "cluster": "ghost1" }, { "cluster": "ghost2" }] }))
        .start();
    let reply = send(Client::http1().post(&envoy.url("/")).body("x"));
    let report = failure_report(&reply, 2);
    assert_eq!(report["delivered"], 0, "{report:#}");
    for c in ["ghost1", "ghost2"] {
        assert_eq!(
            failed_entry(&report, c)["outcome"],
            "dispatch_error",
            "{report:#}"
        );
    }
    // "At once": no call was made, so nothing waits for a timeout (the default, 60 s). Slow
    // only by what a loaded machine makes of one request.
    assert!(
        reply.elapsed < Duration::from_secs(10),
        "{:?}",
        reply.elapsed
    );
}

// ---------------------------------------------------------------------------------------
// 5. No subscribers.

#[test]
fn no_subscribers_gives_202() {
    let envoy = Envoy::with_subscribers(&json!({ "subscribers": [] }), &[]);
    assert_202_empty(&send(
        Client::http1().post(&envoy.url("/")).body("nobody listens"),
    ));
}

#[test]
fn a_channel_with_no_subscribers_gives_202() {
    let envoy = Envoy::with_subscribers(&one_channel(json!([])), &[]);
    assert_202_empty(&send(
        Client::http1().post(&envoy.url("/")).body("nobody listens"),
    ));
}

// ---------------------------------------------------------------------------------------
// 6. Host routing.

#[test]
fn each_host_reaches_only_its_channel_and_an_unknown_host_gets_404() {
    let o1 = Subscriber::ok("orders-a");
    let o2 = Subscriber::ok("orders-b");
    let p1 = Subscriber::ok("payments-a");
    let envoy = Envoy::with_subscribers(
        &json!({ "channels": [
            { "name": "default/orders",
              "hosts": ["orders.default", "orders.default.svc.cluster.local"],
              "subscribers": [{ "cluster": "orders-a" }, { "cluster": "orders-b" }] },
            { "name": "default/payments", "hosts": ["payments.default"],
              "subscribers": [{ "cluster": "payments-a" }] }
        ] }),
        &[&o1, &o2, &p1],
    );
    let client = Client::http1();
    let post = |host: &str, body: &str| {
        send(
            client
                .post(&envoy.url("/"))
                .header("host", host)
                .body(body.to_owned()),
        )
    };

    assert_202_empty(&post("orders.default", "o-1"));
    assert_eq!((o1.count(), o2.count(), p1.count()), (1, 1, 0));

    assert_202_empty(&post("payments.default", "p-1"));
    assert_eq!((o1.count(), o2.count(), p1.count()), (1, 1, 1));

    assert_202_empty(&post("ORDERS.Default.svc.Cluster.Local:8080", "o-2"));
    assert_202_empty(&post("Payments.DEFAULT:80", "p-2"));
    assert_eq!((o1.count(), o2.count(), p1.count()), (2, 2, 2));

    assert_rejected(&post("unknown.default", "lost"), 404);
    assert_rejected(&post("orders.default.evil", "lost"), 404);
    assert_eq!((o1.count(), o2.count(), p1.count()), (2, 2, 2));

    let bodies = |s: &Subscriber| s.requests().into_iter().map(|r| r.body).collect::<Vec<_>>();
    assert_eq!(bodies(&o1), [b"o-1".to_vec(), b"o-2".to_vec()]);
    assert_eq!(bodies(&o2), [b"o-1".to_vec(), b"o-2".to_vec()]);
    assert_eq!(bodies(&p1), [b"p-1".to_vec(), b"p-2".to_vec()]);
}

// ---------------------------------------------------------------------------------------
// 7. Header forwarding.

#[test]
fn forwards_request_id_ce_and_trace_headers_but_not_authorization_cookie_or_unlisted_ones() {
    let sub = Subscriber::ok("sink");
    let envoy = Envoy::with_subscribers(
        &json!({ "subscribers": [{ "cluster": "sink", "headers": { "x-added": "by-config" } }] }),
        &[&sub],
    );
    let sent = [
        ("content-type", "application/cloudevents+json"),
        ("x-request-id", "4f1c9a2e-7d3b-4e2a-9a61-0c5b8e7f1d23"),
        ("ce-id", "evt-0001"),
        ("ce-type", "com.example.order.created"),
        ("ce-source", "/orders"),
        ("ce-specversion", "1.0"),
        (
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ),
        ("tracestate", "congo=t61rcWkgMzE"),
        ("knative-arrival-time", "2024-01-01T00:00:00Z"),
        ("x-b3-traceid", "80f198ee56343ba864fe8b2a57d3eff7"),
    ];
    let withheld = [
        ("authorization", "Bearer secret-token"),
        ("cookie", "session=abc"),
        ("proxy-authorization", "Basic c2VjcmV0"),
        ("x-unlisted", "nope"),
        ("x-envoy-original-path", "/secret"),
    ];
    let mut request = Client::http1().post(&envoy.url("/")).body("{}");
    for (name, value) in sent.iter().chain(withheld.iter()) {
        request = request.header(*name, *value);
    }
    assert_202_empty(&send(request));

    let got = sub.only_request();
    for (name, value) in sent {
        assert_eq!(got.header_all(name), [value], "{name} in {got:#?}");
    }
    for (name, _) in withheld {
        assert_eq!(got.header(name), None, "{name} was forwarded: {got:#?}");
    }
    assert_eq!(got.header_all("x-added"), ["by-config"], "{got:#?}");
    assert_eq!(got.authority(), Some("sink"), "{got:#?}");
}

#[test]
fn authorization_is_forwarded_only_when_listed_by_exact_name() {
    let sub = Subscriber::ok("sink");
    let envoy = Envoy::with_subscribers(
        &json!({
            "forward_headers": ["authorization", "x-custom-*"],
            "subscribers": [{ "cluster": "sink" }]
        }),
        &[&sub],
    );
    let reply = send(
        Client::http1()
            .post(&envoy.url("/"))
            .header("authorization", "Bearer t")
            .header("cookie", "a=b")
            .header("x-custom-one", "1")
            .header("content-type", "text/plain")
            .header("x-request-id", "r-1")
            .body("x"),
    );
    assert_202_empty(&reply);
    let got = sub.only_request();
    assert_eq!(got.header("authorization"), Some("Bearer t"), "{got:#?}");
    assert_eq!(got.header("x-custom-one"), Some("1"), "{got:#?}");
    assert_eq!(got.header("cookie"), None, "{got:#?}");
    // Not in this forward_headers list.
    assert_eq!(got.header("content-type"), None, "{got:#?}");
    assert_eq!(got.header("x-request-id"), None, "{got:#?}");
}

#[test]
fn with_forward_all_the_host_content_length_and_credentials_are_still_not_forwarded() {
    let sub = Subscriber::ok("sink");
    let envoy = Envoy::with_subscribers(
        &json!({
            "forward_headers": ["*"],
            "subscribers": [{ "cluster": "sink", "authority": "sink.local" }]
        }),
        &[&sub],
    );
    let body = vec![b'z'; 20_000];
    let reply = send(
        Client::http1()
            .post(&envoy.url("/"))
            .header("host", "events.example:8080")
            .header("x-anything", "yes")
            .header("authorization", "Bearer t")
            .header("cookie", "a=b")
            .header("proxy-authorization", "Basic x")
            .body(chunked_body(body.clone())),
    );
    assert_202_empty(&reply);
    let got = sub.only_request();
    assert_call(&got, "/", "sink.local", &body);
    assert_eq!(got.header_all("host"), ["sink.local"], "{got:#?}");
    assert_eq!(got.header("x-anything"), Some("yes"), "{got:#?}");
    for name in ["authorization", "cookie", "proxy-authorization"] {
        assert_eq!(got.header(name), None, "{name} was forwarded: {got:#?}");
    }
    assert!(got.header_all("content-length").len() <= 1, "{got:#?}");
    assert!(got.header_all("transfer-encoding").len() <= 1, "{got:#?}");
}

#[test]
fn a_forwarded_header_that_is_not_utf8_is_forwarded_and_a_host_that_is_not_is_400() {
    let sub = Subscriber::ok("sink");
    let envoy =
        Envoy::with_subscribers(&json!({ "subscribers": [{ "cluster": "sink" }] }), &[&sub]);
    // obs-text: fanout carries a value it does not read (byte for byte: js_sdk.rs shows the
    // bytes; this harness's subscriber reads header lines lossily).
    let value = reqwest::header::HeaderValue::from_bytes(b"caf\xe9").unwrap();
    let reply = send(
        Client::http1()
            .post(&envoy.url("/"))
            .header("ce-source", value)
            .body("x"),
    );
    assert_eq!(reply.status, 202, "{reply:?}");
    assert_eq!(sub.only_request().header("ce-source"), Some("caf\u{fffd}"));
    // The authority routes, so it must be read. Envoy's codec refuses a host that is not
    // ASCII itself (a plain-text 400) before fanout sees it; fanout's own 400 naming
    // `:authority` is its defence where a codec would let one through (src/request.rs,
    // `an_authority_that_is_not_utf8_is_a_400_naming_it`).
    let host = reqwest::header::HeaderValue::from_bytes(b"caf\xe9").unwrap();
    let reply = send(
        Client::http1()
            .post(&envoy.url("/"))
            .header("host", host)
            .body("x"),
    );
    assert_eq!(reply.status, 400, "{reply:?}");
    assert_eq!(sub.count(), 1, "the refused request reached nobody");
}

// ---------------------------------------------------------------------------------------
// 8. No body, and a chunked upload.

#[test]
fn a_request_without_body_and_a_chunked_upload_both_fan_out() {
    let a = Subscriber::ok("a");
    let b = Subscriber::ok("b");
    let envoy = Envoy::with_subscribers(
        &json!({ "subscribers": [{ "cluster": "a", "path": "/a" }, { "cluster": "b", "path": "/b" }] }),
        &[&a, &b],
    );
    let client = Client::http1();

    assert_202_empty(&send(client.post(&envoy.url("/"))));
    for (s, path) in [(&a, "/a"), (&b, "/b")] {
        assert_call(&s.only_request(), path, s.name(), b"");
    }

    // 300 KB without a length: sent chunked, in many pieces.
    let body: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    assert_202_empty(&send(
        client
            .post(&envoy.url("/"))
            .header("content-type", "application/octet-stream")
            .body(chunked_body(body.clone())),
    ));
    for (s, path) in [(&a, "/a"), (&b, "/b")] {
        let requests = s.requests();
        assert_eq!(requests.len(), 2, "{}", s.name());
        assert_call(&requests[1], path, s.name(), &body);
        assert_eq!(
            requests[1].header("content-type"),
            Some("application/octet-stream")
        );
    }
}

// ---------------------------------------------------------------------------------------
// 9. Limits: body size and method.

#[test]
fn a_2_mib_body_over_a_1_mib_limit_gives_413_and_nobody_is_called() {
    let sub = Subscriber::ok("sink");
    let envoy = Envoy::with_subscribers(
        &json!({ "max_body_bytes": 1_048_576, "subscribers": [{ "cluster": "sink" }] }),
        &[&sub],
    );
    let reply = send(
        Client::http1()
            .post(&envoy.url("/"))
            .body(vec![b'x'; 2 * 1024 * 1024]),
    );
    // The filter's own 413 (with its JSON error), not Envoy's plain one.
    assert_rejected(&reply, 413);
    // Still serving, and nobody was called.
    assert_202_empty(&send(Client::http1().post(&envoy.url("/")).body("small")));
    assert_eq!(sub.count(), 1);
    assert_eq!(sub.only_request().body, b"small");
}

#[test]
fn a_body_one_byte_over_max_body_bytes_gives_the_filters_413_and_at_the_limit_fans_out() {
    let sub = Subscriber::ok("sink");
    let envoy = Envoy::with_subscribers(
        &json!({ "max_body_bytes": 1000, "subscribers": [{ "cluster": "sink" }] }),
        &[&sub],
    );
    let client = Client::http1();
    assert_rejected(
        &send(client.post(&envoy.url("/")).body(vec![1u8; 1001])),
        413,
    );
    assert_rejected(
        &send(
            client
                .post(&envoy.url("/"))
                .body(chunked_body(vec![1u8; 5000])),
        ),
        413,
    );
    assert_nobody_called(&[&sub]);
    assert_202_empty(&send(client.post(&envoy.url("/")).body(vec![1u8; 1000])));
    assert_eq!(sub.only_request().body, vec![1u8; 1000]);
}

#[test]
fn a_2_mib_body_fans_out_when_max_body_bytes_and_envoys_buffer_limit_allow_it() {
    let sub = Subscriber::ok("sink");
    let envoy = Envoy::builder()
        .fanout(&json!({ "max_body_bytes": 4_194_304, "subscribers": [{ "cluster": "sink" }] }))
        .cluster("sink", sub.port())
        .buffer_limit(8 * 1024 * 1024)
        .start();
    let body: Vec<u8> = (0..2 * 1024 * 1024u32).map(|i| (i % 253) as u8).collect();
    let client = Client::http1();
    assert_202_empty(&send(client.post(&envoy.url("/")).body(body.clone())));
    assert_202_empty(&send(
        client
            .post(&envoy.url("/"))
            .body(chunked_body(body.clone())),
    ));
    let requests = sub.requests();
    assert_eq!(requests.len(), 2);
    for r in &requests {
        assert_call(r, "/", "sink", &body);
    }
}

#[test]
fn a_get_gives_405_with_allow_post_options_and_nobody_is_called() {
    let sub = Subscriber::ok("sink");
    let envoy =
        Envoy::with_subscribers(&json!({ "subscribers": [{ "cluster": "sink" }] }), &[&sub]);
    let client = Client::http1();
    let reply = send(client.get(&envoy.url("/")));
    assert_rejected(&reply, 405);
    assert_eq!(
        reply.header("allow").as_deref(),
        Some("POST, OPTIONS"),
        "{reply:?}"
    );
    let reply = send(client.http.put(envoy.url("/")).body("x"));
    assert_rejected(&reply, 405);
    assert_nobody_called(&[&sub]);
}

// ---------------------------------------------------------------------------------------
// 10. HTTP/2 downstream.

#[test]
fn h2c_downstream_behaves_like_http1() {
    let good = Subscriber::ok("good");
    let flaky = Subscriber::ok("flaky");
    let envoy = Envoy::with_subscribers(
        &json!({ "channels": [{ "name": "default/orders", "hosts": ["orders.default"],
            "subscribers": [
                { "cluster": "good", "authority": "good.local", "path": "/g",
                  "headers": { "x-tenant": "acme" } },
                { "cluster": "flaky", "path": "/f" }
            ] }] }),
        &[&good, &flaky],
    );
    let client = Client::h2c_resolving("orders.default", envoy.addr());
    let url = format!("http://orders.default:{}/", envoy.port());
    let body = binary_body();

    let reply = send(
        client
            .post(&url)
            .header("content-type", "application/octet-stream")
            .header("ce-id", "h2-1")
            .header("cookie", "no=way")
            .body(body.clone()),
    );
    assert_eq!(reply.version, reqwest::Version::HTTP_2);
    assert_202_empty(&reply);
    let got = good.only_request();
    assert_call(&got, "/g", "good.local", &body);
    assert_eq!(got.header("content-type"), Some("application/octet-stream"));
    assert_eq!(got.header("ce-id"), Some("h2-1"));
    assert_eq!(got.header("x-tenant"), Some("acme"));
    assert_eq!(got.header("cookie"), None);
    assert_call(&flaky.only_request(), "/f", "flaky", &body);

    // A chunk-less streamed body over h2, and a failure report.
    flaky.set_behavior(Behavior::Status(503));
    let reply = send(client.post(&url).body(chunked_body(body.clone())));
    assert_eq!(reply.version, reqwest::Version::HTTP_2);
    let report = failure_report(&reply, 1);
    assert_eq!(failed_entry(&report, "flaky")["status"], 503, "{report:#}");
    assert_eq!(good.count(), 2);
    assert_eq!(good.requests()[1].body, body);

    // Rejections too.
    assert_rejected(&send(client.get(&url)), 405);
    let other = Client::h2c();
    assert_rejected(&send(other.post(&envoy.url("/")).body("x")), 404);
    assert_eq!((good.count(), flaky.count()), (2, 2));
}

// ---------------------------------------------------------------------------------------
// 11. Concurrency.

#[test]
fn two_hundred_concurrent_requests_to_four_subscribers_all_get_202_and_each_subscriber_counts_200()
{
    const N: usize = 200;
    let subs: Vec<Subscriber> = (0..4).map(|i| Subscriber::ok(&format!("sub{i}"))).collect();
    let config = json!({ "subscribers": (0..4).map(|i| json!({ "cluster": format!("sub{i}") })).collect::<Vec<_>>() });
    let envoy = Envoy::with_subscribers(&config, &subs.iter().collect::<Vec<_>>());
    let client = Client::http1();
    let barrier = Arc::new(Barrier::new(N));
    let url = envoy.url("/");
    let threads: Vec<_> = (0..N)
        .map(|i| {
            let client = client.clone();
            let barrier = Arc::clone(&barrier);
            let url = url.clone();
            std::thread::spawn(move || {
                barrier.wait();
                send(client.post(&url).body(format!("event-{i}")))
            })
        })
        .collect();
    let replies: Vec<Reply> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let statuses: Vec<u16> = replies.iter().map(|r| r.status).collect();
    let not_202: Vec<_> = replies.iter().filter(|r| r.status != 202).collect();
    assert!(
        not_202.is_empty(),
        "{} of {N} were not 202: {not_202:#?}",
        not_202.len()
    );
    assert_eq!(statuses.len(), N);

    let expected: BTreeSet<Vec<u8>> = (0..N).map(|i| format!("event-{i}").into_bytes()).collect();
    for s in &subs {
        let requests = s.requests();
        assert_eq!(requests.len(), N, "subscriber {}", s.name());
        let bodies: BTreeSet<Vec<u8>> = requests.into_iter().map(|r| r.body).collect();
        assert_eq!(
            bodies,
            expected,
            "subscriber {} got duplicates or strays",
            s.name()
        );
    }
}

// ---------------------------------------------------------------------------------------
// A client that goes away mid-fan-out does not disturb the others.

#[test]
fn a_client_that_goes_away_mid_fan_out_does_not_disturb_other_requests() {
    let slow = Subscriber::start("slow", Behavior::Delay(Duration::from_millis(800), 200));
    let fast = Subscriber::ok("fast");
    let mut envoy = Envoy::with_subscribers(
        &json!({ "channels": [
            { "name": "slow", "hosts": ["slow.test"], "subscribers": [{ "cluster": "slow" }] },
            { "name": "fast", "hosts": ["fast.test"], "subscribers": [{ "cluster": "fast" }] }
        ] }),
        &[&slow, &fast],
    );
    let impatient = reqwest::blocking::Client::builder()
        .no_proxy()
        .timeout(Duration::from_millis(150))
        .build()
        .unwrap();
    for _ in 0..3 {
        let r = impatient
            .post(envoy.url("/"))
            .header("host", "slow.test")
            .body("x")
            .send();
        assert!(r.is_err(), "expected the client to give up: {r:?}");
    }
    let client = Client::http1();
    let post = |host: &str| send(client.post(&envoy.url("/")).header("host", host).body("y"));
    assert_202_empty(&post("fast.test"));
    // Once the abandoned calls are over on Envoy's side (cancelled with their streams, or
    // answered by the subscriber after its 800 ms): no stream and no call to `slow` left.
    let active = |envoy: &Envoy| {
        (
            envoy.stat("http.ingress.downstream_rq_active"),
            envoy.stat("cluster.slow.upstream_rq_active"),
        )
    };
    let idle = |envoy: &Envoy| (active(envoy) == (Some(0), Some(0))).then_some(());
    assert!(
        poll_until(Duration::from_secs(20), Duration::from_millis(50), || idle(
            &envoy
        ))
        .is_some(),
        "the abandoned calls never ended: (downstream_rq_active, upstream_rq_active) {:?}",
        active(&envoy)
    );
    assert_202_empty(&post("fast.test"));
    assert_202_empty(&post("slow.test"));
    assert_eq!(fast.count(), 2);
    assert!(envoy.try_wait_alive());
    let log = envoy.log();
    assert!(!log.contains("panicked"), "the filter panicked:\n{log}");
}

// What becomes of the calls of a sender that goes away once they reached the subscriber
// (docs/answers.md): the wasm build's run to their answer; the native build's are cancelled
// by Envoy with the sender's stream, which over HTTP/1.1 closes each call's connection.
#[test]
fn a_sender_that_goes_away_leaves_its_calls_answered_on_wasm_and_cancelled_on_native() {
    use std::io::Write;
    // Its answers come well after each sender has left, even on a loaded machine.
    let slow = Subscriber::start("slow", Behavior::Delay(Duration::from_secs(2), 200));
    let envoy = Envoy::with_subscribers(&one_channel(json!([{ "cluster": "slow" }])), &[&slow]);
    for sent in 1..=3 {
        let mut sender = std::net::TcpStream::connect(envoy.addr()).unwrap();
        sender
            .write_all(b"POST / HTTP/1.1\r\nhost: a.test\r\ncontent-length: 1\r\n\r\nx")
            .unwrap();
        assert_eq!(slow.wait_for(sent, Duration::from_secs(10)), sent);
        // The sender, and its connection, go away here: its call is in flight.
    }
    let stat = |name: &str| envoy.stat(&format!("cluster.slow.{name}"));
    let idle = || (stat("upstream_rq_active") == Some(0)).then_some(());
    assert!(
        poll_until(Duration::from_secs(20), Duration::from_millis(50), idle).is_some(),
        "the calls never ended: upstream_rq_active {:?}",
        stat("upstream_rq_active")
    );
    let (answered, reset) = match harness::fanout_build() {
        harness::Build::Wasm => (3, 0),
        harness::Build::Native => (0, 3),
    };
    // (Envoy makes `upstream_rq_2xx` on the first 2xx.)
    assert_eq!(
        (
            stat("upstream_rq_2xx").unwrap_or(0),
            stat("upstream_cx_destroy_local_with_active_rq").unwrap_or(0)
        ),
        (answered, reset),
        "(calls answered 2xx, connections closed with a call in flight)"
    );
    assert_eq!(slow.count(), 3, "{:#?}", slow.requests());
}

// ---------------------------------------------------------------------------------------
// 12. A config with an error.

#[test]
fn a_config_with_an_empty_cluster_stops_envoy_and_its_log_names_the_field_path() {
    let (status, log) = Envoy::builder()
        .fanout(
            &json!({ "channels": [{ "name": "default/orders", "hosts": ["*"],
            "subscribers": [{ "cluster": "" }] }] }),
        )
        .start_expecting_failure();
    assert!(!status.success(), "Envoy exited with {status}:\n{log}");
    assert!(
        log.contains("channels[0].subscribers[0].cluster"),
        "the log should name channels[0].subscribers[0].cluster:\n{log}"
    );
}

#[test]
fn every_kind_of_config_error_stops_envoy_and_names_its_field() {
    let cases: Vec<(&str, String, Vec<&str>)> = vec![
        (
            "unknown field",
            json!({ "channels": [{ "name": "c", "hosts": ["*"],
                "subscribers": [{ "cluster": "a" }, { "clsuter": "b" }] }] })
            .to_string(),
            vec!["channels[0].subscribers[1]", "clsuter"],
        ),
        (
            "wrong type",
            json!({ "timeout_ms": "fast", "subscribers": [] }).to_string(),
            vec!["timeout_ms"],
        ),
        (
            "path without leading slash",
            json!({ "subscribers": [{ "cluster": "a" }, { "cluster": "b", "path": "events" }] })
                .to_string(),
            vec!["subscribers[1].path"],
        ),
        (
            "timeout of 0",
            json!({ "subscribers": [{ "cluster": "a", "timeout_ms": 0 }] }).to_string(),
            vec!["subscribers[0].timeout_ms"],
        ),
        (
            "a host claimed by two channels",
            json!({ "channels": [
                { "name": "one", "hosts": ["a.example"], "subscribers": [] },
                { "name": "two", "hosts": ["b.example", "a.example"], "subscribers": [] }
            ] })
            .to_string(),
            vec!["channels[1].hosts", "a.example"],
        ),
        (
            "both channels and subscribers",
            json!({ "channels": [], "subscribers": [] }).to_string(),
            vec!["channels", "subscribers"],
        ),
        ("not JSON", "{ this is not json".to_owned(), vec![]),
        ("no configuration at all", String::new(), vec![]),
    ];
    let mut problems = Vec::new();
    for (what, config, needles) in &cases {
        let (status, log) = Envoy::builder()
            .fanout_raw(config)
            .start_expecting_failure();
        if status.success() {
            problems.push(format!("{what}: Envoy exited with success"));
        }
        // The filter's own lines: Envoy's other lines could contain the words.
        let filter_lines = harness::filter_log_lines(&log);
        if filter_lines.is_empty() {
            problems.push(format!("{what}: the filter logged nothing"));
        }
        for needle in needles {
            if !filter_lines.iter().any(|l| l.contains(needle)) {
                problems.push(format!(
                    "{what}: no log line of the filter names {needle:?}; its lines:\n  {}",
                    filter_lines.join("\n  ")
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
