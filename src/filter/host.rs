//! The host calls the filter makes, behind a trait: [`ProxyHost`] performs them through
//! proxy-wasm, and the glue's tests put a fake in its place.
//!
//! The SDK's `Context` helper methods unwrap host errors (and its `get_map` unwraps header
//! values as UTF-8); going to `hostcalls` directly lets a host error become an answer or a
//! log line instead of a panic that aborts the VM.

use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType};

use crate::answer::Answer;
use crate::dedupe::CasMismatch;
use crate::metrics::Kind;

pub trait Host {
    /// Makes the `log` crate follow Envoy's log level for wasm.
    fn follow_log_level(&self);
    fn plugin_configuration(&self) -> Option<Vec<u8>>;
    /// All request headers at once: one host call.
    fn request_headers(&self) -> Vec<(String, Vec<u8>)>;
    fn request_body(&self, size: usize) -> Vec<u8>;
    /// Starts a call; `Err` carries the reason Envoy refused it (no callback will come).
    fn dispatch(
        &self,
        cluster: &str,
        headers: Vec<(&str, &str)>,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, String>;
    /// `:status` of the call answer being delivered to `on_http_call_response`.
    fn call_status(&self) -> Option<u16>;
    /// Up to `max` bytes of that answer's body.
    fn call_body(&self, max: usize) -> Vec<u8>;
    /// One header of that answer.
    fn call_header(&self, name: &str) -> Option<String>;
    /// All headers of that answer.
    fn call_headers(&self) -> Vec<(String, Vec<u8>)>;
    /// Makes `context_id` the context the next host calls act for; false if it is gone.
    fn set_effective_context(&self, context_id: u32) -> bool;
    /// Answers the current stream locally.
    fn respond(&self, answer: &Answer);
    /// Milliseconds on the host's clock.
    fn now_ms(&self) -> u64;
    /// Defines (or finds, by name) a metric; `None` if Envoy refused.
    fn define_metric(&self, kind: Kind, name: &str) -> Option<u32>;
    fn increment_metric(&self, id: u32, delta: i64);
    fn record_metric(&self, id: u32, value: u64);
    /// Sets the root context's timer.
    fn set_tick_period(&self, period: Duration);
    /// A key of Envoy's shared data (one store per VM id for the whole process, seen by
    /// every worker): its value and CAS, `(None, None)` if it does not exist.
    fn get_shared_data(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Writes a key of the shared data if its CAS is still `cas` (`None`: unconditionally;
    /// Envoy also writes a key that does not exist yet whatever `cas` says).
    fn set_shared_data(&self, key: &str, value: &[u8], cas: Option<u32>)
        -> Result<(), CasMismatch>;
}

#[derive(Clone, Copy, Default)]
pub struct ProxyHost;

impl Host for ProxyHost {
    fn follow_log_level(&self) {
        if let Ok(level) = hostcalls::get_log_level() {
            proxy_wasm::set_log_level(level);
        }
    }

    fn plugin_configuration(&self) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
    }

    fn request_headers(&self) -> Vec<(String, Vec<u8>)> {
        hostcalls::get_map_bytes(MapType::HttpRequestHeaders).unwrap_or_default()
    }

    fn request_body(&self, size: usize) -> Vec<u8> {
        hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size)
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    fn dispatch(
        &self,
        cluster: &str,
        headers: Vec<(&str, &str)>,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, String> {
        let body = (!body.is_empty()).then_some(body);
        hostcalls::dispatch_http_call(cluster, headers, body, Vec::new(), timeout).map_err(
            |status| match status {
                proxy_wasm::types::Status::BadArgument => format!(
                    "Envoy refused the call (BadArgument): is \"{cluster}\" a cluster Envoy knows?"
                ),
                other => format!("Envoy refused the call ({other:?})"),
            },
        )
    }

    fn call_status(&self) -> Option<u16> {
        let value = hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status")
            .ok()
            .flatten()?;
        std::str::from_utf8(&value).ok()?.parse().ok()
    }

    fn call_body(&self, max: usize) -> Vec<u8> {
        hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, max)
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    fn call_header(&self, name: &str) -> Option<String> {
        let value = hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, name)
            .ok()
            .flatten()?;
        String::from_utf8(value).ok()
    }

    fn call_headers(&self) -> Vec<(String, Vec<u8>)> {
        hostcalls::get_map_bytes(MapType::HttpCallResponseHeaders).unwrap_or_default()
    }

    fn set_effective_context(&self, context_id: u32) -> bool {
        hostcalls::set_effective_context(context_id).is_ok()
    }

    fn respond(&self, answer: &Answer) {
        let body = (!answer.body.is_empty()).then_some(answer.body.as_slice());
        if let Err(status) =
            hostcalls::send_http_response(answer.status, answer.header_pairs(), body)
        {
            log::warn!("fanout: could not answer {}: {status:?}", answer.status);
        }
    }

    fn now_ms(&self) -> u64 {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_millis() as u64)
    }

    fn define_metric(&self, kind: Kind, name: &str) -> Option<u32> {
        let kind = match kind {
            Kind::Counter => MetricType::Counter,
            Kind::Gauge => MetricType::Gauge,
            Kind::Histogram => MetricType::Histogram,
        };
        hostcalls::define_metric(kind, name).ok()
    }

    fn increment_metric(&self, id: u32, delta: i64) {
        let _ = hostcalls::increment_metric(id, delta);
    }

    fn record_metric(&self, id: u32, value: u64) {
        let _ = hostcalls::record_metric(id, value);
    }

    fn set_tick_period(&self, period: Duration) {
        let _ = hostcalls::set_tick_period(period);
    }

    fn get_shared_data(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        hostcalls::get_shared_data(key).unwrap_or((None, None))
    }

    fn set_shared_data(
        &self,
        key: &str,
        value: &[u8],
        cas: Option<u32>,
    ) -> Result<(), CasMismatch> {
        hostcalls::set_shared_data(key, Some(value), cas).map_err(|_| CasMismatch)
    }
}
