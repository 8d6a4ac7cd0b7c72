//! Traces of fan-outs, exported over OTLP: the pure part. The W3C trace context of the
//! sender ([`context`]), the spans of one event ([`span`]), OTLP's messages ([`otlp`]), and
//! the batching exporter of one VM ([`export`]), which returns what the glue must send.
//!
//! [`Tracer`] decides whether a request is traced and names its spans: a request with a
//! valid `traceparent` follows the sender's `sampled` flag; one without is sampled with the
//! configured ratio, decided from its new trace id as OpenTelemetry's `TraceIdRatioBased`
//! does (so every service with the same ratio agrees). Ids come from a `fastrand` generator
//! seeded by the glue (no host call, no random source of its own), like jitter's.
//!
//! Nothing here reads a clock, calls the host or knows the configuration's JSON.

pub mod context;
pub mod export;
pub mod otlp;
pub mod span;

pub use span::{
    DeliveryOutcome, Destination, DestinationFields, EndedSpan, EventAttributes, EventFields,
    OpenSpan, SpanLeg, Verdict,
};

use context::TraceParent;

/// Span buffers kept for reuse: the spans of a few fan-outs in flight.
const SPARE_BUFFERS: usize = 64;

/// Ids and the sampling decision, one per VM.
#[derive(Debug, Clone)]
pub struct Tracer {
    ids: fastrand::Rng,
    /// Buffers of spans whose bytes were copied to the exporter, for new spans: a span then
    /// costs no allocation.
    spare: Vec<Vec<u8>>,
    /// A new trace is sampled when the low 63 bits of its id's last 8 bytes are below this.
    ratio_bound: u64,
}

impl Tracer {
    /// `ratio`: the share of requests without a `traceparent` that are traced, 0 to 1 (the
    /// configuration checks it; out of range it is clamped).
    pub fn new(ratio: f64, seed: u64) -> Tracer {
        // 2^63 as a float, exactly; a float to int cast saturates.
        let ratio_bound = (ratio.clamp(0.0, 1.0) * 9_223_372_036_854_775_808.0) as u64;
        Tracer {
            ids: fastrand::Rng::with_seed(seed),
            spare: Vec::new(),
            ratio_bound,
        }
    }

    /// The request's span when the request is traced, `None` when it is not (its calls then
    /// carry the sender's `traceparent` and `tracestate` unchanged, as without tracing).
    /// `traceparent` and `tracestate` are the request's headers as they came; `describe`
    /// gives the event's attributes and the request's start, and is called only when the
    /// request is traced (an untraced one pays for the decision alone). The span comes with
    /// the event's attributes, for its deliveries'.
    pub fn request(
        &mut self,
        traceparent: Option<&[u8]>,
        tracestate: Option<&[u8]>,
        channel: &str,
        method: &str,
        describe: impl FnOnce() -> (EventFields, u64),
    ) -> Option<(OpenSpan, EventFields)> {
        let parent = traceparent.and_then(TraceParent::parse);
        let (trace_id, parent_id) = match parent {
            Some(parent) if !parent.sampled => return None,
            Some(parent) => (parent.trace_id, Some(parent.parent_id)),
            None => {
                let trace_id = self.trace_id();
                if !self.samples(&trace_id) {
                    return None;
                }
                (trace_id, None)
            }
        };
        let (event, start_ns) = describe();
        let mut span = OpenSpan::start(
            self.fresh(),
            trace_id,
            parent_id.as_ref().map_or(&[][..], |id| &id[..]),
            &["fanout ", channel],
            otlp::SERVER,
            start_ns,
        );
        if parent_id.is_some() {
            span.remote_parent(tracestate.and_then(context::tracestate));
        }
        span.describe_request(channel, method, &event);
        Some((span, event))
    }

    /// A new span id (never all zero).
    pub fn span_id(&mut self) -> [u8; 8] {
        self.ids.u64(1..).to_be_bytes()
    }

    /// A new span's id and buffer.
    fn fresh(&mut self) -> ([u8; 8], Vec<u8>) {
        (self.span_id(), self.spare.pop().unwrap_or_default())
    }

    /// A span's buffer, once its bytes are copied (a few dozen are kept).
    pub fn recycle(&mut self, span: EndedSpan) {
        if self.spare.len() < SPARE_BUFFERS {
            self.spare.push(span.into_buffer());
        }
    }

    fn trace_id(&mut self) -> [u8; 16] {
        self.ids.u128(1..).to_be_bytes()
    }

    fn samples(&self, trace_id: &[u8; 16]) -> bool {
        let mut low = [0u8; 8];
        low.copy_from_slice(trace_id.get(8..).unwrap_or(&[0; 8]));
        (u64::from_be_bytes(low) >> 1) < self.ratio_bound
    }
}

#[cfg(test)]
mod tests {
    use super::otlp::{Value, CLIENT, ERROR, PRODUCER, SERVER};
    use super::*;

    const SENDER: &[u8] = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn event() -> EventAttributes<'static> {
        EventAttributes {
            id: Some("e-1"),
            source: Some("/orders"),
            event_type: Some("order.created"),
            subject: None,
            spec_version: Some("1.0"),
        }
    }

    fn attr<'a>(span: &'a otlp::Span, key: &str) -> Option<&'a Value> {
        let kv = span.attributes.iter().find(|kv| kv.key == key)?;
        kv.value.as_ref()?.value.as_ref()
    }

    fn string(span: &otlp::Span, key: &str) -> Option<String> {
        match attr(span, key) {
            Some(Value::String(s)) => Some(s.clone()),
            _ => None,
        }
    }

    fn int(span: &otlp::Span, key: &str) -> Option<i64> {
        match attr(span, key) {
            Some(Value::Int(i)) => Some(*i),
            _ => None,
        }
    }

    #[test]
    fn the_senders_sampled_flag_is_honoured_whatever_the_ratio() {
        let mut never = Tracer::new(0.0, 1);
        let mut always = Tracer::new(1.0, 1);
        let unsampled = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        for _ in 0..100 {
            assert!(never
                .request(Some(SENDER), None, "c", "POST", || (
                    EventFields::new(&event()),
                    1
                ))
                .is_some());
            assert!(always
                .request(Some(unsampled), None, "c", "POST", || (
                    EventFields::new(&event()),
                    1
                ))
                .is_none());
        }
    }

    #[test]
    fn requests_without_a_traceparent_are_sampled_at_the_ratio() {
        for (ratio, low, high) in [(0.0, 0, 0), (0.25, 2_300, 2_700), (1.0, 10_000, 10_000)] {
            let mut tracer = Tracer::new(ratio, 42);
            let sampled = (0..10_000)
                .filter(|_| {
                    tracer
                        .request(None, None, "c", "POST", || (EventFields::new(&event()), 1))
                        .is_some()
                })
                .count();
            assert!((low..=high).contains(&sampled), "{ratio}: {sampled}");
        }
        // An invalid traceparent is no traceparent: the trace restarts, at the ratio.
        let mut never = Tracer::new(0.0, 1);
        assert!(never
            .request(Some(b"00-garbage"), None, "c", "POST", || (
                EventFields::new(&event()),
                1
            ))
            .is_none());
        let mut always = Tracer::new(1.0, 1);
        let span = always.request(Some(b"00-garbage"), Some(b"a=1"), "c", "POST", || {
            (EventFields::new(&event()), 1)
        });
        assert_eq!(
            span.unwrap().0.tracestate(),
            None,
            "tracestate of an invalid traceparent"
        );
    }

    #[test]
    fn an_untraced_request_is_not_described() {
        let described = std::cell::Cell::new(0);
        let describe = || {
            described.set(described.get() + 1);
            (EventFields::default(), 1)
        };
        let unsampled = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        let mut never = Tracer::new(0.0, 1);
        let mut always = Tracer::new(1.0, 1);
        assert!(never.request(None, None, "c", "POST", describe).is_none());
        assert!(always
            .request(Some(unsampled), None, "c", "POST", describe)
            .is_none());
        assert_eq!(described.get(), 0, "its attributes and clock are not read");
        assert!(always.request(None, None, "c", "POST", describe).is_some());
        assert_eq!(described.get(), 1);
    }

    #[test]
    fn the_ratio_is_decided_by_the_trace_id() {
        let tracer = Tracer::new(0.5, 0);
        let id = |low: u64| {
            let mut id = [9u8; 16];
            id[8..].copy_from_slice(&low.to_be_bytes());
            id
        };
        assert!(tracer.samples(&id(0)));
        assert!(tracer.samples(&id((1 << 63) - 1)));
        assert!(!tracer.samples(&id(1 << 63)));
        assert!(!tracer.samples(&id(u64::MAX)));
    }

    #[test]
    fn ids_are_never_zero_and_differ_by_seed() {
        let mut a = Tracer::new(1.0, 1);
        let mut b = Tracer::new(1.0, 2);
        let ids: Vec<_> = (0..1000).map(|_| a.span_id()).collect();
        assert!(ids.iter().all(|id| *id != [0; 8]));
        assert_ne!(a.span_id(), b.span_id());
        assert_ne!(a.trace_id(), [0; 16]);
    }

    /// One event, one subscriber that failed once (503, Retry-After 1 s), then took it and
    /// answered with a reply event; a second subscriber that failed for good and was
    /// dead-lettered: the tree, names, kinds, parents and attributes.
    #[test]
    fn one_events_spans_form_the_tree() {
        let mut tracer = Tracer::new(0.0, 7);
        let request = tracer
            .request(
                Some(SENDER),
                Some(b"congo=t61rcWkgMzE"),
                "default/orders",
                "POST",
                || (EventFields::new(&event()), 1_000),
            )
            .unwrap()
            .0;
        let billing = Destination {
            cluster: "billing",
            authority: "billing.svc",
            path: "/in",
            fields: None,
        };
        let send = request.leg(
            &mut tracer,
            SpanLeg::Delivery,
            &billing,
            &EventFields::new(&event()),
            1_010,
        );
        let first = send.attempt(&mut tracer, 0, 0, None, 1_020);
        let header = first.traceparent();
        let header = std::str::from_utf8(&header).unwrap();
        assert_eq!(&header[..36], "00-4bf92f3577b34da6a3ce929d0e0e4736-");
        assert!(header.ends_with("-01"));
        assert_eq!(first.tracestate().map(|s| &**s), Some("congo=t61rcWkgMzE"));
        let first = first
            .end_attempt(Some(503), Some("status 503"), 1_030)
            .decode();
        let second = send.attempt(&mut tracer, 1, 1000, Some(1000), 2_030);
        let second = second.end_attempt(Some(200), None, 2_040).decode();
        let reply_to = Destination {
            cluster: "replies",
            authority: "replies",
            path: "/",
            fields: None,
        };
        let reply = send.leg(
            &mut tracer,
            SpanLeg::Reply,
            &reply_to,
            &EventFields::new(&event()),
            2_041,
        );
        let reply_attempt = reply
            .attempt(&mut tracer, 0, 0, None, 2_042)
            .end_attempt(Some(202), None, 2_043)
            .decode();
        let reply = reply
            .end_leg(
                &DeliveryOutcome {
                    attempts: 1,
                    delivered: true,
                    dead_lettered: false,
                    error: None,
                },
                2_044,
            )
            .decode();
        let outcome = DeliveryOutcome {
            attempts: 2,
            delivered: true,
            dead_lettered: false,
            error: None,
        };
        let send_id = send.span_id().to_vec();
        let send = send.end_leg(&outcome, 2_045).decode();
        let dl_to = Destination {
            cluster: "dlq",
            authority: "dlq",
            path: "/",
            fields: None,
        };
        let dead = request.leg(
            &mut tracer,
            SpanLeg::DeadLetter,
            &dl_to,
            &EventFields::new(&event()),
            2_046,
        );
        let dead = dead
            .end_leg(
                &DeliveryOutcome {
                    attempts: 1,
                    delivered: true,
                    dead_lettered: false,
                    error: None,
                },
                2_047,
            )
            .decode();
        let verdict = Verdict {
            status: 202,
            subscribers: 2,
            failed: 0,
            dead_lettered: 1,
        };
        let request_id = request.span_id().to_vec();
        let request = request.end_request(&verdict, 3_000).decode();

        assert_eq!(request.name, "fanout default/orders");
        assert_eq!(
            (request.kind, request.parent_span_id.as_slice()),
            (
                SERVER,
                &[0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7][..]
            )
        );
        assert_eq!(request.flags, otlp::PARENT_REMOTE);
        assert_eq!(request.trace_state, "congo=t61rcWkgMzE");
        assert_eq!(
            string(&request, "kn.channel.namespace").as_deref(),
            Some("default")
        );
        assert_eq!(
            string(&request, "kn.channel.name").as_deref(),
            Some("orders")
        );
        assert_eq!(
            string(&request, "cloudevents.type").as_deref(),
            Some("order.created")
        );
        assert_eq!(string(&request, "cloudevents.subject"), None);
        assert_eq!(int(&request, "fanout.subscribers.dead_lettered"), Some(1));
        assert_eq!(request.status, None);
        assert_eq!(
            (request.start_time_unix_nano, request.end_time_unix_nano),
            (1_000, 3_000)
        );

        assert_eq!((send.name.as_str(), send.kind), ("send billing", PRODUCER));
        assert_eq!(send.parent_span_id, request_id);
        assert_eq!(
            string(&send, "messaging.destination.name").as_deref(),
            Some("billing")
        );
        assert_eq!(
            string(&send, "server.address").as_deref(),
            Some("billing.svc")
        );
        assert_eq!(int(&send, "fanout.attempts"), Some(2));
        assert_eq!(
            attr(&send, "fanout.dead_lettered"),
            Some(&Value::Bool(false))
        );

        for attempt in [&first, &second] {
            assert_eq!((attempt.name.as_str(), attempt.kind), ("POST", CLIENT));
            assert_eq!(attempt.parent_span_id, send_id);
        }
        let mut first_id = String::new();
        context::push_hex(&mut first_id, &first.span_id);
        assert_eq!(
            header[36..52],
            first_id,
            "an attempt's traceparent names the attempt's span"
        );
        assert_eq!(
            first.status.as_ref().map(|s| (s.code, s.message.as_str())),
            Some((ERROR, "status 503"))
        );
        assert_eq!(string(&first, "error.type").as_deref(), Some("503"));
        assert_eq!(int(&first, "http.request.resend_count"), None);
        assert_eq!(int(&second, "http.request.resend_count"), Some(1));
        assert_eq!(int(&second, "fanout.backoff_ms"), Some(1000));
        assert_eq!(int(&second, "fanout.retry_after_ms"), Some(1000));
        assert_eq!(second.status, None);

        assert_eq!(reply.name, "reply replies");
        // The ends encoded once (a first attempt's, a common status) read as the others.
        assert_eq!(int(&reply, "fanout.attempts"), Some(1));
        assert_eq!(
            attr(&reply, "fanout.dead_lettered"),
            Some(&Value::Bool(false))
        );
        assert_eq!(int(&reply_attempt, "http.response.status_code"), Some(202));
        assert_eq!(int(&second, "http.response.status_code"), Some(200));
        assert_eq!(int(&first, "http.response.status_code"), Some(503));
        assert_eq!(reply.parent_span_id, send_id);
        assert_eq!(reply_attempt.parent_span_id, reply.span_id);
        assert_eq!(dead.name, "dead letter dlq");
        assert_eq!(dead.parent_span_id, request_id);
        let ids = [
            &request,
            &send,
            &first,
            &second,
            &reply,
            &reply_attempt,
            &dead,
        ];
        assert!(ids.iter().all(|s| s.trace_id == request.trace_id));
        let mut span_ids: Vec<_> = ids.iter().map(|s| s.span_id.clone()).collect();
        span_ids.dedup();
        assert_eq!(span_ids.len(), 7);
    }

    #[test]
    fn failures_set_the_status() {
        let mut tracer = Tracer::new(1.0, 3);
        let request = tracer
            .request(None, None, "orders", "POST", || (EventFields::default(), 5))
            .unwrap()
            .0;
        let to = Destination {
            cluster: "a",
            authority: "a",
            path: "/",
            fields: None,
        };
        let send = request.leg(
            &mut tracer,
            SpanLeg::Delivery,
            &to,
            &EventFields::default(),
            6,
        );
        let timeout = send
            .attempt(&mut tracer, 0, 0, None, 7)
            .end_attempt(None, Some("timeout"), 8)
            .decode();
        assert_eq!(string(&timeout, "error.type").as_deref(), Some("timeout"));
        assert_eq!(int(&timeout, "http.response.status_code"), None);
        let outcome = DeliveryOutcome {
            attempts: 1,
            delivered: false,
            dead_lettered: true,
            error: Some("timeout"),
        };
        let send = send.end_leg(&outcome, 9).decode();
        assert_eq!(send.status.as_ref().map(|s| s.code), Some(ERROR));
        assert_eq!(
            attr(&send, "fanout.dead_lettered"),
            Some(&Value::Bool(true))
        );
        let verdict = Verdict {
            status: 500,
            subscribers: 1,
            failed: 1,
            dead_lettered: 0,
        };
        let mut request = request;
        request.event(&EventFields::new(&EventAttributes {
            event_type: Some("late"),
            ..EventAttributes::default()
        }));
        let request = request.end_request(&verdict, 4).decode();
        assert_eq!(
            request.status.as_ref().map(|s| s.message.as_str()),
            Some("1 of 1 subscribers failed")
        );
        assert_eq!(
            request.end_time_unix_nano, 5,
            "an end before the start is the start"
        );
        assert!(
            request.parent_span_id.is_empty(),
            "a new trace's request span is its root"
        );
        assert_eq!(request.flags, otlp::PARENT_KNOWN_LOCAL);
        assert_eq!(
            string(&request, "kn.channel.name"),
            None,
            "a channel name without a namespace"
        );
        assert_eq!(
            string(&request, "cloudevents.type").as_deref(),
            Some("late"),
            "the event's attributes, known once the body is in"
        );
    }
}
