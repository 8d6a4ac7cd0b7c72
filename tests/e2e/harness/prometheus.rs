//! A real Prometheus on loopback (`PROMETHEUS_BIN`, Debian's `prometheus` package: `make
//! prometheus`), in its own process group, its data in a temp dir, stopped (SIGKILL) when the
//! guard drops. It scrapes the given targets' `/stats/prometheus` under one job and
//! evaluates the given rule files; its HTTP API is read with [`Prometheus::query`] and
//! [`Prometheus::alerts`].
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::fs;
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
use serde_json::{json, Value};

use super::{free_ports, TempDir};

/// The Prometheus binary: `PROMETHEUS_BIN`, else `prometheus` on the PATH. Missing is a
/// failure with the how-to, not a skip.
pub fn prometheus_bin() -> PathBuf {
    let bin = std::env::var_os("PROMETHEUS_BIN")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("PATH").and_then(|paths| {
                std::env::split_paths(&paths)
                    .map(|dir| dir.join("prometheus"))
                    .find(|candidate| candidate.is_file())
            })
        })
        .expect("no Prometheus: run `make prometheus` (Debian: apt-get install prometheus)");
    assert!(
        bin.exists(),
        "PROMETHEUS_BIN {} does not exist",
        bin.display()
    );
    bin
}

/// What Prometheus scrapes and evaluates, and how often.
pub struct Setup<'a> {
    /// The `job` label of every scraped series.
    pub job: &'a str,
    /// Addresses serving Envoy's `/stats/prometheus` (the admin, or a listener routing to it).
    pub targets: Vec<SocketAddr>,
    /// Rule files, as JSON documents (Prometheus reads YAML, of which JSON is a part).
    pub rules: Vec<Value>,
    pub interval: Duration,
}

/// One more scrape job, beside [`Setup`]'s.
pub struct Job<'a> {
    pub name: &'a str,
    pub targets: Vec<SocketAddr>,
    /// The path of the metrics page (Envoy's is `/stats/prometheus`).
    pub path: &'a str,
}

pub struct Prometheus {
    child: Option<Child>,
    port: u16,
    dir: TempDir,
}

impl Prometheus {
    /// Started and ready (`/-/ready`); its first scrape may not have happened yet.
    pub fn start(setup: &Setup) -> Prometheus {
        Prometheus::start_with_jobs(setup, &[])
    }

    /// [`Prometheus::start`], scraping `more` too (e.g. fanout-control's `/metrics`).
    pub fn start_with_jobs(setup: &Setup, more: &[Job]) -> Prometheus {
        let dir = TempDir::new("fanout-prometheus", "Prometheus' config, data and log");
        let interval = format!("{}ms", setup.interval.as_millis());
        let mut rule_files = Vec::new();
        for (i, rules) in setup.rules.iter().enumerate() {
            let path = dir.path().join(format!("rules-{i}.yaml"));
            fs::write(&path, serde_json::to_string_pretty(rules).unwrap()).unwrap();
            rule_files.push(path.to_string_lossy().into_owned());
        }
        let targets: Vec<String> = setup.targets.iter().map(ToString::to_string).collect();
        let mut envoys = json!({
            "job_name": setup.job,
            "metrics_path": "/stats/prometheus",
            "scrape_timeout": interval,
            "static_configs": [{ "targets": targets }]
        });
        if super::fanout_build() == super::Build::Native {
            // docs/native.md's rule: the native build's series under the wasm build's names,
            // which the shipped rules and dashboards use.
            envoys["metric_relabel_configs"] = json!([{
                "source_labels": ["__name__"],
                "regex": "envoy_dynamicmodulescustom_(fanout_.*)",
                "target_label": "__name__",
                "replacement": "$1"
            }]);
        }
        let mut jobs = vec![envoys];
        for job in more {
            let targets: Vec<String> = job.targets.iter().map(ToString::to_string).collect();
            jobs.push(json!({
                "job_name": job.name,
                "metrics_path": job.path,
                "scrape_timeout": interval,
                "static_configs": [{ "targets": targets }]
            }));
        }
        let config = json!({
            "global": { "scrape_interval": interval, "evaluation_interval": interval },
            "rule_files": rule_files,
            "scrape_configs": jobs
        });
        let config_path = dir.path().join("prometheus.yml");
        fs::write(&config_path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
        let port = free_ports(1)[0];
        let log = fs::File::create(dir.path().join("prometheus.log")).unwrap();
        let mut command = Command::new(prometheus_bin());
        command
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .process_group(0);
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("starting Prometheus: {e}"));
        let me = Prometheus {
            child: Some(child),
            port,
            dir,
        };
        me.wait_ready();
        me
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(reply) = self.get("/-/ready") {
                if reply.status().is_success() {
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "Prometheus is not ready after 30 s; its log:\n{}",
            self.log()
        );
    }

    fn get(&self, path: &str) -> reqwest::Result<reqwest::blocking::Response> {
        reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()?
            .get(format!("http://127.0.0.1:{}{path}", self.port))
            .send()
    }

    /// `GET path` of the HTTP API: its `data`, after checking `"status": "success"`.
    fn api(&self, path: &str) -> Value {
        let reply = self
            .get(path)
            .unwrap_or_else(|e| panic!("GET {path} from Prometheus: {e}"));
        let text = reply.text().unwrap_or_else(|e| panic!("GET {path}: {e}"));
        let body: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("GET {path}: {e}: {text}"));
        assert_eq!(body["status"], "success", "GET {path}: {body}");
        body["data"].clone()
    }

    /// An instant query now: the `result` vector (each `{"metric": {...}, "value": [t, "v"]}`).
    pub fn query(&self, promql: &str) -> Vec<Value> {
        let encoded = utf8_percent_encode(promql, NON_ALPHANUMERIC);
        let data = self.api(&format!("/api/v1/query?query={encoded}"));
        assert_eq!(data["resultType"], "vector", "{promql}: {data}");
        data["result"].as_array().cloned().unwrap_or_default()
    }

    /// The series names matching a selector (`/api/v1/series`).
    pub fn series(&self, selector: &str) -> Vec<Value> {
        let encoded = utf8_percent_encode(selector, NON_ALPHANUMERIC);
        let data = self.api(&format!("/api/v1/series?match[]={encoded}"));
        data.as_array().cloned().unwrap_or_default()
    }

    /// Every alert pending or firing now (`/api/v1/alerts`).
    pub fn alerts(&self) -> Vec<Value> {
        self.api("/api/v1/alerts")["alerts"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The health of the scrape targets (`/api/v1/targets`, active ones).
    pub fn targets(&self) -> Vec<Value> {
        self.api("/api/v1/targets")["activeTargets"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if std::thread::panicking() {
                eprintln!("--- Prometheus' log ---\n{}\n---", self.log());
            }
            // SAFETY: signalling the process group we created; no memory is involved.
            unsafe {
                libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL);
            }
            let _ = child.wait();
        }
    }
}
