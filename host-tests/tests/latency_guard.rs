//! latency-guard, the built `.wasm`, in the harness with a virtual clock: TTFT deadlines (a clean
//! 504 while the response headers are held, a reset once they went out), release at the first
//! token, the total deadline's error event, the SLO breaker (opening with enough samples, fallback
//! and refusal while open, half-open probes, hysteresis against flapping), priority shedding against
//! an in-flight limit, configuration errors and malformed input. Every figure is exact: the 1 ms
//! tick fires deadlines at their time to the millisecond.
//!
//! The tests play the filters around the guard (see `common::latency`): model-router's decision in
//! `sluice_route`, llm-metrics' `sluice_first_token`, and Envoy's buffering of the response body
//! while the guard holds the headers.
//!
//! Build the plugin first: `cargo build --release --target wasm32-wasip1 -p sluice-latency-guard`.

mod common;

use std::time::Duration;

use common::latency::*;
use common::llm::chat;
use serde_json::{json, Value};
use sluice_core::latency::{QuantileSketch, SketchParams};
use sluice_host::{Gateway, LogLevel};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn assert_no_crash(gw: &Gateway) {
    assert_eq!(gw.crashed(), None, "the plugin must never trap");
}

/// v1 with a 1 s TTFT deadline and a 2 s total deadline.
fn deadlines() -> Value {
    policy(json!({"ttft_deadline_ms": 1000, "total_deadline_ms": 2000}))
}

/// v1 with the default [`breaker`] (and a TTFT deadline far above the latencies used).
fn with_breaker(overrides: Value) -> Value {
    policy(json!({"ttft_deadline_ms": 5000, "breaker": breaker(overrides)}))
}

fn header(reply: &sluice_host::LocalReply, name: &str) -> Option<String> {
    reply.headers.get(name).map(str::to_string)
}

fn info_logs(gw: &Gateway) -> Vec<String> {
    gw.logs_at_least(LogLevel::Info)
}

/// The breaker log's rendering of a latency in µs (`612.3 ms`).
fn ms_text(us: u64) -> String {
    format!("{}.{} ms", us / 1000, (us % 1000) / 100)
}

/// p95 of `n` samples of `value_ms`, as the shared window's sketch reads it, in the log's rendering.
fn p95_text(value_ms: u64, n: u64) -> String {
    let mut s = QuantileSketch::new(SketchParams::DEFAULT);
    s.add_n(value_ms * 1000, n);
    ms_text(s.quantile(0.95).expect("samples"))
}

/// The stamp of an admitted request whose client got `status`.
fn stamp_with(version: &str, class: &str, priority: &str, probe: bool, outcome: &str, ttft_ms: u64, status: u16) -> Value {
    json!({"version": version, "class": class, "priority": priority, "probe": probe,
           "outcome": outcome, "status": status, "ttft_ms": ttft_ms})
}

/// The stamp of an admitted request whose client got the upstream's 200.
fn stamp(version: &str, class: &str, priority: &str, probe: bool, outcome: &str, ttft_ms: u64) -> Value {
    stamp_with(version, class, priority, probe, outcome, ttft_ms, 200)
}

/// Opens v1's breaker with `n` slow (800 ms) requests; returns the time it opened.
fn open_breaker(gw: &Gateway, n: u64) -> u64 {
    for _ in 0..n {
        stream_ok(gw, STANDARD, "v1", 800);
    }
    assert_eq!(gw.gauge(&breaker_state("v1")), Some(1), "{:?}", transition_logs(gw, "v1"));
    gw.now_ns()
}

/// When v1's breaker entered its current state (the shared state: format, state, since, hold).
fn breaker_since(gw: &Gateway) -> u64 {
    let state = gw.shared_data("sluice/latency-guard/breaker/v1").expect("breaker state");
    u64::from_le_bytes(state[2..10].try_into().expect("8 bytes"))
}

/// Moves the clock to the absolute time `t`.
fn advance_to(gw: &Gateway, t: u64) {
    let now = gw.now_ns();
    assert!(t >= now, "time only moves forward");
    gw.advance(Duration::from_nanos(t - now)).expect("advance");
}

// ---------------------------------------------------------------------------------------------
// 1–3. TTFT deadline
// ---------------------------------------------------------------------------------------------

#[test]
fn ttft_deadline_answers_504_at_the_deadline_not_before_while_headers_are_held() {
    let gw = gateway(&deadlines());
    // Nothing watched: the slow tick (open breakers only).
    assert_eq!(gw.tick_period(), Some(ms(1000)));
    gw.advance(ms(7)).unwrap();
    let mut x = request(&gw, STANDARD, "v1");
    // A watched stream: the tick waits for the earliest thing due (its TTFT deadline, 1 s away),
    // at most 1 s at a time.
    assert_eq!(gw.tick_period(), Some(ms(1000)));
    x.sse_headers(100);
    assert!(x.stream.response_paused(), "headers held until the first token");
    // A held stream is looked at every 10 ms, in case nothing wakes the guard at its first token.
    assert_eq!(gw.tick_period(), Some(ms(10)));
    x.role(100);
    x.at(999);
    assert_eq!(x.local_reply(), None);
    assert!(x.stream.response_paused());
    assert_eq!(x.downstream_status(), None, "nothing reached the client");
    assert!(x.downstream_body().is_empty());
    assert_eq!(gw.counter(&deadline_total("v1", "ttft", "reply_504")), None);

    x.at(1000);
    let reply = x.local_reply().expect("a 504 at the TTFT deadline");
    assert_eq!(reply.status, 504);
    assert_eq!(header(&reply, "content-type").as_deref(), Some("application/json"));
    assert_eq!(header(&reply, "x-sluice-deadline").as_deref(), Some("ttft"));
    assert_eq!(header(&reply, "x-sluice-refused-by").as_deref(), Some("latency-guard"));
    assert_eq!(
        reply_json(&reply),
        json!({"error": {
            "message": "sluice latency-guard: the first token of model version v1 did not arrive within the ttft deadline of 1000 ms",
            "type": "timeout",
            "code": "ttft_deadline_exceeded"
        }})
    );
    assert_eq!(gw.counter(&deadline_total("v1", "ttft", "reply_504")), Some(1));
    assert!(info_logs(&gw).contains(&"sluice latency-guard: ttft deadline of 1000 ms fired for a request to v1 after 1000 ms: reply_504".to_string()));
    assert!(!x.stream.closed_by_plugin());

    // Nothing fires twice (the total deadline passes too), and the late token never reaches anyone.
    x.token(1500, "late");
    x.at(3000);
    assert_eq!(gw.counter(&deadline_total("v1", "ttft", "reply_504")), Some(1));
    assert_eq!(gw.counter(&deadline_total("v1", "total", "reply_504")), None);
    assert_eq!(gw.counter(&deadline_total("v1", "total", "reset")), None);
    assert!(!x.stream.closed_by_plugin());
    x.end();
    assert_eq!(x.stamp(), Some(stamp_with("v1", "standard", "standard", false, "ttft", 1000, 504)));
    assert_eq!(gw.counter(&requests_total("v1", "standard", "ttft")), Some(1));
    assert_no_crash(&gw);
}

/// What a held stream that got no token by its TTFT deadline left behind.
#[derive(Debug, PartialEq)]
struct TtftReply {
    /// At +999 ms: a reply, headers still held, a status sent to the client.
    at_999: (Option<u32>, bool, Option<String>),
    status: u32,
    headers: [Option<String>; 3],
    body: Value,
    downstream_status: Option<String>,
    replies_504: Option<u64>,
    stamp: Option<Value>,
    requests_total: Option<u64>,
    crashed: Option<String>,
}

/// Every API: a stream whose headers the guard holds (llm-metrics behind it) and whose first token
/// does not come by the TTFT deadline is answered 504 at the deadline and not a millisecond before,
/// in its API's error shape, after the events that precede content.
#[test]
fn every_api_gets_the_ttft_504_in_its_own_error_shape() {
    use common::llm::{completions, messages, responses};
    let message = "sluice latency-guard: the first token of model version v1 did not arrive within the ttft deadline of 1000 ms";
    let openai = json!({"error": {"message": message, "type": "timeout", "code": "ttft_deadline_exceeded"}});
    let before_content = |t: Vec<(u64, String)>, first_content_ms: u64| -> Vec<Vec<u8>> {
        t.into_iter().filter(|(ms, _)| *ms < first_content_ms).map(|(_, e)| e.into_bytes()).collect()
    };
    let cases: [(&str, String, Vec<Vec<u8>>, Value); 4] = [
        (chat::PATH, chat::request(true, true), vec![chat::role().into_bytes()], openai.clone()),
        (completions::PATH, completions::request(true), vec![], openai.clone()),
        (responses::PATH, responses::request(true), before_content(responses::timeline(), 250), openai.clone()),
        (
            messages::PATH,
            messages::request(true),
            before_content(messages::timeline(), 400),
            json!({"type": "error", "error": {"type": "timeout_error", "message": message, "sluice_code": "ttft_deadline_exceeded"}}),
        ),
    ];
    for (path, body, events, error) in cases {
        let gw = gateway(&deadlines());
        let mut x = Req::new(STANDARD, "v1").api(path, body).send(&gw);
        x.sse_headers(100);
        for e in &events {
            x.chunk(100, e, false, false);
        }
        x.at(999);
        let at_999 = (x.local_reply().map(|r| r.status), x.stream.response_paused(), x.downstream_status());
        x.at(1000);
        let reply = x.local_reply().unwrap_or_else(|| panic!("{path}: a 504 at the TTFT deadline"));
        let downstream_status = x.downstream_status();
        x.end();
        let got = TtftReply {
            at_999,
            status: reply.status,
            headers: [header(&reply, "content-type"), header(&reply, "x-sluice-deadline"), header(&reply, "x-sluice-refused-by")],
            body: reply_json(&reply),
            downstream_status,
            replies_504: gw.counter(&deadline_total("v1", "ttft", "reply_504")),
            stamp: x.stamp(),
            requests_total: gw.counter(&requests_total("v1", "standard", "ttft")),
            crashed: gw.crashed(),
        };
        let want = TtftReply {
            at_999: (None, true, None),
            status: 504,
            headers: [Some("application/json".into()), Some("ttft".into()), Some("latency-guard".into())],
            body: error,
            downstream_status: Some("504".into()),
            replies_504: Some(1),
            stamp: Some(stamp_with("v1", "standard", "standard", false, "ttft", 1000, 504)),
            requests_total: Some(1),
            crashed: None,
        };
        assert_eq!(got, want, "{path}");
    }
}

#[test]
fn ttft_deadline_answers_504_when_the_upstream_has_not_even_sent_headers() {
    let gw = gateway(&deadlines());
    let mut x = request(&gw, CRITICAL, "v1");
    x.at(999);
    assert_eq!(x.local_reply(), None);
    x.at(1000);
    let reply = x.local_reply().expect("504");
    assert_eq!(reply.status, 504);
    assert_eq!(reply_json(&reply)["error"]["code"], "ttft_deadline_exceeded");
    // Headers arriving after the reply are dropped.
    x.sse_headers(1200);
    assert_eq!(x.downstream_status().as_deref(), Some("504"));
    x.end();
    assert_eq!(gw.counter(&deadline_total("v1", "ttft", "reply_504")), Some(1));
    assert_eq!(gw.counter(&requests_total("v1", "interactive", "ttft")), Some(1));
    assert_no_crash(&gw);
}

/// A held stream whose first token arrives at +300 ms: released at `released_at`, with the role
/// chunk and keep-alive Envoy buffered in front of the guard, in order; nothing cut afterwards.
fn release_at_first_token(req: Req, released_at: u64) {
    let gw = gateway(&deadlines());
    gw.advance(ms(3)).unwrap();
    let mut x = req.send(&gw);
    x.sse_headers(50);
    x.role(50);
    x.chunk(120, b": keep-alive\n\n", false, false);
    x.at(299);
    assert!(x.stream.response_paused());
    assert_eq!(x.downstream_status(), None);
    x.token(300, "Hi");
    if released_at > 300 {
        // The mark is at +300; without a wake-up the guard finds it at its next tick.
        assert!(x.stream.response_paused());
        assert_eq!(x.downstream_status(), None);
        x.at(released_at - 1);
        assert!(x.stream.response_paused());
        x.at(released_at);
    }
    assert!(!x.stream.response_paused(), "released at +{released_at}");
    assert_eq!(x.downstream_status().as_deref(), Some("200"));
    let expected = [chat::role(), ": keep-alive\n\n".to_string(), chat::content("Hi")].concat();
    assert_eq!(String::from_utf8(x.downstream_body()).unwrap(), expected, "buffered chunks, in order");
    assert_eq!(x.downstream_body(), x.upstream);

    x.token(320, " there");
    x.token(340, "!");
    x.finish(350, 3);
    assert_eq!(x.downstream_body(), x.upstream, "byte-identical");
    // Past the TTFT deadline (the stream has its token): nothing happens.
    x.at(1999);
    assert_eq!(x.local_reply(), None);
    assert!(!x.stream.closed_by_plugin());
    x.end();
    gw.advance(ms(5000)).unwrap();
    // The TTFT sample is llm-metrics' mark (+300), not the moment the guard saw the token.
    assert_eq!(x.stamp(), Some(stamp("v1", "standard", "standard", false, "ok", 300)));
    assert_eq!(gw.counter(&requests_total("v1", "standard", "ok")), Some(1));
    for kind in ["ttft", "total"] {
        for action in ["reply_504", "reset", "error_event"] {
            assert_eq!(gw.counter(&deadline_total("v1", kind, action)), None, "{kind} {action}");
        }
    }
    assert_no_crash(&gw);
}

#[test]
fn held_headers_are_released_at_the_first_token_through_the_release_queue() {
    release_at_first_token(Req::new(STANDARD, "v1"), 300);
}

#[test]
fn held_headers_are_released_by_the_tick_when_nothing_wakes_the_guard() {
    // Held since +50 and looked at every 10 ms: the tick at +310 finds the mark made at +300.
    release_at_first_token(Req::new(STANDARD, "v1").without_release_queue(), 310);
}

#[test]
fn a_stream_without_content_is_released_at_its_end_with_the_upstreams_own_answer() {
    let gw = gateway(&deadlines());
    let mut x = request(&gw, STANDARD, "v1");
    x.sse_headers(10);
    x.role(10);
    let error = "data: {\"error\":{\"message\":\"The server had an error\",\"type\":\"server_error\"}}\n\n";
    x.chunk(400, error.as_bytes(), false, false);
    assert!(x.stream.response_paused(), "no content yet");
    x.chunk(420, chat::DONE.as_bytes(), false, true);
    assert!(!x.stream.response_paused(), "released at the end of the stream");
    assert_eq!(x.downstream_body(), x.upstream, "the upstream's own answer, not a 504");
    x.at(2500);
    assert_eq!(x.local_reply(), None);
    x.end();
    assert_eq!(
        x.stamp(),
        Some(json!({"version": "v1", "class": "standard", "priority": "standard",
        "probe": false, "outcome": "error", "status": 200, "ttft_ms": null}))
    );
    assert_eq!(gw.counter(&deadline_total("v1", "ttft", "reply_504")), None);
    assert_no_crash(&gw);
}

#[test]
fn without_a_first_token_signal_the_headers_go_out_and_the_ttft_deadline_resets_the_stream() {
    let gw = gateway(&deadlines());
    let mut x = Req::new(STANDARD, "v1").without_llm_metrics().send(&gw);
    x.sse_headers(100);
    assert!(!x.stream.response_paused(), "no llm-metrics signal: not held");
    assert_eq!(x.downstream_status().as_deref(), Some("200"));
    let warned = |gw: &Gateway| {
        gw.logs_at_least(LogLevel::Warn)
            .iter()
            .filter(|l| {
                l.as_str()
                    == "sluice latency-guard: a stream without llm-metrics' first-token mark (llm-metrics missing \
                        behind the guard, or skipping this response: content-encoding, path_prefixes); such streams \
                        are not held and a TTFT deadline can only reset them"
            })
            .count()
    };
    assert_eq!(warned(&gw), 1);
    x.role(100);
    assert_eq!(x.downstream_body(), chat::role().into_bytes());
    x.at(999);
    assert!(!x.stream.closed_by_plugin());
    x.at(1000);
    assert!(x.stream.closed_by_plugin(), "reset at the TTFT deadline");
    assert_eq!(x.local_reply(), None, "headers went out: no reply possible");
    assert_eq!(x.downstream_body(), chat::role().into_bytes());
    assert_eq!(gw.counter(&deadline_total("v1", "ttft", "reset")), Some(1));
    assert_eq!(gw.counter(&deadline_total("v1", "ttft", "reply_504")), None);
    x.end();
    assert_eq!(x.stamp(), Some(stamp("v1", "standard", "standard", false, "ttft", 1000)));

    // Content before the deadline (seen by the guard itself) keeps the stream; the warning is once.
    let mut y = Req::new(STANDARD, "v1").without_llm_metrics().send(&gw);
    y.sse_headers(0);
    y.role(0);
    y.token(200, "Hi");
    y.at(1500);
    assert!(!y.stream.closed_by_plugin());
    y.finish(1600, 1);
    assert_eq!(y.downstream_body(), y.upstream);
    y.end();
    assert_eq!(y.stamp(), Some(stamp("v1", "standard", "standard", false, "ok", 200)));
    assert_eq!(gw.counter(&deadline_total("v1", "ttft", "reset")), Some(1));
    assert_eq!(warned(&gw), 1);
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 4. Total deadline
// ---------------------------------------------------------------------------------------------

/// The JSON of the error event that ends a chat stream at its total deadline (its framing checked).
fn split_event(bytes: &[u8]) -> Value {
    let text = std::str::from_utf8(bytes).expect("UTF-8 event");
    let json = text
        .strip_prefix("data: ")
        .and_then(|t| t.strip_suffix("\n\ndata: [DONE]\n\n"))
        .unwrap_or_else(|| panic!("not an SSE error event followed by [DONE]: {text:?}"));
    serde_json::from_str(json).expect("the event's data is JSON")
}

#[test]
fn total_deadline_ends_a_stream_with_an_error_event_then_resets_it() {
    let gw = gateway(&deadlines());
    let mut x = request(&gw, STANDARD, "v1");
    x.sse_headers(0);
    x.role(0);
    x.token(100, "t0");
    for i in 1..10u64 {
        x.token(100 + 200 * i, &format!(" t{i}"));
    }
    x.at(2000);
    assert!(!x.stream.closed_by_plugin());
    assert_eq!(x.downstream_body(), x.upstream, "nothing cut before a chunk arrives");
    let before = x.downstream_body();

    // The first chunk after the deadline carries the error event instead.
    x.token(2010, " late-1");
    let after = x.downstream_body();
    assert_eq!(&after[..before.len()], &before[..]);
    assert_eq!(
        split_event(&after[before.len()..]),
        json!({"error": {
            "message": "sluice latency-guard: total deadline of 2000 ms exceeded; the response was cut here",
            "type": "timeout",
            "code": "total_deadline_exceeded"
        }})
    );
    assert_eq!(gw.counter(&deadline_total("v1", "total", "error_event")), Some(1));
    // Later chunks are emptied; the reset follows 20 ms after the event.
    x.token(2020, " late-2");
    assert_eq!(x.downstream_body(), after);
    x.at(2029);
    assert!(!x.stream.closed_by_plugin());
    x.at(2030);
    assert!(x.stream.closed_by_plugin(), "reset 20 ms after the error event");
    x.token(2040, " late-3");
    assert_eq!(x.downstream_body(), after);
    assert_eq!(x.local_reply(), None);
    assert_eq!(gw.counter(&deadline_total("v1", "total", "error_event")), Some(1));
    assert_eq!(gw.counter(&deadline_total("v1", "total", "reset")), None);
    assert_eq!(gw.counter(&deadline_total("v1", "ttft", "reset")), None);
    x.end();
    assert_eq!(x.stamp(), Some(stamp("v1", "standard", "standard", false, "total", 100)));
    assert_eq!(gw.counter(&requests_total("v1", "standard", "total")), Some(1));
    assert_no_crash(&gw);
}

#[test]
fn total_deadline_resets_a_stalled_stream_whose_headers_went_out() {
    let gw = gateway(&deadlines());
    let mut x = request(&gw, STANDARD, "v1");
    x.sse_headers(0);
    x.role(0);
    x.token(100, "Hi");
    x.token(1500, " there");
    let sent = x.downstream_body();
    // Silent from +1500: at the deadline the guard waits up to 500 ms for a chunk to carry the
    // error event, then resets.
    x.at(2499);
    assert!(!x.stream.closed_by_plugin());
    x.at(2500);
    assert!(x.stream.closed_by_plugin());
    assert_eq!(x.downstream_body(), sent);
    assert_eq!(x.local_reply(), None);
    assert_eq!(gw.counter(&deadline_total("v1", "total", "reset")), Some(1));
    assert_eq!(gw.counter(&deadline_total("v1", "total", "error_event")), None);
    assert!(info_logs(&gw).contains(&"sluice latency-guard: total deadline of 2000 ms fired for a request to v1 after 2500 ms: reset".to_string()));
    x.end();
    assert_eq!(x.stamp().unwrap()["outcome"], "total");
    assert_no_crash(&gw);
}

/// One API's streamed answer and what its stream ends with at the total deadline.
struct ApiCase {
    path: &'static str,
    body: String,
    timeline: Vec<(u64, String)>,
    /// `event: error` framing with this JSON, or (`None`) the OpenAI error chunk and `[DONE]`.
    error_event: Option<Value>,
    /// The guard's own TTFT: the first content event is played at +100 + 10 ms × its index.
    ttft_ms: u64,
}

/// What a stream cut at the total deadline left behind.
#[derive(Debug, PartialEq)]
struct TotalCut {
    /// The bytes that took the place of the chunk after the deadline.
    event: String,
    error_events: Option<u64>,
    stamp: Option<Value>,
    requests_total: Option<u64>,
    crashed: Option<String>,
}

#[test]
fn total_deadline_event_takes_the_error_shape_of_each_api() {
    use common::llm::{completions, messages, responses};
    let message = "sluice latency-guard: total deadline of 2000 ms exceeded; the response was cut here";
    let openai = json!({"error": {"message": message, "type": "timeout", "code": "total_deadline_exceeded"}});
    // The events are compared as bytes: the JSON as serde_json writes it (members in name order).
    let cases = [
        ApiCase {
            path: messages::PATH,
            body: messages::request(true),
            timeline: messages::timeline(),
            error_event: Some(json!({"type": "error", "error": {"type": "timeout_error", "message": message,
                "sluice_code": "total_deadline_exceeded"}})),
            ttft_ms: 130, // message_start, content_block_start, ping, then the first text delta
        },
        ApiCase {
            path: responses::PATH,
            body: responses::request(true),
            timeline: responses::timeline(),
            error_event: Some(json!({"type": "error", "code": "total_deadline_exceeded", "message": message, "param": null})),
            ttft_ms: 140, // four lifecycle events, then the first output_text.delta
        },
        ApiCase {
            path: completions::PATH,
            body: completions::request(true),
            timeline: vec![(1, completions::text("This", None)), (2, completions::text(" is", None))],
            error_event: None,
            ttft_ms: 100,
        },
        ApiCase { path: chat::PATH, body: chat::request(true, true), timeline: chat::timeline(true), error_event: None, ttft_ms: 110 },
    ];
    for case in cases {
        let path = case.path;
        let gw = gateway(&deadlines());
        // Not held (no llm-metrics): the guard's own reading of the stream sees the tokens.
        let mut x = Req::new(STANDARD, "v1").api(path, case.body).without_llm_metrics().send(&gw);
        x.sse_headers(0);
        let (last, rest) = case.timeline.split_last().unwrap();
        for (i, (_, event)) in rest.iter().enumerate() {
            x.chunk(100 + 10 * i as u64, event.as_bytes(), false, false);
        }
        let before = x.downstream_body();
        x.chunk(2010, last.1.as_bytes(), false, false);
        let after = x.downstream_body();
        let event = String::from_utf8(after[before.len()..].to_vec()).unwrap();
        x.end();
        let got = TotalCut {
            event,
            error_events: gw.counter(&deadline_total("v1", "total", "error_event")),
            stamp: x.stamp(),
            requests_total: gw.counter(&requests_total("v1", "standard", "total")),
            crashed: gw.crashed(),
        };
        let want = TotalCut {
            event: match case.error_event {
                None => format!("data: {openai}\n\ndata: [DONE]\n\n"),
                Some(e) => format!("event: error\ndata: {e}\n\n"),
            },
            error_events: Some(1),
            stamp: Some(stamp("v1", "standard", "standard", false, "total", case.ttft_ms)),
            requests_total: Some(1),
            crashed: None,
        };
        assert_eq!(got, want, "{path}");
    }
}

#[test]
fn a_complete_response_is_never_cut_while_its_log_is_pending() {
    let gw = gateway(&deadlines());
    // The whole stream passed the guard by +1500; the stream ends (access log) only at +3000, as
    // with a client that reads slowly: no deadline applies any more.
    let mut x = request(&gw, STANDARD, "v1");
    x.sse_headers(0);
    x.role(0);
    x.token(100, "Hi");
    x.finish(1500, 1);
    x.at(3000);
    assert!(!x.stream.closed_by_plugin(), "a complete response is not reset");
    assert_eq!(x.downstream_body(), x.upstream);
    x.end();
    assert_eq!(x.stamp(), Some(stamp("v1", "standard", "standard", false, "ok", 100)));

    // A streamed request answered at once with a whole error body: nothing to cut at the TTFT
    // deadline either.
    let mut y = Req::new(STANDARD, "v1").send(&gw);
    y.response_headers(10, "400", "application/json");
    y.chunk(10, br#"{"error":{"message":"bad request","type":"invalid_request_error"}}"#, false, true);
    y.at(3000);
    assert!(!y.stream.closed_by_plugin());
    assert_eq!(y.downstream_body(), y.upstream);
    y.end();
    assert_eq!(y.stamp().unwrap()["outcome"], "ok", "a 4xx is not an error of the version");

    // A response that is only headers.
    let mut z = request(&gw, STANDARD, "v1");
    z.at(10);
    z.stream.response_headers(&[(":status", "503")], true).unwrap();
    z.at(3000);
    assert!(!z.stream.closed_by_plugin());
    assert_eq!(z.downstream_status().as_deref(), Some("503"));
    z.end();
    assert_eq!(z.stamp().unwrap()["outcome"], "error", "a 5xx is");
    // Every stream logged: the next tick returns to the slow one.
    gw.advance(ms(2)).unwrap();
    assert_eq!(gw.tick_period(), Some(ms(1000)));
    for kind in ["ttft", "total"] {
        for action in ["reply_504", "reset", "error_event"] {
            assert_eq!(gw.counter(&deadline_total("v1", kind, action)), None, "{kind} {action}");
        }
    }
    assert_no_crash(&gw);
}

/// What whole (non-streamed) answers of one API left behind: one at +1500 (past the TTFT deadline,
/// within the total one), one missing at the total deadline, and the same API streamed.
#[derive(Debug, PartialEq)]
struct WholeAnswers {
    /// The answer at +1500: held?, a reply?, byte-identical, its stamp.
    in_time: (bool, Option<u32>, bool, Option<Value>),
    /// The missing answer: a reply at +1999?, then the 504's status, `x-sluice-deadline`, body.
    missing_at_1999: Option<u32>,
    missing: (u32, Option<String>, Value),
    missing_stamp: Option<Value>,
    /// `deadline_total` for (total, reply_504) and (ttft, reply_504) before the streamed request.
    replies_504: (Option<u64>, Option<u64>),
    /// The streamed request: its status at +1000 and the TTFT 504s counted then.
    streamed: (Option<u32>, Option<u64>),
    crashed: Option<String>,
}

/// Every API: a whole answer has no TTFT deadline, only the total one (a 504 in its API's error
/// shape); the same API streamed has its TTFT deadline.
#[test]
fn whole_answers_have_no_ttft_deadline_only_the_total_one() {
    use common::llm::{completions, messages, responses};
    let message = "sluice latency-guard: the response of model version v1 did not arrive within the total deadline of 2000 ms";
    let openai = json!({"error": {"message": message, "type": "timeout", "code": "total_deadline_exceeded"}});
    let cases = [
        (chat::PATH, chat::request(false, false), chat::response(19, 9), chat::request(true, true), openai.clone()),
        (completions::PATH, completions::request(false), completions::response(), completions::request(true), openai.clone()),
        (responses::PATH, responses::request(false), responses::response(), responses::request(true), openai.clone()),
        (
            messages::PATH,
            messages::request(false),
            messages::response(),
            messages::request(true),
            json!({"type": "error", "error": {"type": "timeout_error", "message": message, "sluice_code": "total_deadline_exceeded"}}),
        ),
    ];
    let whole_stamp = |outcome: &str, status: u16| json!({"version": "v1", "class": "standard", "priority": "standard", "probe": false, "outcome": outcome, "status": status, "ttft_ms": null});
    for (path, whole, answer, streamed, error) in cases {
        let gw = gateway(&deadlines());
        let mut x = Req::new(STANDARD, "v1").api(path, whole.clone()).send(&gw);
        x.at(1499);
        x.response_headers(1500, "200", "application/json");
        let held = x.stream.response_paused();
        x.chunk(1500, answer.as_bytes(), false, true);
        let reply = x.local_reply().map(|r| r.status);
        x.end();
        let in_time = (held, reply, x.downstream_body() == x.upstream, x.stamp());

        let mut y = Req::new(STANDARD, "v1").api(path, whole).send(&gw);
        y.at(1999);
        let missing_at_1999 = y.local_reply().map(|r| r.status);
        y.at(2000);
        let reply = y.local_reply().unwrap_or_else(|| panic!("{path}: 504 at the total deadline"));
        y.end();
        let replies_504 = (gw.counter(&deadline_total("v1", "total", "reply_504")), gw.counter(&deadline_total("v1", "ttft", "reply_504")));

        let mut z = Req::new(STANDARD, "v1").api(path, streamed).send(&gw);
        z.at(1000);
        let streamed = (z.local_reply().map(|r| r.status), gw.counter(&deadline_total("v1", "ttft", "reply_504")));
        z.end();

        let got = WholeAnswers {
            in_time,
            missing_at_1999,
            missing: (reply.status, header(&reply, "x-sluice-deadline"), reply_json(&reply)),
            missing_stamp: y.stamp(),
            replies_504,
            streamed,
            crashed: gw.crashed(),
        };
        let want = WholeAnswers {
            in_time: (false, None, true, Some(whole_stamp("ok", 200))),
            missing_at_1999: None,
            missing: (504, Some("total".into()), error),
            missing_stamp: Some(whole_stamp("total", 504)),
            replies_504: (Some(1), None),
            streamed: (Some(504), Some(1)),
            crashed: None,
        };
        assert_eq!(got, want, "{path}");
    }
}

// ---------------------------------------------------------------------------------------------
// 5–7. The breaker
// ---------------------------------------------------------------------------------------------

#[test]
fn breaker_opens_only_once_it_has_min_samples() {
    let gw = gateway(&with_breaker(json!({})));
    for i in 0..4 {
        let s = stream_ok(&gw, STANDARD, "v1", 800);
        assert_eq!(s, stamp("v1", "standard", "standard", false, "ok", 800), "request {i}");
        assert_eq!(gw.gauge(&breaker_state("v1")), Some(0), "4 of 5 samples: closed");
    }
    assert_eq!(gw.counter(&transitions("v1", "open")), None);
    assert!(transition_logs(&gw, "v1").is_empty());

    // The fifth slow TTFT opens it at that request's first token, while it is still streaming.
    let mut x = request(&gw, STANDARD, "v1");
    x.sse_headers(0);
    x.role(0);
    x.at(799);
    assert_eq!(gw.gauge(&breaker_state("v1")), Some(0));
    x.token(800, "Hi");
    assert_eq!(gw.gauge(&breaker_state("v1")), Some(1), "open at the fifth first token");
    assert_eq!(gw.counter(&transitions("v1", "open")), Some(1));
    assert_eq!(
        transition_logs(&gw, "v1"),
        vec![format!(
            "sluice latency-guard: breaker of v1 closed → open: objective breached in the last 60 s \
             (4 finished requests, 5 TTFTs): ttft p95 {} > 500 ms",
            p95_text(800, 5)
        )]
    );
    x.finish(812, 1);
    x.end();
    assert_eq!(gw.counter(&transitions("v1", "open")), Some(1), "its end does not count its TTFT twice");
    assert_eq!(p95_text(800, 5), "800.0 ms");
    // The shared state says open too (format version 1, state code 1).
    let state = gw.shared_data("sluice/latency-guard/breaker/v1").expect("breaker state");
    assert_eq!((state.len(), state[0], state[1]), (18, 1, 1));
    assert_no_crash(&gw);
}

#[test]
fn a_client_that_goes_away_is_not_a_sample() {
    let gw = gateway(&with_breaker(json!({})));
    for _ in 0..4 {
        stream_ok(&gw, STANDARD, "v1", 800);
    }
    // The client leaves before the first token: no TTFT, no finished request, nothing about the
    // version.
    let mut x = request(&gw, STANDARD, "v1");
    x.sse_headers(0);
    x.role(0);
    x.at(900);
    x.stream.client_reset().unwrap();
    let stamp = x.stamp().unwrap();
    assert_eq!((stamp["outcome"].as_str(), stamp["ttft_ms"].is_null()), (Some("client_disconnect"), true));
    assert_eq!(gw.counter(&requests_total("v1", "standard", "client_disconnect")), Some(1));
    assert_eq!(gw.gauge(&breaker_state("v1")), Some(0), "still 4 samples");
    stream_ok(&gw, STANDARD, "v1", 800);
    assert_eq!(gw.gauge(&breaker_state("v1")), Some(1));
    assert!(transition_logs(&gw, "v1")[0].contains("(4 finished requests, 5 TTFTs)"), "{:?}", transition_logs(&gw, "v1"));
    assert_no_crash(&gw);
}

#[test]
fn fast_requests_keep_the_breaker_closed_however_many() {
    let gw = gateway(&with_breaker(json!({})));
    for _ in 0..12 {
        stream_ok(&gw, STANDARD, "v1", 450);
    }
    assert_eq!(gw.gauge(&breaker_state("v1")), Some(0));
    assert_eq!(gw.counter(&transitions("v1", "open")), None);
    assert_no_crash(&gw);
}

#[test]
fn while_open_critical_and_standard_fail_over_and_sheddable_gets_503() {
    let gw = gateway(&with_breaker(json!({})));
    let opened = open_breaker(&gw, 5);
    gw.advance(ms(1500)).unwrap();

    // Sheddable to v1: refused, retry-after the rest of the open time (8.5 s → 9).
    let mut x = request(&gw, SHEDDABLE, "v1");
    assert_eq!(x.avoid(), None, "sheddable traffic is refused, not failed over");
    let reply = x.local_reply().expect("503");
    assert_eq!(reply.status, 503);
    assert_eq!(header(&reply, "retry-after").as_deref(), Some("9"));
    assert_eq!(header(&reply, "content-type").as_deref(), Some("application/json"));
    assert_eq!(header(&reply, "x-sluice-refused-by").as_deref(), Some("latency-guard"));
    assert_eq!(
        reply_json(&reply),
        json!({"error": {
            "message": "model version v1 is failing its latency objective (circuit open); sheddable requests are refused until it recovers",
            "type": "overloaded",
            "code": "breaker_open"
        }})
    );
    assert_eq!(gw.counter(&shed_total("v1", "sheddable", "breaker_open")), Some(1));
    x.end();
    assert_eq!(
        x.stamp(),
        Some(json!({"version": "v1", "class": "batch", "priority": "sheddable",
        "probe": false, "outcome": "shed_breaker_open", "status": 503, "ttft_ms": null}))
    );

    // Critical and standard: the avoid list sends them to v2, where they pass.
    for (tenant, class, priority) in [(CRITICAL, "interactive", "critical"), (STANDARD, "standard", "standard")] {
        let req = Req::new(tenant, "v1").via_router("v1");
        let mut x = req.send(&gw);
        assert_eq!(x.avoid().as_deref(), Some("v1>v2"), "{tenant}");
        assert_eq!(x.version.as_deref(), Some("v2"));
        assert_eq!(x.local_reply(), None);
        x.end();
        // Ended before any response, Envoy naming no cause: the client went away, as every plugin
        // classifies it (`Outcome::classify`); no status.
        assert_eq!(
            x.stamp(),
            Some(json!({"version": "v2", "class": class, "priority": priority,
            "probe": false, "outcome": "client_disconnect", "status": 0, "ttft_ms": null}))
        );
        let s = stream_ok_req(&gw, &req, 100);
        assert_eq!(s, stamp("v2", class, priority, false, "ok", 100));
    }
    // Sheddable traffic to v2 is not affected.
    assert_eq!(stream_ok(&gw, SHEDDABLE, "v2", 100)["version"], "v2");

    // A critical request the router could not move: served on v1 all the same, and counted.
    let s = stream_ok(&gw, CRITICAL, "v1", 100);
    assert_eq!(s, stamp("v1", "interactive", "critical", false, "ok", 100));
    assert_eq!(gw.counter("sluice.latency.fallback_unavailable_total.version.v1.priority.critical"), Some(1));

    // Just before it may probe: retry-after rounds the last 100 ms up to 1 s.
    advance_to(&gw, opened + 9_900 * NS_PER_MS);
    let x = request(&gw, SHEDDABLE, "v1");
    let reply = x.local_reply().expect("503");
    assert_eq!(header(&reply, "retry-after").as_deref(), Some("1"));
    assert_eq!(gw.counter(&shed_total("v1", "sheddable", "breaker_open")), Some(2));
    assert_eq!(gw.counter(&shed_total("v1", "critical", "breaker_open")), None);
    assert_eq!(gw.counter(&shed_total("v1", "standard", "breaker_open")), None);
    assert_eq!(gw.gauge(&breaker_state("v1")), Some(1));
    assert_no_crash(&gw);
}

/// Request ids `prefix-0`, `prefix-1`, … (the guard picks probes by a hash of the request id).
fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// Half-open: `n_probes` critical probes of `ttft_ms` (with the non-probes in between failing over
/// to v2); checks each request's fate against the draw and returns the number of non-probes seen.
fn probe_round(gw: &Gateway, prefix: &str, n_probes: usize, ttft_ms: u64, after_each: impl Fn(usize)) -> usize {
    let (mut probes, mut others) = (0, 0);
    for id in ids(prefix, 200) {
        if probes == n_probes {
            break;
        }
        let req = Req::new(CRITICAL, "v1").via_router("v1").id(&id);
        let s = stream_ok_req(gw, &req, ttft_ms);
        if is_probe(&id, 50) {
            assert_eq!(s, stamp("v1", "interactive", "critical", true, "ok", ttft_ms), "{id} is a probe");
            probes += 1;
            after_each(probes);
        } else {
            assert_eq!(s, stamp("v2", "interactive", "critical", false, "ok", ttft_ms), "{id} is not a probe");
            others += 1;
        }
    }
    assert_eq!(probes, n_probes, "enough probes among the ids");
    others
}

/// Opens the breaker and waits for it to go half-open; checks the transition's time and log. With no
/// stream watched the guard ticks every 100 ms and sweeps open breakers at most every 100 ms, so the
/// breaker goes half-open within 200 ms after `open_for`, never before.
fn half_open(gw: &Gateway) {
    open_breaker(gw, 5);
    // It opened at the fifth request's first token: the time the shared state says.
    let opened = breaker_since(gw);
    advance_to(gw, opened + 10_000 * NS_PER_MS - NS_PER_MS);
    assert_eq!(gw.gauge(&breaker_state("v1")), Some(1), "still open just before open_for");
    assert_eq!(gw.counter(&transitions("v1", "half_open")), None);
    let mut at = opened + 10_000 * NS_PER_MS - NS_PER_MS;
    while gw.counter(&transitions("v1", "half_open")).is_none() {
        at += NS_PER_MS;
        assert!(at - opened <= 10_200 * NS_PER_MS, "not half-open 200 ms after open_for");
        advance_to(gw, at);
    }
    assert!(at - opened >= 10_000 * NS_PER_MS);
    assert_eq!(gw.gauge(&breaker_state("v1")), Some(2), "half-open at the first sweep after open_for");
    assert_eq!(gw.counter(&transitions("v1", "half_open")), Some(1));
    assert_eq!(
        transition_logs(gw, "v1").last().unwrap(),
        &format!(
            "sluice latency-guard: breaker of v1 open → half_open: open for {} ms; probing 50 % of traffic, \
             deciding after 4 samples; closing needs ttft p95 ≤ 450 ms",
            (at - opened) / NS_PER_MS
        )
    );
}

#[test]
fn a_request_that_finds_open_for_elapsed_makes_the_breaker_half_open_itself_not_the_next_sweep() {
    let gw = gateway(&with_breaker(json!({})));
    open_breaker(&gw, 5);
    let opened = breaker_since(&gw);
    // The first millisecond past open_for at which no sweep has yet moved it (sweeps run every
    // 100 ms, at a phase set by when the VM started ticking).
    let mut at = opened + 10_000 * NS_PER_MS;
    loop {
        advance_to(&gw, at);
        assert_eq!(gw.counter(&transitions("v1", "half_open")), None, "a sweep got there first at +{} ms", (at - opened) / NS_PER_MS);
        if gw.gauge(&breaker_state("v1")) == Some(1) {
            break;
        }
        at += NS_PER_MS;
    }
    let mut x = Req::new(CRITICAL, "v1").via_router("v1").id("finds-it-due").send(&gw);
    assert_eq!(
        gw.counter(&transitions("v1", "half_open")),
        Some(1),
        "half-open at the request's arrival: {:?}",
        gw.logs_at_least(LogLevel::Info).iter().rev().take(4).collect::<Vec<_>>()
    );
    assert!(
        transition_logs(&gw, "v1").last().unwrap().contains(&format!("open → half_open: open for {} ms", (at - opened) / NS_PER_MS)),
        "{:?}",
        transition_logs(&gw, "v1")
    );
    x.end();
    assert_no_crash(&gw);
}

#[test]
fn half_open_admits_probes_by_request_id_and_healthy_probes_close_it() {
    let gw = gateway(&with_breaker(json!({})));
    half_open(&gw);

    // A sheddable request that is not a probe: refused for a second.
    let id = ids("shed", 50).into_iter().find(|id| !is_probe(id, 50)).unwrap();
    let x = Req::new(SHEDDABLE, "v1").id(&id).send(&gw);
    let reply = x.local_reply().expect("503 while half-open");
    assert_eq!(header(&reply, "retry-after").as_deref(), Some("1"));

    let others = probe_round(&gw, "heal", 4, 100, |n| {
        let expected = if n < 4 { 2 } else { 0 };
        assert_eq!(gw.gauge(&breaker_state("v1")), Some(expected), "after {n} healthy probes");
    });
    assert!(others > 0, "some requests were not probes");
    assert_eq!(gw.counter("sluice.latency.probes_total.version.v1"), Some(4));
    assert_eq!(gw.counter(&transitions("v1", "closed")), Some(1));
    assert_eq!(
        transition_logs(&gw, "v1").last().unwrap(),
        &format!(
            "sluice latency-guard: breaker of v1 half_open → closed: probes healthy (3 finished requests, 4 TTFTs): \
             ttft p95 {} ≤ 450 ms (objective 500 ms − 10 %)",
            p95_text(100, 4)
        )
    );
    // Closed: everyone back on v1, no probes.
    let mut x = Req::new(CRITICAL, "v1").via_router("v1").id("after-close").send(&gw);
    assert_eq!((x.avoid(), x.version.as_deref()), (None, Some("v1")));
    x.end();
    assert_eq!(x.stamp().unwrap()["probe"], false);
    assert_eq!(stream_ok(&gw, SHEDDABLE, "v1", 100)["version"], "v1");
    assert_no_crash(&gw);
}

#[test]
fn slow_probes_reopen_the_breaker() {
    let gw = gateway(&with_breaker(json!({})));
    half_open(&gw);
    probe_round(&gw, "slow", 4, 800, |n| {
        let expected = if n < 4 { 2 } else { 1 };
        assert_eq!(gw.gauge(&breaker_state("v1")), Some(expected), "after {n} slow probes");
    });
    // Reopened when the last probe's sample was judged: the time the shared state says.
    let reopened = breaker_since(&gw);
    assert_eq!(gw.counter(&transitions("v1", "open")), Some(2));
    assert_eq!(gw.counter(&transitions("v1", "closed")), None);
    assert_eq!(
        transition_logs(&gw, "v1").last().unwrap(),
        &format!(
            "sluice latency-guard: breaker of v1 half_open → open: probes breached the objective (3 finished requests, 4 TTFTs): \
             ttft p95 {} > 500 ms",
            p95_text(800, 4)
        )
    );
    // Open again for the full open time.
    let x = request(&gw, SHEDDABLE, "v1");
    assert_eq!(header(&x.local_reply().expect("503"), "retry-after").as_deref(), Some("10"));
    let mut y = Req::new(CRITICAL, "v1").via_router("v1").id("heal-1").send(&gw);
    assert_eq!(y.avoid().as_deref(), Some("v1>v2"), "every request fails over again, probe draw or not");
    y.end();
    advance_to(&gw, reopened + 9_999 * NS_PER_MS);
    assert_eq!(gw.gauge(&breaker_state("v1")), Some(1));
    assert_eq!(gw.counter(&transitions("v1", "half_open")), Some(1));
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 8. No flapping
// ---------------------------------------------------------------------------------------------

/// Transition counts of v1: (to open, to half-open, to closed).
fn transition_counts(gw: &Gateway) -> (u64, u64, u64) {
    let c = |to| gw.counter(&transitions("v1", to)).unwrap_or(0);
    (c("open"), c("half_open"), c("closed"))
}

/// A 10 s window of 1 s slots, 5 samples to open, open 2 s, every half-open request a probe, 5
/// probes to decide.
fn flap_policy(hysteresis: u32) -> Value {
    with_breaker(json!({"window_s": 10, "slots": 10, "min_samples": 5, "open_for_ms": 2000,
                        "probe_percent": 100, "probes": 5, "hysteresis_percent": hysteresis}))
}

/// Critical requests through the router for `run_s` seconds of virtual time, one after the other,
/// v1's TTFT given by `latency(ms since the start of the run)` (v2 answers in 100 ms). Returns how
/// often the routing went back from v2 to v1.
fn run(gw: &Gateway, run_s: u64, latency: impl Fn(u64) -> u64) -> u64 {
    let t0 = gw.now_ns();
    let mut last = String::from("v1");
    let mut back_to_v1 = 0;
    let mut i = 0;
    while gw.now_ns() < t0 + run_s * 1000 * NS_PER_MS {
        let req = Req::new(CRITICAL, "v1").via_router("v1").id(&format!("flap-{i}"));
        i += 1;
        let mut x = req.send(gw);
        let version = x.version.clone().unwrap();
        let ttft = if version == "v1" { latency((gw.now_ns() - t0) / NS_PER_MS) } else { 100 };
        x.sse_headers(0);
        x.role(0);
        x.token(ttft, "Hi");
        x.token(ttft + 5, "!");
        x.finish(ttft + 10, 2);
        x.end();
        if version == "v1" && last == "v2" {
            back_to_v1 += 1;
        }
        last = version;
    }
    back_to_v1
}

#[test]
fn latency_inside_the_hysteresis_band_neither_closes_nor_reopens_the_breaker() {
    let gw = gateway(&flap_policy(10));
    open_breaker(&gw, 5);
    assert_eq!(transition_counts(&gw), (1, 0, 0));
    // Two minutes between 460 and 495 ms: under the 500 ms objective, over the 450 ms close limit.
    let back = run(&gw, 120, |t| if (t / 700).is_multiple_of(2) { 460 } else { 495 });
    assert_eq!(transition_counts(&gw), (1, 1, 0), "{:#?}", transition_logs(&gw, "v1"));
    assert_eq!(back, 1, "traffic went back to v1 once (as probes), and stayed");
    assert_eq!(gw.gauge(&breaker_state("v1")), Some(2));
    assert_no_crash(&gw);
}

#[test]
fn latency_oscillating_around_the_objective_never_closes_the_breaker_with_hysteresis() {
    // 520 ms and 480 ms alternating every 3 s, for two minutes: just over and just under 500 ms.
    let latency = |t: u64| if (t / 3000).is_multiple_of(2) { 520 } else { 480 };
    let gw = gateway(&flap_policy(10));
    run(&gw, 120, latency);
    // Open on every 520 ms phase, probing (half-open) on every 480 ms phase, never closed: the
    // traffic that is not probing stays on the fallback for the whole run.
    assert_eq!(transition_counts(&gw), (20, 20, 0), "{:#?}", transition_logs(&gw, "v1"));
    assert!(transition_logs(&gw, "v1").iter().all(|l| !l.contains("→ closed")));

    // The same traffic without hysteresis flaps: closed on most 480 ms phases, reopened on the
    // next 520 ms one (after the minimum closed dwell of open_for).
    let control = gateway(&flap_policy(0));
    run(&control, 120, latency);
    assert_eq!(transition_counts(&control), (20, 20, 13), "{:#?}", transition_logs(&control, "v1"));
    assert_no_crash(&gw);
    assert_no_crash(&control);
}

// ---------------------------------------------------------------------------------------------
// 9. Shedding by priority
// ---------------------------------------------------------------------------------------------

#[test]
fn in_flight_shedding_refuses_sheddable_first_then_standard_never_critical() {
    let gw = gateway(&policy(json!({"in_flight": {"limit": 4, "standard_extra_percent": 50}})));
    let count = |gw: &Gateway| {
        let raw = gw.shared_data("sluice/latency-guard/in-flight/v1").expect("counter");
        u64::from_le_bytes(raw[..8].try_into().unwrap())
    };
    assert_eq!(count(&gw), 0, "created at configure time");
    let mut open = Vec::new();
    let mut refused = Vec::new();
    let refusal_of = |x: &Exchange, n: u64, limit: u64, priority: &str| {
        assert_eq!(x.stamp().unwrap()["outcome"], "shed_in_flight");
        let reply = x.local_reply().unwrap_or_else(|| panic!("{priority} refused at {n}"));
        assert_eq!(reply.status, 503);
        assert_eq!(header(&reply, "retry-after").as_deref(), Some("1"));
        assert_eq!(
            reply_json(&reply),
            json!({"error": {
                "message": format!("model version v1 has {n} requests in flight (limit {limit} for {priority} requests); try again shortly"),
                "type": "overloaded",
                "code": "in_flight_limit"
            }})
        );
    };

    for i in 1..=4u64 {
        let x = Req::new(SHEDDABLE, "v1").id(&format!("s{i}")).send(&gw);
        assert_eq!(x.local_reply(), None, "sheddable {i} of 4");
        assert_eq!(gw.gauge(&in_flight("v1")), Some(i as i64));
        open.push(x);
    }
    let x = Req::new(SHEDDABLE, "v1").id("s5").send(&gw);
    refusal_of(&x, 4, 4, "sheddable");
    refused.push(x);
    assert_eq!(gw.counter(&shed_total("v1", "sheddable", "in_flight")), Some(1));
    assert_eq!(gw.gauge(&in_flight("v1")), Some(4));

    for i in 5..=6u64 {
        let x = Req::new(STANDARD, "v1").id(&format!("d{i}")).send(&gw);
        assert_eq!(x.local_reply(), None, "standard at {}", i - 1);
        assert_eq!(gw.gauge(&in_flight("v1")), Some(i as i64));
        open.push(x);
    }
    let x = Req::new(STANDARD, "v1").id("d7").send(&gw);
    refusal_of(&x, 6, 6, "standard");
    refused.push(x);
    assert_eq!(gw.counter(&shed_total("v1", "standard", "in_flight")), Some(1));

    for i in 7..=20u64 {
        let x = Req::new(CRITICAL, "v1").id(&format!("c{i}")).send(&gw);
        assert_eq!(x.local_reply(), None, "critical is never shed (at {})", i - 1);
        assert_eq!(gw.gauge(&in_flight("v1")), Some(i as i64));
        open.push(x);
    }
    assert_eq!(count(&gw), 20);
    assert_eq!(gw.counter(&shed_total("v1", "critical", "in_flight")), None);
    let x = Req::new(SHEDDABLE, "v1").id("s-late").send(&gw);
    refusal_of(&x, 20, 4, "sheddable");
    refused.push(x);
    assert_eq!(gw.counter(&shed_total("v1", "sheddable", "in_flight")), Some(2));

    // Refused requests were never counted: ending them changes nothing.
    for mut x in refused {
        x.end();
    }
    assert_eq!(count(&gw), 20);
    // Ending requests frees their slots.
    for expected in (3..20).rev() {
        let mut x = open.pop().unwrap();
        x.end();
        assert_eq!(gw.gauge(&in_flight("v1")), Some(expected));
    }
    assert_eq!(count(&gw), 3);
    let x = Req::new(SHEDDABLE, "v1").id("s-again").send(&gw);
    assert_eq!(x.local_reply(), None, "room again at 3 of 4");
    assert_eq!(gw.gauge(&in_flight("v1")), Some(4));
    // Another version has no limit.
    let y = Req::new(SHEDDABLE, "v2").id("s-v2").send(&gw);
    assert_eq!(y.local_reply(), None);
    assert_eq!(count(&gw), 4);
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 10. Configuration errors
// ---------------------------------------------------------------------------------------------

#[test]
fn broken_policies_are_refused_with_the_field_that_is_wrong() {
    let v1 = |v: Value| policy(v).to_string();
    let with_breaker = |b: Value| policy(json!({"breaker": breaker(b)})).to_string();
    let mut classes_bad = policy(json!({}));
    classes_bad["classes"][1]["priority"] = json!("urgent");
    let mut no_versions = policy(json!({}));
    no_versions["versions"] = json!([]);
    let mut duplicate = policy(json!({}));
    duplicate["versions"][1]["name"] = json!("v1");
    let mut no_source = policy(json!({}));
    no_source.as_object_mut().unwrap().remove("tenant");
    let mut bad_default = policy(json!({}));
    bad_default["default_class"] = json!("gold");
    let mut bad_header = policy(json!({}));
    bad_header["tenant"] = json!({"header": "x tenant"});
    let mut bad_name = policy(json!({}));
    bad_name["versions"][0]["name"] = json!("v 1");
    let mut two_sources = policy(json!({}));
    two_sources["tenant"] = json!({"header": "x-t", "property": ["a"]});

    let cases: Vec<(String, &str)> = vec![
        (
            v1(json!({"ttft_deadline": 1000})),
            "latency-guard policy is not valid JSON: versions[0].ttft_deadline: unknown field `ttft_deadline`, expected one of `name`, \
             `ttft_deadline_ms`, `total_deadline_ms`, `max_output_tokens`, `in_flight`, `breaker`",
        ),
        (
            classes_bad.to_string(),
            "latency-guard policy is not valid JSON: classes[1].priority: unknown variant `urgent`, expected one of `critical`, `standard`, `sheddable`",
        ),
        (v1(json!({"ttft_deadline_ms": 3000, "total_deadline_ms": 2000})), "versions[0].ttft_deadline_ms: must not exceed total_deadline_ms (3000 > 2000)"),
        (v1(json!({"ttft_deadline_ms": 0})), "versions[0].ttft_deadline_ms: must be 1–3600000, got 0"),
        (v1(json!({"in_flight": {"limit": 0}})), "versions[0].in_flight.limit: must be 1–1000000, got 0"),
        (with_breaker(json!({"fallback": "v9"})), "versions[0].breaker.fallback: \"v9\" is not a version of the policy"),
        (with_breaker(json!({"fallback": "v1"})), "versions[0].breaker.fallback: must name another version"),
        (with_breaker(json!({"objective": {"percentile": 100}})), "versions[0].breaker.objective.percentile: must be 1–99.9, got 100"),
        (with_breaker(json!({"objective": {"ttft_ms": null}})), "versions[0].breaker.objective: set at least one of ttft_ms, tpot_ms, error_per_mille"),
        (with_breaker(json!({"window_s": 10, "slots": 7})), "versions[0].breaker.slots: must divide the window into whole milliseconds (10000 ms / 7)"),
        (with_breaker(json!({"open_for_ms": 50})), "versions[0].breaker.open_for_ms: must be 100–86400000, got 50"),
        (with_breaker(json!({"hysteresis_percent": 95})), "versions[0].breaker.hysteresis_percent: must be 0–90, got 95"),
        (with_breaker(json!({"probe_percent": 0})), "versions[0].breaker.probe_percent: must be 1–100, got 0"),
        (
            with_breaker(json!({"fallback": null, "while_open": {"critical": "fallback"}})),
            "versions[0].breaker.while_open.critical: `fallback` needs versions[0].breaker.fallback",
        ),
        (no_versions.to_string(), "versions: list at least one model version"),
        (duplicate.to_string(), "versions[1].name: \"v1\" is already defined at versions[0]"),
        (bad_name.to_string(), "versions[0].name: must be 1–64 letters, digits, '-', '_' or '.', got \"v 1\""),
        (no_source.to_string(), "classes[0].tenants: set `tenant` to say where the tenant comes from"),
        (bad_default.to_string(), "default_class: \"gold\" is not a class of the policy"),
        (bad_header.to_string(), "tenant.header: must be an HTTP header name (1–128 token characters), got \"x tenant\""),
        (two_sources.to_string(), "tenant: set exactly one of header, property"),
        ("{\"versions\": [".to_string(), "latency-guard policy is not valid JSON"),
        (String::new(), "latency-guard policy is not valid JSON"),
    ];
    // Every case is checked before failing, so one run lists every wrong message.
    let mut failed = Vec::new();
    for (policy, expected) in cases {
        let error = match Gateway::start(&plugin(), common::latency::spec(policy.as_str())) {
            Ok(_) => "accepted".to_string(),
            Err(e) => format!("{e:#}"),
        };
        // A policy that is not JSON makes sluice.wasm's whole configuration not JSON.
        let wanted = match !policy.trim().is_empty() && serde_json::from_str::<serde_json::Value>(&policy).is_err() {
            true => common::not_json_refusal(&format!("sluice latency-guard: configuration refused: {expected}")),
            false => format!("sluice latency-guard: configuration refused: {expected}"),
        };
        if !error.contains(&wanted) {
            failed.push(format!("policy {policy}\n  expected: {expected}\n  got: {error}"));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    // The base policies themselves are fine.
    gateway(&policy(json!({"breaker": breaker(json!({}))})));
    gateway(&deadlines());
}

// ---------------------------------------------------------------------------------------------
// 11. Malformed input
// ---------------------------------------------------------------------------------------------

#[test]
fn garbage_sse_passes_through_untouched() {
    let gw = gateway(&policy(json!({"ttft_deadline_ms": 30_000, "total_deadline_ms": 60_000, "breaker": breaker(json!({}))})));
    let mut x = Req::new(STANDARD, "v1").without_llm_metrics().send(&gw);
    x.sse_headers(0);
    let long_line = vec![b'x'; 70_000];
    let garbage: Vec<&[u8]> = vec![
        b"\xff\xfe\x00\x01 not utf-8 \xc3\x28\n\n",
        b"data: {\"choices\": [{\"delta\": {\"content\": \"unterminated\n\n",
        b"data: [DONE]\n\ndata: after done\n\n",
        b"event: \x80\x81\r\ndata:\r\n\r\n",
        b"data: {\"choices\": 42, \"usage\": {\"completion_tokens\": -1}}\n\n",
        b"data: {\"choices\": [{\"delta\": {\"content\": 7}}]}\n\n",
        &long_line,
        b"\n\n:::\n\n\n",
    ];
    for (i, g) in garbage.iter().enumerate() {
        x.chunk(10 * (i as u64 + 1), g, false, false);
        assert_no_crash(&gw);
    }
    x.chunk(100, b"", false, true);
    assert_eq!(x.downstream_body(), x.upstream, "passed byte for byte");
    assert!(!x.stopped());
    x.end();
    assert_eq!(x.stamp().unwrap()["outcome"], "ok");
    assert_no_crash(&gw);
}

#[test]
fn non_utf8_and_blank_tenants_are_classified_without_crashing() {
    let gw = gateway(&deadlines());
    for (tenant, class) in [(&b"\xff\xfe\x80"[..], "other"), (&b"crit-\xff"[..], "interactive"), (&b"   "[..], "other"), (&b""[..], "other")] {
        let req = Req::new(STANDARD, "v1").raw_tenant(Some(tenant));
        let s = stream_ok_req(&gw, &req, 100);
        assert_eq!(s["class"], class, "tenant {tenant:?}");
    }
    let s = stream_ok_req(&gw, &Req::new(STANDARD, "v1").raw_tenant(None), 100);
    assert_eq!(s["class"], "other");
    assert_eq!(s["priority"], "sheddable");
    assert_no_crash(&gw);
}

#[test]
fn malformed_route_and_missing_metadata_leave_the_request_alone() {
    let gw = gateway(&deadlines());
    // No version known: not guarded at all (no hold, no deadline, no stamp).
    for route in [
        Route::Raw(b"{\"version\":".to_vec()),
        Route::Raw(b"\xff\xfe{".to_vec()),
        Route::Raw(br#"{"version": 42}"#.to_vec()),
        Route::Raw(br#"["v1"]"#.to_vec()),
        Route::Version("v9".into()),
        Route::Nothing,
    ] {
        let mut x = Req::new(STANDARD, "v1").route(route.clone()).send(&gw);
        assert_eq!(x.local_reply(), None, "{route:?}");
        x.sse_headers(0);
        assert!(!x.stream.response_paused(), "not held: {route:?}");
        x.role(0);
        x.at(5000);
        x.token(5000, "Hi");
        x.finish(5010, 1);
        assert!(!x.stopped(), "no deadline applies: {route:?}");
        assert_eq!(x.downstream_body(), x.upstream);
        x.end();
        assert_eq!(x.stamp(), None, "{route:?}");
        assert_no_crash(&gw);
    }
    // Without a usable router decision the guard reads the model json_to_metadata lifted.
    for route in [Route::Raw(b"{\"version\":".to_vec()), Route::Nothing] {
        let mut x = Req::new(STANDARD, "v1").route(route).metadata("v1").send(&gw);
        x.sse_headers(0);
        assert!(x.stream.response_paused(), "metadata v1: guarded");
        x.at(1000);
        assert_eq!(x.local_reply().map(|r| r.status), Some(504));
        x.end();
    }
    // A router decision wins over the metadata.
    let s = stream_ok_req(&gw, &Req::new(STANDARD, "v2").metadata("v1"), 100);
    assert_eq!(s["version"], "v2");
    // Metadata naming no version of the policy: not guarded.
    let mut x = Req::new(STANDARD, "v1").route(Route::Nothing).metadata("").send(&gw);
    x.sse_headers(0);
    assert!(!x.stream.response_paused());
    x.end();
    assert_eq!(x.stamp(), None);
    assert_eq!(gw.counter(&requests_total("v1", "standard", "ttft")), Some(2));
    assert_no_crash(&gw);
}

#[test]
fn garbage_first_token_signal_and_odd_responses_do_not_crash() {
    let gw = gateway(&deadlines());
    // A first-token value that is not a time: the guard keeps holding, and answers 504 in time.
    let mut x = request(&gw, STANDARD, "v1");
    x.sse_headers(0);
    for (t, v) in [(100, "soon"), (200, "-5"), (300, "18446744073709551616"), (400, "0x10"), (500, "")] {
        x.at(t);
        x.stream.set_property(&[FIRST_TOKEN], v);
    }
    x.at(999);
    assert!(x.stream.response_paused());
    x.at(1000);
    assert_eq!(x.local_reply().map(|r| r.status), Some(504));
    x.end();

    // Odd response headers: no status, a non-numeric status, a 500 without content type.
    for (status, ct) in [("", ""), ("abc", "text/event-stream"), ("500", "")] {
        let mut x = request(&gw, STANDARD, "v1");
        x.response_headers(10, status, ct);
        x.chunk(20, b"\x00\x01garbage", false, true);
        x.at(30);
        assert_eq!(x.local_reply(), None, "{status:?} {ct:?}");
        assert_eq!(x.downstream_body(), x.upstream);
        x.end();
        assert_no_crash(&gw);
    }
    // Paths the guard does not know, and a client gone before anything came back.
    let mut s = gw.stream();
    s.request_headers(&[(":method", "GET"), (":path", "/healthz")], true).unwrap();
    s.response_headers(&[(":status", "200")], true).unwrap();
    s.end().unwrap();
    let mut x = request(&gw, STANDARD, "v1");
    x.stream.client_reset().unwrap();
    assert_eq!(x.stamp().unwrap()["outcome"], "client_disconnect");
    assert_no_crash(&gw);
}
