//! What an operator applies for the control plane: `deploy/kubernetes/control/`
//! (fanout-control) and `deploy/kubernetes-xds/` (the fanout Envoys on xDS), as `kubectl
//! kustomize` builds them:
//! - every object passes the Kubernetes API's schemas strictly (`kubernetes-validate`, as
//!   tests/e2e/deploy.rs checks the rest);
//! - the names agree: the Service and port the Envoys' bootstrap dials, the name its TLS
//!   check expects, the Secrets and mount paths, the node id from the pod's name;
//! - fanout-control runs hardened (non-root, read-only root, no capabilities), two replicas
//!   kept apart, and holds only the permissions its Kubernetes source needs;
//! - where `KUBE_APISERVER_BIN` names a kube-apiserver (with etcd from `make etcd`), both are
//!   applied with `kubectl apply --dry-run=server` to it; SKIPPED otherwise.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness::etcd::EtcdCluster;
use crate::harness::{
    free_ports, manifest_dir, read_shipped, read_shipped_yaml, yaml_to_json, TempDir,
};
use serde::Deserialize;
use serde_json::{json, Value};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const CONTROL: &str = "deploy/kubernetes/control";
const XDS: &str = "deploy/kubernetes-xds";
const KUBERNETES_VERSION: &str = "1.33.0";

/// `kubectl kustomize dir`: the objects.
fn kustomize(rel: &str) -> (String, Vec<Value>) {
    let out = Command::new("kubectl")
        .args(["kustomize"])
        .arg(manifest_dir().join(rel))
        .output()
        .expect("kubectl (kustomize)");
    assert!(
        out.status.success(),
        "kubectl kustomize {rel}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let objects = serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| serde_json::to_value(serde_yaml_ng::Value::deserialize(doc).unwrap()).unwrap())
        .collect();
    (text, objects)
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn container<'a>(deployment: &'a Value, name: &str) -> &'a Value {
    deployment["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap()
}

fn arg_after<'a>(container: &'a Value, flag: &str) -> &'a str {
    let args = container["args"].as_array().unwrap();
    let at = args
        .iter()
        .position(|a| a == flag)
        .unwrap_or_else(|| panic!("no {flag}"));
    args[at + 1].as_str().unwrap()
}

#[test]
fn the_control_plane_and_the_xds_overlay_pass_the_kubernetes_schemas_strictly() {
    let dir = TempDir::new("fanout-k8s-control", "the built manifests");
    let mut files = Vec::new();
    for rel in [CONTROL, XDS] {
        let (text, objects) = kustomize(rel);
        assert!(objects.len() >= 5, "{rel}: {objects:#?}");
        let path = dir.path().join(format!("{}.yaml", rel.replace('/', "-")));
        std::fs::write(&path, text).unwrap();
        files.push(path);
    }
    let python = crate::harness::sdk::sdk_python();
    let bin = python.with_file_name("kubernetes-validate");
    assert!(
        bin.exists(),
        "{}: run `make kubernetes-validate`",
        bin.display()
    );
    let out = Command::new(&bin)
        .args(["--strict", "--no-warn", "-k", KUBERNETES_VERSION])
        .args(&files)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(!text.contains("failed"), "{text}");
    for file in &files {
        assert!(
            text.contains(&format!("{} passed", file.display())),
            "{text}"
        );
    }
}

/// fanout-control: two replicas on different nodes where it can, a PDB keeping one, hardened
/// containers, its ports named, TLS from the Secret cert-manager writes.
#[test]
fn fanout_control_runs_two_hardened_replicas_with_tls_from_its_secret() {
    let (_, objects) = kustomize(CONTROL);
    for object in objects.iter().filter(|o| o["kind"] != "Namespace") {
        let namespaced =
            !["ClusterRole", "ClusterRoleBinding"].contains(&object["kind"].as_str().unwrap());
        if namespaced {
            assert_eq!(
                object["metadata"]["namespace"], "fanout-system",
                "{object:#}"
            );
        }
    }
    let deployment = find(&objects, "Deployment", "fanout-control");
    assert_eq!(deployment["spec"]["replicas"], 2);
    let pod = &deployment["spec"]["template"]["spec"];
    let anti = &pod["affinity"]["podAntiAffinity"]
        ["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"];
    assert_eq!(anti["topologyKey"], "kubernetes.io/hostname");
    assert_eq!(
        anti["labelSelector"]["matchLabels"]["app"],
        "fanout-control"
    );
    assert_eq!(pod["serviceAccountName"], "fanout-control");
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(
        pod["securityContext"]["runAsUser"], 65532,
        "the image's user"
    );
    let c = container(deployment, "fanout-control");
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(c["securityContext"]["capabilities"]["drop"], json!(["ALL"]));
    assert_eq!(c["image"], "fanout-control:0.1.0");
    // TLS from the Secret fanout-control-tls, at the paths the arguments name.
    let mount = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "tls")
        .unwrap()["mountPath"]
        .as_str()
        .unwrap();
    for (flag, key) in [
        ("--tls-cert", "tls.crt"),
        ("--tls-key", "tls.key"),
        ("--client-ca", "ca.crt"),
    ] {
        assert_eq!(arg_after(c, flag), format!("{mount}/{key}"));
    }
    assert_eq!(
        pod["volumes"][0]["secret"]["secretName"],
        "fanout-control-tls"
    );
    // The ports: what the Service names, where the server listens.
    let ports: Vec<(String, u64)> = c["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_owned(),
                p["containerPort"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        ports,
        [("xds".to_owned(), 18000), ("http".to_owned(), 18001)]
    );
    assert_eq!(arg_after(c, "--xds-address"), "0.0.0.0:18000");
    assert_eq!(arg_after(c, "--http-address"), "0.0.0.0:18001");
    let service = find(&objects, "Service", "fanout-control");
    let service_ports: Vec<Value> = service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| json!([p["name"], p["port"], p["targetPort"]]))
        .collect();
    assert_eq!(
        service_ports,
        [json!(["xds", 18000, "xds"]), json!(["http", 18001, "http"])]
    );
    let pdb = find(&objects, "PodDisruptionBudget", "fanout-control");
    assert_eq!(pdb["spec"]["minAvailable"], 1);
}

/// The Envoys' bootstrap dials the Service by its DNS name, checks the name cert-manager puts
/// in the server's certificate, and reads its client certificate where the overlay mounts
/// the Secret; each pod's name is its node id.
#[test]
fn the_xds_overlay_and_the_bootstrap_name_what_the_control_plane_provides() {
    let bootstrap = read_shipped_yaml("envoy/xds/envoy-cluster.yaml");
    let xds = &bootstrap["static_resources"]["clusters"][0];
    let address = &xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        ["socket_address"];
    let (_, control) = kustomize(CONTROL);
    let service = find(&control, "Service", "fanout-control");
    let namespace = service["metadata"]["namespace"].as_str().unwrap();
    assert_eq!(
        address["address"],
        format!("fanout-control.{namespace}.svc.cluster.local")
    );
    assert_eq!(address["port_value"], service["spec"]["ports"][0]["port"]);
    assert_eq!(
        xds["transport_socket"]["typed_config"]["sni"],
        format!("fanout-control.{namespace}.svc")
    );
    let (_, overlay) = kustomize(XDS);
    assert!(
        !overlay
            .iter()
            .any(|o| o["metadata"]["name"] == "fanout-config"),
        "the file-based configuration is gone"
    );
    let configmap = find(&overlay, "ConfigMap", "fanout-envoy");
    assert_eq!(
        configmap["data"]["envoy.yaml"],
        read_shipped("envoy/xds/envoy-cluster.yaml"),
        "run `make k8s-configmaps`"
    );
    for name in ["xds-client.yaml", "xds-server-ca.yaml"] {
        assert_eq!(
            configmap["data"][name],
            read_shipped(&format!("envoy/xds/sds/{name}")),
            "run `make k8s-configmaps`"
        );
    }
    let deployment = find(&overlay, "Deployment", "fanout");
    let envoy = container(deployment, "envoy");
    assert_eq!(arg_after(envoy, "--service-node"), "$(POD_NAME)");
    assert_eq!(
        arg_after(envoy, "--config-path"),
        "/etc/fanout-envoy/envoy.yaml"
    );
    assert_eq!(
        envoy["env"],
        json!([{ "name": "POD_NAME", "valueFrom": { "fieldRef": { "fieldPath": "metadata.name" } } }])
    );
    let mounts = envoy["volumeMounts"].as_array().unwrap();
    assert!(
        !mounts.iter().any(|m| m["mountPath"] == "/etc/fanout"),
        "{mounts:?}"
    );
    let tls = mounts
        .iter()
        .find(|m| m["name"] == "fanout-xds-client")
        .unwrap();
    let sds = yaml_to_json(&read_shipped("envoy/xds/sds/xds-client.yaml"), "sds");
    let chain = sds["resources"][0]["tls_certificate"]["certificate_chain"]["filename"]
        .as_str()
        .unwrap();
    assert_eq!(
        chain,
        format!("{}/tls.crt", tls["mountPath"].as_str().unwrap())
    );
    let volumes = deployment["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap();
    let secret = volumes
        .iter()
        .find(|v| v["name"] == "fanout-xds-client")
        .unwrap();
    assert_eq!(secret["secret"]["secretName"], "fanout-xds-client");
    assert!(!volumes.iter().any(|v| v["name"] == "fanout-config"));
    // The NetworkPolicy lets these pods reach xDS: they carry its label.
    let policy = find(&control, "NetworkPolicy", "fanout-control");
    let from = &policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"];
    for (key, value) in from.as_object().unwrap() {
        assert_eq!(
            &deployment["spec"]["template"]["metadata"]["labels"][key], value,
            "the Envoys lack the label the NetworkPolicy admits"
        );
    }
}

/// Only fanout's Envoys reach xDS, only the monitoring namespace reaches /metrics and /state.
#[test]
fn the_network_policy_admits_only_the_envoys_to_xds_and_monitoring_to_metrics() {
    let (_, objects) = kustomize(CONTROL);
    let policy = find(&objects, "NetworkPolicy", "fanout-control");
    assert_eq!(policy["spec"]["policyTypes"], json!(["Ingress"]));
    assert_eq!(
        policy["spec"]["podSelector"]["matchLabels"],
        json!({ "app": "fanout-control" })
    );
    assert_eq!(
        policy["spec"]["ingress"],
        json!([
            {
                "from": [{ "namespaceSelector": {}, "podSelector": { "matchLabels": { "app": "fanout" } } }],
                "ports": [{ "port": "xds", "protocol": "TCP" }]
            },
            {
                "from": [{ "namespaceSelector": { "matchLabels": { "kubernetes.io/metadata.name": "monitoring" } } }],
                "ports": [{ "port": "http", "protocol": "TCP" }]
            }
        ])
    );
}

/// Least privilege: read what the Kubernetes source watches, write only FanoutChannels'
/// status and annotation and Services, Leases only in its own namespace; no wildcard, no Secrets.
#[test]
fn the_control_plane_holds_only_the_permissions_its_source_needs() {
    let (_, objects) = kustomize(CONTROL);
    let rules = |kind: &str, name: &str| -> Vec<(String, String, Vec<String>)> {
        let mut out = Vec::new();
        for rule in find(&objects, kind, name)["rules"].as_array().unwrap() {
            let verbs: Vec<String> = rule["verbs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap().to_owned())
                .collect();
            for group in rule["apiGroups"].as_array().unwrap() {
                for resource in rule["resources"].as_array().unwrap() {
                    out.push((
                        group.as_str().unwrap().to_owned(),
                        resource.as_str().unwrap().to_owned(),
                        verbs.clone(),
                    ));
                }
            }
        }
        out
    };
    let read = ["get", "list", "watch"].map(String::from).to_vec();
    let expected_read: Vec<(String, String, Vec<String>)> = [
        ("messaging.fanout.dev", "fanoutchannels"),
        ("messaging.knative.dev", "inmemorychannels"),
        ("messaging.knative.dev", "channels"),
        ("messaging.knative.dev", "subscriptions"),
        ("eventing.knative.dev", "eventpolicies"),
    ]
    .iter()
    .map(|(g, r)| ((*g).to_owned(), (*r).to_owned(), read.clone()))
    .collect();
    assert_eq!(rules("ClusterRole", "fanout-control-read"), expected_read);
    let write = rules("ClusterRole", "fanout-control-write");
    assert_eq!(
        write
            .iter()
            .map(|(g, r, _)| format!("{g}/{r}"))
            .collect::<Vec<_>>(),
        [
            "messaging.fanout.dev/fanoutchannels/status",
            "messaging.fanout.dev/fanoutchannels",
            "/services"
        ]
    );
    let leases = rules("Role", "fanout-control-leases");
    assert_eq!(leases.len(), 1);
    assert_eq!(
        (leases[0].0.as_str(), leases[0].1.as_str()),
        ("coordination.k8s.io", "leases")
    );
    assert_eq!(
        find(&objects, "Role", "fanout-control-leases")["metadata"]["namespace"],
        "fanout-system"
    );
    // Each replica's report of what its Envoys serve, in the Lease's namespace.
    let reports = rules("Role", "fanout-control-reports");
    assert_eq!(
        reports
            .iter()
            .map(|(g, r, _)| format!("{g}/{r}"))
            .collect::<Vec<_>>(),
        ["/configmaps"]
    );
    assert_eq!(
        find(&objects, "Role", "fanout-control-reports")["metadata"]["namespace"],
        "fanout-system"
    );
    for object in objects
        .iter()
        .filter(|o| o["kind"].as_str().is_some_and(|k| k.ends_with("Role")))
    {
        let text = object["rules"].to_string();
        assert!(!text.contains('*'), "a wildcard: {object:#}");
        assert!(!text.contains("secrets"), "Secrets: {object:#}");
    }
    // Every binding names the control plane's ServiceAccount, and nothing else.
    for object in objects
        .iter()
        .filter(|o| o["kind"].as_str().is_some_and(|k| k.ends_with("Binding")))
    {
        assert_eq!(
            object["subjects"],
            json!([{ "kind": "ServiceAccount", "name": "fanout-control", "namespace": "fanout-system" }]),
            "{object:#}"
        );
    }
}

/// A kube-apiserver (KUBE_APISERVER_BIN) on etcd, on loopback, with one static admin token.
struct Apiserver {
    child: Child,
    kubeconfig: PathBuf,
    _etcd: EtcdCluster,
    _dir: TempDir,
}

impl Apiserver {
    fn start(bin: &Path) -> Apiserver {
        let etcd = EtcdCluster::start(1);
        let dir = TempDir::new("fanout-apiserver", "the apiserver's keys, config and log");
        let d = dir.path();
        let key = d.join("sa.key");
        let status = Command::new("openssl")
            .args(["genrsa", "-out"])
            .arg(&key)
            .arg("2048")
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success());
        std::fs::write(
            d.join("tokens.csv"),
            "e2e-admin-token,e2e-admin,1,\"system:masters\"\n",
        )
        .unwrap();
        let port = free_ports(1)[0];
        let log = std::fs::File::create(d.join("apiserver.log")).unwrap();
        let mut command = Command::new(bin);
        command
            .arg(format!(
                "--etcd-servers=http://127.0.0.1:{}",
                etcd.client_ports()[0]
            ))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--secure-port={port}"))
            .arg(format!("--cert-dir={}", d.join("certs").display()))
            .arg(format!(
                "--token-auth-file={}",
                d.join("tokens.csv").display()
            ))
            .arg("--authorization-mode=RBAC")
            .arg(format!("--service-account-key-file={}", key.display()))
            .arg(format!(
                "--service-account-signing-key-file={}",
                key.display()
            ))
            .arg("--service-account-issuer=https://kubernetes.default.svc")
            .arg("--service-cluster-ip-range=10.96.0.0/16")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0);
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().expect("start kube-apiserver");
        let kubeconfig = d.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: e2e\n  cluster:\n    server: https://127.0.0.1:{port}\n    insecure-skip-tls-verify: true\n\
                 users:\n- name: admin\n  user:\n    token: e2e-admin-token\n\
                 contexts:\n- name: e2e\n  context: {{cluster: e2e, user: admin}}\ncurrent-context: e2e\n"
            ),
        )
        .unwrap();
        let apiserver = Apiserver {
            child,
            kubeconfig,
            _etcd: etcd,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(90);
        while !apiserver.kubectl(&["get", "--raw", "/readyz"]).0 {
            assert!(
                Instant::now() < deadline,
                "kube-apiserver not ready: {}",
                std::fs::read_to_string(d_log(&apiserver)).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        apiserver
    }

    fn kubectl(&self, args: &[&str]) -> (bool, String) {
        let out = Command::new("kubectl")
            .arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    }
}

fn d_log(apiserver: &Apiserver) -> PathBuf {
    apiserver.kubeconfig.with_file_name("apiserver.log")
}

impl Drop for Apiserver {
    fn drop(&mut self) {
        // SAFETY: a plain kill(2) of the apiserver's own process group.
        unsafe {
            libc::kill(-(self.child.id() as i32), libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

/// Both kustomizations, applied with `--dry-run=server` to a real kube-apiserver: its
/// admission and validation accept every object (RBAC, NetworkPolicy, PDB, the Deployments).
#[test]
fn the_control_plane_and_the_overlay_apply_to_a_real_apiserver() {
    // The Makefile exports the variable, empty where it is not given.
    let bin = std::env::var_os("KUBE_APISERVER_BIN").filter(|b| !b.is_empty());
    let Some(bin) = bin.map(PathBuf::from) else {
        eprintln!("SKIPPED: KUBE_APISERVER_BIN is not set (a kube-apiserver >= 1.24)");
        return;
    };
    assert!(
        bin.is_file(),
        "KUBE_APISERVER_BIN={}: no such file",
        bin.display()
    );
    let apiserver = Apiserver::start(&bin);
    // The namespaces must exist for the namespaced objects' dry run.
    for namespace in ["fanout-system", "fanout"] {
        let (ok, out) = apiserver.kubectl(&["create", "namespace", namespace]);
        assert!(ok, "{out}");
    }
    // docs/deploying.md's step 3, as written there, with --dry-run=server.
    let control = manifest_dir().join(CONTROL).display().to_string();
    let xds = manifest_dir().join(XDS).display().to_string();
    let wasm = format!("fanout.wasm={}", crate::harness::wasm_path().display());
    let steps: [&[&str]; 3] = [
        &["apply", "-k", &control],
        &[
            "-n",
            "fanout",
            "create",
            "configmap",
            "fanout-wasm",
            "--from-file",
            &wasm,
        ],
        &["-n", "fanout", "apply", "-k", &xds],
    ];
    for step in steps {
        let args: Vec<&str> = step.iter().copied().chain(["--dry-run=server"]).collect();
        let (ok, out) = apiserver.kubectl(&args);
        assert!(ok, "kubectl {args:?}: {out}");
        assert!(out.contains("(server dry run)"), "{out}");
        assert!(
            !out.to_lowercase().contains("error"),
            "kubectl {args:?}: {out}"
        );
    }
    let docs = read_shipped("docs/deploying.md");
    for line in [
        "kubectl apply -k deploy/kubernetes/control/",
        "kubectl -n fanout create configmap fanout-wasm --from-file=fanout.wasm=target/wasm32-wasip1/release/fanout.wasm",
        "kubectl -n fanout apply -k deploy/kubernetes-xds/",
    ] {
        assert!(docs.contains(line), "docs/deploying.md no longer says {line:?}");
    }
}
