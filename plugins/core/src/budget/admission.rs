//! Admission and settlement of one request against every budget of its key, team and org.
//!
//! Admission reserves the worst case on every counter (rolling back what it took if a later counter
//! refuses); settlement replaces each reservation by the actual charge. Both go through
//! [`super::ledger`], so the invariants documented there hold for the whole hierarchy.

use super::ledger::{self, Counter, Lease, ReserveError, SharedStore, StoreError};
use super::policy::{Limit, Policy};
use crate::usage::Usage;

const NS_PER_S: u64 = 1_000_000_000;

/// The worst case a request may cost, before it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Demand {
    pub input_tokens: u64,
    /// Output limit of one generation (what is written into the request).
    pub output_tokens: u64,
    /// Generations the request asks for ([`crate::request::RequestInfo::output_choices`]): the
    /// reservation covers `output_tokens × choices`.
    pub choices: u64,
    /// Model used to price the request.
    pub model: Option<String>,
}

/// A request admitted: its leases and what it may produce.
#[derive(Debug, Clone, PartialEq)]
pub struct Admission {
    pub key: usize,
    pub model: Option<String>,
    /// `(counter index, lease)` for every counter of the key.
    pub leases: Vec<(usize, Lease)>,
    pub input_tokens: u64,
    /// Output limit of one generation granted (lower than asked when clamped).
    pub output_tokens: u64,
    /// Generations covered: the reservation holds `output_tokens × choices` output tokens.
    pub choices: u64,
    pub clamped: bool,
    pub reserved_micro_usd: u64,
    /// Counters after the reservation, same order as `leases`: for rate headers and gauges.
    pub after: Vec<Counter>,
}

/// A request refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub counter: usize,
    pub used: u64,
    pub reserved: u64,
    pub limit: u64,
    /// Seconds until the refusing window resets.
    pub retry_after_s: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdmitError {
    Exceeded(Refusal),
    /// A money budget applies but no price matches the model: refusing is the only safe answer.
    Unpriced { counter: usize, model: Option<String> },
    /// The store could not be updated (contention beyond the retry bound, or unavailable).
    Store(String),
}

/// What a settled request was charged.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Settlement {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub micro_usd: u64,
    /// Counters after settlement (same order as the admission's leases); `None` where the store failed.
    pub after: Vec<Option<Counter>>,
    /// Reserved − charged, in the units of each counter (positive: over-estimate).
    pub over_estimates: Vec<i128>,
}

impl Demand {
    /// Output tokens the request can produce over all its generations.
    pub fn reserved_output_tokens(&self) -> u64 {
        self.output_tokens.saturating_mul(self.choices.max(1))
    }
}

impl Admission {
    /// Output tokens reserved over all generations.
    pub fn reserved_output_tokens(&self) -> u64 {
        self.output_tokens.saturating_mul(self.choices.max(1))
    }
}

fn minute_of(now_ns: u64) -> u32 {
    u32::try_from(now_ns / NS_PER_S / 60).unwrap_or(u32::MAX)
}

impl Policy {
    /// Creates every counter that does not exist yet; returns how many it created. Call once at
    /// configure time, before traffic: the store's CAS cannot make a *create* conditional (Envoy
    /// accepts any CAS token for a missing key), so two first reservations racing on a missing key
    /// could lose one. With every counter created up front, each later update is a real CAS.
    pub fn ensure_counters(&self, store: &mut dyn SharedStore) -> Result<usize, StoreError> {
        let mut created = 0;
        for spec in &self.counters {
            if let (None, _) = store.get(&spec.store_key)? {
                store.set(&spec.store_key, &Counter::default().encode(), 0)?;
                created += 1;
            }
        }
        Ok(created)
    }

    fn cost(&self, model: Option<&str>, input: u64, output: u64) -> Option<u64> {
        let usage = Usage { input_tokens: input, output_tokens: output, ..Usage::default() };
        self.prices.cost_micro_usd(model?, &usage)
    }

    fn cost_of_usage(&self, model: Option<&str>, usage: &Usage) -> Option<u64> {
        self.prices.cost_micro_usd(model?, usage)
    }

    /// Admits `demand` for `key` at `now_ns`, clamping its output when the policy allows.
    pub fn admit(&self, store: &mut dyn SharedStore, key: usize, demand: &Demand, now_ns: u64) -> Result<Admission, AdmitError> {
        match self.try_admit(store, key, demand, now_ns) {
            Err(AdmitError::Exceeded(refusal)) if self.clamp.enabled => {
                let Some(output) = self.max_output_that_fits(store, key, demand, now_ns) else {
                    return Err(AdmitError::Exceeded(refusal));
                };
                if output < self.clamp.min_output_tokens || output >= demand.output_tokens {
                    return Err(AdmitError::Exceeded(refusal));
                }
                let clamped = Demand { output_tokens: output, ..demand.clone() };
                let mut admission = self.try_admit(store, key, &clamped, now_ns)?;
                admission.clamped = true;
                Ok(admission)
            }
            other => other,
        }
    }

    fn try_admit(&self, store: &mut dyn SharedStore, key: usize, demand: &Demand, now_ns: u64) -> Result<Admission, AdmitError> {
        let node = self.keys.get(key).ok_or_else(|| AdmitError::Store(format!("no key #{key}")))?;
        let model = demand.model.as_deref();
        let output = demand.reserved_output_tokens();
        let cost = self.cost(model, demand.input_tokens, output);
        let minute = minute_of(now_ns);
        let ttl = self.reservation_ttl_minutes;
        let mut leases = Vec::with_capacity(node.counters.len());
        let mut after = Vec::with_capacity(node.counters.len());
        for &index in &node.counters {
            let Some(spec) = self.counters.get(index) else { continue };
            let cost = match (spec.limit, cost) {
                (Limit::MicroUsd(_), None) => {
                    rollback(store, &leases, now_ns, self);
                    return Err(AdmitError::Unpriced { counter: index, model: demand.model.clone() });
                }
                (_, cost) => cost.unwrap_or(0),
            };
            let amount = spec.limit.amount(demand.input_tokens, output, cost);
            let window_id = spec.window.id(now_ns);
            match ledger::reserve(store, &spec.store_key, window_id, minute, ttl, amount, spec.limit.value()) {
                Ok((lease, counter)) => {
                    leases.push((index, lease));
                    after.push(counter);
                }
                Err(e) => {
                    rollback(store, &leases, now_ns, self);
                    return Err(match e {
                        ReserveError::Exceeded { used, reserved, limit } => {
                            let reset = spec.window.end_ns(now_ns);
                            AdmitError::Exceeded(Refusal {
                                counter: index,
                                used,
                                reserved,
                                limit,
                                retry_after_s: reset.saturating_sub(now_ns).div_ceil(NS_PER_S).max(1),
                            })
                        }
                        ReserveError::Contended => AdmitError::Store(format!("{}: too much contention", spec.store_key)),
                        ReserveError::Store(StoreError::CasMismatch) => AdmitError::Store("CAS mismatch".into()),
                        ReserveError::Store(StoreError::Unavailable(m)) => AdmitError::Store(m),
                    });
                }
            }
        }
        Ok(Admission {
            key,
            model: demand.model.clone(),
            leases,
            input_tokens: demand.input_tokens,
            output_tokens: demand.output_tokens,
            choices: demand.choices.max(1),
            clamped: false,
            reserved_micro_usd: cost.unwrap_or(0),
            after,
        })
    }

    /// The largest per-generation output limit every counter of `key` could still pay for, from a
    /// snapshot.
    fn max_output_that_fits(&self, store: &mut dyn SharedStore, key: usize, demand: &Demand, now_ns: u64) -> Option<u64> {
        let node = self.keys.get(key)?;
        let minute = minute_of(now_ns);
        let mut best = demand.reserved_output_tokens();
        for &index in &node.counters {
            let spec = self.counters.get(index)?;
            let counter = ledger::read(store, &spec.store_key, spec.window.id(now_ns), minute, self.reservation_ttl_minutes).ok()?;
            let room = spec.limit.value().checked_sub(counter.committed())?;
            let fits = match spec.limit {
                Limit::Tokens { input_weight, output_weight, .. } => {
                    let after_input = room.checked_sub(demand.input_tokens.saturating_mul(input_weight))?;
                    // An input-only budget does not limit output.
                    after_input.checked_div(output_weight).unwrap_or(u64::MAX)
                }
                Limit::Requests(_) => {
                    if room >= 1 {
                        u64::MAX
                    } else {
                        return None;
                    }
                }
                Limit::MicroUsd(_) => {
                    let (_, price) = self.prices.lookup_entry(demand.model.as_deref()?)?;
                    let out_per_mtok = price.output;
                    let in_cost = self.cost(demand.model.as_deref(), demand.input_tokens, 0)?;
                    let room_after_input = room.checked_sub(in_cost)?;
                    if out_per_mtok == 0 {
                        u64::MAX
                    } else {
                        // cost = ⌈(in·p_in + out·p_out) / 10⁶⌉ ≤ room ⇔ out ≤ (room·10⁶ − in·p_in) / p_out;
                        // using the rounded input cost keeps this conservative.
                        u64::try_from(u128::from(room_after_input) * 1_000_000 / u128::from(out_per_mtok)).unwrap_or(u64::MAX)
                    }
                }
            };
            best = best.min(fits);
        }
        Some(best / demand.choices.max(1))
    }

    /// Replaces the admission's reservations by what the request actually used.
    pub fn settle(&self, store: &mut dyn SharedStore, admission: &Admission, actual: &Usage, now_ns: u64) -> Settlement {
        let model = admission.model.as_deref();
        let micro_usd = self.cost_of_usage(model, actual).unwrap_or(0);
        let minute = minute_of(now_ns);
        let mut settlement = Settlement {
            input_tokens: actual.input_tokens,
            output_tokens: actual.output_tokens,
            micro_usd,
            ..Settlement::default()
        };
        for (index, lease) in &admission.leases {
            let Some(spec) = self.counters.get(*index) else { continue };
            let amount = spec.limit.amount(actual.input_tokens, actual.output_tokens, micro_usd);
            let after = ledger::settle(store, lease, amount, spec.window.id(now_ns), minute, self.reservation_ttl_minutes).ok();
            settlement.after.push(after);
            settlement.over_estimates.push(i128::from(lease.amount) - i128::from(amount));
        }
        settlement
    }
}

/// Gives back leases already taken when a later counter refuses.
fn rollback(store: &mut dyn SharedStore, leases: &[(usize, Lease)], now_ns: u64, policy: &Policy) {
    let minute = minute_of(now_ns);
    for (index, lease) in leases {
        let Some(spec) = policy.counters.get(*index) else { continue };
        // A rollback is a settlement of nothing.
        let _ = ledger::settle(store, lease, 0, spec.window.id(now_ns), minute, policy.reservation_ttl_minutes);
    }
}
