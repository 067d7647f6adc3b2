//! The engine in-process: small scenarios through the production `.wasm` plugins on the virtual
//! clock, with exact figures derived from the policies (policies/*.json, docs/tenant-budget.md,
//! docs/latency-guard.md) and the service model (workload/src/upstream.rs) — not from the engine itself.
//!
//! Every run here also goes through the native host (the same flows compiled in), which must give
//! the same verdicts, breaker transitions, samples and warnings: each scenario is an agreement case
//! of the two hosts as well.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use sluice_sim::engine::{Engine, Plugins, RunOptions, RunResult};
use sluice_sim::scenario::{PluginKind, Scenario};
use sluice_sim::trace::{ApiKind, ReaderOptions, TraceReader, TraceRequest};
use sluice_sim::verdict::{Decision, Stamp, Verdict};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// 2026-01-01T00:00:00Z: a minute (and day, and month) boundary.
const MINUTE_BOUNDARY_NS: u64 = 1_767_225_600_000_000_000;
const MS: u64 = 1_000_000;

/// `sluice.wasm`, compiled once per test binary.
fn plugins() -> &'static Plugins {
    static PLUGINS: OnceLock<Plugins> = OnceLock::new();
    PLUGINS.get_or_init(|| {
        let dir = sluice_host::workspace_target_dir().join("wasm32-wasip1").join("release");
        Plugins::load(&dir).expect("build the plugin first: cargo build --release --target wasm32-wasip1 -p sluice")
    })
}

/// A path in examples/sim/, so that `../../policies/…` names the shipped policies.
fn scenario_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/sim/test.scenario.json")
}

fn scenario(value: Value) -> Scenario {
    Scenario::parse(&value.to_string(), &scenario_path()).unwrap_or_else(|e| panic!("{e}"))
}

/// A streamed chat request of `tenant` (user `u1`) arriving `t_ms` after the first.
fn request(line: u64, t_ms: u64, tenant: &str, prompt: u64, max_tokens: u64, output: u64) -> TraceRequest {
    TraceRequest {
        line,
        arrival_ns: t_ms * MS,
        tenant: Some(tenant.to_string()),
        key: None,
        user: Some("u1".to_string()),
        api: ApiKind::ChatCompletions,
        model: None,
        prompt_tokens: Some(prompt),
        max_output_tokens: Some(max_tokens),
        output_tokens: Some(output),
        stream: Some(true),
        status: None,
        outcome: None,
        prefix_blocks: Vec::new(),
    }
}

/// Runs `trace` on both hosts and returns the wasm host's verdicts by line, each exactly once,
/// after checking the native host's run is the same in every field.
fn run(scenario: &Scenario, start_ns: u64, trace: Vec<TraceRequest>) -> (Vec<Verdict>, RunResult) {
    let (verdicts, result) = run_on(plugins(), scenario, start_ns, trace.clone());
    let (native, native_result) = run_on(&Plugins::native(), scenario, start_ns, trace);
    assert_eq!(serialized(&native), serialized(&verdicts), "the native host's verdicts differ from the wasm host's");
    assert_eq!(native_result.transitions, result.transitions, "breaker transitions differ between hosts");
    assert_eq!(native_result.samples, result.samples, "samples differ between hosts");
    assert_eq!(native_result.warnings, result.warnings, "warnings differ between hosts");
    assert_eq!(native_result.span_ms, result.span_ms);
    (verdicts, result)
}

fn run_on(plugins: &Plugins, scenario: &Scenario, start_ns: u64, trace: Vec<TraceRequest>) -> (Vec<Verdict>, RunResult) {
    let n = trace.len();
    let engine = Engine::new(scenario, plugins, &RunOptions { start_ns }).unwrap();
    let mut verdicts = Vec::new();
    let result = engine
        .run(
            trace.into_iter(),
            |v| {
                verdicts.push(v);
                Ok(())
            },
            |_| {},
        )
        .unwrap();
    assert_eq!(result.requests, n as u64);
    verdicts.sort_by_key(|v| v.line);
    let lines: Vec<u64> = verdicts.iter().map(|v| v.line).collect();
    let mut unique = lines.clone();
    unique.dedup();
    assert_eq!(lines, unique, "a request got two verdicts");
    assert_eq!(verdicts.len(), n, "every request ends with exactly one verdict");
    (verdicts, result)
}

fn line(verdicts: &[Verdict], n: u64) -> &Verdict {
    verdicts.iter().find(|v| v.line == n).unwrap_or_else(|| panic!("no verdict for line {n}"))
}

fn stamp_u64(stamp: &Option<Stamp>, field: &str) -> Option<u64> {
    stamp.as_ref().and_then(|s| s.u64(field))
}

fn stamp_str(stamp: &Option<Stamp>, field: &str) -> Option<String> {
    stamp.as_ref().and_then(|s| s.str(field))
}

/// The four shipped demo policies, as examples/sim/demo.scenario.json names them.
fn demo_plugins() -> Value {
    json!({
        "latency_guard": "../../policies/latency-guard.demo.json",
        "model_router": "../../policies/model-router.demo.json",
        "tenant_budget": "../../policies/tenant-budget.full.json",
        "llm_metrics": "../../policies/llm-metrics.demo.json"
    })
}

// ---------------------------------------------------------------------------------------------
// One request through all four plugins
// ---------------------------------------------------------------------------------------------

#[test]
fn one_request_through_all_four_plugins() {
    let s = scenario(json!({
        "plugins": demo_plugins(),
        "upstream": {
            "llama-v1": { "ttft_base_ms": 40, "prefill_tokens_per_s": 12000, "tpot_ms": 22 },
            "llama-v2": { "ttft_base_ms": 35, "prefill_tokens_per_s": 15000, "tpot_ms": 18 }
        }
    }));
    // acme: critical class of the demo guard, a key of the full budget policy, a tenant label of
    // llm-metrics; routed by the 99/1 split (sticky on the tenant header).
    let (v, result) = run(&s, MINUTE_BOUNDARY_NS, vec![request(1, 0, "acme", 1200, 100, 100)]);
    let v = &v[0];
    assert_eq!(v.version.as_deref(), Some("v1"), "{v:#?}");
    assert_eq!(v.route_reason.as_deref(), Some("weight"));
    assert_eq!((v.decision, v.status, v.outcome.as_str()), (Decision::Admitted, 200, "completed"));
    assert_eq!((v.code.as_deref(), v.refused_by.as_deref()), (None, None));
    assert_eq!(v.tenant.as_deref(), Some("acme"));
    assert_eq!(v.key.as_deref(), Some("acme"), "the budget stamp's key");
    // TTFT = 40 ms + 1200 tokens / 12,000 tokens/s = 140 ms, measured by llm-metrics on the
    // virtual clock (the request reached the upstream the instant it arrived).
    assert_eq!(v.ttft_ms, Some(140.0));
    assert_eq!(v.tpot_ms, Some(22.0));
    // The last token: 140 + 99 × 22 = 2318 ms after arrival.
    assert_eq!(v.duration_ms, 2318.0);
    assert_eq!((v.input_tokens, v.output_tokens, v.prompt_tokens), (1200, 100, 1200));
    // llama-3-70b*: $0.59 / $0.79 per Mtok → ⌈1200 × 0.59 + 100 × 0.79⌉ = 787 µUSD.
    assert_eq!(v.cost_usd, Some(787.0 / 1e6));
    assert_eq!(v.upstream_concurrency, Some(1));
    assert_eq!(v.api, "chat_completions");
    assert_eq!(v.model.as_deref(), Some("llama-3-70b"));
    assert!(v.stream);
    // Each plugin stamped it.
    assert_eq!(stamp_str(&v.stamps.budget, "decision").as_deref(), Some("admitted"));
    assert_eq!(stamp_u64(&v.stamps.budget, "charged_tokens"), Some(1300));
    assert_eq!(stamp_str(&v.stamps.latency, "class").as_deref(), Some("interactive"));
    assert_eq!(stamp_u64(&v.stamps.latency, "ttft_ms"), Some(140));
    assert_eq!(stamp_str(&v.stamps.latency, "outcome").as_deref(), Some("ok"));
    assert_eq!(stamp_str(&v.stamps.route, "version").as_deref(), Some("v1"));
    assert_eq!(stamp_str(&v.stamps.sluice, "model_version").as_deref(), Some("v1"));
    assert_eq!(stamp_str(&v.stamps.sluice, "usage").as_deref(), Some("reported"));
    assert_eq!(result.requests, 1);
    assert!(result.transitions.is_empty());
    assert!(result.span_ms >= 2318.0, "{}", result.span_ms);
}

// ---------------------------------------------------------------------------------------------
// tenant-budget: a small per-minute token budget
// ---------------------------------------------------------------------------------------------

/// The body the gateway gets for `request(.., prompt, max_tokens, ..)` of user `u1` asking for
/// `llama-3-70b`: the text is 4 characters a token after the 4 of the message (the mock's count),
/// so its size is that of any ASCII text of that length.
fn chat_body_bytes(prompt: u64, max_tokens: u64) -> u64 {
    let text = "x".repeat(((prompt - 4) * 4) as usize);
    let body = json!({"model": "llama-3-70b", "messages": [{"role": "user", "content": text}], "stream": true, "max_tokens": max_tokens, "user": "u1"});
    body.to_string().len() as u64
}

#[test]
fn budget_admits_what_fits_and_refreshes_with_the_window() {
    const PROMPT: u64 = 100;
    const MAX: u64 = 200;
    const OUTPUT: u64 = 50;
    // Strict mode: the worst case of a request is its body's size in bytes + its output limit.
    let reservation = chat_body_bytes(PROMPT, MAX) + MAX;
    let limit = 3 * reservation + reservation / 2;
    let s = budget_and_metrics(
        minute_tokens(limit),
        json!({}),
        json!({ "default_upstream": { "ttft_base_ms": 20, "prefill_tokens_per_s": 10000, "tpot_ms": 10 } }),
    );
    let mut trace = Vec::new();
    // Six at once at 0 s, four at 30 s (when the first ones have long settled), six at 60.5 s.
    for (first, n, t_ms) in [(1, 6, 0), (7, 4, 30_000), (11, 6, 60_500)] {
        for i in 0..n {
            trace.push(request(first + i, t_ms, "k1", PROMPT, MAX, OUTPUT));
        }
    }
    // A settled request is charged what it used: 100 + 50 tokens. After three of them and with
    // nothing reserved, ⌊(limit − 450) / reservation⌋ more fit.
    let after_three = (limit - 3 * (PROMPT + OUTPUT)) / reservation;
    assert_eq!(after_three, 2, "the scenario is meant to admit two then");

    let check = |v: &[Verdict], lines: std::ops::RangeInclusive<u64>, admitted: u64| {
        let first = *lines.start();
        for n in lines {
            let v = line(v, n);
            if n < first + admitted {
                assert_eq!((v.decision, v.status, v.outcome.as_str(), v.code.as_deref()), (Decision::Admitted, 200, "completed", None), "line {n}: {v:#?}");
                assert_eq!(stamp_u64(&v.stamps.budget, "reserved_tokens"), Some(reservation), "line {n}");
                assert_eq!(stamp_u64(&v.stamps.budget, "charged_tokens"), Some(PROMPT + OUTPUT), "line {n}");
                assert_eq!(v.output_tokens, OUTPUT);
            } else {
                assert_eq!(
                    (v.decision, v.status, v.outcome.as_str(), v.code.as_deref()),
                    (Decision::Refused, 429, "refused", Some("key:k1:minute:total_tokens")),
                    "line {n}: {v:#?}"
                );
                assert_eq!(v.refused_by.as_deref(), Some("tenant-budget"));
                assert_eq!(v.output_tokens, 0);
                assert_eq!(v.upstream_concurrency, None, "a refused request never reaches the upstream");
            }
        }
    };

    // Started at a minute boundary: 0 s and 30 s share a minute, 60.5 s starts the next one.
    let (v, _) = run(&s, MINUTE_BOUNDARY_NS, trace.clone());
    check(&v, 1..=6, 3); // three reservations fit in 3.5, the fourth does not
    check(&v, 7..=10, after_three);
    check(&v, 11..=16, 3); // the budget is whole again

    // Started 10 s before a minute boundary: 30 s starts a fresh minute (three fit of four), which
    // 60.5 s is still in.
    let (v, _) = run(&s, MINUTE_BOUNDARY_NS - 10_000 * MS, trace);
    check(&v, 1..=6, 3);
    check(&v, 7..=10, 3);
    check(&v, 11..=16, after_three);
}

#[test]
fn a_policy_reading_the_tenant_where_the_clients_do_not_send_it_gets_a_note() {
    let demo = scenario(json!({ "plugins": demo_plugins() }));
    assert!(demo.notes.is_empty(), "every demo policy reads x-sluice-tenant, as the clients send it: {:?}", demo.notes);
    // The clients send their tenant in x-org: the demo's four policies read x-sluice-tenant.
    let moved = scenario(json!({ "plugins": demo_plugins(), "traffic": { "tenant_header": "X-Org" } }));
    let fields: Vec<&str> = moved.notes.iter().map(|n| n.split(" is ").next().unwrap_or_default()).collect();
    assert_eq!(
        fields,
        [
            "plugins.latency_guard: tenant.header",
            "plugins.model_router: models[0].shadow.tenant_header",
            "plugins.tenant_budget: identity.header",
            "plugins.llm_metrics: tenant.header"
        ],
        "{:?}",
        moved.notes
    );
    assert!(moved.notes.iter().all(|n| n.contains("\"x-sluice-tenant\", but the simulated clients send their tenant in \"X-Org\"")), "{:?}", moved.notes);
    // A budget that identifies by API key alone: no request the simulator sends has one.
    let keyed = budget_and_metrics(minute_tokens(1_000), json!({ "identity": { "api_key": true } }), json!({}));
    assert_eq!(keyed.notes.len(), 1, "{:?}", keyed.notes);
    assert!(
        keyed.notes[0].starts_with("plugins.tenant_budget: identity.header is not set") && keyed.notes[0].contains("every request is an unknown key"),
        "{:?}",
        keyed.notes
    );
}

#[test]
fn a_default_model_the_router_does_not_route_gets_a_note() {
    let routed = scenario(json!({ "plugins": demo_plugins(), "traffic": { "model": "llama-3-70b" } }));
    assert!(routed.notes.is_empty(), "{:?}", routed.notes);
    let unrouted = scenario(json!({ "plugins": demo_plugins(), "traffic": { "model": "gpt-4o" } }));
    assert_eq!(unrouted.notes.len(), 1, "{:?}", unrouted.notes);
    assert!(unrouted.notes[0].starts_with("plugins.model_router: no model of the policy matches \"gpt-4o\" (traffic.model)"), "{:?}", unrouted.notes);
    // And so it is: the request goes to the upstream its model names, with no routing decision.
    let s = scenario(json!({
        "plugins": { "model_router": "../../policies/model-router.demo.json" },
        "traffic": { "model": "gpt-4o" },
        "upstream": { "gpt-4o": { "ttft_base_ms": 70, "prefill_tokens_per_s": 10000, "tpot_ms": 20 } }
    }));
    let (v, _) = run(&s, MINUTE_BOUNDARY_NS, vec![request(1, 0, "acme", 500, 10, 10)]);
    assert_eq!(
        (v[0].route_reason.as_deref(), v[0].upstream.as_ref().map(|u| u.name.as_str()), v[0].ttft_ms),
        (None, Some("gpt-4o"), Some(120.0)),
        "{:#?}",
        v[0]
    );
}

#[test]
fn a_redis_ledger_runs_as_the_local_ledger_and_the_scenario_says_so() {
    const PROMPT: u64 = 100;
    const MAX: u64 = 200;
    let reservation = chat_body_bytes(PROMPT, MAX) + MAX;
    let upstream = json!({ "default_upstream": { "ttft_base_ms": 20, "prefill_tokens_per_s": 10000, "tpot_ms": 10 } });
    let local = budget_and_metrics(minute_tokens(3 * reservation), json!({}), upstream.clone());
    // `on_failure: allow` would admit all six if the ledger's callouts went unanswered.
    let redis = budget_and_metrics(
        minute_tokens(3 * reservation),
        json!({ "ledger": { "mode": "redis", "cluster": "sluice_ledger", "timeout_ms": 50, "on_failure": "allow" } }),
        upstream,
    );
    assert!(local.notes.is_empty(), "{:?}", local.notes);
    assert_eq!(redis.notes.len(), 1, "{:?}", redis.notes);
    assert!(redis.notes[0].starts_with("plugins.tenant_budget: the budget's ledger is Redis") && redis.notes[0].contains("local ledger"), "{:?}", redis.notes);
    let trace: Vec<TraceRequest> = (1..=6).map(|n| request(n, 0, "k1", PROMPT, MAX, 50)).collect();
    let (v, _) = run(&redis, MINUTE_BOUNDARY_NS, trace.clone());
    let refused = v.iter().filter(|v| v.decision == Decision::Refused).count();
    assert_eq!(refused, 3, "three reservations fit, the other three are refused: {v:#?}");
    let (local_verdicts, _) = run(&local, MINUTE_BOUNDARY_NS, trace);
    assert_eq!(serialized(&v), serialized(&local_verdicts), "the Redis-mode policy decides as the local one");
}

// ---------------------------------------------------------------------------------------------
// The service model: batch limit, queue, slowdown by batch size
// ---------------------------------------------------------------------------------------------

fn metrics_only(upstream: Value) -> Scenario {
    scenario(json!({
        "plugins": { "llm_metrics": "../../policies/llm-metrics.demo.json" },
        "upstream": { "llama-3-70b": upstream }
    }))
}

#[test]
fn max_batch_one_queues_the_second_request_behind_the_whole_first() {
    // TTFT 50 + 400 / 8000 s = 100 ms; 10 tokens 10 ms apart: the first is served for 190 ms.
    let s = metrics_only(json!({ "ttft_base_ms": 50, "prefill_tokens_per_s": 8000, "tpot_ms": 10, "max_batch": 1 }));
    let (v, _) = run(&s, MINUTE_BOUNDARY_NS, vec![request(1, 0, "acme", 400, 10, 10), request(2, 0, "acme", 400, 10, 10)]);
    let (a, b) = (line(&v, 1), line(&v, 2));
    assert_eq!((a.status, b.status), (200, 200));
    assert_eq!(a.ttft_ms, Some(100.0));
    assert_eq!(a.duration_ms, 190.0);
    // The second waits the first's whole service (190 ms), then its own 100 ms.
    assert_eq!(b.ttft_ms, Some(290.0));
    assert_eq!(b.tpot_ms, Some(10.0));
    assert_eq!(b.duration_ms, 380.0);
    assert_eq!((a.upstream_concurrency, b.upstream_concurrency), (Some(1), Some(1)));
}

#[test]
fn a_running_request_slows_prefill_and_decode_of_the_next() {
    let s = metrics_only(json!({
        "ttft_base_ms": 50, "prefill_tokens_per_s": 8000, "prefill_slowdown_per_running": 0.5,
        "tpot_ms": 10, "tpot_per_running_ms": 5, "max_batch": 2
    }));
    let trace = vec![request(1, 0, "acme", 400, 10, 10), request(2, 0, "acme", 400, 10, 10), request(3, 0, "acme", 400, 10, 10)];
    let (v, _) = run(&s, MINUTE_BOUNDARY_NS, trace);
    let (a, b, c) = (line(&v, 1), line(&v, 2), line(&v, 3));
    // First: alone. 50 + 50 = 100 ms, 10 ms a token, done at 190 ms.
    assert_eq!((a.ttft_ms, a.tpot_ms, a.duration_ms, a.upstream_concurrency), (Some(100.0), Some(10.0), 190.0, Some(2 - 1)));
    // Second: one running → prefill × 1.5 = 75 ms, TTFT 125 ms; 15 ms a token; done at 260 ms.
    assert_eq!((b.ttft_ms, b.tpot_ms, b.duration_ms, b.upstream_concurrency), (Some(125.0), Some(15.0), 260.0, Some(2)));
    // Third: queued until the first ends at 190 ms, then starts beside the second (one running):
    // 190 + 125 = 315 ms TTFT, 15 ms a token, done at 315 + 135 = 450 ms.
    assert_eq!((c.ttft_ms, c.tpot_ms, c.duration_ms, c.upstream_concurrency), (Some(315.0), Some(15.0), 450.0, Some(2)));
}

// ---------------------------------------------------------------------------------------------
// Incidents
// ---------------------------------------------------------------------------------------------

#[test]
fn an_error_incident_answers_its_window_with_its_status() {
    let s = scenario(json!({
        "plugins": { "llm_metrics": "../../policies/llm-metrics.demo.json" },
        "upstream": { "llama-3-70b": { "ttft_base_ms": 30, "prefill_tokens_per_s": 10000, "tpot_ms": 10 } },
        "incidents": [{ "upstream": "llama-3-70b", "from_s": 10, "to_s": 20, "status": 503 }]
    }));
    let arrivals = [5_000, 9_999, 10_000, 15_000, 19_999, 20_000, 25_000];
    let trace = arrivals.iter().enumerate().map(|(i, t)| request(i as u64 + 1, *t, "acme", 200, 20, 20)).collect();
    let (v, _) = run(&s, MINUTE_BOUNDARY_NS, trace);
    for (i, t) in arrivals.iter().enumerate() {
        let v = line(&v, i as u64 + 1);
        assert_eq!(v.arrival_ms, *t as f64);
        if (10_000..20_000).contains(t) {
            assert_eq!((v.status, v.outcome.as_str(), v.output_tokens, v.ttft_ms), (503, "upstream_error", 0, None), "{t} ms: {v:#?}");
            // Refused without prefill: the fixed part alone.
            assert_eq!(v.duration_ms, 30.0, "{t} ms");
            assert_eq!(v.decision, Decision::Admitted, "the gateway let it through; the upstream failed it");
        } else {
            // 30 + 200 / 10,000 s = 50 ms.
            assert_eq!((v.status, v.outcome.as_str(), v.output_tokens, v.ttft_ms), (200, "completed", 20, Some(50.0)), "{t} ms: {v:#?}");
        }
    }
}

#[test]
fn a_request_reaches_the_upstream_the_routers_configured_route_header_names() {
    let mut s = scenario(json!({
        "plugins": { "model_router": "../../policies/model-router.demo.json" },
        "upstream": {
            "llama-v1": { "ttft_base_ms": 40, "prefill_tokens_per_s": 10000, "tpot_ms": 20 },
            "llama-v2": { "ttft_base_ms": 70, "prefill_tokens_per_s": 10000, "tpot_ms": 20 }
        }
    }));
    // The demo router with its route header renamed and v2 alone (no shadow): Envoy's route picks
    // the cluster by that header, so every request is served by llama-v2, not by the upstream its
    // body's model (llama-3-70b-v2) names.
    let (_, router) = s.plugins.iter_mut().find(|(kind, _)| *kind == PluginKind::ModelRouter).unwrap();
    let mut policy: Value = serde_json::from_str(router).unwrap();
    policy["route_header"] = "x-pick-upstream".into();
    let model = &mut policy["models"][0];
    model["versions"] = json!([model["versions"][1].clone()]);
    model["fallback"] = json!(["v2"]);
    model.as_object_mut().unwrap().remove("shadow");
    *router = policy.to_string();
    let trace: Vec<TraceRequest> = (0..4).map(|i| request(i + 1, i * 100, "acme", 500, 10, 10)).collect();
    let (v, _) = run(&s, MINUTE_BOUNDARY_NS, trace);
    for v in &v {
        assert_eq!(v.version.as_deref(), Some("v2"), "{v:#?}");
        assert_eq!(v.upstream.as_ref().map(|u| u.name.as_str()), Some("llama-v2"), "{v:#?}");
        // 70 + 500 / 10,000 s = 120 ms: llama-v2's service, not the default upstream's.
        assert_eq!(v.ttft_ms, Some(120.0), "{v:#?}");
    }
}

#[test]
fn a_slow_incident_opens_the_breaker_and_moves_traffic_to_the_fallback() {
    let s = scenario(json!({
        "plugins": {
            "latency_guard": "../../policies/latency-guard.demo.json",
            "model_router": "../../policies/model-router.demo.json",
            "llm_metrics": "../../policies/llm-metrics.demo.json"
        },
        "upstream": {
            // Healthy: 40 + 600 / 12,000 s = 90 ms, under the demo breaker's p95 objective of 400 ms.
            "llama-v1": { "ttft_base_ms": 40, "prefill_tokens_per_s": 12000, "tpot_ms": 20 },
            "llama-v2": { "ttft_base_ms": 30, "prefill_tokens_per_s": 12000, "tpot_ms": 20 }
        },
        // × 6 = 540 ms from 10 s on: over the objective, under the 2 s TTFT deadline.
        "incidents": [{ "upstream": "llama-v1", "from_s": 10, "to_s": 60, "ttft_factor": 6 }]
    }));
    // Every 100 ms for 25 s, round robin over a critical, a standard and a sheddable tenant.
    let tenants = ["acme", "globex", "batch-nightly"];
    let trace: Vec<TraceRequest> = (0..250).map(|i| request(i + 1, i * 100, tenants[(i % 3) as usize], 600, 20, 20)).collect();
    let (v, result) = run(&s, MINUTE_BOUNDARY_NS, trace);

    // Before the incident: everyone on v1 by weight, 90 ms.
    for v in v.iter().filter(|v| v.arrival_ms < 10_000.0) {
        assert_eq!((v.version.as_deref(), v.route_reason.as_deref(), v.status, v.ttft_ms), (Some("v1"), Some("weight"), 200, Some(90.0)), "{v:#?}");
    }
    // The window then holds 100 TTFTs of 90 ms; p95 is the sample of rank ⌊0.95 (n − 1)⌋, which is
    // a slow one from n = 107 on: the 7th slow request (arrived 10.6 s, first token at 11.14 s)
    // opens the breaker.
    let opened: Vec<_> = result.transitions.iter().filter(|t| t.version == "v1" && t.from == "closed" && t.to == "open").collect();
    assert!(!opened.is_empty(), "no closed → open transition: {:?}", result.transitions);
    // The transition's time is the guard's own (when its state gauge changed), not the next state sample's.
    assert_eq!(opened[0].t_ms, 11_140.0, "{:?}", result.transitions);
    // Open for 10 s, then half-open at the guard's next 100 ms look at its open breakers.
    let half_open = result.transitions.iter().find(|t| t.version == "v1" && t.from == "open" && t.to == "half_open").expect("open → half_open");
    assert!((21_140.0..=21_240.0).contains(&half_open.t_ms), "{:?}", result.transitions);
    assert!(result.warnings.iter().any(|w| w.contains("breaker of v1 closed → open")), "the guard's log line is among the warnings: {:?}", result.warnings);
    for v in v.iter().filter(|v| (10_000.0..11_140.0).contains(&v.arrival_ms)) {
        assert_eq!((v.version.as_deref(), v.ttft_ms), (Some("v1"), Some(540.0)), "admitted before the breaker opened: {v:#?}");
    }
    // While open (10 s from 11.14 s): critical and standard go to the fallback v2, sheddable is
    // refused by the guard.
    let open: Vec<&Verdict> = v.iter().filter(|v| (11_140.0..21_140.0).contains(&v.arrival_ms)).collect();
    assert_eq!(open.len(), 100, "arrivals 11.2 s … 21.1 s");
    for v in open {
        if v.tenant.as_deref() == Some("batch-nightly") {
            assert_eq!(
                (v.decision, v.status, v.code.as_deref(), v.refused_by.as_deref()),
                (Decision::Refused, 503, Some("shed_breaker_open"), Some("latency-guard")),
                "{v:#?}"
            );
            assert_eq!(v.upstream_concurrency, None);
        } else {
            assert_eq!((v.decision, v.status), (Decision::Admitted, 200), "{v:#?}");
            assert_eq!((v.version.as_deref(), v.route_reason.as_deref()), (Some("v2"), Some("fallback")), "{v:#?}");
            // v2: 30 + 50 = 80 ms.
            assert_eq!(v.ttft_ms, Some(80.0));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Determinism
// ---------------------------------------------------------------------------------------------

fn azure(limit: usize) -> Vec<TraceRequest> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/azure-2023-conv/azure-2023-conv.first-2000.csv");
    let reader = TraceReader::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()), ReaderOptions::default());
    reader.take(limit).map(Result::unwrap).collect()
}

fn demo_with_seed(seed: u64) -> Scenario {
    scenario(json!({
        "seed": seed,
        "plugins": demo_plugins(),
        "traffic": {
            "tenants": [{ "name": "acme" }, { "name": "globex" }, { "name": "bank-emea" }, { "name": "batch-nightly" }],
            "zipf_s": 1.0,
            "users_per_tenant": 50,
            // At most 32 tokens a request: the runs stay short in a debug build.
            "max_tokens": 32
        },
        "upstream": {
            "llama-v1": { "ttft_base_ms": 40, "prefill_tokens_per_s": 12000, "tpot_ms": 22, "tpot_per_running_ms": 0.15, "max_batch": 48 },
            "llama-v2": { "ttft_base_ms": 35, "prefill_tokens_per_s": 15000, "tpot_ms": 18, "tpot_per_running_ms": 0.1, "max_batch": 48 },
            "qwen_v1": { "ttft_base_ms": 50, "prefill_tokens_per_s": 10000, "tpot_ms": 25, "max_batch": 16 }
        },
        "incidents": [{ "upstream": "llama-v1", "from_s": 20, "to_s": 40, "ttft_factor": 4 }]
    }))
}

fn serialized(verdicts: &[Verdict]) -> Vec<String> {
    verdicts.iter().map(|v| serde_json::to_string(v).unwrap()).collect()
}

#[test]
fn same_scenario_and_seed_give_identical_verdicts() {
    let trace = azure(200);
    let s = demo_with_seed(7);
    let (a, ra) = run(&s, MINUTE_BOUNDARY_NS, trace.clone());
    let (b, rb) = run(&s, MINUTE_BOUNDARY_NS, trace.clone());
    assert_eq!(serialized(&a), serialized(&b));
    assert_eq!(ra.samples, rb.samples);
    assert_eq!(ra.transitions, rb.transitions);
    assert_eq!(ra.span_ms, rb.span_ms);

    // Another seed draws other tenants (and users) for the same lines.
    let (c, _) = run(&demo_with_seed(8), MINUTE_BOUNDARY_NS, trace);
    let tenants = |v: &[Verdict]| v.iter().map(|v| v.tenant.clone().unwrap()).collect::<Vec<_>>();
    let (ta, tc) = (tenants(&a), tenants(&c));
    let moved = ta.iter().zip(&tc).filter(|(x, y)| x != y).count();
    assert!(moved > 20, "only {moved} of 200 requests changed tenant with another seed");
    // Zipf, s = 1, four tenants: weights 1, 1/2, 1/3, 1/4 → acme draws 12/25 = 48 %.
    for t in [&ta, &tc] {
        let acme = t.iter().filter(|x| x.as_str() == "acme").count();
        assert!((70..=122).contains(&acme), "acme drew {acme} of 200 (expected ≈ 96)");
        let nightly = t.iter().filter(|x| x.as_str() == "batch-nightly").count();
        assert!(nightly < acme / 2, "batch-nightly drew {nightly}, acme {acme}");
    }
}

// ---------------------------------------------------------------------------------------------
// Bounded state
// ---------------------------------------------------------------------------------------------

#[test]
fn three_thousand_requests_all_end() {
    // 3,000 requests 5 ms apart through all four demo policies (every tenth streamed, the rest
    // whole answers: a debug build runs those about twice as fast), on an upstream with room for
    // them all (each is served in 40 + 25 + 15 × 5 = 140 ms: about 28 at once).
    let s = scenario(json!({
        "plugins": demo_plugins(),
        "upstream": {
            "llama-v1": { "ttft_base_ms": 40, "prefill_tokens_per_s": 12000, "tpot_ms": 5, "max_batch": 256 },
            "llama-v2": { "ttft_base_ms": 40, "prefill_tokens_per_s": 12000, "tpot_ms": 5, "max_batch": 256 }
        }
    }));
    let tenants = ["acme", "globex", "bank-emea"];
    let trace: Vec<TraceRequest> = (0..3000)
        .map(|i| {
            let mut r = request(i + 1, i * 5, tenants[(i % 3) as usize], 300, 16, 16);
            r.stream = Some(i % 10 == 0);
            r
        })
        .collect();
    let (v, result) = run(&s, MINUTE_BOUNDARY_NS, trace);
    // Every request ended, with exactly one verdict (`run` checks it), which the engine emits only
    // when the chain reports the stream ended: no stream is left open.
    assert_eq!((result.requests, v.len()), (3000, 3000));
    assert!(result.transitions.is_empty(), "{:?}", result.transitions);
    // acme (500k tokens a minute) and bank-emea (1M) are charged 316 tokens a request: all admitted.
    for v in v.iter().filter(|v| v.tenant.as_deref() != Some("globex")) {
        assert_eq!((v.decision, v.status, v.outcome.as_str(), v.output_tokens), (Decision::Admitted, 200, "completed", 16), "{v:#?}");
    }
    // globex has 100k tokens a minute and this trace lasts 15 s: it is refused with 429 once its
    // budget is (nearly) spent, and never charged past it (strict mode: zero overshoot).
    let globex: Vec<&Verdict> = v.iter().filter(|v| v.tenant.as_deref() == Some("globex")).collect();
    let charged: u64 = globex.iter().filter(|v| v.decision == Decision::Admitted).map(|v| stamp_u64(&v.stamps.budget, "charged_tokens").unwrap()).sum();
    let admitted = globex.iter().filter(|v| v.decision == Decision::Admitted).count() as u64;
    assert_eq!(charged, admitted * 316);
    assert!(charged <= 100_000, "globex charged {charged} tokens of its 100,000");
    assert!(charged > 95_000, "globex charged only {charged} tokens of its 100,000");
    for v in globex.iter().filter(|v| v.decision != Decision::Admitted) {
        assert_eq!((v.decision, v.status, v.code.as_deref()), (Decision::Refused, 429, Some("key:globex:minute:total_tokens")), "{v:#?}");
    }
}

// ---------------------------------------------------------------------------------------------
// More of the service model, the request shapes and the plugins' decisions
// ---------------------------------------------------------------------------------------------

/// tenant-budget with one key `k1` (`key` adds members to it: `budgets`, `max_output_tokens`) and
/// the policy members `policy`, llm-metrics behind it, and the scenario members `rest`.
fn budget_and_metrics(key: Value, policy: Value, rest: Value) -> Scenario {
    let mut k1 = json!({ "id": "k1" });
    let mut budget = json!({ "mode": "strict", "identity": { "header": "x-sluice-tenant" } });
    let mut s = json!({ "plugins": { "llm_metrics": "../../policies/llm-metrics.demo.json" } });
    for (target, members) in [(&mut k1, key), (&mut budget, policy), (&mut s, rest)] {
        for (k, v) in members.as_object().unwrap() {
            target[k] = v.clone();
        }
    }
    budget["orgs"] = json!([{ "id": "o", "teams": [{ "id": "t", "keys": [k1] }] }]);
    s["plugins"]["tenant_budget"] = budget;
    scenario(s)
}

fn minute_tokens(tokens: u64) -> Value {
    json!({ "budgets": [{ "window": "minute", "tokens": tokens }] })
}

#[test]
fn stamps_are_read_under_the_filter_state_keys_the_policies_set() {
    // 40 + 800 / 8,000 s = 140 ms to the first token, then 12 ms a token; a minute of 10,000
    // tokens: the first request fits, the second's prompt alone (12,000 tokens) does not.
    let mut s = budget_and_metrics(
        minute_tokens(10_000),
        json!({ "filter_state_key": "acme.budget" }),
        json!({ "default_upstream": { "ttft_base_ms": 40, "prefill_tokens_per_s": 8000, "tpot_ms": 12 } }),
    );
    let (_, metrics) = s.plugins.iter_mut().find(|(kind, _)| *kind == PluginKind::LlmMetrics).unwrap();
    let mut policy: Value = serde_json::from_str(metrics).unwrap();
    policy["filter_state_key"] = "acme_llm".into();
    *metrics = policy.to_string();
    let (v, _) = run(&s, MINUTE_BOUNDARY_NS, vec![request(1, 0, "k1", 800, 64, 25), request(2, 1_000, "k1", 12_000, 64, 25)]);
    let admitted = line(&v, 1);
    assert_eq!(
        (admitted.status, admitted.outcome.as_str(), admitted.decision, admitted.code.as_deref()),
        (200, "completed", Decision::Admitted, None),
        "{admitted:#?}"
    );
    assert_eq!((admitted.ttft_ms, admitted.tpot_ms, admitted.output_tokens), (Some(140.0), Some(12.0), 25), "{admitted:#?}");
    assert_eq!(stamp_u64(&admitted.stamps.budget, "charged_tokens"), Some(825), "{admitted:#?}");
    assert_eq!(stamp_u64(&admitted.stamps.sluice, "output_tokens"), Some(25), "{admitted:#?}");
    assert_eq!((admitted.ctx.as_deref(), admitted.turn.as_deref()), (Some("1k"), Some("first")), "{admitted:#?}");
    let refused = line(&v, 2);
    assert_eq!((refused.status, refused.decision, refused.refused_by.as_deref()), (429, Decision::Refused, Some("tenant-budget")), "{refused:#?}");
    assert_eq!(refused.code.as_deref(), Some("key:k1:minute:total_tokens"), "{refused:#?}");
    assert_eq!(refused.outcome, "refused", "{refused:#?}");
}

#[test]
fn every_api_streamed_or_whole_is_measured_exactly() {
    // 40 + 800 / 8,000 s = 140 ms to the first token, then 12 ms a token.
    let s = budget_and_metrics(
        minute_tokens(100_000_000),
        json!({}),
        json!({ "default_upstream": { "ttft_base_ms": 40, "prefill_tokens_per_s": 8000, "tpot_ms": 12 } }),
    );
    let apis = [ApiKind::ChatCompletions, ApiKind::Completions, ApiKind::Responses, ApiKind::AnthropicMessages];
    let mut trace = Vec::new();
    for (i, api) in apis.iter().enumerate() {
        for (j, stream) in [true, false].into_iter().enumerate() {
            let n = (2 * i + j) as u64;
            let mut r = request(n + 1, n * 5_000, "k1", 800, 64, 25);
            r.api = *api;
            r.stream = Some(stream);
            trace.push(r);
        }
    }
    let (v, _) = run(&s, MINUTE_BOUNDARY_NS, trace);
    for v in &v {
        let what = format!("{} stream={}", v.api, v.stream);
        assert_eq!((v.status, v.outcome.as_str(), v.decision), (200, "completed", Decision::Admitted), "{what}: {v:#?}");
        // The mock counts the prompt the simulator wrote as exactly the trace's prompt tokens, and
        // every API reports usage (tenant-budget asks chat and completions streams for it).
        assert_eq!((v.input_tokens, v.output_tokens), (800, 25), "{what}");
        assert_eq!(stamp_str(&v.stamps.sluice, "usage").as_deref(), Some("reported"), "{what}");
        assert_eq!(stamp_u64(&v.stamps.budget, "charged_tokens"), Some(825), "{what}");
        // Whole answers arrive at their last token: 140 + 24 × 12 = 428 ms.
        assert_eq!(v.duration_ms, 428.0, "{what}");
        assert_eq!(v.ttft_ms, v.stream.then_some(140.0), "{what}");
        if v.stream {
            assert_eq!(v.tpot_ms, Some(12.0), "{what}");
        }
    }
    let apis: Vec<&str> = v.iter().map(|v| v.api.as_str()).collect();
    assert_eq!(apis, ["chat_completions", "chat_completions", "completions", "completions", "responses", "responses", "messages", "messages"]);
}

#[test]
fn the_output_limit_a_request_carries() {
    // No limit in the trace: the scenario's `traffic.max_tokens` decides; tenant-budget reserves
    // min(request's limit, key ceiling, default_max_output_tokens) and writes it into the request,
    // and the upstream stops there.
    let run_with = |max_tokens: Value, key_ceiling: Option<u64>| {
        let mut key = minute_tokens(100_000_000);
        if let Some(c) = key_ceiling {
            key["max_output_tokens"] = json!(c);
        }
        let s = budget_and_metrics(key, json!({ "default_max_output_tokens": 1000 }), json!({ "traffic": { "max_tokens": max_tokens } }));
        let mut r = request(1, 0, "k1", 100, 0, 50);
        r.max_output_tokens = None;
        let (v, _) = run(&s, MINUTE_BOUNDARY_NS, vec![r]);
        let v = v.into_iter().next().unwrap();
        (stamp_u64(&v.stamps.budget, "reserved_output_tokens"), v.output_tokens, v.status)
    };
    assert_eq!(run_with(Value::Null, None), (Some(1000), 50, 200), "no limit: the policy's default is reserved");
    assert_eq!(run_with(json!(30), None), (Some(30), 30, 200), "a fixed limit below the output cuts it");
    assert_eq!(run_with(json!("output"), None), (Some(50), 50, 200), "\"output\": exactly what the trace produced");
    assert_eq!(run_with(json!("output"), Some(20)), (Some(20), 20, 200), "the key's ceiling");
}

#[test]
fn clamp_lowers_the_output_limit_to_what_the_budget_can_pay() {
    const PROMPT: u64 = 100;
    let body = chat_body_bytes(PROMPT, 200);
    // Room for the prompt side and 60 output tokens.
    let s = budget_and_metrics(minute_tokens(body + 60), json!({ "clamp": { "enabled": true, "min_output_tokens": 16 } }), json!({}));
    let (v, _) = run(&s, MINUTE_BOUNDARY_NS, vec![request(1, 0, "k1", PROMPT, 200, 100), request(2, 10_000, "k1", PROMPT, 200, 100)]);
    let first = line(&v, 1);
    assert_eq!((first.decision, first.status, first.output_tokens), (Decision::Clamped, 200, 60), "{first:#?}");
    assert_eq!(stamp_u64(&first.stamps.budget, "reserved_output_tokens"), Some(60));
    assert_eq!(stamp_u64(&first.stamps.budget, "charged_tokens"), Some(PROMPT + 60));
    // Then 160 tokens are used: the next body alone no longer fits.
    let second = line(&v, 2);
    assert_eq!((second.decision, second.status, second.code.as_deref()), (Decision::Refused, 429, Some("key:k1:minute:total_tokens")), "{second:#?}");
}

#[test]
fn the_guard_sheds_by_priority_against_the_in_flight_limit() {
    // The demo guard: v1 has `in_flight.limit` 64 and the default standard_extra_percent of 25, so
    // sheddable requests are refused at 64 in flight, standard ones at 80, critical ones never.
    let s = scenario(json!({
        "plugins": {
            "latency_guard": "../../policies/latency-guard.demo.json",
            "model_router": "../../policies/model-router.demo.json",
            "llm_metrics": "../../policies/llm-metrics.demo.json"
        },
        "upstream": { "llama-v1": { "ttft_base_ms": 50, "prefill_tokens_per_s": 10000, "tpot_ms": 50, "max_batch": 256 } }
    }));
    // All at once, in this order; each stays in flight for 5 s.
    let mut trace = Vec::new();
    let groups = [("globex", 70), ("batch-nightly", 10), ("globex", 15), ("acme", 5)];
    for (tenant, n) in groups {
        for _ in 0..n {
            let line = trace.len() as u64 + 1;
            trace.push(request(line, 0, tenant, 100, 100, 100));
        }
    }
    let (v, _) = run(&s, MINUTE_BOUNDARY_NS, trace);
    let admitted = |range: std::ops::RangeInclusive<u64>| {
        for n in range {
            let v = line(&v, n);
            assert_eq!((v.decision, v.status, v.version.as_deref()), (Decision::Admitted, 200, Some("v1")), "line {n}: {v:#?}");
        }
    };
    let shed = |range: std::ops::RangeInclusive<u64>| {
        for n in range {
            let v = line(&v, n);
            assert_eq!(
                (v.decision, v.status, v.code.as_deref(), v.refused_by.as_deref()),
                (Decision::Refused, 503, Some("shed_in_flight"), Some("latency-guard")),
                "line {n}: {v:#?}"
            );
        }
    };
    admitted(1..=70); // standard, up to 70 in flight
    shed(71..=80); // sheddable, 70 ≥ 64
    admitted(81..=90); // standard, 70 … 79 < 80
    shed(91..=95); // standard, 80 ≥ 80
    admitted(96..=100); // critical
                        // In flight at once: 85, all served together (max_batch 256).
    assert_eq!(line(&v, 100).upstream_concurrency, Some(85));
}

#[test]
fn a_ttft_deadline_answers_504_and_frees_the_batch_slot() {
    let s = scenario(json!({
        "plugins": {
            "latency_guard": "../../policies/latency-guard.demo.json",
            "model_router": "../../policies/model-router.demo.json",
            "llm_metrics": "../../policies/llm-metrics.demo.json"
        },
        "upstream": { "llama-v1": { "ttft_base_ms": 50, "prefill_tokens_per_s": 10000, "tpot_ms": 10, "max_batch": 1 } },
        // The first request starts inside it: 100 ms × 30 = 3 s to its first token.
        "incidents": [{ "upstream": "llama-v1", "from_s": 0, "to_s": 1, "ttft_factor": 30 }]
    }));
    let (v, _) = run(&s, MINUTE_BOUNDARY_NS, vec![request(1, 0, "acme", 500, 10, 10), request(2, 1_500, "acme", 500, 10, 10)]);
    let first = line(&v, 1);
    // v1's TTFT deadline (2,000 ms): a 504 from the guard, which is not a refusal.
    assert_eq!((first.status, first.outcome.as_str(), first.decision, first.code.as_deref()), (504, "deadline", Decision::Admitted, None), "{first:#?}");
    assert_eq!(first.duration_ms, 2000.0);
    assert_eq!(stamp_str(&first.stamps.latency, "outcome").as_deref(), Some("ttft"));
    // The second waited for the only slot, which the first gave up at 2 s: 500 ms of queue and its
    // own 100 ms (the incident is over when it starts).
    let second = line(&v, 2);
    assert_eq!((second.status, second.ttft_ms), (200, Some(600.0)), "{second:#?}");
}

#[test]
fn samples_count_requests_running_and_queued() {
    let s = scenario(json!({
        "plugins": { "llm_metrics": "../../policies/llm-metrics.demo.json" },
        "upstream": { "llama-3-70b": { "ttft_base_ms": 50, "prefill_tokens_per_s": 8000, "tpot_ms": 10, "max_batch": 1 } },
        "sample_every_ms": 50
    }));
    // Three at once, each served for 190 ms, one after the other: done at 190, 380 and 570 ms.
    let (_, result) = run(&s, MINUTE_BOUNDARY_NS, (1..=3).map(|n| request(n, 0, "acme", 400, 10, 10)).collect());
    let in_flight = |t: f64| {
        let sample = result.samples.iter().find(|s| s.t_ms == t).unwrap_or_else(|| panic!("no sample at {t} ms: {:?}", result.samples));
        sample.in_flight.iter().find(|(name, _)| name == "llama-3-70b").map_or(0, |(_, n)| *n)
    };
    for (t, n) in [(50.0, 3), (150.0, 3), (200.0, 2), (350.0, 2), (400.0, 1), (550.0, 1)] {
        assert_eq!(in_flight(t), n, "at {t} ms");
    }
    let times: Vec<f64> = result.samples.iter().map(|s| s.t_ms).take(4).collect();
    assert_eq!(times, [0.0, 50.0, 100.0, 150.0]);
}

#[test]
fn samples_of_a_long_span_are_coarsened_to_a_bound() {
    let s = scenario(json!({
        "plugins": { "llm_metrics": "../../policies/llm-metrics.demo.json" },
        "sample_every_ms": 1
    }));
    // Two requests 20 s apart: 20,000 samples at 1 ms, more than the bound.
    let (_, result) = run(&s, MINUTE_BOUNDARY_NS, vec![request(1, 0, "acme", 400, 10, 10), request(2, 20_000, "acme", 400, 10, 10)]);
    let times: Vec<f64> = result.samples.iter().map(|s| s.t_ms).collect();
    assert!(times.len() <= sluice_sim::engine::MAX_SAMPLES, "{} samples", times.len());
    assert!(times.len() > sluice_sim::engine::MAX_SAMPLES / 4, "{} samples: coarsened more than needed", times.len());
    // 1 ms doubled until 20 s fits: 8 ms apart, evenly, from the first arrival to the span's end.
    assert_eq!(result.sample_every_ms, 8);
    assert!(times.windows(2).all(|w| w[1] - w[0] == 8.0), "uneven spacing: {:?}", times.windows(2).find(|w| w[1] - w[0] != 8.0));
    assert_eq!(times.first(), Some(&0.0));
    assert!(*times.last().unwrap() >= result.span_ms - 8.0, "the last sample at {:?}, the span {}", times.last(), result.span_ms);
}

#[test]
fn error_rate_draws_per_request_from_the_seed() {
    let with = |seed: u64| {
        scenario(json!({
            "seed": seed,
            "plugins": { "llm_metrics": "../../policies/llm-metrics.demo.json" },
            "default_upstream": { "ttft_base_ms": 20, "tpot_ms": 5, "error_rate": 0.3, "error_status": 502 },
            // Nothing fails from 10 s to 12 s, everything from 12 s to 14 s.
            "incidents": [
                { "upstream": "llama-3-70b", "from_s": 10, "to_s": 12, "error_rate": 0 },
                { "upstream": "llama-3-70b", "from_s": 12, "to_s": 14, "status": 504 }
            ]
        }))
    };
    // 700 requests 20 ms apart: 0 … 13.98 s.
    let trace: Vec<TraceRequest> = (0..700).map(|i| request(i + 1, i * 20, "acme", 100, 4, 4)).collect();
    let failed = |v: &[Verdict]| v.iter().filter(|v| v.arrival_ms < 10_000.0 && v.status != 200).map(|v| v.line).collect::<Vec<_>>();
    let (a, _) = run(&with(1), MINUTE_BOUNDARY_NS, trace.clone());
    // The first 500 requests fail with probability 0.3: 150 expected, σ ≈ 10.
    let fa = failed(&a);
    assert!((110..=190).contains(&fa.len()), "{} of 500 failed", fa.len());
    assert!(a.iter().filter(|v| v.status != 200 && v.arrival_ms < 10_000.0).all(|v| v.status == 502 && v.outcome == "upstream_error"));
    assert!(a.iter().filter(|v| (10_000.0..12_000.0).contains(&v.arrival_ms)).all(|v| v.status == 200), "the incident's error_rate 0 wins");
    assert!(a.iter().filter(|v| v.arrival_ms >= 12_000.0).all(|v| v.status == 504), "the incident's status wins");
    let (b, _) = run(&with(1), MINUTE_BOUNDARY_NS, trace.clone());
    assert_eq!(failed(&b), fa, "the same seed fails the same requests");
    let (c, _) = run(&with(2), MINUTE_BOUNDARY_NS, trace);
    assert_ne!(failed(&c), fa, "another seed fails others");
}

#[test]
fn time_scale_compresses_arrivals_and_incidents_follow_the_scaled_clock() {
    let s = scenario(json!({
        "time_scale": 0.5,
        "plugins": { "llm_metrics": "../../policies/llm-metrics.demo.json" },
        "default_upstream": { "ttft_base_ms": 20, "tpot_ms": 5 },
        // Seconds of the replay (after scaling): only the request at trace time 1 s (0.5 s here).
        "incidents": [{ "upstream": "llama-3-70b", "from_s": 0.4, "to_s": 0.6, "status": 502 }]
    }));
    let (v, result) = run(&s, MINUTE_BOUNDARY_NS, (0..3).map(|i| request(i + 1, i * 1000, "acme", 100, 4, 4)).collect());
    let arrivals: Vec<f64> = v.iter().map(|v| v.arrival_ms).collect();
    assert_eq!(arrivals, [0.0, 500.0, 1000.0]);
    let statuses: Vec<u16> = v.iter().map(|v| v.status).collect();
    assert_eq!(statuses, [200, 502, 200]);
    // The last answer: 1000 ms + 20 ms + 100 tokens at the default 20,000 a second (5 ms) + 3 × 5 ms.
    assert_eq!(result.span_ms, 1000.0 + 20.0 + 5.0 + 15.0);
}

#[test]
fn a_queued_request_that_fails_still_takes_the_fixed_time() {
    let s = scenario(json!({
        "plugins": { "llm_metrics": "../../policies/llm-metrics.demo.json" },
        "upstream": { "llama-3-70b": { "ttft_base_ms": 50, "prefill_tokens_per_s": 8000, "tpot_ms": 10, "max_batch": 1 } },
        "incidents": [{ "upstream": "llama-3-70b", "from_s": 0.1, "to_s": 10, "status": 503 }]
    }));
    // The first starts before the incident and is served for 190 ms; the second arrives at 50 ms,
    // waits for the slot until 190 ms and then fails: its answer comes ttft_base_ms (50 ms) after
    // it leaves the queue, as an unqueued failure's does after it arrives.
    let (v, _) = run(&s, MINUTE_BOUNDARY_NS, vec![request(1, 0, "acme", 400, 10, 10), request(2, 50, "acme", 400, 10, 10)]);
    assert_eq!((line(&v, 1).status, line(&v, 1).duration_ms), (200, 190.0));
    let second = line(&v, 2);
    assert_eq!(second.status, 503);
    assert_eq!(second.duration_ms, 140.0 + 50.0, "{second:#?}");
}

// ---------------------------------------------------------------------------------------------
// Output quality: llm-metrics' judgement of the simulated answers
// ---------------------------------------------------------------------------------------------

#[test]
fn simulated_answers_are_judged_from_llm_metrics_stamp() {
    let s = metrics_only(json!({ "ttft_base_ms": 20, "tpot_ms": 5 }));
    let apis = [ApiKind::ChatCompletions, ApiKind::Completions, ApiKind::Responses, ApiKind::AnthropicMessages];
    // Per API, streamed and whole: cut at the limit (200 → 64), under it (40), too short to measure (5).
    let outputs = [200u64, 40, 5];
    let mut trace = Vec::new();
    for api in apis {
        for stream in [true, false] {
            for output in outputs {
                let n = trace.len() as u64;
                let mut r = request(n + 1, n * 1_000, "acme", 100, 64, output);
                (r.api, r.stream) = (api, Some(stream));
                trace.push(r);
            }
        }
    }
    let (v, _) = run(&s, MINUTE_BOUNDARY_NS, trace);
    for v in &v {
        let what = format!("{} stream={} line {}", v.api, v.stream, v.line);
        let q = v.quality.as_ref().unwrap_or_else(|| panic!("{what}: a 200 that completed is judged"));
        assert_eq!(Some(q.model_version.as_str()), v.version.as_deref(), "{what}");
        assert_eq!(Some(q.model_version.as_str()), stamp_str(&v.stamps.sluice, "model_version").as_deref(), "{what}");
        assert!(!q.empty, "{what}");
        let planned = outputs[((v.line - 1) % 3) as usize];
        assert_eq!(q.output_tokens, planned.min(64), "{what}");
        assert_eq!(q.truncated, planned > 64, "{what}: finish {}", q.finish);
        // The mock writes distinct words (tok0 tok1 …): no trigram repeats. Five words are three
        // trigrams, under the ten llm-metrics needs for a figure.
        assert_eq!(q.repetition_per_mille, (planned >= 12).then_some(0), "{what}");
        assert_eq!(q.repetition_per_mille, stamp_u64(&v.stamps.sluice, "repetition_per_mille"), "{what}");
    }
    let summary = sluice_sim::report::summarize(&sluice_sim::report::ReportInput {
        title: "quality",
        source: sluice_sim::report::Source::Simulated,
        verdicts: &v,
        samples: &[],
        transitions: &[],
    });
    assert_eq!(summary.quality.len(), 1);
    let q = &summary.quality[0];
    assert_eq!((q.answers, q.repetition_answers, q.repetition_mean_per_mille), (24, 16, Some(0.0)));
    assert_eq!((q.empty, q.truncated, q.output_tokens_p50, q.output_tokens_p95), (0, 8, Some(40.0), Some(64.0)));
}
