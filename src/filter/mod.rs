//! The only part of `fanout` that touches proxy-wasm: the root context (configuration) and
//! the http context (one request), in the order Envoy calls them.
//!
//! Each callback gathers what Envoy offers, hands it to the pure core (admission, the
//! fan-out state, the verdict) and performs what the core decides through a [`Host`].
//!
//! Calls and their answers belong to the [`engine::Engine`], shared by the root context and
//! the streams; see there for who sends what.
//!
//! How Envoy behaves here (see the project's Envoy notes): the body reaches a filter that
//! paused in the headers callback only with `allow_on_headers_stop_iteration: true`; a call to
//! a cluster Envoy does not know fails at dispatch and gets no callback; a local reply is
//! applied after the callback returns, and a second one would hang the client, so a stream
//! answers once and ignores what comes after.

mod engine;
pub mod host;
mod redelivery;
mod telemetry;
#[cfg(test)]
mod tests;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};

use crate::answer::Answer;
use crate::config::{BodyWait, Config, Mode, ReportDetail};
use crate::fanout::FanOut;
use crate::request::{admit, too_large, Admitted};
use engine::{Engine, Finished, Job};
pub use host::{Host, ProxyHost};
use telemetry::Telemetry;

/// How often the root context hands the counts to Envoy's stats.
const METRICS_FLUSH: Duration = Duration::from_secs(1);
/// The root context's timer while deliveries may need it (retries, async): the resolution of
/// backoff delays, and the most an async event waits before its calls go out.
const DELIVERY_TICK: Duration = Duration::from_millis(10);

/// The plugin: holds the configuration, parsed once per `on_configure`, shared (`Rc`) with
/// every stream created after it. A stream keeps the configuration it started with.
pub struct FanoutRoot<H> {
    id: u32,
    host: H,
    config: Option<Rc<Config>>,
    /// This worker's counts, shared with its streams; flushed to Envoy on the timer.
    telemetry: Rc<RefCell<Telemetry>>,
    engine: Rc<RefCell<Engine>>,
    tick: Duration,
    last_flush_ms: u64,
}

/// What every root context of one VM shares. A configuration update (e.g. through ECDS)
/// starts a new root context in the same VM while the old one's streams and deliveries are
/// still under way: they must go on counting into the same tally, and the new root's timer
/// must carry on the old one's retries.
#[derive(Clone)]
pub struct VmShared {
    telemetry: Rc<RefCell<Telemetry>>,
    engine: Rc<RefCell<Engine>>,
}

impl Default for VmShared {
    fn default() -> Self {
        let telemetry: Rc<RefCell<Telemetry>> = Rc::default();
        VmShared {
            engine: Rc::new(RefCell::new(Engine::new(telemetry.clone()))),
            telemetry,
        }
    }
}

thread_local! {
    /// One per VM: Envoy runs each VM on one thread.
    static VM_SHARED: VmShared = VmShared::default();
}

impl VmShared {
    /// This VM's.
    pub fn of_this_vm() -> VmShared {
        VM_SHARED.with(VmShared::clone)
    }
}

impl<H: Host + Clone + 'static> FanoutRoot<H> {
    /// A root context with state of its own (tests).
    pub fn new(id: u32, host: H) -> Self {
        FanoutRoot::with_shared(id, host, VmShared::default())
    }

    /// A root context sharing `shared` with the VM's other root contexts.
    pub fn with_shared(id: u32, host: H, shared: VmShared) -> Self {
        FanoutRoot {
            id,
            host,
            config: None,
            engine: shared.engine,
            telemetry: shared.telemetry,
            tick: Duration::ZERO,
            last_flush_ms: 0,
        }
    }

    /// The timer the current configuration and the deliveries in flight need.
    fn retune_timer(&mut self) {
        let config = self.config.as_deref();
        let busy = self
            .engine
            .try_borrow()
            .is_ok_and(|engine| engine.has_timed_work());
        let wanted = if busy || config.is_some_and(|c| c.needs_timer) {
            DELIVERY_TICK
        } else if config.is_some_and(|c| c.metrics) {
            METRICS_FLUSH
        } else {
            Duration::ZERO
        };
        if wanted != self.tick {
            self.host.set_tick_period(wanted);
            self.tick = wanted;
        }
    }

    /// Answers the streams whose fan-outs ended during a root callback.
    fn deliver(&self, finished: Vec<Finished>) {
        for done in finished {
            if let Some(stream) = done.answer_to {
                answer_stream(&self.host, stream, self.id, &done.answer);
            }
        }
    }
}

/// Answers `stream` from another context: Envoy applies host calls to the effective context.
/// A stream that is gone (its client left) cannot be answered, and that is all.
fn answer_stream<H: Host>(host: &H, stream: u32, current: u32, answer: &Answer) {
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

impl<H: Host + Clone + 'static> Context for FanoutRoot<H> {
    /// The plugin is being retired (a newer configuration took over, or Envoy stops): hand
    /// over what was counted since the last tick.
    fn on_done(&mut self) -> bool {
        if let Ok(mut telemetry) = self.telemetry.try_borrow_mut() {
            telemetry.flush(&self.host);
        }
        true
    }

    /// Answers to the calls the root made (retries, async deliveries).
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let finished =
            self.engine
                .borrow_mut()
                .on_response(&self.host, token_id, num_headers, body_size);
        self.deliver(finished.into_iter().collect());
    }
}

impl<H: Host + Clone + 'static> RootContext for FanoutRoot<H> {
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        self.host.follow_log_level();
        true
    }

    /// A configuration that does not validate is refused: Envoy does not start with it, and
    /// on an update keeps serving the previous one.
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        self.host.follow_log_level();
        let bytes = self.host.plugin_configuration().unwrap_or_default();
        match Config::from_json(&bytes) {
            Ok(config) => {
                for name in config.forward.sensitive_entries() {
                    log::warn!(
                        "forward_headers lists \"{name}\": it is forwarded to every \
                         subscriber"
                    );
                }
                for warning in &config.warnings {
                    log::warn!("{warning}");
                }
                let subscribers: usize = config.channels.iter().map(|c| c.subscribers.len()).sum();
                log::info!(
                    "configured {} channel(s), {} subscriber(s)",
                    config.channels.len(),
                    subscribers
                );
                if config.metrics {
                    let mut telemetry = self.telemetry.borrow_mut();
                    telemetry.tally.register_requests();
                    if config.dedupe.is_some() {
                        telemetry.tally.register_dedupe();
                    }
                    for subscriber in config.channels.iter().flat_map(|c| &c.subscribers) {
                        telemetry.tally.register_subscriber(&subscriber.cluster);
                        if subscriber.reply.is_some() {
                            telemetry.tally.register_replies(&subscriber.cluster);
                        }
                    }
                    telemetry.define_all(&self.host);
                }
                redelivery::prepare(&self.host, &config);
                self.config = Some(Rc::new(config));
                self.retune_timer();
                true
            }
            Err(error) => {
                log::error!("invalid plugin configuration: {error}");
                false
            }
        }
    }

    fn on_tick(&mut self) {
        let finished = self.engine.borrow_mut().tick(&self.host);
        self.deliver(finished);
        let now = self.host.now_ms();
        if self.tick >= METRICS_FLUSH || now.saturating_sub(self.last_flush_ms) >= 1000 {
            self.telemetry.borrow_mut().flush(&self.host);
            self.last_flush_ms = now;
        }
        self.retune_timer();
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let metrics = self.config.as_ref().is_some_and(|c| c.metrics);
        Some(Box::new(FanoutStream {
            id: context_id,
            host: self.host.clone(),
            config: self.config.clone(),
            telemetry: metrics.then(|| self.telemetry.clone()),
            engine: self.engine.clone(),
            stage: Stage::Headers,
            started_ms: 0,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Where one request is.
enum Stage {
    /// Nothing seen yet.
    Headers,
    /// Admitted; buffering the body until end of stream.
    Body { admitted: Admitted, received: usize },
    /// A sync fan-out in the engine, answered when it ends.
    Delivering { job: u64 },
    /// The answer is sent; whatever comes now is ignored.
    Answered,
}

/// One request.
pub struct FanoutStream<H> {
    id: u32,
    host: H,
    config: Option<Rc<Config>>,
    /// `None` when the configuration turns metrics off.
    telemetry: Option<Rc<RefCell<Telemetry>>>,
    engine: Rc<RefCell<Engine>>,
    stage: Stage,
    /// When the request's headers arrived, on the host's clock.
    started_ms: u64,
}

impl<H: Host> FanoutStream<H> {
    /// Counts something, and flushes at once if a histogram buffer is full.
    fn count(&self, record: impl FnOnce(&mut crate::metrics::Tally)) {
        if let Some(telemetry) = &self.telemetry {
            if let Ok(mut telemetry) = telemetry.try_borrow_mut() {
                record(&mut telemetry.tally);
                if telemetry.tally.wants_flush() {
                    telemetry.flush(&self.host);
                }
            }
        }
    }

    /// Sends the answer (once), counting it unless the engine did.
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

    /// The request is complete: hand the event to the engine. Sync: the calls go out now,
    /// from this stream, and the answer comes when they end. Async: 202 now, the root context
    /// delivers.
    fn fan_out(&mut self, config: &Rc<Config>, admitted: Admitted, body: Vec<u8>) {
        let Some(channel) = config.channel(admitted.channel) else {
            self.reject(Answer::rejected(500, "fanout: channel index out of range"));
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
        let mut fanout = FanOut::new(admitted.channel, channel.subscribers.len(), self.started_ms)
            .with_full_report(config.report == ReportDetail::Full);
        let mut wanted = Vec::with_capacity(channel.subscribers.len());
        for (index, subscriber) in channel.subscribers.iter().enumerate() {
            if subscriber.accepts(event.attributes.as_ref()) {
                wanted.push(index);
            } else {
                fanout.skip(index);
                self.count(|tally| tally.call_skipped(&subscriber.cluster));
            }
        }
        // Before anything is claimed: a refused request must leave no claim behind.
        if config.mode == Mode::Async {
            let in_flight = self.engine.borrow().async_in_flight();
            if in_flight >= config.max_in_flight {
                let message = format!(
                    "fanout holds {in_flight} events in flight on this worker \
                     (max_in_flight); try again later"
                );
                self.reject(Answer::rejected(503, &message).with_header("retry-after", "1".into()));
                return;
            }
        }
        // `dedupe`: subscribers that already have the event, or that another request is
        // delivering it to, are marked in the fan-out and not called; the rest are claimed.
        let redelivery =
            self.dedupe_claim(config, event.key.as_deref(), channel, &wanted, &mut fanout);
        let in_progress = fanout.in_progress();
        // Nothing to send (every subscriber skipped, or already delivered): the engine ends
        // the job at once.
        let nothing_to_send = fanout.is_done();
        let job = Job {
            config: config.clone(),
            fanout,
            body,
            forwarded: admitted.forwarded,
            answer_to: None,
            log_id: self.id,
            started_ms: self.started_ms,
            redelivery,
        };
        match config.mode {
            Mode::Async => {
                let (_, finished) =
                    self.engine
                        .borrow_mut()
                        .start(&self.host, job, nothing_to_send);
                let answer = match finished {
                    // Nothing to send: the verdict is already known (202, with the report
                    // when dedupe found every subscriber had the event; 409 when another
                    // request is delivering to the rest).
                    Some(finished) => finished.answer,
                    // What this request claimed is delivered in the background; the
                    // subscribers another request is delivering to are that request's. The
                    // sender retries, and the retry is answered from the records.
                    None if in_progress > 0 => Answer::rejected(
                        409,
                        &format!(
                            "another request is delivering this event to {in_progress} \
                             subscriber(s); try again later"
                        ),
                    )
                    .with_header("retry-after", "1".into()),
                    None => Answer::accepted(),
                };
                if answer.status == 202 {
                    self.answer(answer, false);
                } else {
                    self.reject(answer);
                }
            }
            Mode::Sync => {
                let job = Job {
                    answer_to: Some(self.id),
                    ..job
                };
                let (id, finished) = self.engine.borrow_mut().start(&self.host, job, true);
                self.stage = Stage::Delivering { job: id };
                if let Some(finished) = finished {
                    self.finished(finished);
                }
            }
        }
    }

    /// A fan-out ended while this stream's callback runs.
    fn finished(&mut self, finished: Finished) {
        match finished.answer_to {
            Some(stream) if stream == self.id => self.answer(finished.answer, true),
            Some(stream) => answer_stream(&self.host, stream, self.id, &finished.answer),
            None => {}
        }
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
}

impl<H: Host> Context for FanoutStream<H> {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let finished =
            self.engine
                .borrow_mut()
                .on_response(&self.host, token_id, num_headers, body_size);
        if let Some(finished) = finished {
            self.finished(finished);
        }
    }

    fn on_done(&mut self) -> bool {
        if let Stage::Delivering { job } = self.stage {
            let mut engine = self.engine.borrow_mut();
            if engine.contains(job) {
                log::info!(
                    "[#{}] the client went away before the fan-out ended; its calls are \
                     cancelled",
                    self.id
                );
                engine.abandon(&self.host, job);
            }
        }
        true
    }
}

impl<H: Host> HttpContext for FanoutStream<H> {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.started_ms = self.host.now_ms();
        self.count(|tally| tally.received());
        let Some(config) = self.config.clone() else {
            self.reject(Answer::rejected(
                500,
                "fanout has no valid configuration; see Envoy's log",
            ));
            return Action::Pause;
        };
        match admit(&config, self.host.request_headers()) {
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
                    return Action::Continue;
                }
            }
        }
        // Nothing goes on to the router. With `allow_on_headers_stop_iteration`, Envoy still
        // delivers the body.
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(config) = self.config.clone() else {
            return Action::Pause;
        };
        let Stage::Body { received, .. } = &mut self.stage else {
            return Action::Pause;
        };
        // `body_size` is all that Envoy has buffered so far, since every call paused.
        *received = body_size;
        if body_size as u64 > config.max_body_bytes {
            self.reject(too_large(config.max_body_bytes));
            return Action::Pause;
        }
        if end_of_stream {
            self.body_complete(&config);
        }
        Action::Pause
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // Trailers end the request: the body is complete without an end_of_stream body call.
        if let Some(config) = self.config.clone() {
            if matches!(self.stage, Stage::Body { .. }) {
                self.body_complete(&config);
            }
        }
        Action::Pause
    }

    /// The filter answers every request itself, so a response coming back through it before
    /// that answer was made elsewhere: by the router, when `body_wait: continue` is used
    /// without a buffer filter after this one (the router acted on the headers alone), or by
    /// Envoy itself (a stream timeout). Either way the sender got another answer: do not fan
    /// out after it, and say why.
    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        match self.stage {
            Stage::Answered => {}
            // The root context answered for this stream: the fan-out is over.
            Stage::Delivering { job }
                if self
                    .engine
                    .try_borrow()
                    .is_ok_and(|engine| !engine.contains(job)) =>
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
                    if let Ok(mut engine) = self.engine.try_borrow_mut() {
                        engine.abandon(&self.host, job);
                    }
                }
                self.stage = Stage::Answered;
            }
        }
        Action::Continue
    }
}
