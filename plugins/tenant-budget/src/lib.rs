//! sluice tenant-budget: a proxy-wasm HTTP filter that decides, before a request reaches the model,
//! whether its key (and the key's team and org) may spend, reserves the worst case, and settles
//! exactly what was spent when the response ends — or is cut short.
//!
//! It is the sluice engine (`sluice-engine`) built with one section, configured with tenant-budget's
//! policy unwrapped; every rule is in `sluice_core::flow::budget` (docs/tenant-budget.md).

proxy_wasm::main! {{
    sluice_engine::start_tenant_budget();
}}
