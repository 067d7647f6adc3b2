//! model-router's request life: which version of the requested model a request goes to, what the
//! client may not steer, the access-log stamp of the decision, and the shadow copy of a sample of
//! requests whose answer is compared with the primary's and never reaches the client.
//!
//! ```text
//! request headers ─► decided (route and version headers set, stamp written; unrouted requests stop
//! here) ─► request body (rewritten to the version's upstream model; the shadow copy is built from
//! the whole body and queued) ─► response (a shadowed primary's answer is captured) ─► end (the
//! primary's side is handed over for comparison; passive health; a refused request's queued shadow
//! is dropped)
//! ```
//!
//! Per VM, [`Router`] holds the policy and the shadow book: shadows waiting for the root's tick
//! (a stream's callouts die with the stream, so the root sends them), shadows in flight, and
//! comparisons waiting for their other half. The host sends what [`Router::take_queued`] gives it
//! and reports back with [`Router::shadow_sent`], [`Router::shadow_not_started`] and
//! [`Router::on_shadow_answer`]; the tick and the callout are host operations.

use super::{Dir, Effect, Effects, LogLevel, Verdict, View};
use crate::api::ApiKind;
use crate::contract::{self, GatewayEnd, AVOID_PROPERTY, CLIENT_FORBIDDEN_HEADERS, ROUTE_PROPERTY, SHADOW_HEADER};
use crate::metrics::{self, ShadowPair, ShadowResult, Unrouted};
use crate::observation::Observer;
use crate::report::sanitize_label;
use crate::request::inspect_request_with_kind;
use crate::response::{inspect_response_body, ResponseSummary};
use crate::rewrite::set_top_level_string;
use crate::routing::similarity::{jaccard_per_mille, response_text};
use crate::routing::{Decision, Reason, RoutingPolicy, ShadowVerdict};
use crate::span;
use crate::store::{self, SharedStore};
use crate::timing::StreamTiming;
use crate::vecmap::VecMap;
use std::collections::VecDeque;
use std::fmt::Write as _;
use std::time::Duration;

use crate::contract::MODEL_METADATA;
/// Bytes of a streamed primary response kept to compare texts (figures come from the stream itself).
pub const TEXT_CAPTURE_BYTES: usize = 64 * 1024;
/// Largest whole response body (non-streamed primary, or any shadow answer) read for its figures.
pub const MAX_WHOLE_BODY_BYTES: usize = 4 * 1024 * 1024;
/// Characters of text compared.
pub const TEXT_COMPARE_CHARS: usize = 4096;
/// How long a version whose cluster had no healthy upstream is skipped.
pub const UNHEALTHY_FOR_NS: u64 = 10_000_000_000;
/// Shadow results or primaries waiting for their other half; older ones are dropped.
pub const MAX_PENDING_COMPARISONS: usize = 1024;
/// How long a shadow callout may take.
pub const SHADOW_TIMEOUT: Duration = Duration::from_secs(300);
/// How soon a queued shadow request is sent (by the root's tick).
pub const SHADOW_TICK: Duration = Duration::from_millis(20);
const NS_PER_MS: u64 = 1_000_000;

/// The shared-data key marking `route` unhealthy (its value: until when, host ns).
pub fn unhealthy_key(route: &str) -> String {
    format!("sluice/model-router/unhealthy/{route}")
}

/// One side of a comparison.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Side {
    status: u16,
    duration_ns: u64,
    ttft_ns: Option<u64>,
    output_tokens: u64,
    finish_reason: Option<String>,
    error: bool,
    text: String,
}

impl Side {
    /// A shadow that got no answer: a shadow error, so the comparison still completes.
    fn failed(duration_ns: u64) -> Side {
        Side { duration_ns, error: true, ..Side::default() }
    }

    fn of(status: u16, duration_ns: u64, ttft_ns: Option<u64>, summary: &ResponseSummary, text: String) -> Side {
        Side {
            status,
            duration_ns,
            ttft_ns,
            output_tokens: if summary.usage_reported { summary.usage.output_tokens } else { summary.estimated_output_tokens },
            finish_reason: summary.finish_reason.clone(),
            error: status == 0 || status >= 500 || summary.upstream_error.is_some(),
            text,
        }
    }
}

/// The W3C trace-context headers a traced primary's shadow copies from the client's request: the
/// shadow joins the client's trace beside the gateway's span. It cannot name the gateway span
/// itself: Envoy's router writes that span's context into the request after the filters have seen
/// it, and measured in Envoy 1.40 a filter cannot read it later (the header map is readable only
/// inside the request-headers callback, and the `request.headers` property read from the root's
/// tick is empty). Without a client trace context, the shadow shares its primary's `x-request-id`.
pub const TRACE_HEADERS: &[&str] = &["traceparent", "tracestate"];

/// A shadow request waiting for the root's tick.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShadowJob {
    /// The Envoy cluster to call.
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    request_id: String,
    kind: ApiKind,
    primary_version: String,
    shadow_version: String,
}

impl ShadowJob {
    fn pair(&self) -> ShadowPair {
        ShadowPair::new(&sanitize_label(&self.primary_version), &sanitize_label(&self.shadow_version))
    }
}

#[derive(Debug)]
struct InFlightShadow {
    request_id: String,
    kind: ApiKind,
    started_ns: u64,
    primary_version: String,
    shadow_version: String,
}

#[derive(Debug, Default)]
struct Pending {
    primary: Option<Side>,
    shadow: Option<Side>,
    versions: (String, String),
}

/// Per-VM state every stream shares: the policy and the shadow book.
#[derive(Debug)]
pub struct Router {
    pub policy: RoutingPolicy,
    jobs: Vec<ShadowJob>,
    /// [`VecMap`]s, not B-trees (two instantiations less in the playground's page), of boxes: an
    /// insertion or removal moves pointers. Callout tokens only grow (added at the end); pending
    /// comparisons are at most [`MAX_PENDING_COMPARISONS`].
    in_flight: VecMap<u32, Box<InFlightShadow>>,
    pending: VecMap<String, Box<Pending>>,
    pending_order: VecDeque<String>,
}

impl Router {
    pub fn new(policy: RoutingPolicy) -> Router {
        Router { policy, jobs: Vec::new(), in_flight: VecMap::new(), pending: VecMap::new(), pending_order: VecDeque::new() }
    }

    /// Shadow requests waiting for the root's tick (the tick runs only while this is not zero).
    pub fn queued(&self) -> usize {
        self.jobs.len()
    }

    /// Every waiting shadow request, for the root to send now.
    pub fn take_queued(&mut self) -> Vec<ShadowJob> {
        std::mem::take(&mut self.jobs)
    }

    /// The host sent `job`'s callout (`token`) at `now`.
    pub fn shadow_sent(&mut self, token: u32, job: ShadowJob, now: u64, fx: &mut Effects) {
        fx.count(metrics::router_shadow_total(&job.pair(), ShadowResult::Sent), 1);
        let ShadowJob { request_id, kind, primary_version, shadow_version, .. } = job;
        self.in_flight.insert(token, Box::new(InFlightShadow { request_id, kind, started_ns: now, primary_version, shadow_version }));
    }

    /// The host could not start `job`'s callout (`reason`, for the log).
    pub fn shadow_not_started(&mut self, job: ShadowJob, reason: &str, fx: &mut Effects) {
        fx.log(LogLevel::Warn, format!("shadow request to cluster {} failed to start: {reason}", job.cluster));
        fx.count(metrics::router_shadow_total(&job.pair(), ShadowResult::Failed), 1);
        // The comparison still completes, as a shadow error, so nothing waits for it.
        self.offer(&job.request_id, (job.primary_version, job.shadow_version), None, Some(Side::failed(0)), fx);
    }

    /// The answer to callout `token`: `status` 0 when there was none (failed or timed out), `body`
    /// its first [`MAX_WHOLE_BODY_BYTES`].
    pub fn on_shadow_answer(&mut self, token: u32, status: u16, body: &[u8], now: u64, fx: &mut Effects) {
        let Some(call) = self.in_flight.remove(&token) else { return };
        if status == 0 {
            let pair = ShadowPair::new(&sanitize_label(&call.primary_version), &sanitize_label(&call.shadow_version));
            fx.count(metrics::router_shadow_total(&pair, ShadowResult::Failed), 1);
        }
        let summary = inspect_response_body(call.kind, body);
        let side = Side::of(status, now.saturating_sub(call.started_ns), None, &summary, response_text(call.kind, body, TEXT_COMPARE_CHARS));
        self.offer(&call.request_id, (call.primary_version, call.shadow_version), None, Some(side), fx);
    }

    /// Stores one side of a comparison; emits the comparison when both sides are in.
    fn offer(&mut self, request_id: &str, versions: (String, String), primary: Option<Side>, shadow: Option<Side>, fx: &mut Effects) {
        if !self.pending.contains_key(request_id) {
            while self.pending.len() >= MAX_PENDING_COMPARISONS {
                let Some(old) = self.pending_order.pop_front() else { break };
                self.pending.remove(&old);
            }
            self.pending_order.push_back(request_id.to_string());
        }
        let entry = self.pending.get_or_insert_with(request_id.to_string(), Box::default);
        entry.versions = versions;
        if primary.is_some() {
            entry.primary = primary;
        }
        if shadow.is_some() {
            entry.shadow = shadow;
        }
        if entry.primary.is_some() && entry.shadow.is_some() {
            if let Some(done) = self.pending.remove(request_id) {
                self.pending_order.retain(|id| id != request_id);
                compare(request_id, *done, fx);
            }
        }
    }
}

/// The comparison of both sides: metrics, and one log line (a JSON object).
fn compare(request_id: &str, done: Pending, fx: &mut Effects) {
    let (Some(p), Some(s)) = (done.primary, done.shadow) else { return };
    let pair = ShadowPair::new(&sanitize_label(&done.versions.0), &sanitize_label(&done.versions.1));
    for (side, v) in [(metrics::Side::Primary, &p), (metrics::Side::Shadow, &s)] {
        fx.push(Effect::Record { name: metrics::router_compare_duration_ms(&pair, side), value: v.duration_ns / NS_PER_MS });
        fx.push(Effect::Record { name: metrics::router_compare_output_tokens(&pair, side), value: v.output_tokens });
        if v.error {
            fx.count(metrics::router_compare_errors_total(&pair, side), 1);
        }
    }
    if let Some(ttft) = p.ttft_ns {
        fx.push(Effect::Record { name: metrics::router_compare_ttft_ms(&pair), value: ttft / NS_PER_MS });
    }
    let agree = p.finish_reason == s.finish_reason;
    fx.count(metrics::router_compare_total(&pair, agree), 1);
    let similarity = jaccard_per_mille(&p.text, &s.text);
    fx.push(Effect::Record { name: metrics::router_compare_similarity_per_mille(&pair), value: similarity });
    // Members in name order: the bytes the line had when it was built as a serde_json map.
    let mut line = String::with_capacity(256);
    line.push_str("shadow comparison {\"duration_ms\":[");
    let _ = write!(line, "{},{}", p.duration_ns / NS_PER_MS, s.duration_ns / NS_PER_MS);
    line.push_str("],\"finish\":[");
    push_json_opt(&mut line, p.finish_reason.as_deref());
    line.push(',');
    push_json_opt(&mut line, s.finish_reason.as_deref());
    let _ = write!(line, "],\"output_tokens\":[{},{}],\"primary\":", p.output_tokens, s.output_tokens);
    push_json_str(&mut line, &done.versions.0);
    line.push_str(",\"request_id\":");
    push_json_str(&mut line, request_id);
    line.push_str(",\"shadow\":");
    push_json_str(&mut line, &done.versions.1);
    let _ = write!(line, ",\"similarity_per_mille\":{similarity},\"status\":[{},{}],\"ttft_ms\":[", p.status, s.status);
    match p.ttft_ns {
        Some(t) => {
            let _ = write!(line, "{}", t / NS_PER_MS);
        }
        None => line.push_str("null"),
    }
    line.push_str(",null]}");
    fx.log(LogLevel::Info, line);
}

/// Appends `s` as a JSON string, escaped as serde_json escapes it (quote, backslash, control
/// characters; `\b \f \n \r \t` short, the others `\u00xx`; nothing else).
fn push_json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn push_json_opt(out: &mut String, s: Option<&str>) {
    match s {
        Some(s) => push_json_str(out, s),
        None => out.push_str("null"),
    }
}

/// Where a sampled request's shadow copy goes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ShadowTarget {
    version: String,
    upstream_model: String,
    cluster: String,
    /// Empty: the primary request's authority.
    authority: String,
}

/// The shadow copy of one request.
#[derive(Debug)]
enum Shadowing {
    /// Not shadowed: not sampled, excluded, over the cap, not JSON, or dropped with its refused
    /// request.
    Off,
    /// Sampled; the copy is built once the whole request body is in.
    Sampled(Box<ShadowTarget>),
    /// Queued for the root's tick (or sent already), to version `0`.
    Queued(String),
}

impl Shadowing {
    fn version(&self) -> Option<&str> {
        match self {
            Shadowing::Off => None,
            Shadowing::Sampled(t) => Some(&t.version),
            Shadowing::Queued(v) => Some(v),
        }
    }
}

/// The primary's side of a shadowed request.
#[derive(Debug)]
enum Primary {
    /// Its answer, captured: a stream is observed event by event and only a text prefix kept; a
    /// whole body is kept (bounded) to read its figures at the end.
    Capturing { observer: Option<Observer>, captured: Vec<u8> },
    /// Handed over for comparison.
    Offered,
}

#[derive(Debug)]
struct Routed {
    kind: ApiKind,
    path: String,
    authority: String,
    request_id: String,
    model: String,
    /// The policy's entry for `model`, found once in the header phase.
    model_index: usize,
    decision: Decision,
    /// The body's `model` is rewritten to the version's upstream name.
    rewrite_model: bool,
    shadow: Shadowing,
    primary: Primary,
    status: u16,
    timing: StreamTiming,
    /// Envoy traces this request: the decision goes on its span too (`crate::span`).
    traced: bool,
    /// The client's trace context, for the shadow ([`TRACE_HEADERS`]); empty unless traced.
    trace_context: Vec<(String, String)>,
}

/// One stream's routing; `None` inside for requests that are not routed (not an LLM API, no or an
/// unknown model, no version left).
#[derive(Debug, Default)]
pub struct RouterFlow {
    /// The host's id of the stream, for the request id of a request that has none.
    context_id: u32,
    routed: Option<Box<Routed>>,
}

impl RouterFlow {
    pub fn new(context_id: u32) -> RouterFlow {
        RouterFlow { context_id, routed: None }
    }

    /// Whether the request was routed (only then do the later events matter).
    pub fn is_routed(&self) -> bool {
        self.routed.is_some()
    }

    /// Whether the request body must be seen: to rewrite its model, or to copy it for the shadow.
    pub fn wants_request_body(&self) -> bool {
        self.routed.as_ref().is_some_and(|r| r.rewrite_model || !matches!(r.shadow, Shadowing::Off))
    }

    /// Whether the response is captured for a comparison.
    pub fn wants_response(&self) -> bool {
        self.routed.as_ref().is_some_and(|r| !matches!(r.shadow, Shadowing::Off) && matches!(r.primary, Primary::Capturing { .. }))
    }

    /// The request headers (`view` answers from the whole map; `store` holds the routes marked
    /// unhealthy by every worker). `now` is asked only for a request that is routed: the host's
    /// time is a hostcall, and most traffic through a gateway is not an LLM call.
    pub fn on_request_headers(
        &mut self,
        router: &mut Router,
        view: &mut dyn View,
        store: &mut dyn SharedStore,
        end_of_stream: bool,
        now: &mut dyn FnMut() -> u64,
        fx: &mut Effects,
    ) {
        let policy = &router.policy;
        // A client never chooses its version or route: whatever it sent is removed, and only the
        // router writes them. Most are absent, and a removal costs a hostcall: only present ones go.
        let removed = [Some(policy.route_header()), Some(policy.version_header()), policy.override_client_header()].into_iter().flatten();
        for name in removed.chain(CLIENT_FORBIDDEN_HEADERS.iter().copied()) {
            if view.request_header(name).is_some() {
                fx.push(Effect::SetHeader { dir: Dir::Request, name: name.to_string(), value: None });
            }
        }
        let path = view.request_header(":path").unwrap_or_default();
        let Some(kind) = ApiKind::from_path(&path) else { return };
        let Some(model) = view.property(&MODEL_METADATA) else {
            fx.count(metrics::router_unrouted_total(Unrouted::NoModel), 1);
            return;
        };
        let Some(index) = policy.model_for(&model) else {
            fx.count(metrics::router_unrouted_total(Unrouted::UnknownModel), 1);
            return;
        };
        let Some(entry) = policy.model(index) else { return };
        // Labelled with the policy's model entry, not the client's string: a glob entry would
        // otherwise let a client mint a series per model name.
        let model_label = sanitize_label(&entry.pattern);
        let now = now();
        // Envoy sets x-request-id unless configured not to; without one, a per-stream id keeps
        // sampling and comparisons apart.
        let request_id = view.request_header("x-request-id").filter(|id| !id.is_empty()).unwrap_or_else(|| format!("sluice-{now}-{}", self.context_id));
        let traced = span::traced(Some(&request_id));
        let trace_context: Vec<(String, String)> = if traced {
            TRACE_HEADERS.iter().filter_map(|name| view.request_header(name).filter(|v| !v.is_empty()).map(|v| ((*name).to_string(), v))).collect()
        } else {
            Vec::new()
        };
        let key = sticky_key(policy, view);
        let forced = policy.override_property().and_then(|p| crate::flow::property_at(view, p));
        // Versions whose cluster recently had no healthy upstream (marked by any worker).
        let mut unhealthy: Vec<&str> = entry
            .versions
            .iter()
            .filter(|v| store.get(&unhealthy_key(&v.route)).map(|(until, _)| store::decode_counter(until.as_deref())).unwrap_or(0) > now)
            .map(|v| v.name.as_str())
            .collect();
        // latency-guard (in front) lists versions this request must not go to: their SLO breaker is
        // open and the tenant's class fails over. Filter state, so a client cannot forge it.
        let avoid = view.property(&[AVOID_PROPERTY]).map(|list| contract::decode_avoid_list(&list)).unwrap_or_default();
        let only_unhealthy = unhealthy.clone();
        unhealthy.extend(avoid.iter().map(|(v, _)| v.as_str()));
        let decide = |forced: Option<&str>, unhealthy: &[&str]| policy.decide(index, key.as_deref(), request_id.as_bytes(), forced, now, unhealthy);
        // When the guard's list leaves nothing to route to, a slow version beats the route table's
        // default: decide as if the list were empty (the guard then counts the request as having
        // no fallback).
        let Some(mut decision) = decide(forced.as_deref(), &unhealthy).or_else(|| decide(forced.as_deref(), &only_unhealthy)) else {
            fx.count(metrics::router_unrouted_total(Unrouted::NoVersion { model: &model_label }), 1);
            return;
        };
        // The guard may name the fallback it wants for the avoided version; the router's own
        // fallback order applies when it does not, or when that version is not available.
        let preferred = avoid
            .iter()
            .find(|(v, _)| decision.fallback_from.as_deref() == Some(v.as_str()))
            .map(|(_, f)| f.as_str())
            .filter(|f| !f.is_empty() && !unhealthy.contains(f));
        if let (Reason::Fallback, Some(preferred)) = (decision.reason, preferred) {
            if let Some(d) = decide(Some(preferred), &unhealthy) {
                if d.version == preferred {
                    decision = Decision { reason: Reason::Fallback, fallback_from: decision.fallback_from.take(), ..d };
                }
            }
        }
        fx.push(Effect::SetHeader { dir: Dir::Request, name: policy.route_header().to_string(), value: Some(decision.route.clone()) });
        fx.push(Effect::SetHeader { dir: Dir::Request, name: policy.version_header().to_string(), value: Some(decision.version.clone()) });
        fx.count(metrics::router_requests_total(&model_label, &sanitize_label(&decision.version), decision.reason), 1);
        let tenant = entry.shadow.as_ref().and_then(|s| s.tenant_header.as_deref()).and_then(|h| view.request_header(h));
        let shadow = match (policy.shadow_sampled(index, request_id.as_bytes(), tenant.as_deref()), entry.shadow.as_ref()) {
            (ShadowVerdict::Sampled, Some(s)) => Shadowing::Sampled(Box::new(ShadowTarget {
                version: s.version.name.clone(),
                upstream_model: s.version.upstream_model.clone(),
                cluster: s.version.cluster.clone(),
                authority: s.version.authority.clone(),
            })),
            (ShadowVerdict::ExcludedTenant, shadow) => {
                let shadow_name = shadow.map(|s| sanitize_label(&s.version.name)).unwrap_or_default();
                fx.count(metrics::router_shadow_total(&ShadowPair::new(&sanitize_label(&decision.version), &shadow_name), ShadowResult::Excluded), 1);
                Shadowing::Off
            }
            _ => Shadowing::Off,
        };
        let rewrite_model = decision.upstream_model != model;
        if rewrite_model && !end_of_stream {
            // The body's model is rewritten: its length may change.
            fx.push(Effect::SetHeader { dir: Dir::Request, name: "content-length".into(), value: None });
        }
        let routed = Box::new(Routed {
            kind,
            path,
            authority: view.request_header(":authority").unwrap_or_default(),
            request_id,
            model,
            model_index: index,
            decision,
            rewrite_model,
            shadow,
            primary: Primary::Capturing { observer: None, captured: Vec::new() },
            status: 0,
            timing: StreamTiming::new(now),
            traced,
            trace_context,
        });
        routed.stamp(fx);
        self.routed = Some(routed);
    }

    /// A request body chunk of `size` bytes. The body is held until it is whole (then `size` is
    /// all of it), rewritten, and copied for the shadow.
    pub fn on_request_body(&mut self, router: &mut Router, view: &mut dyn View, size: usize, end_of_stream: bool, fx: &mut Effects) -> Verdict {
        let Some(r) = self.routed.as_mut() else { return Verdict::Continue };
        if !r.rewrite_model && matches!(r.shadow, Shadowing::Off) {
            return Verdict::Continue;
        }
        if !end_of_stream {
            return Verdict::Pause;
        }
        let body = view.body(Dir::Request, size);
        if r.rewrite_model {
            // The policies behind (tenant-budget, llm-metrics) read this body's inspection: parsed
            // here, it is remembered across the rewrite (`remember_rewrite`) and the rewrite's own
            // check of the text finds it known — one parse of the body where a check here and a
            // parse of the rewritten body behind made two.
            let _ = inspect_request_with_kind(r.kind, &body);
            match set_top_level_string(&body, "model", &r.decision.upstream_model) {
                Ok(new_body) => fx.push(Effect::ReplaceBody { dir: Dir::Request, bytes: new_body }),
                Err(e) => fx.log(LogLevel::Warn, format!("model not rewritten ({e}); the request goes to {} as sent", r.decision.route)),
            }
        }
        if !matches!(r.shadow, Shadowing::Sampled(_)) {
            return Verdict::Continue;
        }
        let Shadowing::Sampled(target) = std::mem::replace(&mut r.shadow, Shadowing::Off) else { return Verdict::Continue };
        let ShadowTarget { version, upstream_model, cluster, authority } = *target;
        let pair = ShadowPair::new(&sanitize_label(&r.decision.version), &sanitize_label(&version));
        let cap = router.policy.model(r.model_index).and_then(|m| m.shadow.as_ref()).map_or(0, |s| s.max_concurrent);
        let busy = router.in_flight.len() + router.jobs.len();
        fx.count(metrics::router_shadow_total(&pair, ShadowResult::Sampled), 1);
        if busy >= cap as usize {
            fx.count(metrics::router_shadow_total(&pair, ShadowResult::SkippedCap), 1);
        } else if let Ok(shadow_body) = set_top_level_string(&body, "model", &upstream_model) {
            let authority = if authority.is_empty() { r.authority.clone() } else { authority };
            let mut headers: Vec<(String, String)> = vec![
                (":method".into(), "POST".into()),
                (":path".into(), r.path.clone()),
                (":authority".into(), authority),
                ("content-type".into(), "application/json".into()),
                (SHADOW_HEADER.into(), "1".into()),
                ("x-request-id".into(), r.request_id.clone()),
            ];
            headers.extend(r.trace_context.iter().cloned());
            router.jobs.push(ShadowJob {
                cluster,
                headers,
                body: shadow_body,
                request_id: r.request_id.clone(),
                kind: r.kind,
                primary_version: r.decision.version.clone(),
                shadow_version: version.clone(),
            });
            r.shadow = Shadowing::Queued(version);
        } else {
            // Not JSON: nothing to send the shadow.
            fx.count(metrics::router_shadow_total(&pair, ShadowResult::Failed), 1);
        }
        if matches!(r.shadow, Shadowing::Off) {
            r.stamp(fx);
            if r.traced {
                span::clear(span::SHADOW, fx);
            }
        }
        Verdict::Continue
    }

    ///
    /// A request another filter refused (its gateway reply is marked by now) loses its queued
    /// shadow here, before a tick could send it, and before Envoy finishes the request's span.
    pub fn on_response_headers(&mut self, router: &mut Router, view: &mut dyn View, fx: &mut Effects) {
        let Some(r) = self.routed.as_mut() else { return };
        r.drop_shadow_of_refused_request(router, view, fx);
        let Primary::Capturing { observer, .. } = &mut r.primary else { return };
        if matches!(r.shadow, Shadowing::Off) {
            // Only a comparison reads the status and the stream.
            return;
        }
        r.status = view.response_header(":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        if view.response_header("content-type").is_some_and(|c| c.to_ascii_lowercase().starts_with("text/event-stream")) {
            *observer = Some(view.response_observer(r.kind));
        }
    }

    /// A response body chunk of `size` bytes, captured while the request is shadowed. `now` is
    /// asked only for a chunk with content and at the end (a stream may arrive byte by byte).
    pub fn on_response_body(
        &mut self,
        router: &mut Router,
        view: &mut dyn View,
        size: usize,
        end_of_stream: bool,
        now: &mut dyn FnMut() -> u64,
        fx: &mut Effects,
    ) {
        let Some(r) = self.routed.as_mut() else { return };
        if matches!(r.shadow, Shadowing::Off) {
            return;
        }
        let Primary::Capturing { observer, captured } = &mut r.primary else { return };
        let chunk = view.body(Dir::Response, size);
        let cap = if observer.is_some() { TEXT_CAPTURE_BYTES } else { MAX_WHOLE_BODY_BYTES };
        let room = cap.saturating_sub(captured.len());
        captured.extend_from_slice(chunk.get(..room.min(chunk.len())).unwrap_or_default());
        if let Some(observer) = observer.as_mut() {
            let outcome = observer.push(&chunk);
            if outcome.content_events > 0 {
                r.timing.on_content(now(), outcome.content_events);
            }
        }
        if end_of_stream {
            r.finish_primary(router, now(), fx);
        }
    }

    /// The request's teardown. `now` is asked only when needed (most requests end without it).
    pub fn on_log(&mut self, router: &mut Router, view: &mut dyn View, store: &mut dyn SharedStore, now: &mut dyn FnMut() -> u64, fx: &mut Effects) {
        let Some(r) = self.routed.as_mut() else { return };
        // Passive health: a version whose cluster has no healthy upstream is skipped for a while,
        // by every worker, and its traffic falls back in the policy's order.
        let details = view.property(&["response", "code_details"]).unwrap_or_default();
        if details.contains("no_healthy_upstream") {
            let until = now().saturating_add(UNHEALTHY_FOR_NS);
            // Unconditional: the latest mark wins, there is nothing to merge.
            if let Err(e) = store.set(&unhealthy_key(&r.decision.route), &store::encode_counter(until), 0) {
                fx.log(LogLevel::Warn, format!("marking {} unhealthy failed: {e}", r.decision.route));
            }
            fx.log(LogLevel::Info, format!("route {} has no healthy upstream: version {} skipped for 10 s", r.decision.route, r.decision.version));
        }
        r.drop_shadow_of_refused_request(router, view, fx);
        if !matches!(r.shadow, Shadowing::Off) && matches!(r.primary, Primary::Capturing { .. }) {
            r.finish_primary(router, now(), fx);
        }
    }
}

/// The sticky key of a request: the first configured source that is present (header values as
/// the bytes the client sent).
fn sticky_key(policy: &RoutingPolicy, view: &mut dyn View) -> Option<Vec<u8>> {
    let view = std::cell::RefCell::new(view);
    let mut header = |name: &str| view.borrow_mut().request_header_bytes(name);
    let mut property = |path: &[String]| crate::flow::property_at(&mut **view.borrow_mut(), path).map(String::into_bytes);
    policy.sticky_key(&mut header, &mut property).map(|k| k.bytes)
}

impl Routed {
    /// The access-log stamp of the decision (`%FILTER_STATE(wasm.sluice_route:PLAIN)%`): a JSON
    /// object, members in name order (the bytes it had when built as a serde_json map).
    fn stamp(&self, fx: &mut Effects) {
        let d = &self.decision;
        let mut s = String::with_capacity(160);
        s.push_str("{\"model\":");
        push_json_str(&mut s, &self.model);
        s.push_str(",\"reason\":");
        push_json_str(&mut s, d.reason.as_str());
        s.push_str(",\"route\":");
        push_json_str(&mut s, &d.route);
        s.push_str(",\"shadow\":");
        push_json_opt(&mut s, self.shadow.version());
        s.push_str(",\"upstream_model\":");
        push_json_str(&mut s, &d.upstream_model);
        s.push_str(",\"version\":");
        push_json_str(&mut s, &d.version);
        s.push('}');
        fx.set_state(ROUTE_PROPERTY, s);
        if self.traced {
            span::route(d.reason.as_str(), self.shadow.version(), fx);
        }
    }

    /// A filter behind the router (tenant-budget) refused the request: its shadow must not reach the
    /// shadow model either. Shadows leave on the root's next tick, so one still queued is dropped;
    /// one already sent runs on (counted under its own result).
    fn drop_shadow_of_refused_request(&mut self, router: &mut Router, view: &mut dyn View, fx: &mut Effects) {
        let Some(shadow_version) = self.shadow.version() else { return };
        if !view.gateway_reply().is_some_and(|g| g.end == GatewayEnd::Refused) {
            return;
        }
        let queued = router.jobs.len();
        router.jobs.retain(|job| job.request_id != self.request_id);
        if router.jobs.len() < queued {
            let pair = ShadowPair::new(&sanitize_label(&self.decision.version), &sanitize_label(shadow_version));
            fx.count(metrics::router_shadow_total(&pair, ShadowResult::Refused), 1);
            self.shadow = Shadowing::Off;
            self.stamp(fx);
            if self.traced {
                span::clear(span::SHADOW, fx);
            }
        }
    }

    /// The primary side of a shadowed request, handed over for comparison (once).
    fn finish_primary(&mut self, router: &mut Router, now: u64, fx: &mut Effects) {
        let Primary::Capturing { observer, captured } = std::mem::replace(&mut self.primary, Primary::Offered) else { return };
        let summary = match observer {
            Some(mut observer) => {
                observer.finish();
                observer.summary()
            }
            None => inspect_response_body(self.kind, &captured),
        };
        let text = response_text(self.kind, &captured, TEXT_COMPARE_CHARS);
        let side = Side::of(self.status, self.timing.duration_ns(now), self.timing.ttft_ns(), &summary, text);
        let versions = (self.decision.version.clone(), self.shadow.version().unwrap_or_default().to_string());
        router.offer(&self.request_id, versions, Some(side), None, fx);
    }
}

#[cfg(test)]
mod tests;
