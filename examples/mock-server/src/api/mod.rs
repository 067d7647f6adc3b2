//! What the mock says, per API: turns a request body plus [`Controls`] into a [`Plan`] (model,
//! token counts, usage) and renders it as SSE events or as one JSON body, in the shape of the real
//! OpenAI chat completions, legacy completions, Responses and Anthropic Messages APIs.
//!
//! Token `i` (from 0) of every answer is the text `tok{i} ` so tests know the exact content.
//!
//! Prompt tokens are a deterministic count tests can recompute: every *text unit* of the request
//! costs `ceil(chars / 4) + 4` tokens, where `chars` counts Unicode scalar values. Text units are:
//! - chat completions: each element of `messages` (its `content`: a string, or the `text` of each part);
//! - legacy completions: `prompt` (a string, or each string of an array);
//! - Responses: `instructions`, then `input` (a string, or each item's `content`/`output`);
//! - Anthropic Messages: `system` (if present), then each element of `messages`.
//!
//! Output tokens are the content tokens sent plus `x-mock-reasoning-tokens` (as in OpenAI, where
//! reasoning tokens are part of completion tokens). Cached tokens are part of the prompt tokens for
//! OpenAI; for Anthropic they are reported as `cache_read_input_tokens` and subtracted from
//! `input_tokens`, as Anthropic does.

mod anthropic;
mod body;
mod openai;
mod responses;

pub use body::{Body, Limit, Model};

use crate::controls::{Controls, UsageMode};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// The inference APIs the mock serves, one per path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/responses`
    Responses,
    /// `POST /v1/messages` (Anthropic)
    Messages,
}

impl Api {
    pub fn from_path(path: &str) -> Option<Api> {
        match path {
            "/v1/chat/completions" => Some(Api::Chat),
            "/v1/completions" => Some(Api::Completions),
            "/v1/responses" => Some(Api::Responses),
            "/v1/messages" => Some(Api::Messages),
            _ => None,
        }
    }
}

/// The text of content token `i`.
pub fn token_text(i: u64) -> String {
    let mut text = Vec::new();
    push_token_text(i, &mut text);
    String::from_utf8_lossy(&text).into_owned()
}

/// Appends [`token_text`]`(i)` to `out`: `tok<i> `, nothing JSON would escape.
fn push_token_text(i: u64, out: &mut Vec<u8>) {
    // Written in place, digits by hand, into one buffer appended at once: a `String` per token
    // was the simulator's largest allocation, then `write!`'s formatting machinery a tenth of its
    // instructions, then three appends a token.
    let (text, start) = token_text_buffer(i);
    out.extend_from_slice(text.get(start.saturating_sub(3)..).unwrap_or_default());
}

/// `tok<i> ` right-aligned in a buffer (`u64::MAX` has 20 digits), and where its digits start
/// (`tok` is the three bytes before).
fn token_text_buffer(i: u64) -> ([u8; 24], usize) {
    let mut text = [b' '; 24];
    let mut start = text.len().saturating_sub(1);
    let mut rest = i;
    loop {
        start = start.saturating_sub(1);
        if let Some(slot) = text.get_mut(start) {
            *slot = b'0'.saturating_add(u8::try_from(rest % 10).unwrap_or(0));
        }
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    tok_before(&mut text, start);
    (text, start)
}

/// Writes `tok` just before the digits starting at `start`.
fn tok_before(text: &mut [u8; 24], start: usize) {
    if let Some(tok) = text.get_mut(start.saturating_sub(3)..start) {
        tok.copy_from_slice(b"tok");
    }
}

/// Tokens whose texts [`first_token_texts`] holds: longer than almost every answer, 79 KB.
const FIRST_TOKENS: u64 = 10_000;

/// `tok0 tok1 … tok9999 `, written once.
fn first_token_texts() -> &'static [u8] {
    static TEXTS: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    TEXTS.get_or_init(|| {
        let mut texts = Vec::with_capacity(usize::try_from(FIRST_TOKENS * 8).unwrap_or(0));
        for i in 0..FIRST_TOKENS {
            push_token_text(i, &mut texts);
        }
        texts
    })
}

/// Where token `i`'s text starts in [`first_token_texts`]: `tok` and a space (4 bytes) and the
/// digits of every token before it.
fn texts_offset(i: u64) -> usize {
    let mut digits = 0u64;
    let (mut low, mut high, mut width) = (0u64, 10u64, 1u64);
    while i > low {
        digits = digits.saturating_add(width.saturating_mul(i.min(high).saturating_sub(low)));
        (low, high, width) = (high, high.saturating_mul(10), width.saturating_add(1));
    }
    usize::try_from(i.saturating_mul(4).saturating_add(digits)).unwrap_or(usize::MAX)
}

/// Appends [`token_text`] of tokens `i .. i + n` (not past `u64::MAX`) to `out`: a token's text is
/// kept whole in one buffer and counted up in place for the next, one append a token, where
/// writing each number anew was most of the cost of a many-token event.
fn push_token_texts(i: u64, n: u64, out: &mut Vec<u8>) {
    let count = i.saturating_add(n).saturating_sub(i);
    // Within the first tokens, one copy from their texts written out once (one append a token
    // and its count up were two fifths of the simulator's rendering of a 16-token event).
    let end = i.saturating_add(count);
    if end <= FIRST_TOKENS {
        if let Some(texts) = first_token_texts().get(texts_offset(i)..texts_offset(end)) {
            out.extend_from_slice(texts);
            return;
        }
    }
    let (mut text, mut start) = token_text_buffer(i);
    let space = text.len().saturating_sub(1);
    for k in 0..count {
        out.extend_from_slice(text.get(start.saturating_sub(3)..).unwrap_or_default());
        if k.saturating_add(1) == count {
            break;
        }
        // Plus one: trailing nines become zeros and the digit before them goes up, or a new
        // leading one (the range ends before u64::MAX, whose 20 digits fit).
        let mut at = space;
        loop {
            at = at.saturating_sub(1);
            match text.get_mut(at) {
                Some(d) if *d == b'9' => {
                    *d = b'0';
                    if at <= start {
                        start = start.saturating_sub(1);
                        if let Some(lead) = text.get_mut(start) {
                            *lead = b'1';
                        }
                        tok_before(&mut text, start);
                        break;
                    }
                }
                Some(d) => {
                    *d = d.saturating_add(1);
                    break;
                }
                None => break,
            }
        }
    }
}

/// The text a [`TokenTemplate`] is cut around.
const TEMPLATE_MARK: &str = "\u{0}";

/// A plan's content-token event with its text cut out (see [`Plan::token_template`]).
#[derive(Debug, Clone)]
pub struct TokenTemplate {
    /// The wire bytes before and after the JSON-escaped text; `None`: render each event whole.
    split: Option<(Vec<u8>, Vec<u8>)>,
}

impl TokenTemplate {
    /// Appends the wire form of the event carrying tokens `i .. i + n` of `plan` to `out`.
    /// Bytes an event of `n` tokens takes, about (token texts are a few bytes each): what to reserve.
    pub fn size_hint(&self, n: u64) -> usize {
        let texts = usize::try_from(n.max(1)).unwrap_or(1).saturating_mul(8);
        self.split.as_ref().map_or(256, |(before, after)| before.len().saturating_add(after.len())).saturating_add(texts)
    }

    pub fn render(&self, plan: &Plan, i: u64, n: u64, seq: &mut u64, out: &mut Vec<u8>) {
        let Some((before, after)) = &self.split else {
            out.extend_from_slice(&plan.tokens(i, n, seq).render(false));
            return;
        };
        out.extend_from_slice(before);
        // One token (every event at one token an event) the short way: the run's set-up costs more.
        if n <= 1 && i < u64::MAX {
            push_token_text(i, out);
        } else {
            push_token_texts(i, n.max(1), out);
        }
        out.extend_from_slice(after);
    }
}

/// One SSE event: an optional `event:` line and one `data:` line.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub name: Option<&'static str>,
    pub data: String,
}

impl Event {
    fn data(v: Value) -> Event {
        Event { name: None, data: v.to_string() }
    }
    fn named(name: &'static str, v: Value) -> Event {
        Event { name: Some(name), data: v.to_string() }
    }
    /// Wire form, ending in the blank line that dispatches the event.
    pub fn render(&self, crlf: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.data.len().saturating_add(40));
        self.render_into(crlf, &mut out);
        out
    }

    /// Appends [`Event::render`]'s bytes to `out` (a renderer of many events reuses one buffer).
    pub fn render_into(&self, crlf: bool, out: &mut Vec<u8>) {
        let nl: &[u8] = if crlf { b"\r\n" } else { b"\n" };
        if let Some(name) = self.name {
            out.extend_from_slice(b"event: ");
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(nl);
        }
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(self.data.as_bytes());
        out.extend_from_slice(nl);
        out.extend_from_slice(nl);
    }
}

/// Sets `key` on a JSON object (a no-op on anything else, which the builders here never pass).
fn set(v: &mut Value, key: &str, value: Value) {
    if let Some(obj) = v.as_object_mut() {
        obj.insert(key.to_string(), value);
    }
}

/// An SSE comment line, as servers send to keep idle connections open.
pub fn keepalive_comment(crlf: bool) -> Vec<u8> {
    if crlf {
        b": keep-alive\r\n\r\n".to_vec()
    } else {
        b": keep-alive\n\n".to_vec()
    }
}

/// Everything decided before the first byte of the answer.
#[derive(Debug, Clone)]
pub struct Plan {
    pub api: Api,
    pub model: String,
    pub stream: bool,
    /// Content tokens to send (already capped by the request's max tokens).
    pub tokens: u64,
    /// True when the request's max tokens cut the answer short (finish reason "length").
    pub truncated: bool,
    pub max_tokens: Option<u64>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub reasoning_tokens: u64,
    /// Whether usage is reported at all.
    pub usage: bool,
    pub id: String,
    /// Id of the output message item (Responses API).
    pub item_id: String,
    pub created: u64,
}

impl Plan {
    /// Reads what matters from the request body. Errors are messages for a 400 reply.
    pub fn new(api: Api, body: &Value, controls: &Controls, model_override: Option<&str>) -> Result<Plan, String> {
        Plan::of_body(api, &Body::of_value(Some(api), body), controls, model_override)
    }

    /// [`Plan::new`] from what it reads of the body ([`Body::parse`] reads it from the text).
    pub fn of_body(api: Api, body: &Body, controls: &Controls, model_override: Option<&str>) -> Result<Plan, String> {
        if !body.object {
            return Err("request body must be a JSON object".into());
        }
        let model = match (model_override, &body.model) {
            (Some(m), _) => m.to_string(),
            (None, Model::Name(m)) => m.clone(),
            (None, Model::Unset) => "mock-model".to_string(),
            (None, Model::Invalid) => return Err("model must be a string".into()),
        };
        let stream = body.stream;
        // The API's limit members, in the order their errors are reported (an unset pads).
        let max_field: [(&str, Limit); 2] = match api {
            Api::Chat => [("max_completion_tokens", body.max_completion_tokens), ("max_tokens", body.max_tokens)],
            Api::Completions | Api::Messages => [("max_tokens", body.max_tokens), ("", Limit::Unset)],
            Api::Responses => [("max_output_tokens", body.max_output_tokens), ("", Limit::Unset)],
        };
        let mut max_tokens = None;
        for (field, limit) in max_field {
            match limit {
                Limit::Unset => {}
                Limit::Tokens(n) => max_tokens = Some(max_tokens.map_or(n, |m: u64| m.min(n))),
                Limit::Invalid => return Err(format!("{field} must be a non-negative integer")),
            }
        }
        let tokens = max_tokens.map_or(controls.tokens, |m| m.min(controls.tokens));
        let include_usage = body.include_usage;
        let usage = match controls.usage {
            UsageMode::Always => true,
            UsageMode::Never => false,
            UsageMode::Auto => match api {
                Api::Chat | Api::Completions => !stream || include_usage,
                Api::Responses | Api::Messages => true,
            },
        };
        let (id_prefix, item_prefix) = match api {
            Api::Chat => ("chatcmpl-", "msg_"),
            Api::Completions => ("cmpl-", "msg_"),
            Api::Responses => ("resp_", "msg_"),
            Api::Messages => ("msg_", "msg_"),
        };
        Ok(Plan {
            api,
            model,
            stream,
            tokens,
            truncated: tokens < controls.tokens,
            max_tokens,
            prompt_tokens: body.prompt_tokens,
            cached_tokens: controls.cached_tokens,
            reasoning_tokens: controls.reasoning_tokens,
            usage,
            id: new_id(id_prefix),
            item_id: new_id(item_prefix),
            created: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        })
    }

    pub fn completion_tokens(&self) -> u64 {
        self.tokens + self.reasoning_tokens
    }

    /// The whole answer text.
    pub fn text(&self) -> String {
        (0..self.tokens).map(token_text).collect()
    }

    /// OpenAI chat/completions usage object.
    fn openai_usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens(),
            "total_tokens": self.prompt_tokens + self.completion_tokens(),
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        })
    }

    /// Events sent with the response head, before the time to first token has passed.
    pub fn preamble(&self, seq: &mut u64) -> Vec<Event> {
        match self.api {
            Api::Chat => vec![openai::chat_role_chunk(self)],
            Api::Completions => vec![],
            Api::Responses => responses::preamble(self, seq),
            Api::Messages => anthropic::preamble(self),
        }
    }

    /// The event carrying content token `i`.
    pub fn token(&self, i: u64, seq: &mut u64) -> Event {
        self.tokens(i, 1, seq)
    }

    /// One event carrying content tokens `i` to `i + n − 1` (servers that batch tokens per event;
    /// the simulator, to spend fewer events on long answers).
    pub fn tokens(&self, i: u64, n: u64, seq: &mut u64) -> Event {
        let text: String = (i..i.saturating_add(n.max(1))).map(token_text).collect();
        self.text_event(&text, seq)
    }

    /// The event carrying content token `i`, its text padded with `x` to at least `bytes` bytes
    /// (`x-mock-token-bytes`: large events).
    pub fn token_padded(&self, i: u64, bytes: usize, seq: &mut u64) -> Event {
        let mut text = token_text(i);
        if text.len() < bytes {
            text.push_str(&"x".repeat(bytes - text.len()));
        }
        self.text_event(&text, seq)
    }

    /// A template of this plan's content-token events, for renderers of many events (the
    /// simulator): [`TokenTemplate::render`] writes exactly `self.tokens(i, n, seq).render(false)`.
    pub fn token_template(&self) -> TokenTemplate {
        // Responses' token events carry a sequence number: rendered whole, one by one.
        if self.api == Api::Responses {
            return TokenTemplate { split: None };
        }
        let mut wire = self.text_event(TEMPLATE_MARK, &mut 0).render(false);
        // The mark (a NUL, escaped by JSON) must stand for the text alone: a model name holding one
        // would make the split ambiguous, so such a plan renders whole too. Found at backslashes
        // (no others in the envelope but a name's), not by a substring search of a copy.
        let escaped: &[u8] = b"\\u0000";
        let (mut found, mut count, mut from) = (0, 0, 0);
        while let Some(at) = wire.get(from..).and_then(|rest| rest.iter().position(|b| *b == b'\\')).map(|at| at.saturating_add(from)) {
            if wire.get(at..at.saturating_add(escaped.len())) == Some(escaped) {
                (found, count, from) = (at, count + 1, at.saturating_add(escaped.len()));
            } else {
                from = at.saturating_add(1);
            }
        }
        let split = (count == 1).then(|| {
            let after = wire.split_off(found).split_off(escaped.len());
            (wire, after)
        });
        TokenTemplate { split }
    }

    fn text_event(&self, text: &str, seq: &mut u64) -> Event {
        let text = text.to_string();
        match self.api {
            Api::Chat => openai::chat_token_chunk(self, &text),
            Api::Completions => openai::completion_token_chunk(self, &text),
            Api::Responses => responses::token(self, &text, seq),
            Api::Messages => anthropic::token(&text),
        }
    }

    /// Events after the last content token: finish reason, usage, end marker.
    pub fn epilogue(&self, seq: &mut u64) -> Vec<Event> {
        match self.api {
            Api::Chat | Api::Completions => openai::epilogue(self),
            Api::Responses => responses::epilogue(self, seq),
            Api::Messages => anthropic::epilogue(self),
        }
    }

    /// Whether `event` (one of [`Plan::epilogue`]'s) carries the final usage: the OpenAI usage
    /// chunk, Anthropic's `message_delta` with `usage`, or the Responses terminal event whose
    /// `response.usage` is an object.
    pub fn is_final_usage(&self, event: &Event) -> bool {
        if !self.usage {
            return false;
        }
        let Ok(v) = serde_json::from_str::<Value>(&event.data) else {
            return false;
        };
        match self.api {
            Api::Chat | Api::Completions => v.get("usage").is_some_and(Value::is_object),
            Api::Messages => v.get("type") == Some(&json!("message_delta")) && v.get("usage").is_some_and(Value::is_object),
            Api::Responses => v.pointer("/response/usage").is_some_and(Value::is_object),
        }
    }

    /// The API's in-stream error event (`x-mock-fail: error-event-after:N`).
    pub fn error_event(&self, seq: &mut u64) -> Event {
        let message = "mock: injected error in stream";
        match self.api {
            Api::Chat | Api::Completions => Event::data(json!({
                "error": {"message": message, "type": "server_error", "param": null, "code": "internal_error"}
            })),
            Api::Responses => Event::named(
                "error",
                json!({"type": "error", "code": "server_error", "message": message, "param": null,
                       "sequence_number": responses::next(seq)}),
            ),
            Api::Messages => Event::named("error", json!({"type": "error", "error": {"type": "overloaded_error", "message": message}})),
        }
    }

    /// The non-streaming response body.
    pub fn full_body(&self) -> Value {
        match self.api {
            Api::Chat => openai::chat_full(self),
            Api::Completions => openai::completion_full(self),
            Api::Responses => responses::full(self),
            Api::Messages => anthropic::full(self),
        }
    }
}

/// A JSON error body in the style of the API at `path`: Anthropic's on `/v1/messages`, OpenAI's
/// everywhere else.
pub fn error_body(path: &str, status: u16, message: &str) -> Value {
    if Api::from_path(path) == Some(Api::Messages) {
        let kind = match status {
            400 | 413 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            _ => "api_error",
        };
        json!({"type": "error", "error": {"type": kind, "message": message}})
    } else {
        let (kind, code) = match status {
            400 | 413 | 431 => ("invalid_request_error", Value::Null),
            401 => ("invalid_request_error", json!("invalid_api_key")),
            404 => ("invalid_request_error", json!("not_found")),
            429 => ("rate_limit_error", json!("rate_limit_exceeded")),
            503 => ("server_error", json!("service_unavailable")),
            _ => ("server_error", Value::Null),
        };
        json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
    }
}

/// Unique enough ids for a mock: a per-process seed and a counter, hex-encoded.
pub(crate) fn new_id(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let seed = *SEED.get_or_init(|| {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
        nanos ^ (u64::from(std::process::id()) << 32)
    });
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    // `format!("{prefix}{seed:016x}{n:08x}")`, written directly (two ids a plan).
    let mut id = String::with_capacity(prefix.len().saturating_add(24));
    id.push_str(prefix);
    push_hex(&mut id, seed, 16);
    push_hex(&mut id, n, 8);
    id
}

/// Appends `v` in lowercase hex, zero-padded to at least `width` digits (as `{v:0width$x}`).
fn push_hex(out: &mut String, v: u64, width: u32) {
    let digits = (u64::BITS - v.leading_zeros()).div_ceil(4).max(width).clamp(1, 16);
    for k in (0..digits).rev() {
        let nibble = (v >> (4 * k)) & 0xf;
        out.push(char::from_digit(u32::try_from(nibble).unwrap_or(0), 16).unwrap_or('0'));
    }
}

/// Prompt tokens per the rule in the module docs.
pub fn prompt_tokens(api: Api, body: &Value) -> u64 {
    let units: Vec<&Value> = match api {
        Api::Chat => array(body.get("messages")).iter().map(|m| m.get("content").unwrap_or(&Value::Null)).collect(),
        Api::Completions => match body.get("prompt") {
            Some(Value::Array(items)) => items.iter().collect(),
            Some(p) => vec![p],
            None => vec![],
        },
        Api::Responses => {
            let mut units: Vec<&Value> = body.get("instructions").filter(|v| v.is_string()).into_iter().collect();
            match body.get("input") {
                Some(Value::Array(items)) => units.extend(items.iter().map(|it| it.get("content").or_else(|| it.get("output")).unwrap_or(&Value::Null))),
                Some(input) => units.push(input),
                None => {}
            }
            units
        }
        Api::Messages => {
            let mut units: Vec<&Value> = body.get("system").into_iter().collect();
            units.extend(array(body.get("messages")).iter().map(|m| m.get("content").unwrap_or(&Value::Null)));
            units
        }
    };
    units.into_iter().map(|u| (text_chars(u) as u64).div_ceil(4) + 4).sum()
}

fn array(v: Option<&Value>) -> &[Value] {
    v.and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[])
}

/// Characters of text in a content value: a string, or the `text` of each part of an array.
fn text_chars(v: &Value) -> usize {
    match v {
        Value::String(s) => s.chars().count(),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match p {
                Value::String(s) => s.chars().count(),
                _ => p.get("text").and_then(Value::as_str).map_or(0, |s| s.chars().count()),
            })
            .sum(),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use crate::controls::Defaults;

    #[test]
    fn token_texts_are_written_as_format_writes_them() {
        for i in [0, 1, 9, 10, 99, 100, 12_345, 1_000_000_007, u64::MAX - 1, u64::MAX] {
            let mut out = b"x".to_vec();
            push_token_text(i, &mut out);
            assert_eq!(out, format!("xtok{i} ").into_bytes());
        }
    }

    /// Runs of tokens counted up in place are the tokens written one by one: across a digit more
    /// (9, 99, 999 …), from 0, up to the end of u64.
    #[test]
    fn runs_of_token_texts_are_the_tokens_one_by_one() {
        let mut runs = vec![(0, 1), (0, 25), (7, 16), (95, 10), (990, 20), (9_999, 3), (123_456, 64), (u64::MAX - 3, 3), (u64::MAX - 3, 9), (u64::MAX, 1)];
        // Within, at and across the end of the texts written once.
        runs.extend([(0, FIRST_TOKENS), (FIRST_TOKENS - 16, 16), (FIRST_TOKENS - 16, 17), (FIRST_TOKENS - 1, 2), (FIRST_TOKENS, 5), (0, 0), (FIRST_TOKENS, 0)]);
        runs.extend((0..200).map(|k| (k * 37, k % 17)));
        for (i, n) in runs {
            let mut out = b"x".to_vec();
            push_token_texts(i, n, &mut out);
            let mut expected = b"x".to_vec();
            for t in i..i.saturating_add(n) {
                push_token_text(t, &mut expected);
            }
            assert_eq!(String::from_utf8(out).unwrap(), String::from_utf8(expected).unwrap(), "{i}+{n}");
        }
    }

    fn controls() -> Controls {
        Controls::from_headers(&Defaults::default(), |_| None).unwrap()
    }

    #[test]
    fn prompt_token_rule() {
        // "Hello" = 5 chars -> 2 + 4; "You are terse." = 14 chars -> 4 + 4
        let chat = json!({"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]});
        assert_eq!(prompt_tokens(Api::Chat, &chat), 14);
        let parts = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]});
        assert_eq!(prompt_tokens(Api::Chat, &parts), 6);
        assert_eq!(prompt_tokens(Api::Completions, &json!({"prompt": "Hello"})), 6);
        assert_eq!(prompt_tokens(Api::Completions, &json!({"prompt": ["Hello", ""]})), 10);
        assert_eq!(prompt_tokens(Api::Responses, &json!({"instructions": "Be", "input": "Hello"})), 5 + 6);
        let messages = json!({"system": "You are terse.", "messages": [{"role": "user", "content": "Hello"}]});
        assert_eq!(prompt_tokens(Api::Messages, &messages), 14);
        // Multi-byte characters count once each.
        assert_eq!(prompt_tokens(Api::Completions, &json!({"prompt": "ééééé"})), 6);
    }

    #[test]
    fn the_token_template_renders_the_events_byte_for_byte() {
        let mut templated = 0;
        for api in [Api::Chat, Api::Completions, Api::Responses, Api::Messages] {
            for (model, usage) in [("m", true), ("llama-v1 \"quoted\" é", false), ("has \u{0} a nul", true), ("back\\slash \\u0000", false), ("a\\", true)] {
                let body = json!({"model": model, "stream": true, "stream_options": {"include_usage": usage}});
                let plan = Plan::new(api, &body, &controls(), None).unwrap();
                let template = plan.token_template();
                templated += usize::from(template.split.is_some());
                let (mut seq_whole, mut seq_templated) = (3, 3);
                for (i, n) in [(0, 1), (1, 1), (2, 16), (99, 3), (12_345, 0)] {
                    let mut out = Vec::new();
                    template.render(&plan, i, n, &mut seq_templated, &mut out);
                    assert_eq!(
                        String::from_utf8(out).unwrap(),
                        String::from_utf8(plan.tokens(i, n, &mut seq_whole).render(false)).unwrap(),
                        "{api:?} {model} {i}+{n}"
                    );
                    assert_eq!(seq_templated, seq_whole);
                }
            }
        }
        // Chat and completions with the three names that do not hold the mark (nor its escaped
        // text); messages with all five (its token events do not carry the model).
        assert_eq!(templated, 11);
    }

    #[test]
    fn ids_are_written_as_format_writes_them() {
        for v in [0, 1, 0xf, 0x10, 0xabc, 0xffff_ffff, 0x1_0000_0000, 0x0123_4567_89ab_cdef, u64::MAX] {
            for width in [1, 8, 16] {
                let mut out = "p-".to_string();
                push_hex(&mut out, v, width);
                assert_eq!(out, format!("p-{v:0w$x}", w = width as usize));
            }
        }
        let id = new_id("chatcmpl-");
        assert!(id.starts_with("chatcmpl-") && id.len() == 9 + 24, "{id}");
    }

    #[test]
    fn max_tokens_truncates() {
        let plan = Plan::new(Api::Chat, &json!({"max_tokens": 3}), &controls(), None).unwrap();
        assert_eq!((plan.tokens, plan.truncated), (3, true));
        let plan = Plan::new(Api::Chat, &json!({"max_tokens": 30}), &controls(), None).unwrap();
        assert_eq!((plan.tokens, plan.truncated), (16, false));
        assert!(Plan::new(Api::Chat, &json!({"max_tokens": "3"}), &controls(), None).is_err());
        assert!(Plan::new(Api::Chat, &json!([1]), &controls(), None).is_err());
    }

    #[test]
    fn model_is_echoed_unless_overridden() {
        let body = json!({"model": "m1"});
        assert_eq!(Plan::new(Api::Chat, &body, &controls(), None).unwrap().model, "m1");
        assert_eq!(Plan::new(Api::Chat, &body, &controls(), Some("fixed")).unwrap().model, "fixed");
    }

    #[test]
    fn crlf_rendering() {
        let e = Event { name: Some("ping"), data: "{}".into() };
        assert_eq!(e.render(false), b"event: ping\ndata: {}\n\n");
        assert_eq!(e.render(true), b"event: ping\r\ndata: {}\r\n\r\n");
        let unnamed = Event { name: None, data: "[DONE]".into() };
        assert_eq!(unnamed.render(true), b"data: [DONE]\r\n\r\n");
        let mut out = b"x".to_vec();
        e.render_into(false, &mut out);
        unnamed.render_into(false, &mut out);
        assert_eq!(out, b"xevent: ping\ndata: {}\n\ndata: [DONE]\n\n");
    }
}
