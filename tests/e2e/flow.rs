//! Flow control in the real Envoy (issue 16): Envoy's own circuit breaker reported as its own
//! outcome, `overflow`; best-effort subscribers, which the sender's answer does not wait for;
//! jittered retry waits.
//!
//! The per-subscriber cap (`max_concurrent_calls`, `max_queued_calls`) is not wired yet on
//! this branch (t16-rest): its tests are ignored until it is. The cap is per Envoy worker, so
//! the tests that measure it start Envoy with one worker.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness;

use std::time::{Duration, Instant};

use harness::timing::{assert_waited_at_least, LOADED_LATE_SLACK, TIMER_EARLY_SLACK};
use harness::{
    assert_202, assert_rejected, assert_status, send, Behavior, Client, Envoy, Reply, Subscriber,
};
use serde_json::{json, Value};

const fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Envoy with the filter configured by `config`, a cluster per subscriber, `workers` workers.
fn envoy(config: &Value, subscribers: &[&Subscriber], workers: u32) -> Envoy {
    Envoy::builder()
        .fanout(config)
        .subscribers(subscribers)
        .concurrency(workers)
        .start()
}

/// Sends `body` from a thread of its own (its own client, so its own connection).
fn send_in_background(envoy: &Envoy, body: String) -> std::thread::JoinHandle<Reply> {
    let url = envoy.url("/");
    std::thread::spawn(move || send(Client::http1().post(&url).body(body)))
}

/// Twelve events sent at once in `mode` to a subscriber capped at 2 calls (whose first four
/// calls fail and are retried) and to one without a cap: every event is delivered, the capped
/// one never sees more than 2 calls at once, the other sees more (so the load was concurrent
/// and the cap is what held it back).
fn the_cap_holds_and_every_event_is_delivered(mode: &str) {
    const EVENTS: usize = 12;
    let answer = |status| Behavior::Delay(ms(150), status);
    let mut steps = vec![answer(503); 4];
    steps.push(answer(200));
    let capped = Subscriber::start("capped", Behavior::Sequence(steps));
    let free = Subscriber::start("free", answer(200));
    let config = json!({
        "mode": mode,
        "delivery": { "retry": 2, "backoff_delay_ms": 20 },
        "subscribers": [
            // Far shorter than the wait in line of the last events (about 6 x 150 ms): it
            // times the call from when it is sent, not from when it joined the line.
            { "cluster": "capped", "max_concurrent_calls": 2, "timeout_ms": 500 },
            { "cluster": "free" }
        ]
    });
    let envoy = envoy(&config, &[&capped, &free], 1);
    let senders: Vec<_> = (0..EVENTS)
        .map(|i| send_in_background(&envoy, format!("event {i}")))
        .collect();
    for sender in senders {
        assert_202(&sender.join().unwrap());
    }
    // Every event, plus the four retries of the failed calls.
    let want = EVENTS + 4;
    assert_eq!(
        capped.wait_for(want, Duration::from_secs(30)),
        want,
        "{mode}"
    );
    assert_eq!(
        free.wait_for(EVENTS, Duration::from_secs(30)),
        EVENTS,
        "{mode}"
    );
    let mut bodies: Vec<Vec<u8>> = capped.requests().into_iter().map(|r| r.body).collect();
    bodies.sort();
    bodies.dedup();
    assert_eq!(
        bodies.len(),
        EVENTS,
        "{mode}: every event reached the capped subscriber"
    );
    expect_stat(&envoy, "fanout.in_flight", 0);
    assert_eq!(
        capped.max_concurrent(),
        2,
        "{mode}: the capped subscriber's concurrency"
    );
    assert!(
        free.max_concurrent() > 2,
        "{mode}: the uncapped subscriber saw at most {} calls at once: the events were not \
         sent concurrently, so this test showed nothing",
        free.max_concurrent()
    );
    capped.stays_at(want, ms(300));
}

#[test]
fn sync_the_concurrency_a_subscriber_sees_never_exceeds_its_cap_and_every_event_is_delivered() {
    the_cap_holds_and_every_event_is_delivered("sync");
}

#[test]
fn async_the_concurrency_a_subscriber_sees_never_exceeds_its_cap_and_every_event_is_delivered() {
    the_cap_holds_and_every_event_is_delivered("async");
}

/// A subscriber capped at one call with room for one more in line: the event after those two
/// is refused with 503, `retry-after` and a JSON error naming it, and no subscriber at all is
/// called for it (never half a fan-out), in sync and async mode alike.
fn a_full_queue_refuses_the_event_and_calls_nobody(mode: &str) {
    let other = Subscriber::ok("other");
    let slow = Subscriber::start("slow", Behavior::Delay(Duration::from_secs(3), 200));
    let config = json!({
        "mode": mode,
        "subscribers": [
            { "cluster": "other" },
            { "cluster": "slow", "max_concurrent_calls": 1, "max_queued_calls": 1 }
        ]
    });
    let envoy = envoy(&config, &[&other, &slow], 1);
    let first = send_in_background(&envoy, "first".into());
    assert_eq!(slow.wait_for(1, Duration::from_secs(10)), 1, "{mode}");
    // Waits in line behind the first: admitted.
    let second = send_in_background(&envoy, "second".into());
    assert_eq!(other.wait_for(2, Duration::from_secs(10)), 2, "{mode}");

    let refused = send(Client::http1().post(&envoy.url("/")).body("third"));
    assert_rejected(&refused, 503);
    let retry_after = refused.header("retry-after").unwrap_or_default();
    assert!(
        retry_after.parse::<u64>().is_ok_and(|secs| secs >= 1),
        "{mode}: retry-after {retry_after:?}"
    );
    let error = refused.json();
    assert_eq!(error["subscriber"], "slow", "{mode}: {error}");
    assert!(
        error["error"].as_str().unwrap().contains("slow"),
        "{mode}: {error}"
    );

    for reply in [first.join().unwrap(), second.join().unwrap()] {
        assert_202(&reply);
    }
    assert_eq!(slow.wait_for(2, Duration::from_secs(15)), 2, "{mode}");
    expect_stat(&envoy, "fanout.in_flight", 0);
    for sub in [&other, &slow] {
        // The two events reach `other` on two connections at about the same time: in either
        // order (seen: "second" first, under load). What matters is that "third" is absent.
        let mut bodies: Vec<Vec<u8>> = sub.requests().into_iter().map(|r| r.body).collect();
        bodies.sort();
        assert_eq!(
            bodies,
            [b"first".to_vec(), b"second".to_vec()],
            "{mode}: {} was called for the refused event",
            sub.name()
        );
    }
    // Room again: the next event is taken.
    assert_202(&send(Client::http1().post(&envoy.url("/")).body("fourth")));
}

#[test]
fn sync_a_full_queue_answers_503_with_retry_after_and_no_subscriber_is_called() {
    a_full_queue_refuses_the_event_and_calls_nobody("sync");
}

#[test]
fn async_a_full_queue_answers_503_with_retry_after_and_no_subscriber_is_called() {
    a_full_queue_refuses_the_event_and_calls_nobody("async");
}

/// Envoy with a circuit breaker of one request (and one pending) on the cluster `tiny`, and
/// a plain cluster for each of `others`.
fn behind_a_tiny_circuit_breaker(
    config: &Value,
    tiny: &Subscriber,
    others: &[&Subscriber],
) -> Envoy {
    Envoy::builder()
        .fanout(config)
        .cluster("tiny", tiny.port())
        .cluster_field(
            "tiny",
            "circuit_breakers",
            json!({ "thresholds": [{ "max_requests": 1, "max_pending_requests": 1 }] }),
        )
        .subscribers(others)
        .concurrency(1)
        .start()
}

/// Envoy 1.40 refuses a call past a full circuit breaker in two ways (measured, issue 16):
/// the first call that needs a new connection waits for it and is then answered 503 with
/// `x-envoy-overloaded` ("reset reason: overflow"); later calls, which find that connection
/// idle, are refused inside `dispatch_http_call` (`InternalFailure`). Both are `overflow`.
#[test]
fn a_circuit_breaker_overflow_is_reported_as_its_own_outcome() {
    let tiny = Subscriber::start("tiny", Behavior::Delay(ms(2500), 200));
    let config = json!({ "timeout_ms": 5000, "subscribers": [{ "cluster": "tiny" }] });
    let envoy = behind_a_tiny_circuit_breaker(&config, &tiny, &[]);
    let holder = send_in_background(&envoy, "holds the only request".into());
    assert_eq!(tiny.wait_for(1, Duration::from_secs(10)), 1);
    let client = Client::http1();
    for attempt in ["answered by Envoy", "refused at dispatch"] {
        let reply = send(client.post(&envoy.url("/")).body(attempt));
        assert_status(&reply, 500);
        let failed = &reply.json()["failed"][0];
        assert_eq!(failed["cluster"], "tiny", "{attempt}: {failed}");
        assert_eq!(failed["outcome"], "overflow", "{attempt}: {failed}");
        let detail = failed["detail"].as_str().unwrap_or_default();
        assert!(detail.contains("circuit breaker"), "{attempt}: {failed}");
    }
    assert_202(&holder.join().unwrap());
    assert_eq!(tiny.count(), 1, "a refused call reached the subscriber");
}

#[test]
fn a_circuit_breaker_overflow_is_retried_and_dead_lettered_as_overflow() {
    // Retryable: once the call holding the only request ends, a retry gets through.
    let tiny = Subscriber::start("tiny", Behavior::Delay(ms(1500), 200));
    let config = json!({
        "timeout_ms": 5000,
        "delivery": { "retry": 6, "backoff_policy": "linear", "backoff_delay_ms": 200 },
        "subscribers": [{ "cluster": "tiny" }]
    });
    let envoy = behind_a_tiny_circuit_breaker(&config, &tiny, &[]);
    let holder = send_in_background(&envoy, "holds the only request".into());
    assert_eq!(tiny.wait_for(1, Duration::from_secs(10)), 1);
    assert_202(&send(Client::http1().post(&envoy.url("/")).body("retried")));
    assert_202(&holder.join().unwrap());
    let bodies: Vec<Vec<u8>> = tiny.requests().into_iter().map(|r| r.body).collect();
    assert_eq!(
        bodies,
        [b"holds the only request".to_vec(), b"retried".to_vec()]
    );
    drop(envoy);

    // Without retries, the dead letter says how it failed.
    let tiny = Subscriber::start("tiny", Behavior::Delay(ms(1500), 200));
    let dlq = Subscriber::ok("dlq");
    let config = json!({
        "timeout_ms": 5000,
        "delivery": { "dead_letter": { "cluster": "dlq" } },
        "subscribers": [{ "cluster": "tiny" }]
    });
    let envoy = behind_a_tiny_circuit_breaker(&config, &tiny, &[&dlq]);
    let holder = send_in_background(&envoy, "holds the only request".into());
    assert_eq!(tiny.wait_for(1, Duration::from_secs(10)), 1);
    let reply = send(Client::http1().post(&envoy.url("/")).body("dead-lettered"));
    assert_202(&reply);
    assert_eq!(reply.header("x-fanout-dead-lettered").as_deref(), Some("1"));
    let letter = dlq.only_request();
    assert_eq!(letter.body, b"dead-lettered");
    assert_eq!(letter.header("x-fanout-failed-outcome"), Some("overflow"));
    assert_202(&holder.join().unwrap());
    assert_eq!(tiny.count(), 1);
}

/// Waits (bounded, generously: stats are flushed on the root context's timer) until the
/// fanout stat `wasmcustom.<name>` is `value`; panics if it does not get there.
fn expect_stat(envoy: &Envoy, name: &str, value: u64) {
    envoy.expect_stat(
        &format!("wasmcustom.{name}"),
        |v| v == value,
        Duration::from_secs(15),
    );
}

#[test]
fn a_failing_best_effort_subscriber_leaves_the_answer_202_and_is_dead_lettered() {
    let billing = Subscriber::ok("billing");
    let audit = Subscriber::start("audit", Behavior::Status(503));
    let dlq = Subscriber::ok("dlq");
    let config = json!({
        "subscribers": [
            { "cluster": "billing" },
            { "cluster": "audit", "required": false,
              "delivery": { "retry": 2, "backoff_delay_ms": 50,
                            "dead_letter": { "cluster": "dlq", "path": "/audit" } } }
        ]
    });
    let envoy = envoy(&config, &[&billing, &audit, &dlq], 2);
    assert_202(&send(Client::http1().post(&envoy.url("/")).body("event")));
    assert_eq!(billing.only_request().body, b"event");
    // The best-effort delivery goes on after the answer: its retries, then the dead letter.
    assert_eq!(audit.wait_for(3, Duration::from_secs(10)), 3);
    assert_eq!(dlq.wait_for(1, Duration::from_secs(10)), 1);
    let letter = dlq.only_request();
    assert_eq!(letter.path, "/audit");
    assert_eq!(letter.body, b"event");
    assert_eq!(letter.header("x-fanout-failed-cluster"), Some("audit"));
    assert_eq!(letter.header("x-fanout-failed-attempts"), Some("3"));
    audit.stays_at(3, ms(300));

    // Without a dead letter, its failure still leaves a 202, and is counted.
    let config = json!({
        "subscribers": [{ "cluster": "billing" }, { "cluster": "audit", "required": false }]
    });
    let envoy = self::envoy(&config, &[&billing, &audit], 2);
    assert_202(&send(Client::http1().post(&envoy.url("/")).body("again")));
    expect_stat(&envoy, "fanout.subscriber.audit.failed.status_5xx", 1);
}

#[test]
fn a_slow_best_effort_subscriber_does_not_delay_the_answer_which_says_it_is_pending() {
    const SLOW: Duration = Duration::from_secs(6);
    let billing = Subscriber::ok("billing");
    let search = Subscriber::start("search", Behavior::Delay(SLOW, 200));
    let config = json!({
        "subscribers": [{ "cluster": "billing" }, { "cluster": "search", "required": false }]
    });
    let envoy = envoy(&config, &[&billing, &search], 2);
    let started = Instant::now();
    {
        let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
        assert_202(&reply);
        assert_eq!(reply.header("x-fanout-pending").as_deref(), Some("1"));
        // The client and its connection go away here: the delivery goes on from the root.
    }
    let answered = started.elapsed();
    // Waiting for the slow one would take SLOW; a loaded machine adds less than this.
    assert!(
        answered < SLOW - LOADED_LATE_SLACK,
        "answered after {answered:?}"
    );
    assert_eq!(billing.only_request().body, b"event");
    assert_eq!(search.wait_for(1, Duration::from_secs(10)), 1);
    // The best-effort delivery completes after the answer.
    expect_stat(&envoy, "fanout.subscriber.search.delivered", 1);

    // A required failure is answered 500 at once too, listing the best-effort subscriber
    // apart from the failed ones.
    billing.set_behavior(Behavior::Status(400));
    let started = Instant::now();
    let reply = send(Client::http1().post(&envoy.url("/")).body("second"));
    assert!(started.elapsed() < SLOW - LOADED_LATE_SLACK);
    assert_status(&reply, 500);
    let report = reply.json();
    let failed: Vec<&str> = report["failed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["cluster"].as_str().unwrap())
        .collect();
    assert_eq!(failed, ["billing"], "{report}");
    let mut rest = report.clone();
    rest["failed"] = json!([]);
    assert!(
        rest.to_string().contains("\"search\""),
        "the report does not name the best-effort subscriber: {report}"
    );
}

#[test]
fn a_channel_of_best_effort_subscribers_answers_at_once_like_async_mode() {
    const SLOW: Duration = Duration::from_secs(6);
    let a = Subscriber::start("a", Behavior::Delay(SLOW, 200));
    let b = Subscriber::start("b", Behavior::Delay(SLOW, 200));
    let config = json!({
        "max_in_flight": 1,
        "subscribers": [
            { "cluster": "a", "required": false },
            { "cluster": "b", "required": false }
        ]
    });
    let envoy = envoy(&config, &[&a, &b], 1);
    let client = Client::http1();
    let reply = send(client.post(&envoy.url("/")).body("event"));
    assert_202(&reply);
    assert_eq!(reply.header("x-fanout-pending").as_deref(), Some("2"));
    assert!(
        reply.elapsed < SLOW - LOADED_LATE_SLACK,
        "{:?}",
        reply.elapsed
    );
    // Bounded by max_in_flight, like async mode.
    let second = send(client.post(&envoy.url("/")).body("second"));
    assert_rejected(&second, 503);
    assert!(second.header("retry-after").is_some());
    assert_eq!(a.wait_for(1, Duration::from_secs(10)), 1);
    assert_eq!(b.wait_for(1, Duration::from_secs(10)), 1);
    a.stays_at(1, ms(300));
}

/// The gaps between a subscriber's attempts, as it received them.
fn gaps(sub: &Subscriber) -> Vec<Duration> {
    let requests = sub.requests();
    requests.windows(2).map(|w| w[1].at - w[0].at).collect()
}

/// Retries whose nominal wait is the cap (200 ms): without jitter every gap is at least that
/// (less a coarse-clock tick); with `backoff_jitter: 1.0` the waits spread over [0, 200] ms
/// (the upper half of [0, 400] is capped at 200), a quarter of them under 100 ms. Loose on
/// purpose: a loaded machine only makes gaps longer (a run beside the whole suite added up to
/// 20 ms to most gaps), so the checks are that without jitter no gap is short, and that with
/// it at least a few of 40 are far shorter (under 150 ms) than any unjittered gap can be:
/// with 20 ms of lateness on every gap, 13 are expected and fewer than 3 has a probability of
/// about 1 in 30,000 (1 in 1,000 with 50 ms).
#[test]
fn jitter_spreads_retry_gaps() {
    const NOMINAL: Duration = Duration::from_millis(200);
    let run = |jitter: f64, retries: usize| -> Vec<Duration> {
        let down = Subscriber::start("down", Behavior::Status(503));
        let config = json!({
            "delivery": { "retry": retries, "backoff_delay_ms": 100, "backoff_max_ms": 200,
                          "backoff_jitter": jitter },
            "subscribers": [{ "cluster": "down", "timeout_ms": 1000 }]
        });
        let envoy = envoy(&config, &[&down], 1);
        let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
        assert_status(&reply, 500);
        assert_eq!(reply.json()["failed"][0]["attempts"], retries + 1);
        gaps(&down)
    };

    let steady = run(0.0, 10);
    assert_eq!(steady.len(), 10);
    for gap in &steady {
        assert!(
            *gap + TIMER_EARLY_SLACK >= NOMINAL,
            "without jitter: {steady:?}"
        );
    }

    let spread = run(1.0, 40);
    assert_eq!(spread.len(), 40);
    let short = spread.iter().filter(|gap| **gap < ms(150)).count();
    assert!(short >= 3, "only {short} short gaps: {spread:?}");
}

/// `Retry-After` is a floor that jitter never goes under.
#[test]
fn jitter_never_waits_less_than_retry_after_asked() {
    let busy = Subscriber::start(
        "busy",
        Behavior::Respond {
            status: 503,
            headers: vec![("retry-after".into(), "1".into())],
            body: "busy".into(),
        },
    );
    let config = json!({
        "delivery": { "retry": 3, "backoff_delay_ms": 10, "backoff_max_ms": 5000,
                      "backoff_jitter": 1.0 },
        "subscribers": [{ "cluster": "busy" }]
    });
    let envoy = envoy(&config, &[&busy], 1);
    assert_status(
        &send(Client::http1().post(&envoy.url("/")).body("event")),
        500,
    );
    let gaps = gaps(&busy);
    assert_eq!(gaps.len(), 3);
    for gap in &gaps {
        assert_waited_at_least(*gap, Duration::from_secs(1), "retry-after 1");
    }
}
