//! The Redis ledger's side of admission and settlement: the bodies tenant-budget sends to
//! `sluice-ledger` and the admissions built from its answers (wire contract: docs/ledger.md).
//! Pure, like the rest of core: the plugin makes the HTTP callouts and hands the bytes back here.

use super::admission::{Admission, AdmitError, Demand, Plan, Refusal, RemoteHold, Settlement};
use super::ledger::{Counter, Lease};
use super::policy::Policy;
use crate::usage::Usage;
use serde::Deserialize;

const NS_PER_S: u64 = 1_000_000_000;
/// Amounts and limits cross to the ledger's Lua scripts, whose numbers are exact only up to 2⁵³.
pub const MAX_EXACT: u64 = 1 << 53;

/// What a ledger callout that brought no usable answer says about the call. Envoy's own replies
/// (it could not connect, the call timed out) are plain text; `sluice-ledger`'s are JSON.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallFailure {
    pub kind: FailureKind,
    /// What happened, for the log: names who answered and why.
    pub why: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Envoy never sent the call: no connection could be made (refused, connect timeout), no
    /// healthy host, or the cluster's circuit breaker. Nothing can have run in Redis.
    NotSent,
    /// Sent and not answered in time (Envoy's 504, or no reply at all): it may still run.
    TimedOut,
    /// The service answered an error, or the connection broke after the call went out.
    Failed,
}

/// The reset reasons Envoy names in its 503 when the request never reached the upstream.
const NOT_SENT_RESETS: [&str; 4] = ["remote connection failure", "local connection failure", "connection timeout", "overflow"];
/// How much of an answer a log line quotes.
const QUOTED_BYTES: usize = 240;

/// Classifies a callout answer that is not a ledger answer (`status` 0: no reply at all).
pub fn call_failure(status: u16, body: &[u8]) -> CallFailure {
    let full = String::from_utf8_lossy(body);
    let full = full.trim();
    let text = quoted(full);
    let (kind, why) = if status == 0 {
        (FailureKind::TimedOut, "no answer from sluice-ledger (the call timed out or was reset)".to_string())
    } else if let Ok(error) = serde_json::from_slice::<ServiceError>(body) {
        (FailureKind::Failed, format!("sluice-ledger answered HTTP {status} {}: {}", error.error, error.message))
    } else if status == 504 && full == "upstream request timeout" {
        (FailureKind::TimedOut, "sluice-ledger did not answer within timeout_ms (Envoy: upstream request timeout)".to_string())
    } else if status == 503 && (full == "no healthy upstream" || reset_reason(full).is_some_and(|r| NOT_SENT_RESETS.contains(&r))) {
        (FailureKind::NotSent, format!("Envoy could not reach sluice-ledger ({text})"))
    } else if full.is_empty() {
        (FailureKind::Failed, format!("HTTP {status} with no body"))
    } else {
        (FailureKind::Failed, format!("HTTP {status}: {text}"))
    };
    CallFailure { kind, why }
}

/// At most [`QUOTED_BYTES`] of `text`, cut at a character boundary.
fn quoted(text: &str) -> &str {
    let mut end = text.len().min(QUOTED_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.get(..end).unwrap_or_default()
}

/// The reset reason of Envoy's "upstream connect error or disconnect/reset before headers" reply.
fn reset_reason(text: &str) -> Option<&str> {
    let rest = text.strip_prefix("upstream connect error or disconnect/reset before headers. reset reason: ")?;
    Some(rest.split(',').next().unwrap_or(rest).trim())
}

/// The error body `sluice-ledger` answers with.
#[derive(Deserialize)]
struct ServiceError {
    error: String,
    #[serde(default)]
    message: String,
}

/// A reservation sent to the Redis ledger, waiting for its answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingReserve {
    /// The `POST /v1/reserve` body.
    pub body: Vec<u8>,
    pub id: String,
    key: usize,
    demand: Demand,
    plan: Plan,
    now_ns: u64,
}

impl PendingReserve {
    pub fn demand(&self) -> &Demand {
        &self.demand
    }

    /// A settlement of nothing for this reservation, for a request that went away while the
    /// ledger was deciding: if the hold was made, it is released rather than left to expire (and be
    /// charged at its reservation).
    pub fn release_body(&self) -> Vec<u8> {
        let charges = vec![0u64; self.plan.holds.len()];
        serde_json::json!({"id": self.id, "tag": self.plan.org, "charges": charges}).to_string().into_bytes()
    }

    /// Where a charge is written back to the Redis ledger when the local fallback admitted this
    /// request instead.
    pub fn write_back(&self) -> WriteBack {
        let counters = self.plan.holds.iter().map(|h| WriteBackCounter { index: h.index, key: h.remote_key.clone(), expire_at_s: h.expire_at_s }).collect();
        WriteBack { tag: self.plan.org.clone(), counters }
    }
}

/// The Redis counters of a request the local fallback admitted: what it is charged there is
/// written back to them (`POST /v1/charge`) once the ledger answers again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteBack {
    pub tag: String,
    pub counters: Vec<WriteBackCounter>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteBackCounter {
    /// The policy's counter.
    pub index: usize,
    /// Its key in the ledger (as a reservation names it).
    pub key: String,
    /// When its window (plus the reservation TTL) is over: past it, the charge counts for nothing.
    pub expire_at_s: u64,
}

#[derive(Deserialize)]
struct CounterState {
    used: u64,
    reserved: u64,
}

#[derive(Deserialize)]
struct ReserveReply {
    admitted: bool,
    #[serde(default)]
    counters: Vec<CounterState>,
    #[serde(default)]
    refused: Option<usize>,
    #[serde(default)]
    used: u64,
    #[serde(default)]
    reserved: u64,
    #[serde(default)]
    reason: Option<String>,
}

impl Policy {
    /// The reservation of `demand` for `key`, named `id` (unique per request: a reused id would
    /// replay another request's hold), as a body for `POST /v1/reserve`.
    pub fn remote_reserve(&self, key: usize, demand: &Demand, now_ns: u64, id: &str) -> Result<PendingReserve, AdmitError> {
        let plan = self.plan(key, demand, now_ns)?;
        let counters: Vec<serde_json::Value> = plan
            .holds
            .iter()
            // An amount above the limit is refused whatever its size: capped so it stays exact there.
            .map(|h| serde_json::json!({"key": h.remote_key, "limit": h.limit, "amount": h.amount.min(h.limit.saturating_add(1)).min(MAX_EXACT), "expire_at_s": h.expire_at_s}))
            .collect();
        let body = serde_json::json!({
            "id": id,
            "tag": plan.org,
            "hold_ttl_s": u64::from(self.reservation_ttl_minutes) * 60,
            "counters": counters,
        });
        Ok(PendingReserve { body: body.to_string().into_bytes(), id: id.to_string(), key, demand: demand.clone(), plan, now_ns })
    }

    /// The admission the ledger's answer grants: `Exceeded` when a budget refused, `Store` when
    /// the answer is not one (then the ledger's failure policy applies).
    pub fn remote_admission(&self, pending: &PendingReserve, status: u16, reply: &[u8]) -> Result<Admission, AdmitError> {
        if status != 200 {
            return Err(AdmitError::Store(call_failure(status, reply).why));
        }
        let reply: ReserveReply = serde_json::from_slice(reply).map_err(|e| AdmitError::Store(format!("sluice-ledger answer unreadable: {e}")))?;
        let holds = &pending.plan.holds;
        if !reply.admitted {
            let Some(hold) = reply.refused.and_then(|i| holds.get(i)) else {
                let reason = reply.reason.unwrap_or_else(|| "no refused counter named".into());
                return Err(AdmitError::Store(format!("sluice-ledger did not admit the request: {reason}")));
            };
            let end = self.counters.get(hold.index).map_or(pending.now_ns, |spec| spec.window.end_ns(pending.now_ns));
            return Err(AdmitError::Exceeded(Refusal {
                counter: hold.index,
                used: reply.used,
                reserved: reply.reserved,
                limit: hold.limit,
                retry_after_s: end.saturating_sub(pending.now_ns).div_ceil(NS_PER_S).max(1),
            }));
        }
        if reply.counters.len() != holds.len() {
            return Err(AdmitError::Store(format!("sluice-ledger answered {} counters for {}", reply.counters.len(), holds.len())));
        }
        let minute = u32::try_from(pending.now_ns / NS_PER_S / 60).unwrap_or(u32::MAX);
        let leases = holds.iter().map(|h| (h.index, Lease { key: h.remote_key.clone(), window_id: h.window_id, minute, amount: h.amount })).collect();
        // Gauges and rate headers read `used` and the total reserved: one lease stands for it.
        let after =
            holds.iter().zip(&reply.counters).map(|(h, c)| Counter { window_id: h.window_id, used: c.used, leases: vec![(minute, c.reserved)] }).collect();
        Ok(Admission {
            key: pending.key,
            model: pending.demand.model.clone(),
            leases,
            input_tokens: pending.demand.input_tokens,
            output_tokens: pending.demand.output_tokens,
            choices: pending.demand.choices.max(1),
            clamped: false,
            reserved_micro_usd: pending.plan.cost.unwrap_or(0),
            after,
            remote: Some(RemoteHold { id: pending.id.clone(), tag: pending.plan.org.clone() }),
        })
    }

    /// With clamping on, a refused reservation is tried once more with the output the refusing
    /// budget's room still pays for (same id: the first attempt held nothing). `None`: refuse.
    pub fn remote_clamped(&self, pending: &PendingReserve, refusal: &Refusal) -> Option<PendingReserve> {
        if !self.clamp.enabled {
            return None;
        }
        let spec = self.counters.get(refusal.counter)?;
        let room = refusal.limit.checked_sub(refusal.used.saturating_add(refusal.reserved))?;
        let output = self.output_that_fits(spec, room, &pending.demand)? / pending.demand.choices.max(1);
        if output < self.clamp.min_output_tokens || output >= pending.demand.output_tokens {
            return None;
        }
        let demand = Demand { output_tokens: output, ..pending.demand.clone() };
        self.remote_reserve(pending.key, &demand, pending.now_ns, &pending.id).ok()
    }

    /// What `actual` (costing `micro_usd`) takes from each counter of `target`, in its order.
    pub fn write_back_amounts(&self, target: &WriteBack, actual: &Usage, micro_usd: u64) -> Vec<u64> {
        target
            .counters
            .iter()
            .map(|c| self.counters.get(c.index).map_or(0, |spec| spec.limit.amount(actual.input_tokens, actual.output_tokens, micro_usd)).min(MAX_EXACT))
            .collect()
    }

    /// The `POST /v1/settle` body that replaces a Redis hold by what the request used, and the
    /// settlement it makes (counters after it are unknown until the ledger answers: `None`).
    pub fn remote_settle(&self, admission: &Admission, actual: &Usage) -> Option<(Vec<u8>, Settlement)> {
        let hold = admission.remote.as_ref()?;
        let micro_usd = admission.model.as_deref().and_then(|m| self.prices.cost_micro_usd(m, actual)).unwrap_or(0);
        let mut settlement = Settlement { input_tokens: actual.input_tokens, output_tokens: actual.output_tokens, micro_usd, ..Settlement::default() };
        let mut charges = Vec::with_capacity(admission.leases.len());
        for (index, lease) in &admission.leases {
            let amount = self.counters.get(*index).map_or(0, |spec| spec.limit.amount(actual.input_tokens, actual.output_tokens, micro_usd));
            charges.push(amount.min(MAX_EXACT));
            settlement.after.push(None);
            settlement.over_estimates.push(i128::from(lease.amount) - i128::from(amount));
        }
        let body = serde_json::json!({"id": hold.id, "tag": hold.tag, "charges": charges});
        Some((body.to_string().into_bytes(), settlement))
    }
}
