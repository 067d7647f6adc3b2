//! Anthropic Messages streams: cumulative usage, cache tokens, content block deltas, ping and errors.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::*;
use sluice_core::api::ApiKind;
use sluice_core::usage::Usage;

const A: ApiKind = ApiKind::AnthropicMessages;

#[test]
fn full_stream() {
    let body = anthropic_stream(&["Hello", "!", " How can I", " help?"]);
    let (_, s) = observe_whole(A, body.as_bytes());
    assert_eq!(
        s.usage,
        Usage { input_tokens: 25 + 2000 + 100, output_tokens: 15, cached_input_tokens: 2000, cache_creation_input_tokens: 100, reasoning_tokens: 0 }
    );
    assert!(s.usage_reported && s.done);
    assert_eq!(s.content_chunks, 4);
    assert_eq!(s.estimated_output_tokens, 1 + 1 + 2 + 1);
    assert_eq!(s.finish_reason.as_deref(), Some("end_turn"));
    assert_eq!(s.response_model.as_deref(), Some("claude-sonnet-4-5-20250929"));
    assert_eq!(s.malformed_events, 0);
}

#[test]
fn first_content_is_the_first_text_delta() {
    let body = anthropic_stream(&["Hi"]);
    let events: Vec<&str> = body.split_inclusive("\n\n").collect();
    let (outs, _) = observe_chunks(A, &events);
    // message_start, content_block_start (empty text), ping, then the delta.
    assert_eq!(first_content(&outs), Some(3));
    assert!(outs[5].usage_seen, "message_delta carries usage");
    assert!(outs[6].done, "message_stop");
}

#[test]
fn byte_by_byte_and_crlf() {
    let body = anthropic_stream(&["Hello", " world"]);
    let whole = observe_whole(A, body.as_bytes()).1;
    assert_eq!(observe_bytewise(A, body.as_bytes()).1, whole);
    assert_eq!(observe_bytewise(A, body.replace('\n', "\r\n").as_bytes()).1, whole);
}

#[test]
fn message_delta_output_is_cumulative_take_last() {
    let body = concat!(
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"model\":\"claude-x\",\"usage\":{\"input_tokens\":10,\"output_tokens\":1}}}\n\n",
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"a\"}}\n\n",
        "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":null},\"usage\":{\"output_tokens\":40}}\n\n",
        "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\"},\"usage\":{\"output_tokens\":100}}\n\n",
        "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
    );
    let (_, s) = observe_whole(A, body.as_bytes());
    assert_eq!(s.usage.output_tokens, 100, "not 1 + 40 + 100");
    assert_eq!(s.usage.input_tokens, 10);
    assert_eq!(s.finish_reason.as_deref(), Some("max_tokens"));
}

#[test]
fn message_delta_with_full_cumulative_usage_overrides_start() {
    let body = concat!(
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":10,\"cache_read_input_tokens\":0,\"output_tokens\":1}}}\n\n",
        "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"input_tokens\":12,\"cache_read_input_tokens\":5,\"cache_creation_input_tokens\":0,\"output_tokens\":7}}\n\n",
    );
    let (_, s) = observe_whole(A, body.as_bytes());
    assert_eq!(s.usage, Usage { input_tokens: 17, output_tokens: 7, cached_input_tokens: 5, ..Usage::default() });
}

#[test]
fn tool_use_and_thinking_deltas() {
    let body = concat!(
        "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"thinking\",\"thinking\":\"\"}}\n\n",
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"thinking_delta\",\"thinking\":\"Let me solve this\"}}\n\n",
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"signature_delta\",\"signature\":\"EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds\"}}\n\n",
        "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_01T1x1fJ34qAmk2tNTrN7Up6\",\"name\":\"get_weather\",\"input\":{}}}\n\n",
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"\"}}\n\n",
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"location\\\": \\\"San Fra\"}}\n\n",
    );
    let events: Vec<&str> = body.split_inclusive("\n\n").collect();
    let (outs, s) = observe_chunks(A, &events);
    let content: Vec<u32> = outs.iter().map(|o| o.content_events).collect();
    assert_eq!(content, [0, 1, 0, 0, 0, 1, 0]);
    assert_eq!(s.estimated_output_tokens, 4 + 5);
    assert!(!s.usage_reported, "no message_delta: output is the estimate");
    assert_eq!(s.usage.output_tokens, 9);
}

#[test]
fn cut_after_message_start_keeps_input_and_estimates_output() {
    let body = anthropic_stream(&["Hello", " world"]);
    let cut = body.find("event: content_block_stop").unwrap();
    let (_, s) = observe_whole(A, &body.as_bytes()[..cut]);
    assert!(!s.usage_reported);
    assert!(!s.done);
    assert_eq!(s.usage.input_tokens, 2125, "message_start input is real");
    assert_eq!(s.usage.output_tokens, 1 + 1);
}

#[test]
fn error_event() {
    let body = concat!(
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":10,\"output_tokens\":1}}}\n\n",
        "event: ping\ndata: {\"type\": \"ping\"}\n\n",
        "event: error\ndata: {\"type\": \"error\", \"error\": {\"type\": \"overloaded_error\", \"message\": \"Overloaded\"}}\n\n",
    );
    let (_, s) = observe_whole(A, body.as_bytes());
    assert_eq!(s.upstream_error.as_deref(), Some("Overloaded"));
    assert!(!s.done);
    assert_eq!(s.content_chunks, 0);
}

#[test]
fn unterminated_last_event_is_dispatched_at_finish() {
    let body = anthropic_stream(&["Hi"]);
    let trimmed = body.trim_end();
    let (_, s) = observe_whole(A, trimmed.as_bytes());
    assert!(s.done, "message_stop without its blank line still counts at end of stream");
}
