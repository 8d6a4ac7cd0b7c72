//! Who may send, imported from Knative: `fanout-control render --oidc-issuer` turns the
//! EventPolicies of `tests/fixtures/knative/senders.json` into Envoy's jwt_authn and rbac
//! (senders-jwt.yaml, senders-rbac.yaml), and the real Envoy runs them before fanout on the
//! shipped `envoy/configmap/envoy-senders.yaml`, from a ConfigMap volume.
//!
//! The fixture: three InMemoryChannels in `default`. `orders` (label team=shop): the policy
//! `orders-producer` names it by ref and allows what Knative resolved its ApiServerSource to
//! (status.from); `shop-partners` selects team=shop channels and allows the pattern
//! `system:serviceaccount:partners:*`. `payments` (team=finance): `ledger-writer` selects it
//! by a matchExpression and allows a ServiceAccount of namespace `finance` by ref. `audit`: no
//! policy applies, so Knative's default mode, allow-same-namespace, does.
//!
//! Per channel an allowed and a refused sender, with tokens minted at test time
//! (tests/fixtures/authz/mint.py): 202 and the subscriber called, or 401/403 and nobody.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::harness;

use harness::reload::{shipped_bootstrap_from, ConfigMapVolume};
use harness::sdk::sdk_python;
use harness::{send, Client, Envoy, Subscriber, TempDir};
use serde_json::{json, Value};

const FIXTURE: &str = "tests/fixtures/knative/senders.json";
pub(crate) const ISSUER: &str = "https://kubernetes.default.svc.cluster.local";
const SA: &str = "system:serviceaccount";

fn audience(channel: &str) -> String {
    format!("messaging.knative.dev/inmemorychannel/default/{channel}")
}

fn host(channel: &str) -> String {
    format!("{channel}-kn-channel.default.svc.cluster.local")
}

/// Tokens by name, from (name, subject, audience), issued by [`ISSUER`]; the JWKS into `dir`.
pub(crate) fn mint(
    dir: &std::path::Path,
    tokens: &[(&str, String, String)],
) -> BTreeMap<String, String> {
    let spec: serde_json::Map<String, Value> = tokens
        .iter()
        .map(|(name, sub, aud)| {
            (
                name.to_string(),
                json!({ "sub": sub, "aud": aud, "iss": ISSUER }),
            )
        })
        .collect();
    let out = std::process::Command::new(sdk_python())
        .arg(harness::manifest_dir().join("tests/fixtures/authz/mint.py"))
        .arg(dir)
        .arg(Value::Object(spec).to_string())
        .output()
        .expect("run mint.py");
    assert!(
        out.status.success(),
        "mint.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `fanout-control render` on the objects of the file `input`, into `out`.
fn import(input: &std::path::Path, out: &std::path::Path, args: &[&str]) -> (i32, String, String) {
    let objects = std::fs::read_to_string(input).unwrap();
    let dir = TempDir::new("fanout-senders-source", "the objects rendered");
    harness::control::render_objects(dir.path(), &objects, out, args)
}

#[test]
fn event_policies_decide_who_may_send_to_each_imported_channel() {
    let billing = Subscriber::ok("billing");
    let ledger = Subscriber::ok("ledger");
    let audit = Subscriber::ok("audit");
    let out = TempDir::new("fanout-senders", "the import's files");
    let mut volume = ConfigMapVolume::new();
    let jwks_path = volume.path().join("jwks.json");
    let resolve: Vec<String> = [&billing, &ledger, &audit]
        .iter()
        .map(|s| {
            format!(
                "{}.default.svc.cluster.local=127.0.0.1:{}",
                s.name(),
                s.port()
            )
        })
        .collect();
    let mut args: Vec<String> = harness::control::build_args(&[])
        .into_iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    args.extend([
        "--oidc-issuer".to_owned(),
        ISSUER.to_owned(),
        "--jwks".to_owned(),
        jwks_path.display().to_string(),
    ]);
    for r in &resolve {
        args.extend(["--resolve".to_owned(), r.clone()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let fixture = harness::manifest_dir().join(FIXTURE);
    let (code, stdout, stderr) = import(&fixture, out.path(), &args);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("3 EventPolicy(ies)"), "{stdout}");

    let keys = TempDir::new("fanout-senders-keys", "the JWKS and tokens");
    let tokens = mint(
        keys.path(),
        &[
            (
                "orders_producer",
                format!("{SA}:default:orders-producer"),
                audience("orders"),
            ),
            (
                "partner",
                format!("{SA}:partners:reseller-7"),
                audience("orders"),
            ),
            (
                "partner_upper",
                format!("{SA}:PARTNERS:reseller-8"),
                audience("orders"),
            ),
            (
                "intruder",
                format!("{SA}:default:intruder"),
                audience("orders"),
            ),
            (
                "orders_producer_for_audit",
                format!("{SA}:default:orders-producer"),
                audience("audit"),
            ),
            (
                "ledger_writer",
                format!("{SA}:finance:ledger-writer"),
                audience("payments"),
            ),
            (
                "partner_on_payments",
                format!("{SA}:partners:reseller-7"),
                audience("payments"),
            ),
            (
                "default_on_audit",
                format!("{SA}:default:anyone"),
                audience("audit"),
            ),
            (
                "partner_on_audit",
                format!("{SA}:partners:reseller-7"),
                audience("audit"),
            ),
        ],
    );
    let jwks = std::fs::read_to_string(keys.path().join("jwks.json")).unwrap();
    let file = |name: &str| std::fs::read_to_string(out.path().join(name)).unwrap();
    volume.publish(&[
        ("fanout.yaml", &file("fanout.yaml")),
        ("clusters.yaml", &file("clusters.yaml")),
        ("senders-jwt.yaml", &file("senders-jwt.yaml")),
        ("senders-rbac.yaml", &file("senders-rbac.yaml")),
        ("jwks.json", &jwks),
    ]);
    let bootstrap = shipped_bootstrap_from("envoy/configmap/envoy-senders.yaml", volume.path());
    let mut builder = Envoy::builder();
    for key in ["node", "admin", "dynamic_resources", "static_resources"] {
        builder = builder.bootstrap_field(key, bootstrap[key].clone());
    }
    let envoy = builder.start();
    for filter in ["senders-jwt", "senders-rbac", "fanout"] {
        envoy.expect_stat(
            &format!("extension_config_discovery.http_filter.{filter}.config_reload"),
            |n| n >= 1,
            Duration::from_secs(10),
        );
    }
    assert_eq!(envoy.stat("server.dynamic_unknown_fields").unwrap_or(0), 0);

    let post = |channel: &str, token: Option<&str>| {
        let host = host(channel);
        let client = Client::http1_resolving(&host, envoy.addr());
        let mut request = client
            .post(&format!("http://{host}:{}/", envoy.port()))
            .header("ce-specversion", "1.0")
            .header("ce-id", "1")
            .header("ce-source", "/e2e/senders")
            .header("ce-type", "e2e.senders")
            .header("content-type", "application/json")
            .body("{}");
        if let Some(name) = token {
            request = request.header("authorization", format!("Bearer {}", tokens[name]));
        }
        send(request)
    };
    // (channel, token, status): one row per rule of the fixture.
    let cases: &[(&str, Option<&str>, u16)] = &[
        ("orders", Some("orders_producer"), 202), // status.from of a ref
        ("orders", Some("partner"), 202),         // a `sub` pattern of a selected policy
        ("orders", Some("partner_upper"), 202),   // compared without case, as Knative does
        ("orders", Some("intruder"), 403),        // same namespace, but policies apply
        ("orders", Some("orders_producer_for_audit"), 403), // a token for another channel
        ("orders", None, 401),                    // no token
        ("payments", Some("ledger_writer"), 202), // a ServiceAccount ref, by matchExpression
        ("payments", Some("partner_on_payments"), 403), // team=shop's policy is not payments'
        ("audit", Some("default_on_audit"), 202), // no policy: allow-same-namespace
        ("audit", Some("partner_on_audit"), 403),
    ];
    for (channel, token, status) in cases {
        let reply = post(channel, *token);
        assert_eq!(
            reply.status,
            *status,
            "{channel} with {token:?}: {}",
            reply.text()
        );
    }
    assert_eq!(billing.wait_for(3, Duration::from_secs(5)), 3);
    assert_eq!(ledger.wait_for(1, Duration::from_secs(5)), 1);
    assert_eq!(audit.wait_for(1, Duration::from_secs(5)), 1);
    envoy.expect_stat(
        "wasmcustom.fanout.requests.received",
        |n| n == 5,
        Duration::from_secs(5),
    );
    billing.stays_at(3, Duration::from_millis(300));
}

#[test]
fn what_cannot_be_enforced_is_an_error_naming_the_policy_and_field() {
    let dir = TempDir::new("fanout-senders-errors", "inputs");
    let channel = json!({
        "apiVersion": "messaging.knative.dev/v1", "kind": "InMemoryChannel",
        "metadata": { "name": "orders", "namespace": "default" },
        "spec": { "subscribers": [{ "uid": "u1", "subscriberUri": "http://billing.default.svc.cluster.local/" }] },
        "status": { "address": { "url": "http://orders-kn-channel.default.svc.cluster.local",
                                 "audience": audience("orders") } }
    });
    let policy = |name: &str, spec: Value| {
        json!({ "apiVersion": "eventing.knative.dev/v1alpha1", "kind": "EventPolicy",
                "metadata": { "name": name, "namespace": "default" }, "spec": spec })
    };
    let run = |items: Vec<Value>, extra: &[&str]| {
        let input = dir.path().join("objects.json");
        std::fs::write(
            &input,
            json!({ "kind": "List", "apiVersion": "v1", "items": items }).to_string(),
        )
        .unwrap();
        let out = dir.path().join("out");
        let (code, _, stderr) = import(&input, &out, extra);
        (code, stderr, out.join("fanout.json").exists())
    };
    let oidc = ["--oidc-issuer", ISSUER];
    let filtered = policy(
        "filtered",
        json!({ "from": [{ "sub": "x" }], "filters": [{ "exact": { "type": "a" } }] }),
    );
    let unresolved = policy(
        "unresolved",
        json!({ "from": [{ "ref": { "apiVersion": "sources.knative.dev/v1", "kind": "PingSource", "name": "p" } }] }),
    );
    let plain = policy("plain", json!({ "from": [{ "sub": "x" }] }));
    let cases: Vec<(Vec<Value>, &[&str], &str)> = vec![
        (vec![channel.clone(), filtered], &oidc, "EventPolicy default/filtered: spec.filters:"),
        (vec![channel.clone(), unresolved], &oidc, "EventPolicy default/unresolved: spec.from[0].ref: PingSource default/p"),
        (vec![channel.clone(), plain], &[], "EventPolicy default/plain: kind: EventPolicy: who may send is enforced only with --oidc-issuer"),
    ];
    for (items, extra, expected) in cases {
        let (code, stderr, written) = run(items, extra);
        assert_eq!(code, 1, "{stderr}");
        assert!(stderr.contains(expected), "{expected:?} not in:\n{stderr}");
        assert!(!written, "nothing may be written on an error");
    }
    // A channel without an audience cannot have its tokens checked.
    let mut no_audience = channel.clone();
    no_audience["status"]["address"]
        .as_object_mut()
        .unwrap()
        .remove("audience");
    let (code, stderr, _) = run(vec![no_audience], &oidc);
    assert_eq!(code, 1);
    assert!(
        stderr.contains("InMemoryChannel default/orders: status.address.audience: missing"),
        "{stderr}"
    );
}
