//! Shared by the tenant-budget tests: the compiled `sluice_tenant_budget.wasm`, policies built from a
//! small org / team / key hierarchy, instants next to calendar boundaries, and readers for what the
//! plugin leaves behind (ledger counters in shared data, the access-log stamp). Request and response
//! payloads come from [`super::llm`].

use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use sluice_core::budget::ledger::Counter;
use sluice_core::budget::Policy;
use sluice_host::{workspace_wasm, Gateway, Plugin, PluginSpec, Stream};

pub const NS: u64 = 1_000_000_000;

/// 2026-03-31T23:59:50Z: ten seconds before a minute, hour, day and calendar-month boundary.
pub const MAR31_235950: u64 = 1_775_001_590;
/// 2026-04-14T23:59:50Z: ten seconds before a month window with `reset_day: 15` ends.
pub const APR14_235950: u64 = 1_776_211_190;
/// 2026-03-31T12:00:30Z: 30 s before the minute ends, 3570 s before the hour ends.
pub const MAR31_120030: u64 = 1_774_958_430;

/// `sk-live-7f3a9c`, an API key whose SHA-256 is [`API_KEY_SHA256`].
pub const API_KEY: &str = "sk-live-7f3a9c";
pub const API_KEY_SHA256: &str = "8f4817c5641318858b88ae4863b4e02c02167601bf1963944b60fc0aec5d7b1a";
/// `sk-ant-api03-xyz` and its SHA-256.
pub const ANTHROPIC_KEY: &str = "sk-ant-api03-xyz";
pub const ANTHROPIC_KEY_SHA256: &str = "2b8fac756cc021a587248108797965f45b3f966993003a21b3800bad9c9f96a2";
/// base64url (no padding) of `{"sub":"alice","sluice_key":"search-dev"}`, as jwt_authn forwards it.
pub const JWT_PAYLOAD_SEARCH_DEV: &str = "eyJzdWIiOiJhbGljZSIsInNsdWljZV9rZXkiOiJzZWFyY2gtZGV2In0";

/// The compiled tenant-budget plugin (build it first with
/// `cargo build --release --target wasm32-wasip1 -p sluice-tenant-budget`).
pub fn plugin() -> Plugin {
    static PLUGIN: OnceLock<Plugin> = OnceLock::new();
    PLUGIN.get_or_init(|| Plugin::load(workspace_wasm(super::build_stem("sluice_tenant_budget"))).expect("the build compiles")).clone()
}

pub fn at(unix_s: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(unix_s)
}

/// A gateway running tenant-budget with `policy`, its clock at `unix_s`.
pub fn gateway_at(policy: &Value, unix_s: u64) -> Gateway {
    Gateway::start(&plugin(), spec(&policy.to_string()).start_time(at(unix_s)))
        .unwrap_or_else(|e| panic!("tenant-budget refused the policy: {e:#}\npolicy: {policy}"))
}

/// A gateway running tenant-budget with `policy` at 2026-03-31T23:59:50Z.
pub fn gateway(policy: &Value) -> Gateway {
    gateway_at(policy, MAR31_235950)
}

/// The error with which the plugin refuses `policy` at load (panics if it accepts it).
pub fn load_error(policy: &Value) -> String {
    match Gateway::start(&plugin(), spec(&policy.to_string())) {
        Ok(_) => panic!("the policy was accepted: {policy}"),
        Err(e) => format!("{e:#}"),
    }
}

/// Prices of the models the llm payloads use (USD per million tokens): gpt-4o 2.5 in / 10 out,
/// claude 3 in / 15 out.
pub fn prices() -> Value {
    json!([
        {"model": "gpt-4o*", "input_usd_per_mtok": 2.5, "output_usd_per_mtok": 10},
        {"model": "claude-*", "input_usd_per_mtok": 3, "output_usd_per_mtok": 15,
         "cached_input_usd_per_mtok": 0.3, "cache_creation_input_usd_per_mtok": 3.75}
    ])
}

/// A policy with one org `acme`, one team `search`, keys `search-prod` (with `key_budgets`) and
/// `search-dev` (no budgets of its own); keys named by the `x-sluice-key` header.
pub fn policy(org_budgets: Value, team_budgets: Value, key_budgets: Value) -> Value {
    json!({
        "identity": {"header": "x-sluice-key"},
        "prices": prices(),
        "orgs": [{
            "id": "acme",
            "budgets": org_budgets,
            "teams": [{
                "id": "search",
                "budgets": team_budgets,
                "keys": [
                    {"id": "search-prod", "budgets": key_budgets},
                    {"id": "search-dev"}
                ]
            }]
        }]
    })
}

/// `base` with the top-level members of `changes` added or replaced.
pub fn with(base: &Value, changes: Value) -> Value {
    let mut v = base.clone();
    if let (Some(o), Value::Object(c)) = (v.as_object_mut(), changes) {
        o.extend(c);
    }
    v
}

/// Request headers of an LLM call by key `key` (auth-filter header).
pub fn key_headers<'a>(path: &'a str, key: &'a str) -> Vec<(&'a str, &'a str)> {
    super::llm::headers(path, &[("x-sluice-key", key)])
}

/// The chat request of [`super::llm::chat::request`] with an output limit.
pub fn chat_body(stream: bool, include_usage: bool, max_tokens: Option<u64>) -> String {
    let mut v: Value = serde_json::from_str(&super::llm::chat::request(stream, include_usage)).expect("JSON");
    if let Some(n) = max_tokens {
        v["max_tokens"] = json!(n);
    }
    v.to_string()
}

/// Shared-data key of budget `n` (its position in `budgets`) of `level` `id` in the policy `gw`
/// runs: counters are named by what they count, not by position, so the policy says which.
pub fn store_key(gw: &Gateway, level: &str, id: &str, n: usize) -> String {
    let policy =
        Policy::from_json(&super::policy_of(&gw.configuration(), "tenant_budget")).unwrap_or_else(|e| panic!("the gateway's policy does not compile: {e}"));
    let owned: Vec<&str> =
        policy.counters.iter().filter(|c| c.level.as_str() == level && c.owner == id && !c.per_identity).map(|c| c.store_key.as_str()).collect();
    owned.get(n).map(|k| k.to_string()).unwrap_or_else(|| panic!("{level} {id} has {} budgets, not a budget {n}", owned.len()))
}

/// The ledger counter of budget `n` of `level` `id`, as stored.
pub fn counter(gw: &Gateway, level: &str, id: &str, n: usize) -> Counter {
    let key = store_key(gw, level, id, n);
    let bytes = gw.shared_data(&key).unwrap_or_else(|| panic!("no counter {key} in shared data"));
    Counter::decode(&bytes).unwrap_or_else(|| panic!("counter {key} does not decode"))
}

/// `(used, reserved)` of a counter.
pub fn used_reserved(gw: &Gateway, level: &str, id: &str, n: usize) -> (u64, u64) {
    let c = counter(gw, level, id, n);
    (c.used, c.reserved())
}

/// The counter as it stands at `now_s` for a window whose id is `window_id` (a counter of an older
/// window reads as empty, as the ledger rolls it on its next update).
pub fn counter_in_window(gw: &Gateway, level: &str, id: &str, n: usize, window_id: u64) -> Counter {
    let mut c = counter(gw, level, id, n);
    let minute = u32::try_from(gw.now_ns() / NS / 60).expect("minute");
    c.roll(window_id, minute, 10);
    c
}

/// The access-log stamp (`sluice_budget` filter state), parsed.
pub fn stamp(stream: &Stream<'_>) -> Value {
    let raw = stream.filter_state("sluice_budget").expect("the plugin wrote its access-log stamp");
    serde_json::from_slice(&raw).expect("the stamp is JSON")
}

/// The local reply's body, parsed.
pub fn reply_json(stream: &Stream<'_>) -> Value {
    let reply = stream.local_reply().expect("a local reply");
    serde_json::from_slice(&reply.body).expect("the reply body is JSON")
}

/// A response header the client received.
pub fn response_header(stream: &Stream<'_>, name: &str) -> Option<String> {
    stream.downstream_response_headers().and_then(|h| h.get(name).map(str::to_owned))
}

/// Cost in micro-USD of `input` / `output` gpt-4o tokens (2.5 and 10 USD per million), rounded up.
pub fn gpt4o_cost(input: u64, output: u64) -> u64 {
    (input * 2_500_000 + output * 10_000_000).div_ceil(1_000_000)
}

/// `sluice.budget.remaining.<level>.<id>.window.<w>.unit.<u>`
pub fn remaining(level: &str, id: &str, window: &str, unit: &str) -> String {
    format!("sluice.budget.remaining.{level}.{id}.window.{window}.unit.{unit}")
}

/// `sluice.budget.rejections_total.key.<k>.reason.<code>` (`:` → `_`).
pub fn rejections(key: &str, code: &str) -> String {
    format!("sluice.budget.rejections_total.key.{key}.reason.{}", code.replace(':', "_"))
}

/// `sluice.budget.charged_tokens_total` of key `key` in team `search`, org `acme`.
pub fn charged_tokens(key: &str, model_version: &str) -> String {
    format!("sluice.budget.charged_tokens_total.key.{key}.team.search.org.acme.model_version.{model_version}")
}

/// A policy as the build under test reads it ([`super::section_spec`]).
pub fn spec(policy: &str) -> PluginSpec {
    super::section_spec("tenant_budget", policy)
}
