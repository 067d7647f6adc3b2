//! tenant-budget's request life: who a request is, whether it may spend, what it reserved, and what
//! it is charged when its response ends — or is cut short.
//!
//! ```text
//! request headers ─► Holding (the body is held until complete) ─► [Reserving (the Redis ledger
//! decides)] ─► Admitted (the response is observed) ─► Settled
//!                    └──────────────► Refused (a local reply; nothing to settle)
//!                    └──────────────► Unbudgeted (the ledger failed and `on_failure = allow`)
//! ```
//!
//! The request body is held until admission, because a request that does not fit must never reach
//! the model; the response is never held. Two host operations need an answer in the middle of an
//! event — starting a callout to the ledger (its token, or why it did not start) and replacing the
//! held request body (whether the host took it) — so a flow gets them through [`BudgetHost`], as it
//! gets shared data through a [`SharedStore`]; everything else is an [`Effect`].

mod stamp;
#[cfg(test)]
mod tests;

use super::{Dir, Effect, Effects, LogLevel, Verdict, View};
use crate::api::ApiKind;
use crate::budget::identities::identity_hash;
use crate::budget::ledger::Counter;
use crate::budget::policy::{CounterSpec, JwtConfig, LedgerConfig, LedgerFailure, Limit, Mode};
use crate::budget::remote::{call_failure, FailureKind, PendingReserve, WriteBack, MAX_EXACT};
use crate::budget::{Admission, AdmitError, Demand, Policy, Settlement};
use crate::contract::{GatewayEnd, GatewayReply};
use crate::headers::HeaderPairs;
use crate::identity::{api_key_from_headers, jwt_payload_claim, sha256_hex};
use crate::metrics::{self, LedgerCall, LedgerFallback, LedgerResult};
use crate::observation::Observer;
use crate::reply::error_body;
use crate::report::{sanitize_label, LabelBound, Outcome};
use crate::request::{inspect_request_with_kind, RequestInfo};
use crate::response::inspect_response_body;
use crate::rewrite::{rewrite_request, UsageChunkStripper};
use crate::sse::DEFAULT_MAX_EVENT_BYTES;
use crate::store::SharedStore;
use crate::usage::Usage;
use crate::vecmap::VecMap;
use stamp::Stamp;
use std::collections::VecDeque;

/// Largest request body the plugin will hold to admit it. A larger body cannot be sized, so it is
/// refused (413) rather than let through unbudgeted.
pub const MAX_REQUEST_BODY_BYTES: usize = 8 * 1024 * 1024;
/// Strict mode: tokens added to the body-size bound of a request that defines tools, for the
/// tool-use instructions providers add to the prompt (Anthropic documents up to 530 tokens;
/// DeepSeek's template adds 103). See docs/estimate-calibration.md.
const TOOL_PROMPT_ALLOWANCE: u64 = 1024;
/// Largest non-streaming response body copied to read its usage.
const MAX_RESPONSE_BODY_BYTES: usize = 4 * 1024 * 1024;
/// Largest ledger answer a host reads (answers are small JSON objects).
pub const MAX_LEDGER_ANSWER_BYTES: usize = 64 * 1024;
/// Settlements waiting to be sent to the Redis ledger, most kept per VM; beyond it the oldest is
/// dropped (its hold then expires and is charged at its reserved amount: conservative).
const MAX_QUEUED_SETTLEMENTS: usize = 16_384;
/// How long after a request vanished mid-reservation its release is sent.
const RELEASE_DELAY_NS: u64 = 1_000_000_000;
/// Attempts per settlement before it is left to expire.
const MAX_SETTLE_ATTEMPTS: u32 = 50;
/// The root's tick in Redis mode: it sends queued settlements (a stream's own callouts die with
/// the stream, so settlement is the root's).
pub const SETTLE_TICK_MS: u64 = 20;
/// Per tick: queued settlements looked at, and callouts started (the rest waits for the next tick).
const TICK_LOOKS: usize = 1024;
const TICK_CALLS: usize = 256;

/// Most settlements one callout carries (the ledger's own limit, docs/ledger.md).
pub const SETTLE_BATCH_MAX: usize = 256;
/// Most bytes of settlements one callout carries: half the ledger's 64 KiB body limit.
const SETTLE_BATCH_MAX_BYTES: usize = 32 * 1024;

const RESERVE_PATH: &str = "/v1/reserve";
const SETTLE_PATH: &str = "/v1/settle";
const SETTLE_BATCH_PATH: &str = "/v1/settle_batch";
const CHARGE_PATH: &str = "/v1/charge";
/// Counters with a local-fallback charge waiting to be written back, most kept per VM (summed per
/// counter, so this bounds memory whatever the outage's length); a charge to a further counter is
/// dropped and counted.
const MAX_WRITE_BACK_COUNTERS: usize = 4096;
/// Most counters one `/v1/charge` carries (the ledger's own limit).
const WRITE_BACK_MAX_COUNTERS: usize = 64;

/// The host operations whose answer a budget flow needs before it goes on.
pub trait BudgetHost {
    /// Starts `POST path` with `body` to the Redis ledger service (cluster, authority and timeout
    /// in `ledger`): the callout's token, or why it was not started.
    fn ledger_call(&mut self, ledger: &LedgerConfig, path: &str, body: &[u8]) -> Result<u32, String>;
    /// Replaces the held request body (`size` bytes) by `bytes`; whether the host took it (a
    /// request whose output limit cannot be written must not go on).
    fn replace_request_body(&mut self, size: usize, bytes: &[u8]) -> bool;
}

/// Numbers the budget VMs of one process, in shared data (every worker's VM sees it).
const VM_NUMBER_KEY: &str = "sluice/tenant-budget/vm-number";

/// A number no other budget VM of this process has: part of every hold id it makes. 0 when shared
/// data fails (ids then rest on the configure time alone).
pub fn next_vm_number(store: &mut dyn SharedStore) -> u64 {
    crate::store::counter_add(store, VM_NUMBER_KEY, 1).unwrap_or(0)
}

/// How long a ledger call that failed `attempts` times waits before it is sent again: 0.1 s more
/// per attempt, at most 2 s.
fn retry_delay_ns(attempts: u32) -> u64 {
    u64::from(attempts.min(20)) * 100_000_000
}

/// One settlement for the Redis ledger (idempotent per hold id: retries are safe).
#[derive(Debug, Clone, PartialEq, Eq)]
struct SettleJob {
    body: Vec<u8>,
    attempts: u32,
    /// Not before this host time (backoff after a failure).
    not_before_ns: u64,
}

/// The compiled policy and what every stream of a VM shares: the model-version label bound, the
/// VM's hold-id nonce, the Redis settlement queue and the ledger's last known health.
#[derive(Debug)]
pub struct BudgetPolicy {
    pub policy: Policy,
    /// The charge metrics' model-version label: the version comes from the request.
    model_versions: LabelBound,
    /// Makes this VM's Redis hold ids unique across VMs and Envoy processes.
    vm_nonce: String,
    settle_queue: VecDeque<SettleJob>,
    /// Settlements in flight, by callout token: one alone (`/v1/settle`) or a batch
    /// (`/v1/settle_batch`), with the time they were sent.
    /// (This and the other maps here are [`VecMap`]s: a few entries each, and the playground's page
    /// carries four B-tree instantiations less.)
    settle_calls: VecMap<u32, SettleCall>,
    /// The ledger answered a batch 404 (a service from before batches): settlements go one by one.
    batches_unsupported: bool,
    /// The Redis ledger's last known state (`None` before the first call): logged on change only.
    ledger_ok: Option<bool>,
    /// What the local fallback charged while the ledger failed, per org tag, to write back.
    write_backs: VecMap<String, TagWriteBack>,
    /// Counters in `write_backs`, waiting or being sent (at most [`MAX_WRITE_BACK_COUNTERS`]).
    write_back_counters: usize,
    /// Numbers this VM's write-back ids.
    write_back_seq: u64,
    /// Write-backs in flight, by callout token: their tag, and when they were sent.
    write_back_calls: VecMap<u32, (String, u64)>,
    /// The ledger answered a write-back 404 (a service from before `/v1/charge`): none are kept.
    write_backs_unsupported: bool,
}

/// One org's charges from the local fallback, summed per Redis counter.
#[derive(Debug, Default)]
struct TagWriteBack {
    /// Not yet sent: per counter key, the amount and when its window is over (s).
    waiting: VecMap<String, (u64, u64)>,
    /// Sent, and sent again unchanged (same id: the ledger applies it once) until answered.
    sending: Option<WriteBackBatch>,
}

#[derive(Debug)]
struct WriteBackBatch {
    body: Vec<u8>,
    counters: usize,
    /// The last of its counters' windows ends then (s): past it the charge counts for nothing.
    ends_s: u64,
    attempts: u32,
    not_before_ns: u64,
    in_flight: bool,
}

impl BudgetPolicy {
    /// `node_id` (the proxy's node id) and `now` (the configure time) tell Envoy processes apart,
    /// `vm_number` ([`next_vm_number`]) the VMs of one process: its workers' VMs are configured at
    /// the same instant (two of them once named their holds alike, and a request's reservation
    /// replayed another's).
    pub fn new(policy: Policy, node_id: &str, now: u64, vm_number: u64) -> BudgetPolicy {
        let model_versions = LabelBound::new(policy.model_versions.iter().cloned(), policy.max_dynamic_model_versions);
        let node_hash = sha256_hex(node_id.as_bytes());
        let vm_nonce = format!("{}{now:x}-{vm_number:x}", node_hash.get(..8).unwrap_or_default());
        BudgetPolicy {
            policy,
            model_versions,
            vm_nonce,
            settle_queue: VecDeque::new(),
            settle_calls: VecMap::new(),
            batches_unsupported: false,
            ledger_ok: None,
            write_backs: VecMap::new(),
            write_back_counters: 0,
            write_back_seq: 0,
            write_back_calls: VecMap::new(),
            write_backs_unsupported: false,
        }
    }

    /// Counters with a local-fallback charge not yet written back to the Redis ledger.
    pub fn pending_write_backs(&self) -> usize {
        self.write_back_counters
    }

    /// Adds what a request the local fallback admitted was charged (`amounts`, per counter of
    /// `target`) to what will be written back to the Redis ledger.
    fn queue_write_back(&mut self, target: &WriteBack, amounts: &[u64], fx: &mut Effects) {
        if self.write_backs_unsupported {
            return;
        }
        let tag = self.write_backs.get_or_insert_with(target.tag.clone(), TagWriteBack::default);
        for (counter, &amount) in target.counters.iter().zip(amounts) {
            if amount == 0 {
                continue;
            }
            if let Some((sum, _)) = tag.waiting.get_mut(&counter.key) {
                *sum = sum.saturating_add(amount).min(MAX_EXACT);
            } else if self.write_back_counters >= MAX_WRITE_BACK_COUNTERS {
                fx.count(metrics::budget_ledger_settlements_dropped_total(), 1);
            } else {
                tag.waiting.insert(counter.key.clone(), (amount, counter.expire_at_s));
                self.write_back_counters += 1;
            }
        }
    }

    /// Starts each org's due write-back: the one being sent again, or the next (up to
    /// [`WRITE_BACK_MAX_COUNTERS`] waiting counters under a new id). One in flight per org, so a
    /// counter's charges reach the ledger in order and a retry never overlaps a newer sum.
    fn tick_write_backs(&mut self, host: &mut dyn BudgetHost, now: u64, fx: &mut Effects) {
        let now_s = now / 1_000_000_000;
        let mut failures = Vec::new();
        for (tag_name, tag) in self.write_backs.iter_mut() {
            if self.write_back_calls.len() >= TICK_CALLS {
                break;
            }
            if tag.sending.as_ref().is_some_and(|b| !b.in_flight && b.ends_s < now_s) {
                // Every window it charges is over: the ledger would skip it all.
                self.write_back_counters = self.write_back_counters.saturating_sub(tag.sending.take().map_or(0, |b| b.counters));
            }
            if tag.sending.is_none() && !tag.waiting.is_empty() {
                let keys: Vec<String> = tag.waiting.keys().take(WRITE_BACK_MAX_COUNTERS).cloned().collect();
                let mut counters = Vec::with_capacity(keys.len());
                let mut ends_s = 0;
                for key in keys {
                    let Some((amount, expire_at_s)) = tag.waiting.remove(&key) else { continue };
                    ends_s = ends_s.max(expire_at_s);
                    counters.push(serde_json::json!({"key": key, "amount": amount, "expire_at_s": expire_at_s}));
                }
                self.write_back_seq += 1;
                let id = format!("{}-w{:x}", self.vm_nonce, self.write_back_seq);
                let body = serde_json::json!({"id": id, "tag": tag_name, "counters": counters}).to_string().into_bytes();
                tag.sending = Some(WriteBackBatch { body, counters: counters.len(), ends_s, attempts: 0, not_before_ns: now, in_flight: false });
            }
            let Some(batch) = tag.sending.as_mut().filter(|b| !b.in_flight && b.not_before_ns <= now) else { continue };
            match host.ledger_call(&self.policy.ledger, CHARGE_PATH, &batch.body) {
                Ok(token) => {
                    batch.in_flight = true;
                    self.write_back_calls.insert(token, (tag_name.clone(), now));
                }
                Err(e) => {
                    batch.attempts += 1;
                    batch.not_before_ns = now.saturating_add(retry_delay_ns(batch.attempts));
                    failures.push(format!("write-back callout not started: {e}"));
                }
            }
        }
        self.write_backs.retain(|_, t| t.sending.is_some() || !t.waiting.is_empty());
        if let Some(why) = failures.first() {
            self.ledger_health(false, why, fx);
        }
    }

    /// The ledger's answer to write-back callout `token` (`status` 0: none). Final when it charged
    /// (or had already: a retry), refused it as malformed, or has no `/v1/charge`; otherwise sent
    /// again, unchanged, with a growing delay, until its windows are over.
    fn write_back_answered(&mut self, tag_name: &str, status: u16, answer: &[u8], now: u64, fx: &mut Effects) {
        let done = status == 200 && serde_json::from_slice::<serde_json::Value>(answer).is_ok_and(|v| v.get("charged").is_some());
        let failure = (!done).then(|| call_failure(status, answer));
        let result = match &failure {
            None => LedgerResult::Ok,
            Some(f) if f.kind == FailureKind::TimedOut => LedgerResult::Timeout,
            Some(_) if status == 400 => LedgerResult::Rejected,
            Some(_) => LedgerResult::Error,
        };
        fx.count(metrics::budget_ledger_calls_total(LedgerCall::WriteBack, result), 1);
        let Some(tag) = self.write_backs.get_mut(tag_name) else { return };
        let Some(batch) = tag.sending.as_mut() else { return };
        let finished = match status {
            _ if done => true,
            400 => {
                fx.log(LogLevel::Error, format!("tenant-budget: the Redis ledger rejected a write-back: {}", String::from_utf8_lossy(answer)));
                true
            }
            404 => {
                fx.log(LogLevel::Warn, "tenant-budget: the Redis ledger has no /v1/charge (404); the local fallback's charges are not written back");
                self.write_backs_unsupported = true;
                true
            }
            _ => false,
        };
        if !finished {
            batch.in_flight = false;
            batch.attempts += 1;
            batch.not_before_ns = now.saturating_add(retry_delay_ns(batch.attempts));
            let why = failure.map_or_else(String::new, |f| f.why);
            self.ledger_health(false, &format!("write-back: {why}"), fx);
            return;
        }
        self.write_back_counters = self.write_back_counters.saturating_sub(batch.counters);
        tag.sending = None;
        if self.write_backs_unsupported {
            self.write_backs.clear();
            self.write_back_counters = 0;
        }
        if done {
            self.ledger_health(true, "", fx);
        }
    }

    /// What every hold id of this proxy starts with: the first 8 hex digits of its node id's SHA-256.
    pub fn hold_prefix(&self) -> &str {
        self.vm_nonce.get(..8).unwrap_or_default()
    }

    /// Whether settlements go to the Redis ledger (the host then ticks every [`SETTLE_TICK_MS`]).
    pub fn needs_tick(&self) -> bool {
        self.policy.ledger.uses_service()
    }

    /// Settlements queued and not yet sent.
    pub fn queued_settlements(&self) -> usize {
        self.settle_queue.len()
    }

    /// Logs the ledger's state when it changes (not per request) and exports it as a gauge.
    fn ledger_health(&mut self, ok: bool, why: &str, fx: &mut Effects) {
        if self.ledger_ok == Some(ok) {
            return;
        }
        if ok && self.ledger_ok.is_none() {
            // The first answer: nothing changed.
        } else if ok {
            fx.log(LogLevel::Warn, "tenant-budget: the Redis ledger answers again");
        } else {
            fx.log(LogLevel::Warn, format!("tenant-budget: the Redis ledger is failing: {why}; on_failure = {:?}", self.policy.ledger.on_failure));
        }
        self.ledger_ok = Some(ok);
        fx.push(Effect::GaugeSet { name: metrics::budget_ledger_up().to_string(), value: u64::from(ok) });
    }

    /// Gives back an admission's whole reservation (a request admitted but then not sent).
    fn release(&mut self, store: &mut dyn SharedStore, admission: &Admission, now: u64, fx: &mut Effects) {
        if admission.remote_hold().is_some() {
            self.queue_settlement(admission, &Usage::default(), now, fx);
        } else {
            self.policy.settle(store, admission, &Usage::default(), now);
        }
    }

    /// Queues the release of a reservation whose fate is unknown (its answer never came, or the
    /// request went away before it did), sent [`RELEASE_DELAY_NS`] later.
    fn queue_release(&mut self, pending: &PendingReserve, now: u64, fx: &mut Effects) {
        if self.settle_queue.len() >= MAX_QUEUED_SETTLEMENTS {
            fx.count(metrics::budget_ledger_settlements_dropped_total(), 1);
            return;
        }
        self.settle_queue.push_back(SettleJob { body: pending.release_body(), attempts: 0, not_before_ns: now.saturating_add(RELEASE_DELAY_NS) });
    }

    /// Queues the Redis settlement of `admission` at `actual`; returns the settlement it makes.
    fn queue_settlement(&mut self, admission: &Admission, actual: &Usage, now: u64, fx: &mut Effects) -> Option<Settlement> {
        let (body, settlement) = self.policy.remote_settle(admission, actual)?;
        if self.settle_queue.len() >= MAX_QUEUED_SETTLEMENTS {
            self.settle_queue.pop_front();
            fx.count(metrics::budget_ledger_settlements_dropped_total(), 1);
        }
        self.settle_queue.push_back(SettleJob { body, attempts: 0, not_before_ns: now });
        Some(settlement)
    }

    /// Puts a failed settlement back with a growing delay, or gives up after
    /// [`MAX_SETTLE_ATTEMPTS`] (the hold then expires and is charged at its reservation).
    fn retry_settlement(&mut self, mut job: SettleJob, now: u64, fx: &mut Effects) {
        job.attempts += 1;
        if job.attempts >= MAX_SETTLE_ATTEMPTS {
            fx.count(metrics::budget_ledger_settlements_dropped_total(), 1);
            return;
        }
        job.not_before_ns = now.saturating_add(retry_delay_ns(job.attempts));
        self.settle_queue.push_back(job);
    }

    /// The root's tick: sends the queued settlements that are due, several in one callout when
    /// more than one is due ([`SETTLE_BATCH_MAX`] each). Bounded per tick (jobs looked at, calls
    /// started); the rest waits for the next one, and jobs still backing off go round to the back.
    pub fn on_tick(&mut self, host: &mut dyn BudgetHost, now: u64, fx: &mut Effects) {
        let per_call = if self.batches_unsupported { 1 } else { SETTLE_BATCH_MAX };
        let mut due: Vec<SettleJob> = Vec::new();
        for _ in 0..self.settle_queue.len().min(TICK_LOOKS) {
            let Some(job) = self.settle_queue.pop_front() else { break };
            if job.not_before_ns > now || due.len() >= TICK_CALLS * per_call {
                self.settle_queue.push_back(job);
                continue;
            }
            due.push(job);
        }
        let mut due = due.into_iter().peekable();
        while due.peek().is_some() {
            let (mut jobs, mut bytes) = (Vec::new(), 0usize);
            while let Some(job) = due.next_if(|j| jobs.is_empty() || (jobs.len() < per_call && bytes + j.body.len() < SETTLE_BATCH_MAX_BYTES)) {
                bytes += job.body.len() + 1;
                jobs.push(job);
            }
            let call = if let [job] = jobs.as_slice() {
                host.ledger_call(&self.policy.ledger, SETTLE_PATH, &job.body)
            } else {
                host.ledger_call(&self.policy.ledger, SETTLE_BATCH_PATH, &batch_body(&jobs))
            };
            match call {
                Ok(token) => {
                    self.settle_calls.insert(token, SettleCall { jobs, started: now });
                }
                Err(e) => {
                    self.ledger_health(false, &format!("settle callout not started: {e}"), fx);
                    for job in jobs {
                        self.retry_settlement(job, now, fx);
                    }
                }
            }
        }
        if !self.write_backs.is_empty() {
            self.tick_write_backs(host, now, fx);
        }
    }

    /// Whether callout `token` is a settlement this VM sent (its answer is then read and handed
    /// to [`BudgetPolicy::on_settle_answer`]).
    pub fn awaits_settlement(&self, token: u32) -> bool {
        self.settle_calls.contains_key(&token) || self.write_back_calls.contains_key(&token)
    }

    /// The ledger's answer to settlement callout `token` (`status` 0: no answer, the call failed or
    /// timed out). A batch's answer holds each settlement's own status and answer, in order.
    pub fn on_settle_answer(&mut self, token: u32, status: u16, answer: &[u8], now: u64, fx: &mut Effects) {
        if let Some((tag, started)) = self.write_back_calls.remove(&token) {
            self.write_back_answered(&tag, status, answer, now, fx);
            fx.push(Effect::Record {
                name: metrics::budget_ledger_latency_ms(LedgerCall::WriteBack).to_string(),
                value: now.saturating_sub(started) / 1_000_000,
            });
            return;
        }
        let Some(SettleCall { jobs, started }) = self.settle_calls.remove(&token) else { return };
        self.settle_call_answered(jobs, status, answer, now, fx);
        // The callout's latency, once for all its settlements.
        fx.push(Effect::Record { name: metrics::budget_ledger_latency_ms(LedgerCall::Settle).to_string(), value: now.saturating_sub(started) / 1_000_000 });
    }

    fn settle_call_answered(&mut self, jobs: Vec<SettleJob>, status: u16, answer: &[u8], now: u64, fx: &mut Effects) {
        if jobs.len() == 1 {
            for job in jobs {
                self.settle_answered(job, status, answer, now, fx);
            }
            return;
        }
        if status == 404 {
            // A ledger from before batches: nothing was settled; one by one from now on.
            self.batches_unsupported = true;
            fx.log(LogLevel::Warn, "tenant-budget: the Redis ledger has no /v1/settle_batch (404); settlements are sent one by one");
            self.settle_queue.extend(jobs);
            return;
        }
        let results = (status == 200)
            .then(|| serde_json::from_slice::<serde_json::Value>(answer).ok())
            .flatten()
            .and_then(|v| v.get("results").and_then(|r| r.as_array()).cloned())
            .filter(|r| r.len() == jobs.len());
        match results {
            Some(results) => {
                for (job, item) in jobs.into_iter().zip(results) {
                    let item_status = item.get("status").and_then(serde_json::Value::as_u64).and_then(|s| u16::try_from(s).ok()).unwrap_or(0);
                    let item_answer = item.get("answer").map(|a| a.to_string()).unwrap_or_default();
                    self.settle_answered(job, item_status, item_answer.as_bytes(), now, fx);
                }
            }
            // No answer, the call's own failure, or an answer that is not a batch's: every
            // settlement of it failed alike and is retried (a 400 of the whole batch judged none
            // of them, so it is no item's final answer either).
            None => {
                let status = if matches!(status, 200 | 400) { 502 } else { status };
                for job in jobs {
                    self.settle_answered(job, status, answer, now, fx);
                }
            }
        }
    }

    /// One settlement's answer (alone, or its item of a batch): final, or retried.
    fn settle_answered(&mut self, job: SettleJob, status: u16, answer: &[u8], now: u64, fx: &mut Effects) {
        // 200 with any answer is final: settled now, or already (a retry), or expired (charged at
        // its reservation by the ledger).
        let done = status == 200 && serde_json::from_slice::<serde_json::Value>(answer).is_ok_and(|v| v.get("settled").is_some());
        // A 400 is final: the ledger judged the settlement itself malformed, a retry cannot fix it.
        let rejected = status == 400;
        let failure = (!done).then(|| call_failure(status, answer));
        let result = if done {
            LedgerResult::Ok
        } else if failure.as_ref().is_some_and(|f| f.kind == FailureKind::TimedOut) {
            LedgerResult::Timeout
        } else if rejected {
            LedgerResult::Rejected
        } else {
            LedgerResult::Error
        };
        fx.count(metrics::budget_ledger_calls_total(LedgerCall::Settle, result), 1);
        if done {
            self.ledger_health(true, "", fx);
        } else if rejected {
            fx.log(LogLevel::Error, format!("tenant-budget: the Redis ledger rejected a settlement: {}", String::from_utf8_lossy(answer)));
        } else {
            let why = failure.map_or_else(String::new, |f| f.why);
            self.ledger_health(false, &format!("settle: {why}"), fx);
            self.retry_settlement(job, now, fx);
        }
    }
}

/// Settlements sent in one callout, and when.
#[derive(Debug)]
struct SettleCall {
    jobs: Vec<SettleJob>,
    started: u64,
}

/// `{"settlements":[…]}`: each job's own `/v1/settle` body, in order.
fn batch_body(jobs: &[SettleJob]) -> Vec<u8> {
    let mut body = Vec::with_capacity(20 + jobs.iter().map(|j| j.body.len() + 1).sum::<usize>());
    body.extend_from_slice(b"{\"settlements\":[");
    for (i, job) in jobs.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(&job.body);
    }
    body.extend_from_slice(b"]}");
    body
}

/// What is kept of the response, to charge it.
#[derive(Debug)]
enum ResponseBody {
    /// A whole answer, collected up to [`MAX_RESPONSE_BODY_BYTES`] (the default until response
    /// headers say it streams).
    Collected(Vec<u8>),
    /// A stream, observed event by event; the usage sluice asked for is stripped when `stripper`.
    Observed { observer: Observer, stripper: Option<UsageChunkStripper> },
}

/// The Redis ledger is deciding; the request body is held meanwhile.
#[derive(Debug)]
struct Reserving {
    token: u32,
    pending: PendingReserve,
    started: u64,
    body: Vec<u8>,
    /// This reservation is the clamped retry of a refused one.
    clamped_retry: bool,
}

/// An admitted request: what it reserved and what its response has shown so far.
#[derive(Debug)]
struct Admitted {
    admission: Admission,
    /// sluice added `stream_options.include_usage`: the usage is stripped from the response.
    injected_usage: bool,
    /// The first budget past its soft limit, announced in a response header.
    soft_warning: Option<String>,
    response: ResponseBody,
}

/// Where a budgeted request is.
#[derive(Debug)]
enum Phase {
    /// Identified; the body is held until it is complete (the decision is pending).
    Holding,
    /// Waiting for the Redis ledger's answer (the decision is pending).
    Reserving(Box<Reserving>),
    Admitted(Box<Admitted>),
    /// Let through without a budget (the ledger failed, `on_failure = allow`): nothing to settle.
    Unbudgeted,
    /// Refused with a local reply: nothing reserved, nothing to settle.
    Refused,
    /// The end was accounted for (charged, or stamped as not evaluated).
    Settled,
}

/// A request on an LLM path, from identification to settlement.
#[derive(Debug)]
struct Budgeted {
    kind: ApiKind,
    key: Option<usize>,
    /// Hash of the request's identity for `identity_budgets`.
    identity: Option<String>,
    model_version: Option<String>,
    request: Option<RequestInfo>,
    /// The upstream's response status (0 before response headers).
    status: u16,
    phase: Phase,
    stamp: Stamp,
    /// Envoy traces this request ([`crate::span::traced`]), and the decision its span was last given.
    traced: bool,
    span_decision: Option<&'static str>,
    /// Admitted by the local fallback: the Redis counters its charge is written back to.
    write_back: Option<WriteBack>,
}

/// One stream's budget; `None` inside for traffic on paths that are not an LLM API.
#[derive(Debug, Default)]
pub struct BudgetFlow {
    context_id: u32,
    budgeted: Option<Box<Budgeted>>,
}

impl BudgetFlow {
    /// The flow of stream `context_id` (part of its Redis hold id).
    pub fn new(context_id: u32) -> BudgetFlow {
        BudgetFlow { context_id, budgeted: None }
    }

    /// Whether this request is budgeted (it is on an LLM path).
    pub fn is_budgeted(&self) -> bool {
        self.budgeted.is_some()
    }

    /// Whether callout `token` is this stream's reservation (its answer is then read and handed to
    /// [`BudgetFlow::on_reserve_answer`]).
    pub fn awaits_reserve(&self, token: u32) -> bool {
        self.budgeted.as_ref().is_some_and(|b| matches!(&b.phase, Phase::Reserving(r) if r.token == token))
    }

    /// Identifies the request from its header map (one read for the path, the identity sources,
    /// the version and the encoding).
    pub fn on_request_headers(&mut self, policy: &mut BudgetPolicy, headers: &HeaderPairs, end_of_stream: bool, fx: &mut Effects) -> Verdict {
        let path = headers.text(":path").unwrap_or_default();
        let Some(kind) = ApiKind::from_path(&path) else { return Verdict::Continue };
        let p = &policy.policy;
        let key = identify(p, headers);
        let identity = per_identity(p, headers);
        let model_version = headers.text(&p.model_version_header);
        let b = self.budgeted.insert(Box::new(Budgeted {
            kind,
            key,
            identity,
            model_version,
            request: None,
            status: 0,
            phase: Phase::Holding,
            stamp: Stamp::default(),
            traced: crate::span::traced(headers.text("x-request-id").as_deref()),
            span_decision: None,
            write_back: None,
        }));
        let Some(key) = key else {
            b.reject(policy, 401, "authentication_error", "unknown_key", "the request's API key or tenant is not in the budget policy", None, fx);
            return Verdict::Pause;
        };
        if let Some(node) = p.keys.get(key) {
            b.stamp.key = Some(node.id.clone());
            b.stamp.team = Some(node.team.clone());
            b.stamp.org = Some(node.org.clone());
        }
        if headers.first("content-encoding").is_some_and(crate::headers::is_encoded) {
            b.reject(policy, 415, "invalid_request_error", "encoded_body", "compressed request bodies cannot be budgeted; send identity encoding", None, fx);
            return Verdict::Pause;
        }
        if end_of_stream {
            // No body at all: nothing to size.
            b.reject(policy, 400, "invalid_request_error", "no_body", "an LLM request needs a JSON body", None, fx);
            return Verdict::Pause;
        }
        // The body may be rewritten (output limit, include_usage): its length will change.
        fx.push(Effect::SetHeader { dir: Dir::Request, name: "content-length".into(), value: None });
        // Headers continue: Envoy's wasm host turns a paused header phase into "stop everything",
        // and the body would then never reach this filter. The body is held instead (below) until
        // admission, so a refused request reaches the upstream as headers and a reset, no body —
        // the model never sees it.
        Verdict::Continue
    }

    /// Holds the body until it is complete, then admits it (locally, or by asking the ledger).
    #[allow(clippy::too_many_arguments)]
    pub fn on_request_body(
        &mut self,
        policy: &mut BudgetPolicy,
        store: &mut dyn SharedStore,
        host: &mut dyn BudgetHost,
        view: &mut dyn View,
        size: usize,
        end_of_stream: bool,
        now: u64,
        fx: &mut Effects,
    ) -> Verdict {
        let Some(b) = self.budgeted.as_mut() else { return Verdict::Continue };
        if !matches!(b.phase, Phase::Holding) {
            return Verdict::Pause;
        }
        if size > MAX_REQUEST_BODY_BYTES {
            b.reject(policy, 413, "request_too_large", "body_too_large", "request body too large to budget", None, fx);
            return Verdict::Pause;
        }
        if !end_of_stream {
            // Envoy buffers until the whole body is here (bounded by its buffer limits and ours).
            return Verdict::Pause;
        }
        let body = view.body(Dir::Request, size);
        b.admit(policy, store, host, self.context_id, &body, size, now, fx)
    }

    /// The Redis ledger's answer to this request's reservation (`status` 0: none came). `Continue`:
    /// the held request goes on (the host resumes it).
    #[allow(clippy::too_many_arguments)]
    pub fn on_reserve_answer(
        &mut self,
        policy: &mut BudgetPolicy,
        store: &mut dyn SharedStore,
        host: &mut dyn BudgetHost,
        status: u16,
        answer: &[u8],
        now: u64,
        fx: &mut Effects,
    ) -> Verdict {
        let Some(b) = self.budgeted.as_mut() else { return Verdict::Pause };
        // Back to pending until the answer is decided (every branch below leaves a phase).
        let Phase::Reserving(reserving) = std::mem::replace(&mut b.phase, Phase::Holding) else { return Verdict::Pause };
        let Reserving { pending, started, body, clamped_retry, .. } = *reserving;
        let result = policy.policy.remote_admission(&pending, status, answer);
        let failure = (status != 200).then(|| call_failure(status, answer).kind);
        let outcome = match &result {
            Ok(_) | Err(AdmitError::Exceeded(_)) => LedgerResult::Ok,
            Err(_) if failure == Some(FailureKind::TimedOut) => LedgerResult::Timeout,
            Err(_) => LedgerResult::Error,
        };
        fx.count(metrics::budget_ledger_calls_total(LedgerCall::Reserve, outcome), 1);
        fx.push(Effect::Record { name: metrics::budget_ledger_latency_ms(LedgerCall::Reserve).to_string(), value: now.saturating_sub(started) / 1_000_000 });
        if outcome == LedgerResult::Ok {
            policy.ledger_health(true, "", fx);
        }
        let size = body.len();
        match result {
            Err(AdmitError::Exceeded(refusal)) => match policy.policy.remote_clamped(&pending, &refusal) {
                Some(clamped) => b.dispatch_reserve(policy, store, host, clamped, body, true, now, fx),
                None => b.decided(policy, store, host, Err(AdmitError::Exceeded(refusal)), &body, size, now, fx),
            },
            Err(AdmitError::Store(e)) => {
                // The reservation may still run in Redis after this (a stall past the timeout): release
                // it, a second later; the ledger's tombstone stops a reservation arriving after that.
                // One Envoy never sent holds nothing, and its release would only add to an outage.
                if failure != Some(FailureKind::NotSent) {
                    policy.queue_release(&pending, now, fx);
                }
                b.ledger_failed(policy, store, host, &e, &pending, body, now, fx)
            }
            Ok(mut admission) => {
                admission.clamped = clamped_retry;
                b.decided(policy, store, host, Ok(admission), &body, size, now, fx)
            }
            Err(other) => b.decided(policy, store, host, Err(other), &body, size, now, fx),
        }
    }

    /// Announces the budget to the client (rate headers, soft-limit warning, a clamp) and starts
    /// observing the response.
    pub fn on_response_headers(&mut self, policy: &mut BudgetPolicy, view: &mut dyn View, now: u64, fx: &mut Effects) {
        let Some(b) = self.budgeted.as_mut() else { return };
        let Budgeted { kind, status, phase, .. } = &mut **b;
        *status = view.response_header(":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        let Phase::Admitted(a) = phase else { return };
        let streaming = view.response_header("content-type").is_some_and(|c| c.to_ascii_lowercase().starts_with("text/event-stream"));
        if streaming {
            let stripper = a.injected_usage.then(|| UsageChunkStripper::new(DEFAULT_MAX_EVENT_BYTES));
            let mut observer = view.response_observer(*kind);
            if stripper.is_some() {
                // The stripper takes the observer's word for the events it found to be JSON.
                observer.keep_validated();
            }
            a.response = ResponseBody::Observed { observer, stripper };
        }
        let mut set = |name: String, value: String| fx.push(Effect::SetHeader { dir: Dir::Response, name, value: Some(value) });
        for (name, value) in rate_headers(&policy.policy, &a.admission, now) {
            set(name, value);
        }
        if let Some(code) = &a.soft_warning {
            set("x-sluice-budget-warning".into(), format!("soft limit reached: {code}"));
        }
        if a.admission.clamped {
            set("x-sluice-clamped-max-tokens".into(), a.admission.output_tokens.to_string());
        }
        if matches!(a.response, ResponseBody::Observed { stripper: Some(_), .. }) {
            // The body changes length when the usage chunk is removed.
            fx.push(Effect::SetHeader { dir: Dir::Response, name: "content-length".into(), value: None });
        }
    }

    /// Observes (or collects) the response and strips the usage sluice asked for; settles at its end.
    #[allow(clippy::too_many_arguments)]
    pub fn on_response_body(
        &mut self,
        policy: &mut BudgetPolicy,
        store: &mut dyn SharedStore,
        view: &mut dyn View,
        size: usize,
        end_of_stream: bool,
        now: u64,
        fx: &mut Effects,
    ) {
        let Some(b) = self.budgeted.as_mut() else { return };
        let Phase::Admitted(a) = &mut b.phase else { return };
        match &mut a.response {
            ResponseBody::Observed { observer, stripper } => {
                // A reader behind a shared observer reads the chunk only to strip it.
                let chunk = if stripper.is_some() || observer.reads_chunk() { view.body(Dir::Response, size) } else { std::borrow::Cow::Borrowed(&[][..]) };
                observer.push(&chunk);
                if end_of_stream {
                    observer.finish();
                }
                if let Some(stripper) = stripper {
                    let changed = observer.with_validated(|known| stripper.push_changed_knowing(&chunk, known));
                    let held = if end_of_stream { stripper.finish() } else { Vec::new() };
                    if changed.is_some() || !held.is_empty() {
                        let mut out = changed.unwrap_or_else(|| chunk.to_vec());
                        out.extend_from_slice(&held);
                        if *out != *chunk {
                            fx.push(Effect::ReplaceBody { dir: Dir::Response, bytes: out });
                        }
                    }
                }
            }
            ResponseBody::Collected(body) => {
                let chunk = view.body(Dir::Response, size);
                if body.len() + chunk.len() <= MAX_RESPONSE_BODY_BYTES {
                    body.extend_from_slice(&chunk);
                }
            }
        }
        if end_of_stream {
            b.settle(policy, store, view, Outcome::Completed, now, fx);
        }
    }

    /// Trailers end the response: the body saw no end of stream.
    pub fn on_response_trailers(&mut self, policy: &mut BudgetPolicy, store: &mut dyn SharedStore, view: &mut dyn View, now: u64, fx: &mut Effects) {
        let Some(b) = self.budgeted.as_mut() else { return };
        b.finish_observer();
        b.settle(policy, store, view, Outcome::Completed, now, fx);
    }

    /// The stream's teardown: releases a reservation still being decided, and settles a request
    /// whose response never ended (a client that went away, an upstream that failed).
    pub fn on_log(&mut self, policy: &mut BudgetPolicy, store: &mut dyn SharedStore, view: &mut dyn View, now: u64, fx: &mut Effects) {
        let Some(b) = self.budgeted.as_mut() else { return };
        // Gone while the Redis ledger decided (the host cancelled the callout): release the hold it
        // may have made. Sent a second later, so that the reservation has landed first.
        if let Phase::Reserving(r) = &b.phase {
            if cfg!(feature = "ledger-service") {
                policy.queue_release(&r.pending, now, fx);
            }
            b.phase = Phase::Holding;
        }
        if !matches!(b.phase, Phase::Refused | Phase::Settled) {
            let outcome = view.unended_outcome();
            b.finish_observer();
            b.settle(policy, store, view, outcome, now, fx);
        }
    }
}

impl Budgeted {
    fn write_stamp(&mut self, policy: &BudgetPolicy, fx: &mut Effects) {
        fx.set_state(&policy.policy.filter_state_key, self.stamp.to_json());
        // The span gets the decision once (settling stamps the same decision again).
        if self.traced && self.stamp.decision != self.span_decision {
            if let Some(decision) = self.stamp.decision {
                crate::span::budget(decision, self.stamp.reject_code.as_deref(), fx);
            }
            self.span_decision = self.stamp.decision;
        }
    }

    fn finish_observer(&mut self) {
        if let Phase::Admitted(a) = &mut self.phase {
            if let ResponseBody::Observed { observer, .. } = &mut a.response {
                observer.finish();
            }
        }
    }

    /// Refuses the request with a local reply in the API's error shape, recorded for the other
    /// plugins (the gateway's own reply) and stamped.
    #[allow(clippy::too_many_arguments)]
    fn reject(&mut self, policy: &BudgetPolicy, status: u32, error_type: &str, code: &str, message: &str, retry_after_s: Option<u64>, fx: &mut Effects) {
        self.phase = Phase::Refused;
        let (key, _, _) = key_path(&policy.policy, self.key);
        fx.count(metrics::budget_rejections_total(&sanitize_label(&key), &sanitize_label(code)), 1);
        self.stamp.decision = Some("rejected");
        self.stamp.reject_code = Some(code.to_string());
        self.stamp.status = Some(status);
        self.stamp.outcome = Some(Outcome::Refused.as_str());
        self.write_stamp(policy, fx);
        let body = error_body(Some(self.kind), message, error_type, code);
        let mut headers = vec![("content-type".to_string(), "application/json".to_string())];
        if let Some(s) = retry_after_s {
            headers.push(("retry-after".to_string(), s.to_string()));
        }
        // Recorded before the reply it describes.
        fx.push(Effect::MarkReply(GatewayReply { status: u16::try_from(status).unwrap_or(500), end: GatewayEnd::Refused }));
        fx.push(Effect::LocalReply { status, headers, body: body.into_bytes() });
    }

    /// Sizes the request and asks for its reservation: the local ledger decides now, the Redis
    /// ledger by a callout.
    #[allow(clippy::too_many_arguments)]
    fn admit(
        &mut self,
        policy: &mut BudgetPolicy,
        store: &mut dyn SharedStore,
        host: &mut dyn BudgetHost,
        context_id: u32,
        body: &[u8],
        body_size: usize,
        now: u64,
        fx: &mut Effects,
    ) -> Verdict {
        let Some(key) = self.key else { return Verdict::Pause };
        let info = match inspect_request_with_kind(self.kind, body) {
            Ok((kind, info)) => {
                // A chat body posted to a completions path is a chat request: size, rewrite and
                // read the response as one.
                self.kind = kind;
                info
            }
            Err(e) => {
                let message = format!("request body cannot be budgeted: {e}");
                self.reject(policy, 400, "invalid_request_error", "malformed_body", &message, None, fx);
                return Verdict::Pause;
            }
        };
        let p = &policy.policy;
        let ceiling = p.keys.get(key).and_then(|k| k.max_output_tokens).unwrap_or(p.default_max_output_tokens);
        let output = info.max_output_tokens.map_or(ceiling, |requested| requested.min(ceiling));
        let input = match p.mode {
            // Every prompt token comes from at least one byte of the body (message text, tool
            // definitions), and a chat template's per-message tokens are fewer than the JSON framing
            // bytes of each message: the body size bounds the prompt for any tokenizer.
            Mode::Strict => (body.len() as u64).saturating_add(if info.has_tools { TOOL_PROMPT_ALLOWANCE } else { 0 }),
            Mode::Estimate => info.prompt_tokens_estimate.saturating_mul(100 + u64::from(p.estimate_margin_percent)).div_ceil(100),
        };
        let demand =
            Demand { input_tokens: input, output_tokens: output, choices: info.output_choices, model: info.model.clone(), identity: self.identity.clone() };
        self.request = Some(info);
        if p.ledger.uses_service() {
            // A hold id unique to this request attempt: the VM's nonce, the stream and the time.
            let id = format!("{}-{context_id:x}-{now:x}", policy.vm_nonce);
            return match p.remote_reserve(key, &demand, now, &id) {
                Ok(pending) => self.dispatch_reserve(policy, store, host, pending, body.to_vec(), false, now, fx),
                Err(e) => self.decided(policy, store, host, Err(e), body, body_size, now, fx),
            };
        }
        let result = p.admit(store, key, &demand, now);
        self.decided(policy, store, host, result, body, body_size, now, fx)
    }

    /// Sends a reservation to the Redis ledger; the request waits (paused) for the answer.
    #[allow(clippy::too_many_arguments)]
    fn dispatch_reserve(
        &mut self,
        policy: &mut BudgetPolicy,
        store: &mut dyn SharedStore,
        host: &mut dyn BudgetHost,
        pending: PendingReserve,
        body: Vec<u8>,
        clamped_retry: bool,
        now: u64,
        fx: &mut Effects,
    ) -> Verdict {
        match host.ledger_call(&policy.policy.ledger, RESERVE_PATH, &pending.body) {
            Ok(token) => {
                // Named in the stamp from here on, whatever the answer: a hold can be traced.
                self.stamp.ledger_hold = Some(pending.id.clone());
                self.phase = Phase::Reserving(Box::new(Reserving { token, pending, started: now, body, clamped_retry }));
                Verdict::Pause
            }
            Err(e) => self.ledger_failed(policy, store, host, &format!("reserve callout not started: {e}"), &pending, body, now, fx),
        }
    }

    /// The Redis ledger did not answer usably: the policy's `on_failure` decides.
    #[allow(clippy::too_many_arguments)]
    fn ledger_failed(
        &mut self,
        policy: &mut BudgetPolicy,
        store: &mut dyn SharedStore,
        host: &mut dyn BudgetHost,
        why: &str,
        pending: &PendingReserve,
        body: Vec<u8>,
        now: u64,
        fx: &mut Effects,
    ) -> Verdict {
        policy.ledger_health(false, why, fx);
        match policy.policy.ledger.on_failure {
            LedgerFailure::Deny => {
                self.reject(policy, 503, "overloaded", "budget_ledger_unavailable", "the budget ledger is unavailable; retry shortly", Some(1), fx);
                Verdict::Pause
            }
            LedgerFailure::Allow => {
                self.phase = Phase::Unbudgeted;
                self.stamp.decision = Some("unbudgeted");
                self.write_stamp(policy, fx);
                fx.count(metrics::budget_ledger_fallback_total(LedgerFallback::Allow), 1);
                Verdict::Continue
            }
            LedgerFailure::Local => {
                fx.count(metrics::budget_ledger_fallback_total(LedgerFallback::Local), 1);
                self.write_back = Some(pending.write_back());
                let result = match self.key {
                    Some(key) => policy.policy.admit_fallback(store, key, pending.demand(), now),
                    None => Err(AdmitError::Store("no key".into())),
                };
                self.decided(policy, store, host, result, &body, body.len(), now, fx)
            }
        }
    }

    /// Applies an admission decision (local or Redis): rewrite and stamp an admitted request, or
    /// answer a refused one.
    #[allow(clippy::too_many_arguments)]
    fn decided(
        &mut self,
        policy: &mut BudgetPolicy,
        store: &mut dyn SharedStore,
        host: &mut dyn BudgetHost,
        result: Result<Admission, AdmitError>,
        body: &[u8],
        body_size: usize,
        now: u64,
        fx: &mut Effects,
    ) -> Verdict {
        let admission = match result {
            Ok(admission) => admission,
            Err(AdmitError::Exceeded(refusal)) => {
                let code = policy.policy.counters.get(refusal.counter).map(|c| c.code.clone()).unwrap_or_default();
                let message = format!(
                    "budget {code} exceeded: {} used and {} reserved of {}; resets in {} s",
                    refusal.used, refusal.reserved, refusal.limit, refusal.retry_after_s
                );
                self.reject(policy, 429, "budget_exceeded", &code, &message, Some(refusal.retry_after_s), fx);
                return Verdict::Pause;
            }
            Err(AdmitError::Unpriced { model, .. }) => {
                let message = format!("no price is configured for model {model:?}, and a money budget applies");
                self.reject(policy, 400, "invalid_request_error", "unpriced_model", &message, None, fx);
                return Verdict::Pause;
            }
            Err(AdmitError::Store(e)) => {
                fx.log(LogLevel::Warn, format!("budget store failed, refusing: {e}"));
                self.reject(policy, 503, "overloaded", "budget_store_unavailable", "budget ledger busy, retry", Some(1), fx);
                return Verdict::Pause;
            }
        };
        let asked = self.request.as_ref().and_then(|r| r.max_output_tokens);
        let set_limit = (asked != Some(admission.output_tokens)).then_some(admission.output_tokens);
        let inject_usage = self.request.as_ref().is_some_and(|r| policy.policy.include_usage && r.stream && !r.include_usage);
        let mut injected_usage = false;
        if inject_usage || set_limit.is_some() {
            match rewrite_request(self.kind, body, inject_usage, set_limit) {
                Ok(rewrite) => {
                    injected_usage = rewrite.injected_include_usage;
                    if !host.replace_request_body(body_size, &rewrite.body) {
                        // The limit the reservation assumed cannot be written: not admitted.
                        policy.release(store, &admission, now, fx);
                        self.reject(
                            policy,
                            503,
                            "overloaded",
                            "unrewritable_body",
                            "the request body could not be updated to enforce the budget; retry",
                            Some(1),
                            fx,
                        );
                        return Verdict::Pause;
                    }
                }
                Err(e) => {
                    // Parsed once already, so this is a number serde cannot round-trip: the
                    // output limit cannot be enforced, so the request cannot be admitted.
                    policy.release(store, &admission, now, fx);
                    let message = format!("request body cannot be rewritten to enforce the budget: {e}");
                    self.reject(policy, 400, "invalid_request_error", "unrewritable_body", &message, None, fx);
                    return Verdict::Pause;
                }
            }
        }
        let (key_id, _, _) = key_path(&policy.policy, self.key);
        if admission.clamped {
            fx.count(metrics::budget_clamps_total(&key_id), 1);
        }
        let mut soft_warning = None;
        for ((index, _), counter) in admission.leases.iter().zip(&admission.after) {
            if let Some(spec) = policy.policy.counters.get(*index) {
                if publish_counter(spec, counter, 0, &key_id, fx) && soft_warning.is_none() {
                    soft_warning = Some(spec.code.clone());
                }
            }
        }
        let s = &mut self.stamp;
        s.decision = Some(if admission.clamped { "clamped" } else { "admitted" });
        if let Some(hold) = admission.remote_hold() {
            s.ledger = Some("redis");
            s.ledger_hold = Some(hold.id.clone());
        } else if policy.policy.ledger.uses_service() {
            s.ledger = Some("local_fallback");
        }
        s.reserved_input_tokens = Some(admission.input_tokens);
        s.reserved_output_tokens = Some(admission.reserved_output_tokens());
        s.reserved_tokens = Some(admission.input_tokens.saturating_add(admission.reserved_output_tokens()));
        s.reserved_micro_usd = Some(admission.reserved_micro_usd);
        self.write_stamp(policy, fx);
        self.phase = Phase::Admitted(Box::new(Admitted { admission, injected_usage, soft_warning, response: ResponseBody::Collected(Vec::new()) }));
        Verdict::Continue
    }

    /// Charges what the request used and gives back the rest of its reservation; stamps the end.
    fn settle(&mut self, policy: &mut BudgetPolicy, store: &mut dyn SharedStore, view: &mut dyn View, seen: Outcome, now: u64, fx: &mut Effects) {
        if matches!(self.phase, Phase::Refused | Phase::Settled) {
            return;
        }
        let Phase::Admitted(admitted) = std::mem::replace(&mut self.phase, Phase::Settled) else {
            // Refused by another plugin before admission (latency-guard's shedding): nothing was
            // reserved; the stamp still tells the request's story.
            if let Some(g) = view.gateway_reply() {
                self.stamp.decision = Some("not_evaluated");
                self.stamp.status = Some(u32::from(g.status));
                self.stamp.outcome = Some(Outcome::from(g.end).as_str());
                self.write_stamp(policy, fx);
            }
            return;
        };
        let Admitted { admission, response, .. } = *admitted;
        let summary = match &response {
            ResponseBody::Observed { observer, .. } => observer.summary(),
            ResponseBody::Collected(body) => inspect_response_body(self.kind, body),
        };
        let (prompt_estimate, request_model) = self.request.as_ref().map_or((0, None), |r| (r.prompt_tokens_estimate, r.model.as_deref()));
        // A reply latency-guard generated (a deadline) is that status and outcome for the charge too.
        let gateway = view.gateway_reply();
        let status = gateway.map_or(self.status, |g| g.status);
        let produced = (200..300).contains(&self.status);
        let outcome = Outcome::classify(gateway, seen, self.status, summary.upstream_error.is_some());
        // Charge what the upstream reports; without a report, what was seen (output) and the prompt
        // estimate (input). A refused or failed upstream answer produced nothing to charge, and
        // neither did a stream the gateway ended before any content reached it.
        // (Anthropic's message_start reports the input before any content: a 504 after it still
        // charges nothing.)
        let nothing_passed = outcome == Outcome::Deadline && summary.estimated_output_tokens == 0;
        let actual = match (produced, summary.usage_reported) {
            (true, true) => summary.usage,
            (true, false) if nothing_passed => Usage::default(),
            (true, false) => Usage {
                input_tokens: if summary.usage.input_tokens > 0 { summary.usage.input_tokens } else { prompt_estimate },
                output_tokens: summary.estimated_output_tokens,
                ..summary.usage
            },
            (false, _) => Usage::default(),
        };
        let settlement = match admission.remote_hold() {
            Some(_) => policy.queue_settlement(&admission, &actual, now, fx).unwrap_or_default(),
            None => {
                let settlement = policy.policy.settle(store, &admission, &actual, now);
                if let Some(target) = self.write_back.take().filter(|_| cfg!(feature = "ledger-service")) {
                    let amounts = policy.policy.write_back_amounts(&target, &actual, settlement.micro_usd);
                    policy.queue_write_back(&target, &amounts, fx);
                }
                settlement
            }
        };
        let (key, team, org) = key_path(&policy.policy, self.key);
        let mv = policy.model_versions.label(self.model_version.as_deref().or(request_model).unwrap_or("unknown"));
        let labels = metrics::ChargeSeries::new(&key, &team, &org, &mv);
        let charged_tokens = actual.input_tokens.saturating_add(actual.output_tokens);
        fx.count(metrics::budget_charged_tokens_total(&labels), i64::try_from(charged_tokens).unwrap_or(i64::MAX));
        fx.count(metrics::budget_charged_micro_usd_total(&labels), i64::try_from(settlement.micro_usd).unwrap_or(i64::MAX));
        let reserved_tokens = admission.input_tokens.saturating_add(admission.reserved_output_tokens());
        fx.push(Effect::Record { name: metrics::budget_overestimate_tokens(&key), value: reserved_tokens.saturating_sub(charged_tokens) });
        for (((index, lease), after), over) in admission.leases.iter().zip(&settlement.after).zip(&settlement.over_estimates) {
            if let (Some(spec), Some(counter)) = (policy.policy.counters.get(*index), after) {
                let charged = u64::try_from(i128::from(lease.amount) - over).unwrap_or(0);
                publish_counter(spec, counter, charged, &key, fx);
            }
        }
        let s = &mut self.stamp;
        s.input_tokens = Some(actual.input_tokens);
        s.output_tokens = Some(actual.output_tokens);
        s.charged_tokens = Some(charged_tokens);
        s.charged_micro_usd = Some(settlement.micro_usd);
        s.usage = Some(if summary.usage_reported { "reported" } else { "estimated" });
        s.status = Some(u32::from(status));
        s.outcome = Some(outcome.as_str());
        self.write_stamp(policy, fx);
    }
}

/// Publishes the remaining-budget gauge; returns whether the counter's *usage* is at or past its
/// soft limit (announced to the client). A crossing — this request's charge `charged` took usage
/// past it — is counted and logged once. Reservations do not count: a worst case that never
/// happens must not announce anything.
pub fn publish_counter(spec: &CounterSpec, counter: &Counter, charged: u64, key: &str, fx: &mut Effects) -> bool {
    if spec.per_identity {
        // One counter per identity: a gauge would need a label per identity (unbounded), and
        // without one it would show whichever identity was seen last. Only the announcement stays.
        return spec.soft_limit.is_some_and(|soft| counter.used >= soft);
    }
    fx.push(Effect::GaugeSet { name: metrics::budget_remaining(spec), value: spec.limit.value().saturating_sub(counter.committed()) });
    let Some(soft) = spec.soft_limit else { return false };
    let used = counter.used;
    if charged > 0 && used >= soft && used.saturating_sub(charged) < soft {
        fx.count(metrics::budget_soft_limit_crossings_total(spec), 1);
        fx.log(LogLevel::Info, format!("soft limit of {} crossed by key {key}: {used} of {} used (soft limit {soft})", spec.code, spec.limit.value()));
    }
    used >= soft
}

/// Resolves the request's key from the configured authenticated sources, in order: API key hash,
/// auth-filter header, JWT claim; falls back to the policy's default key for unknown callers.
pub fn identify(policy: &Policy, headers: &HeaderPairs) -> Option<usize> {
    let id = &policy.identity;
    let found = first_credential(headers, id.api_key, id.header.as_deref(), id.jwt.as_ref(), |credential| match credential {
        Credential::ApiKeyHash(hash) => policy.key_by_api_key_hash(&hash),
        Credential::Header(value) | Credential::JwtClaim(value) => policy.key_by_id(&value),
    });
    found.or(policy.unknown_default)
}

/// The identity `identity_budgets` count by, hashed: the first per-identity source present. `None`
/// when the policy has none or the request carries none (it then counts as `anonymous`).
pub fn per_identity(policy: &Policy, headers: &HeaderPairs) -> Option<String> {
    let source = policy.identity.per_identity.as_ref()?;
    first_credential(headers, source.api_key, source.header.as_deref(), source.jwt.as_ref(), |credential| {
        Some(identity_hash(&match credential {
            Credential::ApiKeyHash(hash) => format!("api_key:{hash}"),
            Credential::Header(value) if value.is_empty() => return None,
            Credential::Header(value) => format!("header:{value}"),
            Credential::JwtClaim(claim) => format!("jwt:{claim}"),
        }))
    })
}

/// What a request presents, from one of the authenticated sources a policy names.
enum Credential {
    /// SHA-256 (lowercase hex) of `Authorization: Bearer …` / `x-api-key`.
    ApiKeyHash(String),
    /// The trimmed value of the header an auth filter in front writes.
    Header(String),
    /// A claim of the payload jwt_authn verified and forwards.
    JwtClaim(String),
}

/// Tries the sources in the documented order (API key, header, JWT claim) and returns the first
/// credential `accept` maps to something; a source that is absent, or not accepted, passes to the next.
///
/// A header that is present more than once is no credential (nor is one whose count the host cannot
/// give): Envoy's single-value read returns only the first copy, so a client's copy ahead of the one
/// an auth filter appended — or two copies naming two tenants — must not name anyone.
fn first_credential<T>(
    headers: &HeaderPairs,
    api_key: bool,
    header: Option<&str>,
    jwt: Option<&JwtConfig>,
    mut accept: impl FnMut(Credential) -> Option<T>,
) -> Option<T> {
    if api_key {
        if let Some(key) = api_key_from_headers(headers.single("authorization"), headers.single("x-api-key")) {
            if let Some(found) = accept(Credential::ApiKeyHash(sha256_hex(&key))) {
                return Some(found);
            }
        }
    }
    if let Some(value) = header.and_then(|h| headers.single(h)).map(String::from_utf8_lossy) {
        if let Some(found) = accept(Credential::Header(value.trim().to_string())) {
            return Some(found);
        }
    }
    let claim = jwt.and_then(|j| headers.single(&j.header).and_then(|payload| jwt_payload_claim(payload, &j.claim)))?;
    accept(Credential::JwtClaim(claim))
}

/// `x-ratelimit-*` headers for the tightest window of each unit (least room left).
pub fn rate_headers(policy: &Policy, admission: &Admission, now: u64) -> Vec<(String, String)> {
    let mut tightest: [Option<(u64, u64, u64)>; 3] = [None, None, None];
    for ((index, _), counter) in admission.leases.iter().zip(&admission.after) {
        let Some(spec) = policy.counters.get(*index) else { continue };
        let slot = match spec.limit {
            Limit::Tokens { .. } => 0,
            Limit::Requests(_) => 1,
            Limit::MicroUsd(_) => 2,
        };
        let limit = spec.limit.value();
        let remaining = limit.saturating_sub(counter.committed());
        let reset_s = spec.window.end_ns(now).saturating_sub(now).div_ceil(1_000_000_000);
        if let Some(entry) = tightest.get_mut(slot) {
            if entry.is_none_or(|(_, r, _)| remaining < r) {
                *entry = Some((limit, remaining, reset_s));
            }
        }
    }
    let mut out = Vec::new();
    for (unit, entry) in ["tokens", "requests", "micro-usd"].iter().zip(tightest) {
        if let Some((limit, remaining, reset)) = entry {
            let mut reset_text = crate::text::u64_text(reset);
            reset_text.push('s');
            out.push((crate::text::join(&["x-ratelimit-limit-", unit]), crate::text::u64_text(limit)));
            out.push((crate::text::join(&["x-ratelimit-remaining-", unit]), crate::text::u64_text(remaining)));
            out.push((crate::text::join(&["x-ratelimit-reset-", unit]), reset_text));
        }
    }
    out
}

/// Ids of the request's key, its team and its org (`unknown` before the key is identified).
fn key_path(policy: &Policy, key: Option<usize>) -> (String, String, String) {
    match key.and_then(|k| policy.keys.get(k)) {
        Some(node) => (node.id.clone(), node.team.clone(), node.org.clone()),
        None => ("unknown".into(), "unknown".into(), "unknown".into()),
    }
}
