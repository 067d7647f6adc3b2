//! API detection from paths and request-body inspection for every API kind.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::json;
use sluice_core::api::ApiKind;
use sluice_core::request::{inspect_request, inspect_request_with_kind, refine_kind, ContextBucket, RequestError, RequestInfo};

fn inspect(kind: ApiKind, v: serde_json::Value) -> RequestInfo {
    inspect_request(kind, v.to_string().as_bytes()).unwrap()
}

#[test]
fn kind_from_path() {
    use ApiKind::*;
    let cases = [
        ("/v1/chat/completions", Some(ChatCompletions)),
        ("/openai/v1/chat/completions", Some(ChatCompletions)),
        ("/v1/chat/completions/", Some(ChatCompletions)),
        ("/v1/chat/completions?api-version=2024-10-21", Some(ChatCompletions)),
        ("/openai/deployments/gpt4/chat/completions?api-version=1", Some(ChatCompletions)),
        ("/v1/completions", Some(Completions)),
        ("/v1/completions#frag", Some(Completions)),
        ("/v1/responses", Some(Responses)),
        ("/v1/responses/", Some(Responses)),
        ("/v1/messages", Some(AnthropicMessages)),
        ("/anthropic/v1/messages?beta=true", Some(AnthropicMessages)),
        ("/v1/messages/count_tokens", None),
        ("/v1/responses/resp_123", None),
        ("/v1/embeddings", None),
        ("/v1/models", None),
        ("/v1/chatcompletions", None),
        ("/v1/xmessages", None),
        ("", None),
        ("/", None),
        ("?", None),
    ];
    for (path, want) in cases {
        assert_eq!(ApiKind::from_path(path), want, "{path}");
    }
}

#[test]
fn kind_labels_round_trip_and_nothing_else_is_a_kind() {
    for kind in ApiKind::ALL {
        assert_eq!(ApiKind::from_label(kind.as_str()), Some(kind));
    }
    for other in ["", "chat", "Messages", "chat_completions ", "anthropic_messages"] {
        assert_eq!(ApiKind::from_label(other), None, "{other:?}");
    }
}

#[test]
fn kind_labels() {
    let labels: Vec<&str> = ApiKind::ALL.iter().map(|k| k.as_str()).collect();
    assert_eq!(labels, ["chat_completions", "completions", "responses", "messages"]);
    assert_eq!(ApiKind::Responses.to_string(), "responses");
}

#[test]
fn chat_request() {
    let body = json!({
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "You are terse."},                     // 14 chars
            {"role": "user", "content": [
                {"type": "text", "text": "What's in this image?"},               // 21
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
            ]},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "describe", "arguments": "{\"x\":1}"}}     // 8 + 7
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a cat"},      // 5
        ],
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": 100,
        "max_completion_tokens": 50,
        "user": "user-1234",
    });
    let info = inspect(ApiKind::ChatCompletions, body);
    assert_eq!(
        info,
        RequestInfo {
            model: Some("gpt-4o-mini".into()),
            stream: true,
            stream_unreadable: false,
            include_usage: true,
            max_output_tokens: Some(50),
            message_count: 4,
            follow_up: true,
            // ceil(55 / 4) = 14, + 4 messages × 4
            prompt_tokens_estimate: 14 + 16,
            user: Some("user-1234".into()),
            has_tools: false,
            output_choices: 1,
        }
    );
}

/// `stream` as latency-guard reads it: a boolean, absent or `null` (no stream asked for), or
/// anything else (unknown: the guard treats the request as a stream).
#[test]
fn stream_member_readable_or_not() {
    let cases = [
        (json!({"stream": true}), true, false),
        (json!({"stream": false}), false, false),
        (json!({}), false, false),
        (json!({"stream": null}), false, false),
        (json!({"stream": "yes"}), false, true),
        (json!({"stream": 1}), false, true),
        (json!({"stream": {"on": true}}), false, true),
    ];
    for (body, stream, unreadable) in cases {
        let info = inspect(ApiKind::ChatCompletions, body.clone());
        assert_eq!((info.stream, info.stream_unreadable), (stream, unreadable), "{body}");
    }
}

/// Every parameter of the supported APIs that multiplies the output a request can produce.
#[test]
fn output_choices_count_every_generation_the_request_can_produce() {
    let cases = [
        (ApiKind::ChatCompletions, json!({"messages": [], "n": 8, "max_tokens": 60}), 8),
        (ApiKind::ChatCompletions, json!({"messages": []}), 1),
        (ApiKind::ChatCompletions, json!({"messages": [], "n": 0}), 1),
        (ApiKind::ChatCompletions, json!({"messages": [], "n": "8"}), 1),
        // best_of candidates are generated (and billed); n of them are returned.
        (ApiKind::Completions, json!({"prompt": "x", "n": 2, "best_of": 5}), 5),
        (ApiKind::Completions, json!({"prompt": "x", "n": 3}), 3),
        // A batch of prompts: each one gets its own generations.
        (ApiKind::Completions, json!({"prompt": ["a", "b", "c"], "n": 2}), 6),
        (ApiKind::Completions, json!({"prompt": [[1, 2], [3]], "best_of": 4}), 8),
        // A flat array of token ids is one prompt.
        (ApiKind::Completions, json!({"prompt": [1, 2, 3], "n": 2}), 2),
        // A chat body posted to a completions path is a chat request (refined): n counts.
        (ApiKind::Completions, json!({"messages": [{"role": "user", "content": "x"}], "n": 4}), 4),
        (ApiKind::Responses, json!({"input": "x", "n": 4}), 1),
        (ApiKind::AnthropicMessages, json!({"messages": [], "n": 4, "max_tokens": 10}), 1),
        (ApiKind::ChatCompletions, json!({"messages": [], "n": u64::MAX}), 1 << 20),
    ];
    for (kind, body, expected) in cases {
        assert_eq!(inspect(kind, body.clone()).output_choices, expected, "{kind:?} {body}");
    }
}

#[test]
fn chat_request_first_turn_with_tools() {
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let tools_chars = tools.to_string().chars().count() as u64;
    let body = json!({
        "model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": tools, "max_tokens": 7, "stream": "yes",
        "stream_options": {"include_usage": "true"},
    });
    let info = inspect(ApiKind::ChatCompletions, body);
    assert!(!info.follow_up);
    assert!(!info.stream, "non-bool stream is not true");
    assert!(!info.include_usage);
    assert_eq!(info.max_output_tokens, Some(7));
    assert_eq!(info.prompt_tokens_estimate, (17 + tools_chars).div_ceil(4) + 4);
    assert_eq!(info.user, None);
}

#[test]
fn estimate_counts_characters_not_bytes() {
    let info = inspect(
        ApiKind::ChatCompletions,
        json!({"messages": [{"role": "user", "content": "héllo wörld 😊😊"}]}), // 14 chars, 20 bytes
    );
    assert_eq!(info.prompt_tokens_estimate, 4 + 4);
}

#[test]
fn completions_request() {
    let info = inspect(
        ApiKind::Completions,
        json!({"model": "gpt-3.5-turbo-instruct", "prompt": "Say this is a test", "max_tokens": 7,
               "temperature": 0, "stream": true}),
    );
    assert_eq!(info.message_count, 1);
    assert_eq!(info.max_output_tokens, Some(7));
    assert!(info.stream);
    assert_eq!(info.prompt_tokens_estimate, 18u64.div_ceil(4) + 4);

    let batch = inspect(ApiKind::Completions, json!({"prompt": ["abcd", "efgh"]}));
    assert_eq!(batch.prompt_tokens_estimate, 2 + 4);
    let ids = inspect(ApiKind::Completions, json!({"prompt": [1, 2, 3, 4, 5]}));
    assert_eq!(ids.prompt_tokens_estimate, 5 + 4, "token ids count exactly");
    let id_batch = inspect(ApiKind::Completions, json!({"prompt": [[1, 2], [3]]}));
    assert_eq!(id_batch.prompt_tokens_estimate, 3 + 4);
}

#[test]
fn responses_request_string_input() {
    let info = inspect(
        ApiKind::Responses,
        json!({"model": "gpt-4.1", "instructions": "Be brief.", "input": "Tell me a joke",
               "max_output_tokens": 256, "stream": true, "user": "u"}),
    );
    assert_eq!(info.message_count, 1);
    assert!(!info.follow_up);
    assert_eq!(info.max_output_tokens, Some(256));
    assert_eq!(info.prompt_tokens_estimate, 23u64.div_ceil(4) + 4);
    assert_eq!(info.user.as_deref(), Some("u"));
}

#[test]
fn responses_request_items() {
    let info = inspect(
        ApiKind::Responses,
        json!({"model": "o4-mini", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "abcd"},
                                         {"type": "input_image", "image_url": "https://x/y.png"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ]}),
    );
    assert_eq!(info.message_count, 3);
    assert!(info.follow_up);
    // "abcd" + "f" + "{}" + "ok" = 9 chars
    assert_eq!(info.prompt_tokens_estimate, 3 + 12);

    let assistant = inspect(
        ApiKind::Responses,
        json!({"input": [{"role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
                         {"role": "user", "content": "again"}]}),
    );
    assert!(assistant.follow_up);
    let chained = inspect(ApiKind::Responses, json!({"input": "next", "previous_response_id": "resp_1"}));
    assert!(chained.follow_up);
}

#[test]
fn anthropic_request() {
    let body = json!({
        "model": "claude-sonnet-4-5",
        "max_tokens": 1024,
        "system": [{"type": "text", "text": "You are a poet.", "cache_control": {"type": "ephemeral"}}], // 15
        "messages": [
            {"role": "user", "content": "Hello"},                                          // 5
            {"role": "assistant", "content": [
                {"type": "text", "text": "Hi"},                                            // 2
                {"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {"a": 1}}   // 4 + 7
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"},         // 1
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
            ]},
        ],
        "metadata": {"user_id": "13803d75-b4b5-4c3e-b2a2-6f21399b021b"},
        "stream": true,
        "user": "ignored-for-anthropic",
    });
    let info = inspect(ApiKind::AnthropicMessages, body);
    assert_eq!(info.model.as_deref(), Some("claude-sonnet-4-5"));
    assert_eq!(info.max_output_tokens, Some(1024));
    assert_eq!(info.message_count, 3);
    assert!(info.follow_up);
    assert!(info.stream);
    assert!(!info.include_usage);
    assert_eq!(info.user.as_deref(), Some("13803d75-b4b5-4c3e-b2a2-6f21399b021b"));
    assert_eq!(info.prompt_tokens_estimate, 34u64.div_ceil(4) + 12);

    let plain = inspect(ApiKind::AnthropicMessages, json!({"system": "abcdefgh", "messages": [{"role": "user", "content": "abcd"}]}));
    assert_eq!(plain.prompt_tokens_estimate, 3 + 4);
    assert!(!plain.follow_up);
}

#[test]
fn request_errors() {
    assert!(matches!(inspect_request(ApiKind::ChatCompletions, b"{\"model\":"), Err(RequestError::NotJson(_))));
    assert!(matches!(inspect_request(ApiKind::ChatCompletions, b"\xff\xfe"), Err(RequestError::NotJson(_))));
    assert_eq!(inspect_request(ApiKind::Responses, b"[1,2]"), Err(RequestError::NotObject));
    assert_eq!(inspect_request(ApiKind::Responses, b"\"str\""), Err(RequestError::NotObject));
    let deep = "[".repeat(10_000);
    assert!(matches!(inspect_request(ApiKind::ChatCompletions, deep.as_bytes()), Err(RequestError::NotJson(_))));
    let msg = inspect_request(ApiKind::ChatCompletions, b"").unwrap_err().to_string();
    assert!(msg.starts_with("request body is not valid JSON: "), "{msg}");
}

#[test]
fn wrong_types_are_treated_as_absent() {
    let info = inspect(ApiKind::ChatCompletions, json!({"model": 5, "messages": "nope", "max_tokens": -1, "user": 3}));
    assert_eq!(info, RequestInfo::default());
}

#[test]
fn refine_kind_rules() {
    let chat_body = json!({"messages": []});
    let prompt_body = json!({"prompt": "x"});
    assert_eq!(refine_kind(ApiKind::Completions, &chat_body), ApiKind::ChatCompletions);
    assert_eq!(refine_kind(ApiKind::ChatCompletions, &prompt_body), ApiKind::Completions);
    assert_eq!(refine_kind(ApiKind::Completions, &prompt_body), ApiKind::Completions);
    assert_eq!(refine_kind(ApiKind::ChatCompletions, &chat_body), ApiKind::ChatCompletions);
    assert_eq!(refine_kind(ApiKind::AnthropicMessages, &prompt_body), ApiKind::AnthropicMessages);
    assert_eq!(refine_kind(ApiKind::Responses, &chat_body), ApiKind::Responses);
    let both = json!({"messages": [], "prompt": "x"});
    assert_eq!(refine_kind(ApiKind::Completions, &both), ApiKind::Completions);

    let (kind, info) = inspect_request_with_kind(ApiKind::Completions, br#"{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":3}"#).unwrap();
    assert_eq!(kind, ApiKind::ChatCompletions);
    assert_eq!(info.message_count, 1);
    assert_eq!(info.max_output_tokens, Some(3));
}

#[test]
fn context_buckets() {
    use ContextBucket::*;
    let cases = [
        (0, UpTo1k),
        (1024, UpTo1k),
        (1025, UpTo2k),
        (2048, UpTo2k),
        (2049, UpTo4k),
        (4096, UpTo4k),
        (8192, UpTo8k),
        (8193, UpTo16k),
        (16384, UpTo16k),
        (16385, Over16k),
        (u64::MAX, Over16k),
    ];
    for (t, b) in cases {
        assert_eq!(ContextBucket::from_tokens(t), b, "{t}");
    }
    let labels: Vec<&str> = [UpTo1k, UpTo2k, UpTo4k, UpTo8k, UpTo16k, Over16k].iter().map(|b| b.as_str()).collect();
    assert_eq!(labels, ["1k", "2k", "4k", "8k", "16k", "over_16k"]);
}

#[test]
fn tool_definitions_are_flagged() {
    let with = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]});
    assert!(inspect(ApiKind::ChatCompletions, with).has_tools);
    let without = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": null});
    assert!(!inspect(ApiKind::ChatCompletions, without).has_tools);
}

#[test]
fn a_body_inspected_again_gives_the_same_answer_and_another_body_its_own() {
    let a = br#"{"model":"a","messages":[{"role":"user","content":"hello"}]}"#;
    let b = br#"{"model":"b","messages":[{"role":"user","content":"hellu"}]}"#;
    let first = inspect_request_with_kind(ApiKind::ChatCompletions, a).unwrap();
    assert_eq!(inspect_request_with_kind(ApiKind::ChatCompletions, a).unwrap(), first);
    // Same length, other bytes: not the remembered answer.
    let other = inspect_request_with_kind(ApiKind::ChatCompletions, b).unwrap();
    assert_eq!(other.1.model.as_deref(), Some("b"));
    // Same bytes, another kind: inspected for that kind.
    let (kind, _) = inspect_request_with_kind(ApiKind::Completions, b).unwrap();
    assert_eq!(kind, ApiKind::ChatCompletions, "a chat body posted to completions is refined, not taken from memory");
    assert!(inspect_request_with_kind(ApiKind::ChatCompletions, b"{\"model\":").is_err());
    assert_eq!(inspect_request_with_kind(ApiKind::ChatCompletions, a).unwrap(), first);
}
