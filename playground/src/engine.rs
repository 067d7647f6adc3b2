//! The engine: a workload's requests through sluice-core's decision functions in the gateway's
//! filter order (latency-guard → model-router → tenant-budget), on one virtual clock, against the
//! simulator's service model of the upstream.
//!
//! Each step calls what the plugin calls, in the plugin's order, with the inputs the plugin would
//! read from the host (headers and metadata of the request the simulator builds, the request body
//! as the filters in front left it, the time): latency-guard's classification, avoid list, breaker
//! admission, in-flight shedding, deadlines and window samples; model-router's sticky decision with
//! the guard's avoid list, its preferred fallback and shadow sampling with the concurrency cap;
//! tenant-budget's identification, request sizing, admission (with clamping), body rewrite and
//! settlement on the usage the modelled upstream reports. Shared state lives in core's
//! [`MemoryStore`], as in the plugins' tests. What no host means for fidelity is in docs/playground.md.

use serde::Serialize;
use serde_json::Value;
use sluice_core::api::ApiKind;
use sluice_core::budget::identities::identity_hash;
use sluice_core::budget::policy::Mode;
use sluice_core::budget::{ledger, Admission, AdmitError, Demand, Policy};
use sluice_core::identity::{api_key_from_headers, jwt_payload_claim, sha256_hex};
use sluice_core::latency::{self, breaker, window, Admission as BreakerAdmission, Breaker, LatencyPolicy, OpenAction, Priority, State, TenantSource};
use sluice_core::request::{inspect_request_with_kind, RequestInfo};
use sluice_core::rewrite::{rewrite_request, set_top_level_string};
use sluice_core::routing::{Decision, Reason, RoutingPolicy, ShadowVerdict};
use sluice_core::store::MemoryStore;
use sluice_core::timing::StreamTiming;
use sluice_core::usage::Usage;
use sluice_workload::draw::mix;
use sluice_workload::request::{prompt_chars, prompt_text, request_body};
use sluice_workload::upstream::{active_incidents, failure, ms_to_ns, service_times};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};

use crate::workload::{api_str, Request, Workload};

/// Where json_to_metadata puts the body's model and user (the shipped gateways' configuration).
const MODEL_METADATA: [&str; 4] = ["metadata", "filter_metadata", "sluice", "model"];
const USER_METADATA: [&str; 4] = ["metadata", "filter_metadata", "sluice", "user"];
/// tenant-budget, strict mode: the allowance for a request that defines tools (its plugin's constant).
const TOOL_PROMPT_ALLOWANCE: u64 = 1024;
/// model-router's root tick, which sends queued shadow requests.
const ROUTER_TICK_NS: u64 = 20_000_000;
const MS: u64 = 1_000_000;

/// The compiled policies of one run; a plugin without a policy is not in the chain.
#[derive(Debug, Default)]
pub struct Policies {
    pub latency_guard: Option<LatencyPolicy>,
    pub model_router: Option<RoutingPolicy>,
    pub tenant_budget: Option<Policy>,
}

/// What the gateway did with a request (the simulator's `decision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Admitted,
    Clamped,
    Refused,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Admitted => "admitted",
            Verdict::Clamped => "clamped",
            Verdict::Refused => "refused",
        }
    }
}

/// One request's outcome, with the simulator's field names where it has them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestVerdict {
    pub line: u64,
    pub arrival_ms: f64,
    pub tenant: Option<String>,
    /// tenant-budget's key.
    pub key: Option<String>,
    pub user: Option<String>,
    pub api: &'static str,
    pub stream: bool,
    pub prompt_tokens: u64,
    pub decision: Verdict,
    pub status: u16,
    pub code: Option<String>,
    pub refused_by: Option<&'static str>,
    pub outcome: &'static str,
    pub version: Option<String>,
    pub route_reason: Option<&'static str>,
    pub shadow_version: Option<String>,
    /// latency-guard's class and whether the request was a half-open probe.
    pub class: Option<String>,
    pub probe: bool,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub duration_ms: f64,
    /// What tenant-budget charged.
    pub charged_input_tokens: u64,
    pub charged_output_tokens: u64,
    pub charged_micro_usd: u64,
    /// The upstream it reached, and the output limit it carried there.
    pub upstream: Option<String>,
    pub max_tokens_upstream: Option<u64>,
}

/// A breaker transition, with the numbers that caused it (core's reason).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BreakerTransition {
    pub t_ms: f64,
    pub version: String,
    pub from: &'static str,
    pub to: &'static str,
    pub reason: String,
}

/// One budget's remaining amount over time.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BudgetSeries {
    pub code: String,
    pub unit: &'static str,
    pub limit: u64,
    pub remaining: Vec<u64>,
}

/// State sampled every `sample_every_ms`; counts are of requests arriving since the previous sample.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Series {
    pub t_ms: Vec<f64>,
    /// Breaker state per version: 0 closed, 1 open, 2 half-open.
    pub breakers: BTreeMap<String, Vec<u8>>,
    /// The budgets of the keys the workload used (per-identity budgets are one counter per identity: left out).
    pub budgets: Vec<BudgetSeries>,
    /// Cumulative spend per tenant, micro-USD, and charged tokens.
    pub spend_micro_usd: BTreeMap<String, Vec<u64>>,
    pub charged_tokens: BTreeMap<String, Vec<u64>>,
    /// Requests admitted per version, and refused per code, in each interval.
    pub admitted_by_version: BTreeMap<String, Vec<u64>>,
    pub refused_by_code: BTreeMap<String, Vec<u64>>,
    /// Requests running or queued at each upstream.
    pub in_flight: BTreeMap<String, Vec<u32>>,
}

/// Per-tenant counts of the verdict table.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TenantRow {
    pub tenant: String,
    pub requests: u64,
    pub admitted: u64,
    pub clamped: u64,
    pub refused: u64,
    pub refusals: BTreeMap<String, u64>,
    pub charged_tokens: u64,
    pub charged_micro_usd: u64,
}

/// Everything one run returns to the page.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RunOutput {
    pub verdicts: Vec<RequestVerdict>,
    pub tenants: Vec<TenantRow>,
    pub transitions: Vec<BreakerTransition>,
    pub series: Series,
    /// Virtual time from the first arrival to the last answer, ms.
    pub span_ms: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// The first content token reaches the gateway.
    FirstToken(usize),
    /// The last piece of the answer (or the error answer) reaches the gateway.
    End(usize),
    /// A latency-guard deadline is due.
    TtftDeadline(usize),
    TotalDeadline(usize),
    /// model-router's tick sends the queued shadow of this request; its answer comes back.
    ShadowSent(usize),
    ShadowDone(usize),
}

/// How an admitted request's upstream serves it (fixed when service starts).
#[derive(Debug, Clone, Copy)]
struct Service {
    itl_ns: u64,
    tokens: u64,
    fail: Option<u16>,
}

#[derive(Debug)]
struct GuardState {
    class: String,
    priority: Priority,
    draw: u64,
    admitted: Option<GuardAdmitted>,
}

#[derive(Debug)]
struct GuardAdmitted {
    version: String,
    probe: bool,
    counted_in_flight: bool,
    ttft_deadline_ns: Option<u64>,
    ttft_recorded: bool,
    fired: Option<Fired>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fired {
    TtftReply,
    TotalReply,
    TotalEnd,
}

#[derive(Debug)]
struct Flight {
    request: Request,
    arrival_ns: u64,
    tenant: Option<String>,
    user: Option<String>,
    stream: bool,
    kind: ApiKind,
    headers: Vec<(String, String)>,
    model: String,
    guard: Option<GuardState>,
    route: Option<Decision>,
    shadow: Option<String>,
    shadow_queued: bool,
    budget_key: Option<usize>,
    budget_info: Option<RequestInfo>,
    admission: Option<Admission>,
    clamped: bool,
    refused: Option<(u16, &'static str, String)>,
    upstream: Option<String>,
    upstream_body: Option<Value>,
    reached_ns: u64,
    service: Option<Service>,
    slot_taken: bool,
    first_token_ns: Option<u64>,
    ended: bool,
}

/// One run's state.
pub struct Engine<'a> {
    policies: &'a Policies,
    workload: &'a Workload,
    start_ns: u64,
    store: MemoryStore,
    in_flight: BTreeMap<String, u64>,
    events: BinaryHeap<Reverse<(u64, u64, Event)>>,
    seq: u64,
    flights: Vec<Flight>,
    /// Running requests and FIFO queue per upstream.
    running: BTreeMap<String, u32>,
    queues: BTreeMap<String, VecDeque<usize>>,
    /// model-router's shadows: queued for its next tick, and sent and not yet answered.
    shadow_jobs: u32,
    shadow_calls: u32,
    filler: String,
    out: RunOutput,
    next_sample_ns: u64,
    samples_done: usize,
    keys_seen: Vec<usize>,
    last_ns: u64,
}

impl<'a> Engine<'a> {
    pub fn new(policies: &'a Policies, workload: &'a Workload) -> Engine<'a> {
        let start_ns = workload.start_unix_ms.saturating_mul(MS);
        let mut store = MemoryStore::default();
        // What each plugin creates at configure time, before traffic.
        if let Some(p) = &policies.tenant_budget {
            let _ = p.ensure_counters(&mut store);
        }
        if let Some(p) = &policies.latency_guard {
            for v in &p.versions {
                if let Some(b) = &v.breaker {
                    let _ = window::ensure(&mut store, &v.window_key(), &b.window);
                    let _ = breaker::ensure(&mut store, &v.breaker_key());
                }
            }
        }
        Engine {
            policies,
            workload,
            start_ns,
            store,
            in_flight: BTreeMap::new(),
            events: BinaryHeap::new(),
            seq: 0,
            flights: Vec::new(),
            running: BTreeMap::new(),
            queues: BTreeMap::new(),
            shadow_jobs: 0,
            shadow_calls: 0,
            filler: String::new(),
            out: RunOutput::default(),
            next_sample_ns: start_ns,
            samples_done: 0,
            keys_seen: Vec::new(),
            last_ns: start_ns,
        }
    }

    /// Runs `requests` (in arrival order) to the end of the last answer.
    pub fn run(mut self, requests: Vec<Request>) -> RunOutput {
        let mut arrivals = requests.into_iter().peekable();
        loop {
            let next_arrival = arrivals.peek().map(|r| self.start_ns.saturating_add(r.arrival_ns));
            let next_event = self.events.peek().map(|Reverse((t, _, _))| *t);
            // Events at the arrival's instant come first (the simulator's order).
            let t = match (next_arrival, next_event) {
                (Some(a), Some(e)) => a.min(e),
                (Some(a), None) => a,
                (None, Some(e)) => e,
                (None, None) => break,
            };
            self.sample_until(t);
            self.last_ns = self.last_ns.max(t);
            if next_event == Some(t) {
                if let Some(Reverse((at, _, event))) = self.events.pop() {
                    self.handle(at, event);
                }
            } else if let Some(r) = arrivals.next() {
                self.arrive(r, t);
            }
        }
        self.sample_until(self.last_ns.saturating_add(1));
        self.out.span_ms = self.last_ns.saturating_sub(self.start_ns) as f64 / 1e6;
        self.finish_tables();
        self.out
    }

    fn schedule(&mut self, at: u64, event: Event) {
        self.seq += 1;
        self.events.push(Reverse((at, self.seq, event)));
    }

    // -----------------------------------------------------------------------------------------
    // The request side, in filter order
    // -----------------------------------------------------------------------------------------

    fn arrive(&mut self, request: Request, now: u64) {
        let id = self.flights.len();
        let traffic = &self.workload.traffic;
        // The client request the simulator builds for this record (sluice_sim::engine::client_request).
        let tenant = request.tenant.clone().or_else(|| request.key.clone());
        let user = request
            .user
            .clone()
            .or_else(|| tenant.as_ref().map(|t| format!("{t}-u{}", (mix(self.workload.seed, request.line) >> 20) % traffic.users_per_tenant)));
        let stream = request.stream.unwrap_or(traffic.stream);
        let max_tokens = request.max_tokens.or(match &traffic.max_tokens {
            Value::Number(n) => n.as_u64(),
            Value::String(s) if s == "output" => Some(request.output_tokens.unwrap_or(traffic.output_tokens)),
            _ => None,
        });
        let model = request.model.clone().unwrap_or_else(|| traffic.model.clone());
        let text = prompt_text(&mut self.filler, request.prompt_tokens).to_string();
        let (path, body) = request_body(request.api, &model, &text, stream, max_tokens, user.as_deref());
        let body = body.to_string().into_bytes();
        let mut headers = vec![
            (":method".to_string(), "POST".to_string()),
            (":path".to_string(), path.to_string()),
            (":authority".to_string(), "gateway".to_string()),
            ("content-type".to_string(), "application/json".to_string()),
            ("x-request-id".to_string(), format!("sim-{}", request.line)),
        ];
        if let Some(t) = &tenant {
            headers.push((traffic.tenant_header.to_ascii_lowercase(), t.clone()));
        }
        self.flights.push(Flight {
            arrival_ns: now,
            tenant,
            user,
            stream,
            kind: request.api,
            headers,
            model,
            guard: None,
            route: None,
            shadow: None,
            shadow_queued: false,
            budget_key: None,
            budget_info: None,
            admission: None,
            clamped: false,
            refused: None,
            upstream: None,
            upstream_body: None,
            reached_ns: 0,
            service: None,
            slot_taken: false,
            first_token_ns: None,
            ended: false,
            request,
        });
        // Request headers: guard, router, budget.
        self.guard_headers(id);
        self.router_headers(id, now);
        if !self.budget_headers(id) {
            self.end_refused(id, now);
            return;
        }
        // Request body: each filter sees the body as the one in front left it.
        let mut body = body;
        if !self.guard_body(id, now, &mut body) {
            self.end_refused(id, now);
            return;
        }
        self.router_body(id, &mut body);
        if !self.budget_body(id, now, &mut body) {
            // model-router drops a shadow still queued for its tick when a filter behind refuses.
            if let Some(f) = self.flights.get_mut(id) {
                if f.shadow_queued {
                    f.shadow_queued = false;
                    f.shadow = None;
                    self.shadow_jobs = self.shadow_jobs.saturating_sub(1);
                }
            }
            self.end_refused(id, now);
            return;
        }
        self.reach_upstream(id, now, &body);
    }

    fn header<'f>(f: &'f Flight, name: &str) -> Option<&'f str> {
        f.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    fn property(f: &Flight, path: &[String]) -> Option<String> {
        if path.iter().map(String::as_str).eq(MODEL_METADATA) {
            Some(f.model.clone())
        } else if path.iter().map(String::as_str).eq(USER_METADATA) {
            f.user.clone()
        } else {
            None
        }
    }

    /// latency-guard, request headers: the class, the probe draw, the versions to avoid.
    fn guard_headers(&mut self, id: usize) {
        let Some(policy) = self.policies.latency_guard.as_ref() else { return };
        let Some(f) = self.flights.get(id) else { return };
        let tenant = match &policy.tenant {
            None => None,
            Some(TenantSource::Header(name)) => Self::header(f, name).map(str::to_string),
            Some(TenantSource::Property(p)) => Self::property(f, p),
        };
        let (class, priority) = policy.classify(tenant.as_deref().map(str::trim).filter(|t| !t.is_empty()));
        let class = class.to_string();
        let draw = breaker::probe_draw(Self::header(f, "x-request-id").unwrap_or_default(), 0);
        if let Some(f) = self.flights.get_mut(id) {
            f.guard = Some(GuardState { class, priority, draw, admitted: None });
        }
    }

    /// The versions whose breaker blocks this request and whose class fails over, with the
    /// fallback the guard prefers (its `sluice_latency_avoid` filter state).
    fn avoid_list(&mut self, id: usize, now: u64) -> Vec<(String, String)> {
        let Some(policy) = self.policies.latency_guard.as_ref() else { return Vec::new() };
        let Some((priority, draw)) = self.flights.get(id).and_then(|f| f.guard.as_ref()).map(|g| (g.priority, g.draw)) else { return Vec::new() };
        let mut avoid = Vec::new();
        for v in &policy.versions {
            let Some(b) = v.breaker.as_ref().filter(|b| b.action(priority) == OpenAction::Fallback) else { continue };
            let Some(current) = self.current_breaker(&v.name, now) else { continue };
            if current.admit(draw) == BreakerAdmission::Blocked {
                avoid.push((v.name.clone(), b.fallback.clone().unwrap_or_default()));
            }
        }
        avoid
    }

    /// model-router, request headers: the decision (with the guard's avoid list) and the shadow draw.
    fn router_headers(&mut self, id: usize, now: u64) {
        let avoid = self.avoid_list(id, now);
        let Some(policy) = self.policies.model_router.as_ref() else { return };
        let Some(f) = self.flights.get(id) else { return };
        let Some(index) = policy.model_for(&f.model) else { return };
        let request_id = Self::header(f, "x-request-id").unwrap_or_default().to_string();
        let mut header = |name: &str| Self::header(f, name).map(|v| v.as_bytes().to_vec());
        let mut property = |path: &[String]| Self::property(f, path).map(String::into_bytes);
        let key = policy.sticky_key(&mut header, &mut property).map(|k| k.bytes);
        let forced = policy.override_property().and_then(|p| Self::property(f, p));
        // No passive health marks here: the modelled upstreams always have a healthy host.
        let only_unhealthy: Vec<&str> = Vec::new();
        let mut unhealthy = only_unhealthy.clone();
        unhealthy.extend(avoid.iter().map(|(v, _)| v.as_str()));
        let decided = policy
            .decide(index, key.as_deref(), request_id.as_bytes(), forced.as_deref(), now, &unhealthy)
            .or_else(|| policy.decide(index, key.as_deref(), request_id.as_bytes(), forced.as_deref(), now, &only_unhealthy));
        let Some(mut decision) = decided else { return };
        let preferred = avoid
            .iter()
            .find(|(v, _)| decision.fallback_from.as_deref() == Some(v.as_str()))
            .map(|(_, p)| p.as_str())
            .filter(|p| !p.is_empty() && !unhealthy.contains(p));
        if let (Reason::Fallback, Some(preferred)) = (decision.reason, preferred) {
            if let Some(d) = policy.decide(index, key.as_deref(), request_id.as_bytes(), Some(preferred), now, &unhealthy) {
                if d.version == preferred {
                    decision = Decision { reason: Reason::Fallback, fallback_from: decision.fallback_from.take(), ..d };
                }
            }
        }
        let tenant =
            policy.model(index).and_then(|m| m.shadow.as_ref()).and_then(|s| s.tenant_header.as_deref()).and_then(|h| Self::header(f, h)).map(str::to_string);
        let shadow = match policy.shadow_sampled(index, request_id.as_bytes(), tenant.as_deref()) {
            ShadowVerdict::Sampled => policy.model(index).and_then(|m| m.shadow.as_ref()).map(|s| s.version.name.clone()),
            _ => None,
        };
        if let Some(f) = self.flights.get_mut(id) {
            f.headers.retain(|(k, _)| !k.eq_ignore_ascii_case(policy.route_header()) && !k.eq_ignore_ascii_case(policy.version_header()));
            f.headers.push((policy.route_header().to_string(), decision.route.clone()));
            f.headers.push((policy.version_header().to_string(), decision.version.clone()));
            f.route = Some(decision);
            f.shadow = shadow;
        }
    }

    /// tenant-budget, request headers: the key (false: refused as unknown).
    fn budget_headers(&mut self, id: usize) -> bool {
        let Some(policy) = self.policies.tenant_budget.as_ref() else { return true };
        let Some(f) = self.flights.get(id) else { return true };
        let key = identify(policy, f);
        match key {
            Some(k) => {
                if !self.keys_seen.contains(&k) {
                    self.keys_seen.push(k);
                }
                if let Some(f) = self.flights.get_mut(id) {
                    f.budget_key = Some(k);
                }
                true
            }
            None => {
                if let Some(f) = self.flights.get_mut(id) {
                    f.refused = Some((401, "tenant-budget", "unknown_key".into()));
                }
                false
            }
        }
    }

    /// latency-guard, first body chunk: breaker admission, in-flight shedding, deadlines, the
    /// version's output ceiling. False: refused.
    fn guard_body(&mut self, id: usize, now: u64, body: &mut Vec<u8>) -> bool {
        let Some(policy) = self.policies.latency_guard.as_ref() else { return true };
        let Some(f) = self.flights.get(id) else { return true };
        let Some((priority, draw)) = f.guard.as_ref().map(|g| (g.priority, g.draw)) else { return true };
        let version = f.route.as_ref().map(|d| d.version.clone()).unwrap_or_else(|| f.model.clone());
        let stream = f.stream;
        let kind = f.kind;
        let Some(vp) = policy.version(&version) else { return true };
        let mut probe = false;
        if let Some(b) = &vp.breaker {
            let current = self.current_breaker(&vp.name, now).unwrap_or_else(|| Breaker::new(b.config.clone()));
            match current.admit(draw) {
                BreakerAdmission::Pass => {}
                BreakerAdmission::Probe => probe = true,
                BreakerAdmission::Blocked => {
                    if b.action(priority) == OpenAction::Reject {
                        if let Some(f) = self.flights.get_mut(id) {
                            f.refused = Some((503, "latency-guard", "shed_breaker_open".into()));
                        }
                        return false;
                    }
                }
            }
        }
        let mut counted_in_flight = false;
        if let Some(limit) = vp.in_flight {
            let n = self.in_flight.entry(vp.name.clone()).or_insert(0);
            if latency::should_shed(priority, *n, &limit) {
                if let Some(f) = self.flights.get_mut(id) {
                    f.refused = Some((503, "latency-guard", "shed_in_flight".into()));
                }
                return false;
            }
            *n += 1;
            counted_in_flight = true;
        }
        if let Some(ceiling) = vp.max_output_tokens {
            if let Ok((kind, info)) = inspect_request_with_kind(kind, body) {
                let target = info.max_output_tokens.map_or(ceiling, |asked| asked.min(ceiling));
                if info.max_output_tokens != Some(target) {
                    if let Ok(rewrite) = rewrite_request(kind, body, false, Some(target)) {
                        *body = rewrite.body;
                    }
                }
            }
        }
        let deadline = |d: Option<u64>| d.map(|d| now.saturating_add(d));
        // A whole answer has no first token before its end: only the total deadline applies.
        let ttft_deadline_ns = if stream { deadline(vp.ttft_deadline_ns) } else { None };
        let total_deadline_ns = deadline(vp.total_deadline_ns);
        if let Some(g) = self.flights.get_mut(id).and_then(|f| f.guard.as_mut()) {
            g.admitted = Some(GuardAdmitted { version: vp.name.clone(), probe, counted_in_flight, ttft_deadline_ns, ttft_recorded: false, fired: None });
        }
        if let Some(d) = ttft_deadline_ns {
            self.schedule(d, Event::TtftDeadline(id));
        }
        if let Some(d) = total_deadline_ns {
            self.schedule(d, Event::TotalDeadline(id));
        }
        true
    }

    /// model-router, request body: the model rewritten to the version's upstream model; the shadow
    /// queued for the router's tick unless the cap is reached.
    fn router_body(&mut self, id: usize, body: &mut Vec<u8>) {
        let Some(policy) = self.policies.model_router.as_ref() else { return };
        let Some(f) = self.flights.get(id) else { return };
        let Some(d) = f.route.as_ref() else { return };
        if d.upstream_model != f.model {
            if let Ok(new_body) = set_top_level_string(body, "model", &d.upstream_model) {
                *body = new_body;
            }
        }
        if f.shadow.is_none() {
            return;
        }
        let cap = policy.model_for(&f.model).and_then(|i| policy.model(i)).and_then(|m| m.shadow.as_ref()).map_or(0, |s| s.max_concurrent);
        let busy = self.shadow_jobs + self.shadow_calls;
        let arrival = f.arrival_ns;
        if busy >= cap {
            if let Some(f) = self.flights.get_mut(id) {
                f.shadow = None;
            }
            return;
        }
        self.shadow_jobs += 1;
        if let Some(f) = self.flights.get_mut(id) {
            f.shadow_queued = true;
        }
        // The router's root tick fires every 20 ms from its start; one due at this very instant
        // fired before the request arrived.
        let since = arrival.saturating_sub(self.start_ns);
        let tick = self.start_ns + (since / ROUTER_TICK_NS + 1) * ROUTER_TICK_NS;
        self.schedule(tick, Event::ShadowSent(id));
    }

    /// tenant-budget, request body: sizing, admission, rewrite. False: refused.
    fn budget_body(&mut self, id: usize, now: u64, body: &mut Vec<u8>) -> bool {
        let Some(policy) = self.policies.tenant_budget.as_ref() else { return true };
        let Some(f) = self.flights.get(id) else { return true };
        let Some(key) = f.budget_key else { return true };
        let refuse = |s: &mut Self, status: u16, code: String| {
            if let Some(f) = s.flights.get_mut(id) {
                f.refused = Some((status, "tenant-budget", code));
            }
            false
        };
        let (kind, info) = match inspect_request_with_kind(f.kind, body) {
            Ok(x) => x,
            Err(_) => return refuse(self, 400, "malformed_body".into()),
        };
        let identity = per_identity(policy, f);
        let ceiling = policy.keys.get(key).and_then(|k| k.max_output_tokens).unwrap_or(policy.default_max_output_tokens);
        let output = info.max_output_tokens.map_or(ceiling, |requested| requested.min(ceiling));
        let input = match policy.mode {
            Mode::Strict => (body.len() as u64).saturating_add(if info.has_tools { TOOL_PROMPT_ALLOWANCE } else { 0 }),
            Mode::Estimate => info.prompt_tokens_estimate.saturating_mul(100 + u64::from(policy.estimate_margin_percent)).div_ceil(100),
        };
        let demand = Demand { input_tokens: input, output_tokens: output, choices: info.output_choices, model: info.model.clone(), identity };
        let inject_usage = policy.include_usage && info.stream && !info.include_usage;
        match policy.admit(&mut self.store, key, &demand, now) {
            Ok(admission) => {
                let asked = info.max_output_tokens;
                let set_limit = (asked != Some(admission.output_tokens)).then_some(admission.output_tokens);
                if inject_usage || set_limit.is_some() {
                    match rewrite_request(kind, body, inject_usage, set_limit) {
                        Ok(rewrite) => *body = rewrite.body,
                        Err(_) => {
                            policy.settle(&mut self.store, &admission, &Usage::default(), now);
                            return refuse(self, 400, "unrewritable_body".into());
                        }
                    }
                }
                if let Some(f) = self.flights.get_mut(id) {
                    f.kind = kind;
                    f.clamped = admission.clamped;
                    f.admission = Some(admission);
                    f.budget_info = Some(info);
                }
                true
            }
            Err(AdmitError::Exceeded(refusal)) => {
                let code = policy.counters.get(refusal.counter).map(|c| c.code.clone()).unwrap_or_default();
                refuse(self, 429, code)
            }
            Err(AdmitError::Unpriced { .. }) => refuse(self, 400, "unpriced_model".into()),
            Err(AdmitError::Store(_)) => refuse(self, 503, "budget_store_unavailable".into()),
        }
    }

    // -----------------------------------------------------------------------------------------
    // The upstream (the simulator's service model)
    // -----------------------------------------------------------------------------------------

    fn reach_upstream(&mut self, id: usize, now: u64, body: &[u8]) {
        let Some(f) = self.flights.get_mut(id) else { return };
        let body: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let route = f.route.as_ref().map(|d| d.route.clone());
        let name = route.or_else(|| body.get("model").and_then(Value::as_str).map(str::to_string)).unwrap_or_else(|| "default".into());
        f.upstream = Some(name.clone());
        f.upstream_body = Some(body);
        f.reached_ns = now;
        let running = *self.running.get(&name).unwrap_or(&0);
        if running < self.workload.upstream(&name).max_batch {
            self.start_service(id, now);
        } else {
            self.queues.entry(name).or_default().push_back(id);
        }
    }

    fn start_service(&mut self, id: usize, now: u64) {
        let offset_s = now.saturating_sub(self.start_ns) as f64 / 1e9;
        let Some(f) = self.flights.get(id) else { return };
        let Some(name) = f.upstream.clone() else { return };
        let model = self.workload.upstream(&name);
        let incidents = active_incidents(&self.workload.incidents, &name, offset_s);
        let running = *self.running.get(&name).unwrap_or(&0);
        let fail = failure(model, &incidents, self.workload.seed, f.request.line);
        let (mut ttft_ms, mut tpot_ms) = service_times(model, f.request.prompt_tokens, running, &incidents);
        if self.workload.whole_milliseconds {
            (ttft_ms, tpot_ms) = (ttft_ms.round(), tpot_ms.round());
        }
        let body = f.upstream_body.as_ref().unwrap_or(&Value::Null);
        let planned = f.request.output_tokens.unwrap_or(self.workload.traffic.output_tokens);
        let tokens = body_limit(f.kind, body).map_or(planned, |m| m.min(planned));
        // A failure answers after the fixed part alone, without a batch slot.
        let ttft_ns = if fail.is_some() { ms_to_ns(model.ttft_base_ms) } else { ms_to_ns(ttft_ms) };
        let service = Service { itl_ns: ms_to_ns(tpot_ms), tokens, fail };
        let stream = f.stream;
        if fail.is_none() {
            *self.running.entry(name).or_insert(0) += 1;
        }
        if let Some(f) = self.flights.get_mut(id) {
            f.service = Some(service);
            f.slot_taken = fail.is_none();
        }
        let first = now + ttft_ns;
        if fail.is_some() {
            self.schedule(first, Event::End(id));
            return;
        }
        if stream && tokens > 0 {
            self.schedule(first, Event::FirstToken(id));
        }
        self.schedule(first + service.itl_ns * tokens.saturating_sub(1), Event::End(id));
    }

    /// A batch slot of `name` is free: the next queued request that is still waiting starts.
    fn free_slot(&mut self, name: &str, now: u64) {
        if let Some(r) = self.running.get_mut(name) {
            *r = r.saturating_sub(1);
        }
        while let Some(next) = self.queues.get_mut(name).and_then(VecDeque::pop_front) {
            if self.flights.get(next).is_some_and(|f| !f.ended) {
                self.start_service(next, now);
                return;
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // Response side and ends
    // -----------------------------------------------------------------------------------------

    fn handle(&mut self, at: u64, event: Event) {
        match event {
            Event::FirstToken(id) => {
                let Some(f) = self.flights.get_mut(id) else { return };
                if f.ended {
                    return;
                }
                f.first_token_ns = Some(at);
                self.guard_first_token(id, at);
            }
            Event::End(id) => {
                if self.flights.get(id).is_none_or(|f| f.ended) {
                    return;
                }
                // The slot is free when the last piece leaves the upstream, before the gateway reads it.
                let taken = self.flights.get(id).is_some_and(|f| f.slot_taken);
                if taken {
                    if let Some(name) = self.flights.get_mut(id).and_then(|f| {
                        f.slot_taken = false;
                        f.upstream.clone()
                    }) {
                        self.free_slot(&name, at);
                    }
                }
                self.finish(id, at, None);
            }
            Event::TtftDeadline(id) => {
                let Some(f) = self.flights.get(id) else { return };
                if f.ended || f.first_token_ns.is_some() {
                    return;
                }
                self.finish(id, at, Some(Fired::TtftReply));
            }
            Event::TotalDeadline(id) => {
                let Some(f) = self.flights.get(id) else { return };
                if f.ended {
                    return;
                }
                let fired = if f.first_token_ns.is_some() { Fired::TotalEnd } else { Fired::TotalReply };
                self.finish(id, at, Some(fired));
            }
            Event::ShadowSent(id) => {
                let Some(f) = self.flights.get_mut(id) else { return };
                if !f.shadow_queued {
                    return;
                }
                f.shadow_queued = false;
                self.shadow_jobs = self.shadow_jobs.saturating_sub(1);
                self.shadow_calls += 1;
                let done = self.shadow_answer_ns(id);
                self.schedule(at + done, Event::ShadowDone(id));
            }
            Event::ShadowDone(_) => self.shadow_calls = self.shadow_calls.saturating_sub(1),
        }
    }

    /// How long the shadow upstream takes to answer a shadow whole (the simulator's model: no queue).
    fn shadow_answer_ns(&self, id: usize) -> u64 {
        let Some(f) = self.flights.get(id) else { return 0 };
        let Some(policy) = self.policies.model_router.as_ref() else { return 0 };
        let Some(s) = policy.model_for(&f.model).and_then(|i| policy.model(i)).and_then(|m| m.shadow.as_ref()) else { return 0 };
        let model = self.workload.upstream(&s.version.cluster);
        let running = *self.running.get(&s.version.cluster).unwrap_or(&0);
        let text_chars = prompt_chars(f.request.prompt_tokens);
        let prompt = text_chars.div_ceil(4) + 4;
        let (ttft_ms, tpot_ms) = service_times(model, prompt, running, &[]);
        let default_out = self.workload.traffic.output_tokens;
        // The shadow's body is the one the router saw: the client's limit (after the guard's ceiling).
        let tokens = f.request.max_tokens.unwrap_or(default_out).min(default_out);
        ms_to_ns(ttft_ms) + ms_to_ns(tpot_ms) * tokens.saturating_sub(1)
    }

    /// latency-guard at the first token (released by llm-metrics' mark): the TTFT into the window.
    fn guard_first_token(&mut self, id: usize, at: u64) {
        let Some(f) = self.flights.get_mut(id) else { return };
        let arrival = f.arrival_ns;
        let Some(a) = f.guard.as_mut().and_then(|g| g.admitted.as_mut()) else { return };
        if a.ttft_recorded || a.fired.is_some() {
            return;
        }
        a.ttft_recorded = true;
        let version = a.version.clone();
        let ttft_us = at.saturating_sub(arrival) / 1000;
        self.update_window(&version, at, |store, key, config| window::update_ttft(store, key, config, at, ttft_us));
    }

    /// A request refused by a filter before any upstream saw it.
    fn end_refused(&mut self, id: usize, now: u64) {
        // The guard had counted it in flight when a filter behind it refused.
        self.guard_log(id, now, true);
        if let Some(f) = self.flights.get_mut(id) {
            f.ended = true;
        }
        self.emit(id, now, None);
    }

    /// The end of an admitted request: at its last piece, or at a deadline the guard fired.
    fn finish(&mut self, id: usize, at: u64, fired: Option<Fired>) {
        if let Some(f) = self.flights.get_mut(id) {
            f.ended = true;
            if let Some(a) = f.guard.as_mut().and_then(|g| g.admitted.as_mut()) {
                a.fired = fired;
            }
        }
        if fired.is_some() {
            // The upstream request is reset: its slot is free (a queued one leaves the queue).
            let taken = self.flights.get(id).is_some_and(|f| f.slot_taken);
            if let Some(name) = self.flights.get_mut(id).and_then(|f| {
                f.slot_taken = false;
                f.upstream.clone()
            }) {
                if taken {
                    self.free_slot(&name, at);
                }
            }
        }
        let produced = self.settle(id, at, fired);
        self.guard_log(id, at, false);
        self.emit(id, at, Some(produced));
    }

    /// tenant-budget's settlement; returns what was charged (input, output, micro-USD) and the
    /// tokens the client got.
    fn settle(&mut self, id: usize, at: u64, fired: Option<Fired>) -> Charged {
        let Some(f) = self.flights.get(id) else { return Charged::default() };
        let service = f.service;
        let delivered = match (service, fired) {
            (Some(s), None) if s.fail.is_none() => s.tokens,
            // Cut at the total deadline: what reached the gateway by then.
            (Some(s), Some(Fired::TotalEnd)) if s.fail.is_none() => {
                f.first_token_ns.map_or(0, |first| (at.saturating_sub(first) / s.itl_ns.max(1) + 1).min(s.tokens))
            }
            _ => 0,
        };
        let Some(policy) = self.policies.tenant_budget.as_ref() else { return Charged::default() };
        let Some(admission) = f.admission.as_ref() else { return Charged::default() };
        let info = f.budget_info.clone().unwrap_or_default();
        // The status tenant-budget saw: the guard's 504, the upstream's error, or 200.
        let status = match (fired, service) {
            (Some(Fired::TtftReply | Fired::TotalReply), _) => 504,
            (_, Some(s)) => s.fail.unwrap_or(200),
            (_, None) => 504,
        };
        let produced = (200..300).contains(&status);
        let body = f.upstream_body.as_ref().unwrap_or(&Value::Null);
        // The mock reports usage on whole answers, on Responses and Anthropic streams, and on OpenAI
        // streams that asked for it; a stream cut at a deadline never reaches its usage.
        let asked_usage = body.get("stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool) == Some(true);
        let reported = fired.is_none() && (!f.stream || matches!(f.kind, ApiKind::Responses | ApiKind::AnthropicMessages) || asked_usage);
        let actual = match (produced, reported) {
            (true, true) => Usage { input_tokens: prompt_chars(f.request.prompt_tokens).div_ceil(4) + 4, output_tokens: delivered, ..Usage::default() },
            (true, false) => Usage { input_tokens: info.prompt_tokens_estimate, output_tokens: delivered, ..Usage::default() },
            (false, _) => Usage::default(),
        };
        let settlement = policy.settle(&mut self.store, admission, &actual, at);
        Charged { input: actual.input_tokens, output: actual.output_tokens, micro_usd: settlement.micro_usd }
    }

    /// latency-guard's end of request: leave in flight; sample the window and judge the breaker
    /// unless another filter answered the request itself.
    fn guard_log(&mut self, id: usize, at: u64, refused_behind: bool) {
        let Some(f) = self.flights.get(id) else { return };
        let arrival = f.arrival_ns;
        let service = f.service;
        let first = f.first_token_ns;
        let Some(a) = f.guard.as_ref().and_then(|g| g.admitted.as_ref()) else { return };
        let (version, counted, fired, recorded, ttft_deadline) = (a.version.clone(), a.counted_in_flight, a.fired, a.ttft_recorded, a.ttft_deadline_ns);
        if counted {
            if let Some(n) = self.in_flight.get_mut(&version) {
                *n = n.saturating_sub(1);
            }
        }
        if refused_behind {
            return;
        }
        let error = fired.is_some() || service.is_none_or(|s| s.fail.is_some_and(|st| st >= 500));
        let ttft_us = match fired {
            Some(Fired::TtftReply) => ttft_deadline.map(|d| d.saturating_sub(arrival) / 1000),
            _ => first.map(|t| t.saturating_sub(arrival) / 1000),
        };
        let window_ttft = if recorded { None } else { ttft_us };
        // The guard's own stream timing: the first content chunk, then the last one.
        let mut timing = StreamTiming::new(arrival);
        if let (Some(s), Some(first), None) = (service, first, fired) {
            timing.on_content(first, 1);
            if s.tokens >= 2 {
                timing.on_content(first + s.itl_ns * (s.tokens - 1), 1);
            }
        }
        let tpot_us = service.and_then(|s| timing.tpot_ns(s.tokens)).map(|v| v / 1000);
        self.update_window(&version, at, |store, key, config| window::update(store, key, config, at, window_ttft, tpot_us, error));
    }

    /// Applies `update` to the version's window (when it has a breaker) and judges the breaker.
    fn update_window(
        &mut self,
        version: &str,
        now: u64,
        update: impl FnOnce(&mut MemoryStore, &str, &latency::WindowConfig) -> Result<latency::RollingWindow, latency::UpdateError>,
    ) {
        let Some(policy) = self.policies.latency_guard.as_ref() else { return };
        let Some(vp) = policy.version(version) else { return };
        let Some(b) = vp.breaker.as_ref() else { return };
        if let Ok(w) = update(&mut self.store, &vp.window_key(), &b.window) {
            let stats = w.snapshot(now);
            self.judge(version, now, &stats);
        }
    }

    fn judge(&mut self, version: &str, now: u64, stats: &latency::WindowStats) {
        let Some(policy) = self.policies.latency_guard.as_ref() else { return };
        let Some(vp) = policy.version(version) else { return };
        let Some(b) = vp.breaker.as_ref() else { return };
        if let Ok((_, Some(t))) = breaker::update(&mut self.store, &vp.breaker_key(), &b.config, now, stats) {
            if t.reset_window {
                let _ = window::reset(&mut self.store, &vp.window_key(), &b.window);
            }
            self.out.transitions.push(BreakerTransition {
                t_ms: now.saturating_sub(self.start_ns) as f64 / 1e6,
                version: version.to_string(),
                from: t.from.as_str(),
                to: t.to.as_str(),
                reason: t.reason,
            });
        }
    }

    /// The breaker as a request arriving `now` sees it: open → half-open is decided here when due.
    fn current_breaker(&mut self, version: &str, now: u64) -> Option<Breaker> {
        let policy = self.policies.latency_guard.as_ref()?;
        let vp = policy.version(version)?;
        let b = vp.breaker.as_ref()?;
        let current = breaker::read(&mut self.store, &vp.breaker_key(), &b.config).ok()?;
        let state = current.state();
        if state.state != State::Open || now.saturating_sub(state.since_ns) < b.config.open_for_ns {
            return Some(current);
        }
        let Ok(w) = window::read(&mut self.store, &vp.window_key(), &b.window) else { return Some(current) };
        let stats = w.snapshot(now);
        self.judge(version, now, &stats);
        let config = b.config.clone();
        Some(breaker::read(&mut self.store, &vp.breaker_key(), &config).unwrap_or(current))
    }

    // -----------------------------------------------------------------------------------------
    // Output
    // -----------------------------------------------------------------------------------------

    fn emit(&mut self, id: usize, at: u64, charged: Option<Charged>) {
        let Some(f) = self.flights.get(id) else { return };
        let charged = charged.unwrap_or_default();
        let fired = f.guard.as_ref().and_then(|g| g.admitted.as_ref()).and_then(|a| a.fired);
        let (decision, status, code, refused_by, outcome) = match (&f.refused, fired, f.service) {
            (Some((status, by, code)), _, _) => (Verdict::Refused, *status, Some(code.clone()), Some(*by), "refused"),
            (None, Some(Fired::TtftReply | Fired::TotalReply), _) => (self.admitted_kind(f), 504, None, None, "deadline"),
            (None, Some(Fired::TotalEnd), _) => (self.admitted_kind(f), 200, None, None, "deadline"),
            (None, None, Some(s)) if s.fail.is_some() => (self.admitted_kind(f), s.fail.unwrap_or(500), None, None, "upstream_error"),
            (None, None, _) => (self.admitted_kind(f), 200, None, None, "completed"),
        };
        let key = f.budget_key.and_then(|k| self.policies.tenant_budget.as_ref().and_then(|p| p.keys.get(k))).map(|k| k.id.clone());
        let version = f.route.as_ref().map(|d| d.version.clone()).or_else(|| f.upstream.clone());
        let service = f.service;
        let verdict = RequestVerdict {
            line: f.request.line,
            arrival_ms: f.arrival_ns.saturating_sub(self.start_ns) as f64 / 1e6,
            tenant: f.tenant.clone(),
            key,
            user: f.user.clone(),
            api: api_str(f.request.api),
            stream: f.stream,
            prompt_tokens: f.request.prompt_tokens,
            decision,
            status,
            code,
            refused_by,
            outcome,
            version,
            route_reason: f.route.as_ref().map(|d| d.reason.as_str()),
            shadow_version: f.shadow.clone(),
            class: f.guard.as_ref().map(|g| g.class.clone()),
            probe: f.guard.as_ref().and_then(|g| g.admitted.as_ref()).is_some_and(|a| a.probe),
            ttft_ms: f.first_token_ns.map(|t| t.saturating_sub(f.arrival_ns) as f64 / 1e6),
            tpot_ms: service.filter(|s| f.stream && s.fail.is_none() && s.tokens > 1 && fired.is_none()).map(|s| s.itl_ns as f64 / 1e6),
            duration_ms: at.saturating_sub(f.arrival_ns) as f64 / 1e6,
            charged_input_tokens: charged.input,
            charged_output_tokens: charged.output,
            charged_micro_usd: charged.micro_usd,
            upstream: f.upstream.clone(),
            max_tokens_upstream: f.upstream_body.as_ref().and_then(|b| body_limit(f.kind, b)),
        };
        self.out.verdicts.push(verdict);
    }

    fn admitted_kind(&self, f: &Flight) -> Verdict {
        if f.clamped {
            Verdict::Clamped
        } else {
            Verdict::Admitted
        }
    }

    /// Takes the samples due before `t`.
    fn sample_until(&mut self, t: u64) {
        let every = self.workload.sample_every_ms.max(1) * MS;
        while self.next_sample_ns < t {
            let at = self.next_sample_ns;
            self.sample(at);
            self.next_sample_ns = at.saturating_add(every);
        }
    }

    fn sample(&mut self, at: u64) {
        let n = self.samples_done;
        self.samples_done += 1;
        let series = &mut self.out.series;
        series.t_ms.push(at.saturating_sub(self.start_ns) as f64 / 1e6);
        let push = |map: &mut BTreeMap<String, Vec<u64>>, name: &str, value: u64| {
            let v = map.entry(name.to_string()).or_insert_with(|| vec![0; n]);
            v.resize(n, v.last().copied().unwrap_or(0));
            v.push(value);
        };
        if let Some(policy) = &self.policies.latency_guard {
            for v in &policy.versions {
                let Some(b) = &v.breaker else { continue };
                let state = breaker::read(&mut self.store, &v.breaker_key(), &b.config).map(|b| b.state().state.code()).unwrap_or(0);
                series.breakers.entry(v.name.clone()).or_default().push(state);
            }
        }
        if let Some(policy) = &self.policies.tenant_budget {
            let minute = u32::try_from(at / 60_000_000_000).unwrap_or(u32::MAX);
            let mut wanted: Vec<usize> = self.keys_seen.iter().filter_map(|&k| policy.keys.get(k)).flat_map(|k| k.counters.iter().copied()).collect();
            wanted.sort_unstable();
            wanted.dedup();
            for index in wanted {
                let Some(spec) = policy.counters.get(index).filter(|s| !s.per_identity) else { continue };
                let counter = ledger::read(&mut self.store, &spec.store_key, spec.window.id(at), minute, policy.reservation_ttl_minutes).unwrap_or_default();
                let remaining = spec.limit.value().saturating_sub(counter.committed());
                match series.budgets.iter_mut().find(|b| b.code == spec.code) {
                    Some(b) => b.remaining.push(remaining),
                    None => {
                        let mut remaining_series = vec![spec.limit.value(); n];
                        remaining_series.push(remaining);
                        series.budgets.push(BudgetSeries {
                            code: spec.code.clone(),
                            unit: spec.limit.measure(),
                            limit: spec.limit.value(),
                            remaining: remaining_series,
                        })
                    }
                }
            }
        }
        // Spend and counts from the verdicts so far (each verdict is written at its request's end).
        let mut spend: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        let mut admitted: BTreeMap<String, u64> = BTreeMap::new();
        let mut refused: BTreeMap<String, u64> = BTreeMap::new();
        let from_ms = if n == 0 { f64::NEG_INFINITY } else { series.t_ms.get(n - 1).copied().unwrap_or(0.0) };
        let to_ms = at.saturating_sub(self.start_ns) as f64 / 1e6;
        for v in &self.out.verdicts {
            let tenant = v.tenant.clone().unwrap_or_else(|| "anonymous".into());
            let e = spend.entry(tenant).or_default();
            e.0 += v.charged_micro_usd;
            e.1 += v.charged_input_tokens + v.charged_output_tokens;
        }
        for f in &self.flights {
            let a = f.arrival_ns.saturating_sub(self.start_ns) as f64 / 1e6;
            if !(a > from_ms && a <= to_ms) {
                continue;
            }
            match &f.refused {
                Some((_, _, code)) => *refused.entry(code.clone()).or_default() += 1,
                None => {
                    let v = f.route.as_ref().map(|d| d.version.clone()).or_else(|| f.upstream.clone()).unwrap_or_else(|| "unrouted".into());
                    *admitted.entry(v).or_default() += 1;
                }
            }
        }
        for (tenant, (usd, tokens)) in &spend {
            push(&mut series.spend_micro_usd, tenant, *usd);
            push(&mut series.charged_tokens, tenant, *tokens);
        }
        for map in [&mut series.spend_micro_usd, &mut series.charged_tokens] {
            for v in map.values_mut() {
                let last = v.last().copied().unwrap_or(0);
                v.resize(n + 1, last);
            }
        }
        for (name, count) in admitted {
            series.admitted_by_version.entry(name).or_insert_with(|| vec![0; n]).push(count);
        }
        for (code, count) in refused {
            series.refused_by_code.entry(code).or_insert_with(|| vec![0; n]).push(count);
        }
        for map in [&mut series.admitted_by_version, &mut series.refused_by_code] {
            for v in map.values_mut() {
                v.resize(n + 1, 0);
            }
        }
        let mut names: Vec<String> = self.running.keys().chain(self.queues.keys()).cloned().collect();
        names.sort();
        names.dedup();
        for name in names {
            let busy = self.running.get(&name).copied().unwrap_or(0)
                + self
                    .queues
                    .get(&name)
                    .map_or(0, |q| q.iter().filter(|&&i| self.flights.get(i).is_some_and(|f| !f.ended && f.service.is_none())).count() as u32);
            let v = series.in_flight.entry(name).or_insert_with(|| vec![0; n]);
            v.resize(n, 0);
            v.push(busy);
        }
        for v in series.in_flight.values_mut() {
            v.resize(n + 1, 0);
        }
    }

    fn finish_tables(&mut self) {
        self.out.verdicts.sort_by_key(|v| v.line);
        let mut rows: BTreeMap<String, TenantRow> = BTreeMap::new();
        for v in &self.out.verdicts {
            let name = v.tenant.clone().unwrap_or_else(|| "anonymous".into());
            let row = rows.entry(name.clone()).or_insert_with(|| TenantRow { tenant: name, ..TenantRow::default() });
            row.requests += 1;
            match v.decision {
                Verdict::Admitted => row.admitted += 1,
                Verdict::Clamped => row.clamped += 1,
                Verdict::Refused => {
                    row.refused += 1;
                    *row.refusals.entry(v.code.clone().unwrap_or_default()).or_default() += 1;
                }
            }
            row.charged_tokens += v.charged_input_tokens + v.charged_output_tokens;
            row.charged_micro_usd += v.charged_micro_usd;
        }
        self.out.tenants = rows.into_values().collect();
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Charged {
    input: u64,
    output: u64,
    micro_usd: u64,
}

/// tenant-budget's key: API key hash, auth header, JWT claim, in that order; else the policy's default.
fn identify(policy: &Policy, f: &Flight) -> Option<usize> {
    let id = &policy.identity;
    first_credential(f, id.api_key, id.header.as_deref(), id.jwt.as_ref().map(|j| (j.header.as_str(), j.claim.as_str())), |c| match c {
        Credential::ApiKeyHash(hash) => policy.key_by_api_key_hash(&hash),
        Credential::Header(v) | Credential::Jwt(v) => policy.key_by_id(&v),
    })
    .or(policy.unknown_default)
}

/// tenant-budget's per-identity name, hashed.
fn per_identity(policy: &Policy, f: &Flight) -> Option<String> {
    let s = policy.identity.per_identity.as_ref()?;
    first_credential(f, s.api_key, s.header.as_deref(), s.jwt.as_ref().map(|j| (j.header.as_str(), j.claim.as_str())), |c| {
        Some(identity_hash(&match c {
            Credential::ApiKeyHash(hash) => format!("api_key:{hash}"),
            Credential::Header(v) if v.is_empty() => return None,
            Credential::Header(v) => format!("header:{v}"),
            Credential::Jwt(v) => format!("jwt:{v}"),
        }))
    })
}

enum Credential {
    ApiKeyHash(String),
    Header(String),
    Jwt(String),
}

fn first_credential<T>(
    f: &Flight,
    api_key: bool,
    header: Option<&str>,
    jwt: Option<(&str, &str)>,
    mut accept: impl FnMut(Credential) -> Option<T>,
) -> Option<T> {
    let bytes = |name: &str| Engine::header(f, name).map(|v| v.as_bytes().to_vec());
    if api_key {
        if let Some(key) = api_key_from_headers(bytes("authorization").as_deref(), bytes("x-api-key").as_deref()) {
            if let Some(found) = accept(Credential::ApiKeyHash(sha256_hex(&key))) {
                return Some(found);
            }
        }
    }
    if let Some(v) = header.and_then(|h| Engine::header(f, h)) {
        if let Some(found) = accept(Credential::Header(v.trim().to_string())) {
            return Some(found);
        }
    }
    let (h, claim) = jwt?;
    let claim = bytes(h).and_then(|payload| jwt_payload_claim(&payload, claim))?;
    accept(Credential::Jwt(claim))
}

/// The output limit the body carries, as the mock server reads it (the lowest of its fields).
fn body_limit(kind: ApiKind, body: &Value) -> Option<u64> {
    let fields: &[&str] = match kind {
        ApiKind::ChatCompletions => &["max_completion_tokens", "max_tokens"],
        ApiKind::Completions | ApiKind::AnthropicMessages => &["max_tokens"],
        ApiKind::Responses => &["max_output_tokens"],
    };
    fields.iter().filter_map(|f| body.get(*f).and_then(Value::as_u64)).min()
}
