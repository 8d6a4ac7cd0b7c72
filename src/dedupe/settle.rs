//! Dedupe after the calls: when a fan-out ends, sync or async, from whichever context ends
//! it (also when a sync sender goes away), the claims it made (`claim`) are settled:
//! who took the event is recorded, the other claims released so that a retry calls them
//! again. And at configure time, the store made ready (the shard keys).
//!
//! Cost per request with the `envoy` store and a key: one get and one set after the calls
//! (a retry per CAS conflict with another worker). Off, or without a key: no host call.

use std::hash::BuildHasher;

use super::etcd;
use super::{create_shards, shard_key, update, Limits, StoredEvent};
use crate::config::{Config, DedupeConfig, EtcdStore, Store};
use crate::host::{Host, HostStore};
use crate::metrics::Tally;

/// What a request claimed, to settle when its fan-out ends: carried in the delivery's job, so
/// that whichever context ends the fan-out (the stream, or the root context for retries and
/// async deliveries) records it. One variant per store.
pub enum Claims {
    /// In Envoy's shared data.
    Shard(ShardClaims),
    /// In the etcd store.
    Etcd(EtcdClaims),
}

/// An event's claims in one shard of Envoy's shared data.
pub struct ShardClaims {
    pub shard: u32,
    pub channel: String,
    pub key: Vec<u8>,
    pub owner: u64,
    /// Index in the channel and identity of each subscriber this request calls.
    pub subscribers: Vec<(usize, u64)>,
}

/// An event's claim in the etcd store: its key and our value, and its records' key and the
/// live records read with the claim (kept when the new ones are put).
pub struct EtcdClaims {
    /// Index in the channel and identity of each subscriber this request calls.
    pub subscribers: Vec<(usize, u64)>,
    pub claim_key: Vec<u8>,
    pub claim: String,
    pub records_key: Vec<u8>,
    pub records: Vec<etcd::Record>,
}

/// An etcd settle, sent by the root context (Envoy cancels a stream's calls when the stream
/// ends; the root's outlive it).
pub struct RemoteSettle {
    pub cluster: String,
    pub timeout_ms: u32,
    /// The claim's key and our value: the records are put and the claim deleted only if it
    /// is still ours.
    pub claim: (Vec<u8>, String),
    /// The records' key and value to put (none if nobody took the event now).
    pub records: Option<(Vec<u8>, String)>,
    /// When the records lapse: the lease they need lives at least until then.
    pub until_ms: u64,
    pub log_id: u32,
    pub metrics: bool,
    /// The sync fan-out (job id) whose answer waits for this settle, if any.
    pub hold: Option<u64>,
}

/// Header on the answer of a fan-out whose outcome could not be written to the etcd store
/// (its settle failed): a redelivery may call again the subscribers that took the event.
pub const NOT_RECORDED_HEADER: &str = "x-fanout-not-recorded";

/// At configure time, with the `envoy` store: creates the shard keys, so that no request
/// meets a missing one, and says how much memory the store may take.
pub fn prepare<H: Host>(host: &H, config: &Config) {
    let Some(dedupe) = &config.dedupe else {
        return;
    };
    if !matches!(dedupe.store, Store::Envoy) {
        return;
    }
    create_shards(&HostStore(host), dedupe);
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
pub fn owner_id(context_id: u32, now_ms: u64) -> u64 {
    std::collections::hash_map::RandomState::new().hash_one((context_id, now_ms))
}

/// What settling did to the store, for the metrics.
#[derive(Default)]
pub struct Settled {
    entries_delta: i64,
    store_error: bool,
}

impl Settled {
    pub fn record(&self, tally: &mut Tally) {
        tally.dedupe_entries(self.entries_delta);
        if self.store_error {
            tally.dedupe_store_errors(1);
        }
    }
}

/// The fan-out ended (all calls ended, given up, or the sender went away): records the
/// subscribers this request delivered to (`delivered`, by index in the channel: 2xx, or taken
/// by their dead-letter target) and releases its claims on the others in their shard of
/// Envoy's shared data, so that a retry calls them again.
pub fn settle_shard<H: Host>(
    host: &H,
    now: u64,
    config: &Config,
    held: ShardClaims,
    delivered: &[bool],
    log_id: u32,
) -> Settled {
    let Some(dedupe) = &config.dedupe else {
        return Settled::default();
    };
    let took = |index: usize| delivered.get(index).copied().unwrap_or(false);
    settle_in_shard(host, now, dedupe, held, took, log_id)
}

/// The same for claims in etcd: the txn to send from the root context; `None` when the
/// configuration no longer names the etcd store (the claims lapse on their own).
pub fn settle_etcd(
    now: u64,
    config: &Config,
    held: EtcdClaims,
    delivered: &[bool],
    log_id: u32,
) -> Option<RemoteSettle> {
    let Store::Etcd(store) = &config.dedupe.as_ref()?.store else {
        return None;
    };
    let took = |index: usize| delivered.get(index).copied().unwrap_or(false);
    Some(settle_in_etcd(now, config, store, held, took, log_id))
}

/// The etcd settle of `held`: the records still live and the new ones put, the claim
/// deleted, if the claim is still ours.
fn settle_in_etcd(
    now: u64,
    config: &Config,
    store: &EtcdStore,
    held: EtcdClaims,
    took: impl Fn(usize) -> bool,
    log_id: u32,
) -> RemoteSettle {
    let ttl_ms = config.dedupe.as_ref().map_or(0, |d| d.ttl_ms);
    let until_ms = now.saturating_add(ttl_ms);
    let took: Vec<u64> = held
        .subscribers
        .iter()
        .filter(|(index, _)| took(*index))
        .map(|(_, id)| *id)
        .collect();
    // The records still live, and the new ones: a subscriber claimed had no live record, so
    // no subscriber is in both.
    let put = (!took.is_empty()).then(|| {
        let records: Vec<etcd::Record> = held
            .records
            .into_iter()
            .filter(|r| r.until_ms > now)
            .chain(took.iter().map(|&subscriber| etcd::Record {
                subscriber,
                until_ms,
            }))
            .collect();
        (held.records_key, etcd::records_value(&records))
    });
    RemoteSettle {
        cluster: store.cluster.clone(),
        timeout_ms: store.timeout_ms,
        claim: (held.claim_key, held.claim),
        records: put,
        until_ms,
        log_id,
        metrics: config.metrics,
        hold: None,
    }
}

/// The settle of `held` in its shard of Envoy's shared data (get, change, set under CAS).
fn settle_in_shard<H: Host>(
    host: &H,
    now: u64,
    dedupe: &DedupeConfig,
    held: ShardClaims,
    took: impl Fn(usize) -> bool,
    log_id: u32,
) -> Settled {
    let outcomes: Vec<(u64, bool)> = held
        .subscribers
        .iter()
        .map(|(index, id)| (*id, took(*index)))
        .collect();
    let event = StoredEvent {
        channel: &held.channel,
        key: &held.key,
    };
    let limits = Limits {
        capacity: dedupe.capacity(held.shard),
        ttl_ms: dedupe.ttl_ms,
    };
    let store = HostStore(host);
    let settled = update(&store, &shard_key(held.shard), |s| {
        ((), s.settle(&event, &outcomes, held.owner, now, limits))
    });
    match settled {
        Ok(done) => Settled {
            entries_delta: done.entries_delta,
            ..Settled::default()
        },
        Err(_) => {
            // The claims lapse on their own; deliveries not recorded may be repeated.
            log::warn!("[#{log_id}] dedupe: could not record the outcome (store contended)");
            Settled {
                store_error: true,
                ..Settled::default()
            }
        }
    }
}
