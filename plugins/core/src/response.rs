//! What an LLM response says about itself: when content starts (TTFT), how much was generated, the
//! reported usage, finish reason, model and upstream errors — for SSE streams fed chunk by chunk
//! ([`StreamObserver`]) and for complete JSON bodies ([`inspect_response_body`]).
//!
//! Memory per request is bounded: the SSE framer's capped carry buffer plus counters and a few short
//! strings (truncated to [`MAX_STRING_BYTES`]). Generated text is counted, never stored.
//!
//! An event is *content* when it carries model output: OpenAI chat `delta.content`, `delta.tool_calls`,
//! `delta.reasoning_content` / `delta.reasoning`, `delta.refusal` (non-empty); completions
//! `choices[].text`; Responses `response.*.delta` events of output text, reasoning, refusal and
//! tool-call arguments; Anthropic `content_block_delta` with `text_delta`, `input_json_delta` or
//! `thinking_delta`. Role-only chunks, usage chunks, `[DONE]`, pings and comments are not content.

use crate::api::ApiKind;
use crate::json::{chars, error_message, json_chars, nonempty_str_at, str_at, truncate_utf8};
use crate::sse::{SseEvent, SseFramer, DEFAULT_MAX_EVENT_BYTES};
use crate::usage::{AnthropicUsage, Usage};
use serde_json::Value;

/// Longest model name, finish reason or error message kept (bytes, cut at a character boundary).
pub const MAX_STRING_BYTES: usize = 256;

/// Everything learnt from one response.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ResponseSummary {
    /// Reported usage if the upstream sent it; otherwise `output_tokens` is the estimate
    /// ([`Self::estimated_output_tokens`]) and the input side holds whatever was reported (Anthropic's
    /// `message_start`), else 0.
    pub usage: Usage,
    /// `true` when the output token count was reported by the upstream; `false` means it is the
    /// estimate (flag it "estimated").
    pub usage_reported: bool,
    /// OpenAI `finish_reason` (last non-null), Responses `incomplete_details.reason` or `status`,
    /// Anthropic `stop_reason`.
    pub finish_reason: Option<String>,
    /// Model named by the response (may differ from the requested alias).
    pub response_model: Option<String>,
    /// Events that carried content.
    pub content_chunks: u64,
    /// Output tokens estimated from content, always computed: per content event
    /// max(1, ⌊chars / 4⌋) — see [`estimated_tokens_in_event`].
    pub estimated_output_tokens: u64,
    /// Message (or type/code) of an upstream error: an `error` object in a chunk, Anthropic
    /// `event: error`, Responses `error` / `response.failed`, or a JSON error body. The first one wins.
    pub upstream_error: Option<String>,
    /// Events whose data was not valid JSON (other than `[DONE]`).
    pub malformed_events: u64,
    /// Events dropped for exceeding the per-event cap (or a JSON body over the cap).
    pub overflowed_events: u64,
    /// The terminal event was seen: `[DONE]`, `message_stop`, `response.completed` / `.failed` /
    /// `.incomplete`, or a complete non-error JSON body.
    pub done: bool,
}

/// What one [`StreamObserver::push`] (or `finish`) saw in its chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ChunkOutcome {
    /// Content events completed in this chunk; > 0 on the first such chunk marks the first token.
    pub content_events: u32,
    /// Estimated tokens of those events.
    pub estimated_tokens: u32,
    /// A usage report arrived in this chunk.
    pub usage_seen: bool,
    /// The terminal event arrived in this chunk (see [`ResponseSummary::done`] for "so far").
    pub done: bool,
}

/// Per-request observer of a response body, fed chunk by chunk.
///
/// A body whose first non-blank byte is `{` is not SSE (an error or a non-streamed answer to a
/// streamed request): it is collected up to the event cap and inspected as JSON at [`Self::finish`].
#[derive(Debug, Clone)]
pub struct StreamObserver {
    framer: SseFramer,
    state: State,
}

#[derive(Debug, Clone)]
enum Mode {
    /// Only whitespace seen so far.
    Undecided,
    Sse,
    /// Collected JSON body; `None` once it exceeded the cap.
    Json(Option<Vec<u8>>),
}

#[derive(Debug, Clone)]
struct State {
    kind: ApiKind,
    cap: usize,
    mode: Mode,
    summary: ResponseSummary,
    /// OpenAI / Responses usage, replaced by each report.
    openai_usage: Option<Usage>,
    /// Anthropic usage merged from `message_start` and `message_delta`.
    anthropic_usage: AnthropicUsage,
    anthropic_output_reported: bool,
    json_overflowed: u64,
}

impl StreamObserver {
    /// Observer with the default per-event cap ([`DEFAULT_MAX_EVENT_BYTES`]).
    pub fn new(kind: ApiKind) -> Self {
        Self::with_max_event_bytes(kind, DEFAULT_MAX_EVENT_BYTES)
    }

    /// Observer whose SSE framer carries at most `cap` bytes of one event.
    pub fn with_max_event_bytes(kind: ApiKind, cap: usize) -> Self {
        Self {
            framer: SseFramer::new(cap),
            state: State {
                kind,
                cap,
                mode: Mode::Undecided,
                summary: ResponseSummary::default(),
                openai_usage: None,
                anthropic_usage: AnthropicUsage::default(),
                anthropic_output_reported: false,
                json_overflowed: 0,
            },
        }
    }

    /// The API kind this observer parses.
    pub fn kind(&self) -> ApiKind {
        self.state.kind
    }

    /// Feed one response body chunk.
    pub fn push(&mut self, chunk: &[u8]) -> ChunkOutcome {
        let mut out = ChunkOutcome::default();
        let Self { framer, state } = self;
        let mut rest = chunk;
        if matches!(state.mode, Mode::Undecided) {
            match rest.iter().position(|b| !b.is_ascii_whitespace()) {
                // Leading blank lines are no-ops in SSE, so dropping them changes nothing.
                None => return out,
                Some(start) => {
                    rest = rest.get(start..).unwrap_or_default();
                    state.mode = if rest.first() == Some(&b'{') { Mode::Json(Some(Vec::new())) } else { Mode::Sse };
                }
            }
        }
        match &mut state.mode {
            Mode::Json(buf) => {
                if let Some(b) = buf {
                    if b.len().saturating_add(rest.len()) > state.cap {
                        *buf = None;
                        state.json_overflowed = state.json_overflowed.saturating_add(1);
                    } else {
                        let extra = crate::sse::bounded_growth(b.capacity(), b.len(), rest.len(), state.cap);
                        b.reserve_exact(extra);
                        b.extend_from_slice(rest);
                    }
                }
            }
            _ => framer.push(rest, &mut |ev| state.on_event(ev, &mut out)),
        }
        out
    }

    /// End of stream: dispatch a final event that lacked its blank line, or inspect a JSON body.
    pub fn finish(&mut self) -> ChunkOutcome {
        let mut out = ChunkOutcome::default();
        let Self { framer, state } = self;
        match &mut state.mode {
            Mode::Json(buf) => {
                if let Some(body) = buf.take() {
                    match serde_json::from_slice::<Value>(&body) {
                        Ok(v) if v.is_object() => state.on_body(&v, &mut out),
                        _ => state.summary.malformed_events += 1,
                    }
                }
            }
            _ => framer.finish(&mut |ev| state.on_event(ev, &mut out)),
        }
        out
    }

    /// Summary so far: reported usage if any, else the estimate in `usage.output_tokens`.
    pub fn summary(&self) -> ResponseSummary {
        let st = &self.state;
        let mut s = st.summary.clone();
        s.overflowed_events = self.framer.overflowed_events().saturating_add(st.json_overflowed);
        if let Some(u) = st.openai_usage {
            s.usage = u;
            s.usage_reported = true;
        } else {
            s.usage = st.anthropic_usage.normalised();
            s.usage_reported = st.anthropic_output_reported;
            if !s.usage_reported {
                s.usage.output_tokens = s.estimated_output_tokens;
            }
        }
        s
    }

    /// SSE comment lines (keep-alives) seen.
    pub fn comments_seen(&self) -> u64 {
        self.framer.comments_seen()
    }

    /// Bytes currently buffered (SSE carry or collected JSON body); bounded by the cap.
    pub fn buffered_bytes(&self) -> usize {
        match &self.state.mode {
            Mode::Json(Some(b)) => b.len(),
            _ => self.framer.buffered_bytes(),
        }
    }
}

/// Tokens estimated for one streamed content event of `chars` characters: max(1, ⌊chars / 4⌋).
/// Servers that stream token by token (OpenAI, vLLM, TGI, llama.cpp) send one token per event, and
/// a single token is rarely 8 characters or longer, so there the estimate is exact; events that
/// carry several tokens (Anthropic text deltas, batched streams) get the usual 4 characters a token.
pub fn estimated_tokens_in_event(chars: u64) -> u64 {
    (chars / 4).max(1)
}

/// Non-streaming response body (already complete). A body that is SSE (some servers stream even when
/// not asked) is run through a [`StreamObserver`]; anything else that is not a JSON object counts as
/// one malformed event.
pub fn inspect_response_body(kind: ApiKind, body: &[u8]) -> ResponseSummary {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') && first.is_some() {
        let mut obs = StreamObserver::new(kind);
        obs.push(body);
        obs.finish();
        let s = obs.summary();
        if s.content_chunks > 0 || s.done || s.upstream_error.is_some() || s.usage_reported {
            return s;
        }
    }
    let mut obs = StreamObserver::new(kind);
    let mut out = ChunkOutcome::default();
    match serde_json::from_slice::<Value>(body) {
        Ok(v) if v.is_object() => obs.state.on_body(&v, &mut out),
        _ => obs.state.summary.malformed_events = 1,
    }
    obs.summary()
}

/// Responses API event types whose `delta` is model output.
const RESPONSES_CONTENT_DELTAS: &[&str] = &[
    "response.output_text.delta",
    "response.reasoning_text.delta",
    "response.reasoning_summary_text.delta",
    "response.function_call_arguments.delta",
    "response.refusal.delta",
    "response.custom_tool_call_input.delta",
    "response.code_interpreter_call_code.delta",
    "response.mcp_call_arguments.delta",
];

/// Characters of a `content` value: a string or an array of text parts.
fn content_chars(v: &Value) -> u64 {
    match v {
        Value::String(s) => chars(s),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match p {
                Value::String(s) => chars(s),
                _ => ["text", "refusal"].iter().filter_map(|k| str_at(p, k)).map(chars).sum(),
            })
            .fold(0u64, u64::saturating_add),
        _ => 0,
    }
}

/// Characters of function names and arguments in an OpenAI `tool_calls` array (or one `function_call`).
fn tool_call_chars(calls: &Value) -> u64 {
    let one = |call: &Value| -> u64 {
        let f = call.get("function").unwrap_or(call);
        ["name", "arguments"].iter().filter_map(|k| str_at(f, k)).map(chars).fold(0u64, u64::saturating_add)
    };
    match calls {
        Value::Array(a) => a.iter().map(one).fold(0u64, u64::saturating_add),
        Value::Object(_) => one(calls),
        _ => 0,
    }
}

fn set_string(slot: &mut Option<String>, value: &str) {
    if slot.as_deref() != Some(value) {
        *slot = Some(truncate_utf8(value, MAX_STRING_BYTES));
    }
}

impl State {
    fn on_event(&mut self, ev: SseEvent, out: &mut ChunkOutcome) {
        let data = ev.data.trim();
        if data.is_empty() {
            return;
        }
        if data == "[DONE]" {
            self.mark_done(out);
            return;
        }
        // Typed, borrowing parse of the common event shapes first: no allocation per key, several
        // times faster than a `Value`. Anything unusual (errors, arrays as content, odd types) falls
        // through to the general `Value` path below, which handles every shape.
        let handled = match self.kind {
            ApiKind::ChatCompletions | ApiKind::Completions => self.openai_fast(data, out),
            ApiKind::AnthropicMessages => self.anthropic_fast(data, ev.event.as_deref(), out),
            ApiKind::Responses => false,
        };
        if handled {
            return;
        }
        self.value_path(data, ev.event.as_deref(), out);
    }

    /// The general path: every event shape, through a `Value`.
    fn value_path(&mut self, data: &str, event: Option<&str>, out: &mut ChunkOutcome) {
        let v = match serde_json::from_str::<Value>(data) {
            Ok(v) if v.is_object() => v,
            _ => {
                self.summary.malformed_events = self.summary.malformed_events.saturating_add(1);
                return;
            }
        };
        if let Some(msg) = error_message(&v) {
            self.set_error(msg);
            return;
        }
        let ty = str_at(&v, "type").or(event).unwrap_or("");
        match self.kind {
            ApiKind::ChatCompletions | ApiKind::Completions => self.openai_chunk(&v, out),
            ApiKind::Responses => self.responses_event(ty, &v, out),
            ApiKind::AnthropicMessages => self.anthropic_event(ty, &v, out),
        }
    }

    /// Fast path for an OpenAI chat / completions chunk; `false` if the general path must decide.
    fn openai_fast(&mut self, data: &str, out: &mut ChunkOutcome) -> bool {
        let Ok(fast::Obj(chunk)) = serde_json::from_str::<fast::Obj<fast::OpenAiChunk<'_>>>(data) else {
            return false;
        };
        if chunk.ty.is_some() || chunk.error.as_ref().is_some_and(|e| !e.is_null()) {
            return false;
        }
        if let Some(m) = chunk.model.as_deref().filter(|m| !m.is_empty()) {
            set_string(&mut self.summary.response_model, m);
        }
        let mut has_content = false;
        let mut n = 0u64;
        for fast::Obj(choice) in chunk.choices.iter().flatten() {
            if let Some(fast::Obj(d)) = &choice.delta {
                for text in [&d.content, &d.reasoning_content, &d.reasoning, &d.refusal] {
                    let c = text.as_deref().map_or(0, chars);
                    has_content |= c > 0;
                    n = n.saturating_add(c);
                }
                for calls in [&d.tool_calls, &d.function_call] {
                    let nonempty = match calls {
                        Some(Value::Array(a)) => !a.is_empty(),
                        Some(Value::Object(o)) => !o.is_empty(),
                        _ => false,
                    };
                    if let Some(calls) = calls.as_ref().filter(|_| nonempty) {
                        has_content = true;
                        n = n.saturating_add(tool_call_chars(calls));
                    }
                }
            }
            if let Some(t) = choice.text.as_deref().filter(|t| !t.is_empty()) {
                has_content = true;
                n = n.saturating_add(chars(t));
            }
            if let Some(r) = choice.finish_reason.as_deref().filter(|r| !r.is_empty()) {
                set_string(&mut self.summary.finish_reason, r);
            }
        }
        if has_content {
            self.content(n, out);
        }
        if let Some(u) = chunk.usage.as_ref().and_then(Usage::from_openai) {
            self.openai_usage = Some(u);
            out.usage_seen = true;
        }
        true
    }

    /// Fast path for the hot Anthropic events (`content_block_delta`, `ping`, `content_block_stop`,
    /// `message_stop`); everything else takes the general path.
    fn anthropic_fast(&mut self, data: &str, event: Option<&str>, out: &mut ChunkOutcome) -> bool {
        let Ok(fast::Obj(ev)) = serde_json::from_str::<fast::Obj<fast::AnthropicEvent<'_>>>(data) else {
            return false;
        };
        // An error member makes any event an error report (found by the stream_event fuzz target:
        // `event: content_block_delta` with `{"error":{…}}` was taken as an empty delta).
        if ev.error.is_some() {
            return false;
        }
        match ev.ty.as_deref().or(event) {
            Some("content_block_delta") => {
                let Some(fast::Obj(delta)) = ev.delta else { return true };
                let text = match delta.ty.as_deref() {
                    Some("text_delta") => delta.text,
                    Some("input_json_delta") => delta.partial_json,
                    Some("thinking_delta") => delta.thinking,
                    _ => return true,
                };
                if let Some(t) = text.as_deref().filter(|t| !t.is_empty()) {
                    self.content(chars(t), out);
                }
                true
            }
            Some("ping" | "content_block_stop") => true,
            Some("message_stop") => {
                self.mark_done(out);
                true
            }
            _ => false,
        }
    }

    fn mark_done(&mut self, out: &mut ChunkOutcome) {
        self.summary.done = true;
        out.done = true;
    }

    fn set_error(&mut self, msg: &str) {
        if self.summary.upstream_error.is_none() {
            self.summary.upstream_error = Some(truncate_utf8(msg, MAX_STRING_BYTES));
        }
    }

    fn set_model(&mut self, v: &Value) {
        if let Some(m) = nonempty_str_at(v, "model") {
            set_string(&mut self.summary.response_model, m);
        }
    }

    /// One content event of `chars` characters (0 for e.g. a tool-call header).
    fn content(&mut self, chars: u64, out: &mut ChunkOutcome) {
        let tokens = estimated_tokens_in_event(chars);
        let s = &mut self.summary;
        s.content_chunks = s.content_chunks.saturating_add(1);
        s.estimated_output_tokens = s.estimated_output_tokens.saturating_add(tokens);
        out.content_events = out.content_events.saturating_add(1);
        out.estimated_tokens = out.estimated_tokens.saturating_add(u32::try_from(tokens).unwrap_or(u32::MAX));
    }

    fn openai_usage(&mut self, v: &Value, out: &mut ChunkOutcome) {
        if let Some(u) = v.get("usage").and_then(Usage::from_openai) {
            self.openai_usage = Some(u);
            out.usage_seen = true;
        }
    }

    /// OpenAI chat or legacy completions chunk (both shapes accepted: the path may have lied).
    fn openai_chunk(&mut self, v: &Value, out: &mut ChunkOutcome) {
        self.set_model(v);
        let mut has_content = false;
        let mut n = 0u64;
        for choice in v.get("choices").and_then(Value::as_array).into_iter().flatten() {
            if let Some(delta) = choice.get("delta") {
                for key in ["content", "reasoning_content", "reasoning", "refusal"] {
                    let c = delta.get(key).map_or(0, content_chars);
                    has_content |= c > 0;
                    n = n.saturating_add(c);
                }
                for key in ["tool_calls", "function_call"] {
                    let calls = delta.get(key);
                    let nonempty = match calls {
                        Some(Value::Array(a)) => !a.is_empty(),
                        Some(Value::Object(o)) => !o.is_empty(),
                        _ => false,
                    };
                    if let Some(calls) = calls.filter(|_| nonempty) {
                        has_content = true;
                        n = n.saturating_add(tool_call_chars(calls));
                    }
                }
            }
            if let Some(t) = nonempty_str_at(choice, "text") {
                has_content = true;
                n = n.saturating_add(chars(t));
            }
            if let Some(r) = nonempty_str_at(choice, "finish_reason") {
                set_string(&mut self.summary.finish_reason, r);
            }
        }
        if has_content {
            self.content(n, out);
        }
        self.openai_usage(v, out);
    }

    fn responses_event(&mut self, ty: &str, v: &Value, out: &mut ChunkOutcome) {
        if RESPONSES_CONTENT_DELTAS.contains(&ty) {
            if let Some(d) = nonempty_str_at(v, "delta") {
                self.content(chars(d), out);
            }
            return;
        }
        match ty {
            "response.created" | "response.in_progress" | "response.queued" => {
                if let Some(r) = v.get("response") {
                    self.set_model(r);
                }
            }
            "response.completed" | "response.incomplete" | "response.failed" => {
                self.mark_done(out);
                if let Some(r) = v.get("response") {
                    self.response_object(r, out);
                }
                if ty == "response.failed" {
                    self.set_error("response.failed");
                }
            }
            _ => {}
        }
    }

    /// A Responses API `response` object: model, status, usage, error.
    fn response_object(&mut self, r: &Value, out: &mut ChunkOutcome) {
        self.set_model(r);
        let reason = r.get("incomplete_details").and_then(|d| nonempty_str_at(d, "reason")).or_else(|| nonempty_str_at(r, "status"));
        if let Some(reason) = reason {
            set_string(&mut self.summary.finish_reason, reason);
        }
        if let Some(msg) = error_message(r) {
            self.set_error(msg);
        }
        self.openai_usage(r, out);
    }

    fn anthropic_event(&mut self, ty: &str, v: &Value, out: &mut ChunkOutcome) {
        match ty {
            "message_start" => {
                if let Some(m) = v.get("message") {
                    self.set_model(m);
                    if let Some(u) = m.get("usage").and_then(AnthropicUsage::from_json) {
                        self.anthropic_usage.merge(u);
                    }
                }
            }
            "content_block_start" => {
                let text = v.get("content_block").and_then(|b| nonempty_str_at(b, "text"));
                if let Some(t) = text {
                    self.content(chars(t), out);
                }
            }
            "content_block_delta" => {
                let Some(delta) = v.get("delta") else { return };
                let key = match str_at(delta, "type") {
                    Some("text_delta") => "text",
                    Some("input_json_delta") => "partial_json",
                    Some("thinking_delta") => "thinking",
                    _ => return,
                };
                if let Some(t) = nonempty_str_at(delta, key) {
                    self.content(chars(t), out);
                }
            }
            "message_delta" => {
                if let Some(r) = v.get("delta").and_then(|d| nonempty_str_at(d, "stop_reason")) {
                    set_string(&mut self.summary.finish_reason, r);
                }
                if let Some(u) = v.get("usage").and_then(AnthropicUsage::from_json) {
                    self.anthropic_output_reported |= u.output.is_some();
                    self.anthropic_usage.merge(u);
                    out.usage_seen = true;
                }
            }
            "message_stop" => self.mark_done(out),
            _ => {}
        }
    }

    /// A complete (non-streamed) JSON response body.
    fn on_body(&mut self, v: &Value, out: &mut ChunkOutcome) {
        if let Some(msg) = error_message(v) {
            self.set_error(msg);
            // A failed Responses object still carries status and usage.
            if self.kind == ApiKind::Responses && str_at(v, "object") == Some("response") {
                self.response_object(v, out);
            }
            return;
        }
        let mut n = 0u64;
        let mut has_content = false;
        let mut add = |c: u64| {
            has_content |= c > 0;
            n = n.saturating_add(c);
        };
        match self.kind {
            ApiKind::ChatCompletions | ApiKind::Completions => {
                self.set_model(v);
                for choice in v.get("choices").and_then(Value::as_array).into_iter().flatten() {
                    if let Some(m) = choice.get("message") {
                        for key in ["content", "reasoning_content", "reasoning", "refusal"] {
                            add(m.get(key).map_or(0, content_chars));
                        }
                        for key in ["tool_calls", "function_call"] {
                            if let Some(calls) = m.get(key) {
                                let c = tool_call_chars(calls);
                                add(c);
                            }
                        }
                    }
                    if let Some(t) = str_at(choice, "text") {
                        add(chars(t));
                    }
                    if let Some(r) = nonempty_str_at(choice, "finish_reason") {
                        set_string(&mut self.summary.finish_reason, r);
                    }
                }
                self.openai_usage(v, out);
            }
            ApiKind::Responses => {
                for item in v.get("output").and_then(Value::as_array).into_iter().flatten() {
                    for key in ["content", "summary"] {
                        add(item.get(key).map_or(0, content_chars));
                    }
                    for key in ["name", "arguments", "input"] {
                        add(str_at(item, key).map_or(0, chars));
                    }
                }
                self.response_object(v, out);
            }
            ApiKind::AnthropicMessages => {
                self.set_model(v);
                for block in v.get("content").and_then(Value::as_array).into_iter().flatten() {
                    match str_at(block, "type") {
                        Some("text") => add(str_at(block, "text").map_or(0, chars)),
                        Some("thinking") => add(str_at(block, "thinking").map_or(0, chars)),
                        Some("tool_use") => {
                            add(str_at(block, "name").map_or(0, chars));
                            add(block.get("input").map_or(0, json_chars));
                        }
                        _ => {}
                    }
                }
                if let Some(r) = nonempty_str_at(v, "stop_reason") {
                    set_string(&mut self.summary.finish_reason, r);
                }
                if let Some(u) = v.get("usage").and_then(AnthropicUsage::from_json) {
                    self.anthropic_output_reported |= u.output.is_some();
                    self.anthropic_usage.merge(u);
                    out.usage_seen = true;
                }
            }
        }
        if has_content {
            // One body is one "event"; its estimate is plain ⌈chars / 4⌉.
            let tokens = n.div_ceil(4);
            let s = &mut self.summary;
            s.content_chunks = s.content_chunks.saturating_add(1);
            s.estimated_output_tokens = s.estimated_output_tokens.saturating_add(tokens);
            out.content_events = out.content_events.saturating_add(1);
            out.estimated_tokens = out.estimated_tokens.saturating_add(u32::try_from(tokens).unwrap_or(u32::MAX));
        }
        self.mark_done(out);
    }
}

/// Hooks for the fuzz targets (fuzz/): the fast paths against the general path.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;

/// Borrowing, typed shapes of the hottest stream events. Unknown fields are skipped without being
/// built; a field of an unexpected type fails the parse and sends the event to the `Value` path.
mod fast {
    use serde::de::value::MapAccessDeserializer;
    use serde::de::{Deserializer, MapAccess, Visitor};
    use serde::Deserialize;
    use serde_json::Value;
    use std::borrow::Cow;
    use std::marker::PhantomData;

    /// A struct read only from a JSON object. Derived structs also accept an array, field by field
    /// in declaration order (`["m",[…]]` would be a chunk of model `m`), which the general path
    /// rightly reads as no chunk at all (found by fuzz/fuzz_targets/stream_event.rs).
    pub(super) struct Obj<T>(pub T);

    impl<'de, T: Deserialize<'de>> Deserialize<'de> for Obj<T> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct ObjVisitor<T>(PhantomData<T>);
            impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjVisitor<T> {
                type Value = Obj<T>;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Obj<T>, A::Error> {
                    T::deserialize(MapAccessDeserializer::new(map)).map(Obj)
                }
            }
            d.deserialize_map(ObjVisitor(PhantomData))
        }
    }

    #[derive(Deserialize)]
    pub(super) struct OpenAiChunk<'a> {
        #[serde(default, borrow)]
        pub model: Option<Cow<'a, str>>,
        #[serde(default, borrow)]
        pub choices: Option<Vec<Obj<OpenAiChoice<'a>>>>,
        #[serde(default)]
        pub usage: Option<Value>,
        #[serde(default)]
        pub error: Option<Value>,
        #[serde(default, rename = "type")]
        pub ty: Option<Value>,
    }

    #[derive(Deserialize)]
    pub(super) struct OpenAiChoice<'a> {
        #[serde(default, borrow)]
        pub delta: Option<Obj<OpenAiDelta<'a>>>,
        #[serde(default, borrow)]
        pub text: Option<Cow<'a, str>>,
        #[serde(default, borrow)]
        pub finish_reason: Option<Cow<'a, str>>,
    }

    #[derive(Deserialize)]
    pub(super) struct OpenAiDelta<'a> {
        #[serde(default, borrow)]
        pub content: Option<Cow<'a, str>>,
        #[serde(default, borrow)]
        pub reasoning_content: Option<Cow<'a, str>>,
        #[serde(default, borrow)]
        pub reasoning: Option<Cow<'a, str>>,
        #[serde(default, borrow)]
        pub refusal: Option<Cow<'a, str>>,
        #[serde(default)]
        pub tool_calls: Option<Value>,
        #[serde(default)]
        pub function_call: Option<Value>,
    }

    #[derive(Deserialize)]
    pub(super) struct AnthropicEvent<'a> {
        #[serde(default, borrow, rename = "type")]
        pub ty: Option<Cow<'a, str>>,
        #[serde(default, borrow)]
        pub delta: Option<Obj<AnthropicDelta<'a>>>,
        #[serde(default)]
        pub error: Option<Value>,
    }

    #[derive(Deserialize)]
    pub(super) struct AnthropicDelta<'a> {
        #[serde(default, borrow, rename = "type")]
        pub ty: Option<Cow<'a, str>>,
        #[serde(default, borrow)]
        pub text: Option<Cow<'a, str>>,
        #[serde(default, borrow)]
        pub partial_json: Option<Cow<'a, str>>,
        #[serde(default, borrow)]
        pub thinking: Option<Cow<'a, str>>,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run one event's data through the fast path (if it takes it) and through the `Value` path;
    /// both must leave the same state and outcome.
    fn same_both_ways(kind: ApiKind, event: Option<&str>, data: &str) -> bool {
        let mut fast = StreamObserver::new(kind).state;
        let mut slow = fast.clone();
        let (mut out_f, mut out_s) = (ChunkOutcome::default(), ChunkOutcome::default());
        let taken = match kind {
            ApiKind::AnthropicMessages => fast.anthropic_fast(data, event, &mut out_f),
            _ => fast.openai_fast(data, &mut out_f),
        };
        let v: Value = serde_json::from_str(data).unwrap();
        let ty = str_at(&v, "type").or(event).unwrap_or("");
        match kind {
            ApiKind::AnthropicMessages => slow.anthropic_event(ty, &v, &mut out_s),
            _ => slow.openai_chunk(&v, &mut out_s),
        }
        if taken {
            assert_eq!(out_f, out_s, "{data}");
            assert_eq!(fast.summary, slow.summary, "{data}");
            assert_eq!(fast.openai_usage, slow.openai_usage, "{data}");
        }
        taken
    }

    #[test]
    fn fast_paths_agree_with_the_value_path() {
        let openai = [
            (
                r#"{"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"","refusal":null},"finish_reason":null}],"usage":null}"#,
                true,
            ),
            (r#"{"model":"m","choices":[{"delta":{"content":"héllo wörld"},"finish_reason":null}]}"#, true),
            (r#"{"model":"","choices":[{"delta":{"content":null,"reasoning_content":"why"}}]}"#, true),
            (r#"{"choices":[{"delta":{"reasoning":"r","refusal":"no"}},{"delta":{"content":"x"},"finish_reason":"stop"}]}"#, true),
            (r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"call_1","function":{"name":"f","arguments":""}}]}}]}"#, true),
            (r#"{"choices":[{"delta":{"tool_calls":[]}}]}"#, true),
            (r#"{"choices":[{"delta":{"function_call":{"name":"legacy"}}}]}"#, true),
            (r#"{"choices":[{"text":"abc","finish_reason":"length"}]}"#, true),
            (r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":1}}}"#, true),
            (r#"{"choices":null,"usage":{"prompt_tokens":3,"completion_tokens":4}}"#, true),
            (r#"{"error":null,"choices":[{"delta":{"content":"a"}}]}"#, true),
            (r#"{"choices":[{"delta":{"content":[{"type":"text","text":"parts"}]}}]}"#, false),
            (r#"{"model":5,"choices":[{"delta":{"content":"a"}}]}"#, false),
            (r#"{"type":"x","choices":[]}"#, false),
        ];
        for (data, fast) in openai {
            assert_eq!(same_both_ways(ApiKind::ChatCompletions, None, data), fast, "{data}");
        }
        let anthropic = [
            (r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi 😊"}}"#, true),
            (r#"{"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":""}}"#, true),
            (r#"{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"hmm"}}"#, true),
            (r#"{"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"abc"}}"#, true),
            (r#"{"type":"content_block_delta","index":0}"#, true),
            (r#"{"type": "ping"}"#, true),
            (r#"{"type":"content_block_stop","index":0}"#, true),
            (r#"{"type":"message_stop"}"#, true),
            (r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":3}}"#, false),
            (r#"{"type":"message_start","message":{"usage":{"input_tokens":1}}}"#, false),
        ];
        for (data, fast) in anthropic {
            assert_eq!(same_both_ways(ApiKind::AnthropicMessages, None, data), fast, "{data}");
        }
        assert!(same_both_ways(ApiKind::AnthropicMessages, Some("content_block_delta"), r#"{"delta":{"type":"text_delta","text":"no type field"}}"#));
    }
}
