//! model-router's section: the proxy-wasm side of `sluice_core::flow::router` — read, call the
//! flow, apply its effects. What only a host can do stays here: the root's tick (it runs only while
//! shadow requests wait) and the shadow callouts, which the root sends because a stream's callouts
//! die with the stream.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, MapType};
use sluice_core::flow::router::{Router, RouterFlow, MAX_WHOLE_BODY_BYTES, SHADOW_TICK, SHADOW_TIMEOUT};
use sluice_core::flow::{Effects, Verdict};
use sluice_core::routing::RoutingPolicy;
use sluice_proxy_host as host;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

/// Per-VM state shared by the root and every stream (a VM is single-threaded).
struct Shared {
    router: Router,
    metrics: host::Metrics,
    effects: Effects,
    /// Whether the root's tick runs: only while shadow requests wait to be sent (an idle tick
    /// every 20 ms cost ≈ 1 % of a core per worker in Envoy, measured with no traffic).
    tick_armed: bool,
}

pub struct Root {
    shared: Option<Rc<RefCell<Shared>>>,
}

impl Root {
    /// Sets the section up with its validated policy.
    pub fn configure(policy: RoutingPolicy) -> Root {
        let shared = Shared { router: Router::new(policy), metrics: host::Metrics::default(), effects: Effects::default(), tick_armed: false };
        Root { shared: Some(Rc::new(RefCell::new(shared))) }
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        let Some(shared) = self.shared.as_ref() else { return };
        let mut guard = shared.borrow_mut();
        let sh = &mut *guard;
        let (now, status) = (host::now_ns(), host::call_status());
        let body = host::body(BufferType::HttpCallResponseBody, body_size.min(MAX_WHOLE_BODY_BYTES));
        sh.router.on_shadow_answer(token, status, &body, now, &mut sh.effects);
        host::apply(&mut sh.effects, &mut sh.metrics, 0);
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        // Configured by the engine ([`Root::configure`]) before Envoy's call reaches here.
        self.shared.is_some()
    }

    fn on_tick(&mut self) {
        let Some(shared) = self.shared.clone() else { return };
        let jobs = {
            let mut sh = shared.borrow_mut();
            // Every waiting job is sent now: the tick stops until the next one is queued.
            if sh.tick_armed {
                match host::set_tick_period(Duration::ZERO) {
                    Ok(()) => sh.tick_armed = false,
                    Err(status) => log::debug!("stopping the shadow tick failed: {status:?}"),
                }
            }
            sh.router.take_queued()
        };
        for job in jobs {
            let headers: Vec<(&str, &str)> = job.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            let sent = self.dispatch_http_call(&job.cluster, headers, Some(&job.body), vec![], SHADOW_TIMEOUT);
            let mut guard = shared.borrow_mut();
            let sh = &mut *guard;
            match sent {
                Ok(token) => sh.router.shadow_sent(token, job, host::now_ns(), &mut sh.effects),
                Err(status) => sh.router.shadow_not_started(job, &format!("{status:?}"), &mut sh.effects),
            }
            host::apply(&mut sh.effects, &mut sh.metrics, 0);
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream { shared: self.shared.clone(), flow: RouterFlow::new(context_id) }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Stream {
    shared: Option<Rc<RefCell<Shared>>>,
    flow: RouterFlow,
}

impl Stream {
    /// Calls the flow with the VM's router and applies what it returns.
    fn with<T: Default>(&mut self, body_size: usize, event: impl FnOnce(&mut RouterFlow, &mut Shared) -> T) -> T {
        let Some(shared) = self.shared.as_ref() else { return T::default() };
        let mut guard = shared.borrow_mut();
        let sh = &mut *guard;
        let out = event(&mut self.flow, sh);
        host::apply(&mut sh.effects, &mut sh.metrics, body_size);
        out
    }
}

impl Context for Stream {}

fn action(verdict: Verdict) -> Action {
    match verdict {
        Verdict::Continue => Action::Continue,
        Verdict::Pause => Action::Pause,
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        // One read of the whole map: the client headers to remove are almost always absent (a
        // removal check is a hostcall each), and the path, request id, tenant and authority come
        // from it too.
        let mut view = host::RequestHeadersView(host::headers(MapType::HttpRequestHeaders));
        self.with(0, |flow, sh| flow.on_request_headers(&mut sh.router, &mut view, &mut host::SharedData, end_of_stream, &mut host::now_ns, &mut sh.effects));
        Action::Continue
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.flow.wants_request_body() {
            return Action::Continue;
        }
        action(self.with(body_size, |flow, sh| {
            let queued = sh.router.queued();
            let verdict = flow.on_request_body(&mut sh.router, &mut host::LiveView, body_size, end_of_stream, &mut sh.effects);
            // A queued shadow starts the root's tick if it is stopped.
            if sh.router.queued() > queued && !sh.tick_armed {
                match host::set_tick_period(SHADOW_TICK) {
                    Ok(()) => sh.tick_armed = true,
                    Err(status) => log::warn!("setting the shadow tick failed: {status:?}"),
                }
            }
            verdict
        }))
    }

    fn on_http_response_headers(&mut self, _n: usize, _eos: bool) -> Action {
        if self.flow.wants_response() {
            self.with(0, |flow, sh| flow.on_response_headers(&mut sh.router, &mut host::LiveView, &mut sh.effects));
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.flow.wants_response() {
            self.with(0, |flow, sh| flow.on_response_body(&mut sh.router, &mut host::LiveView, body_size, end_of_stream, &mut host::now_ns, &mut sh.effects));
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        if self.flow.is_routed() {
            self.with(0, |flow, sh| flow.on_log(&mut sh.router, &mut host::LiveView, &mut host::SharedData, &mut host::now_ns, &mut sh.effects));
        }
    }
}
