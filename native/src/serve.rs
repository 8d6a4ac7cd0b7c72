//! How the native build serves a configuration: every configuration the wasm build takes,
//! read and validated by the same code (`Config::from_json`), refused with the same errors.
//! Where it is served differs:
//! - on the workers, as the wasm build: a configuration whose work is all done while the
//!   sender waits (sync mode, required subscribers with their retries, call caps, replies
//!   and dead letters; the `envoy` dedupe store). Every call is the sender's stream's;
//! - by its own context on Envoy's main thread (the glue's hub) when it asks for work after
//!   the sender's answer, or for no sender ([`needs_hub`]): async mode, best-effort
//!   subscribers, the etcd store, `tracing`. Proxy-wasm gives the wasm build a root context
//!   per worker for that; Envoy's dynamic-module HTTP filter has one per configuration, on
//!   the main thread.

use fanout::config::{AnswerMode, Config, ConfigError, Store};

/// The plugin configuration `bytes` read and validated as the wasm build reads it: the
/// configuration, or the first reason it is refused (its path, and what to do).
pub fn configure(bytes: &[u8]) -> Result<Config, ConfigError> {
    Config::from_json(bytes)
}

/// Whether `config` asks for work after the sender's answer, or for no sender: async mode,
/// `tracing`, the etcd store, a best-effort subscriber. Such a configuration is served by
/// its own context on Envoy's main thread rather than on the workers.
pub fn needs_hub(config: &Config) -> bool {
    config.mode == AnswerMode::Async
        || config.tracing.is_some()
        || matches!(
            config.dedupe.as_ref().map(|d| &d.store),
            Some(Store::Etcd(_))
        )
        || config
            .channels
            .iter()
            .flat_map(|c| &c.subscribers)
            .any(|s| !s.required)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hub(json: &str) -> bool {
        match configure(json.as_bytes()) {
            Ok(config) => needs_hub(&config),
            Err(error) => panic!("refused: {error}: {json}"),
        }
    }

    #[test]
    fn a_sync_configuration_with_required_subscribers_is_served_on_the_workers() {
        let json = r#"{"channels": [{"name": "orders", "hosts": ["*"], "subscribers": [
            {"cluster": "a", "path": "/x", "delivery": {"format": "structured", "retry": 2,
             "backoff_policy": "exponential", "backoff_delay_ms": 50,
             "dead_letter": {"cluster": "dl"}},
             "reply": {"cluster": "r"}, "max_concurrent_calls": 2,
             "filters": [{"exact": {"type": "t"}}]},
            {"cluster": "b"}]}],
            "dedupe": {"store": "envoy"}, "metrics": true}"#;
        assert!(!hub(json));
    }

    #[test]
    fn the_readers_own_errors_are_the_refusals() {
        let error = configure(br#"{"subscribers": [{"cluster": ""}], "mode": "async"}"#)
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            error.as_deref(),
            Some("subscribers[0].cluster: must not be empty")
        );
    }

    #[test]
    fn work_after_the_answer_or_for_no_sender_is_served_by_the_hub() {
        for json in [
            r#"{"subscribers": [{"cluster": "a"}], "mode": "async"}"#,
            r#"{"subscribers": [{"cluster": "a"}],
                "tracing": {"collector": {"cluster": "otel"}}}"#,
            r#"{"subscribers": [{"cluster": "a"}],
                "dedupe": {"store": {"etcd": {"cluster": "etcd"}}}}"#,
            r#"{"channels": [{"name": "c", "subscribers": [
                {"cluster": "a"}, {"cluster": "b", "required": false}]}]}"#,
            r#"{"subscribers": [{"cluster": "a", "required": false}]}"#,
        ] {
            assert!(hub(json), "{json}");
        }
    }
}
