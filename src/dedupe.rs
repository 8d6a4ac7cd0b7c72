//! Redelivery without duplicates: which subscribers already have an event, kept in a store
//! that every worker of an Envoy process shares, so that a sender's retry reaches only the
//! subscribers that did not take the event the first time.
//!
//! This module is the record format and the rules; it does not know proxy-wasm. The store is
//! behind [`SharedStore`], which Envoy's shared data implements (`filter/`) and the tests fake.
//!
//! # Store layout
//!
//! Records live in a fixed ring of **shard keys** `fanout.dedupe.slot.<i>`, `i` in
//! `0..shards`, `shards = ceil(max_entries / 32)`. An event `(channel, key)` belongs to shard
//! `fnv1a(channel, key) % shards`; a shard's value is the list of its events ([`Shard`]),
//! each with the per-subscriber state: *delivered at t* or *claimed until t by owner o*.
//! Shard `i` holds at most its share of `max_entries` (they add up to exactly
//! `max_entries`); a full shard evicts its oldest event (by first record) first. So the store
//! never holds more than `max_entries` events, in a number of keys that never grows: Envoy's
//! shared data has no delete, and a key per event would be a leak.
//!
//! Why shards and not one index key: every update is a read-modify-write of a whole value
//! under CAS; one key with 100 000 events would copy megabytes per request and make every
//! worker contend on it. Eviction is therefore oldest-first *per shard* (an event is kept
//! until about `max_entries` newer events have arrived, fewer for an unlucky shard).
//!
//! # Concurrency
//!
//! Every change is get → change → set-with-CAS, retried on a mismatch ([`update`]). Envoy's
//! CAS does not cover creation (a `set` on an absent key succeeds whatever CAS it carries), so
//! a shard key is first created *empty* and only then updated under CAS; the filter creates
//! all of them at configure time, before any request.
//!
//! Two requests for the same event racing before either has recorded anything: the first
//! one's CAS write turns each subscriber it will call into a **claim** (owner, expiry). The
//! second sees the claims and does not call those subscribers; it answers 409 (*in
//! progress*, retry) unless it has nothing else to wait for. A claim is settled when its
//! request ends: *delivered* on 2xx, removed otherwise (also when the client went away and
//! Envoy cancelled the calls), so a retry calls that subscriber again. A claim whose request
//! never settled (a crashed VM) expires at its call's timeout plus [`CLAIM_MARGIN_MS`].
//!
//! # Memory bound
//!
//! See [`DedupeConfig::max_bytes`]: `max_entries × (14 + channel + key + 25 × subscribers)`
//! bytes of values, plus Envoy's per-key overhead for `shards` keys.

use crate::config::Channel;

/// Prefix of the shard keys in Envoy's shared data.
pub const SHARD_PREFIX: &str = "fanout.dedupe.slot.";
/// Events per shard at most: bounds the bytes copied per store access.
pub const SHARD_CAPACITY: u32 = 32;
/// Event keys longer than this are not deduplicated (fanned out as if they had no key).
pub const MAX_KEY_BYTES: usize = 256;
/// The largest `max_entries` accepted.
pub const MAX_ENTRIES_LIMIT: u32 = 1_000_000;
/// The longest `ttl_ms` accepted: 7 days.
pub const MAX_TTL_MS: u64 = 7 * 24 * 3600 * 1000;
/// Get/set rounds before a store update gives up (only contention makes it retry).
pub const MAX_ATTEMPTS: u32 = 32;
/// How long a claim outlives its call's timeout, for a request that never settles it.
pub const CLAIM_MARGIN_MS: u64 = 5_000;

/// Record format version, the first byte of every shard value.
const FORMAT: u8 = 1;
const TAG_DELIVERED: u8 = 1;
const TAG_CLAIMED: u8 = 2;

/// The validated `dedupe` configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DedupeConfig {
    /// What names an event.
    pub key: Identity,
    pub ttl_ms: u64,
    pub max_entries: u32,
}

/// What names an event for `dedupe`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// The CloudEvent's `source` and `id` together, which the CloudEvents spec makes unique
    /// (and Knative's data-plane spec requires for duplicate detection): `ce-source` and `ce-id`
    /// in binary mode, the members `source` and `id` of a structured body. The default.
    CloudEvent,
    /// The value of this request header (lower case): `key` in the configuration, for
    /// traffic that is not CloudEvents.
    Header(String),
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Identity::CloudEvent => f.write_str("the CloudEvents identity (source, id)"),
            Identity::Header(name) => write!(f, "header {name}"),
        }
    }
}

/// The store key of a CloudEvent: its `source` and `id`, the source's length first
/// (`<length>:<source><id>`), so that two different pairs never make the same key (`("/a",
/// "b1")` is `2:/ab1`, `("/ab", "1")` is `3:/ab1`). `None` when either is empty or the key is
/// longer than [`MAX_KEY_BYTES`]: such an event is not deduplicated.
pub fn cloudevent_key(source: &[u8], id: &[u8]) -> Option<Vec<u8>> {
    if source.is_empty() || id.is_empty() {
        return None;
    }
    let mut key = source.len().to_string().into_bytes();
    key.push(b':');
    key.extend_from_slice(source);
    key.extend_from_slice(id);
    (key.len() <= MAX_KEY_BYTES).then_some(key)
}

/// The store key named by a header (`key` in the configuration): its value. `None` when it is
/// empty or longer than [`MAX_KEY_BYTES`].
pub fn header_key(value: &[u8]) -> Option<Vec<u8>> {
    (!value.is_empty() && value.len() <= MAX_KEY_BYTES).then(|| value.to_vec())
}

impl DedupeConfig {
    pub fn shards(&self) -> u32 {
        self.max_entries.div_ceil(SHARD_CAPACITY).max(1)
    }

    /// How many events shard `shard` may hold; the shards' capacities add up to
    /// `max_entries`, and none is 0.
    pub fn capacity(&self, shard: u32) -> usize {
        let shards = self.shards();
        let base = self.max_entries / shards;
        let extra = u32::from(shard < self.max_entries % shards);
        (base + extra) as usize
    }

    /// The shard an event belongs to. FNV-1a: the same on every worker and every run.
    pub fn shard_of(&self, channel: &str, key: &[u8]) -> u32 {
        let mut h = Fnv::new();
        h.write(channel.as_bytes());
        h.write(&[0]);
        h.write(key);
        (h.finish() % u64::from(self.shards())) as u32
    }

    /// Upper bound of the bytes of all shard values, for events of channels named with at
    /// most `channel_bytes` bytes and with at most `subscribers` subscribers: per event 14
    /// bytes of framing, the channel name, the key (at most [`MAX_KEY_BYTES`]) and 25 bytes per
    /// subscriber (a claim; a delivery takes 17).
    pub fn max_bytes(&self, channel_bytes: usize, subscribers: usize) -> u64 {
        let entry = 8 + 2 + channel_bytes + 2 + MAX_KEY_BYTES + 2 + 25 * subscribers;
        let framing = 5 * u64::from(self.shards());
        u64::from(self.max_entries) * entry as u64 + framing
    }
}

pub fn shard_key(shard: u32) -> String {
    format!("{SHARD_PREFIX}{shard}")
}

/// 64-bit FNV-1a: stable across processes, unlike std's randomly keyed hasher.
struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// Stable identities of a channel's subscribers, in order: a hash of what makes a delivery
/// target (cluster, authority, path, its own headers), so that records survive a
/// configuration update that reorders or adds subscribers. Two identical subscribers get
/// different identities (the second hashes its occurrence too).
pub fn subscriber_ids(channel: &Channel) -> Vec<u64> {
    let mut ids: Vec<u64> = Vec::with_capacity(channel.subscribers.len());
    for sub in &channel.subscribers {
        let mut h = Fnv::new();
        for (name, value) in &sub.call_headers {
            h.write(name.as_bytes());
            h.write(&[0]);
            h.write(value.as_bytes());
            h.write(&[0]);
        }
        h.write(sub.cluster.as_bytes());
        let mut id = h.finish();
        let mut occurrence = 0u8;
        while ids.contains(&id) {
            occurrence = occurrence.wrapping_add(1);
            h.write(&[occurrence]);
            id = h.finish();
        }
        ids.push(id);
    }
    ids
}

/// One event as the store knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event<'a> {
    pub channel: &'a str,
    pub key: &'a [u8],
}

/// What one subscriber's record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mark {
    /// It answered 2xx at `at_ms`; forgotten at `at_ms + ttl_ms`.
    Delivered { at_ms: u64 },
    /// A request (`owner`) is calling it; the claim lapses at `until_ms`.
    Claimed { until_ms: u64, owner: u64 },
}

impl Mark {
    fn live(&self, now_ms: u64, ttl_ms: u64) -> bool {
        match *self {
            Mark::Delivered { at_ms } => now_ms < at_ms.saturating_add(ttl_ms),
            Mark::Claimed { until_ms, .. } => now_ms < until_ms,
        }
    }
}

/// One event's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub channel: String,
    pub key: Vec<u8>,
    /// When the event was first recorded: the eviction order.
    pub created_ms: u64,
    /// Subscriber identity and its mark.
    pub marks: Vec<(u64, Mark)>,
}

impl Entry {
    fn is(&self, event: &Event<'_>) -> bool {
        self.channel == event.channel && self.key == event.key
    }

    fn mark(&self, id: u64) -> Option<&Mark> {
        self.marks.iter().find(|(i, _)| *i == id).map(|(_, m)| m)
    }

    fn set(&mut self, id: u64, mark: Mark) {
        match self.marks.iter_mut().find(|(i, _)| *i == id) {
            Some(slot) => slot.1 = mark,
            None => self.marks.push((id, mark)),
        }
    }
}

/// What a request does about one subscriber, decided by [`Shard::claim`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// Not recorded (or expired): this request calls it (it now holds the claim).
    Deliver,
    /// It already took the event: skip it.
    AlreadyDelivered,
    /// Another request is calling it right now: skip it, and do not claim success for it.
    InProgress,
}

/// The value of one shard key: its events, in the order they were first recorded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Shard {
    pub entries: Vec<Entry>,
}

/// A shard value that does not decode (another format, or damage): it is replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Corrupt;

impl Shard {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(5 + self.entries.len() * 96);
        out.push(FORMAT);
        out.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        for e in &self.entries {
            out.extend_from_slice(&e.created_ms.to_le_bytes());
            put_bytes(&mut out, e.channel.as_bytes());
            put_bytes(&mut out, &e.key);
            out.extend_from_slice(&(e.marks.len() as u16).to_le_bytes());
            for (id, mark) in &e.marks {
                out.extend_from_slice(&id.to_le_bytes());
                match *mark {
                    Mark::Delivered { at_ms } => {
                        out.push(TAG_DELIVERED);
                        out.extend_from_slice(&at_ms.to_le_bytes());
                    }
                    Mark::Claimed { until_ms, owner } => {
                        out.push(TAG_CLAIMED);
                        out.extend_from_slice(&until_ms.to_le_bytes());
                        out.extend_from_slice(&owner.to_le_bytes());
                    }
                }
            }
        }
        out
    }

    /// An empty value is an empty shard (how shard keys are created).
    pub fn decode(bytes: &[u8]) -> Result<Shard, Corrupt> {
        if bytes.is_empty() {
            return Ok(Shard::default());
        }
        let mut r = Reader(bytes);
        if r.u8()? != FORMAT {
            return Err(Corrupt);
        }
        let count = r.u32()? as usize;
        let mut entries = Vec::with_capacity(count.min(SHARD_CAPACITY as usize * 2));
        for _ in 0..count {
            let created_ms = r.u64()?;
            let channel = String::from_utf8(r.bytes()?.to_vec()).map_err(|_| Corrupt)?;
            let key = r.bytes()?.to_vec();
            let n = r.u16()? as usize;
            let mut marks = Vec::with_capacity(n);
            for _ in 0..n {
                let id = r.u64()?;
                let mark = match r.u8()? {
                    TAG_DELIVERED => Mark::Delivered { at_ms: r.u64()? },
                    TAG_CLAIMED => Mark::Claimed {
                        until_ms: r.u64()?,
                        owner: r.u64()?,
                    },
                    _ => return Err(Corrupt),
                };
                marks.push((id, mark));
            }
            entries.push(Entry {
                channel,
                key,
                created_ms,
                marks,
            });
        }
        if !r.0.is_empty() {
            return Err(Corrupt);
        }
        Ok(Shard { entries })
    }

    /// Forgets what has expired: deliveries older than `ttl_ms`, lapsed claims, and events
    /// with nothing left.
    pub fn expire(&mut self, now_ms: u64, ttl_ms: u64) {
        for e in &mut self.entries {
            e.marks.retain(|(_, m)| m.live(now_ms, ttl_ms));
        }
        self.entries.retain(|e| !e.marks.is_empty());
    }

    /// Evicts the oldest events (by first record) until at most `capacity` are left.
    pub fn evict(&mut self, capacity: usize) {
        while self.entries.len() > capacity {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(i, e)| (e.created_ms, *i))
                .map(|(i, _)| i);
            match oldest {
                Some(i) => {
                    self.entries.remove(i);
                }
                None => break,
            }
        }
    }

    fn entry_mut(&mut self, event: &Event<'_>, now_ms: u64) -> &mut Entry {
        let index = match self.entries.iter().position(|e| e.is(event)) {
            Some(i) => i,
            None => {
                self.entries.push(Entry {
                    channel: event.channel.to_string(),
                    key: event.key.to_vec(),
                    created_ms: now_ms,
                    marks: Vec::new(),
                });
                self.entries.len() - 1
            }
        };
        &mut self.entries[index]
    }

    /// Decides, for each subscriber (`ids[i]`, whose claim would last until
    /// `claim_until[i]`), whether this request calls it, and claims those it will call.
    /// Returns the decisions and whether the shard changed (and must be written).
    pub fn claim(
        &mut self,
        event: &Event<'_>,
        ids: &[u64],
        claim_until: &[u64],
        owner: u64,
        now_ms: u64,
        limits: Limits,
    ) -> (Vec<Seen>, bool) {
        self.expire(now_ms, limits.ttl_ms);
        let existing = self.entries.iter().find(|e| e.is(event));
        let seen: Vec<Seen> = ids
            .iter()
            .map(|id| match existing.and_then(|e| e.mark(*id)) {
                Some(Mark::Delivered { .. }) => Seen::AlreadyDelivered,
                Some(Mark::Claimed { .. }) => Seen::InProgress,
                None => Seen::Deliver,
            })
            .collect();
        if !seen.contains(&Seen::Deliver) {
            return (seen, false);
        }
        let entry = self.entry_mut(event, now_ms);
        for ((id, until), s) in ids.iter().zip(claim_until).zip(&seen) {
            if *s == Seen::Deliver {
                entry.set(
                    *id,
                    Mark::Claimed {
                        until_ms: *until,
                        owner,
                    },
                );
            }
        }
        self.evict(limits.capacity);
        (seen, true)
    }

    /// Settles `owner`'s claims: each `(id, delivered)` becomes *delivered now*, or, when the
    /// call did not deliver, the claim is dropped (only if it is still `owner`'s) so that a
    /// retry calls that subscriber again. Returns whether the shard changed.
    pub fn settle(
        &mut self,
        event: &Event<'_>,
        outcomes: &[(u64, bool)],
        owner: u64,
        now_ms: u64,
        limits: Limits,
    ) -> bool {
        self.expire(now_ms, limits.ttl_ms);
        let mut changed = false;
        if outcomes.iter().any(|(_, delivered)| *delivered) {
            let entry = self.entry_mut(event, now_ms);
            for (id, _) in outcomes.iter().filter(|(_, d)| *d) {
                entry.set(*id, Mark::Delivered { at_ms: now_ms });
            }
            changed = true;
        }
        if let Some(entry) = self.entries.iter_mut().find(|e| e.is(event)) {
            let before = entry.marks.len();
            entry.marks.retain(|(id, mark)| {
                let ours_failed = outcomes.iter().any(|(o, d)| o == id && !d);
                !(ours_failed && matches!(mark, Mark::Claimed { owner: o, .. } if *o == owner))
            });
            changed |= entry.marks.len() != before;
        }
        self.entries.retain(|e| !e.marks.is_empty());
        self.evict(limits.capacity);
        changed
    }
}

/// What bounds a shard: its capacity and the configured ttl.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub capacity: usize,
    pub ttl_ms: u64,
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    // Channel names and keys are far below 64 KiB (keys are cut off at MAX_KEY_BYTES).
    let len = bytes.len().min(u16::MAX as usize);
    out.extend_from_slice(&(len as u16).to_le_bytes());
    out.extend_from_slice(&bytes[..len]);
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Corrupt> {
        if self.0.len() < n {
            return Err(Corrupt);
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, Corrupt> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, Corrupt> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, Corrupt> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    fn u64(&mut self) -> Result<u64, Corrupt> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn bytes(&mut self) -> Result<&'a [u8], Corrupt> {
        let n = self.u16()? as usize;
        self.take(n)
    }
}

/// A `set` whose CAS no longer matched: someone wrote the key since our `get`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CasMismatch;

/// A process-wide key-value store with compare-and-swap: Envoy's proxy-wasm shared data.
pub trait SharedStore {
    /// The value and its CAS; `(None, None)` when the key does not exist.
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Writes `value` if the key's CAS is still `cas` (`None`: unconditionally). As in Envoy,
    /// a key that does not exist is written whatever `cas` says.
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch>;
    /// Empties a key. (proxy-wasm has no delete: the key stays, with an empty value.)
    fn remove(&self, key: &str) {
        let _ = self.set(key, &[], None);
    }
}

/// The result of an [`update`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Updated<T> {
    pub value: T,
    /// Events in the store after minus before (for the `fanout.dedupe.entries` gauge).
    pub entries_delta: i64,
    /// Host calls made (gets and sets).
    pub store_calls: u32,
    /// The value read was not a shard and has been replaced.
    pub replaced_corrupt: bool,
}

/// The store stayed contended for [`MAX_ATTEMPTS`] rounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Contended {
    pub store_calls: u32,
}

/// Applies `change` to the shard at `key` under CAS, retrying on a mismatch with a fresh
/// read. `change` returns its result and whether the shard must be written; it may run
/// several times, and only the result of the run that was written (or the last, unwritten
/// one) is returned. A missing key is first created empty, then updated under CAS.
pub fn update<S: SharedStore + ?Sized, T>(
    store: &S,
    key: &str,
    mut change: impl FnMut(&mut Shard) -> (T, bool),
) -> Result<Updated<T>, Contended> {
    let mut calls = 0;
    for _ in 0..MAX_ATTEMPTS {
        let (bytes, cas) = store.get(key);
        calls += 1;
        let Some(cas) = cas else {
            // Creating with content would race another creator and lose one of the two
            // writes (Envoy ignores CAS for a new key); two creators of an empty value lose
            // nothing.
            let _ = store.set(key, &[], None);
            calls += 1;
            continue;
        };
        let bytes = bytes.unwrap_or_default();
        let (mut shard, corrupt) = match Shard::decode(&bytes) {
            Ok(shard) => (shard, false),
            Err(Corrupt) => (Shard::default(), true),
        };
        let before = shard.entries.len() as i64;
        let (value, write) = change(&mut shard);
        if !write && !corrupt {
            return Ok(Updated {
                value,
                entries_delta: 0,
                store_calls: calls,
                replaced_corrupt: false,
            });
        }
        calls += 1;
        if store.set(key, &shard.encode(), Some(cas)).is_ok() {
            return Ok(Updated {
                value,
                entries_delta: shard.entries.len() as i64 - if corrupt { 0 } else { before },
                store_calls: calls,
                replaced_corrupt: corrupt,
            });
        }
    }
    Err(Contended { store_calls: calls })
}

/// Creates every shard key that does not exist yet, empty; returns the host calls made.
/// Run at configure time so that no request ever meets a missing key (see [`update`]).
pub fn create_shards<S: SharedStore + ?Sized>(store: &S, config: &DedupeConfig) -> u32 {
    let mut calls = 0;
    for shard in 0..config.shards() {
        let key = shard_key(shard);
        calls += 1;
        if store.get(&key).1.is_none() {
            let _ = store.set(&key, &[], None);
            calls += 1;
        }
    }
    calls
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::{Cell, RefCell};
    use std::collections::HashMap;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// Envoy's shared data, as its C++ implementation behaves: a global CAS counter that
    /// skips 0, and CAS checked only for keys that exist.
    #[derive(Default)]
    struct MemStore {
        data: RefCell<HashMap<String, (Vec<u8>, u32)>>,
        next_cas: Cell<u32>,
    }

    impl SharedStore for MemStore {
        fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
            match self.data.borrow().get(key) {
                Some((v, cas)) => (Some(v.clone()), Some(*cas)),
                None => (None, None),
            }
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
            let mut data = self.data.borrow_mut();
            if let (Some((_, current)), Some(cas)) = (data.get(key), cas) {
                if *current != cas {
                    return Err(CasMismatch);
                }
            }
            let next = self.next_cas.get().wrapping_add(1).max(1);
            self.next_cas.set(next);
            data.insert(key.to_string(), (value.to_vec(), next));
            Ok(())
        }
    }

    /// A store where another worker writes between our get and our set, `races` times.
    struct RacyStore<'a> {
        inner: &'a MemStore,
        races: Cell<u32>,
        rival: Box<dyn Fn(&MemStore) + 'a>,
    }

    impl SharedStore for RacyStore<'_> {
        fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
            if self.races.get() > 0 {
                self.races.set(self.races.get() - 1);
                (self.rival)(self.inner);
            }
            self.inner.set(key, value, cas)
        }
    }

    const LIMITS: Limits = Limits {
        capacity: 4,
        ttl_ms: 1000,
    };
    const EV: Event<'static> = Event {
        channel: "orders",
        key: b"e-1",
    };

    fn claim(shard: &mut Shard, ids: &[u64], owner: u64, now: u64) -> Vec<Seen> {
        let until = vec![now + 100; ids.len()];
        shard.claim(&EV, ids, &until, owner, now, LIMITS).0
    }

    #[test]
    fn record_format_round_trips() {
        let shard = Shard {
            entries: vec![
                Entry {
                    channel: "default/orders".into(),
                    key: b"9f1c-\xff".to_vec(),
                    created_ms: 1_700_000_000_123,
                    marks: vec![
                        (1, Mark::Delivered { at_ms: 5 }),
                        (
                            u64::MAX,
                            Mark::Claimed {
                                until_ms: 7,
                                owner: 42,
                            },
                        ),
                    ],
                },
                Entry {
                    channel: String::new(),
                    key: Vec::new(),
                    created_ms: 0,
                    marks: vec![(3, Mark::Delivered { at_ms: 0 })],
                },
            ],
        };
        let bytes = shard.encode();
        assert_eq!(bytes[0], FORMAT);
        // 5 framing + (8+2+14+2+6+2 + 17 + 25) + (8+2+0+2+0+2 + 17)
        assert_eq!(bytes.len(), 5 + 76 + 31);
        assert_eq!(Shard::decode(&bytes), Ok(shard));
        assert_eq!(Shard::decode(b""), Ok(Shard::default()));
    }

    #[test]
    fn damaged_values_do_not_decode() {
        let mut shard = Shard::default();
        claim(&mut shard, &[1, 2], 9, 0);
        let bytes = shard.encode();
        for cut in 1..bytes.len() {
            assert_eq!(Shard::decode(&bytes[..cut]), Err(Corrupt), "cut at {cut}");
        }
        let mut wrong_format = bytes.clone();
        wrong_format[0] = 7;
        assert_eq!(Shard::decode(&wrong_format), Err(Corrupt));
        let mut trailing = bytes;
        trailing.push(0);
        assert_eq!(Shard::decode(&trailing), Err(Corrupt));
    }

    #[test]
    fn a_new_event_is_claimed_for_every_subscriber() {
        let mut shard = Shard::default();
        assert_eq!(claim(&mut shard, &[1, 2, 3], 9, 10), vec![Seen::Deliver; 3]);
        let e = &shard.entries[0];
        assert_eq!(e.created_ms, 10);
        assert_eq!(
            e.mark(2),
            Some(&Mark::Claimed {
                until_ms: 110,
                owner: 9
            })
        );
    }

    #[test]
    fn settled_deliveries_are_skipped_and_failures_called_again() {
        let mut shard = Shard::default();
        claim(&mut shard, &[1, 2, 3], 9, 0);
        assert!(shard.settle(&EV, &[(1, true), (2, false), (3, true)], 9, 5, LIMITS));
        assert_eq!(
            claim(&mut shard, &[1, 2, 3], 10, 6),
            vec![
                Seen::AlreadyDelivered,
                Seen::Deliver,
                Seen::AlreadyDelivered
            ]
        );
        // Another channel or key is another event.
        let other = Event {
            channel: "orders",
            key: b"e-2",
        };
        let (seen, _) = shard.claim(&other, &[1], &[100], 11, 6, LIMITS);
        assert_eq!(seen, vec![Seen::Deliver]);
    }

    #[test]
    fn a_claim_in_progress_is_not_claimed_twice() {
        let mut shard = Shard::default();
        claim(&mut shard, &[1, 2], 9, 0);
        let (seen, changed) = shard.claim(&EV, &[1, 2], &[100, 100], 10, 1, LIMITS);
        assert_eq!(seen, vec![Seen::InProgress; 2]);
        assert!(!changed, "nothing to claim must not cost a write");
        // Settling someone else's claim as failed leaves it alone.
        assert!(!shard.settle(&EV, &[(1, false)], 10, 2, LIMITS));
        assert_eq!(
            claim(&mut shard, &[1], 11, 3),
            vec![Seen::InProgress],
            "the claim of owner 9 still stands"
        );
    }

    #[test]
    fn a_lapsed_claim_can_be_taken_over() {
        let mut shard = Shard::default();
        claim(&mut shard, &[1], 9, 0); // until 100
        assert_eq!(claim(&mut shard, &[1], 10, 99), vec![Seen::InProgress]);
        assert_eq!(claim(&mut shard, &[1], 10, 100), vec![Seen::Deliver]);
    }

    #[test]
    fn deliveries_expire_after_ttl() {
        let mut shard = Shard::default();
        claim(&mut shard, &[1, 2], 9, 0);
        shard.settle(&EV, &[(1, true)], 9, 10, LIMITS);
        shard.settle(&EV, &[(2, true)], 9, 500, LIMITS);
        // ttl 1000 counts from each delivery.
        assert_eq!(
            claim(&mut shard, &[1, 2], 10, 1009),
            vec![Seen::AlreadyDelivered; 2]
        );
        let mut later = shard.clone();
        assert_eq!(
            claim(&mut later, &[1, 2], 10, 1010),
            vec![Seen::Deliver, Seen::AlreadyDelivered]
        );
        shard.expire(1500, LIMITS.ttl_ms);
        assert!(shard.entries.is_empty(), "{shard:?}");
    }

    #[test]
    fn a_full_shard_evicts_its_oldest_event_first() {
        let mut shard = Shard::default();
        for i in 0..10u64 {
            let key = format!("e{i}");
            let ev = Event {
                channel: "c",
                key: key.as_bytes(),
            };
            shard.settle(&ev, &[(1, true)], 1, i, LIMITS);
            assert!(shard.entries.len() <= LIMITS.capacity);
        }
        let keys: Vec<&[u8]> = shard.entries.iter().map(|e| e.key.as_slice()).collect();
        assert_eq!(keys, [b"e6", b"e7", b"e8", b"e9"]);
    }

    #[test]
    fn shards_add_up_to_max_entries() {
        for max_entries in [1, 31, 32, 33, 100, 1000, 100_000, MAX_ENTRIES_LIMIT] {
            let config = DedupeConfig {
                key: Identity::CloudEvent,
                ttl_ms: 1,
                max_entries,
            };
            let total: usize = (0..config.shards()).map(|s| config.capacity(s)).sum();
            assert_eq!(total, max_entries as usize);
            assert!((0..config.shards()).all(|s| (1..=32).contains(&config.capacity(s))));
        }
        let config = DedupeConfig {
            key: Identity::CloudEvent,
            ttl_ms: 1,
            max_entries: 100_000,
        };
        assert_eq!(config.shards(), 3125);
        // 100 000 events, channel names up to 32 bytes, 5 subscribers: about 42 MB at most.
        assert_eq!(
            config.max_bytes(32, 5),
            100_000 * (8 + 2 + 32 + 2 + 256 + 2 + 125) + 5 * 3125
        );
        // The shard is a pure function of (channel, key).
        assert_eq!(config.shard_of("a", b"k"), config.shard_of("a", b"k"));
        assert_ne!(config.shard_of("a", b"k1"), config.shard_of("a", b"k2"));
    }

    #[test]
    fn subscriber_ids_are_stable_and_distinct() {
        let config = crate::config::Config::from_json(
            br#"{"channels": [
                {"name": "a", "hosts": ["a"], "subscribers": [{"cluster": "x"}, {"cluster": "y"}, {"cluster": "x"}]},
                {"name": "b", "hosts": ["b"], "subscribers": [{"cluster": "y"}, {"cluster": "x", "path": "/p"}]}
            ]}"#,
        )
        .unwrap();
        let a = subscriber_ids(&config.channels[0]);
        let b = subscriber_ids(&config.channels[1]);
        assert_eq!(a.len(), 3);
        assert!(a[0] != a[1] && a[0] != a[2] && a[1] != a[2]);
        // Reordered, a subscriber keeps its identity; a different path is another target.
        assert_eq!(a[1], b[0]);
        assert_ne!(a[0], b[1]);
    }

    #[test]
    fn update_creates_a_missing_key_empty_then_writes_under_cas() {
        let store = MemStore::default();
        let done = update(&store, "k", |shard| {
            claim(shard, &[1], 9, 0);
            ((), true)
        })
        .unwrap();
        // get (missing), set (create empty), get, set.
        assert_eq!(done.store_calls, 4);
        assert_eq!(done.entries_delta, 1);
        let (bytes, _) = store.get("k");
        assert_eq!(Shard::decode(&bytes.unwrap()).unwrap().entries.len(), 1);
        // Nothing to write: one get.
        let read = update(&store, "k", |_| ((), false)).unwrap();
        assert_eq!(read.store_calls, 1);
    }

    // Two workers claim the same event at once: worker B writes its claim between worker A's
    // get and set. A's set fails the CAS, A re-reads, sees B's claims, and calls nobody.
    #[test]
    fn a_race_on_the_same_event_gives_each_subscriber_one_caller() {
        let store = MemStore::default();
        create_shards(
            &store,
            &DedupeConfig {
                key: Identity::CloudEvent,
                ttl_ms: 1000,
                max_entries: 1,
            },
        );
        let racy = RacyStore {
            inner: &store,
            races: Cell::new(1),
            rival: Box::new(|s: &MemStore| {
                let b = update(s, &shard_key(0), |shard| {
                    let seen = claim(shard, &[1, 2], 20, 0);
                    (seen, true)
                })
                .unwrap();
                assert_eq!(b.value, vec![Seen::Deliver; 2]);
            }),
        };
        let a = update(&racy, &shard_key(0), |shard| {
            let (seen, changed) = shard.claim(&EV, &[1, 2], &[100, 100], 10, 0, LIMITS);
            (seen, changed)
        })
        .unwrap();
        assert_eq!(a.value, vec![Seen::InProgress; 2]);
        assert_eq!(
            a.store_calls, 3,
            "get, failed set, get (nothing left to write)"
        );
    }

    // A settle racing another event's insert in the same shard: nothing is lost.
    #[test]
    fn a_race_on_one_shard_loses_no_record() {
        let store = MemStore::default();
        store.set("k", &[], None).unwrap();
        let racy = RacyStore {
            inner: &store,
            races: Cell::new(3),
            rival: Box::new(|s: &MemStore| {
                let n = s.data.borrow().get("k").map_or(0, |(v, _)| v.len());
                let key = format!("rival-{n}");
                update(s, "k", |shard| {
                    let ev = Event {
                        channel: "orders",
                        key: key.as_bytes(),
                    };
                    let big = Limits {
                        capacity: 100,
                        ttl_ms: 1000,
                    };
                    (shard.settle(&ev, &[(1, true)], 20, 0, big), true)
                })
                .unwrap();
            }),
        };
        let big = Limits {
            capacity: 100,
            ttl_ms: 1000,
        };
        let mine = update(&racy, "k", |shard| {
            ((), shard.settle(&EV, &[(1, true)], 10, 0, big))
        })
        .unwrap();
        assert_eq!(mine.store_calls, 8, "four rounds of get+set");
        let shard = Shard::decode(&store.get("k").0.unwrap()).unwrap();
        assert_eq!(shard.entries.len(), 4, "three rivals and mine: {shard:?}");
    }

    #[test]
    fn endless_contention_gives_up() {
        let store = MemStore::default();
        store.set("k", &[], None).unwrap();
        let racy = RacyStore {
            inner: &store,
            races: Cell::new(u32::MAX),
            rival: Box::new(|s: &MemStore| {
                let _ = s.set("k", &[], None);
            }),
        };
        let result = update(&racy, "k", |_| ((), true));
        assert_eq!(
            result,
            Err(Contended {
                store_calls: 2 * MAX_ATTEMPTS
            })
        );
    }

    #[test]
    fn a_corrupt_value_is_replaced() {
        let store = MemStore::default();
        store.set("k", b"garbage", None).unwrap();
        let done = update(&store, "k", |_| ((), false)).unwrap();
        assert!(done.replaced_corrupt);
        assert_eq!(store.get("k").0.unwrap(), Shard::default().encode());
    }

    #[test]
    fn create_shards_creates_only_missing_keys() {
        let store = MemStore::default();
        let config = DedupeConfig {
            key: Identity::CloudEvent,
            ttl_ms: 1,
            max_entries: 100,
        };
        store.set(&shard_key(1), b"keep", None).unwrap();
        assert_eq!(create_shards(&store, &config), 4 + 3);
        assert_eq!(store.get(&shard_key(1)).0.unwrap(), b"keep");
        assert_eq!(store.get(&shard_key(3)).0.unwrap(), b"");
        assert_eq!(create_shards(&store, &config), 4);
    }

    #[test]
    fn cloudevent_keys_never_mix_up_two_identities() {
        assert_eq!(cloudevent_key(b"/orders", b"1").unwrap(), b"7:/orders1");
        // The same id from two sources, and pairs whose concatenations are equal.
        let pairs: &[(&[u8], &[u8])] = &[
            (b"/a", b"1"),
            (b"/b", b"1"),
            (b"/a", b"b1"),
            (b"/ab", b"1"),
            (b"/a1", b"1"),
            (b"1:/a", b"1"),
            (b"/", b"2:/a1"),
            (b"2:/a", b"1"),
        ];
        let keys: Vec<Vec<u8>> = pairs
            .iter()
            .map(|(source, id)| cloudevent_key(source, id).unwrap())
            .collect();
        for (i, a) in keys.iter().enumerate() {
            for (j, b) in keys.iter().enumerate() {
                assert_eq!(i == j, a == b, "{:?} and {:?}", pairs[i], pairs[j]);
            }
        }
        assert_eq!(cloudevent_key(b"", b"1"), None);
        assert_eq!(cloudevent_key(b"/a", b""), None);
        // The whole key counts against MAX_KEY_BYTES.
        let source = vec![b's'; MAX_KEY_BYTES - 5];
        assert_eq!(cloudevent_key(&source, b"1").unwrap().len(), MAX_KEY_BYTES);
        assert_eq!(cloudevent_key(&source, b"12"), None);
    }

    #[test]
    fn header_keys_are_the_value_within_bounds() {
        assert_eq!(header_key(b"e1").unwrap(), b"e1");
        assert_eq!(header_key(b""), None);
        assert!(header_key(&[b'k'; MAX_KEY_BYTES]).is_some());
        assert_eq!(header_key(&[b'k'; MAX_KEY_BYTES + 1]), None);
    }

    /// The CPU cost of dedupe's pure part per request: claim and settle on a full shard (32
    /// events, 3 subscribers each), with encode/decode, against an in-memory store. Run with
    /// `cargo test --release --lib dedupe_cost -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn dedupe_cost_per_request() {
        let store = MemStore::default();
        let limits = Limits {
            capacity: 32,
            ttl_ms: u64::MAX / 2,
        };
        let ids = [11, 22, 33];
        let until = [u64::MAX / 2; 3];
        let n = 100_000u64;
        let start = std::time::Instant::now();
        let mut bytes = 0;
        for i in 0..n {
            let key = format!("0b8e4c8a-2f7e-4a51-9d4c-{i:012}");
            let event = Event {
                channel: "default/orders",
                key: key.as_bytes(),
            };
            update(&store, "k", |s| s.claim(&event, &ids, &until, i, i, limits)).unwrap();
            update(&store, "k", |s| {
                let outcomes = [(11, true), (22, true), (33, true)];
                ((), s.settle(&event, &outcomes, i, i, limits))
            })
            .unwrap();
            bytes = store.get("k").0.map_or(0, |v| v.len());
        }
        let per = start.elapsed() / n as u32;
        eprintln!("dedupe claim+settle on a full shard ({bytes} bytes): {per:?} per request");
    }
}
