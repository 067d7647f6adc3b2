//! The model-router policy as written (JSON) and compiled: sticky-key sources, headers, the trusted
//! override, and per logical model its versions (weights, ramps), fallback order and shadow.
//!
//! Validation is done once, at configuration time, with errors naming the offending field
//! (`models[0].versions[1].ramp[2].at: …`); the compiled [`RoutingPolicy`] is then only read.

use crate::budget::window::days_from_civil;
use serde::Deserialize;
use serde_json::Number;

/// Largest weight a version may have. Weights are relative integers: `{99, 1}`, `{990_000, 10_000}`
/// and `{9_900, 100}` mean the same split; the range allows splits down to one in a million.
pub const MAX_WEIGHT: u64 = 1_000_000;
/// Most versions one model may list (the decision is O(versions)).
pub const MAX_VERSIONS: usize = 64;
/// Most steps one ramp may have.
pub const MAX_RAMP_STEPS: usize = 64;
/// Most model entries.
pub const MAX_MODELS: usize = 1024;
/// Latest year a ramp step may name (nanoseconds since the epoch fit a `u64` until 2554).
pub const MAX_YEAR: u64 = 2500;

// ---------------------------------------------------------------------------------------------
// As written.

/// Policy as written by the operator (the plugin's `configuration`). See docs/model-router.md and
/// policies/model-router.schema.json.
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RoutingConfig {
    /// Sources of the sticky key, tried in order; default `[{"api_key": true}]`.
    #[serde(default = "default_sticky_key")]
    pub sticky_key: Vec<StickyKeyConfig>,
    /// Request header the plugin sets to the chosen version's `route` (the Envoy route matches it).
    #[serde(default = "default_route_header")]
    pub route_header: String,
    /// Request header the plugin sets to the chosen version's name (for llm-metrics and the log).
    #[serde(default = "default_version_header")]
    pub version_header: String,
    #[serde(default, rename = "override")]
    pub override_: Option<OverrideConfig>,
    pub models: Vec<ModelConfig>,
}

/// One sticky-key source: exactly one of the fields.
#[derive(Debug, Deserialize, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct StickyKeyConfig {
    /// A request header set by an authentication filter in front of sluice.
    #[serde(default)]
    pub header: Option<String>,
    /// The request's API key (`authorization: Bearer` / `x-api-key`), used by its SHA-256.
    #[serde(default)]
    pub api_key: Option<bool>,
    /// A host property path (e.g. JWT metadata).
    #[serde(default)]
    pub property: Option<Vec<String>>,
    /// The body's `user` field, as extracted to metadata by `json_to_metadata`
    /// ([`crate::contract::USER_METADATA`]).
    #[serde(default)]
    pub body_user: Option<bool>,
}

/// Forcing a version, for testing.
#[derive(Debug, Deserialize, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct OverrideConfig {
    /// The trusted source: a host property (e.g. a claim jwt_authn verified) naming the version.
    #[serde(default)]
    pub property: Option<Vec<String>>,
    /// A header a client might send to force a version: never honoured; the plugin strips it
    /// (and counts the attempt).
    #[serde(default)]
    pub client_header: Option<String>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Glob (`*`, `?`) over the `model` the client asks for.
    pub model: String,
    pub versions: Vec<VersionConfig>,
    /// Version names to fall back to, in order, when the chosen one is unhealthy. Default: every
    /// version in listed order (skipping versions whose weight is 0 at the time).
    #[serde(default)]
    pub fallback: Option<Vec<String>>,
    #[serde(default)]
    pub shadow: Option<ShadowConfig>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct VersionConfig {
    pub name: String,
    /// Integer 0–[`MAX_WEIGHT`]; applies until the first ramp step.
    pub weight: Number,
    /// Model name written into the request body.
    pub upstream_model: String,
    /// Value of the route header (what the Envoy route matches on).
    pub route: String,
    #[serde(default)]
    pub ramp: Vec<RampStepConfig>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RampStepConfig {
    /// `YYYY-MM-DDTHH:MM:SSZ` (UTC).
    pub at: String,
    pub weight: Number,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ShadowConfig {
    pub version: ShadowVersionConfig,
    /// Share of requests shadowed, 0–1.
    pub fraction: f64,
    /// Most shadow requests in flight at once (per Envoy process: the plugin counts them).
    pub max_concurrent: u32,
    /// Tenant globs whose requests are never shadowed.
    #[serde(default)]
    pub exclude_tenants: Vec<String>,
    /// Header (set by auth in front) naming the tenant; required with `exclude_tenants`.
    #[serde(default)]
    pub tenant_header: Option<String>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ShadowVersionConfig {
    pub name: String,
    pub upstream_model: String,
    /// Route tag of the shadow version (labels only; default: `name`).
    #[serde(default)]
    pub route: Option<String>,
    /// Envoy cluster the shadow callout goes to.
    pub cluster: String,
    /// `:authority` of the callout (default: `cluster`).
    #[serde(default)]
    pub authority: Option<String>,
}

fn default_sticky_key() -> Vec<StickyKeyConfig> {
    vec![StickyKeyConfig { api_key: Some(true), ..StickyKeyConfig::default() }]
}
fn default_route_header() -> String {
    "x-sluice-route".into()
}
fn default_version_header() -> String {
    "x-model-version".into()
}

// ---------------------------------------------------------------------------------------------
// Compiled.

/// Where a sticky key comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StickySource {
    /// A request header (lowercase name).
    Header(String),
    /// The API key, by its lowercase hex SHA-256 ([`crate::identity::sha256_hex`]).
    ApiKey,
    /// A host property path (`{"body_user": true}` compiles to [`crate::contract::USER_METADATA`]).
    Property(Vec<String>),
}

impl StickySource {
    /// Label for metrics: `"header"`, `"api_key"`, `"property"`.
    pub fn kind(&self) -> &'static str {
        match self {
            StickySource::Header(_) => "header",
            StickySource::ApiKey => "api_key",
            StickySource::Property(_) => "property",
        }
    }
}

/// A compiled model-router policy.
#[derive(Debug, Clone)]
pub struct RoutingPolicy {
    pub(super) sticky: Vec<StickySource>,
    pub(super) route_header: String,
    pub(super) version_header: String,
    pub(super) override_property: Option<Vec<String>>,
    pub(super) override_client_header: Option<String>,
    pub(super) models: Vec<ModelRoute>,
}

/// One logical model entry.
#[derive(Debug, Clone)]
pub struct ModelRoute {
    /// The glob it matches requested models with.
    pub pattern: String,
    pub versions: Vec<Version>,
    /// Indexes into `versions`, in fallback order.
    pub fallback: Vec<usize>,
    /// `fallback` was written by the operator (its versions are eligible whatever their weight);
    /// otherwise it is every version in order and versions of weight 0 at the time are skipped.
    pub fallback_explicit: bool,
    pub shadow: Option<Shadow>,
}

/// One version of a model.
#[derive(Debug, Clone)]
pub struct Version {
    pub name: String,
    /// Weight before the first ramp step.
    pub weight: u64,
    pub upstream_model: String,
    pub route: String,
    /// Steps in strictly increasing time.
    pub ramp: Vec<RampStep>,
}

impl Version {
    /// Weight at `now_ns`, and whether it comes from a ramp step.
    pub fn weight_at(&self, now_ns: u64) -> (u64, bool) {
        match self.ramp.iter().rev().find(|s| s.at_ns <= now_ns) {
            Some(step) => (step.weight, true),
            None => (self.weight, false),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RampStep {
    /// As written (`2026-12-01T00:00:00Z`).
    pub at: String,
    /// Nanoseconds since the Unix epoch.
    pub at_ns: u64,
    pub weight: u64,
}

/// Shadow traffic of one model.
#[derive(Debug, Clone)]
pub struct Shadow {
    pub version: ShadowVersion,
    pub fraction: f64,
    pub max_concurrent: u32,
    pub exclude_tenants: Vec<String>,
    /// Lowercase header name.
    pub tenant_header: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShadowVersion {
    pub name: String,
    pub upstream_model: String,
    pub route: String,
    pub cluster: String,
    pub authority: String,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RoutingPolicyError {
    #[error("model-router policy is not valid JSON: {0}")]
    Json(String),
    #[error("{field}: {problem}")]
    Invalid { field: String, problem: String },
}

fn invalid(field: impl Into<String>, problem: impl Into<String>) -> RoutingPolicyError {
    RoutingPolicyError::Invalid { field: field.into(), problem: problem.into() }
}

/// Version names and routes become header values, metric-name parts and store keys.
fn check_name(field: &str, name: &str) -> Result<(), RoutingPolicyError> {
    let ok = !name.is_empty() && name.len() <= 64 && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(invalid(field, format!("must be 1–64 of A–Z a–z 0–9 '_' '.' '-', got {name:?}")))
    }
}

/// An HTTP header name (RFC 9110 token, not a pseudo-header), returned lowercase.
fn header_name(field: &str, name: &str) -> Result<String, RoutingPolicyError> {
    let tchar = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if name.is_empty() || name.len() > 128 || !name.bytes().all(tchar) {
        return Err(invalid(field, format!("must be an HTTP header name (1–128 token characters), got {name:?}")));
    }
    Ok(name.to_ascii_lowercase())
}

fn property_path(field: &str, path: &[String]) -> Result<Vec<String>, RoutingPolicyError> {
    if path.is_empty() || path.len() > 16 {
        return Err(invalid(field, "must be a path of 1–16 non-empty segments"));
    }
    if let Some(i) = path.iter().position(String::is_empty) {
        return Err(invalid(format!("{field}[{i}]"), "must not be empty"));
    }
    Ok(path.to_vec())
}

/// Text written into a JSON body or a header: 1–256 bytes, no control characters.
fn check_text(field: &str, text: &str) -> Result<(), RoutingPolicyError> {
    if text.is_empty() || text.len() > 256 || text.chars().any(char::is_control) {
        return Err(invalid(field, format!("must be 1–256 bytes without control characters, got {text:?}")));
    }
    Ok(())
}

fn weight(field: &str, n: &Number) -> Result<u64, RoutingPolicyError> {
    match n.as_u64() {
        Some(w) if w <= MAX_WEIGHT => Ok(w),
        _ => Err(invalid(field, format!("must be a whole number 0–{MAX_WEIGHT}, got {n}"))),
    }
}

/// Nanoseconds since the epoch of a `YYYY-MM-DDTHH:MM:SSZ` UTC timestamp (years 1970–[`MAX_YEAR`]).
pub fn parse_utc_timestamp(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    if b.len() != 20 {
        return None;
    }
    let shape_ok = b.iter().enumerate().all(|(i, &c)| match i {
        4 | 7 => c == b'-',
        10 => c == b'T',
        13 | 16 => c == b':',
        19 => c == b'Z',
        _ => c.is_ascii_digit(),
    });
    if !shape_ok {
        return None;
    }
    let num = |from: usize, to: usize| -> u64 { b.get(from..to).unwrap_or_default().iter().fold(0u64, |acc, &d| acc * 10 + u64::from(d - b'0')) };
    let (year, month, day) = (num(0, 4), num(5, 7), num(8, 10));
    let (hour, minute, second) = (num(11, 13), num(14, 16), num(17, 19));
    if !(1970..=MAX_YEAR).contains(&year) || !(1..=12).contains(&month) || hour > 23 || minute > 59 || second > 59 {
        return None;
    }
    let first = days_from_civil(year, month, 1);
    let next = if month == 12 { days_from_civil(year + 1, 1, 1) } else { days_from_civil(year, month + 1, 1) };
    if day == 0 || day > next.saturating_sub(first) {
        return None;
    }
    let days = first + day - 1;
    let secs = days * 86_400 + hour * 3600 + minute * 60 + second;
    secs.checked_mul(1_000_000_000)
}

impl RoutingPolicy {
    /// Parse and validate a policy.
    pub fn from_json(bytes: &[u8]) -> Result<Self, RoutingPolicyError> {
        let config: RoutingConfig = crate::json::parse_config(bytes).map_err(RoutingPolicyError::Json)?;
        Self::compile(config)
    }

    pub fn compile(c: RoutingConfig) -> Result<Self, RoutingPolicyError> {
        if c.sticky_key.is_empty() {
            return Err(invalid("sticky_key", "list at least one source (omit the field for [{\"api_key\": true}]); with none every request would be unkeyed"));
        }
        let mut sticky = Vec::with_capacity(c.sticky_key.len());
        for (i, s) in c.sticky_key.iter().enumerate() {
            let f = format!("sticky_key[{i}]");
            let set =
                usize::from(s.header.is_some()) + usize::from(s.api_key.is_some()) + usize::from(s.property.is_some()) + usize::from(s.body_user.is_some());
            if set != 1 {
                return Err(invalid(f, "set exactly one of header, api_key, property, body_user"));
            }
            let source = match (&s.header, s.api_key, &s.property, s.body_user) {
                (Some(h), ..) => StickySource::Header(header_name(&format!("{f}.header"), h)?),
                (_, Some(true), ..) => StickySource::ApiKey,
                (_, _, Some(p), _) => StickySource::Property(property_path(&format!("{f}.property"), p)?),
                (.., Some(true)) => StickySource::Property(crate::contract::USER_METADATA.iter().map(|s| (*s).to_string()).collect()),
                (_, Some(false), ..) => return Err(invalid(format!("{f}.api_key"), "only `true` is meaningful; remove the entry instead")),
                _ => return Err(invalid(format!("{f}.body_user"), "only `true` is meaningful; remove the entry instead")),
            };
            if sticky.contains(&source) {
                return Err(invalid(f, "the same source is listed twice"));
            }
            sticky.push(source);
        }

        let route_header = header_name("route_header", &c.route_header)?;
        let version_header = header_name("version_header", &c.version_header)?;
        if route_header == version_header {
            return Err(invalid("version_header", "must differ from route_header"));
        }
        let (override_property, override_client_header) = match &c.override_ {
            None => (None, None),
            Some(o) => {
                if o.property.is_none() && o.client_header.is_none() {
                    return Err(invalid("override", "name a trusted property and/or the client_header to strip, or remove override"));
                }
                let property = o.property.as_deref().map(|p| property_path("override.property", p)).transpose()?;
                let client = o.client_header.as_deref().map(|h| header_name("override.client_header", h)).transpose()?;
                if let Some(h) = &client {
                    let clash = *h == route_header || *h == version_header || sticky.iter().any(|s| matches!(s, StickySource::Header(x) if x == h));
                    if clash {
                        return Err(invalid("override.client_header", format!("{h:?} is also a header the policy reads or writes; it would be stripped")));
                    }
                }
                (property, client)
            }
        };

        if c.models.is_empty() {
            return Err(invalid("models", "list at least one model"));
        }
        if c.models.len() > MAX_MODELS {
            return Err(invalid("models", format!("at most {MAX_MODELS} entries, got {}", c.models.len())));
        }
        let mut models: Vec<ModelRoute> = Vec::with_capacity(c.models.len());
        for (mi, m) in c.models.iter().enumerate() {
            let mf = format!("models[{mi}]");
            if m.model.is_empty() || m.model.len() > 256 {
                return Err(invalid(format!("{mf}.model"), "must be a glob of 1–256 bytes"));
            }
            if let Some(first) = models.iter().position(|o| o.pattern == m.model) {
                return Err(invalid(format!("{mf}.model"), format!("{:?} is already matched by models[{first}] (the first match wins)", m.model)));
            }
            models.push(compile_model(&mf, m)?);
        }
        Ok(RoutingPolicy { sticky, route_header, version_header, override_property, override_client_header, models })
    }
}

fn compile_model(mf: &str, m: &ModelConfig) -> Result<ModelRoute, RoutingPolicyError> {
    if m.versions.is_empty() || m.versions.len() > MAX_VERSIONS {
        return Err(invalid(format!("{mf}.versions"), format!("list 1–{MAX_VERSIONS} versions, got {}", m.versions.len())));
    }
    let mut versions: Vec<Version> = Vec::with_capacity(m.versions.len());
    for (vi, v) in m.versions.iter().enumerate() {
        let vf = format!("{mf}.versions[{vi}]");
        check_name(&format!("{vf}.name"), &v.name)?;
        if versions.iter().any(|o| o.name == v.name) {
            return Err(invalid(format!("{vf}.name"), format!("version {:?} is listed twice", v.name)));
        }
        check_name(&format!("{vf}.route"), &v.route)?;
        check_text(&format!("{vf}.upstream_model"), &v.upstream_model)?;
        let w = weight(&format!("{vf}.weight"), &v.weight)?;
        if v.ramp.len() > MAX_RAMP_STEPS {
            return Err(invalid(format!("{vf}.ramp"), format!("at most {MAX_RAMP_STEPS} steps, got {}", v.ramp.len())));
        }
        let mut ramp: Vec<RampStep> = Vec::with_capacity(v.ramp.len());
        for (si, s) in v.ramp.iter().enumerate() {
            let sf = format!("{vf}.ramp[{si}]");
            let at_ns = parse_utc_timestamp(&s.at)
                .ok_or_else(|| invalid(format!("{sf}.at"), format!("must be a UTC time YYYY-MM-DDTHH:MM:SSZ between 1970 and {MAX_YEAR}, got {:?}", s.at)))?;
            if let Some(prev) = ramp.last() {
                if at_ns <= prev.at_ns {
                    return Err(invalid(
                        format!("{sf}.at"),
                        format!("{} is not after the previous step ({}); steps must be in increasing time", s.at, prev.at),
                    ));
                }
            }
            ramp.push(RampStep { at: s.at.clone(), at_ns, weight: weight(&format!("{sf}.weight"), &s.weight)? });
        }
        versions.push(Version { name: v.name.clone(), weight: w, upstream_model: v.upstream_model.clone(), route: v.route.clone(), ramp });
    }
    // Weights are piecewise constant between ramp steps: checking at t = 0 and at every step covers
    // all time.
    let mut instants: Vec<(u64, Option<&str>)> = vec![(0, None)];
    for v in &versions {
        instants.extend(v.ramp.iter().map(|s| (s.at_ns, Some(s.at.as_str()))));
    }
    for (t, label) in instants {
        if versions.iter().all(|v| v.weight_at(t).0 == 0) {
            let when = label.map_or_else(|| "before any ramp step".to_string(), |at| format!("from {at}"));
            return Err(invalid(format!("{mf}.versions"), format!("every version has weight 0 {when}; at least one must have weight > 0 at all times")));
        }
    }

    let (fallback, fallback_explicit) = match &m.fallback {
        None => ((0..versions.len()).collect(), false),
        Some(names) => {
            let mut order: Vec<usize> = Vec::with_capacity(names.len());
            for (fi, name) in names.iter().enumerate() {
                let ff = format!("{mf}.fallback[{fi}]");
                let i = versions.iter().position(|v| v.name == *name).ok_or_else(|| invalid(&ff, format!("{name:?} is not a version of this model")))?;
                if order.contains(&i) {
                    return Err(invalid(ff, format!("{name:?} is listed twice")));
                }
                order.push(i);
            }
            if order.is_empty() {
                return Err(invalid(format!("{mf}.fallback"), "must list at least one version (omit it for every version in order)"));
            }
            (order, true)
        }
    };

    let shadow = m.shadow.as_ref().map(|s| compile_shadow(&format!("{mf}.shadow"), s)).transpose()?;
    Ok(ModelRoute { pattern: m.model.clone(), versions, fallback, fallback_explicit, shadow })
}

fn compile_shadow(sf: &str, s: &ShadowConfig) -> Result<Shadow, RoutingPolicyError> {
    let v = &s.version;
    check_name(&format!("{sf}.version.name"), &v.name)?;
    check_text(&format!("{sf}.version.upstream_model"), &v.upstream_model)?;
    let route = v.route.clone().unwrap_or_else(|| v.name.clone());
    check_name(&format!("{sf}.version.route"), &route)?;
    check_text(&format!("{sf}.version.cluster"), &v.cluster)?;
    if v.cluster.contains(char::is_whitespace) {
        return Err(invalid(format!("{sf}.version.cluster"), "must not contain whitespace"));
    }
    let authority = v.authority.clone().unwrap_or_else(|| v.cluster.clone());
    check_text(&format!("{sf}.version.authority"), &authority)?;
    if !s.fraction.is_finite() || !(0.0..=1.0).contains(&s.fraction) {
        return Err(invalid(format!("{sf}.fraction"), format!("must be 0–1, got {}", s.fraction)));
    }
    if s.max_concurrent == 0 || s.max_concurrent > 100_000 {
        return Err(invalid(format!("{sf}.max_concurrent"), format!("must be 1–100000, got {}", s.max_concurrent)));
    }
    for (i, t) in s.exclude_tenants.iter().enumerate() {
        if t.is_empty() || t.len() > 256 {
            return Err(invalid(format!("{sf}.exclude_tenants[{i}]"), "must be a glob of 1–256 bytes"));
        }
    }
    let tenant_header = s.tenant_header.as_deref().map(|h| header_name(&format!("{sf}.tenant_header"), h)).transpose()?;
    if !s.exclude_tenants.is_empty() && tenant_header.is_none() {
        return Err(invalid(format!("{sf}.tenant_header"), "required with exclude_tenants: the header (set by auth in front) that names the tenant"));
    }
    Ok(Shadow {
        version: ShadowVersion { name: v.name.clone(), upstream_model: v.upstream_model.clone(), route, cluster: v.cluster.clone(), authority },
        fraction: s.fraction,
        max_concurrent: s.max_concurrent,
        exclude_tenants: s.exclude_tenants.clone(),
        tenant_header,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps() {
        assert_eq!(parse_utc_timestamp("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_utc_timestamp("2026-12-01T00:00:00Z"), Some(1_796_083_200 * 1_000_000_000));
        assert_eq!(parse_utc_timestamp("2024-02-29T23:59:59Z"), Some(1_709_251_199 * 1_000_000_000));
        for bad in [
            "2023-02-29T00:00:00Z",
            "2026-13-01T00:00:00Z",
            "2026-00-01T00:00:00Z",
            "2026-04-31T00:00:00Z",
            "2026-01-01T24:00:00Z",
            "2026-01-01T00:60:00Z",
            "2026-01-01T00:00:60Z",
            "2026-01-01 00:00:00Z",
            "2026-01-01T00:00:00",
            "2026-01-01T00:00:00+00:00",
            "2026-01-01T00:00:00.5Z",
            "1969-12-31T23:59:59Z",
            "2501-01-01T00:00:00Z",
            "２026-01-01T00:00:00Z",
            "",
        ] {
            assert_eq!(parse_utc_timestamp(bad), None, "{bad}");
        }
        assert!(parse_utc_timestamp("2500-12-31T23:59:59Z").is_some());
    }
}
