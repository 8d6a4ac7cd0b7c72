//! `tracing`: the spans of a fan-out, the trace context each call carries, and the export
//! from the root context's timer.

use super::*;
use crate::protowire::Message;
use crate::trace::otlp::{self, ExportTraceServiceRequest};

const SENDER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const SENDER: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// `a` is retried once, `b` fails into its dead letter, `c` answers with a reply.
const TRACED: &str = r#"{
  "tracing": {"collector": {"cluster": "otel"}, "sampling_ratio": 1.0,
              "max_batch_delay_ms": 5000},
  "forward_headers": ["traceparent", "tracestate", "ce-*"],
  "subscribers": [
    {"cluster": "a", "delivery": {"retry": 1, "backoff_delay_ms": 100}},
    {"cluster": "b", "delivery": {"dead_letter": {"cluster": "dlq"}}},
    {"cluster": "c", "reply": {"cluster": "replies"}}
  ]
}"#;

/// A binary reply event's headers, as subscriber `c` answers.
const REPLY: &[(&str, &str)] = &[
    ("ce-specversion", "1.0"),
    ("ce-id", "r-1"),
    ("ce-source", "/c"),
    ("ce-type", "reply"),
];

fn traced_request() -> Vec<(&'static str, &'static str)> {
    let mut headers = post("x");
    headers.extend([
        ("traceparent", SENDER),
        ("tracestate", "congo=t61"),
        ("ce-specversion", "1.0"),
        ("ce-id", "e-1"),
        ("ce-source", "/orders"),
        ("ce-type", "order.created"),
    ]);
    headers
}

fn exported(plugin: &FakeEnvoy) -> Vec<otlp::Span> {
    plugin
        .state()
        .dispatched
        .iter()
        .filter(|call| call.cluster == "otel")
        .flat_map(|call| {
            let request = ExportTraceServiceRequest::decode(call.body.as_slice()).unwrap();
            request
                .resource_spans
                .into_iter()
                .flat_map(|r| r.scope_spans)
                .flat_map(|s| s.spans)
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The span id a call's `traceparent` names, checking that it is in the sender's trace.
fn parent_of_call(call: &Dispatched) -> String {
    let traceparent = header_of(call, "traceparent").unwrap();
    let parts: Vec<&str> = traceparent.split('-').collect();
    assert_eq!((parts[0], parts[1], parts[3]), ("00", SENDER_TRACE, "01"));
    assert_eq!(
        call.headers
            .iter()
            .filter(|(n, _)| n == "traceparent")
            .count(),
        1,
        "the sender's traceparent is replaced, not repeated"
    );
    parts[2].to_string()
}

#[test]
fn a_traced_fan_out_makes_the_tree_and_every_call_names_its_attempt() {
    let mut plugin = FakeEnvoy::configured(TRACED);
    let mut ctx = send(&plugin, &traced_request(), b"event");
    plugin.answer(&mut ctx, "a", Some(503), "busy");
    plugin.answer(&mut ctx, "b", Some(500), "down");
    let dead_letter = plugin.last_call();
    assert_eq!(dead_letter.cluster, "dlq");
    plugin.answer_call(&mut ctx, dead_letter.token, Some(202), "");
    plugin.answer_with(&mut ctx, "c", 200, REPLY, b"r");
    let reply = plugin.last_call();
    assert_eq!(reply.cluster, "replies");
    plugin.answer_call(&mut ctx, reply.token, Some(202), "");
    plugin.tick_at(500);
    let retry = plugin.last_call();
    assert_eq!((retry.cluster.as_str(), retry.context), ("a", ROOT));
    plugin.answer_root_call(retry.token, Some(200), "", &[]);
    assert_eq!(plugin.only_answer().status, 202);

    // Every call carries its own attempt's context, and the sender's tracestate.
    let calls: Vec<Dispatched> = plugin.state().dispatched.clone();
    let mut call_parents = Vec::new();
    for call in calls.iter().filter(|c| c.cluster != "otel") {
        call_parents.push((call.cluster.clone(), parent_of_call(call)));
        assert_eq!(header_of(call, "tracestate").as_deref(), Some("congo=t61"));
    }
    assert_eq!(call_parents.len(), 6, "{call_parents:?}");

    plugin.tick_at(4_999);
    assert!(
        exported(&plugin).is_empty(),
        "exported before the batch's delay"
    );
    plugin.tick_at(5_000);
    let export = plugin.last_call();
    assert_eq!((export.cluster.as_str(), export.context), ("otel", ROOT));
    assert_eq!(header_of(&export, ":path").as_deref(), Some("/v1/traces"));
    let spans = exported(&plugin);
    let by_id = |id: &[u8]| spans.iter().find(|s| s.span_id == id).unwrap();
    let named =
        |name: &str| -> Vec<&otlp::Span> { spans.iter().filter(|s| s.name == name).collect() };
    assert!(spans.iter().all(|s| hex(&s.trace_id) == SENDER_TRACE));
    let request = named("fanout default")[0];
    assert_eq!(hex(&request.parent_span_id), "00f067aa0ba902b7");
    let sends: Vec<&otlp::Span> = ["send a", "send b", "send c"]
        .iter()
        .map(|name| named(name)[0])
        .collect();
    assert!(sends.iter().all(|s| s.parent_span_id == request.span_id));
    // Each call's traceparent is its attempt's span; an attempt's parent is its leg's.
    for (cluster, span_id) in &call_parents {
        let attempt = spans.iter().find(|s| hex(&s.span_id) == *span_id).unwrap();
        assert_eq!(attempt.name, "POST");
        let leg = by_id(&attempt.parent_span_id);
        let expected = match cluster.as_str() {
            "dlq" => "dead letter dlq",
            "replies" => "reply replies",
            other => &format!("send {other}"),
        };
        assert_eq!(leg.name, expected);
    }
    let under = |parent: &otlp::Span| {
        spans
            .iter()
            .filter(|s| s.parent_span_id == parent.span_id)
            .count()
    };
    assert_eq!(under(sends[0]), 2, "a: two attempts");
    assert_eq!(under(sends[1]), 2, "b: an attempt and its dead letter");
    assert_eq!(under(sends[2]), 2, "c: an attempt and its reply");
    assert_eq!(
        by_id(&named("dead letter dlq")[0].parent_span_id).name,
        "send b"
    );
    assert_eq!(spans.len(), 1 + 3 + 4 + 2 + 2);
    assert!(sends[0].status.is_none() && sends[2].status.is_none());
    assert!(sends[1].status.is_some(), "b did not take the event");
    plugin.answer_root_call(export.token, Some(200), "", &[]);
    assert_eq!(plugin.flushed("fanout.tracing.spans_dropped"), 0);
}

#[test]
fn a_collector_that_fails_costs_the_spans_counted() {
    let config = TRACED.replace("\"tracing\"", "\"metrics\": true, \"tracing\"");
    let mut plugin = FakeEnvoy::configured(&config);
    let mut ctx = send(&plugin, &traced_request(), b"event");
    for cluster in ["a", "b", "c"] {
        plugin.answer(&mut ctx, cluster, Some(202), "");
    }
    plugin.tick_at(5_000);
    let export = plugin.last_call();
    assert_eq!(export.cluster, "otel");
    let sent = exported(&plugin).len();
    assert_eq!(sent, 1 + 3 + 3);
    plugin.answer_root_call(export.token, Some(503), "", &[]);
    assert_eq!(plugin.flushed("fanout.tracing.spans_dropped"), sent as i64);
}

#[test]
fn an_unsampled_request_keeps_the_senders_context_and_makes_no_span() {
    let mut plugin = FakeEnvoy::configured(TRACED);
    let mut headers = post("x");
    let unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
    headers.push(("traceparent", unsampled));
    let mut ctx = send(&plugin, &headers, b"event");
    let calls = plugin.state().dispatched.clone();
    assert_eq!(calls.len(), 3);
    for call in &calls {
        assert_eq!(header_of(call, "traceparent").as_deref(), Some(unsampled));
    }
    for cluster in ["a", "b", "c"] {
        plugin.answer(&mut ctx, cluster, Some(202), "");
    }
    plugin.tick_at(5_000);
    assert!(exported(&plugin).is_empty());
}

#[test]
fn without_tracing_a_reply_carries_the_senders_trace_context() {
    let plugin = FakeEnvoy::configured(
        r#"{"subscribers": [{"cluster": "c", "reply": {"cluster": "replies"}}]}"#,
    );
    let mut ctx = send(&plugin, &traced_request(), b"event");
    let event = plugin.last_call();
    assert_eq!(header_of(&event, "traceparent").as_deref(), Some(SENDER));
    // The subscriber's answer has a trace context of its own: not the one passed on.
    let mut answer = REPLY.to_vec();
    answer.push((
        "traceparent",
        "00-11111111111111111111111111111111-2222222222222222-01",
    ));
    plugin.answer_with(&mut ctx, "c", 200, &answer, b"r");
    let reply = plugin.last_call();
    assert_eq!(reply.cluster, "replies");
    assert_eq!(header_of(&reply, "traceparent").as_deref(), Some(SENDER));
    assert_eq!(
        header_of(&reply, "tracestate").as_deref(),
        Some("congo=t61")
    );
}

/// The `cloudevents.*` attributes of a span, by name.
fn event_attributes(span: &otlp::Span) -> Vec<(String, String)> {
    span.attributes
        .iter()
        .filter(|kv| kv.key.starts_with("cloudevents."))
        .filter_map(|kv| match kv.value.as_ref()?.value.as_ref()? {
            otlp::Value::String(text) => Some((kv.key.to_string(), text.clone())),
            _ => None,
        })
        .collect()
}

/// The request's span and its delivery's carry the event's attributes as admission read them:
/// a binary event's decoded headers, a structured event's body members (parsed once, for the
/// spans alone when nothing else reads them), nothing for a request that is no CloudEvent.
#[test]
fn the_spans_carry_the_attributes_admission_read() {
    let config = r#"{"tracing": {"collector": {"cluster": "otel"}, "sampling_ratio": 1.0},
                     "subscribers": [{"cluster": "a"}]}"#;
    let spans_of = |extra: &[(&str, &str)], body: &[u8]| {
        let mut plugin = FakeEnvoy::configured(config);
        let mut headers = post("x");
        headers.extend_from_slice(extra);
        let mut ctx = send(&plugin, &headers, body);
        plugin.answer(&mut ctx, "a", Some(200), "");
        assert_eq!(plugin.only_answer().status, 202);
        plugin.tick_at(60_000);
        let spans = exported(&plugin);
        let of = |name: &str| {
            let span = spans.iter().find(|s| s.name == name).unwrap();
            event_attributes(span)
        };
        let (request, send) = (of("fanout default"), of("send a"));
        assert_eq!(
            request, send,
            "the delivery carries the request's attributes"
        );
        request
    };
    let want = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (format!("cloudevents.{k}"), v.to_string()))
            .collect()
    };
    let all = want(&[
        ("event_id", "e 1"),
        ("source", "/s"),
        ("type", "t"),
        ("subject", "sub"),
        ("specversion", "1.0"),
    ]);
    let binary = [
        ("ce-specversion", "1.0"),
        ("ce-id", "e%201"),
        ("ce-source", r#""/s""#),
        ("ce-type", "t"),
        ("ce-subject", "sub"),
        ("ce-greeting", "%FF"),
    ];
    assert_eq!(spans_of(&binary, b"{}"), all);
    let structured = [("content-type", "application/cloudevents+json")];
    let body = br#"{"specversion": "1.0", "id": "e 1", "source": "/s", "type": "t",
                    "subject": "sub", "data": {"id": "not me"}}"#;
    assert_eq!(spans_of(&structured, body), all);
    // A body that is no structured event has no attributes, and is still delivered.
    assert_eq!(spans_of(&structured, b"{not json"), []);
    assert_eq!(spans_of(&[("content-type", "application/json")], b"{}"), []);
}
