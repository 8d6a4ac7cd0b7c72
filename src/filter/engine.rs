//! Deliveries in flight on one worker: every fan-out's [`FanOut`] state, the calls it has
//! under way, and the work the root context's timer must do (retries after their backoff,
//! async deliveries that outlive their request).
//!
//! Who makes a call decides who hears back, and how long the call may live: Envoy cancels a
//! stream's calls when the stream ends, while calls made from the root context live as long as
//! the plugin. So a sync fan-out sends its first attempts from its stream (no timer delay),
//! and everything sent from the timer (retries, async deliveries) belongs to the root. Either
//! context hands the answers to this engine, which owns the state; the engine never answers a
//! sender itself but returns the answer to the glue, so no `RefCell` is borrowed while Envoy
//! runs the local reply.

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use super::redelivery::{self, Redelivery};
use super::telemetry::Telemetry;
use super::Host;
use crate::answer::Answer;
use crate::config::{Channel, Config, Mode};
use crate::delivery::{honours_retry_after, parse_retry_after};
use crate::fanout::{
    classify, is_success, CallEnd, Failure, FanOut, Leg, ReplyEvent, BODY_PEEK_BYTES,
};
use crate::reply::{self, Answered, PREFER_REPLY};

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
    pub forwarded: Vec<(String, String)>,
    /// The stream waiting for the answer (sync mode); `None` once async or abandoned.
    pub answer_to: Option<u32>,
    /// Context id for log lines.
    pub log_id: u32,
    pub started_ms: u64,
    /// `dedupe`'s claims of this event, settled when the fan-out ends.
    pub redelivery: Option<Redelivery>,
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

pub struct Engine {
    jobs: HashMap<u64, Job>,
    /// Pending call token -> job and subscriber index.
    tokens: HashMap<u32, (u64, usize)>,
    next_job: u64,
    telemetry: Rc<RefCell<Telemetry>>,
}

impl Engine {
    pub fn new(telemetry: Rc<RefCell<Telemetry>>) -> Self {
        Engine {
            jobs: HashMap::new(),
            tokens: HashMap::new(),
            next_job: 1,
            telemetry,
        }
    }

    /// Async fan-outs still delivering (what `max_in_flight` bounds).
    pub fn async_in_flight(&self) -> usize {
        self.jobs
            .values()
            .filter(|job| job.config.mode == Mode::Async)
            .count()
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
        self.count(&job.config, |tally| tally.fanout_started());
        self.jobs.insert(id, job);
        let finished = if send_now {
            self.pump(host, &Clock::new(host), id)
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
            if job.config.mode == Mode::Async {
                return;
            }
        }
        if let Some(mut job) = self.jobs.remove(&id) {
            self.tokens.retain(|_, (j, _)| *j != id);
            self.settle(&Clock::new(host), &mut job);
            self.count(&job.config, |tally| tally.fanout_ended(None));
        }
    }

    /// Whether the root context's timer has work: calls to send or retries waiting.
    pub fn has_timed_work(&self) -> bool {
        self.jobs
            .values()
            .any(|job| job.fanout.has_ready() || job.fanout.waiting() > 0)
    }

    /// The root context's timer: sends what is due in every fan-out, and gives up on those
    /// whose answers can no longer come.
    pub fn tick<H: Host>(&mut self, host: &H) -> Vec<Finished> {
        let clock = Clock::new(host);
        let now = clock.now();
        let lost: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, job)| now > job.deadline_ms())
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
            self.tokens.retain(|_, (job, _)| *job != id);
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
        finished.extend(due.into_iter().filter_map(|id| self.pump(host, &clock, id)));
        finished
    }

    /// Sends every call of job `id` that is due, until none is (a refused call may turn into
    /// a dead letter at once); returns the answer if the fan-out ended.
    fn pump<H: Host>(&mut self, host: &H, clock: &Clock<'_, H>, id: u64) -> Option<Finished> {
        loop {
            let job = self.jobs.get_mut(&id)?;
            // The time matters only to retries waiting for it.
            let now = if job.fanout.waiting() > 0 {
                clock.now()
            } else {
                0
            };
            let sends = job.fanout.take_ready(now);
            if sends.is_empty() {
                break;
            }
            let config = job.config.clone();
            let channel = config.channel(job.fanout.channel())?;
            let telemetry = self.telemetry.clone();
            for send in sends {
                let job = self.jobs.get_mut(&id)?;
                let sub_cluster = channel.subscribers.get(send.index)?.cluster.as_str();
                let call = CallPlan::new(job, channel, send.index, send.leg)?;
                let result = host.dispatch(call.cluster, call.headers(), &call.body, call.timeout);
                let cluster = call.cluster.to_string();
                drop(call);
                let retry = send.leg == Leg::Event && job_attempts(job, send.index) > 0;
                match result {
                    Ok(token) => {
                        job.fanout.dispatched(send.index, token);
                        self.tokens.insert(token, (id, send.index));
                    }
                    Err(detail) => {
                        let failure = Failure::DispatchError {
                            detail: detail.clone(),
                        };
                        job.fanout
                            .dispatch_failed(send.index, detail, clock.now(), channel);
                        log_failure(job, channel, send.index, send.leg, &failure);
                        let reply_gave_up =
                            send.leg == Leg::Reply && !job.fanout.is_retrying(send.index);
                        count(&telemetry, &config, |tally| {
                            if reply_gave_up {
                                tally.reply_failed(sub_cluster, &failure);
                            }
                            tally.call_ended(&cluster, &Err(failure), None)
                        });
                    }
                }
                count(&telemetry, &config, |tally| {
                    tally.call_started(&cluster);
                    if retry {
                        tally.retried(sub_cluster);
                    }
                });
            }
        }
        self.finish_if_done(clock, id)
    }

    /// The answer to call `token` is being delivered (to whichever context made the call).
    pub fn on_response<H: Host>(
        &mut self,
        host: &H,
        token: u32,
        num_headers: usize,
        body_size: usize,
    ) -> Option<Finished> {
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
                                headers,
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
                    result: classify(status, &body),
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
        let cluster = match leg {
            Leg::Event => sub.cluster.as_str(),
            Leg::Reply => sub.reply.as_ref().map_or("", |t| t.cluster.as_str()),
            Leg::DeadLetter => sub.dead_letter.as_ref().map_or("", |t| t.cluster.as_str()),
        }
        .to_string();
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
            tally.call_ended(&cluster, &result, Some(duration));
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
        self.pump(host, &clock, id)
    }

    fn finish_if_done<H: Host>(&mut self, clock: &Clock<'_, H>, id: u64) -> Option<Finished> {
        if !self.jobs.get(&id)?.fanout.is_done() {
            return None;
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
        match job.config.mode {
            Mode::Sync => {
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
            Mode::Async => {
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

    /// Records `dedupe`'s outcome of a job that ended (async too: at the end of the background
    /// delivery, not at its 202).
    fn settle<H: Host>(&self, clock: &Clock<'_, H>, job: &mut Job) {
        if let Some(claimed) = job.redelivery.take() {
            let settled = redelivery::settle(
                clock.host,
                clock.now(),
                &job.config,
                claimed,
                &job.fanout,
                job.log_id,
            );
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

/// One call, as it is handed to Envoy.
struct CallPlan<'a> {
    cluster: &'a str,
    timeout: std::time::Duration,
    base: &'a [(String, String)],
    /// `Prefer: reply`: the call is to a subscriber whose replies are passed on.
    prefer_reply: bool,
    extra: Vec<(String, String)>,
    forwarded: &'a [(String, String)],
    /// Forwarded headers the `extra` ones replace (a dead letter's error attributes).
    replaced: fn(&str) -> bool,
    body: Cow<'a, [u8]>,
}

impl<'a> CallPlan<'a> {
    fn new(job: &'a Job, channel: &'a Channel, index: usize, leg: Leg) -> Option<CallPlan<'a>> {
        let sub = channel.subscribers.get(index)?;
        Some(match leg {
            Leg::Event => CallPlan {
                cluster: &sub.cluster,
                timeout: sub.timeout,
                base: &sub.call_headers,
                prefer_reply: sub.reply.is_some(),
                extra: Vec::new(),
                forwarded: &job.forwarded,
                replaced: |_| false,
                body: Cow::Borrowed(&job.body),
            },
            Leg::DeadLetter => {
                let target = sub.dead_letter.as_ref()?;
                let letter = job
                    .fanout
                    .dead_letter(index, channel, &job.forwarded, &job.body);
                CallPlan {
                    cluster: &target.cluster,
                    timeout: target.timeout,
                    base: &target.call_headers,
                    prefer_reply: false,
                    extra: letter.headers,
                    forwarded: &job.forwarded,
                    replaced: crate::dead_letter::replaces,
                    body: letter.body.map_or(Cow::Borrowed(&job.body[..]), Cow::Owned),
                }
            }
            Leg::Reply => {
                let target = sub.reply.as_ref()?;
                let reply = job.fanout.reply_event(index)?;
                CallPlan {
                    cluster: &target.cluster,
                    timeout: target.timeout,
                    base: &target.call_headers,
                    prefer_reply: false,
                    extra: Vec::new(),
                    forwarded: &reply.headers,
                    replaced: |_| false,
                    body: Cow::Borrowed(&reply.body),
                }
            }
        })
    }

    fn headers(&self) -> Vec<(&str, &str)> {
        let prefer = self.prefer_reply.then_some(PREFER_REPLY);
        self.base
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_str()))
            .chain(prefer)
            .chain(
                self.extra
                    .iter()
                    .map(|(name, value)| (name.as_str(), value.as_str())),
            )
            .chain(
                self.forwarded
                    .iter()
                    .filter(|(name, _)| !(self.replaced)(name))
                    .map(|(name, value)| (name.as_str(), value.as_str())),
            )
            .collect()
    }
}
