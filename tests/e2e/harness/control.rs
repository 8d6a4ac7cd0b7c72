//! The control plane, `fanout-control` (the built binary: `FANOUT_CONTROL_BIN`, else
//! `target/release/fanout-control`, which `make control` builds), run as a child in its own
//! process group on loopback, and Envoys on the shipped `envoy/xds/envoy.yaml` pointed at it.

use super::{manifest_dir, read_shipped_yaml, Envoy, EnvoyBuilder, TempDir};
use serde_json::{json, Value};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn control_bin() -> PathBuf {
    let bin = std::env::var_os("FANOUT_CONTROL_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest_dir().join("target/release/fanout-control"));
    assert!(
        bin.is_file(),
        "{} is missing: run `make control` (or set FANOUT_CONTROL_BIN)",
        bin.display()
    );
    bin
}

/// The options that choose the build the server's Envoys load, unless `more` chooses: the
/// built wasm module, or on the native build (`FANOUT_BUILD=native`) the native build by its
/// name, `fanout`, which the Envoys find in their `ENVOY_DYNAMIC_MODULES_SEARCH_PATH`.
pub fn build_args(more: &[&str]) -> Vec<std::ffi::OsString> {
    let chosen = |flag: &str| {
        more.iter()
            .any(|a| *a == flag || a.starts_with(&format!("{flag}=")))
    };
    if chosen("--wasm") || chosen("--build") {
        return Vec::new();
    }
    match super::fanout_build() {
        super::Build::Wasm => vec!["--wasm".into(), super::wasm_path().into()],
        super::Build::Native => vec!["--build".into(), "native".into()],
    }
}

/// A running `fanout-control`. Dropping it stops its process group.
pub struct Control {
    child: Option<Child>,
    log: PathBuf,
    pub xds_port: u16,
    pub http_port: u16,
    _dir: TempDir,
}

impl Control {
    /// Start the server on `source_dir` with its xDS on `xds_port`, and wait for `/ready`.
    pub fn start(source_dir: &Path, xds_port: u16) -> Control {
        Control::start_with(source_dir, xds_port, &[])
    }

    /// [`Control::start`] with more options of the server (`--oidc-issuer`, `--resolve`, ...).
    pub fn start_with(source_dir: &Path, xds_port: u16, more: &[&str]) -> Control {
        let source = format!("dir:{}", source_dir.display());
        Control::start_on(&source, xds_port, more, &[])
    }

    /// The server on `--source kubernetes`, with `KUBECONFIG` set to `kubeconfig`.
    pub fn start_kubernetes(kubeconfig: &Path, xds_port: u16, more: &[&str]) -> Control {
        let env = [("KUBECONFIG", kubeconfig.as_os_str())];
        Control::start_on("kubernetes", xds_port, more, &env)
    }

    /// The server on `--source SOURCE`, with these environment variables set.
    pub fn start_on(
        source: &str,
        xds_port: u16,
        more: &[&str],
        env: &[(&str, &std::ffi::OsStr)],
    ) -> Control {
        let http_port = super::free_ports(1)[0];
        let dir = TempDir::new("fanout-control", "the control plane's log");
        let log = dir.path().join("control.log");
        let mut command = Command::new(control_bin());
        command
            .args(["--source", source])
            .envs(env.iter().copied())
            .args(["--xds-address", &format!("127.0.0.1:{xds_port}")])
            .args(["--http-address", &format!("127.0.0.1:{http_port}")])
            .args(build_args(more))
            .args(more)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).expect("create the log"))
            .stderr(
                std::fs::File::create(dir.path().join("stderr.log")).expect("create stderr.log"),
            )
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
        let child = command.spawn().expect("start fanout-control");
        let control = Control {
            child: Some(child),
            log,
            xds_port,
            http_port,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while control.get("/ready").map(|(code, _)| code) != Some(200) {
            assert!(
                Instant::now() < deadline,
                "fanout-control did not become ready: {}",
                control.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        control
    }

    /// The server's pid (also its process group).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    pub fn log(&self) -> String {
        let stderr = self.log.with_file_name("stderr.log");
        [&self.log, &stderr]
            .iter()
            .filter_map(|p| std::fs::read_to_string(p).ok())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// `GET path` on the state address: (status, body).
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        let url = format!("http://127.0.0.1:{}{path}", self.http_port);
        let response = reqwest::blocking::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(5))
            .build()
            .ok()?
            .get(url)
            .send()
            .ok()?;
        let code = response.status().as_u16();
        Some((code, response.text().ok()?))
    }

    /// GET /state.
    pub fn state(&self) -> Value {
        let (code, body) = self.get("/state").expect("GET /state");
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).expect("/state is JSON")
    }

    /// Wait (bounded) until `pred` holds for the state; returns the last state.
    pub fn wait_for_state(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let state = self.state();
            if pred(&state) {
                return state;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not within {timeout:?}; state: {state:#}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGTERM the server's process group and wait for it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pgid = child.id() as libc::pid_t;
            // SAFETY: signalling a process group this harness created.
            unsafe {
                libc::kill(-pgid, libc::SIGTERM);
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            // SAFETY: as above; ESRCH when the group is gone is fine.
            unsafe {
                libc::kill(-pgid, libc::SIGKILL);
            }
            let _ = child.wait();
        }
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        if std::thread::panicking() && self.child.is_some() {
            eprintln!("--- fanout-control's log ---\n{}\n---", self.log());
        }
        self.stop();
    }
}

/// The shipped `envoy/xds/envoy.yaml`, on ephemeral ports, pointed at the server on
/// `xds_port`, with node id `node` (Envoy's `--service-node`, as the file says); on the native
/// build, made the native build's ([`native_ecds`](super::native_ecds)).
pub fn xds_envoy(node: &str, xds_port: u16) -> EnvoyBuilder {
    let mut bootstrap = read_shipped_yaml("envoy/xds/envoy.yaml");
    let zero = json!({ "socket_address": { "address": "127.0.0.1", "port_value": 0 } });
    bootstrap["admin"]["address"] = zero.clone();
    bootstrap["static_resources"]["listeners"][0]["address"] = zero;
    let cluster = &mut bootstrap["static_resources"]["clusters"][0];
    assert_eq!(cluster["name"], "fanout-control");
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        ["socket_address"]["port_value"] = json!(xds_port);
    super::native_ecds(&mut bootstrap);
    Envoy::builder()
        .raw_bootstrap(bootstrap)
        .args_list(&["--service-node", node])
}

/// CPU time (user + system) a process has used so far, from /proc (clock ticks of 10 ms).
pub fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command name (which is in parentheses and may hold spaces).
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|i| fields.get(*i)?.parse::<u64>().ok())
        .sum();
    Duration::from_millis(ticks * 10)
}

/// How `fanout-control render` starts each line it prints.
pub const RENDER_PREFIX: &str = "fanout-control render";

/// `fanout-control render --source dir:<source_dir> --out <out> <more>`: (exit code, stdout,
/// stderr).
pub fn render(source_dir: &Path, out: &Path, more: &[&str]) -> (i32, String, String) {
    let output = Command::new(control_bin())
        .arg("render")
        .arg(format!("--source=dir:{}", source_dir.display()))
        .arg(format!("--out={}", out.display()))
        .args(more)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run fanout-control render: {e}"));
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// [`render`] on one file of Knative objects (`objects`, its text), in a source directory
/// of its own under `dir`.
pub fn render_objects(
    dir: &Path,
    objects: &str,
    out: &Path,
    more: &[&str],
) -> (i32, String, String) {
    let source = dir.join("source");
    std::fs::create_dir_all(&source).expect("create the source directory");
    std::fs::write(source.join("objects.json"), objects).expect("write the objects");
    render(&source, out, more)
}
