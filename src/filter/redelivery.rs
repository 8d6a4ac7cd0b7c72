//! The glue of [`crate::dedupe`]: Envoy's shared data as its store, and the two points where
//! a delivery meets it: in the stream, before the event goes to the engine (which subscribers
//! to skip, and claiming the others), and in the engine when the fan-out ends, sync or async,
//! from whichever context ends it (recording who took the event, releasing the rest; also
//! when a sync sender goes away).
//!
//! Cost per request with dedupe on and a key: one get and one set of the event's shard before
//! the calls, one get and one set after (a retry per CAS conflict with another worker); a
//! request whose subscribers all already have the event costs one get. Off, or without a
//! key: no host call.

use std::hash::BuildHasher;

use super::{FanoutStream, Host};
use crate::config::{Channel, Config};
use crate::dedupe::{
    self, shard_key, subscriber_ids, update, CasMismatch, Event, Limits, Seen, SharedStore,
    CLAIM_MARGIN_MS,
};
use crate::fanout::FanOut;
use crate::metrics::Tally;

/// Envoy's shared data, through the [`Host`].
pub struct HostStore<'a, H>(pub &'a H);

impl<H: Host> SharedStore for HostStore<'_, H> {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.0.get_shared_data(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
        self.0.set_shared_data(key, value, cas)
    }
}

/// What a request claimed, to settle when its fan-out ends: carried in the engine's job, so
/// that whichever context ends the fan-out (the stream, or the root context for retries and
/// async deliveries) records it.
pub struct Redelivery {
    shard: u32,
    channel: String,
    key: Vec<u8>,
    owner: u64,
    /// Index in the channel and identity of each subscriber this request calls.
    subscribers: Vec<(usize, u64)>,
}

/// At configure time: creates the shard keys, so that no request meets a missing one, and
/// says how much memory the store may take.
pub fn prepare<H: Host>(host: &H, config: &Config) {
    let Some(dedupe) = &config.dedupe else {
        return;
    };
    dedupe::create_shards(&HostStore(host), dedupe);
    let channel_bytes = config.channels.iter().map(|c| c.name.len()).max();
    let subscribers = config.channels.iter().map(|c| c.subscribers.len()).max();
    log::info!(
        "dedupe on {}: up to {} events for {} ms, in {} shared-data keys of at most {} \
         bytes in all",
        dedupe.key,
        dedupe.max_entries,
        dedupe.ttl_ms,
        dedupe.shards(),
        dedupe.max_bytes(channel_bytes.unwrap_or(0), subscribers.unwrap_or(0))
    );
}

/// Tells this request's claims from any other's, across workers: std's random hasher keys
/// differ per VM and per call.
fn owner_id(context_id: u32, now_ms: u64) -> u64 {
    std::collections::hash_map::RandomState::new().hash_one((context_id, now_ms))
}

impl<H: Host> FanoutStream<H> {
    /// Before the calls: for each subscriber of `channel` in `wanted` (those its filter did
    /// not skip), marks it in `fanout` as already delivered, or as being delivered by another
    /// request, or claims it for this request (left ready to call). Returns the claims to
    /// settle when the fan-out ends. Changes nothing (everyone wanted is called) when dedupe
    /// is off, the request has no key, or the store cannot be updated.
    pub(super) fn dedupe_claim(
        &self,
        config: &Config,
        event_key: Option<&[u8]>,
        channel: &Channel,
        wanted: &[usize],
        fanout: &mut FanOut,
    ) -> Option<Redelivery> {
        let dedupe = config.dedupe.as_ref()?;
        let Some(key) = event_key else {
            self.count(|tally| tally.dedupe_missing_key());
            return None;
        };
        if wanted.is_empty() {
            return None;
        }
        let all_ids = subscriber_ids(channel);
        // The request's start, read when its headers came: no clock read of its own.
        let now = self.started_ms;
        let mut ids = Vec::with_capacity(wanted.len());
        let mut until = Vec::with_capacity(wanted.len());
        for &index in wanted {
            let (Some(id), Some(sub)) = (all_ids.get(index), channel.subscribers.get(index)) else {
                return None;
            };
            ids.push(*id);
            // Retries, a dead letter and a reply all happen under the claim.
            until.push(
                now.saturating_add(sub.worst_case_ms())
                    .saturating_add(CLAIM_MARGIN_MS),
            );
        }
        let owner = owner_id(self.id, now);
        let event = Event {
            channel: &channel.name,
            key,
        };
        let shard = dedupe.shard_of(&channel.name, key);
        let limits = Limits {
            capacity: dedupe.capacity(shard),
            ttl_ms: dedupe.ttl_ms,
        };
        let store = HostStore(&self.host);
        let claimed = update(&store, &shard_key(shard), |s| {
            s.claim(&event, &ids, &until, owner, now, limits)
        });
        let done = match claimed {
            Ok(done) => done,
            Err(contended) => {
                log::warn!(
                    "[#{}] dedupe: the store stayed contended after {} host calls; \
                     delivering to every subscriber",
                    self.id,
                    contended.store_calls
                );
                self.count(|tally| tally.dedupe_store_error());
                return None;
            }
        };
        if done.replaced_corrupt {
            log::warn!(
                "[#{}] dedupe: replaced an unreadable shard {shard}",
                self.id
            );
        }
        let seen = done.value;
        let already = seen
            .iter()
            .filter(|s| **s == Seen::AlreadyDelivered)
            .count();
        let in_progress = seen.iter().filter(|s| **s == Seen::InProgress).count();
        let delta = done.entries_delta;
        self.count(|tally| {
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
        (!subscribers.is_empty()).then(|| Redelivery {
            shard,
            channel: channel.name.clone(),
            key: key.to_vec(),
            owner,
            subscribers,
        })
    }
}

/// What settling did to the store, for the metrics.
pub struct Settled {
    entries_delta: i64,
    store_error: bool,
}

impl Settled {
    pub fn record(&self, tally: &mut Tally) {
        tally.dedupe_entries(self.entries_delta);
        if self.store_error {
            tally.dedupe_store_error();
        }
    }
}

/// The fan-out ended (all calls ended, given up, or the sender went away): records the
/// subscribers this request delivered to (2xx, or taken by their dead-letter target) and
/// releases its claims on the others, so that a retry calls them again.
pub fn settle<H: Host>(
    host: &H,
    now: u64,
    config: &Config,
    claimed: Redelivery,
    fanout: &FanOut,
    log_id: u32,
) -> Settled {
    let Some(dedupe) = &config.dedupe else {
        return Settled {
            entries_delta: 0,
            store_error: false,
        };
    };
    let outcomes: Vec<(u64, bool)> = claimed
        .subscribers
        .iter()
        .map(|(index, id)| (*id, fanout.is_delivered(*index)))
        .collect();
    let event = Event {
        channel: &claimed.channel,
        key: &claimed.key,
    };
    let limits = Limits {
        capacity: dedupe.capacity(claimed.shard),
        ttl_ms: dedupe.ttl_ms,
    };
    let store = HostStore(host);
    let settled = update(&store, &shard_key(claimed.shard), |s| {
        ((), s.settle(&event, &outcomes, claimed.owner, now, limits))
    });
    match settled {
        Ok(done) => Settled {
            entries_delta: done.entries_delta,
            store_error: false,
        },
        Err(_) => {
            // The claims lapse on their own; deliveries not recorded may be repeated.
            log::warn!("[#{log_id}] dedupe: could not record the outcome (store contended)");
            Settled {
                entries_delta: 0,
                store_error: true,
            }
        }
    }
}
