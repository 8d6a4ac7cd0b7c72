//! Traces: what fanout's exporter sends, decoded by a real OTLP receiver built on the
//! official protos (`harness::otlp`). The exporter's body and request line come from the
//! pure core (`fanout::trace`) and the configuration (`tracing`) exactly as the filter will
//! make them; the request pipeline does not make spans yet, so these tests drive the core
//! the way it will: one event, a subscriber retried once and answering with a reply, a
//! subscriber that times out three times and is dead-lettered.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fanout::config::Config;
use fanout::trace::export::Exporter;
use fanout::trace::{
    DeliveryOutcome, Destination, EventAttributes, Leg, OpenSpan, Tracer, Verdict,
};
use serde_json::json;

use crate::harness::otlp::{OtlpReceiver, SpanTree};
use crate::harness::{assert_202_empty, send, Client, Envoy};

const SENDER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const SENDER_SPAN: &str = "00f067aa0ba902b7";
const MS: u64 = 1_000_000;

/// The spans of one event as the pipeline will make them, with the `traceparent` each
/// attempt's call carries, by the attempt's span id.
struct Event {
    tracer: Tracer,
    spans: Vec<fanout::trace::otlp::Span>,
    traceparents: BTreeMap<String, String>,
}

impl Event {
    fn attempt(
        &mut self,
        leg: &OpenSpan,
        resend: u32,
        backoff_ms: u64,
        (start, end): (u64, u64),
        status: Option<u16>,
        error: Option<&str>,
    ) {
        let span = leg.attempt(self.tracer.span_id(), resend, backoff_ms, None, start);
        let mut id = String::new();
        fanout::trace::context::push_hex(&mut id, &span.span_id());
        self.traceparents.insert(id, span.traceparent());
        self.spans.push(span.end_attempt(status, error, end));
    }
}

fn one_event(t0: u64) -> Event {
    let mut event = Event {
        tracer: Tracer::new(0.0, 7),
        spans: Vec::new(),
        traceparents: BTreeMap::new(),
    };
    let attrs = EventAttributes {
        id: Some("order-1"),
        source: Some("/shop"),
        event_type: Some("order.created"),
        subject: Some("42"),
        spec_version: Some("1.0"),
    };
    let traceparent = format!("00-{SENDER_TRACE}-{SENDER_SPAN}-01");
    let request = event
        .tracer
        .request(
            Some(traceparent.as_bytes()),
            Some(b"congo=t61rcWkgMzE"),
            "default/orders",
            "POST",
            &attrs,
            t0,
        )
        .expect("the sender sampled it");
    let at = |ms: f64| t0 + (ms * MS as f64) as u64;

    let billing = Destination {
        cluster: "billing",
        authority: "billing.default.svc",
        path: "/events",
    };
    let send = request.leg(
        event.tracer.span_id(),
        Leg::Delivery,
        &billing,
        &attrs,
        at(0.2),
    );
    event.attempt(
        &send,
        0,
        0,
        (at(0.3), at(2.1)),
        Some(503),
        Some("status 503"),
    );
    event.attempt(&send, 1, 100, (at(102.1), at(104.0)), Some(200), None);
    let replies = Destination {
        cluster: "replies",
        authority: "replies",
        path: "/",
    };
    let reply = send.leg(
        event.tracer.span_id(),
        Leg::Reply,
        &replies,
        &attrs,
        at(104.1),
    );
    event.attempt(&reply, 0, 0, (at(104.2), at(105.9)), Some(202), None);
    let delivered = DeliveryOutcome {
        attempts: 1,
        delivered: true,
        dead_lettered: false,
        error: None,
    };
    event.spans.push(reply.end_leg(&delivered, at(106.0)));
    let billing_done = DeliveryOutcome {
        attempts: 2,
        ..delivered
    };
    event.spans.push(send.end_leg(&billing_done, at(106.0)));

    let shipping = Destination {
        cluster: "shipping",
        authority: "shipping",
        path: "/",
    };
    let send = request.leg(
        event.tracer.span_id(),
        Leg::Delivery,
        &shipping,
        &attrs,
        at(0.2),
    );
    let timeouts = [(0, 0.3), (50, 300.4), (100, 650.5)];
    for (resend, (backoff, start)) in timeouts.into_iter().enumerate() {
        let window = (at(start), at(start + 250.0));
        event.attempt(
            &send,
            resend as u32,
            backoff,
            window,
            Some(504),
            Some("timeout"),
        );
    }
    let dlq = Destination {
        cluster: "dlq",
        authority: "dlq",
        path: "/dead",
    };
    let dead = send.leg(
        event.tracer.span_id(),
        Leg::DeadLetter,
        &dlq,
        &attrs,
        at(900.6),
    );
    event.attempt(&dead, 0, 0, (at(900.7), at(902.8)), Some(200), None);
    event.spans.push(dead.end_leg(&delivered, at(903.0)));
    let failed = DeliveryOutcome {
        attempts: 3,
        delivered: false,
        dead_lettered: true,
        error: Some("timeout"),
    };
    event.spans.push(send.end_leg(&failed, at(903.0)));

    let verdict = Verdict {
        status: 202,
        subscribers: 2,
        failed: 0,
        dead_lettered: 1,
    };
    event.spans.push(request.end_request(&verdict, at(903.5)));
    event
}

/// The one export the exporter makes of `spans` with the `tracing` of `config`: nothing
/// dropped, one batch.
fn export_of(
    config: &serde_json::Value,
    spans: Vec<fanout::trace::otlp::Span>,
) -> fanout::trace::export::Export {
    let config = Config::from_json(config.to_string().as_bytes()).expect("a valid config");
    let mut exporter = Exporter::new(config.tracing.expect("tracing on").export);
    for span in spans {
        exporter.record(span, 0);
    }
    let export = exporter.tick(0, true).expect("one export");
    assert_eq!(exporter.queued(), 0, "one batch");
    assert_eq!(exporter.take_dropped(), 0);
    export
}

/// What the exporter sends for `spans` with the `tracing` of `config`, POSTed to the
/// receiver as the filter's call will be (its request line, headers and body).
fn export_to(
    receiver: &OtlpReceiver,
    config: serde_json::Value,
    spans: Vec<fanout::trace::otlp::Span>,
) {
    let export = export_of(&config, spans);
    assert_eq!(export.cluster, "otel");
    let header = |name: &str| {
        export
            .headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
            .expect(name)
    };
    assert_eq!(header(":method"), "POST");
    let client = reqwest::blocking::Client::new();
    let mut request = client.post(format!(
        "http://127.0.0.1:{}{}",
        receiver.port(),
        header(":path")
    ));
    for (name, value) in export.headers.iter().filter(|(n, _)| !n.starts_with(':')) {
        request = request.header(name, value);
    }
    let answer = request
        .body(export.body.clone())
        .send()
        .expect("the receiver answers");
    assert_eq!(answer.status(), 200, "{:?}", answer.text());
}

fn tracing_config() -> serde_json::Value {
    json!({
        "subscribers": [{"cluster": "billing"}],
        "tracing": {"collector": {"cluster": "otel", "headers": {"x-api-key": "k"}},
                    "resource": {"deployment.environment": "e2e"}}
    })
}

#[test]
fn one_events_trace_arrives_as_a_tree_the_official_protos_decode() {
    let receiver = OtlpReceiver::start();
    let t0 = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let event = one_event(t0);
    export_to(&receiver, tracing_config(), event.spans);
    let spans = receiver.wait_for_spans(12, Duration::from_secs(10));
    assert_eq!(spans.len(), 12, "{spans:#?}");
    let exports = receiver.exports();
    assert_eq!(exports.len(), 1);
    assert_eq!(exports[0]["path"], "/v1/traces");
    assert_eq!(exports[0]["content_type"], "application/x-protobuf");
    if let Some(path) = std::env::var_os("FANOUT_TRACE_SPANS_OUT") {
        std::fs::copy(receiver.spans_file(), path).expect("copy the spans for the picture");
    }

    let tree = SpanTree::of(&spans, SENDER_TRACE);
    assert_eq!(tree.spans.len(), 12, "every span is in the sender's trace");
    let request = tree.root();
    assert_eq!(request.name, "fanout default/orders");
    assert_eq!(request.kind, "SPAN_KIND_SERVER");
    assert_eq!(
        request.parent_span_id, SENDER_SPAN,
        "a child of the sender's span"
    );
    assert_eq!(request.trace_state, "congo=t61rcWkgMzE");
    assert_eq!(request.resource["service.name"], "fanout");
    assert_eq!(request.resource["deployment.environment"], "e2e");
    assert_eq!(
        request.attr("kn.channel.namespace"),
        Some(&json!("default"))
    );
    assert_eq!(request.attr("kn.channel.name"), Some(&json!("orders")));
    assert_eq!(
        request.attr("cloudevents.type"),
        Some(&json!("order.created"))
    );
    assert_eq!(request.attr("http.response.status_code"), Some(&json!(202)));
    assert_eq!(
        request.attr("fanout.subscribers.dead_lettered"),
        Some(&json!(1))
    );
    assert_eq!(request.status, "STATUS_CODE_UNSET");

    let sends: Vec<&str> = tree
        .children(request)
        .iter()
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(sends, ["send billing", "send shipping"]);

    let billing = tree.named("send billing");
    assert_eq!(billing.kind, "SPAN_KIND_PRODUCER");
    assert_eq!(
        billing.attr("messaging.destination.name"),
        Some(&json!("billing"))
    );
    assert_eq!(
        billing.attr("server.address"),
        Some(&json!("billing.default.svc"))
    );
    assert_eq!(billing.attr("fanout.attempts"), Some(&json!(2)));
    assert_eq!(billing.status, "STATUS_CODE_UNSET");
    let under: Vec<&str> = tree
        .children(billing)
        .iter()
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(
        under,
        ["POST", "POST", "reply replies"],
        "the attempts, then the reply"
    );
    let attempts = tree.children(billing);
    assert_eq!(attempts[0].kind, "SPAN_KIND_CLIENT");
    assert_eq!(
        attempts[0].attr("http.response.status_code"),
        Some(&json!(503))
    );
    assert_eq!(attempts[0].status, "STATUS_CODE_ERROR");
    assert_eq!(attempts[0].attr("http.request.resend_count"), None);
    assert_eq!(
        attempts[1].attr("http.request.resend_count"),
        Some(&json!(1))
    );
    assert_eq!(attempts[1].attr("fanout.backoff_ms"), Some(&json!(100)));
    assert_eq!(attempts[1].status, "STATUS_CODE_UNSET");
    let reply = tree.named("reply replies");
    assert_eq!(tree.children(reply).len(), 1, "the reply's attempt");

    let shipping = tree.named("send shipping");
    assert_eq!(shipping.status, "STATUS_CODE_ERROR");
    assert_eq!(shipping.status_message, "timeout");
    assert_eq!(shipping.attr("fanout.dead_lettered"), Some(&json!(true)));
    let under = tree.children(shipping);
    let names: Vec<&str> = under.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["POST", "POST", "POST", "dead letter dlq"]);
    assert!(under[..3]
        .iter()
        .all(|a| a.attr("error.type") == Some(&json!("504"))));
    let dead = tree.named("dead letter dlq");
    assert_eq!(dead.attr("url.path"), Some(&json!("/dead")));
    assert_eq!(
        tree.children(dead)[0].attr("http.response.status_code"),
        Some(&json!(200))
    );

    // Each call's traceparent names its own attempt span, in the sender's trace, sampled;
    // the sender's tracestate goes with it.
    let calls: Vec<_> = tree
        .spans
        .iter()
        .filter(|s| s.kind == "SPAN_KIND_CLIENT")
        .collect();
    assert_eq!(calls.len(), 7);
    for call in calls {
        assert_eq!(
            event.traceparents[&call.span_id],
            format!("00-{SENDER_TRACE}-{}-01", call.span_id)
        );
        assert_eq!(call.trace_state, "congo=t61rcWkgMzE");
    }
    // Times are nanoseconds since the epoch, children inside their parents.
    for span in &tree.spans {
        assert!(
            span.start_ns >= t0 && span.end_ns >= span.start_ns,
            "{span:?}"
        );
        if let Some(parent) = tree.spans.iter().find(|p| p.span_id == span.parent_span_id) {
            assert!(
                parent.start_ns <= span.start_ns && span.end_ns <= parent.end_ns,
                "{span:?} in {parent:?}"
            );
        }
    }
}

#[test]
fn the_receiver_refuses_what_is_not_otlp_protobuf() {
    // The receiver is strict, so the test above would fail on a wrong content type or a body
    // that does not decode.
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

/// The collector needs nothing of Envoy but a plain HTTP/1.1 cluster: an export's body,
/// carried by the filter's own `dispatch_http_call` (as a subscriber call: the pipeline does
/// not export yet) through the real Envoy to the receiver, decodes whole there.
#[test]
fn an_export_crosses_a_plain_http1_cluster_from_the_filter() {
    let receiver = OtlpReceiver::start();
    let config = json!({
        "subscribers": [{"cluster": "otel", "path": "/v1/traces"}],
        "tracing": {"collector": {"cluster": "otel"}}
    });
    let t0 = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let export = export_of(&config, one_event(t0).spans);
    let envoy = Envoy::with_clusters(&config, &[("otel", receiver.port())]);
    let content_type = export
        .headers
        .iter()
        .find(|(n, _)| n == "content-type")
        .unwrap();
    assert_eq!(content_type.1, "application/x-protobuf");
    let request = Client::http1()
        .post(&envoy.url("/"))
        .header("content-type", &content_type.1)
        .body(export.body.clone());
    assert_202_empty(&send(request));
    let spans = receiver.wait_for_spans(12, Duration::from_secs(10));
    assert_eq!(spans.len(), 12);
    let exports = receiver.exports();
    assert_eq!(exports[0]["path"], "/v1/traces");
    assert_eq!(exports[0]["authority"], "otel");
    assert_eq!(
        SpanTree::of(&spans, SENDER_TRACE).root().name,
        "fanout default/orders"
    );
}
