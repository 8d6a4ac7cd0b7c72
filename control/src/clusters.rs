//! A subscriber cluster as CDS serves it: one endpoint (its host, or where `--resolve` says
//! it is), and for https the TLS that checks the host's certificate.

use crate::model::ClusterSpec;
use crate::resource::any;
use envoy_types::pb::envoy::config::cluster::v3::{
    cluster::ClusterDiscoveryType, cluster::DiscoveryType, Cluster,
};
use envoy_types::pb::envoy::config::core::v3::{
    address, data_source, socket_address, transport_socket, Address, DataSource, SocketAddress,
    TransportSocket,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    common_tls_context, subject_alt_name_matcher::SanType, CertificateValidationContext,
    CommonTlsContext, SubjectAltNameMatcher, UpstreamTlsContext,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{string_matcher, StringMatcher};
use envoy_types::pb::google::protobuf::Duration;

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

/// Where `--resolve` says HOST on PORT is, if it does.
fn resolved<'a>(resolve: &'a [Resolve], host: &str, port: u16) -> Option<&'a Resolve> {
    resolve
        .iter()
        .find(|r| r.host == host && r.port.is_none_or(|p| p == port))
}

/// One cluster with one endpoint: STATIC for an IP address, STRICT_DNS for a host name; TLS
/// (SNI and the certificate checked for the host) for https.
/// `trusted_ca`: the CA bundle an https cluster trusts when the source names no CA
/// certificates for it; `connect_timeout`: `--connect-timeout`.
pub fn cluster(
    spec: &ClusterSpec,
    resolve: &[Resolve],
    trusted_ca: &str,
    connect_timeout: std::time::Duration,
) -> Cluster {
    let is_ip = spec.host.parse::<std::net::IpAddr>().is_ok();
    let (host, port) = resolved(resolve, &spec.host, spec.port)
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
            seconds: i64::try_from(connect_timeout.as_secs()).unwrap_or(i64::MAX),
            nanos: i32::try_from(connect_timeout.subsec_nanos()).unwrap_or(0),
        }),
        load_assignment: Some(ClusterLoadAssignment {
            cluster_name: spec.name.clone(),
            endpoints: vec![LocalityLbEndpoints {
                lb_endpoints: vec![endpoint],
                ..LocalityLbEndpoints::default()
            }],
            ..ClusterLoadAssignment::default()
        }),
        transport_socket: spec.tls.then(|| tls_socket(spec, is_ip, trusted_ca)),
        ..Cluster::default()
    }
}

fn tls_socket(spec: &ClusterSpec, is_ip: bool, trusted_ca: &str) -> TransportSocket {
    let trusted = if spec.ca_certs.is_empty() {
        data_source::Specifier::Filename(trusted_ca.to_owned())
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
