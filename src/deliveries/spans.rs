//! The spans of the fan-outs in flight (`tracing`): one per request, one per subscriber's
//! delivery (`send <cluster>`), one per reply and dead letter under it, and one per attempt
//! (each call's `traceparent` names its own). The deliveries call in at four points: a job
//! starts ([`Tracing::request`]), a call goes out ([`JobSpans::call`]), a call ends
//! ([`JobSpans::call_ended`]), the job ends ([`JobSpans::end`]). Spans that end go to the
//! VM's [`Exporter`], which the root context's timer empties ([`Tracing::export_due`]).
//!
//! With `tracing` off there is no [`Tracing`] and no job has spans: nothing here runs, and
//! no host call is made for it. Times are the host clock's nanoseconds, read by the caller.

use crate::call::{Failure, Leg};
use crate::cloudevents::{Attributes, ContentMode};
use crate::config::{Subscriber, TracingConfig};
use crate::fan_out_state::Progress;
use crate::headers::HeaderMap;
use crate::trace::export::{Export, Exporter};
use std::rc::Rc;

use crate::trace::context::LEN_00;
use crate::trace::{
    self, DeliveryOutcome, Destination, EndedSpan, EventAttributes, EventFields, OpenSpan, Tracer,
};

/// The event's CloudEvents attributes, as the spans carry them: read from the request's one
/// event view ([`ContentMode`], then the [`Attributes`] its body completed), never from the
/// headers or the body again.
fn span_event(attributes: &Attributes) -> EventFields {
    EventFields::new(&EventAttributes {
        id: attributes.get("id"),
        source: attributes.get("source"),
        event_type: attributes.get("type"),
        subject: attributes.get("subject"),
        spec_version: attributes.get("specversion"),
    })
}

/// The VM's tracing: ids and sampling, and the exporter of the spans that ended.
pub struct Tracing {
    tracer: Tracer,
    exporter: Exporter,
    /// The export call in flight.
    export_token: Option<u32>,
}

impl Tracing {
    pub fn new(config: &TracingConfig, seed: u64) -> Tracing {
        Tracing {
            tracer: Tracer::new(config.sampling_ratio, seed),
            exporter: Exporter::new(config.export.clone()),
            export_token: None,
        }
    }

    /// A new configuration's settings; the spans held and the export in flight stay.
    pub fn reconfigure(&mut self, config: &TracingConfig, seed: u64) {
        self.tracer = Tracer::new(config.sampling_ratio, seed);
        self.exporter.reconfigure(config.export.clone());
    }

    /// The spans of a new fan-out to `subscribers` subscribers of `channel`, if the request
    /// is traced (its sender's `sampled` flag, or the ratio): `headers` are the request's,
    /// `event` what admission read of its event (binary mode's attributes, or that a
    /// structured body will tell them), `now_ns` the clock (read only for a traced one).
    pub fn request(
        &mut self,
        headers: &HeaderMap,
        event: Option<&ContentMode>,
        channel: &str,
        subscribers: usize,
        now_ns: impl FnOnce() -> u64,
    ) -> Option<Box<JobSpans>> {
        let method = headers.get(":method").unwrap_or(b"POST");
        let structured = event == Some(&ContentMode::Structured);
        let (request, event) = self.tracer.request(
            headers.get("traceparent"),
            headers.get("tracestate"),
            channel,
            std::str::from_utf8(method).unwrap_or("POST"),
            || {
                let binary = event.and_then(ContentMode::binary_event);
                (binary.map(span_event).unwrap_or_default(), now_ns())
            },
        )?;
        let mut subs = Vec::with_capacity(subscribers);
        subs.resize_with(subscribers, SubSpans::default);
        Some(Box::new(JobSpans {
            request,
            structured,
            event,
            subs,
        }))
    }

    fn record(&mut self, span: EndedSpan, now_ns: u64) {
        self.exporter.record(&span, now_ns / 1_000_000);
        self.tracer.recycle(span);
    }

    /// The export due at `now_ms` (`flush`: all that is held), if none is in flight.
    pub fn export_due(&mut self, now_ms: u64, flush: bool) -> Option<Export> {
        self.exporter.tick(now_ms, flush)
    }

    /// The export went out as call `token` (`None`: Envoy refused it, its spans are lost).
    pub fn exported(&mut self, token: Option<u32>) {
        match token {
            Some(token) => self.export_token = Some(token),
            None => self.exporter.answered(None),
        }
    }

    /// Whether `token` is the export in flight; if so, the collector's `status` is taken.
    pub fn export_answered(&mut self, token: u32, status: impl FnOnce() -> Option<u16>) -> bool {
        if self.export_token != Some(token) {
            return false;
        }
        self.export_token = None;
        self.exporter.answered(status());
        true
    }

    /// The warning due at `now_ms`, and the spans dropped since the last call.
    pub fn losses(&mut self, now_ms: u64) -> (Option<String>, u64) {
        (self.exporter.warning(now_ms), self.exporter.take_dropped())
    }

    /// Spans held, or an export in flight: the timer has work.
    pub fn busy(&self) -> bool {
        self.exporter.queued() > 0 || self.export_token.is_some()
    }
}

/// One traced fan-out's spans.
pub struct JobSpans {
    request: OpenSpan,
    /// A structured event, whose attributes come with its body.
    structured: bool,
    /// Its CloudEvents attributes, as every delivery's span carries them.
    event: EventFields,
    /// By subscriber index.
    subs: Vec<SubSpans>,
}

/// One subscriber's spans under way.
#[derive(Default)]
struct SubSpans {
    /// `send <cluster>`, from its first call.
    send: Option<OpenSpan>,
    /// The reply or dead letter under way: its leg, span and attempts so far.
    leg: Option<(Leg, OpenSpan, u32)>,
    /// The call in flight.
    attempt: Option<OpenSpan>,
    /// Attempts of the event so far.
    attempts: u32,
    /// When its last call ended, what it failed with, and the `Retry-After` it asked for.
    last_end_ns: u64,
    last_error: Option<String>,
    retry_after_ms: Option<u64>,
}

/// The `traceparent` and `tracestate` a call carries.
pub struct CallContext {
    pub traceparent: [u8; LEN_00],
    pub tracestate: Option<Rc<str>>,
}

impl JobSpans {
    /// A structured event's attributes, known once its body is in (`None`: the body is no
    /// structured event).
    pub fn structured_event(&mut self, attributes: Option<&Attributes>) {
        if !self.structured || !self.event.is_empty() {
            return;
        }
        if let Some(attributes) = attributes {
            self.event = span_event(attributes);
            self.request.event(&self.event);
        }
    }

    /// Subscriber `index`'s `leg` call goes out at `now_ns`: its attempt's span (and the
    /// delivery's, the reply's or the dead letter's, at their first call); its context.
    pub fn call(
        &mut self,
        tracing: &mut Tracing,
        sub: &Subscriber,
        index: usize,
        leg: Leg,
        now_ns: u64,
    ) -> Option<CallContext> {
        let s = self.subs.get_mut(index)?;
        let send = s.send.get_or_insert_with(|| {
            let to = destination(sub, Leg::Event);
            let ids = &mut tracing.tracer;
            self.request
                .leg(ids, trace::SpanLeg::Delivery, &to, &self.event, now_ns)
        });
        if leg != Leg::Event && s.leg.as_ref().is_none_or(|(l, _, _)| *l != leg) {
            let which = match leg {
                Leg::Reply => trace::SpanLeg::Reply,
                _ => trace::SpanLeg::DeadLetter,
            };
            let span = send.leg(
                &mut tracing.tracer,
                which,
                &destination(sub, leg),
                &self.event,
                now_ns,
            );
            if let Some((_, old, attempts)) = s.leg.replace((leg, span, 0)) {
                let outcome = outcome(attempts, false, false, s.last_error.as_deref());
                tracing.record(old.end_leg(&outcome, now_ns), now_ns);
            }
        }
        let (parent, resend) = match (&mut s.leg, leg) {
            (Some((_, span, attempts)), Leg::Reply | Leg::DeadLetter) => (&*span, attempts),
            _ => (&*send, &mut s.attempts),
        };
        // A wait and a `Retry-After` belong to a retry of the same leg.
        let retry_after_ms = s.retry_after_ms.take().filter(|_| *resend > 0);
        let backoff_ms = if *resend > 0 {
            now_ns.saturating_sub(s.last_end_ns) / 1_000_000
        } else {
            0
        };
        let attempt = parent.attempt(
            &mut tracing.tracer,
            *resend,
            backoff_ms,
            retry_after_ms,
            now_ns,
        );
        *resend = resend.saturating_add(1);
        let context = CallContext {
            traceparent: attempt.traceparent(),
            tracestate: attempt.tracestate().cloned(),
        };
        s.attempt = Some(attempt);
        Some(context)
    }

    /// Subscriber `index`'s call ended at `now_ns` (`status`: the answer's, `None` for none;
    /// `failure`: how it failed; `retry_after_ms`: what its answer asked to wait), and its
    /// delivery is now at `progress`.
    #[allow(clippy::too_many_arguments)]
    pub fn call_ended(
        &mut self,
        tracing: &mut Tracing,
        index: usize,
        status: Option<u16>,
        failure: Option<&Failure>,
        retry_after_ms: Option<u64>,
        progress: Progress<'_>,
        now_ns: u64,
    ) {
        let Some(s) = self.subs.get_mut(index) else {
            return;
        };
        let error = failure.map(Failure::to_string);
        if let Some(attempt) = s.attempt.take() {
            let span = attempt.end_attempt(status, error.as_deref(), now_ns);
            tracing.record(span, now_ns);
        }
        s.last_end_ns = now_ns;
        s.retry_after_ms = retry_after_ms;
        if error.is_some() {
            s.last_error = error;
        }
        s.advance(tracing, progress, now_ns);
    }

    /// The fan-out ended at `now_ns` (`progress`: where each subscriber's delivery is; calls
    /// still open were cancelled or lost): every span still open ends, the request's last.
    pub fn end<'p>(
        self,
        tracing: &mut Tracing,
        verdict: &trace::Verdict,
        progress: impl Fn(usize) -> Option<Progress<'p>>,
        now_ns: u64,
    ) {
        let JobSpans {
            request, mut subs, ..
        } = self;
        for (index, s) in subs.iter_mut().enumerate() {
            if let Some(attempt) = s.attempt.take() {
                let span = attempt.end_attempt(None, Some("no answer: cancelled or lost"), now_ns);
                tracing.record(span, now_ns);
            }
            if let Some(progress) = progress(index) {
                s.advance(
                    tracing,
                    Progress {
                        ended: true,
                        ..progress
                    },
                    now_ns,
                );
            }
        }
        tracing.record(request.end_request(verdict, now_ns), now_ns);
    }
}

impl SubSpans {
    /// Ends the reply's or dead letter's span once its leg is over, and the delivery's once
    /// the subscriber's delivery is.
    fn advance(&mut self, tracing: &mut Tracing, progress: Progress<'_>, now_ns: u64) {
        if let Some((leg, span, attempts)) = self.leg.take() {
            if progress.leg == leg && !progress.ended {
                self.leg = Some((leg, span, attempts));
            } else {
                let took = took_leg(leg, progress);
                let error = self.last_error.as_deref().filter(|_| !took);
                let span = span.end_leg(&outcome(attempts, took, false, error), now_ns);
                tracing.record(span, now_ns);
            }
        }
        if !progress.ended {
            return;
        }
        if let Some(send) = self.send.take() {
            let error = progress.failure.map(Failure::to_string);
            let error = error.as_deref().or(self.last_error.as_deref());
            let outcome = DeliveryOutcome {
                attempts: progress.event_attempts,
                delivered: progress.delivered,
                dead_lettered: progress.dead_lettered,
                error,
            };
            tracing.record(send.end_leg(&outcome, now_ns), now_ns);
        }
    }
}

/// Whether a reply or dead-letter `leg` that is over took the event.
fn took_leg(leg: Leg, progress: Progress<'_>) -> bool {
    match leg {
        Leg::Reply => progress.delivered,
        _ => progress.dead_lettered,
    }
}

fn outcome(
    attempts: u32,
    delivered: bool,
    dead_lettered: bool,
    error: Option<&str>,
) -> DeliveryOutcome<'_> {
    DeliveryOutcome {
        attempts,
        delivered,
        dead_lettered,
        error,
    }
}

/// Where `sub`'s `leg` call goes.
fn destination(sub: &Subscriber, leg: Leg) -> Destination<'_> {
    let target = match leg {
        Leg::Event => None,
        Leg::Reply => sub.reply.as_ref(),
        Leg::DeadLetter => sub.dead_letter.as_ref(),
    };
    match target {
        Some(target) => Destination {
            cluster: &target.cluster,
            authority: &target.authority,
            path: &target.path,
            fields: None,
        },
        None => Destination {
            cluster: &sub.cluster,
            authority: &sub.authority,
            path: &sub.path,
            fields: Some(&sub.span_destination),
        },
    }
}
