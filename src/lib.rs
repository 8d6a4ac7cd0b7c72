//! `fanout`: a proxy-wasm HTTP filter for Envoy that delivers one incoming event to every
//! subscriber of a channel and answers 202 when all of them took it, 500 with a report when
//! any did not.
//!
//! Everything but [`filter`] is plain Rust without proxy-wasm, built and tested natively and
//! inside wasm32 (`--no-default-features`): values at the bottom, the policies over them, the
//! configuration, the per-request state, the [`host::Host`] seam, and on top the
//! orchestration ([`plugin`], [`stream`], [`recipients`], [`deliveries`]) that Envoy's
//! callbacks drive. [`filter`] is the proxy-wasm adapter: it forwards each callback to the
//! orchestration and performs host calls for it. docs/design.md has the module map and one
//! request's walk through it; README.md is the user contract.

// Tests may borrow cells directly (src/cell.rs's rule is for the core's shared state).
#![cfg_attr(test, allow(clippy::disallowed_methods))]

// Values: an answer, one call, an event's attributes and its content modes, header rules,
// JSON, channel routing, protobuf's wire format.
pub mod answer;
pub mod call;
pub mod cloudevents;
pub mod format;
pub mod headers;
pub mod json;
pub mod protowire;
pub mod routing;
// Policies over them: retries and their jitter, replies, dead letters, subscription filters,
// the per-cluster caps on calls in flight.
pub mod call_slots;
pub mod dead_letter;
pub mod event_filter;
pub mod jitter;
pub mod reply;
pub mod retry;
// Traces: W3C trace context, the spans of an event, OTLP and its batching exporter.
pub mod trace;
// The configuration, validated into what a request needs.
pub mod config;
// Per-request state, pure: admission, the fan-out state and its verdict, dedupe's records,
// the counts.
pub mod call_table;
pub mod dedupe;
pub mod fan_out_state;
pub mod metrics;
pub mod request;
// The seam to Envoy, and what goes through it: the stats; the rule for shared state.
pub mod cell;
pub mod host;
pub mod telemetry;
pub mod timer;
// The orchestration, generic over the host: the plugin, one request, who gets its event,
// the deliveries in flight, dedupe's claims settled.
pub mod deliveries;
pub mod pipeline;
pub mod plugin;
pub mod recipients;
pub mod stream;

// Test support (the fake host): an index out of bounds there is a test's bug; its state is
// its own, not shared between contexts (src/cell.rs).
#[cfg(any(test, feature = "testing"))]
#[allow(clippy::indexing_slicing, clippy::disallowed_methods)]
pub mod testing;
#[cfg(test)]
mod tests;

#[cfg(feature = "filter")]
pub mod filter;

#[cfg(feature = "filter")]
proxy_wasm::main! {{
    // Until on_vm_start reads Envoy's own level for wasm.
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|id| {
        Box::new(filter::FanoutRoot::new(id))
    });
}}
