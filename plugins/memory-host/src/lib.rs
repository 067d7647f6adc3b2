//! sluice-memory-host: sluice-core's four flows (`sluice_core::flow`) in the shipped gateways'
//! shape, driven as `plugins/engine`'s adapters drive them in Envoy and as `sluice-host` runs those
//! adapters for the simulator — over a host that holds each request in memory, on a clock its
//! caller drives. The playground's requests pass it, and so do `sluice-sim --host native`'s.
//! Nothing here decides anything: each event goes to the flows in order, their effects are applied
//! to the request, and what the flows wrote (filter state) is what the engine reports.
//!
//! The shape (envoy/templates/full-gateway.yaml, and the simulator's): latency-guard's section alone
//! in a filter in front, then one filter running model-router, tenant-budget and llm-metrics in
//! pipeline order on the request and reversed on the response, each section when its policy is given
//! (llm-metrics' first-token mark is what releases the response headers latency-guard holds, so every
//! shipped gateway has it). What the host does between them is what `sluice-host`'s chain does:
//!
//! - a section that answers the request itself stops it there; its reply passes the response side
//!   of the other filter, then the request ends (every filter's log event, the guard's first);
//! - headers, bodies and filter state are one per request, edited in place by the effects, so a
//!   filter sees what the ones before it left (the route header, the rewritten body, the guard's
//!   avoid list, the gateway's reply mark);
//! - the guard's held response headers hold the body behind them until llm-metrics' mark wakes the
//!   guard (its release queue) or its tick finds the mark;
//! - each filter's tick is a timer as proxy-wasm's: due one period after it is set, then every
//!   period (the guard's follows its `SetTickPeriod` effects; model-router's runs while shadows
//!   wait); shadow callouts are answered by the engine, or time out after [`SHADOW_TIMEOUT`].
//!
//! Shared data (windows, breakers, in-flight counters, budget counters, health marks) is core's
//! [`MemoryStore`]. Gauges keep their last value, as Envoy's do ([`Gateway::gauge`]); breaker
//! transitions are read off latency-guard's state gauge, as the simulator's wasm host reads them.
//! Metric samples other than gauges (counters, histograms) are not kept: no caller reads them.
//! The sections of the back filter share one response observer per request, as in one VM; the
//! guard, in a VM of its own as in the simulator's harness, observes on its own.

use sluice_core::vecmap::VecMap;

use sluice_core::api::ApiKind;
use sluice_core::budget::policy::{LedgerConfig, LedgerMode};
use sluice_core::budget::Policy;
use sluice_core::contract::{GatewayReply, ReleaseAddress, GATEWAY_REPLY_PROPERTY, RELEASE_PROPERTY};
use sluice_core::flow::budget::{next_vm_number, BudgetFlow, BudgetHost, BudgetPolicy};
use sluice_core::flow::guard::{self, GuardFlow, GuardRoot};
use sluice_core::flow::metrics::config::Settings;
use sluice_core::flow::metrics::{MetricsFlow, MetricsPolicy};
use sluice_core::flow::router::{Router, RouterFlow, SHADOW_TICK, SHADOW_TIMEOUT};
use sluice_core::flow::{Dir, Effect, Effects, LogLevel, Verdict, View};
use sluice_core::headers::HeaderPairs;
use sluice_core::latency::breaker::State;
use sluice_core::latency::deadline::IDLE_TICK_NS;
use sluice_core::latency::LatencyPolicy;
use sluice_core::metrics::LATENCY_BREAKER_STATE_PREFIX;
use sluice_core::observation::{Observer, SharedSlot};
use sluice_core::report::Outcome;
use sluice_core::routing::RoutingPolicy;
use sluice_core::store::MemoryStore;

/// The guard's release queue and VM id (named in its hold's filter state; one VM here).
const RELEASE_QUEUE: &str = "sluice_latency_release_1";
const VM_ID: &str = "sluice";

/// A filter of the chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    /// latency-guard's, in front.
    Guard,
    /// The one running model-router, tenant-budget and llm-metrics.
    Sections,
}

/// What reached the upstream, ended, or went out as a shadow, for the engine.
#[derive(Debug)]
pub enum Out {
    /// The whole request, as the last filter let it go: the value of model-router's route header
    /// (its `route_header`, the upstream Envoy's route picks by it) and the body.
    Upstream { id: u32, route: Option<String>, body: Vec<u8> },
    /// The request's life ended in every filter; `state` is its filter state (the stamps).
    Ended { id: u32, end: Ended },
    /// model-router sent a shadow copy: callout `token` to `cluster`.
    Shadow { token: u32, cluster: String, path: String, body: Vec<u8> },
}

#[derive(Debug)]
pub struct Ended {
    pub state: VecMap<String, Vec<u8>>,
    /// The filter that answered the request itself, and the status it answered.
    pub reply: Option<(Filter, u16)>,
    /// The status of the response headers that reached the client.
    pub client_status: u16,
}

/// A root context's tick timer, as proxy-wasm hosts keep it.
#[derive(Debug, Default, Clone, Copy)]
struct Timer {
    period_ns: Option<u64>,
    next_ns: u64,
}

impl Timer {
    /// Ticks every `period_ns` from `now` (0: stops).
    fn set(&mut self, period_ns: u64, now: u64) {
        if period_ns == 0 {
            self.period_ns = None;
        } else {
            self.period_ns = Some(period_ns);
            self.next_ns = now.saturating_add(period_ns);
        }
    }

    fn due(&self) -> Option<u64> {
        self.period_ns.map(|_| self.next_ns)
    }

    fn fired(&mut self, at: u64) {
        if let Some(p) = self.period_ns {
            self.next_ns = at.saturating_add(p);
        }
    }
}

/// A breaker transition: a change of latency-guard's state gauge of one version.
#[derive(Debug, Clone)]
pub struct Transition {
    pub at_ns: u64,
    /// The version's label in the gauge's name.
    pub version: String,
    pub from: &'static str,
    pub to: &'static str,
    pub reason: String,
}

/// A breaker's state by its gauge value (0 closed, 1 open, 2 half-open).
pub fn breaker_state(code: i64) -> Option<&'static str> {
    u8::try_from(code).ok().and_then(State::from_code).map(State::as_str)
}

/// The transition a change of gauge `name` from `before` to `after` is, if `name` is a breaker's
/// state gauge and the state changed: the version's label, from, to.
pub fn breaker_change(name: &str, before: i64, after: i64) -> Option<(&str, &'static str, &'static str)> {
    let version = name.strip_prefix(LATENCY_BREAKER_STATE_PREFIX)?;
    let (from, to) = (breaker_state(before)?, breaker_state(after)?);
    (from != to).then_some((version, from, to))
}

/// What effects reach beyond one request: the guard's tick, gauges, breaker transitions, and log
/// lines at warning or above.
#[derive(Debug, Default)]
struct Sink {
    guard_timer: Timer,
    gauges: VecMap<String, i64>,
    transitions: Vec<Transition>,
    warnings: Vec<String>,
}

impl Sink {
    fn take(&mut self, effect: Effect, now: u64) {
        match effect {
            Effect::SetTickPeriod { ms } => self.guard_timer.set(ms.saturating_mul(1_000_000), now),
            Effect::GaugeSet { name, value } => self.gauge(name, i64::try_from(value).unwrap_or(i64::MAX), now),
            Effect::GaugeAdd { name, delta } => {
                let value = self.gauges.get(&name).copied().unwrap_or(0).saturating_add(delta);
                self.gauge(name, value, now);
            }
            Effect::Log { level: LogLevel::Warn | LogLevel::Error, message } => {
                self.annotate(&message);
                self.warnings.push(message);
            }
            _ => {}
        }
    }

    /// A gauge's new value; a change of a breaker's state gauge is a transition (0 closed, 1 open,
    /// 2 half-open; a gauge never set reads 0, as Envoy's).
    fn gauge(&mut self, name: String, value: i64, now: u64) {
        // One search where the gauge exists (every set but its first).
        let before = self.gauges.get_mut(name.as_str()).map(|v| std::mem::replace(v, value));
        if let Some((version, from, to)) = breaker_change(&name, before.unwrap_or(0), value) {
            self.transitions.push(Transition { at_ns: now, version: version.to_string(), from, to, reason: String::new() });
        }
        if before.is_none() {
            self.gauges.insert(name, value);
        }
    }

    /// The guard's warning that follows a transition's gauge (`… breaker of <version> <from> → <to>:
    /// <reason>`) gives it its reason, for people to read; nothing decides on it.
    fn annotate(&mut self, message: &str) {
        let Some(last) = self.transitions.last_mut().filter(|t| t.reason.is_empty()) else { return };
        let Some((_, reason)) = message.split_once(&format!(" {} → {}: ", last.from, last.to)) else { return };
        last.reason = reason.to_string();
    }

    /// Effects that act on no request (a root's tick, a shadow's answer).
    fn take_all(&mut self, fx: &mut Effects, now: u64) {
        for effect in fx.drain() {
            self.take(effect, now);
        }
    }
}

/// One request as the proxy holds it.
#[derive(Debug, Default)]
struct Data {
    request_headers: Vec<(String, String)>,
    request_body: Vec<u8>,
    /// Attributes set before the first filter (json_to_metadata's), by their fixed paths.
    metadata: Vec<(&'static [&'static str], String)>,
    state: VecMap<String, Vec<u8>>,
    response_headers: Vec<(String, String)>,
    /// The response chunk being passed.
    chunk: Vec<u8>,
    code_details: Option<&'static str>,
    /// The stream's shared response observer: the back filter's sections and the guard in front
    /// read it, as sluice.wasm's two instances in one VM do (the guard announces it at the request).
    slot: SharedSlot,
}

/// The [`View`] a flow reads one request through.
struct StreamView<'a> {
    data: &'a mut Data,
    now: u64,
}

fn view(data: &mut Data, now: u64) -> StreamView<'_> {
    StreamView { data, now }
}

fn find(pairs: &[(String, String)], name: &str) -> Option<String> {
    pairs.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.clone())
}

impl View for StreamView<'_> {
    fn now(&mut self) -> u64 {
        self.now
    }
    fn request_header(&mut self, name: &str) -> Option<String> {
        find(&self.data.request_headers, name)
    }
    fn response_header(&mut self, name: &str) -> Option<String> {
        find(&self.data.response_headers, name)
    }
    fn body(&mut self, dir: Dir, size: usize) -> std::borrow::Cow<'_, [u8]> {
        let body = match dir {
            Dir::Request => &self.data.request_body,
            Dir::Response => &self.data.chunk,
        };
        std::borrow::Cow::Borrowed(body.get(..size.min(body.len())).unwrap_or_default())
    }
    fn property(&mut self, path: &[&str]) -> Option<String> {
        if let [key] = path {
            // Filter state; an empty value reads back as absent, as in Envoy.
            return self.data.state.get(*key).filter(|v| !v.is_empty()).map(|v| String::from_utf8_lossy(v).into_owned());
        }
        if path == ["response", "code_details"] {
            return self.data.code_details.map(str::to_string);
        }
        self.data.metadata.iter().find(|(p, _)| *p == path).map(|(_, v)| v.clone())
    }
    fn gateway_reply(&mut self) -> Option<GatewayReply> {
        self.data.state.get(GATEWAY_REPLY_PROPERTY).and_then(|v| GatewayReply::decode(&String::from_utf8_lossy(v)))
    }
    fn unended_outcome(&mut self) -> Outcome {
        Outcome::of_unended(self.data.code_details.unwrap_or_default(), None)
    }
    fn response_observer(&mut self, kind: ApiKind) -> Observer {
        Observer::join(&self.data.slot, kind)
    }
}

/// A reply a filter gave the request itself.
#[derive(Debug, Clone)]
struct LocalReply {
    filter: Filter,
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

/// A request's place in the chain.
#[derive(Debug, Default)]
struct Ctl {
    data: Data,
    /// The filter that answered the request itself: status, headers, body.
    reply: Option<LocalReply>,
    replied: bool,
    reset: bool,
    /// llm-metrics marked the first token (wake the guard), the guard let the response go.
    woken: bool,
    resume: bool,
    /// The guard holds the response headers; the body behind them waits.
    held: bool,
    held_body: Vec<u8>,
    held_end: bool,
    /// The response's end passed the guard: the request is done.
    done: bool,
    client_status: u16,
}

fn set_header(pairs: &mut Vec<(String, String)>, name: &str, value: Option<String>) {
    pairs.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
    if let Some(v) = value {
        pairs.push((name.to_string(), v));
    }
}

/// Applies what a flow of `filter` pushed to its request, in order.
fn apply(fx: &mut Effects, ctl: &mut Ctl, filter: Filter, sink: &mut Sink, now: u64) {
    for effect in fx.drain() {
        let d = &mut ctl.data;
        match effect {
            Effect::SetState { key, value } => {
                d.state.insert(key, value);
            }
            Effect::SetHeader { dir: Dir::Request, name, value } => set_header(&mut d.request_headers, &name, value),
            Effect::SetHeader { dir: Dir::Response, name, value } => set_header(&mut d.response_headers, &name, value),
            Effect::ReplaceBody { dir: Dir::Request, bytes } => d.request_body = bytes,
            Effect::ReplaceBody { dir: Dir::Response, bytes } => d.chunk = bytes,
            Effect::AppendBody { dir: Dir::Request, bytes } => d.request_body.extend_from_slice(&bytes),
            Effect::AppendBody { dir: Dir::Response, bytes } => d.chunk.extend_from_slice(&bytes),
            Effect::MarkReply(reply) => {
                d.state.insert(GATEWAY_REPLY_PROPERTY.to_string(), reply.encode().into_bytes());
            }
            Effect::LocalReply { status, headers, body } => {
                if ctl.reply.is_none() {
                    ctl.reply = Some(LocalReply { filter, status: u16::try_from(status).unwrap_or(500), headers, body });
                }
            }
            Effect::WakeGuard => ctl.woken = true,
            Effect::ResumeResponse => ctl.resume = true,
            Effect::ResetStream => ctl.reset = true,
            other => sink.take(other, now),
        }
    }
}

/// tenant-budget's host operations: the request body replaced mid-event; no Redis ledger (the
/// playground runs every policy on its local ledger, [`Gateway::new`]).
#[derive(Default)]
struct Host {
    replaced: Option<Vec<u8>>,
}

impl BudgetHost for Host {
    fn ledger_call(&mut self, _ledger: &LedgerConfig, _path: &str, _body: &[u8]) -> Result<u32, String> {
        Err("no ledger service in the playground".into())
    }
    fn replace_request_body(&mut self, _size: usize, bytes: &[u8]) -> bool {
        self.replaced = Some(bytes.to_vec());
        true
    }
}

/// One request's flows.
#[derive(Debug, Default)]
struct Flows {
    guard: Option<GuardFlow>,
    router: Option<RouterFlow>,
    budget: Option<BudgetFlow>,
    metrics: Option<MetricsFlow>,
}

#[derive(Debug, Default)]
struct Stream {
    ctl: Ctl,
    flows: Flows,
}

/// The per-VM parts: each policy's root, shared data, the effects list, the sink.
struct Vm {
    guard: Option<GuardRoot>,
    router: Option<Router>,
    budget: Option<BudgetPolicy>,
    metrics: Option<MetricsPolicy>,
    store: MemoryStore,
    fx: Effects,
    sink: Sink,
}

/// The chain: its VM, its requests, the back filter's tick, what the engine has to pick up.
pub struct Gateway {
    vm: Vm,
    /// Open requests by id. A [`VecMap`] (one B-tree instantiation less in the playground's page);
    /// boxed, so that opening or ending one moves pointers, not streams.
    streams: VecMap<u32, Box<Stream>>,
    /// The back filter's tick (model-router's, while shadows wait to be sent).
    sections_timer: Timer,
    router_armed: bool,
    next_token: u32,
    out: Vec<Out>,
}

impl Gateway {
    /// Configures each policy given at `now`, creating the shared state each creates before
    /// traffic. A Redis-ledger budget runs on its local ledger: one gateway's counters, the same
    /// admission rules (there is no ledger service here).
    pub fn new(guard: Option<LatencyPolicy>, router: Option<RoutingPolicy>, budget: Option<Policy>, metrics: Option<Settings>, now: u64) -> Gateway {
        let mut store = MemoryStore::default();
        let mut sink = Sink::default();
        let guard = guard.map(|p| {
            let _ = guard::ensure_shared_state(&p, &mut store);
            sink.guard_timer.set(IDLE_TICK_NS, now);
            GuardRoot::new(p, Some(RELEASE_QUEUE.to_string()), VM_ID.to_string())
        });
        let budget = budget.map(|mut p| {
            p.ledger.mode = LedgerMode::Local;
            let _ = p.ensure_counters(&mut store);
            let vm_number = next_vm_number(&mut store);
            BudgetPolicy::new(p, "playground", now, vm_number)
        });
        let vm = Vm { guard, router: router.map(Router::new), budget, metrics: metrics.map(MetricsPolicy::new), store, fx: Effects::without_counters(), sink };
        Gateway { vm, streams: VecMap::new(), sections_timer: Timer::default(), router_armed: false, next_token: 0, out: Vec::new() }
    }

    /// The guard and budget policies with the shared data, for the engine's samples.
    pub fn shared(&mut self) -> (Option<&LatencyPolicy>, Option<&Policy>, &mut MemoryStore) {
        (self.vm.guard.as_ref().map(GuardRoot::policy), self.vm.budget.as_ref().map(|b| &b.policy), &mut self.vm.store)
    }

    /// tenant-budget's stamp key (its policy's `filter_state_key`).
    pub fn budget_stamp_key(&self) -> Option<&str> {
        self.vm.budget.as_ref().map(|b| b.policy.filter_state_key.as_str())
    }

    /// The metrics' stamp key (`sluice_llm` by default).
    pub fn metrics_stamp_key(&self) -> Option<&str> {
        self.vm.metrics.as_ref().map(|m| m.settings.filter_state_key.as_str())
    }

    pub fn transitions(&self) -> &[Transition] {
        &self.vm.sink.transitions
    }

    /// Gauge `name`'s value, as Envoy would export it (`None`: never set).
    pub fn gauge(&self, name: &str) -> Option<i64> {
        self.vm.sink.gauges.get(name).copied()
    }

    /// Every gauge set so far, with its value, in name order.
    pub fn gauges(&self) -> impl Iterator<Item = (&str, i64)> {
        self.vm.sink.gauges.iter().map(|(k, v)| (k.as_str(), *v))
    }

    /// The flows' log lines at warning or above, in order.
    pub fn warnings(&self) -> &[String] {
        &self.vm.sink.warnings
    }

    pub fn is_open(&self, id: u32) -> bool {
        self.streams.contains_key(&id)
    }

    pub fn open_streams(&self) -> usize {
        self.streams.len()
    }

    /// Filter state `key` of open request `id`.
    pub fn state(&self, id: u32, key: &str) -> Option<&[u8]> {
        self.streams.get(&id).and_then(|s| s.ctl.data.state.get(key)).map(Vec::as_slice)
    }

    pub fn take_out(&mut self) -> Vec<Out> {
        std::mem::take(&mut self.out)
    }

    /// When the next tick of either filter is due.
    pub fn next_tick(&self) -> Option<u64> {
        [self.vm.sink.guard_timer.due(), self.sections_timer.due()].into_iter().flatten().min()
    }

    // ---------------------------------------------------------------------------------------------
    // The request
    // ---------------------------------------------------------------------------------------------

    /// A client request (headers, then its whole body) through the filters; it reaches the
    /// upstream ([`Out::Upstream`]) unless a filter answers it.
    pub fn request(&mut self, id: u32, now: u64, headers: Vec<(String, String)>, metadata: Vec<(&'static [&'static str], String)>, body: Vec<u8>) {
        let mut stream = Stream::default();
        stream.ctl.data.request_headers = headers;
        stream.ctl.data.metadata = metadata;
        stream.ctl.data.request_body = body;
        let vm = &self.vm;
        stream.flows = Flows {
            guard: vm.guard.as_ref().map(|_| GuardFlow::new(id)),
            router: vm.router.as_ref().map(|_| RouterFlow::new(id)),
            budget: vm.budget.as_ref().map(|_| BudgetFlow::new(id)),
            metrics: vm.metrics.as_ref().map(|_| MetricsFlow::default()),
        };
        self.streams.insert(id, Box::new(stream));
        for body in [false, true] {
            let Some(s) = self.streams.get_mut(&id) else { return };
            self.vm.guard_request(s, now, body);
            let went_on = s.ctl.reply.is_none() && self.sections_request(id, now, body);
            if !went_on {
                self.settle(id, now);
                return;
            }
        }
        if let Some(s) = self.streams.get_mut(&id) {
            let d = &mut s.ctl.data;
            // The body goes upstream and leaves the stream, as in Envoy (no hook after the request's
            // reads it): moved, not copied (a copy of each prompt was a few percent of a replay).
            // Of the headers, what reads the upstream's side needs only the route (a copy of every
            // pair was ≈ 16 allocations a request).
            let route = self.vm.router.as_ref().and_then(|r| find(&d.request_headers, r.policy.route_header()));
            self.out.push(Out::Upstream { id, route, body: std::mem::take(&mut d.request_body) });
        }
    }

    /// The back filter's sections on a request event; whether the event went through them all.
    fn sections_request(&mut self, id: u32, now: u64, body: bool) -> bool {
        let Some(s) = self.streams.get_mut(&id) else { return false };
        let Vm { router, budget, metrics, store, fx, sink, .. } = &mut self.vm;
        let Stream { ctl, flows } = &mut **s;
        if let (Some(r), Some(flow)) = (router.as_mut(), flows.router.as_mut()) {
            let mut v = view(&mut ctl.data, now);
            if !body {
                flow.on_request_headers(r, &mut v, store, false, &mut || now, fx);
            } else if flow.wants_request_body() {
                let (queued, size) = (r.queued(), v.data.request_body.len());
                flow.on_request_body(r, &mut v, size, true, fx);
                // A queued shadow starts the tick if it is stopped.
                if r.queued() > queued && !self.router_armed {
                    self.sections_timer.set(SHADOW_TICK.as_nanos().try_into().unwrap_or(u64::MAX), now);
                    self.router_armed = true;
                }
            }
            apply(fx, ctl, Filter::Sections, sink, now);
        }
        if let (Some(b), Some(flow)) = (budget.as_mut(), flows.budget.as_mut()) {
            let verdict = if !body {
                let headers = HeaderPairs::from_pairs(&ctl.data.request_headers);
                flow.on_request_headers(b, &headers, false, fx)
            } else if flow.is_budgeted() {
                let mut host = Host::default();
                let size = ctl.data.request_body.len();
                let verdict = flow.on_request_body(b, store, &mut host, &mut view(&mut ctl.data, now), size, true, now, fx);
                if let Some(bytes) = host.replaced.take() {
                    ctl.data.request_body = bytes;
                }
                verdict
            } else {
                Verdict::Continue
            };
            apply(fx, ctl, Filter::Sections, sink, now);
            if verdict == Verdict::Pause {
                return false;
            }
        }
        if let (Some(m), Some(flow)) = (metrics.as_mut(), flows.metrics.as_mut()) {
            let mut v = view(&mut ctl.data, now);
            if !body {
                flow.on_request_headers(m, &mut v, now, fx);
            } else if flow.is_measured() {
                let size = v.data.request_body.len();
                flow.on_request_body(m, &mut v, size, true, fx);
            }
            apply(fx, ctl, Filter::Sections, sink, now);
        }
        true
    }

    // ---------------------------------------------------------------------------------------------
    // The response
    // ---------------------------------------------------------------------------------------------

    /// The upstream's response headers.
    pub fn response_headers(&mut self, id: u32, now: u64, status: u16, headers: &[(String, String)]) {
        let Some(s) = self.streams.get_mut(&id) else { return };
        let mut pairs = vec![(":status".to_string(), status.to_string())];
        pairs.extend(headers.iter().cloned());
        s.ctl.data.response_headers = pairs;
        self.vm.sections_response(s, now, None);
        if self.vm.guard_response(s, now, None) == Verdict::Pause {
            s.ctl.held = true;
        } else {
            s.ctl.client_status = status;
        }
        self.settle(id, now);
    }

    /// A piece of the upstream's response body; `end`: its last.
    pub fn response_body(&mut self, id: u32, now: u64, bytes: &[u8], end: bool) {
        let Some(s) = self.streams.get_mut(&id) else { return };
        // Into the stream's chunk buffer, its allocation reused chunk after chunk.
        s.ctl.data.chunk.clear();
        s.ctl.data.chunk.extend_from_slice(bytes);
        self.vm.sections_response(s, now, Some(end));
        if s.ctl.held {
            s.ctl.held_body.extend_from_slice(&s.ctl.data.chunk);
            s.ctl.held_end |= end;
        } else {
            self.vm.guard_response(s, now, Some(end));
            s.ctl.done |= end;
        }
        self.settle(id, now);
    }

    /// What the last events left to do for request `id`: wake the guard, let the held response
    /// go, send a filter's reply, reset, or end the request.
    fn settle(&mut self, id: u32, now: u64) {
        for _ in 0..8 {
            let Some(s) = self.streams.get_mut(&id) else { return };
            if s.ctl.reply.is_some() && !s.ctl.replied {
                self.reply(id, now);
                return;
            }
            if s.ctl.reset {
                s.ctl.data.code_details = Some("wasm_fail_stream");
                self.end(id, now);
                return;
            }
            if std::mem::take(&mut s.ctl.woken) {
                self.vm.release(id, s, now);
                continue;
            }
            if std::mem::take(&mut s.ctl.resume) && s.ctl.held {
                // The held headers go to the client, then the body that waited behind them.
                s.ctl.held = false;
                s.ctl.client_status = find(&s.ctl.data.response_headers, ":status").and_then(|v| v.parse().ok()).unwrap_or(0);
                let end = s.ctl.held_end;
                let body = std::mem::take(&mut s.ctl.held_body);
                if !body.is_empty() || end {
                    s.ctl.data.chunk = body;
                    self.vm.guard_response(s, now, Some(end));
                    s.ctl.done |= end;
                }
                continue;
            }
            if s.ctl.done {
                self.end(id, now);
            }
            return;
        }
    }

    /// A filter answered request `id`: its reply passes the other filter's response side, then
    /// the request ends.
    fn reply(&mut self, id: u32, now: u64) {
        let Some(s) = self.streams.get_mut(&id) else { return };
        s.ctl.replied = true;
        let Some(LocalReply { filter, status, headers, body }) = s.ctl.reply.clone() else { return };
        let mut pairs = vec![(":status".to_string(), status.to_string())];
        pairs.extend(headers);
        let end = if body.is_empty() { None } else { Some(true) };
        let pass = |vm: &mut Vm, s: &mut Stream, other: Filter| {
            s.ctl.data.response_headers = pairs.clone();
            match other {
                Filter::Sections => vm.sections_response(s, now, None),
                Filter::Guard => {
                    vm.guard_response(s, now, None);
                }
            }
            if let Some(end) = end {
                s.ctl.data.chunk = body.clone();
                match other {
                    Filter::Sections => vm.sections_response(s, now, Some(end)),
                    Filter::Guard => {
                        vm.guard_response(s, now, Some(end));
                    }
                }
            }
        };
        if filter != Filter::Sections {
            pass(&mut self.vm, s, Filter::Sections);
        }
        if filter != Filter::Guard {
            pass(&mut self.vm, s, Filter::Guard);
        }
        s.ctl.client_status = status;
        self.end(id, now);
    }

    /// The request's end in every filter (its log event: the guard's filter first, then the
    /// sections in response order); its filter state goes to the engine.
    fn end(&mut self, id: u32, now: u64) {
        let Some(mut s) = self.streams.remove(&id) else { return };
        let Vm { guard, router, budget, metrics, store, fx, sink } = &mut self.vm;
        let Stream { ctl, flows } = &mut *s;
        if let (Some(root), Some(flow)) = (guard.as_mut(), flows.guard.as_mut()) {
            if flow.is_guarded() {
                flow.on_log(root, &mut view(&mut ctl.data, now), store, now, fx);
                apply(fx, ctl, Filter::Guard, sink, now);
            }
        }
        if let (Some(m), Some(flow)) = (metrics.as_mut(), flows.metrics.as_mut()) {
            if flow.is_measured() {
                flow.on_log(m, &mut view(&mut ctl.data, now), fx);
                apply(fx, ctl, Filter::Sections, sink, now);
            }
        }
        if let (Some(b), Some(flow)) = (budget.as_mut(), flows.budget.as_mut()) {
            if flow.is_budgeted() {
                flow.on_log(b, store, &mut view(&mut ctl.data, now), now, fx);
                apply(fx, ctl, Filter::Sections, sink, now);
            }
        }
        if let (Some(r), Some(flow)) = (router.as_mut(), flows.router.as_mut()) {
            if flow.is_routed() {
                flow.on_log(r, &mut view(&mut ctl.data, now), store, &mut || now, fx);
                apply(fx, ctl, Filter::Sections, sink, now);
            }
        }
        let reply = ctl.reply.as_ref().map(|r| (r.filter, r.status));
        let state = std::mem::take(&mut ctl.data.state);
        self.out.push(Out::Ended { id, end: Ended { state, reply, client_status: ctl.client_status } });
    }

    // ---------------------------------------------------------------------------------------------
    // Ticks and callouts
    // ---------------------------------------------------------------------------------------------

    /// Fires the tick due at `now` (the guard's filter first when both are).
    pub fn tick(&mut self, now: u64) {
        if self.vm.sink.guard_timer.due().is_some_and(|d| d <= now) {
            self.vm.sink.guard_timer.fired(now);
            self.guard_tick(now);
        } else if self.sections_timer.due().is_some_and(|d| d <= now) {
            self.sections_timer.fired(now);
            self.sections_tick(now);
        }
    }

    /// latency-guard's root tick: each watched request (released, deadline fired, reset), then
    /// the breakers' sweep and the tick re-timed.
    fn guard_tick(&mut self, now: u64) {
        let Some(ids) = self.vm.guard.as_ref().map(|g| g.due_ids(now)) else { return };
        for id in ids {
            let Vm { guard, store, fx, sink, .. } = &mut self.vm;
            let Some(root) = guard.as_mut() else { return };
            match self.streams.get_mut(&id) {
                Some(s) => {
                    root.on_tick_stream(id, now, &mut |i| i == id, &mut view(&mut s.ctl.data, now), store, fx);
                    apply(fx, &mut s.ctl, Filter::Guard, sink, now);
                }
                None => {
                    root.on_tick_stream(id, now, &mut |_| false, &mut view(&mut Data::default(), now), store, fx);
                    sink.take_all(fx, now);
                }
            }
            self.settle(id, now);
        }
        let Vm { guard, store, fx, sink, .. } = &mut self.vm;
        if let Some(root) = guard.as_mut() {
            root.after_tick(now, store, fx);
            sink.take_all(fx, now);
        }
    }

    /// The back filter's tick: model-router sends every shadow waiting (and stops its tick).
    fn sections_tick(&mut self, now: u64) {
        let Vm { router, fx, sink, .. } = &mut self.vm;
        let Some(r) = router.as_mut() else { return };
        if self.router_armed {
            self.sections_timer.set(0, now);
            self.router_armed = false;
        }
        for job in r.take_queued() {
            self.next_token = self.next_token.wrapping_add(1);
            let token = self.next_token;
            let path = job.headers.iter().find(|(k, _)| k == ":path").map(|(_, v)| v.clone()).unwrap_or_default();
            self.out.push(Out::Shadow { token, cluster: job.cluster.clone(), path, body: job.body.clone() });
            r.shadow_sent(token, job, now, fx);
            sink.take_all(fx, now);
        }
    }

    /// The answer to shadow callout `token` (`status` 0: it timed out).
    pub fn shadow_answer(&mut self, token: u32, now: u64, status: u16, body: &[u8]) {
        let Vm { router, fx, sink, .. } = &mut self.vm;
        if let Some(r) = router.as_mut() {
            r.on_shadow_answer(token, status, body, now, fx);
            sink.take_all(fx, now);
        }
    }
}

/// How long a shadow callout may take before its answer is no answer.
pub fn shadow_timeout_ns() -> u64 {
    SHADOW_TIMEOUT.as_nanos().try_into().unwrap_or(u64::MAX)
}

impl Vm {
    /// latency-guard's filter on a request event (`body`: the whole body, else the headers).
    fn guard_request(&mut self, s: &mut Stream, now: u64, body: bool) {
        let (Some(root), Some(flow)) = (self.guard.as_mut(), s.flows.guard.as_mut()) else { return };
        let mut v = view(&mut s.ctl.data, now);
        if !body {
            flow.on_request_headers(root, &mut v, &mut self.store, false, now, &mut self.fx);
        } else if flow.is_guarded() {
            let size = v.data.request_body.len();
            flow.on_request_body(root, &mut v, &mut self.store, size, true, now, &mut self.fx);
        }
        apply(&mut self.fx, &mut s.ctl, Filter::Guard, &mut self.sink, now);
    }

    /// latency-guard's filter on the response headers (`end` `None`) or a body chunk.
    fn guard_response(&mut self, s: &mut Stream, now: u64, end: Option<bool>) -> Verdict {
        let (Some(root), Some(flow)) = (self.guard.as_mut(), s.flows.guard.as_mut()) else { return Verdict::Continue };
        if !flow.is_guarded() {
            return Verdict::Continue;
        }
        let mut v = view(&mut s.ctl.data, now);
        let verdict = match end {
            None => flow.on_response_headers(root, &mut v, &mut self.store, false, now, &mut self.fx),
            Some(end) => {
                let size = v.data.chunk.len();
                flow.on_response_body(root, &mut v, &mut self.store, size, end, now, &mut self.fx)
            }
        };
        apply(&mut self.fx, &mut s.ctl, Filter::Guard, &mut self.sink, now);
        verdict
    }

    /// The back filter's sections on the response headers (`end` `None`) or a body chunk, in
    /// response order; each reads the chunk as the one before it left it.
    fn sections_response(&mut self, s: &mut Stream, now: u64, end: Option<bool>) {
        let Stream { ctl, flows } = s;
        if let (Some(m), Some(flow)) = (self.metrics.as_mut(), flows.metrics.as_mut()) {
            if flow.is_measured() {
                let mut v = view(&mut ctl.data, now);
                match end {
                    None => flow.on_response_headers(m, &mut v, false, &mut self.fx),
                    Some(end) => {
                        let size = v.data.chunk.len();
                        flow.on_response_body(m, &mut v, size, end, now, &mut self.fx);
                    }
                }
                apply(&mut self.fx, ctl, Filter::Sections, &mut self.sink, now);
            }
        }
        if let (Some(b), Some(flow)) = (self.budget.as_mut(), flows.budget.as_mut()) {
            if flow.is_budgeted() {
                let mut v = view(&mut ctl.data, now);
                match end {
                    None => flow.on_response_headers(b, &mut v, now, &mut self.fx),
                    Some(end) => {
                        let size = v.data.chunk.len();
                        flow.on_response_body(b, &mut self.store, &mut v, size, end, now, &mut self.fx);
                    }
                }
                apply(&mut self.fx, ctl, Filter::Sections, &mut self.sink, now);
            }
        }
        if let (Some(r), Some(flow)) = (self.router.as_mut(), flows.router.as_mut()) {
            if flow.wants_response() {
                let mut v = view(&mut ctl.data, now);
                match end {
                    None => flow.on_response_headers(r, &mut v, &mut self.fx),
                    Some(end) => {
                        let size = v.data.chunk.len();
                        flow.on_response_body(r, &mut v, size, end, &mut || now, &mut self.fx);
                    }
                }
                apply(&mut self.fx, ctl, Filter::Sections, &mut self.sink, now);
            }
        }
    }

    /// llm-metrics woke the guard: its release queue's item (the request's id in the guard's hold
    /// address) reaches the guard's root.
    fn release(&mut self, id: u32, s: &mut Stream, now: u64) {
        let Some(root) = self.guard.as_mut() else { return };
        let Some(address) = s.ctl.data.state.get(RELEASE_PROPERTY).map(|v| String::from_utf8_lossy(v).into_owned()) else { return };
        let Some(item) = ReleaseAddress::decode(&address).map(|a| a.stream.to_string()) else { return };
        root.on_release(item.as_bytes(), now, &mut |i| i == id, &mut view(&mut s.ctl.data, now), &mut self.store, &mut self.fx);
        apply(&mut self.fx, &mut s.ctl, Filter::Guard, &mut self.sink, now);
    }
}
