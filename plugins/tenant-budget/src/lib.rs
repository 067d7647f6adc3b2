//! sluice tenant-budget: a proxy-wasm HTTP filter that decides, before a request reaches the model,
//! whether its key (and the key's team and org) may spend, reserves the worst case, and settles
//! exactly what was spent when the response ends — or is cut short.
//!
//! The adapter only moves bytes and time between Envoy and `sluice-core::budget`; every decision is
//! made there. The request body is held until admission, because a request that does not fit must
//! never reach the model; the response is never held.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};
use sluice_core::api::ApiKind;
use sluice_core::budget::identities::identity_hash;
use sluice_core::budget::ledger::Counter;
use sluice_core::budget::policy::{CounterSpec, JwtConfig, LedgerFailure, LedgerMode, Limit, Mode};
use sluice_core::budget::remote::PendingReserve;
use sluice_core::budget::{Admission, AdmitError, Demand, Policy};
use sluice_core::contract::GatewayEnd;
use sluice_core::identity::{api_key_from_headers, jwt_payload_claim, sha256_hex};
use sluice_core::metrics::{self, LedgerCall, LedgerFallback, LedgerResult};
use sluice_core::reply::error_body;
use sluice_core::report::{sanitize_label, LabelBound, Outcome};
use sluice_core::request::{inspect_request_with_kind, RequestInfo};
use sluice_core::response::{inspect_response_body, StreamObserver};
use sluice_core::rewrite::{rewrite_request, UsageChunkStripper};
use sluice_core::sse::DEFAULT_MAX_EVENT_BYTES;
use sluice_core::usage::Usage;
use sluice_proxy_host as host;
use sluice_proxy_host::{HeaderPairs, SharedData};
use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::rc::Rc;
use std::time::Duration;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    sluice_proxy_host::install_panic_hook("tenant-budget");
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// Largest request body the plugin will hold to admit it. A larger body cannot be sized, so it is
/// refused (413) rather than let through unbudgeted.
const MAX_REQUEST_BODY_BYTES: usize = 8 * 1024 * 1024;
/// Strict mode: tokens added to the body-size bound of a request that defines tools, for the
/// tool-use instructions providers add to the prompt (Anthropic documents up to 530 tokens;
/// DeepSeek's template adds 103). See docs/estimate-calibration.md.
const TOOL_PROMPT_ALLOWANCE: u64 = 1024;
/// Largest non-streaming response body copied to read its usage.
const MAX_RESPONSE_BODY_BYTES: usize = 4 * 1024 * 1024;

/// Settlements waiting to be sent to the Redis ledger, most kept per VM; beyond it the oldest is
/// dropped (its hold then expires and is charged at its reserved amount: conservative).
const MAX_QUEUED_SETTLEMENTS: usize = 16_384;
/// How long after a request vanished mid-reservation its release is sent.
const RELEASE_DELAY_NS: u64 = 1_000_000_000;
/// Attempts per settlement before it is left to expire.
const MAX_SETTLE_ATTEMPTS: u32 = 50;
/// The root's tick in Redis mode: it sends queued settlements (a stream's own callouts die with
/// the stream, so settlement is the root's).
const SETTLE_TICK: Duration = Duration::from_millis(20);

struct Shared {
    policy: Policy,
    metrics: host::Metrics,
    /// The charge metrics' model-version label: the version comes from the request.
    model_versions: LabelBound,
    /// Makes this VM's Redis hold ids unique across VMs and Envoy processes.
    vm_nonce: String,
    settle_queue: VecDeque<SettleJob>,
    /// Settlements in flight, by callout token.
    settle_calls: BTreeMap<u32, (SettleJob, u64)>,
    /// The Redis ledger's last known state (`None` before the first call): logged on change only.
    ledger_ok: Option<bool>,
}

/// One settlement for the Redis ledger (idempotent per hold id: retries are safe).
struct SettleJob {
    body: Vec<u8>,
    attempts: u32,
    /// Not before this host time (backoff after a failure).
    not_before_ns: u64,
}

impl Shared {
    /// Logs the ledger's state when it changes (not per request) and exports it as a gauge.
    fn ledger_health(&mut self, ok: bool, why: &str) {
        if self.ledger_ok == Some(ok) {
            return;
        }
        if ok && self.ledger_ok.is_none() {
            // The first answer: nothing changed.
        } else if ok {
            log::warn!("tenant-budget: the Redis ledger answers again");
        } else {
            log::warn!("tenant-budget: the Redis ledger is failing ({why}); on_failure = {:?}", self.policy.ledger.on_failure);
        }
        self.ledger_ok = Some(ok);
        self.metrics.set_gauge(metrics::budget_ledger_up(), u64::from(ok));
    }

    /// Gives back an admission's whole reservation (a request admitted but then not sent).
    fn release(&mut self, admission: &Admission, now: u64) {
        if admission.remote.is_some() {
            self.queue_settlement(admission, &Usage::default(), now);
        } else {
            self.policy.settle(&mut SharedData, admission, &Usage::default(), now);
        }
    }

    /// Queues the release of a reservation whose fate is unknown (its answer never came, or the
    /// request went away before it did), sent [`RELEASE_DELAY_NS`] later.
    fn queue_release(&mut self, pending: &PendingReserve, now: u64) {
        if self.settle_queue.len() >= MAX_QUEUED_SETTLEMENTS {
            self.metrics.add(MetricType::Counter, metrics::budget_ledger_settlements_dropped_total(), 1);
            return;
        }
        self.settle_queue.push_back(SettleJob { body: pending.release_body(), attempts: 0, not_before_ns: now.saturating_add(RELEASE_DELAY_NS) });
    }

    /// Queues the Redis settlement of `admission` at `actual`; returns the settlement it makes.
    fn queue_settlement(&mut self, admission: &Admission, actual: &Usage, now: u64) -> Option<sluice_core::budget::Settlement> {
        let (body, settlement) = self.policy.remote_settle(admission, actual)?;
        if self.settle_queue.len() >= MAX_QUEUED_SETTLEMENTS {
            self.settle_queue.pop_front();
            self.metrics.add(MetricType::Counter, metrics::budget_ledger_settlements_dropped_total(), 1);
        }
        self.settle_queue.push_back(SettleJob { body, attempts: 0, not_before_ns: now });
        Some(settlement)
    }
}

/// Starts a call to the Redis ledger service through its Envoy cluster.
fn ledger_call(policy: &Policy, path: &str, body: &[u8]) -> Result<u32, String> {
    let cluster = policy.ledger.cluster.as_deref().unwrap_or_default();
    let headers = vec![(":method", "POST"), (":path", path), (":authority", policy.ledger.authority.as_str()), ("content-type", "application/json")];
    let timeout = Duration::from_millis(u64::from(policy.ledger.timeout_ms));
    proxy_wasm::hostcalls::dispatch_http_call(cluster, headers, Some(body), vec![], timeout).map_err(|status| format!("{status:?}"))
}

/// A hold id unique to this request attempt: the VM's nonce, the stream and the time.
fn ledger_request_id(vm_nonce: &str, context_id: u32, now_ns: u64) -> String {
    format!("{vm_nonce}-{context_id:x}-{now_ns:x}")
}

#[derive(Default)]
struct Root {
    shared: Option<Rc<RefCell<Shared>>>,
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        let Some(shared) = self.shared.clone() else { return };
        let mut sh = shared.borrow_mut();
        let Some((job, started)) = sh.settle_calls.remove(&token) else { return };
        let now = host::now_ns();
        let status = host::call_status();
        let body = host::body(BufferType::HttpCallResponseBody, body_size.min(64 * 1024));
        // 200 with any answer is final: settled now, or already (a retry), or expired (charged at
        // its reservation by the ledger).
        let done = status == 200 && serde_json::from_slice::<serde_json::Value>(&body).is_ok_and(|v| v.get("settled").is_some());
        // A 400 is final: the ledger judged the settlement itself malformed, a retry cannot fix it.
        let rejected = status == 400;
        let result = if done {
            LedgerResult::Ok
        } else if status == 0 {
            LedgerResult::Timeout
        } else if rejected {
            LedgerResult::Rejected
        } else {
            LedgerResult::Error
        };
        sh.metrics.add(MetricType::Counter, metrics::budget_ledger_calls_total(LedgerCall::Settle, result), 1);
        sh.metrics.record(metrics::budget_ledger_latency_ms(LedgerCall::Settle), now.saturating_sub(started) / 1_000_000);
        if done {
            sh.ledger_health(true, "");
        } else if rejected {
            log::error!("tenant-budget: the Redis ledger rejected a settlement: {}", String::from_utf8_lossy(&body));
        } else {
            sh.ledger_health(false, &format!("settle answered HTTP {status}"));
            retry_settlement(&mut sh, job, now);
        }
    }
}

/// Puts a failed settlement back with a growing delay, or gives up after
/// [`MAX_SETTLE_ATTEMPTS`] (the hold then expires and is charged at its reservation).
fn retry_settlement(sh: &mut Shared, mut job: SettleJob, now: u64) {
    job.attempts += 1;
    if job.attempts >= MAX_SETTLE_ATTEMPTS {
        sh.metrics.add(MetricType::Counter, metrics::budget_ledger_settlements_dropped_total(), 1);
        return;
    }
    let backoff_ms = u64::from(job.attempts.min(20)) * 100;
    job.not_before_ns = now.saturating_add(backoff_ms * 1_000_000);
    sh.settle_queue.push_back(job);
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let Some(bytes) = host::plugin_configuration() else { return false };
        let policy = match Policy::from_json(&bytes) {
            Ok(p) => p,
            Err(e) => {
                log::error!("tenant-budget policy refused: {e}");
                return false;
            }
        };
        if let Err(e) = policy.ensure_counters(&mut SharedData) {
            log::warn!("creating budget counters failed: {e}");
        }
        log::info!("tenant-budget configured: {} keys, {} budget counters", policy.keys.len(), policy.counters.len());
        let model_versions = LabelBound::new(policy.model_versions.iter().cloned(), policy.max_dynamic_model_versions);
        if policy.ledger.mode == LedgerMode::Redis {
            if let Err(status) = proxy_wasm::hostcalls::set_tick_period(SETTLE_TICK) {
                log::error!("tenant-budget: cannot set the settlement tick ({status:?}); Redis holds would only expire");
                return false;
            }
        }
        // The node id tells Envoy processes apart, the configure time VMs of one process.
        let node = host::property(&["node".into(), "id".into()]).unwrap_or_default();
        let vm_nonce = format!("{}{:x}", &sha256_hex(node.as_bytes())[..8], host::now_ns());
        self.shared = Some(Rc::new(RefCell::new(Shared {
            policy,
            metrics: host::Metrics::default(),
            model_versions,
            vm_nonce,
            settle_queue: VecDeque::new(),
            settle_calls: BTreeMap::new(),
            ledger_ok: None,
        })));
        true
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream { context_id, shared: self.shared.clone(), state: None }))
    }

    fn on_tick(&mut self) {
        let Some(shared) = self.shared.clone() else { return };
        let mut sh = shared.borrow_mut();
        let now = host::now_ns();
        // Bounded per tick (jobs looked at, calls started); the rest waits for the next one. Jobs
        // still backing off go round to the back.
        let mut started = 0;
        for _ in 0..sh.settle_queue.len().min(1024) {
            let Some(job) = sh.settle_queue.pop_front() else { break };
            if job.not_before_ns > now || started >= 256 {
                sh.settle_queue.push_back(job);
                continue;
            }
            match ledger_call(&sh.policy, "/v1/settle", &job.body) {
                Ok(token) => {
                    started += 1;
                    sh.settle_calls.insert(token, (job, now));
                }
                Err(e) => {
                    sh.ledger_health(false, &format!("settle callout not started: {e}"));
                    retry_settlement(&mut sh, job, now);
                }
            }
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Stream {
    context_id: u32,
    shared: Option<Rc<RefCell<Shared>>>,
    state: Option<Box<Budgeted>>,
}

/// A request on an LLM path, from identification to settlement.
struct Budgeted {
    kind: ApiKind,
    key: Option<usize>,
    /// Hash of the request's identity for `identity_budgets`.
    identity: Option<String>,
    model_version: Option<String>,
    /// Whether `stream_options.include_usage` is to be added.
    inject_usage: bool,
    /// Redis mode: the request body, held until the ledger answers (then rewritten).
    held_body: Vec<u8>,
    /// Redis mode: the reservation waiting for the ledger (callout token, request, start).
    reserve: Option<(u32, PendingReserve, u64)>,
    /// The reservation now waiting is the clamped retry of a refused one.
    clamped_retry: bool,
    request: Option<RequestInfo>,
    admission: Option<Admission>,
    decision: &'static str,
    reject_code: Option<String>,
    injected_usage: bool,
    /// Budget past its soft limit, announced in a response header.
    soft_warning: Option<String>,
    status: u16,
    observer: Option<StreamObserver>,
    stripper: Option<UsageChunkStripper>,
    response_body: Vec<u8>,
    settled: bool,
    stamp: serde_json::Map<String, serde_json::Value>,
}

impl Context for Stream {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        if self.state.as_ref().and_then(|b| b.reserve.as_ref()).map(|(t, _, _)| *t) != Some(token) {
            return;
        }
        let status = host::call_status();
        let body = host::body(BufferType::HttpCallResponseBody, body_size.min(64 * 1024));
        self.on_reserve_reply(status, &body);
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        let Some(shared) = self.shared.clone() else { return Action::Continue };
        // One read of the map for the path, the identity sources, the version and the encoding.
        let headers = host::headers(MapType::HttpRequestHeaders);
        let path = headers.text(":path").unwrap_or_default();
        let Some(kind) = ApiKind::from_path(&path) else { return Action::Continue };
        let sh = shared.borrow();
        let policy = &sh.policy;
        let key = identify(policy, &headers);
        let identity = per_identity(policy, &headers);
        let model_version = headers.text(&policy.model_version_header);
        let mut b = Box::new(Budgeted {
            kind,
            key,
            identity,
            model_version,
            inject_usage: false,
            held_body: Vec::new(),
            reserve: None,
            clamped_retry: false,
            request: None,
            admission: None,
            decision: "pending",
            reject_code: None,
            injected_usage: false,
            soft_warning: None,
            status: 0,
            observer: None,
            stripper: None,
            response_body: Vec::new(),
            settled: false,
            stamp: serde_json::Map::new(),
        });
        let Some(key) = key else {
            drop(sh);
            b.decision = "rejected";
            b.reject_code = Some("unknown_key".into());
            self.state = Some(b);
            self.reject(401, "authentication_error", "unknown_key", "the request's API key or tenant is not in the budget policy", None);
            return Action::Pause;
        };
        if let Some(node) = policy.keys.get(key) {
            b.stamp.insert("key".into(), node.id.clone().into());
            b.stamp.insert("team".into(), node.team.clone().into());
            b.stamp.insert("org".into(), node.org.clone().into());
        }
        if let Some(enc) = headers.first("content-encoding") {
            if !enc.eq_ignore_ascii_case(b"identity") {
                drop(sh);
                self.state = Some(b);
                self.reject(415, "invalid_request_error", "encoded_body", "compressed request bodies cannot be budgeted; send identity encoding", None);
                return Action::Pause;
            }
        }
        drop(sh);
        self.state = Some(b);
        if end_of_stream {
            // No body at all: nothing to size.
            self.reject(400, "invalid_request_error", "no_body", "an LLM request needs a JSON body", None);
            return Action::Pause;
        }
        // The body may be rewritten (output limit, include_usage): its length will change.
        host::set_header(MapType::HttpRequestHeaders, "content-length", None);
        // Headers continue: Envoy's wasm host turns a paused header phase into "stop everything",
        // and the body would then never reach this filter. The body is held instead (below) until
        // admission, so a refused request reaches the upstream as headers and a reset, no body —
        // the model never sees it.
        Action::Continue
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(b) = self.state.as_ref() else { return Action::Continue };
        if b.decision != "pending" {
            return Action::Pause;
        }
        if body_size > MAX_REQUEST_BODY_BYTES {
            self.reject(413, "request_too_large", "body_too_large", "request body too large to budget", None);
            return Action::Pause;
        }
        if !end_of_stream {
            // Envoy buffers until the whole body is here (bounded by its buffer limits and ours).
            return Action::Pause;
        }
        let body = host::body(BufferType::HttpRequestBody, body_size);
        self.admit(&body, body_size)
    }

    fn on_http_response_headers(&mut self, _n: usize, _eos: bool) -> Action {
        let Some(shared) = self.shared.clone() else { return Action::Continue };
        let Some(b) = self.state.as_mut() else { return Action::Continue };
        b.status = host::header(MapType::HttpResponseHeaders, ":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        let Some(admission) = &b.admission else { return Action::Continue };
        let streaming = host::header(MapType::HttpResponseHeaders, "content-type").is_some_and(|c| c.to_ascii_lowercase().starts_with("text/event-stream"));
        if streaming {
            b.observer = Some(StreamObserver::new(b.kind));
            if b.injected_usage {
                b.stripper = Some(UsageChunkStripper::new(DEFAULT_MAX_EVENT_BYTES));
            }
        }
        let sh = shared.borrow();
        for (name, value) in rate_headers(&sh.policy, admission) {
            host::set_header(MapType::HttpResponseHeaders, &name, Some(&value));
        }
        if let Some(code) = &b.soft_warning {
            host::set_header(MapType::HttpResponseHeaders, "x-sluice-budget-warning", Some(&format!("soft limit reached: {code}")));
        }
        if admission.clamped {
            host::set_header(MapType::HttpResponseHeaders, "x-sluice-clamped-max-tokens", Some(&admission.output_tokens.to_string()));
        }
        if b.stripper.is_some() {
            // The body changes length when the usage chunk is removed.
            host::set_header(MapType::HttpResponseHeaders, "content-length", None);
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(b) = self.state.as_mut() else { return Action::Continue };
        if b.admission.is_none() {
            return Action::Continue;
        }
        let chunk = host::body(BufferType::HttpResponseBody, body_size);
        if let Some(observer) = b.observer.as_mut() {
            observer.push(&chunk);
            if end_of_stream {
                observer.finish();
            }
        } else if b.response_body.len() + chunk.len() <= MAX_RESPONSE_BODY_BYTES {
            b.response_body.extend_from_slice(&chunk);
        }
        if let Some(stripper) = b.stripper.as_mut() {
            let mut out = stripper.push(&chunk);
            if end_of_stream {
                out.extend_from_slice(&stripper.finish());
            }
            if out != chunk {
                host::replace_body(BufferType::HttpResponseBody, body_size, &out);
            }
        }
        if end_of_stream {
            self.settle(Outcome::Completed);
        }
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _n: usize) -> Action {
        // Trailers end the response: the body saw no end_of_stream.
        if let Some(observer) = self.state.as_mut().and_then(|b| b.observer.as_mut()) {
            observer.finish();
        }
        self.settle(Outcome::Completed);
        Action::Continue
    }

    fn on_log(&mut self) {
        // Gone while the Redis ledger decided (Envoy cancelled the callout): release the hold it may
        // have made. Sent a second later, so that the reservation has landed first.
        if let (Some(shared), Some((_, pending, _))) = (self.shared.clone(), self.state.as_mut().and_then(|b| b.reserve.take())) {
            shared.borrow_mut().queue_release(&pending, host::now_ns());
        }
        if self.state.as_ref().is_some_and(|b| !b.settled) {
            let outcome = host::interrupted_outcome();
            if let Some(observer) = self.state.as_mut().and_then(|b| b.observer.as_mut()) {
                observer.finish();
            }
            self.settle(outcome);
        }
    }
}

/// Resolves the request's key from the configured authenticated sources, in order: API key hash,
/// auth-filter header, JWT claim; falls back to the policy's default key for unknown callers.
fn identify(policy: &Policy, headers: &HeaderPairs) -> Option<usize> {
    let id = &policy.identity;
    let found = first_credential(headers, id.api_key, id.header.as_deref(), id.jwt.as_ref(), |credential| match credential {
        Credential::ApiKeyHash(hash) => policy.key_by_api_key_hash(&hash),
        Credential::Header(value) | Credential::JwtClaim(value) => policy.key_by_id(&value),
    });
    found.or(policy.unknown_default)
}

/// The identity `identity_budgets` count by, hashed: the first per-identity source present. `None`
/// when the policy has none or the request carries none (it then counts as `anonymous`).
fn per_identity(policy: &Policy, headers: &HeaderPairs) -> Option<String> {
    let source = policy.identity.per_identity.as_ref()?;
    first_credential(headers, source.api_key, source.header.as_deref(), source.jwt.as_ref(), |credential| {
        Some(identity_hash(&match credential {
            Credential::ApiKeyHash(hash) => format!("api_key:{hash}"),
            Credential::Header(value) if value.is_empty() => return None,
            Credential::Header(value) => format!("header:{value}"),
            Credential::JwtClaim(claim) => format!("jwt:{claim}"),
        }))
    })
}

/// What a request presents, from one of the authenticated sources a policy names.
enum Credential {
    /// SHA-256 (lowercase hex) of `Authorization: Bearer …` / `x-api-key`.
    ApiKeyHash(String),
    /// The trimmed value of the header an auth filter in front writes.
    Header(String),
    /// A claim of the payload jwt_authn verified and forwards.
    JwtClaim(String),
}

/// Tries the sources in the documented order (API key, header, JWT claim) and returns the first
/// credential `accept` maps to something; a source that is absent, or not accepted, passes to the next.
///
/// A header that is present more than once is no credential (nor is one whose count the host cannot
/// give): Envoy's single-value read returns only the first copy, so a client's copy ahead of the one
/// an auth filter appended — or two copies naming two tenants — must not name anyone.
fn first_credential<T>(
    headers: &HeaderPairs,
    api_key: bool,
    header: Option<&str>,
    jwt: Option<&JwtConfig>,
    mut accept: impl FnMut(Credential) -> Option<T>,
) -> Option<T> {
    if api_key {
        if let Some(key) = api_key_from_headers(headers.single("authorization"), headers.single("x-api-key")) {
            if let Some(found) = accept(Credential::ApiKeyHash(sha256_hex(&key))) {
                return Some(found);
            }
        }
    }
    if let Some(value) = header.and_then(|h| headers.single(h)).map(String::from_utf8_lossy) {
        if let Some(found) = accept(Credential::Header(value.trim().to_string())) {
            return Some(found);
        }
    }
    let claim = jwt.and_then(|j| headers.single(&j.header).and_then(|payload| jwt_payload_claim(payload, &j.claim)))?;
    accept(Credential::JwtClaim(claim))
}

/// `x-ratelimit-*` headers for the tightest window of each unit (least room left).
fn rate_headers(policy: &Policy, admission: &Admission) -> Vec<(String, String)> {
    let mut tightest: [Option<(u64, u64, u64)>; 3] = [None, None, None];
    let now = host::now_ns();
    for ((index, _), counter) in admission.leases.iter().zip(&admission.after) {
        let Some(spec) = policy.counters.get(*index) else { continue };
        let slot = match spec.limit {
            Limit::Tokens { .. } => 0,
            Limit::Requests(_) => 1,
            Limit::MicroUsd(_) => 2,
        };
        let limit = spec.limit.value();
        let remaining = limit.saturating_sub(counter.committed());
        let reset_s = spec.window.end_ns(now).saturating_sub(now).div_ceil(1_000_000_000);
        if let Some(entry) = tightest.get_mut(slot) {
            if entry.is_none_or(|(_, r, _)| remaining < r) {
                *entry = Some((limit, remaining, reset_s));
            }
        }
    }
    let mut out = Vec::new();
    for (unit, entry) in ["tokens", "requests", "micro-usd"].iter().zip(tightest) {
        if let Some((limit, remaining, reset)) = entry {
            out.push((format!("x-ratelimit-limit-{unit}"), limit.to_string()));
            out.push((format!("x-ratelimit-remaining-{unit}"), remaining.to_string()));
            out.push((format!("x-ratelimit-reset-{unit}"), format!("{reset}s")));
        }
    }
    out
}

/// Ids of the request's key, its team and its org (`unknown` before the key is identified).
fn key_path(policy: &Policy, key: Option<usize>) -> (String, String, String) {
    match key.and_then(|k| policy.keys.get(k)) {
        Some(node) => (node.id.clone(), node.team.clone(), node.org.clone()),
        None => ("unknown".into(), "unknown".into(), "unknown".into()),
    }
}

impl Stream {
    fn reject(&mut self, status: u32, error_type: &str, code: &str, message: &str, retry_after_s: Option<u64>) {
        let kind = self.state.as_ref().map(|b| b.kind);
        if let (Some(shared), Some(b)) = (self.shared.as_ref(), self.state.as_mut()) {
            b.decision = "rejected";
            b.reject_code = Some(code.to_string());
            b.settled = true;
            let (key, _, _) = key_path(&shared.borrow().policy, b.key);
            shared.borrow_mut().metrics.add(MetricType::Counter, &metrics::budget_rejections_total(&sanitize_label(&key), &sanitize_label(code)), 1);
            b.stamp.insert("decision".into(), "rejected".into());
            b.stamp.insert("reject_code".into(), code.into());
            b.stamp.insert("status".into(), status.into());
            b.stamp.insert("outcome".into(), Outcome::Refused.as_str().into());
            write_stamp(&shared.borrow().policy.filter_state_key, &b.stamp);
        }
        let body = error_body(kind, message, error_type, code);
        let retry = retry_after_s.map(|s| s.to_string());
        let mut headers = vec![("content-type", "application/json")];
        if let Some(r) = retry.as_deref() {
            headers.push(("retry-after", r));
        }
        host::gateway_local_reply(GatewayEnd::Refused, status, &headers, body.as_bytes());
    }

    fn admit(&mut self, body: &[u8], body_size: usize) -> Action {
        let Some(shared) = self.shared.clone() else { return Action::Continue };
        let Some(b) = self.state.as_mut() else { return Action::Continue };
        let Some(key) = b.key else { return Action::Pause };
        let info = match inspect_request_with_kind(b.kind, body) {
            Ok((kind, info)) => {
                // A chat body posted to a completions path is a chat request: size, rewrite and
                // read the response as one.
                b.kind = kind;
                info
            }
            Err(e) => {
                let message = format!("request body cannot be budgeted: {e}");
                self.reject(400, "invalid_request_error", "malformed_body", &message, None);
                return Action::Pause;
            }
        };
        let sh = shared.borrow();
        let policy = &sh.policy;
        let ceiling = policy.keys.get(key).and_then(|k| k.max_output_tokens).unwrap_or(policy.default_max_output_tokens);
        let output = info.max_output_tokens.map_or(ceiling, |requested| requested.min(ceiling));
        let input = match policy.mode {
            // Every prompt token comes from at least one byte of the body (message text, tool
            // definitions), and a chat template's per-message tokens are fewer than the JSON framing
            // bytes of each message: the body size bounds the prompt for any tokenizer.
            Mode::Strict => (body.len() as u64).saturating_add(if info.has_tools { TOOL_PROMPT_ALLOWANCE } else { 0 }),
            Mode::Estimate => info.prompt_tokens_estimate.saturating_mul(100 + u64::from(policy.estimate_margin_percent)).div_ceil(100),
        };
        let demand =
            Demand { input_tokens: input, output_tokens: output, choices: info.output_choices, model: info.model.clone(), identity: b.identity.clone() };
        let now = host::now_ns();
        b.inject_usage = policy.include_usage && info.stream && !info.include_usage;
        b.request = Some(info);
        if policy.ledger.mode == LedgerMode::Redis {
            let id = ledger_request_id(&sh.vm_nonce, self.context_id, now);
            let pending = match policy.remote_reserve(key, &demand, now, &id) {
                Ok(p) => p,
                Err(e) => {
                    drop(sh);
                    return self.decided(Err(e), body, body_size);
                }
            };
            drop(sh);
            b.held_body = body.to_vec();
            return self.dispatch_reserve(pending);
        }
        let result = policy.admit(&mut SharedData, key, &demand, now);
        drop(sh);
        self.decided(result, body, body_size)
    }

    /// Sends a reservation to the Redis ledger; the request waits (paused) for the answer.
    fn dispatch_reserve(&mut self, pending: PendingReserve) -> Action {
        let Some(shared) = self.shared.clone() else { return Action::Continue };
        let call = {
            let sh = shared.borrow();
            ledger_call(&sh.policy, "/v1/reserve", &pending.body)
        };
        match call {
            Ok(token) => {
                if let Some(b) = self.state.as_mut() {
                    // Named in the stamp from here on, whatever the answer: a hold can be traced.
                    b.stamp.insert("ledger_hold".into(), pending.id.clone().into());
                    b.reserve = Some((token, pending, host::now_ns()));
                }
                Action::Pause
            }
            Err(e) => {
                let body = self.state.as_mut().map(|b| std::mem::take(&mut b.held_body)).unwrap_or_default();
                self.ledger_failed(&format!("reserve callout not started: {e}"), pending, &body)
            }
        }
    }

    /// The Redis ledger did not answer usably: the policy's `on_failure` decides.
    fn ledger_failed(&mut self, why: &str, pending: PendingReserve, body: &[u8]) -> Action {
        let Some(shared) = self.shared.clone() else { return Action::Continue };
        let on_failure = {
            let mut sh = shared.borrow_mut();
            sh.ledger_health(false, why);
            sh.policy.ledger.on_failure
        };
        let size = body.len();
        match on_failure {
            LedgerFailure::Deny => {
                self.reject(503, "overloaded", "budget_ledger_unavailable", "the budget ledger is unavailable; retry shortly", Some(1));
                Action::Pause
            }
            LedgerFailure::Allow => {
                if let Some(b) = self.state.as_mut() {
                    b.decision = "unbudgeted";
                    b.stamp.insert("decision".into(), "unbudgeted".into());
                    write_stamp(&shared.borrow().policy.filter_state_key, &b.stamp);
                }
                shared.borrow_mut().metrics.add(MetricType::Counter, metrics::budget_ledger_fallback_total(LedgerFallback::Allow), 1);
                Action::Continue
            }
            LedgerFailure::Local => {
                let key = self.state.as_ref().and_then(|b| b.key);
                let result = {
                    let mut sh = shared.borrow_mut();
                    sh.metrics.add(MetricType::Counter, metrics::budget_ledger_fallback_total(LedgerFallback::Local), 1);
                    match key {
                        Some(key) => sh.policy.admit_fallback(&mut SharedData, key, pending.demand(), host::now_ns()),
                        None => Err(AdmitError::Store("no key".into())),
                    }
                };
                self.decided(result, body, size)
            }
        }
    }

    /// The Redis ledger's answer to this request's reservation.
    fn on_reserve_reply(&mut self, status: u16, reply: &[u8]) {
        let Some(shared) = self.shared.clone() else { return };
        let Some((_, pending, started)) = self.state.as_mut().and_then(|b| b.reserve.take()) else { return };
        let now = host::now_ns();
        let result = {
            let mut sh = shared.borrow_mut();
            let result = sh.policy.remote_admission(&pending, status, reply);
            let outcome = match &result {
                Ok(_) | Err(AdmitError::Exceeded(_)) => LedgerResult::Ok,
                Err(_) if status == 0 => LedgerResult::Timeout,
                Err(_) => LedgerResult::Error,
            };
            sh.metrics.add(MetricType::Counter, metrics::budget_ledger_calls_total(LedgerCall::Reserve, outcome), 1);
            sh.metrics.record(metrics::budget_ledger_latency_ms(LedgerCall::Reserve), now.saturating_sub(started) / 1_000_000);
            if outcome == LedgerResult::Ok {
                sh.ledger_health(true, "");
            }
            result
        };
        let body = self.state.as_mut().map(|b| std::mem::take(&mut b.held_body)).unwrap_or_default();
        let size = body.len();
        let action = match result {
            Err(AdmitError::Exceeded(refusal)) => {
                let retry = shared.borrow().policy.remote_clamped(&pending, &refusal);
                match retry {
                    Some(clamped) => {
                        if let Some(b) = self.state.as_mut() {
                            b.held_body = body;
                            b.clamped_retry = true;
                        }
                        self.dispatch_reserve(clamped)
                    }
                    None => self.decided(Err(AdmitError::Exceeded(refusal)), &body, size),
                }
            }
            Err(AdmitError::Store(e)) => {
                // The reservation may still run in Redis after this (a stall past the timeout): release
                // it, a second later; the ledger's tombstone stops a reservation arriving after that.
                shared.borrow_mut().queue_release(&pending, now);
                self.ledger_failed(&e, pending, &body)
            }
            Ok(mut admission) => {
                admission.clamped = self.state.as_ref().is_some_and(|b| b.clamped_retry);
                self.decided(Ok(admission), &body, size)
            }
            Err(other) => self.decided(Err(other), &body, size),
        };
        if matches!(action, Action::Continue) {
            host::resume_request();
        }
    }

    /// Applies an admission decision (local or Redis): rewrite and stamp an admitted request, or
    /// answer a refused one.
    fn decided(&mut self, result: Result<Admission, AdmitError>, body: &[u8], body_size: usize) -> Action {
        let Some(shared) = self.shared.clone() else { return Action::Continue };
        let Some(b) = self.state.as_mut() else { return Action::Continue };
        let now = host::now_ns();
        match result {
            Ok(admission) => {
                let asked = b.request.as_ref().and_then(|r| r.max_output_tokens);
                let set_limit = (asked != Some(admission.output_tokens)).then_some(admission.output_tokens);
                if b.inject_usage || set_limit.is_some() {
                    match rewrite_request(b.kind, body, b.inject_usage, set_limit) {
                        Ok(rewrite) => {
                            b.injected_usage = rewrite.injected_include_usage;
                            if !host::try_replace_body(BufferType::HttpRequestBody, body_size, &rewrite.body) {
                                // The limit the reservation assumed cannot be written: not admitted.
                                shared.borrow_mut().release(&admission, now);
                                self.reject(
                                    503,
                                    "overloaded",
                                    "unrewritable_body",
                                    "the request body could not be updated to enforce the budget; retry",
                                    Some(1),
                                );
                                return Action::Pause;
                            }
                        }
                        Err(e) => {
                            // Parsed once already, so this is a number serde cannot round-trip: the
                            // output limit cannot be enforced, so the request cannot be admitted.
                            shared.borrow_mut().release(&admission, now);
                            let message = format!("request body cannot be rewritten to enforce the budget: {e}");
                            self.reject(400, "invalid_request_error", "unrewritable_body", &message, None);
                            return Action::Pause;
                        }
                    }
                }
                b.decision = if admission.clamped { "clamped" } else { "admitted" };
                let mut sh = shared.borrow_mut();
                let (key_id, _, _) = key_path(&sh.policy, b.key);
                if admission.clamped {
                    sh.metrics.add(MetricType::Counter, &metrics::budget_clamps_total(&key_id), 1);
                }
                for ((index, _), counter) in admission.leases.iter().zip(&admission.after) {
                    if let Some(spec) = sh.policy.counters.get(*index).cloned() {
                        if publish_counter(&mut sh, &spec, counter, 0, &key_id) && b.soft_warning.is_none() {
                            b.soft_warning = Some(spec.code.clone());
                        }
                    }
                }
                b.stamp.insert("decision".into(), b.decision.into());
                if let Some(hold) = &admission.remote {
                    b.stamp.insert("ledger".into(), "redis".into());
                    b.stamp.insert("ledger_hold".into(), hold.id.clone().into());
                } else if sh.policy.ledger.mode == LedgerMode::Redis {
                    b.stamp.insert("ledger".into(), "local_fallback".into());
                }
                b.stamp.insert("reserved_input_tokens".into(), admission.input_tokens.into());
                b.stamp.insert("reserved_output_tokens".into(), admission.reserved_output_tokens().into());
                b.stamp.insert("reserved_tokens".into(), admission.input_tokens.saturating_add(admission.reserved_output_tokens()).into());
                b.stamp.insert("reserved_micro_usd".into(), admission.reserved_micro_usd.into());
                write_stamp(&sh.policy.filter_state_key, &b.stamp);
                b.admission = Some(admission);
                Action::Continue
            }
            Err(AdmitError::Exceeded(refusal)) => {
                let code = shared.borrow().policy.counters.get(refusal.counter).map(|c| c.code.clone()).unwrap_or_default();
                let message = format!(
                    "budget {code} exceeded: {} used and {} reserved of {}; resets in {} s",
                    refusal.used, refusal.reserved, refusal.limit, refusal.retry_after_s
                );
                self.reject(429, "budget_exceeded", &code, &message, Some(refusal.retry_after_s));
                Action::Pause
            }
            Err(AdmitError::Unpriced { model, .. }) => {
                let message = format!("no price is configured for model {model:?}, and a money budget applies");
                self.reject(400, "invalid_request_error", "unpriced_model", &message, None);
                Action::Pause
            }
            Err(AdmitError::Store(e)) => {
                log::warn!("budget store failed, refusing: {e}");
                self.reject(503, "overloaded", "budget_store_unavailable", "budget ledger busy, retry", Some(1));
                Action::Pause
            }
        }
    }

    fn settle(&mut self, outcome: Outcome) {
        let (Some(shared), Some(b)) = (self.shared.clone(), self.state.as_mut()) else { return };
        if b.settled {
            return;
        }
        b.settled = true;
        let Some(admission) = b.admission.take() else {
            // Refused by another plugin before admission (latency-guard's shedding): nothing was
            // reserved; the stamp still tells the request's story.
            if let Some(g) = host::gateway_reply() {
                b.stamp.insert("decision".into(), "not_evaluated".into());
                b.stamp.insert("status".into(), g.status.into());
                b.stamp.insert("outcome".into(), Outcome::from(g.end).as_str().into());
                write_stamp(&shared.borrow().policy.filter_state_key, &b.stamp);
            }
            return;
        };
        let summary = match &b.observer {
            Some(observer) => observer.summary(),
            None => inspect_response_body(b.kind, &b.response_body),
        };
        let request = b.request.clone().unwrap_or_default();
        // A reply latency-guard generated (a deadline) is that status and outcome for the charge too.
        let gateway = host::gateway_reply();
        let status = gateway.map_or(b.status, |g| g.status);
        let produced = (200..300).contains(&b.status);
        let outcome = Outcome::classify(gateway, outcome, b.status, summary.upstream_error.is_some());
        // Charge what the upstream reports; without a report, what was seen (output) and the prompt
        // estimate (input). A refused or failed upstream answer produced nothing to charge, and
        // neither did a stream the gateway ended before any content reached it.
        // (Anthropic's message_start reports the input before any content: a 504 after it still
        // charges nothing.)
        let nothing_passed = outcome == Outcome::Deadline && summary.estimated_output_tokens == 0;
        let actual = match (produced, summary.usage_reported) {
            (true, true) => summary.usage,
            (true, false) if nothing_passed => Usage::default(),
            (true, false) => Usage {
                input_tokens: if summary.usage.input_tokens > 0 { summary.usage.input_tokens } else { request.prompt_tokens_estimate },
                output_tokens: summary.estimated_output_tokens,
                ..summary.usage
            },
            (false, _) => Usage::default(),
        };
        let now = host::now_ns();
        let mut sh = shared.borrow_mut();
        let settlement = match admission.remote {
            Some(_) => sh.queue_settlement(&admission, &actual, now).unwrap_or_default(),
            None => sh.policy.settle(&mut SharedData, &admission, &actual, now),
        };
        let (key, team, org) = key_path(&sh.policy, b.key);
        let mv = sh.model_versions.label(b.model_version.as_deref().or(request.model.as_deref()).unwrap_or("unknown"));
        let labels = metrics::ChargeSeries::new(&key, &team, &org, &mv);
        let charged_tokens = actual.input_tokens.saturating_add(actual.output_tokens);
        sh.metrics.add(MetricType::Counter, &metrics::budget_charged_tokens_total(&labels), i64::try_from(charged_tokens).unwrap_or(i64::MAX));
        sh.metrics.add(MetricType::Counter, &metrics::budget_charged_micro_usd_total(&labels), i64::try_from(settlement.micro_usd).unwrap_or(i64::MAX));
        let reserved_tokens = admission.input_tokens.saturating_add(admission.reserved_output_tokens());
        sh.metrics.record(&metrics::budget_overestimate_tokens(&key), reserved_tokens.saturating_sub(charged_tokens));
        for (((index, lease), after), over) in admission.leases.iter().zip(&settlement.after).zip(&settlement.over_estimates) {
            if let (Some(spec), Some(counter)) = (sh.policy.counters.get(*index).cloned(), after) {
                let charged = u64::try_from(i128::from(lease.amount) - over).unwrap_or(0);
                publish_counter(&mut sh, &spec, counter, charged, &key);
            }
        }
        b.stamp.insert("input_tokens".into(), actual.input_tokens.into());
        b.stamp.insert("output_tokens".into(), actual.output_tokens.into());
        b.stamp.insert("charged_tokens".into(), charged_tokens.into());
        b.stamp.insert("charged_micro_usd".into(), settlement.micro_usd.into());
        b.stamp.insert("usage".into(), if summary.usage_reported { "reported" } else { "estimated" }.into());
        b.stamp.insert("status".into(), status.into());
        b.stamp.insert("outcome".into(), outcome.as_str().into());
        write_stamp(&sh.policy.filter_state_key, &b.stamp);
    }
}

/// Remaining-budget gauge for a counter, and the soft-limit announcement when it is crossed.
/// Publishes the remaining-budget gauge; returns whether the counter's *usage* is at or past its
/// soft limit (announced to the client). A crossing — this request's charge `charged` took usage
/// past it — is counted and logged once. Reservations do not count: a worst case that never
/// happens must not announce anything.
fn publish_counter(sh: &mut Shared, spec: &CounterSpec, counter: &Counter, charged: u64, key: &str) -> bool {
    if spec.per_identity {
        // One counter per identity: a gauge would need a label per identity (unbounded), and
        // without one it would show whichever identity was seen last. Only the announcement stays.
        return spec.soft_limit.is_some_and(|soft| counter.used >= soft);
    }
    sh.metrics.set_gauge(&metrics::budget_remaining(spec), spec.limit.value().saturating_sub(counter.committed()));
    let Some(soft) = spec.soft_limit else { return false };
    let used = counter.used;
    if charged > 0 && used >= soft && used.saturating_sub(charged) < soft {
        sh.metrics.add(MetricType::Counter, &metrics::budget_soft_limit_crossings_total(spec), 1);
        log::info!("soft limit of {} crossed by key {key}: {used} of {} used (soft limit {soft})", spec.code, spec.limit.value());
    }
    used >= soft
}

fn write_stamp(key: &str, stamp: &serde_json::Map<String, serde_json::Value>) {
    let json = serde_json::Value::Object(stamp.clone()).to_string();
    host::set_property(key, json.as_bytes());
}
