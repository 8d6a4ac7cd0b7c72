//! The property the contract promises: whatever Knative objects the source holds (valid, odd
//! or hostile), everything the server serves is a configuration the filter takes, and a
//! channel that is not served as it is now says why.

use crate::contract::Build;
use crate::knative;
use crate::model::{AuthorizationMode, MapOptions};
use crate::render::{self, RenderOptions, Served, Serving};
use crate::senders::Oidc;
use envoy_types::pb::envoy::config::core::v3::TypedExtensionConfig;
use envoy_types::pb::envoy::extensions::filters::http::wasm::v3::Wasm;
use envoy_types::pb::google::protobuf::StringValue;
use proptest::prelude::*;
use proptest::sample::select;
use prost::Message;
use serde_json::{json, Value};

fn uri() -> impl Strategy<Value = String> {
    let scheme = select(vec!["http", "https", "HTTPS", "ftp", ""]);
    let userinfo = select(vec!["", "", "", "user:pw@"]);
    let host = select(vec![
        "a.example",
        "b.example",
        "A.Example",
        "a.example.",
        "127.0.0.1",
        "[::1]",
        "[::1",
        "x_y.svc.cluster.local",
        "",
        "*",
        "a b",
        "ü.example",
        "h\u{7}",
    ]);
    let port = select(vec![
        "", "", ":80", ":8443", ":0", ":65535", ":65536", ":x", ":",
    ]);
    let path = select(vec![
        "", "/", "/p?q=1", "?q", "#f", "/a b", "/\u{7f}", "/ü", "/%20", "//x", "/\t", "/a\"b",
    ]);
    (scheme, userinfo, host, port, path).prop_map(|(s, u, h, p, path)| {
        let s = if s.is_empty() {
            String::new()
        } else {
            format!("{s}://")
        };
        format!("{s}{u}{h}{p}{path}")
    })
}

fn duration() -> impl Strategy<Value = Value> {
    prop_oneof![
        select(vec![
            "PT0.2S",
            "PT0S",
            "PT1M",
            "P1D",
            "PT",
            "1s",
            "PT1000000H",
            "P50000D",
            "-PT1S",
            "PT0.0001S",
            "PT1,5S",
            "P1W",
            "PT4294967.295S",
            "PT4294967.296S",
        ])
        .prop_map(|d| json!(d)),
        Just(json!(3)),
        Just(Value::Null),
    ]
}

fn retry() -> impl Strategy<Value = Value> {
    select(vec![
        json!(0),
        json!(1),
        json!(3),
        json!(100),
        json!(101),
        json!(u64::from(u32::MAX)),
        json!(u64::MAX),
        json!(-1),
        json!("3"),
        json!(2.5),
    ])
}

/// A delivery spec: one whose every field is valid (so that channels with deliveries are
/// served, and what is served is checked), or one of odd and hostile values.
fn delivery() -> impl Strategy<Value = Value> {
    prop_oneof![valid_delivery(), any_delivery()]
}

fn valid_delivery() -> impl Strategy<Value = Value> {
    let durations = |d: &[&str]| select(d.iter().map(|d| json!(d)).collect::<Vec<_>>());
    (
        prop::option::of(select(vec![json!(0), json!(1), json!(3), json!(100)])),
        prop::option::of(select(vec![json!("linear"), json!("exponential")])),
        prop::option::of(durations(&["PT0.2S", "PT1S", "PT2.5S", "P1D"])),
        prop::option::of(durations(&["PT0.5S", "PT1S", "PT30S"])),
        prop::option::of(durations(&["PT1S", "PT5S"])),
        prop::option::of(select(vec![json!("json"), json!("binary")])),
        prop::option::of(Just(
            json!({ "uri": "http://dlq.example.svc.cluster.local/dead" }),
        )),
    )
        .prop_map(|(retry, policy, delay, timeout, after, format, dlq)| {
            delivery_of((retry, policy, delay, timeout, after, format, dlq), None)
        })
}

/// A delivery spec of the fields that are given (and `unknown`, a field Knative has not).
fn delivery_of(
    (retry, policy, delay, timeout, after, format, dlq): DeliveryFields,
    unknown: Option<Value>,
) -> Value {
    let fields = [
        ("retry", retry),
        ("backoffPolicy", policy),
        ("backoffDelay", delay),
        ("timeout", timeout),
        ("retryAfterMax", after),
        ("format", format),
        ("deadLetterSink", dlq),
        ("retries", unknown),
    ];
    Value::Object(
        fields
            .into_iter()
            .filter_map(|(k, v)| Some((k.to_owned(), v?)))
            .collect(),
    )
}

type DeliveryFields = (
    Option<Value>,
    Option<Value>,
    Option<Value>,
    Option<Value>,
    Option<Value>,
    Option<Value>,
    Option<Value>,
);

fn any_delivery() -> impl Strategy<Value = Value> {
    let policy = select(vec![
        json!("linear"),
        json!("exponential"),
        json!("Linear"),
        json!(3),
    ]);
    let format = select(vec![
        json!("json"),
        json!("binary"),
        json!("structured"),
        Value::Null,
    ]);
    let dead_letter = prop_oneof![
        uri().prop_map(|u| json!({ "uri": u })),
        uri().prop_map(|u| json!({ "uri": u, "CACerts": "CA", "audience": "dlq" })),
        Just(json!({ "ref": { "kind": "Service", "name": "dlq" } })),
    ];
    (
        prop::option::of(retry()),
        prop::option::of(policy),
        prop::option::of(duration()),
        prop::option::of(duration()),
        prop::option::of(duration()),
        prop::option::of(format),
        prop::option::of(dead_letter),
        prop::bool::weighted(0.1),
    )
        .prop_map(
            |(retry, policy, delay, timeout, after, format, dlq, unknown)| {
                let fields = (retry, policy, delay, timeout, after, format, dlq);
                delivery_of(fields, unknown.then(|| json!(2)))
            },
        )
}

/// A subscriber's URI: mostly one fanout calls, else anything [`uri`] makes.
fn subscriber_uri() -> impl Strategy<Value = String> {
    let valid = select(vec![
        "http://billing.shop.svc.cluster.local/in",
        "http://a.example:8080/",
        "https://b.example/x?y=1",
    ])
    .prop_map(str::to_owned);
    prop_oneof![valid, uri()]
}

fn subscriber_entry() -> impl Strategy<Value = Value> {
    (
        subscriber_uri(),
        prop::option::of(subscriber_uri()),
        prop::option::of(delivery()),
        select(vec!["u1", "u2", "u3"]),
        prop::option::of(Just("CA")),
    )
        .prop_map(|(uri, reply, delivery, uid, ca)| {
            let mut e = json!({ "uid": uid, "subscriberUri": uri });
            if let Some(reply) = reply {
                e["replyUri"] = json!(reply);
            }
            if let Some(delivery) = delivery {
                e["delivery"] = delivery;
            }
            if let Some(ca) = ca {
                e["subscriberCACerts"] = json!(ca);
            }
            e
        })
}

fn channel() -> impl Strategy<Value = Value> {
    (
        select(vec!["InMemoryChannel", "Channel"]),
        select(vec!["default", "shop", "other"]),
        select(vec!["a", "b", "orders"]),
        prop::option::of(uri()),
        prop::collection::vec(subscriber_entry(), 0..4),
        prop::option::of(delivery()),
        prop::option::of(select(vec!["aud-a", "aud-b"])),
    )
        .prop_map(|(kind, ns, name, url, subscribers, delivery, audience)| {
            let mut c = json!({
                "apiVersion": "messaging.knative.dev/v1", "kind": kind,
                "metadata": { "name": name, "namespace": ns },
                "spec": { "subscribers": subscribers },
                "status": {}
            });
            if let Some(url) = url {
                c["status"]["address"] = json!({ "url": url });
            }
            if let Some(audience) = audience {
                c["status"]["address"]["audience"] = json!(audience);
            }
            if let Some(delivery) = delivery {
                c["spec"]["delivery"] = delivery;
            }
            c
        })
}

fn subscription() -> impl Strategy<Value = Value> {
    (
        select(vec!["s1", "s2"]),
        select(vec!["default", "shop"]),
        select(vec!["a", "b", "orders", "missing"]),
        uri(),
        prop::option::of(delivery()),
    )
        .prop_map(|(name, ns, channel, uri, delivery)| {
            let mut s = json!({
                "apiVersion": "messaging.knative.dev/v1", "kind": "Subscription",
                "metadata": { "name": name, "namespace": ns, "uid": name },
                "spec": { "channel": { "apiVersion": "messaging.knative.dev/v1",
                                       "kind": "InMemoryChannel", "name": channel },
                          "subscriber": { "uri": uri } }
            });
            if let Some(delivery) = delivery {
                s["spec"]["delivery"] = delivery;
            }
            s
        })
}

fn policy() -> impl Strategy<Value = Value> {
    (
        select(vec!["default", "shop"]),
        select(vec![
            json!([{ "sub": "system:serviceaccount:shop:*" }]),
            json!([{ "sub": "x" }]),
            json!([{ "ref": { "kind": "ServiceAccount", "name": "sa" } }]),
            json!([]),
        ]),
        select(vec![
            Value::Null,
            json!([{ "ref": { "apiVersion": "messaging.knative.dev/v1",
                              "kind": "InMemoryChannel", "name": "a" } }]),
        ]),
    )
        .prop_map(|(ns, from, to)| {
            let mut p = json!({
                "apiVersion": "eventing.knative.dev/v1alpha1", "kind": "EventPolicy",
                "metadata": { "name": "p", "namespace": ns },
                "spec": { "from": from }
            });
            if !to.is_null() {
                p["spec"]["to"] = to;
            }
            p
        })
}

fn objects() -> impl Strategy<Value = Vec<Value>> {
    (
        prop::collection::vec(channel(), 0..5),
        prop::collection::vec(subscription(), 0..3),
        prop::collection::vec(policy(), 0..2),
    )
        .prop_map(|(mut c, s, p)| {
            c.extend(s);
            c.extend(p);
            c
        })
}

fn options() -> impl Strategy<Value = (MapOptions, RenderOptions)> {
    let mode = select(vec![
        None,
        Some(AuthorizationMode::AllowSameNamespace),
        Some(AuthorizationMode::AllowAll),
        Some(AuthorizationMode::DenyAll),
    ]);
    mode.prop_map(|senders| {
        let render = RenderOptions {
            build: Build::Wasm("/fanout.wasm".into()),
            trusted_ca: "/ca.crt".into(),
            oidc: senders.map(|_| Oidc {
                issuer: "https://issuer.example".into(),
                jwks: "/jwks.json".into(),
            }),
            resolve: Vec::new(),
            connect_timeout: std::time::Duration::from_secs(1),
        };
        (MapOptions { senders }, render)
    })
}

/// The plugin configuration of the served fanout filter.
fn plugin(served: &Served) -> String {
    let filter = TypedExtensionConfig::decode(served.ecds[0].value.as_slice()).unwrap();
    let wasm = Wasm::decode(filter.typed_config.unwrap().value.as_slice()).unwrap();
    let config = wasm.config.unwrap().configuration.unwrap();
    StringValue::decode(config.value.as_slice()).unwrap().value
}

fn check(served: &Served) -> Result<(), TestCaseError> {
    let plugin = plugin(served);
    if let Err(e) = fanout::config::Config::from_json(plugin.as_bytes()) {
        return Err(TestCaseError::fail(format!(
            "the filter refuses {plugin}: {e}"
        )));
    }
    for (name, channel) in &served.channels {
        prop_assert!(
            channel.serving == Serving::Current || !channel.problems.is_empty(),
            "{name} is {:?} and says no why",
            channel.serving
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// Served from nothing, then changed to other objects (a channel's last good version
    /// next to the others' new ones): the filter takes every version served.
    #[test]
    fn everything_served_parses_in_the_filter(
        (map, render) in options(),
        first in objects(),
        then in objects(),
    ) {
        let one = render::serve(&knative::map(&map, first), None, &render);
        check(&one)?;
        let two = render::serve(&knative::map(&map, then), Some(&one), &render);
        check(&two)?;
    }
}

/// The generator reaches what it is for: among its cases, channels served with a delivery
/// (retries, backoff, a dead letter), not only ones refused for a hostile value.
#[test]
fn the_generated_objects_serve_deliveries_too() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = (options(), objects());
    let with_delivery = (0..256)
        .filter(|_| {
            let ((map, render), objects) = strategy.new_tree(&mut runner).unwrap().current();
            plugin(&render::serve(&knative::map(&map, objects), None, &render))
                .contains("\"delivery\"")
        })
        .count();
    assert!(
        with_delivery >= 10,
        "{with_delivery} of 256 served a delivery"
    );
}

/// What the server serves, for the filter's tests in wasm32 (`make test-wasm`: the filter's
/// own reader, compiled as Envoy runs it, parses each line; src/config/served_corpus.rs).
const CORPUS: &str = "../tests/fixtures/control/served.jsonl";

/// The corpus is what the server serves for the generator's first 256 cases (deterministic:
/// each served from nothing, then changed to other objects), each distinct configuration
/// once; when the mapping changes, `FANOUT_WRITE_CORPUS=1` writes it again.
#[test]
fn the_served_corpus_is_what_the_server_serves() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = (options(), objects(), objects());
    let mut documents = std::collections::BTreeSet::new();
    for _ in 0..256 {
        let ((map, render), first, then) = strategy.new_tree(&mut runner).unwrap().current();
        let one = render::serve(&knative::map(&map, first), None, &render);
        let two = render::serve(&knative::map(&map, then), Some(&one), &render);
        for served in [&one, &two] {
            check(served).unwrap();
            documents.insert(plugin(served));
        }
    }
    let lines: String = documents.iter().map(|d| format!("{d}\n")).collect();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(CORPUS);
    if std::env::var_os("FANOUT_WRITE_CORPUS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &lines).unwrap();
    }
    let shipped = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        shipped == lines,
        "{} is not what the server serves: run \
         FANOUT_WRITE_CORPUS=1 cargo test -p fanout-control served_corpus",
        path.display()
    );
}
