//! What the native build refuses at configuration, and why: everything fanout does after the
//! sender's answer, or for no sender, needs a context that lives on a worker without a
//! request in flight (proxy-wasm's root context). Envoy's dynamic-module HTTP filter has no
//! such context, so the native build delivers only while the sender waits: every call is a
//! callout of the sender's stream. What a sync sender waits for is served: retries, calls
//! waiting for a slot (`max_concurrent_calls`), a required subscriber's reply and dead
//! letter (the glue's timer thread wakes the worker when a retry is due or a call got its
//! slot; every such call is the sender's stream's). A configuration that asks for more is
//! refused here, with the path of the field that asks for it, before Envoy takes it.

use fanout::config::{AnswerMode, Config, ConfigError, Store, Subscriber};
use serde_json::Value;

/// Why a subscriber or an option needs a worker's own context, said once.
const WASM: &str = "the wasm build (a worker context)";

/// The plugin configuration `bytes` read and validated as the wasm build reads it, then
/// checked against what the native build can serve: the configuration, or the first reason
/// it cannot be served (its path, and what to do).
pub fn configure(bytes: &[u8]) -> Result<Config, ConfigError> {
    let config = Config::from_json(bytes)?;
    // Only to name the field a refusal is about: where it was written (the subscriber's
    // own, the top-level default, the `subscribers` shorthand).
    let doc: Value = serde_json::from_slice(bytes).unwrap_or(Value::Null);
    match refusal(&config, &doc) {
        Some(error) => Err(error),
        None => Ok(config),
    }
}

/// The first thing in `config` the native build cannot do, with its path in `doc` (the same
/// configuration as JSON); `None` when it can serve all of it.
pub fn refusal(config: &Config, doc: &Value) -> Option<ConfigError> {
    let refuse = |path: &str, message: &str| {
        Some(ConfigError {
            path: path.to_string(),
            message: message.to_string(),
        })
    };
    if config.mode == AnswerMode::Async {
        return refuse(
            "mode",
            &format!(
                "\"async\" needs {WASM}: it delivers after the 202; the native build \
                 delivers while the sender waits (\"sync\")"
            ),
        );
    }
    if config.tracing.is_some() {
        return refuse(
            "tracing",
            &format!("needs {WASM}: spans are exported in batches, for no sender"),
        );
    }
    if let Some(Store::Etcd(_)) = config.dedupe.as_ref().map(|d| &d.store) {
        return refuse(
            "dedupe.store",
            &format!(
                "etcd needs {WASM}: its settles and leases go out with no sender's \
                 stream to call from; the native build has the \"envoy\" store"
            ),
        );
    }
    let shorthand = doc.get("channels").is_none_or(Value::is_null);
    for (c, channel) in config.channels.iter().enumerate() {
        for (s, subscriber) in channel.subscribers.iter().enumerate() {
            let at = if shorthand {
                format!("subscribers[{s}]")
            } else {
                format!("channels[{c}].subscribers[{s}]")
            };
            if let Some(error) = subscriber_refusal(subscriber, &at) {
                return Some(error);
            }
        }
    }
    None
}

/// What one subscriber asks for that the native build cannot do: a best-effort subscriber's
/// calls go on after the sender's answer. (A required subscriber's reply and dead letter are
/// part of its delivery: the sender waits for them, and they are its stream's calls.)
fn subscriber_refusal(subscriber: &Subscriber, at: &str) -> Option<ConfigError> {
    if subscriber.required {
        return None;
    }
    Some(ConfigError {
        path: format!("{at}.required"),
        message: format!(
            "best-effort subscribers need {WASM}; the native build delivers while the \
             sender waits"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(json: &str) -> String {
        match configure(json.as_bytes()) {
            Err(error) => error.to_string(),
            Ok(_) => panic!("accepted: {json}"),
        }
    }

    #[test]
    fn a_sync_configuration_with_required_subscribers_is_served() {
        let json = r#"{"channels": [{"name": "orders", "hosts": ["*"], "subscribers": [
            {"cluster": "a", "path": "/x", "delivery": {"format": "structured"},
             "filters": [{"exact": {"type": "t"}}]},
            {"cluster": "b"}]}],
            "dedupe": {"store": "envoy"}, "metrics": true}"#;
        assert!(configure(json.as_bytes()).is_ok());
    }

    #[test]
    fn the_readers_own_errors_come_first() {
        assert_eq!(
            refused(r#"{"subscribers": [{"cluster": ""}], "mode": "async"}"#),
            "subscribers[0].cluster: must not be empty"
        );
    }

    #[test]
    fn async_mode_is_refused() {
        let error = refused(r#"{"subscribers": [{"cluster": "a"}], "mode": "async"}"#);
        assert!(
            error.starts_with("mode: \"async\" needs the wasm build"),
            "{error}"
        );
    }

    #[test]
    fn tracing_is_refused() {
        let error = refused(
            r#"{"subscribers": [{"cluster": "a"}], "tracing": {"collector": {"cluster": "otel"}}}"#,
        );
        assert!(
            error.starts_with("tracing: needs the wasm build"),
            "{error}"
        );
    }

    #[test]
    fn the_etcd_store_is_refused() {
        let error = refused(
            r#"{"subscribers": [{"cluster": "a"}],
                "dedupe": {"store": {"etcd": {"cluster": "etcd"}}}}"#,
        );
        assert!(
            error.starts_with("dedupe.store: etcd needs the wasm build"),
            "{error}"
        );
    }

    #[test]
    fn a_best_effort_subscriber_is_refused_by_its_path() {
        let error = refused(
            r#"{"channels": [{"name": "c", "subscribers": [
                {"cluster": "a"}, {"cluster": "b", "required": false}]}]}"#,
        );
        assert_eq!(
            error,
            "channels[0].subscribers[1].required: best-effort subscribers need the wasm \
             build (a worker context); the native build delivers while the sender waits"
        );
    }

    #[test]
    fn retries_of_a_sync_fan_out_are_served_with_their_backoff_and_jitter() {
        let own = r#"{"subscribers": [{"cluster": "a", "delivery": {"retry": 2,
            "backoff_policy": "exponential", "backoff_delay_ms": 50, "backoff_max_ms": 400,
            "backoff_jitter": 0.2}}]}"#;
        assert!(configure(own.as_bytes()).is_ok());
        let top = r#"{"subscribers": [{"cluster": "a"}], "delivery": {"retry": 1}}"#;
        assert!(configure(top.as_bytes()).is_ok());
    }

    #[test]
    fn retries_do_not_make_what_needs_a_worker_context_served() {
        let error = refused(
            r#"{"subscribers": [{"cluster": "a", "required": false,
                "delivery": {"retry": 2}}]}"#,
        );
        assert!(error.starts_with("subscribers[0].required: "), "{error}");
        let error = refused(
            r#"{"mode": "async", "subscribers": [{"cluster": "a"}],
            "delivery": {"retry": 2}}"#,
        );
        assert!(error.starts_with("mode: "), "{error}");
        let error = refused(
            r#"{"channels": [{"name": "c", "subscribers": [{"cluster": "a"},
            {"cluster": "b", "required": false, "delivery": {"retry": 1}}]}]}"#,
        );
        assert!(
            error.starts_with("channels[0].subscribers[1].required: "),
            "{error}"
        );
    }

    #[test]
    fn no_retries_is_served() {
        let json = r#"{"subscribers": [{"cluster": "a", "delivery": {"retry": 0}}]}"#;
        assert!(configure(json.as_bytes()).is_ok());
    }

    #[test]
    fn a_required_subscribers_dead_letter_and_reply_are_served() {
        for json in [
            r#"{"channels": [{"name": "c", "subscribers": [{"cluster": "a",
                "delivery": {"retry": 1, "dead_letter": {"cluster": "dl"}}}]}]}"#,
            r#"{"subscribers": [{"cluster": "a", "reply": {"cluster": "r"}}]}"#,
            r#"{"subscribers": [{"cluster": "a"}], "reply": {"cluster": "r"},
                "delivery": {"dead_letter": {"cluster": "dl"}}}"#,
        ] {
            assert!(configure(json.as_bytes()).is_ok(), "{json}");
        }
    }

    #[test]
    fn call_caps_are_served() {
        for json in [
            r#"{"subscribers": [{"cluster": "a", "max_concurrent_calls": 2}]}"#,
            r#"{"subscribers": [{"cluster": "a"}], "max_concurrent_calls": 2,
                "max_queued_calls": 4}"#,
        ] {
            assert!(configure(json.as_bytes()).is_ok(), "{json}");
        }
    }
}
