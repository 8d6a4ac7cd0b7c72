//! Flow control in the real Envoy (issue 16): jittered retry waits; Envoy's own circuit
//! breaker reported as its own outcome, `overflow`.
//!
//! The per-subscriber cap and best-effort subscribers are not in this file yet (branch
//! `t16-rest` has their tests, written before the behaviour).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod harness;

use std::time::Duration;

use harness::timing::{assert_waited_at_least, TIMER_EARLY_SLACK};
use harness::{assert_status, send, Behavior, Client, Envoy, Subscriber};
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
