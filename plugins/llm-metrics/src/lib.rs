//! sluice llm-metrics: a proxy-wasm HTTP filter that measures every LLM request passing through
//! Envoy — time to first content token, time per output token, decode tokens/s, duration, token
//! counts, cost — as Envoy metrics with bounded labels, plus a per-request access-log stamp.
//!
//! Every rule is in `sluice_core::flow::metrics`; this adapter reads what the host gives, calls the
//! flow and applies its effects. It never buffers a stream and never delays a request: every
//! callback returns `Continue`.

/// The configuration lives in core with the flow; re-exported under its old path.
pub use sluice_core::flow::metrics::config;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use sluice_core::flow::metrics::{MetricsFlow, MetricsPolicy};
use sluice_core::flow::Effects;
use sluice_proxy_host as host;
use std::cell::RefCell;
use std::rc::Rc;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    sluice_proxy_host::install_panic_hook("llm-metrics");
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

pub use sluice_core::contract::FIRST_TOKEN_PROPERTY;

/// Per-VM state shared by the root and every stream (a VM is single-threaded).
struct Shared {
    policy: MetricsPolicy,
    metrics: host::Metrics,
    effects: Effects,
}

#[derive(Default)]
struct Root {
    shared: Option<Rc<RefCell<Shared>>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let Some(bytes) = host::plugin_configuration() else { return false };
        match config::Settings::parse(&bytes) {
            Ok(settings) => {
                log::info!("sluice llm-metrics: configured ({} price entries)", settings.prices.len());
                let policy = MetricsPolicy::new(settings);
                self.shared = Some(Rc::new(RefCell::new(Shared { policy, metrics: host::Metrics::default(), effects: Effects::default() })));
                true
            }
            Err(e) => {
                log::error!("sluice llm-metrics: configuration refused: {e}");
                false
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream { shared: self.shared.clone(), flow: MetricsFlow::default() }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Stream {
    shared: Option<Rc<RefCell<Shared>>>,
    flow: MetricsFlow,
}

impl Stream {
    /// Calls the flow with the VM's policy and applies what it returns.
    fn with(&mut self, body_size: usize, event: impl FnOnce(&mut MetricsFlow, &mut MetricsPolicy, &mut Effects)) {
        let Some(shared) = self.shared.as_ref() else { return };
        let mut guard = shared.borrow_mut();
        let sh = &mut *guard;
        event(&mut self.flow, &mut sh.policy, &mut sh.effects);
        host::apply(&mut sh.effects, &mut sh.metrics, body_size);
    }
}

impl Context for Stream {}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let now = host::now_ns();
        self.with(0, |flow, policy, fx| flow.on_request_headers(policy, &mut host::LiveView, now, fx));
        Action::Continue
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.flow.is_measured() {
            self.with(0, |flow, policy, fx| flow.on_request_body(policy, &mut host::LiveView, body_size, end_of_stream, fx));
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if self.flow.is_measured() {
            let now = host::now_ns();
            self.with(0, |flow, policy, fx| flow.on_response_headers(policy, &mut host::LiveView, end_of_stream, now, fx));
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.flow.is_measured() {
            let now = host::now_ns();
            self.with(body_size, |flow, policy, fx| flow.on_response_body(policy, &mut host::LiveView, body_size, end_of_stream, now, fx));
        }
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.flow.is_measured() {
            let now = host::now_ns();
            self.with(0, |flow, policy, fx| flow.on_response_trailers(policy, &mut host::LiveView, now, fx));
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        if self.flow.is_measured() {
            let now = host::now_ns();
            self.with(0, |flow, policy, fx| flow.on_log(policy, &mut host::LiveView, now, fx));
        }
    }
}
