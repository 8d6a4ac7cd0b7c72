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

/// The listener: the filter (and `extra` HTTP filters after it) before a router whose only
/// route answers 418. Envoy reads it from a file (LDS), so that a test can replace it.
fn listener(port: u16, config: &Value, extra: &[Value]) -> Value {
    let mut listener = static_listener(port, config, extra);
    if let Some(object) = listener.as_object_mut() {
        object.insert(
            "@type".into(),
            json!("type.googleapis.com/envoy.config.listener.v3.Listener"),
        );
    }
    json!({ "resources": [listener] })
}

/// The same listener, as a bootstrap's static one: a configuration Envoy refuses there
/// stops Envoy (from LDS, it would only be rejected).
fn static_listener(port: u16, config: &Value, extra: &[Value]) -> Value {
    let mut filters = vec![native_filter(config)];
    filters.extend(extra.iter().cloned());
    filters.push(json!({
        "name": "envoy.filters.http.router",
        "typed_config": { "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router" }
    }));
    json!({
        "name": "fanout",
        "address": loopback(port),
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
    })
}

fn listener_of(port: u16, config: &Value, extra: &[Value]) -> String {
    listener(port, config, extra).to_string()
}

/// A bootstrap: the listener from `lds` (a file in the watched directory `dir`), a cluster
/// per `(name, port)`.
fn bootstrap(dir: &Path, lds: &Path, clusters: &[(&str, u16)]) -> Value {
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
        "node": { "id": "native-test", "cluster": "native-test" },
        "dynamic_resources": { "lds_config": {
            "resource_api_version": "V3",
            "path_config_source": { "path": lds, "watched_directory": { "path": dir } }
        } },
        "static_resources": { "clusters": clusters }
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
        let mut envoy = Envoy::spawn(config, subscribers, extra, true);
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
        let mut envoy = Envoy::spawn(config, &[], &[], false);
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
    fn spawn(config: &Value, subscribers: &[&Subscriber], extra: &[Value], lds: bool) -> Envoy {
        let (bin, native) = (envoy_bin(), native_dir());
        let dir = std::env::temp_dir().join(format!(
            "fanout-native-{}-{}",
            std::process::id(),
            free_port()
        ));
        fs::create_dir_all(&dir).expect("a temp dir");
        let listener = free_port();
        let clusters: Vec<(&str, u16)> = subscribers.iter().map(|s| (s.name(), s.port())).collect();
        let lds_dir = dir.join("lds");
        fs::create_dir_all(&lds_dir).expect("the LDS directory");
        let lds_file = lds_dir.join("listener.json");
        let mut bootstrap = bootstrap(&lds_dir, &lds_file, &clusters);
        if lds {
            fs::write(&lds_file, listener_of(listener, config, extra)).expect("the listener");
        } else if let Some(object) = bootstrap.as_object_mut() {
            object.remove("dynamic_resources");
            bootstrap["static_resources"]["listeners"] =
                json!([static_listener(listener, config, extra)]);
        }
        let path = dir.join("envoy.yaml");
        fs::write(&path, bootstrap.to_string()).expect("write the bootstrap");
        let mut command = Command::new(&bin);
        command
            .arg("-c")
            .arg(&path)
            .args([
                "--concurrency",
                "2",
                "--use-dynamic-base-id",
                "--drain-time-s",
                "1",
            ])
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

    /// Replaces the filter's configuration (LDS: a new listener, taken for new connections
    /// while the old one drains).
    fn reconfigure(&self, config: &Value) {
        let text = listener_of(self.listener.port(), config, &[]);
        let staged = self.dir.join("listener.json.new");
        fs::write(&staged, text).expect("write the new listener");
        fs::rename(&staged, self.dir.join("lds/listener.json")).expect("move it in place");
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

    /// Envoy's log once it shows `text` (Envoy writes its log file every 20 ms: a line
    /// logged just now may not be there yet), or as it is after a few seconds.
    fn log_showing(&self, text: &str) -> String {
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            let log = self.log();
            if log.contains(text) || Instant::now() >= until {
                return log;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
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
    retry_after: Option<String>,
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
    let retry_after = reply
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = reply.text().expect("a body");
    assert_ne!(
        status, 418,
        "the request got past fanout to the router: {body}"
    );
    Reply {
        status,
        retry_after,
        body,
    }
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
    let log = envoy.log_showing("Dynamic module ABI version v0.2.0 matched");
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
    let post = |host: &str, body: String| {
        send(client.post(envoy.url("/")).header("host", host).body(body))
    };
    let refused = |reply: Reply, status: u16| {
        assert_eq!(reply.status, status, "{}", reply.body);
        assert!(reply.json()["error"].is_string(), "{}", reply.body);
    };
    refused(post("other.example", "e".into()), 404);
    refused(
        send(client.get(envoy.url("/")).header("host", "orders.example")),
        405,
    );
    refused(post("orders.example", "x".repeat(1000)), 413);
    assert_eq!(a.count(), 0, "nobody is called for a refused request");
    // And the channel still serves.
    let ok = post("orders.example", "e".into());
    assert_eq!(ok.status, 202, "{}", ok.body);
    assert_eq!(a.count(), 1);
}

#[test]
fn a_config_the_reader_refuses_makes_envoy_refuse_it_with_the_fields_path() {
    let cases = [
        (
            json!({ "subscribers": [{ "cluster": "" }] }),
            "subscribers[0].cluster: must not be empty",
        ),
        (
            json!({ "mode": "async", "subscribers": [{ "cluster": "a", "delivery": { "retry": 101 } }] }),
            "subscribers[0].delivery.retry",
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

/// Async mode and a best-effort subscriber are served by the configuration's own context
/// on Envoy's main thread: the sender has its answer, the deliveries go on after it, and
/// they are counted in Envoy's stats.
#[test]
fn work_after_the_answer_is_served_by_the_configurations_own_context() {
    let (a, b) = (Subscriber::ok("a"), Subscriber::ok("b"));
    for config in [
        json!({ "mode": "async", "metrics": true,
                "subscribers": [{ "cluster": "a" }, { "cluster": "b" }] }),
        json!({ "metrics": true,
                "subscribers": [{ "cluster": "a" }, { "cluster": "b", "required": false }] }),
    ] {
        let (before_a, before_b) = (a.count(), b.count());
        let envoy = Envoy::start(&config, &[&a, &b]);
        let reply = send(client().post(envoy.url("/")).body("{}"));
        assert_eq!(reply.status, 202, "{config}: {}", reply.body);
        let until = Instant::now() + Duration::from_secs(10);
        while (a.count(), b.count()) != (before_a + 1, before_b + 1) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(
            (a.count(), b.count()),
            (before_a + 1, before_b + 1),
            "{config}"
        );
        let until = Instant::now() + Duration::from_secs(10);
        while envoy.stat("dynamicmodulescustom.fanout.subscriber.b.delivered") != Some(1)
            && Instant::now() < until
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(
            envoy.stat("dynamicmodulescustom.fanout.subscriber.b.delivered"),
            Some(1),
            "{config}"
        );
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
    let rejected = "dynamicmodulescustom.fanout.requests.rejected.405";
    assert_eq!(envoy.stat(rejected), Some(0), "{}", envoy.log());
    assert_eq!(send(client.get(envoy.url("/"))).status, 405);
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
    assert_eq!(envoy.stat(rejected), Some(1));
    let calls = envoy.stat("dynamicmodulescustom.fanout.subscriber.a.delivered");
    assert!(
        calls.is_some_and(|n| n >= 1 && n <= sent),
        "{calls:?}: {}",
        envoy.log()
    );
}

#[test]
fn the_counts_of_the_last_requests_reach_envoys_stats_without_another_request() {
    let subscribers = json!([{ "cluster": "a" }, { "cluster": "down" }]);
    counts_reach_envoy_after_the_last_request(&json!({ "subscribers": subscribers }));
    // The envoy store's tick is quicker than the metrics' second.
    counts_reach_envoy_after_the_last_request(&json!({
        "subscribers": subscribers,
        "dedupe": { "store": "envoy" }
    }));
}

/// 202s, a 405 and 500 reports (a local reply that completes the stream inside a hook), and
/// nothing after them: each worker hands its counts over when its last stream is over, not
/// on a next request.
fn counts_reach_envoy_after_the_last_request(config: &Value) {
    let a = Subscriber::ok("a");
    let down = Subscriber::start(
        "down",
        Behavior::Sequence(vec![
            Behavior::Status(200),
            Behavior::Status(200),
            Behavior::Status(200),
            Behavior::Status(500),
        ]),
    );
    let envoy = Envoy::start(config, &[&a, &down]);
    let client = client();
    for _ in 0..3 {
        assert_eq!(send(client.post(envoy.url("/")).body("e")).status, 202);
    }
    assert_eq!(send(client.get(envoy.url("/"))).status, 405);
    for _ in 0..2 {
        assert_eq!(send(client.post(envoy.url("/")).body("e")).status, 500);
    }
    let want = [
        ("dynamicmodulescustom.fanout.requests.accepted", 3),
        ("dynamicmodulescustom.fanout.requests.rejected.405", 1),
        ("dynamicmodulescustom.fanout.subscriber.a.delivered", 5),
        (
            "dynamicmodulescustom.fanout.subscriber.down.failed.status_5xx",
            2,
        ),
        ("dynamicmodulescustom.fanout.in_flight", 0),
    ];
    let deadline = Instant::now() + Duration::from_secs(10);
    let seen = loop {
        let seen: Vec<_> = want.iter().map(|(name, _)| envoy.stat(name)).collect();
        let all = want.iter().zip(&seen).all(|((_, n), s)| *s == Some(*n));
        if all || Instant::now() > deadline {
            break seen;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let expected: Vec<_> = want.iter().map(|(_, n)| Some(*n)).collect();
    assert_eq!(seen, expected, "{config}: {want:?}: {}", envoy.log());
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

#[test]
fn a_body_past_envoys_default_buffer_limit_is_fanned_out_whole_up_to_max_body_bytes() {
    let a = Subscriber::ok("a");
    let config = json!({ "max_body_bytes": 4_000_000, "subscribers": [{ "cluster": "a" }] });
    let envoy = Envoy::start(&config, &[&a]);
    // 3 MB: past Envoy's default 1 MiB per-stream buffer, which would answer 413 itself.
    let body: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let reply = send(client().post(envoy.url("/")).body(body.clone()));
    assert_eq!(reply.status, 202, "{}", reply.body);
    assert!(
        a.only_request().body == body,
        "the subscriber got another body"
    );
    // Past max_body_bytes: fanout's own 413, with its JSON.
    let big = send(client().post(envoy.url("/")).body(vec![b'x'; 4_500_000]));
    assert_eq!(big.status, 413, "{}", big.body);
    assert!(big.json()["error"].is_string(), "{}", big.body);
}

#[test]
fn a_configuration_update_serves_new_senders_and_a_refused_one_keeps_the_last() {
    let (a, b) = (Subscriber::ok("a"), Subscriber::ok("b"));
    let envoy = Envoy::start(&json!({ "subscribers": [{ "cluster": "a" }] }), &[&a, &b]);
    // Each post on a new connection: a connection stays on the listener it was opened on.
    let post = || {
        send(
            reqwest::blocking::Client::new()
                .post(envoy.url("/"))
                .body("e"),
        )
    };
    assert_eq!(post().status, 202);
    assert_eq!((a.count(), b.count()), (1, 0));

    envoy.reconfigure(&json!({ "subscribers": [{ "cluster": "b" }] }));
    let deadline = Instant::now() + Duration::from_secs(20);
    while b.count() == 0 {
        assert!(
            Instant::now() < deadline,
            "the update never served: {}",
            envoy.log()
        );
        assert_eq!(post().status, 202);
        std::thread::sleep(Duration::from_millis(50));
    }
    let before = a.count();

    // A configuration the filter refuses: Envoy rejects the update and keeps serving the
    // last one.
    envoy
        .reconfigure(&json!({ "subscribers": [{ "cluster": "a", "delivery": { "retry": 101 } }] }));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !envoy.log().contains("subscribers[0].delivery.retry") {
        assert!(
            Instant::now() < deadline,
            "no refusal logged: {}",
            envoy.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let delivered = b.count();
    for _ in 0..5 {
        assert_eq!(post().status, 202);
    }
    assert_eq!((a.count(), b.count()), (before, delivered + 5));
}

/// A sync fan-out's subscriber with `retry` and a short linear backoff.
fn retrying(cluster: &str, retry: u32, delay_ms: u32) -> Value {
    json!({ "cluster": cluster, "delivery": {
        "retry": retry, "backoff_policy": "linear", "backoff_delay_ms": delay_ms } })
}

#[test]
fn a_subscriber_failing_once_is_retried_and_the_sender_gets_202() {
    let flaky = Subscriber::start(
        "flaky",
        Behavior::Sequence(vec![Behavior::Status(503), Behavior::Status(200)]),
    );
    let config = json!({ "subscribers": [retrying("flaky", 2, 50)] });
    let envoy = Envoy::start(&config, &[&flaky]);
    // Nothing else comes to Envoy while the retry waits: the timer wakes the worker.
    let reply = send(client().post(envoy.url("/")).body("event"));
    assert_eq!(reply.status, 202, "{}", reply.body);
    assert_eq!(flaky.count(), 2);
    let bodies: Vec<Vec<u8>> = flaky.requests().into_iter().map(|r| r.body).collect();
    assert_eq!(bodies, vec![b"event".to_vec(), b"event".to_vec()]);
}

#[test]
fn a_subscriber_always_failing_gets_every_retry_then_the_sender_gets_the_500_report() {
    let down = Subscriber::start("down", Behavior::Status(503));
    let config = json!({ "subscribers": [retrying("down", 2, 50)] });
    let envoy = Envoy::start(&config, &[&down]);
    let reply = send(client().post(envoy.url("/")).body("event"));
    assert_eq!(reply.status, 500, "{}", reply.body);
    let report = reply.json();
    assert_eq!(report["failed"][0]["cluster"], "down", "{report}");
    assert_eq!(report["failed"][0]["status"], 503, "{report}");
    assert_eq!(down.count(), 3, "one attempt and two retries");
    down.stays_at(3, Duration::from_millis(300));
}

#[test]
fn a_sender_leaving_while_its_retry_waits_leaves_envoy_serving() {
    let flaky = Subscriber::start(
        "flaky",
        Behavior::Sequence(vec![
            Behavior::Status(503),
            Behavior::Status(503),
            Behavior::Status(503),
            Behavior::Status(200),
        ]),
    );
    let config = json!({ "subscribers": [retrying("flaky", 2, 1000)] });
    let envoy = Envoy::start(&config, &[&flaky]);
    let impatient = reqwest::blocking::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .expect("a client");
    for _ in 0..3 {
        assert!(impatient.post(envoy.url("/")).body("e").send().is_err());
    }
    // Their retries were due while nobody waited for them: none is sent, and the timer's
    // wake-ups come to streams that are gone.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(flaky.count(), 3, "{:#?}", flaky.requests());
    let reply = send(client().post(envoy.url("/")).body("e"));
    assert_eq!(reply.status, 202, "{}", reply.body);
    assert_eq!(flaky.count(), 4);
}

#[test]
fn a_retry_waits_for_the_subscribers_retry_after() {
    let busy = Subscriber::start(
        "busy",
        Behavior::Sequence(vec![
            Behavior::respond(503, &[("retry-after", "1")], "busy"),
            Behavior::Status(200),
        ]),
    );
    let config = json!({ "subscribers": [{ "cluster": "busy", "delivery": {
        "retry": 1, "backoff_delay_ms": 10, "backoff_max_ms": 5000 } }] });
    let envoy = Envoy::start(&config, &[&busy]);
    let reply = send(client().post(envoy.url("/")).body("event"));
    assert_eq!(reply.status, 202, "{}", reply.body);
    let requests = busy.requests();
    assert_eq!(requests.len(), 2);
    let waited = requests[1].at.duration_since(requests[0].at);
    // `retry-after: 1` asks for a second; the backoff alone would be 10 ms.
    assert!(
        waited >= Duration::from_millis(800),
        "retried after {waited:?}"
    );
}

#[test]
fn concurrent_senders_with_retries_on_both_workers_each_get_202() {
    let flaky = Subscriber::start("flaky", Behavior::FirstOfEach("ce-id", 503));
    let ok = Subscriber::ok("ok");
    let config = json!({ "subscribers": [retrying("flaky", 2, 20), { "cluster": "ok" }] });
    let envoy = Envoy::start(&config, &[&flaky, &ok]);
    let url = envoy.url("/");
    let senders: Vec<_> = (0..6)
        .map(|t| {
            let url = url.clone();
            std::thread::spawn(move || {
                // A connection per sender: Envoy spreads them over its two workers.
                let client = client();
                (0..5)
                    .map(|i| {
                        let request = client
                            .post(&url)
                            .header("ce-id", format!("{t}-{i}"))
                            .header("ce-source", "/native")
                            .header("ce-specversion", "1.0")
                            .header("ce-type", "t")
                            .body("e");
                        send(request).status
                    })
                    .collect::<Vec<u16>>()
            })
        })
        .collect();
    let statuses: Vec<u16> = senders
        .into_iter()
        .flat_map(|s| s.join().expect("a sender"))
        .collect();
    assert!(statuses.iter().all(|s| *s == 202), "{statuses:?}");
    assert_eq!((flaky.count(), ok.count()), (60, 30));
}

/// `n` events (`event 0`, `event 1`, ...) sent at once, each from a thread and a connection
/// of its own (Envoy spreads them over its workers); their replies, in that order.
fn send_at_once(envoy: &Envoy, n: usize) -> Vec<Reply> {
    let url = envoy.url("/");
    let senders: Vec<_> = (0..n)
        .map(|i| {
            let url = url.clone();
            std::thread::spawn(move || send(client().post(&url).body(format!("event {i}"))))
        })
        .collect();
    senders
        .into_iter()
        .map(|s| s.join().expect("a sender"))
        .collect()
}

/// Twelve senders at once (their own connections, over Envoy's two workers) to a subscriber
/// capped at one call per worker, whose first calls fail and are retried, and to one without
/// a cap: every sender gets 202, every event reaches both, the capped one never sees more
/// than two calls at once (one per worker) and the other sees more. Nothing but the timer
/// wakes a worker when a call's slot comes free after the last request arrived.
#[test]
fn a_capped_subscriber_sees_at_most_its_cap_per_worker_and_every_sender_gets_202() {
    const SENDERS: usize = 12;
    let answer = |status| Behavior::Delay(Duration::from_millis(100), status);
    let mut steps = vec![answer(503); 2];
    steps.push(answer(200));
    let capped = Subscriber::start("capped", Behavior::Sequence(steps));
    let free = Subscriber::start("free", answer(200));
    let config = json!({
        "delivery": { "retry": 1, "backoff_delay_ms": 20 },
        "subscribers": [
            { "cluster": "capped", "max_concurrent_calls": 1, "timeout_ms": 500 },
            { "cluster": "free" }
        ]
    });
    let envoy = Envoy::start(&config, &[&capped, &free]);
    for reply in send_at_once(&envoy, SENDERS) {
        assert_eq!(reply.status, 202, "{}", reply.body);
    }
    assert_eq!(
        capped.count(),
        SENDERS + 2,
        "every event and the two retries"
    );
    assert_eq!(free.count(), SENDERS);
    let mut bodies: Vec<Vec<u8>> = capped.requests().into_iter().map(|r| r.body).collect();
    bodies.sort();
    bodies.dedup();
    assert_eq!(
        bodies.len(),
        SENDERS,
        "every event reached the capped subscriber"
    );
    assert!(
        capped.max_concurrent() <= 2,
        "the capped subscriber saw {} calls at once (one per worker allowed)",
        capped.max_concurrent()
    );
    assert!(
        free.max_concurrent() > 2,
        "the uncapped subscriber saw at most {} calls at once: the senders were not \
         concurrent, so this test showed nothing",
        free.max_concurrent()
    );
    assert_eq!(envoy.stat("dynamicmodulescustom.fanout.in_flight"), Some(0));
}

/// A subscriber capped at one call with room for one more in line, on each worker: once both
/// workers have one call in flight and one in line, the next sender gets 503 with
/// `retry-after` and a JSON error naming the subscriber, and nobody is called for it.
#[test]
fn a_full_line_answers_503_with_retry_after_and_calls_nobody() {
    let other = Subscriber::ok("other");
    let slow = Subscriber::start("slow", Behavior::Delay(Duration::from_secs(2), 200));
    let config = json!({ "subscribers": [
        { "cluster": "other" },
        { "cluster": "slow", "max_concurrent_calls": 1, "max_queued_calls": 1 }
    ] });
    let envoy = Envoy::start(&config, &[&other, &slow]);
    // Four senders fill both workers' slot and line (Envoy spreads connections over them;
    // which worker takes which is Envoy's choice, so the refusals are counted, not placed).
    let replies = send_at_once(&envoy, 6);
    let refused: Vec<&Reply> = replies.iter().filter(|r| r.status == 503).collect();
    let taken = replies.iter().filter(|r| r.status == 202).count();
    assert_eq!(
        taken + refused.len(),
        6,
        "{:?}",
        replies.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    assert!(
        !refused.is_empty(),
        "six senders, at most four places: none refused"
    );
    assert!(
        taken <= 4,
        "{taken} taken: more than a slot and a place in line per worker"
    );
    for reply in &refused {
        let error = reply.json();
        assert_eq!(error["subscriber"], "slow", "{error}");
        let retry_after = reply.retry_after.as_deref().unwrap_or_default();
        assert!(
            retry_after.parse::<u64>().is_ok_and(|secs| secs >= 1),
            "retry-after {retry_after:?}"
        );
    }
    // Nobody was called for a refused event: every call made was for a taken one.
    assert_eq!(slow.count(), taken);
    assert_eq!(other.count(), taken);
}

/// Calls that get their slot within the worker's tick period of its last tick (a subscriber
/// answering at once) are sent by the timer's wake-up: no other request comes to wake the
/// worker, and every sender still gets its 202.
#[test]
fn a_call_given_its_slot_between_two_ticks_is_sent_with_no_other_request() {
    const SENDERS: usize = 12;
    let quick = Subscriber::ok("quick");
    let config = json!({ "subscribers": [{ "cluster": "quick", "max_concurrent_calls": 1 }] });
    let envoy = Envoy::start(&config, &[&quick]);
    for reply in send_at_once(&envoy, SENDERS) {
        assert_eq!(reply.status, 202, "{}", reply.body);
    }
    assert_eq!(quick.count(), SENDERS);
}

/// A required subscriber that fails for good sends the event to its dead-letter target, and
/// one that answers with an event passes it to its reply target, while the sender waits: it
/// gets 202 once both are taken (the dead-lettered one named in its header), and the 500
/// report when the dead-letter target fails too.
#[test]
fn a_required_subscribers_dead_letter_and_reply_go_out_before_the_answer() {
    let down = Subscriber::start("down", Behavior::Status(503));
    let dl = Subscriber::ok("dl");
    let replier = Subscriber::start(
        "replier",
        Behavior::respond(
            200,
            &[
                ("ce-id", "reply-1"),
                ("ce-source", "/replier"),
                ("ce-specversion", "1.0"),
                ("ce-type", "reply"),
            ],
            "the reply",
        ),
    );
    let replies = Subscriber::ok("replies");
    let config = json!({ "subscribers": [
        { "cluster": "down", "delivery": { "retry": 1, "backoff_delay_ms": 20,
            "dead_letter": { "cluster": "dl" } } },
        { "cluster": "replier", "reply": { "cluster": "replies" } }
    ] });
    let envoy = Envoy::start(&config, &[&down, &dl, &replier, &replies]);
    let event = || {
        client()
            .post(envoy.url("/"))
            .header("ce-id", "1")
            .header("ce-source", "/native")
            .header("ce-specversion", "1.0")
            .header("ce-type", "t")
            .body("event")
    };
    let reply = send(event());
    assert_eq!(reply.status, 202, "{}", reply.body);
    // Both went out before the answer: nothing is left to come.
    assert_eq!(down.count(), 2, "the event and its retry");
    assert_eq!(dl.count(), 1);
    assert_eq!(dl.requests()[0].body, b"event".to_vec());
    assert_eq!(replies.count(), 1);
    assert_eq!(replies.requests()[0].body, b"the reply".to_vec());
    assert_eq!(header(&replies.requests()[0], "ce-id"), Some("reply-1"));

    // The dead-letter target down too: the subscriber failed, and the sender is told.
    dl.set_behavior(Behavior::Status(500));
    let reply = send(event());
    assert_eq!(reply.status, 500, "{}", reply.body);
    assert_eq!(
        reply.json()["failed"][0]["cluster"],
        "down",
        "{}",
        reply.body
    );
    // The dead letter is retried as the event is (once more): 1 + 2 calls in all.
    assert_eq!((dl.count(), replies.count()), (3, 2));
}
