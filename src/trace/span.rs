//! The spans of one event, with the OpenTelemetry messaging and HTTP conventions' names, and
//! Knative's where it has its own (`kn.channel.*`, `cloudevents.*` as its dispatcher writes
//! them):
//!
//! ```text
//! fanout <channel>          SERVER    the request: verdict, counts          (request)
//! └─ send <cluster>         PRODUCER  one subscriber's delivery: outcome    (delivery)
//!    ├─ POST                CLIENT    one attempt: status, backoff waited   (attempt)
//!    ├─ POST                CLIENT    http.request.resend_count = 1
//!    ├─ reply <cluster>     PRODUCER  its reply event, attempts under it
//!    └─ dead letter <cl.>   PRODUCER  the dead letter, attempts under it
//! ```
//!
//! A span is an [`OpenSpan`] while it runs (the calls made from it take its
//! [`OpenSpan::traceparent`]), and an OTLP [`otlp::Span`] once ended, ready for the
//! exporter's buffer. Times are the host clock's nanoseconds since the epoch; this module
//! reads no clock.

use super::context::traceparent;
use super::otlp::{self, KeyValue, Value};

/// A span started and not yet ended.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenSpan {
    span: otlp::Span,
    trace_id: [u8; 16],
    span_id: [u8; 8],
}

/// Which call a delivery-level span stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leg {
    Delivery,
    Reply,
    DeadLetter,
}

/// The CloudEvents attributes a span carries (`None`: the request is not a CloudEvent, or
/// they were not read).
#[derive(Debug, Clone, Copy, Default)]
pub struct EventAttributes<'a> {
    pub id: Option<&'a str>,
    pub source: Option<&'a str>,
    pub event_type: Option<&'a str>,
    pub subject: Option<&'a str>,
    pub spec_version: Option<&'a str>,
}

/// Where a call goes.
#[derive(Debug, Clone, Copy)]
pub struct Destination<'a> {
    pub cluster: &'a str,
    pub authority: &'a str,
    pub path: &'a str,
}

/// How one subscriber's delivery ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeliveryOutcome<'a> {
    pub attempts: u32,
    pub delivered: bool,
    pub dead_lettered: bool,
    /// Why it failed, in the words of fanout's report (`timeout`, `status 503`, ...).
    pub error: Option<&'a str>,
}

/// What the request's span records of its verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub status: u16,
    pub subscribers: u32,
    pub failed: u32,
    pub dead_lettered: u32,
}

/// `messaging.system`: fanout's own, since no registered value names it.
const SYSTEM: &str = "fanout";

impl OpenSpan {
    /// A span with its ids, parent (empty for a root) and start.
    pub(super) fn start(
        trace_id: [u8; 16],
        span_id: [u8; 8],
        parent: &[u8],
        name: String,
        kind: i32,
        start_ns: u64,
    ) -> OpenSpan {
        OpenSpan {
            span: otlp::Span {
                trace_id: trace_id.to_vec(),
                span_id: span_id.to_vec(),
                parent_span_id: parent.to_vec(),
                name,
                kind,
                start_time_unix_nano: start_ns,
                flags: otlp::PARENT_KNOWN_LOCAL,
                ..otlp::Span::default()
            },
            trace_id,
            span_id,
        }
    }

    /// A child of this span, in its trace, with its `tracestate`.
    fn child(&self, span_id: [u8; 8], name: String, kind: i32, start_ns: u64) -> OpenSpan {
        let mut child =
            OpenSpan::start(self.trace_id, span_id, &self.span_id, name, kind, start_ns);
        child.span.trace_state.clone_from(&self.span.trace_state);
        child
    }

    pub(super) fn remote_parent(&mut self, trace_state: Option<String>) {
        self.span.flags = otlp::PARENT_REMOTE;
        self.span.trace_state = trace_state.unwrap_or_default();
    }

    /// The `traceparent` of a call made from this span (sampled: only sampled requests have
    /// spans).
    pub fn traceparent(&self) -> String {
        traceparent(&self.trace_id, &self.span_id, true)
    }

    /// The `tracestate` a call made from this span carries: the sender's, if it was valid.
    pub fn tracestate(&self) -> Option<&str> {
        Some(self.span.trace_state.as_str()).filter(|s| !s.is_empty())
    }

    pub fn span_id(&self) -> [u8; 8] {
        self.span_id
    }

    fn str(&mut self, key: &'static str, value: &str) {
        self.span
            .attributes
            .push(KeyValue::new(key, Value::String(value.to_string())));
    }

    fn int(&mut self, key: &'static str, value: i64) {
        self.span
            .attributes
            .push(KeyValue::new(key, Value::Int(value)));
    }

    fn bool(&mut self, key: &'static str, value: bool) {
        self.span
            .attributes
            .push(KeyValue::new(key, Value::Bool(value)));
    }

    /// Status ERROR with `message`, and `error.type`.
    fn fail(&mut self, error_type: &str, message: &str) {
        self.str("error.type", error_type);
        self.span.status = Some(otlp::Status {
            message: message.to_string(),
            code: otlp::ERROR,
        });
    }

    fn end(mut self, end_ns: u64) -> otlp::Span {
        self.span.end_time_unix_nano = end_ns.max(self.span.start_time_unix_nano);
        self.span
    }

    /// The request's span, as [`super::Tracer::request`] started it: the channel and the
    /// event's attributes.
    pub(super) fn describe_request(
        &mut self,
        channel: &str,
        method: &str,
        event: &EventAttributes,
    ) {
        self.str("messaging.system", SYSTEM);
        self.str("messaging.operation.name", "fanout");
        self.str("messaging.destination.name", channel);
        // Knative names channels `namespace/name`; fanout's channel names follow it.
        if let Some((namespace, name)) = channel.split_once('/') {
            self.str("kn.channel.namespace", namespace);
            self.str("kn.channel.name", name);
        }
        self.str("http.request.method", method);
        self.event(event);
    }

    /// The event's CloudEvents attributes: at the start for a delivery (the event is known),
    /// later for the request, whose span starts with the headers and whose event (a
    /// structured one's attributes) is known once the body is in.
    pub fn event(&mut self, event: &EventAttributes) {
        let attributes = [
            ("cloudevents.event_id", event.id),
            ("cloudevents.source", event.source),
            ("cloudevents.type", event.event_type),
            ("cloudevents.subject", event.subject),
            ("cloudevents.specversion", event.spec_version),
        ];
        for (key, value) in attributes {
            if let Some(value) = value {
                self.str(key, value);
            }
        }
    }

    /// A delivery-level span under the request's span: `send <cluster>` for a subscriber,
    /// `reply <cluster>` and `dead letter <cluster>` under that subscriber's span.
    pub fn leg(
        &self,
        span_id: [u8; 8],
        leg: Leg,
        to: &Destination,
        event: &EventAttributes,
        start_ns: u64,
    ) -> OpenSpan {
        let operation = match leg {
            Leg::Delivery => "send",
            Leg::Reply => "reply",
            Leg::DeadLetter => "dead letter",
        };
        let name = [operation, " ", to.cluster].concat();
        let mut span = self.child(span_id, name, otlp::PRODUCER, start_ns);
        span.str("messaging.system", SYSTEM);
        span.str("messaging.operation.name", operation);
        span.str("messaging.operation.type", "send");
        span.str("messaging.destination.name", to.cluster);
        span.str("server.address", to.authority);
        span.str("url.path", to.path);
        span.event(event);
        span
    }

    /// One attempt under a delivery-level span (`POST`, CLIENT): its number from 0, the wait
    /// before it and the `Retry-After` that wait honoured.
    pub fn attempt(
        &self,
        span_id: [u8; 8],
        resend: u32,
        backoff_ms: u64,
        retry_after_ms: Option<u64>,
        start_ns: u64,
    ) -> OpenSpan {
        let mut span = self.child(span_id, "POST".into(), otlp::CLIENT, start_ns);
        span.str("http.request.method", "POST");
        if resend > 0 {
            span.int("http.request.resend_count", i64::from(resend));
            span.int("fanout.backoff_ms", clamp(backoff_ms));
        }
        if let Some(ms) = retry_after_ms {
            span.int("fanout.retry_after_ms", clamp(ms));
        }
        span
    }

    /// An attempt's end: the subscriber's status (`None`: no answer), and `error`, fanout's
    /// word for a failure (`timeout`, `reset`, `status 503`, ...) when it was one.
    pub fn end_attempt(
        mut self,
        status: Option<u16>,
        error: Option<&str>,
        end_ns: u64,
    ) -> otlp::Span {
        if let Some(status) = status {
            self.int("http.response.status_code", i64::from(status));
        }
        if let Some(error) = error {
            let error_type = status.map_or(error.to_string(), |s| s.to_string());
            self.fail(&error_type, error);
        }
        self.end(end_ns)
    }

    /// A delivery-level span's end.
    pub fn end_leg(mut self, outcome: &DeliveryOutcome, end_ns: u64) -> otlp::Span {
        self.int("fanout.attempts", i64::from(outcome.attempts));
        self.bool("fanout.dead_lettered", outcome.dead_lettered);
        if !outcome.delivered {
            let error = outcome.error.unwrap_or("failed");
            self.fail("delivery_failed", error);
        }
        self.end(end_ns)
    }

    /// The request span's end: the answer's status and the counts; a 5xx is an error.
    pub fn end_request(mut self, verdict: &Verdict, end_ns: u64) -> otlp::Span {
        self.int("http.response.status_code", i64::from(verdict.status));
        self.int("fanout.subscribers", i64::from(verdict.subscribers));
        self.int("fanout.subscribers.failed", i64::from(verdict.failed));
        self.int(
            "fanout.subscribers.dead_lettered",
            i64::from(verdict.dead_lettered),
        );
        if verdict.status >= 500 {
            let message = format!(
                "{} of {} subscribers failed",
                verdict.failed, verdict.subscribers
            );
            self.fail(&verdict.status.to_string(), &message);
        }
        self.end(end_ns)
    }
}

fn clamp(ms: u64) -> i64 {
    i64::try_from(ms).unwrap_or(i64::MAX)
}
