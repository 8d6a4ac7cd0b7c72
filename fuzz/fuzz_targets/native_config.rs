//! The native build's configuration path (`fanout_native::configure`: the bytes Envoy hands
//! `on_http_filter_config_new`, read and validated as the wasm build reads them) on arbitrary
//! input, and where it is served (`needs_hub`: on the workers, or by the configuration's own
//! context on Envoy's main thread). No Envoy: the path is pure.
//!
//! Properties:
//! - `configure` never panics;
//! - it accepts exactly what `Config::from_json` accepts, and refuses with the reader's own
//!   error (its path and message), the same way every time;
//! - a configuration is served by its hub exactly when it asks for work after the sender's
//!   answer or for no sender (async mode, `tracing`, the etcd store, a best-effort
//!   subscriber), read here independently of `fanout_native::serve`.
#![no_main]

use fanout::config::{AnswerMode, Config, Store};
use fanout_native::configure;
use fanout_native::serve::needs_hub;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let native = configure(data);
    assert_eq!(
        configure(data).err(),
        native.as_ref().err().cloned(),
        "refused another way"
    );
    match (Config::from_json(data), native) {
        (Ok(_), Ok(served)) => {
            assert_eq!(
                needs_hub(&served),
                after_the_answer(&served),
                "served in the wrong place"
            );
        }
        (Err(reader), Err(error)) => assert_eq!(reader, error, "not the reader's own refusal"),
        (Ok(_), Err(error)) => panic!("refused a config the reader takes: {error}"),
        (Err(reader), Ok(_)) => panic!("served a config the reader refuses: {reader}"),
    }
});

/// What needs a context that outlives every request (the wasm build's root context).
fn after_the_answer(config: &Config) -> bool {
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
