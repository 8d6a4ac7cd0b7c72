#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The shipped Envoy configs and the demo, checked with the real Envoy and the built filter.
//!
//! - every Envoy bootstrap under `envoy/` and `examples/docker-compose/envoy.yaml` passes
//!   `envoy --mode validate` (which loads fanout.wasm and runs its configuration check);
//! - the docker-compose Envoy config is exactly what `gen-envoy-config.sh` makes of
//!   `envoy/envoy.yaml`, and docker-compose.yml agrees with it;
//! - the Istio EnvoyFilter has the stop-iteration flag, and its filter stanza and plugin
//!   configuration pass `envoy --mode validate` inside a minimal bootstrap;
//! - every Kubernetes resource under `envoy/` (Istio, Envoy Gateway) passes its CRD's published
//!   OpenAPI schema, pinned in `tests/fixtures/schemas/`, strictly (an unknown field fails);
//! - `DEMO_ONESHOT=1 examples/demo.sh` (what `make run` runs) answers 202 and reaches all three
//!   subscribers.
//!
//! Envoy comes from `ENVOY_BIN` (default `.tools/envoy-1.40.0`, installed by `make envoy`), the
//! filter from `FANOUT_WASM` (default `target/wasm32-wasip1/release/fanout.wasm`, built by
//! `make build`). Missing either fails the tests; they never skip.

use crate::harness;

use std::fs;
use std::io::Read;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use harness::{
    envoy_bin, free_ports, manifest_dir, read_shipped, read_shipped_yaml, validate_config,
    wasm_path, yaml_to_json, Envoy, TempDir,
};
use serde::Deserialize;
use serde_json::{json, Value};

/// Points every `filename: …fanout.wasm` in a config at the built filter; returns how many.
fn with_built_wasm(config: &str) -> (String, usize) {
    let wasm = wasm_path();
    let mut count = 0;
    let mut out = String::with_capacity(config.len());
    for line in config.lines() {
        let trimmed = line.trim_start();
        if let Some(value) = trimmed.strip_prefix("filename:") {
            if value.trim().trim_matches('"').ends_with("fanout.wasm") {
                let indent = &line[..line.len() - trimmed.len()];
                out.push_str(&format!("{indent}filename: {}\n", wasm.display()));
                count += 1;
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    (out, count)
}

/// Validates a shipped bootstrap file with its wasm path pointed at the built filter.
fn validate_bootstrap_file(rel: &str) {
    let (config, wasms) = with_built_wasm(&read_shipped(rel));
    assert!(wasms >= 1, "{rel} loads no fanout.wasm");
    let log = validate_config(&config, rel);
    // Validate mode loads the module and runs its configuration check.
    assert!(
        log.contains("fanout: configured"),
        "{rel}: the filter did not report its configuration:\n{log}"
    );
}

#[test]
fn demo_config_validates() {
    validate_bootstrap_file("envoy/envoy.yaml");
}

#[test]
fn demo_config_has_the_tripwire_and_the_flag() {
    let config = read_shipped_yaml("envoy/envoy.yaml");
    let hcm = &config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"];
    let wasm = &hcm["http_filters"][0]["typed_config"]["config"];
    assert_eq!(wasm["allow_on_headers_stop_iteration"], json!(true));
    assert_eq!(
        hcm["http_filters"][1]["name"],
        json!("envoy.filters.http.router")
    );
    let route = &hcm["route_config"]["virtual_hosts"][0]["routes"][0]["direct_response"];
    assert_eq!(route["status"], json!(500));
    assert_eq!(
        route["body"]["inline_string"],
        json!("fanout did not answer this request; the request reached the router")
    );
}

/// The front Envoy that sends every copy of an event to the same replica.
const FRONT: &str = "envoy/front-affinity.yaml";

#[test]
fn every_bootstrap_under_envoy_validates() {
    let mut checked = Vec::new();
    let mut entries: Vec<_> = fs::read_dir(manifest_dir().join("envoy"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")))
        .collect();
    entries.sort();
    for path in entries {
        let rel = path
            .strip_prefix(manifest_dir())
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let text = read_shipped(&rel);
        let kinds: Vec<Value> = serde_yaml_ng::Deserializer::from_str(&text)
            .filter_map(|doc| serde_yaml_ng::Value::deserialize(doc).ok())
            .filter_map(|doc| serde_json::to_value(doc).ok())
            .filter_map(|doc| doc.get("kind").cloned())
            .collect();
        if !kinds.is_empty() {
            // Kubernetes resources, not an Envoy bootstrap: their own tests check them.
            for kind in kinds {
                // DestinationRule (the Istio affinity): its fields are checked by
                // tests/e2e/affinity.rs; no schema of it is pinned.
                assert!(
                    kind.as_str()
                        .is_some_and(|k| crd_schema(k).is_some() || k == "DestinationRule"),
                    "{rel}: unknown kind {kind}; teach tests/e2e/shipped_configs.rs to check it"
                );
            }
            continue;
        }
        let doc = yaml_to_json(&text, &rel);
        assert!(
            doc.get("static_resources").is_some() || doc.get("dynamic_resources").is_some(),
            "{rel}: neither an Envoy bootstrap nor a known resource"
        );
        if rel == FRONT {
            // The front balances over the replicas and runs no fanout: Envoy alone checks it
            // (its own tests: tests/e2e/affinity.rs).
            validate_config(&text, &rel);
        } else {
            validate_bootstrap_file(&rel);
        }
        checked.push(rel);
    }
    for expected in ["envoy/envoy.yaml", "envoy/envoy-buffered.yaml", FRONT] {
        assert!(checked.contains(&expected.to_string()), "{checked:?}");
    }
}

#[test]
fn compose_config_is_generated_from_the_demo_config() {
    let script = manifest_dir().join("examples/docker-compose/gen-envoy-config.sh");
    let output = Command::new("sh")
        .arg(&script)
        .arg("--stdout")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{} failed:\n{}",
        script.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    let generated = String::from_utf8(output.stdout).unwrap();
    let checked_in = read_shipped("examples/docker-compose/envoy.yaml");
    if generated != checked_in {
        let line = generated
            .lines()
            .zip(checked_in.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| generated.lines().count().min(checked_in.lines().count()));
        panic!(
            "examples/docker-compose/envoy.yaml has drifted from envoy/envoy.yaml (first \
             difference at line {}): run examples/docker-compose/gen-envoy-config.sh",
            line + 1
        );
    }
}

#[test]
fn compose_config_validates() {
    validate_bootstrap_file("examples/docker-compose/envoy.yaml");
}

#[test]
fn compose_file_agrees_with_its_envoy_config() {
    let compose = read_shipped_yaml("examples/docker-compose/docker-compose.yml");
    let envoy = read_shipped_yaml("examples/docker-compose/envoy.yaml");
    let services = compose["services"].as_object().expect("services");

    // Envoy's image is the version the tests run.
    let version = Command::new(envoy_bin()).arg("--version").output().unwrap();
    let version = String::from_utf8_lossy(&version.stdout).to_string();
    let image = services["envoy"]["image"].as_str().unwrap();
    let tag = image.rsplit_once(":v").map(|(_, t)| t).unwrap_or("");
    assert!(
        !tag.is_empty() && version.contains(&format!("/{tag}/")),
        "the compose Envoy image {image} is not the Envoy the tests use ({})",
        version.trim()
    );

    // Every cluster is a compose service, reached on the port the subscriber image listens on.
    let dockerfile = read_shipped("examples/docker-compose/Dockerfile");
    for cluster in envoy["static_resources"]["clusters"].as_array().unwrap() {
        let name = cluster["name"].as_str().unwrap();
        let addr = &cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
            ["address"]["socket_address"];
        assert_eq!(addr["address"], json!(name), "cluster {name}");
        assert!(
            services.contains_key(name),
            "no compose service for cluster {name}"
        );
        let port = addr["port_value"].as_u64().unwrap();
        assert!(
            dockerfile.contains(&format!("\"--port\", \"{port}\"")),
            "cluster {name} uses port {port}, which the subscriber image does not listen on"
        );
        assert!(
            services[name]["command"]
                .as_array()
                .unwrap()
                .contains(&json!(name)),
            "service {name} does not run a subscriber named {name}"
        );
    }

    // Envoy reads the config and the wasm where the compose file mounts them.
    let mounts: Vec<&str> = services["envoy"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        mounts.contains(&"./envoy.yaml:/etc/envoy/envoy.yaml:ro"),
        "{mounts:?}"
    );
    let wasm_path = read_shipped("examples/docker-compose/envoy.yaml")
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("filename:")
                .map(|f| f.trim().to_string())
        })
        .expect("the compose Envoy config loads a wasm file");
    let wasm_dir = Path::new(&wasm_path).parent().unwrap().to_str().unwrap();
    assert!(
        mounts
            .iter()
            .any(|m| m.starts_with("fanout-wasm:") && m.contains(&format!(":{wasm_dir}"))),
        "Envoy reads {wasm_path}, but the fanout-wasm volume is not mounted at {wasm_dir}: {mounts:?}"
    );
    let cp = services["fanout-wasm"]["volumes"][0].as_str().unwrap();
    assert_eq!(cp, "fanout-wasm:/out");
    assert!(dockerfile.contains("\"/out/fanout.wasm\""));
}

#[test]
fn istio_envoyfilter_sets_the_flag_and_validates() {
    let rel = "envoy/istio-envoyfilter.yaml";
    let doc = read_shipped_yaml(rel);
    assert_eq!(doc["kind"], json!("EnvoyFilter"));
    assert!(doc["apiVersion"]
        .as_str()
        .unwrap()
        .starts_with("networking.istio.io/"));
    let patches = doc["spec"]["configPatches"].as_array().unwrap();
    let patch = patches
        .iter()
        .find(|p| p["applyTo"] == json!("HTTP_FILTER"))
        .expect("an HTTP_FILTER patch");
    assert_eq!(patch["match"]["context"], json!("SIDECAR_INBOUND"));
    assert_eq!(
        patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"],
        json!("envoy.filters.http.router")
    );
    assert_eq!(patch["patch"]["operation"], json!("INSERT_BEFORE"));

    let filter = &patch["patch"]["value"];
    let config = &filter["typed_config"]["config"];
    assert_eq!(
        filter["typed_config"]["@type"],
        json!("type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm")
    );
    assert_eq!(
        config["allow_on_headers_stop_iteration"],
        json!(true),
        "{rel}: without allow_on_headers_stop_iteration the filter never sees the body"
    );
    assert_eq!(
        config["vm_config"]["code"]["local"]["filename"],
        json!("/var/local/fanout/fanout.wasm")
    );
    let plugin: Value = serde_json::from_str(config["configuration"]["value"].as_str().unwrap())
        .expect("the plugin configuration is JSON");

    // The same filter stanza, in a minimal bootstrap that knows the subscriber clusters, must
    // satisfy Envoy and fanout's own configuration check.
    let mut filter = filter.clone();
    filter["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] =
        json!(wasm_path().to_str().unwrap());
    validate_inbound_chain(vec![filter], &plugin, rel);
}

/// Validates an inbound HTTP chain (the given filters, then the router) in a minimal
/// bootstrap that declares every subscriber cluster of `plugin`, with the built filter.
fn validate_inbound_chain(http_filters: Vec<Value>, plugin: &Value, rel: &str) {
    let mut builder = Envoy::builder().http_filters(http_filters);
    let mut clusters = 0;
    let channels = plugin["channels"].as_array().cloned().unwrap_or_default();
    let shorthand = json!([{ "subscribers": plugin["subscribers"].clone() }]);
    for channel in channels.iter().chain(shorthand.as_array().unwrap()) {
        for sub in channel["subscribers"].as_array().into_iter().flatten() {
            // Never connected to: validate mode starts no worker.
            builder = builder.cluster(sub["cluster"].as_str().unwrap(), 1);
            clusters += 1;
        }
    }
    assert!(clusters > 0, "{rel} configures no subscriber");
    let log = builder.validate(rel);
    assert!(log.contains("fanout: configured"), "{log}");
}

#[test]
fn demo_oneshot_answers_202_and_reaches_every_subscriber() {
    let ports = free_ports(5);
    let log_dir = TempDir::new("fanout-configs-demo", "the demo's output");
    let log = log_dir.path().join("demo.out");
    let mut child = Command::new("bash")
        .arg(manifest_dir().join("examples/demo.sh"))
        .current_dir(manifest_dir())
        .env("DEMO_ONESHOT", "1")
        .env("NO_COLOR", "1")
        .env("ENVOY_BIN", envoy_bin())
        .env("FANOUT_WASM", wasm_path())
        .env("FANOUT_DEMO_PORT", ports[0].to_string())
        .env("FANOUT_DEMO_ADMIN_PORT", ports[1].to_string())
        .env("FANOUT_DEMO_BILLING_PORT", ports[2].to_string())
        .env("FANOUT_DEMO_SHIPPING_PORT", ports[3].to_string())
        .env("FANOUT_DEMO_ANALYTICS_PORT", ports[4].to_string())
        .stdin(Stdio::null())
        .stdout(fs::File::create(&log).unwrap())
        .stderr(fs::File::create(log_dir.path().join("demo.err")).unwrap())
        .spawn()
        .unwrap();

    // The demo bounds its own waits; this bounds the whole run (it may build the subscriber).
    let deadline = Instant::now() + Duration::from_secs(300);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            // SIGTERM: the demo's trap stops everything it started.
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };

    let mut out = String::new();
    fs::File::open(&log)
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let err = fs::read_to_string(log_dir.path().join("demo.err")).unwrap_or_default();
    let status =
        status.unwrap_or_else(|| panic!("the demo did not finish in 300 s:\n{out}\n{err}"));
    assert!(
        status.success(),
        "the demo failed ({status}):\n{out}\n{err}"
    );
    assert!(out.contains("HTTP 202 Accepted"), "{out}");
    for (name, path) in [
        ("billing", "/events/billing"),
        ("shipping", "/hooks/orders"),
        ("analytics", "/ingest"),
    ] {
        assert!(
            out.contains(&format!("{name} · event #1")),
            "{name}:\n{out}"
        );
        assert!(out.contains(&format!("POST {path}")), "{path}:\n{out}");
    }
    assert!(
        out.lines()
            .any(|l| l.contains("x-tenant") && l.contains("acme")),
        "billing's extra header is missing:\n{out}"
    );
    assert!(out.contains("stopped envoy and 3 subscribers"), "{out}");
    // Everything it started is gone: its ports are free again.
    for port in ports {
        assert!(
            TcpListener::bind(("127.0.0.1", port)).is_ok(),
            "port {port} is still in use after the demo ended"
        );
    }
}

/// The WasmPlugin example: fanout in `body_wait: continue` mode (WasmPlugin cannot set the
/// stop-iteration flag) plus an EnvoyFilter that puts the buffer filter before the router.
/// The chain they make (fanout, buffer, router) must validate with the built filter.
#[test]
fn istio_wasmplugin_uses_continue_mode_with_a_buffer_filter_and_validates() {
    let rel = "envoy/istio-wasmplugin.yaml";
    let text = read_shipped(rel);
    let docs: Vec<Value> = serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| {
            let value = serde_yaml_ng::Value::deserialize(doc)
                .unwrap_or_else(|e| panic!("{rel} is not valid YAML: {e}"));
            serde_json::to_value(value).unwrap()
        })
        .collect();
    let plugin_doc = docs
        .iter()
        .find(|d| d["kind"] == json!("WasmPlugin"))
        .expect("a WasmPlugin");
    let buffer_doc = docs
        .iter()
        .find(|d| d["kind"] == json!("EnvoyFilter"))
        .expect("an EnvoyFilter for the buffer filter");
    assert_eq!(plugin_doc["spec"]["phase"], json!("UNSPECIFIED_PHASE"));
    let plugin = plugin_doc["spec"]["pluginConfig"].clone();
    assert_eq!(
        plugin["body_wait"],
        json!("continue"),
        "{rel}: a WasmPlugin cannot set allow_on_headers_stop_iteration"
    );
    let patch = &buffer_doc["spec"]["configPatches"][0];
    assert_eq!(patch["match"]["context"], json!("SIDECAR_INBOUND"));
    assert_eq!(
        patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"],
        json!("envoy.filters.http.router")
    );
    assert_eq!(patch["patch"]["operation"], json!("INSERT_BEFORE"));
    let buffer = patch["patch"]["value"].clone();
    assert_eq!(buffer["name"], json!("envoy.filters.http.buffer"));

    // What Istio generates from the WasmPlugin: the wasm filter with the pluginConfig as JSON,
    // the root id from pluginName, and no stop-iteration flag.
    let wasm = json!({
        "name": "default.fanout",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": "default.fanout",
                "root_id": plugin_doc["spec"]["pluginName"],
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": plugin.to_string()
                },
                "vm_config": {
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": { "local": { "filename": wasm_path().to_str().unwrap() } }
                }
            }
        }
    });
    validate_inbound_chain(vec![wasm, buffer], &plugin, rel);
}

/// The pinned schema (tests/fixtures/schemas/README.md) of each Kubernetes kind the shipped
/// files use.
fn crd_schema(kind: &str) -> Option<&'static str> {
    Some(match kind {
        "WasmPlugin" => "istio-wasmplugin-v1alpha1.json",
        "EnvoyFilter" => "istio-envoyfilter-v1alpha3.json",
        "EnvoyExtensionPolicy" => "envoy-gateway-envoyextensionpolicy-v1alpha1.json",
        "BackendTrafficPolicy" => "envoy-gateway-backendtrafficpolicy-v1alpha1.json",
        "EnvoyProxy" => "envoy-gateway-envoyproxy-v1alpha1.json",
        _ => return None,
    })
}

/// Every YAML document of a shipped file, as JSON.
fn shipped_docs(rel: &str) -> Vec<Value> {
    let text = read_shipped(rel);
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| {
            let value = serde_yaml_ng::Value::deserialize(doc)
                .unwrap_or_else(|e| panic!("{rel} is not valid YAML: {e}"));
            serde_json::to_value(value).unwrap()
        })
        .collect()
}

/// tools/check-k8s-schema.py on `(what, object)` pairs: its error lines (empty: all valid).
fn schema_errors(objects: &[(String, Value)]) -> Vec<String> {
    let items: Vec<Value> = objects
        .iter()
        .map(|(what, object)| {
            let kind = object["kind"].as_str().unwrap_or_default();
            let schema = crd_schema(kind).unwrap_or_else(|| panic!("{what}: no schema for {kind}"));
            json!({ "what": what, "schema": schema, "object": object })
        })
        .collect();
    let python = harness::sdk::sdk_python();
    let mut child = Command::new(&python)
        .arg(manifest_dir().join("tools/check-k8s-schema.py"))
        .arg(manifest_dir().join("tests/fixtures/schemas"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run {}: {e}", python.display()));
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin
            .write_all(serde_json::to_string(&items).unwrap().as_bytes())
            .unwrap();
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.trim().is_empty() && matches!(out.status.code(), Some(0 | 1)),
        "tools/check-k8s-schema.py failed ({}): {stderr} (is jsonschema installed? `make jsonschema`)",
        out.status
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The Kubernetes resources under envoy/ against their CRDs' schemas; and the check is strict
/// enough to catch a misspelt field.
#[test]
fn kubernetes_resources_match_their_crd_schemas() {
    let mut objects = Vec::new();
    for rel in [
        "envoy/istio-wasmplugin.yaml",
        "envoy/istio-envoyfilter.yaml",
        "envoy/envoy-gateway.yaml",
    ] {
        for doc in shipped_docs(rel) {
            let what = format!("{rel} ({})", doc["kind"].as_str().unwrap_or("?"));
            objects.push((what, doc));
        }
    }
    assert!(objects.len() >= 6, "{objects:?}");
    let errors = schema_errors(&objects);
    assert!(errors.is_empty(), "{}", errors.join("\n"));

    // The same documents with one field misspelt each must fail, naming the field's path.
    let mut typos = Vec::new();
    for (what, doc) in &objects {
        let mut doc = doc.clone();
        let spec = doc["spec"].as_object_mut().unwrap();
        let (field, value) = spec
            .iter()
            .next()
            .map(|(k, v)| (k.clone(), v.clone()))
            .unwrap();
        spec.remove(&field);
        spec.insert(format!("{field}x"), value);
        typos.push((format!("{what} with spec.{field}x"), doc));
    }
    let mut wasm_typo = objects
        .iter()
        .find(|(_, d)| d["kind"] == json!("EnvoyExtensionPolicy"))
        .unwrap()
        .1
        .clone();
    wasm_typo["spec"]["wasm"][0]["code"]["image"]["pullPolicy"] = json!("IfNotPresent");
    typos.push((
        "EnvoyExtensionPolicy with image.pullPolicy".into(),
        wasm_typo,
    ));
    let errors = schema_errors(&typos);
    for (what, _) in &typos {
        assert!(
            errors.iter().any(|e| e.starts_with(&format!("{what}: "))),
            "no schema error for {what}: {errors:#?}"
        );
    }
    assert!(
        errors.iter().any(|e| e.contains("wasm.0.code.image")),
        "{errors:#?}"
    );
}

/// The Envoy Gateway example: the module from the image, fanout in `body_wait: continue`
/// mode (Envoy Gateway cannot set the stop-iteration flag), the buffer filter after it. The
/// chain Envoy Gateway makes of it (fanout, buffer, router) must validate with the built
/// filter.
#[test]
fn envoy_gateway_policy_loads_the_image_in_continue_mode_and_validates() {
    let rel = "envoy/envoy-gateway.yaml";
    let docs = shipped_docs(rel);
    let find = |kind: &str| {
        docs.iter()
            .find(|d| d["kind"] == json!(kind))
            .unwrap_or_else(|| panic!("{rel}: no {kind}"))
    };
    let policy = find("EnvoyExtensionPolicy");
    let wasm = &policy["spec"]["wasm"][0];
    assert_eq!(wasm["code"]["type"], json!("Image"));
    let url = wasm["code"]["image"]["url"].as_str().unwrap();
    // The tag of this release (Cargo.toml's version).
    let tag = format!(":{}", env!("CARGO_PKG_VERSION"));
    assert!(url.ends_with(&tag) && !url.contains("://"), "{url}");
    let plugin = wasm["config"].clone();
    assert_eq!(plugin["body_wait"], json!("continue"), "{rel}");
    let buffer = find("BackendTrafficPolicy");
    assert_eq!(buffer["spec"]["targetRefs"], policy["spec"]["targetRefs"]);
    assert!(buffer["spec"]["requestBuffer"]["limit"].is_string());
    assert_eq!(
        find("EnvoyProxy")["spec"]["filterOrder"],
        json!([{ "name": "envoy.filters.http.buffer", "after": "envoy.filters.http.wasm" }])
    );

    let wasm_filter = json!({
        "name": "envoy.filters.http.wasm/envoyextensionpolicy/default/fanout/0",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": wasm["name"],
                "root_id": wasm["rootID"],
                "fail_open": false,
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": plugin.to_string()
                },
                "vm_config": {
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": { "local": { "filename": wasm_path().to_str().unwrap() } }
                }
            }
        }
    });
    let buffer_filter = json!({
        "name": "envoy.filters.http.buffer",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
            "max_request_bytes": 2 * 1024 * 1024
        }
    });
    validate_inbound_chain(vec![wasm_filter, buffer_filter], &plugin, rel);
}

/// Every HTTP connection manager in `v`.
fn connection_managers(v: &Value, found: &mut Vec<Value>) {
    match v {
        Value::Object(fields) => {
            if fields.get("name") == Some(&json!("envoy.filters.network.http_connection_manager")) {
                found.push(fields.get("typed_config").cloned().unwrap_or(Value::Null));
            }
            fields.values().for_each(|f| connection_managers(f, found));
        }
        Value::Array(items) => items.iter().for_each(|i| connection_managers(i, found)),
        _ => {}
    }
}

/// Subscribers get the sender's `x-request-id` or none, never one Envoy made up (the same one
/// to every subscriber): Knative forwards only what the sender sent. Every shipped bootstrap
/// (and the Kubernetes example's, inside its ConfigMap) turns Envoy's generation off. That
/// Envoy then forwards none is checked in `authz.rs`.
#[test]
fn every_shipped_connection_manager_leaves_x_request_id_to_the_sender() {
    let mut files = vec![
        "examples/docker-compose/envoy.yaml".to_owned(),
        "envoy/configmap/envoy.yaml".to_owned(),
        "envoy/configmap/envoy-senders.yaml".to_owned(),
        "envoy/authz/envoy-jwt.yaml".to_owned(),
        "envoy/authz/envoy-mtls.yaml".to_owned(),
        "envoy/xds/envoy.yaml".to_owned(),
        "envoy/xds/envoy-cluster.yaml".to_owned(),
        "examples/docker-compose/envoy-xds.yaml".to_owned(),
    ];
    for entry in fs::read_dir(manifest_dir().join("envoy")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".yaml") {
            files.push(format!("envoy/{name}"));
        }
    }
    let mut checked = 0;
    for rel in &files {
        let text = read_shipped(rel);
        for doc in text.split("\n---\n") {
            let mut doc = yaml_to_json(doc, rel);
            if doc["kind"] == "ConfigMap" {
                if let Some(inner) = doc["data"]["envoy.yaml"].as_str() {
                    doc = yaml_to_json(inner, rel);
                }
            }
            let mut managers = Vec::new();
            connection_managers(&doc, &mut managers);
            for hcm in managers.iter().filter(|h| h.get("stat_prefix").is_some()) {
                assert_eq!(
                    hcm["generate_request_id"],
                    json!(false),
                    "{rel}: a connection manager without generate_request_id: false"
                );
                checked += 1;
            }
        }
    }
    let kubernetes = read_shipped("deploy/kubernetes/fanout-envoy.yaml");
    for doc in kubernetes.split("\n---\n") {
        let doc = yaml_to_json(doc, "deploy/kubernetes/fanout-envoy.yaml");
        if let Some(inner) = doc["data"]["envoy.yaml"].as_str() {
            let mut managers = Vec::new();
            connection_managers(
                &yaml_to_json(inner, "the ConfigMap's envoy.yaml"),
                &mut managers,
            );
            assert!(!managers.is_empty());
            for hcm in managers {
                assert_eq!(
                    hcm["generate_request_id"],
                    json!(false),
                    "the Kubernetes example"
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 9, "only {checked} connection managers found");
}

/// Every YAML file under `dir` (recursively), relative to the repository.
fn shipped_yaml_files(dir: &str, out: &mut Vec<String>) {
    let mut entries: Vec<_> = fs::read_dir(manifest_dir().join(dir))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        let rel = path
            .strip_prefix(manifest_dir())
            .unwrap()
            .to_string_lossy()
            .into_owned();
        if path.is_dir() {
            shipped_yaml_files(&rel, out);
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml")
        ) {
            out.push(rel);
        }
    }
}

/// The Envoy bootstraps in a YAML document: itself, or those a ConfigMap carries (a
/// bootstrap, or a bootstrap override such as Istio's custom_bootstrap.json).
fn bootstraps_in(doc: Value, rel: &str) -> Vec<(String, Value)> {
    if doc["kind"] == "ConfigMap" {
        let data = doc["data"].as_object().cloned().unwrap_or_default();
        return data
            .iter()
            .filter(|(key, _)| key.ends_with(".yaml") || key.ends_with(".json"))
            .filter_map(|(key, text)| {
                let inner = yaml_to_json(text.as_str()?, &format!("{rel}: {key}"));
                let is_bootstrap = ["static_resources", "dynamic_resources", "stats_config"]
                    .iter()
                    .any(|k| inner.get(k).is_some());
                is_bootstrap.then(|| (format!("{rel}: {key}"), inner))
            })
            .collect();
    }
    let is_bootstrap = doc.get("kind").is_none()
        && (doc.get("static_resources").is_some() || doc.get("dynamic_resources").is_some());
    if is_bootstrap {
        vec![(rel.to_owned(), doc)]
    } else {
        Vec::new()
    }
}

/// Whether a bootstrap runs fanout: a Wasm filter loading fanout.wasm, or a filter `fanout`
/// whose configuration comes over ECDS; an Istio override is merged into a sidecar that does.
fn loads_fanout(bootstrap: &Value) -> bool {
    fn discovers_fanout(v: &Value) -> bool {
        match v {
            Value::Object(fields) => {
                (fields.get("name") == Some(&json!("fanout"))
                    && fields.contains_key("config_discovery"))
                    || fields.values().any(discovers_fanout)
            }
            Value::Array(items) => items.iter().any(discovers_fanout),
            _ => false,
        }
    }
    bootstrap.to_string().contains("fanout.wasm")
        || discovers_fanout(bootstrap)
        || bootstrap.get("static_resources").is_none() && bootstrap.get("stats_config").is_some()
}

/// docs/metrics.md says every shipped bootstrap that loads fanout has its tag rules (without
/// them every subscriber's series is named after its cluster, and the shipped alerts and
/// dashboard go silent). Every bootstrap under `envoy/`, `examples/` and `deploy/` (the
/// control plane's included, and those inside ConfigMaps) is held to the block the doc shows.
#[test]
fn every_shipped_bootstrap_that_runs_fanout_has_the_documented_tag_rules() {
    let doc = read_shipped("docs/metrics.md");
    let block = doc
        .split_once("add them to a bootstrap of your own:")
        .and_then(|(_, rest)| rest.split_once("```yaml\n"))
        .and_then(|(_, rest)| rest.split_once("```"))
        .map(|(block, _)| block)
        .expect("docs/metrics.md shows the tag rules in a yaml block");
    let documented =
        yaml_to_json(block, "docs/metrics.md's tag rules")["stats_config"]["stats_tags"].clone();
    assert_eq!(documented.as_array().map(Vec::len), Some(3), "{documented}");
    let mut files = Vec::new();
    for dir in ["envoy", "examples", "deploy"] {
        shipped_yaml_files(dir, &mut files);
    }
    let (mut checked, mut without_fanout) = (Vec::new(), Vec::new());
    for rel in &files {
        let text = read_shipped(rel);
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            let Ok(doc) = serde_yaml_ng::Value::deserialize(doc) else {
                continue;
            };
            let doc = serde_json::to_value(doc).unwrap();
            for (name, bootstrap) in bootstraps_in(doc, rel) {
                if !loads_fanout(&bootstrap) {
                    without_fanout.push(name);
                    continue;
                }
                let tags = bootstrap["stats_config"]["stats_tags"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                for rule in documented.as_array().unwrap() {
                    assert!(
                        tags.contains(rule),
                        "{name}: no tag rule {rule} (docs/metrics.md); it has {tags:?}"
                    );
                }
                checked.push(name);
            }
        }
    }
    for expected in [
        "envoy/envoy.yaml",
        "envoy/xds/envoy.yaml",
        "envoy/xds/envoy-cluster.yaml",
        "envoy/configmap/envoy.yaml",
        "examples/docker-compose/envoy.yaml",
        "deploy/kubernetes/fanout-envoy.yaml: envoy.yaml",
        "deploy/istio/bootstrap.yaml: custom_bootstrap.json",
    ] {
        assert!(
            checked.iter().any(|c| c == expected),
            "{expected} not checked: {checked:?}"
        );
    }
    assert_eq!(
        without_fanout,
        vec![FRONT.to_owned()],
        "bootstraps without fanout"
    );
}

/// The control-plane compose demo's Envoy config is what `gen-envoy-xds-config.sh` makes of
/// `envoy/xds/envoy.yaml`, Envoy accepts it, and the compose file names the services and
/// ports it uses.
#[test]
fn compose_control_config_is_generated_from_the_xds_bootstrap_and_agrees_with_its_compose_file() {
    let script = manifest_dir().join("examples/docker-compose/gen-envoy-xds-config.sh");
    let output = Command::new("sh")
        .arg(&script)
        .arg("--stdout")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let generated = String::from_utf8(output.stdout).unwrap();
    assert_eq!(
        generated,
        read_shipped("examples/docker-compose/envoy-xds.yaml"),
        "examples/docker-compose/envoy-xds.yaml has drifted: run gen-envoy-xds-config.sh"
    );
    validate_config(&generated, "examples/docker-compose/envoy-xds.yaml");
    let envoy = yaml_to_json(&generated, "envoy-xds.yaml");
    let compose = read_shipped_yaml("examples/docker-compose/docker-compose.control.yml");
    let services = compose["services"].as_object().unwrap();
    let xds = &envoy["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]
        ["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
    let control = &services[xds["address"].as_str().unwrap()];
    let args: Vec<&str> = control["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let after = |flag: &str| args[args.iter().position(|a| *a == flag).unwrap() + 1];
    assert_eq!(
        after("--xds-address"),
        format!("0.0.0.0:{}", xds["port_value"])
    );
    assert_eq!(control["image"], "fanout-control:local");
    // The wasm path the server names is where Envoy's container mounts the module.
    let wasm_volume = services["envoy"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|v| v.as_str()?.strip_prefix("fanout-wasm:"))
        .unwrap();
    assert_eq!(
        after("--wasm"),
        format!("{}/fanout.wasm", wasm_volume.trim_end_matches(":ro"))
    );
    // The channel's subscribers are the compose services, on the subscriber image's port.
    let channel = read_shipped_yaml("examples/docker-compose/channels/orders.yaml");
    for subscriber in channel["spec"]["subscribers"].as_array().unwrap() {
        let uri = subscriber["subscriberUri"].as_str().unwrap();
        let host = uri.trim_start_matches("http://").split(':').next().unwrap();
        assert!(services.contains_key(host), "{uri}: no service {host}");
        assert!(uri.contains(":8080/"), "{uri}");
    }
}
