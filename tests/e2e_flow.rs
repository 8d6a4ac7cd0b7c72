//! Flow control in the real Envoy (issue 16): jittered retry waits; Envoy's own circuit
//! breaker reported as its own outcome, `overflow`.
//!
//! The per-subscriber cap and best-effort subscribers are not in this file yet (branch
//! `t16-rest` has their tests, written before the behaviour).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod harness;

use std::time::Duration;

use harness::timing::{assert_waited_at_least, TIMER_EARLY_SLACK};
use harness::{assert_202, assert_status, send, Behavior, Client, Envoy, Reply, Subscriber};
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

/// The gaps between a subscriber's attempts, as it received them.
fn gaps(sub: &Subscriber) -> Vec<Duration> {
    let requests = sub.requests();
    requests.windows(2).map(|w| w[1].at - w[0].at).collect()
}

/// Twenty retries whose nominal wait is the cap (200 ms): without jitter every gap is at least
/// that (less a coarse-clock tick); with `backoff_jitter: 0.5` the waits spread over
/// [100, 200] ms. Loose on purpose: a loaded machine only makes gaps longer, so the checks are
/// that no gap is shorter than the jitter allows, and that several are clearly shorter than
/// the unjittered wait, which without jitter none can be.
#[test]
fn jitter_spreads_retry_gaps() {
    const RETRIES: usize = 20;
    const NOMINAL: Duration = Duration::from_millis(200);
    let run = |jitter: f64| -> Vec<Duration> {
        let down = Subscriber::start("down", Behavior::Status(503));
        let config = json!({
            "delivery": { "retry": RETRIES, "backoff_delay_ms": 100, "backoff_max_ms": 200,
                          "backoff_jitter": jitter },
            "subscribers": [{ "cluster": "down", "timeout_ms": 1000 }]
        });
        let envoy = envoy(&config, &[&down], 1);
        let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
        assert_status(&reply, 500);
        assert_eq!(reply.json()["failed"][0]["attempts"], RETRIES + 1);
        gaps(&down)
    };

    let steady = run(0.0);
    assert_eq!(steady.len(), RETRIES);
    for gap in &steady {
        assert!(
            *gap + TIMER_EARLY_SLACK >= NOMINAL,
            "without jitter: {steady:?}"
        );
    }

    let spread = run(0.5);
    assert_eq!(spread.len(), RETRIES);
    for gap in &spread {
        assert!(
            *gap + TIMER_EARLY_SLACK >= NOMINAL / 2,
            "a gap below (1 - jitter) x the wait: {spread:?}"
        );
    }
    // Half the draws land below 150 ms: that at least three land below 175 ms is near-certain
    // with jitter and impossible without it (every gap above is at least 190 ms).
    let short = spread.iter().filter(|gap| **gap < ms(175)).count();
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
