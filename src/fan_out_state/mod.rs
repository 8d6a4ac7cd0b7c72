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

    #[cfg(test)]
    pub fn failed(failure: Failure) -> CallEnd {
        CallEnd {
            result: Err(failure),
            ..CallEnd::ok()
        }
    }

    /// A 2xx whose reply event goes to the subscriber's reply target.
    #[cfg(test)]
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

/// Where one subscriber's delivery is ([`FanOut::progress`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress<'a> {
    /// The leg under way, or the last one.
    pub leg: Leg,
    pub ended: bool,
    /// It took the event (and its reply, if any, was passed on).
    pub delivered: bool,
    /// Its dead-letter target took the event.
    pub dead_lettered: bool,
    pub event_attempts: u32,
    /// The last failure of the leg (or of the event).
    pub failure: Option<&'a Failure>,
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
    #[cfg(any(test, feature = "testing"))]
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

    /// [`FanOut::completed_at`] for a token of any subscriber (the tests' and fuzz targets'
    /// way in).
    #[cfg(any(test, feature = "testing"))]
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

    /// The call with `token`, which the caller knows belongs to subscriber `index`, ended.
    /// Returns the subscriber's index, or `None` (and changes nothing) for a token this
    /// fan-out is not waiting for there, so that late and duplicate callbacks cannot change an
    /// answer.
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
            let delay = sub.retry.wait_before(
                call.leg_attempts,
                end.retry_after_ms,
                sub.backoff_jitter,
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

    /// Where subscriber `index`'s delivery is, for its spans: the leg under way (or the
    /// last), and, once it ended, how.
    pub fn progress(&self, index: usize) -> Option<Progress<'_>> {
        let call = self.calls.get(index)?;
        Some(Progress {
            leg: call.leg,
            ended: call.ended(),
            delivered: call.state == CallState::Delivered,
            dead_lettered: call.state == CallState::DeadLettered,
            event_attempts: call.event_attempts,
            failure: call.failure(call.leg).or(call.failure(Leg::Event)),
        })
    }

    /// Subscribers whose dead-letter target took the event.
    pub fn dead_lettered(&self) -> usize {
        self.count(|state| matches!(state, CallState::DeadLettered))
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
mod tests;
