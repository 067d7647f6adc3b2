//! policies/llm-metrics.schema.json and docs/configuration.md agree with the llm-metrics
//! configuration types, in both directions, and every shipped llm-metrics example validates against
//! the schema and is accepted by `Settings::parse`. The comparison is sluice-core's
//! (plugins/core/tests/schema_check/mod.rs), shared with the other plugins' test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

#[path = "../../core/tests/schema_check/mod.rs"]
mod schema_check;

use schema_check::{assert_none, compare, compare_docs, examples, read_json, violations, DocSection, Documents};
use sluice_llm_metrics::config::{Config, Settings};

fn code_documents() -> Documents {
    Documents::new(("(code)", serde_json::to_value(schemars::schema_for!(Config)).unwrap()))
}

#[test]
fn llm_metrics_schema_matches_the_code() {
    let docs = code_documents();
    assert_none("policies/llm-metrics.schema.json vs Config", &compare(&docs.shape("(code)"), &docs.shape("llm-metrics.schema.json")));
}

#[test]
fn llm_metrics_docs_match_the_code() {
    let docs = code_documents();
    assert_none("docs/configuration.md vs Config", &compare_docs(&docs.shape("(code)"), &[DocSection { file: "configuration.md", from: None }]));
}

#[test]
fn llm_metrics_examples_validate_and_load() {
    let validator = schema_check::validator("llm-metrics.schema.json");
    let mut problems = Vec::new();
    for path in examples("llm-metrics") {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        problems.extend(violations(&validator, &read_json(&path)).into_iter().map(|v| format!("{name}: schema: {v}")));
        if let Err(e) = Settings::parse(&std::fs::read(&path).unwrap()) {
            problems.push(format!("{name}: refused by the plugin: {e}"));
        }
    }
    assert_none("policies/llm-metrics.*.json", &problems);
}

#[test]
fn llm_metrics_schema_ranges_match_the_code() {
    let validator = schema_check::validator("llm-metrics.schema.json");
    let shipped = code_documents().shape("llm-metrics.schema.json");
    let load = |b: &[u8]| Settings::parse(b).map(drop).map_err(|e| e.to_string());
    let mut problems = Vec::new();
    for path in examples("llm-metrics") {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let found = schema_check::boundary_disagreements(&shipped, &validator, &read_json(&path), &load, &[]);
        problems.extend(found.into_iter().map(|d| format!("{name}: {d}")));
    }
    assert_none("policies/llm-metrics.schema.json ranges", &problems);
}
