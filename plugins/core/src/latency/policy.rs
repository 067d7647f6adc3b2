//! The latency-guard policy: tenant classes (name → priority, tenant globs) and, per model version,
//! deadlines, an output-token ceiling, an in-flight limit and the SLO breaker (objectives, window,
//! minimum samples, open time, hysteresis, probes, fallback version and what each priority gets
//! while the breaker is open). Parsed from JSON once and validated with errors naming the field
//! (`versions[1].breaker.objective.ttft_ms: …`); the compiled [`LatencyPolicy`] is then only read.

use super::breaker::BreakerConfig;
use super::shed::{InFlightLimit, Priority};
use super::sketch::SketchParams;
use super::window::WindowConfig;
use crate::price::glob_match;
use serde::Deserialize;
use std::collections::BTreeMap;

/// Longest deadline or objective accepted: one hour (the sketch's range).
pub const MAX_MS: u64 = 3_600_000;
/// Most tenant classes.
pub const MAX_CLASSES: usize = 64;
/// Most tenant globs per class.
pub const MAX_TENANT_GLOBS: usize = 1024;
/// Most model versions.
pub const MAX_VERSIONS: usize = 1024;
/// Class of tenants no class matches when `default_class` is not set (priority sheddable).
pub const OTHER_CLASS: &str = "other";

// ---------------------------------------------------------------------------------------------
// As written.

/// Policy as written by the operator (the plugin's `configuration`).
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct LatencyPolicyConfig {
    /// Where the (authenticated) tenant comes from; required when a class lists tenants.
    #[serde(default)]
    pub tenant: Option<TenantSourceConfig>,
    #[serde(default)]
    pub classes: Vec<ClassConfig>,
    /// Class of tenants no class matches; default: `other`, sheddable.
    #[serde(default)]
    pub default_class: Option<String>,
    pub versions: Vec<VersionConfig>,
}

/// Exactly one of the fields.
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct TenantSourceConfig {
    /// A request header set by an authentication filter in front of sluice.
    #[serde(default)]
    pub header: Option<String>,
    /// A host property path (e.g. JWT metadata).
    #[serde(default)]
    pub property: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ClassConfig {
    pub name: String,
    pub priority: Priority,
    /// Tenant globs (`*`, `?`); the first class with a matching glob wins.
    #[serde(default)]
    pub tenants: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct VersionConfig {
    /// The model version (as model-router names it).
    pub name: String,
    /// No content token by then: abandon upstream (retry on the fallback or answer 504).
    #[serde(default)]
    pub ttft_deadline_ms: Option<u64>,
    /// The whole response by then: end the stream with an error event.
    #[serde(default)]
    pub total_deadline_ms: Option<u64>,
    /// Ceiling on any request's output tokens.
    #[serde(default)]
    pub max_output_tokens: Option<u64>,
    #[serde(default)]
    pub in_flight: Option<InFlightConfig>,
    #[serde(default)]
    pub breaker: Option<BreakerJson>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct InFlightConfig {
    pub limit: u64,
    #[serde(default = "default_standard_extra")]
    pub standard_extra_percent: u32,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct BreakerJson {
    pub objective: ObjectiveConfig,
    /// Window length, seconds.
    pub window_s: u64,
    /// Slots the window is kept in (its resolution: a slot leaves the window at once).
    #[serde(default = "default_slots")]
    pub slots: u32,
    pub min_samples: u64,
    pub open_for_ms: u64,
    #[serde(default = "default_hysteresis")]
    pub hysteresis_percent: u32,
    #[serde(default = "default_probe_percent")]
    pub probe_percent: u32,
    #[serde(default = "default_probes")]
    pub probes: u64,
    /// Version that takes the traffic while this one is open.
    #[serde(default)]
    pub fallback: Option<String>,
    #[serde(default)]
    pub while_open: WhileOpenConfig,
}

/// At least one of `ttft_ms`, `tpot_ms`, `error_per_mille`.
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ObjectiveConfig {
    /// The percentile latency objectives are read at.
    #[serde(default = "default_percentile")]
    pub percentile: f64,
    #[serde(default)]
    pub ttft_ms: Option<u64>,
    /// Time per output token.
    #[serde(default)]
    pub tpot_ms: Option<u64>,
    #[serde(default)]
    pub error_per_mille: Option<u32>,
}

/// What each priority gets while the breaker is open. Default with a fallback: critical and
/// standard fail over, sheddable is refused; without one: everyone is refused.
#[derive(Debug, Deserialize, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct WhileOpenConfig {
    #[serde(default)]
    pub critical: Option<OpenAction>,
    #[serde(default)]
    pub standard: Option<OpenAction>,
    #[serde(default)]
    pub sheddable: Option<OpenAction>,
}

/// A request's fate while its version's breaker is open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schema", serde(rename_all = "snake_case"))]
pub enum OpenAction {
    /// Send it to the fallback version.
    Fallback,
    /// Answer 503 with `retry-after`.
    Reject,
}

crate::json::unit_enum_deserialize!(OpenAction {
    Fallback = "fallback",
    Reject = "reject",
});

fn default_standard_extra() -> u32 {
    25
}
fn default_slots() -> u32 {
    6
}
fn default_hysteresis() -> u32 {
    10
}
fn default_probe_percent() -> u32 {
    10
}
fn default_probes() -> u64 {
    20
}
fn default_percentile() -> f64 {
    95.0
}

// ---------------------------------------------------------------------------------------------
// Compiled.

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantSource {
    Header(String),
    Property(Vec<String>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantClass {
    pub name: String,
    pub priority: Priority,
    pub tenants: Vec<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct BreakerPolicy {
    pub config: BreakerConfig,
    pub window: WindowConfig,
    pub fallback: Option<String>,
    /// Indexed by [`Priority`] order: critical, standard, sheddable.
    while_open: [OpenAction; 3],
}

impl BreakerPolicy {
    pub fn action(&self, priority: Priority) -> OpenAction {
        let i = match priority {
            Priority::Critical => 0,
            Priority::Standard => 1,
            Priority::Sheddable => 2,
        };
        self.while_open.get(i).copied().unwrap_or(OpenAction::Reject)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct VersionPolicy {
    pub name: String,
    pub ttft_deadline_ns: Option<u64>,
    pub total_deadline_ns: Option<u64>,
    pub max_output_tokens: Option<u64>,
    pub in_flight: Option<InFlightLimit>,
    pub breaker: Option<BreakerPolicy>,
}

impl VersionPolicy {
    /// Shared-data key of the version's rolling window.
    pub fn window_key(&self) -> String {
        crate::text::join(&["sluice/latency-guard/window/", &self.name])
    }

    /// Shared-data key of the version's breaker state.
    pub fn breaker_key(&self) -> String {
        crate::text::join(&["sluice/latency-guard/breaker/", &self.name])
    }

    /// Shared-data key of the version's in-flight counter.
    pub fn in_flight_key(&self) -> String {
        crate::text::join(&["sluice/latency-guard/in-flight/", &self.name])
    }
}

/// A compiled policy.
#[derive(Debug, Clone, PartialEq)]
pub struct LatencyPolicy {
    pub tenant: Option<TenantSource>,
    pub classes: Vec<TenantClass>,
    /// Index into `classes` of the class of unmatched tenants; `None`: [`OTHER_CLASS`], sheddable.
    pub default_class: Option<usize>,
    pub versions: Vec<VersionPolicy>,
    by_name: BTreeMap<String, usize>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PolicyError {
    #[error("latency-guard policy is not valid JSON: {0}")]
    Json(String),
    #[error("{field}: {problem}")]
    Invalid { field: String, problem: String },
}

fn invalid(field: impl Into<String>, problem: impl Into<String>) -> PolicyError {
    PolicyError::Invalid { field: field.into(), problem: problem.into() }
}

/// Names become parts of metric names and store keys.
fn check_id(field: &str, id: &str) -> Result<(), PolicyError> {
    if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) {
        return Err(invalid(field, format!("must be 1–64 letters, digits, '-', '_' or '.', got {id:?}")));
    }
    Ok(())
}

fn in_range<T: PartialOrd + std::fmt::Display + Copy>(field: &str, v: T, lo: T, hi: T) -> Result<T, PolicyError> {
    if v < lo || v > hi {
        return Err(invalid(field, format!("must be {lo}–{hi}, got {v}")));
    }
    Ok(v)
}

impl LatencyPolicy {
    pub fn from_json(bytes: &[u8]) -> Result<LatencyPolicy, PolicyError> {
        let config: LatencyPolicyConfig = crate::json::parse_config(bytes).map_err(PolicyError::Json)?;
        LatencyPolicy::compile(config)
    }

    pub fn compile(c: LatencyPolicyConfig) -> Result<LatencyPolicy, PolicyError> {
        let tenant = match &c.tenant {
            None => None,
            Some(t) => Some(match (&t.header, &t.property) {
                (Some(h), None) => {
                    let tchar = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
                    if h.is_empty() || h.len() > 128 || !h.bytes().all(tchar) {
                        return Err(invalid("tenant.header", format!("must be an HTTP header name (1–128 token characters), got {h:?}")));
                    }
                    TenantSource::Header(h.to_ascii_lowercase())
                }
                (None, Some(p)) => {
                    if p.is_empty() || p.len() > 16 {
                        return Err(invalid("tenant.property", "must be a path of 1–16 non-empty segments"));
                    }
                    if let Some(i) = p.iter().position(String::is_empty) {
                        return Err(invalid(format!("tenant.property[{i}]"), "must not be empty"));
                    }
                    TenantSource::Property(p.clone())
                }
                _ => return Err(invalid("tenant", "set exactly one of header, property")),
            }),
        };

        if c.classes.len() > MAX_CLASSES {
            return Err(invalid("classes", format!("at most {MAX_CLASSES} classes, got {}", c.classes.len())));
        }
        let mut classes: Vec<TenantClass> = Vec::with_capacity(c.classes.len());
        for (ci, class) in c.classes.iter().enumerate() {
            let cf = format!("classes[{ci}]");
            check_id(&format!("{cf}.name"), &class.name)?;
            if let Some(first) = classes.iter().position(|o| o.name == class.name) {
                return Err(invalid(format!("{cf}.name"), format!("{:?} is already defined at classes[{first}]", class.name)));
            }
            if class.tenants.len() > MAX_TENANT_GLOBS {
                return Err(invalid(format!("{cf}.tenants"), format!("at most {MAX_TENANT_GLOBS} globs, got {}", class.tenants.len())));
            }
            for (gi, g) in class.tenants.iter().enumerate() {
                if g.is_empty() || g.len() > 256 {
                    return Err(invalid(format!("{cf}.tenants[{gi}]"), "must be a glob of 1–256 bytes"));
                }
            }
            if !class.tenants.is_empty() && tenant.is_none() {
                return Err(invalid(format!("{cf}.tenants"), "set `tenant` to say where the tenant comes from"));
            }
            classes.push(TenantClass { name: class.name.clone(), priority: class.priority, tenants: class.tenants.clone() });
        }
        let default_class = match &c.default_class {
            None => None,
            Some(name) => {
                Some(classes.iter().position(|k| k.name == *name).ok_or_else(|| invalid("default_class", format!("{name:?} is not a class of the policy")))?)
            }
        };

        if c.versions.is_empty() {
            return Err(invalid("versions", "list at least one model version"));
        }
        if c.versions.len() > MAX_VERSIONS {
            return Err(invalid("versions", format!("at most {MAX_VERSIONS} versions, got {}", c.versions.len())));
        }
        let mut versions = Vec::with_capacity(c.versions.len());
        let mut by_name = BTreeMap::new();
        for (vi, v) in c.versions.iter().enumerate() {
            let vf = format!("versions[{vi}]");
            check_id(&format!("{vf}.name"), &v.name)?;
            if let Some(first) = by_name.insert(v.name.clone(), vi) {
                return Err(invalid(format!("{vf}.name"), format!("{:?} is already defined at versions[{first}]", v.name)));
            }
            versions.push(compile_version(&vf, v)?);
        }
        // A fallback the policy does not know is a typo that would silently disable failing over.
        for (vi, v) in versions.iter().enumerate() {
            if let Some(f) = v.breaker.as_ref().and_then(|b| b.fallback.as_deref()) {
                if !by_name.contains_key(f) {
                    return Err(invalid(
                        format!("versions[{vi}].breaker.fallback"),
                        format!("{f:?} is not a version of the policy (list it, even without objectives)"),
                    ));
                }
            }
        }
        Ok(LatencyPolicy { tenant, classes, default_class, versions, by_name })
    }

    /// The latency policy of a model version, if it has one.
    pub fn version(&self, name: &str) -> Option<&VersionPolicy> {
        self.by_name.get(name).and_then(|&i| self.versions.get(i))
    }

    /// The class name and priority of a tenant (`None`: unknown tenant): the first class with a
    /// matching glob, else the default class, else [`OTHER_CLASS`] (sheddable).
    pub fn classify(&self, tenant: Option<&str>) -> (&str, Priority) {
        if let Some(t) = tenant {
            if let Some(class) = self.classes.iter().find(|c| c.tenants.iter().any(|g| glob_match(g, t))) {
                return (&class.name, class.priority);
            }
        }
        match self.default_class.and_then(|i| self.classes.get(i)) {
            Some(class) => (&class.name, class.priority),
            None => (OTHER_CLASS, Priority::Sheddable),
        }
    }
}

fn compile_version(vf: &str, v: &VersionConfig) -> Result<VersionPolicy, PolicyError> {
    let ms = |field: &str, value: Option<u64>| -> Result<Option<u64>, PolicyError> {
        value.map(|x| in_range(&format!("{vf}.{field}"), x, 1, MAX_MS).map(|x| x * 1_000_000)).transpose()
    };
    let ttft_deadline_ns = ms("ttft_deadline_ms", v.ttft_deadline_ms)?;
    let total_deadline_ns = ms("total_deadline_ms", v.total_deadline_ms)?;
    if let (Some(ttft), Some(total)) = (ttft_deadline_ns, total_deadline_ns) {
        if ttft > total {
            return Err(invalid(format!("{vf}.ttft_deadline_ms"), format!("must not exceed total_deadline_ms ({} > {})", ttft / 1_000_000, total / 1_000_000)));
        }
    }
    let max_output_tokens = v.max_output_tokens.map(|t| in_range(&format!("{vf}.max_output_tokens"), t, 1, 10_000_000)).transpose()?;
    let in_flight = match &v.in_flight {
        None => None,
        Some(f) => Some(InFlightLimit {
            limit: in_range(&format!("{vf}.in_flight.limit"), f.limit, 1, 1_000_000)?,
            standard_extra_percent: in_range(&format!("{vf}.in_flight.standard_extra_percent"), f.standard_extra_percent, 0, 1000)?,
        }),
    };
    let breaker = v.breaker.as_ref().map(|b| compile_breaker(&format!("{vf}.breaker"), &v.name, b)).transpose()?;
    Ok(VersionPolicy { name: v.name.clone(), ttft_deadline_ns, total_deadline_ns, max_output_tokens, in_flight, breaker })
}

fn compile_breaker(bf: &str, version: &str, b: &BreakerJson) -> Result<BreakerPolicy, PolicyError> {
    let of = format!("{bf}.objective");
    let o = &b.objective;
    if !o.percentile.is_finite() || !(1.0..=99.9).contains(&o.percentile) {
        return Err(invalid(format!("{of}.percentile"), format!("must be 1–99.9, got {}", o.percentile)));
    }
    if o.ttft_ms.is_none() && o.tpot_ms.is_none() && o.error_per_mille.is_none() {
        return Err(invalid(&of, "set at least one of ttft_ms, tpot_ms, error_per_mille"));
    }
    let ttft_us = o.ttft_ms.map(|t| in_range(&format!("{of}.ttft_ms"), t, 1, MAX_MS).map(|t| t * 1000)).transpose()?;
    let tpot_us = o.tpot_ms.map(|t| in_range(&format!("{of}.tpot_ms"), t, 1, MAX_MS).map(|t| t * 1000)).transpose()?;
    let error_per_mille = o.error_per_mille.map(|z| in_range(&format!("{of}.error_per_mille"), z, 0, 999)).transpose()?;

    let window_s = in_range(&format!("{bf}.window_s"), b.window_s, 1, 3600)?;
    let slots = in_range(&format!("{bf}.slots"), b.slots, 1, 60)?;
    let window_ms = window_s * 1000;
    if window_ms % u64::from(slots) != 0 {
        return Err(invalid(format!("{bf}.slots"), format!("must divide the window into whole milliseconds ({window_ms} ms / {slots})")));
    }
    let window =
        WindowConfig::new(slots, window_ms / u64::from(slots) * 1_000_000, SketchParams::DEFAULT).map_err(|e| invalid(format!("{bf}.slots"), e.to_string()))?;
    let min_samples = in_range(&format!("{bf}.min_samples"), b.min_samples, 1, 1_000_000)?;
    let open_for_ms = in_range(&format!("{bf}.open_for_ms"), b.open_for_ms, 100, 86_400_000)?;
    let hysteresis_percent = in_range(&format!("{bf}.hysteresis_percent"), b.hysteresis_percent, 0, 90)?;
    let probe_percent = in_range(&format!("{bf}.probe_percent"), b.probe_percent, 1, 100)?;
    let probes = in_range(&format!("{bf}.probes"), b.probes, 1, 100_000)?;

    if let Some(f) = &b.fallback {
        check_id(&format!("{bf}.fallback"), f)?;
        if f == version {
            return Err(invalid(format!("{bf}.fallback"), "must name another version"));
        }
    }
    let default = |p: Priority| match (&b.fallback, p) {
        (Some(_), Priority::Critical | Priority::Standard) => OpenAction::Fallback,
        _ => OpenAction::Reject,
    };
    let mut while_open = [OpenAction::Reject; 3];
    let w = &b.while_open;
    for ((slot, p), given) in while_open.iter_mut().zip(Priority::ALL).zip([w.critical, w.standard, w.sheddable]) {
        let action = given.unwrap_or_else(|| default(p));
        if action == OpenAction::Fallback && b.fallback.is_none() {
            return Err(invalid(format!("{bf}.while_open.{}", p.as_str()), format!("`fallback` needs {bf}.fallback")));
        }
        *slot = action;
    }

    Ok(BreakerPolicy {
        config: BreakerConfig {
            percentile: o.percentile,
            ttft_us,
            tpot_us,
            error_per_mille,
            min_samples,
            open_for_ns: open_for_ms * 1_000_000,
            hysteresis_percent,
            probe_percent,
            probes,
        },
        window,
        fallback: b.fallback.clone(),
        while_open,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn the_shipped_policies_compile() {
        let example = LatencyPolicy::from_json(include_bytes!("../../../../policies/latency-guard.example.json")).unwrap();
        assert_eq!(example.classify(Some("chat-eu-1")), ("interactive", Priority::Critical));
        assert_eq!(example.classify(Some("eval-nightly")), ("batch", Priority::Sheddable));
        assert_eq!(example.classify(Some("someone-else")), ("standard", Priority::Standard));
        let v1 = example.version("llama-v1").unwrap();
        assert_eq!((v1.ttft_deadline_ns, v1.total_deadline_ns, v1.max_output_tokens), (Some(2 * S), Some(180 * S), None));
        assert_eq!(v1.in_flight.map(|l| (l.limit, l.standard_limit())), Some((256, 320)));
        let b = v1.breaker.as_ref().unwrap();
        assert_eq!((b.config.percentile, b.config.ttft_us, b.config.tpot_us, b.config.error_per_mille), (99.0, Some(450_000), None, Some(20)));
        assert_eq!((b.config.min_samples, b.config.open_for_ns, b.config.probes, b.config.probe_percent), (50, 60 * S, 200, 20));
        assert_eq!((b.window.window_ns(), b.window.slots()), (60 * S, 6));
        assert_eq!(b.fallback.as_deref(), Some("llama-v2"));
        assert_eq!(Priority::ALL.map(|p| b.action(p)), [OpenAction::Fallback, OpenAction::Fallback, OpenAction::Reject]);
        assert!(example.version("llama-v2").unwrap().breaker.is_none());

        let e2e = LatencyPolicy::from_json(include_bytes!("../../../../policies/latency-guard.e2e.json")).unwrap();
        assert_eq!(e2e.classify(Some("crit-1")), ("interactive", Priority::Critical));
        assert_eq!(e2e.classify(Some("batch-1")), ("batch", Priority::Sheddable));
        assert_eq!(e2e.classify(None), ("default", Priority::Standard));
        let v1 = e2e.version("v1").unwrap();
        assert_eq!((v1.ttft_deadline_ns, v1.total_deadline_ns), (Some(S), Some(4 * S)));
        let b = v1.breaker.as_ref().unwrap();
        assert_eq!((b.config.percentile, b.config.ttft_us, b.config.error_per_mille), (95.0, Some(300_000), Some(200)));
        assert_eq!((b.window.window_ns(), b.window.slot_ns()), (4 * S, S));
        assert_eq!((b.config.probes, b.config.probe_percent, b.config.hysteresis_percent), (8, 25, 10));
        assert_eq!(b.fallback.as_deref(), Some("v2"));
        assert_eq!(e2e.version("v2").unwrap().ttft_deadline_ns, Some(2 * S));
    }
}
