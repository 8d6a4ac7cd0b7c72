//! Who may send: the shipped sender-authorization configurations (`envoy/authz/`) in the real
//! Envoy, with keys, certificates and tokens made by the test.
//!
//! - JWT (`envoy/authz/envoy-jwt.yaml`): Envoy's `jwt_authn` checks the bearer token against
//!   the channel's provider, `rbac` allows the channel's subjects, then fanout. An allowed
//!   sender gets 202 and the subscriber the event; an expired token, a wrong issuer, a wrong
//!   audience, a token for another channel, no token, a tampered signature, a key not in the
//!   JWKS, a subject the channel does not allow: 401/403 from Envoy, nobody called, and fanout
//!   counts nothing received (the refused request never reached it).
//! - mTLS (`envoy/authz/envoy-mtls.yaml`): the listener asks for a client certificate signed by
//!   the senders' CA, `rbac` allows the channel's SANs: an allowed SAN gets 202, another SAN
//!   403, no certificate is refused at the TLS handshake.
//!
//! Tokens are signed by `tests/fixtures/authz/mint.py` (PyJWT in the Envoy venv, `make sdk`)
//! with an RSA key it makes on each run; certificates by openssl, also made on each run.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::harness;

use harness::sdk::sdk_python;
use harness::{read_shipped_yaml, send, wasm_path, Client, Envoy, Subscriber, TempDir};
use serde_json::{json, Value};

/// The shipped bootstrap `rel`, made to run here: listener and admin on free loopback ports,
/// each cluster at its subscriber, the wasm module and the files it names (`/etc/fanout/...`)
/// in `dir`.
fn shipped_bootstrap(rel: &str, subscribers: &[&Subscriber], dir: &Path) -> Value {
    let mut text = serde_json::to_string(&read_shipped_yaml(rel)).unwrap();
    text = text.replace(
        "/etc/fanout-wasm/fanout.wasm",
        &wasm_path().display().to_string(),
    );
    text = text.replace("/etc/fanout/", &format!("{}/", dir.display()));
    let mut bootstrap: Value = serde_json::from_str(&text).unwrap();
    let listener = &mut bootstrap["static_resources"]["listeners"][0];
    listener["address"]["socket_address"]["port_value"] = json!(0);
    // The harness finds the listener by this name.
    listener["name"] = json!("ingress");
    for cluster in bootstrap["static_resources"]["clusters"]
        .as_array_mut()
        .unwrap()
    {
        let name = cluster["name"].as_str().unwrap().to_owned();
        let subscriber = subscribers
            .iter()
            .find(|s| s.name() == name)
            .unwrap_or_else(|| panic!("{rel}: no subscriber for cluster {name}"));
        cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
            ["socket_address"]["port_value"] = json!(subscriber.port());
    }
    bootstrap
}

fn start_shipped(rel: &str, subscribers: &[&Subscriber], dir: &Path) -> Envoy {
    let bootstrap = shipped_bootstrap(rel, subscribers, dir);
    Envoy::builder()
        .bootstrap_field("static_resources", bootstrap["static_resources"].clone())
        .start()
}

/// Mints the keys and tokens into `dir` (jwks.json) and returns the tokens by name.
fn mint(dir: &Path) -> BTreeMap<String, String> {
    let script = harness::manifest_dir().join("tests/fixtures/authz/mint.py");
    let out = Command::new(sdk_python())
        .arg(&script)
        .arg(dir)
        .output()
        .expect("run mint.py");
    assert!(
        out.status.success(),
        "mint.py failed (PyJWT is installed by `make sdk`):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("mint.py prints a JSON object")
}

fn event(client: &Client, envoy: &Envoy, host: &str, token: Option<&str>) -> harness::Reply {
    let mut request = client
        .post(&format!("http://{host}:{}/", envoy.port()))
        .header("content-type", "application/json")
        .header("ce-specversion", "1.0")
        .header("ce-id", "1")
        .header("ce-source", "/e2e/authz")
        .header("ce-type", "e2e.authz")
        .body("{}");
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    send(request)
}

#[test]
fn jwt_senders_are_allowed_per_channel_and_the_rest_refused_before_fanout() {
    let dir = TempDir::new("fanout-authz", "JWKS and tokens");
    let tokens = mint(dir.path());
    let billing = Subscriber::ok("billing");
    let ledger = Subscriber::ok("ledger");
    let envoy = start_shipped(
        "envoy/authz/envoy-jwt.yaml",
        &[&billing, &ledger],
        dir.path(),
    );
    let orders = Client::http1_resolving("orders.default", envoy.addr());
    let payments = Client::http1_resolving("payments.default", envoy.addr());

    // Refused: status from Envoy, and Envoy's words for why.
    let refused: &[(&str, Option<&str>, u16, &str)] = &[
        ("no token", None, 401, "Jwt is missing"),
        ("expired", Some("expired"), 401, "Jwt is expired"),
        (
            "wrong issuer",
            Some("wrong_issuer"),
            401,
            "Jwt issuer is not configured",
        ),
        (
            "tampered signature",
            Some("tampered"),
            401,
            "Jwt verification fails",
        ),
        (
            "a key not in the JWKS",
            Some("other_key"),
            401,
            "Jwt verification fails",
        ),
        (
            "wrong audience",
            Some("wrong_audience"),
            403,
            "Audiences in Jwt are not allowed",
        ),
        (
            "for another channel",
            Some("for_payments_channel"),
            403,
            "Audiences in Jwt are not allowed",
        ),
        (
            "a subject the channel does not allow",
            Some("other_subject"),
            403,
            "RBAC: access denied",
        ),
    ];
    for (what, token, status, words) in refused {
        let token = token.map(|name| tokens[name].as_str());
        let reply = event(&orders, &envoy, "orders.default", token);
        assert_eq!(reply.status, *status, "{what}: {}", reply.text());
        assert!(
            reply.text().contains(words),
            "{what}: {:?} lacks {words:?}",
            reply.text()
        );
    }
    // The payments sender's own token is not for orders either.
    let reply = event(&orders, &envoy, "orders.default", Some(&tokens["payments"]));
    assert_eq!(
        reply.status,
        403,
        "the payments sender on orders: {}",
        reply.text()
    );

    // Allowed: each sender on its own channel.
    let reply = event(&orders, &envoy, "orders.default", Some(&tokens["orders"]));
    assert_eq!(reply.status, 202, "{}", reply.text());
    let reply = event(
        &payments,
        &envoy,
        "payments.default",
        Some(&tokens["payments"]),
    );
    assert_eq!(reply.status, 202, "{}", reply.text());
    assert_eq!(billing.wait_for(1, Duration::from_secs(5)), 1);
    assert_eq!(ledger.wait_for(1, Duration::from_secs(5)), 1);
    // The subscriber gets the event, not the sender's credentials.
    let got = billing.only_request();
    assert_eq!(got.header("ce-id"), Some("1"));
    assert_eq!(got.header("authorization"), None);
    // Nor an x-request-id Envoy made up (generate_request_id: false).
    assert_eq!(got.header("x-request-id"), None);

    // fanout saw only the two it answered: a refused sender never reached it.
    envoy.expect_stat(
        "wasmcustom.fanout.requests.received",
        |n| n == 2,
        Duration::from_secs(5),
    );
    assert_eq!(envoy.stat("wasmcustom.fanout.requests.accepted"), Some(2));
    assert_eq!(
        envoy
            .stat("wasmcustom.fanout.requests.reached_router")
            .unwrap_or(0),
        0
    );
    // Seven bad tokens and the payments sender's token were jwt_authn's to refuse; the one
    // valid token of a subject orders does not list was rbac's.
    assert_eq!(envoy.stat("http.fanout_ingress.jwt_authn.denied"), Some(8));
    assert_eq!(envoy.stat("http.fanout_ingress.rbac.denied"), Some(1));
    billing.stays_at(1, Duration::from_millis(300));
}

/// A CA, and certificates it signs for the server and for each client SAN, made by openssl.
fn make_certificates(dir: &Path, clients: &[(&str, &str)]) {
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl (apt-get install openssl)");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let sign = |name: &str, subject: &str, san: &str, ca: &str| {
        run(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-subj",
            subject,
            "-out",
            &format!("{name}.csr"),
        ]);
        fs::write(
            dir.join(format!("{name}.ext")),
            format!("subjectAltName={san}\n"),
        )
        .unwrap();
        run(&[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.crt"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            &format!("{name}.ext"),
            "-out",
            &format!("{name}.crt"),
        ]);
    };
    for ca in ["senders-ca", "other-ca"] {
        run(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &format!("{ca}.key"),
            "-subj",
            &format!("/CN={ca}"),
            "-days",
            "1",
            "-out",
            &format!("{ca}.crt"),
        ]);
    }
    sign(
        "server",
        "/CN=orders.default",
        "DNS:orders.default,DNS:payments.default",
        "senders-ca",
    );
    for (name, san) in clients {
        sign(name, &format!("/CN={name}"), san, "senders-ca");
    }
    sign(
        "stranger",
        "/CN=stranger",
        "URI:spiffe://cluster.local/ns/default/sa/orders-producer",
        "other-ca",
    );
}

/// POSTs an event with curl over TLS, with the client certificate `cert` if any; returns the
/// status, or None when the TLS handshake failed.
fn curl_event(dir: &Path, envoy: &Envoy, host: &str, cert: Option<&str>) -> Option<u16> {
    let mut command = Command::new("curl");
    command
        .current_dir(dir)
        .args([
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
            "10",
        ])
        .args(["--cacert", "senders-ca.crt"])
        .args(["--resolve", &format!("{host}:{}:127.0.0.1", envoy.port())])
        .args([
            "-H",
            "content-type: application/json",
            "-H",
            "ce-specversion: 1.0",
        ])
        .args([
            "-H",
            "ce-id: 1",
            "-H",
            "ce-source: /e2e/authz",
            "-H",
            "ce-type: e2e.authz",
        ])
        .args(["--data", "{}", &format!("https://{host}:{}/", envoy.port())]);
    if let Some(cert) = cert {
        command.args([
            "--cert",
            &format!("{cert}.crt"),
            "--key",
            &format!("{cert}.key"),
        ]);
    }
    let out = command.output().expect("curl");
    let code: u16 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or(0);
    (code != 0).then_some(code)
}

#[test]
fn mtls_senders_are_allowed_by_their_certificates_san_per_channel() {
    let dir = TempDir::new("fanout-authz-mtls", "certificates");
    make_certificates(
        dir.path(),
        &[
            (
                "orders-producer",
                "URI:spiffe://cluster.local/ns/default/sa/orders-producer",
            ),
            (
                "intruder",
                "URI:spiffe://cluster.local/ns/default/sa/intruder",
            ),
        ],
    );
    let billing = Subscriber::ok("billing");
    let ledger = Subscriber::ok("ledger");
    let envoy = start_shipped(
        "envoy/authz/envoy-mtls.yaml",
        &[&billing, &ledger],
        dir.path(),
    );

    assert_eq!(
        curl_event(
            dir.path(),
            &envoy,
            "orders.default",
            Some("orders-producer")
        ),
        Some(202)
    );
    assert_eq!(billing.wait_for(1, Duration::from_secs(5)), 1);
    assert_eq!(
        curl_event(dir.path(), &envoy, "orders.default", Some("intruder")),
        Some(403),
        "a SAN the channel does not allow"
    );
    assert_eq!(
        curl_event(
            dir.path(),
            &envoy,
            "payments.default",
            Some("orders-producer")
        ),
        Some(403),
        "an allowed SAN of another channel"
    );
    assert_eq!(
        curl_event(dir.path(), &envoy, "orders.default", None),
        None,
        "no client certificate: refused at the TLS handshake"
    );
    assert_eq!(
        curl_event(dir.path(), &envoy, "orders.default", Some("stranger")),
        None,
        "a certificate from another CA: refused at the TLS handshake"
    );
    envoy.expect_stat(
        "wasmcustom.fanout.requests.received",
        |n| n == 1,
        Duration::from_secs(5),
    );
    billing.stays_at(1, Duration::from_millis(300));
    assert_eq!(ledger.count(), 0);
}

/// The channel hosts and subjects each Envoy file's RBAC allows (per virtual host).
fn allowed_in_bootstrap(rel: &str) -> BTreeMap<String, (Vec<String>, Vec<String>)> {
    let bootstrap = read_shipped_yaml(rel);
    let hcm = &bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"];
    let mut allowed = BTreeMap::new();
    for vhost in hcm["route_config"]["virtual_hosts"].as_array().unwrap() {
        let Some(rbac) = vhost["typed_per_filter_config"].get("envoy.filters.http.rbac") else {
            continue;
        };
        let hosts = vhost["domains"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_str().unwrap().to_owned())
            .collect();
        let mut who = Vec::new();
        for policy in rbac["rbac"]["rules"]["policies"]
            .as_object()
            .unwrap()
            .values()
        {
            for principal in policy["principals"].as_array().unwrap() {
                let exact = principal["metadata"]["value"]["string_match"]["exact"]
                    .as_str()
                    .or(principal["authenticated"]["principal_name"]["exact"].as_str())
                    .unwrap();
                who.push(exact.to_owned());
            }
        }
        allowed.insert(vhost["name"].as_str().unwrap().to_owned(), (hosts, who));
    }
    allowed
}

#[test]
fn the_istio_policies_allow_the_senders_the_envoy_files_allow() {
    let jwt = allowed_in_bootstrap("envoy/authz/envoy-jwt.yaml");
    let mtls = allowed_in_bootstrap("envoy/authz/envoy-mtls.yaml");
    let text = harness::read_shipped("envoy/authz/istio-authz.yaml");
    let docs: Vec<Value> = text
        .split("\n---\n")
        .map(|doc| harness::yaml_to_json(doc, "envoy/authz/istio-authz.yaml"))
        .collect();
    let policy = docs
        .iter()
        .find(|d| d["kind"] == "AuthorizationPolicy")
        .unwrap();
    assert_eq!(policy["spec"]["action"], "ALLOW");
    let authn = docs
        .iter()
        .find(|d| d["kind"] == "RequestAuthentication")
        .unwrap();
    assert_eq!(authn["spec"]["selector"], policy["spec"]["selector"]);
    let issuer = authn["spec"]["jwtRules"][0]["issuer"].as_str().unwrap();
    for (channel, (hosts, subjects)) in &jwt {
        let rules: Vec<&Value> = policy["spec"]["rules"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|rule| {
                let to = &rule["to"][0]["operation"]["hosts"];
                hosts
                    .iter()
                    .all(|h| to.as_array().unwrap().contains(&json!(h)))
            })
            .collect();
        assert!(
            !rules.is_empty(),
            "no Istio rule for the hosts of {channel}"
        );
        let principals: Vec<&str> = rules
            .iter()
            .flat_map(|r| r["from"].as_array().unwrap())
            .flat_map(|f| {
                let source = &f["source"];
                source["requestPrincipals"]
                    .as_array()
                    .into_iter()
                    .chain(source["principals"].as_array())
                    .flatten()
            })
            .map(|p| p.as_str().unwrap())
            .collect();
        for subject in subjects {
            assert!(
                principals.contains(&format!("{issuer}/{subject}").as_str()),
                "{channel}: the Istio policy does not allow the JWT sender {subject}"
            );
        }
        // Every token rule checks the channel's own audience.
        for rule in rules
            .iter()
            .filter(|r| r["from"][0]["source"]["requestPrincipals"].is_array())
        {
            assert_eq!(
                rule["when"][0]["key"], "request.auth.audiences",
                "{channel}"
            );
            assert_eq!(
                rule["when"][0]["values"][0].as_str(),
                hosts.first().map(String::as_str)
            );
        }
        // mTLS senders: Istio names a SPIFFE id without its scheme.
        for san in &mtls[channel].1 {
            let principal = san.strip_prefix("spiffe://").unwrap();
            assert!(
                principals.contains(&principal),
                "{channel}: the Istio policy does not allow the mTLS sender {san}"
            );
        }
    }
    assert_eq!(
        jwt.keys().collect::<Vec<_>>(),
        mtls.keys().collect::<Vec<_>>()
    );
}
