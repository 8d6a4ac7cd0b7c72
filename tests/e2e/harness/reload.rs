//! Live reconfiguration the way a mounted ConfigMap delivers it: Envoy runs the shipped
//! `envoy/configmap/envoy.yaml` (the filter through ECDS, the clusters through CDS, both from
//! files in a watched directory), and the test replaces those files the way the kubelet does,
//! with an atomic flip of the `..data` symlink. The filter's file is the one
//! `fanout-control render` writes, with the test's fan-out config in it. On the native build,
//! the bootstrap takes the native build's filter and render writes it (`--build native`).
//!
//! Waits poll Envoy's admin stats with a deadline; nothing sleeps a fixed time for Envoy.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::os::unix::fs::symlink;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use super::{manifest_dir, read_shipped_yaml, Client, Envoy, TempDir};

/// The shipped bootstrap.
pub const SHIPPED_BOOTSTRAP: &str = "envoy/configmap/envoy.yaml";
/// Where the shipped bootstrap expects the ConfigMap volume.
const SHIPPED_VOLUME: &str = "/etc/fanout";

/// The ECDS stats of the filter (`name: fanout` in the bootstrap).
pub const ECDS: &str = "extension_config_discovery.http_filter.fanout";

/// A directory laid out like a kubelet ConfigMap volume:
///
/// ```text
/// ..2026_11_30_03_20_00.000000001/fanout.yaml
/// ..data -> ..2026_11_30_03_20_00.000000001
/// fanout.yaml -> ..data/fanout.yaml
/// ```
///
/// An update writes a fresh timestamped directory, points `..data_tmp` at it, renames
/// `..data_tmp` over `..data` (the atomic step) and removes the old directory, as the kubelet's
/// AtomicWriter does. Removed on drop (kept when the test fails or with `FANOUT_E2E_KEEP`).
pub struct ConfigMapVolume {
    dir: TempDir,
    seq: u64,
}

impl ConfigMapVolume {
    pub fn new() -> ConfigMapVolume {
        ConfigMapVolume {
            dir: TempDir::new("fanout-configmap", "the ConfigMap volume"),
            seq: 0,
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Replace the volume's whole content with `files` (name, content), kubelet-style.
    pub fn publish(&mut self, files: &[(&str, &str)]) {
        self.seq += 1;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let stamp = format!("..{}.{:09}_{}", now.as_secs(), now.subsec_nanos(), self.seq);
        let dir = self.dir.path().join(&stamp);
        fs::create_dir(&dir).expect("create the timestamped dir");
        for (name, content) in files {
            fs::write(dir.join(name), content).expect("write a ConfigMap key");
        }
        let data = self.dir.path().join("..data");
        let old = fs::read_link(&data).ok();
        let tmp = self.dir.path().join("..data_tmp");
        let _ = fs::remove_file(&tmp);
        symlink(&stamp, &tmp).expect("symlink ..data_tmp");
        fs::rename(&tmp, &data).expect("rename ..data_tmp over ..data");
        // The user-visible names: created once, they always point through ..data.
        for (name, _) in files {
            let link = self.dir.path().join(name);
            if fs::symlink_metadata(&link).is_err() {
                symlink(Path::new("..data").join(name), &link).expect("symlink a key");
            }
        }
        if let Some(old) = old {
            let _ = fs::remove_dir_all(self.dir.path().join(old));
        }
    }
}

impl Default for ConfigMapVolume {
    fn default() -> Self {
        ConfigMapVolume::new()
    }
}

/// The ECDS file for a fan-out config (JSON text, passed as is), pointing at the built filter.
///
/// `fanout-control render` runs once per test process; the `fanout.yaml` it writes is the
/// template, and each config goes into the one field that carries it, with `version_info`
/// made unique for it. `render_writes_the_ecds_file_the_tests_use` checks that this equals
/// what render writes for the same config.
pub fn render_filter(fanout_config: &str) -> String {
    static TEMPLATE: OnceLock<Value> = OnceLock::new();
    let template = TEMPLATE.get_or_init(|| rendered_filter().0);
    let mut document = template.clone();
    *plugin_value(&mut document) = json!(fanout_config.trim());
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    std::hash::Hash::hash(fanout_config.trim(), &mut hasher);
    document["version_info"] = json!(format!("{:016x}", std::hash::Hasher::finish(&hasher)));
    serde_json::to_string_pretty(&document).expect("serialize")
}

/// The field of an ECDS file (`fanout.yaml`) that carries the fan-out config: the wasm
/// filter's plugin configuration, or the native build's `filter_config`.
fn plugin_value(document: &mut Value) -> &mut Value {
    let filter = &mut document["resources"][0]["typed_config"];
    if filter["@type"] == super::NATIVE_TYPE {
        &mut filter["filter_config"]["value"]
    } else {
        &mut filter["config"]["configuration"]["value"]
    }
}

/// `fanout.yaml` as `fanout-control render` writes it for one small InMemoryChannel, with
/// the built filter (`--wasm <built filter>`, or on the native build `--build native`), and
/// the fan-out config it carries.
pub fn rendered_filter() -> (Value, String) {
    let dir = TempDir::new("fanout-render-template", "the rendered filter");
    let channel = json!({
        "apiVersion": "messaging.knative.dev/v1", "kind": "InMemoryChannel",
        "metadata": { "name": "template", "namespace": "default" },
        "spec": { "subscribers": [{ "subscriberUri": "http://billing.default.svc.cluster.local/events" }] },
        "status": { "address": { "url": "http://template-kn-channel.default.svc.cluster.local" } }
    });
    let out = dir.path().join("out");
    let build: Vec<String> = super::control::build_args(&[])
        .into_iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let build: Vec<&str> = build.iter().map(String::as_str).collect();
    let (code, _, err) =
        super::control::render_objects(dir.path(), &channel.to_string(), &out, &build);
    assert_eq!(code, 0, "fanout-control render failed: {err}");
    let text = fs::read_to_string(out.join("fanout.yaml")).expect("render wrote fanout.yaml");
    let mut document: Value = serde_json::from_str(&text).expect("render writes JSON");
    let config = plugin_value(&mut document)
        .as_str()
        .expect("the filter carries its config")
        .to_owned();
    (document, config)
}

/// The CDS file: one STATIC cluster per (name, port) on 127.0.0.1.
pub fn render_clusters(clusters: &[(&str, u16)]) -> String {
    let resources: Vec<Value> = clusters
        .iter()
        .map(|(name, port)| {
            json!({
                "@type": "type.googleapis.com/envoy.config.cluster.v3.Cluster",
                "name": name,
                "type": "STATIC",
                "connect_timeout": "1s",
                "load_assignment": { "cluster_name": name, "endpoints": [{ "lb_endpoints": [{
                    "endpoint": { "address": { "socket_address": {
                        "address": "127.0.0.1", "port_value": port } } } }] }] }
            })
        })
        .collect();
    let document =
        json!({ "version_info": format!("{:x}", resources.len()), "resources": resources });
    serde_json::to_string_pretty(&document).expect("serialize")
}

/// The shipped bootstrap, as JSON, with the ConfigMap paths moved to `volume`, the listener
/// and the admin on loopback with ports of the kernel's choosing.
pub fn shipped_bootstrap(volume: &Path) -> Value {
    shipped_bootstrap_from(SHIPPED_BOOTSTRAP, volume)
}

/// The same for another shipped ConfigMap bootstrap (`rel`, e.g. the one with sender
/// authorization), which must use the same volume path and name its listener `ingress`.
/// Every listener moves to loopback with a port of the kernel's choosing; the admin to a
/// free loopback port, and the static clusters that reach the admin (the `admin_read`
/// listener's) with it.
pub fn shipped_bootstrap_from(rel: &str, volume: &Path) -> Value {
    let mut bootstrap = read_shipped_yaml(rel);
    super::native_ecds(&mut bootstrap);
    move_volume(&mut bootstrap, &volume.to_string_lossy());
    let shipped_admin = bootstrap["admin"]["address"]["socket_address"]["port_value"].clone();
    let admin_port = super::free_ports(1)[0];
    bootstrap["admin"]["address"] =
        json!({ "socket_address": { "address": "127.0.0.1", "port_value": admin_port } });
    if let Some(clusters) = bootstrap["static_resources"]["clusters"].as_array_mut() {
        for cluster in clusters {
            for group in cluster["load_assignment"]["endpoints"]
                .as_array_mut()
                .unwrap()
            {
                for endpoint in group["lb_endpoints"].as_array_mut().unwrap() {
                    let address = &mut endpoint["endpoint"]["address"]["socket_address"];
                    if address["port_value"] == shipped_admin {
                        address["port_value"] = json!(admin_port);
                    }
                }
            }
        }
    }
    let loopback = json!({ "socket_address": { "address": "127.0.0.1", "port_value": 0 } });
    let listeners = bootstrap["static_resources"]["listeners"]
        .as_array_mut()
        .expect("the shipped bootstrap has static listeners");
    assert!(
        listeners.iter().any(|l| l["name"] == "ingress"),
        "{rel}: the harness finds the listener by the name `ingress`"
    );
    for listener in listeners.iter_mut() {
        listener["address"] = loopback.clone();
    }
    bootstrap
}

fn move_volume(v: &mut Value, to: &str) {
    match v {
        Value::String(s) => {
            if s == SHIPPED_VOLUME {
                *s = to.to_owned();
            } else if let Some(rest) = s.strip_prefix(&format!("{SHIPPED_VOLUME}/")) {
                *s = format!("{to}/{rest}");
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|i| move_volume(i, to)),
        Value::Object(fields) => fields.values_mut().for_each(|f| move_volume(f, to)),
        _ => {}
    }
}

/// Envoy on the shipped ConfigMap bootstrap, with the volume it watches. Envoy is declared
/// first: it stops before the volume is removed. Everything an [`Envoy`] offers (its URL, log,
/// stats) is there through `Deref`.
pub struct ReloadEnvoy {
    pub envoy: Envoy,
    volume: ConfigMapVolume,
    filter: String,
    clusters: String,
}

impl std::ops::Deref for ReloadEnvoy {
    type Target = Envoy;

    fn deref(&self) -> &Envoy {
        &self.envoy
    }
}

/// How Envoy took an update of the filter's file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Update {
    Accepted,
    Rejected,
}

impl ReloadEnvoy {
    /// Publish the first files, then start Envoy on them.
    pub fn start(fanout_config: &str, clusters: &[(&str, u16)]) -> ReloadEnvoy {
        let me = ReloadEnvoy::start_unconfigured(fanout_config, clusters);
        assert!(
            me.stat(&format!("{ECDS}.update_success"))
                .is_some_and(|n| n >= 1),
            "Envoy is ready but has not loaded the filter's file"
        );
        me
    }

    /// Like `start`, without requiring that Envoy took the filter's file (for a first file
    /// Envoy refuses).
    pub fn start_unconfigured(fanout_config: &str, clusters: &[(&str, u16)]) -> ReloadEnvoy {
        ReloadEnvoy::start_on_files(render_filter(fanout_config), render_clusters(clusters))
    }

    /// Publish these two files as they are (the ECDS `fanout.yaml` and the CDS `clusters.yaml`,
    /// e.g. as `fanout-control render` wrote them), then start Envoy on them. As with
    /// `start_unconfigured`, whether Envoy took the filter's file is for the caller to check.
    pub fn start_on_files(filter: String, clusters: String) -> ReloadEnvoy {
        if super::fanout_build() == super::Build::Native && filter.contains(super::WASM_TYPE) {
            super::skip_on_native(
                "the filter's file Envoy is given (fanout.yaml) is the wasm filter: a shipped \
                 one, not one render writes for the native build",
            );
        }
        let mut volume = ConfigMapVolume::new();
        volume.publish(&[("fanout.yaml", &filter), ("clusters.yaml", &clusters)]);
        let bootstrap = shipped_bootstrap(volume.path());
        let mut builder = Envoy::builder();
        for key in [
            "node",
            "admin",
            "stats_config",
            "dynamic_resources",
            "static_resources",
        ] {
            builder = builder.bootstrap_field(key, bootstrap[key].clone());
        }
        ReloadEnvoy {
            envoy: builder.start(),
            volume,
            filter,
            clusters,
        }
    }

    /// Flip the volume to the current files (both keys, as one ConfigMap update does).
    fn flip(&mut self) {
        let (filter, clusters) = (self.filter.clone(), self.clusters.clone());
        self.volume
            .publish(&[("fanout.yaml", &filter), ("clusters.yaml", &clusters)]);
    }

    /// Replace the fan-out config (a new ECDS file) without waiting for Envoy.
    pub fn publish_filter(&mut self, fanout_config: &str) {
        self.filter = render_filter(fanout_config);
        self.flip();
    }

    /// Replace the fan-out config and wait (bounded) until Envoy has taken or refused it.
    pub fn swap_filter(&mut self, fanout_config: &str, timeout: Duration) -> Update {
        let before = self.ecds_outcomes();
        self.publish_filter(fanout_config);
        self.wait_ecds_after(before, timeout)
    }

    /// Replace the clusters (a new CDS file) and wait (bounded) until Envoy applied it.
    pub fn swap_clusters(&mut self, clusters: &[(&str, u16)], timeout: Duration) {
        let before = self.stat("cluster_manager.cds.update_success").unwrap_or(0);
        self.clusters = render_clusters(clusters);
        self.flip();
        self.expect_stat(
            "cluster_manager.cds.update_success",
            |v| v > before,
            timeout,
        );
    }

    /// (update_success, update_rejected) of the filter's ECDS subscription.
    pub fn ecds_outcomes(&self) -> (u64, u64) {
        let stats = self.stats(ECDS);
        let count = |name: &str| stats.get(&format!("{ECDS}.{name}")).copied().unwrap_or(0);
        (count("update_success"), count("update_rejected"))
    }

    /// Wait until the ECDS subscription has processed an update after `before`.
    pub fn wait_ecds_after(&self, before: (u64, u64), timeout: Duration) -> Update {
        let deadline = Instant::now() + timeout;
        loop {
            let now = self.ecds_outcomes();
            if now.1 > before.1 {
                return Update::Rejected;
            }
            if now.0 > before.0 {
                return Update::Accepted;
            }
            if Instant::now() > deadline {
                panic!(
                    "Envoy did not process the new filter file within {timeout:?} \
                     ({ECDS}.update_success/update_rejected still {now:?}). Log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Calls `probe` until it returns true `n` times in a row; false if that did not happen
/// within `timeout`. Envoy applies a new filter config on the main thread first and then on
/// each worker: a few requests may still meet the old one right after the stat moved.
pub fn until_consecutive(n: usize, timeout: Duration, mut probe: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    let mut streak = 0;
    while Instant::now() < deadline {
        if probe() {
            streak += 1;
            if streak >= n {
                return true;
            }
        } else {
            streak = 0;
        }
    }
    false
}

/// Continuous load: `threads` senders, each with its own keep-alive connection, together
/// about `rate` requests/s, until stopped, `max_requests` sent or `max_time` passed.
/// Transport errors are recorded, not raised. Stopped and joined on drop.
pub struct Load {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    threads: Vec<JoinHandle<Vec<Outcome>>>,
    started: Instant,
}

/// One load request: the status, or the transport error (as status 0), and the answer's body.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub status: u16,
    pub body: String,
}

/// What the load saw.
#[derive(Debug)]
pub struct LoadReport {
    pub total: usize,
    pub by_status: BTreeMap<u16, usize>,
    /// Up to 10 answers that were not 202 (status 0: transport error).
    pub failures: Vec<Outcome>,
    pub elapsed: Duration,
}

impl LoadReport {
    pub fn rate(&self) -> f64 {
        self.total as f64 / self.elapsed.as_secs_f64().max(1e-3)
    }
}

impl Load {
    pub fn start(
        url: &str,
        threads: usize,
        rate: f64,
        max_requests: u64,
        max_time: Duration,
    ) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let interval = Duration::from_secs_f64(threads as f64 / rate);
        let threads = (0..threads)
            .map(|t| {
                let (stop, sent, url) = (stop.clone(), sent.clone(), url.to_owned());
                std::thread::Builder::new()
                    .name(format!("load-{t}"))
                    .spawn(move || {
                        let client = Client::http1();
                        let mut outcomes = Vec::new();
                        let mut next = Instant::now();
                        while !stop.load(Ordering::SeqCst) && started.elapsed() < max_time {
                            if sent.fetch_add(1, Ordering::SeqCst) >= max_requests {
                                break;
                            }
                            let result = client
                                .post(&url)
                                .header("content-type", "application/json")
                                .body(format!("{{\"load\":{t}}}"))
                                .send()
                                .and_then(|r| {
                                    let status = r.status().as_u16();
                                    r.text().map(|body| Outcome { status, body })
                                });
                            outcomes.push(result.unwrap_or_else(|e| Outcome {
                                status: 0,
                                body: format!("{e} ({e:?})"),
                            }));
                            // Pacing, not waiting for Envoy: keeps the rate bounded.
                            next += interval;
                            let now = Instant::now();
                            if next > now {
                                std::thread::sleep(next - now);
                            } else {
                                next = now;
                            }
                        }
                        outcomes
                    })
                    .expect("spawn a load thread")
            })
            .collect();
        Load {
            stop,
            sent,
            threads,
            started,
        }
    }

    /// How many requests were started so far.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::SeqCst)
    }

    /// Stop, join, and report.
    pub fn finish(mut self) -> LoadReport {
        self.stop.store(true, Ordering::SeqCst);
        let mut report = LoadReport {
            total: 0,
            by_status: BTreeMap::new(),
            failures: Vec::new(),
            elapsed: Duration::ZERO,
        };
        for t in std::mem::take(&mut self.threads) {
            for o in t.join().unwrap_or_default() {
                report.total += 1;
                *report.by_status.entry(o.status).or_default() += 1;
                if o.status != 202 && report.failures.len() < 10 {
                    report.failures.push(o);
                }
            }
        }
        report.elapsed = self.started.elapsed();
        report
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in std::mem::take(&mut self.threads) {
            let _ = t.join();
        }
    }
}
