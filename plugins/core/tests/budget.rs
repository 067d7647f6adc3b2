//! Budgets: policy validation, hierarchy, reservation and settlement, clamping, windows, and
//! concurrent admissions through a CAS store.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use sluice_core::budget::ledger::Counter;
use sluice_core::budget::{AdmitError, Demand, Policy};
use sluice_core::store::{MemoryStore, SharedStore, ThreadedStore};
use sluice_core::usage::Usage;
use std::sync::{Arc, Mutex};

const NS: u64 = 1_000_000_000;
/// 2026-03-31T23:59:50Z: ten seconds before a minute, day and month boundary.
const T0: u64 = 1_775_001_590 * NS;

fn policy(json: &str) -> Policy {
    Policy::from_json(json.as_bytes()).unwrap_or_else(|e| panic!("{e}"))
}

fn refused(json: &str) -> String {
    match Policy::from_json(json.as_bytes()) {
        Ok(_) => panic!("accepted: {json}"),
        Err(e) => e.to_string(),
    }
}

const ORG: &str = r#"{
  "identity": {"header": "x-sluice-key"},
  "prices": [{"model": "m*", "input_usd_per_mtok": 1.0, "output_usd_per_mtok": 4.0}],
  "clamp": {"enabled": CLAMP, "min_output_tokens": 10},
  "orgs": [{"id": "acme", "budgets": [{"window": "month", "usd": 0.01}],
    "teams": [
      {"id": "search", "budgets": [{"window": "minute", "tokens": 1000}],
       "keys": [{"id": "search-prod", "budgets": [{"window": "minute", "tokens": 5000}]},
                {"id": "search-dev", "budgets": [{"window": "day", "requests": 2}]}]},
      {"id": "ads", "keys": [{"id": "ads-batch", "budgets": [{"window": "minute", "tokens": 300, "count": "output"}]}]}]}]
}"#;

fn org(clamp: bool) -> Policy {
    policy(&ORG.replace("CLAMP", if clamp { "true" } else { "false" }))
}

fn demand(input: u64, output: u64) -> Demand {
    Demand { input_tokens: input, output_tokens: output, choices: 1, model: Some("m1".into()), identity: None }
}

fn usage(input: u64, output: u64) -> Usage {
    Usage { input_tokens: input, output_tokens: output, ..Usage::default() }
}

#[test]
fn a_request_must_fit_every_level_team_exhausted_while_key_has_room() {
    let p = org(false);
    let mut store = MemoryStore::default();
    let prod = p.key_by_id("search-prod").unwrap();
    let a = p.admit(&mut store, prod, &demand(300, 300), T0).unwrap();
    p.settle(&mut store, &a, &usage(300, 300), T0);
    // Team budget (1000/min) has 400 left; the key's own (5000/min) has 4400.
    match p.admit(&mut store, prod, &demand(300, 300), T0) {
        Err(AdmitError::Exceeded(r)) => {
            assert_eq!(p.counters[r.counter].code, "team:search:minute:total_tokens");
            assert_eq!((r.used, r.reserved, r.limit), (600, 0, 1000));
            assert_eq!(r.retry_after_s, 10, "the minute ends in 10 s");
        }
        other => panic!("{other:?}"),
    }
    // Nothing was left reserved by the refused attempt (the org and key leases were rolled back).
    let b = p.admit(&mut store, prod, &demand(200, 200), T0).unwrap();
    assert_eq!(b.leases.len(), 3, "org, team and key budgets");
}

#[test]
fn reservation_then_refund_to_the_actual_charge() {
    let p = org(false);
    let mut store = MemoryStore::default();
    let prod = p.key_by_id("search-prod").unwrap();
    let a = p.admit(&mut store, prod, &demand(100, 800), T0).unwrap();
    assert_eq!(a.after[1].reserved(), 900, "team counter holds the worst case");
    let s = p.settle(&mut store, &a, &usage(100, 50), T0 + NS);
    assert_eq!(s.after[1].as_ref().unwrap().committed(), 150, "only the actual charge remains");
    assert_eq!(s.over_estimates[1], 750);
    // Money: 100 × $1/M + 50 × $4/M = 300 µUSD.
    assert_eq!(s.micro_usd, 300);
    assert_eq!(s.after[0].as_ref().unwrap().used, 300);
}

#[test]
fn clamping_lowers_the_output_limit_to_what_the_budget_can_pay() {
    let p = org(true);
    let mut store = MemoryStore::default();
    let prod = p.key_by_id("search-prod").unwrap();
    let a = p.admit(&mut store, prod, &demand(100, 700), T0).unwrap();
    p.settle(&mut store, &a, &usage(100, 700), T0);
    // 200 team tokens left: 100 input + at most 100 output.
    let b = p.admit(&mut store, prod, &demand(100, 500), T0).unwrap();
    assert!(b.clamped);
    assert_eq!(b.output_tokens, 100);
    // Below min_output_tokens (10) it is refused instead.
    p.settle(&mut store, &b, &usage(100, 95), T0);
    assert!(matches!(p.admit(&mut store, prod, &demand(0, 500), T0), Err(AdmitError::Exceeded(_))));
}

#[test]
fn requests_and_output_only_budgets_count_their_own_unit() {
    let p = org(false);
    let mut store = MemoryStore::default();
    let dev = p.key_by_id("search-dev").unwrap();
    for _ in 0..2 {
        let a = p.admit(&mut store, dev, &demand(1, 1), T0).unwrap();
        p.settle(&mut store, &a, &usage(1, 1), T0);
    }
    assert!(matches!(p.admit(&mut store, dev, &demand(1, 1), T0), Err(AdmitError::Exceeded(_))));
    let ads = p.key_by_id("ads-batch").unwrap();
    // 300 output tokens a minute, input free.
    let a = p.admit(&mut store, ads, &demand(5000, 300), T0).unwrap_or_else(|e| panic!("{e:?}"));
    p.settle(&mut store, &a, &usage(5000, 300), T0);
}

#[test]
fn a_request_straddling_the_minute_is_charged_to_its_admission_window() {
    let p = org(false);
    let mut store = MemoryStore::default();
    let prod = p.key_by_id("search-prod").unwrap();
    let a = p.admit(&mut store, prod, &demand(100, 800), T0).unwrap();
    // Settles 20 s later, in the next minute: the new minute starts empty and stays so.
    let s = p.settle(&mut store, &a, &usage(100, 800), T0 + 20 * NS);
    let team = s.after[1].as_ref().unwrap();
    assert_eq!((team.used, team.reserved()), (0, 0));
    // The month (also rolled over at midnight) starts empty too.
    let org = s.after[0].as_ref().unwrap();
    assert_eq!(org.used, 0);
    assert!(p.admit(&mut store, prod, &demand(100, 890), T0 + 20 * NS).is_ok());
}

#[test]
fn money_budget_without_a_price_is_refused() {
    let p = org(false);
    let mut store = MemoryStore::default();
    let prod = p.key_by_id("search-prod").unwrap();
    let d = Demand { input_tokens: 1, output_tokens: 1, choices: 1, model: Some("unknown-model".into()), identity: None };
    assert!(matches!(p.admit(&mut store, prod, &d, T0), Err(AdmitError::Unpriced { .. })));
}

#[test]
fn policy_errors_name_the_field() {
    assert!(refused(r#"{"identity":{},"orgs":[]}"#).starts_with("identity: name at least one source"));
    let base =
        |budget: &str| format!(r#"{{"identity":{{"header":"x"}},"orgs":[{{"id":"o","teams":[{{"id":"t","keys":[{{"id":"k","budgets":[{budget}]}}]}}]}}]}}"#);
    assert!(refused(&base(r#"{"window":"week","tokens":1}"#)).contains("unknown variant `week`"));
    assert!(refused(&base(r#"{"window":"minute"}"#)).starts_with("orgs[0].teams[0].keys[0].budgets[0]: set exactly one of"));
    assert!(refused(&base(r#"{"window":"minute","tokens":1,"usd":1}"#)).contains("exactly one"));
    assert!(refused(&base(r#"{"window":"month","usd":1,"reset_day":31}"#)).contains("reset_day: must be 1–28"));
    assert!(refused(&base(r#"{"window":"day","usd":-1}"#)).contains("usd: must be a finite amount"));
    assert!(refused(&base(r#"{"window":"day","tokens":1,"count":"total","input_weight":2}"#)).contains("not both"));
    assert!(refused(&base(r#"{"window":"day","requests":1,"count":"input"}"#)).contains("tokens budgets only"));
    assert!(refused(&base(r#"{"window":"day","tokens":1,"soft_limit_percent":0}"#)).contains("soft_limit_percent"));
    assert!(refused(&base(r#"{"window":"day","tokens":1,"typo":1}"#)).contains("unknown field `typo`"));
    let dup = r#"{"identity":{"header":"x"},"orgs":[{"id":"o","teams":[{"id":"t","keys":[{"id":"k"},{"id":"k"}]}]}]}"#;
    assert!(refused(dup).contains("defined twice"));
    let bad_hash = r#"{"identity":{"api_key":true},"orgs":[{"id":"o","teams":[{"id":"t","keys":[{"id":"k","api_key_sha256":"abc"}]}]}]}"#;
    assert!(refused(bad_hash).contains("api_key_sha256: must be 64 hex digits"));
    let unknown = r#"{"identity":{"header":"x"},"unknown":{"action":"default","key":"nobody"},"orgs":[{"id":"o","teams":[{"id":"t","keys":[{"id":"k"}]}]}]}"#;
    assert!(refused(unknown).starts_with("unknown.key:"));
    assert!(refused(r#"{"identity":{"header":"x"},"orgs":[{"id":"o.x"}]}"#).starts_with("orgs[0].id:"));
}

#[test]
fn concurrent_admissions_never_overshoot_in_strict_mode() {
    // Repeated: interleavings differ from run to run.
    for _ in 0..5 {
        concurrent_run();
    }
}

fn concurrent_run() {
    let p = Arc::new(org(true));
    let mut store = ThreadedStore::default();
    // As the plugin does at configure time: every later update is then a real CAS.
    assert_eq!(p.ensure_counters(&mut store).unwrap(), p.counters.len());
    let prod = p.key_by_id("search-prod").unwrap();
    let charged = Arc::new(Mutex::new(0u64));
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let (p, mut store, charged) = (p.clone(), store.clone(), charged.clone());
            std::thread::spawn(move || {
                for i in 0..200u64 {
                    let (input, output) = (10 + (t * 7 + i) % 40, 20 + (i * 13 + t) % 60);
                    if let Ok(a) = p.admit(&mut store, prod, &demand(input, output), T0) {
                        // Actual usage never exceeds the (possibly clamped) grant: strict mode's guarantee.
                        let actual_out = a.output_tokens.saturating_sub((i % 3) * 5);
                        p.settle(&mut store, &a, &usage(input, actual_out), T0);
                        *charged.lock().unwrap() += input + actual_out;
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let team_key = &p.counters[p.keys[prod].counters[1]].store_key;
    let team = Counter::decode(&store.get(team_key).unwrap().0.unwrap()).unwrap();
    let total = *charged.lock().unwrap();
    assert_eq!(team.used, total, "every settled charge is in the ledger, none lost or doubled");
    assert_eq!(team.reserved(), 0);
    assert!(total <= 1000, "team budget overshot: {total}");
    assert!(total >= 900, "admissions stopped far below the limit: {total}");
}

#[test]
fn the_shipped_policies_are_valid() {
    for name in ["tenant-budget.example.json", "tenant-budget.e2e.json", "tenant-budget.bench.json"] {
        let path = format!("{}/../../policies/{name}", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).unwrap();
        let p = Policy::from_json(text.as_bytes()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(!p.keys.is_empty(), "{name}");
    }
    let p = policy(&std::fs::read_to_string(format!("{}/../../policies/tenant-budget.example.json", env!("CARGO_MANIFEST_DIR"))).unwrap());
    assert_eq!(p.keys.len(), 10);
    // "test" hashes to 9f86…0a08: the staging key.
    let staging = p.key_by_api_key_hash(&sluice_core::identity::sha256_hex(b"test")).unwrap();
    assert_eq!(p.keys[staging].id, "search-staging");
    assert_eq!(p.keys[staging].counters.len(), 1 + 2 + 2, "org, team and key budgets");
}

#[test]
fn cut_off_streams_is_refused_not_silently_ignored() {
    let json = r#"{"identity":{"header":"x"},"cut_off_streams":true,"orgs":[{"id":"o","teams":[{"id":"t","keys":[{"id":"k"}]}]}]}"#;
    assert!(refused(json).starts_with("cut_off_streams: not supported yet"));
}

/// A request for several generations reserves the output of every one of them: three concurrent
/// `n: 8, max_tokens: 60` requests cannot overshoot a 600 tokens/minute budget.
#[test]
fn several_choices_reserve_every_generation() {
    let p = policy(
        r#"{"identity": {"header": "k"}, "orgs": [{"id": "o", "teams": [{"id": "t",
            "keys": [{"id": "k1", "budgets": [{"window": "minute", "tokens": 600}]}]}]}]}"#,
    );
    let mut store = MemoryStore::default();
    let k = p.key_by_id("k1").unwrap();
    let many = Demand { input_tokens: 36, output_tokens: 60, choices: 8, model: None, identity: None };
    assert_eq!(many.reserved_output_tokens(), 480);
    let a = p.admit(&mut store, k, &many, T0).unwrap();
    assert_eq!((a.output_tokens, a.choices, a.reserved_output_tokens()), (60, 8, 480));
    assert_eq!(a.after[0].reserved(), 36 + 480);
    // The second (and third) concurrent one no longer fits: 516 + 516 > 600.
    assert!(matches!(p.admit(&mut store, k, &many, T0), Err(AdmitError::Exceeded(_))));
    // Settled at what all eight generations produced.
    let s = p.settle(&mut store, &a, &usage(36, 8 * 60), T0);
    assert_eq!(s.after[0].as_ref().unwrap().committed(), 516);
}

/// Clamping lowers the per-generation limit so that all generations together fit.
#[test]
fn clamping_divides_the_room_between_generations() {
    let p = policy(
        r#"{"identity": {"header": "k"}, "clamp": {"enabled": true, "min_output_tokens": 10},
            "orgs": [{"id": "o", "teams": [{"id": "t",
            "keys": [{"id": "k1", "budgets": [{"window": "minute", "tokens": 600}]}]}]}]}"#,
    );
    let mut store = MemoryStore::default();
    let k = p.key_by_id("k1").unwrap();
    let a = p.admit(&mut store, k, &Demand { input_tokens: 100, output_tokens: 200, choices: 4, model: None, identity: None }, T0).unwrap();
    // 500 tokens of room after the prompt, shared by 4 generations: 125 each.
    assert!(a.clamped);
    assert_eq!((a.output_tokens, a.reserved_output_tokens()), (125, 500));
    assert_eq!(a.after[0].reserved(), 600);
}

/// Two budgets of one owner that count the same thing over the same window could not be told apart
/// in metrics or refusals: refused at load, naming both.
#[test]
fn budgets_counting_the_same_thing_in_one_window_are_refused() {
    let two = |a: &str, b: &str| {
        format!(
            r#"{{"identity": {{"header": "k"}}, "orgs": [{{"id": "o", "teams": [{{"id": "t",
                "keys": [{{"id": "load-4", "budgets": [{a}, {b}]}}]}}]}}]}}"#
        )
    };
    let e = refused(&two(r#"{"window": "day", "tokens": 3000, "count": "output"}"#, r#"{"window": "day", "tokens": 9000, "count": "output"}"#));
    assert!(e.contains("budgets[1]") && e.contains("output_tokens") && e.contains("budgets[0]"), "{e}");
    // Different measures in one window are distinct budgets, with distinct codes.
    let p = policy(&two(r#"{"window": "day", "tokens": 3000, "count": "output"}"#, r#"{"window": "day", "tokens": 200000}"#));
    let codes: Vec<&str> = p.counters.iter().map(|c| c.code.as_str()).collect();
    assert_eq!(codes, ["key:load-4:day:output_tokens", "key:load-4:day:total_tokens"]);
    let weighted = policy(&two(r#"{"window": "day", "tokens": 3000, "input_weight": 1, "output_weight": 4}"#, r#"{"window": "day", "requests": 10}"#));
    assert_eq!(weighted.counters[0].code, "key:load-4:day:weighted_tokens");
}

const IDENTITY_POLICY: &str = r#"{
  "identity": {"header": "x-key", "per_identity": {"header": "x-user"}},
  "ledger": {"mode": "redis", "cluster": "sluice_ledger", "replicas": 4},
  "orgs": [{"id": "acme", "teams": [{"id": "search",
    "budgets": [{"window": "minute", "tokens": 100000}],
    "identity_budgets": [{"window": "day", "tokens": 1000}],
    "keys": [{"id": "k1"}]}]}]
}"#;

fn with_identity(input: u64, output: u64, who: Option<&str>) -> Demand {
    Demand { input_tokens: input, output_tokens: output, choices: 1, model: None, identity: who.map(sluice_core::budget::identities::identity_hash) }
}

/// Every identity gets the template budget on its own; requests without one share `anonymous`.
#[test]
fn identity_budgets_limit_each_identity_on_its_own_in_the_local_ledger() {
    let p = policy(IDENTITY_POLICY);
    let mut store = MemoryStore::default();
    p.ensure_counters(&mut store).unwrap();
    let k = p.key_by_id("k1").unwrap();
    let code = |e: AdmitError| match e {
        AdmitError::Exceeded(r) => p.counters[r.counter].code.clone(),
        other => panic!("{other:?}"),
    };
    for user in ["alice", "bob"] {
        p.admit(&mut store, k, &with_identity(500, 500, Some(user)), T0).unwrap();
        let e = p.admit(&mut store, k, &with_identity(1, 0, Some(user)), T0).unwrap_err();
        assert_eq!(code(e), "team:search:day:total_tokens:per_identity", "{user}");
    }
    p.admit(&mut store, k, &with_identity(1000, 0, None), T0).unwrap();
    assert!(p.admit(&mut store, k, &with_identity(1, 0, None), T0).is_err(), "anonymous is one identity");
    // The team budget saw all of it.
    let team = p.counters.iter().position(|c| c.code == "team:search:minute:total_tokens").unwrap();
    let (bytes, _) = store.get(&p.counters[team].store_key).unwrap();
    assert_eq!(Counter::decode(&bytes.unwrap()).unwrap().reserved(), 3000);
}

/// The Redis ledger's side: the reserve body names every counter (per-identity ones per identity,
/// each in its window), the answer becomes an admission held remotely, a refusal names its budget.
#[test]
fn remote_reserve_and_settle_bodies_follow_the_wire_contract() {
    use sluice_core::budget::identities::identity_hash;
    let p = policy(IDENTITY_POLICY);
    let k = p.key_by_id("k1").unwrap();
    let pending = p.remote_reserve(k, &with_identity(100, 50, Some("alice")), T0, "req-1").unwrap();
    let body: serde_json::Value = serde_json::from_slice(&pending.body).unwrap();
    let minute = T0 / NS / 60;
    let day = T0 / NS / 86_400;
    let alice = identity_hash("alice");
    assert_eq!(
        body,
        serde_json::json!({"id": "req-1", "tag": "acme", "hold_ttl_s": 600, "counters": [
            {"key": format!("team:search:minute:total_tokens:w{minute}"), "limit": 100000, "amount": 150, "expire_at_s": (minute + 1) * 60 + 600},
            {"key": format!("team:search:day:total_tokens:per_identity:{alice}:w{day}"), "limit": 1000, "amount": 150, "expire_at_s": (day + 1) * 86_400 + 600},
        ]})
    );
    let reply = br#"{"admitted": true, "replayed": false, "counters": [{"used": 10, "reserved": 150}, {"used": 0, "reserved": 150}]}"#;
    let a = p.remote_admission(&pending, 200, reply).unwrap();
    assert_eq!(a.remote.as_ref().map(|h| (h.id.as_str(), h.tag.as_str())), Some(("req-1", "acme")));
    assert_eq!((a.after[0].used, a.after[0].committed()), (10, 160));
    let (settle, s) = p.remote_settle(&a, &usage(100, 20)).unwrap();
    assert_eq!(serde_json::from_slice::<serde_json::Value>(&settle).unwrap(), serde_json::json!({"id": "req-1", "tag": "acme", "charges": [120, 120]}));
    assert_eq!(s.over_estimates, vec![30, 30]);

    let refused = br#"{"admitted": false, "refused": 1, "used": 990, "reserved": 0, "limit": 1000}"#;
    match p.remote_admission(&pending, 200, refused) {
        Err(AdmitError::Exceeded(r)) => {
            assert_eq!(p.counters[r.counter].code, "team:search:day:total_tokens:per_identity");
            assert_eq!((r.used, r.limit, r.retry_after_s), (990, 1000, 10));
        }
        other => panic!("{other:?}"),
    }
    for (status, body) in [(503, &b"{}"[..]), (200, b"not json"), (200, br#"{"admitted": true, "counters": []}"#), (200, br#"{"admitted": false}"#)] {
        assert!(matches!(p.remote_admission(&pending, status, body), Err(AdmitError::Store(_))), "{status} {}", String::from_utf8_lossy(body));
    }
}

/// `on_failure: local` divides every limit by the replicas sharing it.
#[test]
fn the_local_fallback_divides_limits_by_the_replicas() {
    let p = policy(IDENTITY_POLICY);
    let mut store = MemoryStore::default();
    p.ensure_counters(&mut store).unwrap();
    let k = p.key_by_id("k1").unwrap();
    // 1000 / 4 = 250 per process for the identity budget.
    p.admit_fallback(&mut store, k, &with_identity(250, 0, Some("carol")), T0).unwrap();
    assert!(p.admit_fallback(&mut store, k, &with_identity(1, 0, Some("carol")), T0).is_err());
}

#[test]
fn ledger_and_identity_settings_are_validated() {
    let base =
        |extra: &str| format!(r#"{{"identity": {{"header": "k"}}, {extra} "orgs": [{{"id": "o", "teams": [{{"id": "t", "keys": [{{"id": "k"}}]}}]}}]}}"#);
    assert!(refused(&base(r#""ledger": {"mode": "redis"},"#)).contains("ledger.cluster"));
    assert!(refused(&base(r#""ledger": {"mode": "redis", "cluster": "c", "replicas": 0},"#)).contains("ledger.replicas"));
    assert!(refused(&base(r#""ledger": {"mode": "local", "timeout_ms": 0},"#)).contains("ledger.timeout_ms"));
    assert!(refused(&base(r#""ledger": {"mode": "remote"},"#)).contains("ledger.mode"));
    assert!(refused(&base(r#""max_local_identities": 1,"#)).contains("max_local_identities"));
    let no_source = r#"{"identity": {"header": "k"}, "orgs": [{"id": "o", "identity_budgets": [{"window": "day", "tokens": 1}], "teams": [{"id": "t", "keys": [{"id": "k"}]}]}]}"#;
    assert!(refused(no_source).contains("identity.per_identity"));
}
