//! A filter that kills its own VM on request: a request carrying `x-sluice-test-trap` makes it
//! execute `unreachable` in `on_http_request_headers`, which is what any trap (a panic with
//! `panic = "abort"`, an out-of-bounds access) looks like to Envoy. The lifecycle tests put it in
//! the chain beside sluice's plugins to see what each `failure_policy` does to the trapping request,
//! the ones after it and what the plugins in the same chain count. Every response it passes gets
//! `x-trap-filter: <VM id>` — a number the VM drew when it started — so a test can tell a reloaded
//! VM from the one that trapped.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MapType};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { vm: 0 }) });
}}

/// The request header that makes the filter trap.
const TRAP_HEADER: &str = "x-sluice-test-trap";

struct Root {
    vm: u64,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_vm_start(&mut self, _size: usize) -> bool {
        // The start time in nanoseconds tells two VMs of one process apart.
        self.vm = proxy_wasm::hostcalls::get_current_time().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos() as u64);
        true
    }
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream { vm: self.vm }))
    }
}

struct Stream {
    vm: u64,
}

impl Context for Stream {}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        if let Ok(Some(_)) = proxy_wasm::hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, TRAP_HEADER) {
            // The trap itself: a wasm `unreachable` instruction, not a Rust panic, so no panic
            // machinery runs first.
            #[cfg(target_arch = "wasm32")]
            core::arch::wasm32::unreachable();
        }
        Action::Continue
    }
    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        // Ignored on failure: a test filter has nothing to do about it.
        let _ = proxy_wasm::hostcalls::add_map_value(MapType::HttpResponseHeaders, "x-trap-filter", &self.vm.to_string());
        Action::Continue
    }
}
