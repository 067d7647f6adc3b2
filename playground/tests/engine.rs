//! The engine natively, on the shipped example (policies/*.json and examples/playground/example.workload.json).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use sluice_playground::{run, RunInput};
use std::path::Path;

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn example() -> RunInput {
    RunInput {
        latency_guard: Some(read("policies/latency-guard.demo.json")),
        model_router: Some(read("policies/model-router.demo.json")),
        tenant_budget: Some(read("policies/tenant-budget.full.json")),
        workload: read("examples/playground/example.workload.json"),
        trace: None,
    }
}

#[test]
fn smoke_print() {
    let out = run(&example()).unwrap();
    for t in &out.tenants {
        println!("{t:?}");
    }
    for t in &out.transitions {
        println!("{t:?}");
    }
    println!("{}", out.verdicts.len());
}
