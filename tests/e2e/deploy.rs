//! What an operator applies (`deploy/`): the Kubernetes manifests pass the Kubernetes API's
//! schemas strictly (the `kubernetes-validate` package's pinned schemas, `make
//! kubernetes-validate`), the ConfigMaps are what their sources make, a real Envoy runs what
//! they hold with the names and ports the Deployment, Services and PodDisruptionBudget use,
//! and the Istio recipe (stats tags through a bootstrap override, the stats matcher) labels
//! fanout's stats and keeps what `drain.sh` reads, on a real Envoy.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use harness::reload::{ReloadEnvoy, ECDS};
use harness::{
    manifest_dir, read_shipped, send, wasm_path, yaml_to_json, Client, Envoy, Subscriber, TempDir,
};
use serde::Deserialize;
use serde_json::{json, Value};

const K8S: &str = "deploy/kubernetes";
/// The Kubernetes release whose API schemas the manifests must pass.
const KUBERNETES_VERSION: &str = "1.33.0";

/// Every YAML document of a shipped file, as JSON.
fn docs(rel: &str) -> Vec<Value> {
    let text = read_shipped(rel);
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| serde_json::to_value(serde_yaml_ng::Value::deserialize(doc).unwrap()).unwrap())
        .collect()
}

fn manifests() -> Vec<String> {
    let mut files: Vec<String> = ["deploy/kubernetes", "deploy/istio"]
        .iter()
        .flat_map(|dir| std::fs::read_dir(manifest_dir().join(dir)).unwrap())
        .map(|entry| entry.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .filter(|p| !p.ends_with("kustomization.yaml"))
        .map(|p| {
            p.strip_prefix(manifest_dir())
                .unwrap()
                .display()
                .to_string()
        })
        .collect();
    files.sort();
    files
}

/// `kubernetes-validate --strict` on files: (exit code, output).
fn validate(files: &[PathBuf]) -> (i32, String) {
    let python = harness::sdk::sdk_python();
    let bin = python.with_file_name("kubernetes-validate");
    assert!(
        bin.exists(),
        "{} is missing: run `make kubernetes-validate`",
        bin.display()
    );
    let out = Command::new(&bin)
        .args(["--strict", "--no-warn", "-k", KUBERNETES_VERSION])
        .args(files)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn the_manifests_pass_the_kubernetes_schemas_strictly() {
    let files = manifests();
    assert!(files.len() >= 7, "{files:?}");
    let paths: Vec<PathBuf> = files.iter().map(|f| manifest_dir().join(f)).collect();
    let (code, out) = validate(&paths);
    assert_eq!(code, 0, "{out}");
    for file in &files {
        assert!(out.contains(&format!("{file} passed")), "{file}: {out}");
    }
    // Strict: a misspelt field fails, naming it.
    let dir = TempDir::new("fanout-k8s-typo", "a manifest with a typo");
    let typo = dir.path().join("deployment.yaml");
    std::fs::write(
        &typo,
        read_shipped("deploy/kubernetes/deployment.yaml")
            .replace("readinessProbe", "readinesProbe"),
    )
    .unwrap();
    let (code, out) = validate(&[typo]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("'readinesProbe' was unexpected"), "{out}");
}

/// A ConfigMap's `data` key as text.
fn configmap_key(rel: &str, key: &str) -> String {
    let doc = &docs(rel)[0];
    assert_eq!(doc["kind"], "ConfigMap", "{rel}");
    doc["data"][key]
        .as_str()
        .unwrap_or_else(|| panic!("{rel} has no key {key}"))
        .to_owned()
}

#[test]
fn the_configmaps_are_what_their_sources_make() {
    assert_eq!(
        configmap_key("deploy/kubernetes/fanout-envoy.yaml", "envoy.yaml"),
        read_shipped("envoy/configmap/envoy.yaml"),
        "run `make k8s-configmaps`"
    );
    assert_eq!(
        configmap_key("deploy/kubernetes/fanout-envoy.yaml", "drain.sh"),
        read_shipped("envoy/drain.sh"),
        "run `make k8s-configmaps`"
    );
    // fanout-config again: render on deploy/kubernetes/channels/, packaged whole.
    let dir = TempDir::new("fanout-k8s-configmaps", "the ConfigMaps written again");
    let rendered = dir.path().join("rendered");
    let (code, _, stderr) = crate::harness::control::render(
        &manifest_dir().join("deploy/kubernetes/channels"),
        &rendered,
        &[],
    );
    assert_eq!(code, 0, "{stderr}");
    let out = Command::new("python3")
        .arg(manifest_dir().join("tools/k8s-configmaps.py"))
        .arg(&rendered)
        .args(["--source", "deploy/kubernetes/channels", "-o"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for name in ["fanout-envoy.yaml", "fanout-config.yaml"] {
        assert_eq!(
            std::fs::read_to_string(dir.path().join(name)).unwrap(),
            read_shipped(&format!("{K8S}/{name}")),
            "{K8S}/{name} is not what `make k8s-configmaps` writes"
        );
    }
    // Every manifest is in the kustomization.
    let kustomization = yaml_to_json(&read_shipped("deploy/kubernetes/kustomization.yaml"), "k");
    let listed: Vec<String> = kustomization["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| format!("{K8S}/{}", r.as_str().unwrap()))
        .collect();
    for file in manifests().iter().filter(|f| f.starts_with(K8S)) {
        assert!(listed.contains(file), "{file} is not in kustomization.yaml");
    }
}

/// The pod's container named `envoy`, and the pod template.
fn deployment() -> (Value, Value) {
    let deployment = docs("deploy/kubernetes/deployment.yaml").remove(0);
    let pod = deployment["spec"]["template"].clone();
    let container = pod["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "envoy")
        .unwrap()
        .clone();
    (pod, container)
}

fn port_named(container: &Value, name: &str) -> u64 {
    container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no container port {name}"))["containerPort"]
        .as_u64()
        .unwrap()
}

#[test]
fn a_real_envoy_runs_the_configmaps_on_the_names_and_ports_the_manifests_use() {
    let (pod, container) = deployment();
    let labels = &pod["metadata"]["labels"];
    let bootstrap = yaml_to_json(
        &configmap_key("deploy/kubernetes/fanout-envoy.yaml", "envoy.yaml"),
        "envoy.yaml",
    );
    // The names: every selector picks the pods.
    for svc in docs("deploy/kubernetes/service.yaml") {
        assert_eq!(
            &svc["spec"]["selector"], labels,
            "{}",
            svc["metadata"]["name"]
        );
        let port = &svc["spec"]["ports"][0];
        assert_eq!(
            port["name"], "http",
            "Istio's protocol selection by port name"
        );
        assert_eq!(port["appProtocol"], "http");
        assert_eq!(port["targetPort"], "http");
    }
    let pdb = docs("deploy/kubernetes/poddisruptionbudget.yaml").remove(0);
    assert_eq!(&pdb["spec"]["selector"]["matchLabels"], labels);
    // The ports: events on `http` = the ingress listener, probes and scrapes on
    // `admin-read` = the admin_read listener.
    let listener_port = |name: &str| -> u64 {
        bootstrap["static_resources"]["listeners"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["name"] == name)
            .unwrap()["address"]["socket_address"]["port_value"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(port_named(&container, "http"), listener_port("ingress"));
    assert_eq!(
        port_named(&container, "admin-read"),
        listener_port("admin_read")
    );
    let annotations = &pod["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(
        annotations["prometheus.io/port"],
        listener_port("admin_read").to_string()
    );
    assert_eq!(annotations["prometheus.io/path"], "/stats/prometheus");
    assert_eq!(container["readinessProbe"]["httpGet"]["port"], "admin-read");
    // The volumes: the bootstrap where the args say, the watched directory where
    // fanout-config is, the module where fanout.yaml says.
    let mount_of = |configmap: &str| -> String {
        let volume = pod["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["configMap"]["name"] == configmap)
            .unwrap_or_else(|| panic!("no volume of ConfigMap {configmap}"));
        let mount = container["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == volume["name"])
            .unwrap();
        assert!(
            mount.get("subPath").is_none(),
            "a subPath mount never sees updates"
        );
        mount["mountPath"].as_str().unwrap().to_owned()
    };
    let args: Vec<&str> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(args.contains(&format!("{}/envoy.yaml", mount_of("fanout-envoy")).as_str()));
    let pre_stop = container["lifecycle"]["preStop"]["exec"]["command"].to_string();
    assert!(pre_stop.contains(&format!("{}/drain.sh", mount_of("fanout-envoy"))));
    assert_eq!(
        bootstrap["dynamic_resources"]["cds_config"]["path_config_source"]["watched_directory"]
            ["path"],
        mount_of("fanout-config")
    );
    let filter = configmap_key("deploy/kubernetes/fanout-config.yaml", "fanout.yaml");
    let module = format!("{}/fanout.wasm", mount_of("fanout-wasm"));
    assert!(filter.contains(&module), "fanout.yaml loads {module}");

    // A real Envoy on these files (the module where the test has it) takes the filter, and
    // the read-only listener answers the probe and the scrape.
    let envoy = ReloadEnvoy::start_on_files(
        filter.replace(&module, &wasm_path().display().to_string()),
        configmap_key("deploy/kubernetes/fanout-config.yaml", "clusters.yaml"),
    );
    assert!(
        envoy.stat(&format!("{ECDS}.update_success")).unwrap_or(0) >= 1,
        "Envoy did not take fanout-config's fanout.yaml:\n{}",
        envoy.log()
    );
    let read_only = format!("http://{}", envoy.listener_addr("admin_read"));
    let ready = send(Client::http1().get(&format!("{read_only}/ready")));
    assert_eq!(ready.status, 200, "{}", ready.text());
    let scrape = send(Client::http1().get(&format!("{read_only}/stats/prometheus")));
    assert_eq!(scrape.status, 200);
    assert!(
        scrape.text().contains(
            "fanout_subscriber_calls{fanout_cluster=\"http_billing_default_svc_cluster_local_80\"}"
        ),
        "{}",
        scrape.text()
    );
}

/// The Istio recipe without Istio: the sidecar's stats as the recipe makes them (the
/// stats_tags of deploy/istio/bootstrap.yaml, the stats matcher Istio builds from the
/// proxyStatsMatcher of deploy/istio/deployment.yaml, inclusion prefixes and regexps), on an
/// Envoy with Istio's names (an `outbound|80||...` subscriber cluster, the inbound stat
/// prefix `inbound_0.0.0.0_8080`): fanout's stats carry their labels in /stats/prometheus,
/// and drain.sh finds what it reads.
#[test]
fn the_istio_stats_recipe_labels_fanout_s_stats_and_keeps_what_drain_sh_reads() {
    let custom: Value = serde_json::from_str(&configmap_key(
        "deploy/istio/bootstrap.yaml",
        "custom_bootstrap.json",
    ))
    .unwrap();
    let tags = custom["stats_config"]["stats_tags"].clone();
    assert_eq!(
        tags,
        harness::read_shipped_yaml("envoy/envoy.yaml")["stats_config"]["stats_tags"],
        "the Istio recipe's stats_tags are envoy/envoy.yaml's"
    );
    let (pod, _) = {
        let d = docs("deploy/istio/deployment.yaml").remove(0);
        (d["spec"]["template"].clone(), ())
    };
    assert_eq!(
        pod["metadata"]["annotations"]["sidecar.istio.io/bootstrapOverride"],
        docs("deploy/istio/bootstrap.yaml")[0]["metadata"]["name"]
    );
    let proxy_config: Value = serde_json::from_str(
        pod["metadata"]["annotations"]["proxy.istio.io/config"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let matcher = &proxy_config["proxyStatsMatcher"];
    let mut patterns: Vec<Value> = matcher["inclusionPrefixes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| json!({ "prefix": p }))
        .collect();
    patterns.extend(
        matcher["inclusionRegexps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| json!({ "safe_regex": { "regex": r } })),
    );

    let cluster = "outbound|80||billing.default.svc.cluster.local";
    let billing = Subscriber::ok("billing");
    let envoy = Envoy::builder()
        .fanout(&json!({ "subscribers": [{ "cluster": cluster }] }))
        .cluster(cluster, billing.port())
        .stat_prefix("inbound_0.0.0.0_8080")
        .bootstrap_field(
            "stats_config",
            json!({ "stats_tags": tags, "stats_matcher": { "inclusion_list": { "patterns": patterns } } }),
        )
        .start();
    assert_eq!(
        send(Client::http1().post(&envoy.url("/")).body("{}")).status,
        202
    );
    let key = "fanout_subscriber_delivered{fanout_cluster=\"outbound_80__billing_default_svc_cluster_local\"}";
    let scraped =
        harness::timing::poll_until(Duration::from_secs(10), Duration::from_millis(100), || {
            let scraped = envoy.prometheus("fanout_");
            (scraped.get(key) == Some(&1.0)).then_some(scraped)
        });
    assert!(
        scraped.is_some(),
        "{key} in {:#?}",
        envoy.prometheus("fanout_")
    );
    assert!(envoy
        .stat("http.inbound_0.0.0.0_8080.downstream_rq_active")
        .is_some());

    let out = Command::new("sh")
        .arg(manifest_dir().join("envoy/drain.sh"))
        .arg(format!("http://{}", envoy.admin_addr()))
        .arg("30")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("fanout owes nothing"), "{stderr}");
}

/// Every shipped bootstrap that loads fanout turns its per-subscriber stats into the labels
/// docs/metrics.md names: the same stats_tags as envoy/envoy.yaml.
#[test]
fn every_shipped_bootstrap_that_loads_fanout_has_the_stats_tags() {
    let expected =
        harness::read_shipped_yaml("envoy/envoy.yaml")["stats_config"]["stats_tags"].clone();
    assert!(
        expected.as_array().is_some_and(|t| t.len() == 3),
        "{expected}"
    );
    let mut files = vec!["examples/docker-compose/envoy.yaml".to_owned()];
    for dir in ["envoy", "envoy/configmap", "envoy/authz"] {
        for entry in std::fs::read_dir(manifest_dir().join(dir)).unwrap() {
            let name = entry.unwrap().file_name().to_string_lossy().into_owned();
            if name.ends_with(".yaml") {
                files.push(format!("{dir}/{name}"));
            }
        }
    }
    let mut checked = Vec::new();
    for rel in &files {
        for doc in docs(rel) {
            // A bootstrap (not a Kubernetes resource) whose filters name fanout.
            if doc.get("static_resources").is_none() || !doc.to_string().contains("fanout") {
                continue;
            }
            if doc["static_resources"]
                .to_string()
                .contains("envoy.filters.http.wasm")
                || doc["static_resources"]
                    .to_string()
                    .contains("config_discovery")
            {
                assert_eq!(
                    doc["stats_config"]["stats_tags"], expected,
                    "{rel}: not the stats_tags of envoy/envoy.yaml"
                );
                checked.push(rel.clone());
            }
        }
    }
    for must in [
        "envoy/envoy.yaml",
        "envoy/configmap/envoy.yaml",
        "envoy/configmap/envoy-senders.yaml",
        "envoy/authz/envoy-jwt.yaml",
        "examples/docker-compose/envoy.yaml",
    ] {
        assert!(
            checked.iter().any(|c| c == must),
            "{must} not checked: {checked:?}"
        );
    }
}
