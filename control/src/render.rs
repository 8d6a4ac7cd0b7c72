//! What the server serves, decided from a source's snapshot: which channels (as they are now,
//! their last good version, or not at all), and the two xDS resources they become: the fanout
//! filter's ECDS resource and the subscriber clusters (CDS). Versions are digests of the
//! content, so two servers, or a restarted one, give the same state the same version.

use crate::clusters::cluster;
pub use crate::clusters::Resolve;
use crate::contract;
use crate::model::{ChannelMapping, ChannelSpec, ClusterSpec, Problem, Snapshot};
use crate::resource::any;
use crate::senders::{self, Oidc};
use envoy_types::pb::envoy::config::core::v3::{
    async_data_source, data_source, AsyncDataSource, DataSource, TypedExtensionConfig,
};
use envoy_types::pb::envoy::extensions::filters::http::wasm::v3::Wasm;
use envoy_types::pb::envoy::extensions::wasm::v3::{plugin_config, PluginConfig, VmConfig};
use envoy_types::pb::google::protobuf::{Any, BoolValue, StringValue};
use fanout::routing::normalize_host;
use serde::Serialize;
use serde_json::json;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// The ECDS resource's name: what the bootstrap's `config_discovery` asks for.
pub const FILTER_NAME: &str = "fanout";

/// How the resources are rendered (the server's command line).
#[derive(Clone, Debug)]
pub struct RenderOptions {
    /// fanout.wasm as the Envoys see it.
    pub wasm: String,
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
}

/// Decide what to serve from `snapshot`, falling back for a channel with problems to its
/// version in `previous`.
pub fn serve(snapshot: &Snapshot, previous: Option<&Served>, options: &RenderOptions) -> Served {
    let channels = decide(snapshot, previous);
    let served: Vec<_> = channels
        .iter()
        .filter(|(_, c)| c.serving != Serving::NotServed)
        .collect();
    let plugin = contract::document(
        served
            .iter()
            .map(|(n, c)| contract::channel(n, &c.spec))
            .collect(),
    );
    let specs: Vec<(&String, &ChannelSpec)> = served.iter().map(|(n, c)| (*n, &c.spec)).collect();
    let (mut ecds, who) = senders::filters(&specs, options.oidc.as_ref());
    let ecds_version = digest(&format!("{plugin}\n{}\n{who}", options.wasm));
    ecds.insert(0, any(&filter_config(&plugin, &options.wasm)));
    let mut clusters = BTreeMap::new();
    for (_, channel) in served {
        for cluster in channel.spec.clusters.values() {
            clusters
                .entry(cluster.name.clone())
                .or_insert_with(|| cluster_spec_merge(cluster, &channels));
        }
    }
    let clusters_named: Vec<(String, u16)> = clusters
        .values()
        .map(|c| (c.host.clone(), c.port))
        .collect();
    let (resolve, ca) = (&options.resolve, &options.trusted_ca);
    let clusters: BTreeMap<String, Any> = clusters
        .into_iter()
        .map(|(name, spec)| {
            (
                name,
                any(&cluster(&spec, resolve, ca, options.connect_timeout)),
            )
        })
        .collect();
    let cds_version = cds_version(clusters.values());
    let mut warnings = snapshot.warnings.clone();
    for unused in options.resolve.iter().filter(|r| {
        !clusters_named
            .iter()
            .any(|(host, port)| r.host == *host && r.port.is_none_or(|p| p == *port))
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
    }
}

/// Each channel as it is now, its last good version in `previous`, or not at all: a version
/// is served only if the filter takes it and none of its hosts is another channel's. A host
/// stays with the channel that was served with it as long as that channel still names it
/// (or keeps its last good version), so a channel that claims another's host is the one
/// charged with it, whatever the names' order.
fn decide(snapshot: &Snapshot, previous: Option<&Served>) -> BTreeMap<String, ServedChannel> {
    let served_before = |name: &str| {
        previous
            .and_then(|p| p.channels.get(name))
            .filter(|c| c.serving != Serving::NotServed)
    };
    let mut hosts = Hosts::default();
    for (name, mapping) in &snapshot.channels {
        if let Some(last) = served_before(name) {
            hosts.reserve(mapping.object_or(name), &last.spec, mapping);
        }
    }
    let mut channels = BTreeMap::new();
    for (name, mapping) in &snapshot.channels {
        let channel = choose(name, mapping, served_before(name), &hosts);
        hosts.claim(mapping.object_or(name), &channel.spec);
        channels.insert(name.clone(), channel);
    }
    channels
}

/// The channel as it is now if it has no problems, the filter takes it and its hosts are
/// free; else its last good version `last` on the same terms; else not served.
fn choose(
    name: &str,
    mapping: &ChannelMapping,
    last: Option<&ServedChannel>,
    hosts: &Hosts,
) -> ServedChannel {
    let mut problems = mapping.problems.clone();
    let current = mapping
        .problems
        .is_empty()
        .then_some((Serving::Current, &mapping.spec));
    let candidates = current
        .into_iter()
        .chain(last.map(|l| (Serving::LastGood, &l.spec)));
    for (serving, spec) in candidates {
        let digest = channel_digest(name, spec);
        // What was served is known to be taken.
        let taken = if last.is_some_and(|l| l.digest == digest) {
            Ok(())
        } else {
            contract::check(name, spec)
        };
        match taken.and_then(|()| hosts.free(mapping.object_or(name), spec)) {
            Ok(()) => {
                return ServedChannel {
                    serving,
                    spec: spec.clone(),
                    digest,
                    problems,
                    warnings: mapping.warnings.clone(),
                }
            }
            Err(problem) if !problems.contains(&problem) => problems.push(problem),
            Err(_) => {}
        }
    }
    let spec = ChannelSpec::default();
    ServedChannel {
        serving: Serving::NotServed,
        digest: channel_digest(name, &spec),
        spec,
        problems,
        warnings: mapping.warnings.clone(),
    }
}

/// A digest of a channel as served: an Envoy whose filter has it has this channel.
fn channel_digest(name: &str, spec: &ChannelSpec) -> String {
    digest(&json!([contract::channel(name, spec), spec.senders]).to_string())
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

/// A cluster named by several channels trusts the CA certificates any of them names.
fn cluster_spec_merge(
    first: &ClusterSpec,
    channels: &BTreeMap<String, ServedChannel>,
) -> ClusterSpec {
    let mut merged = first.clone();
    for other in channels
        .values()
        .filter_map(|c| c.spec.clusters.get(&first.name))
    {
        for ca in &other.ca_certs {
            if !merged.ca_certs.contains(ca) {
                merged.ca_certs.push(ca.clone());
            }
        }
    }
    merged
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

/// The fanout filter as an ECDS resource (`fanout-control render` writes it as `fanout.yaml`).
fn filter_config(plugin: &str, wasm: &str) -> TypedExtensionConfig {
    let code = AsyncDataSource {
        specifier: Some(async_data_source::Specifier::Local(DataSource {
            specifier: Some(data_source::Specifier::Filename(wasm.to_owned())),
            ..DataSource::default()
        })),
    };
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
    TypedExtensionConfig {
        name: FILTER_NAME.to_owned(),
        typed_config: Some(any(&Wasm {
            config: Some(config),
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knative;
    use crate::model::MapOptions;
    use envoy_types::pb::envoy::config::cluster::v3::{
        cluster::ClusterDiscoveryType, cluster::DiscoveryType, Cluster,
    };
    use envoy_types::pb::envoy::config::core::v3::transport_socket;
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::UpstreamTlsContext;
    use prost::Message;
    use serde_json::Value;

    fn options() -> RenderOptions {
        RenderOptions {
            wasm: "/w/fanout.wasm".into(),
            trusted_ca: "/ca.crt".into(),
            oidc: None,
            resolve: Vec::new(),
            connect_timeout: std::time::Duration::from_secs(1),
        }
    }

    fn imc(name: &str, uri: &str) -> Value {
        json!({
            "apiVersion": "messaging.knative.dev/v1", "kind": "InMemoryChannel",
            "metadata": { "name": name, "namespace": "default" },
            "spec": { "subscribers": [{ "subscriberUri": uri }] },
            "status": { "address": { "url": format!("http://{name}.example") } }
        })
    }

    fn plugin(served: &Served) -> Value {
        let filter = TypedExtensionConfig::decode(served.ecds[0].value.as_slice()).unwrap();
        let wasm = Wasm::decode(filter.typed_config.unwrap().value.as_slice()).unwrap();
        let config = wasm.config.unwrap().configuration.unwrap();
        serde_json::from_str(&StringValue::decode(config.value.as_slice()).unwrap().value).unwrap()
    }

    #[test]
    fn a_bad_channel_keeps_its_last_good_version_and_the_rest_moves() {
        let first = serve(
            &knative::map(
                &MapOptions::default(),
                vec![imc("a", "http://x.example/"), imc("b", "http://y.example/")],
            ),
            None,
            &options(),
        );
        assert_eq!(first.clusters.len(), 2);
        let second = serve(
            &knative::map(
                &MapOptions::default(),
                vec![imc("a", "ftp://x.example/"), imc("b", "http://z.example/")],
            ),
            Some(&first),
            &options(),
        );
        assert_eq!(second.channels["default/a"].serving, Serving::LastGood);
        assert_eq!(
            second.channels["default/a"].digest,
            first.channels["default/a"].digest
        );
        assert_eq!(second.channels["default/b"].serving, Serving::Current);
        let config = plugin(&second);
        assert_eq!(
            config["channels"][0]["subscribers"][0]["cluster"],
            "http|x.example|80"
        );
        assert_eq!(
            config["channels"][1]["subscribers"][0]["cluster"],
            "http|z.example|80"
        );
        let new = serve(
            &knative::map(&MapOptions::default(), vec![imc("c", "ftp://x.example/")]),
            None,
            &options(),
        );
        assert_eq!(new.channels["default/c"].serving, Serving::NotServed);
        assert_eq!(plugin(&new)["channels"], json!([]));
    }

    /// A channel of another namespace whose address names a served channel's host (the
    /// filter refuses a host claimed twice) is that channel's problem: the served one keeps
    /// its host and its changes are served, whichever name sorts first.
    #[test]
    fn a_host_claimed_again_is_the_claimants_problem() {
        let channel = |namespace: &str, name: &str, subscribers: &[&str]| {
            let entries: Vec<Value> = subscribers
                .iter()
                .map(|u| json!({ "subscriberUri": u }))
                .collect();
            json!({
                "apiVersion": "messaging.knative.dev/v1", "kind": "InMemoryChannel",
                "metadata": { "name": name, "namespace": namespace },
                "spec": { "subscribers": entries },
                "status": { "address": { "url": "http://orders.shop.example" } }
            })
        };
        let map = |objects| knative::map(&MapOptions::default(), objects);
        let first = serve(
            &map(vec![channel("shop", "orders", &["http://a.example/"])]),
            None,
            &options(),
        );
        let both = vec![
            channel(
                "shop",
                "orders",
                &["http://a.example/", "http://b.example/"],
            ),
            channel("another", "orders", &["http://evil.example/"]),
        ];
        let second = serve(&map(both), Some(&first), &options());
        let orders = &second.channels["shop/orders"];
        assert_eq!(orders.serving, Serving::Current);
        assert_eq!(orders.spec.subscribers.len(), 2);
        let claimant = &second.channels["another/orders"];
        assert_eq!(claimant.serving, Serving::NotServed);
        assert_eq!(claimant.problems[0].field, "status.address.url");
        assert!(
            claimant.problems[0].message.contains("shop/orders"),
            "{:?}",
            claimant.problems
        );
        let config = plugin(&second);
        assert_eq!(config["channels"].as_array().map(Vec::len), Some(1));
        let parsed = fanout::config::Config::from_json(config.to_string().as_bytes());
        assert!(parsed.is_ok(), "{parsed:?}");
        // Both served, and the one whose name sorts first takes the other's host: it is
        // charged, and keeps its last good version.
        let mut taker = channel("another", "orders", &["http://a.example/"]);
        taker["status"]["address"]["url"] = json!("http://another.example");
        let third = serve(
            &map(vec![
                channel("shop", "orders", &["http://a.example/"]),
                taker.clone(),
            ]),
            Some(&second),
            &options(),
        );
        assert_eq!(third.channels["another/orders"].serving, Serving::Current);
        taker["status"]["addresses"] = json!([{ "url": "http://orders.shop.example" }]);
        let fourth = serve(
            &map(vec![
                channel("shop", "orders", &["http://a.example/"]),
                taker,
            ]),
            Some(&third),
            &options(),
        );
        assert_eq!(fourth.channels["shop/orders"].serving, Serving::Current);
        let taker = &fourth.channels["another/orders"];
        assert_eq!(taker.serving, Serving::LastGood, "{:?}", taker.problems);
        assert_eq!(taker.spec.hosts, vec!["another.example"]);
    }

    #[test]
    fn resolve_points_a_cluster_elsewhere_and_keeps_its_tls_name() {
        let parse = |s: &str| s.parse::<Resolve>();
        assert_eq!(
            parse("x.example:443=127.0.0.1:8443").unwrap(),
            Resolve {
                spec: "x.example:443=127.0.0.1:8443".into(),
                host: "x.example".into(),
                port: Some(443),
                address: "127.0.0.1".into(),
                address_port: 8443,
            }
        );
        assert_eq!(parse("[::1]=[::1]:9").unwrap().host, "::1");
        assert_eq!(parse("X.example=h:9").unwrap().port, None);
        assert!(parse("x.example").is_err());
        assert!(parse("x.example=127.0.0.1").is_err());
        assert!(parse("x.example=127.0.0.1:0").is_err());
        assert!(parse("x.example:http=127.0.0.1:9").is_err());
        let options = RenderOptions {
            resolve: vec![
                parse("x.example=127.0.0.1:8443").unwrap(),
                parse("y.example:80=127.0.0.1:9").unwrap(),
                parse("nobody.example=127.0.0.1:9").unwrap(),
            ],
            ..options()
        };
        let served = serve(
            &knative::map(
                &MapOptions::default(),
                vec![
                    imc("a", "https://x.example/"),
                    imc("b", "http://y.example:81/"),
                ],
            ),
            None,
            &options,
        );
        let x = Cluster::decode(served.clusters["https|x.example|443"].value.as_slice()).unwrap();
        assert_eq!(
            x.cluster_discovery_type,
            Some(ClusterDiscoveryType::Type(DiscoveryType::Static as i32))
        );
        let endpoint = format!("{:?}", x.load_assignment.unwrap().endpoints);
        assert!(endpoint.contains("\"127.0.0.1\"") && endpoint.contains("PortValue(8443)"));
        let Some(transport_socket::ConfigType::TypedConfig(tls)) =
            x.transport_socket.unwrap().config_type
        else {
            panic!("no TLS")
        };
        let tls = UpstreamTlsContext::decode(tls.value.as_slice()).unwrap();
        assert_eq!(tls.sni, "x.example", "the SNI stays the URI's host");
        // y.example:80 does not resolve y.example:81.
        let y = Cluster::decode(served.clusters["http|y.example|81"].value.as_slice()).unwrap();
        assert!(format!("{:?}", y.load_assignment).contains("\"y.example\""));
        let unused: Vec<_> = served.warnings.iter().map(|w| w.field.as_str()).collect();
        assert_eq!(
            unused,
            vec!["y.example:80=127.0.0.1:9", "nobody.example=127.0.0.1:9"]
        );
    }

    #[test]
    fn versions_are_digests_of_the_content() {
        let objects = vec![imc("a", "https://x.example/")];
        let one = serve(
            &knative::map(&MapOptions::default(), objects.clone()),
            None,
            &options(),
        );
        let two = serve(
            &knative::map(&MapOptions::default(), objects),
            None,
            &options(),
        );
        assert_eq!(
            (one.ecds_version.clone(), one.cds_version.clone()),
            (two.ecds_version, two.cds_version)
        );
        let other = serve(
            &knative::map(&MapOptions::default(), vec![imc("a", "https://y.example/")]),
            None,
            &options(),
        );
        assert_ne!(one.ecds_version, other.ecds_version);
        assert_ne!(one.cds_version, other.cds_version);
        let cluster =
            Cluster::decode(one.clusters["https|x.example|443"].value.as_slice()).unwrap();
        let Some(transport_socket::ConfigType::TypedConfig(tls)) =
            cluster.transport_socket.unwrap().config_type
        else {
            panic!("no TLS")
        };
        assert_eq!(
            UpstreamTlsContext::decode(tls.value.as_slice())
                .unwrap()
                .sni,
            "x.example"
        );
    }
}
