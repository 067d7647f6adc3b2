//! sluice-playground: the policy playground's engine and its browser binding.
//!
//! - [`compile`]: a policy of tenant-budget, model-router or latency-guard through core's own parser,
//!   with the error (field path included) the plugin logs when Envoy hands it that policy.
//! - [`run`]: a small workload ([`workload`]: a synthetic load or a slice of a generic JSONL trace)
//!   through sluice-core's flows in the shipped gateways' order (`sluice_memory_host`), in virtual time
//!   ([`engine`]), returning per-request verdicts, per-tenant counts, breaker transitions and
//!   sampled series.
//! - `bind` (wasm32 only): the same two functions for JavaScript, JSON in and JSON out; `heap`: the
//!   page's allocator.
//!
//! Everything here is pure Rust over `sluice-core`; the page is `examples/playground/`, built by
//! `cargo xtask playground` (docs/playground.md).
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing))]

mod answer;
pub mod engine;
pub mod workload;

#[cfg(target_arch = "wasm32")]
mod bind;
// The page's allocator (the global one in the wasm32 build only; natively its tests drive it).
#[cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]
mod heap;

use serde::{Deserialize, Serialize};
use sluice_core::budget::Policy;
use sluice_core::latency::LatencyPolicy;
use sluice_core::routing::RoutingPolicy;

pub use engine::{Policies, RunOutput};
pub use workload::{Workload, WorkloadError};

/// The plugins whose decisions the playground runs. llm-metrics decides nothing (it measures), and
/// its configuration type lives in its proxy-wasm crate, so it is not here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Plugin {
    TenantBudget,
    ModelRouter,
    LatencyGuard,
}

impl Plugin {
    pub const ALL: [Plugin; 3] = [Plugin::LatencyGuard, Plugin::ModelRouter, Plugin::TenantBudget];

    /// `tenant-budget`, `model-router`, `latency-guard`.
    pub fn name(self) -> &'static str {
        match self {
            Plugin::TenantBudget => "tenant-budget",
            Plugin::ModelRouter => "model-router",
            Plugin::LatencyGuard => "latency-guard",
        }
    }

    /// From `tenant-budget` / `tenant_budget` (and the others alike).
    pub fn parse(name: &str) -> Option<Plugin> {
        Plugin::ALL.into_iter().find(|p| p.name() == name || p.name().replace('-', "_") == name)
    }
}

/// `items` stably sorted by `key`, through core's sort (one instance of the standard library's
/// sort for core and the page: each `sort_by_key` of another element type or closure carried its
/// own copy, ≈ 4 KB of the page each).
pub(crate) fn by_key<T>(items: Vec<T>, key: impl Fn(&T) -> u64) -> Vec<T> {
    sluice_core::sort::stable_by_key(items, key)
}

/// Why a run or a compile failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaygroundError {
    /// The plugin refuses its policy: `error` is core's message (field path first), `log` the line
    /// the plugin writes to Envoy's log when it refuses it.
    #[error("{log}")]
    Policy { plugin: Plugin, error: String, log: String },
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    #[error("playground input: {0}")]
    Input(String),
}

/// A policy accepted by its plugin's parser, with what the plugin logs at configure time.
#[derive(Debug)]
pub enum Compiled {
    TenantBudget(Box<Policy>),
    ModelRouter(RoutingPolicy),
    LatencyGuard(LatencyPolicy),
}

impl Compiled {
    /// The plugin's configure log line (the counts it reports).
    pub fn summary(&self) -> String {
        match self {
            Compiled::TenantBudget(p) => format!("tenant-budget configured: {} keys, {} budget counters", p.keys.len(), p.counters.len()),
            Compiled::ModelRouter(p) => {
                let versions: usize = p.models().iter().map(|m| m.versions.len()).sum();
                let shadows = p.models().iter().filter(|m| m.shadow.is_some()).count();
                format!("model-router configured: {} models, {versions} versions, {shadows} with a shadow", p.models().len())
            }
            Compiled::LatencyGuard(p) => format!(
                "sluice latency-guard: configured ({} classes, {} versions, {} with a breaker)",
                p.classes.len(),
                p.versions.len(),
                p.versions.iter().filter(|v| v.breaker.is_some()).count()
            ),
        }
    }
}

/// Compiles `policy` (the JSON Envoy would hand the plugin) with core's parser.
pub fn compile(plugin: Plugin, policy: &str) -> Result<Compiled, PlaygroundError> {
    let bytes = policy.as_bytes();
    let refused = |error: String, log: String| PlaygroundError::Policy { plugin, error, log };
    match plugin {
        Plugin::TenantBudget => Policy::from_json(bytes)
            .map(|p| Compiled::TenantBudget(Box::new(p)))
            .map_err(|e| refused(e.to_string(), format!("tenant-budget policy refused: {e}"))),
        Plugin::ModelRouter => {
            RoutingPolicy::from_json(bytes).map(Compiled::ModelRouter).map_err(|e| refused(e.to_string(), format!("model-router policy refused: {e}")))
        }
        Plugin::LatencyGuard => LatencyPolicy::from_json(bytes)
            .map(Compiled::LatencyGuard)
            .map_err(|e| refused(e.to_string(), format!("sluice latency-guard: configuration refused: {e}"))),
    }
}

/// What the page sends: each plugin's policy text (absent or empty: not in the chain), the workload,
/// and optionally a trace slice that replaces the workload's synthetic tenants.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunInput {
    #[serde(default)]
    pub latency_guard: Option<String>,
    #[serde(default)]
    pub model_router: Option<String>,
    #[serde(default)]
    pub tenant_budget: Option<String>,
    /// The workload's JSON text.
    pub workload: String,
    /// Generic JSONL lines; when non-empty, these are the requests.
    #[serde(default)]
    pub trace: Option<String>,
}

/// Compiles every policy given.
pub fn policies(input: &RunInput) -> Result<Policies, PlaygroundError> {
    let mut out = Policies::default();
    for (plugin, text) in
        [(Plugin::LatencyGuard, &input.latency_guard), (Plugin::ModelRouter, &input.model_router), (Plugin::TenantBudget, &input.tenant_budget)]
    {
        let Some(text) = text.as_deref().filter(|t| !t.trim().is_empty()) else { continue };
        match compile(plugin, text)? {
            Compiled::LatencyGuard(p) => out.latency_guard = Some(p),
            Compiled::ModelRouter(p) => out.model_router = Some(p),
            Compiled::TenantBudget(p) => out.tenant_budget = Some(*p),
        }
    }
    Ok(out)
}

/// The requests of `input`: the trace when one is given, else the workload's synthetic load.
pub fn requests(input: &RunInput, workload: &Workload) -> Result<Vec<workload::Request>, PlaygroundError> {
    match input.trace.as_deref().filter(|t| !t.trim().is_empty()) {
        Some(trace) => Ok(workload::read_generic_jsonl(trace)?),
        None => Ok(workload.synthetic()?),
    }
}

/// Compiles the policies, reads the workload and runs it.
pub fn run(input: &RunInput) -> Result<RunOutput, PlaygroundError> {
    let policies = policies(input)?;
    let workload = Workload::from_json(&input.workload)?;
    let requests = requests(input, &workload)?;
    Ok(engine::Engine::new(policies, &workload).run(requests))
}

/// [`run`] with JSON text in and out, as the page calls it: `{"ok": true, "result": …}` or
/// `{"ok": false, "error": …, "plugin": …, "log": …}`.
pub fn run_json(input: &str) -> String {
    // From the bytes, as every other JSON the page reads: one reader type less in its .wasm.
    let parsed: Result<RunInput, PlaygroundError> = serde_json::from_slice(input.as_bytes()).map_err(|e| PlaygroundError::Input(e.to_string()));
    match parsed.and_then(|i| run(&i)) {
        Ok(out) => answer(&RunAnswer { ok: true, result: &out }),
        Err(e) => error_json(&e),
    }
}

/// [`compile`] with JSON text out: `{"ok": true, "summary": …}` or the error as [`run_json`] gives it.
pub fn compile_json(plugin: &str, policy: &str) -> String {
    let Some(p) = Plugin::parse(plugin) else {
        return error_json(&PlaygroundError::Input(format!("unknown plugin {plugin:?}: tenant-budget, model-router or latency-guard")));
    };
    match compile(p, policy) {
        Ok(c) => answer(&Summary { ok: true, plugin: p.name(), summary: &c.summary() }),
        Err(e) => error_json(&e),
    }
}

// The answers' objects, written straight to text (not through a `serde_json::Value`: the page then
// carries no serializer into `Value`). Their fields are in key order, as `json!` gave them.
#[derive(Serialize)]
struct RunAnswer<'a> {
    ok: bool,
    result: &'a RunOutput,
}

#[derive(Serialize)]
struct Summary<'a> {
    ok: bool,
    plugin: &'static str,
    summary: &'a str,
}

#[derive(Serialize)]
struct Refused<'a> {
    error: &'a str,
    log: &'a str,
    ok: bool,
    plugin: Option<&'static str>,
}

fn answer(a: &impl Serialize) -> String {
    serde_json::to_string(a).unwrap_or_default()
}

fn error_json(e: &PlaygroundError) -> String {
    match e {
        PlaygroundError::Policy { plugin, error, log } => answer(&Refused { error, log, ok: false, plugin: Some(plugin.name()) }),
        other => {
            let text = other.to_string();
            answer(&Refused { error: &text, log: &text, ok: false, plugin: None })
        }
    }
}
