//! What the server serves, decided from a source's snapshot: which channels (as they are now,
//! their last good version, or not at all), and the two xDS resources they become: the fanout
//! filter's ECDS resource and the subscriber clusters (CDS). Versions are digests of the
//! content, so two servers, or a restarted one, give the same state the same version.

use crate::clusters::cluster;
pub use crate::clusters::Resolve;
use crate::contract::{self, Build};
use crate::model::{ChannelMapping, ChannelSpec, ClusterSpec, Problem, Snapshot};
use crate::resource::any;
use crate::senders::{self, Oidc};
use envoy_types::pb::envoy::config::core::v3::{
    async_data_source, data_source, AsyncDataSource, DataSource, TypedExtensionConfig,
};
use envoy_types::pb::envoy::extensions::dynamic_modules::v3::DynamicModuleConfig;
use envoy_types::pb::envoy::extensions::filters::http::dynamic_modules::v3::DynamicModuleFilter;
use envoy_types::pb::envoy::extensions::filters::http::wasm::v3::Wasm;
use envoy_types::pb::envoy::extensions::wasm::v3::{plugin_config, PluginConfig, VmConfig};
use envoy_types::pb::google::protobuf::{Any, BoolValue, StringValue};
use fanout::routing::normalize_host;
use serde::Serialize;
use serde_json::json;
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::sync::Arc;

/// The ECDS resource's name: what the bootstrap's `config_discovery` asks for.
pub const FILTER_NAME: &str = "fanout";

/// How the resources are rendered (the server's command line).
#[derive(Clone, Debug)]
pub struct RenderOptions {
    /// The build of fanout the Envoys load.
    pub build: Build,
    /// The CA bundle an https cluster trusts when the source names no CA certificates.
    pub trusted_ca: String,
    /// Check senders' tokens from this issuer (`--oidc-issuer`, `--jwks`).
    pub oidc: Option<Oidc>,
    /// Where a cluster's endpoint is instead of its host (`--resolve`).
    pub resolve: Vec<Resolve>,
    /// Every cluster's `connect_timeout` (`--connect-timeout`).
    pub connect_timeout: std::time::Duration,
}

/// Whether a channel is served as the source has it now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Serving {
    /// As the source has it now.
    Current,
    /// The source's version has problems: the last good one is served.
    LastGood,
    /// It has problems and never had a good version: not served (its hosts get 404).
    NotServed,
}

/// One channel as served.
#[derive(Clone, Debug, Serialize)]
pub struct ServedChannel {
    pub serving: Serving,
    /// What is served (the last good spec when `serving` is `last-good`).
    #[serde(skip)]
    pub spec: ChannelSpec,
    /// A digest of what is served: an Envoy whose filter has it has this channel as served.
    pub digest: String,
    pub problems: Vec<Problem>,
    pub warnings: Vec<Problem>,
}

/// Everything the server serves at one moment.
#[derive(Clone, Debug)]
pub struct Served {
    pub channels: BTreeMap<String, ServedChannel>,
    pub problems: Vec<Problem>,
    /// What is served differently from Knative (the channels' own are in `channels`).
    pub warnings: Vec<Problem>,
    /// The ECDS resources: the fanout filter and the two senders filters.
    pub ecds: Vec<Any>,
    pub ecds_version: String,
    pub clusters: BTreeMap<String, Any>,
    pub cds_version: String,
    /// What was written for it, for the next state to reuse.
    written: Written,
}

#[cfg(test)]
impl Served {
    /// A state serving only `channels` at filter version `ecds_version`, for other modules'
    /// tests.
    pub fn of_channels(channels: BTreeMap<String, ServedChannel>, ecds_version: &str) -> Served {
        Served {
            channels,
            problems: Vec::new(),
            warnings: Vec::new(),
            ecds: Vec::new(),
            ecds_version: ecds_version.to_owned(),
            clusters: BTreeMap::new(),
            cds_version: String::new(),
            written: Written::default(),
        }
    }
}

/// What was written for a state, kept for the next one: one change among a thousand
/// channels rewrites (and the filter checks) that one channel, not the thousand. Each served
/// channel's entry of the filter's `channels`, and the spec each cluster was rendered from.
#[derive(Clone, Debug, Default)]
struct Written {
    entries: BTreeMap<String, Arc<RawValue>>,
    clusters: BTreeMap<String, ClusterSpec>,
}

/// Decide what to serve from `snapshot`, falling back for a channel with problems to its
/// version in `previous` (served with the same `options`: what it wrote is reused for what
/// did not change).
pub fn serve(snapshot: &Snapshot, previous: Option<&Served>, options: &RenderOptions) -> Served {
    let (channels, entries) = decide(snapshot, previous, &options.build);
    let written: Vec<&RawValue> = entries.values().map(|e| &**e).collect();
    let plugin = match contract::document(&written) {
        Ok(plugin) => plugin,
        Err(problem) => return unwritten(previous, problem),
    };
    let specs: Vec<(&String, &ChannelSpec)> = channels
        .iter()
        .filter(|(_, c)| c.serving != Serving::NotServed)
        .map(|(n, c)| (n, &c.spec))
        .collect();
    let (mut ecds, who) = senders::filters(&specs, options.oidc.as_ref());
    let ecds_version = digest(&format!("{plugin}\n{}\n{who}", options.build.identity()));
    ecds.insert(0, any(&filter_config(&plugin, &options.build)));
    let specs = cluster_specs(&channels);
    let clusters = render_clusters(&specs, previous, options);
    let cds_version = cds_version(clusters.values());
    let mut warnings = snapshot.warnings.clone();
    for unused in options.resolve.iter().filter(|r| {
        !specs
            .values()
            .any(|c| r.host == c.host && r.port.is_none_or(|p| p == c.port))
    }) {
        let message = "no URI in the input names this host (and port)";
        warnings.push(Problem::new("--resolve", &unused.spec, message));
    }
    Served {
        channels,
        problems: snapshot.problems.clone(),
        warnings,
        ecds,
        ecds_version,
        clusters,
        cds_version,
        written: Written {
            entries,
            clusters: specs,
        },
    }
}

/// The filter's configuration could not be written (serde_json writing text it made itself:
/// not expected): what was served stays, with the problem.
fn unwritten(previous: Option<&Served>, problem: Problem) -> Served {
    log::error!("{}: {}", problem.object, problem.message);
    let mut served = previous.cloned().unwrap_or_else(|| Served {
        channels: BTreeMap::new(),
        problems: Vec::new(),
        warnings: Vec::new(),
        ecds: Vec::new(),
        ecds_version: String::new(),
        clusters: BTreeMap::new(),
        cds_version: String::new(),
        written: Written::default(),
    });
    served.problems.push(problem);
    served
}

/// Every cluster the served channels call; one named by several channels trusts the CA
/// certificates any of them names.
fn cluster_specs(channels: &BTreeMap<String, ServedChannel>) -> BTreeMap<String, ClusterSpec> {
    let mut specs: BTreeMap<String, ClusterSpec> = BTreeMap::new();
    for cluster in channels.values().flat_map(|c| c.spec.clusters.values()) {
        match specs.get_mut(&cluster.name) {
            Some(merged) => {
                for ca in &cluster.ca_certs {
                    if !merged.ca_certs.contains(ca) {
                        merged.ca_certs.push(ca.clone());
                    }
                }
            }
            None => {
                specs.insert(cluster.name.clone(), cluster.clone());
            }
        }
    }
    specs
}

/// Each cluster as a resource: the one `previous` has where its spec did not change.
fn render_clusters(
    specs: &BTreeMap<String, ClusterSpec>,
    previous: Option<&Served>,
    options: &RenderOptions,
) -> BTreeMap<String, Any> {
    let (resolve, ca) = (&options.resolve, &options.trusted_ca);
    let rendered = |name: &String, spec: &ClusterSpec| {
        let previous = previous?;
        (previous.written.clusters.get(name)? == spec)
            .then(|| previous.clusters.get(name).cloned())
            .flatten()
    };
    specs
        .iter()
        .map(|(name, spec)| {
            let cluster = rendered(name, spec)
                .unwrap_or_else(|| any(&cluster(spec, resolve, ca, options.connect_timeout)));
            (name.clone(), cluster)
        })
        .collect()
}

/// Each channel as it is now, its last good version in `previous`, or not at all: a version
/// is served only if the filter takes it and none of its hosts is another channel's. A host
/// stays with the channel that was served with it as long as that channel still names it
/// (or keeps its last good version), so a channel that claims another's host is the one
/// charged with it, whatever the names' order. With them, each served channel's entry of
/// the filter's `channels`.
fn decide(snapshot: &Snapshot, previous: Option<&Served>, build: &Build) -> (Channels, Entries) {
    let served_before = |name: &str| {
        let previous = previous?;
        let channel = previous.channels.get(name)?;
        let entry = previous.written.entries.get(name)?;
        (channel.serving != Serving::NotServed).then_some((channel, entry))
    };
    let mut hosts = Hosts::default();
    for (name, mapping) in &snapshot.channels {
        if let Some((last, _)) = served_before(name) {
            hosts.reserve(mapping.object_or(name), &last.spec, mapping);
        }
    }
    let (mut channels, mut entries) = (BTreeMap::new(), BTreeMap::new());
    for (name, mapping) in &snapshot.channels {
        let (channel, entry) = choose(name, mapping, served_before(name), &hosts, build);
        hosts.claim(mapping.object_or(name), &channel.spec);
        entries.extend(entry.map(|e| (name.clone(), e)));
        channels.insert(name.clone(), channel);
    }
    (channels, entries)
}

type Channels = BTreeMap<String, ServedChannel>;
type Entries = BTreeMap<String, Arc<RawValue>>;

/// The channel as it is now if it has no problems, the filter (of the build the Envoys
/// load) takes it and its hosts are free; else its last good version `last` (with its entry) on the same terms; else not
/// served.
fn choose(
    name: &str,
    mapping: &ChannelMapping,
    last: Option<(&ServedChannel, &Arc<RawValue>)>,
    hosts: &Hosts,
    build: &Build,
) -> (ServedChannel, Option<Arc<RawValue>>) {
    let mut problems = mapping.problems.clone();
    let current = mapping
        .problems
        .is_empty()
        .then_some((Serving::Current, &mapping.spec));
    let candidates = current
        .into_iter()
        .chain(last.map(|(l, _)| (Serving::LastGood, &l.spec)));
    for (serving, spec) in candidates {
        let taken = written(name, spec, last, build)
            .and_then(|w| hosts.free(mapping.object_or(name), spec).map(|()| w));
        match taken {
            Ok((digest, entry)) => {
                let channel = ServedChannel {
                    serving,
                    spec: spec.clone(),
                    digest,
                    problems,
                    warnings: mapping.warnings.clone(),
                };
                return (channel, Some(entry));
            }
            Err(problem) if !problems.contains(&problem) => problems.push(problem),
            Err(_) => {}
        }
    }
    let spec = ChannelSpec::default();
    let channel = ServedChannel {
        serving: Serving::NotServed,
        digest: channel_digest(&json!(contract::channel(name, &spec)).to_string(), &spec),
        spec,
        problems,
        warnings: mapping.warnings.clone(),
    };
    (channel, None)
}

/// `spec` written as the filter's entry, with its digest, if the filter takes it. What was
/// served (`last`) is known to be taken: unchanged, it is not written or checked again.
fn written(
    name: &str,
    spec: &ChannelSpec,
    last: Option<(&ServedChannel, &Arc<RawValue>)>,
    build: &Build,
) -> Result<(String, Arc<RawValue>), Problem> {
    if let Some((last, entry)) = last.filter(|(l, _)| l.spec == *spec) {
        return Ok((last.digest.clone(), entry.clone()));
    }
    let entry = contract::entry(name, spec)?;
    let digest = channel_digest(entry.get(), spec);
    if last.is_none_or(|(l, _)| l.digest != digest) {
        contract::check_entry(name, spec, &entry, build)?;
    }
    Ok((digest, entry))
}

/// A digest of a channel as served (its entry of the filter's `channels`, written, and who
/// may send to it): an Envoy whose filter has it has this channel.
fn channel_digest(entry: &str, spec: &ChannelSpec) -> String {
    digest(&format!("[{entry},{}]", json!(spec.senders)))
}

/// Whose each host is (by the object of its channel), compared as the filter compares them:
/// claimed by a channel decided already, or reserved for the channel served with it before.
#[derive(Default)]
struct Hosts {
    claimed: BTreeMap<String, String>,
    reserved: BTreeMap<String, String>,
}

impl Hosts {
    /// Reserve the hosts `name` was served with (`last`) that it still names now, or all of
    /// them if it has problems (it keeps its last good version).
    fn reserve(&mut self, name: &str, last: &ChannelSpec, now: &ChannelMapping) {
        let named_now = |host: &str| {
            now.spec
                .hosts
                .iter()
                .any(|h| normalize_host(h) == normalize_host(host))
        };
        for host in &last.hosts {
            if !now.problems.is_empty() || named_now(host) {
                let key = normalize_host(host).into_owned();
                self.reserved.insert(key, name.to_owned());
            }
        }
    }

    /// Whether none of the channel's hosts is another channel's.
    fn free(&self, name: &str, spec: &ChannelSpec) -> Result<(), Problem> {
        for host in &spec.hosts {
            let key = normalize_host(host);
            let owner = self
                .claimed
                .get(key.as_ref())
                .or_else(|| self.reserved.get(key.as_ref()));
            if let Some(owner) = owner.filter(|owner| *owner != name) {
                let message = format!("host {host} is also {owner}'s");
                return Err(Problem::new(name, "status.address.url", message));
            }
        }
        Ok(())
    }

    fn claim(&mut self, name: &str, spec: &ChannelSpec) {
        for host in &spec.hosts {
            self.claimed
                .entry(normalize_host(host).into_owned())
                .or_insert_with(|| name.to_owned());
        }
    }
}

/// The version of a set of clusters: a digest of their encoding.
pub fn cds_version<'a>(clusters: impl Iterator<Item = &'a Any>) -> String {
    let mut hasher = Sha256::new();
    for cluster in clusters {
        hasher.update(&cluster.value);
        hasher.update(b"\n");
    }
    hex16(&hasher.finalize())
}

pub fn digest(text: &str) -> String {
    hex16(&Sha256::digest(text.as_bytes()))
}

fn hex16(bytes: &[u8]) -> String {
    bytes.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// The fanout filter as an ECDS resource (`fanout-control render` writes it as `fanout.yaml`),
/// for the build the Envoys load.
fn filter_config(plugin: &str, build: &Build) -> TypedExtensionConfig {
    let typed_config = match build {
        Build::Wasm(wasm) => any(&wasm_filter(plugin, wasm)),
        Build::Native(module) => any(&native_filter(plugin, module)),
    };
    TypedExtensionConfig {
        name: FILTER_NAME.to_owned(),
        typed_config: Some(typed_config),
    }
}

/// The native build's filter (docs/native.md): the library by its name (Envoy's
/// `ENVOY_DYNAMIC_MODULES_SEARCH_PATH`) or by its absolute path, and the same JSON as the
/// wasm filter's plugin configuration.
fn native_filter(plugin: &str, module: &str) -> DynamicModuleFilter {
    let (name, file) = if module.starts_with('/') {
        (String::new(), Some(local_file(module)))
    } else {
        (module.to_owned(), None)
    };
    // do_not_close: every new version is a new filter configuration on the same library;
    // kept loaded, the library keeps its dedupe store across versions.
    let config = DynamicModuleConfig {
        name,
        module: file,
        do_not_close: true,
        ..DynamicModuleConfig::default()
    };
    DynamicModuleFilter {
        dynamic_module_config: Some(config),
        filter_name: FILTER_NAME.to_owned(),
        filter_config: Some(any(&StringValue {
            value: plugin.to_owned(),
        })),
        ..DynamicModuleFilter::default()
    }
}

fn local_file(path: &str) -> AsyncDataSource {
    AsyncDataSource {
        specifier: Some(async_data_source::Specifier::Local(DataSource {
            specifier: Some(data_source::Specifier::Filename(path.to_owned())),
            ..DataSource::default()
        })),
    }
}

/// The wasm filter: the module file, its VM and the plugin configuration.
fn wasm_filter(plugin: &str, wasm: &str) -> Wasm {
    let code = local_file(wasm);
    // The same vm_id and code in every version: Envoy keeps the VMs and starts only a new
    // plugin in them for each new configuration.
    let vm = VmConfig {
        vm_id: FILTER_NAME.to_owned(),
        runtime: "envoy.wasm.runtime.v8".to_owned(),
        code: Some(code),
        ..VmConfig::default()
    };
    let config = PluginConfig {
        name: FILTER_NAME.to_owned(),
        root_id: FILTER_NAME.to_owned(),
        configuration: Some(any(&StringValue {
            value: plugin.to_owned(),
        })),
        allow_on_headers_stop_iteration: Some(BoolValue { value: true }),
        vm: Some(plugin_config::Vm::VmConfig(vm)),
        ..PluginConfig::default()
    };
    Wasm {
        config: Some(config),
    }
}

#[cfg(test)]
mod tests;
