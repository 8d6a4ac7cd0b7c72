//! Checks of the end-to-end harness itself, with Envoy as a plain proxy (no filter): process
//! handling, readiness, subscriber behaviours, and the refused-config path.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness;

use std::time::Duration;

use harness::{chunked_body, send, Behavior, Client, Envoy, Subscriber};

fn process_exists(pid: u32) -> bool {
    // Signal 0: existence check. A zombie would still count, but we reap in stop().
    // SAFETY: no memory involved.
    unsafe { libc::kill(pid as libc::pid_t, 0) == 0 }
}

#[test]
fn plain_proxy_reaches_a_recording_subscriber_and_envoy_is_gone_after_drop() {
    let sub = Subscriber::start("echo", Behavior::Status(201));
    let envoy = Envoy::builder()
        .cluster("echo", sub.port())
        .plain_proxy_to("echo")
        .start();
    let pid = envoy.pid();
    assert!(process_exists(pid));
    assert_ne!(envoy.admin_port(), envoy.port());
    let (code, body) = envoy.admin_get("/ready");
    assert_eq!((code, body.trim()), (200, "LIVE"));

    let client = Client::http1();
    let reply = send(
        client
            .post(&envoy.url("/some/path?q=1"))
            .header("x-test", "yes")
            .body("hello"),
    );
    assert_eq!(reply.status, 201, "{}", reply.text());
    assert!(reply.text().contains("subscriber echo answers 201"));
    let reply = send(
        client
            .post(&envoy.url("/chunked"))
            .body(chunked_body(vec![7u8; 100_000])),
    );
    assert_eq!(reply.status, 201);

    let h2 = Client::h2c();
    let reply = send(h2.post(&envoy.url("/h2")).body("over h2c"));
    assert_eq!(reply.status, 201);
    assert_eq!(reply.version, reqwest::Version::HTTP_2);

    let requests = sub.requests();
    assert_eq!(requests.len(), 3);
    assert_eq!(requests[0].method, "POST");
    assert_eq!(requests[0].path, "/some/path?q=1");
    assert_eq!(requests[0].header("x-test"), Some("yes"));
    assert_eq!(requests[0].body, b"hello");
    assert_eq!(requests[1].body, vec![7u8; 100_000]);
    assert_eq!(requests[2].body, b"over h2c");
    assert!(envoy.wait_for_log("starting main dispatch loop", Duration::from_secs(5)));

    drop(envoy);
    assert!(!process_exists(pid), "Envoy (pid {pid}) survived its guard");
}

#[test]
fn subscriber_delay_and_reset_behave_as_set() {
    let slow = Subscriber::start("slow", Behavior::Delay(Duration::from_millis(400), 204));
    let broken = Subscriber::start("broken", Behavior::Reset);
    let client = Client::http1();

    let reply = send(client.post(&format!("http://{}/", slow.addr())).body("x"));
    assert_eq!(reply.status, 204);
    // The subscriber's own sleep, on the precise monotonic clock the client reads too: it
    // cannot end early; 10 ms is only for the two clocks' reads.
    assert!(
        reply.elapsed >= Duration::from_millis(390),
        "{:?}",
        reply.elapsed
    );

    let err = client
        .post(&format!("http://{}/", broken.addr()))
        .body("x")
        .send()
        .expect_err("a reset connection is an error");
    assert!(!err.is_status(), "{err:?}");
    assert_eq!(broken.count(), 1);

    slow.set_behavior(Behavior::Status(200));
    let reply = send(client.post(&format!("http://{}/", slow.addr())).body("y"));
    assert_eq!(reply.status, 200);
    assert_eq!(slow.wait_for(2, Duration::from_secs(1)), 2);
}

#[test]
fn dropping_a_subscriber_with_a_request_in_flight_returns_promptly() {
    let slow = Subscriber::start("stuck", Behavior::Delay(Duration::from_secs(60), 200));
    let addr = slow.addr();
    let request = std::thread::spawn(move || {
        Client::http1()
            .post(&format!("http://{addr}/"))
            .body("x")
            .send()
    });
    assert_eq!(slow.wait_for(1, Duration::from_secs(5)), 1);
    let start = std::time::Instant::now();
    drop(slow);
    // Promptly: not after the 60 s delay (the subscriber checks its stop flag every 5 ms);
    // whatever a loaded machine adds to joining its threads stays far below that.
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    assert!(request.join().unwrap().is_err());
}

#[test]
fn a_subscriber_measures_the_requests_it_handles_at_once() {
    let slow = Subscriber::start("slow", Behavior::Delay(Duration::from_millis(300), 200));
    let url = format!("http://{}/", slow.addr());
    let client = Client::http1();
    for _ in 0..2 {
        assert_eq!(send(client.post(&url).body("one at a time")).status, 200);
    }
    assert_eq!(slow.max_concurrent(), 1);
    // Long enough that a loaded machine still starts all three before the first is answered.
    slow.set_behavior(Behavior::Delay(Duration::from_secs(2), 200));
    let senders: Vec<_> = (0..3)
        .map(|_| {
            let url = url.clone();
            // A client each: a connection each, so the three are in flight together.
            std::thread::spawn(move || send(Client::http1().post(&url).body("together")).status)
        })
        .collect();
    assert_eq!(slow.wait_for(5, Duration::from_secs(5)), 5);
    for sender in senders {
        assert_eq!(sender.join().unwrap(), 200);
    }
    // All three were received before the first answer.
    assert_eq!(slow.max_concurrent(), 3);
    // A request stops counting as active once its answer is written, which the client may
    // read first: none stays active for long.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while slow.active() != 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(slow.active(), 0);
}

#[test]
fn cluster_fields_and_the_worker_count_reach_envoy() {
    let sub = Subscriber::ok("tiny");
    let envoy = Envoy::builder()
        .cluster("tiny", sub.port())
        .cluster_field(
            "tiny",
            "circuit_breakers",
            serde_json::json!({ "thresholds": [{ "max_requests": 3, "max_pending_requests": 2 }] }),
        )
        .concurrency(1)
        .plain_proxy_to("tiny")
        .start();
    let (_, clusters) = envoy.admin_get("/clusters");
    assert!(
        clusters.contains("tiny::default_priority::max_requests::3"),
        "{clusters}"
    );
    assert!(
        clusters.contains("tiny::default_priority::max_pending_requests::2"),
        "{clusters}"
    );
    let (_, info) = envoy.admin_get("/server_info");
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(info["command_line_options"]["concurrency"], 1, "{info}");
}

#[test]
fn an_invalid_envoy_config_is_reported_with_its_log() {
    // A route to a cluster that does not exist: Envoy refuses the bootstrap.
    let (status, log) = Envoy::builder()
        .plain_proxy_to("nowhere")
        .start_expecting_failure();
    assert!(!status.success());
    assert!(log.contains("nowhere"), "{log}");
}

#[test]
fn the_timing_checks_allow_a_timer_a_tick_early_and_refuse_one_at_half_or_never() {
    use harness::timing::{
        assert_waited_about, assert_waited_at_least, poll_until, LOADED_LATE_SLACK,
    };
    const fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }
    let nominal = ms(700);
    // What Envoy did under load: passes.
    assert_waited_at_least(Duration::from_micros(699_450), nominal, "a tick early");
    assert_waited_about(nominal + ms(2500), nominal, "late on a loaded machine");
    // A timeout at half its value, a retry with no backoff, a timer that never fired: fail.
    let fails = |check: fn()| std::panic::catch_unwind(check).is_err();
    assert!(fails(|| assert_waited_at_least(ms(350), ms(700), "half")));
    assert!(fails(|| assert_waited_at_least(
        ms(1),
        ms(50),
        "no backoff"
    )));
    assert!(fails(|| assert_waited_about(
        ms(700) + LOADED_LATE_SLACK,
        ms(700),
        "never fired"
    )));

    let mut calls = 0;
    let found = poll_until(Duration::from_secs(5), ms(1), || {
        calls += 1;
        (calls == 3).then_some(calls)
    });
    assert_eq!(found, Some(3));
    let start = std::time::Instant::now();
    assert_eq!(poll_until(ms(50), ms(10), || None::<()>), None);
    assert!(
        start.elapsed() >= ms(50),
        "gave up early: {:?}",
        start.elapsed()
    );
}
