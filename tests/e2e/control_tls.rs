//! fanout-control with mutual TLS on its xDS port (`--tls-cert`, `--tls-key`, `--client-ca`),
//! and real Envoys on the shipped cluster bootstrap (`envoy/xds/envoy-cluster.yaml` with its
//! SDS files, `envoy/xds/sds/`), the names in it as shipped: the server's name
//! `fanout-control.fanout-system.svc` (SNI and the certificate check), reached by DNS
//! (`localhost` here, on loopback). Certificates are made per test with the openssl CLI.
//!
//! - an Envoy with a client certificate from the CA is served, and named by the SPIFFE URI in
//!   its certificate followed by its pod name;
//! - an Envoy without a client certificate, or with one from another CA, is refused;
//! - new server certificate files are taken for new connections without dropping a stream;
//! - `--forget-after`: an Envoy gone that long leaves `/state`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness::control::Control;
use crate::harness::{free_ports, read_shipped, read_shipped_yaml, Client, Envoy, TempDir};
use serde_json::{json, Value};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(20);
const SERVER_NAME: &str = "fanout-control.fanout-system.svc";
const IDENTITY: &str = "spiffe://cluster.local/ns/fanout/sa/fanout";

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

/// A CA: `<name>.crt` and `<name>.key` in `dir`.
fn make_ca(dir: &Path, name: &str) {
    let (key, crt) = (format!("{name}.key"), format!("{name}.crt"));
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &crt,
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
}

/// A certificate `<name>.crt` (key `<name>.key`) signed by the CA `ca`, with these
/// subjectAltNames (`DNS:...`, `URI:...`).
fn make_cert(dir: &Path, ca: &str, name: &str, sans: &str) {
    let (key, csr, crt) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.crt"),
    );
    let ext = format!("{name}.ext");
    fs::write(
        dir.join(&ext),
        format!(
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n\
             extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName={sans}\n"
        ),
    )
    .unwrap();
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &format!("/CN={name}"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &format!("{ca}.crt"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &ext,
            "-out",
            &crt,
        ],
    );
}

/// Everything one test needs: CA `ca` (server and good client), CA `other` (a client from
/// elsewhere).
struct Pki {
    dir: TempDir,
}

impl Pki {
    fn new() -> Pki {
        let dir = TempDir::new("fanout-control-pki", "test certificates");
        let d = dir.path();
        make_ca(d, "ca");
        make_ca(d, "other");
        make_cert(d, "ca", "server", &format!("DNS:{SERVER_NAME}"));
        make_cert(
            d,
            "ca",
            "client",
            &format!("URI:{IDENTITY},DNS:fanout.fanout.svc"),
        );
        make_cert(d, "other", "stranger", &format!("URI:{IDENTITY}"));
        Pki { dir }
    }

    fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    /// The server's options.
    fn server_args(&self) -> Vec<String> {
        vec![
            "--tls-cert".into(),
            self.path("server.crt").display().to_string(),
            "--tls-key".into(),
            self.path("server.key").display().to_string(),
            "--client-ca".into(),
            self.path("ca.crt").display().to_string(),
        ]
    }

    /// A Secret as the kubelet mounts it (tls.crt, tls.key, ca.crt) for client `name`.
    fn secret_dir(&self, name: &str) -> PathBuf {
        let dir = self.path(&format!("secret-{name}"));
        fs::create_dir_all(&dir).unwrap();
        fs::copy(self.path(&format!("{name}.crt")), dir.join("tls.crt")).unwrap();
        fs::copy(self.path(&format!("{name}.key")), dir.join("tls.key")).unwrap();
        fs::copy(self.path("ca.crt"), dir.join("ca.crt")).unwrap();
        dir
    }
}

fn start_control(pki: &Pki, source: &Path, more: &[&str]) -> Control {
    let mut args = pki.server_args();
    args.extend(more.iter().map(|s| (*s).to_owned()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Control::start_with(source, free_ports(1)[0], &args)
}

/// The shipped cluster bootstrap on loopback: its listeners on ephemeral ports, the server
/// at `localhost:<xds_port>`, its SDS files copied beside it with the Secret's directory
/// `secret` (None: the client certificate taken out, as an Envoy without one).
fn cluster_envoy(
    node: &str,
    xds_port: u16,
    secret: Option<&Path>,
    ca_dir: &Path,
) -> (Envoy, TempDir) {
    let dir = TempDir::new("fanout-xds-envoy", "the bootstrap's SDS files");
    let tls_dir = secret.unwrap_or(ca_dir);
    let mut sds = Vec::new();
    for name in ["xds-client.yaml", "xds-server-ca.yaml"] {
        let text = read_shipped(&format!("envoy/xds/sds/{name}"))
            .replace("/etc/fanout-xds-tls", &tls_dir.display().to_string());
        let path = dir.path().join(name);
        fs::write(&path, text).unwrap();
        sds.push(path.display().to_string());
    }
    let mut bootstrap = read_shipped_yaml("envoy/xds/envoy-cluster.yaml");
    let admin_port = free_ports(1)[0];
    bootstrap["admin"]["address"]["socket_address"] =
        json!({ "address": "127.0.0.1", "port_value": admin_port });
    for listener in bootstrap["static_resources"]["listeners"]
        .as_array_mut()
        .unwrap()
    {
        listener["address"]["socket_address"] = json!({ "address": "127.0.0.1", "port_value": 0 });
    }
    for cluster in bootstrap["static_resources"]["clusters"]
        .as_array_mut()
        .unwrap()
    {
        let is_xds = cluster["name"] == "fanout-control";
        let endpoint = &mut cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
            ["endpoint"]["address"]["socket_address"];
        if is_xds {
            assert_eq!(
                endpoint["address"],
                "fanout-control.fanout-system.svc.cluster.local"
            );
            *endpoint = json!({ "address": "localhost", "port_value": xds_port });
            let context = &mut cluster["transport_socket"]["typed_config"]["common_tls_context"];
            assert_eq!(
                context["tls_certificate_sds_secret_configs"][0]["name"],
                "xds-client"
            );
            context["tls_certificate_sds_secret_configs"][0]["sds_config"]["path_config_source"] =
                json!({ "path": sds[0], "watched_directory": { "path": tls_dir } });
            context["validation_context_sds_secret_config"]["sds_config"]["path_config_source"] =
                json!({ "path": sds[1], "watched_directory": { "path": tls_dir } });
            if secret.is_none() {
                context
                    .as_object_mut()
                    .unwrap()
                    .remove("tls_certificate_sds_secret_configs");
            }
        } else {
            endpoint["port_value"] = json!(admin_port);
        }
    }
    crate::harness::native_ecds(&mut bootstrap);
    let envoy = Envoy::builder()
        .raw_bootstrap(bootstrap)
        .args_list(&["--service-node", node])
        .start_unready();
    (envoy, dir)
}

fn channel_file(dir: &Path, name: &str, uri: &str) {
    let text = format!(
        "apiVersion: messaging.knative.dev/v1\nkind: InMemoryChannel\nmetadata: {{name: {name}, namespace: default}}\n\
         spec:\n  subscribers:\n    - {{subscriberUri: '{uri}'}}\nstatus:\n  address: {{url: 'http://{name}.example'}}\n"
    );
    let tmp = dir.join(format!(".{name}.tmp"));
    fs::write(&tmp, text).unwrap();
    fs::rename(&tmp, dir.join(format!("{name}.yaml"))).unwrap();
}

fn admin_stat(envoy: &Envoy, name: &str) -> Option<u64> {
    let admin = envoy.admin_now()?;
    let (_, body) = crate::harness::http_get(admin, &format!("/stats?filter=^{name}$"))?;
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .and_then(|v| v.trim().parse().ok())
}

/// The leaf certificate (PEM body) the server shows to a new TLS connection.
fn served_certificate(pki: &Pki, port: u16) -> String {
    let out = Command::new("openssl")
        .args(["s_client", "-connect", &format!("127.0.0.1:{port}")])
        .args(["-servername", SERVER_NAME, "-alpn", "h2"])
        .arg("-cert")
        .arg(pki.path("client.crt"))
        .arg("-key")
        .arg(pki.path("client.key"))
        .stdin(std::process::Stdio::null())
        .output()
        .expect("openssl s_client");
    let text = String::from_utf8_lossy(&out.stdout);
    let begin = text
        .find("-----BEGIN CERTIFICATE-----")
        .expect("a certificate");
    let end = text[begin..]
        .find("-----END CERTIFICATE-----")
        .expect("its end")
        + begin;
    text[begin..end].to_owned()
}

fn pem_body(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap();
    let end = text.find("-----END CERTIFICATE-----").unwrap();
    text[..end].to_owned()
}

#[test]
fn an_envoy_with_a_certificate_from_the_ca_is_served_under_its_certificate_name() {
    let pki = Pki::new();
    let source = TempDir::new("fanout-control-src", "the source directory");
    let subscriber = crate::harness::Subscriber::ok("billing");
    channel_file(
        source.path(),
        "orders",
        &format!("http://127.0.0.1:{}/", subscriber.port()),
    );
    let control = start_control(&pki, source.path(), &[]);
    let secret = pki.secret_dir("client");
    let (mut envoy, _sds) = cluster_envoy("pod-a", control.xds_port, Some(&secret), pki.dir.path());
    envoy.wait_started();
    let name = format!("{IDENTITY}#pod-a");
    let state = control.wait_for_state("the Envoy current", WAIT, |s| {
        s["channels"]["default/orders"]["envoys"][&name]["state"] == "current"
    });
    assert_eq!(
        state["envoys"].as_object().unwrap().len(),
        1,
        "one Envoy, by its certificate's name: {state:#}"
    );
    let client = Client::http1_resolving("orders.example", envoy.addr());
    let reply = crate::harness::send(
        client
            .post(&format!("http://orders.example:{}/", envoy.port()))
            .header("content-type", "application/json")
            .body("{}"),
    );
    assert_eq!(reply.status, 202);
    assert_eq!(subscriber.count(), 1);
}

#[test]
fn envoys_without_a_client_certificate_or_from_another_ca_are_refused() {
    let pki = Pki::new();
    let source = TempDir::new("fanout-control-src", "the source directory");
    channel_file(source.path(), "orders", "http://127.0.0.1:1/");
    let control = start_control(&pki, source.path(), &[]);
    let stranger = pki.secret_dir("stranger");
    let (no_cert, _a) = cluster_envoy("no-cert", control.xds_port, None, pki.dir.path());
    let (from_elsewhere, _b) = cluster_envoy(
        "stranger",
        control.xds_port,
        Some(&stranger),
        pki.dir.path(),
    );
    let envoys = [no_cert, from_elsewhere];
    // Each Envoy tries (and retries) its handshake; the server refuses every one, saying why.
    let deadline = Instant::now() + WAIT;
    let refusals = |why: &str| {
        control
            .log()
            .lines()
            .filter(|l| l.contains("refused") && l.contains(why))
            .count()
    };
    while refusals("peer sent no certificates") < 2 || refusals("UnknownIssuer") < 2 {
        assert!(
            Instant::now() < deadline,
            "the Envoys were not refused twice each: {}",
            control.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The Envoys saw it: their connections to the server failed or were closed on them.
    for envoy in &envoys {
        let failed = ["ssl.connection_error", "upstream_cx_destroy_remote"]
            .iter()
            .filter_map(|stat| admin_stat(envoy, &format!("cluster.fanout-control.{stat}")))
            .sum::<u64>();
        assert!(failed >= 1, "{}", envoy.log());
    }
    let state = control.state();
    assert_eq!(state["envoys"], json!({}), "{state:#}");
    for envoy in &envoys {
        let admin = envoy.admin_now().expect("admin");
        let ready = crate::harness::http_get(admin, "/ready").map(|(code, _)| code);
        assert_eq!(ready, Some(503), "an Envoy with nothing is not ready");
    }
}

#[test]
fn new_certificate_files_are_served_to_new_connections_and_streams_stay() {
    let pki = Pki::new();
    let source = TempDir::new("fanout-control-src", "the source directory");
    channel_file(source.path(), "orders", "http://127.0.0.1:1/");
    let control = start_control(&pki, source.path(), &[]);
    let secret = pki.secret_dir("client");
    let (mut envoy, _sds) = cluster_envoy("pod-a", control.xds_port, Some(&secret), pki.dir.path());
    envoy.wait_started();
    let before = served_certificate(&pki, control.xds_port);
    assert_eq!(before, pem_body(&pki.path("server.crt")));
    assert_eq!(
        admin_stat(&envoy, "cluster.fanout-control.upstream_cx_total"),
        Some(1)
    );

    // cert-manager renews: a new key and certificate for the same name, written in place.
    make_cert(
        pki.dir.path(),
        "ca",
        "renewed",
        &format!("DNS:{SERVER_NAME}"),
    );
    fs::copy(pki.path("renewed.key"), pki.path("server.key")).unwrap();
    fs::copy(pki.path("renewed.crt"), pki.path("server.crt")).unwrap();
    let renewed = pem_body(&pki.path("renewed.crt"));
    let deadline = Instant::now() + WAIT;
    while served_certificate(&pki, control.xds_port) != renewed {
        assert!(Instant::now() < deadline, "not reloaded: {}", control.log());
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(control.log().contains("TLS files reloaded"));

    // The Envoy's stream stayed, and still carries changes.
    channel_file(source.path(), "shipping", "http://127.0.0.1:2/");
    let name = format!("{IDENTITY}#pod-a");
    control.wait_for_state("the change reached the Envoy", WAIT, |s| {
        s["channels"]["default/shipping"]["envoys"][&name]["state"] == "current"
    });
    assert_eq!(
        admin_stat(&envoy, "cluster.fanout-control.upstream_cx_total"),
        Some(1),
        "the Envoy reconnected"
    );

    // Files that do not load are logged, and the last good ones stay.
    let failures = control.log().matches("do not load").count();
    fs::write(pki.path("server.key"), "not a key").unwrap();
    let deadline = Instant::now() + WAIT;
    while control.log().matches("do not load").count() == failures {
        assert!(Instant::now() < deadline, "{}", control.log());
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(served_certificate(&pki, control.xds_port), renewed);
}

#[test]
fn an_envoy_gone_longer_than_forget_after_is_forgotten() {
    let source = TempDir::new("fanout-control-src", "the source directory");
    channel_file(source.path(), "orders", "http://127.0.0.1:1/");
    let control = Control::start_with(source.path(), free_ports(1)[0], &["--forget-after", "1"]);
    let mut envoy = crate::harness::control::xds_envoy("gone", control.xds_port).start();
    control.wait_for_state("the Envoy known", WAIT, |s| {
        s["envoys"]["gone"]["streams"] == 1
    });
    let metrics = |control: &Control| {
        let (code, body) = control.get("/metrics").expect("GET /metrics");
        assert_eq!(code, 200);
        body
    };
    assert!(metrics(&control).contains(r#"node="gone""#));
    envoy.stop();
    let state = control.wait_for_state("the Envoy forgotten", WAIT, |s| {
        s["envoys"].get("gone").is_none()
    });
    assert_eq!(state["envoys"], json!({}), "{state:#}");
    assert!(
        !metrics(&control).contains(r#"node="gone""#),
        "{}",
        metrics(&control)
    );
}

#[test]
fn the_cluster_bootstrap_names_what_the_manifests_provide() {
    let bootstrap: Value = read_shipped_yaml("envoy/xds/envoy-cluster.yaml");
    let listeners = bootstrap["static_resources"]["listeners"]
        .as_array()
        .unwrap();
    let port = |name: &str| {
        listeners.iter().find(|l| l["name"] == name).unwrap()["address"]["socket_address"].clone()
    };
    assert_eq!(
        port("ingress"),
        json!({ "address": "0.0.0.0", "port_value": 8080 })
    );
    assert_eq!(
        port("admin_read"),
        json!({ "address": "0.0.0.0", "port_value": 9902 })
    );
    let cluster = &bootstrap["static_resources"]["clusters"][0];
    assert_eq!(cluster["type"], "STRICT_DNS");
    assert!(cluster["typed_extension_protocol_options"]
        .to_string()
        .contains("http2_protocol_options"));
    assert_eq!(
        cluster["transport_socket"]["typed_config"]["sni"],
        SERVER_NAME
    );
}
