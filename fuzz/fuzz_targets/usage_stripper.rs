//! The usage-chunk stripper (rewrite.rs `UsageChunkStripper`) on any bytes, split into chunks at
//! fuzzer-chosen sizes, with a small and the default event cap.
//!
//! Checks, besides never panicking:
//! - it holds at most the cap after every chunk;
//! - where the chunk boundaries fall changes neither the bytes sent on nor the counters;
//! - taking the word of an observer of the same chunks for the texts it found to be JSON
//!   (`push_knowing`, as tenant-budget does) changes neither;
//! - a stream that never spells `usage` (and has no escapes) passes byte for byte;
//! - against the SSE framer reading its input and its output: every complete event whose data is a
//!   JSON object with a non-null `usage` and empty, `null` or absent `choices` is gone; every other
//!   single-`data:`-line JSON object event with a `usage` member is still there and parses to the
//!   same `Value` without it; everything else (and an unfinished last event) is unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde::de::IgnoredAny;
use serde_json::Value;
use sluice_core::api::ApiKind;
use sluice_core::response::StreamObserver;
use sluice_core::rewrite::UsageChunkStripper;
use sluice_core::sse::{SseEvent, SseFramer, DEFAULT_MAX_EVENT_BYTES};
use sluice_core_fuzz::chunks;

fn strip(parts: &[&[u8]], cap: usize) -> (Vec<u8>, u64, u64, u64) {
    let mut s = UsageChunkStripper::new(cap);
    let mut out = Vec::new();
    for part in parts {
        out.extend_from_slice(&s.push(part));
        assert!(s.held_bytes() <= cap, "stripper holds {} > cap {cap}", s.held_bytes());
    }
    out.extend_from_slice(&s.finish());
    (out, s.removed_usage_events(), s.stripped_usage_members(), s.overflowed_events())
}

/// [`strip`], with an observer of the same chunks vouching for the JSON it read.
fn strip_knowing(parts: &[&[u8]], cap: usize) -> (Vec<u8>, u64, u64, u64) {
    let mut s = UsageChunkStripper::new(cap);
    let mut observer = StreamObserver::with_max_event_bytes(ApiKind::ChatCompletions, cap);
    observer.keep_validated();
    let mut out = Vec::new();
    for part in parts {
        observer.push(part);
        out.extend_from_slice(&s.push_knowing(part, observer.validated()));
    }
    out.extend_from_slice(&s.finish());
    (out, s.removed_usage_events(), s.stripped_usage_members(), s.overflowed_events())
}

/// Events completed by a blank line, and those only `finish` dispatches (an unterminated last one).
fn events(bytes: &[u8]) -> (Vec<SseEvent>, Vec<SseEvent>) {
    let mut framer = SseFramer::new(DEFAULT_MAX_EVENT_BYTES);
    let (mut complete, mut trailing) = (Vec::new(), Vec::new());
    framer.push(bytes, &mut |ev| complete.push(ev));
    framer.finish(&mut |ev| trailing.push(ev));
    (complete, trailing)
}

enum Want {
    Same(SseEvent),
    Without(Option<String>, Value),
}

/// What must become of each input event; `None` when serde_json's two readings of some event's
/// data differ (a `Value` refused where a skipping parse accepts, e.g. `1e400`), so the stripper's
/// verdict on it cannot be predicted here.
fn expectation(input: &[u8]) -> Option<Vec<Want>> {
    let (complete, trailing) = events(input);
    let mut want = Vec::new();
    for ev in complete {
        let value = match serde_json::from_str::<Value>(&ev.data) {
            Ok(v) => v,
            Err(_) if serde_json::from_str::<IgnoredAny>(&ev.data).is_ok() => return None,
            Err(_) => {
                want.push(Want::Same(ev));
                continue;
            }
        };
        let Value::Object(mut obj) = value else {
            want.push(Want::Same(ev));
            continue;
        };
        let Some(usage) = obj.get("usage") else {
            want.push(Want::Same(ev));
            continue;
        };
        let no_choices = match obj.get("choices") {
            None | Some(Value::Null) => true,
            Some(Value::Array(a)) => a.is_empty(),
            Some(_) => false,
        };
        if !usage.is_null() && no_choices {
            continue;
        }
        if ev.data.contains('\n') {
            want.push(Want::Same(ev));
        } else {
            obj.remove("usage");
            want.push(Want::Without(ev.event, Value::Object(obj)));
        }
    }
    want.extend(trailing.into_iter().map(Want::Same));
    Some(want)
}

fuzz_target!(|data: &[u8]| {
    let (a, b, body) = match data {
        [a, b, rest @ ..] => (*a, *b, rest),
        _ => (1, 1, data),
    };
    let split = chunks(body, a, b);
    let mut full = None;
    for cap in [64, DEFAULT_MAX_EVENT_BYTES] {
        let whole = strip(&[body], cap);
        assert_eq!(strip(&split, cap), whole, "stripper result depends on chunk boundaries (cap {cap})");
        assert_eq!(strip_knowing(&split, cap), whole, "the observer's word changed the stripper's result (cap {cap})");
        full = Some(whole);
    }
    let Some((out, _, _, overflowed)) = full else { return };
    if !body.windows(5).any(|w| w == b"usage") && !body.contains(&b'\\') {
        assert_eq!(out, body, "a stream without usage was changed");
    }
    if overflowed > 0 {
        return;
    }
    let Some(want) = expectation(body) else { return };
    let (complete, trailing) = events(&out);
    let got: Vec<SseEvent> = complete.into_iter().chain(trailing).collect();
    assert_eq!(got.len(), want.len(), "event count after stripping: {:?}", String::from_utf8_lossy(&out));
    for (g, w) in got.iter().zip(&want) {
        match w {
            Want::Same(ev) => assert_eq!(g, ev, "an event that must pass unchanged"),
            Want::Without(event, v) => {
                assert_eq!(&g.event, event);
                match serde_json::from_str::<Value>(&g.data) {
                    Ok(got) => assert_eq!(&got, v, "usage removed: {:?}", g.data),
                    Err(e) => panic!("stripping usage broke the JSON ({e}): {:?}", g.data),
                }
            }
        }
    }
});
