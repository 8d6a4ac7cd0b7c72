//! The only part of `fanout` that touches proxy-wasm: Envoy's root context and http context.
//! Each callback is forwarded, as it comes, to the core's [`Plugin`] (the root context's job)
//! or [`Stream`] (one request's), which decide and perform everything through the [`Host`]
//! trait; [`ProxyHost`] is that trait done with proxy-wasm's host calls.
//!
//! [`Host`]: crate::host::Host

pub mod host;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};

use crate::plugin::{Plugin, VmShared};
use crate::stream::{Flow, Stream};
pub use host::ProxyHost;

/// The root context: one per plugin configuration.
pub struct FanoutRoot(Plugin<ProxyHost>);

impl FanoutRoot {
    /// A root context of this VM: it shares the VM's deliveries and counts with the root
    /// contexts a configuration update starts beside it.
    pub fn new(context_id: u32) -> Self {
        FanoutRoot(Plugin::with_shared(
            context_id,
            ProxyHost,
            VmShared::of_this_vm(),
        ))
    }
}

impl Context for FanoutRoot {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        num_trailers: usize,
    ) {
        host::call_answer_has(num_trailers);
        self.0.on_call_response(token_id, num_headers, body_size);
        self.done_if_retired();
    }

    fn on_done(&mut self) -> bool {
        self.0.on_done()
    }
}

impl FanoutRoot {
    /// A retired root whose last call was answered: Envoy may delete it now (once; it
    /// answered `false` to `on_done`, so Envoy holds it until this).
    fn done_if_retired(&mut self) {
        if self.0.take_retired() {
            if let Err(status) = host::root_done() {
                log::warn!("Envoy refused proxy_done for a retired plugin: {status:?}");
            }
        }
    }
}

impl RootContext for FanoutRoot {
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        self.0.on_vm_start()
    }

    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        self.0.on_configure()
    }

    fn on_tick(&mut self) {
        self.0.on_tick();
        self.done_if_retired();
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(FanoutStream(self.0.create_stream(context_id))))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// The http context: one per request.
pub struct FanoutStream(Stream<ProxyHost>);

impl Context for FanoutStream {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        num_trailers: usize,
    ) {
        host::call_answer_has(num_trailers);
        self.0.on_call_response(token_id, num_headers, body_size);
    }

    fn on_done(&mut self) -> bool {
        self.0.on_done()
    }
}

impl HttpContext for FanoutStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        action(self.0.on_request_headers(end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        action(self.0.on_request_body(body_size, end_of_stream))
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        action(self.0.on_request_trailers())
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        action(self.0.on_response_headers())
    }
}

fn action(flow: Flow) -> Action {
    match flow {
        Flow::Continue => Action::Continue,
        Flow::Pause => Action::Pause,
    }
}
