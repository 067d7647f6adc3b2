//! Shared by the latency-guard tests: the compiled `sluice_latency_guard.wasm`, policies built with
//! `serde_json::json!`, requests as Envoy hands them to the guard (model-router's decision in filter
//! state `sluice_route`, or the model in metadata), and [`Exchange`], which plays one request and its
//! streamed answer on the virtual clock at exact millisecond offsets, taking the parts of the filters
//! around the guard:
//!
//! - **model-router** (behind the guard): writes `sluice_route` after the request headers, before
//!   the body; with [`Route::Router`] it honours the guard's `sluice_latency_avoid` list as the real
//!   router does;
//! - **llm-metrics** (behind the guard): writes `sluice_first_token` = `"0"` at the headers of an
//!   SSE response, and the host time of the first content token when that token arrives (or of the
//!   end of a stream that had none); if the guard holds the stream (filter state
//!   `sluice_latency_release` = `<context id> <queue> <vm id>`) it then enqueues the context id on
//!   the guard's release queue, which wakes the guard at once;
//! - **Envoy**: while the guard holds the response headers, Envoy buffers the body in front of it
//!   (proxy-wasm hosts turn a headers `StopIteration` into `StopAllIterationAndWatermark`, so no body
//!   callback reaches the filter) and hands the buffered bytes over in one piece when the guard
//!   resumes. The harness itself would still call the body callbacks of a filter that paused its
//!   headers, so [`Exchange`] does this buffering.

use std::sync::OnceLock;
use std::time::Duration;

use serde_json::{json, Value};
use sluice_host::{workspace_wasm, Gateway, LocalReply, Plugin, PluginSpec, Stream};

use super::llm::{self, chat};

pub const TENANT_HEADER: &str = "x-sluice-tenant";
/// Filter state the guard writes for model-router.
pub const AVOID: &str = "sluice_latency_avoid";
/// Filter state llm-metrics writes for the guard.
pub const FIRST_TOKEN: &str = "sluice_first_token";
/// Filter state the guard writes on a held stream: `<context id> <queue name> <vm id>`.
pub const RELEASE: &str = "sluice_latency_release";
/// Filter state model-router writes with its decision.
pub const ROUTE: &str = "sluice_route";
/// The guard's access-log stamp.
pub const STAMP: &str = "sluice_latency";
/// Where `json_to_metadata` puts the body's `model`.
pub use sluice_core::contract::MODEL_METADATA;

/// Tenants of the classes of [`policy`]: `crit-*` critical, `std-*` standard, `batch-*` sheddable
/// (and anyone else falls in the built-in class `other`, sheddable).
pub const CRITICAL: &str = "crit-a";
pub const STANDARD: &str = "std-a";
pub const SHEDDABLE: &str = "batch-a";

pub const NS_PER_MS: u64 = 1_000_000;

/// The compiled latency-guard plugin (compiled once per test binary; build it first with
/// `cargo build --release --target wasm32-wasip1 -p sluice-latency-guard`).
pub fn plugin() -> Plugin {
    static PLUGIN: OnceLock<Plugin> = OnceLock::new();
    PLUGIN.get_or_init(|| Plugin::load(workspace_wasm(super::build_stem("sluice_latency_guard"))).expect("the build compiles")).clone()
}

/// A policy with the three classes and versions `v1` (given, as its JSON object without `name`)
/// and `v2` (no limits: the fallback).
pub fn policy(v1: Value) -> Value {
    let mut v1 = v1;
    v1["name"] = json!("v1");
    json!({
        "tenant": {"header": TENANT_HEADER},
        "classes": [
            {"name": "interactive", "priority": "critical", "tenants": ["crit-*"]},
            {"name": "standard", "priority": "standard", "tenants": ["std-*"]},
            {"name": "batch", "priority": "sheddable", "tenants": ["batch-*"]}
        ],
        "versions": [v1, {"name": "v2"}]
    })
}

/// A breaker on the TTFT at p95 ≤ 500 ms over a 60 s window of 6 slots, opening with 5 samples,
/// open 10 s, 10 % hysteresis, probing 50 % of the traffic, deciding after 4 probes, failing over to
/// `v2`; `overrides` replaces any of these fields (`null` removes one).
pub fn breaker(overrides: Value) -> Value {
    let mut b = json!({
        "objective": {"percentile": 95, "ttft_ms": 500},
        "window_s": 60,
        "slots": 6,
        "min_samples": 5,
        "open_for_ms": 10_000,
        "hysteresis_percent": 10,
        "probe_percent": 50,
        "probes": 4,
        "fallback": "v2"
    });
    merge(&mut b, overrides);
    b
}

/// JSON merge patch (RFC 7396): objects merge key by key, `null` removes, anything else replaces.
pub fn merge(target: &mut Value, patch: Value) {
    match patch {
        Value::Object(patch) => {
            if !target.is_object() {
                *target = json!({});
            }
            if let Value::Object(t) = target {
                for (k, v) in patch {
                    if v.is_null() {
                        t.remove(&k);
                    } else {
                        merge(t.entry(k).or_insert(Value::Null), v);
                    }
                }
            }
        }
        other => *target = other,
    }
}

/// A gateway running the guard with `policy` (its clock at 2026-01-01T00:00:00Z).
pub fn gateway(policy: &Value) -> Gateway {
    Gateway::start(&plugin(), spec(&policy.to_string())).unwrap_or_else(|e| panic!("latency-guard refused the policy: {e:#}\npolicy: {policy}"))
}

/// The error a policy is refused with (panics if it is accepted).
pub fn refusal(policy: &str) -> String {
    match Gateway::start(&plugin(), spec(policy)) {
        Ok(_) => panic!("latency-guard accepted {policy}"),
        Err(e) => format!("{e:#}"),
    }
}

/// The guard's probe draw for a request id: FNV-1a 64 of the id, high bits folded down. A half-open
/// breaker admits the request as a probe when `draw % 100 < probe_percent`.
pub fn draw(request_id: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in request_id.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^ (h >> 29)
}

pub fn is_probe(request_id: &str, probe_percent: u64) -> bool {
    draw(request_id) % 100 < probe_percent
}

/// Where a request goes, as the filters between the guard's header and body phases decide it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// model-router decided this version (whatever the guard asked).
    Version(String),
    /// model-router wanted `preferred` and honours the guard's avoid list (`v>fallback` entries).
    Router { preferred: String },
    /// This raw `sluice_route` filter state (any bytes).
    Raw(Vec<u8>),
    /// Neither a router decision nor metadata.
    Nothing,
}

/// One request as the guard receives it.
#[derive(Clone, Debug)]
pub struct Req {
    pub tenant: Option<Vec<u8>>,
    pub request_id: String,
    pub route: Route,
    /// The model json_to_metadata lifted into metadata (read when there is no router decision).
    pub metadata: Option<String>,
    /// Play llm-metrics' part (`sluice_first_token`).
    pub llm_metrics: bool,
    /// llm-metrics wakes the guard through its release queue (else the guard's tick finds the mark).
    pub wake: bool,
    pub path: String,
    pub body: Vec<u8>,
}

impl Req {
    /// A streamed chat request from `tenant`, routed to `version` by model-router.
    pub fn new(tenant: &str, version: &str) -> Self {
        Self {
            tenant: Some(tenant.as_bytes().to_vec()),
            request_id: format!("req-{tenant}-{version}"),
            route: Route::Version(version.into()),
            metadata: None,
            llm_metrics: true,
            wake: true,
            path: chat::PATH.into(),
            body: chat::request(true, true).into_bytes(),
        }
    }
    pub fn id(mut self, request_id: &str) -> Self {
        request_id.clone_into(&mut self.request_id);
        self
    }
    pub fn route(mut self, route: Route) -> Self {
        self.route = route;
        self
    }
    pub fn metadata(mut self, model: &str) -> Self {
        self.metadata = Some(model.into());
        self
    }
    /// model-router prefers `preferred` and honours the avoid list.
    pub fn via_router(self, preferred: &str) -> Self {
        self.route(Route::Router { preferred: preferred.into() })
    }
    pub fn raw_tenant(mut self, tenant: Option<&[u8]>) -> Self {
        self.tenant = tenant.map(<[u8]>::to_vec);
        self
    }
    /// No llm-metrics behind the guard: `sluice_first_token` is never written.
    pub fn without_llm_metrics(mut self) -> Self {
        self.llm_metrics = false;
        self
    }
    /// llm-metrics marks the first token but does not wake the guard (an older llm-metrics, or no
    /// release queue): the guard's tick has to find the mark.
    pub fn without_release_queue(mut self) -> Self {
        self.wake = false;
        self
    }
    /// Another API or body (`path`, request body bytes).
    pub fn api(mut self, path: &str, body: impl Into<Vec<u8>>) -> Self {
        path.clone_into(&mut self.path);
        self.body = body.into();
        self
    }
    /// A chat request for a whole (non-streamed) answer.
    pub fn whole(self) -> Self {
        self.api(chat::PATH, chat::request(false, false))
    }

    /// Request headers as the client sent them (values may be any bytes).
    pub fn headers(&self, body_len: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut h: Vec<(Vec<u8>, Vec<u8>)> = llm::headers(&self.path, &[]).into_iter().map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec())).collect();
        h.push((b"x-request-id".to_vec(), self.request_id.clone().into_bytes()));
        h.push((b"content-length".to_vec(), body_len.to_string().into_bytes()));
        if let Some(t) = &self.tenant {
            h.push((TENANT_HEADER.as_bytes().to_vec(), t.clone()));
        }
        h
    }

    /// Sends the request at the current time (offset 0): headers, the route decision, the body.
    pub fn send<'g>(&self, gw: &'g Gateway) -> Exchange<'g> {
        let start_ns = gw.now_ns();
        let mut stream = gw.stream();
        if let Some(m) = &self.metadata {
            stream.set_property(&MODEL_METADATA, m.as_bytes());
        }
        stream.request_headers(&self.headers(self.body.len()), false).expect("request headers");
        // model-router's header phase, between the guard's headers and body.
        let decided = match &self.route {
            Route::Version(v) => Some(v.clone()),
            Route::Router { preferred } => {
                let avoid = stream.filter_state(AVOID).map(|a| String::from_utf8(a).expect("the avoid list is UTF-8")).unwrap_or_default();
                let fallback = avoid.split(',').find_map(|entry| {
                    let (version, fallback) = entry.split_once('>')?;
                    (version == preferred && !fallback.is_empty()).then(|| fallback.to_string())
                });
                Some(fallback.unwrap_or_else(|| preferred.clone()))
            }
            Route::Raw(raw) => {
                stream.set_property(&[ROUTE], raw.clone());
                None
            }
            Route::Nothing => None,
        };
        if let Some(v) = &decided {
            stream.set_property(&[ROUTE], json!({"version": v, "reason": "weight"}).to_string());
        }
        stream.request_body(&self.body, true).expect("request body");
        Exchange {
            gw,
            stream,
            start_ns,
            version: decided,
            llm_metrics: self.llm_metrics,
            wake: self.wake,
            held: Vec::new(),
            held_end: false,
            upstream: Vec::new(),
        }
    }
}

/// A request with the defaults of [`Req::new`], sent now.
pub fn request<'g>(gw: &'g Gateway, tenant: &str, version: &str) -> Exchange<'g> {
    Req::new(tenant, version).send(gw)
}

/// One request and its answer on a gateway, played at offsets (ms) from the request's start.
pub struct Exchange<'g> {
    pub gw: &'g Gateway,
    pub stream: Stream<'g>,
    pub start_ns: u64,
    /// The version the router decided, if any.
    pub version: Option<String>,
    llm_metrics: bool,
    wake: bool,
    /// Body bytes Envoy holds in front of the guard while it holds the response headers.
    held: Vec<u8>,
    held_end: bool,
    /// Every response body byte the upstream sent, in order.
    pub upstream: Vec<u8>,
}

impl<'g> Exchange<'g> {
    /// Milliseconds since the request started.
    pub fn elapsed_ms(&self) -> u64 {
        (self.gw.now_ns() - self.start_ns) / NS_PER_MS
    }

    /// Moves the clock to `ms` after the request started. While Envoy holds body bytes for the
    /// guard, it moves 1 ms (one tick) at a time and hands them over as soon as the guard resumes.
    pub fn at(&mut self, ms: u64) {
        let target = self.start_ns + ms * NS_PER_MS;
        let now = self.gw.now_ns();
        assert!(target >= now, "time only moves forward: +{ms} ms is in the past");
        loop {
            let now = self.gw.now_ns();
            if now >= target {
                break;
            }
            let step = if self.held.is_empty() && !self.held_end { target - now } else { NS_PER_MS.min(target - now) };
            self.gw.advance(Duration::from_nanos(step)).expect("advance the clock");
            self.pump();
        }
    }

    /// Hands the bytes Envoy held to the guard once it no longer holds the response.
    fn pump(&mut self) {
        if (self.held.is_empty() && !self.held_end) || self.stream.response_paused() || self.stopped() {
            return;
        }
        let bytes = std::mem::take(&mut self.held);
        let end = std::mem::take(&mut self.held_end);
        self.stream.response_body(&bytes, end).expect("response body");
    }

    /// The guard answered locally or reset the stream.
    pub fn stopped(&self) -> bool {
        self.stream.local_reply().is_some() || self.stream.closed_by_plugin()
    }

    /// Response headers `status` / `content-type` at `+ms`; llm-metrics (if present) marks the
    /// stream as waiting for its first token first.
    pub fn response_headers(&mut self, ms: u64, status: &str, content_type: &str) {
        self.at(ms);
        if self.llm_metrics && content_type.to_ascii_lowercase().starts_with("text/event-stream") {
            self.stream.set_property(&[FIRST_TOKEN], "0");
        }
        self.stream.response_headers(&[(":status", status), ("content-type", content_type)], false).expect("response headers");
    }

    /// `200 text/event-stream` at `+ms`.
    pub fn sse_headers(&mut self, ms: u64) {
        self.response_headers(ms, "200", "text/event-stream; charset=utf-8");
    }

    /// Upstream body bytes at `+ms`; `content`: they carry a content token. llm-metrics sees them
    /// first (and marks the first token, or the end of a stream without one); then Envoy holds them
    /// in front of the guard while it holds the headers, or hands them over.
    pub fn chunk(&mut self, ms: u64, bytes: &[u8], content: bool, end: bool) {
        self.at(ms);
        self.upstream.extend_from_slice(bytes);
        let held = self.stream.response_paused();
        if held {
            self.held.extend_from_slice(bytes);
            self.held_end |= end;
        }
        if self.llm_metrics && (content || end) && self.stream.property(&[FIRST_TOKEN]).as_deref() == Some(b"0") {
            self.mark_first_token();
        }
        if held {
            self.pump();
        } else {
            self.stream.response_body(bytes, end).expect("response body");
        }
    }

    /// llm-metrics' mark: the time now in `sluice_first_token`, and the guard woken through the
    /// queue named in `sluice_latency_release`.
    fn mark_first_token(&mut self) {
        let now = self.gw.now_ns().to_string();
        self.stream.set_property(&[FIRST_TOKEN], now);
        if !self.wake {
            return;
        }
        let Some(release) = self.stream.filter_state(RELEASE) else { return };
        let release = String::from_utf8(release).expect("the release property is UTF-8");
        let mut parts = release.splitn(3, ' ');
        let (Some(id), Some(queue), Some(vm_id)) = (parts.next(), parts.next(), parts.next()) else {
            panic!("release property {release:?} is not `<id> <queue> <vm id>`");
        };
        assert_eq!(id, self.stream.id().to_string(), "the release names this stream");
        assert_eq!(vm_id, "sluice_vm", "the release names the guard's VM");
        self.gw.enqueue(queue, id.as_bytes()).expect("the release queue exists");
    }

    /// The role-only chunk at `+ms`.
    pub fn role(&mut self, ms: u64) {
        self.chunk(ms, chat::role().as_bytes(), false, false);
    }

    /// A content chunk at `+ms`.
    pub fn token(&mut self, ms: u64, text: &str) {
        self.chunk(ms, chat::content(text).as_bytes(), true, false);
    }

    /// Finish, usage and `[DONE]` (ending the stream) at `+ms`.
    pub fn finish(&mut self, ms: u64, completion_tokens: u64) {
        self.chunk(ms, chat::finish("stop").as_bytes(), false, false);
        self.chunk(ms, chat::usage(19, completion_tokens).as_bytes(), false, false);
        self.chunk(ms, chat::DONE.as_bytes(), false, true);
    }

    /// The stream's end of life (done, log, delete).
    pub fn end(&mut self) {
        self.stream.end().expect("end of stream");
    }

    pub fn local_reply(&self) -> Option<LocalReply> {
        self.stream.local_reply()
    }

    /// What the client received.
    pub fn downstream_body(&self) -> Vec<u8> {
        self.stream.downstream_body()
    }

    /// The `:status` the client received, if headers reached it.
    pub fn downstream_status(&self) -> Option<String> {
        self.stream.downstream_response_headers().and_then(|h| h.get(":status").map(str::to_string))
    }

    /// The avoid list the guard wrote for model-router, if any.
    pub fn avoid(&self) -> Option<String> {
        self.stream.filter_state(AVOID).map(|a| String::from_utf8(a).expect("the avoid list is UTF-8"))
    }

    /// The access-log stamp, parsed (written at the end of the stream).
    pub fn stamp(&self) -> Option<Value> {
        self.stream.filter_state(STAMP).map(|raw| serde_json::from_slice(&raw).expect("the stamp is JSON"))
    }
}

/// A healthy streamed exchange for `req` whose first content token arrives `ttft_ms` after the
/// request: headers and role chunk at once, tokens at `ttft`, `ttft+5`, `ttft+10`, finish, usage and
/// `[DONE]` at `ttft+12`. Returns the stamp (panics if the guard refused or cut the request).
pub fn stream_ok_req(gw: &Gateway, req: &Req, ttft_ms: u64) -> Value {
    let mut x = req.send(gw);
    assert_eq!(x.local_reply(), None, "the guard refused {req:?}");
    x.sse_headers(0);
    x.role(0);
    x.token(ttft_ms, "Hi");
    x.token(ttft_ms + 5, " there");
    x.token(ttft_ms + 10, "!");
    x.finish(ttft_ms + 12, 3);
    assert!(!x.stopped(), "the guard cut a healthy stream: {:?}", x.local_reply());
    assert_eq!(x.downstream_body(), x.upstream, "a healthy stream reaches the client unchanged");
    x.end();
    x.stamp().expect("the guard stamps every admitted request")
}

/// [`stream_ok_req`] for `tenant` routed to `version`.
pub fn stream_ok(gw: &Gateway, tenant: &str, version: &str, ttft_ms: u64) -> Value {
    stream_ok_req(gw, &Req::new(tenant, version), ttft_ms)
}

/// The parsed JSON body of a local reply.
pub fn reply_json(reply: &LocalReply) -> Value {
    serde_json::from_slice(&reply.body).expect("the reply body is JSON")
}

// ---- metric names ----

pub fn deadline_total(version: &str, kind: &str, action: &str) -> String {
    format!("sluice.latency.deadline_total.version.{version}.kind.{kind}.action.{action}")
}

pub fn shed_total(version: &str, priority: &str, reason: &str) -> String {
    format!("sluice.latency.shed_total.version.{version}.priority.{priority}.reason.{reason}")
}

pub fn requests_total(version: &str, class: &str, outcome: &str) -> String {
    format!("sluice.latency.requests_total.version.{version}.class.{class}.outcome.{outcome}")
}

pub fn transitions(version: &str, to: &str) -> String {
    format!("sluice.latency.breaker_transitions_total.version.{version}.to.{to}")
}

pub fn breaker_state(version: &str) -> String {
    format!("sluice.latency.breaker_state.version.{version}")
}

pub fn in_flight(version: &str) -> String {
    format!("sluice.latency.in_flight.version.{version}")
}

/// The transition log lines (warn) of the breaker of `version`.
pub fn transition_logs(gw: &Gateway, version: &str) -> Vec<String> {
    let prefix = format!("sluice latency-guard: breaker of {version} ");
    gw.logs_at_least(sluice_host::LogLevel::Warn).into_iter().filter(|l| l.starts_with(&prefix)).collect()
}

/// A policy as the build under test reads it ([`super::section_spec`]).
pub fn spec(policy: &str) -> PluginSpec {
    super::section_spec("latency_guard", policy)
}
