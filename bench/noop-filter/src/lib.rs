//! The floor of a proxy-wasm filter: a root context that creates one http context per
//! request, and http contexts whose callbacks all return `Continue` (the SDK defaults).

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;

struct NoopRoot;
struct NoopStream;

impl Context for NoopRoot {}
impl RootContext for NoopRoot {
    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(NoopStream))
    }
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

impl Context for NoopStream {}
impl HttpContext for NoopStream {}

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| Box::new(NoopRoot));
}}
