//! The workload: who sends what, and how each upstream serves. Either a synthetic load (a few
//! tenants, each with a rate, prompt and output sizes) or a pasted slice of a trace in the
//! simulator's generic JSONL format (docs/simulator.md, "Generic JSONL"), plus the simulator's own
//! service model (`upstream`, `default_upstream`, `incidents`: `sluice-workload`'s types, checks
//! and defaults, the ones `sluice-sim` reads) so that one workload can be replayed by `sluice-sim`
//! unchanged.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sluice_core::api::ApiKind;
use sluice_core::vecmap::VecMap;
use sluice_workload::traffic::{
    default_model, default_output_tokens, default_sample_every_ms, default_stream, default_tenant_header, default_users_per_tenant,
};
use sluice_workload::upstream::{check_incident, check_upstream};

/// The simulator's service model of an upstream and its incidents (shared, not copied).
pub use sluice_workload::upstream::{Incident, Upstream};

/// 2026-01-01T00:00:00Z, the simulator's default start: a minute, day and month boundary.
pub const DEFAULT_START_UNIX_MS: u64 = 1_767_225_600_000;
/// Most requests one run takes (the page must stay responsive).
pub const MAX_REQUESTS: usize = 20_000;

/// Why a workload cannot be used. Field paths are the workload's own (`tenants[1].rate_per_s`) or,
/// for a trace, the line and the field as the trace names it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkloadError {
    #[error("workload, field `{field}`: {message}")]
    Invalid { field: String, message: String },
    #[error("trace line {line}{}: {message}", field.as_ref().map(|f| format!(", field `{f}`")).unwrap_or_default())]
    Trace { line: u64, field: Option<String>, message: String },
    #[error("the workload has {0} requests; at most {MAX_REQUESTS} run in the playground (use sluice-sim for more)")]
    TooLarge(usize),
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> WorkloadError {
    WorkloadError::Invalid { field: field.into(), message: message.into() }
}

/// The workload as written (JSON, unknown fields refused).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    /// Every random draw (users, upstream errors) is a function of (seed, request line), as in the simulator.
    #[serde(default)]
    pub seed: u64,
    /// Wall-clock time of the first request: budgets' calendar windows are counted from it.
    #[serde(default = "default_start")]
    pub start_unix_ms: u64,
    /// Defaults for requests that do not say (the simulator's `traffic` section).
    #[serde(default)]
    pub traffic: Traffic,
    /// A synthetic load; ignored when a trace is given.
    #[serde(default)]
    pub tenants: Vec<TenantLoad>,
    /// How long the synthetic load lasts, seconds.
    #[serde(default = "default_duration")]
    pub duration_s: f64,
    /// The service model of each upstream (the route model-router writes, or the shadow's cluster).
    #[serde(default)]
    /// (Core's `VecMap`, deserialized as a `BTreeMap` is: one B-tree instantiation less in the page.)
    pub upstream: VecMap<String, Upstream>,
    #[serde(default)]
    pub default_upstream: Upstream,
    #[serde(default)]
    pub incidents: Vec<Incident>,
    /// How often breaker states, budgets and spend are sampled for the charts, ms.
    #[serde(default = "default_sample_every_ms")]
    pub sample_every_ms: u64,
    /// Round TTFT and time per output token to whole milliseconds (the simulator's option).
    #[serde(default)]
    pub whole_milliseconds: bool,
}

/// Defaults for requests that do not say, as the simulator's `traffic` section.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Traffic {
    #[serde(default = "default_tenant_header")]
    pub tenant_header: String,
    #[serde(default = "default_users_per_tenant")]
    pub users_per_tenant: u64,
    #[serde(default = "default_model")]
    pub model: String,
    #[serde(default = "default_stream")]
    pub stream: bool,
    /// The output limit of requests that give none: `null`, a number, or `"output"` (their output tokens).
    #[serde(default)]
    pub max_tokens: Value,
    #[serde(default = "default_output_tokens")]
    pub output_tokens: u64,
}

impl Default for Traffic {
    fn default() -> Self {
        Traffic {
            tenant_header: default_tenant_header(),
            users_per_tenant: default_users_per_tenant(),
            model: default_model(),
            stream: default_stream(),
            max_tokens: Value::Null,
            output_tokens: default_output_tokens(),
        }
    }
}

/// One tenant of a synthetic load: evenly spaced arrivals at `rate_per_s`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TenantLoad {
    pub name: String,
    pub rate_per_s: f64,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    /// The request's output limit (none: `traffic.max_tokens`).
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// Streamed (none: `traffic.stream`).
    #[serde(default)]
    pub stream: Option<bool>,
    /// Distinct users, taking turns (`<tenant>-u<n>`): the sticky key of a router keyed on the user.
    #[serde(default = "one_user")]
    pub users: u64,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub api: Option<String>,
    /// Active from and to, seconds (default: the whole `duration_s`).
    #[serde(default)]
    pub from_s: Option<f64>,
    #[serde(default)]
    pub to_s: Option<f64>,
}

/// One request, as the simulator's trace record (`sluice_sim::trace::TraceRequest`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Request {
    /// 1-based, in arrival order.
    pub line: u64,
    /// After the first request, ns.
    pub arrival_ns: u64,
    pub tenant: Option<String>,
    pub key: Option<String>,
    pub user: Option<String>,
    #[serde(serialize_with = "api_name")]
    pub api: ApiKind,
    pub model: Option<String>,
    pub prompt_tokens: u64,
    pub max_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    pub stream: Option<bool>,
}

fn api_name<S: serde::Serializer>(api: &ApiKind, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(api.as_str())
}

impl Workload {
    /// Parses a workload, naming the field of any error.
    pub fn from_json(text: &str) -> Result<Workload, WorkloadError> {
        let w: Workload =
            sluice_core::json::parse_config_at(text.as_bytes()).map_err(|e| invalid(if e.path.is_empty() { ".".to_string() } else { e.path }, e.message))?;
        w.check()?;
        Ok(w)
    }

    /// The simulator's checks of the same fields, plus the synthetic load's.
    fn check(&self) -> Result<(), WorkloadError> {
        if self.sample_every_ms == 0 {
            return Err(invalid("sample_every_ms", "must be at least 1"));
        }
        if !(self.duration_s.is_finite() && self.duration_s > 0.0 && self.duration_s <= 86_400.0) {
            return Err(invalid("duration_s", format!("must be a number of seconds in (0, 86400], got {}", self.duration_s)));
        }
        if self.traffic.users_per_tenant == 0 {
            return Err(invalid("traffic.users_per_tenant", "must be at least 1"));
        }
        match &self.traffic.max_tokens {
            Value::Null => {}
            Value::Number(n) if n.as_u64().is_some() => {}
            Value::String(s) if s == "output" => {}
            other => return Err(invalid("traffic.max_tokens", format!("expected null, an integer or \"output\", got {other}"))),
        }
        for (i, t) in self.tenants.iter().enumerate() {
            let f = |name: &str| format!("tenants[{i}].{name}");
            if t.name.is_empty() {
                return Err(invalid(f("name"), "must not be empty"));
            }
            if !(t.rate_per_s.is_finite() && t.rate_per_s > 0.0 && t.rate_per_s <= 1000.0) {
                return Err(invalid(f("rate_per_s"), format!("must be a rate in (0, 1000] requests a second, got {}", t.rate_per_s)));
            }
            if t.users == 0 {
                return Err(invalid(f("users"), "must be at least 1"));
            }
            if let Some(api) = &t.api {
                if ApiKind::from_label(api).is_none() {
                    return Err(invalid(f("api"), format!("unknown API {api:?}: chat_completions, completions, responses or messages")));
                }
            }
            let (from, to) = (t.from_s.unwrap_or(0.0), t.to_s.unwrap_or(self.duration_s));
            if !(from.is_finite() && to.is_finite() && from >= 0.0 && to > from) {
                return Err(invalid(f("to_s"), format!("the tenant must be active for a while: from_s {from} to to_s {to}")));
            }
        }
        for (name, u) in self.upstream.iter().map(|(k, v)| (format!("upstream.{k}"), v)).chain([("default_upstream".to_string(), &self.default_upstream)]) {
            check_upstream(u).map_err(|(field, message)| invalid(format!("{name}.{field}"), message))?;
        }
        for (i, incident) in self.incidents.iter().enumerate() {
            check_incident(incident).map_err(|(field, message)| invalid(format!("incidents[{i}].{field}"), message))?;
        }
        Ok(())
    }

    /// The service model of upstream `name`.
    pub fn upstream(&self, name: &str) -> &Upstream {
        self.upstream.get(name).unwrap_or(&self.default_upstream)
    }

    /// The synthetic load's requests in arrival order: tenant `i`'s `k`-th request arrives at
    /// `from_s + (k + i / n) / rate` (whole milliseconds; the offset keeps tenants of one rate
    /// from arriving together).
    pub fn synthetic(&self) -> Result<Vec<Request>, WorkloadError> {
        let n = self.tenants.len().max(1) as f64;
        let mut out: Vec<(u64, Request)> = Vec::new();
        for (i, t) in self.tenants.iter().enumerate() {
            let from = t.from_s.unwrap_or(0.0);
            let to = t.to_s.unwrap_or(self.duration_s).min(self.duration_s);
            let mut k: u64 = 0;
            loop {
                let at_s = from + (k as f64 + i as f64 / n) / t.rate_per_s;
                if at_s >= to {
                    break;
                }
                if out.len() >= MAX_REQUESTS {
                    return Err(WorkloadError::TooLarge(out.len() + 1));
                }
                let arrival_ms = (at_s * 1000.0).floor() as u64;
                out.push((
                    arrival_ms,
                    Request {
                        line: 0,
                        arrival_ns: arrival_ms * 1_000_000,
                        tenant: Some(t.name.clone()),
                        key: None,
                        user: Some(format!("{}-u{}", t.name, k % t.users)),
                        api: t.api.as_deref().and_then(ApiKind::from_label).unwrap_or(ApiKind::ChatCompletions),
                        model: t.model.clone(),
                        prompt_tokens: t.prompt_tokens,
                        max_tokens: t.max_tokens,
                        output_tokens: Some(t.output_tokens),
                        stream: t.stream,
                    },
                ));
                k += 1;
            }
        }
        // Equal arrivals keep tenant order: `out` is in tenant order, and the sort is stable.
        let out = crate::by_key(out, |(at, _)| *at);
        let first = out.first().map_or(0, |(at, _)| *at);
        Ok(out
            .into_iter()
            .enumerate()
            .map(|(n, (at, mut r))| {
                r.line = n as u64 + 1;
                r.arrival_ns = (at - first) * 1_000_000;
                r
            })
            .collect())
    }
}

/// The requests as a trace in the generic JSONL format (what `sluice-sim run --trace` reads).
pub fn to_generic_jsonl(requests: &[Request]) -> String {
    let mut out = String::new();
    for r in requests {
        let mut line = serde_json::Map::new();
        // Whole milliseconds print as integers: exact in both readers.
        let ms = r.arrival_ns / 1_000_000;
        let frac = r.arrival_ns % 1_000_000;
        line.insert("t_ms".into(), if frac == 0 { Value::from(ms) } else { Value::from(r.arrival_ns as f64 / 1e6) });
        for (k, v) in [("tenant", &r.tenant), ("key", &r.key), ("user", &r.user), ("model", &r.model)] {
            if let Some(v) = v {
                line.insert(k.into(), Value::from(v.clone()));
            }
        }
        line.insert("api".into(), r.api.as_str().into());
        line.insert("prompt_tokens".into(), r.prompt_tokens.into());
        if let Some(m) = r.max_tokens {
            line.insert("max_tokens".into(), m.into());
        }
        if let Some(o) = r.output_tokens {
            line.insert("output_tokens".into(), o.into());
        }
        if let Some(s) = r.stream {
            line.insert("stream".into(), s.into());
        }
        out.push_str(&Value::Object(line).to_string());
        out.push('\n');
    }
    out
}

/// Reads a slice of a trace in the generic JSONL format. Same rules as the simulator's reader:
/// `t_ms` or `time` (RFC 3339), not both, one kind for the whole trace; `prompt_tokens` required;
/// `null` is absent; other fields ignored; arrivals may not go back; blank lines passed over.
pub fn read_generic_jsonl(text: &str) -> Result<Vec<Request>, WorkloadError> {
    let mut out: Vec<Request> = Vec::new();
    let mut origin: Option<(bool, i128)> = None;
    let mut last_ns: u64 = 0;
    for (i, raw) in text.lines().enumerate() {
        let line = i as u64 + 1;
        let raw = raw.strip_prefix('\u{feff}').unwrap_or(raw);
        if raw.trim().is_empty() {
            continue;
        }
        let err = |field: Option<&str>, message: String| WorkloadError::Trace { line, field: field.map(str::to_string), message };
        // From the bytes: one JSON reader type in the page's .wasm (the same errors; `raw` is UTF-8).
        let v: Value = serde_json::from_slice(raw.as_bytes()).map_err(|e| err(None, format!("not JSON: {e}")))?;
        let Some(obj) = v.as_object() else { return Err(err(None, "not a JSON object".into())) };
        let get = |k: &str| obj.get(k).filter(|v| !v.is_null());
        let u64_field = |k: &str| -> Result<Option<u64>, WorkloadError> {
            get(k).map(|v| v.as_u64().ok_or_else(|| err(Some(k), format!("invalid type: {v}, expected u64")))).transpose()
        };
        let str_field = |k: &str| -> Result<Option<String>, WorkloadError> {
            get(k).map(|v| v.as_str().map(str::to_string).ok_or_else(|| err(Some(k), format!("invalid type: {v}, expected a string")))).transpose()
        };
        // Arrival on the trace's own clock, ns (relative for t_ms, Unix for time).
        let (calendar, at): (bool, i128) = match (get("t_ms"), get("time")) {
            (Some(_), Some(_)) => return Err(err(Some("time"), "give t_ms or time, not both".into())),
            (Some(t), None) => {
                let ms = t.as_f64().filter(|m| m.is_finite() && *m >= 0.0).ok_or_else(|| err(Some("t_ms"), format!("must be a number ≥ 0, got {t}")))?;
                (
                    false,
                    match t.as_u64() {
                        Some(whole) => i128::from(whole) * 1_000_000,
                        None => (ms * 1e6).round() as i128,
                    },
                )
            }
            (None, Some(t)) => {
                let s = t.as_str().ok_or_else(|| err(Some("time"), format!("invalid type: {t}, expected a string")))?;
                (true, rfc3339_ns(s).map_err(|m| err(Some("time"), format!("{s:?}: {m}")))?)
            }
            (None, None) => return Err(err(Some("t_ms"), "missing: give t_ms or time".into())),
        };
        let base = match origin {
            None => {
                origin = Some((calendar, at));
                at
            }
            Some((kind, _)) if kind != calendar => return Err(err(Some(if calendar { "time" } else { "t_ms" }), "the trace mixes t_ms and time".into())),
            Some((_, base)) => base,
        };
        let field = if calendar { "time" } else { "t_ms" };
        let offset = at - base;
        let arrival_ns = u64::try_from(offset).ok().filter(|&a| a >= last_ns).ok_or_else(|| {
            err(
                Some(field),
                format!("arrival {} s after the first record is before the previous record's {} s (out of order)", offset as f64 / 1e9, last_ns as f64 / 1e9),
            )
        })?;
        last_ns = arrival_ns;
        let prompt_tokens = u64_field("prompt_tokens")?.ok_or_else(|| err(Some("prompt_tokens"), "missing".into()))?;
        let api = match str_field("api")? {
            None => ApiKind::ChatCompletions,
            Some(a) => ApiKind::from_label(&a).ok_or_else(|| err(Some("api"), format!("unknown API {a:?}")))?,
        };
        let stream = get("stream").map(|v| v.as_bool().ok_or_else(|| err(Some("stream"), format!("invalid type: {v}, expected a boolean")))).transpose()?;
        if out.len() >= MAX_REQUESTS {
            return Err(WorkloadError::TooLarge(out.len() + 1));
        }
        out.push(Request {
            line,
            arrival_ns,
            tenant: str_field("tenant")?,
            key: str_field("key")?,
            user: str_field("user")?,
            api,
            model: str_field("model")?,
            prompt_tokens,
            max_tokens: u64_field("max_tokens")?,
            output_tokens: u64_field("output_tokens")?,
            stream,
        });
    }
    Ok(out)
}

/// Unix nanoseconds of an RFC 3339 time with a UTC offset (`T` or a space, up to 9 fractional digits).
fn rfc3339_ns(s: &str) -> Result<i128, String> {
    let b = s.as_bytes();
    let num = |from: usize, len: usize| -> Result<u64, String> {
        let part = s.get(from..from + len).ok_or("too short")?;
        if !part.bytes().all(|c| c.is_ascii_digit()) {
            return Err(format!("expected digits at column {}", from + 1));
        }
        part.parse::<u64>().map_err(|e| e.to_string())
    };
    if b.len() < 20
        || b.get(4) != Some(&b'-')
        || b.get(7) != Some(&b'-')
        || !matches!(b.get(10), Some(b'T' | b't' | b' '))
        || b.get(13) != Some(&b':')
        || b.get(16) != Some(&b':')
    {
        return Err("expected YYYY-MM-DDTHH:MM:SS[.fraction](Z|±HH:MM)".into());
    }
    let (year, month, day, hour, minute, second) = (num(0, 4)?, num(5, 2)?, num(8, 2)?, num(11, 2)?, num(14, 2)?, num(17, 2)?);
    if !(1..=12).contains(&month) || day == 0 || hour > 23 || minute > 59 || second > 59 || year < 1970 {
        return Err("a field is out of range".into());
    }
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let days_in_month = [31, if leap { 29 } else { 28 }, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
    if day > days_in_month.get(month as usize - 1).copied().unwrap_or(31) {
        return Err(format!("day {day} does not exist in {year}-{month:02}"));
    }
    let mut at = 19;
    let mut frac_ns: u64 = 0;
    if b.get(at) == Some(&b'.') {
        let digits = b.get(at + 1..).unwrap_or_default().iter().take_while(|c| c.is_ascii_digit()).count();
        if digits == 0 || digits > 9 {
            return Err("1 to 9 fractional digits".into());
        }
        frac_ns = num(at + 1, digits)? * 10u64.pow(9 - digits as u32);
        at += 1 + digits;
    }
    let offset_s: i128 = match b.get(at..) {
        Some([b'Z' | b'z']) => 0,
        Some([sign @ (b'+' | b'-'), _, _, b':', _, _]) => {
            let (h, m) = (num(at + 1, 2)?, num(at + 4, 2)?);
            let o = i128::from(h * 3600 + m * 60);
            if *sign == b'+' {
                o
            } else {
                -o
            }
        }
        _ => return Err("expected a UTC offset: Z or ±HH:MM".into()),
    };
    let days = sluice_core::budget::window::days_from_civil(year, month, day);
    let secs = i128::from(days * 86_400 + hour * 3600 + minute * 60 + second) - offset_s;
    Ok(secs * 1_000_000_000 + i128::from(frac_ns))
}

fn default_start() -> u64 {
    DEFAULT_START_UNIX_MS
}
fn default_duration() -> f64 {
    60.0
}
fn one_user() -> u64 {
    1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_matches_the_simulator_examples() {
        let a = rfc3339_ns("2025-03-01T09:00:00Z").unwrap();
        assert_eq!(rfc3339_ns("2025-03-01T10:00:00.250+01:00").unwrap() - a, 250_000_000);
        assert_eq!(rfc3339_ns("2025-03-01T04:00:01.000000001-05:00").unwrap() - a, 1_000_000_001);
        assert_eq!(rfc3339_ns("2025-02-30T00:00:00Z").unwrap_err(), "day 30 does not exist in 2025-02");
        assert_eq!(rfc3339_ns("1970-01-01T00:00:01Z").unwrap(), 1_000_000_000);
    }

    #[test]
    fn generic_trace_reads_and_names_bad_fields() {
        let ok = read_generic_jsonl("{\"t_ms\": 0, \"tenant\": \"acme\", \"prompt_tokens\": 812, \"stream\": true}\n\n{\"t_ms\": 125.5, \"api\": \"completions\", \"prompt_tokens\": 40, \"extra\": 1}\n").unwrap();
        assert_eq!(ok.len(), 2);
        assert_eq!((ok[1].line, ok[1].arrival_ns, ok[1].api), (3, 125_500_000, ApiKind::Completions));
        let e = read_generic_jsonl("{\"t_ms\": 0, \"prompt_tokens\": \"12x\"}").unwrap_err();
        assert_eq!(e.to_string(), "trace line 1, field `prompt_tokens`: invalid type: \"12x\", expected u64");
        let e = read_generic_jsonl("{\"t_ms\": 5, \"prompt_tokens\": 1}\n{\"t_ms\": 1, \"prompt_tokens\": 1}").unwrap_err();
        assert!(e.to_string().starts_with("trace line 2, field `t_ms`: arrival"), "{e}");
    }

    #[test]
    fn synthetic_load_is_evenly_spaced_and_round_trips_through_jsonl() {
        let w = Workload::from_json(
            r#"{"duration_s": 2, "tenants": [{"name": "a", "rate_per_s": 2, "prompt_tokens": 10, "output_tokens": 5, "users": 2},
                {"name": "b", "rate_per_s": 1, "prompt_tokens": 20, "output_tokens": 7, "stream": false}]}"#,
        )
        .unwrap();
        let r = w.synthetic().unwrap();
        let at: Vec<(u64, &str)> = r.iter().map(|r| (r.arrival_ns / 1_000_000, r.tenant.as_deref().unwrap())).collect();
        assert_eq!(at, vec![(0, "a"), (500, "a"), (500, "b"), (1000, "a"), (1500, "a"), (1500, "b")]);
        assert_eq!(r[1].user.as_deref(), Some("a-u1"));
        let back = read_generic_jsonl(&to_generic_jsonl(&r)).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn workload_errors_name_their_field() {
        let e = Workload::from_json(r#"{"tenants": [{"name": "a", "rate_per_s": 0, "prompt_tokens": 1, "output_tokens": 1}]}"#).unwrap_err();
        assert_eq!(e.to_string(), "workload, field `tenants[0].rate_per_s`: must be a rate in (0, 1000] requests a second, got 0");
        let e = Workload::from_json(r#"{"upstream": {"v1": {"max_batch": 0}}}"#).unwrap_err();
        assert_eq!(e.to_string(), "workload, field `upstream.v1.max_batch`: must be at least 1");
        let e = Workload::from_json(r#"{"tenant": []}"#).unwrap_err();
        assert!(e.to_string().starts_with("workload, field `tenant`: unknown field `tenant`"), "{e}");
    }
}
