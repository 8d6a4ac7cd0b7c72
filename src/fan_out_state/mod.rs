//! The state of one fan-out: one call per subscriber, each pending until it ends, and the
//! verdict once all have ended.
//!
//! It knows nothing of who performs the calls (the stream's context, or the root context for
//! retries and async deliveries) nor of proxy-wasm: `deliveries` reports what happened to
//! each call (dispatched with a token, refused at dispatch, answered) and asks for the
//! verdict when [`FanOut::is_done`]. Tokens it does not know, or knows as already ended, are
//! ignored, so a late or duplicate callback cannot change an answer.

use crate::call::{Failure, Leg};
use crate::config::Channel;
use crate::dead_letter::{Cause, DeadLetter};
use crate::headers::Forwarded;
use crate::jitter::JitterRng;
use crate::retry::is_retryable;
use report::FailureReport;

mod report;

/// A call to make now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadyCall {
    pub index: usize,
    pub leg: Leg,
}

/// A subscriber's 2xx answer that is itself an event, to pass on to its reply target.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplyEvent {
    /// `content-type` and `ce-*` of the answer.
    pub headers: Forwarded,
    pub body: Vec<u8>,
}

/// How a call ended, as the deliveries saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallEnd {
    pub result: Result<(), Failure>,
    /// How long the answer's `retry-after` asks to wait, in ms.
    pub retry_after_ms: Option<u64>,
    /// The start of a failed answer's body (at most [`crate::call::BODY_PEEK_BYTES`]), for the dead
    /// letter's `knativeerrordata`.
    pub body: Vec<u8>,
    /// A 2xx answer that is a reply event, when the subscriber has a reply target (see
    /// [`crate::reply`]); `Err` when it cannot be passed on (too large).
    pub reply: Option<Result<ReplyEvent, Failure>>,
}

impl CallEnd {
    pub fn ok() -> CallEnd {
        CallEnd {
            result: Ok(()),
            retry_after_ms: None,
            body: Vec::new(),
            reply: None,
        }
    }

    pub fn failed(failure: Failure) -> CallEnd {
        CallEnd {
            result: Err(failure),
            ..CallEnd::ok()
        }
    }

    /// A 2xx whose reply event goes to the subscriber's reply target.
    pub fn replied(reply: ReplyEvent) -> CallEnd {
        CallEnd {
            reply: Some(Ok(reply)),
            ..CallEnd::ok()
        }
    }
}

/// A failed attempt of one leg, as the dead letter needs it.
#[derive(Debug, Clone)]
struct LegFailure {
    failure: Failure,
    /// The start of the answer's body.
    body: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum CallState {
    /// To be sent now.
    Ready,
    /// Handed out by [`FanOut::take_ready`]; it reports `dispatched` or
    /// `dispatch_failed`.
    Sending,
    Pending {
        token: u32,
    },
    /// Waiting to be retried.
    Waiting {
        until_ms: u64,
    },
    /// Its filter does not want the event: never called.
    Skipped,
    /// `dedupe` recorded that it already took this event: not called again.
    AlreadyDelivered,
    /// `dedupe`: another request is delivering this event to it right now: not called.
    InProgress,
    Delivered,
    /// Failed for good, but the dead-letter target took the event.
    DeadLettered,
    Failed {
        elapsed_ms: u64,
    },
}

#[derive(Debug, Clone)]
struct Call {
    leg: Leg,
    state: CallState,
    /// Attempts of the current leg.
    leg_attempts: u32,
    /// Attempts of the event leg (what the report calls attempts).
    event_attempts: u32,
    /// Last failure of each leg.
    event_failure: Option<LegFailure>,
    reply_failure: Option<LegFailure>,
    dead_letter_failure: Option<LegFailure>,
    reply: Option<ReplyEvent>,
}

impl Call {
    fn failure_slot(&mut self, leg: Leg) -> &mut Option<LegFailure> {
        match leg {
            Leg::Event => &mut self.event_failure,
            Leg::Reply => &mut self.reply_failure,
            Leg::DeadLetter => &mut self.dead_letter_failure,
        }
    }

    fn failure(&self, leg: Leg) -> Option<&Failure> {
        match leg {
            Leg::Event => self.event_failure.as_ref(),
            Leg::Reply => self.reply_failure.as_ref(),
            Leg::DeadLetter => self.dead_letter_failure.as_ref(),
        }
        .map(|f| &f.failure)
    }

    /// The leg whose failure sent the event to the dead-letter target: the reply's, when
    /// the subscriber took the event and its reply failed for good.
    fn dead_letter_cause(&self) -> (Leg, Option<&LegFailure>) {
        match &self.reply_failure {
            Some(reply) => (Leg::Reply, Some(reply)),
            None => (Leg::Event, self.event_failure.as_ref()),
        }
    }

    fn ended(&self) -> bool {
        matches!(
            self.state,
            CallState::Skipped
                | CallState::AlreadyDelivered
                | CallState::InProgress
                | CallState::Delivered
                | CallState::DeadLettered
                | CallState::Failed { .. }
        )
    }
}

/// One event's delivery to every subscriber of its channel.
#[derive(Debug)]
pub struct FanOut {
    /// The 500 report lists the subscribers that took the event too.
    full_report: bool,
    started_ms: u64,
    calls: Vec<Call>,
    /// Subscribers whose delivery has not ended.
    open: usize,
    /// Every subscriber of the channel is required (`with_only_required`): the required ones
    /// are done exactly when all are, with no scan. `false` (the default) always scans.
    only_required: bool,
    /// Calls `Ready` or `Waiting`: what `take_ready` may hand out. Kept so that the answer
    /// to one call does not scan every subscriber's when nothing is left to send.
    to_send: usize,
    /// Draws the jitter of its retry waits; seeded by [`FanOut::seed_jitter`] from the
    /// VM's generator when the fan-out starts (tests leave the fixed default).
    jitter_rng: JitterRng,
}

impl FanOut {
    /// A fan-out to the `subscribers` subscribers of a channel, started at `now_ms` (any
    /// clock; only differences are reported). Every subscriber is ready to be sent the event.
    /// The methods that need the channel's configuration are given it.
    pub fn new(subscribers: usize, now_ms: u64) -> FanOut {
        FanOut {
            full_report: false,
            started_ms: now_ms,
            calls: vec![
                Call {
                    leg: Leg::Event,
                    state: CallState::Ready,
                    leg_attempts: 0,
                    event_attempts: 0,
                    event_failure: None,
                    reply_failure: None,
                    dead_letter_failure: None,
                    reply: None,
                };
                subscribers
            ],
            open: subscribers,
            to_send: subscribers,
            only_required: false,
            jitter_rng: JitterRng::with_seed(0),
        }
    }

    /// Seeds the draws of its retry waits' jitter (`delivery.backoff_jitter`).
    pub fn seed_jitter(&mut self, seed: u64) {
        self.jitter_rng = JitterRng::with_seed(seed);
    }

    /// Tells that every subscriber of its channel is required, so that whether the required
    /// ones are done is known without looking at each (on every answer of a sync fan-out).
    pub fn with_only_required(mut self, only_required: bool) -> Self {
        self.only_required = only_required;
        self
    }

    /// Makes the 500 report list every subscriber that took the event as well
    /// (`"report": "full"`).
    pub fn with_full_report(mut self, full: bool) -> Self {
        self.full_report = full;
        self
    }

    /// Subscriber `index` does not want the event: it is not called, and it is done.
    pub fn skip(&mut self, index: usize) {
        self.end_unsent(index, CallState::Skipped);
    }

    /// `dedupe` knows subscriber `index` already took this event: it is not called again,
    /// and it is done (it counts as delivered in the verdict).
    pub fn already_delivered(&mut self, index: usize) {
        self.end_unsent(index, CallState::AlreadyDelivered);
    }

    /// `dedupe` knows another request is delivering this event to subscriber `index` right
    /// now: it is not called, and the verdict asks the sender to retry (409) unless something
    /// failed (500).
    pub fn in_progress_elsewhere(&mut self, index: usize) {
        self.end_unsent(index, CallState::InProgress);
    }

    /// Ends a subscriber's delivery that has not started, in `state`.
    fn end_unsent(&mut self, index: usize, state: CallState) {
        if let Some(call) = self.calls.get_mut(index) {
            if call.state == CallState::Ready && call.leg == Leg::Event && call.leg_attempts == 0 {
                call.state = state;
                self.open = self.open.saturating_sub(1);
                self.to_send = self.to_send.saturating_sub(1);
            }
        }
    }

    /// Whether subscriber `index` took the event in this fan-out: directly (2xx, and its
    /// reply passed on if it has a reply target) or through its dead-letter target.
    pub fn is_delivered(&self, index: usize) -> bool {
        self.calls.get(index).is_some_and(|call| {
            matches!(call.state, CallState::Delivered | CallState::DeadLettered)
        })
    }

    /// Number of subscribers skipped by their filter.
    pub fn skipped(&self) -> usize {
        self.count(|state| *state == CallState::Skipped)
    }

    /// Number of subscribers `dedupe` did not call because another request is delivering the
    /// event to them.
    pub fn in_progress(&self) -> usize {
        self.count(|state| *state == CallState::InProgress)
    }

    fn count(&self, which: impl Fn(&CallState) -> bool) -> usize {
        self.calls.iter().filter(|call| which(&call.state)).count()
    }

    /// The calls to make now: every subscriber ready to be sent something, and every retry
    /// whose wait is over at `now_ms`. The caller reports each back with
    /// [`FanOut::dispatched`] or [`FanOut::dispatch_failed`].
    pub fn take_ready(&mut self, now_ms: u64) -> Vec<ReadyCall> {
        self.take_ready_where(now_ms, |_| true)
    }

    /// [`FanOut::take_ready`] for the subscribers `wanted` accepts; the others stay ready.
    pub fn take_ready_where(
        &mut self,
        now_ms: u64,
        wanted: impl Fn(usize) -> bool,
    ) -> Vec<ReadyCall> {
        // The tests and fuzz targets (debug builds) check the count on every call.
        debug_assert_eq!(
            self.to_send,
            self.count(|state| matches!(state, CallState::Ready | CallState::Waiting { .. }))
        );
        let mut sends = Vec::new();
        if self.to_send == 0 {
            return sends;
        }
        for (index, call) in self.calls.iter_mut().enumerate() {
            if !wanted(index) {
                continue;
            }
            let due = match call.state {
                CallState::Ready => true,
                CallState::Waiting { until_ms } => until_ms <= now_ms,
                _ => false,
            };
            if due {
                call.state = CallState::Sending;
                self.to_send = self.to_send.saturating_sub(1);
                sends.push(ReadyCall {
                    index,
                    leg: call.leg,
                });
            }
        }
        sends
    }

    /// When the next retry is due, if one is waiting.
    pub fn next_wakeup(&self) -> Option<u64> {
        self.calls
            .iter()
            .filter_map(|call| match call.state {
                CallState::Waiting { until_ms } => Some(until_ms),
                _ => None,
            })
            .min()
    }

    /// Whether a call is ready to be sent at once (after a leg changed).
    pub fn has_ready(&self) -> bool {
        self.to_send > 0 && self.calls.iter().any(|call| call.state == CallState::Ready)
    }

    /// The call to subscriber `index` is under way with `token`.
    pub fn dispatched(&mut self, index: usize, token: u32) {
        if let Some(call) = self.calls.get_mut(index) {
            if call.state == CallState::Sending {
                call.state = CallState::Pending { token };
                call.leg_attempts = call.leg_attempts.saturating_add(1);
                if call.leg == Leg::Event {
                    call.event_attempts = call.event_attempts.saturating_add(1);
                }
            }
        }
    }

    /// Envoy refused the call to subscriber `index`: no callback will come for it. It may
    /// still be retried (a cluster can appear later).
    pub fn dispatch_failed(
        &mut self,
        index: usize,
        failure: Failure,
        now_ms: u64,
        channel: &Channel,
    ) {
        let Some(call) = self.calls.get_mut(index) else {
            return;
        };
        if call.state != CallState::Sending {
            return;
        }
        call.leg_attempts = call.leg_attempts.saturating_add(1);
        if call.leg == Leg::Event {
            call.event_attempts = call.event_attempts.saturating_add(1);
        }
        self.fail(index, failure, CallEnd::ok(), now_ms, channel);
    }

    /// Which subscriber and leg a token belongs to, if it is pending.
    pub fn leg_of(&self, token: u32) -> Option<(usize, Leg)> {
        self.calls
            .iter()
            .position(|call| call.state == CallState::Pending { token })
            .and_then(|index| self.leg_at(index, token).map(|leg| (index, leg)))
    }

    /// The leg subscriber `index` is waiting on with `token`, if it is: the deliveries remember
    /// which subscriber a token went to, so a large fan-out need not search.
    pub fn leg_at(&self, index: usize, token: u32) -> Option<Leg> {
        self.calls
            .get(index)
            .filter(|call| call.state == CallState::Pending { token })
            .map(|call| call.leg)
    }

    /// The call with `token` ended. Returns the subscriber's index, or `None` (and changes
    /// nothing) for a token this fan-out is not waiting for, so that late and duplicate
    /// callbacks cannot change an answer.
    pub fn completed(
        &mut self,
        token: u32,
        end: CallEnd,
        now_ms: u64,
        channel: &Channel,
    ) -> Option<usize> {
        let (index, _) = self.leg_of(token)?;
        self.completed_at(index, token, end, now_ms, channel)
    }

    /// [`FanOut::completed`] for a token the caller knows belongs to subscriber `index`.
    pub fn completed_at(
        &mut self,
        index: usize,
        token: u32,
        end: CallEnd,
        now_ms: u64,
        channel: &Channel,
    ) -> Option<usize> {
        let leg = self.leg_at(index, token)?;
        match end.result {
            Ok(()) => self.succeed(index, leg, end.reply, now_ms, channel),
            Err(ref failure) => {
                let failure = failure.clone();
                self.fail(index, failure, end, now_ms, channel);
            }
        }
        Some(index)
    }

    fn succeed(
        &mut self,
        index: usize,
        leg: Leg,
        reply: Option<Result<ReplyEvent, Failure>>,
        now_ms: u64,
        channel: &Channel,
    ) {
        let wants_reply = channel
            .subscribers
            .get(index)
            .is_some_and(|sub| sub.reply.is_some());
        let Some(call) = self.calls.get_mut(index) else {
            return;
        };
        call.state = match (leg, reply) {
            (Leg::Event, Some(reply)) if wants_reply => {
                call.leg = Leg::Reply;
                call.leg_attempts = 0;
                match reply {
                    Ok(reply) => {
                        call.reply = Some(reply);
                        self.to_send = self.to_send.saturating_add(1);
                        CallState::Ready
                    }
                    // The reply leg fails before any call: too large to pass on.
                    Err(failure) => {
                        return self.fail(index, failure, CallEnd::ok(), now_ms, channel)
                    }
                }
            }
            (Leg::Event | Leg::Reply, _) => CallState::Delivered,
            (Leg::DeadLetter, _) => CallState::DeadLettered,
        };
        if call.ended() {
            self.open = self.open.saturating_sub(1);
        }
    }

    /// The current leg of subscriber `index` failed with `failure` (`end` says the rest of
    /// how the call ended): retry it, send the event to the dead-letter target, or fail.
    fn fail(
        &mut self,
        index: usize,
        failure: Failure,
        end: CallEnd,
        now_ms: u64,
        channel: &Channel,
    ) {
        let Some(sub) = channel.subscribers.get(index) else {
            return;
        };
        let Some(call) = self.calls.get_mut(index) else {
            return;
        };
        let retryable = is_retryable(&failure);
        *call.failure_slot(call.leg) = Some(LegFailure {
            failure,
            body: end.body,
        });
        if retryable && call.leg_attempts <= sub.retry.retry {
            // The computed backoff spread by the jitter, capped, and never below what
            // `retry-after` asked for.
            let delay = sub.backoff_jitter.apply(
                sub.retry.delay_before(call.leg_attempts, None),
                end.retry_after_ms.unwrap_or(0),
                sub.retry.max_ms,
                &mut self.jitter_rng,
            );
            call.state = CallState::Waiting {
                until_ms: now_ms.saturating_add(delay),
            };
            self.to_send = self.to_send.saturating_add(1);
            return;
        }
        // The event, or its reply, failed for good.
        if call.leg != Leg::DeadLetter && sub.dead_letter.is_some() {
            call.leg = Leg::DeadLetter;
            call.leg_attempts = 0;
            call.state = CallState::Ready;
            self.to_send = self.to_send.saturating_add(1);
            return;
        }
        call.state = CallState::Failed {
            elapsed_ms: now_ms.saturating_sub(self.started_ms),
        };
        self.open = self.open.saturating_sub(1);
    }

    /// Ends every delivery still open as failed with no answer: for a fan-out whose answers
    /// can no longer come (it outlived every timeout it could have).
    pub fn give_up(&mut self, now_ms: u64) {
        let elapsed_ms = now_ms.saturating_sub(self.started_ms);
        for call in self.calls.iter_mut().filter(|call| !call.ended()) {
            if matches!(call.state, CallState::Ready | CallState::Waiting { .. }) {
                self.to_send = self.to_send.saturating_sub(1);
            }
            *call.failure_slot(call.leg) = Some(LegFailure {
                failure: Failure::NoResponse,
                body: Vec::new(),
            });
            call.state = CallState::Failed { elapsed_ms };
            self.open = self.open.saturating_sub(1);
        }
    }

    /// Every required subscriber of `channel` has ended: the sender's answer is due.
    pub fn required_done(&self, channel: &Channel) -> bool {
        // The tests and fuzz targets (debug builds) check that the flag tells the truth.
        debug_assert!(!self.only_required || channel.subscribers.iter().all(|s| s.required));
        if self.only_required {
            return self.open == 0;
        }
        self.calls
            .iter()
            .zip(&channel.subscribers)
            .all(|(call, sub)| !sub.required || call.ended())
    }

    /// Best-effort subscribers of `channel` whose delivery is still going on.
    pub fn best_effort_pending(&self, channel: &Channel) -> usize {
        self.calls
            .iter()
            .zip(&channel.subscribers)
            .filter(|(call, sub)| !sub.required && !call.ended())
            .count()
    }

    /// Best-effort subscribers of `channel` that failed for good.
    pub fn best_effort_failed(&self, channel: &Channel) -> usize {
        self.calls
            .iter()
            .zip(&channel.subscribers)
            .filter(|(call, sub)| !sub.required && matches!(call.state, CallState::Failed { .. }))
            .count()
    }

    pub fn is_done(&self) -> bool {
        self.open == 0
    }

    /// Subscribers whose delivery has not ended.
    pub fn open(&self) -> usize {
        self.open
    }

    /// Attempts so far to deliver the event itself to subscriber `index`.
    pub fn event_attempts(&self, index: usize) -> u32 {
        self.calls.get(index).map_or(0, |call| call.event_attempts)
    }

    /// Whether subscriber `index` is waiting to retry its current leg.
    pub fn is_retrying(&self, index: usize) -> bool {
        self.calls
            .get(index)
            .is_some_and(|call| matches!(call.state, CallState::Waiting { .. }))
    }

    /// Whether subscriber `index` has failed for good.
    pub fn is_failed(&self, index: usize) -> bool {
        self.calls
            .get(index)
            .is_some_and(|call| matches!(call.state, CallState::Failed { .. }))
    }

    /// Retries waiting for their time: how many.
    pub fn waiting(&self) -> usize {
        if self.to_send == 0 {
            return 0;
        }
        self.count(|state| matches!(state, CallState::Waiting { .. }))
    }

    /// The subscribers that failed for good, with their last failure.
    pub fn failures(&self) -> impl Iterator<Item = (usize, &Failure)> {
        self.calls
            .iter()
            .enumerate()
            .filter_map(|(i, call)| match &call.state {
                CallState::Failed { .. } => call
                    .failure(call.leg)
                    .or(call.failure(Leg::Event))
                    .map(|f| (i, f)),
                _ => None,
            })
    }

    /// The answer a reply leg passes on.
    pub fn reply_event(&self, index: usize) -> Option<&ReplyEvent> {
        self.calls.get(index).and_then(|call| call.reply.as_ref())
    }

    /// What subscriber `index`'s dead letter carries: its failure (of the event, or of the
    /// reply when the subscriber took the event and its reply failed for good) as headers,
    /// and in structured mode the event's body with Knative's error attributes in it.
    /// `forwarded` and `event` are the request's forwarded headers and body.
    pub fn dead_letter(
        &self,
        index: usize,
        channel: &Channel,
        forwarded: &Forwarded,
        event: &[u8],
    ) -> DeadLetter {
        let (Some(call), Some(sub)) = (self.calls.get(index), channel.subscribers.get(index))
        else {
            return DeadLetter::default();
        };
        let (leg, cause) = call.dead_letter_cause();
        let (authority, path, timeout) = match (leg, &sub.reply) {
            (Leg::Reply, Some(target)) => (&target.authority, &target.path, target.timeout),
            _ => (&sub.authority, &sub.path, sub.timeout),
        };
        let failure = cause.map_or(&Failure::NoResponse, |c| &c.failure);
        crate::dead_letter::dead_letter(
            &Cause {
                cluster: &sub.cluster,
                leg,
                failure,
                answer: cause.map_or(&[][..], |c| c.body.as_slice()),
                detail: &FailureReport::new(failure, timeout).detail,
                authority,
                path,
                attempts: call.event_attempts,
            },
            forwarded,
            event,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::answer::{Answer, ALREADY_DELIVERED_HEADER, DEAD_LETTERED_HEADER, FAILED_HEADER};
    use crate::config::Config;
    use crate::dead_letter::{
        DEAD_LETTER_ATTEMPTS, DEAD_LETTER_BODY, DEAD_LETTER_CLUSTER, DEAD_LETTER_LEG,
        DEAD_LETTER_OUTCOME, DEAD_LETTER_STATUS,
    };
    use base64::Engine;
    use std::rc::Rc;

    fn dispatch_error(detail: &str) -> Failure {
        Failure::DispatchError {
            detail: detail.into(),
        }
    }

    fn channel_from(json: &str) -> Rc<Channel> {
        let mut config = Config::from_json(json.as_bytes()).unwrap();
        config.channels.remove(0)
    }

    fn channel(n: usize) -> Rc<Channel> {
        let subs: Vec<String> = (0..n)
            .map(|i| format!(r#"{{"cluster": "c{i}", "path": "/p{i}", "timeout_ms": 250}}"#))
            .collect();
        channel_from(&format!(r#"{{"subscribers": [{}]}}"#, subs.join(",")))
    }

    fn report(answer: &Answer) -> serde_json::Value {
        serde_json::from_slice(&answer.body).unwrap()
    }

    fn status(s: u16) -> CallEnd {
        CallEnd::failed(Failure::Status {
            status: s,
            detail: format!("answered {s}"),
        })
    }

    /// Sends everything ready, giving tokens from `next`; returns the sends.
    fn send_all(f: &mut FanOut, now: u64, next: &mut u32) -> Vec<(ReadyCall, u32)> {
        let sends = f.take_ready(now);
        sends
            .into_iter()
            .map(|send| {
                *next += 1;
                f.dispatched(send.index, *next);
                (send, *next)
            })
            .collect()
    }

    #[test]
    fn every_subscriber_is_sent_the_event_once() {
        let mut f = FanOut::new(3, 0);
        let sends = f.take_ready(0);
        assert_eq!(
            sends,
            (0..3)
                .map(|index| ReadyCall {
                    index,
                    leg: Leg::Event
                })
                .collect::<Vec<_>>()
        );
        assert!(f.take_ready(0).is_empty(), "sent twice");
    }

    #[test]
    fn all_delivered_is_202() {
        let ch = channel(3);
        let mut f = FanOut::new(3, 1000);
        let mut next = 9;
        send_all(&mut f, 1000, &mut next);
        assert!(!f.is_done());
        assert_eq!(f.completed(11, CallEnd::ok(), 1001, &ch), Some(1));
        assert_eq!(f.completed(10, CallEnd::ok(), 1002, &ch), Some(0));
        assert_eq!(f.open(), 1);
        assert_eq!(f.completed(12, CallEnd::ok(), 1003, &ch), Some(2));
        assert!(f.is_done());
        assert_eq!(f.verdict(&ch), Answer::accepted());
    }

    #[test]
    fn no_subscribers_is_done_at_once_and_202() {
        let f = FanOut::new(0, 0);
        assert!(f.is_done());
        assert_eq!(f.verdict(&channel(0)).status, 202);
    }

    #[test]
    fn one_failure_makes_a_500_report_naming_it() {
        let ch = channel(3);
        let mut f = FanOut::new(3, 1000);
        let mut next = 0;
        send_all(&mut f, 1000, &mut next);
        f.completed(2, CallEnd::ok(), 1005, &ch);
        f.completed(3, status(500), 1042, &ch);
        f.completed(1, CallEnd::ok(), 1043, &ch);
        assert!(f.is_done());
        let answer = f.verdict(&ch);
        assert_eq!(answer.status, 500);
        assert!(answer.headers.contains(&(FAILED_HEADER, "1".to_string())));
        assert!(answer
            .headers
            .contains(&("content-type", "application/json".to_string())));
        let doc = report(&answer);
        assert_eq!(doc["channel"], "default");
        assert_eq!(doc["subscribers"], 3);
        assert_eq!(doc["delivered"], 2);
        let failed = doc["failed"].as_array().unwrap();
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0]["cluster"], "c2");
        assert_eq!(failed[0]["path"], "/p2");
        assert_eq!(failed[0]["leg"], "event");
        assert_eq!(failed[0]["outcome"], "status");
        assert_eq!(failed[0]["status"], 500);
        assert_eq!(failed[0]["detail"], "answered 500");
        assert_eq!(failed[0]["attempts"], 1);
        assert_eq!(failed[0]["elapsed_ms"], 42);
        assert_eq!(doc["skipped"], serde_json::json!([]));
        assert_eq!(doc["dead_lettered"], serde_json::json!([]));
    }

    #[test]
    fn a_full_report_lists_the_subscribers_that_took_the_event() {
        let ch = channel(2);
        let mut f = FanOut::new(2, 0).with_full_report(true);
        let mut next = 0;
        send_all(&mut f, 0, &mut next);
        f.completed(1, CallEnd::ok(), 1, &ch);
        f.completed(2, status(500), 1, &ch);
        let doc = report(&f.verdict(&ch));
        assert_eq!(
            doc["succeeded"],
            serde_json::json!([{"cluster": "c0", "authority": "c0", "path": "/p0",
                                "dead_lettered": false, "attempts": 1}])
        );
        // Not listed by default.
        let mut f = FanOut::new(2, 0);
        send_all(&mut f, 0, &mut next);
        f.completed(3, CallEnd::ok(), 1, &ch);
        f.completed(4, status(500), 1, &ch);
        assert!(report(&f.verdict(&ch)).get("succeeded").is_none());
    }

    #[test]
    fn giving_up_fails_what_is_still_open() {
        let ch = channel(3);
        let mut f = FanOut::new(3, 0);
        let mut next = 0;
        send_all(&mut f, 0, &mut next);
        f.completed(1, CallEnd::ok(), 1, &ch);
        f.give_up(500);
        assert!(f.is_done());
        let doc = report(&f.verdict(&ch));
        assert_eq!(doc["delivered"], 1);
        assert_eq!(doc["failed"][0]["outcome"], "no_response");
        assert_eq!(doc["failed"][1]["elapsed_ms"], 500);
        // a late answer changes nothing
        assert_eq!(f.completed(2, CallEnd::ok(), 600, &ch), None);
    }

    #[test]
    fn a_refused_call_fails_at_once() {
        let ch = channel(2);
        let mut f = FanOut::new(2, 0);
        let sends = f.take_ready(0);
        assert_eq!(sends.len(), 2);
        f.dispatched(0, 1);
        f.dispatch_failed(1, dispatch_error("unknown cluster"), 3, &ch);
        assert_eq!(f.open(), 1);
        f.completed(1, CallEnd::ok(), 4, &ch);
        let doc = report(&f.verdict(&ch));
        assert_eq!(doc["failed"][0]["cluster"], "c1");
        assert_eq!(doc["failed"][0]["outcome"], "dispatch_error");
        assert_eq!(doc["failed"][0]["detail"], "unknown cluster");
        assert_eq!(doc["failed"][0]["attempts"], 1);
        assert!(doc["failed"][0].get("status").is_none());
    }

    #[test]
    fn timeout_report_says_the_timeout() {
        let ch = channel(1);
        let mut f = FanOut::new(1, 0);
        let mut next = 0;
        send_all(&mut f, 0, &mut next);
        f.completed(1, CallEnd::failed(Failure::Timeout), 251, &ch);
        let doc = report(&f.verdict(&ch));
        assert_eq!(doc["failed"][0]["outcome"], "timeout");
        assert_eq!(
            doc["failed"][0]["detail"],
            "no answer within the timeout of 250 ms"
        );
    }

    #[test]
    fn late_unknown_and_duplicate_tokens_are_ignored() {
        let ch = channel(2);
        let mut f = FanOut::new(2, 0);
        let mut next = 0;
        send_all(&mut f, 0, &mut next);
        assert_eq!(
            f.completed(99, CallEnd::ok(), 0, &ch),
            None,
            "unknown token"
        );
        assert_eq!(
            f.completed(1, CallEnd::failed(Failure::NoResponse), 0, &ch),
            Some(0)
        );
        assert_eq!(
            f.completed(1, CallEnd::ok(), 0, &ch),
            None,
            "duplicate token"
        );
        assert_eq!(f.open(), 1);
        assert_eq!(f.completed(2, CallEnd::ok(), 0, &ch), Some(1));
        assert_eq!(f.completed(2, status(500), 0, &ch), None, "late token");
        assert_eq!(f.failures().count(), 1);
        assert_eq!(f.verdict(&ch).status, 500);
    }

    #[test]
    fn dedupe_marks_are_named_in_every_answer_and_kept_apart_from_filter_skips() {
        let ch = channel(3);
        // All already delivered: 202 at once, saying so.
        let mut f = FanOut::new(3, 0);
        (0..3).for_each(|i| f.already_delivered(i));
        assert!(f.is_done());
        assert!(f.take_ready(0).is_empty());
        let answer = f.verdict(&ch);
        assert_eq!(answer.status, 202);
        assert!(answer
            .headers
            .contains(&(ALREADY_DELIVERED_HEADER, "3".to_string())));
        let doc = report(&answer);
        assert_eq!(
            doc["already_delivered"],
            serde_json::json!(["c0", "c1", "c2"])
        );
        assert_eq!(doc["delivered"], 0);
        assert_eq!(doc["skipped"], serde_json::json!([]));
        assert!(doc.get("in_progress").is_none());

        // One already delivered, one delivered, one failed: 500 naming both.
        let mut f = FanOut::new(3, 0);
        f.already_delivered(0);
        let mut next = 0;
        assert_eq!(send_all(&mut f, 0, &mut next).len(), 2);
        f.completed(1, CallEnd::ok(), 0, &ch);
        f.completed(2, CallEnd::failed(Failure::NoResponse), 0, &ch);
        assert!(f.is_delivered(1) && !f.is_delivered(0) && !f.is_delivered(2));
        let answer = f.verdict(&ch);
        assert_eq!(answer.status, 500);
        let doc = report(&answer);
        assert_eq!(doc["already_delivered"], serde_json::json!(["c0"]));
        assert_eq!(doc["failed"][0]["cluster"], "c2");

        // In progress elsewhere, skipped by a filter, nothing failed: 409, retry.
        let mut f = FanOut::new(3, 0);
        f.in_progress_elsewhere(0);
        f.skip(1);
        // A subscriber's state is set once: a later mark changes nothing.
        f.already_delivered(1);
        let mut next = 0;
        send_all(&mut f, 0, &mut next);
        f.completed(1, CallEnd::ok(), 0, &ch);
        assert!(f.is_done());
        let answer = f.verdict(&ch);
        assert_eq!(answer.status, 409);
        assert!(answer.headers.contains(&("retry-after", "1".to_string())));
        let doc = report(&answer);
        assert_eq!(doc["in_progress"], serde_json::json!(["c0"]));
        assert_eq!(doc["skipped"], serde_json::json!(["c1"]));
        assert!(doc.get("already_delivered").is_none());
        assert_eq!(doc["failed"], serde_json::json!([]));
    }

    #[test]
    fn a_call_is_dispatched_or_refused_once() {
        let ch = channel(1);
        let mut f = FanOut::new(1, 0);
        f.take_ready(0);
        f.dispatched(0, 1);
        f.dispatch_failed(0, dispatch_error("late"), 0, &ch);
        f.dispatched(0, 2);
        assert_eq!(f.completed(2, CallEnd::ok(), 0, &ch), None);
        assert_eq!(f.completed(1, CallEnd::ok(), 0, &ch), Some(0));
        assert!(f.is_done());
        // out-of-range indexes change nothing
        f.dispatched(5, 3);
        f.dispatch_failed(5, dispatch_error("x"), 0, &ch);
        assert!(f.is_done());
    }

    #[test]
    fn skipped_subscribers_are_done_and_not_failures() {
        let ch = channel(3);
        let mut f = FanOut::new(3, 0);
        f.skip(0);
        f.skip(2);
        assert_eq!(
            f.take_ready(0),
            vec![ReadyCall {
                index: 1,
                leg: Leg::Event
            }]
        );
        f.dispatched(1, 1);
        assert_eq!(f.open(), 1);
        assert_eq!(f.skipped(), 2);
        assert!(f.completed(1, CallEnd::ok(), 0, &ch).is_some());
        assert!(f.is_done());
        assert_eq!(f.verdict(&ch), Answer::accepted());
    }

    #[test]
    fn skipped_subscribers_are_never_sent_and_the_report_lists_them_apart_from_failed() {
        let ch = channel(4);
        let mut f = FanOut::new(4, 0);
        f.skip(0);
        f.skip(3);
        let mut next = 0;
        let sent = send_all(&mut f, 0, &mut next);
        let indexes: Vec<usize> = sent.iter().map(|(send, _)| send.index).collect();
        assert_eq!(indexes, [1, 2]);
        // A call under way cannot be skipped any more.
        f.skip(1);
        assert_eq!(f.skipped(), 2);
        f.completed(sent[0].1, CallEnd::ok(), 0, &ch);
        f.completed(sent[1].1, status(503), 0, &ch);
        assert!(f.is_done());
        let answer = f.verdict(&ch);
        assert_eq!(answer.status, 500);
        assert!(answer.headers.contains(&(FAILED_HEADER, "1".to_string())));
        let doc = report(&answer);
        assert_eq!(doc["subscribers"], 4);
        assert_eq!(doc["delivered"], 1);
        assert_eq!(doc["failed"].as_array().unwrap().len(), 1);
        assert_eq!(doc["failed"][0]["cluster"], "c2");
        assert_eq!(doc["skipped"], serde_json::json!(["c0", "c3"]));
    }

    #[test]
    fn all_skipped_is_done_at_once_and_202() {
        let ch = channel(2);
        let mut f = FanOut::new(2, 0);
        f.skip(0);
        f.skip(1);
        assert!(f.is_done());
        assert_eq!(f.verdict(&ch), Answer::accepted());
    }

    const RETRYING: &str = r#"{"delivery": {"retry": 2, "backoff_policy": "linear",
        "backoff_delay_ms": 100, "backoff_max_ms": 1000},
        "subscribers": [{"cluster": "a"}]}"#;

    #[test]
    fn a_retryable_failure_waits_its_backoff_then_is_sent_again() {
        let ch = channel_from(RETRYING);
        let mut f = FanOut::new(1, 0);
        let mut next = 0;
        send_all(&mut f, 0, &mut next);
        f.completed(1, status(503), 10, &ch);
        assert!(!f.is_done());
        assert_eq!(f.next_wakeup(), Some(110), "linear: 100 ms before retry 1");
        assert!(f.take_ready(109).is_empty());
        assert_eq!(send_all(&mut f, 110, &mut next).len(), 1);
        f.completed(2, CallEnd::failed(Failure::Timeout), 300, &ch);
        assert_eq!(f.next_wakeup(), Some(500), "linear: 200 ms before retry 2");
        send_all(&mut f, 500, &mut next);
        f.completed(3, CallEnd::ok(), 510, &ch);
        assert!(f.is_done());
        assert_eq!(f.event_attempts(0), 3);
        assert_eq!(f.verdict(&ch), Answer::accepted());
    }

    #[test]
    fn retries_run_out_and_the_report_counts_the_attempts() {
        let ch = channel_from(RETRYING);
        let mut f = FanOut::new(1, 0);
        let mut next = 0;
        for now in [0, 1000, 2000] {
            send_all(&mut f, now, &mut next);
            f.completed(next, status(500), now + 1, &ch);
        }
        assert!(f.is_done());
        let doc = report(&f.verdict(&ch));
        assert_eq!(doc["failed"][0]["attempts"], 3);
        assert_eq!(doc["failed"][0]["status"], 500);
        assert_eq!(doc["failed"][0]["elapsed_ms"], 2001);
    }

    #[test]
    fn a_400_is_never_retried() {
        let ch = channel_from(RETRYING);
        let mut f = FanOut::new(1, 0);
        let mut next = 0;
        send_all(&mut f, 0, &mut next);
        f.completed(1, status(400), 5, &ch);
        assert!(f.is_done());
        assert_eq!(f.event_attempts(0), 1);
        assert_eq!(f.verdict(&ch).status, 500);
    }

    #[test]
    fn retry_after_lengthens_the_wait_capped_by_the_maximum_and_never_shortens_it() {
        let ch = channel_from(RETRYING);
        let mut f = FanOut::new(1, 0);
        let mut next = 0;
        send_all(&mut f, 0, &mut next);
        let mut end = status(429);
        end.retry_after_ms = Some(30_000);
        f.completed(1, end, 0, &ch);
        assert_eq!(f.next_wakeup(), Some(1000), "30 s capped at backoff_max_ms");
        send_all(&mut f, 1000, &mut next);
        let mut end = status(503);
        end.retry_after_ms = Some(0);
        f.completed(2, end, 1000, &ch);
        assert_eq!(
            f.next_wakeup(),
            Some(1200),
            "linear: 200 ms before retry 2, not shortened by retry-after: 0"
        );
    }

    #[test]
    fn a_refused_call_is_retried_too() {
        let ch = channel_from(RETRYING);
        let mut f = FanOut::new(1, 0);
        f.take_ready(0);
        f.dispatch_failed(0, dispatch_error("no such cluster"), 0, &ch);
        assert!(!f.is_done());
        assert_eq!(f.next_wakeup(), Some(100));
    }

    /// Subscriber 0's dead-letter target took the event: it counts as delivered, 202.
    fn assert_dead_lettered_and_202(f: &FanOut, ch: &Channel) {
        assert!(f.is_done() && f.is_delivered(0));
        let answer = f.verdict(ch);
        assert_eq!(answer.status, 202);
        assert!(answer
            .headers
            .contains(&(DEAD_LETTERED_HEADER, "1".to_string())));
    }

    const DEAD_LETTER: &str = r#"{"delivery": {"retry": 1, "backoff_delay_ms": 10,
        "dead_letter": {"cluster": "dlq", "path": "/dead"}},
        "subscribers": [{"cluster": "a"}, {"cluster": "b"}]}"#;

    #[test]
    fn failed_for_good_goes_to_the_dead_letter_and_counts_as_delivered() {
        let ch = channel_from(DEAD_LETTER);
        let mut f = FanOut::new(2, 0);
        let mut next = 0;
        send_all(&mut f, 0, &mut next); // a: 1, b: 2
        f.completed(2, CallEnd::ok(), 1, &ch);
        f.completed(1, status(503), 1, &ch);
        send_all(&mut f, 100, &mut next); // a retry: 3
        let mut end = status(502);
        if let Err(Failure::Status { detail, .. }) = &mut end.result {
            *detail = "bad  gateway".to_string();
        }
        end.body = b"bad\r\ngateway".to_vec();
        f.completed(3, end, 101, &ch);
        // Now the dead letter is ready at once.
        assert!(f.has_ready());
        let sends = send_all(&mut f, 101, &mut next); // dlq: 4
        assert_eq!(
            sends[0].0,
            ReadyCall {
                index: 0,
                leg: Leg::DeadLetter
            }
        );
        let letter = f.dead_letter(0, &ch, &Forwarded::default(), b"event");
        assert_eq!(letter.body, None);
        let header = |name: &str| letter.header(name);
        assert_eq!(header(DEAD_LETTER_CLUSTER), Some("a"));
        assert_eq!(header(DEAD_LETTER_LEG), Some("event"));
        assert_eq!(header(DEAD_LETTER_OUTCOME), Some("status"));
        assert_eq!(header(DEAD_LETTER_STATUS), Some("502"));
        assert_eq!(header(DEAD_LETTER_BODY), Some("bad  gateway"));
        assert_eq!(header(DEAD_LETTER_ATTEMPTS), Some("2"));
        assert_eq!(header("ce-knativeerrordest"), Some("http://a/"));
        assert_eq!(header("ce-knativeerrorcode"), Some("502"));
        // The raw answer of the last attempt, not the sanitized detail.
        assert_eq!(
            header("ce-knativeerrordata"),
            Some(
                base64::engine::general_purpose::STANDARD
                    .encode("bad\r\ngateway")
                    .as_str()
            )
        );
        f.completed(4, CallEnd::ok(), 102, &ch);
        assert_dead_lettered_and_202(&f, &ch);
    }

    #[test]
    fn a_failing_dead_letter_is_a_failure_reporting_both() {
        let ch = channel_from(DEAD_LETTER);
        let mut f = FanOut::new(2, 0);
        let mut next = 0;
        send_all(&mut f, 0, &mut next);
        f.completed(2, CallEnd::ok(), 1, &ch);
        f.completed(1, status(400), 1, &ch); // not retryable: straight to the dead letter
        send_all(&mut f, 1, &mut next); // dlq: 3
        f.completed(3, status(500), 2, &ch);
        send_all(&mut f, 100, &mut next); // dlq retry: 4
        f.completed(4, CallEnd::failed(Failure::NoResponse), 101, &ch);
        assert!(f.is_done());
        let doc = report(&f.verdict(&ch));
        let failed = &doc["failed"][0];
        assert_eq!(failed["cluster"], "a");
        assert_eq!(failed["leg"], "dead_letter");
        assert_eq!(failed["outcome"], "no_response");
        assert_eq!(failed["attempts"], 1);
        assert_eq!(failed["event"]["outcome"], "status");
        assert_eq!(failed["event"]["status"], 400);
    }

    const REPLY: &str = r#"{"subscribers": [{"cluster": "a", "reply": {"cluster": "r"}}]}"#;

    #[test]
    fn a_2xx_with_a_body_is_passed_to_the_reply_target() {
        let ch = channel_from(REPLY);
        let mut f = FanOut::new(1, 0);
        let mut next = 0;
        send_all(&mut f, 0, &mut next);
        let reply = ReplyEvent {
            headers: [("ce-type", "reply")].into_iter().collect(),
            body: b"answer".to_vec(),
        };
        f.completed(1, CallEnd::replied(reply.clone()), 1, &ch);
        assert!(!f.is_done());
        let sends = send_all(&mut f, 1, &mut next);
        assert_eq!(
            sends[0].0,
            ReadyCall {
                index: 0,
                leg: Leg::Reply
            }
        );
        assert_eq!(f.reply_event(0), Some(&reply));
        f.completed(2, CallEnd::ok(), 2, &ch);
        assert!(f.is_done());
        assert_eq!(f.verdict(&ch), Answer::accepted());
    }

    #[test]
    fn a_2xx_without_a_reply_is_done_and_a_failed_reply_is_a_failed_delivery() {
        let ch = channel_from(REPLY);
        let mut f = FanOut::new(1, 0);
        let mut next = 0;
        send_all(&mut f, 0, &mut next);
        f.completed(1, CallEnd::ok(), 1, &ch);
        assert!(f.is_done(), "no reply event means done");

        let mut f = FanOut::new(1, 0);
        send_all(&mut f, 0, &mut next);
        let reply = ReplyEvent {
            headers: [("ce-type", "t")].into_iter().collect(),
            body: b"x".to_vec(),
        };
        f.completed(next, CallEnd::replied(reply), 1, &ch);
        send_all(&mut f, 1, &mut next);
        f.completed(next, status(503), 2, &ch);
        assert!(f.is_done());
        let doc = report(&f.verdict(&ch));
        assert_eq!(doc["failed"][0]["leg"], "reply");
        assert_eq!(doc["failed"][0]["status"], 503);
    }

    #[test]
    fn a_reply_event_without_data_is_passed_on_too() {
        let ch = channel_from(REPLY);
        let mut f = FanOut::new(1, 0);
        let mut next = 0;
        send_all(&mut f, 0, &mut next);
        let reply = ReplyEvent {
            headers: [("ce-type", "t")].into_iter().collect(),
            body: Vec::new(),
        };
        f.completed(1, CallEnd::replied(reply), 1, &ch);
        assert_eq!(f.take_ready(1)[0].leg, Leg::Reply);
    }

    /// A 2xx whose reply of 2000 bytes is over a limit of 1000.
    fn too_large_reply() -> CallEnd {
        CallEnd {
            reply: Some(Err(Failure::TooLarge {
                size: 2000,
                limit: 1000,
            })),
            ..CallEnd::ok()
        }
    }

    #[test]
    fn a_reply_too_large_is_a_failed_reply_never_sent() {
        let ch = channel_from(REPLY);
        let mut f = FanOut::new(1, 0);
        let mut next = 0;
        send_all(&mut f, 0, &mut next);
        f.completed(1, too_large_reply(), 7, &ch);
        assert!(f.is_done(), "too large is not retried");
        assert!(
            f.take_ready(7).is_empty(),
            "nothing goes to the reply target"
        );
        let answer = f.verdict(&ch);
        assert_eq!(answer.status, 500);
        let failed = &report(&answer)["failed"][0];
        assert_eq!(failed["leg"], "reply");
        assert_eq!(failed["outcome"], "too_large");
        assert_eq!(
            failed["detail"],
            "the reply of 2000 bytes is larger than max_body_bytes (1000): not passed on"
        );
        assert_eq!(failed["attempts"], 1);
        assert_eq!(failed["elapsed_ms"], 7);
        assert!(failed.get("status").is_none());
    }

    const REPLY_AND_DEAD_LETTER: &str = r#"{"delivery": {"retry": 1, "backoff_delay_ms": 10,
        "dead_letter": {"cluster": "dlq"}},
        "subscribers": [{"cluster": "a", "authority": "a.local", "path": "/in",
                         "reply": {"cluster": "r", "authority": "r.local", "path": "/replies"}}]}"#;

    #[test]
    fn a_reply_that_failed_for_good_sends_the_original_event_to_the_dead_letter() {
        let ch = channel_from(REPLY_AND_DEAD_LETTER);
        let mut f = FanOut::new(1, 0);
        let mut next = 0;
        send_all(&mut f, 0, &mut next); // a: 1
        let reply = ReplyEvent {
            headers: [("ce-type", "t")].into_iter().collect(),
            body: b"answer".to_vec(),
        };
        f.completed(1, CallEnd::replied(reply), 1, &ch);
        send_all(&mut f, 1, &mut next); // r: 2
        let mut end = status(503);
        end.body = b"replies down".to_vec();
        f.completed(2, end.clone(), 2, &ch);
        assert!(f.is_retrying(0), "the reply is retried like the event");
        send_all(&mut f, 100, &mut next); // r retry: 3
        f.completed(3, end, 101, &ch);
        assert!(!f.is_retrying(0) && !f.is_failed(0));
        let sends = send_all(&mut f, 101, &mut next); // dlq: 4
        assert_eq!(sends[0].0.leg, Leg::DeadLetter);
        let letter = f.dead_letter(0, &ch, &Forwarded::default(), b"event");
        let header = |name: &str| letter.header(name);
        assert_eq!(header(DEAD_LETTER_CLUSTER), Some("a"));
        assert_eq!(header(DEAD_LETTER_LEG), Some("reply"));
        assert_eq!(header(DEAD_LETTER_STATUS), Some("503"));
        assert_eq!(header(DEAD_LETTER_ATTEMPTS), Some("1"));
        assert_eq!(
            header("ce-knativeerrordest"),
            Some("http://r.local/replies"),
            "the reply target failed, not the subscriber"
        );
        assert_eq!(header("ce-knativeerrorcode"), Some("503"));
        f.completed(4, CallEnd::ok(), 102, &ch);
        assert_dead_lettered_and_202(&f, &ch);
    }

    #[test]
    fn a_reply_too_large_goes_to_the_dead_letter_and_a_failing_one_reports_both() {
        let ch = channel_from(REPLY_AND_DEAD_LETTER);
        let mut f = FanOut::new(1, 0);
        let mut next = 0;
        send_all(&mut f, 0, &mut next);
        f.completed(1, too_large_reply(), 1, &ch);
        let sends = send_all(&mut f, 1, &mut next); // dlq: 2
        assert_eq!(sends[0].0.leg, Leg::DeadLetter);
        let letter = f.dead_letter(0, &ch, &Forwarded::default(), b"event");
        assert!(letter
            .headers
            .contains(&("ce-knativeerrorcode".to_string(), "413".to_string())));
        assert!(letter
            .headers
            .contains(&(DEAD_LETTER_OUTCOME.to_string(), "too_large".to_string())));
        f.completed(2, status(500), 2, &ch);
        send_all(&mut f, 100, &mut next); // dlq retry: 3
        f.completed(3, status(500), 101, &ch);
        assert!(f.is_done());
        let failed = &report(&f.verdict(&ch))["failed"][0];
        assert_eq!(failed["leg"], "dead_letter");
        assert_eq!(failed["status"], 500);
        assert_eq!(failed["reply"]["outcome"], "too_large");
        assert!(failed.get("event").is_none());
    }
}
