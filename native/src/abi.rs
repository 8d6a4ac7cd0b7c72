//! Envoy's dynamic-module ABI (Envoy 1.40.0, ABI `v0.2.0`), declared by hand: the only
//! module with `unsafe`. It holds the C types, the callbacks Envoy exports (imported here),
//! and every hook Envoy calls (exported here), each a thin wrapper that turns Envoy's raw
//! pointers and buffers into the safe handles below and calls the safe glue (`glue.rs`).
//! Nothing here decides anything.
//!
//! Rules every hook keeps: it never panics (the crate is built with `panic = "abort"`: a
//! panic would abort Envoy); a pointer Envoy hands over is used only during the hook it came
//! with, except a filter's (`Filter`), which the glue drops from every table when Envoy
//! completes or destroys that filter; Envoy's buffers are copied before the hook returns.

use std::ffi::{c_char, c_void};
use std::ptr::NonNull;
use std::sync::Arc;

use fanout::headers::HeaderMap;

use crate::glue::{self, CallAnswer, FilterState, NativeConfig};

/// The ABI version this module was written against: Envoy 1.40.0's. Envoy only warns on a
/// mismatch; what refuses an older Envoy is the import of `log_v2` (new in 1.40.0), which
/// the library's BIND_NOW linking resolves at load (`build.rs`).
pub const ABI_VERSION: &std::ffi::CStr = c"v0.2.0";

/// A buffer Envoy owns (valid during the hook or call it came with).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    ptr: *const u8,
    length: usize,
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

/// A header: the same layout whoever owns the bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct HttpHeader {
    key_ptr: *const u8,
    key_length: usize,
    value_ptr: *const u8,
    value_length: usize,
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
    fn envoy_dynamic_module_callback_http_filter_http_callout(
        fe: *mut c_void,
        callout_id_out: *mut u64,
        cluster_name: ModuleBuffer,
        headers: *mut HttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_milliseconds: u64,
    ) -> u32;
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
unsafe fn bytes<'a>(ptr: *const u8, length: usize) -> &'a [u8] {
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
        timeout_ms: u64,
    ) -> Result<u64, u32> {
        let mut headers: Vec<HttpHeader> = headers
            .iter()
            .map(|(name, value)| HttpHeader::of(name.as_bytes(), value))
            .collect();
        let mut id: u64 = 0;
        // SAFETY: a live filter; every buffer is valid for the call (Envoy copies them);
        // `id` is valid for one write.
        let result = unsafe {
            envoy_dynamic_module_callback_http_filter_http_callout(
                self.ptr(),
                &mut id,
                ModuleBuffer::of(cluster.as_bytes()),
                headers.as_mut_ptr(),
                headers.len(),
                ModuleBuffer::of(body),
                timeout_ms,
            )
        };
        if result == 0 {
            Ok(id)
        } else {
            Err(result)
        }
    }

    /// Adds to, or takes from, a metric this filter's configuration defined.
    pub fn update_metric(self, kind: MetricKind, id: usize, delta: i64) {
        let update = match (kind, delta >= 0) {
            (MetricKind::Counter, _) => envoy_dynamic_module_callback_http_filter_increment_counter,
            (MetricKind::Gauge, true) => envoy_dynamic_module_callback_http_filter_increment_gauge,
            (MetricKind::Gauge, false) => envoy_dynamic_module_callback_http_filter_decrement_gauge,
            (MetricKind::Histogram, _) => {
                envoy_dynamic_module_callback_http_filter_record_histogram_value
            }
        };
        // SAFETY: a live filter; no labels.
        unsafe {
            update(
                self.ptr(),
                id,
                std::ptr::null_mut(),
                0,
                delta.unsigned_abs(),
            );
        }
    }
}

/// A filter's scheduler: a commit, from any thread, posts `on_http_filter_scheduled` to the
/// filter's worker (nothing comes once the filter is gone: Envoy's scheduler holds it
/// weakly). Deleted when dropped: held in an `Arc` by whoever may commit, the last holder
/// deletes it, so no commit ever follows the delete.
pub struct Scheduler(NonNull<c_void>);

// SAFETY: Envoy's scheduler only posts to its worker's dispatcher, which is thread-safe, and
// may be deleted from any thread (it holds the filter weakly); `Drop` deletes it once.
unsafe impl Send for Scheduler {}
// SAFETY: `commit` takes `&self` and only posts (see `Send`).
unsafe impl Sync for Scheduler {}

impl crate::timer::Wake for Scheduler {
    fn commit(&self, event: u64) {
        // SAFETY: a scheduler not deleted yet (we are one of its holders).
        unsafe {
            envoy_dynamic_module_callback_http_filter_scheduler_commit(self.0.as_ptr(), event)
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // SAFETY: the last holder, once.
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_delete(self.0.as_ptr()) }
    }
}

impl Filter {
    /// A new scheduler of this (live) filter.
    pub fn scheduler(self) -> Option<Arc<Scheduler>> {
        // SAFETY: a live filter, on its worker.
        let ptr = unsafe { envoy_dynamic_module_callback_http_filter_scheduler_new(self.ptr()) };
        NonNull::new(ptr).map(|ptr| Arc::new(Scheduler(ptr)))
    }
}

/// The filter state behind a module pointer Envoy hands back, for the hook.
///
/// SAFETY (callers): `fm` is null or a pointer `on_http_filter_new` returned that
/// `on_http_filter_destroy` has not taken back.
unsafe fn state<'a>(fm: *const c_void) -> Option<&'a FilterState> {
    // SAFETY: as the caller promised: a `Box<FilterState>` Envoy holds for us.
    unsafe { fm.cast::<FilterState>().as_ref() }
}

fn filter(fe: *mut c_void) -> Option<Filter> {
    NonNull::new(fe).map(Filter)
}

// ---------------------------------------------------------------------------------------
// The hooks Envoy calls. Each one: pointers into handles, then the glue.

/// Main thread, once per process: the ABI version, or NULL to refuse the library.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    glue::program_init();
    ABI_VERSION.as_ptr()
}

/// Main thread: a filter configuration (`filter_config`); NULL refuses it.
///
/// SAFETY: Envoy passes its config pointer and two buffers valid for the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    config_envoy_ptr: *mut c_void,
    name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> *const c_void {
    let Some(def) = NonNull::new(config_envoy_ptr).map(ConfigDef) else {
        return std::ptr::null();
    };
    // SAFETY: Envoy's buffers, valid for this call; copied by the glue.
    let (name, config) = unsafe {
        (
            bytes(name.ptr, name.length),
            bytes(config.ptr, config.length),
        )
    };
    match glue::config_new(&def, name, config) {
        Some(config) => Box::into_raw(Box::new(config)).cast_const().cast(),
        None => std::ptr::null(),
    }
}

/// Main thread: Envoy is done with a configuration (its filters hold their own reference).
///
/// SAFETY: `config_module_ptr` is what `config_new` returned, handed back once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(
    config_module_ptr: *const c_void,
) {
    if !config_module_ptr.is_null() {
        // SAFETY: the `Box<Arc<NativeConfig>>` `config_new` made, taken back once.
        let config =
            unsafe { Box::from_raw(config_module_ptr.cast::<Arc<NativeConfig>>().cast_mut()) };
        glue::config_destroy(&config);
    }
}

/// A stream's worker: a new filter of that configuration; NULL closes the stream.
///
/// SAFETY: `config_module_ptr` is a live configuration of ours, `fe` Envoy's filter.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config_module_ptr: *const c_void,
    fe: *mut c_void,
) -> *const c_void {
    // SAFETY: a `Box<Arc<NativeConfig>>` from `config_new` that Envoy has not destroyed.
    let config = unsafe { config_module_ptr.cast::<Arc<NativeConfig>>().as_ref() };
    match (config, filter(fe)) {
        (Some(config), Some(fe)) => match glue::filter_new(config, fe) {
            Some(state) => Box::into_raw(state).cast_const().cast(),
            None => std::ptr::null(),
        },
        _ => std::ptr::null(),
    }
}

/// The filter is gone: its state is dropped.
///
/// SAFETY: `fm` is what `filter_new` returned, handed back once. Envoy destroys a filter
/// from its worker's deferred deletion, never inside one of that filter's own hooks, so no
/// `&FilterState` of a running hook outlives the box.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(fm: *const c_void) {
    if !fm.is_null() {
        // SAFETY: the `Box<FilterState>` `filter_new` made, taken back once.
        glue::destroy(unsafe { Box::from_raw(fm.cast::<FilterState>().cast_mut()) });
    }
}

/// SAFETY (every stream hook below): `fe` is Envoy's live filter, `fm` ours for it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    fe: *mut c_void,
    fm: *const c_void,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: see above.
    match (filter(fe), unsafe { state(fm) }) {
        (Some(fe), Some(state)) => glue::request_headers(state, fe, end_of_stream),
        _ => CONTINUE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    fe: *mut c_void,
    fm: *const c_void,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: see `request_headers`.
    match (filter(fe), unsafe { state(fm) }) {
        (Some(fe), Some(state)) => glue::request_body(state, fe, end_of_stream),
        _ => CONTINUE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    fe: *mut c_void,
    fm: *const c_void,
) -> u32 {
    // SAFETY: see `request_headers`.
    match (filter(fe), unsafe { state(fm) }) {
        (Some(fe), Some(state)) => glue::request_trailers(state, fe),
        _ => CONTINUE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    fe: *mut c_void,
    fm: *const c_void,
    _end_of_stream: bool,
) -> u32 {
    // SAFETY: see `request_headers`.
    match (filter(fe), unsafe { state(fm) }) {
        (Some(fe), Some(state)) => glue::response_headers(state, fe),
        _ => CONTINUE,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    _fe: *mut c_void,
    _fm: *const c_void,
    _end_of_stream: bool,
) -> u32 {
    CONTINUE
}

#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    _fe: *mut c_void,
    _fm: *const c_void,
) -> u32 {
    CONTINUE
}

/// The stream is over (answered, or its client left): Envoy may call this inside another
/// hook of the same worker (a local reply sent to this stream from another one).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    fe: *mut c_void,
    fm: *const c_void,
) {
    // SAFETY: see `request_headers`.
    if let (Some(fe), Some(state)) = (filter(fe), unsafe { state(fm) }) {
        glue::stream_complete(state, fe);
    }
}

/// The answer to a call this stream made: its headers (`:status` first) and body chunks,
/// valid during the hook only (copied here). One-shot calls carry no trailers.
///
/// SAFETY: as the stream hooks; `headers` and `body_chunks` point at the counts given.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    fe: *mut c_void,
    fm: *const c_void,
    callout_id: u64,
    _result: u32,
    headers: *const HttpHeader,
    headers_size: usize,
    body_chunks: *const EnvoyBuffer,
    body_chunks_size: usize,
) {
    // SAFETY: see `request_headers`.
    let (Some(fe), Some(state)) = (filter(fe), unsafe { state(fm) }) else {
        return;
    };
    let mut answer = CallAnswer::default();
    if !headers.is_null() {
        // SAFETY: Envoy's `headers_size` headers, valid during the hook.
        let headers = unsafe { std::slice::from_raw_parts(headers, headers_size) };
        for h in headers {
            // SAFETY: each header's buffers, valid during the hook; copied.
            let (name, value) = unsafe {
                (
                    bytes(h.key_ptr, h.key_length),
                    bytes(h.value_ptr, h.value_length),
                )
            };
            answer
                .headers
                .push((String::from_utf8_lossy(name).into_owned(), value.to_vec()));
        }
    }
    if !body_chunks.is_null() {
        // SAFETY: Envoy's `body_chunks_size` chunks, valid during the hook.
        let chunks = unsafe { std::slice::from_raw_parts(body_chunks, body_chunks_size) };
        for chunk in chunks {
            // SAFETY: each chunk's bytes, valid during the hook; copied.
            answer
                .body
                .extend_from_slice(unsafe { bytes(chunk.ptr, chunk.length) });
        }
    }
    glue::callout_done(state, fe, callout_id, answer);
}

// The hooks Envoy 1.40.0 requires of an HTTP filter module, which fanout does not use:
// streamed calls, watermarks.

#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _fe: *mut c_void,
    _fm: *const c_void,
    _stream_id: u64,
    _headers: *const HttpHeader,
    _headers_size: usize,
    _end_stream: bool,
) {
}

#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _fe: *mut c_void,
    _fm: *const c_void,
    _stream_id: u64,
    _data: *const EnvoyBuffer,
    _data_count: usize,
    _end_stream: bool,
) {
}

#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _fe: *mut c_void,
    _fm: *const c_void,
    _stream_id: u64,
    _trailers: *const HttpHeader,
    _trailers_size: usize,
) {
}

#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _fe: *mut c_void,
    _fm: *const c_void,
    _stream_id: u64,
) {
}

#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _fe: *mut c_void,
    _fm: *const c_void,
    _stream_id: u64,
    _reason: u32,
) {
}

/// A commit to one of this filter's schedulers (the timer's wake-up): on the worker.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    fe: *mut c_void,
    fm: *const c_void,
    event_id: u64,
) {
    // SAFETY: see `request_headers`.
    if let (Some(fe), Some(state)) = (filter(fe), unsafe { state(fm) }) {
        glue::scheduled(state, fe, event_id);
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _fe: *mut c_void,
    _fm: *const c_void,
) {
}

#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _fe: *mut c_void,
    _fm: *const c_void,
) {
}
