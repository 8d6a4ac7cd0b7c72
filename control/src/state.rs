//! The one place that knows what every Envoy has: the versions each connected Envoy has
//! ACKed, the NACKs with Envoy's text, and from them, per channel, where it and each of its
//! subscribers are live. The HTTP state endpoint reads it (and so will a status writer).

use crate::model::Problem;
use crate::render::{Served, Serving};
use fanout::config::RawSubscriber;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

/// The two resource kinds the server serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Filter,
    Clusters,
}

/// A version an Envoy refused, with Envoy's own words.
#[derive(Clone, Debug, Serialize)]
pub struct Nack {
    pub version: String,
    pub error: String,
}

/// One resource kind on one Envoy.
#[derive(Clone, Debug, Default, Serialize)]
pub struct KindRecord {
    /// The last version sent.
    pub sent: Option<String>,
    /// The last version the Envoy ACKed (or said it had when it connected).
    pub acked: Option<String>,
    /// The last NACK.
    pub nack: Option<Nack>,
}

/// One Envoy, by node id.
#[derive(Clone, Debug, Default, Serialize)]
pub struct EnvoyRecord {
    /// Streams open now (0: disconnected; the record stays, with what it last had).
    pub streams: u32,
    pub filter: KindRecord,
    pub clusters: KindRecord,
    /// Responses sent to it since the server started.
    pub responses: u64,
    /// Since when it has had no stream (for `--forget-after`).
    #[serde(skip)]
    pub gone_since: Option<std::time::Instant>,
}

impl EnvoyRecord {
    fn kind(&mut self, kind: Kind) -> &mut KindRecord {
        match kind {
            Kind::Filter => &mut self.filter,
            Kind::Clusters => &mut self.clusters,
        }
    }
}

/// What one filter version holds: per channel, its digest and its subscribers (URI and the
/// clusters they call).
#[derive(Debug, Default)]
struct FilterVersion {
    channels: BTreeMap<String, (String, Vec<LiveSubscriber>)>,
}

/// A subscriber's URI and the clusters it calls.
type LiveSubscriber = (String, BTreeSet<String>);

#[derive(Default)]
struct Inner {
    served: Option<Arc<Served>>,
    filters: BTreeMap<String, FilterVersion>,
    cluster_sets: BTreeMap<String, BTreeSet<String>>,
    order: VecDeque<(Kind, String)>,
    envoys: BTreeMap<String, EnvoyRecord>,
}

/// Shared by the xDS streams and the HTTP endpoint.
#[derive(Clone, Default)]
pub struct Ledger {
    inner: Arc<Mutex<Inner>>,
}

/// Versions kept for telling what an Envoy has, besides those some Envoy has now.
const HISTORY: usize = 32;

impl Ledger {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A new served state: remember what its versions hold.
    pub fn serving(&self, served: Arc<Served>) {
        let mut inner = self.lock();
        let mut version = FilterVersion::default();
        for (name, channel) in served
            .channels
            .iter()
            .filter(|(_, c)| c.serving != Serving::NotServed)
        {
            let subscribers = channel
                .spec
                .subscribers
                .iter()
                .map(|s| (s.uri.clone(), clusters_of(&s.config)))
                .collect();
            version
                .channels
                .insert(name.clone(), (channel.digest.clone(), subscribers));
        }
        if inner
            .filters
            .insert(served.ecds_version.clone(), version)
            .is_none()
        {
            inner
                .order
                .push_back((Kind::Filter, served.ecds_version.clone()));
        }
        let names = served.clusters.keys().cloned().collect();
        if inner
            .cluster_sets
            .insert(served.cds_version.clone(), names)
            .is_none()
        {
            inner
                .order
                .push_back((Kind::Clusters, served.cds_version.clone()));
        }
        inner.served = Some(served);
        prune(&mut inner);
    }

    /// A cluster version one stream sends: it differs from the served one while the stream
    /// keeps clusters its Envoy's previous filter still calls. Known here, the Envoy's ACK
    /// of it counts at once (a subscriber is live where its clusters are).
    pub fn sending_clusters(&self, version: &str, names: &BTreeSet<String>) {
        let mut inner = self.lock();
        if inner.cluster_sets.contains_key(version) {
            return;
        }
        inner.cluster_sets.insert(version.to_owned(), names.clone());
        inner.order.push_back((Kind::Clusters, version.to_owned()));
        prune(&mut inner);
    }

    /// The cluster names of a filter version the server knows.
    pub fn filter_clusters(&self, version: &str) -> Option<BTreeSet<String>> {
        let inner = self.lock();
        let filter = inner.filters.get(version)?;
        Some(
            filter
                .channels
                .values()
                .flat_map(|(_, subs)| subs.iter().flat_map(|(_, c)| c.iter().cloned()))
                .collect(),
        )
    }

    /// The cluster names of a cluster version the server knows.
    pub fn cluster_set(&self, version: &str) -> Option<BTreeSet<String>> {
        self.lock().cluster_sets.get(version).cloned()
    }

    pub fn connected(&self, node: &str) {
        let mut inner = self.lock();
        let envoy = inner.envoys.entry(node.to_owned()).or_default();
        envoy.streams += 1;
        envoy.gone_since = None;
    }

    pub fn disconnected(&self, node: &str) {
        if let Some(envoy) = self.lock().envoys.get_mut(node) {
            envoy.streams = envoy.streams.saturating_sub(1);
            if envoy.streams == 0 {
                envoy.gone_since = Some(std::time::Instant::now());
            }
        }
    }

    /// Drop the records of Envoys without a stream for longer than `after`; their names.
    pub fn forget(&self, after: std::time::Duration) -> Vec<String> {
        let mut inner = self.lock();
        let gone: Vec<String> = inner
            .envoys
            .iter()
            .filter(|(_, e)| e.gone_since.is_some_and(|at| at.elapsed() > after))
            .map(|(node, _)| node.clone())
            .collect();
        for node in &gone {
            inner.envoys.remove(node);
        }
        prune(&mut inner);
        gone
    }

    /// What is served and every Envoy's record, read under the lock (for the metrics).
    pub fn view<R>(
        &self,
        f: impl FnOnce(Option<&Served>, &BTreeMap<String, EnvoyRecord>) -> R,
    ) -> R {
        let inner = self.lock();
        f(inner.served.as_deref(), &inner.envoys)
    }

    pub fn sent(&self, node: &str, kind: Kind, version: &str) {
        let mut inner = self.lock();
        let envoy = inner.envoys.entry(node.to_owned()).or_default();
        envoy.responses += 1;
        envoy.kind(kind).sent = Some(version.to_owned());
    }

    pub fn acked(&self, node: &str, kind: Kind, version: &str) {
        let mut inner = self.lock();
        inner
            .envoys
            .entry(node.to_owned())
            .or_default()
            .kind(kind)
            .acked = Some(version.to_owned());
    }

    pub fn nacked(&self, node: &str, kind: Kind, version: &str, error: &str) {
        log::warn!("{node} refused {kind:?} version {version}: {error}");
        let mut inner = self.lock();
        let nack = Nack {
            version: version.to_owned(),
            error: error.to_owned(),
        };
        inner
            .envoys
            .entry(node.to_owned())
            .or_default()
            .kind(kind)
            .nack = Some(nack);
    }

    /// Whether the server has a state to serve (the source has been read once).
    pub fn ready(&self) -> bool {
        self.lock().served.is_some()
    }

    /// Everything, for the state endpoint.
    pub fn report(&self) -> Value {
        let inner = self.lock();
        let Some(served) = inner.served.as_ref() else {
            return json!({ "ready": false });
        };
        let channels: BTreeMap<&String, Value> = served
            .channels
            .iter()
            .map(|(name, c)| (name, channel_report(&inner, served, name, c)))
            .collect();
        json!({
            "ready": true,
            "versions": { "filter": served.ecds_version, "clusters": served.cds_version },
            "channels": channels,
            "problems": served.problems,
            "warnings": served.warnings,
            "envoys": inner.envoys,
        })
    }
}

fn channel_report(
    inner: &Inner,
    served: &Served,
    name: &str,
    channel: &crate::render::ServedChannel,
) -> Value {
    let mut envoys = BTreeMap::new();
    let mut live: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (node, envoy) in &inner.envoys {
        let has = envoy
            .filter
            .acked
            .as_ref()
            .and_then(|v| inner.filters.get(v))
            .and_then(|f| f.channels.get(name));
        let clusters = envoy
            .clusters
            .acked
            .as_ref()
            .and_then(|v| inner.cluster_sets.get(v));
        let state = match has {
            Some((digest, _)) if *digest == channel.digest => "current",
            _ if channel.serving == Serving::NotServed => "absent",
            _ if nacked_now(&envoy.filter, &served.ecds_version) => "nacked",
            _ => "behind",
        };
        envoys.insert(
            node.as_str(),
            json!({ "state": state, "connected": envoy.streams > 0 }),
        );
        for (uri, needs) in has.map(|(_, s)| s.as_slice()).unwrap_or_default() {
            if clusters.is_some_and(|c| needs.is_subset(c)) {
                live.entry(uri.as_str()).or_default().push(node.as_str());
            }
        }
    }
    let subscribers: Vec<Value> = channel
        .spec
        .subscribers
        .iter()
        .map(|s| json!({ "uri": s.uri, "live_on": live.get(s.uri.as_str()).cloned().unwrap_or_default() }))
        .collect();
    let problems: &[Problem] = &channel.problems;
    json!({
        "serving": channel.serving,
        "digest": channel.digest,
        "hosts": channel.spec.hosts,
        "subscribers": subscribers,
        "problems": problems,
        "warnings": channel.warnings,
        "senders": channel.spec.senders,
        "envoys": envoys,
    })
}

fn nacked_now(record: &KindRecord, current: &str) -> bool {
    record.nack.as_ref().is_some_and(|n| n.version == current)
}

/// Every `cluster` a subscriber's config calls (the subscriber, its reply, its dead letter).
fn clusters_of(config: &RawSubscriber) -> BTreeSet<String> {
    let dead_letter = config
        .delivery
        .as_ref()
        .and_then(|d| d.dead_letter.as_ref());
    let targets = config.reply.iter().chain(dead_letter);
    std::iter::once(&config.cluster)
        .chain(targets.map(|t| &t.cluster))
        .cloned()
        .collect()
}

/// Forget old versions no Envoy has and the server no longer serves.
fn prune(inner: &mut Inner) {
    let mut keep: BTreeSet<String> = BTreeSet::new();
    for envoy in inner.envoys.values() {
        for record in [&envoy.filter, &envoy.clusters] {
            keep.extend(record.acked.iter().chain(record.sent.iter()).cloned());
        }
    }
    if let Some(served) = &inner.served {
        keep.insert(served.ecds_version.clone());
        keep.insert(served.cds_version.clone());
    }
    let mut excess = inner.order.len().saturating_sub(HISTORY);
    let mut kept = VecDeque::new();
    while let Some((kind, version)) = inner.order.pop_front() {
        if excess > 0 && !keep.contains(&version) {
            excess -= 1;
            match kind {
                Kind::Filter => inner.filters.remove(&version),
                Kind::Clusters => inner
                    .cluster_sets
                    .remove(&version)
                    .map(|_| FilterVersion::default()),
            };
        } else {
            kept.push_back((kind, version));
        }
    }
    inner.order = kept;
}
