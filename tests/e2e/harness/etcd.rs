//! A real etcd cluster on loopback for the dedupe store's tests: `n` members of the pinned
//! etcd (`ETCD_BIN`, `make etcd`), each in its own process group, their data in a temp dir,
//! stopped (SIGKILL) when the guard drops. Members can be killed and started again; the
//! keys under a prefix are read with the gateway's range.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::{json, Value};

use super::{free_ports, TempDir};

/// The etcd binary: `ETCD_BIN` (the Makefile exports it). Missing is a failure, not a skip.
pub fn etcd_bin() -> PathBuf {
    let bin = std::env::var_os("ETCD_BIN")
        .map(PathBuf::from)
        .expect("ETCD_BIN is not set: run `make etcd` and the tests through the Makefile");
    assert!(
        bin.exists(),
        "ETCD_BIN {} does not exist: run `make etcd`",
        bin.display()
    );
    bin
}

struct Member {
    name: String,
    client: u16,
    peer: u16,
    child: Option<Child>,
}

pub struct EtcdCluster {
    members: Vec<Member>,
    dir: TempDir,
}

impl EtcdCluster {
    /// `n` members, started and answering.
    pub fn start(n: usize) -> EtcdCluster {
        let ports = free_ports(2 * n);
        let members: Vec<Member> = (0..n)
            .map(|i| Member {
                name: format!("m{i}"),
                client: ports[2 * i],
                peer: ports[2 * i + 1],
                child: None,
            })
            .collect();
        let mut cluster = EtcdCluster {
            members,
            dir: TempDir::new("fanout-etcd", "etcd's data and logs"),
        };
        for i in 0..n {
            cluster.spawn(i);
        }
        for i in 0..n {
            cluster.wait_healthy(i);
        }
        cluster
    }

    fn spawn(&mut self, i: usize) {
        let initial: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer))
            .collect();
        let dir = self.dir.path().to_path_buf();
        let m = &mut self.members[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(format!("{}.log", m.name)))
            .unwrap();
        let child = Command::new(etcd_bin())
            .args([
                "--name",
                &m.name,
                "--data-dir",
                dir.join(&m.name).to_str().unwrap(),
                "--listen-client-urls",
                &format!("http://127.0.0.1:{}", m.client),
                "--advertise-client-urls",
                &format!("http://127.0.0.1:{}", m.client),
                "--listen-peer-urls",
                &format!("http://127.0.0.1:{}", m.peer),
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{}", m.peer),
                "--initial-cluster",
                &initial.join(","),
                "--initial-cluster-token",
                "fanout-e2e",
                "--heartbeat-interval",
                "50",
                "--election-timeout",
                "500",
                "--log-level",
                "warn",
            ])
            .stdout(Stdio::null())
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("starting etcd: {e}"));
        m.child = Some(child);
    }

    /// Waits (bounded) until member `i` says it is healthy: up, and its cluster has a leader.
    pub fn wait_healthy(&self, i: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let port = self.members[i].client;
        while Instant::now() < deadline {
            if let Some((200, body)) = http(port, "GET", "/health", "") {
                if body.contains("\"true\"") {
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "etcd member {i} is not healthy after 20 s; logs in {:?}",
            self.dir.path()
        );
    }

    pub fn client_ports(&self) -> Vec<u16> {
        self.members.iter().map(|m| m.client).collect()
    }

    /// An Envoy cluster of the members, health-checked (`/health`, every 100 ms) so that
    /// Envoy stops sending to a member that is gone.
    pub fn envoy_load_assignment(&self, name: &str) -> Value {
        json!({
            "cluster_name": name,
            "endpoints": [{ "lb_endpoints": self.members.iter().map(|m| json!({
                "endpoint": { "address": { "socket_address": {
                    "address": "127.0.0.1", "port_value": m.client } } }
            })).collect::<Vec<_>>() }]
        })
    }

    /// What Envoy's cluster of etcd members needs: fanout speaks etcd's gRPC API, HTTP/2
    /// (here without TLS).
    pub fn envoy_protocol_options() -> Value {
        json!({
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": { "http2_protocol_options": {} }
            }
        })
    }

    pub fn health_checks() -> Value {
        json!([{
            "timeout": "0.2s", "interval": "0.1s",
            "unhealthy_threshold": 1, "healthy_threshold": 1,
            "no_traffic_interval": "0.1s",
            "http_health_check": { "path": "/health" }
        }])
    }

    /// Kills member `i` (SIGKILL).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            // SAFETY: signalling a process group we created.
            unsafe {
                libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL);
            }
            let _ = child.wait();
        }
    }

    /// Starts member `i` again, on its data, and waits until the cluster answers.
    pub fn restart(&mut self, i: usize) {
        self.spawn(i);
    }

    pub fn wait_all_healthy(&self) {
        for i in 0..self.members.len() {
            self.wait_healthy(i);
        }
    }

    /// A write to a key of the harness's own, then etcd's history compacted up to it:
    /// every watch from an earlier revision (a kube-apiserver's client resuming after a
    /// restart) is answered 410 Gone, as it is once the apiserver's own compaction (every
    /// 5 minutes) passes it. The revision compacted to.
    pub fn write_and_compact(&self) -> i64 {
        let b64 = base64::engine::general_purpose::STANDARD;
        let put = json!({ "key": b64.encode("/fanout-e2e/compact"), "value": b64.encode("1") });
        for m in self.members.iter().filter(|m| m.child.is_some()) {
            let Some((200, answer)) = http(m.client, "POST", "/v3/kv/put", &put.to_string()) else {
                continue;
            };
            let doc: Value = serde_json::from_str(&answer).unwrap();
            let revision: i64 = doc["header"]["revision"].as_str().unwrap().parse().unwrap();
            let compact = json!({ "revision": revision, "physical": true }).to_string();
            let done = http(m.client, "POST", "/v3/kv/compaction", &compact);
            assert!(matches!(done, Some((200, _))), "etcd compaction: {done:?}");
            return revision;
        }
        panic!("no etcd member answered the put");
    }

    /// The keys under `prefix` and their values, read from a member that is up.
    pub fn keys(&self, prefix: &str) -> Vec<(String, String)> {
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut end = prefix.as_bytes().to_vec();
        if let Some(last) = end.last_mut() {
            *last += 1;
        }
        let body = json!({ "key": b64.encode(prefix), "range_end": b64.encode(&end) }).to_string();
        for m in self.members.iter().filter(|m| m.child.is_some()) {
            if let Some((200, answer)) = http(m.client, "POST", "/v3/kv/range", &body) {
                let doc: Value = serde_json::from_str(&answer).unwrap();
                let text = |v: &Value| {
                    String::from_utf8_lossy(&b64.decode(v.as_str().unwrap_or("")).unwrap())
                        .into_owned()
                };
                return doc["kvs"]
                    .as_array()
                    .map(|kvs| {
                        kvs.iter()
                            .map(|kv| (text(&kv["key"]), text(&kv["value"])))
                            .collect()
                    })
                    .unwrap_or_default();
            }
        }
        panic!("no etcd member answered the range");
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}

/// One plain HTTP exchange with an etcd member: status and body. HTTP/1.0, so that a long
/// answer comes whole, not chunked.
fn http(port: u16, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    let mut conn = TcpStream::connect(("127.0.0.1", port)).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        conn,
        "{method} {path} HTTP/1.0\r\nHost: etcd\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer).ok()?;
    let status = answer.get(9..12)?.parse().ok()?;
    let body = answer.split_once("\r\n\r\n")?.1.to_string();
    Some((status, body))
}
