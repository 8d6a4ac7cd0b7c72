//! The `tracing` settings: where spans go (an OTLP/HTTP collector behind an Envoy cluster,
//! a call target like a dead letter), how many requests without a `traceparent` are traced,
//! the resource the spans are exported under, and the exporter's limits. Off when absent.
//!
//! ```json
//! "tracing": {"collector": {"cluster": "otel-collector"}, "sampling_ratio": 0.1,
//!             "resource": {"deployment.environment": "prod"}}
//! ```

use std::time::Duration;

#[cfg(test)]
use serde::Deserialize;

use super::json_path::{At, PathError};
use super::{ConfigError, RawHeaders, RawTarget};
use crate::trace::export::ExportSettings;
use crate::trace::otlp::{KeyValue, Value};

/// `tracing`, field for field.
#[derive(Debug, Default)]
#[cfg_attr(test, derive(Deserialize), serde(deny_unknown_fields))]
pub(super) struct RawTracing {
    collector: Option<RawTarget>,
    sampling_ratio: Option<f64>,
    #[cfg_attr(test, serde(default))]
    resource: RawHeaders,
    max_queue_spans: Option<u32>,
    max_batch_spans: Option<u32>,
    max_batch_delay_ms: Option<u32>,
}

/// The validated `tracing`.
#[derive(Debug, Clone, PartialEq)]
pub struct TracingConfig {
    /// The share of requests without a (valid) `traceparent` that are traced, 0 to 1.
    pub sampling_ratio: f64,
    pub export: ExportSettings,
}

/// OTLP/HTTP's path for traces.
pub const DEFAULT_TRACES_PATH: &str = "/v1/traces";
pub const DEFAULT_EXPORT_TIMEOUT_MS: u64 = 5_000;
/// OpenTelemetry's batch span processor's defaults (`OTEL_BSP_*`), but a shorter delay: one
/// second between a delivery and its spans is what an operator watching a trace expects.
pub const DEFAULT_MAX_QUEUE_SPANS: u32 = 2048;
pub const DEFAULT_MAX_BATCH_SPANS: u32 = 512;
pub const DEFAULT_MAX_BATCH_DELAY_MS: u32 = 1_000;
/// Spans one VM may hold: each is a few hundred bytes.
pub const MAX_QUEUE_SPANS_LIMIT: u32 = 100_000;

const FIELDS: &[&str] = &[
    "collector",
    "sampling_ratio",
    "resource",
    "max_queue_spans",
    "max_batch_spans",
    "max_batch_delay_ms",
];

impl RawTracing {
    pub(super) fn read(at: At) -> Result<RawTracing, PathError> {
        at.fields(
            "struct RawTracing",
            FIELDS,
            |raw: &mut RawTracing, name, at| {
                match name {
                    "collector" => raw.collector = at.option(RawTarget::read)?,
                    "sampling_ratio" => raw.sampling_ratio = at.option(At::f64)?,
                    "resource" => raw.resource = RawHeaders::read(at)?,
                    "max_queue_spans" => raw.max_queue_spans = at.option(At::u32)?,
                    "max_batch_spans" => raw.max_batch_spans = at.option(At::u32)?,
                    "max_batch_delay_ms" => raw.max_batch_delay_ms = at.option(At::u32)?,
                    _ => {}
                }
                Ok(())
            },
        )
    }

    pub(super) fn validate(self) -> Result<TracingConfig, ConfigError> {
        let Some(mut collector) = self.collector else {
            return Err(ConfigError::new(
                "tracing.collector",
                "required: the Envoy cluster of an OTLP/HTTP collector, e.g. {\"cluster\": \"otel-collector\"}",
            ));
        };
        collector
            .path
            .get_or_insert_with(|| DEFAULT_TRACES_PATH.into());
        let default_timeout = Duration::from_millis(DEFAULT_EXPORT_TIMEOUT_MS);
        let target = collector.validate("tracing.collector", default_timeout)?;
        let sampling_ratio = self.sampling_ratio.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&sampling_ratio) {
            return Err(ConfigError::new(
                "tracing.sampling_ratio",
                format!(
                    "must be from 0.0 (trace only requests whose sender sampled them) to 1.0 \
                     (every request), got {}",
                    crate::json::number_text(sampling_ratio)
                ),
            ));
        }
        let queue = limit(
            "max_queue_spans",
            self.max_queue_spans,
            DEFAULT_MAX_QUEUE_SPANS,
            MAX_QUEUE_SPANS_LIMIT,
        )?;
        let batch = limit(
            "max_batch_spans",
            self.max_batch_spans,
            DEFAULT_MAX_BATCH_SPANS.min(queue),
            queue,
        )?;
        let delay = limit(
            "max_batch_delay_ms",
            self.max_batch_delay_ms,
            DEFAULT_MAX_BATCH_DELAY_MS,
            60_000,
        )?;
        Ok(TracingConfig {
            sampling_ratio,
            export: ExportSettings {
                cluster: target.cluster,
                call_headers: target.call_headers,
                timeout_ms: u32::try_from(target.timeout.as_millis()).unwrap_or(u32::MAX),
                resource: resource(self.resource)?,
                max_queue_spans: queue as usize,
                max_batch_spans: batch as usize,
                max_delay_ms: u64::from(delay),
            },
        })
    }
}

/// `service.name` first (`fanout` unless given), then the others in document order.
fn resource(raw: RawHeaders) -> Result<Vec<KeyValue>, ConfigError> {
    let mut service = "fanout".to_string();
    let mut others = Vec::new();
    for (key, value) in raw.0 {
        if key.is_empty() {
            return Err(ConfigError::new(
                "tracing.resource",
                "an attribute's name must not be empty",
            ));
        }
        match key.as_str() {
            "service.name" => service = value,
            _ => others.push(KeyValue::new(key, Value::String(value))),
        }
    }
    others.insert(0, KeyValue::new("service.name", Value::String(service)));
    Ok(others)
}

fn limit(field: &str, value: Option<u32>, default: u32, max: u32) -> Result<u32, ConfigError> {
    let value = value.unwrap_or(default);
    if (1..=max).contains(&value) {
        Ok(value)
    } else {
        Err(ConfigError::new(
            format!("tracing.{field}"),
            format!("must be from 1 to {max}, got {value}"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;
    use crate::trace::otlp::{KeyValue, Value};

    fn tracing(json: &str) -> Result<super::TracingConfig, String> {
        let doc = format!("{{\"subscribers\": [{{\"cluster\": \"a\"}}], \"tracing\": {json}}}");
        match Config::from_json(doc.as_bytes()) {
            Ok(config) => Ok(config.tracing.expect("tracing on")),
            Err(e) => Err(e.to_string()),
        }
    }

    #[test]
    fn the_defaults() {
        let config = tracing(r#"{"collector": {"cluster": "otel"}}"#).unwrap();
        assert_eq!(config.sampling_ratio, 0.0);
        let export = &config.export;
        assert_eq!(export.cluster, "otel");
        let headers: Vec<(&str, &str)> = export
            .call_headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            headers,
            [
                (":method", "POST"),
                (":path", "/v1/traces"),
                (":authority", "otel")
            ]
        );
        assert_eq!(export.timeout_ms, 5000);
        assert_eq!(
            (
                export.max_queue_spans,
                export.max_batch_spans,
                export.max_delay_ms
            ),
            (2048, 512, 1000)
        );
        assert_eq!(
            export.resource,
            [KeyValue::new(
                "service.name",
                Value::String("fanout".into())
            )]
        );
        let off = Config::from_json(br#"{"subscribers": [{"cluster": "a"}]}"#).unwrap();
        assert_eq!(off.tracing, None);
    }

    #[test]
    fn every_field() {
        let config = tracing(
            r#"{"collector": {"cluster": "otel", "authority": "otel.svc:4318", "path": "/otlp/v1/traces",
                "timeout_ms": 250, "headers": {"x-api-key": "k"}},
                "sampling_ratio": 0.25, "resource": {"deployment.environment": "prod", "service.name": "bus"},
                "max_queue_spans": 100, "max_batch_spans": 10, "max_batch_delay_ms": 50}"#,
        )
        .unwrap();
        assert_eq!(config.sampling_ratio, 0.25);
        let export = &config.export;
        assert!(export
            .call_headers
            .contains(&(":authority".into(), "otel.svc:4318".into())));
        assert!(export
            .call_headers
            .contains(&(":path".into(), "/otlp/v1/traces".into())));
        assert!(export
            .call_headers
            .contains(&("x-api-key".into(), "k".into())));
        assert_eq!(export.timeout_ms, 250);
        let keys: Vec<&str> = export.resource.iter().map(|kv| kv.key.as_ref()).collect();
        assert_eq!(keys, ["service.name", "deployment.environment"]);
        assert_eq!(
            export.resource[0]
                .value
                .as_ref()
                .and_then(|v| v.value.clone()),
            Some(Value::String("bus".into()))
        );
        assert_eq!(
            (
                export.max_queue_spans,
                export.max_batch_spans,
                export.max_delay_ms
            ),
            (100, 10, 50)
        );
        // A queue smaller than the default batch makes the batch default to the queue.
        let small = tracing(r#"{"collector": {"cluster": "otel"}, "max_queue_spans": 8}"#).unwrap();
        assert_eq!(small.export.max_batch_spans, 8);
    }

    #[test]
    fn refused_with_the_fields_path() {
        let cases = [
            (r#"{}"#, "tracing.collector: required: the Envoy cluster of an OTLP/HTTP collector"),
            (r#"{"collector": {"cluster": ""}}"#, "tracing.collector.cluster: must not be empty"),
            (r#"{"collector": {"cluster": "o", "path": "v1"}}"#, "tracing.collector.path: must start with \"/\""),
            (r#"{"collector": {"cluster": "o", "timeout_ms": 0}}"#, "tracing.collector.timeout_ms:"),
            (r#"{"collector": {"cluster": "o", "headers": {":path": "/x"}}}"#, "tracing.collector.headers.:path:"),
            (r#"{"collector": {"cluster": "o"}, "sampling_ratio": 1.5}"#, "tracing.sampling_ratio: must be from 0.0 (trace only requests whose sender sampled them) to 1.0 (every request), got 1.5"),
            (r#"{"collector": {"cluster": "o"}, "sampling_ratio": -0.1}"#, "tracing.sampling_ratio: must be from 0.0"),
            (r#"{"collector": {"cluster": "o"}, "resource": {"": "x"}}"#, "tracing.resource: an attribute's name must not be empty"),
            (r#"{"collector": {"cluster": "o"}, "max_queue_spans": 0}"#, "tracing.max_queue_spans: must be from 1 to 100000, got 0"),
            (r#"{"collector": {"cluster": "o"}, "max_queue_spans": 10, "max_batch_spans": 11}"#, "tracing.max_batch_spans: must be from 1 to 10, got 11"),
            (r#"{"collector": {"cluster": "o"}, "max_batch_delay_ms": 60001}"#, "tracing.max_batch_delay_ms: must be from 1 to 60000, got 60001"),
            (r#"{"collector": {"cluster": "o"}, "sample": 1}"#, "tracing.sample: unknown field `sample`, expected one of `collector`, `sampling_ratio`"),
            (r#"{"collector": "o"}"#, "tracing.collector: invalid type: string \"o\", expected struct RawTarget"),
            (r#"{"collector": {"cluster": "o"}, "resource": {"a": 1}}"#, "tracing.resource.a: invalid type: integer `1`, expected a string"),
            (r#"[]"#, "tracing: invalid type: sequence, expected struct RawTracing"),
        ];
        for (json, want) in cases {
            let got = tracing(json).unwrap_err();
            assert!(got.starts_with(want), "{json}\n got: {got}\nwant: {want}");
        }
    }
}
