//! Rolling restarts and crashes (issue 23 §2), with real processes on loopback: two fanout
//! replicas in async mode behind a round-robin front (`envoy/front-affinity.yaml` without
//! its hash), slow subscribers, a subscriber that always fails (retried, then
//! dead-lettered), and hundreds of events while the replicas are replaced one by one.
//!
//! - `envoy/drain.sh` then SIGTERM: every `202` is delivered (or dead-lettered) exactly once
//!   at every subscriber, and the replicas' counters add up to exactly the `202`s.
//! - SIGKILL: what is lost is what the killed replica owed (`fanout.in_flight` just before
//!   the kill bounds it), nothing answered after the kill is lost, nothing is duplicated.
//!
//! And the Kubernetes manifests (`deploy/kubernetes/`, `deploy/istio/`) parse, and its grace period covers
//! the longest delivery of its own configuration.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::front::{start_replica, Balance, Front};
use crate::harness::reload::{ReloadEnvoy, Update};
use crate::harness::{free_ports, manifest_dir, Behavior, Client, Envoy, Subscriber};

/// Envoy's drain period for the replicas: new connections are still accepted this long
/// after `drain_listeners?graceful`, then refused.
const DRAIN_TIME_S: &str = "2";
/// At most this many events per run, and this long of sending.
const MAX_EVENTS: usize = 2000;
const MAX_SENDING: Duration = Duration::from_secs(90);

fn config() -> Value {
    json!({
        "mode": "async",
        "max_in_flight": 10000,
        "subscribers": [
            { "cluster": "quick" },
            { "cluster": "slow" },
            { "cluster": "broken", "delivery": {
                "retry": 1, "backoff_policy": "linear", "backoff_delay_ms": 200,
                "dead_letter": { "cluster": "dlq" } } }
        ]
    })
}

struct Subscribers {
    quick: Subscriber,
    slow: Subscriber,
    broken: Subscriber,
    dlq: Subscriber,
}

impl Subscribers {
    fn start() -> Subscribers {
        Subscribers {
            quick: Subscriber::start("quick", Behavior::Delay(Duration::from_millis(100), 200)),
            slow: Subscriber::start("slow", Behavior::Delay(Duration::from_millis(600), 200)),
            broken: Subscriber::start("broken", Behavior::Status(500)),
            dlq: Subscriber::start("dlq", Behavior::Delay(Duration::from_millis(50), 200)),
        }
    }

    fn replica(&self, port: u16) -> Envoy {
        start_replica(
            Envoy::builder()
                .fanout(&config())
                .subscribers(&[&self.quick, &self.slow, &self.broken, &self.dlq])
                .arg("--drain-time-s")
                .arg(DRAIN_TIME_S)
                .arg("--drain-strategy")
                .arg("immediate"),
            port,
        )
    }

    /// Requests per event id, at each subscriber that must take every event once.
    fn received(&self) -> BTreeMap<&'static str, BTreeMap<String, usize>> {
        let mut out = BTreeMap::new();
        for (name, sub) in [
            ("quick", &self.quick),
            ("slow", &self.slow),
            ("dlq", &self.dlq),
        ] {
            let mut ids: BTreeMap<String, usize> = BTreeMap::new();
            for r in sub.requests() {
                let id = r.header("ce-id").unwrap_or("(none)").to_owned();
                *ids.entry(id).or_default() += 1;
            }
            out.insert(name, ids);
        }
        out
    }
}

/// One event the sender sent: its id, the status it got (0: transport error) and when.
#[derive(Clone, Debug)]
struct Sent {
    id: String,
    status: u16,
    at: Instant,
}

/// Senders posting binary events with unique ids to the front, about `rate` a second.
struct Sender {
    stop: Arc<AtomicBool>,
    sent: Arc<Mutex<Vec<Sent>>>,
    threads: Vec<JoinHandle<()>>,
}

impl Sender {
    fn start(url: String, threads: usize, rate: f64) -> Sender {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(Mutex::new(Vec::new()));
        let started = Instant::now();
        let interval = Duration::from_secs_f64(threads as f64 / rate);
        let threads = (0..threads)
            .map(|t| {
                let (stop, sent, url) = (stop.clone(), sent.clone(), url.clone());
                std::thread::spawn(move || {
                    let client = Client::http1();
                    let mut next = Instant::now();
                    for i in 0.. {
                        if stop.load(Ordering::SeqCst)
                            || started.elapsed() > MAX_SENDING
                            || sent.lock().unwrap().len() >= MAX_EVENTS
                        {
                            break;
                        }
                        let id = format!("ev-{t}-{i}");
                        let status = client
                            .post(&url)
                            .header("ce-specversion", "1.0")
                            .header("ce-type", "com.example.order")
                            .header("ce-source", "/rollout")
                            .header("ce-id", &id)
                            .header("content-type", "application/json")
                            .body(format!("{{\"id\":\"{id}\"}}"))
                            .send()
                            .map(|r| r.status().as_u16())
                            .unwrap_or(0);
                        sent.lock().unwrap().push(Sent {
                            id,
                            status,
                            at: Instant::now(),
                        });
                        next += interval;
                        let now = Instant::now();
                        if next > now {
                            std::thread::sleep(next - now);
                        } else {
                            next = now;
                        }
                    }
                })
            })
            .collect();
        Sender {
            stop,
            sent,
            threads,
        }
    }

    fn accepted(&self) -> usize {
        self.sent
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.status == 202)
            .count()
    }

    fn finish(mut self) -> Vec<Sent> {
        self.stop.store(true, Ordering::SeqCst);
        for t in std::mem::take(&mut self.threads) {
            t.join().unwrap();
        }
        self.sent.lock().unwrap().clone()
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in std::mem::take(&mut self.threads) {
            let _ = t.join();
        }
    }
}

/// The counters of one replica that must add up over the whole rollout.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Counted {
    accepted: u64,
    quick: u64,
    slow: u64,
    dead_lettered: u64,
}

impl std::ops::Add for Counted {
    type Output = Counted;
    fn add(self, o: Counted) -> Counted {
        Counted {
            accepted: self.accepted + o.accepted,
            quick: self.quick + o.quick,
            slow: self.slow + o.slow,
            dead_lettered: self.dead_lettered + o.dead_lettered,
        }
    }
}

fn counted(replica: &Envoy) -> Counted {
    let stat = |name: &str| {
        replica
            .stat(&format!("wasmcustom.fanout.{name}"))
            .unwrap_or(0)
    };
    Counted {
        accepted: stat("requests.accepted"),
        quick: stat("subscriber.quick.delivered"),
        slow: stat("subscriber.slow.delivered"),
        dead_lettered: stat("subscriber.broken.dead_lettered"),
    }
}

fn in_flight(replica: &Envoy) -> u64 {
    replica.stat("wasmcustom.fanout.in_flight").unwrap_or(0)
}

/// Runs the shipped `envoy/drain.sh` against a replica's admin: (exit code, stderr, time).
fn drain(replica: &Envoy, deadline_s: u32) -> (i32, String, Duration) {
    drain_with(replica, deadline_s, &[])
}

/// The same with more environment (e.g. `FANOUT_DRAIN_CLIENT`).
fn drain_with(replica: &Envoy, deadline_s: u32, env: &[(&str, &str)]) -> (i32, String, Duration) {
    let script: PathBuf = manifest_dir().join("envoy/drain.sh");
    let started = Instant::now();
    let out = Command::new("sh")
        .envs(env.iter().copied())
        .arg(&script)
        .arg(format!("http://{}", replica.admin_addr()))
        .arg(deadline_s.to_string())
        .output()
        .expect("run envoy/drain.sh");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        started.elapsed(),
    )
}

/// drain.sh with each way to the admin it may find here (curl, wget, bash's /dev/tcp: the
/// envoyproxy/envoy images have only the last; Istio's pilot-agent is not on this machine),
/// under a stat prefix with dots (Istio's inbound one): a request whose body is still
/// arriving holds it (fanout owes nothing yet; only downstream_rq_active shows it), and it
/// says it is done once that request is answered.
#[test]
fn drain_sh_waits_for_a_request_in_progress_under_istio_s_stat_prefix_with_each_client() {
    use std::io::Write;
    const HOLD: Duration = Duration::from_secs(5);
    for client in ["curl", "wget", "bash"] {
        let sub = Subscriber::ok("sub");
        let envoy = Envoy::builder()
            .fanout(&json!({ "subscribers": [{ "cluster": "sub" }] }))
            .cluster("sub", sub.port())
            .stat_prefix("inbound_0.0.0.0_8080")
            .arg("--drain-time-s")
            .arg(DRAIN_TIME_S)
            .arg("--drain-strategy")
            .arg("immediate")
            .start();
        // A sender whose body is slow: headers and half the body now, the rest after HOLD.
        let mut upload = std::net::TcpStream::connect(envoy.addr()).unwrap();
        upload
            .write_all(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{")
            .unwrap();
        let finisher = std::thread::spawn(move || {
            std::thread::sleep(HOLD);
            upload.write_all(b"}").unwrap();
            let mut answer = [0u8; 12];
            std::io::Read::read_exact(&mut upload, &mut answer).unwrap();
            String::from_utf8_lossy(&answer).into_owned()
        });
        let (code, stderr, took) = drain_with(&envoy, 60, &[("FANOUT_DRAIN_CLIENT", client)]);
        assert_eq!(code, 0, "{client}: drain.sh failed:\n{stderr}");
        assert!(
            stderr.contains("fanout owes nothing"),
            "{client}:\n{stderr}"
        );
        assert!(
            took >= HOLD,
            "{client}: done after {took:?}, before the request ended:\n{stderr}"
        );
        assert_eq!(finisher.join().unwrap(), "HTTP/1.1 202", "{client}");
    }
}

/// In a sidecar whose stats matcher drops downstream_rq_active (Istio's default), drain.sh
/// cannot see requests in progress: it says so and fails, rather than reading 0.
#[test]
fn drain_sh_refuses_to_guess_without_downstream_rq_active() {
    let sub = Subscriber::ok("sub");
    let envoy = Envoy::builder()
        .fanout(&json!({ "subscribers": [{ "cluster": "sub" }] }))
        .cluster("sub", sub.port())
        .bootstrap_field(
            "stats_config",
            json!({ "stats_matcher": { "inclusion_list": { "patterns": [
                { "prefix": "wasmcustom.fanout." }, { "prefix": "http.admin." }
            ] } } }),
        )
        .start();
    let (code, stderr, _) = drain(&envoy, 30);
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("no http.<prefix>.downstream_rq_active"),
        "{stderr}"
    );
}

/// With fanout's metrics off nothing says what it owes: drain.sh says so and fails (after
/// its quiet window: the gauge appears within a second of a start).
#[test]
fn drain_sh_refuses_to_guess_with_fanout_s_metrics_off() {
    let sub = Subscriber::ok("sub");
    let envoy = Envoy::builder()
        .fanout(&json!({ "metrics": false, "subscribers": [{ "cluster": "sub" }] }))
        .cluster("sub", sub.port())
        .start();
    let (code, stderr, _) = drain(&envoy, 30);
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("Envoy has no wasmcustom.fanout.in_flight"),
        "{stderr}"
    );
}

/// Waits (bounded) until every replica owes nothing and has flushed its counters.
fn settle(replicas: &[&Envoy]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while replicas.iter().any(|r| in_flight(r) > 0) {
        assert!(
            Instant::now() < deadline,
            "the replicas still owe work after 30 s"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The gauge and the counters are flushed together, once a second.
    std::thread::sleep(Duration::from_millis(1500));
}

#[test]
fn a_rolling_restart_with_drain_sh_loses_and_duplicates_nothing() {
    let subs = Subscribers::start();
    let ports = free_ports(2);
    let mut replicas: Vec<Envoy> = ports.iter().map(|p| subs.replica(*p)).collect();
    let front = Front::start(Balance::RoundRobin, &ports);
    let sender = Sender::start(front.url("/"), 4, 40.0);
    let mut retired = Counted::default();
    let mut drains = Vec::new();
    std::thread::sleep(Duration::from_secs(3));
    for (index, port) in ports.iter().enumerate() {
        let owed_before = in_flight(&replicas[index]);
        let (code, stderr, took) = drain(&replicas[index], 60);
        assert_eq!(code, 0, "drain.sh failed:\n{stderr}");
        assert!(
            stderr.contains("fanout owes nothing"),
            "drain.sh said:\n{stderr}"
        );
        assert_eq!(in_flight(&replicas[index]), 0);
        retired = retired + counted(&replicas[index]);
        drains.push((owed_before, took));
        replicas[index].stop();
        // Envoy retires the plugin on SIGTERM; had it owed anything, it would say so.
        let log = replicas[index].log();
        assert!(
            !log.contains("while this worker owes"),
            "a replica drained by drain.sh was retired owing work:\n{log}"
        );
        // The replacement, on the same address (the front's endpoint).
        replicas[index] = subs.replica(*port);
        std::thread::sleep(Duration::from_secs(2));
    }
    let sent_by_then = sender.sent.lock().unwrap().len();
    assert!(
        sent_by_then < MAX_EVENTS,
        "the sender stopped ({sent_by_then} events) before the rollout ended: not under load"
    );
    std::thread::sleep(Duration::from_secs(2));
    let sent = sender.finish();
    settle(&replicas.iter().collect::<Vec<_>>());
    let total = retired
        + replicas
            .iter()
            .map(counted)
            .fold(Counted::default(), |a, b| a + b);

    let accepted: BTreeSet<&str> = sent
        .iter()
        .filter(|s| s.status == 202)
        .map(|s| s.id.as_str())
        .collect();
    let others: Vec<&Sent> = sent.iter().filter(|s| s.status != 202).collect();
    eprintln!(
        "rollout: {} events sent, {} answered 202, {} otherwise ({:?}); per drain (owed at \
         its start, duration): {drains:?}",
        sent.len(),
        accepted.len(),
        others.len(),
        others.iter().map(|s| s.status).collect::<BTreeSet<_>>()
    );
    assert!(
        accepted.len() >= 200,
        "hundreds of events: {}",
        accepted.len()
    );
    assert!(
        drains.iter().any(|(owed, _)| *owed > 0),
        "no replica owed anything when its drain began: the test proves nothing ({drains:?})"
    );
    let received = subs.received();
    for (name, ids) in &received {
        let missing: Vec<&&str> = accepted
            .iter()
            .filter(|id| !ids.contains_key(**id))
            .collect();
        let twice: Vec<(&String, &usize)> = ids.iter().filter(|(_, n)| **n > 1).collect();
        assert!(
            missing.is_empty(),
            "{name} never got {} accepted event(s), e.g. {:?}",
            missing.len(),
            &missing[..missing.len().min(5)]
        );
        assert!(
            twice.is_empty(),
            "{name} got events more than once: {twice:?}"
        );
        let unknown: Vec<&String> = ids
            .keys()
            .filter(|id| !accepted.contains(id.as_str()))
            .collect();
        assert!(
            unknown.is_empty(),
            "{name} got events whose sender did not get a 202: {unknown:?}"
        );
    }
    let n = accepted.len() as u64;
    assert_eq!(
        total,
        Counted {
            accepted: n,
            quick: n,
            slow: n,
            dead_lettered: n
        },
        "the replicas' counters, summed over the rollout (retired ones read after their drain)"
    );
}

#[test]
fn sigkill_loses_what_the_killed_replica_owed_and_nothing_else() {
    let subs = Subscribers::start();
    let ports = free_ports(2);
    let mut replicas: Vec<Envoy> = ports.iter().map(|p| subs.replica(*p)).collect();
    let front = Front::start(Balance::RoundRobin, &ports);
    let sender = Sender::start(front.url("/"), 4, 40.0);
    std::thread::sleep(Duration::from_secs(4));
    // What the victim owes, as its gauge said just before the kill (flushed once a second).
    let read_at = Instant::now();
    let owed = in_flight(&replicas[0]);
    let accepted_before = sender.accepted();
    // SAFETY: signalling the process group the harness started for this Envoy.
    unsafe {
        libc::kill(-(replicas[0].pid() as libc::pid_t), libc::SIGKILL);
    }
    let killed_at = Instant::now();
    std::thread::sleep(Duration::from_secs(1));
    replicas[0] = subs.replica(ports[0]);
    std::thread::sleep(Duration::from_secs(3));
    let sent = sender.finish();
    settle(&replicas.iter().collect::<Vec<_>>());

    let received = subs.received();
    let complete = |id: &str| received.values().all(|ids| ids.get(id) == Some(&1));
    let accepted: Vec<&Sent> = sent.iter().filter(|s| s.status == 202).collect();
    let lost: Vec<&Sent> = accepted
        .iter()
        .copied()
        .filter(|s| !complete(&s.id))
        .collect();
    // Accepted since the gauge's last flush (once a second; two allow for a busy event
    // loop), so perhaps not in `owed` yet.
    let unflushed = accepted
        .iter()
        .filter(|s| s.at + Duration::from_secs(2) >= read_at && s.at <= killed_at)
        .count() as u64;
    eprintln!(
        "sigkill: {} answered 202 ({accepted_before} before the kill), {} lost; the victim's \
         fanout.in_flight just before: {owed}, accepted within one flush before it or after: \
         {unflushed}",
        accepted.len(),
        lost.len()
    );
    assert!(
        owed > 0,
        "the victim owed nothing at the kill: the test proves nothing"
    );
    assert!(
        !lost.is_empty(),
        "a SIGKILL with {owed} fan-out(s) owed lost nothing?"
    );
    assert!(
        lost.len() as u64 <= owed + unflushed,
        "lost {} events, more than the victim owed ({owed}) plus those accepted since its \
         gauge's last flush ({unflushed})",
        lost.len()
    );
    // Each lost event was in flight at the kill: answered before it, and recently (its
    // deliveries take under a second here; three allow for a loaded machine).
    for s in &lost {
        // `at` is when the sender's thread saw the answer, which on a busy machine can be a
        // scheduling delay after the victim sent it; the new replica starts 1 s after the
        // kill, so half a second still tells the victim's answers from the new one's.
        assert!(
            s.at <= killed_at + Duration::from_millis(500),
            "{} was answered 202 after the kill and still lost",
            s.id
        );
        assert!(
            s.at + Duration::from_secs(3) >= killed_at,
            "{} was answered {:?} before the kill, long enough to be delivered, and is lost",
            s.id,
            killed_at - s.at
        );
    }
    // Nothing is duplicated, lost or not.
    for (name, ids) in &received {
        let twice: Vec<(&String, &usize)> = ids.iter().filter(|(_, n)| **n > 1).collect();
        assert!(
            twice.is_empty(),
            "{name} got events more than once: {twice:?}"
        );
    }
}

/// A new configuration (an ECDS update) retires the plugin while its root context's async
/// calls are in flight: Envoy cancels a deleted context's calls, so the retired root waits
/// for their answers (it answers `false` to `on_done`, then `proxy_done`), and every event
/// is delivered and counted as delivered, not given up as lost half a minute later.
#[test]
fn async_deliveries_in_flight_when_a_new_configuration_retires_the_plugin_are_finished() {
    let slow = Subscriber::start("slow", Behavior::Delay(Duration::from_secs(3), 200));
    let config = |version: &str| {
        json!({
            "mode": "async",
            "subscribers": [{ "cluster": "slow", "timeout_ms": 10000,
                              "headers": { "x-config": version } }]
        })
        .to_string()
    };
    let mut envoy = ReloadEnvoy::start(&config("1"), &[("slow", slow.port())]);
    let client = Client::http1();
    const EVENTS: usize = 10;
    for i in 0..EVENTS {
        let reply = crate::harness::send(
            client
                .post(&envoy.url("/"))
                .header("ce-id", format!("r-{i}"))
                .body("{}"),
        );
        assert_eq!(reply.status, 202, "{}", reply.text());
    }
    assert_eq!(slow.wait_for(EVENTS, Duration::from_secs(10)), EVENTS);
    let swapped = Instant::now();
    assert_eq!(
        envoy.swap_filter(&config("2"), Duration::from_secs(20)),
        Update::Accepted
    );
    if crate::harness::fanout_build() == crate::harness::Build::Native {
        return replaced_calls_are_counted_on_the_native_build(&envoy, EVENTS as u64);
    }
    let stats = envoy.wait_for_stats(
        "wasmcustom.fanout.",
        |s| {
            s.get("wasmcustom.fanout.subscriber.slow.delivered") == Some(&(EVENTS as u64))
                && s.get("wasmcustom.fanout.in_flight") == Some(&0)
        },
        Duration::from_secs(20),
    );
    let took = swapped.elapsed();
    let failed: u64 = stats
        .iter()
        .filter(|(name, _)| name.starts_with("wasmcustom.fanout.subscriber.slow.failed."))
        .map(|(_, n)| *n)
        .sum();
    assert_eq!(
        (
            stats
                .get("wasmcustom.fanout.subscriber.slow.delivered")
                .copied(),
            stats.get("wasmcustom.fanout.in_flight").copied(),
            failed,
            stats.get("wasmcustom.fanout.requests.undelivered").copied(),
        ),
        (Some(EVENTS as u64), Some(0), 0, Some(0)),
        "after the update (waited {took:?}): {stats:?}"
    );
    assert!(
        envoy.wait_for_log(
            "retired plugin: its last call was answered",
            Duration::from_secs(10)
        ),
        "the retired root never told Envoy it was done"
    );
    // Nobody was called twice, and the calls were the old configuration's.
    assert_eq!(slow.count(), EVENTS);
    assert!(slow
        .requests()
        .iter()
        .all(|r| r.header("x-config") == Some("1")));
}

/// The native build cannot keep a replaced configuration until its calls are answered:
/// Envoy cancels them with it. Nothing is lost silently: each call in flight counts as one
/// with no response (retried or dead-lettered where the subscriber's delivery says so; here
/// neither), the events as undelivered, nothing stays in flight, and the warning says how
/// many.
fn replaced_calls_are_counted_on_the_native_build(envoy: &ReloadEnvoy, events: u64) {
    let stats = envoy.wait_for_stats(
        "wasmcustom.fanout.",
        |s| {
            s.get("wasmcustom.fanout.requests.undelivered") == Some(&events)
                && s.get("wasmcustom.fanout.in_flight") == Some(&0)
        },
        Duration::from_secs(20),
    );
    assert_eq!(
        (
            stats
                .get("wasmcustom.fanout.subscriber.slow.failed.no_response")
                .copied(),
            stats
                .get("wasmcustom.fanout.subscriber.slow.delivered")
                .copied(),
            stats.get("wasmcustom.fanout.in_flight").copied(),
        ),
        (Some(events), Some(0), Some(0)),
        "{stats:?}"
    );
    assert!(
        envoy.wait_for_log(
            &format!("configuration's {events} call(s) in flight are cancelled by Envoy"),
            Duration::from_secs(10)
        ),
        "the cancelled calls were not said"
    );
}

/// The longest delivery of a fanout configuration (JSON), in ms: what fanout itself computes
/// per subscriber (every attempt of every leg timing out, every wait at its longest).
fn longest_delivery_ms(fanout_json: &str) -> u64 {
    let config = fanout::config::Config::from_json(fanout_json.as_bytes())
        .unwrap_or_else(|e| panic!("the example's fanout configuration is refused: {e}"));
    config
        .channels
        .iter()
        .flat_map(|c| &c.subscribers)
        .map(|s| s.worst_case_ms())
        .max()
        .unwrap_or(0)
}

fn arg_after<'a>(args: &'a [Value], flag: &str) -> &'a str {
    let at = args
        .iter()
        .position(|a| a == flag)
        .unwrap_or_else(|| panic!("no {flag} in {args:?}"));
    args[at + 1].as_str().unwrap()
}

fn as_u64(v: &Value) -> u64 {
    v.as_u64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
        .unwrap_or_else(|| panic!("not a number: {v}"))
}

#[test]
fn the_kubernetes_example_drains_with_drain_sh_and_its_grace_period_covers_the_longest_delivery() {
    use crate::harness::{read_shipped, read_shipped_yaml};
    // What fanout-config holds (tests/e2e/deploy.rs checks it is what render writes for
    // deploy/kubernetes/channels/).
    let filter = read_shipped_yaml("deploy/kubernetes/fanout-config.yaml")["data"]["fanout.yaml"]
        .as_str()
        .map(|f| serde_json::from_str::<Value>(f).unwrap())
        .unwrap();
    let fanout_json = filter["resources"][0]["typed_config"]["config"]["configuration"]["value"]
        .as_str()
        .unwrap()
        .to_owned();
    let longest_ms = longest_delivery_ms(&fanout_json);
    assert_eq!(
        longest_ms, 50_000,
        "the longest delivery the comments compute"
    );

    let deployment = read_shipped_yaml("deploy/kubernetes/deployment.yaml");
    let spec = &deployment["spec"];
    assert_eq!(spec["replicas"], 2);
    assert_eq!(spec["strategy"]["rollingUpdate"]["maxUnavailable"], 0);
    let pod = &spec["template"]["spec"];
    let container = &pod["containers"][0];
    let args = container["args"].as_array().unwrap();
    assert_eq!(arg_after(args, "--drain-strategy"), "immediate");
    let drain_time_s: u64 = arg_after(args, "--drain-time-s").parse().unwrap();
    let pre_stop: Vec<&str> = container["lifecycle"]["preStop"]["exec"]["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(
        &pre_stop[..3],
        ["sh", "/etc/fanout-envoy/drain.sh", "http://127.0.0.1:9901"]
    );
    let deadline_s: u64 = pre_stop[3].parse().unwrap();
    let quiet_s = 3;
    assert!(
        deadline_s * 1000 >= (drain_time_s + quiet_s) * 1000 + longest_ms,
        "drain.sh's deadline ({deadline_s} s) must cover the drain time ({drain_time_s} s), \
         the longest delivery ({longest_ms} ms) and the quiet window ({quiet_s} s)"
    );
    let grace = as_u64(&pod["terminationGracePeriodSeconds"]);
    assert!(
        grace > deadline_s,
        "terminationGracePeriodSeconds ({grace}) counts from preStop: it must exceed \
         drain.sh's deadline ({deadline_s})"
    );
    assert!(container["readinessProbe"].is_object());
    // The Services: both select the pods, the headless one on the port the front dials.
    let services: Vec<Value> =
        serde_yaml_ng::Deserializer::from_str(&read_shipped("deploy/kubernetes/service.yaml"))
            .map(|doc| {
                let v: serde_yaml_ng::Value = serde::Deserialize::deserialize(doc).unwrap();
                serde_json::to_value(v).unwrap()
            })
            .collect();
    assert_eq!(services.len(), 2);
    let labels = &spec["template"]["metadata"]["labels"];
    for svc in &services {
        assert_eq!(&svc["spec"]["selector"], labels);
    }
    let headless = services
        .iter()
        .find(|s| s["spec"]["clusterIP"] == "None")
        .expect("a headless Service for the front");
    let front = read_shipped_yaml("envoy/front-affinity.yaml");
    let endpoint = &front["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]
        ["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
    assert!(endpoint["address"].as_str().unwrap().starts_with(&format!(
        "{}.",
        headless["metadata"]["name"].as_str().unwrap()
    )));
    assert_eq!(
        endpoint["port_value"],
        container["ports"][0]["containerPort"]
    );

    // Istio: the hook on the sidecar, inbound listeners only, and the drain duration.
    let istio = read_shipped_yaml("deploy/istio/deployment.yaml");
    let pod = &istio["spec"]["template"];
    let proxy_config: Value = serde_json::from_str(
        pod["metadata"]["annotations"]["proxy.istio.io/config"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let drain_duration_s: u64 = proxy_config["terminationDrainDuration"]
        .as_str()
        .unwrap()
        .trim_end_matches('s')
        .parse()
        .unwrap();
    let sidecar = pod["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "istio-proxy")
        .expect("an istio-proxy container to merge the hook into");
    let pre_stop: Vec<&str> = sidecar["lifecycle"]["preStop"]["exec"]["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(
        &pre_stop[..3],
        ["sh", "/etc/fanout-drain/drain.sh", "http://127.0.0.1:15000"]
    );
    assert!(sidecar["env"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["name"] == "FANOUT_DRAIN_PARAMS"
            && e["value"].as_str().unwrap().contains("inboundonly")));
    let istio_deadline_s: u64 = pre_stop[3].parse().unwrap();
    let plugin = &read_shipped("envoy/istio-wasmplugin.yaml");
    let plugin = crate::harness::yaml_to_json(plugin.split("\n---").next().unwrap(), "WasmPlugin");
    let istio_longest_ms = longest_delivery_ms(&plugin["spec"]["pluginConfig"].to_string());
    assert!(istio_deadline_s * 1000 >= istio_longest_ms + quiet_s * 1000);
    let grace = as_u64(&pod["spec"]["terminationGracePeriodSeconds"]);
    assert!(grace > istio_deadline_s + drain_duration_s);
}

/// SIGTERM without draining first: Envoy exits at once and what the replica owed is lost,
/// but not silently: the retired plugin's log line names it.
#[test]
fn sigterm_without_drain_sh_logs_what_the_replica_owed() {
    let subs = Subscribers::start();
    let port = free_ports(1)[0];
    let mut replica = subs.replica(port);
    let client = Client::http1();
    for i in 0..5 {
        let reply = crate::harness::send(
            client
                .post(&replica.url("/"))
                .header("ce-id", format!("t-{i}"))
                .body("{}"),
        );
        assert_eq!(reply.status, 202);
    }
    assert_eq!(subs.slow.wait_for(5, Duration::from_secs(10)), 5);
    let started = Instant::now();
    replica.stop();
    let took = started.elapsed();
    let log = replica.log();
    eprintln!("SIGTERM with 5 fan-outs owed: Envoy exited in {took:?}");
    // One line per worker that owed something; together they name all five.
    let marker = "plugin retired with no newer configuration while this worker owes ";
    let owed: u64 = log
        .lines()
        .filter_map(|line| line.split(marker).nth(1))
        .map(|rest| rest.split(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(owed, 5, "the fan-outs owed at SIGTERM, as logged:\n{log}");
}
