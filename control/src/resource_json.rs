//! The xDS resources the server serves, written as the JSON Envoy reads from a file (proto3's
//! JSON mapping, with the protos' own field names): what `fanout-control render` writes. It
//! decodes the very `Any`s the server sends, so a file and the xDS server never differ.
//!
//! It knows the messages the server builds (clusters, TLS, the wasm filter, the native build's
//! dynamic-module filter, jwt_authn, rbac)
//! and nothing else: a field it does not know is an error naming the message, never a field
//! dropped from the file. Each message's function moves out the fields it writes; what is left
//! must be the message's default.

use envoy_types::pb::envoy::config::cluster::v3::{cluster::ClusterDiscoveryType, Cluster};
use envoy_types::pb::envoy::config::core::v3::{
    address, async_data_source, data_source, socket_address, transport_socket, Address,
    AsyncDataSource, DataSource, TransportSocket, TypedExtensionConfig,
};
use envoy_types::pb::envoy::config::endpoint::v3::{lb_endpoint, ClusterLoadAssignment};
use envoy_types::pb::envoy::config::rbac::v3::{
    permission, principal, rbac, Permission, Policy, Principal, Rbac as RbacRules, SourcedMetadata,
};
use envoy_types::pb::envoy::config::route::v3::{header_matcher, route_match, HeaderMatcher};
use envoy_types::pb::envoy::extensions::dynamic_modules::v3::DynamicModuleConfig;
use envoy_types::pb::envoy::extensions::filters::http::dynamic_modules::v3::DynamicModuleFilter;
use envoy_types::pb::envoy::extensions::filters::http::jwt_authn::v3::{
    jwt_provider, jwt_requirement, requirement_rule, JwtAuthentication, JwtProvider,
    RequirementRule,
};
use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::Rbac;
use envoy_types::pb::envoy::extensions::filters::http::wasm::v3::Wasm;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    common_tls_context, subject_alt_name_matcher::SanType, CertificateValidationContext,
    SubjectAltNameMatcher, UpstreamTlsContext,
};
use envoy_types::pb::envoy::extensions::wasm::v3::{plugin_config, PluginConfig};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    metadata_matcher, string_matcher, value_matcher, MetadataMatcher, StringMatcher,
};
use envoy_types::pb::google::protobuf::{Any, Duration, StringValue};
use prost::{Message, Name};
use serde_json::{json, Map, Value};
use std::fmt::Debug;
use std::mem::take;

type Json = Result<Value, String>;

/// One resource (an `Any` as served: a Cluster or a TypedExtensionConfig) as JSON, its
/// `@type` first.
pub fn any(resource: &Any) -> Json {
    let url = resource.type_url.as_str();
    let bytes = resource.value.as_slice();
    let mut out = Map::new();
    out.insert("@type".to_owned(), json!(url));
    let fields = if url == Cluster::type_url() {
        cluster(decode(bytes)?)
    } else if url == TypedExtensionConfig::type_url() {
        extension(decode(bytes)?)
    } else if url == Wasm::type_url() {
        wasm(decode(bytes)?)
    } else if url == DynamicModuleFilter::type_url() {
        dynamic_module_filter(decode(bytes)?)
    } else if url == UpstreamTlsContext::type_url() {
        upstream_tls(decode(bytes)?)
    } else if url == StringValue::type_url() {
        let value: StringValue = decode(bytes)?;
        Ok(json!({ "value": value.value }))
    } else if url == JwtAuthentication::type_url() {
        jwt_authentication(decode(bytes)?)
    } else if url == Rbac::type_url() {
        rbac_filter(decode(bytes)?)
    } else {
        Err(format!("render cannot write a resource of type {url}"))
    }?;
    if let Value::Object(fields) = fields {
        out.extend(fields);
    }
    Ok(Value::Object(out))
}

fn decode<M: Message + Default>(bytes: &[u8]) -> Result<M, String> {
    M::decode(bytes).map_err(|e| format!("a served resource does not decode: {e}"))
}

/// Ok when everything of `rest` was written (it is the default), else an error naming it.
fn written<M: Default + PartialEq + Debug>(what: &str, rest: &M) -> Result<(), String> {
    if *rest == M::default() {
        Ok(())
    } else {
        Err(format!(
            "render cannot write these fields of {what}: {rest:?}"
        ))
    }
}

/// The fields of a message: empty strings, lists and absent messages are left out.
#[derive(Default)]
struct Fields(Map<String, Value>);

impl Fields {
    fn text(mut self, name: &str, value: String) -> Fields {
        if !value.is_empty() {
            self.0.insert(name.to_owned(), json!(value));
        }
        self
    }

    fn value(mut self, name: &str, value: Option<Value>) -> Fields {
        if let Some(value) = value {
            self.0.insert(name.to_owned(), value);
        }
        self
    }

    fn list(mut self, name: &str, values: Vec<Value>) -> Fields {
        if !values.is_empty() {
            self.0.insert(name.to_owned(), Value::Array(values));
        }
        self
    }

    fn done<M: Default + PartialEq + Debug>(self, what: &str, rest: &M) -> Json {
        written(what, rest)?;
        Ok(Value::Object(self.0))
    }
}

fn each<T>(items: Vec<T>, f: impl Fn(T) -> Json) -> Result<Vec<Value>, String> {
    items.into_iter().map(f).collect()
}

fn some<T>(item: Option<T>, f: impl Fn(T) -> Json) -> Result<Option<Value>, String> {
    item.map(f).transpose()
}

/// proto3 JSON's Duration: seconds with up to nine decimals, then `s`.
fn duration(d: Duration) -> Json {
    let text = if d.nanos == 0 {
        format!("{}s", d.seconds)
    } else {
        let decimals = format!("{:09}", d.nanos);
        format!("{}.{}s", d.seconds, decimals.trim_end_matches('0'))
    };
    Ok(json!(text))
}

fn cluster(mut c: Cluster) -> Json {
    let kind = match take(&mut c.cluster_discovery_type) {
        Some(ClusterDiscoveryType::Type(kind)) => Some(enum_name(kind, |k| {
            envoy_types::pb::envoy::config::cluster::v3::cluster::DiscoveryType::try_from(k)
                .ok()
                .map(|k| k.as_str_name())
        })?),
        Some(other) => return Err(format!("render cannot write the cluster type {other:?}")),
        None => None,
    };
    Fields::default()
        .text("name", take(&mut c.name))
        .value("type", kind)
        .value(
            "connect_timeout",
            some(take(&mut c.connect_timeout), duration)?,
        )
        .value(
            "load_assignment",
            some(take(&mut c.load_assignment), load_assignment)?,
        )
        .value(
            "transport_socket",
            some(take(&mut c.transport_socket), transport)?,
        )
        .done("Cluster", &c)
}

fn enum_name(value: i32, name: impl Fn(i32) -> Option<&'static str>) -> Json {
    name(value)
        .map(|n| json!(n))
        .ok_or_else(|| format!("render cannot write the enum value {value}"))
}

fn load_assignment(mut a: ClusterLoadAssignment) -> Json {
    let mut endpoints = Vec::new();
    for mut locality in take(&mut a.endpoints) {
        let mut lb_endpoints = Vec::new();
        for mut lb in take(&mut locality.lb_endpoints) {
            let endpoint = match take(&mut lb.host_identifier) {
                Some(lb_endpoint::HostIdentifier::Endpoint(mut endpoint)) => {
                    let address = some(take(&mut endpoint.address), socket)?;
                    let endpoint = Fields::default()
                        .value("address", address)
                        .done("Endpoint", &endpoint)?;
                    Some(endpoint)
                }
                Some(other) => return Err(format!("render cannot write the endpoint {other:?}")),
                None => None,
            };
            let lb = Fields::default()
                .value("endpoint", endpoint)
                .done("LbEndpoint", &lb)?;
            lb_endpoints.push(lb);
        }
        let locality = Fields::default()
            .list("lb_endpoints", lb_endpoints)
            .done("LocalityLbEndpoints", &locality)?;
        endpoints.push(locality);
    }
    Fields::default()
        .text("cluster_name", take(&mut a.cluster_name))
        .list("endpoints", endpoints)
        .done("ClusterLoadAssignment", &a)
}

fn socket(mut a: Address) -> Json {
    let Some(address::Address::SocketAddress(mut s)) = take(&mut a.address) else {
        return Err(format!("render cannot write the address {a:?}"));
    };
    let port = match take(&mut s.port_specifier) {
        Some(socket_address::PortSpecifier::PortValue(port)) => Some(json!(port)),
        Some(other) => return Err(format!("render cannot write the port {other:?}")),
        None => None,
    };
    let s_json = Fields::default()
        .text("address", take(&mut s.address))
        .value("port_value", port)
        .done("SocketAddress", &s)?;
    written("Address", &a)?;
    Ok(json!({ "socket_address": s_json }))
}

fn transport(mut t: TransportSocket) -> Json {
    let config = match take(&mut t.config_type) {
        Some(transport_socket::ConfigType::TypedConfig(config)) => Some(any(&config)?),
        None => None,
    };
    Fields::default()
        .text("name", take(&mut t.name))
        .value("typed_config", config)
        .done("TransportSocket", &t)
}

fn upstream_tls(mut u: UpstreamTlsContext) -> Json {
    let common = match take(&mut u.common_tls_context) {
        Some(mut common) => {
            let validation = match take(&mut common.validation_context_type) {
                Some(common_tls_context::ValidationContextType::ValidationContext(v)) => {
                    Some(validation_context(v)?)
                }
                Some(other) => return Err(format!("render cannot write {other:?}")),
                None => None,
            };
            let fields = Fields::default().value("validation_context", validation);
            Some(fields.done("CommonTlsContext", &common)?)
        }
        None => None,
    };
    Fields::default()
        .value("common_tls_context", common)
        .text("sni", take(&mut u.sni))
        .done("UpstreamTlsContext", &u)
}

fn validation_context(mut v: CertificateValidationContext) -> Json {
    let sans = each(take(&mut v.match_typed_subject_alt_names), san)?;
    Fields::default()
        .value("trusted_ca", some(take(&mut v.trusted_ca), data_source)?)
        .list("match_typed_subject_alt_names", sans)
        .done("CertificateValidationContext", &v)
}

fn san(mut s: SubjectAltNameMatcher) -> Json {
    let kind = enum_name(take(&mut s.san_type), |k| {
        SanType::try_from(k).ok().map(|k| k.as_str_name())
    })?;
    Fields::default()
        .value("san_type", Some(kind))
        .value("matcher", some(take(&mut s.matcher), string_matcher)?)
        .done("SubjectAltNameMatcher", &s)
}

fn data_source(mut d: DataSource) -> Json {
    let fields = match take(&mut d.specifier) {
        Some(data_source::Specifier::Filename(f)) => Fields::default().text("filename", f),
        Some(data_source::Specifier::InlineString(s)) => {
            Fields::default().value("inline_string", Some(json!(s)))
        }
        Some(other) => return Err(format!("render cannot write the data source {other:?}")),
        None => Fields::default(),
    };
    fields.done("DataSource", &d)
}

fn string_matcher(mut m: StringMatcher) -> Json {
    let (name, value) = match take(&mut m.match_pattern) {
        Some(string_matcher::MatchPattern::Exact(s)) => ("exact", json!(s)),
        Some(string_matcher::MatchPattern::Prefix(s)) => ("prefix", json!(s)),
        Some(string_matcher::MatchPattern::SafeRegex(mut r)) => {
            let regex = Fields::default()
                .text("regex", take(&mut r.regex))
                .done("RegexMatcher", &r)?;
            ("safe_regex", regex)
        }
        other => return Err(format!("render cannot write the string match {other:?}")),
    };
    let ignore_case = take(&mut m.ignore_case).then_some(Value::Bool(true));
    Fields::default()
        .value(name, Some(value))
        .value("ignore_case", ignore_case)
        .done("StringMatcher", &m)
}

fn extension(mut e: TypedExtensionConfig) -> Json {
    Fields::default()
        .text("name", take(&mut e.name))
        .value(
            "typed_config",
            some(take(&mut e.typed_config), |c| any(&c))?,
        )
        .done("TypedExtensionConfig", &e)
}

fn wasm(mut w: Wasm) -> Json {
    Fields::default()
        .value("config", some(take(&mut w.config), plugin)?)
        .done("Wasm", &w)
}

fn plugin(mut p: PluginConfig) -> Json {
    let vm = match take(&mut p.vm) {
        Some(plugin_config::Vm::VmConfig(mut vm)) => {
            let code = some(take(&mut vm.code), async_source)?;
            let fields = Fields::default()
                .text("vm_id", take(&mut vm.vm_id))
                .text("runtime", take(&mut vm.runtime))
                .value("code", code);
            Some(fields.done("VmConfig", &vm)?)
        }
        None => None,
    };
    let stop = take(&mut p.allow_on_headers_stop_iteration).map(|b| json!(b.value));
    Fields::default()
        .text("name", take(&mut p.name))
        .text("root_id", take(&mut p.root_id))
        .value("allow_on_headers_stop_iteration", stop)
        .value(
            "configuration",
            some(take(&mut p.configuration), |c| any(&c))?,
        )
        .value("vm_config", vm)
        .done("PluginConfig", &p)
}

fn dynamic_module_filter(mut f: DynamicModuleFilter) -> Json {
    let module = some(take(&mut f.dynamic_module_config), dynamic_module)?;
    Fields::default()
        .value("dynamic_module_config", module)
        .text("filter_name", take(&mut f.filter_name))
        .value(
            "filter_config",
            some(take(&mut f.filter_config), |c| any(&c))?,
        )
        .done("DynamicModuleFilter", &f)
}

fn dynamic_module(mut m: DynamicModuleConfig) -> Json {
    let do_not_close = take(&mut m.do_not_close).then_some(Value::Bool(true));
    Fields::default()
        .text("name", take(&mut m.name))
        .value("module", some(take(&mut m.module), async_source)?)
        .value("do_not_close", do_not_close)
        .done("DynamicModuleConfig", &m)
}

fn async_source(mut a: AsyncDataSource) -> Json {
    let Some(async_data_source::Specifier::Local(local)) = take(&mut a.specifier) else {
        return Err(format!("render cannot write the code source {a:?}"));
    };
    let local = data_source(local)?;
    written("AsyncDataSource", &a)?;
    Ok(json!({ "local": local }))
}

fn jwt_authentication(mut j: JwtAuthentication) -> Json {
    let mut providers = Map::new();
    // A protobuf map has no order; the file lists the providers by name.
    let mut named: Vec<(String, JwtProvider)> = take(&mut j.providers).into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, provider) in named {
        providers.insert(name, jwt_provider(provider)?);
    }
    let providers = (!providers.is_empty()).then_some(Value::Object(providers));
    Fields::default()
        .value("providers", providers)
        .list("rules", each(take(&mut j.rules), requirement_rule)?)
        .done("JwtAuthentication", &j)
}

fn jwt_provider(mut p: JwtProvider) -> Json {
    let jwks = match take(&mut p.jwks_source_specifier) {
        Some(jwt_provider::JwksSourceSpecifier::LocalJwks(local)) => Some(data_source(local)?),
        Some(other) => return Err(format!("render cannot write the JWKS source {other:?}")),
        None => None,
    };
    let audiences = take(&mut p.audiences).into_iter().map(|a| json!(a));
    Fields::default()
        .text("issuer", take(&mut p.issuer))
        .list("audiences", audiences.collect())
        .value("local_jwks", jwks)
        .text("payload_in_metadata", take(&mut p.payload_in_metadata))
        .done("JwtProvider", &p)
}

fn requirement_rule(mut r: RequirementRule) -> Json {
    let requires = match take(&mut r.requirement_type) {
        Some(requirement_rule::RequirementType::Requires(mut requirement)) => {
            let Some(jwt_requirement::RequiresType::ProviderName(name)) =
                take(&mut requirement.requires_type)
            else {
                return Err(format!(
                    "render cannot write the requirement {requirement:?}"
                ));
            };
            Some(json!({ "provider_name": name }))
        }
        Some(other) => return Err(format!("render cannot write the requirement {other:?}")),
        None => None,
    };
    let route = match take(&mut r.r#match) {
        Some(mut m) => {
            let prefix = match take(&mut m.path_specifier) {
                Some(route_match::PathSpecifier::Prefix(p)) => Some(json!(p)),
                Some(other) => return Err(format!("render cannot write the path {other:?}")),
                None => None,
            };
            let headers = each(take(&mut m.headers), header_matcher)?;
            let fields = Fields::default()
                .value("prefix", prefix)
                .list("headers", headers);
            Some(fields.done("RouteMatch", &m)?)
        }
        None => None,
    };
    Fields::default()
        .value("match", route)
        .value("requires", requires)
        .done("RequirementRule", &r)
}

fn header_matcher(mut h: HeaderMatcher) -> Json {
    let string_match = match take(&mut h.header_match_specifier) {
        Some(header_matcher::HeaderMatchSpecifier::StringMatch(m)) => Some(string_matcher(m)?),
        Some(other) => return Err(format!("render cannot write the header match {other:?}")),
        None => None,
    };
    Fields::default()
        .text("name", take(&mut h.name))
        .value("string_match", string_match)
        .done("HeaderMatcher", &h)
}

fn rbac_filter(mut r: Rbac) -> Json {
    Fields::default()
        .value("rules", some(take(&mut r.rules), rbac_rules)?)
        .done("RBAC", &r)
}

fn rbac_rules(mut r: RbacRules) -> Json {
    let action = enum_name(take(&mut r.action), |a| {
        rbac::Action::try_from(a).ok().map(|a| a.as_str_name())
    })?;
    let mut policies = Map::new();
    let mut named: Vec<(String, Policy)> = take(&mut r.policies).into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, policy) in named {
        policies.insert(name, rbac_policy(policy)?);
    }
    Fields::default()
        .value("action", Some(action))
        .value("policies", Some(Value::Object(policies)))
        .done("RBAC rules", &r)
}

fn rbac_policy(mut p: Policy) -> Json {
    Fields::default()
        .list("permissions", each(take(&mut p.permissions), permission)?)
        .list("principals", each(take(&mut p.principals), principal)?)
        .done("Policy", &p)
}

fn permission(mut p: Permission) -> Json {
    let Some(permission::Rule::Header(header)) = take(&mut p.rule) else {
        return Err(format!("render cannot write the permission {p:?}"));
    };
    Ok(json!({ "header": header_matcher(header)? }))
}

fn principal(mut p: Principal) -> Json {
    match take(&mut p.identifier) {
        Some(principal::Identifier::Any(any)) => Ok(json!({ "any": any })),
        Some(principal::Identifier::SourcedMetadata(sourced)) => {
            Ok(json!({ "sourced_metadata": sourced_metadata(sourced)? }))
        }
        other => Err(format!("render cannot write the principal {other:?}")),
    }
}

fn sourced_metadata(mut s: SourcedMetadata) -> Json {
    let source = take(&mut s.metadata_source);
    let source = (source != 0)
        .then(|| {
            enum_name(source, |v| {
                envoy_types::pb::envoy::config::rbac::v3::MetadataSource::try_from(v)
                    .ok()
                    .map(|v| v.as_str_name())
            })
        })
        .transpose()?;
    Fields::default()
        .value(
            "metadata_matcher",
            some(take(&mut s.metadata_matcher), metadata_matcher)?,
        )
        .value("metadata_source", source)
        .done("SourcedMetadata", &s)
}

fn metadata_matcher(mut m: MetadataMatcher) -> Json {
    let mut path = Vec::new();
    for mut segment in take(&mut m.path) {
        let Some(metadata_matcher::path_segment::Segment::Key(key)) = take(&mut segment.segment)
        else {
            return Err(format!("render cannot write the path segment {segment:?}"));
        };
        path.push(json!({ "key": key }));
    }
    let value = match take(&mut m.value) {
        Some(mut v) => {
            let Some(value_matcher::MatchPattern::StringMatch(sm)) = take(&mut v.match_pattern)
            else {
                return Err(format!("render cannot write the value match {v:?}"));
            };
            Some(json!({ "string_match": string_matcher(sm)? }))
        }
        None => None,
    };
    Fields::default()
        .text("filter", take(&mut m.filter))
        .list("path", path)
        .value("value", value)
        .done("MetadataMatcher", &m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_seconds_with_decimals() {
        let d = |seconds, nanos| duration(Duration { seconds, nanos }).unwrap();
        assert_eq!(d(1, 0), json!("1s"));
        assert_eq!(d(0, 250_000_000), json!("0.25s"));
        assert_eq!(d(2, 1), json!("2.000000001s"));
    }

    #[test]
    fn a_field_render_does_not_know_is_an_error_not_a_loss() {
        let cluster = Cluster {
            name: "x".into(),
            alt_stat_name: "not written by render".into(),
            ..Cluster::default()
        };
        let err = any(&crate::resource::any(&cluster)).unwrap_err();
        assert!(
            err.contains("Cluster") && err.contains("alt_stat_name"),
            "{err}"
        );
        let known = Cluster {
            name: "x".into(),
            ..Cluster::default()
        };
        assert_eq!(
            any(&crate::resource::any(&known)).unwrap(),
            json!({ "@type": Cluster::type_url(), "name": "x" })
        );
    }
}
