//! The CloudEvents JavaScript SDK (npm `cloudevents`, pinned in `tests/fixtures/js/`, installed
//! by `make js`) as a sender and a subscriber, in the real Envoy: issue 26 §4. The SDK does not
//! percent-encode attribute values and Node writes header strings as latin1, so a binary event
//! with `greeting: grüße aus Köln` goes out as raw latin1 bytes (HTTP's obs-text). fanout
//! carries a value it does not read byte for byte: what the JS subscriber (`HTTP.toEvent`)
//! and the Python SDK (`from_http`) read of a fanned-out event is what they read of the same
//! message sent straight to the subscriber; the same for the Python SDK as the sender (it
//! percent-encodes, as the binding says). A value fanout must read (here a filter's attribute)
//! is read by the HTTP binding's rule, and refused with a 400 naming the header.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::harness;
use harness::sdk::run_sdk;
use harness::{send, Client, Envoy};
use serde_json::{json, Value};

/// `tests/fixtures/js`, with the SDK installed: a missing install is a failure saying how to
/// get it, never a skip.
fn js_dir() -> PathBuf {
    let dir = std::env::var_os("FANOUT_JS_SDK")
        .map(PathBuf::from)
        .unwrap_or_else(|| harness::manifest_dir().join("tests/fixtures/js"));
    assert!(
        dir.join("node_modules/cloudevents/package.json").exists(),
        "the CloudEvents JavaScript SDK is not installed in {}: run `make js` (npm ci)",
        dir.display()
    );
    dir
}

fn node() -> Command {
    let mut command = Command::new("node");
    command.current_dir(js_dir()).arg("sdk.js");
    command
}

/// `node sdk.js send URL MODE`: the SDK's event sent with Node's http; its answer.
fn js_send(url: &str, mode: &str) -> (u16, String) {
    let out = node()
        .args(["send", url, mode])
        .output()
        .unwrap_or_else(|e| panic!("cannot run node (apt-get install nodejs): {e}"));
    assert!(
        out.status.success(),
        "the JS sender failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let answer: Value = serde_json::from_slice(&out.stdout).unwrap();
    (
        answer["status"].as_u64().unwrap() as u16,
        answer["body"].as_str().unwrap().to_string(),
    )
}

/// The JS SDK's subscriber: `node sdk.js receive` in its own process group, killed on drop;
/// what it read, one JSON a request.
struct JsSubscriber {
    child: Child,
    port: u16,
    lines: Arc<Mutex<Vec<Value>>>,
}

impl JsSubscriber {
    fn start() -> JsSubscriber {
        let mut child = node()
            .arg("receive")
            .stdout(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run node (apt-get install nodejs): {e}"));
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut first = String::new();
        stdout.read_line(&mut first).unwrap();
        let port: Value = serde_json::from_str(&first)
            .unwrap_or_else(|e| panic!("the JS subscriber did not start ({e}): {first:?}"));
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                sink.lock()
                    .unwrap()
                    .push(serde_json::from_str(&line).unwrap());
            }
        });
        JsSubscriber {
            child,
            port: port["port"].as_u64().unwrap() as u16,
            lines,
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/", self.port)
    }

    /// Waits for the `n`th request it read (counted from 1).
    fn nth(&self, n: usize) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(line) = self.lines.lock().unwrap().get(n - 1) {
                return line.clone();
            }
            assert!(
                Instant::now() < deadline,
                "the JS subscriber got no request {n}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn count(&self) -> usize {
        self.lines.lock().unwrap().len()
    }
}

impl Drop for JsSubscriber {
    fn drop(&mut self) {
        // SAFETY: signals the process group this guard started (its own, by process_group(0)).
        unsafe {
            libc::killpg(self.child.id() as i32, libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

/// The event headers of a request the JS subscriber read (content-type and ce-*), as hex of
/// their bytes.
fn event_headers(line: &Value) -> Vec<(String, String)> {
    let mut headers: Vec<(String, String)> = line["raw"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(name, _)| name.starts_with("ce-") || *name == "content-type")
        .map(|(name, hex)| (name.clone(), hex.as_str().unwrap().to_string()))
        .collect();
    headers.sort();
    headers
}

/// Reads HTTP messages (`{"headers": {name: hex}, "body": hex}`, header bytes taken as latin1
/// as Python's http.server does) with the Python SDK's `from_http`; prints each event's
/// attributes (as text) and data.
const PY_DECODE: &str = r#"
import json, sys
from cloudevents.core.bindings import http
from cloudevents.core.formats.json import JSONFormat

out = []
for m in json.load(sys.stdin):
    headers = {n: bytes.fromhex(v).decode("latin1") for n, v in m["headers"].items()}
    message = http.HTTPMessage(headers=headers, body=bytes.fromhex(m["body"]))
    event = http.from_http(message, JSONFormat())
    a = {k: str(v) for k, v in event.get_attributes().items()}
    out.append({"attributes": a, "data": event.get_data()})
print(json.dumps(out))
"#;

fn python_reads(lines: &[&Value]) -> Vec<Value> {
    let messages: Vec<Value> = lines
        .iter()
        .map(|line| {
            let headers: serde_json::Map<String, Value> = event_headers(line)
                .into_iter()
                .map(|(n, v)| (n, json!(v)))
                .collect();
            json!({"headers": headers, "body": line["body"]})
        })
        .collect();
    let out = run_sdk(PY_DECODE, &[], &serde_json::to_vec(&messages).unwrap());
    serde_json::from_str(&out).unwrap()
}

/// `grüße aus Köln` in latin1, as Node writes it, in hex.
const LATIN1_GREETING: &str = "6772fcdf6520617573204bf66c6e";

#[test]
fn js_sdk_events_with_non_ascii_attributes_read_back_as_a_direct_send_gives() {
    let js = JsSubscriber::start();
    let envoy = Envoy::with_clusters(
        &json!({"subscribers": [{"cluster": "js"}]}),
        &[("js", js.port)],
    );
    let mut n = 0;
    for mode in ["binary", "structured"] {
        assert_eq!(
            js_send(&js.url(), mode).0,
            202,
            "{mode}: straight to the subscriber"
        );
        n += 1;
        let direct = js.nth(n);
        let (status, body) = js_send(&envoy.url("/"), mode);
        assert_eq!(status, 202, "{mode} through fanout: {body}");
        n += 1;
        let fanned = js.nth(n);
        assert!(direct.get("error").is_none(), "{mode}: {direct}");
        assert_eq!(
            fanned["event"], direct["event"],
            "{mode}: the JS SDK reads the same event"
        );
        assert_eq!(fanned["event"]["greeting"], "grüße aus Köln");
        assert_eq!(fanned["event"]["subject"], "Köln");
        assert_eq!(
            fanned["body"], direct["body"],
            "{mode}: the body byte for byte"
        );
        assert_eq!(
            event_headers(&fanned),
            event_headers(&direct),
            "{mode}: content-type and ce-* byte for byte"
        );
        if mode == "binary" {
            assert_eq!(
                fanned["raw"]["ce-greeting"], LATIN1_GREETING,
                "raw latin1, as sent"
            );
        }
        let read = python_reads(&[&direct, &fanned]);
        assert_eq!(
            read[1], read[0],
            "{mode}: the Python SDK reads the same event"
        );
        assert_eq!(read[1]["attributes"]["id"], "js-1");
    }
}

/// Makes one binary and one structured message of an event with non-ASCII attribute values
/// with the Python SDK, which percent-encodes them as the binding says; prints them as
/// `[{"headers": {...}, "body": hex}]`.
const PY_ENCODE: &str = r#"
import json
from cloudevents.core.bindings import http
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent

attributes = {"specversion": "1.0", "type": "com.example.grüße", "source": "/koeln",
              "id": "py-1", "subject": "Köln",
              "greeting": "grüße aus Köln", "datacontenttype": "application/json"}
out = []
for encode in (http.to_binary, http.to_structured):
    message = encode(CloudEvent(attributes=attributes, data={"text": "grüße"}), JSONFormat())
    out.append({"headers": message.headers, "body": message.body.hex()})
print(json.dumps(out))
"#;

#[test]
fn python_sdk_events_with_non_ascii_attributes_read_back_as_a_direct_send_gives() {
    let js = JsSubscriber::start();
    let envoy = Envoy::with_clusters(
        &json!({"subscribers": [{"cluster": "js"}]}),
        &[("js", js.port)],
    );
    let messages: Vec<Value> = serde_json::from_str(&run_sdk(PY_ENCODE, &[], b"")).unwrap();
    let post = |url: &str, message: &Value| {
        let mut request = Client::http1().http.post(url);
        for (name, value) in message["headers"].as_object().unwrap() {
            request = request.header(name.as_str(), value.as_str().unwrap());
        }
        let body = message["body"].as_str().unwrap();
        let body: Vec<u8> = (0..body.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&body[i..i + 2], 16).unwrap())
            .collect();
        send(request.body(body)).status
    };
    for (i, message) in messages.iter().enumerate() {
        assert_eq!(post(&js.url(), message), 202);
        let direct = js.nth(2 * i + 1);
        assert_eq!(post(&envoy.url("/"), message), 202);
        let fanned = js.nth(2 * i + 2);
        assert_eq!(
            fanned["event"], direct["event"],
            "{message}: the JS SDK reads the same"
        );
        assert_eq!(
            event_headers(&fanned),
            event_headers(&direct),
            "byte for byte"
        );
        let read = python_reads(&[&direct, &fanned]);
        assert_eq!(
            read[1], read[0],
            "{message}: the Python SDK reads the same event"
        );
        assert_eq!(read[1]["attributes"]["greeting"], "grüße aus Köln");
    }
}

#[test]
fn a_latin1_attribute_a_filter_reads_is_refused_with_400_naming_it() {
    let js = JsSubscriber::start();
    let config = json!({"subscribers": [
        {"cluster": "js", "filters": [{"exact": {"greeting": "grüße aus Köln"}}]}
    ]});
    let envoy = Envoy::with_clusters(&config, &[("js", js.port)]);
    let (status, body) = js_send(&envoy.url("/"), "binary");
    assert_eq!(status, 400, "{body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    let error = error["error"].as_str().unwrap();
    assert!(
        error.contains("ce-greeting") && error.contains("not UTF-8 once percent-decoded"),
        "{error}"
    );
    // The same event in structured mode is UTF-8 JSON: the filter reads it, and it matches.
    let (status, body) = js_send(&envoy.url("/"), "structured");
    assert_eq!(status, 202, "{body}");
    assert_eq!(js.nth(1)["event"]["greeting"], "grüße aus Köln");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(js.count(), 1, "the refused event reached nobody");
}
