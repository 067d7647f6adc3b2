//! SSE framer behaviour: WHATWG parsing rules, chunk boundaries, bounded memory.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use sluice_core::sse::{SseEvent, SseFramer, DEFAULT_MAX_EVENT_BYTES};

fn ev(event: Option<&str>, data: &str) -> SseEvent {
    SseEvent { event: event.map(str::to_owned), data: data.to_owned() }
}

fn frame_chunks(chunks: &[&[u8]], cap: usize) -> (Vec<SseEvent>, SseFramer) {
    let mut f = SseFramer::new(cap);
    let mut out = Vec::new();
    for c in chunks {
        f.push(c, &mut |e| out.push(e));
        assert!(f.buffered_bytes() <= cap);
    }
    f.finish(&mut |e| out.push(e));
    (out, f)
}

fn frame(input: &str) -> Vec<SseEvent> {
    frame_chunks(&[input.as_bytes()], DEFAULT_MAX_EVENT_BYTES).0
}

fn frame_bytewise(input: &[u8]) -> Vec<SseEvent> {
    let chunks: Vec<&[u8]> = input.chunks(1).collect();
    frame_chunks(&chunks, DEFAULT_MAX_EVENT_BYTES).0
}

#[test]
fn two_events_one_chunk() {
    assert_eq!(frame("data: {\"a\":1}\n\ndata: {\"b\":2}\n\n"), vec![ev(None, "{\"a\":1}"), ev(None, "{\"b\":2}")]);
}

#[test]
fn event_field_and_multiline_data() {
    let got = frame("event: message_start\ndata: line1\ndata: line2\n\ndata: x\n\n");
    assert_eq!(got, vec![ev(Some("message_start"), "line1\nline2"), ev(None, "x")], "event type must reset after dispatch");
}

#[test]
fn only_one_leading_space_is_stripped() {
    assert_eq!(frame("data:x\n\ndata: x\n\ndata:  x\n\n"), vec![ev(None, "x"), ev(None, "x"), ev(None, " x")]);
}

#[test]
fn comments_are_counted_not_dispatched() {
    let (events, f) = frame_chunks(&[b": keep-alive\n\n: OPENROUTER PROCESSING\n\ndata: 1\n\n:\n\n"], 1024);
    assert_eq!(events, vec![ev(None, "1")]);
    assert_eq!(f.comments_seen(), 3);
}

#[test]
fn events_without_data_are_not_dispatched() {
    assert_eq!(frame("event: ping\n\nid: 7\nretry: 100\n\n"), vec![]);
}

#[test]
fn data_field_without_colon_is_empty_data() {
    assert_eq!(frame("data\n\n"), vec![ev(None, "")]);
    assert_eq!(frame("data\ndata\n\n"), vec![ev(None, "\n")]);
}

#[test]
fn unknown_fields_and_id_retry_are_ignored() {
    assert_eq!(frame("id: 1\nretry: 3000\nfoo: bar\ndata: ok\n\n"), vec![ev(None, "ok")]);
}

#[test]
fn crlf_and_cr_line_endings() {
    let expected = vec![ev(Some("e"), "a\nb"), ev(None, "c")];
    assert_eq!(frame("event: e\r\ndata: a\r\ndata: b\r\n\r\ndata: c\r\n\r\n"), expected);
    assert_eq!(frame("event: e\rdata: a\rdata: b\r\rdata: c\r\r"), expected);
    assert_eq!(frame("event: e\ndata: a\r\ndata: b\r\n\ndata: c\r\r\n"), expected);
}

#[test]
fn cr_at_chunk_end_then_lf_is_one_line_end() {
    // If the LF were taken as a second line end, "a" would be dispatched alone.
    let (events, _) = frame_chunks(&[b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n"], 1024);
    assert_eq!(events, vec![ev(None, "a\nb")]);
}

#[test]
fn cr_at_chunk_end_then_cr_is_a_blank_line() {
    let (events, _) = frame_chunks(&[b"data: a\r", b"\rdata: b\r\r"], 1024);
    assert_eq!(events, vec![ev(None, "a"), ev(None, "b")]);
}

#[test]
fn cr_at_chunk_end_survives_empty_chunks() {
    let (events, _) = frame_chunks(&[b"data: a\r", b"", b"\n", b"data: b\n\n"], 1024);
    assert_eq!(events, vec![ev(None, "a\nb")]);
}

#[test]
fn byte_by_byte_equals_whole() {
    let input = "event: a\r\ndata: {\"x\":\"héllo 😊\"}\r\n\r\n: c\rdata: 2\r\rdata: 3\n\n";
    let whole = frame(input);
    assert_eq!(whole.len(), 3);
    assert_eq!(frame_bytewise(input.as_bytes()), whole);
}

#[test]
fn finish_dispatches_unterminated_event() {
    assert_eq!(frame("data: a\n\ndata: tail"), vec![ev(None, "a"), ev(None, "tail")]);
    assert_eq!(frame("data: tail\n"), vec![ev(None, "tail")]);
    assert_eq!(frame("event: x\n"), vec![], "no data, nothing to dispatch");
}

#[test]
fn finish_resets_for_reuse() {
    let mut f = SseFramer::new(64);
    let mut out = Vec::new();
    f.push(b"data: a\r", &mut |e| out.push(e));
    f.finish(&mut |e| out.push(e));
    f.push(b"\ndata: b\n\n", &mut |e| out.push(e));
    assert_eq!(out, vec![ev(None, "a"), ev(None, "b")]);
    assert_eq!(f.buffered_bytes(), 0);
}

#[test]
fn invalid_utf8_is_replaced() {
    let (events, _) = frame_chunks(&[b"data: a\xffb\n\n"], 1024);
    assert_eq!(events, vec![ev(None, "a\u{FFFD}b")]);
}

#[test]
fn utf8_split_across_chunks_is_reassembled() {
    let s = "data: 😊\n\n".as_bytes();
    let (events, _) = frame_chunks(&[&s[..8], &s[8..]], 1024);
    assert_eq!(events, vec![ev(None, "😊")]);
}

#[test]
fn leading_bom_is_stripped() {
    let (events, _) = frame_chunks(&[b"\xEF\xBB", b"\xBFdata: a\n\n"], 1024);
    assert_eq!(events, vec![ev(None, "a")]);
}

#[test]
fn oversized_event_is_dropped_and_framer_resyncs() {
    let big = "x".repeat(200);
    let input = format!("data: small\n\ndata: {big}\ndata: more\n\ndata: after\n\n");
    let (events, f) = frame_chunks(&[input.as_bytes()], 100);
    assert_eq!(events, vec![ev(None, "small"), ev(None, "after")]);
    assert_eq!(f.overflowed_events(), 1);
}

#[test]
fn oversized_line_split_across_chunks_is_dropped() {
    let mut chunks: Vec<Vec<u8>> = vec![b"event: big\ndata: ".to_vec()];
    chunks.extend((0..50).map(|_| vec![b'y'; 10]));
    chunks.push(b"\n\nevent: ok\ndata: fine\n\n".to_vec());
    let refs: Vec<&[u8]> = chunks.iter().map(Vec::as_slice).collect();
    let (events, f) = frame_chunks(&refs, 100);
    assert_eq!(events, vec![ev(Some("ok"), "fine")]);
    assert_eq!(f.overflowed_events(), 1);
}

#[test]
fn many_data_lines_hit_the_cap() {
    let input = "data: 0123456789\n".repeat(20) + "\ndata: next\n\n";
    let (events, f) = frame_chunks(&[input.as_bytes()], 100);
    assert_eq!(events, vec![ev(None, "next")]);
    assert_eq!(f.overflowed_events(), 1);
}

#[test]
fn event_exactly_at_cap_is_kept() {
    // Peak held for this event: event "e" (1) + the whole raw line "data: abcd" (10) = 11 bytes.
    let chunks: [&[u8]; 2] = [b"event: e\ndata: ab", b"cd\n\n"];
    let (events, f) = frame_chunks(&chunks, 11);
    assert_eq!(events, vec![ev(Some("e"), "abcd")]);
    assert_eq!(f.overflowed_events(), 0);
    let (events, f) = frame_chunks(&chunks, 10);
    assert_eq!(events, vec![]);
    assert_eq!(f.overflowed_events(), 1);
}

#[test]
fn stream_without_newline_stays_bounded() {
    let cap = 4096;
    let mut f = SseFramer::new(cap);
    let chunk = vec![b'z'; 64 * 1024];
    let mut n = 0;
    for _ in 0..80 {
        // 5 MiB with no line end at all.
        f.push(&chunk, &mut |_| n += 1);
        assert!(f.buffered_bytes() <= cap);
    }
    assert_eq!(n, 0);
    assert_eq!(f.overflowed_events(), 1);
    f.push(b"\n\ndata: back\n\n", &mut |e| {
        assert_eq!(e.data, "back");
        n += 1;
    });
    assert_eq!(n, 1);
}

#[test]
fn overflow_then_finish_does_not_dispatch_the_discarded_event() {
    let (events, f) = frame_chunks(&[b"data: 0123456789012345678901234567890"], 10);
    assert_eq!(events, vec![]);
    assert_eq!(f.overflowed_events(), 1);
}
