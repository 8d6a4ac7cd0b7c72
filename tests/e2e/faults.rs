//! Hostile conditions in the real Envoy: subscribers that die, hang, flood or speak
//! broken HTTP; clients that leave mid-fan-out by the thousand; a channel of 1000
//! subscribers; and requests that try to reach what they should not.
//!
//! Every outcome asserted here is one we observed with Envoy 1.40.0 (and 1.36.4) and is
//! documented in SECURITY.md and the README's "Hostile conditions" section. Deadlines are
//! generous (a loaded 2-core machine); loops are bounded; everything is on loopback.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness::faults::{raw_request, Fault, FaultServer};
use harness::timing::{assert_host_measured_at_least, assert_waited_at_least, poll_until};
use harness::{
    assert_202, assert_status, send, set_linger_zero, Behavior, Client, Envoy, Recorded, Reply,
    Subscriber,
};
use serde_json::{json, Value};

// ---------------------------------------------------------------------------------------
// Helpers

/// The 500 report of a fan-out in which exactly the subscribers `failed` failed: returns
/// each one's entry by cluster.
fn report_naming(reply: &Reply, failed: &[&str]) -> BTreeMap<String, Value> {
    assert_status(reply, 500);
    assert_eq!(
        reply.header("x-fanout-failed"),
        Some(failed.len().to_string()),
        "{reply:?}"
    );
    let report = reply.json();
    let entries: BTreeMap<String, Value> = report["failed"]
        .as_array()
        .unwrap_or_else(|| panic!("no failed list: {report}"))
        .iter()
        .map(|e| (e["cluster"].as_str().unwrap().to_owned(), e.clone()))
        .collect();
    let names: BTreeSet<&str> = entries.keys().map(String::as_str).collect();
    assert_eq!(names, failed.iter().copied().collect(), "{report:#}");
    entries
}

/// One POST with `Host: host`.
fn post(client: &Client, envoy: &Envoy, host: &str, body: &str) -> Reply {
    send(
        client
            .post(&envoy.url("/"))
            .header("host", host)
            .body(body.to_owned()),
    )
}

/// Envoy and the filter are fine: Envoy runs (same process), its log has no panic and no
/// wasm failure.
fn assert_envoy_healthy(envoy: &mut Envoy, pid: u32) {
    assert!(envoy.try_wait_alive(), "Envoy exited:\n{}", envoy.log());
    assert_eq!(envoy.pid(), pid, "Envoy was restarted");
    let log = envoy.log();
    for bad in [
        "panicked",
        "wasm trap",
        "Function: proxy_on",
        "failed to call",
        "VM is dead",
    ] {
        assert!(!log.contains(bad), "Envoy's log has {bad:?}:\n{log}");
    }
}

/// A `host: <name>` request that ends with `body`, as raw HTTP/1.1 bytes.
fn raw_post(host: &str, path: &str, extra: &str, body: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

// ---------------------------------------------------------------------------------------
// A subscriber killed mid-load, then restarted on the same port.

#[test]
fn a_subscriber_killed_mid_load_fails_with_a_report_while_down_and_all_202_after_its_restart() {
    let a = Subscriber::ok("steady-a");
    let b = Subscriber::ok("steady-b");
    let victim = FaultServer::start("victim", Fault::Ok);
    let config = json!({ "subscribers": [
        { "cluster": "steady-a" }, { "cluster": "victim", "timeout_ms": 5000 }, { "cluster": "steady-b" }
    ] });
    let mut envoy = Envoy::with_clusters(
        &config,
        &[
            ("steady-a", a.port()),
            ("victim", victim.port()),
            ("steady-b", b.port()),
        ],
    );
    let pid = envoy.pid();
    let url = envoy.url("/");

    // Four senders, each one request after the other, until told to stop (bounded anyway).
    let stop = Arc::new(AtomicBool::new(false));
    let results: Arc<Mutex<Vec<(Instant, Instant, Reply)>>> = Arc::default();
    let senders: Vec<_> = (0..4)
        .map(|t| {
            let (stop, results, url) = (Arc::clone(&stop), Arc::clone(&results), url.clone());
            std::thread::spawn(move || {
                let client = Client::http1();
                for i in 0..20_000 {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let begun = Instant::now();
                    let reply = send(client.post(&url).body(format!("event-{t}-{i}")));
                    results.lock().unwrap().push((begun, Instant::now(), reply));
                }
            })
        })
        .collect();

    // A phase lasts its time and until PHASE_REQUESTS requests begun in it have ended (polled,
    // bounded): a loaded machine gets through fewer requests per second, and each phase must
    // have enough to mean something.
    const PHASE_REQUESTS: usize = 20;
    // After the restart, a request begun within RESTART_GRACE may still meet the dead
    // connection: it counts as straddling, not as "after".
    const RESTART_GRACE: Duration = Duration::from_millis(300);
    let phase = |from: Instant, lasting: Duration| {
        let ended = poll_until(Duration::from_secs(60), Duration::from_millis(20), || {
            let n = results
                .lock()
                .unwrap()
                .iter()
                .filter(|(begun, _, _)| *begun > from)
                .count();
            (from.elapsed() >= lasting && n >= PHASE_REQUESTS).then_some(())
        });
        assert!(
            ended.is_some(),
            "fewer than {PHASE_REQUESTS} requests in a phase"
        );
    };
    phase(Instant::now(), Duration::from_millis(1500));
    let kill_begun = Instant::now();
    let killed = victim.kill();
    let kill_done = Instant::now();
    phase(kill_done, Duration::from_millis(1500));
    let restart_begun = Instant::now();
    let victim = killed.restart();
    let restart_done = Instant::now();
    phase(restart_done + RESTART_GRACE, Duration::from_millis(1700));
    stop.store(true, Ordering::SeqCst);
    for s in senders {
        s.join().unwrap();
    }

    let results = results.lock().unwrap();
    let (mut up, mut down, mut after, mut straddling) = (0, 0, 0, 0);
    for (begun, ended, reply) in results.iter() {
        if *ended < kill_begun {
            assert_202(reply);
            up += 1;
        } else if *begun > kill_done && *ended < restart_begun {
            // Down: connection refused, the report says so and names only the victim.
            let entries = report_naming(reply, &["victim"]);
            assert_eq!(entries["victim"]["outcome"], "reset", "{:?}", reply.text());
            assert_eq!(reply.json()["delivered"], 2);
            down += 1;
        } else if *begun > restart_done + RESTART_GRACE {
            assert_202(reply);
            after += 1;
        } else {
            // In flight while it died or came back: either, but nothing else.
            if reply.status != 202 {
                report_naming(reply, &["victim"]);
            }
            straddling += 1;
        }
    }
    eprintln!(
        "kill/restart: {} requests: {up} before (all 202), {down} while down (all 500 naming \
         the victim, outcome reset), {after} after the restart (all 202), {straddling} in \
         between; victim answered {}",
        results.len(),
        victim.count()
    );
    assert!(
        up >= 5 && down >= 5 && after >= 5,
        "too few requests in a phase: {up}/{down}/{after}"
    );
    // Nothing lost silently: the healthy subscribers got every event, down or not.
    assert_eq!(a.count(), results.len());
    assert_eq!(b.count(), results.len());
    assert_envoy_healthy(&mut envoy, pid);
}

// ---------------------------------------------------------------------------------------
// A subscriber that accepts and never answers.

#[test]
fn a_subscriber_that_accepts_and_never_answers_is_a_timeout_at_its_timeout() {
    let silent = FaultServer::start("silent", Fault::Silent);
    let ok = Subscriber::ok("ok");
    let config = json!({ "subscribers": [
        { "cluster": "silent", "timeout_ms": 700 }, { "cluster": "ok" }
    ] });
    let mut envoy = Envoy::with_clusters(&config, &[("silent", silent.port()), ("ok", ok.port())]);
    let pid = envoy.pid();
    let reply = post(&Client::http1(), &envoy, "any", "e");
    let entries = report_naming(&reply, &["silent"]);
    let entry = &entries["silent"];
    assert_eq!(entry["outcome"], "timeout", "{entry}");
    assert_eq!(entry["detail"], "no answer within the timeout of 700 ms");
    let timeout = Duration::from_millis(700);
    // The report's clock is the host's wall clock, the client's its own: both see Envoy's
    // timer fire up to a coarse-clock tick early (we saw 698 and 699 ms in the report and
    // 699.45 ms at the client), never at half the timeout.
    let elapsed = Duration::from_millis(entry["elapsed_ms"].as_u64().unwrap());
    assert_host_measured_at_least(elapsed, timeout, "the report's elapsed_ms");
    assert_waited_at_least(reply.elapsed, timeout, "the client's wait");
    // Late only tells "fired" from "never fired" (the subscriber never answers): generous.
    assert!(
        reply.elapsed < Duration::from_secs(10),
        "answered after {:?}",
        reply.elapsed
    );
    eprintln!(
        "silent subscriber: 500 timeout after {:?} (timeout 700 ms)",
        reply.elapsed
    );
    assert_eq!(silent.count(), 1);
    assert_eq!(ok.count(), 1);
    assert_envoy_healthy(&mut envoy, pid);
}

// ---------------------------------------------------------------------------------------
// A subscriber that answers with a 10 MiB body.

const TEN_MIB: usize = 10 * 1024 * 1024;

#[test]
fn a_10_mib_answer_is_taken_as_its_status_and_a_failures_detail_stays_short() {
    let huge_ok = FaultServer::start("huge-ok", Fault::Sized(200, TEN_MIB));
    let huge_fail = FaultServer::start("huge-fail", Fault::Sized(503, TEN_MIB));
    let ok = Subscriber::ok("ok");
    let config = json!({ "channels": [
        { "name": "ok", "hosts": ["ok.test"], "subscribers": [
            { "cluster": "huge-ok", "timeout_ms": 10000 }, { "cluster": "ok" } ] },
        { "name": "fail", "hosts": ["fail.test"], "subscribers": [
            { "cluster": "huge-fail", "timeout_ms": 10000 }, { "cluster": "ok" } ] }
    ] });
    let mut envoy = Envoy::with_clusters(
        &config,
        &[
            ("huge-ok", huge_ok.port()),
            ("huge-fail", huge_fail.port()),
            ("ok", ok.port()),
        ],
    );
    let pid = envoy.pid();
    let client = Client::http1();

    // 200 with 10 MiB: Envoy's async client takes the whole answer; the filter reads no body
    // of a 2xx (no reply target), so the subscriber counts as delivered.
    let reply = post(&client, &envoy, "ok.test", "e");
    assert_202(&reply);
    eprintln!(
        "10 MiB 200 answer: {} after {:?}",
        reply.status, reply.elapsed
    );

    // 503 with 10 MiB: a failure whose detail quotes only the start of the body.
    let reply = post(&client, &envoy, "fail.test", "e");
    let entries = report_naming(&reply, &["huge-fail"]);
    let entry = &entries["huge-fail"];
    assert_eq!(entry["outcome"], "status");
    assert_eq!(entry["status"], 503);
    let detail = entry["detail"].as_str().unwrap();
    assert!(
        detail.len() <= 256 + 3 && detail.starts_with("xxxx"),
        "{} bytes",
        detail.len()
    );
    assert!(
        reply.body.len() < 4096,
        "the report is {} bytes",
        reply.body.len()
    );
    eprintln!(
        "10 MiB 503 answer: 500 report of {} bytes after {:?}",
        reply.body.len(),
        reply.elapsed
    );

    // Several at once do not hurt Envoy.
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (client, url) = (client.clone(), envoy.url("/"));
            std::thread::spawn(move || send(client.post(&url).header("host", "ok.test").body("e")))
        })
        .collect();
    for t in threads {
        assert_202(&t.join().unwrap());
    }
    assert_eq!(ok.count(), 6);
    assert_envoy_healthy(&mut envoy, pid);
}

// ---------------------------------------------------------------------------------------
// A subscriber that answers with malformed HTTP.

/// Envoy and the fan-out behind hosts `<name>.test`, one per case: the case's server and a
/// healthy peer. Returns each case's failed entry.
fn malformed_outcomes(cases: &[(&str, &[u8])]) -> Vec<(String, Value)> {
    let servers: Vec<FaultServer> = cases
        .iter()
        .map(|(name, bytes)| FaultServer::start(name, Fault::Raw(bytes.to_vec())))
        .collect();
    let ok = Subscriber::ok("ok");
    let channels: Vec<Value> = cases
        .iter()
        .map(|(name, _)| {
            json!({ "name": name, "hosts": [format!("{name}.test")], "subscribers": [
                { "cluster": name, "timeout_ms": 5000 }, { "cluster": "ok" } ] })
        })
        .collect();
    let mut clusters: Vec<(&str, u16)> = cases
        .iter()
        .zip(&servers)
        .map(|((name, _), s)| (*name, s.port()))
        .collect();
    clusters.push(("ok", ok.port()));
    let mut envoy = Envoy::with_clusters(&json!({ "channels": channels }), &clusters);
    let pid = envoy.pid();
    let client = Client::http1();
    let mut entries = Vec::new();
    for (name, _) in cases {
        let reply = post(&client, &envoy, &format!("{name}.test"), "e");
        let report = report_naming(&reply, &[name]);
        // Envoy ends such a call as soon as it reads the bad answer; the bound is the call's
        // own 5 s timeout, the wrong behaviour it tells this from (however loaded the machine).
        assert!(
            reply.elapsed < Duration::from_secs(5),
            "{name}: after {:?}",
            reply.elapsed
        );
        eprintln!("malformed answer {name}: {}", report[*name]);
        entries.push(((*name).to_owned(), report[*name].clone()));
    }
    assert_eq!(ok.count(), cases.len());
    assert_envoy_healthy(&mut envoy, pid);
    entries
}

#[test]
fn an_answer_cut_short_is_no_response_and_a_close_without_answer_is_a_reset() {
    let entries = malformed_outcomes(&[
        (
            "closed-early",
            b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b",
        ),
        ("closed-silently", b""),
    ]);
    assert_eq!(entries[0].1["outcome"], "no_response", "{:?}", entries[0]);
    assert_eq!(entries[0].1["detail"], "the call ended without an answer");
    assert_eq!(entries[1].1["outcome"], "reset", "{:?}", entries[1]);
    assert!(entries[1].1["detail"]
        .as_str()
        .unwrap()
        .contains("connection termination"));
}

/// FAILS with the filter as of this commit (reported as a filter bug): Envoy answers a call
/// whose answer it cannot parse with its own local reply `502 upstream connect error or
/// disconnect/reset before headers. reset reason: protocol error`; `fanout::classify`
/// recognizes that text only with a 503, so the report says `"outcome": "status", "status":
/// 502`, as if the subscriber had answered 502, and the metric is `failed.status_5xx`.
/// Expected: `"outcome": "reset"`, no `status`, like every other reset Envoy reports.
#[test]
fn an_answer_that_is_not_http_is_a_reset_not_a_502_from_the_subscriber() {
    let entries = malformed_outcomes(&[
        ("garbage", b"HELLO THIS IS NOT HTTP\r\n\r\n"),
        (
            "bad-status",
            b"HTTP/1.1 abc Oops\r\ncontent-length: 0\r\n\r\n",
        ),
        (
            "bad-header",
            b"HTTP/1.1 200 OK\r\nx-a\0b: c\r\ncontent-length: 0\r\n\r\n",
        ),
    ]);
    for (name, entry) in &entries {
        // What Envoy does is the same for all three: a protocol error before the headers.
        assert!(
            entry["detail"]
                .as_str()
                .unwrap()
                .ends_with("reset reason: protocol error"),
            "{name}: {entry}"
        );
    }
    let wrong: Vec<String> = entries
        .iter()
        .filter(|(_, e)| e["outcome"] != "reset" || e.get("status").is_some())
        .map(|(name, e)| format!("{name}: {e}"))
        .collect();
    assert!(
        wrong.is_empty(),
        "Envoy's protocol-error reply is reported as the subscriber's own status (filter bug, \
         see the comment on this test):\n{}",
        wrong.join("\n")
    );
}

// ---------------------------------------------------------------------------------------
// 1000 clients that disconnect mid-fan-out, under load.

#[test]
fn a_thousand_clients_leaving_mid_fan_out_under_load_break_nothing() {
    let slow = Subscriber::start("slow", Behavior::Delay(Duration::from_millis(300), 200));
    let slow2 = Subscriber::ok("slow-peer");
    let fast = Subscriber::ok("fast");
    let config = json!({ "channels": [
        { "name": "slow", "hosts": ["slow.test"], "subscribers": [
            { "cluster": "slow" }, { "cluster": "slow-peer" } ] },
        { "name": "fast", "hosts": ["fast.test"], "subscribers": [{ "cluster": "fast" }] }
    ] });
    let mut envoy = Envoy::builder()
        .fanout(&config)
        .cluster("slow", slow.port())
        .cluster("slow-peer", slow2.port())
        .cluster("fast", fast.port())
        .log_level("warning")
        .start();
    let pid = envoy.pid();
    let addr = envoy.addr();
    // Envoy's own wasm stats (VMs created and active, by runtime), not fanout's: the native
    // build has no VM (what it has, Envoy serving and the counts back to idle, is checked on
    // both builds).
    let wasm = harness::fanout_build() == harness::Build::Wasm;
    let vm_stats = |envoy: &Envoy| -> BTreeMap<String, u64> {
        if wasm {
            envoy.stats("wasm.")
        } else {
            BTreeMap::new()
        }
    };
    let wasm_before = vm_stats(&envoy);

    // Load: requests to both channels all along from 4 clients (to `slow.test` too: they
    // share the worker with the leavers), each must be 202.
    let stop = Arc::new(AtomicBool::new(false));
    let loaders: Vec<_> = (0..4)
        .map(|t| {
            let (stop, url) = (Arc::clone(&stop), envoy.url("/"));
            std::thread::spawn(move || {
                let client = Client::http1();
                let host = if t == 0 { "slow.test" } else { "fast.test" };
                let mut replies = Vec::new();
                for i in 0..50_000 {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    replies.push(send(
                        client
                            .post(&url)
                            .header("host", host)
                            .body(format!("load-{t}-{i}")),
                    ));
                }
                replies
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));

    // 1000 clients: send a whole event, then leave before the answer (after 0-40 ms), half
    // with a FIN and half with an RST; every tenth leaves halfway through its body.
    const CLIENTS: usize = 1000;
    const THREADS: usize = 25;
    let leavers: Vec<_> = (0..THREADS)
        .map(|t| {
            std::thread::spawn(move || {
                for k in 0..CLIENTS / THREADS {
                    let i = t * (CLIENTS / THREADS) + k;
                    let Ok(mut stream) = TcpStream::connect(addr) else { continue };
                    let body = format!("{{\"event\": {i}}}");
                    let request = if i.is_multiple_of(10) {
                        // Declares more than it sends.
                        format!("POST / HTTP/1.1\r\nhost: slow.test\r\ncontent-length: 100\r\n\r\n{body}")
                    } else {
                        format!("POST / HTTP/1.1\r\nhost: slow.test\r\ncontent-length: {}\r\n\r\n{body}", body.len())
                    };
                    let _ = std::io::Write::write_all(&mut stream, request.as_bytes());
                    std::thread::sleep(Duration::from_millis((i % 5) as u64 * 20));
                    if i.is_multiple_of(2) {
                        let _ = set_linger_zero(&stream);
                    }
                    let _ = stream.shutdown(Shutdown::Both);
                }
            })
        })
        .collect();
    let storm_begun = Instant::now();
    for l in leavers {
        l.join().unwrap();
    }
    let storm = storm_begun.elapsed();
    stop.store(true, Ordering::SeqCst);
    let replies: Vec<Reply> = loaders
        .into_iter()
        .flat_map(|l| l.join().unwrap())
        .collect();
    for r in &replies {
        assert_202(r);
    }
    assert!(replies.len() >= 20, "too little load: {}", replies.len());

    // The abandoned calls' subscribers answer after 300 ms; then everything is back to idle.
    let in_flight = envoy.wait_for_stat(
        "wasmcustom.fanout.in_flight",
        |n| n == 0,
        Duration::from_secs(20),
    );
    assert_eq!(
        in_flight.unwrap_or(0),
        0,
        "fan-outs still counted in flight"
    );

    let client = Client::http1();
    for i in 0..10 {
        assert_202(&post(&client, &envoy, "slow.test", &format!("after-{i}")));
        assert_202(&post(&client, &envoy, "fast.test", &format!("after-{i}")));
    }
    let wasm_after = vm_stats(&envoy);
    eprintln!(
        "1000 clients left mid-fan-out in {storm:?}; {} load requests meanwhile, all 202; slow \
         subscriber got {} events; wasm stats before {wasm_before:?} after {wasm_after:?}",
        replies.len(),
        slow.count()
    );
    // The VMs: as many as at the start, none created again (a VM failure would make Envoy
    // create a new one, or fail the requests), none failed or reloaded
    // (`wasm.fanout.vm_reload*`).
    assert!(
        !wasm || wasm_after.keys().any(|k| k.ends_with(".active")),
        "{wasm_after:?}"
    );
    for (name, value) in &wasm_after {
        if name.ends_with(".active") || name.ends_with(".created") {
            assert_eq!(Some(value), wasm_before.get(name), "{name} changed");
        }
        if name.contains("fail") || name.contains("crash") || name.contains("vm_reload") {
            assert_eq!(*value, 0, "{name}");
        }
    }
    assert_envoy_healthy(&mut envoy, pid);
}

// ---------------------------------------------------------------------------------------
// A channel of 1000 subscribers.

#[test]
fn a_channel_of_1000_subscribers_works() {
    let (hubs, envoy, pid) = thousand_subscribers();
    let mut envoy = envoy;
    let client = Client::http1();
    for i in 0..THOUSAND_EVENTS {
        assert_202(&post(&client, &envoy, "any", &format!("event-{i}")));
    }
    for hub in &hubs {
        let want = THOUSAND / HUBS * THOUSAND_EVENTS;
        assert_eq!(
            hub.wait_for(want, Duration::from_secs(30)),
            want,
            "{}",
            hub.name()
        );
    }
    let mut per_subscriber: BTreeMap<(String, String), usize> = BTreeMap::new();
    for r in hubs.iter().flat_map(Subscriber::requests) {
        *per_subscriber
            .entry((r.authority().unwrap_or_default().to_owned(), r.path.clone()))
            .or_default() += 1;
    }
    assert_eq!(
        per_subscriber.len(),
        THOUSAND,
        "not every subscriber was called"
    );
    for ((authority, path), count) in &per_subscriber {
        assert_eq!(*count, THOUSAND_EVENTS, "{authority} {path}");
        assert_eq!(
            authority.trim_end_matches(".test"),
            path.trim_start_matches('/')
        );
    }
    envoy_healthy_then_stop(&mut envoy, pid);
}

const THOUSAND: usize = 1000;
const THOUSAND_EVENTS: usize = 3;
// 25 servers behind 1000 clusters (40 each): Envoy makes 1000 calls over 1000 connection
// pools; the servers tell them apart by authority and path. (One server for all would
// overflow its listen backlog when 1000 connections open at once.)
const HUBS: usize = 25;

/// Envoy with one channel of 1000 subscribers on [`HUBS`] servers. The test is about scale,
/// not speed: each cluster gets a 10 s connect timeout (Envoy's 1 s failed most calls when
/// four CPU burners starved the hub servers) and the filter waits up to 25 s per call (the
/// client gives up at 30 s).
fn thousand_subscribers() -> (Vec<Subscriber>, Envoy, u32) {
    let hubs: Vec<Subscriber> = (0..HUBS)
        .map(|h| Subscriber::ok(&format!("hub{h}")))
        .collect();
    let subscribers: Vec<Value> = (0..THOUSAND)
        .map(|i| json!({ "cluster": format!("s{i}"), "authority": format!("s{i}.test"), "path": format!("/s{i}") }))
        .collect();
    let names: Vec<String> = (0..THOUSAND).map(|i| format!("s{i}")).collect();
    let mut builder = Envoy::builder()
        .fanout(&json!({ "timeout_ms": 25000, "subscribers": subscribers }))
        .clusters(
            names
                .iter()
                .enumerate()
                .map(|(i, n)| (n.as_str(), hubs[i % HUBS].port())),
        );
    for name in &names {
        builder = builder.cluster_field(name, "connect_timeout", json!("10s"));
    }
    let envoy = builder.start();
    let pid = envoy.pid();
    (hubs, envoy, pid)
}

/// What a channel of 1000 costs: Envoy's start-up, each fan-out's time and its RSS, against
/// the same Envoy with a channel of 4. A measurement, not a test: `make bench` runs it
/// (`--ignored --nocapture`) and prints the line.
#[test]
#[ignore = "a measurement: make bench runs it"]
fn bench_cost_of_a_1000_subscriber_channel() {
    let started = Instant::now();
    let (hubs, envoy, _) = thousand_subscribers();
    let startup = started.elapsed();
    let rss_idle = envoy.rss_kib();
    let client = Client::http1();
    let mut times = Vec::new();
    for i in 0..THOUSAND_EVENTS {
        let reply = post(&client, &envoy, "any", &format!("event-{i}"));
        assert_202(&reply);
        times.push(reply.elapsed);
    }
    let rss_after = envoy.rss_kib();
    drop(envoy);

    let small: Vec<Value> = (0..4)
        .map(|i| json!({ "cluster": format!("s{i}") }))
        .collect();
    let envoy4 = Envoy::builder()
        .fanout(&json!({ "subscribers": small }))
        .clusters((0..4).map(|i| (["s0", "s1", "s2", "s3"][i], hubs[i].port())))
        .start();
    let rss4_idle = envoy4.rss_kib();
    let mut times4 = Vec::new();
    for i in 0..THOUSAND_EVENTS {
        let reply = post(&client, &envoy4, "any", &format!("small-{i}"));
        assert_202(&reply);
        times4.push(reply.elapsed);
    }
    let rss4_after = envoy4.rss_kib();
    println!(
        "1000 subscribers: Envoy ready in {startup:?}; fan-outs took {times:?}; Envoy RSS {} MiB \
         idle, {} MiB after {THOUSAND_EVENTS} events. For comparison, 4 subscribers: fan-outs \
         {times4:?}, RSS {} MiB idle, {} MiB after.",
        rss_idle / 1024,
        rss_after / 1024,
        rss4_idle / 1024,
        rss4_after / 1024
    );
}

fn envoy_healthy_then_stop(envoy: &mut Envoy, pid: u32) {
    assert_envoy_healthy(envoy, pid);
    envoy.stop();
}

// ---------------------------------------------------------------------------------------
// Security: what a request can and cannot reach.

/// Two channels and one Envoy cluster no channel names; `orders.test` reaches only
/// subscriber `a` at `a.internal` `/a`.
struct Fortress {
    a: Subscriber,
    s: Subscriber,
    unlisted: Subscriber,
    envoy: Envoy,
}

fn fortress(forward_headers: Option<Value>) -> Fortress {
    let a = Subscriber::ok("a");
    let s = Subscriber::ok("s");
    let unlisted = Subscriber::ok("unlisted");
    let mut config = json!({ "channels": [
        { "name": "orders", "hosts": ["orders.test"], "subscribers": [
            { "cluster": "a", "authority": "a.internal", "path": "/a", "timeout_ms": 2000 } ] },
        { "name": "secret", "hosts": ["secret.test"], "subscribers": [
            { "cluster": "s", "authority": "s.internal", "path": "/s" } ] }
    ] });
    if let Some(list) = forward_headers {
        config["forward_headers"] = list;
    }
    let envoy = Envoy::with_clusters(
        &config,
        &[
            ("a", a.port()),
            ("s", s.port()),
            ("unlisted", unlisted.port()),
        ],
    );
    Fortress {
        a,
        s,
        unlisted,
        envoy,
    }
}

/// Every call `a` got is exactly the configured one: path, authority, and no header the
/// client sent that is not forwarded by default.
fn assert_configured_call(got: &Recorded, client_headers: &[&str]) {
    assert_eq!(got.method, "POST", "{got:#?}");
    assert_eq!(got.path, "/a", "{got:#?}");
    assert_eq!(got.authority(), Some("a.internal"), "{got:#?}");
    assert!(got.header("x-injected").is_none(), "{got:#?}");
    // Envoy's own x-envoy-expected-rq-timeout-ms is the subscriber's timeout.
    assert_eq!(
        got.header_all("x-envoy-expected-rq-timeout-ms"),
        ["2000"],
        "{got:#?}"
    );
    for name in client_headers {
        let name = name.to_ascii_lowercase();
        if name == "x-envoy-internal" {
            // Envoy sets its own on every call it makes for a filter.
            assert_eq!(got.header_all(&name), ["true"], "{got:#?}");
        } else if name != "content-type" && name != "x-envoy-expected-rq-timeout-ms" {
            assert!(
                got.header(&name).is_none(),
                "{name} reached the subscriber: {got:#?}"
            );
        }
    }
}

#[test]
fn no_header_path_or_body_of_a_request_selects_a_cluster_authority_or_path() {
    let f = fortress(None);
    let addr = f.envoy.addr();
    let envoy_headers = [
        (
            "x-envoy-original-dst-host",
            format!("127.0.0.1:{}", f.unlisted.port()),
        ),
        ("x-envoy-upstream-alt-stat-name", "s".to_owned()),
        ("x-envoy-original-path", "/s".to_owned()),
        ("x-envoy-upstream-rq-timeout-ms", "1".to_owned()),
        ("x-envoy-expected-rq-timeout-ms", "1".to_owned()),
        ("x-envoy-retry-on", "5xx".to_owned()),
        ("x-envoy-max-retries", "10".to_owned()),
        ("x-envoy-internal", "false".to_owned()),
        ("x-envoy-decorator-operation", "s".to_owned()),
        ("x-forwarded-host", "secret.test".to_owned()),
        ("x-forwarded-proto", "https".to_owned()),
        ("x-original-url", "/s".to_owned()),
        ("x-rewrite-url", "/s".to_owned()),
        ("x-http-method-override", "GET".to_owned()),
        ("forwarded", "host=secret.test;proto=https".to_owned()),
        ("cluster", "unlisted".to_owned()),
        ("x-cluster", "s".to_owned()),
        ("x-subscriber", "s".to_owned()),
    ];
    let mut sent = 0;
    // Headers that name clusters, hosts and paths.
    let extra: String = envoy_headers
        .iter()
        .map(|(n, v)| format!("{n}: {v}\r\n"))
        .collect();
    let (code, text) = raw_request(
        addr,
        &raw_post("orders.test", "/", &extra, "{}"),
        Duration::from_secs(10),
    );
    assert_eq!(code, 202, "{text}");
    sent += 1;
    let names: Vec<&str> = envoy_headers.iter().map(|(n, _)| *n).collect();
    assert_configured_call(&f.a.requests()[0], &names);

    // Paths that try to name another subscriber.
    for path in [
        "/s",
        "/../s",
        "/a/../../s",
        "//secret.test/s",
        "/%2e%2e/s",
        "/%2F%2Fsecret.test",
        "/?cluster=s&path=/s&authority=s.internal",
        "/;cluster=s",
        "/#s",
    ] {
        let (code, text) = raw_request(
            addr,
            &raw_post("orders.test", path, "", "{}"),
            Duration::from_secs(10),
        );
        assert!(code == 202 || code == 400, "{path}: {text}");
        if code == 202 {
            sent += 1;
        }
    }
    // A body that names them.
    let body = r#"{"cluster":"s","authority":"s.internal","path":"/s","subscribers":[{"cluster":"unlisted"}]}"#;
    let (code, text) = raw_request(
        addr,
        &raw_post("orders.test", "/", "ce-cluster: s\r\nce-path: /s\r\n", body),
        Duration::from_secs(10),
    );
    assert_eq!(code, 202, "{text}");
    sent += 1;
    let last = f.a.requests().pop().unwrap();
    assert_eq!(last.body, body.as_bytes());
    // ce-* travel as they are (forwarded by default), and select nothing.
    assert_eq!(last.header("ce-cluster"), Some("s"));

    // Hosts: only an exact channel host (any case, any port) picks a channel; tricks get 404.
    for host in ["ORDERS.test:8080", "orders.test."] {
        let (code, text) = raw_request(
            addr,
            &raw_post(host, "/", "", "{}"),
            Duration::from_secs(10),
        );
        assert_eq!(code, 202, "{host}: {text}");
        sent += 1;
    }
    for host in [
        "orders.test@secret.test",
        "secret.test.orders.test",
        "orders.test.secret.test",
        "orders.test%2esecret",
        "unlisted",
        "a.internal",
        "s",
    ] {
        let (code, text) = raw_request(
            addr,
            &raw_post(host, "/", "", "{}"),
            Duration::from_secs(10),
        );
        assert!(code == 404 || code == 400, "{host}: {code} {text}");
    }

    for got in f.a.requests() {
        assert_configured_call(&got, &names);
    }
    assert_eq!(f.a.count(), sent);
    assert_eq!(
        f.s.count(),
        0,
        "a request reached the secret channel: {:#?}",
        f.s.requests()
    );
    assert_eq!(
        f.unlisted.count(),
        0,
        "a request reached an unlisted cluster"
    );
}

#[test]
fn header_injection_with_cr_lf_or_nul_is_refused_by_envoy_or_travels_as_inert_text() {
    let f = fortress(Some(json!(["content-type", "x-request-id", "ce-*"])));
    let addr = f.envoy.addr();
    let attempts: Vec<(&str, Vec<u8>)> = vec![
        (
            "bare CR in a value",
            raw_post(
                "orders.test",
                "/",
                "x-request-id: abc\rx-injected: 1\r\n",
                "{}",
            ),
        ),
        (
            "bare LF in a value",
            raw_post("orders.test", "/", "ce-id: abc\nx-injected: 1\r\n", "{}"),
        ),
        (
            "NUL in a value",
            raw_post("orders.test", "/", "ce-id: abc\0x-injected: 1\r\n", "{}"),
        ),
        (
            "obs-fold",
            raw_post("orders.test", "/", "ce-id: abc\r\n x-injected: 1\r\n", "{}"),
        ),
        (
            "percent-encoded CRLF",
            raw_post(
                "orders.test",
                "/",
                "ce-id: abc%0d%0ax-injected: 1\r\n",
                "{}",
            ),
        ),
        (
            "CRLF in the path",
            raw_post("orders.test", "/a\r\nx-injected: 1", "", "{}"),
        ),
        (
            "CRLF in the host",
            raw_post("orders.test\r\nx-injected: 1", "/", "", "{}"),
        ),
        (
            "space before the colon",
            raw_post("orders.test", "/", "x-injected : 1\r\n", "{}"),
        ),
        (
            "two hosts",
            raw_post("orders.test", "/", "host: secret.test\r\n", "{}"),
        ),
    ];
    let mut outcomes = Vec::new();
    for (what, request) in &attempts {
        let before = f.a.count();
        let (code, text) = raw_request(addr, request, Duration::from_secs(10));
        outcomes.push(format!("{what}: {code}"));
        match code {
            202 => {
                assert_eq!(f.a.count(), before + 1, "{what}");
                let got = f.a.requests().pop().unwrap();
                assert_configured_call(&got, &["x-injected"]);
                for (name, value) in &got.headers {
                    assert!(
                        !value.contains(['\r', '\n', '\0']),
                        "{what}: {name}: {value:?}"
                    );
                }
            }
            400..=499 => assert_eq!(f.a.count(), before, "{what}: refused but fanned out"),
            _ => panic!("{what}: {code} {text}"),
        }
    }
    eprintln!("injection attempts: {}", outcomes.join("; "));
    assert_eq!(f.s.count(), 0);
    assert_eq!(f.unlisted.count(), 0);
}

#[test]
fn credentials_and_envoy_headers_travel_only_when_listed_by_name_and_listing_them_warns() {
    let secrets = [
        ("authorization", "Bearer secret"),
        ("cookie", "session=secret"),
        ("proxy-authorization", "Basic c2VjcmV0"),
        ("x-envoy-peer-metadata", "secret"),
        ("x-envoy-original-path", "/secret"),
    ];
    // A catch-all list forwards other headers, never these.
    let f = fortress(Some(json!(["*"])));
    let mut request = Client::http1()
        .post(&f.envoy.url("/"))
        .header("host", "orders.test");
    for (n, v) in secrets {
        request = request.header(n, v);
    }
    assert_202(&send(
        request
            .header("x-api-key", "k")
            .header("x-custom", "c")
            .body("{}"),
    ));
    let got = f.a.only_request();
    for (n, _) in secrets {
        assert!(got.header(n).is_none(), "{n} forwarded by \"*\": {got:#?}");
    }
    assert_eq!(got.header("x-custom"), Some("c"));
    // Not a credential to fanout: a custom key header travels with "*" (SECURITY.md says so).
    assert_eq!(got.header("x-api-key"), Some("k"));
    assert!(!f.envoy.log().contains("forward_headers lists"));
    drop(f);

    // Listed by exact name: they travel, and configure() warned about each.
    let f = fortress(Some(json!([
        "authorization",
        "x-envoy-peer-metadata",
        "cookie*"
    ])));
    let mut request = Client::http1()
        .post(&f.envoy.url("/"))
        .header("host", "orders.test");
    for (n, v) in secrets {
        request = request.header(n, v);
    }
    assert_202(&send(request.body("{}")));
    let got = f.a.only_request();
    assert_eq!(got.header("authorization"), Some("Bearer secret"));
    assert_eq!(got.header("x-envoy-peer-metadata"), Some("secret"));
    // A prefix never picks a credential up, even one spelt out before its star.
    assert!(got.header("cookie").is_none(), "{got:#?}");
    assert!(got.header("proxy-authorization").is_none());
    assert!(got.header("x-envoy-original-path").is_none());
    for name in ["authorization", "x-envoy-peer-metadata"] {
        let warning = format!("forward_headers lists \"{name}\"");
        assert!(
            f.envoy.wait_for_log(&warning, Duration::from_secs(5)),
            "no warning for {name}:\n{}",
            f.envoy.log()
        );
    }
}

#[test]
fn text_from_subscriber_answers_is_sanitized_in_reports_and_dead_letter_headers() {
    let evil_body =
        "line one\r\nx-injected: yes\r\n\r\n\u{0}\u{1b}[31m\"}]</script>\r\nHTTP/1.1 200 OK\r\n";
    let answer = format!(
        "HTTP/1.1 500 Oops\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{evil_body}",
        evil_body.len()
    );
    let evil = FaultServer::start("evil", Fault::Raw(answer.clone().into_bytes()));
    let evil_dl = FaultServer::start("evil-dl", Fault::Raw(answer.into_bytes()));
    let dlq = Subscriber::ok("dlq");
    let config = json!({ "channels": [
        { "name": "report", "hosts": ["report.test"], "subscribers": [{ "cluster": "evil" }] },
        { "name": "dead", "hosts": ["dead.test"], "subscribers": [
            { "cluster": "evil-dl", "delivery": { "dead_letter": { "cluster": "dlq" } } } ] }
    ] });
    let envoy = Envoy::with_clusters(
        &config,
        &[
            ("evil", evil.port()),
            ("evil-dl", evil_dl.port()),
            ("dlq", dlq.port()),
        ],
    );
    let client = Client::http1();

    let reply = post(&client, &envoy, "report.test", "e");
    let entries = report_naming(&reply, &["evil"]);
    let detail = entries["evil"]["detail"].as_str().unwrap();
    assert!(!detail.chars().any(char::is_control), "{detail:?}");
    assert!(
        detail.starts_with("line one  x-injected: yes"),
        "{detail:?}"
    );
    assert!(reply.header("x-injected").is_none(), "{reply:?}");

    // The dead letter carries the failure in headers: one line each, nothing injected.
    let reply = post(&client, &envoy, "dead.test", "e");
    assert_202(&reply);
    let letter = dlq.only_request();
    let body_header = letter
        .header("x-fanout-failed-body")
        .unwrap_or_else(|| panic!("{letter:#?}"));
    assert!(
        body_header.starts_with("line one  x-injected: yes"),
        "{body_header:?}"
    );
    assert!(letter.header("x-injected").is_none(), "{letter:#?}");
    for (name, value) in &letter.headers {
        assert!(!value.chars().any(char::is_control), "{name}: {value:?}");
    }
    assert_eq!(letter.header("x-fanout-failed-status"), Some("500"));
}
