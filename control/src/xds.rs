//! The ADS server (state of the world): every Envoy gets the fanout filter and the senders
//! filters (ECDS, one version for the three) and the subscriber clusters (CDS) on one
//! stream, whole on every (re)connect and on every change.
//!
//! Order: clusters before the filter that calls them, and a cluster the Envoy's current
//! filter still calls stays until the Envoy has ACKed the filter that no longer does, and
//! then for a grace period (`--cluster-grace`) while events that started with the previous
//! filter finish their calls: no event meets an unknown cluster because of the order of two
//! updates. A refused
//! version (NACK) is recorded with Envoy's text and not sent again; the next change is.

use crate::render::{cds_version, Served};
use crate::state::{Kind, Ledger};
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryService;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use std::collections::{BTreeMap, BTreeSet};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

pub const FILTER_TYPE: &str = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig";
pub const CLUSTER_TYPE: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

type ResponseStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// The ADS service: what is served now, and the ledger every stream reports to.
pub struct Ads {
    pub served: watch::Receiver<Option<Arc<Served>>>,
    pub ledger: Ledger,
    /// How long a cluster stays after the Envoy's filter stopped calling it: calls that
    /// events in flight started with the previous filter version still finish (Envoy resets
    /// the calls of a removed cluster).
    pub cluster_grace: Duration,
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = ResponseStream<DiscoveryResponse>;
    type DeltaAggregatedResourcesStream = ResponseStream<DeltaDiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        let (tx, rx) = mpsc::channel(16);
        let stream = AdsStream {
            state: StreamState {
                cluster_grace: self.cluster_grace,
                peer: request.extensions().get::<crate::tls::Peer>().cloned(),
                ..StreamState::default()
            },
            ledger: self.ledger.clone(),
            tx,
        };
        tokio::spawn(stream.run(request.into_inner(), self.served.clone()));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn delta_aggregated_resources(
        &self,
        _request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Err(Status::unimplemented(
            "fanout-control serves state-of-the-world ADS (api_type: GRPC)",
        ))
    }
}

/// A response on its way, until the Envoy ACKs or NACKs it.
#[derive(Debug)]
struct InFlight {
    version: String,
    nonce: String,
    /// The clusters it holds (CDS) or calls (the filter).
    clusters: BTreeSet<String>,
    /// When it was sent (for the push-to-ACK latency).
    sent: Instant,
}

#[derive(Debug, Default)]
struct KindStream {
    subscribed: bool,
    in_flight: Option<InFlight>,
    /// The version last sent, or the one the Envoy said it had when it connected.
    last: Option<String>,
    /// The cluster names of `last` (CDS).
    last_clusters: BTreeSet<String>,
}

/// What one stream knows of its Envoy.
#[derive(Debug, Default)]
pub struct StreamState {
    node: Option<String>,
    nonce: u64,
    filter: KindStream,
    clusters: KindStream,
    /// The clusters the Envoy's current filter calls (they must stay).
    filter_calls: BTreeSet<String>,
    /// Clusters a previous filter called, kept until then.
    retired: Vec<(Instant, BTreeSet<String>)>,
    cluster_grace: Duration,
    /// Every cluster sent on this stream, for keeping one the current filter still calls.
    sent_clusters: BTreeMap<String, Any>,
    /// The served cluster version `sent_clusters` has taken in last.
    clusters_of: Option<String>,
    /// Who connected, with mutual TLS (crate::tls).
    peer: Option<crate::tls::Peer>,
}

struct AdsStream {
    state: StreamState,
    ledger: Ledger,
    tx: mpsc::Sender<Result<DiscoveryResponse, Status>>,
}

impl AdsStream {
    async fn run(
        mut self,
        mut inbound: Streaming<DiscoveryRequest>,
        mut served: watch::Receiver<Option<Arc<Served>>>,
    ) {
        loop {
            let next_retirement = self.state.retired.iter().map(|(at, _)| *at).min();
            let retire = async {
                match next_retirement {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = retire => {
                    let now = Instant::now();
                    self.state.retired.retain(|(at, _)| *at > now);
                }
                request = inbound.next() => match request {
                    Some(Ok(request)) => self.state.on_request(&request, &self.ledger),
                    Some(Err(status)) => {
                        log::info!("{}: stream ended: {}", self.state.node_id(), status.message());
                        break;
                    }
                    None => break,
                },
                changed = served.changed() => if changed.is_err() { break },
            }
            let current = served.borrow().clone();
            if let Some(current) = current {
                for response in self.state.step(&current, &self.ledger) {
                    if self.tx.send(Ok(response)).await.is_err() {
                        break;
                    }
                }
            }
        }
        if let Some(node) = &self.state.node {
            self.ledger.disconnected(node);
        }
    }
}

impl StreamState {
    fn node_id(&self) -> &str {
        self.node.as_deref().unwrap_or("(no node yet)")
    }

    fn kind(&mut self, kind: Kind) -> &mut KindStream {
        match kind {
            Kind::Filter => &mut self.filter,
            Kind::Clusters => &mut self.clusters,
        }
    }

    /// A request: a subscription (no nonce), an ACK or a NACK of what was sent.
    pub fn on_request(&mut self, request: &DiscoveryRequest, ledger: &Ledger) {
        if self.node.is_none() {
            let claimed = request
                .node
                .as_ref()
                .map(|n| n.id.as_str())
                .filter(|id| !id.is_empty());
            let id = crate::tls::node_name(self.peer.as_ref(), claimed);
            log::info!("{id} connected");
            ledger.connected(&id);
            self.node = Some(id);
        }
        let node = self.node_id().to_owned();
        let kind = match request.type_url.as_str() {
            FILTER_TYPE => Kind::Filter,
            CLUSTER_TYPE => Kind::Clusters,
            other => return log::debug!("{node}: {other} is not served"),
        };
        if request.response_nonce.is_empty() {
            self.kind(kind).subscribed = true;
            if !request.version_info.is_empty() {
                // A reconnect: the Envoy has this version already.
                ledger.acked(&node, kind, &request.version_info);
                self.kind(kind).last = Some(request.version_info.clone());
                match kind {
                    Kind::Filter => {
                        self.filter_calls = ledger
                            .filter_clusters(&request.version_info)
                            .unwrap_or_default()
                    }
                    Kind::Clusters => {
                        self.clusters.last_clusters = ledger
                            .cluster_set(&request.version_info)
                            .unwrap_or_default()
                    }
                }
            }
            return;
        }
        let stream = self.kind(kind);
        let Some(in_flight) = stream
            .in_flight
            .take_if(|f| f.nonce == request.response_nonce)
        else {
            return; // an answer to an older response: superseded
        };
        self.answered(&node, kind, in_flight, request, ledger);
    }

    /// The Envoy's answer to `in_flight`.
    fn answered(
        &mut self,
        node: &str,
        kind: Kind,
        in_flight: InFlight,
        request: &DiscoveryRequest,
        ledger: &Ledger,
    ) {
        let refused = request.error_detail.is_some();
        let answer = if refused { "refused" } else { "acked" };
        let after = in_flight.sent.elapsed();
        log::debug!(
            "{node}: {answer} {kind:?} {} after {after:?}",
            in_flight.version
        );
        crate::metrics::answered(node, kind, after, refused);
        match &request.error_detail {
            Some(error) => ledger.nacked(node, kind, &in_flight.version, &error.message),
            None => {
                ledger.acked(node, kind, &in_flight.version);
                if kind == Kind::Filter {
                    let previous = std::mem::replace(&mut self.filter_calls, in_flight.clusters);
                    self.retired
                        .push((Instant::now() + self.cluster_grace, previous));
                }
            }
        }
    }

    /// What to send now, given what is served.
    pub fn step(&mut self, served: &Served, ledger: &Ledger) -> Vec<DiscoveryResponse> {
        let mut out = Vec::new();
        if self.clusters_of.as_ref() != Some(&served.cds_version) {
            for (name, cluster) in &served.clusters {
                self.sent_clusters.insert(name.clone(), cluster.clone());
            }
            self.clusters_of = Some(served.cds_version.clone());
        }
        if self.clusters.subscribed && self.clusters.in_flight.is_none() {
            let (version, want) = self.clusters_wanted(served);
            if self.clusters.last.as_ref() != Some(&version) {
                let names: BTreeSet<String> = want.keys().map(|n| (*n).clone()).collect();
                let resources = want.into_values().cloned().collect();
                out.push(self.respond(
                    Kind::Clusters,
                    CLUSTER_TYPE,
                    &version,
                    resources,
                    names,
                    ledger,
                ));
            }
        }
        let clusters_there = !self.clusters.subscribed
            || (self.clusters.in_flight.is_none()
                && served
                    .clusters
                    .keys()
                    .all(|c| self.clusters.last_clusters.contains(c)));
        let filter_behind = self.filter.last.as_ref() != Some(&served.ecds_version);
        if self.filter.subscribed
            && self.filter.in_flight.is_none()
            && clusters_there
            && filter_behind
        {
            let calls = served.clusters.keys().cloned().collect();
            let resources = served.ecds.clone();
            out.push(self.respond(
                Kind::Filter,
                FILTER_TYPE,
                &served.ecds_version,
                resources,
                calls,
                ledger,
            ));
        }
        out
    }

    /// The clusters this Envoy should have, with their version: the served ones, and those
    /// its current (or a retiring) filter still calls.
    fn clusters_wanted<'a>(
        &'a self,
        served: &'a Served,
    ) -> (String, BTreeMap<&'a String, &'a Any>) {
        let mut want: BTreeMap<&String, &Any> = served.clusters.iter().collect();
        let mut kept = false;
        for name in self
            .filter_calls
            .iter()
            .chain(self.retired.iter().flat_map(|(_, names)| names))
        {
            let cluster = self.sent_clusters.get_key_value(name);
            if let Some((name, cluster)) = cluster.filter(|(n, _)| !want.contains_key(n)) {
                want.insert(name, cluster);
                kept = true;
            }
        }
        // Only the served clusters: their version is the served one, not hashed again (each
        // step, on every answer of every Envoy).
        let version = if kept {
            cds_version(want.values().copied())
        } else {
            served.cds_version.clone()
        };
        (version, want)
    }

    fn respond(
        &mut self,
        kind: Kind,
        type_url: &str,
        version: &str,
        resources: Vec<Any>,
        clusters: BTreeSet<String>,
        ledger: &Ledger,
    ) -> DiscoveryResponse {
        self.nonce += 1;
        let nonce = self.nonce.to_string();
        let node = self.node_id().to_owned();
        log::debug!(
            "{node}: sent {kind:?} {version} ({} resources)",
            resources.len()
        );
        ledger.sent(&node, kind, version);
        crate::metrics::pushed(kind);
        let stream = self.kind(kind);
        stream.last = Some(version.to_owned());
        if kind == Kind::Clusters {
            ledger.sending_clusters(version, &clusters);
            stream.last_clusters = clusters.clone();
        }
        stream.in_flight = Some(InFlight {
            version: version.to_owned(),
            nonce: nonce.clone(),
            clusters,
            sent: Instant::now(),
        });
        DiscoveryResponse {
            version_info: version.to_owned(),
            resources,
            type_url: type_url.to_owned(),
            nonce,
            ..DiscoveryResponse::default()
        }
    }
}

#[cfg(test)]
mod push_cost;
