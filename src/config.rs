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

use crate::cloudevents::Attributes;
use crate::dedupe::{DedupeConfig, Identity, MAX_ENTRIES_LIMIT, MAX_TTL_MS};
use crate::delivery::{
    BackoffPolicy, RetryPolicy, DEFAULT_BACKOFF_DELAY_MS, DEFAULT_BACKOFF_MAX_MS, MAX_RETRY,
};
use crate::filters::{self, Filter};
use crate::headers::{self, HeaderSelector};
use crate::routing::Router;

/// The JSON document read with field paths in its errors.
mod json_path;

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
/// The method the filter answers itself (200 with `allow`), never fanned out.
pub const OPTIONS: &str = "OPTIONS";

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
    delivery: Option<RawDelivery>,
    reply: Option<RawTarget>,
    #[serde(default)]
    mode: Mode,
    max_in_flight: Option<u32>,
    #[serde(default)]
    report: ReportDetail,
    dedupe: Option<RawDedupe>,
    require_cloudevents: Option<bool>,
}

/// How much the 500 report says.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReportDetail {
    /// The subscribers that failed (and those dead-lettered or skipped, by name).
    #[default]
    Failures,
    /// Also every subscriber that took the event.
    Full,
}

/// `"dedupe": {"ttl_ms": 600000, "max_entries": 100000}` (and `"key": "<header>"` to name
/// events by a header instead of their CloudEvents identity); off when absent.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDedupe {
    key: Option<String>,
    ttl_ms: Option<u64>,
    max_entries: Option<u32>,
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
    delivery: Option<RawDelivery>,
    reply: Option<RawTarget>,
    /// The filter dialect, compiled by [`filters::compile_list`].
    filters: Option<Vec<serde_json::Value>>,
    /// The older `{"attributes": {...}}` form, compiled by [`filters::compile_legacy`].
    filter: Option<serde_json::Value>,
}

/// Where a dead letter or a reply goes: a call target like a subscriber.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTarget {
    cluster: String,
    authority: Option<String>,
    path: Option<String>,
    timeout_ms: Option<u32>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
}

/// Retries and dead letters. A subscriber's own fields win over the top-level ones.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDelivery {
    retry: Option<u32>,
    backoff_policy: Option<BackoffPolicy>,
    backoff_delay_ms: Option<u32>,
    backoff_max_ms: Option<u32>,
    dead_letter: Option<RawTarget>,
}

impl RawDelivery {
    /// This subscriber's fields, falling back to the top level's.
    fn or(self, default: &RawDelivery) -> RawDelivery {
        RawDelivery {
            retry: self.retry.or(default.retry),
            backoff_policy: self.backoff_policy.or(default.backoff_policy),
            backoff_delay_ms: self.backoff_delay_ms.or(default.backoff_delay_ms),
            backoff_max_ms: self.backoff_max_ms.or(default.backoff_max_ms),
            dead_letter: self.dead_letter.or_else(|| default.dead_letter.clone()),
        }
    }

    fn policy(&self, at: &str) -> Result<RetryPolicy, ConfigError> {
        let retry = self.retry.unwrap_or(0);
        if retry > MAX_RETRY {
            return Err(ConfigError::new(
                format!("{at}.retry"),
                format!("at most {MAX_RETRY} retries, got {retry}"),
            ));
        }
        Ok(RetryPolicy {
            retry,
            policy: self.backoff_policy.unwrap_or_default(),
            delay_ms: self
                .backoff_delay_ms
                .map_or(DEFAULT_BACKOFF_DELAY_MS, u64::from),
            max_ms: self
                .backoff_max_ms
                .map_or(DEFAULT_BACKOFF_MAX_MS, u64::from),
        })
    }
}

/// Whether the 202/500 answer waits for the deliveries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Answer when every subscriber has taken the event or failed for good.
    #[default]
    Sync,
    /// Answer 202 once the event is complete and valid; deliver in the background.
    Async,
}

/// Events an async worker holds at once when `max_in_flight` is not set.
pub const DEFAULT_MAX_IN_FLIGHT: u32 = 1000;
/// Above this worst-case time a sync fan-out would outlast Envoy's default stream idle timeout
/// (5 minutes), which answers the sender 408 instead: configure() warns.
pub const SYNC_DEADLINE_WARNING_MS: u64 = 300_000;

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
    pub mode: Mode,
    pub report: ReportDetail,
    /// Async mode: events one worker holds at once; past it a request gets 503.
    pub max_in_flight: usize,
    /// Some subscriber retries, dead-letters or replies: the root context's timer is needed.
    pub needs_timer: bool,
    /// Things that are valid but probably not what the user wants, for configure() to log.
    pub warnings: Vec<String>,
    /// Redelivery without duplicates (`None`: off).
    pub dedupe: Option<DedupeConfig>,
    /// A request that is not a valid CloudEvent gets 400 (default false: anything is fanned
    /// out).
    pub require_cloudevents: bool,
}

/// A set of subscribers reached through the hosts that name the channel.
#[derive(Debug)]
pub struct Channel {
    pub name: String,
    pub subscribers: Vec<Subscriber>,
    /// Some subscriber has a filter: only then are a request's CloudEvents attributes read
    /// (and a structured body parsed).
    pub filtered: bool,
}

/// One delivery target: an Envoy cluster, the request line it expects, and what to do when
/// it fails or answers with an event.
#[derive(Debug)]
pub struct Subscriber {
    pub cluster: String,
    pub authority: String,
    pub path: String,
    pub timeout: Duration,
    /// `:method`, `:path`, `:authority` and the subscriber's own headers: the part of every
    /// call's header list that does not depend on the request.
    pub call_headers: Vec<(String, String)>,
    pub retry: RetryPolicy,
    /// Where the event goes when this subscriber has failed for good.
    pub dead_letter: Option<Target>,
    /// Where this subscriber's answer goes when it answers 2xx with a body.
    pub reply: Option<Target>,
    /// Which events it wants; `None`: every request, CloudEvent or not.
    pub filter: Option<Filter>,
}

/// A dead-letter or reply target.
#[derive(Debug, Clone)]
pub struct Target {
    pub cluster: String,
    pub authority: String,
    pub path: String,
    pub timeout: Duration,
    pub call_headers: Vec<(String, String)>,
}

impl Subscriber {
    /// Does it want the event with these attributes (`None`: the request is not a
    /// CloudEvent, or the channel has no filters and nobody looked)?
    pub fn accepts(&self, event: Option<&Attributes>) -> bool {
        filters::accepts(self.filter.as_ref(), event)
    }

    /// Whether this subscriber needs more than one call per event at times: retries, a dead
    /// letter or a reply.
    pub fn has_follow_ups(&self) -> bool {
        self.retry.retry > 0 || self.dead_letter.is_some() || self.reply.is_some()
    }

    /// The longest this subscriber's delivery can take (every attempt timing out, every wait
    /// at its longest, then its reply, then the dead letter: a reply that fails for good sends
    /// the event there too).
    pub fn worst_case_ms(&self) -> u64 {
        let call = |timeout: Duration| self.retry.worst_case_ms(timeout.as_millis() as u64);
        [
            Some(self.timeout),
            self.reply.as_ref().map(|t| t.timeout),
            self.dead_letter.as_ref().map(|t| t.timeout),
        ]
        .into_iter()
        .flatten()
        .fold(0, |total: u64, timeout| total.saturating_add(call(timeout)))
    }
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
        let raw: RawConfig = json_path::from_slice(bytes).map_err(|e| match e {
            // Not JSON at all (or something after the document): the position is what helps,
            // and there is no field.
            json_path::ReadError::Syntax(inner) => ConfigError::new(
                "",
                format!("the plugin configuration is not valid JSON: {inner}"),
            ),
            json_path::ReadError::Data { path, message } => ConfigError::new(path, message),
        })?;
        raw.validate()
    }

    pub fn channel(&self, index: usize) -> Option<&Channel> {
        self.channels.get(index)
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

        let defaults = Defaults {
            delivery: self.delivery.unwrap_or_default(),
            reply: self.reply,
        };
        // The top-level ones are checked once, by name, even when every subscriber has its own.
        defaults.delivery.policy("delivery")?;
        if let Some(dlq) = &defaults.delivery.dead_letter {
            dlq.clone()
                .validate("delivery.dead_letter", default_timeout)?;
        }
        if let Some(reply) = &defaults.reply {
            reply.clone().validate("reply", default_timeout)?;
        }
        let max_in_flight = match self.max_in_flight {
            Some(0) => {
                return Err(ConfigError::new(
                    "max_in_flight",
                    "must be at least 1 (events one worker holds at once in async mode)",
                ))
            }
            Some(n) => n as usize,
            None => DEFAULT_MAX_IN_FLIGHT as usize,
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
                subscribers.push(sub.validate(
                    &format!("{at}subscribers[{s}]"),
                    default_timeout,
                    &defaults,
                )?);
            }
            let filtered = subscribers.iter().any(|s| s.filter.is_some());
            channels.push(Channel {
                name,
                subscribers,
                filtered,
            });
        }

        let mut warnings = Vec::new();
        if self.mode == Mode::Sync {
            for channel in &channels {
                for sub in &channel.subscribers {
                    let worst = sub.worst_case_ms();
                    if worst > SYNC_DEADLINE_WARNING_MS {
                        warnings.push(format!(
                            "channel {}: subscriber {} may take up to {worst} ms to deliver in \
                             sync mode, longer than Envoy's default stream idle timeout \
                             ({SYNC_DEADLINE_WARNING_MS} ms); raise that timeout or lower \
                             timeouts and retries",
                            channel.name, sub.cluster
                        ));
                    }
                }
            }
        }
        let needs_timer = self.mode == Mode::Async
            || channels
                .iter()
                .flat_map(|c| &c.subscribers)
                .any(Subscriber::has_follow_ups);

        Ok(Config {
            // OPTIONS is answered by the filter itself (request.rs), whatever `methods` says.
            allow: format!("{}, {OPTIONS}", methods.join(", ")),
            methods,
            max_body_bytes: self.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES),
            forward,
            channels,
            router,
            metrics: self.metrics.unwrap_or(true),
            body_wait: self.body_wait,
            mode: self.mode,
            report: self.report,
            max_in_flight,
            needs_timer,
            warnings,
            dedupe: self.dedupe.map(RawDedupe::validate).transpose()?,
            require_cloudevents: self.require_cloudevents.unwrap_or(false),
        })
    }
}

/// Defaults of `dedupe` (without `key`, events are named by their CloudEvents identity).
pub const DEFAULT_DEDUPE_TTL_MS: u64 = 600_000;
pub const DEFAULT_DEDUPE_MAX_ENTRIES: u32 = 100_000;

impl RawDedupe {
    fn validate(self) -> Result<DedupeConfig, ConfigError> {
        let key = match self.key {
            None => Identity::CloudEvent,
            Some(name) => {
                let name = name.to_ascii_lowercase();
                if name.is_empty() || !name.bytes().all(headers::is_token_byte) {
                    return Err(ConfigError::new(
                        "dedupe.key",
                        format!(
                            "\"{name}\" is not a header name, e.g. \"x-event-id\" (leave `key` out \
                             to name events by their CloudEvents source and id)"
                        ),
                    ));
                }
                Identity::Header(name)
            }
        };
        let ttl_ms = self.ttl_ms.unwrap_or(DEFAULT_DEDUPE_TTL_MS);
        if !(1..=MAX_TTL_MS).contains(&ttl_ms) {
            return Err(ConfigError::new(
                "dedupe.ttl_ms",
                format!("must be from 1 to {MAX_TTL_MS} (7 days), got {ttl_ms}"),
            ));
        }
        let max_entries = self.max_entries.unwrap_or(DEFAULT_DEDUPE_MAX_ENTRIES);
        if !(1..=MAX_ENTRIES_LIMIT).contains(&max_entries) {
            return Err(ConfigError::new(
                "dedupe.max_entries",
                format!("must be from 1 to {MAX_ENTRIES_LIMIT}, got {max_entries}"),
            ));
        }
        Ok(DedupeConfig {
            key,
            ttl_ms,
            max_entries,
        })
    }
}

impl RawTarget {
    fn validate(self, at: &str, default_timeout: Duration) -> Result<Target, ConfigError> {
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

        Ok(Target {
            cluster: self.cluster,
            authority,
            path,
            timeout,
            call_headers,
        })
    }
}

/// The top-level defaults a subscriber falls back to.
struct Defaults {
    delivery: RawDelivery,
    reply: Option<RawTarget>,
}

impl RawSubscriber {
    fn validate(
        self,
        at: &str,
        default_timeout: Duration,
        defaults: &Defaults,
    ) -> Result<Subscriber, ConfigError> {
        let filter = match (&self.filters, &self.filter) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::new(
                    format!("{at}.filter"),
                    "cannot be used together with `filters`: put its attributes in `filters` \
                     as `exact` filters",
                ))
            }
            (Some(list), None) => filters::compile_list(list),
            (None, Some(legacy)) => filters::compile_legacy(legacy),
            (None, None) => Ok(None),
        }
        .map_err(|e| ConfigError::new(format!("{at}.{}", e.path), e.message))?;
        let target = RawTarget {
            cluster: self.cluster,
            authority: self.authority,
            path: self.path,
            timeout_ms: self.timeout_ms,
            headers: self.headers,
        }
        .validate(at, default_timeout)?;
        // Errors name the subscriber's own field when it has one, else the top-level one.
        let delivery_at = if self.delivery.is_some() {
            format!("{at}.delivery")
        } else {
            "delivery".to_string()
        };
        let delivery = self.delivery.unwrap_or_default().or(&defaults.delivery);
        let retry = delivery.policy(&delivery_at)?;
        let dead_letter = match delivery.dead_letter {
            Some(dlq) => {
                Some(dlq.validate(&format!("{delivery_at}.dead_letter"), default_timeout)?)
            }
            None => None,
        };
        let reply = match (self.reply, &defaults.reply) {
            (Some(reply), _) => Some(reply.validate(&format!("{at}.reply"), default_timeout)?),
            (None, Some(reply)) => Some(reply.clone().validate("reply", default_timeout)?),
            (None, None) => None,
        };
        Ok(Subscriber {
            cluster: target.cluster,
            authority: target.authority,
            path: target.path,
            timeout: target.timeout,
            call_headers: target.call_headers,
            retry,
            dead_letter,
            reply,
            filter,
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
        if method == OPTIONS {
            return Err(ConfigError::new(
                format!("methods[{i}]"),
                "OPTIONS is answered by fanout itself (200 with `allow` and the CloudEvents \
                 webhook headers) and never fanned out: leave it out",
            ));
        }
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

    /// Each config is refused with a message containing its expected text.
    fn assert_rejected(cases: &[(&str, &str)]) {
        for (json, expected) in cases {
            let message = error(json);
            assert!(
                message.contains(expected),
                "config {json}\n  gave: {message}\n  want: ...{expected}..."
            );
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
        assert_eq!(config.allow, "POST, OPTIONS");
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
                r#"{"subscribers": [{"cluster": "a"}]} trailing"#,
                "not valid JSON: trailing characters at line 1",
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
    fn delivery_defaults_and_subscriber_overrides() {
        let config = parse(
            r#"{
              "delivery": { "retry": 3, "backoff_policy": "linear", "backoff_delay_ms": 50,
                            "dead_letter": { "cluster": "dlq", "authority": "dlq.local" } },
              "reply": { "cluster": "replies" },
              "subscribers": [
                { "cluster": "a" },
                { "cluster": "b", "delivery": { "retry": 1 } },
                { "cluster": "c", "reply": { "cluster": "own", "path": "/r" } }
              ]
            }"#,
        )
        .unwrap();
        let subs = &config.channels[0].subscribers;
        assert_eq!(subs[0].retry.retry, 3);
        assert_eq!(subs[0].retry.policy, BackoffPolicy::Linear);
        assert_eq!(subs[0].retry.delay_ms, 50);
        assert_eq!(subs[0].retry.max_ms, DEFAULT_BACKOFF_MAX_MS);
        let dlq = subs[0].dead_letter.as_ref().unwrap();
        assert_eq!(
            (dlq.cluster.as_str(), dlq.authority.as_str()),
            ("dlq", "dlq.local")
        );
        assert_eq!(subs[0].reply.as_ref().unwrap().cluster, "replies");
        // b overrides retry only: the rest comes from the top level.
        assert_eq!(subs[1].retry.retry, 1);
        assert_eq!(subs[1].retry.policy, BackoffPolicy::Linear);
        assert_eq!(subs[1].dead_letter.as_ref().unwrap().cluster, "dlq");
        assert_eq!(subs[2].reply.as_ref().unwrap().path, "/r");
        assert!(config.needs_timer);
        assert_eq!(config.mode, Mode::Sync);
    }

    #[test]
    fn plain_config_needs_no_timer_and_async_does() {
        assert!(
            !parse(r#"{"subscribers": [{"cluster": "a"}]}"#)
                .unwrap()
                .needs_timer
        );
        let config = parse(r#"{"mode": "async", "subscribers": [{"cluster": "a"}]}"#).unwrap();
        assert!(config.needs_timer);
        assert_eq!(config.mode, Mode::Async);
        assert_eq!(config.max_in_flight, DEFAULT_MAX_IN_FLIGHT as usize);
    }

    #[test]
    fn delivery_rejections_name_the_field() {
        let cases: &[(&str, &str)] = &[
            (
                r#"{"delivery": {"retry": 101}, "subscribers": []}"#,
                "delivery.retry: at most 100 retries",
            ),
            (
                r#"{"subscribers": [{"cluster": "a", "delivery": {"retry": 1000}}]}"#,
                "subscribers[0].delivery.retry: at most 100 retries",
            ),
            (
                r#"{"delivery": {"backoff_policy": "random"}, "subscribers": []}"#,
                "delivery.backoff_policy: unknown variant `random`, expected `linear` or `exponential`",
            ),
            (
                r#"{"delivery": {"dead_letter": {"cluster": ""}}, "subscribers": []}"#,
                "delivery.dead_letter.cluster: must not be empty",
            ),
            (
                r#"{"subscribers": [{"cluster": "a", "delivery": {"dead_letter": {"cluster": "d", "path": "x"}}}]}"#,
                "subscribers[0].delivery.dead_letter.path: must start with",
            ),
            (
                r#"{"reply": {"cluster": "r", "timeout_ms": 0}, "subscribers": []}"#,
                "reply.timeout_ms: must be at least 1",
            ),
            (
                r#"{"subscribers": [{"cluster": "a", "reply": {"path": "/"}}]}"#,
                "subscribers[0].reply: missing field `cluster`",
            ),
            (
                r#"{"delivery": {"retries": 3}, "subscribers": []}"#,
                "delivery.retries: unknown field `retries`",
            ),
            (
                r#"{"mode": "later", "subscribers": []}"#,
                "mode: unknown variant `later`, expected `sync` or `async`",
            ),
            (
                r#"{"mode": "async", "max_in_flight": 0, "subscribers": []}"#,
                "max_in_flight: must be at least 1",
            ),
        ];
        assert_rejected(cases);
    }

    #[test]
    fn a_sync_delivery_longer_than_envoys_idle_timeout_is_warned_about() {
        let config = parse(
            r#"{"delivery": {"retry": 10}, "subscribers": [{"cluster": "slow", "timeout_ms": 60000}]}"#,
        )
        .unwrap();
        assert_eq!(config.warnings.len(), 1);
        assert!(
            config.warnings[0].contains("subscriber slow may take up to"),
            "{:?}",
            config.warnings
        );
        let config = parse(
            r#"{"mode": "async", "delivery": {"retry": 10}, "subscribers": [{"cluster": "slow", "timeout_ms": 60000}]}"#,
        )
        .unwrap();
        assert!(config.warnings.is_empty());
    }

    #[test]
    fn report_is_failures_unless_full() {
        let config = parse(r#"{"subscribers": []}"#).unwrap();
        assert_eq!(config.report, ReportDetail::Failures);
        let config = parse(r#"{"report": "full", "subscribers": []}"#).unwrap();
        assert_eq!(config.report, ReportDetail::Full);
        assert!(error(r#"{"report": "all", "subscribers": []}"#)
            .contains("report: unknown variant `all`, expected `failures` or `full`"));
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
    fn filters_compile_at_configure_time_and_mark_the_channel() {
        let config = parse(
            r#"{"channels": [
                 {"name": "orders", "hosts": ["orders"], "subscribers": [
                   {"cluster": "a", "filters": [{"exact": {"type": "created"}}]},
                   {"cluster": "b", "filter": {"attributes": {"type": "shipped"}}},
                   {"cluster": "c"},
                   {"cluster": "d", "filters": []}
                 ]},
                 {"name": "plain", "hosts": ["plain"], "subscribers": [{"cluster": "e"}]}
               ]}"#,
        )
        .unwrap();
        let orders = &config.channels[0];
        assert!(orders.filtered);
        assert!(!config.channels[1].filtered);
        let created = Attributes::from([("type", "created")]);
        let accepts: Vec<bool> = orders
            .subscribers
            .iter()
            .map(|s| s.accepts(Some(&created)))
            .collect();
        assert_eq!(accepts, [true, false, true, true]);
        let not_an_event: Vec<bool> = orders.subscribers.iter().map(|s| s.accepts(None)).collect();
        assert_eq!(not_an_event, [false, false, true, true]);
    }

    /// The example of the README's "Subscription filters" section, as it is printed there.
    #[test]
    fn readme_filter_example_is_accepted_and_means_what_it_says() {
        let readme = include_str!("../README.md");
        let section = &readme[readme.find("## Subscription filters").unwrap()..];
        let start = section.find("```json\n").unwrap() + "```json\n".len();
        let example = &section[start..start + section[start..].find("```").unwrap()];
        let config = parse(example).unwrap();
        let channel = &config.channels[0];
        assert!(channel.filtered);
        let event = Attributes::from([
            ("type", "com.example.order.created"),
            ("source", "/orders/eu"),
            ("subject", "invoice.pdf"),
        ]);
        let wanted: Vec<&str> = channel
            .subscribers
            .iter()
            .filter(|s| s.accepts(Some(&event)))
            .map(|s| s.cluster.as_str())
            .collect();
        assert_eq!(
            wanted,
            ["billing", "archive", "shipping", "legacy", "audit"]
        );
        let mut test = event.clone();
        test.insert("env".into(), "test".into());
        test.insert("type".into(), "com.example.order.cancelled".into());
        let wanted: Vec<&str> = channel
            .subscribers
            .iter()
            .filter(|s| s.accepts(Some(&test)))
            .map(|s| s.cluster.as_str())
            .collect();
        assert_eq!(wanted, ["shipping", "audit"]);
    }

    #[test]
    fn filter_rejections_name_the_field() {
        let cases: &[(&str, &str)] = &[
            (
                r#"{"channels": [{"subscribers": [{"cluster": "a"}, {"cluster": "b", "filters": [
                     {"exact": {"type": "t"}}, {"prefix": {"source": "/"}},
                     {"exact": {"type": "t", "source": "s"}}]}]}]}"#,
                "channels[0].subscribers[1].filters[2].exact: must name exactly one attribute",
            ),
            (
                r#"{"subscribers": [{"cluster": "a", "filters": [{"regex": {"type": "."}}]}]}"#,
                "subscribers[0].filters[0].regex: unknown operator \"regex\"",
            ),
            (
                r#"{"subscribers": [{"cluster": "a", "filters": [{"exact": {"": "t"}}]}]}"#,
                "subscribers[0].filters[0].exact.: the attribute name must not be empty",
            ),
            (
                r#"{"subscribers": [{"cluster": "a", "filters": {"exact": {"type": "t"}}}]}"#,
                "subscribers[0].filters: invalid type: map, expected a sequence",
            ),
            (
                r#"{"subscribers": [{"cluster": "a", "filter": {"attributes": {"": "t"}}}]}"#,
                "subscribers[0].filter.attributes.: the attribute name must not be empty",
            ),
            (
                r#"{"subscribers": [{"cluster": "a", "filter": {"attributes": {}}, "filters": []}]}"#,
                "subscribers[0].filter: cannot be used together with `filters`",
            ),
        ];
        for (json, expected) in cases {
            let message = error(json);
            assert!(
                message.starts_with(expected),
                "config {json:?}\n  gave: {message}\n  want: {expected}..."
            );
        }
    }

    #[test]
    fn dedupe_is_off_unless_present_and_has_defaults() {
        assert_eq!(parse(r#"{"subscribers": []}"#).unwrap().dedupe, None);
        let config = parse(r#"{"dedupe": {}, "subscribers": []}"#).unwrap();
        assert_eq!(
            config.dedupe,
            Some(DedupeConfig {
                key: Identity::CloudEvent,
                ttl_ms: 600_000,
                max_entries: 100_000
            })
        );
        let config = parse(
            r#"{"dedupe": {"key": "X-Event-Id", "ttl_ms": 1, "max_entries": 1}, "subscribers": []}"#,
        )
        .unwrap();
        let dedupe = config.dedupe.unwrap();
        assert_eq!(dedupe.key, Identity::Header("x-event-id".into()));
        assert_eq!((dedupe.ttl_ms, dedupe.max_entries), (1, 1));
    }

    #[test]
    fn dedupe_rejections_name_the_field() {
        let cases: &[(&str, &str)] = &[
            (r#"{"key": ""}"#, "dedupe.key: \"\" is not a header name"),
            (
                r#"{"key": "ce id"}"#,
                "dedupe.key: \"ce id\" is not a header name",
            ),
            (r#"{"key": ":path"}"#, "dedupe.key:"),
            (r#"{"ttl_ms": 0}"#, "dedupe.ttl_ms: must be from 1 to"),
            (
                r#"{"ttl_ms": 604800001}"#,
                "dedupe.ttl_ms: must be from 1 to",
            ),
            (
                r#"{"max_entries": 0}"#,
                "dedupe.max_entries: must be from 1 to 1000000",
            ),
            (
                r#"{"max_entries": 1000001}"#,
                "dedupe.max_entries: must be from 1",
            ),
            (
                r#"{"max_entries": -1}"#,
                "dedupe.max_entries: invalid value",
            ),
            (r#"{"ttl": 5}"#, "dedupe.ttl: unknown field `ttl`"),
        ];
        for (dedupe, expected) in cases {
            let message = error(&format!(r#"{{"dedupe": {dedupe}, "subscribers": []}}"#));
            assert!(
                message.contains(expected),
                "{dedupe}\n  gave: {message}\n  want: {expected}"
            );
        }
    }

    #[test]
    fn several_methods_make_the_allow_header_with_options() {
        let config = parse(r#"{"methods": ["POST", "PUT"], "subscribers": []}"#).unwrap();
        assert_eq!(config.allow, "POST, PUT, OPTIONS");
    }

    #[test]
    fn options_is_not_a_method_to_fan_out() {
        let message = error(r#"{"methods": ["POST", "OPTIONS"], "subscribers": []}"#);
        assert!(
            message.starts_with("methods[1]: OPTIONS is answered by fanout itself"),
            "{message}"
        );
    }

    #[test]
    fn require_cloudevents_is_off_by_default_and_must_be_a_boolean() {
        assert!(!parse(r#"{"subscribers": []}"#).unwrap().require_cloudevents);
        let on = parse(r#"{"require_cloudevents": true, "subscribers": []}"#).unwrap();
        assert!(on.require_cloudevents);
        let message = error(r#"{"require_cloudevents": "yes", "subscribers": []}"#);
        assert!(
            message.starts_with(
                "require_cloudevents: invalid type: string \"yes\", expected a boolean"
            ),
            "{message}"
        );
    }
}
