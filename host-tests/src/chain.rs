//! A filter chain: several plugin VMs in one Envoy process, in filter order, on one virtual clock.
//!
//! What the VMs share is what Envoy shares between filters and VMs of one process: the clock,
//! shared data, shared queues (a queue registered by one VM is resolved and filled by another with
//! the same `vm_id`), and each stream's filter state. The request passes the filters in order and
//! the response in reverse order; what a filter holds (pauses) reaches the next one when it lets it
//! go, whether from its own callback, a tick, a queue notification or a callout's answer.
//!
//! The end of the chain is the upstream: the request reaches it whole, once every filter has let
//! its end pass (Envoy's `buffer` filter in front of the router does the same in the shipped
//! gateways), and is reported as a [`ChainEvent::UpstreamRequest`]. What reaches the client is
//! reported as [`ChainEvent`]s too. A local reply from a filter passes the response side of every
//! other filter, as Envoy encodes it through the chain; then the stream ends.
//!
//! Not modelled: request and response trailers (a chain stream has none), per-filter failure
//! policies (a trap fails the call), and HTTP/2 flow control.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::OnceLock;

use anyhow::{bail, Context as _, Result};

use crate::abi::property_path;
use crate::gateway::{host_state, Gateway, Plugin, PluginSpec, Process};
use crate::headers::Headers;
use crate::hostcalls::callouts::{HttpCall, HttpReply};
use crate::hostcalls::properties::Properties;
use crate::state::{lock, Deferred, Phase, Shared};
use crate::stream::Stream;
use crate::LocalReply;

/// The full gateway's filters in order, each with the example policy (in `policies/`) it runs
/// with: the plugin's `.wasm` name, the policy file.
pub const FULL_GATEWAY: [(&str, &str); 4] = [
    ("sluice_latency_guard", "latency-guard.demo.json"),
    ("sluice_model_router", "model-router.demo.json"),
    ("sluice_tenant_budget", "tenant-budget.full.json"),
    ("sluice_llm_metrics", "llm-metrics.demo.json"),
];

/// The full gateway as `sluice.wasm` filters ([`Chain::sluice_gateway`]): each filter's name and
/// its sections, with the single-policy build whose example policy each section gets.
pub const SLUICE_GATEWAY: [(&str, &[(&str, &str)]); 2] = [
    ("sluice_latency_guard", &[("latency_guard", "sluice_latency_guard")]),
    ("sluice", &[("model_router", "sluice_model_router"), ("tenant_budget", "sluice_tenant_budget"), ("llm_metrics", "sluice_llm_metrics")]),
];

/// The example policy `file` of `policies/`, as its text.
fn example_policy(file: &str) -> Result<String> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies").join(file);
    std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
}

/// A stream of a [`Chain`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u64);

/// Something that reached the upstream or the client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChainEvent {
    /// The whole request, as the last filter let it go.
    UpstreamRequest { stream: StreamId, headers: Headers, body: Vec<u8> },
    /// Response headers reached the client (`status` from `:status`).
    ClientHeaders { stream: StreamId, status: u32 },
    /// Response body bytes reached the client; `end` once the response is complete.
    ClientBody { stream: StreamId, len: usize, end: bool },
    /// Filter `filter` answered the request itself.
    LocalReply { stream: StreamId, filter: usize, reply: LocalReply },
    /// Filter `filter` reset the stream.
    Reset { stream: StreamId, filter: usize },
    /// The stream's life ended in every filter (done, log, delete): its stamps are final.
    Ended { stream: StreamId, properties: Vec<(String, Vec<u8>)> },
}

/// Where one direction of a stream stands at one filter.
#[derive(Clone, Debug, Default)]
struct Hop {
    /// The filter was given the end of this direction.
    ended_in: bool,
    /// The filter let the end pass to the next one.
    ended_out: bool,
    /// Body that arrived while the filter held its headers: Envoy 1.40 turns a paused header
    /// phase into StopAllIterationAndWatermark and gives the filter this body only once it
    /// resumes (the lone [`Stream`] calls the body callbacks anyway).
    waiting: Vec<u8>,
    /// The end of the direction is among what waits.
    waiting_end: bool,
}

struct Flow {
    contexts: Vec<u32>,
    properties: Shared<Properties>,
    request: Vec<Hop>,
    response: Vec<Hop>,
    upstream_headers: Option<Headers>,
    upstream_body: Vec<u8>,
    upstream_sent: bool,
    client_headers: bool,
    /// A filter replied or reset: the remaining events are the end of life only.
    stopped: bool,
}

/// A map keyed by the host's own small integers (stream, filter and context ids); the simulator's
/// engine keys its streams, queue tickets and callout tokens the same way.
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// One rotate and multiply per word instead of SipHash: the flows are looked up several times per
/// callback, and SipHash was a few per cent of the host's time. The keys are the host's own
/// counters, not anything traffic chooses, so there is no flooding to resist.
#[derive(Clone, Copy, Default)]
pub struct IdHasher(u64);

impl IdHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.add(u64::from(*byte));
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }
}

/// Plugin VMs in filter order behind one virtual clock. See the module docs.
pub struct Chain {
    gateways: Vec<Gateway>,
    process: Process,
    flows: RefCell<IdMap<StreamId, Flow>>,
    /// (filter, context id) → stream, to find the stream a tick or callout touched.
    by_context: RefCell<IdMap<(usize, u32), StreamId>>,
    next_stream: Cell<u64>,
    events: RefCell<VecDeque<ChainEvent>>,
}

impl Chain {
    /// Starts one VM per filter, in order: `_initialize`, root context, vm start, configure, as
    /// [`Gateway::start`] does. The first spec's start time starts the shared clock.
    pub fn start(filters: &[(&Plugin, PluginSpec)]) -> Result<Self> {
        let start_ns = filters.first().map_or(crate::DEFAULT_EPOCH_NS, |(_, spec)| spec.start_ns());
        let mut process = Process::new(start_ns);
        let mut gateways = Vec::with_capacity(filters.len());
        for (i, (plugin, spec)) in filters.iter().enumerate() {
            process.next_vm = u32::try_from(i).unwrap_or(u32::MAX);
            let state = host_state(spec.clone(), Some(&process));
            let gateway = Gateway::start_with(plugin, state).with_context(|| format!("filter {i} ({})", spec.plugin_name()))?;
            gateways.push(gateway);
        }
        let chain =
            Self { gateways, process, flows: RefCell::default(), by_context: RefCell::default(), next_stream: Cell::new(1), events: RefCell::default() };
        chain.settle()?;
        Ok(chain)
    }

    /// The full gateway (`envoy/templates/full-gateway.yaml`): [`FULL_GATEWAY`]'s four plugins,
    /// built by `cargo xtask build`, each with its example policy from `policies/`, in one VM
    /// group (`vm_id` `sluice`, as the guard's release queue needs), warnings and worse kept.
    /// Each `.wasm` is compiled once per process.
    pub fn full_gateway() -> Result<Self> {
        static PLUGINS: OnceLock<Result<Vec<Plugin>, String>> = OnceLock::new();
        let plugins = PLUGINS
            .get_or_init(|| FULL_GATEWAY.iter().map(|(name, _)| Plugin::load(crate::workspace_wasm(name)).map_err(|e| format!("{name}: {e:#}"))).collect())
            .as_ref()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut filters = Vec::with_capacity(FULL_GATEWAY.len());
        for (plugin, (name, policy)) in plugins.iter().zip(FULL_GATEWAY) {
            let config = example_policy(policy)?;
            filters.push((plugin, PluginSpec::new(config).name(name).root_id(name).vm_id("sluice").keep_logs_from(crate::LogLevel::Warn)));
        }
        Self::start(&filters)
    }

    /// The full gateway as two `sluice.wasm` filters: latency-guard's section alone in front (it
    /// holds response headers), then one filter with model-router's, tenant-budget's and
    /// llm-metrics' sections ([`SLUICE_GATEWAY`]), each with [`FULL_GATEWAY`]'s example policy.
    pub fn sluice_gateway() -> Result<Self> {
        static PLUGIN: OnceLock<Result<Plugin, String>> = OnceLock::new();
        let plugin = PLUGIN
            .get_or_init(|| Plugin::load(crate::workspace_wasm("sluice")).map_err(|e| format!("sluice: {e:#}")))
            .as_ref()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut filters = Vec::with_capacity(SLUICE_GATEWAY.len());
        for (name, sections) in SLUICE_GATEWAY {
            let mut config = String::from("{");
            for (i, (section, stem)) in sections.iter().enumerate() {
                let file = FULL_GATEWAY.iter().find(|(s, _)| s == stem).map(|(_, f)| *f).context("a policy of the full gateway")?;
                config.push_str(&format!("{}\"{section}\": {}", if i > 0 { ", " } else { "" }, example_policy(file)?));
            }
            config.push('}');
            filters.push((plugin, PluginSpec::new(config).name(name).root_id(name).vm_id("sluice").keep_logs_from(crate::LogLevel::Warn)));
        }
        Self::start(&filters)
    }

    /// The filters' VMs, in filter order (for their metrics, logs and shared data).
    pub fn gateways(&self) -> &[Gateway] {
        &self.gateways
    }

    /// Virtual time, ns since the Unix epoch.
    pub fn now_ns(&self) -> u64 {
        self.process.clock.now_ns()
    }

    /// The earliest tick or callout timeout any filter waits for.
    pub fn next_due_ns(&self) -> Option<u64> {
        self.gateways.iter().filter_map(|g| g.next_event().map(|(at, _)| at)).min()
    }

    /// Moves the clock to `target_ns` (never back), firing every tick and timeout due on the way
    /// at its exact time, across all filters in time order (ties in filter order).
    pub fn advance_to(&self, target_ns: u64) -> Result<()> {
        loop {
            let next = self
                .gateways
                .iter()
                .enumerate()
                .filter_map(|(i, g)| g.next_event().map(|(at, e)| (at, i, e)))
                .filter(|(at, _, _)| *at <= target_ns)
                .min_by_key(|(at, i, _)| (*at, *i));
            let Some((at, i, event)) = next else { break };
            if let Some(gateway) = self.gateways.get(i) {
                gateway.fire_event(at.max(self.now_ns()), event)?;
            }
            self.settle()?;
        }
        if target_ns > self.now_ns() {
            self.process.clock.set_ns(target_ns);
        }
        Ok(())
    }

    /// What reached the upstream or the client since the last call, in order.
    pub fn take_events(&self) -> Vec<ChainEvent> {
        self.events.borrow_mut().drain(..).collect()
    }

    // ---- streams ----

    /// A new stream; `properties` are attributes or filter state set before the first filter runs
    /// (e.g. the metadata `json_to_metadata` writes).
    pub fn stream(&self, properties: &[(&[&str], &[u8])]) -> StreamId {
        let id = StreamId(self.next_stream.get());
        self.next_stream.set(id.0 + 1);
        let shared = crate::gateway::stream_properties();
        {
            let mut props = lock(&shared);
            for (path, value) in properties {
                props.set(property_path(path), value.to_vec());
            }
        }
        let contexts: Vec<u32> = self.gateways.iter().map(|g| g.stream_sharing(shared.clone())).collect();
        let mut by_context = self.by_context.borrow_mut();
        for (i, ctx) in contexts.iter().enumerate() {
            by_context.insert((i, *ctx), id);
        }
        let n = self.gateways.len();
        self.flows.borrow_mut().insert(
            id,
            Flow {
                contexts,
                properties: shared,
                request: vec![Hop::default(); n],
                response: vec![Hop::default(); n],
                upstream_headers: None,
                upstream_body: Vec::new(),
                upstream_sent: false,
                client_headers: false,
                stopped: false,
            },
        );
        id
    }

    /// The client sends request headers.
    pub fn request_headers(&self, stream: StreamId, headers: Headers, end_of_stream: bool) -> Result<()> {
        self.deliver_request(stream, 0, Some(headers), Vec::new(), end_of_stream)?;
        self.settle()
    }

    /// The client sends a piece of request body.
    pub fn request_body(&self, stream: StreamId, chunk: Vec<u8>, end_of_stream: bool) -> Result<()> {
        self.deliver_request(stream, 0, None, chunk, end_of_stream)?;
        self.settle()
    }

    /// The upstream answers with headers.
    pub fn response_headers(&self, stream: StreamId, headers: Headers, end_of_stream: bool) -> Result<()> {
        let last = self.gateways.len();
        self.deliver_response(stream, last, Some(headers), Vec::new(), end_of_stream)?;
        self.settle()
    }

    /// The upstream sends a piece of response body.
    pub fn response_body(&self, stream: StreamId, chunk: Vec<u8>, end_of_stream: bool) -> Result<()> {
        let last = self.gateways.len();
        self.deliver_response(stream, last, None, chunk, end_of_stream)?;
        self.settle()
    }

    /// The client goes away: every filter sees the end of life, with Envoy's reason in
    /// `response.code_details`.
    pub fn client_reset(&self, stream: StreamId) -> Result<()> {
        self.set_stream_property(stream, &["response", "code_details"], b"downstream_remote_disconnect");
        self.end(stream)?;
        self.settle()
    }

    /// The upstream resets. Before response headers Envoy answers the client with a 503 that
    /// passes every filter; after them the stream just ends.
    pub fn upstream_reset(&self, stream: StreamId) -> Result<()> {
        let started = self.flows.borrow().get(&stream).is_some_and(|f| f.response.last().is_some_and(|h| h.ended_in) || f.client_headers);
        let headers_seen = self.with_filter_stream(stream, self.gateways.len().saturating_sub(1), |s| s.response.headers_seen).unwrap_or(false);
        if !headers_seen && !started {
            let headers = Headers::from_pairs(&[(":status", "503"), ("content-type", "text/plain")]);
            self.response_headers(stream, headers, false)?;
            self.response_body(stream, b"upstream connect error or disconnect/reset before headers. reset reason: remote reset".to_vec(), true)
        } else {
            self.set_stream_property(stream, &["response", "code_details"], b"upstream_reset_after_response_started{remote_reset}");
            self.end(stream)?;
            self.settle()
        }
    }

    /// Whether the stream is still open (its end of life has not run).
    pub fn is_open(&self, stream: StreamId) -> bool {
        self.flows.borrow().contains_key(&stream)
    }

    /// Streams open now.
    pub fn open_streams(&self) -> usize {
        self.flows.borrow().len()
    }

    /// HTTP callouts waiting for an answer, with the filter that made each.
    pub fn http_calls(&self) -> Vec<(usize, HttpCall)> {
        self.gateways.iter().enumerate().flat_map(|(i, g)| g.http_calls().into_iter().map(move |c| (i, c))).collect()
    }

    /// Answers filter `filter`'s callout `token`.
    pub fn respond_http_call(&self, filter: usize, token: u32, reply: HttpReply) -> Result<()> {
        self.gateway(filter)?.respond_http_call(token, reply)?;
        self.settle()
    }

    /// Fails filter `filter`'s callout `token` (a reset or timeout).
    pub fn fail_http_call(&self, filter: usize, token: u32) -> Result<()> {
        self.gateway(filter)?.fail_http_call(token)?;
        self.settle()
    }

    // ---- plumbing ----

    fn gateway(&self, filter: usize) -> Result<&Gateway> {
        self.gateways.get(filter).with_context(|| format!("no filter {filter} in a chain of {}", self.gateways.len()))
    }

    fn context(&self, stream: StreamId, filter: usize) -> Option<u32> {
        self.flows.borrow().get(&stream).and_then(|f| f.contexts.get(filter).copied())
    }

    fn set_stream_property(&self, stream: StreamId, path: &[&str], value: &[u8]) {
        if let Some(flow) = self.flows.borrow().get(&stream) {
            lock(&flow.properties).set(property_path(path), value.to_vec());
        }
    }

    fn with_filter_stream<T>(&self, stream: StreamId, filter: usize, f: impl FnOnce(&mut crate::state::HttpStream) -> T) -> Option<T> {
        let ctx = self.context(stream, filter)?;
        let gateway = self.gateways.get(filter)?;
        let mut runtime = gateway.runtime();
        runtime.state_mut().streams.get_mut(&ctx).map(f)
    }

    /// Gives request data to filter `filter` (or the upstream past the last one), then moves on
    /// whatever it lets pass.
    fn deliver_request(&self, stream: StreamId, filter: usize, headers: Option<Headers>, body: Vec<u8>, end: bool) -> Result<()> {
        if filter >= self.gateways.len() {
            return self.reach_upstream(stream, headers, body, end);
        }
        self.deliver_to(stream, filter, true, headers, body, end)
    }

    /// Gives response data to the filter before `from` (`from` is the filter count for data from
    /// the upstream, which enters at the last filter), or the client past the first one.
    fn deliver_response(&self, stream: StreamId, from: usize, headers: Option<Headers>, body: Vec<u8>, end: bool) -> Result<()> {
        let Some(filter) = from.checked_sub(1) else {
            return self.reach_client(stream, headers, body.len(), end);
        };
        self.deliver_to(stream, filter, false, headers, body, end)
    }

    /// One direction's data into one filter: headers, then body (body that arrives while the
    /// filter holds its headers waits for it), then whatever it lets pass moves on.
    fn deliver_to(&self, stream: StreamId, filter: usize, request: bool, headers: Option<Headers>, body: Vec<u8>, end: bool) -> Result<()> {
        let Some(ctx) = self.context(stream, filter) else { return Ok(()) };
        if headers.is_none() && self.holds_headers(stream, filter, request) {
            self.mark_hop(stream, filter, request, |h| {
                h.waiting.extend_from_slice(&body);
                h.waiting_end |= end;
            });
            return Ok(());
        }
        let mut s = Stream::new(self.gateway(filter)?, ctx);
        let only_headers = end && body.is_empty();
        let had_headers = headers.is_some();
        if let Some(headers) = headers {
            if request {
                s.request_headers_owned(headers, only_headers)?;
            } else {
                s.response_headers_owned(headers, only_headers)?;
            }
        }
        // A body callback for body bytes, or for data without headers (an end among them).
        if !had_headers || !body.is_empty() {
            if request {
                s.request_body(&body, end)?;
            } else {
                s.response_body(&body, end)?;
            }
        }
        if end {
            self.mark_hop(stream, filter, request, |h| h.ended_in = true);
        }
        self.pump(stream)
    }

    fn hop(&self, stream: StreamId, filter: usize, request: bool) -> (bool, bool) {
        self.flows
            .borrow()
            .get(&stream)
            .and_then(|f| if request { f.request.get(filter) } else { f.response.get(filter) }.map(|h| (h.ended_in, h.ended_out)))
            .unwrap_or_default()
    }

    /// Whether the filter paused its header phase and has not resumed.
    fn holds_headers(&self, stream: StreamId, filter: usize, request: bool) -> bool {
        self.with_filter_stream(stream, filter, |s| {
            let d = if request { &s.request } else { &s.response };
            s.phase == Phase::Open && d.headers_seen && d.paused && d.sent_headers.is_none()
        })
        .unwrap_or(false)
    }

    /// Gives a filter that resumed its header phase the body that waited for it.
    fn deliver_waiting(&self, stream: StreamId, filter: usize, request: bool) -> Result<()> {
        if self.holds_headers(stream, filter, request) {
            return Ok(());
        }
        let mut waiting = None;
        self.mark_hop(stream, filter, request, |h| {
            if !h.waiting.is_empty() || h.waiting_end {
                waiting = Some((std::mem::take(&mut h.waiting), std::mem::take(&mut h.waiting_end)));
            }
        });
        let Some((body, end)) = waiting else { return Ok(()) };
        if request {
            self.deliver_request(stream, filter, None, body, end)
        } else {
            self.deliver_response(stream, filter + 1, None, body, end)
        }
    }

    fn mark_hop(&self, stream: StreamId, filter: usize, request: bool, f: impl FnOnce(&mut Hop)) {
        if let Some(flow) = self.flows.borrow_mut().get_mut(&stream) {
            let hops = if request { &mut flow.request } else { &mut flow.response };
            if let Some(hop) = hops.get_mut(filter) {
                f(hop);
            }
        }
    }

    /// Moves on what every filter of `stream` let go: the request forward, the response back; a
    /// filter's local reply or reset ends the stream.
    fn pump(&self, stream: StreamId) -> Result<()> {
        let n = self.gateways.len();
        for filter in 0..n {
            if !self.is_open(stream) || self.stopped(stream) {
                return Ok(());
            }
            if self.check_stop(stream, filter)? {
                return Ok(());
            }
            self.deliver_waiting(stream, filter, true)?;
            let Some((headers, body, end)) = self.drain(stream, filter, true) else { continue };
            self.deliver_request(stream, filter + 1, headers, body, end)?;
        }
        for filter in (0..n).rev() {
            if !self.is_open(stream) || self.stopped(stream) {
                return Ok(());
            }
            if self.check_stop(stream, filter)? {
                return Ok(());
            }
            self.deliver_waiting(stream, filter, false)?;
            let Some((headers, body, end)) = self.drain(stream, filter, false) else { continue };
            self.deliver_response(stream, filter, headers, body, end)?;
        }
        Ok(())
    }

    fn stopped(&self, stream: StreamId) -> bool {
        self.flows.borrow().get(&stream).is_some_and(|f| f.stopped)
    }

    /// What filter `filter` let pass in one direction since the last look: new headers, body, and
    /// whether the end passed. `None` when nothing did.
    fn drain(&self, stream: StreamId, filter: usize, request: bool) -> Option<(Option<Headers>, Vec<u8>, bool)> {
        let (ended_in, ended_out) = self.hop(stream, filter, request);
        let (headers, body, paused) = self.with_filter_stream(stream, filter, |s| {
            let d = if request { &mut s.request } else { &mut s.response };
            let headers = match (&d.sent_headers, d.headers_forwarded) {
                (Some(h), false) => {
                    d.headers_forwarded = true;
                    Some(h.clone())
                }
                _ => None,
            };
            (headers, std::mem::take(&mut d.sent_body), d.paused)
        })?;
        let end = ended_in && !ended_out && !paused;
        if end {
            self.mark_hop(stream, filter, request, |h| h.ended_out = true);
        }
        if headers.is_none() && body.is_empty() && !end {
            return None;
        }
        Some((headers, body, end))
    }

    /// A filter that replied or reset ends the stream: the reply passes the other filters'
    /// response side to the client, then every filter ends. Returns whether it stopped.
    fn check_stop(&self, stream: StreamId, filter: usize) -> Result<bool> {
        let Some((phase, reply, closed)) = self.with_filter_stream(stream, filter, |s| (s.phase, s.local_reply.clone(), s.closed_by_plugin)) else {
            return Ok(false);
        };
        if phase != Phase::Stopped {
            return Ok(false);
        }
        if let Some(flow) = self.flows.borrow_mut().get_mut(&stream) {
            flow.stopped = true;
        }
        if let Some(reply) = reply {
            self.events.borrow_mut().push_back(ChainEvent::LocalReply { stream, filter, reply: reply.clone() });
            let mut headers = Headers::from_pairs(&[(":status", reply.status.to_string())]);
            for (k, v) in reply.headers.iter() {
                headers.add(k, v);
            }
            for other in (0..self.gateways.len()).rev().filter(|i| *i != filter) {
                let Some(ctx) = self.context(stream, other) else { continue };
                let mut s = Stream::new(self.gateway(other)?, ctx);
                s.response_headers_owned(headers.clone(), reply.body.is_empty())?;
                if !reply.body.is_empty() {
                    s.response_body(&reply.body, true)?;
                }
            }
            self.events.borrow_mut().push_back(ChainEvent::ClientHeaders { stream, status: reply.status });
            self.events.borrow_mut().push_back(ChainEvent::ClientBody { stream, len: reply.body.len(), end: true });
        } else if closed {
            self.events.borrow_mut().push_back(ChainEvent::Reset { stream, filter });
            self.set_stream_property(stream, &["response", "code_details"], b"wasm_fail_stream");
        }
        self.end(stream)?;
        Ok(true)
    }

    fn reach_upstream(&self, stream: StreamId, headers: Option<Headers>, body: Vec<u8>, end: bool) -> Result<()> {
        let mut flows = self.flows.borrow_mut();
        let Some(flow) = flows.get_mut(&stream) else { return Ok(()) };
        if let Some(headers) = headers {
            flow.upstream_headers = Some(headers);
        }
        flow.upstream_body.extend_from_slice(&body);
        if end && !flow.upstream_sent {
            flow.upstream_sent = true;
            let Some(headers) = flow.upstream_headers.take() else { bail!("stream {}: request ended upstream without headers", stream.0) };
            let body = std::mem::take(&mut flow.upstream_body);
            drop(flows);
            self.events.borrow_mut().push_back(ChainEvent::UpstreamRequest { stream, headers, body });
        }
        Ok(())
    }

    fn reach_client(&self, stream: StreamId, headers: Option<Headers>, len: usize, end: bool) -> Result<()> {
        if let Some(headers) = headers {
            let status = headers.get(":status").and_then(|s| s.parse().ok()).unwrap_or(0);
            if let Some(flow) = self.flows.borrow_mut().get_mut(&stream) {
                flow.client_headers = true;
            }
            self.events.borrow_mut().push_back(ChainEvent::ClientHeaders { stream, status });
        }
        if len > 0 || end {
            self.events.borrow_mut().push_back(ChainEvent::ClientBody { stream, len, end });
        }
        if end {
            self.end(stream)?;
        }
        Ok(())
    }

    /// The end of the stream's life in every filter (done, log, delete, in filter order); then
    /// the host forgets it.
    fn end(&self, stream: StreamId) -> Result<()> {
        let Some(flow) = self.flows.borrow_mut().remove(&stream) else { return Ok(()) };
        for (i, ctx) in flow.contexts.iter().enumerate() {
            if let Some(gateway) = self.gateways.get(i) {
                Stream::new(gateway, *ctx).end()?;
            }
        }
        let properties = lock(&flow.properties).filter_state();
        let mut by_context = self.by_context.borrow_mut();
        for (i, ctx) in flow.contexts.iter().enumerate() {
            by_context.remove(&(i, *ctx));
            if let Some(gateway) = self.gateways.get(i) {
                gateway.forget_stream(*ctx);
            }
        }
        drop(by_context);
        self.events.borrow_mut().push_back(ChainEvent::Ended { stream, properties });
        Ok(())
    }

    /// Delivers queue notifications to the VMs that own the queues and moves on what ticks,
    /// callouts and notifications let go, until nothing more happens.
    fn settle(&self) -> Result<()> {
        for _ in 0..10_000 {
            let work = lock(&self.process.deferred).pop_front();
            if let Some(Deferred::QueueReady { vm, context_id, queue_id }) = work {
                let gateway = self.gateway(usize::try_from(vm).unwrap_or(usize::MAX))?;
                gateway.queue_ready(context_id, queue_id)?;
            }
            let mut touched = Vec::new();
            for (i, gateway) in self.gateways.iter().enumerate() {
                for ctx in gateway.take_touched() {
                    if let Some(stream) = self.by_context.borrow().get(&(i, ctx)) {
                        touched.push(*stream);
                    }
                }
            }
            if work.is_none() && touched.is_empty() {
                return Ok(());
            }
            touched.dedup();
            for stream in touched {
                self.pump(stream)?;
            }
        }
        bail!("the chain keeps finding more work after 10,000 rounds")
    }
}
