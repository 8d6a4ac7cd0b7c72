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
pub mod sdk;
mod subscriber;
pub mod timing;

pub use client::{chunked_body, send, Client, Reply};
pub use envoy::{body_wait, envoy_bin, wasm_path, BodyWait, Envoy, EnvoyBuilder, TRIPWIRE_BODY};
pub use subscriber::{Behavior, Recorded, Subscriber};

use std::path::PathBuf;

/// The crate root (where Cargo.toml is).
pub fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A new directory under the system temp dir, unique across parallel tests and processes:
/// `<prefix>-<pid>-<sequence>-<nanos>`.
pub fn unique_temp_dir(prefix: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{SystemTime, UNIX_EPOCH};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let path = std::env::temp_dir().join(format!(
        "{prefix}-{}-{}-{nanos}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    path
}
