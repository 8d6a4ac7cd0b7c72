//! The promise across replicas, tried the way senders try it: once a sender has a replica's
//! answer, a redelivery through any replica (that one alive or killed) calls only the
//! subscribers that did not take the event. Two replicas on a three-member etcd, `s1` always
//! takes the event, `s2` fails each event's first delivery; the sender redelivers through
//! the other replica the moment it has the first answer, never waiting for anything else.
//! Many events in a row, so that a window of a few milliseconds shows.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness;
use crate::replicas_store::{counts, etcd_dedupe, post, replica, stat};

use std::time::Duration;

use harness::etcd::EtcdCluster;
use harness::{Behavior, Client, Envoy, Reply, Subscriber};
use serde_json::json;

/// `s1` takes every event; `s2` fails each event's first delivery, then takes it.
fn subscribers() -> (Subscriber, Subscriber) {
    (
        Subscriber::ok("s1"),
        Subscriber::start("s2", Behavior::FirstOfEach("ce-id", 500)),
    )
}

/// The first answer of event `id` (through `first`): s1 took it, s2 failed.
fn first_answer(client: &Client, first: &Envoy, id: &str) -> Reply {
    let answer = post(client, first, id);
    assert_eq!(
        answer.status,
        500,
        "{id}, first delivery: {}",
        answer.text()
    );
    answer
}

/// The redelivery of `id` through `second`, right after the first answer: only s2 is called;
/// s1 is in the report as having the event. (No 409: the first request is over, nobody holds
/// the claim.)
fn assert_redelivered(client: &Client, second: &Envoy, id: &str, what: &str) {
    let retry = post(client, second, id);
    assert_eq!(
        retry.status,
        202,
        "{id}, redelivered {what}: {}",
        retry.text()
    );
    assert_eq!(
        retry.header("x-fanout-already-delivered").as_deref(),
        Some("1"),
        "{id}, redelivered {what}: s1 must not be called again: {}",
        retry.text()
    );
    assert_eq!(
        retry.json()["already_delivered"],
        json!(["s1"]),
        "{id}, redelivered {what}: s1 must not be called again: {}",
        retry.text()
    );
}

/// No store error counted (the counts reach Envoy's stats every second: read after that).
fn assert_no_store_error(envoy: &Envoy) {
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(
        stat(envoy, "fanout.dedupe.store_errors", |n| n == 0),
        Some(0),
        "store errors"
    );
}

/// 60 events: each redelivered through the other replica the moment its first answer comes.
#[test]
fn a_redelivery_sent_the_moment_the_answer_comes_calls_only_who_failed() {
    let etcd = EtcdCluster::start(3);
    let (s1, s2) = subscribers();
    let subs = [&s1, &s2];
    let dedupe = etcd_dedupe("/fanout-moment/", "deliver");
    let (one, two) = (
        replica(dedupe.clone(), &subs, Some(&etcd)),
        replica(dedupe, &subs, Some(&etcd)),
    );
    let client = Client::http1();
    for i in 0..60 {
        let id = format!("moment-{i}");
        first_answer(&client, &one, &id);
        assert_redelivered(&client, &two, &id, "the moment the answer came");
        assert_eq!(counts(&subs), [i + 1, 2 * (i + 1)], "{id}");
    }
    assert_no_store_error(&one);
    assert_no_store_error(&two);
}

/// Fresh replicas, three times: events sent the moment `/ready` answers (before the
/// replicas' first leases are granted) are deduplicated like any other.
#[test]
fn the_first_events_after_ready_are_deduplicated() {
    let etcd = EtcdCluster::start(3);
    let (s1, s2) = subscribers();
    let subs = [&s1, &s2];
    let dedupe = etcd_dedupe("/fanout-fresh/", "deliver");
    let client = Client::http1();
    let mut sent = 0;
    for round in 0..3 {
        // `replica` returns the moment `/ready` answers.
        let one = replica(dedupe.clone(), &subs, Some(&etcd));
        let two = replica(dedupe.clone(), &subs, Some(&etcd));
        for i in 0..20 {
            let id = format!("fresh-{round}-{i}");
            first_answer(&client, &one, &id);
            assert_redelivered(&client, &two, &id, "by a fresh replica");
            sent += 1;
            assert_eq!(counts(&subs), [sent, 2 * sent], "{id}");
        }
        assert_no_store_error(&one);
        assert_no_store_error(&two);
    }
}

/// Five times: a replica answers ten events and is killed (SIGKILL) the moment its last
/// answer comes; the redeliveries through the other replica call only s2.
#[test]
fn a_replica_killed_right_after_it_answered_takes_nothing_with_it() {
    let etcd = EtcdCluster::start(3);
    let (s1, s2) = subscribers();
    let subs = [&s1, &s2];
    let dedupe = etcd_dedupe("/fanout-killed/", "deliver");
    let survivor = replica(dedupe.clone(), &subs, Some(&etcd));
    let client = Client::http1();
    let mut sent = 0;
    for round in 0..5 {
        let mut doomed = replica(dedupe.clone(), &subs, Some(&etcd));
        let ids: Vec<String> = (0..10).map(|i| format!("killed-{round}-{i}")).collect();
        for id in &ids {
            first_answer(&client, &doomed, id);
        }
        // SAFETY: signalling the Envoy process this test started.
        unsafe {
            libc::kill(doomed.pid() as libc::pid_t, libc::SIGKILL);
        }
        doomed.stop();
        for id in &ids {
            assert_redelivered(&client, &survivor, id, "after its replica was killed");
        }
        sent += ids.len();
        assert_eq!(counts(&subs), [sent, 2 * sent], "round {round}");
    }
    assert_no_store_error(&survivor);
}

/// etcd down (every member killed): each event delivered meanwhile is counted as a store
/// error and logged; etcd back and seen healthy by Envoy: 50 events redelivered the moment
/// their answer comes call only s2.
#[test]
fn after_etcd_is_down_and_back_a_redelivery_calls_only_who_failed() {
    let mut etcd = EtcdCluster::start(3);
    let (s1, s2) = subscribers();
    let subs = [&s1, &s2];
    let dedupe = etcd_dedupe("/fanout-outage/", "deliver");
    let (one, two) = (
        replica(dedupe.clone(), &subs, Some(&etcd)),
        replica(dedupe, &subs, Some(&etcd)),
    );
    let client = Client::http1();
    first_answer(&client, &one, "before");
    assert_redelivered(&client, &two, "before", "before the outage");

    for i in 0..3 {
        etcd.kill(i);
    }
    for i in 0..5 {
        // Delivered to everyone (on_store_error: deliver), never silently.
        let reply = post(&client, &one, &format!("outage-{i}"));
        assert_eq!(reply.status, 500, "{}", reply.text());
    }
    assert_eq!(
        stat(&one, "fanout.dedupe.store_errors", |n| n >= 5),
        Some(5),
        "every event of the outage is a store error"
    );
    assert!(
        one.wait_for_log("dedupe: the etcd store failed", Duration::from_secs(5)),
        "the store errors are logged"
    );

    for i in 0..3 {
        etcd.restart(i);
    }
    etcd.wait_all_healthy();
    // What an operator watches: Envoy's health checks see the members again.
    for envoy in [&one, &two] {
        let healthy = envoy.wait_for_stat(
            "cluster.etcd.membership_healthy",
            |n| n == 3,
            Duration::from_secs(20),
        );
        assert_eq!(healthy, Some(3));
    }
    let before = [&one, &two].map(|e| stat(e, "fanout.dedupe.store_errors", |_| true));
    let (s1_before, s2_before) = (s1.count(), s2.count());
    for i in 0..50 {
        let id = format!("after-{i}");
        first_answer(&client, &one, &id);
        assert_redelivered(&client, &two, &id, "after the outage");
        assert_eq!(
            counts(&subs),
            [s1_before + i + 1, s2_before + 2 * (i + 1)],
            "{id}"
        );
    }
    std::thread::sleep(Duration::from_millis(1200));
    let after = [&one, &two].map(|e| stat(e, "fanout.dedupe.store_errors", |_| true));
    assert_eq!(before, after, "no store error once etcd is back");
}
