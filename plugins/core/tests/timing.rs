//! Timing arithmetic on host timestamps.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use sluice_core::timing::StreamTiming;

const MS: u64 = 1_000_000;

#[test]
fn ttft_tpot_and_rate() {
    let mut t = StreamTiming::new(1_000 * MS);
    assert_eq!(t.ttft_ns(), None);
    t.on_content(1_100 * MS, 0); // role-only chunk: no content events
    assert_eq!(t.ttft_ns(), None);
    t.on_content(1_250 * MS, 1);
    for i in 1..=10 {
        t.on_content(1_250 * MS + i * 20 * MS, 1);
    }
    assert_eq!(t.ttft_ns(), Some(250 * MS));
    assert_eq!(t.content_events, 11);
    // 11 tokens over 200 ms after the first: 20 ms per token, 50 tokens/s.
    assert_eq!(t.tpot_ns(11), Some(20 * MS));
    assert_eq!(t.decode_tokens_per_s(11), Some(50));
    // Reported usage may differ from events: 101 tokens in the same 200 ms.
    assert_eq!(t.tpot_ns(101), Some(2 * MS));
    assert_eq!(t.decode_tokens_per_s(101), Some(500));
    assert_eq!(t.duration_ns(1_500 * MS), 500 * MS);
}

#[test]
fn undefined_cases() {
    let mut t = StreamTiming::new(0);
    assert_eq!(t.tpot_ns(10), None);
    assert_eq!(t.decode_tokens_per_s(10), None);
    t.on_content(5, 3);
    assert_eq!(t.tpot_ns(1), None);
    assert_eq!(t.tpot_ns(0), None);
    assert_eq!(t.tpot_ns(10), None, "all content at one instant");
    assert_eq!(t.decode_tokens_per_s(10), None);
    t.on_content(10, 1);
    assert_eq!(t.tpot_ns(1), None);
    assert_eq!(t.tpot_ns(2), Some(5));
    assert_eq!(t.decode_tokens_per_s(2), Some(200_000_000));
}

#[test]
fn clock_going_backwards_saturates() {
    let mut t = StreamTiming::new(100);
    t.on_content(50, 1);
    assert_eq!(t.ttft_ns(), Some(0));
    t.on_content(40, 1);
    assert_eq!(t.last_content_ns, Some(50), "last never moves backwards");
    assert_eq!(t.duration_ns(10), 0);
    t.on_content(u64::MAX, 1);
    assert_eq!(t.tpot_ns(2), Some(u64::MAX - 50));
    assert_eq!(t.tpot_ns(u64::MAX), Some(0));
    assert_eq!(t.decode_tokens_per_s(u64::MAX), Some(1_000_000_000));
}
