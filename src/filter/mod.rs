//! The only part of `fanout` that touches proxy-wasm: the root context (configuration) and
//! the http context (one request), in the order Envoy calls them.
//!
//! Each callback gathers what Envoy offers, hands it to the pure core (admission, the
//! fan-out state, the verdict) and performs what the core decides through a [`Host`].
//!
//! How Envoy behaves here (see the project's Envoy notes): the body reaches a filter that
//! paused in the headers callback only with `allow_on_headers_stop_iteration: true`; a call to
//! a cluster Envoy does not know fails at dispatch and gets no callback; a local reply is
//! applied after the callback returns, and a second one would hang the client, so a stream
//! answers once and ignores what comes after.

pub mod host;
mod telemetry;
#[cfg(test)]
mod tests;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};

use crate::answer::Answer;
use crate::config::{BodyWait, Config};
use crate::fanout::{classify, is_success, Failure, FanOut, BODY_PEEK_BYTES};
use crate::request::{admit, too_large, Admitted};
pub use host::{Host, ProxyHost};
use telemetry::Telemetry;

/// How often the root context hands the counts to Envoy's stats.
const METRICS_FLUSH: Duration = Duration::from_secs(1);

/// The plugin: holds the configuration, parsed once per `on_configure`, shared (`Rc`) with
/// every stream created after it. A stream keeps the configuration it started with.
pub struct FanoutRoot<H> {
    host: H,
    config: Option<Rc<Config>>,
    /// This worker's counts, shared with its streams; flushed to Envoy on each tick.
    telemetry: Rc<RefCell<Telemetry>>,
}

impl<H: Host + Clone + 'static> FanoutRoot<H> {
    pub fn new(host: H) -> Self {
        FanoutRoot {
            host,
            config: None,
            telemetry: Rc::default(),
        }
    }
}

impl<H: Host + Clone + 'static> Context for FanoutRoot<H> {}

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
                let subscribers: usize = config.channels.iter().map(|c| c.subscribers.len()).sum();
                log::info!(
                    "configured {} channel(s), {} subscriber(s)",
                    config.channels.len(),
                    subscribers
                );
                if config.metrics {
                    let mut telemetry = self.telemetry.borrow_mut();
                    telemetry.tally.register_requests();
                    for subscriber in config.channels.iter().flat_map(|c| &c.subscribers) {
                        telemetry.tally.register_subscriber(&subscriber.cluster);
                    }
                    telemetry.define_all(&self.host);
                    self.host.set_tick_period(METRICS_FLUSH);
                } else {
                    self.host.set_tick_period(Duration::ZERO);
                }
                self.config = Some(Rc::new(config));
                true
            }
            Err(error) => {
                log::error!("invalid plugin configuration: {error}");
                false
            }
        }
    }

    fn on_tick(&mut self) {
        self.telemetry.borrow_mut().flush(&self.host);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let metrics = self.config.as_ref().is_some_and(|c| c.metrics);
        Some(Box::new(FanoutStream {
            id: context_id,
            host: self.host.clone(),
            config: self.config.clone(),
            telemetry: metrics.then(|| self.telemetry.clone()),
            stage: Stage::Headers,
            started_ms: 0,
            in_flight: false,
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
    /// Calls under way.
    FanningOut(FanOut),
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
    stage: Stage,
    /// When the request's headers arrived, on the host's clock.
    started_ms: u64,
    /// A fan-out started and has not ended: counted in the in-flight gauge.
    in_flight: bool,
}

impl<H: Host> FanoutStream<H> {
    /// Counts something, and flushes at once if a histogram buffer is full.
    fn count(&self, record: impl FnOnce(&mut crate::metrics::Tally)) {
        if let Some(telemetry) = &self.telemetry {
            let mut telemetry = telemetry.borrow_mut();
            record(&mut telemetry.tally);
            if telemetry.tally.wants_flush() {
                telemetry.flush(&self.host);
            }
        }
    }

    fn answer(&mut self, answer: Answer) {
        if matches!(self.stage, Stage::Answered) {
            return;
        }
        self.host.respond(&answer);
        self.stage = Stage::Answered;
        if self.telemetry.is_some() {
            let duration = self.in_flight.then(|| self.elapsed_ms());
            self.in_flight = false;
            self.count(|tally| {
                tally.answered(answer.status);
                if duration.is_some() {
                    tally.fanout_ended(duration);
                }
            });
        }
    }

    fn elapsed_ms(&self) -> u64 {
        self.host.now_ms().saturating_sub(self.started_ms)
    }

    /// Reject with a log line a user can act on.
    fn reject(&mut self, answer: Answer) {
        log::info!(
            "[#{}] answered {}: {}",
            self.id,
            answer.status,
            String::from_utf8_lossy(&answer.body)
        );
        self.answer(answer);
    }

    /// The request is complete: one call per subscriber, all at once.
    fn fan_out(&mut self, config: &Config, admitted: Admitted, body: &[u8]) {
        let Some(channel) = config.channel(admitted.channel) else {
            self.reject(Answer::rejected(500, "fanout: channel index out of range"));
            return;
        };
        let mut fanout = FanOut::new(admitted.channel, channel.subscribers.len(), self.started_ms);
        self.in_flight = true;
        self.count(|tally| tally.fanout_started());
        let mut headers: Vec<(&str, &str)> = Vec::new();
        for (index, subscriber) in channel.subscribers.iter().enumerate() {
            headers.clear();
            headers.extend(
                subscriber
                    .call_headers
                    .iter()
                    .chain(&admitted.forwarded)
                    .map(|(name, value)| (name.as_str(), value.as_str())),
            );
            let call = self.host.dispatch(
                &subscriber.cluster,
                std::mem::take(&mut headers),
                body,
                subscriber.timeout,
            );
            self.count(|tally| tally.call_started(&subscriber.cluster));
            match call {
                Ok(token) => fanout.dispatched(index, token),
                Err(detail) => {
                    log::warn!(
                        "[#{}] channel {}: subscriber {} failed: dispatch error: {detail}",
                        self.id,
                        channel.name,
                        subscriber.cluster
                    );
                    let failure = Err(Failure::DispatchError {
                        detail: detail.clone(),
                    });
                    self.count(|tally| tally.call_ended(&subscriber.cluster, &failure, None));
                    fanout.dispatch_failed(index, detail, self.host.now_ms());
                }
            }
        }
        if fanout.is_done() {
            self.finish(config, &fanout);
        } else {
            self.stage = Stage::FanningOut(fanout);
        }
    }

    fn finish(&mut self, config: &Config, fanout: &FanOut) {
        let Some(channel) = config.channel(fanout.channel()) else {
            return;
        };
        let answer = fanout.verdict(channel);
        if answer.status != 202 {
            log::info!(
                "[#{}] channel {}: answered {}: {} of {} subscriber(s) failed",
                self.id,
                channel.name,
                answer.status,
                fanout.failures().count(),
                channel.subscribers.len()
            );
        }
        self.answer(answer);
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
        let Some(config) = self.config.clone() else {
            return;
        };
        let Stage::FanningOut(fanout) = &mut self.stage else {
            log::debug!("[#{}] late answer to call {token_id}", self.id);
            return;
        };
        let status = if num_headers == 0 {
            None
        } else {
            self.host.call_status()
        };
        // Read a body only to explain a failure: a success costs no more host calls.
        let result = match status {
            Some(status) if is_success(status) => Ok(()),
            _ => {
                let body = if body_size > 0 {
                    self.host.call_body(body_size.min(BODY_PEEK_BYTES))
                } else {
                    Vec::new()
                };
                classify(status, &body)
            }
        };
        let now = if result.is_err() || self.telemetry.is_some() {
            self.host.now_ms()
        } else {
            0
        };
        let failure = result.as_ref().err().cloned();
        let Some(index) = fanout.completed(token_id, result.clone(), now) else {
            log::debug!("[#{}] answer to unknown call {token_id}", self.id);
            return;
        };
        let done = fanout.is_done();
        let channel_index = fanout.channel();
        if let Some(subscriber) = config
            .channel(channel_index)
            .and_then(|c| c.subscribers.get(index))
        {
            let duration = now.saturating_sub(self.started_ms);
            self.count(|tally| tally.call_ended(&subscriber.cluster, &result, Some(duration)));
        }
        if let Some(failure) = failure {
            if let Some(channel) = config.channel(channel_index) {
                let cluster = channel
                    .subscribers
                    .get(index)
                    .map_or("?", |s| s.cluster.as_str());
                log::warn!(
                    "[#{}] channel {}: subscriber {cluster} failed: {failure}",
                    self.id,
                    channel.name
                );
            }
        }
        if done {
            if let Stage::FanningOut(done) = std::mem::replace(&mut self.stage, Stage::Headers) {
                self.finish(&config, &done);
            }
        }
    }

    fn on_done(&mut self) -> bool {
        if let Stage::FanningOut(fanout) = &self.stage {
            log::info!(
                "[#{}] the client went away with {} call(s) pending; Envoy cancels them",
                self.id,
                fanout.open()
            );
        }
        if self.in_flight {
            self.in_flight = false;
            self.count(|tally| tally.fanout_ended(None));
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
            Ok(admitted) if end_of_stream => self.fan_out(&config, admitted, &[]),
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

    /// The filter answers every request itself, so a response coming back through it before
    /// that answer was made elsewhere: by the router, when `body_wait: continue` is used
    /// without a buffer filter after this one (the router acted on the headers alone), or by
    /// Envoy itself (a stream timeout). Either way the sender got another answer: do not fan
    /// out after it, and say why.
    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        match self.stage {
            Stage::Answered => {}
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
                if self.in_flight {
                    self.in_flight = false;
                    self.count(|tally| tally.fanout_ended(None));
                }
                self.stage = Stage::Answered;
            }
        }
        Action::Continue
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
}

impl<H: Host> FanoutStream<H> {
    fn body_complete(&mut self, config: &Config) {
        if let Stage::Body { admitted, received } =
            std::mem::replace(&mut self.stage, Stage::Headers)
        {
            let body = if received > 0 {
                self.host.request_body(received)
            } else {
                Vec::new()
            };
            self.fan_out(config, admitted, &body);
        }
    }
}
