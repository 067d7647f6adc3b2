//! sluice llm-metrics: a proxy-wasm HTTP filter that measures every LLM request passing through
//! Envoy — time to first content token, time per output token, decode tokens/s, duration, token
//! counts, cost — as Envoy metrics with bounded labels, plus a per-request access-log stamp.
//!
//! This crate is the thin adapter: it reads what the host gives (headers, body chunks, time,
//! properties), hands it to `sluice-core`, and writes back metrics and filter state. It never
//! buffers a stream and never delays a request: every callback returns `Continue`.

pub mod config;

use config::{Settings, TenantSource};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};
use sluice_core::api::ApiKind;
use sluice_core::metrics::{self, UninspectedReason};
use sluice_core::report::{LabelBound, Labels, MetricKind, Outcome, RequestRecord, OTHER};
use sluice_core::request::{inspect_request, ContextBucket, RequestInfo};
use sluice_core::response::{inspect_response_body, StreamObserver};
use sluice_core::sse::StreamTail;
use sluice_core::timing::StreamTiming;
use sluice_proxy_host as host;
use std::cell::RefCell;
use std::rc::Rc;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    sluice_proxy_host::install_panic_hook("llm-metrics");
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

pub use sluice_core::contract::FIRST_TOKEN_PROPERTY;
use sluice_core::contract::{FirstTokenMark, ReleaseAddress, RELEASE_PROPERTY};

/// Per-VM state shared by the root and every stream (a VM is single-threaded).
struct Shared {
    settings: Settings,
    metrics: host::Metrics,
    model_versions: LabelBound,
    tenants: LabelBound,
}

#[derive(Default)]
struct Root {
    shared: Option<Rc<RefCell<Shared>>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let Some(bytes) = host::plugin_configuration() else { return false };
        match Settings::parse(&bytes) {
            Ok(settings) => {
                let model_versions = LabelBound::new(settings.model_versions.iter().cloned(), settings.max_dynamic_model_versions);
                // Tenants are named explicitly: a tenant name is not a free-form label.
                let tenants = LabelBound::new(settings.tenants.iter().cloned(), 0);
                log::info!("sluice llm-metrics: configured ({} price entries)", settings.prices.len());
                self.shared = Some(Rc::new(RefCell::new(Shared { settings, metrics: host::Metrics::default(), model_versions, tenants })));
                true
            }
            Err(e) => {
                log::error!("sluice llm-metrics: configuration refused: {e}");
                false
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream { shared: self.shared.clone(), state: None }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// One HTTP stream. `state` is `None` for traffic the configuration does not measure.
struct Stream {
    shared: Option<Rc<RefCell<Shared>>>,
    state: Option<Box<Measured>>,
}

/// Why a body was not inspected; counted so an operator sees what is being missed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Skip {
    Encoded,
    TooLarge,
}

struct Measured {
    kind: ApiKind,
    start_ns: u64,
    model_version_header: Option<String>,
    tenant_label: String,
    request_body: Vec<u8>,
    request_skip: Option<Skip>,
    request: Option<RequestInfo>,
    in_flight_label: Option<String>,
    status: u16,
    streaming: bool,
    observer: Option<StreamObserver>,
    response_body: Vec<u8>,
    response_skip: Option<Skip>,
    timing: StreamTiming,
    /// Last bytes of the streamed body, to know whether it ended on an event boundary.
    stream_tail: StreamTail,
    response_ended: bool,
    reported: bool,
}

impl Context for Stream {}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(shared) = self.shared.clone() else { return Action::Continue };
        let path = host::header(MapType::HttpRequestHeaders, ":path").unwrap_or_default();
        let mut sh = shared.borrow_mut();
        if !sh.settings.wants_path(&path) {
            return Action::Continue;
        }
        let Some(kind) = ApiKind::from_path(&path) else { return Action::Continue };
        let tenant = match &sh.settings.tenant {
            TenantSource::None => None,
            TenantSource::Header(name) => host::header(MapType::HttpRequestHeaders, name),
            TenantSource::Property(path) => host::property(path),
        };
        let tenant_label = match tenant.as_deref().map(str::trim) {
            None | Some("") => "anonymous".to_string(),
            Some(t) => sh.tenants.label(t),
        };
        let request_skip = match host::header(MapType::HttpRequestHeaders, "content-encoding") {
            Some(enc) if !enc.eq_ignore_ascii_case("identity") => Some(Skip::Encoded),
            _ => None,
        };
        let model_version_header = host::header(MapType::HttpRequestHeaders, &sh.settings.model_version_header).filter(|v| !v.is_empty());
        let mut m = Box::new(Measured {
            kind,
            start_ns: host::now_ns(),
            model_version_header,
            tenant_label,
            request_body: Vec::new(),
            request_skip,
            request: None,
            in_flight_label: None,
            status: 0,
            streaming: false,
            observer: None,
            response_body: Vec::new(),
            response_skip: None,
            timing: StreamTiming::default(),
            stream_tail: StreamTail::default(),
            response_ended: false,
            reported: false,
        });
        m.timing = StreamTiming::new(m.start_ns);
        if m.model_version_header.is_some() {
            m.enter_in_flight(&mut sh);
        }
        self.state = Some(m);
        Action::Continue
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let (Some(shared), Some(m)) = (self.shared.as_ref(), self.state.as_mut()) else {
            return Action::Continue;
        };
        let mut sh = shared.borrow_mut();
        if m.request_skip.is_none() {
            if m.request_body.len().saturating_add(body_size) > sh.settings.max_request_body_bytes {
                m.request_skip = Some(Skip::TooLarge);
                m.request_body = Vec::new();
            } else {
                m.request_body.extend_from_slice(&host::body(BufferType::HttpRequestBody, body_size));
            }
        }
        if end_of_stream {
            m.finish_request_body(&mut sh);
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let (Some(shared), Some(m)) = (self.shared.as_ref(), self.state.as_mut()) else {
            return Action::Continue;
        };
        let mut sh = shared.borrow_mut();
        // A request body that never signalled its end (e.g. a GET) is settled now.
        m.finish_request_body(&mut sh);
        m.status = host::header(MapType::HttpResponseHeaders, ":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        let content_type = host::header(MapType::HttpResponseHeaders, "content-type").unwrap_or_default();
        m.streaming = content_type.to_ascii_lowercase().starts_with("text/event-stream");
        if let Some(enc) = host::header(MapType::HttpResponseHeaders, "content-encoding") {
            if !enc.eq_ignore_ascii_case("identity") {
                m.response_skip = Some(Skip::Encoded);
            }
        }
        if m.streaming && m.response_skip.is_none() {
            m.observer = Some(StreamObserver::new(m.kind));
            // latency-guard (in front) holds the response until the first content token: it reads
            // this filter state, "0" while waiting (an empty value reads back as absent).
            host::set_property(FIRST_TOKEN_PROPERTY, FirstTokenMark::WAITING);
        }
        if end_of_stream {
            // A response without a body (another filter's empty local reply, a 204) ends here: no
            // body callback follows, and on_log would take it for a client that went away.
            let now = host::now_ns();
            if m.observer.is_some() {
                mark_first_token(now);
            }
            m.response_ended = true;
            let record = m.record(&sh, now, Outcome::Completed);
            m.report(&mut sh, &record);
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let (Some(shared), Some(m)) = (self.shared.as_ref(), self.state.as_mut()) else {
            return Action::Continue;
        };
        let now = host::now_ns();
        let mut sh = shared.borrow_mut();
        if let Some(observer) = m.observer.as_mut() {
            let chunk = host::body(BufferType::HttpResponseBody, body_size);
            m.stream_tail.push(&chunk);
            let mut outcome = observer.push(&chunk);
            if end_of_stream {
                let last = observer.finish();
                outcome.content_events = outcome.content_events.saturating_add(last.content_events);
            }
            if outcome.content_events > 0 {
                if m.timing.first_content_ns.is_none() {
                    mark_first_token(now);
                }
                m.timing.on_content(now, outcome.content_events);
            }
        } else if m.response_skip.is_none() && !m.streaming {
            if m.response_body.len().saturating_add(body_size) > sh.settings.max_response_body_bytes {
                m.response_skip = Some(Skip::TooLarge);
                m.response_body = Vec::new();
            } else {
                m.response_body.extend_from_slice(&host::body(BufferType::HttpResponseBody, body_size));
            }
        }
        if end_of_stream {
            if m.observer.is_some() && m.timing.first_content_ns.is_none() {
                // A stream that ends without a content token (an error event, an empty answer) also
                // releases what latency-guard holds: the client gets the upstream's own answer.
                mark_first_token(now);
            }
            m.response_ended = true;
            let record = m.record(&sh, now, Outcome::Completed);
            if sh.settings.stream_summary_comment && m.observer.is_some() {
                let mut comment = m.stream_tail.separator_before_new_event().to_string();
                comment.push_str(&summary_comment(&record));
                host::append_response_body(body_size, comment.as_bytes());
            }
            m.report(&mut sh, &record);
        }
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        // Trailers end the response (an HTTP/2 upstream's, or those Envoy's decompressor adds):
        // the body saw no end_of_stream, and without this the request would be recorded at
        // teardown as a client disconnect.
        let (Some(shared), Some(m)) = (self.shared.as_ref(), self.state.as_mut()) else {
            return Action::Continue;
        };
        if m.reported {
            return Action::Continue;
        }
        let now = host::now_ns();
        let mut sh = shared.borrow_mut();
        if let Some(observer) = m.observer.as_mut() {
            let last = observer.finish();
            if last.content_events > 0 {
                if m.timing.first_content_ns.is_none() {
                    mark_first_token(now);
                }
                m.timing.on_content(now, last.content_events);
            }
            if m.timing.first_content_ns.is_none() {
                mark_first_token(now);
            }
        }
        m.response_ended = true;
        let record = m.record(&sh, now, Outcome::Completed);
        m.report(&mut sh, &record);
        Action::Continue
    }

    fn on_log(&mut self) {
        let (Some(shared), Some(m)) = (self.shared.as_ref(), self.state.as_mut()) else { return };
        let mut sh = shared.borrow_mut();
        m.finish_request_body(&mut sh);
        if !m.reported {
            if let Some(observer) = m.observer.as_mut() {
                // A trailing event without its blank line still counts.
                let last = observer.finish();
                if last.content_events > 0 {
                    m.timing.on_content(host::now_ns(), last.content_events);
                }
            }
            let outcome = host::interrupted_outcome();
            let record = m.record(&sh, host::now_ns(), outcome);
            m.report(&mut sh, &record);
        }
        if let Some(label) = m.in_flight_label.take() {
            sh.metrics.add(MetricType::Gauge, &metrics::in_flight(&label), -1);
        }
    }
}

/// Marks the first content token for latency-guard and, when the guard holds this stream, wakes it
/// through its release queue (otherwise it would notice at its next tick, milliseconds later).
fn mark_first_token(now: u64) {
    host::set_property(FIRST_TOKEN_PROPERTY, FirstTokenMark::at(now).as_bytes());
    let Some(release) = host::property(&[RELEASE_PROPERTY.to_string()]) else { return };
    let Some(ReleaseAddress { stream, queue, vm_id }) = ReleaseAddress::decode(&release) else { return };
    match proxy_wasm::hostcalls::resolve_shared_queue(vm_id, queue) {
        Ok(Some(queue_id)) => {
            if let Err(status) = proxy_wasm::hostcalls::enqueue_shared_queue(queue_id, Some(stream.as_bytes())) {
                log::debug!("sluice llm-metrics: waking latency-guard failed: {status:?}");
            }
        }
        Ok(None) | Err(_) => log::debug!("sluice llm-metrics: latency-guard's release queue {queue} not found"),
    }
}

fn summary_comment(record: &RequestRecord) -> String {
    let opt = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_else(|| "-".into());
    format!(
        ": sluice ttft_us={} tpot_us={} output_tokens={} input_tokens={} usage={}\n\n",
        opt(record.ttft_ns().map(|v| v / 1000)),
        opt(record.tpot_ns().map(|v| v / 1000)),
        record.output_tokens(),
        record.input_tokens(),
        if record.response.usage_reported { "reported" } else { "estimated" },
    )
}

impl Measured {
    fn model_version_raw(&self) -> Option<String> {
        self.model_version_header.clone().or_else(|| self.request.as_ref().and_then(|r| r.model.clone()))
    }

    fn enter_in_flight(&mut self, sh: &mut Shared) {
        if self.in_flight_label.is_some() {
            return;
        }
        let raw = self.model_version_raw().unwrap_or_else(|| "unknown".into());
        let label = sh.model_versions.label(&raw);
        sh.metrics.add(MetricType::Gauge, &metrics::in_flight(&label), 1);
        self.in_flight_label = Some(label);
    }

    /// Parses the request body once it is complete (or abandons it), then counts the request in flight.
    fn finish_request_body(&mut self, sh: &mut Shared) {
        if self.request.is_none() && self.request_skip.is_none() && !self.request_body.is_empty() {
            match inspect_request(self.kind, &self.request_body) {
                Ok(info) => self.request = Some(info),
                Err(e) => {
                    log::debug!("sluice llm-metrics: request body not inspected: {e}");
                    sh.metrics.add(MetricType::Counter, metrics::request_body_uninspected_total(UninspectedReason::Malformed), 1);
                }
            }
            self.request_body = Vec::new();
        }
        if let Some(skip) = self.request_skip.take() {
            let reason = match skip {
                Skip::Encoded => UninspectedReason::Encoded,
                Skip::TooLarge => UninspectedReason::TooLarge,
            };
            sh.metrics.add(MetricType::Counter, metrics::request_body_uninspected_total(reason), 1);
            self.request_body = Vec::new();
        }
        self.enter_in_flight(sh);
    }

    fn record(&self, sh: &Shared, end_ns: u64, outcome: Outcome) -> RequestRecord {
        let response = match &self.observer {
            Some(observer) => observer.summary(),
            None if !self.response_body.is_empty() => inspect_response_body(self.kind, &self.response_body),
            None => Default::default(),
        };
        let request = self.request.clone().unwrap_or_default();
        // A reply another sluice plugin generated (a refusal, a deadline) is that status and outcome,
        // whatever the upstream's headers said before it.
        let gateway = host::gateway_reply();
        let status = gateway.map_or(self.status, |g| g.status);
        let outcome = Outcome::classify(gateway, outcome, self.status, response.upstream_error.is_some());
        let prompt_tokens = if response.usage_reported { response.usage.input_tokens } else { request.prompt_tokens_estimate };
        let have_request = self.request.is_some();
        let labels = Labels {
            model_version: self.in_flight_label.clone().unwrap_or_else(|| OTHER.to_string()),
            tenant: self.tenant_label.clone(),
            api: self.kind.as_str().to_string(),
            ctx: if have_request || response.usage_reported { ContextBucket::from_tokens(prompt_tokens).as_str().to_string() } else { "unknown".into() },
            turn: match (have_request, request.follow_up) {
                (false, _) => "unknown".into(),
                (true, false) => "first".into(),
                (true, true) => "follow_up".into(),
            },
            stream: self.streaming.to_string(),
        };
        let cost_model = response.response_model.clone().or_else(|| request.model.clone());
        let mut record = RequestRecord {
            labels,
            request_model: request.model.clone(),
            status,
            streaming: self.streaming,
            timing: self.timing,
            end_ns,
            response,
            cost_micro_usd: None,
            outcome,
            prompt_tokens_estimate: request.prompt_tokens_estimate,
        };
        // Providers bill what they generated, including streams cut short, but not refused requests.
        let billable = (200..300).contains(&status);
        if let (true, Some(model)) = (billable, cost_model) {
            let mut usage = record.response.usage;
            usage.input_tokens = record.input_tokens();
            usage.output_tokens = record.output_tokens();
            record.cost_micro_usd = sh.settings.prices.cost_micro_usd(&model, &usage);
        }
        record
    }

    fn report(&mut self, sh: &mut Shared, record: &RequestRecord) {
        if self.reported {
            return;
        }
        self.reported = true;
        for sample in record.samples() {
            match sample.kind {
                MetricKind::Histogram => sh.metrics.record(&sample.name, sample.value),
                MetricKind::Counter => sh.metrics.add(MetricType::Counter, &sample.name, i64::try_from(sample.value).unwrap_or(i64::MAX)),
                MetricKind::Gauge => sh.metrics.add(MetricType::Gauge, &sample.name, i64::try_from(sample.value).unwrap_or(i64::MAX)),
            }
        }
        host::set_property(&sh.settings.filter_state_key, record.stamp_json().as_bytes());
    }
}
