//! The shipped gateway (`envoy/gateway.yaml`) started the way `cargo xtask up` starts it, with a
//! plugin configuration of the test's choosing, in front of a mock model server.

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
