//! sluice latency-guard: per-tenant-class latency policies in Envoy — TTFT and total deadlines, an
//! SLO circuit breaker per model version with fallback through model-router, and priority shedding
//! against per-version in-flight limits. The decisions are `sluice_core::latency`'s; this crate
//! reads the host, keeps each worker's watch list of streams, and acts. Each stream's deadlines,
//! hold and release are core's [`StreamWatch`] (`latency::deadline`): the callbacks hand it their
//! events and apply the effects it returns.
//!
//! Where it sits (docs/latency-guard.md has the whole picture and the reasons):
//!
//! ```text
//! json_to_metadata → latency-guard → model-router → llm-metrics → router
//! ```
//!
//! - request headers: the tenant's class; for every version whose breaker blocks this request and
//!   whose action for the class is `fallback`, an entry in filter state `sluice_latency_avoid`,
//!   which model-router honours when it picks the version;
//! - first request body chunk (model-router has decided by then): the final version; breaker
//!   refusal (503 + `retry-after`), in-flight shedding (503), deadlines armed;
//! - response headers of a stream: held until llm-metrics (behind the guard) marks the first
//!   content token in filter state `sluice_first_token`, so at the TTFT deadline nothing has reached
//!   the client and the answer can still be a clean 504;
//! - the root tick (1–100 ms apart, set to when the next thing is due): releases held streams,
//!   fires deadlines, lets open breakers start probing;
//! - end of stream: TTFT, time per output token and error into the version's shared window, breaker
//!   evaluated, every transition logged with the numbers that caused it.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};
use sluice_core::api::ApiKind;
use sluice_core::latency::deadline::{self, Effect, Effects, Finished, Fired, FirstTokenMark};
use sluice_core::latency::{
    self, breaker, window, Admission, Breaker, LatencyPolicy, OpenAction, Priority, State, StreamWatch, TenantSource, Transition, VersionPolicy,
};
use sluice_core::metrics::{self, ShedReason};
use sluice_core::reply::error_body;
use sluice_core::report::{sanitize_label, Outcome};
use sluice_core::request::inspect_request_with_kind;
use sluice_core::response::StreamObserver;
use sluice_core::rewrite::rewrite_request;
use sluice_core::store::{self, SharedStore, Updated};
use sluice_core::timing::StreamTiming;
use sluice_proxy_host as host;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Duration;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    sluice_proxy_host::install_panic_hook("latency-guard");
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

use sluice_core::contract::{self, GatewayEnd, ROUTE_PROPERTY};
pub use sluice_core::contract::{AVOID_PROPERTY, FIRST_TOKEN_PROPERTY, RELEASE_PROPERTY};
/// Shared-data counter that gives each guard VM (one per worker) its own release queue.
const VM_SEQUENCE_KEY: &str = "sluice/latency-guard/vm-sequence";
/// Metadata json_to_metadata lifts the request's model into (used when no router decided).
const MODEL_METADATA: [&str; 4] = ["metadata", "filter_metadata", "sluice", "model"];
/// Access-log stamp: `%FILTER_STATE(wasm.sluice_latency:PLAIN)%`.
const STAMP_PROPERTY: &str = "sluice_latency";

/// The tick while nothing is watched (open breakers only); while streams are watched the tick
/// follows what is due ([`deadline::tick_period_ms`]).
const IDLE_TICK: Duration = Duration::from_nanos(deadline::IDLE_TICK_NS);
/// How often each worker looks at open breakers (their way to half-open is time alone).
const BREAKER_SWEEP_NS: u64 = deadline::IDLE_TICK_NS;

struct Shared {
    policy: LatencyPolicy,
    metrics: host::Metrics,
    /// Streams the tick watches, by context id.
    watched: BTreeMap<u32, Watch>,
    next_breaker_sweep_ns: u64,
    warned_no_first_token_signal: bool,
    /// This VM's release queue (name, id) and the VM id llm-metrics resolves it under.
    release_queue: Option<(String, u32)>,
    vm_id: String,
    /// The tick period set now, ms: the time until the next thing due (a deadline, a reset, a
    /// held stream to look at), between 1 ms and [`IDLE_TICK`]. A 1 ms tick whenever any
    /// stream was watched cost ≈ 2.5 % of a core per worker for nothing most of the time.
    tick_period_ms: u64,
}

/// A watched stream: its deadline machine (core's) and what applying its effects needs.
#[derive(Debug)]
struct Watch {
    kind: ApiKind,
    /// Shared, not copied: effects are applied with it while the watch list is borrowed.
    version: Rc<str>,
    machine: StreamWatch,
}

#[derive(Default)]
struct Root {
    shared: Option<Rc<RefCell<Shared>>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let Some(bytes) = host::plugin_configuration() else { return false };
        let policy = match LatencyPolicy::from_json(&bytes) {
            Ok(p) => p,
            Err(e) => {
                log::error!("sluice latency-guard: configuration refused: {e}");
                return false;
            }
        };
        // Every shared value exists before traffic: Envoy accepts any CAS token for a missing key,
        // so a create could not be conditional.
        let mut store = host::SharedData;
        for v in &policy.versions {
            if let Some(b) = &v.breaker {
                let w = window::ensure(&mut store, &v.window_key(), &b.window);
                let s = breaker::ensure(&mut store, &v.breaker_key());
                if let Err(e) = w.and(s) {
                    log::error!("sluice latency-guard: cannot create the shared state of {}: {e}", v.name);
                    return false;
                }
            }
            if v.in_flight.is_some() {
                if let Ok((None, _)) = store.get(&v.in_flight_key()) {
                    if let Err(e) = store.set(&v.in_flight_key(), &store::encode_counter(0), 0) {
                        log::error!("sluice latency-guard: cannot create the in-flight counter of {}: {e}", v.name);
                        return false;
                    }
                }
            }
        }
        let vm_id = host::property(&["plugin_vm_id".to_string()]).unwrap_or_default();
        let release_queue = register_release_queue();
        if let Err(status) = proxy_wasm::hostcalls::set_tick_period(IDLE_TICK) {
            log::error!("sluice latency-guard: cannot set the tick ({status:?}); deadlines would never fire");
            return false;
        }
        log::info!(
            "sluice latency-guard: configured ({} classes, {} versions, {} with a breaker)",
            policy.classes.len(),
            policy.versions.len(),
            policy.versions.iter().filter(|v| v.breaker.is_some()).count()
        );
        self.shared = Some(Rc::new(RefCell::new(Shared {
            policy,
            metrics: host::Metrics::default(),
            watched: BTreeMap::new(),
            next_breaker_sweep_ns: 0,
            warned_no_first_token_signal: false,
            release_queue,
            vm_id,
            tick_period_ms: deadline::IDLE_TICK_NS / 1_000_000,
        })));
        true
    }

    fn on_tick(&mut self) {
        let Some(shared) = self.shared.clone() else { return };
        let now = host::now_ns();
        let mut sh = shared.borrow_mut();
        let ids: Vec<u32> = sh.watched.keys().copied().collect();
        for id in ids {
            sh.tick_stream(id, now);
        }
        if now >= sh.next_breaker_sweep_ns {
            sh.next_breaker_sweep_ns = now.saturating_add(BREAKER_SWEEP_NS);
            sh.sweep_open_breakers(now);
        }
        sh.schedule_tick(now);
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        let Some(shared) = self.shared.clone() else { return };
        let mut sh = shared.borrow_mut();
        // Bounded per call: the host calls again while items remain.
        for _ in 0..1024 {
            let item = match proxy_wasm::hostcalls::dequeue_shared_queue(queue_id) {
                Ok(Some(item)) => item,
                Ok(None) => break,
                Err(status) => {
                    log::warn!("sluice latency-guard: release queue unreadable: {status:?}");
                    break;
                }
            };
            let id = std::str::from_utf8(&item).ok().and_then(|t| t.trim().parse::<u32>().ok());
            if let Some(id) = id {
                if sh.watched.get(&id).is_some_and(|w| w.machine.is_held()) {
                    sh.release_if_ready(id, host::now_ns());
                }
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Guard { context_id, shared: self.shared.clone(), state: None }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Guard {
    context_id: u32,
    shared: Option<Rc<RefCell<Shared>>>,
    state: Option<Box<Guarded>>,
}

/// A request the guard follows.
struct Guarded {
    kind: ApiKind,
    class: String,
    priority: Priority,
    /// Deterministic per request: picks half-open probes.
    draw: u64,
    start_ns: u64,
    /// Set once the final version is known and the request admitted.
    admitted: Option<Admitted>,
    decided: bool,
    /// The version's output-token ceiling, applied once the whole request body is in.
    clamp_to: Option<u64>,
    status: u16,
    streaming: bool,
    observer: Option<StreamObserver>,
    timing: StreamTiming,
    observed: bool,
    /// The response reached its end here (its last body chunk, or headers or trailers that ended it).
    response_ended: bool,
}

struct Admitted {
    version: String,
    probe: bool,
    counted_in_flight: bool,
}

impl Context for Guard {}

impl HttpContext for Guard {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        let Some(shared) = self.shared.clone() else { return Action::Continue };
        let path = host::header(MapType::HttpRequestHeaders, ":path").unwrap_or_default();
        let Some(kind) = ApiKind::from_path(&path) else { return Action::Continue };
        let mut sh = shared.borrow_mut();
        let tenant = match &sh.policy.tenant {
            None => None,
            Some(TenantSource::Header(name)) => host::header(MapType::HttpRequestHeaders, name),
            Some(TenantSource::Property(p)) => host::property(p),
        };
        let (class, priority) = sh.policy.classify(tenant.as_deref().map(str::trim).filter(|t| !t.is_empty()));
        let class = class.to_string();
        let request_id = host::header(MapType::HttpRequestHeaders, "x-request-id").unwrap_or_default();
        let draw = breaker::probe_draw(&request_id, self.context_id);
        let now = host::now_ns();
        // Which versions this request must not be sent to: blocked by their breaker, and failing over
        // is what this class does. model-router reads the list when it picks the version.
        let mut avoid: Vec<(&str, &str)> = Vec::new();
        let fallbacks: Vec<(String, String, String, latency::BreakerPolicy)> = sh
            .policy
            .versions
            .iter()
            .filter_map(|v| {
                v.breaker.clone().filter(|b| b.action(priority) == OpenAction::Fallback).map(|b| (v.name.clone(), v.breaker_key(), v.window_key(), b))
            })
            .collect();
        for (name, breaker_key, window_key, b) in &fallbacks {
            let Some(breaker) = sh.current_breaker(name, breaker_key, window_key, b, now) else { continue };
            if breaker.admit(draw) == Admission::Blocked {
                avoid.push((name, b.fallback.as_deref().unwrap_or("")));
            }
        }
        if !avoid.is_empty() {
            host::set_property(AVOID_PROPERTY, contract::encode_avoid_list(avoid).as_bytes());
        }
        if !end_of_stream && sh.policy.versions.iter().any(|v| v.max_output_tokens.is_some()) {
            // The output ceiling may rewrite the body after these headers are gone (the version is
            // only known later): its length may change.
            host::set_header(MapType::HttpRequestHeaders, "content-length", None);
        }
        drop(sh);
        self.state = Some(Box::new(Guarded {
            kind,
            class,
            priority,
            draw,
            start_ns: now,
            admitted: None,
            decided: false,
            clamp_to: None,
            status: 0,
            streaming: false,
            observer: None,
            timing: StreamTiming::new(now),
            observed: false,
            response_ended: false,
        }));
        if end_of_stream {
            // No body: decide now (there is no later request event).
            return self.decide(None);
        }
        Action::Continue
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        // The whole body, read at most once per callback (the decision and the ceiling both need it).
        let mut whole_body: Option<Vec<u8>> = None;
        if self.state.as_ref().is_some_and(|g| !g.decided) {
            // json_to_metadata in front hands over the whole body at once: whether the client asked
            // for a stream is known here, and only streams have a first token before their end.
            let streaming = if end_of_stream {
                let body = whole_body.insert(host::body(BufferType::HttpRequestBody, body_size));
                serde_json::from_slice::<StreamFlag>(body).ok().map(|f| f.stream.unwrap_or(false))
            } else {
                None
            };
            if let Action::Pause = self.decide(streaming) {
                return Action::Pause;
            }
        }
        let Some(g) = self.state.as_mut() else { return Action::Continue };
        let Some(ceiling) = g.clamp_to else { return Action::Continue };
        if !end_of_stream {
            // The ceiling is written into the whole body (Envoy buffers it, within its limit).
            return Action::Pause;
        }
        g.clamp_to = None;
        let body = whole_body.unwrap_or_else(|| host::body(BufferType::HttpRequestBody, body_size));
        match inspect_request_with_kind(g.kind, &body) {
            Ok((kind, info)) => {
                let target = info.max_output_tokens.map_or(ceiling, |asked| asked.min(ceiling));
                if info.max_output_tokens != Some(target) {
                    match rewrite_request(kind, &body, false, Some(target)) {
                        Ok(rewrite) => {
                            host::replace_body(BufferType::HttpRequestBody, body_size, &rewrite.body);
                            let version = g.admitted.as_ref().map(|a| sanitize_label(&a.version)).unwrap_or_default();
                            if let Some(shared) = &self.shared {
                                shared.borrow_mut().metrics.add(MetricType::Counter, &metrics::latency_output_capped_total(&version), 1);
                            }
                        }
                        Err(e) => log::debug!("sluice latency-guard: output ceiling not written: {e}"),
                    }
                }
            }
            // Not an LLM request body the guard understands: forwarded as it is, the upstream judges it.
            Err(e) => log::debug!("sluice latency-guard: request body not inspected, output ceiling not applied: {e}"),
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        let (Some(shared), Some(g)) = (self.shared.clone(), self.state.as_mut()) else { return Action::Continue };
        if !g.decided {
            // A request without a body event (or a reply before it): decide now, no refusal possible.
            g.decided = true;
        }
        g.status = host::header(MapType::HttpResponseHeaders, ":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        g.response_ended |= end_of_stream;
        let content_type = host::header(MapType::HttpResponseHeaders, "content-type").unwrap_or_default();
        g.streaming = content_type.to_ascii_lowercase().starts_with("text/event-stream");
        if g.streaming {
            g.observer = Some(StreamObserver::new(g.kind));
        }
        let mut sh = shared.borrow_mut();
        let Some(w) = sh.watched.get_mut(&self.context_id) else { return Action::Continue };
        let effects = w.machine.on_response_headers(g.status, g.streaming, end_of_stream, first_token_mark);
        if effects.is_empty() {
            return Action::Continue;
        }
        sh.apply(self.context_id, host::now_ns(), &effects, 0)
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let (Some(shared), Some(g)) = (self.shared.clone(), self.state.as_mut()) else { return Action::Continue };
        let now = host::now_ns();
        g.response_ended |= end_of_stream;
        let mut sh = shared.borrow_mut();
        // Reads the chunk (unless the machine drops it); whether it carried content.
        let mut observe = || {
            let Some(observer) = g.observer.as_mut() else { return false };
            let chunk = host::body(BufferType::HttpResponseBody, body_size);
            let mut outcome = observer.push(&chunk);
            if end_of_stream {
                let last = observer.finish();
                outcome.content_events = outcome.content_events.saturating_add(last.content_events);
            }
            g.timing.on_content(now, outcome.content_events);
            outcome.content_events > 0
        };
        let Some(w) = sh.watched.get_mut(&self.context_id) else {
            observe();
            return Action::Continue;
        };
        let effects = w.machine.on_response_body(now, g.streaming, end_of_stream, observe);
        sh.apply(self.context_id, now, &effects, body_size)
    }

    fn on_http_response_trailers(&mut self, _n: usize) -> Action {
        // Trailers end the response: the body saw no end_of_stream.
        if let Some(g) = self.state.as_mut() {
            g.response_ended = true;
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        let (Some(shared), Some(g)) = (self.shared.clone(), self.state.as_mut()) else { return };
        let mut sh = shared.borrow_mut();
        let watch = sh.watched.remove(&self.context_id);
        let Some(a) = g.admitted.take() else { return };
        if a.counted_in_flight {
            sh.leave_in_flight(&a.version);
        }
        if g.observed {
            return;
        }
        g.observed = true;
        let now = host::now_ns();
        if let Some(observer) = g.observer.as_mut() {
            let last = observer.finish();
            if last.content_events > 0 {
                g.timing.on_content(now, last.content_events);
            }
        }
        // What fired, and the TTFT with llm-metrics' mark taken into the timing.
        let Finished { fired, ttft_us, window_ttft_us } = match watch {
            Some(w) => w.machine.end(&mut g.timing),
            None => {
                let ttft_us = g.timing.ttft_ns().map(|v| v / 1000);
                Finished { fired: None, ttft_us, window_ttft_us: ttft_us }
            }
        };
        let summary = g.observer.as_ref().map(StreamObserver::summary).unwrap_or_default();
        // Another plugin answered the request itself (tenant-budget's refusal): it says nothing about
        // the version's latency, and the stamp says what the client got.
        let gateway = host::gateway_reply();
        if let (None, Some(reply)) = (fired, gateway) {
            let version_label = sanitize_label(&a.version);
            let outcome = Outcome::from(reply.end).as_str();
            sh.metrics.add(MetricType::Counter, &metrics::latency_requests_total(&version_label, &sanitize_label(&g.class), outcome), 1);
            write_stamp(g, &a, outcome, reply.status, None);
            return;
        }
        // The same classification as every other plugin's (`Outcome::classify`).
        let seen = if g.response_ended { Outcome::Completed } else { host::interrupted_outcome() };
        let ended = Outcome::classify(None, seen, g.status, summary.upstream_error.is_some());
        let error = fired.is_some() || ended == Outcome::UpstreamError;
        // The client went away before the answer ended (streamed or not): no sample.
        let client_gone = !error && ended == Outcome::ClientDisconnect;
        let output_tokens = summary.usage.output_tokens;
        let tpot_us = g.timing.tpot_ns(output_tokens).map(|v| v / 1000);
        let outcome = match (fired, error) {
            (Some(f), _) => f.kind().as_str(),
            (None, true) => "error",
            (None, false) if client_gone => "client_disconnect",
            _ => "ok",
        };
        let version_label = sanitize_label(&a.version);
        sh.metrics.add(MetricType::Counter, &metrics::latency_requests_total(&version_label, &sanitize_label(&g.class), outcome), 1);
        write_stamp(g, &a, outcome, gateway.map_or(g.status, |r| r.status), ttft_us);
        if client_gone {
            // Says nothing about the version's latency.
            return;
        }
        sh.observe(&a.version, now, window_ttft_us, tpot_us, error);
    }
}

impl Guard {
    /// The final version is known (model-router decided in its header phase): admit or refuse.
    /// `streaming`: whether the request asked for a stream (`None`: unknown, treated as a stream).
    fn decide(&mut self, streaming: Option<bool>) -> Action {
        let (Some(shared), Some(g)) = (self.shared.clone(), self.state.as_mut()) else { return Action::Continue };
        g.decided = true;
        let Some(version) = final_version() else { return Action::Continue };
        let mut sh = shared.borrow_mut();
        let Some(vp) = sh.policy.version(&version).cloned() else { return Action::Continue };
        let now = host::now_ns();
        let version_label = sanitize_label(&vp.name);
        let priority = g.priority;
        let mut probe = false;
        if let Some(b) = &vp.breaker {
            let breaker = sh.current_breaker(&vp.name, &vp.breaker_key(), &vp.window_key(), b, now).unwrap_or_else(|| Breaker::new(b.config.clone()));
            match breaker.admit(g.draw) {
                Admission::Pass => {}
                Admission::Probe => probe = true,
                Admission::Blocked => match b.action(priority) {
                    OpenAction::Reject => {
                        let retry = breaker.retry_after_s(now);
                        sh.count_shed(&version_label, priority, ShedReason::BreakerOpen);
                        let message = format!(
                            "model version {} is failing its latency objective (circuit open); {} requests are refused until it recovers",
                            vp.name,
                            priority.as_str()
                        );
                        refuse(g.kind, 503, retry, &message, "overloaded", "breaker_open");
                        write_refusal_stamp(g, &vp.name, "shed_breaker_open");
                        return Action::Pause;
                    }
                    OpenAction::Fallback => {
                        // model-router was asked to avoid this version and could not (no router in the
                        // chain, or no available fallback): better served slowly than not at all.
                        sh.metrics.add(MetricType::Counter, &metrics::latency_fallback_unavailable_total(&version_label, priority), 1);
                    }
                },
            }
        }
        let mut counted_in_flight = false;
        if let Some(limit) = vp.in_flight {
            match enter_in_flight(&vp, priority, &limit) {
                InFlight::Entered(n) => {
                    counted_in_flight = true;
                    sh.metrics.set_gauge(&metrics::latency_in_flight(&version_label), n);
                }
                InFlight::Shed(n) => {
                    sh.count_shed(&version_label, priority, ShedReason::InFlight);
                    let message = format!(
                        "model version {} has {n} requests in flight (limit {} for {} requests); try again shortly",
                        vp.name,
                        match priority {
                            Priority::Standard => limit.standard_limit(),
                            _ => limit.limit,
                        },
                        priority.as_str()
                    );
                    refuse(g.kind, 503, 1, &message, "overloaded", "in_flight_limit");
                    write_refusal_stamp(g, &vp.name, "shed_in_flight");
                    return Action::Pause;
                }
                InFlight::Unavailable => {}
            }
        }
        g.admitted = Some(Admitted { version: vp.name.clone(), probe, counted_in_flight });
        g.clamp_to = vp.max_output_tokens;
        if probe {
            sh.metrics.add(MetricType::Counter, &metrics::latency_probes_total(&version_label), 1);
        }
        let machine = StreamWatch::new(g.start_ns, vp.ttft_deadline_ns, vp.total_deadline_ns, streaming);
        sh.watched.insert(self.context_id, Watch { kind: g.kind, version: Rc::from(vp.name.as_str()), machine });
        sh.schedule_tick(host::now_ns());
        Action::Continue
    }
}

/// Registers this VM's release queue under a name no other VM of the process uses. `None` (logged):
/// held streams are then released by the tick alone, a few milliseconds later.
fn register_release_queue() -> Option<(String, u32)> {
    let Ok(n) = store::counter_add(&mut host::SharedData, VM_SEQUENCE_KEY, 1) else {
        log::warn!("sluice latency-guard: no release queue (shared data unavailable); held streams wait for the tick");
        return None;
    };
    let name = format!("sluice_latency_release_{n}");
    match proxy_wasm::hostcalls::register_shared_queue(&name) {
        Ok(id) => Some((name, id)),
        Err(status) => {
            log::warn!("sluice latency-guard: no release queue ({status:?}); held streams wait for the tick");
            None
        }
    }
}

/// The version the request goes to: model-router's decision, else the model json_to_metadata read.
fn final_version() -> Option<String> {
    if let Some(version) = host::property(&[ROUTE_PROPERTY.to_string()]).and_then(|d| contract::route_version(&d)) {
        return Some(version);
    }
    host::property(&MODEL_METADATA.map(String::from)).filter(|m| !m.is_empty())
}

/// llm-metrics' first-token mark of the current stream.
fn first_token_mark() -> FirstTokenMark {
    FirstTokenMark::parse(host::property(&[FIRST_TOKEN_PROPERTY.to_string()]).as_deref())
}

/// The one member of a request body the guard reads itself.
#[derive(serde::Deserialize)]
struct StreamFlag {
    #[serde(default)]
    stream: Option<bool>,
}

fn refuse(kind: ApiKind, status: u32, retry_after_s: u64, message: &str, error_type: &str, code: &str) {
    let body = error_body(Some(kind), message, error_type, code);
    let retry = retry_after_s.to_string();
    host::gateway_local_reply(
        GatewayEnd::Refused,
        status,
        &[("content-type", "application/json"), ("retry-after", &retry), ("x-sluice-refused-by", "latency-guard")],
        body.as_bytes(),
    );
}

fn write_refusal_stamp(g: &Guarded, version: &str, outcome: &str) {
    let stamp = serde_json::json!({
        "version": version, "class": g.class, "priority": g.priority.as_str(), "probe": false, "outcome": outcome,
        "status": 503, "ttft_ms": null,
    });
    host::set_property(STAMP_PROPERTY, stamp.to_string().as_bytes());
}

/// The stamp of an admitted request; `status` is what the client got (the gateway's own reply when
/// one was sent, else the upstream's).
fn write_stamp(g: &Guarded, a: &Admitted, outcome: &str, status: u16, ttft_us: Option<u64>) {
    let stamp = serde_json::json!({
        "version": a.version, "class": g.class, "priority": g.priority.as_str(), "probe": a.probe,
        "outcome": outcome, "status": status, "ttft_ms": ttft_us.map(|v| v / 1000),
    });
    host::set_property(STAMP_PROPERTY, stamp.to_string().as_bytes());
}

enum InFlight {
    Entered(u64),
    Shed(u64),
    /// The counter could not be read or updated: not counted, not shed.
    Unavailable,
}

fn enter_in_flight(vp: &VersionPolicy, priority: Priority, limit: &latency::InFlightLimit) -> InFlight {
    let entered = store::counter_update(&mut host::SharedData, &vp.in_flight_key(), |n| {
        if latency::should_shed(priority, n, limit) {
            Err(n)
        } else {
            Ok(n.saturating_add(1))
        }
    });
    match entered {
        Ok(Updated::Written(n)) => InFlight::Entered(n),
        Ok(Updated::Stopped(n)) => InFlight::Shed(n),
        Err(store::CasError::Store(_)) => InFlight::Unavailable,
        Err(store::CasError::Contended) => {
            log::warn!("sluice latency-guard: in-flight counter of {} too contended; request not counted", vp.name);
            InFlight::Unavailable
        }
    }
}

impl Shared {
    /// One watched stream on a tick: release it at its first token, fire its deadline, or reset it
    /// after its error event; what to do is core's ([`StreamWatch::on_tick`]).
    fn tick_stream(&mut self, id: u32, now: u64) {
        let Some(w) = self.watched.get_mut(&id) else { return };
        let mark = if w.machine.is_held() {
            if !host::set_effective_context(id) {
                self.watched.remove(&id);
                return;
            }
            Some(first_token_mark())
        } else {
            None
        };
        let effects = w.machine.on_tick(now, mark);
        if effects.is_empty() {
            return;
        }
        if !host::set_effective_context(id) {
            // The stream is gone: nothing to act on, nothing more to watch.
            self.watched.remove(&id);
            return;
        }
        self.apply(id, now, &effects, 0);
    }

    /// Applies a watched stream's effects, in order, in that stream's context. `body_size`: the
    /// size of the response chunk in a body callback (0 elsewhere). `Pause` when the response
    /// headers are held.
    fn apply(&mut self, id: u32, now: u64, effects: &Effects, body_size: usize) -> Action {
        let Some(w) = self.watched.get(&id) else { return Action::Continue };
        let (api, version) = (w.kind, Rc::clone(&w.version));
        let mut action = Action::Continue;
        for effect in effects {
            match *effect {
                Effect::Hold => {
                    if let Some((name, _)) = &self.release_queue {
                        let stream = id.to_string();
                        let address = contract::ReleaseAddress { stream: &stream, queue: name, vm_id: &self.vm_id };
                        host::set_property(RELEASE_PROPERTY, address.encode().as_bytes());
                    }
                    action = Action::Pause;
                }
                Effect::Unmarked => {
                    if !self.warned_no_first_token_signal {
                        self.warned_no_first_token_signal = true;
                        log::warn!(
                            "sluice latency-guard: a stream without llm-metrics' first-token mark (llm-metrics missing \
                             behind the guard, or skipping this response: content-encoding, path_prefixes); such streams \
                             are not held and a TTFT deadline can only reset them"
                        );
                    }
                }
                // A failure is logged by the host layer.
                Effect::Release => {
                    host::resume_response();
                }
                Effect::RecordTtft { ttft_us } => {
                    self.update_window_and_judge(&version, now, |store, key, config| window::update_ttft(store, key, config, now, ttft_us));
                }
                // Nothing to do on the host: the tick comes back when the wait ends.
                Effect::AwaitChunk { .. } => {}
                Effect::Reply504 { kind, deadline_ms } => {
                    // Envoy resets the upstream request.
                    let body = deadline::reply_504_body(api, kind, &version, deadline_ms);
                    host::gateway_local_reply(
                        GatewayEnd::Deadline,
                        504,
                        &[("content-type", "application/json"), ("x-sluice-deadline", kind.as_str()), ("x-sluice-refused-by", "latency-guard")],
                        body.as_bytes(),
                    );
                }
                Effect::MarkReply(reply) => host::mark_gateway_reply(reply),
                Effect::Reset => {
                    host::reset_stream();
                }
                Effect::ErrorEvent { kind, deadline_ms } => {
                    host::replace_body(BufferType::HttpResponseBody, body_size, deadline::error_event(api, kind, deadline_ms).as_bytes());
                }
                Effect::DropChunk => host::replace_body(BufferType::HttpResponseBody, body_size, b""),
                Effect::CountFired(fired) => self.count_deadline(&version, fired),
                Effect::LogFired { fired, deadline_ms, after_ms } => log::info!(
                    "sluice latency-guard: {} deadline of {deadline_ms} ms fired for a request to {version} after {after_ms} ms: {}",
                    fired.kind().as_str(),
                    fired.action()
                ),
                Effect::Reschedule => self.schedule_tick(now),
            }
        }
        action
    }

    /// Sets the tick to fire when the next thing is due on this worker ([`deadline::tick_period_ms`]).
    /// A hostcall only when the period changes.
    fn schedule_tick(&mut self, now: u64) {
        let queue = self.release_queue.is_some();
        let period_ms = deadline::tick_period_ms(now, self.watched.values().filter_map(|w| w.machine.next_due_ns(now, queue)));
        if period_ms == self.tick_period_ms {
            return;
        }
        match proxy_wasm::hostcalls::set_tick_period(Duration::from_millis(period_ms)) {
            Ok(()) => self.tick_period_ms = period_ms,
            Err(status) => log::warn!("sluice latency-guard: cannot change the tick period: {status:?}"),
        }
    }

    /// Releases a held stream whose first token llm-metrics has marked (or forgets it when gone).
    fn release_if_ready(&mut self, id: u32, now: u64) {
        if !host::set_effective_context(id) {
            self.watched.remove(&id);
            return;
        }
        let mark = first_token_mark();
        let Some(w) = self.watched.get_mut(&id) else { return };
        let effects = w.machine.on_first_token_mark(mark);
        self.apply(id, now, &effects, 0);
    }

    fn count_deadline(&mut self, version: &str, fired: Fired) {
        let version = sanitize_label(version);
        self.metrics.add(MetricType::Counter, &metrics::latency_deadline_total(&version, fired), 1);
    }

    fn count_shed(&mut self, version_label: &str, priority: Priority, reason: ShedReason) {
        self.metrics.add(MetricType::Counter, &metrics::latency_shed_total(version_label, priority, reason), 1);
    }

    fn leave_in_flight(&mut self, version: &str) {
        let Some(vp) = self.policy.version(version) else { return };
        match store::counter_add(&mut host::SharedData, &vp.in_flight_key(), -1) {
            Ok(n) => {
                self.metrics.set_gauge(&metrics::latency_in_flight(&sanitize_label(version)), n);
            }
            Err(store::CasError::Contended) => log::warn!("sluice latency-guard: in-flight counter of {version} too contended; it may read high"),
            Err(store::CasError::Store(_)) => {}
        }
    }

    /// A finished request into its version's window; the breaker judged on the result.
    fn observe(&mut self, version: &str, now: u64, ttft_us: Option<u64>, tpot_us: Option<u64>, error: bool) {
        self.update_window_and_judge(version, now, |store, key, config| window::update(store, key, config, now, ttft_us, tpot_us, error));
    }

    /// Applies `update` to the version's shared window (when it has a breaker) and judges the
    /// breaker on the window as written.
    fn update_window_and_judge(
        &mut self,
        version: &str,
        now: u64,
        update: impl FnOnce(&mut host::SharedData, &str, &latency::WindowConfig) -> Result<latency::RollingWindow, latency::UpdateError>,
    ) {
        let Some(vp) = self.policy.version(version) else { return };
        let Some(b) = vp.breaker.clone() else { return };
        let (window_key, breaker_key) = (vp.window_key(), vp.breaker_key());
        match update(&mut host::SharedData, &window_key, &b.window) {
            Ok(window) => {
                let stats = window.snapshot(now);
                self.judge(version, &breaker_key, &window_key, &b, now, &stats);
            }
            Err(e) => log::warn!("sluice latency-guard: window of {version} not updated: {e}"),
        }
    }

    fn judge(&mut self, name: &str, breaker_key: &str, window_key: &str, b: &latency::BreakerPolicy, now: u64, stats: &latency::WindowStats) {
        let mut store = host::SharedData;
        match breaker::update(&mut store, breaker_key, &b.config, now, stats) {
            Ok((breaker, transition)) => {
                let label = sanitize_label(name);
                self.metrics.set_gauge(&metrics::latency_breaker_state(&label), u64::from(breaker.state().state.code()));
                if let Some(t) = transition {
                    self.on_transition(name, window_key, b, &t);
                }
            }
            Err(e) => log::warn!("sluice latency-guard: breaker of {name} not evaluated: {e}"),
        }
    }

    fn on_transition(&mut self, name: &str, window_key: &str, b: &latency::BreakerPolicy, t: &Transition) {
        let label = sanitize_label(name);
        log::warn!("sluice latency-guard: breaker of {name} {} → {}: {}", t.from.as_str(), t.to.as_str(), t.reason);
        self.metrics.add(MetricType::Counter, &metrics::latency_breaker_transitions_total(&label, t.to), 1);
        if t.reset_window {
            if let Err(e) = window::reset(&mut host::SharedData, window_key, &b.window) {
                log::warn!("sluice latency-guard: window of {name} not reset: {e}");
            }
        }
    }

    /// The breaker of version `name` as a request arriving `now` must see it. Open → half-open is a
    /// matter of time alone, so it is decided here, at the request that finds it due, rather than
    /// at the next sweep (up to 100 ms later, at a phase set by when the VM started ticking).
    /// `None` when the shared state cannot be read.
    fn current_breaker(&mut self, name: &str, breaker_key: &str, window_key: &str, b: &latency::BreakerPolicy, now: u64) -> Option<Breaker> {
        let mut store = host::SharedData;
        let breaker = breaker::read(&mut store, breaker_key, &b.config).ok()?;
        let state = breaker.state();
        if state.state != State::Open || now.saturating_sub(state.since_ns) < b.config.open_for_ns {
            return Some(breaker);
        }
        let Ok(window) = window::read(&mut store, window_key, &b.window) else { return Some(breaker) };
        let stats = window.snapshot(now);
        self.judge(name, breaker_key, window_key, b, now, &stats);
        Some(breaker::read(&mut store, breaker_key, &b.config).unwrap_or(breaker))
    }

    /// Open breakers go half-open on time alone, and traffic may not reach them to notice.
    fn sweep_open_breakers(&mut self, now: u64) {
        let versions: Vec<(String, String, String, latency::BreakerPolicy)> =
            self.policy.versions.iter().filter_map(|v| v.breaker.clone().map(|b| (v.name.clone(), v.breaker_key(), v.window_key(), b))).collect();
        let mut store = host::SharedData;
        for (name, breaker_key, window_key, b) in versions {
            let Ok(current) = breaker::read(&mut store, &breaker_key, &b.config) else { continue };
            self.metrics.set_gauge(&metrics::latency_breaker_state(&sanitize_label(&name)), u64::from(current.state().state.code()));
            if current.state().state != State::Open {
                continue;
            }
            let Ok(window) = window::read(&mut store, &window_key, &b.window) else { continue };
            let stats = window.snapshot(now);
            self.judge(&name, &breaker_key, &window_key, &b, now, &stats);
        }
    }
}
