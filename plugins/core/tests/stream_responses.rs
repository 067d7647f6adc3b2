//! OpenAI Responses API streams: typed events, usage from response.completed / incomplete / failed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::*;
use sluice_core::api::ApiKind;
use sluice_core::response::StreamObserver;
use sluice_core::usage::Usage;

const R: ApiKind = ApiKind::Responses;

#[test]
fn full_stream() {
    let body = responses_stream(&["Hi", " there", "!"]);
    let (outs, s) = observe_whole(R, body.as_bytes());
    assert_eq!(outs[0].content_events, 3);
    assert!(outs[0].usage_seen && outs[0].done);
    assert_eq!(s.content_chunks, 3);
    assert_eq!(s.estimated_output_tokens, 1 + 1 + 1);
    assert_eq!(s.usage, Usage { input_tokens: 37, output_tokens: 11, cached_input_tokens: 12, cache_creation_input_tokens: 0, reasoning_tokens: 4 });
    assert!(s.usage_reported && s.done);
    assert_eq!(s.finish_reason.as_deref(), Some("completed"));
    assert_eq!(s.response_model.as_deref(), Some("gpt-4.1-2025-04-14"));
    assert_eq!(s.malformed_events, 0);
}

#[test]
fn setup_events_are_not_content() {
    let body = responses_stream(&["Hi"]);
    let mut o = StreamObserver::new(R);
    let mut first = None;
    for (i, event) in body.split_inclusive("\n\n").enumerate() {
        if o.push(event.as_bytes()).content_events > 0 && first.is_none() {
            first = Some((i, event.to_owned()));
        }
    }
    let (i, event) = first.unwrap();
    assert_eq!(i, 4, "created, in_progress, output_item.added, content_part.added come first");
    assert!(event.starts_with("event: response.output_text.delta\n"));
}

#[test]
fn byte_by_byte_equals_whole() {
    let body = responses_stream(&["Hello", " 😊", "!"]);
    assert_eq!(observe_whole(R, body.as_bytes()).1, observe_bytewise(R, body.as_bytes()).1);
}

#[test]
fn reasoning_function_call_and_refusal_deltas() {
    let events = [
        r#"{"type":"response.reasoning_summary_text.delta","item_id":"rs_1","output_index":0,"summary_index":0,"delta":"**Thinking**"}"#,
        r#"{"type":"response.reasoning_text.delta","item_id":"rs_1","output_index":0,"content_index":0,"delta":"a"}"#,
        r#"{"type":"response.function_call_arguments.delta","item_id":"fc_1","output_index":1,"delta":"{\"location\":"}"#,
        r#"{"type":"response.refusal.delta","item_id":"msg_1","output_index":2,"content_index":0,"delta":"No"}"#,
        r#"{"type":"response.output_text.delta","item_id":"msg_1","output_index":2,"content_index":0,"delta":""}"#,
        r#"{"type":"response.output_text.done","item_id":"msg_1","output_index":2,"content_index":0,"text":"full text"}"#,
        r#"{"type":"response.function_call_arguments.done","item_id":"fc_1","output_index":1,"arguments":"{}"}"#,
    ];
    let chunks: Vec<String> = events.iter().map(|e| format!("data: {e}\n\n")).collect();
    let refs: Vec<&str> = chunks.iter().map(String::as_str).collect();
    let (outs, s) = observe_chunks(R, &refs);
    let content: Vec<u32> = outs.iter().map(|o| o.content_events).collect();
    assert_eq!(content, [1, 1, 1, 1, 0, 0, 0, 0]);
    assert_eq!(s.estimated_output_tokens, 3 + 1 + 3 + 1);
    assert!(!s.usage_reported);
    assert!(!s.done);
}

#[test]
fn event_type_from_event_line_when_data_lacks_it() {
    let (_, s) = observe_chunks(R, &["event: response.output_text.delta\ndata: {\"delta\":\"abc\"}\n\n"]);
    assert_eq!(s.content_chunks, 1);
}

#[test]
fn incomplete_response() {
    let body = concat!(
        "event: response.output_text.delta\n",
        "data: {\"type\":\"response.output_text.delta\",\"delta\":\"Once upon\"}\n\n",
        "event: response.incomplete\n",
        "data: {\"type\":\"response.incomplete\",\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"incomplete\",",
        "\"incomplete_details\":{\"reason\":\"max_output_tokens\"},\"model\":\"o4-mini-2025-04-16\",",
        "\"usage\":{\"input_tokens\":12,\"input_tokens_details\":{\"cached_tokens\":0},\"output_tokens\":16,",
        "\"output_tokens_details\":{\"reasoning_tokens\":14},\"total_tokens\":28}}}\n\n",
    );
    let (_, s) = observe_bytewise(R, body.as_bytes());
    assert_eq!(s.finish_reason.as_deref(), Some("max_output_tokens"));
    assert_eq!(s.usage.output_tokens, 16);
    assert_eq!(s.usage.reasoning_tokens, 14);
    assert!(s.done && s.usage_reported);
    assert_eq!(s.upstream_error, None);
}

#[test]
fn failed_response() {
    let body = concat!(
        "event: response.failed\n",
        "data: {\"type\":\"response.failed\",\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"failed\",",
        "\"error\":{\"code\":\"server_error\",\"message\":\"The model failed to generate a response.\"},",
        "\"incomplete_details\":null,\"model\":\"gpt-4.1\",\"usage\":null}}\n\n",
    );
    let (_, s) = observe_whole(R, body.as_bytes());
    assert_eq!(s.upstream_error.as_deref(), Some("The model failed to generate a response."));
    assert_eq!(s.finish_reason.as_deref(), Some("failed"));
    assert!(s.done);
    assert!(!s.usage_reported);
}

#[test]
fn error_event() {
    let body =
        "event: error\ndata: {\"type\":\"error\",\"code\":\"ERR_SOMETHING\",\"message\":\"Something went wrong\",\"param\":null,\"sequence_number\":1}\n\n";
    let (_, s) = observe_whole(R, body.as_bytes());
    assert_eq!(s.upstream_error.as_deref(), Some("Something went wrong"));
    assert!(!s.done);
}
