//! Who gets this event: the one place that decides it, once the request is complete. In this
//! order: each subscriber's filter (a subscriber that does not want the event is skipped,
//! never called, and counted); in async mode the `max_in_flight` cap (a 503, before anything
//! is claimed, so that a refused request leaves no claim behind); then `dedupe` (subscribers
//! that already have the event, or that another request is delivering it to right now, are
//! not called; the others are claimed for this request).
//!
//! What comes out is a [`FanOut`] whose ready calls are exactly the subscribers to call, and
//! the claims to settle when it ends; or the answer the request gets instead.
//!
//! The claims are `dedupe::claim`'s.

use crate::answer::Answer;
use crate::config::{AnswerMode, Channel, Config, ReportDetail};
use crate::dedupe::claim::{self, Claim};
use crate::fan_out_state::FanOut;
use crate::host::Host;
use crate::request::Event;
use crate::telemetry::Counter;

/// The event to deliver, as far as choosing its recipients needs it.
pub struct Incoming<'a> {
    /// Its context id, for log lines.
    pub log_id: u32,
    /// When its headers came, on the host's clock.
    pub started_ms: u64,
    pub channel: &'a Channel,
    pub event: &'a Event,
}

/// Who gets the event.
pub struct Recipients {
    /// One call per subscriber: ready for those who get the event, ended for the others.
    pub fanout: FanOut,
    /// `dedupe`'s claims, settled when the fan-out ends; or the etcd store to ask first.
    pub claim: Claim,
}

/// Decides who gets the event of `request`. `async_in_flight` is asked only in async mode.
pub fn choose<H: Host>(
    host: &H,
    counter: &Counter,
    config: &Config,
    request: &Incoming<'_>,
    async_in_flight: impl FnOnce() -> usize,
    admit_calls: impl FnOnce(&[&str]) -> Result<(), Answer>,
    lease: impl FnOnce(u64) -> Option<i64>,
) -> Result<Recipients, Answer> {
    let channel = request.channel;
    let mut fanout = FanOut::new(channel.subscribers.len(), request.started_ms)
        .with_full_report(config.report == ReportDetail::Full)
        .with_only_required(channel.subscribers.iter().all(|s| s.required));
    let mut wanted = Vec::with_capacity(channel.subscribers.len());
    for (index, subscriber) in channel.subscribers.iter().enumerate() {
        if subscriber.accepts(request.event.attributes.as_ref()) {
            wanted.push(index);
        } else {
            fanout.skip(index);
            counter.count(host, |tally| tally.call_skipped(&subscriber.cluster));
        }
    }
    // Before anything is claimed: a refused request must leave no claim behind.
    if config.mode == AnswerMode::Async || channel.all_best_effort() {
        let in_flight = async_in_flight();
        if in_flight >= config.max_in_flight {
            return Err(Answer::busy(in_flight));
        }
    }
    // `max_concurrent_calls`: a first call that would wait beyond `max_queued_calls` refuses
    // the whole event, before anything is claimed or sent.
    if !config.call_caps.is_empty() {
        let clusters: Vec<&str> = wanted
            .iter()
            .filter_map(|&index| channel.subscribers.get(index))
            .map(|sub| sub.cluster.as_str())
            .collect();
        admit_calls(&clusters)?;
    }
    let claim = claim::claim(
        host,
        counter,
        config,
        &claim::Asking {
            log_id: request.log_id,
            started_ms: request.started_ms,
            channel,
            key: request.event.key.as_deref(),
        },
        &wanted,
        &mut fanout,
        lease,
    );
    Ok(Recipients { fanout, claim })
}
