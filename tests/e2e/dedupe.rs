//! Redelivery without duplicates in the real Envoy (`--concurrency 2`: two workers share the
//! store): a retry reaches only the subscribers that did not take the event, records expire
//! after `ttl_ms`, the store stays within `max_entries`, and concurrent redeliveries of one
//! event across workers give each subscriber exactly one delivery. Events are binary-mode
//! CloudEvents named by their (`ce-source`, `ce-id`), or by a `key` header; the identity in
//! both modes, sent by the CloudEvents SDK, is in `knative_ingress.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness;

use std::collections::BTreeMap;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use harness::{send, Behavior, Client, Envoy, Reply, Subscriber};
use serde_json::{json, Value};

fn envoy(dedupe: Value, subscribers: &[&Subscriber]) -> Envoy {
    let config = json!({
        "dedupe": dedupe,
        "channels": [{ "name": "default/orders", "hosts": ["*"], "subscribers":
            subscribers.iter().map(|s| json!({ "cluster": s.name() })).collect::<Vec<_>>() }]
    });
    Envoy::with_subscribers(&config, subscribers)
}

/// The source of every event here: the identity is (`SOURCE`, id).
const SOURCE: &str = "/e2e/dedupe";

fn post(client: &Client, envoy: &Envoy, id: Option<&str>) -> Reply {
    let mut request = client.post(&envoy.url("/")).body("{}");
    if let Some(id) = id {
        request = request.header("ce-source", SOURCE).header("ce-id", id);
    }
    let reply = send(request);
    reply.assert_not_tripwire();
    reply
}

fn counts(subs: &[&Subscriber]) -> Vec<usize> {
    subs.iter().map(|s| s.count()).collect()
}

/// A stat of fanout's (`wasmcustom.<name>`), waiting (bounded) until it has `want`: the
/// filter hands its counts to Envoy once a second.
fn wait_for_stat(envoy: &Envoy, name: &str, want: u64) -> Option<u64> {
    envoy.wait_for_stat(
        &format!("wasmcustom.{name}"),
        |n| n == want,
        Duration::from_secs(10),
    )
}

#[test]
fn a_redelivery_reaches_only_the_subscriber_that_failed() {
    let (a, b, c) = (
        Subscriber::ok("a"),
        Subscriber::ok("b"),
        Subscriber::ok("c"),
    );
    let subs = [&a, &b, &c];
    c.set_behavior(Behavior::Status(503));
    let envoy = envoy(json!({ "key": "ce-id" }), &subs);
    let client = Client::http1();

    let first = post(&client, &envoy, Some("evt-1"));
    assert_eq!(first.status, 500, "{}", first.text());
    assert_eq!(first.json()["failed"][0]["cluster"], "c");
    assert_eq!(counts(&subs), [1, 1, 1]);

    // c recovers; the sender retries: only c is called.
    c.set_behavior(Behavior::Status(200));
    let retry = post(&client, &envoy, Some("evt-1"));
    assert_eq!(retry.status, 202, "{}", retry.text());
    assert_eq!(
        retry.header("x-fanout-already-delivered").as_deref(),
        Some("2")
    );
    assert_eq!(retry.json()["already_delivered"], json!(["a", "b"]));
    assert_eq!(counts(&subs), [1, 1, 2]);

    // And again: everybody has it; nobody is called.
    let again = post(&client, &envoy, Some("evt-1"));
    assert_eq!(again.status, 202);
    assert_eq!(
        again.header("x-fanout-already-delivered").as_deref(),
        Some("3")
    );
    assert_eq!(counts(&subs), [1, 1, 2]);

    // Another event is another event; a request without the key goes to everyone, counted.
    assert_eq!(post(&client, &envoy, Some("evt-2")).status, 202);
    assert_eq!(post(&client, &envoy, None).status, 202);
    assert_eq!(post(&client, &envoy, None).status, 202);
    assert_eq!(counts(&subs), [4, 4, 5]);
    assert_eq!(
        wait_for_stat(&envoy, "fanout.dedupe.missing_key", 2),
        Some(2)
    );
    assert_eq!(wait_for_stat(&envoy, "fanout.dedupe.skipped", 5), Some(5));
    assert_eq!(wait_for_stat(&envoy, "fanout.dedupe.entries", 2), Some(2));
}

#[test]
fn a_key_header_names_events_by_its_value_alone() {
    let (a, b) = (Subscriber::ok("a"), Subscriber::ok("b"));
    let subs = [&a, &b];
    let envoy = envoy(json!({ "key": "x-event-id" }), &subs);
    let client = Client::http1();
    let event = |id: &str, source: &str| {
        let reply = send(
            client
                .post(&envoy.url("/"))
                .header("x-event-id", id)
                .header("ce-source", source)
                .body("{}"),
        );
        assert_eq!(reply.status, 202, "{}", reply.text());
        reply.header("x-fanout-already-delivered")
    };
    assert_eq!(event("order-7", "/a"), None);
    assert_eq!(counts(&subs), [1, 1]);
    // The header's value is the whole identity: another source is the same event.
    assert_eq!(event("order-7", "/b").as_deref(), Some("2"));
    assert_eq!(event("order-8", "/a"), None);
    assert_eq!(counts(&subs), [2, 2]);
    // Without the header (ce-source and ce-id do not count): to everyone, counted.
    assert_eq!(post(&client, &envoy, Some("order-7")).status, 202);
    assert_eq!(counts(&subs), [3, 3]);
    assert_eq!(
        wait_for_stat(&envoy, "fanout.dedupe.missing_key", 1),
        Some(1)
    );
}

#[test]
fn after_ttl_ms_the_event_goes_to_everyone_again() {
    let (a, b) = (Subscriber::ok("a"), Subscriber::ok("b"));
    let subs = [&a, &b];
    let envoy = envoy(json!({ "ttl_ms": 1500 }), &subs);
    let client = Client::http1();
    assert_eq!(post(&client, &envoy, Some("evt-1")).status, 202);
    assert_eq!(post(&client, &envoy, Some("evt-1")).status, 202);
    assert_eq!(counts(&subs), [1, 1]);
    // A fixed wait: what passes is the filter's clock (the host's wall clock), past ttl_ms
    // from the delivery, which was before this sleep began; 200 ms over it is plenty.
    std::thread::sleep(Duration::from_millis(1700));
    let after = post(&client, &envoy, Some("evt-1"));
    assert_eq!(after.status, 202);
    assert_eq!(after.header("x-fanout-already-delivered"), None);
    assert_eq!(counts(&subs), [2, 2]);
}

#[test]
fn max_entries_100_with_1000_events_stays_bounded_and_evicts_the_oldest() {
    let a = Subscriber::ok("a");
    let envoy = envoy(json!({ "max_entries": 100 }), &[&a]);
    let client = Client::http1();
    // 1000 distinct events, from 8 senders at once.
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let client = client.clone();
            let url = envoy.url("/");
            std::thread::spawn(move || {
                for i in (t..1000).step_by(8) {
                    let reply = send(
                        client
                            .post(&url)
                            .header("ce-source", SOURCE)
                            .header("ce-id", format!("evt-{i}"))
                            .body("{}"),
                    );
                    assert_eq!(reply.status, 202, "evt-{i}: {}", reply.text());
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    assert_eq!(a.count(), 1000);
    assert_eq!(
        wait_for_stat(&envoy, "fanout.dedupe.entries", 100),
        Some(100)
    );

    // The newest are remembered; the oldest were evicted and are delivered again.
    assert_eq!(post(&client, &envoy, Some("evt-999")).status, 202);
    assert_eq!(a.count(), 1000, "evt-999 was forgotten");
    assert_eq!(post(&client, &envoy, Some("evt-0")).status, 202);
    assert_eq!(a.count(), 1001, "evt-0 was still remembered");
    assert_eq!(
        wait_for_stat(&envoy, "fanout.dedupe.entries", 100),
        Some(100)
    );
}

#[test]
fn two_hundred_concurrent_redeliveries_across_workers_give_each_subscriber_one_delivery() {
    const N: usize = 200;
    // A slow subscriber keeps the first delivery in flight while the others arrive.
    let subs: Vec<Subscriber> = (0..4)
        .map(|i| {
            Subscriber::start(
                &format!("s{i}"),
                Behavior::Delay(Duration::from_millis(300), 200),
            )
        })
        .collect();
    let refs: Vec<&Subscriber> = subs.iter().collect();
    let envoy = envoy(json!({}), &refs);
    let client = Client::http1();
    let barrier = Arc::new(Barrier::new(N));
    let threads: Vec<_> = (0..N)
        .map(|_| {
            let client = client.clone();
            let barrier = Arc::clone(&barrier);
            let url = envoy.url("/");
            std::thread::spawn(move || {
                barrier.wait();
                send(
                    client
                        .post(&url)
                        .header("ce-source", SOURCE)
                        .header("ce-id", "evt-once")
                        .body("{}"),
                )
            })
        })
        .collect();
    let replies: Vec<Reply> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(
        counts(&refs),
        [1, 1, 1, 1],
        "a subscriber got the event twice"
    );
    let accepted = replies.iter().filter(|r| r.status == 202).count();
    let in_progress = replies.iter().filter(|r| r.status == 409).count();
    let other: Vec<_> = replies
        .iter()
        .filter(|r| r.status != 202 && r.status != 409)
        .map(|r| (r.status, r.text()))
        .collect();
    assert!(other.is_empty(), "{other:?}");
    assert!(accepted >= 1, "nobody got 202");
    assert_eq!(accepted + in_progress, N);
    for r in replies.iter().filter(|r| r.status == 409) {
        assert_eq!(r.header("retry-after").as_deref(), Some("1"));
        assert!(r.json()["in_progress"]
            .as_array()
            .is_some_and(|a| !a.is_empty()));
    }
    eprintln!("{accepted} answered 202, {in_progress} answered 409 (in progress elsewhere)");
    // Both workers took connections, so the claims were seen across threads.
    let stats: BTreeMap<String, u64> = envoy
        .stats("listener.")
        .into_iter()
        .filter(|(name, _)| name.contains(".worker_") && name.ends_with(".downstream_cx_total"))
        .collect();
    let per_worker: Vec<u64> = stats.values().copied().collect();
    eprintln!("connections per worker: {per_worker:?}");
    assert!(
        per_worker.len() == 2 && per_worker.iter().all(|n| *n > 0),
        "one worker took every connection: {stats:#?}"
    );

    // The senders that got 409 retry: 202, and still nobody is called again.
    let retry = post(&client, &envoy, Some("evt-once"));
    assert_eq!(retry.status, 202);
    assert_eq!(
        retry.header("x-fanout-already-delivered").as_deref(),
        Some("4")
    );
    assert_eq!(counts(&refs), [1, 1, 1, 1]);
}

#[test]
fn async_mode_records_when_the_background_delivery_ends() {
    // The second copy must come while the first is still being delivered: `slow` holds its
    // answer long enough for that on a loaded machine too (the copies after it are polled).
    let slow = Subscriber::start("slow", Behavior::Delay(Duration::from_millis(1500), 200));
    let fast = Subscriber::ok("fast");
    let subs = [&slow, &fast];
    let config = json!({
        "mode": "async",
        "dedupe": {},
        "subscribers": [{ "cluster": "slow" }, { "cluster": "fast" }]
    });
    let envoy = Envoy::builder()
        .fanout(&config)
        .cluster("slow", slow.port())
        .cluster("fast", fast.port())
        .start();
    let client = Client::http1();
    assert_eq!(post(&client, &envoy, Some("evt-a")).status, 202);
    // The first copy is still being delivered in the background: the second calls nobody.
    let second = post(&client, &envoy, Some("evt-a"));
    assert_eq!(second.status, 409, "{}", second.text());
    assert_eq!(second.header("retry-after").as_deref(), Some("1"));
    // Once the background delivery has ended, a copy is answered from the records.
    let deadline = Instant::now() + Duration::from_secs(10);
    let last = loop {
        let reply = post(&client, &envoy, Some("evt-a"));
        if reply.status != 409 || Instant::now() > deadline {
            break reply;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(last.status, 202, "{}", last.text());
    assert_eq!(
        last.header("x-fanout-already-delivered").as_deref(),
        Some("2")
    );
    assert_eq!(last.json()["already_delivered"], json!(["slow", "fast"]));
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(counts(&subs), [1, 1], "a subscriber got the event twice");
    assert_eq!(
        wait_for_stat(&envoy, "fanout.requests.undelivered", 0),
        Some(0)
    );
}

/// The cost in Envoy: sequential requests with distinct keys, dedupe off and on (with full
/// shards: max_entries 1000, 2000 events, the last 1000 timed). Not a test; run with
/// `cargo test --release --test e2e dedupe::cost -- --ignored --nocapture`.
#[test]
#[ignore]
fn cost_per_request_dedupe_off_and_on() {
    let a = Subscriber::ok("a");
    let client = Client::http1();
    let mut lines = Vec::new();
    for dedupe in [None, Some(json!({ "max_entries": 1000 }))] {
        let mut config = json!({ "subscribers": [{ "cluster": "a" }] });
        if let Some(d) = &dedupe {
            config["dedupe"] = d.clone();
        }
        let envoy = Envoy::builder()
            .fanout(&config)
            .cluster("a", a.port())
            .start();
        let mut timed = Vec::new();
        for i in 0..2000 {
            let start = Instant::now();
            let reply = post(
                &client,
                &envoy,
                Some(&format!("0b8e4c8a-2f7e-4a51-9d4c-{i:012}")),
            );
            assert_eq!(reply.status, 202);
            if i >= 1000 {
                timed.push(start.elapsed());
            }
        }
        timed.sort();
        let mean = timed.iter().sum::<Duration>() / timed.len() as u32;
        lines.push(format!(
            "dedupe {}: mean {mean:?}, p50 {:?}, p99 {:?}",
            if dedupe.is_some() { "on " } else { "off" },
            timed[timed.len() / 2],
            timed[timed.len() * 99 / 100]
        ));
    }
    eprintln!("{}", lines.join("\n"));
}
