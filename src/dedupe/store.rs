//! The store behind dedupe ([`SharedStore`]: Envoy's shared data, or a fake) and the CAS loop
//! every change goes through ([`update`]).

use super::{shard_key, Corrupt, Shard, MAX_ATTEMPTS};
use crate::config::DedupeConfig;
pub use crate::host::{CasMismatch, SharedStore};

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
