//! Live reconfiguration the way a mounted ConfigMap delivers it: the real Envoy on
//! the shipped `envoy/configmap/envoy.yaml` gets the filter's config through ECDS and the
//! clusters through CDS, both from files in a watched directory, and each test replaces those
//! files with the kubelet's atomic `..data` symlink flip. The filter's file is the one
//! `fanout-control render` writes, with each test's fan-out config in it.
//!
//! Every wait polls Envoy's stats (or the subscribers) up to a generous deadline; timings are
//! printed, not asserted tightly, so a loaded machine does not fail these tests.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use harness::control::render;
use harness::reload::{
    render_filter, rendered_filter, until_consecutive, Load, ReloadEnvoy, Update, ECDS,
};
use harness::{assert_202, send, Behavior, Client, Reply, Subscriber, TempDir};
use serde_json::{json, Value};

/// Envoy picks up a file change, then applies it on every worker.
const SWAP_TIMEOUT: Duration = Duration::from_secs(20);
/// How long the new config may take to show in every answer after Envoy took it.
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(20);

/// One channel for every host; `x-seq` is forwarded so each call can be matched to its request.
fn config(subscribers: Value) -> String {
    json!({ "forward_headers": ["x-seq"], "subscribers": subscribers }).to_string()
}

fn subs(names: &[&str]) -> Value {
    Value::Array(names.iter().map(|n| json!({ "cluster": n })).collect())
}

/// A request on a fresh connection (so that Envoy may hand it to any worker), tagged `x-seq`.
fn post(envoy: &ReloadEnvoy, seq: &str) -> Reply {
    send(
        Client::http1()
            .post(&envoy.url("/"))
            .header("connection", "close")
            .header("x-seq", seq)
            .body(format!("{{\"seq\":\"{seq}\"}}")),
    )
}

fn got(s: &Subscriber, seq: &str) -> bool {
    s.requests().iter().any(|r| r.header("x-seq") == Some(seq))
}

/// Sends tagged requests until `n` in a row were answered 202 and reached exactly `want` of
/// `all`: the new config is on every worker the requests met.
fn converge(envoy: &ReloadEnvoy, tag: &str, all: &[&Subscriber], want: &[&str], n: usize) -> usize {
    let mut sent = 0;
    let ok = until_consecutive(n, CONVERGE_TIMEOUT, || {
        sent += 1;
        let seq = format!("{tag}-{sent}");
        let reply = post(envoy, &seq);
        reply.status == 202 && all.iter().all(|s| got(s, &seq) == want.contains(&s.name()))
    });
    assert!(
        ok,
        "after {sent} requests the answers still do not show the new config (want {want:?})"
    );
    sent
}

// ---------------------------------------------------------------------------------------
// 1. Adding a subscriber by replacing the file, under load, 10 times: every answer 202.

#[test]
fn adding_subscribers_by_ten_configmap_swaps_under_load_fails_no_request() {
    let base = Subscriber::ok("base");
    let added: Vec<Subscriber> = (1..=10)
        .map(|i| Subscriber::ok(&format!("added{i}")))
        .collect();
    let mut clusters = vec![(base.name(), base.port())];
    clusters.extend(added.iter().map(|s| (s.name(), s.port())));
    let mut envoy = ReloadEnvoy::start(&config(subs(&["base"])), &clusters);

    // A few hundred requests/s, bounded in count and time.
    let load = Load::start(&envoy.url("/"), 16, 300.0, 30_000, Duration::from_secs(40));
    // Load is flowing before the first swap.
    assert!(
        base.wait_for(50, Duration::from_secs(20)) >= 50,
        "the load did not get going"
    );
    let before_swaps = load.sent();

    let mut latencies = Vec::new();
    for (i, sub) in added.iter().enumerate() {
        // Swap i: `base` and the i-th added subscriber (the previous one leaves).
        let start = Instant::now();
        envoy.publish_filter(&config(subs(&["base", sub.name()])));
        assert!(
            sub.wait_for(1, SWAP_TIMEOUT) >= 1,
            "swap {}: {} got nothing within {SWAP_TIMEOUT:?}",
            i + 1,
            sub.name()
        );
        latencies.push(start.elapsed());
        // The swap is done on Envoy's side too before the next one, and load keeps flowing
        // between swaps: at least 30 more events reach `base` first.
        envoy.expect_stat(
            &format!("{ECDS}.update_success"),
            |v| v >= 2 + i as u64,
            SWAP_TIMEOUT,
        );
        let seen = base.count();
        assert!(
            base.wait_for(seen + 30, SWAP_TIMEOUT) >= seen + 30,
            "the load stalled after swap {}",
            i + 1
        );
    }
    let during_swaps = load.sent() - before_swaps;
    let report = load.finish();

    let max = latencies.iter().max().copied().unwrap_or_default();
    eprintln!(
        "10 swaps under load: swap-to-first-event {:?} (max {max:?}); {} requests during the \
         swaps, {} in all at {:.0} req/s: {:?}",
        latencies,
        during_swaps,
        report.total,
        report.rate(),
        report.by_status
    );
    assert!(
        report.failures.is_empty() && report.by_status.keys().all(|s| *s == 202),
        "requests failed during the swaps: {:?}, e.g. {:#?}",
        report.by_status,
        report.failures
    );
    assert!(
        during_swaps >= 300,
        "too little load during the swaps to mean anything: {during_swaps}"
    );
    assert!(envoy.stat(&format!("{ECDS}.update_success")).unwrap_or(0) >= 11);
    assert_eq!(
        envoy.stat(&format!("{ECDS}.update_rejected")).unwrap_or(0),
        0
    );
    // Every answered request reached `base`: it was in every config.
    assert!(
        base.count() >= report.total,
        "{} < {}",
        base.count(),
        report.total
    );
    // "Within a couple of seconds" on an idle machine; generous here for a loaded one.
    assert!(
        max < Duration::from_secs(10),
        "a swap took {max:?} to reach its subscriber"
    );
}

// ---------------------------------------------------------------------------------------
// 2. Removing a subscriber: it stops receiving events.

#[test]
fn a_subscriber_removed_from_the_configmap_stops_receiving_events() {
    let keep = Subscriber::ok("keep");
    let gone = Subscriber::ok("gone");
    let mut envoy = ReloadEnvoy::start(
        &config(subs(&["keep", "gone"])),
        &[("keep", keep.port()), ("gone", gone.port())],
    );
    for i in 0..3 {
        let seq = format!("before-{i}");
        assert_202(&post(&envoy, &seq));
        assert!(got(&keep, &seq) && got(&gone, &seq));
    }

    assert_eq!(
        envoy.swap_filter(&config(subs(&["keep"])), SWAP_TIMEOUT),
        Update::Accepted
    );
    converge(&envoy, "converge", &[&keep, &gone], &["keep"], 10);

    let gone_before = gone.count();
    for i in 0..30 {
        let seq = format!("after-{i}");
        assert_202(&post(&envoy, &seq));
        assert!(got(&keep, &seq), "keep missed {seq}");
    }
    assert_eq!(
        gone.count(),
        gone_before,
        "the removed subscriber still gets events: {:#?}",
        &gone.requests()[gone_before..]
    );
}

// ---------------------------------------------------------------------------------------
// 3. A fan-out that started before the swap finishes with the subscribers it started with.

#[test]
fn requests_started_before_a_swap_finish_with_their_original_subscribers() {
    // `slow` holds its answer long enough for the swap to happen while the call is open.
    let slow = Subscriber::start("slow", Behavior::Delay(Duration::from_secs(6), 200));
    let old = Subscriber::ok("old");
    let new = Subscriber::ok("new");
    let mut envoy = ReloadEnvoy::start(
        &config(subs(&["slow", "old"])),
        &[
            ("slow", slow.port()),
            ("old", old.port()),
            ("new", new.port()),
        ],
    );

    // (a) The fan-out is under way (slow has the call) when the file is swapped.
    let url = envoy.url("/");
    let long = std::thread::spawn(move || {
        send(
            Client::http1()
                .post(&url)
                .header("x-seq", "long")
                .body("{\"long\":true}"),
        )
    });
    assert!(
        slow.wait_for(1, SWAP_TIMEOUT) >= 1,
        "slow never got the call"
    );

    // (b) A request whose headers came before the swap and whose body comes after it.
    let mut half = std::net::TcpStream::connect(envoy.envoy.addr()).unwrap();
    half.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let body = b"{\"half\":\"body\"}";
    use std::io::{Read, Write};
    write!(
        half,
        "POST / HTTP/1.1\r\nhost: x\r\nx-seq: half\r\nconnection: close\r\n\
         content-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    half.write_all(&body[..5]).unwrap();
    half.flush().unwrap();
    // Envoy has the stream (its headers) before the swap.
    envoy.expect_stat(
        "http.ingress.downstream_rq_active",
        |v| v >= 2,
        SWAP_TIMEOUT,
    );

    assert_eq!(
        envoy.swap_filter(&config(subs(&["new"])), SWAP_TIMEOUT),
        Update::Accepted
    );
    converge(&envoy, "converge", &[&old, &new], &["new"], 10);
    assert!(
        !long.is_finished(),
        "the long request ended before the new config took over: the test proves nothing"
    );

    half.write_all(&body[5..]).unwrap();
    let mut answer = Vec::new();
    half.read_to_end(&mut answer)
        .expect("the answer to the half-sent request, then the connection closed");
    let answer = String::from_utf8_lossy(&answer);
    let long_reply = long.join().unwrap();

    assert_202(&long_reply);
    assert!(
        got(&slow, "long") && got(&old, "long"),
        "long lost a subscriber"
    );
    assert!(
        !got(&new, "long"),
        "long reached a subscriber added after it started"
    );

    assert!(
        answer.starts_with("HTTP/1.1 202"),
        "the half-sent request: {answer}"
    );
    assert!(
        got(&slow, "half") && got(&old, "half"),
        "half lost a subscriber"
    );
    assert!(
        !got(&new, "half"),
        "half reached a subscriber added after it started"
    );
    let call = old
        .requests()
        .into_iter()
        .find(|r| r.header("x-seq") == Some("half"))
        .unwrap();
    assert_eq!(call.body, body, "the body that came after the swap");
}

/// A stream counts into the telemetry it started with; every root context of a VM shares one
/// tally (and the newest root's timer flushes it), so what streams spanning a swap counted is
/// not lost: `requests.accepted` includes them and the `in_flight` gauge comes back to 0.
#[test]
fn metrics_of_requests_that_span_a_swap_are_not_lost() {
    let slow = Subscriber::start("slow", Behavior::Delay(Duration::from_secs(3), 200));
    let other = Subscriber::ok("other");
    let mut envoy = ReloadEnvoy::start(
        &config(subs(&["slow"])),
        &[("slow", slow.port()), ("other", other.port())],
    );
    let url = envoy.url("/");
    let long = std::thread::spawn(move || {
        send(Client::http1().post(&url).header("x-seq", "long").body("x"))
    });
    assert!(
        slow.wait_for(1, SWAP_TIMEOUT) >= 1,
        "slow never got the call"
    );
    assert_eq!(
        envoy.swap_filter(&config(subs(&["other"])), SWAP_TIMEOUT),
        Update::Accepted
    );
    let probes = converge(&envoy, "converge", &[&slow, &other], &["other"], 5);
    assert_202(&long.join().unwrap());
    let answered_202 = envoy.stat("http.ingress.downstream_rq_2xx").unwrap_or(0);
    assert_eq!(answered_202 as usize, probes + 1);
    // Counts reach Envoy on the next tick (1 s): wait for them, bounded.
    let counted = |stats: &BTreeMap<String, u64>| {
        (
            stats.get("wasmcustom.fanout.requests.accepted").copied(),
            stats.get("wasmcustom.fanout.in_flight").copied(),
        )
    };
    let stats = envoy.wait_for_stats(
        "wasmcustom.fanout.",
        |stats| counted(stats) == (Some(answered_202), Some(0)),
        Duration::from_secs(15),
    );
    let (accepted, in_flight) = counted(&stats);
    assert!(
        accepted == Some(answered_202) && in_flight == Some(0),
        "after the swap: requests.accepted {accepted:?} (Envoy answered {answered_202} \
         2xx), in_flight {in_flight:?} (nothing is in flight)"
    );
}

// ---------------------------------------------------------------------------------------
// 4. An invalid config is rejected; the old one keeps serving, unchanged.

#[test]
fn an_invalid_configmap_update_is_rejected_and_the_old_config_keeps_serving() {
    let a = Subscriber::ok("a");
    let first = json!({ "forward_headers": ["x-seq"],
                        "subscribers": [{ "cluster": "a", "path": "/v1" }] })
    .to_string();
    let mut envoy = ReloadEnvoy::start(&first, &[("a", a.port())]);
    let version = envoy.text_stat(&format!("{ECDS}.version_text"));
    let serves_v1 = |envoy: &ReloadEnvoy, seq: &str| {
        assert_202(&post(envoy, seq));
        let call = a
            .requests()
            .into_iter()
            .find(|r| r.header("x-seq") == Some(seq))
            .unwrap_or_else(|| panic!("a did not get {seq}"));
        assert_eq!(call.path, "/v1", "the config changed");
    };
    serves_v1(&envoy, "first");

    let invalid = [
        (
            r#"{"forward_headers": ["x-seq"], "subscribers": [{"cluster": "a", "bogus": 1}]}"#,
            "subscribers[0].bogus: unknown field `bogus`",
        ),
        (
            r#"{"forward_headers": ["x-seq"], "subscribers": [{"cluster": "a"}, {"cluster": ""}]}"#,
            "subscribers[1].cluster: must not be empty",
        ),
    ];
    for (n, (bad, field)) in invalid.iter().enumerate() {
        let fails = envoy.stat(&format!("{ECDS}.config_fail")).unwrap_or(0);
        assert_eq!(
            envoy.swap_filter(bad, SWAP_TIMEOUT),
            Update::Rejected,
            "{bad}"
        );
        envoy.expect_stat(&format!("{ECDS}.config_fail"), |v| v > fails, SWAP_TIMEOUT);
        assert!(
            envoy.envoy.wait_for_log(field, SWAP_TIMEOUT),
            "the log does not name the field ({field}):\n{}",
            envoy.log()
        );
        assert_eq!(envoy.text_stat(&format!("{ECDS}.version_text")), version);
        for i in 0..10 {
            serves_v1(&envoy, &format!("after-invalid-{n}-{i}"));
        }
    }
    eprintln!(
        "rejections: {ECDS}.config_fail={:?} update_rejected={:?}",
        envoy.stat(&format!("{ECDS}.config_fail")),
        envoy.stat(&format!("{ECDS}.update_rejected"))
    );

    // A valid config after the rejected ones is taken.
    let second = json!({ "forward_headers": ["x-seq"],
                         "subscribers": [{ "cluster": "a", "path": "/v2" }] })
    .to_string();
    assert_eq!(envoy.swap_filter(&second, SWAP_TIMEOUT), Update::Accepted);
    let mut n = 0;
    assert!(
        until_consecutive(10, CONVERGE_TIMEOUT, || {
            n += 1;
            let seq = format!("v2-{n}");
            post(&envoy, &seq).status == 202
                && a.requests()
                    .iter()
                    .any(|r| r.header("x-seq") == Some(seq.as_str()) && r.path == "/v2")
        }),
        "the valid config after the rejected ones was not applied"
    );
}

// ---------------------------------------------------------------------------------------
// 5. A config naming a cluster Envoy does not have yet: 500 naming it, until it appears.

#[test]
fn a_subscriber_whose_cluster_is_missing_gets_500_naming_it_until_the_cluster_arrives() {
    let a = Subscriber::ok("a");
    let late = Subscriber::ok("late");
    let mut envoy = ReloadEnvoy::start(&config(subs(&["a"])), &[("a", a.port())]);
    assert_eq!(
        envoy.swap_filter(&config(subs(&["a", "late"])), SWAP_TIMEOUT),
        Update::Accepted
    );
    // Until every worker has the new config, answers are 202 (from `a` alone).
    let mut report = Value::Null;
    let mut n = 0;
    assert!(
        until_consecutive(5, CONVERGE_TIMEOUT, || {
            n += 1;
            let reply = post(&envoy, &format!("missing-{n}"));
            reply.assert_not_tripwire();
            if reply.status != 500 {
                return false;
            }
            report = reply.json();
            true
        }),
        "no 500 for a subscriber whose cluster Envoy does not have"
    );
    let failed = report["failed"].as_array().expect("a failure report");
    assert_eq!(failed.len(), 1, "{report:#}");
    assert_eq!(failed[0]["cluster"], "late", "{report:#}");
    assert_eq!(failed[0]["outcome"], "dispatch_error", "{report:#}");
    assert_eq!(report["delivered"], 1, "{report:#}");
    assert!(got(&a, &format!("missing-{n}")), "a still gets the event");

    // The cluster arrives (CDS from the same volume): the same config now works.
    envoy.swap_clusters(&[("a", a.port()), ("late", late.port())], SWAP_TIMEOUT);
    converge(&envoy, "arrived", &[&a, &late], &["a", "late"], 10);
}

// ---------------------------------------------------------------------------------------
// 6. 50 quick swaps: no growth in wasm VMs or in Envoy's memory. On the native build, which
// has no VM, the memory: what a configuration holds (its plugin, metrics, tables) must go
// with it.

#[test]
fn fifty_quick_swaps_leave_no_more_wasm_vms_and_no_memory_growth() {
    let wasm = harness::fanout_build() == harness::Build::Wasm;
    let vm_count = |envoy: &ReloadEnvoy| {
        wasm.then(|| envoy.stat("wasm.envoy.wasm.runtime.v8.active").unwrap_or(0))
    };
    let a = Subscriber::ok("a");
    let mut envoy = ReloadEnvoy::start(&config(subs(&["a"])), &[("a", a.port())]);
    let cfg = |i: usize, metrics: bool| {
        json!({ "timeout_ms": 1000 + i, "forward_headers": ["x-seq"], "metrics": metrics,
                "subscribers": [{ "cluster": "a", "path": format!("/swap/{i}") }] })
        .to_string()
    };

    // Warm up: the first swaps fill caches that are allocated once.
    for i in 0..5 {
        assert_eq!(
            envoy.swap_filter(&cfg(i, true), SWAP_TIMEOUT),
            Update::Accepted
        );
        assert_202(&post(&envoy, &format!("warm-{i}")));
    }
    let vms_before = vm_count(&envoy);
    assert_ne!(vms_before, Some(0), "no wasm VM counted");

    // What a leak per swap would look like: a VM (MBs), the module (330 KB), a plugin instance
    // with its config and contexts (tens of KB): 1.5 MB and more over 50 swaps. Measured on
    // Envoy 1.40, in Envoy's heap: about 1 KB per swap with the filter's metrics off (the
    // wasm host's own bookkeeping per plugin reload; the same swaps of a non-wasm ECDS filter
    // grow nothing). The filter defines its metrics once per VM (every root context of a VM
    // shares them), so metrics on adds nothing per swap. Bound: 256 KiB either way.
    // The native build holds far less per configuration: a configuration leaked on purpose
    // (its handle never dropped) grew the heap by 210 KB over 50 swaps with metrics on, where
    // the build as it is moves it by a few KB either way. Bound: 128 KiB.
    let bound = if wasm { 256 * 1024 } else { 128 * 1024 };
    let mut first = 5;
    for metrics in [true, false] {
        let mem_before = envoy.heap_allocated();
        // Envoy's resident set: printed, not asserted (V8 and the allocator make it noisy).
        let rss_before = envoy.rss_kib();
        let start = Instant::now();
        for i in first..first + 50 {
            assert_eq!(
                envoy.swap_filter(&cfg(i, metrics), SWAP_TIMEOUT),
                Update::Accepted
            );
        }
        let took = start.elapsed();
        let last = first + 49;
        first += 50;
        converge(&envoy, &format!("after-{metrics}"), &[&a], &["a"], 5);
        assert_eq!(
            a.requests().last().map(|r| r.path.clone()),
            Some(format!("/swap/{last}"))
        );
        // Envoy retires old plugin instances when the last stream using them ends: wait for
        // the VM count to be back (it should already be), then compare.
        let vms_after = vms_before.map(|before| {
            envoy.expect_stat(
                "wasm.envoy.wasm.runtime.v8.active",
                |v| v <= before,
                SWAP_TIMEOUT,
            )
        });
        // What the retired instances held is freed by Envoy's deferred deletion, later on a
        // loaded machine: a leak stays over the bound, a late free comes back under it.
        let settled_by = std::time::Instant::now() + SWAP_TIMEOUT;
        let mut mem_after = envoy.heap_allocated();
        while mem_after as i64 - mem_before as i64 >= bound
            && std::time::Instant::now() < settled_by
        {
            std::thread::sleep(Duration::from_millis(200));
            mem_after = envoy.heap_allocated();
        }
        let rss_after = envoy.rss_kib();
        let growth = mem_after as i64 - mem_before as i64;
        let created = wasm.then(|| {
            envoy
                .stat("wasm.envoy.wasm.runtime.v8.created")
                .unwrap_or(0)
        });
        eprintln!(
            "50 swaps (metrics {metrics}) in {took:?}: v8 VMs {vms_before:?} -> {vms_after:?} \
             (created in all: {created:?}), heap allocated (admin /memory) {mem_before} -> \
             {mem_after} ({growth:+} bytes, {:+.0} per swap), VmRSS {rss_before} -> \
             {rss_after} kB",
            growth as f64 / 50.0
        );
        assert_eq!(vms_after, vms_before, "wasm VMs after 50 swaps");
        assert!(
            growth < bound,
            "Envoy's memory grew by {growth} bytes over 50 swaps (metrics {metrics}; bound \
             {bound})"
        );
    }
    assert!(envoy.stat(&format!("{ECDS}.update_success")).unwrap_or(0) >= 106);
    assert_eq!(
        envoy.stat(&format!("{ECDS}.update_rejected")).unwrap_or(0),
        0
    );
}

// ---------------------------------------------------------------------------------------
// The shipped pieces.

#[test]
fn render_writes_the_ecds_file_the_tests_use() {
    let (mut by_render, config) = rendered_filter();
    let mut by_harness: Value = serde_json::from_str(&render_filter(&config)).unwrap();
    by_render["version_info"] = json!("");
    by_harness["version_info"] = json!("");
    assert_eq!(by_render, by_harness);
    if harness::fanout_build() == harness::Build::Native {
        // `render --build native`: the native build's filter, the library by its name.
        let native = &by_render["resources"][0]["typed_config"];
        assert_eq!(native["@type"], harness::NATIVE_TYPE);
        assert_eq!(
            native["dynamic_module_config"],
            json!({ "name": "fanout", "do_not_close": true })
        );
        assert_eq!(native["filter_name"], "fanout");
        assert_eq!(
            native["filter_config"]["value"],
            json!(config),
            "passed on as written"
        );
    } else {
        let wasm = &by_render["resources"][0]["typed_config"]["config"];
        assert_eq!(wasm["allow_on_headers_stop_iteration"], json!(true));
        assert_eq!(
            wasm["configuration"]["value"],
            json!(config),
            "passed on as written"
        );
    }
    assert_eq!(by_render["resources"][0]["name"], "fanout");

    // No source, or a malformed option: refused before Envoy ever sees a file.
    let dir = TempDir::new("fanout-render-refused", "render's output");
    let missing = dir.path().join("missing");
    let (code, _, err) = render(&missing, &dir.path().join("out"), &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("cannot read"), "{err}");
    let (code, _, err) = render(
        dir.path(),
        &dir.path().join("out"),
        &["--resolve", "broken"],
    );
    assert_eq!(code, 2, "{err}");
}

#[test]
fn until_the_first_valid_config_arrives_requests_get_500_not_202() {
    let a = Subscriber::ok("a");
    let mut envoy = ReloadEnvoy::start_unconfigured(
        r#"{"subscribers": [{"cluster": "a", "bogus": true}]}"#,
        &[("a", a.port())],
    );
    let reply = send(Client::http1().post(&envoy.url("/")).body("x"));
    assert_eq!(reply.status, 500, "{:?}", reply.text());
    assert_eq!(a.count(), 0);
    assert_eq!(
        envoy.swap_filter(&config(subs(&["a"])), SWAP_TIMEOUT),
        Update::Accepted
    );
    converge(&envoy, "configured", &[&a], &["a"], 5);
}
