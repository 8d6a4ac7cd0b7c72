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

use std::fmt;
use std::rc::Rc;
use std::time::Duration;

#[cfg(test)]
use serde::Deserialize;

use crate::call_slots::CallCap;
use crate::cloudevents::Attributes;
use crate::event_filter::{self, Filter};
use crate::format::Format;
use crate::headers::HeaderSelector;
use crate::jitter::Jitter;
use crate::retry::{BackoffPolicy, RetryPolicy};
use crate::routing::Router;

/// The `dedupe` settings, raw and validated.
mod dedupe;
/// The JSON document read with field paths in its errors.
mod json_path;
/// The raw types read from it.
mod read;
/// The raw types written as JSON (for a control plane building the configuration).
#[cfg(feature = "serialize")]
mod write;
pub use json_path::Node;
/// `tracing`: its raw and validated settings.
mod tracing;
mod validate;
use dedupe::RawDedupe;
pub use dedupe::{
    DedupeConfig, EtcdStore, Identity, OnStoreError, Store, DEFAULT_DEDUPE_MAX_ENTRIES,
    DEFAULT_DEDUPE_TTL_MS, MAX_ENTRIES_LIMIT, MAX_KEY_BYTES, MAX_TTL_MS, SHARD_CAPACITY,
};
pub use tracing::TracingConfig;

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
#[derive(Debug, Default)]
#[cfg_attr(test, derive(Deserialize), serde(deny_unknown_fields))]
struct RawConfig {
    timeout_ms: Option<u32>,
    max_body_bytes: Option<u64>,
    methods: Option<Vec<String>>,
    forward_headers: Option<Vec<String>>,
    channels: Option<Vec<RawChannel>>,
    subscribers: Option<Vec<RawSubscriber>>,
    metrics: Option<bool>,
    #[cfg_attr(test, serde(default))]
    body_wait: BodyWait,
    delivery: Option<RawDelivery>,
    reply: Option<RawTarget>,
    #[cfg_attr(test, serde(default))]
    mode: AnswerMode,
    max_in_flight: Option<u32>,
    /// Defaults of every subscriber's own.
    max_concurrent_calls: Option<u32>,
    max_queued_calls: Option<u32>,
    #[cfg_attr(test, serde(default))]
    report: ReportDetail,
    dedupe: Option<RawDedupe>,
    require_cloudevents: Option<bool>,
    tracing: Option<tracing::RawTracing>,
}

/// How much the 500 report says.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(test, derive(Deserialize), serde(rename_all = "lowercase"))]
pub enum ReportDetail {
    /// The subscribers that failed (and those dead-lettered or skipped, by name).
    #[default]
    Failures,
    /// Also every subscriber that took the event.
    Full,
}

/// One entry of `channels`.
#[derive(Debug, Default)]
#[cfg_attr(test, derive(Deserialize), serde(deny_unknown_fields))]
#[cfg_attr(feature = "serialize", derive(Clone, PartialEq, serde::Serialize))]
pub struct RawChannel {
    #[cfg_attr(feature = "serialize", serde(skip_serializing_if = "Option::is_none"))]
    pub name: Option<String>,
    #[cfg_attr(feature = "serialize", serde(skip_serializing_if = "Option::is_none"))]
    pub hosts: Option<Vec<String>>,
    #[cfg_attr(test, serde(default))]
    pub subscribers: Vec<RawSubscriber>,
}

/// One subscriber, of a channel or of the top-level `subscribers`.
#[derive(Debug, Default)]
#[cfg_attr(test, derive(Deserialize), serde(deny_unknown_fields))]
#[cfg_attr(feature = "serialize", derive(Clone, PartialEq, serde::Serialize))]
pub struct RawSubscriber {
    pub cluster: String,
    #[cfg_attr(feature = "serialize", serde(skip_serializing_if = "Option::is_none"))]
    pub authority: Option<String>,
    #[cfg_attr(feature = "serialize", serde(skip_serializing_if = "Option::is_none"))]
    pub path: Option<String>,
    #[cfg_attr(feature = "serialize", serde(skip_serializing_if = "Option::is_none"))]
    pub timeout_ms: Option<u32>,
    #[cfg_attr(test, serde(default))]
    #[cfg_attr(
        feature = "serialize",
        serde(skip_serializing_if = "RawHeaders::is_empty")
    )]
    pub headers: RawHeaders,
    #[cfg_attr(feature = "serialize", serde(skip_serializing_if = "Option::is_none"))]
    pub delivery: Option<RawDelivery>,
    #[cfg_attr(feature = "serialize", serde(skip_serializing_if = "Option::is_none"))]
    pub reply: Option<RawTarget>,
    /// The filter dialect, compiled by [`event_filter::compile_list`].
    #[cfg_attr(
        feature = "serialize",
        serde(
            skip_serializing_if = "Option::is_none",
            serialize_with = "write::nodes"
        )
    )]
    pub filters: Option<Vec<Node>>,
    /// The older `{"attributes": {...}}` form, compiled by [`event_filter::compile_legacy`].
    #[cfg_attr(
        feature = "serialize",
        serde(
            skip_serializing_if = "Option::is_none",
            serialize_with = "write::node"
        )
    )]
    pub filter: Option<Node>,
    /// `false`: best-effort, the sender's answer does not wait for it (default true).
    #[cfg_attr(feature = "serialize", serde(skip_serializing_if = "Option::is_none"))]
    pub required: Option<bool>,
    #[cfg_attr(feature = "serialize", serde(skip_serializing_if = "Option::is_none"))]
    pub max_concurrent_calls: Option<u32>,
    #[cfg_attr(feature = "serialize", serde(skip_serializing_if = "Option::is_none"))]
    pub max_queued_calls: Option<u32>,
}

/// Where a dead letter or a reply goes: a call target like a subscriber.
#[derive(Debug, Clone, Default)]
#[cfg_attr(test, derive(Deserialize), serde(deny_unknown_fields))]
#[cfg_attr(feature = "serialize", derive(PartialEq, serde::Serialize))]
pub struct RawTarget {
    pub cluster: String,
    #[cfg_attr(feature = "serialize", serde(skip_serializing_if = "Option::is_none"))]
    pub authority: Option<String>,
    #[cfg_attr(feature = "serialize", serde(skip_serializing_if = "Option::is_none"))]
    pub path: Option<String>,
    #[cfg_attr(feature = "serialize", serde(skip_serializing_if = "Option::is_none"))]
    pub timeout_ms: Option<u32>,
    #[cfg_attr(test, serde(default))]
    #[cfg_attr(
        feature = "serialize",
        serde(skip_serializing_if = "RawHeaders::is_empty")
    )]
    pub headers: RawHeaders,
}

/// A target's `headers` object: names and values in document order, a name given twice
/// keeping its last value (as a map would). A list, not a `BTreeMap`: a target has few
/// headers, and a map's code costs module size.
#[derive(Debug, Clone, Default)]
#[cfg_attr(feature = "serialize", derive(PartialEq))]
pub struct RawHeaders(pub Vec<(String, String)>);

#[cfg(test)]
impl<'de> Deserialize<'de> for RawHeaders {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(RawHeadersVisitor)
    }
}

#[cfg(test)]
struct RawHeadersVisitor;

#[cfg(test)]
impl<'de> serde::de::Visitor<'de> for RawHeadersVisitor {
    type Value = RawHeaders;

    /// A map's own word, so the messages are those serde's derived reader of a map gives.
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a map")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<RawHeaders, A::Error> {
        let mut headers: Vec<(String, String)> = Vec::new();
        while let Some((name, value)) = map.next_entry::<String, String>()? {
            match headers.iter_mut().find(|(n, _)| *n == name) {
                Some(header) => header.1 = value,
                None => headers.push((name, value)),
            }
        }
        Ok(RawHeaders(headers))
    }
}

/// Retries and dead letters. A subscriber's own fields win over the top-level ones.
#[derive(Debug, Clone, Default)]
#[cfg_attr(test, derive(Deserialize), serde(deny_unknown_fields))]
#[cfg_attr(feature = "serialize", derive(PartialEq, serde::Serialize))]
pub struct RawDelivery {
    #[cfg_attr(feature = "serialize", serde(skip_serializing_if = "Option::is_none"))]
    pub retry: Option<u32>,
    #[cfg_attr(
        feature = "serialize",
        serde(
            skip_serializing_if = "Option::is_none",
            serialize_with = "write::policy"
        )
    )]
    pub backoff_policy: Option<BackoffPolicy>,
    #[cfg_attr(feature = "serialize", serde(skip_serializing_if = "Option::is_none"))]
    pub backoff_delay_ms: Option<u32>,
    #[cfg_attr(feature = "serialize", serde(skip_serializing_if = "Option::is_none"))]
    pub backoff_max_ms: Option<u32>,
    #[cfg_attr(feature = "serialize", serde(skip_serializing_if = "Option::is_none"))]
    pub backoff_jitter: Option<f64>,
    #[cfg_attr(feature = "serialize", serde(skip_serializing_if = "Option::is_none"))]
    pub dead_letter: Option<RawTarget>,
    /// `binary`, `structured` or `json`: the content mode the subscriber gets.
    #[cfg_attr(feature = "serialize", serde(skip_serializing_if = "Option::is_none"))]
    pub format: Option<String>,
}

/// Whether the 202/500 answer waits for the deliveries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(test, derive(Deserialize), serde(rename_all = "lowercase"))]
pub enum AnswerMode {
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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(test, derive(Deserialize), serde(rename_all = "lowercase"))]
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
    /// Shared with the fan-outs delivering to them (each holds its channel).
    pub channels: Vec<Rc<Channel>>,
    pub router: Router,
    /// Whether to count requests and calls in Envoy's stats (default true).
    pub metrics: bool,
    pub body_wait: BodyWait,
    pub mode: AnswerMode,
    pub report: ReportDetail,
    /// Async mode: events one worker holds at once; past it a request gets 503.
    pub max_in_flight: usize,
    /// Every cluster whose subscribers have `max_concurrent_calls`, with its cap (one per
    /// cluster: its subscribers share it), for [`crate::call_slots::CallSlots::set_caps`].
    pub call_caps: Vec<(String, CallCap)>,
    /// Some subscriber retries, dead-letters or replies: the root context's timer is needed.
    pub needs_timer: bool,
    /// Things that are valid but probably not what the user wants, for configure() to log.
    pub warnings: Vec<String>,
    /// Redelivery without duplicates (`None`: off).
    pub dedupe: Option<DedupeConfig>,
    /// A request that is not a valid CloudEvent gets 400 (default false: anything is fanned
    /// out).
    pub require_cloudevents: bool,
    /// Spans exported over OTLP (`None`: off).
    pub tracing: Option<TracingConfig>,
}

/// A set of subscribers reached through the hosts that name the channel.
#[derive(Debug)]
pub struct Channel {
    pub name: String,
    pub subscribers: Vec<Subscriber>,
    /// Some subscriber has a filter: only then are a request's CloudEvents attributes read
    /// (and a structured body parsed).
    pub filtered: bool,
    /// Some subscriber has a `delivery.format`: only then is the event converted (once per
    /// request, `format.rs`).
    pub converts: bool,
}

impl Channel {
    /// Every subscriber is best-effort: the channel answers 202 at once, like async mode.
    pub fn all_best_effort(&self) -> bool {
        !self.subscribers.is_empty() && self.subscribers.iter().all(|s| !s.required)
    }
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
    /// Its identity in `dedupe`'s records (see `config/dedupe.rs`'s `subscriber_ids`).
    pub dedupe_id: u64,
    /// `delivery.backoff_jitter`: how much its retry waits are spread.
    pub backoff_jitter: Jitter,
    /// `false`: best-effort; the sender's answer does not depend on it, and its calls go out
    /// from the root context.
    pub required: bool,
    /// `max_concurrent_calls` and `max_queued_calls` of its cluster (`None`: no cap).
    pub call_cap: Option<CallCap>,
    /// `delivery.format`: the content mode it gets (`None`: the event as it came).
    pub format: Option<Format>,
    /// Its delivery span's destination attributes (`tracing`), encoded once.
    pub span_destination: crate::trace::DestinationFields,
    /// Where its calls are counted (with `metrics`), fixed by the plugin at configure time.
    pub stats: LegStats,
}

/// Where a subscriber's calls are counted in its worker's tally, for each leg: the index of
/// the cluster each leg calls (`metrics::Tally::cluster`), fixed once by the plugin when it
/// configures, so that counting a call looks up no name. `usize::MAX` (the default): not
/// fixed, nothing is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LegStats {
    /// The subscriber's own cluster: its event's calls, retries, dead letters, skips.
    pub event: usize,
    pub reply: usize,
    pub dead_letter: usize,
}

impl Default for LegStats {
    fn default() -> Self {
        LegStats {
            event: usize::MAX,
            reply: usize::MAX,
            dead_letter: usize::MAX,
        }
    }
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

impl Target {
    /// Its delivery span's destination attributes (`tracing`), encoded.
    fn span_destination(&self) -> crate::trace::DestinationFields {
        crate::trace::DestinationFields::new(&self.cluster, &self.authority, &self.path)
    }
}

impl Subscriber {
    /// Does it want the event with these attributes (`None`: the request is not a
    /// CloudEvent, or the channel has no filters and nobody looked)?
    pub fn accepts(&self, event: Option<&Attributes>) -> bool {
        event_filter::accepts(self.filter.as_ref(), event)
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
        let raw: RawConfig = read::config(bytes).map_err(|e| match e {
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

    pub fn channel(&self, index: usize) -> Option<&Rc<Channel>> {
        self.channels.get(index)
    }
}

#[cfg(test)]
mod served_corpus;
#[cfg(test)]
mod tests;
