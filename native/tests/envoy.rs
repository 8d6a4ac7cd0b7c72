//! The native build in the real Envoy (1.40.0, `make envoy`): the library `make build-native`
//! puts in target/native, loaded by `envoy.filters.http.dynamic_modules` with fanout's JSON
//! as its `filter_config`, real subscribers on loopback (the e2e suite's, from
//! tests/e2e/harness/). Each Envoy runs in its own process group, stopped on drop.

// Test code: a failed expectation is a panic (the crate's lints are for the library).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::indexing_slicing)]

#[path = "../../tests/e2e/harness/server.rs"]
#[allow(dead_code, unsafe_code)]
mod server;
#[path = "../../tests/e2e/harness/subscriber.rs"]
#[allow(dead_code)]
mod subscriber;

use std::fs;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use subscriber::{Behavior, Recorded, Subscriber};

/// How long Envoy may take to become ready, or to exit on a refused config.
const START_TIMEOUT: Duration = Duration::from_secs(60);

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("native/ is in the repository")
        .to_path_buf()
}

fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// `$ENVOY_BIN`, else .tools/envoy-1.40.0 (`make envoy`).
fn envoy_bin() -> PathBuf {
    let bin = env_path("ENVOY_BIN").unwrap_or_else(|| repo().join(".tools/envoy-1.40.0"));
    assert!(
        bin.is_file(),
        "the Envoy binary is missing: {} (set ENVOY_BIN, or run `make test-native`, which \
         installs it with `make envoy`)",
        bin.display()
    );
    bin
}

/// `$FANOUT_NATIVE_DIR`, else target/native (`make build-native`): the directory holding
/// libfanout.so.
fn native_dir() -> PathBuf {
    let dir = env_path("FANOUT_NATIVE_DIR").unwrap_or_else(|| repo().join("target/native"));
    assert!(
        dir.join("libfanout.so").is_file(),
        "the native library is missing: {}/libfanout.so (run `make test-native`, which \
         builds it with `make build-native`)",
        dir.display()
    );
    fs::canonicalize(&dir).unwrap_or(dir)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

fn loopback(port: u16) -> Value {
    json!({ "socket_address": { "address": "127.0.0.1", "port_value": port } })
}

/// The HTTP filter stanza of the native build (docs/native.md).
fn native_filter(config: &Value) -> Value {
    json!({
        "name": "envoy.filters.http.dynamic_modules",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            "dynamic_module_config": { "name": "fanout", "do_not_close": true },
            "filter_name": "fanout",
            "filter_config": {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": config.to_string()
            }
        }
    })
}

/// A bootstrap: one listener with the filter (and `extra` HTTP filters after it) before a
/// router whose only route answers 418, and a cluster per `(name, port)`.
fn bootstrap(listener: u16, config: &Value, clusters: &[(&str, u16)], extra: &[Value]) -> Value {
    let mut filters = vec![native_filter(config)];
    filters.extend(extra.iter().cloned());
    filters.push(json!({
        "name": "envoy.filters.http.router",
        "typed_config": { "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router" }
    }));
    let clusters: Vec<Value> = clusters
        .iter()
        .map(|(name, port)| {
            json!({
                "name": name,
                "type": "STATIC",
                "connect_timeout": "1s",
                "load_assignment": { "cluster_name": name, "endpoints": [
                    { "lb_endpoints": [{ "endpoint": { "address": loopback(*port) } }] }
                ] }
            })
        })
        .collect();
    json!({
        "admin": { "address": loopback(0) },
        "static_resources": {
            "listeners": [{
                "name": "fanout",
                "address": loopback(listener),
                "filter_chains": [{ "filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "ingress",
                        "route_config": { "virtual_hosts": [{
                            "name": "all", "domains": ["*"],
                            "routes": [{ "match": { "prefix": "/" }, "direct_response": {
                                "status": 418,
                                "body": { "inline_string": "the request reached the router" }
                            } }]
                        }] },
                        "http_filters": filters
                    }
                }] }]
            }],
            "clusters": clusters
        }
    })
}

/// A running Envoy with the native build; dropping it stops its process group.
struct Envoy {
    child: Option<Child>,
    dir: PathBuf,
    listener: SocketAddr,
    admin: Option<SocketAddr>,
}

impl Envoy {
    fn start(config: &Value, subscribers: &[&Subscriber]) -> Envoy {
        Envoy::start_with(config, subscribers, &[])
    }

    fn start_with(config: &Value, subscribers: &[&Subscriber], extra: &[Value]) -> Envoy {
        let mut envoy = Envoy::spawn(config, subscribers, extra);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = envoy
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "Envoy exited ({status}) instead of serving. Its log:\n{}",
                    envoy.log()
                );
            }
            if let Some(admin) = envoy.admin_from_file() {
                if admin_get(admin, "/ready").is_some_and(|(code, _)| code == 200) {
                    envoy.admin = Some(admin);
                    return envoy;
                }
            }
            assert!(
                Instant::now() < deadline,
                "Envoy did not become ready. Its log:\n{}",
                envoy.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Envoy on a config it must refuse: its exit status and log.
    fn refused(config: &Value) -> (ExitStatus, String) {
        let mut envoy = Envoy::spawn(config, &[], &[]);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = envoy
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                envoy.child = None;
                return (status, envoy.log());
            }
            if let Some(admin) = envoy.admin_from_file() {
                if admin_get(admin, "/ready").is_some_and(|(code, _)| code == 200) {
                    panic!(
                        "Envoy took a config it must refuse:\n{config}\n{}",
                        envoy.log()
                    );
                }
            }
            assert!(
                Instant::now() < deadline,
                "Envoy neither refused nor served. Its log:\n{}",
                envoy.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[allow(unsafe_code)]
    fn spawn(config: &Value, subscribers: &[&Subscriber], extra: &[Value]) -> Envoy {
        let (bin, native) = (envoy_bin(), native_dir());
        let dir = std::env::temp_dir().join(format!(
            "fanout-native-{}-{}",
            std::process::id(),
            free_port()
        ));
        fs::create_dir_all(&dir).expect("a temp dir");
        let listener = free_port();
        let clusters: Vec<(&str, u16)> = subscribers.iter().map(|s| (s.name(), s.port())).collect();
        let bootstrap = bootstrap(listener, config, &clusters, extra);
        let path = dir.join("envoy.yaml");
        fs::write(&path, bootstrap.to_string()).expect("write the bootstrap");
        let mut command = Command::new(&bin);
        command
            .arg("-c")
            .arg(&path)
            .args(["--concurrency", "2", "--use-dynamic-base-id"])
            .arg("--admin-address-path")
            .arg(dir.join("admin.address"))
            .arg("--log-path")
            .arg(dir.join("envoy.log"))
            .args(["--log-level", "info", "--file-flush-interval-msec", "20"])
            .env("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", &native)
            .stdin(Stdio::null())
            .stdout(fs::File::create(dir.join("stdout.log")).expect("stdout.log"))
            .stderr(fs::File::create(dir.join("stderr.log")).expect("stderr.log"))
            .process_group(0);
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec. If
        // this test process dies without dropping the guard, the kernel kills Envoy.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().expect("start Envoy");
        Envoy {
            child: Some(child),
            dir,
            listener: SocketAddr::from(([127, 0, 0, 1], listener)),
            admin: None,
        }
    }

    fn admin_from_file(&self) -> Option<SocketAddr> {
        fs::read_to_string(self.dir.join("admin.address"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.listener)
    }

    fn log(&self) -> String {
        ["envoy.log", "stderr.log", "stdout.log"]
            .iter()
            .filter_map(|f| fs::read(self.dir.join(f)).ok())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// A counter or gauge of Envoy's `/stats` (`None`: not there).
    fn stat(&self, name: &str) -> Option<u64> {
        let admin = self.admin?;
        let (_, text) = admin_get(admin, &format!("/stats?filter=^{name}$"))?;
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .and_then(|v| v.trim().parse().ok())
    }

    #[allow(unsafe_code)]
    fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let group = child.id() as libc::pid_t;
        // SAFETY: signalling the process group we created.
        unsafe { libc::kill(-group, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        // SAFETY: as above; ESRCH once the group is empty is fine.
        unsafe { libc::kill(-group, libc::SIGKILL) };
        let _ = child.wait();
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- Envoy's log ({}) ---\n{}",
                self.dir.display(),
                self.log()
            );
        }
        self.stop();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// GET on the admin interface: (status, body).
fn admin_get(admin: SocketAddr, path: &str) -> Option<(u16, String)> {
    let reply = reqwest::blocking::Client::new()
        .get(format!("http://{admin}{path}"))
        .timeout(Duration::from_secs(2))
        .send()
        .ok()?;
    let status = reply.status().as_u16();
    Some((status, reply.text().ok()?))
}

struct Reply {
    status: u16,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }
}

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("an HTTP client")
}

fn send(request: reqwest::blocking::RequestBuilder) -> Reply {
    let reply = request.send().expect("Envoy answers");
    let status = reply.status().as_u16();
    let body = reply.text().expect("a body");
    assert_ne!(
        status, 418,
        "the request got past fanout to the router: {body}"
    );
    Reply { status, body }
}

fn header<'a>(request: &'a Recorded, name: &str) -> Option<&'a str> {
    request.header(name)
}

#[test]
fn a_sync_fan_out_to_two_subscribers_answers_202_and_both_get_the_event() {
    let (a, b) = (Subscriber::ok("a"), Subscriber::ok("b"));
    let config = json!({ "subscribers": [
        { "cluster": "a", "path": "/events" },
        { "cluster": "b" }
    ] });
    let envoy = Envoy::start(&config, &[&a, &b]);
    let reply = send(
        client()
            .post(envoy.url("/"))
            .header("content-type", "application/json")
            .header("ce-id", "evt-1")
            .header("ce-source", "/native")
            .header("ce-specversion", "1.0")
            .header("ce-type", "order.created")
            .header("x-not-forwarded", "secret")
            .body(r#"{"order":1}"#),
    );
    assert_eq!(reply.status, 202, "{}", reply.body);
    // The ABI version the library was written for is Envoy's.
    let log = envoy.log();
    assert!(
        log.contains("Dynamic module ABI version v0.2.0 matched"),
        "{log}"
    );
    for (subscriber, path) in [(&a, "/events"), (&b, "/")] {
        let got = subscriber.only_request();
        assert_eq!(got.method, "POST");
        assert_eq!(got.path, path);
        assert_eq!(got.body, br#"{"order":1}"#);
        assert_eq!(header(&got, "ce-id"), Some("evt-1"));
        assert_eq!(header(&got, "ce-type"), Some("order.created"));
        assert_eq!(header(&got, "content-type"), Some("application/json"));
        assert_eq!(header(&got, "x-not-forwarded"), None);
    }
}

#[test]
fn a_subscriber_answering_500_gives_the_500_with_the_report() {
    let ok = Subscriber::ok("fine");
    let down = Subscriber::start("down", Behavior::Status(500));
    let config = json!({ "subscribers": [{ "cluster": "fine" }, { "cluster": "down" }] });
    let envoy = Envoy::start(&config, &[&ok, &down]);
    let reply = send(client().post(envoy.url("/")).body("event"));
    assert_eq!(reply.status, 500, "{}", reply.body);
    let report = reply.json();
    assert_eq!(report["failed"][0]["cluster"], "down", "{report}");
    assert_eq!(report["failed"][0]["status"], 500, "{report}");
    assert_eq!(ok.count(), 1);
    assert_eq!(down.count(), 1);
}

#[test]
fn bad_requests_get_their_4xx_with_an_error() {
    let a = Subscriber::ok("a");
    let config = json!({
        "max_body_bytes": 100,
        "channels": [{ "name": "orders", "hosts": ["orders.example"],
                       "subscribers": [{ "cluster": "a" }] }]
    });
    let envoy = Envoy::start(&config, &[&a]);
    let client = client();
    let unknown = send(
        client
            .post(envoy.url("/"))
            .header("host", "other.example")
            .body("e"),
    );
    assert_eq!(unknown.status, 404, "{}", unknown.body);
    assert!(unknown.json()["error"].is_string(), "{}", unknown.body);
    let get = send(client.get(envoy.url("/")).header("host", "orders.example"));
    assert_eq!(get.status, 405, "{}", get.body);
    assert!(get.json()["error"].is_string(), "{}", get.body);
    let big = send(
        client
            .post(envoy.url("/"))
            .header("host", "orders.example")
            .body("x".repeat(1000)),
    );
    assert_eq!(big.status, 413, "{}", big.body);
    assert!(big.json()["error"].is_string(), "{}", big.body);
    assert_eq!(a.count(), 0, "nobody is called for a refused request");
    // And the channel still serves.
    let ok = send(
        client
            .post(envoy.url("/"))
            .header("host", "orders.example")
            .body("e"),
    );
    assert_eq!(ok.status, 202, "{}", ok.body);
    assert_eq!(a.count(), 1);
}

#[test]
fn what_the_native_build_cannot_serve_makes_envoy_refuse_the_config() {
    let sub = |extra: Value| {
        let mut s = json!({ "cluster": "a" });
        if let (Some(s), Some(extra)) = (s.as_object_mut(), extra.as_object()) {
            s.extend(extra.clone());
        }
        s
    };
    let cases = [
        (
            json!({ "mode": "async", "subscribers": [sub(json!({}))] }),
            "mode: \"async\" needs the wasm build",
        ),
        (
            json!({ "channels": [{ "name": "c", "subscribers": [sub(json!({})), sub(json!({ "required": false }))] }] }),
            "channels[0].subscribers[1].required: best-effort subscribers need the wasm build",
        ),
        (
            json!({ "subscribers": [sub(json!({ "delivery": { "retry": 2 } }))] }),
            "subscribers[0].delivery.retry: retries need",
        ),
        (
            json!({ "delivery": { "retry": 1 }, "subscribers": [sub(json!({}))] }),
            "delivery.retry: retries need",
        ),
        (
            json!({ "subscribers": [sub(json!({ "delivery": { "dead_letter": { "cluster": "dl" } } }))] }),
            "subscribers[0].delivery.dead_letter: dead letters need",
        ),
        (
            json!({ "subscribers": [sub(json!({ "reply": { "cluster": "r" } }))] }),
            "subscribers[0].reply: replies need",
        ),
        (
            json!({ "subscribers": [sub(json!({}))], "dedupe": { "store": { "etcd": { "cluster": "etcd" } } } }),
            "dedupe.store: etcd needs the wasm build",
        ),
        (
            json!({ "subscribers": [sub(json!({}))], "tracing": { "collector": { "cluster": "otel" } } }),
            "tracing: needs the wasm build",
        ),
        (
            json!({ "subscribers": [sub(json!({ "max_concurrent_calls": 4 }))] }),
            "subscribers[0].max_concurrent_calls: needs the wasm build",
        ),
        // The reader's own errors, as in the wasm build.
        (
            json!({ "subscribers": [{ "cluster": "" }] }),
            "subscribers[0].cluster: must not be empty",
        ),
    ];
    for (config, says) in cases {
        let (status, log) = Envoy::refused(&config);
        assert!(!status.success(), "Envoy exited {status} on {config}");
        assert!(
            log.contains(says),
            "the log does not say {says:?} for {config}:\n{log}"
        );
        assert!(log.contains("Failed to create filter config"), "{log}");
    }
}

#[test]
fn the_envoy_dedupe_store_calls_nobody_again_for_a_redelivery() {
    let (a, b) = (Subscriber::ok("a"), Subscriber::ok("b"));
    let config = json!({
        "dedupe": { "store": "envoy" },
        "subscribers": [{ "cluster": "a" }, { "cluster": "b" }]
    });
    let envoy = Envoy::start(&config, &[&a, &b]);
    let client = client();
    let post = |id: &str| {
        send(
            client
                .post(envoy.url("/"))
                .header("ce-source", "/native/dedupe")
                .header("ce-id", id)
                .body("{}"),
        )
    };
    let first = post("evt-1");
    assert_eq!(first.status, 202, "{}", first.body);
    assert_eq!((a.count(), b.count()), (1, 1));
    // The sender retries the same event (on another connection: maybe another worker).
    for _ in 0..4 {
        let again = send(
            reqwest::blocking::Client::new()
                .post(envoy.url("/"))
                .header("ce-source", "/native/dedupe")
                .header("ce-id", "evt-1")
                .body("{}"),
        );
        assert_eq!(again.status, 202, "{}", again.body);
        assert_eq!(
            again.json()["already_delivered"],
            json!(["a", "b"]),
            "{}",
            again.body
        );
    }
    assert_eq!(
        (a.count(), b.count()),
        (1, 1),
        "a redelivery called a subscriber again"
    );
    assert_eq!(post("evt-2").status, 202);
    assert_eq!((a.count(), b.count()), (2, 2));
}

#[test]
fn counters_reach_envoys_stats_under_steady_traffic() {
    let a = Subscriber::ok("a");
    let config = json!({ "subscribers": [{ "cluster": "a" }] });
    let envoy = Envoy::start(&config, &[&a]);
    let client = client();
    let accepted = "dynamicmodulescustom.fanout.requests.accepted";
    // Defined with the configuration: there, at zero, before any request.
    assert_eq!(envoy.stat(accepted), Some(0), "{}", envoy.log());
    // A sender posting every 100 ms: the counts reach Envoy about once a second.
    let mut sent = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    let seen = loop {
        assert_eq!(send(client.post(envoy.url("/")).body("e")).status, 202);
        sent += 1;
        let seen = envoy.stat(accepted).unwrap_or(0);
        if seen >= 10 || Instant::now() > deadline {
            break seen;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(seen >= 10 && seen <= sent, "{seen} counted of {sent} sent");
    let calls = envoy.stat("dynamicmodulescustom.fanout.subscriber.a.delivered");
    assert!(
        calls.is_some_and(|n| n >= 1 && n <= sent),
        "{calls:?}: {}",
        envoy.log()
    );
}

#[test]
fn body_wait_continue_with_a_buffer_filter_fans_out_the_whole_body() {
    let a = Subscriber::ok("a");
    let config = json!({ "body_wait": "continue", "subscribers": [{ "cluster": "a" }] });
    let buffer = json!({
        "name": "envoy.filters.http.buffer",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
            "max_request_bytes": 1_048_576
        }
    });
    let envoy = Envoy::start_with(&config, &[&a], &[buffer]);
    let body = "y".repeat(200_000);
    let reply = send(client().post(envoy.url("/")).body(body.clone()));
    assert_eq!(reply.status, 202, "{}", reply.body);
    assert_eq!(a.only_request().body, body.as_bytes());
}

/// `make test-compat` runs this with `ENVOY_BIN` set to the oldest Envoy it installs
/// (1.36.4): the library imports callbacks only Envoy 1.40.0 exports, and is linked to
/// resolve them all at load, so an older Envoy refuses it, naming the symbol, and exits.
#[test]
#[ignore = "needs an Envoy older than 1.40.0 as ENVOY_BIN: make test-compat runs it"]
fn an_envoy_older_than_1_40_refuses_the_library_at_load() {
    let version = Command::new(envoy_bin())
        .arg("--version")
        .output()
        .expect("envoy --version");
    let version = String::from_utf8_lossy(&version.stdout).into_owned();
    assert!(
        !version.contains("/1.40.") && !version.contains("/1.41."),
        "ENVOY_BIN is not older than 1.40.0: {version}"
    );
    let (status, log) = Envoy::refused(&json!({ "subscribers": [{ "cluster": "a" }] }));
    assert!(!status.success(), "Envoy exited {status}");
    assert!(
        log.contains("Failed to load dynamic module")
            && log.contains("undefined symbol: envoy_dynamic_module_callback_"),
        "{log}"
    );
}

#[test]
fn a_cluster_envoy_does_not_know_and_a_timeout_are_failures_in_the_report() {
    let slow = Subscriber::start("slow", Behavior::Delay(Duration::from_secs(3), 200));
    let config = json!({ "subscribers": [
        { "cluster": "slow", "timeout_ms": 300 },
        { "cluster": "nowhere" }
    ] });
    let envoy = Envoy::start(&config, &[&slow]);
    let reply = send(client().post(envoy.url("/")).body("event"));
    assert_eq!(reply.status, 500, "{}", reply.body);
    let report = reply.json();
    let failed = report["failed"].as_array().expect("a list of failures");
    let by = |cluster: &str| {
        failed
            .iter()
            .find(|f| f["cluster"] == cluster)
            .unwrap_or_else(|| panic!("{cluster} is not in {report}"))
            .clone()
    };
    assert_eq!(by("slow")["outcome"], "timeout", "{report}");
    assert_eq!(by("nowhere")["outcome"], "dispatch_error", "{report}");
    let detail = by("nowhere")["detail"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(detail.contains("ClusterNotFound"), "{report}");
}

#[test]
fn concurrent_senders_on_both_workers_each_get_one_answer_and_every_delivery_is_made() {
    let (a, b) = (Subscriber::ok("a"), Subscriber::ok("b"));
    let config = json!({ "subscribers": [{ "cluster": "a" }, { "cluster": "b" }] });
    let envoy = Envoy::start(&config, &[&a, &b]);
    let url = envoy.url("/");
    let senders: Vec<_> = (0..8)
        .map(|t| {
            let url = url.clone();
            std::thread::spawn(move || {
                // A connection per sender: Envoy spreads them over its two workers.
                let client = client();
                (0..10)
                    .map(|i| send(client.post(&url).body(format!("{t}-{i}"))).status)
                    .collect::<Vec<u16>>()
            })
        })
        .collect();
    let statuses: Vec<u16> = senders
        .into_iter()
        .flat_map(|s| s.join().expect("a sender"))
        .collect();
    assert!(statuses.iter().all(|s| *s == 202), "{statuses:?}");
    assert_eq!((a.count(), b.count()), (80, 80));
    let mut bodies: Vec<Vec<u8>> = a.requests().into_iter().map(|r| r.body).collect();
    bodies.sort();
    bodies.dedup();
    assert_eq!(bodies.len(), 80, "each event once");
}

#[test]
fn a_sender_leaving_mid_fan_out_leaves_envoy_serving() {
    let slow = Subscriber::start("slow", Behavior::Delay(Duration::from_millis(1500), 200));
    let config = json!({ "subscribers": [{ "cluster": "slow" }] });
    let envoy = Envoy::start(&config, &[&slow]);
    let impatient = reqwest::blocking::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .expect("a client");
    for _ in 0..3 {
        assert!(impatient.post(envoy.url("/")).body("e").send().is_err());
    }
    // Its calls' answers come to streams that are gone; the next sender is served.
    std::thread::sleep(Duration::from_millis(1500));
    let reply = send(client().post(envoy.url("/")).body("e"));
    assert_eq!(reply.status, 202, "{}", reply.body);
}
