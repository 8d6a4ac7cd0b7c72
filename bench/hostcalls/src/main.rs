//! Prints, as JSON, the host calls `fanout` makes for one request answered 202, for
//! N = 0, 1, 4, 16, 64 subscribers, with metrics on and off, and with `tracing` at 100 %
//! sampling (metrics off; its rows say `"tracing": true`).
//!
//! Each request: headers (not end of stream), one body callback with end of stream and a
//! 1 KiB body, then one 200 answer per subscriber. Metrics are flushed on the root's tick;
//! the flush's calls are amortised over the requests since the previous tick. Calls the
//! proxy-wasm SDK makes on its own are added: `set_effective_context` before every
//! `on_http_call_response`.

// A harness: it drives the plugin it owns through its cells directly (the crate's
// clippy.toml rule, src/cell.rs, is for the core's shared state).
#![allow(clippy::disallowed_methods)]

use fanout::plugin::Plugin;
use fanout::testing::FakeHost;

const REQUESTS: u64 = 1000;

/// What a sender typically puts on a binary CloudEvent, pseudo-headers first as Envoy hands
/// them over.
fn request_headers() -> Vec<(String, Vec<u8>)> {
    let mut headers = vec![
        (":method", "POST"),
        (":path", "/"),
        (":authority", "127.0.0.1:10000"),
        (":scheme", "http"),
        ("content-type", "application/json"),
        ("content-length", "1024"),
        ("ce-specversion", "1.0"),
        ("ce-type", "dev.fanout.bench"),
        ("ce-source", "/bench"),
        ("ce-id", "1"),
        ("user-agent", "wrk"),
        ("x-forwarded-proto", "http"),
        ("x-request-id", "0b7c5a4e-9a7c-4c55-8a3c-1f0f2b1a6f11"),
    ];
    headers.sort_by_key(|(name, _)| !name.starts_with(':'));
    headers
        .into_iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect()
}

fn measure(n: usize, metrics: bool, tracing: bool) -> String {
    let subscribers: Vec<String> = (0..n)
        .map(|i| format!(r#"{{"cluster": "sub_{i}"}}"#))
        .collect();
    let traced = if tracing {
        r#""tracing": {"collector": {"cluster": "otel"}, "sampling_ratio": 1.0}, "#
    } else {
        ""
    };
    let config = format!(
        r#"{{{traced}"metrics": {metrics}, "timeout_ms": 5000, "subscribers": [{}]}}"#,
        subscribers.join(",")
    );
    let host = FakeHost::default();
    {
        let mut state = host.0.borrow_mut();
        state.config = Some(config.into_bytes());
        state.request_headers = request_headers();
        state.request_body = vec![b'x'; 1024];
        state.call_response = (Some(200), Vec::new());
    }
    let mut root = Plugin::new(1, host.clone());
    assert!(root.on_vm_start());
    assert!(root.on_configure(), "configuration refused");
    host.0.borrow_mut().calls.clear();
    let mut sdk_calls = 0u64;
    for i in 0..REQUESTS {
        let mut stream = root.create_stream(i as u32 + 2);
        let _ = stream.on_request_headers(false);
        let _ = stream.on_request_body(1024, true);
        let calls = std::mem::take(&mut host.0.borrow_mut().dispatched);
        for call in calls {
            sdk_calls += 1; // set_effective_context, by the SDK's dispatcher
            stream.on_call_response(call.token, 3, 0);
        }
        let _ = stream.on_response_headers();
        stream.on_done();
        let answers = std::mem::take(&mut host.0.borrow_mut().answers);
        assert!(
            answers.len() == 1 && answers[0].status == 202,
            "the bench request must be answered 202 once: {answers:?}"
        );
    }
    root.on_tick();
    let state = host.0.borrow();
    let total = state.calls.values().sum::<u64>() + sdk_calls;
    let mut by_call: Vec<String> = state
        .calls
        .iter()
        .map(|(name, count)| format!(r#""{name}": {}"#, *count as f64 / REQUESTS as f64))
        .collect();
    by_call.push(format!(
        r#""set_effective_context (SDK)": {}"#,
        sdk_calls as f64 / REQUESTS as f64
    ));
    let tracing = if tracing { r#""tracing": true, "# } else { "" };
    format!(
        r#"{{"subscribers": {n}, "metrics": {metrics}, {tracing}"per_request": {}, "by_call": {{{}}}}}"#,
        total as f64 / REQUESTS as f64,
        by_call.join(", ")
    )
}

/// `FANOUT_HOSTCALLS_ONLY=N,METRICS` (e.g. `0,true`; `4,tracing` for a traced one): that configuration alone, for a native
/// instruction profile of fanout's own code per request (bench/README.md).
fn main() {
    let only = std::env::var("FANOUT_HOSTCALLS_ONLY").ok();
    let mut rows = Vec::new();
    for (metrics, tracing) in [(true, false), (false, false), (false, true)] {
        for n in [0, 1, 4, 16, 64] {
            let key = if tracing {
                format!("{n},tracing")
            } else {
                format!("{n},{metrics}")
            };
            if only.as_ref().is_none_or(|o| *o == key) {
                rows.push(measure(n, metrics, tracing));
            }
        }
    }
    println!("[\n  {}\n]", rows.join(",\n  "));
}
