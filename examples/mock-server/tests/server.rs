//! The mock binary over real sockets: every API streamed and whole, keep-alive, chunked request
//! bodies, timing lower bounds, every failure mode and framing control.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;
use common::{chat_body, Mock};
use serde_json::{json, Value};
use std::time::Duration;

/// Prompt tokens of `chat_body()`: "You are terse." (14 chars) -> 4+4, "Hello" (5) -> 2+4.
const CHAT_PROMPT_TOKENS: u64 = 14;

fn texts(events: &[Value], pointer: &str) -> String {
    events.iter().filter_map(|e| e.pointer(pointer).and_then(Value::as_str)).collect()
}

#[test]
fn chat_stream_with_usage() {
    let mock = Mock::start(&["--tokens", "4"]);
    let r = mock.conn().post("/v1/chat/completions", &[("x-mock-cached-tokens", "3"), ("x-mock-reasoning-tokens", "2")], &chat_body(true, true));
    assert_eq!(r.status, 200);
    assert!(r.complete);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert_eq!(r.header("x-mock-prompt-tokens"), Some("14"));
    assert_eq!(r.header("x-mock-served-by"), Some("mock"));
    let events = r.events();
    // role, 4 tokens, finish, usage, [DONE]; one HTTP chunk per event
    assert_eq!(events.len(), 8);
    assert_eq!(r.chunks.len(), 8);
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let chunks = r.event_json();
    assert_eq!(chunks[0]["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
    assert_eq!(texts(&chunks, "/choices/0/delta/content"), "tok0 tok1 tok2 tok3 ");
    assert_eq!(chunks[5]["choices"][0]["finish_reason"], "stop");
    assert_eq!(chunks[5]["choices"][0]["delta"], json!({}));
    for c in &chunks[..6] {
        assert_eq!(c["usage"], Value::Null);
        assert!(c.as_object().unwrap().contains_key("usage"));
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["model"], "llama-3-70b");
        assert!(c["id"].as_str().unwrap().starts_with("chatcmpl-"));
        assert!(c["system_fingerprint"].is_string());
        assert!(c["created"].is_u64());
    }
    assert_eq!(chunks[6]["choices"], json!([]));
    assert_eq!(
        chunks[6]["usage"],
        json!({"prompt_tokens": CHAT_PROMPT_TOKENS, "completion_tokens": 6, "total_tokens": CHAT_PROMPT_TOKENS + 6,
               "prompt_tokens_details": {"cached_tokens": 3}, "completion_tokens_details": {"reasoning_tokens": 2}})
    );
}

#[test]
fn chat_stream_without_usage_and_max_tokens_length() {
    let mock = Mock::start(&["--model-name", "fixed-model"]);
    let mut body = chat_body(true, false);
    body["max_tokens"] = json!(3);
    let r = mock.conn().post("/v1/chat/completions", &[], &body);
    let chunks = r.event_json();
    assert_eq!(chunks.len(), 5); // role, 3 tokens, finish
    assert!(chunks.iter().all(|c| !c.as_object().unwrap().contains_key("usage")));
    assert!(chunks.iter().all(|c| c["model"] == "fixed-model"));
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    // x-mock-usage: always forces the usage chunk even without include_usage
    let r = mock.conn().post("/v1/chat/completions", &[("x-mock-usage", "always"), ("x-mock-tokens", "2")], &chat_body(true, false));
    assert_eq!(r.event_json().last().unwrap()["usage"]["completion_tokens"], 2);
}

#[test]
fn chat_whole() {
    let mock = Mock::start(&[]);
    let r = mock.conn().post("/v1/chat/completions", &[("x-mock-tokens", "3")], &chat_body(false, false));
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("application/json"));
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["content"], "tok0 tok1 tok2 ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["prompt_tokens"], CHAT_PROMPT_TOKENS);
    assert_eq!(v["usage"]["completion_tokens"], 3);
}

#[test]
fn legacy_completions_stream_and_whole() {
    let mock = Mock::start(&["--tokens", "3"]);
    let body = json!({"model": "m", "prompt": "Hello", "stream": true, "stream_options": {"include_usage": true}});
    let r = mock.conn().post("/v1/completions", &[], &body);
    let chunks = r.event_json();
    assert_eq!(chunks.len(), 5); // 3 tokens, finish, usage
    assert_eq!(texts(&chunks, "/choices/0/text"), "tok0 tok1 tok2 ");
    assert_eq!(chunks[0]["object"], "text_completion");
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "stop");
    assert_eq!(chunks[4]["usage"]["prompt_tokens"], 6);
    assert_eq!(r.events().last().unwrap().1, "[DONE]");

    let r = mock.conn().post("/v1/completions", &[], &json!({"model": "m", "prompt": ["Hello", "Hello"]}));
    let v = r.json();
    assert_eq!(v["choices"][0]["text"], "tok0 tok1 tok2 ");
    assert_eq!(v["usage"]["prompt_tokens"], 12);
}

#[test]
fn responses_stream_and_whole() {
    let mock = Mock::start(&["--tokens", "3"]);
    let body = json!({"model": "gpt-x", "input": "Hello", "instructions": "Be", "stream": true});
    let r = mock.conn().post("/v1/responses", &[("x-mock-cached-tokens", "4"), ("x-mock-reasoning-tokens", "5")], &body);
    let names: Vec<String> = r.events().into_iter().map(|(n, _)| n.unwrap()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let events = r.event_json();
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["sequence_number"], i as u64);
        assert_eq!(e["type"].as_str(), Some(names[i].as_str()));
    }
    assert_eq!(texts(&events, "/delta"), "tok0 tok1 tok2 ");
    let done = &events[10]["response"];
    assert_eq!(done["status"], "completed");
    assert_eq!(
        done["usage"],
        json!({"input_tokens": 11, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 8,
               "output_tokens_details": {"reasoning_tokens": 5}, "total_tokens": 19})
    );

    let r = mock.conn().post("/v1/responses", &[], &json!({"model": "gpt-x", "input": [{"role": "user", "content": "Hello"}]}));
    let v = r.json();
    assert_eq!(v["object"], "response");
    assert_eq!(v["output"][0]["content"][0]["text"], "tok0 tok1 tok2 ");
    assert_eq!(v["usage"]["input_tokens"], 6);
}

#[test]
fn responses_truncated_is_incomplete() {
    let mock = Mock::start(&[]);
    let body = json!({"input": "Hello", "stream": true, "max_output_tokens": 2});
    let r = mock.conn().post("/v1/responses", &[], &body);
    let last = r.event_json().pop().unwrap();
    assert_eq!(last["type"], "response.incomplete");
    assert_eq!(last["response"]["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(last["response"]["usage"]["output_tokens"], 2);
}

#[test]
fn anthropic_stream_and_whole() {
    let mock = Mock::start(&["--tokens", "3"]);
    let body = json!({"model": "claude-x", "max_tokens": 100, "system": "You are terse.", "stream": true,
                      "messages": [{"role": "user", "content": "Hello"}]});
    let r = mock.conn().post("/v1/messages", &[("x-mock-cached-tokens", "5")], &body);
    let names: Vec<String> = r.events().into_iter().map(|(n, _)| n.unwrap()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
    let events = r.event_json();
    assert_eq!(events[0]["message"]["usage"], json!({"input_tokens": 9, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 5, "output_tokens": 1}));
    assert_eq!(texts(&events, "/delta/text"), "tok0 tok1 tok2 ");
    assert_eq!(events[7]["delta"]["stop_reason"], "end_turn");
    assert_eq!(events[7]["usage"]["output_tokens"], 3);

    let mut body = body;
    body["stream"] = json!(false);
    body["max_tokens"] = json!(2);
    let v = mock.conn().post("/v1/messages", &[], &body).json();
    assert_eq!(v["type"], "message");
    assert_eq!(v["content"][0]["text"], "tok0 tok1 ");
    assert_eq!(v["stop_reason"], "max_tokens");
    assert_eq!(v["usage"]["input_tokens"], CHAT_PROMPT_TOKENS);
}

#[test]
fn keep_alive_serves_three_requests_on_one_connection() {
    let mock = Mock::start(&["--tokens", "2"]);
    let mut conn = mock.conn();
    let a = conn.post("/v1/chat/completions", &[], &chat_body(true, true));
    let b = conn.post("/v1/chat/completions", &[], &chat_body(false, false));
    let c = conn.post("/v1/messages", &[], &json!({"stream": true, "messages": []}));
    assert!(a.complete && b.complete && c.complete);
    assert_eq!((a.status, b.status, c.status), (200, 200, 200));
    assert_eq!(c.events().last().unwrap().0.as_deref(), Some("message_stop"));
    let stats = conn.request("GET", "/mock/stats", &[], "").json();
    assert_eq!(stats["requests"], 3);
    assert_eq!(stats["tokens_sent"], 6);
    assert_eq!(stats["by_path"]["/v1/chat/completions"], 2);
    assert_eq!(stats["connections"], 1);
}

#[test]
fn chunked_request_body() {
    let mock = Mock::start(&["--tokens", "1"]);
    let mut conn = mock.conn();
    let body = chat_body(false, false).to_string();
    let (a, b) = body.split_at(10);
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: m\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{a}\r\n{:x};ext=1\r\n{b}\r\n0\r\n\r\n",
        a.len(),
        b.len()
    );
    let at = conn.send_raw(raw.as_bytes());
    let r = conn.read_response(at);
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["usage"]["prompt_tokens"], CHAT_PROMPT_TOKENS);
    // and the connection is still usable
    assert_eq!(conn.request("GET", "/health", &[], "").text(), "ok");
}

#[test]
fn ttft_and_itl_are_honored() {
    let mock = Mock::start(&[]);
    let headers = [("x-mock-ttft-ms", "200"), ("x-mock-itl-ms", "50"), ("x-mock-tokens", "4")];
    let r = mock.conn().post("/v1/chat/completions", &headers, &chat_body(true, false));
    // chunk 0 is the role-only chunk, sent before the delay; chunks 1..=4 carry tokens
    let (role_at, _) = r.chunks[0];
    let (first_at, first) = &r.chunks[1];
    assert!(String::from_utf8_lossy(first).contains("tok0"));
    assert!(role_at < *first_at);
    assert!(first_at.duration_since(r.sent_at) >= Duration::from_millis(200));
    // Token i leaves the server no earlier than TTFT + i × ITL after the request. Measured from the
    // request, not between two reads: a reader that is late for one chunk (a loaded machine) reads
    // the next one sooner, which says nothing about the server's pacing.
    for (i, (at, _)) in r.chunks[1..5].iter().enumerate() {
        let due = Duration::from_millis(200 + 50 * i as u64 - 5);
        assert!(at.duration_since(r.sent_at) >= due, "token {i} after {:?}, before {due:?}: itl not honored", at.duration_since(r.sent_at));
    }

    // Whole answers take the full generation time too.
    let r = mock.conn().post("/v1/chat/completions", &headers, &chat_body(false, false));
    assert!(r.sent_at.elapsed() >= Duration::from_millis(350));
}

#[test]
fn cli_timing_defaults() {
    let mock = Mock::start(&["--ttft-ms", "150", "--tokens", "2"]);
    let r = mock.conn().post("/v1/chat/completions", &[], &chat_body(true, false));
    assert!(r.chunks[1].0.duration_since(r.sent_at) >= Duration::from_millis(150));
}

#[test]
fn reset_after_closes_mid_stream() {
    let mock = Mock::start(&["--tokens", "5"]);
    let mut conn = mock.conn();
    let r = conn.post("/v1/chat/completions", &[("x-mock-fail", "reset-after:2")], &chat_body(true, true));
    assert_eq!(r.status, 200);
    assert!(!r.complete, "no terminating chunk");
    assert_eq!(texts(&r.event_json(), "/choices/0/delta/content"), "tok0 tok1 ");
    assert!(!r.text().contains("[DONE]"));
    assert!(conn.is_closed());
}

#[test]
fn error_event_after_ends_stream() {
    let mock = Mock::start(&["--tokens", "5"]);
    let r = mock.conn().post("/v1/chat/completions", &[("x-mock-fail", "error-event-after:1")], &chat_body(true, true));
    assert!(r.complete);
    let events = r.event_json();
    assert_eq!(events.len(), 3); // role, 1 token, error
    assert_eq!(events[2]["error"]["type"], "server_error");

    let body = json!({"stream": true, "messages": [{"role": "user", "content": "x"}]});
    let r = mock.conn().post("/v1/messages", &[("x-mock-fail", "error-event-after:0")], &body);
    let (name, data) = r.events().pop().unwrap();
    assert_eq!(name.as_deref(), Some("error"));
    assert_eq!(serde_json::from_str::<Value>(&data).unwrap()["error"]["type"], "overloaded_error");
}

#[test]
fn status_failures_are_api_styled() {
    let mock = Mock::start(&[]);
    let mut conn = mock.conn();
    let r = conn.post("/v1/chat/completions", &[("x-mock-fail", "status:503")], &chat_body(true, true));
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["type"], "server_error");
    let r = conn.post("/v1/messages", &[("x-mock-fail", "status:429")], &json!({"messages": []}));
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.json(), json!({"type": "error", "error": {"type": "rate_limit_error", "message": "mock: injected failure with status 429"}}));
}

#[test]
fn malformed_requests_get_400_json() {
    let mock = Mock::start(&[]);
    let mut conn = mock.conn();
    let r = conn.request("POST", "/v1/chat/completions", &[], "{not json");
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    let r = conn.request("POST", "/v1/messages", &[], "[1,2]");
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["type"], "error");
    let r = conn.request("POST", "/v1/chat/completions", &[("x-mock-tokens", "many")], "{}");
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("x-mock-tokens"));
    // The connection survives a bad body (the framing was fine).
    assert_eq!(conn.request("GET", "/health", &[], "").status, 200);

    // Broken HTTP framing gets a 400 and the connection is closed.
    let mut conn = mock.conn();
    let at = conn.send_raw(b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: nope\r\n\r\n");
    let r = conn.read_response(at);
    assert_eq!(r.status, 400);
    assert!(conn.is_closed());
}

#[test]
fn keepalive_comments_crlf_and_split() {
    let mock = Mock::start(&["--tokens", "2"]);
    let headers = [("x-mock-keepalive", "3"), ("x-mock-crlf", "1"), ("x-mock-split", "7"), ("x-mock-ttft-ms", "30")];
    let r = mock.conn().post("/v1/chat/completions", &headers, &chat_body(true, false));
    let text = r.text();
    assert_eq!(text.matches(": keep-alive\r\n\r\n").count(), 3);
    assert!(!text.replace("\r\n", "").contains('\n'), "only CRLF line ends");
    assert!(r.chunks.iter().all(|(_, c)| c.len() <= 7));
    // Comments come after the role chunk and before the first token.
    let ka = text.find(": keep-alive").unwrap();
    assert!(text.find("\"role\"").unwrap() < ka && ka < text.find("tok0").unwrap());
    assert_eq!(texts(&r.event_json(), "/choices/0/delta/content"), "tok0 tok1 ");
}

#[test]
fn served_by_health_models_and_404() {
    let mock = Mock::start(&["--served-by", "blue", "--model-name", "m-fixed"]);
    let mut conn = mock.conn();
    let r = conn.post("/v1/chat/completions", &[("x-mock-version", "green")], &chat_body(false, false));
    assert_eq!(r.header("x-mock-served-by"), Some("green"));
    let r = conn.request("GET", "/health", &[], "");
    assert_eq!((r.status, r.text().as_str(), r.header("x-mock-served-by")), (200, "ok", Some("blue")));
    let r = conn.request("GET", "/v1/models", &[], "");
    assert_eq!(r.json()["data"][0]["id"], "m-fixed");
    assert_eq!(conn.request("GET", "/nope", &[], "").status, 404);
    assert_eq!(conn.request("GET", "/v1/chat/completions", &[], "").status, 405);
    conn.request("POST", "/mock/reset", &[], "");
    assert_eq!(conn.request("GET", "/mock/stats", &[], "").json()["requests"], 0);
}

/// `GET /mock/requests`, polled until it holds `n` records (a record is written when the
/// request's answer ends, which can be just after the client saw the end).
fn ledger(mock: &Mock, n: usize) -> Vec<Value> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = mock.conn().request("GET", "/mock/requests", &[], "");
        assert_eq!(r.status, 200);
        let records = r.json().as_array().unwrap().clone();
        if records.len() >= n || std::time::Instant::now() > deadline {
            assert_eq!(records.len(), n, "{records:?}");
            return records;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn ledger_records_every_inference_request() {
    let mock = Mock::start(&["--tokens", "4"]);
    let mut conn = mock.conn();
    let id = |v: &'static str| ("x-request-id", v);
    conn.post("/v1/chat/completions", &[id("a"), ("x-mock-reasoning-tokens", "2")], &chat_body(true, true));
    conn.post("/v1/chat/completions", &[id("b")], &chat_body(true, false));
    let mut capped = chat_body(false, false);
    capped["max_completion_tokens"] = json!(3);
    conn.post("/v1/chat/completions", &[id("c")], &capped);
    let anthropic = json!({"stream": true, "max_tokens": 10, "system": "You are terse.",
                           "messages": [{"role": "user", "content": "Hello"}]});
    conn.post("/v1/messages", &[id("d"), ("x-mock-cached-tokens", "5")], &anthropic);
    conn.post("/v1/responses", &[id("e")], &json!({"stream": true, "input": "Hello"}));
    conn.post("/v1/chat/completions", &[id("f"), ("x-mock-fail", "status:503")], &chat_body(true, true));
    conn.post("/v1/chat/completions", &[id("g"), ("x-mock-fail", "error-event-after:1")], &chat_body(true, true));
    conn.request("POST", "/v1/chat/completions", &[id("h")], "{not json");
    conn.post("/v1/chat/completions", &[], &chat_body(false, false)); // no id: one is generated
    conn.request("GET", "/health", &[id("not-inference")], "");
    let r = conn.post("/v1/chat/completions", &[id("i"), ("x-mock-fail", "reset-after:3")], &chat_body(true, true));
    assert!(!r.complete);

    let records = ledger(&mock, 10);
    let by_id = |id: &str| records.iter().find(|r| r["request_id"] == id).unwrap().clone();
    assert_eq!(
        by_id("a"),
        json!({"request_id": "a", "path": "/v1/chat/completions", "stream": true, "max_tokens": null,
               "model": "llama-3-70b", "prompt_tokens": CHAT_PROMPT_TOKENS, "completion_tokens": 6, "tokens_flushed": 4,
               "usage_reported": true, "completed": true, "failure": null})
    );
    // Streamed without include_usage: the usage that would have been reported, not sent.
    let b = by_id("b");
    assert_eq!((b["completion_tokens"].as_u64(), b["tokens_flushed"].as_u64()), (Some(4), Some(4)));
    assert_eq!((b["usage_reported"].as_bool(), b["completed"].as_bool()), (Some(false), Some(true)));
    // The request's output limit caps the answer and is recorded.
    let c = by_id("c");
    assert_eq!((c["stream"].as_bool(), c["max_tokens"].as_u64()), (Some(false), Some(3)));
    assert_eq!((c["completion_tokens"].as_u64(), c["tokens_flushed"].as_u64()), (Some(3), Some(3)));
    assert_eq!(c["usage_reported"], true);
    // Anthropic: prompt tokens are input + cache read, as the usage adds up.
    let d = by_id("d");
    assert_eq!((d["prompt_tokens"].as_u64(), d["completion_tokens"].as_u64()), (Some(CHAT_PROMPT_TOKENS), Some(4)));
    assert_eq!((d["usage_reported"].as_bool(), d["completed"].as_bool()), (Some(true), Some(true)));
    assert_eq!(by_id("e")["usage_reported"], true);
    let f = by_id("f");
    assert_eq!((f["failure"].as_str(), f["tokens_flushed"].as_u64()), (Some("status:503"), Some(0)));
    assert_eq!((f["completed"].as_bool(), f["usage_reported"].as_bool()), (Some(false), Some(false)));
    let g = by_id("g");
    assert_eq!((g["failure"].as_str(), g["tokens_flushed"].as_u64()), (Some("error_event"), Some(1)));
    assert_eq!((g["completed"].as_bool(), g["usage_reported"].as_bool()), (Some(false), Some(false)));
    assert_eq!(by_id("h")["failure"], "bad_request");
    let generated = records.iter().find(|r| r["request_id"].as_str().unwrap().starts_with("mockreq-"));
    assert!(generated.is_some(), "{records:?}");
    let i = by_id("i");
    assert_eq!((i["failure"].as_str(), i["tokens_flushed"].as_u64()), (Some("reset"), Some(3)));
    assert_eq!((i["completed"].as_bool(), i["usage_reported"].as_bool()), (Some(false), Some(false)));
    assert_eq!(i["completion_tokens"], 4);

    // Reset clears the ledger.
    mock.conn().request("POST", "/mock/reset", &[], "");
    assert_eq!(ledger(&mock, 0), Vec::<Value>::new());
}

#[test]
fn ledger_counts_tokens_flushed_before_the_client_went_away() {
    let mock = Mock::start(&[]);
    let mut conn = mock.conn();
    let headers = [("x-request-id", "gone"), ("x-mock-tokens", "2000"), ("x-mock-itl-ms", "2")];
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: m\r\ncontent-length: {}\r\n{}\r\n{}",
        chat_body(true, true).to_string().len(),
        headers.iter().map(|(n, v)| format!("{n}: {v}\r\n")).collect::<String>(),
        chat_body(true, true)
    );
    conn.send_raw(raw.as_bytes());
    // Read a little of the stream, then drop the connection.
    let mut first = [0u8; 512];
    assert!(conn.read_some(&mut first) > 0);
    drop(conn);
    let records = ledger(&mock, 1);
    let r = &records[0];
    assert_eq!(r["request_id"], "gone");
    assert_eq!(r["failure"], "client_gone");
    assert_eq!((r["completed"].as_bool(), r["usage_reported"].as_bool()), (Some(false), Some(false)));
    let flushed = r["tokens_flushed"].as_u64().unwrap();
    assert!(flushed < 2000, "{r}");
    assert_eq!(r["completion_tokens"], 2000);
}

#[test]
fn ledger_takes_chunked_request_bodies() {
    let mock = Mock::start(&["--tokens", "9"]);
    let mut conn = mock.conn();
    let mut body = chat_body(true, true);
    body["max_tokens"] = json!(5);
    let body = body.to_string();
    let (a, b) = body.split_at(7);
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: m\r\nx-request-id: chunked\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n",
        a.len(),
        b.len()
    );
    let at = conn.send_raw(raw.as_bytes());
    assert!(conn.read_response(at).complete);
    let records = ledger(&mock, 1);
    assert_eq!(records[0]["request_id"], "chunked");
    assert_eq!(records[0]["max_tokens"], 5);
    assert_eq!(records[0]["tokens_flushed"], 5);
    assert_eq!(records[0]["completion_tokens"], 5);
}

/// `GET path` on a new connection, as JSON.
fn get_json(mock: &Mock, path: &str) -> Value {
    let r = mock.conn().request("GET", path, &[], "");
    assert_eq!(r.status, 200, "{path}");
    r.json()
}

/// Waits until `check` holds for `GET path` (the server records a cut body when it notices).
fn wait_json(mock: &Mock, path: &str, check: impl Fn(&Value) -> bool) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let v = get_json(mock, path);
        if check(&v) || std::time::Instant::now() > deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn every_connection_and_request_head_is_recorded_even_without_a_body() {
    let mock = Mock::start(&["--tokens", "2"]);
    // A whole request, and a GET on the same connection.
    let mut conn = mock.conn();
    conn.post("/v1/chat/completions", &[("x-request-id", "whole")], &chat_body(false, false));
    conn.request("GET", "/health", &[("x-request-id", "get")], "");
    // Headers of a chunked request, then the connection closes: what a proxy does when it resets a
    // request it already forwarded the head of.
    let mut cut = mock.conn();
    cut.send_raw(b"POST /v1/chat/completions HTTP/1.1\r\nhost: m\r\nx-request-id: headers-only\r\ntransfer-encoding: chunked\r\n\r\n");
    std::thread::sleep(Duration::from_millis(50));
    drop(cut);
    // Part of a content-length body, then close.
    let mut partial = mock.conn();
    partial.send_raw(b"POST /v1/messages HTTP/1.1\r\nhost: m\r\nx-request-id: partial\r\ncontent-length: 100\r\n\r\n{\"model\"");
    std::thread::sleep(Duration::from_millis(50));
    drop(partial);
    // A connection that sends nothing at all.
    drop(mock.conn());

    let heads = wait_json(&mock, "/mock/heads", |v| v.as_array().unwrap().iter().filter(|h| h["body"] == "incomplete").count() == 2);
    let heads = heads.as_array().unwrap();
    let by_id = |id: &str| heads.iter().find(|h| h["request_id"] == id).unwrap_or_else(|| panic!("no head {id}: {heads:?}")).clone();
    assert_eq!(by_id("whole")["body"], "complete");
    assert_eq!(by_id("whole")["path"], "/v1/chat/completions");
    assert_eq!((by_id("get")["method"].as_str(), by_id("get")["body"].as_str()), (Some("GET"), Some("none")));
    assert_eq!(by_id("whole")["connection"], by_id("get")["connection"]);
    assert_eq!(by_id("headers-only")["body"], "incomplete");
    assert_eq!((by_id("partial")["body"].as_str(), by_id("partial")["path"].as_str()), (Some("incomplete"), Some("/v1/messages")));
    assert!(heads.iter().all(|h| h["seq"].as_u64().unwrap() > 0 && h["at_ms"].as_u64().unwrap() > 0));
    // The cut requests never made it into the answered-request ledger.
    let ledger = get_json(&mock, "/mock/requests");
    let ids: Vec<&str> = ledger.as_array().unwrap().iter().filter_map(|r| r["request_id"].as_str()).collect();
    assert_eq!(ids, ["whole"]);

    // Connections: the keep-alive one, the two cut ones, the silent one, plus our GETs.
    let conns = wait_json(&mock, "/mock/connections", |v| v["connections"][3]["closed"] == true);
    let list = conns["connections"].as_array().unwrap();
    assert_eq!(list[0]["heads"], 2);
    assert_eq!((list[1]["heads"].as_u64(), list[2]["heads"].as_u64(), list[3]["heads"].as_u64()), (Some(1), Some(1), Some(0)));
    assert!(list[1..4].iter().all(|c| c["closed"] == true && c["refused"] == false), "{list:?}");
    assert!(list[0]["peer"].as_str().unwrap().starts_with("127.0.0.1:"));
    assert_eq!(conns["accepted"].as_u64(), Some(list.len() as u64));
    assert!(get_json(&mock, "/mock/stats")["connections_accepted"].as_u64().unwrap() > 4);

    // Reset forgets them.
    mock.conn().request("POST", "/mock/reset", &[], "");
    let heads = get_json(&mock, "/mock/heads");
    // Only the GET that read them back is left.
    assert_eq!(heads.as_array().unwrap().len(), 1, "{heads}");
    assert_eq!(get_json(&mock, "/mock/connections")["accepted"], 2);
}
