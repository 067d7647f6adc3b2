//! Shared by the integration tests: builds the test plugin (once per test binary) and compiles it
//! (once; a compiled `Plugin` is immutable and shared, every test starts its own `Gateway`).

#![allow(dead_code)] // each test binary uses a different part

pub mod budget;
pub mod latency;
pub mod llm;
pub mod router;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use sluice_host::{Gateway, Plugin, PluginSpec};

/// Which build the policy suites run: each policy's own `.wasm` with its policy as is, or, with
/// `SLUICE_HARNESS_BUILD=sluice` (the test command runs the suites both ways), `sluice.wasm` with
/// the same policy as its section: one engine, two builds, one behaviour.
pub fn one_filter() -> bool {
    std::env::var("SLUICE_HARNESS_BUILD").is_ok_and(|v| v == "sluice")
}

/// The `.wasm` stem of the build under test for the policy built as `single`.
pub fn build_stem(single: &'static str) -> &'static str {
    if one_filter() {
        "sluice"
    } else {
        single
    }
}

/// A policy's configuration `policy` as the build under test reads it: unwrapped, or as `section`
/// of sluice.wasm's configuration (an empty policy is an empty section).
pub fn section_spec(section: &str, policy: &str) -> PluginSpec {
    if !one_filter() {
        return PluginSpec::new(policy);
    }
    let policy = if policy.trim().is_empty() { "{}" } else { policy };
    PluginSpec::new(format!("{{\"{section}\":{policy}}}"))
}

/// The policy a gateway of the build under test runs, from its configuration (`section`'s member
/// for sluice.wasm).
pub fn policy_of(configuration: &[u8], section: &str) -> Vec<u8> {
    if !one_filter() {
        return configuration.to_vec();
    }
    let whole: serde_json::Value = serde_json::from_slice(configuration).expect("sluice.wasm's configuration is JSON");
    whole.get(section).map(|v| v.to_string().into_bytes()).unwrap_or_default()
}

/// What the build under test logs for a configuration that is not JSON at all: the policy's own
/// words (`single`), or sluice.wasm's, whose section cannot be told apart in broken JSON.
pub fn not_json_refusal(single: &str) -> String {
    if one_filter() {
        "sluice: configuration refused: configuration is not valid JSON".to_string()
    } else {
        single.to_string()
    }
}

/// The configuration most tests use: a 100 ms tick.
pub const CONFIG: &str = r#"{"tick_ms": 100}"#;

pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Builds `host-tests/test-plugin` for wasm32-wasip1 (cargo is a no-op when it is up to date)
/// and returns the path of the `.wasm`.
pub fn test_plugin_wasm() -> PathBuf {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match BUILT.get_or_init(build_test_plugin) {
        Ok(path) => path.clone(),
        Err(error) => panic!("{error}"),
    }
}

fn build_test_plugin() -> Result<PathBuf, String> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("test-plugin/Cargo.toml");
    let target_dir = sluice_host::workspace_target_dir().join("test-plugin");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(cargo)
        .args(["build", "--release", "--target", "wasm32-wasip1", "--manifest-path"])
        .arg(&manifest)
        .arg("--target-dir")
        .arg(&target_dir)
        // Flags meant for the host build (coverage, sanitizers) do not apply to wasm.
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_TARGET_DIR")
        .output()
        .map_err(|e| format!("cannot run cargo to build the test plugin: {e}"))?;
    let wasm = target_dir.join("wasm32-wasip1/release/sluice_host_test_plugin.wasm");
    if !output.status.success() || !wasm.exists() {
        return Err(format!(
            "building the test plugin failed (is the wasm32-wasip1 target installed? \
             `rustup target add wasm32-wasip1`):\n{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(wasm)
}

/// The compiled test plugin.
pub fn test_plugin() -> Plugin {
    static PLUGIN: OnceLock<Plugin> = OnceLock::new();
    PLUGIN.get_or_init(|| Plugin::load(test_plugin_wasm()).expect("the test plugin compiles")).clone()
}

/// A fresh gateway running the test plugin with [`CONFIG`].
pub fn gateway() -> Gateway {
    Gateway::start(&test_plugin(), PluginSpec::new(CONFIG)).expect("the test plugin starts")
}
