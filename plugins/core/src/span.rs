//! What the request's tracing span carries. sluice has no tracer of its own: Envoy's tracer makes
//! the span, and each attribute below is a filter-state value a section writes once, which the
//! gateway's `tracing.custom_tags` copy onto the span
//! (`{tag: gen_ai.usage.input_tokens, value: "%FILTER_STATE(wasm.sluice_span.gen_ai.usage.input_tokens:PLAIN)%"}`;
//! docs/tracing.md).
//!
//! Measured in Envoy 1.40: custom tags are evaluated when the span is finished, after the
//! response's last byte but *before* the filters' `on_log` — what a section writes at the end of
//! the response reaches the span, what it writes in `on_log` does not. `FILTER_STATE(…:FIELD:x)`
//! cannot read a member of the JSON stamps (wasm filter state has no field access), hence one value
//! per attribute. Every value is the same number or word the section's access-log stamp carries.
//!
//! The values are written only for a request Envoy traces: Envoy packs its sampling decision into
//! the `x-request-id` UUID ([`traced`]), so a gateway without tracing, or a request the sampler
//! left out, costs nothing but that header's read.

use crate::api::ApiKind;
use crate::flow::Effects;
use crate::report::RequestRecord;
use crate::request::RequestInfo;

/// One span attribute: its name on the span and the filter-state key it is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attribute {
    /// The attribute's name (the custom tag's `tag`).
    pub name: &'static str,
    /// The filter-state key the section writes (`%FILTER_STATE(wasm.<key>:PLAIN)%`).
    pub key: &'static str,
    /// The section that writes it.
    pub section: Section,
}

/// Which sluice section writes an attribute (a gateway's tags name those of its sections only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section {
    LlmMetrics,
    ModelRouter,
    TenantBudget,
    LatencyGuard,
}

macro_rules! attributes {
    ($($id:ident = $name:literal, $section:ident;)*) => {
        $(pub const $id: Attribute = Attribute { name: $name, key: concat!("sluice_span.", $name), section: Section::$section };)*
        /// Every attribute, in the order the shipped gateways list their custom tags.
        pub const ATTRIBUTES: &[Attribute] = &[$($id),*];
    };
}

attributes! {
    OPERATION = "gen_ai.operation.name", LlmMetrics;
    PROVIDER = "gen_ai.provider.name", LlmMetrics;
    REQUEST_MODEL = "gen_ai.request.model", LlmMetrics;
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens", LlmMetrics;
    API = "sluice.api", LlmMetrics;
    MODEL_VERSION = "sluice.model_version", LlmMetrics;
    TENANT = "sluice.tenant", LlmMetrics;
    RESPONSE_MODEL = "gen_ai.response.model", LlmMetrics;
    INPUT_TOKENS = "gen_ai.usage.input_tokens", LlmMetrics;
    OUTPUT_TOKENS = "gen_ai.usage.output_tokens", LlmMetrics;
    FINISH_REASONS = "gen_ai.response.finish_reasons", LlmMetrics;
    TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk", LlmMetrics;
    TPOT_US = "sluice.tpot_us", LlmMetrics;
    COST = "sluice.cost_micro_usd", LlmMetrics;
    OUTCOME = "sluice.outcome", LlmMetrics;
    ROUTE_REASON = "sluice.route.reason", ModelRouter;
    SHADOW = "sluice.shadow", ModelRouter;
    BUDGET_DECISION = "sluice.budget.decision", TenantBudget;
    BUDGET_CODE = "sluice.budget.code", TenantBudget;
    GUARD_CLASS = "sluice.guard.class", LatencyGuard;
    GUARD_OUTCOME = "sluice.guard.outcome", LatencyGuard;
}

/// Whether Envoy traces the request with this `x-request-id`: Envoy's UUID request-id extension
/// (the default) packs the tracing decision into the UUID's 14th hex digit — `9` sampled, `a`
/// forced by the server, `b` forced by the client — and leaves the version's `4` otherwise
/// (Envoy's `UuidRequestIdConfig`). A request id that is not such a UUID is not traced by Envoy
/// either (it cannot carry the decision).
pub fn traced(request_id: Option<&str>) -> bool {
    let Some(id) = request_id else { return false };
    let b = id.as_bytes();
    b.len() == 36 && b.get(8) == Some(&b'-') && b.get(13) == Some(&b'-') && matches!(b.get(14), Some(b'9' | b'a' | b'b'))
}

fn set(fx: &mut Effects, attr: Attribute, value: impl Into<Vec<u8>>) {
    let value = value.into();
    // Envoy reads an empty filter-state value back as absent: nothing to write.
    if !value.is_empty() {
        fx.set_state(attr.key, value);
    }
}

/// The GenAI operation an API kind performs (OpenTelemetry's `gen_ai.operation.name` values).
pub fn operation(kind: ApiKind) -> &'static str {
    match kind {
        ApiKind::Completions => "text_completion",
        ApiKind::ChatCompletions | ApiKind::Responses | ApiKind::AnthropicMessages => "chat",
    }
}

/// The provider whose API the request speaks (`gen_ai.provider.name`): what sluice can know — an
/// OpenAI-compatible server (vLLM, TGI, …) is `openai` here.
pub fn provider(kind: ApiKind) -> &'static str {
    match kind {
        ApiKind::AnthropicMessages => "anthropic",
        ApiKind::ChatCompletions | ApiKind::Completions | ApiKind::Responses => "openai",
    }
}

/// llm-metrics, once the request body is read: what the request asked for, and its labels (so a
/// request that never ends — a client gone — still has them on its span).
pub fn llm_request(kind: ApiKind, request: Option<&RequestInfo>, model_version: &str, tenant: &str, fx: &mut Effects) {
    set(fx, OPERATION, operation(kind));
    set(fx, PROVIDER, provider(kind));
    if let Some(r) = request {
        if let Some(model) = &r.model {
            set(fx, REQUEST_MODEL, model.as_str());
        }
        if let Some(max) = r.max_output_tokens {
            set(fx, REQUEST_MAX_TOKENS, max.to_string());
        }
    }
    set(fx, API, kind.as_str());
    set(fx, MODEL_VERSION, model_version);
    set(fx, TENANT, tenant);
}

/// llm-metrics, when the request is reported: the figures of its stamp (`record.stamp_json()`).
pub fn llm_response(record: &RequestRecord, fx: &mut Effects) {
    if let Some(model) = &record.response.response_model {
        set(fx, RESPONSE_MODEL, model.as_str());
    }
    set(fx, INPUT_TOKENS, record.input_tokens().to_string());
    set(fx, OUTPUT_TOKENS, record.output_tokens().to_string());
    if let Some(reason) = &record.response.finish_reason {
        set(fx, FINISH_REASONS, reason.as_str());
    }
    // Seconds, as the convention wants, to the stamp's microsecond.
    if let Some(us) = record.ttft_ns().map(|ns| ns / 1000) {
        set(fx, TIME_TO_FIRST_CHUNK, seconds(us));
    }
    if let Some(us) = record.tpot_ns().map(|ns| ns / 1000) {
        set(fx, TPOT_US, us.to_string());
    }
    if let Some(cost) = record.cost_micro_usd {
        set(fx, COST, cost.to_string());
    }
    set(fx, OUTCOME, record.outcome.as_str());
}

/// `us` µs as decimal seconds with six places (`33766` → `0.033766`): exact, no float.
pub fn seconds(us: u64) -> String {
    format!("{}.{:06}", us / 1_000_000, us % 1_000_000)
}

/// model-router, with its decision: why this version, and the shadow version when one is sent.
pub fn route(reason: &str, shadow: Option<&str>, fx: &mut Effects) {
    set(fx, ROUTE_REASON, reason);
    if let Some(s) = shadow {
        set(fx, SHADOW, s);
    }
}

/// Removes an attribute written earlier (Envoy reads an empty value back as absent): a shadow
/// that was dropped after the decision.
pub fn clear(attr: Attribute, fx: &mut Effects) {
    fx.set_state(attr.key, Vec::new());
}

/// tenant-budget, with its decision (`admitted`, `clamped`, `rejected`, …) and a refusal's code.
pub fn budget(decision: &str, code: Option<&str>, fx: &mut Effects) {
    set(fx, BUDGET_DECISION, decision);
    if let Some(c) = code {
        set(fx, BUDGET_CODE, c);
    }
}

/// latency-guard, at admission: the tenant's class.
pub fn guard_class(class: &str, fx: &mut Effects) {
    set(fx, GUARD_CLASS, class);
}

/// latency-guard, when it ends a request itself (a shed 503, a deadline's 504): the outcome its
/// stamp gives. Written then, not at `on_log`, which comes after Envoy finished the span.
pub fn guard_outcome(outcome: &str, fx: &mut Effects) {
    set(fx, GUARD_OUTCOME, outcome);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::Effect;

    #[test]
    fn the_trace_decision_is_read_from_the_request_id() {
        let cases = [
            (Some("6a1c7f0e-7f6b-9b2b-9a55-1f0c2d3e4f51"), true),
            (Some("6a1c7f0e-7f6b-ab2b-9a55-1f0c2d3e4f51"), true),
            (Some("6a1c7f0e-7f6b-bb2b-9a55-1f0c2d3e4f51"), true),
            (Some("6a1c7f0e-7f6b-4b2b-9a55-1f0c2d3e4f51"), false),
            (Some("full-stream-1"), false),
            (Some("6a1c7f0e-7f6b-9b2b-9a55-1f0c2d3e4f5"), false),
            (None, false),
        ];
        for (id, want) in cases {
            assert_eq!(traced(id), want, "{id:?}");
        }
    }

    #[test]
    fn seconds_keep_every_microsecond() {
        assert_eq!(seconds(33_766), "0.033766");
        assert_eq!(seconds(2_000_001), "2.000001");
        assert_eq!(seconds(0), "0.000000");
    }

    #[test]
    fn every_attribute_has_its_own_key_under_the_prefix() {
        let mut keys: Vec<&str> = ATTRIBUTES.iter().map(|a| a.key).collect();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), ATTRIBUTES.len());
        for a in ATTRIBUTES {
            assert_eq!(a.key.strip_prefix("sluice_span."), Some(a.name));
        }
    }

    #[test]
    fn empty_values_are_not_written() {
        let mut fx = Effects::default();
        route("weight", Some(""), &mut fx);
        let written: Vec<String> = fx.0.iter().filter_map(|e| if let Effect::SetState { key, .. } = e { Some(key.clone()) } else { None }).collect();
        assert_eq!(written, vec![ROUTE_REASON.key.to_string()]);
    }
}
