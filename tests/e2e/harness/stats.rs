//! What a running Envoy says about itself: its stats (admin `/stats`, and `/stats/prometheus`
//! as a scraper sees it), its heap (admin `/memory`) and its resident set (`/proc`).
//!
//! fanout's own metrics are `wasmcustom.fanout.*` in `/stats` and `fanout_*` in
//! `/stats/prometheus`. The native build's are `dynamicmodulescustom.fanout.*` and
//! `envoy_dynamicmodulescustom_fanout_*` (docs/native.md); an Envoy running it is read here
//! under the wasm build's names, so that a test reads either the same. The filter hands its
//! counts to Envoy on its root context's tick (once a second), so a test that reads them
//! after some requests waits for them with [`Envoy::wait_for_stat`] or
//! [`Envoy::wait_for_stats`], bounded, instead of sleeping.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;

use super::timing::poll_until;
use super::Envoy;

/// The prefix of fanout's stats in `/stats`: the wasm build's, and the native build's.
const WASM_STATS: &str = "wasmcustom";
const NATIVE_STATS: &str = "dynamicmodulescustom";
/// The native build's prefix in `/stats/prometheus`, where Envoy drops the wasm build's.
const NATIVE_PROMETHEUS: &str = "envoy_dynamicmodulescustom_";

/// How often the waits below read Envoy's stats again.
const POLL: Duration = Duration::from_millis(10);

impl Envoy {
    /// Every stat in admin `/stats` whose name starts with `prefix` (`""`: all), with its
    /// value as Envoy prints it: a number for counters and gauges, `P0(...) ...` or
    /// `No recorded values` for histograms, a quoted string for text readouts.
    pub fn stats_text(&self, prefix: &str) -> BTreeMap<String, String> {
        if self.native && prefix.starts_with("wasm.") {
            super::skip_on_native(&format!(
                "the test reads the wasm VMs' own stats ({prefix}...)"
            ));
        }
        let asked = prefix;
        let prefix = &self.native_name(prefix, WASM_STATS, NATIVE_STATS);
        let path = if prefix.is_empty() {
            "/stats".to_owned()
        } else {
            // Envoy's filter is a regular expression, matched anywhere in the name.
            format!("/stats?filter=^{}", regex_escape(prefix))
        };
        let (code, body) = self.admin_get(&path);
        assert_eq!(code, 200, "GET {path}: {body}");
        body.lines()
            .filter_map(|line| {
                let (name, value) = line.split_once(": ")?;
                name.starts_with(prefix).then(|| {
                    let name = self.native_name(name, NATIVE_STATS, WASM_STATS);
                    (name, value.trim().to_owned())
                })
            })
            .filter(|(name, _)| name.starts_with(asked))
            .collect()
    }

    /// `name` with its leading `from` replaced by `to` when this Envoy runs the native build;
    /// as it is otherwise.
    fn native_name(&self, name: &str, from: &str, to: &str) -> String {
        match name.strip_prefix(from) {
            Some(rest) if self.native => format!("{to}{rest}"),
            _ => name.to_owned(),
        }
    }

    /// Every counter and gauge whose name starts with `prefix` (`""`: all), by name.
    /// Histograms and text readouts are left out.
    pub fn stats(&self, prefix: &str) -> BTreeMap<String, u64> {
        self.stats_text(prefix)
            .into_iter()
            .filter_map(|(name, value)| Some((name, value.parse().ok()?)))
            .collect()
    }

    /// One counter or gauge, by its whole name (e.g. `wasmcustom.fanout.in_flight`); None
    /// while Envoy does not have it.
    pub fn stat(&self, name: &str) -> Option<u64> {
        self.stats(name).remove(name)
    }

    /// A text readout, unquoted (e.g. an ECDS subscription's `version_text`).
    pub fn text_stat(&self, name: &str) -> Option<String> {
        self.stats_text(name)
            .remove(name)
            .map(|v| v.trim_matches('"').to_owned())
    }

    /// Reads `name` until it is there and `pred` holds for it, at most `timeout`: returns the
    /// last value read (`None`: Envoy never had the stat). Callers assert on it.
    pub fn wait_for_stat(
        &self,
        name: &str,
        pred: impl Fn(u64) -> bool,
        timeout: Duration,
    ) -> Option<u64> {
        let mut last = None;
        poll_until(timeout, POLL, || {
            last = self.stat(name);
            last.filter(|v| pred(*v))
        })
        .or(last)
    }

    /// [`wait_for_stat`](Envoy::wait_for_stat) for a stat the test cannot go on without:
    /// its value once `pred` holds; panics when it does not within `timeout`.
    pub fn expect_stat(&self, name: &str, pred: impl Fn(u64) -> bool, timeout: Duration) -> u64 {
        match self.wait_for_stat(name, &pred, timeout) {
            Some(value) if pred(value) => value,
            last => {
                panic!("stat {name} is {last:?} after {timeout:?}, not what the test waits for")
            }
        }
    }

    /// Reads the counters and gauges under `prefix` (as [`stats`](Envoy::stats)) until `pred`
    /// holds for them, at most `timeout`: returns the last reading. Callers assert on it.
    pub fn wait_for_stats(
        &self,
        prefix: &str,
        pred: impl Fn(&BTreeMap<String, u64>) -> bool,
        timeout: Duration,
    ) -> BTreeMap<String, u64> {
        let mut last = BTreeMap::new();
        poll_until(timeout, POLL, || {
            last = self.stats(prefix);
            pred(&last).then_some(())
        });
        last
    }

    /// What a Prometheus scrape of admin `/stats/prometheus` gets: the `name{labels} value`
    /// lines whose name starts with `prefix`, keyed by `name{labels}`. Histograms contribute
    /// their `_bucket`, `_sum` and `_count` lines.
    pub fn prometheus(&self, prefix: &str) -> BTreeMap<String, f64> {
        let (code, text) = self.admin_get("/stats/prometheus");
        assert_eq!(code, 200, "GET /stats/prometheus: {text}");
        text.lines()
            .map(|line| self.native_name(line, NATIVE_PROMETHEUS, ""))
            .filter(|line| line.starts_with(prefix))
            .filter_map(|line| {
                let (key, value) = line.rsplit_once(' ')?;
                Some((key.to_owned(), value.parse().ok()?))
            })
            .collect()
    }

    /// Bytes allocated by Envoy's heap right now (admin `/memory`, tcmalloc's count; the
    /// `server.memory_allocated` gauge is only refreshed at each stats flush).
    pub fn heap_allocated(&self) -> u64 {
        let (code, body) = self.admin_get("/memory");
        assert_eq!(code, 200, "GET /memory: {body}");
        let v: Value = serde_json::from_str(&body).expect("/memory is JSON");
        v["allocated"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .or_else(|| v["allocated"].as_u64())
            .unwrap_or_else(|| panic!("/memory without `allocated`: {body}"))
    }

    /// Envoy's resident set size in KiB (`VmRSS` of `/proc/<pid>/status`).
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("read Envoy's /proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc status")
    }
}

/// `text` as a regular expression that matches exactly it.
fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 2);
    for c in text.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}
