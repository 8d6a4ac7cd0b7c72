//! Delivery beyond one attempt, in the real Envoy: retries with backoff (sent from the root
//! context's timer), the dead-letter target, reply forwarding, and async mode, whose
//! deliveries outlive the request.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness;

use std::time::{Duration, Instant};

use harness::timing::{assert_waited_about, assert_waited_at_least};
use harness::{send, Behavior, Client, Envoy, Subscriber};
use serde_json::json;

fn status(s: u16) -> Behavior {
    Behavior::Status(s)
}

/// Asserts no more than `n` requests arrive at `sub` within `wait`. (A fixed wait: it looks for
/// something that must not happen; a loaded machine can only make it miss, never fail.)
fn stays_at(sub: &Subscriber, n: usize, wait: Duration) {
    std::thread::sleep(wait);
    assert_eq!(sub.count(), n, "{}: {:#?}", sub.name(), sub.requests());
}

#[test]
fn a_subscriber_failing_twice_then_succeeding_gets_three_attempts_with_growing_gaps_and_202() {
    let steady = Subscriber::ok("steady");
    let flaky = Subscriber::start(
        "flaky",
        Behavior::Sequence(vec![status(503), Behavior::Reset, status(200)]),
    );
    let config = json!({
        "delivery": { "retry": 3, "backoff_policy": "linear", "backoff_delay_ms": 300 },
        "subscribers": [{ "cluster": "steady" }, { "cluster": "flaky" }]
    });
    let envoy = Envoy::with_subscribers(&config, &[&steady, &flaky]);
    let started = Instant::now();
    let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
    let took = started.elapsed();
    reply.assert_not_tripwire();
    assert_eq!(reply.status, 202, "{}", reply.text());
    assert_eq!(steady.count(), 1);
    let attempts = flaky.requests();
    assert_eq!(attempts.len(), 3, "{attempts:#?}");
    assert!(attempts.iter().all(|r| r.body == b"event"));
    // linear: 300 ms before retry 1, 600 ms before retry 2 (the timer ticks every 10 ms and
    // compares the host's clock in whole ms): a retry with no backoff fails, one that comes
    // late on a loaded machine does not.
    let gap1 = attempts[1].at - attempts[0].at;
    let gap2 = attempts[2].at - attempts[1].at;
    assert_waited_about(gap1, Duration::from_millis(300), "gap before retry 1");
    assert_waited_about(gap2, Duration::from_millis(600), "gap before retry 2");
    assert_waited_at_least(took, Duration::from_millis(900), "the client's wait");
    stays_at(&flaky, 3, Duration::from_millis(300));
}

#[test]
fn a_400_is_not_retried_and_gives_500() {
    let picky = Subscriber::start("picky", status(400));
    let config = json!({
        "delivery": { "retry": 3, "backoff_delay_ms": 10 },
        "subscribers": [{ "cluster": "picky" }]
    });
    let envoy = Envoy::with_subscribers(&config, &[&picky]);
    let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
    assert_eq!(reply.status, 500, "{}", reply.text());
    let report = reply.json();
    assert_eq!(report["failed"][0]["status"], 400);
    assert_eq!(report["failed"][0]["attempts"], 1);
    stays_at(&picky, 1, Duration::from_millis(300));
}

#[test]
fn exhausted_retries_go_to_the_dead_letter_with_the_failure_and_the_answer_is_202() {
    let down = Subscriber::start("down", status(503));
    let dlq = Subscriber::ok("dlq");
    let config = json!({
        "forward_headers": ["content-type", "ce-*"],
        "delivery": { "retry": 2, "backoff_delay_ms": 20,
                      "dead_letter": { "cluster": "dlq", "path": "/dead", "authority": "dlq.local" } },
        "subscribers": [{ "cluster": "down", "path": "/events" }]
    });
    let envoy = Envoy::with_subscribers(&config, &[&down, &dlq]);
    let reply = send(
        Client::http1()
            .post(&envoy.url("/"))
            .header("ce-id", "e-1")
            .header("content-type", "application/json")
            .body("{\"n\":1}"),
    );
    assert_eq!(reply.status, 202, "{}", reply.text());
    assert_eq!(reply.header("x-fanout-dead-lettered").as_deref(), Some("1"));
    assert_eq!(down.count(), 3);
    let letter = dlq.only_request();
    assert_eq!(letter.path, "/dead");
    assert_eq!(letter.authority(), Some("dlq.local"));
    assert_eq!(letter.body, b"{\"n\":1}");
    assert_eq!(letter.header("ce-id"), Some("e-1"));
    assert_eq!(letter.header("content-type"), Some("application/json"));
    assert_eq!(letter.header("x-fanout-failed-cluster"), Some("down"));
    assert_eq!(letter.header("x-fanout-failed-outcome"), Some("status"));
    assert_eq!(letter.header("x-fanout-failed-status"), Some("503"));
    assert_eq!(letter.header("x-fanout-failed-attempts"), Some("3"));
    assert_eq!(
        letter.header("x-fanout-failed-body"),
        Some("subscriber down answers 503")
    );
    // Knative's error attributes too, as ce-* headers (the event is in binary mode); the
    // CloudEvents SDK reading them is in tests/e2e/knative_delivery.rs.
    assert_eq!(letter.header("x-fanout-failed-leg"), Some("event"));
    assert_eq!(
        letter.header("ce-knativeerrordest"),
        Some("http://down/events")
    );
    assert_eq!(letter.header("ce-knativeerrorcode"), Some("503"));
    assert_eq!(
        letter.header("ce-knativeerrordata"),
        Some("c3Vic2NyaWJlciBkb3duIGFuc3dlcnMgNTAzCg=="),
        "base64 of the subscriber's answer, as it came"
    );
}

#[test]
fn a_failing_dead_letter_target_gives_500() {
    let down = Subscriber::start("down", status(500));
    let dlq = Subscriber::start("dlq", status(500));
    let config = json!({
        "delivery": { "dead_letter": { "cluster": "dlq" } },
        "subscribers": [{ "cluster": "down" }]
    });
    let envoy = Envoy::with_subscribers(&config, &[&down, &dlq]);
    let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
    assert_eq!(reply.status, 500, "{}", reply.text());
    let failed = &reply.json()["failed"][0];
    assert_eq!(failed["cluster"], "down");
    assert_eq!(failed["leg"], "dead_letter");
    assert_eq!(failed["status"], 500);
    assert_eq!(failed["event"]["status"], 500);
    assert_eq!(dlq.count(), 1);
}

#[test]
fn a_reply_is_forwarded_and_a_failed_reply_fails_the_delivery() {
    let answering = Subscriber::start(
        "answering",
        Behavior::Respond {
            status: 200,
            headers: vec![
                ("content-type".into(), "application/json".into()),
                ("ce-specversion".into(), "1.0".into()),
                ("ce-type".into(), "com.example.answer".into()),
                ("ce-id".into(), "r-1".into()),
                ("ce-source".into(), "/answering".into()),
                ("set-cookie".into(), "secret=1".into()),
            ],
            body: "{\"answer\":42}".into(),
        },
    );
    let replies = Subscriber::ok("replies");
    let config = json!({
        "subscribers": [{ "cluster": "answering",
                          "reply": { "cluster": "replies", "path": "/replies" } }]
    });
    let envoy = Envoy::with_subscribers(&config, &[&answering, &replies]);
    let reply = send(Client::http1().post(&envoy.url("/")).body("question"));
    assert_eq!(reply.status, 202, "{}", reply.text());
    assert_eq!(answering.only_request().header("prefer"), Some("reply"));
    let forwarded = replies.only_request();
    assert_eq!(forwarded.path, "/replies");
    assert_eq!(forwarded.body, b"{\"answer\":42}");
    assert_eq!(forwarded.header("ce-type"), Some("com.example.answer"));
    assert_eq!(forwarded.header("ce-id"), Some("r-1"));
    assert_eq!(forwarded.header("content-type"), Some("application/json"));
    assert_eq!(forwarded.header("set-cookie"), None);

    replies.set_behavior(status(503));
    let reply = send(Client::http1().post(&envoy.url("/")).body("question"));
    assert_eq!(reply.status, 500, "{}", reply.text());
    let failed = &reply.json()["failed"][0];
    assert_eq!(failed["cluster"], "answering");
    assert_eq!(failed["leg"], "reply");
    assert_eq!(failed["status"], 503);
}

#[test]
fn an_empty_2xx_sends_no_reply() {
    let quiet = Subscriber::start("quiet", status(204));
    let replies = Subscriber::ok("replies");
    let config = json!({
        "reply": { "cluster": "replies" },
        "subscribers": [{ "cluster": "quiet" }]
    });
    let envoy = Envoy::with_subscribers(&config, &[&quiet, &replies]);
    assert_eq!(
        send(Client::http1().post(&envoy.url("/")).body("e")).status,
        202
    );
    stays_at(&replies, 0, Duration::from_millis(200));
}

#[test]
fn async_answers_before_a_slow_subscriber_which_still_gets_the_event_after_the_client_left() {
    let slow = Subscriber::start("slow", Behavior::Delay(Duration::from_secs(3), 200));
    let config = json!({ "mode": "async", "subscribers": [{ "cluster": "slow" }] });
    let envoy = Envoy::with_subscribers(&config, &[&slow]);
    let started = Instant::now();
    {
        let client = Client::http1();
        let reply = send(client.post(&envoy.url("/")).body("later"));
        assert_eq!(reply.status, 202, "{}", reply.text());
        // The client, and its connection, go away here.
    }
    let answered = started.elapsed();
    // Well before the subscriber's 3 s answer (what it would be if it waited for it), with
    // room for a loaded machine.
    assert!(
        answered < Duration::from_secs(2),
        "answered after {answered:?}"
    );
    assert_eq!(slow.wait_for(1, Duration::from_secs(10)), 1);
    assert_eq!(slow.only_request().body, b"later");
    // The delivery completes: nothing is left in flight.
    let in_flight = envoy.wait_for_stat(
        "wasmcustom.fanout.in_flight",
        |n| n == 0,
        Duration::from_secs(15),
    );
    assert_eq!(in_flight, Some(0), "still in flight");
}

#[test]
fn async_retries_after_the_202() {
    let flaky = Subscriber::start("flaky", Behavior::Sequence(vec![status(503), status(200)]));
    let config = json!({
        "mode": "async",
        "delivery": { "retry": 2, "backoff_delay_ms": 50 },
        "subscribers": [{ "cluster": "flaky" }]
    });
    let envoy = Envoy::with_subscribers(&config, &[&flaky]);
    assert_eq!(
        send(Client::http1().post(&envoy.url("/")).body("e")).status,
        202
    );
    assert_eq!(flaky.wait_for(2, Duration::from_secs(10)), 2);
    stays_at(&flaky, 2, Duration::from_millis(300));
}

#[test]
fn async_past_the_in_flight_cap_answers_503() {
    let slow = Subscriber::start("slow", Behavior::Delay(Duration::from_secs(3), 200));
    let config = json!({
        "mode": "async", "max_in_flight": 1,
        "subscribers": [{ "cluster": "slow" }]
    });
    let envoy = Envoy::with_subscribers(&config, &[&slow]);
    // One connection: one worker, whose cap is 1.
    let client = Client::http1();
    let first = send(client.post(&envoy.url("/")).body("1"));
    assert_eq!(first.status, 202, "{}", first.text());
    let second = send(client.post(&envoy.url("/")).body("2"));
    assert_eq!(second.status, 503, "{}", second.text());
    assert_eq!(second.header("retry-after").as_deref(), Some("1"));
    assert!(second.json()["error"]
        .as_str()
        .unwrap()
        .contains("max_in_flight"));
    // Once the first is delivered, there is room again.
    assert_eq!(slow.wait_for(1, Duration::from_secs(10)), 1);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let reply = send(client.post(&envoy.url("/")).body("3"));
        if reply.status == 202 {
            break;
        }
        assert_eq!(reply.status, 503);
        assert!(Instant::now() < deadline, "the cap never freed up");
        std::thread::sleep(Duration::from_millis(200));
    }
}
