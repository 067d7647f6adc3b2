//! What the modelled upstream answers: the mock server's answers (`examples/mock-server`'s
//! `api` module, which the simulator renders its upstream with) in the shape the flows read — each
//! API's events or whole body, content token `i` the text `tok{i} `, usage where the mock reports it
//! (whole answers, Responses and Anthropic streams, OpenAI streams that ask for it) with its prompt
//! count (`⌈chars / 4⌉ + 4` per text unit), finish reasons by whether the output limit cut the
//! answer — timed and chunked as the simulator does: the first token alone at the TTFT, then events
//! of [`TOKENS_PER_EVENT`] tokens sent when their last token is due, gathered into one chunk per
//! [`CHUNK_NS`] of time. The mock itself cannot run in the page (it reads the system clock, which
//! `wasm32-unknown-unknown` does not have); what is left out of its events (ids, timestamps,
//! sequence numbers, `output_text.done`) is nothing a flow reads.

use serde_json::Value;
use sluice_core::api::ApiKind;

/// Content tokens per event after the first (the agreement test's simulator runs with the same).
pub const TOKENS_PER_EVENT: u64 = 16;
/// Tokens due within one such slice of time reach the gateway as one chunk (the simulator's
/// `stream_chunk_ms` default, 100 ms).
pub const CHUNK_NS: u64 = 100_000_000;

/// A planned answer: its status, headers and body pieces with their offsets from the start of
/// service (the last piece ends the response).
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub pieces: Vec<(u64, Vec<u8>)>,
    /// Content tokens it carries.
    pub tokens: u64,
}

/// What the answer to `body` says, decided before its first byte (the mock's `Plan`).
struct Plan {
    kind: ApiKind,
    /// The model, as a JSON string.
    model: String,
    tokens: u64,
    truncated: bool,
    prompt: u64,
    usage: bool,
}

/// The answer to `body` (a request of `kind`) from an upstream that would write `planned` tokens,
/// with its first token `ttft_ns` after service starts and one every `itl_ns` after that; `fail`:
/// an error status instead (sent at `ttft_ns`). `chunk_ns`: how tokens are gathered into chunks
/// (`u64::MAX`: all after the first in one).
pub fn answer(kind: ApiKind, body: &Value, planned: u64, ttft_ns: u64, itl_ns: u64, fail: Option<u16>, chunk_ns: u64) -> Answer {
    let json = vec![("content-type".to_string(), "application/json".to_string())];
    if let Some(status) = fail {
        return Answer { status, headers: json, pieces: vec![(ttft_ns, error_body(kind, status).into_bytes())], tokens: 0 };
    }
    let max_fields: &[&str] = match kind {
        ApiKind::ChatCompletions => &["max_completion_tokens", "max_tokens"],
        ApiKind::Completions | ApiKind::AnthropicMessages => &["max_tokens"],
        ApiKind::Responses => &["max_output_tokens"],
    };
    let max = max_fields.iter().filter_map(|f| body.get(*f).and_then(Value::as_u64)).min();
    let tokens = max.map_or(planned, |m| m.min(planned));
    let stream = body.get("stream") == Some(&Value::Bool(true));
    let include_usage = body.pointer("/stream_options/include_usage") == Some(&Value::Bool(true));
    let model = body.get("model").and_then(Value::as_str).unwrap_or("mock-model");
    let plan = Plan {
        kind,
        model: Value::String(model.to_string()).to_string(),
        tokens,
        truncated: tokens < planned,
        prompt: prompt_tokens(kind, body),
        usage: match kind {
            ApiKind::ChatCompletions | ApiKind::Completions => !stream || include_usage,
            ApiKind::Responses | ApiKind::AnthropicMessages => true,
        },
    };
    let end_ns = ttft_ns.saturating_add(itl_ns.saturating_mul(tokens.saturating_sub(1)));
    if !stream {
        return Answer { status: 200, headers: json, pieces: vec![(end_ns, plan.whole().into_bytes())], tokens };
    }
    let mut pieces: Vec<(u64, Vec<u8>)> = Vec::new();
    let preamble = plan.preamble();
    if !preamble.is_empty() {
        pieces.push((0, preamble.into_bytes()));
    }
    // Chunk 0 is the first token alone; chunk k ≥ 1 holds the events whose last token's offset
    // after the first lies in ((k − 1)·chunk, k·chunk], sent when that token is due.
    let mut current: Option<(u64, u64, String)> = None;
    let mut i = 0;
    while i < tokens {
        let n = if i == 0 { 1 } else { TOKENS_PER_EVENT.min(tokens - i) };
        let at = ttft_ns.saturating_add(itl_ns.saturating_mul(i + n - 1));
        let text: String = (i..i + n).map(|t| format!("tok{t} ")).collect();
        let event = plan.text_event(&text);
        let chunk = if i == 0 { 0 } else { at.saturating_sub(ttft_ns).div_ceil(chunk_ns.max(1)) };
        match &mut current {
            Some((k, t, bytes)) if *k == chunk => {
                *t = at;
                bytes.push_str(&event);
            }
            _ => {
                if let Some((_, t, bytes)) = current.take() {
                    pieces.push((t, bytes.into_bytes()));
                }
                current = Some((chunk, at, event));
            }
        }
        i += n;
    }
    let epilogue = plan.epilogue();
    match current {
        Some((_, t, mut bytes)) => {
            bytes.push_str(&epilogue);
            pieces.push((t, bytes.into_bytes()));
        }
        None => pieces.push((end_ns, epilogue.into_bytes())),
    }
    let headers = vec![("content-type".to_string(), "text/event-stream".to_string()), ("cache-control".to_string(), "no-cache".to_string())];
    Answer { status: 200, headers, pieces, tokens }
}

fn data(json: &str) -> String {
    format!("data: {json}\n\n")
}

fn named(name: &str, json: &str) -> String {
    format!("event: {name}\ndata: {json}\n\n")
}

impl Plan {
    fn text(&self) -> String {
        (0..self.tokens).map(|t| format!("tok{t} ")).collect()
    }

    fn finish(&self) -> &'static str {
        match (self.kind, self.truncated) {
            (ApiKind::AnthropicMessages, true) => "max_tokens",
            (ApiKind::AnthropicMessages, false) => "end_turn",
            (ApiKind::Responses, true) => "incomplete",
            (ApiKind::Responses, false) => "completed",
            (_, true) => "length",
            (_, false) => "stop",
        }
    }

    fn openai_usage(&self) -> String {
        format!("{{\"prompt_tokens\":{},\"completion_tokens\":{},\"total_tokens\":{}}}", self.prompt, self.tokens, self.prompt + self.tokens)
    }

    /// An OpenAI chunk (`choices` as JSON text); `usage: null` on it when usage is on.
    fn chunk(&self, choices: &str) -> String {
        let object = if self.kind == ApiKind::ChatCompletions { "chat.completion.chunk" } else { "text_completion" };
        let usage = if self.usage { ",\"usage\":null" } else { "" };
        data(&format!("{{\"id\":\"sim\",\"object\":\"{object}\",\"model\":{},\"choices\":{choices}{usage}}}", self.model))
    }

    fn responses_object(&self, status: &str, text: Option<&str>) -> String {
        let incomplete = if status == "incomplete" { "{\"reason\":\"max_output_tokens\"}" } else { "null" };
        let output = match text {
            Some(t) => {
                format!("[{{\"type\":\"message\",\"role\":\"assistant\",\"status\":\"{status}\",\"content\":[{{\"type\":\"output_text\",\"text\":\"{t}\"}}]}}]")
            }
            None => "[]".to_string(),
        };
        let usage = match (text, self.usage) {
            (Some(_), true) => {
                format!("{{\"input_tokens\":{},\"output_tokens\":{},\"total_tokens\":{}}}", self.prompt, self.tokens, self.prompt + self.tokens)
            }
            _ => "null".to_string(),
        };
        format!(
            "{{\"id\":\"resp_sim\",\"object\":\"response\",\"status\":\"{status}\",\"incomplete_details\":{incomplete},\"model\":{},\"output\":{output},\"usage\":{usage}}}",
            self.model
        )
    }

    fn anthropic_message(&self, content: &str, stop: &str, output_tokens: u64) -> String {
        format!(
            "{{\"id\":\"msg_sim\",\"type\":\"message\",\"role\":\"assistant\",\"model\":{},\"content\":{content},\"stop_reason\":{stop},\"usage\":{{\"input_tokens\":{},\"output_tokens\":{output_tokens}}}}}",
            self.model, self.prompt
        )
    }

    /// Events sent with the response head.
    fn preamble(&self) -> String {
        match self.kind {
            ApiKind::ChatCompletions => self.chunk("[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]"),
            ApiKind::Completions => String::new(),
            ApiKind::Responses => {
                named("response.created", &format!("{{\"type\":\"response.created\",\"response\":{}}}", self.responses_object("in_progress", None)))
            }
            ApiKind::AnthropicMessages => {
                let start = format!("{{\"type\":\"message_start\",\"message\":{}}}", self.anthropic_message("[]", "null", 1));
                let mut out = named("message_start", &start);
                out.push_str(&named(
                    "content_block_start",
                    "{\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}",
                ));
                out.push_str(&named("ping", "{\"type\":\"ping\"}"));
                out
            }
        }
    }

    /// One event carrying `text` (whole tokens: no character needs escaping).
    fn text_event(&self, text: &str) -> String {
        match self.kind {
            ApiKind::ChatCompletions => self.chunk(&format!("[{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}},\"finish_reason\":null}}]")),
            ApiKind::Completions => self.chunk(&format!("[{{\"index\":0,\"text\":\"{text}\",\"finish_reason\":null}}]")),
            ApiKind::Responses => named(
                "response.output_text.delta",
                &format!("{{\"type\":\"response.output_text.delta\",\"item_id\":\"msg_sim\",\"output_index\":0,\"content_index\":0,\"delta\":\"{text}\"}}"),
            ),
            ApiKind::AnthropicMessages => named(
                "content_block_delta",
                &format!("{{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":\"{text}\"}}}}"),
            ),
        }
    }

    /// Events after the last content token: finish reason, usage, end marker.
    fn epilogue(&self) -> String {
        let finish = self.finish();
        match self.kind {
            ApiKind::ChatCompletions | ApiKind::Completions => {
                let choice = if self.kind == ApiKind::ChatCompletions { "\"delta\":{}" } else { "\"text\":\"\"" };
                let mut out = self.chunk(&format!("[{{\"index\":0,{choice},\"finish_reason\":\"{finish}\"}}]"));
                if self.usage {
                    let object = if self.kind == ApiKind::ChatCompletions { "chat.completion.chunk" } else { "text_completion" };
                    out.push_str(&data(&format!(
                        "{{\"id\":\"sim\",\"object\":\"{object}\",\"model\":{},\"choices\":[],\"usage\":{}}}",
                        self.model,
                        self.openai_usage()
                    )));
                }
                out.push_str(&data("[DONE]"));
                out
            }
            ApiKind::Responses => {
                let name = format!("response.{finish}");
                named(&name, &format!("{{\"type\":\"{name}\",\"response\":{}}}", self.responses_object(finish, Some(&self.text()))))
            }
            ApiKind::AnthropicMessages => {
                let mut out = named("content_block_stop", "{\"type\":\"content_block_stop\",\"index\":0}");
                out.push_str(&named(
                    "message_delta",
                    &format!(
                        "{{\"type\":\"message_delta\",\"delta\":{{\"stop_reason\":\"{finish}\",\"stop_sequence\":null}},\"usage\":{{\"output_tokens\":{}}}}}",
                        self.tokens
                    ),
                ));
                out.push_str(&named("message_stop", "{\"type\":\"message_stop\"}"));
                out
            }
        }
    }

    /// The whole (non-streamed) answer.
    fn whole(&self) -> String {
        let text = self.text();
        let finish = self.finish();
        match self.kind {
            ApiKind::ChatCompletions | ApiKind::Completions => {
                let (object, choice) = if self.kind == ApiKind::ChatCompletions {
                    ("chat.completion", format!("\"message\":{{\"role\":\"assistant\",\"content\":\"{text}\"}}"))
                } else {
                    ("text_completion", format!("\"text\":\"{text}\""))
                };
                format!(
                    "{{\"id\":\"sim\",\"object\":\"{object}\",\"model\":{},\"choices\":[{{\"index\":0,{choice},\"finish_reason\":\"{finish}\"}}],\"usage\":{}}}",
                    self.model,
                    self.openai_usage()
                )
            }
            ApiKind::Responses => self.responses_object(finish, Some(&text)),
            ApiKind::AnthropicMessages => {
                self.anthropic_message(&format!("[{{\"type\":\"text\",\"text\":\"{text}\"}}]"), &format!("\"{finish}\""), self.tokens)
            }
        }
    }
}

/// An error answer in the API's shape (Anthropic's on messages, OpenAI's elsewhere).
fn error_body(kind: ApiKind, status: u16) -> String {
    let message = "upstream error (simulated)";
    if kind == ApiKind::AnthropicMessages {
        let error = match status {
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            _ => "api_error",
        };
        return format!("{{\"type\":\"error\",\"error\":{{\"type\":\"{error}\",\"message\":\"{message}\"}}}}");
    }
    let error = match status {
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    };
    format!("{{\"error\":{{\"message\":\"{message}\",\"type\":\"{error}\",\"param\":null,\"code\":null}}}}")
}

/// The prompt tokens the mock reports: `⌈chars / 4⌉ + 4` per text unit (each message's content;
/// a completion's prompt or each of its strings; a response's instructions and input or each
/// input item; Anthropic's system and each message).
pub fn prompt_tokens(kind: ApiKind, body: &Value) -> u64 {
    let list = |v: Option<&Value>| v.and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default().to_vec();
    let content = |m: &Value| m.get("content").cloned().unwrap_or(Value::Null);
    let mut units: Vec<Value> = Vec::new();
    match kind {
        ApiKind::ChatCompletions => units.extend(list(body.get("messages")).iter().map(content)),
        ApiKind::Completions => match body.get("prompt") {
            Some(Value::Array(items)) => units.extend(items.iter().cloned()),
            Some(p) => units.push(p.clone()),
            None => {}
        },
        ApiKind::Responses => {
            units.extend(body.get("instructions").filter(|v| v.is_string()).cloned());
            match body.get("input") {
                Some(Value::Array(items)) => {
                    units.extend(items.iter().map(|it| it.get("content").or_else(|| it.get("output")).cloned().unwrap_or(Value::Null)))
                }
                Some(input) => units.push(input.clone()),
                None => {}
            }
        }
        ApiKind::AnthropicMessages => {
            units.extend(body.get("system").cloned());
            units.extend(list(body.get("messages")).iter().map(content));
        }
    }
    let chars = |s: &str| s.chars().count() as u64;
    units
        .iter()
        .map(|u| {
            let n = match u {
                Value::String(s) => chars(s),
                Value::Array(parts) => parts
                    .iter()
                    .map(|p| match p {
                        Value::String(s) => chars(s),
                        _ => p.get("text").and_then(Value::as_str).map_or(0, chars),
                    })
                    .sum(),
                _ => 0,
            };
            n.div_ceil(4) + 4
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::response::inspect_response_body;
    use sluice_core::response::StreamObserver;

    fn body(kind: ApiKind, stream: bool, max: Option<u64>) -> Value {
        serde_json::from_slice(&sluice_workload::request::request_body(kind, "m", "0123456789abcdef", stream, max, None).1).unwrap()
    }

    /// Every API's stream and whole answer reads back (core's own observer) as the mock's: the
    /// tokens, the usage it reports, the finish reason.
    #[test]
    fn answers_read_back_with_the_mocks_usage() {
        for kind in [ApiKind::ChatCompletions, ApiKind::Completions, ApiKind::Responses, ApiKind::AnthropicMessages] {
            let whole = answer(kind, &body(kind, false, Some(30)), 40, 5, 1, None, CHUNK_NS);
            let [(at, bytes)] = whole.pieces.as_slice() else { panic!("{kind:?}: one piece") };
            assert_eq!((*at, whole.tokens), (5 + 29, 30));
            let s = inspect_response_body(kind, bytes);
            assert!(s.usage_reported, "{kind:?}");
            assert_eq!((s.usage.input_tokens, s.usage.output_tokens), (8, 30), "{kind:?}");
            assert!(s.finish_reason.is_some(), "{kind:?}");

            let streamed = answer(kind, &body(kind, true, None), 40, 5, 1, None, CHUNK_NS);
            let mut observer = StreamObserver::new(kind);
            let mut content = 0;
            for (_, piece) in &streamed.pieces {
                content += observer.push(piece).content_events;
            }
            content += observer.finish().content_events;
            let s = observer.summary();
            // The first token alone, then 39 in events of 16: 1 + 3.
            assert_eq!(content, 4, "{kind:?}");
            let reported = matches!(kind, ApiKind::Responses | ApiKind::AnthropicMessages);
            assert_eq!(s.usage_reported, reported, "{kind:?}");
            if reported {
                assert_eq!((s.usage.input_tokens, s.usage.output_tokens), (8, 40), "{kind:?}");
            }
        }
    }

    /// Chunks: the preamble at 0, the first token alone at the TTFT, then one chunk per 100 ms.
    #[test]
    fn streams_are_chunked_as_the_simulator_chunks_them() {
        let a = answer(ApiKind::ChatCompletions, &body(ApiKind::ChatCompletions, true, None), 100, 50_000_000, 10_000_000, None, CHUNK_NS);
        let times: Vec<u64> = a.pieces.iter().map(|(t, _)| t / 1_000_000).collect();
        // Tokens 1–16 end at 210 ms (chunk 2), 17–32 at 370 (4), … 81–96 at 1010 and 97–99 at
        // 1040 (both chunk 10: one piece, sent at 1040).
        assert_eq!(times, vec![0, 50, 210, 370, 530, 690, 850, 1040]);
        let failed = answer(ApiKind::AnthropicMessages, &Value::Null, 10, 40, 1, Some(503), CHUNK_NS);
        assert_eq!((failed.status, failed.pieces.len()), (503, 1));
    }
}
