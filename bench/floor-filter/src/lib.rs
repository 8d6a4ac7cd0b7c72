//! The floor of a wasm fan-out, for `make bench`: what any proxy-wasm filter must do to send
//! one request to N subscribers and answer it, and nothing else (no routing, admission,
//! report, metrics or retries).
//!
//! Plugin configuration: the subscriber clusters, separated by white space (N = how many;
//! none: answer 202 at once), and optionally `+clock` and `+headers`, which add the two host
//! calls fanout makes at N = 0 that the floor does not need (so `make bench` can tell their
//! cost from the cost of fanout's own code).
//!
//! Per request: in the headers callback, read the request headers if N > 0 or `+headers` (one
//! `get_map`; kept: the ones fanout forwards by default that the benchmark's request has,
//! `content-type`, `x-request-id`, `ce-*`) and the clock if `+clock`, then pause. At the end
//! of the body read it (one `get_buffer`) and send each cluster a POST with the body and those
//! headers; read each answer's `:status` (one `get_map_value`); when every call is back,
//! answer 202, or 500 if one was refused or not 2xx. Host errors are failures, never panics.

use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, MapType};

/// The same per-call timeout the benchmark gives fanout.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Default)]
struct Plan {
    clusters: Vec<String>,
    read_clock: bool,
    read_headers: bool,
}

#[derive(Default)]
struct FloorRoot {
    plan: Rc<Plan>,
}

impl Context for FloorRoot {}

impl RootContext for FloorRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let config = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        let mut plan = Plan::default();
        for word in String::from_utf8_lossy(&config).split_whitespace() {
            match word {
                "+clock" => plan.read_clock = true,
                "+headers" => plan.read_headers = true,
                cluster => plan.clusters.push(cluster.to_string()),
            }
        }
        self.plan = Rc::new(plan);
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(FloorStream {
            plan: self.plan.clone(),
            forwarded: Vec::new(),
            pending: 0,
            failed: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct FloorStream {
    plan: Rc<Plan>,
    /// The request headers every call carries.
    forwarded: Vec<(String, String)>,
    /// Calls not back yet.
    pending: usize,
    /// Some call was refused or answered other than 2xx.
    failed: bool,
}

fn forwarded(name: &str) -> bool {
    name == "content-type" || name == "x-request-id" || name.starts_with("ce-")
}

impl FloorStream {
    fn fan_out(&mut self, body_size: usize) {
        let body = if body_size > 0 {
            hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size)
                .ok()
                .flatten()
        } else {
            None
        };
        let plan = self.plan.clone();
        for cluster in &plan.clusters {
            let mut headers = vec![
                (":method", "POST"),
                (":path", "/"),
                (":authority", cluster.as_str()),
            ];
            headers.extend(self.forwarded.iter().map(|(n, v)| (n.as_str(), v.as_str())));
            match hostcalls::dispatch_http_call(
                cluster,
                headers,
                body.as_deref(),
                Vec::new(),
                CALL_TIMEOUT,
            ) {
                Ok(_) => self.pending += 1,
                Err(_) => self.failed = true,
            }
        }
        self.answer_if_done();
    }

    fn answer_if_done(&self) {
        if self.pending == 0 {
            let status = if self.failed { 500 } else { 202 };
            let _ = hostcalls::send_http_response(status, Vec::new(), None);
        }
    }
}

impl Context for FloorStream {
    fn on_http_call_response(
        &mut self,
        _token: u32,
        _headers: usize,
        _body: usize,
        _trailers: usize,
    ) {
        let status = hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status")
            .ok()
            .flatten();
        self.failed |= !status.is_some_and(|s| s.len() == 3 && s[0] == b'2');
        self.pending = self.pending.saturating_sub(1);
        self.answer_if_done();
    }
}

impl HttpContext for FloorStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if self.plan.read_clock {
            let _ = hostcalls::get_current_time();
        }
        if self.plan.read_headers || !self.plan.clusters.is_empty() {
            let headers = hostcalls::get_map_bytes(MapType::HttpRequestHeaders).unwrap_or_default();
            self.forwarded = headers
                .into_iter()
                .filter(|(name, _)| forwarded(name))
                .filter_map(|(name, value)| Some((name, String::from_utf8(value).ok()?)))
                .collect();
        }
        if end_of_stream {
            self.fan_out(0);
        }
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if end_of_stream {
            self.fan_out(body_size);
        }
        Action::Pause
    }
}

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| Box::<FloorRoot>::default());
}}
