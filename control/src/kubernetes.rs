//! The Kubernetes source (`--source kubernetes`) and the FanoutChannel kind: watches on the
//! Kubernetes API turned into the objects the mapper reads ([`crate::knative::map`]).

mod acks;
pub mod crd;
mod lease;
mod objects;
mod reports;
mod status;
mod watch;
mod writer;

pub use writer::Writer;

use crate::source::{Listings, Source};
use std::future::Future;
use std::pin::Pin;

/// `NS/NAME`, for the flags that name a namespaced object.
pub fn namespaced(value: &str) -> Result<(String, String), String> {
    match value.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
            Ok((ns.to_owned(), name.to_owned()))
        }
        _ => Err(format!("{value:?}: expected NAMESPACE/NAME")),
    }
}

/// The Kubernetes API as the source of truth: in-cluster configuration, or `KUBECONFIG` (or
/// `~/.kube/config`); the objects of `namespace`, or of every namespace.
pub struct KubeSource {
    namespace: Option<String>,
}

impl KubeSource {
    pub fn new(namespace: Option<String>) -> KubeSource {
        KubeSource { namespace }
    }
}

impl Source for KubeSource {
    fn describe(&self) -> String {
        match &self.namespace {
            Some(ns) => format!("kubernetes (namespace {ns})"),
            None => "kubernetes (all namespaces)".to_owned(),
        }
    }

    fn run(self: Box<Self>, out: Listings) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let client = match kube::Client::try_default().await {
                Ok(client) => client,
                Err(e) => {
                    // Nothing to retry: the configuration itself is wrong.
                    log::error!(
                        "kubernetes source: no usable configuration (in-cluster, KUBECONFIG \
                         or ~/.kube/config): {e}"
                    );
                    std::process::exit(2);
                }
            };
            watch::run(client, self.namespace, out).await;
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::knative;
    use crate::model::MapOptions;
    use serde_json::json;

    /// A FanoutChannel maps as an InMemoryChannel does: at its conventional host, with its
    /// subscribers and the Subscriptions that name it.
    #[test]
    fn a_fanout_channel_is_served_at_its_conventional_host() {
        let channel = json!({
            "apiVersion": "messaging.fanout.dev/v1alpha1", "kind": "FanoutChannel",
            "metadata": { "name": "orders", "namespace": "shop", "uid": "c1" },
            "spec": { "subscribers": [{ "uid": "s1", "generation": 1,
                "subscriberUri": "http://billing.shop.svc.cluster.local/" }] }
        });
        let snapshot = knative::map(&MapOptions::default(), vec![channel]);
        let mapped = &snapshot.channels["shop/orders"];
        assert!(mapped.problems.is_empty(), "{:?}", mapped.problems);
        assert!(mapped.warnings.is_empty(), "{:?}", mapped.warnings);
        assert_eq!(
            mapped.spec.hosts,
            vec!["orders-kn-channel.shop.svc.cluster.local".to_owned()]
        );
        assert_eq!(mapped.spec.subscribers.len(), 1);
    }

    /// A Knative Channel backed by a FanoutChannel is one fanout channel.
    #[test]
    fn a_channel_with_a_fanout_channel_template_is_one_channel() {
        let channel = json!({
            "apiVersion": "messaging.knative.dev/v1", "kind": "Channel",
            "metadata": { "name": "orders", "namespace": "shop" },
            "spec": { "channelTemplate": { "apiVersion": "messaging.fanout.dev/v1alpha1",
                "kind": "FanoutChannel" } },
            "status": { "channel": { "apiVersion": "messaging.fanout.dev/v1alpha1",
                "kind": "FanoutChannel", "name": "orders", "namespace": "shop" } }
        });
        let backing = json!({
            "apiVersion": "messaging.fanout.dev/v1alpha1", "kind": "FanoutChannel",
            "metadata": { "name": "orders", "namespace": "shop" },
            "spec": { "subscribers": [{ "uid": "s1",
                "subscriberUri": "http://billing.shop.svc.cluster.local/" }] }
        });
        let snapshot = knative::map(&MapOptions::default(), vec![channel, backing]);
        assert_eq!(snapshot.channels.len(), 1, "{:?}", snapshot.channels.keys());
        let mapped = &snapshot.channels["shop/orders"];
        assert_eq!(
            mapped.spec.hosts,
            vec!["orders-kn-channel.shop.svc.cluster.local".to_owned()]
        );
        assert_eq!(mapped.spec.subscribers.len(), 1);
    }
}
