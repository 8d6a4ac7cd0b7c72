//! The OCI image (`make image`, `make push`) the way a mesh loads it: pushed by `make push` to
//! a real registry on loopback (Debian's `docker-registry`, the CNCF distribution registry),
//! pulled back over the registry's HTTP API, `plugin.wasm` taken out by Istio's rules
//! (pkg/wasm/imagefetcher.go: the last layer, its media type, the file's basename), and run
//! in the real Envoy. fanout-control's image (`make image-control`, `make push-control`) goes
//! the same way: pulled back and read layer by layer, then pulled by Docker and run as
//! Kubernetes runs it, configuring a real Envoy (SKIPPED where no Docker engine answers).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness;

use std::io::Read;
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use harness::{assert_202_empty, free_ports, manifest_dir, send, wasm_path, Client, Envoy};
use harness::{Subscriber, TempDir};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const OCI_LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const DOCKER_LAYER: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";

/// A distribution registry on 127.0.0.1, with its storage and config in a temp dir; stopped
/// (its whole process group) on drop.
struct Registry {
    child: Child,
    port: u16,
    _dir: TempDir,
}

impl Registry {
    fn start() -> Registry {
        let bin = which("docker-registry").unwrap_or_else(|| {
            panic!(
                "docker-registry is missing (Debian: apt-get install docker-registry); \
                 `make test-e2e` installs it"
            )
        });
        let dir = TempDir::new("fanout-registry", "the test registry's storage and log");
        let port = free_ports(1)[0];
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n\
                 storage:\n  filesystem:\n    rootdirectory: {}\n\
                 http:\n  addr: 127.0.0.1:{port}\n",
                dir.path().join("data").display()
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.path().join("registry.log")).unwrap();
        let mut command = Command::new(bin);
        command
            .arg("serve")
            .arg(&config)
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
        let mut child = command.spawn().expect("start docker-registry");
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = child.try_wait() {
                let log = std::fs::read_to_string(dir.path().join("registry.log"));
                panic!("docker-registry exited ({status}): {log:?}");
            }
            assert!(
                Instant::now() < deadline,
                "docker-registry did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Registry {
            child,
            port,
            _dir: dir,
        }
    }

    /// GET on the registry's API: status, content type, Docker-Content-Digest, body.
    fn get(&self, path: &str, accept: &str) -> (u16, String, String, Vec<u8>) {
        let reply = reqwest::blocking::Client::new()
            .get(format!("http://127.0.0.1:{}{path}", self.port))
            .header("accept", accept)
            .send()
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        let header = |name: &str| {
            reply
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned()
        };
        let (status, content_type, digest) = (
            reply.status().as_u16(),
            header("content-type"),
            header("docker-content-digest"),
        );
        (
            status,
            content_type,
            digest,
            reply.bytes().unwrap().to_vec(),
        )
    }
}

impl Registry {
    /// The manifest of `repo:tag`, as a client asking for OCI (or Docker's v2) gets it: the OCI
    /// manifest whose digest make wrote (`made`), served under that digest.
    fn manifest(&self, repo: &str, tag: &str, made: &str) -> Value {
        let (status, content_type, served, body) = self.get(
            &format!("/v2/{repo}/manifests/{tag}"),
            &format!("{OCI_MANIFEST}, application/vnd.docker.distribution.manifest.v2+json"),
        );
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        assert_eq!(content_type, OCI_MANIFEST);
        assert_eq!(
            served, made,
            "the registry holds another manifest than make wrote"
        );
        assert_eq!(format!("sha256:{}", sha256_hex(&body)), made);
        serde_json::from_slice(&body).unwrap()
    }

    /// The blob `digest` of `repo`, its bytes checked against the digest.
    fn blob(&self, repo: &str, digest: &str) -> Vec<u8> {
        let (status, _, _, bytes) = self.get(
            &format!("/v2/{repo}/blobs/{digest}"),
            "application/octet-stream",
        );
        assert_eq!(status, 200, "{digest}");
        assert_eq!(format!("sha256:{}", sha256_hex(&bytes)), digest);
        bytes
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        // SAFETY: a plain kill(2) of the registry's own process group.
        unsafe {
            libc::kill(-(self.child.id() as i32), libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `make <args>` from the crate root; panics with its output unless it succeeds.
fn make(args: &[&str]) -> String {
    let out = Command::new("make")
        .arg("--no-print-directory")
        .args(args)
        .current_dir(manifest_dir())
        .output()
        .expect("run make");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "make {args:?} failed:\n{text}");
    text
}

/// Istio's extraction of a "compat" image's layer: gunzip, then the first entry whose
/// basename is plugin.wasm.
fn plugin_wasm(layer: &[u8]) -> Vec<u8> {
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(layer));
    for entry in archive.entries().expect("the layer is a tar.gz") {
        let mut entry = entry.expect("a tar entry");
        let path = entry.path().expect("an entry path").into_owned();
        if path.file_name().and_then(|n| n.to_str()) == Some("plugin.wasm") {
            let mut module = Vec::new();
            entry.read_to_end(&mut module).unwrap();
            return module;
        }
    }
    panic!("plugin.wasm not found in the image's last layer");
}

fn layout_digest(layout: &Path) -> String {
    let file = PathBuf::from(format!("{}.digest", layout.display()));
    std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        .trim()
        .to_owned()
}

/// One of the images (`make <image>`, `make <push>`; its Makefile variables start with
/// `vars`: "", `CONTROL_`, `NATIVE_`) built twice into `work` (the same digest: reproducible),
/// then pushed to `registry` as `repo:0.1.0-test`: the image's reference and digest.
fn build_twice_and_push(
    registry: &Registry,
    work: &Path,
    (image, push): (&str, &str),
    vars: &str,
    repo: &str,
) -> (String, String) {
    let layout = work.join(repo.rsplit('/').next().unwrap());
    let layout_arg = format!("{vars}IMAGE_LAYOUT={}", layout.display());
    let tag_arg = format!("{vars}IMAGE_TAG=0.1.0-test");
    let reference = format!("127.0.0.1:{}/{repo}:0.1.0-test", registry.port);
    make(&[image, &layout_arg, &tag_arg]);
    let first = layout_digest(&layout);
    make(&[image, &layout_arg, &tag_arg]);
    assert_eq!(
        layout_digest(&layout),
        first,
        "two builds of one {image} differ"
    );
    make(&[
        push,
        &layout_arg,
        &tag_arg,
        &format!("IMAGE={reference}"),
        "TLS_VERIFY=false",
    ]);
    (reference, first)
}

/// One event from a sender to `envoy`, fanned out to `billing` (the only subscriber, path
/// `/events`): 202, and billing got it.
fn one_order_fans_out(envoy: &Envoy, billing: &Subscriber) {
    let reply = send(
        Client::http1()
            .post(&envoy.url("/"))
            .header("content-type", "application/json")
            .body(r#"{"order":"A-1001"}"#),
    );
    assert_202_empty(&reply);
    let got = billing.only_request();
    assert_eq!(got.path, "/events");
    assert_eq!(got.body, br#"{"order":"A-1001"}"#);
}

#[test]
fn make_push_to_a_registry_then_the_module_istio_extracts_fans_out_in_envoy() {
    let registry = Registry::start();
    let work = TempDir::new("fanout-image", "the image layouts and the pulled module");
    let (_, digest) = build_twice_and_push(
        &registry,
        work.path(),
        ("image", "push"),
        "",
        "fanout/fanout",
    );
    let manifest = registry.manifest("fanout/fanout", "0.1.0-test", &digest);
    let annotations = &manifest["annotations"];
    for key in ["version", "revision", "licenses"] {
        let value = annotations[format!("org.opencontainers.image.{key}")].as_str();
        assert!(
            value.is_some_and(|v| !v.is_empty()),
            "annotation {key} missing: {manifest:#}"
        );
    }
    assert_eq!(
        annotations["org.opencontainers.image.licenses"],
        json!("Apache-2.0")
    );

    // Istio: the last layer; its media type must be the OCI (or Docker) tar+gzip one.
    let layers = manifest["layers"].as_array().expect("layers");
    let last = layers.last().expect("at least one layer");
    let media_type = last["mediaType"].as_str().unwrap_or("");
    assert!(
        media_type == OCI_LAYER || media_type == DOCKER_LAYER,
        "last layer: {last}"
    );
    let layer = registry.blob(
        "fanout/fanout",
        last["digest"].as_str().expect("layer digest"),
    );
    assert_eq!(last["size"], json!(layer.len()));

    let module = plugin_wasm(&layer);
    let shipped = std::fs::read(wasm_path()).unwrap();
    assert_eq!(
        sha256_hex(&module),
        sha256_hex(&shipped),
        "the image's plugin.wasm is not the shipped module"
    );

    // The pulled module, loaded by the real Envoy: one event, one subscriber, 202.
    let pulled = work.path().join("plugin.wasm");
    std::fs::write(&pulled, &module).unwrap();
    let billing = Subscriber::ok("billing");
    let envoy = Envoy::builder()
        .wasm_file(&pulled)
        .fanout(
            &json!({ "channels": [{ "name": "default/orders", "hosts": ["*"],
            "subscribers": [{ "cluster": "billing", "path": "/events" }] }] }),
        )
        .subscribers(&[&billing])
        .start();
    one_order_fans_out(&envoy, &billing);
}

/// The native build's image (`make image-native`, `make push-native`), pulled back over the
/// registry's API: the manifest make wrote, a linux/amd64 config, one layer holding only
/// `libfanout.so`, the library `make build-native` built. Its files, laid out as a pod's image
/// volume mounts them, are where the real Envoy finds the library by its name (as
/// fanout-control's filter names it): one event, one subscriber, 202.
#[test]
fn make_push_native_then_envoy_loads_the_library_from_the_image_by_its_name() {
    let registry = Registry::start();
    let work = TempDir::new("fanout-image", "the native image's layout and its files");
    let repo = "fanout/fanout-native";
    let targets = ("image-native", "push-native");
    let (_, digest) = build_twice_and_push(&registry, work.path(), targets, "NATIVE_", repo);
    let manifest = registry.manifest(repo, "0.1.0-test", &digest);
    assert_eq!(
        manifest["annotations"]["org.opencontainers.image.title"],
        json!("fanout-native")
    );
    let config_digest = manifest["config"]["digest"]
        .as_str()
        .expect("config digest");
    let config: Value = serde_json::from_slice(&registry.blob(repo, config_digest)).unwrap();
    assert_eq!(
        (&config["architecture"], &config["os"]),
        (&json!("amd64"), &json!("linux"))
    );
    let layers = manifest["layers"].as_array().expect("layers");
    assert_eq!(layers.len(), 1, "one layer: {manifest:#}");
    assert_eq!(layers[0]["mediaType"], json!(OCI_LAYER));
    let layer = registry.blob(repo, layers[0]["digest"].as_str().expect("layer digest"));

    let files = layer_files(&layer);
    assert_eq!(
        files.keys().collect::<Vec<_>>(),
        ["libfanout.so"],
        "the layer holds the library alone, at its root"
    );
    let (mode, library) = &files["libfanout.so"];
    assert_eq!(mode & 0o777, 0o755);
    let built = std::fs::read(harness::native_lib_path()).unwrap();
    assert_eq!(
        sha256_hex(library),
        sha256_hex(&built),
        "the image's libfanout.so is not the library make build-native built"
    );

    // The image's files where a pod mounts them, Envoy's search path pointing there, the
    // library named by its name: the real Envoy loads it and fans out.
    let mount = work.path().join("modules");
    std::fs::create_dir(&mount).unwrap();
    std::fs::write(mount.join("libfanout.so"), library).unwrap();
    let config = json!({ "channels": [{ "name": "default/orders", "hosts": ["*"],
        "subscribers": [{ "cluster": "billing", "path": "/events" }] }] });
    let filter = json!({
        "name": "fanout",
        "typed_config": {
            "@type": harness::NATIVE_TYPE,
            "dynamic_module_config": { "name": "fanout", "do_not_close": true },
            "filter_name": "fanout",
            "filter_config": {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": config.to_string()
            }
        }
    });
    let billing = Subscriber::ok("billing");
    let envoy = Envoy::builder()
        .http_filters(vec![filter])
        .native_search_path(&mount)
        .subscribers(&[&billing])
        .start();
    one_order_fans_out(&envoy, &billing);
    // The library Envoy mapped is the image's file, nothing else of that name.
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", envoy.pid())).unwrap();
    let mapped: std::collections::BTreeSet<&str> = maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .filter(|path| path.ends_with("/libfanout.so"))
        .collect();
    let expected = std::fs::canonicalize(mount.join("libfanout.so")).unwrap();
    assert_eq!(
        mapped.into_iter().collect::<Vec<_>>(),
        [expected.to_str().unwrap()],
        "the library Envoy loaded"
    );
}

/// The entries of an image layer (tar.gz): path -> (mode, bytes).
fn layer_files(layer: &[u8]) -> std::collections::BTreeMap<String, (u32, Vec<u8>)> {
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(layer));
    let mut files = std::collections::BTreeMap::new();
    for entry in archive.entries().expect("the layer is a tar.gz") {
        let mut entry = entry.expect("a tar entry");
        let path = entry.path().unwrap().display().to_string();
        let mode = entry.header().mode().unwrap();
        let mut bytes = Vec::new();
        entry.read_to_end(&mut bytes).unwrap();
        files.insert(path, (mode, bytes));
    }
    files
}

/// `make image-control` then `make push-control` to `registry`: the image's reference and
/// digest.
fn push_control_image(registry: &Registry, work: &Path) -> (String, String) {
    let targets = ("image-control", "push-control");
    build_twice_and_push(registry, work, targets, "CONTROL_", "fanout/fanout-control")
}

/// fanout-control's image (`make image-control`, `make push-control`), pulled back over the
/// registry's API: the manifest make wrote, one layer holding the static binary (the one
/// `make control-static` built, with no program interpreter) and the user it runs as, a
/// config that runs it as that user, not root.
#[test]
fn make_push_control_then_the_pulled_image_holds_the_static_binary_run_as_non_root() {
    let registry = Registry::start();
    let work = TempDir::new("fanout-control-image", "the image layout");
    let (_, digest) = push_control_image(&registry, work.path());
    let manifest = registry.manifest("fanout/fanout-control", "0.1.0-test", &digest);
    let blob = |digest: &str| registry.blob("fanout/fanout-control", digest);
    let config: Value =
        serde_json::from_slice(&blob(manifest["config"]["digest"].as_str().unwrap())).unwrap();
    assert_eq!(config["os"], "linux");
    assert_eq!(config["architecture"], "amd64");
    assert_eq!(config["config"]["User"], "65532:65532", "{config:#}");
    assert_eq!(
        config["config"]["Entrypoint"],
        json!(["/usr/local/bin/fanout-control"])
    );
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1, "no base image: {manifest:#}");
    let files = layer_files(&blob(layers[0]["digest"].as_str().unwrap()));
    let names: Vec<&String> = files.keys().collect();
    assert_eq!(
        names,
        [
            "etc/",
            "etc/group",
            "etc/passwd",
            "usr/",
            "usr/local/",
            "usr/local/bin/",
            "usr/local/bin/fanout-control"
        ],
        "nothing but the binary and its user"
    );
    let (mode, binary) = &files["usr/local/bin/fanout-control"];
    assert_eq!(mode & 0o777, 0o755);
    let built = std::fs::read(
        manifest_dir().join("target/static/x86_64-unknown-linux-gnu/release/fanout-control"),
    )
    .unwrap();
    assert_eq!(sha256_hex(binary), sha256_hex(&built));
    assert!(
        !binary.windows(16).any(|w| w == b"/lib64/ld-linux-"),
        "the binary names a loader: not static"
    );
    let passwd = String::from_utf8_lossy(&files["etc/passwd"].1).into_owned();
    assert!(passwd.contains("fanout:x:65532:65532:"), "{passwd}");
}

/// Whether a Docker engine answers here (`docker info`).
fn docker_answers() -> bool {
    Command::new("docker")
        .arg("info")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn docker(args: &[&str]) -> String {
    let out = Command::new("docker").args(args).output().expect("docker");
    assert!(
        out.status.success(),
        "docker {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A container removed when dropped.
struct Container(String);

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new("docker")
            .args(["rm", "-f", &self.0])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// fanout-control's image pulled by Docker from the registry and run as Kubernetes runs it
/// (its own user, a read-only root file system, every capability dropped): it reads its
/// source, answers /ready and /metrics, and a real Envoy it configures delivers an event.
/// Where no Docker engine answers it says SKIPPED (and `make test` shows it).
#[test]
fn the_control_image_runs_under_docker_and_configures_an_envoy() {
    if !docker_answers() {
        eprintln!("SKIPPED: no Docker engine answers here (docker info failed)");
        return;
    }
    let registry = Registry::start();
    let work = TempDir::new("fanout-control-image", "the image layout and the source");
    let (image, _) = push_control_image(&registry, work.path());
    docker(&["pull", "--quiet", &image]);
    let source = work.path().join("source");
    std::fs::create_dir(&source).unwrap();
    let billing = Subscriber::ok("billing");
    std::fs::write(
        source.join("orders.yaml"),
        format!(
            "apiVersion: messaging.knative.dev/v1\nkind: InMemoryChannel\n\
             metadata: {{name: orders, namespace: default}}\n\
             spec:\n  subscribers:\n    - {{subscriberUri: 'http://127.0.0.1:{}/events'}}\n\
             status:\n  address: {{url: 'http://orders.example'}}\n",
            billing.port()
        ),
    )
    .unwrap();
    // The container's user reads them, as a mounted ConfigMap would let it.
    for path in [work.path(), &source, &source.join("orders.yaml")] {
        use std::os::unix::fs::PermissionsExt;
        let mode = if path.is_dir() { 0o755 } else { 0o644 };
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let ports = free_ports(2);
    let (xds, http) = (ports[0], ports[1]);
    let id = docker(&[
        "run",
        "--detach",
        "--network",
        "host",
        "--read-only",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "--volume",
        &format!("{}:/etc/fanout-source:ro", source.display()),
        &image,
        "--source",
        "dir:/etc/fanout-source",
        "--xds-address",
        &format!("127.0.0.1:{xds}"),
        "--http-address",
        &format!("127.0.0.1:{http}"),
        "--wasm",
        &wasm_path().display().to_string(),
    ]);
    let container = Container(id);
    assert_eq!(
        docker(&["inspect", "--format", "{{.Config.User}}", &container.0]),
        "65532:65532"
    );
    let get = |path: &str| {
        reqwest::blocking::Client::new()
            .get(format!("http://127.0.0.1:{http}{path}"))
            .send()
            .ok()
            .map(|r| (r.status().as_u16(), r.text().unwrap_or_default()))
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while get("/ready").map(|(code, _)| code) != Some(200) {
        assert!(
            Instant::now() < deadline,
            "not ready; its log: {}",
            docker(&["logs", &container.0])
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let envoy = crate::harness::control::xds_envoy("docker", xds).start();
    let client = Client::http1_resolving("orders.example", envoy.addr());
    let reply = send(
        client
            .post(&format!("http://orders.example:{}/", envoy.port()))
            .header("content-type", "application/json")
            .body(r#"{"order":"A-1"}"#),
    );
    assert_202_empty(&reply);
    assert_eq!(billing.only_request().path, "/events");
    let (code, metrics) = get("/metrics").unwrap();
    assert_eq!(code, 200);
    assert!(
        metrics.contains(r#"fanout_control_acks_total{node="docker",kind="filter"}"#),
        "{metrics}"
    );
}
