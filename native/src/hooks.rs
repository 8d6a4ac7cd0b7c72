//! The hooks Envoy calls (exported here): each a thin wrapper that turns Envoy's raw
//! pointers and buffers into `abi.rs`'s safe handles and calls the safe glue (`glue.rs`).
//! With `abi.rs`, the only module with `unsafe`; nothing here decides anything.
//!
//! Rules every hook keeps: it never panics (the crate is built with `panic = "abort"`: a
//! panic would abort Envoy); a pointer Envoy hands over is used only during the hook it came
//! with, except a filter's (`Filter`); Envoy's buffers are copied before the hook returns.

use std::ffi::{c_char, c_void};
use std::sync::Arc;

use crate::abi::{
    bytes, ConfigDef, ConfigHandle, EnvoyBuffer, Filter, HttpHeader, LentAnswer, ABI_VERSION,
    CONTINUE,
};
use crate::glue::{self, FilterModule};
use crate::host::NativeConfig;
use crate::hub;

/// The filter state behind a module pointer Envoy hands back, for the hook.
///
/// SAFETY (callers): `fm` is null or a pointer `on_http_filter_new` returned that
/// `on_http_filter_destroy` has not taken back.
unsafe fn state<'a>(fm: *const c_void) -> Option<&'a FilterModule> {
    // SAFETY: as the caller promised: a `Box<FilterModule>` Envoy holds for us.
    unsafe { fm.cast::<FilterModule>().as_ref() }
}

/// The configuration behind a module pointer Envoy hands back, for the hook.
///
/// SAFETY (callers): `cm` is null or a pointer `on_http_filter_config_new` returned that
/// `on_http_filter_config_destroy` has not taken back.
unsafe fn config<'a>(cm: *const c_void) -> Option<&'a Arc<NativeConfig>> {
    // SAFETY: as the caller promised: a `Box<Arc<NativeConfig>>` Envoy holds for us.
    unsafe { cm.cast::<Arc<NativeConfig>>().as_ref() }
}

fn filter(fe: *mut c_void) -> Option<Filter> {
    Filter::from_hook(fe)
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
    let (Some(def), Some(handle)) = (
        ConfigDef::from_hook(config_envoy_ptr),
        ConfigHandle::from_hook(config_envoy_ptr),
    ) else {
        return std::ptr::null();
    };
    // SAFETY: Envoy's buffers, valid for this call; copied by the glue.
    let (name, config) = unsafe {
        (
            bytes(name.ptr, name.length),
            bytes(config.ptr, config.length),
        )
    };
    match glue::config_new(&def, handle, name, config) {
        Some(config) => Box::into_raw(Box::new(config)).cast_const().cast(),
        None => std::ptr::null(),
    }
}

/// Envoy is done with a configuration (its filters hold their own reference): on the main
/// thread, or on the worker whose stream held the last reference.
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
    // SAFETY: a configuration of ours that Envoy has not destroyed.
    let config = unsafe { config(config_module_ptr) };
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
        // SAFETY: the `Box<FilterModule>` `filter_new` made, taken back once.
        glue::destroy(unsafe { Box::from_raw(fm.cast::<FilterModule>().cast_mut()) });
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
        (Some(fe), Some(FilterModule::Local(state))) => {
            glue::request_headers(state, fe, end_of_stream)
        }
        (Some(fe), Some(FilterModule::Relayed(state))) => {
            hub::request_headers(state, fe, end_of_stream)
        }
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
        (Some(fe), Some(FilterModule::Local(state))) => {
            glue::request_body(state, fe, end_of_stream)
        }
        (Some(fe), Some(FilterModule::Relayed(state))) => {
            hub::request_body(state, fe, end_of_stream)
        }
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
        (Some(fe), Some(FilterModule::Local(state))) => glue::request_trailers(state, fe),
        (Some(fe), Some(FilterModule::Relayed(state))) => hub::request_trailers(state, fe),
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
        (Some(fe), Some(FilterModule::Local(state))) => glue::response_headers(state, fe),
        (Some(_), Some(FilterModule::Relayed(state))) => hub::response_headers(state),
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
    match (filter(fe), unsafe { state(fm) }) {
        (Some(fe), Some(FilterModule::Local(state))) => glue::stream_complete(state, fe),
        (Some(_), Some(FilterModule::Relayed(state))) => hub::over(state),
        _ => {}
    }
}

/// The answer to a call this stream made: its headers (`:status` first) and body chunks,
/// valid during the hook only (read in place, copied by the glue). One-shot calls carry no
/// trailers.
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
    let (Some(fe), Some(FilterModule::Local(state))) = (filter(fe), unsafe { state(fm) }) else {
        return;
    };
    // SAFETY: Envoy's `headers_size` headers and `body_chunks_size` chunks, valid during
    // the hook; the glue copies what it keeps.
    let answer =
        unsafe { LentAnswer::from_hook(headers, headers_size, body_chunks, body_chunks_size) };
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
    match (filter(fe), unsafe { state(fm) }) {
        (Some(fe), Some(FilterModule::Local(state))) => glue::scheduled(state, fe, event_id),
        (Some(fe), Some(FilterModule::Relayed(state))) => hub::relay_scheduled(state, fe),
        _ => {}
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

// The configuration's own context, on the main thread (`hub.rs`).

/// A commit to a configuration's scheduler: its hub's turn, on the main thread.
///
/// SAFETY: `config_module_ptr` is null (Envoy is destroying the configuration) or a live
/// configuration of ours.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    _config_envoy_ptr: *mut c_void,
    config_module_ptr: *const c_void,
    _event_id: u64,
) {
    // SAFETY: see above.
    if let Some(config) = unsafe { config(config_module_ptr) } {
        hub::scheduled(config);
    }
}

/// A call of a configuration's hub, on the main thread (a stream: its answer comes in
/// parts, trailers included): its headers.
///
/// SAFETY: as `config_scheduled`; `headers` points at `headers_size` headers, valid during
/// the hook (the hub copies them).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_headers(
    _config_envoy_ptr: *mut c_void,
    config_module_ptr: *const c_void,
    stream_id: u64,
    headers: *const HttpHeader,
    headers_size: usize,
    _end_stream: bool,
) {
    // SAFETY: see above.
    if let Some(config) = unsafe { config(config_module_ptr) } {
        // SAFETY: see above.
        let part = unsafe { LentAnswer::from_hook(headers, headers_size, std::ptr::null(), 0) };
        hub::call_part(config, stream_id, part, false);
    }
}

/// A chunk of the answer's body.
///
/// SAFETY: as `config_scheduled`; `data` points at `data_count` buffers, valid during the
/// hook (the hub copies them).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_data(
    _config_envoy_ptr: *mut c_void,
    config_module_ptr: *const c_void,
    stream_id: u64,
    data: *const EnvoyBuffer,
    data_count: usize,
    _end_stream: bool,
) {
    // SAFETY: see above.
    if let Some(config) = unsafe { config(config_module_ptr) } {
        // SAFETY: see above.
        let part = unsafe { LentAnswer::from_hook(std::ptr::null(), 0, data, data_count) };
        hub::call_part(config, stream_id, part, false);
    }
}

/// The answer's trailers.
///
/// SAFETY: as `..._stream_headers`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_trailers(
    _config_envoy_ptr: *mut c_void,
    config_module_ptr: *const c_void,
    stream_id: u64,
    trailers: *const HttpHeader,
    trailers_size: usize,
) {
    // SAFETY: see above.
    if let Some(config) = unsafe { config(config_module_ptr) } {
        // SAFETY: see above.
        let part = unsafe { LentAnswer::from_hook(trailers, trailers_size, std::ptr::null(), 0) };
        hub::call_part(config, stream_id, part, true);
    }
}

/// The answer is complete.
///
/// SAFETY: as `config_scheduled`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_complete(
    _config_envoy_ptr: *mut c_void,
    config_module_ptr: *const c_void,
    stream_id: u64,
) {
    // SAFETY: see above.
    if let Some(config) = unsafe { config(config_module_ptr) } {
        hub::call_done(config, stream_id, true);
    }
}

/// The call failed (reset: no answer, or part of one).
///
/// SAFETY: as `config_scheduled`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_reset(
    _config_envoy_ptr: *mut c_void,
    config_module_ptr: *const c_void,
    stream_id: u64,
    _reason: u32,
) {
    // SAFETY: see above.
    if let Some(config) = unsafe { config(config_module_ptr) } {
        hub::call_done(config, stream_id, false);
    }
}
