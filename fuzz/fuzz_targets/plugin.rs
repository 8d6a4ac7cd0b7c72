//! The whole core, driven the way Envoy drives the filter, on the fake host
//! (`fanout::testing::FakeHost`): a plugin configured with one of a few configurations
//! (sync, async, retries with a dead letter and a reply target, dedupe, filters, metrics on or
//! off, best-effort subscribers, jitter, a cap of one call), then an arbitrary sequence of
//! callbacks: streams opened with any headers, bodies in pieces, trailers, answers to any call
//! made so far (or to a token never handed out) with any status, body and `retry-after`, from
//! the stream or the root context, the timer firing with the clock moved on, clients going
//! away, responses passing back through the filter.
//!
//! Properties:
//! - nothing panics;
//! - every stream is answered at most once, and every answer is a status Envoy can send with
//!   header values that cannot split a header block;
//! - once every call still waited for has been answered 200 and the timer has run past every
//!   deadline, no fan-out is left in flight (the `fanout.in_flight` gauge is back to 0 with
//!   metrics on), and a sync stream that was neither left by its client nor answered by
//!   Envoy has had its one answer.

// A harness: it drives the plugin it owns through its cells directly (the crate's
// clippy.toml rule, src/cell.rs, is for the core's shared state).
#![allow(clippy::disallowed_methods)]
#![no_main]

use std::collections::BTreeMap;

use arbitrary::{Arbitrary, Unstructured};
use fanout::headers::is_valid_value;
use fanout::plugin::Plugin;
use fanout::stream::Stream;
use fanout::testing::FakeHost;
use libfuzzer_sys::fuzz_target;

const ROOT: u32 = 1;

const CONFIGS: &[&str] = &[
    r#"{"subscribers": [{"cluster": "a"}, {"cluster": "b"}]}"#,
    r#"{"mode": "async", "max_in_flight": 2, "metrics": false,
        "subscribers": [{"cluster": "a"}, {"cluster": "b"}]}"#,
    r#"{"max_body_bytes": 64, "delivery": {"retry": 2, "backoff_delay_ms": 10,
        "dead_letter": {"cluster": "dlq"}},
        "subscribers": [{"cluster": "a", "reply": {"cluster": "r"}}, {"cluster": "b"}]}"#,
    r#"{"dedupe": {"ttl_ms": 1000, "max_entries": 4}, "delivery": {"retry": 1},
        "subscribers": [{"cluster": "a"}, {"cluster": "b"}, {"cluster": "c"}]}"#,
    r#"{"body_wait": "continue", "channels": [{"name": "o", "hosts": ["o"], "subscribers": [
        {"cluster": "t", "filters": [{"exact": {"type": "t"}}]}, {"cluster": "all"}]}]}"#,
    r#"{"mode": "async", "dedupe": {"key": "x-id"}, "delivery": {"retry": 1,
        "dead_letter": {"cluster": "dlq"}}, "subscribers": [{"cluster": "a"}]}"#,
    r#"{"dedupe": {"key": "x-id"}, "delivery": {"retry": 2, "backoff_delay_ms": 10,
        "backoff_jitter": 0.5, "dead_letter": {"cluster": "dlq"}},
        "subscribers": [{"cluster": "a"}, {"cluster": "b", "required": false,
        "reply": {"cluster": "r"}}]}"#,
    r#"{"max_concurrent_calls": 1, "max_queued_calls": 1, "delivery": {"retry": 1,
        "backoff_delay_ms": 10, "dead_letter": {"cluster": "a"}},
        "subscribers": [{"cluster": "a"}, {"cluster": "b", "required": false}]}"#,
    r#"{"max_in_flight": 2, "delivery": {"retry": 1},
        "subscribers": [{"cluster": "a", "required": false}, {"cluster": "b", "required": false}]}"#,
];

#[derive(Arbitrary, Debug)]
enum Header {
    Post,
    Method(String),
    Host(String),
    ContentLength(u16),
    ContentType(bool),
    Ce(String, String),
    Source(String),
    Id(String),
    Other(String, Vec<u8>),
}

#[derive(Arbitrary, Debug)]
enum Op {
    Open {
        headers: Vec<Header>,
        body: u8,
        end_of_stream: bool,
    },
    Body {
        stream: u8,
        size: u8,
        end_of_stream: bool,
    },
    Trailers {
        stream: u8,
    },
    /// The answer to the `call`th call made so far (or, with `stray`, to a token nobody has).
    Answer {
        call: u8,
        stray: bool,
        status: Option<u16>,
        body: Vec<u8>,
        headers: Vec<(String, String)>,
    },
    Tick {
        ms: u16,
    },
    Done {
        stream: u8,
    },
    ResponseHeaders {
        stream: u8,
    },
}

struct Open {
    id: u32,
    stream: Stream<FakeHost>,
    /// The request ended (headers or body with end of stream, or trailers).
    complete: bool,
    /// Envoy answered it, or its client left: it may never get fanout's answer.
    left: bool,
    /// `on_done` came: Envoy calls nothing on it any more.
    done: bool,
}

fn request_headers(headers: &[Header]) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = Vec::new();
    let mut push = |name: &str, value: &[u8]| out.push((name.to_string(), value.to_vec()));
    for header in headers.iter().take(12) {
        match header {
            Header::Post => push(":method", b"POST"),
            Header::Method(m) => push(":method", m.as_bytes()),
            Header::Host(h) => push(":authority", h.as_bytes()),
            Header::ContentLength(n) => push("content-length", n.to_string().as_bytes()),
            Header::ContentType(structured) => push(
                "content-type",
                if *structured {
                    b"application/cloudevents+json"
                } else {
                    b"application/json"
                },
            ),
            Header::Ce(name, value) => push(
                &format!("ce-{}", name.to_ascii_lowercase()),
                value.as_bytes(),
            ),
            Header::Source(s) => push("ce-source", s.as_bytes()),
            Header::Id(i) => push("ce-id", i.as_bytes()),
            Header::Other(name, value) => push(&name.to_ascii_lowercase(), value),
        }
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let Ok(which) = u.int_in_range(0..=CONFIGS.len() - 1) else {
        return;
    };
    let Ok(ops) = Vec::<Op>::arbitrary_take_rest(u) else {
        return;
    };
    let config = CONFIGS[which];
    let metrics = !config.contains(r#""metrics": false"#);
    let sync = !config.contains("async");

    let host = FakeHost::default();
    host.0.borrow_mut().config = Some(config.as_bytes().to_vec());
    let mut root = Plugin::new(ROOT, host.clone());
    assert!(root.on_vm_start());
    assert!(
        root.on_configure(),
        "a fixed configuration was refused: {config}"
    );
    let mut streams: Vec<Open> = Vec::new();
    let enter = |context: u32| host.0.borrow_mut().effective = context;

    for op in ops.into_iter().take(200) {
        match op {
            Op::Open {
                headers,
                body,
                end_of_stream,
            } => {
                let id = ROOT + 1 + streams.len() as u32;
                {
                    let mut state = host.0.borrow_mut();
                    state.request_headers = request_headers(&headers);
                    state.request_body = vec![b'{'; usize::from(body)];
                }
                enter(id);
                let mut stream = root.create_stream(id);
                let _ = stream.on_request_headers(end_of_stream);
                streams.push(Open {
                    id,
                    stream,
                    complete: end_of_stream,
                    left: false,
                    done: false,
                });
            }
            Op::Body {
                stream,
                size,
                end_of_stream,
            } => {
                if let Some(open) = pick(&mut streams, stream) {
                    enter(open.id);
                    let _ = open
                        .stream
                        .on_request_body(usize::from(size), end_of_stream);
                    open.complete |= end_of_stream;
                }
            }
            Op::Trailers { stream } => {
                if let Some(open) = pick(&mut streams, stream) {
                    enter(open.id);
                    let _ = open.stream.on_request_trailers();
                    open.complete = true;
                }
            }
            Op::Answer {
                call,
                stray,
                status,
                body,
                headers,
            } => {
                let dispatched = host.0.borrow().dispatched.clone();
                let (token, context) = if stray || dispatched.is_empty() {
                    (u32::from(call) + 10_000, ROOT)
                } else {
                    let call = &dispatched[usize::from(call) % dispatched.len()];
                    (call.token, call.context)
                };
                {
                    let mut state = host.0.borrow_mut();
                    state.call_response = (status, body.clone());
                    state.call_response_headers = headers
                        .iter()
                        .take(4)
                        .map(|(n, v)| (n.to_ascii_lowercase(), v.as_bytes().to_vec()))
                        .collect();
                }
                let num_headers = usize::from(status.is_some()) + headers.len().min(4);
                answer(
                    &host,
                    &mut root,
                    &mut streams,
                    context,
                    token,
                    num_headers,
                    body.len(),
                );
            }
            Op::Tick { ms } => {
                host.0.borrow_mut().now_ms += u64::from(ms);
                enter(ROOT);
                root.on_tick();
            }
            Op::Done { stream } => {
                if let Some(open) = pick(&mut streams, stream) {
                    enter(open.id);
                    open.stream.on_done();
                    open.left = true;
                    open.done = true;
                    host.0.borrow_mut().gone.insert(open.id);
                }
            }
            Op::ResponseHeaders { stream } => {
                if let Some(open) = pick(&mut streams, stream) {
                    enter(open.id);
                    let _ = open.stream.on_response_headers();
                    let answered = host.0.borrow().answered_streams.contains(&open.id);
                    // Envoy's own answer (or the router's) reached the client.
                    open.left |= !answered;
                }
            }
        }
        check_answers(&host);
    }

    // Drain: answer every call still waited for with 200, and let the timer run past every
    // deadline (retries, async deliveries, lost calls).
    let mut seen = 0usize;
    for _ in 0..64 {
        let dispatched = host.0.borrow().dispatched.clone();
        for call in &dispatched[seen..] {
            host.0.borrow_mut().call_response = (Some(200), Vec::new());
            host.0.borrow_mut().call_response_headers = Vec::new();
            answer(
                &host,
                &mut root,
                &mut streams,
                call.context,
                call.token,
                1,
                0,
            );
        }
        seen = dispatched.len();
        host.0.borrow_mut().now_ms += 60_000;
        enter(ROOT);
        root.on_tick();
        if host.0.borrow().dispatched.len() == seen {
            break;
        }
    }
    check_answers(&host);
    if metrics {
        host.0.borrow_mut().now_ms += 2_000;
        enter(ROOT);
        root.on_tick();
        assert_eq!(
            host.0.borrow().metric("fanout.in_flight").map(|m| m.2),
            Some(0),
            "fan-outs left in flight"
        );
    }
    if sync {
        let state = host.0.borrow();
        for open in streams.iter().filter(|o| o.complete && !o.left) {
            assert!(
                state.answered_streams.contains(&open.id),
                "stream {} was complete and never answered",
                open.id
            );
        }
    }
});

/// The `n`th stream, unless Envoy is done with it.
fn pick(streams: &mut [Open], n: u8) -> Option<&mut Open> {
    if streams.is_empty() {
        return None;
    }
    let len = streams.len();
    streams.get_mut(usize::from(n) % len).filter(|o| !o.done)
}

/// Hands the answer to `token` to the context that made the call, as Envoy does.
fn answer(
    host: &FakeHost,
    root: &mut Plugin<FakeHost>,
    streams: &mut [Open],
    context: u32,
    token: u32,
    num_headers: usize,
    body_size: usize,
) {
    host.0.borrow_mut().effective = context;
    if context == ROOT {
        root.on_call_response(token, num_headers, body_size);
    } else if let Some(open) = streams.iter_mut().find(|o| o.id == context) {
        // Envoy cancels a stream's calls when it ends: no answer comes after that.
        if !host.0.borrow().gone.contains(&context) {
            open.stream.on_call_response(token, num_headers, body_size);
        }
    }
}

fn check_answers(host: &FakeHost) {
    let state = host.0.borrow();
    let mut per_stream: BTreeMap<u32, usize> = BTreeMap::new();
    for stream in &state.answered_streams {
        *per_stream.entry(*stream).or_default() += 1;
    }
    for (stream, n) in per_stream {
        assert!(
            n <= 1,
            "stream {stream} answered {n} times: {:?}",
            state.answers
        );
    }
    for answer in &state.answers {
        assert!((200..600).contains(&answer.status), "{answer:?}");
        for (name, value) in &answer.headers {
            assert!(is_valid_value(value), "{name}: {value:?}");
        }
    }
}
