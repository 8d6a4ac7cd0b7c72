//! The configuration contract: the JSON that Envoy hands the filter as its plugin
//! configuration, and its validation into a [`Config`] that is ready to serve requests.
//!
//! Everything a request needs that can be worked out once is worked out here, at configure
//! time: per-subscriber header lists, the host routing table, the header selection. A config
//! that would misbehave at request time is rejected here, with a [`ConfigError`] that names
//! the field path (`channels[0].subscribers[2].cluster: must not be empty`), so that Envoy
//! refuses it (at startup it does not start; on an xDS update it keeps the previous one).
//!
//! This module does not know about proxy-wasm.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::Deserialize;
use serde_json::error::Category;

use crate::headers::{self, HeaderSelector};
use crate::routing::Router;

/// Per-call timeout when neither the subscriber nor the top level sets one.
pub const DEFAULT_TIMEOUT_MS: u32 = 60_000;
/// Largest body accepted when `max_body_bytes` is not set. Envoy's own listener buffer limit
/// (`per_connection_buffer_limit_bytes`) is 1 MiB by default too.
pub const DEFAULT_MAX_BODY_BYTES: u64 = 1024 * 1024;
/// Request headers forwarded to subscribers when `forward_headers` is not set.
pub const DEFAULT_FORWARD_HEADERS: &[&str] = &[
    "content-type",
    "x-request-id",
    "traceparent",
    "tracestate",
    "ce-*",
    "knative-*",
    "x-b3-*",
];
/// The method used for every subscriber call.
pub const SUBSCRIBER_METHOD: &str = "POST";

/// A configuration the filter cannot serve with. `path` is the JSON path of the offending
/// field (empty for the document as a whole).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub path: String,
    pub message: String,
}

impl ConfigError {
    fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            path: path.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() || self.path == "." {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

impl std::error::Error for ConfigError {}

/// The JSON document, field for field. Unknown fields are errors: a misspelt option must not
/// be silently ignored.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    timeout_ms: Option<u32>,
    max_body_bytes: Option<u64>,
    methods: Option<Vec<String>>,
    forward_headers: Option<Vec<String>>,
    channels: Option<Vec<RawChannel>>,
    subscribers: Option<Vec<RawSubscriber>>,
    metrics: Option<bool>,
    #[serde(default)]
    body_wait: BodyWait,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawChannel {
    name: Option<String>,
    hosts: Option<Vec<String>>,
    #[serde(default)]
    subscribers: Vec<RawSubscriber>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSubscriber {
    cluster: String,
    authority: Option<String>,
    path: Option<String>,
    timeout_ms: Option<u32>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
}

/// How the filter waits for the request body.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BodyWait {
    /// Pause in the headers callback. Needs `allow_on_headers_stop_iteration: true` in the
    /// plugin configuration on Envoy >= 1.35 (and works there only).
    #[default]
    Pause,
    /// Let the headers continue and hold the body. Needs an Envoy `buffer` filter after this
    /// one, or the router acts on the headers before the body is complete.
    Continue,
}

/// A validated configuration.
#[derive(Debug)]
pub struct Config {
    /// Methods a request may use (exact, case-sensitive as HTTP methods are).
    pub methods: Vec<String>,
    /// The `allow` header value of a 405 answer, joined once.
    pub allow: String,
    pub max_body_bytes: u64,
    pub forward: HeaderSelector,
    pub channels: Vec<Channel>,
    pub router: Router,
    /// Whether to count requests and calls in Envoy's stats (default true).
    pub metrics: bool,
    pub body_wait: BodyWait,
}

/// A set of subscribers reached through the hosts that name the channel.
#[derive(Debug)]
pub struct Channel {
    pub name: String,
    pub subscribers: Vec<Subscriber>,
}

/// One delivery target: an Envoy cluster, and the request line it expects.
#[derive(Debug)]
pub struct Subscriber {
    pub cluster: String,
    pub authority: String,
    pub path: String,
    pub timeout: Duration,
    /// `:method`, `:path`, `:authority` and the subscriber's own headers: the part of every
    /// call's header list that does not depend on the request.
    pub call_headers: Vec<(String, String)>,
}

impl Config {
    /// Parses and validates the plugin configuration.
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(ConfigError::new(
                "",
                "the plugin configuration is empty: give a JSON object with `channels` or `subscribers`",
            ));
        }
        // serde would take a JSON array as the fields in order; only an object is a config.
        if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(ConfigError::new(
                "",
                "the plugin configuration must be a JSON object, e.g. {\"subscribers\": [{\"cluster\": \"billing\"}]}",
            ));
        }
        let de = &mut serde_json::Deserializer::from_slice(bytes);
        let raw: RawConfig = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            match inner.classify() {
                // Not JSON at all: the position is what helps, and there is no field.
                Category::Syntax | Category::Eof | Category::Io => ConfigError::new(
                    "",
                    format!("the plugin configuration is not valid JSON: {inner}"),
                ),
                Category::Data => ConfigError::new(path, without_position(&inner)),
            }
        })?;
        raw.validate()
    }

    pub fn channel(&self, index: usize) -> Option<&Channel> {
        self.channels.get(index)
    }
}

/// serde_json's message without the trailing "at line 1 column 42", which means little in a
/// configuration that was embedded in YAML; the field path says where instead.
fn without_position(e: &serde_json::Error) -> String {
    let text = e.to_string();
    match text.rfind(" at line ") {
        Some(i) if e.line() > 0 => text[..i].to_string(),
        _ => text,
    }
}

impl RawConfig {
    fn validate(self) -> Result<Config, ConfigError> {
        let default_timeout = match self.timeout_ms {
            Some(ms) => timeout("timeout_ms", ms)?,
            None => Duration::from_millis(u64::from(DEFAULT_TIMEOUT_MS)),
        };

        let methods = match self.methods {
            Some(methods) => validate_methods(methods)?,
            None => vec![SUBSCRIBER_METHOD.to_string()],
        };

        let forward = match self.forward_headers {
            Some(list) => HeaderSelector::new(&list)
                .map_err(|(i, msg)| ConfigError::new(format!("forward_headers[{i}]"), msg))?,
            None => HeaderSelector::new(DEFAULT_FORWARD_HEADERS)
                .map_err(|(i, msg)| ConfigError::new(format!("forward_headers[{i}]"), msg))?,
        };

        // The shorthand's errors say `subscribers[i]`, a channel's `channels[c].subscribers[i]`.
        let (raw_channels, shorthand) = match (self.channels, self.subscribers) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::new(
                    "subscribers",
                    "cannot be used together with `channels`: top-level `subscribers` is the \
                     shorthand for one channel that matches every host",
                ))
            }
            (Some(channels), None) => (channels, false),
            (None, Some(subscribers)) => (
                vec![RawChannel {
                    name: Some("default".to_string()),
                    hosts: Some(vec!["*".to_string()]),
                    subscribers,
                }],
                true,
            ),
            (None, None) => {
                return Err(ConfigError::new(
                    "",
                    "no channels: give `channels` (a list of channels, each with hosts and \
                     subscribers) or `subscribers` (one channel for every host)",
                ))
            }
        };

        let mut router = Router::default();
        let mut channels = Vec::with_capacity(raw_channels.len());
        for (c, raw) in raw_channels.into_iter().enumerate() {
            let at = if shorthand {
                String::new()
            } else {
                format!("channels[{c}].")
            };
            let name = match raw.name {
                Some(name) if name.trim().is_empty() => {
                    return Err(ConfigError::new(
                        format!("{at}name"),
                        "must not be empty (leave it out for a default name)",
                    ))
                }
                Some(name) => name,
                None => format!("channels[{c}]"),
            };
            if let Some(other) = channels.iter().position(|ch: &Channel| ch.name == name) {
                return Err(ConfigError::new(
                    format!("{at}name"),
                    format!("\"{name}\" is already the name of channels[{other}]"),
                ));
            }
            let hosts = raw.hosts.unwrap_or_else(|| vec!["*".to_string()]);
            if hosts.is_empty() {
                return Err(ConfigError::new(
                    format!("{at}hosts"),
                    "must list at least one host (\"*\" matches every host)",
                ));
            }
            for (h, host) in hosts.iter().enumerate() {
                router
                    .add(host, c)
                    .map_err(|msg| ConfigError::new(format!("{at}hosts[{h}]"), msg))?;
            }
            let mut subscribers = Vec::with_capacity(raw.subscribers.len());
            for (s, sub) in raw.subscribers.into_iter().enumerate() {
                subscribers.push(sub.validate(&format!("{at}subscribers[{s}]"), default_timeout)?);
            }
            channels.push(Channel { name, subscribers });
        }

        Ok(Config {
            allow: methods.join(", "),
            methods,
            max_body_bytes: self.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES),
            forward,
            channels,
            router,
            metrics: self.metrics.unwrap_or(true),
            body_wait: self.body_wait,
        })
    }
}

impl RawSubscriber {
    fn validate(self, at: &str, default_timeout: Duration) -> Result<Subscriber, ConfigError> {
        let field = |name: &str| format!("{at}.{name}");
        if self.cluster.trim().is_empty() {
            return Err(ConfigError::new(field("cluster"), "must not be empty"));
        }
        if self.cluster.chars().any(char::is_control) {
            return Err(ConfigError::new(
                field("cluster"),
                "must not contain control characters",
            ));
        }
        let authority = self.authority.unwrap_or_else(|| self.cluster.clone());
        if authority.is_empty() || !headers::is_valid_value(&authority) || authority.contains(' ') {
            return Err(ConfigError::new(
                field("authority"),
                "must be a host name, optionally with a port, e.g. \"billing.default.svc\"",
            ));
        }
        let path = self.path.unwrap_or_else(|| "/".to_string());
        if !path.starts_with('/') {
            return Err(ConfigError::new(
                field("path"),
                format!("must start with \"/\", got \"{path}\""),
            ));
        }
        if path.bytes().any(|b| b <= b' ' || b == 0x7f) {
            return Err(ConfigError::new(
                field("path"),
                "must not contain spaces or control characters (percent-encode them)",
            ));
        }
        let timeout = match self.timeout_ms {
            Some(ms) => timeout(&field("timeout_ms"), ms)?,
            None => default_timeout,
        };

        let mut call_headers = Vec::with_capacity(3 + self.headers.len());
        call_headers.push((":method".to_string(), SUBSCRIBER_METHOD.to_string()));
        call_headers.push((":path".to_string(), path.clone()));
        call_headers.push((":authority".to_string(), authority.clone()));
        for (name, value) in self.headers {
            let at = field(&format!("headers.{name}"));
            let name = headers::validate_extra_header(&name, &value)
                .map_err(|msg| ConfigError::new(at, msg))?;
            call_headers.push((name, value));
        }

        Ok(Subscriber {
            cluster: self.cluster,
            authority,
            path,
            timeout,
            call_headers,
        })
    }
}

fn timeout(path: &str, ms: u32) -> Result<Duration, ConfigError> {
    if ms == 0 {
        return Err(ConfigError::new(
            path,
            "must be at least 1: Envoy reads a timeout of 0 as \"no timeout\"",
        ));
    }
    Ok(Duration::from_millis(u64::from(ms)))
}

fn validate_methods(methods: Vec<String>) -> Result<Vec<String>, ConfigError> {
    if methods.is_empty() {
        return Err(ConfigError::new(
            "methods",
            "must list at least one method, e.g. [\"POST\"]",
        ));
    }
    for (i, method) in methods.iter().enumerate() {
        let token = !method.is_empty() && method.bytes().all(headers::is_token_byte);
        if !token || method.bytes().any(|b| b.is_ascii_lowercase()) {
            return Err(ConfigError::new(
                format!("methods[{i}]"),
                format!(
                    "\"{method}\" is not an upper-case HTTP method such as \"POST\" or \"PUT\""
                ),
            ));
        }
    }
    Ok(methods)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn parse(json: &str) -> Result<Config, ConfigError> {
        Config::from_json(json.as_bytes())
    }

    fn error(json: &str) -> String {
        match parse(json) {
            Ok(_) => panic!("config was accepted: {json}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn full_example_from_the_readme_is_accepted() {
        let config = parse(
            r#"{
              "timeout_ms": 60000, "max_body_bytes": 1048576, "methods": ["POST"],
              "forward_headers": ["content-type", "x-request-id", "traceparent", "tracestate",
                                  "ce-*", "knative-*", "x-b3-*"],
              "channels": [
                { "name": "default/orders",
                  "hosts": ["orders.default", "orders.default.svc.cluster.local"],
                  "subscribers": [
                    { "cluster": "billing", "authority": "billing.default.svc.cluster.local",
                      "path": "/events", "timeout_ms": 2000, "headers": { "x-tenant": "acme" } }
                  ] }
              ]
            }"#,
        )
        .unwrap();
        let channel = &config.channels[0];
        assert_eq!(channel.name, "default/orders");
        let sub = &channel.subscribers[0];
        assert_eq!(sub.cluster, "billing");
        assert_eq!(sub.timeout, Duration::from_millis(2000));
        assert_eq!(
            sub.call_headers,
            vec![
                (":method".to_string(), "POST".to_string()),
                (":path".to_string(), "/events".to_string()),
                (
                    ":authority".to_string(),
                    "billing.default.svc.cluster.local".to_string()
                ),
                ("x-tenant".to_string(), "acme".to_string()),
            ]
        );
        assert_eq!(config.router.route("orders.default"), Some(0));
        assert_eq!(config.router.route("other"), None);
    }

    #[test]
    fn defaults_fill_every_field_but_cluster() {
        let config = parse(r#"{"subscribers": [{"cluster": "a"}]}"#).unwrap();
        assert_eq!(config.methods, vec!["POST"]);
        assert_eq!(config.allow, "POST");
        assert_eq!(config.max_body_bytes, DEFAULT_MAX_BODY_BYTES);
        assert!(config.forward.selects("ce-type"));
        assert!(config.forward.selects("x-b3-traceid"));
        assert!(!config.forward.selects("authorization"));
        let sub = &config.channels[0].subscribers[0];
        assert_eq!(sub.authority, "a");
        assert_eq!(sub.path, "/");
        assert_eq!(
            sub.timeout,
            Duration::from_millis(u64::from(DEFAULT_TIMEOUT_MS))
        );
        assert_eq!(config.router.route("anything.at.all"), Some(0));
    }

    #[test]
    fn top_level_timeout_is_the_default_and_a_subscriber_timeout_wins() {
        let config = parse(
            r#"{"timeout_ms": 700, "subscribers": [{"cluster": "a"}, {"cluster": "b", "timeout_ms": 5}]}"#,
        )
        .unwrap();
        let subs = &config.channels[0].subscribers;
        assert_eq!(subs[0].timeout, Duration::from_millis(700));
        assert_eq!(subs[1].timeout, Duration::from_millis(5));
    }

    #[test]
    fn empty_subscriber_list_is_a_valid_channel() {
        let config = parse(r#"{"subscribers": []}"#).unwrap();
        assert!(config.channels[0].subscribers.is_empty());
    }

    /// Every rejection names the field path and says what would be valid.
    #[test]
    fn rejections_name_the_field() {
        let cases: &[(&str, &str)] = &[
            ("", "the plugin configuration is empty"),
            ("  \n", "the plugin configuration is empty"),
            ("{}", "no channels"),
            ("[]", "must be a JSON object"),
            ("not json", "must be a JSON object"),
            (
                "{not json",
                "the plugin configuration is not valid JSON: key must be a string at line 1 column 2",
            ),
            (
                r#"{"subscribers": [{"cluster": "a"}]"#,
                "not valid JSON: EOF while parsing an object at line 1",
            ),
            (
                r#"{"subscribers": [{"cluster": "a"}], "bogus": 1}"#,
                "unknown field `bogus`",
            ),
            (
                r#"{"subscribers": [{"cluster": "a", "clutser": "b"}]}"#,
                "subscribers[0].clutser: unknown field `clutser`, expected one of `cluster`",
            ),
            (
                r#"{"channels": [{"subscribers": [{"cluster": "a"}, {"cluster": "b"}, {"cluster": ""}]}]}"#,
                "channels[0].subscribers[2].cluster: must not be empty",
            ),
            (
                r#"{"subscribers": [{"cluster": "a", "timeout_ms": "fast"}]}"#,
                "subscribers[0].timeout_ms: invalid type: string \"fast\"",
            ),
            (
                r#"{"subscribers": [{"cluster": "a", "timeout_ms": 0}]}"#,
                "subscribers[0].timeout_ms: must be at least 1",
            ),
            (
                r#"{"timeout_ms": 0, "subscribers": []}"#,
                "timeout_ms: must be at least 1",
            ),
            (
                r#"{"timeout_ms": -5, "subscribers": []}"#,
                "timeout_ms: invalid value: integer `-5`",
            ),
            (
                r#"{"subscribers": [{"cluster": "a", "path": "events"}]}"#,
                "subscribers[0].path: must start with \"/\"",
            ),
            (
                r#"{"subscribers": [{"cluster": "a", "path": "/a b"}]}"#,
                "subscribers[0].path: must not contain spaces",
            ),
            (
                r#"{"subscribers": [{"cluster": "a", "authority": "x\r\ny: z"}]}"#,
                "subscribers[0].authority: must be a host name",
            ),
            (
                r#"{"subscribers": [{"cluster": "a"}], "channels": []}"#,
                "subscribers: cannot be used together with `channels`",
            ),
            (
                r#"{"channels": [{"name": "x", "hosts": ["a.b"]}, {"name": "y", "hosts": ["c", "A.B"]}]}"#,
                "channels[1].hosts[1]: \"a.b\" is already claimed by channels[0]",
            ),
            (
                r#"{"channels": [{"name": "x"}, {"name": "y"}]}"#,
                "channels[1].hosts[0]: \"*\" is already claimed by channels[0]",
            ),
            (
                r#"{"channels": [{"name": "x", "hosts": ["a"]}, {"name": "x", "hosts": ["b"]}]}"#,
                "channels[1].name: \"x\" is already the name of channels[0]",
            ),
            (
                r#"{"channels": [{"hosts": []}]}"#,
                "channels[0].hosts: must list at least one host",
            ),
            (
                r#"{"channels": [{"hosts": ["orders:8080"]}]}"#,
                "channels[0].hosts[0]: must not contain a port",
            ),
            (
                r#"{"channels": [{"hosts": [""]}]}"#,
                "channels[0].hosts[0]: must not be empty",
            ),
            (
                r#"{"methods": [], "subscribers": []}"#,
                "methods: must list at least one",
            ),
            (
                r#"{"methods": ["post"], "subscribers": []}"#,
                "methods[0]: \"post\" is not an upper-case HTTP method",
            ),
            (
                r#"{"forward_headers": ["ok", "bad header"], "subscribers": []}"#,
                "forward_headers[1]:",
            ),
            (
                r#"{"forward_headers": ["content-length"], "subscribers": []}"#,
                "forward_headers[0]: \"content-length\" is never forwarded",
            ),
            (
                r#"{"subscribers": [{"cluster": "a", "headers": {"content-length": "5"}}]}"#,
                "subscribers[0].headers.content-length:",
            ),
            (
                r#"{"subscribers": [{"cluster": "a", "headers": {":path": "/x"}}]}"#,
                "subscribers[0].headers.:path:",
            ),
            (
                r#"{"subscribers": [{"cluster": "a", "headers": {"x-a": "1\r\nx-b: 2"}}]}"#,
                "subscribers[0].headers.x-a: the value must not contain",
            ),
        ];
        for (json, expected) in cases {
            let message = error(json);
            assert!(
                message.contains(expected),
                "config {json:?}\n  gave: {message}\n  want: ...{expected}..."
            );
            assert!(
                !message.contains(" at line ") || message.contains("not valid JSON"),
                "position leaked into {message}"
            );
            assert!(!message.starts_with('?'), "{message}");
        }
    }

    #[test]
    fn extra_header_names_are_lower_cased() {
        let config =
            parse(r#"{"subscribers": [{"cluster": "a", "headers": {"X-Tenant": "Acme"}}]}"#)
                .unwrap();
        let headers = &config.channels[0].subscribers[0].call_headers;
        assert_eq!(headers[3], ("x-tenant".to_string(), "Acme".to_string()));
    }

    #[test]
    fn body_wait_is_pause_unless_set() {
        let config = parse(r#"{"subscribers": []}"#).unwrap();
        assert_eq!(config.body_wait, BodyWait::Pause);
        let config = parse(r#"{"body_wait": "continue", "subscribers": []}"#).unwrap();
        assert_eq!(config.body_wait, BodyWait::Continue);
        let message = error(r#"{"body_wait": "wait", "subscribers": []}"#);
        assert!(
            message.contains("body_wait: unknown variant `wait`, expected `pause` or `continue`"),
            "{message}"
        );
    }

    #[test]
    fn several_methods_make_the_allow_header() {
        let config = parse(r#"{"methods": ["POST", "PUT"], "subscribers": []}"#).unwrap();
        assert_eq!(config.allow, "POST, PUT");
    }
}
