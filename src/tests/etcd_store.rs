//! `dedupe` with the `etcd` store: the store's decisions (claim, conflict, record, expiry,
//! errors) on the fake host, etcd's answers being the ones etcd 3.5.1 gave to these very
//! requests over its gRPC API (the fixtures, their recorder and the txn readers are in
//! `etcd_fixtures.rs`).

use super::etcd_fixtures::{
    claimed_keys, deletes, fixture, not_grpc, ops, puts, txn_of, EtcdAnswer, ETCD,
};
use super::*;
use crate::config::Config;
use crate::dedupe::etcd::proto::{Against, Message, Request};
use crate::dedupe::etcd::{self, remote};
use crate::dedupe::settle::NOT_RECORDED_HEADER;

/// The subscribers (by cluster, in ETCD's channel) and times of a records' value.
fn records_of(value: &str) -> Vec<(String, u64)> {
    let config = Config::from_json(ETCD.as_bytes()).unwrap();
    let rest = value.strip_prefix('d').expect("a records' value");
    assert_eq!(rest.len() % 36, 0, "{value}");
    (0..rest.len() / 36)
        .map(|i| {
            let (id, until) = rest[i * 36..(i + 1) * 36].split_at(16);
            let id = u64::from_str_radix(id, 16).unwrap();
            let sub = config.channels[0]
                .subscribers
                .iter()
                .find(|s| s.dedupe_id == id)
                .expect("a subscriber of the channel");
            (sub.cluster.clone(), until.parse().unwrap())
        })
        .collect()
}

impl FakeEnvoy {
    /// etcd answers a stream's claim.
    fn answer_etcd(&self, ctx: &mut Stream<FakeHost>, token: u32, answer: &EtcdAnswer) {
        let num_headers = self.host.0.borrow_mut().set_etcd_answer(answer, STREAM);
        ctx.on_call_response(token, num_headers, answer.body.len());
        self.host.0.borrow_mut().call_response_trailers.clear();
    }

    /// etcd answers one of the root's calls (a grant, a settle).
    fn answer_etcd_root(&mut self, token: u32, answer: &EtcdAnswer) {
        let num_headers = self.host.0.borrow_mut().set_etcd_answer(answer, ROOT);
        self.root
            .on_call_response(token, num_headers, answer.body.len());
        self.host.0.borrow_mut().call_response_trailers.clear();
    }
}

impl FakeEnvoy {
    /// The plugin with the etcd store, its first leases granted (by recorded answers).
    fn with_etcd(json: &str) -> FakeEnvoy {
        let mut plugin = FakeEnvoy::configured(json);
        plugin.tick_at(0);
        plugin.grant_leases();
        plugin
    }

    /// Answers every lease grant asked for so far.
    fn grant_leases(&mut self) {
        let grants: Vec<u32> = self
            .state()
            .dispatched
            .iter()
            .filter(|d| header_of(d, ":path").as_deref() == Some(etcd::GRANT_PATH))
            .map(|d| d.token)
            .collect();
        assert!(!grants.is_empty(), "no lease grant was asked for");
        for token in grants {
            self.answer_etcd_root(token, &fixture("grant"));
        }
    }

    fn etcd_calls(&self) -> Vec<Dispatched> {
        self.state()
            .dispatched
            .iter()
            .filter(|d| {
                d.cluster == "etcd" && header_of(d, ":path").as_deref() == Some(etcd::TXN_PATH)
            })
            .cloned()
            .collect()
    }

    fn subscriber_calls(&self) -> Vec<(u32, String)> {
        self.state()
            .dispatched
            .iter()
            .filter(|d| d.cluster != "etcd")
            .map(|d| (d.token, d.cluster.clone()))
            .collect()
    }
}

#[test]
fn the_timer_grants_the_leases_ahead_from_the_root() {
    let mut plugin = FakeEnvoy::configured(ETCD);
    assert!(
        plugin.state().dispatched.is_empty(),
        "no call at configure time"
    );
    plugin.tick_at(0);
    let grants = plugin.state().dispatched.clone();
    // Records and claims, this bucket and the next.
    assert_eq!(grants.len(), 4, "{grants:?}");
    for grant in &grants {
        assert_eq!(grant.cluster, "etcd");
        assert_eq!(grant.context, ROOT);
        assert_eq!(header_of(grant, ":method").as_deref(), Some("POST"));
        assert_eq!(
            header_of(grant, ":path").as_deref(),
            Some("/etcdserverpb.Lease/LeaseGrant")
        );
        assert_eq!(
            header_of(grant, "content-type").as_deref(),
            Some("application/grpc")
        );
        assert_eq!(header_of(grant, "te").as_deref(), Some("trailers"));
        assert_eq!(grant.timeout, Duration::from_millis(250));
    }
    // The records' lease: ttl 60 s, buckets of 6 s, the first granted at 0 for 12 s... 67 s.
    let grant =
        etcd::proto::LeaseGrantRequest::decode(etcd::proto::unframe(&grants[0].body).unwrap())
            .unwrap();
    assert_eq!(grant.ttl, 67);
    assert_eq!(plugin.state().tick_period, Some(Duration::from_millis(10)));
}

#[test]
fn the_etcd_store_creates_no_shared_data_keys() {
    let plugin = FakeEnvoy::configured(ETCD);
    assert!(plugin.state().shared.borrow().values.is_empty());
}

#[test]
fn a_cluster_envoy_does_not_have_makes_every_event_a_store_error() {
    // Envoy's main-thread VM is configured before the clusters are ready and refuses calls
    // to every cluster then: the configuration is accepted, the timer asks again.
    let host = FakeHost::default();
    host.0.borrow_mut().config = Some(ETCD.as_bytes().to_vec());
    host.0.borrow_mut().unknown_clusters.insert("etcd".into());
    let root = Plugin::new(ROOT, host.clone());
    let mut plugin = FakeEnvoy { host, root };
    assert!(plugin.root.on_configure());
    plugin.tick_at(1_000);
    let _ctx = send(&plugin, &event("e1"), b"{}");
    // No lease comes: it waits the store's timeout, then takes on_store_error.
    assert!(plugin.subscriber_calls().is_empty());
    plugin.tick_at(1_250);
    assert_eq!(plugin.subscriber_calls().len(), 3);
    assert_eq!(plugin.flushed("fanout.dedupe.store_errors"), 1);
}

/// The first delivery of e1: billing and analytics take it, shipping fails.
fn first_delivery(plugin: &mut FakeEnvoy) {
    let mut ctx = send(plugin, &event("e1"), b"{}");
    // Nobody is called before etcd answers the claim, made from the stream.
    let claims = plugin.etcd_calls();
    assert_eq!(claims.len(), 1);
    assert_eq!(claims[0].context, STREAM);
    assert!(plugin.subscriber_calls().is_empty());
    assert!(plugin.answers().is_empty());
    let values = puts(&claims[0].body);
    // The event's one claim, twice (create, or take over a lapsed one), whatever its
    // subscribers.
    assert_eq!(values.len(), 2);
    assert!(
        values.iter().all(|v| v.as_bytes()[20] == b'c'),
        "{values:?}"
    );
    plugin.answer_etcd(&mut ctx, claims[0].token, &fixture("claim_fresh"));
    let calls = plugin.subscriber_calls();
    assert_eq!(
        calls.iter().map(|c| c.1.as_str()).collect::<Vec<_>>(),
        ["billing", "shipping", "analytics"]
    );
    plugin.answer_call(&mut ctx, calls[0].0, Some(200), "");
    plugin.answer_call(&mut ctx, calls[1].0, Some(503), "down");
    plugin.answer_call(&mut ctx, calls[2].0, Some(200), "");
    // The settle goes out at once, as a call of the root context (it outlives the stream);
    // the answer waits for it, so that a sender that has it finds the records in etcd.
    // Until etcd answers it, it is work owed (in `fanout.in_flight`).
    assert!(plugin.answers().is_empty(), "no answer before the settle");
    assert_eq!(plugin.etcd_calls().len(), 2);
    let now = plugin.state().now_ms;
    assert_eq!(plugin.flushed("fanout.in_flight"), 1);
    let settle = plugin.etcd_calls().last().cloned().unwrap();
    assert_eq!(settle.context, ROOT);
    let values = puts(&settle.body);
    assert_eq!(values.len(), 1, "the event's records: {values:?}");
    let records = records_of(&values[0]);
    assert_eq!(
        records.iter().map(|r| r.0.as_str()).collect::<Vec<_>>(),
        ["billing", "analytics"]
    );
    // Delivered when the fan-out ended: forgotten ttl_ms later.
    assert!(records.iter().all(|r| r.1 == now + 60_000), "{records:?}");
    assert_eq!(deletes(&settle.body), 1, "the claim released");
    plugin.answer_etcd_root(settle.token, &fixture("settle"));
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 500);
    assert_eq!(FakeEnvoy::header(&answer, NOT_RECORDED_HEADER), None);
    assert_eq!(plugin.flushed("fanout.in_flight"), 0);
}

#[test]
fn a_redelivery_calls_only_the_subscriber_that_failed() {
    let mut plugin = FakeEnvoy::with_etcd(ETCD);
    first_delivery(&mut plugin);
    let before = plugin.subscriber_calls().len();
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    let claim = plugin.etcd_calls().last().cloned().unwrap();
    // etcd: billing and analytics delivered, shipping's key gone and claimed again.
    plugin.answer_etcd(&mut ctx, claim.token, &fixture("claim_retry"));
    let calls = plugin.subscriber_calls();
    assert_eq!(
        calls[before..]
            .iter()
            .map(|c| c.1.as_str())
            .collect::<Vec<_>>(),
        ["shipping"]
    );
    plugin.answer_call(&mut ctx, calls[before].0, Some(200), "");
    // The settle keeps the records read with the claim, and adds shipping's.
    let settle = plugin.etcd_calls().last().cloned().unwrap();
    let values = puts(&settle.body);
    assert_eq!(values.len(), 1);
    let mut who: Vec<String> = records_of(&values[0]).into_iter().map(|r| r.0).collect();
    who.sort();
    assert_eq!(who, ["analytics", "billing", "shipping"]);
    assert_eq!(deletes(&settle.body), 1);
    plugin.answer_etcd_root(settle.token, &fixture("settle"));
    let answer = plugin.last_answer();
    assert_eq!(answer.status, 202);
    assert_eq!(
        report(&answer)["already_delivered"],
        serde_json::json!(["billing", "analytics"])
    );
    assert_eq!(plugin.flushed("fanout.dedupe.skipped"), 2);
    assert_eq!(plugin.state().value("fanout.dedupe.store_errors"), 0);
}

/// etcd's answer to one claim, made here (not recorded): ours, with `records`.
fn claimed_with(records: &[etcd::Record]) -> EtcdAnswer {
    use etcd::proto::{KeyValue, RangeResponse, Response, ResponseOp, TxnResponse};
    let op = |response| ResponseOp {
        response: Some(response),
    };
    let value = etcd::records_value(records).into_bytes();
    let created = TxnResponse {
        header: None,
        succeeded: true,
        responses: vec![
            op(Response::Put(etcd::proto::Empty {})),
            op(Response::Range(RangeResponse {
                kvs: vec![KeyValue {
                    key: b"/fanout/6:orders/e1/d".to_vec(),
                    value,
                }],
            })),
        ],
    };
    let txn = TxnResponse {
        header: None,
        succeeded: true,
        responses: vec![op(Response::Txn(created))],
    };
    EtcdAnswer {
        body: etcd::proto::frame(&txn),
        ..fixture("claim_fresh")
    }
}

#[test]
fn a_copy_of_an_event_everyone_has_releases_its_claim_at_once() {
    let mut plugin = FakeEnvoy::with_etcd(ETCD);
    let config = Config::from_json(ETCD.as_bytes()).unwrap();
    let records: Vec<etcd::Record> = config.channels[0]
        .subscribers
        .iter()
        .map(|s| etcd::Record {
            subscriber: s.dedupe_id,
            until_ms: 60_000,
        })
        .collect();
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    let claim = plugin.etcd_calls()[0].clone();
    plugin.answer_etcd(&mut ctx, claim.token, &claimed_with(&records));
    assert!(plugin.subscriber_calls().is_empty());
    // Nothing recorded anew; the claim deleted rather than left to lapse, before the
    // answer (a copy sent the moment it comes finds no claim of ours).
    let settle = plugin.etcd_calls().last().cloned().unwrap();
    assert_eq!(settle.context, ROOT);
    assert!(puts(&settle.body).is_empty());
    assert_eq!(deletes(&settle.body), 1);
    assert!(plugin.answers().is_empty());
    plugin.answer_etcd_root(settle.token, &fixture("settle"));
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 202);
    assert_eq!(
        report(&answer)["already_delivered"],
        serde_json::json!(["billing", "shipping", "analytics"])
    );
    // A record past its time is no record: everyone is called.
    let plugin = FakeEnvoy::with_etcd(ETCD);
    let now = plugin.state().now_ms;
    let lapsed: Vec<etcd::Record> = records
        .iter()
        .map(|r| etcd::Record {
            until_ms: now,
            ..*r
        })
        .collect();
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    let claim = plugin.etcd_calls()[0].clone();
    plugin.answer_etcd(&mut ctx, claim.token, &claimed_with(&lapsed));
    assert_eq!(plugin.subscriber_calls().len(), 3);
}

#[test]
fn a_copy_in_flight_elsewhere_gets_409_and_calls_nobody() {
    let mut plugin = FakeEnvoy::with_etcd(ETCD);
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    let claim = plugin.etcd_calls()[0].clone();
    plugin.answer_etcd(&mut ctx, claim.token, &fixture("claim_conflict"));
    assert!(plugin.subscriber_calls().is_empty());
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 409);
    assert_eq!(
        FakeEnvoy::header(&answer, "retry-after").as_deref(),
        Some("1")
    );
    // Nothing claimed: nothing to settle.
    plugin.tick_at(10);
    assert_eq!(plugin.etcd_calls().len(), 1);
    assert_eq!(plugin.flushed("fanout.dedupe.in_progress"), 3);
}

#[test]
fn lapsed_records_and_claims_are_taken_over() {
    let mut plugin = FakeEnvoy::with_etcd(ETCD);
    // Later: the leases of then are granted by the timer.
    // At the recorded time (`record_etcd_fixtures`): the claim and the records lapsed.
    plugin.tick_at(1_100_000);
    plugin.grant_leases();
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    let claim = plugin.etcd_calls()[0].clone();
    // The claim compares its value with "<now, 20 digits>~": lower values lapsed.
    let below = format!("{:020}~", 1_100_000).into_bytes();
    let compared: Vec<Vec<u8>> = ops(&txn_of(&claim.body))
        .into_iter()
        .filter_map(|op| match op {
            Request::Txn(txn) => Some(txn.compare),
            _ => None,
        })
        .flatten()
        .filter_map(|c| match c.against {
            Some(Against::Value(v)) => Some(v),
            _ => None,
        })
        .collect();
    assert_eq!(compared, vec![below], "one claim for the event");
    plugin.answer_etcd(&mut ctx, claim.token, &fixture("claim_lapsed"));
    assert_eq!(plugin.subscriber_calls().len(), 3);
}

#[test]
fn an_unreachable_store_delivers_to_everyone_and_counts() {
    let not_a_txn = EtcdAnswer {
        body: vec![0, 0, 0, 0, 2, 0xff, 0xff],
        ..fixture("claim_fresh")
    };
    let no_responses = EtcdAnswer {
        body: etcd::proto::frame(&etcd::proto::TxnResponse::default()),
        ..fixture("claim_fresh")
    };
    let untold = EtcdAnswer {
        grpc: None,
        ..fixture("claim_fresh")
    };
    for (what, answer) in [
        ("no answer", not_grpc(None, b"")),
        ("Envoy's 503", not_grpc(Some(503), b"no healthy upstream")),
        ("HTTP/1.1 to etcd", not_grpc(Some(404), b"Not Found")),
        ("not a txn", not_a_txn),
        ("no responses", no_responses),
        ("no grpc-status", untold),
        ("a gRPC error", fixture("lease_not_found")),
    ] {
        let mut plugin = FakeEnvoy::with_etcd(ETCD);
        let mut ctx = send(&plugin, &event("e1"), b"{}");
        let claim = plugin.etcd_calls()[0].clone();
        plugin.answer_etcd(&mut ctx, claim.token, &answer);
        let calls = plugin.subscriber_calls();
        assert_eq!(calls.len(), 3, "{what}");
        for (token, _) in calls {
            plugin.answer_call(&mut ctx, token, Some(200), "");
        }
        let answer = plugin.last_answer();
        assert_eq!(answer.status, 202);
        // Delivered without dedupe: the sender is told its outcome is not recorded.
        assert_eq!(
            FakeEnvoy::header(&answer, NOT_RECORDED_HEADER).as_deref(),
            Some("1"),
            "{what}"
        );
        assert_eq!(plugin.flushed("fanout.dedupe.store_errors"), 1);
        // Nothing was claimed: nothing to settle.
        assert_eq!(plugin.etcd_calls().len(), 1);
    }
}

#[test]
fn reject_answers_503_and_calls_nobody() {
    let json = ETCD.replace(
        "\"timeout_ms\": 250}}",
        "\"timeout_ms\": 250}}, \"on_store_error\": \"reject\"",
    );
    let mut plugin = FakeEnvoy::with_etcd(&json);
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    let claim = plugin.etcd_calls()[0].clone();
    plugin.answer_etcd(&mut ctx, claim.token, &not_grpc(None, b""));
    assert!(plugin.subscriber_calls().is_empty());
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 503);
    assert_eq!(
        FakeEnvoy::header(&answer, "retry-after").as_deref(),
        Some("1")
    );
    assert_eq!(plugin.flushed("fanout.dedupe.store_errors"), 1);
}

#[test]
fn a_request_before_the_first_lease_waits_for_it() {
    let mut plugin = FakeEnvoy::configured(ETCD);
    plugin.tick_at(0);
    let mut ctx = open(&plugin, 10, "e1");
    assert!(plugin.etcd_calls().is_empty(), "no claim without a lease");
    assert!(plugin.subscriber_calls().is_empty() && plugin.answers().is_empty());
    // The grants come back: the claim goes out at once, for the root.
    plugin.grant_leases();
    let claim = plugin.etcd_calls()[0].clone();
    assert_eq!(claim.context, ROOT);
    plugin.answer_etcd_root(claim.token, &fixture("claim_fresh"));
    assert_eq!(plugin.root_subscriber_calls().len(), 3);
    assert_eq!(plugin.state().value("fanout.dedupe.store_errors"), 0);
    assert!(ctx.on_done());
}

#[test]
fn without_a_lease_within_the_store_timeout_on_store_error_decides_and_counts() {
    for (on_store_error, status, calls) in [("deliver", None, 3), ("reject", Some(503), 0)] {
        let json = ETCD.replace(
            "\"timeout_ms\": 250}}",
            &format!("\"timeout_ms\": 250}}}}, \"on_store_error\": \"{on_store_error}\""),
        );
        let mut plugin = FakeEnvoy::configured(&json);
        plugin.tick_at(0);
        let _ctx = open(&plugin, 10, "e1");
        plugin.tick_at(200);
        assert!(plugin.subscriber_calls().is_empty(), "it still waits");
        assert_eq!(plugin.state().tick_period, Some(Duration::from_millis(10)));
        plugin.tick_at(250);
        assert!(plugin.etcd_calls().is_empty(), "no claim without a lease");
        assert_eq!(plugin.subscriber_calls().len(), calls, "{on_store_error}");
        assert_eq!(plugin.answers().first().map(|a| a.status), status);
        assert_eq!(plugin.flushed("fanout.dedupe.store_errors"), 1);
    }
}

#[test]
fn a_request_without_an_identity_costs_no_etcd_call() {
    let mut plugin = FakeEnvoy::with_etcd(ETCD);
    let _ctx = send(&plugin, &post("orders.default"), b"{}");
    assert!(plugin.etcd_calls().is_empty());
    assert_eq!(plugin.subscriber_calls().len(), 3);
    assert_eq!(plugin.flushed("fanout.dedupe.missing_key"), 1);
}

#[test]
fn a_failed_settle_is_counted_and_grants_again_when_the_lease_is_lost() {
    let mut plugin = FakeEnvoy::with_etcd(ETCD);
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    let claim = plugin.etcd_calls()[0].clone();
    plugin.answer_etcd(&mut ctx, claim.token, &fixture("claim_fresh"));
    for (token, _) in plugin.subscriber_calls() {
        plugin.answer_call(&mut ctx, token, Some(200), "");
    }
    let settle = plugin.etcd_calls().last().cloned().unwrap();
    let grants_before = plugin.state().dispatched.len();
    assert!(
        plugin.answers().is_empty(),
        "the answer waits for the settle"
    );
    plugin.answer_etcd_root(settle.token, &fixture("lease_not_found"));
    assert_eq!(plugin.flushed("fanout.dedupe.store_errors"), 1);
    // Everyone took the event: still a 202 (an error would have the sender redeliver it to
    // everyone), saying that it is not recorded.
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 202);
    assert_eq!(
        FakeEnvoy::header(&answer, NOT_RECORDED_HEADER).as_deref(),
        Some("1")
    );
    // The leases are asked for again at the next tick.
    plugin.tick_at(2_000);
    let grants = plugin.state().dispatched[grants_before..]
        .iter()
        .filter(|d| header_of(d, ":path").as_deref() == Some(etcd::GRANT_PATH))
        .count();
    assert!(grants >= 2, "{grants}");
}

#[test]
fn a_settle_whose_answer_never_comes_lets_the_answer_go_counted() {
    let mut plugin = FakeEnvoy::with_etcd(ETCD);
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    let claim = plugin.etcd_calls()[0].clone();
    plugin.answer_etcd(&mut ctx, claim.token, &fixture("claim_fresh"));
    for (token, _) in plugin.subscriber_calls() {
        plugin.answer_call(&mut ctx, token, Some(200), "");
    }
    assert_eq!(plugin.etcd_calls().len(), 2, "the settle is out");
    // Envoy answers a timed-out call itself; if even that never comes, the timer gives up
    // a second after the timeout (250 ms).
    plugin.tick_at(1_249);
    assert!(plugin.answers().is_empty());
    plugin.tick_at(1_250);
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 202);
    assert_eq!(
        FakeEnvoy::header(&answer, NOT_RECORDED_HEADER).as_deref(),
        Some("1")
    );
    assert_eq!(plugin.flushed("fanout.dedupe.store_errors"), 1);
    assert_eq!(plugin.state().value("fanout.in_flight"), 0);
}

#[test]
fn a_claim_refused_for_a_lost_lease_has_the_leases_granted_again() {
    let mut plugin = FakeEnvoy::with_etcd(ETCD);
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    let claim = plugin.etcd_calls()[0].clone();
    let grants_before = plugin.state().dispatched.len();
    plugin.answer_etcd(&mut ctx, claim.token, &fixture("lease_not_found"));
    assert_eq!(
        plugin.subscriber_calls().len(),
        3,
        "on_store_error: deliver"
    );
    assert_eq!(plugin.flushed("fanout.dedupe.store_errors"), 1);
    // The next request waits for the new leases, asked for at the next tick.
    let _next = open(&plugin, 20, "e2");
    assert_eq!(plugin.etcd_calls().len(), 1, "no claim on a lost lease");
    plugin.tick_at(10);
    let grants = plugin.state().dispatched[grants_before..]
        .iter()
        .filter(|d| header_of(d, ":path").as_deref() == Some(etcd::GRANT_PATH))
        .count();
    assert!(grants >= 2, "{grants}");
}

#[test]
fn the_timer_runs_fast_only_while_the_store_owes_something() {
    let mut plugin = FakeEnvoy::with_etcd(ETCD);
    // The leases granted, nothing owed: a tick every LEASE_TICK, not every 10 ms.
    plugin.tick_at(10);
    assert_eq!(plugin.state().tick_period, Some(remote::LEASE_TICK));
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    let claim = plugin.etcd_calls()[0].clone();
    plugin.answer_etcd(&mut ctx, claim.token, &fixture("claim_fresh"));
    for (token, _) in plugin.subscriber_calls() {
        plugin.answer_call(&mut ctx, token, Some(200), "");
    }
    // The settle went out at once; owed, it asked for the fast timer.
    assert_eq!(plugin.etcd_calls().len(), 2);
    assert_eq!(plugin.state().tick_period, Some(Duration::from_millis(10)));
    let settle = plugin.etcd_calls().last().cloned().unwrap();
    // In flight: still owed, still fast, and sent once.
    plugin.tick_at(30);
    assert_eq!(plugin.state().tick_period, Some(Duration::from_millis(10)));
    assert_eq!(plugin.etcd_calls().len(), 2);
    plugin.answer_etcd_root(settle.token, &fixture("settle"));
    assert_eq!(plugin.last_answer().status, 202);
    plugin.tick_at(40);
    assert_eq!(plugin.state().tick_period, Some(remote::LEASE_TICK));
    assert_eq!(plugin.flushed("fanout.in_flight"), 0);
}

#[test]
fn the_settles_queued_while_one_is_in_flight_go_out_as_one_txn() {
    let mut plugin = FakeEnvoy::with_etcd(ETCD);
    // Each claimed before the next comes (no claim coalesced).
    let mut ctxs = Vec::new();
    for (i, id) in ["e1", "e2", "e3"].into_iter().enumerate() {
        let mut ctx = open(&plugin, 10 + i as u32, id);
        let claim = plugin.etcd_calls().last().cloned().unwrap();
        plugin.answer_etcd_on(
            &mut ctx,
            10 + i as u32,
            claim.token,
            &fixture("claim_fresh"),
        );
        ctxs.push(ctx);
    }
    let calls = plugin.subscriber_calls();
    assert_eq!(calls.len(), 9);
    // e1 ends: its settle goes out at once.
    for (token, _) in &calls[..3] {
        plugin.answer_call(&mut ctxs[0], *token, Some(200), "");
    }
    let first = plugin.etcd_calls().last().cloned().unwrap();
    assert_eq!(plugin.etcd_calls().len(), 4, "three claims, e1's settle");
    // e2 (shipping fails, its claim is released in the same txn) and e3 end meanwhile: they
    // wait for e1's settle.
    for (i, (token, _)) in calls[3..].iter().enumerate() {
        let status = if i == 1 { 503 } else { 200 };
        plugin.answer_call(&mut ctxs[1 + i / 3], *token, Some(status), "");
    }
    assert_eq!(plugin.etcd_calls().len(), 4);
    assert!(plugin.answers().is_empty());
    plugin.answer_etcd_root(first.token, &fixture("settle"));
    assert_eq!(plugin.answers().len(), 1, "e1's answer");
    let txns = plugin.etcd_calls();
    assert_eq!(txns.len(), 5, "one settle for e2 and e3");
    assert_eq!(txns[4].context, ROOT);
    let values = puts(&txns[4].body);
    assert_eq!(values.len(), 2, "the records of e2, of e3: {values:?}");
    assert_eq!(
        records_of(&values[0])
            .into_iter()
            .map(|r| r.0)
            .collect::<Vec<_>>(),
        ["billing", "analytics"]
    );
    assert_eq!(records_of(&values[1]).len(), 3);
    assert_eq!(deletes(&txns[4].body), 2, "both claims released");
    assert_eq!(plugin.flushed("fanout.in_flight"), 2);
    plugin.answer_etcd_root(txns[4].token, &fixture("settle"));
    let statuses: Vec<u32> = plugin.answers().iter().map(|a| a.status).collect();
    assert_eq!(statuses, [202, 500, 202]);
    assert_eq!(plugin.flushed("fanout.in_flight"), 0);
    assert_eq!(plugin.state().value("fanout.dedupe.store_errors"), 0);
}

#[test]
fn a_failed_settle_txn_counts_each_settle_in_it() {
    let mut plugin = FakeEnvoy::with_etcd(ETCD);
    let mut ctxs = Vec::new();
    for (i, id) in ["e1", "e2"].into_iter().enumerate() {
        let mut ctx = open(&plugin, 10 + i as u32, id);
        let claim = plugin.etcd_calls().last().cloned().unwrap();
        plugin.answer_etcd_on(
            &mut ctx,
            10 + i as u32,
            claim.token,
            &fixture("claim_fresh"),
        );
        ctxs.push(ctx);
    }
    // e1's settle goes out at once; e2's waits for it, and goes out at the tick.
    let calls = plugin.subscriber_calls();
    for (i, (token, _)) in calls.iter().enumerate() {
        plugin.answer_call(&mut ctxs[i / 3], *token, Some(200), "");
    }
    plugin.tick_at(10);
    let settles = plugin.etcd_calls()[2..].to_vec();
    assert_eq!(settles.len(), 2);
    for settle in &settles {
        plugin.answer_etcd_root(settle.token, &not_grpc(None, b""));
    }
    assert_eq!(plugin.flushed("fanout.dedupe.store_errors"), 2);
    assert_eq!(plugin.state().value("fanout.in_flight"), 0);
    for answer in plugin.answers() {
        assert_eq!(answer.status, 202);
        assert_eq!(
            FakeEnvoy::header(&answer, NOT_RECORDED_HEADER).as_deref(),
            Some("1")
        );
    }
}

/// Where the etcd store's own work per event goes (N = 3, natively): the claim body, reading
/// etcd's answer to it, the settle body. Run with
/// `cargo test --release --lib etcd_store_cost -- --ignored --nocapture`.
#[test]
#[ignore]
fn etcd_store_cost_per_event() {
    let config = Config::from_json(ETCD.as_bytes()).unwrap();
    let ids: Vec<u64> = config.channels[0]
        .subscribers
        .iter()
        .map(|s| s.dedupe_id)
        .collect();
    let answer = fixture("claim_fresh");
    let reply = etcd::Reply {
        status: Some(200),
        grpc_status: Some("0".into()),
        grpc_message: None,
        body: answer.body.clone(),
    };
    let n = 20_000u32;
    let (claim_key, records_key) = etcd::keys("/fanout/", "orders", b"0b8e4c8a-2f7e-4a51");
    let value = etcd::claim_value(1, 2);
    let records: Vec<etcd::Record> = ids
        .iter()
        .map(|&subscriber| etcd::Record {
            subscriber,
            until_ms: 1_000_000,
        })
        .collect();
    let time = |what: &str, f: &mut dyn FnMut() -> usize| {
        let start = std::time::Instant::now();
        let mut bytes = 0;
        for _ in 0..n {
            bytes += f();
        }
        eprintln!(
            "{what}: {:?} per event ({} bytes)",
            start.elapsed() / n,
            bytes / n as usize
        );
    };
    time("claim body", &mut || {
        let op = etcd::ClaimOp {
            key: &claim_key,
            value: &value,
            records: &records_key,
            lease: 7_587_868_122_391_046_144,
            now_ms: 1_000_000,
        };
        etcd::claim_body(&[op]).len()
    });
    time("claim answer read", &mut || {
        let message = etcd::read_answer(&reply).unwrap();
        etcd::read_claim(message, 1).unwrap().len() + reply.body.len()
    });
    time("settle body", &mut || {
        let put = etcd::records_value(&records);
        let op = etcd::SettleOp {
            claim_key: &claim_key,
            claim: &value,
            records: Some((&records_key, &put)),
        };
        etcd::settle_body(&[op], 7).len()
    });
}

/// A request on its own stream context `id` (requests at once need distinct ones).
fn open(plugin: &FakeEnvoy, id: u32, event_id: &str) -> Stream<FakeHost> {
    let mut state = plugin.host.0.borrow_mut();
    state.request_headers = event(event_id)
        .iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect();
    state.request_body = b"{}".to_vec();
    state.effective = id;
    drop(state);
    let mut ctx = plugin.root.create_stream(id);
    assert_eq!(ctx.on_request_headers(false), Flow::Pause);
    assert_eq!(ctx.on_request_body(2, true), Flow::Pause);
    ctx
}

impl FakeEnvoy {
    /// etcd answers the claim of the stream on context `id`.
    fn answer_etcd_on(&self, ctx: &mut Stream<FakeHost>, id: u32, token: u32, answer: &EtcdAnswer) {
        let num_headers = self.host.0.borrow_mut().set_etcd_answer(answer, id);
        ctx.on_call_response(token, num_headers, answer.body.len());
        self.host.0.borrow_mut().call_response_trailers.clear();
    }

    /// A subscriber answers one of the root's calls.
    fn answer_root(&mut self, token: u32, status: u16) {
        self.answer_root_call(token, Some(status), "", &[]);
    }

    fn root_subscriber_calls(&self) -> Vec<(u32, String)> {
        self.state()
            .dispatched
            .iter()
            .filter(|d| d.cluster != "etcd" && d.context == ROOT)
            .map(|d| (d.token, d.cluster.clone()))
            .collect()
    }
}

#[test]
fn claims_that_come_while_one_is_in_flight_go_out_as_one_txn_for_the_root() {
    let mut plugin = FakeEnvoy::with_etcd(ETCD);
    // At the batch's recorded time (`record_etcd_fixtures`): its first event's records lapsed.
    plugin.tick_at(1_100_005);
    plugin.grant_leases();
    let mut first = open(&plugin, 10, "e1");
    assert_eq!(plugin.etcd_calls().len(), 1, "nothing in flight: at once");
    // Two more while e1's claim is in flight: parked, nobody called, nothing sent yet.
    let mut second = open(&plugin, 11, "e2");
    let mut third = open(&plugin, 12, "e3");
    assert_eq!(plugin.etcd_calls().len(), 1);
    assert!(plugin.subscriber_calls().is_empty());
    assert!(plugin.answers().is_empty());
    // e1's claim comes back: e1 is called from its stream, and e2 and e3 go out in one txn,
    // made for the root context.
    let claim = plugin.etcd_calls()[0].clone();
    plugin.answer_etcd_on(&mut first, 10, claim.token, &fixture("claim_fresh"));
    let txns = plugin.etcd_calls();
    assert_eq!(txns.len(), 2);
    let batch = txns[1].clone();
    assert_eq!(batch.context, ROOT);
    let keys = claimed_keys(&batch.body);
    let text: Vec<String> = keys
        .iter()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .collect();
    assert_eq!(text, ["/fanout/6:orders/e2/c", "/fanout/6:orders/e3/c"]);
    assert_eq!(plugin.subscriber_calls().len(), 3, "e1's three only");
    // The batch's answer (recorded: the first request's subscribers in progress elsewhere,
    // the second's claimed): e2 gets 409 at once, e3 is called from the root.
    plugin.answer_etcd_root(batch.token, &fixture("claim_batch"));
    let calls = plugin.root_subscriber_calls();
    assert_eq!(
        calls.iter().map(|c| c.1.as_str()).collect::<Vec<_>>(),
        ["billing", "shipping", "analytics"]
    );
    assert_eq!(plugin.state().answered_streams, [11]);
    assert_eq!(plugin.last_answer().status, 409);
    for (token, _) in calls {
        plugin.answer_root(token, 200);
    }
    // e3's answer waits for its settle, sent by the root.
    assert_eq!(plugin.state().answered_streams, [11]);
    let settle = plugin.etcd_calls().last().cloned().unwrap();
    assert_eq!(settle.context, ROOT);
    plugin.answer_etcd_root(settle.token, &fixture("settle"));
    assert_eq!(plugin.state().answered_streams, [11, 12]);
    assert_eq!(plugin.last_answer().status, 202);
    // The streams learn it at their next callback: the answer coming back through them.
    assert_eq!(second.on_response_headers(), Flow::Continue);
    assert_eq!(third.on_response_headers(), Flow::Continue);
    assert!(second.on_done() && third.on_done());
    // e1 ends as always.
    for (token, _) in plugin.subscriber_calls().into_iter().take(3) {
        plugin.answer_call(&mut first, token, Some(200), "");
    }
    let settle = plugin.etcd_calls().last().cloned().unwrap();
    plugin.answer_etcd_root(settle.token, &fixture("settle"));
    assert_eq!(plugin.answers().len(), 3);
    assert_eq!(plugin.flushed("fanout.dedupe.in_progress"), 3);
    assert_eq!(plugin.state().value("fanout.dedupe.store_errors"), 0);
}

#[test]
fn a_failed_batch_gives_each_request_in_it_what_on_store_error_says() {
    for (on_error, status) in [("deliver", 202), ("reject", 503)] {
        let json = ETCD.replace(
            "\"timeout_ms\": 250}}",
            &format!("\"timeout_ms\": 250}}}}, \"on_store_error\": \"{on_error}\""),
        );
        let mut plugin = FakeEnvoy::with_etcd(&json);
        let mut first = open(&plugin, 10, "e1");
        let _second = open(&plugin, 11, "e2");
        let _third = open(&plugin, 12, "e3");
        let claim = plugin.etcd_calls()[0].clone();
        plugin.answer_etcd_on(&mut first, 10, claim.token, &fixture("claim_fresh"));
        let batch = plugin.etcd_calls()[1].clone();
        plugin.answer_etcd_root(batch.token, &not_grpc(None, b""));
        let calls = plugin.root_subscriber_calls();
        if on_error == "deliver" {
            assert_eq!(calls.len(), 6, "everyone, as if dedupe were off");
            for (token, _) in calls {
                plugin.answer_root(token, 200);
            }
        } else {
            assert!(calls.is_empty(), "nobody called");
        }
        assert_eq!(plugin.state().answered_streams, [11, 12]);
        assert!(plugin.answers().iter().all(|a| a.status == status));
        assert_eq!(
            plugin.flushed("fanout.dedupe.store_errors"),
            2,
            "{on_error}"
        );
    }
}

#[test]
fn a_parked_request_whose_client_leaves_is_dropped_before_its_claim() {
    let plugin = FakeEnvoy::with_etcd(ETCD);
    let mut first = open(&plugin, 10, "e1");
    let mut gone = open(&plugin, 11, "e2");
    let _kept = open(&plugin, 12, "e3");
    assert!(gone.on_done());
    let claim = plugin.etcd_calls()[0].clone();
    plugin.answer_etcd_on(&mut first, 10, claim.token, &fixture("claim_fresh"));
    let batch = plugin.etcd_calls()[1].clone();
    let keys = claimed_keys(&batch.body);
    assert_eq!(keys, [b"/fanout/6:orders/e3/c".to_vec()], "only e3's claim");
}

#[test]
fn the_claims_go_out_when_the_stream_whose_claim_was_in_flight_ends() {
    // Its client left: Envoy cancels its calls, so no answer will land.
    let plugin = FakeEnvoy::with_etcd(ETCD);
    let mut first = open(&plugin, 10, "e1");
    let _second = open(&plugin, 11, "e2");
    assert!(first.on_done());
    let txns = plugin.etcd_calls();
    assert_eq!(txns.len(), 2);
    assert_eq!(txns[1].context, ROOT);
}

#[test]
fn two_copies_of_one_event_never_share_a_txn() {
    // etcd refuses a txn that writes a key twice.
    let mut plugin = FakeEnvoy::with_etcd(ETCD);
    let mut first = open(&plugin, 10, "e1");
    let _a = open(&plugin, 11, "e2");
    let _b = open(&plugin, 12, "e2");
    let claim = plugin.etcd_calls()[0].clone();
    plugin.answer_etcd_on(&mut first, 10, claim.token, &fixture("claim_fresh"));
    let batch = plugin.etcd_calls()[1].clone();
    assert_eq!(claimed_keys(&batch.body).len(), 1, "one copy now");
    plugin.answer_etcd_root(batch.token, &fixture("claim_fresh"));
    let next = plugin.etcd_calls();
    assert_eq!(next.len(), 3, "the other copy in the next txn");
    assert_eq!(next[2].context, ROOT);
    assert_eq!(claimed_keys(&next[2].body), claimed_keys(&batch.body));
}

#[test]
fn a_request_whose_client_leaves_while_its_claim_is_in_the_roots_txn_is_not_answered() {
    let mut plugin = FakeEnvoy::with_etcd(ETCD);
    plugin.tick_at(1_100_005);
    plugin.grant_leases();
    let mut first = open(&plugin, 10, "e1");
    let _second = open(&plugin, 11, "e2");
    let mut third = open(&plugin, 12, "e3");
    let claim = plugin.etcd_calls()[0].clone();
    plugin.answer_etcd_on(&mut first, 10, claim.token, &fixture("claim_fresh"));
    let batch = plugin.etcd_calls()[1].clone();
    assert_eq!(batch.context, ROOT);
    // e3's client leaves while its claim is in the root's txn: its answer finds nobody.
    assert!(third.on_done());
    let settles_before = plugin.etcd_calls().len();
    // The batch's answer: e2 in progress elsewhere (409), e3 claimed, and released at once.
    plugin.answer_etcd_root(batch.token, &fixture("claim_batch"));
    assert_eq!(plugin.state().answered_streams, [11]);
    assert_eq!(plugin.last_answer().status, 409);
    let settle = plugin.etcd_calls().last().cloned().unwrap();
    assert_eq!(plugin.etcd_calls().len(), settles_before + 1, "e3's settle");
    assert_eq!(settle.context, ROOT);
    plugin.answer_etcd_root(settle.token, &fixture("settle"));
    assert_eq!(plugin.state().answered_streams, [11], "nobody answers e3");
}
