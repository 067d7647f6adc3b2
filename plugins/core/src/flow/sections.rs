//! The engine's configuration: one section per policy, each the policy's own configuration
//! unchanged (today's policy files are the sections), parsed and validated once at configure time.
//! Every host of the engine reads it here, so `sluice.wasm` (`plugins/engine`) and `libsluice.so`
//! (`native/`) accept the same documents and refuse the rest in the same words.

use crate::budget::Policy as BudgetPolicy;
use crate::flow::metrics::config::Settings as MetricsSettings;
use crate::flow::metrics::MetricsPolicy;
use crate::latency::LatencyPolicy;
use crate::routing::RoutingPolicy;

/// A policy section, in pipeline order (request side).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SectionKind {
    LatencyGuard,
    ModelRouter,
    TenantBudget,
    LlmMetrics,
}

/// Every section, in pipeline order (request side).
pub const KINDS: [SectionKind; 4] = [SectionKind::LatencyGuard, SectionKind::ModelRouter, SectionKind::TenantBudget, SectionKind::LlmMetrics];
/// Every section's member name, in pipeline order, for messages.
fn section_names() -> String {
    KINDS.map(SectionKind::section).join(", ")
}

impl SectionKind {
    /// The section's member name in `sluice.wasm`'s configuration.
    pub fn section(self) -> &'static str {
        match self {
            SectionKind::LatencyGuard => "latency_guard",
            SectionKind::ModelRouter => "model_router",
            SectionKind::TenantBudget => "tenant_budget",
            SectionKind::LlmMetrics => "llm_metrics",
        }
    }

    /// The policy's name in log lines (the single-policy filter's name).
    pub fn policy_name(self) -> &'static str {
        match self {
            SectionKind::LatencyGuard => "latency-guard",
            SectionKind::ModelRouter => "model-router",
            SectionKind::TenantBudget => "tenant-budget",
            SectionKind::LlmMetrics => "llm-metrics",
        }
    }

    /// How the single-policy build words a refused configuration in its log line (kept as each
    /// filter always wrote it: operators grep for these).
    pub fn refusal(self) -> &'static str {
        match self {
            SectionKind::LatencyGuard => "sluice latency-guard: configuration refused",
            SectionKind::ModelRouter => "model-router policy refused",
            SectionKind::TenantBudget => "tenant-budget policy refused",
            SectionKind::LlmMetrics => "sluice llm-metrics: configuration refused",
        }
    }

    fn from_section(name: &str) -> Option<SectionKind> {
        KINDS.into_iter().find(|k| k.section() == name)
    }
}

/// One configured, validated policy.
#[derive(Debug)]
pub enum Policy {
    LatencyGuard(Box<LatencyPolicy>),
    ModelRouter(Box<RoutingPolicy>),
    TenantBudget(Box<BudgetPolicy>),
    LlmMetrics(Box<MetricsPolicy>),
}

impl Policy {
    /// Parses one policy's configuration as that policy words its errors. An empty llm-metrics
    /// configuration means all defaults, as it always has.
    fn parse(kind: SectionKind, bytes: &[u8]) -> Result<Policy, String> {
        match kind {
            SectionKind::LatencyGuard => LatencyPolicy::from_json(bytes).map(|p| Policy::LatencyGuard(Box::new(p))).map_err(|e| e.to_string()),
            SectionKind::ModelRouter => RoutingPolicy::from_json(bytes).map(|p| Policy::ModelRouter(Box::new(p))).map_err(|e| e.to_string()),
            SectionKind::TenantBudget => BudgetPolicy::from_json(bytes).map(|p| Policy::TenantBudget(Box::new(p))).map_err(|e| e.to_string()),
            SectionKind::LlmMetrics => MetricsSettings::parse(bytes).map(|s| Policy::LlmMetrics(Box::new(MetricsPolicy::new(s)))).map_err(|e| e.to_string()),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("configuration is not valid JSON: {0}")]
    Json(String),
    #[error("configuration must be a JSON object with one member per policy section ({})", section_names())]
    NotAnObject,
    #[error("unknown section `{0}`: expected one of {known}", known = section_names())]
    UnknownSection(String),
    #[error("no policy section: name one of {}", section_names())]
    Empty,
    #[error(
        "sections {0}: latency_guard runs in a filter instance of its own, in front of the others (it holds a stream's response headers until the first content token, which the sections behind it must see first)"
    )]
    GuardWithOthers(String),
    /// A single-policy build's own configuration error, as that policy words it.
    #[error("{0}")]
    Policy(String),
    /// A section's policy refused, in that policy's own words (operators grep for them), then
    /// the section it came from.
    #[error("{refusal}: {problem} (section `{section}`)", refusal = kind.refusal(), section = kind.section())]
    Section { kind: SectionKind, problem: String },
}

/// A configuration with one section per policy (`sluice.wasm`): the policies in pipeline order.
pub fn parse_sections(bytes: &[u8]) -> Result<Vec<Policy>, ConfigError> {
    let text = std::str::from_utf8(bytes).map_err(|e| ConfigError::Json(format!("not UTF-8: {e}")))?;
    if text.trim().is_empty() {
        return Err(ConfigError::Empty);
    }
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| ConfigError::Json(e.to_string()))?;
    if !value.is_object() {
        return Err(ConfigError::NotAnObject);
    }
    // Each section as written: a policy's error positions (line, column) count from its section.
    let members: std::collections::BTreeMap<String, &serde_json::value::RawValue> = serde_json::from_str(text).map_err(|e| ConfigError::Json(e.to_string()))?;
    let mut found = Vec::new();
    for (name, section) in members {
        match SectionKind::from_section(&name) {
            Some(kind) => found.push((kind, section)),
            None => return Err(ConfigError::UnknownSection(name)),
        }
    }
    // In pipeline order, whatever order the JSON had.
    found.sort_by_key(|(kind, _)| KINDS.iter().position(|k| k == kind));
    if found.is_empty() {
        return Err(ConfigError::Empty);
    }
    if found.len() > 1 && found.iter().any(|(kind, _)| *kind == SectionKind::LatencyGuard) {
        return Err(ConfigError::GuardWithOthers(found.iter().map(|(k, _)| k.section()).collect::<Vec<_>>().join(", ")));
    }
    found.into_iter().map(|(kind, section)| Policy::parse(kind, section.get().as_bytes()).map_err(|problem| ConfigError::Section { kind, problem })).collect()
}

/// A configuration that is one policy's alone, unwrapped (the single-policy builds).
pub fn parse_only(kind: SectionKind, bytes: &[u8]) -> Result<Policy, ConfigError> {
    Policy::parse(kind, bytes).map_err(ConfigError::Policy)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;

    fn err(json: &str) -> String {
        match parse_sections(json.as_bytes()) {
            Ok(_) => panic!("accepted {json}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn the_shipped_policies_are_sections_unchanged() {
        let metrics = include_str!("../../../../policies/llm-metrics.demo.json");
        match parse_sections(format!(r#"{{"llm_metrics":{metrics}}}"#).as_bytes()).unwrap().as_slice() {
            [Policy::LlmMetrics(m)] => assert_eq!(m.settings.prices.len(), 4),
            other => panic!("{other:?}"),
        }
        let guard = include_str!("../../../../policies/latency-guard.demo.json");
        assert!(matches!(parse_sections(format!(r#"{{"latency_guard":{guard}}}"#).as_bytes()).unwrap().as_slice(), [Policy::LatencyGuard(_)]));
        let router = include_str!("../../../../policies/model-router.demo.json");
        assert!(matches!(parse_sections(format!(r#"{{"model_router":{router}}}"#).as_bytes()).unwrap().as_slice(), [Policy::ModelRouter(_)]));
        let budget = include_str!("../../../../policies/tenant-budget.full.json");
        assert!(matches!(parse_sections(format!(r#"{{"tenant_budget":{budget}}}"#).as_bytes()).unwrap().as_slice(), [Policy::TenantBudget(_)]));
        // Several sections, in pipeline order whatever the JSON's order.
        let three = format!(r#"{{"llm_metrics":{metrics},"tenant_budget":{budget},"model_router":{router}}}"#);
        assert!(matches!(parse_sections(three.as_bytes()).unwrap().as_slice(), [Policy::ModelRouter(_), Policy::TenantBudget(_), Policy::LlmMetrics(_)]));
    }

    #[test]
    fn errors_name_the_section_and_the_field() {
        assert_eq!(
            err(r#"{"llm_metrics":{"path_prefixes":["v1"]}}"#),
            "sluice llm-metrics: configuration refused: path_prefixes[0]: must start with '/', got \"v1\" (section `llm_metrics`)"
        );
        let unknown = err(r#"{"llm_metrics":{"path_prefix":[]}}"#);
        assert!(unknown.contains("unknown field `path_prefix`") && unknown.ends_with("(section `llm_metrics`)"), "{unknown}");
        let guard = err(r#"{"latency_guard":{"classes":7}}"#);
        assert!(guard.starts_with("sluice latency-guard: configuration refused: ") && guard.ends_with("(section `latency_guard`)"), "{guard}");
        assert_eq!(err(r#"{"llm_metric":{}}"#), "unknown section `llm_metric`: expected one of latency_guard, model_router, tenant_budget, llm_metrics");
        assert_eq!(err("{}"), "no policy section: name one of latency_guard, model_router, tenant_budget, llm_metrics");
        assert_eq!(err(""), err("{}"));
        assert!(err("[1]").starts_with("configuration must be a JSON object"));
        assert!(err("{nope").starts_with("configuration is not valid JSON"));
        assert!(err(r#"{"model_router":{"models":3}}"#).starts_with("model-router policy refused: "));
        assert_eq!(
            err("{\"tenant_budget\": {\n  \"mode\": \"sloppy\"\n}}"),
            "tenant-budget policy refused: tenant-budget policy is not valid JSON: mode: unknown variant `sloppy`, expected `strict` or `estimate` at line 2 column 18 (section `tenant_budget`)",
            "positions count from the section as written"
        );
        assert!(err(r#"{"llm_metrics":{},"latency_guard":{}}"#)
            .starts_with("sections latency_guard, llm_metrics: latency_guard runs in a filter instance of its own"));
    }

    #[test]
    fn a_single_policy_build_reads_its_policy_unwrapped() {
        assert!(matches!(parse_only(SectionKind::LlmMetrics, b"").unwrap(), Policy::LlmMetrics(_)));
        assert!(parse_only(SectionKind::LlmMetrics, br#"{"llm_metrics":{}}"#).unwrap_err().to_string().contains("unknown field `llm_metrics`"));
    }
}
