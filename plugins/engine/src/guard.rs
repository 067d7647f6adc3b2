//! latency-guard's section: the proxy-wasm side of `sluice_core::flow::guard` ([`GuardRoot`] per
//! VM, [`GuardFlow`] per stream) — read, call the flow, apply its effects. What stays here is what
//! only a proxy-wasm host has: the release queue (registered, dequeued), the initial tick, and
//! making a watched stream the effective context before the root acts on it.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};
use sluice_core::flow::guard::{self, GuardFlow, GuardRoot};
use sluice_core::flow::{Effects, Verdict};
use sluice_core::latency::{deadline, LatencyPolicy};
use sluice_core::store;
use sluice_proxy_host as host;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

/// Shared-data counter that gives each guard VM (one per worker) its own release queue.
const VM_SEQUENCE_KEY: &str = "sluice/latency-guard/vm-sequence";

/// Per-VM state shared by the root and every stream (a VM is single-threaded).
struct Shared {
    root: GuardRoot,
    metrics: host::Metrics,
    effects: Effects,
}

impl Shared {
    /// Applies what the flow pushed, in the current context.
    fn apply(&mut self, body_size: usize) {
        host::apply(&mut self.effects, &mut self.metrics, body_size);
    }
}

pub struct Root {
    shared: Option<Rc<RefCell<Shared>>>,
}

impl Root {
    /// Sets the section up with its validated policy: shared state, the release queue, the tick.
    pub fn configure(policy: LatencyPolicy) -> Option<Root> {
        if let Err(e) = guard::ensure_shared_state(&policy, &mut host::SharedData) {
            log::error!("sluice latency-guard: {e}");
            return None;
        }
        let vm_id = host::property(&["plugin_vm_id"]).unwrap_or_default();
        let release_queue = register_release_queue();
        if let Err(status) = host::set_tick_period(Duration::from_nanos(deadline::IDLE_TICK_NS)) {
            log::error!("sluice latency-guard: cannot set the tick ({status:?}); deadlines would never fire");
            return None;
        }
        log::info!(
            "sluice latency-guard: configured ({} classes, {} versions, {} with a breaker)",
            policy.classes.len(),
            policy.versions.len(),
            policy.versions.iter().filter(|v| v.breaker.is_some()).count()
        );
        let root = GuardRoot::new(policy, release_queue.map(|(name, _)| name), vm_id);
        Some(Root { shared: Some(Rc::new(RefCell::new(Shared { root, metrics: host::Metrics::default(), effects: Effects::default() }))) })
    }
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        // Configured by the engine ([`Root::configure`]) before Envoy's call reaches here.
        self.shared.is_some()
    }

    fn on_tick(&mut self) {
        let Some(shared) = self.shared.clone() else { return };
        let now = host::now_ns();
        let mut guard = shared.borrow_mut();
        let sh = &mut *guard;
        for id in sh.root.due_ids(now) {
            sh.root.on_tick_stream(id, now, &mut host::set_effective_context, &mut host::LiveView, &mut host::SharedData, &mut sh.effects);
            sh.apply(0);
        }
        sh.root.after_tick(now, &mut host::SharedData, &mut sh.effects);
        sh.apply(0);
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        let Some(shared) = self.shared.clone() else { return };
        let mut guard = shared.borrow_mut();
        let sh = &mut *guard;
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
            let now = host::now_ns();
            sh.root.on_release(&item, now, &mut host::set_effective_context, &mut host::LiveView, &mut host::SharedData, &mut sh.effects);
            sh.apply(0);
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Guard { shared: self.shared.clone(), flow: GuardFlow::new(context_id) }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Guard {
    shared: Option<Rc<RefCell<Shared>>>,
    flow: GuardFlow,
}

impl Guard {
    /// Calls the flow with the VM's root and applies what it returns.
    fn with(&mut self, body_size: usize, event: impl FnOnce(&mut GuardFlow, &mut GuardRoot, &mut Effects) -> Verdict) -> Action {
        let Some(shared) = self.shared.as_ref() else { return Action::Continue };
        let mut guard = shared.borrow_mut();
        let sh = &mut *guard;
        let verdict = event(&mut self.flow, &mut sh.root, &mut sh.effects);
        sh.apply(body_size);
        match verdict {
            Verdict::Continue => Action::Continue,
            Verdict::Pause => Action::Pause,
        }
    }
}

impl Context for Guard {}

impl HttpContext for Guard {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        let now = host::now_ns();
        let action = self.with(0, move |flow, root, fx| flow.on_request_headers(root, &mut host::LiveView, &mut host::SharedData, end_of_stream, now, fx));
        if self.flow.is_guarded() {
            // The filters behind read the response before the guard does: they find the observer
            // the guard will read through ([`host::stream`]).
            host::stream::announce();
        }
        action
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.flow.is_guarded() {
            return Action::Continue;
        }
        let now = host::now_ns();
        self.with(body_size, move |flow, root, fx| flow.on_request_body(root, &mut host::LiveView, &mut host::SharedData, body_size, end_of_stream, now, fx))
    }

    fn on_http_response_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        if !self.flow.is_guarded() {
            return Action::Continue;
        }
        let now = host::now_ns();
        self.with(0, move |flow, root, fx| flow.on_response_headers(root, &mut host::LiveView, &mut host::SharedData, end_of_stream, now, fx))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.flow.is_guarded() {
            return Action::Continue;
        }
        let now = host::now_ns();
        self.with(body_size, move |flow, root, fx| flow.on_response_body(root, &mut host::LiveView, &mut host::SharedData, body_size, end_of_stream, now, fx))
    }

    fn on_http_response_trailers(&mut self, _n: usize) -> Action {
        self.flow.on_response_trailers();
        Action::Continue
    }

    fn on_log(&mut self) {
        if !self.flow.is_guarded() {
            return;
        }
        let now = host::now_ns();
        self.with(0, move |flow, root, fx| {
            flow.on_log(root, &mut host::LiveView, &mut host::SharedData, now, fx);
            Verdict::Continue
        });
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
