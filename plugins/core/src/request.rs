//! What a request body tells before the upstream answers: model, streaming flags, output limit,
//! conversation shape, end user, and an estimate of the prompt size.
//!
//! Parsing is lenient about everything sluice does not need: a field of the wrong type is treated as
//! absent, because rejecting requests is the upstream's job, not a metrics or budget filter's.

use crate::api::ApiKind;
use crate::json::{chars, json_chars, nonempty_str_at, str_at, tokens_from_chars, u64_at};
use serde_json::Value;

/// Tokens added per message on top of its text, for role markers and separators in chat templates.
pub const MESSAGE_OVERHEAD_TOKENS: u64 = 4;

/// Facts taken from one request body.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestInfo {
    /// `model`, if a string.
    pub model: Option<String>,
    /// `stream == true`.
    pub stream: bool,
    /// `stream` is there, not `null` and not a boolean: whether the client asked for a stream is
    /// not known (the upstream will refuse the body; latency-guard treats it as a stream).
    pub stream_unreadable: bool,
    /// `stream_options.include_usage == true` (OpenAI: the stream will end with a usage chunk).
    pub include_usage: bool,
    /// Output limit: `max_completion_tokens` / `max_tokens` / `max_output_tokens`, the one the API
    /// documents first (chat prefers `max_completion_tokens`), else whichever is present.
    pub max_output_tokens: Option<u64>,
    /// `messages[]` (chat, Anthropic) or `input[]` items (Responses; a string input counts 1);
    /// completions: 1.
    pub message_count: u32,
    /// An earlier model turn is part of the request: a message or input item with role `assistant`
    /// (or `tool`, which always answers an assistant tool call), a Responses `function_call` /
    /// `function_call_output` / `reasoning` item, or a Responses `previous_response_id`.
    pub follow_up: bool,
    /// Prompt size ESTIMATE, not a tokenizer count: ⌈characters of all text / 4⌉ plus
    /// [`MESSAGE_OVERHEAD_TOKENS`] per message. Text is string content, `text` / `input_text` /
    /// `output_text` parts, system prompts (Anthropic top-level `system` string or blocks, Responses
    /// `instructions`), tool-call arguments and results, completions `prompt` (string or strings; a
    /// token-id array counts its length exactly) and tool definitions (their compact JSON length).
    /// Images, audio and files are ignored.
    pub prompt_tokens_estimate: u64,
    /// End user: body `user` (OpenAI) or `metadata.user_id` (Anthropic). Client-supplied: fine for
    /// labels, never for identity or budgets.
    pub user: Option<String>,
    /// Tool (function) definitions are present: providers then add hidden tool-use instructions
    /// to the prompt (Anthropic documents 159–530 tokens), which no body-size bound covers.
    pub has_tools: bool,
    /// How many generations the output limit applies to, each up to `max_output_tokens`: chat `n`;
    /// legacy completions `max(n, best_of)` (best_of candidates are generated and billed, n
    /// returned) times the number of prompts in a batched `prompt` array. 1 for the Responses and
    /// Anthropic Messages APIs, which have no such parameter. Never 0.
    pub output_choices: u64,
}

impl Default for RequestInfo {
    /// What an empty request says: nothing known, one generation.
    fn default() -> Self {
        RequestInfo {
            model: None,
            stream: false,
            stream_unreadable: false,
            include_usage: false,
            max_output_tokens: None,
            message_count: 0,
            follow_up: false,
            prompt_tokens_estimate: 0,
            user: None,
            has_tools: false,
            output_choices: 1,
        }
    }
}

/// Why a request body could not be inspected.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum RequestError {
    /// The body is not valid JSON (message from the parser, with line and column).
    #[error("request body is not valid JSON: {0}")]
    NotJson(String),
    /// The body is JSON but not an object.
    #[error("request body is not a JSON object")]
    NotObject,
}

/// Inspect a request body for the API `kind` (after [`refine_kind`]; see
/// [`inspect_request_with_kind`] to learn which kind was used).
pub fn inspect_request(kind: ApiKind, body: &[u8]) -> Result<RequestInfo, RequestError> {
    inspect_request_with_kind(kind, body).map(|(_, info)| info)
}

/// Bodies up to this size are remembered by [`inspect_request_with_kind`].
const REMEMBERED_BODY_BYTES: usize = 64 * 1024;

type Inspected = Result<(ApiKind, RequestInfo), RequestError>;

thread_local! {
    /// The last body inspected and what it gave: the policies of one VM that read the same request
    /// (latency-guard, then tenant-budget, in front of everything that rewrites it) parse it once.
    static LAST_INSPECTED: std::cell::RefCell<Option<(ApiKind, Vec<u8>, Inspected)>> = const { std::cell::RefCell::new(None) };
}

/// Like [`inspect_request`], also returning the kind after [`refine_kind`]. The same bytes for the
/// same kind right after give the same answer without a second parse.
pub fn inspect_request_with_kind(kind: ApiKind, body: &[u8]) -> Inspected {
    if body.len() > REMEMBERED_BODY_BYTES {
        return inspect_uncached(kind, body);
    }
    let hit = LAST_INSPECTED.with(|last| last.borrow().as_ref().filter(|(k, b, _)| *k == kind && b.as_slice() == body).map(|(_, _, r)| r.clone()));
    if let Some(inspected) = hit {
        return inspected;
    }
    let inspected = inspect_uncached(kind, body);
    LAST_INSPECTED.with(|last| {
        let mut last = last.borrow_mut();
        match last.as_mut() {
            // The allocation of the last body is reused.
            Some((k, b, r)) => {
                *k = kind;
                b.clear();
                b.extend_from_slice(body);
                *r = inspected.clone();
            }
            None => *last = Some((kind, body.to_vec(), inspected.clone())),
        }
    });
    inspected
}

/// Whether `body` is the last body inspected and was a JSON object: valid JSON in valid UTF-8, so
/// a rewrite of it need not validate it again.
pub(crate) fn known_object(body: &[u8]) -> bool {
    LAST_INSPECTED.with(|last| last.borrow().as_ref().is_some_and(|(_, b, r)| r.is_ok() && b.as_slice() == body))
}

/// `after` is `before` rewritten in a way whose inspection is `before`'s changed by `change` (a
/// member the inspection reads set to a known value). When `before` is the last body inspected,
/// `after` takes its place, so that the policies after the rewrite read it without a parse: the
/// body was parsed once per member set (the router's model, the budget's limit and usage flag)
/// before.
pub(crate) fn remember_rewrite(before: &[u8], after: &[u8], change: impl FnOnce(&mut RequestInfo)) {
    if after.len() > REMEMBERED_BODY_BYTES {
        return;
    }
    LAST_INSPECTED.with(|last| {
        let mut last = last.borrow_mut();
        if let Some((_, remembered, Ok((_, info)))) = last.as_mut() {
            if remembered.as_slice() == before {
                remembered.clear();
                remembered.extend_from_slice(after);
                change(info);
            }
        }
    });
}

fn inspect_uncached(kind: ApiKind, body: &[u8]) -> Inspected {
    let v: Value = serde_json::from_slice(body).map_err(|e| RequestError::NotJson(e.to_string()))?;
    if !v.is_object() {
        return Err(RequestError::NotObject);
    }
    let kind = refine_kind(kind, &v);
    Ok((kind, inspect_value(kind, &v)))
}

/// Refine a kind guessed from the path using the parsed body. Rules:
///
/// - `Completions` with a `messages` array and no `prompt` becomes `ChatCompletions` (clients that
///   post chat bodies to a `…/completions` route, and paths like `/v1/engines/x/completions`).
/// - `ChatCompletions` with a `prompt` and no `messages` becomes `Completions`.
/// - Everything else is kept: `responses` and `messages` paths are unambiguous.
pub fn refine_kind(kind: ApiKind, body_json: &Value) -> ApiKind {
    let has_messages = body_json.get("messages").is_some_and(Value::is_array);
    let has_prompt = body_json.get("prompt").is_some_and(|p| !p.is_null());
    match kind {
        ApiKind::Completions if has_messages && !has_prompt => ApiKind::ChatCompletions,
        ApiKind::ChatCompletions if has_prompt && !has_messages => ApiKind::Completions,
        other => other,
    }
}

fn inspect_value(kind: ApiKind, v: &Value) -> RequestInfo {
    let limit_keys: &[&str] = match kind {
        ApiKind::ChatCompletions => &["max_completion_tokens", "max_tokens", "max_output_tokens"],
        ApiKind::Completions | ApiKind::AnthropicMessages => &["max_tokens", "max_completion_tokens", "max_output_tokens"],
        ApiKind::Responses => &["max_output_tokens", "max_completion_tokens", "max_tokens"],
    };
    let user = match kind {
        ApiKind::AnthropicMessages => v.get("metadata").and_then(|m| nonempty_str_at(m, "user_id")),
        _ => nonempty_str_at(v, "user"),
    };
    let mut info = RequestInfo {
        model: str_at(v, "model").map(str::to_owned),
        stream: v.get("stream").and_then(Value::as_bool) == Some(true),
        stream_unreadable: v.get("stream").is_some_and(|s| !s.is_null() && !s.is_boolean()),
        include_usage: v.get("stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool) == Some(true),
        max_output_tokens: limit_keys.iter().find_map(|k| u64_at(v, k)),
        user: user.map(str::to_owned),
        ..RequestInfo::default()
    };
    let mut text = TextCount::default();
    match kind {
        ApiKind::ChatCompletions => chat(v, &mut info, &mut text),
        ApiKind::Completions => completions(v, &mut info, &mut text),
        ApiKind::Responses => responses(v, &mut info, &mut text),
        ApiKind::AnthropicMessages => anthropic(v, &mut info, &mut text),
    }
    // Tool definitions are sent to the model as part of the prompt.
    for key in ["tools", "functions"] {
        if let Some(tools) = v.get(key).filter(|t| !t.is_null()) {
            info.has_tools = true;
            text.chars = text.chars.saturating_add(json_chars(tools));
        }
    }
    info.output_choices = output_choices(kind, v);
    info.prompt_tokens_estimate =
        tokens_from_chars(text.chars).saturating_add(text.exact_tokens).saturating_add(u64::from(info.message_count).saturating_mul(MESSAGE_OVERHEAD_TOKENS));
    info
}

/// Largest generation count accepted from a request body; a larger `n` is counted as this many (the
/// reservation is then larger than any budget, so the request is refused, never under-reserved).
const MAX_OUTPUT_CHOICES: u64 = 1 << 20;

/// See [`RequestInfo::output_choices`]. A parameter of the wrong type, 0 or absent counts as 1: the
/// upstream refuses such a body, and 1 is its documented default.
fn output_choices(kind: ApiKind, v: &Value) -> u64 {
    let at_least_one = |key: &str| u64_at(v, key).filter(|&n| n > 0).unwrap_or(1).min(MAX_OUTPUT_CHOICES);
    match kind {
        ApiKind::ChatCompletions => at_least_one("n"),
        ApiKind::Completions => {
            let per_prompt = at_least_one("n").max(at_least_one("best_of"));
            // A batch: an array of strings or of token-id arrays is one prompt per element; a flat
            // array of token ids is a single prompt.
            let prompts = match v.get("prompt") {
                Some(Value::Array(items)) if !items.is_empty() && !items.iter().all(Value::is_number) => items.len() as u64,
                _ => 1,
            };
            per_prompt.saturating_mul(prompts).min(MAX_OUTPUT_CHOICES)
        }
        ApiKind::Responses | ApiKind::AnthropicMessages => 1,
    }
}

/// Running count of prompt text.
#[derive(Default)]
struct TextCount {
    chars: u64,
    /// Tokens known exactly (completions prompts given as token ids).
    exact_tokens: u64,
}

impl TextCount {
    fn add_str(&mut self, s: &str) {
        self.chars = self.chars.saturating_add(chars(s));
    }

    /// A `content` value: a string, or an array of parts whose text parts count.
    fn add_content(&mut self, content: &Value) {
        match content {
            Value::String(s) => self.add_str(s),
            Value::Array(parts) => {
                for part in parts {
                    self.add_part(part);
                }
            }
            _ => {}
        }
    }

    /// One content part or block of any of the APIs.
    fn add_part(&mut self, part: &Value) {
        match str_at(part, "type") {
            Some("text" | "input_text" | "output_text") => {
                if let Some(t) = str_at(part, "text") {
                    self.add_str(t);
                }
            }
            Some("refusal") => {
                if let Some(t) = str_at(part, "refusal") {
                    self.add_str(t);
                }
            }
            // Anthropic blocks replayed from earlier turns.
            Some("thinking") => {
                if let Some(t) = str_at(part, "thinking") {
                    self.add_str(t);
                }
            }
            Some("tool_use") => {
                if let Some(name) = str_at(part, "name") {
                    self.add_str(name);
                }
                if let Some(input) = part.get("input") {
                    self.chars = self.chars.saturating_add(json_chars(input));
                }
            }
            Some("tool_result") => {
                if let Some(c) = part.get("content") {
                    self.add_content(c);
                }
            }
            // Plain strings inside a part array (some clients send them).
            None => {
                if let Some(s) = part.as_str() {
                    self.add_str(s);
                }
            }
            // Images, audio, files, documents: not text.
            Some(_) => {}
        }
    }
}

fn count_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn chat(v: &Value, info: &mut RequestInfo, text: &mut TextCount) {
    let Some(messages) = v.get("messages").and_then(Value::as_array) else {
        return;
    };
    info.message_count = count_u32(messages.len());
    for m in messages {
        if matches!(str_at(m, "role"), Some("assistant" | "tool" | "function")) {
            info.follow_up = true;
        }
        if let Some(c) = m.get("content") {
            text.add_content(c);
        }
        if let Some(calls) = m.get("tool_calls").and_then(Value::as_array) {
            for call in calls {
                if let Some(f) = call.get("function") {
                    for key in ["name", "arguments"] {
                        if let Some(s) = str_at(f, key) {
                            text.add_str(s);
                        }
                    }
                }
            }
        }
    }
}

fn completions(v: &Value, info: &mut RequestInfo, text: &mut TextCount) {
    info.message_count = 1;
    match v.get("prompt") {
        Some(Value::String(s)) => text.add_str(s),
        Some(Value::Array(items)) => {
            for item in items {
                match item {
                    Value::String(s) => text.add_str(s),
                    // A token-id prompt: its length is the exact token count.
                    Value::Number(_) => text.exact_tokens = text.exact_tokens.saturating_add(1),
                    Value::Array(ids) => {
                        text.exact_tokens = text.exact_tokens.saturating_add(ids.len() as u64);
                    }
                    _ => {}
                }
            }
        }
        _ => {}
    }
    if let Some(s) = str_at(v, "suffix") {
        text.add_str(s);
    }
}

fn responses(v: &Value, info: &mut RequestInfo, text: &mut TextCount) {
    if let Some(s) = str_at(v, "instructions") {
        text.add_str(s);
    }
    if v.get("previous_response_id").is_some_and(|p| !p.is_null()) {
        info.follow_up = true;
    }
    match v.get("input") {
        Some(Value::String(s)) => {
            info.message_count = 1;
            text.add_str(s);
        }
        Some(Value::Array(items)) => {
            info.message_count = count_u32(items.len());
            for item in items {
                if matches!(str_at(item, "role"), Some("assistant"))
                    || matches!(str_at(item, "type"), Some("function_call" | "function_call_output" | "reasoning"))
                {
                    info.follow_up = true;
                }
                if let Some(c) = item.get("content") {
                    text.add_content(c);
                }
                for key in ["name", "arguments"] {
                    if let Some(s) = str_at(item, key) {
                        text.add_str(s);
                    }
                }
                match item.get("output") {
                    Some(Value::String(s)) => text.add_str(s),
                    Some(o @ Value::Array(_)) => text.add_content(o),
                    _ => {}
                }
                if let Some(summary) = item.get("summary") {
                    text.add_content(summary);
                }
            }
        }
        _ => {}
    }
}

fn anthropic(v: &Value, info: &mut RequestInfo, text: &mut TextCount) {
    if let Some(system) = v.get("system") {
        text.add_content(system);
    }
    let Some(messages) = v.get("messages").and_then(Value::as_array) else {
        return;
    };
    info.message_count = count_u32(messages.len());
    for m in messages {
        if str_at(m, "role") == Some("assistant") {
            info.follow_up = true;
        }
        if let Some(c) = m.get("content") {
            text.add_content(c);
        }
    }
}

/// Prompt-size bucket for labels: bounded cardinality, powers of two (1k = 1024 tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ContextBucket {
    /// ≤ 1024 tokens.
    UpTo1k,
    /// ≤ 2048 tokens.
    UpTo2k,
    /// ≤ 4096 tokens.
    UpTo4k,
    /// ≤ 8192 tokens.
    UpTo8k,
    /// ≤ 16384 tokens.
    UpTo16k,
    /// > 16384 tokens.
    Over16k,
}

impl ContextBucket {
    /// The bucket holding `t` tokens (upper bounds inclusive).
    pub fn from_tokens(t: u64) -> Self {
        match t {
            0..=1024 => ContextBucket::UpTo1k,
            1025..=2048 => ContextBucket::UpTo2k,
            2049..=4096 => ContextBucket::UpTo4k,
            4097..=8192 => ContextBucket::UpTo8k,
            8193..=16384 => ContextBucket::UpTo16k,
            _ => ContextBucket::Over16k,
        }
    }

    /// Label value: `"1k"`, `"2k"`, `"4k"`, `"8k"`, `"16k"`, `"over_16k"`.
    pub fn as_str(self) -> &'static str {
        match self {
            ContextBucket::UpTo1k => "1k",
            ContextBucket::UpTo2k => "2k",
            ContextBucket::UpTo4k => "4k",
            ContextBucket::UpTo8k => "8k",
            ContextBucket::UpTo16k => "16k",
            ContextBucket::Over16k => "over_16k",
        }
    }
}
