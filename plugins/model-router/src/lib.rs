//! sluice model-router: a proxy-wasm HTTP filter that assigns each LLM request to a version of the
//! model it asks for — sticky per user by consistent hashing, weighted, with ramps, trusted
//! overrides and fallback — and optionally sends a sample to a shadow version whose answer is
//! compared with the primary's and never reaches the client.
//!
//! Envoy routes on headers, before a proxy-wasm filter can see the body, so the requested `model`
//! comes from Envoy's `json_to_metadata` filter placed in front (it holds the headers until it has
//! read `model` from the body). The decision is a request header the route table matches on (Envoy
//! re-selects the route when a filter changes headers); the body's `model` is then rewritten to the
//! version's upstream name. See docs/model-router.md.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};
use sluice_core::api::ApiKind;
use sluice_core::metrics::{self, ShadowPair, ShadowResult, Unrouted};
use sluice_core::report::sanitize_label;
use sluice_core::response::{inspect_response_body, ResponseSummary, StreamObserver};
use sluice_core::rewrite::set_top_level_string;
use sluice_core::routing::similarity::{jaccard_per_mille, response_text};
use sluice_core::routing::{Decision, Reason, RoutingPolicy, ShadowVerdict};
use sluice_core::store::{self, SharedStore};
use sluice_core::timing::StreamTiming;
use sluice_proxy_host as host;
use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::rc::Rc;
use std::time::Duration;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    sluice_proxy_host::install_panic_hook("model-router");
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// Where `json_to_metadata` puts the body's `model` (see envoy/templates/router-gateway.yaml).
const MODEL_METADATA: [&str; 4] = ["metadata", "filter_metadata", "sluice", "model"];
/// Bytes of a streamed primary response kept to compare texts (figures come from the stream itself).
const TEXT_CAPTURE_BYTES: usize = 64 * 1024;
/// Largest whole response body (non-streamed primary, or any shadow answer) read for its figures.
const MAX_WHOLE_BODY_BYTES: usize = 4 * 1024 * 1024;
/// Characters of text compared.
const TEXT_COMPARE_CHARS: usize = 4096;
/// How long a version whose cluster had no healthy upstream is skipped.
const UNHEALTHY_FOR_NS: u64 = 10_000_000_000;
/// Shadow results or primaries waiting for their other half; older ones are dropped.
const MAX_PENDING_COMPARISONS: usize = 1024;
const SHADOW_TIMEOUT: Duration = Duration::from_secs(300);
/// How soon a queued shadow request is sent (from the root context: a stream's callouts die with the
/// stream).
const SHADOW_TICK: Duration = Duration::from_millis(20);
const NS_PER_MS: u64 = 1_000_000;

/// One side of a comparison.
#[derive(Clone, Debug)]
struct Side {
    status: u16,
    duration_ns: u64,
    ttft_ns: Option<u64>,
    output_tokens: u64,
    finish_reason: Option<String>,
    error: bool,
    text: String,
}

struct ShadowJob {
    request_id: String,
    cluster: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    kind: ApiKind,
    primary_version: String,
    shadow_version: String,
}

struct InFlightShadow {
    request_id: String,
    kind: ApiKind,
    started_ns: u64,
    primary_version: String,
    shadow_version: String,
}

#[derive(Default)]
struct Pending {
    primary: Option<Side>,
    shadow: Option<Side>,
    versions: (String, String),
}

struct Shared {
    policy: RoutingPolicy,
    metrics: host::Metrics,
    jobs: Vec<ShadowJob>,
    in_flight: BTreeMap<u32, InFlightShadow>,
    pending: BTreeMap<String, Pending>,
    pending_order: VecDeque<String>,
    /// Whether the root's tick runs: only while shadow requests wait to be sent (an idle tick
    /// every 20 ms cost ≈ 1 % of a core per worker in Envoy, measured with no traffic).
    tick_armed: bool,
}

impl Shared {
    /// Queues a shadow request for the root's next tick, starting the tick if it is stopped.
    fn queue_shadow(&mut self, job: ShadowJob) {
        self.jobs.push(job);
        if !self.tick_armed {
            match proxy_wasm::hostcalls::set_tick_period(SHADOW_TICK) {
                Ok(()) => self.tick_armed = true,
                Err(status) => log::warn!("setting the shadow tick failed: {status:?}"),
            }
        }
    }

    fn count(&mut self, name: &str) {
        self.metrics.add(MetricType::Counter, name, 1);
    }

    /// Stores one side of a comparison; emits the comparison when both sides are in.
    fn offer(&mut self, request_id: &str, versions: (String, String), primary: Option<Side>, shadow: Option<Side>) {
        if !self.pending.contains_key(request_id) {
            while self.pending.len() >= MAX_PENDING_COMPARISONS {
                let Some(old) = self.pending_order.pop_front() else { break };
                self.pending.remove(&old);
            }
            self.pending_order.push_back(request_id.to_string());
        }
        let entry = self.pending.entry(request_id.to_string()).or_default();
        entry.versions = versions;
        if primary.is_some() {
            entry.primary = primary;
        }
        if shadow.is_some() {
            entry.shadow = shadow;
        }
        let complete = entry.primary.is_some() && entry.shadow.is_some();
        if complete {
            if let Some(done) = self.pending.remove(request_id) {
                self.pending_order.retain(|id| id != request_id);
                self.compare(request_id, done);
            }
        }
    }

    fn compare(&mut self, request_id: &str, done: Pending) {
        let (Some(p), Some(s)) = (done.primary, done.shadow) else { return };
        let pair = ShadowPair::new(&sanitize_label(&done.versions.0), &sanitize_label(&done.versions.1));
        for (side, v) in [(metrics::Side::Primary, &p), (metrics::Side::Shadow, &s)] {
            self.metrics.record(&metrics::router_compare_duration_ms(&pair, side), v.duration_ns / NS_PER_MS);
            self.metrics.record(&metrics::router_compare_output_tokens(&pair, side), v.output_tokens);
            if v.error {
                self.count(&metrics::router_compare_errors_total(&pair, side));
            }
        }
        if let Some(ttft) = p.ttft_ns {
            self.metrics.record(&metrics::router_compare_ttft_ms(&pair), ttft / NS_PER_MS);
        }
        let agree = p.finish_reason == s.finish_reason;
        self.count(&metrics::router_compare_total(&pair, agree));
        let similarity = jaccard_per_mille(&p.text, &s.text);
        self.metrics.record(&metrics::router_compare_similarity_per_mille(&pair), similarity);
        let record = serde_json::json!({
            "request_id": request_id,
            "primary": done.versions.0,
            "shadow": done.versions.1,
            "duration_ms": [p.duration_ns / NS_PER_MS, s.duration_ns / NS_PER_MS],
            "ttft_ms": [p.ttft_ns.map(|t| t / NS_PER_MS), serde_json::Value::Null],
            "output_tokens": [p.output_tokens, s.output_tokens],
            "finish": [p.finish_reason, s.finish_reason],
            "status": [p.status, s.status],
            "similarity_per_mille": similarity,
        });
        log::info!("shadow comparison {record}");
    }
}

#[derive(Default)]
struct Root {
    shared: Option<Rc<RefCell<Shared>>>,
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        let Some(shared) = self.shared.clone() else { return };
        let mut sh = shared.borrow_mut();
        let Some(call) = sh.in_flight.remove(&token) else { return };
        let now = host::now_ns();
        let status = host::call_status();
        let body = host::body(BufferType::HttpCallResponseBody, body_size.min(MAX_WHOLE_BODY_BYTES));
        let pair = ShadowPair::new(&sanitize_label(&call.primary_version), &sanitize_label(&call.shadow_version));
        if status == 0 {
            sh.count(&metrics::router_shadow_total(&pair, ShadowResult::Failed));
        }
        let summary = inspect_response_body(call.kind, &body);
        let side = Side {
            status,
            duration_ns: now.saturating_sub(call.started_ns),
            ttft_ns: None,
            output_tokens: output_tokens(&summary),
            finish_reason: summary.finish_reason.clone(),
            error: status == 0 || status >= 500 || summary.upstream_error.is_some(),
            text: response_text(call.kind, &body, TEXT_COMPARE_CHARS),
        };
        sh.offer(&call.request_id, (call.primary_version, call.shadow_version), None, Some(side));
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let Some(bytes) = host::plugin_configuration() else { return false };
        match RoutingPolicy::from_json(&bytes) {
            Ok(policy) => {
                self.shared = Some(Rc::new(RefCell::new(Shared {
                    policy,
                    metrics: host::Metrics::default(),
                    jobs: Vec::new(),
                    in_flight: BTreeMap::new(),
                    pending: BTreeMap::new(),
                    pending_order: VecDeque::new(),
                    tick_armed: false,
                })));
                true
            }
            Err(e) => {
                log::error!("model-router policy refused: {e}");
                false
            }
        }
    }

    fn on_tick(&mut self) {
        let Some(shared) = self.shared.clone() else { return };
        let jobs: Vec<ShadowJob> = {
            let mut sh = shared.borrow_mut();
            // Every waiting job is sent now: the tick stops until the next one is queued.
            if sh.tick_armed {
                match proxy_wasm::hostcalls::set_tick_period(Duration::ZERO) {
                    Ok(()) => sh.tick_armed = false,
                    Err(status) => log::debug!("stopping the shadow tick failed: {status:?}"),
                }
            }
            std::mem::take(&mut sh.jobs)
        };
        for job in jobs {
            let headers: Vec<(&str, &str)> = job.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            let pair = ShadowPair::new(&sanitize_label(&job.primary_version), &sanitize_label(&job.shadow_version));
            match self.dispatch_http_call(&job.cluster, headers, Some(&job.body), vec![], SHADOW_TIMEOUT) {
                Ok(token) => {
                    let mut sh = shared.borrow_mut();
                    sh.count(&metrics::router_shadow_total(&pair, ShadowResult::Sent));
                    sh.in_flight.insert(
                        token,
                        InFlightShadow {
                            request_id: job.request_id,
                            kind: job.kind,
                            started_ns: host::now_ns(),
                            primary_version: job.primary_version,
                            shadow_version: job.shadow_version,
                        },
                    );
                }
                Err(status) => {
                    log::warn!("shadow request to cluster {} failed to start: {status:?}", job.cluster);
                    let mut sh = shared.borrow_mut();
                    sh.count(&metrics::router_shadow_total(&pair, ShadowResult::Failed));
                    // The comparison still completes, as a shadow error, so nothing waits for it.
                    let failed = Side { status: 0, duration_ns: 0, ttft_ns: None, output_tokens: 0, finish_reason: None, error: true, text: String::new() };
                    sh.offer(&job.request_id, (job.primary_version, job.shadow_version), None, Some(failed));
                }
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream { context_id, shared: self.shared.clone(), state: None }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Stream {
    context_id: u32,
    shared: Option<Rc<RefCell<Shared>>>,
    state: Option<Box<Routed>>,
}

struct Routed {
    kind: ApiKind,
    path: String,
    authority: String,
    request_id: String,
    model: String,
    /// The policy's entry for `model`, found once in the header phase.
    model_index: usize,
    decision: Decision,
    /// The shadow version's (name, upstream model, cluster, authority), when this request is shadowed.
    shadow: Option<(String, String, String, String)>,
    rewrite_model: bool,
    status: u16,
    timing: StreamTiming,
    observer: Option<StreamObserver>,
    captured: Vec<u8>,
    finished: bool,
}

impl Context for Stream {}

fn output_tokens(summary: &ResponseSummary) -> u64 {
    if summary.usage_reported {
        summary.usage.output_tokens
    } else {
        summary.estimated_output_tokens
    }
}

/// The sticky key of a request: the first configured source that is present.
fn sticky_key(policy: &RoutingPolicy, headers: &host::HeaderPairs) -> Option<Vec<u8>> {
    let mut header = |name: &str| headers.first(name).map(<[u8]>::to_vec);
    let mut property = |path: &[String]| host::property(path).map(String::into_bytes);
    policy.sticky_key(&mut header, &mut property).map(|k| k.bytes)
}

/// Filter state latency-guard writes: `version>preferred-fallback` entries, comma-separated.
use sluice_core::contract::{self, GatewayEnd, AVOID_PROPERTY, CLIENT_FORBIDDEN_HEADERS, SHADOW_HEADER};

/// The versions latency-guard asked this request to avoid, with the fallback it prefers (may be empty).
fn avoided_versions() -> Vec<(String, String)> {
    host::property(&[AVOID_PROPERTY.to_string()]).map(|list| contract::decode_avoid_list(&list)).unwrap_or_default()
}

fn unhealthy_key(route: &str) -> String {
    format!("sluice/model-router/unhealthy/{route}")
}

/// Routes of versions whose cluster recently had no healthy upstream (shared by every worker).
fn unhealthy_routes(routes: &[String], now: u64) -> Vec<String> {
    routes
        .iter()
        .filter(|route| {
            let until = host::SharedData.get(&unhealthy_key(route)).map(|(v, _)| store::decode_counter(v.as_deref())).unwrap_or(0);
            until > now
        })
        .cloned()
        .collect()
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        let Some(shared) = self.shared.clone() else { return Action::Continue };
        let mut sh = shared.borrow_mut();
        // A client never chooses its version or route: whatever it sent is removed, and only the
        // router writes them.
        // One read of the whole map: the headers to remove are almost always absent (a removal is a
        // hostcall each), and the path, request id, tenant and authority come from it too.
        let headers = host::headers(MapType::HttpRequestHeaders);
        let (route_header, version_header) = (sh.policy.route_header().to_string(), sh.policy.version_header().to_string());
        let client_override = sh.policy.override_client_header().map(str::to_string);
        let removed = [Some(route_header.as_str()), Some(version_header.as_str()), client_override.as_deref()].into_iter().flatten();
        for name in removed.chain(CLIENT_FORBIDDEN_HEADERS.iter().copied()) {
            if headers.contains(name) {
                host::set_header(MapType::HttpRequestHeaders, name, None);
            }
        }
        let path = headers.text(":path").unwrap_or_default();
        let Some(kind) = ApiKind::from_path(&path) else { return Action::Continue };
        let Some(model) = host::property(&MODEL_METADATA.map(String::from)) else {
            sh.count(&metrics::router_unrouted_total(Unrouted::NoModel));
            return Action::Continue;
        };
        let Some(index) = sh.policy.model_for(&model) else {
            sh.count(&metrics::router_unrouted_total(Unrouted::UnknownModel));
            return Action::Continue;
        };
        // Envoy sets x-request-id unless configured not to; without one, a per-stream id keeps
        // sampling and comparisons apart.
        let request_id = headers.text("x-request-id").filter(|id| !id.is_empty()).unwrap_or_else(|| format!("sluice-{}-{}", host::now_ns(), self.context_id));
        let key = sticky_key(&sh.policy, &headers);
        let forced = sh.policy.override_property().and_then(host::property);
        let now = host::now_ns();
        let routes: Vec<String> = sh.policy.model(index).map(|m| m.versions.iter().map(|v| v.route.clone()).collect()).unwrap_or_default();
        let unhealthy_routes = unhealthy_routes(&routes, now);
        let mut unhealthy: Vec<&str> = sh
            .policy
            .model(index)
            .map(|m| m.versions.iter().filter(|v| unhealthy_routes.contains(&v.route)).map(|v| v.name.as_str()).collect())
            .unwrap_or_default();
        // latency-guard (in front) lists versions this request must not go to: their SLO breaker is
        // open and the tenant's class fails over. Filter state, so a client cannot forge it.
        let avoid = avoided_versions();
        let only_unhealthy = unhealthy.clone();
        unhealthy.extend(avoid.iter().map(|(v, _)| v.as_str()));
        // When the guard's list leaves nothing to route to, a slow version beats the route table's
        // default: decide as if the list were empty (the guard then counts the request as having
        // no fallback).
        let decided = sh
            .policy
            .decide(index, key.as_deref(), request_id.as_bytes(), forced.as_deref(), now, &unhealthy)
            .or_else(|| sh.policy.decide(index, key.as_deref(), request_id.as_bytes(), forced.as_deref(), now, &only_unhealthy));
        let Some(mut decision) = decided else {
            // Labelled with the policy's model entry, not the client's string: a glob entry would
            // otherwise let a client mint a series per model name.
            let entry = sh.policy.model(index).map(|m| sanitize_label(&m.pattern)).unwrap_or_else(|| "unknown".into());
            sh.count(&metrics::router_unrouted_total(Unrouted::NoVersion { model: &entry }));
            return Action::Continue;
        };
        // The guard may name the fallback it wants for the avoided version; the router's own
        // fallback order applies when it does not, or when that version is not available.
        let preferred = avoid
            .iter()
            .find(|(v, _)| decision.fallback_from.as_deref() == Some(v.as_str()))
            .map(|(_, f)| f.as_str())
            .filter(|f| !f.is_empty() && !unhealthy.contains(f));
        if let (Reason::Fallback, Some(preferred)) = (decision.reason, preferred) {
            if let Some(d) = sh.policy.decide(index, key.as_deref(), request_id.as_bytes(), Some(preferred), now, &unhealthy) {
                if d.version == preferred {
                    decision = Decision { reason: Reason::Fallback, fallback_from: decision.fallback_from.take(), ..d };
                }
            }
        }
        host::set_header(MapType::HttpRequestHeaders, &route_header, Some(&decision.route));
        host::set_header(MapType::HttpRequestHeaders, &version_header, Some(&decision.version));
        let model_label = sh.policy.model(index).map(|m| sanitize_label(&m.pattern)).unwrap_or_else(|| "unknown".into());
        sh.count(&metrics::router_requests_total(&model_label, &sanitize_label(&decision.version), decision.reason));
        let tenant = sh.policy.model(index).and_then(|m| m.shadow.as_ref()).and_then(|s| s.tenant_header.clone()).and_then(|h| headers.text(&h));
        let shadow = match sh.policy.shadow_sampled(index, request_id.as_bytes(), tenant.as_deref()) {
            ShadowVerdict::Sampled => sh
                .policy
                .model(index)
                .and_then(|m| m.shadow.as_ref())
                .map(|s| (s.version.name.clone(), s.version.upstream_model.clone(), s.version.cluster.clone(), s.version.authority.clone())),
            ShadowVerdict::ExcludedTenant => {
                let shadow_name = sh.policy.model(index).and_then(|m| m.shadow.as_ref()).map(|s| sanitize_label(&s.version.name)).unwrap_or_default();
                sh.count(&metrics::router_shadow_total(&ShadowPair::new(&sanitize_label(&decision.version), &shadow_name), ShadowResult::Excluded));
                None
            }
            ShadowVerdict::NotSampled | ShadowVerdict::NotConfigured => None,
        };
        let rewrite_model = decision.upstream_model != model;
        if rewrite_model && !end_of_stream {
            // The body's model is rewritten: its length may change.
            host::set_header(MapType::HttpRequestHeaders, "content-length", None);
        }
        let routed = Box::new(Routed {
            kind,
            path,
            authority: headers.text(":authority").unwrap_or_default(),
            request_id,
            model,
            model_index: index,
            decision,
            shadow,
            rewrite_model,
            status: 0,
            timing: StreamTiming::new(now),
            observer: None,
            captured: Vec::new(),
            finished: false,
        });
        write_stamp(&routed);
        self.state = Some(routed);
        Action::Continue
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let (Some(shared), Some(r)) = (self.shared.clone(), self.state.as_mut()) else { return Action::Continue };
        if !r.rewrite_model && r.shadow.is_none() {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = host::body(BufferType::HttpRequestBody, body_size);
        if r.rewrite_model {
            match set_top_level_string(&body, "model", &r.decision.upstream_model) {
                Ok(new_body) => host::replace_body(BufferType::HttpRequestBody, body_size, &new_body),
                Err(e) => log::warn!("model not rewritten ({e}); the request goes to {} as sent", r.decision.route),
            }
        }
        if let Some((name, upstream_model, cluster, authority)) = r.shadow.clone() {
            let mut sh = shared.borrow_mut();
            let pair = ShadowPair::new(&sanitize_label(&r.decision.version), &sanitize_label(&name));
            let cap = sh.policy.model(r.model_index).and_then(|m| m.shadow.as_ref()).map_or(0, |s| s.max_concurrent);
            let busy = sh.in_flight.len() + sh.jobs.len();
            sh.count(&metrics::router_shadow_total(&pair, ShadowResult::Sampled));
            let shadow_body = set_top_level_string(&body, "model", &upstream_model);
            if busy >= cap as usize {
                sh.count(&metrics::router_shadow_total(&pair, ShadowResult::SkippedCap));
                r.shadow = None;
            } else if let Ok(shadow_body) = shadow_body {
                let authority = if authority.is_empty() { r.authority.clone() } else { authority };
                sh.queue_shadow(ShadowJob {
                    request_id: r.request_id.clone(),
                    cluster,
                    headers: vec![
                        (":method".into(), "POST".into()),
                        (":path".into(), r.path.clone()),
                        (":authority".into(), authority),
                        ("content-type".into(), "application/json".into()),
                        (SHADOW_HEADER.into(), "1".into()),
                        ("x-request-id".into(), r.request_id.clone()),
                    ],
                    body: shadow_body,
                    kind: r.kind,
                    primary_version: r.decision.version.clone(),
                    shadow_version: name,
                });
            } else {
                // Not JSON: nothing to send the shadow.
                sh.count(&metrics::router_shadow_total(&pair, ShadowResult::Failed));
                r.shadow = None;
            }
            if r.shadow.is_none() {
                write_stamp(r);
            }
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _n: usize, _eos: bool) -> Action {
        let Some(r) = self.state.as_mut() else { return Action::Continue };
        r.status = host::header(MapType::HttpResponseHeaders, ":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        let streaming = host::header(MapType::HttpResponseHeaders, "content-type").is_some_and(|c| c.to_ascii_lowercase().starts_with("text/event-stream"));
        if streaming {
            r.observer = Some(StreamObserver::new(r.kind));
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(r) = self.state.as_mut() else { return Action::Continue };
        if r.shadow.is_none() {
            return Action::Continue;
        }
        let chunk = host::body(BufferType::HttpResponseBody, body_size);
        // A stream's figures come from the observer, so only a text prefix is kept; a whole body is
        // kept (bounded) to read its figures at the end.
        let cap = if r.observer.is_some() { TEXT_CAPTURE_BYTES } else { MAX_WHOLE_BODY_BYTES };
        let room = cap.saturating_sub(r.captured.len());
        r.captured.extend_from_slice(chunk.get(..room.min(chunk.len())).unwrap_or_default());
        if let Some(observer) = r.observer.as_mut() {
            let outcome = observer.push(&chunk);
            if outcome.content_events > 0 {
                r.timing.on_content(host::now_ns(), outcome.content_events);
            }
        }
        if end_of_stream {
            self.finish_primary();
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        let Some(r) = self.state.as_ref() else { return };
        // Passive health: a version whose cluster has no healthy upstream is skipped for a while,
        // by every worker, and its traffic falls back in the policy's order.
        let details = host::property(&["response".into(), "code_details".into()]).unwrap_or_default();
        if details.contains("no_healthy_upstream") {
            let until = host::now_ns().saturating_add(UNHEALTHY_FOR_NS);
            // Unconditional: the latest mark wins, there is nothing to merge.
            if let Err(e) = host::SharedData.set(&unhealthy_key(&r.decision.route), &store::encode_counter(until), 0) {
                log::warn!("marking {} unhealthy failed: {e}", r.decision.route);
            }
            log::info!("route {} has no healthy upstream: version {} skipped for 10 s", r.decision.route, r.decision.version);
        }
        self.drop_shadow_of_refused_request();
        self.finish_primary();
    }
}

/// The access-log stamp of the decision (`%FILTER_STATE(wasm.sluice_route:PLAIN)%`).
fn write_stamp(r: &Routed) {
    let stamp = serde_json::json!({
        "model": r.model, "version": r.decision.version, "reason": r.decision.reason.as_str(),
        "route": r.decision.route, "upstream_model": r.decision.upstream_model,
        "shadow": r.shadow.as_ref().map(|s| s.0.clone()),
    });
    host::set_property(sluice_core::contract::ROUTE_PROPERTY, stamp.to_string().as_bytes());
}

impl Stream {
    /// A filter behind the router (tenant-budget) refused the request: its shadow must not reach the
    /// shadow model either. Shadows leave on the root's next tick, so one still queued is dropped;
    /// one already sent runs on (counted under its own result).
    fn drop_shadow_of_refused_request(&mut self) {
        let (Some(shared), Some(r)) = (self.shared.clone(), self.state.as_mut()) else { return };
        if r.shadow.is_none() || !host::gateway_reply().is_some_and(|g| g.end == GatewayEnd::Refused) {
            return;
        }
        let mut sh = shared.borrow_mut();
        let queued = sh.jobs.len();
        sh.jobs.retain(|job| job.request_id != r.request_id);
        if sh.jobs.len() < queued {
            let pair = ShadowPair::new(&sanitize_label(&r.decision.version), &r.shadow.as_ref().map(|s| sanitize_label(&s.0)).unwrap_or_default());
            sh.count(&metrics::router_shadow_total(&pair, ShadowResult::Refused));
            r.shadow = None;
            write_stamp(r);
        }
    }

    /// The primary side of a shadowed request, handed to the root for comparison.
    fn finish_primary(&mut self) {
        let (Some(shared), Some(r)) = (self.shared.clone(), self.state.as_mut()) else { return };
        if r.finished || r.shadow.is_none() {
            return;
        }
        r.finished = true;
        let now = host::now_ns();
        let summary = match r.observer.as_mut() {
            Some(observer) => {
                observer.finish();
                observer.summary()
            }
            None => inspect_response_body(r.kind, &r.captured),
        };
        let side = Side {
            status: r.status,
            duration_ns: r.timing.duration_ns(now),
            ttft_ns: r.timing.ttft_ns(),
            output_tokens: output_tokens(&summary),
            finish_reason: summary.finish_reason.clone(),
            error: r.status == 0 || r.status >= 500 || summary.upstream_error.is_some(),
            text: response_text(r.kind, &r.captured, TEXT_COMPARE_CHARS),
        };
        let versions = (r.decision.version.clone(), r.shadow.as_ref().map(|s| s.0.clone()).unwrap_or_default());
        shared.borrow_mut().offer(&r.request_id, versions, Some(side), None);
    }
}
