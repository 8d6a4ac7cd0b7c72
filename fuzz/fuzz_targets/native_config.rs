//! The native build's configuration path (`fanout_native::configure`: the bytes Envoy hands
//! `on_http_filter_config_new`, read and validated as the wasm build reads them, then checked
//! against what the native build can serve) on arbitrary input. No Envoy: the path is pure.
//!
//! Properties:
//! - `configure` never panics;
//! - it refuses with a message, the same way every time;
//! - it accepts exactly what `Config::from_json` accepts and needs no worker context of its
//!   own: sync mode, no `tracing`, no etcd store, every subscriber required (retries, call
//!   caps, replies and dead letters of required subscribers are served: the sender waits
//!   for them);
//! - what `Config::from_json` accepts but the native build refuses is refused with the path
//!   of a field, one the document has (the subscriber's own or the top-level default).
#![no_main]

use fanout::config::{AnswerMode, Config, Store};
use fanout_native::configure;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let native = configure(data);
    if let Err(error) = &native {
        assert!(!error.message.is_empty(), "a refusal without a message");
        assert_eq!(
            configure(data).err().as_ref(),
            Some(error),
            "refused another way"
        );
    }
    match (Config::from_json(data), native) {
        (Ok(config), Ok(_)) => assert!(
            !needs_worker_context(&config),
            "served what needs a worker context"
        ),
        (Ok(config), Err(error)) => {
            assert!(
                needs_worker_context(&config),
                "refused a config it can serve: {error}"
            );
            assert!(!error.path.is_empty(), "a refusal without a path: {error}");
            let doc: serde_json::Value = serde_json::from_slice(data).expect("accepted JSON");
            assert!(
                has_path(&doc, &error.path),
                "{error}: no such field in the document"
            );
        }
        (Err(reader), Err(error)) => assert_eq!(reader, error, "not the reader's own refusal"),
        (Err(reader), Ok(_)) => panic!("served a config the reader refuses: {reader}"),
    }
});

/// What only a worker's own context can do (the wasm build's root context: work after the
/// sender's answer, or for no sender), read independently of `fanout_native::refuse`.
fn needs_worker_context(config: &Config) -> bool {
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

/// Whether the document has a value at a path like `channels[0].subscribers[1].reply`.
fn has_path(doc: &serde_json::Value, path: &str) -> bool {
    let mut at = doc;
    for part in path.split('.') {
        let (name, index) = match part.split_once('[') {
            Some((name, rest)) => (name, rest.trim_end_matches(']').parse::<usize>().ok()),
            None => (part, None),
        };
        let Some(next) = at.get(name) else {
            return false;
        };
        at = next;
        if let Some(i) = index {
            let Some(next) = at.get(i) else {
                return false;
            };
            at = next;
        }
    }
    true
}
