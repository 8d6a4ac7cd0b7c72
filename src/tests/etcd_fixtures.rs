//! etcd's answers for the core's tests, recorded from a real etcd: the fixtures
//! (`tests/fixtures/etcd/`, what etcd 3.5.1 answered to the requests fanout makes over its
//! gRPC API), the recorder that writes them (`record_etcd_fixtures`, run by hand against an
//! etcd on loopback), the fake host set to give one as a call's answer, and readers of the
//! txns fanout sent. Test builds only: nothing of it is in the module.

#[cfg(not(target_arch = "wasm32"))]
use crate::config::Config;
use crate::dedupe::etcd;
use crate::dedupe::etcd::proto::{Message, Request, RequestOp, TxnRequest};
use crate::testing::FakeState;

/// The configuration the fixtures were recorded with: one channel of three subscribers,
/// events named by `ce-id`, the etcd store on cluster `etcd`.
pub const ETCD: &str = r#"{
  "dedupe": {"key": "ce-id", "ttl_ms": 60000,
             "store": {"etcd": {"cluster": "etcd", "prefix": "/fanout/", "timeout_ms": 250}}},
  "channels": [
    {"name": "orders", "hosts": ["orders.default"], "subscribers": [
      {"cluster": "billing"}, {"cluster": "shipping"}, {"cluster": "analytics"}
    ]}
  ]
}"#;

/// An answer of etcd's gRPC server, as the host gives it.
pub struct EtcdAnswer {
    pub status: Option<u16>,
    /// In the trailers (a message and its status) or, for an error, the headers (an answer
    /// that is only trailers, as gRPC servers send errors).
    pub grpc: Option<(String, String)>,
    pub in_trailers: bool,
    pub body: Vec<u8>,
}

/// A recorded answer of etcd 3.5.1: a message (`<name>.grpc`, its body as gRPC frames it;
/// `grpc-status: 0` in the trailers) or an error (`<name>.status`: `grpc-status`, a space,
/// `grpc-message`, in the headers).
pub fn fixture(name: &str) -> EtcdAnswer {
    let message: Option<&[u8]> = match name {
        "grant" => Some(include_bytes!("../../tests/fixtures/etcd/grant.grpc")),
        "claim_fresh" => Some(include_bytes!("../../tests/fixtures/etcd/claim_fresh.grpc")),
        "settle" => Some(include_bytes!("../../tests/fixtures/etcd/settle.grpc")),
        "claim_retry" => Some(include_bytes!("../../tests/fixtures/etcd/claim_retry.grpc")),
        "claim_conflict" => Some(include_bytes!(
            "../../tests/fixtures/etcd/claim_conflict.grpc"
        )),
        "claim_lapsed" => Some(include_bytes!(
            "../../tests/fixtures/etcd/claim_lapsed.grpc"
        )),
        "claim_batch" => Some(include_bytes!("../../tests/fixtures/etcd/claim_batch.grpc")),
        _ => None,
    };
    if let Some(body) = message {
        return EtcdAnswer {
            status: Some(200),
            grpc: Some(("0".into(), String::new())),
            in_trailers: true,
            body: body.to_vec(),
        };
    }
    let text = match name {
        "lease_not_found" => include_str!("../../tests/fixtures/etcd/lease_not_found.status"),
        other => panic!("no fixture {other}"),
    };
    let (code, message) = text.trim().split_once(' ').unwrap();
    EtcdAnswer {
        status: Some(200),
        grpc: Some((code.into(), message.into())),
        in_trailers: false,
        body: Vec::new(),
    }
}

/// An answer that is not etcd's: `status` and `body` only (Envoy's own, or none).
pub fn not_grpc(status: Option<u16>, body: &[u8]) -> EtcdAnswer {
    EtcdAnswer {
        status,
        grpc: None,
        in_trailers: false,
        body: body.to_vec(),
    }
}

/// A txn a call sent.
pub fn txn_of(body: &[u8]) -> TxnRequest {
    TxnRequest::decode(etcd::proto::unframe(body).unwrap()).unwrap()
}

/// Every operation of a txn and of the txns nested in it, depth first.
pub fn ops(txn: &TxnRequest) -> Vec<Request> {
    fn walk(ops: &[RequestOp], out: &mut Vec<Request>) {
        for op in ops {
            let Some(request) = &op.request else { continue };
            out.push(request.clone());
            if let Request::Txn(txn) = request {
                walk(&txn.success, out);
                walk(&txn.failure, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(&txn.success, &mut out);
    walk(&txn.failure, &mut out);
    out
}

/// The values a txn body puts, in order.
pub fn puts(body: &[u8]) -> Vec<String> {
    ops(&txn_of(body))
        .into_iter()
        .filter_map(|op| match op {
            Request::Put(put) => Some(String::from_utf8(put.value).unwrap()),
            _ => None,
        })
        .collect()
}

pub fn deletes(body: &[u8]) -> usize {
    ops(&txn_of(body))
        .iter()
        .filter(|op| matches!(op, Request::DeleteRange(_)))
        .count()
}

/// The keys a claim txn claims, in order (each event's nested txn compares its claim key).
pub fn claimed_keys(body: &[u8]) -> Vec<Vec<u8>> {
    txn_of(body)
        .success
        .iter()
        .filter_map(|op| match &op.request {
            Some(Request::Txn(txn)) => txn.compare.first().map(|c| c.key.clone()),
            _ => None,
        })
        .collect()
}

impl FakeState {
    /// `answer` as the next answer to a call, delivered to context `effective`: the number
    /// of headers the host reports.
    pub fn set_etcd_answer(&mut self, answer: &EtcdAnswer, effective: u32) -> usize {
        let state = self;
        state.call_response = (answer.status, answer.body.clone());
        let grpc: Vec<(String, String)> = answer
            .grpc
            .iter()
            .flat_map(|(code, message)| {
                [("grpc-status".to_string(), code.clone())]
                    .into_iter()
                    .chain((!message.is_empty()).then(|| ("grpc-message".into(), message.clone())))
            })
            .collect();
        let (headers, trailers) = if answer.in_trailers {
            (Vec::new(), grpc)
        } else {
            (grpc, Vec::new())
        };
        state.call_response_headers = headers
            .into_iter()
            .map(|(n, v)| (n, v.into_bytes()))
            .collect();
        state.call_response_trailers = trailers;
        state.effective = effective;
        usize::from(answer.status.is_some()) + state.call_response_headers.len()
    }
}

/// Records etcd's answers to the requests fanout makes, into `tests/fixtures/etcd/`: run
/// against an etcd 3.5.1 on loopback with
/// `FANOUT_ETCD_RECORD=127.0.0.1:2379 cargo test --lib record_etcd_fixtures -- --ignored`.
/// (gRPC over HTTP/2 without TLS, as Envoy's cluster speaks it; a message's `grpc-status`
/// comes in the trailers, which this client does not read: a body that decodes is the
/// success, and an error comes in the headers.)
#[cfg(not(target_arch = "wasm32"))]
#[test]
#[ignore]
fn record_etcd_fixtures() {
    let recorder = Recorder::new();
    let config = Config::from_json(ETCD.as_bytes()).unwrap();
    let ids: Vec<u64> = config.channels[0]
        .subscribers
        .iter()
        .map(|s| s.dedupe_id)
        .collect();
    // A fresh event key each run: the fixtures do not depend on what etcd held before.
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
        .to_string();
    let grant = recorder.save(
        "grant",
        recorder.post(etcd::GRANT_PATH, &etcd::grant_body(120)),
    );
    let lease = etcd::read_grant(etcd::proto::unframe(&grant).unwrap()).unwrap();
    let records = record_one_event(&recorder, &ids, lease, &run);
    record_the_limits(&recorder, lease, &run, &records);
}

/// Now, on the recording's clock.
#[cfg(not(target_arch = "wasm32"))]
const RECORDED_NOW: u64 = 1_000_000;

/// An HTTP/2 client of the etcd being recorded, and where its answers go.
#[cfg(not(target_arch = "wasm32"))]
struct Recorder {
    client: reqwest::blocking::Client,
    addr: String,
    dir: &'static str,
}

#[cfg(not(target_arch = "wasm32"))]
impl Recorder {
    fn new() -> Recorder {
        let addr = std::env::var("FANOUT_ETCD_RECORD").expect("FANOUT_ETCD_RECORD=host:port");
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/etcd");
        std::fs::create_dir_all(dir).unwrap();
        let client = reqwest::blocking::Client::builder()
            .http2_prior_knowledge()
            .build()
            .unwrap();
        Recorder { client, addr, dir }
    }

    /// The message, or the error's `grpc-status` and `grpc-message`.
    fn post(&self, path: &str, body: &[u8]) -> Result<Vec<u8>, String> {
        let answer = self
            .client
            .post(format!("http://{}{path}", self.addr))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(body.to_vec())
            .send()
            .unwrap();
        assert_eq!(answer.status(), 200);
        let header = |name: &str| {
            answer
                .headers()
                .get(name)
                .map(|v| v.to_str().unwrap().to_string())
        };
        match header("grpc-status") {
            Some(code) if code != "0" => Err(format!(
                "{code} {}",
                header("grpc-message").unwrap_or_default()
            )),
            _ => Ok(answer.bytes().unwrap().to_vec()),
        }
    }

    /// Writes a message as fixture `name`.
    fn save(&self, name: &str, answer: Result<Vec<u8>, String>) -> Vec<u8> {
        let body = answer.unwrap_or_else(|e| panic!("{name}: {e}"));
        println!("{name}: {} bytes", body.len());
        std::fs::write(format!("{}/{name}.grpc", self.dir), &body).unwrap();
        body
    }
}

/// One event's life in etcd: claimed, a copy's conflict, settled, redelivered, lapsed, and
/// batched with a new event. Returns the records value it settled.
#[cfg(not(target_arch = "wasm32"))]
fn record_one_event(recorder: &Recorder, ids: &[u64], lease: i64, run: &str) -> String {
    let now = RECORDED_NOW;
    let (claim_key, records_key) = etcd::keys("/fanout/", "orders", run.as_bytes());
    let claim = |owner: u64, until: u64, now: u64| {
        let value = etcd::claim_value(until, owner);
        let op = etcd::ClaimOp {
            key: &claim_key,
            value: &value,
            records: &records_key,
            lease,
            now_ms: now,
        };
        (etcd::claim_body(&[op]), value)
    };
    // The first delivery: claimed by owner 1, no records.
    let (body, first) = claim(1, now + 10_000, now);
    recorder.save("claim_fresh", recorder.post(etcd::TXN_PATH, &body));
    // A copy at the same time: owner 1's claim holds, no records.
    let (body, _) = claim(2, now + 10_000, now + 5);
    recorder.save("claim_conflict", recorder.post(etcd::TXN_PATH, &body));
    // Billing and analytics took it, shipping failed: their records, the claim released.
    let records: Vec<etcd::Record> = [ids[0], ids[2]]
        .iter()
        .map(|&subscriber| etcd::Record {
            subscriber,
            until_ms: now + 60_000,
        })
        .collect();
    let records = etcd::records_value(&records);
    let settled = etcd::SettleOp {
        claim_key: &claim_key,
        claim: &first,
        records: Some((&records_key, &records)),
    };
    let body = etcd::settle_body(&[settled], lease);
    recorder.save("settle", recorder.post(etcd::TXN_PATH, &body));
    // The redelivery: claimed by owner 3, the two records read.
    let (body, _) = claim(3, now + 20_000, now + 10);
    recorder.save("claim_retry", recorder.post(etcd::TXN_PATH, &body));
    // After the ttl: owner 3's claim lapsed, taken over; the records read, lapsed.
    let (body, _) = claim(4, now + 200_000, now + 100_000);
    recorder.save("claim_lapsed", recorder.post(etcd::TXN_PATH, &body));
    record_a_batch(recorder, lease, run, (&claim_key, &records_key));
    records
}

/// Two requests' claims in one txn: the event again (owner 4's claim holds: in progress),
/// and a new event (claimed).
#[cfg(not(target_arch = "wasm32"))]
fn record_a_batch(recorder: &Recorder, lease: i64, run: &str, event: (&[u8], &[u8])) {
    let (other_claim, other_records) =
        etcd::keys("/fanout/", "orders", format!("{run}-b").as_bytes());
    let value = etcd::claim_value(RECORDED_NOW + 210_000, 5);
    let ops = [
        etcd::ClaimOp {
            key: event.0,
            value: &value,
            records: event.1,
            lease,
            now_ms: RECORDED_NOW + 100_005,
        },
        etcd::ClaimOp {
            key: &other_claim,
            value: &value,
            records: &other_records,
            lease,
            now_ms: RECORDED_NOW + 100_005,
        },
    ];
    recorder.save(
        "claim_batch",
        recorder.post(etcd::TXN_PATH, &etcd::claim_body(&ops)),
    );
}

/// The batches' limits are etcd's own: one claim or one settle operation more is refused.
/// Then a settle with a lease etcd does not have: the `lease_not_found` error.
#[cfg(not(target_arch = "wasm32"))]
fn record_the_limits(recorder: &Recorder, lease: i64, run: &str, records: &str) {
    let value = etcd::claim_value(RECORDED_NOW + 210_000, 5);
    let many: Vec<(Vec<u8>, Vec<u8>)> = (0..=etcd::MAX_CLAIMS_PER_TXN
        .max(etcd::MAX_SETTLES_PER_TXN))
        .map(|i| etcd::keys("/fanout/", "orders", format!("{run}-many-{i}").as_bytes()))
        .collect();
    let claims: Vec<etcd::ClaimOp<'_>> = many
        .iter()
        .map(|(key, records)| etcd::ClaimOp {
            key,
            value: &value,
            records,
            lease,
            now_ms: RECORDED_NOW,
        })
        .collect();
    let too_many = |answer: Result<Vec<u8>, String>| {
        let error = answer.unwrap_err();
        assert!(error.contains("too many operations"), "{error}");
    };
    let fits = &claims[..etcd::MAX_CLAIMS_PER_TXN];
    recorder
        .post(etcd::TXN_PATH, &etcd::claim_body(fits))
        .unwrap();
    let one_more = &claims[..=etcd::MAX_CLAIMS_PER_TXN];
    too_many(recorder.post(etcd::TXN_PATH, &etcd::claim_body(one_more)));
    let settles = |n: usize| -> Vec<etcd::SettleOp<'_>> {
        many[..n]
            .iter()
            .map(|(c, r)| etcd::SettleOp {
                claim_key: c,
                claim: &value,
                records: Some((r, records)),
            })
            .collect()
    };
    let settle = |n: usize| recorder.post(etcd::TXN_PATH, &etcd::settle_body(&settles(n), lease));
    too_many(settle(etcd::MAX_SETTLES_PER_TXN + 1));
    settle(etcd::MAX_SETTLES_PER_TXN).unwrap();
    // A lease etcd does not have, for the records of a claim still ours (etcd checks the
    // leases of the puts it applies): the first event's claim, released above, made again.
    recorder
        .post(etcd::TXN_PATH, &etcd::claim_body(&claims[..1]))
        .unwrap();
    let bad = etcd::settle_body(&settles(1), 7_777_777);
    let error = recorder.post(etcd::TXN_PATH, &bad).unwrap_err();
    assert!(error.starts_with("5 "), "{error}");
    println!("lease_not_found: {error}");
    let path = format!("{}/lease_not_found.status", recorder.dir);
    std::fs::write(path, format!("{error}\n")).unwrap();
}
