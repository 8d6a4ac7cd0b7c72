//! `body_wait: continue`, the mode for Envoys without `allow_on_headers_stop_iteration`
//! (before 1.35) and for Istio's WasmPlugin: the filter lets the headers go on and a buffer
//! filter after it holds them from the router. The whole e2e suite runs in this mode too
//! (`FANOUT_E2E_BODY_WAIT=continue`, see `make test-compat`); these tests are about what
//! happens when the buffer filter is missing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness;

use std::time::Duration;

use harness::{send, Client, Envoy, Subscriber, TRIPWIRE_BODY};
use serde_json::json;

fn continue_config(subscriber: &Subscriber) -> serde_json::Value {
    json!({ "body_wait": "continue", "subscribers": [{ "cluster": subscriber.name() }] })
}

#[test]
fn with_the_buffer_filter_continue_mode_fans_out_the_whole_body() {
    let billing = Subscriber::ok("billing");
    let envoy = Envoy::builder()
        .fanout(&continue_config(&billing))
        .cluster("billing", billing.port())
        .start();
    let body = vec![b'e'; 300 * 1024];
    let reply = send(Client::http1().post(&envoy.url("/")).body(body.clone()));
    reply.assert_not_tripwire();
    assert_eq!(reply.status, 202, "{}", reply.text());
    assert_eq!(billing.only_request().body, body);
    assert!(!envoy.log().contains("allow_on_headers_stop_iteration"));
}

/// Without the buffer filter the router acts on the headers alone. Behind the tripwire route
/// every shipped configuration has, that is a loud 500 from the route, the filter logs an
/// error and counts it, and the event is not fanned out behind the sender's back.
#[test]
fn without_the_buffer_filter_the_tripwire_answers_and_nothing_is_fanned_out() {
    let billing = Subscriber::ok("billing");
    let envoy = Envoy::builder()
        .fanout(&continue_config(&billing))
        .cluster("billing", billing.port())
        .without_buffer_filter()
        .start();
    let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
    assert_eq!(reply.status, 500);
    assert_eq!(reply.text(), TRIPWIRE_BODY);
    assert!(
        envoy.wait_for_log("the request reached the router", Duration::from_secs(10)),
        "no error in Envoy's log:\n{}",
        envoy.log()
    );
    assert_eq!(
        envoy.wait_for_stat(
            "wasmcustom.fanout.requests.reached_router",
            |n| n == 1,
            Duration::from_secs(10)
        ),
        Some(1)
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(billing.count(), 0, "fanned out after the router answered");
}

/// Even with a route to a real upstream instead of the tripwire, the upstream never receives
/// the event: the body stays in the filter, which answers the sender itself.
#[test]
fn without_the_buffer_filter_a_routed_upstream_never_gets_the_event() {
    let billing = Subscriber::ok("billing");
    let upstream = Subscriber::ok("route_upstream");
    let envoy = Envoy::builder()
        .fanout(&continue_config(&billing))
        .cluster("billing", billing.port())
        .cluster("route_upstream", upstream.port())
        .route_to("route_upstream")
        .without_buffer_filter()
        .start();
    let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
    assert_eq!(reply.status, 202, "{}", reply.text());
    assert_eq!(billing.only_request().body, b"event");
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        upstream.requests().iter().all(|r| r.body != b"event"),
        "the route's upstream received the event: {:?}",
        upstream.requests()
    );
}
