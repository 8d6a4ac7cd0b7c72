//! The filter's configuration is the contract: the document fanout-control serves (the
//! served channels as the filter's `channels`) and, per channel, the filter's own validation
//! of it (`fanout::config`, the code Envoy runs). A channel the filter would refuse is that
//! channel's problem, named by the object and field of the source it comes from; it never
//! reaches the one resource every channel shares.

use crate::model::{ChannelSpec, Problem};
use serde_json::{json, Value};

/// One channel as an entry of the filter's `channels`.
pub fn channel_json(name: &str, spec: &ChannelSpec) -> Value {
    let subscribers: Vec<&Value> = spec.subscribers.iter().map(|s| &s.config).collect();
    json!({ "name": name, "hosts": spec.hosts, "subscribers": subscribers })
}

/// The filter's plugin configuration of these channels (entries of [`channel_json`]).
pub fn document(channels: Vec<Value>) -> String {
    json!({ "channels": channels }).to_string()
}

/// Whether the filter takes `spec` served alone; its refusal as a problem of the channel.
pub fn check(name: &str, spec: &ChannelSpec) -> Result<(), Problem> {
    let text = document(vec![channel_json(name, spec)]);
    match fanout::config::Config::from_json(text.as_bytes()) {
        Ok(_) => Ok(()),
        Err(e) => Err(refused(name, spec, &e.path, &e.message)),
    }
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

    fn subscriber(config: Value) -> SubscriberSpec {
        SubscriberSpec {
            uri: "http://a.example/".into(),
            config,
            object: "InMemoryChannel default/a".into(),
            field: "spec.subscribers[0]".into(),
        }
    }

    #[test]
    fn what_the_filter_refuses_is_charged_to_where_it_comes_from() {
        let spec = |hosts: Vec<&str>, config: Value| ChannelSpec {
            hosts: hosts.into_iter().map(str::to_owned).collect(),
            subscribers: vec![subscriber(config)],
            ..ChannelSpec::default()
        };
        let good = json!({ "cluster": "http|a.example|80", "path": "/" });
        assert_eq!(
            check("default/a", &spec(vec!["a.example"], good.clone())),
            Ok(())
        );
        let retry = json!({ "cluster": "c", "delivery": { "retry": 101 } });
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
}
