//! Deliveries in flight on one worker: every fan-out's [`FanOut`](crate::fan_out_state::FanOut) state, the calls it has
//! under way, and the work the root context's timer must do (retries after their backoff,
//! async deliveries that outlive their request).
//!
//! Who makes a call decides who hears back, and how long the call may live: Envoy cancels a
//! stream's calls when the stream ends, while calls made from the root context live as long as
//! the plugin. So a sync fan-out sends its first attempts from its stream (no timer delay),
//! and everything sent from the timer (retries, async deliveries) belongs to the root. Each
//! call is entered in the worker's [`CallTable`] as a delivery attempt; whichever context gets
//! its answer, the pipeline hands that continuation to [`Deliveries::answered`]. The
//! deliveries never answer a sender themselves but return the answer to the plugin or the
//! stream, so no `RefCell` is borrowed while Envoy runs the local reply.

use std::cell::RefCell;
use std::rc::Rc;

use hashbrown::HashMap;

use crate::answer::Answer;
use crate::call::{Failure, Leg};
use crate::call_slots::{CallCap, Slot};
use crate::call_table::{Attempt, CallTable, Continuation};
use crate::cloudevents::ContentMode;
use crate::config::{AnswerMode, Config};
use crate::dedupe::dedupe_store::Ending;
use crate::headers::HeaderMap;
use crate::host::Host;
use crate::jitter::{self, JitterRng};
use crate::telemetry::{count_into, Telemetry};
use call_end::Expected;
use call_plan::CallPlan;
use clock::Clock;
use end::labelled;
use job::{leg_cluster, leg_stats};
pub use job::{InLine, Job, Variant};
pub use owed::Owed;
use slot_gate::{Pass, SlotGate};
pub use spans::JobSpans;
use traced::{CallOutcome, Traces};

mod call_end;
mod call_plan;
mod clock;
mod end;
mod job;
mod owed;
mod slot_gate;
mod spans;
mod traced;

/// An answer due: a fan-out that ended (or a request answered at once), and the stream
/// waiting for it, if one is. The context running sends it.
pub struct Finished {
    pub answer_to: Option<u32>,
    pub answer: Answer,
}

impl Finished {
    /// `stream` is answered at once (logged if it is a refusal; counted where it is sent).
    pub fn now(stream: u32, answer: Answer) -> Finished {
        if answer.status >= 400 {
            log::info!(
                "[#{stream}] answered {}: {}",
                answer.status,
                String::from_utf8_lossy(&answer.body)
            );
        }
        Finished {
            answer_to: Some(stream),
            answer,
        }
    }
}

/// What a stage made of a request: its sync fan-out under way (the job), if one is, and
/// the answers due now (its own among them if it is answered at once). The one outcome of
/// every stage a request passes: launched here, begun by the pipeline.
#[derive(Default)]
pub struct Outcome {
    pub delivering: Option<u64>,
    pub finished: Vec<Finished>,
}

/// Every fan-out of one worker still under way, and the calls it waits for.
pub struct Deliveries {
    jobs: HashMap<u64, Job>,
    next_job: u64,
    telemetry: Rc<RefCell<Telemetry>>,
    /// The VM's generator for retry jitter: each fan-out draws its own seed from it. Seeded
    /// by [`Deliveries::seed_jitter`] when the plugin is configured.
    jitter_rng: JitterRng,
    /// `max_concurrent_calls`: the slot each call holds, the calls waiting for one.
    gate: SlotGate,
    /// Fan-outs that ended with `dedupe` claims, for the settle stage (the pipeline's).
    ended: Vec<Ending<Finished>>,
    /// `tracing`: the VM's spans and their exporter (`None`: off).
    traces: Option<Traces>,
}

impl Deliveries {
    pub fn new(telemetry: Rc<RefCell<Telemetry>>) -> Self {
        Deliveries {
            jobs: HashMap::new(),
            next_job: 1,
            telemetry,
            jitter_rng: JitterRng::with_seed(0),
            gate: SlotGate::new(),
            ended: Vec::new(),
            traces: None,
        }
    }

    /// Seeds the retry jitter from the host's clock and the root context's id (proxy-wasm
    /// has no random source; the VMs of several workers differ by the clock's nanoseconds).
    pub fn seed_jitter<H: Host>(&mut self, host: &H, root_id: u32) {
        let seed = jitter::seed(&[host.now_nanos(), u64::from(root_id), self.next_job]);
        self.jitter_rng = JitterRng::with_seed(seed);
    }

    /// The tracing of a (new) configuration (`None`: off).
    pub fn configure_tracing<H: Host>(
        &mut self,
        host: &H,
        config: Option<&crate::config::TracingConfig>,
        metrics: bool,
        root: u32,
    ) {
        Traces::configure(&mut self.traces, host, config, metrics, root);
    }

    /// The spans of a new request on `channel`, if it is traced.
    pub fn traced<H: Host>(
        &mut self,
        host: &H,
        headers: &HeaderMap,
        event: Option<&ContentMode>,
        channel: &str,
        subscribers: usize,
    ) -> Option<Box<JobSpans>> {
        let tracing = &mut self.traces.as_mut()?.tracing;
        tracing.request(headers, event, channel, subscribers, || host.now_nanos())
    }

    /// The exporter's batch due (`flush`: whatever is held), as root context `root`'s call.
    pub fn export<H: Host>(&mut self, host: &H, calls: &mut CallTable, root: u32, flush: bool) {
        if let Some(traces) = self.traces.as_mut() {
            traces.export(host, calls, &self.telemetry, root, flush);
        }
    }

    /// The continuation of a span export: the collector's answer to call `token`.
    pub fn export_answered<H: Host>(&mut self, host: &H, token: u32) {
        if let Some(traces) = self.traces.as_mut() {
            traces.export_answered(host, token);
        }
    }

    /// Starts the fan-out `job` of the request on `stream`: answered at once (async mode, a
    /// channel of best-effort subscribers, or nothing to send: 202, with the report when
    /// every subscriber had the event; 409 when another request is delivering to the rest)
    /// or a sync fan-out that answers when it ends. Its first calls are the acting
    /// context's: root context `root`, or (`None`) the stream's.
    pub fn launch<H: Host>(
        &mut self,
        host: &H,
        calls: &mut CallTable,
        root: Option<u32>,
        job: Job,
        stream: u32,
    ) -> Outcome {
        let in_progress = job.fanout.in_progress();
        // Subscribers to call: in a channel of best-effort ones, all still pending at the 202.
        let to_call = job.fanout.open();
        // Nothing to send (every subscriber skipped, or already delivered): the job ends at
        // once.
        let nothing_to_send = job.fanout.is_done();
        // A channel of best-effort subscribers only answers at once, like async mode.
        let best_effort = job.channel.all_best_effort();
        if job.config.mode == AnswerMode::Async || best_effort {
            let unrecorded = job.unrecorded;
            let (_, finished) = self.start(host, calls, root, job, nothing_to_send);
            let answer = match finished {
                Some(finished) => finished.answer,
                // What this request claimed is delivered in the background; the
                // subscribers another request is delivering to are that request's. The
                // sender retries, and the retry is answered from the records.
                None if in_progress > 0 => Answer::in_progress_elsewhere(in_progress),
                None if best_effort => Answer::accepted()
                    .with_header(crate::answer::PENDING_HEADER, to_call.to_string()),
                None => Answer::accepted(),
            };
            return Outcome {
                delivering: None,
                finished: vec![Finished::now(stream, labelled(answer, unrecorded))],
            };
        }
        let job = Job {
            answer_to: Some(stream),
            ..job
        };
        let (id, finished) = self.start(host, calls, root, job, true);
        Outcome {
            delivering: Some(id),
            finished: finished.into_iter().collect(),
        }
    }

    /// The clock of one callback: in nanoseconds if spans may need them.
    fn clock<'h, H: Host>(&self, host: &'h H) -> Clock<'h, H> {
        Clock::new(host, self.traces.is_some())
    }

    /// Takes a new fan-out. With `send_now` its first calls go out at once, from the calling
    /// context (`root`, or the stream's); otherwise at the root context's next tick.
    fn start<H: Host>(
        &mut self,
        host: &H,
        calls: &mut CallTable,
        root: Option<u32>,
        job: Job,
        send_now: bool,
    ) -> (u64, Option<Finished>) {
        let id = self.next_job;
        self.next_job = self.next_job.saturating_add(1);
        let mut job = job;
        job.fanout.seed_jitter(self.jitter_rng.next_seed());
        self.count(host, &job.config, |tally| tally.fanout_started());
        self.jobs.insert(id, job);
        let finished = if send_now {
            self.pump(host, calls, &self.clock(host), root, id)
        } else {
            None
        };
        (id, finished)
    }

    /// The sender went away: a sync fan-out is dropped, its calls forgotten (on wasm they
    /// still run to their answer, which nobody reads; a native stream's are cancelled by
    /// Envoy with it). Its `dedupe` claims are settled: what was delivered so far is
    /// recorded, the rest released.
    pub fn abandon<H: Host>(&mut self, host: &H, calls: &mut CallTable, id: u64) {
        if let Some(job) = self.jobs.get(&id) {
            // Async, or answered already with best-effort deliveries still going on.
            if job.config.mode == AnswerMode::Async || job.answer_to.is_none() {
                return;
            }
        }
        if let Some(mut job) = self.jobs.remove(&id) {
            // Its waiting calls leave the line before its calls in flight free their slots,
            // so that none of them takes one.
            self.gate.cancel_job(id);
            self.forget_calls(calls, id);
            let clock = self.clock(host);
            if let Some(traces) = self.traces.as_mut() {
                traces.end(&clock, &mut job, None);
            }
            if let Some(claims) = job.claims.take() {
                self.ended(&clock, id, &job, claims, None);
            }
            self.count(host, &job.config, |tally| tally.fanout_ended(None));
        }
    }

    /// The sync fan-out whose sender is `stream`, if one is under way.
    pub fn job_of(&self, stream: u32) -> Option<u64> {
        self.jobs
            .iter()
            .find(|(_, job)| job.answer_to == Some(stream))
            .map(|(id, _)| *id)
    }

    /// The root context's timer: sends what is due in every fan-out, and gives up on those
    /// whose answers can no longer come: root context `root` acts.
    pub fn tick<H: Host>(&mut self, host: &H, calls: &mut CallTable, root: u32) -> Vec<Finished> {
        let clock = self.clock(host);
        let now = clock.now();
        let lost: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, job)| job.is_lost(now))
            .map(|(id, _)| *id)
            .collect();
        let mut finished = Vec::new();
        for id in lost {
            if let Some(job) = self.jobs.get_mut(&id) {
                log::warn!(
                    "[#{}] {} call(s) never came back, long past their timeouts; counting them \
                     as failed",
                    job.log_id,
                    job.fanout.open()
                );
                job.fanout.give_up(now);
            }
            self.forget_calls(calls, id);
            finished.extend(self.finish_if_done(&clock, id));
        }
        let due: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, job)| {
                job.fanout.has_ready() || job.fanout.next_wakeup().is_some_and(|t| t <= now)
            })
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            finished.extend(self.pump(host, calls, &clock, Some(root), id));
        }
        finished.extend(self.send_released(host, calls, &clock, root));
        self.report_gauges(host);
        self.export(host, calls, root, false);
        finished
    }

    /// Sends every call of job `id` that is due, until none is (a refused call may turn into
    /// a dead letter at once); returns the answer if the fan-out ended.
    /// The calls are root context `root`'s (`None`: the stream's); best-effort calls go out
    /// only from a root context.
    fn pump<H: Host>(
        &mut self,
        host: &H,
        calls: &mut CallTable,
        clock: &Clock<'_, H>,
        root: Option<u32>,
        id: u64,
    ) -> Option<Finished> {
        let from_root = root.is_some();
        loop {
            let job = self.jobs.get_mut(&id)?;
            // The time matters only to retries waiting for it.
            let now = if job.fanout.waiting() > 0 {
                clock.now()
            } else {
                0
            };
            let capped = !job.config.call_caps.is_empty();
            let channel = job.channel.clone();
            // Best-effort subscribers are called from the root context only: Envoy cancels a
            // stream's calls when the stream ends, and their delivery outlives the answer.
            let sends = if from_root {
                job.fanout.take_ready(now)
            } else {
                job.fanout.take_ready_where(now, |index| {
                    channel.subscribers.get(index).is_some_and(|s| s.required)
                })
            };
            if sends.is_empty() {
                break;
            }
            for send in sends {
                let cluster = leg_cluster(channel.subscribers.get(send.index)?, send.leg);
                let call = (id, send.index, send.leg);
                match self.gate.pass(capped, cluster, call) {
                    Pass::Now(slot) => self.send_one(host, calls, clock, root, call, slot),
                    Pass::Queued => {
                        if let Some(job) = self.jobs.get_mut(&id) {
                            job.line.calls = job.line.calls.saturating_add(1);
                        }
                    }
                }
            }
        }
        self.finish_if_done(clock, id)
    }

    /// Sends the `leg` call of subscriber `index` of job `id`, which holds `slot`, as root
    /// context `root`'s call (`None`: the stream's); its answer continues as that attempt.
    fn send_one<H: Host>(
        &mut self,
        host: &H,
        calls: &mut CallTable,
        clock: &Clock<'_, H>,
        root: Option<u32>,
        (id, index, leg): (u64, usize, Leg),
        slot: Slot,
    ) {
        let Some(job) = self.jobs.get_mut(&id) else {
            self.gate.release(slot);
            return;
        };
        let context = match self.traces.as_mut() {
            Some(traces) if job.spans.is_some() => traces.call(clock, job, index, leg),
            _ => None,
        };
        let config = job.config.clone();
        let channel = job.channel.clone();
        let Some(sub) = channel.subscribers.get(index) else {
            self.gate.release(slot);
            return;
        };
        let Some(call) = CallPlan::new(job, &channel, index, leg, context.as_ref()) else {
            self.gate.release(slot);
            return;
        };
        let serving = job.answer_to;
        let result = host.dispatch_serving(
            serving,
            call.cluster,
            call.headers(),
            &call.body,
            call.timeout,
        );
        drop(call);
        let stats = leg_stats(sub, leg);
        let retry = leg == Leg::Event && job.fanout.event_attempts(index) > 0;
        match result {
            Ok(token) => {
                job.fanout.dispatched(index, token);
                let attempt = Attempt {
                    job: id,
                    index,
                    slot,
                };
                calls.insert(token, Continuation::Delivery(attempt), root);
            }
            Err(failure) => {
                self.gate.release(slot);
                self.refused(host, clock, (id, index, leg), failure);
            }
        }
        self.count(host, &config, |tally| {
            tally.call_started(stats);
            if retry {
                tally.retried(sub.stats.event);
            }
        });
    }

    /// Envoy refused to send the `leg` call of subscriber `index` of job `id`: recorded as
    /// that attempt's end (a retry may wait, a dead letter may follow), counted, traced.
    fn refused<H: Host>(
        &mut self,
        host: &H,
        clock: &Clock<'_, H>,
        (id, index, leg): (u64, usize, Leg),
        failure: Failure,
    ) {
        let Some(job) = self.jobs.get_mut(&id) else {
            return;
        };
        let channel = job.channel.clone();
        let Some(sub) = channel.subscribers.get(index) else {
            return;
        };
        job.fanout
            .dispatch_failed(index, failure.clone(), clock.now(), &channel);
        job.log_failure(index, leg, &failure);
        let reply_gave_up = leg == Leg::Reply && !job.fanout.is_retrying(index);
        let (config, stats) = (job.config.clone(), leg_stats(sub, leg));
        self.count(host, &config, |tally| {
            if reply_gave_up {
                tally.reply_failed(&sub.cluster, &failure);
            }
            tally.call_ended(stats, &Err(failure.clone()), None)
        });
        if let (Some(traces), Some(job)) = (self.traces.as_mut(), self.jobs.get_mut(&id)) {
            traces.call_ended(clock, job, index, &CallOutcome::failed(failure));
        }
    }

    /// Forgets job `id`'s calls in flight (abandoned, or lost): their slots are free.
    fn forget_calls(&mut self, calls: &mut CallTable, id: u64) {
        for slot in calls.forget_job(id) {
            self.gate.release(slot);
        }
    }

    /// The continuation of a delivery's call (`attempt`, call `token`), answered to
    /// whichever context made it: root context `root`, or (`None`) the stream that made it.
    /// Its slot is handed back, its end read and recorded, and what is due next goes out.
    pub fn answered<H: Host>(
        &mut self,
        host: &H,
        calls: &mut CallTable,
        root: Option<u32>,
        (attempt, token): (Attempt, u32),
        (num_headers, body_size): (usize, usize),
    ) -> Option<Finished> {
        let Attempt {
            job: id,
            index,
            slot,
        } = attempt;
        self.gate.release(slot);
        let clock = self.clock(host);
        let job = self.jobs.get_mut(&id)?;
        let leg = job.fanout.leg_at(index, token)?;
        let channel = job.channel.clone();
        let sub = channel.subscribers.get(index)?;
        // The cluster this leg called.
        let cluster = leg_cluster(sub, leg);
        let expected = Expected {
            sub,
            leg,
            cluster,
            num_headers,
            body_size,
            max_body_bytes: job.config.max_body_bytes,
        };
        let ended = call_end::read(host, &expected, || clock.now());
        if ended.discarded {
            log::debug!(
                "[#{}] channel {}: subscriber {} answered {} with a body that is not a \
                 CloudEvent (no ce-* header, no application/cloudevents content type): not a \
                 reply, discarded",
                job.log_id,
                channel.name,
                sub.cluster,
                ended.status.unwrap_or(0)
            );
        }
        // The time: for a failure (its wait, its elapsed time) and for the duration metric.
        let now =
            if ended.end.result.is_err() || ended.reply_refused().is_some() || job.config.metrics {
                clock.now()
            } else {
                0
            };
        let config = job.config.clone();
        let traced = job.spans.is_some().then(|| CallOutcome::of(&ended));
        let recorded = job.record(index, token, leg, ended, now)?;
        self.count(host, &config, |tally| recorded.count(tally, sub, leg));
        if let (Some(outcome), Some(traces), Some(job)) =
            (traced, self.traces.as_mut(), self.jobs.get_mut(&id))
        {
            traces.call_ended(&clock, job, index, &outcome);
        }
        // A leg that just changed (reply, dead letter) goes out at once.
        self.pump(host, calls, &clock, root, id)
    }

    /// Whether a new event whose first calls go to `clusters` fits every capped cluster's
    /// line (`max_queued_calls`); else the 503 naming the subscriber, counted and warned of
    /// (at most once per cluster per 10 s).
    pub fn admit<H: Host>(
        &mut self,
        host: &H,
        config: &Config,
        clusters: &[&str],
    ) -> Result<(), Answer> {
        let Err((refusal, warn)) = self.gate.admit(clusters, || host.now_ms()) else {
            return Ok(());
        };
        if let Some(unlogged) = warn {
            let earlier = if unlogged > 0 {
                format!(" ({unlogged} more since the last warning)")
            } else {
                String::new()
            };
            log::warn!("request refused: {}{earlier}", refusal.message());
        }
        self.count(host, config, |tally| tally.refused(&refusal.key));
        Err(refusal.answer())
    }

    /// Sends the calls that got a slot since the last tick, in the order they got it; each
    /// leaves its job's line as it goes.
    fn send_released<H: Host>(
        &mut self,
        host: &H,
        calls: &mut CallTable,
        clock: &Clock<'_, H>,
        root: u32,
    ) -> Vec<Finished> {
        let mut finished = Vec::new();
        while let Some(((id, index, leg), slot)) = self.gate.next_released() {
            if let Some(job) = self.jobs.get_mut(&id) {
                job.line.calls = job.line.calls.saturating_sub(1);
                job.line.left_at = Some(clock.now());
            }
            self.send_one(host, calls, clock, Some(root), (id, index, leg), slot);
            finished.extend(self.pump(host, calls, clock, Some(root), id));
        }
        finished
    }

    /// Counts how the capped clusters' calls in flight and waiting changed since the last tick.
    fn report_gauges<H: Host>(&mut self, host: &H) {
        let gate = &mut self.gate;
        count_into(&self.telemetry, host, |tally| {
            gate.report_gauges(|change| {
                tally.call_gauges(change.cluster, change.in_flight, change.queued)
            });
        });
    }

    /// The caps of a (new) configuration; calls that now have room go out at the next tick.
    pub fn set_caps(&mut self, caps: &[(String, CallCap)]) {
        self.gate.set_caps(caps);
    }

    /// Everything this worker still owes (`calls`: its calls in flight).
    pub fn owed(&self, calls: &CallTable) -> Owed {
        Owed {
            fanouts: self.jobs.len(),
            answered: self.async_in_flight(),
            retrying: self
                .jobs
                .values()
                .filter(|job| job.fanout.waiting() > 0)
                .count(),
            calls: calls.deliveries(),
            queued: self.jobs.values().map(|job| job.line.calls).sum(),
        }
    }

    /// Fan-outs delivering in the background, their sender answered (async mode, channels
    /// of best-effort subscribers, best-effort deliveries after the answer): what
    /// `max_in_flight` bounds.
    pub fn async_in_flight(&self) -> usize {
        self.jobs
            .values()
            .filter(|job| job.answer_to.is_none())
            .count()
    }

    /// Whether job `id`'s sender still waits for its answer.
    pub fn awaits_answer(&self, id: u64) -> bool {
        self.jobs
            .get(&id)
            .is_some_and(|job| job.answer_to.is_some())
    }

    /// Whether the root context's timer has work: calls to send or retries waiting.
    pub fn has_timed_work(&self) -> bool {
        self.jobs
            .values()
            .any(|job| job.fanout.has_ready() || job.fanout.waiting() > 0)
            || self.gate.has_released()
    }

    /// Counts, unless `config` turns metrics off: the one way to count ([`count_into`]).
    fn count<H: Host>(
        &self,
        host: &H,
        config: &Config,
        record: impl FnOnce(&mut crate::metrics::Tally),
    ) {
        if config.metrics {
            count_into(&self.telemetry, host, record);
        }
    }
}
