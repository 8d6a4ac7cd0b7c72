//! Affinity without a store (issue 23 §3): the shipped front (`envoy/front-affinity.yaml`:
//! `hash_policy` on `ce-source` and `ce-id`, `MAGLEV`) over two fanout replicas with the
//! default `envoy` dedupe store sends every copy of a binary-mode event to one replica, so a
//! redelivery after a partial failure reaches only the subscriber that failed. A round-robin
//! front sends the redelivery to the other replica, which calls everyone again: the
//! documented difference, asserted.

use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::front::{front_bootstrap, start_replica, Balance, Front};
use crate::harness::{
    free_ports, read_shipped, read_shipped_yaml, send, validate_config, Behavior, Client, Envoy,
    Subscriber,
};

/// Events per run: enough that MAGLEV puts some on each replica.
const EVENTS: usize = 16;

fn config() -> Value {
    json!({
        "dedupe": { "ttl_ms": 600000, "max_entries": 10000 },
        "subscribers": [{ "cluster": "steady" }, { "cluster": "flaky" }]
    })
}

/// `flaky` fails the first copy of every event and takes the second (each event is sent
/// twice, one after the other, so its requests alternate); `steady` takes everything.
fn subscribers() -> (Subscriber, Subscriber) {
    let steps: Vec<Behavior> = (0..EVENTS * 2)
        .map(|i| Behavior::Status(if i % 2 == 0 { 500 } else { 200 }))
        .chain([Behavior::Status(200)])
        .collect();
    (
        Subscriber::ok("steady"),
        Subscriber::start("flaky", Behavior::Sequence(steps)),
    )
}

struct Run {
    steady_calls: usize,
    flaky_calls: usize,
    /// Events each replica received (its `fanout.requests.received`).
    per_replica: Vec<u64>,
    /// The second copies' statuses.
    redelivered: Vec<u16>,
}

/// Two replicas behind the front; every event sent, it fails at `flaky` (500), then sent
/// again as the sender's retry.
fn run(balance: Balance) -> Run {
    let (steady, flaky) = subscribers();
    let ports = free_ports(2);
    let replicas: Vec<Envoy> = ports
        .iter()
        .map(|port| {
            start_replica(
                Envoy::builder()
                    .fanout(&config())
                    .subscribers(&[&steady, &flaky]),
                *port,
            )
        })
        .collect();
    let front = Front::start(balance, &ports);
    let client = Client::http1();
    let mut redelivered = Vec::new();
    for i in 0..EVENTS {
        let copy = || {
            send(
                client
                    .post(&front.url("/"))
                    .header("ce-specversion", "1.0")
                    .header("ce-type", "com.example.order")
                    .header("ce-source", "/orders")
                    .header("ce-id", format!("order-{i}"))
                    .header("content-type", "application/json")
                    .body(format!("{{\"order\":{i}}}")),
            )
        };
        let first = copy();
        assert_eq!(
            first.status,
            500,
            "the first copy fails at flaky: {}",
            first.text()
        );
        redelivered.push(copy().status);
    }
    // Flushed once a second: wait until both replicas counted every request.
    let total = |rs: &[Envoy]| -> u64 {
        rs.iter()
            .map(|r| r.stat("wasmcustom.fanout.requests.received").unwrap_or(0))
            .sum()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while total(&replicas) < (EVENTS * 2) as u64 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let per_replica = replicas
        .iter()
        .map(|r| r.stat("wasmcustom.fanout.requests.received").unwrap_or(0))
        .collect();
    Run {
        steady_calls: steady.count(),
        flaky_calls: flaky.count(),
        per_replica,
        redelivered,
    }
}

#[test]
fn the_shipped_front_validates_and_hashes_on_the_cloudevents_identity() {
    let shipped = read_shipped_yaml("envoy/front-affinity.yaml");
    let route = &shipped["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["route_config"]["virtual_hosts"][0]["routes"][0]["route"];
    let hashed: Vec<&str> = route["hash_policy"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["header"]["header_name"].as_str().unwrap())
        .collect();
    assert_eq!(hashed, ["ce-source", "ce-id"]);
    assert_eq!(
        shipped["static_resources"]["clusters"][0]["lb_policy"],
        "MAGLEV"
    );
    let retry_on = route["retry_policy"]["retry_on"].as_str().unwrap();
    for never in [
        "5xx",
        "gateway-error",
        "retriable-status-codes",
        "reset,",
        "deadline",
    ] {
        assert!(
            !format!("{retry_on},").contains(never),
            "the front must not retry what fanout may have accepted ({never}): {retry_on}"
        );
    }
    // The file as shipped (DNS names and all) is a valid Envoy bootstrap.
    validate_config(
        &read_shipped("envoy/front-affinity.yaml"),
        "envoy/front-affinity.yaml",
    );
    let dr = read_shipped_yaml("envoy/istio-destinationrule.yaml");
    assert_eq!(dr["kind"], "DestinationRule");
    assert_eq!(
        dr["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"]["httpHeaderName"],
        "ce-id"
    );
    // And the round-robin variant the tests use differs only in the balancing.
    let rr = front_bootstrap(Balance::RoundRobin, &[1, 2]);
    assert_eq!(
        rr["static_resources"]["clusters"][0]["lb_policy"],
        "ROUND_ROBIN"
    );
}

#[test]
fn with_the_hashing_front_a_redelivery_reaches_only_the_subscriber_that_failed() {
    let run = run(Balance::Affinity);
    assert!(
        run.redelivered.iter().all(|s| *s == 202),
        "every redelivery is taken: {:?}",
        run.redelivered
    );
    assert_eq!(
        run.steady_calls, EVENTS,
        "steady was called again for a redelivery: every copy of an event must reach the \
         replica that remembers it"
    );
    assert_eq!(run.flaky_calls, EVENTS * 2);
    // Both replicas carried events (16 events all on one of two replicas: 2^-15), each
    // event's two copies on the same one: an even count each.
    assert!(
        run.per_replica.iter().all(|n| *n > 0 && n % 2 == 0),
        "events per replica: {:?}",
        run.per_replica
    );
}

#[test]
fn with_a_round_robin_front_a_redelivery_calls_everyone_again() {
    let run = run(Balance::RoundRobin);
    assert!(
        run.redelivered.iter().all(|s| *s == 202),
        "{:?}",
        run.redelivered
    );
    // The front (one connection, round robin) alternates replicas: the retry of each event
    // lands on the replica that has no record of it, and steady gets it twice.
    assert_eq!(
        run.steady_calls,
        EVENTS * 2,
        "the documented difference: without affinity (or the etcd store) a redelivery \
         through another replica is not deduplicated"
    );
    assert_eq!(run.per_replica, vec![EVENTS as u64, EVENTS as u64]);
}
