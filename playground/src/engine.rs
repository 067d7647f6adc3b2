//! The engine: a workload's requests through the gateway (`sluice_memory_host`: sluice-core's flows
//! in the shipped gateways' filter order — latency-guard, then model-router, tenant-budget and
//! llm-metrics) on one virtual clock, against the simulator's service model of the upstream.
//!
//! Per request, the engine builds the request the simulator sends for the same record (headers,
//! json_to_metadata's model and user, the body) and hands it to the gateway at its arrival time;
//! what the gateway lets through reaches the modelled upstream (batch, FIFO queue, service times,
//! incidents, seeded errors: `sluice-workload`'s), whose answer ([`crate::answer`]: the mock
//! server's bytes, chunked as the simulator chunks them) goes back through the gateway piece by
//! piece. The filters' ticks and model-router's shadow callouts run on the same clock. Each
//! request's verdict is read from what the flows stamped (their filter state), as the simulator
//! reads it from the plugins' stamps. What no Envoy means for fidelity is in docs/playground.md.

use serde::Serialize;
use serde_json::Value;
use sluice_core::api::ApiKind;
use sluice_core::budget::ledger;
use sluice_core::contract::{route_version, ROUTE_PROPERTY};
use sluice_core::contract::{MODEL_METADATA, USER_METADATA};
use sluice_core::flow::guard::STAMP_PROPERTY as GUARD_STAMP;
use sluice_core::latency::{breaker, LatencyPolicy};
use sluice_core::report::Outcome;
use sluice_core::routing::{Reason, RoutingPolicy};
use sluice_core::vecmap::VecMap;
use sluice_workload::draw::mix;
use sluice_workload::request::{prompt_text, request_body};
use sluice_workload::upstream::{active_incidents, failure, ms_to_ns, service_times};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use crate::answer::{answer, prompt_tokens, CHUNK_NS};
use crate::workload::{Request, Workload};
use sluice_memory_host::{shadow_timeout_ns, Ended, Filter, Gateway, Out};

const MS: u64 = 1_000_000;

/// The compiled policies of one run; a plugin without a policy is not in the chain.
#[derive(Debug, Default)]
pub struct Policies {
    pub latency_guard: Option<LatencyPolicy>,
    pub model_router: Option<RoutingPolicy>,
    pub tenant_budget: Option<sluice_core::budget::Policy>,
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
    pub breakers: VecMap<String, Vec<u8>>,
    /// The budgets of the keys the workload used (per-identity budgets are one counter per identity: left out).
    pub budgets: Vec<BudgetSeries>,
    /// Cumulative spend per tenant, micro-USD, and charged tokens. (The maps here are core's
    /// `VecMap`s, serialized as `BTreeMap`s are: a few names each, and B-tree code per map type is
    /// what the page's .wasm was made of most.)
    pub spend_micro_usd: VecMap<String, Vec<u64>>,
    pub charged_tokens: VecMap<String, Vec<u64>>,
    /// Requests admitted per version, and refused per code, in each interval.
    pub admitted_by_version: VecMap<String, Vec<u64>>,
    pub refused_by_code: VecMap<String, Vec<u64>>,
    /// Requests running or queued at each upstream (u64 like the maps above: one map type less).
    pub in_flight: VecMap<String, Vec<u64>>,
}

/// Per-tenant counts of the verdict table.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TenantRow {
    pub tenant: String,
    pub requests: u64,
    pub admitted: u64,
    pub clamped: u64,
    pub refused: u64,
    pub refusals: VecMap<String, u64>,
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
    /// The upstream starts answering a request: its response headers.
    Headers(usize),
    /// Piece `n` of the answer reaches the gateway.
    Piece(usize, usize),
    /// The answer to shadow callout `token` (or its timeout).
    ShadowAnswer(u32),
}

/// How an upstream serves a request (fixed when service starts).
#[derive(Debug, Clone, Copy)]
struct Service {
    itl_ns: u64,
    tokens: u64,
    fail: Option<u16>,
}

/// An upstream's running requests and FIFO queue.
#[derive(Debug)]
struct Load {
    name: String,
    running: u32,
    queue: VecDeque<usize>,
}

#[derive(Debug)]
struct Flight {
    request: Request,
    arrival_ns: u64,
    tenant: Option<String>,
    user: Option<String>,
    stream: bool,
    upstream: Option<String>,
    upstream_body: Option<Value>,
    answer: Option<crate::answer::Answer>,
    service: Option<Service>,
    slot_taken: bool,
    first_content_ns: Option<u64>,
    ended: bool,
    /// What the request came to at its arrival (the series): the code of its refusal, or the
    /// version it went to.
    refused_code: Option<String>,
    version: Option<String>,
}

/// One run's state.
pub struct Engine<'a> {
    workload: &'a Workload,
    gateway: Gateway,
    start_ns: u64,
    events: BinaryHeap<Reverse<(u64, u64, Event)>>,
    seq: u64,
    flights: Vec<Flight>,
    /// Running requests and FIFO queue per upstream, in the order first used (a handful: a list,
    /// not a map, which would be one more map type in the page's .wasm).
    loads: Vec<Load>,
    /// Shadow answers on their way, by token: status (0: timed out) and body (a few at a time).
    shadows: Vec<(u32, u16, Vec<u8>)>,
    /// The stamps' filter-state keys: llm-metrics', tenant-budget's.
    metrics_key: Option<String>,
    budget_key: Option<String>,
    filler: String,
    out: RunOutput,
    next_sample_ns: u64,
    samples_done: usize,
    keys_seen: Vec<usize>,
    last_ns: u64,
    /// The last arrival or upstream event.
    last_activity_ns: u64,
}

/// Virtual time past the last arrival or upstream event after which requests still open are
/// left as they are (a host that never lets a request end must not keep the page ticking).
const IDLE_LIMIT_NS: u64 = 600_000_000_000;

impl<'a> Engine<'a> {
    pub fn new(policies: Policies, workload: &'a Workload) -> Engine<'a> {
        let start_ns = workload.start_unix_ms.saturating_mul(MS);
        // llm-metrics with its defaults, as in every shipped gateway: its first-token mark releases the
        // response headers latency-guard holds.
        let metrics = sluice_core::flow::metrics::config::Settings::defaults().ok();
        let gateway = Gateway::new(policies.latency_guard, policies.model_router, policies.tenant_budget, metrics, start_ns);
        let metrics_key = gateway.metrics_stamp_key().map(str::to_string);
        let budget_key = gateway.budget_stamp_key().map(str::to_string);
        Engine {
            workload,
            gateway,
            start_ns,
            events: BinaryHeap::new(),
            seq: 0,
            flights: Vec::new(),
            loads: Vec::new(),
            shadows: Vec::new(),
            metrics_key,
            budget_key,
            filler: String::new(),
            out: RunOutput::default(),
            next_sample_ns: start_ns,
            samples_done: 0,
            keys_seen: Vec::new(),
            last_ns: start_ns,
            last_activity_ns: start_ns,
        }
    }

    /// Runs `requests` (in arrival order) to the end of the last answer.
    pub fn run(mut self, requests: Vec<Request>) -> RunOutput {
        let mut arrivals = requests.into_iter().peekable();
        loop {
            let next_arrival = arrivals.peek().map(|r| self.start_ns.saturating_add(r.arrival_ns));
            let next_event = self.events.peek().map(|Reverse((t, _, _))| *t);
            let horizon = [next_arrival, next_event].into_iter().flatten().min();
            // The filters' ticks fire at their times up to the next arrival or event (first at the
            // same instant), and go on while requests are open.
            let open = self.gateway.open_streams() > 0;
            let tick = self.gateway.next_tick().filter(|&t| match horizon {
                Some(h) => t <= h,
                None => open && t.saturating_sub(self.last_activity_ns) < IDLE_LIMIT_NS,
            });
            let Some(t) = tick.or(horizon) else { break };
            self.sample_until(t);
            self.last_ns = self.last_ns.max(t);
            if tick.is_some() {
                self.gateway.tick(t);
            } else {
                self.last_activity_ns = t;
                // Events at the arrival's instant come first (the simulator's order).
                if next_event == Some(t) {
                    if let Some(Reverse((at, _, event))) = self.events.pop() {
                        self.handle(at, event);
                    }
                } else if let Some(r) = arrivals.next() {
                    self.arrive(r, t);
                }
            }
            self.drain(t);
        }
        self.sample_until(self.last_ns.saturating_add(1));
        self.out.span_ms = self.last_ns.saturating_sub(self.start_ns) as f64 / 1e6;
        self.out.transitions = self
            .gateway
            .transitions()
            .iter()
            .map(|t| BreakerTransition {
                t_ms: t.at_ns.saturating_sub(self.start_ns) as f64 / 1e6,
                version: t.version.clone(),
                from: t.from,
                to: t.to,
                reason: t.reason.clone(),
            })
            .collect();
        self.finish_tables();
        self.out
    }

    /// The requests running at upstream `name`.
    fn running(&self, name: &str) -> u32 {
        self.loads.iter().find(|l| l.name == name).map_or(0, |l| l.running)
    }

    /// Upstream `name`'s load, added when first used.
    fn load(&mut self, name: String) -> Option<&mut Load> {
        match self.loads.iter().position(|l| l.name == name) {
            Some(i) => self.loads.get_mut(i),
            None => {
                self.loads.push(Load { name, running: 0, queue: VecDeque::new() });
                self.loads.last_mut()
            }
        }
    }

    fn schedule(&mut self, at: u64, event: Event) {
        self.seq += 1;
        self.events.push(Reverse((at, self.seq, event)));
    }

    /// Takes what the gateway let through, ended or sent since the last look.
    fn drain(&mut self, now: u64) {
        loop {
            let outs = self.gateway.take_out();
            if outs.is_empty() {
                return;
            }
            for out in outs {
                match out {
                    Out::Upstream { id, route, body } => self.reach_upstream(id as usize, now, route, &body),
                    Out::Ended { id, end } => self.finish(id as usize, now, &end),
                    Out::Shadow { token, cluster, path, body } => self.shadow(token, now, &cluster, &path, &body),
                }
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // The client side
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
        let text = prompt_text(&mut self.filler, request.prompt_tokens);
        let (path, body) = request_body(request.api, &model, text, stream, max_tokens, user.as_deref());
        let pair = |k: &str, v: String| (k.to_string(), v);
        let mut headers = vec![
            pair(":method", "POST".into()),
            pair(":path", path.into()),
            pair(":authority", "gateway".into()),
            pair(":scheme", "http".into()),
            pair("content-type", "application/json".into()),
            pair("x-request-id", format!("sim-{}", request.line)),
            pair("content-length", body.len().to_string()),
        ];
        if let Some(t) = &tenant {
            headers.push((traffic.tenant_header.to_ascii_lowercase(), t.clone()));
        }
        if request.api == ApiKind::AnthropicMessages {
            headers.push(pair("anthropic-version", "2023-06-01".into()));
        }
        let mut metadata: Vec<(&'static [&'static str], String)> = vec![(&MODEL_METADATA, model)];
        if let Some(u) = &user {
            metadata.push((&USER_METADATA, u.clone()));
        }
        self.flights.push(Flight {
            arrival_ns: now,
            tenant,
            user,
            stream,
            upstream: None,
            upstream_body: None,
            answer: None,
            service: None,
            slot_taken: false,
            first_content_ns: None,
            ended: false,
            refused_code: None,
            version: None,
            request,
        });
        let gid = u32::try_from(id).unwrap_or(u32::MAX);
        self.gateway.request(gid, now, headers, metadata, body);
        self.drain(now);
        // Still open: admitted to the upstream; its version and key from the stamps so far.
        if self.gateway.is_open(gid) {
            let version = self.gateway.state(gid, ROUTE_PROPERTY).and_then(|r| route_version(&String::from_utf8_lossy(r)));
            let key = self.budget_key.as_deref().and_then(|k| self.gateway.state(gid, k)).and_then(|s| stamp_text(s, "key"));
            if let Some(f) = self.flights.get_mut(id) {
                f.version = version.or_else(|| f.upstream.clone());
            }
            if let Some(key) = key {
                self.note_key(&key);
            }
        }
    }

    /// A key the workload used (its budgets are sampled).
    fn note_key(&mut self, key: &str) {
        let Some(policy) = self.gateway.shared().1 else { return };
        if let Some(index) = policy.keys.iter().position(|k| k.id == key) {
            if !self.keys_seen.contains(&index) {
                self.keys_seen.push(index);
            }
        }
    }

    /// The end of a request in every filter: its verdict from the stamps.
    fn finish(&mut self, id: usize, now: u64, end: &Ended) {
        let Some(f) = self.flights.get_mut(id) else { return };
        f.ended = true;
        if f.slot_taken {
            // Ended before the upstream's last piece (a deadline): the upstream request is reset.
            f.slot_taken = false;
            if let Some(name) = f.upstream.clone() {
                self.free_slot(&name, now);
            }
        }
        let verdict = self.verdict(id, now, end);
        if let Some(f) = self.flights.get_mut(id) {
            if verdict.decision == Verdict::Refused {
                f.refused_code = verdict.code.clone().or_else(|| Some(String::new()));
            }
            f.version = f.version.take().or_else(|| verdict.version.clone());
        }
        if let Some(key) = verdict.key.clone() {
            self.note_key(&key);
        }
        self.out.verdicts.push(verdict);
    }

    /// A request's verdict from its stamps, as the simulator reads the plugins' (sluice-sim's
    /// `Engine::verdict`).
    fn verdict(&self, id: usize, now: u64, end: &Ended) -> RequestVerdict {
        let f = self.flights.get(id);
        let stamp = |key: Option<&str>| key.and_then(|k| end.state.get(k)).and_then(|v| serde_json::from_slice::<Value>(v).ok());
        let (llm, budget, route, latency) =
            (stamp(self.metrics_key.as_deref()), stamp(self.budget_key.as_deref()), stamp(Some(ROUTE_PROPERTY)), stamp(Some(GUARD_STAMP)));
        let (llm, budget, route, latency) = (llm.as_ref(), budget.as_ref(), route.as_ref(), latency.as_ref());
        let num = |v: Option<&Value>, field: &str| v.and_then(|s| s.get(field)).and_then(Value::as_u64);
        let text = |v: Option<&Value>, field: &str| v.and_then(|s| s.get(field)).and_then(Value::as_str).map(str::to_string);
        // The gateway's own reply is a refusal, unless it is latency-guard's 504 at a deadline. Of
        // the back filter's sections only tenant-budget answers requests itself.
        let refused_by = end.reply.filter(|(_, status)| *status != 504).map(|(filter, _)| match filter {
            Filter::Guard => "latency-guard",
            Filter::Sections => "tenant-budget",
        });
        let code = match refused_by {
            Some("tenant-budget") => text(budget, "reject_code"),
            Some(_) => text(latency, "outcome"),
            None => None,
        };
        let decision = match (refused_by, text(budget, "decision").as_deref()) {
            (Some(_), _) => Verdict::Refused,
            (None, Some("clamped")) => Verdict::Clamped,
            _ => Verdict::Admitted,
        };
        let upstream = f.and_then(|f| f.upstream.clone());
        let service = f.and_then(|f| f.service);
        let stream = f.is_some_and(|f| f.stream);
        let arrival_ns = f.map_or(now, |f| f.arrival_ns);
        let status = num(llm, "status").and_then(|s| u16::try_from(s).ok()).unwrap_or(end.reply.map_or(end.client_status, |(_, s)| s));
        let outcome = text(llm, "outcome")
            .and_then(|o| {
                [Outcome::Completed, Outcome::ClientDisconnect, Outcome::UpstreamError, Outcome::Refused, Outcome::Deadline]
                    .into_iter()
                    .find(|k| k.as_str() == o)
            })
            .map(Outcome::as_str)
            .unwrap_or(match (refused_by, end.reply) {
                (Some(_), _) => "refused",
                (None, Some(_)) => "deadline",
                _ if status >= 400 || status == 0 => "upstream_error",
                _ => "completed",
            });
        let ms = |us: u64| us as f64 / 1000.0;
        let request = f.map(|f| &f.request);
        RequestVerdict {
            line: request.map_or(0, |r| r.line),
            arrival_ms: arrival_ns.saturating_sub(self.start_ns) as f64 / 1e6,
            tenant: f.and_then(|f| f.tenant.clone()),
            key: text(budget, "key"),
            user: f.and_then(|f| f.user.clone()),
            api: request.map_or("chat_completions", |r| r.api.as_str()),
            stream,
            prompt_tokens: request.map_or(0, |r| r.prompt_tokens),
            decision,
            status,
            code,
            refused_by,
            outcome,
            version: text(route, "version").or_else(|| text(llm, "model_version")).or_else(|| upstream.clone()),
            route_reason: text(route, "reason")
                .and_then(|r| [Reason::Weight, Reason::Ramp, Reason::Override, Reason::Fallback, Reason::Unkeyed].into_iter().find(|k| k.as_str() == r))
                .map(Reason::as_str),
            shadow_version: text(route, "shadow"),
            class: text(latency, "class"),
            probe: latency.and_then(|l| l.get("probe")).and_then(Value::as_bool).unwrap_or(false),
            ttft_ms: num(llm, "ttft_us")
                .map(ms)
                .or_else(|| f.and_then(|f| f.first_content_ns).filter(|_| stream).map(|t| t.saturating_sub(arrival_ns) as f64 / 1e6)),
            // llm-metrics' figure (none for a whole answer); the modelled one only without it.
            tpot_ms: match llm {
                Some(l) => l.get("tpot_us").and_then(Value::as_u64).map(ms),
                None => service.filter(|s| stream && s.fail.is_none() && s.tokens > 1).map(|s| s.itl_ns as f64 / 1e6),
            },
            duration_ms: num(llm, "duration_us").map_or_else(|| now.saturating_sub(arrival_ns) as f64 / 1e6, ms),
            charged_input_tokens: num(budget, "input_tokens").unwrap_or(0),
            charged_output_tokens: num(budget, "output_tokens").unwrap_or(0),
            charged_micro_usd: num(budget, "charged_micro_usd").unwrap_or(0),
            upstream,
            max_tokens_upstream: f.and_then(|f| f.upstream_body.as_ref().and_then(|b| body_limit(f.request.api, b))),
        }
    }

    // -----------------------------------------------------------------------------------------
    // The upstream (the simulator's service model)
    // -----------------------------------------------------------------------------------------

    fn reach_upstream(&mut self, id: usize, now: u64, route: Option<String>, body: &[u8]) {
        // The upstream a request reaches: the route model-router wrote, else its model.
        let Some(f) = self.flights.get_mut(id) else { return };
        let body: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let name = route.or_else(|| body.get("model").and_then(Value::as_str).map(str::to_string)).unwrap_or_else(|| "default".into());
        f.upstream = Some(name.clone());
        f.upstream_body = Some(body);
        if self.running(&name) < self.workload.upstream(&name).max_batch {
            self.start_service(id, now);
        } else {
            if let Some(l) = self.load(name) {
                l.queue.push_back(id);
            }
        }
    }

    /// Service starts: the answer is planned (its service times fixed by the batch it joins), its
    /// headers sent now and its pieces when they are due.
    fn start_service(&mut self, id: usize, now: u64) {
        let offset_s = now.saturating_sub(self.start_ns) as f64 / 1e9;
        let Some(f) = self.flights.get(id) else { return };
        let Some(name) = f.upstream.clone() else { return };
        let model = self.workload.upstream(&name);
        let incidents = active_incidents(&self.workload.incidents, &name, offset_s);
        let running = self.running(&name);
        let fail = failure(model, &incidents, self.workload.seed, f.request.line);
        let (mut ttft_ms, mut tpot_ms) = service_times(model, f.request.prompt_tokens, running, &incidents);
        if self.workload.whole_milliseconds {
            (ttft_ms, tpot_ms) = (ttft_ms.round(), tpot_ms.round());
        }
        let planned = f.request.output_tokens.unwrap_or(self.workload.traffic.output_tokens);
        // A failure answers after the fixed part alone, without a batch slot.
        let ttft_ns = if fail.is_some() { ms_to_ns(model.ttft_base_ms) } else { ms_to_ns(ttft_ms) };
        let itl_ns = ms_to_ns(tpot_ms);
        let a = answer(f.request.api, f.upstream_body.as_ref().unwrap_or(&Value::Null), planned, ttft_ns, itl_ns, fail, CHUNK_NS);
        let times: Vec<u64> = a.pieces.iter().map(|(t, _)| now.saturating_add(*t)).collect();
        let service = Service { itl_ns, tokens: a.tokens, fail };
        if fail.is_none() {
            if let Some(l) = self.load(name) {
                l.running += 1;
            }
        }
        if let Some(f) = self.flights.get_mut(id) {
            f.service = Some(service);
            f.slot_taken = fail.is_none();
            f.answer = Some(a);
        }
        self.schedule(now, Event::Headers(id));
        for (n, at) in times.into_iter().enumerate() {
            self.schedule(at, Event::Piece(id, n));
        }
    }

    /// A batch slot of `name` is free: the next queued request that is still waiting starts.
    fn free_slot(&mut self, name: &str, now: u64) {
        let Some(index) = self.loads.iter().position(|l| l.name == name) else { return };
        if let Some(l) = self.loads.get_mut(index) {
            l.running = l.running.saturating_sub(1);
        }
        while let Some(next) = self.loads.get_mut(index).and_then(|l| l.queue.pop_front()) {
            if self.flights.get(next).is_some_and(|f| !f.ended) {
                self.start_service(next, now);
                return;
            }
        }
    }

    fn handle(&mut self, at: u64, event: Event) {
        match event {
            Event::Headers(id) => {
                let Some(a) = self.flights.get(id).and_then(|f| f.answer.as_ref()) else { return };
                let (status, headers) = (a.status, a.headers.clone());
                self.gateway.response_headers(gateway_id(id), at, status, &headers);
            }
            Event::Piece(id, n) => {
                let Some(f) = self.flights.get_mut(id) else { return };
                let Some(a) = f.answer.as_mut() else { return };
                let last = n + 1 == a.pieces.len();
                let bytes = a.pieces.get_mut(n).map(|(_, b)| std::mem::take(b)).unwrap_or_default();
                if f.first_content_ns.is_none() && n > 0 {
                    f.first_content_ns = Some(at);
                }
                // The slot is free when the last piece leaves the upstream, before the gateway reads it.
                if last && f.slot_taken {
                    f.slot_taken = false;
                    if let Some(name) = f.upstream.clone() {
                        self.free_slot(&name, at);
                    }
                }
                self.gateway.response_body(gateway_id(id), at, &bytes, last);
            }
            Event::ShadowAnswer(token) => {
                let (status, body) = match self.shadows.iter().position(|(t, _, _)| *t == token) {
                    Some(i) => {
                        let (_, status, body) = self.shadows.swap_remove(i);
                        (status, body)
                    }
                    None => (0, Vec::new()),
                };
                self.gateway.shadow_answer(token, at, status, &body);
            }
        }
    }

    /// model-router's shadow copy, answered whole by the shadow upstream's model (no queue, as in
    /// the simulator) after its TTFT and decode time — or by its timeout.
    fn shadow(&mut self, token: u32, now: u64, cluster: &str, path: &str, body: &[u8]) {
        let body: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let model = self.workload.upstream(cluster);
        let running = self.running(cluster);
        let default_out = self.workload.traffic.output_tokens;
        let tokens = body.get("max_tokens").and_then(Value::as_u64).unwrap_or(default_out).min(default_out);
        let (status, bytes, after) = match ApiKind::from_path(path) {
            Some(kind) => {
                let (ttft_ms, tpot_ms) = service_times(model, prompt_tokens(kind, &body), running, &[]);
                let a = answer(kind, &body, tokens, ms_to_ns(ttft_ms), ms_to_ns(tpot_ms), None, u64::MAX);
                let after = a.pieces.last().map_or(0, |(t, _)| *t);
                (a.status, a.pieces.into_iter().flat_map(|(_, b)| b).collect(), after)
            }
            None => (404, Vec::new(), 0),
        };
        let timeout = shadow_timeout_ns();
        let (status, bytes, after) = if after > timeout { (0, Vec::new(), timeout) } else { (status, bytes, after) };
        match self.shadows.iter_mut().find(|(t, _, _)| *t == token) {
            Some(s) => (s.1, s.2) = (status, bytes),
            None => self.shadows.push((token, status, bytes)),
        }
        self.schedule(now.saturating_add(after), Event::ShadowAnswer(token));
    }

    // -----------------------------------------------------------------------------------------
    // Output
    // -----------------------------------------------------------------------------------------

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
        let push = |map: &mut VecMap<String, Vec<u64>>, name: &str, value: u64| {
            let v = map.get_or_insert_with(name.to_string(), || vec![0; n]);
            v.resize(n, v.last().copied().unwrap_or(0));
            v.push(value);
        };
        let (guard, budget, store) = self.gateway.shared();
        if let Some(policy) = guard {
            for v in &policy.versions {
                let Some(b) = &v.breaker else { continue };
                let state = breaker::read(store, &v.breaker_key(), &b.config).map(|b| b.state().state.code()).unwrap_or(0);
                series.breakers.get_or_insert_with(v.name.clone(), Vec::new).push(state);
            }
        }
        if let Some(policy) = budget {
            let minute = u32::try_from(at / 60_000_000_000).unwrap_or(u32::MAX);
            // The counters of the keys seen, each once, in index order: marks, not a sort (one sort
            // instance less in the page's .wasm).
            let mut wanted = vec![false; policy.counters.len()];
            for index in self.keys_seen.iter().filter_map(|&k| policy.keys.get(k)).flat_map(|k| k.counters.iter().copied()) {
                if let Some(w) = wanted.get_mut(index) {
                    *w = true;
                }
            }
            for index in wanted.iter().enumerate().filter_map(|(i, &w)| w.then_some(i)) {
                let Some(spec) = policy.counters.get(index).filter(|s| !s.per_identity) else { continue };
                let counter = ledger::read(store, &spec.store_key, spec.window.id(at), minute, policy.reservation_ttl_minutes).unwrap_or_default();
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
        let mut spend: VecMap<String, (u64, u64)> = VecMap::new();
        let mut admitted: VecMap<String, u64> = VecMap::new();
        let mut refused: VecMap<String, u64> = VecMap::new();
        let from_ms = if n == 0 { f64::NEG_INFINITY } else { series.t_ms.get(n - 1).copied().unwrap_or(0.0) };
        let to_ms = at.saturating_sub(self.start_ns) as f64 / 1e6;
        for v in &self.out.verdicts {
            let tenant = v.tenant.clone().unwrap_or_else(|| "anonymous".into());
            let e = spend.get_or_insert_with(tenant, Default::default);
            e.0 += v.charged_micro_usd;
            e.1 += v.charged_input_tokens + v.charged_output_tokens;
        }
        for f in &self.flights {
            let a = f.arrival_ns.saturating_sub(self.start_ns) as f64 / 1e6;
            if !(a > from_ms && a <= to_ms) {
                continue;
            }
            match &f.refused_code {
                Some(code) => *refused.get_or_insert_with(code.clone(), || 0) += 1,
                None => {
                    let v = f.version.clone().or_else(|| f.upstream.clone()).unwrap_or_else(|| "unrouted".into());
                    *admitted.get_or_insert_with(v, || 0) += 1;
                }
            }
        }
        for (tenant, (usd, tokens)) in spend.iter() {
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
            series.admitted_by_version.get_or_insert_with(name, || vec![0; n]).push(count);
        }
        for (code, count) in refused {
            series.refused_by_code.get_or_insert_with(code, || vec![0; n]).push(count);
        }
        for map in [&mut series.admitted_by_version, &mut series.refused_by_code] {
            for v in map.values_mut() {
                v.resize(n + 1, 0);
            }
        }
        for load in &self.loads {
            let queued = load.queue.iter().filter(|&&i| self.flights.get(i).is_some_and(|f| !f.ended && f.service.is_none())).count();
            let busy = u64::from(load.running) + queued as u64;
            let v = series.in_flight.get_or_insert_with(load.name.clone(), || vec![0; n]);
            v.resize(n, 0);
            v.push(busy);
        }
        for v in series.in_flight.values_mut() {
            v.resize(n + 1, 0);
        }
    }

    fn finish_tables(&mut self) {
        self.out.verdicts = crate::by_key(std::mem::take(&mut self.out.verdicts), |v| v.line);
        // By tenant name, kept sorted (a map would be one more map type in the page's .wasm).
        let mut rows: Vec<TenantRow> = Vec::new();
        for v in &self.out.verdicts {
            let name = v.tenant.as_deref().unwrap_or("anonymous");
            let at = match rows.binary_search_by(|r| r.tenant.as_str().cmp(name)) {
                Ok(at) => at,
                Err(at) => {
                    rows.insert(at, TenantRow { tenant: name.to_string(), ..TenantRow::default() });
                    at
                }
            };
            let Some(row) = rows.get_mut(at) else { continue };
            row.requests += 1;
            match v.decision {
                Verdict::Admitted => row.admitted += 1,
                Verdict::Clamped => row.clamped += 1,
                Verdict::Refused => {
                    row.refused += 1;
                    *row.refusals.get_or_insert_with(v.code.clone().unwrap_or_default(), || 0) += 1;
                }
            }
            row.charged_tokens += v.charged_input_tokens + v.charged_output_tokens;
            row.charged_micro_usd += v.charged_micro_usd;
        }
        self.out.tenants = rows;
    }
}

/// The gateway's id of request `id` (its position in the run).
fn gateway_id(id: usize) -> u32 {
    u32::try_from(id).unwrap_or(u32::MAX)
}

/// A text field of a stamp (JSON in filter state).
fn stamp_text(stamp: &[u8], field: &str) -> Option<String> {
    serde_json::from_slice::<Value>(stamp).ok()?.get(field)?.as_str().map(str::to_string)
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
