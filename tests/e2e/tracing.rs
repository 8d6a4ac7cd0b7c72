//! Traces of real requests: events sent through the real Envoy with the built filter to real
//! subscribers, the spans fanout exports received by a real OTLP receiver that decodes them
//! with the official protos (`harness::otlp`), and the `traceparent` every call carried as
//! the subscribers, reply targets and dead-letter targets received it.
//!
//! A batch of spans leaves a worker about a second after its spans end (the exporter's
//! default `max_batch_delay_ms`, checked every 100 ms on Envoy's coarse timer), so the tests
//! poll the receiver for the spans to arrive, with a timeout of many seconds.

use std::net::TcpListener;
use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::otlp::{OtlpReceiver, ReceivedSpan, SpanTree};
use crate::harness::{send, Behavior, Client, Envoy, Recorded, Reply, Subscriber};

const SENDER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const SENDER_SPAN: &str = "00f067aa0ba902b7";
const SENDER_STATE: &str = "congo=t61rcWkgMzE";
/// Spans arrive within about a second of their end; this is for a loaded machine.
const ARRIVAL: Duration = Duration::from_secs(30);

fn sampled() -> String {
    format!("00-{SENDER_TRACE}-{SENDER_SPAN}-01")
}

/// A binary-mode CloudEvent to `envoy`, with `trace` (traceparent, tracestate) if given,
/// sent on `client` (one connection: one worker).
fn send_event(client: &Client, envoy: &Envoy, trace: Option<(&str, &str)>) -> Reply {
    let mut request = client
        .post(&envoy.url("/"))
        .header("content-type", "application/json")
        .header("ce-specversion", "1.0")
        .header("ce-id", "order-1")
        .header("ce-source", "/shop")
        .header("ce-type", "order.created")
        .header("ce-subject", "42");
    if let Some((traceparent, tracestate)) = trace {
        request = request
            .header("traceparent", traceparent)
            .header("tracestate", tracestate);
    }
    let reply = send(request.body("{\"order\":1}"));
    reply.assert_not_tripwire();
    reply
}

/// The attempt span `request` names in its one `traceparent` (`00-<trace>-<span>-01`): a
/// CLIENT span of `tree`, which is `trace`; with the sender's `tracestate` when `state`.
fn attempt_of<'t>(
    tree: &'t SpanTree,
    request: &Recorded,
    trace: &str,
    state: Option<&str>,
) -> &'t ReceivedSpan {
    let traceparents = request.header_all("traceparent");
    assert_eq!(traceparents.len(), 1, "one traceparent: {request:#?}");
    let parts: Vec<&str> = traceparents[0].split('-').collect();
    assert_eq!(parts.len(), 4, "{traceparents:?}");
    assert_eq!((parts[0], parts[1], parts[3]), ("00", trace, "01"));
    assert_eq!(
        request.header_all("tracestate"),
        state.into_iter().collect::<Vec<_>>()
    );
    let span = tree
        .by_id(parts[2])
        .unwrap_or_else(|| panic!("{} names no exported span", traceparents[0]));
    assert_eq!(
        (span.name.as_str(), span.kind.as_str()),
        ("POST", "SPAN_KIND_CLIENT")
    );
    span
}

fn int(span: &ReceivedSpan, key: &str) -> Option<i64> {
    span.attr(key).and_then(Value::as_i64)
}

/// What most tests here run: the receiver, a subscriber `billing` that takes every event,
/// and one Envoy worker whose fanout sends each event to it, with `tracing` as given (its
/// collector the receiver, as cluster `otel`). Bound as `receiver, billing, envoy`, Envoy
/// stops first.
struct ToBilling {
    receiver: OtlpReceiver,
    billing: Subscriber,
    envoy: Envoy,
}

fn to_billing(tracing: Value) -> ToBilling {
    let receiver = OtlpReceiver::start();
    let billing = Subscriber::ok("billing");
    let config = json!({"subscribers": [{"cluster": "billing"}], "tracing": tracing});
    let envoy = Envoy::builder()
        .fanout(&config)
        .subscribers(&[&billing])
        .cluster("otel", receiver.port())
        .concurrency(1)
        .start();
    ToBilling {
        receiver,
        billing,
        envoy,
    }
}

/// A port nothing listens on (bound, then closed).
fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    listener.local_addr().expect("its address").port()
}

/// One event, two subscribers: `billing` answers 503 with `Retry-After: 1`, then takes the
/// event on its retry and answers with a reply event, passed on to `replies`; `shipping`
/// fails for good and the event goes to its dead-letter target `dlq`. Everything fanout did
/// arrives as one tree in the sender's trace, and each call carried its own attempt's span.
#[test]
fn one_events_trace_through_envoy_arrives_whole_at_the_receiver() {
    let receiver = OtlpReceiver::start();
    let billing = Subscriber::start(
        "billing",
        Behavior::Sequence(vec![
            Behavior::respond(503, &[("retry-after", "1")], "busy"),
            Behavior::respond(
                200,
                &[
                    ("content-type", "application/json"),
                    ("ce-specversion", "1.0"),
                    ("ce-id", "bill-1"),
                    ("ce-source", "/billing"),
                    ("ce-type", "order.billed"),
                ],
                "{\"billed\":true}",
            ),
        ]),
    );
    let shipping = Subscriber::start("shipping", Behavior::Status(503));
    let replies = Subscriber::ok("replies");
    let dlq = Subscriber::ok("dlq");
    let config = json!({
        "channels": [{"name": "default/orders", "subscribers": [
            {"cluster": "billing", "path": "/events",
             "delivery": {"retry": 2, "backoff_delay_ms": 50},
             "reply": {"cluster": "replies"}},
            {"cluster": "shipping",
             "delivery": {"retry": 1, "backoff_delay_ms": 50,
                          "dead_letter": {"cluster": "dlq", "path": "/dead"}}}
        ]}],
        "tracing": {"collector": {"cluster": "otel"},
                    "resource": {"deployment.environment": "e2e"}}
    });
    let envoy = Envoy::builder()
        .fanout(&config)
        .subscribers(&[&billing, &shipping, &replies, &dlq])
        .cluster("otel", receiver.port())
        .start();
    let answer = send_event(&Client::http1(), &envoy, Some((&sampled(), SENDER_STATE)));
    assert_eq!(answer.status, 202, "{}", answer.text());
    assert_eq!(
        answer.header("x-fanout-dead-lettered").as_deref(),
        Some("1")
    );

    let tree = receiver.wait_for_trace(SENDER_TRACE, 11, ARRIVAL);
    if let Some(path) = std::env::var_os("FANOUT_TRACE_SPANS_OUT") {
        std::fs::copy(receiver.spans_file(), path).expect("copy the spans for the picture");
    }
    assert_eq!(tree.spans.len(), 11, "{:#?}", tree.spans);
    assert_eq!(
        receiver.spans().len(),
        11,
        "nothing outside the sender's trace"
    );
    tree.assert_nested();
    for span in &tree.spans {
        assert_eq!(span.trace_state, SENDER_STATE, "{span:#?}");
        assert_eq!(span.resource["service.name"], "fanout");
        assert_eq!(span.resource["deployment.environment"], "e2e");
    }

    let request = tree.root();
    assert_eq!(request.name, "fanout default/orders");
    assert_eq!(request.kind, "SPAN_KIND_SERVER");
    assert_eq!(
        request.parent_span_id, SENDER_SPAN,
        "a child of the sender's span"
    );
    for (key, value) in [
        ("messaging.destination.name", "default/orders"),
        ("kn.channel.namespace", "default"),
        ("kn.channel.name", "orders"),
        ("http.request.method", "POST"),
        ("cloudevents.event_id", "order-1"),
        ("cloudevents.source", "/shop"),
        ("cloudevents.type", "order.created"),
        ("cloudevents.subject", "42"),
        ("cloudevents.specversion", "1.0"),
    ] {
        assert_eq!(request.attr(key), Some(&json!(value)), "{key}");
    }
    assert_eq!(int(request, "http.response.status_code"), Some(202));
    assert_eq!(int(request, "fanout.subscribers"), Some(2));
    assert_eq!(int(request, "fanout.subscribers.failed"), Some(0));
    assert_eq!(int(request, "fanout.subscribers.dead_lettered"), Some(1));
    assert_eq!(request.status, "STATUS_CODE_UNSET");
    // Both deliveries start with the request's calls, at the same time.
    let mut sends = tree.names_under(request);
    sends.sort_unstable();
    assert_eq!(sends, ["send billing", "send shipping"]);

    // billing: a 503 with Retry-After, the retry a second later, then its reply.
    let send_billing = tree.named("send billing");
    assert_eq!(send_billing.kind, "SPAN_KIND_PRODUCER");
    assert_eq!(
        send_billing.attr("messaging.destination.name"),
        Some(&json!("billing"))
    );
    assert_eq!(send_billing.attr("server.address"), Some(&json!("billing")));
    assert_eq!(send_billing.attr("url.path"), Some(&json!("/events")));
    assert_eq!(
        send_billing.attr("cloudevents.type"),
        Some(&json!("order.created"))
    );
    assert_eq!(int(send_billing, "fanout.attempts"), Some(2));
    assert_eq!(
        send_billing.attr("fanout.dead_lettered"),
        Some(&json!(false))
    );
    assert_eq!(send_billing.status, "STATUS_CODE_UNSET");
    assert_eq!(
        tree.names_under(send_billing),
        ["POST", "POST", "reply replies"]
    );
    let attempts = tree.children(send_billing);
    let (busy, took) = (attempts[0], attempts[1]);
    assert_eq!(int(busy, "http.response.status_code"), Some(503));
    assert_eq!(busy.status, "STATUS_CODE_ERROR");
    assert_eq!(busy.attr("error.type"), Some(&json!("503")));
    assert_eq!(busy.attr("http.request.resend_count"), None);
    assert_eq!(busy.attr("fanout.backoff_ms"), None);
    assert_eq!(int(took, "http.response.status_code"), Some(200));
    assert_eq!(took.status, "STATUS_CODE_UNSET");
    assert_eq!(int(took, "http.request.resend_count"), Some(1));
    assert_eq!(int(took, "fanout.retry_after_ms"), Some(1000));
    let waited = int(took, "fanout.backoff_ms").expect("the wait before the retry");
    assert!(waited >= 900, "Retry-After: 1 honoured, waited {waited} ms");
    let reply = tree.named("reply replies");
    assert_eq!(reply.kind, "SPAN_KIND_PRODUCER");
    assert_eq!(
        reply.attr("messaging.destination.name"),
        Some(&json!("replies"))
    );
    assert_eq!(int(reply, "fanout.attempts"), Some(1));
    assert_eq!(reply.status, "STATUS_CODE_UNSET");
    let reply_attempts = tree.children(reply);
    assert_eq!(reply_attempts.len(), 1);
    assert_eq!(
        int(reply_attempts[0], "http.response.status_code"),
        Some(200)
    );

    // shipping: two 503s, then the dead letter.
    let send_shipping = tree.named("send shipping");
    assert_eq!(send_shipping.kind, "SPAN_KIND_PRODUCER");
    assert_eq!(int(send_shipping, "fanout.attempts"), Some(2));
    assert_eq!(
        send_shipping.attr("fanout.dead_lettered"),
        Some(&json!(true))
    );
    assert_eq!(send_shipping.status, "STATUS_CODE_ERROR");
    assert_eq!(
        send_shipping.attr("error.type"),
        Some(&json!("delivery_failed"))
    );
    assert!(
        send_shipping.status_message.contains("503"),
        "{:?}",
        send_shipping.status_message
    );
    assert_eq!(
        tree.names_under(send_shipping),
        ["POST", "POST", "dead letter dlq"]
    );
    let failures = tree.children(send_shipping);
    for (resend, attempt) in failures[..2].iter().enumerate() {
        assert_eq!(int(attempt, "http.response.status_code"), Some(503));
        assert_eq!(attempt.status, "STATUS_CODE_ERROR");
        assert_eq!(attempt.attr("error.type"), Some(&json!("503")));
        assert_eq!(attempt.attr("fanout.retry_after_ms"), None);
        let resend = i64::try_from(resend).unwrap();
        assert_eq!(
            int(attempt, "http.request.resend_count"),
            Some(resend).filter(|n| *n > 0)
        );
    }
    assert!(int(failures[1], "fanout.backoff_ms").is_some_and(|ms| ms >= 40));
    let dead = tree.named("dead letter dlq");
    assert_eq!(dead.kind, "SPAN_KIND_PRODUCER");
    assert_eq!(dead.attr("messaging.destination.name"), Some(&json!("dlq")));
    assert_eq!(dead.attr("url.path"), Some(&json!("/dead")));
    assert_eq!(int(dead, "fanout.attempts"), Some(1));
    assert_eq!(dead.status, "STATUS_CODE_UNSET");
    let dead_attempts = tree.children(dead);
    assert_eq!(dead_attempts.len(), 1);
    assert_eq!(
        int(dead_attempts[0], "http.response.status_code"),
        Some(200)
    );

    // What each target received names the attempt span that was exported for it.
    let named_by = |sub: &Subscriber| -> Vec<&ReceivedSpan> {
        sub.requests()
            .iter()
            .map(|r| attempt_of(&tree, r, SENDER_TRACE, Some(SENDER_STATE)))
            .collect()
    };
    assert_eq!(named_by(&billing), [busy, took]);
    assert_eq!(named_by(&shipping), failures[..2]);
    assert_eq!(named_by(&replies), reply_attempts);
    assert_eq!(named_by(&dlq), dead_attempts);

    for export in receiver.exports() {
        assert_eq!(export["path"], "/v1/traces");
        assert_eq!(export["content_type"], "application/x-protobuf");
        assert_eq!(export["authority"], "otel");
    }
}

/// Without a `traceparent`, `sampling_ratio: 1.0` starts a new trace whose root is the
/// request's span; a sender that did not sample keeps its context, unchanged, and nothing is
/// made of its request.
#[test]
fn a_request_without_traceparent_starts_a_trace_at_ratio_one() {
    let ToBilling {
        receiver,
        billing,
        envoy,
    } = to_billing(json!({"collector": {"cluster": "otel"}, "sampling_ratio": 1.0}));
    let client = Client::http1();
    let unsampled = format!("00-{SENDER_TRACE}-{SENDER_SPAN}-00");
    assert_eq!(
        send_event(&client, &envoy, Some((&unsampled, SENDER_STATE))).status,
        202
    );
    assert_eq!(send_event(&client, &envoy, None).status, 202);

    let requests = billing.requests();
    assert_eq!(requests[0].header_all("traceparent"), [unsampled.as_str()]);
    assert_eq!(requests[0].header_all("tracestate"), [SENDER_STATE]);
    let traceparent = requests[1]
        .header("traceparent")
        .expect("a new trace's context");
    let trace = traceparent
        .split('-')
        .nth(1)
        .expect("a trace id")
        .to_string();
    assert_ne!(trace, SENDER_TRACE);
    let tree = receiver.wait_for_trace(&trace, 3, ARRIVAL);
    let root = tree.root();
    assert_eq!(root.name, "fanout default");
    assert_eq!(root.parent_span_id, "", "the root of its trace");
    assert_eq!(root.trace_state, "");
    assert_eq!(int(root, "http.response.status_code"), Some(202));
    assert_eq!(tree.names_under(root), ["send billing"]);
    let attempt = attempt_of(&tree, &requests[1], &trace, None);
    assert_eq!(attempt.parent_span_id, tree.named("send billing").span_id);
    tree.assert_nested();
    // The same worker exported both requests' spans in order: the unsampled one made none.
    assert!(
        receiver.spans().iter().all(|s| s.trace_id == trace),
        "{:#?}",
        receiver.spans()
    );
}

/// At the default ratio (0), a request without `traceparent` is not traced: its call carries
/// none, and nothing is exported for it; a sampled sender's request on the same connection
/// (the same worker, whose exporter keeps their order) is.
#[test]
fn at_the_default_ratio_only_sampled_senders_are_traced() {
    let ToBilling {
        receiver,
        billing,
        envoy,
    } = to_billing(json!({"collector": {"cluster": "otel"}}));
    let client = Client::http1();
    assert_eq!(send_event(&client, &envoy, None).status, 202);
    assert_eq!(
        send_event(&client, &envoy, Some((&sampled(), SENDER_STATE))).status,
        202
    );
    let requests = billing.requests();
    assert_eq!(requests[0].header("traceparent"), None);
    assert_eq!(requests[0].header("tracestate"), None);
    let tree = receiver.wait_for_trace(SENDER_TRACE, 3, ARRIVAL);
    attempt_of(&tree, &requests[1], SENDER_TRACE, Some(SENDER_STATE));
    assert_eq!(receiver.spans().len(), 3, "{:#?}", receiver.spans());
}

/// Async mode answers 202 at once and retries after it: the request's span covers the
/// retry, and both attempts are in the sender's trace.
#[test]
fn async_deliveries_are_traced_past_the_answer() {
    let receiver = OtlpReceiver::start();
    let flaky = Subscriber::start(
        "flaky",
        Behavior::Sequence(vec![Behavior::Status(503), Behavior::Status(200)]),
    );
    let config = json!({
        "mode": "async",
        "delivery": {"retry": 2, "backoff_delay_ms": 300},
        "channels": [{"name": "default/orders", "subscribers": [{"cluster": "flaky"}]}],
        "tracing": {"collector": {"cluster": "otel"}}
    });
    let envoy = Envoy::builder()
        .fanout(&config)
        .subscribers(&[&flaky])
        .cluster("otel", receiver.port())
        .start();
    let answer = send_event(&Client::http1(), &envoy, Some((&sampled(), SENDER_STATE)));
    assert_eq!(answer.status, 202, "{}", answer.text());

    let tree = receiver.wait_for_trace(SENDER_TRACE, 4, ARRIVAL);
    assert_eq!(tree.spans.len(), 4, "{:#?}", tree.spans);
    tree.assert_nested();
    let request = tree.root();
    assert_eq!(request.name, "fanout default/orders");
    assert_eq!(request.parent_span_id, SENDER_SPAN);
    assert_eq!(int(request, "http.response.status_code"), Some(202));
    assert_eq!(request.status, "STATUS_CODE_UNSET");
    let send = tree.named("send flaky");
    assert_eq!(send.parent_span_id, request.span_id);
    assert_eq!(int(send, "fanout.attempts"), Some(2));
    assert_eq!(send.status, "STATUS_CODE_UNSET");
    let attempts = tree.children(send);
    assert_eq!(attempts.len(), 2);
    assert_eq!(int(attempts[0], "http.response.status_code"), Some(503));
    assert_eq!(int(attempts[1], "http.response.status_code"), Some(200));
    assert!(int(attempts[1], "fanout.backoff_ms").is_some_and(|ms| ms >= 250));
    assert!(
        request.end_ns >= attempts[1].end_ns,
        "the request's span ends after the retry"
    );
    let named: Vec<&ReceivedSpan> = flaky
        .requests()
        .iter()
        .map(|r| attempt_of(&tree, r, SENDER_TRACE, Some(SENDER_STATE)))
        .collect();
    assert_eq!(named, attempts);
}

/// A collector that is down costs the spans and nothing else: requests are answered as
/// usual, and the spans lost are counted in Envoy's stats.
#[test]
fn a_collector_that_is_down_costs_only_the_spans_counted() {
    let billing = Subscriber::ok("billing");
    let config = json!({
        "subscribers": [{"cluster": "billing"}],
        "tracing": {"collector": {"cluster": "otel", "timeout_ms": 1000}}
    });
    let envoy = Envoy::builder()
        .fanout(&config)
        .subscribers(&[&billing])
        .cluster("otel", closed_port())
        .concurrency(1)
        .start();
    let client = Client::http1();
    let answer = send_event(&client, &envoy, Some((&sampled(), SENDER_STATE)));
    assert_eq!(answer.status, 202, "{}", answer.text());
    // Request, delivery, attempt: three spans, lost with their export.
    let dropped = envoy.expect_stat(
        "wasmcustom.fanout.tracing.spans_dropped",
        |n| n >= 3,
        ARRIVAL,
    );
    assert_eq!(dropped, 3);
    let again = send_event(&client, &envoy, Some((&sampled(), SENDER_STATE)));
    assert_eq!(again.status, 202, "{}", again.text());
    assert_eq!(billing.count(), 2);
    envoy.expect_stat(
        "wasmcustom.fanout.tracing.spans_dropped",
        |n| n >= 6,
        ARRIVAL,
    );
}

/// The collector needs nothing of Envoy but a plain HTTP/1.1 cluster; the export goes to
/// the path and authority configured, with the configured headers (a collector's API key).
#[test]
fn the_export_crosses_a_plain_http1_cluster_as_configured() {
    let ToBilling {
        receiver,
        billing: _billing,
        envoy,
    } = to_billing(
        json!({"collector": {"cluster": "otel", "authority": "collector.example",
                                  "path": "/otlp/v1/traces", "headers": {"x-api-key": "k"}}}),
    );
    let answer = send_event(&Client::http1(), &envoy, Some((&sampled(), SENDER_STATE)));
    assert_eq!(answer.status, 202, "{}", answer.text());
    let tree = receiver.wait_for_trace(SENDER_TRACE, 3, ARRIVAL);
    assert_eq!(tree.root().name, "fanout default");
    let exports = receiver.exports();
    assert!(!exports.is_empty());
    for export in exports {
        assert_eq!(export["path"], "/otlp/v1/traces");
        assert_eq!(export["authority"], "collector.example");
        assert_eq!(export["content_type"], "application/x-protobuf");
        assert_eq!(export["headers"]["x-api-key"], "k");
    }
}

#[test]
fn the_receiver_refuses_what_is_not_otlp_protobuf() {
    // The receiver is strict, so the tests above would fail on a wrong content type or a
    // body that does not decode.
    let receiver = OtlpReceiver::start();
    let url = format!("http://127.0.0.1:{}/v1/traces", receiver.port());
    let client = reqwest::blocking::Client::new();
    let json = client
        .post(&url)
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .unwrap();
    assert_eq!(json.status(), 415);
    let garbage = client
        .post(&url)
        .header("content-type", "application/x-protobuf")
        .body(vec![0x0a, 0xff, 0xff])
        .send()
        .unwrap();
    assert_eq!(garbage.status(), 400);
    assert!(receiver.spans().is_empty());
}

/// A sender that gives up before the answer: the request's span ends with 499 (no answer was
/// sent), and is no error of fanout's.
#[test]
fn a_sender_that_went_away_ends_its_span_with_499() {
    let receiver = OtlpReceiver::start();
    let slow = Subscriber::start("slow", Behavior::Delay(Duration::from_secs(5), 200));
    let config = json!({
        "subscribers": [{"cluster": "slow"}],
        "tracing": {"collector": {"cluster": "otel"}}
    });
    let envoy = Envoy::builder()
        .fanout(&config)
        .subscribers(&[&slow])
        .cluster("otel", receiver.port())
        .start();
    let gave_up = Client::http1()
        .post(&envoy.url("/"))
        .header("traceparent", sampled())
        .header("tracestate", SENDER_STATE)
        .timeout(Duration::from_secs(1))
        .body("{\"order\":1}")
        .send();
    assert!(gave_up.is_err(), "{gave_up:?}");
    let tree = receiver.wait_for_trace(SENDER_TRACE, 3, ARRIVAL);
    assert_eq!(tree.spans.len(), 3, "{:#?}", tree.spans);
    tree.assert_nested();
    let request = tree.root();
    assert_eq!(request.parent_span_id, SENDER_SPAN);
    assert_eq!(int(request, "http.response.status_code"), Some(499));
    assert_eq!(request.status, "STATUS_CODE_UNSET");
    let send = tree.named("send slow");
    assert_eq!(
        send.status, "STATUS_CODE_ERROR",
        "the event was not delivered"
    );
    // The call went with its request: it ends without an answer, as an error.
    let attempt = attempt_of(
        &tree,
        &slow.only_request(),
        SENDER_TRACE,
        Some(SENDER_STATE),
    );
    assert_eq!(attempt.parent_span_id, send.span_id);
    assert_eq!(attempt.attr("http.response.status_code"), None);
    assert_eq!(attempt.status, "STATUS_CODE_ERROR");
}

/// A structured event's attributes are read from its body, for the request's span and the
/// deliveries'.
#[test]
fn a_structured_events_attributes_come_from_its_body() {
    let ToBilling {
        receiver,
        billing: _billing,
        envoy,
    } = to_billing(json!({"collector": {"cluster": "otel"}}));
    let event = json!({"specversion": "1.0", "id": "order-2", "source": "/shop",
                       "type": "order.paid", "subject": "43", "data": {"order": 2}});
    let answer = send(
        Client::http1()
            .post(&envoy.url("/"))
            .header("content-type", "application/cloudevents+json")
            .header("traceparent", sampled())
            .body(event.to_string()),
    );
    assert_eq!(answer.status, 202, "{}", answer.text());
    let tree = receiver.wait_for_trace(SENDER_TRACE, 3, ARRIVAL);
    for span in [tree.root(), tree.named("send billing")] {
        for (key, value) in [
            ("cloudevents.event_id", "order-2"),
            ("cloudevents.source", "/shop"),
            ("cloudevents.type", "order.paid"),
            ("cloudevents.subject", "43"),
            ("cloudevents.specversion", "1.0"),
        ] {
            assert_eq!(span.attr(key), Some(&json!(value)), "{}: {key}", span.name);
        }
    }
}
