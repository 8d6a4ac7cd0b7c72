//! The watches: one per kind (FanoutChannels, and Knative's InMemoryChannels, Channels,
//! Subscriptions and EventPolicies), each a kube-rs watcher that relists after any error,
//! turned into [`Update`]s for [`Objects`]; each time the whole set changes it is listed to
//! the loop every source shares, which maps it with the directory source's mapper. Every
//! relist counts in `fanout_control_source_relists_total`.

use super::objects::{Objects, Update};
use crate::source::{Listing, Listings};
use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Client;
use serde_json::Value;
use std::time::Duration;
use tokio::sync::mpsc;

/// The kinds watched, in the order the mapper gets them.
pub fn kinds() -> Vec<ApiResource> {
    let kind = |group: &str, version: &str, kind: &str, plural: &str| {
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
    };
    vec![
        kind(
            super::crd::GROUP,
            "v1alpha1",
            "FanoutChannel",
            "fanoutchannels",
        ),
        kind(
            "messaging.knative.dev",
            "v1",
            "InMemoryChannel",
            "inmemorychannels",
        ),
        kind("messaging.knative.dev", "v1", "Channel", "channels"),
        kind(
            "messaging.knative.dev",
            "v1",
            "Subscription",
            "subscriptions",
        ),
        kind(
            "eventing.knative.dev",
            "v1alpha1",
            "EventPolicy",
            "eventpolicies",
        ),
    ]
}

/// How long a watch waits before it tries again after an error: from 200 ms, doubling, at
/// most 5 s (an apiserver back from a restart is watched again within seconds), reset by
/// every event.
pub struct Retry {
    next: Duration,
}

impl Default for Retry {
    fn default() -> Retry {
        Retry { next: FIRST_RETRY }
    }
}

const FIRST_RETRY: Duration = Duration::from_millis(200);
const LAST_RETRY: Duration = Duration::from_secs(5);

impl Iterator for Retry {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        let wait = self.next;
        self.next = (wait * 2).min(LAST_RETRY);
        Some(wait)
    }
}

impl Backoff for Retry {
    fn reset(&mut self) {
        self.next = FIRST_RETRY;
    }
}

/// An object as the mapper reads it: with its `apiVersion` and `kind` (a list's items may
/// lack them) and without `managedFields`.
fn document(object: DynamicObject, resource: &ApiResource) -> Value {
    let mut value = serde_json::to_value(object).unwrap_or(Value::Null);
    if let Some(fields) = value.as_object_mut() {
        fields.insert("apiVersion".into(), resource.api_version.clone().into());
        fields.insert("kind".into(), resource.kind.clone().into());
        if let Some(metadata) = fields.get_mut("metadata").and_then(Value::as_object_mut) {
            metadata.remove("managedFields");
        }
    }
    value
}

fn is_not_found(error: &watcher::Error) -> bool {
    let api = match error {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => e,
        _ => return false,
    };
    matches!(api, kube::Error::Api(status) if status.code == 404)
}

/// Watch one kind until `tx` has no receiver: its updates, tagged with `index`.
async fn watch_kind(
    api: Api<DynamicObject>,
    resource: ApiResource,
    index: usize,
    tx: mpsc::UnboundedSender<(usize, Update)>,
) {
    let name = format!("{}.{}", resource.plural, resource.group);
    let mut stream = watcher::watcher(api, watcher::Config::default())
        .backoff(Retry::default())
        .boxed();
    let (mut absent, mut listed) = (false, false);
    while let Some(event) = stream.next().await {
        let update = match event {
            Ok(Event::Init) => Update::Restarted,
            Ok(Event::InitApply(o)) => Update::Listed(document(o, &resource)),
            Ok(Event::InitDone) => {
                if std::mem::take(&mut absent) {
                    log::info!("{name}: now served by the API, watching it");
                }
                // Every list after the first is a relist (a watch error, 410 Gone, an
                // apiserver restart).
                crate::metrics::source_read(std::mem::replace(&mut listed, true));
                Update::ListDone
            }
            Ok(Event::Apply(o)) => {
                crate::metrics::source_read(false);
                Update::Applied(document(o, &resource))
            }
            Ok(Event::Delete(o)) => {
                crate::metrics::source_read(false);
                Update::Deleted(document(o, &resource))
            }
            Err(e) if is_not_found(&e) => {
                if !std::mem::replace(&mut absent, true) {
                    log::warn!(
                        "{name}: not served by the API (CRD not installed?); none of them \
                         are served until it is"
                    );
                }
                Update::Absent
            }
            Err(e) => {
                log::warn!("{name}: {e}; watching again (serving the last whole list)");
                continue;
            }
        };
        if tx.send((index, update)).is_err() {
            return;
        }
    }
}

/// Watch every kind, in `namespace` or in all, and list the whole set each time it changes
/// (once every kind has been listed whole), until `out` has no receiver.
pub async fn run(client: Client, namespace: Option<String>, out: Listings) {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let resources = kinds();
    let mut objects = Objects::new(resources.len());
    let mut watches = Vec::new();
    for (index, resource) in resources.into_iter().enumerate() {
        let api = match &namespace {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
            None => Api::all_with(client.clone(), &resource),
        };
        watches.push(tokio::spawn(watch_kind(api, resource, index, tx.clone())));
    }
    drop(tx);
    loop {
        let received = tokio::select! {
            received = rx.recv() => received,
            () = out.closed() => None,
        };
        let Some((index, update)) = received else {
            break;
        };
        let mut changed = objects.apply(index, update);
        // What arrived with it is listed in the same pass.
        while let Ok((index, update)) = rx.try_recv() {
            changed |= objects.apply(index, update);
        }
        if changed && objects.complete() {
            let listing = Listing {
                objects: objects.all(),
                problems: Vec::new(),
            };
            if out.send(Some(listing)).is_err() {
                break;
            }
        }
    }
    watches.iter().for_each(tokio::task::JoinHandle::abort);
}
