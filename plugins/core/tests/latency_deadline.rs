//! The latency guard's per-stream machine (`latency::deadline`): when response headers are held and
//! released, the 504 at a deadline (not a nanosecond early), the reset of a stream whose headers went
//! out, the total deadline's error event and the reset after it, the wait for a chunk to carry the
//! event, what the tick is told is due, and what the stream's end reports.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use proptest::prelude::*;
use sluice_core::api::ApiKind;
use sluice_core::contract::{GatewayEnd, GatewayReply};
use sluice_core::latency::deadline::{
    error_event, reply_504_body, tick_period_ms, DeadlineKind, Effect, Fired, FirstTokenMark, Phase, StreamWatch, CHUNK_WAIT_NS, END_GRACE_NS, HELD_POLL_NS,
    IDLE_TICK_NS, TICK_NS,
};
use sluice_core::timing::StreamTiming;

const MS: u64 = 1_000_000;
/// Requests start here, so that "ms after the start" and absolute times differ.
const START: u64 = 7 * MS;
const TTFT: u64 = 1000 * MS;
const TOTAL: u64 = 2000 * MS;

fn at(ms: u64) -> u64 {
    START + ms * MS
}

/// A streamed request with a 1 s TTFT and a 2 s total deadline.
fn watch() -> StreamWatch {
    StreamWatch::new(START, Some(TTFT), Some(TOTAL), Some(true))
}

fn deadline_reply(status: u16) -> Effect {
    Effect::MarkReply(GatewayReply { status, end: GatewayEnd::Deadline })
}

/// Response headers of a 200 event stream, llm-metrics behind the guard waiting for the token.
fn held() -> StreamWatch {
    let mut w = watch();
    assert_eq!(w.on_response_headers(200, true, false, || FirstTokenMark::Waiting), vec![Effect::Hold, Effect::Reschedule]);
    assert_eq!(w.phase(), Phase::Held);
    w
}

/// Response headers of a 200 event stream that went out (llm-metrics not behind the guard).
fn streaming_unmarked() -> StreamWatch {
    let mut w = watch();
    assert_eq!(w.on_response_headers(200, true, false, || FirstTokenMark::Absent), vec![Effect::Unmarked]);
    assert_eq!(w.phase(), Phase::Streaming { chunk_wait_until_ns: None });
    w
}

/// A stream released at its first token at +100 ms.
fn streaming() -> StreamWatch {
    let mut w = held();
    assert_eq!(w.on_first_token_mark(FirstTokenMark::At(at(100))), vec![Effect::Release, Effect::RecordTtft { ttft_us: 100_000 }]);
    w
}

fn chunk(w: &mut StreamWatch, now: u64, content: bool) -> Vec<Effect> {
    w.on_response_body(now, true, false, || content)
}

// ---------------------------------------------------------------------------------------------
// The TTFT deadline

#[test]
fn ttft_deadline_fires_exactly_at_its_nanosecond_as_504_or_reset_by_what_reached_the_client() {
    struct Case {
        name: &'static str,
        watch: fn() -> StreamWatch,
        effects: Vec<Effect>,
        phase: Phase,
    }
    let log = |fired| Effect::LogFired { fired, deadline_ms: 1000, after_ms: 1000 };
    let cases = [
        Case {
            name: "no response headers yet",
            watch,
            effects: vec![Effect::Reply504 { kind: DeadlineKind::Ttft, deadline_ms: 1000 }, log(Fired::TtftReply), Effect::CountFired(Fired::TtftReply)],
            phase: Phase::Replied(DeadlineKind::Ttft),
        },
        Case {
            name: "headers held",
            watch: held,
            effects: vec![Effect::Reply504 { kind: DeadlineKind::Ttft, deadline_ms: 1000 }, log(Fired::TtftReply), Effect::CountFired(Fired::TtftReply)],
            phase: Phase::Replied(DeadlineKind::Ttft),
        },
        Case {
            name: "headers out, no mark to hold on",
            watch: streaming_unmarked,
            effects: vec![deadline_reply(200), Effect::Reset, log(Fired::TtftReset), Effect::CountFired(Fired::TtftReset)],
            phase: Phase::Reset(DeadlineKind::Ttft),
        },
    ];
    for case in cases {
        let mut w = (case.watch)();
        let mark = w.is_held().then_some(FirstTokenMark::Waiting);
        assert!(w.next_due_ns(at(0), true).is_some_and(|t| t <= START + TTFT), "{}: looked at by the deadline", case.name);
        // A worker's tick visits only the streams due (`tick_due`): this one at its deadline's
        // nanosecond, not the one before (unless held: a held stream is polled at every tick).
        assert!(w.tick_due(START + TTFT), "{}: due at the deadline", case.name);
        assert_eq!(w.tick_due(START + TTFT - 1), w.is_held(), "{}: due a nanosecond early only if held", case.name);
        assert_eq!(w.on_tick(START + TTFT - 1, mark), vec![], "{}: a nanosecond early", case.name);
        assert_eq!(w.fired(), None, "{}", case.name);
        assert_eq!(w.on_tick(START + TTFT, mark), case.effects, "{}", case.name);
        assert_eq!(w.phase(), case.phase, "{}", case.name);
        // Nothing fires twice, the total deadline included, and nothing is due any more.
        assert_eq!(w.on_tick(START + TOTAL + CHUNK_WAIT_NS, mark), vec![], "{}", case.name);
        assert_eq!(w.next_due_ns(START + TOTAL, true), None, "{}", case.name);
    }
}

#[test]
fn the_first_token_releases_a_held_stream_and_cancels_its_ttft_deadline() {
    let mut w = held();
    // Polled while llm-metrics still waits: nothing happens.
    assert_eq!(w.on_tick(at(50), Some(FirstTokenMark::Waiting)), vec![]);
    assert!(w.is_held());
    assert_eq!(w.on_first_token_mark(FirstTokenMark::At(at(300))), vec![Effect::Release, Effect::RecordTtft { ttft_us: 300_000 }]);
    assert_eq!(w.phase(), Phase::Streaming { chunk_wait_until_ns: None });
    assert_eq!(w.first_token_ns(), Some(at(300)));
    // A second wake-up changes nothing.
    assert_eq!(w.on_first_token_mark(FirstTokenMark::At(at(310))), vec![]);
    // The TTFT deadline no longer applies: the next thing due is the total deadline.
    assert_eq!(w.next_due_ns(at(400), true), Some(START + TOTAL));
    assert_eq!(w.on_tick(START + TTFT, None), vec![]);
    assert_eq!(w.fired(), None);
}

#[test]
fn a_held_stream_is_released_by_the_tick_that_finds_the_mark_even_at_its_deadline() {
    let mut w = held();
    // The mark was made before the deadline, the tick finds it at the deadline: released.
    assert_eq!(w.on_tick(START + TTFT, Some(FirstTokenMark::At(at(999)))), vec![Effect::Release, Effect::RecordTtft { ttft_us: 999_000 }]);
    assert_eq!(w.fired(), None);
    assert_eq!(w.on_tick(START + TTFT + MS, None), vec![]);
}

#[test]
fn only_a_time_in_the_mark_releases() {
    for mark in [FirstTokenMark::Absent, FirstTokenMark::Waiting, FirstTokenMark::Unreadable] {
        let mut w = held();
        assert_eq!(w.on_first_token_mark(mark), vec![], "{mark:?}");
        assert_eq!(w.on_tick(at(500), Some(mark)), vec![], "{mark:?}");
        assert!(w.is_held(), "{mark:?}");
    }
    // And only a held stream is released.
    let mut w = streaming_unmarked();
    assert_eq!(w.on_first_token_mark(FirstTokenMark::At(at(10))), vec![]);
    assert_eq!(w.first_token_ns(), None);
}

#[test]
fn a_held_stream_is_polled_every_10_ms_with_a_release_queue_and_every_tick_without() {
    let w = held();
    assert_eq!(w.next_due_ns(at(50), true), Some(at(50) + HELD_POLL_NS));
    assert_eq!(w.next_due_ns(at(50), false), Some(at(50) + TICK_NS));
    // Near the deadline the deadline comes first.
    assert_eq!(w.next_due_ns(at(995), true), Some(START + TTFT));
    assert_eq!(HELD_POLL_NS, 10 * MS);
    // Not held: no poll, the deadline.
    assert_eq!(watch().next_due_ns(at(50), false), Some(START + TTFT));
}

#[test]
fn headers_are_held_only_for_a_2xx_event_stream_with_a_body_and_a_ttft_deadline_and_the_mark_read_only_then() {
    // (status, event stream, headers are the whole response, TTFT deadline armed, held)
    let cases = [
        (200, true, false, true, true),
        (204, true, false, true, true),
        (199, true, false, true, false),
        (300, true, false, true, false),
        (429, true, false, true, false),
        (503, true, false, true, false),
        (200, false, false, true, false),
        (200, true, true, true, false),
        (200, true, false, false, false),
    ];
    for (status, sse, eos, ttft, hold) in cases {
        let mut w = StreamWatch::new(START, ttft.then_some(TTFT), Some(TOTAL), Some(true));
        let mut read = false;
        let effects = w.on_response_headers(status, sse, eos, || {
            read = true;
            FirstTokenMark::Waiting
        });
        let case = format!("{status} sse={sse} eos={eos} ttft={ttft}");
        assert_eq!(read, hold, "{case}: mark read");
        assert_eq!(w.is_held(), hold, "{case}");
        assert_eq!(effects, if hold { vec![Effect::Hold, Effect::Reschedule] } else { vec![] }, "{case}");
        if !hold {
            assert_eq!(w.phase(), Phase::Streaming { chunk_wait_until_ns: None }, "{case}");
        }
    }
    // A mark that is already a time (or garbage): the headers go out, no warning.
    for mark in [FirstTokenMark::At(at(1)), FirstTokenMark::Unreadable] {
        let mut w = watch();
        assert_eq!(w.on_response_headers(200, true, false, || mark), vec![], "{mark:?}");
        assert_eq!(w.phase(), Phase::Streaming { chunk_wait_until_ns: None }, "{mark:?}");
    }
}

#[test]
fn a_stream_that_got_its_content_before_the_deadline_without_a_mark_is_not_reset() {
    let mut w = streaming_unmarked();
    assert_eq!(chunk(&mut w, at(0), false), vec![], "role chunk: no content");
    assert_eq!(chunk(&mut w, at(200), true), vec![Effect::RecordTtft { ttft_us: 200_000 }]);
    assert_eq!(chunk(&mut w, at(300), true), vec![], "the TTFT goes in once");
    assert_eq!(w.first_token_ns(), Some(at(200)));
    assert_eq!(w.on_tick(START + TTFT, None), vec![]);
    assert_eq!(w.fired(), None);
}

// ---------------------------------------------------------------------------------------------
// The total deadline

#[test]
fn past_the_total_deadline_the_next_chunk_becomes_the_error_event_and_the_stream_is_reset_end_grace_later() {
    let mut w = streaming();
    assert_eq!(chunk(&mut w, START + TOTAL - 1, true), vec![], "a nanosecond before: passes");
    let now = START + TOTAL + 10 * MS;
    assert_eq!(
        chunk(&mut w, now, true),
        vec![
            Effect::ErrorEvent { kind: DeadlineKind::Total, deadline_ms: 2000 },
            deadline_reply(200),
            Effect::CountFired(Fired::TotalEvent),
            Effect::Reschedule
        ]
    );
    assert_eq!(w.phase(), Phase::Cut { reset_at_ns: Some(now + END_GRACE_NS) });
    assert_eq!(w.fired(), Some(Fired::TotalEvent));
    assert_eq!(w.next_due_ns(now, true), Some(now + END_GRACE_NS));
    // Later chunks are dropped without being read.
    assert_eq!(w.on_response_body(now + MS, true, false, || panic!("a dropped chunk is not observed")), vec![Effect::DropChunk]);
    assert_eq!(w.on_response_body(now + 2 * MS, true, true, || panic!("not even the last")), vec![Effect::DropChunk]);
    assert_eq!(w.on_tick(now + END_GRACE_NS - 1, None), vec![]);
    assert_eq!(w.on_tick(now + END_GRACE_NS, None), vec![Effect::Reset]);
    assert_eq!(w.phase(), Phase::Cut { reset_at_ns: None });
    assert_eq!(w.on_tick(now + 10 * END_GRACE_NS, None), vec![], "reset once");
    assert_eq!(w.next_due_ns(now + END_GRACE_NS, true), None);
    assert_eq!(END_GRACE_NS, 20 * MS);
}

#[test]
fn a_stream_silent_past_the_total_deadline_waits_chunk_wait_for_a_chunk_then_is_reset() {
    let mut w = streaming();
    assert_eq!(w.on_tick(START + TOTAL - 1, None), vec![]);
    let until = START + TOTAL + CHUNK_WAIT_NS;
    assert_eq!(w.on_tick(START + TOTAL, None), vec![Effect::AwaitChunk { until_ns: until }]);
    assert_eq!(w.phase(), Phase::Streaming { chunk_wait_until_ns: Some(until) });
    assert_eq!(w.next_due_ns(START + TOTAL, true), Some(until));
    assert_eq!(w.on_tick(until - 1, None), vec![]);
    assert_eq!(
        w.on_tick(until, None),
        vec![
            deadline_reply(200),
            Effect::Reset,
            Effect::LogFired { fired: Fired::TotalReset, deadline_ms: 2000, after_ms: 2500 },
            Effect::CountFired(Fired::TotalReset)
        ]
    );
    assert_eq!(w.phase(), Phase::Reset(DeadlineKind::Total));
    assert_eq!(w.next_due_ns(until, true), None);
    assert_eq!(CHUNK_WAIT_NS, 500 * MS);
}

#[test]
fn a_chunk_within_chunk_wait_carries_the_error_event_instead_of_a_reset() {
    let mut w = streaming();
    assert_eq!(w.on_tick(START + TOTAL, None), vec![Effect::AwaitChunk { until_ns: START + TOTAL + CHUNK_WAIT_NS }]);
    let effects = chunk(&mut w, START + TOTAL + 499 * MS, false);
    assert_eq!(effects.first(), Some(&Effect::ErrorEvent { kind: DeadlineKind::Total, deadline_ms: 2000 }));
    assert_eq!(w.on_tick(START + TOTAL + CHUNK_WAIT_NS, None), vec![], "no reset for the wait");
    assert_eq!(w.on_tick(START + TOTAL + 499 * MS + END_GRACE_NS, None), vec![Effect::Reset]);
}

#[test]
fn total_deadline_before_anything_reached_the_client_is_a_504_also_for_whole_answers() {
    // A whole answer: no TTFT deadline at all.
    let mut w = StreamWatch::new(START, Some(TTFT), Some(TOTAL), Some(false));
    assert_eq!(w.ttft_ms(), 0);
    assert_eq!(w.next_due_ns(at(0), true), Some(START + TOTAL));
    assert_eq!(w.on_tick(START + TTFT, None), vec![]);
    assert_eq!(w.on_tick(START + TOTAL - 1, None), vec![]);
    assert_eq!(
        w.on_tick(START + TOTAL, None),
        vec![
            Effect::Reply504 { kind: DeadlineKind::Total, deadline_ms: 2000 },
            Effect::LogFired { fired: Fired::TotalReply, deadline_ms: 2000, after_ms: 2000 },
            Effect::CountFired(Fired::TotalReply)
        ]
    );
    // Unknown whether it streams: treated as a stream.
    assert_eq!(StreamWatch::new(START, Some(TTFT), Some(TOTAL), None).ttft_ms(), 1000);
    // A held stream whose total deadline comes first.
    let mut w = StreamWatch::new(START, Some(3 * TOTAL), Some(TOTAL), Some(true));
    w.on_response_headers(200, true, false, || FirstTokenMark::Waiting);
    assert_eq!(w.on_tick(START + TOTAL, Some(FirstTokenMark::Waiting)).first(), Some(&Effect::Reply504 { kind: DeadlineKind::Total, deadline_ms: 2000 }));
}

#[test]
fn the_error_event_needs_an_event_stream_to_ride_on() {
    let mut w = watch();
    w.on_response_headers(200, false, false, || panic!("a body that is not an event stream is not held"));
    assert_eq!(w.on_response_body(START + TOTAL, false, false, || false), vec![]);
    assert_eq!(w.fired(), None);
}

// ---------------------------------------------------------------------------------------------
// The end of a response, the end of a stream

#[test]
fn a_complete_response_has_no_deadline_left_however_late_it_is_logged() {
    // The last chunk passed: nothing fires, nothing is due.
    let mut w = streaming();
    assert_eq!(w.on_response_body(at(1500), true, true, || true), vec![]);
    assert_eq!(w.next_due_ns(at(1500), true), None);
    assert_eq!(w.on_tick(START + 10 * TOTAL, None), vec![]);
    // Headers that are the whole response, before any deadline.
    let mut w = watch();
    assert_eq!(w.on_response_headers(503, false, true, || panic!("not read")), vec![]);
    assert_eq!(w.next_due_ns(at(10), true), None);
    assert_eq!(w.on_tick(START + 10 * TOTAL, None), vec![]);
    // The last chunk carries no error event even past the deadline: the answer is complete.
    let mut w = streaming();
    assert_eq!(w.on_response_body(START + TOTAL + MS, true, true, || false), vec![]);
    assert_eq!(w.fired(), None);
}

#[test]
fn the_end_reports_what_fired_and_the_ttft_sample() {
    // Released at llm-metrics' mark (+100): the guard saw the token later; the mark wins, and the
    // window already has it.
    let w = streaming();
    let mut timing = StreamTiming::new(START);
    timing.on_content(at(130), 1);
    let end = w.end(&mut timing);
    assert_eq!((end.fired, end.ttft_us, end.window_ttft_us), (None, Some(100_000), None));
    assert_eq!(timing.first_content_ns, Some(at(100)));

    // At a TTFT deadline that fired the TTFT is the deadline, into the window at the end.
    let mut w = held();
    w.on_tick(START + TTFT, Some(FirstTokenMark::Waiting));
    let end = w.end(&mut StreamTiming::new(START));
    assert_eq!((end.fired, end.ttft_us, end.window_ttft_us), (Some(Fired::TtftReply), Some(1_000_000), Some(1_000_000)));

    // A stream without content has no TTFT, whatever released it.
    let mut w = held();
    w.on_first_token_mark(FirstTokenMark::At(at(420)));
    let end = w.end(&mut StreamTiming::new(START));
    assert_eq!((end.fired, end.ttft_us, end.window_ttft_us), (None, None, None));

    // Cut by the error event: the measured TTFT, outcome total.
    let mut w = streaming_unmarked();
    chunk(&mut w, at(100), true);
    chunk(&mut w, START + TOTAL, true);
    let mut timing = StreamTiming::new(START);
    timing.on_content(at(100), 1);
    let end = w.end(&mut timing);
    assert_eq!((end.fired, end.ttft_us, end.window_ttft_us), (Some(Fired::TotalEvent), Some(100_000), None));

    // Never saw a token and never recorded: the window gets the measured TTFT at the end.
    let w = watch();
    let mut timing = StreamTiming::new(START);
    timing.on_content(at(250), 1);
    assert_eq!(w.end(&mut timing).window_ttft_us, Some(250_000));
}

// ---------------------------------------------------------------------------------------------
// Labels, the mark, the tick, the bodies

#[test]
fn fired_labels() {
    let cases = [
        (Fired::TtftReply, "ttft", "reply_504"),
        (Fired::TtftReset, "ttft", "reset"),
        (Fired::TotalReply, "total", "reply_504"),
        (Fired::TotalEvent, "total", "error_event"),
        (Fired::TotalReset, "total", "reset"),
    ];
    for (fired, kind, action) in cases {
        assert_eq!((fired.kind().as_str(), fired.action()), (kind, action), "{fired:?}");
    }
}

#[test]
fn first_token_mark_parsing() {
    let cases = [
        (None, FirstTokenMark::Absent),
        (Some("0"), FirstTokenMark::Waiting),
        (Some("1234"), FirstTokenMark::At(1234)),
        (Some("00"), FirstTokenMark::Unreadable),
        (Some(" 0"), FirstTokenMark::Unreadable),
        (Some(""), FirstTokenMark::Unreadable),
        (Some("-5"), FirstTokenMark::Unreadable),
        (Some("soon"), FirstTokenMark::Unreadable),
        (Some("18446744073709551616"), FirstTokenMark::Unreadable),
    ];
    for (value, mark) in cases {
        assert_eq!(FirstTokenMark::parse(value), mark, "{value:?}");
    }
}

#[test]
fn the_tick_waits_for_the_earliest_thing_due_in_whole_milliseconds_between_1_and_1000() {
    let now = 5 * MS + 300;
    let cases: [(&[u64], u64); 8] = [
        (&[], 1000),
        (&[now + 5000 * MS], 1000),
        (&[now + 500 * MS], 500),
        (&[now + 40 * MS, now + 10 * MS], 10),
        (&[now + 10 * MS + 1], 11),
        (&[now + 1], 1),
        (&[now], 1),
        (&[now - MS], 1),
    ];
    for (due, period) in cases {
        assert_eq!(tick_period_ms(now, due.iter().copied()), period, "{due:?}");
    }
    assert_eq!((TICK_NS, IDLE_TICK_NS), (MS, 1000 * MS));
}

#[test]
fn deadline_bodies_take_the_error_shape_of_the_api() {
    let reply: serde_json::Value = serde_json::from_str(&reply_504_body(ApiKind::ChatCompletions, DeadlineKind::Ttft, "v1", 1000)).unwrap();
    assert_eq!(
        reply,
        serde_json::json!({"error": {"message": "sluice latency-guard: the first token of model version v1 did not arrive within the ttft deadline of 1000 ms",
            "type": "timeout", "code": "ttft_deadline_exceeded"}})
    );
    let reply: serde_json::Value = serde_json::from_str(&reply_504_body(ApiKind::AnthropicMessages, DeadlineKind::Total, "v2", 30)).unwrap();
    assert_eq!(reply["error"]["type"], "timeout_error");
    assert_eq!(reply["error"]["sluice_code"], "total_deadline_exceeded");
    assert!(reply["error"]["message"].as_str().unwrap().starts_with("sluice latency-guard: the response of model version v2 "));

    let message = "sluice latency-guard: total deadline of 2000 ms exceeded; the response was cut here";
    for api in [ApiKind::ChatCompletions, ApiKind::Completions] {
        let event = error_event(api, DeadlineKind::Total, 2000);
        let data = event.strip_prefix("data: ").and_then(|e| e.strip_suffix("\n\ndata: [DONE]\n\n")).unwrap();
        let data: serde_json::Value = serde_json::from_str(data).unwrap();
        assert_eq!(data, serde_json::json!({"error": {"message": message, "type": "timeout", "code": "total_deadline_exceeded"}}), "{api:?}");
    }
    let event = error_event(ApiKind::Responses, DeadlineKind::Total, 2000);
    let data: serde_json::Value = serde_json::from_str(event.strip_prefix("event: error\ndata: ").and_then(|e| e.strip_suffix("\n\n")).unwrap()).unwrap();
    assert_eq!(data, serde_json::json!({"type": "error", "code": "total_deadline_exceeded", "message": message, "param": null}));
    let event = error_event(ApiKind::AnthropicMessages, DeadlineKind::Total, 2000);
    let data: serde_json::Value = serde_json::from_str(event.strip_prefix("event: error\ndata: ").and_then(|e| e.strip_suffix("\n\n")).unwrap()).unwrap();
    assert_eq!(data["error"]["sluice_code"], "total_deadline_exceeded");
}

// ---------------------------------------------------------------------------------------------
// Any order of events

#[derive(Debug, Clone)]
enum Event {
    Headers { status: u16, sse: bool, eos: bool, mark: FirstTokenMark },
    Mark(FirstTokenMark),
    Chunk { content: bool, eos: bool },
    Tick { mark: FirstTokenMark },
}

fn event() -> impl Strategy<Value = Event> {
    let mark = prop_oneof![
        Just(FirstTokenMark::Absent),
        Just(FirstTokenMark::Waiting),
        Just(FirstTokenMark::Unreadable),
        (1u64..3_000).prop_map(|ms| FirstTokenMark::At(START + ms * MS)),
    ];
    let headers = (prop_oneof![Just(200u16), Just(500)], any::<bool>(), prop::bool::weighted(0.1), mark.clone());
    prop_oneof![
        headers.prop_map(|(status, sse, eos, mark)| Event::Headers { status, sse, eos, mark }),
        mark.clone().prop_map(Event::Mark),
        (any::<bool>(), prop::bool::weighted(0.05)).prop_map(|(content, eos)| Event::Chunk { content, eos }),
        mark.prop_map(|mark| Event::Tick { mark }),
    ]
}

proptest! {
    /// Whatever the order: nothing fires before its deadline, a deadline fires at most once, a 504
    /// is never sent after anything reached the client, and a reset after the error event comes
    /// only END_GRACE after it.
    #[test]
    fn deadlines_fire_once_never_early_and_504_only_before_the_client_saw_anything(
        steps in prop::collection::vec((0u64..400, event()), 1..40),
    ) {
        let mut w = watch();
        let mut now = START;
        let mut fired = 0;
        let mut client_saw = false;
        let mut event_at = None;
        for (dt, e) in steps {
            now += dt * MS;
            let effects = match e {
                Event::Headers { status, sse, eos, mark } => w.on_response_headers(status, sse, eos, || mark),
                Event::Mark(mark) => w.on_first_token_mark(mark),
                Event::Chunk { content, eos } => w.on_response_body(now, true, eos, || content),
                Event::Tick { mark } => {
                    let mark = w.is_held().then_some(mark);
                    let (due, before) = (w.tick_due(now), w.clone());
                    let effects = w.on_tick(now, mark);
                    // A tick the worker skips (not due) would have done nothing.
                    prop_assert!(due || (effects.is_empty() && w == before), "a tick not due acted: {effects:?}");
                    effects
                }
            };
            for effect in &effects {
                match *effect {
                    Effect::CountFired(f) => {
                        fired += 1;
                        let deadline = match f.kind() { DeadlineKind::Ttft => TTFT, DeadlineKind::Total => TOTAL };
                        prop_assert!(now >= START + deadline, "{f:?} at {now}");
                    }
                    Effect::Reply504 { .. } => prop_assert!(!client_saw, "504 after the headers went out"),
                    Effect::ErrorEvent { .. } => event_at = Some(now),
                    Effect::Reset => if let Some(t) = event_at {
                        prop_assert!(now >= t + END_GRACE_NS);
                    },
                    _ => {}
                }
            }
            prop_assert!(fired <= 1, "{effects:?}");
            if matches!(w.phase(), Phase::Streaming { .. }) {
                client_saw = true;
            }
        }
    }
}
