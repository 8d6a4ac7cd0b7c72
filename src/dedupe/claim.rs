//! Dedupe before the calls: for each subscriber a request would call, whether it already
//! took the event (skip it), another request is calling it right now (skip it, 409), or this
//! request claims it and calls it. The claims are settled when the fan-out ends
//! (`settle`).
//!
//! [`claim`] says what a request must claim ([`Claim`]); its store makes the claims, in the
//! pipeline's claim stage (`DedupeStore::claim`). Cost with the `envoy` store and a key: one
//! get and one set of the event's shard (a retry per CAS conflict with another worker); a
//! request whose subscribers all already have the event costs one get. With the `etcd`
//! store: one etcd txn (a gRPC call), whose answer continues the request ([`claimed`]). Off,
//! or without a key: no host call.

use std::time::Duration;

use crate::answer::Answer;
use crate::config::{Channel, Config, DedupeConfig, EtcdStore, OnStoreError, Store};
use crate::fan_out_state::FanOut;
use crate::host::{Host, HostStore};
use crate::telemetry::Counter;

use super::etcd::{self, ClaimOp, Found, StoreError};
pub use super::settle::{owner_id, Claims, EtcdClaims, ShardClaims};
use super::{shard_key, update, Limits, Seen, StoredEvent, CLAIM_MARGIN_MS};

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

/// A request's claims, for its store to make (the pipeline's claim stage).
pub enum Claim {
    /// In the event's shard of Envoy's shared data, at once.
    Shard(ShardAsk),
    /// In etcd: this txn, then its answer. (Without a lease yet, it waits for one up to the
    /// store's timeout, then [`store_failed`] says what the event gets.)
    Etcd(Ask),
}

/// A claim in Envoy's shared data: the event's identity and the subscribers it claims.
pub struct ShardAsk {
    key: Vec<u8>,
    wanted: Wanted,
}

/// An etcd claim to send, and what reading its answer needs. Sent alone ([`Ask::body`]) or
/// with the claims of other requests in one txn ([`batch_body`]).
pub struct Ask {
    pub cluster: String,
    pub timeout: Duration,
    /// The lease its claim is written with (`None`: none held yet; it waits for one), the
    /// time the lease must cover, and the request's time.
    pub lease: Option<i64>,
    until_ms: u64,
    now_ms: u64,
    /// Index in the channel and identity of each subscriber asked for.
    subscribers: Vec<(usize, u64)>,
    /// The event's claim key and our claim value, and its records key.
    claim_key: Vec<u8>,
    claim: String,
    records_key: Vec<u8>,
}

impl Ask {
    /// The headers of the claim's call.
    pub fn headers(&self) -> Vec<(&str, &[u8])> {
        etcd::call_headers(&self.cluster, etcd::TXN_PATH)
    }

    /// The claim txn of this request alone.
    pub fn body(&self) -> Vec<u8> {
        batch_body(std::slice::from_ref(&self))
    }

    /// Whether it claims the key `other` claims (etcd refuses a txn that writes a key twice:
    /// two copies of one event go in two txns).
    pub fn shares_a_key(&self, other: &Ask) -> bool {
        self.claim_key == other.claim_key
    }

    /// Takes the lease `pick` gives for its claim, if it has none yet: whether it has one.
    pub fn lease_from(&mut self, pick: impl FnOnce(u64) -> Option<i64>) -> bool {
        if self.lease.is_none() {
            self.lease = pick(self.until_ms);
        }
        self.lease.is_some()
    }
}

/// One claim txn for several requests' claims, in their order (their keys all differ; each
/// has its lease: an ask without one waits, it is never sent).
pub fn batch_body(asks: &[&Ask]) -> Vec<u8> {
    let ops: Vec<ClaimOp<'_>> = asks
        .iter()
        .map(|ask| ClaimOp {
            key: &ask.claim_key,
            value: &ask.claim,
            records: &ask.records_key,
            lease: ask.lease.unwrap_or_default(),
            now_ms: ask.now_ms,
        })
        .collect();
    etcd::claim_body(&ops)
}

/// What etcd's answer to a claim txn of `n` requests' claims found for each of them, in
/// the txn's order, or why the store failed (then for all of them).
pub fn read_batch(reply: &etcd::Reply, n: usize) -> Result<Vec<Found>, StoreError> {
    etcd::read_claim(etcd::read_answer(reply)?, n)
}

/// The answer to an etcd call being delivered (`num_headers` 0: none came), read through the
/// host: its status, body and `grpc-status` (three host calls), and on an error the message.
pub fn etcd_reply<H: Host>(host: &H, num_headers: usize, body_size: usize) -> etcd::Reply {
    if num_headers == 0 {
        return etcd::Reply::default();
    }
    let body = if body_size > 0 {
        host.call_body(body_size)
    } else {
        Vec::new()
    };
    // A success has it in the trailers; an error that is only trailers, in the headers.
    let (grpc_status, in_trailers) = match host.call_trailer("grpc-status") {
        Some(status) => (Some(status), true),
        None => (host.call_header("grpc-status"), false),
    };
    let grpc_message = match grpc_status.as_deref() {
        Some("0") | None => None,
        Some(_) if in_trailers => host.call_trailer("grpc-message"),
        Some(_) => host.call_header("grpc-message"),
    };
    etcd::Reply {
        status: host.call_status(),
        grpc_status,
        grpc_message,
        body,
    }
}

/// The subscribers a request would call, as its claims need them: index in the channel and
/// identity of each, the time each claim must last, the owner and the request's time.
struct Wanted {
    subscribers: Vec<(usize, u64)>,
    until: Vec<u64>,
    owner: u64,
    now: u64,
}

impl Wanted {
    /// `None` if an index is not the channel's.
    fn of(request: &Asking<'_>, wanted: &[usize]) -> Option<Wanted> {
        // The request's start, read when its headers came: no clock read of its own.
        let now = request.started_ms;
        let mut subscribers = Vec::with_capacity(wanted.len());
        let mut until = Vec::with_capacity(wanted.len());
        for &index in wanted {
            let sub = request.channel.subscribers.get(index)?;
            subscribers.push((index, sub.dedupe_id));
            // Retries, a dead letter and a reply all happen under the claim.
            until.push(
                now.saturating_add(sub.worst_case_ms())
                    .saturating_add(CLAIM_MARGIN_MS),
            );
        }
        let owner = owner_id(request.log_id, now);
        Some(Wanted {
            subscribers,
            until,
            owner,
            now,
        })
    }
}

/// `dedupe`, before the calls: the claims of the subscribers in `wanted` (those its filter
/// did not skip) for the request's store to make (`None`: nothing to claim, and everyone
/// wanted is called: the request has no key, or nobody is wanted). An etcd claim is asked
/// without a lease: the claim stage gives it one ([`Ask::lease_from`]).
pub fn claim<H: Host>(
    host: &H,
    counter: &Counter,
    dedupe: &DedupeConfig,
    request: &Asking<'_>,
    wanted: &[usize],
) -> Option<Claim> {
    let Some(key) = request.key else {
        counter.count(host, |tally| tally.dedupe_missing_key());
        return None;
    };
    if wanted.is_empty() {
        return None;
    }
    let wanted = Wanted::of(request, wanted)?;
    Some(match &dedupe.store {
        Store::Etcd(store) => Claim::Etcd(ask(store, request.channel, key, wanted)),
        Store::Envoy => Claim::Shard(ShardAsk {
            key: key.to_vec(),
            wanted,
        }),
    })
}

/// The claims of `ask` in the event's shard of Envoy's shared data (get, change, set under
/// CAS) for request `log_id` on `channel`: `fanout` marked, and the claims made, if any.
/// The store contended past its retries: counted, and everyone is called (`None`).
pub fn claim_in_shard<H: Host>(
    host: &H,
    counter: &Counter,
    (dedupe, channel): (&DedupeConfig, &Channel),
    log_id: u32,
    ask: ShardAsk,
    fanout: &mut FanOut,
) -> Option<Claims> {
    let ShardAsk { key, wanted } = ask;
    let event = StoredEvent {
        channel: &channel.name,
        key: &key,
    };
    let shard = dedupe.shard_of(&channel.name, &key);
    let limits = Limits {
        capacity: dedupe.capacity(shard),
        ttl_ms: dedupe.ttl_ms,
    };
    let ids: Vec<u64> = wanted.subscribers.iter().map(|(_, id)| *id).collect();
    let claimed = update(&HostStore(host), &shard_key(shard), |s| {
        s.claim(
            &event,
            &ids,
            &wanted.until,
            wanted.owner,
            wanted.now,
            limits,
        )
    });
    let done = match claimed {
        Ok(done) => done,
        Err(contended) => {
            log::warn!(
                "[#{log_id}] dedupe: the store stayed contended after {} host calls; \
                 delivering to every subscriber",
                contended.store_calls
            );
            counter.count(host, |tally| tally.dedupe_store_errors(1));
            return None;
        }
    };
    if done.replaced_corrupt {
        log::warn!("[#{log_id}] dedupe: replaced an unreadable shard {shard}");
    }
    let delta = done.entries_delta;
    counter.count(host, |tally| tally.dedupe_entries(delta));
    let claimed = mark(host, counter, fanout, &wanted.subscribers, &done.value);
    (!claimed.is_empty()).then(|| {
        Claims::Shard(ShardClaims {
            shard,
            channel: channel.name.clone(),
            key,
            owner: wanted.owner,
            subscribers: claimed,
        })
    })
}

/// Marks each subscriber in `fanout` as `seen` says, counts the skipped ones, and returns
/// those claimed.
fn mark<H: Host>(
    host: &H,
    counter: &Counter,
    fanout: &mut FanOut,
    subscribers: &[(usize, u64)],
    seen: &[Seen],
) -> Vec<(usize, u64)> {
    let already = seen
        .iter()
        .filter(|s| **s == Seen::AlreadyDelivered)
        .count();
    let in_progress = seen.iter().filter(|s| **s == Seen::InProgress).count();
    counter.count(host, |tally| tally.dedupe_skipped(already, in_progress));
    let mut claimed = Vec::new();
    for (&(index, id), s) in subscribers.iter().zip(seen) {
        match s {
            Seen::Deliver => claimed.push((index, id)),
            Seen::AlreadyDelivered => fanout.already_delivered(index),
            Seen::InProgress => fanout.in_progress_elsewhere(index),
        }
    }
    claimed
}

/// The etcd claim of `wanted`: one claim for the event, until its longest delivery ends,
/// to be written with a lease that lives that long (none yet: the claim stage picks it).
fn ask(store: &EtcdStore, channel: &Channel, key: &[u8], wanted: Wanted) -> Ask {
    let until = wanted.until.iter().copied().max().unwrap_or(wanted.now);
    let (claim_key, records_key) = etcd::keys(&store.prefix, &channel.name, key);
    Ask {
        cluster: store.cluster.clone(),
        timeout: Duration::from_millis(u64::from(store.timeout_ms)),
        lease: None,
        until_ms: until,
        now_ms: wanted.now,
        subscribers: wanted.subscribers,
        claim_key,
        claim: etcd::claim_value(until, wanted.owner),
        records_key,
    }
}

/// What etcd found for `ask`'s event: marks `fanout` and returns the claims to settle. When
/// the claim is ours it is settled even if nobody is left to call (every subscriber already
/// has the event), so that it is released at once rather than when it lapses.
pub fn claimed<H: Host>(
    host: &H,
    counter: &Counter,
    ask: Ask,
    found: &Found,
    fanout: &mut FanOut,
) -> Option<Claims> {
    let seen: Vec<Seen> = ask
        .subscribers
        .iter()
        .map(|&(_, id)| found.seen(id, ask.now_ms))
        .collect();
    let claimed = mark(host, counter, fanout, &ask.subscribers, &seen);
    found.claimed.then(|| {
        let records = found
            .records
            .iter()
            .filter(|r| r.until_ms > ask.now_ms)
            .copied()
            .collect();
        Claims::Etcd(EtcdClaims {
            subscribers: claimed,
            claim_key: ask.claim_key,
            claim: ask.claim,
            records_key: ask.records_key,
            records,
        })
    })
}

/// The store failed for a request: counted; one warning per 10 s at most (`warn` says
/// whether this one is logged, and how many were not since the last). With
/// `on_store_error: deliver` everyone is called as if dedupe were off (`Ok`); with `reject`,
/// the 503 to answer, nobody called.
pub fn store_failed<H: Host>(
    host: &H,
    counter: &Counter,
    config: &Config,
    log_id: u32,
    error: &StoreError,
    warn: impl FnOnce() -> Option<u32>,
) -> Result<(), Answer> {
    counter.count(host, |tally| tally.dedupe_store_errors(1));
    let reject = config
        .dedupe
        .as_ref()
        .is_some_and(|d| d.on_store_error == OnStoreError::Reject);
    let what = if reject {
        "answering 503"
    } else {
        "delivering to every subscriber"
    };
    if let Some(unlogged) = warn() {
        let earlier = if unlogged > 0 {
            format!(" ({unlogged} more since the last warning)")
        } else {
            String::new()
        };
        log::warn!("[#{log_id}] dedupe: the etcd store failed: {error}; {what}{earlier}");
    }
    if reject {
        Err(Answer::rejected(
            503,
            "the dedupe store cannot be reached; nobody was called, try again",
        )
        .with_header("retry-after", "1".to_string()))
    } else {
        Ok(())
    }
}
