//! The two hosts of the flows agree at trace scale: the shipped demo scenario (all four policies,
//! a shadow, an incident that opens a breaker) over the bundled Azure slice, and the Mooncake
//! fidelity scenario (bursts of long prompts, budgets on every token kind, clamps, breaker
//! open/probe/reopen/close) over its slice — every verdict, transition, sample and warning of
//! `--host native` equal to `--host wasm`'s. (sim/tests/engine.rs holds the same for each of its
//! scenarios; e2e/tests/sim_fidelity.rs holds the wasm host to real Envoy.)

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::path::{Path, PathBuf};

use sluice_sim::engine::{Engine, Plugins, RunOptions, RunResult};
use sluice_sim::scenario::Scenario;
use sluice_sim::trace::{ReaderOptions, TraceReader};
use sluice_sim::verdict::Verdict;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn run(plugins: &Plugins, scenario: &Scenario, trace: &str) -> (Vec<String>, RunResult) {
    let file = std::fs::File::open(root().join(trace)).unwrap();
    let mut reader = TraceReader::new(std::io::BufReader::new(file), ReaderOptions::default()).peekable();
    let first = reader.peek().map(|r| r.as_ref().map(|_| ()).map_err(|e| e.to_string()));
    assert!(matches!(first, Some(Ok(()))), "{trace}: {first:?}");
    let requests: Vec<_> = reader.map(Result::unwrap).collect();
    let start_ns = 1_767_225_600_000_000_000;
    let engine = Engine::new(scenario, plugins, &RunOptions { start_ns }).unwrap();
    let mut verdicts: Vec<Verdict> = Vec::new();
    let result = engine
        .run(
            requests.into_iter(),
            |v| {
                verdicts.push(v);
                Ok(())
            },
            |_| {},
        )
        .unwrap();
    (verdicts.iter().map(|v| serde_json::to_string(v).unwrap()).collect(), result)
}

fn agree(scenario: &str, trace: &str, tokens_per_event: Option<u64>) -> (Vec<String>, RunResult) {
    let mut scenario = Scenario::load(&root().join(scenario)).unwrap();
    if let Some(n) = tokens_per_event {
        scenario.tokens_per_event = n;
    }
    let wasm = Plugins::load(&sluice_host::workspace_target_dir().join("wasm32-wasip1").join("release")).expect("build the plugins first: cargo xtask build");
    let (wasm_verdicts, wasm_result) = run(&wasm, &scenario, trace);
    let (native_verdicts, native_result) = run(&Plugins::native(), &scenario, trace);
    assert_eq!(native_verdicts.len(), wasm_verdicts.len());
    for (n, (native, wasm)) in native_verdicts.iter().zip(&wasm_verdicts).enumerate() {
        assert_eq!(native, wasm, "verdict {n} of {trace} differs between the hosts");
    }
    assert_eq!(native_result.transitions, wasm_result.transitions);
    assert_eq!(native_result.samples, wasm_result.samples);
    assert_eq!(native_result.warnings, wasm_result.warnings);
    (wasm_verdicts, wasm_result)
}

#[test]
fn the_demo_scenario_over_the_azure_slice_is_the_same_on_both_hosts() {
    let (verdicts, result) = agree("examples/sim/demo.scenario.json", "sim/traces/azure-2023-conv/azure-2023-conv.first-2000.csv", Some(4));
    assert_eq!(verdicts.len(), 2000);
    // What the run exercised, so that agreement is not over an idle chain.
    let count = |needle: &str| verdicts.iter().filter(|v| v.contains(needle)).count();
    assert!(count("\"decision\":\"refused\"") > 0, "no refusal");
    assert!(count("\"shadow_version\":\"") > 0, "no shadow");
    assert!(!result.transitions.is_empty(), "no breaker transition");
}

#[test]
fn the_mooncake_fidelity_scenario_is_the_same_on_both_hosts() {
    let (verdicts, result) = agree("examples/sim/fidelity-mooncake.scenario.json", "sim/traces/mooncake/conversation_trace.first-200.jsonl", None);
    assert_eq!(verdicts.len(), 200);
    assert!(verdicts.iter().any(|v| v.contains("\"decision\":\"clamped\"")), "no clamp");
    assert!(result.transitions.len() >= 3, "{:?}", result.transitions);
}
