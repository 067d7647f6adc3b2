//! The gateway a simulation's requests pass, on either of two hosts of the same flows:
//!
//! - **wasm** (the default): `sluice.wasm` itself, the file Envoy loads, under wasmtime
//!   (`sluice_host::Chain`): the proxy-wasm adapters, the ABI, one VM per filter. What the fidelity
//!   tests hold against real Envoy.
//! - **native**: the same sluice-core flows compiled into the simulator (`sluice_memory_host`, the
//!   playground's host), in the same filter shape and event order, without the VM. Many times
//!   faster; its verdicts are held equal to the wasm host's by `sim/tests/hosts.rs`.
//!
//! Both give the engine the same events in the same order: what reached the upstream, a filter's
//! own reply, the status the client got, the end of a request with its filter state.

use std::collections::BTreeMap;

use anyhow::{anyhow, Result};
use sluice_core::flow::sections::{parse_sections, Policy};
use sluice_host::{Chain, ChainEvent, Headers, HttpReply, StreamId};
use sluice_memory_host::{breaker_change, shadow_timeout_ns, Filter, Out};

use crate::verdict::Transition;

/// Which host runs the flows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Host {
    /// `sluice.wasm` under wasmtime: the file Envoy loads.
    #[default]
    Wasm,
    /// sluice-core's flows compiled into the simulator: the same code, no VM.
    Native,
}

/// What happened at the gateway's edges since the engine last looked.
#[derive(Debug)]
pub enum Happened {
    /// The request reached the upstream: model-router's route header (if any) and the body.
    Upstream { stream: StreamId, route: Option<String>, body: Vec<u8> },
    /// Filter `filter` answered the request itself with `status`.
    LocalReply { stream: StreamId, filter: usize, status: u16 },
    /// The response headers reached the client with `status`.
    ClientStatus { stream: StreamId, status: u16 },
    /// The request's life ended in every filter; its filter state (the stamps).
    Ended { stream: StreamId, properties: Vec<(String, Vec<u8>)> },
}

/// What the engine reads by a name the policies may change: model-router's `route_header` (the
/// header Envoy's route picks the upstream by), and the filter-state keys of llm-metrics' and
/// tenant-budget's stamps (their `filter_state_key`s).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    /// `None` when no filter routes.
    pub route_header: Option<String>,
    pub metrics_stamp: String,
    pub budget_stamp: String,
}

impl Names {
    /// The names `configs` (each filter's `sluice.wasm` configuration) set, by the parser the
    /// filters use; a policy's default where its section is absent (it then writes no stamp).
    pub fn of(configs: &[String]) -> Result<Names> {
        let mut names = Names { route_header: None, metrics_stamp: "sluice_llm".into(), budget_stamp: "sluice_budget".into() };
        for config in configs {
            for policy in parse_sections(config.as_bytes()).map_err(|e| anyhow!("{e}"))? {
                match policy {
                    Policy::ModelRouter(p) => names.route_header = Some(p.route_header().to_string()),
                    Policy::LlmMetrics(p) => names.metrics_stamp = p.settings.filter_state_key,
                    Policy::TenantBudget(p) => names.budget_stamp = p.filter_state_key.clone(),
                    Policy::LatencyGuard(_) => {}
                }
            }
        }
        Ok(names)
    }
}

/// A callout a filter sent (model-router's shadow copies).
#[derive(Debug, Clone)]
pub struct Callout {
    pub filter: usize,
    pub token: u32,
    pub upstream: String,
    pub path: String,
    pub body: Vec<u8>,
}

/// The chain of filters on one of the two hosts.
pub enum Gateway {
    /// The chain, and model-router's route header (its `route_header`) when a filter routes.
    Wasm(Box<Chain>, Option<String>),
    Native(Box<Native>),
}

/// sluice-core's flows over the in-memory host, with the clock, the callouts' timeouts and the
/// filter numbering the wasm chain has.
pub struct Native {
    gateway: sluice_memory_host::Gateway,
    now: u64,
    next_id: u32,
    /// The engine's filter numbers of the guard's filter and of the one with the other sections.
    guard_filter: usize,
    sections_filter: usize,
    /// Shadow callouts in flight, by token: their deadlines.
    callouts: BTreeMap<u32, u64>,
    /// Callouts sent since the engine last looked: handed over once, not copied on every look.
    sent: Vec<Callout>,
    happened: Vec<Happened>,
}

impl Gateway {
    /// The native host for `configs` (each filter's `sluice.wasm` configuration, parsed by the
    /// parser sluice.wasm and the native module use, so a policy is refused in the same words) at
    /// `start_ns`.
    pub fn native(configs: &[String], start_ns: u64) -> Result<Gateway> {
        let (mut guard, mut router, mut budget, mut metrics) = (None, None, None, None);
        let (mut guard_filter, mut sections_filter) = (0, 0);
        for (n, config) in configs.iter().enumerate() {
            for policy in parse_sections(config.as_bytes()).map_err(|e| anyhow!("{e}"))? {
                match policy {
                    Policy::LatencyGuard(p) => {
                        guard_filter = n;
                        guard = Some(*p);
                        continue;
                    }
                    Policy::ModelRouter(p) => router = Some(*p),
                    Policy::TenantBudget(p) => budget = Some(*p),
                    Policy::LlmMetrics(p) => metrics = Some(p.settings),
                }
                sections_filter = n;
            }
        }
        Ok(Gateway::Native(Box::new(Native {
            gateway: sluice_memory_host::Gateway::new(guard, router, budget, metrics, start_ns),
            now: start_ns,
            next_id: 0,
            guard_filter,
            sections_filter,
            callouts: BTreeMap::new(),
            sent: Vec::new(),
            happened: Vec::new(),
        })))
    }

    /// The wasm host: `chain`, whose model-router (if any) routes by `route_header`.
    pub fn wasm(chain: Chain, route_header: Option<String>) -> Gateway {
        Gateway::Wasm(Box::new(chain), route_header)
    }

    pub fn now_ns(&self) -> u64 {
        match self {
            Gateway::Wasm(chain, _) => chain.now_ns(),
            Gateway::Native(n) => n.now,
        }
    }

    /// Moves the clock to `t`, firing the filters' ticks and callout timeouts due on the way.
    pub fn advance_to(&mut self, t: u64) -> Result<()> {
        match self {
            Gateway::Wasm(chain, _) => chain.advance_to(t),
            Gateway::Native(n) => {
                n.advance_to(t);
                Ok(())
            }
        }
    }

    /// A client request, headers then its whole body, with the metadata `json_to_metadata` set.
    pub fn request(&mut self, headers: Vec<(String, String)>, metadata: &[(&'static [&'static str], &[u8])], body: Vec<u8>) -> Result<StreamId> {
        match self {
            Gateway::Wasm(chain, _) => {
                let id = chain.stream(metadata);
                chain.request_headers(id, Headers::from_pairs(&headers), false)?;
                chain.request_body(id, body, true)?;
                Ok(id)
            }
            Gateway::Native(n) => {
                n.next_id = n.next_id.wrapping_add(1);
                let id = n.next_id;
                let metadata = metadata.iter().map(|(path, value)| (*path, String::from_utf8_lossy(value).into_owned())).collect();
                n.gateway.request(id, n.now, headers, metadata, body);
                Ok(StreamId(u64::from(id)))
            }
        }
    }

    pub fn is_open(&self, stream: StreamId) -> bool {
        match self {
            Gateway::Wasm(chain, _) => chain.is_open(stream),
            Gateway::Native(n) => native_id(stream).is_some_and(|id| n.gateway.is_open(id)),
        }
    }

    /// The upstream's response headers.
    pub fn response_headers(&mut self, stream: StreamId, status: u16, headers: &[(String, String)]) -> Result<()> {
        match self {
            Gateway::Wasm(chain, _) => {
                let mut all = vec![(":status".to_string(), status.to_string())];
                all.extend(headers.iter().cloned());
                chain.response_headers(stream, Headers::from_pairs(&all), false)
            }
            Gateway::Native(n) => {
                if let Some(id) = native_id(stream) {
                    n.gateway.response_headers(id, n.now, status, headers);
                }
                Ok(())
            }
        }
    }

    /// A piece of the upstream's response body (`end`: the last).
    pub fn response_body(&mut self, stream: StreamId, bytes: &[u8], end: bool) -> Result<()> {
        match self {
            Gateway::Wasm(chain, _) => chain.response_body(stream, bytes.to_vec(), end),
            Gateway::Native(n) => {
                if let Some(id) = native_id(stream) {
                    n.gateway.response_body(id, n.now, bytes, end);
                }
                Ok(())
            }
        }
    }

    /// What happened since the last call, in order.
    pub fn take_happened(&mut self) -> Vec<Happened> {
        match self {
            Gateway::Wasm(chain, route_header) => chain
                .take_events()
                .into_iter()
                .filter_map(|event| match event {
                    ChainEvent::UpstreamRequest { stream, headers, body } => {
                        Some(Happened::Upstream { stream, route: route_header.as_deref().and_then(|h| headers.get(h)).map(str::to_string), body })
                    }
                    ChainEvent::LocalReply { stream, filter, reply } => {
                        Some(Happened::LocalReply { stream, filter, status: u16::try_from(reply.status).unwrap_or(0) })
                    }
                    ChainEvent::ClientHeaders { stream, status } => Some(Happened::ClientStatus { stream, status: u16::try_from(status).unwrap_or(0) }),
                    ChainEvent::Ended { stream, properties } => Some(Happened::Ended { stream, properties }),
                    ChainEvent::ClientBody { .. } | ChainEvent::Reset { .. } => None,
                })
                .collect(),
            Gateway::Native(n) => {
                n.collect();
                std::mem::take(&mut n.happened)
            }
        }
    }

    /// The callouts waiting for an answer that the engine may not have seen: on the wasm host every
    /// one waiting, on the native host those sent since the last call and still waiting.
    pub fn callouts(&mut self) -> Vec<Callout> {
        match self {
            Gateway::Wasm(chain, _) => chain
                .http_calls()
                .into_iter()
                .map(|(filter, call)| Callout {
                    filter,
                    token: call.token,
                    upstream: call.upstream.clone(),
                    path: call.headers.get(":path").unwrap_or("/v1/chat/completions").to_string(),
                    body: call.body,
                })
                .collect(),
            Gateway::Native(n) => {
                n.collect();
                let mut sent = std::mem::take(&mut n.sent);
                sent.retain(|c| n.callouts.contains_key(&c.token));
                sent
            }
        }
    }

    /// Answers callout `token` of `filter`, if it still waits (it may have timed out).
    pub fn answer_callout(&mut self, filter: usize, token: u32, status: u16, headers: &[(String, String)], body: Vec<u8>) -> Result<()> {
        match self {
            Gateway::Wasm(chain, _) => {
                if !chain.http_calls().iter().any(|(f, c)| *f == filter && c.token == token) {
                    return Ok(());
                }
                let mut reply = Headers::from_pairs(&[(":status", status.to_string())]);
                for (k, v) in headers {
                    reply.add(k.as_bytes(), v.as_bytes());
                }
                chain.respond_http_call(filter, token, HttpReply { headers: reply, body, trailers: Headers::new() })
            }
            Gateway::Native(n) => {
                if n.callouts.remove(&token).is_some() {
                    n.gateway.shadow_answer(token, n.now, status, &body);
                }
                Ok(())
            }
        }
    }

    /// Every gauge whose name starts with `prefix`, with its value, in name order.
    pub fn gauges(&self, prefix: &str) -> Vec<(String, i64)> {
        let mut found: Vec<(String, i64)> = match self {
            Gateway::Wasm(chain, _) => chain
                .gateways()
                .iter()
                .flat_map(|g| g.metric_names().into_iter().filter(|name| name.starts_with(prefix)).filter_map(|name| g.gauge(&name).map(|v| (name, v))))
                .collect(),
            Gateway::Native(n) => n.gateway.gauges().filter(|(name, _)| name.starts_with(prefix)).map(|(k, v)| (k.to_string(), v)).collect(),
        };
        found.sort();
        found
    }

    /// The breakers' transitions so far, ms from `start_ns`.
    pub fn transitions(&self, start_ns: u64) -> Vec<Transition> {
        let t_ms = |at_ns: u64| at_ns.saturating_sub(start_ns) as f64 / 1e6;
        match self {
            Gateway::Wasm(chain, _) => chain
                .gateways()
                .iter()
                .flat_map(|g| g.gauge_changes())
                .filter_map(|c| {
                    let (version, from, to) = breaker_change(&c.name, c.from, c.to)?;
                    Some(Transition { t_ms: t_ms(c.at_ns), version: version.to_string(), from: from.to_string(), to: to.to_string() })
                })
                .collect(),
            Gateway::Native(n) => n
                .gateway
                .transitions()
                .iter()
                .map(|t| Transition { t_ms: t_ms(t.at_ns), version: t.version.clone(), from: t.from.to_string(), to: t.to.to_string() })
                .collect(),
        }
    }

    /// The plugins' log lines at warning or above.
    pub fn warnings(&self) -> Vec<String> {
        match self {
            Gateway::Wasm(chain, _) => chain.gateways().iter().flat_map(|g| g.logs()).map(|line| line.message).collect(),
            Gateway::Native(n) => n.gateway.warnings().to_vec(),
        }
    }
}

fn native_id(stream: StreamId) -> Option<u32> {
    u32::try_from(stream.0).ok()
}

impl Native {
    /// Fires, in time order, every tick and callout timeout due by `t`, then sets the clock to `t`.
    fn advance_to(&mut self, t: u64) {
        loop {
            self.collect();
            let timeout = self.callouts.iter().map(|(token, deadline)| (*deadline, *token)).min();
            let tick = self.gateway.next_tick();
            match (timeout, tick) {
                (Some((deadline, token)), tick) if deadline <= t && tick.is_none_or(|k| deadline < k) => {
                    self.now = self.now.max(deadline);
                    self.callouts.remove(&token);
                    // No answer in time: the callout fails, as Envoy's timeout answers it.
                    self.gateway.shadow_answer(token, self.now, 0, &[]);
                }
                (_, Some(k)) if k <= t => {
                    self.now = self.now.max(k);
                    self.gateway.tick(self.now);
                }
                _ => break,
            }
        }
        self.now = self.now.max(t);
    }

    /// Turns what the host put out into the engine's events and the callouts in flight.
    fn collect(&mut self) {
        for out in self.gateway.take_out() {
            match out {
                Out::Upstream { id, route, body } => {
                    self.happened.push(Happened::Upstream { stream: StreamId(u64::from(id)), route, body });
                }
                Out::Ended { id, end } => {
                    let stream = StreamId(u64::from(id));
                    if let Some((filter, status)) = end.reply {
                        let filter = match filter {
                            Filter::Guard => self.guard_filter,
                            Filter::Sections => self.sections_filter,
                        };
                        self.happened.push(Happened::LocalReply { stream, filter, status });
                    }
                    if end.client_status != 0 {
                        self.happened.push(Happened::ClientStatus { stream, status: end.client_status });
                    }
                    self.happened.push(Happened::Ended { stream, properties: end.state.into_iter().collect() });
                }
                Out::Shadow { token, cluster, path, body } => {
                    let deadline = self.now.saturating_add(shadow_timeout_ns());
                    self.callouts.insert(token, deadline);
                    self.sent.push(Callout { filter: self.sections_filter, token, upstream: cluster, path, body });
                }
            }
        }
    }
}
