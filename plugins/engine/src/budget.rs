//! tenant-budget's section: the proxy-wasm side of `sluice_core::flow::budget` — read, call the
//! flow, apply its effects; plus the two host operations the flow needs an answer from ([`Host`]:
//! ledger callouts, the request body's replacement) and the root's tick.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, MapType};
use sluice_core::budget::policy::LedgerConfig;
use sluice_core::budget::Policy;
use sluice_core::flow::budget::{next_vm_number, BudgetFlow, BudgetHost, BudgetPolicy, MAX_LEDGER_ANSWER_BYTES, SETTLE_TICK_MS};
use sluice_core::flow::{Effects, Verdict};
use sluice_proxy_host as host;
use sluice_proxy_host::SharedData;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

/// Per-VM state shared by the root and every stream (a VM is single-threaded).
struct Shared {
    budget: BudgetPolicy,
    metrics: host::Metrics,
    effects: Effects,
}

/// The host operations the flow waits on.
struct Host;

impl BudgetHost for Host {
    fn ledger_call(&mut self, ledger: &LedgerConfig, path: &str, body: &[u8]) -> Result<u32, String> {
        let cluster = ledger.cluster.as_deref().unwrap_or_default();
        let headers = vec![(":method", "POST"), (":path", path), (":authority", ledger.authority.as_str()), ("content-type", "application/json")];
        let timeout = Duration::from_millis(u64::from(ledger.timeout_ms));
        proxy_wasm::hostcalls::dispatch_http_call(cluster, headers, Some(body), vec![], timeout).map_err(|status| format!("{status:?}"))
    }

    fn replace_request_body(&mut self, size: usize, bytes: &[u8]) -> bool {
        host::try_replace_body(BufferType::HttpRequestBody, size, bytes)
    }
}

/// The ledger's answer to the callout being delivered: its status (0 when none came) and body.
fn callout_answer(body_size: usize) -> (u16, Vec<u8>) {
    (host::call_status(), host::body(BufferType::HttpCallResponseBody, body_size.min(MAX_LEDGER_ANSWER_BYTES)))
}

fn action(verdict: Verdict) -> Action {
    match verdict {
        Verdict::Continue => Action::Continue,
        Verdict::Pause => Action::Pause,
    }
}

pub struct Root {
    shared: Option<Rc<RefCell<Shared>>>,
}

impl Root {
    /// Whether the section ticks all the time (settlements to the Redis ledger).
    pub fn needs_tick(&self) -> bool {
        self.shared.as_ref().is_some_and(|sh| sh.borrow().budget.needs_tick())
    }

    /// Sets the section up with its validated policy: the counters, the settlement tick.
    pub fn configure(policy: Policy) -> Option<Root> {
        if let Err(e) = policy.ensure_counters(&mut SharedData) {
            log::warn!("creating budget counters failed: {e}");
        }
        log::info!("tenant-budget configured: {} keys, {} budget counters", policy.keys.len(), policy.counters.len());
        // Envoy 1.40 answers the node under the `xds` attributes (`node.id` finds nothing there).
        let node = host::property(&["xds", "node", "id"]).or_else(|| host::property(&["node", "id"])).unwrap_or_default();
        let budget = BudgetPolicy::new(policy, &node, host::now_ns(), next_vm_number(&mut SharedData));
        if budget.needs_tick() {
            log::info!("tenant-budget: Redis hold ids of this proxy start with {} (node id {node:?})", budget.hold_prefix());
        }
        if budget.needs_tick() {
            if let Err(status) = host::set_tick_period(Duration::from_millis(SETTLE_TICK_MS)) {
                log::error!("tenant-budget: cannot set the settlement tick ({status:?}); Redis holds would only expire");
                return None;
            }
        }
        Some(Root { shared: Some(Rc::new(RefCell::new(Shared { budget, metrics: host::Metrics::default(), effects: Effects::default() }))) })
    }

    fn with(&mut self, event: impl FnOnce(&mut BudgetPolicy, &mut Effects)) {
        let Some(shared) = self.shared.as_ref() else { return };
        let mut guard = shared.borrow_mut();
        let sh = &mut *guard;
        event(&mut sh.budget, &mut sh.effects);
        host::apply(&mut sh.effects, &mut sh.metrics, 0);
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        if !self.shared.as_ref().is_some_and(|sh| sh.borrow().budget.awaits_settlement(token)) {
            return;
        }
        let now = host::now_ns();
        let (status, answer) = callout_answer(body_size);
        self.with(|budget, fx| budget.on_settle_answer(token, status, &answer, now, fx));
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        // Configured by the engine ([`Root::configure`]) before Envoy's call reaches here.
        self.shared.is_some()
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream { shared: self.shared.clone(), flow: BudgetFlow::new(context_id) }))
    }

    fn on_tick(&mut self) {
        let now = host::now_ns();
        self.with(|budget, fx| budget.on_tick(&mut Host, now, fx));
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Stream {
    shared: Option<Rc<RefCell<Shared>>>,
    flow: BudgetFlow,
}

impl Stream {
    /// Calls the flow with the VM's policy and applies what it returns.
    fn with<T: Default>(&mut self, body_size: usize, event: impl FnOnce(&mut BudgetFlow, &mut BudgetPolicy, &mut Effects) -> T) -> T {
        let Some(shared) = self.shared.as_ref() else { return T::default() };
        let mut guard = shared.borrow_mut();
        let sh = &mut *guard;
        let out = event(&mut self.flow, &mut sh.budget, &mut sh.effects);
        host::apply(&mut sh.effects, &mut sh.metrics, body_size);
        out
    }
}

impl Context for Stream {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        if !self.flow.awaits_reserve(token) {
            return;
        }
        let now = host::now_ns();
        let (status, answer) = callout_answer(body_size);
        let verdict = self.with(0, |flow, budget, fx| flow.on_reserve_answer(budget, &mut SharedData, &mut Host, status, &answer, now, fx));
        // Only an answer that was handled (not a vanished stream's) resumes the held request.
        if self.shared.is_some() && verdict == Verdict::Continue {
            host::resume_request();
        }
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        // One read of the map for the path, the identity sources, the version and the encoding.
        let headers = host::headers(MapType::HttpRequestHeaders);
        action(self.with(0, |flow, budget, fx| flow.on_request_headers(budget, &headers, end_of_stream, fx)))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.flow.is_budgeted() {
            return Action::Continue;
        }
        let now = host::now_ns();
        action(self.with(body_size, |flow, budget, fx| {
            flow.on_request_body(budget, &mut SharedData, &mut Host, &mut host::LiveView, body_size, end_of_stream, now, fx)
        }))
    }

    fn on_http_response_headers(&mut self, _n: usize, _eos: bool) -> Action {
        if self.flow.is_budgeted() {
            let now = host::now_ns();
            self.with(0, |flow, budget, fx| flow.on_response_headers(budget, &mut host::LiveView, now, fx));
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.flow.is_budgeted() {
            let now = host::now_ns();
            self.with(body_size, |flow, budget, fx| flow.on_response_body(budget, &mut SharedData, &mut host::LiveView, body_size, end_of_stream, now, fx));
        }
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _n: usize) -> Action {
        if self.flow.is_budgeted() {
            let now = host::now_ns();
            self.with(0, |flow, budget, fx| flow.on_response_trailers(budget, &mut SharedData, &mut host::LiveView, now, fx));
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        if self.flow.is_budgeted() {
            let now = host::now_ns();
            self.with(0, |flow, budget, fx| flow.on_log(budget, &mut SharedData, &mut host::LiveView, now, fx));
        }
    }
}
