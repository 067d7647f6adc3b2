//! latency-guard's request life: per-tenant-class latency policies — TTFT and total deadlines, an
//! SLO circuit breaker per model version with fallback through model-router, and priority shedding
//! against per-version in-flight limits.
//!
//! Two types, as the host has two kinds of context:
//!
//! - [`GuardRoot`] (one per VM): the policy, the streams whose deadlines the tick watches (each
//!   one's [`StreamWatch`]), the tick period that follows what is due next, the breakers' sweep;
//! - [`GuardFlow`] (one per stream): the tenant's class, the admission decision and what the guard
//!   reads of the response, reported at the end.
//!
//! ```text
//! request headers ─► Undecided ── first request body chunk (model-router decided by then) ──► Admitted ── log ──► Reported
//!   (class, avoid list for model-router)  │                                                   (StreamWatch in the root)
//!                                          ├── breaker open, class rejects ──► Refused (503 + retry-after)
//!                                          ├── past the in-flight limit ─────► Refused (503)
//!                                          └── no version the policy names ─► Passed
//! ```
//!
//! Shared state (windows, breakers, in-flight counters) is read and written through the
//! [`SharedStore`] passed in; everything else the host does is an [`Effect`].

use super::{Dir, Effect, Effects, LogLevel, Verdict, View};
use crate::api::ApiKind;
use crate::contract::{self, FirstTokenMark, GatewayEnd, GatewayReply, AVOID_PROPERTY, FIRST_TOKEN_PROPERTY, RELEASE_PROPERTY, ROUTE_PROPERTY};
use crate::latency::deadline::{self, Finished};
use crate::latency::{
    self, breaker, window, Admission, Breaker, BreakerPolicy, LatencyPolicy, OpenAction, Priority, State, StreamWatch, TenantSource, Transition, VersionPolicy,
};
use crate::metrics::{self, ShedReason};
use crate::observation::Observer;
use crate::reply::error_body;
use crate::report::{sanitize_label, Outcome};
use crate::request::inspect_request_with_kind;
use crate::rewrite::rewrite_request;
use crate::store::{self, SharedStore, Updated};
use crate::timing::StreamTiming;
use std::sync::Arc;
use watchlist::Watchlist;

mod watchlist;

use crate::contract::MODEL_METADATA;
/// Access-log stamp: `%FILTER_STATE(wasm.sluice_latency:PLAIN)%`.
pub const STAMP_PROPERTY: &str = "sluice_latency";
/// How often each worker looks at open breakers (their way to half-open is time alone).
pub const BREAKER_SWEEP_NS: u64 = deadline::IDLE_TICK_NS;

/// Creates every shared value the policy needs (windows, breakers, in-flight counters) before
/// traffic: Envoy accepts any CAS token for a missing key, so a create could not be conditional.
/// `Err`: what could not be created, for the configuration's refusal.
pub fn ensure_shared_state(policy: &LatencyPolicy, store: &mut dyn SharedStore) -> Result<(), String> {
    for v in &policy.versions {
        if let Some(b) = &v.breaker {
            let w = window::ensure(store, &v.window_key(), &b.window);
            let s = breaker::ensure(store, &v.breaker_key());
            if let Err(e) = w.and(s) {
                return Err(format!("cannot create the shared state of {}: {e}", v.name));
            }
        }
        if v.in_flight.is_some() {
            if let Ok((None, _)) = store.get(&v.in_flight_key()) {
                if let Err(e) = store.set(&v.in_flight_key(), &store::encode_counter(0), 0) {
                    return Err(format!("cannot create the in-flight counter of {}: {e}", v.name));
                }
            }
        }
    }
    Ok(())
}

/// A watched stream: its deadline machine and what translating its effects needs.
#[derive(Debug)]
struct Watch {
    kind: ApiKind,
    /// Shared, not copied: effects are translated with it while the watch list is borrowed.
    version: Arc<str>,
    machine: StreamWatch,
    /// Envoy traces the request: a deadline's outcome goes on its span ([`crate::span`]).
    traced: bool,
    /// The machine's due time as the watch list last filed it ([`Watchlist`]).
    filed_due_ns: Option<u64>,
}

/// The guard's per-VM state (a VM is single-threaded; one per worker).
#[derive(Debug)]
pub struct GuardRoot {
    policy: LatencyPolicy,
    /// Streams the tick watches, by context id, in the order of what each is due for next.
    watched: Watchlist,
    /// The versions' windows as this worker last wrote them (a decode saved when no other worker
    /// wrote since).
    windows: latency::window::WindowCache,
    next_breaker_sweep_ns: u64,
    warned_no_first_token_signal: bool,
    /// This VM's release queue (its name), when it has one, and the VM id llm-metrics resolves it under.
    release_queue: Option<String>,
    vm_id: String,
    /// The tick period set now, ms: the time until the next thing due (a deadline, a reset, a
    /// held stream to look at), between 1 ms and the idle tick. A 1 ms tick whenever any stream
    /// was watched cost ≈ 2.5 % of a core per worker for nothing most of the time.
    tick_period_ms: u64,
    /// The host lets the guard decide at a held stream's first token in the hook that marks it
    /// (the native module: [`Self::on_release`] from the same stream's hook), so the tick's look
    /// at a held stream is a fallback, as with a release queue.
    woken_at_first_token: bool,
}

impl GuardRoot {
    /// A configured VM whose tick runs at the idle period. `release_queue`: the name of the queue
    /// llm-metrics wakes this VM through (`None`: held streams wait for the tick).
    pub fn new(policy: LatencyPolicy, release_queue: Option<String>, vm_id: String) -> GuardRoot {
        GuardRoot {
            policy,
            watched: Watchlist::default(),
            windows: latency::window::WindowCache::default(),
            next_breaker_sweep_ns: 0,
            warned_no_first_token_signal: false,
            release_queue,
            vm_id,
            tick_period_ms: deadline::IDLE_TICK_NS / 1_000_000,
            woken_at_first_token: false,
        }
    }

    /// A root whose host wakes it at a held stream's first token in the hook that marks it, with
    /// no release queue (the native module): held streams are then looked at by the tick as
    /// rarely as with a release queue ([`deadline::HELD_POLL_NS`]).
    pub fn woken_at_first_token(mut self) -> GuardRoot {
        self.woken_at_first_token = true;
        self
    }

    /// Whether the host wakes this root at a held stream's first token (a release queue, or the
    /// same hook).
    fn wakes_at_first_token(&self) -> bool {
        self.release_queue.is_some() || self.woken_at_first_token
    }

    /// When stream `id`'s tick next has something to do ([`StreamWatch::next_due_ns`]); `None`
    /// when it is not watched or waits only for its end. A host that ticks each stream on its own
    /// (the native module's tick thread) ticks it then, and not before.
    pub fn stream_due_ns(&self, id: u32, now: u64) -> Option<u64> {
        self.watched.get(id).and_then(|w| w.machine.next_due_ns(now, self.wakes_at_first_token()))
    }

    pub fn policy(&self) -> &LatencyPolicy {
        &self.policy
    }

    /// The streams the tick watches now.
    pub fn watched_ids(&self) -> Vec<u32> {
        self.watched.ids().collect()
    }

    /// The watched streams a tick at `now` acts on ([`StreamWatch::tick_due`]), in ascending id
    /// order; the tick of any other would be a no-op.
    pub fn due_ids(&self, now: u64) -> impl Iterator<Item = u32> {
        self.watched.due_ids(now)
    }

    /// Whether stream `id`'s response headers are held.
    pub fn is_held(&self, id: u32) -> bool {
        self.watched.get(id).is_some_and(|w| w.machine.is_held())
    }

    /// One watched stream on a tick: release it at its first token, fire its deadline, or reset it
    /// after its error event ([`StreamWatch::on_tick`]). `enter` makes `id` the stream the host
    /// reads and acts on (`false`: the host no longer knows it, and it is no longer watched); the
    /// effects pushed act on that stream.
    pub fn on_tick_stream(
        &mut self,
        id: u32,
        now: u64,
        enter: &mut dyn FnMut(u32) -> bool,
        view: &mut dyn View,
        store: &mut dyn SharedStore,
        fx: &mut Effects,
    ) {
        let Some(held) = self.watched.get(id).map(|w| w.machine.is_held()) else { return };
        let mark = if held {
            if !enter(id) {
                self.watched.remove(id);
                return;
            }
            Some(first_token_mark(view))
        } else {
            None
        };
        let Some(steps) = self.watched.update(id, |w| w.machine.on_tick(now, mark)) else { return };
        if steps.is_empty() {
            return;
        }
        if !enter(id) {
            // The stream is gone: nothing to act on, nothing more to watch.
            self.watched.remove(id);
            return;
        }
        self.translate(id, now, &steps, store, fx);
    }

    /// After every watched stream's tick: the sweep of open breakers when it is due, and the tick
    /// re-timed to what is due next. The effects act on no stream.
    pub fn after_tick(&mut self, now: u64, store: &mut dyn SharedStore, fx: &mut Effects) {
        if now >= self.next_breaker_sweep_ns {
            self.next_breaker_sweep_ns = now.saturating_add(BREAKER_SWEEP_NS);
            self.sweep_open_breakers(now, store, fx);
        }
        self.schedule(now, fx);
    }

    /// An item of the release queue (a context id llm-metrics enqueued at the first token): the
    /// held stream is released when its mark says so; `enter` as in [`Self::on_tick_stream`].
    pub fn on_release(
        &mut self,
        item: &[u8],
        now: u64,
        enter: &mut dyn FnMut(u32) -> bool,
        view: &mut dyn View,
        store: &mut dyn SharedStore,
        fx: &mut Effects,
    ) {
        let Some(id) = std::str::from_utf8(item).ok().and_then(|t| t.trim().parse::<u32>().ok()) else { return };
        if !self.is_held(id) {
            return;
        }
        if !enter(id) {
            self.watched.remove(id);
            return;
        }
        let mark = first_token_mark(view);
        let Some(steps) = self.watched.update(id, |w| w.machine.on_first_token_mark(mark)) else { return };
        self.translate(id, now, &steps, store, fx);
    }

    /// A watched stream's deadline effects as host effects, in order. `Pause` when the response
    /// headers are held.
    fn translate(&mut self, id: u32, now: u64, steps: &deadline::Effects, store: &mut dyn SharedStore, fx: &mut Effects) -> Verdict {
        let Some(w) = self.watched.get(id) else { return Verdict::Continue };
        let (api, version, traced) = (w.kind, Arc::clone(&w.version), w.traced);
        let mut verdict = Verdict::Continue;
        for step in steps {
            match *step {
                deadline::Effect::Hold => {
                    if let Some(name) = &self.release_queue {
                        let stream = id.to_string();
                        let address = contract::ReleaseAddress { stream: &stream, queue: name, vm_id: &self.vm_id };
                        fx.set_state(RELEASE_PROPERTY, address.encode());
                    }
                    verdict = Verdict::Pause;
                }
                deadline::Effect::Unmarked => {
                    if !self.warned_no_first_token_signal {
                        self.warned_no_first_token_signal = true;
                        fx.log(
                            LogLevel::Warn,
                            "sluice latency-guard: a stream without llm-metrics' first-token mark (llm-metrics missing \
                             behind the guard, or skipping this response: content-encoding, path_prefixes); such streams \
                             are not held and a TTFT deadline can only reset them",
                        );
                    }
                }
                deadline::Effect::Release => fx.push(Effect::ResumeResponse),
                deadline::Effect::RecordTtft { ttft_us } => {
                    self.update_window_and_judge(&version, now, store, fx, latency::window::Sample::Ttft(ttft_us));
                }
                // Nothing to do on the host: the tick comes back when the wait ends.
                deadline::Effect::AwaitChunk { .. } => {}
                deadline::Effect::Reply504 { kind, deadline_ms } => {
                    // Envoy resets the upstream request.
                    let body = deadline::reply_504_body(api, kind, &version, deadline_ms);
                    let headers = [("content-type", "application/json"), ("x-sluice-deadline", kind.as_str()), ("x-sluice-refused-by", "latency-guard")];
                    // The outcome the stamp gives at on_log (the deadline's kind), on the span now.
                    if traced {
                        crate::span::guard_outcome(kind.as_str(), fx);
                    }
                    local_reply(fx, GatewayEnd::Deadline, 504, &headers, body);
                }
                deadline::Effect::MarkReply(reply) => fx.push(Effect::MarkReply(reply)),
                deadline::Effect::Reset => fx.push(Effect::ResetStream),
                deadline::Effect::ErrorEvent { kind, deadline_ms } => {
                    fx.push(Effect::ReplaceBody { dir: Dir::Response, bytes: deadline::error_event(api, kind, deadline_ms).into_bytes() });
                }
                deadline::Effect::DropChunk => fx.push(Effect::ReplaceBody { dir: Dir::Response, bytes: Vec::new() }),
                deadline::Effect::CountFired(fired) => fx.count(metrics::latency_deadline_total(&sanitize_label(&version), fired), 1),
                deadline::Effect::LogFired { fired, deadline_ms, after_ms } => fx.log(
                    LogLevel::Info,
                    format!(
                        "sluice latency-guard: {} deadline of {deadline_ms} ms fired for a request to {version} after {after_ms} ms: {}",
                        fired.kind().as_str(),
                        fired.action()
                    ),
                ),
                deadline::Effect::Reschedule => self.schedule(now, fx),
            }
        }
        verdict
    }

    /// Sets the tick to fire when the next thing is due on this worker ([`deadline::tick_period_ms`]);
    /// an effect only when the period changes (each is a hostcall).
    fn schedule(&mut self, now: u64, fx: &mut Effects) {
        let period_ms = deadline::tick_period_ms(now, self.watched.next_due_ns(now, self.wakes_at_first_token()));
        if period_ms != self.tick_period_ms {
            self.tick_period_ms = period_ms;
            fx.push(Effect::SetTickPeriod { ms: period_ms });
        }
    }

    fn leave_in_flight(&self, version: &str, store: &mut dyn SharedStore, fx: &mut Effects) {
        let Some(vp) = self.policy.version(version) else { return };
        match store::counter_add(store, &vp.in_flight_key(), -1) {
            Ok(n) => fx.push(Effect::GaugeSet { name: metrics::latency_in_flight(&sanitize_label(version)), value: n }),
            Err(store::CasError::Contended) => {
                fx.log(LogLevel::Warn, format!("sluice latency-guard: in-flight counter of {version} too contended; it may read high"))
            }
            Err(store::CasError::Store(_)) => {}
        }
    }

    /// Records `sample` in the version's shared window (when it has a breaker) and judges the
    /// breaker on the window as written.
    fn update_window_and_judge(&mut self, version: &str, now: u64, store: &mut dyn SharedStore, fx: &mut Effects, sample: latency::window::Sample) {
        let Some(vp) = self.policy.version(version) else { return };
        let Some(b) = &vp.breaker else { return };
        match self.windows.update(store, &vp.window_key(), &b.window, now, sample) {
            Ok(stats) => judge(vp, b, now, stats, store, fx),
            Err(e) => fx.log(LogLevel::Warn, format!("sluice latency-guard: window of {version} not updated: {e}")),
        }
    }

    /// Open breakers go half-open on time alone, and traffic may not reach them to notice.
    fn sweep_open_breakers(&self, now: u64, store: &mut dyn SharedStore, fx: &mut Effects) {
        for v in &self.policy.versions {
            let Some(b) = &v.breaker else { continue };
            let (breaker_key, window_key) = (v.breaker_key(), v.window_key());
            let Ok(current) = breaker::read(store, &breaker_key, &b.config) else { continue };
            fx.push(Effect::GaugeSet { name: metrics::latency_breaker_state(&sanitize_label(&v.name)), value: u64::from(current.state().state.code()) });
            if current.state().state != State::Open {
                continue;
            }
            let Ok(window) = window::read(store, &window_key, &b.window) else { continue };
            let stats = window.snapshot(now);
            judge(v, b, now, &stats, store, fx);
        }
    }
}

/// Evaluates the breaker of version `vp` on `stats`: its state gauge, and any transition logged,
/// counted and (when it says so) followed by a reset of the window.
fn judge(vp: &VersionPolicy, b: &BreakerPolicy, now: u64, stats: &latency::WindowStats, store: &mut dyn SharedStore, fx: &mut Effects) {
    let name = vp.name.as_str();
    match breaker::update(store, &vp.breaker_key(), &b.config, now, stats) {
        Ok((breaker, transition)) => {
            let label = sanitize_label(name);
            let state = breaker.state();
            fx.push(Effect::GaugeSet { name: metrics::latency_breaker_state(&label), value: u64::from(state.state.code()) });
            if let Some(t) = transition {
                on_transition(name, &vp.window_key(), b, &t, store, fx);
            } else if breaker.probes_on_a_stale_window(stats) {
                // Probing, on a window the transition's worker has not emptied yet (or failed to):
                // empty it here, so that the probes are judged whatever became of that reset.
                reset_window(name, &vp.window_key(), b, state.since_ns, store, fx);
            }
        }
        Err(e) => fx.log(LogLevel::Warn, format!("sluice latency-guard: breaker of {name} not evaluated: {e}")),
    }
}

fn on_transition(name: &str, window_key: &str, b: &BreakerPolicy, t: &Transition, store: &mut dyn SharedStore, fx: &mut Effects) {
    let label = sanitize_label(name);
    fx.log(LogLevel::Warn, format!("sluice latency-guard: breaker of {name} {} → {}: {}", t.from.as_str(), t.to.as_str(), t.reason));
    fx.count(metrics::latency_breaker_transitions_total(&label, t.to), 1);
    if t.reset_window {
        reset_window(name, window_key, b, t.at_ns, store, fx);
    }
}

fn reset_window(name: &str, window_key: &str, b: &BreakerPolicy, since_ns: u64, store: &mut dyn SharedStore, fx: &mut Effects) {
    if let Err(e) = window::reset_since(store, window_key, &b.window, since_ns) {
        fx.log(LogLevel::Warn, format!("sluice latency-guard: window of {name} not reset: {e}"));
    }
}

/// The breaker of version `vp` as a request arriving `now` must see it. Open → half-open is a
/// matter of time alone, so it is decided here, at the request that finds it due, rather than at
/// the next sweep (up to the idle tick later, at a phase set by when the VM started ticking).
/// `None` when the shared state cannot be read.
fn current_breaker(vp: &VersionPolicy, b: &BreakerPolicy, now: u64, store: &mut dyn SharedStore, fx: &mut Effects) -> Option<Breaker> {
    let (breaker_key, window_key) = (vp.breaker_key(), vp.window_key());
    let breaker = breaker::read(store, &breaker_key, &b.config).ok()?;
    let state = breaker.state();
    if state.state != State::Open || now.saturating_sub(state.since_ns) < b.config.open_for_ns {
        return Some(breaker);
    }
    let Ok(window) = window::read(store, &window_key, &b.window) else { return Some(breaker) };
    let stats = window.snapshot(now);
    judge(vp, b, now, &stats, store, fx);
    Some(breaker::read(store, &breaker_key, &b.config).unwrap_or(breaker))
}

/// llm-metrics' first-token mark of the current stream.
fn first_token_mark(view: &mut dyn View) -> FirstTokenMark {
    FirstTokenMark::parse(view.property(&[FIRST_TOKEN_PROPERTY]).as_deref())
}

/// A reply the gateway decided on (refusal, deadline): recorded for the other policies, then sent.
fn local_reply(fx: &mut Effects, end: GatewayEnd, status: u16, headers: &[(&str, &str)], body: String) {
    fx.push(Effect::MarkReply(GatewayReply { status, end }));
    let headers = headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    fx.push(Effect::LocalReply { status: u32::from(status), headers, body: body.into_bytes() });
}

/// A 503 refusal in the API's error shape, with when to try again.
fn refuse(fx: &mut Effects, kind: ApiKind, retry_after_s: u64, message: &str, code: &str) {
    let body = error_body(Some(kind), message, "overloaded", code);
    let retry = retry_after_s.to_string();
    local_reply(fx, GatewayEnd::Refused, 503, &[("content-type", "application/json"), ("retry-after", &retry), ("x-sluice-refused-by", "latency-guard")], body);
}

/// Where a guarded request is in its admission.
#[derive(Debug)]
enum Phase {
    /// Request headers seen; the final version is not known yet (model-router decides in its own
    /// header phase, behind the guard).
    Undecided,
    /// Decided without being guarded: no version, one the policy does not name, or a response
    /// that came before the decision.
    Passed,
    /// Answered 503 by the guard (breaker open, or past the in-flight limit); its stamp is written.
    Refused,
    /// Admitted to a version of the policy; its deadlines are watched by the [`GuardRoot`].
    Admitted(Admitted),
    /// The end was reported (counters, stamp, window): nothing more happens.
    Reported,
}

#[derive(Debug)]
struct Admitted {
    version: String,
    probe: bool,
    counted_in_flight: bool,
}

/// How far the response went through the guard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Response {
    /// No end seen yet (headers may have arrived).
    Open,
    /// The response reached its end here (its last body chunk, or headers or trailers that ended it).
    Ended,
}

/// A request the guard follows.
#[derive(Debug)]
struct Guarded {
    kind: ApiKind,
    class: String,
    priority: Priority,
    /// Deterministic per request: picks half-open probes.
    draw: u64,
    start_ns: u64,
    phase: Phase,
    /// The version's output-token ceiling, applied once the whole request body is in.
    clamp_to: Option<u64>,
    status: u16,
    /// The response's event stream, observed (`None`: not an event stream, or no headers yet).
    observer: Option<Observer>,
    timing: StreamTiming,
    response: Response,
    /// Envoy traces the request: its class and a refusal's outcome go on its span ([`crate::span`]).
    traced: bool,
}

/// One stream's guard; `None` inside for requests that are no LLM API call.
#[derive(Debug)]
pub struct GuardFlow {
    /// The stream's context id: it seeds the probe draw and keys the stream's watch in the root.
    id: u32,
    guarded: Option<Box<Guarded>>,
}

impl GuardFlow {
    pub fn new(id: u32) -> GuardFlow {
        GuardFlow { id, guarded: None }
    }

    /// Whether this request is guarded (its path is an LLM API's).
    pub fn is_guarded(&self) -> bool {
        self.guarded.is_some()
    }

    /// Request headers: the tenant's class, and for every version whose breaker blocks this request
    /// and whose action for the class is `fallback`, an entry in the avoid list model-router honours
    /// when it picks the version. A request without a body is decided here.
    pub fn on_request_headers(
        &mut self,
        root: &mut GuardRoot,
        view: &mut dyn View,
        store: &mut dyn SharedStore,
        end_of_stream: bool,
        now: u64,
        fx: &mut Effects,
    ) -> Verdict {
        let path = view.request_header(":path").unwrap_or_default();
        let Some(kind) = ApiKind::from_path(&path) else { return Verdict::Continue };
        let tenant = match &root.policy.tenant {
            None => None,
            Some(TenantSource::Header(name)) => view.request_header(name),
            Some(TenantSource::Property(p)) => crate::flow::property_at(view, p),
        };
        let (class, priority) = root.policy.classify(tenant.as_deref().map(str::trim).filter(|t| !t.is_empty()));
        let class = class.to_string();
        let request_id = view.request_header("x-request-id").unwrap_or_default();
        let traced = crate::span::traced(Some(&request_id));
        if traced {
            crate::span::guard_class(&class, fx);
        }
        let draw = breaker::probe_draw(&request_id, self.id);
        // Which versions this request must not be sent to: blocked by their breaker, and failing
        // over is what this class does. model-router reads the list when it picks the version.
        let mut avoid: Vec<(&str, &str)> = Vec::new();
        for v in &root.policy.versions {
            let Some(b) = v.breaker.as_ref().filter(|b| b.action(priority) == OpenAction::Fallback) else { continue };
            let Some(breaker) = current_breaker(v, b, now, store, fx) else { continue };
            if breaker.admit(draw) == Admission::Blocked {
                avoid.push((&v.name, b.fallback.as_deref().unwrap_or("")));
            }
        }
        if !avoid.is_empty() {
            fx.set_state(AVOID_PROPERTY, contract::encode_avoid_list(avoid));
        }
        if !end_of_stream && root.policy.versions.iter().any(|v| v.max_output_tokens.is_some()) {
            // The output ceiling may rewrite the body after these headers are gone (the version is
            // only known later): its length may change.
            fx.push(Effect::SetHeader { dir: Dir::Request, name: "content-length".to_string(), value: None });
        }
        self.guarded = Some(Box::new(Guarded {
            kind,
            class,
            priority,
            draw,
            start_ns: now,
            phase: Phase::Undecided,
            clamp_to: None,
            status: 0,
            observer: None,
            timing: StreamTiming::new(now),
            response: Response::Open,
            traced,
        }));
        if end_of_stream {
            // No body: decide now (there is no later request event).
            return self.decide(root, view, store, None, now, fx);
        }
        Verdict::Continue
    }

    /// A request body chunk: the decision at the first one, and the version's output ceiling
    /// written into the whole body (which the guard then waits for).
    // A body event takes the chunk's size and end besides what every event takes.
    #[allow(clippy::too_many_arguments)]
    pub fn on_request_body(
        &mut self,
        root: &mut GuardRoot,
        view: &mut dyn View,
        store: &mut dyn SharedStore,
        size: usize,
        end_of_stream: bool,
        now: u64,
        fx: &mut Effects,
    ) -> Verdict {
        // A body the host copied out (wasm: a hostcall) is kept for the ceiling below: read at most
        // once per event. One it lends (natively, the memory host) is cheaper to borrow again.
        let mut copied_body: Option<Vec<u8>> = None;
        if let Some(g) = self.guarded.as_ref().filter(|g| matches!(g.phase, Phase::Undecided)) {
            // json_to_metadata in front hands over the whole body at once: whether the client asked
            // for a stream is known here, and only streams have a first token before their end.
            // Read from core's inspection, which the policies behind then find remembered (one
            // parse of the body for all of them).
            let streaming = if end_of_stream {
                let body = view.body(Dir::Request, size);
                let streaming = inspect_request_with_kind(g.kind, &body).ok().and_then(|(_, info)| (!info.stream_unreadable).then_some(info.stream));
                if let std::borrow::Cow::Owned(bytes) = body {
                    copied_body = Some(bytes);
                }
                streaming
            } else {
                None
            };
            if let Verdict::Pause = self.decide(root, view, store, streaming, now, fx) {
                return Verdict::Pause;
            }
        }
        let Some(g) = self.guarded.as_mut() else { return Verdict::Continue };
        let Some(ceiling) = g.clamp_to else { return Verdict::Continue };
        if !end_of_stream {
            // The ceiling is written into the whole body (Envoy buffers it, within its limit).
            return Verdict::Pause;
        }
        g.clamp_to = None;
        let body = copied_body.map_or_else(|| view.body(Dir::Request, size), std::borrow::Cow::Owned);
        match inspect_request_with_kind(g.kind, &body) {
            Ok((kind, info)) => {
                let target = info.max_output_tokens.map_or(ceiling, |asked| asked.min(ceiling));
                if info.max_output_tokens != Some(target) {
                    match rewrite_request(kind, &body, false, Some(target)) {
                        Ok(rewrite) => {
                            fx.push(Effect::ReplaceBody { dir: Dir::Request, bytes: rewrite.body });
                            let version = match &g.phase {
                                Phase::Admitted(a) => sanitize_label(&a.version),
                                _ => String::new(),
                            };
                            fx.count(metrics::latency_output_capped_total(&version), 1);
                        }
                        Err(e) => fx.log(LogLevel::Debug, format!("sluice latency-guard: output ceiling not written: {e}")),
                    }
                }
            }
            // Not an LLM request body the guard understands: forwarded as it is, the upstream judges it.
            Err(e) => fx.log(LogLevel::Debug, format!("sluice latency-guard: request body not inspected, output ceiling not applied: {e}")),
        }
        Verdict::Continue
    }

    /// Response headers: the status and whether the answer is an event stream; a watched stream's
    /// headers are held until llm-metrics marks the first content token ([`StreamWatch`]).
    pub fn on_response_headers(
        &mut self,
        root: &mut GuardRoot,
        view: &mut dyn View,
        store: &mut dyn SharedStore,
        end_of_stream: bool,
        now: u64,
        fx: &mut Effects,
    ) -> Verdict {
        let Some(g) = self.guarded.as_mut() else { return Verdict::Continue };
        if let Phase::Undecided = g.phase {
            // A request without a body event (or a reply before it): decided now, no refusal possible.
            g.phase = Phase::Passed;
        }
        g.status = view.response_header(":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        if end_of_stream {
            g.response = Response::Ended;
        }
        let content_type = view.response_header("content-type").unwrap_or_default();
        let streaming = content_type.to_ascii_lowercase().starts_with("text/event-stream");
        if streaming {
            g.observer = Some(view.response_observer(g.kind));
        }
        let status = g.status;
        let Some(steps) = root.watched.update(self.id, |w| w.machine.on_response_headers(status, streaming, end_of_stream, || first_token_mark(view))) else {
            return Verdict::Continue;
        };
        if steps.is_empty() {
            return Verdict::Continue;
        }
        root.translate(self.id, now, &steps, store, fx)
    }

    /// A response chunk: read for content when it is an event stream (the guard's own first token
    /// when llm-metrics does not mark it), and the total deadline's error event put on it.
    // A body event takes the chunk's size and end besides what every event takes.
    #[allow(clippy::too_many_arguments)]
    pub fn on_response_body(
        &mut self,
        root: &mut GuardRoot,
        view: &mut dyn View,
        store: &mut dyn SharedStore,
        size: usize,
        end_of_stream: bool,
        now: u64,
        fx: &mut Effects,
    ) -> Verdict {
        let Some(g) = self.guarded.as_mut() else { return Verdict::Continue };
        if end_of_stream {
            g.response = Response::Ended;
        }
        let streaming = g.observer.is_some();
        // Reads the chunk (unless the machine drops it); whether it carried content.
        let mut observe = || {
            let Some(observer) = g.observer.as_mut() else { return false };
            let chunk = if observer.reads_chunk() { view.body(Dir::Response, size) } else { std::borrow::Cow::Borrowed(&[][..]) };
            let mut outcome = observer.push(&chunk);
            if end_of_stream {
                let last = observer.finish();
                outcome.content_events = outcome.content_events.saturating_add(last.content_events);
            }
            g.timing.on_content(now, outcome.content_events);
            outcome.content_events > 0
        };
        let Some(steps) = root.watched.update(self.id, |w| w.machine.on_response_body(now, streaming, end_of_stream, &mut observe)) else {
            // Not watched: the chunk is still read.
            observe();
            return Verdict::Continue;
        };
        root.translate(self.id, now, &steps, store, fx)
    }

    /// Trailers end the response: the body saw no end of stream.
    pub fn on_response_trailers(&mut self) {
        if let Some(g) = self.guarded.as_mut() {
            g.response = Response::Ended;
        }
    }

    /// The request's end (its access log): out of the in-flight count, counted by outcome, stamped,
    /// and its TTFT, time per output token and error into the version's window (the breaker judged
    /// on the result).
    pub fn on_log(&mut self, root: &mut GuardRoot, view: &mut dyn View, store: &mut dyn SharedStore, now: u64, fx: &mut Effects) {
        let Some(g) = self.guarded.as_mut() else { return };
        let watch = root.watched.remove(self.id);
        let a = match std::mem::replace(&mut g.phase, Phase::Reported) {
            Phase::Admitted(a) => a,
            other => {
                g.phase = other;
                return;
            }
        };
        if a.counted_in_flight {
            root.leave_in_flight(&a.version, store, fx);
        }
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
        let summary = g.observer.as_ref().map(|o| o.summary()).unwrap_or_default();
        let version_label = sanitize_label(&a.version);
        let class_label = sanitize_label(&g.class);
        // Another policy answered the request itself (tenant-budget's refusal): it says nothing
        // about the version's latency, and the stamp says what the client got.
        let gateway = view.gateway_reply();
        if let (None, Some(reply)) = (fired, gateway) {
            let outcome = Outcome::from(reply.end).as_str();
            fx.count(metrics::latency_requests_total(&version_label, &class_label, outcome), 1);
            fx.set_state(STAMP_PROPERTY, stamp(g, &a, outcome, reply.status, None));
            return;
        }
        // The same classification as every other policy's (`Outcome::classify`).
        let seen = match g.response {
            Response::Ended => Outcome::Completed,
            Response::Open => view.unended_outcome(),
        };
        let ended = Outcome::classify(None, seen, g.status, summary.upstream_error.is_some());
        let error = fired.is_some() || ended == Outcome::UpstreamError;
        // The client went away before the answer ended (streamed or not): no sample.
        let client_gone = !error && ended == Outcome::ClientDisconnect;
        let tpot_us = g.timing.tpot_ns(summary.usage.output_tokens).map(|v| v / 1000);
        let outcome = match (fired, error) {
            (Some(f), _) => f.kind().as_str(),
            (None, true) => "error",
            (None, false) if client_gone => "client_disconnect",
            _ => "ok",
        };
        fx.count(metrics::latency_requests_total(&version_label, &class_label, outcome), 1);
        fx.set_state(STAMP_PROPERTY, stamp(g, &a, outcome, gateway.map_or(g.status, |r| r.status), ttft_us));
        if client_gone {
            // Says nothing about the version's latency.
            return;
        }
        root.update_window_and_judge(&a.version, now, store, fx, latency::window::Sample::Finished { ttft_us: window_ttft_us, tpot_us, error });
    }

    /// The final version is known (model-router decided in its header phase): admit or refuse.
    /// `streaming`: whether the request asked for a stream (`None`: unknown, treated as a stream).
    fn decide(
        &mut self,
        root: &mut GuardRoot,
        view: &mut dyn View,
        store: &mut dyn SharedStore,
        streaming: Option<bool>,
        now: u64,
        fx: &mut Effects,
    ) -> Verdict {
        let Some(g) = self.guarded.as_mut() else { return Verdict::Continue };
        g.phase = Phase::Passed;
        let Some(version) = final_version(view) else { return Verdict::Continue };
        let Some(vp) = root.policy.version(&version) else { return Verdict::Continue };
        let version_label = sanitize_label(&vp.name);
        let priority = g.priority;
        let mut probe = false;
        if let Some(b) = &vp.breaker {
            let breaker = current_breaker(vp, b, now, store, fx).unwrap_or_else(|| Breaker::new(b.config.clone()));
            match breaker.admit(g.draw) {
                Admission::Pass => {}
                Admission::Probe => probe = true,
                Admission::Blocked => match b.action(priority) {
                    OpenAction::Reject => {
                        let retry = breaker.retry_after_s(now);
                        fx.count(metrics::latency_shed_total(&version_label, priority, ShedReason::BreakerOpen), 1);
                        let message = format!(
                            "model version {} is failing its latency objective (circuit open); {} requests are refused until it recovers",
                            vp.name,
                            priority.as_str()
                        );
                        refuse(fx, g.kind, retry, &message, "breaker_open");
                        fx.set_state(STAMP_PROPERTY, refusal_stamp(g, &vp.name, "shed_breaker_open"));
                        // On the span now: the stamp's own outcome comes at on_log, after Envoy
                        // finished the span.
                        if g.traced {
                            crate::span::guard_outcome("shed_breaker_open", fx);
                        }
                        g.phase = Phase::Refused;
                        return Verdict::Pause;
                    }
                    OpenAction::Fallback => {
                        // model-router was asked to avoid this version and could not (no router in
                        // the chain, or no available fallback): better served slowly than not at all.
                        fx.count(metrics::latency_fallback_unavailable_total(&version_label, priority), 1);
                    }
                },
            }
        }
        let mut counted_in_flight = false;
        if let Some(limit) = &vp.in_flight {
            match enter_in_flight(vp, priority, limit, store) {
                InFlight::Entered(n) => {
                    counted_in_flight = true;
                    fx.push(Effect::GaugeSet { name: metrics::latency_in_flight(&version_label), value: n });
                }
                InFlight::Shed(n) => {
                    fx.count(metrics::latency_shed_total(&version_label, priority, ShedReason::InFlight), 1);
                    let message = format!(
                        "model version {} has {n} requests in flight (limit {} for {} requests); try again shortly",
                        vp.name,
                        match priority {
                            Priority::Standard => limit.standard_limit(),
                            _ => limit.limit,
                        },
                        priority.as_str()
                    );
                    refuse(fx, g.kind, 1, &message, "in_flight_limit");
                    fx.set_state(STAMP_PROPERTY, refusal_stamp(g, &vp.name, "shed_in_flight"));
                    if g.traced {
                        crate::span::guard_outcome("shed_in_flight", fx);
                    }
                    g.phase = Phase::Refused;
                    return Verdict::Pause;
                }
                InFlight::Unavailable => {}
                InFlight::Contended => {
                    fx.log(LogLevel::Warn, format!("sluice latency-guard: in-flight counter of {} too contended; request not counted", vp.name));
                }
            }
        }
        g.phase = Phase::Admitted(Admitted { version: vp.name.clone(), probe, counted_in_flight });
        g.clamp_to = vp.max_output_tokens;
        if probe {
            fx.count(metrics::latency_probes_total(&version_label), 1);
        }
        let machine = StreamWatch::new(g.start_ns, vp.ttft_deadline_ns, vp.total_deadline_ns, streaming);
        let watch = Watch { kind: g.kind, version: Arc::from(vp.name.as_str()), machine, traced: g.traced, filed_due_ns: None };
        root.watched.insert(self.id, Box::new(watch));
        root.schedule(now, fx);
        Verdict::Continue
    }
}

/// The version the request goes to: model-router's decision, else the model json_to_metadata read.
fn final_version(view: &mut dyn View) -> Option<String> {
    if let Some(version) = view.property(&[ROUTE_PROPERTY]).and_then(|d| contract::route_version(&d)) {
        return Some(version);
    }
    view.property(&MODEL_METADATA).filter(|m| !m.is_empty())
}

/// The stamp of a request the guard refused.
fn refusal_stamp(g: &Guarded, version: &str, outcome: &str) -> String {
    let stamp = serde_json::json!({
        "version": version, "class": g.class, "priority": g.priority.as_str(), "probe": false, "outcome": outcome,
        "status": 503, "ttft_ms": null,
    });
    stamp.to_string()
}

/// The stamp of an admitted request; `status` is what the client got (the gateway's own reply when
/// one was sent, else the upstream's).
/// The stamp as text, in the bytes a `serde_json` map of these fields writes (sorted keys,
/// compact), without building one per request.
fn stamp(g: &Guarded, a: &Admitted, outcome: &str, status: u16, ttft_us: Option<u64>) -> String {
    use crate::text::{push_json_string, push_u64};
    let mut out = String::with_capacity(128);
    out.push_str("{\"class\":");
    push_json_string(&mut out, &g.class);
    out.push_str(",\"outcome\":");
    push_json_string(&mut out, outcome);
    out.push_str(",\"priority\":");
    push_json_string(&mut out, g.priority.as_str());
    out.push_str(if a.probe { ",\"probe\":true,\"status\":" } else { ",\"probe\":false,\"status\":" });
    push_u64(&mut out, u64::from(status));
    out.push_str(",\"ttft_ms\":");
    match ttft_us {
        Some(us) => push_u64(&mut out, us / 1000),
        None => out.push_str("null"),
    }
    out.push_str(",\"version\":");
    push_json_string(&mut out, &a.version);
    out.push('}');
    out
}

enum InFlight {
    Entered(u64),
    Shed(u64),
    /// The counter could not be read: not counted, not shed.
    Unavailable,
    /// Every attempt to update the counter lost to another worker: not counted, not shed.
    Contended,
}

/// Counts the request into the version's in-flight counter, unless its priority is shed at the
/// count it finds.
fn enter_in_flight(vp: &VersionPolicy, priority: Priority, limit: &latency::InFlightLimit, store: &mut dyn SharedStore) -> InFlight {
    let entered =
        store::counter_update(store, &vp.in_flight_key(), |n| if latency::should_shed(priority, n, limit) { Err(n) } else { Ok(n.saturating_add(1)) });
    match entered {
        Ok(Updated::Written(n)) => InFlight::Entered(n),
        Ok(Updated::Stopped(n)) => InFlight::Shed(n),
        Err(store::CasError::Store(_)) => InFlight::Unavailable,
        Err(store::CasError::Contended) => InFlight::Contended,
    }
}

#[cfg(test)]
mod tests;
