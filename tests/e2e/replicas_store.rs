//! One dedupe memory for every replica: two or three fanout Envoys sharing a three-member
//! etcd cluster (`dedupe.store.etcd`), all real processes on loopback. Each test sends to
//! replica A, then to replica B directly: what a round-robin front does at worst, made
//! deterministic. And the documented difference: the `envoy` store is one process's.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness;

use std::time::{Duration, Instant};

use harness::etcd::EtcdCluster;
use harness::{send, Behavior, Client, Envoy, Reply, Subscriber};
use serde_json::{json, Value};

pub(crate) const SOURCE: &str = "/e2e/replicas";

/// A fanout Envoy on channel `default/orders` of `subscribers`, with `dedupe`; the etcd
/// cluster `etcd` of `store`'s members when given.
pub(crate) fn replica(
    dedupe: Value,
    subscribers: &[&Subscriber],
    store: Option<&EtcdCluster>,
) -> Envoy {
    replica_with(dedupe, subscribers, store, None)
}

/// [`replica`], with `workers` Envoy worker threads (default 2).
pub(crate) fn replica_with(
    dedupe: Value,
    subscribers: &[&Subscriber],
    store: Option<&EtcdCluster>,
    workers: Option<u32>,
) -> Envoy {
    let config = json!({
        "dedupe": dedupe,
        "channels": [{ "name": "default/orders", "hosts": ["*"], "subscribers":
            subscribers.iter().map(|s| json!({ "cluster": s.name(), "timeout_ms": 5000 }))
                .collect::<Vec<_>>() }]
    });
    let mut builder = Envoy::builder().fanout(&config).subscribers(subscribers);
    if let Some(workers) = workers {
        builder = builder.concurrency(workers);
    }
    if let Some(etcd) = store {
        builder = builder
            .cluster("etcd", etcd.client_ports()[0])
            .cluster_field(
                "etcd",
                "load_assignment",
                etcd.envoy_load_assignment("etcd"),
            )
            .cluster_field("etcd", "health_checks", EtcdCluster::health_checks())
            .cluster_field(
                "etcd",
                "typed_extension_protocol_options",
                EtcdCluster::envoy_protocol_options(),
            );
    }
    // Ready: a sender sends at once (the first requests wait for the replica's first
    // leases).
    builder.start()
}

pub(crate) fn etcd_dedupe(prefix: &str, on_store_error: &str) -> Value {
    json!({
        "ttl_ms": 60000,
        "store": { "etcd": { "cluster": "etcd", "prefix": prefix, "timeout_ms": 1000 } },
        "on_store_error": on_store_error
    })
}

pub(crate) fn post(client: &Client, envoy: &Envoy, id: &str) -> Reply {
    let reply = send(
        client
            .post(&envoy.url("/"))
            .header("ce-source", SOURCE)
            .header("ce-id", id)
            .body("{}"),
    );
    reply.assert_not_tripwire();
    reply
}

pub(crate) fn counts(subs: &[&Subscriber]) -> Vec<usize> {
    subs.iter().map(|s| s.count()).collect()
}

/// The delivery records etcd holds under `prefix`: each event's records key (`.../d`) holds
/// `d` and one record (a subscriber's id, 16 hex digits, and a time, 20 digits) per subscriber
/// that took it.
pub(crate) fn records(etcd: &EtcdCluster, prefix: &str) -> usize {
    etcd.keys(prefix)
        .iter()
        .filter(|(k, v)| k.ends_with("/d") && v.starts_with('d') && (v.len() - 1) % 36 == 0)
        .map(|(_, v)| (v.len() - 1) / 36)
        .sum()
}

/// Asserts that etcd holds `n` delivery records under `prefix` now: a replica answers only
/// once its records are in etcd, so a sender that has the answer finds them there.
fn assert_records(etcd: &EtcdCluster, prefix: &str, n: usize) {
    let records = records(etcd, prefix);
    assert_eq!(records, n, "records in etcd: {:?}", etcd.keys(prefix));
}

pub(crate) fn stat(envoy: &Envoy, name: &str, pred: impl Fn(u64) -> bool) -> Option<u64> {
    envoy.wait_for_stat(&format!("wasmcustom.{name}"), pred, Duration::from_secs(10))
}

/// A partial failure on A, the redelivery on B: with etcd only the failed subscriber is
/// called; with the `envoy` store (each replica its own memory) everyone is, again.
#[test]
fn a_redelivery_through_another_replica_calls_only_the_subscriber_that_failed() {
    let etcd = EtcdCluster::start(3);
    let (a, b, c) = (
        Subscriber::ok("a"),
        Subscriber::ok("b"),
        Subscriber::ok("c"),
    );
    let subs = [&a, &b, &c];
    let dedupe = etcd_dedupe("/fanout-redelivery/", "deliver");
    let (one, two) = (
        replica(dedupe.clone(), &subs, Some(&etcd)),
        replica(dedupe, &subs, Some(&etcd)),
    );
    let client = Client::http1();
    c.set_behavior(Behavior::Status(503));
    let first = post(&client, &one, "evt-1");
    assert_eq!(first.status, 500, "{}", first.text());
    assert_eq!(counts(&subs), [1, 1, 1]);
    assert_records(&etcd, "/fanout-redelivery/", 2);
    c.set_behavior(Behavior::Status(200));
    let retry = post(&client, &two, "evt-1");
    assert_eq!(retry.status, 202, "{}", retry.text());
    assert_eq!(retry.json()["already_delivered"], json!(["a", "b"]));
    assert_eq!(
        counts(&subs),
        [1, 1, 2],
        "only c is called again, by the other replica"
    );
    assert_eq!(
        stat(&two, "fanout.dedupe.store_errors", |n| n == 0),
        Some(0)
    );

    // The `envoy` store: B has no memory of what A delivered.
    let (a2, b2, c2) = (
        Subscriber::ok("a"),
        Subscriber::ok("b"),
        Subscriber::ok("c"),
    );
    let subs2 = [&a2, &b2, &c2];
    let local = json!({ "ttl_ms": 60000 });
    let (one, two) = (
        replica(local.clone(), &subs2, None),
        replica(local, &subs2, None),
    );
    c2.set_behavior(Behavior::Status(503));
    assert_eq!(post(&client, &one, "evt-1").status, 500);
    c2.set_behavior(Behavior::Status(200));
    let retry = post(&client, &two, "evt-1");
    assert_eq!(retry.status, 202, "{}", retry.text());
    assert_eq!(
        counts(&subs2),
        [2, 2, 2],
        "the envoy store calls everyone again"
    );
}

/// The replica that delivered dies (SIGKILL) once it answered; the redelivery through
/// another is still deduplicated, and a restart forgets nothing.
#[test]
fn a_killed_replica_takes_no_memory_with_it() {
    let etcd = EtcdCluster::start(3);
    let (a, b) = (Subscriber::ok("a"), Subscriber::ok("b"));
    let subs = [&a, &b];
    let dedupe = etcd_dedupe("/fanout-kill/", "deliver");
    let mut one = replica(dedupe.clone(), &subs, Some(&etcd));
    let two = replica(dedupe.clone(), &subs, Some(&etcd));
    let client = Client::http1();
    assert_eq!(post(&client, &one, "evt-1").status, 202);
    assert_records(&etcd, "/fanout-kill/", 2);
    // SAFETY: signalling the Envoy process this test started.
    unsafe {
        libc::kill(one.pid() as libc::pid_t, libc::SIGKILL);
    }
    one.stop();
    let retry = post(&client, &two, "evt-1");
    assert_eq!(retry.status, 202, "{}", retry.text());
    assert_eq!(
        retry.header("x-fanout-already-delivered").as_deref(),
        Some("2")
    );
    assert_eq!(counts(&subs), [1, 1]);
    // A replica started afresh remembers too.
    let three = replica(dedupe, &subs, Some(&etcd));
    assert_eq!(post(&client, &three, "evt-1").status, 202);
    assert_eq!(counts(&subs), [1, 1]);
}

/// Two copies of one event on two replicas at once: each subscriber is called once; the
/// copy that came second gets 409 with retry-after.
#[test]
fn two_copies_on_two_replicas_at_once_call_each_subscriber_once() {
    let etcd = EtcdCluster::start(3);
    let slow = Behavior::Delay(Duration::from_millis(800), 200);
    let (a, b) = (
        Subscriber::start("a", slow.clone()),
        Subscriber::start("b", slow),
    );
    let subs = [&a, &b];
    let dedupe = etcd_dedupe("/fanout-race/", "deliver");
    let one = replica(dedupe.clone(), &subs, Some(&etcd));
    let two = replica(dedupe, &subs, Some(&etcd));
    let (url_one, url_two) = (one.url("/"), two.url("/"));
    let racers: Vec<_> = [url_one, url_two]
        .into_iter()
        .map(|url| {
            std::thread::spawn(move || {
                let client = Client::http1();
                send(
                    client
                        .post(&url)
                        .header("ce-source", SOURCE)
                        .header("ce-id", "evt-race")
                        .body("{}"),
                )
            })
        })
        .collect();
    let mut replies: Vec<Reply> = racers.into_iter().map(|r| r.join().unwrap()).collect();
    replies.sort_by_key(|r| r.status);
    let statuses: Vec<u16> = replies.iter().map(|r| r.status).collect();
    assert_eq!(
        statuses,
        [202, 409],
        "{:?}",
        replies.iter().map(|r| r.text()).collect::<Vec<_>>()
    );
    assert!(replies[1].header("retry-after").is_some());
    assert_eq!(counts(&subs), [1, 1]);
}

/// One etcd member down: nothing changes. All down: `deliver` calls everyone and counts,
/// `reject` answers 503 and calls nobody. etcd back: deduplication resumes.
#[test]
fn etcd_down_and_back() {
    let mut etcd = EtcdCluster::start(3);
    let (a, b) = (Subscriber::ok("a"), Subscriber::ok("b"));
    let subs = [&a, &b];
    let one = replica(etcd_dedupe("/fanout-down/", "deliver"), &subs, Some(&etcd));
    let two = replica(etcd_dedupe("/fanout-down/", "deliver"), &subs, Some(&etcd));
    let strict = replica(etcd_dedupe("/fanout-down/", "reject"), &subs, Some(&etcd));
    let client = Client::http1();

    etcd.kill(0);
    // If member 0 led, the others elect a leader first (a second or two: until then every
    // write times out, a store error); then each Envoy's health check takes member 0 out
    // (what an operator watches: `membership_healthy`). Until it has, a call may still go to
    // member 0 and fail, which the answer says (`x-fanout-not-recorded`).
    etcd.wait_healthy(1);
    etcd.wait_healthy(2);
    for envoy in [&one, &two, &strict] {
        let healthy = envoy.wait_for_stat(
            "cluster.etcd.membership_healthy",
            |n| n == 2,
            Duration::from_secs(20),
        );
        assert_eq!(healthy, Some(2));
    }
    // The workers get the new host set from Envoy's main thread a moment after the stat.
    std::thread::sleep(Duration::from_secs(1));
    b.set_behavior(Behavior::Status(503));
    assert_eq!(post(&client, &one, "evt-1").status, 500);
    assert_records(&etcd, "/fanout-down/", 1);
    b.set_behavior(Behavior::Status(200));
    let retry = post(&client, &two, "evt-1");
    assert_eq!(retry.status, 202, "{}", retry.text());
    assert_eq!(
        counts(&subs),
        [1, 2],
        "one member down: deduplicated as before"
    );

    etcd.kill(1);
    etcd.kill(2);
    std::thread::sleep(Duration::from_secs(1));
    let down = post(&client, &two, "evt-1");
    assert_eq!(down.status, 202, "{}", down.text());
    assert_eq!(counts(&subs), [2, 3], "deliver: everyone is called");
    assert!(stat(&two, "fanout.dedupe.store_errors", |n| n >= 1).unwrap() >= 1);
    let refused = post(&client, &strict, "evt-2");
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert!(refused.header("retry-after").is_some());
    assert_eq!(counts(&subs), [2, 3], "reject: nobody is called");

    for i in 0..3 {
        etcd.restart(i);
    }
    etcd.wait_all_healthy();
    // The health checks see the members again; the timer grants leases again.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let reply = post(&client, &one, "evt-3");
        if reply.status == 202 && reply.header("x-fanout-already-delivered").is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "dedupe did not resume: {}",
            reply.text()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let before = counts(&subs);
    let again = post(&client, &two, "evt-3");
    assert_eq!(again.status, 202);
    assert_eq!(counts(&subs), before, "deduplicated again across replicas");
}

/// Events that come while a claim is in flight share claim txns (one worker, 150 events
/// released at once): each still reaches every subscriber exactly once and is recorded, and
/// etcd gets fewer txns than there were events (claims and settles together). Enough of
/// them that the settles of one tick pass etcd's `--max-txn-ops` (each a nested txn of two
/// operations): the batches split where etcd's own count says, with no store error.
#[test]
fn claims_that_come_together_share_txns() {
    let etcd = EtcdCluster::start(1);
    let (a, b) = (Subscriber::ok("a"), Subscriber::ok("b"));
    let subs = [&a, &b];
    let prefix = "/fanout-together/";
    let envoy = replica_with(etcd_dedupe(prefix, "deliver"), &subs, Some(&etcd), Some(1));
    let txns = || envoy.stat("cluster.etcd.upstream_rq_total").unwrap_or(0);
    let before = txns();
    let n = 150;
    let url = envoy.url("/");
    let start = std::sync::Arc::new(std::sync::Barrier::new(n));
    let senders: Vec<_> = (0..n)
        .map(|i| {
            let (url, start) = (url.clone(), start.clone());
            std::thread::spawn(move || {
                let client = Client::http1();
                start.wait();
                let reply = send(
                    client
                        .post(&url)
                        .header("ce-source", SOURCE)
                        .header("ce-id", format!("together-{i}"))
                        .body("{}"),
                );
                (reply.status, reply.text())
            })
        })
        .collect();
    for sender in senders {
        let (status, text) = sender.join().unwrap();
        assert_eq!(status, 202, "{text}");
    }
    assert_eq!(counts(&subs), [n, n], "each event to each subscriber once");
    assert_records(&etcd, prefix, 2 * n);
    let used = txns() - before;
    eprintln!("{n} events at once: {used} etcd txns (claims and settles)");
    assert!(
        used < n as u64,
        "{used} etcd txns for {n} events: the claims were not coalesced"
    );
    assert_eq!(
        stat(&envoy, "fanout.dedupe.store_errors", |n| n == 0),
        Some(0)
    );
}

/// `ttl_ms` is exact to the replicas' clocks (the value says when it lapses), and the keys
/// are gone from etcd within the lease's bucket and a second or two after.
#[test]
fn ttl_is_honoured_and_no_key_is_left() {
    let etcd = EtcdCluster::start(3);
    let (a, b) = (Subscriber::ok("a"), Subscriber::ok("b"));
    let subs = [&a, &b];
    let dedupe = json!({
        "ttl_ms": 2000,
        "store": { "etcd": { "cluster": "etcd", "prefix": "/fanout-ttl/", "timeout_ms": 1000 } }
    });
    let one = replica(dedupe.clone(), &subs, Some(&etcd));
    let two = replica(dedupe, &subs, Some(&etcd));
    let client = Client::http1();
    let sent = Instant::now();
    assert_eq!(post(&client, &one, "evt-ttl").status, 202);
    assert_records(&etcd, "/fanout-ttl/", 2);
    assert_eq!(post(&client, &two, "evt-ttl").status, 202);
    assert_eq!(counts(&subs), [1, 1], "within ttl_ms: deduplicated");
    std::thread::sleep(Duration::from_millis(2300).saturating_sub(sent.elapsed()));
    assert_eq!(post(&client, &two, "evt-ttl").status, 202);
    assert_eq!(counts(&subs), [2, 2], "after ttl_ms: delivered again");
    assert_records(&etcd, "/fanout-ttl/", 2);
    // ttl 2 s + a bucket (1 s) + the lease's rounding (1 s) + etcd's expiry check.
    let written = Instant::now();
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(
        records(&etcd, "/fanout-ttl/"),
        2,
        "a record lives at least ttl_ms"
    );
    assert_eq!(
        etcd.keys("/fanout-ttl/").len(),
        1,
        "the event's records, its claim released"
    );
    let deadline = written + Duration::from_secs(8);
    while !etcd.keys("/fanout-ttl/").is_empty() {
        assert!(
            Instant::now() < deadline,
            "keys left: {:?}",
            etcd.keys("/fanout-ttl/")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let gone = written.elapsed();
    eprintln!("records gone from etcd {gone:?} after they were written (ttl_ms 2000)");
}

/// What the etcd store adds to the sender's answer on loopback: p50 and p99 of 300
/// sequential events (unique ids) to 4 subscribers, dedupe off / `envoy` store / `etcd`
/// store. A quick measurement by hand, not a check (the reported figures are `make bench`'s
/// dedupe rows, docs/performance.md): run with
/// `cargo test --test e2e replicas_store::latency -- --ignored --nocapture`.
#[test]
#[ignore]
fn latency_per_event() {
    let etcd = EtcdCluster::start(3);
    let subs: Vec<Subscriber> = ["a", "b", "c", "d"]
        .iter()
        .map(|n| Subscriber::ok(n))
        .collect();
    let refs: Vec<&Subscriber> = subs.iter().collect();
    let client = Client::http1();
    for (name, dedupe) in [
        ("off", Value::Null),
        ("envoy", json!({ "ttl_ms": 60000 })),
        ("etcd", etcd_dedupe("/fanout-bench/", "deliver")),
    ] {
        let envoy = replica(dedupe, &refs, Some(&etcd));
        for i in 0..50 {
            post(&client, &envoy, &format!("warm-{name}-{i}"));
        }
        let cpu_before = cpu_ticks(envoy.pid());
        let mut times: Vec<Duration> = (0..300)
            .map(|i| {
                let start = Instant::now();
                assert_eq!(post(&client, &envoy, &format!("{name}-{i}")).status, 202);
                start.elapsed()
            })
            .collect();
        let cpu_ms = (cpu_ticks(envoy.pid()) - cpu_before) * 10;
        times.sort();
        eprintln!(
            "dedupe {name}: p50 {:?}, p99 {:?}, Envoy CPU {:.2} ms per event (N = 4, loopback)",
            times[times.len() / 2],
            times[times.len() * 99 / 100],
            cpu_ms as f64 / 300.0
        );
    }
}

/// utime + stime of a process, in clock ticks (100 per second on Linux).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}
