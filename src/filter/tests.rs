//! The proxy-wasm glue driven natively: the real root and http contexts, with a fake host in
//! place of Envoy that records every call and answer.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::Action;
use serde_json::Value;

use super::{FanoutRoot, Host};
use crate::answer::Answer;
use crate::dedupe::{CasMismatch, Shard};
use crate::metrics::Kind;

/// The host functions the SDK imports from Envoy. The glue reaches the host only through
/// [`Host`], so none of these may ever run in a test; they exist so that the test binary
/// links (the SDK's default trait methods refer to them).
macro_rules! unreachable_host_functions {
    ($($name:ident)*) => {$(
        #[no_mangle]
        extern "C" fn $name() -> u32 {
            eprintln!("the glue called {} directly instead of through Host", stringify!($name));
            std::process::abort()
        }
    )*};
}

unreachable_host_functions! {
    proxy_add_header_map_value
    proxy_call_foreign_function
    proxy_close_stream
    proxy_continue_stream
    proxy_define_metric
    proxy_dequeue_shared_queue
    proxy_done
    proxy_enqueue_shared_queue
    proxy_get_buffer_bytes
    proxy_get_current_time_nanoseconds
    proxy_get_header_map_pairs
    proxy_get_header_map_value
    proxy_get_log_level
    proxy_get_metric
    proxy_get_property
    proxy_get_shared_data
    proxy_get_status
    proxy_grpc_call
    proxy_grpc_cancel
    proxy_grpc_close
    proxy_grpc_send
    proxy_grpc_stream
    proxy_http_call
    proxy_increment_metric
    proxy_log
    proxy_record_metric
    proxy_register_shared_queue
    proxy_remove_header_map_value
    proxy_replace_header_map_value
    proxy_resolve_shared_queue
    proxy_send_local_response
    proxy_set_buffer_bytes
    proxy_set_effective_context
    proxy_set_header_map_pairs
    proxy_set_property
    proxy_set_shared_data
    proxy_set_tick_period_milliseconds
}

#[derive(Debug, Clone, PartialEq)]
struct Dispatched {
    token: u32,
    /// The context the call was made for (Envoy cancels a stream's calls when it ends).
    context: u32,
    cluster: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    timeout: Duration,
}

#[derive(Default)]
struct State {
    config: Option<Vec<u8>>,
    request_headers: Vec<(String, Vec<u8>)>,
    request_body: Vec<u8>,
    body_reads: usize,
    unknown_clusters: HashSet<String>,
    next_token: u32,
    dispatched: Vec<Dispatched>,
    /// The answer to the call being delivered: `:status` and body.
    call_response: (Option<u16>, Vec<u8>),
    call_response_headers: Vec<(String, Vec<u8>)>,
    /// The context Envoy applies host calls to (the one whose callback runs, or the one set
    /// with set_effective_context).
    effective: u32,
    /// Streams whose client went away: set_effective_context fails for them.
    gone: HashSet<u32>,
    /// Answers by the stream they went to.
    answered_streams: Vec<u32>,
    call_body_reads: usize,
    answers: Vec<Answer>,
    now_ms: u64,
    /// Metrics by name: kind, and the counter/gauge value or histogram samples.
    metrics: Vec<(String, Kind, i64, Vec<u64>)>,
    tick_period: Option<Duration>,
    /// Envoy's shared data: one per process, so two fake "workers" may share it.
    shared: Rc<RefCell<SharedData>>,
}

/// Envoy's shared data as its C++ implementation behaves: one CAS counter for all keys,
/// never 0; CAS checked only for a key that exists.
#[derive(Default)]
struct SharedData {
    values: HashMap<String, (Vec<u8>, u32)>,
    last_cas: u32,
    gets: usize,
    sets: usize,
}

impl SharedData {
    /// Events recorded in all shards.
    fn events(&self) -> usize {
        self.values
            .values()
            .map(|(v, _)| Shard::decode(v).unwrap().entries.len())
            .sum()
    }
}

impl State {
    fn metric(&self, name: &str) -> Option<&(String, Kind, i64, Vec<u64>)> {
        self.metrics.iter().find(|m| m.0 == name)
    }

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

#[derive(Clone, Default)]
struct FakeHost(Rc<RefCell<State>>);

impl Host for FakeHost {
    fn follow_log_level(&self) {}

    fn plugin_configuration(&self) -> Option<Vec<u8>> {
        self.0.borrow().config.clone()
    }

    fn request_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.0.borrow().request_headers.clone()
    }

    fn request_body(&self, size: usize) -> Vec<u8> {
        let mut state = self.0.borrow_mut();
        state.body_reads += 1;
        let end = size.min(state.request_body.len());
        state.request_body[..end].to_vec()
    }

    fn dispatch(
        &self,
        cluster: &str,
        headers: Vec<(&str, &str)>,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, String> {
        let mut state = self.0.borrow_mut();
        if state.unknown_clusters.contains(cluster) {
            return Err(format!("unknown cluster {cluster}"));
        }
        state.next_token += 1;
        let token = state.next_token;
        let context = state.effective;
        state.dispatched.push(Dispatched {
            token,
            context,
            cluster: cluster.to_string(),
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            body: body.to_vec(),
            timeout,
        });
        Ok(token)
    }

    fn call_status(&self) -> Option<u16> {
        self.0.borrow().call_response.0
    }

    fn call_body(&self, max: usize) -> Vec<u8> {
        let mut state = self.0.borrow_mut();
        state.call_body_reads += 1;
        let body = &state.call_response.1;
        body[..max.min(body.len())].to_vec()
    }

    fn call_header(&self, name: &str) -> Option<String> {
        let state = self.0.borrow();
        state
            .call_response_headers
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| String::from_utf8(v.clone()).ok())
    }

    fn call_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.0.borrow().call_response_headers.clone()
    }

    fn set_effective_context(&self, context_id: u32) -> bool {
        let mut state = self.0.borrow_mut();
        if state.gone.contains(&context_id) {
            return false;
        }
        state.effective = context_id;
        true
    }

    fn respond(&self, answer: &Answer) {
        let mut state = self.0.borrow_mut();
        let stream = state.effective;
        state.answers.push(answer.clone());
        state.answered_streams.push(stream);
    }

    fn now_ms(&self) -> u64 {
        self.0.borrow().now_ms
    }

    fn define_metric(&self, kind: Kind, name: &str) -> Option<u32> {
        let mut state = self.0.borrow_mut();
        // Envoy keeps one stat per name: defining it again finds the same one.
        if let Some(i) = state.metrics.iter().position(|m| m.0 == name) {
            return Some(i as u32);
        }
        state.metrics.push((name.to_string(), kind, 0, Vec::new()));
        Some(state.metrics.len() as u32 - 1)
    }

    fn increment_metric(&self, id: u32, delta: i64) {
        let mut state = self.0.borrow_mut();
        let metric = &mut state.metrics[id as usize];
        assert_ne!(metric.1, Kind::Histogram, "increment of a histogram");
        metric.2 += delta;
    }

    fn record_metric(&self, id: u32, value: u64) {
        let mut state = self.0.borrow_mut();
        let metric = &mut state.metrics[id as usize];
        assert_eq!(metric.1, Kind::Histogram, "record of a non-histogram");
        metric.3.push(value);
    }

    fn set_tick_period(&self, period: Duration) {
        self.0.borrow_mut().tick_period = Some(period);
    }

    fn get_shared_data(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        let state = self.0.borrow();
        let mut shared = state.shared.borrow_mut();
        shared.gets += 1;
        match shared.values.get(key) {
            Some((value, cas)) => (Some(value.clone()), Some(*cas)),
            None => (None, None),
        }
    }

    fn set_shared_data(
        &self,
        key: &str,
        value: &[u8],
        cas: Option<u32>,
    ) -> Result<(), CasMismatch> {
        let state = self.0.borrow();
        let mut shared = state.shared.borrow_mut();
        shared.sets += 1;
        if let (Some((_, current)), Some(cas)) = (shared.values.get(key), cas) {
            if *current != cas {
                return Err(CasMismatch);
            }
        }
        shared.last_cas = shared.last_cas.wrapping_add(1).max(1);
        let next = shared.last_cas;
        shared
            .values
            .insert(key.to_string(), (value.to_vec(), next));
        Ok(())
    }
}

const ROOT: u32 = 1;
const STREAM: u32 = 2;

/// A configured plugin and a way to open streams on it.
struct Plugin {
    host: FakeHost,
    root: FanoutRoot<FakeHost>,
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

impl Plugin {
    fn configured(json: &str) -> Plugin {
        let (plugin, ok) = Plugin::configure(json);
        assert!(ok, "configuration refused: {json}");
        plugin
    }

    fn configure(json: &str) -> (Plugin, bool) {
        Plugin::configure_sharing(json, Rc::default())
    }

    /// A plugin on another "worker" of the same Envoy: its own VM, the same shared data.
    fn another_worker(&self, json: &str) -> Plugin {
        let shared = self.state().shared.clone();
        let (plugin, ok) = Plugin::configure_sharing(json, shared);
        assert!(ok);
        plugin
    }

    fn configure_sharing(json: &str, shared: Rc<RefCell<SharedData>>) -> (Plugin, bool) {
        let host = FakeHost::default();
        host.0.borrow_mut().config = Some(json.as_bytes().to_vec());
        host.0.borrow_mut().shared = shared;
        let mut root = FanoutRoot::new(ROOT, host.clone());
        assert!(root.on_vm_start(0));
        let ok = root.on_configure(json.len());
        (Plugin { host, root }, ok)
    }

    fn stream(&self, headers: &[(&str, &str)], body: &[u8]) -> Box<dyn HttpContext> {
        let mut state = self.host.0.borrow_mut();
        state.request_headers = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
        state.request_body = body.to_vec();
        state.effective = STREAM;
        drop(state);
        self.root.create_http_context(STREAM).unwrap()
    }

    fn state(&self) -> std::cell::Ref<'_, State> {
        self.host.0.borrow()
    }

    /// Delivers the answer to call `token`, as Envoy would.
    fn answer_call(&self, ctx: &mut dyn HttpContext, token: u32, status: Option<u16>, body: &str) {
        let mut state = self.host.0.borrow_mut();
        state.call_response = (status, body.as_bytes().to_vec());
        state.call_response_headers = Vec::new();
        state.effective = STREAM;
        drop(state);
        let num_headers = usize::from(status.is_some());
        ctx.on_http_call_response(token, num_headers, body.len(), 0);
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
fn send(plugin: &Plugin, headers: &[(&str, &str)], body: &[u8]) -> Box<dyn HttpContext> {
    let mut ctx = plugin.stream(headers, body);
    if body.is_empty() {
        assert_eq!(
            ctx.on_http_request_headers(headers.len(), true),
            Action::Pause
        );
    } else {
        assert_eq!(
            ctx.on_http_request_headers(headers.len(), false),
            Action::Pause
        );
        assert_eq!(ctx.on_http_request_body(body.len(), true), Action::Pause);
    }
    ctx
}

fn report(answer: &Answer) -> Value {
    serde_json::from_slice(&answer.body).unwrap()
}

// Rule 3: one call per subscriber, POST, its path and authority, the body, the selected
// headers, its own headers.
#[test]
fn every_subscriber_gets_one_call_with_body_and_headers() {
    let plugin = Plugin::configured(THREE);
    let mut headers = post("orders.default:8080");
    headers.extend([
        ("content-type", "application/json"),
        ("ce-id", "42"),
        ("authorization", "Bearer secret"),
        ("cookie", "a=b"),
        ("x-unlisted", "1"),
        ("content-length", "11"),
        ("x-request-id", "r-1"),
    ]);
    let _ctx = send(&plugin, &headers, b"{\"id\": 42}\n");
    let state = plugin.state();
    assert!(state.answers.is_empty(), "answered before the calls ended");
    let calls = &state.dispatched;
    assert_eq!(
        calls.iter().map(|c| c.cluster.as_str()).collect::<Vec<_>>(),
        ["billing", "shipping", "analytics"]
    );
    let forwarded = [
        ("content-type", "application/json"),
        ("ce-id", "42"),
        ("x-request-id", "r-1"),
    ];
    let expect = |path: &str, authority: &str, extra: &[(&str, &str)]| {
        let mut h: Vec<(String, String)> = vec![
            (":method".into(), "POST".into()),
            (":path".into(), path.into()),
            (":authority".into(), authority.into()),
        ];
        h.extend(
            extra
                .iter()
                .chain(&forwarded)
                .map(|(n, v)| (n.to_string(), v.to_string())),
        );
        h
    };
    assert_eq!(
        calls[0].headers,
        expect("/events", "billing.local", &[("x-tenant", "acme")])
    );
    assert_eq!(calls[1].headers, expect("/", "shipping", &[]));
    assert_eq!(calls[2].headers, expect("/in", "analytics", &[]));
    for call in calls {
        assert_eq!(call.body, b"{\"id\": 42}\n");
    }
    assert_eq!(calls[0].timeout, Duration::from_millis(2000));
    assert_eq!(calls[1].timeout, Duration::from_millis(60_000));
}

// Rules 4 and 5: the answer waits for every call; all 2xx gives 202.
#[test]
fn all_subscribers_2xx_answers_202_after_the_last() {
    let plugin = Plugin::configured(THREE);
    let mut ctx = send(&plugin, &post("orders.default"), b"{}");
    plugin.answer_call(ctx.as_mut(), 2, Some(200), "");
    plugin.answer_call(ctx.as_mut(), 1, Some(204), "");
    assert!(plugin.answers().is_empty());
    plugin.answer_call(ctx.as_mut(), 3, Some(202), "ignored body");
    assert_eq!(plugin.only_answer(), Answer::accepted());
    // Successes cost no read of the answer's body.
    assert_eq!(plugin.state().call_body_reads, 0);
}

// Rule 5: any failure gives 500 with a report; the others are still called.
#[test]
fn one_failure_answers_500_naming_it() {
    let plugin = Plugin::configured(THREE);
    let mut ctx = send(&plugin, &post("orders.default"), b"{}");
    plugin.host.0.borrow_mut().now_ms = 0;
    plugin.answer_call(ctx.as_mut(), 1, Some(200), "");
    plugin.host.0.borrow_mut().now_ms = 35;
    plugin.answer_call(ctx.as_mut(), 2, Some(500), "database down\r\n");
    plugin.answer_call(ctx.as_mut(), 3, Some(200), "");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 500);
    assert!(answer
        .headers
        .contains(&("x-fanout-failed", "1".to_string())));
    let doc = report(&answer);
    assert_eq!(doc["channel"], "orders");
    assert_eq!(doc["delivered"], 2);
    let failed = &doc["failed"][0];
    assert_eq!(failed["cluster"], "shipping");
    assert_eq!(failed["outcome"], "status");
    assert_eq!(failed["status"], 500);
    assert_eq!(failed["detail"], "database down");
    assert_eq!(failed["elapsed_ms"], 35);
}

#[test]
fn outcome_kinds_in_the_report() {
    let cases: &[(Option<u16>, &str, &str)] = &[
        (Some(504), "upstream request timeout", "timeout"),
        (
            Some(503),
            "upstream connect error or disconnect/reset before headers. reset reason: connection termination",
            "reset",
        ),
        (None, "", "no_response"),
        (Some(404), "", "status"),
        (Some(302), "", "status"),
    ];
    for (status, body, outcome) in cases {
        let plugin = Plugin::configured(r#"{"subscribers": [{"cluster": "a"}]}"#);
        let mut ctx = send(&plugin, &post("x"), b"e");
        plugin.answer_call(ctx.as_mut(), 1, *status, body);
        let answer = plugin.only_answer();
        assert_eq!(answer.status, 500, "{status:?} {body}");
        assert_eq!(
            report(&answer)["failed"][0]["outcome"],
            *outcome,
            "{status:?} {body}"
        );
    }
}

// Rule 5: a call Envoy refuses counts at once; if all are refused the answer is immediate.
#[test]
fn unknown_cluster_fails_at_dispatch_and_others_are_still_called() {
    let plugin = Plugin::configured(THREE);
    plugin
        .host
        .0
        .borrow_mut()
        .unknown_clusters
        .insert("shipping".into());
    let mut ctx = send(&plugin, &post("orders.default"), b"{}");
    assert_eq!(plugin.state().dispatched.len(), 2);
    plugin.answer_call(ctx.as_mut(), 1, Some(200), "");
    assert!(plugin.answers().is_empty());
    plugin.answer_call(ctx.as_mut(), 2, Some(200), "");
    let doc = report(&plugin.only_answer());
    assert_eq!(doc["failed"][0]["cluster"], "shipping");
    assert_eq!(doc["failed"][0]["outcome"], "dispatch_error");
    assert_eq!(doc["failed"][0]["detail"], "unknown cluster shipping");
}

#[test]
fn every_call_refused_answers_500_at_once() {
    let plugin = Plugin::configured(r#"{"subscribers": [{"cluster": "a"}, {"cluster": "b"}]}"#);
    {
        let mut state = plugin.host.0.borrow_mut();
        state.unknown_clusters.insert("a".into());
        state.unknown_clusters.insert("b".into());
    }
    let _ctx = send(&plugin, &post("x"), b"e");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 500);
    assert!(answer
        .headers
        .contains(&("x-fanout-failed", "2".to_string())));
}

#[test]
fn no_subscribers_answers_202_at_once() {
    let plugin = Plugin::configured(THREE);
    let _ctx = send(&plugin, &post("empty.default"), b"{}");
    assert_eq!(plugin.only_answer(), Answer::accepted());
    assert!(plugin.state().dispatched.is_empty());
}

// Rule 1.
#[test]
fn method_not_allowed_is_405_with_allow_and_no_call() {
    let plugin = Plugin::configured(THREE);
    let ctx_headers = [(":method", "GET"), (":authority", "orders.default")];
    let _ctx = send(&plugin, &ctx_headers, b"");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 405);
    assert!(answer
        .headers
        .contains(&("allow", "POST, OPTIONS".to_string())));
    assert!(plugin.state().dispatched.is_empty());
}

#[test]
fn options_is_200_with_the_webhook_headers_and_no_call() {
    let mut plugin = Plugin::configured(THREE);
    let headers = [
        (":method", "OPTIONS"),
        (":authority", "orders.default"),
        ("webhook-request-origin", "sender.example"),
    ];
    let _ctx = send(&plugin, &headers, b"");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 200);
    assert!(answer.body.is_empty());
    for header in [
        ("allow", "POST, OPTIONS"),
        ("webhook-allowed-origin", "sender.example"),
        ("webhook-allowed-rate", "*"),
    ] {
        assert!(answer.header_pairs().contains(&header), "{answer:?}");
    }
    assert!(plugin.state().dispatched.is_empty());
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.requests.options"), 1);
    assert!(plugin
        .state()
        .metric("fanout.requests.rejected.200")
        .is_none());
}

impl Plugin {
    /// A request with a body that is answered `status` (its error containing `error`) from
    /// its headers: the body is never read, nobody is called.
    fn rejected_from_the_headers(&self, headers: &[(&str, &str)], status: u32, error: &str) {
        let mut ctx = self.stream(headers, b"{}");
        assert_eq!(
            ctx.on_http_request_headers(headers.len(), false),
            Action::Pause
        );
        let answer = self.only_answer();
        assert_eq!(answer.status, status);
        let text = report(&answer)["error"].as_str().unwrap().to_string();
        assert!(text.contains(error), "{text}");
        assert_eq!(ctx.on_http_request_body(2, true), Action::Pause);
        assert_eq!(self.answers().len(), 1);
        assert!(self.state().dispatched.is_empty());
        assert_eq!(self.state().body_reads, 0);
    }
}

const REQUIRE_CLOUDEVENTS: &str = r#"{
  "require_cloudevents": true,
  "subscribers": [{"cluster": "a"}, {"cluster": "b"}]
}"#;

#[test]
fn require_cloudevents_rejects_a_binary_request_from_its_headers() {
    let mut plugin = Plugin::configured(REQUIRE_CLOUDEVENTS);
    let mut headers = post("x");
    headers.extend([("ce-specversion", "1.0"), ("ce-id", "1"), ("ce-type", "t")]);
    plugin.rejected_from_the_headers(&headers, 400, "ce-source is missing");
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.requests.rejected.400"), 1);

    // The valid one is fanned out.
    headers.push(("ce-source", "/s"));
    let _ctx = send(&plugin, &headers, b"{}");
    assert_eq!(plugin.state().dispatched.len(), 2);
}

#[test]
fn require_cloudevents_rejects_a_structured_body_once_complete() {
    let plugin = Plugin::configured(REQUIRE_CLOUDEVENTS);
    let mut headers = post("x");
    headers.push(("content-type", "application/cloudevents+json"));
    let _ctx = send(
        &plugin,
        &headers,
        br#"{"specversion": "1.0", "id": "1", "type": "t"}"#,
    );
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 400);
    assert!(report(&answer)["error"]
        .as_str()
        .unwrap()
        .contains("member source is missing"));
    assert!(plugin.state().dispatched.is_empty());
    let valid = br#"{"specversion": "1.0", "id": "1", "source": "/s", "type": "t"}"#;
    let _ctx = send(&plugin, &headers, valid);
    assert_eq!(plugin.state().dispatched.len(), 2);
}

#[test]
fn unknown_host_is_404_and_no_call() {
    let plugin = Plugin::configured(THREE);
    let _ctx = send(&plugin, &post("nobody.default"), b"{}");
    assert_eq!(plugin.only_answer().status, 404);
    assert!(plugin.state().dispatched.is_empty());
}

// Rule 2: declared or counted, a body over the limit is 413 and nobody is called.
#[test]
fn declared_body_over_the_limit_is_413_before_the_body() {
    let plugin = Plugin::configured(THREE);
    let mut headers = post("orders.default");
    headers.push(("content-length", "65"));
    let mut ctx = plugin.stream(&headers, b"");
    assert_eq!(
        ctx.on_http_request_headers(headers.len(), false),
        Action::Pause
    );
    assert_eq!(plugin.only_answer().status, 413);
    // The rest of the upload changes nothing.
    assert_eq!(ctx.on_http_request_body(65, true), Action::Pause);
    assert_eq!(plugin.answers().len(), 1);
    assert!(plugin.state().dispatched.is_empty());
    assert_eq!(plugin.state().body_reads, 0);
}

#[test]
fn chunked_body_over_the_limit_is_413_as_it_grows() {
    let plugin = Plugin::configured(THREE);
    let headers = post("orders.default");
    let mut ctx = plugin.stream(&headers, &[b'x'; 100]);
    assert_eq!(
        ctx.on_http_request_headers(headers.len(), false),
        Action::Pause
    );
    assert_eq!(ctx.on_http_request_body(40, false), Action::Pause);
    assert!(plugin.answers().is_empty());
    assert_eq!(ctx.on_http_request_body(80, false), Action::Pause);
    assert_eq!(plugin.only_answer().status, 413);
    assert_eq!(ctx.on_http_request_body(100, true), Action::Pause);
    assert_eq!(plugin.answers().len(), 1);
    assert!(plugin.state().dispatched.is_empty());
}

#[test]
fn body_at_the_limit_is_fanned_out() {
    let plugin = Plugin::configured(THREE);
    let _ctx = send(&plugin, &post("orders.default"), &[b'x'; 64]);
    assert!(plugin.answers().is_empty());
    assert_eq!(plugin.state().dispatched.len(), 3);
    assert_eq!(plugin.state().dispatched[0].body.len(), 64);
}

// A body in several pieces is read once, whole, at end of stream.
#[test]
fn chunked_body_is_read_once_at_end_of_stream() {
    let plugin = Plugin::configured(THREE);
    let headers = post("orders.default");
    let mut ctx = plugin.stream(&headers, b"hello world");
    ctx.on_http_request_headers(headers.len(), false);
    ctx.on_http_request_body(5, false);
    ctx.on_http_request_body(11, false);
    assert!(plugin.state().dispatched.is_empty());
    ctx.on_http_request_body(11, true);
    let state = plugin.state();
    assert_eq!(state.body_reads, 1);
    assert_eq!(state.dispatched.len(), 3);
    assert_eq!(state.dispatched[2].body, b"hello world");
}

#[test]
fn trailers_end_the_request() {
    let plugin = Plugin::configured(THREE);
    let headers = post("orders.default");
    let mut ctx = plugin.stream(&headers, b"data");
    ctx.on_http_request_headers(headers.len(), false);
    ctx.on_http_request_body(4, false);
    assert_eq!(ctx.on_http_request_trailers(1), Action::Pause);
    assert_eq!(plugin.state().dispatched.len(), 3);
    assert_eq!(plugin.state().dispatched[0].body, b"data");
}

#[test]
fn request_without_body_fans_out_from_the_headers() {
    let plugin = Plugin::configured(THREE);
    let _ctx = send(&plugin, &post("orders.default"), b"");
    let state = plugin.state();
    assert_eq!(state.dispatched.len(), 3);
    assert!(state.dispatched[0].body.is_empty());
    assert_eq!(state.body_reads, 0);
}

#[test]
fn non_utf8_forwarded_header_is_400() {
    let plugin = Plugin::configured(THREE);
    let mut ctx = plugin.stream(&post("orders.default"), b"");
    plugin
        .host
        .0
        .borrow_mut()
        .request_headers
        .push(("ce-source".into(), vec![0xc3, 0x28]));
    ctx.on_http_request_headers(4, true);
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 400);
    assert!(report(&answer)["error"]
        .as_str()
        .unwrap()
        .contains("ce-source"));
}

// Rule 6: answered once; late, duplicate and unknown callbacks are ignored.
#[test]
fn late_duplicate_and_unknown_callbacks_change_nothing() {
    let plugin = Plugin::configured(THREE);
    let mut ctx = send(&plugin, &post("orders.default"), b"{}");
    plugin.answer_call(ctx.as_mut(), 99, Some(500), "stranger");
    plugin.answer_call(ctx.as_mut(), 1, Some(200), "");
    plugin.answer_call(ctx.as_mut(), 1, Some(500), "duplicate");
    plugin.answer_call(ctx.as_mut(), 2, Some(200), "");
    assert!(plugin.answers().is_empty());
    plugin.answer_call(ctx.as_mut(), 3, Some(200), "");
    assert_eq!(plugin.only_answer(), Answer::accepted());
    plugin.answer_call(ctx.as_mut(), 3, Some(500), "late");
    plugin.answer_call(ctx.as_mut(), 2, None, "");
    assert_eq!(plugin.answers().len(), 1);
    assert_eq!(ctx.on_http_request_body(10, true), Action::Pause);
    assert_eq!(plugin.answers().len(), 1);
}

// Rule 6: a client that goes away leaves other streams alone.
#[test]
fn a_stream_that_ends_early_does_not_disturb_another() {
    let plugin = Plugin::configured(r#"{"subscribers": [{"cluster": "a"}]}"#);
    let mut first = send(&plugin, &post("x"), b"1");
    let mut second = send(&plugin, &post("x"), b"2");
    assert!(first.on_done());
    drop(first);
    plugin.answer_call(second.as_mut(), 2, Some(200), "");
    assert_eq!(plugin.only_answer(), Answer::accepted());
}

#[test]
fn streams_keep_the_config_they_started_with() {
    let (mut plugin, ok) = Plugin::configure(r#"{"subscribers": [{"cluster": "old"}]}"#);
    assert!(ok);
    let mut before = plugin.stream(&post("x"), b"");
    // A new configuration arrives (as an xDS update would deliver it).
    plugin.host.0.borrow_mut().config = Some(br#"{"subscribers": [{"cluster": "new"}]}"#.to_vec());
    assert!(plugin.root.on_configure(0));
    before.on_http_request_headers(3, true);
    let _after = send(&plugin, &post("x"), b"");
    let clusters: Vec<String> = plugin
        .state()
        .dispatched
        .iter()
        .map(|c| c.cluster.clone())
        .collect();
    assert_eq!(clusters, ["old", "new"]);
}

#[test]
fn an_invalid_update_is_refused_and_the_old_config_serves() {
    let (mut plugin, ok) = Plugin::configure(r#"{"subscribers": [{"cluster": "old"}]}"#);
    assert!(ok);
    plugin.host.0.borrow_mut().config = Some(br#"{"subscribers": [{"cluster": ""}]}"#.to_vec());
    assert!(!plugin.root.on_configure(0));
    let _ctx = send(&plugin, &post("x"), b"");
    assert_eq!(plugin.state().dispatched[0].cluster, "old");
}

// Every config rejection of the contract makes on_configure refuse.
#[test]
fn config_rejections_are_refused_by_on_configure() {
    let cases = [
        "",
        "{}",
        r#"{"subscribers": [{"cluster": "a"}], "unknown": true}"#,
        r#"{"subscribers": [{"cluster": 5}]}"#,
        r#"{"subscribers": [{"cluster": ""}]}"#,
        r#"{"subscribers": [{"cluster": "a", "path": "x"}]}"#,
        r#"{"subscribers": [{"cluster": "a", "timeout_ms": 0}]}"#,
        r#"{"timeout_ms": 0, "subscribers": []}"#,
        r#"{"channels": [{"hosts": ["a"]}, {"hosts": ["a"]}]}"#,
        r#"{"channels": [], "subscribers": []}"#,
    ];
    for json in cases {
        let (_plugin, ok) = Plugin::configure(json);
        assert!(!ok, "accepted: {json:?}");
    }
    let (_plugin, ok) = Plugin::configure(THREE);
    assert!(ok);
}

#[test]
fn a_stream_without_configuration_answers_500() {
    let (plugin, ok) = Plugin::configure("{}");
    assert!(!ok);
    let _ctx = send(&plugin, &post("x"), b"");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 500);
    assert!(plugin.state().dispatched.is_empty());
}

// Metrics: counted in memory, handed to Envoy on the root's tick.
#[test]
fn metrics_are_defined_at_configure_and_flushed_on_tick() {
    let mut plugin = Plugin::configured(THREE);
    {
        let state = plugin.state();
        assert_eq!(state.tick_period, Some(Duration::from_secs(1)));
        for name in [
            "fanout.requests.received",
            "fanout.requests.accepted",
            "fanout.requests.failed",
            "fanout.requests.options",
            "fanout.subscriber.billing.calls",
            "fanout.subscriber.shipping.delivered",
            "fanout.subscriber.analytics.failed.timeout",
            "fanout.in_flight",
        ] {
            assert_eq!(state.value(name), 0, "{name}");
        }
        assert!(state.samples("fanout.duration_ms").is_empty());
    }

    // One fan-out: billing 200 after 5 ms, shipping 500 after 7 ms, analytics times out.
    plugin.host.0.borrow_mut().now_ms = 1000;
    let mut ctx = send(&plugin, &post("orders.default"), b"{}");
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.in_flight"), 1);
    assert_eq!(plugin.state().value("fanout.subscriber.billing.calls"), 1);
    plugin.host.0.borrow_mut().now_ms = 1005;
    plugin.answer_call(ctx.as_mut(), 1, Some(200), "");
    plugin.host.0.borrow_mut().now_ms = 1007;
    plugin.answer_call(ctx.as_mut(), 2, Some(500), "");
    plugin.host.0.borrow_mut().now_ms = 1010;
    plugin.answer_call(ctx.as_mut(), 3, Some(504), "upstream request timeout");
    // A rejection and a success with no subscribers.
    let _r = send(&plugin, &post("nobody"), b"{}");
    let _e = send(&plugin, &post("empty.default"), b"");
    plugin.root.on_tick();

    let state = plugin.state();
    let expected = [
        ("fanout.requests.received", 3),
        ("fanout.requests.accepted", 1),
        ("fanout.requests.failed", 1),
        ("fanout.requests.rejected.404", 1),
        ("fanout.subscriber.billing.calls", 1),
        ("fanout.subscriber.billing.delivered", 1),
        ("fanout.subscriber.shipping.failed.status_5xx", 1),
        ("fanout.subscriber.analytics.failed.timeout", 1),
        ("fanout.subscriber.analytics.delivered", 0),
        ("fanout.in_flight", 0),
    ];
    for (name, value) in expected {
        assert_eq!(state.value(name), value, "{name}");
    }
    assert_eq!(state.samples("fanout.call_duration_ms"), vec![5, 7, 10]);
    assert_eq!(state.samples("fanout.duration_ms"), vec![10, 0]);
}

#[test]
fn a_client_that_goes_away_leaves_the_in_flight_gauge() {
    let mut plugin = Plugin::configured(THREE);
    let mut ctx = send(&plugin, &post("orders.default"), b"{}");
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.in_flight"), 1);
    assert!(ctx.on_done());
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.in_flight"), 0);
    assert!(plugin.state().samples("fanout.duration_ms").is_empty());
}

#[test]
fn metrics_off_defines_and_counts_nothing() {
    let mut plugin = Plugin::configured(r#"{"metrics": false, "subscribers": [{"cluster": "a"}]}"#);
    let mut ctx = send(&plugin, &post("x"), b"e");
    plugin.answer_call(ctx.as_mut(), 1, Some(200), "");
    plugin.root.on_tick();
    let state = plugin.state();
    assert!(state.metrics.is_empty(), "{:?}", state.metrics);
    assert_eq!(state.tick_period.unwrap_or_default(), Duration::ZERO);
    assert_eq!(state.answers.len(), 1);
}

#[test]
fn odd_cluster_names_make_one_stat_segment() {
    let plugin = Plugin::configured(
        r#"{"subscribers": [{"cluster": "outbound|80||billing.default.svc.cluster.local"}]}"#,
    );
    assert_eq!(
        plugin
            .state()
            .value("fanout.subscriber.outbound_80__billing_default_svc_cluster_local.calls"),
        0
    );
}

// body_wait: continue lets the headers on (to a buffer filter) and still fans out the body.
#[test]
fn continue_mode_lets_headers_on_and_fans_out_at_end_of_stream() {
    let plugin =
        Plugin::configured(r#"{"body_wait": "continue", "subscribers": [{"cluster": "a"}]}"#);
    let headers = post("x");
    let mut ctx = plugin.stream(&headers, b"event");
    assert_eq!(
        ctx.on_http_request_headers(headers.len(), false),
        Action::Continue
    );
    assert_eq!(ctx.on_http_request_body(5, false), Action::Pause);
    assert_eq!(ctx.on_http_request_body(5, true), Action::Pause);
    assert_eq!(plugin.state().dispatched[0].body, b"event");
    plugin.answer_call(ctx.as_mut(), 1, Some(200), "");
    assert_eq!(plugin.only_answer(), Answer::accepted());
    // Our own local reply passes through the response path: nothing to flag.
    assert_eq!(ctx.on_http_response_headers(0, true), Action::Continue);
}

#[test]
fn continue_mode_still_pauses_rejections_and_bodyless_requests() {
    let plugin =
        Plugin::configured(r#"{"body_wait": "continue", "subscribers": [{"cluster": "a"}]}"#);
    let get = [(":method", "GET"), (":authority", "x")];
    let mut ctx = plugin.stream(&get, b"");
    assert_eq!(ctx.on_http_request_headers(2, false), Action::Pause);
    assert_eq!(plugin.only_answer().status, 405);
    let headers = post("x");
    let mut ctx = plugin.stream(&headers, b"");
    assert_eq!(
        ctx.on_http_request_headers(headers.len(), true),
        Action::Pause
    );
    assert_eq!(plugin.state().dispatched.len(), 1);
}

#[test]
fn a_response_before_our_answer_means_the_router_was_reached() {
    let mut plugin =
        Plugin::configured(r#"{"body_wait": "continue", "subscribers": [{"cluster": "a"}]}"#);
    let headers = post("x");
    let mut ctx = plugin.stream(&headers, b"event");
    assert_eq!(
        ctx.on_http_request_headers(headers.len(), false),
        Action::Continue
    );
    // No buffer filter: the route answers before the body is in.
    assert_eq!(ctx.on_http_response_headers(2, false), Action::Continue);
    assert_eq!(ctx.on_http_request_body(5, true), Action::Pause);
    assert!(plugin.state().dispatched.is_empty(), "fanned out anyway");
    assert!(plugin.answers().is_empty());
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.requests.reached_router"), 1);
}

// Delivery: retries, dead letters, replies, async.

impl Plugin {
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
        self.root
            .on_http_call_response(token, num_headers, body.len(), 0);
    }

    fn last_call(&self) -> Dispatched {
        self.state().dispatched.last().cloned().unwrap()
    }
}

const RETRY_TWICE: &str = r#"{"delivery": {"retry": 2, "backoff_policy": "linear",
    "backoff_delay_ms": 100}, "subscribers": [{"cluster": "a"}, {"cluster": "b"}]}"#;

#[test]
fn a_sync_retry_goes_out_from_the_root_after_its_backoff_and_the_root_answers_the_stream() {
    let mut plugin = Plugin::configured(RETRY_TWICE);
    assert_eq!(plugin.state().tick_period, Some(Duration::from_millis(10)));
    let mut ctx = send(&plugin, &post("x"), b"event");
    // First attempts from the stream.
    assert!(plugin
        .state()
        .dispatched
        .iter()
        .all(|c| c.context == STREAM));
    plugin.answer_call(ctx.as_mut(), 1, Some(200), "");
    plugin.host.0.borrow_mut().now_ms = 5;
    plugin.answer_call(ctx.as_mut(), 2, Some(503), "busy");
    assert!(plugin.answers().is_empty());
    plugin.tick_at(104);
    assert_eq!(
        plugin.state().dispatched.len(),
        2,
        "retried before its backoff"
    );
    plugin.tick_at(105);
    let retry = plugin.last_call();
    assert_eq!((retry.cluster.as_str(), retry.context), ("b", ROOT));
    assert_eq!(retry.body, b"event");
    plugin.answer_root_call(retry.token, Some(200), "", &[]);
    assert_eq!(plugin.only_answer(), Answer::accepted());
    assert_eq!(plugin.state().answered_streams, vec![STREAM]);
    // The root put its own context back for whatever it does next.
    assert_eq!(plugin.state().effective, ROOT);
    // Our own answer passing through the stream is not mistaken for somebody else's.
    assert_eq!(ctx.on_http_response_headers(1, true), Action::Continue);
    plugin.tick_at(1000);
    assert_eq!(plugin.state().value("fanout.subscriber.b.retries"), 1);
    assert_eq!(plugin.state().value("fanout.requests.accepted"), 1);
}

#[test]
fn the_sender_leaving_during_a_retry_wait_drops_the_fan_out() {
    let mut plugin = Plugin::configured(RETRY_TWICE);
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.answer_call(ctx.as_mut(), 1, Some(200), "");
    plugin.answer_call(ctx.as_mut(), 2, Some(503), "");
    assert!(ctx.on_done());
    plugin.host.0.borrow_mut().gone.insert(STREAM);
    plugin.tick_at(10_000);
    assert_eq!(
        plugin.state().dispatched.len(),
        2,
        "retried for a sender that left"
    );
    assert!(plugin.answers().is_empty());
}

#[test]
fn retries_run_out_into_a_500_with_the_attempts() {
    let mut plugin = Plugin::configured(RETRY_TWICE);
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.answer_call(ctx.as_mut(), 1, Some(200), "");
    plugin.answer_call(ctx.as_mut(), 2, Some(500), "");
    plugin.tick_at(100);
    plugin.answer_root_call(plugin.last_call().token, None, "", &[]);
    plugin.tick_at(300);
    plugin.answer_root_call(plugin.last_call().token, Some(502), "still down", &[]);
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 500);
    let failed = &report(&answer)["failed"][0];
    assert_eq!(failed["cluster"], "b");
    assert_eq!(failed["attempts"], 3);
    assert_eq!(failed["status"], 502);
}

#[test]
fn a_400_is_not_retried() {
    let mut plugin = Plugin::configured(RETRY_TWICE);
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.answer_call(ctx.as_mut(), 1, Some(200), "");
    plugin.answer_call(ctx.as_mut(), 2, Some(400), "bad event");
    assert_eq!(plugin.only_answer().status, 500);
    plugin.tick_at(10_000);
    assert_eq!(plugin.state().dispatched.len(), 2);
}

#[test]
fn retry_after_is_read_and_honoured() {
    let mut plugin = Plugin::configured(
        r#"{"delivery": {"retry": 1, "backoff_delay_ms": 1, "backoff_max_ms": 60000},
            "subscribers": [{"cluster": "a"}]}"#,
    );
    let mut ctx = send(&plugin, &post("x"), b"event");
    {
        let mut state = plugin.host.0.borrow_mut();
        state.call_response = (Some(429), Vec::new());
        state.call_response_headers = vec![("retry-after".into(), b"2".to_vec())];
    }
    ctx.on_http_call_response(1, 2, 0, 0);
    plugin.tick_at(1999);
    assert_eq!(plugin.state().dispatched.len(), 1);
    plugin.tick_at(2000);
    assert_eq!(plugin.state().dispatched.len(), 2);
}

const WITH_DEAD_LETTER: &str = r#"{"delivery": {"dead_letter": {"cluster": "dlq",
    "authority": "dlq.local", "path": "/dead"}}, "subscribers": [{"cluster": "a"}]}"#;

#[test]
fn a_failed_subscriber_is_dead_lettered_with_the_failure_headers() {
    let plugin = Plugin::configured(WITH_DEAD_LETTER);
    let mut headers = post("x");
    headers.push(("ce-id", "7"));
    let mut ctx = send(&plugin, &headers, b"event");
    plugin.answer_call(ctx.as_mut(), 1, Some(500), "db\ndown");
    // The dead letter goes out at once, from the stream.
    let dlq = plugin.last_call();
    assert_eq!(dlq.cluster, "dlq");
    assert_eq!(dlq.body, b"event");
    let header = |name: &str| {
        dlq.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(header(":path").as_deref(), Some("/dead"));
    assert_eq!(header(":authority").as_deref(), Some("dlq.local"));
    assert_eq!(header("ce-id").as_deref(), Some("7"));
    assert_eq!(header("x-fanout-failed-cluster").as_deref(), Some("a"));
    assert_eq!(header("x-fanout-failed-status").as_deref(), Some("500"));
    assert_eq!(header("x-fanout-failed-body").as_deref(), Some("db down"));
    plugin.answer_call(ctx.as_mut(), dlq.token, Some(202), "");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 202);
    assert!(answer
        .headers
        .contains(&("x-fanout-dead-lettered", "1".to_string())));
}

#[test]
fn a_failing_dead_letter_is_a_500() {
    let plugin = Plugin::configured(WITH_DEAD_LETTER);
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.answer_call(ctx.as_mut(), 1, Some(500), "");
    plugin.answer_call(ctx.as_mut(), 2, Some(503), "");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 500);
    assert_eq!(report(&answer)["failed"][0]["leg"], "dead_letter");
}

#[test]
fn a_reply_is_forwarded_with_its_content_type_and_ce_headers() {
    let plugin = Plugin::configured(
        r#"{"subscribers": [{"cluster": "a", "reply": {"cluster": "replies", "path": "/in"}}]}"#,
    );
    let mut ctx = send(&plugin, &post("x"), b"event");
    {
        let mut state = plugin.host.0.borrow_mut();
        state.call_response = (Some(200), b"{\"answer\": 1}".to_vec());
        state.call_response_headers = vec![
            (":status".into(), b"200".to_vec()),
            ("content-type".into(), b"application/json".to_vec()),
            ("ce-type".into(), b"com.example.reply".to_vec()),
            ("set-cookie".into(), b"secret".to_vec()),
        ];
    }
    ctx.on_http_call_response(1, 4, 13, 0);
    let reply = plugin.last_call();
    assert_eq!(reply.cluster, "replies");
    assert_eq!(reply.body, b"{\"answer\": 1}");
    assert!(reply
        .headers
        .contains(&("content-type".to_string(), "application/json".to_string())));
    assert!(reply
        .headers
        .contains(&("ce-type".to_string(), "com.example.reply".to_string())));
    assert!(!reply.headers.iter().any(|(n, _)| n == "set-cookie"));
    assert!(
        plugin.answers().is_empty(),
        "answered before the reply was delivered"
    );
    plugin.answer_call(ctx.as_mut(), reply.token, Some(500), "");
    assert_eq!(
        plugin.only_answer().status,
        500,
        "a failed reply is a failed delivery"
    );
}

// Knative's data plane (issue 14): replies, dead letters, retry-after.

impl Plugin {
    /// Delivers the answer to call `token` from the stream, with headers.
    fn answer_call_with(
        &self,
        ctx: &mut dyn HttpContext,
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
        ctx.on_http_call_response(token, 1 + headers.len(), body.len(), 0);
    }

    /// A metric's value after the next flush (a second later).
    fn flushed(&mut self, name: &str) -> i64 {
        let later = self.state().now_ms + 1000;
        self.tick_at(later);
        self.state().value(name)
    }
}

fn header_of(call: &Dispatched, name: &str) -> Option<String> {
    call.headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.clone())
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

#[test]
fn prefer_reply_goes_only_to_subscribers_with_a_reply_target() {
    let plugin = Plugin::configured(REPLYING);
    let _ctx = send(&plugin, &post("x"), b"event");
    let calls = plugin.state().dispatched.clone();
    assert_eq!(header_of(&calls[0], "prefer").as_deref(), Some("reply"));
    assert_eq!(header_of(&calls[1], "prefer"), None);
}

#[test]
fn a_202_is_never_a_reply_and_nothing_of_it_is_read() {
    let plugin = Plugin::configured(REPLYING);
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.answer_call(ctx.as_mut(), 2, Some(200), "");
    plugin.answer_call_with(
        ctx.as_mut(),
        1,
        202,
        &[("ce-type", "com.example.reply"), ("ce-id", "r")],
        b"{\"looks\": \"like an event\"}",
    );
    assert_eq!(plugin.only_answer(), Answer::accepted());
    assert_eq!(plugin.state().dispatched.len(), 2, "a reply was sent");
    assert_eq!(plugin.state().call_body_reads, 0);
}

#[test]
fn a_2xx_body_that_is_not_a_cloudevent_is_discarded_and_counted() {
    let mut plugin = Plugin::configured(REPLYING);
    assert_eq!(
        plugin.flushed("fanout.subscriber.answering.reply_discarded"),
        0
    );
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.answer_call(ctx.as_mut(), 2, Some(200), "");
    plugin.answer_call_with(
        ctx.as_mut(),
        1,
        200,
        &[("content-type", "application/json")],
        b"{\"ok\": true}",
    );
    assert_eq!(plugin.only_answer(), Answer::accepted());
    assert_eq!(plugin.state().dispatched.len(), 2, "a reply was sent");
    assert_eq!(plugin.state().call_body_reads, 0, "the body was read");
    assert_eq!(
        plugin.flushed("fanout.subscriber.answering.reply_discarded"),
        1
    );
    // A subscriber without a reply target has no reply counters.
    assert!(plugin
        .state()
        .metric("fanout.subscriber.plain.reply_discarded")
        .is_none());
}

#[test]
fn a_structured_reply_is_passed_on_whole_at_the_limit() {
    let plugin = Plugin::configured(REPLYING);
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.answer_call(ctx.as_mut(), 2, Some(200), "");
    let body = [b'x'; 64];
    plugin.answer_call_with(
        ctx.as_mut(),
        1,
        200,
        &[("content-type", "application/cloudevents+json")],
        &body,
    );
    let reply = plugin.last_call();
    assert_eq!(reply.cluster, "replies");
    assert_eq!(reply.body, body);
    assert_eq!(header_of(&reply, "prefer"), None);
}

#[test]
fn a_reply_over_max_body_bytes_is_a_failed_reply_never_read_nor_sent_cut_short() {
    let mut plugin = Plugin::configured(
        r#"{"max_body_bytes": 64,
            "subscribers": [{"cluster": "answering", "reply": {"cluster": "replies"}}]}"#,
    );
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.host.0.borrow_mut().now_ms = 9;
    plugin.answer_call_with(ctx.as_mut(), 1, 200, &[("ce-type", "t")], &[b'x'; 65]);
    assert_eq!(plugin.state().dispatched.len(), 1, "a reply was sent");
    assert_eq!(plugin.state().call_body_reads, 0, "the body was read");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 500);
    let failed = &report(&answer)["failed"][0];
    assert_eq!(failed["cluster"], "answering");
    assert_eq!(failed["leg"], "reply");
    assert_eq!(failed["outcome"], "too_large");
    assert_eq!(
        failed["detail"],
        "the reply of 65 bytes is larger than max_body_bytes (64): not passed on"
    );
    assert_eq!(
        plugin.flushed("fanout.subscriber.answering.reply_failed.too_large"),
        1
    );
    // The subscriber's own call succeeded.
    assert_eq!(
        plugin
            .state()
            .value("fanout.subscriber.answering.delivered"),
        1
    );
}

#[test]
fn a_reply_target_envoy_refuses_is_a_failed_reply_counted_by_its_reason() {
    let mut plugin = Plugin::configured(
        r#"{"subscribers": [{"cluster": "answering", "reply": {"cluster": "replies"}}]}"#,
    );
    plugin
        .host
        .0
        .borrow_mut()
        .unknown_clusters
        .insert("replies".into());
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.answer_call_with(ctx.as_mut(), 1, 200, &[("ce-type", "t")], b"answer");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 500);
    let failed = &report(&answer)["failed"][0];
    assert_eq!(failed["leg"], "reply");
    assert_eq!(failed["outcome"], "dispatch_error");
    assert_eq!(
        plugin.flushed("fanout.subscriber.answering.reply_failed.dispatch_error"),
        1
    );
    assert_eq!(
        plugin
            .state()
            .value("fanout.subscriber.replies.failed.dispatch_error"),
        1
    );
}

#[test]
fn a_reply_that_failed_for_good_sends_the_original_event_to_the_dead_letter() {
    let mut plugin = Plugin::configured(REPLYING);
    let mut headers = post("x");
    headers.extend([("ce-id", "7"), ("ce-knativeerrorcode", "999")]);
    let mut ctx = send(&plugin, &headers, b"event");
    plugin.answer_call(ctx.as_mut(), 2, Some(200), "");
    plugin.answer_call_with(ctx.as_mut(), 1, 200, &[("ce-type", "reply")], b"answer");
    let reply = plugin.last_call();
    assert_eq!(reply.cluster, "replies");
    plugin.answer_call_with(ctx.as_mut(), reply.token, 503, &[], b"replies down");
    let dlq = plugin.last_call();
    assert_eq!(dlq.cluster, "dlq");
    assert_eq!(dlq.body, b"event", "the original event, not the reply");
    assert_eq!(header_of(&dlq, "ce-id").as_deref(), Some("7"));
    assert_eq!(
        header_of(&dlq, "x-fanout-failed-cluster").as_deref(),
        Some("answering")
    );
    assert_eq!(
        header_of(&dlq, "x-fanout-failed-leg").as_deref(),
        Some("reply")
    );
    assert_eq!(
        header_of(&dlq, "x-fanout-failed-status").as_deref(),
        Some("503")
    );
    assert_eq!(
        header_of(&dlq, "ce-knativeerrordest").as_deref(),
        Some("http://replies.local/replies")
    );
    // The request's own attribute of that name gives way to the dead letter's.
    assert_eq!(
        dlq.headers
            .iter()
            .filter(|(n, _)| n == "ce-knativeerrorcode")
            .map(|(_, v)| v.as_str())
            .collect::<Vec<_>>(),
        ["503"]
    );
    assert_eq!(
        header_of(&dlq, "ce-knativeerrordata").as_deref(),
        Some("cmVwbGllcyBkb3du"),
        "base64 of the reply target's answer"
    );
    plugin.answer_call(ctx.as_mut(), dlq.token, Some(200), "");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 202);
    assert!(answer
        .headers
        .contains(&("x-fanout-dead-lettered", "1".to_string())));
    assert_eq!(
        plugin.flushed("fanout.subscriber.answering.reply_failed.status_5xx"),
        1
    );
    assert_eq!(
        plugin
            .state()
            .value("fanout.subscriber.answering.dead_lettered"),
        1
    );
}

#[test]
fn a_structured_dead_letter_carries_the_attributes_in_its_json() {
    let plugin = Plugin::configured(REPLYING);
    let mut headers = post("x");
    headers.push(("content-type", "application/cloudevents+json"));
    let event = br#"{"specversion":"1.0","id":"1","source":"/s","type":"t"}"#;
    let mut ctx = send(&plugin, &headers, event);
    plugin.answer_call(ctx.as_mut(), 1, Some(200), "");
    plugin.answer_call(ctx.as_mut(), 2, Some(400), "no");
    let dlq = plugin.last_call();
    assert_eq!(dlq.cluster, "dlq");
    let want = r#"{"specversion":"1.0","id":"1","source":"/s","type":"t","knativeerrordest":"http://plain/","knativeerrorcode":400,"knativeerrordata":"bm8="}"#;
    assert_eq!(String::from_utf8(dlq.body.clone()).unwrap(), want);
    assert!(!dlq.headers.iter().any(|(n, _)| n.starts_with("ce-")));
    assert_eq!(
        header_of(&dlq, "x-fanout-failed-status").as_deref(),
        Some("400")
    );
}

#[test]
fn retry_after_never_shortens_the_backoff_and_is_read_on_429_and_503_only() {
    let config = r#"{"delivery": {"retry": 3, "backoff_policy": "linear",
        "backoff_delay_ms": 500, "backoff_max_ms": 60000},
        "subscribers": [{"cluster": "a"}]}"#;
    for (status, retry_after, wait) in [
        (503, "0", 500),
        (429, "1", 1000),
        (503, "2", 2000),
        (500, "2", 500),
        (504, "2", 500),
        (429, "soon", 500),
    ] {
        let mut plugin = Plugin::configured(config);
        let mut ctx = send(&plugin, &post("x"), b"event");
        plugin.answer_call_with(
            ctx.as_mut(),
            1,
            status,
            &[("retry-after", retry_after)],
            b"",
        );
        plugin.tick_at(wait - 1);
        assert_eq!(
            plugin.state().dispatched.len(),
            1,
            "{status} retry-after {retry_after}: retried before {wait} ms"
        );
        plugin.tick_at(wait);
        assert_eq!(
            plugin.state().dispatched.len(),
            2,
            "{status} retry-after {retry_after}: not retried at {wait} ms"
        );
    }
}

#[test]
fn retry_after_as_an_http_date_is_read_against_the_hosts_wall_clock() {
    let mut plugin = Plugin::configured(
        r#"{"delivery": {"retry": 1, "backoff_delay_ms": 1, "backoff_max_ms": 60000},
            "subscribers": [{"cluster": "a"}]}"#,
    );
    // 2015-10-21T07:28:00Z is 1445412480000 ms after the epoch; the host says it is 3 s
    // before.
    let now = 1_445_412_477_000;
    plugin.host.0.borrow_mut().now_ms = now;
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.answer_call_with(
        ctx.as_mut(),
        1,
        429,
        &[("retry-after", "Wed, 21 Oct 2015 07:28:00 GMT")],
        b"",
    );
    plugin.tick_at(now + 2999);
    assert_eq!(plugin.state().dispatched.len(), 1);
    plugin.tick_at(now + 3000);
    assert_eq!(plugin.state().dispatched.len(), 2);
}

const ASYNC: &str = r#"{"mode": "async", "max_in_flight": 2,
    "subscribers": [{"cluster": "a"}, {"cluster": "b"}]}"#;

#[test]
fn async_answers_202_at_once_and_the_root_delivers_after_the_sender_left() {
    let mut plugin = Plugin::configured(ASYNC);
    let ctx = send(&plugin, &post("x"), b"event");
    assert_eq!(plugin.only_answer(), Answer::accepted());
    assert!(plugin.state().dispatched.is_empty(), "sent from the stream");
    drop(ctx);
    plugin.host.0.borrow_mut().gone.insert(STREAM);
    plugin.tick_at(1);
    let calls = plugin.state().dispatched.clone();
    assert_eq!(calls.len(), 2);
    assert!(calls
        .iter()
        .all(|c| c.context == ROOT && c.body == b"event"));
    plugin.answer_root_call(calls[0].token, Some(200), "", &[]);
    plugin.answer_root_call(calls[1].token, Some(200), "", &[]);
    assert_eq!(plugin.answers().len(), 1, "nothing more to answer");
    plugin.tick_at(2000);
    assert_eq!(plugin.state().value("fanout.in_flight"), 0);
}

#[test]
fn async_past_max_in_flight_is_503_not_dropped() {
    let mut plugin = Plugin::configured(ASYNC);
    let _a = send(&plugin, &post("x"), b"1");
    let _b = send(&plugin, &post("x"), b"2");
    let _c = send(&plugin, &post("x"), b"3");
    let answers = plugin.answers();
    assert_eq!(
        answers.iter().map(|a| a.status).collect::<Vec<_>>(),
        vec![202, 202, 503]
    );
    assert!(answers[2]
        .headers
        .contains(&("retry-after", "1".to_string())));
    // Once one is delivered there is room again.
    plugin.tick_at(1);
    let calls: Vec<Dispatched> = plugin.state().dispatched.clone();
    for call in calls.into_iter().take(2) {
        plugin.answer_root_call(call.token, Some(200), "", &[]);
    }
    let _d = send(&plugin, &post("x"), b"4");
    assert_eq!(plugin.answers().last().unwrap().status, 202);
}

#[test]
fn an_async_failure_after_the_202_is_counted() {
    let mut plugin = Plugin::configured(r#"{"mode": "async", "subscribers": [{"cluster": "a"}]}"#);
    let _ctx = send(&plugin, &post("x"), b"event");
    plugin.tick_at(1);
    plugin.answer_root_call(plugin.last_call().token, Some(500), "", &[]);
    plugin.tick_at(2000);
    assert_eq!(plugin.state().value("fanout.requests.undelivered"), 1);
    assert_eq!(plugin.state().value("fanout.requests.accepted"), 1);
}

// Subscription filters (issue 5).

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

fn clusters(plugin: &Plugin) -> Vec<String> {
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

#[test]
fn binary_event_reaches_only_the_subscribers_whose_filter_matches() {
    let plugin = Plugin::configured(FILTERED);
    let headers = with(
        "orders.default",
        &[("ce-type", "order.shipped"), ("ce-id", "1")],
    );
    let mut ctx = send(&plugin, &headers, b"{}");
    assert_eq!(clusters(&plugin), ["shipped", "everything"]);
    // ce-* are not in forward_headers here: filtering does not need them forwarded.
    assert!(plugin.state().dispatched[0]
        .headers
        .iter()
        .all(|(n, _)| !n.starts_with("ce-")));
    plugin.answer_call(ctx.as_mut(), 1, Some(200), "");
    assert!(plugin.answers().is_empty());
    plugin.answer_call(ctx.as_mut(), 2, Some(200), "");
    assert_eq!(plugin.only_answer(), Answer::accepted());
}

#[test]
fn percent_encoded_binary_attributes_are_decoded_before_matching() {
    let plugin = Plugin::configured(FILTERED);
    let headers = with("orders.default", &[("ce-type", "order%2Ecreated")]);
    let _ctx = send(&plugin, &headers, b"");
    assert_eq!(clusters(&plugin), ["created", "everything"]);
}

#[test]
fn structured_event_is_parsed_once_and_filtered() {
    let plugin = Plugin::configured(FILTERED);
    let body = br#"{"specversion": "1.0", "type": "order.created", "source": "/eu/shop",
                    "id": "7", "data": {"type": "order.shipped", "items": [1, 2]}}"#;
    let headers = with("picky.default", &[STRUCTURED]);
    let mut ctx = send(&plugin, &headers, body);
    assert_eq!(clusters(&plugin), ["created", "eu"]);
    assert_eq!(plugin.state().body_reads, 1);
    assert_eq!(plugin.state().dispatched[0].body, body);
    plugin.answer_call(ctx.as_mut(), 1, Some(200), "");
    plugin.answer_call(ctx.as_mut(), 2, Some(200), "");
    assert_eq!(plugin.only_answer(), Answer::accepted());
}

#[test]
fn every_subscriber_skipped_answers_202_at_once() {
    let plugin = Plugin::configured(FILTERED);
    let headers = with(
        "picky.default",
        &[("ce-type", "order.refunded"), ("ce-source", "/us/shop")],
    );
    let _ctx = send(&plugin, &headers, b"{}");
    assert!(plugin.state().dispatched.is_empty());
    assert_eq!(plugin.only_answer(), Answer::accepted());
}

#[test]
fn a_request_that_is_not_a_cloudevent_reaches_only_unfiltered_subscribers() {
    let plugin = Plugin::configured(FILTERED);
    let headers = with("orders.default", &[("content-type", "application/json")]);
    let _ctx = send(&plugin, &headers, br#"{"type": "order.created"}"#);
    assert_eq!(clusters(&plugin), ["everything"]);
    let plugin = Plugin::configured(FILTERED);
    let _ctx = send(&plugin, &post("picky.default"), b"plain text");
    assert_eq!(plugin.only_answer(), Answer::accepted());
}

#[test]
fn the_500_report_lists_skipped_subscribers_apart_from_failed() {
    let plugin = Plugin::configured(FILTERED);
    let headers = with("orders.default", &[("ce-type", "order.created")]);
    let mut ctx = send(&plugin, &headers, b"{}");
    assert_eq!(clusters(&plugin), ["created", "everything"]);
    plugin.answer_call(ctx.as_mut(), 1, Some(503), "busy");
    plugin.answer_call(ctx.as_mut(), 2, Some(200), "");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 500);
    assert!(answer
        .headers
        .contains(&("x-fanout-failed", "1".to_string())));
    let doc = report(&answer);
    assert_eq!(doc["subscribers"], 3);
    assert_eq!(doc["delivered"], 1);
    assert_eq!(doc["failed"][0]["cluster"], "created");
    assert_eq!(doc["skipped"], serde_json::json!(["shipped"]));
    // The metrics tell skipped from failed too.
    let mut plugin = plugin;
    plugin.root.on_tick();
    let state = plugin.state();
    assert_eq!(state.value("fanout.subscriber.shipped.skipped"), 1);
    assert_eq!(state.value("fanout.subscriber.shipped.calls"), 0);
    assert_eq!(
        state.value("fanout.subscriber.created.failed.status_5xx"),
        1
    );
    assert_eq!(state.value("fanout.subscriber.everything.skipped"), 0);
}

#[test]
fn a_batch_is_415_from_the_headers_when_the_channel_filters() {
    let plugin = Plugin::configured(FILTERED);
    let headers = with(
        "orders.default",
        &[("content-type", "application/cloudevents-batch+json")],
    );
    plugin.rejected_from_the_headers(&headers, 415, "batch of CloudEvents");
}

#[test]
fn a_malformed_structured_body_is_400_when_a_filter_needs_it() {
    let plugin = Plugin::configured(FILTERED);
    let headers = with("orders.default", &[STRUCTURED]);
    let _ctx = send(&plugin, &headers, br#"{"type": "order.created", "data": "#);
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 400);
    assert!(report(&answer)["error"]
        .as_str()
        .unwrap()
        .contains("not a structured CloudEvent"));
    assert!(plugin.state().dispatched.is_empty());
    // An empty body is no event either.
    let plugin = Plugin::configured(FILTERED);
    let _ctx = send(&plugin, &headers, b"");
    assert_eq!(plugin.only_answer().status, 400);
}

#[test]
fn without_filters_a_structured_body_is_not_parsed() {
    // A body that is not JSON at all: parsing it would mean a 400.
    let plugin = Plugin::configured(FILTERED);
    let headers = with("plain.default", &[STRUCTURED]);
    let mut ctx = send(&plugin, &headers, b"{not json");
    assert_eq!(clusters(&plugin), ["a", "b"]);
    plugin.answer_call(ctx.as_mut(), 1, Some(200), "");
    plugin.answer_call(ctx.as_mut(), 2, Some(200), "");
    assert_eq!(plugin.only_answer(), Answer::accepted());
    // ...and a batch goes out to all as it is.
    let plugin = Plugin::configured(FILTERED);
    let headers = with(
        "plain.default",
        &[("content-type", "application/cloudevents-batch+json")],
    );
    let _ctx = send(&plugin, &headers, b"[]");
    assert_eq!(clusters(&plugin), ["a", "b"]);
}

#[test]
fn filter_config_errors_are_refused_by_on_configure() {
    for json in [
        r#"{"subscribers": [{"cluster": "a", "filters": [{"exact": {"type": "t", "id": "1"}}]}]}"#,
        r#"{"subscribers": [{"cluster": "a", "filters": [{"like": {"type": "t"}}]}]}"#,
        r#"{"subscribers": [{"cluster": "a", "filters": [{"exact": {"": "t"}}]}]}"#,
        r#"{"subscribers": [{"cluster": "a", "filter": {"attributes": {"type": 1}}}]}"#,
    ] {
        let (_plugin, ok) = Plugin::configure(json);
        assert!(!ok, "accepted: {json}");
    }
}

#[test]
fn async_mode_filters_too_and_an_event_nobody_wants_ends_at_once() {
    let config = FILTERED.replacen(
        r#""forward_headers""#,
        r#""mode": "async", "forward_headers""#,
        1,
    );
    let mut plugin = Plugin::configured(&config);
    let nobody = with("picky.default", &[("ce-type", "order.refunded")]);
    let _ctx = send(&plugin, &nobody, b"{}");
    assert_eq!(plugin.only_answer(), Answer::accepted());
    // A tick a second later sends what is due and flushes the metrics.
    plugin.tick_at(1000);
    assert!(plugin.state().dispatched.is_empty());
    // The job ended: nothing stays in flight.
    assert_eq!(plugin.state().value("fanout.in_flight"), 0);
    assert_eq!(plugin.state().value("fanout.subscriber.eu.skipped"), 1);

    let created = with("picky.default", &[("ce-type", "order.created")]);
    let _ctx = send(&plugin, &created, b"{}");
    plugin.tick_at(1001);
    assert_eq!(clusters(&plugin), ["created"]);
}

#[test]
fn a_root_call_that_never_comes_back_is_given_up_after_its_worst_case() {
    let mut plugin = Plugin::configured(
        r#"{"mode": "async", "timeout_ms": 1000, "subscribers": [{"cluster": "a"}]}"#,
    );
    let _ctx = send(&plugin, &post("x"), b"event");
    plugin.tick_at(1);
    assert_eq!(plugin.state().dispatched.len(), 1);
    // Envoy drops the call: no answer ever comes.
    plugin.tick_at(1000 + 29_000);
    plugin.tick_at(31_500);
    plugin.tick_at(33_000);
    let state = plugin.state();
    assert_eq!(state.value("fanout.requests.undelivered"), 1);
    assert_eq!(state.value("fanout.in_flight"), 0);
}

/// A configuration update starts a new root context in the same VM; a request that started
/// under the old one is counted, and its deliveries go on.
#[test]
fn root_contexts_of_one_vm_share_counts_and_deliveries() {
    let host = FakeHost::default();
    let json = br#"{"delivery": {"retry": 1, "backoff_delay_ms": 100},
                    "subscribers": [{"cluster": "a"}]}"#;
    host.0.borrow_mut().config = Some(json.to_vec());
    let shared = super::VmShared::default();
    let mut old = FanoutRoot::with_shared(ROOT, host.clone(), shared.clone());
    assert!(old.on_configure(0));
    host.0.borrow_mut().request_headers = post("x")
        .iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect();
    host.0.borrow_mut().effective = STREAM;
    let mut ctx = old.create_http_context(STREAM).unwrap();
    ctx.on_http_request_headers(3, true);
    host.0.borrow_mut().call_response = (Some(503), Vec::new());
    ctx.on_http_call_response(1, 1, 0, 0);

    // The update: a new root in the same VM; the old one is retired.
    let mut new = FanoutRoot::with_shared(ROOT + 10, host.clone(), shared);
    assert!(new.on_configure(0));
    assert!(old.on_done());
    drop(old);
    // exponential by default: 100 ms * 2^1 before retry 1
    host.0.borrow_mut().now_ms = 200;
    host.0.borrow_mut().effective = ROOT + 10;
    new.on_tick();
    let retry = host.0.borrow().dispatched.last().cloned().unwrap();
    assert_eq!(
        retry.token, 2,
        "the new root's timer sent the old request's retry"
    );
    host.0.borrow_mut().call_response = (Some(200), Vec::new());
    new.on_http_call_response(2, 1, 0, 0);
    assert_eq!(host.0.borrow().answers, vec![Answer::accepted()]);
    host.0.borrow_mut().now_ms = 2000;
    new.on_tick();
    let state = host.0.borrow();
    assert_eq!(state.value("fanout.requests.accepted"), 1);
    assert_eq!(state.value("fanout.requests.received"), 1);
    assert_eq!(state.value("fanout.in_flight"), 0);
    assert_eq!(state.value("fanout.subscriber.a.retries"), 1);
}

// ---------------------------------------------------------------------------------------
// dedupe: redelivery without duplicates.

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

impl Plugin {
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

#[test]
fn configure_creates_the_shard_keys() {
    let plugin = Plugin::configured(DEDUPE);
    let state = plugin.state();
    let shared = state.shared.borrow();
    let mut keys: Vec<&String> = shared.values.keys().collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "fanout.dedupe.slot.0",
            "fanout.dedupe.slot.1",
            "fanout.dedupe.slot.2",
            "fanout.dedupe.slot.3"
        ]
    );
    assert!(shared.values.values().all(|(v, _)| v.is_empty()));
}

#[test]
fn a_redelivery_calls_only_the_subscriber_that_failed() {
    let mut plugin = Plugin::configured(DEDUPE);
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    plugin.answer_call(ctx.as_mut(), 1, Some(200), "");
    plugin.answer_call(ctx.as_mut(), 2, Some(503), "down");
    plugin.answer_call(ctx.as_mut(), 3, Some(200), "");
    assert_eq!(plugin.last_answer().status, 500);
    assert!(report(&plugin.last_answer())
        .get("already_delivered")
        .is_none());

    // The sender retries: only shipping is called, and the 202 names the others.
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    assert_eq!(
        plugin.dispatched_since(3),
        [(4, "shipping".to_string())],
        "only the failed subscriber is called again"
    );
    plugin.answer_call(ctx.as_mut(), 4, Some(200), "");
    let answer = plugin.last_answer();
    assert_eq!(answer.status, 202);
    assert_eq!(
        Plugin::header(&answer, "x-fanout-already-delivered").as_deref(),
        Some("2")
    );
    let doc = report(&answer);
    assert_eq!(
        doc["already_delivered"],
        serde_json::json!(["billing", "analytics"])
    );
    assert_eq!(doc["delivered"], 1);

    // Once more: everybody has it, 202 at once, nobody called.
    let _ctx = send(&plugin, &event("e1"), b"{}");
    assert_eq!(plugin.state().dispatched.len(), 4);
    let answer = plugin.last_answer();
    assert_eq!(answer.status, 202);
    assert_eq!(
        Plugin::header(&answer, "x-fanout-already-delivered").as_deref(),
        Some("3")
    );
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.dedupe.skipped"), 5);
    assert_eq!(plugin.state().value("fanout.dedupe.entries"), 1);
    assert_eq!(plugin.state().value("fanout.requests.accepted"), 2);
}

#[test]
fn a_request_without_the_key_fans_out_to_everyone_and_is_counted() {
    let mut plugin = Plugin::configured(DEDUPE);
    for _ in 0..2 {
        let mut ctx = send(&plugin, &post("orders.default"), b"{}");
        let n = plugin.state().dispatched.len();
        for token in n as u32 - 2..=n as u32 {
            plugin.answer_call(ctx.as_mut(), token, Some(200), "");
        }
        assert_eq!(plugin.last_answer(), Answer::accepted());
    }
    assert_eq!(plugin.state().dispatched.len(), 6);
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.dedupe.missing_key"), 2);
    assert_eq!(plugin.state().shared.borrow().events(), 0);
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
fn deliver(plugin: &Plugin, headers: &[(&str, &str)], body: &[u8]) -> usize {
    let before = plugin.state().dispatched.len();
    let mut ctx = send(plugin, headers, body);
    let calls = plugin.dispatched_since(before);
    for (token, _) in &calls {
        plugin.answer_call(ctx.as_mut(), *token, Some(200), "");
    }
    assert_eq!(plugin.last_answer().status, 202);
    calls.len()
}

#[test]
fn the_same_id_from_two_sources_is_two_events() {
    let mut plugin = Plugin::configured(&dedupe_by_identity());
    assert_eq!(deliver(&plugin, &from("/orders/eu", "1"), b"{}"), 3);
    assert_eq!(deliver(&plugin, &from("/orders/us", "1"), b"{}"), 3);
    // A copy of either is a duplicate.
    assert_eq!(deliver(&plugin, &from("/orders/eu", "1"), b"{}"), 0);
    assert_eq!(deliver(&plugin, &from("/orders/us", "1"), b"{}"), 0);
    // The id alone is no identity: fanned out to everyone, counted.
    assert_eq!(deliver(&plugin, &event("1"), b"{}"), 3);
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.dedupe.entries"), 2);
    assert_eq!(plugin.state().value("fanout.dedupe.missing_key"), 1);
}

#[test]
fn a_structured_event_is_named_by_the_source_and_id_in_its_body() {
    let mut plugin = Plugin::configured(&dedupe_by_identity());
    let mut headers = post("orders.default");
    headers.push(("content-type", "application/cloudevents+json"));
    let event = |source: &str| {
        format!(r#"{{"specversion": "1.0", "type": "t", "source": "{source}", "id": "1"}}"#)
    };
    assert_eq!(deliver(&plugin, &headers, event("/a").as_bytes()), 3);
    assert_eq!(deliver(&plugin, &headers, event("/b").as_bytes()), 3);
    assert_eq!(deliver(&plugin, &headers, event("/a").as_bytes()), 0);
    // Its binary copy is the same event.
    assert_eq!(deliver(&plugin, &from("/b", "1"), b"{}"), 0);
    // A body that does not parse has no identity; without filters it is no 400 either.
    assert_eq!(deliver(&plugin, &headers, b"{not json"), 3);
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.dedupe.missing_key"), 1);
}

#[test]
fn continue_mode_reads_a_structured_identity_at_end_of_stream() {
    let config = dedupe_by_identity().replacen('{', r#"{"body_wait": "continue", "#, 1);
    let plugin = Plugin::configured(&config);
    let mut headers = post("orders.default");
    headers.push(("content-type", "application/cloudevents+json"));
    let body = br#"{"specversion": "1.0", "type": "t", "source": "/a", "id": "1"}"#;
    for expected in [3, 0] {
        let before = plugin.state().dispatched.len();
        let mut ctx = plugin.stream(&headers, body);
        assert_eq!(
            ctx.on_http_request_headers(headers.len(), false),
            Action::Continue
        );
        assert_eq!(ctx.on_http_request_body(body.len(), true), Action::Pause);
        let calls = plugin.dispatched_since(before);
        assert_eq!(calls.len(), expected);
        for (token, _) in &calls {
            plugin.answer_call(ctx.as_mut(), *token, Some(200), "");
        }
        assert_eq!(plugin.last_answer().status, 202);
    }
}

// Two workers, the same event at once: the second calls nobody and says "in progress" (409),
// and after the first has delivered, a retry gets 202 without any call.
#[test]
fn the_same_event_on_two_workers_is_delivered_once() {
    let first = Plugin::configured(DEDUPE);
    let second = first.another_worker(DEDUPE);
    let mut a = send(&first, &event("e1"), b"{}");
    assert_eq!(first.state().dispatched.len(), 3);
    let _b = send(&second, &event("e1"), b"{}");
    assert!(second.state().dispatched.is_empty(), "called twice");
    let answer = second.only_answer();
    assert_eq!(answer.status, 409);
    assert_eq!(Plugin::header(&answer, "retry-after").as_deref(), Some("1"));
    assert_eq!(
        report(&answer)["in_progress"],
        serde_json::json!(["billing", "shipping", "analytics"])
    );
    for token in 1..=3 {
        first.answer_call(a.as_mut(), token, Some(200), "");
    }
    assert_eq!(first.only_answer(), Answer::accepted());
    let _c = send(&second, &event("e1"), b"{}");
    assert!(second.state().dispatched.is_empty());
    assert_eq!(second.last_answer().status, 202);
}

// A client that goes away: what was delivered is recorded, the rest is released.
#[test]
fn a_client_that_goes_away_releases_its_claims() {
    let plugin = Plugin::configured(DEDUPE);
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    plugin.answer_call(ctx.as_mut(), 1, Some(200), "");
    assert!(ctx.on_done());
    let _retry = send(&plugin, &event("e1"), b"{}");
    assert_eq!(
        plugin.dispatched_since(3),
        [(4, "shipping".to_string()), (5, "analytics".to_string())]
    );
}

#[test]
fn records_expire_after_ttl() {
    let plugin = Plugin::configured(DEDUPE);
    plugin.host.0.borrow_mut().now_ms = 10_000;
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    for token in 1..=3 {
        plugin.answer_call(ctx.as_mut(), token, Some(200), "");
    }
    plugin.host.0.borrow_mut().now_ms = 10_999;
    let _ctx = send(&plugin, &event("e1"), b"{}");
    assert_eq!(plugin.state().dispatched.len(), 3, "still remembered");
    plugin.host.0.borrow_mut().now_ms = 11_000;
    let _ctx = send(&plugin, &event("e1"), b"{}");
    assert_eq!(plugin.state().dispatched.len(), 6, "forgotten after ttl_ms");
}

#[test]
fn the_store_never_holds_more_than_max_entries() {
    let mut plugin = Plugin::configured(DEDUPE);
    for i in 0..1000 {
        let id = format!("e{i}");
        let mut ctx = send(&plugin, &event(&id), b"{}");
        let n = plugin.state().dispatched.len() as u32;
        for token in n - 2..=n {
            plugin.answer_call(ctx.as_mut(), token, Some(200), "");
        }
        assert!(plugin.state().shared.borrow().events() <= 100);
    }
    assert_eq!(plugin.state().shared.borrow().events(), 100);
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.dedupe.entries"), 100);
    // The oldest were evicted: e0 goes to everyone again; the newest is still known.
    let before = plugin.state().dispatched.len();
    let _old = send(&plugin, &event("e0"), b"{}");
    assert_eq!(plugin.state().dispatched.len(), before + 3);
    let _new = send(&plugin, &event("e999"), b"{}");
    assert_eq!(plugin.state().dispatched.len(), before + 3);
}

// The per-request cost: host calls on the shared data, dedupe off and on.
#[test]
fn dedupe_costs_four_shared_data_calls_per_request() {
    let calls = |plugin: &Plugin| {
        let state = plugin.state();
        let shared = state.shared.borrow();
        shared.gets + shared.sets
    };
    let off = Plugin::configured(THREE);
    let mut ctx = send(&off, &event("e1"), b"{}");
    for token in 1..=3 {
        off.answer_call(ctx.as_mut(), token, Some(200), "");
    }
    assert_eq!(calls(&off), 0);

    let on = Plugin::configured(DEDUPE);
    let after_configure = calls(&on);
    let mut ctx = send(&on, &event("e1"), b"{}");
    assert_eq!(calls(&on) - after_configure, 2, "claim: get + set");
    for token in 1..=3 {
        on.answer_call(ctx.as_mut(), token, Some(200), "");
    }
    assert_eq!(calls(&on) - after_configure, 4, "settle: get + set");
    let _again = send(&on, &event("e1"), b"{}");
    assert_eq!(calls(&on) - after_configure, 5, "all delivered: one get");
    let _no_key = send(&on, &post("orders.default"), b"{}");
    assert_eq!(calls(&on) - after_configure, 5, "no key: nothing");
}

// dedupe with what came to main since: filters, retries from the root, dead letters, async.

fn shard_marks(plugin: &Plugin) -> usize {
    let state = plugin.state();
    let shared = state.shared.borrow();
    shared
        .values
        .values()
        .flat_map(|(v, _)| Shard::decode(v).unwrap().entries)
        .map(|e| e.marks.len())
        .sum()
}

#[test]
fn a_subscriber_its_filter_skipped_is_never_claimed_nor_recorded() {
    let config = FILTERED.replacen('{', r#"{"dedupe": {}, "#, 1);
    let plugin = Plugin::configured(&config);
    let created = with(
        "orders.default",
        &[
            ("ce-specversion", "1.0"),
            ("ce-id", "e1"),
            ("ce-source", "/s"),
            ("ce-type", "order.created"),
        ],
    );
    let mut ctx = send(&plugin, &created, b"{}");
    assert_eq!(clusters(&plugin), ["created", "everything"]);
    assert_eq!(
        shard_marks(&plugin),
        2,
        "only the called subscribers are claimed"
    );
    plugin.answer_call(ctx.as_mut(), 1, Some(200), "");
    plugin.answer_call(ctx.as_mut(), 2, Some(200), "");
    assert_eq!(plugin.only_answer(), Answer::accepted());
    assert_eq!(shard_marks(&plugin), 2);

    // The same id, another type: "shipped" wants it now; it was never recorded, so it is
    // called; "everything" already has it; "created" is skipped by its filter.
    let mut shipped = created.clone();
    shipped.retain(|(n, _)| *n != "ce-type");
    shipped.push(("ce-type", "order.shipped"));
    let mut ctx = send(&plugin, &shipped, b"{}");
    assert_eq!(clusters(&plugin), ["created", "everything", "shipped"]);
    plugin.answer_call(ctx.as_mut(), 3, Some(200), "");
    let answer = plugin.last_answer();
    assert_eq!(answer.status, 202);
    let doc = report(&answer);
    assert_eq!(doc["skipped"], serde_json::json!(["created"]));
    assert_eq!(doc["already_delivered"], serde_json::json!(["everything"]));
    assert_eq!(doc["delivered"], 1);
}

#[test]
fn a_dead_lettered_subscriber_counts_as_delivered() {
    let config = WITH_DEAD_LETTER.replacen('{', r#"{"dedupe": {}, "#, 1);
    let plugin = Plugin::configured(&config);
    let mut headers = post("x");
    headers.push(("ce-source", "/s"));
    headers.push(("ce-id", "7"));
    let mut ctx = send(&plugin, &headers, b"event");
    plugin.answer_call(ctx.as_mut(), 1, Some(400), "no");
    assert_eq!(plugin.last_call().cluster, "dlq");
    plugin.answer_call(ctx.as_mut(), 2, Some(200), "");
    assert_eq!(plugin.only_answer().status, 202);
    let _again = send(&plugin, &headers, b"event");
    assert_eq!(plugin.state().dispatched.len(), 2, "called again");
    let answer = plugin.last_answer();
    assert_eq!(answer.status, 202);
    assert_eq!(
        report(&answer)["already_delivered"],
        serde_json::json!(["a"])
    );
}

#[test]
fn a_retry_from_the_root_is_recorded_when_the_root_ends_the_fan_out() {
    let config = RETRY_TWICE.replacen('{', r#"{"dedupe": {}, "#, 1);
    let mut plugin = Plugin::configured(&config);
    let mut headers = post("x");
    headers.push(("ce-source", "/s"));
    headers.push(("ce-id", "r1"));
    let mut ctx = send(&plugin, &headers, b"event");
    plugin.answer_call(ctx.as_mut(), 1, Some(200), "");
    plugin.answer_call(ctx.as_mut(), 2, Some(503), "busy");
    plugin.tick_at(200);
    let retry = plugin.last_call();
    assert_eq!((retry.cluster.as_str(), retry.context), ("b", ROOT));
    plugin.answer_root_call(retry.token, Some(200), "", &[]);
    assert_eq!(plugin.only_answer(), Answer::accepted());
    let _again = send(&plugin, &headers, b"event");
    assert_eq!(plugin.state().dispatched.len(), 3, "called again");
    assert_eq!(
        Plugin::header(&plugin.last_answer(), "x-fanout-already-delivered").as_deref(),
        Some("2")
    );
}

#[test]
fn a_sync_sender_that_leaves_during_a_retry_wait_releases_the_claim() {
    let config = RETRY_TWICE.replacen('{', r#"{"dedupe": {}, "#, 1);
    let mut plugin = Plugin::configured(&config);
    let mut headers = post("x");
    headers.push(("ce-source", "/s"));
    headers.push(("ce-id", "r1"));
    let mut ctx = send(&plugin, &headers, b"event");
    plugin.answer_call(ctx.as_mut(), 1, Some(200), "");
    plugin.answer_call(ctx.as_mut(), 2, Some(503), "");
    assert!(ctx.on_done());
    plugin.host.0.borrow_mut().gone.insert(STREAM);
    plugin.tick_at(10_000);
    // The sender's retry: a is recorded, b's claim was released, so b is called (not 409).
    plugin.host.0.borrow_mut().gone.clear();
    let _retry = send(&plugin, &headers, b"event");
    assert_eq!(plugin.dispatched_since(2), [(3, "b".to_string())]);
}

#[test]
fn async_records_at_the_end_of_the_background_delivery() {
    let config = ASYNC.replacen('{', r#"{"dedupe": {}, "#, 1);
    let mut plugin = Plugin::configured(&config);
    let mut headers = post("x");
    headers.push(("ce-source", "/s"));
    headers.push(("ce-id", "a1"));
    let _first = send(&plugin, &headers, b"event");
    assert_eq!(plugin.only_answer(), Answer::accepted());
    // A redelivery while the first is still being delivered: nobody called, 409.
    let _second = send(&plugin, &headers, b"event");
    let answer = plugin.last_answer();
    assert_eq!(answer.status, 409);
    assert_eq!(Plugin::header(&answer, "retry-after").as_deref(), Some("1"));
    plugin.tick_at(1);
    let calls = plugin.state().dispatched.clone();
    assert_eq!(calls.len(), 2, "the 409 request called somebody");
    plugin.answer_root_call(calls[0].token, Some(200), "", &[]);
    plugin.answer_root_call(calls[1].token, Some(200), "", &[]);
    // Recorded: a third copy is answered 202 at once and calls nobody, not even later.
    let _third = send(&plugin, &headers, b"event");
    let answer = plugin.last_answer();
    assert_eq!(answer.status, 202);
    assert_eq!(
        Plugin::header(&answer, "x-fanout-already-delivered").as_deref(),
        Some("2")
    );
    plugin.tick_at(2);
    assert_eq!(plugin.state().dispatched.len(), 2);
    plugin.tick_at(2000);
    assert_eq!(plugin.state().value("fanout.dedupe.skipped"), 2);
    assert_eq!(plugin.state().value("fanout.dedupe.in_progress"), 2);
    assert_eq!(plugin.state().value("fanout.requests.undelivered"), 0);
    assert_eq!(plugin.state().value("fanout.in_flight"), 0);
}

#[test]
fn async_past_max_in_flight_claims_nothing() {
    let config = ASYNC.replacen('{', r#"{"dedupe": {}, "#, 1);
    let plugin = Plugin::configured(&config);
    for id in ["1", "2", "3"] {
        let mut headers = post("x");
        headers.push(("ce-source", "/s"));
        headers.push(("ce-id", id));
        let _ctx = send(&plugin, &headers, b"event");
    }
    assert_eq!(plugin.last_answer().status, 503);
    assert_eq!(shard_marks(&plugin), 4, "the refused event left claims");
}
