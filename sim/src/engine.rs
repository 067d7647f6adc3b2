//! The engine: a trace's requests through the production filter, `sluice.wasm`, in the shipped
//! gateways' shape, on one virtual clock, against the modelled upstream — or through the same flows
//! compiled natively ([`crate::gateway::Host::Native`]).
//!
//! The shape is the shipped one (envoy/templates/full-gateway.yaml): latency-guard's section alone
//! in a filter in front (it holds response headers), then one filter with the scenario's other
//! sections, which read each event once between them.
//!
//! Everything happens in time order: arrivals from the trace (scaled), the upstream's answers
//! (headers, chunks, end), shadow answers, and the plugins' own ticks and callout timeouts (fired
//! by the chain at their exact time). Requests overlap as they would in a gateway, so budgets see
//! reservations in flight, shedding sees in-flight counts and breakers see TTFTs as they happen.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashSet};
use std::hash::BuildHasherDefault;
use std::path::Path;

use anyhow::Result;
use serde_json::Value;
use sluice_core::contract::{MODEL_METADATA, ROUTE_PROPERTY, USER_METADATA};
use sluice_core::flow::guard::STAMP_PROPERTY as GUARD_STAMP;
use sluice_core::metrics::{BUDGET_REMAINING_PREFIX, LATENCY_BREAKER_STATE_PREFIX};
use sluice_host::{Chain, IdHasher, IdMap, LogLevel, Plugin, PluginSpec, StreamId};
use sluice_memory_host::breaker_state;
use sluice_mock_server::api::{Body, Limit, Model};
use sluice_workload::draw::{mix, unit};
use sluice_workload::request::{prompt_text, request_body};
use sluice_workload::upstream::{active_incidents, failure, ms_to_ns, service_times};

use crate::gateway::{Callout, Gateway, Happened, Host, Names};
use crate::scenario::{MaxTokens, PluginKind, Scenario};
use crate::trace::{ApiKind, TraceRequest};
use crate::upstream::{self, Service, VersionLoad};
use crate::verdict::{Decision, Quality, Sample, Stamp, Stamps, Transition, UpstreamPlan, Verdict};

/// What runs the flows: `sluice.wasm` compiled once (every run starts fresh VMs from it), or the
/// flows compiled into the simulator.
pub struct Plugins {
    sluice: Option<Plugin>,
}

impl Plugins {
    /// Compiles `sluice.wasm` found in `dir`.
    pub fn load(dir: &Path) -> Result<Self> {
        Ok(Self { sluice: Some(Plugin::load(dir.join("sluice.wasm"))?) })
    }

    /// The native host: sluice-core's flows as compiled into the simulator; no `.wasm` needed.
    pub fn native() -> Self {
        Self { sluice: None }
    }

    /// Compiles `sluice.wasm` from `dir` for the wasm host; nothing for the native one.
    pub fn for_host(host: Host, dir: &Path) -> Result<Self> {
        match host {
            Host::Wasm => Self::load(dir),
            Host::Native => Ok(Self::native()),
        }
    }

    pub fn host(&self) -> Host {
        if self.sluice.is_some() {
            Host::Wasm
        } else {
            Host::Native
        }
    }
}

/// The scenario's policies as the shipped gateways' filters: latency-guard's section alone, then
/// the others in one filter, in pipeline order; each with its `sluice.wasm` configuration.
fn filters(scenario: &Scenario) -> Vec<Vec<(PluginKind, String)>> {
    let (guard, rest): (Vec<_>, Vec<_>) = scenario.plugins.iter().cloned().partition(|(kind, _)| *kind == PluginKind::LatencyGuard);
    [guard, rest].into_iter().filter(|sections| !sections.is_empty()).collect()
}

/// A filter's `sluice.wasm` configuration: one member per section.
fn filter_config(sections: &[(PluginKind, String)]) -> String {
    let body: Vec<String> = sections.iter().map(|(kind, policy)| format!("\"{}\": {policy}", kind.section())).collect();
    format!("{{{}}}", body.join(", "))
}

/// The wasm host's chain: one `sluice.wasm` filter per entry of `filters`, in one VM group.
fn wasm_chain(sluice: &Plugin, filters: &[Vec<(PluginKind, String)>], options: &RunOptions) -> Result<Chain> {
    let mut specs = Vec::new();
    for sections in filters {
        let guard = sections.iter().any(|(kind, _)| *kind == PluginKind::LatencyGuard);
        // The root ids of the shipped gateways' two filters.
        let name = if guard { "sluice_latency_guard" } else { "sluice" };
        let mut spec = PluginSpec::new(filter_config(sections))
            .name(name)
            .root_id(name)
            .vm_id("sluice")
            .log_level(LogLevel::Info)
            .keep_logs_from(LogLevel::Warn)
            .echo_logs(false)
            .start_time(std::time::UNIX_EPOCH + std::time::Duration::from_nanos(options.start_ns));
        if guard {
            // Breaker transitions, as the state gauge Envoy exports changes.
            spec = spec.watch_gauges(LATENCY_BREAKER_STATE_PREFIX);
        }
        specs.push((sluice, spec));
    }
    Chain::start(&specs).map_err(|e| anyhow::anyhow!("{e:#}"))
}

/// A callout's answer, due at its time.
struct CalloutReply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

/// Options of one run that are not part of the scenario.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Wall-clock time of the trace's first request, ns since the epoch: budgets' calendar windows
    /// (minute, day, month) are counted from it.
    pub start_ns: u64,
}

/// What a run produced besides the verdicts it streamed out.
#[derive(Debug, Default, Clone)]
pub struct RunResult {
    pub requests: u64,
    pub samples: Vec<Sample>,
    /// Virtual time between two of `samples`, ms: the scenario's `sample_every_ms`, or a multiple
    /// of it when a long span coarsened them ([`MAX_SAMPLES`]).
    pub sample_every_ms: u64,
    pub transitions: Vec<Transition>,
    /// Virtual time from the first arrival to the last answer, ms.
    pub span_ms: f64,
    /// Plugin log lines at warning or above (they are worth a look).
    pub warnings: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// The upstream sends response headers (and the preamble) for a request.
    Headers(StreamId),
    /// The upstream sends piece `n` of its answer.
    Piece(StreamId, usize),
    /// Breaker states, in-flight counts and budget gauges are sampled.
    Sample,
    /// A shadow answer arrives for filter `filter`'s callout `token`.
    CalloutReply(usize, u32),
}

struct InFlight {
    request: TraceRequest,
    arrival_ns: u64,
    tenant: Option<String>,
    user: Option<String>,
    output_tokens: u64,
    stream: bool,
    path: String,
    /// Set when the request reached the upstream.
    upstream: Option<Upstreamed>,
    local_reply: Option<(usize, u16)>,
    client_status: u16,
    first_content_ns: Option<u64>,
}

struct Upstreamed {
    name: String,
    /// What the upstream reads of the request body.
    body: Body,
    answer: Option<upstream::Answer>,
    started_ns: u64,
    reached_ns: u64,
    service: Option<Service>,
    /// The answer has ended (or the stream ended first): its batch slot is free.
    released: bool,
}

/// One simulation: a chain of fresh filters and the upstream's state.
pub struct Engine<'a> {
    scenario: &'a Scenario,
    chain: Gateway,
    /// The stamps' keys (and the route header) the policies set.
    names: Names,
    /// The sections of each filter, in filter order.
    kinds: Vec<Vec<PluginKind>>,
    start_ns: u64,
    events: BinaryHeap<Reverse<(u64, u64, Event)>>,
    seq: u64,
    flights: IdMap<StreamId, InFlight>,
    loads: BTreeMap<String, VersionLoad>,
    queued: IdMap<u64, StreamId>,
    next_queue_ticket: u64,
    callouts: HashSet<(usize, u32), BuildHasherDefault<IdHasher>>,
    callout_replies: IdMap<(usize, u32), CalloutReply>,
    filler: String,
    /// The upstream's piece on its way to the gateway.
    piece: Vec<u8>,
    result: RunResult,
    last_event_ns: u64,
}

/// The most samples a run keeps. Past it, every other sample is dropped and the interval doubles,
/// so a report's memory for samples is bounded whatever the trace's virtual span (a day at 1 s
/// would be 86,400 of them); its charts need no more points than this.
pub const MAX_SAMPLES: usize = 4096;

impl<'a> Engine<'a> {
    /// Starts the scenario's plugins (fresh state) at `options.start_ns`, on `plugins`' host.
    pub fn new(scenario: &'a Scenario, plugins: &Plugins, options: &RunOptions) -> Result<Self> {
        let filters = filters(scenario);
        let kinds: Vec<Vec<PluginKind>> = filters.iter().map(|sections| sections.iter().map(|(kind, _)| *kind).collect()).collect();
        let configs: Vec<String> = filters.iter().map(|sections| filter_config(sections)).collect();
        let names = Names::of(&configs)?;
        let chain = match &plugins.sluice {
            Some(sluice) => Gateway::wasm(wasm_chain(sluice, &filters, options)?, names.route_header.clone()),
            None => Gateway::native(&configs, options.start_ns)?,
        };
        let mut engine = Engine {
            scenario,
            chain,
            names,
            kinds,
            start_ns: options.start_ns,
            events: BinaryHeap::new(),
            seq: 0,
            flights: IdMap::default(),
            loads: BTreeMap::new(),
            queued: IdMap::default(),
            next_queue_ticket: 0,
            callouts: HashSet::default(),
            callout_replies: IdMap::default(),
            piece: Vec::new(),
            filler: String::new(),
            result: RunResult { sample_every_ms: scenario.sample_every_ms, ..RunResult::default() },
            last_event_ns: options.start_ns,
        };
        engine.schedule(options.start_ns, Event::Sample);
        Ok(engine)
    }

    /// Takes no samples (breaker states, budgets remaining, in-flight per upstream every
    /// `sample_every_ms`): only the report draws them, and they grow with the trace's virtual span,
    /// not its requests (a day at 1 s is 86,400 of them), so a run without a report keeps its
    /// memory bounded by what is in flight. Verdicts are unchanged: a sample only reads.
    pub fn without_samples(mut self) -> Self {
        self.events.retain(|Reverse((_, _, event))| *event != Event::Sample);
        self
    }

    /// Runs every request of `trace` and hands each verdict to `emit` as its request ends.
    /// `progress` is called now and then with the number of requests started.
    pub fn run(
        mut self,
        trace: impl Iterator<Item = TraceRequest>,
        mut emit: impl FnMut(Verdict) -> Result<()>,
        mut progress: impl FnMut(u64),
    ) -> Result<RunResult> {
        let mut trace = trace.peekable();
        loop {
            let next_arrival = trace.peek().map(|r| self.start_ns + self.scaled(r.arrival_ns));
            let next_event = self.events.peek().map(|Reverse((t, _, _))| *t);
            let busy = !self.flights.is_empty();
            let t = match (next_arrival, next_event) {
                (Some(a), Some(e)) => a.min(e),
                (Some(a), None) => a,
                // Samples keep coming forever; stop once nothing else is left.
                (None, Some(e)) if busy || self.events.iter().any(|Reverse((_, _, ev))| *ev != Event::Sample) => e,
                _ => break,
            };
            self.advance(t)?;
            if next_event == Some(t) && next_arrival.is_none_or(|a| t <= a) {
                if let Some(Reverse((at, _, event))) = self.events.pop() {
                    self.handle(at, event)?;
                }
            } else if let Some(request) = trace.next() {
                self.arrive(request)?;
                self.result.requests += 1;
                if self.result.requests.is_multiple_of(1000) {
                    progress(self.result.requests);
                }
            }
            self.drain(&mut emit)?;
        }
        progress(self.result.requests);
        self.result.span_ms = (self.last_event_ns.saturating_sub(self.start_ns)) as f64 / 1e6;
        self.result.transitions = self.chain.transitions(self.start_ns);
        self.result.warnings = self.chain.warnings();
        Ok(self.result)
    }

    fn scaled(&self, arrival_ns: u64) -> u64 {
        (arrival_ns as f64 * self.scenario.time_scale).round() as u64
    }

    fn schedule(&mut self, at: u64, event: Event) {
        self.seq += 1;
        self.events.push(Reverse((at, self.seq, event)));
    }

    /// Moves the chain's clock to `t`, firing the plugins' ticks and timeouts on the way, and
    /// picks up callouts they started.
    fn advance(&mut self, t: u64) -> Result<()> {
        self.chain.advance_to(t)?;
        self.last_event_ns = self.last_event_ns.max(t);
        Ok(())
    }

    fn arrive(&mut self, request: TraceRequest) -> Result<()> {
        let now = self.chain.now_ns();
        let client = client_request(self.scenario, &request, &mut self.filler);
        let mut metadata: Vec<(&[&str], &[u8])> = vec![(&MODEL_METADATA, client.model.as_bytes())];
        if let Some(user) = &client.user {
            metadata.push((&USER_METADATA, user.as_bytes()));
        }
        let id = self.chain.request(client.headers, &metadata, client.body)?;
        self.flights.insert(
            id,
            InFlight {
                request,
                arrival_ns: now,
                tenant: client.tenant,
                user: client.user,
                output_tokens: client.output_tokens,
                stream: client.stream,
                path: client.path,
                upstream: None,
                local_reply: None,
                client_status: 0,
                first_content_ns: None,
            },
        );
        // The request may have ended within the call (a refusal): its end waits in the events,
        // handled once the flight is recorded.
        Ok(())
    }

    /// Handles what reached the upstream and the client, new callouts, and ended streams.
    fn drain(&mut self, emit: &mut impl FnMut(Verdict) -> Result<()>) -> Result<()> {
        loop {
            let events = self.chain.take_happened();
            if events.is_empty() {
                break;
            }
            for event in events {
                match event {
                    Happened::Upstream { stream, route, body } => self.reach_upstream(stream, route, &body),
                    Happened::LocalReply { stream, filter, status } => {
                        if let Some(f) = self.flights.get_mut(&stream) {
                            f.local_reply = Some((filter, status));
                        }
                    }
                    Happened::ClientStatus { stream, status } => {
                        if let Some(f) = self.flights.get_mut(&stream) {
                            f.client_status = status;
                        }
                    }
                    Happened::Ended { stream, properties } => {
                        if let Some(flight) = self.flights.remove(&stream) {
                            self.release_slot(&flight);
                            let verdict = self.verdict(flight, &properties);
                            emit(verdict)?;
                        }
                    }
                }
            }
        }
        self.pick_up_callouts();
        Ok(())
    }

    fn reach_upstream(&mut self, stream: StreamId, route_header: Option<String>, body: &[u8]) {
        let now = self.chain.now_ns();
        let Some(flight) = self.flights.get_mut(&stream) else { return };
        let body = Body::parse(upstream::api_of(&flight.path), body);
        // The upstream a request reaches: the route model-router wrote, else its model.
        let model = match &body.model {
            Model::Name(m) => Some(m.clone()),
            Model::Unset | Model::Invalid => None,
        };
        let name = route_header.or(model).unwrap_or_else(|| "default".into());
        flight.upstream = Some(Upstreamed { name: name.clone(), body, answer: None, started_ns: now, reached_ns: now, service: None, released: true });
        let load = self.loads.entry(name.clone()).or_default();
        let max_batch = self.scenario.upstream(&name).max_batch;
        if load.running < max_batch {
            self.start_service(stream);
        } else {
            self.next_queue_ticket += 1;
            load.queue.push_back(self.next_queue_ticket);
            self.queued.insert(self.next_queue_ticket, stream);
        }
    }

    /// The request starts being served: its service times are fixed by the batch it joins.
    fn start_service(&mut self, stream: StreamId) {
        let now = self.chain.now_ns();
        let offset_s = now.saturating_sub(self.start_ns) as f64 / 1e9;
        let Some(flight) = self.flights.get_mut(&stream) else { return };
        let Some(up) = flight.upstream.as_mut() else { return };
        let model = self.scenario.upstream(&up.name);
        let incidents = active_incidents(&self.scenario.incidents, &up.name, offset_s);
        let load = self.loads.entry(up.name.clone()).or_default();
        let fail = failure(model, &incidents, self.scenario.seed, flight.request.line);
        let prompt_tokens = flight.request.prompt_tokens.unwrap_or(0);
        let (mut ttft_ms, mut tpot_ms) = service_times(model, prompt_tokens, load.running, &incidents);
        if self.scenario.whole_milliseconds {
            (ttft_ms, tpot_ms) = (ttft_ms.round(), tpot_ms.round());
        }
        let queue_wait = now.saturating_sub(up.reached_ns);
        // A failure comes back after the fixed part alone (no prefill), once the request is served.
        let ttft_ns = queue_wait + if fail.is_some() { ms_to_ns(model.ttft_base_ms) } else { ms_to_ns(ttft_ms) };
        let service = Service { ttft_ns, itl_ns: ms_to_ns(tpot_ms), tokens: flight.output_tokens, fail, running: load.running + 1 };
        let answer =
            upstream::answer(&flight.path, &up.body, &service, self.scenario.stream_chunk_ms.saturating_mul(1_000_000), self.scenario.tokens_per_event);
        if fail.is_none() {
            load.running += 1;
            up.released = false;
        }
        up.started_ns = now;
        // Headers went out when the request reached the upstream; pieces are timed from then.
        let base = up.reached_ns;
        let pieces: Vec<u64> = answer.pieces.iter().map(|(t, _)| base + *t).collect();
        up.service = Some(service);
        up.answer = Some(answer);
        self.schedule(now, Event::Headers(stream));
        for (n, at) in pieces.into_iter().enumerate() {
            self.schedule(at.max(now), Event::Piece(stream, n));
        }
    }

    fn release_slot(&mut self, flight: &InFlight) {
        let Some(up) = &flight.upstream else { return };
        if up.released {
            return;
        }
        self.free(&up.name.clone());
    }

    fn free(&mut self, name: &str) {
        let next = {
            let Some(load) = self.loads.get_mut(name) else { return };
            load.running = load.running.saturating_sub(1);
            load.queue.pop_front()
        };
        if let Some(ticket) = next {
            if let Some(stream) = self.queued.remove(&ticket) {
                if self.flights.contains_key(&stream) {
                    self.start_service(stream);
                } else {
                    self.free_nothing(name);
                }
            }
        }
    }

    /// A queued request that went away: the slot passes to the next one.
    fn free_nothing(&mut self, name: &str) {
        if let Some(load) = self.loads.get_mut(name) {
            load.running += 1;
        }
        self.free(name);
    }

    fn handle(&mut self, at: u64, event: Event) -> Result<()> {
        match event {
            Event::Sample => {
                self.sample(at);
                self.schedule(at + self.result.sample_every_ms.saturating_mul(1_000_000), Event::Sample);
            }
            Event::Headers(stream) => {
                let Some(answer) = self.flights.get(&stream).and_then(|f| f.upstream.as_ref()).and_then(|u| u.answer.as_ref()) else { return Ok(()) };
                if self.chain.is_open(stream) {
                    self.chain.response_headers(stream, answer.status, &answer.headers)?;
                }
            }
            Event::Piece(stream, n) => {
                let Some(flight) = self.flights.get_mut(&stream) else { return Ok(()) };
                let Some(up) = flight.upstream.as_mut() else { return Ok(()) };
                let Some(answer) = up.answer.as_mut() else { return Ok(()) };
                let last = n + 1 == answer.pieces.len();
                let Some(bytes) = answer.piece(n) else { return Ok(()) };
                // Copied out (the upstream may start the next request's service below): into one
                // buffer, reused piece after piece.
                self.piece.clear();
                self.piece.extend_from_slice(bytes);
                if last {
                    // Sent whole: its memory goes now, not when the request ends.
                    answer.body = Vec::new();
                }
                // A piece reaches the client only while the gateway keeps the stream open: one
                // that latency-guard ended at its deadline (during the ticks `advance` ran up to
                // this piece) gets no first token, whatever the upstream still sends.
                let open = self.chain.is_open(stream);
                if open && flight.first_content_ns.is_none() && n > 0 {
                    flight.first_content_ns = Some(at);
                }
                if last && !up.released {
                    up.released = true;
                    let name = up.name.clone();
                    self.free(&name);
                }
                if open {
                    self.chain.response_body(stream, &self.piece, last)?;
                }
            }
            Event::CalloutReply(filter, token) => {
                if let Some(reply) = self.callout_replies.remove(&(filter, token)) {
                    self.chain.answer_callout(filter, token, reply.status, &reply.headers, reply.body)?;
                }
                self.callouts.remove(&(filter, token));
            }
        }
        Ok(())
    }

    /// Answers the shadow requests the plugins sent (model-router's callouts) from the shadow
    /// upstream's model, as a whole answer after its TTFT and decode time.
    fn pick_up_callouts(&mut self) {
        for call in self.chain.callouts() {
            if !self.callouts.insert((call.filter, call.token)) {
                continue;
            }
            let Callout { filter, token, ref path, .. } = call;
            let now = self.chain.now_ns();
            let body = Body::parse(upstream::api_of(path), &call.body);
            let model = self.scenario.upstream(&call.upstream);
            let prompt = body.prompt_tokens;
            let running = self.loads.get(&call.upstream).map_or(0, |l| l.running);
            let (ttft_ms, tpot_ms) = service_times(model, prompt, running, &[]);
            let max_tokens = match body.max_tokens {
                Limit::Tokens(n) => Some(n),
                Limit::Unset | Limit::Invalid => None,
            };
            let tokens = max_tokens.unwrap_or(self.scenario.traffic.output_tokens).min(self.scenario.traffic.output_tokens);
            let service = Service { ttft_ns: ms_to_ns(ttft_ms), itl_ns: ms_to_ns(tpot_ms), tokens, fail: None, running: running + 1 };
            let answer = upstream::answer(path, &body, &service, u64::MAX, self.scenario.tokens_per_event);
            let end = answer.pieces.last().map_or(0, |(t, _)| *t);
            self.callout_replies.insert((filter, token), CalloutReply { status: answer.status, headers: answer.headers, body: answer.body });
            self.schedule(now + end, Event::CalloutReply(filter, token));
        }
    }

    fn sample(&mut self, at: u64) {
        let t_ms = at.saturating_sub(self.start_ns) as f64 / 1e6;
        let mut sample = Sample { t_ms, breakers: Vec::new(), in_flight: Vec::new(), budgets_remaining: Vec::new() };
        let has = |kind: PluginKind| self.kinds.iter().flatten().any(|k| *k == kind);
        if has(PluginKind::LatencyGuard) {
            for (name, value) in self.chain.gauges(LATENCY_BREAKER_STATE_PREFIX) {
                let Some(version) = name.strip_prefix(LATENCY_BREAKER_STATE_PREFIX) else { continue };
                let state = breaker_state(value).unwrap_or("closed");
                sample.breakers.push((version.to_string(), state.to_string()));
            }
        }
        if has(PluginKind::TenantBudget) {
            for (name, value) in self.chain.gauges(BUDGET_REMAINING_PREFIX) {
                if let Some(code) = name.strip_prefix(BUDGET_REMAINING_PREFIX) {
                    sample.budgets_remaining.push((code.to_string(), value));
                }
            }
        }
        for (name, load) in &self.loads {
            sample.in_flight.push((name.clone(), load.running + u32::try_from(load.queue.len()).unwrap_or(u32::MAX)));
        }
        self.result.samples.push(sample);
        if self.result.samples.len() > MAX_SAMPLES {
            // MAX_SAMPLES is even: the sample just taken (an even index) stays, the spacing doubles.
            let mut index = 0usize;
            self.result.samples.retain(|_| {
                let keep = index.is_multiple_of(2);
                index += 1;
                keep
            });
            self.result.sample_every_ms = self.result.sample_every_ms.saturating_mul(2);
        }
    }

    fn verdict(&self, flight: InFlight, properties: &[(String, Vec<u8>)]) -> Verdict {
        // Each stamp checked and read once, for the members a verdict takes from it.
        fn read<const N: usize>(properties: &[(String, Vec<u8>)], name: &str, keys: [&str; N]) -> (Option<Stamp>, [Option<Value>; N]) {
            let bytes = properties.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_slice());
            match bytes.and_then(|b| Stamp::parse_reading(b, keys)) {
                Some((stamp, members)) => (Some(stamp), members),
                None => (None, std::array::from_fn(|_| None)),
            }
        }
        let now = self.chain.now_ns();
        let refused_by = flight.local_reply.and_then(|(filter, status)| {
            // Of a filter's sections only tenant-budget answers requests itself (latency-guard
            // has a filter of its own).
            let kinds = self.kinds.get(filter)?;
            let kind = kinds.iter().find(|k| **k == PluginKind::TenantBudget).or_else(|| kinds.first())?;
            // A guard's 504 is a deadline, not a refusal.
            (status != 504).then_some(*kind)
        });
        let (budget, [reject_code, budget_decision, budget_key]) = read(properties, &self.names.budget_stamp, ["reject_code", "decision", "key"]);
        let (route, [route_version, route_reason, route_shadow]) = read(properties, ROUTE_PROPERTY, ["version", "reason", "shadow"]);
        let (latency, [latency_outcome]) = read(properties, GUARD_STAMP, ["outcome"]);
        let (
            sluice,
            [stamp_status, stamp_outcome, ttft_us, tpot_us, duration_us, input_tokens, output_tokens, cost_micro_usd, ctx, turn, model_version, finish_reason, content_chunks, repetition_per_mille],
        ) = read(
            properties,
            &self.names.metrics_stamp,
            [
                "status",
                "outcome",
                "ttft_us",
                "tpot_us",
                "duration_us",
                "input_tokens",
                "output_tokens",
                "cost_micro_usd",
                "ctx",
                "turn",
                "model_version",
                "finish_reason",
                "content_chunks",
                "repetition_per_mille",
            ],
        );
        let stamps = Stamps { sluice, budget, route, latency };
        let num = |v: &Option<Value>| v.as_ref().and_then(Value::as_u64);
        fn str_of(v: &Option<Value>) -> Option<&str> {
            v.as_ref().and_then(Value::as_str)
        }
        // A member's string taken out of it, not copied: a verdict reads each once.
        let text = |v: Option<Value>| match v {
            Some(Value::String(s)) => Some(s),
            _ => None,
        };
        // What llm-metrics' quality series count, judged from its stamp's fields (before the
        // verdict takes the strings it borrows).
        let quality = str_of(&model_version).zip(num(&stamp_status)).zip(str_of(&stamp_outcome)).and_then(|((model_version, status), outcome)| {
            Quality::judge(
                model_version,
                status,
                outcome,
                num(&output_tokens).unwrap_or(0),
                str_of(&finish_reason),
                num(&content_chunks),
                num(&repetition_per_mille),
            )
        });
        let code = match refused_by {
            Some(PluginKind::TenantBudget) => text(reject_code),
            Some(PluginKind::LatencyGuard) => text(latency_outcome),
            _ => None,
        };
        let clamped = str_of(&budget_decision) == Some("clamped");
        let decision = if refused_by.is_some() {
            Decision::Refused
        } else if clamped {
            Decision::Clamped
        } else {
            Decision::Admitted
        };
        let llm = stamps.sluice.is_some();
        let up = flight.upstream.as_ref();
        let service = up.and_then(|u| u.service.as_ref());
        let version = text(route_version).or_else(|| text(model_version)).or_else(|| up.map(|u| u.name.clone()));
        let status = num(&stamp_status).map(|s| u16::try_from(s).unwrap_or(0)).unwrap_or(flight.local_reply.map_or(flight.client_status, |(_, s)| s));
        let outcome = text(stamp_outcome).unwrap_or_else(|| {
            match (refused_by, flight.local_reply) {
                (Some(_), _) => "refused",
                (None, Some(_)) => "deadline",
                _ if status >= 400 || status == 0 => "upstream_error",
                _ => "completed",
            }
            .to_string()
        });
        let ttft_ms = num(&ttft_us)
            .map(|us| us as f64 / 1000.0)
            .or_else(|| flight.first_content_ns.filter(|_| flight.stream).map(|t| t.saturating_sub(flight.arrival_ns) as f64 / 1e6));
        // llm-metrics' figure when it measured the request (null for a whole answer, as in Envoy's
        // log); the modelled one only when llm-metrics is not in the chain.
        let tpot_ms = match llm {
            true => num(&tpot_us).map(|us| us as f64 / 1000.0),
            false => service.filter(|s| s.tokens > 1 && s.fail.is_none() && flight.stream).map(|s| s.itl_ns as f64 / 1e6),
        };
        let duration_ms = num(&duration_us).map_or_else(|| now.saturating_sub(flight.arrival_ns) as f64 / 1e6, |us| us as f64 / 1000.0);
        let prompt = flight.request.prompt_tokens.unwrap_or(0);
        Verdict {
            line: flight.request.line,
            arrival_ms: flight.arrival_ns.saturating_sub(self.start_ns) as f64 / 1e6,
            tenant: flight.tenant,
            key: text(budget_key).or(flight.request.key),
            user: flight.user,
            api: flight.request.api.as_str().to_string(),
            model: flight.request.model.or_else(|| Some(self.scenario.traffic.model.clone())),
            prompt_tokens: prompt,
            stream: flight.stream,
            decision,
            status,
            code,
            refused_by: refused_by.map(|k| k.name().to_string()),
            outcome,
            version,
            route_reason: text(route_reason),
            shadow_version: route_shadow
                .as_ref()
                .and_then(|s| s.as_str().map(str::to_string).or_else(|| s.get("version").and_then(Value::as_str).map(str::to_string))),
            ttft_ms,
            tpot_ms,
            duration_ms,
            input_tokens: num(&input_tokens).unwrap_or(if up.is_some() { prompt } else { 0 }),
            output_tokens: num(&output_tokens).unwrap_or_else(|| service.filter(|s| s.fail.is_none()).map_or(0, |s| s.tokens)),
            cost_usd: num(&cost_micro_usd).map(|m| m as f64 / 1e6),
            ctx: text(ctx),
            turn: text(turn),
            quality,
            upstream_concurrency: service.map(|s| s.running),
            upstream: up.zip(service).map(|(u, s)| UpstreamPlan {
                name: u.name.clone(),
                ttft_ms: s.ttft_ns as f64 / 1e6,
                itl_ms: s.itl_ns as f64 / 1e6,
                tokens: s.tokens,
                fail_status: s.fail,
            }),
            stamps,
        }
    }
}

/// The HTTP request a trace line stands for, as a client sends it to the gateway (the simulator
/// gives it to the first plugin; a replay against real Envoy sends the same bytes).
#[derive(Debug, Clone)]
pub struct ClientRequest {
    pub path: String,
    /// Request headers, pseudo-headers first.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// The model asked for (what `json_to_metadata` lifts into metadata).
    pub model: String,
    pub tenant: Option<String>,
    /// The user (the body's `user`, lifted into metadata too).
    pub user: Option<String>,
    pub stream: bool,
    /// What the upstream will produce for it (the trace's output tokens, else the scenario's).
    pub output_tokens: u64,
}

/// Builds the client request for `request` under `scenario`'s traffic rules (identity, model,
/// stream and output limit when the trace does not say). `filler` is the prompt text reused across
/// requests.
pub fn client_request(scenario: &Scenario, request: &TraceRequest, filler: &mut String) -> ClientRequest {
    let traffic = &scenario.traffic;
    let draw = mix(scenario.seed, request.line);
    let tenant = request.tenant.clone().or_else(|| request.key.clone()).or_else(|| pick_tenant(traffic, draw));
    let user = request.user.clone().or_else(|| tenant.as_ref().map(|t| format!("{t}-u{}", (draw >> 20) % traffic.users_per_tenant)));
    let stream = request.stream.unwrap_or(traffic.stream);
    let output_tokens = request.output_tokens.unwrap_or(traffic.output_tokens);
    let max_tokens = request.max_output_tokens.or(match traffic.max_tokens {
        MaxTokens::None => None,
        MaxTokens::Fixed(n) => Some(n),
        MaxTokens::Output => Some(output_tokens),
    });
    let model = request.model.clone().unwrap_or_else(|| traffic.model.clone());
    let text = prompt_text(filler, request.prompt_tokens.unwrap_or(0));
    let (path, body) = request_body(request.api, &model, text, stream, max_tokens, user.as_deref());
    let mut headers = vec![
        (":method".to_string(), "POST".to_string()),
        (":path".to_string(), path.to_string()),
        (":authority".to_string(), "gateway".to_string()),
        (":scheme".to_string(), "http".to_string()),
        ("content-type".to_string(), "application/json".to_string()),
        ("x-request-id".to_string(), format!("sim-{}", request.line)),
        ("content-length".to_string(), body.len().to_string()),
    ];
    if let Some(tenant) = &tenant {
        headers.push((traffic.tenant_header.clone(), tenant.clone()));
    }
    if request.api == ApiKind::AnthropicMessages {
        headers.push(("anthropic-version".to_string(), "2023-06-01".to_string()));
    }
    ClientRequest { path: path.to_string(), headers, body, model, tenant, user, stream, output_tokens }
}

/// The tenant of a request whose trace line names none: Zipf weights by position, or shares.
fn pick_tenant(traffic: &crate::scenario::Traffic, draw: u64) -> Option<String> {
    if traffic.tenants.is_empty() {
        return None;
    }
    let weights: Vec<f64> = traffic.tenants.iter().enumerate().map(|(i, t)| t.share.unwrap_or_else(|| 1.0 / ((i + 1) as f64).powf(traffic.zipf_s))).collect();
    let total: f64 = weights.iter().sum();
    let mut x = unit(draw) * total;
    for (t, w) in traffic.tenants.iter().zip(&weights) {
        if x < *w {
            return Some(t.name.clone());
        }
        x -= w;
    }
    traffic.tenants.last().map(|t| t.name.clone())
}
