//! Fuzz the response path: any bytes, split into chunks at fuzzer-chosen points, through a
//! `StreamObserver` of every API kind, with a small and the default event cap. Must never panic, and
//! buffered bytes must never exceed the cap.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_core::api::ApiKind;
use sluice_core::response::{inspect_response_body, StreamObserver};
use sluice_core::sse::DEFAULT_MAX_EVENT_BYTES;

fuzz_target!(|data: &[u8]| {
    // First two bytes choose the split points; the rest is the body.
    let (cuts, body) = match data {
        [a, b, rest @ ..] => ((*a as usize, *b as usize), rest),
        _ => ((0, 0), data),
    };
    for kind in ApiKind::ALL {
        for cap in [64, DEFAULT_MAX_EVENT_BYTES] {
            let mut o = StreamObserver::with_max_event_bytes(kind, cap);
            let step = cuts.0.max(1);
            let mut i = 0;
            while i < body.len() {
                // Alternate chunk sizes so CR/LF pairs and UTF-8 sequences land on boundaries.
                let len = if (i / step) % 2 == 0 { step } else { cuts.1.max(1) };
                let end = body.len().min(i + len);
                o.push(&body[i..end]);
                assert!(o.buffered_bytes() <= cap);
                i = end;
            }
            o.finish();
            let _ = o.summary();
        }
        let _ = inspect_response_body(kind, body);
    }
});
