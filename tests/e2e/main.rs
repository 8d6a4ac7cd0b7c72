//! The integration tests, in one test binary (`cargo test --test e2e`): one module per suite,
//! all on the shared [`harness`]. Most run the real Envoy with the built `fanout.wasm` in front
//! of real subscribers on loopback; `make test-e2e` builds the filter and installs Envoy first.
//! One binary rather than one per suite: the harness and its dependencies (reqwest, tokio)
//! are compiled and linked once. Select a suite with its module path, e.g.
//! `cargo test --test e2e dedupe::`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod harness;

// The contract with a sender and subscribers.
mod contract;
// Each area of behaviour.
mod compat;
mod dedupe;
mod delivery;
mod filters;
mod flow;
mod metrics;
mod reload;
// Knative's contract, with the CloudEvents SDK; the importer of Knative objects.
mod knative_delivery;
mod knative_import;
mod knative_ingress;
// Hostile conditions and the soak.
mod faults;
mod soak;
// The shipped configurations, the image and the demo; the harness's own checks.
mod harness_selftest;
mod image;
mod shipped_configs;
