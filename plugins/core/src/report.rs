//! What one finished LLM request becomes: flat metric samples whose names carry their labels (Envoy
//! turns them back into Prometheus labels with the `stats_tags` in `envoy/`), and the per-request
//! access-log stamp. Host-agnostic, so the exact figures are testable without wasm.

use crate::response::ResponseSummary;
use crate::timing::StreamTiming;
use crate::vecmap::VecMap;

/// Prefix of every sluice metric name as the plugin defines it (Envoy stores it under `wasmcustom.`).
pub const METRIC_PREFIX: &str = "sluice";

/// Longest label value kept; longer values are cut (label values are names, not payloads).
pub const MAX_LABEL_LEN: usize = 64;

/// Makes a value safe inside a dot-separated Envoy stat name: anything outside `[A-Za-z0-9_-]`
/// becomes `_`, so a value can never inject another `.label.` segment. Empty becomes `unknown`.
pub fn sanitize_label(value: &str) -> String {
    let mut out = String::with_capacity(value.len().min(MAX_LABEL_LEN));
    for c in value.chars().take(MAX_LABEL_LEN) {
        if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
            out.push(c);
        } else {
            out.push('_');
        }
    }
    if out.is_empty() {
        out.push_str("unknown");
    }
    out
}

/// Keeps a label's cardinality bounded: values named in configuration keep their name; other values
/// keep theirs only while fewer than `max_dynamic` distinct ones have been seen (per VM), after which
/// they are reported as `other`.
#[derive(Debug, Clone)]
pub struct LabelBound {
    /// Sets as [`VecMap`]s of `()` (a few names each): one B-tree instantiation less in the
    /// playground's page.
    named: VecMap<String, ()>,
    max_dynamic: usize,
    dynamic: VecMap<String, ()>,
}

/// The label value for everything beyond the configured cardinality.
pub const OTHER: &str = "other";

impl LabelBound {
    pub fn new(named: impl IntoIterator<Item = String>, max_dynamic: usize) -> Self {
        let mut set = VecMap::new();
        for n in named {
            set.insert(sanitize_label(&n), ());
        }
        LabelBound { named: set, max_dynamic, dynamic: VecMap::new() }
    }

    /// The label to report for `raw`.
    pub fn label(&mut self, raw: &str) -> String {
        let clean = sanitize_label(raw);
        if self.named.contains_key(&clean) || self.dynamic.contains_key(&clean) {
            return clean;
        }
        if self.dynamic.len() < self.max_dynamic {
            self.dynamic.insert(clean.clone(), ());
            return clean;
        }
        OTHER.to_string()
    }
}

/// The labels every per-request sluice metric carries, already sanitized and bounded.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Labels {
    pub model_version: String,
    pub tenant: String,
    pub api: String,
    pub ctx: String,
    pub turn: String,
    pub stream: String,
}

impl Labels {
    /// `.model_version.v2.tenant.acme.api.chat_completions.ctx.1k.turn.first.stream.true`
    pub fn suffix(&self) -> String {
        crate::text::join(&[
            ".model_version.",
            &self.model_version,
            ".tenant.",
            &self.tenant,
            ".api.",
            &self.api,
            ".ctx.",
            &self.ctx,
            ".turn.",
            &self.turn,
            ".stream.",
            &self.stream,
        ])
    }
}

/// How a request ended, as far as the proxy can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Outcome {
    /// The response reached its end.
    #[default]
    Completed,
    /// The client went away before the response ended.
    ClientDisconnect,
    /// The upstream failed: 5xx, reset, or an error event inside a 200 stream.
    UpstreamError,
    /// A sluice plugin refused the request itself (budget 429/4xx, shedding 503).
    Refused,
    /// latency-guard ended it at a deadline (504, or an error event in a started stream).
    Deadline,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::ClientDisconnect => "client_disconnect",
            Outcome::UpstreamError => "upstream_error",
            Outcome::Refused => "refused",
            Outcome::Deadline => "deadline",
        }
    }
}

impl From<crate::contract::GatewayEnd> for Outcome {
    fn from(end: crate::contract::GatewayEnd) -> Self {
        match end {
            crate::contract::GatewayEnd::Refused => Outcome::Refused,
            crate::contract::GatewayEnd::Deadline => Outcome::Deadline,
        }
    }
}

impl Outcome {
    /// How a stream that a filter did not see end ended, from Envoy's `response.code_details` and
    /// `response.flags` (`None` when the host gives none): the upstream failed (reset, timeout,
    /// connection failure), or the client went away. One exception: an upstream answer
    /// (`via_upstream`) with none of Envoy's response flags set went through Envoy whole — the
    /// filter missed its end, not the client (Envoy 1.40 drops trailers that a filter nearer the
    /// upstream adds, e.g. its decompressor, for the filters between it and one still holding the
    /// response; found by e2e/tests/faults_envoy.rs).
    pub fn of_unended(code_details: &str, response_flags: Option<u64>) -> Outcome {
        if code_details.contains("upstream") && !code_details.contains("via_upstream") {
            Outcome::UpstreamError
        } else if code_details == "via_upstream" && response_flags == Some(0) {
            Outcome::Completed
        } else {
            Outcome::ClientDisconnect
        }
    }

    /// The one classification every plugin reports a request with. `seen` is what the filter saw:
    /// `Completed` when the response reached its end, else [`Outcome::of_unended`]. A reply a sluice
    /// plugin generated (a refusal, a deadline) is that outcome whatever else happened; a 5xx, or an
    /// error event inside a non-error answer, is the upstream's failure; a 4xx with an error body is
    /// the client's mistake, answered properly.
    pub fn classify(gateway: Option<crate::contract::GatewayReply>, seen: Outcome, upstream_status: u16, upstream_error_event: bool) -> Outcome {
        match (gateway, seen) {
            (Some(g), _) => g.end.into(),
            (None, Outcome::Completed) if upstream_status >= 500 || (upstream_status < 400 && upstream_error_event) => Outcome::UpstreamError,
            (None, other) => other,
        }
    }
}

/// Finish reasons the public APIs document (OpenAI chat and completions, the Responses API's
/// incomplete reasons and statuses, Anthropic's stop reasons). Anything else an upstream sends is
/// labelled `other`: the label must stay bounded whatever the upstream says.
pub const KNOWN_FINISH_REASONS: &[&str] = &[
    "stop",
    "length",
    "tool_calls",
    "content_filter",
    "function_call",
    "end_turn",
    "max_tokens",
    "stop_sequence",
    "tool_use",
    "pause_turn",
    "refusal",
    "model_context_window_exceeded",
    "completed",
    "incomplete",
    "failed",
    "cancelled",
    "max_output_tokens",
];

/// Finish reasons that mean the answer hit its token limit (OpenAI, Anthropic, Responses).
pub const TRUNCATED_FINISH: &[&str] = &["length", "max_tokens", "max_output_tokens"];

/// The `finish` label of a finish reason: a documented reason, `none`, or `other`.
pub fn finish_label(reason: Option<&str>) -> &'static str {
    match reason {
        None => "none",
        Some(r) => KNOWN_FINISH_REASONS.iter().find(|k| **k == r).copied().unwrap_or(OTHER),
    }
}

/// Everything known about one LLM request when it ends.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RequestRecord {
    pub labels: Labels,
    /// The `model` the client asked for.
    pub request_model: Option<String>,
    /// HTTP status sent to the client; 0 when no response headers were seen.
    pub status: u16,
    pub streaming: bool,
    pub timing: StreamTiming,
    pub end_ns: u64,
    pub response: ResponseSummary,
    pub cost_micro_usd: Option<u64>,
    pub outcome: Outcome,
    /// Prompt size estimated from the request body, used when no usage was reported.
    pub prompt_tokens_estimate: u64,
}

/// Metric kinds, as the proxy-wasm ABI knows them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// One value to add to a counter or record in a histogram.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    pub kind: MetricKind,
    pub name: String,
    pub value: u64,
}

const NS_PER_MS: u64 = 1_000_000;
const NS_PER_US: u64 = 1_000;

impl RequestRecord {
    /// Output tokens: reported usage when present, otherwise the per-chunk estimate.
    pub fn output_tokens(&self) -> u64 {
        if self.response.usage_reported {
            self.response.usage.output_tokens
        } else {
            self.response.estimated_output_tokens
        }
    }

    /// Input tokens: reported usage when present (or an input count the stream reported before it
    /// was cut); otherwise the request-body estimate, except for
    /// an answer of status 400 or more (an upstream error or a refusal: the model did not run the
    /// prompt, so no tokens are counted — the request is counted as an error instead).
    pub fn input_tokens(&self) -> u64 {
        if self.response.usage_reported {
            self.response.usage.input_tokens
        } else if self.status >= 400 {
            0
        } else if self.response.usage.input_tokens > 0 {
            // Reported before the end without the rest (Anthropic's message_start, then a cut or an
            // error event): the upstream's figure, as tenant-budget charges it.
            self.response.usage.input_tokens
        } else {
            self.prompt_tokens_estimate
        }
    }

    pub fn ttft_ns(&self) -> Option<u64> {
        if self.streaming {
            self.timing.ttft_ns()
        } else {
            None
        }
    }

    pub fn tpot_ns(&self) -> Option<u64> {
        self.timing.tpot_ns(self.output_tokens())
    }

    pub fn decode_tokens_per_s(&self) -> Option<u64> {
        self.timing.decode_tokens_per_s(self.output_tokens())
    }

    pub fn duration_ns(&self) -> u64 {
        self.timing.duration_ns(self.end_ns)
    }

    /// Every metric sample this request contributes. Timing histograms only get a sample when the
    /// figure is defined (no TTFT without a content token, no TPOT with fewer than two tokens).
    pub fn samples(&self) -> Vec<Sample> {
        use crate::metrics;
        let series = metrics::RequestSeries::new(&self.labels);
        let mut out = Vec::with_capacity(16);
        let mut push = |kind: MetricKind, name: String, value: u64| out.push(Sample { kind, name, value });
        let requests = metrics::requests_total(&series, self.status, self.response.finish_reason.as_deref(), self.response.usage_reported);
        push(MetricKind::Counter, requests, 1);
        if let Some(ttft) = self.ttft_ns() {
            push(MetricKind::Histogram, metrics::ttft_ms(&series), ttft / NS_PER_MS);
        }
        if let Some(tpot) = self.tpot_ns() {
            push(MetricKind::Histogram, metrics::tpot_us(&series), tpot / NS_PER_US);
        }
        if let Some(tps) = self.decode_tokens_per_s() {
            push(MetricKind::Histogram, metrics::decode_tokens_per_s(&series), tps);
        }
        push(MetricKind::Histogram, metrics::request_duration_ms(&series), self.duration_ns() / NS_PER_MS);

        let (input, output) = (self.input_tokens(), self.output_tokens());
        push(MetricKind::Histogram, metrics::input_tokens(&series), input);
        push(MetricKind::Histogram, metrics::output_tokens(&series), output);
        push(MetricKind::Counter, metrics::input_tokens_total(&series), input);
        push(MetricKind::Counter, metrics::output_tokens_total(&series), output);
        let usage_figures = &self.response.usage;
        push(MetricKind::Counter, metrics::cached_input_tokens_total(&series), usage_figures.cached_input_tokens);
        push(MetricKind::Counter, metrics::reasoning_tokens_total(&series), usage_figures.reasoning_tokens);
        if let Some(cost) = self.cost_micro_usd {
            push(MetricKind::Counter, metrics::cost_micro_usd_total(&series), cost);
        }
        match self.outcome {
            Outcome::Completed => {}
            Outcome::ClientDisconnect => push(MetricKind::Counter, metrics::client_disconnects_total(&series), 1),
            Outcome::UpstreamError => push(MetricKind::Counter, metrics::upstream_errors_total(&series), 1),
            Outcome::Refused => push(MetricKind::Counter, metrics::gateway_replies_total(&series, crate::contract::GatewayEnd::Refused), 1),
            Outcome::Deadline => push(MetricKind::Counter, metrics::gateway_replies_total(&series, crate::contract::GatewayEnd::Deadline), 1),
        }
        if self.judges_quality() {
            let version = &self.labels.model_version;
            let finish = finish_label(self.response.finish_reason.as_deref());
            push(MetricKind::Histogram, metrics::quality_output_tokens(version, finish), output);
            if let Some(r) = self.response.repetition {
                push(MetricKind::Histogram, metrics::quality_repetition_per_mille(version), r.per_mille);
            }
            if self.response.content_chunks == 0 {
                push(MetricKind::Counter, metrics::quality_degenerate_answers_total(version, metrics::Degenerate::Empty), 1);
            }
            if TRUNCATED_FINISH.contains(&finish) {
                push(MetricKind::Counter, metrics::quality_degenerate_answers_total(version, metrics::Degenerate::Truncated), 1);
            }
        }
        out
    }

    /// Whether the answer is the model's whole answer, so that what it wrote can be judged: a 2xx
    /// that completed. Refusals, deadlines, upstream errors and streams the client left are not.
    pub fn judges_quality(&self) -> bool {
        (200..300).contains(&self.status) && self.outcome == Outcome::Completed
    }

    /// The access-log stamp: one JSON object, stable field names (see docs/access-log.md).
    /// Absent figures are `null`, never a made-up zero.
    pub fn stamp_json(&self) -> String {
        // Written piece by piece: `write!` per field costs several times as much in wasm.
        let mut s = String::with_capacity(512);
        let l = &self.labels;
        let text = |s: &mut String, name: &str, value: &str| {
            s.push_str(name);
            s.push_str(value);
        };
        text(&mut s, "{\"api\":\"", &l.api);
        text(&mut s, "\",\"model_version\":\"", &l.model_version);
        text(&mut s, "\",\"tenant\":\"", &l.tenant);
        text(&mut s, "\",\"ctx\":\"", &l.ctx);
        text(&mut s, "\",\"turn\":\"", &l.turn);
        s.push_str(if self.streaming { "\",\"stream\":true," } else { "\",\"stream\":false," });
        json_opt_str(&mut s, "\"model\":", self.request_model.as_deref());
        json_opt_str(&mut s, ",\"response_model\":", self.response.response_model.as_deref());
        json_u64(&mut s, ",\"status\":", u64::from(self.status));
        text(&mut s, ",\"outcome\":\"", self.outcome.as_str());
        s.push('"');
        json_opt_u64(&mut s, ",\"ttft_us\":", self.ttft_ns().map(|v| v / NS_PER_US));
        json_opt_u64(&mut s, ",\"tpot_us\":", self.tpot_ns().map(|v| v / NS_PER_US));
        json_opt_u64(&mut s, ",\"decode_tokens_per_s\":", self.decode_tokens_per_s());
        json_u64(&mut s, ",\"duration_us\":", self.duration_ns() / NS_PER_US);
        let u = &self.response.usage;
        json_u64(&mut s, ",\"input_tokens\":", self.input_tokens());
        json_u64(&mut s, ",\"output_tokens\":", self.output_tokens());
        json_u64(&mut s, ",\"cached_input_tokens\":", u.cached_input_tokens);
        json_u64(&mut s, ",\"cache_creation_input_tokens\":", u.cache_creation_input_tokens);
        json_u64(&mut s, ",\"reasoning_tokens\":", u.reasoning_tokens);
        s.push_str(if self.response.usage_reported { ",\"usage\":\"reported\"" } else { ",\"usage\":\"estimated\"" });
        json_u64(&mut s, ",\"content_chunks\":", self.response.content_chunks);
        json_opt_u64(&mut s, ",\"cost_micro_usd\":", self.cost_micro_usd);
        json_opt_str(&mut s, ",\"finish_reason\":", self.response.finish_reason.as_deref());
        json_opt_str(&mut s, ",\"upstream_error\":", self.response.upstream_error.as_deref());
        json_opt_u64(&mut s, ",\"repetition_per_mille\":", self.response.repetition.map(|r| r.per_mille));
        s.push('}');
        s
    }
}

fn json_u64(s: &mut String, name: &str, v: u64) {
    s.push_str(name);
    crate::text::push_u64(s, v);
}

/// Absent figures are `null`.
fn json_opt_u64(s: &mut String, name: &str, v: Option<u64>) {
    match v {
        Some(v) => json_u64(s, name, v),
        None => {
            s.push_str(name);
            s.push_str("null");
        }
    }
}

fn json_opt_str(s: &mut String, name: &str, v: Option<&str>) {
    s.push_str(name);
    match v {
        // Escaped as serde_json escapes: quotes, backslashes, control characters.
        Some(v) => crate::text::push_json_string(s, v),
        None => s.push_str("null"),
    }
}

#[cfg(test)]
mod outcome_tests {
    use super::Outcome;
    use crate::contract::{GatewayEnd, GatewayReply};

    #[test]
    fn an_unended_stream_is_named_by_envoys_details_and_flags() {
        let cases = [
            ("upstream_reset_after_response_started{remote_reset}", Some(0x10), Outcome::UpstreamError),
            ("upstream_response_timeout", Some(0), Outcome::UpstreamError),
            ("downstream_remote_disconnect", Some(0x1000), Outcome::ClientDisconnect),
            ("via_upstream", Some(0), Outcome::Completed),
            // A flag set (DC: the client left) or none given: not known to have gone through whole.
            ("via_upstream", Some(0x1000), Outcome::ClientDisconnect),
            ("via_upstream", None, Outcome::ClientDisconnect),
            ("", None, Outcome::ClientDisconnect),
        ];
        for (details, flags, want) in cases {
            assert_eq!(Outcome::of_unended(details, flags), want, "{details} {flags:?}");
        }
    }

    #[test]
    fn one_classification_for_every_plugin() {
        let deadline = Some(GatewayReply { status: 504, end: GatewayEnd::Deadline });
        let refused = Some(GatewayReply { status: 429, end: GatewayEnd::Refused });
        let cases = [
            // The gateway's own reply wins over whatever the upstream did.
            (deadline, Outcome::ClientDisconnect, 200, false, Outcome::Deadline),
            (refused, Outcome::Completed, 0, false, Outcome::Refused),
            (None, Outcome::Completed, 200, false, Outcome::Completed),
            // An error event inside a 200 stream is the upstream's failure.
            (None, Outcome::Completed, 200, true, Outcome::UpstreamError),
            (None, Outcome::Completed, 503, false, Outcome::UpstreamError),
            // A 4xx with an error body: the client's mistake, answered properly.
            (None, Outcome::Completed, 400, true, Outcome::Completed),
            // What the filter saw of an unended stream stays, whatever the status.
            (None, Outcome::ClientDisconnect, 500, false, Outcome::ClientDisconnect),
            (None, Outcome::UpstreamError, 200, false, Outcome::UpstreamError),
        ];
        for (gateway, seen, status, error_event, want) in cases {
            assert_eq!(Outcome::classify(gateway, seen, status, error_event), want, "{gateway:?} {seen:?} {status} {error_event}");
        }
    }
}
