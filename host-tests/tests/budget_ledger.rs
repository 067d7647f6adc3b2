//! tenant-budget in Redis mode, the built `.wasm` in the harness: the reservation is a callout to
//! the `sluice-ledger` cluster and the request waits for it (the upstream sees nothing before the
//! answer); settlement leaves from the root context, survives the request, and is retried; the
//! ledger's failure policy (deny, allow, local) applies when it does not answer. The ledger's own
//! behaviour is tested against real Redis in `ledger/tests/`; here the test plays the service.

mod common;

use common::budget::*;
use common::llm::{chat, Call, Delivery};
use serde_json::{json, Value};
use sluice_host::{Gateway, HttpCall, HttpReply};
use std::time::Duration;

fn redis_policy(on_failure: &str) -> Value {
    let mut p = policy(json!([]), json!([{"window": "minute", "tokens": 1_000_000}]), json!([{"window": "minute", "tokens": 100_000}]));
    p["ledger"] = json!({"mode": "redis", "cluster": "sluice_ledger", "timeout_ms": 200, "on_failure": on_failure, "replicas": 4});
    p
}

fn calls_to(gw: &Gateway, path: &str) -> Vec<HttpCall> {
    gw.http_calls().into_iter().filter(|c| c.headers.get(":path") == Some(path)).collect()
}

fn body_of(call: &HttpCall) -> Value {
    serde_json::from_slice(&call.body).expect("callout body is JSON")
}

fn reply(body: Value) -> HttpReply {
    HttpReply::status(200).header("content-type", "application/json").body(body.to_string())
}

fn admitted(call: &HttpCall) -> HttpReply {
    let n = body_of(call)["counters"].as_array().map_or(0, Vec::len);
    reply(json!({"admitted": true, "replayed": false, "counters": vec![json!({"used": 0, "reserved": 1}); n]}))
}

#[test]
fn a_reservation_waits_for_the_ledger_and_settlement_leaves_from_the_root() {
    let gw = gateway(&redis_policy("deny"));
    let body = chat_body(false, false, Some(100));
    let b = body.len() as u64;
    let mut c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    // Held: nothing upstream until the ledger answers.
    assert!(c.stream.request_paused());
    assert!(c.stream.upstream_request_body().is_empty());
    let reserve = calls_to(&gw, "/v1/reserve");
    assert_eq!(reserve.len(), 1);
    let call = &reserve[0];
    assert_eq!(call.upstream, "sluice_ledger");
    assert_eq!(call.timeout, Some(Duration::from_millis(200)));
    assert_eq!(call.headers.get(":authority"), Some("sluice-ledger"));
    let sent = body_of(call);
    let id = sent["id"].as_str().expect("id").to_string();
    assert_eq!(sent["tag"], json!("acme"));
    let keys: Vec<&str> = sent["counters"].as_array().unwrap().iter().map(|c| c["key"].as_str().unwrap()).collect();
    let minute = gw.now_ns() / NS / 60;
    assert_eq!(keys, [format!("team:search:minute:total_tokens:w{minute}"), format!("key:search-prod:minute:total_tokens:w{minute}")]);
    assert!(sent["counters"].as_array().unwrap().iter().all(|c| c["amount"] == json!(b + 100)));

    gw.respond_http_call(call.token, admitted(call)).unwrap();
    assert!(!c.stream.request_paused(), "resumed once admitted");
    assert_eq!(c.stream.upstream_request_body(), body.as_bytes());
    assert_eq!(stamp(&c.stream)["ledger"], json!("redis"));
    assert_eq!(stamp(&c.stream)["ledger_hold"], json!(id), "the hold is traceable from the access log");

    c.response_headers(300, "200", "application/json");
    c.body_bytes(300, chat::response(19, 9).as_bytes(), true);
    c.end();
    // The stream is gone; its settlement goes out from the root at the next tick.
    gw.advance(Duration::from_millis(25)).unwrap();
    let settle = calls_to(&gw, "/v1/settle");
    assert_eq!(settle.len(), 1);
    assert_eq!(body_of(&settle[0]), json!({"id": id, "tag": "acme", "charges": [28, 28]}));
    assert_ne!(settle[0].context_id, c.stream.id(), "made by the root, not the finished stream");
    gw.respond_http_call(settle[0].token, reply(json!({"settled": true, "counters": [{"used": 28, "reserved": 0}, {"used": 28, "reserved": 0}]}))).unwrap();
    gw.advance(Duration::from_millis(100)).unwrap();
    assert!(calls_to(&gw, "/v1/settle").is_empty(), "settled once");
    assert_eq!(gw.counter("sluice.budget.ledger_calls_total.call.settle.result.ok"), Some(1));
    assert_eq!(gw.counter("sluice.budget.ledger_calls_total.call.reserve.result.ok"), Some(1));
    assert_eq!(gw.crashed(), None);
}

#[test]
fn a_refusal_from_the_ledger_is_a_429_naming_the_budget() {
    let gw = gateway(&redis_policy("deny"));
    let c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &chat_body(false, false, Some(100)));
    let call = calls_to(&gw, "/v1/reserve").remove(0);
    gw.respond_http_call(call.token, reply(json!({"admitted": false, "refused": 1, "used": 99_990, "reserved": 0, "limit": 100_000}))).unwrap();
    let local = c.stream.local_reply().expect("refused");
    assert_eq!(local.status, 429);
    let err = reply_json(&c.stream);
    assert_eq!(err["error"]["code"], json!("key:search-prod:minute:total_tokens"));
    assert!(c.stream.upstream_request_body().is_empty());
}

#[test]
fn settlement_is_retried_until_the_ledger_takes_it() {
    let gw = gateway(&redis_policy("deny"));
    let mut c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &chat_body(false, false, Some(100)));
    let call = calls_to(&gw, "/v1/reserve").remove(0);
    gw.respond_http_call(call.token, admitted(&call)).unwrap();
    c.response_headers(100, "200", "application/json");
    c.body_bytes(100, chat::response(19, 9).as_bytes(), true);
    c.end();
    gw.advance(Duration::from_millis(25)).unwrap();
    let first = calls_to(&gw, "/v1/settle").remove(0);
    gw.fail_http_call(first.token).unwrap();
    assert_eq!(gw.counter("sluice.budget.ledger_calls_total.call.settle.result.timeout"), Some(1));
    assert_eq!(gw.gauge("sluice.budget.ledger_up"), Some(0));
    gw.advance(Duration::from_millis(150)).unwrap();
    let again = calls_to(&gw, "/v1/settle");
    assert_eq!(again.len(), 1, "retried after its backoff");
    assert_eq!(again[0].body, first.body, "the same settlement: idempotent by id");
    gw.respond_http_call(again[0].token, reply(json!({"settled": false, "reason": "already_settled"}))).unwrap();
    assert_eq!(gw.gauge("sluice.budget.ledger_up"), Some(1));
    let warns = gw.logs_at_least(sluice_host::LogLevel::Warn);
    assert_eq!(warns.iter().filter(|l| l.contains("Redis ledger is failing")).count(), 1, "{warns:?}");
    assert_eq!(warns.iter().filter(|l| l.contains("answers again")).count(), 1, "{warns:?}");
}

#[test]
fn when_the_ledger_does_not_answer_deny_refuses_with_503() {
    let gw = gateway(&redis_policy("deny"));
    let c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &chat_body(false, false, Some(100)));
    let call = calls_to(&gw, "/v1/reserve").remove(0);
    gw.fail_http_call(call.token).unwrap();
    assert_eq!(c.stream.local_reply().map(|r| r.status), Some(503));
    assert_eq!(reply_json(&c.stream)["error"]["code"], json!("budget_ledger_unavailable"));
    assert_eq!(gw.counter("sluice.budget.ledger_calls_total.call.reserve.result.timeout"), Some(1));
    assert!(c.stream.upstream_request_body().is_empty());
    // The reservation may still run in Redis after the timeout: it is released a second later.
    let id = body_of(&call)["id"].clone();
    gw.advance(Duration::from_millis(900)).unwrap();
    assert!(calls_to(&gw, "/v1/settle").is_empty());
    gw.advance(Duration::from_millis(200)).unwrap();
    let release = calls_to(&gw, "/v1/settle");
    assert_eq!(release.len(), 1);
    assert_eq!(body_of(&release[0]), json!({"id": id, "tag": "acme", "charges": [0, 0]}));
}

#[test]
fn when_the_ledger_does_not_answer_allow_lets_the_request_pass_unbudgeted() {
    let gw = gateway(&redis_policy("allow"));
    let body = chat_body(false, false, Some(100));
    let c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &body);
    let call = calls_to(&gw, "/v1/reserve").remove(0);
    gw.respond_http_call(call.token, HttpReply::status(503).body("redis down")).unwrap();
    assert_eq!(c.stream.local_reply(), None);
    assert!(!c.stream.request_paused());
    assert_eq!(c.stream.upstream_request_body(), body.as_bytes());
    assert_eq!(stamp(&c.stream)["decision"], json!("unbudgeted"));
}

#[test]
fn when_the_ledger_does_not_answer_local_admits_against_the_divided_limit() {
    // Key budget 10,000 a minute over 4 replicas: 2,500 in this process; each request reserves its
    // body + 1,500.
    let mut p = redis_policy("local");
    p["orgs"][0]["teams"][0]["keys"][0]["budgets"] = json!([{"window": "minute", "tokens": 10_000}]);
    let gw = gateway(&p);
    let admit = || {
        let c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &chat_body(false, false, Some(1_500)));
        let call = calls_to(&gw, "/v1/reserve").pop().expect("a reservation");
        gw.fail_http_call(call.token).unwrap();
        c
    };
    let first = admit();
    assert_eq!(first.stream.local_reply(), None);
    assert_eq!(stamp(&first.stream)["ledger"], json!("local_fallback"));
    let b = chat_body(false, false, Some(1_500)).len() as u64;
    assert_eq!(stamp(&first.stream)["reserved_tokens"], json!(b + 1_500));
    assert!(2 * (b + 1_500) > 2_500 && b + 1_500 <= 2_500);
    let second = admit();
    assert_eq!(second.stream.local_reply().map(|r| r.status), Some(429), "over a quarter of the key's budget");
    assert_eq!(gw.counter("sluice.budget.ledger_fallback_total.action.local"), Some(2));
}

#[test]
fn a_request_gone_while_the_ledger_decides_releases_its_hold() {
    let gw = gateway(&redis_policy("deny"));
    let mut c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &chat_body(false, false, Some(100)));
    let call = calls_to(&gw, "/v1/reserve").remove(0);
    let id = body_of(&call)["id"].clone();
    c.stream.client_reset().unwrap();
    gw.advance(Duration::from_millis(500)).unwrap();
    assert!(calls_to(&gw, "/v1/settle").is_empty(), "not before the reservation can have landed");
    gw.advance(Duration::from_millis(600)).unwrap();
    let release = calls_to(&gw, "/v1/settle");
    assert_eq!(release.len(), 1);
    assert_eq!(body_of(&release[0]), json!({"id": id, "tag": "acme", "charges": [0, 0]}));
}

/// Per-identity budgets in Redis mode: one counter key per identity, no identity listed anywhere.
#[test]
fn identity_budgets_name_one_redis_counter_per_identity() {
    let mut p = redis_policy("deny");
    p["identity"]["per_identity"] = json!({"header": "x-user"});
    p["orgs"][0]["teams"][0]["identity_budgets"] = json!([{"window": "day", "tokens": 200_000}]);
    let gw = gateway(&p);
    let mut keys = Vec::new();
    for user in ["alice", "bob", "alice"] {
        let mut h = key_headers(chat::PATH, "search-prod");
        h.push(("x-user", user));
        let _c = Call::start(&gw, &h, &chat_body(false, false, Some(10)));
        let call = calls_to(&gw, "/v1/reserve").pop().unwrap();
        let sent = body_of(&call);
        let identity_key =
            sent["counters"].as_array().unwrap().iter().map(|c| c["key"].as_str().unwrap().to_string()).find(|k| k.contains(":per_identity:")).unwrap();
        keys.push(identity_key);
        gw.fail_http_call(call.token).unwrap();
    }
    assert_ne!(keys[0], keys[1], "alice and bob count apart");
    assert_eq!(keys[0], keys[2], "alice is always alice");
    let day = gw.now_ns() / NS / 86_400;
    let prefix = "team:search:day:total_tokens:per_identity:";
    assert!(keys[0].starts_with(prefix) && keys[0].ends_with(&format!(":w{day}")), "{}", keys[0]);
    // No metric carries an identity.
    let hash = &keys[0][prefix.len()..prefix.len() + 16];
    assert!(gw.metric_names().iter().all(|n| !n.contains(hash)));
}

#[test]
fn a_streamed_request_in_redis_mode_gets_include_usage_and_is_settled_from_reported_usage() {
    let gw = gateway(&redis_policy("deny"));
    let mut c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &chat::request(true, false));
    let call = calls_to(&gw, "/v1/reserve").remove(0);
    gw.respond_http_call(call.token, admitted(&call)).unwrap();
    let upstream: Value = serde_json::from_slice(&c.stream.upstream_request_body()).unwrap();
    assert_eq!(upstream["stream_options"]["include_usage"], json!(true), "written after the ledger's answer");
    c.sse_headers(100);
    c.body(&chat::timeline(true), Delivery::PerEntry, true);
    c.end();
    gw.advance(Duration::from_millis(25)).unwrap();
    let settle = calls_to(&gw, "/v1/settle").remove(0);
    let charged = body_of(&settle)["charges"][0].as_u64().unwrap();
    assert_eq!(Some(charged), stamp(&c.stream)["charged_tokens"].as_u64());
    assert_eq!(stamp(&c.stream)["usage"], json!("reported"));
}

/// The hold id a gateway whose properties are `properties` sends to the ledger.
fn first_hold_id(properties: &[(&[&str], &str)]) -> String {
    let mut s = spec(&redis_policy("deny").to_string()).start_time(at(MAR31_235950));
    for (path, value) in properties {
        s = s.property(path, value.as_bytes().to_vec());
    }
    let gw = Gateway::start(&plugin(), s).expect("the policy loads");
    let _c = Call::start(&gw, &key_headers(chat::PATH, "search-prod"), &chat_body(false, false, Some(100)));
    let reserve = calls_to(&gw, "/v1/reserve");
    body_of(&reserve[0])["id"].as_str().expect("id").to_string()
}

#[test]
fn hold_ids_start_with_the_hash_of_the_node_id_where_envoy_exposes_it() {
    let prefix = |node: &str| sluice_core::identity::sha256_hex(node.as_bytes())[..8].to_string();
    // Envoy 1.40: `xds.node.id` (its `node.id` answers nothing); older releases: `node.id`.
    let xds = first_hold_id(&[(&["xds", "node", "id"], "edge-1")]);
    assert!(xds.starts_with(&prefix("edge-1")), "{xds}");
    let legacy = first_hold_id(&[(&["node", "id"], "edge-2")]);
    assert!(legacy.starts_with(&prefix("edge-2")), "{legacy}");
    let both = first_hold_id(&[(&["xds", "node", "id"], "edge-3"), (&["node", "id"], "other")]);
    assert!(both.starts_with(&prefix("edge-3")), "{both}");
    // No node id at all: still unique per VM, with the hash of the empty id.
    let none = first_hold_id(&[]);
    assert!(none.starts_with(&prefix("")), "{none}");
}
