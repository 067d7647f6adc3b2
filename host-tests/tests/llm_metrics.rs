//! llm-metrics, the built `.wasm`, in the harness with a virtual clock: every test states one
//! behaviour with exact figures (a first content chunk at +180 ms is a TTFT of exactly 180 ms,
//! cost is an exact integer of micro-USD), read back from the metrics the plugin defined and from
//! its access-log stamp.
//!
//! Build the plugin first: `cargo build --release --target wasm32-wasip1 -p sluice-llm-metrics`.

mod common;

use common::llm::{chat, completions, config_with, gateway, gateway_with, headers, messages, plugin, responses, Call, Delivery, Labels, ACME_V2, CONFIG};
use serde_json::{json, Value};
use sluice_host::Gateway;

// ---------------------------------------------------------------------------------------------
// Reading back what one request recorded
// ---------------------------------------------------------------------------------------------

/// Every per-request metric of one label set, as the plugin recorded it (`None`: never defined).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Figures {
    ttft_ms: Option<Vec<u64>>,
    tpot_us: Option<Vec<u64>>,
    decode_tokens_per_s: Option<Vec<u64>>,
    request_duration_ms: Option<Vec<u64>>,
    input_tokens: Option<Vec<u64>>,
    output_tokens: Option<Vec<u64>>,
    input_tokens_total: Option<u64>,
    output_tokens_total: Option<u64>,
    cached_input_tokens_total: Option<u64>,
    reasoning_tokens_total: Option<u64>,
    cost_micro_usd_total: Option<u64>,
    client_disconnects_total: Option<u64>,
    upstream_errors_total: Option<u64>,
}

fn figures(gw: &Gateway, l: &Labels) -> Figures {
    Figures {
        ttft_ms: gw.histogram(&l.name("ttft_ms")),
        tpot_us: gw.histogram(&l.name("tpot_us")),
        decode_tokens_per_s: gw.histogram(&l.name("decode_tokens_per_s")),
        request_duration_ms: gw.histogram(&l.name("request_duration_ms")),
        input_tokens: gw.histogram(&l.name("input_tokens")),
        output_tokens: gw.histogram(&l.name("output_tokens")),
        input_tokens_total: gw.counter(&l.name("input_tokens_total")),
        output_tokens_total: gw.counter(&l.name("output_tokens_total")),
        cached_input_tokens_total: gw.counter(&l.name("cached_input_tokens_total")),
        reasoning_tokens_total: gw.counter(&l.name("reasoning_tokens_total")),
        cost_micro_usd_total: gw.counter(&l.name("cost_micro_usd_total")),
        client_disconnects_total: gw.counter(&l.name("client_disconnects_total")),
        upstream_errors_total: gw.counter(&l.name("upstream_errors_total")),
    }
}

/// What exactly one request with these figures records.
#[derive(Default)]
struct One {
    ttft_ms: Option<u64>,
    tpot_us: Option<u64>,
    tps: Option<u64>,
    duration_ms: u64,
    input: u64,
    output: u64,
    cached: u64,
    cost: Option<u64>,
    client_disconnect: bool,
    upstream_error: bool,
}

impl One {
    fn figures(&self) -> Figures {
        Figures {
            ttft_ms: self.ttft_ms.map(|v| vec![v]),
            tpot_us: self.tpot_us.map(|v| vec![v]),
            decode_tokens_per_s: self.tps.map(|v| vec![v]),
            request_duration_ms: Some(vec![self.duration_ms]),
            input_tokens: Some(vec![self.input]),
            output_tokens: Some(vec![self.output]),
            input_tokens_total: Some(self.input),
            output_tokens_total: Some(self.output),
            cached_input_tokens_total: Some(self.cached),
            reasoning_tokens_total: Some(0),
            cost_micro_usd_total: self.cost,
            client_disconnects_total: self.client_disconnect.then_some(1),
            upstream_errors_total: self.upstream_error.then_some(1),
        }
    }
}

/// `base` with the fields of `changes` replaced.
fn with(base: &Value, changes: Value) -> Value {
    let mut v = base.clone();
    if let (Some(o), Value::Object(c)) = (v.as_object_mut(), changes) {
        o.extend(c);
    }
    v
}

/// The stamp of the standard streamed chat answer ([`chat::timeline`] with usage).
fn chat_stream_stamp() -> Value {
    json!({
        "api": "chat_completions", "model_version": "v2", "tenant": "acme", "ctx": "1k", "turn": "first",
        "stream": true, "model": "gpt-4o", "response_model": "gpt-4o-2024-08-06", "status": 200,
        "outcome": "completed", "ttft_us": 180_000, "tpot_us": 25_000, "decode_tokens_per_s": 40,
        "duration_us": 392_000, "input_tokens": 19, "output_tokens": 9, "cached_input_tokens": 0,
        "cache_creation_input_tokens": 0, "reasoning_tokens": 0, "usage": "reported", "content_chunks": 9,
        // 19 × 2.5 + 9 × 10 = 137.5 → rounded up
        "cost_micro_usd": 138, "finish_reason": "stop", "upstream_error": null, "repetition_per_mille": null
    })
}

/// The figures of the standard streamed chat answer.
fn chat_stream_figures() -> Figures {
    One {
        ttft_ms: Some(180),
        tpot_us: Some(25_000), // (380 − 180) ms / (9 − 1)
        tps: Some(40),         // 8 tokens / 0.2 s
        duration_ms: 392,
        input: 19,
        output: 9,
        cost: Some(138),
        ..One::default()
    }
    .figures()
}

/// Plays the standard streamed chat answer (with the usage chunk) on `gw`, delivered as `delivery`.
fn play_chat_stream<'g>(gw: &'g Gateway, timeline: &[(u64, String)], delivery: Delivery) -> Call<'g> {
    let mut c = Call::start(gw, &headers(chat::PATH, &ACME_V2), &chat::request(true, true));
    c.sse_headers(timeline[0].0);
    c.body(timeline, delivery, true);
    c.end();
    c
}

fn assert_no_crash(gw: &Gateway) {
    assert_eq!(gw.crashed(), None, "the plugin must never trap");
}

// ---------------------------------------------------------------------------------------------
// 1. Each API, streamed and not
// ---------------------------------------------------------------------------------------------

/// Everything one request of one API records: its per-request metrics, its `requests_total`
/// counter, its stamp, whether the client got the upstream's bytes, the in-flight gauge after it.
#[derive(Debug, PartialEq)]
struct Recorded {
    figures: Figures,
    requests_total: Option<u64>,
    stamp: Value,
    byte_identical: bool,
    in_flight: Option<i64>,
    crashed: Option<String>,
}

/// One API's request and answer: the answer's pieces at their offsets (the response headers come
/// with the first), and what it must record.
struct ApiCase {
    name: &'static str,
    path: &'static str,
    headers: Vec<(&'static str, &'static str)>,
    body: String,
    content_type: &'static str,
    answer: Vec<(u64, String)>,
    labels: Labels,
    finish: &'static str,
    figures: Figures,
    stamp: Value,
}

impl ApiCase {
    fn sse(&self) -> bool {
        self.content_type.starts_with("text/event-stream")
    }

    /// Plays the case on a fresh gateway, delivered as `delivery`; with `crlf` every LF of the
    /// answer is CRLF.
    fn play(&self, delivery: Delivery, crlf: bool) -> Recorded {
        let gw = gateway();
        let mut c = Call::start(&gw, &headers(self.path, &self.headers), &self.body);
        c.response_headers(self.answer[0].0, "200", self.content_type);
        let answer: Vec<(u64, String)> = self.answer.iter().map(|(t, s)| (*t, if crlf { s.replace('\n', "\r\n") } else { s.clone() })).collect();
        c.body(&answer, delivery, true);
        c.end();
        Recorded {
            figures: figures(&gw, &self.labels),
            requests_total: gw.counter(&self.labels.requests_total("2xx", self.finish, "reported")),
            stamp: c.stamp(),
            byte_identical: c.downstream_body() == c.upstream_body,
            in_flight: gw.gauge("sluice.in_flight.model_version.v2"),
            crashed: gw.crashed(),
        }
    }

    fn expected(&self) -> Recorded {
        Recorded { figures: self.figures.clone(), requests_total: Some(1), stamp: self.stamp.clone(), byte_identical: true, in_flight: Some(0), crashed: None }
    }
}

fn completions_stamp() -> Value {
    json!({
        "api": "completions", "model_version": "v2", "tenant": "acme", "ctx": "1k", "turn": "first",
        "stream": true, "model": "gpt-3.5-turbo-instruct", "response_model": "gpt-3.5-turbo-instruct",
        "status": 200, "outcome": "completed", "ttft_us": 90_000, "tpot_us": 20_000, "decode_tokens_per_s": 50,
        "duration_us": 177_000, "input_tokens": 5, "output_tokens": 5, "cached_input_tokens": 0,
        "cache_creation_input_tokens": 0, "reasoning_tokens": 0, "usage": "reported", "content_chunks": 5,
        // 5 × 1.5 + 5 × 2 = 17.5 → 18
        "cost_micro_usd": 18, "finish_reason": "length", "upstream_error": null, "repetition_per_mille": null
    })
}

fn responses_stamp() -> Value {
    json!({
        "api": "responses", "model_version": "v2", "tenant": "acme", "ctx": "2k", "turn": "first",
        "stream": true, "model": "gpt-4o", "response_model": "gpt-4o-2024-08-06", "status": 200,
        "outcome": "completed", "ttft_us": 250_000, "tpot_us": 20_000, "decode_tokens_per_s": 50,
        "duration_us": 360_000, "input_tokens": 1500, "output_tokens": 6, "cached_input_tokens": 1024,
        "cache_creation_input_tokens": 0, "reasoning_tokens": 0, "usage": "reported", "content_chunks": 6,
        // 476 uncached × 2.5 + 1024 cached × 1.25 + 6 × 10 = 1190 + 1280 + 60
        "cost_micro_usd": 2530, "finish_reason": "completed", "upstream_error": null, "repetition_per_mille": null
    })
}

fn messages_stamp() -> Value {
    json!({
        "api": "messages", "model_version": "v2", "tenant": "acme", "ctx": "2k", "turn": "first",
        "stream": true, "model": "claude-sonnet-4-5", "response_model": "claude-sonnet-4-5-20250929",
        "status": 200, "outcome": "completed", "ttft_us": 400_000, "tpot_us": 8_571, "decode_tokens_per_s": 116,
        // input = 25 + 1000 cache reads
        "duration_us": 531_000, "input_tokens": 1025, "output_tokens": 15, "cached_input_tokens": 1000,
        "cache_creation_input_tokens": 0, "reasoning_tokens": 0, "usage": "reported", "content_chunks": 5,
        // 25 × 3 + 1000 × 0.3 + 15 × 15 = 75 + 300 + 225
        "cost_micro_usd": 600, "finish_reason": "end_turn", "upstream_error": null, "repetition_per_mille": null
    })
}

/// Without a stream there is no TTFT, TPOT or decode speed, and the whole body is one content chunk.
fn whole(stamp: Value, duration_us: u64, changes: Value) -> Value {
    let s =
        with(&stamp, json!({"stream": false, "ttft_us": null, "tpot_us": null, "decode_tokens_per_s": null, "duration_us": duration_us, "content_chunks": 1}));
    with(&s, changes)
}

fn api_cases() -> Vec<ApiCase> {
    let chat_whole = chat::response(19, 9);
    let (chat_a, chat_b) = chat_whole.split_at(chat_whole.len() / 2);
    let mut cmpl_stream: Vec<(u64, String)> =
        ["This", " is", " indeed", " a", " test"].iter().enumerate().map(|(i, p)| (90 + 20 * i as u64, completions::text(p, None))).collect();
    cmpl_stream.push((175, completions::text("", Some("length"))));
    cmpl_stream.push((176, completions::usage(5, 5)));
    cmpl_stream.push((177, chat::DONE.to_string()));
    let sse = "text/event-stream; charset=utf-8";
    let json_ct = "application/json";
    vec![
        ApiCase {
            name: "chat, streamed",
            path: chat::PATH,
            headers: ACME_V2.to_vec(),
            body: chat::request(true, true),
            content_type: sse,
            answer: chat::timeline(true),
            labels: Labels::new("chat_completions"),
            finish: "stop",
            figures: chat_stream_figures(),
            stamp: chat_stream_stamp(),
        },
        ApiCase {
            name: "chat, whole (in two pieces)",
            path: chat::PATH,
            headers: ACME_V2.to_vec(),
            body: chat::request(false, false),
            content_type: json_ct,
            answer: vec![(640, chat_a.to_string()), (641, chat_b.to_string())],
            labels: Labels::new("chat_completions").stream(false),
            finish: "stop",
            // No TTFT, TPOT or decode-speed sample without a stream.
            figures: One { duration_ms: 641, input: 19, output: 9, cost: Some(138), ..One::default() }.figures(),
            stamp: whole(chat_stream_stamp(), 641_000, json!({})),
        },
        ApiCase {
            name: "completions, streamed",
            path: completions::PATH,
            headers: ACME_V2.to_vec(),
            body: completions::request(true),
            content_type: sse,
            answer: cmpl_stream,
            labels: Labels::new("completions"),
            finish: "length",
            figures: One {
                ttft_ms: Some(90),
                tpot_us: Some(20_000), // 80 ms / 4
                tps: Some(50),
                duration_ms: 177,
                input: 5,
                output: 5,
                cost: Some(18),
                ..One::default()
            }
            .figures(),
            stamp: completions_stamp(),
        },
        ApiCase {
            name: "completions, whole",
            path: completions::PATH,
            headers: ACME_V2.to_vec(),
            body: completions::request(false),
            content_type: json_ct,
            answer: vec![(500, completions::response())],
            labels: Labels::new("completions").stream(false),
            finish: "length",
            // 5 × 1.5 + 7 × 2 = 21.5 → 22
            figures: One { duration_ms: 500, input: 5, output: 7, cost: Some(22), ..One::default() }.figures(),
            stamp: whole(completions_stamp(), 500_000, json!({"output_tokens": 7, "cost_micro_usd": 22})),
        },
        ApiCase {
            name: "responses, streamed",
            path: responses::PATH,
            headers: ACME_V2.to_vec(),
            body: responses::request(true),
            content_type: sse,
            answer: responses::timeline(),
            labels: Labels::new("responses").ctx("2k"),
            finish: "completed",
            figures: One {
                ttft_ms: Some(250),
                tpot_us: Some(20_000), // (350 − 250) ms / 5
                tps: Some(50),
                duration_ms: 360,
                input: 1500,
                output: 6,
                cached: 1024,
                cost: Some(2530),
                ..One::default()
            }
            .figures(),
            stamp: responses_stamp(),
        },
        ApiCase {
            name: "responses, whole",
            path: responses::PATH,
            headers: ACME_V2.to_vec(),
            body: responses::request(false),
            content_type: json_ct,
            answer: vec![(900, responses::response())],
            labels: Labels::new("responses").ctx("2k").stream(false),
            finish: "completed",
            figures: One { duration_ms: 900, input: 1500, output: 6, cached: 1024, cost: Some(2530), ..One::default() }.figures(),
            stamp: whole(responses_stamp(), 900_000, json!({})),
        },
        ApiCase {
            name: "messages, streamed (cumulative output usage)",
            path: messages::PATH,
            headers: vec![ACME_V2[0], ACME_V2[1], ("anthropic-version", "2023-06-01")],
            body: messages::request(true),
            content_type: sse,
            answer: messages::timeline(),
            labels: Labels::new("messages").ctx("2k"),
            finish: "end_turn",
            figures: One {
                ttft_ms: Some(400),
                tpot_us: Some(8_571), // (520 − 400) ms / 14 = 8 571 428 ns
                tps: Some(116),       // 14 / 0.12 s = 116.7
                duration_ms: 531,
                input: 1025,
                output: 15,
                cached: 1000,
                cost: Some(600),
                ..One::default()
            }
            .figures(),
            stamp: messages_stamp(),
        },
        ApiCase {
            name: "messages, whole",
            path: messages::PATH,
            headers: ACME_V2.to_vec(),
            body: messages::request(false),
            content_type: json_ct,
            answer: vec![(1200, messages::response())],
            labels: Labels::new("messages").ctx("2k").stream(false),
            finish: "end_turn",
            figures: One { duration_ms: 1200, input: 1025, output: 15, cached: 1000, cost: Some(600), ..One::default() }.figures(),
            stamp: whole(messages_stamp(), 1_200_000, json!({})),
        },
    ]
}

/// Every API, streamed and whole: exact TTFT, TPOT, decode speed, duration, tokens and cost, one
/// `requests_total`, the whole stamp, the answer passed byte-identical, nothing left in flight.
#[test]
fn every_api_streamed_and_whole_records_exact_figures() {
    for case in api_cases() {
        let got = case.play(Delivery::PerEntry, false);
        assert_eq!(got, case.expected(), "{}", case.name);
    }
}

/// The same answers one byte per body callback, streams with CRLF line endings: the same figures.
#[test]
fn every_api_one_byte_at_a_time_gives_the_same_figures() {
    for case in api_cases() {
        let got = case.play(Delivery::ByteByByte, case.sse());
        assert_eq!(got, case.expected(), "{} (byte by byte)", case.name);
    }
}

// ---------------------------------------------------------------------------------------------
// 2–4. What is and is not a first token
// ---------------------------------------------------------------------------------------------

#[test]
fn a_role_only_first_chunk_is_not_the_first_token() {
    let gw = gateway();
    let mut t = chat::timeline(true);
    t[0] = (5, chat::role()); // role-only chunk at +5 ms; first content at +180 ms
    let c = play_chat_stream(&gw, &t, Delivery::PerEntry);
    let l = Labels::new("chat_completions");
    assert_eq!(gw.histogram(&l.name("ttft_ms")), Some(vec![180]), "TTFT is 180 ms, not 5 ms");
    assert_eq!(c.stamp()["ttft_us"], json!(180_000));
    assert_eq!(figures(&gw, &l), chat_stream_figures());
}

#[test]
fn keep_alive_comments_before_content_do_not_count() {
    let gw = gateway();
    let mut t =
        vec![(20, ": keep-alive\n\n".to_string()), (60, ": keep-alive\n\n".to_string()), (100, ": ping - 2026-01-01 00:00:00.100000+00:00\n\n".to_string())];
    t.extend(chat::timeline(true));
    let c = play_chat_stream(&gw, &t, Delivery::PerEntry);
    let l = Labels::new("chat_completions");
    assert_eq!(figures(&gw, &l), chat_stream_figures());
    assert_eq!(c.stamp(), chat_stream_stamp());
    assert_eq!(c.downstream_body(), c.upstream_body);
}

#[test]
fn the_usage_chunk_is_read_whatever_its_choices_and_adds_no_content() {
    let variants = [
        ("choices: []", json!([])),
        ("choices: null", Value::Null),
        ("choices with an empty delta", json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": null}])),
        ("choices with empty content", json!([{"index": 0, "delta": {"content": ""}, "logprobs": null, "finish_reason": null}])),
    ];
    for (what, choices) in variants {
        let gw = gateway();
        let mut t = chat::timeline(false);
        let usage = chat::event(chat::usage_value(choices, 19, 9, 0));
        t.insert(t.len() - 1, (391, usage));
        let c = play_chat_stream(&gw, &t, Delivery::PerEntry);
        let l = Labels::new("chat_completions");
        assert_eq!(figures(&gw, &l), chat_stream_figures(), "{what}");
        assert_eq!(c.stamp(), chat_stream_stamp(), "{what}");
        assert_eq!(gw.counter(&l.requests_total("2xx", "stop", "reported")), Some(1), "{what}");
    }
}

// ---------------------------------------------------------------------------------------------
// 5. No usage: estimated
// ---------------------------------------------------------------------------------------------

#[test]
fn without_usage_output_tokens_are_estimated_from_content_chunks() {
    let gw = gateway();
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(true, false));
    c.sse_headers(120);
    c.body(&chat::timeline(false), Delivery::PerEntry, true);
    c.end();
    let l = Labels::new("chat_completions");
    // 9 chunks: eight of ≤ 4 characters count 1 each, " with that today" (16 characters) counts 4.
    assert_eq!(chat::ESTIMATED_TOKENS, 12);
    assert_eq!(
        figures(&gw, &l),
        One {
            ttft_ms: Some(180),
            tpot_us: Some(18_181), // 200 ms / 11
            tps: Some(55),         // 11 / 0.2 s
            duration_ms: 392,
            input: chat::REQUEST_ESTIMATE,
            output: 12,
            cost: Some(163), // 17 × 2.5 + 12 × 10 = 162.5 → 163
            ..One::default()
        }
        .figures()
    );
    assert_eq!(gw.counter(&l.requests_total("2xx", "stop", "estimated")), Some(1));
    assert_eq!(gw.counter(&l.requests_total("2xx", "stop", "reported")), None);
    assert_eq!(
        c.stamp(),
        with(
            &chat_stream_stamp(),
            json!({"usage": "estimated", "input_tokens": 17, "output_tokens": 12, "tpot_us": 18_181,
                   "decode_tokens_per_s": 55, "cost_micro_usd": 163})
        )
    );
}

// ---------------------------------------------------------------------------------------------
// 6. Framing: CRLF, CR, one byte at a time
// ---------------------------------------------------------------------------------------------

#[test]
fn line_endings_and_chunking_do_not_change_the_figures() {
    let lf = chat::timeline(true);
    let with_endings = |ending: &str| -> Vec<(u64, String)> { lf.iter().map(|(t, s)| (*t, s.replace('\n', ending))).collect() };
    let cases = [
        ("LF, one call per event", lf.clone(), Delivery::PerEntry),
        ("CRLF, one call per event", with_endings("\r\n"), Delivery::PerEntry),
        ("CR, one call per event", with_endings("\r"), Delivery::PerEntry),
        ("LF, one call per byte", lf.clone(), Delivery::ByteByByte),
        // CRLF one call per byte: every_api_one_byte_at_a_time_gives_the_same_figures.
        ("CR, one call per byte", with_endings("\r"), Delivery::ByteByByte),
    ];
    for (what, timeline, delivery) in cases {
        let gw = gateway();
        let c = play_chat_stream(&gw, &timeline, delivery);
        assert_no_crash(&gw);
        let l = Labels::new("chat_completions");
        assert_eq!(figures(&gw, &l), chat_stream_figures(), "{what}");
        assert_eq!(c.stamp(), chat_stream_stamp(), "{what}");
        assert_eq!(gw.counter(&l.requests_total("2xx", "stop", "reported")), Some(1), "{what}");
        assert_eq!(c.downstream_body(), c.upstream_body, "{what}: byte-identical");
    }
}

// ---------------------------------------------------------------------------------------------
// 7–8. Errors and interruptions
// ---------------------------------------------------------------------------------------------

#[test]
fn an_upstream_5xx_is_an_upstream_error() {
    let gw = gateway();
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(true, true));
    c.response_headers(35, "500", "application/json");
    let body = json!({"error": {"message": "The server had an error while processing your request. Sorry about that!",
                                "type": "server_error", "param": null, "code": null}})
    .to_string();
    c.body(&[(35, body.clone())], Delivery::PerEntry, true);
    c.end();
    let l = Labels::new("chat_completions").stream(false);
    assert_eq!(gw.counter(&l.name("upstream_errors_total")), Some(1));
    assert_eq!(gw.counter(&l.name("client_disconnects_total")), None);
    assert_eq!(gw.counter(&l.requests_total("5xx", "none", "estimated")), Some(1));
    assert_eq!(gw.histogram(&l.name("ttft_ms")), None);
    assert_eq!(gw.histogram(&l.name("request_duration_ms")), Some(vec![35]));
    assert_eq!(gw.histogram(&l.name("output_tokens")), Some(vec![0]));
    let stamp = c.stamp();
    assert_eq!(stamp["status"], json!(500));
    assert_eq!(stamp["outcome"], json!("upstream_error"));
    assert_eq!(stamp["upstream_error"], json!("The server had an error while processing your request. Sorry about that!"));
    assert_eq!(stamp["output_tokens"], json!(0));
    // The model never ran the prompt: no input tokens, the request counts as an error instead.
    assert_eq!(stamp["input_tokens"], json!(0));
    assert_eq!(gw.counter(&l.name("input_tokens_total")).unwrap_or(0), 0);
    assert_eq!(gw.histogram(&l.name("input_tokens")), Some(vec![0]));
    assert_eq!(stamp["usage"], json!("estimated"));
    assert_eq!(stamp["ttft_us"], Value::Null);
    assert_eq!(c.downstream_body(), body.as_bytes());
    assert_eq!(gw.gauge("sluice.in_flight.model_version.v2"), Some(0));
}

#[test]
fn an_upstream_reset_before_headers_is_an_upstream_error() {
    let gw = gateway();
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(true, true));
    c.at(30);
    c.stream.upstream_reset().unwrap();
    let l = Labels::new("chat_completions").stream(false);
    assert_eq!(gw.counter(&l.name("upstream_errors_total")), Some(1));
    assert_eq!(gw.counter(&l.requests_total("5xx", "none", "estimated")), Some(1));
    assert_eq!(gw.histogram(&l.name("request_duration_ms")), Some(vec![30]));
    assert_eq!(c.stamp()["outcome"], json!("upstream_error"));
    assert_eq!(c.stamp()["status"], json!(503));
    assert_eq!(gw.gauge("sluice.in_flight.model_version.v2"), Some(0));
}

/// Plays the standard chat stream up to and including the third content chunk (+230 ms).
fn chat_stream_cut_after_three_chunks(gw: &Gateway) -> Call<'_> {
    let mut c = Call::start(gw, &headers(chat::PATH, &ACME_V2), &chat::request(true, true));
    assert_eq!(gw.gauge("sluice.in_flight.model_version.v2"), Some(1), "in flight from the request headers on");
    c.sse_headers(120);
    let t = chat::timeline(true);
    c.body(&t[..4], Delivery::PerEntry, false); // role, "Hi", "!", " How"
    assert_eq!(gw.gauge("sluice.in_flight.model_version.v2"), Some(1));
    c
}

#[test]
fn a_client_disconnect_mid_stream_counts_the_tokens_seen_so_far() {
    let gw = gateway();
    let mut c = chat_stream_cut_after_three_chunks(&gw);
    c.at(300);
    c.stream.client_reset().unwrap();
    let l = Labels::new("chat_completions");
    // Estimated: "Hi", "!", " How": 3 tokens over (230 − 180) ms.
    assert_eq!(
        figures(&gw, &l),
        One {
            ttft_ms: Some(180),
            tpot_us: Some(25_000), // 50 ms / 2
            tps: Some(40),         // 2 / 0.05 s
            duration_ms: 300,
            input: chat::REQUEST_ESTIMATE,
            output: 3,
            cost: Some(73), // 17 × 2.5 + 3 × 10 = 72.5 → 73
            client_disconnect: true,
            ..One::default()
        }
        .figures()
    );
    assert_eq!(gw.counter(&l.requests_total("2xx", "none", "estimated")), Some(1));
    let stamp = c.stamp();
    assert_eq!(stamp["outcome"], json!("client_disconnect"));
    assert_eq!(stamp["content_chunks"], json!(3));
    assert_eq!(stamp["output_tokens"], json!(3));
    assert_eq!(stamp["duration_us"], json!(300_000));
    assert_eq!(stamp["finish_reason"], Value::Null);
    assert_eq!(gw.gauge("sluice.in_flight.model_version.v2"), Some(0));
}

#[test]
fn an_upstream_reset_mid_stream_is_an_upstream_error() {
    let gw = gateway();
    let mut c = chat_stream_cut_after_three_chunks(&gw);
    c.at(300);
    c.stream.upstream_reset().unwrap();
    let l = Labels::new("chat_completions");
    let expected = One {
        ttft_ms: Some(180),
        tpot_us: Some(25_000),
        tps: Some(40),
        duration_ms: 300,
        input: chat::REQUEST_ESTIMATE,
        output: 3,
        cost: Some(73),
        upstream_error: true,
        ..One::default()
    };
    assert_eq!(figures(&gw, &l), expected.figures());
    assert_eq!(gw.counter(&l.requests_total("2xx", "none", "estimated")), Some(1));
    assert_eq!(c.stamp()["outcome"], json!("upstream_error"));
    assert_eq!(gw.gauge("sluice.in_flight.model_version.v2"), Some(0));
}

// ---------------------------------------------------------------------------------------------
// 9. Malformed input never traps and passes untouched
// ---------------------------------------------------------------------------------------------

/// A chat stream with broken JSON, garbage lines, non-UTF-8 bytes, two `data:` lines that make one
/// invalid event, a non-string content, and a last event that lacks its blank line. Only the three
/// valid content events (A at +180, B at +200, C at +220 ms) count.
fn malformed_stream() -> Vec<(u64, Vec<u8>)> {
    let valid = |text: &str| chat::content(text).into_bytes();
    let mut last = chat::event(chat::chunk_value(json!({"content": "C"}), Some("stop")));
    last.truncate(last.len() - 2); // no blank line: the stream just ends
    vec![
        (120, chat::role().into_bytes()),
        (130, b"data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\n\n".to_vec()),
        (140, b"this line is garbage\n\xff\xfe\x00 binary junk \xc3\x28\nretry: 1000\nid: 7\n\n".to_vec()),
        (150, [chat::content("lost").trim_end().as_bytes(), b"\n", chat::content("lost too").as_bytes()].concat()),
        (160, b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":5}}]}\n\n".to_vec()),
        (170, b"data: [1, 2, 3]\n\ndata: \"just a string\"\n\ndata: null\n\nevent: weird\n\n".to_vec()),
        (180, valid("A")),
        (200, valid("B")),
        (220, last.into_bytes()),
    ]
}

#[test]
fn malformed_events_and_malformed_sse_never_trap_and_pass_byte_identical() {
    let gw = gateway();
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(true, false));
    c.sse_headers(120);
    let t = malformed_stream();
    for (i, (ms, bytes)) in t.iter().enumerate() {
        c.body_bytes(*ms, bytes, i + 1 == t.len());
    }
    c.end();
    assert_no_crash(&gw);
    assert_eq!(c.downstream_body(), c.upstream_body, "byte-identical");
    let l = Labels::new("chat_completions");
    assert_eq!(
        figures(&gw, &l),
        One {
            ttft_ms: Some(180),
            tpot_us: Some(20_000), // (220 − 180) ms / 2
            tps: Some(50),
            duration_ms: 220,
            input: chat::REQUEST_ESTIMATE,
            output: 3,
            cost: Some(73), // 17 × 2.5 + 3 × 10 = 72.5 → 73
            ..One::default()
        }
        .figures()
    );
    let stamp = c.stamp();
    assert_eq!(stamp["content_chunks"], json!(3));
    assert_eq!(stamp["finish_reason"], json!("stop"));
    assert_eq!(stamp["outcome"], json!("completed"));
}

#[test]
fn malformed_stream_one_byte_at_a_time_with_summary_never_traps() {
    let gw = gateway_with(&config_with(json!({"stream_summary_comment": true})));
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(true, false));
    c.sse_headers(120);
    let t: Vec<(u64, String)> = malformed_stream().into_iter().map(|(ms, b)| (ms, String::from_utf8_lossy(&b).into_owned())).collect();
    c.body(&t, Delivery::ByteByByte, true);
    c.end();
    assert_no_crash(&gw);
    let down = c.downstream_body();
    let summary = b": sluice ttft_us=180000 tpot_us=20000 output_tokens=3 input_tokens=17 usage=estimated\n\n";
    assert!(down.starts_with(&c.upstream_body), "the upstream bytes reach the client unchanged");
    assert!(down.ends_with(summary), "{}", String::from_utf8_lossy(&down[c.upstream_body.len()..]));
    assert_eq!(c.stamp()["content_chunks"], json!(3));
}

#[test]
fn the_summary_comment_never_corrupts_an_unterminated_last_event() {
    let gw = gateway_with(&config_with(json!({"stream_summary_comment": true})));
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(true, false));
    c.sse_headers(120);
    let mut t = chat::timeline(false);
    t.pop(); // no [DONE]
    let last = t.last_mut().unwrap();
    last.1.truncate(last.1.len() - 2); // the finish chunk ends without "\n\n" (servers do this)
    let last_line = last.1.clone();
    c.body(&t, Delivery::PerEntry, true);
    c.end();
    let down = String::from_utf8(c.downstream_body()).unwrap();
    assert!(down.lines().any(|l| l == last_line), "the client must still see the last data line intact; it got:\n{}", &down[down.len().saturating_sub(300)..]);
}

// ---------------------------------------------------------------------------------------------
// 10. Request bodies the plugin does not inspect
// ---------------------------------------------------------------------------------------------

/// Sends `body` with `extra` headers and a short streamed answer without usage (so no figure can
/// come from anywhere but the request body), then returns the call.
fn uninspected<'g>(gw: &'g Gateway, extra: &[(&str, &str)], body: &[u8], chunks: usize) -> Call<'g> {
    let mut h = headers(chat::PATH, &ACME_V2);
    h.extend_from_slice(extra);
    let raw: Vec<(&[u8], &[u8])> = h.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())).collect();
    let mut stream = gw.stream();
    let start_ns = gw.now_ns();
    stream.request_headers(&raw, false).unwrap();
    let piece = body.len().div_ceil(chunks);
    let pieces: Vec<&[u8]> = body.chunks(piece).collect();
    for (i, p) in pieces.iter().enumerate() {
        stream.request_body(p, i + 1 == pieces.len()).unwrap();
    }
    assert_eq!(stream.upstream_request_body(), body, "the request body passes untouched");
    let mut c = Call { gw, stream, start_ns, upstream_body: Vec::new() };
    c.sse_headers(100);
    c.body(&[(100, chat::content("Hi")), (150, chat::finish("stop")), (151, chat::DONE.to_string())], Delivery::PerEntry, true);
    c.end();
    c
}

#[test]
fn a_request_body_that_is_not_json_is_counted_as_malformed() {
    let gw = gateway();
    let c = uninspected(&gw, &[], b"{\"model\": \"gpt-4o\", \"messages\": [", 1);
    assert_eq!(gw.counter("sluice.request_body_uninspected_total.reason.malformed"), Some(1));
    assert_eq!(gw.counter("sluice.request_body_uninspected_total.reason.encoded"), None);
    let l = Labels::new("chat_completions").ctx("unknown").turn("unknown");
    assert_eq!(gw.counter(&l.requests_total("2xx", "stop", "estimated")), Some(1));
    let stamp = c.stamp();
    assert_eq!((stamp["ctx"].clone(), stamp["turn"].clone(), stamp["model"].clone()), (json!("unknown"), json!("unknown"), Value::Null));
    assert_eq!(stamp["output_tokens"], json!(1));
    assert_eq!(stamp["ttft_us"], json!(100_000));
    assert_no_crash(&gw);
}

#[test]
fn a_gzip_request_body_is_counted_as_encoded() {
    let gw = gateway();
    // A gzip member header and some deflate bytes: not something to parse.
    let gz = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03\xabV\xca\xcdOI\xcdQ\xb2RJ\xaf(\xd1\x35\xc9\x07\x00\xff\xff";
    let c = uninspected(&gw, &[("content-encoding", "gzip")], gz, 1);
    assert_eq!(gw.counter("sluice.request_body_uninspected_total.reason.encoded"), Some(1));
    assert_eq!(gw.counter("sluice.request_body_uninspected_total.reason.malformed"), None);
    let l = Labels::new("chat_completions").ctx("unknown").turn("unknown");
    assert_eq!(gw.counter(&l.requests_total("2xx", "stop", "estimated")), Some(1));
    assert_eq!(c.stamp()["ctx"], json!("unknown"));
    assert_no_crash(&gw);
}

#[test]
fn a_request_body_over_the_cap_is_counted_as_too_large() {
    let gw = gateway_with(&config_with(json!({"max_request_body_bytes": 1024})));
    let long = "x".repeat(3000);
    let body = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": long}], "stream": true}).to_string();
    let c = uninspected(&gw, &[], body.as_bytes(), 3);
    assert_eq!(gw.counter("sluice.request_body_uninspected_total.reason.too_large"), Some(1));
    assert_eq!(gw.counter("sluice.request_body_uninspected_total.reason.malformed"), None);
    let l = Labels::new("chat_completions").ctx("unknown").turn("unknown");
    assert_eq!(gw.counter(&l.requests_total("2xx", "stop", "estimated")), Some(1));
    let stamp = c.stamp();
    assert_eq!((stamp["ctx"].clone(), stamp["turn"].clone()), (json!("unknown"), json!("unknown")));
    assert_eq!(stamp["input_tokens"], json!(0), "nothing to estimate from");
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 11. A 50 MB stream in bounded memory
// ---------------------------------------------------------------------------------------------

#[test]
fn a_50_mb_stream_is_measured_in_bounded_memory() {
    let gw = gateway();
    // Baseline: a 10-content-event stream.
    {
        let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(true, false));
        c.sse_headers(100);
        let t: Vec<(u64, String)> = (0..10).map(|i| (100 + i, chat::content("ab"))).collect();
        c.body(&t, Delivery::PerEntry, true);
        c.end();
    }
    let baseline = gw.memory_bytes().expect("the plugin exports its memory");

    let event = format!(
        "data: {}\n\n",
        json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1741570283, "model": "gpt-4o-mini",
               "choices": [{"index": 0, "delta": {"content": "ab"}, "finish_reason": null}]})
    );
    let n = (50usize << 20).div_ceil(event.len());
    let mut body = Vec::with_capacity(n * event.len() + 16);
    for _ in 0..n {
        body.extend_from_slice(event.as_bytes());
    }
    let last_content_end = body.len();
    body.extend_from_slice(chat::DONE.as_bytes());

    const CHUNK: usize = 64 * 1024;
    let mut s = gw.stream();
    let start = gw.now_ns();
    s.request_headers(&headers(chat::PATH, &[("x-sluice-tenant", "acme"), ("x-model-version", "big")]), false).unwrap();
    s.request_body(chat::request(true, false).as_bytes(), true).unwrap();
    gw.advance(std::time::Duration::from_millis(100)).unwrap();
    s.response_headers(&[(":status", "200"), ("content-type", "text/event-stream")], false).unwrap();
    let chunks: Vec<&[u8]> = body.chunks(CHUNK).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        if i > 0 {
            gw.advance(std::time::Duration::from_millis(1)).unwrap();
        }
        s.response_body(chunk, i + 1 == chunks.len()).unwrap();
    }
    let end_ms = (gw.now_ns() - start) / 1_000_000;
    s.end().unwrap();
    assert_no_crash(&gw);

    let after = gw.memory_bytes().unwrap();
    assert!(after <= baseline + (1 << 20), "linear memory grew from {baseline} to {after} bytes over a {} byte stream", body.len());

    // The last content event ends in chunk (last_content_end − 1) / CHUNK, at +100 ms + that many ms.
    let last_chunk = ((last_content_end - 1) / CHUNK) as u64;
    let n = n as u64;
    let l = Labels::new("chat_completions").model_version("big");
    let raw: Value = serde_json::from_slice(&s.filter_state("sluice_llm").unwrap()).unwrap();
    assert_eq!(raw["output_tokens"], json!(n), "one estimated token per \"ab\" event");
    assert_eq!(raw["content_chunks"], json!(n));
    assert_eq!(raw["usage"], json!("estimated"));
    assert_eq!(gw.histogram(&l.name("ttft_ms")), Some(vec![100]));
    assert_eq!(gw.histogram(&l.name("tpot_us")), Some(vec![last_chunk * 1_000_000 / (n - 1) / 1000]));
    assert_eq!(gw.histogram(&l.name("request_duration_ms")), Some(vec![end_ms]));
    assert_eq!(gw.counter(&l.name("output_tokens_total")), Some(n));
    let down = s.downstream_body();
    assert!(down.len() == body.len() && down == body, "the stream passes byte-identical");
}

// ---------------------------------------------------------------------------------------------
// 12. Hostile header bytes
// ---------------------------------------------------------------------------------------------

fn label_safe(name: &str) -> bool {
    name.split('.').all(|seg| !seg.is_empty() && seg.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-'))
}

#[test]
fn non_utf8_header_values_never_trap_and_labels_are_sanitized() {
    let gw = gateway();
    let body = chat::request(true, true);
    let headers: Vec<(&[u8], &[u8])> = vec![
        (b":method", b"POST"),
        (b":path", chat::PATH.as_bytes()),
        (b":authority", b"llm.internal"),
        (b"content-type", b"application/json"),
        (b"x-sluice-tenant", b"\xff\xfe"),
        (b"x-model-version", b"v2\xff\xfe.tenant.evil"),
    ];
    let mut c = Call::start_raw(&gw, &headers, body.as_bytes());
    c.sse_headers(120);
    c.body(&chat::timeline(true), Delivery::PerEntry, true);
    c.end();
    assert_no_crash(&gw);
    let names = gw.metric_names();
    assert!(!names.is_empty());
    for name in &names {
        assert!(label_safe(name), "unsafe metric name {name:?}");
    }
    // Each non-UTF-8 byte becomes one U+FFFD, then `_`; the dots cannot inject labels.
    let l = Labels::new("chat_completions").model_version("v2___tenant_evil").tenant("other");
    assert_eq!(figures(&gw, &l), chat_stream_figures());
    assert_eq!(c.stamp(), with(&chat_stream_stamp(), json!({"model_version": "v2___tenant_evil", "tenant": "other"})));
    assert_eq!(gw.gauge("sluice.in_flight.model_version.v2___tenant_evil"), Some(0));

    // An unknown but well-formed tenant is `other`; a missing one is `anonymous`.
    for (tenant, label) in [(Some("initech"), "other"), (None, "anonymous")] {
        let mut extra = vec![("x-model-version", "v2")];
        if let Some(t) = tenant {
            extra.push(("x-sluice-tenant", t));
        }
        let mut c = Call::start(&gw, &headers_vec(&extra), &chat::request(false, false));
        c.response_headers(50, "200", "application/json");
        c.body(&[(50, chat::response(19, 9))], Delivery::PerEntry, true);
        c.end();
        assert_eq!(c.stamp()["tenant"], json!(label));
    }
    let other = Labels::new("chat_completions").tenant("other").stream(false);
    assert_eq!(gw.counter(&other.requests_total("2xx", "stop", "reported")), Some(1));
}

fn headers_vec<'a>(extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    headers(chat::PATH, extra)
}

// ---------------------------------------------------------------------------------------------
// 13. Turn and context labels
// ---------------------------------------------------------------------------------------------

#[test]
fn a_conversation_with_an_earlier_assistant_message_is_a_follow_up() {
    let gw = gateway();
    let body = json!({
        "model": "gpt-4o",
        "messages": [
            {"role": "system", "content": "You are a calculator."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And times 3?"}
        ]
    })
    .to_string();
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &body);
    c.response_headers(300, "200", "application/json");
    c.body(&[(300, chat::response(31, 2))], Delivery::PerEntry, true);
    c.end();
    let l = Labels::new("chat_completions").turn("follow_up").stream(false);
    assert_eq!(gw.counter(&l.requests_total("2xx", "stop", "reported")), Some(1));
    assert_eq!(c.stamp()["turn"], json!("follow_up"));

    let body = json!({
        "model": "claude-sonnet-4-5", "max_tokens": 512,
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
            {"role": "user", "content": "Tell me a fact."}
        ]
    })
    .to_string();
    let mut c = Call::start(&gw, &headers(messages::PATH, &ACME_V2), &body);
    c.response_headers(300, "200", "application/json");
    c.body(&[(300, messages::response())], Delivery::PerEntry, true);
    c.end();
    let l = Labels::new("messages").ctx("2k").turn("follow_up").stream(false);
    assert_eq!(gw.counter(&l.requests_total("2xx", "end_turn", "reported")), Some(1));
}

#[test]
fn a_long_prompt_is_in_the_over_16k_context_bucket() {
    let gw = gateway();
    let system = "You are a helpful assistant.";
    let user = "All work and no play makes Jack a dull boy. ".repeat(1820);
    let body = json!({
        "model": "gpt-4o", "stream": true,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]
    })
    .to_string();
    // ⌈(28 + 80 080) / 4⌉ + 2 messages × 4 = 20 027 + 8
    let estimate = 20_035;
    assert_eq!(system.len() + user.len(), 80_108);
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &body);
    c.sse_headers(120);
    c.body(&chat::timeline(false), Delivery::PerEntry, true);
    c.end();
    let l = Labels::new("chat_completions").ctx("over_16k");
    assert_eq!(gw.counter(&l.requests_total("2xx", "stop", "estimated")), Some(1));
    assert_eq!(gw.histogram(&l.name("input_tokens")), Some(vec![estimate]));
    assert_eq!(gw.histogram(&l.name("ttft_ms")), Some(vec![180]));
    let stamp = c.stamp();
    assert_eq!((stamp["ctx"].clone(), stamp["input_tokens"].clone()), (json!("over_16k"), json!(estimate)));
}

#[test]
fn reported_prompt_tokens_decide_the_context_bucket() {
    let gw = gateway();
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(false, false));
    c.response_headers(300, "200", "application/json");
    c.body(&[(300, chat::response(16_385, 9))], Delivery::PerEntry, true);
    c.end();
    let l = Labels::new("chat_completions").ctx("over_16k").stream(false);
    assert_eq!(gw.counter(&l.requests_total("2xx", "stop", "reported")), Some(1));
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(false, false));
    c.response_headers(300, "200", "application/json");
    c.body(&[(300, chat::response(16_384, 9))], Delivery::PerEntry, true);
    c.end();
    let l = Labels::new("chat_completions").ctx("16k").stream(false);
    assert_eq!(gw.counter(&l.requests_total("2xx", "stop", "reported")), Some(1));
}

// ---------------------------------------------------------------------------------------------
// 14. The summary comment
// ---------------------------------------------------------------------------------------------

#[test]
fn the_summary_comment_reaches_the_client_at_the_end_of_the_stream() {
    let gw = gateway_with(&config_with(json!({"stream_summary_comment": true})));
    let c = play_chat_stream(&gw, &chat::timeline(true), Delivery::PerEntry);
    let mut expected = c.upstream_body.clone();
    expected.extend_from_slice(b": sluice ttft_us=180000 tpot_us=25000 output_tokens=9 input_tokens=19 usage=reported\n\n");
    assert_eq!(String::from_utf8(c.downstream_body()).unwrap(), String::from_utf8(expected).unwrap());
    assert_eq!(c.stamp(), chat_stream_stamp(), "the comment changes no figure");

    // Estimated usage says so.
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(true, false));
    c.sse_headers(120);
    c.body(&chat::timeline(false), Delivery::PerEntry, true);
    c.end();
    let down = c.downstream_body();
    assert_eq!(&down[..c.upstream_body.len()], &c.upstream_body[..]);
    assert_eq!(
        String::from_utf8_lossy(&down[c.upstream_body.len()..]),
        ": sluice ttft_us=180000 tpot_us=18181 output_tokens=12 input_tokens=17 usage=estimated\n\n"
    );

    // A non-streamed answer is JSON: nothing is appended to it.
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(false, false));
    c.response_headers(300, "200", "application/json");
    c.body(&[(300, chat::response(19, 9))], Delivery::PerEntry, true);
    c.end();
    assert_eq!(c.downstream_body(), c.upstream_body);
}

#[test]
fn without_the_summary_comment_every_stream_is_byte_identical() {
    let gw = gateway();
    let c = play_chat_stream(&gw, &chat::timeline(true), Delivery::PerEntry);
    assert_eq!(c.downstream_body(), c.upstream_body);
    let mut c = Call::start(&gw, &headers(responses::PATH, &ACME_V2), &responses::request(true));
    c.sse_headers(200);
    c.body(&responses::timeline(), Delivery::PerEntry, true);
    c.end();
    assert_eq!(c.downstream_body(), c.upstream_body);
}

// ---------------------------------------------------------------------------------------------
// 15. Traffic that is not measured
// ---------------------------------------------------------------------------------------------

#[test]
fn non_llm_paths_define_no_metric_and_write_no_stamp() {
    let gw = gateway();
    let cases: [(&str, &str); 5] = [
        ("GET", "/healthz"),
        ("GET", "/v1/models"),
        ("POST", "/v1/messages/count_tokens"),
        ("POST", "/openai/v1/chat/completions"), // an LLM path, but outside path_prefixes ["/v1/"]
        ("GET", "/v1/responses/resp_123"),
    ];
    for (method, path) in cases {
        let mut s = gw.stream();
        s.request_headers(&[(":method", method), (":path", path), ("x-sluice-tenant", "acme")], method == "GET").unwrap();
        if method == "POST" {
            s.request_body(chat::request(true, true).as_bytes(), true).unwrap();
        }
        gw.advance(std::time::Duration::from_millis(5)).unwrap();
        s.response_headers(&[(":status", "200"), ("content-type", "text/event-stream")], false).unwrap();
        let body = chat::timeline(true).into_iter().map(|(_, b)| b).collect::<String>();
        s.response_body(body.as_bytes(), true).unwrap();
        s.end().unwrap();
        assert_eq!(s.filter_state("sluice_llm"), None, "{path}");
        assert_eq!(s.downstream_body(), body.as_bytes(), "{path}");
    }
    assert_eq!(gw.metric_names(), Vec::<String>::new());
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 16. Configuration errors
// ---------------------------------------------------------------------------------------------

#[test]
fn configuration_errors_are_refused_at_load_with_precise_messages() {
    let cases = [
        (r#"{"path_prefixes": ["v1/"]}"#, r#"path_prefixes[0]: must start with '/', got "v1/""#),
        (r#"{"path_prefixes": ["/v1/", "openai"]}"#, r#"path_prefixes[1]: must start with '/', got "openai""#),
        (r#"{"path_prefixes": []}"#, "path_prefixes: must list at least one prefix"),
        (r#"{"path_prefix": ["/v1/"]}"#, "unknown field `path_prefix`"),
        (r#"{"tenant": {"header": ""}}"#, "tenant.header: must not be empty"),
        (r#"{"tenant": {"cookie": "session"}}"#, "unknown variant `cookie`"),
        (r#"{"model_version_header": "x model"}"#, "model_version_header: must be a header name"),
        (r#"{"max_dynamic_model_versions": 5000}"#, "max_dynamic_model_versions: at most 1000"),
        (r#"{"max_request_body_bytes": 1000000000}"#, "max_request_body_bytes: at most 67108864 bytes, got 1000000000"),
        (r#"{"filter_state_key": "sluice llm"}"#, "filter_state_key: must be letters, digits"),
        (
            r#"{"prices": [{"model": "gpt-4o*", "input_usd_per_mtok": -1, "output_usd_per_mtok": 10}]}"#,
            "prices[0].input_usd_per_mtok: must be a finite number >= 0, got -1",
        ),
        (r#"{"prices": [{"model": "gpt-4o*", "input_usd_per_mtok": 1}]}"#, "missing field `output_usd_per_mtok`"),
        ("{not json", "configuration is not valid JSON"),
    ];
    for (config, message) in cases {
        let error = match Gateway::start(&plugin(), common::llm::spec(config)) {
            Ok(_) => panic!("accepted {config}"),
            Err(e) => format!("{e:#}"),
        };
        assert!(error.contains("proxy_on_configure returned false"), "{config}: {error}");
        assert!(error.contains(message), "{config}: expected {message:?} in: {error}");
    }
    // The shipped configuration and an empty one load.
    assert!(Gateway::start(&plugin(), common::llm::spec(CONFIG)).is_ok());
    assert!(Gateway::start(&plugin(), common::llm::spec("")).is_ok());
}

// ---------------------------------------------------------------------------------------------
// 17. model_version: source and cardinality
// ---------------------------------------------------------------------------------------------

/// A non-streamed chat call with `extra` headers and a body asking for `model`; returns the stamp.
fn quick_chat(gw: &Gateway, extra: &[(&str, &str)], model: &str) -> Value {
    let body = json!({"model": model, "messages": [{"role": "user", "content": "Hello!"}]}).to_string();
    let mut c = Call::start(gw, &headers(chat::PATH, extra), &body);
    c.response_headers(100, "200", "application/json");
    c.body(&[(100, chat::response(10, 9))], Delivery::PerEntry, true);
    c.end();
    c.stamp()
}

#[test]
fn model_version_falls_back_to_the_body_model_and_the_header_wins() {
    let gw = gateway();
    // No header: the body's model, sanitized ('.' is not a label character).
    let mut c = Call::start(
        &gw,
        &headers(chat::PATH, &[("x-sluice-tenant", "acme")]),
        &json!({
        "model": "gpt-4.1-mini", "messages": [{"role": "user", "content": "Hello!"}]})
        .to_string(),
    );
    assert_eq!(gw.gauge("sluice.in_flight.model_version.gpt-4_1-mini"), Some(1), "in flight once the body names it");
    c.response_headers(100, "200", "application/json");
    c.body(&[(100, chat::response(10, 9))], Delivery::PerEntry, true);
    c.end();
    assert_eq!(c.stamp()["model_version"], json!("gpt-4_1-mini"));
    assert_eq!(gw.gauge("sluice.in_flight.model_version.gpt-4_1-mini"), Some(0));
    let l = Labels::new("chat_completions").model_version("gpt-4_1-mini").stream(false);
    assert_eq!(gw.counter(&l.requests_total("2xx", "stop", "reported")), Some(1));

    // The header wins over the body.
    let stamp = quick_chat(&gw, &[("x-sluice-tenant", "acme"), ("x-model-version", "canary-7")], "gpt-4.1-mini");
    assert_eq!(stamp["model_version"], json!("canary-7"));
    assert_eq!(stamp["model"], json!("gpt-4.1-mini"));
    let l = Labels::new("chat_completions").model_version("canary-7").stream(false);
    assert_eq!(gw.counter(&l.requests_total("2xx", "stop", "reported")), Some(1));
}

#[test]
fn model_versions_beyond_the_dynamic_limit_are_other() {
    let gw = gateway_with(&config_with(json!({"model_versions": ["stable"], "max_dynamic_model_versions": 2})));
    let seen: Vec<Value> = ["stable", "v1", "v2", "v3", "v1", "stable", "v4"]
        .iter()
        .map(|v| quick_chat(&gw, &[("x-sluice-tenant", "acme"), ("x-model-version", v)], "gpt-4o")["model_version"].clone())
        .collect();
    assert_eq!(seen, ["stable", "v1", "v2", "other", "v1", "stable", "other"].map(|s| json!(s)));
    let count = |mv: &str| gw.counter(&Labels::new("chat_completions").model_version(mv).stream(false).requests_total("2xx", "stop", "reported"));
    assert_eq!((count("stable"), count("v1"), count("v2"), count("other")), (Some(2), Some(2), Some(1), Some(2)));
    assert_eq!((count("v3"), count("v4")), (None, None));
    assert_eq!(gw.gauge("sluice.in_flight.model_version.other"), Some(0));
    assert_eq!(gw.gauge("sluice.in_flight.model_version.v3"), None);
}

// ---------------------------------------------------------------------------------------------
// Documented behaviour the plugin does not follow
// ---------------------------------------------------------------------------------------------

#[test]
fn a_4xx_error_body_is_not_an_upstream_error() {
    let gw = gateway();
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(false, false));
    c.response_headers(40, "400", "application/json");
    let body = json!({"error": {"message": "'messages' is a required property", "type": "invalid_request_error",
                                "param": null, "code": null}})
    .to_string();
    c.body(&[(40, body)], Delivery::PerEntry, true);
    c.end();
    let l = Labels::new("chat_completions").stream(false);
    assert_eq!(gw.counter(&l.requests_total("4xx", "none", "estimated")), Some(1));
    let stamp = c.stamp();
    assert_eq!(stamp["upstream_error"], json!("'messages' is a required property"));
    assert_eq!(gw.counter(&l.name("upstream_errors_total")), None);
    assert_eq!(stamp["outcome"], json!("completed"));
}

// ---------------------------------------------------------------------------------------------
// Replies the gateway generated itself (another sluice plugin's refusal or deadline)
// ---------------------------------------------------------------------------------------------

/// latency-guard answered 504 at the TTFT deadline while it held the upstream's 200 headers: the
/// request is a 504 with outcome `deadline` here too, not a 2xx client disconnect, and no prompt
/// tokens are counted (nothing was produced).
#[test]
fn a_guard_504_is_a_504_with_outcome_deadline() {
    let gw = gateway();
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(true, true));
    c.sse_headers(20);
    c.body(&[(20, chat::role())], Delivery::PerEntry, false);
    c.at(1000);
    c.stream.set_property(&["sluice_gateway_reply"], "504 deadline");
    c.end();
    let l = Labels::new("chat_completions");
    assert_eq!(gw.counter(&l.requests_total("5xx", "none", "estimated")), Some(1));
    assert_eq!(gw.counter(&l.requests_total("2xx", "none", "estimated")), None);
    assert_eq!(gw.counter(&l.name("client_disconnects_total")), None);
    assert_eq!(gw.counter(&l.name("upstream_errors_total")), None);
    assert_eq!(gw.counter(&format!("{}.reason.deadline", l.name("gateway_replies_total"))), Some(1));
    assert_eq!(gw.counter(&l.name("input_tokens_total")).unwrap_or(0), 0);
    assert_eq!(gw.histogram(&l.name("ttft_ms")), None);
    let stamp = c.stamp();
    assert_eq!((stamp["status"].clone(), stamp["outcome"].clone()), (json!(504), json!("deadline")));
    assert_eq!((stamp["input_tokens"].clone(), stamp["output_tokens"].clone()), (json!(0), json!(0)));
    assert_eq!(stamp["cost_micro_usd"], Value::Null);
}

/// A stream latency-guard ended at its total deadline with an error event: the client saw 200
/// and the tokens before the cut, which were produced and are counted; the outcome is `deadline`.
#[test]
fn a_stream_ended_at_the_total_deadline_keeps_its_tokens_with_outcome_deadline() {
    let gw = gateway();
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(true, true));
    c.sse_headers(20);
    c.body(&[(20, chat::role()), (100, chat::content("a")), (150, chat::content("b"))], Delivery::PerEntry, false);
    c.stream.set_property(&["sluice_gateway_reply"], "200 deadline");
    c.at(4000);
    c.end();
    let l = Labels::new("chat_completions");
    assert_eq!(gw.counter(&l.requests_total("2xx", "none", "estimated")), Some(1));
    assert_eq!(gw.counter(&format!("{}.reason.deadline", l.name("gateway_replies_total"))), Some(1));
    assert_eq!(gw.counter(&l.name("client_disconnects_total")), None);
    let stamp = c.stamp();
    assert_eq!((stamp["status"].clone(), stamp["outcome"].clone()), (json!(200), json!("deadline")));
    assert_eq!(stamp["output_tokens"], json!(2));
    assert_eq!(stamp["input_tokens"], json!(chat::REQUEST_ESTIMATE));
    assert_eq!(stamp["ttft_us"], json!(100_000));
}

/// tenant-budget refused the request (429 through the filter chain): outcome `refused`, no tokens.
#[test]
fn a_budget_refusal_is_refused_not_completed() {
    let gw = gateway();
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(true, true));
    c.stream.set_property(&["sluice_gateway_reply"], "429 refused");
    c.response_headers(1, "429", "application/json");
    c.body(&[(1, r#"{"error":{"message":"budget","type":"budget_exceeded","code":"key:k:minute:total_tokens"}}"#.to_string())], Delivery::PerEntry, true);
    c.end();
    let l = Labels::new("chat_completions").stream(false);
    assert_eq!(gw.counter(&l.requests_total("4xx", "none", "estimated")), Some(1));
    assert_eq!(gw.counter(&format!("{}.reason.refused", l.name("gateway_replies_total"))), Some(1));
    assert_eq!(gw.counter(&l.name("input_tokens_total")).unwrap_or(0), 0);
    let stamp = c.stamp();
    assert_eq!((stamp["status"].clone(), stamp["outcome"].clone()), (json!(429), json!("refused")));
    assert_eq!(stamp["input_tokens"], json!(0));
}

/// An upstream 429 (the model server's own rate limit) ran no prompt: no input tokens either.
#[test]
fn an_upstream_429_counts_no_tokens() {
    let gw = gateway();
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(true, true));
    c.response_headers(5, "429", "application/json");
    c.body(&[(5, r#"{"error":{"message":"slow down","type":"rate_limit_exceeded"}}"#.to_string())], Delivery::PerEntry, true);
    c.end();
    let l = Labels::new("chat_completions").stream(false);
    assert_eq!(gw.counter(&l.requests_total("4xx", "none", "estimated")), Some(1));
    assert_eq!(gw.counter(&l.name("input_tokens_total")).unwrap_or(0), 0);
    assert_eq!(c.stamp()["input_tokens"], json!(0));
    assert_eq!(c.stamp()["outcome"], json!("completed"));
}
