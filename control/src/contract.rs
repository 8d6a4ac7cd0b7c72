//! The filter's configuration is the contract: the document fanout-control serves (the
//! served channels as the filter's `channels`, built as the filter's own types,
//! `fanout::config::RawChannel` and `RawSubscriber`) and, per channel, the filter's own
//! validation of it (`fanout::config`, the code Envoy runs). A channel the filter would
//! refuse is that channel's problem, named by the object and field of the source it comes
//! from; it never reaches the one resource every channel shares.

use crate::model::{ChannelSpec, Problem};
use fanout::config::RawChannel;
use serde::Serialize;
use serde_json::json;
use serde_json::value::RawValue;
use std::sync::Arc;

/// Which build of fanout the Envoys load, as they see it (`--build`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Build {
    /// The wasm module: its file (`--wasm`).
    Wasm(String),
    /// The native build: the library's name, or its absolute path (`--native-module`).
    Native(String),
}

impl Build {
    /// What the filter's version digests besides its configuration: the module file for the
    /// wasm build (as ever), the library for the native build.
    pub fn identity(&self) -> String {
        match self {
            Build::Wasm(path) => path.clone(),
            Build::Native(module) => format!("native:{module}"),
        }
    }
}

/// One channel as an entry of the filter's `channels`.
pub fn channel(name: &str, spec: &ChannelSpec) -> RawChannel {
    RawChannel {
        name: Some(name.to_owned()),
        hosts: Some(spec.hosts.clone()),
        subscribers: spec.subscribers.iter().map(|s| s.config.clone()).collect(),
    }
}

/// One channel's entry of the filter's `channels` ([`channel`]), written: through
/// serde_json's `Value`, whose objects keep their keys sorted, so that the same channel is
/// the same text (and so the same versions) whatever the order of the types' fields.
/// Written once per version of a channel, and served as it is written.
pub fn entry(name: &str, spec: &ChannelSpec) -> Result<Arc<RawValue>, Problem> {
    written(&channel(name, spec))
        .map_err(|e| Problem::new(name, "", format!("cannot be written: {e}")))
}

fn written(channel: &RawChannel) -> Result<Arc<RawValue>, serde_json::Error> {
    serde_json::value::to_raw_value(&json!(channel)).map(Arc::from)
}

/// The filter's plugin configuration: its `channels`, written entries ([`entry`]).
#[derive(Serialize)]
struct Document<'a> {
    channels: &'a [&'a RawValue],
}

/// The filter's plugin configuration of these channels (entries of [`entry`]).
pub fn document(channels: &[&RawValue]) -> Result<String, Problem> {
    serde_json::to_string(&Document { channels }).map_err(|e| {
        let message = format!("the filter's configuration cannot be written: {e}");
        Problem::new("fanout", "", message)
    })
}

/// Whether the wasm filter takes `spec` served alone; its refusal as a problem of the channel.
#[cfg(test)]
pub fn check(name: &str, spec: &ChannelSpec) -> Result<(), Problem> {
    let wasm = Build::Wasm(String::new());
    check_entry(name, spec, &entry(name, spec)?, &wasm)
}

/// Whether the filter of `build` takes `spec`, written as `entry`, served alone; its refusal
/// as a problem of the channel. The native build reads it with its own entry point
/// (`fanout_native::configure`, what it runs in Envoy), which takes what the wasm build
/// takes.
pub fn check_entry(
    name: &str,
    spec: &ChannelSpec,
    entry: &RawValue,
    build: &Build,
) -> Result<(), Problem> {
    let text = document(&[entry])?;
    let checked = match build {
        Build::Wasm(_) => fanout::config::Config::from_json(text.as_bytes()).map(drop),
        Build::Native(_) => fanout_native::configure(text.as_bytes()).map(drop),
    };
    checked.map_err(|e| refused(name, spec, &e.path, &e.message))
}

/// The filter's error at `path` (of a document with `spec` as its only channel), charged to
/// the object and field a subscriber comes from where the path is one subscriber's.
fn refused(name: &str, spec: &ChannelSpec, path: &str, message: &str) -> Problem {
    let within = path.strip_prefix("channels[0].").unwrap_or(path);
    let text = |field: &str| format!("the filter refuses {field}: {message}");
    let subscriber = within.strip_prefix("subscribers[").and_then(|rest| {
        let (index, field) = rest.split_once(']')?;
        let subscriber = spec.subscribers.get(index.parse::<usize>().ok()?)?;
        Some((subscriber, field.trim_start_matches('.')))
    });
    match subscriber {
        Some((subscriber, field)) => {
            Problem::new(&subscriber.object, &subscriber.field, text(field))
        }
        None if within.starts_with("hosts") => {
            Problem::new(name, "status.address.url", text(within))
        }
        None => Problem::new(name, "", text(within)),
    }
}

#[cfg(test)]
mod properties;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::SubscriberSpec;
    use fanout::config::{Node, RawDelivery, RawHeaders, RawSubscriber, RawTarget};
    use fanout::retry::BackoffPolicy;

    /// The document of these channels, written as the server writes each.
    fn document(channels: Vec<RawChannel>) -> String {
        let entries: Vec<_> = channels.iter().map(|c| written(c).unwrap()).collect();
        let entries: Vec<&RawValue> = entries.iter().map(|e| &**e).collect();
        super::document(&entries).unwrap()
    }

    fn subscriber(config: RawSubscriber) -> SubscriberSpec {
        SubscriberSpec {
            uri: "http://a.example/".into(),
            config,
            object: "InMemoryChannel default/a".into(),
            field: "spec.subscribers[0]".into(),
        }
    }

    #[test]
    fn what_the_filter_refuses_is_charged_to_where_it_comes_from() {
        let spec = |hosts: Vec<&str>, config: RawSubscriber| ChannelSpec {
            hosts: hosts.into_iter().map(str::to_owned).collect(),
            subscribers: vec![subscriber(config)],
            ..ChannelSpec::default()
        };
        let good = RawSubscriber {
            cluster: "http|a.example|80".into(),
            path: Some("/".into()),
            ..RawSubscriber::default()
        };
        assert_eq!(
            check("default/a", &spec(vec!["a.example"], good.clone())),
            Ok(())
        );
        let retry = RawSubscriber {
            cluster: "c".into(),
            delivery: Some(RawDelivery {
                retry: Some(101),
                ..RawDelivery::default()
            }),
            ..RawSubscriber::default()
        };
        let problem = check("default/a", &spec(vec!["a.example"], retry)).unwrap_err();
        assert_eq!(
            (problem.object.as_str(), problem.field.as_str()),
            ("InMemoryChannel default/a", "spec.subscribers[0]")
        );
        assert!(
            problem
                .message
                .starts_with("the filter refuses delivery.retry: "),
            "{problem:?}"
        );
        let problem = check("default/a", &spec(vec!["a.example:80"], good)).unwrap_err();
        assert_eq!(
            (problem.object.as_str(), problem.field.as_str()),
            ("default/a", "status.address.url")
        );
        assert!(problem.message.contains("hosts[0]"), "{problem:?}");
    }

    /// The native build takes what the wasm build takes (a best-effort subscriber, whose
    /// calls go on after the sender's answer; a reply and a dead letter), and refuses what
    /// it refuses with the same problem, charged to the same subscriber.
    #[test]
    fn the_native_build_takes_and_refuses_what_the_wasm_build_does() {
        let checked = |config: RawSubscriber, build: &Build| {
            let spec = ChannelSpec {
                hosts: vec!["a.example".into()],
                subscribers: vec![subscriber(config)],
                ..ChannelSpec::default()
            };
            check_entry(
                "default/a",
                &spec,
                &entry("default/a", &spec).unwrap(),
                build,
            )
        };
        let (wasm, native) = (Build::Wasm(String::new()), Build::Native("fanout".into()));
        let best_effort = RawSubscriber {
            required: Some(false),
            ..RawSubscriber::from(target("c", "/", None))
        };
        let replying = RawSubscriber {
            delivery: Some(RawDelivery {
                dead_letter: Some(target("d", "/d", None)),
                ..RawDelivery::default()
            }),
            reply: Some(target("r", "/r", None)),
            ..RawSubscriber::from(target("c", "/", None))
        };
        for served in [best_effort, replying] {
            assert_eq!(checked(served.clone(), &wasm), Ok(()));
            assert_eq!(checked(served, &native), Ok(()));
        }
        let bad = RawSubscriber {
            delivery: Some(RawDelivery {
                retry: Some(101),
                ..RawDelivery::default()
            }),
            ..RawSubscriber::from(target("c", "/", None))
        };
        let problem = checked(bad.clone(), &native).unwrap_err();
        assert_eq!(checked(bad, &wasm).unwrap_err(), problem);
        assert_eq!(
            (problem.object.as_str(), problem.field.as_str()),
            ("InMemoryChannel default/a", "spec.subscribers[0]")
        );
    }

    fn target(cluster: &str, path: &str, timeout_ms: Option<u32>) -> RawTarget {
        RawTarget {
            cluster: cluster.into(),
            authority: Some("a.example".into()),
            path: Some(path.into()),
            timeout_ms,
            ..RawTarget::default()
        }
    }

    /// The served text is the filter's types written with their keys sorted, the fields
    /// not set left out: the same bytes as when control built it as JSON values.
    #[test]
    fn the_document_is_the_filters_types_with_sorted_keys() {
        let config = RawSubscriber {
            timeout_ms: Some(2000),
            delivery: Some(RawDelivery {
                retry: Some(2),
                backoff_policy: Some(BackoffPolicy::Linear),
                backoff_delay_ms: Some(100),
                backoff_max_ms: Some(200),
                dead_letter: Some(target("http|d.example|80", "/d", Some(2000))),
                format: Some("json".into()),
                ..RawDelivery::default()
            }),
            reply: Some(target("http|r.example|80", "/r", None)),
            ..RawSubscriber::from(target("http|a.example|80", "/", None))
        };
        let spec = ChannelSpec {
            hosts: vec!["a.example".into()],
            subscribers: vec![subscriber(config)],
            ..ChannelSpec::default()
        };
        assert_eq!(
            document(vec![channel("default/a", &spec)]),
            concat!(
                r#"{"channels":[{"hosts":["a.example"],"name":"default/a","subscribers":[{"#,
                r#""authority":"a.example","cluster":"http|a.example|80","delivery":{"#,
                r#""backoff_delay_ms":100,"backoff_max_ms":200,"backoff_policy":"linear","#,
                r#""dead_letter":{"authority":"a.example","cluster":"http|d.example|80","#,
                r#""path":"/d","timeout_ms":2000},"format":"json","retry":2},"path":"/","#,
                r#""reply":{"authority":"a.example","cluster":"http|r.example|80","path":"/r"},"#,
                r#""timeout_ms":2000}]}]}"#
            )
        );
        assert_eq!(
            document(vec![channel("default/b", &ChannelSpec::default())]),
            r#"{"channels":[{"hosts":[],"name":"default/b","subscribers":[]}]}"#
        );
    }

    /// Every field of the types, written, is read back by the filter as it was set.
    #[test]
    fn the_filter_reads_every_field_written() {
        let exact = Node::Object(vec![(
            "exact".into(),
            Node::Object(vec![("type".into(), Node::Str("order.created".into()))]),
        )]);
        let config = RawSubscriber {
            timeout_ms: Some(1500),
            headers: RawHeaders(vec![("x-team".into(), "billing".into())]),
            delivery: Some(RawDelivery {
                retry: Some(3),
                backoff_policy: Some(BackoffPolicy::Linear),
                backoff_delay_ms: Some(50),
                backoff_max_ms: Some(400),
                backoff_jitter: Some(0.5),
                dead_letter: Some(target("dlq", "/d", Some(700))),
                format: Some("structured".into()),
            }),
            reply: Some(target("reply", "/r", Some(900))),
            filters: Some(vec![exact]),
            required: Some(false),
            max_concurrent_calls: Some(4),
            max_queued_calls: Some(8),
            ..RawSubscriber::from(target("sub", "/s", None))
        };
        let spec = ChannelSpec {
            hosts: vec!["a.example".into()],
            subscribers: vec![subscriber(config)],
            ..ChannelSpec::default()
        };
        let text = document(vec![channel("default/a", &spec)]);
        let read = fanout::config::Config::from_json(text.as_bytes()).unwrap();
        let s = &read.channel(0).unwrap().subscribers[0];
        assert_eq!((s.cluster.as_str(), s.path.as_str()), ("sub", "/s"));
        assert_eq!(s.timeout.as_millis(), 1500);
        assert!(s
            .call_headers
            .contains(&("x-team".into(), "billing".into())));
        assert_eq!(
            (
                s.retry.retry,
                s.retry.policy,
                s.retry.delay_ms,
                s.retry.max_ms
            ),
            (3, BackoffPolicy::Linear, 50, 400)
        );
        let dead_letter = s.dead_letter.as_ref().unwrap();
        assert_eq!(
            (
                dead_letter.cluster.as_str(),
                dead_letter.timeout.as_millis()
            ),
            ("dlq", 700)
        );
        let reply = s.reply.as_ref().unwrap();
        assert_eq!(
            (reply.cluster.as_str(), reply.path.as_str()),
            ("reply", "/r")
        );
        assert!(s.format.is_some() && s.filter.is_some() && !s.required);
        let cap = s.call_cap.unwrap();
        assert_eq!((cap.max_concurrent_calls, cap.max_queued_calls), (4, 8));
        assert!(text.contains(r#""backoff_jitter":0.5"#), "{text}");
    }
}
