//! Redelivery without duplicates: which subscribers already have an event, kept in a store
//! that every worker of an Envoy process shares, so that a sender's retry reaches only the
//! subscribers that did not take the event the first time.
//!
//! All of dedupe's state and orchestration is here (its settings are the configuration's,
//! `config/dedupe.rs`): the record format and the rules ([`Shard`], in `shard.rs`), the CAS
//! loop over Envoy's shared data ([`update`], in `store.rs`), the claims a request makes
//! before its calls (`claim.rs`) and their settling when its fan-out ends (`settle.rs`), the
//! etcd store (`etcd/`), and the one face both stores show the pipeline
//! ([`dedupe_store::DedupeStore`], behind which [`stores::Stores`] holds them). None of it
//! knows proxy-wasm. The `envoy` store is behind [`SharedStore`], which Envoy's shared data
//! implements (through the `Host`) and the tests fake.
//!
//! In short: records live in a fixed ring of shard keys of Envoy's shared data, created at
//! configure time (shared data has no delete); every change is get, change, set under CAS
//! ([`update`]), retried on a mismatch; a request claims the subscribers it calls before
//! calling them, and settles the claims when its fan-out ends. docs/dedupe.md has the
//! layout, the concurrency, the memory bound and the cost.

use crate::config::MAX_KEY_BYTES;

pub mod claim;
pub mod dedupe_store;
pub mod etcd;
pub mod settle;
pub mod stores;
// Its five indexing sites are in bounds by the shard format's own checks; they are the
// dedupe module's to rewrite (clippy::indexing_slicing is denied everywhere else).
#[allow(clippy::indexing_slicing)]
mod shard;
mod store;
pub use shard::{Corrupt, Entry, Limits, Mark, Seen, Shard, StoredEvent};
pub use store::{create_shards, update, CasMismatch, Contended, SharedStore, Updated};

/// Prefix of the shard keys in Envoy's shared data.
pub const SHARD_PREFIX: &str = "fanout.dedupe.slot.";
/// Get/set rounds before a store update gives up (only contention makes it retry).
pub const MAX_ATTEMPTS: u32 = 32;
/// How long a claim outlives its call's timeout, for a request that never settles it.
pub const CLAIM_MARGIN_MS: u64 = 5_000;

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

pub fn shard_key(shard: u32) -> String {
    format!("{SHARD_PREFIX}{shard}")
}

#[cfg(test)]
mod tests {
    use super::shard::FORMAT;
    use super::*;
    use crate::config::{DedupeConfig, Identity};
    use std::cell::{Cell, RefCell};
    use std::collections::HashMap;

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
    const EV: StoredEvent<'static> = StoredEvent {
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
        let other = StoredEvent {
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
            let ev = StoredEvent {
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
                store: Default::default(),
                on_store_error: Default::default(),
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
                    let ev = StoredEvent {
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
            store: Default::default(),
            on_store_error: Default::default(),
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
            let event = StoredEvent {
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
