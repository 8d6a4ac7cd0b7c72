//! The core driven the way Envoy drives it: a [`Plugin`] and its [`Stream`]s on the fake
//! host, which records every call and answer (see [`crate::testing`]). One file per
//! behaviour; this one holds what they share: the fake Envoy, its requests and answers.
//! They run natively and inside wasm32 (`make test-wasm`).

mod admission;
mod best_effort;
mod configure;
mod dedupe;
mod delivery;
mod etcd_fixtures;
mod etcd_store;
mod filters;
mod flow_control;
mod format;
mod header_bytes;
mod metrics;
mod replies;
mod retries;
mod shutdown;
mod tracing;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use serde_json::Value;

use crate::answer::Answer;
use crate::dedupe::Shard;
use crate::plugin::{Plugin, VmShared};
use crate::stream::{Flow, Stream};
use crate::testing::{Dispatched, FakeHost, FakeState, SharedData};

/// The token of the latest call to a cluster, failing the test when there is none.
trait TokenOf {
    fn token_of(&self, cluster: &str) -> u32;
}

impl TokenOf for FakeState {
    fn token_of(&self, cluster: &str) -> u32 {
        self.last_token_to(cluster).unwrap_or_else(|| {
            panic!(
                "no call went to {cluster}; calls made: {:?}",
                self.dispatched
                    .iter()
                    .map(|call| (call.token, &call.cluster))
                    .collect::<Vec<_>>()
            )
        })
    }
}

impl TokenOf for FakeHost {
    fn token_of(&self, cluster: &str) -> u32 {
        self.0.borrow().token_of(cluster)
    }
}

/// What the tests read of the fake host's metrics: a metric never defined fails the test.
trait MetricReadings {
    fn value(&self, name: &str) -> i64;
    fn samples(&self, name: &str) -> Vec<u64>;
}

impl MetricReadings for FakeState {
    fn value(&self, name: &str) -> i64 {
        self.metric(name)
            .unwrap_or_else(|| panic!("metric {name} not defined"))
            .2
    }

    fn samples(&self, name: &str) -> Vec<u64> {
        self.metric(name)
            .unwrap_or_else(|| panic!("metric {name} not defined"))
            .3
            .clone()
    }
}

/// Events recorded in all of dedupe's shards in the fake shared data.
trait StoredEvents {
    fn events(&self) -> usize;
}

impl StoredEvents for SharedData {
    fn events(&self) -> usize {
        self.values
            .values()
            .map(|(v, _)| Shard::decode(v).unwrap().entries.len())
            .sum()
    }
}

const ROOT: u32 = 1;

const STREAM: u32 = 2;

/// A call token no call was given.
const NEVER_SENT: u32 = 99;

/// A configured plugin in a fake Envoy, and a way to open streams on it.
struct FakeEnvoy {
    host: FakeHost,
    root: Plugin<FakeHost>,
}

const THREE: &str = r#"{
  "forward_headers": ["content-type", "x-request-id", "ce-*"],
  "max_body_bytes": 64,
  "channels": [
    {"name": "orders", "hosts": ["orders.default"], "subscribers": [
      {"cluster": "billing", "path": "/events", "authority": "billing.local", "timeout_ms": 2000,
       "headers": {"x-tenant": "acme"}},
      {"cluster": "shipping"},
      {"cluster": "analytics", "path": "/in"}
    ]},
    {"name": "empty", "hosts": ["empty.default"], "subscribers": []}
  ]
}"#;

impl FakeEnvoy {
    fn configured(json: &str) -> FakeEnvoy {
        let (plugin, ok) = FakeEnvoy::configure(json);
        assert!(ok, "configuration refused: {json}");
        plugin
    }

    fn configure(json: &str) -> (FakeEnvoy, bool) {
        FakeEnvoy::configure_sharing(json, Rc::default())
    }

    /// A plugin on another "worker" of the same Envoy: its own VM, the same shared data.
    fn another_worker(&self, json: &str) -> FakeEnvoy {
        let shared = self.state().shared.clone();
        let (plugin, ok) = FakeEnvoy::configure_sharing(json, shared);
        assert!(ok);
        plugin
    }

    fn configure_sharing(json: &str, shared: Rc<RefCell<SharedData>>) -> (FakeEnvoy, bool) {
        let host = FakeHost::default();
        host.0.borrow_mut().config = Some(json.as_bytes().to_vec());
        host.0.borrow_mut().shared = shared;
        let mut root = Plugin::new(ROOT, host.clone());
        assert!(root.on_vm_start());
        let ok = root.on_configure();
        (FakeEnvoy { host, root }, ok)
    }

    fn stream(&self, headers: &[(&str, &str)], body: &[u8]) -> Stream<FakeHost> {
        let mut state = self.host.0.borrow_mut();
        state.request_headers = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
        state.request_body = body.to_vec();
        state.effective = STREAM;
        drop(state);
        self.root.create_stream(STREAM)
    }

    fn state(&self) -> std::cell::Ref<'_, FakeState> {
        self.host.0.borrow()
    }

    /// Delivers `status` (`None`: no headers, as for a reset) and `body` as the answer to the
    /// latest call to `cluster`, to the stream that made it.
    fn answer(&self, ctx: &mut Stream<FakeHost>, cluster: &str, status: Option<u16>, body: &str) {
        self.answer_call(ctx, self.host.token_of(cluster), status, body);
    }

    /// Delivers the answer to call `token`, as Envoy would.
    fn answer_call(&self, ctx: &mut Stream<FakeHost>, token: u32, status: Option<u16>, body: &str) {
        let mut state = self.host.0.borrow_mut();
        state.call_response = (status, body.as_bytes().to_vec());
        state.call_response_headers = Vec::new();
        state.effective = STREAM;
        drop(state);
        let num_headers = usize::from(status.is_some());
        ctx.on_call_response(token, num_headers, body.len());
    }

    fn answers(&self) -> Vec<Answer> {
        self.state().answers.clone()
    }

    fn only_answer(&self) -> Answer {
        let answers = self.answers();
        assert_eq!(answers.len(), 1, "expected exactly one answer: {answers:?}");
        answers[0].clone()
    }
}

fn post(host: &str) -> Vec<(&str, &str)> {
    vec![(":method", "POST"), (":authority", host), (":path", "/")]
}

/// Headers, then the body in one piece.
fn send(plugin: &FakeEnvoy, headers: &[(&str, &str)], body: &[u8]) -> Stream<FakeHost> {
    let mut ctx = plugin.stream(headers, body);
    if body.is_empty() {
        assert_eq!(ctx.on_request_headers(true), Flow::Pause);
    } else {
        assert_eq!(ctx.on_request_headers(false), Flow::Pause);
        assert_eq!(ctx.on_request_body(body.len(), true), Flow::Pause);
    }
    ctx
}

fn report(answer: &Answer) -> Value {
    serde_json::from_slice(&answer.body).unwrap()
}

impl FakeEnvoy {
    /// A request with a body that is answered `status` (its error containing `error`) from
    /// its headers: the body is never read, nobody is called.
    fn rejected_from_the_headers(&self, headers: &[(&str, &str)], status: u32, error: &str) {
        let mut ctx = self.stream(headers, b"{}");
        assert_eq!(ctx.on_request_headers(false), Flow::Pause);
        let answer = self.only_answer();
        assert_eq!(answer.status, status);
        let text = report(&answer)["error"].as_str().unwrap().to_string();
        assert!(text.contains(error), "{text}");
        assert_eq!(ctx.on_request_body(2, true), Flow::Pause);
        assert_eq!(self.answers().len(), 1);
        assert!(self.state().dispatched.is_empty());
        assert_eq!(self.state().body_reads, 0);
    }
}

const REQUIRE_CLOUDEVENTS: &str = r#"{
  "require_cloudevents": true,
  "subscribers": [{"cluster": "a"}, {"cluster": "b"}]
}"#;

impl FakeEnvoy {
    /// The root's timer fires at `now_ms`.
    fn tick_at(&mut self, now_ms: u64) {
        let mut state = self.host.0.borrow_mut();
        state.now_ms = now_ms;
        state.effective = ROOT;
        drop(state);
        self.root.on_tick();
    }

    /// Delivers the answer to a call the root made.
    fn answer_root_call(
        &mut self,
        token: u32,
        status: Option<u16>,
        body: &str,
        headers: &[(&str, &str)],
    ) {
        let mut state = self.host.0.borrow_mut();
        state.call_response = (status, body.as_bytes().to_vec());
        state.call_response_headers = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
        state.effective = ROOT;
        drop(state);
        let num_headers = usize::from(status.is_some()) + headers.len();
        self.root.on_call_response(token, num_headers, body.len());
    }

    fn last_call(&self) -> Dispatched {
        self.state().dispatched.last().cloned().unwrap()
    }
}

const RETRY_TWICE: &str = r#"{"delivery": {"retry": 2, "backoff_policy": "linear",
    "backoff_delay_ms": 100}, "subscribers": [{"cluster": "a"}, {"cluster": "b"}]}"#;

const WITH_DEAD_LETTER: &str = r#"{"delivery": {"dead_letter": {"cluster": "dlq",
    "authority": "dlq.local", "path": "/dead"}}, "subscribers": [{"cluster": "a"}]}"#;

impl FakeEnvoy {
    /// [`FakeEnvoy::answer`] with headers.
    fn answer_with(
        &self,
        ctx: &mut Stream<FakeHost>,
        cluster: &str,
        status: u16,
        headers: &[(&str, &str)],
        body: &[u8],
    ) {
        self.answer_call_with(ctx, self.host.token_of(cluster), status, headers, body);
    }

    /// Delivers the answer to call `token` from the stream, with headers.
    fn answer_call_with(
        &self,
        ctx: &mut Stream<FakeHost>,
        token: u32,
        status: u16,
        headers: &[(&str, &str)],
        body: &[u8],
    ) {
        let mut state = self.host.0.borrow_mut();
        state.call_response = (Some(status), body.to_vec());
        state.call_response_headers = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
        state.effective = STREAM;
        drop(state);
        ctx.on_call_response(token, 1 + headers.len(), body.len());
    }

    /// A metric's value after the next flush (a second later).
    fn flushed(&mut self, name: &str) -> i64 {
        let later = self.state().now_ms + 1000;
        self.tick_at(later);
        self.state().value(name)
    }
}

fn header_of(call: &Dispatched, name: &str) -> Option<String> {
    call.header(name)
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

const REPLYING: &str = r#"{
  "forward_headers": ["content-type", "ce-*"],
  "max_body_bytes": 64,
  "delivery": {"dead_letter": {"cluster": "dlq", "authority": "dlq.local"}},
  "subscribers": [
    {"cluster": "answering", "authority": "answering.local", "path": "/in",
     "reply": {"cluster": "replies", "authority": "replies.local", "path": "/replies"}},
    {"cluster": "plain"}
  ]
}"#;

const ASYNC: &str = r#"{"mode": "async", "max_in_flight": 2,
    "subscribers": [{"cluster": "a"}, {"cluster": "b"}]}"#;

const FILTERED: &str = r#"{
  "forward_headers": ["content-type"],
  "channels": [
    {"name": "orders", "hosts": ["orders.default"], "subscribers": [
      {"cluster": "created", "filters": [{"exact": {"type": "order.created"}}]},
      {"cluster": "shipped", "filter": {"attributes": {"type": "order.shipped"}}},
      {"cluster": "everything"}
    ]},
    {"name": "picky", "hosts": ["picky.default"], "subscribers": [
      {"cluster": "created", "filters": [{"exact": {"type": "order.created"}}]},
      {"cluster": "eu", "filters": [{"prefix": {"source": "/eu/"}}]}
    ]},
    {"name": "plain", "hosts": ["plain.default"], "subscribers": [
      {"cluster": "a"}, {"cluster": "b"}
    ]}
  ]
}"#;

fn clusters(plugin: &FakeEnvoy) -> Vec<String> {
    plugin
        .state()
        .dispatched
        .iter()
        .map(|c| c.cluster.clone())
        .collect()
}

fn with(
    host: &'static str,
    extra: &[(&'static str, &'static str)],
) -> Vec<(&'static str, &'static str)> {
    let mut headers = post(host);
    headers.extend_from_slice(extra);
    headers
}

const STRUCTURED: (&str, &str) = ("content-type", "application/cloudevents+json");

const DEDUPE: &str = r#"{
  "dedupe": {"key": "ce-id", "ttl_ms": 1000, "max_entries": 100},
  "channels": [
    {"name": "orders", "hosts": ["orders.default"], "subscribers": [
      {"cluster": "billing"}, {"cluster": "shipping"}, {"cluster": "analytics"}
    ]}
  ]
}"#;

fn event(id: &str) -> Vec<(&str, &str)> {
    let mut h = post("orders.default");
    h.push(("ce-id", id));
    h
}

impl FakeEnvoy {
    fn dispatched_since(&self, before: usize) -> Vec<(u32, String)> {
        self.state().dispatched[before..]
            .iter()
            .map(|d| (d.token, d.cluster.clone()))
            .collect()
    }

    fn last_answer(&self) -> Answer {
        self.answers().last().cloned().expect("an answer")
    }

    fn header(answer: &Answer, name: &str) -> Option<String> {
        answer
            .headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.clone())
    }
}

// Without `key`, an event is its CloudEvents (source, id), in binary and structured mode.
fn dedupe_by_identity() -> String {
    DEDUPE.replacen(r#""key": "ce-id", "#, "", 1)
}

fn from(source: &'static str, id: &'static str) -> Vec<(&'static str, &'static str)> {
    let mut h = post("orders.default");
    h.extend([("ce-source", source), ("ce-id", id)]);
    h
}

/// Sends an event and answers every call it makes 200; returns how many calls it made.
fn deliver(plugin: &FakeEnvoy, headers: &[(&str, &str)], body: &[u8]) -> usize {
    let before = plugin.state().dispatched.len();
    let mut ctx = send(plugin, headers, body);
    let calls = plugin.dispatched_since(before);
    for (token, _) in &calls {
        plugin.answer_call(&mut ctx, *token, Some(200), "");
    }
    assert_eq!(plugin.last_answer().status, 202);
    calls.len()
}

// dedupe with what came to main since: filters, retries from the root, dead letters, async.

fn shard_marks(plugin: &FakeEnvoy) -> usize {
    let state = plugin.state();
    let shared = state.shared.borrow();
    shared
        .values
        .values()
        .flat_map(|(v, _)| Shard::decode(v).unwrap().entries)
        .map(|e| e.marks.len())
        .sum()
}
