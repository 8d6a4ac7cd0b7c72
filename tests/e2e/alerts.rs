//! The shipped Prometheus rules and Grafana dashboard on a real Prometheus that scrapes a
//! real Envoy running fanout on the shipped ConfigMap bootstrap (its `stats_tags`, live
//! reconfiguration, the read-only `admin_read` listener that the scrape goes through): a subscriber that fails makes the shipped alerts fire for it, read back
//! from Prometheus' API; a configuration the filter refuses fires its alert; every query of
//! every dashboard panel finds series.
//!
//! Prometheus scrapes and evaluates every 500 ms. The rules are the shipped file with every
//! alert's `for:` set to 0 (how long a condition must hold is `promtool test rules`' part:
//! `make test-rules`); the expressions, labels and thresholds are the shipped ones.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::control::{xds_envoy, Control};
use harness::prometheus::{Job, Prometheus, Setup};
use harness::reload::{ReloadEnvoy, Update};
use harness::{
    free_ports, read_shipped, read_shipped_yaml, send, Behavior, Client, Subscriber, TempDir,
};
use serde_json::{json, Value};

const RULES: &str = "deploy/prometheus/fanout-rules.yaml";
const DASHBOARD: &str = "deploy/grafana/fanout-dashboard.json";
const JOB: &str = "fanout";
const FIRE_TIMEOUT: Duration = Duration::from_secs(60);
const CONTROL_RULES: &str = "deploy/prometheus/fanout-control-rules.yaml";
const CONTROL_DASHBOARD: &str = "deploy/grafana/fanout-control-dashboard.json";
const CONTROL_JOB: &str = "fanout-control";

/// The shipped rules with every alert's `for` at 0.
fn rules_without_for() -> Value {
    shipped_rules_without_for(RULES)
}

/// A shipped rules file with every alert's `for` at 0.
fn shipped_rules_without_for(rel: &str) -> Value {
    let mut rules = read_shipped_yaml(rel);
    for group in rules["groups"].as_array_mut().expect("groups") {
        for rule in group["rules"].as_array_mut().expect("rules") {
            if rule.get("for").is_some() {
                rule["for"] = json!("0s");
            }
        }
    }
    rules
}

/// A sender that keeps sending CloudEvents (and now and then a GET, which fanout answers
/// 405) until dropped, as a steady producer does.
struct Sender {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sender {
    fn start(url: String) -> Sender {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let (s, n) = (stop.clone(), sent.clone());
        let thread = std::thread::spawn(move || {
            let client = Client::http1();
            while !s.load(Ordering::Relaxed) {
                let i = n.fetch_add(1, Ordering::Relaxed);
                let event = client
                    .post(&url)
                    .header("ce-specversion", "1.0")
                    .header("ce-type", "com.example.order")
                    .header("ce-source", "/e2e/alerts")
                    .header("ce-id", format!("event-{i}"))
                    .header("content-type", "application/json")
                    .body("{}");
                send(event);
                if i % 10 == 0 {
                    send(client.get(&url));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        Sender {
            stop,
            sent,
            thread: Some(thread),
        }
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Waits (bounded) until an alert named `name` whose labels include `labels` fires.
fn wait_firing(prometheus: &Prometheus, name: &str, labels: &[(&str, &str)]) -> Value {
    let deadline = Instant::now() + FIRE_TIMEOUT;
    loop {
        let alerts = prometheus.alerts();
        let found = alerts.iter().find(|a| {
            a["state"] == "firing"
                && a["labels"]["alertname"] == name
                && labels.iter().all(|(k, v)| a["labels"][*k] == *v)
        });
        if let Some(alert) = found {
            return alert.clone();
        }
        assert!(
            Instant::now() < deadline,
            "{name} {labels:?} did not fire within {FIRE_TIMEOUT:?}; alerts: {alerts:#?}\n\
             targets: {:#?}",
            prometheus.targets()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Every panel query of the shipped dashboard, its variables set for this Prometheus.
fn dashboard_queries() -> Vec<(String, String)> {
    shipped_dashboard_queries(DASHBOARD, JOB)
}

/// Every panel query of a shipped dashboard, its variables set for `job` here.
fn shipped_dashboard_queries(rel: &str, job: &str) -> Vec<(String, String)> {
    let dashboard: Value = serde_json::from_str(&read_shipped(rel)).expect("JSON");
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        if panel["type"] == "row" {
            continue;
        }
        let targets = panel["targets"].as_array().expect("a panel with targets");
        assert!(!targets.is_empty(), "panel {} has no query", panel["title"]);
        for target in targets {
            let expr = target["expr"].as_str().expect("expr");
            let expr = expr
                .replace("$__rate_interval", "1m")
                .replace("$job", job)
                .replace("$instance", ".*");
            queries.push((panel["title"].as_str().unwrap_or("").to_owned(), expr));
        }
    }
    queries
}

#[test]
fn a_failing_subscriber_fires_the_shipped_alerts_and_every_panel_has_data() {
    let steady = Subscriber::ok("steady");
    let flaky = Subscriber::start("flaky", Behavior::Status(503));
    let config = json!({
        "dedupe": {},
        "subscribers": [
            { "cluster": "steady", "max_concurrent_calls": 16 },
            { "cluster": "flaky" }
        ]
    })
    .to_string();
    let clusters = [("steady", steady.port()), ("flaky", flaky.port())];
    let mut envoy = ReloadEnvoy::start(&config, &clusters);
    let prometheus = Prometheus::start(&Setup {
        job: JOB,
        // What the Deployment's scrape annotations name: port 9902, the read-only listener.
        targets: vec![envoy.listener_addr("admin_read")],
        rules: vec![rules_without_for()],
        interval: Duration::from_millis(500),
    });
    let sender = Sender::start(envoy.url("/"));
    // The read-only listener passes the two pages and nothing else of the admin.
    let read_only = format!("http://{}", envoy.listener_addr("admin_read"));
    assert_eq!(
        send(Client::http1().get(&format!("{read_only}/ready"))).status,
        200
    );
    for (method, path) in [
        ("GET", "/stats"),
        ("POST", "/drain_listeners"),
        ("POST", "/quitquitquit"),
    ] {
        let url = format!("{read_only}{path}");
        let request = if method == "GET" {
            Client::http1().get(&url)
        } else {
            Client::http1().post(&url)
        };
        assert_eq!(
            send(request).status,
            404,
            "{method} {path} through admin_read"
        );
    }

    let alert = wait_firing(
        &prometheus,
        "FanoutSubscriberErrors",
        &[("fanout_cluster", "flaky"), ("job", JOB)],
    );
    assert_eq!(alert["labels"]["severity"], "warning", "{alert:#}");
    wait_firing(&prometheus, "FanoutEventsFailing", &[("job", JOB)]);
    // Only the failing subscriber is named.
    assert!(
        !prometheus
            .alerts()
            .iter()
            .any(|a| a["labels"]["fanout_cluster"] == "steady"),
        "{:#?}",
        prometheus.alerts()
    );
    // The recording rule behind it: every call to flaky fails, none to steady (rate()
    // extrapolates each counter from its own samples: about 1, not exactly).
    let ratio = |cluster: &str| -> f64 {
        let result = prometheus.query(&format!(
            "job_fanout_cluster:fanout_subscriber_error_ratio:rate5m{{fanout_cluster=\"{cluster}\"}}"
        ));
        assert_eq!(result.len(), 1, "{cluster}: {result:#?}");
        result[0]["value"][1].as_str().unwrap().parse().unwrap()
    };
    let flaky_ratio = ratio("flaky");
    assert!((0.8..1.25).contains(&flaky_ratio), "flaky: {flaky_ratio}");
    assert_eq!(ratio("steady"), 0.0);

    // A configuration the filter refuses: Envoy keeps the old one, and the alert fires.
    assert_eq!(
        envoy.swap_filter(r#"{"subscribers": 5}"#, Duration::from_secs(20)),
        Update::Rejected
    );
    wait_firing(&prometheus, "FanoutConfigRefused", &[("job", JOB)]);

    for (title, expr) in dashboard_queries() {
        let result = prometheus.query(&expr);
        assert!(
            !result.is_empty(),
            "dashboard panel {title:?}: no series for {expr}"
        );
    }
    for selector in [
        "fanout_requests_received",
        "fanout_requests_received{job=\"fanout\"}",
    ] {
        assert!(!prometheus.series(selector).is_empty(), "{selector}");
    }
    assert!(sender.sent.load(Ordering::Relaxed) > 0);
}

/// An InMemoryChannel `default/<name>` (host `<name>.example`) with one subscriber entry
/// (its URI, and more fields as YAML flow text).
fn knative_channel(name: &str, uri: &str, more: &str) -> String {
    format!(
        "apiVersion: messaging.knative.dev/v1\nkind: InMemoryChannel\nmetadata: {{name: {name}, namespace: default}}\n\
         spec:\n  subscribers:\n    - {{subscriberUri: '{uri}'{more}}}\nstatus:\n  address: {{url: 'http://{name}.example'}}\n"
    )
}

/// The control plane's metrics on a real Prometheus, beside the Envoy it configures (on the
/// shipped `envoy/xds/envoy.yaml`, whose tag rules label fanout's series): a version the
/// Envoy refuses fires FanoutControlNack naming the Envoy, a channel that never mapped fires
/// FanoutControlChannelsNotServed, and every panel of the control plane's dashboard finds
/// series.
#[test]
fn the_control_plane_is_scraped_and_a_nack_fires_its_alert() {
    let dir = TempDir::new("fanout-control-src", "the source directory");
    let billing = Subscriber::ok("billing");
    let write = |name: &str, text: &str| {
        let tmp = dir.path().join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, dir.path().join(name)).unwrap();
    };
    let billing_uri = format!("http://127.0.0.1:{}/", billing.port());
    write("orders.yaml", &knative_channel("orders", &billing_uri, ""));
    let control = Control::start(dir.path(), free_ports(1)[0]);
    let envoy = xds_envoy("e1", control.xds_port).start();
    let prometheus = Prometheus::start_with_jobs(
        &Setup {
            job: JOB,
            targets: vec![envoy.admin_addr()],
            rules: vec![
                rules_without_for(),
                shipped_rules_without_for(CONTROL_RULES),
            ],
            interval: Duration::from_millis(500),
        },
        &[Job {
            name: CONTROL_JOB,
            targets: vec![format!("127.0.0.1:{}", control.http_port).parse().unwrap()],
            path: "/metrics",
        }],
    );
    let client = Client::http1_resolving("orders.example", envoy.addr());
    let url = format!("http://orders.example:{}/", envoy.port());
    let event = client
        .post(&url)
        .header("ce-specversion", "1.0")
        .header("ce-type", "com.example.order")
        .header("ce-source", "/e2e/alerts")
        .header("ce-id", "control-1")
        .header("content-type", "application/json")
        .body("{}");
    assert_eq!(send(event).status, 202);

    // The ACKs are scraped, and no alert fires for a healthy control plane.
    let deadline = Instant::now() + FIRE_TIMEOUT;
    while prometheus
        .query(r#"fanout_control_acks_total{node="e1",kind="filter"}"#)
        .is_empty()
    {
        assert!(Instant::now() < deadline, "{:#?}", prometheus.targets());
        std::thread::sleep(Duration::from_millis(200));
    }
    // (An alert may fire for the instant before the first ACK: it must go.)
    while prometheus
        .alerts()
        .iter()
        .any(|a| a["labels"]["job"] == CONTROL_JOB)
    {
        assert!(
            Instant::now() < deadline,
            "alerts on a healthy control plane: {:#?}",
            prometheus.alerts()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The Envoy's series carry the subscriber's cluster as a label (the bootstrap's tags),
    // once Prometheus has scraped the Envoy after the event (its own scrape interval).
    let mut calls = prometheus.query("fanout_subscriber_calls");
    while calls.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        calls = prometheus.query("fanout_subscriber_calls");
    }
    assert!(
        calls
            .iter()
            .any(|s| s["metric"]["fanout_cluster"].is_string()),
        "{calls:#?}"
    );

    // An https subscriber whose CA certificates are not PEM: it maps, and the Envoy refuses
    // the cluster.
    write(
        "tls.yaml",
        &knative_channel(
            "tls",
            "https://127.0.0.1:1/",
            ", subscriberCACerts: 'not a certificate'",
        ),
    );
    let alert = wait_firing(
        &prometheus,
        "FanoutControlNack",
        &[("node", "e1"), ("job", CONTROL_JOB)],
    );
    assert_eq!(alert["labels"]["severity"], "critical", "{alert:#}");
    // A channel that never mapped.
    write(
        "bad.yaml",
        &knative_channel("bad", "ftp://127.0.0.1:1/", ""),
    );
    wait_firing(
        &prometheus,
        "FanoutControlChannelsNotServed",
        &[("job", CONTROL_JOB)],
    );

    // Every fanout_control_* name the docs, the rules and the dashboard use is one the
    // server serves (its family: a counter's _total, a histogram's _bucket, _count, _sum).
    let (code, exposition) = control.get("/metrics").expect("GET /metrics");
    assert_eq!(code, 200);
    for rel in ["docs/metrics.md", CONTROL_RULES, CONTROL_DASHBOARD] {
        let text = read_shipped(rel);
        let names = text
            .split(|c: char| {
                !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == ':')
            })
            .filter(|w| w.starts_with("fanout_control_") && !w.contains(':') && !w.ends_with('_'));
        // Status writes come from a source that writes status (not the directory's).
        for name in names.filter(|n| *n != "fanout_control_status_writes_total") {
            let family = ["_total", "_bucket", "_count", "_sum"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .unwrap_or(name);
            assert!(
                exposition.contains(&format!("# TYPE {family} ")),
                "{rel}: {name} is not served by fanout-control:\n{exposition}"
            );
        }
    }
    for (title, expr) in shipped_dashboard_queries(CONTROL_DASHBOARD, CONTROL_JOB) {
        let result = prometheus.query(&expr);
        assert!(
            !result.is_empty(),
            "control dashboard panel {title:?}: no series for {expr}"
        );
    }
}
