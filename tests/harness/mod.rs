//! End-to-end harness: the real Envoy with the built `fanout.wasm`, subscriber servers on
//! loopback whose behaviour each test sets, and an HTTP client (HTTP/1.1 or h2c).
//!
//! Every process and thread a test starts belongs to a guard that stops it on drop, also when
//! the test panics. Nothing uses a fixed port or name, so tests run in parallel.
//!
//! Used from each test crate with `mod harness;`; not every crate uses every part.
#![allow(dead_code, unused_imports)]

mod client;
mod envoy;
pub mod faults;
pub mod reload;
mod subscriber;

pub use client::{chunked_body, send, Client, Reply};
pub use envoy::{body_wait, envoy_bin, wasm_path, BodyWait, Envoy, EnvoyBuilder, TRIPWIRE_BODY};
pub use subscriber::{Behavior, Recorded, Subscriber};

use std::path::PathBuf;

/// The crate root (where Cargo.toml is).
pub fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}
