//! The `dedupe` settings: what names an event, how long and how many events are kept, and
//! what follows from them at configure time: the shard ring, the memory bound, and every
//! subscriber's identity in the store. `config` reads the raw settings and keeps the
//! validated ones; the store and its orchestration (`dedupe/`) use them.

#[cfg(test)]
use serde::Deserialize;

use crate::headers;

/// `"dedupe": {"ttl_ms": 600000, "max_entries": 100000}` (and `"key": "<header>"` to name
/// events by a header instead of their CloudEvents identity); off when absent.
#[derive(Debug, Default)]
#[cfg_attr(test, derive(Deserialize), serde(deny_unknown_fields))]
pub struct RawDedupe {
    pub(crate) key: Option<String>,
    pub(crate) ttl_ms: Option<u64>,
    pub(crate) max_entries: Option<u32>,
    pub(crate) store: Option<RawStore>,
    pub(crate) on_store_error: Option<OnStoreError>,
}

/// `"store": "envoy"` or `"store": {"etcd": {...}}`.
#[derive(Debug)]
#[cfg_attr(test, derive(Deserialize), serde(rename_all = "lowercase"))]
pub enum RawStore {
    Envoy,
    Etcd(RawEtcd),
}

/// `{"cluster": "etcd", "prefix": "/fanout/", "timeout_ms": 250}`.
#[derive(Debug, Default)]
#[cfg_attr(test, derive(Deserialize), serde(deny_unknown_fields))]
pub struct RawEtcd {
    pub(crate) cluster: Option<String>,
    pub(crate) prefix: Option<String>,
    pub(crate) timeout_ms: Option<u32>,
}

/// Where the records and claims are kept.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Store {
    /// Envoy's shared data: one process, all its workers.
    #[default]
    Envoy,
    /// An etcd cluster: every replica, across restarts.
    Etcd(EtcdStore),
}

/// The validated `store.etcd`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdStore {
    /// The Envoy cluster of etcd's members.
    pub cluster: String,
    /// Every key fanout writes starts with it.
    pub prefix: String,
    /// Per etcd call.
    pub timeout_ms: u32,
}

/// What an event gets when the store cannot answer (`on_store_error`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(test, derive(Deserialize), serde(rename_all = "lowercase"))]
pub enum OnStoreError {
    /// Everyone is called, as if dedupe were off.
    #[default]
    Deliver,
    /// 503 with `retry-after`, nobody called.
    Reject,
}

pub const DEFAULT_ETCD_PREFIX: &str = "/fanout/";
pub const DEFAULT_ETCD_TIMEOUT_MS: u32 = 250;

/// A `dedupe` setting refused: the field's path and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    pub path: String,
    pub message: String,
}

impl Invalid {
    fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Invalid {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// Events per shard at most: bounds the bytes copied per store access.
pub const SHARD_CAPACITY: u32 = 32;
/// Event keys longer than this are not deduplicated (fanned out as if they had no key).
pub const MAX_KEY_BYTES: usize = 256;
/// The largest `max_entries` accepted.
pub const MAX_ENTRIES_LIMIT: u32 = 1_000_000;
/// The longest `ttl_ms` accepted: 7 days.
pub const MAX_TTL_MS: u64 = 7 * 24 * 3600 * 1000;

/// The validated `dedupe` configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DedupeConfig {
    /// What names an event.
    pub key: Identity,
    pub ttl_ms: u64,
    pub max_entries: u32,
    pub store: Store,
    pub on_store_error: OnStoreError,
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
/// configuration update that reorders or adds subscribers, or writes a subscriber's headers
/// in another order (a JSON object's keys have none: a tool that writes them sorted must not
/// make every subscriber new). Two identical subscribers get different identities (the
/// second hashes its occurrence too).
/// Each subscriber is given as its cluster and its own headers.
pub fn subscriber_ids<'a>(
    subscribers: impl ExactSizeIterator<Item = (&'a str, &'a [(String, String)])>,
) -> Vec<u64> {
    let mut ids: Vec<u64> = Vec::with_capacity(subscribers.len());
    for (cluster, call_headers) in subscribers {
        let mut h = Fnv::new();
        // The pseudo-headers (`:method`, `:path`, `:authority`) come first, in the order the
        // core writes them; the subscriber's own headers after them, sorted. (With one own
        // header or none, the identity is what it was when their order counted.)
        let own = call_headers
            .iter()
            .position(|(name, _)| !name.starts_with(':'))
            .unwrap_or(call_headers.len());
        let (pseudo, own) = call_headers.split_at(own);
        let mut sorted: Vec<&(String, String)> = own.iter().collect();
        sorted.sort_unstable();
        for (name, value) in pseudo.iter().chain(sorted) {
            h.write(name.as_bytes());
            h.write(&[0]);
            h.write(value.as_bytes());
            h.write(&[0]);
        }
        h.write(cluster.as_bytes());
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

/// Defaults of `dedupe` (without `key`, events are named by their CloudEvents identity).
pub const DEFAULT_DEDUPE_TTL_MS: u64 = 600_000;
pub const DEFAULT_DEDUPE_MAX_ENTRIES: u32 = 100_000;

impl RawDedupe {
    pub fn validate(self) -> Result<DedupeConfig, Invalid> {
        let key = match self.key {
            None => Identity::CloudEvent,
            Some(name) => {
                let name = name.to_ascii_lowercase();
                if name.is_empty() || !name.bytes().all(headers::is_token_byte) {
                    return Err(Invalid::new(
                        "dedupe.key",
                        format!(
                            "\"{name}\" is not a header name, e.g. \"x-event-id\" (leave `key` out \
                             to name events by their CloudEvents source and id)"
                        ),
                    ));
                }
                Identity::Header(name)
            }
        };
        let ttl_ms = self.ttl_ms.unwrap_or(DEFAULT_DEDUPE_TTL_MS);
        if !(1..=MAX_TTL_MS).contains(&ttl_ms) {
            return Err(Invalid::new(
                "dedupe.ttl_ms",
                format!("must be from 1 to {MAX_TTL_MS} (7 days), got {ttl_ms}"),
            ));
        }
        let max_entries = self.max_entries.unwrap_or(DEFAULT_DEDUPE_MAX_ENTRIES);
        if !(1..=MAX_ENTRIES_LIMIT).contains(&max_entries) {
            return Err(Invalid::new(
                "dedupe.max_entries",
                format!("must be from 1 to {MAX_ENTRIES_LIMIT}, got {max_entries}"),
            ));
        }
        let store = match self.store {
            None | Some(RawStore::Envoy) => Store::Envoy,
            Some(RawStore::Etcd(etcd)) => Store::Etcd(etcd.validate()?),
        };
        Ok(DedupeConfig {
            key,
            ttl_ms,
            max_entries,
            store,
            on_store_error: self.on_store_error.unwrap_or_default(),
        })
    }
}

impl RawEtcd {
    fn validate(self) -> Result<EtcdStore, Invalid> {
        const AT: &str = "dedupe.store.etcd";
        let cluster = match self.cluster {
            Some(cluster) if !cluster.is_empty() => cluster,
            _ => {
                return Err(Invalid::new(
                    format!("{AT}.cluster"),
                    "required: the Envoy cluster of the etcd members",
                ))
            }
        };
        let prefix = self.prefix.unwrap_or_else(|| DEFAULT_ETCD_PREFIX.into());
        if !prefix.starts_with('/') {
            return Err(Invalid::new(
                format!("{AT}.prefix"),
                format!("must start with \"/\", got \"{prefix}\""),
            ));
        }
        let timeout_ms = self.timeout_ms.unwrap_or(DEFAULT_ETCD_TIMEOUT_MS);
        if timeout_ms == 0 {
            return Err(Invalid::new(
                format!("{AT}.timeout_ms"),
                "must be at least 1 (ms, per etcd call)",
            ));
        }
        Ok(EtcdStore {
            cluster,
            prefix,
            timeout_ms,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn shards_add_up_to_max_entries() {
        for max_entries in [1, 31, 32, 33, 100, 1000, 100_000, MAX_ENTRIES_LIMIT] {
            let config = DedupeConfig {
                key: Identity::CloudEvent,
                ttl_ms: 1,
                max_entries,
                store: Store::Envoy,
                on_store_error: OnStoreError::Deliver,
            };
            let total: usize = (0..config.shards()).map(|s| config.capacity(s)).sum();
            assert_eq!(total, max_entries as usize);
            assert!((0..config.shards()).all(|s| (1..=32).contains(&config.capacity(s))));
        }
        let config = DedupeConfig {
            key: Identity::CloudEvent,
            ttl_ms: 1,
            max_entries: 100_000,
            store: Store::Envoy,
            on_store_error: OnStoreError::Deliver,
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
        let config = Config::from_json(
            br#"{"channels": [
                {"name": "a", "hosts": ["a"], "subscribers": [{"cluster": "x"}, {"cluster": "y"}, {"cluster": "x"}]},
                {"name": "b", "hosts": ["b"], "subscribers": [{"cluster": "y"}, {"cluster": "x", "path": "/p"}]}
            ]}"#,
        )
        .unwrap();
        let ids = |c: usize| -> Vec<u64> {
            config.channels[c]
                .subscribers
                .iter()
                .map(|s| s.dedupe_id)
                .collect()
        };
        let (a, b) = (ids(0), ids(1));
        assert_eq!(a.len(), 3);
        assert!(a[0] != a[1] && a[0] != a[2] && a[1] != a[2]);
        // Reordered, a subscriber keeps its identity; a different path is another target.
        assert_eq!(a[1], b[0]);
        assert_ne!(a[0], b[1]);
    }

    /// A subscriber's headers written in another order (a JSON object's keys, re-serialized
    /// sorted) are the same subscriber; another value is another one. Found by the `config`
    /// fuzz target: the normalized form of a configuration meant other subscribers.
    #[test]
    fn a_subscribers_identity_does_not_depend_on_the_order_of_its_headers() {
        let id = |json: &str| {
            Config::from_json(json.as_bytes()).unwrap().channels[0].subscribers[0].dedupe_id
        };
        let written =
            id(r#"{"subscribers": [{"cluster": "a", "headers": {"X-A": "1", "-xa": "2"}}]}"#);
        let sorted =
            id(r#"{"subscribers": [{"cluster": "a", "headers": {"-xa": "2", "X-A": "1"}}]}"#);
        let other =
            id(r#"{"subscribers": [{"cluster": "a", "headers": {"-xa": "2", "X-A": "3"}}]}"#);
        assert_eq!(written, sorted);
        assert_ne!(written, other);
    }
}
