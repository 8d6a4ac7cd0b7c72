//! The OCI image (`make image`, `make push`) the way a mesh loads it: pushed by `make push` to
//! a real registry on loopback (Debian's `docker-registry`, the CNCF distribution registry),
//! pulled back over the registry's HTTP API, `plugin.wasm` taken out by Istio's rules
//! (pkg/wasm/imagefetcher.go: the last layer, its media type, the file's basename), and run
//! in the real Envoy.
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

#[test]
fn make_push_to_a_registry_then_the_module_istio_extracts_fans_out_in_envoy() {
    let registry = Registry::start();
    let work = TempDir::new("fanout-image", "the image layouts and the pulled module");
    let layout = work.path().join("fanout");
    let layout_arg = format!("IMAGE_LAYOUT={}", layout.display());
    let image = format!("127.0.0.1:{}/fanout/fanout:0.1.0-test", registry.port);

    // Reproducible: building again gives the same digest.
    make(&["image", &layout_arg, "IMAGE_TAG=0.1.0-test"]);
    let first = layout_digest(&layout);
    make(&["image", &layout_arg, "IMAGE_TAG=0.1.0-test"]);
    assert_eq!(
        layout_digest(&layout),
        first,
        "two builds of one module differ"
    );

    make(&[
        "push",
        &layout_arg,
        "IMAGE_TAG=0.1.0-test",
        &format!("IMAGE={image}"),
        "TLS_VERIFY=false",
    ]);

    // The manifest, as a client asking for OCI gets it: the digest make image wrote.
    let (status, content_type, digest, body) = registry.get(
        "/v2/fanout/fanout/manifests/0.1.0-test",
        &format!("{OCI_MANIFEST}, application/vnd.docker.distribution.manifest.v2+json"),
    );
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(content_type, OCI_MANIFEST);
    assert_eq!(
        digest, first,
        "the registry holds another manifest than make image wrote"
    );
    assert_eq!(format!("sha256:{}", sha256_hex(&body)), first);
    let manifest: Value = serde_json::from_slice(&body).unwrap();
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
    let layer_digest = last["digest"].as_str().expect("layer digest");
    let (status, _, _, layer) = registry.get(
        &format!("/v2/fanout/fanout/blobs/{layer_digest}"),
        "application/octet-stream",
    );
    assert_eq!(status, 200);
    assert_eq!(format!("sha256:{}", sha256_hex(&layer)), layer_digest);
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
