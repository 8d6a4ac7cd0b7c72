//! Envoy's dynamic-module ABI (Envoy 1.40.0, ABI `v0.2.0`), declared by hand: the C types
//! and the callbacks Envoy exports (imported here), each behind a safe handle (`Filter`,
//! `ConfigDef`, `ConfigHandle`, `Scheduler`: a filter's or a configuration's). The hooks
//! Envoy calls are `hooks.rs`'s. With `hooks.rs`, the only module with `unsafe`; nothing
//! here decides anything.
//!
//! A pointer Envoy hands over is used only during the hook it came with, except a filter's
//! (`Filter`), which the glue drops from every table when Envoy completes or destroys that
//! filter; Envoy's buffers are copied before the hook returns.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use fanout::headers::HeaderMap;
/// The ABI version this module was written against: Envoy 1.40.0's. Envoy only warns on a
/// mismatch; what refuses an older Envoy is the import of `log_v2` (new in 1.40.0), which
/// the library's BIND_NOW linking resolves at load (`build.rs`).
pub const ABI_VERSION: &std::ffi::CStr = c"v0.2.0";

/// A buffer Envoy owns (valid during the hook or call it came with).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    pub ptr: *const u8,
    pub length: usize,
}

/// A call's answer as Envoy hands it to `on_http_filter_http_callout_done`: its headers
/// (`:status` first) and body chunks, read in place for the rest of the hook (`'a`).
#[derive(Clone, Copy)]
pub struct LentAnswer<'a> {
    headers: &'a [HttpHeader],
    chunks: &'a [EnvoyBuffer],
}

impl<'a> LentAnswer<'a> {
    /// The answer of the hook's `headers` and `body_chunks`, null when there are none.
    ///
    /// SAFETY (callers): each pointer is null or points at its count of entries, and every
    /// buffer they name is readable, for `'a` (the hook).
    pub unsafe fn from_hook(
        headers: *const HttpHeader,
        headers_size: usize,
        chunks: *const EnvoyBuffer,
        chunks_size: usize,
    ) -> LentAnswer<'a> {
        // SAFETY: as the caller promised.
        unsafe {
            LentAnswer {
                headers: entries(headers, headers_size),
                chunks: entries(chunks, chunks_size),
            }
        }
    }

    /// Each header's name and value, in Envoy's order.
    pub fn headers(&self) -> impl Iterator<Item = (&'a [u8], &'a [u8])> {
        self.headers.iter().map(|h| {
            // SAFETY: each header's buffers, readable for `'a` (`from_hook`).
            unsafe {
                (
                    bytes(h.key_ptr, h.key_length),
                    bytes(h.value_ptr, h.value_length),
                )
            }
        })
    }

    /// The body's chunks, in order.
    pub fn chunks(&self) -> impl Iterator<Item = &'a [u8]> {
        // SAFETY: each chunk's bytes, readable for `'a` (`from_hook`).
        self.chunks
            .iter()
            .map(|chunk| unsafe { bytes(chunk.ptr, chunk.length) })
    }
}

/// `n` entries at `ptr`, none if it is null.
///
/// SAFETY (callers): `ptr` is null or points at `n` entries that outlive `'a`.
unsafe fn entries<'a, T>(ptr: *const T, n: usize) -> &'a [T] {
    if ptr.is_null() || n == 0 {
        &[]
    } else {
        // SAFETY: as the caller promised.
        unsafe { std::slice::from_raw_parts(ptr, n) }
    }
}

/// A buffer the module owns, lent to Envoy for one call.
#[repr(C)]
#[derive(Clone, Copy)]
struct ModuleBuffer {
    ptr: *const u8,
    length: usize,
}

impl ModuleBuffer {
    fn of(bytes: &[u8]) -> Self {
        ModuleBuffer {
            ptr: bytes.as_ptr(),
            length: bytes.len(),
        }
    }
}

/// A call's timeout as the ABI takes it: whole milliseconds (saturating).
fn millis(timeout: Duration) -> u64 {
    u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)
}

/// A header: the same layout whoever owns the bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct HttpHeader {
    pub key_ptr: *const u8,
    pub key_length: usize,
    pub value_ptr: *const u8,
    pub value_length: usize,
}

impl HttpHeader {
    const EMPTY: HttpHeader = HttpHeader {
        key_ptr: std::ptr::null(),
        key_length: 0,
        value_ptr: std::ptr::null(),
        value_length: 0,
    };

    fn of(key: &[u8], value: &[u8]) -> Self {
        HttpHeader {
            key_ptr: key.as_ptr(),
            key_length: key.len(),
            value_ptr: value.as_ptr(),
            value_length: value.len(),
        }
    }
}

/// The headers of a call that are passed to Envoy without a heap allocation.
const CALL_HEADERS_ON_STACK: usize = 16;

// The C enums are `int`-sized.
const HEADER_TYPE_REQUEST: u32 = 0;
const BODY_TYPE_RECEIVED_REQUEST: u32 = 0;
const BODY_TYPE_BUFFERED_REQUEST: u32 = 1;
/// `envoy_dynamic_module_type_on_http_filter_*_status`' Continue, for every hook.
pub const CONTINUE: u32 = 0;
/// Request headers: StopIteration. Request body: StopIterationAndBuffer. Trailers:
/// StopIteration.
pub const STOP: u32 = 1;

unsafe extern "C" {
    /// New in Envoy 1.40.0: its import is what makes an older Envoy refuse the library.
    fn envoy_dynamic_module_callback_log_v2(
        level: u32,
        message: ModuleBuffer,
        source_file: ModuleBuffer,
        source_line: u32,
    );
    fn envoy_dynamic_module_callback_get_log_level() -> u32;
}

// A stream's request: its headers and body, its buffer limit, a local reply.
unsafe extern "C" {
    fn envoy_dynamic_module_callback_http_get_headers_size(fe: *mut c_void, kind: u32) -> usize;
    fn envoy_dynamic_module_callback_http_get_headers(
        fe: *mut c_void,
        kind: u32,
        result: *mut HttpHeader,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_get_body_size(fe: *mut c_void, kind: u32) -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks_size(fe: *mut c_void, kind: u32)
        -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks(
        fe: *mut c_void,
        kind: u32,
        result: *mut EnvoyBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_received_buffered_request_body(fe: *mut c_void) -> bool;
    fn envoy_dynamic_module_callback_http_get_buffer_limit(fe: *mut c_void) -> u64;
    fn envoy_dynamic_module_callback_http_set_buffer_limit(fe: *mut c_void, limit: u64);
    fn envoy_dynamic_module_callback_http_send_response(
        fe: *mut c_void,
        status_code: u32,
        headers: *mut HttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );
}

// A call to a cluster, made by a stream.
unsafe extern "C" {
    fn envoy_dynamic_module_callback_http_filter_http_callout(
        fe: *mut c_void,
        callout_id_out: *mut u64,
        cluster_name: ModuleBuffer,
        headers: *mut HttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_milliseconds: u64,
    ) -> u32;
}

// Metrics: defined with a configuration, changed by a stream.
unsafe extern "C" {
    fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: *mut c_void,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        id_out: *mut usize,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        config: *mut c_void,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        id_out: *mut usize,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_define_histogram(
        config: *mut c_void,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        id_out: *mut usize,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_increment_counter(
        fe: *mut c_void,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_increment_gauge(
        fe: *mut c_void,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_decrement_gauge(
        fe: *mut c_void,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_record_histogram_value(
        fe: *mut c_void,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
}

// A configuration's own calls, metrics and scheduler: its context on Envoy's main thread.
unsafe extern "C" {
    fn envoy_dynamic_module_callback_http_filter_config_start_http_stream(
        config: *mut c_void,
        stream_id_out: *mut u64,
        cluster_name: ModuleBuffer,
        headers: *mut HttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        end_stream: bool,
        timeout_milliseconds: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        config: *mut c_void,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_increment_gauge(
        config: *mut c_void,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_decrement_gauge(
        config: *mut c_void,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_record_histogram_value(
        config: *mut c_void,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(
        config: *mut c_void,
    ) -> *mut c_void;
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
        scheduler: *mut c_void,
        event_id: u64,
    );
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(scheduler: *mut c_void);
}

// A filter's scheduler: the timer thread's way to wake a worker.
unsafe extern "C" {
    fn envoy_dynamic_module_callback_http_filter_scheduler_new(fe: *mut c_void) -> *mut c_void;
    fn envoy_dynamic_module_callback_http_filter_scheduler_commit(
        scheduler: *mut c_void,
        event_id: u64,
    );
    fn envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler: *mut c_void);
}

/// The bytes of an Envoy buffer, for the rest of the hook.
///
/// SAFETY (callers): `ptr` is null or points at `length` readable bytes that outlive `'a`.
pub unsafe fn bytes<'a>(ptr: *const u8, length: usize) -> &'a [u8] {
    if ptr.is_null() || length == 0 {
        &[]
    } else {
        // SAFETY: as the caller promised.
        unsafe { std::slice::from_raw_parts(ptr, length) }
    }
}

/// Envoy's log line, at `level` (0 trace … 5 critical), with the Rust source location.
pub fn log(level: u32, message: &str, file: &str, line: u32) {
    // SAFETY: three buffers valid for the call; Envoy copies them.
    unsafe {
        envoy_dynamic_module_callback_log_v2(
            level,
            ModuleBuffer::of(message.as_bytes()),
            ModuleBuffer::of(file.as_bytes()),
            line,
        );
    }
}

/// The level of Envoy's `dynamic_modules` logger (0 trace … 6 off).
pub fn log_level() -> u32 {
    // SAFETY: no arguments.
    unsafe { envoy_dynamic_module_callback_get_log_level() }
}

/// A metric's kind, as the ABI defines each kind apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// A filter configuration during `on_http_filter_config_new`, the only time Envoy lets a
/// module define metrics.
#[derive(Clone, Copy)]
pub struct ConfigDef(NonNull<c_void>);

impl ConfigDef {
    /// The handle of the configuration pointer `on_http_filter_config_new` was given.
    pub fn from_hook(ptr: *mut c_void) -> Option<ConfigDef> {
        NonNull::new(ptr).map(ConfigDef)
    }

    /// Defines the metric `name` (without labels): its id, `None` if Envoy refused.
    pub fn define(&self, kind: MetricKind, name: &str) -> Option<usize> {
        let define = match kind {
            MetricKind::Counter => envoy_dynamic_module_callback_http_filter_config_define_counter,
            MetricKind::Gauge => envoy_dynamic_module_callback_http_filter_config_define_gauge,
            MetricKind::Histogram => {
                envoy_dynamic_module_callback_http_filter_config_define_histogram
            }
        };
        let mut id: usize = 0;
        // SAFETY: the config pointer is the one of the running `config_new`; the name is
        // valid for the call (Envoy copies it); no labels; `id` is valid for one write.
        let result = unsafe {
            define(
                self.0.as_ptr(),
                ModuleBuffer::of(name.as_bytes()),
                std::ptr::null_mut(),
                0,
                &mut id,
            )
        };
        (result == 0).then_some(id)
    }
}

/// One HTTP filter (one stream) of Envoy, on its worker. Made only from the pointer Envoy
/// hands a hook; the glue keeps it no longer than the filter lives (it forgets it when Envoy
/// completes or destroys the stream), so every call below acts on a live filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Filter(NonNull<c_void>);

impl Filter {
    /// The handle of the filter pointer a hook was given.
    pub fn from_hook(fe: *mut c_void) -> Option<Filter> {
        NonNull::new(fe).map(Filter)
    }

    fn ptr(self) -> *mut c_void {
        self.0.as_ptr()
    }

    /// Every request header, copied.
    pub fn request_headers(self) -> HeaderMap {
        // SAFETY: a live filter; `headers` has room for the `n` entries Envoy writes; each
        // is read (and copied by `from_pairs`) before this returns.
        unsafe {
            let n = envoy_dynamic_module_callback_http_get_headers_size(
                self.ptr(),
                HEADER_TYPE_REQUEST,
            );
            let mut headers = vec![HttpHeader::EMPTY; n];
            if n == 0
                || !envoy_dynamic_module_callback_http_get_headers(
                    self.ptr(),
                    HEADER_TYPE_REQUEST,
                    headers.as_mut_ptr(),
                )
            {
                return HeaderMap::default();
            }
            let pairs: Vec<(&[u8], &[u8])> = headers
                .iter()
                .map(|h| {
                    (
                        bytes(h.key_ptr, h.key_length),
                        bytes(h.value_ptr, h.value_length),
                    )
                })
                .collect();
            HeaderMap::from_pairs(&pairs)
        }
    }

    /// The request body's size so far: what Envoy buffered, and what it just received if
    /// that is not in the buffer yet.
    pub fn request_body_size(self) -> usize {
        // SAFETY: a live filter.
        unsafe {
            let buffered = envoy_dynamic_module_callback_http_get_body_size(
                self.ptr(),
                BODY_TYPE_BUFFERED_REQUEST,
            );
            if envoy_dynamic_module_callback_http_received_buffered_request_body(self.ptr()) {
                return buffered;
            }
            buffered.saturating_add(envoy_dynamic_module_callback_http_get_body_size(
                self.ptr(),
                BODY_TYPE_RECEIVED_REQUEST,
            ))
        }
    }

    /// The request body so far (as [`Filter::request_body_size`] counts it), copied.
    pub fn request_body(self) -> Vec<u8> {
        let mut body = Vec::with_capacity(self.request_body_size());
        self.append_body(BODY_TYPE_BUFFERED_REQUEST, &mut body);
        // SAFETY: a live filter.
        let same = unsafe {
            envoy_dynamic_module_callback_http_received_buffered_request_body(self.ptr())
        };
        if !same {
            self.append_body(BODY_TYPE_RECEIVED_REQUEST, &mut body);
        }
        body
    }

    fn append_body(self, kind: u32, body: &mut Vec<u8>) {
        // SAFETY: a live filter; `chunks` has room for the `n` buffers Envoy writes, each
        // copied before this returns.
        unsafe {
            let n = envoy_dynamic_module_callback_http_get_body_chunks_size(self.ptr(), kind);
            let mut chunks = vec![
                EnvoyBuffer {
                    ptr: std::ptr::null(),
                    length: 0
                };
                n
            ];
            if n > 0
                && envoy_dynamic_module_callback_http_get_body_chunks(
                    self.ptr(),
                    kind,
                    chunks.as_mut_ptr(),
                )
            {
                for chunk in &chunks {
                    body.extend_from_slice(bytes(chunk.ptr, chunk.length));
                }
            }
        }
    }

    /// How much request body Envoy holds for this stream before it answers 413 itself.
    pub fn buffer_limit(self) -> u64 {
        // SAFETY: a live filter.
        unsafe { envoy_dynamic_module_callback_http_get_buffer_limit(self.ptr()) }
    }

    pub fn set_buffer_limit(self, limit: u64) {
        // SAFETY: a live filter.
        unsafe { envoy_dynamic_module_callback_http_set_buffer_limit(self.ptr(), limit) }
    }

    /// Answers the stream locally. Envoy may complete the stream (and call its hooks)
    /// before this returns.
    pub fn send_response(self, status: u32, headers: &[(&str, &[u8])], body: &[u8], details: &str) {
        let mut headers: Vec<HttpHeader> = headers
            .iter()
            .map(|(name, value)| HttpHeader::of(name.as_bytes(), value))
            .collect();
        // SAFETY: a live filter; every buffer is valid for the call (Envoy copies them).
        unsafe {
            envoy_dynamic_module_callback_http_send_response(
                self.ptr(),
                status,
                headers.as_mut_ptr(),
                headers.len(),
                ModuleBuffer::of(body),
                ModuleBuffer::of(details.as_bytes()),
            );
        }
    }

    /// Starts a call from this stream: Envoy's callout id (per stream), or the ABI's
    /// refusal code (2: no such cluster).
    pub fn callout(
        self,
        cluster: &str,
        headers: &[(&str, &[u8])],
        body: &[u8],
        timeout: Duration,
    ) -> Result<u64, u32> {
        with_headers(headers, |list| {
            let mut id: u64 = 0;
            // SAFETY: a live filter; every buffer is valid for the call (Envoy copies them);
            // `id` is valid for one write.
            let result = unsafe {
                envoy_dynamic_module_callback_http_filter_http_callout(
                    self.ptr(),
                    &mut id,
                    ModuleBuffer::of(cluster.as_bytes()),
                    list.as_mut_ptr(),
                    list.len(),
                    ModuleBuffer::of(body),
                    millis(timeout),
                )
            };
            started(result, id)
        })
    }

    /// Adds to, or takes from, a metric this filter's configuration defined.
    pub fn update_metric(self, kind: MetricKind, id: usize, delta: i64) {
        const UPDATES: MetricUpdates = [
            envoy_dynamic_module_callback_http_filter_increment_counter,
            envoy_dynamic_module_callback_http_filter_increment_gauge,
            envoy_dynamic_module_callback_http_filter_decrement_gauge,
            envoy_dynamic_module_callback_http_filter_record_histogram_value,
        ];
        // SAFETY: a live filter.
        unsafe { update_metric(&UPDATES, self.ptr(), kind, id, delta) }
    }
}

/// A metric's updates in the ABI, by a filter or by a configuration (the same signature):
/// increment a counter, increment and decrement a gauge, record a histogram value.
type MetricUpdate = unsafe extern "C" fn(*mut c_void, usize, *mut ModuleBuffer, usize, u64) -> u32;
type MetricUpdates = [MetricUpdate; 4];

/// Adds `delta` to metric `id` of kind `kind` (a negative one takes from a gauge), without
/// labels, through `updates`.
///
/// SAFETY (callers): `ptr` is what `updates` takes: a live filter, or a configuration Envoy
/// holds on the main thread.
unsafe fn update_metric(
    updates: &MetricUpdates,
    ptr: *mut c_void,
    kind: MetricKind,
    id: usize,
    delta: i64,
) {
    let [counter, gauge_up, gauge_down, histogram] = *updates;
    let update = match (kind, delta >= 0) {
        (MetricKind::Counter, _) => counter,
        (MetricKind::Gauge, true) => gauge_up,
        (MetricKind::Gauge, false) => gauge_down,
        (MetricKind::Histogram, _) => histogram,
    };
    // SAFETY: as the caller promised; no labels.
    unsafe {
        update(ptr, id, std::ptr::null_mut(), 0, delta.unsigned_abs());
    }
}

/// A call's id, or the ABI's refusal code (`envoy_dynamic_module_type_http_callout_init_result`).
fn started(result: u32, id: u64) -> Result<u64, u32> {
    if result == 0 {
        Ok(id)
    } else {
        Err(result)
    }
}

/// `headers` as the ABI's list, lent to `call`: on the stack when they fit (every call
/// builds this list), else on the heap.
fn with_headers<R>(headers: &[(&str, &[u8])], call: impl FnOnce(&mut [HttpHeader]) -> R) -> R {
    let mut room = [HttpHeader::EMPTY; CALL_HEADERS_ON_STACK];
    match room.get_mut(..headers.len()) {
        Some(list) => {
            for (slot, (name, value)) in list.iter_mut().zip(headers) {
                *slot = HttpHeader::of(name.as_bytes(), value);
            }
            call(list)
        }
        None => {
            let mut spilled: Vec<HttpHeader> = headers
                .iter()
                .map(|(name, value)| HttpHeader::of(name.as_bytes(), value))
                .collect();
            call(&mut spilled)
        }
    }
}

/// A filter configuration of Envoy's, kept past `config_new` for the configuration's own
/// context on Envoy's main thread (`hub.rs`): its calls, its metrics, its scheduler. Envoy
/// lets these be used on the main thread only; the hub uses it there, and only while
/// Envoy holds the configuration (the hub is dropped in `config_destroy`, and Envoy runs
/// the hub's hooks only for a configuration it still holds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConfigHandle(NonNull<c_void>);

// SAFETY: a pointer kept by a configuration every thread shares, but only used on Envoy's
// main thread (see above), except the scheduler's commit, which Envoy makes thread-safe.
unsafe impl Send for ConfigHandle {}
// SAFETY: as `Send`.
unsafe impl Sync for ConfigHandle {}

impl ConfigHandle {
    /// The handle of the configuration pointer `on_http_filter_config_new` was given.
    pub fn from_hook(ptr: *mut c_void) -> Option<ConfigHandle> {
        NonNull::new(ptr).map(ConfigHandle)
    }

    /// Starts a call of the configuration's (main thread), the whole request sent at once:
    /// Envoy's stream id, or the ABI's refusal code, as [`Filter::callout`]. A stream, not
    /// a one-shot call, because Envoy hands a one-shot call's answer over without its
    /// trailers (a gRPC answer's `grpc-status`); a stream's come in their own hook.
    pub fn start_call(
        self,
        cluster: &str,
        headers: &[(&str, &[u8])],
        body: &[u8],
        timeout: Duration,
    ) -> Result<u64, u32> {
        with_headers(headers, |list| {
            let mut id: u64 = 0;
            // SAFETY: a configuration Envoy holds, on the main thread; every buffer is valid
            // for the call (Envoy copies them); `id` is valid for one write.
            let result = unsafe {
                envoy_dynamic_module_callback_http_filter_config_start_http_stream(
                    self.0.as_ptr(),
                    &mut id,
                    ModuleBuffer::of(cluster.as_bytes()),
                    list.as_mut_ptr(),
                    list.len(),
                    ModuleBuffer::of(body),
                    true,
                    millis(timeout),
                )
            };
            started(result, id)
        })
    }

    /// Adds to, or takes from, a metric of this configuration (main thread).
    pub fn update_metric(self, kind: MetricKind, id: usize, delta: i64) {
        const UPDATES: MetricUpdates = [
            envoy_dynamic_module_callback_http_filter_config_increment_counter,
            envoy_dynamic_module_callback_http_filter_config_increment_gauge,
            envoy_dynamic_module_callback_http_filter_config_decrement_gauge,
            envoy_dynamic_module_callback_http_filter_config_record_histogram_value,
        ];
        // SAFETY: a configuration Envoy holds, on the main thread.
        unsafe { update_metric(&UPDATES, self.0.as_ptr(), kind, id, delta) }
    }

    /// A new scheduler of this configuration: a commit, from any thread, posts
    /// `on_http_filter_config_scheduled` to the main thread.
    pub fn scheduler(self) -> Option<Arc<Scheduler>> {
        // SAFETY: a configuration Envoy holds (called from `config_new`).
        let ptr = unsafe {
            envoy_dynamic_module_callback_http_filter_config_scheduler_new(self.0.as_ptr())
        };
        Scheduler::of(ptr, &CONFIG_SCHEDULER)
    }
}

/// An Envoy scheduler, a filter's or a configuration's: a commit, from any thread, posts
/// `on_http_filter_scheduled` to the filter's worker, or `on_http_filter_config_scheduled` to
/// the main thread (nothing comes once the filter or configuration is gone: the scheduler
/// holds it weakly). Deleted when dropped: held in an `Arc` by whoever may commit, the last
/// holder deletes it, so no commit ever follows the delete.
pub struct Scheduler {
    ptr: NonNull<c_void>,
    ops: &'static SchedulerOps,
}

/// The ABI's commit and delete of one kind of scheduler.
struct SchedulerOps {
    commit: unsafe extern "C" fn(*mut c_void, u64),
    delete: unsafe extern "C" fn(*mut c_void),
}

const FILTER_SCHEDULER: SchedulerOps = SchedulerOps {
    commit: envoy_dynamic_module_callback_http_filter_scheduler_commit,
    delete: envoy_dynamic_module_callback_http_filter_scheduler_delete,
};

const CONFIG_SCHEDULER: SchedulerOps = SchedulerOps {
    commit: envoy_dynamic_module_callback_http_filter_config_scheduler_commit,
    delete: envoy_dynamic_module_callback_http_filter_config_scheduler_delete,
};

// SAFETY: Envoy's schedulers only post to a dispatcher (a worker's or the main thread's),
// which is thread-safe, and may be deleted from any thread (they hold their filter or
// configuration weakly); `Drop` deletes one once.
unsafe impl Send for Scheduler {}
// SAFETY: `commit` takes `&self` and only posts (see `Send`).
unsafe impl Sync for Scheduler {}

impl Scheduler {
    fn of(ptr: *mut c_void, ops: &'static SchedulerOps) -> Option<Arc<Scheduler>> {
        NonNull::new(ptr).map(|ptr| Arc::new(Scheduler { ptr, ops }))
    }
}

impl crate::timer::Wake for Scheduler {
    fn commit(&self, event: u64) {
        // SAFETY: a scheduler not deleted yet (we are one of its holders), of `ops`' kind.
        unsafe { (self.ops.commit)(self.ptr.as_ptr(), event) }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // SAFETY: the last holder, once, of `ops`' kind.
        unsafe { (self.ops.delete)(self.ptr.as_ptr()) }
    }
}

impl Filter {
    /// A new scheduler of this (live) filter.
    pub fn scheduler(self) -> Option<Arc<Scheduler>> {
        // SAFETY: a live filter, on its worker.
        let ptr = unsafe { envoy_dynamic_module_callback_http_filter_scheduler_new(self.ptr()) };
        Scheduler::of(ptr, &FILTER_SCHEDULER)
    }
}
