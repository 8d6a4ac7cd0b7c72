//! End-to-end harness: the real Envoy with the built `fanout.wasm`, subscriber servers on
//! loopback whose behaviour each test sets, and an HTTP client (HTTP/1.1 or h2c).
//!
//! Every process and thread a test starts belongs to a guard that stops it on drop, also when
//! the test panics. Everything binds port 0 and has a unique name, so tests run in parallel.
//! A missing Envoy or filter is a failure with a how-to, never a skip.
//!
//! Used from each test crate with `mod harness;`; not every crate uses every part. What it
//! offers, by task:
//!
//! | to ... | use |
//! | --- | --- |
//! | start Envoy with the filter and a cluster per subscriber | [`Envoy::with_subscribers`]`(&config, &[&a, &b])`, [`Envoy::with_clusters`]`(&config, &[("a", port)])` |
//! | start it with more (log level, route, buffer limit, bootstrap fields, other HTTP filters, a cluster's circuit breakers, the number of workers) | [`Envoy::builder`]`()` ([`EnvoyBuilder`]): `.fanout(&config)`, `.subscribers(..)`, `.clusters(..)`, `.cluster(name, port)`, `.cluster_field(name, field, value)`, `.concurrency(workers)`, ..., `.start()` |
//! | check that Envoy refuses a config | [`EnvoyBuilder::start_expecting_failure`] (exit status and log) |
//! | check a bootstrap with `envoy --mode validate` | [`validate_config`]`(text, what)`, [`EnvoyBuilder::validate`] |
//! | find Envoy and the filter | [`envoy_bin`], [`wasm_path`] (`ENVOY_BIN`, `FANOUT_WASM`); [`body_wait`] (`FANOUT_E2E_BODY_WAIT`) |
//! | run the suite on the native build | `FANOUT_BUILD=native` ([`fanout_build`]): the filter the harness writes is the dynamic module [`native_lib_path`]; a test whose configuration it refuses, or whose bootstrap loads the wasm module anyway, ends with [`NATIVE_SKIP`] before Envoy starts; fanout's stats are read under the wasm build's names |
//! | read Envoy's log | [`Envoy::log`], [`Envoy::wait_for_log`]; fanout's own lines on either build: [`filter_log_lines`] |
//! | read Envoy's stats | [`Envoy::stat`]`(name) -> Option<u64>`, [`Envoy::stats`]`(prefix)`, [`Envoy::text_stat`], [`Envoy::stats_text`], [`Envoy::prometheus`]`(prefix)` |
//! | wait (bounded) for a stat | [`Envoy::wait_for_stat`]`(name, pred, timeout)` (last value), [`Envoy::expect_stat`] (panics), [`Envoy::wait_for_stats`]`(prefix, pred, timeout)` |
//! | check a wait Envoy timed; poll anything with a deadline | [`timing::assert_waited_at_least`], [`timing::assert_waited_about`] (Envoy's coarse timer clock), [`timing::poll_until`] |
//! | read Envoy's memory | [`Envoy::rss_kib`], [`Envoy::heap_allocated`] |
//! | run subscribers | [`Subscriber::ok`]`(name)`, [`Subscriber::start`]`(name, `[`Behavior`]`)`: status, delay, reset, custom answer, sequence; [`Recorded`] requests, [`Subscriber::wait_for`]; the concurrency it saw, [`Subscriber::max_concurrent`] |
//! | misbehave at the transport level | [`faults::FaultServer`] (silent, raw bytes, huge bodies, kill and restart), [`faults::raw_request`] |
//! | send requests | [`Client::http1`], [`Client::h2c`] (and `_resolving` for host names), [`send`] -> [`Reply`], [`chunked_body`] |
//! | check an answer | [`assert_202`], [`assert_202_empty`], [`assert_status`], [`assert_rejected`] (4xx with `{"error": ...}`), [`Reply::assert_not_tripwire`] |
//! | scrape Envoy with a real Prometheus and evaluate rules; query it, read its alerts | [`prometheus::Prometheus::start`]`(&`[`prometheus::Setup`]`)`, [`prometheus::Prometheus::query`], [`prometheus::Prometheus::alerts`] |
//! | run N fanout replicas behind a front Envoy (the shipped `envoy/front-affinity.yaml`, or round robin) | [`front::Front::start`]`(`[`front::Balance`]`, &ports)`, a replica on a fixed port: [`front::start_replica`]`(builder, port)` |
//! | reload the filter the way a ConfigMap does (ECDS, CDS) | [`reload::ReloadEnvoy`] (derefs to [`Envoy`]), [`reload::ConfigMapVolume`], [`reload::Load`] |
//! | run Envoy on ConfigMap files written elsewhere (e.g. by `fanout-control render`) | [`reload::ReloadEnvoy::start_on_files`] |
//! | run `fanout-control render` | [`control::render`], [`control::render_objects`] |
//! | send or read events with the CloudEvents SDK | [`sdk::run_sdk`] |
//! | receive OTLP/HTTP traces, decoded with the official protos; one trace as a tree | [`otlp::OtlpReceiver::start`], [`otlp::SpanTree`] |
//! | read a shipped file | [`manifest_dir`], [`read_shipped`], [`read_shipped_yaml`], [`yaml_to_json`] |
//! | a scratch directory, fixed ports | [`TempDir`], [`unique_temp_dir`]; [`free_ports`] (only for shipped configs and scripts that take port numbers) |
//! | close a connection with an RST | [`set_linger_zero`] |
#![allow(dead_code, unused_imports)]

mod client;
pub mod control;
mod envoy;
pub mod etcd;
pub mod faults;
pub mod front;
pub mod kube;
pub mod otlp;
pub mod prometheus;
pub mod reload;
pub mod sdk;
mod server;
mod stats;
mod subscriber;
pub mod timing;

pub use client::{
    assert_202, assert_202_empty, assert_rejected, assert_status, chunked_body, send, Client, Reply,
};
pub use envoy::{
    body_wait, envoy_bin, fanout_build, filter_log_lines, http_get, native_ecds, native_lib_path,
    native_search_path, validate_config, wasm_path, BodyWait, Build, Envoy, EnvoyBuilder,
    NATIVE_SKIP, NATIVE_TYPE, TRIPWIRE_BODY, WASM_TYPE,
};
pub use server::set_linger_zero;
pub use subscriber::{Behavior, Recorded, Subscriber};

use std::net::TcpListener;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// The crate root (where Cargo.toml is).
pub fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A new directory under the system temp dir, unique across parallel tests and processes:
/// `<prefix>-<pid>-<sequence>-<nanos>`.
pub fn unique_temp_dir(prefix: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{SystemTime, UNIX_EPOCH};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let path = std::env::temp_dir().join(format!(
        "{prefix}-{}-{}-{nanos}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    path
}

/// Ends a test the native build cannot run, saying why (see [`NATIVE_SKIP`]).
pub fn skip_on_native(why: &str) -> ! {
    panic!("{NATIVE_SKIP} {why}");
}

/// A [`unique_temp_dir`] that removes itself on drop, except when the test fails (on the wasm
/// build) or
/// `FANOUT_E2E_KEEP` is set: then it stays, and its path is printed.
pub struct TempDir {
    path: PathBuf,
    /// What it holds, for the "kept ..." line.
    what: &'static str,
}

impl TempDir {
    /// `prefix` starts the directory's name; `what` says in the "kept" line what it holds.
    pub fn new(prefix: &str, what: &'static str) -> TempDir {
        TempDir {
            path: unique_temp_dir(prefix),
            what,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // On the native build most tests that end by panicking were skipped (the panic may
        // come from another thread of the test): what they made goes, as after a pass (an
        // etcd cluster's data is hundreds of MB); FANOUT_E2E_KEEP keeps it.
        let failed = std::thread::panicking() && fanout_build() != Build::Native;
        if failed || std::env::var_os("FANOUT_E2E_KEEP").is_some() {
            eprintln!("kept {} in {}", self.what, self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// `n` distinct free loopback ports, for what needs a fixed port number before it starts (a
/// shipped config or script that takes ports from its environment). Everything the harness
/// starts itself binds port 0 instead: a port chosen here is free when chosen, and another
/// process may take it before it is used.
pub fn free_ports(n: usize) -> Vec<u16> {
    // All held open while choosing, so that they differ.
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind a free loopback port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("a bound port").port())
        .collect()
}

/// A file of the repository (`rel` from the crate root, e.g. `envoy/envoy.yaml`), as text.
pub fn read_shipped(rel: &str) -> String {
    let path = manifest_dir().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// One YAML document as JSON, merge keys (`<<`) applied; `what` names it in the panic.
pub fn yaml_to_json(text: &str, what: &str) -> Value {
    let mut value: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(text).unwrap_or_else(|e| panic!("{what} is not valid YAML: {e}"));
    value
        .apply_merge()
        .unwrap_or_else(|e| panic!("{what}: YAML merge keys: {e}"));
    serde_json::to_value(value).unwrap_or_else(|e| panic!("{what}: not JSON-like YAML: {e}"))
}

/// A YAML file of the repository (one document) as JSON: [`read_shipped`], then
/// [`yaml_to_json`].
pub fn read_shipped_yaml(rel: &str) -> Value {
    yaml_to_json(&read_shipped(rel), rel)
}
