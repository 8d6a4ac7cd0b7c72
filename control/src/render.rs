//! What the server serves, decided from a source's snapshot: which channels (as they are now,
//! their last good version, or not at all), and the two xDS resources they become: the fanout
//! filter's ECDS resource and the subscriber clusters (CDS). Versions are digests of the
//! content, so two servers, or a restarted one, give the same state the same version.

use crate::model::{ChannelSpec, ClusterSpec, Problem, Snapshot};
use crate::senders::{self, Oidc};
use envoy_types::pb::envoy::config::cluster::v3::{
    cluster::ClusterDiscoveryType, cluster::DiscoveryType, Cluster,
};
use envoy_types::pb::envoy::config::core::v3::{
    address, async_data_source, data_source, socket_address, transport_socket, Address,
    AsyncDataSource, DataSource, SocketAddress, TransportSocket, TypedExtensionConfig,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::extensions::filters::http::wasm::v3::Wasm;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    common_tls_context, subject_alt_name_matcher::SanType, CertificateValidationContext,
    CommonTlsContext, SubjectAltNameMatcher, UpstreamTlsContext,
};
use envoy_types::pb::envoy::extensions::wasm::v3::{plugin_config, PluginConfig, VmConfig};
use envoy_types::pb::envoy::r#type::matcher::v3::{string_matcher, StringMatcher};
use envoy_types::pb::google::protobuf::{Any, BoolValue, Duration, StringValue};
use prost::{Message, Name};
use serde::Serialize;
use serde_json::{json, Value};
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

/// `--resolve HOST[:PORT]=ADDRESS:PORT`: the cluster of HOST (on PORT only, when given)
/// calls ADDRESS:PORT instead of HOST's DNS name; calls keep the URI's authority, and https
/// its SNI and certificate check on HOST.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolve {
    pub spec: String,
    pub host: String,
    pub port: Option<u16>,
    pub address: String,
    pub address_port: u16,
}

impl std::str::FromStr for Resolve {
    type Err = String;

    fn from_str(spec: &str) -> Result<Resolve, String> {
        let expected = || format!("{spec:?}: expected HOST[:PORT]=ADDRESS:PORT");
        let (target, address) = spec.split_once('=').ok_or_else(expected)?;
        let (address, address_port) = address.rsplit_once(':').ok_or_else(expected)?;
        let (host, port) = match target.strip_prefix('[') {
            Some(rest) => {
                let (host, after) = rest.split_once(']').ok_or_else(expected)?;
                (host, after.strip_prefix(':'))
            }
            None => match target.split_once(':') {
                Some((host, port)) if !port.contains(':') => (host, Some(port)),
                _ => (target, None),
            },
        };
        let port_of = |p: &str| match p.parse::<u16>() {
            Ok(p) if p > 0 => Ok(p),
            _ => Err(format!("{spec:?}: {p:?} is not a port")),
        };
        let address = address.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || address.is_empty() {
            return Err(expected());
        }
        Ok(Resolve {
            spec: spec.to_owned(),
            host: host.to_ascii_lowercase(),
            port: port.map(port_of).transpose()?,
            address: address.to_owned(),
            address_port: port_of(address_port)?,
        })
    }
}

impl RenderOptions {
    fn resolve(&self, host: &str, port: u16) -> Option<&Resolve> {
        self.resolve
            .iter()
            .find(|r| r.host == host && r.port.is_none_or(|p| p == port))
    }
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
    let plugin = json!({ "channels": served.iter().map(|(n, c)| channel_json(n, &c.spec)).collect::<Vec<_>>() });
    let plugin = plugin.to_string();
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
    let clusters: BTreeMap<String, Any> = clusters
        .into_iter()
        .map(|(name, spec)| (name, any(&cluster(&spec, options))))
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

/// Each channel as it is now, its last good version in `previous`, or not at all.
fn decide(snapshot: &Snapshot, previous: Option<&Served>) -> BTreeMap<String, ServedChannel> {
    let mut channels = BTreeMap::new();
    for (name, mapping) in &snapshot.channels {
        let last = previous
            .and_then(|p| p.channels.get(name))
            .filter(|c| c.serving != Serving::NotServed);
        let (serving, spec) = match (mapping.problems.is_empty(), last) {
            (true, _) => (Serving::Current, mapping.spec.clone()),
            (false, Some(last)) => (Serving::LastGood, last.spec.clone()),
            (false, None) => (Serving::NotServed, ChannelSpec::default()),
        };
        let described = json!([channel_json(name, &spec), spec.senders]);
        let digest = digest(&described.to_string());
        let problems = mapping.problems.clone();
        channels.insert(
            name.clone(),
            ServedChannel {
                serving,
                spec,
                digest,
                problems,
                warnings: mapping.warnings.clone(),
            },
        );
    }
    channels
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

fn channel_json(name: &str, spec: &ChannelSpec) -> Value {
    let subscribers: Vec<&Value> = spec.subscribers.iter().map(|s| &s.config).collect();
    json!({ "name": name, "hosts": spec.hosts, "subscribers": subscribers })
}

pub fn digest(text: &str) -> String {
    hex16(&Sha256::digest(text.as_bytes()))
}

fn hex16(bytes: &[u8]) -> String {
    bytes.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

pub fn any<M: Message + Name>(message: &M) -> Any {
    Any {
        type_url: M::type_url(),
        value: message.encode_to_vec(),
    }
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

/// One cluster with one endpoint: STATIC for an IP address, STRICT_DNS for a host name; TLS
/// (SNI and the certificate checked for the host) for https.
fn cluster(spec: &ClusterSpec, options: &RenderOptions) -> Cluster {
    let is_ip = spec.host.parse::<std::net::IpAddr>().is_ok();
    let (host, port) = options
        .resolve(&spec.host, spec.port)
        .map_or((spec.host.as_str(), spec.port), |r| {
            (r.address.as_str(), r.address_port)
        });
    let kind = if host.parse::<std::net::IpAddr>().is_ok() {
        DiscoveryType::Static
    } else {
        DiscoveryType::StrictDns
    };
    let address = Address {
        address: Some(address::Address::SocketAddress(SocketAddress {
            address: host.to_owned(),
            port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(port))),
            ..SocketAddress::default()
        })),
    };
    let endpoint = LbEndpoint {
        host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
            address: Some(address),
            ..Endpoint::default()
        })),
        ..LbEndpoint::default()
    };
    Cluster {
        name: spec.name.clone(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(kind as i32)),
        connect_timeout: Some(Duration {
            seconds: i64::try_from(options.connect_timeout.as_secs()).unwrap_or(i64::MAX),
            nanos: i32::try_from(options.connect_timeout.subsec_nanos()).unwrap_or(0),
        }),
        load_assignment: Some(ClusterLoadAssignment {
            cluster_name: spec.name.clone(),
            endpoints: vec![LocalityLbEndpoints {
                lb_endpoints: vec![endpoint],
                ..LocalityLbEndpoints::default()
            }],
            ..ClusterLoadAssignment::default()
        }),
        transport_socket: spec.tls.then(|| tls_socket(spec, is_ip, options)),
        ..Cluster::default()
    }
}

fn tls_socket(spec: &ClusterSpec, is_ip: bool, options: &RenderOptions) -> TransportSocket {
    let trusted = if spec.ca_certs.is_empty() {
        data_source::Specifier::Filename(options.trusted_ca.clone())
    } else {
        data_source::Specifier::InlineString(format!("{}\n", spec.ca_certs.join("\n")))
    };
    let host = spec.host.trim_end_matches('.').to_owned();
    let san = SubjectAltNameMatcher {
        san_type: if is_ip {
            SanType::IpAddress
        } else {
            SanType::Dns
        } as i32,
        matcher: Some(StringMatcher {
            match_pattern: Some(string_matcher::MatchPattern::Exact(host.clone())),
            ..StringMatcher::default()
        }),
        ..SubjectAltNameMatcher::default()
    };
    let validation = CertificateValidationContext {
        trusted_ca: Some(DataSource {
            specifier: Some(trusted),
            ..DataSource::default()
        }),
        match_typed_subject_alt_names: vec![san],
        ..CertificateValidationContext::default()
    };
    let context = UpstreamTlsContext {
        common_tls_context: Some(CommonTlsContext {
            validation_context_type: Some(
                common_tls_context::ValidationContextType::ValidationContext(validation),
            ),
            ..CommonTlsContext::default()
        }),
        sni: if is_ip { String::new() } else { host },
        ..UpstreamTlsContext::default()
    };
    TransportSocket {
        name: "envoy.transport_sockets.tls".to_owned(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(any(&context))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knative;
    use crate::model::MapOptions;

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
