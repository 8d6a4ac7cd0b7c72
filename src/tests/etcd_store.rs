//! `dedupe` with the `etcd` store: the store's decisions (claim, conflict, record, expiry,
//! errors) on the fake host, etcd's answers being the ones etcd 3.5.1 gave to these very
//! requests (`tests/fixtures/etcd/`, recorded by `record_etcd_fixtures` below).

use super::*;
use crate::config::Config;
use crate::dedupe::{etcd, remote};

const ETCD: &str = r#"{
  "dedupe": {"key": "ce-id", "ttl_ms": 60000,
             "store": {"etcd": {"cluster": "etcd", "prefix": "/fanout/", "timeout_ms": 250}}},
  "channels": [
    {"name": "orders", "hosts": ["orders.default"], "subscribers": [
      {"cluster": "billing"}, {"cluster": "shipping"}, {"cluster": "analytics"}
    ]}
  ]
}"#;

/// A recorded answer of etcd 3.5.1.
fn fixture(name: &str) -> String {
    let text = match name {
        "grant" => include_str!("../../tests/fixtures/etcd/grant.json"),
        "claim_fresh" => include_str!("../../tests/fixtures/etcd/claim_fresh.json"),
        "settle" => include_str!("../../tests/fixtures/etcd/settle.json"),
        "claim_retry" => include_str!("../../tests/fixtures/etcd/claim_retry.json"),
        "claim_conflict" => include_str!("../../tests/fixtures/etcd/claim_conflict.json"),
        "claim_lapsed" => include_str!("../../tests/fixtures/etcd/claim_lapsed.json"),
        "lease_not_found" => include_str!("../../tests/fixtures/etcd/lease_not_found.json"),
        other => panic!("no fixture {other}"),
    };
    text.trim().to_string()
}

fn base64_decode(text: &str) -> Vec<u8> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .unwrap()
}

/// The values a txn body puts, decoded, in order.
fn puts(body: &[u8]) -> Vec<String> {
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(map) => {
                if let Some(put) = map.get("request_put") {
                    let value = put["value"].as_str().unwrap();
                    out.push(String::from_utf8(base64_decode(value)).unwrap());
                }
                for (k, child) in map {
                    if k != "request_put" {
                        walk(child, out);
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|i| walk(i, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(&serde_json::from_slice(body).unwrap(), &mut out);
    out
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
            self.answer_root_call(token, Some(200), &fixture("grant"), &[]);
        }
    }

    fn etcd_calls(&self) -> Vec<Dispatched> {
        self.state()
            .dispatched
            .iter()
            .filter(|d| {
                d.cluster == "etcd" && header_of(d, ":path").as_deref() == Some("/v3/kv/txn")
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
            Some("/v3/lease/grant")
        );
        assert_eq!(grant.timeout, Duration::from_millis(250));
    }
    // The records' lease: ttl 60 s, buckets of 6 s, the first granted at 0 for 12 s... 67 s.
    let ttl: Value = serde_json::from_slice(&grants[0].body).unwrap();
    assert_eq!(ttl["TTL"], "67");
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
    // Each subscriber's claim twice (create, or take over a lapsed value).
    assert_eq!(values.len(), 6);
    assert!(
        values.iter().all(|v| v.as_bytes()[20] == b'c'),
        "{values:?}"
    );
    plugin.answer_call(
        &mut ctx,
        claims[0].token,
        Some(200),
        &fixture("claim_fresh"),
    );
    let calls = plugin.subscriber_calls();
    assert_eq!(
        calls.iter().map(|c| c.1.as_str()).collect::<Vec<_>>(),
        ["billing", "shipping", "analytics"]
    );
    plugin.answer_call(&mut ctx, calls[0].0, Some(200), "");
    plugin.answer_call(&mut ctx, calls[1].0, Some(503), "down");
    plugin.answer_call(&mut ctx, calls[2].0, Some(200), "");
    assert_eq!(plugin.last_answer().status, 500);
    // The settle goes out from the root context, at its next tick; until etcd answers it,
    // it is work owed (in `fanout.in_flight`).
    assert_eq!(plugin.etcd_calls().len(), 1);
    let now = plugin.state().now_ms;
    assert_eq!(plugin.flushed("fanout.in_flight"), 1);
    let settle = plugin.etcd_calls().last().cloned().unwrap();
    assert_eq!(settle.context, ROOT);
    let values = puts(&settle.body);
    assert_eq!(
        values.len(),
        2,
        "a record for billing and analytics: {values:?}"
    );
    assert!(values.iter().all(|v| v.ends_with('d')));
    // Delivered when the fan-out ended: forgotten ttl_ms later.
    assert_eq!(values[0][..20].parse::<u64>().unwrap(), now + 60_000);
    let text = String::from_utf8(settle.body.clone()).unwrap();
    assert!(
        text.contains("request_delete_range"),
        "shipping's claim released: {text}"
    );
    plugin.answer_root_call(settle.token, Some(200), &fixture("settle"), &[]);
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
    plugin.answer_call(&mut ctx, claim.token, Some(200), &fixture("claim_retry"));
    let calls = plugin.subscriber_calls();
    assert_eq!(
        calls[before..]
            .iter()
            .map(|c| c.1.as_str())
            .collect::<Vec<_>>(),
        ["shipping"]
    );
    plugin.answer_call(&mut ctx, calls[before].0, Some(200), "");
    let answer = plugin.last_answer();
    assert_eq!(answer.status, 202);
    assert_eq!(
        report(&answer)["already_delivered"],
        serde_json::json!(["billing", "analytics"])
    );
    assert_eq!(plugin.flushed("fanout.dedupe.skipped"), 2);
    assert_eq!(plugin.state().value("fanout.dedupe.store_errors"), 0);
}

#[test]
fn a_copy_in_flight_elsewhere_gets_409_and_calls_nobody() {
    let mut plugin = FakeEnvoy::with_etcd(ETCD);
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    let claim = plugin.etcd_calls()[0].clone();
    plugin.answer_call(&mut ctx, claim.token, Some(200), &fixture("claim_conflict"));
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
    plugin.tick_at(200_000);
    plugin.grant_leases();
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    let claim = plugin.etcd_calls()[0].clone();
    // The claim compares each value with "<now, 20 digits>~": lower values lapsed.
    let text = String::from_utf8(claim.body.clone()).unwrap();
    let below = base64::Engine::encode(
        &base64::engine::general_purpose::STANDARD,
        format!("{:020}~", 200_000),
    );
    assert!(text.contains(&below), "{text}");
    plugin.answer_call(&mut ctx, claim.token, Some(200), &fixture("claim_lapsed"));
    assert_eq!(plugin.subscriber_calls().len(), 3);
}

#[test]
fn an_unreachable_store_delivers_to_everyone_and_counts() {
    for (status, body) in [
        (None, String::new()),
        (Some(503), "no healthy upstream".to_string()),
        (Some(200), "not json".to_string()),
        (Some(200), "{\"responses\": []}".to_string()),
        (Some(404), fixture("lease_not_found")),
    ] {
        let mut plugin = FakeEnvoy::with_etcd(ETCD);
        let mut ctx = send(&plugin, &event("e1"), b"{}");
        let claim = plugin.etcd_calls()[0].clone();
        plugin.answer_call(&mut ctx, claim.token, status, &body);
        let calls = plugin.subscriber_calls();
        assert_eq!(calls.len(), 3, "{status:?} {body}");
        for (token, _) in calls {
            plugin.answer_call(&mut ctx, token, Some(200), "");
        }
        assert_eq!(plugin.last_answer().status, 202);
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
    plugin.answer_call(&mut ctx, claim.token, None, "");
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
fn without_a_lease_yet_the_store_counts_as_failed() {
    let mut plugin = FakeEnvoy::configured(ETCD);
    let _ctx = send(&plugin, &event("e1"), b"{}");
    assert!(plugin.etcd_calls().is_empty(), "no claim without a lease");
    assert_eq!(plugin.subscriber_calls().len(), 3);
    assert_eq!(plugin.flushed("fanout.dedupe.store_errors"), 1);
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
    plugin.answer_call(&mut ctx, claim.token, Some(200), &fixture("claim_fresh"));
    for (token, _) in plugin.subscriber_calls() {
        plugin.answer_call(&mut ctx, token, Some(200), "");
    }
    plugin.tick_at(10);
    let settle = plugin.etcd_calls().last().cloned().unwrap();
    let grants_before = plugin.state().dispatched.len();
    plugin.answer_root_call(settle.token, Some(404), &fixture("lease_not_found"), &[]);
    assert_eq!(plugin.flushed("fanout.dedupe.store_errors"), 1);
    // The leases are asked for again at the next tick.
    plugin.tick_at(2_000);
    let grants = plugin.state().dispatched[grants_before..]
        .iter()
        .filter(|d| header_of(d, ":path").as_deref() == Some(etcd::GRANT_PATH))
        .count();
    assert!(grants >= 2, "{grants}");
}

/// Records etcd's answers to the requests fanout makes, into `tests/fixtures/etcd/`: run
/// against an etcd 3.5.1 on loopback with
/// `FANOUT_ETCD_RECORD=127.0.0.1:2379 cargo test --lib record_etcd_fixtures -- --ignored`.
#[test]
#[ignore]
fn record_etcd_fixtures() {
    let addr = std::env::var("FANOUT_ETCD_RECORD").expect("FANOUT_ETCD_RECORD=host:port");
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/etcd");
    std::fs::create_dir_all(dir).unwrap();
    let post = |path: &str, body: &str| -> (u16, String) {
        use std::io::{Read, Write};
        let mut conn = std::net::TcpStream::connect(&addr).unwrap();
        write!(
            conn,
            "POST {path} HTTP/1.1\r\nHost: etcd\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).unwrap();
        let status = answer[9..12].parse().unwrap();
        let body = answer.split("\r\n\r\n").nth(1).unwrap().to_string();
        (status, body)
    };
    let save = |name: &str, (status, body): (u16, String)| {
        println!("{name}: {status} {body}");
        std::fs::write(format!("{dir}/{name}.json"), format!("{}\n", body.trim())).unwrap();
        body
    };
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
    let keys: Vec<Vec<u8>> = ids
        .iter()
        .map(|id| etcd::key("/fanout/", "orders", run.as_bytes(), *id))
        .collect();
    let grant = save("grant", post(etcd::GRANT_PATH, &etcd::grant_body(120)));
    let lease: i64 = serde_json::from_str::<Value>(&grant).unwrap()["ID"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let now = 1_000_000;
    let claim = |owner: u64, until: u64, now: u64| {
        let values: Vec<String> = keys
            .iter()
            .map(|_| etcd::claim_value(until, owner))
            .collect();
        let ops: Vec<etcd::ClaimOp<'_>> = keys
            .iter()
            .zip(&values)
            .map(|(key, value)| etcd::ClaimOp { key, value })
            .collect();
        (etcd::claim_body(&ops, lease, now), values)
    };
    // The first delivery: all three claimed by owner 1.
    let (body, first) = claim(1, now + 10_000, now);
    save("claim_fresh", post(etcd::TXN_PATH, &body));
    // A copy at the same time: all three claimed by owner 1.
    let (body, _) = claim(2, now + 10_000, now + 5);
    save("claim_conflict", post(etcd::TXN_PATH, &body));
    // Billing and analytics took it, shipping failed.
    let record = etcd::delivered_value(now + 60_000);
    let delivered: Vec<(&[u8], &str)> = vec![(&keys[0], &record), (&keys[2], &record)];
    let released: Vec<(&[u8], &str)> = vec![(&keys[1], &first[1])];
    save(
        "settle",
        post(
            etcd::TXN_PATH,
            &etcd::settle_body(&delivered, &released, lease),
        ),
    );
    // The redelivery: two records, shipping's key gone.
    let (body, _) = claim(3, now + 20_000, now + 10);
    save("claim_retry", post(etcd::TXN_PATH, &body));
    // After the ttl: the records and shipping's claim lapsed, taken over.
    let (body, _) = claim(4, now + 200_000, now + 100_000);
    save("claim_lapsed", post(etcd::TXN_PATH, &body));
    // A lease etcd does not have.
    let bad = etcd::settle_body(&delivered, &[], 7_777_777);
    let (status, body) = post(etcd::TXN_PATH, &bad);
    assert_eq!(status, 404, "{body}");
    save("lease_not_found", (status, body));
}

#[test]
fn the_timer_runs_fast_only_while_the_store_owes_something() {
    let mut plugin = FakeEnvoy::with_etcd(ETCD);
    // The leases granted, nothing owed: a tick every LEASE_TICK, not every 10 ms.
    plugin.tick_at(10);
    assert_eq!(plugin.state().tick_period, Some(remote::LEASE_TICK));
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    let claim = plugin.etcd_calls()[0].clone();
    plugin.answer_call(&mut ctx, claim.token, Some(200), &fixture("claim_fresh"));
    for (token, _) in plugin.subscriber_calls() {
        plugin.answer_call(&mut ctx, token, Some(200), "");
    }
    assert_eq!(plugin.last_answer().status, 202);
    // The answer went before the settle: queued, it asked for the fast timer.
    assert_eq!(plugin.etcd_calls().len(), 1);
    assert_eq!(plugin.state().tick_period, Some(Duration::from_millis(10)));
    plugin.tick_at(20);
    let settle = plugin.etcd_calls().last().cloned().unwrap();
    assert_eq!(
        plugin.etcd_calls().len(),
        2,
        "the settle went out at the tick"
    );
    // In flight: still owed, still fast.
    plugin.tick_at(30);
    assert_eq!(plugin.state().tick_period, Some(Duration::from_millis(10)));
    plugin.answer_root_call(settle.token, Some(200), &fixture("settle"), &[]);
    plugin.tick_at(40);
    assert_eq!(plugin.state().tick_period, Some(remote::LEASE_TICK));
    assert_eq!(plugin.flushed("fanout.in_flight"), 0);
}

#[test]
fn the_settles_of_one_tick_go_out_as_one_txn() {
    let mut plugin = FakeEnvoy::with_etcd(ETCD);
    let mut first = send(&plugin, &event("e1"), b"{}");
    let mut second = send(&plugin, &event("e2"), b"{}");
    let claims = plugin.etcd_calls();
    assert_eq!(claims.len(), 2);
    plugin.answer_call(
        &mut first,
        claims[0].token,
        Some(200),
        &fixture("claim_fresh"),
    );
    plugin.answer_call(
        &mut second,
        claims[1].token,
        Some(200),
        &fixture("claim_fresh"),
    );
    let calls = plugin.subscriber_calls();
    assert_eq!(calls.len(), 6);
    for (token, _) in &calls[..3] {
        plugin.answer_call(&mut first, *token, Some(200), "");
    }
    // e2: shipping fails, its claim is released in the same txn.
    for (i, (token, _)) in calls[3..].iter().enumerate() {
        let status = if i == 1 { 503 } else { 200 };
        plugin.answer_call(&mut second, *token, Some(status), "");
    }
    plugin.tick_at(10);
    let txns = plugin.etcd_calls();
    assert_eq!(txns.len(), 3, "two claims, one settle for both");
    assert_eq!(txns[2].context, ROOT);
    let values = puts(&txns[2].body);
    assert_eq!(
        values.len(),
        5,
        "three records of e1, two of e2: {values:?}"
    );
    let text = String::from_utf8(txns[2].body.clone()).unwrap();
    assert_eq!(text.matches("request_delete_range").count(), 1, "{text}");
    assert_eq!(plugin.flushed("fanout.in_flight"), 2);
    plugin.answer_root_call(txns[2].token, Some(200), &fixture("settle"), &[]);
    assert_eq!(plugin.flushed("fanout.in_flight"), 0);
    assert_eq!(plugin.state().value("fanout.dedupe.store_errors"), 0);
}

#[test]
fn a_failed_settle_txn_counts_each_settle_in_it() {
    let mut plugin = FakeEnvoy::with_etcd(ETCD);
    let mut ctxs: Vec<_> = ["e1", "e2"]
        .iter()
        .map(|id| send(&plugin, &event(id), b"{}"))
        .collect();
    let claims = plugin.etcd_calls();
    for (ctx, claim) in ctxs.iter_mut().zip(&claims) {
        plugin.answer_call(ctx, claim.token, Some(200), &fixture("claim_fresh"));
    }
    let calls = plugin.subscriber_calls();
    for (i, (token, _)) in calls.iter().enumerate() {
        plugin.answer_call(&mut ctxs[i / 3], *token, Some(200), "");
    }
    plugin.tick_at(10);
    let settle = plugin.etcd_calls().last().cloned().unwrap();
    plugin.answer_root_call(settle.token, None, "", &[]);
    assert_eq!(plugin.flushed("fanout.dedupe.store_errors"), 2);
    assert_eq!(plugin.state().value("fanout.in_flight"), 0);
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
    let n = 20_000u32;
    let keys: Vec<Vec<u8>> = ids
        .iter()
        .map(|id| etcd::key("/fanout/", "orders", b"0b8e4c8a-2f7e-4a51", *id))
        .collect();
    let values: Vec<String> = ids.iter().map(|_| etcd::claim_value(1, 2)).collect();
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
        let ops: Vec<etcd::ClaimOp<'_>> = keys
            .iter()
            .zip(&values)
            .map(|(key, value)| etcd::ClaimOp { key, value })
            .collect();
        etcd::claim_body(&ops, 7_587_868_122_391_046_144, 1_000_000).len()
    });
    time("claim answer read", &mut || {
        let node = etcd::read_answer(Some(200), answer.as_bytes()).unwrap();
        etcd::read_claim(&node, 3).unwrap().len() + answer.len()
    });
    time("settle body", &mut || {
        let d: Vec<(&[u8], &str)> = keys.iter().map(|k| (k.as_slice(), "x")).collect();
        etcd::settle_body(&d, &[], 7).len()
    });
}
