//! Property tests: chunk boundaries never change the events, and no input panics or grows memory
//! past the cap.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use proptest::prelude::*;
use sluice_core::api::ApiKind;
use sluice_core::response::StreamObserver;
use sluice_core::sse::{SseEvent, SseFramer};

#[derive(Debug, Clone)]
enum Line {
    Event(String),
    Data(String),
    Comment(String),
    Id(String),
}

fn text() -> impl Strategy<Value = String> {
    // Any characters except line terminators, including multi-byte ones and colons.
    proptest::string::string_regex("[^\r\n]{0,24}").unwrap()
}

fn line() -> impl Strategy<Value = Line> {
    prop_oneof![
        1 => text().prop_map(Line::Event),
        4 => text().prop_map(Line::Data),
        1 => text().prop_map(Line::Comment),
        1 => text().prop_map(Line::Id),
    ]
}

fn terminator() -> impl Strategy<Value = &'static str> {
    prop_oneof![Just("\n"), Just("\r\n"), Just("\r")]
}

/// A serialised stream of events, each line with a random terminator.
fn stream() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec((proptest::collection::vec((line(), terminator()), 0..5), terminator()), 0..8).prop_map(|events| {
        let mut out = String::new();
        for (lines, blank) in events {
            for (l, t) in lines {
                match l {
                    // A leading space would be stripped, so always write one to keep values exact.
                    Line::Event(v) => out.push_str(&format!("event: {v}")),
                    Line::Data(v) => out.push_str(&format!("data: {v}")),
                    Line::Comment(v) => out.push_str(&format!(":{v}")),
                    Line::Id(v) => out.push_str(&format!("id: {v}")),
                }
                out.push_str(t);
            }
            out.push_str(blank);
        }
        out.into_bytes()
    })
}

fn run(chunks: &[&[u8]], cap: usize) -> (Vec<SseEvent>, u64, u64) {
    let mut f = SseFramer::new(cap);
    let mut events = Vec::new();
    for c in chunks {
        f.push(c, &mut |e| events.push(e));
        assert!(f.buffered_bytes() <= cap);
    }
    f.finish(&mut |e| events.push(e));
    (events, f.comments_seen(), f.overflowed_events())
}

fn split<'a>(bytes: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    cuts.sort_unstable();
    let mut chunks = Vec::new();
    let mut start = 0;
    for c in cuts {
        chunks.push(&bytes[start..c]);
        start = c;
    }
    chunks.push(&bytes[start..]);
    chunks
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn any_split_gives_the_same_events(s in stream(), cuts in proptest::collection::vec(any::<usize>(), 0..12)) {
        let whole = run(&[&s], 1 << 20);
        let pieces = run(&split(&s, &cuts), 1 << 20);
        prop_assert_eq!(&whole, &pieces);
        let bytewise: Vec<&[u8]> = s.chunks(1).collect();
        prop_assert_eq!(&whole, &run(&bytewise, 1 << 20));
    }

    #[test]
    fn any_split_with_a_small_cap_gives_the_same_events(s in stream(), cuts in proptest::collection::vec(any::<usize>(), 0..12), cap in 0usize..64) {
        prop_assert_eq!(run(&[&s], cap), run(&split(&s, &cuts), cap));
    }

    #[test]
    fn arbitrary_bytes_never_panic_and_stay_bounded(
        bytes in proptest::collection::vec(prop_oneof![Just(b'\n'), Just(b'\r'), Just(b':'), any::<u8>()], 0..2048),
        cuts in proptest::collection::vec(any::<usize>(), 0..16),
        cap in 0usize..300,
    ) {
        run(&split(&bytes, &cuts), cap);
    }

    #[test]
    fn observer_never_panics_and_stays_bounded(
        prefix in prop_oneof![Just(&b""[..]), Just(&b"data: "[..]), Just(&b"event: error\ndata: "[..]), Just(&b"{"[..])],
        bytes in proptest::collection::vec(any::<u8>(), 0..1024),
        cuts in proptest::collection::vec(any::<usize>(), 0..8),
        cap in 0usize..512,
    ) {
        let mut input = prefix.to_vec();
        input.extend_from_slice(&bytes);
        for kind in ApiKind::ALL {
            let mut o = StreamObserver::with_max_event_bytes(kind, cap);
            for c in split(&input, &cuts) {
                o.push(c);
                prop_assert!(o.buffered_bytes() <= cap);
            }
            o.finish();
            let s = o.summary();
            prop_assert!(s.usage_reported || s.usage.output_tokens == s.estimated_output_tokens);
        }
    }

    #[test]
    fn observer_summary_is_split_invariant(tokens in proptest::collection::vec("[a-zé😊 ]{0,6}", 0..20), cuts in proptest::collection::vec(any::<usize>(), 0..10)) {
        let mut body = String::new();
        for t in &tokens {
            body.push_str(&format!("data: {}\n\n", serde_json::json!({"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":t}}]})));
        }
        body.push_str("data: [DONE]\n\n");
        let run_obs = |chunks: &[&[u8]]| {
            let mut o = StreamObserver::new(ApiKind::ChatCompletions);
            let n: u32 = chunks.iter().map(|c| o.push(c).content_events).sum::<u32>() + o.finish().content_events;
            (n, o.summary())
        };
        let whole = run_obs(&[body.as_bytes()]);
        prop_assert_eq!(whole.0 as usize, tokens.iter().filter(|t| !t.is_empty()).count());
        prop_assert_eq!(&whole, &run_obs(&split(body.as_bytes(), &cuts)));
    }
}
