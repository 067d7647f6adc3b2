//! Request body rewrites and the include_usage stripper.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use proptest::prelude::*;
use serde_json::{json, Value};
use sluice_core::api::ApiKind;
use sluice_core::request::inspect_request_with_kind;
use sluice_core::rewrite::{rewrite_request, set_top_level_string, RequestRewrite, RewriteError, UsageChunkStripper};

fn rw(kind: ApiKind, body: &str, inject: bool, max: Option<u64>) -> RequestRewrite {
    rewrite_request(kind, body.as_bytes(), inject, max).unwrap()
}

fn body_str(r: &RequestRewrite) -> &str {
    std::str::from_utf8(&r.body).unwrap()
}

// ------------------------------------------------------------------------------------------------
// rewrite_request
// ------------------------------------------------------------------------------------------------

#[test]
fn injects_include_usage_for_streaming_chat_and_completions() {
    for kind in [ApiKind::ChatCompletions, ApiKind::Completions] {
        let r = rw(kind, r#"{"model":"m","stream":true}"#, true, None);
        assert!(r.injected_include_usage);
        assert!(r.changed);
        assert_eq!(body_str(&r), r#"{"model":"m","stream":true,"stream_options":{"include_usage":true}}"#);
    }
}

#[test]
fn keeps_other_stream_options_and_flips_false() {
    let cases = [
        (
            r#"{"stream":true,"stream_options":{"continuous_usage_stats":false}}"#,
            r#"{"stream":true,"stream_options":{"continuous_usage_stats":false,"include_usage":true}}"#,
        ),
        (r#"{"stream":true,"stream_options":{"include_usage":false,"x":1}}"#, r#"{"stream":true,"stream_options":{"include_usage":true,"x":1}}"#),
        (r#"{"stream":true,"stream_options":{ }}"#, r#"{"stream":true,"stream_options":{"include_usage":true }}"#),
        (r#"{"stream_options":null,"stream":true}"#, r#"{"stream_options":{"include_usage":true},"stream":true}"#),
        (r#"{"stream":true,"stream_options":{"include_usage":null}}"#, r#"{"stream":true,"stream_options":{"include_usage":true}}"#),
    ];
    for (input, want) in cases {
        let r = rw(ApiKind::ChatCompletions, input, true, None);
        assert!(r.injected_include_usage, "{input}");
        assert_eq!(body_str(&r), want);
    }
}

#[test]
fn no_injection_when_not_needed_or_not_applicable() {
    let unchanged = [
        (ApiKind::ChatCompletions, r#"{"stream":true,"stream_options":{"include_usage":true}}"#),
        (ApiKind::ChatCompletions, r#"{"stream":false}"#),
        (ApiKind::ChatCompletions, r#"{"model":"m"}"#),
        (ApiKind::ChatCompletions, r#"{"stream":"true"}"#),
        (ApiKind::ChatCompletions, r#"{"stream":true,"stream_options":"weird"}"#),
        (ApiKind::Completions, r#"{"stream":1}"#),
        (ApiKind::Responses, r#"{"stream":true}"#),
        (ApiKind::AnthropicMessages, r#"{"stream":true}"#),
        // Last duplicate wins for the decision.
        (ApiKind::ChatCompletions, r#"{"stream":true,"stream":false}"#),
    ];
    for (kind, body) in unchanged {
        let r = rw(kind, body, true, None);
        assert!(!r.injected_include_usage, "{kind} {body}");
        assert!(!r.changed);
        assert_eq!(body_str(&r), body);
    }
    // Not asked to inject.
    let r = rw(ApiKind::ChatCompletions, r#"{"stream":true}"#, false, None);
    assert!(!r.injected_include_usage && !r.changed);
}

#[test]
fn injection_edits_every_duplicate_stream_options() {
    let r = rw(ApiKind::ChatCompletions, r#"{"stream":true,"stream_options":{"include_usage":true},"stream_options":{}}"#, true, None);
    assert!(r.injected_include_usage);
    assert_eq!(body_str(&r), r#"{"stream":true,"stream_options":{"include_usage":true},"stream_options":{"include_usage":true}}"#);
}

#[test]
fn output_limit_field_per_kind() {
    let cases = [
        (ApiKind::ChatCompletions, r#"{"model":"m"}"#, r#"{"model":"m","max_tokens":100}"#),
        (ApiKind::ChatCompletions, r#"{"max_tokens":5000,"model":"m"}"#, r#"{"max_tokens":100,"model":"m"}"#),
        (ApiKind::ChatCompletions, r#"{"max_completion_tokens":5000}"#, r#"{"max_completion_tokens":100}"#),
        (ApiKind::ChatCompletions, r#"{"max_completion_tokens":5000,"max_tokens":9}"#, r#"{"max_completion_tokens":100,"max_tokens":100}"#),
        (ApiKind::Completions, r#"{"prompt":"p"}"#, r#"{"prompt":"p","max_tokens":100}"#),
        (ApiKind::Completions, r#"{"max_completion_tokens":5,"max_tokens":null}"#, r#"{"max_completion_tokens":5,"max_tokens":100}"#),
        (ApiKind::Responses, r#"{"input":"x"}"#, r#"{"input":"x","max_output_tokens":100}"#),
        (ApiKind::Responses, r#"{"max_output_tokens": 4096 ,"input":"x"}"#, r#"{"max_output_tokens": 100 ,"input":"x"}"#),
        (ApiKind::AnthropicMessages, r#"{"max_tokens":1024,"messages":[]}"#, r#"{"max_tokens":100,"messages":[]}"#),
        (ApiKind::AnthropicMessages, r#"{}"#, r#"{"max_tokens":100}"#),
        (ApiKind::AnthropicMessages, r#" { } "#, r#" {"max_tokens":100 } "#),
    ];
    for (kind, input, want) in cases {
        let r = rw(kind, input, false, Some(100));
        assert_eq!(body_str(&r), want, "{kind} {input}");
        assert_eq!(r.max_output_tokens_set, Some(100));
        assert!(!r.injected_include_usage);
    }
    let r = rw(ApiKind::AnthropicMessages, r#"{"max_tokens":100}"#, false, Some(100));
    assert!(!r.changed);
    let r = rw(ApiKind::AnthropicMessages, r#"{"max_tokens":100}"#, false, None);
    assert_eq!(r.max_output_tokens_set, None);
}

#[test]
fn duplicate_and_escaped_limit_keys_are_all_capped() {
    let r = rw(ApiKind::ChatCompletions, r#"{"max_tokens":10,"max_tokens":100000}"#, false, Some(50));
    assert_eq!(body_str(&r), r#"{"max_tokens":50,"max_tokens":50}"#);
    // An escaped spelling of the key is the same key to the upstream.
    let r = rw(ApiKind::ChatCompletions, r#"{"max\u005ftokens":100000}"#, false, Some(50));
    assert_eq!(body_str(&r), r#"{"max\u005ftokens":50}"#);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["max_tokens"], 50);
    // Nested keys with the same name are not touched.
    let r = rw(ApiKind::ChatCompletions, r#"{"metadata":{"max_tokens":7}}"#, false, Some(50));
    assert_eq!(body_str(&r), r#"{"metadata":{"max_tokens":7},"max_tokens":50}"#);
}

#[test]
fn both_edits_together_and_pretty_body_kept() {
    let input = "{\n  \"model\": \"gpt-4o\",\n  \"stream\": true,\n  \"max_tokens\": 4096,\n  \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]\n}\n";
    let r = rw(ApiKind::ChatCompletions, input, true, Some(256));
    assert!(r.injected_include_usage);
    assert_eq!(
        body_str(&r),
        "{\n  \"model\": \"gpt-4o\",\n  \"stream\": true,\n  \"max_tokens\": 256,\n  \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}],\"stream_options\":{\"include_usage\":true}\n}\n"
    );
}

#[test]
fn everything_else_round_trips_byte_for_byte() {
    let huge = "é\\\"x😊".repeat(200_000);
    let input = format!(
        r#"{{"model":"m","big":123456789012345678901234567890,"inf":1e400,"tiny":-1E-400,"f":1.0,"z":-0,"s":"{huge}","u":"\u00e9\ud83d\ude0a\n\t\"\\\/","nested":{{"a":[1,2.50,{{"b":null}}]}},"messages":[{{"role":"user","content":"{huge}"}}],"stream":true}}"#
    );
    let r = rw(ApiKind::ChatCompletions, &input, true, Some(10));
    let suffix = r#","stream_options":{"include_usage":true},"max_tokens":10}"#;
    let want = format!("{}{suffix}", &input[..input.len() - 1]);
    assert_eq!(body_str(&r), want);
}

#[test]
fn errors() {
    for body in ["", "{", "{\"a\":1", "{\"a\":1}}", "nope", "{\"a\":tru}", "{'a':1}"] {
        assert!(matches!(rewrite_request(ApiKind::ChatCompletions, body.as_bytes(), true, Some(1)), Err(RewriteError::NotJson(_))), "{body}");
    }
    for body in ["[]", "\"s\"", "1", "null", "[{\"stream\":true}]"] {
        assert_eq!(rewrite_request(ApiKind::ChatCompletions, body.as_bytes(), true, Some(1)), Err(RewriteError::NotObject), "{body}");
    }
    assert!(matches!(rewrite_request(ApiKind::ChatCompletions, b"{\"a\":\"\xff\"}", true, Some(1)), Err(RewriteError::NotJson(_))));
}

#[test]
fn deep_nesting_does_not_overflow_the_stack() {
    let depth = 200_000;
    let body = format!(r#"{{"a":{}{},"stream":true}}"#, "[".repeat(depth), "]".repeat(depth));
    let r = rewrite_request(ApiKind::ChatCompletions, body.as_bytes(), true, Some(1)).unwrap();
    assert!(r.injected_include_usage);
    assert!(r.body.ends_with(br#","stream_options":{"include_usage":true},"max_tokens":1}"#));
}

fn member_value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("true".to_owned()),
        Just("false".to_owned()),
        Just("null".to_owned()),
        Just("1e400".to_owned()),
        Just("18446744073709551616".to_owned()),
        Just(r#"{"include_usage":true}"#.to_owned()),
        Just(r#"{"include_usage":false,"k":[1,{"}":"{"}]}"#.to_owned()),
        Just(r#"{ }"#.to_owned()),
        Just(r#"[ ]"#.to_owned()),
        (0u64..100_000).prop_map(|n| n.to_string()),
        "[^\"\\\\]{0,8}".prop_map(|s| serde_json::to_string(&s).unwrap()),
    ]
}

fn member_key() -> impl Strategy<Value = &'static str> {
    prop_oneof![Just("model"), Just("stream"), Just("stream_options"), Just("max_tokens"), Just("max_completion_tokens"), Just("max_output_tokens"), Just("x"),]
}

fn ws() -> impl Strategy<Value = &'static str> {
    prop_oneof![Just(""), Just(" "), Just("\n  ")]
}

/// A JSON object of the generated `(key, value, space, space)` members, and `last` after them.
fn object_of(members: &[(&str, String, &str, &str)], last: Option<&str>) -> String {
    let inner: Vec<String> = members.iter().map(|(k, v, a, b)| format!("{a}\"{k}\"{b}:{a}{v}{b}")).chain(last.map(str::to_owned)).collect();
    format!("{{{}}}", inner.join(","))
}

proptest! {
    /// Whatever the body, the result is valid JSON with the limit and include_usage set as decided,
    /// and every other member unchanged.
    #[test]
    fn rewritten_bodies_are_valid_and_minimal(
        members in proptest::collection::vec((member_key(), member_value(), ws(), ws()), 0..8),
        kind_ix in 0usize..4,
        inject in any::<bool>(),
        limit in proptest::option::of(0u64..1_000_000),
    ) {
        let kind = ApiKind::ALL[kind_ix];
        let body = object_of(&members, None);
        let r = rewrite_request(kind, body.as_bytes(), inject, limit).unwrap();
        // serde_json::Value cannot hold 1e400: compare with the big numbers neutralised.
        let neutral = |b: &[u8]| -> Value {
            let s = String::from_utf8(b.to_vec()).unwrap()
                .replace("1e400", "0").replace("18446744073709551616", "0");
            serde_json::from_str(&s).unwrap()
        };
        let before = neutral(body.as_bytes());
        let after = neutral(&r.body);
        let after_obj = after.as_object().unwrap();
        let edited: &[&str] = match kind {
            ApiKind::ChatCompletions => &["max_completion_tokens", "max_tokens", "stream_options"],
            ApiKind::Completions => &["max_tokens", "stream_options"],
            ApiKind::Responses => &["max_output_tokens"],
            ApiKind::AnthropicMessages => &["max_tokens"],
        };
        for (k, v) in before.as_object().unwrap() {
            if !edited.contains(&k.as_str()) || (limit.is_none() && k != "stream_options") {
                prop_assert_eq!(after_obj.get(k), Some(v), "{}", k);
            }
        }
        if let Some(limit) = limit {
            let main = match kind {
                ApiKind::ChatCompletions if before.get("max_completion_tokens").is_some() => "max_completion_tokens",
                ApiKind::Responses => "max_output_tokens",
                _ => "max_tokens",
            };
            prop_assert_eq!(after_obj.get(main), Some(&json!(limit)));
        }
        let streaming = before.get("stream") == Some(&json!(true));
        let had = before.pointer("/stream_options/include_usage") == Some(&json!(true));
        let options_ok = matches!(before.get("stream_options"), None | Some(Value::Null | Value::Object(_)));
        let expect_inject = inject
            && matches!(kind, ApiKind::ChatCompletions | ApiKind::Completions)
            && streaming && !had && options_ok;
        prop_assert_eq!(r.injected_include_usage, expect_inject);
        if expect_inject {
            prop_assert_eq!(after.pointer("/stream_options/include_usage"), Some(&json!(true)));
        }
        if !expect_inject && limit.is_none() {
            prop_assert_eq!(&r.body, body.as_bytes());
        }
    }

    /// A rewrite of the body just inspected leaves its result's inspection remembered (the next
    /// policy reads it without a parse): what is remembered is what a parse of the result gives.
    #[test]
    fn the_inspection_remembered_for_a_rewritten_body_is_its_parse(
        members in proptest::collection::vec((member_key(), member_value(), ws(), ws()), 0..8),
        kind_ix in 0usize..4,
        inject in any::<bool>(),
        limit in proptest::option::of(0u64..1_000_000),
        model in "[a-z0-9\"\\\\é-]{0,6}",
        set_model in any::<bool>(),
        streaming in any::<bool>(),
    ) {
        let kind = ApiKind::ALL[kind_ix];
        // Half the bodies stream, so that include_usage is injected often.
        let body = object_of(&members, streaming.then_some("\"stream\":true"));
        // A body serde_json cannot hold (1e400) is not remembered: nothing to compare.
        let Ok((refined, _)) = inspect_request_with_kind(kind, body.as_bytes()) else { return Ok(()) };
        let after = if set_model {
            set_top_level_string(body.as_bytes(), "model", &model).unwrap()
        } else {
            rewrite_request(refined, body.as_bytes(), inject, limit).unwrap().body
        };
        let remembered = inspect_request_with_kind(kind, &after);
        // Another body in between: the next inspection of `after` parses it.
        inspect_request_with_kind(kind, b"{}").unwrap();
        let parsed = inspect_request_with_kind(kind, &after);
        prop_assert_eq!(remembered, parsed, "{} → {}", body, String::from_utf8_lossy(&after));
    }

    #[test]
    fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = rewrite_request(ApiKind::ChatCompletions, &body, true, Some(3));
    }
}

// ------------------------------------------------------------------------------------------------
// UsageChunkStripper
// ------------------------------------------------------------------------------------------------

const CAP: usize = 64 * 1024;

fn strip_in(chunks: &[&[u8]], cap: usize) -> (Vec<u8>, UsageChunkStripper) {
    let mut s = UsageChunkStripper::new(cap);
    let mut out = Vec::new();
    for c in chunks {
        out.extend(s.push(c));
        assert!(s.held_bytes() <= cap);
    }
    out.extend(s.finish());
    (out, s)
}

fn strip(input: &str) -> String {
    String::from_utf8(strip_in(&[input.as_bytes()], CAP).0).unwrap()
}

/// The stream the same server would send without include_usage: no `"usage":null`, no usage chunk.
fn without_usage(tokens: &[&str]) -> String {
    common::chat_stream(tokens, None).replace(",\"usage\":null", "")
}

#[test]
fn realistic_openai_stream_is_restored() {
    let tokens = &common::HELLO_TOKENS;
    let with = common::chat_stream(tokens, Some("[]"));
    let want = without_usage(tokens);
    assert_ne!(with, want);
    let (out, s) = strip_in(&[with.as_bytes()], CAP);
    assert_eq!(String::from_utf8(out).unwrap(), want);
    assert_eq!(s.removed_usage_events(), 1);
    assert_eq!(s.stripped_usage_members(), tokens.len() as u64 + 2);
    // Byte by byte.
    let bytes: Vec<&[u8]> = with.as_bytes().chunks(1).collect();
    assert_eq!(String::from_utf8(strip_in(&bytes, CAP).0).unwrap(), want);
}

#[test]
fn usage_chunk_variants() {
    let usage = r#""usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}"#;
    for choices in [r#","choices":[]"#, r#","choices":null"#, "", r#","choices":[ ]"#] {
        let input = format!("data: {{\"id\":\"x\"{choices},{usage}}}\n\ndata: [DONE]\n\n");
        assert_eq!(strip(&input), "data: [DONE]\n\n", "{choices}");
    }
    // Usage riding on a content chunk: the member goes, the chunk stays.
    let input = format!("data: {{\"id\":\"x\",\"choices\":[{{\"delta\":{{\"content\":\"hi\"}}}}],{usage}}}\n\n");
    assert_eq!(strip(&input), "data: {\"id\":\"x\",\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n");
}

#[test]
fn usage_null_in_every_placement_and_spacing() {
    let cases = [
        (r#"{"a":1,"usage":null}"#, r#"{"a":1}"#),
        (r#"{"usage":null,"a":1}"#, r#"{"a":1}"#),
        (r#"{"a":1,"usage":null,"b":2}"#, r#"{"a":1,"b":2}"#),
        (r#"{"a": 1, "usage": null}"#, r#"{"a": 1}"#),
        (r#"{"usage": null, "a": 1}"#, r#"{"a": 1}"#),
        (r#"{"a": 1, "usage" : null , "b": 2}"#, r#"{"a": 1 , "b": 2}"#),
        (r#"{ "usage":null }"#, r#"{  }"#),
        (r#"{"usage":null,"usage":null,"a":1}"#, r#"{"a":1}"#),
        (r#"{"a":1,"usage":null,"usage":null}"#, r#"{"a":1}"#),
        (r#"{"a":{"usage":null},"usage":null}"#, r#"{"a":{"usage":null}}"#),
        (r#"{"a":"\"usage\":null","usage":null}"#, r#"{"a":"\"usage\":null"}"#),
        (r#"{"a":1,"us\u0061ge":null}"#, r#"{"a":1}"#),
    ];
    for (json, want) in cases {
        for prefix in ["data: ", "data:"] {
            let input = format!("{prefix}{json}\n\n");
            assert_eq!(strip(&input), format!("{prefix}{want}\n\n"), "{input}");
        }
    }
}

#[test]
fn everything_else_passes_untouched() {
    let inputs = [
        ": keep-alive\n\n",
        "data: [DONE]\n\n",
        "event: ping\ndata: {}\n\n",
        "data: {\"choices\":[],\"usage\":nul\n\n",
        "data: [1,{\"usage\":{}}]\n\n",
        "data: \"usage\"\n\n",
        "id: 7\nretry: 10\n\n",
        "\n\n\n",
        "data: {\"a\":1} trailing\n\n",
        "datas: {\"usage\":{},\"choices\":[]}\n\n",
        "data {\"usage\":{},\"choices\":[]}\n\n",
        "data: {\"a\":1,\"usage\":null}", // incomplete at end of stream
        "{\"error\":{\"message\":\"bad\",\"type\":\"invalid_request_error\"}}",
        "data: {\"a\":\"\u{1F600}\\u00e9\"}\n\n",
    ];
    for input in inputs {
        assert_eq!(strip(input), input);
    }
}

#[test]
fn multi_line_data() {
    // A usage chunk split over two data lines still goes.
    let input = "data: {\"choices\":[],\ndata: \"usage\":{\"total_tokens\":3}}\n\ndata: [DONE]\n\n";
    assert_eq!(strip(input), "data: [DONE]\n\n");
    // A content chunk split over lines is left alone rather than edited across lines.
    let input = "data: {\"choices\":[1],\ndata: \"usage\":null}\n\n";
    assert_eq!(strip(input), input);
}

#[test]
fn line_endings_are_preserved() {
    for term in ["\n", "\r\n", "\r"] {
        let t2 = format!("{term}{term}");
        let input = format!("data: {{\"a\":1,\"usage\":null}}{t2}: c{t2}data: {{\"choices\":[],\"usage\":{{}}}}{t2}data: [DONE]{t2}");
        let want = format!("data: {{\"a\":1}}{t2}: c{t2}data: [DONE]{t2}");
        for split in 0..=input.len() {
            let (a, b) = input.as_bytes().split_at(split);
            let (out, s) = strip_in(&[a, b], CAP);
            assert_eq!(String::from_utf8(out).unwrap(), want, "{term:?} split {split}");
            assert_eq!(s.removed_usage_events(), 1);
        }
    }
}

#[test]
fn crlf_split_after_a_removed_event() {
    let chunks: [&[u8]; 3] = [b"data: {\"choices\":[],\"usage\":{}}\r\n\r", b"\ndata: [DONE]\r\n\r", b"\n"];
    let (out, _) = strip_in(&chunks, CAP);
    assert_eq!(out, b"data: [DONE]\r\n\r\n");
    // CR-only stream where the next event starts right after the CR.
    let chunks: [&[u8]; 2] = [b"data: {\"choices\":[],\"usage\":{}}\r\r", b"data: x\r\r"];
    assert_eq!(strip_in(&chunks, CAP).0, b"data: x\r\r");
}

#[test]
fn bom_at_stream_start() {
    let input = "\u{FEFF}data: {\"choices\":[],\"usage\":{}}\n\ndata: [DONE]\n\n";
    assert_eq!(strip(input), "data: [DONE]\n\n");
    let input = "\u{FEFF}data: {\"a\":1,\"usage\":null}\n\n";
    assert_eq!(strip(input), "\u{FEFF}data: {\"a\":1}\n\n");
}

#[test]
fn complete_events_go_out_immediately_partial_ones_are_held() {
    let mut s = UsageChunkStripper::new(CAP);
    assert_eq!(s.push(b"data: {\"a\":1,\"usage\":null}\n\ndata: {\"a\""), b"data: {\"a\":1}\n\n");
    assert_eq!(s.held_bytes(), 10);
    assert_eq!(s.push(b":2,\"usage\":null}\n"), b"");
    assert_eq!(s.push(b"\n"), b"data: {\"a\":2}\n\n");
    assert_eq!(s.held_bytes(), 0);
    assert_eq!(s.push(b"data: [DO"), b"");
    assert_eq!(s.finish(), b"data: [DO");
    assert_eq!(s.push(b""), b"");
}

#[test]
fn oversized_events_pass_through_unmodified() {
    let cap = 64;
    let big = format!("data: {{\"choices\":[],\"usage\":{{\"pad\":\"{}\"}}}}\n\n", "x".repeat(100));
    let small = "data: {\"a\":1,\"usage\":null}\n\n";
    let input = format!("{small}{big}{small}");
    let want = format!("data: {{\"a\":1}}\n\n{big}data: {{\"a\":1}}\n\n");
    for split in 0..=input.len() {
        let (a, b) = input.as_bytes().split_at(split);
        let (out, s) = strip_in(&[a, b], cap);
        assert_eq!(String::from_utf8(out).unwrap(), want, "split {split}");
        assert_eq!(s.overflowed_events(), 1);
        assert_eq!(s.removed_usage_events(), 0);
    }
    // Streaming through in small pieces: the held part never exceeds the cap.
    let mut s = UsageChunkStripper::new(cap);
    let mut out = Vec::new();
    for c in input.as_bytes().chunks(7) {
        out.extend(s.push(c));
        assert!(s.held_bytes() <= cap);
    }
    out.extend(s.finish());
    assert_eq!(String::from_utf8(out).unwrap(), want);
}

// ---- properties ----------------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Piece {
    Content(String),
    Comment,
}

#[derive(Debug, Clone)]
struct StreamSpec {
    pieces: Vec<(Piece, usize)>,
    python_style: bool,
    term: &'static str,
    usage_choices: Option<&'static str>,
    done: bool,
}

fn stream_spec() -> impl Strategy<Value = StreamSpec> {
    let piece = prop_oneof![
        4 => "[^\r\n]{0,12}".prop_map(Piece::Content),
        1 => Just(Piece::Comment),
    ];
    (
        proptest::collection::vec((piece, 0usize..8), 0..8),
        any::<bool>(),
        prop_oneof![Just("\n"), Just("\r\n"), Just("\r")],
        prop_oneof![Just(Some("[]")), Just(Some("null")), Just(Some("")), Just(None)],
        any::<bool>(),
    )
        .prop_map(|(pieces, python_style, term, usage_choices, done)| StreamSpec { pieces, python_style, term, usage_choices, done })
}

/// Render the stream as a server would: with include_usage (`"usage":null` at position `pos` of
/// each chunk, final usage chunk) or without.
fn render(spec: &StreamSpec, with_usage: bool) -> String {
    let (sep, colon) = if spec.python_style { (", ", ": ") } else { (",", ":") };
    let obj = |members: Vec<(String, String)>| {
        let inner: Vec<String> = members.into_iter().map(|(k, v)| format!("\"{k}\"{colon}{v}")).collect();
        format!("{{{}}}", inner.join(sep))
    };
    let t2 = format!("{}{}", spec.term, spec.term);
    let base = |text: &str| {
        vec![
            ("id".to_owned(), "\"chatcmpl-1\"".to_owned()),
            ("object".to_owned(), "\"chat.completion.chunk\"".to_owned()),
            ("created".to_owned(), "1741569952".to_owned()),
            (
                "choices".to_owned(),
                format!(
                    "[{{\"index\"{colon}0{sep}\"delta\"{colon}{{\"content\"{colon}{}}}{sep}\"finish_reason\"{colon}null}}]",
                    serde_json::to_string(text).unwrap()
                ),
            ),
        ]
    };
    let mut s = String::new();
    for (piece, pos) in &spec.pieces {
        match piece {
            Piece::Comment => s.push_str(&format!(": keep-alive{t2}")),
            Piece::Content(text) => {
                let mut members = base(text);
                if with_usage {
                    let at = pos % (members.len() + 1);
                    members.insert(at, ("usage".to_owned(), "null".to_owned()));
                }
                s.push_str(&format!("data: {}{t2}", obj(members)));
            }
        }
    }
    if with_usage {
        if let Some(choices) = spec.usage_choices {
            let mut members = vec![("id".to_owned(), "\"chatcmpl-1\"".to_owned())];
            if !choices.is_empty() {
                members.push(("choices".to_owned(), choices.to_owned()));
            }
            members.push(("usage".to_owned(), format!("{{\"prompt_tokens\"{colon}19{sep}\"completion_tokens\"{colon}10{sep}\"total_tokens\"{colon}29}}")));
            s.push_str(&format!("data: {}{t2}", obj(members)));
        }
    }
    if spec.done {
        s.push_str(&format!("data: [DONE]{t2}"));
    }
    s
}

fn cut(input: &[u8], mut points: Vec<usize>) -> Vec<&[u8]> {
    points.iter_mut().for_each(|p| *p %= input.len() + 1);
    points.sort_unstable();
    let mut chunks = Vec::new();
    let mut at = 0;
    for p in points {
        chunks.push(&input[at..p]);
        at = p;
    }
    chunks.push(&input[at..]);
    chunks
}

fn sse_fragment() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("data: ".to_owned()),
        Just("data:".to_owned()),
        Just("\n".to_owned()),
        Just("\r".to_owned()),
        Just("\r\n".to_owned()),
        Just(": c".to_owned()),
        Just("[DONE]".to_owned()),
        Just("{\"choices\":[],\"usage\":{\"t\":1}}".to_owned()),
        Just("{\"a\":1,\"usage\":null}".to_owned()),
        Just("{\"usage\": null, \"choices\":[1]}".to_owned()),
        Just("{\"usage\":".to_owned()),
        Just("\u{FEFF}".to_owned()),
        "[^\r\n]{0,6}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Any split of an include_usage stream comes out as the stream the server sends without it.
    #[test]
    fn include_usage_stream_becomes_the_plain_stream(
        spec in stream_spec(),
        points in proptest::collection::vec(any::<usize>(), 0..6),
    ) {
        let with = render(&spec, true);
        let without = render(&spec, false);
        let chunks = cut(with.as_bytes(), points);
        let (out, s) = strip_in(&chunks, CAP);
        prop_assert_eq!(String::from_utf8(out).unwrap(), without);
        prop_assert_eq!(s.removed_usage_events(), u64::from(spec.usage_choices.is_some()));
    }

    /// A stream that never had usage passes byte for byte, however it is split.
    #[test]
    fn plain_stream_is_untouched(
        spec in stream_spec(),
        points in proptest::collection::vec(any::<usize>(), 0..6),
    ) {
        let plain = render(&spec, false);
        let chunks = cut(plain.as_bytes(), points);
        let (out, s) = strip_in(&chunks, CAP);
        prop_assert_eq!(String::from_utf8(out).unwrap(), plain);
        prop_assert_eq!(s.removed_usage_events() + s.stripped_usage_members(), 0);
    }

    /// Arbitrary bytes never panic, the held part stays under the cap, and where the chunk
    /// boundaries fall never changes the output.
    #[test]
    fn arbitrary_input_is_bounded_and_split_invariant(
        bytes in proptest::collection::vec(any::<u8>(), 0..300),
        fragments in proptest::collection::vec(sse_fragment(), 0..24),
        points in proptest::collection::vec(any::<usize>(), 0..8),
        cap in 0usize..96,
    ) {
        for input in [bytes, fragments.concat().into_bytes()] {
            let whole = strip_in(&[&input], cap).0;
            let (split, s) = strip_in(&cut(&input, points.clone()), cap);
            prop_assert_eq!(&split, &whole);
            prop_assert!(s.held_bytes() == 0);
            prop_assert!(whole.len() <= input.len());
        }
    }
}

#[test]
fn set_top_level_string_keeps_every_other_byte() {
    use sluice_core::rewrite::set_top_level_string;
    let body = br#"  {"model" : "llama-3-70b", "messages":[{"role":"user","content":"model \"x\" \u00e9"}], "n": 1e400 }  "#;
    let out = set_top_level_string(body, "model", "llama-3-70b-v2").unwrap();
    assert_eq!(
        String::from_utf8(out).unwrap(),
        r#"  {"model" : "llama-3-70b-v2", "messages":[{"role":"user","content":"model \"x\" \u00e9"}], "n": 1e400 }  "#
    );
    let appended = set_top_level_string(br#"{"a":1}"#, "model", "q\"uote").unwrap();
    assert_eq!(appended, br#"{"a":1,"model":"q\"uote"}"#.to_vec());
    assert!(set_top_level_string(b"[1]", "model", "m").is_err());
    assert!(set_top_level_string(b"{", "model", "m").is_err());
}

// A chunk passed unchanged by `push_changed` is what `push` would send: the same bytes and the
// same counters, however the stream is cut (the fast path takes whole LF-ended events without
// `usage`; everything else goes through the framing).
proptest! {
    #[test]
    fn push_changed_sends_what_push_sends(
        events in proptest::collection::vec(prop_oneof![
            Just("data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n".to_string()),
            Just("data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}],\"usage\":null}\n\n".to_string()),
            Just("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n".to_string()),
            Just("data: {\"choices\":[{\"delta\":{\"content\":\"\\u00e9\"}}]}\r\n\r\n".to_string()),
            Just(": keep-alive\n\n".to_string()),
            Just("data: [DONE]\n\n".to_string()),
            "[a-z ]{0,40}".prop_map(|t| format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"{t}\"}}}}]}}\n\n")),
            // Whole events the one-event path must decline or judge as the framing does.
            Just("\ndata: {\"choices\":[],\"usage\":null}\n\n".to_string()),
            Just("data: {\"choices\":[],\"usage\":null}\n\n\n".to_string()),
            Just("\u{feff}data: {\"choices\":[{\"delta\":{}}],\"usage\":null}\n\n".to_string()),
            Just("data: {\"choices\":[],\"us\\u0061ge\":null,\"usage\":null}\n\n".to_string()),
            Just("data: {\"choices\":[],\ndata: \"usage\":{\"total_tokens\":1}}\n\n".to_string()),
            Just("event: chunk\ndata: {\"choices\":[{\"delta\":{\"content\":\"usage\"}}],\"usage\":null}\n\n".to_string()),
            Just("data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}],\"broken\":,\"usage\":null}\n\n".to_string()),
        ], 0..12),
        cuts in proptest::collection::vec(0usize..400, 0..6),
        cap in prop_oneof![Just(CAP), Just(48usize)],
        at_events in any::<bool>(),
    ) {
        let stream = events.concat();
        let bytes = stream.as_bytes();
        // Cut anywhere, or only where an event ends (each chunk whole events, as servers flush).
        let ends: Vec<usize> = events.iter().scan(0, |at, e| { *at += e.len(); Some(*at) }).collect();
        let cuts: Vec<usize> = if at_events { cuts.iter().filter_map(|c| ends.get(c % ends.len().max(1)).copied()).chain(ends.iter().copied().step_by(2)).collect() } else { cuts };
        let mut points: Vec<usize> = cuts.into_iter().map(|c| c.min(bytes.len())).collect();
        points.push(0);
        points.push(bytes.len());
        points.sort_unstable();
        let chunks: Vec<&[u8]> = points.windows(2).map(|w| &bytes[w[0]..w[1]]).collect();

        let (want, plain) = strip_in(&chunks, cap);
        let mut fast = UsageChunkStripper::new(cap);
        let mut got = Vec::new();
        for c in &chunks {
            match fast.push_changed(c) {
                Some(out) => got.extend(out),
                None => got.extend_from_slice(c),
            }
        }
        got.extend(fast.finish());
        prop_assert_eq!(String::from_utf8_lossy(&got), String::from_utf8_lossy(&want));
        prop_assert_eq!(fast.removed_usage_events(), plain.removed_usage_events());
        prop_assert_eq!(fast.stripped_usage_members(), plain.stripped_usage_members());
        prop_assert_eq!(fast.overflowed_events(), plain.overflowed_events());
    }
}

// ------------------------------------------------------------------------------------------------
// The stripper taking the observer's word for the JSON it read (tenant-budget's way)
// ------------------------------------------------------------------------------------------------

/// Events of every kind the stripper decides on: the usual chunk with a trailing `"usage":null`, the
/// usage report, texts that only look like JSON (a broken member, a number too large for a `Value`
/// but JSON all the same, a no-break space around it, bytes that are not UTF-8), several data lines.
fn knowing_cases() -> Vec<Vec<u8>> {
    let mut events: Vec<Vec<u8>> = vec![
        b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"},\"index\":0}],\"id\":\"c1\",\"usage\":null}\n\n".to_vec(),
        b"data:{\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}\n\n".to_vec(),
        b"data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":{\"total_tokens\":5}}\n\n".to_vec(),
        b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}],\"broken\":,\"usage\":null}\n\n".to_vec(),
        b"data: {\"choices\":[],\"big\":1e400,\"usage\":null}\n\n".to_vec(),
        "data: \u{a0}{\"choices\":[],\"usage\":null}\u{a0}\n\n".as_bytes().to_vec(),
        b"data: {\"choices\":[{\"delta\":{\"content\":\"\xff\"}}],\"usage\":null}\n\n".to_vec(),
        b"data: {\"choices\":[],\ndata: \"usage\":null}\n\n".to_vec(),
        b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}] ,  \"usage\" : null }  \n\n".to_vec(),
        b"data: [DONE]\n\n".to_vec(),
    ];
    events.push(events.concat());
    events
}

fn strip_with_observer(parts: &[&[u8]], knowing: bool) -> (Vec<u8>, u64, u64) {
    strip_with_observer_by(parts, knowing, false)
}

/// [`strip_with_observer`], through `push_changed_knowing` (tenant-budget's call) when `changed`.
fn strip_with_observer_by(parts: &[&[u8]], knowing: bool, changed: bool) -> (Vec<u8>, u64, u64) {
    let mut stripper = UsageChunkStripper::new(sluice_core::sse::DEFAULT_MAX_EVENT_BYTES);
    let mut observer = sluice_core::response::StreamObserver::new(ApiKind::ChatCompletions);
    observer.keep_validated();
    let mut out = Vec::new();
    for part in parts {
        observer.push(part);
        let known = if knowing { observer.validated() } else { None };
        if changed {
            out.extend(stripper.push_changed_knowing(part, known).unwrap_or_else(|| part.to_vec()));
        } else {
            out.extend_from_slice(&stripper.push_knowing(part, known));
        }
    }
    out.extend_from_slice(&stripper.finish());
    (out, stripper.removed_usage_events(), stripper.stripped_usage_members())
}

#[test]
fn the_observers_word_changes_nothing_the_stripper_decides() {
    let cases = knowing_cases();
    let stream = cases.concat();
    for size in 1..=stream.len() {
        let parts: Vec<&[u8]> = stream.chunks(size).collect();
        assert_eq!(strip_with_observer(&parts, true), strip_with_observer(&parts, false), "chunks of {size} bytes");
    }
    let (out, removed, stripped) = strip_with_observer(&[&stream], true);
    // Per copy: the report removed; the usual chunk, the finish with its usage, the large number,
    // the text that is not UTF-8 (JSON to a skipping parse) and the spaced one stripped.
    assert_eq!((removed, stripped), (2, 10), "{}", String::from_utf8_lossy(&out));
}

#[test]
fn the_observer_vouches_only_for_texts_it_read_as_json_in_its_last_push() {
    let mut observer = sluice_core::response::StreamObserver::new(ApiKind::ChatCompletions);
    assert!(observer.validated().is_none(), "kept only when asked");
    observer.keep_validated();
    let cases = knowing_cases();
    observer.push(&cases[0]);
    let known = observer.validated().unwrap();
    assert_eq!(known.len(), 1);
    let data = &cases[0][b"data: ".len()..cases[0].len() - 2];
    assert!(known.contains(data));
    assert!(known.contains(format!(" \t{}\r\n", std::str::from_utf8(data).unwrap()).as_bytes()), "JSON whitespace around it is the same text");
    assert!(!known.contains(&data[..data.len() - 1]), "a text cut short is another text");
    // The usage report and a finish carrying usage, read whole by the fast path, are vouched for
    // too (the stripper need not validate them again).
    for case in &cases[1..3] {
        observer.push(case);
        let data = &case[b"data:".len()..case.len() - 2];
        assert!(observer.validated().unwrap().contains(data), "{}", String::from_utf8_lossy(case));
    }
    // Vouched for: what the observer read as JSON, byte for byte. Not: a broken text, one with a
    // number outside f64's range (malformed to the observer, as to serde_json's tree; the
    // stripper's own skipping parse still strips it, above), one with no-break spaces around it
    // (JSON to the observer once it trimmed them, not as the stripper sees it), one that is not
    // UTF-8 (the observer reads it with replacement characters).
    for (case, vouched) in cases[3..7].iter().zip([false, false, false, false]) {
        observer.push(case);
        let data = &case[b"data: ".len()..case.len() - 2];
        let known = observer.validated().unwrap();
        assert_eq!(known.contains(data), vouched, "{}", String::from_utf8_lossy(case));
        assert!(!known.contains(data) || serde_json::from_slice::<serde::de::IgnoredAny>(data).is_ok());
    }
    assert!(!observer.validated().unwrap().contains(&cases[0][b"data: ".len()..cases[0].len() - 2]), "each push starts afresh");
    // Bounded: at most MAX_EVENTS texts a push.
    let many = cases[0].repeat(200);
    observer.push(&many);
    assert_eq!(observer.validated().unwrap().len(), sluice_core::response::ValidatedJson::MAX_EVENTS);
}

/// A stream's content events as a server sends them: the same bytes around each new text.
fn shaped_event(shape: u8, text: &str) -> Vec<u8> {
    let head = r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":""#;
    let tail = r#""},"logprobs":null,"finish_reason":null}]"#;
    match shape {
        0 => format!("data: {head}{text}{tail},\"usage\":null}}\n\n"),
        1 => format!("data:{head}{text}{tail},\"usage\":null}}\n\n"),
        // Space before the member: the framing's cut, not the trailing shape.
        2 => format!("data: {head}{text}{tail} ,\"usage\":null}}\n\n"),
        // `usage` named in the bytes around the text, spelled out or escaped.
        3 => format!("data: {{\"id\":\"usage\",{}{text}{tail},\"usage\":null}}\n\n", &head[1..]),
        4 => format!("data: {{\"us\\u0061ge\":1,{}{text}{tail},\"usage\":null}}\n\n", &head[1..]),
        // Two data lines, another field line, CRLF line ends.
        5 => format!("data: {head}{text}{tail},\ndata: \"usage\":null}}\n\n"),
        6 => format!("id: 7\ndata: {head}{text}{tail},\"usage\":null}}\n\n"),
        7 => format!("data: {head}{text}{tail},\"usage\":null}}\r\n\r\n"),
        _ => format!("data: {head}{text}{tail},\"usage\":{{\"total_tokens\":1}}}}\n\n"),
    }
    .into_bytes()
}

/// Texts the content may hold: words, `usage` itself, escapes of every kind, bytes JSON refuses.
const TEXT_PIECES: [&str; 10] = ["a", " word", "usage", "\\u00e9", "\\\"", "\\\\", "us", "age", "\\", "\""];

#[test]
fn a_stream_read_by_stencil_has_its_trailing_usage_cut_on_the_observers_word() {
    let events: Vec<Vec<u8>> = ["Hello", " there", "", "\\\"q\\\"", "fine"].iter().map(|t| shaped_event(0, t)).collect();
    let mut observer = sluice_core::response::StreamObserver::new(ApiKind::ChatCompletions);
    observer.keep_validated();
    for (i, event) in events.iter().enumerate() {
        observer.push(event);
        let cut = sluice_core::rewrite::vouched_trailing_null_usage(event, observer.validated());
        if i == 0 {
            // The first is parsed whole: the stripper judges it itself.
            assert_eq!(cut, None);
        } else {
            let cut = cut.unwrap_or_else(|| panic!("event {i} not vouched for"));
            assert_eq!(&event[cut.clone()], b",\"usage\":null", "event {i}");
            assert_eq!(cut.end, event.len() - 3);
        }
    }
    // The word is for the event read, nothing else: not the same event with a space more.
    let spaced = [b"data:  ".as_slice(), &events[4][6..]].concat();
    assert_eq!(sluice_core::rewrite::vouched_trailing_null_usage(&spaced, observer.validated()), None);
    // Nor a text naming `usage` (its members must then be read).
    let named = shaped_event(0, "usage");
    observer.push(&named);
    assert_eq!(sluice_core::rewrite::vouched_trailing_null_usage(&named, observer.validated()), None);
    // Each shape repeated, so that a stencil forms and reads the next ones: the stripper's output
    // and counts as without the observer's word.
    for shape in 0..9 {
        let stream: Vec<Vec<u8>> = ["a", "b", "usage", "c", "\\u00e9", "d"].iter().map(|t| shaped_event(shape, t)).collect();
        let parts: Vec<&[u8]> = stream.iter().map(Vec::as_slice).collect();
        assert_eq!(strip_with_observer_by(&parts, true, true), strip_with_observer_by(&parts, false, true), "shape {shape}");
    }
}

proptest! {
    // The stripper cuts the same bytes and counts the same members with the observer's word for
    // stencil-read events as without it, however the stream is shaped and cut.
    #[test]
    fn the_stencils_word_changes_nothing_the_stripper_decides(
        events in proptest::collection::vec((0u8..9, proptest::collection::vec(0usize..TEXT_PIECES.len(), 0..4)), 1..16),
        size in 0usize..64,
    ) {
        let stream: Vec<Vec<u8>> = events.iter().map(|(shape, picks)| {
            // Mostly the plain shape, so that stencils form and are read.
            let shape = if *shape >= 4 && picks.len() % 2 == 0 { 0 } else { *shape };
            let text: String = picks.iter().map(|&p| TEXT_PIECES[p]).collect();
            shaped_event(shape, &text)
        }).collect();
        let whole = stream.concat();
        let parts: Vec<&[u8]> = if size == 0 { stream.iter().map(Vec::as_slice).collect() } else { whole.chunks(size).collect() };
        prop_assert_eq!(strip_with_observer_by(&parts, true, true), strip_with_observer_by(&parts, false, true));
    }
}
