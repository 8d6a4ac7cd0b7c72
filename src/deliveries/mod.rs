//! Deliveries in flight on one worker: every fan-out's [`FanOut`] state, the calls it has
//! under way, and the work the root context's timer must do (retries after their backoff,
//! async deliveries that outlive their request).
//!
//! Who makes a call decides who hears back, and how long the call may live: Envoy cancels a
//! stream's calls when the stream ends, while calls made from the root context live as long as
//! the plugin. So a sync fan-out sends its first attempts from its stream (no timer delay),
//! and everything sent from the timer (retries, async deliveries) belongs to the root. Either
//! context hands the answers to [`Deliveries`], which owns the state; it never answers a
//! sender itself but returns the answer to the plugin or the stream, so no `RefCell` is
//! borrowed while Envoy runs the local reply.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;

use hashbrown::HashMap;

use crate::answer::Answer;
use crate::call::{classify, is_success, Failure, Leg, BODY_PEEK_BYTES};
use crate::call_slots::{CallCap, CallSlots, Slot, Start};
use crate::config::{AnswerMode, Channel, Config, Subscriber};
use crate::dedupe::remote::Remote;
use crate::dedupe::settle::{self, Claims};
use crate::fanout::{CallEnd, FanOut, ReplyEvent};
use crate::headers::Forwarded;
use crate::host::Host;
use crate::jitter::{self, JitterRng};
use crate::reply::{self, Answered};
use crate::retry::{honours_retry_after, parse_retry_after};
use crate::telemetry::Telemetry;
use call_plan::CallPlan;

mod call_plan;

/// The host's clock, read at most once per callback and only if something needs the time:
/// a plain success with metrics off costs no clock read (each read is a host call).
struct Clock<'h, H> {
    host: &'h H,
    now: Cell<Option<u64>>,
}

impl<'h, H: Host> Clock<'h, H> {
    fn new(host: &'h H) -> Self {
        Clock {
            host,
            now: Cell::new(None),
        }
    }

    fn now(&self) -> u64 {
        if let Some(now) = self.now.get() {
            return now;
        }
        let now = self.host.now_ms();
        self.now.set(Some(now));
        now
    }
}

/// One event being delivered.
pub struct Job {
    pub config: Rc<Config>,
    pub fanout: FanOut,
    pub body: Vec<u8>,
    pub forwarded: Forwarded,
    /// The stream waiting for the answer (sync mode); `None` once async or abandoned.
    pub answer_to: Option<u32>,
    /// Context id for log lines.
    pub log_id: u32,
    pub started_ms: u64,
    /// `dedupe`'s claims of this event, settled when the fan-out ends.
    pub redelivery: Option<Claims>,
}

/// How long past its worst case (every attempt timing out, every backoff at its longest) a
/// fan-out is kept before its open calls are given up as lost. Calls end by their timeouts,
/// so this only matters when Envoy drops a call without an answer, e.g. one made by a root
/// context that a configuration update retired.
const LOST_CALL_GRACE_MS: u64 = 30_000;

impl Job {
    fn deadline_ms(&self) -> u64 {
        let worst = self
            .config
            .channel(self.fanout.channel())
            .map_or(0, |channel| {
                channel
                    .subscribers
                    .iter()
                    .map(|sub| sub.worst_case_ms())
                    .max()
                    .unwrap_or(0)
            });
        self.started_ms
            .saturating_add(worst)
            .saturating_add(LOST_CALL_GRACE_MS)
    }
}

/// A fan-out that ended: the answer for its sender, if one is waiting.
pub struct Finished {
    pub answer_to: Option<u32>,
    pub answer: Answer,
}

/// Every fan-out of one worker still under way, and the calls it waits for.
pub struct Deliveries {
    jobs: HashMap<u64, Job>,
    /// Pending call token -> job and subscriber index.
    tokens: HashMap<u32, (u64, usize)>,
    next_job: u64,
    telemetry: Rc<RefCell<Telemetry>>,
    /// The VM's generator for retry jitter: each fan-out draws its own seed from it. Seeded
    /// by [`Deliveries::seed_jitter`] when the plugin is configured.
    jitter_rng: JitterRng,
    /// Calls in flight and waiting per cluster (`max_concurrent_calls`), keyed by cluster;
    /// a waiting call is its job, subscriber and leg.
    slots: CallSlots<String, (u64, usize, Leg)>,
    /// The slot each call in flight holds.
    slot_of: HashMap<u32, Slot>,
    /// Calls that got a slot, to be sent by the root context's next tick.
    released: VecDeque<((u64, usize, Leg), Slot)>,
    /// Per job, its calls waiting in line (a job with calls waiting is never lost).
    queued_by_job: HashMap<u64, usize>,
    /// Per job, when a call of it last left the line (its deadline runs from then).
    sent_from_line: HashMap<u64, u64>,
    /// The capped clusters' calls in flight and waiting as last counted into the gauges.
    reported: HashMap<String, (u32, usize)>,
    /// `dedupe`'s etcd store on this VM: leases, settles owed (sent by the root's tick).
    pub store: Remote,
}

impl Deliveries {
    pub fn new(telemetry: Rc<RefCell<Telemetry>>) -> Self {
        Deliveries {
            jobs: HashMap::new(),
            tokens: HashMap::new(),
            next_job: 1,
            telemetry,
            jitter_rng: JitterRng::with_seed(0),
            slots: CallSlots::new(),
            slot_of: HashMap::new(),
            released: VecDeque::new(),
            queued_by_job: HashMap::new(),
            sent_from_line: HashMap::new(),
            reported: HashMap::new(),
            store: Remote::default(),
        }
    }

    /// Seeds the retry jitter from the host's clock and the root context's id (proxy-wasm
    /// has no random source; the VMs of several workers differ by the clock's nanoseconds).
    pub fn seed_jitter<H: Host>(&mut self, host: &H, root_id: u32) {
        let seed = jitter::seed(&[host.now_nanos(), u64::from(root_id), self.next_job]);
        self.jitter_rng = JitterRng::with_seed(seed);
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

    /// Whether a new event whose first calls go to `clusters` fits every capped cluster's
    /// line (`max_queued_calls`); else the 503 naming the subscriber, counted and warned of
    /// (at most once per cluster per 10 s).
    pub fn admit<H: Host>(
        &mut self,
        host: &H,
        config: &Config,
        clusters: &[&str],
    ) -> Result<(), Answer> {
        let Err(refusal) = self.slots.check(clusters.iter().copied()) else {
            return Ok(());
        };
        if let Some(unlogged) = self.slots.note_refusal(&refusal.key, host.now_ms()) {
            let earlier = if unlogged > 0 {
                format!(" ({unlogged} more since the last warning)")
            } else {
                String::new()
            };
            log::warn!("request refused: {}{earlier}", refusal.message());
        }
        self.count(config, |tally| tally.refused(&refusal.key));
        Err(refusal.answer())
    }

    /// Whether job `id`'s sender still waits for its answer.
    pub fn awaits_answer(&self, id: u64) -> bool {
        self.jobs
            .get(&id)
            .is_some_and(|job| job.answer_to.is_some())
    }

    pub fn contains(&self, job: u64) -> bool {
        self.jobs.contains_key(&job)
    }

    /// Takes a new fan-out. With `send_now` its first calls go out at once, from the calling
    /// context; otherwise at the root context's next tick.
    pub fn start<H: Host>(
        &mut self,
        host: &H,
        job: Job,
        send_now: bool,
    ) -> (u64, Option<Finished>) {
        let id = self.next_job;
        self.next_job += 1;
        let mut job = job;
        job.fanout.seed_jitter(self.jitter_rng.next_seed());
        self.count(&job.config, |tally| tally.fanout_started());
        self.jobs.insert(id, job);
        let finished = if send_now {
            self.pump(host, &Clock::new(host), id, false)
        } else {
            None
        };
        (id, finished)
    }

    /// The sender went away: a sync fan-out is dropped (its stream's calls are cancelled by
    /// Envoy; answers to the root's calls for it are ignored from now on). Its `dedupe`
    /// claims are settled: what was delivered so far is recorded, the rest released.
    pub fn abandon<H: Host>(&mut self, host: &H, id: u64) {
        if let Some(job) = self.jobs.get(&id) {
            // Async, or answered already with best-effort deliveries still going on.
            if job.config.mode == AnswerMode::Async || job.answer_to.is_none() {
                return;
            }
        }
        if let Some(mut job) = self.jobs.remove(&id) {
            // Its waiting calls leave the line before its calls in flight free their slots,
            // so that none of them takes one.
            self.slots.cancel(|waiting| waiting.0 == id);
            self.queued_by_job.remove(&id);
            self.sent_from_line.remove(&id);
            self.released.retain(|(waiting, _)| waiting.0 != id);
            self.forget_calls(id);
            self.settle(&Clock::new(host), &mut job);
            self.count(&job.config, |tally| tally.fanout_ended(None));
        }
    }

    /// Whether the root context's timer has work: calls to send or retries waiting.
    pub fn has_timed_work(&self) -> bool {
        self.jobs
            .values()
            .any(|job| job.fanout.has_ready() || job.fanout.waiting() > 0)
            || !self.released.is_empty()
            || self.store.owed() > 0
    }

    /// The root context's timer: sends what is due in every fan-out, and gives up on those
    /// whose answers can no longer come.
    pub fn tick<H: Host>(&mut self, host: &H) -> Vec<Finished> {
        let clock = Clock::new(host);
        let now = clock.now();
        let lost: Vec<u64> = self
            .jobs
            .iter()
            .filter(|&(id, job)| {
                // A job with calls waiting in line is not lost; its deadline runs from the
                // last call that left the line.
                let from_line = self.sent_from_line.get(id).map_or(0, |sent| {
                    job.deadline_ms()
                        .saturating_sub(job.started_ms)
                        .saturating_add(*sent)
                });
                !self.queued_by_job.contains_key(id) && now > job.deadline_ms().max(from_line)
            })
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
            self.forget_calls(id);
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
        finished.extend(
            due.into_iter()
                .filter_map(|id| self.pump(host, &clock, id, true)),
        );
        finished.extend(self.send_released(host, &clock));
        self.report_gauges();
        finished
    }

    /// Sends every call of job `id` that is due, until none is (a refused call may turn into
    /// a dead letter at once); returns the answer if the fan-out ended.
    /// `from_root`: the root context is the current one (else a stream's).
    fn pump<H: Host>(
        &mut self,
        host: &H,
        clock: &Clock<'_, H>,
        id: u64,
        from_root: bool,
    ) -> Option<Finished> {
        loop {
            let job = self.jobs.get_mut(&id)?;
            // The time matters only to retries waiting for it.
            let now = if job.fanout.waiting() > 0 {
                clock.now()
            } else {
                0
            };
            let config = job.config.clone();
            let channel = config.channel(job.fanout.channel())?;
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
                // A worker that never had a cap counts no calls: no bookkeeping per call.
                // (Calls sent before the first cap arrives are not counted against it.)
                if self.slots.is_unused() && config.call_caps.is_empty() {
                    self.send_one(host, clock, id, send.index, send.leg, Slot::uncounted());
                    continue;
                }
                let cluster = leg_cluster(channel.subscribers.get(send.index)?, send.leg);
                // Every leg to a capped cluster waits for a slot; an uncapped one always
                // gets one at once.
                match self
                    .slots
                    .start(&cluster.to_string(), (id, send.index, send.leg))
                {
                    Start::Now(slot) => self.send_one(host, clock, id, send.index, send.leg, slot),
                    Start::Queued => {
                        *self.queued_by_job.entry(id).or_default() += 1;
                    }
                }
            }
        }
        self.finish_if_done(clock, id)
    }

    /// Sends the `leg` call of subscriber `index` of job `id`, which holds `slot`.
    fn send_one<H: Host>(
        &mut self,
        host: &H,
        clock: &Clock<'_, H>,
        id: u64,
        index: usize,
        leg: Leg,
        slot: Slot,
    ) {
        let telemetry = self.telemetry.clone();
        let Some(job) = self.jobs.get_mut(&id) else {
            self.release(slot);
            return;
        };
        let config = job.config.clone();
        let Some(channel) = config.channel(job.fanout.channel()) else {
            self.release(slot);
            return;
        };
        let Some(sub_cluster) = channel.subscribers.get(index).map(|s| s.cluster.as_str()) else {
            self.release(slot);
            return;
        };
        let Some(call) = CallPlan::new(job, channel, index, leg) else {
            self.release(slot);
            return;
        };
        let result = host.dispatch(call.cluster, call.headers(), &call.body, call.timeout);
        let cluster = call.cluster;
        drop(call);
        let retry = leg == Leg::Event && job_attempts(job, index) > 0;
        match result {
            Ok(token) => {
                job.fanout.dispatched(index, token);
                self.tokens.insert(token, (id, index));
                self.slot_of.insert(token, slot);
            }
            Err(failure) => {
                job.fanout
                    .dispatch_failed(index, failure.clone(), clock.now(), channel);
                log_failure(job, channel, index, leg, &failure);
                let reply_gave_up = leg == Leg::Reply && !job.fanout.is_retrying(index);
                count(&telemetry, &config, |tally| {
                    if reply_gave_up {
                        tally.reply_failed(sub_cluster, &failure);
                    }
                    tally.call_ended(cluster, &Err(failure.clone()), None)
                });
                self.release(slot);
            }
        }
        count(&telemetry, &config, |tally| {
            tally.call_started(cluster);
            if retry {
                tally.retried(sub_cluster);
            }
        });
    }

    /// A call's slot is free: the next call waiting for its cluster, if any, takes it and is
    /// sent by the root context's next tick (Envoy ties a call to the context that makes it,
    /// and the root's calls outlive every stream).
    fn release(&mut self, slot: Slot) {
        if let Some((waiting, slot)) = self.slots.end(slot) {
            self.left_line(waiting.0);
            self.released.push_back((waiting, slot));
        }
    }

    fn left_line(&mut self, id: u64) {
        if let Some(n) = self.queued_by_job.get_mut(&id) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.queued_by_job.remove(&id);
            }
        }
    }

    /// Forgets job `id`'s calls in flight (abandoned, or lost): their slots are free.
    fn forget_calls(&mut self, id: u64) {
        let tokens: Vec<u32> = self
            .tokens
            .iter()
            .filter(|(_, (job, _))| *job == id)
            .map(|(token, _)| *token)
            .collect();
        for token in tokens {
            self.tokens.remove(&token);
            if let Some(slot) = self.slot_of.remove(&token) {
                self.release(slot);
            }
        }
    }

    /// Sends the calls that got a slot since the last tick, in the order they got it.
    fn send_released<H: Host>(&mut self, host: &H, clock: &Clock<'_, H>) -> Vec<Finished> {
        let mut finished = Vec::new();
        while let Some(((id, index, leg), slot)) = self.released.pop_front() {
            self.sent_from_line.insert(id, clock.now());
            self.send_one(host, clock, id, index, leg, slot);
            finished.extend(self.pump(host, clock, id, true));
        }
        finished
    }

    /// Counts how the capped clusters' calls in flight and waiting changed since the last tick.
    fn report_gauges(&mut self) {
        let Ok(mut telemetry) = self.telemetry.try_borrow_mut() else {
            return;
        };
        for gauges in self.slots.gauges() {
            let last = self.reported.get(gauges.key).copied().unwrap_or((0, 0));
            let now = (gauges.in_flight, gauges.queued);
            if now == last || (self.slots.cap(gauges.key).is_none() && last == (0, 0)) {
                continue;
            }
            telemetry.tally.call_gauges(
                gauges.key,
                i64::from(now.0) - i64::from(last.0),
                now.1 as i64 - last.1 as i64,
            );
            self.reported.insert(gauges.key.clone(), now);
        }
    }

    /// The caps of a (new) configuration; calls that now have room go out at the next tick.
    pub fn set_caps(&mut self, caps: &[(String, CallCap)]) {
        for (waiting, slot) in self.slots.set_caps(caps.iter().cloned()) {
            self.left_line(waiting.0);
            self.released.push_back((waiting, slot));
        }
    }

    /// The answer to call `token` is being delivered (to whichever context made the call).
    /// `from_root`: it is delivered to the root context (else to the stream that made it).
    pub fn on_response<H: Host>(
        &mut self,
        host: &H,
        token: u32,
        num_headers: usize,
        body_size: usize,
        from_root: bool,
    ) -> Option<Finished> {
        if let Some(slot) = self.slot_of.remove(&token) {
            self.release(slot);
        }
        let (id, index) = self.tokens.remove(&token)?;
        let job = self.jobs.get_mut(&id)?;
        let config = job.config.clone();
        let channel = config.channel(job.fanout.channel())?;
        let leg = job.fanout.leg_at(index, token)?;
        let sub = channel.subscribers.get(index)?;
        let status = if num_headers == 0 {
            None
        } else {
            host.call_status()
        };
        let clock = Clock::new(host);
        // The cluster this leg called.
        let cluster = leg_cluster(sub, leg);
        let mut discarded = false;
        let end = match status {
            Some(status) if is_success(status) => {
                // Read an answer's headers and body only to pass it on: a plain success costs
                // no more host calls.
                let reply =
                    if leg == Leg::Event && sub.reply.is_some() && reply::may_be_reply(status) {
                        match reply::read(host.call_headers(), body_size, config.max_body_bytes) {
                            Answered::Nothing => None,
                            Answered::NotAnEvent => {
                                discarded = true;
                                None
                            }
                            Answered::TooLarge(failure) => Some(Err(failure)),
                            Answered::Event(headers) => Some(Ok(ReplyEvent {
                                headers: headers.into_iter().collect(),
                                body: if body_size > 0 {
                                    host.call_body(body_size)
                                } else {
                                    Vec::new()
                                },
                            })),
                        }
                    } else {
                        None
                    };
                CallEnd {
                    reply,
                    ..CallEnd::ok()
                }
            }
            _ => {
                let body = if body_size > 0 {
                    host.call_body(body_size.min(BODY_PEEK_BYTES))
                } else {
                    Vec::new()
                };
                let retry_after_ms =
                    if sub.retry.retry > 0 && status.is_some_and(honours_retry_after) {
                        host.call_header("retry-after")
                            .and_then(|v| parse_retry_after(&v, clock.now()))
                    } else {
                        None
                    };
                CallEnd {
                    result: classify(cluster, status, &body),
                    retry_after_ms,
                    body,
                    reply: None,
                }
            }
        };
        if discarded {
            log::debug!(
                "[#{}] channel {}: subscriber {} answered {} with a body that is not a \
                 CloudEvent (no ce-* header, no application/cloudevents content type): not a \
                 reply, discarded",
                job.log_id,
                channel.name,
                sub.cluster,
                status.unwrap_or(0)
            );
        }
        let reply_refused = match &end.reply {
            Some(Err(failure)) => Some(failure.clone()),
            _ => None,
        };
        // The time: for a failure (its wait, its elapsed time) and for the duration metric.
        let now = if end.result.is_err() || reply_refused.is_some() || config.metrics {
            clock.now()
        } else {
            0
        };
        let result = end.result.clone();
        job.fanout.completed_at(index, token, end, now, channel)?;
        // A reply that failed for good: the reply leg's own failure, or one too large to send.
        let reply_failure = match (&result, reply_refused) {
            (_, Some(failure)) => Some(failure),
            (Err(failure), None) if leg == Leg::Reply => Some(failure.clone()),
            _ => None,
        }
        .filter(|_| !job.fanout.is_retrying(index));
        if let Err(failure) = &result {
            log_failure(job, channel, index, leg, failure);
        }
        if let Some(failure) = reply_failure.as_ref().filter(|_| result.is_ok()) {
            log_failure(job, channel, index, Leg::Reply, failure);
        }
        let duration = now.saturating_sub(job.started_ms);
        let dead_lettered = leg == Leg::DeadLetter && result.is_ok();
        count(&self.telemetry, &config, |tally| {
            tally.call_ended(cluster, &result, Some(duration));
            if dead_lettered {
                tally.dead_lettered(&sub.cluster);
            }
            if discarded {
                tally.reply_discarded(&sub.cluster);
            }
            if let Some(failure) = &reply_failure {
                tally.reply_failed(&sub.cluster, failure);
            }
        });
        // A leg that just changed (reply, dead letter) goes out at once.
        self.pump(host, &clock, id, from_root)
    }

    fn finish_if_done<H: Host>(&mut self, clock: &Clock<'_, H>, id: u64) -> Option<Finished> {
        let job = self.jobs.get_mut(&id)?;
        if !job.fanout.is_done() {
            return self.answer_if_due(id);
        }
        let mut job = self.jobs.remove(&id)?;
        self.settle(clock, &mut job);
        let channel = job.config.channel(job.fanout.channel())?;
        let answer = job.fanout.verdict(channel);
        let duration = if job.config.metrics {
            clock.now().saturating_sub(job.started_ms)
        } else {
            0
        };
        let best_effort_failed = job.fanout.best_effort_failed(channel);
        if best_effort_failed > 0 {
            // Never in the answer's status: logged and counted here, dead-lettered if
            // configured (a dead-lettered one is not failed).
            log::warn!(
                "[#{}] channel {}: {best_effort_failed} best-effort subscriber(s) failed for good",
                job.log_id,
                channel.name
            );
            // Async mode counts every failure after the 202 below.
            if job.config.mode == AnswerMode::Sync {
                self.count(&job.config, |tally| tally.undelivered());
            }
        }
        match job.config.mode {
            // Answered already (best-effort deliveries went on after it): it ends like an
            // async one.
            AnswerMode::Sync if job.answer_to.is_none() => {
                self.count(&job.config, |tally| tally.fanout_ended(Some(duration)));
            }
            AnswerMode::Sync => {
                if answer.status != 202 {
                    log::info!(
                        "[#{}] channel {}: answered {}: {} of {} subscriber(s) failed, {} skipped",
                        job.log_id,
                        channel.name,
                        answer.status,
                        job.fanout.failures().count(),
                        channel.subscribers.len(),
                        job.fanout.skipped()
                    );
                }
                let status = answer.status;
                self.count(&job.config, |tally| {
                    tally.answered(status);
                    tally.fanout_ended(Some(duration));
                });
            }
            AnswerMode::Async => {
                if answer.status == 500 {
                    // The sender already has its 202: this is the only trace of the loss.
                    log::warn!(
                        "[#{}] channel {}: async delivery failed for good after the 202: {}",
                        job.log_id,
                        channel.name,
                        String::from_utf8_lossy(&answer.body)
                    );
                }
                // A 409 (dedupe: another request delivers to some subscribers) is no loss.
                let undelivered = job.fanout.failures().next().is_some();
                self.count(&job.config, |tally| {
                    if undelivered {
                        tally.undelivered();
                    }
                    tally.fanout_ended(Some(duration));
                });
            }
        }
        Some(Finished {
            answer_to: job.answer_to,
            answer,
        })
    }

    /// A sync fan-out whose required subscribers have all ended while best-effort ones are
    /// still being delivered to: the sender is answered now (202 with `x-fanout-pending`, or
    /// the 500 of a required failure) and the rest goes on from the root context.
    fn answer_if_due(&mut self, id: u64) -> Option<Finished> {
        let job = self.jobs.get_mut(&id)?;
        let channel = job.config.channel(job.fanout.channel())?;
        if job.answer_to.is_none() || !job.fanout.required_done(channel) {
            return None;
        }
        let answer = job.fanout.verdict(channel);
        let answer_to = job.answer_to.take();
        let config = job.config.clone();
        let status = answer.status;
        self.count(&config, |tally| tally.answered(status));
        Some(Finished { answer_to, answer })
    }

    /// Records `dedupe`'s outcome of a job that ended (async too: at the end of the background
    /// delivery, not at its 202).
    fn settle<H: Host>(&mut self, clock: &Clock<'_, H>, job: &mut Job) {
        if let Some(claimed) = job.redelivery.take() {
            let mut settled = settle::settle(
                clock.host,
                clock.now(),
                &job.config,
                claimed,
                &job.fanout,
                job.log_id,
            );
            if let Some(remote) = settled.remote.take() {
                self.store.queue(remote);
                self.count(&job.config, |tally| tally.owed(1));
            }
            self.count(&job.config, |tally| settled.record(tally));
        }
    }

    fn count(&self, config: &Config, record: impl FnOnce(&mut crate::metrics::Tally)) {
        count(&self.telemetry, config, record);
    }
}

/// Counts, unless metrics are off. A busy telemetry cell (never expected: nothing re-enters
/// while it is borrowed) loses the count rather than panicking.
fn count(
    telemetry: &Rc<RefCell<Telemetry>>,
    config: &Config,
    record: impl FnOnce(&mut crate::metrics::Tally),
) {
    if config.metrics {
        if let Ok(mut telemetry) = telemetry.try_borrow_mut() {
            record(&mut telemetry.tally);
        }
    }
}

/// The cluster the `leg` call of `sub` goes to.
fn leg_cluster(sub: &Subscriber, leg: Leg) -> &str {
    match leg {
        Leg::Event => sub.cluster.as_str(),
        Leg::Reply => sub.reply.as_ref().map_or("", |t| t.cluster.as_str()),
        Leg::DeadLetter => sub.dead_letter.as_ref().map_or("", |t| t.cluster.as_str()),
    }
}

fn job_attempts(job: &Job, index: usize) -> u32 {
    job.fanout.event_attempts(index)
}

fn log_failure(job: &Job, channel: &Channel, index: usize, leg: Leg, failure: &Failure) {
    let cluster = channel
        .subscribers
        .get(index)
        .map_or("?", |s| s.cluster.as_str());
    let what = match leg {
        Leg::Event => String::new(),
        other => format!(" ({})", other.name()),
    };
    if job.fanout.is_failed(index) {
        log::warn!(
            "[#{}] channel {}: subscriber {cluster} failed{what}: {failure}",
            job.log_id,
            channel.name
        );
    } else if job.fanout.is_retrying(index) {
        log::debug!(
            "[#{}] channel {}: subscriber {cluster}{what}: {failure}; trying again",
            job.log_id,
            channel.name
        );
    } else {
        // Its dead-letter target is called next; a warning follows if that fails too.
        log::debug!(
            "[#{}] channel {}: subscriber {cluster} failed{what}: {failure}; sending the event \
             to its dead-letter target",
            job.log_id,
            channel.name
        );
    }
}
