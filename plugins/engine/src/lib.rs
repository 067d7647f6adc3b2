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
mod metrics;

use config::Sections;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};
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

/// The configured policy of one filter instance. Each instance runs one section today; instances
/// of `sluice.wasm` with the same `vm_id` share one VM per worker (docs/architecture.md).
enum Section {
    Metrics(Rc<RefCell<metrics::Shared>>),
}

struct Root {
    shape: Shape,
    section: Option<Section>,
}

impl Root {
    fn new(shape: Shape) -> Root {
        Root { shape, section: None }
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
        let section = match parsed {
            Ok(Sections { llm_metrics: Some(policy) }) => Section::Metrics(metrics::Shared::new(policy)),
            Ok(Sections { llm_metrics: None }) => {
                log::error!("sluice {name}: configuration refused: no policy section");
                return false;
            }
            Err(e) => {
                log::error!("sluice {name}: configuration refused: {e}");
                return false;
            }
        };
        let described = match &section {
            Section::Metrics(sh) => sh.borrow().describe(),
        };
        log::info!("sluice {name}: configured: {described}");
        self.section = Some(section);
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        match self.section.as_ref()? {
            Section::Metrics(sh) => Some(Box::new(metrics::Stream::new(sh.clone()))),
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
