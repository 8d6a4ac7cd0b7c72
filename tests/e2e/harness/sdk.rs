//! The CloudEvents Python SDK as a real client and a real consumer: the e2e tests send events
//! the way a user's code does and read dead letters the way a user's consumer does.
//!
//! The SDK lives in the Envoy venv (`make sdk`, pinned in the Makefile); the Makefile exports
//! its Python as `FANOUT_SDK_PYTHON`. Without it a test fails with a message that says how to
//! get it: a missing SDK is a failure, never a skip.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use base64::Engine;
use serde_json::{json, Value};

use super::{send, Client, Envoy, Recorded, Reply};

/// The Python that has the CloudEvents SDK.
pub fn sdk_python() -> PathBuf {
    let python = std::env::var_os("FANOUT_SDK_PYTHON").map(PathBuf::from).unwrap_or_else(|| {
        panic!("FANOUT_SDK_PYTHON is not set: run the e2e tests through `make test-e2e` (it installs the CloudEvents SDK with `make sdk`)")
    });
    assert!(
        python.exists(),
        "FANOUT_SDK_PYTHON={} does not exist: run `make sdk`",
        python.display()
    );
    python
}

/// Runs `script` (Python source) with the SDK's Python, `args` as `sys.argv[1..]` and `stdin`
/// on its standard input. Panics, with the script's stderr, unless it exits 0; returns its
/// standard output.
pub fn run_sdk(script: &str, args: &[&str], stdin: &[u8]) -> String {
    let python = sdk_python();
    let mut child = Command::new(&python)
        .arg("-c")
        .arg(script)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    let mut input = child.stdin.take().expect("stdin");
    input.write_all(stdin).expect("write to the SDK script");
    drop(input);
    let out = child.wait_with_output().expect("wait for the SDK script");
    assert!(
        out.status.success(),
        "the SDK script failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Standard base64, as the scripts pass bodies.
pub fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The HTTP message a `script` made with the SDK (it prints
/// `{"headers": {...}, "body": "<base64>"}`): its headers and its body.
pub fn sdk_message(script: &str, args: &[&str]) -> (Vec<(String, String)>, Vec<u8>) {
    let out: Value = serde_json::from_str(&run_sdk(script, args, b""))
        .unwrap_or_else(|e| panic!("the SDK script printed no JSON: {e}"));
    let headers = out["headers"]
        .as_object()
        .expect("headers")
        .iter()
        .map(|(n, v)| (n.clone(), v.as_str().expect("a header value").to_string()))
        .collect();
    let body = base64::engine::general_purpose::STANDARD
        .decode(out["body"].as_str().expect("body"))
        .expect("base64 body");
    (headers, body)
}

/// What a `script` reading with the SDK prints (JSON) about `request`, given on its standard
/// input as `{"headers": {...}, "body": "<base64>"}`, every header once (the SDK takes a
/// mapping), as the subscriber received them.
pub fn sdk_read(script: &str, request: &Recorded) -> Value {
    let headers: BTreeMap<&str, &str> = request
        .headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    let input = json!({ "headers": headers, "body": b64(&request.body) });
    serde_json::from_str(&run_sdk(script, &[], input.to_string().as_bytes()))
        .unwrap_or_else(|e| panic!("the SDK script printed no JSON: {e}"))
}

/// A message (an SDK's, as it made it) posted to `envoy`'s `/`.
pub fn post_message(envoy: &Envoy, headers: &[(String, String)], body: &[u8]) -> Reply {
    let mut request = Client::http1().post(&envoy.url("/"));
    for (name, value) in headers {
        request = request.header(name, value);
    }
    send(request.body(body.to_vec()))
}
