//! The validation of the JSON document into a [`Config`]: one function per part, each
//! error naming the field's path. Everything a request needs that can be worked out once is
//! worked out here: the call headers of every target, the routing table, the retry
//! policies, the filters, the subscribers' dedupe identities.

use std::rc::Rc;
use std::time::Duration;

use super::dedupe::subscriber_ids;
use super::{
    AnswerMode, Channel, Config, ConfigError, LegStats, RawChannel, RawConfig, RawDedupe,
    RawDelivery, RawSubscriber, RawTarget, Subscriber, Target, DEFAULT_FORWARD_HEADERS,
    DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_IN_FLIGHT, DEFAULT_TIMEOUT_MS, OPTIONS, SUBSCRIBER_METHOD,
    SYNC_DEADLINE_WARNING_MS,
};
use crate::call_slots::{CallCap, DEFAULT_MAX_QUEUED_CALLS};
use crate::cloudevents::REQUIRED_ATTRIBUTES;
use crate::event_filter::{self, Filter};
use crate::format::Format;
use crate::headers::{self, HeaderSelector};
use crate::jitter::Jitter;
use crate::retry::{RetryPolicy, DEFAULT_BACKOFF_DELAY_MS, DEFAULT_BACKOFF_MAX_MS, MAX_RETRY};
use crate::routing::Router;

impl RawDelivery {
    /// This subscriber's fields, falling back to the top level's.
    fn or(self, default: &RawDelivery) -> RawDelivery {
        RawDelivery {
            retry: self.retry.or(default.retry),
            backoff_policy: self.backoff_policy.or(default.backoff_policy),
            backoff_delay_ms: self.backoff_delay_ms.or(default.backoff_delay_ms),
            backoff_max_ms: self.backoff_max_ms.or(default.backoff_max_ms),
            backoff_jitter: self.backoff_jitter.or(default.backoff_jitter),
            dead_letter: self.dead_letter.or_else(|| default.dead_letter.clone()),
            format: self.format.or_else(|| default.format.clone()),
        }
    }

    /// `format`: `binary`, `structured`, or Knative's `json` for structured.
    fn format(&self, at: &str) -> Result<Option<Format>, ConfigError> {
        let Some(word) = &self.format else {
            return Ok(None);
        };
        Format::parse(word).map(Some).ok_or_else(|| {
            ConfigError::new(
                format!("{at}.format"),
                format!(
                    "{} is not a content mode: use \"binary\", \"structured\" or \"json\" \
                     (Knative's word for structured), or leave it out for the event as it came",
                    // Quoted as JSON without `serde_json::Value`'s serializer (bench/README.md: size).
                    serde_json::to_string(word).unwrap_or_default()
                ),
            )
        })
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

    fn jitter(&self, at: &str) -> Result<Jitter, ConfigError> {
        self.backoff_jitter.map_or(Ok(Jitter::NONE), |fraction| {
            Jitter::new(fraction)
                .map_err(|msg| ConfigError::new(format!("{at}.backoff_jitter"), msg))
        })
    }
}

impl RawConfig {
    /// Every field in the order the document names them, so that the first error a user
    /// meets is the first in their file.
    pub(super) fn validate(self) -> Result<Config, ConfigError> {
        let default_timeout = match self.timeout_ms {
            Some(ms) => timeout("timeout_ms", ms)?,
            None => Duration::from_millis(u64::from(DEFAULT_TIMEOUT_MS)),
        };
        let methods = match self.methods {
            Some(methods) => validate_methods(methods)?,
            None => vec![SUBSCRIBER_METHOD.to_string()],
        };
        let forward = forward_headers(self.forward_headers)?;
        let (raw_channels, shorthand) = channel_list(self.channels, self.subscribers)?;
        let mut defaults = Defaults::validate(self.delivery, self.reply, default_timeout)?;
        if self.max_concurrent_calls == Some(0) {
            return Err(ConfigError::new("max_concurrent_calls", NO_CALLS));
        }
        defaults.max_concurrent_calls = self.max_concurrent_calls;
        defaults.max_queued_calls = self.max_queued_calls;
        let max_in_flight = max_in_flight(self.max_in_flight)?;
        let (channels, router) = channels(raw_channels, shorthand, default_timeout, &defaults)?;
        let call_caps = call_caps(&channels, shorthand)?;
        converted_headers_forwarded(&forward, &channels, shorthand)?;
        if self.max_queued_calls.is_some() && call_caps.is_empty() {
            return Err(ConfigError::new("max_queued_calls", QUEUE_WITHOUT_CAP));
        }
        let warnings = sync_warnings(self.mode, &channels);
        let needs_timer = needs_timer(!call_caps.is_empty(), self.mode, &channels);
        let dedupe = self
            .dedupe
            .map(RawDedupe::validate)
            .transpose()
            .map_err(|e| ConfigError::new(e.path, e.message))?;

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
            call_caps,
            needs_timer,
            warnings,
            dedupe,
            require_cloudevents: self.require_cloudevents.unwrap_or(false),
            tracing: self
                .tracing
                .map(super::tracing::RawTracing::validate)
                .transpose()?,
        })
    }
}

/// The headers a `delivery.format` conversion reads (the event's content type and its
/// required attributes) must be forwarded: it converts the forwarded headers.
fn converted_headers_forwarded(
    forward: &HeaderSelector,
    channels: &[Rc<Channel>],
    shorthand: bool,
) -> Result<(), ConfigError> {
    let missing = std::iter::once("content-type".to_string())
        .chain(REQUIRED_ATTRIBUTES.iter().map(|name| format!("ce-{name}")))
        .find(|header| !forward.selects(header));
    let Some(missing) = missing else {
        return Ok(());
    };
    for (c, channel) in channels.iter().enumerate() {
        if let Some(s) = channel.subscribers.iter().position(|s| s.format.is_some()) {
            let at = if shorthand {
                format!("subscribers[{s}]")
            } else {
                format!("channels[{c}].subscribers[{s}]")
            };
            return Err(ConfigError::new(
                "forward_headers",
                format!(
                    "does not forward {missing}, which {at} needs for its delivery.format: the \
                     conversion reads the forwarded content-type and ce-* headers (add \"ce-*\" \
                     and \"content-type\")"
                ),
            ));
        }
    }
    Ok(())
}

fn forward_headers(list: Option<Vec<String>>) -> Result<HeaderSelector, ConfigError> {
    match list {
        Some(list) => HeaderSelector::new(&list),
        None => HeaderSelector::new(DEFAULT_FORWARD_HEADERS),
    }
    .map_err(|(i, msg)| ConfigError::new(format!("forward_headers[{i}]"), msg))
}

/// `channels`, or the `subscribers` shorthand as one channel for every host (then `true`:
/// the shorthand's errors say `subscribers[i]`, a channel's `channels[c].subscribers[i]`).
fn channel_list(
    channels: Option<Vec<RawChannel>>,
    subscribers: Option<Vec<RawSubscriber>>,
) -> Result<(Vec<RawChannel>, bool), ConfigError> {
    match (channels, subscribers) {
        (Some(_), Some(_)) => Err(ConfigError::new(
            "subscribers",
            "cannot be used together with `channels`: top-level `subscribers` is the \
             shorthand for one channel that matches every host",
        )),
        (Some(channels), None) => Ok((channels, false)),
        (None, Some(subscribers)) => Ok((
            vec![RawChannel {
                name: Some("default".to_string()),
                hosts: Some(vec!["*".to_string()]),
                subscribers,
            }],
            true,
        )),
        (None, None) => Err(ConfigError::new(
            "",
            "no channels: give `channels` (a list of channels, each with hosts and \
             subscribers) or `subscribers` (one channel for every host)",
        )),
    }
}

fn max_in_flight(max: Option<u32>) -> Result<usize, ConfigError> {
    match max {
        Some(0) => Err(ConfigError::new(
            "max_in_flight",
            "must be at least 1 (events one worker holds at once in async mode)",
        )),
        Some(n) => Ok(n as usize),
        None => Ok(DEFAULT_MAX_IN_FLIGHT as usize),
    }
}

/// Whether the root context needs its timer: it sends the calls that waited for a slot
/// (`capped`), the best-effort subscribers' calls, what async mode answers before, and every
/// follow-up (retries, replies, dead letters). The etcd store's timer is the plugin's to tune:
/// fast only while it owes something.
fn needs_timer(capped: bool, mode: AnswerMode, channels: &[Rc<Channel>]) -> bool {
    capped
        || mode == AnswerMode::Async
        || channels
            .iter()
            .flat_map(|c| &c.subscribers)
            .any(|s| s.has_follow_ups() || !s.required)
}

/// Every channel, and the host routing table that leads to them.
fn channels(
    raw_channels: Vec<RawChannel>,
    shorthand: bool,
    default_timeout: Duration,
    defaults: &Defaults,
) -> Result<(Vec<Rc<Channel>>, Router), ConfigError> {
    let mut router = Router::default();
    let mut channels = Vec::with_capacity(raw_channels.len());
    for (c, raw) in raw_channels.into_iter().enumerate() {
        let at = if shorthand {
            String::new()
        } else {
            format!("channels[{c}].")
        };
        let name = channel_name(raw.name, c, &at, &channels)?;
        route_hosts(raw.hosts, c, &at, &mut router)?;
        let mut subscribers = Vec::with_capacity(raw.subscribers.len());
        for (s, sub) in raw.subscribers.into_iter().enumerate() {
            subscribers.push(sub.validate(
                &format!("{at}subscribers[{s}]"),
                default_timeout,
                defaults,
            )?);
        }
        let ids = subscriber_ids(
            subscribers
                .iter()
                .map(|s| (s.cluster.as_str(), s.call_headers.as_slice())),
        );
        for (sub, id) in subscribers.iter_mut().zip(ids) {
            sub.dedupe_id = id;
        }
        let filtered = subscribers.iter().any(|s| s.filter.is_some());
        let converts = subscribers.iter().any(|s| s.format.is_some());
        channels.push(Rc::new(Channel {
            name,
            subscribers,
            filtered,
            converts,
        }));
    }
    Ok((channels, router))
}

/// Channel `c`'s name: its own, not empty and not that of an earlier channel, or
/// `channels[c]`.
fn channel_name(
    name: Option<String>,
    c: usize,
    at: &str,
    channels: &[Rc<Channel>],
) -> Result<String, ConfigError> {
    let name = match name {
        Some(name) if name.trim().is_empty() => {
            return Err(ConfigError::new(
                format!("{at}name"),
                "must not be empty (leave it out for a default name)",
            ))
        }
        Some(name) => name,
        None => format!("channels[{c}]"),
    };
    if let Some(other) = channels.iter().position(|ch| ch.name == name) {
        return Err(ConfigError::new(
            format!("{at}name"),
            format!("\"{name}\" is already the name of channels[{other}]"),
        ));
    }
    Ok(name)
}

/// Channel `c`'s hosts (every host when it names none) into the `router`.
fn route_hosts(
    hosts: Option<Vec<String>>,
    c: usize,
    at: &str,
    router: &mut Router,
) -> Result<(), ConfigError> {
    let hosts = hosts.unwrap_or_else(|| vec!["*".to_string()]);
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
    Ok(())
}

/// Valid, but probably not what the user wants: a sync delivery that can outlast Envoy's
/// default stream idle timeout.
fn sync_warnings(mode: AnswerMode, channels: &[Rc<Channel>]) -> Vec<String> {
    let mut warnings = Vec::new();
    if mode != AnswerMode::Sync {
        return warnings;
    }
    for channel in channels {
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
    warnings
}

impl RawTarget {
    pub(super) fn validate(
        self,
        at: &str,
        default_timeout: Duration,
    ) -> Result<Target, ConfigError> {
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

        let mut call_headers = Vec::with_capacity(3 + self.headers.0.len());
        call_headers.push((":method".to_string(), SUBSCRIBER_METHOD.to_string()));
        call_headers.push((":path".to_string(), path.clone()));
        call_headers.push((":authority".to_string(), authority.clone()));
        for (name, value) in self.headers.0 {
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
    max_concurrent_calls: Option<u32>,
    max_queued_calls: Option<u32>,
}

impl Defaults {
    /// The top-level ones are checked once, by name, even when every subscriber has its own.
    fn validate(
        delivery: Option<RawDelivery>,
        reply: Option<RawTarget>,
        default_timeout: Duration,
    ) -> Result<Defaults, ConfigError> {
        let defaults = Defaults {
            delivery: delivery.unwrap_or_default(),
            reply,
            max_concurrent_calls: None,
            max_queued_calls: None,
        };
        defaults.delivery.policy("delivery")?;
        defaults.delivery.jitter("delivery")?;
        defaults.delivery.format("delivery")?;
        if let Some(dlq) = &defaults.delivery.dead_letter {
            dlq.clone()
                .validate("delivery.dead_letter", default_timeout)?;
        }
        if let Some(reply) = &defaults.reply {
            reply.clone().validate("reply", default_timeout)?;
        }
        Ok(defaults)
    }
}

impl RawSubscriber {
    /// Its filter, from `filters` or the legacy `filter`, compiled.
    fn filter(&self, at: &str) -> Result<Option<Filter>, ConfigError> {
        match (&self.filters, &self.filter) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::new(
                    format!("{at}.filter"),
                    "cannot be used together with `filters`: put its attributes in `filters` \
                     as `exact` filters",
                ))
            }
            (Some(list), None) => event_filter::compile_list(list),
            (None, Some(legacy)) => event_filter::compile_legacy(legacy),
            (None, None) => Ok(None),
        }
        .map_err(|e| ConfigError::new(format!("{at}.{}", e.path), e.message))
    }

    fn validate(
        self,
        at: &str,
        default_timeout: Duration,
        defaults: &Defaults,
    ) -> Result<Subscriber, ConfigError> {
        let filter = self.filter(at)?;
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
        let backoff_jitter = delivery.jitter(&delivery_at)?;
        // A top-level word that is wrong was refused by name already.
        let format = delivery.format(&delivery_at)?;
        let call_cap = call_cap(
            at,
            self.max_concurrent_calls,
            self.max_queued_calls,
            defaults,
        )?;
        let dead_letter = delivery
            .dead_letter
            .map(|dlq| dlq.validate(&format!("{delivery_at}.dead_letter"), default_timeout))
            .transpose()?;
        let reply = match (self.reply, &defaults.reply) {
            (Some(reply), _) => Some(reply.validate(&format!("{at}.reply"), default_timeout)?),
            (None, Some(reply)) => Some(reply.clone().validate("reply", default_timeout)?),
            (None, None) => None,
        };
        Ok(Subscriber {
            span_destination: target.span_destination(),
            cluster: target.cluster,
            authority: target.authority,
            path: target.path,
            timeout: target.timeout,
            call_headers: target.call_headers,
            retry,
            dead_letter,
            reply,
            filter,
            dedupe_id: 0, // set with its channel's others: an identity depends on its duplicates
            backoff_jitter,
            required: self.required.unwrap_or(true),
            call_cap,
            format,
            stats: LegStats::default(),
        })
    }
}

const NO_CALLS: &str = "must be at least 1 (calls in flight to one subscriber on one Envoy \
                        worker); leave it out for no cap";
const QUEUE_WITHOUT_CAP: &str = "has no effect without max_concurrent_calls: it bounds the \
                                 calls waiting for a free one; set max_concurrent_calls too, \
                                 or leave it out";

/// A subscriber's cap: its own fields, else the top-level ones.
fn call_cap(
    at: &str,
    max_concurrent_calls: Option<u32>,
    max_queued_calls: Option<u32>,
    defaults: &Defaults,
) -> Result<Option<CallCap>, ConfigError> {
    if max_concurrent_calls == Some(0) {
        return Err(ConfigError::new(
            format!("{at}.max_concurrent_calls"),
            NO_CALLS,
        ));
    }
    let Some(max_concurrent_calls) = max_concurrent_calls.or(defaults.max_concurrent_calls) else {
        return match max_queued_calls {
            Some(_) => Err(ConfigError::new(
                format!("{at}.max_queued_calls"),
                QUEUE_WITHOUT_CAP,
            )),
            None => Ok(None),
        };
    };
    Ok(Some(CallCap {
        max_concurrent_calls,
        max_queued_calls: max_queued_calls
            .or(defaults.max_queued_calls)
            .unwrap_or(DEFAULT_MAX_QUEUED_CALLS),
    }))
}

/// The cap of every capped cluster, once per cluster in the order they first appear; two
/// subscribers of one cluster with different caps are refused (the cap is the cluster's).
fn call_caps(
    channels: &[Rc<Channel>],
    shorthand: bool,
) -> Result<Vec<(String, CallCap)>, ConfigError> {
    // Each cluster's first subscriber: a list, as clusters are few (a map costs module size).
    let mut first: Vec<(&str, Option<CallCap>, String)> = Vec::new();
    let mut caps = Vec::new();
    for (c, channel) in channels.iter().enumerate() {
        for (s, sub) in channel.subscribers.iter().enumerate() {
            let at = if shorthand {
                format!("subscribers[{s}]")
            } else {
                format!("channels[{c}].subscribers[{s}]")
            };
            match first.iter().find(|(cluster, ..)| *cluster == sub.cluster) {
                Some((_, cap, first_at)) if *cap != sub.call_cap => {
                    return Err(cap_conflict(&at, sub, *cap, first_at));
                }
                Some(_) => {}
                None => {
                    if let Some(cap) = sub.call_cap {
                        caps.push((sub.cluster.clone(), cap));
                    }
                    first.push((&sub.cluster, sub.call_cap, at));
                }
            }
        }
    }
    Ok(caps)
}

/// Two subscribers of one cluster with different caps: the cap is the cluster's.
fn cap_conflict(
    at: &str,
    sub: &Subscriber,
    first_cap: Option<CallCap>,
    first_at: &str,
) -> ConfigError {
    let describe = |cap: Option<CallCap>| match cap {
        Some(cap) => format!(
            "max_concurrent_calls {} and max_queued_calls {}",
            cap.max_concurrent_calls, cap.max_queued_calls
        ),
        None => "no max_concurrent_calls".to_string(),
    };
    let field = match (first_cap, sub.call_cap) {
        (Some(a), Some(b)) if a.max_concurrent_calls == b.max_concurrent_calls => {
            "max_queued_calls"
        }
        _ => "max_concurrent_calls",
    };
    ConfigError::new(
        format!("{at}.{field}"),
        format!(
            "cluster \"{}\" has {} here but {} in {first_at}: the subscribers of one cluster \
             share its cap, give them the same values",
            sub.cluster,
            describe(sub.call_cap),
            describe(first_cap)
        ),
    )
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
