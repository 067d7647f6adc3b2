//! Inputs the fuzz targets (fuzz/, docs/fuzzing.md) found, each with the exact bytes, as native
//! tests of the behaviour that was fixed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use sluice_core::api::ApiKind;
use sluice_core::response::StreamObserver;
use sluice_core::rewrite::UsageChunkStripper;
use sluice_core::sse::{SseEvent, SseFramer};

fn observe(kind: ApiKind, body: &[u8]) -> sluice_core::response::ResponseSummary {
    let mut o = StreamObserver::new(kind);
    o.push(body);
    o.finish();
    o.summary()
}

/// stream_event: the event data `[]` (crash-704c876d…, the target's kind byte `4` = chat, event
/// `error`). The typed fast path read a JSON array as a chunk with every field absent (derived
/// structs accept arrays field by field) and took it silently; the general path counts it
/// malformed.
#[test]
fn an_array_event_is_malformed_not_an_empty_chunk() {
    for kind in [ApiKind::ChatCompletions, ApiKind::Completions, ApiKind::AnthropicMessages] {
        let s = observe(kind, b"event: error\ndata: []\n\n");
        assert_eq!(s.malformed_events, 1, "{kind}");
        assert!(s.upstream_error.is_none(), "{kind}");
    }
}

/// The same hole with fields: an array was read positionally, here as model `m` with one choice
/// of content `hi`, and arrays nested where the fast path expects a choice or a delta too.
#[test]
fn arrays_are_never_read_as_chunks_or_deltas() {
    let s = observe(ApiKind::ChatCompletions, br#"data: ["m",[{"delta":{"content":"hi"}}]]"#);
    assert_eq!((s.malformed_events, s.content_chunks, s.response_model), (1, 0, None));
    // A choice given as an array holding a delta-shaped object, and a delta given as an array.
    let s = observe(ApiKind::ChatCompletions, b"data: {\"choices\":[[{\"content\":\"hi\"}]]}\n\ndata: {\"choices\":[{\"delta\":[\"hi\"]}]}\n\n");
    assert_eq!((s.malformed_events, s.content_chunks), (0, 0));
    let s = observe(ApiKind::AnthropicMessages, b"data: {\"type\":\"content_block_delta\",\"delta\":[\"text_delta\",\"hi\"]}\n\n");
    assert_eq!((s.malformed_events, s.content_chunks), (0, 0));
    let s = observe(ApiKind::AnthropicMessages, b"data: [\"content_block_delta\",{\"type\":\"text_delta\",\"text\":\"hi\"}]\n\n");
    assert_eq!((s.malformed_events, s.content_chunks), (1, 0));
}

fn strip(cap: usize, parts: &[&[u8]]) -> (Vec<u8>, u64, u64) {
    let mut s = UsageChunkStripper::new(cap);
    let mut out = Vec::new();
    for p in parts {
        out.extend_from_slice(&s.push(p));
    }
    out.extend_from_slice(&s.finish());
    (out, s.removed_usage_events(), s.overflowed_events())
}

/// usage_stripper: crash-4c5407a5… (the first two bytes are the target's chunk sizes, 1 and 1). An
/// event of 64 bytes before the CRLF of its blank line, cap 64: in one chunk the whole CRLF was
/// counted (65 > 64, passed through as an overflow); one byte at a time only the CR was (judged).
#[test]
fn usage_stripper_overflow_does_not_depend_on_a_split_crlf() {
    let data: &[u8] = b"\x01\x01\n\n\x01\x00\x01\n\n\r\n-\x00\n\r\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\xb2\x00=\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x002\x00\x00\x00\n\r\n-\x00\n\r\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\xb2\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\n\r\n\r\n\x00\n";
    let body = &data[2..];
    let bytes: Vec<&[u8]> = body.chunks(1).collect();
    assert_eq!(strip(64, &bytes), strip(64, &[body]));
}

/// What that meant for a usage chunk: one whose size with the CR of its blank line is exactly the
/// cap was removed when the CR and LF came in different chunks and passed to the client when they
/// came together. Now it is removed either way.
#[test]
fn a_usage_chunk_at_the_cap_is_removed_wherever_its_crlf_is_split() {
    let event: &[u8] = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\r\n\r\n";
    let cap = event.len() - 1;
    let (at_cr, rest) = event.split_at(event.len() - 1);
    let whole = strip(cap, &[event]);
    assert_eq!(whole, strip(cap, &[at_cr, rest]));
    assert_eq!(whole, (Vec::new(), 1, 0));
}

/// stream_event: crash-d916a45f… = `\x07{"error":{"t":"sxt_"}}` (kind byte 7: Anthropic, event
/// `content_block_delta`). The Anthropic fast path took the event as a delta without one and
/// dropped its error; the general path reports it.
#[test]
fn an_anthropic_delta_event_with_an_error_member_reports_the_error() {
    let data: &[u8] = b"\x07{\"error\":{\"t\":\"sxt_\"}}";
    let mut body = b"event: content_block_delta\ndata: ".to_vec();
    body.extend_from_slice(&data[1..]);
    body.extend_from_slice(b"\n\n");
    let s = observe(ApiKind::AnthropicMessages, &body);
    assert_eq!(s.upstream_error.as_deref(), Some("error"));
    let s = observe(
        ApiKind::AnthropicMessages,
        b"data: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"hi\"},\"error\":{\"message\":\"m\"}}\n\n",
    );
    assert_eq!((s.upstream_error.as_deref(), s.content_chunks), (Some("m"), 0));
}

fn frame(cap: usize, parts: &[&[u8]]) -> (Vec<SseEvent>, u64) {
    let mut f = SseFramer::new(cap);
    let mut events = Vec::new();
    for p in parts {
        f.push(p, &mut |e| events.push(e));
    }
    f.finish(&mut |e| events.push(e));
    (events, f.overflowed_events())
}

/// sse_stream: crash-1e32e2fe… (chunk sizes 7 and 13, cap 64). The first line was over the cap,
/// the next one a lone UTF-8 BOM: whole, the BOM was stripped as if at the stream's start and the
/// line ended the discarded event; split inside the BOM, it did not. Overflow counts (and, in
/// general, which events are kept) depended on chunking.
#[test]
fn a_bom_after_an_overflowed_first_line_is_content_wherever_chunks_end() {
    let data: &[u8] = b"\x07\rnull:0,\"delta\":{x\":0,\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]},\"finish_reason\":\"stop\"\xf8],\"usage\":null}\n\xef\xbb\xbf\ndata: {\"id\":\"c1\",\"model\":\"m\",\"cht\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"co\":\"Hello\"},\"Afinish_reason\":nu\x96l}]null}],\"usage\":null}\n\n: \x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\xfd\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00data: {\"id\":\"c0\",\"mdetails\":{\"cached_tokens\":1}1e400ata: [DONE]\n\n";
    let body = &data[2..];
    let mut parts = Vec::new();
    let (mut i, mut turn) = (0, false);
    while i < body.len() {
        let end = body.len().min(i + if turn { 13 } else { 7 });
        parts.push(&body[i..end]);
        (i, turn) = (end, !turn);
    }
    assert_eq!(frame(64, &parts), frame(64, &[body]));
    // The same in small: an event after the BOM line is part of the discarded one either way.
    let body: &[u8] = b"data: 0123456789abcdef\n\xef\xbb\xbf\ndata: x\n\n";
    assert_eq!(frame(16, &[body]), (Vec::new(), 1));
    assert_eq!(frame(16, &[&body[..24], &body[24..]]), (Vec::new(), 1));
}
