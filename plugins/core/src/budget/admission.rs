//! Admission and settlement of one request against every budget of its key, team and org.
//!
//! Admission reserves the worst case on every counter (rolling back what it took if a later counter
//! refuses); settlement replaces each reservation by the actual charge. Both go through
//! [`super::ledger`], so the invariants documented there hold for the whole hierarchy.

use super::identities::{self, IdentityBuckets};
use super::ledger::{self, Counter, Lease, ReserveError};
use super::policy::{CounterSpec, Limit, Policy};
use crate::store::{SharedStore, StoreError};
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
    /// The request's identity for `identity_budgets` ([`super::identities::identity_hash`]);
    /// `None`: the shared identity `anonymous`.
    pub identity: Option<String>,
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
    /// Held in the Redis ledger (settled through `sluice-ledger`), not in local shared data.
    pub remote: Option<RemoteHold>,
}

/// A hold in the Redis ledger: its name there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteHold {
    /// The request id the hold is named by (settlement is idempotent per id).
    pub id: String,
    /// The org: the Redis Cluster hash tag of every key the request touches.
    pub tag: String,
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
    Unpriced {
        counter: usize,
        model: Option<String>,
    },
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

    /// The hold in the Redis ledger, settled through the ledger service. Never one in a build
    /// without feature `ledger-service` (no reservation went to the service), and that said at
    /// compile time lets the compiler leave the service's settlement code out.
    pub fn remote_hold(&self) -> Option<&RemoteHold> {
        self.remote.as_ref().filter(|_| cfg!(feature = "ledger-service"))
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
            let keys: Vec<(String, Vec<u8>)> = if spec.per_identity {
                (0..identities::BUCKETS).map(|n| (identities::bucket_key(&spec.store_key, n), identities::empty_bucket())).collect()
            } else {
                vec![(spec.store_key.clone(), Counter::default().encode())]
            };
            for (key, empty) in keys {
                if let (None, _) = store.get(&key)? {
                    store.set(&key, &empty, 0)?;
                    created += 1;
                }
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

    /// Admits `demand` for `key` at `now_ns` in the local ledger, clamping its output when the
    /// policy allows.
    pub fn admit(&self, store: &mut dyn SharedStore, key: usize, demand: &Demand, now_ns: u64) -> Result<Admission, AdmitError> {
        self.admit_divided(store, key, demand, now_ns, 1)
    }

    /// The local ledger standing in for an unavailable Redis ledger (`on_failure: local`): every
    /// limit divided by `ledger.replicas`, so the fleet together stays within the limit.
    pub fn admit_fallback(&self, store: &mut dyn SharedStore, key: usize, demand: &Demand, now_ns: u64) -> Result<Admission, AdmitError> {
        self.admit_divided(store, key, demand, now_ns, u64::from(self.ledger.replicas.max(1)))
    }

    fn admit_divided(&self, store: &mut dyn SharedStore, key: usize, demand: &Demand, now_ns: u64, divisor: u64) -> Result<Admission, AdmitError> {
        let mut store = IdentityBuckets::new(store, self.max_local_identities);
        match self.try_admit(&mut store, key, demand, now_ns, divisor) {
            Err(AdmitError::Exceeded(refusal)) if self.clamp.enabled => {
                let Some(output) = self.max_output_that_fits(&mut store, key, demand, now_ns, divisor) else {
                    return Err(AdmitError::Exceeded(refusal));
                };
                if output < self.clamp.min_output_tokens || output >= demand.output_tokens {
                    return Err(AdmitError::Exceeded(refusal));
                }
                let clamped = Demand { output_tokens: output, ..demand.clone() };
                let mut admission = self.try_admit(&mut store, key, &clamped, now_ns, divisor)?;
                admission.clamped = true;
                Ok(admission)
            }
            other => other,
        }
    }

    /// What `demand` takes from each counter of `key` at `now_ns`, in the key's counter order.
    pub(super) fn plan(&self, key: usize, demand: &Demand, now_ns: u64) -> Result<Plan, AdmitError> {
        let node = self.keys.get(key).ok_or_else(|| AdmitError::Store(format!("no key #{key}")))?;
        let output = demand.reserved_output_tokens();
        let cost = self.cost(demand.model.as_deref(), demand.input_tokens, output);
        let identity = demand.identity.clone().unwrap_or_else(anonymous_hash);
        let mut holds = Vec::with_capacity(node.counters.len());
        for &index in &node.counters {
            let Some(spec) = self.counters.get(index) else { continue };
            let cost = match (spec.limit, cost) {
                (Limit::MicroUsd(_), None) => return Err(AdmitError::Unpriced { counter: index, model: demand.model.clone() }),
                (_, cost) => cost.unwrap_or(0),
            };
            let window_id = spec.window.id(now_ns);
            holds.push(PlannedHold {
                index,
                local_key: local_key(spec, &identity),
                remote_key: remote_key(spec, &identity, window_id),
                window_id,
                amount: spec.limit.amount(demand.input_tokens, output, cost),
                limit: spec.limit.value(),
                expire_at_s: (spec.window.end_ns(now_ns) / NS_PER_S).saturating_add(u64::from(self.reservation_ttl_minutes) * 60),
            });
        }
        Ok(Plan { holds, cost, org: node.org.clone() })
    }

    fn try_admit(&self, store: &mut dyn SharedStore, key: usize, demand: &Demand, now_ns: u64, divisor: u64) -> Result<Admission, AdmitError> {
        let plan = self.plan(key, demand, now_ns)?;
        let minute = minute_of(now_ns);
        let ttl = self.reservation_ttl_minutes;
        let mut leases = Vec::with_capacity(plan.holds.len());
        let mut after = Vec::with_capacity(plan.holds.len());
        for hold in &plan.holds {
            let (index, amount, window_id) = (hold.index, hold.amount, hold.window_id);
            let Some(spec) = self.counters.get(index) else { continue };
            match ledger::reserve(store, &hold.local_key, window_id, minute, ttl, amount, hold.limit / divisor.max(1)) {
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
                        ReserveError::Contended => AdmitError::Store(format!("{}: too much contention", hold.local_key)),
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
            reserved_micro_usd: plan.cost.unwrap_or(0),
            after,
            remote: None,
        })
    }

    /// The largest per-generation output limit every counter of `key` could still pay for, from a
    /// snapshot.
    fn max_output_that_fits(&self, store: &mut dyn SharedStore, key: usize, demand: &Demand, now_ns: u64, divisor: u64) -> Option<u64> {
        let plan = self.plan(key, demand, now_ns).ok()?;
        let minute = minute_of(now_ns);
        let mut best = demand.reserved_output_tokens();
        for hold in &plan.holds {
            let spec = self.counters.get(hold.index)?;
            let counter = ledger::read(store, &hold.local_key, hold.window_id, minute, self.reservation_ttl_minutes).ok()?;
            let room = (spec.limit.value() / divisor.max(1)).checked_sub(counter.committed())?;
            best = best.min(self.output_that_fits(spec, room, demand)?);
        }
        Some(best / demand.choices.max(1))
    }

    /// The most output tokens (all generations together) `room` left on `spec` can pay for after the
    /// request's input; `None` when not even the input fits.
    pub(super) fn output_that_fits(&self, spec: &CounterSpec, room: u64, demand: &Demand) -> Option<u64> {
        {
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
            Some(fits)
        }
    }

    /// Replaces the admission's reservations by what the request actually used.
    pub fn settle(&self, store: &mut dyn SharedStore, admission: &Admission, actual: &Usage, now_ns: u64) -> Settlement {
        let mut store = IdentityBuckets::new(store, self.max_local_identities);
        let store: &mut dyn SharedStore = &mut store;
        let model = admission.model.as_deref();
        let micro_usd = self.cost_of_usage(model, actual).unwrap_or(0);
        let minute = minute_of(now_ns);
        let mut settlement = Settlement { input_tokens: actual.input_tokens, output_tokens: actual.output_tokens, micro_usd, ..Settlement::default() };
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

/// The identity of requests that carry none, for `identity_budgets`: they share one counter.
pub const ANONYMOUS: &str = "anonymous";

/// One counter's part of a request's reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PlannedHold {
    pub(super) index: usize,
    /// The counter in local shared data (per-identity: `template#hash`).
    pub(super) local_key: String,
    /// The counter in the Redis ledger: the [`super::policy::counter_name`] joined by `:`, then
    /// `:<identity hash>` for a per-identity budget, then `:w<window id>`.
    pub(super) remote_key: String,
    pub(super) window_id: u64,
    pub(super) amount: u64,
    pub(super) limit: u64,
    /// When the Redis key may go: the window's end plus the reservation TTL (a late settlement
    /// still finds it).
    pub(super) expire_at_s: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Plan {
    pub(super) holds: Vec<PlannedHold>,
    pub(super) cost: Option<u64>,
    pub(super) org: String,
}

/// The identity hash of requests that carry none, computed once.
fn anonymous_hash() -> String {
    static HASH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    HASH.get_or_init(|| identities::identity_hash(ANONYMOUS)).clone()
}

fn local_key(spec: &CounterSpec, identity: &str) -> String {
    if spec.per_identity {
        let mut sep = [0u8; 4];
        crate::text::join(&[&spec.store_key, identities::IDENTITY_SEPARATOR.encode_utf8(&mut sep), identity])
    } else {
        spec.store_key.clone()
    }
}

fn remote_key(spec: &CounterSpec, identity: &str, window_id: u64) -> String {
    let mut key = if spec.per_identity { crate::text::join(&[&spec.remote_name, ":", identity, ":w"]) } else { crate::text::join(&[&spec.remote_name, ":w"]) };
    crate::text::push_u64(&mut key, window_id);
    key
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
