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

use std::rc::Rc;
use std::sync::OnceLock;

use super::context::{traceparent, LEN_00};
use super::otlp::{self, AttributeValue};
use super::Tracer;
use crate::protowire::Writer;

/// A span started and not yet ended: its fields encoded so far (OTLP's `Span`, written as
/// they become known: field order does not matter on the wire), and what its children and
/// its end need.
#[derive(Debug)]
pub struct OpenSpan {
    out: Writer,
    trace_id: [u8; 16],
    span_id: [u8; 8],
    /// The sender's `tracestate`, shared by the request's spans.
    trace_state: Option<Rc<str>>,
    flags: u32,
    start_ns: u64,
}

/// A span that ended: an OTLP `Span`'s encoded fields, what the exporter buffers.
#[derive(Debug, Clone, PartialEq)]
pub struct EndedSpan(Vec<u8>);

impl EndedSpan {
    /// Its buffer, for another span once its bytes are copied.
    pub fn into_buffer(self) -> Vec<u8> {
        self.0
    }
}

impl AsRef<[u8]> for EndedSpan {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

#[cfg(test)]
impl EndedSpan {
    /// The span as a message (tests).
    pub fn decode(&self) -> otlp::Span {
        use crate::protowire::Message;
        otlp::Span::decode(&self.0).unwrap_or_default()
    }

    /// A message as an ended span (tests).
    pub fn of(span: &otlp::Span) -> EndedSpan {
        use crate::protowire::Message;
        EndedSpan(span.encode_to_vec())
    }
}

/// A span's room, by kind: what most of fanout's spans take.
const LEG_CAPACITY: usize = 640;
const ATTEMPT_CAPACITY: usize = 256;

/// The CloudEvents attributes of an event as span attribute fields, encoded once per event
/// and copied into each of its spans.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EventFields(Vec<u8>);

impl EventFields {
    pub fn new(event: &EventAttributes) -> EventFields {
        let attributes = [
            ("cloudevents.event_id", event.id),
            ("cloudevents.source", event.source),
            ("cloudevents.type", event.event_type),
            ("cloudevents.subject", event.subject),
            ("cloudevents.specversion", event.spec_version),
        ];
        let mut out = Writer::default();
        for (key, value) in attributes {
            if let Some(value) = value {
                otlp::attribute(&mut out, key, AttributeValue::Str(value));
            }
        }
        EventFields(out.into_bytes())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Where a delivery-level span's calls go, as its attribute fields (`messaging.destination.name`,
/// `server.address`, `url.path`), encoded once per subscriber when it is configured.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DestinationFields(Vec<u8>);

impl DestinationFields {
    pub fn new(cluster: &str, authority: &str, path: &str) -> DestinationFields {
        let mut out = Writer::default();
        for (key, value) in [
            ("messaging.destination.name", cluster),
            ("server.address", authority),
            ("url.path", path),
        ] {
            otlp::attribute(&mut out, key, AttributeValue::Str(value));
        }
        DestinationFields(out.into_bytes())
    }
}

/// Attribute fields with constant values, encoded once per VM: what every span of one kind
/// carries.
fn constant_fields(cell: &'static OnceLock<Vec<u8>>, attributes: &[(&str, &str)]) -> &'static [u8] {
    cell.get_or_init(|| {
        let mut out = Writer::default();
        for (key, value) in attributes {
            otlp::attribute(&mut out, key, AttributeValue::Str(value));
        }
        out.into_bytes()
    })
}

/// A delivery-level span's constant fields, by [`SpanLeg`].
fn leg_fields(leg: SpanLeg) -> (&'static str, &'static [u8]) {
    static SEND: OnceLock<Vec<u8>> = OnceLock::new();
    static REPLY: OnceLock<Vec<u8>> = OnceLock::new();
    static DEAD_LETTER: OnceLock<Vec<u8>> = OnceLock::new();
    let (operation, cell) = match leg {
        SpanLeg::Delivery => ("send", &SEND),
        SpanLeg::Reply => ("reply", &REPLY),
        SpanLeg::DeadLetter => ("dead letter", &DEAD_LETTER),
    };
    let fields = constant_fields(
        cell,
        &[
            ("messaging.system", SYSTEM),
            ("messaging.operation.name", operation),
            ("messaging.operation.type", "send"),
        ],
    );
    (operation, fields)
}

/// An attempt span's constant fields.
fn attempt_fields() -> &'static [u8] {
    static ATTEMPT: OnceLock<Vec<u8>> = OnceLock::new();
    constant_fields(&ATTEMPT, &[("http.request.method", "POST")])
}

/// The end of a delivery taken at its first attempt (`fanout.attempts` 1,
/// `fanout.dead_lettered` false): most deliveries' end, encoded once.
fn first_attempt_end() -> &'static [u8] {
    static END: OnceLock<Vec<u8>> = OnceLock::new();
    END.get_or_init(|| {
        let mut out = Writer::default();
        otlp::attribute(&mut out, "fanout.attempts", AttributeValue::Int(1));
        otlp::attribute(
            &mut out,
            "fanout.dead_lettered",
            AttributeValue::Bool(false),
        );
        out.into_bytes()
    })
}

/// `http.response.status_code` of the statuses most answers have, encoded once.
fn common_status(status: u16) -> Option<&'static [u8]> {
    const COMMON: [u16; 3] = [200, 202, 204];
    static FIELDS: [OnceLock<Vec<u8>>; 3] = [const { OnceLock::new() }; 3];
    let cell = FIELDS.get(COMMON.iter().position(|s| *s == status)?)?;
    Some(cell.get_or_init(|| {
        let mut out = Writer::default();
        let code = AttributeValue::Int(i64::from(status));
        otlp::attribute(&mut out, "http.response.status_code", code);
        out.into_bytes()
    }))
}

/// Which call a delivery-level span stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanLeg {
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
    /// The three as attribute fields, when they were encoded already.
    pub fields: Option<&'a DestinationFields>,
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
    /// A span with its ids, parent (empty for a root), name (its parts joined) and start.
    pub(super) fn start(
        (span_id, mut buffer): ([u8; 8], Vec<u8>),
        trace_id: [u8; 16],
        parent: &[u8],
        name: &[&str],
        kind: i32,
        start_ns: u64,
    ) -> OpenSpan {
        let capacity = if kind == otlp::CLIENT {
            ATTEMPT_CAPACITY
        } else {
            LEG_CAPACITY
        };
        buffer.clear();
        buffer.reserve(capacity);
        let mut out = Writer::after(buffer);
        out.bytes(1, &trace_id);
        out.bytes(2, &span_id);
        out.bytes(4, parent);
        out.header(5, name.iter().map(|part| part.len()).sum());
        for part in name {
            out.raw(part.as_bytes());
        }
        out.int32(6, kind);
        out.fixed64(7, start_ns);
        OpenSpan {
            out,
            trace_id,
            span_id,
            trace_state: None,
            flags: otlp::PARENT_KNOWN_LOCAL,
            start_ns,
        }
    }

    /// A child of this span, in its trace, with its `tracestate`.
    fn child(&self, ids: &mut Tracer, name: &[&str], kind: i32, start_ns: u64) -> OpenSpan {
        let mut child = OpenSpan::start(
            ids.fresh(),
            self.trace_id,
            &self.span_id,
            name,
            kind,
            start_ns,
        );
        child.trace_state.clone_from(&self.trace_state);
        child
    }

    pub(super) fn remote_parent(&mut self, trace_state: Option<String>) {
        self.flags = otlp::PARENT_REMOTE;
        self.trace_state = trace_state.map(Rc::from);
    }

    /// The `traceparent` of a call made from this span (sampled: only sampled requests have
    /// spans).
    pub fn traceparent(&self) -> [u8; LEN_00] {
        traceparent(&self.trace_id, &self.span_id, true)
    }

    /// The `tracestate` a call made from this span carries: the sender's, if it was valid.
    pub fn tracestate(&self) -> Option<&Rc<str>> {
        self.trace_state.as_ref()
    }

    pub fn span_id(&self) -> [u8; 8] {
        self.span_id
    }

    fn str(&mut self, key: &str, value: &str) {
        otlp::attribute(&mut self.out, key, AttributeValue::Str(value));
    }

    fn int(&mut self, key: &str, value: i64) {
        otlp::attribute(&mut self.out, key, AttributeValue::Int(value));
    }

    fn bool(&mut self, key: &str, value: bool) {
        otlp::attribute(&mut self.out, key, AttributeValue::Bool(value));
    }

    /// Status ERROR with `message`, and `error.type`.
    fn fail(&mut self, error_type: &str, message: &str) {
        self.str("error.type", error_type);
        otlp::status(&mut self.out, message, otlp::ERROR);
    }

    fn end(mut self, end_ns: u64) -> EndedSpan {
        if let Some(state) = &self.trace_state {
            self.out.bytes(3, state.as_bytes());
        }
        self.out.fixed64(8, end_ns.max(self.start_ns));
        self.out.fixed32(16, self.flags);
        EndedSpan(self.out.into_bytes())
    }

    /// The request's span, as [`super::Tracer::request`] started it: the channel and the
    /// event's attributes.
    pub(super) fn describe_request(&mut self, channel: &str, method: &str, event: &EventFields) {
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
    pub fn event(&mut self, event: &EventFields) {
        self.out.raw(&event.0);
    }

    /// A delivery-level span under the request's span: `send <cluster>` for a subscriber,
    /// `reply <cluster>` and `dead letter <cluster>` under that subscriber's span.
    pub fn leg(
        &self,
        ids: &mut Tracer,
        leg: SpanLeg,
        to: &Destination,
        event: &EventFields,
        start_ns: u64,
    ) -> OpenSpan {
        let (operation, constants) = leg_fields(leg);
        let name = [operation, " ", to.cluster];
        let mut span = self.child(ids, &name, otlp::PRODUCER, start_ns);
        span.out.raw(constants);
        match to.fields {
            Some(fields) => span.out.raw(&fields.0),
            None => span
                .out
                .raw(&DestinationFields::new(to.cluster, to.authority, to.path).0),
        }
        span.event(event);
        span
    }

    /// One attempt under a delivery-level span (`POST`, CLIENT): its number from 0, the wait
    /// before it and the `Retry-After` that wait honoured.
    pub fn attempt(
        &self,
        ids: &mut Tracer,
        resend: u32,
        backoff_ms: u64,
        retry_after_ms: Option<u64>,
        start_ns: u64,
    ) -> OpenSpan {
        let mut span = self.child(ids, &["POST"], otlp::CLIENT, start_ns);
        span.out.raw(attempt_fields());
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
    ) -> EndedSpan {
        match status.map(|s| (s, common_status(s))) {
            Some((_, Some(field))) => self.out.raw(field),
            Some((status, None)) => self.int("http.response.status_code", i64::from(status)),
            None => {}
        }
        if let Some(error) = error {
            let mut digits = [0u8; 5];
            let error_type = status.map_or(error, |s| decimal(s, &mut digits));
            self.fail(error_type, error);
        }
        self.end(end_ns)
    }

    /// A delivery-level span's end.
    pub fn end_leg(mut self, outcome: &DeliveryOutcome, end_ns: u64) -> EndedSpan {
        if outcome.attempts == 1 && !outcome.dead_lettered {
            self.out.raw(first_attempt_end());
        } else {
            self.int("fanout.attempts", i64::from(outcome.attempts));
            self.bool("fanout.dead_lettered", outcome.dead_lettered);
        }
        if !outcome.delivered {
            let error = outcome.error.unwrap_or("failed");
            self.fail("delivery_failed", error);
        }
        self.end(end_ns)
    }

    /// The request span's end: the answer's status and the counts; a 5xx is an error.
    pub fn end_request(mut self, verdict: &Verdict, end_ns: u64) -> EndedSpan {
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
            let mut digits = [0u8; 5];
            self.fail(decimal(verdict.status, &mut digits), &message);
        }
        self.end(end_ns)
    }
}

/// `n` in decimal, in `digits`.
fn decimal(n: u16, digits: &mut [u8; 5]) -> &str {
    let mut i = digits.len();
    let mut n = n;
    loop {
        i -= 1;
        if let Some(d) = digits.get_mut(i) {
            *d = b'0' + (n % 10) as u8;
        }
        n /= 10;
        if n == 0 || i == 0 {
            break;
        }
    }
    std::str::from_utf8(digits.get(i..).unwrap_or_default()).unwrap_or_default()
}

fn clamp(ms: u64) -> i64 {
    i64::try_from(ms).unwrap_or(i64::MAX)
}
