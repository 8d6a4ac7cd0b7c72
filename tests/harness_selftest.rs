//! Checks of the end-to-end harness itself, with Envoy as a plain proxy (no filter): process
//! handling, readiness, subscriber behaviours, and the refused-config path.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod harness;

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
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(request.join().unwrap().is_err());
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
