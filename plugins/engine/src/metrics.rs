//! llm-metrics' section: the proxy-wasm side of `sluice_core::flow::metrics` — read, call the
//! flow, apply its effects. Every callback continues: measurement never delays a request.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};
use sluice_core::flow::metrics::{MetricsFlow, MetricsPolicy};
use sluice_core::flow::Effects;
use sluice_proxy_host as host;
use std::cell::RefCell;
use std::rc::Rc;

/// Per-VM state of the section, shared by every stream (a VM is single-threaded).
struct Shared {
    policy: MetricsPolicy,
    metrics: host::Metrics,
    /// Reused by every event, so the hot path allocates no effect list.
    effects: Effects,
}

pub struct Root {
    shared: Rc<RefCell<Shared>>,
}

impl Root {
    pub fn configure(policy: MetricsPolicy) -> Root {
        log::info!("sluice llm-metrics: configured ({} price entries)", policy.settings.prices.len());
        Root { shared: Rc::new(RefCell::new(Shared { policy, metrics: host::Metrics::default(), effects: Effects::default() })) }
    }
}

impl Context for Root {}

impl RootContext for Root {
    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream { shared: self.shared.clone(), flow: MetricsFlow::default() }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Stream {
    shared: Rc<RefCell<Shared>>,
    flow: MetricsFlow,
}

impl Stream {
    /// Calls the flow with the section's policy and applies what it returns.
    fn with(&mut self, body_size: usize, event: impl FnOnce(&mut MetricsFlow, &mut MetricsPolicy, &mut Effects)) {
        let mut guard = self.shared.borrow_mut();
        let sh = &mut *guard;
        event(&mut self.flow, &mut sh.policy, &mut sh.effects);
        if !sh.effects.is_empty() {
            host::apply(&mut sh.effects, &mut sh.metrics, body_size);
        }
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
            self.with(0, |flow, policy, fx| flow.on_response_headers(policy, &mut host::LiveView, end_of_stream, fx));
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
            self.with(0, |flow, policy, fx| flow.on_log(policy, &mut host::LiveView, fx));
        }
    }
}
