//! The response path: the SSE framer and a `StreamObserver` of each API kind, on any bytes split
//! into chunks at fuzzer-chosen sizes, with a small or the default event cap.
//!
//! Checks, besides never panicking:
//! - the framer and the observers hold at most the cap (`buffered_bytes`) after every chunk;
//! - where the chunk boundaries fall changes nothing: the framer dispatches the same events and
//!   counts the same comments and overflows, and every observer ends with the same summary, as when
//!   the body arrives in one chunk (the framer's promise, sse.rs);
//! - the per-chunk outcomes add up to the summary (content events, done);
//! - reading events by stencil (the bytes around a repeated event's one text member compared, the
//!   new string alone scanned) gives every push the same outcome and the stream the same summary as
//!   parsing every event whole.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_core::api::ApiKind;
use sluice_core::response::fuzzing::with_and_without_stencil;
use sluice_core::response::{inspect_response_body, ChunkOutcome, StreamObserver};
use sluice_core::sse::{SseEvent, SseFramer, StreamTail, DEFAULT_MAX_EVENT_BYTES};
use sluice_core_fuzz::chunks;

fn frame(parts: &[&[u8]], cap: usize) -> (Vec<SseEvent>, u64, u64) {
    let mut framer = SseFramer::new(cap);
    let mut events = Vec::new();
    for part in parts {
        framer.push(part, &mut |ev| events.push(ev));
        assert!(framer.buffered_bytes() <= cap, "framer holds {} > cap {cap}", framer.buffered_bytes());
    }
    framer.finish(&mut |ev| events.push(ev));
    (events, framer.comments_seen(), framer.overflowed_events())
}

fn observe(kind: ApiKind, parts: &[&[u8]], cap: usize) -> (sluice_core::response::ResponseSummary, u64) {
    let mut o = StreamObserver::with_max_event_bytes(kind, cap);
    let mut content = 0u64;
    let mut done = false;
    let mut add = |out: ChunkOutcome| {
        content += u64::from(out.content_events);
        done |= out.done;
    };
    for part in parts {
        add(o.push(part));
        assert!(o.buffered_bytes() <= cap, "observer holds {} > cap {cap}", o.buffered_bytes());
    }
    add(o.finish());
    let s = o.summary();
    assert_eq!(content, s.content_chunks, "per-chunk content events do not add up to the summary");
    assert_eq!(done, s.done, "per-chunk done does not match the summary");
    (s, o.comments_seen())
}

fuzz_target!(|data: &[u8]| {
    // The first two bytes choose the chunk sizes, the third the API kind and the cap (one of each
    // per input: splitting into one-byte chunks is the costly part, and the fuzzer steers the
    // choice); the rest is the body.
    let (a, b, pick, body) = match data {
        [a, b, pick, rest @ ..] => (*a, *b, *pick, rest),
        _ => (1, 1, 0, data),
    };
    let kind = ApiKind::ALL[usize::from(pick & 3)];
    let cap = if pick & 4 == 0 { 64 } else { DEFAULT_MAX_EVENT_BYTES };
    let split = chunks(body, a, b);
    let whole: [&[u8]; 1] = [body];
    assert_eq!(frame(&split, cap), frame(&whole, cap), "framer result depends on chunk boundaries (cap {cap})");
    assert_eq!(observe(kind, &split, cap), observe(kind, &whole, cap), "{kind} observer result depends on chunk boundaries (cap {cap})");
    let (stencil, whole_parse) = with_and_without_stencil(kind, &split);
    assert_eq!(stencil, whole_parse, "{kind} observer reads the stream differently by stencil");
    let _ = inspect_response_body(kind, body);
    let mut tail = StreamTail::default();
    for part in &split {
        tail.push(part);
    }
    let mut whole_tail = StreamTail::default();
    whole_tail.push(body);
    assert_eq!(tail.separator_before_new_event(), whole_tail.separator_before_new_event());
});
