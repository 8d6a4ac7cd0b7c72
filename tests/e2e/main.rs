//! The integration tests, in one test binary (`cargo test --test e2e`): one module per suite,
//! all on the shared [`harness`]. Most run the real Envoy with the built `fanout.wasm` in front
//! of real subscribers on loopback; `make test-e2e` builds the filter and installs Envoy first.
//! One binary rather than one per suite: the harness and its dependencies (reqwest, tokio)
//! are compiled and linked once. Select a suite with its module path, e.g.
//! `cargo test --test e2e dedupe::`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// The harness indexes what it built itself, and spawns and signals process groups (libc).
#![allow(clippy::indexing_slicing, unsafe_code)]

mod harness;

// The contract with a sender and subscribers.
mod contract;
// Each area of behaviour.
mod affinity;
mod compat;
mod dedupe;
mod delivery;
mod filters;
mod flow;
mod format;
mod metrics;
// The shipped Prometheus rules and Grafana dashboard on a real Prometheus.
mod alerts;
mod reload;
// The control plane (fanout-control) and Envoys on envoy/xds/envoy.yaml.
mod control;
mod control_tls;
// On a real Kubernetes API (make test-k8s; ignored otherwise).
mod k8s;
mod replicas_redelivery;
mod replicas_store;
mod rollout;
// Traces: the exporter's spans at a real OTLP receiver.
mod tracing;
// Knative's contract, with the CloudEvents SDK; the importer of Knative objects.
mod knative_delivery;
mod knative_dispatcher;
mod knative_import;
mod knative_ingress;
mod knative_senders;
// The CloudEvents JavaScript SDK as sender and subscriber: header values byte for byte.
mod js_sdk;
// Hostile conditions and the soak.
mod faults;
mod soak;
// Who may send: the shipped sender authorization.
mod authz;
// The shipped configurations, deploy/ (Kubernetes, Istio), the image, the demo and the docs;
// the harness's own checks.
mod deploy;
mod deploy_control;
mod docs;
mod harness_selftest;
mod image;
mod shipped_configs;
// docs/design.md's module map against src/ (no Envoy).
mod design_map;
