//! A real OTLP/HTTP trace receiver for the tests: `tools/otlp-receiver.py`, which decodes
//! every export with the official protos (PyPI `opentelemetry-proto`, pinned in the Makefile,
//! in the same venv as the CloudEvents SDK) and writes each span as a JSON line. Started in
//! its own process group on loopback, stopped (SIGKILL) when the guard drops.
//!
//! [`OtlpReceiver::spans`] reads what arrived, [`OtlpReceiver::wait_for_trace`] waits for one
//! trace's spans to arrive; [`SpanTree`] answers the questions a test asks of one trace: the
//! root, a span's children, a span by name or id, whether children lie within their parents.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Map, Value};

use super::sdk::sdk_python;
use super::timing::poll_until;
use super::{manifest_dir, TempDir};

/// The receiver, running.
pub struct OtlpReceiver {
    child: Child,
    port: u16,
    dir: TempDir,
}

/// One span as the receiver decoded it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedSpan {
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    pub trace_state: String,
    pub name: String,
    /// `SPAN_KIND_SERVER`, `SPAN_KIND_CLIENT`, ...
    pub kind: String,
    pub start_ns: u64,
    pub end_ns: u64,
    pub attributes: Map<String, Value>,
    /// `STATUS_CODE_UNSET`, `STATUS_CODE_ERROR`, ...
    pub status: String,
    pub status_message: String,
    pub resource: Map<String, Value>,
}

impl ReceivedSpan {
    pub fn attr(&self, key: &str) -> Option<&Value> {
        self.attributes.get(key)
    }

    fn from_line(line: &Value) -> ReceivedSpan {
        let text = |key: &str| line[key].as_str().unwrap_or_default().to_string();
        let object = |v: &Value| v.as_object().cloned().unwrap_or_default();
        ReceivedSpan {
            trace_id: text("trace_id"),
            span_id: text("span_id"),
            parent_span_id: text("parent_span_id"),
            trace_state: text("trace_state"),
            name: text("name"),
            kind: text("span_kind"),
            start_ns: line["start_ns"].as_u64().unwrap_or_default(),
            end_ns: line["end_ns"].as_u64().unwrap_or_default(),
            attributes: object(&line["attributes"]),
            status: line["status"]["code"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            status_message: line["status"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            resource: object(&line["resource"]),
        }
    }
}

impl OtlpReceiver {
    /// Starts it on a free loopback port; returns once it accepts connections.
    pub fn start() -> OtlpReceiver {
        let dir = TempDir::new("fanout-otlp", "the spans the OTLP receiver got");
        std::fs::create_dir_all(dir.path()).expect("the receiver's directory");
        let script = manifest_dir().join("tools/otlp-receiver.py");
        let mut child = Command::new(sdk_python())
            .arg(&script)
            .args(["--port", "0", "--out"])
            .arg(dir.path().join("spans.jsonl"))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", script.display()));
        let mut first = String::new();
        let stdout = child.stdout.take().expect("the receiver's stdout");
        BufReader::new(stdout)
            .read_line(&mut first)
            .expect("the receiver's first line");
        let port = first
            .trim()
            .strip_prefix("listening on ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| {
                panic!(
                    "the OTLP receiver did not start (is opentelemetry-proto installed? `make otlp`): {first:?}"
                )
            });
        OtlpReceiver { child, port, dir }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The JSON lines written so far.
    fn lines(&self) -> Vec<Value> {
        let text = std::fs::read_to_string(self.dir.path().join("spans.jsonl")).unwrap_or_default();
        text.lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line from the receiver"))
            .collect()
    }

    /// Every export received: path, content type, authority, its number of spans.
    pub fn exports(&self) -> Vec<Value> {
        self.lines()
            .into_iter()
            .filter(|l| l["kind"] == "export")
            .collect()
    }

    /// Every span received, in the order they arrived.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        let lines = self.lines();
        lines
            .iter()
            .filter(|l| l["kind"] == "span")
            .map(ReceivedSpan::from_line)
            .collect()
    }

    /// Waits (bounded) until at least `n` spans arrived; returns them all.
    pub fn wait_for_spans(&self, n: usize, timeout: Duration) -> Vec<ReceivedSpan> {
        poll_until(timeout, Duration::from_millis(20), || {
            Some(self.spans()).filter(|s| s.len() >= n)
        })
        .unwrap_or_else(|| panic!("{} spans after {timeout:?}, wanted {n}", self.spans().len()))
    }

    /// Waits (bounded) until `n` spans of `trace_id` arrived; returns that trace. Batches
    /// leave a worker about a second after their spans end, on Envoy's coarse timer: give it
    /// seconds, not milliseconds.
    pub fn wait_for_trace(&self, trace_id: &str, n: usize, timeout: Duration) -> SpanTree {
        poll_until(timeout, Duration::from_millis(20), || {
            Some(SpanTree::of(&self.spans(), trace_id)).filter(|t| t.spans.len() >= n)
        })
        .unwrap_or_else(|| {
            panic!(
                "{n} spans of trace {trace_id} not received within {timeout:?}; received: {:#?}",
                self.spans()
            )
        })
    }

    /// The file the spans are written to (JSON lines), e.g. for `tools/trace-waterfall.py`.
    pub fn spans_file(&self) -> std::path::PathBuf {
        self.dir.path().join("spans.jsonl")
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        // SAFETY: signalling the process group this guard started.
        unsafe {
            libc::kill(-(self.child.id() as libc::pid_t), libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

/// The spans of one trace.
#[derive(Debug, Clone)]
pub struct SpanTree {
    pub spans: Vec<ReceivedSpan>,
}

impl SpanTree {
    /// The spans of `trace_id` among `spans`.
    pub fn of(spans: &[ReceivedSpan], trace_id: &str) -> SpanTree {
        SpanTree {
            spans: spans
                .iter()
                .filter(|s| s.trace_id == trace_id)
                .cloned()
                .collect(),
        }
    }

    /// The span whose parent is not in this trace (the sender's span, or none): exactly one.
    pub fn root(&self) -> &ReceivedSpan {
        let roots: Vec<_> = self
            .spans
            .iter()
            .filter(|s| !self.spans.iter().any(|p| p.span_id == s.parent_span_id))
            .collect();
        assert_eq!(roots.len(), 1, "one root span: {roots:#?}");
        roots[0]
    }

    /// `span`'s children, by start time.
    pub fn children(&self, span: &ReceivedSpan) -> Vec<&ReceivedSpan> {
        let mut children: Vec<_> = self
            .spans
            .iter()
            .filter(|s| s.parent_span_id == span.span_id)
            .collect();
        children.sort_by_key(|s| s.start_ns);
        children
    }

    /// The names of `span`'s children, by start time.
    pub fn names_under(&self, span: &ReceivedSpan) -> Vec<&str> {
        self.children(span)
            .into_iter()
            .map(|s| s.name.as_str())
            .collect()
    }

    /// The span with this id, if it is in the trace.
    pub fn by_id(&self, span_id: &str) -> Option<&ReceivedSpan> {
        self.spans.iter().find(|s| s.span_id == span_id)
    }

    /// Every span ends at or after its start, and lies within its parent's time when the
    /// parent is in the trace.
    pub fn assert_nested(&self) {
        for span in &self.spans {
            assert!(
                span.start_ns > 0 && span.end_ns >= span.start_ns,
                "{span:#?}"
            );
            if let Some(parent) = self.by_id(&span.parent_span_id) {
                assert!(
                    parent.start_ns <= span.start_ns && span.end_ns <= parent.end_ns,
                    "{:?} ({}..{}) is not within its parent {:?} ({}..{})",
                    span.name,
                    span.start_ns,
                    span.end_ns,
                    parent.name,
                    parent.start_ns,
                    parent.end_ns
                );
            }
        }
    }

    /// The one span named `name`.
    pub fn named(&self, name: &str) -> &ReceivedSpan {
        let found: Vec<_> = self.spans.iter().filter(|s| s.name == name).collect();
        assert_eq!(
            found.len(),
            1,
            "one span named {name:?} in {:#?}",
            self.spans
        );
        found[0]
    }
}
