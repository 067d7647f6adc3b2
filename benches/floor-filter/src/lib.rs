//! The cheapest useful wasm filter: one response header per request. `benches/envoy_load.py` runs
//! it beside sluice so every figure sits next to what merely being a wasm filter costs (the VM
//! crossing per callback), not next to zero.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Floor) });
}}

struct Floor;

impl Context for Floor {}

impl RootContext for Floor {
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Floor))
    }
}

impl HttpContext for Floor {
    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        // The hostcall's result is ignored on purpose: a bench filter has nothing to do on failure.
        let _ = proxy_wasm::hostcalls::add_map_value(proxy_wasm::types::MapType::HttpResponseHeaders, "x-floor", "1");
        Action::Continue
    }
}
