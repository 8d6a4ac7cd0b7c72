//! The etcd store fed arbitrary answers: etcd's gRPC answers to the claim, the settle and a
//! lease grant are read by the store's readers (`fanout::dedupe::etcd`), and a plugin with
//! the etcd store gets them through the fake host as the answers to its calls (the bytes as
//! they come, or framed as one gRPC message, so that the decoding is reached).
//!
//! Properties:
//! - no reader panics, whatever the status and the bytes;
//! - a claim answer that reads gives exactly one decision per subscriber asked;
//! - driven through the plugin, every request is answered once, and never called a
//!   subscriber after a `reject` answer (503); every subscriber called is one of the channel's.

// A harness: it drives the plugin it owns through its cells directly (the crate's
// clippy.toml rule, src/cell.rs, is for the core's shared state).
#![allow(clippy::disallowed_methods)]
#![no_main]

use fanout::dedupe::etcd::{self, proto};
use fanout::plugin::Plugin;
use fanout::testing::FakeHost;
use libfuzzer_sys::fuzz_target;

const CONFIG: &str = r#"{
  "dedupe": {"key": "ce-id", "ttl_ms": 60000,
             "store": {"etcd": {"cluster": "etcd", "timeout_ms": 250}},
             "on_store_error": "ON_ERROR"},
  "subscribers": [{"cluster": "a"}, {"cluster": "b"}, {"cluster": "c"}]
}"#;

fuzz_target!(|data: &[u8]| {
    let Some((&head, rest)) = data.split_first() else {
        return;
    };
    let n = usize::from(head % 5);
    let status = match head >> 5 {
        0 => None,
        1 => Some(503),
        2 => Some(404),
        _ => Some(200),
    };
    let framed = head & 0x08 != 0;
    let body = if framed {
        let mut framed = vec![0];
        framed.extend_from_slice(&u32::try_from(rest.len()).unwrap_or(u32::MAX).to_be_bytes());
        framed.extend_from_slice(rest);
        framed
    } else {
        rest.to_vec()
    };
    // The readers alone: the messages as they come, and the answer around them.
    if let Ok(seen) = etcd::read_claim(rest, n) {
        assert_eq!(seen.len(), n);
    }
    let _ = etcd::read_txn_ok(rest);
    let _ = etcd::read_grant(rest);
    let reply = etcd::Reply {
        status,
        grpc_status: Some("0".into()),
        grpc_message: None,
        body: body.clone(),
    };
    if let Ok(message) = etcd::read_answer(&reply) {
        if framed {
            assert_eq!(message, rest, "a frame's message is what it framed");
        }
    }
    // Through the plugin: the grants, then one request's claim, answered with `rest`.
    let reject = head & 0x10 != 0;
    let config = CONFIG.replace("ON_ERROR", if reject { "reject" } else { "deliver" });
    let host = FakeHost::default();
    host.0.borrow_mut().config = Some(config.into_bytes());
    let mut root = Plugin::new(1, host.clone());
    root.on_vm_start();
    assert!(root.on_configure());
    // The timer grants the leases.
    root.on_tick();
    let grants: Vec<u32> = host.0.borrow().dispatched.iter().map(|d| d.token).collect();
    for token in grants {
        let grant = proto::frame(&proto::LeaseGrantResponse {
            id: 7_587_884_271_138_411_786,
            ttl: 67,
            error: String::new(),
        });
        let mut state = host.0.borrow_mut();
        state.call_response = (Some(200), grant.clone());
        state.call_response_trailers = vec![("grpc-status".into(), "0".into())];
        drop(state);
        root.on_call_response(token, 1, grant.len());
    }
    let before = host.0.borrow().dispatched.len();
    {
        let mut state = host.0.borrow_mut();
        state.request_headers = vec![
            (":method".into(), b"POST".to_vec()),
            (":authority".into(), b"x".to_vec()),
            (":path".into(), b"/".to_vec()),
            ("ce-id".into(), b"e1".to_vec()),
        ];
        state.effective = 2;
    }
    let mut stream = root.create_stream(2);
    stream.on_request_headers(true);
    let claim = host.0.borrow().dispatched.get(before).map(|d| d.token);
    let claim = claim.expect("with its leases granted, the request asks etcd first");
    host.0.borrow_mut().call_response = (status, body.clone());
    stream.on_call_response(claim, usize::from(status.is_some()), body.len());
    let state = host.0.borrow();
    // The subscribers called (a settle to etcd may follow the claim at once, before the
    // answer, when nobody is left to call).
    let called: Vec<&str> = state.dispatched[before + 1..]
        .iter()
        .map(|d| d.cluster.as_str())
        .filter(|c| *c != "etcd")
        .collect();
    assert!(
        called.iter().all(|c| ["a", "b", "c"].contains(c)),
        "{called:?}"
    );
    if state.answers.iter().any(|a| a.status == 503) {
        assert!(called.is_empty(), "a 503 called {called:?}");
    }
    assert!(state.answers.len() <= 1);
});
