//! Who may send, as Envoy enforces it: the served channels' [`Senders`] become Envoy's
//! `jwt_authn` (a provider per channel: the issuer, the channel's audience, the JWKS; a rule
//! per channel by its hosts) and `rbac` (per channel, the subjects of the token's `sub` that
//! may send), served over ECDS as `senders-jwt` and `senders-rbac`; `envoy/xds/envoy.yaml`
//! runs both before fanout (`fanout-control render --oidc-issuer` writes them to files).
//! Without an issuer both are served empty: they let every request through.

use crate::model::{Allowed, ChannelSpec, Senders};
use crate::resource::any;
use envoy_types::pb::envoy::config::core::v3::{data_source, DataSource, TypedExtensionConfig};
use envoy_types::pb::envoy::config::rbac::v3::{
    permission, principal, rbac, MetadataSource, Permission, Policy, Principal, Rbac as RbacRules,
    SourcedMetadata,
};
use envoy_types::pb::envoy::config::route::v3::{
    header_matcher, route_match, HeaderMatcher, RouteMatch,
};
use envoy_types::pb::envoy::extensions::filters::http::jwt_authn::v3::{
    jwt_provider, jwt_requirement, requirement_rule, JwtAuthentication, JwtProvider,
    JwtRequirement, RequirementRule,
};
use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::Rbac;
use envoy_types::pb::envoy::r#type::matcher::v3::{
    metadata_matcher, string_matcher, value_matcher, MetadataMatcher, RegexMatcher, StringMatcher,
    ValueMatcher,
};
use envoy_types::pb::google::protobuf::Any;
use serde_json::{json, Value};

/// The ECDS resource names the bootstrap's `config_discovery` asks for.
pub const JWT_NAME: &str = "senders-jwt";
pub const RBAC_NAME: &str = "senders-rbac";
/// Where jwt_authn puts a verified token's payload; rbac reads `sub` from there.
const PAYLOAD: &str = "jwt_payload";

/// The issuer whose tokens are checked (`--oidc-issuer`) and its keys (`--jwks`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Oidc {
    pub issuer: String,
    /// The JWKS file as the Envoys see it.
    pub jwks: String,
}

/// Both filters for the served channels, and a description of what they enforce (for the
/// version: protobuf maps do not encode in a stable order).
pub fn filters(channels: &[(&String, &ChannelSpec)], oidc: Option<&Oidc>) -> (Vec<Any>, Value) {
    let Some(oidc) = oidc else {
        let jwt = extension(JWT_NAME, any(&JwtAuthentication::default()));
        let rbac = extension(RBAC_NAME, any(&Rbac::default()));
        return (vec![jwt, rbac], Value::Null);
    };
    let mut jwt = JwtAuthentication::default();
    let mut rules = RbacRules {
        action: rbac::Action::Allow as i32,
        ..RbacRules::default()
    };
    let mut described = Vec::new();
    for (index, (name, spec)) in channels.iter().enumerate() {
        if spec.hosts.is_empty() {
            continue;
        }
        let authority = authority(&spec.hosts);
        described.push(json!({ "channel": name, "hosts": spec.hosts, "senders": spec.senders }));
        // A channel without senders (none mapped): no rbac policy, so nobody may send.
        let Some(senders) = &spec.senders else {
            continue;
        };
        let provider = format!("channel-{index}");
        jwt.providers
            .insert(provider.clone(), jwt_provider(oidc, senders));
        jwt.rules.push(rule(authority.clone(), provider));
        let principals = principals(&senders.allowed);
        if !principals.is_empty() {
            let permission = Permission {
                rule: Some(permission::Rule::Header(authority)),
            };
            let policy = Policy {
                permissions: vec![permission],
                principals,
                ..Policy::default()
            };
            rules.policies.insert((*name).clone(), policy);
        }
    }
    let rbac = Rbac {
        rules: Some(rules),
        ..Rbac::default()
    };
    let description = json!({ "issuer": oidc.issuer, "jwks": oidc.jwks, "channels": described });
    (
        vec![
            extension(JWT_NAME, any(&jwt)),
            extension(RBAC_NAME, any(&rbac)),
        ],
        description,
    )
}

/// Requests for the hosts `authority` matches need a token `provider` verifies.
fn rule(authority: HeaderMatcher, provider: String) -> RequirementRule {
    RequirementRule {
        r#match: Some(RouteMatch {
            path_specifier: Some(route_match::PathSpecifier::Prefix("/".to_owned())),
            headers: vec![authority],
            ..RouteMatch::default()
        }),
        requirement_type: Some(requirement_rule::RequirementType::Requires(
            JwtRequirement {
                requires_type: Some(jwt_requirement::RequiresType::ProviderName(provider)),
            },
        )),
    }
}

fn extension(name: &str, config: Any) -> Any {
    any(&TypedExtensionConfig {
        name: name.to_owned(),
        typed_config: Some(config),
    })
}

fn jwt_provider(oidc: &Oidc, senders: &Senders) -> JwtProvider {
    JwtProvider {
        issuer: oidc.issuer.clone(),
        audiences: vec![senders.audience.clone()],
        payload_in_metadata: PAYLOAD.to_owned(),
        jwks_source_specifier: Some(jwt_provider::JwksSourceSpecifier::LocalJwks(DataSource {
            specifier: Some(data_source::Specifier::Filename(oidc.jwks.clone())),
            ..DataSource::default()
        })),
        ..JwtProvider::default()
    }
}

/// The `:authority` as fanout reads it: one of the hosts, any case, any port.
fn authority(hosts: &[String]) -> HeaderMatcher {
    let names: Vec<String> = hosts.iter().map(|h| regex_escape(h)).collect();
    let regex = format!("(?i)^({})(:[0-9]+)?$", names.join("|"));
    HeaderMatcher {
        name: ":authority".to_owned(),
        header_match_specifier: Some(header_matcher::HeaderMatchSpecifier::StringMatch(
            StringMatcher {
                match_pattern: Some(string_matcher::MatchPattern::SafeRegex(RegexMatcher {
                    regex,
                    ..RegexMatcher::default()
                })),
                ..StringMatcher::default()
            },
        )),
        ..HeaderMatcher::default()
    }
}

fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if !c.is_ascii_alphanumeric() && c != '_' && c != '-' {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The token subjects that may send: exact or, ending in `*`, a prefix; without case.
fn principals(allowed: &Allowed) -> Vec<Principal> {
    let subjects = match allowed {
        Allowed::Any => {
            return vec![Principal {
                identifier: Some(principal::Identifier::Any(true)),
            }]
        }
        Allowed::Subjects(subjects) => subjects,
    };
    subjects
        .iter()
        .map(|subject| {
            let pattern = match subject.strip_suffix('*') {
                Some(prefix) => string_matcher::MatchPattern::Prefix(prefix.to_owned()),
                None => string_matcher::MatchPattern::Exact(subject.clone()),
            };
            let matcher = MetadataMatcher {
                filter: "envoy.filters.http.jwt_authn".to_owned(),
                path: [PAYLOAD, "sub"]
                    .iter()
                    .map(|key| metadata_matcher::PathSegment {
                        segment: Some(metadata_matcher::path_segment::Segment::Key(
                            (*key).to_owned(),
                        )),
                    })
                    .collect(),
                value: Some(ValueMatcher {
                    match_pattern: Some(value_matcher::MatchPattern::StringMatch(StringMatcher {
                        match_pattern: Some(pattern),
                        ignore_case: true,
                    })),
                }),
                ..MetadataMatcher::default()
            };
            let sourced = SourcedMetadata {
                metadata_matcher: Some(matcher),
                metadata_source: MetadataSource::Dynamic as i32,
            };
            Principal {
                identifier: Some(principal::Identifier::SourcedMetadata(sourced)),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn spec(hosts: &[&str], senders: Option<Senders>) -> ChannelSpec {
        ChannelSpec {
            hosts: hosts.iter().map(|h| (*h).to_owned()).collect(),
            senders,
            ..ChannelSpec::default()
        }
    }

    fn typed<M: Message + Default>(resource: &Any) -> M {
        let extension = TypedExtensionConfig::decode(resource.value.as_slice()).unwrap();
        M::decode(extension.typed_config.unwrap().value.as_slice()).unwrap()
    }

    #[test]
    fn without_an_issuer_both_filters_pass_everything() {
        let name = "default/a".to_owned();
        let a = spec(&["a.example"], None);
        let (resources, description) = filters(&[(&name, &a)], None);
        assert_eq!(description, Value::Null);
        let jwt: JwtAuthentication = typed(&resources[0]);
        assert!(jwt.providers.is_empty() && jwt.rules.is_empty());
        let rbac: Rbac = typed(&resources[1]);
        assert!(rbac.rules.is_none(), "no rules: rbac enforces nothing");
    }

    #[test]
    fn each_channel_gets_its_provider_rule_and_policy() {
        let oidc = Oidc {
            issuer: "https://issuer.example".into(),
            jwks: "/jwks.json".into(),
        };
        let (a, b, c) = (
            "default/a".to_owned(),
            "default/b".to_owned(),
            "default/c".to_owned(),
        );
        let senders = |allowed| {
            Some(Senders {
                audience: "aud-a".into(),
                allowed,
            })
        };
        let specs = [
            spec(
                &["a.example"],
                senders(Allowed::Subjects(vec!["x:y".into(), "x:z:*".into()])),
            ),
            spec(&["b.example"], senders(Allowed::Subjects(Vec::new()))),
            spec(&["c.example"], senders(Allowed::Any)),
        ];
        let channels = [(&a, &specs[0]), (&b, &specs[1]), (&c, &specs[2])];
        let (resources, description) = filters(&channels, Some(&oidc));
        assert_eq!(description["channels"].as_array().unwrap().len(), 3);
        let jwt: JwtAuthentication = typed(&resources[0]);
        assert_eq!(jwt.providers.len(), 3);
        assert_eq!(jwt.providers["channel-0"].audiences, vec!["aud-a"]);
        assert_eq!(jwt.providers["channel-0"].payload_in_metadata, PAYLOAD);
        assert_eq!(jwt.rules.len(), 3);
        let rbac: Rbac = typed(&resources[1]);
        let policies = rbac.rules.unwrap().policies;
        // deny-all: no policy, so nobody matches (ALLOW).
        assert_eq!(policies.keys().collect::<Vec<_>>().len(), 2);
        assert!(!policies.contains_key("default/b"));
        let a_principals = &policies["default/a"].principals;
        let patterns: Vec<_> = a_principals
            .iter()
            .map(|p| match &p.identifier {
                Some(principal::Identifier::SourcedMetadata(m)) => m
                    .metadata_matcher
                    .as_ref()
                    .and_then(|m| m.value.as_ref())
                    .and_then(|v| v.match_pattern.clone())
                    .map(|p| format!("{p:?}")),
                _ => None,
            })
            .collect();
        assert!(patterns[0].as_ref().unwrap().contains("Exact(\"x:y\")"));
        assert!(patterns[1].as_ref().unwrap().contains("Prefix(\"x:z:\")"));
        assert_eq!(
            policies["default/c"].principals[0].identifier,
            Some(principal::Identifier::Any(true))
        );
    }

    #[test]
    fn hosts_match_in_any_case_on_any_port_and_nothing_else() {
        let matcher = authority(&["a.example".into(), "b-1.example".into()]);
        let Some(header_matcher::HeaderMatchSpecifier::StringMatch(m)) =
            matcher.header_match_specifier
        else {
            panic!("not a string match")
        };
        let Some(string_matcher::MatchPattern::SafeRegex(r)) = m.match_pattern else {
            panic!("not a regex")
        };
        assert_eq!(r.regex, r"(?i)^(a\.example|b-1\.example)(:[0-9]+)?$");
    }
}
