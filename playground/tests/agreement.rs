//! The playground's verdicts against the simulator's (sluice-sim, which runs the production .wasm
//! plugins in sluice-host on a virtual clock) for the same policies and workload: the workload's
//! requests go to the simulator as the generic JSONL trace the page exports, and every request's
//! decision, refusal code, version and shadow version must agree, as must each key's charged tokens.
//! Needs the plugins built: `cargo xtask build` (target/wasm32-wasip1/release/).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use sluice_playground::engine::{RequestVerdict, Verdict};
use sluice_playground::workload::{to_generic_jsonl, Workload};
use sluice_playground::{run, RunInput};
use sluice_sim::engine::{Engine, Plugins, RunOptions};
use sluice_sim::scenario::Scenario;
use sluice_sim::trace::{ReaderOptions, TraceReader};
use sluice_sim::verdict::{Decision, Verdict as SimVerdict};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The simulator's run of `input` (its policies, upstream model, incidents, traffic defaults),
/// llm-metrics in the chain as in every shipped gateway.
fn simulate(input: &RunInput) -> Vec<SimVerdict> {
    let workload = Workload::from_json(&input.workload).unwrap();
    let mut plugins = serde_json::Map::new();
    for (name, text) in [("latency_guard", &input.latency_guard), ("model_router", &input.model_router), ("tenant_budget", &input.tenant_budget)] {
        if let Some(t) = text {
            plugins.insert(name.into(), serde_json::from_str::<Value>(t).unwrap());
        }
    }
    plugins.insert("llm_metrics".into(), serde_json::from_str::<Value>(&read("policies/llm-metrics.demo.json")).unwrap());
    let w: Value = serde_json::from_str(&input.workload).unwrap();
    let mut traffic = w.get("traffic").cloned().unwrap_or(json!({}));
    traffic.as_object_mut().unwrap().remove("tenants");
    let scenario = json!({
        "seed": workload.seed,
        "plugins": plugins,
        "traffic": traffic,
        "upstream": w.get("upstream").cloned().unwrap_or(json!({})),
        "incidents": w.get("incidents").cloned().unwrap_or(json!([])),
        "whole_milliseconds": workload.whole_milliseconds,
        "tokens_per_event": 16,
    });
    let scenario = Scenario::parse(&scenario.to_string(), &root().join("examples/playground/agreement.scenario.json")).unwrap_or_else(|e| panic!("{e}"));
    let dir = sluice_host::workspace_target_dir().join("wasm32-wasip1").join("release");
    let compiled = Plugins::load(&dir).expect("build the plugins first: cargo xtask build");
    let trace = match &input.trace {
        Some(t) => t.clone(),
        None => to_generic_jsonl(&workload.synthetic().unwrap()),
    };
    let reader = TraceReader::new(std::io::Cursor::new(trace.into_bytes()), ReaderOptions::default());
    let requests: Vec<_> = reader.map(|r| r.unwrap()).collect();
    let engine = Engine::new(&scenario, &compiled, &RunOptions { start_ns: workload.start_unix_ms * 1_000_000 }).unwrap();
    let mut out = Vec::new();
    engine
        .run(
            requests.into_iter(),
            |v| {
                out.push(v);
                Ok(())
            },
            |_| {},
        )
        .unwrap();
    out.sort_by_key(|v| v.line);
    out
}

type Key = (&'static str, Option<String>, Option<String>, Option<String>);

fn ours(v: &RequestVerdict) -> Key {
    let d = match v.decision {
        Verdict::Admitted => "admitted",
        Verdict::Clamped => "clamped",
        Verdict::Refused => "refused",
    };
    (d, v.code.clone(), v.version.clone(), v.shadow_version.clone())
}

fn theirs(v: &SimVerdict) -> Key {
    let d = match v.decision {
        Decision::Admitted => "admitted",
        Decision::Clamped => "clamped",
        Decision::Refused => "refused",
    };
    (d, v.code.clone(), v.version.clone(), v.shadow_version.clone())
}

/// Compares request by request; returns (agreeing, total) after printing every difference.
fn compare(input: &RunInput) -> (usize, usize, BTreeMap<String, u64>) {
    let played = run(input).unwrap();
    let simulated = simulate(input);
    assert_eq!(played.verdicts.len(), simulated.len(), "both see every request");
    let mut agree = 0;
    for (p, s) in played.verdicts.iter().zip(&simulated) {
        assert_eq!(p.line, s.line);
        if ours(p) == theirs(s) {
            agree += 1;
        } else {
            eprintln!("line {} at {} ms ({:?}): playground {:?}, simulator {:?}", p.line, p.arrival_ms, p.tenant, ours(p), theirs(s));
        }
    }
    // Charged tokens per key, from tenant-budget's own stamps in the simulator.
    let mut ours_charged: BTreeMap<String, u64> = BTreeMap::new();
    let mut sim_charged: BTreeMap<String, u64> = BTreeMap::new();
    for v in &played.verdicts {
        if let Some(k) = &v.key {
            *ours_charged.entry(k.clone()).or_default() += v.charged_input_tokens + v.charged_output_tokens;
        }
    }
    for v in &simulated {
        let charged = v.stamps.budget.as_ref().and_then(|b| b.u64("charged_tokens")).unwrap_or(0);
        if let Some(k) = &v.key {
            *sim_charged.entry(k.clone()).or_default() += charged;
        }
    }
    assert_eq!(ours_charged, sim_charged, "charged tokens per key");
    let mut decisions: BTreeMap<String, u64> = BTreeMap::new();
    for v in &played.verdicts {
        *decisions.entry(format!("{}{}", v.decision.as_str(), v.code.as_ref().map(|c| format!(" {c}")).unwrap_or_default())).or_default() += 1;
    }
    (agree, played.verdicts.len(), decisions)
}

#[test]
fn the_page_example_agrees_with_the_simulator() {
    let input = RunInput {
        latency_guard: Some(read("policies/latency-guard.demo.json")),
        model_router: Some(read("policies/model-router.demo.json")),
        tenant_budget: Some(read("policies/tenant-budget.full.json")),
        workload: read("examples/playground/example.workload.json"),
        trace: None,
    };
    let (agree, total, decisions) = compare(&input);
    eprintln!("example: {agree} of {total} verdicts agree; {decisions:?}");
    // The example exercises what it is meant to: each kind of refusal, and admissions.
    for kind in ["admitted", "refused unknown_key", "refused key:globex:minute:total_tokens", "refused shed_breaker_open"] {
        assert!(decisions.get(kind).is_some_and(|&n| n > 0), "no {kind} in {decisions:?}");
    }
    assert_eq!(agree, total);
}

#[test]
fn a_sticky_split_and_clamped_budgets_agree_with_the_simulator() {
    // 70/30 sticky per user, streamed and whole answers, a minute budget that clamps and refuses.
    let router = json!({
        "sticky_key": [{ "property": ["metadata", "filter_metadata", "sluice", "user"] }],
        "models": [{ "model": "llama-3-70b", "versions": [
            { "name": "v1", "weight": 70, "upstream_model": "llama-3-70b", "route": "llama-v1" },
            { "name": "v2", "weight": 30, "upstream_model": "llama-3-70b-v2", "route": "llama-v2" }]}]
    });
    let budget = json!({
        "mode": "estimate", "estimate_margin_percent": 0, "identity": { "header": "x-sluice-tenant" },
        "clamp": { "enabled": true, "min_output_tokens": 32 },
        "prices": [{ "model": "llama-3-70b*", "input_usd_per_mtok": 0.59, "output_usd_per_mtok": 0.79 }],
        "orgs": [{ "id": "o", "teams": [{ "id": "t", "keys": [
            { "id": "alpha", "budgets": [{ "window": "minute", "tokens": 40000 }] },
            { "id": "beta", "budgets": [{ "window": "minute", "requests": 25 }] }]}]}]
    });
    let workload = json!({
        "duration_s": 90,
        "tenants": [
            { "name": "alpha", "rate_per_s": 1.5, "prompt_tokens": 600, "output_tokens": 250, "max_tokens": 300, "users": 12 },
            { "name": "beta", "rate_per_s": 0.8, "prompt_tokens": 300, "output_tokens": 90, "stream": false, "users": 7 }
        ]
    });
    let input = RunInput {
        latency_guard: None,
        model_router: Some(router.to_string()),
        tenant_budget: Some(budget.to_string()),
        workload: workload.to_string(),
        trace: None,
    };
    let (agree, total, decisions) = compare(&input);
    eprintln!("split: {agree} of {total} verdicts agree; {decisions:?}");
    for kind in ["admitted", "clamped", "refused key:beta:minute:requests"] {
        assert!(decisions.get(kind).is_some_and(|&n| n > 0), "no {kind} in {decisions:?}");
    }
    let played = run(&input).unwrap();
    let v2 = played.verdicts.iter().filter(|v| v.version.as_deref() == Some("v2")).count();
    assert!(v2 > 0 && v2 < total, "both versions get traffic: {v2} of {total} on v2");
    assert_eq!(agree, total);
}
