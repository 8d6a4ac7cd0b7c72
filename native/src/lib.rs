//! fanout as an Envoy dynamic module: the same core as the wasm module (the `fanout` crate),
//! loaded natively by Envoy's `envoy.filters.http.dynamic_modules` HTTP filter (Envoy 1.40.0
//! or later), with the same JSON configuration as its `filter_config`.
//!
//! Data flows one way: `hooks.rs` (the hooks Envoy calls, each a thin wrapper) → `glue.rs`,
//! which drives the core's `Plugin` and `Stream` exactly as the proxy-wasm glue
//! (`src/filter/`) does → `host.rs`'s `Host` → `abi.rs` (Envoy's callbacks, declared by hand
//! behind safe handles). `hooks.rs` and `abi.rs` are the only modules with `unsafe`. A
//! configuration that asks for work after the sender's answer, or for no sender, is served
//! by its own context on Envoy's main thread (`hub.rs`; `serve.rs` says which).
//!
//! Without the `envoy` feature only the configuration path is built ([`configure`]): the
//! glue imports Envoy's callbacks, which only Envoy provides.

pub mod serve;
pub mod shared;
pub mod timer;

#[cfg(all(feature = "envoy", not(test)))]
#[allow(unsafe_code)]
mod abi;
#[cfg(all(feature = "envoy", not(test)))]
mod glue;
#[cfg(all(feature = "envoy", not(test)))]
#[allow(unsafe_code)]
mod hooks;
#[cfg(all(feature = "envoy", not(test)))]
mod host;
#[cfg(all(feature = "envoy", not(test)))]
mod hub;
#[cfg(all(feature = "envoy", not(test)))]
mod log;

pub use serve::configure;
