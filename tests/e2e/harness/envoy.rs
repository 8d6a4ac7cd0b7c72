//! The Envoy guard: a generated config in a temp dir, Envoy in its own process group, ready
//! when its admin says so, stopped (the whole group) on drop.

use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime};

use serde_json::{json, Value};

use super::{manifest_dir, Subscriber, TempDir};

/// Body of the route behind the filter. The filter answers every request itself, so seeing
/// this body means a request got past the filter to the router.
pub const TRIPWIRE_BODY: &str =
    "fanout did not answer this request; the request reached the router";

/// How long Envoy may take to become ready (or, for a refused config, to exit). Generous:
/// tests run in parallel on small machines and V8 compiles the module per worker.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// The Envoy binary: `$ENVOY_BIN`, else `.tools/envoy-1.40.0` (what `make envoy` installs).
pub fn envoy_bin() -> PathBuf {
    let path = env_path("ENVOY_BIN").unwrap_or_else(|| manifest_dir().join(".tools/envoy-1.40.0"));
    if !is_executable(&path) {
        panic!(
            "the Envoy binary is missing: {} is not an executable file (set by ENVOY_BIN, \
             default .tools/envoy-1.40.0). Install it with `make envoy`, or run the end-to-end \
             tests with `make test-e2e`, which installs Envoy and builds the filter first.",
            path.display()
        );
    }
    path
}

/// The filter: `$FANOUT_WASM`, else `target/wasm32-wasip1/release/fanout.wasm` (what
/// `make build` produces), as an absolute path (it goes into configs Envoy reads elsewhere).
pub fn wasm_path() -> PathBuf {
    let path = env_path("FANOUT_WASM")
        .unwrap_or_else(|| manifest_dir().join("target/wasm32-wasip1/release/fanout.wasm"));
    if !path.is_file() {
        panic!(
            "the filter is missing: {} does not exist (set by FANOUT_WASM, default \
             target/wasm32-wasip1/release/fanout.wasm). Build it with `make build`, or run the \
             end-to-end tests with `make test-e2e`, which builds the filter and installs Envoy \
             first.",
            path.display()
        );
    }
    warn_if_stale(&path);
    fs::canonicalize(&path).unwrap_or(path)
}

/// Which build of fanout the bootstraps written here load: the wasm module (the default), or
/// the native build with `FANOUT_BUILD=native` (an Envoy dynamic module, docs/native.md), so
/// that the whole suite runs on either.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Build {
    Wasm,
    Native,
}

pub fn fanout_build() -> Build {
    match std::env::var("FANOUT_BUILD").as_deref() {
        Err(_) | Ok("") | Ok("wasm") => Build::Wasm,
        Ok("native") => Build::Native,
        Ok(other) => panic!("FANOUT_BUILD must be `wasm` or `native`, not {other:?}"),
    }
}

/// The native build: `$FANOUT_NATIVE_DIR/libfanout.so`, else `target/native/libfanout.so`
/// (what `make build-native` produces), as an absolute path.
pub fn native_lib_path() -> PathBuf {
    let dir = env_path("FANOUT_NATIVE_DIR").unwrap_or_else(|| manifest_dir().join("target/native"));
    let path = dir.join("libfanout.so");
    if !path.is_file() {
        panic!(
            "the native build is missing: {} does not exist (in FANOUT_NATIVE_DIR, default \
             target/native). Build it with `make build-native`, or run the end-to-end tests \
             on it with `make test-e2e-native`.",
            path.display()
        );
    }
    warn_if_older_than(&path, "src", "src/", "make test-e2e-native");
    warn_if_older_than(&path, "native/src", "native/src/", "make test-e2e-native");
    fs::canonicalize(&path).unwrap_or(path)
}

/// The native build's HTTP filter's name (the harness tells an Envoy running it by it).
const NATIVE_FILTER: &str = "envoy.filters.http.dynamic_modules";
/// The native build's filter's type, which a bootstrap's ECDS `type_urls` name for a fanout
/// filter that comes from fanout-control (`--build native`) or from a file `render` wrote.
pub const NATIVE_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter";
/// The wasm filter's type.
pub const WASM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";

/// On the native build, a shipped bootstrap whose fanout filter comes over ECDS made the
/// native build's the way docs/native.md says: the `type_urls` that name the wasm filter name
/// the native build's filter instead, and the stats tag rules match the native build's names.
/// A filter the bootstrap configures itself is left as it is (and a wasm one is a skip). On
/// the wasm build, nothing changes.
pub fn native_ecds(bootstrap: &mut Value) {
    fn retype(value: &mut Value) {
        match value {
            Value::Object(fields) => {
                for (key, field) in fields.iter_mut() {
                    match (key.as_str(), field) {
                        ("type_urls", Value::Array(urls)) => {
                            for url in urls.iter_mut().filter(|u| *u == WASM_TYPE) {
                                *url = json!(NATIVE_TYPE);
                            }
                        }
                        (_, field) => retype(field),
                    }
                }
            }
            Value::Array(items) => items.iter_mut().for_each(retype),
            _ => {}
        }
    }
    if fanout_build() != Build::Native {
        return;
    }
    retype(bootstrap);
    if let Some(stats) = bootstrap.get_mut("stats_config") {
        rename_stats(stats);
    }
}

/// The directory Envoy finds the native build in by its name (`libfanout.so`, for
/// `dynamic_module_config.name: fanout`): its `ENVOY_DYNAMIC_MODULES_SEARCH_PATH`.
pub fn native_search_path() -> PathBuf {
    let lib = native_lib_path();
    lib.parent().map(Path::to_path_buf).unwrap_or(lib)
}

/// The native build's HTTP filter (docs/native.md) with the same JSON configuration as the
/// wasm filter's, the library named by its path.
fn native_filter(config: &str) -> Value {
    json!({
        "name": NATIVE_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            "dynamic_module_config": {
                "module": { "local": { "filename": native_lib_path() } },
                "do_not_close": true
            },
            "filter_name": "fanout",
            "filter_config": {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": config
            }
        }
    })
}

/// On the native build, why this test cannot run there, said before Envoy starts: the
/// bootstrap loads the wasm module anyway: a module file the test names, a wasm filter left
/// in the bootstrap, or an ECDS that takes only the wasm filter (a shipped xDS or ConfigMap
/// bootstrap is made the native build's by [`native_ecds`] first, a static one by
/// `native_in_place`). `None` on the wasm build.
fn native_skip(bootstrap: &Value, wasm_file: Option<&Path>) -> Option<String> {
    if fanout_build() != Build::Native {
        return None;
    }
    let text = bootstrap.to_string();
    if let Some(file) = wasm_file.filter(|_| text.contains(WASM_TYPE)) {
        let name = file.file_name().map_or("", |n| n.to_str().unwrap_or(""));
        return Some(format!(
            "the test loads a wasm module file of its own ({name}), not the built filter"
        ));
    }
    let mut filters = Vec::new();
    wasm_filters(bootstrap, &mut filters);
    if !filters.is_empty() {
        return Some(format!(
            "the bootstrap configures the wasm filter itself ({})",
            filters.join(", ")
        ));
    }
    text.contains(WASM_TYPE).then(|| {
        "the bootstrap's ECDS takes only the wasm filter for fanout (its type_urls)".to_owned()
    })
}

/// On the native build, each wasm filter a bootstrap configures itself (a shipped static
/// bootstrap) made the native build's filter with the same JSON, where it was, as
/// docs/native.md tells its users to; its stats tag rules read the native build's names.
/// On the wasm build, nothing changes.
fn native_in_place(bootstrap: &mut Value) {
    fn swap(value: &mut Value, moved: &mut Vec<String>) {
        match value {
            Value::Object(fields) => {
                let is_wasm = fields.get("typed_config").and_then(|c| c.get("@type"))
                    == Some(&json!(WASM_TYPE));
                let config = fields
                    .get("typed_config")
                    .and_then(|c| c.pointer("/config/configuration/value"))
                    .and_then(Value::as_str)
                    .map(str::to_owned);
                match (is_wasm, config) {
                    (true, Some(config)) => {
                        *value = native_filter(&config);
                        moved.push(config);
                    }
                    _ => fields.values_mut().for_each(|v| swap(v, moved)),
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|v| swap(v, moved)),
            _ => {}
        }
    }
    let mut moved = Vec::new();
    if fanout_build() != Build::Native {
        return;
    }
    swap(bootstrap, &mut moved);
    if !moved.is_empty() {
        if let Some(stats) = bootstrap.get_mut("stats_config") {
            rename_stats(stats);
        }
    }
}

/// The names of the filters `value` configures as the wasm filter (`"@type"` the wasm
/// filter's type, under a filter's `typed_config`).
fn wasm_filters(value: &Value, found: &mut Vec<String>) {
    match value {
        Value::Object(fields) => {
            if fields.get("typed_config").and_then(|c| c.get("@type")) == Some(&json!(WASM_TYPE)) {
                let name = fields.get("name").and_then(Value::as_str).unwrap_or("?");
                found.push(name.to_owned());
            }
            fields.values().for_each(|v| wasm_filters(v, found));
        }
        Value::Array(items) => items.iter().for_each(|v| wasm_filters(v, found)),
        _ => {}
    }
}

/// fanout's stats named as the native build names them under `stats_config`: a regular
/// expression's `^wasmcustom\.` made `^dynamicmodulescustom\.`, a prefix's `wasmcustom.`
/// made `dynamicmodulescustom.`.
fn rename_stats(value: &mut Value) {
    match value {
        Value::String(text) => {
            if let Some(rest) = text.strip_prefix("^wasmcustom\\.") {
                *text = format!("^dynamicmodulescustom\\.{rest}");
            } else if let Some(rest) = text.strip_prefix("wasmcustom.") {
                *text = format!("dynamicmodulescustom.{rest}");
            }
        }
        Value::Array(items) => items.iter_mut().for_each(rename_stats),
        Value::Object(fields) => fields.values_mut().for_each(rename_stats),
        _ => {}
    }
}

/// The lines of an Envoy log (or `envoy --mode validate`'s output) that fanout logged itself,
/// on either build: the wasm VM's (`wasm log ...`) or the dynamic module's
/// (`[dynamic_modules] [src/...] fanout: ...`), the native build's refusal said as the wasm
/// build says it (`invalid plugin configuration: <field>: ...`).
pub fn filter_log_lines(log: &str) -> Vec<String> {
    const NATIVE_REFUSAL: &str = "invalid plugin configuration for filter \"";
    log.lines()
        .filter(|l| {
            l.contains("wasm log") || (l.contains("[dynamic_modules]") && l.contains("] fanout: "))
        })
        .map(|l| match l.split_once(NATIVE_REFUSAL) {
            Some((head, rest)) => match rest.split_once("\": ") {
                Some((_, error)) => format!("{head}invalid plugin configuration: {error}"),
                None => l.to_owned(),
            },
            None => l.to_owned(),
        })
        .collect()
}

/// The panic that ends a test the native build cannot run: a failure in cargo's summary (never
/// a pass), which `make test-e2e-native` counts as skipped by this message.
pub const NATIVE_SKIP: &str = "SKIPPED on the native build:";

fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `cargo test` alone does not rebuild the wasm: say so when src/ is newer than it.
fn warn_if_stale(wasm: &Path) {
    warn_if_older_than(wasm, "src", "src/", "make test-e2e");
}

/// `built` older than the newest file under `sources`: say so, and that `make_target`
/// rebuilds it.
fn warn_if_older_than(built: &Path, sources: &str, said: &str, make_target: &str) {
    let Ok(built_at) = fs::metadata(built).and_then(|m| m.modified()) else {
        return;
    };
    let newest_src = newest_mtime(&manifest_dir().join(sources));
    if newest_src.is_some_and(|src| src > built_at) {
        eprintln!(
            "warning: {} is older than {said}; these tests run the old filter. `{make_target}` \
             rebuilds it.",
            built.display()
        );
    }
}

fn newest_mtime(dir: &Path) -> Option<SystemTime> {
    fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter_map(|e| {
            let meta = e.metadata().ok()?;
            if meta.is_dir() {
                newest_mtime(&e.path())
            } else {
                meta.modified().ok()
            }
        })
        .max()
}

/// How the filter waits for the request body in these tests: `pause` (the default; the
/// plugin config sets `allow_on_headers_stop_iteration`) or `continue` (the filter is
/// configured with `"body_wait": "continue"`, the flag is left out, and a buffer filter follows
/// the filter), chosen by `$FANOUT_E2E_BODY_WAIT` so the whole suite runs in either mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyWait {
    Pause,
    Continue,
}

pub fn body_wait() -> BodyWait {
    match std::env::var("FANOUT_E2E_BODY_WAIT").as_deref() {
        Err(_) | Ok("") | Ok("pause") => BodyWait::Pause,
        Ok("continue") => BodyWait::Continue,
        Ok(other) => panic!("FANOUT_E2E_BODY_WAIT must be `pause` or `continue`, not {other:?}"),
    }
}

/// The plugin configuration with `"body_wait": "continue"` added, when it is a JSON object
/// without one; anything else (a broken config a test wants refused) is left as it is.
fn with_body_wait_continue(config: &str) -> String {
    match serde_json::from_str::<Value>(config) {
        Ok(Value::Object(mut fields)) if !fields.contains_key("body_wait") => {
            fields.insert("body_wait".to_owned(), json!("continue"));
            Value::Object(fields).to_string()
        }
        _ => config.to_owned(),
    }
}

/// What Envoy runs: the fanout filter (or none, to test the harness with a plain proxy), the
/// subscriber clusters, and the route behind the filter.
#[derive(Clone, Debug, Default)]
pub struct EnvoyBuilder {
    /// The plugin configuration, passed verbatim as a StringValue. None: no wasm filter.
    plugin_config: Option<String>,
    clusters: Vec<(String, u16)>,
    /// Route everything to this cluster instead of the tripwire (harness self-tests only).
    proxy_to: Option<String>,
    log_level: Option<String>,
    /// The listener's `per_connection_buffer_limit_bytes` (Envoy's default: 1 MiB). A paused
    /// request body beyond it gets Envoy's own 413, whatever the filter's `max_body_bytes`.
    buffer_limit: Option<u64>,
    /// In `continue` mode, leave out the buffer filter (the misconfiguration the tripwire and
    /// the filter's own check exist for).
    without_buffer_filter: bool,
    /// Extra top-level bootstrap fields (e.g. `stats_config`).
    bootstrap_fields: Vec<(String, Value)>,
    /// Extra fields of one cluster (cluster name, field, value), e.g. `circuit_breakers`.
    cluster_fields: Vec<(String, String, Value)>,
    /// Envoy's worker threads (`--concurrency`; default 2).
    concurrency: Option<u32>,
    /// HTTP filters before the router given as they are, instead of fanout's own stanza.
    http_filters: Option<Vec<Value>>,
    /// More command-line arguments (e.g. `--drain-time-s`).
    args: Vec<String>,
    /// The module Envoy loads instead of [`wasm_path`] (e.g. one pulled from an image).
    wasm_file: Option<PathBuf>,
    /// The listener's HTTP stat prefix (default `ingress`).
    stat_prefix: Option<String>,
    /// A whole bootstrap instead of the one built here (e.g. the shipped xDS one).
    raw_bootstrap: Option<Value>,
    /// Where Envoy finds a native filter that names its library by name, instead of
    /// [`native_search_path`] (e.g. the files of an image, as a pod mounts them).
    native_search_path: Option<PathBuf>,
}

impl EnvoyBuilder {
    /// Load this module file instead of the built one ([`wasm_path`]).
    pub fn wasm_file(mut self, path: &Path) -> Self {
        self.wasm_file = Some(path.to_path_buf());
        self
    }

    /// The fanout filter with this plugin configuration (JSON).
    pub fn fanout(mut self, config: &Value) -> Self {
        self.plugin_config = Some(config.to_string());
        self
    }

    /// The fanout filter with this plugin configuration, verbatim (for broken configs).
    pub fn fanout_raw(mut self, config: &str) -> Self {
        self.plugin_config = Some(config.to_owned());
        self
    }

    /// These HTTP filters (stanzas as in a bootstrap, e.g. one from a shipped EnvoyFilter),
    /// then the router, instead of the fanout filter the harness writes itself. The harness
    /// adds nothing to them: no buffer filter, no stop-iteration flag, whatever the mode.
    pub fn http_filters(mut self, filters: Vec<Value>) -> Self {
        self.plugin_config = None;
        self.http_filters = Some(filters);
        self
    }

    /// A STATIC cluster `name` with one endpoint, 127.0.0.1:`port`. A cluster the filter
    /// names but nobody declares is simply unknown to Envoy.
    pub fn cluster(mut self, name: &str, port: u16) -> Self {
        self.clusters.push((name.to_owned(), port));
        self
    }

    /// A field of the cluster `cluster` (declared with [`EnvoyBuilder::cluster`]), e.g.
    /// `circuit_breakers`.
    pub fn cluster_field(mut self, cluster: &str, field: &str, value: Value) -> Self {
        self.cluster_fields
            .push((cluster.to_owned(), field.to_owned(), value));
        self
    }

    /// Envoy's worker threads (default 2). Each worker runs its own VM of the filter, with
    /// its own per-worker limits.
    pub fn concurrency(mut self, workers: u32) -> Self {
        self.concurrency = Some(workers);
        self
    }

    /// A STATIC cluster per `(name, port)`, as [`cluster`](Self::cluster).
    pub fn clusters<'a>(mut self, clusters: impl IntoIterator<Item = (&'a str, u16)>) -> Self {
        for (name, port) in clusters {
            self = self.cluster(name, port);
        }
        self
    }

    /// A cluster per subscriber, named after it, on its port.
    pub fn subscribers(self, subscribers: &[&Subscriber]) -> Self {
        self.clusters(subscribers.iter().map(|s| (s.name(), s.port())))
    }

    /// No filter: route every request to `cluster` (to test the harness itself).
    pub fn plain_proxy_to(mut self, cluster: &str) -> Self {
        self.plugin_config = None;
        self.proxy_to = Some(cluster.to_owned());
        self
    }

    /// Keep the filter, but route what reaches the router to `cluster` instead of the
    /// tripwire.
    pub fn route_to(mut self, cluster: &str) -> Self {
        self.proxy_to = Some(cluster.to_owned());
        self
    }

    /// A top-level field of the bootstrap, e.g. `stats_config` or `stats_flush_interval`.
    pub fn bootstrap_field(mut self, name: &str, value: Value) -> Self {
        self.bootstrap_fields.push((name.to_owned(), value));
        self
    }

    /// In `continue` mode, no buffer filter after fanout.
    pub fn without_buffer_filter(mut self) -> Self {
        self.without_buffer_filter = true;
        self
    }

    /// The listener's `per_connection_buffer_limit_bytes`.
    pub fn buffer_limit(mut self, bytes: u64) -> Self {
        self.buffer_limit = Some(bytes);
        self
    }

    /// Envoy's log level (default `info`, or `$FANOUT_E2E_ENVOY_LOG_LEVEL`).
    /// One more command-line argument for Envoy.
    pub fn arg(mut self, arg: &str) -> Self {
        self.args.push(arg.to_owned());
        self
    }

    /// The listener's HTTP stat prefix, e.g. Istio's inbound `inbound_0.0.0.0_8080`.
    pub fn stat_prefix(mut self, prefix: &str) -> Self {
        self.stat_prefix = Some(prefix.to_owned());
        self
    }

    /// More command-line arguments, in order.
    pub fn args_list(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| (*a).to_owned()));
        self
    }

    pub fn log_level(mut self, level: &str) -> Self {
        self.log_level = Some(level.to_owned());
        self
    }

    /// Envoy's `ENVOY_DYNAMIC_MODULES_SEARCH_PATH`: this directory instead of the built
    /// library's ([`native_search_path`]).
    pub fn native_search_path(mut self, dir: &Path) -> Self {
        self.native_search_path = Some(dir.to_path_buf());
        self
    }

    /// Run this bootstrap as it is (its admin and listener on port 0, its listener named
    /// `ingress`); the other settings of the builder that shape the bootstrap do not apply.
    pub fn raw_bootstrap(mut self, bootstrap: Value) -> Self {
        self.raw_bootstrap = Some(bootstrap);
        self
    }

    /// The Envoy bootstrap, as JSON (which is YAML).
    pub fn bootstrap(&self) -> Value {
        if let Some(raw) = &self.raw_bootstrap {
            return raw.clone();
        }
        let route = match &self.proxy_to {
            Some(cluster) => json!({ "match": { "prefix": "/" }, "route": { "cluster": cluster } }),
            None => json!({
                "match": { "prefix": "/" },
                "direct_response": { "status": 500, "body": { "inline_string": TRIPWIRE_BODY } }
            }),
        };
        let mut http_filters = self.http_filters.clone().unwrap_or_default();
        let mut native = false;
        if let Some(config) = &self.plugin_config {
            let configured_continue = serde_json::from_str::<Value>(config)
                .ok()
                .is_some_and(|c| c.get("body_wait").and_then(Value::as_str) == Some("continue"));
            let continue_mode = body_wait() == BodyWait::Continue || configured_continue;
            let config = if continue_mode {
                with_body_wait_continue(config)
            } else {
                config.clone()
            };
            // A module file the test names is the wasm module, whatever the build.
            let filter = match (fanout_build(), &self.wasm_file) {
                (Build::Native, None) => {
                    native = true;
                    native_filter(&config)
                }
                _ => self.wasm_filter(&config, continue_mode),
            };
            http_filters.push(filter);
            if continue_mode && !self.without_buffer_filter {
                // Holds the headers away from the router until the body is complete; the
                // body reaches fanout first, which keeps it. Its own limit is set high so
                // that the listener's buffer limit and max_body_bytes are what a test meets.
                http_filters.push(json!({
                    "name": "envoy.filters.http.buffer",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                        "max_request_bytes": 64 * 1024 * 1024
                    }
                }));
            }
        }
        http_filters.push(json!({
            "name": "envoy.filters.http.router",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
            }
        }));
        let clusters: Vec<Value> = self
            .clusters
            .iter()
            .map(|(name, port)| {
                let mut cluster = json!({
                    "name": name,
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "load_assignment": {
                        "cluster_name": name,
                        "endpoints": [{ "lb_endpoints": [{ "endpoint": {
                            "address": loopback(*port)
                        } }] }]
                    }
                });
                for (_, field, value) in self.cluster_fields.iter().filter(|(c, _, _)| c == name) {
                    cluster[field.as_str()] = value.clone();
                }
                cluster
            })
            .collect();
        let mut bootstrap = json!({
            "admin": { "address": loopback(0) },
            "static_resources": {
                "listeners": [{
                    "name": "ingress",
                    "address": loopback(0),
                    "filter_chains": [{ "filters": [{
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                            "stat_prefix": self.stat_prefix.as_deref().unwrap_or("ingress"),
                            "codec_type": "AUTO",
                            "route_config": {
                                "name": "local",
                                "virtual_hosts": [{
                                    "name": "all",
                                    "domains": ["*"],
                                    "routes": [route]
                                }]
                            },
                            "http_filters": http_filters
                        }
                    }] }]
                }],
                "clusters": clusters
            }
        });
        for (name, value) in &self.bootstrap_fields {
            bootstrap[name.as_str()] = value.clone();
        }
        if native {
            // The tag rules of fanout's stats, for the native build's names (docs/native.md).
            if let Some(stats) = bootstrap.get_mut("stats_config") {
                rename_stats(stats);
            }
        }
        if let Some(bytes) = self.buffer_limit {
            bootstrap["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] =
                json!(bytes);
        }
        bootstrap
    }

    /// The wasm filter's stanza: the module (the built one, or [`EnvoyBuilder::wasm_file`])
    /// configured with `config`.
    fn wasm_filter(&self, config: &str, continue_mode: bool) -> Value {
        let mut wasm = json!({
            "name": "fanout",
            "root_id": "fanout",
            "configuration": {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": config
            },
            "vm_config": {
                "vm_id": "fanout",
                "runtime": "envoy.wasm.runtime.v8",
                "code": { "local": { "filename": self.wasm_file.clone().unwrap_or_else(wasm_path) } }
            }
        });
        if !continue_mode {
            wasm["allow_on_headers_stop_iteration"] = json!(true);
        }
        json!({
            "name": "envoy.filters.http.wasm",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                "config": wasm
            }
        })
    }

    /// Check this bootstrap with `envoy --mode validate` (see [`validate_config`]); returns
    /// Envoy's output.
    pub fn validate(&self, what: &str) -> String {
        let bootstrap = serde_json::to_string_pretty(&self.bootstrap()).expect("serialize");
        validate_config(&bootstrap, what)
    }

    /// Start Envoy and wait until it serves. Panics (with Envoy's log) if it does not.
    pub fn start(self) -> Envoy {
        let mut envoy = self.spawn();
        envoy.wait_started();
        envoy
    }

    /// Start Envoy without waiting until it serves (see [`Envoy::wait_started`]).
    pub fn start_unready(self) -> Envoy {
        self.spawn()
    }
}

impl Envoy {
    /// Wait until a started Envoy serves. Panics (with Envoy's log) if it does not.
    pub fn wait_started(&mut self) {
        let envoy = self;
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = envoy.try_wait() {
                panic!(
                    "Envoy exited ({status}) instead of starting. Its log:\n{}",
                    envoy.log()
                );
            }
            if let Some(admin) = envoy.admin_from_file() {
                if http_get(admin, "/ready").is_some_and(|(code, _)| code == 200) {
                    let listener = listener_address(admin).unwrap_or_else(|| {
                        panic!(
                            "Envoy is ready but lists no listener. Its log:\n{}",
                            envoy.log()
                        )
                    });
                    envoy.admin = Some(admin);
                    envoy.listener = Some(listener);
                    return;
                }
            }
            if Instant::now() > deadline {
                panic!(
                    "Envoy did not become ready within {START_TIMEOUT:?}. Its log:\n{}",
                    envoy.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Envoy's admin address once it has written it (also before it serves).
    pub fn admin_now(&self) -> Option<SocketAddr> {
        self.admin_from_file()
    }
}

impl EnvoyBuilder {
    /// Start Envoy with a config it must refuse: wait for it to exit and return its exit
    /// status and log. Panics if it becomes ready instead, or does not exit in time.
    pub fn start_expecting_failure(self) -> (ExitStatus, String) {
        let mut envoy = self.spawn();
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = envoy.try_wait() {
                return (status, envoy.log());
            }
            if let Some(admin) = envoy.admin_from_file() {
                if http_get(admin, "/ready").is_some_and(|(code, _)| code == 200) {
                    panic!(
                        "Envoy accepted a config it should have refused and is serving. Its \
                         log:\n{}",
                        envoy.log()
                    );
                }
            }
            if Instant::now() > deadline {
                panic!(
                    "Envoy neither refused the config nor became ready within \
                     {START_TIMEOUT:?}. Its log:\n{}",
                    envoy.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn spawn(self) -> Envoy {
        // Both panic with a how-to when missing: check them before making anything.
        let bin = envoy_bin();
        let mut bootstrap = self.bootstrap();
        let wasm_file = self.wasm_file.as_deref();
        if wasm_file.is_none() {
            native_in_place(&mut bootstrap);
        }
        if let Some(why) = native_skip(&bootstrap, wasm_file) {
            super::skip_on_native(&why);
        }
        // The native build's filter, in the bootstrap or accepted over ECDS.
        let native = {
            let text = bootstrap.to_string();
            text.contains(NATIVE_FILTER) || text.contains(NATIVE_TYPE)
        };
        let bootstrap = serde_json::to_string_pretty(&bootstrap).expect("serialize");
        let dir = TempDir::new("fanout-e2e", "Envoy's config and logs");
        let config_path = dir.path().join("envoy.yaml");
        fs::write(&config_path, bootstrap).expect("write the Envoy config");
        let log_level = self
            .log_level
            .clone()
            .or_else(|| std::env::var("FANOUT_E2E_ENVOY_LOG_LEVEL").ok())
            .unwrap_or_else(|| "info".to_owned());
        let stdout = fs::File::create(dir.path().join("stdout.log")).expect("create stdout.log");
        let stderr = fs::File::create(dir.path().join("stderr.log")).expect("create stderr.log");
        let mut command = Command::new(&bin);
        command
            .arg("--config-path")
            .arg(&config_path)
            .args(["--concurrency", &self.concurrency.unwrap_or(2).to_string()])
            .arg("--use-dynamic-base-id")
            .arg("--admin-address-path")
            .arg(dir.path().join("admin.address"))
            .arg("--log-path")
            .arg(dir.path().join("envoy.log"))
            .args(["--log-level", &log_level])
            // The log file is flushed every 10 s by default; tests read it.
            .args(["--file-flush-interval-msec", "20"])
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            // Its own process group, so that drop can stop Envoy and anything it started.
            .process_group(0);
        // If this test process dies without running drop (killed, or Ctrl-C, which does
        // not reach Envoy's own process group), the kernel kills Envoy.
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        if native {
            // Where a filter that names the library by its name (fanout-control's) finds it.
            let search_path = self.native_search_path.clone();
            command.env(
                "ENVOY_DYNAMIC_MODULES_SEARCH_PATH",
                search_path.unwrap_or_else(native_search_path),
            );
        }
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start Envoy ({}): {e}", bin.display()));
        Envoy {
            child: Some(child),
            dir,
            admin: None,
            listener: None,
            native,
        }
    }
}

/// Runs `envoy --mode validate` on a bootstrap (YAML or JSON text) and returns Envoy's
/// output; panics with that output when Envoy refuses it. Validate mode loads every wasm
/// module the config names and runs its configuration check (fanout logs
/// `fanout: configured ...`), but starts no listener and no worker. `what` names the config
/// in the panic.
pub fn validate_config(config: &str, what: &str) -> String {
    let bin = envoy_bin();
    let dir = TempDir::new("fanout-validate", "the config Envoy validated");
    let file = dir.path().join("envoy.yaml");
    fs::write(&file, config).expect("write the config to validate");
    let output = Command::new(&bin)
        .args(["--mode", "validate", "--disable-hot-restart"])
        .args(["--log-level", "info", "-c"])
        .arg(&file)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", bin.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success() && text.contains("' OK"),
        "envoy --mode validate rejected {what} ({}):\n{text}",
        output.status
    );
    text
}

fn loopback(port: u16) -> Value {
    json!({ "socket_address": { "address": "127.0.0.1", "port_value": port } })
}

/// A running Envoy. Dropping it stops Envoy's whole process group.
pub struct Envoy {
    child: Option<Child>,
    dir: TempDir,
    admin: Option<SocketAddr>,
    listener: Option<SocketAddr>,
    /// It runs the native build: its stats are read under the wasm build's names.
    pub(super) native: bool,
}

impl Envoy {
    pub fn builder() -> EnvoyBuilder {
        EnvoyBuilder::default()
    }

    /// Envoy with the filter configured by `config` and a cluster per subscriber, named after
    /// it. A cluster the config names but no subscriber backs stays unknown to Envoy.
    pub fn with_subscribers(config: &Value, subscribers: &[&Subscriber]) -> Envoy {
        Envoy::builder()
            .fanout(config)
            .subscribers(subscribers)
            .start()
    }

    /// Envoy with the filter configured by `config` and a cluster per `(name, port)`.
    pub fn with_clusters(config: &Value, clusters: &[(&str, u16)]) -> Envoy {
        Envoy::builder()
            .fanout(config)
            .clusters(clusters.iter().copied())
            .start()
    }

    /// The listener (HTTP/1.1 and h2c).
    pub fn addr(&self) -> SocketAddr {
        self.listener.expect("Envoy is started")
    }

    pub fn port(&self) -> u16 {
        self.addr().port()
    }

    /// The address another listener of the bootstrap bound (by its name), once Envoy is
    /// ready.
    pub fn listener_addr(&self, name: &str) -> SocketAddr {
        named_listener_address(self.admin_addr(), name)
            .unwrap_or_else(|| panic!("Envoy has no listener named {name}"))
    }

    /// `http://127.0.0.1:<listener port><path>`
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr())
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin.expect("Envoy is started")
    }

    pub fn admin_port(&self) -> u16 {
        self.admin_addr().port()
    }

    /// GET a path of the admin interface: (status, body).
    pub fn admin_get(&self, path: &str) -> (u16, String) {
        http_get(self.admin_addr(), path)
            .unwrap_or_else(|| panic!("Envoy's admin did not answer GET {path}"))
    }

    /// Envoy's pid, which is also its process group id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Everything Envoy logged so far (its log file, then stderr and stdout).
    pub fn log(&self) -> String {
        ["envoy.log", "stderr.log", "stdout.log"]
            .iter()
            .filter_map(|f| fs::read(self.dir.path().join(f)).ok())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Wait (bounded) until the log contains `needle`; the log is written asynchronously.
    pub fn wait_for_log(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.log().contains(needle) {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// True while Envoy runs.
    pub fn try_wait_alive(&mut self) -> bool {
        self.try_wait().is_none()
    }

    /// None while Envoy runs.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    fn admin_from_file(&self) -> Option<SocketAddr> {
        fs::read_to_string(self.dir.path().join("admin.address"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Stop Envoy's process group: SIGTERM, then SIGKILL after a grace period. Returns
    /// Envoy's exit status.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        let pgid = child.id() as libc::pid_t;
        // SAFETY: signalling a process group we created; no memory is involved.
        unsafe {
            libc::kill(-pgid, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                _ => {
                    // SAFETY: as above.
                    unsafe {
                        libc::kill(-pgid, libc::SIGKILL);
                    }
                    break child.wait().ok();
                }
            }
        };
        // Anything else left in the group (Envoy starts no children, but be sure).
        // SAFETY: as above; ESRCH when the group is empty is fine.
        unsafe {
            libc::kill(-pgid, libc::SIGKILL);
        }
        status
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        if std::thread::panicking() && self.child.is_some() {
            let log = self.log();
            let tail: Vec<&str> = log.lines().rev().take(60).collect();
            eprintln!(
                "--- last lines of Envoy's log ({}) ---\n{}\n--- end of Envoy's log ---",
                self.dir.path().display(),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        self.stop();
    }
}

/// A minimal HTTP/1.1 GET, one per connection (for the admin interface): (status, body). None if it fails.
pub fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).ok()?;
    let response = String::from_utf8_lossy(&response);
    let (head, body) = response.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    Some((
        code,
        if chunked {
            dechunk(body)?
        } else {
            body.to_owned()
        },
    ))
}

fn dechunk(mut body: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(rest.get(..size)?);
        body = rest.get(size..)?.strip_prefix("\r\n")?;
    }
}

/// The address the listener `ingress` bound (its port was 0 in the config).
fn listener_address(admin: SocketAddr) -> Option<SocketAddr> {
    named_listener_address(admin, "ingress")
}

/// The address the listener `name` bound.
fn named_listener_address(admin: SocketAddr, name: &str) -> Option<SocketAddr> {
    let (code, body) = http_get(admin, "/listeners?format=json")?;
    if code != 200 {
        return None;
    }
    let v: Value = serde_json::from_str(&body).ok()?;
    let sa = v["listener_statuses"]
        .as_array()?
        .iter()
        .find(|l| l["name"] == name)?
        .get("local_address")?
        .get("socket_address")?
        .clone();
    let ip = sa["address"].as_str()?;
    let port = sa["port_value"].as_u64()?;
    format!("{ip}:{port}").parse().ok()
}
