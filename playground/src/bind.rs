//! The browser binding: two functions, JSON text in and out, so the glue stays a few lines and the
//! page needs no knowledge of Rust types. Everything they do is tested natively through
//! [`crate::compile_json`] and [`crate::run_json`].

use wasm_bindgen::prelude::wasm_bindgen;

/// Compiles one plugin's policy: `{"ok": true, "summary": …}` or `{"ok": false, "error": …, "log": …}`.
#[wasm_bindgen]
pub fn compile_policy(plugin: &str, policy: &str) -> String {
    crate::compile_json(plugin, policy)
}

/// Runs a workload through the policies: `{"ok": true, "result": {verdicts, tenants, transitions, series, span_ms}}`.
#[wasm_bindgen]
pub fn run_workload(input: &str) -> String {
    crate::run_json(input)
}
