//! The answer a fan-out ends with: 202, or the report (500, and the 202 or 409 that name
//! what `dedupe` did not call), built from the state of every subscriber's delivery.

use serde::Serialize;

use super::{Call, CallState, FanOut};
use crate::answer::{
    sanitize, Answer, ALREADY_DELIVERED_HEADER, DEAD_LETTERED_HEADER, FAILED_HEADER, PENDING_HEADER,
};
use crate::call::{Failure, Leg, DETAIL_BYTES};
use crate::config::{Channel, Subscriber};

impl FanOut {
    /// The answer for the sender: 202 when every subscriber that wanted the event took it
    /// (directly or through its dead-letter target; also when every one was skipped), else
    /// the 500 report. With `dedupe`, subscribers that already had the event count as having
    /// taken it (202 with a report naming them), and subscribers another request is
    /// delivering to make it a 409 (retry) when nothing failed. Meaningful once
    /// [`FanOut::is_done`].
    pub fn verdict(&self, channel: &Channel) -> Answer {
        let mut report = Report::new(channel, self.calls.len());
        for (call, sub) in self.calls.iter().zip(&channel.subscribers) {
            report.add(call, sub);
        }
        let (failed, already) = (report.failed.len(), report.already_delivered.len());
        let (dead_lettered, pending) =
            (report.dead_lettered.len(), report.best_effort_pending.len());
        // A failure outranks a delivery in progress elsewhere: both mean "retry", but a
        // failure is what a sender's operator needs to see.
        let status = match (failed, already, report.in_progress.is_empty()) {
            (0, 0, true) => None,
            (0, _, true) => Some(202),
            (0, _, false) => Some(409),
            _ => Some(500),
        };
        let mut answer = match status {
            None => Answer::accepted(),
            Some(status) => {
                if self.full_report {
                    report.succeeded = Some(self.succeeded(channel));
                }
                Answer::json(status, &report)
            }
        };
        let counted = |answer: Answer, header: &'static str, count: usize| match count {
            0 => answer,
            _ => answer.with_header(header, count.to_string()),
        };
        answer = counted(answer, FAILED_HEADER, failed);
        answer = counted(answer, ALREADY_DELIVERED_HEADER, already);
        if status == Some(409) {
            answer = answer.with_header("retry-after", "1".to_string());
        }
        answer = counted(answer, DEAD_LETTERED_HEADER, dead_lettered);
        counted(answer, PENDING_HEADER, pending)
    }

    /// With `"report": "full"`: every subscriber that took the event.
    fn succeeded<'a>(&self, channel: &'a Channel) -> Vec<Succeeded<'a>> {
        self.calls
            .iter()
            .zip(&channel.subscribers)
            .filter(|(call, _)| {
                matches!(call.state, CallState::Delivered | CallState::DeadLettered)
            })
            .map(|(call, sub)| Succeeded {
                cluster: &sub.cluster,
                authority: &sub.authority,
                path: &sub.path,
                dead_lettered: call.state == CallState::DeadLettered,
                attempts: call.event_attempts,
            })
            .collect()
    }
}

impl<'a> Report<'a> {
    fn new(channel: &'a Channel, subscribers: usize) -> Self {
        Report {
            channel: &channel.name,
            subscribers,
            delivered: 0,
            failed: Vec::new(),
            dead_lettered: Vec::new(),
            skipped: Vec::new(),
            already_delivered: Vec::new(),
            in_progress: Vec::new(),
            best_effort_failed: Vec::new(),
            best_effort_pending: Vec::new(),
            succeeded: None,
        }
    }

    /// One subscriber's delivery, in its place. A best-effort subscriber's failure is
    /// reported apart and never makes a 500.
    fn add(&mut self, call: &Call, sub: &'a Subscriber) {
        let cluster = sub.cluster.as_str();
        if !sub.required && !call.ended() {
            self.best_effort_pending.push(cluster);
        }
        match &call.state {
            CallState::Delivered => self.delivered += 1,
            CallState::DeadLettered => self.dead_lettered.push(cluster),
            CallState::Skipped => self.skipped.push(cluster),
            CallState::AlreadyDelivered => self.already_delivered.push(cluster),
            CallState::InProgress => self.in_progress.push(cluster),
            CallState::Failed { elapsed_ms } => {
                let failed = FailedSubscriber::new(sub, call, *elapsed_ms);
                if sub.required {
                    self.failed.push(failed);
                } else {
                    self.best_effort_failed.push(failed);
                }
            }
            CallState::Ready
            | CallState::Sending
            | CallState::Pending { .. }
            | CallState::Waiting { .. } => {}
        }
    }
}

/// The body of a 500: which subscribers did not take the event, and why. Also the body of a
/// 202 or 409 when `dedupe` did not call some subscribers. `subscribers` is the sum of
/// `delivered` and the lengths of `failed`, `dead_lettered`, `skipped`, `already_delivered`,
/// `in_progress`, `best_effort_failed` and `best_effort_pending`.
#[derive(Serialize)]
struct Report<'a> {
    channel: &'a str,
    subscribers: usize,
    delivered: usize,
    failed: Vec<FailedSubscriber<'a>>,
    /// Failed, but their dead-letter target took the event: they count as delivered.
    dead_lettered: Vec<&'a str>,
    /// Their filter did not want the event: not called.
    skipped: Vec<&'a str>,
    /// `dedupe`: they already took this event (an earlier request delivered it): not called.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    already_delivered: Vec<&'a str>,
    /// `dedupe`: another request for the same event is delivering it to them right now.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    in_progress: Vec<&'a str>,
    /// Best-effort subscribers that failed for good (apart from `failed`: they never make
    /// the answer a 500).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    best_effort_failed: Vec<FailedSubscriber<'a>>,
    /// Best-effort subscribers still being delivered to when the answer was sent.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    best_effort_pending: Vec<&'a str>,
    /// With `"report": "full"`: every subscriber that took the event.
    #[serde(skip_serializing_if = "Option::is_none")]
    succeeded: Option<Vec<Succeeded<'a>>>,
}

#[derive(Serialize)]
struct Succeeded<'a> {
    cluster: &'a str,
    authority: &'a str,
    path: &'a str,
    /// Taken by its dead-letter target, not by the subscriber.
    dead_lettered: bool,
    attempts: u32,
}

#[derive(Serialize)]
struct FailedSubscriber<'a> {
    cluster: &'a str,
    authority: &'a str,
    path: &'a str,
    /// The call that failed last: `event`, `reply` or `dead_letter`.
    leg: &'static str,
    outcome: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<u16>,
    detail: String,
    /// Attempts to deliver the event itself.
    attempts: u32,
    elapsed_ms: u64,
    /// How the event leg failed, when the dead-letter target then failed too.
    #[serde(skip_serializing_if = "Option::is_none")]
    event: Option<FailureReport>,
    /// How the reply leg failed, when the dead-letter target then failed too.
    #[serde(skip_serializing_if = "Option::is_none")]
    reply: Option<FailureReport>,
}

/// How one failure reads in the report (and in a dead letter).
#[derive(Serialize)]
pub(super) struct FailureReport {
    outcome: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<u16>,
    pub(super) detail: String,
}

impl FailureReport {
    pub(super) fn new(failure: &Failure, timeout: std::time::Duration) -> Self {
        let (status, detail) = match failure {
            Failure::Status { status, detail } => {
                (Some(*status), sanitize(detail.as_bytes(), DETAIL_BYTES))
            }
            Failure::Timeout => (
                None,
                format!("no answer within the timeout of {} ms", timeout.as_millis()),
            ),
            Failure::Reset { detail } => (None, sanitize(detail.as_bytes(), DETAIL_BYTES)),
            Failure::NoResponse => (None, "the call ended without an answer".to_string()),
            Failure::DispatchError { detail } | Failure::Overflow { detail } => {
                (None, detail.clone())
            }
            // Its display is the whole sentence.
            Failure::TooLarge { .. } => (None, failure.to_string()),
        };
        FailureReport {
            outcome: failure.kind(),
            status,
            detail,
        }
    }
}

impl<'a> FailedSubscriber<'a> {
    fn new(sub: &'a Subscriber, call: &Call, elapsed_ms: u64) -> Self {
        let leg_timeout = |leg: Leg| match leg {
            Leg::Event => sub.timeout,
            Leg::Reply => sub.reply.as_ref().map_or(sub.timeout, |t| t.timeout),
            Leg::DeadLetter => sub.dead_letter.as_ref().map_or(sub.timeout, |t| t.timeout),
        };
        let report = call
            .failure(call.leg)
            .map(|f| FailureReport::new(f, leg_timeout(call.leg)));
        // What sent the event to a dead-letter target that then failed too.
        let (event, reply) = match (call.leg, call.dead_letter_cause()) {
            (Leg::DeadLetter, (cause, Some(failure))) => {
                let report = Some(FailureReport::new(&failure.failure, leg_timeout(cause)));
                match cause {
                    Leg::Reply => (None, report),
                    _ => (report, None),
                }
            }
            _ => (None, None),
        };
        let (outcome, status, detail) = match report {
            Some(r) => (r.outcome, r.status, r.detail),
            None => ("no_response", None, String::new()),
        };
        FailedSubscriber {
            cluster: &sub.cluster,
            authority: &sub.authority,
            path: &sub.path,
            leg: call.leg.name(),
            outcome,
            status,
            detail,
            attempts: call.event_attempts,
            elapsed_ms,
            event,
            reply,
        }
    }
}
