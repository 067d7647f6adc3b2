//! How each upstream serves: a service-time model with a batch limit and a FIFO queue, incidents
//! that slow it down or make it fail for a while, and seeded errors. The simulator's scenario and
//! the playground's workload both carry these under the same field names and defaults, so one file
//! describes the upstream for both (docs/simulator.md, "The scenario file").

use serde::{Deserialize, Serialize};

use crate::draw::{mix, unit, ERROR_SALT};

/// How one model version serves: a service-time model with a batch limit and a FIFO queue.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
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
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Incident {
    /// The upstream it hits (a key of `upstream`, e.g. the route model-router writes).
    pub upstream: String,
    /// From and to, seconds after the first request (after the simulator's `time_scale`).
    pub from_s: f64,
    pub to_s: f64,
    /// TTFT multiplied by this while it lasts.
    #[serde(default = "one")]
    pub ttft_factor: f64,
    /// Time per output token multiplied by this.
    #[serde(default = "one")]
    pub tpot_factor: f64,
    /// Every request answered with this status instead.
    #[serde(default)]
    pub status: Option<u16>,
    /// Or this share of them (0–1), with the upstream's `error_status`.
    #[serde(default)]
    pub error_rate: Option<f64>,
}

/// Checks an upstream's numbers; the error is (field, message), the caller prefixes the field with
/// where the upstream sits (`upstream.llama-v1.`, `default_upstream.`).
pub fn check_upstream(u: &Upstream) -> Result<(), (&'static str, String)> {
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

/// Checks an incident; the error is (field, message), the caller prefixes the field with
/// `incidents[i].`.
pub fn check_incident(incident: &Incident) -> Result<(), (&'static str, String)> {
    if !(incident.from_s.is_finite() && incident.to_s.is_finite() && incident.from_s >= 0.0 && incident.to_s > incident.from_s) {
        return Err(("to_s", format!("the incident must last: from_s {} to to_s {}", incident.from_s, incident.to_s)));
    }
    for (name, factor) in [("ttft_factor", incident.ttft_factor), ("tpot_factor", incident.tpot_factor)] {
        if !(factor.is_finite() && factor > 0.0) {
            return Err((name, format!("must be a positive number, got {factor}")));
        }
    }
    if let Some(rate) = incident.error_rate {
        if !(0.0..=1.0).contains(&rate) {
            return Err(("error_rate", format!("must be between 0 and 1, got {rate}")));
        }
    }
    if let Some(status) = incident.status {
        if !(100..=599).contains(&status) {
            return Err(("status", format!("must be an HTTP status, got {status}")));
        }
    }
    Ok(())
}

/// The incidents at `upstream` that a request starting service `offset_s` seconds after the first
/// request falls in (from inclusive, to exclusive).
pub fn active_incidents<'a>(incidents: &'a [Incident], upstream: &str, offset_s: f64) -> Vec<&'a Incident> {
    incidents.iter().filter(|i| i.upstream == upstream && offset_s >= i.from_s && offset_s < i.to_s).collect()
}

/// The service times of a request of `prompt_tokens` that starts with `running` others in the
/// batch, during `incidents` (already filtered to this upstream and this time): (TTFT without
/// the queue wait, time per output token), ms.
pub fn service_times(model: &Upstream, prompt_tokens: u64, running_others: u32, incidents: &[&Incident]) -> (f64, f64) {
    let others = f64::from(running_others);
    let prefill_ms = prompt_tokens as f64 / model.prefill_tokens_per_s * 1000.0 * (1.0 + model.prefill_slowdown_per_running * others);
    let mut ttft_ms = model.ttft_base_ms + prefill_ms;
    let mut tpot_ms = model.tpot_ms + model.tpot_per_running_ms * others;
    for incident in incidents {
        ttft_ms *= incident.ttft_factor;
        tpot_ms *= incident.tpot_factor;
    }
    (ttft_ms, tpot_ms)
}

/// The error status trace line `line` is answered with instead, if any: an active incident's
/// `status`, else with probability `error_rate` (the first active incident's that has one, else
/// the upstream's) the upstream's `error_status`, drawn from (seed, line).
pub fn failure(model: &Upstream, incidents: &[&Incident], seed: u64, line: u64) -> Option<u16> {
    let draw = unit(mix(seed ^ ERROR_SALT, line));
    incidents.iter().find_map(|i| i.status).or_else(|| {
        let rate = incidents.iter().find_map(|i| i.error_rate).unwrap_or(model.error_rate);
        (draw < rate).then_some(model.error_status)
    })
}

/// Milliseconds of the model to whole nanoseconds of the virtual clock (negative and NaN are 0).
pub fn ms_to_ns(ms: f64) -> u64 {
    (ms * 1e6).round().max(0.0) as u64
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

#[cfg(test)]
mod tests {
    use super::*;

    fn incident(upstream: &str, from_s: f64, to_s: f64) -> Incident {
        Incident { upstream: upstream.into(), from_s, to_s, ttft_factor: 1.0, tpot_factor: 1.0, status: None, error_rate: None }
    }

    #[test]
    fn defaults_are_the_documented_ones_and_an_empty_object_means_them() {
        let u = Upstream::default();
        assert_eq!((u.ttft_base_ms, u.prefill_tokens_per_s, u.prefill_slowdown_per_running), (30.0, 20_000.0, 0.0));
        assert_eq!((u.tpot_ms, u.tpot_per_running_ms, u.max_batch, u.error_rate, u.error_status), (20.0, 0.0, 64, 0.0, 500));
        assert_eq!(serde_json::from_str::<Upstream>("{}").unwrap(), u);
        let i: Incident = serde_json::from_str(r#"{"upstream": "v1", "from_s": 1, "to_s": 2.5}"#).unwrap();
        assert_eq!(i, incident("v1", 1.0, 2.5));
    }

    #[test]
    fn unknown_fields_are_refused_and_both_round_trip() {
        let e = serde_json::from_str::<Upstream>(r#"{"max_batchh": 1}"#).unwrap_err().to_string();
        assert!(e.starts_with("unknown field `max_batchh`"), "{e}");
        let e = serde_json::from_str::<Incident>(r#"{"upstream": "v1", "from_s": 0, "to_s": 1, "factor": 2}"#).unwrap_err().to_string();
        assert!(e.starts_with("unknown field `factor`"), "{e}");
        let u = Upstream { max_batch: 8, error_rate: 0.25, ..Upstream::default() };
        assert_eq!(serde_json::from_str::<Upstream>(&serde_json::to_string(&u).unwrap()).unwrap(), u);
        let i = Incident { status: Some(503), ttft_factor: 4.0, ..incident("v2", 10.0, 20.0) };
        assert_eq!(serde_json::from_str::<Incident>(&serde_json::to_string(&i).unwrap()).unwrap(), i);
    }

    #[test]
    fn service_times_grow_with_the_batch_and_incidents_multiply_them() {
        // 2,000 prompt tokens at 8,000 a second: 250 ms of prefill.
        let u = Upstream { prefill_tokens_per_s: 8000.0, prefill_slowdown_per_running: 0.5, tpot_per_running_ms: 2.0, ..Upstream::default() };
        assert_eq!(service_times(&u, 2000, 0, &[]), (30.0 + 250.0, 20.0));
        // 3 others running: prefill × (1 + 0.5 · 3) = 625 ms, TPOT 20 + 2 · 3 = 26 ms.
        assert_eq!(service_times(&u, 2000, 3, &[]), (655.0, 26.0));
        // Incidents multiply the whole TTFT (base included) and TPOT, each by its own factor.
        let slow = Incident { ttft_factor: 2.0, tpot_factor: 1.5, ..incident("v1", 0.0, 1.0) };
        let slower = Incident { ttft_factor: 1.5, ..incident("v1", 0.0, 1.0) };
        assert_eq!(service_times(&u, 2000, 3, &[&slow]), (1310.0, 39.0));
        assert_eq!(service_times(&u, 2000, 3, &[&slow, &slower]), (1965.0, 39.0));
        // No prompt: the fixed part alone.
        assert_eq!(service_times(&Upstream::default(), 0, 10, &[]), (30.0, 20.0));
    }

    #[test]
    fn incidents_are_active_from_inclusive_to_exclusive_at_their_upstream() {
        let all = [incident("v1", 10.0, 20.0), incident("v2", 0.0, 100.0), incident("v1", 15.0, 30.0)];
        let at = |name: &str, t: f64| active_incidents(&all, name, t).into_iter().map(|i| i.from_s).collect::<Vec<_>>();
        assert_eq!(at("v1", 9.999), Vec::<f64>::new());
        assert_eq!(at("v1", 10.0), [10.0]);
        assert_eq!(at("v1", 15.0), [10.0, 15.0]);
        assert_eq!(at("v1", 20.0), [15.0]);
        assert_eq!(at("v1", 30.0), Vec::<f64>::new());
        assert_eq!(at("v2", 50.0), [0.0]);
        assert_eq!(at("v3", 50.0), Vec::<f64>::new());
    }

    #[test]
    fn failures_come_from_incidents_first_then_the_seeded_draw() {
        let healthy = Upstream::default();
        let broken = Upstream { error_rate: 1.0, error_status: 502, ..Upstream::default() };
        // Rate 0 never fails, rate 1 always does (every draw is below 1).
        assert!((1..=200).all(|line| failure(&healthy, &[], 7, line).is_none()));
        assert!((1..=200).all(|line| failure(&broken, &[], 7, line) == Some(502)));
        // An incident's status wins; its error_rate replaces the upstream's, with the upstream's status.
        let down = Incident { status: Some(503), ..incident("v1", 0.0, 1.0) };
        let flaky = Incident { error_rate: Some(1.0), ..incident("v1", 0.0, 1.0) };
        let calm = Incident { error_rate: Some(0.0), ..incident("v1", 0.0, 1.0) };
        assert_eq!(failure(&healthy, &[&down], 7, 1), Some(503));
        assert_eq!(failure(&broken, &[&flaky, &down], 7, 1), Some(503));
        assert_eq!(failure(&healthy, &[&flaky], 7, 1), Some(500));
        assert_eq!(failure(&broken, &[&calm], 7, 1), None);
        // The first incident with a rate decides.
        assert_eq!(failure(&healthy, &[&calm, &flaky], 7, 1), None);
        // Half the draws: exactly those whose salted draw is below 0.5, the same on every call.
        let half = Upstream { error_rate: 0.5, ..Upstream::default() };
        for line in 1..=50 {
            let expected = (unit(mix(7 ^ 0x5eed_e770, line)) < 0.5).then_some(500);
            assert_eq!(failure(&half, &[], 7, line), expected);
        }
    }

    #[test]
    fn check_upstream_names_the_field() {
        assert_eq!(check_upstream(&Upstream::default()), Ok(()));
        let bad = |u: Upstream| check_upstream(&u).unwrap_err();
        let d = Upstream::default;
        assert_eq!(bad(Upstream { ttft_base_ms: -1.0, ..d() }), ("ttft_base_ms", "must be a number ≥ 0, got -1".to_string()));
        assert_eq!(bad(Upstream { prefill_tokens_per_s: 0.0, ..d() }), ("prefill_tokens_per_s", "must be a positive number, got 0".to_string()));
        assert_eq!(
            bad(Upstream { prefill_slowdown_per_running: f64::NAN, ..d() }),
            ("prefill_slowdown_per_running", "must be a number ≥ 0, got NaN".to_string())
        );
        assert_eq!(bad(Upstream { tpot_ms: f64::INFINITY, ..d() }), ("tpot_ms", "must be a number ≥ 0, got inf".to_string()));
        assert_eq!(bad(Upstream { tpot_per_running_ms: -0.5, ..d() }), ("tpot_per_running_ms", "must be a number ≥ 0, got -0.5".to_string()));
        assert_eq!(bad(Upstream { max_batch: 0, ..d() }), ("max_batch", "must be at least 1".to_string()));
        assert_eq!(bad(Upstream { error_rate: 1.5, ..d() }), ("error_rate", "must be between 0 and 1, got 1.5".to_string()));
        assert_eq!(bad(Upstream { error_status: 99, ..d() }), ("error_status", "must be an HTTP status, got 99".to_string()));
        assert_eq!(bad(Upstream { error_status: 600, ..d() }), ("error_status", "must be an HTTP status, got 600".to_string()));
        // The first bad field is named.
        assert_eq!(bad(Upstream { max_batch: 0, ttft_base_ms: -1.0, ..d() }).0, "ttft_base_ms");
        // Zero is allowed where it means "none".
        assert_eq!(check_upstream(&Upstream { ttft_base_ms: 0.0, tpot_ms: 0.0, error_rate: 1.0, error_status: 100, ..d() }), Ok(()));
    }

    #[test]
    fn check_incident_names_the_field() {
        assert_eq!(check_incident(&incident("v1", 0.0, 0.5)), Ok(()));
        let bad = |i: Incident| check_incident(&i).unwrap_err();
        assert_eq!(bad(incident("v1", 5.0, 5.0)), ("to_s", "the incident must last: from_s 5 to to_s 5".to_string()));
        assert_eq!(bad(incident("v1", -1.0, 5.0)), ("to_s", "the incident must last: from_s -1 to to_s 5".to_string()));
        assert_eq!(bad(Incident { ttft_factor: 0.0, ..incident("v1", 0.0, 1.0) }), ("ttft_factor", "must be a positive number, got 0".to_string()));
        assert_eq!(bad(Incident { tpot_factor: -2.0, ..incident("v1", 0.0, 1.0) }), ("tpot_factor", "must be a positive number, got -2".to_string()));
        assert_eq!(bad(Incident { error_rate: Some(2.0), ..incident("v1", 0.0, 1.0) }), ("error_rate", "must be between 0 and 1, got 2".to_string()));
        assert_eq!(bad(Incident { status: Some(42), ..incident("v1", 0.0, 1.0) }), ("status", "must be an HTTP status, got 42".to_string()));
    }

    #[test]
    fn milliseconds_become_whole_nanoseconds() {
        assert_eq!(ms_to_ns(12.5), 12_500_000);
        assert_eq!(ms_to_ns(0.25), 250_000);
        assert_eq!(ms_to_ns(0.000_000_4), 0);
        assert_eq!(ms_to_ns(0.000_001_6), 2);
        assert_eq!(ms_to_ns(-3.0), 0);
        assert_eq!(ms_to_ns(f64::NAN), 0);
    }
}
