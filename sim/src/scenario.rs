//! The scenario file: which plugins run with which policies, who sends what when the trace does not
//! say, and how each model version serves. JSON, every field checked (`deny_unknown_fields`), errors
//! with their field path. docs/simulator.md is the reference.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

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
    #[serde(default = "default_users")]
    pub users_per_tenant: u64,
    /// The model asked for when the trace names none.
    #[serde(default = "default_model")]
    pub model: String,
    /// Streamed when the trace does not say.
    #[serde(default = "default_true")]
    pub stream: bool,
    /// The output limit a request sets when the trace gives none: `null` sends none, a number is
    /// that limit, `"output"` is the trace's output tokens (what the client actually needed).
    #[serde(default)]
    pub max_tokens: MaxTokens,
    /// Output tokens when the trace gives none.
    #[serde(default = "default_output")]
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

/// How one model version serves: a service-time model with a batch limit and a FIFO queue.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Upstream {
    /// Fixed part of time to first token (scheduling, network), ms.
    #[serde(default = "default_ttft_base")]
    pub ttft_base_ms: f64,
    /// Prefill speed: the prompt adds prompt_tokens / this seconds to the TTFT.
    #[serde(default = "default_prefill")]
    pub prefill_tokens_per_s: f64,
    /// Each other request running in the batch adds this share to the prefill time.
    #[serde(default)]
    pub prefill_slowdown_per_running: f64,
    /// Time per output token with the batch otherwise empty, ms.
    #[serde(default = "default_tpot")]
    pub tpot_ms: f64,
    /// Each other running request adds this to the time per output token, ms.
    #[serde(default)]
    pub tpot_per_running_ms: f64,
    /// Requests served at once; more wait in a FIFO queue (their wait is part of their TTFT).
    #[serde(default = "default_batch")]
    pub max_batch: u32,
    /// Share of requests answered with `error_status` instead (0–1), drawn per request with the seed.
    #[serde(default)]
    pub error_rate: f64,
    #[serde(default = "default_error_status")]
    pub error_status: u16,
}

impl Default for Upstream {
    fn default() -> Self {
        Upstream {
            ttft_base_ms: default_ttft_base(),
            prefill_tokens_per_s: default_prefill(),
            prefill_slowdown_per_running: 0.0,
            tpot_ms: default_tpot(),
            tpot_per_running_ms: 0.0,
            max_batch: default_batch(),
            error_rate: 0.0,
            error_status: default_error_status(),
        }
    }
}

/// Something going wrong at one version for a while.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Incident {
    /// The upstream it hits (a key of `upstream`, e.g. the route model-router writes).
    pub upstream: String,
    /// From and to, seconds after the trace's first request (after `time_scale`).
    pub from_s: f64,
    pub to_s: f64,
    /// TTFT multiplied by this while it lasts.
    #[serde(default = "one")]
    pub ttft_factor: f64,
    /// Time per output token multiplied by this.
    #[serde(default = "one")]
    pub tpot_factor: f64,
    /// Every request answered with this status instead.
    pub status: Option<u16>,
    /// Or this share of them (0–1), with the upstream's `error_status`.
    pub error_rate: Option<f64>,
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
    #[serde(default = "default_sample")]
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
            plugins.push((kind, text));
        }
        if plugins.is_empty() {
            return Err(invalid("plugins", "names no plugin: give at least one of latency_guard, model_router, tenant_budget, llm_metrics".into()));
        }
        let traffic = file.traffic.unwrap_or_else(default_traffic);
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
            let field = |f: &str| format!("incidents[{i}].{f}");
            if !(incident.from_s.is_finite() && incident.to_s.is_finite() && incident.from_s >= 0.0 && incident.to_s > incident.from_s) {
                return Err(invalid(&field("to_s"), format!("the incident must last: from_s {} to to_s {}", incident.from_s, incident.to_s)));
            }
            for (name, factor) in [("ttft_factor", incident.ttft_factor), ("tpot_factor", incident.tpot_factor)] {
                if !(factor.is_finite() && factor > 0.0) {
                    return Err(invalid(&field(name), format!("must be a positive number, got {factor}")));
                }
            }
            if let Some(rate) = incident.error_rate {
                if !(0.0..=1.0).contains(&rate) {
                    return Err(invalid(&field("error_rate"), format!("must be between 0 and 1, got {rate}")));
                }
            }
            if let Some(status) = incident.status {
                if !(100..=599).contains(&status) {
                    return Err(invalid(&field("status"), format!("must be an HTTP status, got {status}")));
                }
            }
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

fn check_upstream(u: &Upstream) -> Result<(), (&'static str, String)> {
    let positive = |name: &'static str, v: f64| if v.is_finite() && v > 0.0 { Ok(()) } else { Err((name, format!("must be a positive number, got {v}"))) };
    let non_negative = |name: &'static str, v: f64| if v.is_finite() && v >= 0.0 { Ok(()) } else { Err((name, format!("must be a number ≥ 0, got {v}"))) };
    non_negative("ttft_base_ms", u.ttft_base_ms)?;
    positive("prefill_tokens_per_s", u.prefill_tokens_per_s)?;
    non_negative("prefill_slowdown_per_running", u.prefill_slowdown_per_running)?;
    non_negative("tpot_ms", u.tpot_ms)?;
    non_negative("tpot_per_running_ms", u.tpot_per_running_ms)?;
    if u.max_batch == 0 {
        return Err(("max_batch", "must be at least 1".into()));
    }
    if !(0.0..=1.0).contains(&u.error_rate) {
        return Err(("error_rate", format!("must be between 0 and 1, got {}", u.error_rate)));
    }
    if !(100..=599).contains(&u.error_status) {
        return Err(("error_status", format!("must be an HTTP status, got {}", u.error_status)));
    }
    Ok(())
}

fn default_traffic() -> Traffic {
    Traffic {
        tenant_header: default_tenant_header(),
        tenants: Vec::new(),
        zipf_s: default_zipf(),
        users_per_tenant: default_users(),
        model: default_model(),
        stream: true,
        max_tokens: MaxTokens::None,
        output_tokens: default_output(),
    }
}

fn default_tenant_header() -> String {
    "x-sluice-tenant".into()
}
fn default_zipf() -> f64 {
    1.0
}
fn default_users() -> u64 {
    100
}
fn default_model() -> String {
    "llama-3-70b".into()
}
fn default_true() -> bool {
    true
}
fn default_output() -> u64 {
    128
}
fn default_ttft_base() -> f64 {
    30.0
}
fn default_prefill() -> f64 {
    20_000.0
}
fn default_tpot() -> f64 {
    20.0
}
fn default_batch() -> u32 {
    64
}
fn default_error_status() -> u16 {
    500
}
fn one() -> f64 {
    1.0
}
fn default_sample() -> u64 {
    1000
}
fn default_tokens_per_event() -> u64 {
    1
}
fn default_chunk() -> u64 {
    100
}
