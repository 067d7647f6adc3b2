//! The shipped gateways started the way `cargo xtask up` starts them, with plugin configurations of
//! the test's choosing, in front of a mock model server: `envoy/gateway.yaml` (llm-metrics) and
//! `envoy/budget-gateway.yaml` (tenant-budget, then llm-metrics).

use crate::tools::workspace_root;
use crate::{Envoy, MockServer};
use anyhow::{Context, Result};

/// The plugin configuration is JSON inside a double-quoted YAML string: escape what YAML would read.
pub fn yaml_string_body(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' | '\r' => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// Path of a file shipped in the repository.
pub fn shipped(relative: &str) -> String {
    workspace_root().join(relative).display().to_string()
}

/// The demo plugin configuration, `policies/llm-metrics.demo.json`.
pub fn demo_plugin_config() -> Result<String> {
    let path = shipped("policies/llm-metrics.demo.json");
    std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))
}

/// Starts `envoy/gateway.yaml` with `plugin_config` in front of `mock`.
pub fn start_gateway(mock: &MockServer, plugin_config: &str) -> Result<Envoy> {
    let upstream = mock.port().to_string();
    let config = yaml_string_body(plugin_config);
    Envoy::start(
        &shipped("envoy/gateway.yaml"),
        &[("UPSTREAM_PORT", upstream.as_str()), ("PLUGIN_CONFIG", config.as_str())],
    )
}

/// The tenant-budget policy the end-to-end tests use, `policies/tenant-budget.e2e.json`.
pub fn budget_e2e_policy() -> Result<String> {
    let path = shipped("policies/tenant-budget.e2e.json");
    std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))
}

/// Starts `envoy/budget-gateway.yaml` in front of `mock`, with `budget_config` (tenant-budget's
/// policy JSON) and `metrics_config` (llm-metrics' configuration).
pub fn start_budget_gateway(mock: &MockServer, budget_config: &str, metrics_config: &str) -> Result<Envoy> {
    start_budget_gateway_with(mock, budget_config, metrics_config, &[])
}

/// [`start_budget_gateway`] with more placeholder values (e.g. `("WASM_DIR", dir)`), which take
/// precedence over the defaults.
pub fn start_budget_gateway_with(
    mock: &MockServer,
    budget_config: &str,
    metrics_config: &str,
    substitutions: &[(&str, &str)],
) -> Result<Envoy> {
    let upstream = mock.port().to_string();
    let budget = yaml_string_body(budget_config);
    let metrics = yaml_string_body(metrics_config);
    let mut vars = vec![
        ("UPSTREAM_PORT", upstream.as_str()),
        ("BUDGET_CONFIG", budget.as_str()),
        ("PLUGIN_CONFIG", metrics.as_str()),
    ];
    vars.extend_from_slice(substitutions);
    Envoy::start(&shipped("envoy/budget-gateway.yaml"), &vars)
}
