//! The shipped gateways started the way `cargo xtask up` starts them, with plugin configurations of
//! the test's choosing, in front of mock model servers: `envoy/templates/gateway.yaml` (llm-metrics),
//! `envoy/templates/budget-gateway.yaml` (tenant-budget, then llm-metrics) and `envoy/templates/full-gateway.yaml`
//! (latency-guard, model-router, tenant-budget, llm-metrics).

use crate::tools::workspace_root;
use crate::{Envoy, MockServer};
use anyhow::{Context, Result};
use sluice_envoy_render::GATEWAYS;

/// The plugin configuration is JSON inside a double-quoted YAML string: escape what YAML would read
/// (the rules are `sluice_envoy_render`'s, shared with `cargo xtask render`).
pub use sluice_envoy_render::yaml_string_body;

/// Path of a file shipped in the repository.
pub fn shipped(relative: &str) -> String {
    workspace_root().join(relative).display().to_string()
}

/// The demo plugin configuration, `policies/llm-metrics.demo.json`.
pub fn demo_plugin_config() -> Result<String> {
    let path = shipped("policies/llm-metrics.demo.json");
    std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))
}

/// Starts `envoy/templates/gateway.yaml` with `plugin_config` in front of `mock`.
pub fn start_gateway(mock: &MockServer, plugin_config: &str) -> Result<Envoy> {
    let upstream = mock.port().to_string();
    let config = yaml_string_body(plugin_config);
    Envoy::start(&shipped("envoy/templates/gateway.yaml"), &[("UPSTREAM_PORT", upstream.as_str()), ("PLUGIN_CONFIG", config.as_str())])
}

/// The tenant-budget policy the end-to-end tests use, `policies/tenant-budget.e2e.json`.
pub fn budget_e2e_policy() -> Result<String> {
    let path = shipped("policies/tenant-budget.e2e.json");
    std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))
}

/// Starts `envoy/templates/budget-gateway.yaml` in front of `mock`, with `budget_config` (tenant-budget's
/// policy JSON) and `metrics_config` (llm-metrics' configuration).
pub fn start_budget_gateway(mock: &MockServer, budget_config: &str, metrics_config: &str) -> Result<Envoy> {
    start_budget_gateway_with(mock, budget_config, metrics_config, &[])
}

/// [`start_budget_gateway`] with more placeholder values (e.g. `("WASM_DIR", dir)`), which take
/// precedence over the defaults.
pub fn start_budget_gateway_with(mock: &MockServer, budget_config: &str, metrics_config: &str, substitutions: &[(&str, &str)]) -> Result<Envoy> {
    let upstream = mock.port().to_string();
    let budget = yaml_string_body(budget_config);
    let metrics = yaml_string_body(metrics_config);
    let mut vars = vec![("UPSTREAM_PORT", upstream.as_str()), ("BUDGET_CONFIG", budget.as_str()), ("PLUGIN_CONFIG", metrics.as_str())];
    vars.extend_from_slice(substitutions);
    Envoy::start(&shipped("envoy/templates/budget-gateway.yaml"), &vars)
}

/// The full gateway running: its three upstreams and Envoy (dropped in reverse order: Envoy first).
pub struct FullGateway {
    pub envoy: Envoy,
    /// Cluster `model_v1` (`x-mock-served-by: llama-v1`).
    pub v1: MockServer,
    /// Cluster `model_v2` (`llama-v2`).
    pub v2: MockServer,
    /// Cluster `qwen_v1`, model-router's shadow target (`qwen-v1`).
    pub shadow: MockServer,
}

/// The example policy `envoy/templates/full-gateway.yaml` is rendered with for `placeholder`
/// (`LATENCY_CONFIG`, `ROUTER_CONFIG`, `BUDGET_CONFIG`, `PLUGIN_CONFIG`).
pub fn full_gateway_policy(placeholder: &str) -> Result<String> {
    let file = GATEWAYS
        .iter()
        .find(|g| g.name == "full-gateway")
        .and_then(|g| g.policies.iter().find(|(p, _)| *p == placeholder))
        .map(|(_, file)| *file)
        .with_context(|| format!("the full gateway has no policy {placeholder}"))?;
    let path = shipped(&format!("policies/{file}"));
    std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))
}

/// Starts `envoy/templates/full-gateway.yaml` in front of three mocks started with `mock_args` (plus their
/// `--served-by`), with the example policies of `cargo xtask render` except those `policies`
/// replace (placeholder, JSON).
pub fn start_full_gateway(mock_args: &[&str], policies: &[(&str, &str)]) -> Result<FullGateway> {
    start_full_gateway_with(mock_args, policies, &[])
}

/// [`start_full_gateway`] with more placeholder values (e.g. `TRACING`), which take precedence.
pub fn start_full_gateway_with(mock_args: &[&str], policies: &[(&str, &str)], substitutions: &[(&str, &str)]) -> Result<FullGateway> {
    let mock = |served_by: &str| {
        let mut args = vec!["--served-by", served_by];
        args.extend_from_slice(mock_args);
        MockServer::start(&args)
    };
    let (v1, v2, shadow) = (mock("llama-v1")?, mock("llama-v2")?, mock("qwen-v1")?);
    let ports = [v1.port().to_string(), v2.port().to_string(), shadow.port().to_string()];
    let mut configs = Vec::new();
    for placeholder in ["LATENCY_CONFIG", "ROUTER_CONFIG", "BUDGET_CONFIG", "PLUGIN_CONFIG"] {
        let json = match policies.iter().find(|(p, _)| *p == placeholder) {
            Some((_, json)) => (*json).to_string(),
            None => full_gateway_policy(placeholder)?,
        };
        configs.push((placeholder, yaml_string_body(&json)));
    }
    let mut vars: Vec<(&str, &str)> = vec![("UPSTREAM_PORT", ports[0].as_str()), ("UPSTREAM_PORT_V2", ports[1].as_str()), ("SHADOW_PORT", ports[2].as_str())];
    vars.extend(configs.iter().map(|(p, c)| (*p, c.as_str())));
    vars.extend_from_slice(substitutions);
    let envoy = Envoy::start(&shipped("envoy/templates/full-gateway.yaml"), &vars)?;
    Ok(FullGateway { envoy, v1, v2, shadow })
}
