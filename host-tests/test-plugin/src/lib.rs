//! A proxy-wasm plugin written only to exercise `sluice-host`.
//!
//! Each behaviour is switched on by a request header so that one test states one behaviour:
//!
//! | request header      | what the plugin does                                                    |
//! |---------------------|-------------------------------------------------------------------------|
//! | (always)            | counts requests, stamps `x-seen-path` from the `request.path` property, |
//! |                     | copies the `tenant` property into `x-tenant`, strips `x-internal-secret`,|
//! |                     | sets filter state `sluice_test`, enqueues the path on `test.queue`       |
//! | `x-local-reply`     | answers 429 itself with a JSON body and `retry-after`                    |
//! | `x-callout`         | calls cluster `auth`, pauses; copies the reply body into `x-auth-result` |
//! | `x-grpc`            | calls `svc.Auth/Check` over gRPC, pauses; copies the reply into a header |
//! | `x-cas-conflict`    | bumps shared counter `sluice/test/count`, then writes with a stale CAS   |
//! | `x-panic`           | panics (the VM traps)                                                    |
//! | `x-buffer-request`  | buffers the whole request body and prepends `wrapped:` to it             |
//!
//! Responses: `x-elapsed-ms` is added to the response headers, the time from request headers to
//! the first non-empty response chunk goes to histogram `test.ttfb_ms`, and `: sluice-test done\n\n`
//! is appended to the last response chunk.
//!
//! Configuration (JSON): `{"tick_ms": 100, "fail": false}`. With `"fail": true`, `on_configure`
//! returns false.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use log::{error, info, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MetricType, Status};

const SHARED_COUNT: &str = "sluice/test/count";
const QUEUE: &str = "test.queue";

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|_| Box::new(Root::default()));
}}

#[derive(Clone, Copy, Default)]
struct Metrics {
    requests: u32,
    active: u32,
    ticks: u32,
    ttfb_ms: u32,
    duration_ms: u32,
    request_body_bytes: u32,
    cas_mismatch: u32,
    queue_items: u32,
}

impl Metrics {
    fn define() -> Result<Self, Status> {
        Ok(Self {
            requests: hostcalls::define_metric(MetricType::Counter, "test.requests")?,
            active: hostcalls::define_metric(MetricType::Gauge, "test.active")?,
            ticks: hostcalls::define_metric(MetricType::Counter, "test.ticks")?,
            ttfb_ms: hostcalls::define_metric(MetricType::Histogram, "test.ttfb_ms")?,
            duration_ms: hostcalls::define_metric(MetricType::Histogram, "test.duration_ms")?,
            request_body_bytes: hostcalls::define_metric(
                MetricType::Histogram,
                "test.request_body_bytes",
            )?,
            cas_mismatch: hostcalls::define_metric(MetricType::Counter, "test.cas_mismatch")?,
            queue_items: hostcalls::define_metric(MetricType::Counter, "test.queue_items")?,
        })
    }
}

#[derive(Default)]
struct Root {
    metrics: Metrics,
    queue: u32,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        if let Some(config) = self.get_vm_configuration() {
            info!("vm config: {}", String::from_utf8_lossy(&config));
        }
        true
    }

    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        let config: serde_json::Value = match serde_json::from_slice(&config) {
            Ok(value) => value,
            Err(err) => {
                error!("bad plugin configuration: {err}");
                return false;
            }
        };
        if config["fail"].as_bool() == Some(true) {
            error!("configuration asks me to fail");
            return false;
        }
        self.metrics = match Metrics::define() {
            Ok(metrics) => metrics,
            Err(status) => {
                error!("define_metric failed: {status:?}");
                return false;
            }
        };
        if let Some(ms) = config["tick_ms"].as_u64() {
            self.set_tick_period(Duration::from_millis(ms));
        }
        self.queue = self.register_shared_queue(QUEUE);
        let name = self.get_property(vec!["plugin_name"]).unwrap_or_default();
        info!("configured plugin {}", String::from_utf8_lossy(&name));
        true
    }

    fn on_tick(&mut self) {
        let _ = hostcalls::increment_metric(self.metrics.ticks, 1);
        let now = nanos(self.get_current_time());
        let _ = self.set_shared_data(
            "sluice/test/last_tick_ns",
            Some(now.to_string().as_bytes()),
            None,
        );
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        while let Ok(Some(item)) = self.dequeue_shared_queue(queue_id) {
            let _ = hostcalls::increment_metric(self.metrics.queue_items, 1);
            info!("dequeued {}", String::from_utf8_lossy(&item));
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream {
            id: context_id,
            metrics: self.metrics,
            queue: self.queue,
            started_ns: 0,
            first_chunk_seen: false,
            buffer_request: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Stream {
    id: u32,
    metrics: Metrics,
    queue: u32,
    started_ns: u64,
    first_chunk_seen: bool,
    buffer_request: bool,
}

fn nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

impl Stream {
    fn elapsed_ms(&self) -> u64 {
        (nanos(self.get_current_time()) - self.started_ns) / 1_000_000
    }

    /// Increments the shared counter with a CAS loop, then writes again with the CAS read before
    /// that increment: the host must refuse the stale write.
    fn bump_shared_counter(&self) {
        let mut stale_cas = None;
        for _ in 0..8 {
            let (value, cas) = self.get_shared_data(SHARED_COUNT);
            let n: u64 = value
                .and_then(|v| String::from_utf8(v).ok())
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            match self.set_shared_data(SHARED_COUNT, Some((n + 1).to_string().as_bytes()), cas) {
                Ok(()) => {
                    stale_cas = cas;
                    break;
                }
                Err(Status::CasMismatch) => continue,
                Err(status) => {
                    error!("set_shared_data: {status:?}");
                    return;
                }
            }
        }
        if stale_cas.is_none() {
            // First write ever: use the CAS it produced, then make it stale with one more write.
            let (value, cas) = self.get_shared_data(SHARED_COUNT);
            stale_cas = cas;
            let _ = self.set_shared_data(SHARED_COUNT, value.as_deref(), cas);
        }
        if let Err(Status::CasMismatch) =
            self.set_shared_data(SHARED_COUNT, Some(b"999"), stale_cas)
        {
            let _ = hostcalls::increment_metric(self.metrics.cas_mismatch, 1);
        }
    }
}

impl Context for Stream {
    fn on_http_call_response(
        &mut self,
        _token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        let status = self
            .get_http_call_response_header(":status")
            .unwrap_or_default();
        if status != "200" {
            warn!("auth said {status}");
            self.send_http_response(403, vec![("x-denied-by", "test-plugin")], Some(b"denied"));
            return;
        }
        let body = self
            .get_http_call_response_body(0, body_size)
            .unwrap_or_default();
        self.set_http_request_header("x-auth-result", Some(&String::from_utf8_lossy(&body)));
        self.resume_http_request();
    }

    fn on_grpc_call_response(&mut self, _token: u32, status_code: u32, response_size: usize) {
        if status_code != 0 {
            let (_, message) = self.get_grpc_status();
            self.send_http_response(503, vec![], message.as_deref().map(str::as_bytes));
            return;
        }
        let body = self
            .get_grpc_call_response_body(0, response_size)
            .unwrap_or_default();
        self.set_http_request_header("x-grpc-result", Some(&String::from_utf8_lossy(&body)));
        self.resume_http_request();
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        self.started_ns = nanos(self.get_current_time());
        let _ = hostcalls::increment_metric(self.metrics.requests, 1);
        let _ = hostcalls::increment_metric(self.metrics.active, 1);

        if self.get_http_request_header("x-panic").is_some() {
            panic!("asked to panic in context {}", self.id);
        }

        let path = self
            .get_property(vec!["request", "path"])
            .unwrap_or_default();
        self.set_http_request_header("x-seen-path", Some(&String::from_utf8_lossy(&path)));
        if let Some(tenant) = self.get_property(vec!["tenant"]) {
            self.set_http_request_header_bytes("x-tenant", Some(&tenant));
        }
        if let Some(authority) = self.get_http_request_header_bytes(":authority") {
            self.add_http_request_header("x-authority-len", &authority.len().to_string());
        }
        self.remove_http_request_header("x-internal-secret");
        self.set_property(vec!["sluice_test"], Some(b"seen"));
        let _ = self.enqueue_shared_queue(self.queue, Some(&path));

        if self.get_http_request_header("x-cas-conflict").is_some() {
            self.bump_shared_counter();
        }
        self.buffer_request = self.get_http_request_header("x-buffer-request").is_some();

        if self.get_http_request_header("x-local-reply").is_some() {
            self.send_http_response(
                429,
                vec![("retry-after", "1"), ("content-type", "application/json")],
                Some(br#"{"error":{"message":"slow down","type":"rate_limit","code":"test"}}"#),
            );
            return Action::Pause;
        }
        if self.get_http_request_header("x-callout").is_some() {
            let result = self.dispatch_http_call(
                "auth",
                vec![
                    (":method", "GET"),
                    (":path", "/check"),
                    (":authority", "auth"),
                ],
                Some(b"who?"),
                vec![],
                Duration::from_millis(500),
            );
            return match result {
                Ok(_) => Action::Pause,
                Err(status) => {
                    error!("dispatch_http_call: {status:?}");
                    Action::Continue
                }
            };
        }
        if self.get_http_request_header("x-grpc").is_some() {
            let result = self.dispatch_grpc_call(
                "grpc_upstream",
                "svc.Auth",
                "Check",
                vec![("x-md", b"1")],
                Some(b"req"),
                Duration::from_secs(1),
            );
            return match result {
                Ok(_) => Action::Pause,
                Err(status) => {
                    error!("dispatch_grpc_call: {status:?}");
                    Action::Continue
                }
            };
        }
        Action::Continue
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.buffer_request {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let _ = hostcalls::record_metric(self.metrics.request_body_bytes, body_size as u64);
        self.set_http_request_body(0, 0, b"wrapped:");
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        self.set_http_response_header("x-elapsed-ms", Some(&self.elapsed_ms().to_string()));
        self.set_http_response_header("content-length", None);
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if body_size > 0 && !self.first_chunk_seen {
            self.first_chunk_seen = true;
            let _ = hostcalls::record_metric(self.metrics.ttfb_ms, self.elapsed_ms());
        }
        if end_of_stream {
            self.set_http_response_body(body_size, 0, b": sluice-test done\n\n");
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        let _ = hostcalls::record_metric(self.metrics.duration_ms, self.elapsed_ms());
        let _ = hostcalls::increment_metric(self.metrics.active, -1);
    }
}
