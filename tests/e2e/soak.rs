//! Soak: requests at a steady rate through the real Envoy to a channel of N = 4
//! subscribers. Every answer must be 202, every subscriber must count exactly every event,
//! fanout's own counters must agree, and Envoy's RSS after warm-up must grow by less than 5 %.
//!
//! `soak_short` runs in `make test` (a few thousand requests: `FANOUT_SOAK_SHORT_REQUESTS`,
//! default 3000, at `FANOUT_SOAK_SHORT_RATE`, default 200/s). `soak_full` is `make soak`
//! (`SOAK_REQUESTS`, default 100,000, at `SOAK_RATE`, default 300/s, what a loaded 2-core
//! machine sustains); it is `#[ignore]`d so that `cargo test` leaves it out.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness::faults::{Fault, FaultServer};
use harness::{Client, Envoy};
use serde_json::json;

const SUBSCRIBERS: usize = 4;
/// Client threads, each with its own keep-alive connection pool.
const CLIENTS: usize = 16;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .filter(|v| !v.is_empty())
        .map(|v| {
            v.replace('_', "")
                .parse()
                .unwrap_or_else(|e| panic!("{name}={v}: {e}"))
        })
        .unwrap_or(default)
}

#[test]
fn soak_short() {
    soak(
        env_or("FANOUT_SOAK_SHORT_REQUESTS", 3000),
        env_or("FANOUT_SOAK_SHORT_RATE", 200),
    );
}

#[test]
#[ignore = "the full soak: `make soak` (SOAK_REQUESTS, SOAK_RATE)"]
fn soak_full() {
    soak(
        env_or("FANOUT_SOAK_REQUESTS", 100_000),
        env_or("FANOUT_SOAK_RATE", 300),
    );
}

fn soak(total: usize, rate: usize) {
    assert!(
        total >= 100 && rate >= 1,
        "FANOUT_SOAK_*: at least 100 requests at 1/s"
    );
    // Counting servers (they keep no record of each request, so the soak's own memory stays
    // flat); a FaultServer with `Fault::Ok` answers 200 on keep-alive connections.
    let subs: Vec<FaultServer> = (0..SUBSCRIBERS)
        .map(|i| FaultServer::start(&format!("sub{i}"), Fault::Ok))
        .collect();
    let config = json!({ "subscribers": subs.iter().map(|s| json!({ "cluster": s.name() })).collect::<Vec<_>>() });
    let mut envoy = Envoy::builder()
        .fanout(&config)
        .clusters(subs.iter().map(|s| (s.name(), s.port())))
        .log_level("warning")
        .start();
    let pid = envoy.pid();
    let url = envoy.url("/");

    // Warm-up: the first tenth (at least 500 requests, at most 10,000), after which every
    // connection pool and Envoy's allocator should have settled.
    let warm_up = (total / 10).clamp(500.min(total / 2), 10_000);
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let failures: Arc<Mutex<Vec<String>>> = Arc::default();
    let started = Instant::now();
    let interval = Duration::from_secs(1) / rate as u32;
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (next, done, failures, url) = (
                Arc::clone(&next),
                Arc::clone(&done),
                Arc::clone(&failures),
                url.clone(),
            );
            std::thread::spawn(move || {
                let client = Client::http1();
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= total {
                        break;
                    }
                    // Request i goes out at start + i/rate: a steady rate, whatever the
                    // latency (as long as the clients keep up).
                    let due = started + interval * i as u32;
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    let result = client.post(&url).body(format!("soak-{i}")).send();
                    let outcome = match result {
                        Ok(r) if r.status().as_u16() == 202 => None,
                        Ok(r) => Some(format!("#{i}: {} {:?}", r.status(), r.text().ok())),
                        Err(e) => Some(format!("#{i}: {e}")),
                    };
                    if let Some(o) = outcome {
                        failures.lock().unwrap().push(o);
                    }
                    done.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();

    // Envoy's RSS: once the warm-up is done, then every second, and at the end.
    let mut rss_warm = None;
    let mut rss_max = 0;
    let mut samples = 0;
    let deadline = started + Duration::from_secs((total / rate) as u64 * 3 + 120);
    while done.load(Ordering::SeqCst) < total {
        assert!(Instant::now() < deadline, "the soak did not finish in time");
        assert!(envoy.try_wait_alive(), "Envoy exited:\n{}", envoy.log());
        let rss = envoy.rss_kib();
        rss_max = rss_max.max(rss);
        samples += 1;
        if rss_warm.is_none() && done.load(Ordering::SeqCst) >= warm_up {
            rss_warm = Some(rss);
        }
        std::thread::sleep(Duration::from_millis(if rss_warm.is_none() {
            50
        } else {
            1000
        }));
    }
    for c in clients {
        c.join().unwrap();
    }
    let elapsed = started.elapsed();
    let rss_end = envoy.rss_kib();
    let rss_warm = rss_warm.unwrap_or(rss_end);
    rss_max = rss_max.max(rss_end);

    let failures = failures.lock().unwrap();
    let growth = (rss_end as f64 - rss_warm as f64) / rss_warm as f64 * 100.0;
    eprintln!(
        "soak: {total} requests, {SUBSCRIBERS} subscribers, target {rate}/s, achieved {:.0}/s \
         in {elapsed:.1?}; non-202: {}; Envoy RSS {} KiB after warm-up ({warm_up} requests), {} \
         KiB at the end, {} KiB at most ({samples} samples): growth {growth:+.2} %",
        total as f64 / elapsed.as_secs_f64(),
        failures.len(),
        rss_warm,
        rss_end,
        rss_max
    );
    assert!(
        failures.is_empty(),
        "{} of {total} answers were not 202, the first: {:#?}",
        failures.len(),
        failures.iter().take(10).collect::<Vec<_>>()
    );
    for s in &subs {
        assert_eq!(
            s.count(),
            total,
            "subscriber {} counted {} events",
            s.name(),
            s.count()
        );
    }
    // fanout's own counters (flushed to Envoy once a second) agree.
    let accepted = envoy.wait_for_stat(
        "wasmcustom.fanout.requests.accepted",
        |n| n >= total as u64,
        Duration::from_secs(10),
    );
    assert_eq!(
        accepted.unwrap_or(0),
        total as u64,
        "fanout.requests.accepted"
    );
    assert!(
        growth < 5.0,
        "Envoy's RSS grew by {growth:.2} % after warm-up ({rss_warm} -> {rss_end} KiB)"
    );
    assert!(envoy.try_wait_alive());
    assert_eq!(envoy.pid(), pid);
    let log = envoy.log();
    assert!(!log.contains("panicked"), "the filter panicked:\n{log}");
}
