//! Dedupe before the calls: for each subscriber a request would call, whether it already
//! took the event (skip it), another request is calling it right now (skip it, 409), or this
//! request claims it and calls it. The claims are settled when the fan-out ends
//! (`settle`).
//!
//! Cost with the `envoy` store and a key: one get and one set of the event's shard (a retry
//! per CAS conflict with another worker); a request whose subscribers all already have the
//! event costs one get. Off, or without a key: no host call.

use crate::config::{Channel, Config};
use crate::fanout::FanOut;
use crate::host::{Host, HostStore};
use crate::telemetry::Counter;

pub use super::settle::{owner_id, Claims};
use super::{shard_key, update, Event as StoredEvent, Limits, Seen, CLAIM_MARGIN_MS};

/// The request, as far as its claims need it.
pub struct Asking<'a> {
    /// Its context id, for log lines.
    pub log_id: u32,
    /// When its headers came, on the host's clock: the claims' time.
    pub started_ms: u64,
    pub channel: &'a Channel,
    /// The event's identity in the store; `None`: it has none.
    pub key: Option<&'a [u8]>,
}

/// `dedupe`, before the calls: for each subscriber in `wanted` (those its filter did not
/// skip), marks it in `fanout` as already delivered, or as being delivered by another
/// request, or claims it for this request (left ready to call). Returns the claims to settle
/// when the fan-out ends. Changes nothing (everyone wanted is called) when dedupe is off, the
/// request has no key, or the store cannot be updated.
pub fn claim<H: Host>(
    host: &H,
    counter: &Counter,
    config: &Config,
    request: &Asking<'_>,
    wanted: &[usize],
    fanout: &mut FanOut,
) -> Option<Claims> {
    let dedupe = config.dedupe.as_ref()?;
    let channel = request.channel;
    let Some(key) = request.key else {
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
        Claims::new(
            shard,
            channel.name.clone(),
            key.to_vec(),
            owner,
            subscribers,
        )
    })
}
