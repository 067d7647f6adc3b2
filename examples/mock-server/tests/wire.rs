//! The mock's wire controls and transport failures over real sockets (`x-mock-encoding`,
//! `x-mock-bom`, `x-mock-trailers`, `x-mock-content-type: none`, `x-mock-100-continue`,
//! `x-mock-token-bytes`; `x-mock-fail: reset-on-head | reset-in-body | reset-inside:N |
//! no-terminal | reset-before-terminal`): each one sends what it claims, and the ledger says what
//! was sent. Encoded bodies are decoded here by a reader of the stored-block formats the mock
//! writes, and — when curl is installed — by curl's own gzip, brotli and zstd decoders.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;
use common::{chat_body, Mock};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

const CHAT: &str = "/v1/chat/completions";

fn ledger(mock: &Mock, n: usize) -> Vec<Value> {
    for _ in 0..100 {
        let r = mock.conn().request("GET", "/mock/requests", &[], "");
        let v = r.json();
        if v.as_array().is_some_and(|a| a.len() >= n) {
            return v.as_array().unwrap().clone();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("ledger never had {n} records");
}

/// Decodes a body of stored blocks as the mock writes them (the formats' framing is checked;
/// compressed blocks would be refused).
fn decode_stored(encoding: &str, b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    match encoding {
        "gzip" => {
            assert_eq!(&b[..3], &[0x1f, 0x8b, 8]);
            let mut at = 10;
            loop {
                let last = b[at] & 1 == 1;
                assert_eq!(b[at] >> 1, 0, "stored block");
                let len = usize::from(u16::from_le_bytes([b[at + 1], b[at + 2]]));
                assert_eq!(u16::from_le_bytes([b[at + 3], b[at + 4]]), !(len as u16));
                out.extend_from_slice(&b[at + 5..at + 5 + len]);
                at += 5 + len;
                if last {
                    break;
                }
            }
            let crc = u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
            assert_eq!(crc, sluice_mock_server::wire::crc32_update(0, &out));
            assert_eq!(u32::from_le_bytes(b[at + 4..at + 8].try_into().unwrap()) as usize, out.len());
            assert_eq!(at + 8, b.len());
        }
        "zstd" => {
            assert_eq!(&b[..6], &[0x28, 0xb5, 0x2f, 0xfd, 0x00, 0x38]);
            let mut at = 6;
            loop {
                let h = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], 0]);
                assert_eq!((h >> 1) & 3, 0, "raw block");
                let len = (h >> 3) as usize;
                out.extend_from_slice(&b[at + 3..at + 3 + len]);
                at += 3 + len;
                if h & 1 == 1 {
                    break;
                }
            }
            assert_eq!(at, b.len());
        }
        "br" => {
            // Uncompressed meta-blocks: 21 bits (first, with WBITS) or 20 bits, then the bytes.
            let mut at = 0;
            let mut first = true;
            loop {
                let bits = u32::from_le_bytes([b[at], *b.get(at + 1).unwrap_or(&0), *b.get(at + 2).unwrap_or(&0), 0]) >> u32::from(first);
                if bits & 1 == 1 {
                    assert_eq!(bits & 2, 2, "ISLASTEMPTY");
                    assert_eq!(at + 1, b.len());
                    break;
                }
                assert_eq!((bits >> 1) & 3, 0, "four nibbles");
                let len = ((bits >> 3) & 0xffff) as usize + 1;
                assert_eq!((bits >> 19) & 1, 1, "ISUNCOMPRESSED");
                out.extend_from_slice(&b[at + 3..at + 3 + len]);
                at += 3 + len;
                first = false;
            }
        }
        other => panic!("{other}"),
    }
    out
}

/// curl's decoding of the answer, or `None` when curl is not installed.
fn curl_decoded(mock: &Mock, headers: &[(&str, &str)], body: &Value) -> Option<Vec<u8>> {
    let mut cmd = std::process::Command::new("curl");
    cmd.args(["-s", "--compressed", "--max-time", "10", "-d", &body.to_string()]);
    for (n, v) in headers {
        cmd.args(["-H", &format!("{n}: {v}")]);
    }
    let out = cmd.arg(format!("http://{}{CHAT}", mock.addr)).output().ok()?;
    assert!(out.status.success(), "curl failed: {out:?}");
    Some(out.stdout)
}

#[test]
fn encoded_streams_and_whole_answers_decode_to_the_identity_bytes() {
    let mock = Mock::start(&["--tokens", "4"]);
    for encoding in ["gzip", "br", "zstd"] {
        for stream in [true, false] {
            let body = chat_body(stream, true);
            let r = mock.conn().post(CHAT, &[("x-mock-encoding", encoding)], &body);
            assert_eq!((r.status, r.header("content-encoding")), (200, Some(encoding)));
            let plain = decode_stored(encoding, &r.body);
            let text = String::from_utf8(plain.clone()).unwrap();
            assert!(text.contains("tok0 ") && text.contains("tok3 "), "{encoding}: {text}");
            if stream {
                assert!(text.ends_with("data: [DONE]\n\n"), "{encoding}: {text}");
                // Every event left as its own complete blocks: the first HTTP chunk decodes alone.
                assert!(r.chunks.len() >= 7, "{encoding}: {} chunks", r.chunks.len());
            } else {
                assert_eq!(serde_json::from_slice::<Value>(&plain).unwrap()["usage"]["completion_tokens"], 4);
            }
            if let Some(decoded) = curl_decoded(&mock, &[("x-mock-encoding", encoding)], &body) {
                let decoded = String::from_utf8(decoded).unwrap();
                // Ids and timestamps differ per answer; the token text and the framing do not.
                assert_eq!(decoded.matches("tok").count(), text.matches("tok").count(), "{encoding}: {decoded}");
            }
        }
    }
    let r = mock.conn().post(CHAT, &[("x-mock-encoding", "deflate")], &chat_body(true, true));
    assert_eq!(r.status, 400);
}

#[test]
fn bom_padding_and_no_content_type() {
    let mock = Mock::start(&["--tokens", "2"]);
    let r = mock.conn().post(CHAT, &[("x-mock-bom", "1"), ("x-mock-content-type", "none"), ("x-mock-token-bytes", "100000")], &chat_body(true, true));
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), None);
    assert_eq!(&r.body[..3], b"\xEF\xBB\xBF");
    let text = String::from_utf8(r.body[3..].to_vec()).unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| e.contains("\"content\":\"tok")).collect();
    assert_eq!(events.len(), 2);
    for e in events {
        let v: Value = serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap();
        let content = v["choices"][0]["delta"]["content"].as_str().unwrap();
        assert_eq!(content.len(), 100_000);
        assert!(content.starts_with("tok") && content.ends_with('x'));
    }
}

/// A raw exchange: the request written, everything read until the mock closes or goes quiet.
fn raw_exchange(mock: &Mock, headers: &[(&str, &str)], body: &str) -> Vec<u8> {
    let mut s = TcpStream::connect(mock.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let extra: String = headers.iter().map(|(n, v)| format!("{n}: {v}\r\n")).collect();
    write!(s, "POST {CHAT} HTTP/1.1\r\nhost: m\r\nconnection: close\r\ncontent-length: {}\r\n{extra}\r\n{body}", body.len()).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    out
}

#[test]
fn trailers_and_an_interim_100_continue() {
    let mock = Mock::start(&["--tokens", "3"]);
    let out = String::from_utf8(raw_exchange(&mock, &[("x-mock-trailers", "1"), ("x-mock-100-continue", "1")], &chat_body(true, true).to_string())).unwrap();
    assert!(out.starts_with("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"), "{out}");
    assert!(out.contains("\r\ntrailer: x-mock-tokens-sent\r\n"), "{out}");
    assert!(out.ends_with("\r\n0\r\nx-mock-tokens-sent: 3\r\n\r\n"), "{out}");
}

#[test]
fn transport_failures_cut_where_they_say_and_the_ledger_says_so() {
    let mock = Mock::start(&["--tokens", "4"]);
    let body = chat_body(true, true).to_string();
    // Cut after the head and halfway through the body: no answer at all.
    for (id, fail) in [("on-head", "reset-on-head"), ("in-body", "reset-in-body")] {
        let out = raw_exchange(&mock, &[("x-mock-fail", fail), ("x-request-id", id)], &body);
        assert!(out.is_empty(), "{fail}: {}", String::from_utf8_lossy(&out));
    }
    // Half of the event after two tokens, then the connection closes.
    let out = String::from_utf8(raw_exchange(&mock, &[("x-mock-fail", "reset-inside:2"), ("x-request-id", "inside")], &body)).unwrap();
    assert!(out.contains("tok1 ") && !out.contains("tok3 ") && !out.ends_with("0\r\n\r\n"), "{out}");
    assert!(!out.ends_with("\n\n\r\n"), "the last event is cut: {out}");
    // Everything but [DONE], ended cleanly; and then with the connection closed instead.
    let out = String::from_utf8(raw_exchange(&mock, &[("x-mock-fail", "no-terminal"), ("x-request-id", "no-done")], &body)).unwrap();
    assert!(out.contains("\"usage\":{") && !out.contains("[DONE]") && out.ends_with("\r\n0\r\n\r\n"), "{out}");
    let out = String::from_utf8(raw_exchange(&mock, &[("x-mock-fail", "reset-before-terminal"), ("x-request-id", "cut-done")], &body)).unwrap();
    assert!(out.contains("\"usage\":{") && !out.contains("[DONE]") && !out.ends_with("\r\n0\r\n\r\n"), "{out}");
    // Anthropic: everything but message_stop.
    let messages = json!({"model": "claude", "stream": true, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let mut s = TcpStream::connect(mock.addr).unwrap();
    write!(s, "POST /v1/messages HTTP/1.1\r\nhost: m\r\nconnection: close\r\nx-mock-fail: no-terminal\r\nx-request-id: no-stop\r\ncontent-length: {}\r\n\r\n{messages}", messages.len()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.contains("message_delta") && !out.contains("message_stop"), "{out}");

    let records = ledger(&mock, 6);
    let by_id = |id: &str| records.iter().find(|r| r["request_id"] == id).unwrap_or_else(|| panic!("no record {id}: {records:?}")).clone();
    for id in ["on-head", "in-body"] {
        let r = by_id(id);
        assert_eq!((r["failure"].as_str(), r["tokens_flushed"].as_u64(), r["completed"].as_bool()), (Some("reset"), Some(0), Some(false)), "{r}");
    }
    let r = by_id("inside");
    assert_eq!((r["failure"].as_str(), r["tokens_flushed"].as_u64()), (Some("reset"), Some(2)), "{r}");
    for (id, failure) in [("no-done", "no_terminal"), ("cut-done", "reset"), ("no-stop", "no_terminal")] {
        let r = by_id(id);
        assert_eq!(
            (r["failure"].as_str(), r["tokens_flushed"].as_u64(), r["usage_reported"].as_bool(), r["completed"].as_bool()),
            (Some(failure), Some(4), Some(true), Some(false)),
            "{id}: {r}"
        );
    }
    // The heads were read; the cut bodies never came whole.
    let heads = mock.conn().request("GET", "/mock/heads", &[], "").json();
    let body_of = |id: &str| heads.as_array().unwrap().iter().find(|h| h["request_id"] == id).map(|h| h["body"].clone());
    assert_eq!(body_of("on-head"), Some(json!("incomplete")));
    assert_eq!(body_of("in-body"), Some(json!("incomplete")));
    assert_eq!(body_of("inside"), Some(json!("complete")));
}
