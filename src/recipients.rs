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
//! Cost with dedupe on and a key: one get and one set of the event's shard (a retry per CAS
//! conflict with another worker); a request whose subscribers all already have the event
//! costs one get. Off, or without a key: no host call.

use crate::answer::Answer;
use crate::config::{AnswerMode, Channel, Config, ReportDetail};
use crate::dedupe::{shard_key, update, Event as StoredEvent, Limits, Seen, CLAIM_MARGIN_MS};
use crate::fan_out_state::FanOut;
use crate::host::{Host, HostStore};
use crate::redelivery::{owner_id, Redelivery};
use crate::request::Event;
use crate::telemetry::Counter;

/// The request, as far as choosing its recipients needs it.
pub struct Request<'a> {
    /// Its context id, for log lines.
    pub log_id: u32,
    /// When its headers came, on the host's clock.
    pub started_ms: u64,
    pub channel_index: usize,
    pub channel: &'a Channel,
    pub event: &'a Event,
}

/// Who gets the event.
pub struct Recipients {
    /// One call per subscriber: ready for those who get the event, ended for the others.
    pub fanout: FanOut,
    /// `dedupe`'s claims, settled when the fan-out ends.
    pub claims: Option<Redelivery>,
}

/// Decides who gets the event of `request`. `async_in_flight` is asked only in async mode.
pub fn choose<H: Host>(
    host: &H,
    counter: &Counter,
    config: &Config,
    request: &Request<'_>,
    async_in_flight: impl FnOnce() -> usize,
    admit_calls: impl FnOnce(&[&str]) -> Result<(), Answer>,
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
    let claims = claim(host, counter, config, request, &wanted, &mut fanout);
    Ok(Recipients { fanout, claims })
}

/// `dedupe`, before the calls: for each subscriber in `wanted` (those its filter did not
/// skip), marks it in `fanout` as already delivered, or as being delivered by another
/// request, or claims it for this request (left ready to call). Returns the claims to settle
/// when the fan-out ends. Changes nothing (everyone wanted is called) when dedupe is off, the
/// request has no key, or the store cannot be updated.
fn claim<H: Host>(
    host: &H,
    counter: &Counter,
    config: &Config,
    request: &Request<'_>,
    wanted: &[usize],
    fanout: &mut FanOut,
) -> Option<Redelivery> {
    let dedupe = config.dedupe.as_ref()?;
    let channel = request.channel;
    let Some(key) = request.event.key.as_deref() else {
        counter.count(host, |tally| tally.dedupe_missing_key());
        return None;
    };
    if wanted.is_empty() {
        return None;
    }
    // The request's start, read when its headers came: no clock read of its own.
    let now = request.started_ms;
    let mut ids = Vec::with_capacity(wanted.len());
    let mut until = Vec::with_capacity(wanted.len());
    for &index in wanted {
        let sub = channel.subscribers.get(index)?;
        ids.push(sub.dedupe_id);
        // Retries, a dead letter and a reply all happen under the claim.
        until.push(
            now.saturating_add(sub.worst_case_ms())
                .saturating_add(CLAIM_MARGIN_MS),
        );
    }
    let owner = owner_id(request.log_id, now);
    let event = StoredEvent {
        channel: &channel.name,
        key,
    };
    let shard = dedupe.shard_of(&channel.name, key);
    let limits = Limits {
        capacity: dedupe.capacity(shard),
        ttl_ms: dedupe.ttl_ms,
    };
    let claimed = update(&HostStore(host), &shard_key(shard), |s| {
        s.claim(&event, &ids, &until, owner, now, limits)
    });
    let done = match claimed {
        Ok(done) => done,
        Err(contended) => {
            log::warn!(
                "[#{}] dedupe: the store stayed contended after {} host calls; \
                 delivering to every subscriber",
                request.log_id,
                contended.store_calls
            );
            counter.count(host, |tally| tally.dedupe_store_error());
            return None;
        }
    };
    if done.replaced_corrupt {
        log::warn!(
            "[#{}] dedupe: replaced an unreadable shard {shard}",
            request.log_id
        );
    }
    let seen = done.value;
    let already = seen
        .iter()
        .filter(|s| **s == Seen::AlreadyDelivered)
        .count();
    let in_progress = seen.iter().filter(|s| **s == Seen::InProgress).count();
    let delta = done.entries_delta;
    counter.count(host, |tally| {
        tally.dedupe_skipped(already, in_progress);
        tally.dedupe_entries(delta);
    });
    let mut subscribers = Vec::new();
    for ((&index, id), s) in wanted.iter().zip(&ids).zip(&seen) {
        match s {
            Seen::Deliver => subscribers.push((index, *id)),
            Seen::AlreadyDelivered => fanout.already_delivered(index),
            Seen::InProgress => fanout.in_progress_elsewhere(index),
        }
    }
    (!subscribers.is_empty()).then(|| {
        Redelivery::new(
            shard,
            channel.name.clone(),
            key.to_vec(),
            owner,
            subscribers,
        )
    })
}
