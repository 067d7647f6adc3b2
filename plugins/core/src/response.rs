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
use crate::quality::{Repetition, RepetitionFigure};
use crate::scan::{RawStr, Scanner};
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
    /// How much of the visible answer repeats itself ([`crate::quality`]); `None` for an answer
    /// too short to say, and for tool calls and reasoning, which are not read for it.
    pub repetition: Option<RepetitionFigure>,
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
    /// The visible answer's text (content, completions text, output text, Anthropic text), as read.
    repetition: Repetition,
    /// Kept only when a policy asked for it ([`StreamObserver::keep_validated`]).
    validated: Option<ValidatedJson>,
    stencil: Stencil,
    /// The event just read by the stencil has only the trailing null `usage` ([`Stencil::sole_null_usage`]).
    read_sole_null_usage: bool,
    /// The event the fast path just read carries a `usage` that is not null (see
    /// [`ValidatedJson::record`]).
    read_usage_report: bool,
}

/// The last event the fast path read whole whose one string that counts is a single text member
/// (an OpenAI chunk's `delta.content`, an Anthropic `content_block_delta`'s text). Servers send a
/// stream's events as the same bytes around a new string (the same id, model and choice), so an
/// event that starts and ends with this one's bytes around the member is read by comparing them
/// and scanning the new string alone: the same reading as the whole parse (the JSON around a string
/// is valid whatever valid string sits there), several times cheaper. Any other event the fast or
/// general path reads replaces or drops it, so what its bytes set (the model) is still what was set
/// last. One event's data, at most [`Stencil::MAX_BYTES`] a stream.
#[derive(Debug, Clone, Default)]
struct Stencil {
    /// The event's data; empty when there is no stencil.
    text: Vec<u8>,
    /// The member's string: its first byte, and its closing quote.
    open: usize,
    close: usize,
    /// The member is the visible answer (read for repetition).
    visible: bool,
    /// The bytes around the member are one line whose one `usage` (no `\u` escape) is a trailing
    /// `,"usage":null}` after a value: an event read by this stencil is too, when its new string
    /// names neither ([`ValidatedJson::vouches_sole_null_usage`]). Found at the first read that
    /// asks (`None` until then): a stream whose events never repeat their bytes does not pay for it.
    sole_null_usage: Option<bool>,
    /// The fuzz targets compare the observer with and without it.
    #[cfg_attr(not(feature = "fuzzing"), allow(dead_code))]
    off: bool,
}

impl Stencil {
    /// Longer events are parsed whole each time (an OpenAI chunk is a few hundred bytes).
    const MAX_BYTES: usize = 2048;

    fn clear(&mut self) {
        self.text.clear();
    }

    /// Keeps `data` with `member`, a string scanned from it, as the stencil (or none, if it is too
    /// long or the string is not `data`'s).
    fn keep(&mut self, data: &str, member: RawStr<'_>, visible: bool) {
        self.text.clear();
        let bytes = data.as_bytes();
        let Some(open) = member.offset_in(bytes).filter(|&o| o > 0 && bytes.len() <= Self::MAX_BYTES && !self.off) else { return };
        self.text.extend_from_slice(bytes);
        self.open = open;
        self.close = open.saturating_add(member.raw().len());
        self.visible = visible;
        self.sole_null_usage = None;
    }

    fn sole_null_usage(&mut self) -> bool {
        match self.sole_null_usage {
            Some(known) => known,
            None => *self.sole_null_usage.insert(self.around_member_sole_null_usage()),
        }
    }

    fn around_member_sole_null_usage(&self) -> bool {
        use crate::rewrite::{first_usage_hint, trailing_null_usage};
        let (Some(head), Some(tail)) = (self.text.get(..self.open), self.text.get(self.close..)) else { return false };
        let one_line = !self.text.iter().any(|&b| b == b'\n' || b == b'\r');
        // The stripper's own test for the shape, on the tail: it starts with the member's closing
        // quote, so the member's end is never what comes before the trailing `usage`.
        one_line && first_usage_hint(head).is_none() && trailing_null_usage(tail, first_usage_hint(tail)).is_some()
    }

    /// The member's new string when `data` is the stencil's bytes around one valid JSON string.
    fn fill<'a>(&self, data: &'a str) -> Option<RawStr<'a>> {
        let head = self.text.get(..self.open).filter(|h| !h.is_empty())?;
        let tail = self.text.get(self.close..)?;
        let bytes = data.as_bytes();
        let tail_at = bytes.len().checked_sub(tail.len()).filter(|&t| t >= head.len())?;
        if !bytes.starts_with(head) || !bytes.ends_with(tail) {
            return None;
        }
        // From the opening quote: the string must end exactly at the tail's first byte, its quote.
        let mut sc = Scanner::at(data, self.open.checked_sub(1)?);
        let member = sc.string()?;
        (sc.position() == tail_at.saturating_add(1)).then_some(member)
    }
}

/// The event data the last [`StreamObserver::push`] found to be valid JSON, kept for a policy that
/// rewrites the same events (the usage stripper, [`crate::rewrite::UsageChunkStripper`]) so that it
/// need not validate them a second time. It knows texts, not positions: a text it holds is valid
/// JSON whoever framed it. Bounded, and emptied at every push: what does not fit is not known, and
/// the stripper then validates it itself.
#[derive(Debug, Clone, Default)]
pub struct ValidatedJson {
    bytes: Vec<u8>,
    /// Where each text ends in `bytes`.
    ends: Vec<usize>,
    /// The texts (where they start and end in `bytes`) known to have a single line whose one
    /// `usage` — and no `\u` escape — is the trailing `,"usage":null}` right after a value (what a
    /// stencil's read tells).
    sole_null_usage: Vec<(usize, usize)>,
    /// Where the next look-up starts in `sole_null_usage`: the stripper asks in the events' order.
    next_sole: std::cell::Cell<usize>,
}

impl ValidatedJson {
    /// Data bytes held for one push.
    pub const MAX_BYTES: usize = 16 * 1024;
    /// Events held for one push.
    pub const MAX_EVENTS: usize = 64;

    fn clear(&mut self) {
        self.bytes.clear();
        self.ends.clear();
        self.sole_null_usage.clear();
        self.next_sole.set(0);
    }

    /// Kept only in the shape the stripper cuts without reading the members: a chunk ending in
    /// `,"usage":null}` (OpenAI's with `include_usage`), or the report itself (`usage_report`: the
    /// event carries a `usage` that is not null, once an answer — the stripper validated it again,
    /// ≈ 4,000 instructions an answer). A stream without the member pays one comparison an event,
    /// not a copy.
    fn record(&mut self, data: &[u8], sole_null_usage: bool, usage_report: bool) {
        if !(usage_report || data.ends_with(crate::rewrite::TRAILING_NULL_USAGE))
            || self.ends.len() >= Self::MAX_EVENTS
            || self.bytes.len().saturating_add(data.len()) > Self::MAX_BYTES
        {
            return;
        }
        let extra = crate::sse::bounded_growth(self.bytes.capacity(), self.bytes.len(), data.len(), Self::MAX_BYTES);
        self.bytes.reserve_exact(extra);
        let start = self.bytes.len();
        self.bytes.extend_from_slice(data);
        self.ends.push(self.bytes.len());
        if sole_null_usage {
            self.sole_null_usage.push((start, self.bytes.len()));
        }
    }

    /// `text` is a held text known to have a single line whose one `usage` (and no `\u` escape) is
    /// the trailing `,"usage":null}` right after a value (see `sole_null_usage`): what the usage
    /// stripper may cut without reading the event ([`crate::rewrite::vouched_trailing_null_usage`]).
    pub fn vouches_sole_null_usage(&self, text: &[u8]) -> bool {
        let count = self.sole_null_usage.len();
        if count == 0 {
            return false;
        }
        let first = self.next_sole.get();
        let found = (0..count)
            .map(|k| first.saturating_add(k) % count)
            .find(|&i| self.sole_null_usage.get(i).and_then(|&(from, to)| self.bytes.get(from..to)) == Some(text));
        if let Some(i) = found {
            self.next_sole.set(i.saturating_add(1));
        }
        found.is_some()
    }

    /// `data`, JSON whitespace around it aside, is a text found to be valid JSON.
    pub fn contains(&self, data: &[u8]) -> bool {
        let start = data.iter().position(|&b| !crate::rewrite::is_ws(b)).unwrap_or(data.len());
        let end = data.iter().rposition(|&b| !crate::rewrite::is_ws(b)).map_or(start, |i| i.saturating_add(1));
        let data = data.get(start..end).unwrap_or_default();
        let mut from = 0usize;
        self.ends.iter().any(|&to| {
            let held = self.bytes.get(from..to);
            from = to;
            held == Some(data)
        })
    }

    /// Texts held.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }
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
                repetition: Repetition::default(),
                validated: None,
                stencil: Stencil::default(),
                read_sole_null_usage: false,
                read_usage_report: false,
            },
        }
    }

    /// From now on, keep the data of the events each push finds to be valid JSON
    /// ([`Self::validated`]).
    pub fn keep_validated(&mut self) {
        self.state.validated.get_or_insert_with(ValidatedJson::default);
    }

    /// The event data the last push found to be valid JSON, if asked to keep it.
    pub fn validated(&self) -> Option<&ValidatedJson> {
        self.state.validated.as_ref()
    }

    /// The API kind this observer parses.
    pub fn kind(&self) -> ApiKind {
        self.state.kind
    }

    /// Feed one response body chunk.
    pub fn push(&mut self, chunk: &[u8]) -> ChunkOutcome {
        let mut out = ChunkOutcome::default();
        let Self { framer, state } = self;
        if let Some(v) = &mut state.validated {
            v.clear();
        }
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
            _ => framer.push_borrowed(rest, &mut |ev| state.on_event(ev, &mut out)),
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
            _ => framer.finish_borrowed(&mut |ev| state.on_event(ev, &mut out)),
        }
        state.repetition.finish();
        out
    }

    /// Summary so far: reported usage if any, else the estimate in `usage.output_tokens`.
    pub fn summary(&self) -> ResponseSummary {
        let st = &self.state;
        let mut s = st.summary.clone();
        s.repetition = st.repetition.figure();
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
    obs.state.repetition.finish();
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

/// Feeds the visible text of a `content` value (a string, or an array of text parts: OpenAI's
/// `text`, the Responses API's `output_text`) to the repetition measure. Parts are separate words.
fn feed_content(repetition: &mut Repetition, v: &Value) {
    match v {
        Value::String(s) => repetition.push_text(s),
        Value::Array(parts) => {
            for p in parts {
                let text = match p {
                    Value::String(s) => Some(s.as_str()),
                    _ => str_at(p, "text"),
                };
                if let Some(t) = text {
                    repetition.push_text(t);
                    repetition.push_text(" ");
                }
            }
        }
        _ => {}
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
    fn on_event(&mut self, ev: &SseEvent, out: &mut ChunkOutcome) {
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
            // The OpenAI fast path read the whole text as JSON (the Anthropic one is not asked).
            let sole_null_usage = std::mem::take(&mut self.read_sole_null_usage);
            let usage_report = std::mem::take(&mut self.read_usage_report);
            if matches!(self.kind, ApiKind::ChatCompletions | ApiKind::Completions) {
                if let Some(v) = &mut self.validated {
                    v.record(data.as_bytes(), sole_null_usage, usage_report);
                }
            }
            return;
        }
        self.value_path(data, ev.event.as_deref(), out);
    }

    /// The general path: every event shape, through a `Value`.
    fn value_path(&mut self, data: &str, event: Option<&str>, out: &mut ChunkOutcome) {
        self.stencil.clear();
        // From the bytes, as core reads all its JSON: one serde_json reader type in each .wasm.
        let parsed = serde_json::from_slice::<Value>(data.as_bytes());
        if let (Ok(_), Some(v)) = (&parsed, &mut self.validated) {
            v.record(data.as_bytes(), false, false);
        }
        let v = match parsed {
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
        if let Some(member) = self.stencil.fill(data) {
            let visible = self.stencil.visible;
            // Asked only for a policy that takes the word (the budget's usage stripper). A string can
            // hold neither a raw line break nor a hint that runs into the bytes around it.
            self.read_sole_null_usage = self.validated.is_some() && self.stencil.sole_null_usage() && crate::rewrite::first_usage_hint(member.raw()).is_none();
            self.text_member(member, visible, out);
            return true;
        }
        let Some(chunk) = fast::openai_chunk(data) else {
            self.stencil.clear();
            return false;
        };
        match chunk.only_text {
            Some((member, visible)) if chunk.usage.is_none() && chunk.finish_reason.is_none() => self.stencil.keep(data, member, visible),
            _ => self.stencil.clear(),
        }
        if let Some(m) = chunk.model.filter(|m| !m.is_empty()) {
            set_string(&mut self.summary.response_model, &m.text());
        }
        if let Some(r) = chunk.finish_reason {
            set_string(&mut self.summary.finish_reason, &r.text());
        }
        if chunk.has_content {
            self.content(chunk.content_chars, out);
        }
        if let Some(text) = chunk.visible_text {
            text.feed(&mut self.repetition);
        }
        self.read_usage_report = chunk.usage.is_some();
        if let Some(u) = chunk.usage.and_then(|raw| serde_json::from_slice::<Value>(raw).ok()).as_ref().and_then(Usage::from_openai) {
            self.openai_usage = Some(u);
            out.usage_seen = true;
        }
        true
    }

    /// Fast path for the hot Anthropic events (`content_block_delta`, `ping`, `content_block_stop`,
    /// `message_stop`); everything else takes the general path.
    fn anthropic_fast(&mut self, data: &str, event: Option<&str>, out: &mut ChunkOutcome) -> bool {
        if let Some(member) = self.stencil.fill(data) {
            let visible = self.stencil.visible;
            self.text_member(member, visible, out);
            return true;
        }
        let Some(ev) = fast::anthropic_event(data) else {
            self.stencil.clear();
            return false;
        };
        let ty = ev.ty.map(|t| t.text());
        // A delta whose own `type` member says so: the stencil must not depend on the SSE event name.
        match ev.delta_text {
            Some(member) if ty.as_deref() == Some("content_block_delta") => self.stencil.keep(data, member, ev.delta_is_text),
            _ => self.stencil.clear(),
        }
        match ty.as_deref().or(event) {
            Some("content_block_delta") => {
                if let Some(t) = ev.delta_text.filter(|t| !t.is_empty()) {
                    self.content(t.chars(), out);
                    if ev.delta_is_text {
                        t.feed(&mut self.repetition);
                    }
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

    /// A stencil's member: what the fast paths do with an event's one text member.
    fn text_member(&mut self, member: RawStr<'_>, visible: bool, out: &mut ChunkOutcome) {
        let chars = member.chars();
        if chars > 0 {
            self.content(chars, out);
            if visible {
                member.feed(&mut self.repetition);
            }
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
                if let Some(content) = delta.get("content") {
                    feed_content(&mut self.repetition, content);
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
                self.repetition.push_text(t);
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
                if ty == "response.output_text.delta" {
                    self.repetition.push_text(d);
                }
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
                    self.repetition.push_text(t);
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
                    if key == "text" {
                        self.repetition.push_text(t);
                    }
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
                        if let Some(content) = m.get("content") {
                            feed_content(&mut self.repetition, content);
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
                        self.repetition.push_text(t);
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
                    if str_at(item, "type") == Some("message") {
                        if let Some(content) = item.get("content") {
                            feed_content(&mut self.repetition, content);
                        }
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
                        Some("text") => {
                            let text = str_at(block, "text").unwrap_or_default();
                            add(chars(text));
                            self.repetition.push_text(text);
                            self.repetition.push_text(" ");
                        }
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

/// The hot event shapes read by [`crate::scan`]: one pass over the event's bytes, nothing
/// allocated for the members that are skipped. `None` means "not sure": the general path decides.
mod fast {
    use crate::scan::{first_time, RawStr, Scanner};
    use serde_json::Value;

    /// What an OpenAI chat / completions chunk says, as the general path would read it.
    pub(super) struct OpenAiChunk<'a> {
        pub model: Option<RawStr<'a>>,
        /// The last non-empty `finish_reason` of the chunk's choices.
        pub finish_reason: Option<RawStr<'a>>,
        pub has_content: bool,
        pub content_chars: u64,
        /// The first choice's visible text: `delta.content` or `text` (not reasoning, refusal or tool calls).
        pub visible_text: Option<RawStr<'a>>,
        /// The raw `usage` value, when not null.
        pub usage: Option<&'a [u8]>,
        /// The chunk's text member (content, reasoning, refusal, completions text) and whether it is
        /// the visible one, when it has exactly one string-valued text member and no tool calls.
        pub only_text: Option<(RawStr<'a>, bool)>,
        text_members: u32,
        tool_calls: bool,
    }

    impl<'a> OpenAiChunk<'a> {
        fn text_member(&mut self, member: RawStr<'a>, visible: bool) {
            self.text_members = self.text_members.saturating_add(1);
            self.only_text = (self.text_members == 1 && !self.tool_calls).then_some((member, visible));
        }
    }

    pub(super) fn openai_chunk(data: &str) -> Option<OpenAiChunk<'_>> {
        let mut chunk = OpenAiChunk {
            model: None,
            finish_reason: None,
            has_content: false,
            content_chars: 0,
            visible_text: None,
            usage: None,
            only_text: None,
            text_members: 0,
            tool_calls: false,
        };
        let mut sc = Scanner::new(data);
        let mut seen = 0u32;
        sc.object(|sc, key| {
            if key.is("model") {
                first_time(&mut seen, 1)?;
                chunk.model = sc.opt_string().ok()?;
            } else if key.is("choices") {
                first_time(&mut seen, 2)?;
                if !sc.null() {
                    sc.array(|sc| choice(sc, &mut chunk))?;
                }
            } else if key.is("usage") {
                first_time(&mut seen, 4)?;
                if !sc.null() {
                    chunk.usage = Some(sc.value()?);
                }
            } else if key.is("error") || key.is("type") {
                // A non-null error or a typed event is the general path's (errors, Responses shapes).
                first_time(&mut seen, if key.is("error") { 8 } else { 16 })?;
                if !sc.null() {
                    return None;
                }
            } else {
                sc.value()?;
            }
            Some(())
        })?;
        sc.at_end().then_some(chunk)
    }

    fn choice<'a>(sc: &mut Scanner<'a>, chunk: &mut OpenAiChunk<'a>) -> Option<()> {
        let mut seen = 0u32;
        sc.object(|sc, key| {
            if key.is("delta") {
                first_time(&mut seen, 1)?;
                if !sc.null() {
                    delta(sc, chunk)?;
                }
            } else if key.is("text") {
                first_time(&mut seen, 2)?;
                if let Some(t) = sc.opt_string().ok()? {
                    chunk.text_member(t, true);
                    if !t.is_empty() {
                        chunk.has_content = true;
                        chunk.content_chars = chunk.content_chars.saturating_add(t.chars());
                        chunk.visible_text.get_or_insert(t);
                    }
                }
            } else if key.is("finish_reason") {
                first_time(&mut seen, 4)?;
                if let Some(r) = sc.opt_string().ok()?.filter(|r| !r.is_empty()) {
                    chunk.finish_reason = Some(r);
                }
            } else {
                sc.value()?;
            }
            Some(())
        })
    }

    fn delta<'a>(sc: &mut Scanner<'a>, chunk: &mut OpenAiChunk<'a>) -> Option<()> {
        let mut seen = 0u32;
        sc.object(|sc, key| {
            let text_bit = ["content", "reasoning_content", "reasoning", "refusal"].iter().position(|k| key.is(k));
            if let Some(bit) = text_bit {
                first_time(&mut seen, 1 << bit)?;
                if let Some(t) = sc.opt_string().ok()? {
                    chunk.text_member(t, bit == 0);
                    let c = t.chars();
                    chunk.has_content |= c > 0;
                    chunk.content_chars = chunk.content_chars.saturating_add(c);
                    if bit == 0 && c > 0 {
                        chunk.visible_text.get_or_insert(t);
                    }
                }
            } else if key.is("tool_calls") || key.is("function_call") {
                first_time(&mut seen, if key.is("tool_calls") { 16 } else { 32 })?;
                chunk.tool_calls = true;
                chunk.only_text = None;
                let raw = sc.value()?;
                if matches!(raw.first(), Some(b'[' | b'{')) {
                    let calls: Value = serde_json::from_slice(raw).ok()?;
                    let nonempty = match &calls {
                        Value::Array(a) => !a.is_empty(),
                        Value::Object(o) => !o.is_empty(),
                        _ => false,
                    };
                    if nonempty {
                        chunk.has_content = true;
                        chunk.content_chars = chunk.content_chars.saturating_add(super::tool_call_chars(&calls));
                    }
                }
            } else {
                sc.value()?;
            }
            Some(())
        })
    }

    /// What an Anthropic event says: its `type` and the text of a known delta kind.
    pub(super) struct AnthropicEvent<'a> {
        pub ty: Option<RawStr<'a>>,
        /// `delta.text` / `.partial_json` / `.thinking` for a `text_delta` / `input_json_delta` /
        /// `thinking_delta`; `None` for any other delta.
        pub delta_text: Option<RawStr<'a>>,
        /// The delta is a `text_delta` (visible text, read for repetition).
        pub delta_is_text: bool,
    }

    pub(super) fn anthropic_event(data: &str) -> Option<AnthropicEvent<'_>> {
        let mut ev = AnthropicEvent { ty: None, delta_text: None, delta_is_text: false };
        let mut sc = Scanner::new(data);
        let mut seen = 0u32;
        sc.object(|sc, key| {
            if key.is("type") {
                first_time(&mut seen, 1)?;
                ev.ty = sc.opt_string().ok()?;
            } else if key.is("delta") {
                first_time(&mut seen, 2)?;
                if !sc.null() {
                    (ev.delta_text, ev.delta_is_text) = anthropic_delta(sc)?;
                }
            } else if key.is("error") {
                first_time(&mut seen, 4)?;
                // An error member makes any event an error report, the general path's (found by the
                // stream_event fuzz target: `content_block_delta` with `{"error":{…}}`).
                if !sc.null() {
                    return None;
                }
            } else {
                sc.value()?;
            }
            Some(())
        })?;
        sc.at_end().then_some(ev)
    }

    fn anthropic_delta<'a>(sc: &mut Scanner<'a>) -> Option<(Option<RawStr<'a>>, bool)> {
        let mut seen = 0u32;
        let mut ty = None;
        let mut texts: [Option<RawStr<'a>>; 3] = [None, None, None];
        const FIELDS: [&str; 3] = ["text", "partial_json", "thinking"];
        sc.object(|sc, key| {
            if key.is("type") {
                first_time(&mut seen, 8)?;
                ty = sc.opt_string().ok()?;
            } else if let Some(at) = FIELDS.iter().position(|k| key.is(k)) {
                first_time(&mut seen, 1 << at)?;
                let value = sc.opt_string().ok()?;
                if let Some(slot) = texts.get_mut(at) {
                    *slot = value;
                }
            } else {
                sc.value()?;
            }
            Some(())
        })?;
        let at = match ty.map(|t| t.text()).as_deref() {
            Some("text_delta") => 0,
            Some("input_json_delta") => 1,
            Some("thinking_delta") => 2,
            _ => return Some((None, false)),
        };
        Some((texts.get(at).copied().flatten(), at == 0))
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
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            // Not JSON: the fast path must leave it to the general one (which counts it malformed).
            assert!(!taken, "the fast path took text serde_json refuses: {data}");
            return taken;
        };
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
            (r#"{"type":null,"choices":[{"delta":{"content":"typed null"}}]}"#, true),
            (
                r#"{"choices":[{"delta":{"content":"line\nbreak \"quoted\" \u00e9\u4e2d"}}],"created":1.5e3,"system_fingerprint":null,"logprobs":[true,false]}"#,
                true,
            ),
            (r#"{"model":"a","model":"b","choices":[]}"#, false),
            (r#"{"choices":[{"delta":{"content":"a","content":"bb"}}]}"#, false),
            (r#"{"choices":[{"delta":{"con\u0074ent":"escaped key"}}]}"#, false),
            (r#"{"choices":[{"delta":{"content":"\ud83d\ude00"}}]}"#, false),
            (r#"{"choices":[{"delta":{"content":"x"}}],"n":01}"#, false),
            (r#"{"choices":[{"delta":{"content":"x"}}]} trailing"#, false),
            (r#"{"choices":[{"delta":{"content":"x"},"finish_reason":""}],"usage":{"prompt_tokens":1,"completion_tokens":2}}"#, true),
            (r#"{"choices":[{"delta":{"tool_calls":"not calls"}}]}"#, true),
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
            (r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"esc\u00e9\n"}}"#, true),
            (r#"{"type":"content_block_delta","delta":{"type":"text_delta","text":"a","text":"b"}}"#, false),
            (r#"{"type":"content_block_delta","delta":null}"#, true),
        ];
        for (data, fast) in anthropic {
            assert_eq!(same_both_ways(ApiKind::AnthropicMessages, None, data), fast, "{data}");
        }
        assert!(same_both_ways(ApiKind::AnthropicMessages, Some("content_block_delta"), r#"{"delta":{"type":"text_delta","text":"no type field"}}"#));
    }

    /// Runs `events` (each one event's data) as `data:` events through an observer that reads by
    /// stencil and one that parses every event whole, the body cut into chunks every `cut` bytes
    /// (0: a chunk per event). Returns both runs' outcomes and summaries, and how many events the
    /// stencil would have read as they came.
    fn stencil_both_ways(kind: ApiKind, events: &[String], cut: usize) -> (Vec<ChunkOutcome>, Vec<ChunkOutcome>, ResponseSummary, ResponseSummary, usize) {
        let body: Vec<Vec<u8>> = events.iter().map(|e| format!("data: {e}\n\n").into_bytes()).collect();
        let chunks: Vec<Vec<u8>> = if cut == 0 { body.clone() } else { body.concat().chunks(cut).map(<[u8]>::to_vec).collect() };
        let mut reads = 0;
        let mut runs = Vec::new();
        for stencil in [true, false] {
            let mut observer = StreamObserver::new(kind);
            observer.state.stencil.off = !stencil;
            let mut outcomes = Vec::new();
            for chunk in &chunks {
                if stencil && cut == 0 {
                    let data = std::str::from_utf8(chunk).unwrap_or_default().trim_start_matches("data: ").trim();
                    reads += usize::from(observer.state.stencil.fill(data).is_some());
                }
                outcomes.push(observer.push(chunk));
            }
            outcomes.push(observer.finish());
            runs.push((outcomes, observer.summary()));
        }
        let (without_outcomes, without) = runs.pop().unwrap_or_default();
        let (with_outcomes, with) = runs.pop().unwrap_or_default();
        (with_outcomes, without_outcomes, with, without, reads)
    }

    fn openai_delta(model: &str, content: &str) -> String {
        format!(
            r#"{{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"{model}","choices":[{{"index":0,"delta":{{"content":{content}}},"logprobs":null,"finish_reason":null}}],"usage":null}}"#
        )
    }

    #[test]
    fn the_stencil_reads_a_servers_stream_as_the_whole_parse_does() {
        let contents = [
            "\"Hello\"",
            "\" wörld\"",
            "\"\"",
            "\" \\\"quoted\\\" \"",
            "\"a\\\\b\"",
            "\"line\\n\"",
            "\"\\u00e9t\\u00e9\"",
            "\"\\ud83d\\ude00\"",
            "\"😀\"",
            "\"usage\"",
            "\"x\"",
        ];
        let mut events = vec![r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"usage":null}"#.to_string()];
        events.extend(contents.iter().map(|c| openai_delta("m", c)));
        // Another model mid-stream, then back: the model each event names is the one kept.
        events.push(openai_delta("other", "\"o\""));
        events.push(openai_delta("m", "\"back\""));
        events.push(r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}],"usage":null}"#.to_string());
        events.push(openai_delta("m", "\"after stop\""));
        events.push(r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":12,"total_tokens":17}}"#.to_string());
        events.push("[DONE]".to_string());
        for cut in [0, 1, 7, 64] {
            let (with_outcomes, without_outcomes, with, without, reads) = stencil_both_ways(ApiKind::ChatCompletions, &events, cut);
            assert_eq!(with_outcomes, without_outcomes, "cut {cut}");
            assert_eq!(with, without, "cut {cut}");
            if cut == 0 {
                // Every content event after the first (its bytes differ from the role event's)
                // but two: the surrogate pair's, which the fast path leaves to the general one, and
                // the next, the stencil dropped then; none after another model's or the finish.
                assert_eq!(reads, contents.len() - 1 - 2, "cut {cut}");
            }
        }
        let (_, _, with, _, _) = stencil_both_ways(ApiKind::ChatCompletions, &events, 0);
        assert_eq!(with.response_model.as_deref(), Some("m"));
        assert_eq!(with.finish_reason.as_deref(), Some("stop"));
        assert!(with.repetition.is_some() || with.content_chunks > 0);

        let anthropic: Vec<String> = ["\"Hi\"", "\" there\"", "\"\\\"q\\\"\"", "\"\""]
            .iter()
            .map(|t| format!(r#"{{"type":"content_block_delta","index":0,"delta":{{"type":"text_delta","text":{t}}}}}"#))
            .chain([
                r#"{"type": "ping"}"#.to_string(),
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"after ping"}}"#.to_string(),
            ])
            .collect();
        let (with_outcomes, without_outcomes, with, without, reads) = stencil_both_ways(ApiKind::AnthropicMessages, &anthropic, 0);
        assert_eq!(with_outcomes, without_outcomes);
        assert_eq!(with, without);
        assert_eq!(reads, 3);

        let completions: Vec<String> = ["\"a\"", "\"b c\"", "\"\""]
            .iter()
            .map(|t| format!(r#"{{"id":"cmpl-1","object":"text_completion","model":"m","choices":[{{"index":0,"text":{t},"finish_reason":null}}]}}"#))
            .collect();
        let (with_outcomes, without_outcomes, with, without, reads) = stencil_both_ways(ApiKind::Completions, &completions, 0);
        assert_eq!(with_outcomes, without_outcomes);
        assert_eq!(with, without);
        assert_eq!(reads, 2);
    }

    /// Pieces a stencil's string (or its surroundings) may hold: escapes of every kind, a lone
    /// surrogate, a raw control byte and a raw quote (both invalid in a string), multi-byte text,
    /// and words enough for the repetition figure (it needs ten trigrams).
    const PIECES: [&str; 17] =
        ["a ", "word ", "é ", "😀", "\\\"", "\\\\", "\\n", "\\u00e9", "\\ud83d\\ude00", "\\ud800", "\u{1}", "\"", "\\", "usage", "x ", "y ", "z "];

    fn text_from(picks: &[u8]) -> String {
        picks.iter().map(|&p| PIECES[usize::from(p) % PIECES.len()]).collect()
    }

    proptest::proptest! {
        #[test]
        fn the_stencil_never_changes_what_a_stream_is_read_as(
            kind in 0usize..3,
            shapes in proptest::collection::vec((0u8..13, proptest::collection::vec(0u8..17, 0..6)), 1..40),
            cut in 0usize..40,
        ) {
            let kind = [ApiKind::ChatCompletions, ApiKind::Completions, ApiKind::AnthropicMessages][kind];
            let events: Vec<String> = shapes
                .iter()
                .map(|(shape, picks)| {
                    let t = text_from(picks);
                    match shape {
                        0..=3 => openai_delta("m", &format!("\"{t}\"")),
                        4 => openai_delta("n", &format!("\"{t}\"")),
                        5 => format!(r#"{{"model":"m","choices":[{{"delta":{{"content":"{t}","reasoning_content":"r"}}}}]}}"#),
                        6 => format!(r#"{{"model":"m","choices":[{{"delta":{{"reasoning_content":"{t}"}},"finish_reason":null}}]}}"#),
                        7 => format!(r#"{{"model":"m","choices":[{{"delta":{{"content":"{t}","tool_calls":[{{"index":0,"function":{{"arguments":"x"}}}}]}}}}]}}"#),
                        8 => format!(r#"{{"model":"m","choices":[{{"index":0,"text":"{t}","finish_reason":null}}]}}"#),
                        9 => format!(r#"{{"type":"content_block_delta","index":0,"delta":{{"type":"text_delta","text":"{t}"}}}}"#),
                        10 => format!(r#"{{"type":"content_block_delta","index":0,"delta":{{"type":"thinking_delta","thinking":"{t}"}}}}"#),
                        11 => format!(r#"{{"model":"m","choices":[{{"delta":{{"content":"{t}"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":1,"completion_tokens":2}}}}"#),
                        // Content as parts: the general path's, which sets the model too.
                        _ => format!(r#"{{"model":"n","choices":[{{"delta":{{"content":[{{"type":"text","text":"{t}"}}]}}}}]}}"#),
                    }
                })
                .collect();
            let (with_outcomes, without_outcomes, with, without, _) = stencil_both_ways(kind, &events, cut);
            proptest::prop_assert_eq!(with_outcomes, without_outcomes);
            proptest::prop_assert_eq!(with, without);
        }
    }
}
