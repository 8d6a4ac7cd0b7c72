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

/// What became of one event sent and redelivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// The redelivery called only s2.
    Deduplicated,
    /// A replica said the store failed for it (`x-fanout-not-recorded`: `on_store_error:
    /// deliver`, counted in `fanout.dedupe.store_errors`): no promise, but never silent.
    Unrecorded,
}

fn unrecorded(reply: &Reply) -> bool {
    reply.header("x-fanout-not-recorded").as_deref() == Some("1")
}

/// The first delivery of event `id` through `first`: s1 takes it, s2 fails, the answer is
/// `500`. Returns whether the replica said it could not record it.
fn first_answer(client: &Client, first: &Envoy, id: &str) -> bool {
    let answer = post(client, first, id);
    assert_eq!(
        answer.status,
        500,
        "{id}, first delivery: {}",
        answer.text()
    );
    unrecorded(&answer)
}

/// The redelivery of `id` through `second`, right after the first answer (`first` answered
/// it): only s2 is called, s1 is in the report as having the event. (No 409: the first
/// request is over, nobody holds the claim.) Unless a replica said the store failed.
fn redeliver(client: &Client, second: &Envoy, id: &str, what: &str, first: &Envoy) -> Outcome {
    let retry = post(client, second, id);
    if unrecorded(&retry) {
        return Outcome::Unrecorded;
    }
    assert_eq!(
        retry.status,
        202,
        "{id}, redelivered {what}: {}. The log of the replica that answered first:\n{}",
        retry.text(),
        tail(&first.log())
    );
    assert_eq!(
        retry.header("x-fanout-already-delivered").as_deref(),
        Some("1"),
        "{id}, redelivered {what}: s1 must not be called again: {}",
        retry.text()
    );
    assert_eq!(retry.json()["already_delivered"], json!(["s1"]), "{id}");
    Outcome::Deduplicated
}

/// Sends `id` through `first`, and the moment the answer comes, again through `second`;
/// checks what each subscriber got.
fn send_twice(
    client: &Client,
    subs: &[&Subscriber; 2],
    first: &Envoy,
    second: &Envoy,
    id: &str,
    what: &str,
) -> Outcome {
    let before = counts(subs);
    if first_answer(client, first, id) {
        post(client, second, id);
        return Outcome::Unrecorded;
    }
    let outcome = redeliver(client, second, id, what, first);
    if outcome == Outcome::Deduplicated {
        assert_eq!(
            counts(subs),
            [before[0] + 1, before[1] + 2],
            "{id}: s1 once, s2 twice"
        );
    }
    outcome
}

/// Of `outcomes`, those a replica said it could not record: at most one in ten (a store
/// error under load: a claim or settle past its timeout), and each counted by the replicas.
fn assert_few_unrecorded(outcomes: &[Outcome], replicas: &[&Envoy]) {
    let unrecorded = outcomes
        .iter()
        .filter(|o| **o == Outcome::Unrecorded)
        .count();
    assert!(
        unrecorded * 10 <= outcomes.len(),
        "{unrecorded} of {} events not recorded",
        outcomes.len()
    );
    // The counts reach Envoy's stats every second: read after that.
    std::thread::sleep(Duration::from_millis(1200));
    let counted: u64 = replicas
        .iter()
        .map(|e| stat(e, "fanout.dedupe.store_errors", |_| true).unwrap_or(0))
        .sum();
    assert!(
        counted >= unrecorded as u64,
        "{unrecorded} events not recorded, {counted} store errors counted"
    );
    if unrecorded > 0 {
        eprintln!(
            "{unrecorded} of {} events not recorded (store errors, counted)",
            outcomes.len()
        );
    }
}

/// The end of a log (the last 40 lines).
fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
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
    let outcomes: Vec<Outcome> = (0..60)
        .map(|i| {
            let id = format!("moment-{i}");
            send_twice(
                &client,
                &subs,
                &one,
                &two,
                &id,
                "the moment the answer came",
            )
        })
        .collect();
    assert_few_unrecorded(&outcomes, &[&one, &two]);
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
    for round in 0..3 {
        // `replica` returns the moment `/ready` answers.
        let one = replica(dedupe.clone(), &subs, Some(&etcd));
        let two = replica(dedupe.clone(), &subs, Some(&etcd));
        let outcomes: Vec<Outcome> = (0..20)
            .map(|i| {
                let id = format!("fresh-{round}-{i}");
                send_twice(&client, &subs, &one, &two, &id, "by a fresh replica")
            })
            .collect();
        assert_few_unrecorded(&outcomes, &[&one, &two]);
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
    let mut outcomes = Vec::new();
    for round in 0..5 {
        let mut doomed = replica(dedupe.clone(), &subs, Some(&etcd));
        let ids: Vec<String> = (0..10).map(|i| format!("killed-{round}-{i}")).collect();
        // Those the doomed replica said it could not record carry no promise.
        let before = counts(&subs);
        let recorded: Vec<&String> = ids
            .iter()
            .filter(|id| !first_answer(&client, &doomed, id))
            .collect();
        outcomes.extend((recorded.len()..ids.len()).map(|_| Outcome::Unrecorded));
        assert_eq!(counts(&subs), [before[0] + 10, before[1] + 10]);
        // SAFETY: signalling the Envoy process this test started.
        unsafe {
            libc::kill(doomed.pid() as libc::pid_t, libc::SIGKILL);
        }
        doomed.stop();
        for id in recorded {
            let before = counts(&subs);
            let outcome = redeliver(
                &client,
                &survivor,
                id,
                "after its replica was killed",
                &doomed,
            );
            if outcome == Outcome::Deduplicated {
                assert_eq!(counts(&subs), [before[0], before[1] + 1], "{id}: only s2");
            }
            outcomes.push(outcome);
        }
    }
    assert_few_unrecorded(&outcomes, &[&survivor]);
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
    send_twice(&client, &subs, &one, &two, "before", "before the outage");

    for i in 0..3 {
        etcd.kill(i);
    }
    for i in 0..5 {
        // Delivered to everyone (on_store_error: deliver), never silently.
        let reply = post(&client, &one, &format!("outage-{i}"));
        assert_eq!(reply.status, 500, "{}", reply.text());
        assert!(unrecorded(&reply), "the answer says it is not recorded");
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
    let before: u64 = [&one, &two]
        .iter()
        .map(|e| stat(e, "fanout.dedupe.store_errors", |_| true).unwrap_or(0))
        .sum();
    let outcomes: Vec<Outcome> = (0..50)
        .map(|i| {
            let id = format!("after-{i}");
            send_twice(&client, &subs, &one, &two, &id, "after the outage")
        })
        .collect();
    let unrecorded = outcomes
        .iter()
        .filter(|o| **o == Outcome::Unrecorded)
        .count();
    assert!(
        unrecorded * 10 <= outcomes.len(),
        "{unrecorded} of 50 not recorded"
    );
    std::thread::sleep(Duration::from_millis(1200));
    let after: u64 = [&one, &two]
        .iter()
        .map(|e| stat(e, "fanout.dedupe.store_errors", |_| true).unwrap_or(0))
        .sum();
    assert!(
        after - before >= unrecorded as u64,
        "each one not recorded is counted"
    );
}
