//! Output-quality signals read from real response shapes: the repetition figure of every API kind's
//! stream and whole body (only the visible text counts), a word split across events, escapes, and
//! which finished requests give quality samples.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::*;
use sluice_core::api::ApiKind;
use sluice_core::quality::Repetition;
use sluice_core::report::{Labels, Outcome, RequestRecord};
use sluice_core::response::inspect_response_body;

/// The figure `Repetition` gives the plain text, for comparison.
fn figure_of(text: &str) -> Option<u64> {
    let mut r = Repetition::default();
    r.push_text(text);
    r.finish();
    r.figure().map(|f| f.per_mille)
}

/// "I am sorry." looped, as one token per event (the leading space on the token, as servers send).
fn looped_tokens() -> Vec<String> {
    let mut tokens = Vec::new();
    for i in 0..30 {
        for w in ["I", "am", "sorry."] {
            tokens.push(if i == 0 && w == "I" { w.to_string() } else { format!(" {w}") });
        }
    }
    tokens
}

#[test]
fn a_looped_phrase_reads_the_same_in_every_api_kind_and_on_both_paths() {
    let tokens = looped_tokens();
    let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
    let text: String = tokens.concat();
    let want = figure_of(&text);
    // 90 words, 88 trigrams, 3 distinct: 85 repeats.
    assert_eq!(want, Some(85 * 1000 / 88));
    let cases = [
        (ApiKind::ChatCompletions, chat_stream(&refs, Some("[]"))),
        (ApiKind::AnthropicMessages, anthropic_stream(&refs)),
        (ApiKind::Responses, responses_stream(&refs)),
    ];
    for (kind, body) in cases {
        let (_, whole) = observe_whole(kind, body.as_bytes());
        assert_eq!(whole.repetition.map(|r| r.per_mille), want, "{kind:?} whole");
        // Byte by byte: words split across reads and events are still one word each.
        let (_, bytewise) = observe_bytewise(kind, body.as_bytes());
        assert_eq!(bytewise.repetition, whole.repetition, "{kind:?} bytewise");
    }
}

#[test]
fn an_honest_answer_measures_zero() {
    let tokens: Vec<String> = (0..40).map(|i| format!(" token{i}")).collect();
    let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
    let (_, s) = observe_whole(ApiKind::ChatCompletions, chat_stream(&refs, None).as_bytes());
    assert_eq!(s.repetition.map(|r| (r.per_mille, r.exact)), Some((0, true)));
}

#[test]
fn escaped_text_in_the_fast_path_reads_as_decoded() {
    // Quotes, newlines and a non-ASCII letter escaped, as JSON encoders write them.
    let tokens = ["caf\u{e9}", " \"au", " lait\"\n"];
    let mut deltas = Vec::new();
    for _ in 0..8 {
        deltas.extend_from_slice(&tokens);
    }
    let mut body = String::new();
    for t in &deltas {
        let delta = serde_json::json!({ "content": t }).to_string().replace('\u{e9}', "\\u00e9");
        body.push_str(&chat_chunk(&delta, None));
    }
    body.push_str("data: [DONE]\n\n");
    assert!(body.contains("\\u00e9") && body.contains("\\n"));
    let (_, s) = observe_whole(ApiKind::ChatCompletions, body.as_bytes());
    assert_eq!(s.repetition.map(|r| r.per_mille), figure_of(&deltas.concat()));
    // "café au lait" × 8: 24 words, 22 trigrams, 3 distinct.
    assert_eq!(s.repetition.unwrap().per_mille, 19 * 1000 / 22);
}

#[test]
fn reasoning_tool_calls_and_thinking_are_not_read() {
    // A reasoning loop with a short distinct answer: only the answer is text.
    let mut body = String::new();
    for _ in 0..30 {
        body.push_str(&chat_chunk(r#"{"reasoning_content":" let me think"}"#, None));
    }
    for i in 0..20 {
        body.push_str(&chat_chunk(&format!(r#"{{"content":" answer{i}"}}"#), None));
    }
    body.push_str("data: [DONE]\n\n");
    let (_, s) = observe_whole(ApiKind::ChatCompletions, body.as_bytes());
    assert_eq!(s.repetition.map(|r| r.per_mille), Some(0));
    assert_eq!(s.content_chunks, 50);

    // Anthropic thinking deltas are content (TTFT) but not text.
    let mut a = String::new();
    for _ in 0..30 {
        let data = serde_json::json!({"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":" hmm hmm hmm"}});
        a.push_str(&format!("event: content_block_delta\ndata: {data}\n\n"));
    }
    a.push_str("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
    let (_, s) = observe_whole(ApiKind::AnthropicMessages, a.as_bytes());
    assert_eq!(s.content_chunks, 30);
    assert_eq!(s.repetition, None);
}

#[test]
fn whole_bodies_of_every_kind_are_read() {
    let text = "the same words again and ".repeat(6);
    let want = figure_of(&text);
    assert!(want.unwrap() > 500);
    let chat = serde_json::json!({"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":text},"finish_reason":"stop"}]});
    let completions = serde_json::json!({"id":"c","object":"text_completion","model":"m","choices":[{"index":0,"text":text,"finish_reason":"length"}]});
    let responses = serde_json::json!({"id":"r","object":"response","status":"completed","model":"m","output":[
        {"type":"reasoning","summary":[{"type":"summary_text","text":"x x x x x x x x x x x x x x"}]},
        {"type":"message","role":"assistant","content":[{"type":"output_text","text":text}]}]});
    let anthropic = serde_json::json!({"id":"m","type":"message","model":"m","content":[{"type":"thinking","thinking":"y y y y y y y y y y y y y y y y"},{"type":"text","text":text}],"stop_reason":"end_turn"});
    for (kind, body) in
        [(ApiKind::ChatCompletions, chat), (ApiKind::Completions, completions), (ApiKind::Responses, responses), (ApiKind::AnthropicMessages, anthropic)]
    {
        let s = inspect_response_body(kind, body.to_string().as_bytes());
        assert_eq!(s.repetition.map(|r| r.per_mille), want, "{kind:?}");
    }
}

fn record(status: u16, outcome: Outcome, finish: Option<&str>, content_chunks: u64) -> RequestRecord {
    let mut r = RequestRecord {
        labels: Labels {
            model_version: "v2".into(),
            tenant: "acme".into(),
            api: "chat_completions".into(),
            ctx: "1k".into(),
            turn: "first".into(),
            stream: "true".into(),
        },
        status,
        outcome,
        ..Default::default()
    };
    r.response.finish_reason = finish.map(String::from);
    r.response.content_chunks = content_chunks;
    r.response.usage.output_tokens = 7;
    r.response.usage_reported = true;
    r.response.repetition = Some(sluice_core::quality::RepetitionFigure { per_mille: 250, exact: true });
    r
}

fn quality_samples(r: &RequestRecord) -> Vec<(String, u64)> {
    r.samples().into_iter().filter(|s| s.name.starts_with("sluice.quality.")).map(|s| (s.name, s.value)).collect()
}

#[test]
fn only_whole_answers_are_judged() {
    let done = record(200, Outcome::Completed, Some("stop"), 7);
    assert_eq!(
        quality_samples(&done),
        vec![
            ("sluice.quality.output_tokens.model_version.v2.finish.stop".to_string(), 7),
            ("sluice.quality.repetition_per_mille.model_version.v2".to_string(), 250),
        ]
    );
    assert!(done.stamp_json().ends_with(",\"repetition_per_mille\":250}"));
    let cut = record(200, Outcome::Completed, Some("length"), 0);
    assert_eq!(
        quality_samples(&cut),
        vec![
            ("sluice.quality.output_tokens.model_version.v2.finish.length".to_string(), 7),
            ("sluice.quality.repetition_per_mille.model_version.v2".to_string(), 250),
            ("sluice.quality.degenerate_answers_total.model_version.v2.reason.empty".to_string(), 1),
            ("sluice.quality.degenerate_answers_total.model_version.v2.reason.truncated".to_string(), 1),
        ]
    );
    // A refusal, a deadline, an upstream error, a client that left, a 4xx: nothing judged.
    for r in [
        record(429, Outcome::Refused, None, 0),
        record(200, Outcome::Deadline, None, 3),
        record(200, Outcome::UpstreamError, Some("stop"), 3),
        record(200, Outcome::ClientDisconnect, None, 3),
        record(400, Outcome::Completed, None, 0),
    ] {
        assert_eq!(quality_samples(&r), vec![], "{} {:?}", r.status, r.outcome);
    }
}
