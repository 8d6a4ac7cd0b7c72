//! Prints, as JSON, the host calls `fanout` makes for one request answered 202, for
//! N = 0, 1, 4, 16, 64 subscribers, with metrics on and off.
//!
//! Each request: headers (not end of stream), one body callback with end of stream and a
//! 1 KiB body, then one 200 answer per subscriber. Metrics are flushed on the root's tick;
//! the flush's calls are amortised over the requests since the previous tick. Calls the
//! proxy-wasm SDK makes on its own are added: `set_effective_context` before every
//! `on_http_call_response`.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Duration;

use fanout::answer::Answer;
use fanout::filter::{FanoutRoot, Host};
use fanout::metrics::Kind;
use proxy_wasm::traits::RootContext;

#[derive(Default)]
struct State {
    config: Vec<u8>,
    calls: BTreeMap<&'static str, u64>,
    next_token: u32,
    tokens: Vec<u32>,
    now: u64,
}

#[derive(Clone, Default)]
struct Counting(Rc<RefCell<State>>);

impl Counting {
    fn hit(&self, name: &'static str) {
        *self.0.borrow_mut().calls.entry(name).or_default() += 1;
    }
    fn reset(&self) {
        self.0.borrow_mut().calls.clear();
    }
    fn total(&self) -> u64 {
        self.0.borrow().calls.values().sum()
    }
}

impl Host for Counting {
    fn follow_log_level(&self) {
        self.hit("get_log_level");
    }
    fn plugin_configuration(&self) -> Option<Vec<u8>> {
        self.hit("get_buffer(plugin_configuration)");
        Some(self.0.borrow().config.clone())
    }
    fn request_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.hit("get_map(request_headers)");
        let mut headers = vec![
            (":method", "POST"),
            (":path", "/"),
            (":authority", "127.0.0.1:10000"),
            (":scheme", "http"),
            ("content-type", "application/json"),
            ("content-length", "1024"),
            ("ce-specversion", "1.0"),
            ("ce-type", "dev.fanout.bench"),
            ("ce-source", "/bench"),
            ("ce-id", "1"),
            ("user-agent", "wrk"),
            ("x-forwarded-proto", "http"),
            ("x-request-id", "0b7c5a4e-9a7c-4c55-8a3c-1f0f2b1a6f11"),
        ];
        headers.sort_by_key(|(name, _)| !name.starts_with(':'));
        headers
            .into_iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect()
    }
    fn request_body(&self, size: usize) -> Vec<u8> {
        self.hit("get_buffer(request_body)");
        vec![b'x'; size]
    }
    fn dispatch(
        &self,
        _cluster: &str,
        _headers: Vec<(&str, &str)>,
        _body: &[u8],
        _timeout: Duration,
    ) -> Result<u32, String> {
        self.hit("dispatch_http_call");
        let mut state = self.0.borrow_mut();
        state.next_token += 1;
        let token = state.next_token;
        state.tokens.push(token);
        Ok(token)
    }
    fn call_status(&self) -> Option<u16> {
        self.hit("get_map_value(call_response_headers, :status)");
        Some(200)
    }
    fn call_body(&self, _max: usize) -> Vec<u8> {
        self.hit("get_buffer(call_response_body)");
        Vec::new()
    }
    fn call_header(&self, _name: &str) -> Option<String> {
        self.hit("get_map_value(call_response_headers)");
        None
    }
    fn call_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.hit("get_map(call_response_headers)");
        vec![(":status".to_string(), b"200".to_vec())]
    }
    fn set_effective_context(&self, _context_id: u32) -> bool {
        self.hit("set_effective_context");
        true
    }
    fn respond(&self, answer: &Answer) {
        assert_eq!(answer.status, 202, "the bench request must be answered 202");
        self.hit("send_http_response");
    }
    fn now_ms(&self) -> u64 {
        self.hit("get_current_time");
        let mut state = self.0.borrow_mut();
        state.now += 1;
        state.now
    }
    fn define_metric(&self, _kind: Kind, _name: &str) -> Option<u32> {
        self.hit("define_metric");
        Some(1)
    }
    fn increment_metric(&self, _id: u32, _delta: i64) {
        self.hit("increment_metric");
    }
    fn record_metric(&self, _id: u32, _value: u64) {
        self.hit("record_metric");
    }
    fn set_tick_period(&self, _period: Duration) {
        self.hit("set_tick_period");
    }
    // The bench configurations leave `dedupe` off: no shared data is used.
    fn get_shared_data(&self, _key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.hit("get_shared_data");
        (None, None)
    }
    fn set_shared_data(
        &self,
        _key: &str,
        _value: &[u8],
        _cas: Option<u32>,
    ) -> Result<(), fanout::dedupe::CasMismatch> {
        self.hit("set_shared_data");
        Ok(())
    }
}

const REQUESTS: u64 = 1000;

fn measure(n: usize, metrics: bool) -> String {
    let subscribers: Vec<String> = (0..n)
        .map(|i| format!(r#"{{"cluster": "sub_{i}"}}"#))
        .collect();
    let config = format!(
        r#"{{"metrics": {metrics}, "timeout_ms": 5000, "subscribers": [{}]}}"#,
        subscribers.join(",")
    );
    let host = Counting::default();
    host.0.borrow_mut().config = config.into_bytes();
    let mut root = FanoutRoot::new(1, host.clone());
    assert!(root.on_vm_start(0));
    assert!(root.on_configure(0), "configuration refused");
    host.reset();
    let mut sdk_calls = 0u64;
    for i in 0..REQUESTS {
        let mut stream = root
            .create_http_context(i as u32 + 2)
            .expect("an http context");
        let _ = stream.on_http_request_headers(13, false);
        let _ = stream.on_http_request_body(1024, true);
        let tokens = std::mem::take(&mut host.0.borrow_mut().tokens);
        for token in tokens {
            sdk_calls += 1; // set_effective_context, by the SDK's dispatcher
            stream.on_http_call_response(token, 3, 0, 0);
        }
        let _ = stream.on_http_response_headers(1, true);
        stream.on_done();
    }
    root.on_tick();
    let total = host.total() + sdk_calls;
    let mut by_call: Vec<String> = host
        .0
        .borrow()
        .calls
        .iter()
        .map(|(name, count)| format!(r#""{name}": {}"#, *count as f64 / REQUESTS as f64))
        .collect();
    by_call.push(format!(
        r#""set_effective_context (SDK)": {}"#,
        sdk_calls as f64 / REQUESTS as f64
    ));
    format!(
        r#"{{"subscribers": {n}, "metrics": {metrics}, "per_request": {}, "by_call": {{{}}}}}"#,
        total as f64 / REQUESTS as f64,
        by_call.join(", ")
    )
}

/// `FANOUT_HOSTCALLS_ONLY=N,METRICS` (e.g. `0,true`): that configuration alone, for a native
/// instruction profile of fanout's own code per request (bench/README.md).
fn main() {
    let only = std::env::var("FANOUT_HOSTCALLS_ONLY").ok();
    let mut rows = Vec::new();
    for metrics in [true, false] {
        for n in [0, 1, 4, 16, 64] {
            if only.as_ref().is_none_or(|o| *o == format!("{n},{metrics}")) {
                rows.push(measure(n, metrics));
            }
        }
    }
    println!("[\n  {}\n]", rows.join(",\n  "));
}
