//! A real Kubernetes API on loopback for `make test-k8s`: etcd (`ETCD_BIN`) and the
//! kube-apiserver given as `KUBE_APISERVER_BIN` (1.24 or later), with a CA, a serving
//! certificate and a static admin token made for the run; `kubectl` on a kubeconfig for it;
//! and, where `KNATIVE_CONTROLLER_BIN` and `KNATIVE_EVENTING_SRC` are given, Knative
//! Eventing's own controller (1.22 or later) with the CRDs and ConfigMaps of that tree. Each
//! process in its own process group, stopped when its guard drops.

use super::etcd::EtcdCluster;
use super::{free_ports, TempDir};
use serde_json::Value;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A path from the environment, which must exist.
fn given(var: &str) -> PathBuf {
    let path = std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("{var} is not set: run these tests with `make test-k8s`"));
    assert!(path.exists(), "{var} {} does not exist", path.display());
    path
}

/// Whether Knative's controller is given (`KNATIVE_CONTROLLER_BIN`, `KNATIVE_EVENTING_SRC`).
pub fn knative_given() -> bool {
    ["KNATIVE_CONTROLLER_BIN", "KNATIVE_EVENTING_SRC"]
        .iter()
        .all(|v| std::env::var_os(v).is_some_and(|p| !p.is_empty()))
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA, the apiserver's certificate for 127.0.0.1 signed by it, the service-account key
/// pair, and a static token for an admin (group system:masters).
fn credentials(dir: &Path) -> String {
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509", "-days", "1", "-subj", "/CN=fanout-test-ca"];
    ca.extend(ec);
    ca.extend(["-keyout", "ca.key", "-out", "ca.crt"]);
    ca.extend(["-addext", "basicConstraints=critical,CA:TRUE"]);
    openssl(dir, &ca);
    let mut csr = vec!["req", "-subj", "/CN=kube-apiserver"];
    csr.extend(ec);
    csr.extend(["-keyout", "server.key", "-out", "server.csr"]);
    openssl(dir, &csr);
    std::fs::write(
        dir.join("san.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            "san.ext",
            "-out",
            "server.crt",
        ],
    );
    openssl(dir, &["genrsa", "-out", "sa.key", "2048"]);
    openssl(dir, &["rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub"]);
    let token = format!(
        "fanout-test-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    );
    std::fs::write(
        dir.join("tokens.csv"),
        format!("{token},fanout-test-admin,fanout-test-admin,system:masters\n"),
    )
    .unwrap();
    token
}

/// Spawn `command` in its own process group, killed with the test process.
fn spawn(command: &mut Command, log: &Path) -> Child {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    command
        .stdin(Stdio::null())
        .stdout(file.try_clone().unwrap())
        .stderr(file)
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
    command
        .spawn()
        .unwrap_or_else(|e| panic!("start {command:?}: {e}"))
}

/// SIGKILL `child`'s process group and reap it.
fn kill(child: &mut Option<Child>) {
    if let Some(mut child) = child.take() {
        // SAFETY: signalling a process group this harness created.
        unsafe {
            libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL);
        }
        let _ = child.wait();
    }
}

/// etcd and a kube-apiserver on loopback.
pub struct KubeApi {
    child: Option<Child>,
    pub port: u16,
    pub kubeconfig: PathBuf,
    dir: TempDir,
    // Dropped after the apiserver (fields drop in order).
    _etcd: EtcdCluster,
}

impl KubeApi {
    /// Start etcd and the apiserver, and wait (bounded) until it is ready.
    pub fn start() -> KubeApi {
        let etcd = EtcdCluster::start(1);
        let dir = TempDir::new("fanout-kube", "the kube-apiserver's credentials and log");
        let token = credentials(dir.path());
        let port = free_ports(1)[0];
        let kubeconfig = dir.path().join("kubeconfig");
        let config = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: \
             https://127.0.0.1:{port}\n    certificate-authority: {ca}\nusers:\n- name: admin\n  \
             user:\n    token: {token}\ncontexts:\n- name: test\n  context: {{cluster: test, \
             user: admin}}\ncurrent-context: test\n",
            ca = dir.path().join("ca.crt").display()
        );
        std::fs::write(&kubeconfig, config).unwrap();
        let mut api = KubeApi {
            child: None,
            port,
            kubeconfig,
            dir,
            _etcd: etcd,
        };
        api.spawn();
        api
    }

    fn spawn(&mut self) {
        let d = |name: &str| self.dir.path().join(name).display().to_string();
        let etcd = format!("http://127.0.0.1:{}", self._etcd.client_ports()[0]);
        let mut command = Command::new(given("KUBE_APISERVER_BIN"));
        command.args([
            &format!("--etcd-servers={etcd}"),
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            &format!("--secure-port={}", self.port),
            &format!("--cert-dir={}", d("certs")),
            &format!("--tls-cert-file={}", d("server.crt")),
            &format!("--tls-private-key-file={}", d("server.key")),
            &format!("--client-ca-file={}", d("ca.crt")),
            &format!("--token-auth-file={}", d("tokens.csv")),
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            &format!("--service-account-key-file={}", d("sa.pub")),
            &format!("--service-account-signing-key-file={}", d("sa.key")),
            "--service-cluster-ip-range=10.96.0.0/16",
            "--endpoint-reconciler-type=none",
            "--enable-priority-and-fairness=false",
            "--profiling=false",
            "--v=1",
        ]);
        self.child = Some(spawn(&mut command, &self.dir.path().join("apiserver.log")));
        self.wait_ready();
    }

    /// Wait (bounded) until `/readyz` answers ok.
    pub fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let out = self.kubectl(&["get", "--raw", "/readyz"]);
            if out.0 && out.1.trim() == "ok" {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "kube-apiserver not ready within 90 s: {}\n{}",
                out.2,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Kill the apiserver (SIGKILL) and start it again on the same port and etcd, with etcd's
    /// history compacted meanwhile (past every client's resourceVersion): the restart as a
    /// client may find it, its watches answered 410 Gone and listed again. (Without the
    /// compaction, whether a watch resumes or lists again depends on what was written last.)
    pub fn restart(&mut self) {
        kill(&mut self.child);
        self._etcd.write_and_compact();
        self.spawn();
    }

    pub fn log(&self) -> String {
        let text =
            std::fs::read_to_string(self.dir.path().join("apiserver.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// `kubectl ARGS` on this apiserver: (success, stdout, stderr).
    pub fn kubectl(&self, args: &[&str]) -> (bool, String, String) {
        let out = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(["--request-timeout", "10s"])
            .args(args)
            .output()
            .expect("run kubectl");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// `kubectl ARGS`, which must succeed: its stdout.
    pub fn run(&self, args: &[&str]) -> String {
        let (ok, out, err) = self.kubectl(args);
        assert!(ok, "kubectl {args:?}: {err}{out}");
        out
    }

    /// `kubectl apply -f -` of `yaml`.
    pub fn apply(&self, yaml: &str) {
        use std::io::Write;
        let mut child = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(["apply", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run kubectl");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(yaml.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "kubectl apply: {}\n{yaml}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `kubectl get KIND NAME -n NS -o json`, None when it does not exist.
    pub fn get(&self, kind: &str, namespace: &str, name: &str) -> Option<Value> {
        let (ok, out, err) = self.kubectl(&["get", kind, name, "-n", namespace, "-o", "json"]);
        if !ok {
            assert!(err.contains("NotFound"), "kubectl get {kind} {name}: {err}");
            return None;
        }
        Some(serde_json::from_str(&out).unwrap())
    }

    /// Wait (bounded) until `pred` holds for the object; returns it.
    pub fn wait_for(
        &self,
        (kind, namespace, name): (&str, &str, &str),
        what: &str,
        timeout: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let object = self.get(kind, namespace, name);
            if let Some(object) = object.as_ref().filter(|o| pred(o)) {
                return object.clone();
            }
            assert!(
                Instant::now() < deadline,
                "{kind} {namespace}/{name}: {what}: not within {timeout:?}: {object:#?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        if std::thread::panicking() && self.child.is_some() {
            eprintln!("--- kube-apiserver's log (end) ---\n{}\n---", self.log());
        }
        kill(&mut self.child);
    }
}

/// Knative Eventing's controller on `api`, with its namespace, ConfigMaps and CRDs.
pub struct Knative {
    child: Option<Child>,
    dir: TempDir,
}

impl Knative {
    pub fn start(api: &KubeApi) -> Knative {
        let src = given("KNATIVE_EVENTING_SRC");
        api.run(&["create", "namespace", "knative-eventing"]);
        for dir in ["config/core/resources", "config/core/configmaps"] {
            api.run(&["apply", "-f", src.join(dir).to_str().unwrap()]);
        }
        let dir = TempDir::new("fanout-knative", "Knative's controller log");
        let mut command = Command::new(given("KNATIVE_CONTROLLER_BIN"));
        command
            .arg("--disable-ha")
            .arg("--kubeconfig")
            .arg(&api.kubeconfig)
            .env("SYSTEM_NAMESPACE", "knative-eventing")
            .env("KUBERNETES_MIN_VERSION", "v1.24.0")
            .env("APISERVER_RA_IMAGE", "unused.example/apiserver-ra")
            .env("AUTH_PROXY_IMAGE", "unused.example/auth-proxy")
            .env("POD_NAME", "eventing-controller-test")
            .env("CONTAINER_NAME", "controller");
        let child = spawn(&mut command, &dir.path().join("controller.log"));
        Knative {
            child: Some(child),
            dir,
        }
    }

    pub fn log(&self) -> String {
        let text =
            std::fs::read_to_string(self.dir.path().join("controller.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    }
}

impl Drop for Knative {
    fn drop(&mut self) {
        if std::thread::panicking() && self.child.is_some() {
            eprintln!(
                "--- Knative controller's log (end) ---\n{}\n---",
                self.log()
            );
        }
        kill(&mut self.child);
    }
}
