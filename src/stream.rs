//! One request, in the order Envoy calls its http context: the headers (admission), the body,
//! the trailers, the answers to the calls made from this stream, the end of the stream, and a
//! response coming back through the filter. The glue (`filter/`) forwards each callback here
//! and turns the returned [`Flow`] into proxy-wasm's `Action`.
//!
//! Read top to bottom, a request goes: [`admit`] on the headers (an [`Admitted`] or
//! the answer), the body held until end of stream, then `Stream::fan_out`: the event,
//! [`recipients::choose`] (who gets it), and [`Deliveries::start`] (the calls). The answer
//! comes back from [`Deliveries`] as a [`Finished`], and `Stream::answer` sends it, once.
//! With `dedupe`'s etcd store, the claims are one etcd call made from this stream: the
//! stream waits for its answer (`Stage::Claiming`) before the subscribers are called.
//!
//! How Envoy behaves here: the body reaches a filter that paused in the headers callback only
//! with `allow_on_headers_stop_iteration: true`; a call to a cluster Envoy does not know fails
//! at dispatch and gets no callback; a local reply is applied after the callback returns, and
//! a second one would hang the client, so a stream answers once and ignores what comes after.

use std::cell::RefCell;
use std::rc::Rc;

use crate::answer::Answer;
use crate::config::{BodyWait, Channel, Config};
use crate::dedupe::claim::{self, Ask, Claim, Claims};
use crate::dedupe::etcd::StoreError;
use crate::deliveries::{Continued, Deliveries, Finished, InLine, Job, Launched, Parked, Variant};
use crate::fan_out_state::FanOut;
use crate::headers::Forwarded;
use crate::host::Host;
use crate::recipients::{self, Request};
use crate::request::{admit, Admitted};
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
    /// Waiting for the etcd store's answer to `dedupe`'s claims (its call `token`).
    Claiming { token: u32, claiming: Box<Claiming> },
    /// Its claims wait to go out with others' (the deliveries hold the request); the root
    /// context continues it, and the stream learns what became of it at its next callback
    /// ([`Stream::adopt`]).
    Parked,
    /// A sync fan-out in the deliveries, answered when it ends.
    Delivering { job: u64 },
    /// The answer is sent; whatever comes now is ignored.
    Answered,
}

/// A request whose recipients are chosen but not yet claimed in the etcd store.
struct Claiming {
    ask: Ask,
    channel: Rc<Channel>,
    fanout: FanOut,
    body: Vec<u8>,
    forwarded: Forwarded,
    converted: Option<Box<Variant>>,
}

/// The event as it came (body, forwarded headers) and as `delivery.format` converted it.
type Message = (Vec<u8>, Forwarded, Option<Box<Variant>>);

/// One request.
pub struct Stream<H> {
    id: u32,
    /// The root context that made it: claim batches sent from here are that root's calls.
    root: u32,
    host: H,
    config: Option<Rc<Config>>,
    counter: Counter,
    deliveries: Rc<RefCell<Deliveries>>,
    stage: Stage,
    /// When the request's headers arrived, on the host's clock.
    started_ms: u64,
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
        deliveries: Rc<RefCell<Deliveries>>,
    ) -> Self {
        Stream {
            id,
            root,
            host,
            config,
            counter,
            deliveries,
            stage: Stage::Headers,
            started_ms: 0,
        }
    }

    pub fn on_request_headers(&mut self, end_of_stream: bool) -> Flow {
        self.started_ms = self.host.now_ms();
        self.count(|tally| tally.received());
        let Some(config) = self.config.clone() else {
            self.reject(Answer::no_configuration());
            return Flow::Pause;
        };
        match admit(&config, &self.host.request_headers()) {
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
        if matches!(self.stage, Stage::Claiming { token: t, .. } if t == token) {
            self.claim_answered(num_headers, body_size);
            return;
        }
        let finished = self.deliveries.borrow_mut().on_response(
            &self.host,
            token,
            num_headers,
            body_size,
            false,
        );
        if let Some(finished) = finished {
            self.finished(finished);
        }
        self.flush_settles();
    }

    /// The etcd settles of the fan-outs that ended in this callback go out now (as calls of
    /// the root context), if no settle txn is in flight; an answer held for a settle that
    /// failed at once goes out.
    fn flush_settles(&mut self) {
        let failed = self
            .deliveries
            .borrow_mut()
            .flush_settles(&self.host, self.root);
        for finished in failed {
            self.finished(finished);
        }
    }

    /// What the root context made of this request while it was parked, if it did.
    fn adopt(&mut self) {
        if !matches!(self.stage, Stage::Parked) {
            return;
        }
        let continued = self.deliveries.borrow_mut().claims.adopt(self.id);
        match continued {
            Some(Continued::Answered) => self.stage = Stage::Answered,
            Some(Continued::Delivering(job)) => self.stage = Stage::Delivering { job },
            None => {}
        }
    }

    /// The stream ended (its client may have left before the answer).
    pub fn on_done(&mut self) -> bool {
        self.adopt();
        match &self.stage {
            // Its claim txn will not be answered here now (Envoy cancels it): the claims
            // parked meanwhile go out.
            Stage::Claiming { token, .. } => {
                let token = *token;
                self.claim_landed(token);
            }
            // Not claimed yet: nothing to undo. (In a batch in flight, the root continues it,
            // and finds nobody to answer.)
            Stage::Parked if self.deliveries.borrow_mut().claims.forget(self.id) => {
                log::info!(
                    "[#{}] the client went away before the fan-out started; nothing was \
                     claimed or called",
                    self.id
                );
            }
            _ => {}
        }
        if let Stage::Delivering { job } = self.stage {
            let mut deliveries = self.deliveries.borrow_mut();
            if deliveries.awaits_answer(job) {
                log::info!(
                    "[#{}] the client went away before the fan-out ended; its calls are \
                     cancelled",
                    self.id
                );
                deliveries.abandon(&self.host, job);
            }
        }
        self.flush_settles();
        true
    }

    /// The filter answers every request itself, so a response coming back through it before
    /// that answer was made elsewhere: by the router, when `body_wait: continue` is used
    /// without a buffer filter after this one (the router acted on the headers alone), or by
    /// Envoy itself (a stream timeout). Either way the sender got another answer: do not fan
    /// out after it, and say why.
    pub fn on_response_headers(&mut self) -> Flow {
        self.adopt();
        match self.stage {
            Stage::Answered => {}
            // The root context answered for this stream: the fan-out is over, or goes on
            // with best-effort deliveries only.
            Stage::Delivering { job }
                if self
                    .deliveries
                    .try_borrow()
                    .is_ok_and(|deliveries| !deliveries.awaits_answer(job)) =>
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
            _ => {
                log::info!(
                    "[#{}] Envoy answered the request before fanout did (e.g. a stream timeout)",
                    self.id
                );
                if let Stage::Delivering { job } = self.stage {
                    if let Ok(mut deliveries) = self.deliveries.try_borrow_mut() {
                        deliveries.abandon(&self.host, job);
                    }
                }
                if matches!(self.stage, Stage::Parked) {
                    if let Ok(mut deliveries) = self.deliveries.try_borrow_mut() {
                        deliveries.claims.forget(self.id);
                    }
                }
                self.stage = Stage::Answered;
            }
        }
        Flow::Continue
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
        // Parses a structured body only if a filter, `require_cloudevents` or dedupe's
        // identity needs it; attributes `None` match only subscribers without a filter.
        let event = match admitted.event.complete(&body) {
            Ok(event) => event,
            Err(answer) => {
                self.reject(answer);
                return;
            }
        };
        // `delivery.format`: the event converted once, or the 400, before anything is claimed.
        let converted = match Variant::prepare(channel, &admitted.forwarded, &body) {
            Ok(converted) => converted,
            Err(answer) => {
                self.reject(answer);
                return;
            }
        };
        let request = Request {
            log_id: self.id,
            started_ms: self.started_ms,
            channel,
            event: &event,
        };
        let deliveries = &self.deliveries;
        let host = &self.host;
        let chosen = recipients::choose(
            &self.host,
            &self.counter,
            config,
            &request,
            || deliveries.borrow().async_in_flight(),
            |clusters| deliveries.borrow_mut().admit(host, config, clusters),
            |until| deliveries.borrow().store.leases.pick(until),
        );
        let recipients = match chosen {
            Ok(recipients) => recipients,
            Err(answer) => {
                self.reject(answer);
                return;
            }
        };
        let forwarded = admitted.forwarded;
        match recipients.claim {
            Claim::Done(claims) => {
                let message = (body, forwarded, converted);
                self.deliver(config, channel, recipients.fanout, claims, message)
            }
            Claim::Ask(ask) => {
                let message = (body, forwarded, converted);
                self.ask(config, channel, recipients.fanout, ask, message);
            }
        }
    }

    /// The etcd store must be asked first. With no claim txn of this worker in flight and a
    /// lease held, from this stream: its answer comes back here, and the stream waits. Else
    /// the request is parked, and goes out with the others parked meanwhile in one txn when
    /// the one in flight is answered (or, without a lease, once one is granted: up to the
    /// store's timeout, then it is a store error); the root context continues it then.
    fn ask(
        &mut self,
        config: &Rc<Config>,
        channel: &Rc<Channel>,
        fanout: FanOut,
        mut ask: Ask,
        message: Message,
    ) {
        let unleased = !ask.lease_from(|until| self.deliveries.borrow().store.leases.pick(until));
        if unleased || self.deliveries.borrow().claims.must_park() {
            let job = self.job(config, channel, fanout, message);
            self.deliveries.borrow_mut().claims.park(Parked {
                stream: self.id,
                ask,
                job,
            });
            self.stage = Stage::Parked;
            return;
        }
        match self
            .host
            .dispatch(&ask.cluster, ask.headers(), &ask.body(), ask.timeout)
        {
            Ok(token) => {
                let timeout = u64::try_from(ask.timeout.as_millis()).unwrap_or(u64::MAX);
                self.deliveries
                    .borrow_mut()
                    .claims
                    .flying(token, self.started_ms, timeout);
                let (body, forwarded, converted) = message;
                self.stage = Stage::Claiming {
                    token,
                    claiming: Box::new(Claiming {
                        ask,
                        channel: channel.clone(),
                        fanout,
                        body,
                        forwarded,
                        converted,
                    }),
                };
            }
            Err(failure) => {
                let error = StoreError::new(format!("refused at dispatch: {failure}"));
                self.store_failed(config, channel, fanout, &error, message);
            }
        }
    }

    /// The claim txn in flight (`token`) was answered or cancelled: the claims parked
    /// meanwhile go out together, for the root context.
    fn claim_landed(&mut self, token: u32) {
        let mut deliveries = self.deliveries.borrow_mut();
        deliveries.claims.landed(token);
        deliveries.send_parked(&self.host, self.root);
    }

    /// The etcd store answered this request's claims.
    fn claim_answered(&mut self, num_headers: usize, body_size: usize) {
        let Some(config) = self.config.clone() else {
            return;
        };
        let Stage::Claiming { token, claiming } =
            std::mem::replace(&mut self.stage, Stage::Headers)
        else {
            return;
        };
        // The answer is read before anything else is sent from this callback.
        let reply = claim::etcd_reply(&self.host, num_headers, body_size);
        self.claim_landed(token);
        let Claiming {
            ask,
            channel,
            mut fanout,
            body,
            forwarded,
            converted,
        } = *claiming;
        let message = (body, forwarded, converted);
        match claim::answered(&self.host, &self.counter, ask, &reply, &mut fanout) {
            Ok(claims) => self.deliver(&config, &channel, fanout, claims, message),
            Err(error) => self.store_failed(&config, &channel, fanout, &error, message),
        }
    }

    /// The dedupe store failed: everyone is called (`on_store_error: deliver`), or 503.
    fn store_failed(
        &mut self,
        config: &Rc<Config>,
        channel: &Rc<Channel>,
        fanout: FanOut,
        error: &StoreError,
        message: Message,
    ) {
        let now = self.started_ms;
        let deliveries = &self.deliveries;
        if error.lease_lost() {
            deliveries.borrow_mut().store.leases.forget();
        }
        let failed = claim::store_failed(&self.host, &self.counter, config, self.id, error, || {
            deliveries.borrow_mut().store.warn(now)
        });
        match failed {
            Ok(()) => {
                let job = Job {
                    unrecorded: true,
                    ..self.job(config, channel, fanout, message)
                };
                self.launch(job);
            }
            Err(answer) => self.reject(answer),
        }
    }

    /// The fan-out of this request: who gets the event is decided (`fanout`) but not yet
    /// claimed.
    fn job(
        &self,
        config: &Rc<Config>,
        channel: &Rc<Channel>,
        fanout: FanOut,
        (body, forwarded, converted): Message,
    ) -> Job {
        Job {
            config: config.clone(),
            channel: channel.clone(),
            fanout,
            body,
            forwarded,
            converted,
            answer_to: None,
            log_id: self.id,
            started_ms: self.started_ms,
            redelivery: None,
            unrecorded: false,
            line: InLine::default(),
        }
    }

    /// Who gets the event is decided (and claimed): hand it to the deliveries.
    fn deliver(
        &mut self,
        config: &Rc<Config>,
        channel: &Rc<Channel>,
        fanout: FanOut,
        claims: Option<Claims>,
        message: Message,
    ) {
        let job = Job {
            redelivery: claims,
            ..self.job(config, channel, fanout, message)
        };
        self.launch(job);
    }

    /// Hands the fan-out `job` to the deliveries: answered now, or delivering.
    fn launch(&mut self, job: Job) {
        let launched = self
            .deliveries
            .borrow_mut()
            .launch(&self.host, job, self.id, false);
        match launched {
            Launched::Answer(answer) if answer.status == 202 => self.answer(answer, false),
            Launched::Answer(answer) => self.reject(answer),
            Launched::Delivering(id, finished) => {
                self.stage = Stage::Delivering { job: id };
                if let Some(finished) = finished {
                    self.finished(finished);
                }
            }
        }
        self.flush_settles();
    }

    /// A fan-out ended while this stream's callback runs.
    fn finished(&mut self, finished: Finished) {
        match finished.answer_to {
            Some(stream) if stream == self.id => self.answer(finished.answer, true),
            Some(stream) => answer_stream(&self.host, stream, self.id, &finished.answer),
            None => {}
        }
    }

    /// Sends the answer (once), counting it unless the deliveries did.
    fn answer(&mut self, answer: Answer, counted: bool) {
        if matches!(self.stage, Stage::Answered) {
            return;
        }
        self.host.respond(&answer);
        self.stage = Stage::Answered;
        if !counted {
            self.count(|tally| tally.answered(answer.status));
        }
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
        self.answer(answer, false);
    }

    fn count(&self, record: impl FnOnce(&mut crate::metrics::Tally)) {
        self.counter.count(&self.host, record);
    }
}

/// Answers `stream` from another context: Envoy applies host calls to the effective context.
/// A stream that is gone (its client left) cannot be answered, and that is all.
pub fn answer_stream<H: Host>(host: &H, stream: u32, current: u32, answer: &Answer) {
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
