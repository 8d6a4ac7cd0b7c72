//! The `etcd` store: one dedupe memory for every replica, through etcd's v3 gRPC API
//! (`etcdserverpb.KV/Txn`, `etcdserverpb.Lease/LeaseGrant`), reached with Envoy calls to an
//! ordinary HTTP/2 cluster of etcd members. Pure: the keys and values, the request bodies,
//! the reading of etcd's answers ([`proto`] has the messages), and the leases the keys are
//! written with ([`lease`]); the calls are made by `claim`, `settle` and
//! [`Remote`](super::remote::Remote)'s owner.
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
//!
//! Why gRPC and not etcd's HTTP/JSON gateway (`/v3/kv/txn`): the gateway turns JSON into the
//! same messages and calls etcd's gRPC server over a loopback connection of its own, which
//! cost etcd about three times the CPU per event, and the event its latency
//! (docs/performance.md, "Dedupe stores").

use prost::Message;

use super::Seen;
use proto::{
    frame, unframe, Against, Compare, DeleteRangeRequest, LeaseGrantRequest, LeaseGrantResponse,
    PutRequest, RangeRequest, Request, RequestOp, Response, TxnRequest, TxnResponse,
};
pub use proto::{GRANT_PATH, TXN_PATH};

pub mod lease;
pub mod proto;

pub use lease::{Family, Grant, Leases};

/// Digits of the time at the start of every value.
const TIME_DIGITS: usize = 20;
const CLAIMED: u8 = b'c';
const DELIVERED: u8 = b'd';

/// The key of one subscriber's mark of one event.
pub fn key(prefix: &str, channel: &str, event_key: &[u8], subscriber: u64) -> Vec<u8> {
    let mut key = Vec::with_capacity(prefix.len() + channel.len() + event_key.len() + 24);
    key.extend_from_slice(prefix.as_bytes());
    push_decimal(&mut key, channel.len() as u64);
    key.push(b':');
    key.extend_from_slice(channel.as_bytes());
    key.push(b'/');
    key.extend_from_slice(event_key);
    key.push(b'/');
    push_hex16(&mut key, subscriber);
    key
}

// The keys and values are built by hand, not with `format!`: they are per-subscriber work on
// every event, and the formatting machinery costs several times as many instructions in wasm.

/// `n` in 20 decimal digits, zero-padded (a u64 has at most 20).
fn push_time(out: &mut Vec<u8>, n: u64) {
    let mut digits = [0u8; TIME_DIGITS];
    push_time_into(&mut digits, n);
    out.extend_from_slice(&digits);
}

fn push_time_into(digits: &mut [u8; TIME_DIGITS], n: u64) {
    let mut rest = n;
    for digit in digits.iter_mut().rev() {
        *digit = b'0' + (rest % 10) as u8;
        rest /= 10;
    }
}

/// `n` in decimal, as few digits as it takes.
fn push_decimal(out: &mut Vec<u8>, n: u64) {
    let mut digits = [0u8; TIME_DIGITS];
    push_time_into(&mut digits, n);
    let first = digits
        .iter()
        .position(|d| *d != b'0')
        .unwrap_or(TIME_DIGITS - 1);
    out.extend_from_slice(digits.get(first..).unwrap_or_default());
}

/// `n` in 16 lowercase hex digits, zero-padded.
fn push_hex16(out: &mut Vec<u8>, n: u64) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for shift in (0..16).rev() {
        let nibble = (n >> (shift * 4)) & 0xf;
        out.push(HEX.get(nibble as usize).copied().unwrap_or(b'0'));
    }
}

fn value(until_ms: u64, kind: u8, owner: Option<u64>) -> String {
    let mut out = Vec::with_capacity(TIME_DIGITS + 17);
    push_time(&mut out, until_ms);
    out.push(kind);
    if let Some(owner) = owner {
        push_hex16(&mut out, owner);
    }
    // Digits, hex digits and ASCII letters only.
    String::from_utf8(out).unwrap_or_default()
}

/// A claim by `owner`, lapsing at `until_ms`.
pub fn claim_value(until_ms: u64, owner: u64) -> String {
    value(until_ms, CLAIMED, Some(owner))
}

/// A record: the subscriber took the event; forgotten at `until_ms`.
pub fn delivered_value(until_ms: u64) -> String {
    value(until_ms, DELIVERED, None)
}

/// Every value below this one has lapsed at `now_ms` (its time is at most `now_ms`).
fn lapsed_below(now_ms: u64) -> String {
    value(now_ms, b'~', None)
}

/// One claim to make: the key, our value for it, the lease it is written with, and the time
/// of the request that makes it (values below it have lapsed).
pub struct ClaimOp<'a> {
    pub key: &'a [u8],
    pub value: &'a str,
    pub lease: i64,
    pub now_ms: u64,
}

fn op(request: Request) -> RequestOp {
    RequestOp {
        request: Some(request),
    }
}

fn put(key: &[u8], value: &[u8], lease: i64) -> RequestOp {
    op(Request::Put(PutRequest {
        key: key.to_vec(),
        value: value.to_vec(),
        lease,
    }))
}

fn compare(key: &[u8], result: i32, target: i32, against: Against) -> Compare {
    Compare {
        result,
        target,
        key: key.to_vec(),
        against: Some(against),
    }
}

/// The claim txn: for each key, create it, or take it over if its value lapsed, or read it.
/// gRPC-framed, ready to send. (The ops of several requests make one txn: no key twice.)
pub fn claim_body(ops: &[ClaimOp<'_>]) -> Vec<u8> {
    let success = ops
        .iter()
        .map(|c| {
            let value = c.value.as_bytes();
            let lease = c.lease;
            let take_over = TxnRequest {
                compare: vec![compare(
                    c.key,
                    proto::LESS,
                    proto::VALUE,
                    Against::Value(lapsed_below(c.now_ms).into_bytes()),
                )],
                success: vec![put(c.key, value, lease)],
                failure: vec![op(Request::Range(RangeRequest {
                    key: c.key.to_vec(),
                }))],
            };
            op(Request::Txn(TxnRequest {
                compare: vec![compare(
                    c.key,
                    proto::EQUAL,
                    proto::CREATE,
                    Against::CreateRevision(0),
                )],
                success: vec![put(c.key, value, lease)],
                failure: vec![op(Request::Txn(take_over))],
            }))
        })
        .collect();
    frame(&TxnRequest {
        compare: Vec::new(),
        success,
        failure: Vec::new(),
    })
}

/// The settle txn: `delivered` keys get their record (with `lease`), `released` keys are
/// deleted if their value is still the claim given. gRPC-framed.
pub fn settle_body(delivered: &[(&[u8], &str)], released: &[(&[u8], &str)], lease: i64) -> Vec<u8> {
    let puts = delivered
        .iter()
        .map(|(key, value)| put(key, value.as_bytes(), lease));
    let deletes = released.iter().map(|(key, claim)| {
        op(Request::Txn(TxnRequest {
            compare: vec![compare(
                key,
                proto::EQUAL,
                proto::VALUE,
                Against::Value(claim.as_bytes().to_vec()),
            )],
            success: vec![op(Request::DeleteRange(DeleteRangeRequest {
                key: key.to_vec(),
            }))],
            failure: Vec::new(),
        }))
    });
    frame(&TxnRequest {
        compare: Vec::new(),
        success: puts.chain(deletes).collect(),
        failure: Vec::new(),
    })
}

/// A lease grant of `ttl_s` seconds. gRPC-framed.
pub fn grant_body(ttl_s: u64) -> Vec<u8> {
    frame(&LeaseGrantRequest {
        ttl: i64::try_from(ttl_s).unwrap_or(i64::MAX),
    })
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

/// The answer to an etcd call as the host gave it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reply {
    /// Its `:status`; `None`: no answer came (reset, timeout, no endpoint).
    pub status: Option<u16>,
    /// `grpc-status` and `grpc-message`, from the trailers (or the headers, for an answer
    /// that is only trailers: how gRPC servers send an error).
    pub grpc_status: Option<String>,
    pub grpc_message: Option<String>,
    pub body: Vec<u8>,
}

/// The message of a successful answer, or what went wrong.
pub fn read_answer(reply: &Reply) -> Result<&[u8], StoreError> {
    let Some(status) = reply.status else {
        return Err(StoreError(
            "no answer (unreachable, reset or timed out)".into(),
        ));
    };
    if status != 200 {
        // Not etcd's gRPC server: Envoy's own answer (no healthy upstream), or a cluster
        // that speaks HTTP/1.1 to etcd, whose gateway does not know the gRPC paths.
        return Err(StoreError(format!(
            "etcd answered {status}: {} (fanout speaks etcd's gRPC API: the cluster must \
             speak HTTP/2, with http2_protocol_options)",
            crate::answer::sanitize(&reply.body, 200)
        )));
    }
    match reply.grpc_status.as_deref() {
        Some("0") => {}
        Some(code) => {
            let message = reply.grpc_message.as_deref().unwrap_or("");
            let message = percent_encoding::percent_decode_str(message).decode_utf8_lossy();
            return Err(StoreError(format!(
                "etcd answered gRPC status {code}: {}",
                crate::answer::sanitize(message.as_bytes(), 200)
            )));
        }
        None => return Err(bad("no grpc-status")),
    }
    unframe(&reply.body).map_err(bad)
}

fn bad(what: &str) -> StoreError {
    StoreError(format!("etcd's answer does not read: {what}"))
}

fn txn_response(message: &[u8]) -> Result<TxnResponse, StoreError> {
    TxnResponse::decode(message).map_err(|_| bad("not a TxnResponse"))
}

/// The first response of a txn, if it is a nested txn's.
fn nested_txn(txn: &TxnResponse) -> Option<&TxnResponse> {
    match txn.responses.first()?.response.as_ref()? {
        Response::Txn(nested) => Some(nested),
        _ => None,
    }
}

/// What the claim txn found, for each of its `n` keys in order.
pub fn read_claim(message: &[u8], n: usize) -> Result<Vec<Seen>, StoreError> {
    let txn = txn_response(message)?;
    if txn.responses.len() != n {
        return Err(bad("not one response per subscriber"));
    }
    txn.responses
        .iter()
        .map(|response| {
            let Some(Response::Txn(created)) = &response.response else {
                return Err(bad("no response_txn"));
            };
            if created.succeeded {
                return Ok(Seen::Deliver);
            }
            let taken = nested_txn(created).ok_or_else(|| bad("no nested response_txn"))?;
            if taken.succeeded {
                return Ok(Seen::Deliver);
            }
            let Some(Response::Range(range)) =
                taken.responses.first().and_then(|r| r.response.as_ref())
            else {
                return Err(bad("no response_range"));
            };
            let value = range.kvs.first().map(|kv| kv.value.as_slice());
            match value.and_then(|v| v.get(TIME_DIGITS)) {
                Some(&DELIVERED) => Ok(Seen::AlreadyDelivered),
                Some(&CLAIMED) => Ok(Seen::InProgress),
                _ => Err(bad("a value fanout did not write")),
            }
        })
        .collect()
}

/// Whether a txn answer says it was applied (the settle's has no compare of its own).
pub fn read_txn_ok(message: &[u8]) -> Result<(), StoreError> {
    match txn_response(message)?.header {
        Some(_) => Ok(()),
        None => Err(bad("no header")),
    }
}

/// A granted lease's id.
pub fn read_grant(message: &[u8]) -> Result<i64, StoreError> {
    let grant = LeaseGrantResponse::decode(message).map_err(|_| bad("not a LeaseGrantResponse"))?;
    if !grant.error.is_empty() {
        return Err(StoreError(format!(
            "etcd refused the lease: {}",
            crate::answer::sanitize(grant.error.as_bytes(), 200)
        )));
    }
    if grant.id == 0 {
        return Err(bad("no lease ID"));
    }
    Ok(grant.id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoded(body: &[u8]) -> TxnRequest {
        TxnRequest::decode(unframe(body).unwrap()).unwrap()
    }

    fn nested(op: &RequestOp) -> &TxnRequest {
        match &op.request {
            Some(Request::Txn(txn)) => txn,
            other => panic!("not a txn: {other:?}"),
        }
    }

    #[test]
    fn the_claim_creates_or_takes_over_or_reads_each_key() {
        let keys: Vec<Vec<u8>> = (0..2u64)
            .map(|i| key("/fanout/", "default/orders", b"ev\xff-1", i * 77))
            .collect();
        let values: Vec<String> = (0..2u64).map(|i| claim_value(1_000 + i, 0xbeef)).collect();
        let ops: Vec<ClaimOp<'_>> = keys
            .iter()
            .zip(&values)
            .map(|(key, value)| ClaimOp {
                key,
                value,
                lease: 7_587_868_122_391_046_144,
                now_ms: 123_456,
            })
            .collect();
        let txn = decoded(&claim_body(&ops));
        assert!(txn.compare.is_empty() && txn.failure.is_empty());
        assert_eq!(txn.success.len(), 2);
        for (i, op) in txn.success.iter().enumerate() {
            let create = nested(op);
            assert_eq!(
                create.compare,
                [compare(
                    &keys[i],
                    proto::EQUAL,
                    proto::CREATE,
                    Against::CreateRevision(0)
                )]
            );
            let mine = put(&keys[i], values[i].as_bytes(), 7_587_868_122_391_046_144);
            assert_eq!(create.success, std::slice::from_ref(&mine));
            let take_over = nested(&create.failure[0]);
            assert_eq!(
                take_over.compare,
                [compare(
                    &keys[i],
                    proto::LESS,
                    proto::VALUE,
                    Against::Value(b"00000000000000123456~".to_vec())
                )]
            );
            assert_eq!(take_over.success, [mine]);
            assert_eq!(take_over.failure, [op_range(&keys[i])]);
        }
        assert!(decoded(&claim_body(&[])).success.is_empty());
    }

    fn op_range(key: &[u8]) -> RequestOp {
        op(Request::Range(RangeRequest { key: key.to_vec() }))
    }

    #[test]
    fn the_settle_puts_records_and_deletes_claims_still_ours() {
        let d: Vec<(&[u8], &str)> = vec![(b"a", "x"), (b"b", "yy")];
        let r: Vec<(&[u8], &str)> = vec![(b"c", "mine")];
        let txn = decoded(&settle_body(&d, &r, 42));
        assert_eq!(txn.success.len(), 3);
        assert_eq!(txn.success[0], put(b"a", b"x", 42));
        assert_eq!(txn.success[1], put(b"b", b"yy", 42));
        let delete = nested(&txn.success[2]);
        assert_eq!(
            delete.compare,
            [compare(
                b"c",
                proto::EQUAL,
                proto::VALUE,
                Against::Value(b"mine".to_vec())
            )]
        );
        assert_eq!(
            delete.success,
            [op(Request::DeleteRange(DeleteRangeRequest {
                key: b"c".to_vec()
            }))]
        );
        assert!(decoded(&settle_body(&[], &[], 5)).success.is_empty());
    }

    #[test]
    fn an_answer_reads_only_with_status_200_and_grpc_status_0() {
        let ok = Reply {
            status: Some(200),
            grpc_status: Some("0".into()),
            grpc_message: None,
            body: frame(&TxnResponse::default()),
        };
        assert_eq!(read_answer(&ok), Ok(&[][..]));
        let lost = Reply {
            grpc_status: Some("5".into()),
            grpc_message: Some("etcdserver: requested lease not found".into()),
            body: Vec::new(),
            ..ok.clone()
        };
        let error = read_answer(&lost).unwrap_err();
        assert!(error.lease_lost(), "{error}");
        assert_eq!(
            error.0,
            "etcd answered gRPC status 5: etcdserver: requested lease not found"
        );
        let encoded = Reply {
            grpc_status: Some("14".into()),
            grpc_message: Some("no%20leader%0A".into()),
            ..lost.clone()
        };
        assert_eq!(
            read_answer(&encoded).unwrap_err().0,
            "etcd answered gRPC status 14: no leader"
        );
        let http1 = Reply {
            status: Some(404),
            grpc_status: None,
            body: b"Not Found".to_vec(),
            ..ok.clone()
        };
        assert!(read_answer(&http1)
            .unwrap_err()
            .0
            .starts_with("etcd answered 404: Not Found (fanout speaks etcd's gRPC API"));
        let untold = Reply {
            grpc_status: None,
            ..ok.clone()
        };
        assert_eq!(
            read_answer(&untold).unwrap_err().0,
            "etcd's answer does not read: no grpc-status"
        );
        assert!(read_answer(&Reply::default())
            .unwrap_err()
            .0
            .starts_with("no answer"));
    }

    #[test]
    fn a_grant_without_an_id_or_with_an_error_is_refused() {
        let grant = |id, error: &str| {
            LeaseGrantResponse {
                id,
                ttl: 67,
                error: error.into(),
            }
            .encode_to_vec()
        };
        assert_eq!(
            read_grant(&grant(7_587_884_271_138_411_786, "")),
            Ok(7_587_884_271_138_411_786)
        );
        assert!(read_grant(&grant(0, "")).is_err());
        assert!(read_grant(&grant(5, "too many"))
            .unwrap_err()
            .0
            .contains("too many"));
        assert!(read_grant(b"\xff\xff").is_err());
    }

    #[test]
    fn keys_never_mix_two_events_or_channels() {
        let a = key("/f/", "ab", b"c", 1);
        let b = key("/f/", "a", b"bc", 1);
        assert_ne!(a, b);
        assert_eq!(a, b"/f/2:ab/c/0000000000000001");
    }

    #[test]
    fn keys_and_values_are_what_format_writes() {
        for n in [0, 1, 9, 10, 123_456_789, u64::MAX / 3, u64::MAX] {
            assert_eq!(
                claim_value(n, n ^ 0xabc),
                format!("{n:020}c{:016x}", n ^ 0xabc)
            );
            assert_eq!(delivered_value(n), format!("{n:020}d"));
            assert_eq!(lapsed_below(n), format!("{n:020}~"));
            let k = key("/p/", "ch", b"ev", n);
            assert_eq!(k, format!("/p/2:ch/ev/{n:016x}").into_bytes());
            let mut d = Vec::new();
            push_decimal(&mut d, n);
            assert_eq!(d, n.to_string().into_bytes());
        }
    }

    #[test]
    fn values_compare_by_time() {
        let below = lapsed_below(1000);
        assert!(claim_value(999, 7).as_str() < below.as_str());
        assert!(delivered_value(1000).as_str() < below.as_str());
        assert!(delivered_value(1001).as_str() > below.as_str());
        assert!(claim_value(1001, u64::MAX).as_str() > below.as_str());
    }
}
