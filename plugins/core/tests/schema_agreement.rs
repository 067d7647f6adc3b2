//! The JSON Schemas in `policies/` and the docs pages agree with the configuration types of
//! tenant-budget, model-router and latency-guard (and with the price entries they share with
//! llm-metrics), in both directions; and every shipped example policy validates against its schema
//! and is accepted by the plugin's own parser. See `schema_check/mod.rs` for what is compared.
//! (llm-metrics: plugins/llm-metrics/tests/schema_agreement.rs.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod schema_check;

use schema_check::{assert_none, compare, compare_docs, examples, read_json, violations, DocSection, Documents};
use serde_json::Value;
use sluice_core::budget::policy::PolicyConfig;
use sluice_core::budget::Policy;
use sluice_core::latency::policy::LatencyPolicyConfig;
use sluice_core::latency::LatencyPolicy;
use sluice_core::routing::policy::RoutingConfig;
use sluice_core::routing::RoutingPolicy;

/// The generated schema of `T`, and the shipped one, reduced and compared.
fn schema_disagreements<T: schemars::JsonSchema>(shipped: &str) -> Vec<String> {
    let generated = serde_json::to_value(schemars::schema_for!(T)).unwrap();
    let docs = Documents::new(("(code)", generated));
    compare(&docs.shape("(code)"), &docs.shape(shipped))
}

fn docs_disagreements<T: schemars::JsonSchema>(sections: &[DocSection]) -> Vec<String> {
    let generated = serde_json::to_value(schemars::schema_for!(T)).unwrap();
    let docs = Documents::new(("(code)", generated));
    compare_docs(&docs.shape("(code)"), sections)
}

/// Every `policies/<plugin>.*.json` validates against `policies/<plugin>.schema.json` and `load`
/// accepts it.
fn examples_disagreements(plugin: &str, load: &dyn Fn(&[u8]) -> Result<(), String>) -> Vec<String> {
    let validator = schema_check::validator(&format!("{plugin}.schema.json"));
    let mut out = Vec::new();
    for path in examples(plugin) {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let instance: Value = read_json(&path);
        out.extend(violations(&validator, &instance).into_iter().map(|v| format!("{name}: schema: {v}")));
        if let Err(e) = load(&std::fs::read(&path).unwrap()) {
            out.push(format!("{name}: refused by the plugin: {e}"));
        }
    }
    out
}

/// Every numeric member of every `policies/<plugin>.*.json` (and every numeric member with a
/// default it leaves out), at the bounds the shipped schema states and just past them: the schema
/// and `load` accept and refuse the same values.
fn range_disagreements(plugin: &str, load: &dyn Fn(&[u8]) -> Result<(), String>, cross_field: &[&str]) -> Vec<String> {
    let schema = format!("{plugin}.schema.json");
    let validator = schema_check::validator(&schema);
    let shipped = Documents::new(("(none)", Value::Null)).shape(&schema);
    let mut out = Vec::new();
    for path in examples(plugin) {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let example = read_json(&path);
        out.extend(schema_check::boundary_disagreements(&shipped, &validator, &example, load, cross_field).into_iter().map(|d| format!("{name}: {d}")));
    }
    out.sort();
    out.dedup();
    out
}

const TENANT_BUDGET_DOCS: &[DocSection] = &[
    DocSection { file: "tenant-budget.md", from: Some("## Policy") },
    // `prices` is documented once, with llm-metrics.
    DocSection { file: "configuration.md", from: Some("## Prices") },
];
const MODEL_ROUTER_DOCS: &[DocSection] = &[DocSection { file: "model-router.md", from: Some("## Policy") }];
const LATENCY_GUARD_DOCS: &[DocSection] = &[DocSection { file: "latency-guard.md", from: Some("## Policy") }];

#[test]
fn tenant_budget_schema_matches_the_code() {
    assert_none("policies/tenant-budget.schema.json vs PolicyConfig", &schema_disagreements::<PolicyConfig>("tenant-budget.schema.json"));
}

#[test]
fn tenant_budget_docs_match_the_code() {
    assert_none("docs/tenant-budget.md vs PolicyConfig", &docs_disagreements::<PolicyConfig>(TENANT_BUDGET_DOCS));
}

#[test]
fn tenant_budget_examples_validate_and_load() {
    assert_none("policies/tenant-budget.*.json", &examples_disagreements("tenant-budget", &|b| Policy::from_json(b).map(drop).map_err(|e| e.to_string())));
}

#[test]
fn model_router_schema_matches_the_code() {
    assert_none("policies/model-router.schema.json vs RoutingConfig", &schema_disagreements::<RoutingConfig>("model-router.schema.json"));
}

#[test]
fn model_router_docs_match_the_code() {
    assert_none("docs/model-router.md vs RoutingConfig", &docs_disagreements::<RoutingConfig>(MODEL_ROUTER_DOCS));
}

#[test]
fn model_router_examples_validate_and_load() {
    assert_none("policies/model-router.*.json", &examples_disagreements("model-router", &|b| RoutingPolicy::from_json(b).map(drop).map_err(|e| e.to_string())));
}

#[test]
fn latency_guard_schema_matches_the_code() {
    assert_none("policies/latency-guard.schema.json vs LatencyPolicyConfig", &schema_disagreements::<LatencyPolicyConfig>("latency-guard.schema.json"));
}

#[test]
fn latency_guard_docs_match_the_code() {
    assert_none("docs/latency-guard.md vs LatencyPolicyConfig", &docs_disagreements::<LatencyPolicyConfig>(LATENCY_GUARD_DOCS));
}

#[test]
fn latency_guard_examples_validate_and_load() {
    assert_none(
        "policies/latency-guard.*.json",
        &examples_disagreements("latency-guard", &|b| LatencyPolicy::from_json(b).map(drop).map_err(|e| e.to_string())),
    );
}

#[test]
fn tenant_budget_schema_ranges_match_the_code() {
    let load = |b: &[u8]| Policy::from_json(b).map(drop).map_err(|e| e.to_string());
    assert_none("policies/tenant-budget.schema.json ranges", &range_disagreements("tenant-budget", &load, &[]));
}

#[test]
fn model_router_schema_ranges_match_the_code() {
    let load = |b: &[u8]| RoutingPolicy::from_json(b).map(drop).map_err(|e| e.to_string());
    // A weight in range can still leave every version of a model at 0 (refused; stated in the
    // schema's description).
    let cross_field = ["models[].versions[].weight", "models[].versions[].ramp[].weight"];
    assert_none("policies/model-router.schema.json ranges", &range_disagreements("model-router", &load, &cross_field));
}

#[test]
fn latency_guard_schema_ranges_match_the_code() {
    let load = |b: &[u8]| LatencyPolicy::from_json(b).map(drop).map_err(|e| e.to_string());
    // ttft_deadline_ms ≤ total_deadline_ms, and window_s × 1000 divisible by slots: stated in the
    // schema's description.
    let cross_field = ["versions[].ttft_deadline_ms", "versions[].total_deadline_ms", "versions[].breaker.window_s", "versions[].breaker.slots"];
    assert_none("policies/latency-guard.schema.json ranges", &range_disagreements("latency-guard", &load, &cross_field));
}

/// The rules across members that the tenant-budget schema expresses (sources of the identity,
/// month-only reset day, exactly one limit, count or weights) refuse and accept what the parser does.
#[test]
fn tenant_budget_schema_rules_match_the_code() {
    let validator = schema_check::validator("tenant-budget.schema.json");
    let base = read_json(&schema_check::policies_dir().join("tenant-budget.e2e.json"));
    let budget = "/orgs/0/teams/0/keys/0/budgets/0";
    let cases: &[(&str, Value, bool)] = &[
        ("/identity", serde_json::json!({"api_key": true}), true),
        ("/identity", serde_json::json!({"api_key": false}), false),
        ("/identity", serde_json::json!({"api_key": false, "header": "x-key"}), true),
        ("/identity", serde_json::json!({}), false),
        (budget, serde_json::json!({"window": "month", "tokens": 5000, "reset_day": 28}), true),
        (budget, serde_json::json!({"window": "minute", "tokens": 5000, "reset_day": 1}), false),
        (budget, serde_json::json!({"window": "minute", "tokens": 5000, "output_weight": 3}), true),
        (budget, serde_json::json!({"window": "minute", "tokens": 5000, "input_weight": 0}), false),
        (budget, serde_json::json!({"window": "minute", "tokens": 5000, "input_weight": 0, "output_weight": 0}), false),
        (budget, serde_json::json!({"window": "minute", "tokens": 5000, "count": "input", "input_weight": 1}), false),
        (budget, serde_json::json!({"window": "minute", "requests": 5, "count": "total"}), false),
        (budget, serde_json::json!({"window": "minute", "usd": 1, "output_weight": 1}), false),
        (budget, serde_json::json!({"window": "minute", "tokens": 5000, "usd": 1}), false),
        (budget, serde_json::json!({"window": "minute"}), false),
    ];
    let mut problems = Vec::new();
    for (pointer, value, expected) in cases {
        let mut doc = base.clone();
        *doc.pointer_mut(pointer).unwrap() = value.clone();
        let schema_ok = validator.is_valid(&doc);
        let code = Policy::from_json(&serde_json::to_vec(&doc).unwrap());
        if schema_ok != *expected || code.is_ok() != *expected {
            problems.push(format!("{pointer} = {value}: schema {schema_ok}, plugin {:?}, expected {expected}", code.err()));
        }
    }
    assert_none("tenant-budget rules", &problems);
}

/// `policies/sluice.schema.json` takes what sluice.wasm takes (plugins/engine/src/config.rs): the
/// shipped filters' sections, any subset of the three that share a filter, the guard alone; and
/// refuses the guard with another section, an unknown member, no member and a broken section.
#[test]
fn the_sluice_schema_takes_the_sections_sluice_wasm_takes() {
    let validator = schema_check::validator("sluice.schema.json");
    let policy = |file: &str| read_json(&schema_check::policies_dir().join(file));
    let (guard, router, budget, metrics) =
        (policy("latency-guard.demo.json"), policy("model-router.demo.json"), policy("tenant-budget.full.json"), policy("llm-metrics.demo.json"));
    let accepted = [
        serde_json::json!({"latency_guard": guard}),
        serde_json::json!({"model_router": router, "tenant_budget": budget, "llm_metrics": metrics}),
        serde_json::json!({"tenant_budget": budget, "llm_metrics": metrics}),
        serde_json::json!({"llm_metrics": {}}),
    ];
    for config in &accepted {
        assert_none("a configuration sluice.wasm takes", &violations(&validator, config));
    }
    let refused = [
        serde_json::json!({"latency_guard": guard, "llm_metrics": metrics}),
        serde_json::json!({"tenant_budgets": budget}),
        serde_json::json!({}),
        serde_json::json!({"llm_metrics": {"path_prefixes": []}}),
    ];
    for config in &refused {
        assert!(!violations(&validator, config).is_empty(), "the schema takes what sluice.wasm refuses: {config}");
    }
}
