//! Every host call `fanout` makes, behind one trait: the seam between the core and Envoy.
//!
//! The glue implements it with proxy-wasm (`filter::ProxyHost`); the fake host (`testing`)
//! implements it in memory for the tests and `bench/hostcalls`. Nothing here knows
//! proxy-wasm. A method is one host call (or, for [`Host::request_headers`] and
//! [`Host::call_headers`], one call for the whole map), so that counting the calls of a
//! request is counting these.

use std::time::Duration;

use crate::answer::Answer;
use crate::call::Failure;
use crate::headers::HeaderMap;
use crate::metrics::Kind;

pub trait Host {
    /// Makes the `log` crate follow Envoy's log level for wasm.
    fn follow_log_level(&self);
    fn plugin_configuration(&self) -> Option<Vec<u8>>;
    /// All request headers at once, as the host serialized them: one host call.
    fn request_headers(&self) -> HeaderMap;
    fn request_body(&self, size: usize) -> Vec<u8>;
    /// Starts a call with these headers, their values as bytes (the ABI's type: a forwarded
    /// value goes on byte for byte); `Err` is how Envoy refused it (no callback will come): a
    /// `DispatchError`, or an `Overflow` when the cluster's circuit breaker is full.
    fn dispatch(
        &self,
        cluster: &str,
        headers: Vec<(&str, &[u8])>,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, Failure>;
    /// The same call, for the sync sender's stream `stream` it serves, if any: proxy-wasm
    /// makes it the current context's call (a retry sent from the root context's timer is
    /// the root's); a host without a root context makes it that stream's, so that its
    /// answer comes to the stream (`Err` if the stream is gone).
    fn dispatch_serving(
        &self,
        stream: Option<u32>,
        cluster: &str,
        headers: Vec<(&str, &[u8])>,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, Failure> {
        let _ = stream;
        self.dispatch(cluster, headers, body, timeout)
    }
    /// The same call made for another context of this VM (`context_id`: a root context, from
    /// a stream's callback): its answer is delivered to that context, and it lives as long as
    /// that context does.
    fn dispatch_for(
        &self,
        context_id: u32,
        cluster: &str,
        headers: Vec<(&str, &[u8])>,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, Failure>;
    /// `:status` of the call answer being delivered to `on_http_call_response`.
    fn call_status(&self) -> Option<u16>;
    /// Up to `max` bytes of that answer's body.
    fn call_body(&self, max: usize) -> Vec<u8>;
    /// One header of that answer.
    fn call_header(&self, name: &str) -> Option<String>;
    /// All headers of that answer.
    fn call_headers(&self) -> Vec<(String, Vec<u8>)>;
    /// One trailer of that answer (gRPC's `grpc-status`).
    fn call_trailer(&self, name: &str) -> Option<String>;
    /// Makes `context_id` the context the next host calls act for; false if it is gone.
    fn set_effective_context(&self, context_id: u32) -> bool;
    /// Answers the current stream locally.
    fn respond(&self, answer: &Answer);
    /// Milliseconds on the host's clock.
    fn now_ms(&self) -> u64;
    /// Nanoseconds on the host's clock: what seeds the jitter (two workers configured in the
    /// same millisecond still differ).
    fn now_nanos(&self) -> u64 {
        self.now_ms().saturating_mul(1_000_000)
    }
    /// Defines (or finds, by name) a metric; `None` if Envoy refused.
    fn define_metric(&self, kind: Kind, name: &str) -> Option<u32>;
    fn increment_metric(&self, id: u32, delta: i64);
    fn record_metric(&self, id: u32, value: u64);
    /// Sets the root context's timer.
    fn set_tick_period(&self, period: Duration);
    /// A key of Envoy's shared data (one store per VM id for the whole process, seen by
    /// every worker): its value and CAS, `(None, None)` if it does not exist.
    fn get_shared_data(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Writes a key of the shared data if its CAS is still `cas` (`None`: unconditionally;
    /// Envoy also writes a key that does not exist yet whatever `cas` says).
    fn set_shared_data(&self, key: &str, value: &[u8], cas: Option<u32>)
        -> Result<(), CasMismatch>;
}

/// A `set` whose CAS no longer matched: someone wrote the key since our `get`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CasMismatch;

/// A process-wide key-value store with compare-and-swap: Envoy's proxy-wasm shared data.
pub trait SharedStore {
    /// The value and its CAS; `(None, None)` when the key does not exist.
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Writes `value` if the key's CAS is still `cas` (`None`: unconditionally). As in Envoy,
    /// a key that does not exist is written whatever `cas` says.
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch>;
    /// Empties a key. (proxy-wasm has no delete: the key stays, with an empty value.)
    fn remove(&self, key: &str) {
        let _ = self.set(key, &[], None);
    }
}

/// Envoy's shared data, through the [`Host`], as `dedupe`'s store.
pub struct HostStore<'a, H>(pub &'a H);

impl<H: Host> SharedStore for HostStore<'_, H> {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.0.get_shared_data(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
        self.0.set_shared_data(key, value, cas)
    }
}
