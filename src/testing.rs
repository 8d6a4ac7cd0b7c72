//! The fake host: [`FakeHost`] implements [`Host`] in memory, behaving as Envoy does where
//! the core relies on it (a stream's effective context, shared data's CAS, metrics by name),
//! and records every call and answer. It is what the core's tests drive the plugin and its
//! streams with, natively and inside wasm32, and what `bench/hostcalls` counts host calls
//! with (`calls`). Built for tests, or with the `testing` feature.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::rc::Rc;
use std::time::Duration;

use crate::answer::Answer;
use crate::call::Failure;
use crate::headers::HeaderMap;
use crate::host::CasMismatch;
use crate::host::Host;
use crate::metrics::Kind;

#[derive(Debug, Clone, PartialEq)]
pub struct Dispatched {
    pub token: u32,
    /// The context the call was made for (Envoy cancels a stream's calls when it ends).
    pub context: u32,
    pub cluster: String,
    /// As they were handed over: values are bytes.
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
    pub timeout: Duration,
}

impl Dispatched {
    /// The value of its first header named `name`.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    /// Its headers with their values as text (a value that is not UTF-8 gets U+FFFD), for a
    /// test to compare with a list of strings.
    pub fn text_headers(&self) -> Vec<(String, String)> {
        self.headers
            .iter()
            .map(|(n, v)| (n.clone(), String::from_utf8_lossy(v).into_owned()))
            .collect()
    }
}

#[derive(Default)]
pub struct FakeState {
    pub config: Option<Vec<u8>>,
    pub request_headers: Vec<(String, Vec<u8>)>,
    pub request_body: Vec<u8>,
    pub body_reads: usize,
    pub unknown_clusters: HashSet<String>,
    /// Clusters whose circuit breaker is full: `dispatch` refuses their calls as Envoy does.
    pub overflowing_clusters: HashSet<String>,
    pub next_token: u32,
    pub dispatched: Vec<Dispatched>,
    /// The answer to the call being delivered: `:status` and body.
    pub call_response: (Option<u16>, Vec<u8>),
    pub call_response_headers: Vec<(String, Vec<u8>)>,
    /// Its trailers (gRPC's status).
    pub call_response_trailers: Vec<(String, String)>,
    /// The context Envoy applies host calls to (the one whose callback runs, or the one set
    /// with set_effective_context).
    pub effective: u32,
    /// Streams whose client went away: set_effective_context fails for them.
    pub gone: HashSet<u32>,
    /// Answers by the stream they went to.
    pub answered_streams: Vec<u32>,
    pub call_body_reads: usize,
    pub answers: Vec<Answer>,
    pub now_ms: u64,
    /// Metrics by name: kind, and the counter/gauge value or histogram samples.
    pub metrics: Vec<(String, Kind, i64, Vec<u64>)>,
    pub tick_period: Option<Duration>,
    /// Envoy's shared data: one per process, so two fake "workers" may share it.
    pub shared: Rc<RefCell<SharedData>>,
    /// Host calls made, by the name of the proxy-wasm call each stands for.
    pub calls: BTreeMap<&'static str, u64>,
}

/// Envoy's shared data as its C++ implementation behaves: one CAS counter for all keys,
/// never 0; CAS checked only for a key that exists.
#[derive(Default)]
pub struct SharedData {
    pub values: HashMap<String, (Vec<u8>, u32)>,
    pub last_cas: u32,
    pub gets: usize,
    pub sets: usize,
}

impl FakeState {
    pub fn metric(&self, name: &str) -> Option<&(String, Kind, i64, Vec<u64>)> {
        self.metrics.iter().find(|m| m.0 == name)
    }
}

#[derive(Clone, Default)]
pub struct FakeHost(pub Rc<RefCell<FakeState>>);

impl FakeState {
    /// The token of the latest call made to `cluster`, for a test to answer it by the
    /// subscriber's name rather than by the order calls went out; `None` if no call went there.
    pub fn last_token_to(&self, cluster: &str) -> Option<u32> {
        self.dispatched
            .iter()
            .rev()
            .find(|call| call.cluster == cluster)
            .map(|call| call.token)
    }
}

impl FakeHost {
    /// Counts a host call.
    fn hit(&self, call: &'static str) {
        *self.0.borrow_mut().calls.entry(call).or_default() += 1;
    }
}

impl Host for FakeHost {
    fn follow_log_level(&self) {
        self.hit("get_log_level");
    }

    fn plugin_configuration(&self) -> Option<Vec<u8>> {
        self.hit("get_buffer(plugin_configuration)");
        self.0.borrow().config.clone()
    }

    fn request_headers(&self) -> HeaderMap {
        self.hit("get_map(request_headers)");
        HeaderMap::from_pairs(&self.0.borrow().request_headers)
    }

    fn request_body(&self, size: usize) -> Vec<u8> {
        self.hit("get_buffer(request_body)");
        let mut state = self.0.borrow_mut();
        state.body_reads += 1;
        let end = size.min(state.request_body.len());
        state.request_body[..end].to_vec()
    }

    fn dispatch(
        &self,
        cluster: &str,
        headers: Vec<(&str, &[u8])>,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, Failure> {
        let context = self.0.borrow().effective;
        self.dispatch_for(context, cluster, headers, body, timeout)
    }

    fn dispatch_for(
        &self,
        context: u32,
        cluster: &str,
        headers: Vec<(&str, &[u8])>,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, Failure> {
        self.hit("dispatch_http_call");
        let mut state = self.0.borrow_mut();
        if state.unknown_clusters.contains(cluster) {
            return Err(Failure::DispatchError {
                detail: format!("unknown cluster {cluster}"),
            });
        }
        if state.overflowing_clusters.contains(cluster) {
            return Err(crate::call::overflow(cluster, "refused at dispatch"));
        }
        state.next_token += 1;
        let token = state.next_token;
        state.dispatched.push(Dispatched {
            token,
            context,
            cluster: cluster.to_string(),
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_vec()))
                .collect(),
            body: body.to_vec(),
            timeout,
        });
        Ok(token)
    }

    fn call_status(&self) -> Option<u16> {
        self.hit("get_map_value(call_response_headers, :status)");
        self.0.borrow().call_response.0
    }

    fn call_body(&self, max: usize) -> Vec<u8> {
        self.hit("get_buffer(call_response_body)");
        let mut state = self.0.borrow_mut();
        state.call_body_reads += 1;
        let body = &state.call_response.1;
        body[..max.min(body.len())].to_vec()
    }

    fn call_header(&self, name: &str) -> Option<String> {
        self.hit("get_map_value(call_response_headers)");
        let state = self.0.borrow();
        state
            .call_response_headers
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| String::from_utf8(v.clone()).ok())
    }

    fn call_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.hit("get_map(call_response_headers)");
        self.0.borrow().call_response_headers.clone()
    }

    fn call_trailer(&self, name: &str) -> Option<String> {
        self.hit("get_map_value(call_response_trailers)");
        let state = self.0.borrow();
        state
            .call_response_trailers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    }

    fn set_effective_context(&self, context_id: u32) -> bool {
        self.hit("set_effective_context");
        let mut state = self.0.borrow_mut();
        if state.gone.contains(&context_id) {
            return false;
        }
        state.effective = context_id;
        true
    }

    fn respond(&self, answer: &Answer) {
        self.hit("send_http_response");
        let mut state = self.0.borrow_mut();
        let stream = state.effective;
        state.answers.push(answer.clone());
        state.answered_streams.push(stream);
    }

    fn now_ms(&self) -> u64 {
        self.hit("get_current_time");
        self.0.borrow().now_ms
    }

    fn define_metric(&self, kind: Kind, name: &str) -> Option<u32> {
        self.hit("define_metric");
        let mut state = self.0.borrow_mut();
        // Envoy keeps one stat per name: defining it again finds the same one.
        if let Some(i) = state.metrics.iter().position(|m| m.0 == name) {
            return Some(i as u32);
        }
        state.metrics.push((name.to_string(), kind, 0, Vec::new()));
        Some(state.metrics.len() as u32 - 1)
    }

    fn increment_metric(&self, id: u32, delta: i64) {
        self.hit("increment_metric");
        let mut state = self.0.borrow_mut();
        let metric = &mut state.metrics[id as usize];
        assert_ne!(metric.1, Kind::Histogram, "increment of a histogram");
        metric.2 += delta;
    }

    fn record_metric(&self, id: u32, value: u64) {
        self.hit("record_metric");
        let mut state = self.0.borrow_mut();
        let metric = &mut state.metrics[id as usize];
        assert_eq!(metric.1, Kind::Histogram, "record of a non-histogram");
        metric.3.push(value);
    }

    fn set_tick_period(&self, period: Duration) {
        self.hit("set_tick_period");
        self.0.borrow_mut().tick_period = Some(period);
    }

    fn get_shared_data(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.hit("get_shared_data");
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
        self.hit("set_shared_data");
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
