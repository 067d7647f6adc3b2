//! Non-streaming (complete JSON) response bodies for every API kind.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use sluice_core::api::ApiKind;
use sluice_core::response::inspect_response_body;
use sluice_core::usage::Usage;

#[test]
fn chat_completion() {
    let body = br#"{
  "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
  "object": "chat.completion",
  "created": 1741570283,
  "model": "gpt-4o-2024-08-06",
  "choices": [
    {
      "index": 0,
      "message": {
        "role": "assistant",
        "content": "The image shows a wooden boardwalk path.",
        "refusal": null,
        "annotations": []
      },
      "logprobs": null,
      "finish_reason": "stop"
    }
  ],
  "usage": {
    "prompt_tokens": 1117,
    "completion_tokens": 46,
    "total_tokens": 1163,
    "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
  },
  "service_tier": "default",
  "system_fingerprint": "fp_fc9f1d7035"
}"#;
    let s = inspect_response_body(ApiKind::ChatCompletions, body);
    assert_eq!(s.usage, Usage { input_tokens: 1117, output_tokens: 46, cached_input_tokens: 1024, ..Usage::default() });
    assert!(s.usage_reported && s.done);
    assert_eq!(s.finish_reason.as_deref(), Some("stop"));
    assert_eq!(s.response_model.as_deref(), Some("gpt-4o-2024-08-06"));
    assert_eq!(s.content_chunks, 1);
    assert_eq!(s.estimated_output_tokens, 40u64.div_ceil(4));
}

#[test]
fn chat_completion_tool_calls_without_usage() {
    let body = br#"{"id":"chatcmpl-1","object":"chat.completion","model":"qwen","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},"finish_reason":"tool_calls"}]}"#;
    let s = inspect_response_body(ApiKind::ChatCompletions, body);
    assert!(!s.usage_reported);
    assert_eq!(s.estimated_output_tokens, (11u64 + 16).div_ceil(4));
    assert_eq!(s.usage.output_tokens, s.estimated_output_tokens);
    assert_eq!(s.finish_reason.as_deref(), Some("tool_calls"));
}

#[test]
fn legacy_completion() {
    let body = br#"{"id":"cmpl-uqkvlQyYK7bGYrRHQ0eXlWi7","object":"text_completion","created":1589478378,"model":"gpt-3.5-turbo-instruct","system_fingerprint":"fp_44709d6fcb","choices":[{"text":"\n\nThis is indeed a test","index":0,"logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#;
    let s = inspect_response_body(ApiKind::Completions, body);
    assert_eq!(s.usage, Usage { input_tokens: 5, output_tokens: 7, ..Usage::default() });
    assert_eq!(s.finish_reason.as_deref(), Some("length"));
    assert_eq!(s.estimated_output_tokens, 6);
}

#[test]
fn responses_object() {
    let body = br#"{
  "id": "resp_67ccd3a9da748190baa7f1570fe91ac604becb25c45c1d41",
  "object": "response",
  "created_at": 1741476777,
  "status": "completed",
  "error": null,
  "incomplete_details": null,
  "model": "gpt-4o-2024-08-06",
  "output": [
    {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "abcd"}]},
    {
      "type": "message",
      "id": "msg_67ccd3acc8d48190a77525dc6de64b4104becb25c45c1d41",
      "status": "completed",
      "role": "assistant",
      "content": [{"type": "output_text", "text": "The image depicts a scenic landscape.", "annotations": []}]
    },
    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": "{}"}
  ],
  "usage": {"input_tokens": 328, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 52, "output_tokens_details": {"reasoning_tokens": 20}, "total_tokens": 380}
}"#;
    let s = inspect_response_body(ApiKind::Responses, body);
    assert_eq!(s.usage, Usage { input_tokens: 328, output_tokens: 52, reasoning_tokens: 20, ..Usage::default() });
    assert_eq!(s.finish_reason.as_deref(), Some("completed"));
    assert_eq!(s.estimated_output_tokens, (4u64 + 37 + 1 + 2).div_ceil(4));
    assert!(s.done);
}

#[test]
fn anthropic_message() {
    let body = br#"{"id":"msg_013Zva2CMHLNnXjNJJKqJ2EF","type":"message","role":"assistant","model":"claude-sonnet-4-5-20250929","content":[{"type":"text","text":"Hi! My name is Claude."}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":2095,"output_tokens":503,"cache_creation_input_tokens":2051,"cache_read_input_tokens":4}}"#;
    let s = inspect_response_body(ApiKind::AnthropicMessages, body);
    assert_eq!(
        s.usage,
        Usage { input_tokens: 2095 + 2051 + 4, output_tokens: 503, cached_input_tokens: 4, cache_creation_input_tokens: 2051, reasoning_tokens: 0 }
    );
    assert!(s.usage_reported && s.done);
    assert_eq!(s.finish_reason.as_deref(), Some("end_turn"));
    assert_eq!(s.estimated_output_tokens, 6);
}

#[test]
fn error_bodies() {
    let anthropic = br#"{"type":"error","error":{"type":"rate_limit_error","message":"Number of request tokens has exceeded your per-minute rate limit"},"request_id":"req_011CSHoEeqs5C35K2UUqR7Fy"}"#;
    let s = inspect_response_body(ApiKind::AnthropicMessages, anthropic);
    assert_eq!(s.upstream_error.as_deref(), Some("Number of request tokens has exceeded your per-minute rate limit"));
    assert!(!s.done);
    let openai = br#"{"error":{"message":"Incorrect API key provided","type":"invalid_request_error","param":null,"code":"invalid_api_key"}}"#;
    let s = inspect_response_body(ApiKind::ChatCompletions, openai);
    assert_eq!(s.upstream_error.as_deref(), Some("Incorrect API key provided"));
}

#[test]
fn not_json() {
    let s = inspect_response_body(ApiKind::ChatCompletions, b"<html>502 Bad Gateway</html>");
    assert_eq!(s.malformed_events, 1);
    assert!(!s.done);
    let s = inspect_response_body(ApiKind::ChatCompletions, b"");
    assert_eq!(s.malformed_events, 1);
    let s = inspect_response_body(ApiKind::ChatCompletions, b"[1]");
    assert_eq!(s.malformed_events, 1);
}

#[test]
fn sse_body_is_parsed_as_a_stream() {
    let body = common::chat_stream(&common::HELLO_TOKENS, Some("[]"));
    let s = inspect_response_body(ApiKind::ChatCompletions, body.as_bytes());
    assert_eq!(s.content_chunks, 10);
    assert!(s.usage_reported && s.done);
}
