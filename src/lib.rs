//! `fanout`: a proxy-wasm HTTP filter for Envoy that delivers one incoming event to every
//! subscriber of a channel and answers 202 when all of them took it, 500 with a report when
//! any did not.
//!
//! The fan-out logic is plain Rust with no proxy-wasm in it, tested natively and inside
//! wasm32: [`config`] (the JSON contract), [`routing`] (channel by host), [`headers`] (what is
//! forwarded), [`request`] (admission), [`fanout`] (one request's calls and verdict),
//! [`answer`] and [`metrics`]; [`delivery`] (retries), [`reply`] (which answers are reply
//! events) and [`dead_letter`] (what a dead letter carries) serve delivery; subscription
//! filters are [`cloudevents`] (an event's attributes) and [`filters`] (the matcher);
//! [`dedupe`] is redelivery without duplicates.
//! The `filter` module is the thin proxy-wasm layer on top.

pub mod answer;
pub mod cloudevents;
pub mod config;
pub mod dead_letter;
pub mod dedupe;
pub mod delivery;
pub mod fanout;
pub mod filters;
pub mod headers;
pub mod metrics;
pub mod reply;
pub mod request;
pub mod routing;

#[cfg(feature = "filter")]
pub mod filter;

#[cfg(feature = "filter")]
proxy_wasm::main! {{
    // Until on_vm_start reads Envoy's own level for wasm.
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|id| {
        Box::new(filter::FanoutRoot::with_shared(id, filter::ProxyHost, filter::VmShared::of_this_vm()))
    });
}}
