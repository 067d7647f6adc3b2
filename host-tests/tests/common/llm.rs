//! Shared by the llm-metrics tests: the compiled `sluice_llm_metrics.wasm`, its test configuration,
//! realistic payloads of the four LLM APIs (OpenAI chat and legacy completions, Responses, Anthropic
//! Messages), and [`Call`], which plays one request and its response on the virtual clock at exact
//! millisecond offsets from the request's start.

use std::sync::OnceLock;
use std::time::Duration;

use serde_json::{json, Value};
use sluice_host::{workspace_wasm, Gateway, Plugin, PluginSpec, Stream};

/// Plugin configuration most tests use: a tenant from an auth-filter header, one named tenant,
/// prices for the models the payloads below answer with, paths under `/v1/` only.
pub const CONFIG: &str = r#"{
  "path_prefixes": ["/v1/"],
  "tenant": {"header": "x-sluice-tenant"},
  "tenants": ["acme"],
  "prices": [
    {"model": "gpt-4o*", "input_usd_per_mtok": 2.5, "output_usd_per_mtok": 10, "cached_input_usd_per_mtok": 1.25},
    {"model": "gpt-3.5-turbo-instruct", "input_usd_per_mtok": 1.5, "output_usd_per_mtok": 2},
    {"model": "claude-*", "input_usd_per_mtok": 3, "output_usd_per_mtok": 15,
     "cached_input_usd_per_mtok": 0.3, "cache_creation_input_usd_per_mtok": 3.75}
  ]
}"#;

/// [`CONFIG`] with the keys of `extra` added or replaced.
pub fn config_with(extra: Value) -> String {
    let mut config: Value = serde_json::from_str(CONFIG).expect("CONFIG is JSON");
    if let (Some(base), Value::Object(extra)) = (config.as_object_mut(), extra) {
        base.extend(extra);
    }
    config.to_string()
}

/// The compiled llm-metrics build (compiled once per test binary; build it first with
/// `cargo build --release --target wasm32-wasip1 -p sluice-llm-metrics -p sluice`).
pub fn plugin() -> Plugin {
    static PLUGIN: OnceLock<Plugin> = OnceLock::new();
    PLUGIN.get_or_init(|| Plugin::load(workspace_wasm(super::build_stem("sluice_llm_metrics"))).expect("the llm-metrics build compiles")).clone()
}

/// llm-metrics' configuration `config` as the build under test reads it.
pub fn spec(config: &str) -> PluginSpec {
    super::section_spec("llm_metrics", config)
}

/// A fresh gateway running llm-metrics with `config`.
pub fn gateway_with(config: &str) -> Gateway {
    Gateway::start(&plugin(), spec(config)).expect("llm-metrics accepts its configuration")
}

/// A fresh gateway running llm-metrics with [`CONFIG`].
pub fn gateway() -> Gateway {
    gateway_with(CONFIG)
}

/// The label suffix every per-request metric carries, with the values most tests expect as defaults:
/// model version `v2`, tenant `acme`, ctx `1k`, first turn, streamed.
#[derive(Clone, Debug)]
pub struct Labels {
    pub model_version: String,
    pub tenant: String,
    pub api: String,
    pub ctx: String,
    pub turn: String,
    pub stream: bool,
}

impl Labels {
    pub fn new(api: &str) -> Self {
        Self { model_version: "v2".into(), tenant: "acme".into(), api: api.into(), ctx: "1k".into(), turn: "first".into(), stream: true }
    }
    pub fn model_version(mut self, v: &str) -> Self {
        self.model_version = v.into();
        self
    }
    pub fn tenant(mut self, v: &str) -> Self {
        self.tenant = v.into();
        self
    }
    pub fn ctx(mut self, v: &str) -> Self {
        self.ctx = v.into();
        self
    }
    pub fn turn(mut self, v: &str) -> Self {
        self.turn = v.into();
        self
    }
    pub fn stream(mut self, v: bool) -> Self {
        self.stream = v;
        self
    }

    /// `.model_version.v2.tenant.acme.api.chat_completions.ctx.1k.turn.first.stream.true`
    pub fn suffix(&self) -> String {
        format!(".model_version.{}.tenant.{}.api.{}.ctx.{}.turn.{}.stream.{}", self.model_version, self.tenant, self.api, self.ctx, self.turn, self.stream)
    }

    /// The name of metric `metric` (e.g. `ttft_ms`) with these labels.
    pub fn name(&self, metric: &str) -> String {
        format!("sluice.{metric}{}", self.suffix())
    }

    /// The `requests_total` counter with these labels and its status/finish/usage labels.
    pub fn requests_total(&self, status: &str, finish: &str, usage: &str) -> String {
        format!("sluice.requests_total{}.status.{status}.finish.{finish}.usage.{usage}", self.suffix())
    }
}

/// How the response body is cut into `response_body` calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// One call per timeline entry (typically one SSE event).
    PerEntry,
    /// One call per byte, every byte of an entry at that entry's time.
    ByteByByte,
}

/// One request on a gateway, played at exact offsets from the moment its headers arrived.
pub struct Call<'g> {
    pub gw: &'g Gateway,
    pub stream: Stream<'g>,
    pub start_ns: u64,
    /// Every response body byte sent by the upstream, in order.
    pub upstream_body: Vec<u8>,
}

/// Request headers of an LLM call: `POST path` with a JSON body, plus `extra`.
pub fn headers<'a>(path: &'a str, extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut h = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", "llm.internal"),
        (":scheme", "https"),
        ("content-type", "application/json"),
        ("user-agent", "OpenAI/Python 1.54.0"),
    ];
    h.extend_from_slice(extra);
    h
}

/// The request headers tests use by default: tenant `acme`, model version `v2`.
pub const ACME_V2: [(&str, &str); 2] = [("x-sluice-tenant", "acme"), ("x-model-version", "v2")];

impl<'g> Call<'g> {
    /// Sends the request headers (as raw byte pairs, so values may be any bytes) and `body` at the
    /// current time, which becomes offset 0.
    pub fn start_raw(gw: &'g Gateway, headers: &[(&[u8], &[u8])], body: &[u8]) -> Self {
        let start_ns = gw.now_ns();
        let mut stream = gw.stream();
        stream.request_headers(headers, body.is_empty()).expect("request headers");
        if !body.is_empty() {
            stream.request_body(body, true).expect("request body");
        }
        Self { gw, stream, start_ns, upstream_body: Vec::new() }
    }

    /// Sends `headers` and `body` at the current time, which becomes offset 0.
    pub fn start(gw: &'g Gateway, headers: &[(&str, &str)], body: &str) -> Self {
        let raw: Vec<(&[u8], &[u8])> = headers.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())).collect();
        Self::start_raw(gw, &raw, body.as_bytes())
    }

    /// Moves the virtual clock to `ms` milliseconds after the request started.
    pub fn at(&self, ms: u64) {
        let target = self.start_ns + ms * 1_000_000;
        let now = self.gw.now_ns();
        assert!(target >= now, "time only moves forward: +{ms} ms is in the past");
        self.gw.advance(Duration::from_nanos(target - now)).expect("advance the clock");
    }

    /// Response headers arrive at `+ms`.
    pub fn response_headers(&mut self, ms: u64, status: &str, content_type: &str) {
        self.at(ms);
        self.stream
            .response_headers(
                &[(":status", status), ("content-type", content_type), ("x-request-id", "req_9f8e7d6c5b4a"), ("openai-processing-ms", "57")],
                false,
            )
            .expect("response headers");
    }

    /// SSE response headers (`200`, `text/event-stream; charset=utf-8`) at `+ms`.
    pub fn sse_headers(&mut self, ms: u64) {
        self.response_headers(ms, "200", "text/event-stream; charset=utf-8");
    }

    /// Response body pieces at their offsets; `end` marks the last piece as the end of stream.
    pub fn body(&mut self, timeline: &[(u64, String)], delivery: Delivery, end: bool) {
        let last = timeline.len().saturating_sub(1);
        for (i, (ms, bytes)) in timeline.iter().enumerate() {
            self.at(*ms);
            let eos = end && i == last;
            self.upstream_body.extend_from_slice(bytes.as_bytes());
            match delivery {
                Delivery::PerEntry => {
                    self.stream.response_body(bytes.as_bytes(), eos).expect("response body");
                }
                Delivery::ByteByByte => {
                    let n = bytes.len();
                    for (j, b) in bytes.as_bytes().iter().enumerate() {
                        self.stream.response_body(&[*b], eos && j + 1 == n).expect("response body byte");
                    }
                }
            }
        }
    }

    /// Raw response body bytes at `+ms`.
    pub fn body_bytes(&mut self, ms: u64, bytes: &[u8], end: bool) {
        self.at(ms);
        self.upstream_body.extend_from_slice(bytes);
        self.stream.response_body(bytes, end).expect("response body");
    }

    /// The stream completes (done, log, delete).
    pub fn end(&mut self) {
        self.stream.end().expect("end of stream");
    }

    /// The access-log stamp, parsed.
    pub fn stamp(&self) -> Value {
        let raw = self.stream.filter_state("sluice_llm").expect("the plugin wrote its access-log stamp");
        serde_json::from_slice(&raw).expect("the stamp is JSON")
    }

    /// What the client received.
    pub fn downstream_body(&self) -> Vec<u8> {
        self.stream.downstream_body()
    }
}

// ---------------------------------------------------------------------------------------------
// OpenAI chat completions
// ---------------------------------------------------------------------------------------------

pub mod chat {
    use super::*;

    pub const PATH: &str = "/v1/chat/completions";
    pub const MODEL: &str = "gpt-4o-2024-08-06";
    /// Content of the streamed answer, one chunk each: 9 chunks; the usage chunk says 9 tokens. The
    /// per-chunk estimate (one token per chunk of up to 4 characters, 4 characters a token in longer
    /// ones) gives 8 × 1 + 16/4 = 12; piece lengths are ≤ 4 or a multiple of 4, so rounding up or
    /// down gives the same estimate.
    pub const PIECES: [&str; 9] = ["Hi", "!", " How", " can", " I", " aid", " you", " with that today", "?"];
    pub const ESTIMATED_TOKENS: u64 = 12;

    /// System prompt (28 characters) and user message (6): the request-body estimate is
    /// ⌈34/4⌉ + 2 messages × 4 = 17 tokens.
    pub fn request(stream: bool, include_usage: bool) -> String {
        let mut body = json!({
            "model": "gpt-4o",
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Hello!"}
            ],
            "temperature": 0.7,
            "stream": stream,
        });
        if include_usage {
            body["stream_options"] = json!({"include_usage": true});
        }
        body.to_string()
    }
    pub const REQUEST_ESTIMATE: u64 = 17;

    pub fn event(v: Value) -> String {
        format!("data: {v}\n\n")
    }

    /// One `chat.completion.chunk` with one choice.
    pub fn chunk_value(delta: Value, finish: Option<&str>) -> Value {
        json!({
            "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
            "object": "chat.completion.chunk",
            "created": 1741570283,
            "model": MODEL,
            "system_fingerprint": "fp_eb9dce56a8",
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
            "usage": null
        })
    }

    pub fn role() -> String {
        event(chunk_value(json!({"role": "assistant", "content": "", "refusal": null}), None))
    }
    pub fn content(text: &str) -> String {
        event(chunk_value(json!({"content": text}), None))
    }
    pub fn finish(reason: &str) -> String {
        event(chunk_value(json!({}), Some(reason)))
    }
    pub fn usage_value(choices: Value, prompt: u64, completion: u64, cached: u64) -> Value {
        json!({
            "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
            "object": "chat.completion.chunk",
            "created": 1741570283,
            "model": MODEL,
            "system_fingerprint": "fp_eb9dce56a8",
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                    "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
            }
        })
    }
    /// The `include_usage` chunk as OpenAI sends it: `choices: []`.
    pub fn usage(prompt: u64, completion: u64) -> String {
        event(usage_value(json!([]), prompt, completion, 0))
    }
    pub const DONE: &str = "data: [DONE]\n\n";

    /// The standard streamed answer: headers and a role-only chunk at +120 ms, content at
    /// +180, +205, … +380 ms (every 25 ms), finish at +390, then (if `usage`) the usage chunk
    /// (19 prompt, 9 completion tokens) at +391 and `[DONE]` at +392.
    pub fn timeline(usage: bool) -> Vec<(u64, String)> {
        let mut t = vec![(120, role())];
        for (i, p) in PIECES.iter().enumerate() {
            t.push((180 + 25 * i as u64, content(p)));
        }
        t.push((390, finish("stop")));
        if usage {
            t.push((391, super::chat::usage(19, 9)));
        }
        t.push((392, DONE.to_string()));
        t
    }

    /// A complete (non-streamed) answer.
    pub fn response(prompt: u64, completion: u64) -> String {
        json!({
            "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
            "object": "chat.completion",
            "created": 1741569952,
            "model": MODEL,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": "Hello! How can I help you today?", "refusal": null, "annotations": []},
                "logprobs": null,
                "finish_reason": "stop"
            }],
            "usage": {
                "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                    "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
            },
            "service_tier": "default",
            "system_fingerprint": "fp_fc9f1d7035"
        })
        .to_string()
    }
}

// ---------------------------------------------------------------------------------------------
// OpenAI legacy completions
// ---------------------------------------------------------------------------------------------

pub mod completions {
    use super::*;

    pub const PATH: &str = "/v1/completions";
    pub const MODEL: &str = "gpt-3.5-turbo-instruct";

    pub fn request(stream: bool) -> String {
        let mut body = json!({
            "model": MODEL, "prompt": "Say this is a test", "max_tokens": 7, "temperature": 0, "stream": stream,
        });
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        body.to_string()
    }

    fn chunk(choices: Value, usage: Value) -> String {
        let v = json!({
            "id": "cmpl-7iA7iJjj8V2zOkCGvWF2hAkDWBQZe",
            "object": "text_completion",
            "created": 1690759702,
            "choices": choices,
            "model": MODEL,
            "system_fingerprint": null,
            "usage": usage
        });
        format!("data: {v}\n\n")
    }
    pub fn text(t: &str, finish: Option<&str>) -> String {
        chunk(json!([{"text": t, "index": 0, "logprobs": null, "finish_reason": finish}]), Value::Null)
    }
    pub fn usage(prompt: u64, completion: u64) -> String {
        chunk(json!([]), json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}))
    }

    pub fn response() -> String {
        json!({
            "id": "cmpl-uqkvlQyYK7bGYrRHQ0eXlWi7",
            "object": "text_completion",
            "created": 1589478378,
            "model": MODEL,
            "system_fingerprint": "fp_44709d6fcb",
            "choices": [{"text": "\n\nThis is indeed a test", "index": 0, "logprobs": null, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
        })
        .to_string()
    }
}

// ---------------------------------------------------------------------------------------------
// OpenAI Responses API
// ---------------------------------------------------------------------------------------------

pub mod responses {
    use super::*;

    pub const PATH: &str = "/v1/responses";
    pub const MODEL: &str = "gpt-4o-2024-08-06";
    pub const RESP_ID: &str = "resp_67c9fdcecf488190bdd9a0409de3a1ec07b8b0ad4e5eb654";
    pub const MSG_ID: &str = "msg_67c9fdcf37fc8190ba82116e33fb28c507b8b0ad4e5eb654";
    pub const DELTAS: [&str; 6] = ["Why", " did", " the", " chicken", " cross", "?"];

    pub fn request(stream: bool) -> String {
        json!({
            "model": "gpt-4o",
            "instructions": "You are a comedian.",
            "input": "Tell me a joke about chickens.",
            "stream": stream
        })
        .to_string()
    }

    pub fn event(ty: &str, mut v: Value, seq: u64) -> String {
        v["type"] = json!(ty);
        v["sequence_number"] = json!(seq);
        format!("event: {ty}\ndata: {v}\n\n")
    }

    /// The `response` object; `usage` null while in progress.
    pub fn response_object(status: &str, usage: Value, output: Value) -> Value {
        json!({
            "id": RESP_ID, "object": "response", "created_at": 1741290958, "status": status,
            "error": null, "incomplete_details": null, "instructions": "You are a comedian.",
            "max_output_tokens": null, "model": MODEL, "output": output,
            "parallel_tool_calls": true, "previous_response_id": null,
            "reasoning": {"effort": null, "summary": null}, "store": true, "temperature": 1.0,
            "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [], "top_p": 1.0,
            "truncation": "disabled", "usage": usage, "user": null, "metadata": {}
        })
    }

    pub fn usage(input: u64, cached: u64, output: u64, reasoning: u64) -> Value {
        json!({
            "input_tokens": input, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": input + output
        })
    }

    fn message(text: &str, status: &str) -> Value {
        json!({"id": MSG_ID, "type": "message", "status": status, "role": "assistant",
               "content": [{"type": "output_text", "text": text, "annotations": []}]})
    }

    /// Created/in-progress/item/part events at +200 ms, deltas at +250 … +350 ms (every 20 ms),
    /// closing events at +355 and `response.completed` (usage 1500 in, 1024 cached, 6 out) at +360.
    pub fn timeline() -> Vec<(u64, String)> {
        let text: String = DELTAS.concat();
        let mut seq = 0;
        let mut next = || {
            seq += 1;
            seq - 1
        };
        let mut t = vec![
            (200, event("response.created", json!({"response": response_object("in_progress", Value::Null, json!([]))}), next())),
            (200, event("response.in_progress", json!({"response": response_object("in_progress", Value::Null, json!([]))}), next())),
            (
                200,
                event(
                    "response.output_item.added",
                    json!({"output_index": 0,
                "item": {"id": MSG_ID, "type": "message", "status": "in_progress", "role": "assistant", "content": []}}),
                    next(),
                ),
            ),
            (
                200,
                event(
                    "response.content_part.added",
                    json!({"item_id": MSG_ID, "output_index": 0, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}}),
                    next(),
                ),
            ),
        ];
        for (i, d) in DELTAS.iter().enumerate() {
            t.push((
                250 + 20 * i as u64,
                event("response.output_text.delta", json!({"item_id": MSG_ID, "output_index": 0, "content_index": 0, "delta": d}), next()),
            ));
        }
        t.push((355, event("response.output_text.done", json!({"item_id": MSG_ID, "output_index": 0, "content_index": 0, "text": text}), next())));
        t.push((
            355,
            event(
                "response.content_part.done",
                json!({"item_id": MSG_ID, "output_index": 0, "content_index": 0,
            "part": {"type": "output_text", "text": text, "annotations": []}}),
                next(),
            ),
        ));
        t.push((355, event("response.output_item.done", json!({"output_index": 0, "item": message(&text, "completed")}), next())));
        t.push((
            360,
            event(
                "response.completed",
                json!({"response": response_object("completed",
            usage(1500, 1024, 6, 0), json!([message(&text, "completed")]))}),
                next(),
            ),
        ));
        t
    }

    /// A complete (non-streamed) response.
    pub fn response() -> String {
        response_object("completed", usage(1500, 1024, 6, 0), json!([message("Why did the chicken cross?", "completed")])).to_string()
    }
}

// ---------------------------------------------------------------------------------------------
// Anthropic Messages
// ---------------------------------------------------------------------------------------------

pub mod messages {
    use super::*;

    pub const PATH: &str = "/v1/messages";
    pub const MODEL: &str = "claude-sonnet-4-5-20250929";
    pub const DELTAS: [&str; 5] = ["Hello", "! I'm", " Claude", ", nice", " to meet you."];

    pub fn request(stream: bool) -> String {
        json!({
            "model": "claude-sonnet-4-5",
            "max_tokens": 1024,
            "system": [{"type": "text", "text": "You are a friendly assistant.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "Hello, Claude"}],
            "stream": stream
        })
        .to_string()
    }

    pub fn event(ty: &str, v: Value) -> String {
        format!("event: {ty}\ndata: {v}\n\n")
    }

    /// `message_start` (25 input, 1000 cache-read tokens), `content_block_start` and a `ping` at
    /// +300 ms, text deltas at +400 … +520 ms (every 30 ms), `content_block_stop` at +525,
    /// `message_delta` (end_turn, 15 output tokens) at +530, `message_stop` at +531.
    pub fn timeline() -> Vec<(u64, String)> {
        let mut t = vec![
            (
                300,
                event(
                    "message_start",
                    json!({"type": "message_start", "message": {
                "id": "msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY", "type": "message", "role": "assistant",
                "content": [], "model": MODEL, "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": 25, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 1000, "output_tokens": 1}}}),
                ),
            ),
            (300, event("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}))),
            (300, event("ping", json!({"type": "ping"}))),
        ];
        for (i, d) in DELTAS.iter().enumerate() {
            t.push((
                400 + 30 * i as u64,
                event("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": d}})),
            ));
        }
        t.push((525, event("content_block_stop", json!({"type": "content_block_stop", "index": 0}))));
        t.push((
            530,
            event(
                "message_delta",
                json!({"type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": {"output_tokens": 15}}),
            ),
        ));
        t.push((531, event("message_stop", json!({"type": "message_stop"}))));
        t
    }

    pub fn response() -> String {
        json!({
            "id": "msg_013Zva2CMHLNnXjNJJKqJ2EF", "type": "message", "role": "assistant", "model": MODEL,
            "content": [{"type": "text", "text": "Hello! I'm Claude, nice to meet you."}],
            "stop_reason": "end_turn", "stop_sequence": null,
            "usage": {"input_tokens": 25, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 1000, "output_tokens": 15}
        })
        .to_string()
    }
}
