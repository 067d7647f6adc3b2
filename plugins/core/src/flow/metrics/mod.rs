//! llm-metrics' request life: what one LLM request is measured as — time to first content token,
//! time per output token, decode tokens/s, duration, tokens, cost — and when it is reported
//! (metric samples and the access-log stamp).
//!
//! ```text
//! request headers ─► Request (body collected up to its cap) ─► Response (headers seen: observe the
//! stream, or collect the body) ─► Reported (end of the body, trailers, a body-less response, or
//! the request's teardown: a client that went away, an upstream that failed)
//! ```
//!
//! The flow never delays a request: every event continues. A stream is observed chunk by chunk in
//! bounded memory; a whole body is kept up to `max_response_body_bytes` and then dropped.

pub mod config;

use super::{Dir, Effect, Effects, View};
use crate::api::ApiKind;
use crate::contract::{FirstTokenMark, FIRST_TOKEN_PROPERTY};
use crate::metrics::{self, UninspectedReason};
use crate::observation::Observer;
use crate::report::{LabelBound, Labels, MetricKind, Outcome, RequestRecord, OTHER};
use crate::request::{inspect_request, ContextBucket, RequestInfo};
use crate::response::inspect_response_body;
use crate::sse::StreamTail;
use crate::timing::StreamTiming;
use config::{Settings, TenantSource};

/// The validated configuration and the per-VM label bounds every stream shares.
#[derive(Debug)]
pub struct MetricsPolicy {
    pub settings: Settings,
    model_versions: LabelBound,
    tenants: LabelBound,
}

impl MetricsPolicy {
    pub fn new(settings: Settings) -> MetricsPolicy {
        let model_versions = LabelBound::new(settings.model_versions.iter().cloned(), settings.max_dynamic_model_versions);
        // Tenants are named explicitly: a tenant name is not a free-form label.
        let tenants = LabelBound::new(settings.tenants.iter().cloned(), 0);
        MetricsPolicy { settings, model_versions, tenants }
    }
}

/// Why a body was not inspected; counted so an operator sees what is being missed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Skip {
    Encoded,
    TooLarge,
}

/// The request body, until the request is known.
#[derive(Debug)]
enum RequestBody {
    Collecting(Vec<u8>),
    Skipped(Skip),
    Done,
}

/// What is kept of the response body.
#[derive(Debug)]
enum ResponseBody {
    /// A stream, observed event by event; `tail` knows whether it ended on an event boundary.
    Observed(Observer, StreamTail),
    /// A whole answer, collected up to its cap.
    Collected(Vec<u8>),
    /// Encoded, too large, or a stream that cannot be read: reported without its body.
    Unread,
}

/// Where a measured request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Measuring,
    Reported,
}

#[derive(Debug)]
struct Measured {
    kind: ApiKind,
    phase: Phase,
    model_version_header: Option<String>,
    tenant_label: String,
    request_body: RequestBody,
    request: Option<RequestInfo>,
    in_flight_label: Option<String>,
    status: u16,
    streaming: bool,
    response: ResponseBody,
    timing: StreamTiming,
    /// Envoy traces this request: its span attributes are written (`crate::span`).
    traced: bool,
}

/// One stream's measurement; `None` inside for traffic the configuration does not measure.
#[derive(Debug, Default)]
pub struct MetricsFlow {
    measured: Option<Box<Measured>>,
}

impl MetricsFlow {
    /// Whether this request is measured (its path is one the configuration wants).
    pub fn is_measured(&self) -> bool {
        self.measured.is_some()
    }

    /// The host time of the first content token, once seen.
    pub fn first_content_ns(&self) -> Option<u64> {
        self.measured.as_ref().and_then(|m| m.timing.first_content_ns)
    }

    pub fn on_request_headers(&mut self, policy: &mut MetricsPolicy, view: &mut dyn View, now: u64, fx: &mut Effects) {
        let path = view.request_header(":path").unwrap_or_default();
        if !policy.settings.wants_path(&path) {
            return;
        }
        let Some(kind) = ApiKind::from_path(&path) else { return };
        let tenant = match &policy.settings.tenant {
            TenantSource::None => None,
            TenantSource::Header(name) => view.request_header(name),
            TenantSource::Property(path) => crate::flow::property_at(view, path),
        };
        let tenant_label = match tenant.as_deref().map(str::trim) {
            None | Some("") => "anonymous".to_string(),
            Some(t) => policy.tenants.label(t),
        };
        let request_body = match view.request_header("content-encoding") {
            Some(enc) if crate::headers::is_encoded(enc.as_bytes()) => RequestBody::Skipped(Skip::Encoded),
            _ => RequestBody::Collecting(Vec::new()),
        };
        let model_version_header = view.request_header(&policy.settings.model_version_header).filter(|v| !v.is_empty());
        let mut m = Box::new(Measured {
            kind,
            phase: Phase::Measuring,
            model_version_header,
            tenant_label,
            request_body,
            request: None,
            in_flight_label: None,
            status: 0,
            streaming: false,
            // Until response headers say otherwise (a body without them is kept as a whole answer).
            response: ResponseBody::Collected(Vec::new()),
            timing: StreamTiming::new(now),
            traced: crate::span::traced(view.request_header("x-request-id").as_deref()),
        });
        if m.model_version_header.is_some() {
            m.enter_in_flight(policy, fx);
        }
        self.measured = Some(m);
    }

    pub fn on_request_body(&mut self, policy: &mut MetricsPolicy, view: &mut dyn View, size: usize, end_of_stream: bool, fx: &mut Effects) {
        let Some(m) = self.measured.as_mut() else { return };
        if let RequestBody::Collecting(body) = &mut m.request_body {
            if body.len().saturating_add(size) > policy.settings.max_request_body_bytes {
                m.request_body = RequestBody::Skipped(Skip::TooLarge);
            } else {
                body.extend_from_slice(&view.body(Dir::Request, size));
            }
        }
        if end_of_stream {
            m.finish_request_body(policy, fx);
        }
    }

    pub fn on_response_headers(&mut self, policy: &mut MetricsPolicy, view: &mut dyn View, end_of_stream: bool, fx: &mut Effects) {
        let Some(m) = self.measured.as_mut() else { return };
        // A request body that never signalled its end (e.g. a GET) is settled now.
        m.finish_request_body(policy, fx);
        m.status = view.response_header(":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        let content_type = view.response_header("content-type").unwrap_or_default();
        m.streaming = content_type.to_ascii_lowercase().starts_with("text/event-stream");
        let encoded = view.response_header("content-encoding").is_some_and(|enc| crate::headers::is_encoded(enc.as_bytes()));
        m.response = match (m.streaming, encoded) {
            (_, true) => ResponseBody::Unread,
            (true, false) => {
                // latency-guard (in front) holds the response until the first content token: it
                // reads this mark, "0" while waiting (an empty value reads back as absent).
                fx.set_state(FIRST_TOKEN_PROPERTY, FirstTokenMark::WAITING);
                ResponseBody::Observed(view.response_observer(m.kind), StreamTail::default())
            }
            (false, false) => ResponseBody::Collected(Vec::new()),
        };
        if end_of_stream {
            // A response without a body (another filter's empty local reply, a 204) ends here: no
            // body callback follows, and the teardown would take it for a client that went away.
            let now = view.now();
            if m.observed() {
                mark_first_token(now, fx);
            }
            m.report(policy, view, now, Outcome::Completed, fx);
        }
    }

    pub fn on_response_body(&mut self, policy: &mut MetricsPolicy, view: &mut dyn View, size: usize, end_of_stream: bool, now: u64, fx: &mut Effects) {
        let Some(m) = self.measured.as_mut() else { return };
        let cap = policy.settings.max_response_body_bytes;
        match &mut m.response {
            ResponseBody::Observed(observer, tail) => {
                // Only the summary comment needs the tail; a reader behind a shared observer
                // needs no bytes at all.
                let comment = policy.settings.stream_summary_comment;
                let chunk = if comment || observer.reads_chunk() { view.body(Dir::Response, size) } else { std::borrow::Cow::Borrowed(&[][..]) };
                if comment {
                    tail.push(&chunk);
                }
                let mut seen = observer.push(&chunk);
                if end_of_stream {
                    seen.content_events = seen.content_events.saturating_add(observer.finish().content_events);
                }
                if seen.content_events > 0 {
                    if m.timing.first_content_ns.is_none() {
                        mark_first_token(now, fx);
                    }
                    m.timing.on_content(now, seen.content_events);
                }
            }
            ResponseBody::Collected(body) => {
                if body.len().saturating_add(size) > cap {
                    m.response = ResponseBody::Unread;
                } else {
                    body.extend_from_slice(&view.body(Dir::Response, size));
                }
            }
            ResponseBody::Unread => {}
        }
        if end_of_stream {
            if m.observed() && m.timing.first_content_ns.is_none() {
                // A stream that ends without a content token (an error event, an empty answer) also
                // releases what latency-guard holds: the client gets the upstream's own answer.
                mark_first_token(now, fx);
            }
            if m.phase == Phase::Reported {
                return;
            }
            let record = m.record(policy, view, now, Outcome::Completed);
            if policy.settings.stream_summary_comment {
                if let ResponseBody::Observed(_, tail) = &m.response {
                    let mut comment = tail.separator_before_new_event().to_string();
                    comment.push_str(&summary_comment(&record));
                    fx.push(Effect::AppendBody { dir: Dir::Response, bytes: comment.into_bytes() });
                }
            }
            m.emit(policy, &record, fx);
        }
    }

    /// Trailers end the response (an HTTP/2 upstream's, or those Envoy's decompressor adds): the
    /// body saw no end of stream, and without this the request would be recorded at teardown as a
    /// client disconnect.
    pub fn on_response_trailers(&mut self, policy: &mut MetricsPolicy, view: &mut dyn View, now: u64, fx: &mut Effects) {
        let Some(m) = self.measured.as_mut() else { return };
        if m.phase == Phase::Reported {
            return;
        }
        if let ResponseBody::Observed(observer, _) = &mut m.response {
            let last = observer.finish();
            if last.content_events > 0 {
                if m.timing.first_content_ns.is_none() {
                    mark_first_token(now, fx);
                }
                m.timing.on_content(now, last.content_events);
            }
            if m.timing.first_content_ns.is_none() {
                mark_first_token(now, fx);
            }
        }
        m.report(policy, view, now, Outcome::Completed, fx);
    }

    /// The request's teardown: a request not reported yet ended without its last chunk.
    pub fn on_log(&mut self, policy: &mut MetricsPolicy, view: &mut dyn View, fx: &mut Effects) {
        let Some(m) = self.measured.as_mut() else { return };
        m.finish_request_body(policy, fx);
        if m.phase != Phase::Reported {
            let now = view.now();
            if let ResponseBody::Observed(observer, _) = &mut m.response {
                // A trailing event without its blank line still counts.
                let last = observer.finish();
                if last.content_events > 0 {
                    m.timing.on_content(now, last.content_events);
                }
            }
            let outcome = view.unended_outcome();
            m.report(policy, view, now, outcome, fx);
        }
        if let Some(label) = m.in_flight_label.take() {
            fx.push(Effect::GaugeAdd { name: metrics::in_flight(&label), delta: -1 });
        }
    }
}

/// Marks the first content token for latency-guard, and wakes it if it holds this stream.
fn mark_first_token(now: u64, fx: &mut Effects) {
    fx.set_state(FIRST_TOKEN_PROPERTY, FirstTokenMark::at(now));
    fx.push(Effect::WakeGuard);
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
    fn observed(&self) -> bool {
        matches!(self.response, ResponseBody::Observed(..))
    }

    fn enter_in_flight(&mut self, policy: &mut MetricsPolicy, fx: &mut Effects) {
        if self.in_flight_label.is_some() {
            return;
        }
        let raw = self.model_version_header.as_deref().or_else(|| self.request.as_ref().and_then(|r| r.model.as_deref())).unwrap_or("unknown");
        let label = policy.model_versions.label(raw);
        fx.push(Effect::GaugeAdd { name: metrics::in_flight(&label), delta: 1 });
        self.in_flight_label = Some(label);
    }

    /// Parses the request body once it is complete (or counts why it was not), then counts the
    /// request in flight. Idempotent.
    fn finish_request_body(&mut self, policy: &mut MetricsPolicy, fx: &mut Effects) {
        let first = !matches!(self.request_body, RequestBody::Done);
        match std::mem::replace(&mut self.request_body, RequestBody::Done) {
            RequestBody::Collecting(body) if !body.is_empty() => match inspect_request(self.kind, &body) {
                Ok(info) => self.request = Some(info),
                Err(e) => {
                    fx.log(super::LogLevel::Debug, format!("sluice llm-metrics: request body not inspected: {e}"));
                    fx.count(metrics::request_body_uninspected_total(UninspectedReason::Malformed), 1);
                }
            },
            RequestBody::Skipped(skip) => {
                let reason = match skip {
                    Skip::Encoded => UninspectedReason::Encoded,
                    Skip::TooLarge => UninspectedReason::TooLarge,
                };
                fx.count(metrics::request_body_uninspected_total(reason), 1);
            }
            RequestBody::Collecting(_) | RequestBody::Done => {}
        }
        self.enter_in_flight(policy, fx);
        if first && self.traced {
            let version = self.in_flight_label.as_deref().unwrap_or(OTHER);
            crate::span::llm_request(self.kind, self.request.as_ref(), version, &self.tenant_label, fx);
        }
    }

    fn report(&mut self, policy: &MetricsPolicy, view: &mut dyn View, now: u64, outcome: Outcome, fx: &mut Effects) {
        if self.phase == Phase::Reported {
            return;
        }
        let record = self.record(policy, view, now, outcome);
        self.emit(policy, &record, fx);
    }

    fn record(&self, policy: &MetricsPolicy, view: &mut dyn View, end_ns: u64, outcome: Outcome) -> RequestRecord {
        let mut response = match &self.response {
            ResponseBody::Observed(observer, _) => observer.summary(),
            ResponseBody::Collected(body) if !body.is_empty() => inspect_response_body(self.kind, body),
            _ => Default::default(),
        };
        let request = self.request.clone().unwrap_or_default();
        // A reply another sluice policy generated (a refusal, a deadline) is that status and
        // outcome, whatever the upstream's headers said before it.
        let gateway = view.gateway_reply();
        if gateway.is_some() {
            // The error in that reply's body (or the deadline's error event) is the gateway's own
            // message, not the upstream's; a host that does not pass it through this filter (the
            // native module) never sees it, so reporting it would make the two disagree.
            response.upstream_error = None;
        }
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
            record.cost_micro_usd = policy.settings.prices.cost_micro_usd(&model, &usage);
        }
        record
    }

    fn emit(&mut self, policy: &MetricsPolicy, record: &RequestRecord, fx: &mut Effects) {
        self.phase = Phase::Reported;
        // Counters and histograms only: not built for a host that keeps none.
        let samples = if fx.keeps_counters() { record.samples() } else { Vec::new() };
        for sample in samples {
            let value = i64::try_from(sample.value).unwrap_or(i64::MAX);
            fx.push(match sample.kind {
                MetricKind::Histogram => Effect::Record { name: sample.name, value: sample.value },
                MetricKind::Counter => Effect::Count { name: sample.name, delta: value },
                MetricKind::Gauge => Effect::GaugeAdd { name: sample.name, delta: value },
            });
        }
        fx.set_state(&policy.settings.filter_state_key, record.stamp_json());
        if self.traced {
            crate::span::llm_response(record, fx);
        }
    }
}

#[cfg(test)]
mod tests;
