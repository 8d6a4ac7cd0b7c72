//! The `etcd` store: one dedupe memory for every replica, through etcd's HTTP/JSON gateway
//! (v3: `POST /v3/kv/txn`, `/v3/lease/grant`; keys and values base64), reached with Envoy
//! calls to an ordinary cluster. Pure: the keys and values, the request bodies, the reading
//! of etcd's answers, and the leases the keys are written with; the calls are made by
//! `claim`, `settle` and [`Remote`](super::remote::Remote)'s owner.
//!
//! - A key per (channel, event, subscriber): `<prefix><len>:<channel>/<event key>/<id hex>`.
//! - Its value starts with when it lapses, in ms on the writer's clock, 20 digits, then `c`
//!   and the owner (a claim: a request is calling the subscriber) or `d` (a record: it took
//!   the event). So `ttl_ms` and a claim's end are exact (to the replicas' clocks): etcd
//!   compares values as bytes, and a value below `<now>~` has lapsed.
//! - The claim is one txn, one nested txn per subscriber: the key does not exist
//!   (`create_revision == 0`) → put our claim; else, its value lapsed → put our claim; else
//!   range (the current value: delivered, or claimed by another request).
//! - The settle is one txn: put the record for each subscriber that took the event, delete
//!   the claim of each other one if it is still ours (its value unchanged).
//! - Every key is written with a lease shared by all the keys written in one time bucket
//!   (granted ahead by the root context), so a key is gone at most a bucket width (and a
//!   second of rounding) after its value lapsed: no sweeper, nothing accumulates.

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;

use super::Seen;
use crate::json::Node;

/// The gateway's paths.
pub const TXN_PATH: &str = "/v3/kv/txn";
pub const GRANT_PATH: &str = "/v3/lease/grant";

/// Digits of the time at the start of every value.
const TIME_DIGITS: usize = 20;
const CLAIMED: u8 = b'c';
const DELIVERED: u8 = b'd';

/// The key of one subscriber's mark of one event.
pub fn key(prefix: &str, channel: &str, event_key: &[u8], subscriber: u64) -> Vec<u8> {
    let mut key = Vec::with_capacity(prefix.len() + channel.len() + event_key.len() + 24);
    key.extend_from_slice(prefix.as_bytes());
    key.extend_from_slice(channel.len().to_string().as_bytes());
    key.push(b':');
    key.extend_from_slice(channel.as_bytes());
    key.push(b'/');
    key.extend_from_slice(event_key);
    key.extend_from_slice(format!("/{subscriber:016x}").as_bytes());
    key
}

/// A claim by `owner`, lapsing at `until_ms`.
pub fn claim_value(until_ms: u64, owner: u64) -> String {
    format!("{until_ms:020}c{owner:016x}")
}

/// A record: the subscriber took the event; forgotten at `until_ms`.
pub fn delivered_value(until_ms: u64) -> String {
    format!("{until_ms:020}d")
}

/// Every value below this one has lapsed at `now_ms` (its time is at most `now_ms`).
fn lapsed_below(now_ms: u64) -> String {
    format!("{now_ms:020}~")
}

/// One claim to make: the key and our value for it.
pub struct ClaimOp<'a> {
    pub key: &'a [u8],
    pub value: &'a str,
}

/// `{"request_put":{"key":"<k>","value":"<value, base64>","lease":"<lease>"}}`, `k` already
/// base64. (The bodies are built with `push_str`, not `format!`: it is per event work, and
/// the formatting machinery costs several times as many instructions in wasm.)
fn push_put(out: &mut String, k: &str, value: &[u8], lease: &str) {
    out.push_str("{\"request_put\":{\"key\":\"");
    out.push_str(k);
    out.push_str("\",\"value\":\"");
    BASE64.encode_string(value, out);
    out.push_str("\",\"lease\":\"");
    out.push_str(lease);
    out.push_str("\"}}");
}

/// The claim txn: for each key, create it, or take it over if its value lapsed, or read it.
pub fn claim_body(ops: &[ClaimOp<'_>], lease: i64, now_ms: u64) -> String {
    let below = BASE64.encode(lapsed_below(now_ms).as_bytes());
    let lease = lease.to_string();
    let mut out = String::with_capacity(16 + ops.len() * 640);
    let mut k = String::with_capacity(96);
    out.push_str("{\"success\":[");
    for (i, op) in ops.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        k.clear();
        BASE64.encode_string(op.key, &mut k);
        out.push_str("{\"request_txn\":{\"compare\":[{\"key\":\"");
        out.push_str(&k);
        out.push_str(
            "\",\"target\":\"CREATE\",\"create_revision\":\"0\",\"result\":\"EQUAL\"}],\
             \"success\":[",
        );
        push_put(&mut out, &k, op.value.as_bytes(), &lease);
        out.push_str("],\"failure\":[{\"request_txn\":{\"compare\":[{\"key\":\"");
        out.push_str(&k);
        out.push_str("\",\"target\":\"VALUE\",\"value\":\"");
        out.push_str(&below);
        out.push_str("\",\"result\":\"LESS\"}],\"success\":[");
        push_put(&mut out, &k, op.value.as_bytes(), &lease);
        out.push_str("],\"failure\":[{\"request_range\":{\"key\":\"");
        out.push_str(&k);
        out.push_str("\"}}]}}]}}");
    }
    out.push_str("]}");
    out
}

/// The settle txn: `delivered` keys get their record (with `lease`), `released` keys are
/// deleted if their value is still the claim given.
pub fn settle_body(delivered: &[(&[u8], &str)], released: &[(&[u8], &str)], lease: i64) -> String {
    let lease = lease.to_string();
    let mut out = String::with_capacity(16 + (delivered.len() + released.len()) * 220);
    let mut k = String::with_capacity(96);
    out.push_str("{\"success\":[");
    for (i, (key, value)) in delivered.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        k.clear();
        BASE64.encode_string(key, &mut k);
        push_put(&mut out, &k, value.as_bytes(), &lease);
    }
    for (i, (key, claim)) in released.iter().enumerate() {
        if i > 0 || !delivered.is_empty() {
            out.push(',');
        }
        k.clear();
        BASE64.encode_string(key, &mut k);
        out.push_str("{\"request_txn\":{\"compare\":[{\"key\":\"");
        out.push_str(&k);
        out.push_str("\",\"target\":\"VALUE\",\"value\":\"");
        BASE64.encode_string(claim.as_bytes(), &mut out);
        out.push_str(
            "\",\"result\":\"EQUAL\"}],\"success\":[{\"request_delete_range\":{\"key\":\"",
        );
        out.push_str(&k);
        out.push_str("\"}}]}}");
    }
    out.push_str("]}");
    out
}

/// A lease grant of `ttl_s` seconds.
pub fn grant_body(ttl_s: u64) -> String {
    format!("{{\"TTL\":\"{ttl_s}\"}}")
}

/// What went wrong with the store: unreachable, timing out, an error status, an answer that
/// does not read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreError(pub String);

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl StoreError {
    /// etcd no longer has the lease the keys were written with: the leases must be granted
    /// again.
    pub fn lease_lost(&self) -> bool {
        self.0.contains("lease not found")
    }
}

/// The answer to an etcd call as the host gave it: its `:status` (`None`: no answer came:
/// reset, timeout, no endpoint) and body.
pub fn read_answer(status: Option<u16>, body: &[u8]) -> Result<Node, StoreError> {
    let Some(status) = status else {
        return Err(StoreError(
            "no answer (unreachable, reset or timed out)".into(),
        ));
    };
    let node: Option<Node> = serde_json::from_slice(body).ok();
    if status != 200 {
        let detail = node
            .as_ref()
            .and_then(|n| field(n, "error").or_else(|| field(n, "message")))
            .and_then(Node::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| crate::answer::sanitize(body, 200));
        return Err(StoreError(format!("etcd answered {status}: {detail}")));
    }
    node.ok_or_else(|| StoreError("etcd's answer is not JSON".into()))
}

fn field<'n>(node: &'n Node, name: &str) -> Option<&'n Node> {
    match node {
        Node::Object(entries) => entries.iter().find(|(k, _)| k == name).map(|(_, v)| v),
        _ => None,
    }
}

/// A protobuf bool as the gateway writes it: absent when false.
fn flag(node: &Node, name: &str) -> bool {
    matches!(field(node, name), Some(Node::Bool(true)))
}

fn first_response<'n>(txn: &'n Node, kind: &str) -> Option<&'n Node> {
    match field(txn, "responses")? {
        Node::Array(items) => field(items.first()?, kind),
        _ => None,
    }
}

fn bad(what: &str) -> StoreError {
    StoreError(format!("etcd's answer does not read: {what}"))
}

/// What the claim txn found, for each of its `n` keys in order.
pub fn read_claim(answer: &Node, n: usize) -> Result<Vec<Seen>, StoreError> {
    let Some(Node::Array(responses)) = field(answer, "responses") else {
        return Err(bad("no responses"));
    };
    if responses.len() != n {
        return Err(bad("not one response per subscriber"));
    }
    responses
        .iter()
        .map(|response| {
            let created = field(response, "response_txn").ok_or_else(|| bad("no response_txn"))?;
            if flag(created, "succeeded") {
                return Ok(Seen::Deliver);
            }
            let taken = first_response(created, "response_txn")
                .ok_or_else(|| bad("no nested response_txn"))?;
            if flag(taken, "succeeded") {
                return Ok(Seen::Deliver);
            }
            let range =
                first_response(taken, "response_range").ok_or_else(|| bad("no response_range"))?;
            let value = match field(range, "kvs") {
                Some(Node::Array(kvs)) => kvs.first().and_then(|kv| field(kv, "value")),
                _ => None,
            };
            // A key that exists has a value (an empty one is written without the field).
            let value = value.and_then(Node::as_str).unwrap_or("");
            let value = BASE64
                .decode(value)
                .map_err(|_| bad("a value that is not base64"))?;
            match value.get(TIME_DIGITS) {
                Some(&DELIVERED) => Ok(Seen::AlreadyDelivered),
                Some(&CLAIMED) => Ok(Seen::InProgress),
                _ => Err(bad("a value fanout did not write")),
            }
        })
        .collect()
}

/// Whether a txn answer says it was applied (the settle's has no compare of its own).
pub fn read_txn_ok(answer: &Node) -> Result<(), StoreError> {
    match field(answer, "header") {
        Some(Node::Object(_)) => Ok(()),
        _ => Err(bad("no header")),
    }
}

/// A granted lease's id.
pub fn read_grant(answer: &Node) -> Result<i64, StoreError> {
    if let Some(Node::Str(error)) = field(answer, "error") {
        if !error.is_empty() {
            return Err(StoreError(format!("etcd refused the lease: {error}")));
        }
    }
    match field(answer, "ID") {
        Some(Node::Str(id)) => id
            .parse()
            .map_err(|_| bad("a lease ID that is not a number")),
        Some(Node::Unsigned(id)) => i64::try_from(*id).map_err(|_| bad("a lease ID too large")),
        _ => Err(bad("no lease ID")),
    }
}

/// A lease fanout holds, or asked for: until when the keys written with it may live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Lease {
    /// The end of the bucket it serves plus its horizon: every key written with it must
    /// lapse by then.
    until_ms: u64,
    /// `None` while the grant is in flight (its call's token).
    id: Option<i64>,
    token: Option<u32>,
}

/// A kind of lease: keys that must live `horizon_ms`, bucketed by `width_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Family {
    pub horizon_ms: u64,
    pub width_ms: u64,
}

impl Family {
    /// Buckets of a tenth of the horizon, from 1 s to 60 s.
    pub fn for_horizon(horizon_ms: u64) -> Family {
        Family {
            horizon_ms,
            width_ms: (horizon_ms / 10).clamp(1_000, 60_000),
        }
    }

    /// The `until` of the lease serving the bucket of `at_ms`.
    fn until_for(&self, at_ms: u64) -> u64 {
        let width = self.width_ms.max(1);
        (at_ms / width)
            .saturating_add(1)
            .saturating_mul(width)
            .saturating_add(self.horizon_ms)
    }
}

/// The leases of the etcd store, granted ahead of need by the root context's timer.
#[derive(Debug, Default)]
pub struct Leases {
    leases: Vec<Lease>,
    /// No grant is asked for before this (after a failed one).
    quiet_until_ms: u64,
}

/// A grant to send: its body, and the `until` it serves.
pub struct Grant {
    pub until_ms: u64,
    pub body: String,
}

impl Leases {
    /// Whether every lease asked for is granted, and there is one (no grant pending).
    pub fn all_granted(&self) -> bool {
        !self.leases.is_empty() && self.leases.iter().all(|l| l.id.is_some())
    }

    /// The granted lease that lives the least long while covering `until_ms`.
    pub fn pick(&self, until_ms: u64) -> Option<i64> {
        self.leases
            .iter()
            .filter(|l| l.until_ms >= until_ms)
            .filter_map(|l| l.id.map(|id| (l.until_ms, id)))
            .min()
            .map(|(_, id)| id)
    }

    /// The grants to ask for now: for each family, the leases of this bucket and the next
    /// that are neither held nor asked for. Forgets those past their `until`.
    pub fn wanted(&mut self, now_ms: u64, families: &[Family]) -> Vec<Grant> {
        self.leases.retain(|l| l.until_ms > now_ms);
        if now_ms < self.quiet_until_ms {
            return Vec::new();
        }
        let mut grants = Vec::new();
        for family in families {
            for at in [now_ms, now_ms.saturating_add(family.width_ms)] {
                let until_ms = family.until_for(at);
                if self.leases.iter().any(|l| l.until_ms == until_ms)
                    || grants.iter().any(|g: &Grant| g.until_ms == until_ms)
                {
                    continue;
                }
                // Counted from now (etcd counts from when it grants, later), rounded up,
                // plus a second.
                let ttl_s = until_ms.saturating_sub(now_ms).div_ceil(1000) + 1;
                grants.push(Grant {
                    until_ms,
                    body: grant_body(ttl_s),
                });
            }
        }
        grants
    }

    /// A grant for `until_ms` went out as call `token`.
    pub fn asked(&mut self, until_ms: u64, token: u32) {
        self.leases.push(Lease {
            until_ms,
            id: None,
            token: Some(token),
        });
    }

    /// Whether `token` is a grant's.
    pub fn is_grant(&self, token: u32) -> bool {
        self.leases.iter().any(|l| l.token == Some(token))
    }

    /// The answer to grant `token`.
    pub fn granted(&mut self, token: u32, result: Result<i64, StoreError>, now_ms: u64) {
        match result {
            Ok(id) => {
                for lease in self.leases.iter_mut().filter(|l| l.token == Some(token)) {
                    lease.id = Some(id);
                    lease.token = None;
                }
            }
            Err(_) => self.failed(token, now_ms),
        }
    }

    /// Grant `token` failed (or could not be sent): asked again in a second.
    pub fn failed(&mut self, token: u32, now_ms: u64) {
        self.leases.retain(|l| l.token != Some(token));
        self.quiet_until_ms = now_ms.saturating_add(1_000);
    }

    /// A grant could not even be sent.
    pub fn not_sent(&mut self, now_ms: u64) {
        self.quiet_until_ms = now_ms.saturating_add(1_000);
    }

    /// etcd lost them (a restored cluster): grant all again.
    pub fn forget(&mut self) {
        self.leases.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference_b64(bytes: &[u8]) -> String {
        BASE64.encode(bytes)
    }

    // The bodies as first written, with `format!`: the reference the hand-built ones must
    // match byte for byte.
    fn reference_claim_body(ops: &[ClaimOp<'_>], lease: i64, now_ms: u64) -> String {
        let below = reference_b64(lapsed_below(now_ms).as_bytes());
        let mut out = String::with_capacity(160 + ops.len() * 600);
        out.push_str("{\"success\":[");
        for (i, op) in ops.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let k = reference_b64(op.key);
            let put = format!(
                "{{\"request_put\":{{\"key\":\"{k}\",\"value\":\"{}\",\"lease\":\"{lease}\"}}}}",
                reference_b64(op.value.as_bytes())
            );
            out.push_str(&format!(
                "{{\"request_txn\":{{\"compare\":[{{\"key\":\"{k}\",\"target\":\"CREATE\",\
                 \"create_revision\":\"0\",\"result\":\"EQUAL\"}}],\"success\":[{put}],\
                 \"failure\":[{{\"request_txn\":{{\"compare\":[{{\"key\":\"{k}\",\
                 \"target\":\"VALUE\",\"value\":\"{below}\",\"result\":\"LESS\"}}],\
                 \"success\":[{put}],\"failure\":[{{\"request_range\":{{\"key\":\"{k}\"}}}}]}}}}]}}}}"
            ));
        }
        out.push_str("]}");
        out
    }
    fn reference_settle_body(
        delivered: &[(&[u8], &str)],
        released: &[(&[u8], &str)],
        lease: i64,
    ) -> String {
        let mut ops: Vec<String> = Vec::with_capacity(delivered.len() + released.len());
        for (key, value) in delivered {
            ops.push(format!(
                "{{\"request_put\":{{\"key\":\"{}\",\"value\":\"{}\",\"lease\":\"{lease}\"}}}}",
                reference_b64(key),
                reference_b64(value.as_bytes())
            ));
        }
        for (key, claim) in released {
            let k = reference_b64(key);
            ops.push(format!(
                "{{\"request_txn\":{{\"compare\":[{{\"key\":\"{k}\",\"target\":\"VALUE\",\
                 \"value\":\"{}\",\"result\":\"EQUAL\"}}],\"success\":[{{\"request_delete_range\":\
                 {{\"key\":\"{k}\"}}}}]}}}}",
                reference_b64(claim.as_bytes())
            ));
        }
        format!("{{\"success\":[{}]}}", ops.join(","))
    }

    #[test]
    fn the_bodies_are_the_reference_ones_byte_for_byte() {
        let keys: Vec<Vec<u8>> = (0..4u64)
            .map(|i| key("/fanout/", "default/orders", b"ev\xff-1", i * 77))
            .collect();
        let values: Vec<String> = (0..4u64)
            .map(|i| claim_value(1_000 + i, 0xdead_beef))
            .collect();
        let ops: Vec<ClaimOp<'_>> = keys
            .iter()
            .zip(&values)
            .map(|(key, value)| ClaimOp { key, value })
            .collect();
        for (ops, lease, now) in [
            (&ops[..], 7_587_868_122_391_046_144, 123_456),
            (&ops[..1], -1, 0),
        ] {
            assert_eq!(
                claim_body(ops, lease, now),
                reference_claim_body(ops, lease, now)
            );
        }
        assert_eq!(claim_body(&[], 1, 1), reference_claim_body(&[], 1, 1));
        let d: Vec<(&[u8], &str)> = vec![(&keys[0], "x"), (&keys[2], "yy")];
        let r: Vec<(&[u8], &str)> = vec![(&keys[1], &values[1]), (&keys[3], &values[3])];
        for (d, r, lease) in [
            (&d[..], &r[..], 42),
            (&[][..], &r[..], 0),
            (&d[..], &[][..], 5),
            (&[][..], &[][..], 5),
        ] {
            assert_eq!(settle_body(d, r, lease), reference_settle_body(d, r, lease));
            serde_json::from_str::<serde_json::Value>(&settle_body(d, r, lease)).unwrap();
        }
    }

    #[test]
    fn keys_never_mix_two_events_or_channels() {
        let a = key("/f/", "ab", b"c", 1);
        let b = key("/f/", "a", b"bc", 1);
        assert_ne!(a, b);
        assert_eq!(a, b"/f/2:ab/c/0000000000000001");
    }

    #[test]
    fn values_compare_by_time() {
        let below = lapsed_below(1000);
        assert!(claim_value(999, 7).as_str() < below.as_str());
        assert!(delivered_value(1000).as_str() < below.as_str());
        assert!(delivered_value(1001).as_str() > below.as_str());
        assert!(claim_value(1001, u64::MAX).as_str() > below.as_str());
    }

    #[test]
    fn leases_are_granted_per_bucket_ahead_and_picked_shortest() {
        let mut leases = Leases::default();
        let family = Family::for_horizon(10_000);
        assert_eq!(family.width_ms, 1_000);
        let grants = leases.wanted(500, &[family]);
        let untils: Vec<u64> = grants.iter().map(|g| g.until_ms).collect();
        assert_eq!(untils, [11_000, 12_000]);
        assert_eq!(grants[0].body, "{\"TTL\":\"12\"}");
        leases.asked(11_000, 1);
        leases.asked(12_000, 2);
        assert!(leases.wanted(600, &[family]).is_empty());
        assert_eq!(leases.pick(10_600), None, "not granted yet");
        leases.granted(1, Ok(41), 600);
        leases.granted(2, Ok(42), 600);
        assert_eq!(leases.pick(10_600), Some(41));
        assert_eq!(leases.pick(11_500), Some(42));
        assert_eq!(leases.pick(12_001), None);
        // The next bucket: one more grant; the first lease is kept until it ends.
        let grants = leases.wanted(1_000, &[family]);
        assert_eq!(grants.len(), 1);
        assert_eq!(grants[0].until_ms, 13_000);
        // A failed grant is asked again after a second.
        leases.asked(13_000, 3);
        leases.granted(3, Err(StoreError("down".into())), 1_000);
        assert!(leases.wanted(1_500, &[family]).is_empty());
        assert_eq!(leases.wanted(2_000, &[family]).len(), 2);
        leases.forget();
        assert_eq!(leases.pick(0), None);
    }
}
