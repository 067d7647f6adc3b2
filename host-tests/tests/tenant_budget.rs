//! tenant-budget, the built `.wasm`, in the harness with a virtual clock: admission against every
//! budget of a key's hierarchy, reservation then settlement in the shared-data ledger, calendar
//! windows at their boundaries, clamping, disconnect charging, `include_usage` injection, refusals
//! and policy validation — each stated with exact figures read back from the ledger counters, the
//! access-log stamp, metrics, and what reached the upstream and the client.
//!
//! Build the plugin first: `cargo build --release --target wasm32-wasip1 -p sluice-tenant-budget`.

mod common;

use common::budget::*;
use common::llm::{chat, messages, Call, Delivery};
use serde_json::{json, Value};
use sluice_host::{Action, Gateway};

fn assert_no_crash(gw: &Gateway) {
    assert_eq!(gw.crashed(), None, "the plugin must never trap");
}

/// Minute / month window ids of an instant (seconds since the epoch), as the ledger numbers them.
fn minute_id(unix_s: u64) -> u64 {
    unix_s / 60
}
/// Month index `year * 12 + month - 1` of 2026-03 and 2026-04.
const MARCH_2026: u64 = 2026 * 12 + 2;
const APRIL_2026: u64 = 2026 * 12 + 3;

/// Plays a complete non-streamed chat answer reporting `prompt` / `completion` tokens at `+ms`.
fn answer(c: &mut Call<'_>, ms: u64, prompt: u64, completion: u64) {
    c.response_headers(ms, "200", "application/json");
    c.body_bytes(ms, chat::response(prompt, completion).as_bytes(), true);
}

/// The chat chunk `v` without its `usage` member: what a server that was not asked for usage sends.
fn without_usage(mut v: Value) -> Value {
    if let Some(o) = v.as_object_mut() {
        o.remove("usage");
    }
    v
}

/// The standard streamed chat answer ([`chat::timeline`]) as a server sends it when the request
/// did not ask for `include_usage`: no usage member anywhere, no usage chunk.
fn plain_chat_stream() -> Vec<u8> {
    let mut out = String::new();
    out += &chat::event(without_usage(chat::chunk_value(json!({"role": "assistant", "content": "", "refusal": null}), None)));
    for p in chat::PIECES {
        out += &chat::event(without_usage(chat::chunk_value(json!({"content": p}), None)));
    }
    out += &chat::event(without_usage(chat::chunk_value(json!({}), Some("stop"))));
    out += chat::DONE;
    out.into_bytes()
}

// ---------------------------------------------------------------------------------------------
// 1. Calendar windows at their boundaries
// ---------------------------------------------------------------------------------------------

#[test]
fn a_request_straddling_the_minute_boundary_is_charged_to_the_window_it_was_admitted_in() {
    let p = policy(json!([]), json!([]), json!([{"window": "minute", "tokens": 100_000}]));
    let gw = gateway(&p);
    let old = minute_id(MAR31_235950);
    let body = chat_body(false, false, Some(500));
    let b = body.len() as u64;
    let mut c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    let admitted = counter(&gw, "key", "search-prod", 0);
    assert_eq!((admitted.window_id, admitted.used, admitted.reserved()), (old, 0, b + 500), "admitted 10 s before the minute ends: reserved in that minute");

    // The answer ends 20 s later, 10 s into the next minute.
    answer(&mut c, 20_000, 19, 9);
    c.end();
    let s = stamp(&c.stream);
    assert_eq!((s["charged_tokens"].clone(), s["outcome"].clone()), (json!(28), json!("completed")));
    let now = counter_in_window(&gw, "key", "search-prod", 0, old + 1);
    assert_eq!(
        (now.window_id, now.used, now.reserved()),
        (old + 1, 0, 0),
        "the new minute starts at 0: neither the old reservation nor the late charge is carried in"
    );
    assert_eq!(gw.gauge(&remaining("key", "search-prod", "minute", "total_tokens")), Some(100_000));

    // A request in the new minute is charged exactly its own usage.
    let mut d = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (0, b + 500));
    assert_eq!(counter(&gw, "key", "search-prod", 0).window_id, old + 1);
    answer(&mut d, 100, 10, 5);
    d.end();
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (15, 0));
    assert_eq!(gw.gauge(&remaining("key", "search-prod", "minute", "total_tokens")), Some(100_000 - 15));
    assert_no_crash(&gw);
}

#[test]
fn retry_after_is_the_number_of_seconds_until_the_refusing_minute_ends() {
    let p = policy(json!([]), json!([]), json!([{"window": "minute", "tokens": 2_000}]));
    let gw = gateway(&p);
    let body = chat_body(false, false, Some(1_000));
    let b = body.len() as u64;
    assert!(2 * (b + 1_000) > 2_000 && b + 1_000 <= 2_000);
    // The first request holds its worst case; the second does not fit next to it.
    let first = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    assert_eq!(first.stream.local_reply(), None);
    let second = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    let reply = second.stream.local_reply().expect("refused");
    assert_eq!(reply.status, 429);
    assert_eq!(reply.headers.get("retry-after"), Some("10"));
    assert_eq!(
        reply_json(&second.stream),
        json!({"error": {
            "message": format!("budget key:search-prod:minute:total_tokens exceeded: 0 used and {} reserved of 2000; resets in 10 s", b + 1_000),
            "type": "budget_exceeded",
            "code": "key:search-prod:minute:total_tokens"
        }})
    );
    assert!(second.stream.upstream_request_body().is_empty(), "a refused request never reaches the model");

    // 3.5 s later: 6.5 s remain, rounded up.
    gw.advance(std::time::Duration::from_millis(3_500)).unwrap();
    let third = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    let reply = third.stream.local_reply().expect("refused");
    assert_eq!((reply.status, reply.headers.get("retry-after")), (429, Some("7")));
    assert_eq!(gw.counter(&rejections("search-prod", "key:search-prod:minute:total_tokens")), Some(2));

    // Once the minute is over, the same request fits again.
    gw.advance(std::time::Duration::from_millis(6_500)).unwrap();
    let fourth = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    assert_eq!(fourth.stream.local_reply(), None);
    assert_eq!(fourth.stream.upstream_request_body(), body.as_bytes());
    assert_no_crash(&gw);
}

#[test]
fn retry_after_of_a_month_budget_runs_to_its_reset_day() {
    // Month windows resetting on the 15th: at 2026-03-31T23:59:50Z the window ends 2026-04-15.
    let p = policy(json!([]), json!([{"window": "month", "reset_day": 15, "tokens": 1_000}]), json!([]));
    let gw = gateway(&p);
    let c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &chat_body(false, false, Some(1_000)));
    let reply = c.stream.local_reply().expect("refused");
    assert_eq!(reply.status, 429);
    assert_eq!(reply.headers.get("retry-after"), Some("1209610"), "14 days and 10 s");
    assert_eq!(reply_json(&c.stream)["error"]["code"], "team:search:month:total_tokens");

    // A calendar month (reset day 1) ends with the day: 10 s.
    let p = policy(json!([{"window": "month", "tokens": 1_000}]), json!([]), json!([]));
    let gw = gateway(&p);
    let c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &chat_body(false, false, Some(1_000)));
    let reply = c.stream.local_reply().expect("refused");
    assert_eq!((reply.status, reply.headers.get("retry-after")), (429, Some("10")));
    assert_eq!(reply_json(&c.stream)["error"]["code"], "org:acme:month:total_tokens");
}

/// Org: month from the 15th; key: calendar month. The same straddling request is charged to the
/// org's window (not over) and not to the key's (over) — and the other way round two weeks later.
#[test]
fn month_windows_reset_on_their_reset_day_for_a_request_straddling_the_boundary() {
    let p = policy(json!([{"window": "month", "reset_day": 15, "tokens": 1_000_000}]), json!([]), json!([{"window": "month", "tokens": 1_000_000}]));
    let body = chat_body(false, false, Some(500));
    let b = body.len() as u64;

    // 2026-03-31T23:59:50Z → settles 2026-04-01T00:00:10Z.
    let gw = gateway_at(&p, MAR31_235950);
    let mut c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    assert_eq!(counter(&gw, "org", "acme", 0).window_id, MARCH_2026, "Mar 15 – Apr 15");
    assert_eq!(counter(&gw, "key", "search-prod", 0).window_id, MARCH_2026, "March");
    answer(&mut c, 20_000, 19, 9);
    c.end();
    let org = counter(&gw, "org", "acme", 0);
    assert_eq!((org.window_id, org.used, org.reserved()), (MARCH_2026, 28, 0), "same org window: charged");
    let key = counter_in_window(&gw, "key", "search-prod", 0, APRIL_2026);
    assert_eq!((key.used, key.reserved()), (0, 0), "April starts at 0 for the calendar-month key budget");
    assert_eq!(gw.gauge(&remaining("org", "acme", "month", "total_tokens")), Some(1_000_000 - 28));
    assert_eq!(gw.gauge(&remaining("key", "search-prod", "month", "total_tokens")), Some(1_000_000));

    // 2026-04-14T23:59:50Z → settles 2026-04-15T00:00:10Z.
    let gw = gateway_at(&p, APR14_235950);
    let mut c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    assert_eq!(used_reserved(&gw, "org", "acme", 0), (0, b + 500));
    assert_eq!(counter(&gw, "org", "acme", 0).window_id, MARCH_2026, "Apr 14 is in the Mar 15 – Apr 15 window");
    answer(&mut c, 20_000, 19, 9);
    c.end();
    let org = counter_in_window(&gw, "org", "acme", 0, APRIL_2026);
    assert_eq!((org.used, org.reserved()), (0, 0), "the org window reset on the 15th");
    let key = counter(&gw, "key", "search-prod", 0);
    assert_eq!((key.window_id, key.used, key.reserved()), (APRIL_2026, 28, 0), "the key's April continues");
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 2. The hierarchy: every level must fit
// ---------------------------------------------------------------------------------------------

#[test]
fn an_exhausted_team_budget_refuses_a_key_whose_own_budget_has_room() {
    let p = policy(
        json!([{"window": "month", "tokens": 1_000_000}]),
        json!([{"window": "minute", "tokens": 1_000}]),
        json!([{"window": "minute", "tokens": 100_000}]),
    );
    let gw = gateway(&p);
    // search-dev spends 600 of the team's 1000.
    let mut dev = Call::start(&gw, &key_headers(chat::PATH, "search-dev"), &chat_body(false, false, Some(500)));
    answer(&mut dev, 50, 100, 500);
    dev.end();
    assert_eq!(used_reserved(&gw, "team", "search", 0), (600, 0));

    let body = chat_body(false, false, Some(300));
    let b = body.len() as u64;
    assert!(600 + b + 300 > 1_000 && b + 300 <= 100_000);
    let prod = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    let reply = prod.stream.local_reply().expect("refused by the team");
    assert_eq!(reply.status, 429);
    assert_eq!(reply.headers.get("retry-after"), Some("10"));
    assert_eq!(
        reply_json(&prod.stream),
        json!({"error": {
            "message": "budget team:search:minute:total_tokens exceeded: 600 used and 0 reserved of 1000; resets in 10 s",
            "type": "budget_exceeded",
            "code": "team:search:minute:total_tokens"
        }})
    );
    assert!(prod.stream.upstream_request_body().is_empty());
    // The org lease taken before the team refused was given back; the key's was never taken.
    assert_eq!(used_reserved(&gw, "org", "acme", 0), (600, 0));
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (0, 0));
    let s = stamp(&prod.stream);
    assert_eq!(
        s,
        json!({"key": "search-prod", "team": "search", "org": "acme", "decision": "rejected",
               "reject_code": "team:search:minute:total_tokens", "status": 429, "outcome": "refused"})
    );
    assert_eq!(gw.counter(&rejections("search-prod", "team:search:minute:total_tokens")), Some(1));
    assert_no_crash(&gw);
}

#[test]
fn the_org_money_budget_applies_to_every_key_and_refunds_to_the_actual_cost() {
    // $0.01 a month = 10 000 µUSD.
    let p = policy(json!([{"window": "month", "usd": 0.01}]), json!([]), json!([]));
    let gw = gateway(&p);
    let body = chat_body(false, false, Some(500));
    let b = body.len() as u64;
    let worst = gpt4o_cost(b, 500);
    assert!(worst <= 10_000 && 2 * worst > 10_000);
    let mut first = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    assert_eq!(stamp(&first.stream)["reserved_micro_usd"], json!(worst));
    assert_eq!(used_reserved(&gw, "org", "acme", 0), (0, worst));

    let second = Call::start(&gw, &key_headers(chat::PATH, "search-dev"), &body);
    let reply = second.stream.local_reply().expect("refused by the org's money");
    assert_eq!((reply.status, reply.headers.get("retry-after")), (429, Some("10")));
    assert_eq!(
        reply_json(&second.stream)["error"]["message"],
        format!("budget org:acme:month:micro_usd exceeded: 0 used and {worst} reserved of 10000; resets in 10 s")
    );
    assert_eq!(gw.counter(&rejections("search-dev", "org:acme:month:micro_usd")), Some(1));

    // 19 × 2.5 + 9 × 10 = 137.5 → 138 µUSD charged; the rest of the reservation comes back.
    answer(&mut first, 100, 19, 9);
    first.end();
    assert_eq!(used_reserved(&gw, "org", "acme", 0), (138, 0));
    assert_eq!(stamp(&first.stream)["charged_micro_usd"], json!(138));
    assert_eq!(gw.gauge(&remaining("org", "acme", "month", "micro_usd")), Some(10_000 - 138));
    let third = Call::start(&gw, &key_headers(chat::PATH, "search-dev"), &body);
    assert_eq!(third.stream.local_reply(), None, "fits again after the refund");
    assert_eq!(used_reserved(&gw, "org", "acme", 0), (138, worst));
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 3. Reservation, then settlement to the actual usage
// ---------------------------------------------------------------------------------------------

#[test]
fn strict_admission_reserves_body_bytes_plus_output_limit_and_settlement_keeps_only_the_usage() {
    let p =
        policy(json!([{"window": "month", "usd": 100}]), json!([{"window": "hour", "tokens": 1_000_000}]), json!([{"window": "minute", "tokens": 100_000}]));
    let gw = gateway(&p);
    let body = chat_body(false, false, Some(500));
    let b = body.len() as u64;
    let worst_usd = gpt4o_cost(b, 500);
    let mut c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    assert_eq!(c.stream.upstream_request_body(), body.as_bytes(), "limit already what was granted: body untouched");
    assert_eq!(
        stamp(&c.stream),
        json!({"key": "search-prod", "team": "search", "org": "acme", "decision": "admitted",
               "reserved_input_tokens": b, "reserved_output_tokens": 500, "reserved_tokens": b + 500,
               "reserved_micro_usd": worst_usd})
    );
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (0, b + 500));
    assert_eq!(used_reserved(&gw, "team", "search", 0), (0, b + 500));
    assert_eq!(used_reserved(&gw, "org", "acme", 0), (0, worst_usd));
    assert_eq!(gw.gauge(&remaining("key", "search-prod", "minute", "total_tokens")), Some(100_000 - (b as i64) - 500));
    assert_eq!(gw.gauge(&remaining("org", "acme", "month", "micro_usd")), Some(100_000_000 - worst_usd as i64));

    answer(&mut c, 640, 19, 9);
    c.end();
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (28, 0));
    assert_eq!(used_reserved(&gw, "team", "search", 0), (28, 0));
    assert_eq!(used_reserved(&gw, "org", "acme", 0), (138, 0));
    assert_eq!(gw.gauge(&remaining("key", "search-prod", "minute", "total_tokens")), Some(100_000 - 28));
    assert_eq!(gw.gauge(&remaining("team", "search", "hour", "total_tokens")), Some(1_000_000 - 28));
    assert_eq!(gw.gauge(&remaining("org", "acme", "month", "micro_usd")), Some(100_000_000 - 138));
    assert_eq!(gw.counter(&charged_tokens("search-prod", "gpt-4o")), Some(28));
    assert_eq!(gw.counter("sluice.budget.charged_micro_usd_total.key.search-prod.team.search.org.acme.model_version.gpt-4o"), Some(138));
    assert_eq!(gw.histogram("sluice.budget.overestimate_tokens.key.search-prod"), Some(vec![b + 500 - 28]));
    let s = stamp(&c.stream);
    for (field, value) in [
        ("input_tokens", json!(19)),
        ("output_tokens", json!(9)),
        ("charged_tokens", json!(28)),
        ("charged_micro_usd", json!(138)),
        ("usage", json!("reported")),
        ("outcome", json!("completed")),
        ("reserved_tokens", json!(b + 500)),
    ] {
        assert_eq!(s[field], value, "stamp field {field}");
    }
    assert_no_crash(&gw);
}

#[test]
fn without_an_output_limit_the_default_is_reserved_and_written_into_the_request() {
    let p = with(&policy(json!([]), json!([]), json!([{"window": "minute", "tokens": 100_000}])), json!({"default_max_output_tokens": 1000}));
    let gw = gateway(&p);
    let body = chat::request(false, false);
    let b = body.len() as u64;
    let c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (0, b + 1000));
    let mut expected: Value = serde_json::from_str(&body).unwrap();
    expected["max_tokens"] = json!(1000);
    let sent: Value = serde_json::from_slice(&c.stream.upstream_request_body()).unwrap();
    assert_eq!(sent, expected);
    let headers = c.stream.upstream_request_headers().expect("headers went upstream");
    assert!(!headers.contains("content-length"), "the body changed length");
    assert_no_crash(&gw);
}

#[test]
fn estimate_mode_reserves_the_prompt_estimate_plus_the_margin() {
    let p = with(&policy(json!([]), json!([]), json!([{"window": "minute", "tokens": 100_000}])), json!({"mode": "estimate", "estimate_margin_percent": 10}));
    let gw = gateway(&p);
    let c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &chat_body(false, false, Some(500)));
    // ⌈17 × 1.1⌉ = 19
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (0, 19 + 500));
    assert_eq!(stamp(&c.stream)["reserved_input_tokens"], json!(19));
    assert_no_crash(&gw);
}

#[test]
fn a_non_2xx_answer_charges_no_tokens_but_keeps_the_request_on_requests_budgets() {
    let p = policy(json!([]), json!([{"window": "minute", "requests": 10}]), json!([{"window": "minute", "tokens": 100_000}]));
    let gw = gateway(&p);
    let mut c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &chat_body(false, false, Some(500)));
    assert_eq!(used_reserved(&gw, "team", "search", 0), (0, 1));
    c.response_headers(80, "429", "application/json");
    c.body_bytes(80, br#"{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}"#, true);
    c.end();
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (0, 0));
    assert_eq!(used_reserved(&gw, "team", "search", 0), (1, 0));
    let s = stamp(&c.stream);
    assert_eq!((s["charged_tokens"].clone(), s["charged_micro_usd"].clone()), (json!(0), json!(0)));
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 4. Clamping the output limit
// ---------------------------------------------------------------------------------------------

fn clamp_policy(limit: u64) -> Value {
    with(&policy(json!([]), json!([]), json!([{"window": "minute", "tokens": limit}])), json!({"clamp": {"enabled": true, "min_output_tokens": 64}}))
}

#[test]
fn a_request_that_does_not_fit_is_clamped_to_what_the_budget_can_pay() {
    let body = chat_body(false, false, Some(2_000));
    let b = body.len() as u64;
    let gw = gateway(&clamp_policy(1_000));
    let granted = 1_000 - b;
    let mut c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    assert_eq!(c.stream.local_reply(), None);
    let mut expected: Value = serde_json::from_str(&body).unwrap();
    expected["max_tokens"] = json!(granted);
    let sent = c.stream.upstream_request_body();
    assert_eq!(serde_json::from_slice::<Value>(&sent).unwrap(), expected);
    assert_eq!(sent, body.replace(r#""max_tokens":2000"#, &format!(r#""max_tokens":{granted}"#)).into_bytes(), "only the limit changed, in place");
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (0, 1_000), "exactly the whole budget");
    let s = stamp(&c.stream);
    assert_eq!((s["decision"].clone(), s["reserved_output_tokens"].clone()), (json!("clamped"), json!(granted)));
    assert_eq!(gw.counter("sluice.budget.clamps_total.key.search-prod"), Some(1));
    answer(&mut c, 300, 19, 9);
    assert_eq!(response_header(&c.stream, "x-sluice-clamped-max-tokens"), Some(granted.to_string()));
    c.end();
    assert_no_crash(&gw);
}

#[test]
fn clamping_stops_at_min_output_tokens() {
    let body = chat_body(false, false, Some(2_000));
    let b = body.len() as u64;
    // Exactly min_output_tokens left after the prompt: admitted with 64.
    let gw = gateway(&clamp_policy(b + 64));
    let c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    assert_eq!(c.stream.local_reply(), None);
    assert_eq!(stamp(&c.stream)["reserved_output_tokens"], json!(64));
    // One token less: refused.
    let gw = gateway(&clamp_policy(b + 63));
    let c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    let reply = c.stream.local_reply().expect("refused below min_output_tokens");
    assert_eq!(reply.status, 429);
    assert_eq!(reply_json(&c.stream)["error"]["code"], "key:search-prod:minute:total_tokens");
    assert_eq!(gw.counter("sluice.budget.clamps_total.key.search-prod"), None);
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (0, 0));
    assert!(c.stream.upstream_request_body().is_empty());
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 5. Interrupted streams are charged what was produced, once
// ---------------------------------------------------------------------------------------------

/// A streamed chat request (no include_usage of its own), answered with the role chunk and the first
/// `n` content chunks (each ≤ 4 characters: one token each).
fn partial_stream<'g>(gw: &'g Gateway, n: usize) -> Call<'g> {
    let mut c = Call::start(gw, &key_headers(chat::PATH, "search-prod"), &chat::request(true, false));
    c.sse_headers(120);
    let mut t = vec![(120, chat::role())];
    for (i, p) in chat::PIECES.iter().take(n).enumerate() {
        assert!(p.len() <= 4);
        t.push((180 + 25 * i as u64, chat::content(p)));
    }
    c.body(&t, Delivery::PerEntry, false);
    c
}

fn stream_policy() -> Value {
    policy(json!([]), json!([]), json!([{"window": "minute", "tokens": 100_000}]))
}

#[test]
fn a_client_disconnect_charges_the_content_seen_and_the_prompt_estimate() {
    let gw = gateway(&stream_policy());
    let mut c = partial_stream(&gw, 3);
    c.at(300);
    c.stream.client_reset().unwrap();
    let s = stamp(&c.stream);
    assert_eq!(
        (s["input_tokens"].clone(), s["output_tokens"].clone(), s["charged_tokens"].clone(), s["usage"].clone(), s["outcome"].clone()),
        (json!(chat::REQUEST_ESTIMATE), json!(3), json!(chat::REQUEST_ESTIMATE + 3), json!("estimated"), json!("client_disconnect"))
    );
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (chat::REQUEST_ESTIMATE + 3, 0));
    assert_eq!(gw.counter(&charged_tokens("search-prod", "gpt-4o")), Some(chat::REQUEST_ESTIMATE + 3));
    assert_no_crash(&gw);
}

#[test]
fn an_upstream_reset_after_headers_charges_the_content_seen_as_an_upstream_error() {
    let gw = gateway(&stream_policy());
    let mut c = partial_stream(&gw, 5);
    c.at(400);
    c.stream.upstream_reset().unwrap();
    let s = stamp(&c.stream);
    assert_eq!(
        (s["input_tokens"].clone(), s["output_tokens"].clone(), s["usage"].clone(), s["outcome"].clone()),
        (json!(chat::REQUEST_ESTIMATE), json!(5), json!("estimated"), json!("upstream_error"))
    );
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (chat::REQUEST_ESTIMATE + 5, 0));
    assert_no_crash(&gw);
}

#[test]
fn a_disconnect_before_any_answer_charges_nothing_and_frees_the_reservation() {
    let gw = gateway(&stream_policy());
    let mut c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &chat::request(true, false));
    assert_ne!(used_reserved(&gw, "key", "search-prod", 0).1, 0);
    c.at(5_000);
    c.stream.client_reset().unwrap();
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (0, 0));
    let s = stamp(&c.stream);
    assert_eq!((s["charged_tokens"].clone(), s["outcome"].clone()), (json!(0), json!("client_disconnect")));
    assert_no_crash(&gw);
}

#[test]
fn a_settled_request_is_never_settled_again() {
    let gw = gateway(&stream_policy());
    let mut c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &chat::request(true, false));
    c.sse_headers(120);
    c.body(&chat::timeline(true), Delivery::PerEntry, true);
    let settled_stamp = stamp(&c.stream);
    let settled_counter = counter(&gw, "key", "search-prod", 0);
    assert_eq!((settled_counter.used, settled_counter.reserved()), (28, 0));
    // The client goes away after the last byte, before the stream is torn down.
    c.at(2_000);
    c.stream.client_reset().unwrap();
    assert_eq!(stamp(&c.stream), settled_stamp, "stamp unchanged");
    assert_eq!(counter(&gw, "key", "search-prod", 0), settled_counter, "ledger unchanged");
    assert_eq!(gw.counter(&charged_tokens("search-prod", "gpt-4o")), Some(28));
    assert_eq!(gw.histogram("sluice.budget.overestimate_tokens.key.search-prod").map(|h| h.len()), Some(1));
    assert_eq!(settled_stamp["outcome"], json!("completed"));
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 6. include_usage: asked upstream, hidden from the client
// ---------------------------------------------------------------------------------------------

fn include_usage_is_injected_and_hidden(delivery: Delivery) {
    let gw = gateway(&stream_policy());
    let body = chat::request(true, false);
    let mut c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    let sent = c.stream.upstream_request_body();
    let mut expected: Value = serde_json::from_str(&body).unwrap();
    expected["stream_options"] = json!({"include_usage": true});
    expected["max_tokens"] = json!(4096);
    assert_eq!(serde_json::from_slice::<Value>(&sent).unwrap(), expected);
    let text = String::from_utf8(sent).unwrap();
    assert!(text.starts_with(&body[..body.len() - 1]), "the client's bytes are kept: {text}");
    assert!(text.contains(r#""stream_options":{"include_usage":true}"#), "{text}");

    c.sse_headers(120);
    c.body(&chat::timeline(true), delivery, true);
    let got = c.downstream_body();
    assert_eq!(String::from_utf8_lossy(&got), String::from_utf8_lossy(&plain_chat_stream()), "the client sees the stream it asked for");
    assert!(!String::from_utf8_lossy(&got).contains("usage"));
    assert_eq!(response_header(&c.stream, "content-length"), None);
    c.end();
    let s = stamp(&c.stream);
    assert_eq!(
        (s["input_tokens"].clone(), s["output_tokens"].clone(), s["usage"].clone()),
        (json!(19), json!(9), json!("reported")),
        "charged the usage chunk's numbers"
    );
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (28, 0));
    assert_no_crash(&gw);
}

#[test]
fn include_usage_is_injected_upstream_and_the_client_gets_the_plain_stream() {
    include_usage_is_injected_and_hidden(Delivery::PerEntry);
}

#[test]
fn include_usage_hiding_holds_when_the_stream_arrives_byte_by_byte() {
    include_usage_is_injected_and_hidden(Delivery::ByteByByte);
}

#[test]
fn a_client_that_asked_for_usage_gets_it_untouched() {
    let gw = gateway(&stream_policy());
    let body = chat::request(true, true);
    let mut c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    let mut expected: Value = serde_json::from_str(&body).unwrap();
    expected["max_tokens"] = json!(4096);
    assert_eq!(serde_json::from_slice::<Value>(&c.stream.upstream_request_body()).unwrap(), expected);
    c.sse_headers(120);
    c.body(&chat::timeline(true), Delivery::PerEntry, true);
    c.end();
    assert_eq!(c.downstream_body(), c.upstream_body);
    assert_eq!(stamp(&c.stream)["usage"], json!("reported"));
    assert_no_crash(&gw);
}

#[test]
fn with_include_usage_off_nothing_is_injected_and_the_charge_is_estimated() {
    let gw = gateway(&with(&stream_policy(), json!({"include_usage": false})));
    let body = chat::request(true, false);
    let mut c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    let mut expected: Value = serde_json::from_str(&body).unwrap();
    expected["max_tokens"] = json!(4096);
    let sent = c.stream.upstream_request_body();
    assert_eq!(serde_json::from_slice::<Value>(&sent).unwrap(), expected);
    assert!(!String::from_utf8_lossy(&sent).contains("stream_options"));
    c.sse_headers(120);
    c.body(&chat::timeline(false), Delivery::PerEntry, true);
    c.end();
    assert_eq!(c.downstream_body(), c.upstream_body, "nothing stripped");
    let s = stamp(&c.stream);
    assert_eq!(
        (s["input_tokens"].clone(), s["output_tokens"].clone(), s["usage"].clone()),
        (json!(chat::REQUEST_ESTIMATE), json!(chat::ESTIMATED_TOKENS), json!("estimated"))
    );
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (chat::REQUEST_ESTIMATE + chat::ESTIMATED_TOKENS, 0));
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 7. Stream cut-off is refused, not silently ignored
// ---------------------------------------------------------------------------------------------

#[test]
fn cut_off_streams_is_refused_at_load() {
    let err = load_error(&with(&stream_policy(), json!({"cut_off_streams": true})));
    assert!(err.contains("tenant-budget policy refused: cut_off_streams: not supported yet"), "{err}");
    // false (the default) loads.
    gateway(&with(&stream_policy(), json!({"cut_off_streams": false})));
}

// ---------------------------------------------------------------------------------------------
// 8. Bodies that cannot be sized are refused before the model sees them
// ---------------------------------------------------------------------------------------------

/// Checks a refusal: status, error code, never upstream, counted, no trap.
fn assert_refused(gw: &Gateway, c: &Call<'_>, status: u32, code: &str, key: &str) {
    let reply = c.stream.local_reply().unwrap_or_else(|| panic!("expected a {status} {code}"));
    assert_eq!(reply.status, status, "{}", String::from_utf8_lossy(&reply.body));
    assert_eq!(reply_json(&c.stream)["error"]["code"], json!(code));
    assert!(c.stream.upstream_request_body().is_empty(), "never upstream");
    assert_eq!(gw.counter(&rejections(key, code)), Some(1));
    assert_eq!(stamp(&c.stream)["reject_code"], json!(code));
    assert_no_crash(gw);
}

#[test]
fn a_body_without_a_model_under_a_money_budget_is_refused_as_unpriced() {
    let gw = gateway(&policy(json!([{"window": "month", "usd": 100}]), json!([]), json!([])));
    let c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), r#"{"messages":[{"role":"user","content":"Hello!"}],"max_tokens":100}"#);
    assert_refused(&gw, &c, 400, "unpriced_model", "search-prod");
    assert_eq!(reply_json(&c.stream)["error"]["type"], "invalid_request_error");
    assert_eq!(used_reserved(&gw, "org", "acme", 0), (0, 0));
}

#[test]
fn a_body_that_is_not_json_is_refused_as_malformed() {
    let gw = gateway(&stream_policy());
    let c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), "model=gpt-4o&prompt=hi");
    assert_refused(&gw, &c, 400, "malformed_body", "search-prod");
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (0, 0));
}

#[test]
fn a_compressed_body_is_refused_with_415() {
    let gw = gateway(&stream_policy());
    let mut h = key_headers(chat::PATH, "search-prod");
    h.push(("content-encoding", "gzip"));
    let c = Call::start(&gw, &h, "\u{1f}\u{8b}not really gzip");
    assert_refused(&gw, &c, 415, "encoded_body", "search-prod");
}

#[test]
fn a_request_without_a_body_is_refused() {
    let gw = gateway(&stream_policy());
    let mut s = gw.stream();
    s.request_headers(&key_headers(chat::PATH, "search-prod"), true).unwrap();
    let reply = s.local_reply().expect("refused");
    assert_eq!(reply.status, 400);
    assert_eq!(reply_json(&s)["error"]["code"], "no_body");
    assert_no_crash(&gw);
}

#[test]
fn a_20_mb_body_fed_in_1_mib_chunks_is_refused_with_413() {
    let gw = gateway(&stream_policy());
    let mut s = gw.stream();
    assert_eq!(s.request_headers(&key_headers(chat::PATH, "search-prod"), false).unwrap(), Action::Continue);
    let chunk = vec![b' '; 1 << 20];
    for i in 0..20 {
        s.request_body(&chunk, i == 19).unwrap();
    }
    let reply = s.local_reply().expect("refused");
    assert_eq!(reply.status, 413);
    assert_eq!(reply_json(&s)["error"]["code"], "body_too_large");
    assert!(s.upstream_request_body().is_empty());
    assert_eq!(gw.counter(&rejections("search-prod", "body_too_large")), Some(1));
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (0, 0));
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 9. Who is calling
// ---------------------------------------------------------------------------------------------

#[test]
fn an_unknown_key_is_refused_with_401_unknown_key() {
    let gw = gateway(&stream_policy());
    let c = Call::start(&gw, &key_headers(chat::PATH, "nobody"), &chat_body(false, false, Some(10)));
    let reply = c.stream.local_reply().expect("refused");
    assert_eq!(reply.status, 401);
    let body = reply_json(&c.stream);
    assert_eq!(body["error"]["code"], "unknown_key");
    assert_eq!(body["error"]["type"], "authentication_error");
    assert!(body["error"]["message"].is_string());
    assert_eq!(c.stream.upstream_request_headers(), None, "refused before anything went upstream");
    assert!(c.stream.upstream_request_body().is_empty());
    assert_eq!(gw.counter(&rejections("unknown", "unknown_key")), Some(1));
    // No key header at all: the same.
    let c = Call::start(&gw, &common::llm::headers(chat::PATH, &[]), &chat_body(false, false, Some(10)));
    assert_eq!(c.stream.local_reply().map(|r| r.status), Some(401));
    assert_no_crash(&gw);
}

#[test]
fn an_unknown_key_can_be_charged_to_a_default_key() {
    let p = json!({
        "identity": {"header": "x-sluice-key"},
        "unknown": {"action": "default", "key": "guest"},
        "orgs": [{"id": "acme", "teams": [{"id": "search", "keys": [
            {"id": "search-prod", "budgets": [{"window": "minute", "tokens": 100_000}]},
            {"id": "guest", "budgets": [{"window": "minute", "tokens": 5_000}]}
        ]}]}]
    });
    let gw = gateway(&p);
    let body = chat_body(false, false, Some(100));
    let b = body.len() as u64;
    let mut c = Call::start(&gw, &key_headers(chat::PATH, "nobody"), &body);
    assert_eq!(c.stream.local_reply(), None);
    assert_eq!(used_reserved(&gw, "key", "guest", 0), (0, b + 100));
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (0, 0));
    answer(&mut c, 100, 19, 9);
    c.end();
    assert_eq!(used_reserved(&gw, "key", "guest", 0), (28, 0));
    assert_eq!(stamp(&c.stream)["key"], "guest");
    assert_eq!(gw.counter(&charged_tokens("guest", "gpt-4o")), Some(28));
    assert_no_crash(&gw);
}

fn identity_policy(identity: Value) -> Value {
    json!({
        "identity": identity,
        "orgs": [{"id": "acme", "teams": [{"id": "search", "keys": [
            {"id": "search-prod", "api_key_sha256": API_KEY_SHA256,
             "budgets": [{"window": "minute", "tokens": 100_000}]},
            {"id": "search-dev", "api_key_sha256": ANTHROPIC_KEY_SHA256,
             "budgets": [{"window": "minute", "tokens": 100_000}]}
        ]}]}]
    })
}

#[test]
fn api_keys_are_looked_up_by_their_sha256() {
    let gw = gateway(&identity_policy(json!({"api_key": true})));
    let bearer = format!("Bearer {API_KEY}");
    let c = Call::start(&gw, &common::llm::headers(chat::PATH, &[("authorization", &bearer)]), &chat_body(false, false, Some(10)));
    assert_eq!(stamp(&c.stream)["key"], "search-prod");
    assert_ne!(used_reserved(&gw, "key", "search-prod", 0).1, 0);
    // Anthropic's x-api-key.
    let c = Call::start(&gw, &common::llm::headers(messages::PATH, &[("x-api-key", ANTHROPIC_KEY)]), &messages::request(false));
    assert_eq!(stamp(&c.stream)["key"], "search-dev");
    // The hash itself is not a key, nor is an unlisted key.
    let hash_as_key = format!("Bearer {API_KEY_SHA256}");
    for auth in [hash_as_key.as_str(), "Bearer sk-live-other"] {
        let c = Call::start(&gw, &common::llm::headers(chat::PATH, &[("authorization", auth)]), &chat_body(false, false, Some(10)));
        assert_eq!(c.stream.local_reply().map(|r| r.status), Some(401), "{auth}");
    }
    assert_no_crash(&gw);
}

#[test]
fn a_jwt_payload_claim_names_the_key() {
    let gw = gateway(&identity_policy(json!({"jwt": {"header": "x-jwt-payload", "claim": "sluice_key"}})));
    let c = Call::start(&gw, &common::llm::headers(chat::PATH, &[("x-jwt-payload", JWT_PAYLOAD_SEARCH_DEV)]), &chat_body(false, false, Some(10)));
    assert_eq!(c.stream.local_reply(), None);
    assert_eq!(stamp(&c.stream)["key"], "search-dev");
    assert_ne!(used_reserved(&gw, "key", "search-dev", 0).1, 0);
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 10. A wrong policy is refused at load, with the field named
// ---------------------------------------------------------------------------------------------

#[test]
fn wrong_policies_are_refused_with_the_field_and_the_problem() {
    let base = stream_policy();
    let org_with = |budgets: Value| policy(budgets, json!([]), json!([]));
    let cases: Vec<(Value, &str)> = vec![
        (
            policy(json!([]), json!([]), json!([{"window": "month", "reset_day": 31, "tokens": 1}])),
            "orgs[0].teams[0].keys[0].budgets[0].reset_day: must be 1–28 (a day every month has), got 31",
        ),
        (org_with(json!([{"window": "minute", "reset_day": 2, "tokens": 1}])), "orgs[0].budgets[0].reset_day: only month windows have a reset day"),
        (
            policy(json!([]), json!([{"window": "hour", "tokens": 1, "usd": 1}]), json!([])),
            "orgs[0].teams[0].budgets[0]: set exactly one of tokens, requests, usd",
        ),
        (org_with(json!([{"window": "day", "tokens": 10, "soft_limit_percent": 0}])), "orgs[0].budgets[0].soft_limit_percent: must be 1–100, got 0"),
        (org_with(json!([{"window": "day", "usd": -5}])), "orgs[0].budgets[0].usd: must be a finite amount 0–1000000000, got -5"),
        (org_with(json!([{"window": "day", "tokens": 10, "input_weight": 0, "output_weight": 0}])), "orgs[0].budgets[0]: weights must not both be 0"),
        (org_with(json!([{"window": "day", "requests": 10, "count": "output"}])), "orgs[0].budgets[0]: count and weights apply to tokens budgets only"),
        (
            json!({"identity": {"header": "x-sluice-key"}, "orgs": [{"id": "acme", "teams": [{"id": "search",
                "keys": [{"id": "k1"}, {"id": "k1"}]}]}]}),
            r#"orgs[0].teams[0].keys[1].id: key "k1" is defined twice"#,
        ),
        (
            json!({"identity": {"header": "x-sluice-key"}, "orgs": [{"id": "acme", "teams": [{"id": "search team",
                "keys": [{"id": "k1"}]}]}]}),
            r#"orgs[0].teams[0].id: must be 1–64 letters, digits, '-' or '_', got "search team""#,
        ),
        (
            json!({"identity": {"api_key": true}, "orgs": [{"id": "acme", "teams": [{"id": "search",
                "keys": [{"id": "k1", "api_key_sha256": "sk-live-7f3a9c"}]}]}]}),
            "orgs[0].teams[0].keys[0].api_key_sha256: must be 64 hex digits (the SHA-256 of the key)",
        ),
        (with(&base, json!({"identity": {}})), "identity: name at least one source: api_key, header or jwt"),
        (with(&base, json!({"unknown": {"action": "default", "key": "ghost"}})), r#"unknown.key: "ghost" is not a key of the policy"#),
        (with(&base, json!({"reservation_ttl_minutes": 0})), "reservation_ttl_minutes: must be 1–60, got 0"),
        (with(&base, json!({"default_max_output_tokens": 0})), "default_max_output_tokens: must be at least 1"),
        (with(&base, json!({"filter_state_key": "a b"})), r#"filter_state_key: must be letters, digits, '_' or '.', got "a b""#),
        (with(&base, json!({"orgs": []})), "orgs: must list at least one org"),
        (with(&base, json!({"budget": 1})), "tenant-budget policy is not valid JSON: budget: unknown field `budget`"),
    ];
    for (policy, message) in cases {
        let err = load_error(&policy);
        assert!(err.contains(&format!("tenant-budget policy refused: {message}")), "policy {policy}\nexpected: {message}\ngot: {err}");
    }
}

// ---------------------------------------------------------------------------------------------
// 11. Rate-limit headers on the response
// ---------------------------------------------------------------------------------------------

#[test]
fn responses_carry_rate_headers_for_the_tightest_window_of_each_unit() {
    let p = policy(
        json!([{"window": "month", "usd": 50}]),
        json!([{"window": "hour", "requests": 100}, {"window": "day", "tokens": 5_000}]),
        json!([{"window": "minute", "tokens": 10_000}, {"window": "day", "tokens": 1_000_000}]),
    );
    // 2026-03-31T12:00:30Z: the minute ends in 30 s, the hour in 3570 s, the day and month in 43170 s.
    let gw = gateway_at(&p, MAR31_120030);
    let body = chat_body(false, false, Some(500));
    let b = body.len() as u64;
    let mut first = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    let mut second = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    answer(&mut first, 200, 19, 9);
    answer(&mut second, 200, 19, 9);
    let expect = |c: &Call<'_>, tokens_remaining: u64, requests_remaining: u64, usd_remaining: u64| {
        let got: Vec<(&str, Option<String>)> = [
            "x-ratelimit-limit-tokens",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
            "x-ratelimit-limit-requests",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
            "x-ratelimit-limit-micro-usd",
            "x-ratelimit-remaining-micro-usd",
            "x-ratelimit-reset-micro-usd",
        ]
        .into_iter()
        .map(|h| (h, response_header(&c.stream, h)))
        .collect();
        let want: Vec<(&str, Option<String>)> = vec![
            // Least room left among the tokens budgets: the team's day (5000), not the key's minute.
            ("x-ratelimit-limit-tokens", Some("5000".into())),
            ("x-ratelimit-remaining-tokens", Some(tokens_remaining.to_string())),
            ("x-ratelimit-reset-tokens", Some("43170s".into())),
            ("x-ratelimit-limit-requests", Some("100".into())),
            ("x-ratelimit-remaining-requests", Some(requests_remaining.to_string())),
            ("x-ratelimit-reset-requests", Some("3570s".into())),
            ("x-ratelimit-limit-micro-usd", Some("50000000".into())),
            ("x-ratelimit-remaining-micro-usd", Some(usd_remaining.to_string())),
            ("x-ratelimit-reset-micro-usd", Some("43170s".into())),
        ];
        assert_eq!(got, want);
    };
    let worst_usd = gpt4o_cost(b, 500);
    expect(&first, 5_000 - (b + 500), 99, 50_000_000 - worst_usd);
    expect(&second, 5_000 - 2 * (b + 500), 98, 50_000_000 - 2 * worst_usd);
    first.end();
    second.end();
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 12. Every API: reservation, settlement, refusals, a deadline before the first token
// ---------------------------------------------------------------------------------------------

/// A policy with a minute tokens budget on the key and a month money budget on the org, and a
/// price for the legacy completions model too (1.5 in / 2 out USD per million tokens).
fn every_api_policy() -> Value {
    let mut p = policy(json!([{"window": "month", "usd": 100}]), json!([]), json!([{"window": "minute", "tokens": 100_000}]));
    p["prices"].as_array_mut().expect("prices").push(json!({"model": "gpt-3.5-turbo-instruct", "input_usd_per_mtok": 1.5, "output_usd_per_mtok": 2}));
    p
}

/// Micro-USD of `input` / `output` tokens at `input_usd` / `output_usd` per million, rounded up
/// (the prices are exact in micro-USD per token × 10⁶).
fn cost(input: u64, output: u64, input_usd_x10: u64, output_usd_x10: u64) -> u64 {
    (input * input_usd_x10 * 100_000 + output * output_usd_x10 * 100_000).div_ceil(1_000_000)
}

/// `s` as SSE events, each `data:` JSON without its `usage` member and without the events whose
/// only news is usage (`choices: []`): what a client that did not ask for usage gets.
fn without_usage_events(events: &[(u64, String)]) -> String {
    let mut out = String::new();
    for (_, e) in events {
        match e.strip_prefix("data: ").and_then(|d| d.strip_suffix("\n\n")).and_then(|d| serde_json::from_str::<Value>(d).ok()) {
            Some(v) if v["choices"] == json!([]) => {}
            Some(v) => out += &format!("data: {}\n\n", without_usage(v)),
            None => out += e,
        }
    }
    out
}

/// What one admitted request left behind, at admission and once settled.
#[derive(Debug, PartialEq)]
struct Settlement {
    /// The body that went upstream.
    sent: Value,
    /// `(used, reserved)` of the key's minute tokens and the org's month money, at admission.
    admitted: [(u64, u64); 2],
    /// What the client received.
    client_body: String,
    stamp: Value,
    /// The same counters once settled.
    settled: [(u64, u64); 2],
    charged_tokens_total: Option<u64>,
    charged_micro_usd_total: Option<u64>,
    overestimate_tokens: Option<Vec<u64>>,
    remaining_tokens: Option<i64>,
    remaining_micro_usd: Option<i64>,
    crashed: Option<String>,
}

struct UsageCase {
    name: &'static str,
    path: &'static str,
    body: String,
    /// The body sent upstream, as JSON.
    sent: Value,
    content_type: &'static str,
    answer: Vec<(u64, String)>,
    /// What the client gets (`None`: the upstream's bytes).
    client_body: Option<String>,
    /// The `model_version` label of the charge metrics (the body's model).
    model_label: &'static str,
    reserved_output: u64,
    /// Worst-case and actual money (µUSD), reported input and output tokens.
    worst_usd: u64,
    input: u64,
    output: u64,
    charged_usd: u64,
}

impl UsageCase {
    fn expected(&self) -> Settlement {
        let b = self.body.len() as u64;
        let reserved = b + self.reserved_output;
        let charged = self.input + self.output;
        assert!(reserved > charged, "{}: the reservation covers the usage", self.name);
        let answer: String = self.answer.iter().map(|(_, s)| s.as_str()).collect();
        Settlement {
            sent: self.sent.clone(),
            admitted: [(0, reserved), (0, self.worst_usd)],
            client_body: self.client_body.clone().unwrap_or(answer),
            stamp: json!({"key": "search-prod", "team": "search", "org": "acme", "decision": "admitted",
                "reserved_input_tokens": b, "reserved_output_tokens": self.reserved_output, "reserved_tokens": reserved,
                "reserved_micro_usd": self.worst_usd, "input_tokens": self.input, "output_tokens": self.output,
                "charged_tokens": charged, "charged_micro_usd": self.charged_usd, "usage": "reported",
                "status": 200, "outcome": "completed"}),
            settled: [(charged, 0), (self.charged_usd, 0)],
            charged_tokens_total: Some(charged),
            charged_micro_usd_total: Some(self.charged_usd),
            overestimate_tokens: Some(vec![reserved - charged]),
            remaining_tokens: Some(100_000 - charged as i64),
            remaining_micro_usd: Some(100_000_000 - self.charged_usd as i64),
            crashed: None,
        }
    }

    fn play(&self) -> Settlement {
        let gw = gateway(&every_api_policy());
        let mut c = Call::start(&gw, &key_headers(self.path, "search-prod"), &self.body);
        assert_eq!(c.stream.local_reply(), None, "{}: admitted", self.name);
        let sent = serde_json::from_slice(&c.stream.upstream_request_body()).unwrap_or(Value::Null);
        let ledger = |gw: &Gateway| [used_reserved(gw, "key", "search-prod", 0), used_reserved(gw, "org", "acme", 0)];
        let admitted = ledger(&gw);
        c.response_headers(self.answer[0].0, "200", self.content_type);
        c.body(&self.answer, Delivery::PerEntry, true);
        c.end();
        let metric = |m: &str| gw.counter(&format!("sluice.budget.{m}.key.search-prod.team.search.org.acme.model_version.{}", self.model_label));
        Settlement {
            sent,
            admitted,
            client_body: String::from_utf8_lossy(&c.downstream_body()).into_owned(),
            stamp: stamp(&c.stream),
            settled: ledger(&gw),
            charged_tokens_total: metric("charged_tokens_total"),
            charged_micro_usd_total: metric("charged_micro_usd_total"),
            overestimate_tokens: gw.histogram("sluice.budget.overestimate_tokens.key.search-prod"),
            remaining_tokens: gw.gauge(&remaining("key", "search-prod", "minute", "total_tokens")),
            remaining_micro_usd: gw.gauge(&remaining("org", "acme", "month", "micro_usd")),
            crashed: gw.crashed(),
        }
    }
}

/// `body` (JSON) with the members of `changes` added or replaced, as sent upstream.
fn body_with(body: &str, changes: Value) -> Value {
    with(&serde_json::from_str(body).expect("JSON body"), changes)
}

fn usage_cases() -> Vec<UsageCase> {
    use common::llm::{completions, responses};
    let sse = "text/event-stream; charset=utf-8";
    let whole = "application/json";
    let gpt4o = |i, o| cost(i, o, 25, 100);
    let claude = |i, o| cost(i, o, 30, 150);
    let instruct = |i, o| cost(i, o, 15, 20);

    let chat_stream = chat::request(true, false);
    let chat_whole = chat_body(false, false, Some(500));
    // A streamed completions request that did not ask for usage.
    let cmpl_stream = json!({"model": completions::MODEL, "prompt": "Say this is a test", "max_tokens": 7, "temperature": 0, "stream": true}).to_string();
    let mut cmpl_events: Vec<(u64, String)> =
        ["This", " is", " indeed", " a", " test"].iter().enumerate().map(|(i, p)| (90 + 20 * i as u64, completions::text(p, None))).collect();
    cmpl_events.push((175, completions::text("", Some("length"))));
    cmpl_events.push((176, completions::usage(5, 5)));
    cmpl_events.push((177, chat::DONE.to_string()));
    let cmpl_whole = completions::request(false);
    let resp_stream = responses::request(true);
    let resp_whole = responses::request(false);
    let msg_stream = messages::request(true);
    let msg_whole = messages::request(false);
    let len = |s: &String| s.len() as u64;
    vec![
        UsageCase {
            name: "chat, streamed: include_usage asked upstream, hidden from the client",
            path: chat::PATH,
            sent: body_with(&chat_stream, json!({"stream_options": {"include_usage": true}, "max_tokens": 4096})),
            content_type: sse,
            answer: chat::timeline(true),
            client_body: Some(String::from_utf8(plain_chat_stream()).expect("UTF-8")),
            model_label: "gpt-4o",
            reserved_output: 4096,
            worst_usd: gpt4o(len(&chat_stream), 4096),
            input: 19,
            output: 9,
            charged_usd: 138, // 19 × 2.5 + 9 × 10 = 137.5
            body: chat_stream,
        },
        UsageCase {
            name: "chat, whole",
            path: chat::PATH,
            sent: serde_json::from_str(&chat_whole).expect("JSON"),
            content_type: whole,
            answer: vec![(640, chat::response(19, 9))],
            client_body: None,
            model_label: "gpt-4o",
            reserved_output: 500,
            worst_usd: gpt4o(len(&chat_whole), 500),
            input: 19,
            output: 9,
            charged_usd: 138,
            body: chat_whole,
        },
        UsageCase {
            name: "completions, streamed: include_usage asked upstream, hidden from the client",
            path: completions::PATH,
            sent: body_with(&cmpl_stream, json!({"stream_options": {"include_usage": true}})),
            content_type: sse,
            client_body: Some(without_usage_events(&cmpl_events)),
            answer: cmpl_events,
            model_label: "gpt-3_5-turbo-instruct",
            reserved_output: 7,
            worst_usd: instruct(len(&cmpl_stream), 7),
            input: 5,
            output: 5,
            charged_usd: 18, // 5 × 1.5 + 5 × 2 = 17.5
            body: cmpl_stream,
        },
        UsageCase {
            name: "completions, whole",
            path: completions::PATH,
            sent: serde_json::from_str(&cmpl_whole).expect("JSON"),
            content_type: whole,
            answer: vec![(500, completions::response())],
            client_body: None,
            model_label: "gpt-3_5-turbo-instruct",
            reserved_output: 7,
            worst_usd: instruct(len(&cmpl_whole), 7),
            input: 5,
            output: 7,
            charged_usd: 22, // 5 × 1.5 + 7 × 2 = 21.5
            body: cmpl_whole,
        },
        UsageCase {
            name: "responses, streamed: usage in response.completed",
            path: responses::PATH,
            sent: body_with(&resp_stream, json!({"max_output_tokens": 4096})),
            content_type: sse,
            answer: responses::timeline(),
            client_body: None,
            model_label: "gpt-4o",
            reserved_output: 4096,
            worst_usd: gpt4o(len(&resp_stream), 4096),
            input: 1500,
            output: 6,
            // No cached price for gpt-4o here: the 1024 cached tokens at the input price.
            charged_usd: 3810, // 1500 × 2.5 + 6 × 10
            body: resp_stream,
        },
        UsageCase {
            name: "responses, whole",
            path: responses::PATH,
            sent: body_with(&resp_whole, json!({"max_output_tokens": 4096})),
            content_type: whole,
            answer: vec![(900, responses::response())],
            client_body: None,
            model_label: "gpt-4o",
            reserved_output: 4096,
            worst_usd: gpt4o(len(&resp_whole), 4096),
            input: 1500,
            output: 6,
            charged_usd: 3810,
            body: resp_whole,
        },
        UsageCase {
            name: "messages, streamed: passed untouched, max_tokens 1024 already fits",
            path: messages::PATH,
            sent: serde_json::from_str(&msg_stream).expect("JSON"),
            content_type: sse,
            answer: messages::timeline(),
            client_body: None,
            model_label: "claude-sonnet-4-5",
            reserved_output: 1024,
            worst_usd: claude(len(&msg_stream), 1024),
            input: 1025, // 25 + 1000 cache reads
            output: 15,
            charged_usd: 600, // 25 × 3 + 1000 × 0.3 + 15 × 15
            body: msg_stream,
        },
        UsageCase {
            name: "messages, whole",
            path: messages::PATH,
            sent: serde_json::from_str(&msg_whole).expect("JSON"),
            content_type: whole,
            answer: vec![(1200, messages::response())],
            client_body: None,
            model_label: "claude-sonnet-4-5",
            reserved_output: 1024,
            worst_usd: claude(len(&msg_whole), 1024),
            input: 1025,
            output: 15,
            charged_usd: 600,
            body: msg_whole,
        },
    ]
}

/// Every API, streamed and whole: strict admission reserves the body's bytes plus the output limit
/// (written into the request when it has none), in tokens and in money; settlement keeps exactly
/// the reported usage and its price; the client gets what it asked for.
#[test]
fn every_api_is_reserved_its_worst_case_and_charged_its_reported_usage() {
    for case in usage_cases() {
        assert_eq!(case.play(), case.expected(), "{}", case.name);
    }
}

/// The requests of [`usage_cases`] by API: path, a streamed body, the events a stream sends before
/// its first content token (none for legacy completions), and whether refusals take Anthropic's
/// error shape.
/// `(api, path, streamed body, events before the first content token, Anthropic error shape)`.
type ApiRequest = (&'static str, &'static str, String, Vec<(u64, String)>, bool);

fn every_api() -> Vec<ApiRequest> {
    use common::llm::{completions, responses};
    let before_content = |t: Vec<(u64, String)>, first_content_ms: u64| t.into_iter().filter(|(ms, _)| *ms < first_content_ms).collect::<Vec<_>>();
    vec![
        ("chat", chat::PATH, chat::request(true, false), vec![(120, chat::role())], false),
        ("completions", completions::PATH, completions::request(true), vec![], false),
        ("responses", responses::PATH, responses::request(true), before_content(responses::timeline(), 250), false),
        // message_start already reports 25 + 1000 input tokens and 1 output token.
        ("messages", messages::PATH, messages::request(true), before_content(messages::timeline(), 400), true),
    ]
}

/// What a refused request left behind.
#[derive(Debug, PartialEq)]
struct Refused {
    status: u32,
    retry_after: Option<String>,
    content_type: Option<String>,
    body: Value,
    reached_upstream: bool,
    stamp: Value,
    rejections: Option<u64>,
    key_ledger: (u64, u64),
    /// An unknown key: status, the body with its (free-text) message replaced by `"…"` if it is a
    /// string, whether headers went upstream, and the count of such refusals.
    unknown_key: (u32, Value, bool, Option<u64>),
    crashed: Option<String>,
}

/// Every API: a request over its key's budget gets 429 in its API's error shape, a request from an
/// unknown key 401; neither reaches the model.
#[test]
fn every_api_refuses_in_its_own_error_shape() {
    let code = "key:search-prod:minute:total_tokens";
    let message = "budget key:search-prod:minute:total_tokens exceeded: 0 used and 0 reserved of 100; resets in 10 s";
    for (api, path, body, _, anthropic) in every_api() {
        let gw = gateway(&policy(json!([]), json!([]), json!([{"window": "minute", "tokens": 100}])));
        let c = Call::start(&gw, &key_headers(path, "search-prod"), &body);
        let reply = c.stream.local_reply().unwrap_or_else(|| panic!("{api}: refused"));
        let u = Call::start(&gw, &key_headers(path, "nobody"), &body);
        let unknown = u.stream.local_reply().unwrap_or_else(|| panic!("{api}: unknown key refused"));
        let mut unknown_body = reply_json(&u.stream);
        if unknown_body["error"]["message"].is_string() {
            unknown_body["error"]["message"] = json!("…");
        }
        let got = Refused {
            status: reply.status,
            retry_after: reply.headers.get("retry-after").map(str::to_owned),
            content_type: reply.headers.get("content-type").map(str::to_owned),
            body: reply_json(&c.stream),
            reached_upstream: !c.stream.upstream_request_body().is_empty(),
            stamp: stamp(&c.stream),
            rejections: gw.counter(&rejections("search-prod", code)),
            key_ledger: used_reserved(&gw, "key", "search-prod", 0),
            unknown_key: (unknown.status, unknown_body, u.stream.upstream_request_headers().is_some(), gw.counter(&rejections("unknown", "unknown_key"))),
            crashed: gw.crashed(),
        };
        let (body, unknown_body) = if anthropic {
            (
                json!({"type": "error", "error": {"type": "rate_limit_error", "message": message, "sluice_code": code}}),
                json!({"type": "error", "error": {"type": "authentication_error", "message": "…", "sluice_code": "unknown_key"}}),
            )
        } else {
            (
                json!({"error": {"message": message, "type": "budget_exceeded", "code": code}}),
                json!({"error": {"message": "…", "type": "authentication_error", "code": "unknown_key"}}),
            )
        };
        let want = Refused {
            status: 429,
            retry_after: Some("10".into()),
            content_type: Some("application/json".into()),
            body,
            reached_upstream: false,
            stamp: json!({"key": "search-prod", "team": "search", "org": "acme", "decision": "rejected",
                          "reject_code": code, "status": 429, "outcome": "refused"}),
            rejections: Some(1),
            key_ledger: (0, 0),
            unknown_key: (401, unknown_body, false, Some(1)),
            crashed: None,
        };
        assert_eq!(got, want, "{api}");
    }
}

/// What a stream ended by latency-guard's 504 before its first token was charged.
#[derive(Debug, PartialEq)]
struct DeadlineCharge {
    status: Value,
    outcome: Value,
    charged_tokens: Value,
    charged_micro_usd: Value,
    /// `(used, reserved)` of the key's tokens and the org's money.
    ledger: [(u64, u64); 2],
    crashed: Option<String>,
}

/// Every API: latency-guard answered 504 at the TTFT deadline (it held the upstream's 200 headers)
/// after the events that come before the first token: the stamp says 504 / `deadline`, nothing is
/// charged — not even the input an Anthropic `message_start` already reported — and the
/// reservations are freed.
#[test]
fn every_api_ended_by_a_guard_deadline_before_any_token_charges_nothing() {
    for (api, path, body, before_content, _) in every_api() {
        let gw = gateway(&every_api_policy());
        let mut c = Call::start(&gw, &key_headers(path, "search-prod"), &body);
        assert_ne!(used_reserved(&gw, "key", "search-prod", 0), (0, 0), "{api}: reserved");
        c.sse_headers(120);
        c.body(&before_content, Delivery::PerEntry, false);
        c.at(1000);
        c.stream.set_property(&["sluice_gateway_reply"], "504 deadline");
        c.stream.upstream_reset().unwrap();
        let s = stamp(&c.stream);
        let got = DeadlineCharge {
            status: s["status"].clone(),
            outcome: s["outcome"].clone(),
            charged_tokens: s["charged_tokens"].clone(),
            charged_micro_usd: s["charged_micro_usd"].clone(),
            ledger: [used_reserved(&gw, "key", "search-prod", 0), used_reserved(&gw, "org", "acme", 0)],
            crashed: gw.crashed(),
        };
        let want = DeadlineCharge {
            status: json!(504),
            outcome: json!("deadline"),
            charged_tokens: json!(0),
            charged_micro_usd: json!(0),
            ledger: [(0, 0), (0, 0)],
            crashed: None,
        };
        assert_eq!(got, want, "{api}");
    }
}

// ---------------------------------------------------------------------------------------------
// 13. Soft limits
// ---------------------------------------------------------------------------------------------

#[test]
fn crossing_a_soft_limit_is_counted_once_and_announced_while_above() {
    let p = with(
        &policy(json!([]), json!([{"window": "minute", "tokens": 10_000, "soft_limit_percent": 50}]), json!([])),
        json!({"default_max_output_tokens": 8_000}),
    );
    let gw = gateway(&p);
    let crossings = "sluice.budget.soft_limit_crossings_total.team.search.window.minute.unit.total_tokens";
    let warning = Some("soft limit reached: team:search:minute:total_tokens".to_string());

    // Below: no announcement.
    let mut below = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &chat_body(false, false, Some(100)));
    answer(&mut below, 100, 10, 10);
    below.end();
    assert_eq!(response_header(&below.stream, "x-sluice-budget-warning"), None);
    assert_eq!(gw.counter(crossings).unwrap_or(0), 0);

    // This one takes the team's usage past 5000 (5020 used). Its worst case passed the soft limit
    // at admission already, but only usage counts: nothing is announced for a reservation.
    let mut cross = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &chat_body(false, false, Some(5_000)));
    assert_eq!(gw.counter(crossings).unwrap_or(0), 0, "a reservation is not usage");
    answer(&mut cross, 100, 100, 4_900);
    cross.end();
    assert_eq!(used_reserved(&gw, "team", "search", 0), (5_020, 0));
    // Its own response left before its usage was known.
    assert_eq!(response_header(&cross.stream, "x-sluice-budget-warning"), None);
    assert_eq!(gw.counter(crossings), Some(1), "counted when the settlement takes usage past it");

    // Above: announced on every response, counted no more.
    for key in ["search-dev", "search-prod"] {
        let mut above = Call::start(&gw, &key_headers(chat::PATH, key), &chat_body(false, false, Some(100)));
        answer(&mut above, 100, 10, 10);
        above.end();
        assert_eq!(response_header(&above.stream, "x-sluice-budget-warning"), warning, "{key}");
    }
    assert_eq!(gw.counter(crossings), Some(1));
    assert!(gw.logs().iter().any(|l| l.message.contains("soft limit of team:search:minute:total_tokens crossed by key search-prod")));
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// Scope
// ---------------------------------------------------------------------------------------------

#[test]
fn only_llm_paths_are_budgeted() {
    let gw = gateway(&policy(json!([]), json!([]), json!([{"window": "minute", "tokens": 1}])));
    let mut s = gw.stream();
    let h = key_headers("/v1/models", "nobody");
    assert_eq!(s.request_headers(&h, false).unwrap(), Action::Continue);
    assert_eq!(s.request_body(b"{}", true).unwrap(), Action::Continue);
    assert_eq!(s.local_reply(), None);
    assert_eq!(s.upstream_request_body(), b"{}");
    assert_eq!(s.filter_state("sluice_budget"), None);
    // An LLM path: headers continue without content-length, the body is held until complete.
    let mut s = gw.stream();
    let body = chat_body(false, false, Some(10));
    let mut h = key_headers(chat::PATH, "search-prod");
    let len = body.len().to_string();
    h.push(("content-length", &len));
    assert_eq!(s.request_headers(&h, false).unwrap(), Action::Continue);
    assert!(!s.upstream_request_headers().unwrap().contains("content-length"));
    let (a, rest) = body.as_bytes().split_at(20);
    assert_eq!(s.request_body(a, false).unwrap(), Action::Pause);
    assert!(s.upstream_request_body().is_empty());
    // 10 + body > 1 token: refused.
    s.request_body(rest, true).unwrap();
    assert_eq!(s.local_reply().map(|r| r.status), Some(429));
    assert!(s.upstream_request_body().is_empty());
    assert_no_crash(&gw);
}

/// In `estimate` mode a prompt can cost more than its estimate (dense scripts tokenize at about one
/// token a character, the estimate assumes four): the settlement, not the admission, then takes the
/// budget past its soft limit. That is a crossing too — and the next request, already above, must
/// not be the first to be counted.
#[test]
fn a_soft_limit_crossed_by_a_settlement_is_counted() {
    let p = with(&policy(json!([]), json!([{"window": "minute", "tokens": 1_000, "soft_limit_percent": 50}]), json!([])), json!({"mode": "estimate"}));
    let gw = gateway(&p);
    let crossings = "sluice.budget.soft_limit_crossings_total.team.search.window.minute.unit.total_tokens";
    let prompt: String = "你好".repeat(200);
    let body = json!({"model": "gpt-4o", "max_tokens": 100,
                      "messages": [{"role": "user", "content": prompt}]})
    .to_string();
    let mut c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    let reserved_input = stamp(&c.stream)["reserved_input_tokens"].as_u64().unwrap();
    assert!(reserved_input + 100 < 500, "admission stays below the soft limit");
    assert_eq!(gw.counter(crossings).unwrap_or(0), 0);
    // 400 characters of Chinese: ~400 tokens, not the ~100 estimated.
    answer(&mut c, 100, 410, 100);
    c.end();
    assert_eq!(used_reserved(&gw, "team", "search", 0), (510, 0));
    assert_eq!(gw.counter(crossings), Some(1), "the settlement took the team past 500");
    assert!(gw.logs().iter().any(|l| l.message.contains("soft limit of team:search:minute:total_tokens crossed")));
    // The next request is above, announced, and not counted again.
    let mut next = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &chat_body(false, false, Some(10)));
    answer(&mut next, 100, 5, 5);
    assert_eq!(response_header(&next.stream, "x-sluice-budget-warning"), Some("soft limit reached: team:search:minute:total_tokens".to_string()));
    next.end();
    assert_eq!(gw.counter(crossings), Some(1));
    assert_no_crash(&gw);
}

/// A chat body posted to a `…/completions` route is a chat request (`refine_kind`): its
/// `max_completion_tokens` is the limit that was sized, so it is the one that must be capped —
/// otherwise the model may produce more than was reserved (overshoot in strict mode).
#[test]
fn a_chat_body_on_a_completions_path_has_every_output_limit_capped() {
    let gw = gateway(&stream_policy());
    let body = json!({"model": "gpt-4o", "max_completion_tokens": 10_000,
                      "messages": [{"role": "user", "content": "Hello!"}]})
    .to_string();
    let c = Call::start(&gw, &key_headers("/v1/completions", "search-prod"), &body);
    assert_eq!(stamp(&c.stream)["reserved_output_tokens"], json!(4096));
    let sent: Value = serde_json::from_slice(&c.stream.upstream_request_body()).unwrap();
    for limit in ["max_completion_tokens", "max_tokens"] {
        if let Some(v) = sent.get(limit) {
            assert!(v.as_u64().unwrap() <= 4096, "{limit} = {v} goes upstream, 4096 reserved: {sent}");
        }
    }
    assert_no_crash(&gw);
}

/// A response that ends with trailers (HTTP/2 upstreams) ends normally: it is settled as completed,
/// not as a disconnect.
#[test]
fn a_response_ending_with_trailers_is_settled_as_completed() {
    let gw = gateway(&stream_policy());
    let mut c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &chat::request(true, true));
    c.sse_headers(120);
    c.body(&chat::timeline(true), Delivery::PerEntry, false);
    c.stream.response_trailers(&[("grpc-status", "0")]).unwrap();
    c.end();
    let s = stamp(&c.stream);
    assert_eq!((s["charged_tokens"].clone(), s["usage"].clone(), s["outcome"].clone()), (json!(28), json!("reported"), json!("completed")));
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (28, 0));
    assert_no_crash(&gw);
}

/// A reservation that is never settled holds budget for `reservation_ttl_minutes` only; settled
/// late, it adds its charge without releasing another request's lease.
#[test]
fn an_unsettled_reservation_expires_after_its_ttl_and_a_late_settlement_still_charges() {
    let body = chat_body(false, false, Some(500));
    let b = body.len() as u64;
    let p = with(&policy(json!([]), json!([]), json!([{"window": "hour", "tokens": b + 500}])), json!({"reservation_ttl_minutes": 10}));
    // 12:00:30: the hour has 59.5 minutes left.
    let gw = gateway_at(&p, MAR31_120030);
    let mut first = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (0, b + 500));
    gw.advance(std::time::Duration::from_secs(9 * 60)).unwrap();
    let refused = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    assert_eq!(refused.stream.local_reply().map(|r| r.status), Some(429), "held 9 minutes later");
    gw.advance(std::time::Duration::from_secs(60)).unwrap();
    let mut second = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    assert_eq!(second.stream.local_reply(), None, "the first lease expired after 10 minutes");
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (0, b + 500));
    // The first answer finally ends: its charge is added, the second's lease stays whole.
    answer(&mut first, 11 * 60_000, 19, 9);
    first.end();
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (28, b + 500));
    answer(&mut second, 120_000, 10, 5);
    second.end();
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (43, 0));
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// Defects found by a new user (issue 9)
// ---------------------------------------------------------------------------------------------

/// `n: 8, max_tokens: 60` on a key with 600 tokens a minute: the first request reserves all eight
/// generations (480 output tokens + the body), so the next two concurrent ones are refused — the
/// key can never be charged more than its limit.
#[test]
fn several_choices_are_reserved_in_full_and_cannot_overshoot() {
    let p = policy(json!([]), json!([]), json!([{"window": "minute", "tokens": 600}]));
    let gw = gateway(&p);
    let mut v: Value = serde_json::from_str(&chat::request(false, false)).unwrap();
    v["n"] = json!(8);
    v["max_tokens"] = json!(60);
    v["messages"] = json!([{"role": "user", "content": "hi"}]);
    let body = v.to_string();
    let b = body.len() as u64;
    assert!(b + 480 <= 600, "the first request fits: {b}");
    let mut calls: Vec<Call<'_>> = (0..3).map(|_| Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body)).collect();
    let s = stamp(&calls[0].stream);
    assert_eq!((s["decision"].clone(), s["reserved_output_tokens"].clone()), (json!("admitted"), json!(480)));
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (0, b + 480));
    for c in &calls[1..] {
        assert_eq!(stamp(&c.stream)["decision"], json!("rejected"));
        assert_eq!(c.stream.local_reply().map(|r| r.status), Some(429));
    }
    // The upstream produced all eight generations: 8 × 60 output tokens, charged in full.
    let first = &mut calls[0];
    first.response_headers(500, "200", "application/json");
    let mut answer: Value = serde_json::from_str(&chat::response(4, 480)).unwrap();
    answer["choices"] =
        json!((0..8).map(|i| json!({"index": i, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"})).collect::<Vec<_>>());
    first.body(&[(500, answer.to_string())], Delivery::PerEntry, true);
    first.end();
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (484, 0));
    assert_no_crash(&gw);
}

/// Legacy completions: `best_of` candidates are all generated, and each prompt of a batch gets its
/// own: `prompt: [a, b], best_of: 3, max_tokens: 10` reserves 60 output tokens.
#[test]
fn best_of_and_prompt_batches_multiply_the_reservation() {
    let p = policy(json!([]), json!([]), json!([{"window": "minute", "tokens": 100_000}]));
    let gw = gateway(&p);
    let body = json!({"model": "gpt-4o", "prompt": ["a", "b"], "n": 2, "best_of": 3, "max_tokens": 10}).to_string();
    let c = Call::start(&gw, &key_headers("/v1/completions", "search-prod"), &body);
    let s = stamp(&c.stream);
    assert_eq!(s["reserved_output_tokens"], json!(60));
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (0, body.len() as u64 + 60));
    // The per-generation limit written upstream is unchanged.
    let sent: Value = serde_json::from_slice(&c.stream.upstream_request_body()).unwrap();
    assert_eq!(sent["max_tokens"], json!(10));
}

/// Two budgets of one key in one window that count different things keep separate gauges and
/// separate refusal codes: the exhausted one is visible.
#[test]
fn two_budgets_of_one_window_have_distinct_gauges_and_codes() {
    let p = policy(json!([]), json!([]), json!([{"window": "day", "tokens": 30, "count": "output"}, {"window": "day", "tokens": 200_000}]));
    let gw = gateway(&p);
    let mut c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &chat_body(false, false, Some(30)));
    answer(&mut c, 100, 19, 30);
    c.end();
    assert_eq!(gw.gauge(&remaining("key", "search-prod", "day", "output_tokens")), Some(0));
    assert_eq!(gw.gauge(&remaining("key", "search-prod", "day", "total_tokens")), Some(200_000 - 49));
    let c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &chat_body(false, false, Some(10)));
    assert_eq!(reply_json(&c.stream)["error"]["code"], json!("key:search-prod:day:output_tokens"));
    assert_eq!(gw.counter(&rejections("search-prod", "key:search-prod:day:output_tokens")), Some(1));
}

/// A stream ended at its total deadline after some tokens: what passed is charged, outcome
/// `deadline`, status what the client saw (200).
#[test]
fn a_guard_deadline_after_tokens_charges_what_was_produced() {
    let gw = gateway(&stream_policy());
    let mut c = partial_stream(&gw, 3);
    c.at(4000);
    c.stream.set_property(&["sluice_gateway_reply"], "200 deadline");
    c.stream.upstream_reset().unwrap();
    let s = stamp(&c.stream);
    assert_eq!((s["status"].clone(), s["outcome"].clone(), s["charged_tokens"].clone()), (json!(200), json!("deadline"), json!(chat::REQUEST_ESTIMATE + 3)));
}

/// A client-chosen model version cannot mint charge series: past the named versions and the
/// dynamic cap, charges are labelled `other`.
#[test]
fn charge_metrics_bound_the_model_version_label() {
    let p = with(
        &policy(json!([]), json!([]), json!([{"window": "minute", "tokens": 10_000_000}])),
        json!({"model_versions": ["v1"], "max_dynamic_model_versions": 2}),
    );
    let gw = gateway(&p);
    for i in 0..50 {
        let version = if i == 0 { "v1".to_string() } else { format!("client-{i}") };
        let mut h = key_headers(chat::PATH, "search-prod");
        h.push(("x-model-version", version.as_str()));
        let mut c = Call::start(&gw, &h, &chat_body(false, false, Some(10)));
        answer(&mut c, 100, 19, 9);
        c.end();
    }
    let charged: Vec<String> = gw.metric_names().into_iter().filter(|n| n.starts_with("sluice.budget.charged_tokens_total")).collect();
    assert_eq!(charged.len(), 4, "v1, two dynamic versions, other: {charged:?}");
    assert_eq!(gw.counter(&charged_tokens("search-prod", "v1")), Some(28));
    assert_eq!(gw.counter(&charged_tokens("search-prod", "other")), Some(28 * 47));
}

/// A per-identity budget and a plain one of the same owner, window and measure: the gauge is the
/// plain budget's (identity counters have none), and each identity is limited on its own.
#[test]
fn identity_budgets_leave_the_gauges_to_the_shared_budgets() {
    let mut p = policy(json!([]), json!([{"window": "day", "tokens": 5_000_000}]), json!([]));
    p["identity"]["per_identity"] = json!({"header": "x-user"});
    p["orgs"][0]["teams"][0]["identity_budgets"] = json!([{"window": "day", "tokens": 1_000}]);
    let gw = gateway(&p);
    let send = |user: &str, max_tokens: u64| {
        let mut h = key_headers(chat::PATH, "search-prod");
        h.push(("x-user", user));
        let mut c = Call::start(&gw, &h, &chat_body(false, false, Some(max_tokens)));
        let refused = c.stream.local_reply().map(|r| r.status);
        if refused.is_none() {
            answer(&mut c, 100, 19, 9);
            c.end();
        }
        refused
    };
    assert_eq!(send("alice", 500), None);
    assert_eq!(send("alice", 900), Some(429), "alice's own 1,000 a day");
    assert_eq!(send("bob", 500), None, "bob is not alice");
    assert_eq!(gw.gauge(&remaining("team", "search", "day", "total_tokens")), Some(5_000_000 - 2 * 28));
    assert!(gw.metric_names().iter().all(|n| !n.contains("per_identity") || n.contains("rejections_total")), "{:?}", gw.metric_names());
}

/// A policy update (a new VM in the same process, as ECDS delivers it) that changes one budget's
/// measure and another's window, adds a budget and moves one: the changed budgets start from
/// zero, the unchanged ones keep their counts wherever they now stand. Counters are named by what
/// they count; under the old positional names the requests budget read the tokens used (84 of 10:
/// refused) and the day budget the minute's count.
#[test]
fn a_reconfigured_budget_starts_from_zero_when_its_measure_or_window_changes() {
    let before = policy(
        json!([{"window": "minute", "tokens": 10_000}]),
        json!([{"window": "day", "tokens": 100_000}]),
        json!([{"window": "month", "tokens": 1_000_000}, {"window": "minute", "requests": 50}]),
    );
    let after = policy(
        json!([{"window": "day", "tokens": 10_000}]),
        json!([{"window": "day", "tokens": 90_000}]),
        json!([{"window": "month", "requests": 10}, {"window": "day", "requests": 100}, {"window": "minute", "requests": 50}]),
    );
    let send = |gw: &Gateway| {
        let mut c = Call::start(gw, &key_headers(chat::PATH, "search-prod"), &chat_body(false, false, Some(10)));
        assert_eq!(c.stream.local_reply().map(|r| (r.status, String::from_utf8_lossy(&r.body).into_owned())), None);
        answer(&mut c, 100, 19, 9);
        c.end();
    };
    let old = gateway_at(&before, MAR31_120030);
    for _ in 0..3 {
        send(&old);
    }
    assert_eq!(used_reserved(&old, "key", "search-prod", 0), (84, 0));
    assert_eq!(used_reserved(&old, "org", "acme", 0), (84, 0));

    let new = old.start_beside(&plugin(), common::budget::spec(&after.to_string())).expect("the new policy loads");
    send(&new);
    // Changed measure (month tokens → month requests) and changed window (org minute → day): from zero.
    assert_eq!(used_reserved(&new, "key", "search-prod", 0), (1, 0));
    assert_eq!(used_reserved(&new, "org", "acme", 0), (28, 0));
    // Added: from zero.
    assert_eq!(used_reserved(&new, "key", "search-prod", 1), (1, 0));
    // Unchanged measure and window, moved from position 1 to 2: 3 before, 1 now.
    assert_eq!(used_reserved(&new, "key", "search-prod", 2), (4, 0));
    // Only its limit changed: it keeps its count.
    assert_eq!(used_reserved(&new, "team", "search", 0), (4 * 28, 0));
    // The names, and the old tokens counter left as it was (no longer read).
    assert_eq!(store_key(&new, "key", "search-prod", 0), "sluice/tenant-budget/key/search-prod/month_day1/requests");
    assert_eq!(store_key(&new, "org", "acme", 0), "sluice/tenant-budget/org/acme/day/total_tokens");
    let stale =
        sluice_core::budget::ledger::Counter::decode(&new.shared_data("sluice/tenant-budget/key/search-prod/month_day1/total_tokens").expect("old counter"));
    assert_eq!(stale.map(|c| c.used), Some(84));
    assert_no_crash(&old);
    assert_no_crash(&new);
}
