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

use harness::prometheus::{Prometheus, Setup};
use harness::reload::{ReloadEnvoy, Update};
use harness::{read_shipped, read_shipped_yaml, send, Behavior, Client, Subscriber};
use serde_json::{json, Value};

const RULES: &str = "deploy/prometheus/fanout-rules.yaml";
const DASHBOARD: &str = "deploy/grafana/fanout-dashboard.json";
const JOB: &str = "fanout";
const FIRE_TIMEOUT: Duration = Duration::from_secs(60);

/// The shipped rules with every alert's `for` at 0.
fn rules_without_for() -> Value {
    let mut rules = read_shipped_yaml(RULES);
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
    let dashboard: Value = serde_json::from_str(&read_shipped(DASHBOARD)).expect("JSON");
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
                .replace("$job", JOB)
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
