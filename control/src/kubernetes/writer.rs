//! The status writer: every replica runs it and publishes what its own Envoys serve
//! ([`super::reports`]); the one holding the Lease writes. Each tick it decides every
//! FanoutChannel's status ([`super::status::desired`]) from the channel, what is served and
//! what the connected Envoys of every replica ACKed, and writes the ones that differ (a merge
//! patch at the resourceVersion it read: a stale view is a conflict, never an overwrite), at
//! most [`WRITES_PER_TICK`] per tick, [`CONCURRENT_WRITES`] at once. It also gives each
//! channel its `<name>-kn-channel` Service and Knative's `subscribable` annotation.

use super::acks::{self, at, Report, Versions};
use super::crd::{FanoutChannel, FanoutChannelStatus, KReference};
use super::lease::{Elector, DURATION, RENEW};
use super::reports::{self, Publisher, Reports};
use super::status::{desired, Fleet, Observed};
use super::watch::Retry;
use crate::knative;
use crate::model::{ChannelMapping, MapOptions};
use crate::render::{Served, ServedChannel, Serving};
use crate::state::Ledger;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, CustomResourceExt, Resource, ResourceExt};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How often statuses are decided.
const TICK: Duration = Duration::from_millis(200);
/// At most this many channels' statuses decided (and written) per tick.
const WRITES_PER_TICK: usize = 50;
/// Of those, this many written at once.
const CONCURRENT_WRITES: usize = 8;

/// What became of a status write.
enum Written {
    /// The channel has that status already.
    Unchanged,
    /// Written at this resourceVersion.
    Wrote(String, Value),
    /// Not written (a conflict, an error): decided again.
    Failed,
}

/// The annotation Knative's channel conformance asks every channel object to carry.
const SUBSCRIBABLE: &str = "messaging.knative.dev/subscribable";

/// Who writes, and where.
pub struct Writer {
    pub client: Client,
    /// The namespace watched (all when None).
    pub namespace: Option<String>,
    /// The Lease, `(namespace, name)`.
    pub lease: (String, String),
    /// The Service of the fanout Envoys, `(namespace, name)`: each channel's
    /// `<name>-kn-channel` Service is an ExternalName to it.
    pub dispatcher: Option<(String, String)>,
    pub options: MapOptions,
}

/// What the writer remembers between ticks.
#[derive(Default)]
struct Memory {
    /// By channel: the resourceVersion a status was written at, and that status.
    written: BTreeMap<String, (String, Value)>,
    /// Channels (by uid) whose Service and annotation are in place.
    ensured: HashSet<String>,
    /// By channel: what its status was last decided from, when the channel had it then
    /// (decided again only when that changes, and every [`REDECIDE`] ticks: a dead-letter
    /// sink's address may change on its own).
    decided: BTreeMap<String, String>,
    ticks: u64,
}

impl Memory {
    fn tick(&mut self) {
        self.ticks += 1;
        if self.ticks.is_multiple_of(REDECIDE) {
            self.decided.clear();
        }
    }
}

/// Every this many ticks, every channel's status is decided again.
const REDECIDE: u64 = 150;

fn key(channel: &FanoutChannel) -> String {
    format!(
        "{}/{}",
        channel.namespace().unwrap_or_default(),
        channel.name_any()
    )
}

/// Whether what is served for a channel serves every subscriber of its current generation
/// (`mapping`, the channel mapped on its own) as it is now.
fn serves(mapping: Option<&ChannelMapping>, served: Option<&ServedChannel>) -> bool {
    match (mapping, served) {
        (Some(m), Some(s)) => {
            s.serving == Serving::Current
                && m.spec
                    .subscribers
                    .iter()
                    .all(|x| s.spec.subscribers.contains(x))
        }
        _ => false,
    }
}

/// This replica's own Envoys, summed up ([`acks::local`]) again only when the ledger's
/// record of them or what is served changed.
#[derive(Default)]
struct Own {
    versions: Versions,
    fingerprint: String,
    report: Report,
}

impl Own {
    fn update(&mut self, ledger: &Ledger, served: &Served) {
        self.versions.record(served);
        let fingerprint = ledger.view(|in_ledger, envoys| {
            let each: Vec<_> = envoys
                .iter()
                .map(|(node, e)| {
                    let nack = e.filter.nack.as_ref().map(|n| &n.version);
                    (
                        node,
                        e.streams > 0,
                        &e.filter.acked,
                        &e.clusters.acked,
                        nack,
                    )
                })
                .collect();
            let version = in_ledger.map(|s| s.ecds_version.as_str());
            format!("{}|{version:?}|{each:?}", served.ecds_version)
        });
        if fingerprint != self.fingerprint {
            self.report = acks::local(&ledger.report(), &mut self.versions);
            self.fingerprint = fingerprint;
        }
    }
}

/// A channel's key, what each replica's Envoys have of it, and everything its status is
/// decided from as one string: the object's version, what is served of it and those
/// Envoys (nothing else changes it).
fn decided_from<'a>(
    object: &DynamicObject,
    served: &Served,
    reports: &[&'a Report],
) -> (String, Vec<Fleet<'a>>, String) {
    let name = format!(
        "{}/{}",
        object.namespace().unwrap_or_default(),
        object.name_any()
    );
    let fleets: Vec<Fleet> = reports
        .iter()
        .map(|r| Fleet {
            envoys: r.envoys,
            acked: r.channels.get(&name),
        })
        .collect();
    let served_channel = served.channels.get(&name);
    let inputs = format!(
        "{}|{:?}|{fleets:?}",
        object.resource_version().unwrap_or_default(),
        served_channel.map(|c| (&c.digest, c.serving)),
    );
    (name, fleets, inputs)
}

/// A name for this replica: its host (the pod's name) and process.
fn identity() -> String {
    format!(
        "{}-{}",
        std::env::var("HOSTNAME").unwrap_or_else(|_| "fanout-control".into()),
        std::process::id()
    )
}

impl Writer {
    /// Run until the process ends.
    pub async fn run(self, ledger: Ledger, served: watch::Receiver<Option<Arc<Served>>>) {
        let store = self.watch_channels();
        let elector = Elector {
            api: Api::namespaced(self.client.clone(), &self.lease.0),
            name: self.lease.1.clone(),
            identity: identity(),
        };
        let report_name = reports::name(&self.lease.1, &elector.identity);
        let mut publisher = Publisher::new(self.client.clone(), &self.lease.0, report_name.clone());
        let mut reports = Reports::watch(self.client.clone(), &self.lease.0);
        let (mut own, mut memory) = (Own::default(), Memory::default());
        let mut held_until: Option<Instant> = None;
        let (mut renew, mut tick) = (tokio::time::interval(RENEW), tokio::time::interval(TICK));
        loop {
            tokio::select! {
                _ = renew.tick() => {
                    let started = Instant::now();
                    let holds = elector.hold().await;
                    if holds != held_until.is_some_and(|t| Instant::now() < t) {
                        log::info!("lease {}/{}: {} ({})", self.lease.0, self.lease.1,
                            if holds { "this replica writes status" } else { "another replica writes status" },
                            elector.identity);
                    }
                    // Held for its duration from before the write, less a renewal's margin.
                    held_until = holds.then(|| started + DURATION - RENEW);
                }
                _ = tick.tick() => {
                    let current = served.borrow().clone();
                    let Some(current) = current else { continue };
                    own.update(&ledger, &current);
                    publisher.publish(&own.report).await;
                    if held_until.is_some_and(|t| Instant::now() < t) {
                        let now = Timestamp::now();
                        let others = reports.fresh(&report_name, now);
                        let all: Vec<&Report> = std::iter::once(&own.report)
                            .chain(others.iter().map(|r| &**r))
                            .collect();
                        self.sync(&store, &current, &all, &mut memory).await;
                        reports.forget_gone(now).await;
                    }
                }
            }
        }
    }

    /// The FanoutChannels, watched into a store (dynamic objects: a FanoutChannel Knative
    /// creates has no spec at first).
    fn watch_channels(&self) -> Store<DynamicObject> {
        let resource = FanoutChannel::api_resource();
        let channels: Api<DynamicObject> = match &self.namespace {
            Some(ns) => Api::namespaced_with(self.client.clone(), ns, &resource),
            None => Api::all_with(self.client.clone(), &resource),
        };
        let cache = reflector::store::Writer::<DynamicObject>::new(resource);
        let store = cache.as_reader();
        let stream = watcher(channels, watcher::Config::default()).backoff(Retry::default());
        tokio::spawn(reflector::reflector(cache, stream).for_each(|_| async {}));
        store
    }

    /// Decide every channel's status from what is served and every replica's report
    /// (`reports`); write those that differ.
    async fn sync(
        &self,
        store: &Store<DynamicObject>,
        served: &Served,
        reports: &[&Report],
        memory: &mut Memory,
    ) {
        let now = Timestamp::now().round(k8s_openapi::jiff::Unit::Second);
        let now = now.map(|t| t.to_string()).unwrap_or_default();
        memory.tick();
        let mut turns = Vec::new();
        for object in store.state() {
            if turns.len() >= WRITES_PER_TICK {
                break;
            }
            let (name, fleets, inputs) = decided_from(&object, served, reports);
            let ensured = object.uid().is_some_and(|u| memory.ensured.contains(&u));
            if ensured && memory.decided.get(&name) == Some(&inputs) {
                continue;
            }
            match super::crd::from_object(&*object) {
                Ok(channel) => turns.push((name, inputs, channel, fleets)),
                Err(e) => log::warn!("FanoutChannel {name}: {e}"),
            }
        }
        let (mine, now) = (&*memory, now.as_str());
        let each: Vec<_> = turns
            .iter_mut()
            .map(|(name, _, channel, fleets)| self.turn(name, channel, fleets, served, now, mine))
            .collect();
        let outcomes: Vec<(Option<String>, Written)> = futures::stream::iter(each)
            .buffered(CONCURRENT_WRITES)
            .collect()
            .await;
        for ((name, inputs, _, _), (ensured, written)) in turns.into_iter().zip(outcomes) {
            memory.ensured.extend(ensured);
            match written {
                // Decided again next tick.
                Written::Failed => continue,
                Written::Unchanged => {}
                Written::Wrote(version, status) => {
                    memory.written.insert(name.clone(), (version, status));
                }
            }
            memory.decided.insert(name, inputs);
        }
    }

    /// One channel's turn: its Service and annotation (the uid when they were put in place
    /// now), and its status decided and written.
    async fn turn(
        &self,
        name: &str,
        channel: &mut FanoutChannel,
        fleets: &[Fleet<'_>],
        served: &Served,
        now: &str,
        memory: &Memory,
    ) -> (Option<String>, Written) {
        let ensured = self.ensure(channel, &memory.ensured).await;
        let status = self.decide(name, channel, fleets, served, now).await;
        let written = self.write(channel, status, memory.written.get(name)).await;
        (ensured, written)
    }

    /// The status `channel` should have.
    async fn decide(
        &self,
        name: &str,
        channel: &FanoutChannel,
        fleets: &[Fleet<'_>],
        served: &Served,
        now: &str,
    ) -> FanoutChannelStatus {
        let alone = self.map_alone(channel);
        let mapping = alone.channels.get(name);
        let served_channel = served.channels.get(name);
        desired(&Observed {
            channel,
            problems: mapping.map(|m| m.problems.as_slice()).unwrap_or_default(),
            mapped: mapping.map(|m| &m.spec),
            served: served_channel,
            served_is_current: serves(mapping, served_channel),
            fleets,
            dead_letter: self.dead_letter(channel).await,
            now,
        })
    }

    /// The channel mapped on its own: what this generation of it is served as.
    fn map_alone(&self, channel: &FanoutChannel) -> crate::model::Snapshot {
        let mut doc = serde_json::to_value(channel).unwrap_or(Value::Null);
        if let Some(fields) = doc.as_object_mut() {
            fields.insert("apiVersion".into(), json!(FanoutChannel::api_version(&())));
            fields.insert("kind".into(), json!("FanoutChannel"));
        }
        knative::map(&self.options, vec![doc])
    }

    /// Write `status` when it differs from the channel's (and from what was `written` at
    /// this version).
    async fn write(
        &self,
        channel: &FanoutChannel,
        status: FanoutChannelStatus,
        written: Option<&(String, Value)>,
    ) -> Written {
        let want = serde_json::to_value(&status).unwrap_or(Value::Null);
        let have =
            serde_json::to_value(channel.status.clone().unwrap_or_default()).unwrap_or(Value::Null);
        let version = channel.resource_version().unwrap_or_default();
        let name = key(channel);
        if want == have || written == Some(&(version.clone(), want.clone())) {
            return Written::Unchanged;
        }
        // A merge patch: what the status no longer has is removed with null.
        let mut patch = want.clone();
        if let (Some(patch), Some(have)) = (patch.as_object_mut(), have.as_object()) {
            for gone in have
                .keys()
                .filter(|k| !patch.contains_key(*k))
                .cloned()
                .collect::<Vec<_>>()
            {
                patch.insert(gone, Value::Null);
            }
        }
        let api: Api<FanoutChannel> = Api::namespaced(
            self.client.clone(),
            &channel.namespace().unwrap_or_default(),
        );
        let body = json!({ "metadata": { "resourceVersion": version }, "status": patch });
        match api
            .patch_status(
                &channel.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&body),
            )
            .await
        {
            Ok(_) => {
                crate::metrics::status_written("ok");
                Written::Wrote(version, want)
            }
            // Written by someone else meanwhile: decided again from the new version.
            Err(kube::Error::Api(s)) if s.code == 409 => {
                crate::metrics::status_written("conflict");
                Written::Failed
            }
            Err(e) => {
                crate::metrics::status_written("error");
                log::warn!("FanoutChannel {name}: cannot write its status: {e}");
                Written::Failed
            }
        }
    }

    /// The channel's Service and annotation, once per channel (`ensured`: the channels, by
    /// uid, that have them): its uid when they are in place now. An annotated channel gets
    /// the version the annotation made, so that its status is not a conflict.
    async fn ensure(
        &self,
        channel: &mut FanoutChannel,
        ensured: &HashSet<String>,
    ) -> Option<String> {
        let uid = channel.uid()?;
        if ensured.contains(&uid) {
            return None;
        }
        let (name, ns) = (channel.name_any(), channel.namespace().unwrap_or_default());
        let mut ok = true;
        if channel.annotations().get(SUBSCRIBABLE).map(String::as_str) != Some("v1") {
            let api: Api<FanoutChannel> = Api::namespaced(self.client.clone(), &ns);
            let body = json!({ "metadata": { "annotations": { SUBSCRIBABLE: "v1" } } });
            match api
                .patch(&name, &PatchParams::default(), &Patch::Merge(&body))
                .await
            {
                // Its status is written at the annotated version, when the spec is the same.
                Ok(annotated) if annotated.metadata.generation == channel.metadata.generation => {
                    channel.metadata.resource_version = annotated.metadata.resource_version;
                }
                Ok(_) => {}
                Err(e) => {
                    log::warn!("FanoutChannel {ns}/{name}: cannot annotate it: {e}");
                    ok = false;
                }
            }
        }
        if let Some((dns, dname)) = &self.dispatcher {
            let service = json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {
                    "name": format!("{name}-kn-channel"), "namespace": ns,
                    "labels": { "messaging.fanout.dev/channel": name },
                    "ownerReferences": [{
                        "apiVersion": FanoutChannel::api_version(&()), "kind": "FanoutChannel",
                        "name": name, "uid": uid, "controller": true, "blockOwnerDeletion": true
                    }]
                },
                "spec": { "type": "ExternalName", "externalName": format!("{dname}.{dns}.svc.cluster.local") }
            });
            let api: Api<Service> = Api::namespaced(self.client.clone(), &ns);
            let apply = PatchParams::apply("fanout-control").force();
            if let Err(e) = api
                .patch(
                    &format!("{name}-kn-channel"),
                    &apply,
                    &Patch::Apply(&service),
                )
                .await
            {
                log::warn!("FanoutChannel {ns}/{name}: cannot apply its Service: {e}");
                ok = false;
            }
        }
        ok.then_some(uid)
    }

    /// `spec.delivery.deadLetterSink` as a URI, or why not; None when there is none.
    async fn dead_letter(&self, channel: &FanoutChannel) -> Option<Result<String, String>> {
        let sink = channel.spec.delivery.as_ref()?.dead_letter_sink.as_ref()?;
        let ns = channel.namespace().unwrap_or_default();
        let base = match &sink.reference {
            None => None,
            Some(reference) => match self.resolve(reference, &ns).await {
                Ok(url) => Some(url),
                Err(e) => return Some(Err(e)),
            },
        };
        Some(match (base, &sink.uri) {
            (Some(base), Some(uri)) if !uri.contains("://") => Ok(format!(
                "{}/{}",
                base.trim_end_matches('/'),
                uri.trim_start_matches('/')
            )),
            (Some(base), None) => Ok(base),
            (_, Some(uri)) => Ok(uri.clone()),
            (None, None) => Err("spec.delivery.deadLetterSink: neither ref nor uri".to_owned()),
        })
    }

    /// The address of a referenced object: a Service's cluster name, or what the object's
    /// `status.address.url` says.
    async fn resolve(&self, reference: &KReference, namespace: &str) -> Result<String, String> {
        let ns = reference.namespace.as_deref().unwrap_or(namespace);
        let api_version = reference.api_version.as_deref().unwrap_or("v1");
        let what = format!(
            "spec.delivery.deadLetterSink.ref {} {ns}/{}",
            reference.kind, reference.name
        );
        if reference.kind == "Service" && api_version == "v1" {
            return Ok(format!("http://{}.{ns}.svc.cluster.local", reference.name));
        }
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        let gvk = GroupVersionKind::gvk(group, version, &reference.kind);
        let (resource, _) = kube::discovery::pinned_kind(&self.client, &gvk)
            .await
            .map_err(|e| format!("{what}: {e}"))?;
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), ns, &resource);
        let object = api
            .get(&reference.name)
            .await
            .map_err(|e| format!("{what}: {e}"))?;
        at(&object.data, &["status", "address", "url"])
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("{what}: has no status.address.url"))
    }
}
