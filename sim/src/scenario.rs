//! The scenario file: which plugins run with which policies, who sends what when the trace does not
//! say, and how each model version serves. JSON, every field checked (`deny_unknown_fields`), errors
//! with their field path. docs/simulator.md is the reference.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;
use sluice_workload::traffic::{
    default_model, default_output_tokens, default_sample_every_ms, default_stream, default_tenant_header, default_users_per_tenant,
};
use sluice_workload::upstream::{check_incident, check_upstream};

/// The service model of an upstream and its incidents: the workload model the playground shares.
pub use sluice_workload::upstream::{Incident, Upstream};

/// Why a scenario cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error("cannot read scenario {path}: {error}")]
    Read { path: PathBuf, error: std::io::Error },
    #[error("scenario {path}, field `{field}`: {message}")]
    Invalid { path: PathBuf, field: String, message: String },
    #[error("scenario {path}: cannot read policy {policy}: {error}")]
    Policy { path: PathBuf, policy: PathBuf, error: std::io::Error },
}

/// A parsed, checked scenario. Policies are loaded (their text is what the plugins get).
#[derive(Debug, Clone)]
pub struct Scenario {
    pub name: String,
    pub seed: u64,
    /// Arrival offsets are multiplied by this: 0.5 replays twice as fast, 2 half as fast.
    pub time_scale: f64,
    /// Each enabled plugin's policy text, in filter order.
    pub plugins: Vec<(PluginKind, String)>,
    pub traffic: Traffic,
    pub upstream: BTreeMap<String, Upstream>,
    pub default_upstream: Upstream,
    pub incidents: Vec<Incident>,
    /// How often breaker state, in-flight counts and budget gauges are sampled, ms of virtual time.
    pub sample_every_ms: u64,
    /// Tokens of a stream that fall in one such slice of virtual time reach the gateway as one chunk.
    pub stream_chunk_ms: u64,
    /// Service times (TTFT, time per output token) are rounded to whole milliseconds, as the mock
    /// server takes them: a replay against it then waits exactly what the simulator modelled.
    pub whole_milliseconds: bool,
    /// Content tokens per SSE event after the first (which is always alone, at the TTFT). 1 is
    /// what vLLM and most servers send; more spends fewer plugin callbacks on long answers, with
    /// TTFT, time per output token and token counts unchanged (the last event still comes at the
    /// last token's time, and usage carries the count).
    pub tokens_per_event: u64,
    /// What the simulator changed in a policy to run it, one line each, for the user to read
    /// (a tenant-budget ledger in Redis mode runs as the local ledger).
    pub notes: Vec<String>,
}

/// A tenant-budget policy whose ledger is Redis, as the same policy on the local ledger; `None`
/// for any other policy (a local ledger, or text that is not a JSON object: the plugin refuses it
/// with its own message). The simulator has no Redis and no `sluice-ledger`: on the wasm host the
/// ledger's callouts would be answered by the modelled upstream, natively not made at all, so the
/// two hosts would decide differently and neither as a fleet does.
fn as_local_ledger(text: &str) -> Option<String> {
    let mut policy: Value = serde_json::from_str(text).ok()?;
    let ledger = policy.get_mut("ledger")?.as_object_mut()?;
    if ledger.get("mode").and_then(Value::as_str) != Some("redis") {
        return None;
    }
    // Every other member of the ledger is about reaching Redis; the local mode takes none of them.
    ledger.clear();
    ledger.insert("mode".into(), "local".into());
    Some(policy.to_string())
}

/// A note for each policy that reads a request's tenant from somewhere the simulated clients do
/// not put it: they send it in `traffic.tenant_header` and nowhere else (no API key, no JWT), so a
/// policy reading another header sees no tenant on any request — a what-if of that policy would
/// silently measure its no-tenant path.
fn tenant_header_notes(plugins: &[(PluginKind, String)], tenant_header: &str) -> Vec<String> {
    let mut notes = Vec::new();
    for (kind, text) in plugins {
        let Ok(policy) = serde_json::from_str::<Value>(text) else { continue };
        let field = |path: &str| format!("plugins.{}: {path}", kind.section());
        // Where each reads it; `None`: the budget's identity reads no header at all.
        let mut reads: Vec<(String, Option<&str>)> = Vec::new();
        match kind {
            PluginKind::LatencyGuard | PluginKind::LlmMetrics => {
                if let Some(header) = policy.pointer("/tenant/header").and_then(Value::as_str) {
                    reads.push((field("tenant.header"), Some(header)));
                }
            }
            PluginKind::TenantBudget => {
                if let Some(identity) = policy.get("identity") {
                    reads.push((field("identity.header"), identity.get("header").and_then(Value::as_str)));
                }
            }
            PluginKind::ModelRouter => {
                for (i, model) in policy.get("models").and_then(Value::as_array).into_iter().flatten().enumerate() {
                    if let Some(header) = model.pointer("/shadow/tenant_header").and_then(Value::as_str) {
                        reads.push((field(&format!("models[{i}].shadow.tenant_header")), Some(header)));
                    }
                }
            }
        }
        for (field, header) in reads {
            match header {
                Some(h) if h.eq_ignore_ascii_case(tenant_header) => {}
                Some(h) => notes.push(format!(
                    "{field} is {h:?}, but the simulated clients send their tenant in {tenant_header:?} (traffic.tenant_header) and nowhere else: no request has a tenant there"
                )),
                None => notes.push(format!(
                    "{field} is not set: the budget identifies keys by API key or JWT claim, which the simulated clients do not send (their tenant goes in {tenant_header:?}, traffic.tenant_header): every request is an unknown key"
                )),
            }
        }
    }
    notes
}

/// A note when model-router routes no model matching `traffic.model`, the model of every request
/// whose trace record names none: such requests pass the router untouched and reach the upstream
/// named after their model (or `default_upstream`), so a routing what-if would not route them.
fn unrouted_model_note(plugins: &[(PluginKind, String)], model: &str) -> Option<String> {
    let (_, text) = plugins.iter().find(|(kind, _)| *kind == PluginKind::ModelRouter)?;
    // A policy the parser refuses is reported when the run starts, in the parser's words.
    let policy = sluice_core::routing::RoutingPolicy::from_json(text.as_bytes()).ok()?;
    policy.model_for(model).is_none().then(|| {
        format!(
            "plugins.model_router: no model of the policy matches {model:?} (traffic.model): requests whose trace record names no model are not routed; they reach the upstream named after their model, else default_upstream"
        )
    })
}

/// The four plugins, in the gateway's filter order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum PluginKind {
    LatencyGuard,
    ModelRouter,
    TenantBudget,
    LlmMetrics,
}

impl PluginKind {
    pub const ALL: [PluginKind; 4] = [PluginKind::LatencyGuard, PluginKind::ModelRouter, PluginKind::TenantBudget, PluginKind::LlmMetrics];

    /// Its section in `sluice.wasm`'s configuration (`latency_guard`).
    pub fn section(self) -> &'static str {
        match self {
            PluginKind::LatencyGuard => "latency_guard",
            PluginKind::ModelRouter => "model_router",
            PluginKind::TenantBudget => "tenant_budget",
            PluginKind::LlmMetrics => "llm_metrics",
        }
    }

    /// Its name in the scenario file and in verdicts (`latency-guard`).
    pub fn name(self) -> &'static str {
        match self {
            PluginKind::LatencyGuard => "latency-guard",
            PluginKind::ModelRouter => "model-router",
            PluginKind::TenantBudget => "tenant-budget",
            PluginKind::LlmMetrics => "llm-metrics",
        }
    }
}

/// Who sends what, when the trace does not say.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Traffic {
    /// The header every plugin reads the tenant from (as in the shipped gateways).
    #[serde(default = "default_tenant_header")]
    pub tenant_header: String,
    /// Tenants for requests whose trace line names none, drawn with Zipf weights (the first
    /// is the largest) or explicit shares.
    #[serde(default)]
    pub tenants: Vec<TenantShare>,
    /// The Zipf exponent when `tenants` give no shares (default 1.0).
    #[serde(default = "default_zipf")]
    pub zipf_s: f64,
    /// Users per tenant for requests without a user (each request draws one, uniformly).
    #[serde(default = "default_users_per_tenant")]
    pub users_per_tenant: u64,
    /// The model asked for when the trace names none.
    #[serde(default = "default_model")]
    pub model: String,
    /// Streamed when the trace does not say.
    #[serde(default = "default_stream")]
    pub stream: bool,
    /// The output limit a request sets when the trace gives none: `null` sends none, a number is
    /// that limit, `"output"` is the trace's output tokens (what the client actually needed).
    #[serde(default)]
    pub max_tokens: MaxTokens,
    /// Output tokens when the trace gives none.
    #[serde(default = "default_output_tokens")]
    pub output_tokens: u64,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub enum MaxTokens {
    #[default]
    None,
    Fixed(u64),
    Output,
}

impl<'de> Deserialize<'de> for MaxTokens {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Value::deserialize(d)? {
            Value::Null => Ok(MaxTokens::None),
            Value::Number(n) => n.as_u64().map(MaxTokens::Fixed).ok_or_else(|| serde::de::Error::custom("expected a non-negative integer")),
            Value::String(s) if s == "output" => Ok(MaxTokens::Output),
            other => Err(serde::de::Error::custom(format!("expected null, an integer or \"output\", got {other}"))),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantShare {
    pub name: String,
    /// A relative weight; all tenants without one get Zipf weights by position.
    pub share: Option<f64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    seed: u64,
    #[serde(default = "one")]
    time_scale: f64,
    plugins: PluginFiles,
    #[serde(default)]
    traffic: Option<Traffic>,
    #[serde(default)]
    upstream: BTreeMap<String, Upstream>,
    #[serde(default)]
    default_upstream: Option<Upstream>,
    #[serde(default)]
    incidents: Vec<Incident>,
    #[serde(default = "default_sample_every_ms")]
    sample_every_ms: u64,
    #[serde(default = "default_chunk")]
    stream_chunk_ms: u64,
    #[serde(default)]
    whole_milliseconds: bool,
    #[serde(default = "default_tokens_per_event")]
    tokens_per_event: u64,
}

/// A policy: a path to the JSON file Envoy gets (relative to the scenario file), or the policy
/// object itself.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct PluginFiles {
    latency_guard: Option<Value>,
    model_router: Option<Value>,
    tenant_budget: Option<Value>,
    llm_metrics: Option<Value>,
}

impl Scenario {
    /// Reads and checks the scenario at `path`.
    pub fn load(path: &Path) -> Result<Scenario, ScenarioError> {
        let text = std::fs::read_to_string(path).map_err(|error| ScenarioError::Read { path: path.to_path_buf(), error })?;
        Self::parse(&text, path)
    }

    /// Parses scenario text; `path` names it in errors and anchors relative policy paths.
    pub fn parse(text: &str, path: &Path) -> Result<Scenario, ScenarioError> {
        let invalid = |field: &str, message: String| ScenarioError::Invalid { path: path.to_path_buf(), field: field.to_string(), message };
        let de = &mut serde_json::Deserializer::from_str(text);
        let file: File = serde_path_to_error::deserialize(de).map_err(|e| {
            let field = e.path().to_string();
            invalid(&field, e.into_inner().to_string())
        })?;
        if !(file.time_scale.is_finite() && file.time_scale > 0.0) {
            return Err(invalid("time_scale", format!("must be a positive number, got {}", file.time_scale)));
        }
        if file.sample_every_ms == 0 {
            return Err(invalid("sample_every_ms", "must be at least 1".into()));
        }
        if file.tokens_per_event == 0 || file.tokens_per_event > 4096 {
            return Err(invalid("tokens_per_event", format!("must be 1 to 4096, got {}", file.tokens_per_event)));
        }
        if file.stream_chunk_ms == 0 {
            return Err(invalid("stream_chunk_ms", "must be at least 1".into()));
        }
        let base = path.parent().unwrap_or(Path::new("."));
        let mut plugins = Vec::new();
        let mut notes = Vec::new();
        let files = [
            (PluginKind::LatencyGuard, "plugins.latency_guard", file.plugins.latency_guard),
            (PluginKind::ModelRouter, "plugins.model_router", file.plugins.model_router),
            (PluginKind::TenantBudget, "plugins.tenant_budget", file.plugins.tenant_budget),
            (PluginKind::LlmMetrics, "plugins.llm_metrics", file.plugins.llm_metrics),
        ];
        for (kind, field, value) in files {
            let text = match value {
                None | Some(Value::Null) => continue,
                Some(Value::String(rel)) => {
                    let policy = base.join(rel);
                    std::fs::read_to_string(&policy).map_err(|error| ScenarioError::Policy { path: path.to_path_buf(), policy, error })?
                }
                Some(v @ Value::Object(_)) => v.to_string(),
                Some(other) => return Err(invalid(field, format!("expected a path to the policy file or the policy object, got {other}"))),
            };
            let text = match kind {
                PluginKind::TenantBudget => match as_local_ledger(&text) {
                    Some(local) => {
                        notes.push(format!(
                            "{field}: the budget's ledger is Redis (\"ledger\": {{\"mode\": \"redis\"}}); the simulator runs it as one gateway's local ledger (\"mode\": \"local\"): the same limits and admission, counted exactly, without the ledger's round trips or its on_failure rule"
                        ));
                        local
                    }
                    None => text,
                },
                _ => text,
            };
            plugins.push((kind, text));
        }
        if plugins.is_empty() {
            return Err(invalid("plugins", "names no plugin: give at least one of latency_guard, model_router, tenant_budget, llm_metrics".into()));
        }
        let traffic = file.traffic.unwrap_or_else(default_traffic);
        notes.extend(tenant_header_notes(&plugins, &traffic.tenant_header));
        notes.extend(unrouted_model_note(&plugins, &traffic.model));
        for (i, t) in traffic.tenants.iter().enumerate() {
            if let Some(share) = t.share {
                if !(share.is_finite() && share > 0.0) {
                    return Err(invalid(&format!("traffic.tenants[{i}].share"), format!("must be a positive number, got {share}")));
                }
            }
        }
        if !(traffic.zipf_s.is_finite() && traffic.zipf_s >= 0.0) {
            return Err(invalid("traffic.zipf_s", format!("must be a number ≥ 0, got {}", traffic.zipf_s)));
        }
        if traffic.users_per_tenant == 0 {
            return Err(invalid("traffic.users_per_tenant", "must be at least 1".into()));
        }
        let default_upstream = file.default_upstream.unwrap_or_default();
        for (name, u) in file.upstream.iter().map(|(k, v)| (format!("upstream.{k}"), v)).chain([("default_upstream".to_string(), &default_upstream)]) {
            check_upstream(u).map_err(|(field, message)| invalid(&format!("{name}.{field}"), message))?;
        }
        for (i, incident) in file.incidents.iter().enumerate() {
            check_incident(incident).map_err(|(field, message)| invalid(&format!("incidents[{i}].{field}"), message))?;
        }
        let name = file.name.unwrap_or_else(|| path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "scenario".into()));
        Ok(Scenario {
            name,
            seed: file.seed,
            time_scale: file.time_scale,
            plugins,
            traffic,
            upstream: file.upstream,
            default_upstream,
            incidents: file.incidents,
            sample_every_ms: file.sample_every_ms,
            stream_chunk_ms: file.stream_chunk_ms,
            whole_milliseconds: file.whole_milliseconds,
            tokens_per_event: file.tokens_per_event,
            notes,
        })
    }

    /// The service model of upstream `name` (the route model-router chose, else the version).
    pub fn upstream(&self, name: &str) -> &Upstream {
        self.upstream.get(name).unwrap_or(&self.default_upstream)
    }

    /// The policy of `kind`, when the scenario runs it.
    pub fn policy(&self, kind: PluginKind) -> Option<&str> {
        self.plugins.iter().find(|(k, _)| *k == kind).map(|(_, text)| text.as_str())
    }
}

fn default_traffic() -> Traffic {
    Traffic {
        tenant_header: default_tenant_header(),
        tenants: Vec::new(),
        zipf_s: default_zipf(),
        users_per_tenant: default_users_per_tenant(),
        model: default_model(),
        stream: default_stream(),
        max_tokens: MaxTokens::None,
        output_tokens: default_output_tokens(),
    }
}

fn default_zipf() -> f64 {
    1.0
}
fn one() -> f64 {
    1.0
}
fn default_tokens_per_event() -> u64 {
    1
}
fn default_chunk() -> u64 {
    100
}
