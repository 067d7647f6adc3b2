//! The e2e HTTP client against the mock server directly: whole and streamed responses, chunk
//! timing, cut streams, client aborts, and connection reuse.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use sluice_e2e::{get, post_json, post_stream, Connection, MockServer};
use std::time::Duration;

const CHAT: &str = r#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Hello"}]}"#;

#[test]
fn whole_json_response() {
    let mock = MockServer::start(&["--tokens", "2"]).unwrap();
    let r = post_json(mock.addr(), "/v1/chat/completions", &[("x-mock-version", "v9")], r#"{"messages":[]}"#).unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("X-Mock-Served-By"), Some("v9"));
    assert_eq!(r.json().unwrap()["choices"][0]["message"]["content"], "tok0 tok1 ");
    let r = get(mock.addr(), "/health").unwrap();
    assert_eq!((r.status, r.text().as_str()), (200, "ok"));
    // Error statuses are responses, not client errors.
    let r = post_json(mock.addr(), "/v1/chat/completions", &[], "{oops").unwrap();
    assert_eq!(r.status, 400);
}

#[test]
fn stream_chunks_arrive_with_timestamps() {
    let mock = MockServer::start(&[]).unwrap();
    let headers = [("x-mock-ttft-ms", "150"), ("x-mock-itl-ms", "20"), ("x-mock-tokens", "3")];
    let s = post_stream(mock.addr(), "/v1/chat/completions", &headers, CHAT).unwrap();
    assert_eq!(s.status, 200);
    assert_eq!(s.header("content-type"), Some("text/event-stream"));
    let r = s.collect().unwrap();
    assert!(r.complete);
    // role, 3 tokens, finish, usage, [DONE]: the mock sends one HTTP chunk per event
    assert_eq!(r.chunks.len(), 7);
    assert!(r.chunks.windows(2).all(|w| w[0].at <= w[1].at));
    let ttft = r.time_to("tok0").unwrap();
    assert!(ttft >= Duration::from_millis(150));
    assert!(r.time_to("\"role\"").unwrap() <= ttft);
    // The mock keeps one schedule from the request's start (token i at ttft + i × itl), so a late
    // first token does not push the third one back.
    assert!(r.time_to("tok2").unwrap() >= Duration::from_millis(150 + 2 * 20));
    assert!(r.time_to("never sent").is_none());
    let events = r.events();
    assert_eq!(events.len(), 7);
    assert_eq!(events[6].data, "[DONE]");
    assert_eq!(events[5].json().unwrap()["usage"]["completion_tokens"], 3);
}

#[test]
fn split_events_reassemble() {
    let mock = MockServer::start(&["--tokens", "2"]).unwrap();
    let headers = [("x-mock-split", "5"), ("x-mock-crlf", "1")];
    let r = post_stream(mock.addr(), "/v1/messages", &headers, r#"{"stream":true,"messages":[]}"#).unwrap().collect().unwrap();
    assert!(r.chunks.len() > 20);
    let names: Vec<_> = r.events().into_iter().map(|e| e.event.unwrap()).collect();
    assert_eq!(names.first().map(String::as_str), Some("message_start"));
    assert_eq!(names.last().map(String::as_str), Some("message_stop"));
}

#[test]
fn cut_stream_is_incomplete_not_an_error() {
    let mock = MockServer::start(&["--tokens", "5"]).unwrap();
    let r = post_stream(mock.addr(), "/v1/chat/completions", &[("x-mock-fail", "reset-after:2")], CHAT).unwrap().collect().unwrap();
    assert!(!r.complete);
    assert!(r.text().contains("tok1") && !r.text().contains("tok2"));
    // post_json wants a whole body and says so.
    let err = post_json(mock.addr(), "/v1/chat/completions", &[("x-mock-fail", "reset-after:2")], CHAT).unwrap_err();
    assert!(err.to_string().contains("closed before the end"));
}

#[test]
fn abort_after_disconnects_the_client() {
    let mock = MockServer::start(&["--tokens", "50", "--itl-ms", "20"]).unwrap();
    let s = post_stream(mock.addr(), "/v1/chat/completions", &[], CHAT).unwrap();
    let got = s.abort_after(300).unwrap();
    assert!(got.len() >= 300);
    // The mock notices the closed socket at its next write and stops generating.
    std::thread::sleep(Duration::from_millis(300));
    let sent = mock.stats().unwrap()["tokens_sent"].as_u64().unwrap();
    assert!(sent < 50, "mock kept streaming to a closed client: {sent} tokens");
}

#[test]
fn connection_reuse() {
    let mock = MockServer::start(&["--tokens", "1"]).unwrap();
    let conn = Connection::connect(mock.addr()).unwrap();
    let (a, conn) = conn.request("POST", "/v1/chat/completions", &[], CHAT.as_bytes()).unwrap();
    let (b, conn) = conn.request("POST", "/v1/completions", &[], br#"{"prompt":"x"}"#).unwrap();
    let (c, _conn) = conn.request("GET", "/mock/stats", &[], b"").unwrap();
    assert!(a.complete && b.complete && c.complete);
    let stats: serde_json::Value = serde_json::from_slice(&c.body()).unwrap();
    assert_eq!(stats["requests"], 2);
    assert_eq!(stats["connections"], 1);
}
