//! The configuration's raw types read from the JSON tree ([`json_path::At`]), by hand: what
//! serde's derived readers did (`deny_unknown_fields`, `Option` fields `null` or absent,
//! `#[serde(default)]`, unit enums in lower case), with their messages, at the same paths.
//! The derived readers are built for the tests only, as the reference this reader is checked
//! against (json_path's tests read ~1,500 variants both ways).
//!
//! Each struct's field list is in its declaration order, as serde lists them in "unknown
//! field `x`, expected one of ...".

use super::dedupe::{OnStoreError, RawEtcd, RawStore};
use super::json_path::{self, At, PathError, ReadError};
use super::{
    AnswerMode, BodyWait, RawChannel, RawConfig, RawDedupe, RawDelivery, RawHeaders, RawSubscriber,
    RawTarget, ReportDetail,
};
use crate::json::Node;
use crate::retry::BackoffPolicy;

/// The plugin configuration from its JSON text.
pub(super) fn config(bytes: &[u8]) -> Result<RawConfig, ReadError> {
    json_path::read(bytes, RawConfig::read)
}

const CONFIG_FIELDS: &[&str] = &[
    "timeout_ms",
    "max_body_bytes",
    "methods",
    "forward_headers",
    "channels",
    "subscribers",
    "metrics",
    "body_wait",
    "delivery",
    "reply",
    "mode",
    "max_in_flight",
    "max_concurrent_calls",
    "max_queued_calls",
    "report",
    "dedupe",
    "require_cloudevents",
    "tracing",
];

impl RawConfig {
    fn read(at: At) -> Result<RawConfig, PathError> {
        at.fields(
            "struct RawConfig",
            CONFIG_FIELDS,
            |raw: &mut RawConfig, name, at| {
                match name {
                    "timeout_ms" => raw.timeout_ms = at.option(At::u32)?,
                    "max_body_bytes" => raw.max_body_bytes = at.option(At::u64)?,
                    "methods" => raw.methods = at.option(strings)?,
                    "forward_headers" => raw.forward_headers = at.option(strings)?,
                    "channels" => raw.channels = at.option(|at| at.list(RawChannel::read))?,
                    "subscribers" => {
                        raw.subscribers = at.option(|at| at.list(RawSubscriber::read))?
                    }
                    "metrics" => raw.metrics = at.option(At::bool)?,
                    "body_wait" => raw.body_wait = body_wait(at)?,
                    "delivery" => raw.delivery = at.option(RawDelivery::read)?,
                    "reply" => raw.reply = at.option(RawTarget::read)?,
                    "mode" => raw.mode = mode(at)?,
                    "max_in_flight" => raw.max_in_flight = at.option(At::u32)?,
                    "max_concurrent_calls" => raw.max_concurrent_calls = at.option(At::u32)?,
                    "max_queued_calls" => raw.max_queued_calls = at.option(At::u32)?,
                    "report" => raw.report = report(at)?,
                    "dedupe" => raw.dedupe = at.option(RawDedupe::read)?,
                    "require_cloudevents" => raw.require_cloudevents = at.option(At::bool)?,
                    "tracing" => raw.tracing = at.option(super::tracing::RawTracing::read)?,
                    _ => {}
                }
                Ok(())
            },
        )
    }
}

impl RawDedupe {
    fn read(at: At) -> Result<RawDedupe, PathError> {
        at.fields(
            "struct RawDedupe",
            &["key", "ttl_ms", "max_entries", "store", "on_store_error"],
            |raw: &mut RawDedupe, name, at| {
                match name {
                    "key" => raw.key = at.option(At::string)?,
                    "ttl_ms" => raw.ttl_ms = at.option(At::u64)?,
                    "max_entries" => raw.max_entries = at.option(At::u32)?,
                    "store" => raw.store = at.option(read_store)?,
                    "on_store_error" => {
                        raw.on_store_error = at.option(|at| {
                            at.variant(
                                "enum OnStoreError",
                                &["deliver", "reject"],
                                &[OnStoreError::Deliver, OnStoreError::Reject],
                            )
                        })?
                    }
                    _ => {}
                }
                Ok(())
            },
        )
    }
}

/// `"envoy"`, or `{"etcd": {...}}`: serde's externally tagged enum. (Its errors are worded
/// here: serde's `Unexpected` would bring float formatting into the module.)
fn read_store(at: At) -> Result<RawStore, PathError> {
    const VARIANTS: &[&str] = &["envoy", "etcd"];
    let custom = |message: &str| at.fail(<serde_json::Error as serde::de::Error>::custom(message));
    if matches!(at.node(), Node::Str(_)) {
        return match at.variant("enum RawStore", VARIANTS, &[0u8, 1])? {
            0 => Ok(RawStore::Envoy),
            _ => Err(custom(
                "the etcd store needs its settings: {\"etcd\": {\"cluster\": ...}}",
            )),
        };
    }
    let mut store = None;
    at.object("enum RawStore", VARIANTS, &mut |name, at| {
        store = Some(match name {
            "etcd" => RawStore::Etcd(RawEtcd::read(at)?),
            _ => RawStore::Envoy,
        });
        Ok(())
    })?;
    store.ok_or_else(|| custom("expected \"envoy\" or {\"etcd\": {...}}"))
}

impl RawEtcd {
    fn read(at: At) -> Result<RawEtcd, PathError> {
        at.fields(
            "struct RawEtcd",
            &["cluster", "prefix", "timeout_ms"],
            |raw: &mut RawEtcd, name, at| {
                match name {
                    "cluster" => raw.cluster = at.option(At::string)?,
                    "prefix" => raw.prefix = at.option(At::string)?,
                    "timeout_ms" => raw.timeout_ms = at.option(At::u32)?,
                    _ => {}
                }
                Ok(())
            },
        )
    }
}

impl RawChannel {
    fn read(at: At) -> Result<RawChannel, PathError> {
        at.fields(
            "struct RawChannel",
            &["name", "hosts", "subscribers"],
            |raw: &mut RawChannel, name, at| {
                match name {
                    "name" => raw.name = at.option(At::string)?,
                    "hosts" => raw.hosts = at.option(strings)?,
                    "subscribers" => raw.subscribers = at.list(RawSubscriber::read)?,
                    _ => {}
                }
                Ok(())
            },
        )
    }
}

const SUBSCRIBER_FIELDS: &[&str] = &[
    "cluster",
    "authority",
    "path",
    "timeout_ms",
    "headers",
    "delivery",
    "reply",
    "filters",
    "filter",
    "required",
    "max_concurrent_calls",
    "max_queued_calls",
];

impl RawSubscriber {
    fn read(at: At) -> Result<RawSubscriber, PathError> {
        let mut cluster = None;
        let mut raw = at.fields(
            "struct RawSubscriber",
            SUBSCRIBER_FIELDS,
            |raw: &mut RawSubscriber, name, at| {
                match name {
                    "cluster" => cluster = Some(at.string()?),
                    "authority" => raw.authority = at.option(At::string)?,
                    "path" => raw.path = at.option(At::string)?,
                    "timeout_ms" => raw.timeout_ms = at.option(At::u32)?,
                    "headers" => raw.headers = RawHeaders::read(at)?,
                    "delivery" => raw.delivery = at.option(RawDelivery::read)?,
                    "reply" => raw.reply = at.option(RawTarget::read)?,
                    "filters" => {
                        raw.filters = at.option(|at| at.list(|at| Ok(at.node().clone())))?
                    }
                    "filter" => raw.filter = at.option(|at| Ok(at.node().clone()))?,
                    "required" => raw.required = at.option(At::bool)?,
                    "max_concurrent_calls" => raw.max_concurrent_calls = at.option(At::u32)?,
                    "max_queued_calls" => raw.max_queued_calls = at.option(At::u32)?,
                    _ => {}
                }
                Ok(())
            },
        )?;
        raw.cluster = cluster.ok_or_else(|| at.missing("cluster"))?;
        Ok(raw)
    }
}

impl RawTarget {
    pub(super) fn read(at: At) -> Result<RawTarget, PathError> {
        let mut cluster = None;
        let mut raw = at.fields(
            "struct RawTarget",
            &["cluster", "authority", "path", "timeout_ms", "headers"],
            |raw: &mut RawTarget, name, at| {
                match name {
                    "cluster" => cluster = Some(at.string()?),
                    "authority" => raw.authority = at.option(At::string)?,
                    "path" => raw.path = at.option(At::string)?,
                    "timeout_ms" => raw.timeout_ms = at.option(At::u32)?,
                    "headers" => raw.headers = RawHeaders::read(at)?,
                    _ => {}
                }
                Ok(())
            },
        )?;
        raw.cluster = cluster.ok_or_else(|| at.missing("cluster"))?;
        Ok(raw)
    }
}

impl RawHeaders {
    /// A name given twice keeps its last value, as a map would.
    pub(super) fn read(at: At) -> Result<RawHeaders, PathError> {
        let mut headers: Vec<(String, String)> = Vec::new();
        at.map("a map", &mut |name, at| {
            let value = at.string()?;
            match headers.iter_mut().find(|(n, _)| n == name) {
                Some(header) => header.1 = value,
                None => headers.push((name.to_string(), value)),
            }
            Ok(())
        })?;
        Ok(RawHeaders(headers))
    }
}

const DELIVERY_FIELDS: &[&str] = &[
    "retry",
    "backoff_policy",
    "backoff_delay_ms",
    "backoff_max_ms",
    "backoff_jitter",
    "dead_letter",
    "format",
];

impl RawDelivery {
    fn read(at: At) -> Result<RawDelivery, PathError> {
        at.fields(
            "struct RawDelivery",
            DELIVERY_FIELDS,
            |raw: &mut RawDelivery, name, at| {
                match name {
                    "retry" => raw.retry = at.option(At::u32)?,
                    "backoff_policy" => raw.backoff_policy = at.option(backoff_policy)?,
                    "backoff_delay_ms" => raw.backoff_delay_ms = at.option(At::u32)?,
                    "backoff_max_ms" => raw.backoff_max_ms = at.option(At::u32)?,
                    "backoff_jitter" => raw.backoff_jitter = at.option(At::f64)?,
                    "dead_letter" => raw.dead_letter = at.option(RawTarget::read)?,
                    "format" => raw.format = at.option(At::string)?,
                    _ => {}
                }
                Ok(())
            },
        )
    }
}

fn strings(at: At) -> Result<Vec<String>, PathError> {
    at.list(|at| at.string())
}

fn body_wait(at: At) -> Result<BodyWait, PathError> {
    at.variant(
        "enum BodyWait",
        &["pause", "continue"],
        &[BodyWait::Pause, BodyWait::Continue],
    )
}

fn mode(at: At) -> Result<AnswerMode, PathError> {
    at.variant(
        "enum AnswerMode",
        &["sync", "async"],
        &[AnswerMode::Sync, AnswerMode::Async],
    )
}

fn report(at: At) -> Result<ReportDetail, PathError> {
    at.variant(
        "enum ReportDetail",
        &["failures", "full"],
        &[ReportDetail::Failures, ReportDetail::Full],
    )
}

fn backoff_policy(at: At) -> Result<BackoffPolicy, PathError> {
    at.variant(
        "enum BackoffPolicy",
        &["linear", "exponential"],
        &[BackoffPolicy::Linear, BackoffPolicy::Exponential],
    )
}
