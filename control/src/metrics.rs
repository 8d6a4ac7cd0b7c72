//! fanout-control's own metrics, for Prometheus (`GET /metrics` on the state address):
//! what it pushed, what each Envoy ACKed or NACKed and how long that took, which Envoys are
//! behind, which channels are served from their last good version or not at all, and how its
//! source is doing. `deploy/prometheus/fanout-control-rules.yaml` alerts on them.
//!
//! Events (a push, an ACK, a NACK, a source read) are counted where they happen, through the
//! functions here; what is true now (Envoys connected and behind, channels by serving state)
//! is read from the ledger at each scrape, so it cannot drift from `/state`.
//!
//! One registry per process, as the Prometheus client libraries keep it: the xDS streams, the
//! source's thread and the status writer count into it without being handed anything.

use crate::render::Serving;
use crate::state::{Kind, Ledger};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use std::sync::LazyLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
enum KindLabel {
    filter,
    clusters,
}

impl From<Kind> for KindLabel {
    fn from(kind: Kind) -> KindLabel {
        match kind {
            Kind::Filter => KindLabel::filter,
            Kind::Clusters => KindLabel::clusters,
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ByKind {
    kind: KindLabel,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ByEnvoy {
    node: String,
    kind: KindLabel,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ByNode {
    node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ByState {
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ByReason {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ByResult {
    result: String,
}

type Latency = Family<ByKind, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 1 ms to ~65 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

struct Metrics {
    registry: Registry,
    envoys_connected: Gauge,
    envoy_behind: Family<ByNode, Gauge>,
    pushes: Family<ByKind, Counter>,
    acks: Family<ByEnvoy, Counter>,
    nacks: Family<ByEnvoy, Counter>,
    push_to_ack: Latency,
    channels: Family<ByState, Gauge>,
    source_errors: Family<ByReason, Counter>,
    source_relists: Counter,
    source_last_read: Gauge<f64, AtomicU64>,
    status_writes: Family<ByResult, Counter>,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

impl Metrics {
    fn new() -> Metrics {
        let metrics = Metrics {
            envoys_connected: Gauge::default(),
            envoy_behind: Family::default(),
            pushes: Family::default(),
            acks: Family::default(),
            nacks: Family::default(),
            push_to_ack: Latency::new_with_constructor(latency_histogram),
            channels: Family::default(),
            source_errors: Family::default(),
            source_relists: Counter::default(),
            source_last_read: Gauge::default(),
            status_writes: Family::default(),
            registry: Registry::default(),
        };
        Metrics {
            registry: metrics.registry(),
            ..metrics
        }
    }

    /// A registry of every metric (the registry holds clones: they share their values).
    fn registry(&self) -> Registry {
        let mut registry = Registry::with_prefix("fanout_control");
        registry.register(
            "envoys_connected",
            "xDS streams open now",
            self.envoys_connected.clone(),
        );
        registry.register(
            "envoy_behind",
            "1 while a connected Envoy has not ACKed the filter version served now",
            self.envoy_behind.clone(),
        );
        registry.register("pushes", "Versions sent to Envoys", self.pushes.clone());
        registry.register("acks", "Versions Envoys ACKed", self.acks.clone());
        registry.register(
            "nacks",
            "Versions Envoys refused (NACK; Envoy's text is in /state)",
            self.nacks.clone(),
        );
        registry.register(
            "push_to_ack_seconds",
            "From sending a version to the Envoy's ACK or NACK",
            self.push_to_ack.clone(),
        );
        registry.register(
            "channels",
            "Channels by how they are served: current, last-good, not-served",
            self.channels.clone(),
        );
        self.register_source(&mut registry);
        registry
    }

    fn register_source(&self, registry: &mut Registry) {
        registry.register(
            "source_errors",
            "Reads of the source that failed, by reason",
            self.source_errors.clone(),
        );
        registry.register(
            "source_relists",
            "Times the source was read whole again after a change",
            self.source_relists.clone(),
        );
        registry.register(
            "source_last_read_timestamp_seconds",
            "When the source was last read without an error (Unix time)",
            self.source_last_read.clone(),
        );
        registry.register(
            "status_writes",
            "Status writes to the source's objects, by result",
            self.status_writes.clone(),
        );
    }
}

/// A version sent to an Envoy.
pub fn pushed(kind: Kind) {
    METRICS
        .pushes
        .get_or_create(&ByKind { kind: kind.into() })
        .inc();
}

/// An Envoy's answer to a version sent `after` ago: ACK (`refused` false) or NACK.
pub fn answered(node: &str, kind: Kind, after: Duration, refused: bool) {
    let labels = ByEnvoy {
        node: node.to_owned(),
        kind: kind.into(),
    };
    // Both series from an Envoy's first answer on: a NACK then counts as an increase from
    // 0 (rate() and increase() see no increase in a series that starts at 1).
    let acks = METRICS.acks.get_or_create(&labels);
    let nacks = METRICS.nacks.get_or_create(&labels);
    if refused {
        nacks.inc();
    } else {
        acks.inc();
    }
    METRICS
        .push_to_ack
        .get_or_create(&ByKind { kind: kind.into() })
        .observe(after.as_secs_f64());
}

/// A node forgotten (`--forget-after`): its series go too.
pub fn forget(node: &str) {
    for kind in [KindLabel::filter, KindLabel::clusters] {
        let labels = ByEnvoy {
            node: node.to_owned(),
            kind,
        };
        METRICS.acks.remove(&labels);
        METRICS.nacks.remove(&labels);
    }
}

/// The source was read without an error; `whole`: read again in full (a change, a relist).
pub fn source_read(whole: bool) {
    if whole {
        METRICS.source_relists.inc();
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    METRICS.source_last_read.set(now.as_secs_f64());
}

/// One look at the directory source: `errors` files (or the listing) it could not read or
/// parse, `changed` whether it read something new.
pub fn source_polled(errors: usize, changed: bool) {
    // The series is there from the first look on, at 0 (see `answered`).
    let counter = METRICS.source_errors.get_or_create(&ByReason {
        reason: "read".to_owned(),
    });
    if errors == 0 {
        source_read(changed);
        return;
    }
    counter.inc_by(u64::try_from(errors).unwrap_or(u64::MAX));
}

/// A read of the source failed (`reason`: a short word a rule can match, e.g. `list`,
/// `watch`).
#[allow(dead_code)] // the Kubernetes source counts its watch and list errors here
pub fn source_error(reason: &str) {
    METRICS
        .source_errors
        .get_or_create(&ByReason {
            reason: reason.to_owned(),
        })
        .inc();
}

/// A status write to one of the source's objects (`result`: `ok`, `conflict`, `error`).
pub fn status_written(result: &str) {
    METRICS
        .status_writes
        .get_or_create(&ByResult {
            result: result.to_owned(),
        })
        .inc();
}

/// The text exposition of every metric, with what is true now read from `ledger`.
pub fn render(ledger: &Ledger) -> String {
    refresh(ledger);
    let mut out = String::new();
    // Writing to a String cannot fail; an error here would be the encoder's own.
    if let Err(e) = encode(&mut out, &METRICS.registry) {
        log::warn!("encoding the metrics: {e}");
    }
    out
}

fn refresh(ledger: &Ledger) {
    ledger.view(|served, envoys| {
        let streams: i64 = envoys.values().map(|e| i64::from(e.streams)).sum();
        METRICS.envoys_connected.set(streams);
        METRICS.envoy_behind.clear();
        METRICS.channels.clear();
        let Some(served) = served else {
            return;
        };
        for state in [Serving::Current, Serving::LastGood, Serving::NotServed] {
            let count = served
                .channels
                .values()
                .filter(|c| c.serving == state)
                .count();
            METRICS
                .channels
                .get_or_create(&ByState {
                    state: serving_word(state).to_owned(),
                })
                .set(i64::try_from(count).unwrap_or(i64::MAX));
        }
        for (node, envoy) in envoys.iter().filter(|(_, e)| e.streams > 0) {
            // The filter decides where events go; its clusters are sent before it, and a
            // stream keeps a retired cluster for a while, so its cluster version may lag
            // without harm.
            let behind = envoy.filter.acked.as_ref() != Some(&served.ecds_version);
            METRICS
                .envoy_behind
                .get_or_create(&ByNode { node: node.clone() })
                .set(i64::from(behind));
        }
    });
}

fn serving_word(serving: Serving) -> &'static str {
    match serving {
        Serving::Current => "current",
        Serving::LastGood => "last-good",
        Serving::NotServed => "not-served",
    }
}
