//! The sluice engine: the policies' core flows (`sluice_core::flow`) composed in one proxy-wasm
//! filter. A stream's events go through the flows in the fixed order — latency guard → router →
//! budget → metrics on the request, reversed on the response — each flow reading through one
//! [`View`](sluice_core::flow::View) and pushing effects this adapter applies; nothing here decides
//! anything.
//!
//! Builds: `sluice.wasm` (crate `sluice`, every section, [`start_sections`]) and the single-policy
//! filters kept for existing deployments (`sluice_llm_metrics.wasm`, [`start_llm_metrics`]: the
//! same engine with its one section, configured unwrapped).

pub mod config;

use config::Sections;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use sluice_core::flow::metrics::MetricsFlow;
use sluice_core::flow::Effects;
use sluice_proxy_host as host;
use std::cell::RefCell;
use std::rc::Rc;

/// How a build reads its configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// One section per policy (`sluice.wasm`).
    Sections,
    /// llm-metrics' configuration alone, unwrapped (`sluice_llm_metrics.wasm`).
    LlmMetrics,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Sections => "sluice",
            Shape::LlmMetrics => "llm-metrics",
        }
    }
}

/// The entry point of `sluice.wasm`: call from `proxy_wasm::main!`.
pub fn start_sections() {
    start(Shape::Sections);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::new(Shape::Sections)) });
}

/// The entry point of `sluice_llm_metrics.wasm`: call from `proxy_wasm::main!`.
pub fn start_llm_metrics() {
    start(Shape::LlmMetrics);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::new(Shape::LlmMetrics)) });
}

fn start(shape: Shape) {
    proxy_wasm::set_log_level(LogLevel::Info);
    host::install_panic_hook(shape.name());
}

/// Per-VM state shared by the root and every stream (a VM is single-threaded).
struct Shared {
    sections: Sections,
    metrics: host::Metrics,
    /// Reused by every event, so the hot path allocates no effect list.
    effects: Effects,
}

struct Root {
    shape: Shape,
    shared: Option<Rc<RefCell<Shared>>>,
}

impl Root {
    fn new(shape: Shape) -> Root {
        Root { shape, shared: None }
    }
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let Some(bytes) = host::plugin_configuration() else { return false };
        let parsed = match self.shape {
            Shape::Sections => Sections::parse(&bytes),
            Shape::LlmMetrics => Sections::llm_metrics_only(&bytes),
        };
        let name = self.shape.name();
        match parsed {
            Ok(sections) => {
                log::info!("sluice {name}: configured: {}", sections.describe());
                self.shared = Some(Rc::new(RefCell::new(Shared { sections, metrics: host::Metrics::default(), effects: Effects::default() })));
                true
            }
            Err(e) => {
                log::error!("sluice {name}: configuration refused: {e}");
                false
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let shared = self.shared.clone()?;
        let metrics = shared.borrow().sections.llm_metrics.as_ref().map(|_| MetricsFlow::default());
        Some(Box::new(Stream { shared, metrics }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// One HTTP stream: the flow of each configured policy.
struct Stream {
    shared: Rc<RefCell<Shared>>,
    metrics: Option<MetricsFlow>,
}

impl Context for Stream {}

/// Runs `event` on the metrics flow when its section is configured and, for every event after
/// the first, when the request is measured; then applies the effects.
macro_rules! metrics_event {
    ($self:ident, $body_size:expr, $first:expr, |$flow:ident, $policy:ident, $fx:ident| $call:expr) => {{
        let mut guard = $self.shared.borrow_mut();
        let sh = &mut *guard;
        if let (Some($flow), Some($policy)) = ($self.metrics.as_mut(), sh.sections.llm_metrics.as_mut()) {
            if $first || $flow.is_measured() {
                let $fx = &mut sh.effects;
                $call;
            }
        }
        if !sh.effects.is_empty() {
            host::apply(&mut sh.effects, &mut sh.metrics, $body_size);
        }
    }};
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let now = host::now_ns();
        metrics_event!(self, 0, true, |flow, policy, fx| flow.on_request_headers(policy, &mut host::LiveView, now, fx));
        Action::Continue
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        metrics_event!(self, 0, false, |flow, policy, fx| flow.on_request_body(policy, &mut host::LiveView, body_size, end_of_stream, fx));
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        metrics_event!(self, 0, false, |flow, policy, fx| flow.on_response_headers(policy, &mut host::LiveView, end_of_stream, fx));
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        metrics_event!(self, body_size, false, |flow, policy, fx| flow.on_response_body(
            policy,
            &mut host::LiveView,
            body_size,
            end_of_stream,
            host::now_ns(),
            fx
        ));
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        metrics_event!(self, 0, false, |flow, policy, fx| flow.on_response_trailers(policy, &mut host::LiveView, host::now_ns(), fx));
        Action::Continue
    }

    fn on_log(&mut self) {
        metrics_event!(self, 0, false, |flow, policy, fx| flow.on_log(policy, &mut host::LiveView, fx));
    }
}
