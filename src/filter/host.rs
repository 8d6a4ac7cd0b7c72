//! [`ProxyHost`]: the core's [`Host`] calls, performed through proxy-wasm.
//!
//! The SDK's `Context` helper methods unwrap host errors (and its `get_map` unwraps header
//! values as UTF-8); going to `hostcalls` directly lets a host error become an answer or a
//! log line instead of a panic that aborts the VM.

use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType};

use crate::answer::Answer;
use crate::call::{self, Failure};
use crate::headers::HeaderMap;
use crate::host::CasMismatch;
use crate::host::Host;
use crate::metrics::Kind;

#[derive(Clone, Copy, Default)]
pub struct ProxyHost;

thread_local! {
    /// How many trailers the call answer being delivered has (the glue sets it as the
    /// callback comes): asking Envoy for a trailer of an answer that has none is refused
    /// with `BadArgument`, on which the SDK's `get_map_value_bytes` panics.
    static CALL_TRAILERS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The trailer count of the call answer `on_http_call_response` is delivering.
pub fn call_answer_has(num_trailers: usize) {
    CALL_TRAILERS.with(|n| n.set(num_trailers));
}

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

    fn request_headers(&self) -> HeaderMap {
        let serialized = serialized_map(MapType::HttpRequestHeaders).unwrap_or_default();
        HeaderMap::from_serialized(serialized).unwrap_or_else(|| {
            log::warn!("fanout: Envoy handed over request headers that do not parse");
            HeaderMap::default()
        })
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
        headers: Vec<(&str, &[u8])>,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, Failure> {
        let body = (!body.is_empty()).then_some(body);
        // The SDK's `dispatch_http_call` takes `&str` values; this one, added to the vendored
        // SDK (vendor/proxy-wasm/PATCH.md), takes the ABI's bytes.
        hostcalls::dispatch_http_call_bytes(cluster, headers, body, Vec::new(), timeout)
            .map_err(|status| refused(cluster, status))
    }

    fn dispatch_for(
        &self,
        context_id: u32,
        cluster: &str,
        headers: Vec<(&str, &[u8])>,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, Failure> {
        let body = (!body.is_empty()).then_some(body);
        hostcalls::dispatch_http_call_bytes_for(
            context_id,
            cluster,
            headers,
            body,
            Vec::new(),
            timeout,
        )
        .map_err(|status| refused(cluster, status))
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

    fn call_trailer(&self, name: &str) -> Option<String> {
        if CALL_TRAILERS.with(std::cell::Cell::get) == 0 {
            return None;
        }
        let value = hostcalls::get_map_value_bytes(MapType::HttpCallResponseTrailers, name)
            .ok()
            .flatten()?;
        String::from_utf8(value).ok()
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

    fn now_nanos(&self) -> u64 {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos() as u64)
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

// The SDK's `get_map_bytes` decodes the map into a `Vec` of owned pairs (two allocations per
// header); the core reads Envoy's serialization in place instead (`HeaderMap`), so the raw
// call is declared here, as the SDK declares it.
#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_done() -> proxy_wasm::types::Status;
    fn proxy_get_header_map_pairs(
        map_type: MapType,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> proxy_wasm::types::Status;
}

/// The serialized header map `map_type`, in one buffer the module owns; `None` if Envoy
/// refused.
fn serialized_map(map_type: MapType) -> Option<Vec<u8>> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: both pointers are valid for one write each. On `Ok`, Envoy has allocated the
    // buffer of `size` bytes through the SDK's exported `proxy_on_memory_allocate` (a boxed
    // slice of exactly `size` bytes from this module's allocator) and hands it over: it is
    // this module's to own and free, which `Vec::from_raw_parts` with that length and
    // capacity does (as the SDK's own `get_map` does). One of the crate's two unsafe blocks,
    // both here.
    #[allow(unsafe_code)]
    unsafe {
        match proxy_get_header_map_pairs(map_type, &mut data, &mut size) {
            proxy_wasm::types::Status::Ok if data.is_null() => Some(Vec::new()),
            proxy_wasm::types::Status::Ok => Some(Vec::from_raw_parts(data, size, size)),
            _ => None,
        }
    }
}

/// Tells Envoy that the current root context, which answered `false` to `on_done`, is done
/// now. The SDK's own `done` panics on a status other than `Ok`; this returns it.
pub fn root_done() -> Result<(), proxy_wasm::types::Status> {
    // SAFETY: a host call without arguments.
    #[allow(unsafe_code)]
    let status = unsafe { proxy_done() };
    match status {
        proxy_wasm::types::Status::Ok => Ok(()),
        refused => Err(refused),
    }
}

/// How Envoy refused a call at dispatch.
fn refused(cluster: &str, status: proxy_wasm::types::Status) -> Failure {
    match status {
        proxy_wasm::types::Status::BadArgument => Failure::DispatchError {
            detail: format!(
                "Envoy refused the call (BadArgument): is \"{cluster}\" a cluster Envoy knows?"
            ),
        },
        // Envoy 1.40 fails a call inline (its async client gives no request back) when the
        // cluster's circuit breaker is full; a cluster with no endpoint at all fails the same
        // way, and the two cannot be told apart here.
        proxy_wasm::types::Status::InternalFailure => call::overflow(
            cluster,
            "refused at dispatch, InternalFailure; or the cluster has no endpoint",
        ),
        other => Failure::DispatchError {
            detail: format!("Envoy refused the call ({other:?})"),
        },
    }
}
