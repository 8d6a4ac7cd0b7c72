//! One event being delivered, through its life: taken with its channel and claims, each call's
//! end recorded into its [`FanOut`] (with what that end counts and logs), and given up as lost
//! when its calls can no longer come back.

use std::rc::Rc;

use crate::answer::Answer;
use crate::call::{Failure, Leg};
use crate::config::{Channel, Config, Subscriber};
use crate::dedupe::settle::Claims;
use crate::fan_out_state::FanOut;
use crate::format::{self, Format};
use crate::headers::Forwarded;
use crate::metrics::Tally;
use crate::request::Event;

use super::call_end::AnsweredCall;
use super::spans::JobSpans;

/// One event being delivered.
pub struct Job {
    pub config: Rc<Config>,
    /// The channel it is delivered to (one of `config`'s).
    pub channel: Rc<Channel>,
    pub fanout: FanOut,
    pub body: Vec<u8>,
    pub forwarded: Forwarded,
    /// The event in the other content mode, for the subscribers whose `delivery.format` asks
    /// for it (`None`: nobody does).
    pub converted: Option<Box<Variant>>,
    /// The stream waiting for the answer (sync mode); `None` once async or abandoned.
    pub answer_to: Option<u32>,
    /// Context id for log lines.
    pub log_id: u32,
    pub started_ms: u64,
    /// `dedupe`'s claims of this event, settled when the fan-out ends.
    pub claims: Option<Claims>,
    /// The etcd store failed for it (`on_store_error: deliver`): its outcome will not be
    /// recorded, and its answer says so.
    pub unrecorded: bool,
    /// Its calls in `max_concurrent_calls`' line (the deliveries' to keep; start with the
    /// default).
    pub line: InLine,
    /// Its spans, when the request is traced.
    pub spans: Option<Box<JobSpans>>,
}

/// The event converted once, for every subscriber whose `delivery.format` is `format`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Variant {
    pub format: Format,
    pub forwarded: Forwarded,
    pub body: Vec<u8>,
}

impl Variant {
    /// The event (its content mode as `event` read it), as `forwarded` and `body` carry it,
    /// converted for `channel`'s subscribers that want the other content mode; `None` when
    /// none does. `Err`: the 400 naming the first subscriber with a format whose event cannot
    /// be converted exactly (or is no single CloudEvent), decided before anyone is called.
    pub fn prepare(
        channel: &Channel,
        event: &Event,
        forwarded: &Forwarded,
        body: &[u8],
    ) -> Result<Option<Box<Variant>>, Answer> {
        if !channel.converts {
            return Ok(None);
        }
        let pairs: Vec<(&[u8], &[u8])> = forwarded
            .iter()
            .map(|(name, value)| (name.as_bytes(), value))
            .collect();
        let incoming = event.format();
        let mut variant = None;
        for (index, sub) in channel.subscribers.iter().enumerate() {
            let Some(wanted) = sub.format else {
                continue;
            };
            let refused = |reason: &str| {
                Answer::rejected(
                    400,
                    &format!(
                        "subscriber {} (#{index}) takes events in {wanted} mode \
                         (delivery.format), and this request cannot be converted: {reason}",
                        sub.cluster
                    ),
                )
            };
            let mode = incoming.as_ref().map_err(|reason| refused(reason))?;
            if *mode == wanted || variant.is_some() {
                continue;
            }
            let converted = format::convert(wanted, &pairs, body).map_err(|r| refused(&r))?;
            variant = Some(Box::new(Variant {
                format: converted.format,
                forwarded: converted
                    .headers
                    .iter()
                    .map(|(name, value)| (String::from_utf8_lossy(name), value))
                    .collect(),
                body: converted.body,
            }));
        }
        Ok(variant)
    }
}

/// A job's calls in line.
#[derive(Debug, Default)]
pub struct InLine {
    /// Calls waiting for a call slot, or given one and not yet sent: a job with calls in
    /// line is never lost.
    pub calls: usize,
    /// When a call of it last left the line (its deadline runs from then).
    pub left_at: Option<u64>,
}

/// How long past its worst case (every attempt timing out, every backoff at its longest) a
/// fan-out is kept before its open calls are given up as lost. Calls end by their timeouts,
/// so this only matters when Envoy drops a call without an answer, e.g. one made by a root
/// context that a configuration update retired.
pub const LOST_CALL_GRACE_MS: u64 = 30_000;

/// A call's end as recorded: what it counts.
#[derive(Debug)]
pub struct Recorded {
    pub result: Result<(), Failure>,
    /// A reply that failed for good: the reply leg's own failure, or one too large to send.
    pub reply_failure: Option<Failure>,
    /// A dead letter was taken.
    pub dead_lettered: bool,
    /// A 2xx that is no reply event was dropped.
    pub discarded: bool,
    /// Since the job started.
    pub duration_ms: u64,
}

impl Recorded {
    /// Counts it: the call's end under the cluster `leg` called, the rest under the
    /// subscriber's own.
    pub fn count(&self, tally: &mut Tally, sub: &Subscriber, leg: Leg) {
        tally.call_ended(leg_stats(sub, leg), &self.result, Some(self.duration_ms));
        if self.dead_lettered {
            tally.dead_lettered(sub.stats.event);
        }
        if self.discarded {
            tally.reply_discarded(&sub.cluster);
        }
        if let Some(failure) = &self.reply_failure {
            tally.reply_failed(&sub.cluster, failure);
        }
    }
}

impl Job {
    /// The headers and body `sub`'s event (and its dead letter) carry: the converted ones
    /// when its `delivery.format` is theirs, else the event as it came.
    pub fn message(&self, sub: &Subscriber) -> (&Forwarded, &[u8]) {
        match (&self.converted, sub.format) {
            (Some(variant), Some(format)) if variant.format == format => {
                (&variant.forwarded, &variant.body)
            }
            _ => (&self.forwarded, &self.body),
        }
    }

    /// When its calls, if still open, are given up as lost: past the worst case of its
    /// slowest subscriber, plus `LOST_CALL_GRACE_MS`.
    pub fn deadline_ms(&self) -> u64 {
        let worst = self
            .channel
            .subscribers
            .iter()
            .map(|sub| sub.worst_case_ms())
            .max()
            .unwrap_or(0);
        self.started_ms
            .saturating_add(worst)
            .saturating_add(LOST_CALL_GRACE_MS)
    }

    /// Whether its open calls are lost at `now_ms`. A job with calls in line is not; once a
    /// call of it left the line, its deadline runs from then.
    pub fn is_lost(&self, now_ms: u64) -> bool {
        let deadline = self.deadline_ms();
        let from_line = self.line.left_at.map_or(0, |sent| {
            deadline
                .saturating_sub(self.started_ms)
                .saturating_add(sent)
        });
        self.line.calls == 0 && now_ms > deadline.max(from_line)
    }

    /// Records the end of call `token` (subscriber `index`, `leg`) at `now_ms` and logs a
    /// failure; `None` (nothing changed) for a call this job does not wait for.
    pub fn record(
        &mut self,
        index: usize,
        token: u32,
        leg: Leg,
        ended: AnsweredCall,
        now_ms: u64,
    ) -> Option<Recorded> {
        let reply_refused = match &ended.end.reply {
            Some(Err(failure)) => Some(failure.clone()),
            _ => None,
        };
        let result = ended.end.result.clone();
        self.fanout
            .completed_at(index, token, ended.end, now_ms, &self.channel)?;
        let reply_failure = match (&result, reply_refused) {
            (_, Some(failure)) => Some(failure),
            (Err(failure), None) if leg == Leg::Reply => Some(failure.clone()),
            _ => None,
        }
        .filter(|_| !self.fanout.is_retrying(index));
        if let Err(failure) = &result {
            self.log_failure(index, leg, failure);
        }
        if let Some(failure) = reply_failure.as_ref().filter(|_| result.is_ok()) {
            self.log_failure(index, Leg::Reply, failure);
        }
        Some(Recorded {
            dead_lettered: leg == Leg::DeadLetter && result.is_ok(),
            result,
            reply_failure,
            discarded: ended.discarded,
            duration_ms: now_ms.saturating_sub(self.started_ms),
        })
    }

    /// Logs a failure of subscriber `index`'s `leg` at the level its consequence deserves.
    pub fn log_failure(&self, index: usize, leg: Leg, failure: &Failure) {
        let channel = &self.channel;
        let cluster = channel
            .subscribers
            .get(index)
            .map_or("?", |s| s.cluster.as_str());
        // `Leg::name` in parentheses, after the subscriber.
        let what = match leg {
            Leg::Event => "",
            Leg::Reply => " (reply)",
            Leg::DeadLetter => " (dead_letter)",
        };
        if self.fanout.is_failed(index) {
            log::warn!(
                "[#{}] channel {}: subscriber {cluster} failed{what}: {failure}",
                self.log_id,
                channel.name
            );
        } else if self.fanout.is_retrying(index) {
            log::debug!(
                "[#{}] channel {}: subscriber {cluster}{what}: {failure}; trying again",
                self.log_id,
                channel.name
            );
        } else {
            // Its dead-letter target is called next; a warning follows if that fails too.
            log::debug!(
                "[#{}] channel {}: subscriber {cluster} failed{what}: {failure}; sending the \
                 event to its dead-letter target",
                self.log_id,
                channel.name
            );
        }
    }
}

/// The cluster the `leg` call of `sub` goes to.
/// Where the calls of `sub`'s `leg` are counted (see [`crate::config::LegStats`]).
pub fn leg_stats(sub: &Subscriber, leg: Leg) -> usize {
    match leg {
        Leg::Event => sub.stats.event,
        Leg::Reply => sub.stats.reply,
        Leg::DeadLetter => sub.stats.dead_letter,
    }
}

pub fn leg_cluster(sub: &Subscriber, leg: Leg) -> &str {
    match leg {
        Leg::Event => sub.cluster.as_str(),
        Leg::Reply => sub.reply.as_ref().map_or("", |t| t.cluster.as_str()),
        Leg::DeadLetter => sub.dead_letter.as_ref().map_or("", |t| t.cluster.as_str()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fan_out_state::{CallEnd, ReplyEvent};

    fn job(json: &str, started_ms: u64) -> Job {
        let config = Rc::new(Config::from_json(json.as_bytes()).unwrap());
        let channel = config.channels[0].clone();
        Job {
            fanout: FanOut::new(channel.subscribers.len(), started_ms),
            config,
            channel,
            body: Vec::new(),
            forwarded: Forwarded::default(),
            converted: None,
            answer_to: None,
            log_id: 1,
            started_ms,
            claims: None,
            unrecorded: false,
            line: InLine::default(),
            spans: None,
        }
    }

    fn ended(end: CallEnd) -> AnsweredCall {
        AnsweredCall {
            status: None,
            end,
            discarded: false,
        }
    }

    /// Sends every ready call; their tokens, in order.
    fn send_all(job: &mut Job) -> Vec<u32> {
        let sends = job.fanout.take_ready(0);
        sends
            .iter()
            .map(|send| {
                let token = 10 + send.index as u32;
                job.fanout.dispatched(send.index, token);
                token
            })
            .collect()
    }

    #[test]
    fn the_deadline_is_the_slowest_subscribers_worst_case_and_the_grace() {
        let mut job = job(
            r#"{"subscribers": [{"cluster": "a", "timeout_ms": 1000},
                                {"cluster": "b", "timeout_ms": 3000}]}"#,
            100,
        );
        assert_eq!(job.deadline_ms(), 100 + 3000 + LOST_CALL_GRACE_MS);
        assert!(!job.is_lost(job.deadline_ms()));
        assert!(job.is_lost(job.deadline_ms() + 1));
        // Calls in line: never lost; one that left the line late: its deadline moves.
        job.line.calls = 1;
        assert!(!job.is_lost(u64::MAX));
        job.line.calls = 0;
        job.line.left_at = Some(5000);
        assert!(!job.is_lost(job.deadline_ms() + 1));
        assert!(job.is_lost(job.deadline_ms() + 5000));
    }

    #[test]
    fn a_recorded_end_says_what_it_counts() {
        let mut job = job(
            r#"{"subscribers": [{"cluster": "a", "delivery": {"dead_letter": {"cluster": "dl"}}}]}"#,
            0,
        );
        let tokens = send_all(&mut job);
        let failure = Failure::Status {
            status: 500,
            detail: String::new(),
        };
        let recorded = job
            .record(
                0,
                tokens[0],
                Leg::Event,
                ended(CallEnd::failed(failure.clone())),
                40,
            )
            .unwrap();
        assert_eq!(recorded.result, Err(failure));
        assert_eq!(recorded.duration_ms, 40);
        assert!(!recorded.dead_lettered && recorded.reply_failure.is_none());
        // The dead letter goes next; its success is counted as one.
        let sends = job.fanout.take_ready(40);
        assert_eq!(sends.len(), 1);
        assert_eq!(sends[0].leg, Leg::DeadLetter);
        job.fanout.dispatched(0, 99);
        let recorded = job
            .record(0, 99, Leg::DeadLetter, ended(CallEnd::ok()), 50)
            .unwrap();
        assert!(recorded.dead_lettered && recorded.result.is_ok());
        assert!(job.fanout.is_done());
    }

    #[test]
    fn an_end_the_job_does_not_wait_for_is_not_recorded() {
        let mut job = job(r#"{"subscribers": [{"cluster": "a"}]}"#, 0);
        send_all(&mut job);
        assert!(job
            .record(0, 12345, Leg::Event, ended(CallEnd::ok()), 1)
            .is_none());
        assert!(!job.fanout.is_done());
    }

    #[test]
    fn a_failed_reply_leg_is_a_reply_failure() {
        let mut job = job(
            r#"{"subscribers": [{"cluster": "a", "reply": {"cluster": "r"}}]}"#,
            0,
        );
        let tokens = send_all(&mut job);
        let reply = ReplyEvent::default();
        job.record(0, tokens[0], Leg::Event, ended(CallEnd::replied(reply)), 1)
            .unwrap();
        let sends = job.fanout.take_ready(1);
        assert_eq!(sends[0].leg, Leg::Reply);
        job.fanout.dispatched(0, 77);
        let recorded = job
            .record(
                0,
                77,
                Leg::Reply,
                ended(CallEnd::failed(Failure::Timeout)),
                2,
            )
            .unwrap();
        assert_eq!(recorded.reply_failure, Some(Failure::Timeout));
    }

    #[test]
    fn each_leg_calls_its_own_cluster() {
        let job = job(
            r#"{"subscribers": [{"cluster": "a", "reply": {"cluster": "r"},
                                 "delivery": {"dead_letter": {"cluster": "dl"}}},
                                {"cluster": "b"}]}"#,
            0,
        );
        let (with, without) = (&job.channel.subscribers[0], &job.channel.subscribers[1]);
        assert_eq!(leg_cluster(with, Leg::Event), "a");
        assert_eq!(leg_cluster(with, Leg::Reply), "r");
        assert_eq!(leg_cluster(with, Leg::DeadLetter), "dl");
        assert_eq!(leg_cluster(without, Leg::Reply), "");
    }
}
