//! The sluice engine: the policies' core flows (`sluice_core::flow`) run by one proxy-wasm module.
//! Each section's adapter (`guard`, `router`, `budget`, `metrics`) only reads what the host gives, calls its
//! flow and applies the effects; nothing here decides anything.
//!
//! Builds: `sluice.wasm` (crate `sluice`, configured with one section per policy,
//! [`start_sections`]) and the single-policy filters kept for existing deployments
//! (`sluice_llm_metrics.wasm`, `sluice_latency_guard.wasm`, `sluice_model_router.wasm`,
//! `sluice_tenant_budget.wasm`: the same
//! engine configured with the policy unwrapped). Every instance of `sluice.wasm` that has the same
//! `vm_id` runs in one VM per worker, whatever its section (docs/architecture.md).

// The allocator is only installed in the wasm build; natively its tests drive it.
#[cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]
mod blocks;
mod budget;
mod composite;
pub mod config;
mod guard;
mod metrics;
mod router;

use config::{Policy, SectionKind};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};
use sluice_proxy_host as host;
use std::time::Duration;

#[cfg(target_arch = "wasm32")]
#[global_allocator]
static ALLOCATOR: blocks::Blocks = blocks::Blocks::new();

/// How a build reads its configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// One section per policy (`sluice.wasm`).
    Sections,
    /// One policy's configuration alone, unwrapped (the single-policy builds).
    Only(SectionKind),
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Sections => "sluice",
            Shape::Only(kind) => kind.policy_name(),
        }
    }
}

macro_rules! entry_point {
    ($(#[$doc:meta])* $name:ident, $shape:expr) => {
        $(#[$doc])*
        pub fn $name() {
            proxy_wasm::set_log_level(LogLevel::Info);
            host::install_panic_hook($shape.name());
            proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { shape: $shape, sections: Vec::new(), tick_floor: None }) });
        }
    };
}

entry_point!(
    /// `sluice.wasm`: call from `proxy_wasm::main!`.
    start_sections,
    Shape::Sections
);
entry_point!(
    /// `sluice_llm_metrics.wasm`: call from `proxy_wasm::main!`.
    start_llm_metrics,
    Shape::Only(SectionKind::LlmMetrics)
);
entry_point!(
    /// `sluice_latency_guard.wasm`: call from `proxy_wasm::main!`.
    start_latency_guard,
    Shape::Only(SectionKind::LatencyGuard)
);
entry_point!(
    /// `sluice_model_router.wasm`: call from `proxy_wasm::main!`.
    start_model_router,
    Shape::Only(SectionKind::ModelRouter)
);
entry_point!(
    /// `sluice_tenant_budget.wasm`: call from `proxy_wasm::main!`.
    start_tenant_budget,
    Shape::Only(SectionKind::TenantBudget)
);

/// The filter instance's root: parses the configuration once, then hands every root event to the
/// configured sections' roots, in pipeline order.
struct Root {
    shape: Shape,
    sections: Vec<Box<dyn RootContext>>,
    /// The tick some section always needs, while the instance runs several ([`composite`]).
    tick_floor: Option<Duration>,
}

impl Root {
    /// Runs `event` on every section's root, with the instance's tick floor in force.
    fn each(&mut self, mut event: impl FnMut(&mut dyn RootContext)) {
        host::composite::set_tick_floor(self.tick_floor);
        for section in &mut self.sections {
            event(section.as_mut());
        }
        host::composite::set_tick_floor(None);
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, headers: usize, body_size: usize, trailers: usize) {
        // Each section ignores the tokens it did not dispatch.
        self.each(|section| section.on_http_call_response(token, headers, body_size, trailers));
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let Some(bytes) = host::plugin_configuration() else { return false };
        let parsed = match self.shape {
            Shape::Sections => config::parse_sections(&bytes),
            Shape::Only(kind) => config::parse_only(kind, &bytes).map(|policy| vec![policy]),
        };
        let policies = match parsed {
            Ok(policies) => policies,
            Err(e) => {
                match (self.shape, &e) {
                    // Worded by the policy itself, naming its section.
                    (Shape::Sections, config::ConfigError::Section { .. }) => log::error!("{e}"),
                    (Shape::Sections, _) => log::error!("sluice: configuration refused: {e}"),
                    (Shape::Only(kind), _) => log::error!("{}: {e}", kind.refusal()),
                }
                return false;
            }
        };
        let mut sections: Vec<Box<dyn RootContext>> = Vec::with_capacity(policies.len());
        let mut tick_floor = None;
        for policy in policies {
            let section: Option<Box<dyn RootContext>> = match policy {
                Policy::LatencyGuard(p) => guard::Root::configure(*p).map(|r| Box::new(r) as Box<dyn RootContext>),
                Policy::ModelRouter(p) => Some(Box::new(router::Root::configure(*p))),
                Policy::TenantBudget(p) => budget::Root::configure(*p).map(|r| {
                    if r.needs_tick() {
                        tick_floor = Some(Duration::from_millis(sluice_core::flow::budget::SETTLE_TICK_MS));
                    }
                    Box::new(r) as Box<dyn RootContext>
                }),
                Policy::LlmMetrics(p) => Some(Box::new(metrics::Root::configure(*p))),
            };
            let Some(section) = section else { return false };
            sections.push(section);
        }
        // One section sets its own tick as it always has; several share the instance's.
        self.tick_floor = if sections.len() > 1 { tick_floor } else { None };
        self.sections = sections;
        true
    }

    fn on_tick(&mut self) {
        self.each(|section| section.on_tick());
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        self.each(|section| section.on_queue_ready(queue_id));
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // One section too runs in a composite: it lends the stream's slot (the body read once, the
        // shared response observer) for every callback.
        let children: Vec<Box<dyn HttpContext>> = self.sections.iter().filter_map(|s| s.create_http_context(context_id)).collect();
        if children.is_empty() {
            return None;
        }
        Some(Box::new(composite::Composite::new(children, self.tick_floor, context_id)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
