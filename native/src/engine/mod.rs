//! The `sluice` filter: sluice's engine natively, the third host of the policies' core flows
//! (`sluice_core::flow`) beside `sluice.wasm` (`plugins/engine`) and the playground. It reads what
//! Envoy gives through the ABI, calls the flows and applies their effects; every rule is in core.
//!
//! Its configuration is `sluice.wasm`'s, parsed by the same code (`sluice_core::flow::sections`):
//! one section per policy, the same schema, the same refusals in the same words. Sections run in
//! pipeline order on the request, reversed on the response, as `plugins/engine/src/composite.rs`
//! runs them — in one hook call each, with the chunk read once for every section and, when there
//! are several, one shared response observer per stream (`sluice_core::observation`).
//!
//! Differences from the proxy-wasm host, each because of what the ABI is:
//! - state a worker's VM kept for itself (llm-metrics' bounded label sets) is one per process,
//!   behind a mutex, shared by every worker: one bound for the process instead of one per worker;
//! - filter state keys are written and read with the `wasm.` prefix Envoy's wasm filter gives them
//!   ([`view::STATE_PREFIX`]), so access-log formats and the other filters read the same keys;
//! - metrics are Envoy's labelled metrics, defined at configuration time ([`catalogue`]).
//!
//! - tenant-budget holds the request *headers* until it has read the whole body and decided (the
//!   ABI lets a filter read the body while its headers wait), so a refused request never reaches
//!   the upstream without Envoy's `buffer` filter behind it; its counters live in one in-process
//!   store (core's `MemoryStore`) for every worker, as proxy-wasm shared data is one per process.
//!
//! - model-router sets its route header before Envoy's router filter picks the cluster and clears
//!   the route cache after (as Envoy's wasm filter does on every request-header change); a request
//!   whose model it rewrites is held, headers waiting, until the whole body is in, and the body
//!   is replaced in place. It reads the requested model from `json_to_metadata`'s dynamic metadata
//!   as sluice.wasm does. Its unhealthy-route marks live in the same in-process store.
//!
//! - latency-guard (in a filter instance of its own, in front, as with wasm) decides at the request
//!   body on the version model-router picked at the headers behind it, so its instance lets the
//!   headers go on and the sluice instance behind holds them until the body has passed the guard
//!   ([`GUARD_PENDING`]); it has one root per
//!   configuration for every worker and its breakers, windows and in-flight counters in the same
//!   in-process store; its tick is the module's own thread committing each guarded stream's
//!   scheduler ([`ticker`]), so deadlines, releases and resets happen in the stream's own callback;
//!   a held response is let go in the hook where llm-metrics (behind it) marked the first token.
//!
//! - tenant-budget with a Redis ledger (`ledger.mode: redis`) sends a request's reservation as the
//!   stream's own callout and holds the request (headers and body) until the answer, on the same
//!   worker, decides; the sections behind it then see the body, as sluice.wasm's composite resumes
//!   it. Settlements and write-backs leave from the configuration, on Envoy's main thread: a thread
//!   of the module commits the configuration's scheduler every `SETTLE_TICK_MS` while some wait
//!   ([`EVENT_SETTLE`]), and the main thread sends them as the configuration's callouts and reads
//!   their answers — sluice.wasm's root tick, with one settlement queue per configuration for every
//!   worker instead of one per worker's VM.
//! - model-router's shadow copies are queued by the stream in the configuration's router and sent
//!   from the main thread as the configuration's callouts ([`EVENT_SHADOWS`], committed by the
//!   stream that queued one), so a copy outlives its stream; the answers are compared there, as
//!   sluice.wasm's root does. Metrics of those main-thread events are recorded through the
//!   configuration (Envoy's `http_filter_config_*` metric callbacks), on the same series.
//!
//! Every section of sluice.wasm's configuration is supported.

pub mod catalogue;
pub mod ticker;
pub mod view;

use std::sync::{Arc, Mutex, PoisonError};

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;

use sluice_core::contract::OBSERVATION_PROPERTY;
use sluice_core::flow::budget::{next_vm_number, BudgetFlow, BudgetPolicy, MAX_LEDGER_ANSWER_BYTES, MAX_REQUEST_BODY_BYTES};
use sluice_core::flow::guard::{self as guard_flow, GuardFlow, GuardRoot};
use sluice_core::flow::metrics::{MetricsFlow, MetricsPolicy};
use sluice_core::flow::router::{Router, RouterFlow, MAX_WHOLE_BODY_BYTES, SHADOW_TIMEOUT};
use sluice_core::flow::sections::{self, ConfigError, Policy};
use sluice_core::flow::{Dir, Effect, Effects, LogLevel as FlowLogLevel, Verdict};
use sluice_core::headers::HeaderPairs;
use sluice_core::metrics::Plugin;
use sluice_core::observation::{shared_slot, SharedResponse, SharedSlot};
use sluice_core::store::MemoryStore;

use crate::filter::{
    log, BodyKind, BodyStatus, CalloutAnswer, CalloutRequest, ConfigContext, ConfigHost, ConfigScheduler, Envoy, Filter, FilterConfig, HeadersStatus, LogLevel,
    Metrics,
};
use catalogue::{Catalogue, Sample};
use view::{now_ns, replace_request_body, state_key, Chunk, ConfigBudgetHost, EnvoyBudgetHost, HeldBody, NativeView};

/// State across requests, one per process as proxy-wasm's shared data is: every worker and every
/// `sluice` filter configuration reads and writes it (keys are namespaced by policy, as there).
fn store() -> std::sync::MutexGuard<'static, MemoryStore> {
    static STORE: OnceLock<Mutex<MemoryStore>> = OnceLock::new();
    lock(STORE.get_or_init(|| Mutex::new(MemoryStore::default())))
}

/// A number per stream of the process (a budget's hold ids carry it, as the wasm context id).
fn next_stream_id() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The filter name this module runs the engine under (`DynamicModuleFilter.filter_name`).
pub const FILTER_NAME: &str = "sluice";

/// One configured section, shared by every stream of every worker.
enum SectionConfig {
    Guard(Arc<GuardConfig>),
    Router(Arc<Mutex<Router>>),
    Budget(Arc<Mutex<BudgetPolicy>>),
    Metrics(Arc<Mutex<MetricsPolicy>>),
}

/// latency-guard's root, one per configuration for every worker (its watched streams, the breakers'
/// sweep, the tick period), and the last tick that ran its `after_tick`.
struct GuardConfig {
    root: Mutex<GuardRoot>,
    last_tick: AtomicU64,
    /// Keeps the module's tick thread running while this configuration lives.
    _ticks: ticker::Users,
}

/// The validated configuration of one `sluice` filter.
pub struct EngineConfig {
    /// The configuration's tick (held metric changes, a Redis ledger's settlements), stopped and
    /// joined before `inner` (and the configuration's scheduler in it) is dropped.
    tick: Mutex<Option<config_tick::ConfigTick>>,
    inner: Arc<Inner>,
}

impl EngineConfig {
    fn stop_tick(&self) -> Option<std::thread::ThreadId> {
        let tick = lock(&self.tick).take()?;
        let thread = tick.thread();
        drop(tick);
        thread
    }
}

impl Drop for EngineConfig {
    fn drop(&mut self) {
        self.stop_tick();
    }
}

struct Inner {
    /// In pipeline (request) order.
    sections: Vec<SectionConfig>,
    catalogue: Catalogue,
    /// Posts to the main thread, where held metric changes are flushed ([`EVENT_FLUSH`]) and the
    /// configuration's callouts are sent ([`EVENT_SETTLE`], [`EVENT_SHADOWS`]).
    scheduler: Option<ConfigScheduler>,
}

/// The configuration's event: send the budget's due settlements (its tick, every
/// `SETTLE_TICK_MS` while settlements or write-backs wait).
const EVENT_SETTLE: u64 = 1;
/// The configuration's event: send the router's queued shadow requests.
const EVENT_SHADOWS: u64 = 2;
/// The configuration's event: send the metric changes the workers hold ([`Catalogue::flush`]).
const EVENT_FLUSH: u64 = 3;

/// How often held metric changes are flushed (the tick's period without a Redis ledger; with one,
/// they go at its `SETTLE_TICK_MS`): a counter in `/stats/prometheus` lags its requests by about
/// this much, far below any scrape interval, and a worker's series is sent at most ten times a
/// second however many requests it serves.
pub const METRICS_FLUSH_MS: u64 = 100;

impl Inner {
    /// Whether a budget has settlements or write-backs waiting to be sent (the tick then commits
    /// [`EVENT_SETTLE`]).
    fn settlements_wait(&self) -> bool {
        self.sections.iter().any(|s| match s {
            SectionConfig::Budget(policy) => {
                let policy = lock(policy);
                policy.queued_settlements() > 0 || policy.pending_write_backs() > 0
            }
            _ => false,
        })
    }

    fn commit(&self, event: u64) {
        if let Some(scheduler) = &self.scheduler {
            scheduler.commit(event);
        }
    }
}

/// The configuration's tick: a thread of its own that, every [`METRICS_FLUSH_MS`] (with a Redis
/// ledger every `SETTLE_TICK_MS`, as sluice.wasm's root ticks), commits [`EVENT_FLUSH`] to the main
/// thread while metric changes are held and [`EVENT_SETTLE`] while settlements wait (Envoy's ABI has
/// no timer for a configuration).
///
/// It commits under a lock that its stop takes, and the configuration's destruction stops and
/// joins it before the scheduler is deleted (the `inner` it upgrades is dropped after the join),
/// so no commit reaches a deleted scheduler or a destroyed configuration. One case cannot be
/// joined: Envoy 1.40's `config_scheduler_commit` holds the configuration (it locks its weak
/// pointer) while it posts, so if Envoy lets go of the configuration at that moment, the
/// configuration is destroyed on this thread, inside the commit; the stop then only flags the
/// thread, which ends when the commit returns, commits nothing more, and deletes the scheduler
/// as it lets go of `inner`.
mod config_tick {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Condvar, Mutex, PoisonError, Weak};
    use std::thread::{JoinHandle, ThreadId};
    use std::time::Duration;

    use sluice_core::flow::budget::SETTLE_TICK_MS;

    use super::{Inner, EVENT_FLUSH, EVENT_SETTLE, METRICS_FLUSH_MS};
    use crate::filter::{log, LogLevel};

    struct Gate {
        /// Held while the thread waits and commits.
        lock: Mutex<()>,
        stop: AtomicBool,
        wake: Condvar,
    }

    /// The running thread; dropping it stops the thread and joins it.
    pub(super) struct ConfigTick {
        gate: Arc<Gate>,
        thread: Option<JoinHandle<()>>,
    }

    impl ConfigTick {
        /// The thread's id, while it runs.
        pub(super) fn thread(&self) -> Option<ThreadId> {
            self.thread.as_ref().map(|t| t.thread().id())
        }
    }

    pub(super) fn start(inner: Weak<Inner>, settles: bool) -> Result<ConfigTick, String> {
        let period = if settles { SETTLE_TICK_MS } else { METRICS_FLUSH_MS };
        every(Duration::from_millis(period), move || {
            let Some(inner) = inner.upgrade() else { return false };
            if inner.catalogue.has_unsent() {
                inner.commit(EVENT_FLUSH);
            }
            if inner.settlements_wait() {
                inner.commit(EVENT_SETTLE);
            }
            true
        })
        .map_err(|e| format!("sluice: configuration refused: cannot start the configuration's tick thread: {e}"))
    }

    /// Runs `tick` every `period` on a thread of its own, under the gate's lock, until it returns
    /// false or the [`ConfigTick`] is dropped.
    fn every(period: Duration, mut tick: impl FnMut() -> bool + Send + 'static) -> std::io::Result<ConfigTick> {
        let gate = Arc::new(Gate { lock: Mutex::new(()), stop: AtomicBool::new(false), wake: Condvar::new() });
        let theirs = Arc::clone(&gate);
        let thread = std::thread::Builder::new().name("sluice-config-tick".into()).spawn(move || {
            let gate = theirs;
            let mut held = gate.lock.lock().unwrap_or_else(PoisonError::into_inner);
            loop {
                held = gate.wake.wait_timeout_while(held, period, |()| !gate.stop.load(Ordering::SeqCst)).unwrap_or_else(PoisonError::into_inner).0;
                if gate.stop.load(Ordering::SeqCst) || !tick() {
                    return;
                }
            }
        })?;
        Ok(ConfigTick { gate, thread: Some(thread) })
    }

    impl Drop for ConfigTick {
        fn drop(&mut self) {
            let Some(thread) = self.thread.take() else { return };
            if thread.thread().id() == std::thread::current().id() {
                // Destroyed inside this thread's own commit (see the module's docs): it holds the
                // lock up the stack; the flag ends it when the commit returns.
                self.gate.stop.store(true, Ordering::SeqCst);
                return;
            }
            {
                // Waits for a commit under way; none starts after.
                let _held = self.gate.lock.lock().unwrap_or_else(PoisonError::into_inner);
                self.gate.stop.store(true, Ordering::SeqCst);
            }
            self.gate.wake.notify_all();
            if thread.join().is_err() {
                log(LogLevel::Error, "sluice: the configuration's tick thread panicked");
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use std::sync::atomic::AtomicU32;

        #[test]
        fn dropping_it_stops_and_joins_the_thread_between_ticks() {
            let ticks = Arc::new(AtomicU32::new(0));
            let counted = Arc::clone(&ticks);
            let tick = every(Duration::from_millis(1), move || {
                counted.fetch_add(1, Ordering::SeqCst);
                true
            })
            .ok();
            assert!(tick.is_some(), "the thread did not start");
            while ticks.load(Ordering::SeqCst) < 3 {
                std::thread::yield_now();
            }
            drop(tick);
            let stopped_at = ticks.load(Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(20));
            assert_eq!(ticks.load(Ordering::SeqCst), stopped_at, "a tick ran after the drop returned");
        }

        #[test]
        fn dropped_on_its_own_thread_inside_a_tick_it_ends_after_that_tick() {
            // What happens when Envoy destroys the configuration inside the thread's own commit.
            let slot: Arc<Mutex<Option<ConfigTick>>> = Arc::new(Mutex::new(None));
            let (dropped, after) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU32::new(0)));
            let (theirs, dropped_in_tick, ticks_after) = (Arc::clone(&slot), Arc::clone(&dropped), Arc::clone(&after));
            let tick = every(Duration::from_millis(1), move || {
                let mine = theirs.lock().unwrap_or_else(PoisonError::into_inner).take();
                if mine.is_some() {
                    drop(mine);
                    dropped_in_tick.store(true, Ordering::SeqCst);
                } else if dropped_in_tick.load(Ordering::SeqCst) {
                    ticks_after.fetch_add(1, Ordering::SeqCst);
                }
                true
            })
            .ok();
            assert!(tick.is_some(), "the thread did not start");
            *slot.lock().unwrap_or_else(PoisonError::into_inner) = tick;
            while !dropped.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
            std::thread::sleep(Duration::from_millis(20));
            assert_eq!(after.load(Ordering::SeqCst), 0, "the thread ticked again after it was dropped in its tick");
        }
    }
}

/// Parses `config` as `sluice.wasm` does and defines the configured policies' metrics; the reason,
/// worded as `sluice.wasm` logs it, when refused.
pub fn new_config(config: &[u8], context: &mut ConfigContext<'_>) -> Result<EngineConfig, String> {
    let policies = sections::parse_sections(config).map_err(|e| match e {
        // Worded by the policy itself, naming its section.
        ConfigError::Section { .. } => e.to_string(),
        _ => format!("sluice: configuration refused: {e}"),
    })?;
    let mut configured = Vec::with_capacity(policies.len());
    let mut plugins = Vec::with_capacity(policies.len());
    // A Redis ledger's settlements, and shadow copies, are the configuration's callouts.
    let (mut settles, mut shadows) = (false, false);
    for policy in policies {
        match policy {
            Policy::LlmMetrics(p) => {
                log(LogLevel::Info, &format!("sluice llm-metrics: configured ({} price entries)", p.settings.prices.len()));
                configured.push(SectionConfig::Metrics(Arc::new(Mutex::new(*p))));
                plugins.push(Plugin::LlmMetrics);
            }
            Policy::TenantBudget(p) => {
                let mut store = store();
                if let Err(e) = p.ensure_counters(&mut *store) {
                    log(LogLevel::Warn, &format!("creating budget counters failed: {e}"));
                }
                log(LogLevel::Info, &format!("tenant-budget configured: {} keys, {} budget counters", p.keys.len(), p.counters.len()));
                // No node id natively (the ABI gives none); it only tells Envoys apart in a Redis
                // ledger's hold ids, which the configure time and the VM number tell apart too.
                let budget = BudgetPolicy::new(*p, "", now_ns(), next_vm_number(&mut *store));
                if budget.needs_tick() {
                    log(LogLevel::Info, &format!("tenant-budget: Redis hold ids of this proxy start with {}", budget.hold_prefix()));
                    settles = true;
                }
                configured.push(SectionConfig::Budget(Arc::new(Mutex::new(budget))));
                plugins.push(Plugin::TenantBudget);
            }
            Policy::ModelRouter(p) => {
                // A shadow copy is sent by a callout that must outlive its stream (sluice.wasm's
                // root sends it): the configuration's, on the main thread ([`EngineConfig::on_scheduled`]).
                shadows |= p.models().iter().any(|m| m.shadow.is_some());
                log(LogLevel::Info, &format!("model-router configured: {} models", p.models().len()));
                configured.push(SectionConfig::Router(Arc::new(Mutex::new(Router::new(*p)))));
                plugins.push(Plugin::ModelRouter);
            }
            Policy::LatencyGuard(p) => {
                guard_flow::ensure_shared_state(&p, &mut *store()).map_err(|e| format!("sluice latency-guard: configuration refused: {e}"))?;
                log(
                    LogLevel::Info,
                    &format!(
                        "sluice latency-guard: configured ({} classes, {} versions, {} with a breaker)",
                        p.classes.len(),
                        p.versions.len(),
                        p.versions.iter().filter(|v| v.breaker.is_some()).count()
                    ),
                );
                // No release queue: llm-metrics' first-token mark releases a held stream in the same
                // hook (the sections share the filter), and the module's tick does the rest.
                let root = GuardRoot::new(*p, None, String::new()).woken_at_first_token();
                configured.push(SectionConfig::Guard(Arc::new(GuardConfig { root: Mutex::new(root), last_tick: AtomicU64::new(0), _ticks: ticker::start() })));
                plugins.push(Plugin::LatencyGuard);
            }
        }
    }
    let scheduler = context.scheduler();
    if scheduler.is_none() {
        if settles || shadows {
            return Err(
                "sluice: configuration refused: Envoy gave no configuration scheduler (a Redis ledger's settlements and shadow requests need one)".to_string()
            );
        }
        log(LogLevel::Warn, "sluice: Envoy gave no configuration scheduler: every metric sample is sent as it is made, none held for a flush");
    }
    let catalogue = Catalogue::define(context, &plugins, settles, scheduler.is_some())?;
    let ticks = scheduler.is_some();
    let inner = Arc::new(Inner { sections: configured, catalogue, scheduler });
    let tick = if ticks { Some(config_tick::start(Arc::downgrade(&inner), settles)?) } else { None };
    Ok(EngineConfig { tick: Mutex::new(tick), inner })
}

impl FilterConfig for EngineConfig {
    fn new_filter(&self) -> Box<dyn Filter> {
        let sections = self
            .inner
            .sections
            .iter()
            .map(|section| match section {
                SectionConfig::Guard(config) => {
                    let id = next_stream_id();
                    Section::Guard { config: Arc::clone(config), flow: GuardFlow::new(id), id }
                }
                SectionConfig::Router(router) => Section::Router { router: Arc::clone(router), flow: RouterFlow::new(next_stream_id()) },
                SectionConfig::Budget(policy) => Section::Budget { policy: Arc::clone(policy), flow: BudgetFlow::new(next_stream_id()) },
                SectionConfig::Metrics(policy) => Section::Metrics { policy: Arc::clone(policy), flow: MetricsFlow::default() },
            })
            .collect::<Vec<_>>();
        // Several sections read the response through one observer, as one VM's sections do.
        let shared = (sections.len() > 1).then(shared_slot);
        Box::new(Stream {
            inner: Arc::clone(&self.inner),
            sections,
            shared,
            announced: None,
            effects: Effects::default(),
            chunk: Chunk::default(),
            held: None,
            flags: Flags::default(),
            response_held: false,
            ticked: None,
            due_sent: None,
            paused_at: None,
        })
    }

    /// On the main thread: the budget's settlement tick, or the router's queued shadows, sent as
    /// the configuration's callouts (as sluice.wasm's root sends them).
    fn on_scheduled(&self, config: &mut ConfigHost<'_>, event: u64) {
        if event == EVENT_FLUSH {
            flush(config, &self.inner.catalogue);
            return;
        }
        let mut fx = Effects::default();
        for section in &self.inner.sections {
            match (section, event) {
                (SectionConfig::Budget(policy), EVENT_SETTLE) => {
                    let now = now_ns();
                    lock(policy).on_tick(&mut ConfigBudgetHost { config }, now, &mut fx);
                }
                (SectionConfig::Router(router), EVENT_SHADOWS) => {
                    // Sent with the router unlocked: the streams go on queueing meanwhile.
                    let jobs = lock(router).take_queued();
                    for job in jobs {
                        let headers: Vec<(&str, &[u8])> = job.headers.iter().map(|(k, v)| (k.as_str(), v.as_bytes())).collect();
                        let timeout_ms = u64::try_from(SHADOW_TIMEOUT.as_millis()).unwrap_or(u64::MAX);
                        let sent = config.http_callout(&CalloutRequest { cluster: &job.cluster, headers: &headers, body: &job.body, timeout_ms });
                        drop(headers);
                        let mut router = lock(router);
                        match sent.map_err(|e| e.to_string()).and_then(|id| u32::try_from(id).map_err(|_| format!("callout id {id} is past 32 bits"))) {
                            Ok(token) => router.shadow_sent(token, job, now_ns(), &mut fx),
                            Err(why) => router.shadow_not_started(job, &why, &mut fx),
                        }
                    }
                }
                _ => {}
            }
            apply_config(config, &self.inner.catalogue, &mut fx);
        }
    }

    /// Its streams are gone: the tick stops and what the workers still hold is sent. Not when Envoy
    /// destroys the configuration on the tick thread itself (inside its commit, see
    /// [`config_tick`]): Envoy's metric callbacks may only run on its own threads, so those last
    /// changes are dropped and logged.
    fn on_destroy(&self, config: &mut ConfigHost<'_>) {
        if self.stop_tick() == Some(std::thread::current().id()) {
            if self.inner.catalogue.has_unsent() {
                log(LogLevel::Warn, "sluice: configuration destroyed on its tick thread: its last held metric changes are not sent");
            }
            return;
        }
        flush(config, &self.inner.catalogue);
    }

    /// On the main thread: a settlement's or a shadow's answer.
    fn on_callout_done(&self, config: &mut ConfigHost<'_>, id: u64, answer: &CalloutAnswer) {
        let Ok(token) = u32::try_from(id) else { return };
        let mut fx = Effects::default();
        let now = now_ns();
        for section in &self.inner.sections {
            match section {
                SectionConfig::Budget(policy) => {
                    let mut policy = lock(policy);
                    if policy.awaits_settlement(token) {
                        let body = answer.body.get(..MAX_LEDGER_ANSWER_BYTES).unwrap_or(&answer.body);
                        policy.on_settle_answer(token, answer.status, body, now, &mut fx);
                    }
                }
                SectionConfig::Router(router) => {
                    let body = answer.body.get(..MAX_WHOLE_BODY_BYTES).unwrap_or(&answer.body);
                    lock(router).on_shadow_answer(token, answer.status, body, now, &mut fx);
                }
                _ => {}
            }
            apply_config(config, &self.inner.catalogue, &mut fx);
        }
    }
}

/// Sends the metric changes the workers hold, on the main thread.
fn flush(config: &mut ConfigHost<'_>, catalogue: &Catalogue) {
    for problem in catalogue.flush(config) {
        log(LogLevel::Warn, &format!("sluice: flushing metrics: {problem}"));
    }
}

/// Applies the effects of a configuration-level event (no stream: metrics and log lines only).
fn apply_config(config: &mut ConfigHost<'_>, catalogue: &Catalogue, effects: &mut Effects) {
    for effect in effects.drain() {
        let failed = match effect {
            Effect::Count { name, delta } | Effect::GaugeAdd { name, delta } => catalogue.record(config as &mut dyn Metrics, &name, Sample::Add(delta)).err(),
            Effect::GaugeSet { name, value } | Effect::Record { name, value } => catalogue.record(config as &mut dyn Metrics, &name, Sample::Set(value)).err(),
            Effect::Log { level, message } => {
                log(log_level(level), &message);
                None
            }
            other => Some(format!("{other:?} has no stream to act on at the configuration level")),
        };
        if let Some(problem) = failed {
            log(LogLevel::Warn, &format!("sluice: {problem}"));
        }
    }
}

fn log_level(level: FlowLogLevel) -> LogLevel {
    match level {
        FlowLogLevel::Debug => LogLevel::Debug,
        FlowLogLevel::Info => LogLevel::Info,
        FlowLogLevel::Warn => LogLevel::Warn,
        FlowLogLevel::Error => LogLevel::Error,
    }
}

/// One section's stream.
enum Section {
    /// `id`: the stream's number in the guard's root (its watch) and the ticker.
    Guard {
        config: Arc<GuardConfig>,
        flow: GuardFlow,
        id: u32,
    },
    Router {
        router: Arc<Mutex<Router>>,
        flow: RouterFlow,
    },
    Budget {
        policy: Arc<Mutex<BudgetPolicy>>,
        flow: BudgetFlow,
    },
    Metrics {
        policy: Arc<Mutex<MetricsPolicy>>,
        flow: MetricsFlow,
    },
}

impl Section {
    /// A budget that holds this request until it has decided, or a router that rewrites its body.
    fn holds_request(&self) -> bool {
        match self {
            Section::Budget { flow, .. } => flow.is_budgeted(),
            Section::Router { flow, .. } => flow.wants_request_body(),
            // The guard decides at the body on the version model-router (in the instance behind it)
            // picked at the headers: it lets the headers go on, and that instance holds them
            // ([`GUARD_PENDING`]).
            Section::Guard { .. } => false,
            Section::Metrics { .. } => false,
        }
    }
}

/// Filter state (`wasm.` + this key) the guard's instance writes on a guarded request whose body is
/// still to come: the guard decides at the body, on the version model-router picks at the request
/// headers in a sluice instance behind it, so the guard's instance lets the headers go on and the
/// next sluice instance holds them until the whole body has passed the guard (admitted, or refused
/// with its local reply before the upstream sees anything) — the hold sluice.wasm's chain gets from
/// Envoy's `buffer` filter.
pub const GUARD_PENDING: &str = "sluice_guard_pending";

/// The request body the filter holds while its headers wait: its bytes (up to the most a budget
/// reads, beyond which it refuses anyway) and its whole size.
#[derive(Debug, Default)]
struct Held {
    bytes: Vec<u8>,
    size: usize,
}

/// The engine's stream: the sections' flows and what one hook shares between them.
struct Stream {
    inner: Arc<Inner>,
    sections: Vec<Section>,
    shared: Option<SharedSlot>,
    /// Reused by every event, so the hot path allocates no effect list.
    effects: Effects,
    chunk: Chunk,
    /// Set while the request headers wait for a section's decision on the whole body.
    held: Option<Held>,
    flags: Flags,
    /// latency-guard holds the response headers (until the first token, a deadline or a release
    /// by the tick).
    response_held: bool,
    /// The guarded stream's id, while the module's tick thread ticks it ([`ticker`]).
    ticked: Option<u32>,
    /// The due time last sent to the tick thread for the guarded stream ([`ticker::set_due`]).
    due_sent: Option<Option<u64>>,
    /// The number under which this guard's instance announced the stream's shared observer
    /// ([`announce_observer`]), until the stream ends.
    announced: Option<u64>,
    /// The section whose callout (a Redis ledger's reservation) holds the whole request: the
    /// sections after it see the body when it answers.
    paused_at: Option<usize>,
}

thread_local! {
    /// Shared response observers announced by guard instances on this worker, by number. The sluice
    /// instance behind a guard runs on the same worker thread (one stream's filters always do), so
    /// it finds the guard's observer here and the stream is framed and scanned once for both, as
    /// sluice.wasm's two instances in one VM share theirs.
    static ANNOUNCED: std::cell::RefCell<std::collections::HashMap<u64, std::rc::Weak<std::cell::RefCell<Option<SharedResponse>>>>> =
        std::cell::RefCell::new(std::collections::HashMap::new());
}

/// Filter state [`OBSERVATION_PROPERTY`] as the native module writes it: `native#<number>` (no
/// space, so sluice.wasm, which writes `<vm token> <context id>`, never mistakes it for its own).
const ANNOUNCED_PREFIX: &str = "native#";

/// A guard's instance makes the stream's shared observer, keeps it under a new number and names
/// it in filter state for the instance behind. `None` when the filter state could not be written.
fn announce_observer(envoy: &mut Envoy<'_>) -> Option<(u64, SharedSlot)> {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let number = NEXT.fetch_add(1, Ordering::Relaxed);
    let value = format!("{ANNOUNCED_PREFIX}{number}");
    if !envoy.set_filter_state(&state_key(OBSERVATION_PROPERTY), value.as_bytes()) {
        return None;
    }
    let slot = shared_slot();
    ANNOUNCED.with(|a| a.borrow_mut().insert(number, std::rc::Rc::downgrade(&slot)));
    Some((number, slot))
}

/// The shared observer a guard in front announced on this stream, if it is on this thread and alive.
fn announced_observer(envoy: &mut Envoy<'_>) -> Option<SharedSlot> {
    let value = envoy.filter_state(&state_key(OBSERVATION_PROPERTY))?;
    let number = std::str::from_utf8(value).ok()?.strip_prefix(ANNOUNCED_PREFIX)?.parse::<u64>().ok()?;
    ANNOUNCED.with(|a| a.borrow().get(&number).and_then(std::rc::Weak::upgrade))
}

/// What the effects of an event asked for, beyond what they did at once.
#[derive(Debug, Default)]
struct Flags {
    /// The filter answered the request itself (a local reply).
    replied: bool,
    /// llm-metrics marked the first token: the guard holding the response may let it go.
    woken: bool,
    /// The guard lets its held response go.
    resume: bool,
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Some(id) = self.ticked.take() {
            ticker::forget(id);
        }
        if let Some(number) = self.announced.take() {
            ANNOUNCED.with(|a| a.borrow_mut().remove(&number));
        }
    }
}

/// A policy's state, even if a panic elsewhere poisoned its lock (the state is a label bound and
/// counters: a half-made update is still a valid state).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A response event, for the sections in reverse order.
#[derive(Clone, Copy)]
enum ResponseEvent {
    Headers { end_of_stream: bool },
    Body { end_of_stream: bool },
    Trailers,
    Log,
}

impl Stream {
    /// One response observer for the guard's instance and the sluice instance behind it: the guard
    /// (in front, first at the request) announces one; the instance behind, finding it, reads the
    /// response through it instead of its own.
    fn share_observer(&mut self, envoy: &mut Envoy<'_>) {
        if self.announced.is_some() {
            return;
        }
        if matches!(self.sections.as_slice(), [Section::Guard { .. }]) {
            if self.shared.is_none() {
                if let Some((number, slot)) = announce_observer(envoy) {
                    self.announced = Some(number);
                    self.shared = Some(slot);
                }
            }
        } else if let Some(slot) = announced_observer(envoy) {
            self.shared = Some(slot);
            // Said once per process, at the first stream that shares (the deployment's layout works).
            static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            if !SAID.swap(true, Ordering::Relaxed) {
                log(
                    LogLevel::Info,
                    "sluice: the response is read once for latency-guard's instance and this one (its shared observer, announced in filter state)",
                );
            }
        }
    }

    /// Runs the request headers through the sections in pipeline order until one stops them (with
    /// its local reply); they wait if a budget must read the whole body first.
    fn request_headers(&mut self, envoy: &mut Envoy<'_>, end_of_stream: bool) -> HeadersStatus {
        let now = now_ns();
        self.chunk.forget();
        self.share_observer(envoy);
        let mut pairs: Option<HeaderPairs> = None;
        for i in 0..self.sections.len() {
            let Some(section) = self.sections.get_mut(i) else { continue };
            let verdict = match section {
                Section::Guard { config, flow, id } => {
                    let mut view = NativeView { envoy, now, shared: self.shared.as_ref(), chunk: &mut self.chunk, held: None };
                    let verdict = flow.on_request_headers(&mut lock(&config.root), &mut view, &mut *store(), end_of_stream, now, &mut self.effects);
                    if flow.is_guarded() && !end_of_stream && !envoy.set_filter_state(&state_key(GUARD_PENDING), b"1") {
                        log(
                            LogLevel::Warn,
                            "sluice latency-guard: marking the request for the instance behind failed; it may reach the upstream before the guard decides",
                        );
                    }
                    if flow.is_guarded() && self.ticked.is_none() {
                        if let Some(scheduler) = envoy.scheduler() {
                            ticker::watch(*id, scheduler);
                            self.ticked = Some(*id);
                        }
                    }
                    verdict
                }
                Section::Router { router, flow } => {
                    let mut view = NativeView { envoy, now, shared: self.shared.as_ref(), chunk: &mut self.chunk, held: None };
                    flow.on_request_headers(&mut lock(router), &mut view, &mut *store(), end_of_stream, &mut || now, &mut self.effects);
                    Verdict::Continue
                }
                Section::Budget { policy, flow } => {
                    // One read of the map for the path, the identity sources, the version and the encoding.
                    let headers = pairs.get_or_insert_with(|| HeaderPairs::from_pairs(&envoy.request_headers().entries()));
                    flow.on_request_headers(&mut lock(policy), headers, end_of_stream, &mut self.effects)
                }
                Section::Metrics { policy, flow } => {
                    let mut view = NativeView { envoy, now, shared: self.shared.as_ref(), chunk: &mut self.chunk, held: None };
                    flow.on_request_headers(&mut lock(policy), &mut view, now, &mut self.effects);
                    Verdict::Continue
                }
            };
            self.apply(envoy);
            if verdict == Verdict::Pause && !self.flags.replied {
                // Paused (a ledger's answer, a queue): the body Envoy buffers meanwhile is held too.
                envoy.raise_buffer_limit(crate::filter::HELD_BODY_BUFFER_LIMIT);
            }
            if verdict == Verdict::Pause || self.flags.replied {
                return HeadersStatus::StopIteration;
            }
        }
        // A guard in front decides at the body: this instance holds the headers until it has.
        let guard_in_front = || !self.sections.iter().any(|s| matches!(s, Section::Guard { .. })) && envoy.filter_state(&state_key(GUARD_PENDING)).is_some();
        if !end_of_stream && (self.sections.iter().any(Section::holds_request) || guard_in_front()) {
            self.held = Some(Held::default());
            envoy.raise_buffer_limit(crate::filter::HELD_BODY_BUFFER_LIMIT);
            return HeadersStatus::StopIteration;
        }
        HeadersStatus::Continue
    }

    /// Runs a request body piece through the sections; while the request is held, each section
    /// sees the body held so far, and the filter buffers until every section lets it go.
    fn request_body(&mut self, envoy: &mut Envoy<'_>, end_of_stream: bool) -> BodyStatus {
        if self.flags.replied {
            return BodyStatus::StopIterationNoBuffer;
        }
        self.chunk.forget();
        let now = now_ns();
        if let Some(held) = self.held.as_mut() {
            let body = envoy.body(BodyKind::ReceivedRequest);
            held.size = held.size.saturating_add(body.len());
            // Bounded: a budget refuses a body larger than it reads.
            if held.size <= MAX_REQUEST_BODY_BYTES {
                body.copy_into(&mut held.bytes);
            }
        }
        self.run_request_body(envoy, 0, end_of_stream, now)
    }

    /// Runs a request body event through the sections from position `from` until one pauses it.
    fn run_request_body(&mut self, envoy: &mut Envoy<'_>, from: usize, end_of_stream: bool, now: u64) -> BodyStatus {
        self.paused_at = None;
        for i in from..self.sections.len() {
            let size = match &self.held {
                Some(held) => held.size,
                None => envoy.body(BodyKind::ReceivedRequest).len(),
            };
            let held = self.held.as_ref().map(|h| h.bytes.as_slice());
            let Some(section) = self.sections.get_mut(i) else { continue };
            let mut replaced = None;
            let verdict = match section {
                Section::Guard { config, flow, .. } => {
                    if !flow.is_guarded() {
                        continue;
                    }
                    let mut view = NativeView { envoy, now, shared: self.shared.as_ref(), chunk: &mut self.chunk, held };
                    flow.on_request_body(&mut lock(&config.root), &mut view, &mut *store(), size, end_of_stream, now, &mut self.effects)
                }
                Section::Router { router, flow } => {
                    if !flow.wants_request_body() {
                        continue;
                    }
                    let mut view = NativeView { envoy, now, shared: self.shared.as_ref(), chunk: &mut self.chunk, held };
                    let mut router = lock(router);
                    let queued = router.queued();
                    let verdict = flow.on_request_body(&mut router, &mut view, size, end_of_stream, &mut self.effects);
                    // A queued shadow is sent from the main thread, as the configuration's callout.
                    if router.queued() > queued {
                        drop(router);
                        self.inner.commit(EVENT_SHADOWS);
                    }
                    verdict
                }
                Section::Budget { policy, flow } => {
                    if !flow.is_budgeted() {
                        continue;
                    }
                    let mut view = HeldBody { body: held.unwrap_or_default(), now };
                    let mut host = EnvoyBudgetHost { envoy, replaced: None };
                    let verdict = flow.on_request_body(&mut lock(policy), &mut *store(), &mut host, &mut view, size, end_of_stream, now, &mut self.effects);
                    replaced = host.replaced;
                    verdict
                }
                Section::Metrics { policy, flow } => {
                    if flow.is_measured() {
                        let mut view = NativeView { envoy, now, shared: self.shared.as_ref(), chunk: &mut self.chunk, held };
                        flow.on_request_body(&mut lock(policy), &mut view, size, end_of_stream, &mut self.effects);
                    }
                    Verdict::Continue
                }
            };
            // The budget rewrote the body in Envoy (clamp, `include_usage`): the sections behind it
            // read the new bytes, as they do in sluice.wasm.
            if let (Some(bytes), Some(held)) = (replaced, self.held.as_mut()) {
                held.size = bytes.len();
                held.bytes = bytes;
            }
            self.apply(envoy);
            if self.flags.replied {
                return BodyStatus::StopIterationNoBuffer;
            }
            if verdict == Verdict::Pause {
                if end_of_stream {
                    self.paused_at = Some(i);
                }
                return BodyStatus::StopIterationAndBuffer;
            }
        }
        // Every section let the request go: the held headers and body go on together.
        self.held = None;
        BodyStatus::Continue
    }

    /// A callout this stream sent was answered: a Redis ledger's answer to a budget's reservation.
    /// The budget decides; if it admits, the sections after it see the body, and the request goes
    /// on when every one has let it (as sluice.wasm's composite resumes it).
    fn callout_done(&mut self, envoy: &mut Envoy<'_>, id: u64, answer: &CalloutAnswer) {
        let Ok(token) = u32::try_from(id) else { return };
        let Some(i) = self.sections.iter().position(|s| matches!(s, Section::Budget { flow, .. } if flow.awaits_reserve(token))) else {
            return;
        };
        let now = now_ns();
        self.chunk.forget();
        let (verdict, replaced) = match self.sections.get_mut(i) {
            Some(Section::Budget { policy, flow }) => {
                let body = answer.body.get(..MAX_LEDGER_ANSWER_BYTES).unwrap_or(&answer.body);
                let mut host = EnvoyBudgetHost { envoy, replaced: None };
                let verdict = flow.on_reserve_answer(&mut lock(policy), &mut *store(), &mut host, answer.status, body, now, &mut self.effects);
                (verdict, host.replaced)
            }
            _ => return,
        };
        if let (Some(bytes), Some(held)) = (replaced, self.held.as_mut()) {
            held.size = bytes.len();
            held.bytes = bytes;
        }
        self.apply(envoy);
        if self.flags.replied || verdict == Verdict::Pause || self.paused_at != Some(i) {
            // Refused (its local reply is out), or asking the ledger again (a clamped retry).
            return;
        }
        if self.run_request_body(envoy, i + 1, true, now) == BodyStatus::Continue && !self.flags.replied {
            envoy.continue_request();
        }
    }

    /// Tells the tick thread when this guarded stream's tick is next due (after each hook: what
    /// the hook did may have moved it), if that changed.
    fn send_due(&mut self) {
        let (Some(id), Some(Section::Guard { config, .. })) = (self.ticked, self.sections.first()) else { return };
        let due = lock(&config.root).stream_due_ns(id, now_ns());
        if self.due_sent != Some(due) {
            self.due_sent = Some(due);
            ticker::set_due(id, due);
        }
    }

    /// Applies the effects one section's event returned.
    fn apply(&mut self, envoy: &mut Envoy<'_>) {
        apply(envoy, &self.inner.catalogue, &mut self.effects, &mut self.chunk, self.held.as_mut(), &mut self.flags);
    }

    /// llm-metrics marked the first token while the guard holds the response: the guard's root
    /// decides on the mark now, in this hook (natively there is no release queue to go through).
    fn release(&mut self, envoy: &mut Envoy<'_>, now: u64) {
        let Some(Section::Guard { config, id, .. }) = self.sections.first() else { return };
        let id = *id;
        {
            let mut view = NativeView { envoy, now, shared: self.shared.as_ref(), chunk: &mut self.chunk, held: None };
            lock(&config.root).on_release(id.to_string().as_bytes(), now, &mut |i| i == id, &mut view, &mut *store(), &mut self.effects);
        }
        self.apply(envoy);
        if std::mem::take(&mut self.flags.resume) || self.flags.replied {
            self.response_held = false;
        }
    }

    /// The module's tick for this stream (on its worker): the guard's root releases it, fires its
    /// deadline or resets it, and, once per tick, sweeps the breakers and re-times the tick.
    fn tick(&mut self, envoy: &mut Envoy<'_>, tick: ticker::Tick) {
        let Some(Section::Guard { config, flow, id }) = self.sections.first() else { return };
        if !flow.is_guarded() || self.flags.replied {
            return;
        }
        let (id, now) = (*id, now_ns());
        self.chunk.forget();
        {
            let mut root = lock(&config.root);
            let mut view = NativeView { envoy, now, shared: self.shared.as_ref(), chunk: &mut self.chunk, held: None };
            root.on_tick_stream(id, now, &mut |i| i == id, &mut view, &mut *store(), &mut self.effects);
            if config.last_tick.swap(tick, Ordering::Relaxed) != tick {
                root.after_tick(now, &mut *store(), &mut self.effects);
            }
        }
        self.apply(envoy);
        if self.flags.replied {
            self.response_held = false;
        } else if std::mem::take(&mut self.flags.resume) && self.response_held {
            self.response_held = false;
            envoy.continue_response();
        }
    }

    fn response(&mut self, envoy: &mut Envoy<'_>, event: ResponseEvent) {
        self.chunk.forget();
        let now = now_ns();
        if matches!(event, ResponseEvent::Body { .. }) && self.response_held {
            // The filter behind (llm-metrics) saw this chunk first and marked the first token in
            // filter state if it carried one: the guard lets the response go now, in this hook.
            self.release(envoy, now);
        }
        for i in (0..self.sections.len()).rev() {
            let size = match event {
                ResponseEvent::Body { .. } => self.chunk.size(envoy, BodyKind::ReceivedResponse),
                _ => 0,
            };
            let Some(section) = self.sections.get_mut(i) else { continue };
            let mut view = NativeView { envoy, now, shared: self.shared.as_ref(), chunk: &mut self.chunk, held: None };
            let fx = &mut self.effects;
            match section {
                Section::Guard { config, flow, .. } => {
                    if flow.is_guarded() {
                        let root = &mut lock(&config.root);
                        match event {
                            ResponseEvent::Headers { end_of_stream } => {
                                if flow.on_response_headers(root, &mut view, &mut *store(), end_of_stream, now, fx) == Verdict::Pause {
                                    self.response_held = true;
                                }
                            }
                            // While it holds the response, the guard sees its body when it lets it go.
                            ResponseEvent::Body { end_of_stream } if !self.response_held => {
                                flow.on_response_body(root, &mut view, &mut *store(), size, end_of_stream, now, fx);
                            }
                            ResponseEvent::Body { .. } => {}
                            ResponseEvent::Trailers => flow.on_response_trailers(),
                            ResponseEvent::Log => flow.on_log(root, &mut view, &mut *store(), now, fx),
                        }
                    }
                }
                Section::Router { router, flow } => match event {
                    ResponseEvent::Headers { .. } if flow.wants_response() => flow.on_response_headers(&mut lock(router), &mut view, fx),
                    ResponseEvent::Body { end_of_stream } if flow.wants_response() => {
                        flow.on_response_body(&mut lock(router), &mut view, size, end_of_stream, &mut || now, fx);
                    }
                    ResponseEvent::Log if flow.is_routed() => flow.on_log(&mut lock(router), &mut view, &mut *store(), &mut || now, fx),
                    _ => {}
                },
                Section::Budget { policy, flow } => {
                    if flow.is_budgeted() {
                        let policy = &mut lock(policy);
                        match event {
                            ResponseEvent::Headers { .. } => flow.on_response_headers(policy, &mut view, now, fx),
                            ResponseEvent::Body { end_of_stream } => flow.on_response_body(policy, &mut *store(), &mut view, size, end_of_stream, now, fx),
                            ResponseEvent::Trailers => flow.on_response_trailers(policy, &mut *store(), &mut view, now, fx),
                            ResponseEvent::Log => flow.on_log(policy, &mut *store(), &mut view, now, fx),
                        }
                    }
                }
                Section::Metrics { policy, flow } => {
                    if flow.is_measured() {
                        let policy = &mut lock(policy);
                        match event {
                            ResponseEvent::Headers { end_of_stream } => flow.on_response_headers(policy, &mut view, end_of_stream, fx),
                            ResponseEvent::Body { end_of_stream } => flow.on_response_body(policy, &mut view, size, end_of_stream, now, fx),
                            ResponseEvent::Trailers => flow.on_response_trailers(policy, &mut view, now, fx),
                            ResponseEvent::Log => flow.on_log(policy, &mut view, fx),
                        }
                    }
                }
            }
            self.apply(envoy);
            if std::mem::take(&mut self.flags.woken) && self.response_held {
                self.release(envoy, now);
            }
        }
    }
}

impl Filter for Stream {
    fn on_request_headers(&mut self, envoy: &mut Envoy<'_>, end_of_stream: bool) -> HeadersStatus {
        let status = self.request_headers(envoy, end_of_stream);
        self.send_due();
        status
    }

    fn on_request_body(&mut self, envoy: &mut Envoy<'_>, end_of_stream: bool) -> BodyStatus {
        let status = self.request_body(envoy, end_of_stream);
        self.send_due();
        status
    }

    fn on_response_headers(&mut self, envoy: &mut Envoy<'_>, end_of_stream: bool) -> HeadersStatus {
        self.response(envoy, ResponseEvent::Headers { end_of_stream });
        self.send_due();
        if self.response_held {
            HeadersStatus::StopIteration
        } else {
            HeadersStatus::Continue
        }
    }

    fn on_response_body(&mut self, envoy: &mut Envoy<'_>, end_of_stream: bool) -> BodyStatus {
        self.response(envoy, ResponseEvent::Body { end_of_stream });
        self.send_due();
        if self.response_held {
            BodyStatus::StopIterationAndBuffer
        } else {
            BodyStatus::Continue
        }
    }

    fn on_response_trailers(&mut self, envoy: &mut Envoy<'_>) {
        self.response(envoy, ResponseEvent::Trailers);
        self.send_due();
    }

    fn on_stream_complete(&mut self, envoy: &mut Envoy<'_>) {
        self.response(envoy, ResponseEvent::Log);
        if let Some(id) = self.ticked.take() {
            ticker::forget(id);
        }
    }

    fn on_scheduled(&mut self, envoy: &mut Envoy<'_>, event: u64) {
        self.tick(envoy, event);
        // The tick thread forgot the due time it ticked: this stream's next one is always sent.
        self.due_sent = None;
        self.send_due();
    }

    fn on_callout_done(&mut self, envoy: &mut Envoy<'_>, id: u64, answer: &CalloutAnswer) {
        self.callout_done(envoy, id, answer);
    }
}

fn received(dir: Dir) -> BodyKind {
    match dir {
        Dir::Request => BodyKind::ReceivedRequest,
        Dir::Response => BodyKind::ReceivedResponse,
    }
}

/// Applies a flow's effects to the stream, in order, and empties the list; whether one of them
/// answered the request (a local reply).
///
/// A change of the request headers makes Envoy look the route up again (as Envoy's wasm filter does
/// on every request-header change), so a route header set here picks the cluster. A replaced
/// request body while the filter holds the request is the whole body: what Envoy buffered and the
/// current piece are replaced, and the sections after this one read the new bytes.
fn apply(envoy: &mut Envoy<'_>, catalogue: &Catalogue, effects: &mut Effects, chunk: &mut Chunk, mut held: Option<&mut Held>, flags: &mut Flags) {
    let mut request_headers_changed = false;
    for effect in effects.drain() {
        let failed = match effect {
            Effect::Count { name, delta } | Effect::GaugeAdd { name, delta } => catalogue.record(envoy, &name, Sample::Add(delta)).err(),
            Effect::GaugeSet { name, value } | Effect::Record { name, value } => catalogue.record(envoy, &name, Sample::Set(value)).err(),
            Effect::SetState { key, value } => (!envoy.set_filter_state(&state_key(&key), &value)).then(|| format!("writing filter state {key} failed")),
            Effect::SetHeader { dir, name, value } => {
                request_headers_changed |= dir == Dir::Request;
                let mut headers = match dir {
                    Dir::Request => envoy.request_headers(),
                    Dir::Response => envoy.response_headers(),
                };
                let done = match value {
                    Some(value) => headers.set(&name, value.as_bytes()),
                    None => headers.remove(&name),
                };
                (!done).then(|| format!("setting header {name} failed"))
            }
            Effect::ReplaceBody { dir, bytes } => {
                chunk.forget();
                let kind = received(dir);
                let replaced = match (dir, held.as_deref_mut()) {
                    (Dir::Request, Some(held)) => {
                        held.size = bytes.len();
                        held.bytes.clone_from(&bytes);
                        // The whole body (in the body hook, or after a callout's answer).
                        replace_request_body(envoy, &bytes)
                    }
                    _ => envoy.drain_body(kind, usize::MAX) && envoy.append_body(kind, &bytes),
                };
                (!replaced).then(|| "replacing a body chunk failed".to_string())
            }
            Effect::AppendBody { dir, bytes } => {
                chunk.forget();
                (!envoy.append_body(received(dir), &bytes)).then(|| "appending to a body chunk failed".to_string())
            }
            Effect::MarkReply(reply) => {
                let key = state_key(sluice_core::contract::GATEWAY_REPLY_PROPERTY);
                (!envoy.set_filter_state(&key, reply.encode().as_bytes())).then(|| "marking the gateway reply failed".to_string())
            }
            Effect::LocalReply { status, headers, body } => {
                let pairs: Vec<(&str, &[u8])> = headers.iter().map(|(k, v)| (k.as_str(), v.as_bytes())).collect();
                envoy.send_response(status, &pairs, &body, "sluice");
                flags.replied = true;
                None
            }
            Effect::Log { level, message } => {
                log(log_level(level), &message);
                None
            }
            Effect::WakeGuard => {
                flags.woken = true;
                None
            }
            Effect::ResumeResponse => {
                flags.resume = true;
                None
            }
            Effect::ResetStream => {
                envoy.reset_stream("sluice_latency_guard_reset");
                None
            }
            // The tick thread follows each stream's own due time ([`Stream::send_due`]), not the
            // root's period over all of them.
            Effect::SetTickPeriod { .. } => None,
        };
        if let Some(problem) = failed {
            log(LogLevel::Warn, &format!("sluice: {problem}"));
        }
    }
    if request_headers_changed {
        envoy.clear_route_cache();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_keys_are_the_wasm_filters() {
        assert_eq!(state_key("sluice_llm"), "wasm.sluice_llm");
    }

    #[test]
    fn time_moves_forward_from_the_wall_clock() {
        let a = now_ns();
        let b = now_ns();
        assert!(b >= a);
        // After 2020-01-01: the epoch, not the process start.
        assert!(a > 1_577_836_800_000_000_000);
    }
}
