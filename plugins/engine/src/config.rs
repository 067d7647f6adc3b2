//! The engine's configuration: one section per policy, each the policy's own configuration
//! unchanged (today's policy files are the sections), parsed and validated once at configure time.

use sluice_core::flow::metrics::config::Settings as MetricsSettings;
use sluice_core::flow::metrics::MetricsPolicy;

/// The sections `sluice.wasm` knows, in pipeline order (request side).
pub const SECTIONS: &[&str] = &["latency_guard", "model_router", "tenant_budget", "llm_metrics"];

/// Sections whose policy still runs in its own filter (see docs/configuration.md).
const NOT_YET_IN_ENGINE: &[(&str, &str)] =
    &[("latency_guard", "sluice_latency_guard.wasm"), ("model_router", "sluice_model_router.wasm"), ("tenant_budget", "sluice_tenant_budget.wasm")];

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("configuration is not valid JSON: {0}")]
    Json(String),
    #[error("configuration must be a JSON object with one member per policy section ({})", SECTIONS.join(", "))]
    NotAnObject,
    #[error("unknown section `{0}`: expected one of {known}", known = SECTIONS.join(", "))]
    UnknownSection(String),
    #[error("no policy section: name at least one of {}", SECTIONS.join(", "))]
    Empty,
    #[error("{section}: this policy is not run by sluice.wasm yet; configure {filter} for it")]
    NotYet { section: String, filter: &'static str },
    /// A single-policy build's own configuration error, as that policy words it.
    #[error("{0}")]
    Policy(String),
    #[error("{section}.{problem}")]
    Section { section: &'static str, problem: String },
}

/// Every configured policy, validated.
#[derive(Debug, Default)]
pub struct Sections {
    pub llm_metrics: Option<MetricsPolicy>,
}

impl Sections {
    /// A configuration with one section per policy (`sluice.wasm`).
    pub fn parse(bytes: &[u8]) -> Result<Sections, ConfigError> {
        let text = std::str::from_utf8(bytes).map_err(|e| ConfigError::Json(format!("not UTF-8: {e}")))?;
        if text.trim().is_empty() {
            return Err(ConfigError::Empty);
        }
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| ConfigError::Json(e.to_string()))?;
        let serde_json::Value::Object(members) = value else { return Err(ConfigError::NotAnObject) };
        if members.is_empty() {
            return Err(ConfigError::Empty);
        }
        let mut sections = Sections::default();
        for (name, section) in members {
            match name.as_str() {
                "llm_metrics" => sections.llm_metrics = Some(llm_metrics(&section.to_string(), "llm_metrics")?),
                other => {
                    return Err(match NOT_YET_IN_ENGINE.iter().find(|(s, _)| *s == other) {
                        Some((section, filter)) => ConfigError::NotYet { section: (*section).to_string(), filter },
                        None => ConfigError::UnknownSection(other.to_string()),
                    })
                }
            }
        }
        Ok(sections)
    }

    /// A configuration that is llm-metrics' alone, unwrapped (`sluice_llm_metrics.wasm`): an empty
    /// one means all defaults, as it always has.
    pub fn llm_metrics_only(bytes: &[u8]) -> Result<Sections, ConfigError> {
        let settings = MetricsSettings::parse(bytes).map_err(|e| ConfigError::Policy(e.to_string()))?;
        Ok(Sections { llm_metrics: Some(MetricsPolicy::new(settings)) })
    }
}

fn llm_metrics(text: &str, section: &'static str) -> Result<MetricsPolicy, ConfigError> {
    MetricsSettings::parse(text.as_bytes()).map(MetricsPolicy::new).map_err(|e| ConfigError::Section { section, problem: e.to_string() })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;

    fn err(json: &str) -> String {
        match Sections::parse(json.as_bytes()) {
            Ok(_) => panic!("accepted {json}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn the_shipped_llm_metrics_policy_is_a_section_unchanged() {
        let policy = include_str!("../../../policies/llm-metrics.demo.json");
        let s = Sections::parse(format!(r#"{{"llm_metrics":{policy}}}"#).as_bytes()).unwrap();
        assert_eq!(s.llm_metrics.unwrap().settings.prices.len(), 4);
    }

    #[test]
    fn errors_name_the_section_and_the_field() {
        assert_eq!(err(r#"{"llm_metrics":{"path_prefixes":["v1"]}}"#), "llm_metrics.path_prefixes[0]: must start with '/', got \"v1\"");
        assert!(err(r#"{"llm_metrics":{"path_prefix":[]}}"#).starts_with("llm_metrics."), "{}", err(r#"{"llm_metrics":{"path_prefix":[]}}"#));
        assert!(err(r#"{"llm_metrics":{"path_prefix":[]}}"#).contains("unknown field `path_prefix`"));
        assert_eq!(err(r#"{"llm_metric":{}}"#), "unknown section `llm_metric`: expected one of latency_guard, model_router, tenant_budget, llm_metrics");
        assert_eq!(err("{}"), "no policy section: name at least one of latency_guard, model_router, tenant_budget, llm_metrics");
        assert_eq!(err(""), err("{}"));
        assert!(err("[1]").starts_with("configuration must be a JSON object"));
        assert!(err("{nope").starts_with("configuration is not valid JSON"));
        assert_eq!(err(r#"{"model_router":{}}"#), "model_router: this policy is not run by sluice.wasm yet; configure sluice_model_router.wasm for it");
    }

    #[test]
    fn the_single_section_build_reads_its_policy_unwrapped() {
        assert!(Sections::llm_metrics_only(b"").unwrap().llm_metrics.is_some());
        assert!(Sections::llm_metrics_only(br#"{"llm_metrics":{}}"#).unwrap_err().to_string().contains("unknown field `llm_metrics`"));
    }
}
