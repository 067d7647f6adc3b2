//! tenant-budget's rules, natively: each test drives a [`BudgetFlow`] through its events and
//! asserts the exact effects (and the store's counters) a host would apply.

use super::*;
use crate::budget::ledger;
use crate::flow::FixedView;
use crate::store::MemoryStore;
use serde_json::{json, Value};

const NS: u64 = 1_000_000_000;
/// 2026-03-31T12:00:30Z: 30 s before the minute ends, 3570 s before the hour ends.
const NOW: u64 = 1_774_958_430 * NS;
const STAMP_KEY: &str = "sluice_budget";

/// A policy with org `acme`, team `search` and key `search-prod` (named by `x-sluice-key`) whose
/// own budgets are `key_budgets`; `extra` is merged in at the top.
fn policy_json(key_budgets: Value, extra: Value) -> Value {
    let mut p = json!({
        "identity": {"header": "x-sluice-key"},
        "prices": [{"model": "gpt-4o*", "input_usd_per_mtok": 2.5, "output_usd_per_mtok": 10}],
        "orgs": [{"id": "acme", "teams": [{"id": "search", "keys": [{"id": "search-prod", "budgets": key_budgets}]}]}]
    });
    if let (Some(p), Some(extra)) = (p.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            p.insert(k.clone(), v.clone());
        }
    }
    p
}

fn budget_policy(json: &Value) -> BudgetPolicy {
    let policy = Policy::from_json(json.to_string().as_bytes()).unwrap();
    BudgetPolicy::new(policy, "node-1", NOW, 1)
}

fn minute_tokens(limit: u64) -> Value {
    json!([{"window": "minute", "tokens": limit, "soft_limit_percent": 50}])
}

/// A header map as the host serialises it.
fn headers(pairs: &[(&str, &str)]) -> HeaderPairs {
    HeaderPairs::parse(HeaderPairs::serialize(pairs)).unwrap()
}

fn chat_headers() -> HeaderPairs {
    headers(&[(":path", "/v1/chat/completions"), ("x-sluice-key", "search-prod"), ("content-type", "application/json")])
}

/// A host whose callouts get tokens 1, 2, … (or fail), recording what was sent.
#[derive(Default)]
struct MockHost {
    calls: Vec<(String, Value)>,
    fail_calls: bool,
    refuse_body: bool,
    replaced: Option<Vec<u8>>,
}

impl BudgetHost for MockHost {
    fn ledger_call(&mut self, _ledger: &LedgerConfig, path: &str, body: &[u8]) -> Result<u32, String> {
        if self.fail_calls {
            return Err("BadArgument".into());
        }
        self.calls.push((path.to_string(), serde_json::from_slice(body).unwrap()));
        Ok(u32::try_from(self.calls.len()).unwrap())
    }
    fn replace_request_body(&mut self, _size: usize, bytes: &[u8]) -> bool {
        if self.refuse_body {
            return false;
        }
        self.replaced = Some(bytes.to_vec());
        true
    }
}

/// One request's world: the VM policy, shared data, the host and the effects of the last event.
struct World {
    policy: BudgetPolicy,
    store: MemoryStore,
    host: MockHost,
    view: FixedView,
    flow: BudgetFlow,
    fx: Effects,
}

impl World {
    fn new(json: &Value) -> World {
        let policy = budget_policy(json);
        let mut store = MemoryStore::default();
        policy.policy.ensure_counters(&mut store).unwrap();
        World { policy, store, host: MockHost::default(), view: FixedView::default(), flow: BudgetFlow::new(0x2a), fx: Effects::default() }
    }

    fn take(&mut self) -> Vec<Effect> {
        self.fx.drain().collect()
    }

    fn request_headers(&mut self, h: &HeaderPairs, end_of_stream: bool) -> (Verdict, Vec<Effect>) {
        let v = self.flow.on_request_headers(&mut self.policy, h, end_of_stream, &mut self.fx);
        (v, self.take())
    }

    fn request_body(&mut self, body: &[u8]) -> (Verdict, Vec<Effect>) {
        self.view.request_body = body.to_vec();
        let v = self.flow.on_request_body(&mut self.policy, &mut self.store, &mut self.host, &mut self.view, body.len(), true, NOW, &mut self.fx);
        (v, self.take())
    }

    fn reserve_answer(&mut self, status: u16, answer: &Value, at: u64) -> (Verdict, Vec<Effect>) {
        let bytes = answer.to_string().into_bytes();
        let v = self.flow.on_reserve_answer(&mut self.policy, &mut self.store, &mut self.host, status, &bytes, at, &mut self.fx);
        (v, self.take())
    }

    fn response_headers(&mut self, status: &str, content_type: &str) -> Vec<Effect> {
        self.view.response_headers = vec![(":status".into(), status.into()), ("content-type".into(), content_type.into())];
        self.flow.on_response_headers(&mut self.policy, &mut self.view, NOW, &mut self.fx);
        self.take()
    }

    fn response_body(&mut self, chunk: &[u8], end_of_stream: bool) -> Vec<Effect> {
        self.view.response_body = chunk.to_vec();
        self.flow.on_response_body(&mut self.policy, &mut self.store, &mut self.view, chunk.len(), end_of_stream, NOW, &mut self.fx);
        self.take()
    }

    fn log(&mut self, unended: Outcome) -> Vec<Effect> {
        self.view.unended = unended;
        self.flow.on_log(&mut self.policy, &mut self.store, &mut self.view, NOW, &mut self.fx);
        self.take()
    }

    /// The counter `code` in the store.
    fn counter(&mut self, code: &str) -> Counter {
        let spec = self.policy.policy.counters.iter().find(|c| c.code == code).unwrap().clone();
        let minute = u32::try_from(NOW / NS / 60).unwrap();
        ledger::read(&mut self.store, &spec.store_key, spec.window.id(NOW), minute, self.policy.policy.reservation_ttl_minutes).unwrap()
    }
}

fn stamp(value: Value) -> Effect {
    Effect::SetState { key: STAMP_KEY.into(), value: value.to_string().into_bytes() }
}

fn count(name: &str, delta: i64) -> Effect {
    Effect::Count { name: name.into(), delta }
}

fn gauge(name: &str, value: u64) -> Effect {
    Effect::GaugeSet { name: name.into(), value }
}

fn record(name: &str, value: u64) -> Effect {
    Effect::Record { name: name.into(), value }
}

fn header(name: &str, value: Option<&str>, dir: Dir) -> Effect {
    Effect::SetHeader { dir, name: name.into(), value: value.map(String::from) }
}

/// The refusal a client gets: the reply recorded for the other plugins, then sent.
fn refusal(status: u32, retry_after: Option<&str>, body: Value) -> [Effect; 2] {
    let mut headers = vec![("content-type".to_string(), "application/json".to_string())];
    if let Some(r) = retry_after {
        headers.push(("retry-after".into(), r.into()));
    }
    [
        Effect::MarkReply(GatewayReply { status: u16::try_from(status).unwrap(), end: GatewayEnd::Refused }),
        Effect::LocalReply { status, headers, body: body.to_string().into_bytes() },
    ]
}

/// 78 bytes: strict mode reserves 78 prompt tokens (and the 10 output tokens asked for).
const BODY: &[u8] = br#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"max_tokens":10}"#;
const REMAINING: &str = "sluice.budget.remaining.key.search-prod.window.minute.unit.total_tokens";
const CODE: &str = "key:search-prod:minute:total_tokens";

#[test]
fn an_admitted_request_is_reserved_stamped_and_announced_in_rate_headers() {
    let mut w = World::new(&policy_json(minute_tokens(1000), json!({})));
    let (v, fx) = w.request_headers(&chat_headers(), false);
    assert_eq!(v, Verdict::Continue);
    assert_eq!(fx, [header("content-length", None, Dir::Request)]);
    let input = BODY.len() as u64;
    let (v, fx) = w.request_body(BODY);
    assert_eq!(v, Verdict::Continue);
    let reserved = input + 10;
    assert_eq!(
        fx,
        [
            gauge(REMAINING, 1000 - reserved),
            stamp(json!({"key": "search-prod", "team": "search", "org": "acme", "decision": "admitted",
                "reserved_input_tokens": input, "reserved_output_tokens": 10, "reserved_tokens": reserved,
                "reserved_micro_usd": (input * 25 + 10 * 100).div_ceil(10)})),
        ]
    );
    // max_tokens as asked and no stream: the body goes on untouched.
    assert_eq!(w.host.replaced, None);
    assert_eq!(w.counter(CODE).reserved(), reserved);
    let fx = w.response_headers("200", "application/json");
    assert_eq!(
        fx,
        [
            header("x-ratelimit-limit-tokens", Some("1000"), Dir::Response),
            header("x-ratelimit-remaining-tokens", Some(&(1000 - reserved).to_string()), Dir::Response),
            header("x-ratelimit-reset-tokens", Some("30s"), Dir::Response),
        ]
    );
}

/// A chat completion answer reporting `prompt` + `completion` tokens.
fn answer(prompt: u64, completion: u64) -> Vec<u8> {
    json!({"id": "c1", "object": "chat.completion", "model": "gpt-4o",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}})
    .to_string()
    .into_bytes()
}

const CHARGED_TOKENS: &str = "sluice.budget.charged_tokens_total.key.search-prod.team.search.org.acme.model_version.gpt-4o";
const CHARGED_USD: &str = "sluice.budget.charged_micro_usd_total.key.search-prod.team.search.org.acme.model_version.gpt-4o";
const OVERESTIMATE: &str = "sluice.budget.overestimate_tokens.key.search-prod";

fn admitted_stamp() -> serde_json::Map<String, Value> {
    let input = BODY.len() as u64;
    let v = json!({"key": "search-prod", "team": "search", "org": "acme", "decision": "admitted",
        "reserved_input_tokens": input, "reserved_output_tokens": 10, "reserved_tokens": input + 10, "reserved_micro_usd": 295});
    v.as_object().unwrap().clone()
}

fn with(mut base: serde_json::Map<String, Value>, more: Value) -> Value {
    for (k, v) in more.as_object().unwrap() {
        base.insert(k.clone(), v.clone());
    }
    Value::Object(base)
}

#[test]
fn a_request_past_its_budget_is_refused_with_429_and_reserves_nothing() {
    let mut w = World::new(&policy_json(minute_tokens(50), json!({})));
    w.request_headers(&chat_headers(), false);
    let (v, fx) = w.request_body(BODY);
    assert_eq!(v, Verdict::Pause);
    let message = format!("budget {CODE} exceeded: 0 used and 0 reserved of 50; resets in 30 s");
    let mut want = vec![
        count("sluice.budget.rejections_total.key.search-prod.reason.key_search-prod_minute_total_tokens", 1),
        stamp(json!({"key": "search-prod", "team": "search", "org": "acme", "decision": "rejected", "reject_code": CODE,
            "status": 429, "outcome": "refused"})),
    ];
    want.extend(refusal(429, Some("30"), json!({"error": {"message": message, "type": "budget_exceeded", "code": CODE}})));
    assert_eq!(fx, want);
    assert_eq!(w.counter(CODE).committed(), 0);
    // Refused: nothing to settle at the teardown, nothing more is stamped.
    assert_eq!(w.log(Outcome::ClientDisconnect), []);
}

#[test]
fn an_unknown_key_and_a_compressed_body_are_refused_from_the_headers() {
    let mut w = World::new(&policy_json(minute_tokens(1000), json!({})));
    let (v, fx) = w.request_headers(&headers(&[(":path", "/v1/chat/completions"), ("x-sluice-key", "nobody")]), false);
    assert_eq!(v, Verdict::Pause);
    let mut want = vec![
        count("sluice.budget.rejections_total.key.unknown.reason.unknown_key", 1),
        stamp(json!({"decision": "rejected", "reject_code": "unknown_key", "status": 401, "outcome": "refused"})),
    ];
    let message = "the request's API key or tenant is not in the budget policy";
    want.extend(refusal(401, None, json!({"error": {"message": message, "type": "authentication_error", "code": "unknown_key"}})));
    assert_eq!(fx, want);

    // A key named twice is no key at all.
    let mut w = World::new(&policy_json(minute_tokens(1000), json!({})));
    let twice = headers(&[(":path", "/v1/chat/completions"), ("x-sluice-key", "search-prod"), ("x-sluice-key", "search-prod")]);
    assert_eq!(w.request_headers(&twice, false).0, Verdict::Pause);

    let mut w = World::new(&policy_json(minute_tokens(1000), json!({})));
    let gzip = headers(&[(":path", "/v1/chat/completions"), ("x-sluice-key", "search-prod"), ("content-encoding", "gzip")]);
    let (v, fx) = w.request_headers(&gzip, false);
    assert_eq!(v, Verdict::Pause);
    assert_eq!(fx.first(), Some(&count("sluice.budget.rejections_total.key.search-prod.reason.encoded_body", 1)));
    assert_eq!(
        fx.get(1),
        Some(&stamp(json!({"key": "search-prod", "team": "search", "org": "acme", "decision": "rejected",
        "reject_code": "encoded_body", "status": 415, "outcome": "refused"})))
    );

    // Not an LLM path: not budgeted, nothing done.
    let mut w = World::new(&policy_json(minute_tokens(1000), json!({})));
    assert_eq!(w.request_headers(&headers(&[(":path", "/healthz")]), true), (Verdict::Continue, vec![]));
    assert!(!w.flow.is_budgeted());
}

#[test]
fn a_response_reporting_usage_settles_to_it_and_crosses_the_soft_limit_once() {
    // Soft limit at 100 of 200: the first request's reported 110 tokens cross it.
    let mut w = World::new(&policy_json(minute_tokens(200), json!({})));
    w.request_headers(&chat_headers(), false);
    assert_eq!(w.request_body(BODY).0, Verdict::Continue);
    assert_eq!(w.response_headers("200", "application/json").len(), 3);
    let fx = w.response_body(&answer(90, 20), true);
    assert_eq!(
        fx,
        [
            count(CHARGED_TOKENS, 110),
            // 90 × 2.5 + 20 × 10 micro-USD, rounded up.
            count(CHARGED_USD, 425),
            record(OVERESTIMATE, 0),
            gauge("sluice.budget.remaining.key.search-prod.window.minute.unit.total_tokens", 90),
            count("sluice.budget.soft_limit_crossings_total.key.search-prod.window.minute.unit.total_tokens", 1),
            Effect::Log { level: LogLevel::Info, message: format!("soft limit of {CODE} crossed by key search-prod: 110 of 200 used (soft limit 100)") },
            stamp(with(
                admitted_stamp(),
                json!({"input_tokens": 90, "output_tokens": 20, "charged_tokens": 110, "charged_micro_usd": 425,
                "usage": "reported", "status": 200, "outcome": "completed"})
            )),
        ]
    );
    let c = w.counter(CODE);
    assert_eq!((c.used, c.reserved()), (110, 0));
    // Settled once: the teardown adds nothing.
    assert_eq!(w.log(Outcome::ClientDisconnect), []);

    // The next request is told (usage, not its reservation, is past the soft limit); no new crossing.
    let mut next = BudgetFlow::new(0x2b);
    std::mem::swap(&mut w.flow, &mut next);
    w.request_headers(&chat_headers(), false);
    let (v, fx) = w.request_body(BODY);
    assert_eq!(v, Verdict::Continue);
    // Past the soft limit already: announced, not counted as a crossing again.
    assert_eq!(fx, [gauge(REMAINING, 200 - 110 - 88), stamp(Value::Object(admitted_stamp()))]);
    let fx = w.response_headers("200", "application/json");
    assert_eq!(fx.last(), Some(&header("x-sluice-budget-warning", Some(&format!("soft limit reached: {CODE}")), Dir::Response)));
    let fx = w.response_body(&answer(10, 2), true);
    assert!(!fx.iter().any(|e| matches!(e, Effect::Count { name, .. } if name.contains("soft_limit_crossings"))), "{fx:?}");
}

/// A streaming chat request: sluice asks for the usage (and strips it again).
const STREAM_BODY: &[u8] = br#"{"model":"gpt-4o","stream":true,"messages":[{"role":"user","content":"hello there"}],"max_tokens":10}"#;

fn prompt_estimate(body: &[u8]) -> u64 {
    inspect_request_with_kind(ApiKind::ChatCompletions, body).unwrap().1.prompt_tokens_estimate
}

#[test]
fn a_stream_cut_before_any_content_is_charged_its_prompt() {
    let mut w = World::new(&policy_json(minute_tokens(1000), json!({})));
    w.request_headers(&chat_headers(), false);
    assert_eq!(w.request_body(STREAM_BODY).0, Verdict::Continue);
    let rewritten: Value = serde_json::from_slice(w.host.replaced.as_deref().unwrap()).unwrap();
    assert_eq!(rewritten["stream_options"], json!({"include_usage": true}));
    let fx = w.response_headers("200", "text/event-stream");
    assert_eq!(fx.last(), Some(&header("content-length", None, Dir::Response)), "the stripper changes the length");
    // Only the role delta came before the client went away.
    let role = b"data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\n";
    assert_eq!(w.response_body(role, false), []);
    let input = prompt_estimate(STREAM_BODY);
    assert!(input > 0);
    let reserved = STREAM_BODY.len() as u64 + 10;
    let fx = w.log(Outcome::ClientDisconnect);
    let usd = (input * 25).div_ceil(10);
    assert_eq!(
        fx,
        [
            count(CHARGED_TOKENS, i64::try_from(input).unwrap()),
            count(CHARGED_USD, i64::try_from(usd).unwrap()),
            record(OVERESTIMATE, reserved - input),
            gauge(REMAINING, 1000 - input),
            stamp(json!({"key": "search-prod", "team": "search", "org": "acme", "decision": "admitted",
                "reserved_input_tokens": STREAM_BODY.len(), "reserved_output_tokens": 10, "reserved_tokens": reserved,
                "reserved_micro_usd": (STREAM_BODY.len() as u64 * 25 + 1000).div_ceil(10),
                "input_tokens": input, "output_tokens": 0, "charged_tokens": input, "charged_micro_usd": usd,
                "usage": "estimated", "status": 200, "outcome": "client_disconnect"})),
        ]
    );
    assert_eq!(w.counter(CODE).used, input);

    // The same stream ended by the gateway's deadline before any content: nothing passed, nothing charged.
    let mut w = World::new(&policy_json(minute_tokens(1000), json!({})));
    w.request_headers(&chat_headers(), false);
    w.request_body(STREAM_BODY);
    w.response_headers("200", "text/event-stream");
    w.response_body(role, false);
    w.view.gateway_reply = Some(GatewayReply { status: 504, end: GatewayEnd::Deadline });
    let fx = w.log(Outcome::ClientDisconnect);
    assert_eq!(fx.first(), Some(&count(CHARGED_TOKENS, 0)));
    let Some(Effect::SetState { value, .. }) = fx.last() else { panic!("{fx:?}") };
    let s: Value = serde_json::from_slice(value).unwrap();
    assert_eq!((&s["charged_tokens"], &s["status"], &s["outcome"]), (&json!(0), &json!(504), &json!("deadline")));
    assert_eq!(w.counter(CODE).committed(), 0);
}

#[test]
fn a_body_the_host_will_not_replace_is_refused_and_its_reservation_released() {
    let mut w = World::new(&policy_json(minute_tokens(1000), json!({})));
    w.host.refuse_body = true;
    w.request_headers(&chat_headers(), false);
    let (v, fx) = w.request_body(STREAM_BODY);
    assert_eq!(v, Verdict::Pause);
    let message = "the request body could not be updated to enforce the budget; retry";
    let mut want = vec![
        count("sluice.budget.rejections_total.key.search-prod.reason.unrewritable_body", 1),
        stamp(json!({"key": "search-prod", "team": "search", "org": "acme", "decision": "rejected", "reject_code": "unrewritable_body",
            "status": 503, "outcome": "refused"})),
    ];
    want.extend(refusal(503, Some("1"), json!({"error": {"message": message, "type": "overloaded", "code": "unrewritable_body"}})));
    assert_eq!(fx, want);
    assert_eq!(w.counter(CODE).committed(), 0, "released");
}

fn redis(on_failure: &str) -> Value {
    policy_json(minute_tokens(1000), json!({"ledger": {"mode": "redis", "cluster": "ledger", "on_failure": on_failure}}))
}

const RESERVE_OK: &str = "sluice.budget.ledger_calls_total.call.reserve.result.ok";
const RESERVE_LATENCY: &str = "sluice.budget.ledger_latency_ms.call.reserve";
const RESERVE_ERROR: &str = "sluice.budget.ledger_calls_total.call.reserve.result.error";
const RESERVE_TIMEOUT: &str = "sluice.budget.ledger_calls_total.call.reserve.result.timeout";

/// A Redis-mode request sent to the ledger; returns its hold id.
fn reserving(w: &mut World) -> String {
    w.request_headers(&chat_headers(), false);
    let (v, fx) = w.request_body(BODY);
    assert_eq!((v, fx), (Verdict::Pause, vec![]));
    let (path, body) = w.host.calls.last().unwrap().clone();
    assert_eq!(path, "/v1/reserve");
    let id = body["id"].as_str().unwrap().to_string();
    assert!(id.ends_with(&format!("-2a-{NOW:x}")), "{id}");
    assert!(w.flow.awaits_reserve(1) && !w.flow.awaits_reserve(2));
    id
}

#[test]
fn the_ledgers_admission_admits_and_its_settlement_is_queued_for_the_tick() {
    let mut w = World::new(&redis("deny"));
    let id = reserving(&mut w);
    let (v, fx) = w.reserve_answer(200, &json!({"admitted": true, "counters": [{"used": 5, "reserved": 100}]}), NOW + 3_000_000);
    assert_eq!(v, Verdict::Continue);
    assert_eq!(
        fx,
        [
            count(RESERVE_OK, 1),
            record(RESERVE_LATENCY, 3),
            gauge("sluice.budget.ledger_up", 1),
            gauge(REMAINING, 1000 - 105),
            stamp(with(admitted_stamp(), json!({"ledger": "redis", "ledger_hold": id}))),
        ]
    );
    w.response_headers("200", "application/json");
    let fx = w.response_body(&answer(9, 3), true);
    // The counters after a Redis settlement are the ledger's: no gauge here.
    assert_eq!(
        fx,
        [
            count(CHARGED_TOKENS, 12),
            count(CHARGED_USD, 53),
            record(OVERESTIMATE, 88 - 12),
            stamp(with(
                admitted_stamp(),
                json!({"ledger": "redis", "ledger_hold": id, "input_tokens": 9, "output_tokens": 3,
                "charged_tokens": 12, "charged_micro_usd": 53, "usage": "reported", "status": 200, "outcome": "completed"})
            )),
        ]
    );
    assert_eq!(w.policy.queued_settlements(), 1);
    w.policy.on_tick(&mut w.host, NOW + NS, &mut w.fx);
    assert_eq!(w.take(), []);
    assert_eq!(w.host.calls.last().unwrap(), &("/v1/settle".to_string(), json!({"id": id, "tag": "acme", "charges": [12]})));
    assert!(w.policy.awaits_settlement(2));
    w.policy.on_settle_answer(2, 200, br#"{"settled":true}"#, NOW + NS + 2_000_000, &mut w.fx);
    assert_eq!(w.take(), [count("sluice.budget.ledger_calls_total.call.settle.result.ok", 1), record("sluice.budget.ledger_latency_ms.call.settle", 2)]);
    assert_eq!(w.policy.queued_settlements(), 0);

    // A failed settlement goes back with a backoff, and is sent again once due.
    w.policy.settle_queue.push_back(SettleJob { body: b"{}".to_vec(), attempts: 0, not_before_ns: NOW });
    w.policy.on_tick(&mut w.host, NOW + NS, &mut w.fx);
    w.policy.on_settle_answer(3, 502, b"", NOW + NS, &mut w.fx);
    assert_eq!(
        w.take(),
        [
            count("sluice.budget.ledger_calls_total.call.settle.result.error", 1),
            Effect::Log {
                level: LogLevel::Warn,
                message: "tenant-budget: the Redis ledger is failing: settle: HTTP 502 with no body; on_failure = Deny".into()
            },
            gauge("sluice.budget.ledger_up", 0),
            record("sluice.budget.ledger_latency_ms.call.settle", 0),
        ]
    );
    w.policy.on_tick(&mut w.host, NOW + NS + 50_000_000, &mut w.fx);
    assert_eq!(w.host.calls.len(), 3, "backing off");
    w.policy.on_tick(&mut w.host, NOW + NS + 100_000_000, &mut w.fx);
    assert_eq!(w.host.calls.len(), 4, "sent again");
}

fn settle_job(id: &str) -> SettleJob {
    SettleJob { body: json!({"id": id, "tag": "acme", "charges": [1]}).to_string().into_bytes(), attempts: 0, not_before_ns: NOW }
}

/// Several settlements due in one tick go in one `/v1/settle_batch` callout, in queue order; the
/// answer is judged item by item (settled, a 400 rejected for good, a 503 retried alone later),
/// counted per settlement, its latency once. A batch the call itself fails is retried whole; a 404
/// (a ledger from before batches) sends them one by one from then on.
#[test]
fn settlements_due_together_go_in_one_batch_judged_item_by_item() {
    let mut w = World::new(&redis("deny"));
    for id in ["s-1", "s-2", "s-3"] {
        w.policy.settle_queue.push_back(settle_job(id));
    }
    w.policy.on_tick(&mut w.host, NOW, &mut w.fx);
    let items: Vec<Value> = ["s-1", "s-2", "s-3"].iter().map(|id| json!({"id": id, "tag": "acme", "charges": [1]})).collect();
    assert_eq!(w.host.calls, [("/v1/settle_batch".to_string(), json!({"settlements": items}))]);
    let token = u32::try_from(w.host.calls.len()).unwrap();
    assert!(w.policy.awaits_settlement(token));
    let answer = json!({"results": [
        {"status": 200, "answer": {"settled": true, "counters": [{"used": 1, "reserved": 0}]}},
        {"status": 400, "answer": {"error": "charges_mismatch", "message": "2 charges for 1 counters"}},
        {"status": 503, "answer": {"error": "redis_unavailable", "message": "down"}},
    ]});
    w.policy.on_settle_answer(token, 200, answer.to_string().as_bytes(), NOW + 3_000_000, &mut w.fx);
    let fx = w.take();
    let counted = |result: &str| fx.iter().filter(|e| **e == count(&format!("sluice.budget.ledger_calls_total.call.settle.result.{result}"), 1)).count();
    assert_eq!((counted("ok"), counted("rejected"), counted("error")), (1, 1, 1), "{fx:?}");
    assert_eq!(fx.iter().filter(|e| matches!(e, Effect::Record { .. })).count(), 1, "one latency per callout: {fx:?}");
    assert!(fx.iter().any(|e| matches!(e, Effect::Log { level: LogLevel::Error, message } if message.contains("charges_mismatch"))), "{fx:?}");
    // Only the 503's settlement is back, alone: it goes as a plain /v1/settle once due.
    assert_eq!(w.policy.queued_settlements(), 1);
    w.policy.on_tick(&mut w.host, NOW + NS, &mut w.fx);
    assert_eq!(w.host.calls.last().unwrap(), &("/v1/settle".to_string(), items[2].clone()));

    // The whole call failing (no answer): each of its settlements is retried.
    let mut w = World::new(&redis("deny"));
    for id in ["t-1", "t-2"] {
        w.policy.settle_queue.push_back(settle_job(id));
    }
    w.policy.on_tick(&mut w.host, NOW, &mut w.fx);
    w.policy.on_settle_answer(u32::try_from(w.host.calls.len()).unwrap(), 0, b"", NOW, &mut w.fx);
    assert_eq!(w.policy.queued_settlements(), 2);

    // A ledger without batches: a 404 puts them back untouched, and they go one by one.
    let mut w = World::new(&redis("deny"));
    for id in ["u-1", "u-2"] {
        w.policy.settle_queue.push_back(settle_job(id));
    }
    w.policy.on_tick(&mut w.host, NOW, &mut w.fx);
    w.policy.on_settle_answer(u32::try_from(w.host.calls.len()).unwrap(), 404, br#"{"error":"not_found"}"#, NOW, &mut w.fx);
    assert!(w.take().iter().any(|e| matches!(e, Effect::Log { level: LogLevel::Warn, message } if message.contains("one by one"))));
    w.policy.on_tick(&mut w.host, NOW, &mut w.fx);
    let paths: Vec<&str> = w.host.calls.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(paths, ["/v1/settle_batch", "/v1/settle", "/v1/settle"]);
}

#[test]
fn the_ledgers_refusal_is_a_429_naming_the_refusing_budget() {
    let mut w = World::new(&redis("allow"));
    let id = reserving(&mut w);
    let (v, fx) = w.reserve_answer(200, &json!({"admitted": false, "refused": 0, "used": 990, "reserved": 4}), NOW);
    assert_eq!(v, Verdict::Pause);
    let message = format!("budget {CODE} exceeded: 990 used and 4 reserved of 1000; resets in 30 s");
    let mut want = vec![
        count(RESERVE_OK, 1),
        record(RESERVE_LATENCY, 0),
        gauge("sluice.budget.ledger_up", 1),
        count("sluice.budget.rejections_total.key.search-prod.reason.key_search-prod_minute_total_tokens", 1),
        stamp(json!({"key": "search-prod", "team": "search", "org": "acme", "decision": "rejected", "reject_code": CODE,
            "status": 429, "outcome": "refused", "ledger_hold": id})),
    ];
    want.extend(refusal(429, Some("30"), json!({"error": {"message": message, "type": "budget_exceeded", "code": CODE}})));
    assert_eq!(fx, want);
    assert_eq!(w.policy.queued_settlements(), 0, "a refusal held nothing");
}

#[test]
fn a_ledger_that_does_not_answer_is_handled_by_its_failure_policy() {
    let failing = |on_failure: &str| Effect::Log {
        level: LogLevel::Warn,
        message: format!(
            "tenant-budget: the Redis ledger is failing: no answer from sluice-ledger (the call timed out or was reset); on_failure = {on_failure}"
        ),
    };
    let timed_out = [count("sluice.budget.ledger_calls_total.call.reserve.result.timeout", 1), record(RESERVE_LATENCY, 250)];

    // deny: 503, and the hold the reservation may still make is released a second later.
    let mut w = World::new(&redis("deny"));
    let id = reserving(&mut w);
    let (v, fx) = w.reserve_answer(0, &json!(null), NOW + 250_000_000);
    assert_eq!(v, Verdict::Pause);
    let mut want = timed_out.to_vec();
    want.extend([
        failing("Deny"),
        gauge("sluice.budget.ledger_up", 0),
        count("sluice.budget.rejections_total.key.search-prod.reason.budget_ledger_unavailable", 1),
        stamp(json!({"key": "search-prod", "team": "search", "org": "acme", "decision": "rejected", "reject_code": "budget_ledger_unavailable",
            "status": 503, "outcome": "refused", "ledger_hold": id})),
    ]);
    let message = "the budget ledger is unavailable; retry shortly";
    want.extend(refusal(503, Some("1"), json!({"error": {"message": message, "type": "overloaded", "code": "budget_ledger_unavailable"}})));
    assert_eq!(fx, want);
    assert_eq!(w.policy.queued_settlements(), 1);
    w.policy.on_tick(&mut w.host, NOW + 250_000_000, &mut w.fx);
    assert_eq!(w.host.calls.len(), 1, "the release waits a second");
    w.policy.on_tick(&mut w.host, NOW + 1_250_000_000, &mut w.fx);
    assert_eq!(w.host.calls.last().unwrap(), &("/v1/settle".to_string(), json!({"id": id, "tag": "acme", "charges": [0]})));

    // allow: through, unbudgeted, and nothing to settle at the end.
    let mut w = World::new(&redis("allow"));
    let id = reserving(&mut w);
    let (v, fx) = w.reserve_answer(0, &json!(null), NOW + 250_000_000);
    assert_eq!(v, Verdict::Continue);
    let mut want = timed_out.to_vec();
    want.extend([
        failing("Allow"),
        gauge("sluice.budget.ledger_up", 0),
        stamp(json!({"key": "search-prod", "team": "search", "org": "acme", "decision": "unbudgeted", "ledger_hold": id})),
        count("sluice.budget.ledger_fallback_total.action.allow", 1),
    ]);
    assert_eq!(fx, want);
    w.response_headers("200", "application/json");
    assert_eq!(w.response_body(&answer(9, 3), true), []);
    assert_eq!(w.log(Outcome::Completed), []);

    // local: the per-process ledger admits (a callout that never started counts the same way).
    let mut w = World::new(&redis("local"));
    w.host.fail_calls = true;
    w.request_headers(&chat_headers(), false);
    let (v, fx) = w.request_body(BODY);
    assert_eq!(v, Verdict::Continue);
    assert_eq!(
        fx,
        [
            Effect::Log {
                level: LogLevel::Warn,
                message: "tenant-budget: the Redis ledger is failing: reserve callout not started: BadArgument; on_failure = Local".into()
            },
            gauge("sluice.budget.ledger_up", 0),
            count("sluice.budget.ledger_fallback_total.action.local", 1),
            gauge(REMAINING, 1000 - 88),
            stamp(with(admitted_stamp(), json!({"ledger": "local_fallback"}))),
        ]
    );
    assert_eq!(w.counter(CODE).reserved(), 88);
}

/// Envoy's own answers to a callout it could not deliver, as Envoy 1.40 words them.
const ENVOY_REFUSED: &[u8] = b"upstream connect error or disconnect/reset before headers. reset reason: remote connection failure, transport failure reason: delayed connect error: Connection refused";
const ENVOY_TIMEOUT: &[u8] = b"upstream request timeout";

impl World {
    fn reserve_answer_bytes(&mut self, status: u16, answer: &[u8], at: u64) -> (Verdict, Vec<Effect>) {
        let v = self.flow.on_reserve_answer(&mut self.policy, &mut self.store, &mut self.host, status, answer, at, &mut self.fx);
        (v, self.take())
    }
}

#[test]
fn a_reservation_envoy_never_sent_queues_no_release_and_the_warning_says_envoy_could_not_connect() {
    for body in [ENVOY_REFUSED, b"no healthy upstream".as_slice(), b"upstream connect error or disconnect/reset before headers. reset reason: overflow"] {
        let mut w = World::new(&redis("deny"));
        reserving(&mut w);
        let (v, fx) = w.reserve_answer_bytes(503, body, NOW + 1_000_000);
        assert_eq!(v, Verdict::Pause);
        let text = String::from_utf8_lossy(body);
        let warning = format!("tenant-budget: the Redis ledger is failing: Envoy could not reach sluice-ledger ({text}); on_failure = Deny");
        assert!(fx.contains(&Effect::Log { level: LogLevel::Warn, message: warning }), "{fx:?}");
        assert!(fx.contains(&count(RESERVE_ERROR, 1)), "{fx:?}");
        assert_eq!(w.policy.queued_settlements(), 0, "nothing reached Redis for {text:?}: nothing to release");
    }
}

#[test]
fn a_reservation_that_may_have_run_is_released_whoever_answered() {
    // The service's own 503 (Redis timed out: the script may still run), a connection that broke
    // after the call went out, and Envoy's timeout: each may leave a hold behind.
    let service = json!({"error": "redis_unavailable", "message": "redis 127.0.0.1:6379: timed out"}).to_string();
    let cases: [(u16, &[u8], &str, &str); 3] = [
        (503, service.as_bytes(), RESERVE_ERROR, "sluice-ledger answered HTTP 503 redis_unavailable: redis 127.0.0.1:6379: timed out"),
        (
            503,
            b"upstream connect error or disconnect/reset before headers. reset reason: connection termination",
            RESERVE_ERROR,
            "HTTP 503: upstream connect error or disconnect/reset before headers. reset reason: connection termination",
        ),
        (504, ENVOY_TIMEOUT, RESERVE_TIMEOUT, "sluice-ledger did not answer within timeout_ms (Envoy: upstream request timeout)"),
    ];
    for (status, body, metric, why) in cases {
        let mut w = World::new(&redis("deny"));
        let id = reserving(&mut w);
        let (_, fx) = w.reserve_answer_bytes(status, body, NOW + 1_000_000);
        let warning = format!("tenant-budget: the Redis ledger is failing: {why}; on_failure = Deny");
        assert!(fx.contains(&Effect::Log { level: LogLevel::Warn, message: warning }), "{fx:?}");
        assert!(fx.contains(&count(metric, 1)), "{fx:?}");
        assert_eq!(w.policy.queued_settlements(), 1, "{why}");
        w.policy.on_tick(&mut w.host, NOW + 2 * NS, &mut w.fx);
        assert_eq!(w.host.calls.last().unwrap(), &("/v1/settle".to_string(), json!({"id": id, "tag": "acme", "charges": [0]})));
    }
}

#[test]
fn a_settlement_envoy_could_not_deliver_is_retried_and_logged_as_such() {
    let mut w = World::new(&redis("deny"));
    w.policy.settle_queue.push_back(SettleJob { body: b"{}".to_vec(), attempts: 0, not_before_ns: NOW });
    w.policy.on_tick(&mut w.host, NOW, &mut w.fx);
    let token = w.host.calls.len() as u32;
    w.policy.on_settle_answer(token, 503, ENVOY_REFUSED, NOW, &mut w.fx);
    let fx = w.take();
    let text = String::from_utf8_lossy(ENVOY_REFUSED);
    let warning = format!("tenant-budget: the Redis ledger is failing: settle: Envoy could not reach sluice-ledger ({text}); on_failure = Deny");
    assert!(fx.contains(&Effect::Log { level: LogLevel::Warn, message: warning }), "{fx:?}");
    assert_eq!(w.policy.queued_settlements(), 1, "back in the queue");
}

#[test]
fn a_stream_gone_while_the_ledger_decides_releases_its_hold() {
    let mut w = World::new(&redis("deny"));
    let id = reserving(&mut w);
    assert_eq!(w.log(Outcome::ClientDisconnect), []);
    assert!(!w.flow.awaits_reserve(1));
    w.policy.on_tick(&mut w.host, NOW + NS, &mut w.fx);
    assert_eq!(w.host.calls.last().unwrap(), &("/v1/settle".to_string(), json!({"id": id, "tag": "acme", "charges": [0]})));
}

/// A request the local fallback admitted during an outage (Envoy could not reach the ledger) and
/// its charge once the response ended: summed per Redis counter with the next one, written back
/// by `/v1/charge` once the ledger answers, resent unchanged (same id) while it does not, and
/// final once charged.
#[test]
fn the_local_fallbacks_charges_are_written_back_once_the_ledger_answers() {
    let mut w = World::new(&redis("local"));
    let fallback = |w: &mut World, completion: u64| {
        w.flow = BudgetFlow::new(0x2a);
        w.request_headers(&chat_headers(), false);
        assert_eq!(w.request_body(BODY).0, Verdict::Pause);
        let (path, reserve) = w.host.calls.last().unwrap().clone();
        assert_eq!(path, "/v1/reserve");
        let (v, _) = w.reserve_answer_bytes(503, ENVOY_REFUSED, NOW);
        assert_eq!(v, Verdict::Continue, "admitted locally");
        w.response_headers("200", "application/json");
        w.response_body(&answer(9, completion), true);
        reserve
    };
    let reserve = fallback(&mut w, 3);
    let (key, expire_at_s) = (reserve["counters"][0]["key"].clone(), reserve["counters"][0]["expire_at_s"].clone());
    assert_eq!(w.policy.pending_write_backs(), 1);
    assert_eq!(w.counter(CODE).committed(), 12, "charged locally too");

    // Still down: the callout does not start; it is tried again after a delay.
    w.host.fail_calls = true;
    w.policy.on_tick(&mut w.host, NOW + NS, &mut w.fx);
    assert_eq!(w.take(), [], "the ledger is already known to fail: nothing new to say");
    assert_eq!(w.host.calls.len(), 1);
    w.host.fail_calls = false;
    w.policy.on_tick(&mut w.host, NOW + NS + 50_000_000, &mut w.fx);
    assert_eq!(w.host.calls.len(), 1, "backing off");
    w.policy.on_tick(&mut w.host, NOW + NS + 100_000_000, &mut w.fx);
    let prefix = w.policy.vm_nonce.clone();
    let first = json!({"id": format!("{prefix}-w1"), "tag": "acme", "counters": [{"key": key, "amount": 12, "expire_at_s": expire_at_s}]});
    assert_eq!(w.host.calls.last().unwrap(), &("/v1/charge".to_string(), first.clone()));
    let token = u32::try_from(w.host.calls.len()).unwrap();
    assert!(w.policy.awaits_settlement(token));

    // Another fallback request meanwhile: summed into the next write-back, not into the one sent.
    fallback(&mut w, 5);
    w.take();
    // The answer is lost (timed out): the same body is sent again, under the same id, after a
    // second, longer delay.
    w.policy.on_settle_answer(token, 0, b"", NOW + 2 * NS, &mut w.fx);
    assert_eq!(
        w.take(),
        [count("sluice.budget.ledger_calls_total.call.write_back.result.timeout", 1), record("sluice.budget.ledger_latency_ms.call.write_back", 900)]
    );
    w.policy.on_tick(&mut w.host, NOW + 2 * NS + 200_000_000, &mut w.fx);
    assert_eq!(w.host.calls.last().unwrap(), &("/v1/charge".to_string(), first));
    let token = u32::try_from(w.host.calls.len()).unwrap();
    w.policy.on_settle_answer(token, 200, br#"{"charged":true,"counters":[{"used":12,"reserved":0}]}"#, NOW + 3 * NS, &mut w.fx);
    let fx = w.take();
    assert!(fx.contains(&count("sluice.budget.ledger_calls_total.call.write_back.result.ok", 1)), "{fx:?}");
    assert!(fx.contains(&Effect::Log { level: LogLevel::Warn, message: "tenant-budget: the Redis ledger answers again".into() }), "{fx:?}");
    assert_eq!(w.policy.pending_write_backs(), 1, "the second request's charge waits");
    w.policy.on_tick(&mut w.host, NOW + 3 * NS, &mut w.fx);
    let second = json!({"id": format!("{prefix}-w2"), "tag": "acme", "counters": [{"key": key, "amount": 14, "expire_at_s": expire_at_s}]});
    assert_eq!(w.host.calls.last().unwrap(), &("/v1/charge".to_string(), second));
    // Already charged (a retry the ledger had applied) is final too.
    let token = u32::try_from(w.host.calls.len()).unwrap();
    w.policy.on_settle_answer(token, 200, br#"{"charged":false,"reason":"already_charged"}"#, NOW + 3 * NS, &mut w.fx);
    assert_eq!(w.policy.pending_write_backs(), 0);
    let calls = w.host.calls.len();
    w.policy.on_tick(&mut w.host, NOW + 4 * NS, &mut w.fx);
    assert_eq!(w.host.calls.len(), calls, "nothing left to send");
}

/// A write-back whose windows are over is dropped unsent; one the ledger rejects is final; a ledger
/// without `/v1/charge` (404) stops them; past the bound of counters a charge is dropped, counted.
#[test]
fn write_backs_end_when_moot_rejected_unsupported_or_past_their_bound() {
    let target = |keys: std::ops::Range<usize>, expire_at_s: u64| WriteBack {
        tag: "acme".into(),
        counters: keys.map(|i| crate::budget::remote::WriteBackCounter { index: 0, key: format!("k{i}"), expire_at_s }).collect(),
    };
    let now_s = NOW / NS;
    let mut w = World::new(&redis("local"));
    w.policy.queue_write_back(&target(0..1, now_s - 1), &[5], &mut w.fx);
    w.policy.on_tick(&mut w.host, NOW, &mut w.fx);
    assert_eq!(w.host.calls.len(), 1, "sent while its window may still count");
    w.policy.on_settle_answer(1, 503, ENVOY_REFUSED, NOW, &mut w.fx);
    w.policy.on_tick(&mut w.host, NOW + NS, &mut w.fx);
    assert_eq!((w.host.calls.len(), w.policy.pending_write_backs()), (1, 0), "its window is over: dropped, not sent again");

    w.policy.queue_write_back(&target(0..2, now_s + 60), &[5, 0], &mut w.fx);
    assert_eq!(w.policy.pending_write_backs(), 1, "nothing to write back for a zero charge");
    w.policy.on_tick(&mut w.host, NOW, &mut w.fx);
    w.policy.on_settle_answer(2, 400, br#"{"error":"invalid_field","message":"x"}"#, NOW, &mut w.fx);
    let fx = w.take();
    assert!(fx.contains(&count("sluice.budget.ledger_calls_total.call.write_back.result.rejected", 1)), "{fx:?}");
    assert!(fx.iter().any(|e| matches!(e, Effect::Log { level: LogLevel::Error, message } if message.contains("rejected a write-back"))), "{fx:?}");
    assert_eq!(w.policy.pending_write_backs(), 0);

    // Bounded: counters past the bound are dropped and counted; 64 counters per call.
    w.policy.queue_write_back(&target(0..MAX_WRITE_BACK_COUNTERS + 3, now_s + 60), &vec![1; MAX_WRITE_BACK_COUNTERS + 3], &mut w.fx);
    assert_eq!(w.take().iter().filter(|e| **e == count("sluice.budget.ledger_settlements_dropped_total", 1)).count(), 3);
    assert_eq!(w.policy.pending_write_backs(), MAX_WRITE_BACK_COUNTERS);
    w.policy.on_tick(&mut w.host, NOW, &mut w.fx);
    assert_eq!(w.host.calls.last().unwrap().1["counters"].as_array().unwrap().len(), WRITE_BACK_MAX_COUNTERS);
    w.policy.on_settle_answer(3, 404, br#"{"error":"not_found","message":"no endpoint /v1/charge"}"#, NOW, &mut w.fx);
    assert!(w.take().iter().any(|e| matches!(e, Effect::Log { level: LogLevel::Warn, message } if message.contains("no /v1/charge"))));
    assert_eq!(w.policy.pending_write_backs(), 0);
    w.policy.queue_write_back(&target(0..1, now_s + 60), &[5], &mut w.fx);
    assert_eq!(w.policy.pending_write_backs(), 0, "not kept once the ledger said it cannot take them");
}

/// Two VMs of one process configured at the same instant (Envoy's workers are) name their holds
/// apart by the number each takes from shared data; once two named them alike, and one request's
/// reservation replayed the other's.
#[test]
fn the_vms_of_one_process_name_their_holds_apart() {
    let mut store = MemoryStore::default();
    let (first, second) = (next_vm_number(&mut store), next_vm_number(&mut store));
    assert_eq!((first, second), (1, 2));
    let policy = || Policy::from_json(redis("deny").to_string().as_bytes()).unwrap();
    let ids: Vec<String> = [first, second]
        .into_iter()
        .map(|n| {
            let mut w = World::new(&redis("deny"));
            w.policy = BudgetPolicy::new(policy(), "node-1", NOW, n);
            reserving(&mut w)
        })
        .collect();
    assert_ne!(ids[0], ids[1]);
    assert_eq!(ids[0].get(..8), ids[1].get(..8), "the same proxy: the same prefix");
}
