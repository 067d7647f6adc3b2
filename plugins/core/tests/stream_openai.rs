//! OpenAI chat-completions and legacy completions streams: content detection (TTFT), usage chunk
//! variants, estimates when usage is missing, errors and malformed data.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::*;
use sluice_core::api::ApiKind;
use sluice_core::response::{ChunkOutcome, StreamObserver};
use sluice_core::usage::Usage;

const CHAT: ApiKind = ApiKind::ChatCompletions;

fn reported() -> Usage {
    Usage { input_tokens: 19, output_tokens: 10, cached_input_tokens: 0, cache_creation_input_tokens: 0, reasoning_tokens: 0 }
}

#[test]
fn full_stream_with_usage_chunk_empty_choices() {
    let body = chat_stream(&HELLO_TOKENS, Some("[]"));
    let (_, s) = observe_whole(CHAT, body.as_bytes());
    assert_eq!(s.usage, reported());
    assert!(s.usage_reported);
    assert_eq!(s.content_chunks, 10);
    // max(1, ⌊chars/4⌋) per event: each of these one-token events counts exactly 1.
    assert_eq!(s.estimated_output_tokens, 10);
    assert_eq!(s.finish_reason.as_deref(), Some("stop"));
    assert_eq!(s.response_model.as_deref(), Some("gpt-4o-mini-2024-07-18"));
    assert!(s.done);
    assert_eq!(s.malformed_events, 0);
    assert_eq!(s.upstream_error, None);
}

#[test]
fn usage_chunk_with_null_or_nonempty_choices() {
    for choices in [
        "null",
        r#"[{"index":0,"delta":{},"logprobs":null,"finish_reason":null}]"#,
        r#"[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":"stop"}]"#,
    ] {
        let body = chat_stream(&HELLO_TOKENS, Some(choices));
        let (outs, s) = observe_whole(CHAT, body.as_bytes());
        assert_eq!(s.usage, reported(), "{choices}");
        assert_eq!(s.content_chunks, 10, "usage chunk is not content: {choices}");
        assert!(outs[0].usage_seen && outs[0].done);
    }
}

#[test]
fn role_only_first_chunk_is_not_content() {
    let role = chat_chunk(r#"{"role":"assistant","content":"","refusal":null}"#, None);
    let first = chat_chunk(r#"{"content":"Hi"}"#, None);
    let (outs, s) = observe_chunks(CHAT, &[": keep-alive\n\n", &role, ": ping\n\n", &first, "data: [DONE]\n\n"]);
    assert_eq!(first_content(&outs), Some(3), "TTFT is the chunk with \"Hi\"");
    assert_eq!(outs[3], ChunkOutcome { content_events: 1, estimated_tokens: 1, usage_seen: false, done: false });
    assert!(outs[4].done);
    assert_eq!(s.content_chunks, 1);
}

#[test]
fn keepalive_comments_are_not_content() {
    let mut o = StreamObserver::new(CHAT);
    for _ in 0..5 {
        assert_eq!(o.push(b": keep-alive\n\n"), ChunkOutcome::default());
    }
    assert_eq!(o.comments_seen(), 5);
    assert_eq!(o.summary().content_chunks, 0);
}

#[test]
fn tool_call_reasoning_and_refusal_deltas_are_content() {
    let deltas = [
        r#"{"tool_calls":[{"index":0,"id":"call_abc","type":"function","function":{"name":"get_weather","arguments":""}}]}"#,
        r#"{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\":"}}]}"#,
        r#"{"reasoning_content":"Let me think"}"#,
        r#"{"reasoning":"hmm"}"#,
        r#"{"refusal":"I can't"}"#,
        r#"{"content":null,"reasoning_content":null}"#,
        r#"{"tool_calls":[]}"#,
        r#"{"content":"","role":"assistant"}"#,
    ];
    let chunks: Vec<String> = deltas.iter().map(|d| chat_chunk(d, None)).collect();
    let refs: Vec<&str> = chunks.iter().map(String::as_str).collect();
    let (outs, s) = observe_chunks(CHAT, &refs);
    let content: Vec<u32> = outs.iter().map(|o| o.content_events).collect();
    assert_eq!(content, [1, 1, 1, 1, 1, 0, 0, 0, 0]);
    // get_weather (11) → 2; {"city": (8) → 2; "Let me think" (12) → 3; hmm → 1; I can't (7) → 1
    let est: Vec<u32> = outs.iter().map(|o| o.estimated_tokens).collect();
    assert_eq!(est, [2, 2, 3, 1, 1, 0, 0, 0, 0]);
    assert!(!s.usage_reported);
    assert_eq!(s.usage.output_tokens, 9);
}

#[test]
fn missing_usage_falls_back_to_estimate() {
    let body = chat_stream(&["Hello", " world, this is long"], None);
    let (_, s) = observe_whole(CHAT, body.as_bytes());
    assert!(!s.usage_reported);
    assert_eq!(s.estimated_output_tokens, 1 + 5);
    assert_eq!(s.usage, Usage { output_tokens: 6, ..Usage::default() });
    assert!(s.done);
}

#[test]
fn stream_cut_short_has_no_usage_and_is_not_done() {
    let body = chat_stream(&HELLO_TOKENS, Some("[]"));
    let cut = &body.as_bytes()[..body.len() / 2];
    let (_, s) = observe_whole(CHAT, cut);
    assert!(!s.done);
    assert!(!s.usage_reported);
    assert!(s.content_chunks > 0 && s.content_chunks < 10);
    assert_eq!(s.usage.output_tokens, s.estimated_output_tokens);
}

#[test]
fn byte_by_byte_equals_whole() {
    for body in [chat_stream(&HELLO_TOKENS, Some("[]")), chat_stream(&HELLO_TOKENS, None)] {
        let (outs_w, whole) = observe_whole(CHAT, body.as_bytes());
        let (outs_b, bytes) = observe_bytewise(CHAT, body.as_bytes());
        assert_eq!(whole, bytes);
        let sum = |o: &[ChunkOutcome]| o.iter().map(|c| c.content_events).sum::<u32>();
        assert_eq!(sum(&outs_w), sum(&outs_b));
    }
}

#[test]
fn crlf_stream() {
    let body = chat_stream(&HELLO_TOKENS, Some("[]")).replace('\n', "\r\n");
    let (_, s) = observe_bytewise(CHAT, body.as_bytes());
    assert_eq!(s.content_chunks, 10);
    assert!(s.usage_reported && s.done);
}

#[test]
fn cr_only_stream() {
    let body = chat_stream(&HELLO_TOKENS, Some("[]")).replace('\n', "\r");
    let (_, s) = observe_bytewise(CHAT, body.as_bytes());
    assert_eq!(s.content_chunks, 10);
    assert!(s.usage_reported && s.done);
}

#[test]
fn cached_and_reasoning_usage() {
    let usage = r#""usage":{"prompt_tokens":2006,"completion_tokens":300,"total_tokens":2306,"prompt_tokens_details":{"cached_tokens":1920},"completion_tokens_details":{"reasoning_tokens":256}}"#;
    let body = chat_chunk(r#"{"content":"x"}"#, None) + &chat_usage_chunk("[]", usage) + "data: [DONE]\n\n";
    let (_, s) = observe_whole(CHAT, body.as_bytes());
    assert_eq!(s.usage, Usage { input_tokens: 2006, output_tokens: 300, cached_input_tokens: 1920, cache_creation_input_tokens: 0, reasoning_tokens: 256 });
}

#[test]
fn malformed_json_is_counted_not_fatal() {
    let good = chat_chunk(r#"{"content":"ok"}"#, None);
    let (_, s) = observe_chunks(CHAT, &["data: {\"id\":\"x\",\"choices\":[{\n\n", "data: not json\n\n", "data: 42\n\n", &good, "data: [DONE]\n\n"]);
    assert_eq!(s.malformed_events, 3);
    assert_eq!(s.content_chunks, 1);
    assert!(s.done);
}

#[test]
fn mid_stream_error_object() {
    let err = r#"data: {"error":{"message":"The server had an error while processing your request. Sorry about that!","type":"server_error","param":null,"code":null}}"#;
    let (_, s) = observe_chunks(CHAT, &[&chat_chunk(r#"{"content":"Hel"}"#, None), err, "\n\n"]);
    assert_eq!(s.upstream_error.as_deref(), Some("The server had an error while processing your request. Sorry about that!"));
    assert!(!s.done);
    assert_eq!(s.content_chunks, 1);
}

#[test]
fn error_message_is_truncated() {
    let long = "é".repeat(300);
    let body = format!("data: {}\n\n", serde_json::json!({"error": {"message": long}}));
    let (_, s) = observe_whole(CHAT, body.as_bytes());
    let e = s.upstream_error.unwrap();
    assert!(e.len() <= 256 && e.len() >= 254, "{}", e.len());
}

#[test]
fn json_error_body_on_a_streaming_request() {
    let body = br#"{
  "error": {
    "message": "Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Used 29000, Requested 2000.",
    "type": "tokens",
    "param": null,
    "code": "rate_limit_exceeded"
  }
}"#;
    let (_, s) = observe_chunks(CHAT, &[std::str::from_utf8(&body[..40]).unwrap(), std::str::from_utf8(&body[40..]).unwrap()]);
    assert!(s.upstream_error.unwrap().starts_with("Rate limit reached"));
    assert!(!s.done);
    assert_eq!(s.malformed_events, 0);
}

#[test]
fn legacy_completions_stream() {
    let chunk = |text: &str, finish: &str| {
        format!(
            "data: {{\"id\":\"cmpl-7iA7iJjj8V2zOkCGvWF2hAkDWBQZe\",\"object\":\"text_completion\",\"created\":1690759702,\"choices\":[{{\"text\":{},\"index\":0,\"logprobs\":null,\"finish_reason\":{finish}}}],\"model\":\"gpt-3.5-turbo-instruct\",\"system_fingerprint\":null}}\n\n",
            serde_json::to_string(text).unwrap()
        )
    };
    let body = chunk("This", "null")
        + &chunk(" is", "null")
        + &chunk(" a test", "null")
        + &chunk("", "\"length\"")
        + r#"data: {"id":"cmpl-7iA7iJjj8V2zOkCGvWF2hAkDWBQZe","object":"text_completion","created":1690759702,"choices":[],"model":"gpt-3.5-turbo-instruct","usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#
        + "\n\ndata: [DONE]\n\n";
    let (outs, s) = observe_bytewise(ApiKind::Completions, body.as_bytes());
    assert_eq!(outs.iter().map(|o| o.content_events).sum::<u32>(), 3);
    assert_eq!(s.content_chunks, 3);
    assert_eq!(s.estimated_output_tokens, 1 + 1 + 1);
    assert_eq!(s.finish_reason.as_deref(), Some("length"));
    assert_eq!(s.usage, Usage { input_tokens: 5, output_tokens: 7, ..Usage::default() });
    assert!(s.usage_reported && s.done);
    assert_eq!(s.response_model.as_deref(), Some("gpt-3.5-turbo-instruct"));
}

#[test]
fn multiple_events_in_one_chunk_report_together() {
    let body = chat_chunk(r#"{"content":"a"}"#, None) + &chat_chunk(r#"{"content":"bcdefgh"}"#, None);
    let mut o = StreamObserver::new(CHAT);
    assert_eq!(o.push(body.as_bytes()), ChunkOutcome { content_events: 2, estimated_tokens: 2, usage_seen: false, done: false });
}

#[test]
fn oversized_event_is_counted() {
    let huge = chat_chunk(&serde_json::json!({"content": "x".repeat(4000)}).to_string(), None);
    let small = chat_chunk(r#"{"content":"y"}"#, None);
    let mut o = StreamObserver::with_max_event_bytes(CHAT, 1024);
    o.push(huge.as_bytes());
    o.push(small.as_bytes());
    o.finish();
    let s = o.summary();
    assert_eq!(s.overflowed_events, 1);
    assert_eq!(s.content_chunks, 1);
}
