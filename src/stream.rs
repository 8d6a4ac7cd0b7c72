//! One request, in the order Envoy calls its http context: the headers (admission), the body,
//! the trailers, the answers to the calls made from this stream, the end of the stream, and a
//! response coming back through the filter. The glue (`filter/`) forwards each callback here
//! and turns the returned [`Flow`] into proxy-wasm's `Action`.
//!
//! Read top to bottom, a request goes: [`admit`] on the headers (an [`Admitted`] or
//! the answer), the body held until end of stream, then `Stream::fan_out`: the event,
//! [`recipients::choose`] (who gets it), [`Pipeline::admit`] (whether it fits the worker),
//! its claims ([`recipients::Chosen::claim`]), and [`Pipeline::begin`] (claim, deliver,
//! settle).
//! The answer comes back from the [`Pipeline`] as a [`Finished`] (to this stream's callback,
//! or from the root context's, `answer_stream`), and `Stream::answer` sends it, once. With
//! `dedupe`'s etcd store the stream waits for its claim (`Stage::Claiming`) before the
//! subscribers are called; the pipeline holds the request until then.
//!
//! How Envoy behaves here: the body reaches a filter that paused in the headers callback only
//! with `allow_on_headers_stop_iteration: true`; a call to a cluster Envoy does not know fails
//! at dispatch and gets no callback; a local reply is applied after the callback returns, and
//! a second one would hang the client, so a stream answers once and ignores what comes after.

use std::cell::RefCell;
use std::rc::Rc;

use crate::answer::Answer;
use crate::cell::with_mut;
use crate::config::{BodyWait, Config};
use crate::dedupe::claim::Claim;
use crate::deliveries::{Finished, InLine, Job, JobSpans, Variant};
use crate::host::Host;
use crate::pipeline::{Actor, Pipeline};
use crate::recipients::{self, Incoming};
use crate::request::{admit, Admitted, Event};
use crate::telemetry::Counter;

/// What Envoy should do with the request after a callback: what proxy-wasm calls `Action`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Let it go on to the next filter.
    Continue,
    /// Hold it here.
    Pause,
}

/// Where one request is.
enum Stage {
    /// Nothing seen yet.
    Headers,
    /// Admitted; buffering the body until end of stream.
    Body { admitted: Admitted, received: usize },
    /// Handed to the pipeline to wait for its `dedupe` claim in the etcd store (its own
    /// claim txn, or parked to go out with others'). Its answer comes as any other; should
    /// the stream end first, the pipeline says where the request is (`Stream::waiting_job`).
    Claiming,
    /// A sync fan-out in the deliveries, answered when it ends.
    Delivering { job: u64 },
    /// The answer is sent; whatever comes now is ignored.
    Answered,
}

/// One request.
pub struct Stream<H> {
    id: u32,
    /// The root context that made it: claim batches sent from here are that root's calls.
    root: u32,
    host: H,
    config: Option<Rc<Config>>,
    counter: Counter,
    pipeline: Rc<RefCell<Pipeline>>,
    stage: Stage,
    /// When the request's headers arrived, on the host's clock.
    started_ms: u64,
    /// Its spans, when `tracing` is on and the request is traced.
    spans: Option<Box<JobSpans>>,
}

impl<H: Host> Stream<H> {
    /// A request on the context `id`, served with `config` (`None`: the plugin has no valid
    /// configuration).
    pub fn new(
        id: u32,
        root: u32,
        host: H,
        config: Option<Rc<Config>>,
        counter: Counter,
        pipeline: Rc<RefCell<Pipeline>>,
    ) -> Self {
        Stream {
            id,
            root,
            host,
            config,
            counter,
            pipeline,
            stage: Stage::Headers,
            started_ms: 0,
            spans: None,
        }
    }

    pub fn on_request_headers(&mut self, end_of_stream: bool) -> Flow {
        self.started_ms = self.host.now_ms();
        self.count(|tally| tally.received());
        let Some(config) = self.config.clone() else {
            self.reject(Answer::no_configuration());
            return Flow::Pause;
        };
        let headers = self.host.request_headers();
        let mut admitted = admit(&config, &headers);
        if let (Ok(admitted), Some(_)) = (&mut admitted, &config.tracing) {
            let channel = config.channel(admitted.channel);
            let event = admitted.event.mode.as_ref();
            self.spans = channel.and_then(|channel| {
                let subscribers = channel.subscribers.len();
                let (host, name) = (&self.host, channel.name.as_str());
                with_mut(&self.pipeline, |p| {
                    p.traced(host, &headers, event, name, subscribers)
                })
                .flatten()
            });
            admitted.event.traced = self.spans.is_some();
        }
        match admitted {
            Err(answer) => self.reject(answer),
            // A request without a body: its headers are all there is.
            Ok(admitted) if end_of_stream => self.fan_out(&config, admitted, Vec::new()),
            Ok(admitted) => {
                self.stage = Stage::Body {
                    admitted,
                    received: 0,
                };
                if config.body_wait == BodyWait::Continue {
                    // The headers go on to the buffer filter that must follow this one; it
                    // keeps them from the router until the body is complete, while the body
                    // still reaches this filter first and is held here.
                    return Flow::Continue;
                }
            }
        }
        // Nothing goes on to the router. With `allow_on_headers_stop_iteration`, Envoy still
        // delivers the body.
        Flow::Pause
    }

    pub fn on_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Flow {
        let Some(config) = self.config.clone() else {
            return Flow::Pause;
        };
        let Stage::Body { received, .. } = &mut self.stage else {
            return Flow::Pause;
        };
        // `body_size` is all that Envoy has buffered so far, since every call paused.
        *received = body_size;
        if body_size as u64 > config.max_body_bytes {
            self.reject(Answer::too_large(config.max_body_bytes));
            return Flow::Pause;
        }
        if end_of_stream {
            self.body_complete(&config);
        }
        Flow::Pause
    }

    pub fn on_request_trailers(&mut self) -> Flow {
        // Trailers end the request: the body is complete without an end_of_stream body call.
        if let Some(config) = self.config.clone() {
            if matches!(self.stage, Stage::Body { .. }) {
                self.body_complete(&config);
            }
        }
        Flow::Pause
    }

    /// The answer to a call this stream made.
    pub fn on_call_response(&mut self, token: u32, num_headers: usize, body_size: usize) {
        let actor = self.actor();
        let finished = with_mut(&self.pipeline, |p| {
            p.on_response(&self.host, actor, token, num_headers, body_size)
        });
        self.finished(finished.unwrap_or_default());
    }

    fn actor(&self) -> Actor {
        Actor::Stream {
            id: self.id,
            root: self.root,
        }
    }

    /// The sync fan-out whose answer this stream still waits for, if one is under way:
    /// the one it began, or, for a request that waited for its claim, the one the claim's
    /// answer started (wherever that answer came).
    fn waiting_job(&self) -> Option<u64> {
        let pipeline = self.pipeline.try_borrow().ok()?;
        match self.stage {
            Stage::Delivering { job } => pipeline.awaits_answer(job).then_some(job),
            Stage::Claiming => pipeline.job_of(self.id),
            _ => None,
        }
    }

    /// The stream ended (its client may have left before the answer).
    pub fn on_done(&mut self) -> bool {
        if let Some(job) = self.waiting_job() {
            log::info!(
                "[#{}] the client went away before the fan-out ended; it is dropped, \
                 with no retry, reply or dead letter",
                self.id
            );
            let actor = self.actor();
            let finished = with_mut(&self.pipeline, |p| p.abandon(&self.host, actor, job));
            self.finished(finished.unwrap_or_default());
        } else if matches!(self.stage, Stage::Claiming) {
            // Not claimed yet: nothing to undo. (In a batch in flight, its claim's answer
            // continues it, and finds nobody to answer.)
            let actor = self.actor();
            let unsent = with_mut(&self.pipeline, |p| p.forget(&self.host, actor, true));
            if unsent == Some(true) {
                log::info!(
                    "[#{}] the client went away before the fan-out started; nothing was \
                     claimed or called",
                    self.id
                );
            }
        }
        true
    }

    /// The filter answers every request itself, so a response coming back through it before
    /// that answer was made elsewhere: by the router, when `body_wait: continue` is used
    /// without a buffer filter after this one (the router acted on the headers alone), or by
    /// Envoy itself (a stream timeout). Either way the sender got another answer: do not fan
    /// out after it, and say why.
    pub fn on_response_headers(&mut self) -> Flow {
        let job = self.waiting_job();
        match self.stage {
            Stage::Answered => {}
            // The root context answered for this stream: the fan-out is over, or goes on
            // with best-effort deliveries only; or the request that waited for its claim was
            // answered.
            Stage::Delivering { .. } if job.is_none() => self.stage = Stage::Answered,
            Stage::Claiming
                if job.is_none()
                    && self
                        .pipeline
                        .try_borrow()
                        .is_ok_and(|pipeline| !pipeline.claiming(self.id)) =>
            {
                self.stage = Stage::Answered;
            }
            Stage::Body { .. }
                if self.config.as_ref().map(|c| c.body_wait) == Some(BodyWait::Continue) =>
            {
                log::error!(
                    "[#{}] the request reached the router before fanout answered it: with \
                     \"body_wait\": \"continue\" an Envoy buffer filter must follow fanout; \
                     this request was not fanned out",
                    self.id
                );
                self.count(|tally| tally.reached_router());
                self.stage = Stage::Answered;
            }
            _ => self.answered_by_envoy(job),
        }
        Flow::Continue
    }

    /// Envoy answered the request before fanout did (e.g. a stream timeout): its sync
    /// fan-out (`job`) is abandoned, or its claim forgotten.
    fn answered_by_envoy(&mut self, job: Option<u64>) {
        log::info!(
            "[#{}] Envoy answered the request before fanout did (e.g. a stream timeout)",
            self.id
        );
        let (host, actor) = (&self.host, self.actor());
        let abandoned = match (job, &self.stage) {
            (Some(job), _) => with_mut(&self.pipeline, |p| p.abandon(host, actor, job)),
            (None, Stage::Claiming) => {
                with_mut(&self.pipeline, |p| p.forget(host, actor, false));
                None
            }
            _ => None,
        };
        self.stage = Stage::Answered;
        self.finished(abandoned.unwrap_or_default());
    }

    fn body_complete(&mut self, config: &Rc<Config>) {
        if let Stage::Body { admitted, received } =
            std::mem::replace(&mut self.stage, Stage::Headers)
        {
            let body = if received > 0 {
                self.host.request_body(received)
            } else {
                Vec::new()
            };
            self.fan_out(config, admitted, body);
        }
    }

    /// The request is complete: decide who gets the event and hand it to the deliveries.
    /// Sync: the calls go out now, from this stream, and the answer comes when they end.
    /// Async: 202 now, the root context delivers.
    fn fan_out(&mut self, config: &Rc<Config>, admitted: Admitted, body: Vec<u8>) {
        let Some(channel) = config.channel(admitted.channel) else {
            self.reject(Answer::no_such_channel());
            return;
        };
        // Parses a structured body only if a filter, `require_cloudevents`, dedupe's identity
        // or the spans need it; attributes `None` match only subscribers without a filter.
        // Then `delivery.format`: the event converted once, or the 400, before anything is
        // claimed.
        let prepared = admitted.event.complete(&body).and_then(|event| {
            Variant::prepare(channel, &event, &admitted.forwarded, &body).map(|c| (event, c))
        });
        let (event, converted) = match prepared {
            Ok(prepared) => prepared,
            Err(answer) => {
                self.reject(answer);
                return;
            }
        };
        let request = Incoming {
            log_id: self.id,
            started_ms: self.started_ms,
            channel,
            event: &event,
        };
        let chosen = recipients::choose(&self.host, &self.counter, config, &request);
        // Before anything is claimed: a refused request must leave no claim behind.
        let room = &chosen.room;
        let fits = with_mut(&self.pipeline, |p| p.admit(&self.host, config, room));
        if let Some(Err(answer)) = fits {
            self.reject(answer);
            return;
        }
        let recipients = chosen.claim(&self.host, &self.counter, config, &request);
        let spans = self.spans_for(&event);
        let job = Job {
            config: config.clone(),
            channel: channel.clone(),
            fanout: recipients.fanout,
            body,
            forwarded: admitted.forwarded,
            converted,
            answer_to: None,
            log_id: self.id,
            started_ms: self.started_ms,
            claims: None,
            unrecorded: false,
            line: InLine::default(),
            spans,
        };
        self.begin(job, recipients.claim);
    }

    /// Its spans, if it is traced, with a structured event's attributes now that the body
    /// is in.
    fn spans_for(&mut self, event: &Event) -> Option<Box<JobSpans>> {
        let mut spans = self.spans.take()?;
        spans.structured_event(event.attributes.as_ref());
        Some(spans)
    }

    /// Hands the request to the pipeline (claim, deliver, settle, answer): the stream
    /// delivers, or waits for its claim, or is answered at once.
    fn begin(&mut self, job: Job, claim: Option<Claim>) {
        self.stage = Stage::Claiming;
        let actor = self.actor();
        let outcome = with_mut(&self.pipeline, |p| p.begin(&self.host, actor, job, claim));
        let outcome = outcome.unwrap_or_default();
        if let Some(job) = outcome.delivering {
            self.stage = Stage::Delivering { job };
        }
        self.finished(outcome.finished);
    }

    /// Answers sent from this stream's callback: its own, and those of other streams whose
    /// fan-outs ended here. (The check in line: most calls' answers end nothing.)
    #[inline(always)]
    fn finished(&mut self, finished: Vec<Finished>) {
        if !finished.is_empty() {
            self.answer_finished(finished);
        }
    }

    /// Sends the answers of fan-outs that ended (at least one).
    fn answer_finished(&mut self, finished: Vec<Finished>) {
        for done in finished {
            match done.answer_to {
                Some(stream) if stream == self.id => self.answer(done.answer),
                Some(stream) => {
                    answer_stream(&self.host, &self.counter, stream, self.id, &done.answer)
                }
                None => {}
            }
        }
    }

    /// Sends the answer (once) and counts it: the one place a stream's own answer is sent.
    fn answer(&mut self, answer: Answer) {
        if matches!(self.stage, Stage::Answered) {
            return;
        }
        self.host.respond(&answer);
        self.stage = Stage::Answered;
        self.count(|tally| tally.answered(answer.status));
    }

    /// Reject with a log line a user can act on (at debug for what is no error: OPTIONS).
    fn reject(&mut self, answer: Answer) {
        let level = if answer.status >= 400 {
            log::Level::Info
        } else {
            log::Level::Debug
        };
        log::log!(
            level,
            "[#{}] answered {}: {}",
            self.id,
            answer.status,
            String::from_utf8_lossy(&answer.body)
        );
        self.answer(answer);
    }

    fn count(&self, record: impl FnOnce(&mut crate::metrics::Tally)) {
        self.counter.count(&self.host, record);
    }
}

/// Answers `stream` from another context (counted by `counter`, that context's): Envoy
/// applies host calls to the effective context. A stream that is gone (its client left)
/// cannot be answered, and that is all.
pub fn answer_stream<H: Host>(
    host: &H,
    counter: &Counter,
    stream: u32,
    current: u32,
    answer: &Answer,
) {
    counter.count(host, |tally| tally.answered(answer.status));
    if host.set_effective_context(stream) {
        host.respond(answer);
    } else {
        log::debug!(
            "[#{stream}] the client left before its answer ({})",
            answer.status
        );
    }
    host.set_effective_context(current);
}
