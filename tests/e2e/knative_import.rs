#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! `fanout-control render`: Knative Channels, InMemoryChannels and Subscriptions
//! as `kubectl get channels,inmemorychannels,subscriptions -A -o json` prints them, into the
//! files fanout's live reconfiguration reads.
//!
//! - `tests/fixtures/knative/orders.json`: a Channel with its backing InMemoryChannel (a
//!   channel-level delivery with a dead letter, overridden by one subscription; a reply; an
//!   https subscriber; a Subscription not yet in the channel's spec.subscribers), a second
//!   InMemoryChannel, their Subscriptions. The JSON written is checked field by field, then
//!   loaded into the real Envoy on the shipped ConfigMap bootstrap (`--resolve` points every
//!   host at a local subscriber; the https one sits behind a TLS Envoy with a test CA) and an
//!   event is fanned out: each subscriber gets it on the path its URI names, the failing ones
//!   are retried as their delivery says and dead-lettered, the reply reaches its target.
//! - `tests/fixtures/knative/unresolved.json`: unresolved refs and other errors: exit 1, every
//!   problem named by object and field, nothing written.
//! - Durations, backoff and what is an error or a warning, as tables of small inputs.

use crate::harness;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use harness::control::{render_objects, RENDER_PREFIX};
use harness::reload::{ReloadEnvoy, ECDS};
use harness::timing::assert_waited_at_least;
use harness::{assert_202, assert_status, send, Behavior, Client, Envoy, Subscriber, TempDir};
use serde_json::{json, Value};

const SCRIPT: &str = "fanout-control render";
const ORDERS: &str = "tests/fixtures/knative/orders.json";
const UNRESOLVED: &str = "tests/fixtures/knative/unresolved.json";

/// One run of the command, writing into `<dir>/out` (removed on drop unless the test failed).
struct Import {
    code: i32,
    stdout: String,
    stderr: String,
    dir: TempDir,
}

impl Import {
    /// `input`: a file (relative to the crate root) or, for `-`, `stdin`: the objects.
    fn run(input: &str, stdin: &str, extra: &[&str]) -> Import {
        let dir = TempDir::new("fanout-knative-import", "the import's output");
        let out = dir.path().join("out");
        let objects = if input == "-" {
            stdin.to_owned()
        } else {
            fs::read_to_string(harness::manifest_dir().join(input)).unwrap()
        };
        let (code, stdout, stderr) = render_objects(dir.path(), &objects, &out, extra);
        Import {
            code,
            stdout,
            stderr,
            dir,
        }
    }

    /// The objects as JSON on the command's standard input.
    fn objects(objects: &Value, extra: &[&str]) -> Import {
        Import::run("-", &objects.to_string(), extra)
    }

    fn out(&self) -> PathBuf {
        self.dir.path().join("out")
    }

    fn succeeded(&self) -> &Import {
        assert_eq!(
            self.code, 0,
            "{SCRIPT} failed:\n{}{}",
            self.stdout, self.stderr
        );
        self
    }

    fn file(&self, name: &str) -> String {
        let path = self.out().join(name);
        fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    fn json(&self, name: &str) -> Value {
        serde_json::from_str(&self.file(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    fn lines(&self, kind: &str) -> Vec<String> {
        let prefix = format!("{RENDER_PREFIX}: {kind}: ");
        self.stderr
            .lines()
            .filter_map(|l| l.strip_prefix(&prefix).map(str::to_owned))
            .collect()
    }

    fn warnings(&self) -> Vec<String> {
        self.lines("warning")
    }

    fn errors(&self) -> Vec<String> {
        self.lines("error")
    }
}

/// Asserts that every expected (object, field, message part) is among `lines`, each line
/// starting with the object and its field.
fn assert_reported(lines: &[String], expected: &[(&str, &str, &str)]) {
    for (object, field, part) in expected {
        let prefix = format!("{object}: {field}: ");
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&prefix) && l.contains(part)),
            "no line `{prefix}...{part}...` in:\n{}",
            lines.join("\n")
        );
    }
}

// ---------------------------------------------------------------------------------------------
// What the command writes for the fixture.

/// The fanout config the fixture maps to. Every subscriber keeps the path and authority its URI
/// names; each one's delivery is Knative's, converted.
fn expected_orders_config() -> Value {
    // The channel's delivery (retry 2, exponential, PT0.3S, retryAfterMax PT1S): Knative waits
    // 300 and 600 ms before retries 1 and 2; fanout's delay x 2^k with 150 ms waits the same.
    // retryAfterMax 1000 ms is above the longest backoff, so it is the cap.
    let channel_delivery = json!({
        "retry": 2,
        "backoff_policy": "exponential",
        "backoff_delay_ms": 150,
        "backoff_max_ms": 1000,
        "dead_letter": {
            "cluster": "http|orders-dlq.shop.svc.cluster.local|80",
            "authority": "orders-dlq.shop.svc.cluster.local",
            "path": "/dead"
        }
    });
    json!({
        "channels": [
            {
                "name": "shop/orders",
                "hosts": ["orders-kn-channel.shop.svc.cluster.local"],
                "subscribers": [
                    {
                        "cluster": "http|billing.shop.svc.cluster.local|80",
                        "authority": "billing.shop.svc.cluster.local",
                        "path": "/events?source=orders",
                        "delivery": channel_delivery
                    },
                    {
                        // The Subscription's own delivery replaces the channel's whole: its
                        // retry, backoff, timeout (on the call and on its dead letter) and
                        // dead-letter sink, nothing of the channel's.
                        "cluster": "https|audit.example.com|443",
                        "authority": "audit.example.com",
                        "path": "/ingest",
                        "timeout_ms": 2000,
                        "delivery": {
                            "retry": 1,
                            "backoff_policy": "linear",
                            "backoff_delay_ms": 100,
                            "backoff_max_ms": 100,
                            "dead_letter": {
                                "cluster": "http|audit-dlq.shop.svc.cluster.local|8080",
                                "authority": "audit-dlq.shop.svc.cluster.local:8080",
                                "path": "/",
                                "timeout_ms": 2000
                            }
                        }
                    },
                    {
                        "cluster": "http|enricher.shop.svc.cluster.local|80",
                        "authority": "enricher.shop.svc.cluster.local",
                        "path": "/",
                        "delivery": channel_delivery,
                        "reply": {
                            "cluster": "http|orders-enriched-kn-channel.shop.svc.cluster.local|80",
                            "authority": "orders-enriched-kn-channel.shop.svc.cluster.local",
                            "path": "/"
                        }
                    },
                    {
                        // From the Subscription alone (not yet in spec.subscribers): the
                        // channel's delivery, its dead letter as the Subscription resolved it.
                        "cluster": "http|analytics.shop.svc.cluster.local|80",
                        "authority": "analytics.shop.svc.cluster.local",
                        "path": "/",
                        "delivery": channel_delivery
                    }
                ]
            },
            {
                "name": "shop/orders-enriched",
                "hosts": ["orders-enriched-kn-channel.shop.svc.cluster.local"],
                "subscribers": [
                    {
                        "cluster": "http|shipping.shop.svc.cluster.local|80",
                        "authority": "shipping.shop.svc.cluster.local",
                        "path": "/in"
                    }
                ]
            }
        ]
    })
}

#[test]
fn the_fixture_becomes_one_fanout_channel_per_knative_channel() {
    let import = Import::run(ORDERS, "", &[]);
    import.succeeded();
    assert_eq!(import.json("fanout.json"), expected_orders_config());
    assert!(
        import
            .stdout
            .contains("2 channel(s), 5 subscriber(s), 8 cluster(s)"),
        "{}",
        import.stdout
    );
}

#[test]
fn warnings_name_the_object_and_the_field_and_the_files_are_still_written() {
    let import = Import::run(ORDERS, "", &[]);
    import.succeeded();
    let warnings = import.warnings();
    assert_reported(
        &warnings,
        &[
            (
                "InMemoryChannel shop/orders",
                "spec.subscribers[1].subscriberAudience",
                "fanout sends no OIDC token",
            ),
            (
                "InMemoryChannel shop/orders",
                "spec.subscribers[1].delivery.retryAfterMax",
                "PT0S (ignore Retry-After) has no equivalent",
            ),
        ],
    );
    assert_eq!(warnings.len(), 2, "{warnings:#?}");
    assert!(import.errors().is_empty(), "{}", import.stderr);
    for name in ["fanout.json", "fanout.yaml", "clusters.yaml"] {
        assert!(import.out().join(name).is_file(), "{name} not written");
    }
}

/// A cluster's name, type, endpoint address and port, and TLS SNI (null without TLS).
fn cluster_summary(cluster: &Value) -> Value {
    let address = &cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        ["address"]["socket_address"];
    json!([
        cluster["name"],
        cluster["type"],
        address["address"],
        address["port_value"],
        cluster["transport_socket"]["typed_config"]["sni"],
    ])
}

#[test]
fn every_uri_becomes_one_cluster_per_scheme_host_and_port() {
    let import = Import::run(ORDERS, "", &[]);
    import.succeeded();
    let clusters = import.json("clusters.yaml");
    let resources = clusters["resources"].as_array().unwrap();
    let summary: Vec<Value> = resources.iter().map(cluster_summary).collect();
    let dns = |name: &str, host: &str, port: u16| json!([name, "STRICT_DNS", host, port, null]);
    assert_eq!(
        summary,
        vec![
            json!([
                "https|audit.example.com|443",
                "STRICT_DNS",
                "audit.example.com",
                443,
                "audit.example.com"
            ]),
            dns(
                "http|analytics.shop.svc.cluster.local|80",
                "analytics.shop.svc.cluster.local",
                80
            ),
            dns(
                "http|audit-dlq.shop.svc.cluster.local|8080",
                "audit-dlq.shop.svc.cluster.local",
                8080
            ),
            dns(
                "http|billing.shop.svc.cluster.local|80",
                "billing.shop.svc.cluster.local",
                80
            ),
            dns(
                "http|enricher.shop.svc.cluster.local|80",
                "enricher.shop.svc.cluster.local",
                80
            ),
            dns(
                "http|orders-dlq.shop.svc.cluster.local|80",
                "orders-dlq.shop.svc.cluster.local",
                80
            ),
            dns(
                "http|orders-enriched-kn-channel.shop.svc.cluster.local|80",
                "orders-enriched-kn-channel.shop.svc.cluster.local",
                80
            ),
            dns(
                "http|shipping.shop.svc.cluster.local|80",
                "shipping.shop.svc.cluster.local",
                80
            ),
        ]
    );
    // https: TLS with SNI, the server's certificate checked for the host against the trust
    // store (no CACerts in the fixture: the default bundle).
    let tls = &resources[0]["transport_socket"];
    assert_eq!(
        tls,
        &json!({
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": { "validation_context": {
                    "trusted_ca": { "filename": "/etc/ssl/certs/ca-certificates.crt" },
                    "match_typed_subject_alt_names": [
                        { "san_type": "DNS", "matcher": { "exact": "audit.example.com" } }
                    ]
                } },
                "sni": "audit.example.com"
            }
        })
    );
    for cluster in &resources[1..] {
        assert!(cluster.get("transport_socket").is_none(), "{cluster}");
    }
}

#[test]
fn fanout_yaml_carries_fanout_json() {
    let wasm = "/opt/fanout/fanout.wasm";
    let import = Import::run(ORDERS, "", &["--wasm", wasm]);
    import.succeeded();
    let filter = import.json("fanout.yaml");
    let config = &filter["resources"][0]["typed_config"]["config"];
    let carried: Value =
        serde_json::from_str(config["configuration"]["value"].as_str().unwrap()).unwrap();
    assert_eq!(carried, import.json("fanout.json"));
    assert_eq!(
        config["vm_config"]["code"]["local"]["filename"],
        json!(wasm)
    );
    let plugin: Value =
        serde_json::from_str(config["configuration"]["value"].as_str().unwrap()).unwrap();
    assert_eq!(plugin, expected_orders_config());
}

#[test]
fn resolve_points_clusters_at_local_addresses_and_keeps_the_uris_host() {
    let import = Import::run(
        ORDERS,
        "",
        &[
            "--resolve",
            "billing.shop.svc.cluster.local=127.0.0.1:18081",
            "--resolve",
            "audit.example.com:443=127.0.0.1:18443",
            "--resolve",
            "nobody.example.com=127.0.0.1:1",
        ],
    );
    import.succeeded();
    let clusters = import.json("clusters.yaml");
    let by_name = |name: &str| {
        clusters["resources"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == json!(name))
            .cloned()
            .unwrap_or_else(|| panic!("no cluster {name}"))
    };
    assert_eq!(
        cluster_summary(&by_name("http|billing.shop.svc.cluster.local|80")),
        json!([
            "http|billing.shop.svc.cluster.local|80",
            "STATIC",
            "127.0.0.1",
            18081,
            null
        ])
    );
    // TLS still names and checks the URI's host.
    assert_eq!(
        cluster_summary(&by_name("https|audit.example.com|443")),
        json!([
            "https|audit.example.com|443",
            "STATIC",
            "127.0.0.1",
            18443,
            "audit.example.com"
        ])
    );
    assert_eq!(
        cluster_summary(&by_name("http|shipping.shop.svc.cluster.local|80"))[1],
        json!("STRICT_DNS")
    );
    // The fan-out config does not change: authority and path stay the URI's.
    assert_eq!(import.json("fanout.json"), expected_orders_config());
    assert_reported(
        &import.warnings(),
        &[(
            "--resolve",
            "nobody.example.com=127.0.0.1:1",
            "no URI in the input names this host",
        )],
    );
}

// ---------------------------------------------------------------------------------------------
// Errors: nothing written.

#[test]
fn an_unresolved_ref_is_an_error_and_nothing_is_written() {
    let import = Import::run(UNRESOLVED, "", &[]);
    assert_eq!(import.code, 1, "{}{}", import.stdout, import.stderr);
    let errors = import.errors();
    assert_reported(
        &errors,
        &[
            (
                "Subscription shop/fraud-check",
                "spec.subscriber.ref",
                "Service shop/fraud is not resolved to a URI \
                 (status.physicalSubscription.subscriberUri is empty)",
            ),
            (
                "Subscription shop/refunds",
                "spec.delivery.deadLetterSink.ref",
                "Service shop/refunds-dlq is not resolved to a URI",
            ),
            (
                "InMemoryChannel shop/payments",
                "spec.subscribers[0].delivery.timeout",
                "'30s' is not an ISO-8601 duration",
            ),
            (
                "InMemoryChannel shop/payments",
                "spec.subscribers[1].subscriberUri",
                "only a replyUri",
            ),
            (
                "KafkaChannel shop/invoices",
                "spec.subscribers",
                "its subscribers would get no events from fanout",
            ),
        ],
    );
    assert_eq!(errors.len(), 5, "{errors:#?}");
    assert!(
        import
            .stderr
            .contains(&format!("{RENDER_PREFIX}: 5 error(s); nothing written")),
        "{}",
        import.stderr
    );
    assert!(
        !import.out().exists(),
        "the output directory was created: {:?}",
        fs::read_dir(import.out()).map(|d| d.count())
    );
}

#[test]
fn errors_leave_files_already_in_the_output_directory_alone() {
    let good = Import::run(ORDERS, "", &[]);
    good.succeeded();
    let before: Vec<String> = ["fanout.json", "fanout.yaml", "clusters.yaml"]
        .iter()
        .map(|n| good.file(n))
        .collect();
    let input = fs::read_to_string(harness::manifest_dir().join(UNRESOLVED)).unwrap();
    let (code, _, stderr) = render_objects(good.dir.path(), &input, &good.out(), &[]);
    assert_eq!(code, 1, "{stderr}");
    let after: Vec<String> = ["fanout.json", "fanout.yaml", "clusters.yaml"]
        .iter()
        .map(|n| good.file(n))
        .collect();
    assert_eq!(before, after);
}

// ---------------------------------------------------------------------------------------------
// Tables of small inputs.

/// InMemoryChannel `test/<name>` at its usual address, with these `spec.subscribers`.
fn in_memory_channel(name: &str, subscribers: Value) -> Value {
    json!({
        "apiVersion": "messaging.knative.dev/v1",
        "kind": "InMemoryChannel",
        "metadata": { "name": name, "namespace": "test", "uid": format!("{name}-uid") },
        "spec": { "subscribers": subscribers },
        "status": { "address": { "url": format!("http://{name}-kn-channel.test.svc.cluster.local") } }
    })
}

/// A List with one InMemoryChannel `test/table` whose subscribers are `subscribers`.
fn channel_with(subscribers: Vec<Value>) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "List",
        "metadata": { "resourceVersion": "" },
        "items": [in_memory_channel("table", Value::Array(subscribers))]
    })
}

/// Subscriber `i` of the table channel, with this delivery.
fn with_delivery(i: usize, delivery: Value) -> Value {
    json!({
        "name": format!("s{i}"),
        "uid": format!("uid-{i}"),
        "subscriberUri": format!("http://s{i}.test.svc.cluster.local/"),
        "delivery": delivery
    })
}

/// The table channel with one subscriber per duration, as its `delivery.timeout`.
fn import_timeouts(durations: impl Iterator<Item = Value>) -> Import {
    let subscribers = durations
        .enumerate()
        .map(|(i, d)| with_delivery(i, json!({ "timeout": d })))
        .collect();
    Import::objects(&channel_with(subscribers), &[])
}

#[test]
fn iso_8601_durations_become_milliseconds() {
    let table: &[(&str, u64)] = &[
        ("PT0.2S", 200),
        ("PT1S", 1000),
        ("PT1.5S", 1500),
        ("PT0,5S", 500),
        ("PT0.001S", 1),
        ("PT0.25S", 250),
        ("PT1M", 60_000),
        ("PT2.5M", 150_000),
        ("PT1H30M", 5_400_000),
        ("PT36H", 129_600_000),
        ("P1D", 86_400_000),
        ("P1DT2H", 93_600_000),
        ("P1W", 604_800_000),
        // A month as Knative's parser counts it: 30.436875 days.
        ("P1M", 2_629_746_000),
        ("+PT3S", 3000),
        ("PT1H0M0.5S", 3_600_500),
    ];
    let import = import_timeouts(table.iter().map(|(d, _)| json!(d)));
    import.succeeded();
    let config = import.json("fanout.json");
    let got = config["channels"][0]["subscribers"].as_array().unwrap();
    for (i, (duration, ms)) in table.iter().enumerate() {
        assert_eq!(got[i]["timeout_ms"], json!(ms), "{duration}");
    }
    // Knative's parser keeps one decimal of each number: where that differs, a warning says so.
    assert_reported(
        &import.warnings(),
        &[
            (
                "InMemoryChannel test/table",
                "spec.subscribers[4].delivery.timeout",
                "so Knative used 0 ms; fanout uses 1 ms",
            ),
            (
                "InMemoryChannel test/table",
                "spec.subscribers[5].delivery.timeout",
                "so Knative used 200 ms; fanout uses 250 ms",
            ),
        ],
    );
    assert_eq!(import.warnings().len(), 2, "{}", import.stderr);
}

#[test]
fn malformed_durations_are_refused_with_the_object_and_field() {
    let table: &[(Value, &str)] = &[
        (json!("3s"), "is not an ISO-8601 duration"),
        (json!("PT"), "it names no amount"),
        (json!("P"), "it names no amount"),
        (json!("1H"), "is not an ISO-8601 duration"),
        (json!("P1H"), "is not an ISO-8601 duration"),
        (json!("PT1.S"), "is not an ISO-8601 duration"),
        (json!("PT1S "), "is not an ISO-8601 duration"),
        (json!("PT1H1H"), "is not an ISO-8601 duration"),
        (json!(""), "is not an ISO-8601 duration"),
        (json!("-PT1S"), "must not be negative"),
        (json!(5), "is not an ISO-8601 duration string"),
        (json!("PT0S"), "must be more than 0"),
        (json!("P50D"), "fanout takes at most 4294967295 ms"),
    ];
    let import = import_timeouts(table.iter().map(|(d, _)| d.clone()));
    assert_eq!(import.code, 1, "{}", import.stderr);
    let errors = import.errors();
    for (i, (duration, message)) in table.iter().enumerate() {
        let field = format!("spec.subscribers[{i}].delivery.timeout");
        assert_reported(
            &errors,
            &[("InMemoryChannel test/table", field.as_str(), message)],
        );
        assert!(
            errors
                .iter()
                .filter(|l| l.contains(&format!("{field}:")))
                .count()
                == 1,
            "{duration}: {errors:#?}"
        );
    }
    assert_eq!(errors.len(), table.len(), "{errors:#?}");
    assert!(!import.out().exists());
}

#[test]
fn backoff_and_retry_after_max_map_to_the_waits_knative_makes() {
    // (Knative delivery, fanout delivery, a warning on this field of it)
    let table: &[(Value, Value, Option<&str>)] = &[
        // Knative waits 1, 2, 4 s; fanout 500 ms x 2^k: the same.
        (
            json!({ "retry": 3, "backoffPolicy": "exponential", "backoffDelay": "PT1S" }),
            json!({ "retry": 3, "backoff_policy": "exponential", "backoff_delay_ms": 500,
                    "backoff_max_ms": 4000 }),
            None,
        ),
        // Linear keeps the delay: fanout waits 1, 2, 3 s.
        (
            json!({ "retry": 3, "backoffPolicy": "linear", "backoffDelay": "PT1S" }),
            json!({ "retry": 3, "backoff_policy": "linear", "backoff_delay_ms": 1000,
                    "backoff_max_ms": 3000 }),
            None,
        ),
        // retryAfterMax above the longest backoff: it is the one cap.
        (
            json!({ "retry": 2, "backoffPolicy": "exponential", "backoffDelay": "PT0.2S",
                    "retryAfterMax": "PT10S" }),
            json!({ "retry": 2, "backoff_policy": "exponential", "backoff_delay_ms": 100,
                    "backoff_max_ms": 10000 }),
            None,
        ),
        // Below it: the cap cannot be lower than Knative's own backoff.
        (
            json!({ "retry": 2, "backoffPolicy": "exponential", "backoffDelay": "PT0.2S",
                    "retryAfterMax": "PT0.3S" }),
            json!({ "retry": 2, "backoff_policy": "exponential", "backoff_delay_ms": 100,
                    "backoff_max_ms": 400 }),
            Some("retryAfterMax"),
        ),
        (
            json!({ "retry": 2, "backoffPolicy": "exponential", "backoffDelay": "PT0.2S",
                    "retryAfterMax": "PT0S" }),
            json!({ "retry": 2, "backoff_policy": "exponential", "backoff_delay_ms": 100,
                    "backoff_max_ms": 400 }),
            Some("retryAfterMax"),
        ),
        // Without both backoffPolicy and backoffDelay, Knative's dispatcher does not wait.
        (
            json!({ "retry": 2, "backoffDelay": "PT0.2S" }),
            json!({ "retry": 2, "backoff_delay_ms": 0, "backoff_max_ms": 0 }),
            Some("backoffDelay"),
        ),
        (
            json!({ "retry": 4 }),
            json!({ "retry": 4, "backoff_delay_ms": 0, "backoff_max_ms": 0 }),
            None,
        ),
        // No retries: nothing to space out.
        (
            json!({ "retry": 0, "backoffPolicy": "exponential", "backoffDelay": "PT1S" }),
            Value::Null,
            None,
        ),
        // A timeout goes on the call and on its dead letter.
        (
            json!({ "timeout": "PT0.5S",
                    "deadLetterSink": { "uri": "http://dlq.test.svc.cluster.local/x?y=1" } }),
            json!({ "dead_letter": { "cluster": "http|dlq.test.svc.cluster.local|80",
                    "authority": "dlq.test.svc.cluster.local", "path": "/x?y=1",
                    "timeout_ms": 500 } }),
            None,
        ),
    ];
    let subscribers = table
        .iter()
        .enumerate()
        .map(|(i, (knative, _, _))| with_delivery(i, knative.clone()))
        .collect();
    let import = Import::objects(&channel_with(subscribers), &[]);
    import.succeeded();
    let config = import.json("fanout.json");
    let warnings = import.warnings();
    for (i, (knative, fanout, warning)) in table.iter().enumerate() {
        let got = &config["channels"][0]["subscribers"][i];
        assert_eq!(got["delivery"], *fanout, "{knative}");
        let field = format!("spec.subscribers[{i}].delivery.");
        let warned: Vec<&String> = warnings.iter().filter(|w| w.contains(&field)).collect();
        match warning {
            Some(name) => assert!(
                warned.len() == 1 && warned[0].contains(&format!("{field}{name}:")),
                "{knative}: {warned:#?}"
            ),
            None => assert!(warned.is_empty(), "{knative}: {warned:#?}"),
        }
    }
    assert_eq!(
        config["channels"][0]["subscribers"][8]["timeout_ms"],
        json!(500)
    );
}

#[test]
fn a_subscriber_without_a_delivery_gets_the_channels_and_one_with_a_delivery_only_its_own() {
    let channel = |dead_letter_resolved: bool, subscribers: Value| {
        let mut status =
            json!({ "address": { "url": "http://d-kn-channel.test.svc.cluster.local" } });
        if dead_letter_resolved {
            status["deadLetterSinkUri"] = json!("http://dlq.test.svc.cluster.local/channel");
        }
        json!({ "apiVersion": "v1", "kind": "List", "items": [{
            "apiVersion": "messaging.knative.dev/v1", "kind": "InMemoryChannel",
            "metadata": { "name": "d", "namespace": "test" },
            "spec": {
                "delivery": { "retry": 3, "timeout": "PT1S", "deadLetterSink": { "ref": {
                    "apiVersion": "v1", "kind": "Service", "name": "dlq" } } },
                "subscribers": subscribers
            },
            "status": status
        }] })
    };
    let subscribers = json!([
        { "subscriberUri": "http://plain.test.svc.cluster.local/" },
        { "subscriberUri": "http://own.test.svc.cluster.local/", "delivery": { "retry": 1 } }
    ]);
    let import = Import::objects(&channel(true, subscribers.clone()), &[]);
    import.succeeded();
    let got = &import.json("fanout.json")["channels"][0]["subscribers"];
    assert_eq!(
        got[0],
        json!({
            "cluster": "http|plain.test.svc.cluster.local|80",
            "authority": "plain.test.svc.cluster.local",
            "path": "/",
            "timeout_ms": 1000,
            "delivery": {
                "retry": 3, "backoff_delay_ms": 0, "backoff_max_ms": 0,
                "dead_letter": {
                    "cluster": "http|dlq.test.svc.cluster.local|80",
                    "authority": "dlq.test.svc.cluster.local",
                    "path": "/channel",
                    "timeout_ms": 1000
                }
            }
        })
    );
    // Nothing of the channel's: no timeout, no dead letter.
    assert_eq!(
        got[1],
        json!({
            "cluster": "http|own.test.svc.cluster.local|80",
            "authority": "own.test.svc.cluster.local",
            "path": "/",
            "delivery": { "retry": 1, "backoff_delay_ms": 0, "backoff_max_ms": 0 }
        })
    );

    // The channel's dead-letter sink, unresolved: an error only for a subscriber that uses it.
    let import = Import::objects(&channel(false, json!([subscribers[1].clone()])), &[]);
    import.succeeded();
    let import = Import::objects(&channel(false, subscribers), &[]);
    assert_eq!(import.code, 1, "{}", import.stderr);
    assert_reported(
        &import.errors(),
        &[(
            "InMemoryChannel test/d",
            "spec.delivery.deadLetterSink.ref",
            "Service test/dlq is not resolved to a URI (status.deadLetterSinkUri is empty)",
        )],
    );
    assert_eq!(import.errors().len(), 1, "{}", import.stderr);
}

#[test]
fn delivery_format_maps_from_the_channel_and_the_subscription() {
    let channel = |channel_format: Value, subscribers: Value| {
        json!({ "apiVersion": "v1", "kind": "List", "items": [{
            "apiVersion": "messaging.knative.dev/v1", "kind": "InMemoryChannel",
            "metadata": { "name": "f", "namespace": "test" },
            "spec": { "delivery": { "format": channel_format }, "subscribers": subscribers },
            "status": { "address": { "url": "http://f-kn-channel.test.svc.cluster.local" } }
        }] })
    };
    let subscribers = json!([
        { "subscriberUri": "http://inherits.test.svc.cluster.local/" },
        { "subscriberUri": "http://own.test.svc.cluster.local/",
          "delivery": { "format": "binary" } },
        { "subscriberUri": "http://none.test.svc.cluster.local/", "delivery": { "retry": 1 } }
    ]);
    let import = Import::objects(&channel(json!("json"), subscribers.clone()), &[]);
    import.succeeded();
    assert!(import.warnings().is_empty(), "{}", import.stderr);
    let config = import.json("fanout.json");
    let got = &config["channels"][0]["subscribers"];
    assert_eq!(got[0]["delivery"], json!({ "format": "json" }));
    assert_eq!(got[1]["delivery"], json!({ "format": "binary" }));
    // A subscriber's own delivery replaces the channel's whole, format included.
    assert_eq!(got[2]["delivery"].get("format"), None, "{}", got[2]);
    // Words fanout takes as they are: the written configuration is accepted.
    fanout::config::Config::from_json(config.to_string().as_bytes())
        .unwrap_or_else(|e| panic!("the imported configuration is refused: {e:?}"));

    let import = Import::objects(&channel(json!("xml"), subscribers), &[]);
    assert_eq!(import.code, 1, "{}", import.stderr);
    assert_reported(
        &import.errors(),
        &[(
            "InMemoryChannel test/f",
            "spec.delivery.format",
            "\"xml\": Knative's formats are json (structured mode) and binary",
        )],
    );
}

/// A Subscription `test/<name>` of `channel` (a KReference), resolved as `physical` says.
fn subscription(name: &str, channel: Value, physical: Value) -> Value {
    json!({
        "apiVersion": "messaging.knative.dev/v1",
        "kind": "Subscription",
        "metadata": { "name": name, "namespace": "test", "uid": format!("{name}-uid") },
        "spec": { "channel": channel, "subscriber": { "ref": {
            "apiVersion": "v1", "kind": "Service", "name": name } } },
        "status": { "physicalSubscription": physical }
    })
}

#[test]
fn what_cannot_be_carried_over_is_an_error_or_a_warning() {
    let uri =
        |name: &str| json!({ "subscriberUri": format!("http://{name}.test.svc.cluster.local") });
    // Errors: each alone in an otherwise good input.
    let errors: &[(Value, &str, &str, &str)] = &[
        (
            subscription(
                "lost",
                json!({ "apiVersion": "messaging.knative.dev/v1", "kind": "InMemoryChannel",
                        "name": "elsewhere" }),
                uri("lost"),
            ),
            "Subscription test/lost",
            "spec.channel",
            "InMemoryChannel test/elsewhere is not in the input, though other channels of \
             namespace test are",
        ),
        (
            in_memory_channel("bad-uri", json!([{ "subscriberUri": "ftp://files.test/" }])),
            "InMemoryChannel test/bad-uri",
            "spec.subscribers[0].subscriberUri",
            "fanout calls absolute http and https URIs only",
        ),
        (
            in_memory_channel(
                "many",
                json!([{ "subscriberUri": "http://a.test/", "delivery": { "retry": 101 } }]),
            ),
            "InMemoryChannel test/many",
            "spec.subscribers[0].delivery.retry",
            "fanout retries at most 100 times",
        ),
        (
            {
                let mut twin = in_memory_channel("twin", json!([]));
                twin["status"]["address"]["url"] =
                    json!("http://table-kn-channel.test.svc.cluster.local");
                twin
            },
            "InMemoryChannel test/twin",
            "status.address.url",
            "host table-kn-channel.test.svc.cluster.local is also InMemoryChannel test/table's",
        ),
        (
            json!({ "apiVersion": "messaging.knative.dev/v1", "kind": "Channel",
                    "metadata": { "name": "kafka-backed", "namespace": "test" },
                    "spec": { "channelTemplate": { "apiVersion": "messaging.knative.dev/v1beta1",
                                                   "kind": "KafkaChannel" } } }),
            "Channel test/kafka-backed",
            "status.address.url",
            "missing, and the channel is not an InMemoryChannel",
        ),
        (
            json!({ "apiVersion": "eventing.knative.dev/v1", "kind": "Trigger",
                    "metadata": { "name": "on-order", "namespace": "test" },
                    "spec": { "broker": "default", "subscriber": { "uri": "http://x.test/" } } }),
            "Trigger test/on-order",
            "spec.subscriber",
            "is not a kind this command imports",
        ),
    ];
    for (object, label, field, message) in errors {
        let mut input = channel_with(vec![uri("base")]);
        input["items"].as_array_mut().unwrap().push(object.clone());
        let import = Import::objects(&input, &[]);
        assert_eq!(import.code, 1, "{label}: {}", import.stderr);
        assert_reported(&import.errors(), &[(label, field, message)]);
        assert_eq!(import.errors().len(), 1, "{}", import.stderr);
        assert!(!import.out().exists());
    }
    // Warnings: all in one input, which is still written.
    let mut input = channel_with(vec![
        json!({ "subscriberUri": "http://a.test.svc.cluster.local" }),
        json!({ "subscriberUri": "https://b.example.com/", "subscriberCACerts": "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----",
                "auth": { "serviceAccountName": "oidc-table" } }),
    ]);
    let items = input["items"].as_array_mut().unwrap();
    items.push(subscription(
        "other-namespace",
        json!({ "apiVersion": "messaging.knative.dev/v1", "kind": "InMemoryChannel",
                "name": "orders", "namespace": "elsewhere" }),
        uri("x"),
    ));
    items.push(
        json!({ "apiVersion": "messaging.knative.dev/v1", "kind": "InMemoryChannel",
                       "metadata": { "name": "fresh", "namespace": "test" } }),
    );
    items.push(
        json!({ "apiVersion": "eventing.knative.dev/v1", "kind": "Broker",
                       "metadata": { "name": "default", "namespace": "test" } }),
    );
    let import = Import::objects(&input, &[]);
    import.succeeded();
    assert_reported(
        &import.warnings(),
        &[
            (
                "InMemoryChannel test/table",
                "spec.subscribers[1].auth",
                "fanout sends no OIDC token",
            ),
            (
                "Subscription test/other-namespace",
                "spec.channel",
                "InMemoryChannel elsewhere/orders is not in the input; the Subscription is not imported",
            ),
            (
                "InMemoryChannel test/fresh",
                "status.address.url",
                "matched by the InMemoryChannel's conventional host \
                 fresh-kn-channel.test.svc.cluster.local",
            ),
            ("Broker test/default", "kind", "is not imported; ignored"),
        ],
    );
    assert_eq!(import.warnings().len(), 4, "{}", import.stderr);
    let config = import.json("fanout.json");
    assert_eq!(
        config["channels"][0]["hosts"],
        json!(["fresh-kn-channel.test.svc.cluster.local"])
    );
    // The CA certificates a subscriber names are what its cluster trusts.
    let clusters = import.json("clusters.yaml");
    let https = clusters["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == json!("https|b.example.com|443"))
        .unwrap();
    assert_eq!(
        https["transport_socket"]["typed_config"]["common_tls_context"]["validation_context"]
            ["trusted_ca"],
        json!({ "inline_string": "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n" })
    );
}

// ---------------------------------------------------------------------------------------------
// In the real Envoy.

/// A test CA and certificates it signs, made with the `openssl` command in `dir`.
struct TestCa {
    dir: PathBuf,
    name: String,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run openssl (the TLS tests make their certificates with it): {e}")
        });
    assert!(
        out.status.success(),
        "openssl {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl TestCa {
    fn new(dir: &Path, name: &str) -> TestCa {
        openssl(
            dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "2",
                "-subj",
                &format!("/CN=fanout test CA {name}"),
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.pem"),
            ],
        );
        TestCa {
            dir: dir.to_owned(),
            name: name.to_owned(),
        }
    }

    fn pem_path(&self) -> PathBuf {
        self.dir.join(format!("{}.pem", self.name))
    }

    fn pem(&self) -> String {
        fs::read_to_string(self.pem_path()).unwrap()
    }

    /// A server certificate for `host` (and its key): (certificate file, key file).
    fn issue(&self, host: &str) -> (PathBuf, PathBuf) {
        let base = format!("{}-{host}", self.name);
        fs::write(
            self.dir.join(format!("{base}.ext")),
            format!(
                "subjectAltName=DNS:{host}\nbasicConstraints=CA:FALSE\n\
                 keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
            ),
        )
        .unwrap();
        openssl(
            &self.dir,
            &[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-subj",
                &format!("/CN={host}"),
                "-keyout",
                &format!("{base}.key"),
                "-out",
                &format!("{base}.csr"),
            ],
        );
        openssl(
            &self.dir,
            &[
                "x509",
                "-req",
                "-in",
                &format!("{base}.csr"),
                "-CA",
                &format!("{}.pem", self.name),
                "-CAkey",
                &format!("{}.key", self.name),
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                &format!("{base}.ext"),
                "-out",
                &format!("{base}.pem"),
            ],
        );
        (
            self.dir.join(format!("{base}.pem")),
            self.dir.join(format!("{base}.key")),
        )
    }
}

/// An https server for `hosts`: an Envoy terminating TLS with this certificate, only for a
/// client whose SNI names one of them, and passing every request on to `backend`, a plain
/// subscriber (which then records what arrived over TLS).
fn tls_front(cert: &Path, key: &Path, hosts: &[&str], backend: &Subscriber) -> Envoy {
    let builder = Envoy::builder()
        .plain_proxy_to("backend")
        .cluster("backend", backend.port());
    let mut resources = builder.bootstrap()["static_resources"].clone();
    let chain = &mut resources["listeners"][0]["filter_chains"][0];
    chain["filter_chain_match"] = json!({ "server_names": hosts });
    chain["transport_socket"] = json!({
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "common_tls_context": { "tls_certificates": [ {
                "certificate_chain": { "filename": cert },
                "private_key": { "filename": key }
            } ] }
        }
    });
    // The listener reads the SNI before it picks a filter chain.
    resources["listeners"][0]["listener_filters"] = json!([{
        "name": "envoy.filters.listener.tls_inspector",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector"
        }
    }]);
    builder
        .bootstrap_field("static_resources", resources)
        .start()
}

/// Runs the import on `input`, with `--resolve` for each (host, port), and the built filter
/// (on the native build, `--build native`).
fn import_for_envoy(input: &str, stdin: &str, resolve: &[(&str, u16)], extra: &[&str]) -> Import {
    let build: Vec<String> = harness::control::build_args(&[])
        .into_iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let resolve: Vec<String> = resolve
        .iter()
        .map(|(host, port)| format!("{host}=127.0.0.1:{port}"))
        .collect();
    let mut args: Vec<&str> = build.iter().map(String::as_str).collect();
    for r in &resolve {
        args.extend(["--resolve", r.as_str()]);
    }
    args.extend_from_slice(extra);
    let import = Import::run(input, stdin, &args);
    import.succeeded();
    // Every cluster on loopback: nothing may send a DNS query or traffic elsewhere.
    for cluster in import.json("clusters.yaml")["resources"]
        .as_array()
        .unwrap()
    {
        let summary = cluster_summary(cluster);
        assert_eq!(
            (&summary[1], &summary[2]),
            (&json!("STATIC"), &json!("127.0.0.1")),
            "cluster {} is not on loopback",
            summary[0]
        );
    }
    import
}

/// Envoy on the shipped ConfigMap bootstrap with the files the import wrote: it must take
/// both whole (it ignores unknown fields of xDS resources, so those are checked too).
fn envoy_on(import: &Import) -> ReloadEnvoy {
    let envoy =
        ReloadEnvoy::start_on_files(import.file("fanout.yaml"), import.file("clusters.yaml"));
    let clusters = import.json("clusters.yaml")["resources"]
        .as_array()
        .unwrap()
        .len() as u64;
    let at_least_once = |v: u64| v >= 1;
    let none = |v: u64| v == 0;
    // The written clusters, and the bootstrap's own static ones (the admin_read listener's).
    let static_clusters =
        crate::harness::read_shipped_yaml(crate::harness::reload::SHIPPED_BOOTSTRAP)
            ["static_resources"]["clusters"]
            .as_array()
            .map_or(0, Vec::len) as u64;
    let every_cluster = |v: u64| v == clusters + static_clusters;
    let checks: [(String, &dyn Fn(u64) -> bool); 6] = [
        (format!("{ECDS}.update_success"), &at_least_once),
        (format!("{ECDS}.update_rejected"), &none),
        (
            "cluster_manager.cds.update_success".to_owned(),
            &at_least_once,
        ),
        ("cluster_manager.cds.update_rejected".to_owned(), &none),
        ("cluster_manager.active_clusters".to_owned(), &every_cluster),
        ("server.dynamic_unknown_fields".to_owned(), &none),
    ];
    for (stat, ok) in checks {
        let value = envoy.stat(&stat).unwrap_or(0);
        assert!(
            ok(value),
            "{stat} is {value} ({clusters} clusters written): Envoy did not take the written \
             files as they are. Log:\n{}",
            envoy.log()
        );
    }
    envoy
}

/// A binary-mode CloudEvent to the channel whose host is `host`.
fn send_event(envoy: &ReloadEnvoy, host: &str, id: &str) -> harness::Reply {
    let client = Client::http1_resolving(host, envoy.addr());
    send(
        client
            .post(&format!("http://{host}:{}/", envoy.port()))
            .header("ce-specversion", "1.0")
            .header("ce-id", id)
            .header("ce-source", "/shop/checkout")
            .header("ce-type", "com.example.order.created")
            .header("content-type", "application/json")
            .body(format!("{{\"order\":\"{id}\"}}")),
    )
}

/// `sub` got exactly `n` POSTs, each on `path` with `authority`. Called once the fan-out has
/// answered: in sync mode that is after every attempt, dead letter and reply, so the counts
/// are final.
fn assert_got(sub: &Subscriber, n: usize, path: &str, authority: &str) {
    let requests = sub.requests();
    assert_eq!(requests.len(), n, "{}: {requests:#?}", sub.name());
    for r in &requests {
        assert_eq!(
            (r.method.as_str(), r.path.as_str(), r.authority()),
            ("POST", path, Some(authority)),
            "{}",
            sub.name()
        );
    }
}

#[test]
fn the_written_files_fan_an_event_out_in_the_real_envoy() {
    let billing = Subscriber::start("billing", Behavior::Status(503));
    let audit = Subscriber::start("audit", Behavior::Status(503));
    let enricher = Subscriber::start(
        "enricher",
        Behavior::Respond {
            status: 200,
            headers: vec![
                ("ce-specversion".into(), "1.0".into()),
                ("ce-id".into(), "enriched-1".into()),
                ("ce-source".into(), "/shop/enricher".into()),
                ("ce-type".into(), "com.example.order.enriched".into()),
                ("content-type".into(), "application/json".into()),
            ],
            body: "{\"order\":\"o-1\",\"priority\":\"high\"}".into(),
        },
    );
    let analytics = Subscriber::ok("analytics");
    let reply_sink = Subscriber::ok("orders-enriched");
    let orders_dlq = Subscriber::ok("orders-dlq");
    let audit_dlq = Subscriber::ok("audit-dlq");
    let shipping = Subscriber::ok("shipping");

    // audit.example.com is https: a TLS Envoy with a certificate from a test CA, which the
    // audit subscriber names in subscriberCACerts (as Knative's CACerts).
    let pki = TempDir::new("fanout-knative-pki", "the test certificates");
    let ca = TestCa::new(pki.path(), "ca");
    let (cert, key) = ca.issue("audit.example.com");
    let tls = tls_front(&cert, &key, &["audit.example.com"], &audit);
    let mut objects: Value =
        serde_json::from_str(&fs::read_to_string(harness::manifest_dir().join(ORDERS)).unwrap())
            .unwrap();
    let imc = &mut objects["items"][1];
    assert_eq!(imc["kind"], json!("InMemoryChannel"));
    assert_eq!(imc["spec"]["subscribers"][1]["name"], json!("audit"));
    imc["spec"]["subscribers"][1]["subscriberCACerts"] = json!(ca.pem());

    let import = import_for_envoy(
        "-",
        &objects.to_string(),
        &[
            ("billing.shop.svc.cluster.local", billing.port()),
            ("audit.example.com", tls.port()),
            ("enricher.shop.svc.cluster.local", enricher.port()),
            ("analytics.shop.svc.cluster.local", analytics.port()),
            (
                "orders-enriched-kn-channel.shop.svc.cluster.local",
                reply_sink.port(),
            ),
            ("orders-dlq.shop.svc.cluster.local", orders_dlq.port()),
            ("audit-dlq.shop.svc.cluster.local", audit_dlq.port()),
            ("shipping.shop.svc.cluster.local", shipping.port()),
        ],
        &[],
    );
    let envoy = envoy_on(&import);

    let reply = send_event(&envoy, "orders-kn-channel.shop.svc.cluster.local", "o-1");
    // billing and audit never took it; their dead-letter sinks did: that is delivered.
    assert_202(&reply);
    assert_eq!(reply.header("x-fanout-dead-lettered").as_deref(), Some("2"));

    // The channel's delivery: retry 2, then its dead letter at the path the URI named.
    assert_got(
        &billing,
        3,
        "/events?source=orders",
        "billing.shop.svc.cluster.local",
    );
    let attempts = billing.requests();
    // Knative's waits before retries 1 and 2 (backoffDelay PT0.3S, exponential): 300, 600 ms.
    // Lower bounds only: Envoy's timers may fire a tick early, and anything late under load.
    for (k, wait_ms) in [(1, 300), (2, 600)] {
        assert_waited_at_least(
            attempts[k].at - attempts[k - 1].at,
            Duration::from_millis(wait_ms),
            &format!("billing's retry {k} after the attempt before it (Knative's wait)"),
        );
    }
    assert_got(&orders_dlq, 1, "/dead", "orders-dlq.shop.svc.cluster.local");
    let dead = orders_dlq.only_request();
    assert_eq!(
        dead.header("x-fanout-failed-cluster"),
        Some("http|billing.shop.svc.cluster.local|80")
    );
    assert_eq!(dead.body, b"{\"order\":\"o-1\"}");

    // audit's own delivery replaced the channel's: one retry (not two), its own dead letter.
    // Its two attempts came over TLS, the certificate checked against the CA it named.
    assert_got(&audit, 2, "/ingest", "audit.example.com");
    assert_got(&audit_dlq, 1, "/", "audit-dlq.shop.svc.cluster.local:8080");
    assert_eq!(
        audit_dlq.only_request().header("x-fanout-failed-cluster"),
        Some("https|audit.example.com|443")
    );

    // enrich answered with an event: it went to the reply URI.
    assert_got(&enricher, 1, "/", "enricher.shop.svc.cluster.local");
    assert_got(
        &reply_sink,
        1,
        "/",
        "orders-enriched-kn-channel.shop.svc.cluster.local",
    );
    let reply_event = reply_sink.only_request();
    assert_eq!(reply_event.header("ce-id"), Some("enriched-1"));
    assert_eq!(
        reply_event.body,
        b"{\"order\":\"o-1\",\"priority\":\"high\"}"
    );

    // analytics came from its Subscription alone.
    assert_got(&analytics, 1, "/", "analytics.shop.svc.cluster.local");
    assert_eq!(shipping.count(), 0);

    // The second channel, by its own host.
    let reply = send_event(
        &envoy,
        "orders-enriched-kn-channel.shop.svc.cluster.local",
        "e-1",
    );
    assert_202(&reply);
    assert_got(&shipping, 1, "/in", "shipping.shop.svc.cluster.local");
}

#[test]
fn an_https_subscriber_must_present_a_certificate_for_its_host_from_a_ca_it_trusts() {
    let backend = Subscriber::ok("backend");
    let pki = TempDir::new("fanout-knative-pki", "the test certificates");
    let ca = TestCa::new(pki.path(), "ca");
    let unrelated = TestCa::new(pki.path(), "unrelated");
    let (cert, key) = ca.issue("audit.example.com");
    let tls = tls_front(
        &cert,
        &key,
        &["audit.example.com", "other.example.com"],
        &backend,
    );
    let objects = channel_with(vec![
        // The right host and the CA that signed its certificate: delivered.
        json!({ "subscriberUri": "https://audit.example.com/good",
                "subscriberCACerts": ca.pem() }),
        // A certificate from the CA it trusts, but for another host: refused.
        json!({ "subscriberUri": "https://other.example.com/wrong-host",
                "subscriberCACerts": ca.pem() }),
        // The right host, but no CACerts: the trust store (--trusted-ca) does not know the CA.
        json!({ "subscriberUri": "https://audit.example.com:8443/untrusted" }),
    ]);
    let trusted = unrelated.pem_path().to_string_lossy().into_owned();
    let import = import_for_envoy(
        "-",
        &objects.to_string(),
        &[
            ("audit.example.com", tls.port()),
            ("other.example.com", tls.port()),
        ],
        &["--trusted-ca", &trusted],
    );
    let envoy = envoy_on(&import);
    let reply = send_event(&envoy, "table-kn-channel.test.svc.cluster.local", "t-1");
    assert_status(&reply, 500);
    let report = reply.json();
    let mut failed: Vec<&str> = report["failed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["cluster"].as_str().unwrap())
        .collect();
    failed.sort_unstable();
    assert_eq!(
        failed,
        vec![
            "https|audit.example.com|8443",
            "https|other.example.com|443"
        ],
        "{report}"
    );
    assert_eq!(report["delivered"], json!(1), "{report}");
    assert_got(&backend, 1, "/good", "audit.example.com");
}
