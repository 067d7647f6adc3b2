//! The plugin's JSON configuration (Envoy `configuration` / Istio `pluginConfig`): parsed and
//! validated once at configure time into [`Settings`], shared by every stream of the VM.

use crate::price::{PriceEntry, PriceTable};
use serde::Deserialize;

/// Configuration as written by the operator. Unknown fields are refused so a typo is an error, not
/// a silently ignored knob. See docs/configuration.md and policies/llm-metrics.schema.json.
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Requests whose path starts with one of these prefixes and ends in a known LLM API path are
    /// measured; everything else passes with one string comparison.
    #[serde(default = "default_path_prefixes")]
    pub path_prefixes: Vec<String>,
    /// Request header naming the model version; when absent the request body's `model` is used.
    #[serde(default = "default_model_version_header")]
    pub model_version_header: String,
    /// Model versions that always keep their own label.
    #[serde(default)]
    pub model_versions: Vec<String>,
    /// How many other distinct model versions get their own label (per VM) before `other`.
    #[serde(default = "default_max_dynamic_model_versions")]
    pub max_dynamic_model_versions: usize,
    /// Where the authenticated tenant comes from.
    #[serde(default)]
    pub tenant: TenantSource,
    /// Tenants that get their own label; every other tenant is `other`, no tenant is `anonymous`.
    #[serde(default)]
    pub tenants: Vec<String>,
    /// Prices per model (glob); cost is only reported for models that match.
    #[serde(default)]
    pub prices: Vec<PriceEntry>,
    /// Largest request body inspected for model, turns and prompt size; larger bodies still pass
    /// untouched, measured without those labels.
    #[serde(default = "default_max_request_body_bytes")]
    pub max_request_body_bytes: usize,
    /// Largest non-streaming response body inspected for usage.
    #[serde(default = "default_max_response_body_bytes")]
    pub max_response_body_bytes: usize,
    /// Append `: sluice ttft_us=… tpot_us=… output_tokens=…` as a final SSE comment to streams, so a
    /// client can read its own numbers. SSE clients ignore comments.
    #[serde(default)]
    pub stream_summary_comment: bool,
    /// Filter-state key of the access-log stamp: `%FILTER_STATE(wasm.<key>:PLAIN)%`.
    #[serde(default = "default_filter_state_key")]
    pub filter_state_key: String,
}

/// The authenticated source of the tenant name.
#[derive(Debug, Deserialize, Default, Clone, PartialEq)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum TenantSource {
    /// No tenant label (every request is `anonymous`).
    #[default]
    None,
    /// A request header written by an authentication filter in front of sluice (which must
    /// overwrite any client-supplied value).
    Header(String),
    /// An Envoy attribute path, e.g. `["metadata", "filter_metadata", "envoy.filters.http.jwt_authn", "tenant"]`
    /// or a filter-state value set by another filter.
    Property(Vec<String>),
}

/// What an empty configuration (`{}`) means: every field at its serde default.
impl Default for Config {
    fn default() -> Config {
        Config {
            path_prefixes: default_path_prefixes(),
            model_version_header: default_model_version_header(),
            model_versions: Vec::new(),
            max_dynamic_model_versions: default_max_dynamic_model_versions(),
            tenant: TenantSource::default(),
            tenants: Vec::new(),
            prices: Vec::new(),
            max_request_body_bytes: default_max_request_body_bytes(),
            max_response_body_bytes: default_max_response_body_bytes(),
            stream_summary_comment: false,
            filter_state_key: default_filter_state_key(),
        }
    }
}

fn default_path_prefixes() -> Vec<String> {
    vec!["/".into()]
}
fn default_model_version_header() -> String {
    "x-model-version".into()
}
fn default_max_dynamic_model_versions() -> usize {
    32
}
fn default_max_request_body_bytes() -> usize {
    4 * 1024 * 1024
}
fn default_max_response_body_bytes() -> usize {
    4 * 1024 * 1024
}
fn default_filter_state_key() -> String {
    "sluice_llm".into()
}

/// Upper bound for the body caps: the plugin copies up to this much per request.
const MAX_BODY_CAP: usize = 64 * 1024 * 1024;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("configuration is not valid JSON for sluice llm-metrics: {0}")]
    Json(String),
    #[error("{field}: {problem}")]
    Invalid { field: String, problem: String },
    #[error("prices: {0}")]
    Prices(String),
}

fn invalid(field: &str, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field: field.into(), problem: problem.into() }
}

/// Validated, ready-to-use configuration.
#[derive(Debug)]
pub struct Settings {
    pub path_prefixes: Vec<String>,
    pub model_version_header: String,
    pub model_versions: Vec<String>,
    pub max_dynamic_model_versions: usize,
    pub tenant: TenantSource,
    pub tenants: Vec<String>,
    pub prices: PriceTable,
    pub max_request_body_bytes: usize,
    pub max_response_body_bytes: usize,
    pub stream_summary_comment: bool,
    pub filter_state_key: String,
}

impl Settings {
    /// Parses and validates; an empty configuration means all defaults.
    pub fn parse(bytes: &[u8]) -> Result<Settings, ConfigError> {
        let text = std::str::from_utf8(bytes).map_err(|e| ConfigError::Json(format!("not UTF-8: {e}")))?;
        let config: Config = crate::json::parse_config(if text.trim().is_empty() { b"{}" } else { text.as_bytes() }).map_err(ConfigError::Json)?;
        Settings::validate(config)
    }

    /// The settings of an empty configuration, as [`Settings::parse`] gives them for `{}`, without
    /// the JSON parser: a host that always runs llm-metrics with its defaults (the playground's
    /// page) then carries no deserializer of the configuration.
    pub fn defaults() -> Result<Settings, ConfigError> {
        Settings::validate(Config::default())
    }

    fn validate(c: Config) -> Result<Settings, ConfigError> {
        if c.path_prefixes.is_empty() {
            return Err(invalid("path_prefixes", "must list at least one prefix (use \"/\" for all paths)"));
        }
        for (i, p) in c.path_prefixes.iter().enumerate() {
            if !p.starts_with('/') {
                return Err(invalid(&format!("path_prefixes[{i}]"), format!("must start with '/', got {p:?}")));
            }
        }
        let header = c.model_version_header.to_ascii_lowercase();
        if header.is_empty() || !header.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return Err(invalid("model_version_header", format!("must be a header name of letters, digits, '-' or '_', got {:?}", c.model_version_header)));
        }
        if c.max_dynamic_model_versions > 1000 {
            return Err(invalid(
                "max_dynamic_model_versions",
                format!("at most 1000 (each value multiplies the metric series), got {}", c.max_dynamic_model_versions),
            ));
        }
        match &c.tenant {
            TenantSource::Header(h) if h.is_empty() => return Err(invalid("tenant.header", "must not be empty")),
            TenantSource::Property(p) if p.is_empty() => return Err(invalid("tenant.property", "must be a non-empty attribute path")),
            _ => {}
        }
        for (field, v) in [("max_request_body_bytes", c.max_request_body_bytes), ("max_response_body_bytes", c.max_response_body_bytes)] {
            if v > MAX_BODY_CAP {
                return Err(invalid(field, format!("at most {MAX_BODY_CAP} bytes, got {v}")));
            }
        }
        if c.filter_state_key.is_empty() || !c.filter_state_key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.') {
            return Err(invalid("filter_state_key", format!("must be letters, digits, '_' or '.', got {:?}", c.filter_state_key)));
        }
        let prices = PriceTable::new(c.prices).map_err(|e| ConfigError::Prices(e.to_string()))?;
        Ok(Settings {
            path_prefixes: c.path_prefixes,
            model_version_header: header,
            model_versions: c.model_versions,
            max_dynamic_model_versions: c.max_dynamic_model_versions,
            tenant: c.tenant,
            tenants: c.tenants,
            prices,
            max_request_body_bytes: c.max_request_body_bytes,
            max_response_body_bytes: c.max_response_body_bytes,
            stream_summary_comment: c.stream_summary_comment,
            filter_state_key: c.filter_state_key,
        })
    }

    /// Whether a request path is measured at all.
    pub fn wants_path(&self, path: &str) -> bool {
        self.path_prefixes.iter().any(|p| path.starts_with(p.as_str()))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;

    fn err(json: &str) -> String {
        match Settings::parse(json.as_bytes()) {
            Ok(_) => panic!("accepted {json}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn empty_configuration_means_defaults() {
        let s = Settings::parse(b"").unwrap();
        assert_eq!(s.model_version_header, "x-model-version");
        assert_eq!(s.filter_state_key, "sluice_llm");
        assert!(s.wants_path("/v1/chat/completions"));
        assert_eq!(s.tenant, TenantSource::None);
    }

    #[test]
    fn defaults_are_the_empty_configuration() {
        assert_eq!(format!("{:?}", Settings::defaults().unwrap()), format!("{:?}", Settings::parse(b"{}").unwrap()));
        assert_eq!(format!("{:?}", Config::default()), format!("{:?}", crate::json::parse_config::<Config>(b"{}").unwrap()));
    }

    #[test]
    fn full_configuration_parses() {
        let s = Settings::parse(
            br#"{"path_prefixes":["/v1/"],"model_version_header":"X-Model-Version","tenant":{"header":"x-sluice-tenant"},
                "tenants":["acme"],"prices":[{"model":"gpt-4o*","input_usd_per_mtok":2.5,"output_usd_per_mtok":10}],
                "stream_summary_comment":true}"#,
        )
        .unwrap();
        assert_eq!(s.model_version_header, "x-model-version");
        assert_eq!(s.tenant, TenantSource::Header("x-sluice-tenant".into()));
        assert!(!s.wants_path("/healthz"));
        assert!(s.stream_summary_comment);
    }

    #[test]
    fn errors_name_the_field() {
        assert!(err(r#"{"path_prefix":["/v1"]}"#).contains("unknown field `path_prefix`"));
        assert!(err(r#"{"path_prefixes":["v1"]}"#).starts_with("path_prefixes[0]: must start with '/'"));
        assert!(err(r#"{"path_prefixes":[]}"#).starts_with("path_prefixes:"));
        assert!(err(r#"{"model_version_header":"x model"}"#).starts_with("model_version_header:"));
        assert!(err(r#"{"tenant":{"header":""}}"#).starts_with("tenant.header:"));
        assert!(err(r#"{"tenant":{"cookie":"a"}}"#).contains("unknown variant `cookie`"));
        assert!(err(r#"{"max_request_body_bytes":1000000000}"#).starts_with("max_request_body_bytes: at most"));
        assert!(err(r#"{"filter_state_key":"a b"}"#).starts_with("filter_state_key:"));
        assert!(err("{not json").starts_with("configuration is not valid JSON"));
        assert!(err(r#"{"prices":[{"model":"m","input_usd_per_mtok":-1,"output_usd_per_mtok":1}]}"#).starts_with("prices:"));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod shipped_examples {
    use super::*;

    /// The example shipped in policies/ (used by the demo gateway) must be accepted as is.
    #[test]
    fn demo_policy_is_valid() {
        let s = Settings::parse(include_bytes!("../../../../../policies/llm-metrics.demo.json")).unwrap();
        assert_eq!(s.tenant, TenantSource::Header("x-sluice-tenant".into()));
        assert_eq!(s.prices.len(), 4);
    }
}
