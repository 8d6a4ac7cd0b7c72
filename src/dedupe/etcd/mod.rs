//! The `etcd` store: one dedupe memory for every replica, through etcd's v3 gRPC API
//! (`etcdserverpb.KV/Txn`, `etcdserverpb.Lease/LeaseGrant`), reached with Envoy calls to an
//! ordinary HTTP/2 cluster of etcd members. This file is pure: the keys and values, the
//! request bodies, the reading of etcd's answers ([`proto`] has the messages), and the leases
//! the keys are written with ([`lease`]), a call's headers. The calls are made by the store
//! as a worker keeps it ([`store::EtcdAgent`], behind `DedupeStore`): its claim stage
//! ([`claims`]) and its leases and settles ([`remote`]).
//!
//! - Two keys per (channel, event): `<prefix><len>:<channel>/<event key>/c`, the claim, and
//!   `.../d`, the records. So an event costs etcd three key writes (the claim, then the
//!   records and the claim's release), whatever its subscribers: etcd's cost is per key
//!   written (docs/performance.md, "Dedupe stores").
//! - The claim's value starts with when it lapses, in ms on the writer's clock, 20 digits,
//!   then `c` and the owner. So a claim's end is exact (to the replicas' clocks): etcd
//!   compares values as bytes, and a value below `<now>~` has lapsed.
//! - The records' value: `d`, then for each subscriber that took the event its id (16 hex
//!   digits) and when its record lapses (20 digits). A record past its time reads as absent,
//!   so `ttl_ms` is exact too.
//! - The claim is one txn, one nested txn per event: the claim key does not exist
//!   (`create_revision == 0`) → put our claim and read the records; else, its value lapsed →
//!   the same; else read the claim and the records (another request is calling: the
//!   subscribers without a record are in progress).
//! - The settle is one txn, one nested txn per event: if the claim is still ours (its value
//!   unchanged), put the records (those read at the claim, still live, and the subscribers
//!   that took the event now) and delete the claim; else nothing (ours lapsed and another
//!   request took it over: it read the records and writes them). So only the claim's holder
//!   writes the records, and none is lost between the read and the put.
//! - Every key is written with a lease shared by all the keys written in one time bucket
//!   (granted ahead by the root context), so a key is gone at most a bucket width (and a
//!   second of rounding) after its value lapsed: no sweeper, nothing accumulates.
//!
//! Why gRPC and not etcd's HTTP/JSON gateway (`/v3/kv/txn`): the gateway turns JSON into the
//! same messages and calls etcd's gRPC server over a loopback connection of its own, which
//! cost etcd about three times the CPU per event, and the event its latency
//! (docs/performance.md, "Dedupe stores").

use proto::Message;

use super::Seen;
use proto::{
    frame, unframe, Against, Compare, DeleteRangeRequest, LeaseGrantRequest, LeaseGrantResponse,
    PutRequest, RangeRequest, Request, RequestOp, Response, TxnRequest, TxnResponse,
};
pub use proto::{GRANT_PATH, TXN_PATH};

pub mod claims;
pub mod lease;
pub mod proto;
pub mod remote;
pub mod store;

pub use lease::{Family, Grant, Leases};

/// The headers of a gRPC call to etcd (`path`: the method's).
pub fn call_headers<'a>(cluster: &'a str, path: &'static str) -> Vec<(&'a str, &'a [u8])> {
    vec![
        (":method", b"POST"),
        (":path", path.as_bytes()),
        (":authority", cluster.as_bytes()),
        ("content-type", b"application/grpc"),
        ("te", b"trailers"),
    ]
}

/// Digits of the time in every value.
const TIME_DIGITS: usize = 20;
const CLAIMED: u8 = b'c';
const DELIVERED: u8 = b'd';
/// One record in the records' value: the subscriber's id and when the record lapses.
const RECORD_BYTES: usize = 16 + TIME_DIGITS;

/// etcd's default `--max-txn-ops`, counted as etcd counts it (`checkTxnRequest`): a txn has
/// at most this many operations in each branch, and a txn nested in it at most what its
/// parent's own count leaves, and so on down.
const MAX_TXN_OPS: usize = 128;
/// Events in one claim txn: each one's nested txn has two operations, and the take-over
/// nested in it two more, so k events need k + 2 + 2 <= 128.
pub const MAX_CLAIMS_PER_TXN: usize = MAX_TXN_OPS - 4;
/// Events in one settle txn: each one's nested txn has two operations (the records, the
/// release), so k events need k + 2 <= 128.
pub const MAX_SETTLES_PER_TXN: usize = MAX_TXN_OPS - 2;

/// The keys of one event: its claim, and its records.
pub fn keys(prefix: &str, channel: &str, event_key: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let mut claim = Vec::with_capacity(prefix.len() + channel.len() + event_key.len() + 8);
    claim.extend_from_slice(prefix.as_bytes());
    push_decimal(&mut claim, channel.len() as u64);
    claim.push(b':');
    claim.extend_from_slice(channel.as_bytes());
    claim.push(b'/');
    claim.extend_from_slice(event_key);
    claim.push(b'/');
    let mut records = claim.clone();
    claim.push(CLAIMED);
    records.push(DELIVERED);
    (claim, records)
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

/// The records' value: each subscriber's id and when its record lapses.
pub fn records_value(records: &[Record]) -> String {
    let mut out = Vec::with_capacity(1 + records.len() * RECORD_BYTES);
    out.push(DELIVERED);
    for record in records {
        push_hex16(&mut out, record.subscriber);
        push_time(&mut out, record.until_ms);
    }
    // Hex digits, digits and a letter only.
    String::from_utf8(out).unwrap_or_default()
}

/// A subscriber that took the event, until when it is remembered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    pub subscriber: u64,
    pub until_ms: u64,
}

/// The records of a records' value (`None`: not one fanout wrote).
fn read_records(value: &[u8]) -> Option<Vec<Record>> {
    let rest = value.strip_prefix(&[DELIVERED])?;
    if rest.len() % RECORD_BYTES != 0 {
        return None;
    }
    rest.chunks_exact(RECORD_BYTES)
        .map(|chunk| {
            let (id, time) = chunk.split_at(16);
            Some(Record {
                subscriber: parse_hex16(id)?,
                until_ms: parse_decimal(time)?,
            })
        })
        .collect()
}

fn parse_hex16(digits: &[u8]) -> Option<u64> {
    digits.iter().try_fold(0u64, |n, d| {
        let nibble = char::from(*d).to_digit(16)?;
        // Lowercase only, as written.
        (!d.is_ascii_uppercase()).then_some((n << 4) | u64::from(nibble))
    })
}

fn parse_decimal(digits: &[u8]) -> Option<u64> {
    digits.iter().try_fold(0u64, |n, d| {
        let digit = char::from(*d).to_digit(10)?;
        n.checked_mul(10)?.checked_add(u64::from(digit))
    })
}

/// Every value below this one has lapsed at `now_ms` (its time is at most `now_ms`).
fn lapsed_below(now_ms: u64) -> String {
    value(now_ms, b'~', None)
}

/// One event's claim to make: its claim key, our value for it, its records key, the lease
/// the claim is written with, and the time of the request that makes it (values below it
/// have lapsed).
pub struct ClaimOp<'a> {
    pub key: &'a [u8],
    pub value: &'a str,
    pub records: &'a [u8],
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

fn range(key: &[u8]) -> RequestOp {
    op(Request::Range(RangeRequest { key: key.to_vec() }))
}

/// The claim txn: for each event, create its claim, or take it over if it lapsed, and read
/// its records; or read the claim and the records. gRPC-framed, ready to send. (The ops of
/// several requests make one txn: no claim key twice.)
pub fn claim_body(ops: &[ClaimOp<'_>]) -> Vec<u8> {
    let success = ops
        .iter()
        .map(|c| {
            let mine = || vec![put(c.key, c.value.as_bytes(), c.lease), range(c.records)];
            let take_over = TxnRequest {
                compare: vec![compare(
                    c.key,
                    proto::LESS,
                    proto::VALUE,
                    Against::Value(lapsed_below(c.now_ms).into_bytes()),
                )],
                success: mine(),
                failure: vec![range(c.key), range(c.records)],
            };
            op(Request::Txn(TxnRequest {
                compare: vec![compare(
                    c.key,
                    proto::EQUAL,
                    proto::CREATE,
                    Against::CreateRevision(0),
                )],
                success: mine(),
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

/// One event's settle: its claim key and our claim, and the records to put (its records
/// key and value), if any.
pub struct SettleOp<'a> {
    pub claim_key: &'a [u8],
    pub claim: &'a str,
    pub records: Option<(&'a [u8], &'a str)>,
}

/// The settle txn: for each event, if its claim is still ours (its value unchanged), put its
/// records (with `lease`) and delete the claim; if another request took the claim over (ours
/// lapsed), nothing: that one has read the records and writes them. gRPC-framed.
pub fn settle_body(settles: &[SettleOp<'_>], lease: i64) -> Vec<u8> {
    let success = settles
        .iter()
        .map(|s| {
            let records = s
                .records
                .map(|(key, value)| put(key, value.as_bytes(), lease));
            let release = op(Request::DeleteRange(DeleteRangeRequest {
                key: s.claim_key.to_vec(),
            }));
            op(Request::Txn(TxnRequest {
                compare: vec![compare(
                    s.claim_key,
                    proto::EQUAL,
                    proto::VALUE,
                    Against::Value(s.claim.as_bytes().to_vec()),
                )],
                success: records.into_iter().chain([release]).collect(),
                failure: Vec::new(),
            }))
        })
        .collect();
    frame(&TxnRequest {
        compare: Vec::new(),
        success,
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
pub struct StoreError {
    kind: StoreErrorKind,
    detail: String,
}

/// What a store error means for the store's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoreErrorKind {
    /// etcd does not have the lease a key was written with (gRPC `NOT_FOUND`, 5: the only
    /// one a txn or a lease grant of fanout's can get): the leases must be granted again.
    LeaseLost,
    /// Anything else: this call failed, the state stands.
    Failed,
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.detail)
    }
}

impl StoreError {
    /// A store error that says what happened.
    pub fn new(detail: impl Into<String>) -> StoreError {
        StoreError {
            kind: StoreErrorKind::Failed,
            detail: detail.into(),
        }
    }

    /// etcd no longer has the lease the keys were written with: the leases must be granted
    /// again.
    pub fn lease_lost(&self) -> bool {
        self.kind == StoreErrorKind::LeaseLost
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
        return Err(StoreError::new(
            "no answer (unreachable, reset or timed out)",
        ));
    };
    if status != 200 {
        // Not etcd's gRPC server: Envoy's own answer (no healthy upstream), or a cluster
        // that speaks HTTP/1.1 to etcd, whose gateway does not know the gRPC paths.
        return Err(StoreError::new(format!(
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
            let kind = match code {
                // NOT_FOUND: etcd's `ErrGRPCLeaseNotFound`, the one a txn with a lease or a
                // grant can get.
                "5" => StoreErrorKind::LeaseLost,
                _ => StoreErrorKind::Failed,
            };
            return Err(StoreError {
                kind,
                detail: format!(
                    "etcd answered gRPC status {code}: {}",
                    crate::answer::sanitize(message.as_bytes(), 200)
                ),
            });
        }
        None => return Err(bad("no grpc-status")),
    }
    unframe(&reply.body).map_err(bad)
}

fn bad(what: &str) -> StoreError {
    StoreError::new(format!("etcd's answer does not read: {what}"))
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

/// What the claim txn found for one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// Whether the claim is ours now (else another request holds it).
    pub claimed: bool,
    /// The event's records, as etcd holds them (some may have lapsed).
    pub records: Vec<Record>,
}

impl Found {
    /// What a request does about `subscriber` at `now_ms`: a live record → already
    /// delivered; else it calls it if the claim is ours, or another request is.
    pub fn seen(&self, subscriber: u64, now_ms: u64) -> Seen {
        let recorded = self
            .records
            .iter()
            .any(|r| r.subscriber == subscriber && r.until_ms > now_ms);
        match (recorded, self.claimed) {
            (true, _) => Seen::AlreadyDelivered,
            (false, true) => Seen::Deliver,
            (false, false) => Seen::InProgress,
        }
    }
}

/// The value of a range's first key, if it has one.
fn range_value(response: Option<&proto::ResponseOp>) -> Result<Option<&[u8]>, StoreError> {
    match response.and_then(|r| r.response.as_ref()) {
        Some(Response::Range(range)) => Ok(range.kvs.first().map(|kv| kv.value.as_slice())),
        _ => Err(bad("no response_range")),
    }
}

/// What the claim txn found, for each of its `n` events in order.
pub fn read_claim(message: &[u8], n: usize) -> Result<Vec<Found>, StoreError> {
    let txn = txn_response(message)?;
    if txn.responses.len() != n {
        return Err(bad("not one response per event"));
    }
    txn.responses
        .iter()
        .map(|response| {
            let Some(Response::Txn(created)) = &response.response else {
                return Err(bad("no response_txn"));
            };
            let (claimed, found) = if created.succeeded {
                (true, created)
            } else {
                let taken = nested_txn(created).ok_or_else(|| bad("no nested response_txn"))?;
                (taken.succeeded, taken)
            };
            let mut responses = found.responses.iter();
            if !claimed {
                // Another request's claim.
                let value = range_value(responses.next())?;
                if value.and_then(|v| v.get(TIME_DIGITS)) != Some(&CLAIMED) {
                    return Err(bad("a claim fanout did not write"));
                }
            } else if !matches!(
                responses.next().and_then(|r| r.response.as_ref()),
                Some(Response::Put(_))
            ) {
                return Err(bad("no response_put"));
            }
            let records = match range_value(responses.next())? {
                None => Vec::new(),
                Some(value) => {
                    read_records(value).ok_or_else(|| bad("records fanout did not write"))?
                }
            };
            Ok(Found { claimed, records })
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
        return Err(StoreError::new(format!(
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
    use proto::{KeyValue, RangeResponse, ResponseOp};

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
    fn the_claim_creates_or_takes_over_its_key_and_reads_the_records() {
        let events: Vec<(Vec<u8>, Vec<u8>)> = (0..2u64)
            .map(|i| {
                keys(
                    "/fanout/",
                    "default/orders",
                    format!("ev\u{ff}-{i}").as_bytes(),
                )
            })
            .collect();
        let values: Vec<String> = (0..2u64).map(|i| claim_value(1_000 + i, 0xbeef)).collect();
        let ops: Vec<ClaimOp<'_>> = events
            .iter()
            .zip(&values)
            .map(|((claim, records), value)| ClaimOp {
                key: claim,
                value,
                records,
                lease: 7_587_868_122_391_046_144,
                now_ms: 123_456,
            })
            .collect();
        let txn = decoded(&claim_body(&ops));
        assert!(txn.compare.is_empty() && txn.failure.is_empty());
        assert_eq!(txn.success.len(), 2);
        for (i, op) in txn.success.iter().enumerate() {
            let (claim, records) = &events[i];
            let create = nested(op);
            assert_eq!(
                create.compare,
                [compare(
                    claim,
                    proto::EQUAL,
                    proto::CREATE,
                    Against::CreateRevision(0)
                )]
            );
            let mine = [
                put(claim, values[i].as_bytes(), 7_587_868_122_391_046_144),
                range(records),
            ];
            assert_eq!(create.success, mine);
            let take_over = nested(&create.failure[0]);
            assert_eq!(
                take_over.compare,
                [compare(
                    claim,
                    proto::LESS,
                    proto::VALUE,
                    Against::Value(b"00000000000000123456~".to_vec())
                )]
            );
            assert_eq!(take_over.success, mine);
            assert_eq!(take_over.failure, [range(claim), range(records)]);
        }
        assert!(decoded(&claim_body(&[])).success.is_empty());
    }

    fn answer(responses: Vec<Response>) -> ResponseOp {
        ResponseOp {
            response: Some(Response::Txn(TxnResponse {
                header: None,
                succeeded: false,
                responses: responses
                    .into_iter()
                    .map(|r| ResponseOp { response: Some(r) })
                    .collect(),
            })),
        }
    }

    fn ranged(value: Option<&str>) -> Response {
        Response::Range(RangeResponse {
            kvs: value
                .map(|v| KeyValue {
                    key: b"k".to_vec(),
                    value: v.as_bytes().to_vec(),
                })
                .into_iter()
                .collect(),
        })
    }

    fn created(succeeded: bool, inner: ResponseOp) -> Vec<u8> {
        let Some(Response::Txn(mut txn)) = inner.response else {
            unreachable!()
        };
        txn.succeeded = succeeded;
        TxnResponse {
            header: None,
            succeeded: true,
            responses: vec![ResponseOp {
                response: Some(Response::Txn(txn)),
            }],
        }
        .encode_to_vec()
    }

    #[test]
    fn the_claim_answer_reads_as_ours_or_held_with_the_records() {
        let records = records_value(&[
            Record {
                subscriber: 0xa,
                until_ms: 5_000,
            },
            Record {
                subscriber: 0xb,
                until_ms: 900,
            },
        ]);
        // Created: put, then the records.
        let fresh = created(
            true,
            answer(vec![Response::Put(proto::Empty {}), ranged(Some(&records))]),
        );
        let found = read_claim(&fresh, 1).unwrap();
        assert!(found[0].claimed);
        assert_eq!(found[0].seen(0xa, 1_000), Seen::AlreadyDelivered);
        assert_eq!(found[0].seen(0xb, 1_000), Seen::Deliver, "lapsed at 900");
        assert_eq!(found[0].seen(0xc, 1_000), Seen::Deliver);
        // Held by another: its claim, then the records (none).
        let claim = claim_value(9_000, 3);
        let held = TxnResponse {
            header: None,
            succeeded: false,
            responses: vec![answer(vec![Response::Txn(TxnResponse {
                header: None,
                succeeded: false,
                responses: vec![
                    ResponseOp {
                        response: Some(ranged(Some(&claim))),
                    },
                    ResponseOp {
                        response: Some(ranged(None)),
                    },
                ],
            })])],
        }
        .encode_to_vec();
        let found = read_claim(&held, 1).unwrap();
        assert!(!found[0].claimed && found[0].records.is_empty());
        assert_eq!(found[0].seen(0xa, 1_000), Seen::InProgress);
        assert_eq!(
            read_claim(&held, 2).unwrap_err().to_string(),
            "etcd's answer does not read: not one response per event"
        );
        // Values fanout did not write.
        let odd = created(
            true,
            answer(vec![Response::Put(proto::Empty {}), ranged(Some("d0123"))]),
        );
        assert!(read_claim(&odd, 1).is_err());
        let no_put = created(true, answer(vec![ranged(None), ranged(None)]));
        assert!(read_claim(&no_put, 1).is_err());
    }

    #[test]
    fn records_read_back_as_written_and_nothing_else_reads() {
        let written = vec![
            Record {
                subscriber: u64::MAX,
                until_ms: 0,
            },
            Record {
                subscriber: 0x0123_4567_89ab_cdef,
                until_ms: u64::MAX,
            },
        ];
        let value = records_value(&written);
        assert_eq!(
            value,
            format!("dffffffffffffffff{:020}0123456789abcdef{}", 0, u64::MAX)
        );
        assert_eq!(read_records(value.as_bytes()), Some(written));
        assert_eq!(read_records(b"d"), Some(Vec::new()));
        for bad in [
            &b""[..],
            b"c",
            b"d0",
            b"d0123456789ABCDEF00000000000000000000",
            b"d0123456789abcdef0000000000000000000x",
            b"d0123456789abcdef99999999999999999999",
        ] {
            assert_eq!(read_records(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    /// etcd's `checkTxnRequest` (server/etcdserver/api/v3rpc/key.go, etcd 3.5): the most
    /// operations of a branch, and a nested txn checked against what is left.
    fn etcd_accepts(txn: &TxnRequest, max: usize) -> bool {
        let opc = txn
            .compare
            .len()
            .max(txn.success.len())
            .max(txn.failure.len());
        opc <= max
            && txn
                .success
                .iter()
                .chain(&txn.failure)
                .all(|op| match &op.request {
                    Some(Request::Txn(nested)) => etcd_accepts(nested, max - opc),
                    _ => true,
                })
    }

    #[test]
    fn the_batches_fit_etcds_max_txn_ops_and_one_more_would_not() {
        let events: Vec<(Vec<u8>, Vec<u8>)> = (0..=MAX_CLAIMS_PER_TXN.max(MAX_SETTLES_PER_TXN))
            .map(|i| keys("/fanout/", "orders", format!("e{i}").as_bytes()))
            .collect();
        let value = claim_value(1, 2);
        let ops: Vec<ClaimOp<'_>> = events
            .iter()
            .map(|(key, records)| ClaimOp {
                key,
                value: &value,
                records,
                lease: 1,
                now_ms: 0,
            })
            .collect();
        let claims = |n: usize| decoded(&claim_body(&ops[..n]));
        assert!(etcd_accepts(&claims(MAX_CLAIMS_PER_TXN), MAX_TXN_OPS));
        assert!(!etcd_accepts(&claims(MAX_CLAIMS_PER_TXN + 1), MAX_TXN_OPS));
        // Settles, each with its records (the larger nested txn).
        let settle = |n: usize| {
            let ops: Vec<SettleOp<'_>> = events[..n]
                .iter()
                .map(|(c, r)| SettleOp {
                    claim_key: c,
                    claim: &value,
                    records: Some((r, "d")),
                })
                .collect();
            decoded(&settle_body(&ops, 1))
        };
        assert!(etcd_accepts(&settle(MAX_SETTLES_PER_TXN), MAX_TXN_OPS));
        assert!(!etcd_accepts(&settle(MAX_SETTLES_PER_TXN + 1), MAX_TXN_OPS));
    }

    #[test]
    fn the_settle_writes_records_and_releases_only_a_claim_still_ours() {
        let ops = [
            SettleOp {
                claim_key: b"a/c",
                claim: "mine",
                records: Some((b"a/d", "dxx")),
            },
            SettleOp {
                claim_key: b"b/c",
                claim: "ours",
                records: None,
            },
        ];
        let txn = decoded(&settle_body(&ops, 42));
        assert!(txn.compare.is_empty() && txn.failure.is_empty());
        assert_eq!(txn.success.len(), 2);
        let still_ours = |key: &[u8], claim: &[u8]| {
            [compare(
                key,
                proto::EQUAL,
                proto::VALUE,
                Against::Value(claim.to_vec()),
            )]
        };
        let release = |key: &[u8]| {
            op(Request::DeleteRange(DeleteRangeRequest {
                key: key.to_vec(),
            }))
        };
        let first = nested(&txn.success[0]);
        assert_eq!(first.compare, still_ours(b"a/c", b"mine"));
        assert_eq!(first.success, [put(b"a/d", b"dxx", 42), release(b"a/c")]);
        assert!(first.failure.is_empty(), "taken over: nothing");
        let second = nested(&txn.success[1]);
        assert_eq!(second.compare, still_ours(b"b/c", b"ours"));
        assert_eq!(second.success, [release(b"b/c")]);
        assert!(decoded(&settle_body(&[], 5)).success.is_empty());
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
            error.to_string(),
            "etcd answered gRPC status 5: etcdserver: requested lease not found"
        );
        let encoded = Reply {
            grpc_status: Some("14".into()),
            grpc_message: Some("no%20leader%0A".into()),
            ..lost.clone()
        };
        let error = read_answer(&encoded).unwrap_err();
        assert_eq!(error.to_string(), "etcd answered gRPC status 14: no leader");
        assert!(!error.lease_lost(), "only NOT_FOUND is a lost lease");
        // A lost lease is told by its status, whatever the message says.
        let reworded = Reply {
            grpc_message: Some("lease gone".into()),
            ..lost.clone()
        };
        assert!(read_answer(&reworded).unwrap_err().lease_lost());
        let http1 = Reply {
            status: Some(404),
            grpc_status: None,
            body: b"Not Found".to_vec(),
            ..ok.clone()
        };
        assert!(read_answer(&http1)
            .unwrap_err()
            .to_string()
            .starts_with("etcd answered 404: Not Found (fanout speaks etcd's gRPC API"));
        let untold = Reply {
            grpc_status: None,
            ..ok.clone()
        };
        assert_eq!(
            read_answer(&untold).unwrap_err().to_string(),
            "etcd's answer does not read: no grpc-status"
        );
        assert!(read_answer(&Reply::default())
            .unwrap_err()
            .to_string()
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
            .to_string()
            .contains("too many"));
        assert!(read_grant(b"\xff\xff").is_err());
    }

    #[test]
    fn keys_never_mix_two_events_or_channels() {
        let a = keys("/f/", "ab", b"c");
        let b = keys("/f/", "a", b"bc");
        assert_ne!(a, b);
        assert_eq!(a, (b"/f/2:ab/c/c".to_vec(), b"/f/2:ab/c/d".to_vec()));
        // An event key that ends like a suffix: the suffix is always the last two bytes.
        assert_ne!(keys("/f/", "ab", b"c/c").1, keys("/f/", "ab", b"c").0);
    }

    #[test]
    fn keys_and_values_are_what_format_writes() {
        for n in [0, 1, 9, 10, 123_456_789, u64::MAX / 3, u64::MAX] {
            assert_eq!(
                claim_value(n, n ^ 0xabc),
                format!("{n:020}c{:016x}", n ^ 0xabc)
            );
            assert_eq!(lapsed_below(n), format!("{n:020}~"));
            let record = Record {
                subscriber: n,
                until_ms: n,
            };
            assert_eq!(records_value(&[record]), format!("d{n:016x}{n:020}"));
            let (c, d) = keys("/p/", "ch", format!("ev{n}").as_bytes());
            assert_eq!(c, format!("/p/2:ch/ev{n}/c").into_bytes());
            assert_eq!(d, format!("/p/2:ch/ev{n}/d").into_bytes());
            let mut digits = Vec::new();
            push_decimal(&mut digits, n);
            assert_eq!(digits, n.to_string().into_bytes());
        }
    }

    #[test]
    fn values_compare_by_time() {
        let below = lapsed_below(1000);
        assert!(claim_value(999, 7).as_str() < below.as_str());
        assert!(claim_value(1000, u64::MAX).as_str() < below.as_str());
        assert!(claim_value(1001, u64::MAX).as_str() > below.as_str());
    }
}
