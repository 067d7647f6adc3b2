//! The binding crate's functions natively: compiling each plugin's policy (the shipped examples and
//! broken ones, with the plugin's own messages), and runs whose figures follow from the policies and
//! the service model by hand (docs/playground.md), not from the engine.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use sluice_playground::{compile_json, run, run_json, RunInput};
use std::path::Path;

fn read(rel: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn json(s: &str) -> Value {
    serde_json::from_str(s).unwrap()
}

#[test]
fn every_shipped_policy_compiles_with_its_plugins_summary() {
    let mut seen = 0;
    for entry in std::fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies")).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        let Some(plugin) = ["tenant-budget", "model-router", "latency-guard"].into_iter().find(|p| name.starts_with(&format!("{p}."))) else { continue };
        if name.ends_with(".schema.json") {
            continue;
        }
        let r = json(&compile_json(plugin, &read(&format!("policies/{name}"))));
        assert_eq!(r["ok"], true, "{name}: {r}");
        seen += 1;
    }
    assert!(seen >= 8, "{seen} policies");
    let r = json(&compile_json("tenant-budget", &read("policies/tenant-budget.full.json")));
    // Four keys; counters: acme org 1, assistants 1, acme key 2, batch-nightly 1, globex org 1 + key 2, bank org 1 + key 1.
    assert_eq!(r["summary"], "tenant-budget configured: 4 keys, 10 budget counters");
    let r = json(&compile_json("latency_guard", &read("policies/latency-guard.demo.json")));
    assert_eq!(r["summary"], "sluice latency-guard: configured (3 classes, 2 versions, 1 with a breaker)");
}

#[test]
fn broken_policies_give_the_plugins_message_with_the_field() {
    let mut budget = json(&read("policies/tenant-budget.full.json"));
    budget["orgs"][1]["teams"][0]["keys"][0]["budgets"][1]["usd"] = json!(-3);
    let r = json(&compile_json("tenant-budget", &budget.to_string()));
    assert_eq!(r["ok"], false);
    assert_eq!(r["error"], "orgs[1].teams[0].keys[0].budgets[1].usd: must be a finite amount 0–1000000000, got -3");
    assert_eq!(r["log"], format!("tenant-budget policy refused: {}", r["error"].as_str().unwrap()));

    let mut router = json(&read("policies/model-router.demo.json"));
    router["models"][0]["versions"][1]["colour"] = json!("blue");
    let r = json(&compile_json("model-router", &router.to_string()));
    let error = r["error"].as_str().unwrap();
    assert!(error.starts_with("model-router policy is not valid JSON: models[0].versions[1].colour: unknown field `colour`"), "{error}");
    assert_eq!(r["log"], format!("model-router policy refused: {error}"));

    let r = json(&compile_json("latency-guard", "{\"versions\": [}"));
    assert!(r["log"].as_str().unwrap().starts_with("sluice latency-guard: configuration refused: latency-guard policy is not valid JSON"), "{r}");
    let r = json(&compile_json("llm-metrics", "{}"));
    assert_eq!(r["error"], "playground input: unknown plugin \"llm-metrics\": tenant-budget, model-router or latency-guard");
}

#[test]
fn run_json_reports_policy_and_workload_errors() {
    let input = json!({"tenant_budget": "{\"identity\": {}, \"orgs\": []}", "workload": "{}"});
    let r = json(&run_json(&input.to_string()));
    assert_eq!(r["plugin"], "tenant-budget");
    assert_eq!(r["error"], "identity: name at least one source: api_key, header or jwt");
    let input = json!({"workload": "{\"duration_s\": -1}"});
    assert_eq!(json(&run_json(&input.to_string()))["error"], "workload, field `duration_s`: must be a number of seconds in (0, 86400], got -1");
    let input = json!({"workload": "{}", "trace": "{\"t_ms\": 0}"});
    assert_eq!(json(&run_json(&input.to_string()))["error"], "trace line 1, field `prompt_tokens`: missing");
    assert!(json(&run_json("{\"workload\": 3}"))["error"].as_str().unwrap().starts_with("playground input: invalid type"));
}

/// Estimate mode with no margin: a request of 100 prompt tokens (the simulator's prompt text is 4
/// characters a token plus 4 per message, so the estimate is exactly 100) and a limit of 50 reserves
/// 150 and, answered with 40 tokens, is charged 140. One a second, each answered in
/// 30 + 100/20000 s + 39 × 20 ms = 815 ms, so each is settled before the next: after k requests
/// 140·k is used, and the next fits while 140·k + 150 ≤ 1000, i.e. k ≤ 6: 7 admitted, then refused
/// for the rest of the minute, and admitted again in the next one.
#[test]
fn a_minute_budget_admits_exactly_what_fits_and_resets() {
    let budget = json!({
        "mode": "estimate", "estimate_margin_percent": 0, "identity": { "header": "x-sluice-tenant" },
        "orgs": [{ "id": "o", "teams": [{ "id": "t", "keys": [{ "id": "k", "budgets": [{ "window": "minute", "tokens": 1000 }] }] }] }]
    });
    let workload =
        json!({"duration_s": 70, "tenants": [{ "name": "k", "rate_per_s": 1, "prompt_tokens": 100, "output_tokens": 40, "max_tokens": 50, "stream": false }]});
    let out = run(&RunInput { tenant_budget: Some(budget.to_string()), latency_guard: None, model_router: None, workload: workload.to_string(), trace: None })
        .unwrap();
    assert_eq!(out.verdicts.len(), 70);
    let admitted: Vec<u64> = out.verdicts.iter().filter(|v| v.code.is_none()).map(|v| v.line).collect();
    assert_eq!(admitted, (1..=7).chain(61..=67).collect::<Vec<u64>>());
    let refused = out.verdicts.iter().find(|v| v.line == 8).unwrap();
    assert_eq!((refused.status, refused.code.as_deref(), refused.refused_by), (429, Some("key:k:minute:total_tokens"), Some("tenant-budget")));
    let first = &out.verdicts[0];
    assert_eq!((first.charged_input_tokens, first.charged_output_tokens, first.duration_ms), (100, 40, 815.0));
    assert_eq!(out.tenants[0].charged_tokens, 14 * 140);
    // The budget series: at 0 s the first request's 150 are reserved; 20 left once the 7 are settled.
    let b = &out.series.budgets[0];
    assert_eq!((b.code.as_str(), b.limit, b.remaining[0], b.remaining[30]), ("key:k:minute:total_tokens", 1000, 850, 20));
}

/// Sheddable traffic against an in-flight limit of 2: ten requests within a second, each running
/// 35 ms + 199 × 20 ms = 4.015 s, so the first two are admitted and the other eight shed.
#[test]
fn in_flight_shedding_refuses_beyond_the_limit() {
    let guard = json!({
        "tenant": { "header": "x-sluice-tenant" },
        "classes": [{ "name": "bulk", "priority": "sheddable", "tenants": ["*"] }],
        "versions": [{ "name": "llama-3-70b", "in_flight": { "limit": 2 } }]
    });
    let workload = json!({"duration_s": 1, "tenants": [{ "name": "x", "rate_per_s": 10, "prompt_tokens": 100, "output_tokens": 200 }]});
    let out = run(&RunInput { latency_guard: Some(guard.to_string()), model_router: None, tenant_budget: None, workload: workload.to_string(), trace: None })
        .unwrap();
    let codes: Vec<Option<&str>> = out.verdicts.iter().map(|v| v.code.as_deref()).collect();
    let mut expected = vec![None, None];
    expected.extend([Some("shed_in_flight"); 8]);
    assert_eq!(codes, expected);
    assert_eq!(out.verdicts[0].ttft_ms, Some(35.0));
    assert_eq!(out.verdicts[0].duration_ms, 4015.0);
    assert_eq!(out.verdicts[0].class.as_deref(), Some("bulk"));
}
