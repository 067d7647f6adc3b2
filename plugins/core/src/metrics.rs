//! The catalogue of every metric the sluice plugins define: one constructor per family that builds
//! the flat Envoy name (`sluice.<family>.<key>.<value>…`) from typed or already-bounded label
//! values, and [`FAMILIES`], the table of families for tests and docs.
//!
//! Envoy stores a name as `wasmcustom.sluice.…`; the `stats_tags` shipped in `envoy/templates/` take
//! each `.<key>.<value>` pair out of it as a label, leaving the family's Prometheus name
//! (`sluice.budget.remaining` → `sluice_budget_remaining`). `tests/metric_catalogue.rs` checks every
//! family against those regexes, the `histogram_bucket_settings` and the metric tables of `docs/`.
//!
//! Label values passed as `&str` must already be bounded and sanitized by the caller
//! ([`crate::report::sanitize_label`], [`crate::report::LabelBound`], or names from a validated
//! policy): the constructors only place them. Closed sets are enums, so a constructor cannot be
//! handed a value the docs do not list. Names without a dynamic label are `&'static str`, so the
//! hot paths that count them allocate nothing.

use crate::budget::policy::CounterSpec;
use crate::contract::GatewayEnd;
use crate::latency::deadline::Fired;
use crate::latency::{Priority, State};
pub use crate::report::MetricKind;
use crate::report::{finish_label, Labels};
use crate::routing::Reason;
use std::borrow::Cow;

/// The plugin that defines a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Plugin {
    LlmMetrics,
    TenantBudget,
    ModelRouter,
    LatencyGuard,
}

impl Plugin {
    /// The crate name without `sluice-` (`llm-metrics`, …), as in `sluice_<plugin>.wasm`.
    pub fn as_str(self) -> &'static str {
        match self {
            Plugin::LlmMetrics => "llm-metrics",
            Plugin::TenantBudget => "tenant-budget",
            Plugin::ModelRouter => "model-router",
            Plugin::LatencyGuard => "latency-guard",
        }
    }
}

/// One metric family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Family {
    /// The flat base name, without labels: `sluice.budget.remaining`.
    pub name: &'static str,
    pub kind: MetricKind,
    /// Label keys in the order they appear in the name. `a|b|c` is one label whose key is one of
    /// them (a budget's level: `org.<id>`, `team.<id>` or `key.<id>`); `k?` is a label only some
    /// series carry (`model` on `unrouted_total` with `reason="no_version"`).
    pub labels: &'static [&'static str],
    /// What a value counts or measures.
    pub unit: &'static str,
    pub plugin: Plugin,
}

impl Family {
    /// The Prometheus name Envoy prints: `sluice_budget_remaining`.
    pub fn prometheus_name(&self) -> String {
        self.name.replace('.', "_")
    }
}

use MetricKind::{Counter, Gauge, Histogram};
use Plugin::{LatencyGuard, LlmMetrics, ModelRouter, TenantBudget};

/// The six labels every per-request llm-metrics family carries.
const SIX: &[&str] = &["model_version", "tenant", "api", "ctx", "turn", "stream"];
const fn family(name: &'static str, kind: MetricKind, labels: &'static [&'static str], unit: &'static str, plugin: Plugin) -> Family {
    Family { name, kind, labels, unit, plugin }
}

/// Every family, grouped by plugin.
pub const FAMILIES: &[Family] = &[
    // llm-metrics (report.rs builds the per-request ones)
    family("sluice.requests_total", Counter, &["model_version", "tenant", "api", "ctx", "turn", "stream", "status", "finish", "usage"], "requests", LlmMetrics),
    family("sluice.ttft_ms", Histogram, SIX, "ms", LlmMetrics),
    family("sluice.tpot_us", Histogram, SIX, "us", LlmMetrics),
    family("sluice.decode_tokens_per_s", Histogram, SIX, "tokens_per_s", LlmMetrics),
    family("sluice.request_duration_ms", Histogram, SIX, "ms", LlmMetrics),
    family("sluice.input_tokens", Histogram, SIX, "tokens", LlmMetrics),
    family("sluice.output_tokens", Histogram, SIX, "tokens", LlmMetrics),
    family("sluice.input_tokens_total", Counter, SIX, "tokens", LlmMetrics),
    family("sluice.output_tokens_total", Counter, SIX, "tokens", LlmMetrics),
    family("sluice.cached_input_tokens_total", Counter, SIX, "tokens", LlmMetrics),
    family("sluice.reasoning_tokens_total", Counter, SIX, "tokens", LlmMetrics),
    family("sluice.cost_micro_usd_total", Counter, SIX, "micro_usd", LlmMetrics),
    family("sluice.client_disconnects_total", Counter, SIX, "requests", LlmMetrics),
    family("sluice.upstream_errors_total", Counter, SIX, "requests", LlmMetrics),
    family("sluice.gateway_replies_total", Counter, &["model_version", "tenant", "api", "ctx", "turn", "stream", "reason"], "requests", LlmMetrics),
    family("sluice.in_flight", Gauge, &["model_version"], "requests", LlmMetrics),
    family("sluice.request_body_uninspected_total", Counter, &["reason"], "requests", LlmMetrics),
    family("sluice.quality.repetition_per_mille", Histogram, &["model_version"], "per_mille", LlmMetrics),
    family("sluice.quality.output_tokens", Histogram, &["model_version", "finish"], "tokens", LlmMetrics),
    family("sluice.quality.degenerate_answers_total", Counter, &["model_version", "reason"], "requests", LlmMetrics),
    // tenant-budget
    family("sluice.budget.remaining", Gauge, &["org|team|key", "window", "unit"], "budget_unit", TenantBudget),
    family("sluice.budget.charged_tokens_total", Counter, &["key", "team", "org", "model_version"], "tokens", TenantBudget),
    family("sluice.budget.charged_micro_usd_total", Counter, &["key", "team", "org", "model_version"], "micro_usd", TenantBudget),
    family("sluice.budget.rejections_total", Counter, &["key", "reason"], "requests", TenantBudget),
    family("sluice.budget.clamps_total", Counter, &["key"], "requests", TenantBudget),
    family("sluice.budget.overestimate_tokens", Histogram, &["key"], "tokens", TenantBudget),
    family("sluice.budget.soft_limit_crossings_total", Counter, &["org|team|key", "window", "unit"], "crossings", TenantBudget),
    family("sluice.budget.ledger_calls_total", Counter, &["call", "result"], "calls", TenantBudget),
    family("sluice.budget.ledger_latency_ms", Histogram, &["call"], "ms", TenantBudget),
    family("sluice.budget.ledger_up", Gauge, &[], "bool", TenantBudget),
    family("sluice.budget.ledger_fallback_total", Counter, &["action"], "requests", TenantBudget),
    family("sluice.budget.ledger_settlements_dropped_total", Counter, &[], "settlements", TenantBudget),
    // model-router
    family("sluice.router.requests_total", Counter, &["model", "version", "reason"], "requests", ModelRouter),
    family("sluice.router.unrouted_total", Counter, &["reason", "model?"], "requests", ModelRouter),
    family("sluice.router.shadow_total", Counter, &["primary", "shadow", "result"], "requests", ModelRouter),
    family("sluice.router.compare_duration_ms", Histogram, &["primary", "shadow", "side"], "ms", ModelRouter),
    family("sluice.router.compare_ttft_ms", Histogram, &["primary", "shadow", "side"], "ms", ModelRouter),
    family("sluice.router.compare_output_tokens", Histogram, &["primary", "shadow", "side"], "tokens", ModelRouter),
    family("sluice.router.compare_errors_total", Counter, &["primary", "shadow", "side"], "requests", ModelRouter),
    family("sluice.router.compare_total", Counter, &["primary", "shadow", "finish_agree"], "comparisons", ModelRouter),
    family("sluice.router.compare_similarity_per_mille", Histogram, &["primary", "shadow"], "per_mille", ModelRouter),
    // latency-guard
    family("sluice.latency.requests_total", Counter, &["version", "class", "outcome"], "requests", LatencyGuard),
    family("sluice.latency.deadline_total", Counter, &["version", "kind", "action"], "requests", LatencyGuard),
    family("sluice.latency.shed_total", Counter, &["version", "priority", "reason"], "requests", LatencyGuard),
    family("sluice.latency.fallback_unavailable_total", Counter, &["version", "priority"], "requests", LatencyGuard),
    family("sluice.latency.probes_total", Counter, &["version"], "requests", LatencyGuard),
    family("sluice.latency.output_capped_total", Counter, &["version"], "requests", LatencyGuard),
    family("sluice.latency.breaker_transitions_total", Counter, &["version", "to"], "transitions", LatencyGuard),
    family("sluice.latency.breaker_state", Gauge, &["version"], "state", LatencyGuard),
    family("sluice.latency.in_flight", Gauge, &["version"], "requests", LatencyGuard),
];

/// The family named `name` (`sluice.ttft_ms`).
pub fn family_named(name: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.name == name)
}

// ---------------------------------------------------------------------------------------------
// llm-metrics

/// The six per-request labels, rendered once per request and shared by all its samples:
/// `.model_version.v2.tenant.acme.api.chat_completions.ctx.1k.turn.first.stream.true`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestSeries(String);

impl RequestSeries {
    pub fn new(labels: &Labels) -> Self {
        RequestSeries(labels.suffix())
    }
}

fn per_request(metric: &str, s: &RequestSeries) -> String {
    crate::text::join(&["sluice.", metric, &s.0])
}

/// The `status` label: the status class, `none` when no response headers were seen.
pub fn status_class(status: u16) -> &'static str {
    match status {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        500..=599 => "5xx",
        _ => "none",
    }
}

/// `sluice.requests_total{six,status,finish,usage}`: one per measured request. `finish` goes
/// through [`finish_label`], so an upstream's reason cannot mint a series.
pub fn requests_total(s: &RequestSeries, status: u16, finish_reason: Option<&str>, usage_reported: bool) -> String {
    let usage = if usage_reported { "reported" } else { "estimated" };
    crate::text::join(&["sluice.requests_total", &s.0, ".status.", status_class(status), ".finish.", finish_label(finish_reason), ".usage.", usage])
}

/// `sluice.ttft_ms{six}` (histogram, ms).
pub fn ttft_ms(s: &RequestSeries) -> String {
    per_request("ttft_ms", s)
}

/// `sluice.tpot_us{six}` (histogram, µs).
pub fn tpot_us(s: &RequestSeries) -> String {
    per_request("tpot_us", s)
}

/// `sluice.decode_tokens_per_s{six}` (histogram, tokens/s).
pub fn decode_tokens_per_s(s: &RequestSeries) -> String {
    per_request("decode_tokens_per_s", s)
}

/// `sluice.request_duration_ms{six}` (histogram, ms).
pub fn request_duration_ms(s: &RequestSeries) -> String {
    per_request("request_duration_ms", s)
}

/// `sluice.input_tokens{six}` (histogram, tokens).
pub fn input_tokens(s: &RequestSeries) -> String {
    per_request("input_tokens", s)
}

/// `sluice.output_tokens{six}` (histogram, tokens).
pub fn output_tokens(s: &RequestSeries) -> String {
    per_request("output_tokens", s)
}

/// `sluice.input_tokens_total{six}` (counter, tokens).
pub fn input_tokens_total(s: &RequestSeries) -> String {
    per_request("input_tokens_total", s)
}

/// `sluice.output_tokens_total{six}` (counter, tokens).
pub fn output_tokens_total(s: &RequestSeries) -> String {
    per_request("output_tokens_total", s)
}

/// `sluice.cached_input_tokens_total{six}` (counter, tokens).
pub fn cached_input_tokens_total(s: &RequestSeries) -> String {
    per_request("cached_input_tokens_total", s)
}

/// `sluice.reasoning_tokens_total{six}` (counter, tokens).
pub fn reasoning_tokens_total(s: &RequestSeries) -> String {
    per_request("reasoning_tokens_total", s)
}

/// `sluice.cost_micro_usd_total{six}` (counter, micro-USD).
pub fn cost_micro_usd_total(s: &RequestSeries) -> String {
    per_request("cost_micro_usd_total", s)
}

/// `sluice.client_disconnects_total{six}`.
pub fn client_disconnects_total(s: &RequestSeries) -> String {
    per_request("client_disconnects_total", s)
}

/// `sluice.upstream_errors_total{six}`.
pub fn upstream_errors_total(s: &RequestSeries) -> String {
    per_request("upstream_errors_total", s)
}

/// `sluice.gateway_replies_total{six,reason}`: `reason` is `refused` or `deadline`.
pub fn gateway_replies_total(s: &RequestSeries, end: GatewayEnd) -> String {
    crate::text::join(&["sluice.gateway_replies_total", &s.0, ".reason.", end.as_str()])
}

/// Why an answer counts as degenerate in `sluice.quality.degenerate_answers_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Degenerate {
    /// A completed 2xx answer with no content at all.
    Empty,
    /// A completed 2xx answer cut at its token limit (`length`, `max_tokens`, `max_output_tokens`).
    Truncated,
}

impl Degenerate {
    pub fn as_str(self) -> &'static str {
        match self {
            Degenerate::Empty => "empty",
            Degenerate::Truncated => "truncated",
        }
    }
}

/// `sluice.quality.repetition_per_mille{model_version}` (histogram, ‰ of repeated word trigrams).
pub fn quality_repetition_per_mille(model_version: &str) -> String {
    crate::text::join(&["sluice.quality.repetition_per_mille.model_version.", model_version])
}

/// `sluice.quality.output_tokens{model_version,finish}` (histogram, tokens); `finish` from
/// [`crate::report::finish_label`].
pub fn quality_output_tokens(model_version: &str, finish: &str) -> String {
    crate::text::join(&["sluice.quality.output_tokens.model_version.", model_version, ".finish.", finish])
}

/// `sluice.quality.degenerate_answers_total{model_version,reason}`.
pub fn quality_degenerate_answers_total(model_version: &str, why: Degenerate) -> String {
    crate::text::join(&["sluice.quality.degenerate_answers_total.model_version.", model_version, ".reason.", why.as_str()])
}

/// `sluice.in_flight{model_version}` (gauge); `model_version` from the plugin's [`crate::report::LabelBound`].
pub fn in_flight(model_version: &str) -> String {
    crate::text::join(&["sluice.in_flight.model_version.", model_version])
}

/// Why llm-metrics passed a request body without inspecting it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UninspectedReason {
    Malformed,
    Encoded,
    TooLarge,
}

/// `sluice.request_body_uninspected_total{reason}`.
pub fn request_body_uninspected_total(reason: UninspectedReason) -> &'static str {
    match reason {
        UninspectedReason::Malformed => "sluice.request_body_uninspected_total.reason.malformed",
        UninspectedReason::Encoded => "sluice.request_body_uninspected_total.reason.encoded",
        UninspectedReason::TooLarge => "sluice.request_body_uninspected_total.reason.too_large",
    }
}

// ---------------------------------------------------------------------------------------------
// tenant-budget

/// A budget counter's labels: `.<level>.<owner>.window.<window>.unit.<measure>`.
fn counter_labels(spec: &CounterSpec) -> String {
    crate::text::join(&[".", spec.level.as_str(), ".", &spec.owner, ".window.", spec.window.as_str(), ".unit.", spec.limit.measure()])
}

/// What every [`budget_remaining`] gauge's flat name starts with (then the budget's code:
/// `<level>.<owner>.window.<w>.unit.<u>`), for hosts that read the gauges back.
pub const BUDGET_REMAINING_PREFIX: &str = "sluice.budget.remaining.";

/// `sluice.budget.remaining{org|team|key,window,unit}` (gauge): limit − used − reserved.
pub fn budget_remaining(spec: &CounterSpec) -> String {
    // The labels start with the dot the prefix ends with.
    let labels = counter_labels(spec);
    crate::text::join(&[BUDGET_REMAINING_PREFIX, labels.get(1..).unwrap_or_default()])
}

/// `sluice.budget.soft_limit_crossings_total{org|team|key,window,unit}`.
pub fn budget_soft_limit_crossings_total(spec: &CounterSpec) -> String {
    crate::text::join(&["sluice.budget.soft_limit_crossings_total", &counter_labels(spec)])
}

/// Who a settlement charged: `.key.<key>.team.<team>.org.<org>.model_version.<mv>`, rendered once
/// for the two charge counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChargeSeries(String);

impl ChargeSeries {
    pub fn new(key: &str, team: &str, org: &str, model_version: &str) -> Self {
        ChargeSeries(crate::text::join(&[".key.", key, ".team.", team, ".org.", org, ".model_version.", model_version]))
    }
}

/// `sluice.budget.charged_tokens_total{key,team,org,model_version}`.
pub fn budget_charged_tokens_total(s: &ChargeSeries) -> String {
    crate::text::join(&["sluice.budget.charged_tokens_total", &s.0])
}

/// `sluice.budget.charged_micro_usd_total{key,team,org,model_version}`.
pub fn budget_charged_micro_usd_total(s: &ChargeSeries) -> String {
    crate::text::join(&["sluice.budget.charged_micro_usd_total", &s.0])
}

/// `sluice.budget.rejections_total{key,reason}`; `reason` is the refusal code, sanitized.
pub fn budget_rejections_total(key: &str, reason: &str) -> String {
    crate::text::join(&["sluice.budget.rejections_total.key.", key, ".reason.", reason])
}

/// `sluice.budget.clamps_total{key}`.
pub fn budget_clamps_total(key: &str) -> String {
    crate::text::join(&["sluice.budget.clamps_total.key.", key])
}

/// `sluice.budget.overestimate_tokens{key}` (histogram, tokens): reserved − charged.
pub fn budget_overestimate_tokens(key: &str) -> String {
    crate::text::join(&["sluice.budget.overestimate_tokens.key.", key])
}

/// A call to the Redis ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LedgerCall {
    Reserve,
    Settle,
    /// `/v1/charge`: what the local fallback charged during an outage, written back.
    WriteBack,
}

/// How a call to the Redis ledger ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LedgerResult {
    /// An answer (a refusal included).
    Ok,
    Timeout,
    Error,
    /// A settlement the ledger refused as malformed (final).
    Rejected,
}

/// `sluice.budget.ledger_calls_total{call,result}`.
pub fn budget_ledger_calls_total(call: LedgerCall, result: LedgerResult) -> &'static str {
    match (call, result) {
        (LedgerCall::Reserve, LedgerResult::Ok) => "sluice.budget.ledger_calls_total.call.reserve.result.ok",
        (LedgerCall::Reserve, LedgerResult::Timeout) => "sluice.budget.ledger_calls_total.call.reserve.result.timeout",
        (LedgerCall::Reserve, LedgerResult::Error) => "sluice.budget.ledger_calls_total.call.reserve.result.error",
        (LedgerCall::Reserve, LedgerResult::Rejected) => "sluice.budget.ledger_calls_total.call.reserve.result.rejected",
        (LedgerCall::Settle, LedgerResult::Ok) => "sluice.budget.ledger_calls_total.call.settle.result.ok",
        (LedgerCall::Settle, LedgerResult::Timeout) => "sluice.budget.ledger_calls_total.call.settle.result.timeout",
        (LedgerCall::Settle, LedgerResult::Error) => "sluice.budget.ledger_calls_total.call.settle.result.error",
        (LedgerCall::Settle, LedgerResult::Rejected) => "sluice.budget.ledger_calls_total.call.settle.result.rejected",
        (LedgerCall::WriteBack, LedgerResult::Ok) => "sluice.budget.ledger_calls_total.call.write_back.result.ok",
        (LedgerCall::WriteBack, LedgerResult::Timeout) => "sluice.budget.ledger_calls_total.call.write_back.result.timeout",
        (LedgerCall::WriteBack, LedgerResult::Error) => "sluice.budget.ledger_calls_total.call.write_back.result.error",
        (LedgerCall::WriteBack, LedgerResult::Rejected) => "sluice.budget.ledger_calls_total.call.write_back.result.rejected",
    }
}

/// `sluice.budget.ledger_latency_ms{call}` (histogram, ms).
pub fn budget_ledger_latency_ms(call: LedgerCall) -> &'static str {
    match call {
        LedgerCall::Reserve => "sluice.budget.ledger_latency_ms.call.reserve",
        LedgerCall::Settle => "sluice.budget.ledger_latency_ms.call.settle",
        LedgerCall::WriteBack => "sluice.budget.ledger_latency_ms.call.write_back",
    }
}

/// `sluice.budget.ledger_up` (gauge): 1 while the Redis ledger answers.
pub const fn budget_ledger_up() -> &'static str {
    "sluice.budget.ledger_up"
}

/// What `on_failure` did with a request the Redis ledger did not answer (`deny` is a rejection).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LedgerFallback {
    Allow,
    Local,
}

/// `sluice.budget.ledger_fallback_total{action}`.
pub fn budget_ledger_fallback_total(action: LedgerFallback) -> &'static str {
    match action {
        LedgerFallback::Allow => "sluice.budget.ledger_fallback_total.action.allow",
        LedgerFallback::Local => "sluice.budget.ledger_fallback_total.action.local",
    }
}

/// `sluice.budget.ledger_settlements_dropped_total`: settlements given up.
pub const fn budget_ledger_settlements_dropped_total() -> &'static str {
    "sluice.budget.ledger_settlements_dropped_total"
}

// ---------------------------------------------------------------------------------------------
// model-router

/// `sluice.router.requests_total{model,version,reason}`; `model` is the policy's model entry.
pub fn router_requests_total(model: &str, version: &str, reason: Reason) -> String {
    crate::text::join(&["sluice.router.requests_total.model.", model, ".version.", version, ".reason.", reason.as_str()])
}

/// Why a request was not routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unrouted<'a> {
    /// No `model` in the request's metadata.
    NoModel,
    /// No policy entry matches the model.
    UnknownModel,
    /// The entry (its pattern, sanitized) had no version to route to.
    NoVersion { model: &'a str },
}

/// `sluice.router.unrouted_total{reason[,model]}`.
pub fn router_unrouted_total(why: Unrouted<'_>) -> Cow<'static, str> {
    match why {
        Unrouted::NoModel => Cow::Borrowed("sluice.router.unrouted_total.reason.no_model"),
        Unrouted::UnknownModel => Cow::Borrowed("sluice.router.unrouted_total.reason.unknown_model"),
        Unrouted::NoVersion { model } => Cow::Owned(crate::text::join(&["sluice.router.unrouted_total.reason.no_version.model.", model])),
    }
}

/// A (primary, shadow) pair of versions: `.primary.<p>.shadow.<s>`, rendered once for all the
/// shadow and comparison metrics of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShadowPair(String);

impl ShadowPair {
    pub fn new(primary: &str, shadow: &str) -> Self {
        ShadowPair(crate::text::join(&[".primary.", primary, ".shadow.", shadow]))
    }
}

/// What happened to a request's shadow copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShadowResult {
    Sampled,
    Sent,
    SkippedCap,
    Excluded,
    Failed,
    Refused,
}

impl ShadowResult {
    pub fn as_str(self) -> &'static str {
        match self {
            ShadowResult::Sampled => "sampled",
            ShadowResult::Sent => "sent",
            ShadowResult::SkippedCap => "skipped_cap",
            ShadowResult::Excluded => "excluded",
            ShadowResult::Failed => "failed",
            ShadowResult::Refused => "refused",
        }
    }
}

/// `sluice.router.shadow_total{primary,shadow,result}`.
pub fn router_shadow_total(pair: &ShadowPair, result: ShadowResult) -> String {
    crate::text::join(&["sluice.router.shadow_total", &pair.0, ".result.", result.as_str()])
}

/// One side of a shadow comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Primary,
    Shadow,
}

impl Side {
    pub fn as_str(self) -> &'static str {
        match self {
            Side::Primary => "primary",
            Side::Shadow => "shadow",
        }
    }
}

/// `sluice.router.compare_duration_ms{primary,shadow,side}` (histogram, ms).
pub fn router_compare_duration_ms(pair: &ShadowPair, side: Side) -> String {
    crate::text::join(&["sluice.router.compare_duration_ms", &pair.0, ".side.", side.as_str()])
}

/// `sluice.router.compare_ttft_ms{primary,shadow,side="primary"}` (histogram, ms): the shadow's
/// TTFT is not observable (a callout's answer arrives whole).
pub fn router_compare_ttft_ms(pair: &ShadowPair) -> String {
    crate::text::join(&["sluice.router.compare_ttft_ms", &pair.0, ".side.primary"])
}

/// `sluice.router.compare_output_tokens{primary,shadow,side}` (histogram, tokens).
pub fn router_compare_output_tokens(pair: &ShadowPair, side: Side) -> String {
    crate::text::join(&["sluice.router.compare_output_tokens", &pair.0, ".side.", side.as_str()])
}

/// `sluice.router.compare_errors_total{primary,shadow,side}`.
pub fn router_compare_errors_total(pair: &ShadowPair, side: Side) -> String {
    crate::text::join(&["sluice.router.compare_errors_total", &pair.0, ".side.", side.as_str()])
}

/// `sluice.router.compare_total{primary,shadow,finish_agree}`.
pub fn router_compare_total(pair: &ShadowPair, finish_agree: bool) -> String {
    crate::text::join(&["sluice.router.compare_total", &pair.0, ".finish_agree.", if finish_agree { "true" } else { "false" }])
}

/// `sluice.router.compare_similarity_per_mille{primary,shadow}` (histogram, ‰).
pub fn router_compare_similarity_per_mille(pair: &ShadowPair) -> String {
    crate::text::join(&["sluice.router.compare_similarity_per_mille", &pair.0])
}

// ---------------------------------------------------------------------------------------------
// latency-guard

/// `sluice.latency.requests_total{version,class,outcome}`; `outcome` is one of `ok`, `error`,
/// `client_disconnect`, `ttft`, `total` ([`crate::latency::deadline::DeadlineKind::as_str`]) or a
/// gateway end ([`GatewayEnd::as_str`]).
pub fn latency_requests_total(version: &str, class: &str, outcome: &'static str) -> String {
    crate::text::join(&["sluice.latency.requests_total.version.", version, ".class.", class, ".outcome.", outcome])
}

/// `sluice.latency.deadline_total{version,kind,action}`.
pub fn latency_deadline_total(version: &str, fired: Fired) -> String {
    crate::text::join(&["sluice.latency.deadline_total.version.", version, ".kind.", fired.kind().as_str(), ".action.", fired.action()])
}

/// Why the guard shed a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShedReason {
    BreakerOpen,
    InFlight,
}

impl ShedReason {
    pub fn as_str(self) -> &'static str {
        match self {
            ShedReason::BreakerOpen => "breaker_open",
            ShedReason::InFlight => "in_flight",
        }
    }
}

/// `sluice.latency.shed_total{version,priority,reason}`.
pub fn latency_shed_total(version: &str, priority: Priority, reason: ShedReason) -> String {
    crate::text::join(&["sluice.latency.shed_total.version.", version, ".priority.", priority.as_str(), ".reason.", reason.as_str()])
}

/// `sluice.latency.fallback_unavailable_total{version,priority}`.
pub fn latency_fallback_unavailable_total(version: &str, priority: Priority) -> String {
    crate::text::join(&["sluice.latency.fallback_unavailable_total.version.", version, ".priority.", priority.as_str()])
}

/// `sluice.latency.probes_total{version}`.
pub fn latency_probes_total(version: &str) -> String {
    crate::text::join(&["sluice.latency.probes_total.version.", version])
}

/// `sluice.latency.output_capped_total{version}`.
pub fn latency_output_capped_total(version: &str) -> String {
    crate::text::join(&["sluice.latency.output_capped_total.version.", version])
}

/// `sluice.latency.breaker_transitions_total{version,to}`.
pub fn latency_breaker_transitions_total(version: &str, to: State) -> String {
    crate::text::join(&["sluice.latency.breaker_transitions_total.version.", version, ".to.", to.as_str()])
}

/// `sluice.latency.breaker_state{version}` (gauge: 0 closed, 1 open, 2 half-open).
pub fn latency_breaker_state(version: &str) -> String {
    crate::text::join(&[LATENCY_BREAKER_STATE_PREFIX, version])
}

/// What every [`latency_breaker_state`] gauge's flat name starts with (then the version), for hosts
/// that read breaker transitions off the gauge.
pub const LATENCY_BREAKER_STATE_PREFIX: &str = "sluice.latency.breaker_state.version.";

/// `sluice.latency.in_flight{version}` (gauge).
pub fn latency_in_flight(version: &str) -> String {
    crate::text::join(&["sluice.latency.in_flight.version.", version])
}
