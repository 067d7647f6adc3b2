//! Every `env` import a built plugin has must be a hostcall this host implements, with the right
//! signature — checked over the test plugin and every plugin in the workspace's release build.

mod common;

use std::path::PathBuf;

use sluice_host::{unimplemented_imports, workspace_target_dir, Gateway};

fn workspace_plugins() -> Vec<PathBuf> {
    let dir = workspace_target_dir().join("wasm32-wasip1/release");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "wasm")).collect();
    found.sort();
    found
}

#[test]
fn every_plugin_import_is_implemented() {
    let mut plugins = workspace_plugins();
    plugins.push(common::test_plugin_wasm());
    let mut problems = Vec::new();
    for path in &plugins {
        let wasm = std::fs::read(path).expect("readable wasm");
        for missing in unimplemented_imports(&wasm) {
            problems.push(format!("{}: {missing}", path.display()));
        }
    }
    assert!(problems.is_empty(), "imports the host does not implement:\n{}", problems.join("\n"));
}

/// Every import the proxy-wasm Rust SDK 0.2.5 declares (`src/hostcalls.rs`), with its wasm32
/// signature: `usize`, pointers, enums and `bool` are i32; metric values are i64.
const SDK_0_2_5_IMPORTS: &[(&str, usize, bool)] = &[
    // (name, number of i32 params, whether an i64 follows)
    ("proxy_log", 3, false),
    ("proxy_get_log_level", 1, false),
    ("proxy_get_current_time_nanoseconds", 1, false),
    ("proxy_set_tick_period_milliseconds", 1, false),
    ("proxy_get_buffer_bytes", 5, false),
    ("proxy_set_buffer_bytes", 5, false),
    ("proxy_get_header_map_pairs", 3, false),
    ("proxy_set_header_map_pairs", 3, false),
    ("proxy_get_header_map_value", 5, false),
    ("proxy_remove_header_map_value", 3, false),
    ("proxy_replace_header_map_value", 5, false),
    ("proxy_add_header_map_value", 5, false),
    ("proxy_get_property", 4, false),
    ("proxy_set_property", 4, false),
    ("proxy_get_shared_data", 5, false),
    ("proxy_set_shared_data", 5, false),
    ("proxy_register_shared_queue", 3, false),
    ("proxy_resolve_shared_queue", 5, false),
    ("proxy_dequeue_shared_queue", 3, false),
    ("proxy_enqueue_shared_queue", 3, false),
    ("proxy_continue_stream", 1, false),
    ("proxy_close_stream", 1, false),
    ("proxy_send_local_response", 8, false),
    ("proxy_http_call", 10, false),
    ("proxy_grpc_call", 12, false),
    ("proxy_grpc_stream", 9, false),
    ("proxy_grpc_send", 4, false),
    ("proxy_grpc_cancel", 1, false),
    ("proxy_grpc_close", 1, false),
    ("proxy_get_status", 3, false),
    ("proxy_set_effective_context", 1, false),
    ("proxy_call_foreign_function", 6, false),
    ("proxy_done", 0, false),
    ("proxy_define_metric", 4, false),
    ("proxy_get_metric", 2, false),
    ("proxy_record_metric", 1, true),
    ("proxy_increment_metric", 1, true),
];

#[test]
fn every_import_the_sdk_can_emit_is_implemented() {
    let imports: String = SDK_0_2_5_IMPORTS
        .iter()
        .map(|(name, i32s, i64)| {
            let mut params = vec!["i32"; *i32s];
            if *i64 {
                params.push("i64");
            }
            format!("(import \"env\" \"{name}\" (func (param {}) (result i32)))\n", params.join(" "))
        })
        .collect();
    let wat = format!("(module\n{imports})");
    assert_eq!(unimplemented_imports(wat.as_bytes()), Vec::<String>::new());
}

#[test]
fn a_missing_hostcall_is_reported() {
    let wat = r#"(module
        (import "env" "proxy_log" (func (param i32 i32 i32) (result i32)))
        (import "env" "proxy_not_in_the_abi" (func (param i32) (result i32)))
        (import "env" "proxy_get_current_time_nanoseconds" (func (param i64) (result i32))))"#;
    let missing = unimplemented_imports(wat.as_bytes());
    assert_eq!(missing.len(), 2, "{missing:?}");
    assert_eq!(missing[0], "proxy_not_in_the_abi: not defined");
    assert!(missing[1].starts_with("proxy_get_current_time_nanoseconds: plugin wants (i64)"), "{missing:?}");
}

/// A minimal plugin by hand: it loads although it imports a function nobody defines, and traps
/// only when it calls it.
const UNKNOWN_IMPORT_PLUGIN: &str = r#"(module
    (import "env" "proxy_from_the_future" (func $future (result i32)))
    (memory (export "memory") 1)
    (global $heap (mut i32) (i32.const 1024))
    (func (export "proxy_abi_version_0_2_1"))
    (func (export "proxy_on_memory_allocate") (param i32) (result i32)
        (local $p i32)
        (local.set $p (global.get $heap))
        (global.set $heap (i32.add (global.get $heap) (local.get 0)))
        (local.get $p))
    (func (export "proxy_on_context_create") (param i32 i32))
    (func (export "proxy_on_vm_start") (param i32 i32) (result i32) (i32.const 1))
    (func (export "proxy_on_configure") (param i32 i32) (result i32) (i32.const 1))
    (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
        (drop (call $future))
        (i32.const 0)))"#;

#[test]
fn unknown_imports_trap_when_called_not_at_load() {
    let gw = Gateway::from_bytes(UNKNOWN_IMPORT_PLUGIN.as_bytes(), "").expect("loads despite the unknown import");
    assert_eq!(unimplemented_imports(UNKNOWN_IMPORT_PLUGIN.as_bytes()), ["proxy_from_the_future: not defined"]);
    let mut s = gw.stream();
    let error = s.request_headers(&[(":path", "/")], true).expect_err("the call traps");
    assert!(format!("{error:#}").contains("proxy_on_request_headers"), "{error:#}");
    assert!(gw.crashed().is_some());
}

#[test]
fn a_module_without_the_abi_marker_is_refused() {
    let error = Gateway::from_bytes(b"(module (memory (export \"memory\") 1))", "").err().expect("refused");
    assert!(format!("{error:#}").contains("proxy_abi_version_0_2_1"), "{error:#}");
}
