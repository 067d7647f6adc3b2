//! The Envoy files shipped ready to run, `envoy/rendered/<gateway>.yaml`:
//!
//! - each is byte for byte what `cargo xtask render` makes of its template and example policies
//!   now (the same code, `sluice_envoy_render`), so they never drift from their sources;
//! - each passes `envoy --mode validate`, run from the repository root as the files say — a
//!   native gateway only on Envoy 1.40 (`libsluice.so`'s ABI); older releases refuse it at load
//!   with the module's reason;
//! - a rendered file with a broken policy inlined fails validation, with the plugin's message:
//!   Envoy 1.40 runs every plugin's `on_configure` while validating and refuses the whole file when
//!   one returns false, whatever the filter's `failure_policy` (FAIL_OPEN included).
//!
//! The validation tests are skipped when Envoy is not installed (unless `SLUICE_ENVOY` is set).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use sluice_e2e::tools::workspace_root;
use sluice_e2e::{Envoy, Tools};
use sluice_envoy_render::{gateway, GATEWAYS};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn yaml_stems(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .map(|p| p.file_stem().and_then(|s| s.to_str()).expect("UTF-8 file name").to_string())
        .collect()
}

/// The first line where two texts differ, for a failure message that says where to look.
fn first_difference(a: &str, b: &str) -> String {
    for (i, (x, y)) in a.lines().zip(b.lines()).enumerate() {
        if x != y {
            return format!("line {}:\n  committed: {x}\n  rendered:  {y}", i + 1);
        }
    }
    format!("the committed file has {} lines, a fresh render {}", a.lines().count(), b.lines().count())
}

#[test]
fn every_rendered_file_is_what_its_template_and_policies_give_now() {
    let root = workspace_root();
    let names: BTreeSet<String> = GATEWAYS.iter().map(|g| g.name.to_string()).collect();
    // Every gateway template is rendered, and nothing else is in envoy/rendered/.
    assert_eq!(yaml_stems(&root.join("envoy/templates")), names, "envoy/templates/*.yaml and the render catalogue (envoy/render/src/lib.rs) differ");
    assert_eq!(yaml_stems(&root.join("envoy/rendered")), names, "envoy/rendered/ holds other files: run `cargo xtask render --all`");
    for gw in GATEWAYS {
        let path = root.join(gw.rendered_path());
        let committed = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let fresh = gw.render(&root).unwrap_or_else(|e| panic!("rendering {}: {e}", gw.name));
        assert!(
            committed == fresh,
            "{} is stale: run `cargo xtask render --all`; first difference at {}",
            gw.rendered_path(),
            first_difference(&committed, &fresh)
        );
        assert!(!fresh.contains("{{"), "{}: a placeholder survived", gw.name);
    }
}

#[test]
fn every_rendered_file_passes_envoy_validate_from_the_repository_root() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let root = workspace_root();
    // libsluice.so is built for exactly Envoy 1.40.0's dynamic-module ABI: on every other release
    // (the Envoy matrix runs this test on 1.36–1.39) a native gateway must be refused at load,
    // with the module's own line naming what that Envoy lacks and the release it was built for.
    let release = Envoy::release().unwrap();
    let native_loads = release.starts_with("1.40.");
    let results = two_at_a_time(GATEWAYS, |gw| {
        let path = root.join(gw.rendered_path());
        let outcome = Envoy::validate_in(&path, Some(&root)).map_err(|e| format!("{e:#}"));
        let outcome = match (gw.native && !native_loads, outcome) {
            (false, outcome) => outcome,
            (true, Ok(())) => Err(format!("Envoy {release} validated a native gateway built for 1.40.0")),
            (true, Err(e))
                if e.contains("sluice-native: refusing to load: this Envoy does not export") && e.contains("libsluice.so is built for Envoy 1.40.0") =>
            {
                Ok(())
            }
            (true, Err(e)) => Err(format!("Envoy {release} refused a native gateway without the module's reason:\n{e}")),
        };
        (gw.rendered_path(), outcome)
    });
    let failed: Vec<String> = results.iter().filter_map(|(p, r)| r.as_ref().err().map(|e| format!("{p}: {e}"))).collect();
    assert!(failed.is_empty(), "rendered files Envoy {release} refuses (built the plugins? `cargo xtask build`):\n{}", failed.join("\n"));
    assert_eq!(results.len(), GATEWAYS.len());
    assert!(GATEWAYS.iter().any(|gw| gw.native), "a native gateway is among the shipped ones");
}

/// `f` over `items` on two threads: a validation is CPU-bound (V8 compiles every plugin), and
/// more at once on a 2-core machine only makes each slower.
fn two_at_a_time<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let (f, half) = (&f, items.len().div_ceil(2));
    std::thread::scope(|s| {
        let handles: Vec<_> = items.chunks(half.max(1)).map(|chunk| s.spawn(move || chunk.iter().map(f).collect::<Vec<R>>())).collect();
        handles.into_iter().flat_map(|h| h.join().expect("validation thread")).collect()
    })
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-shipped-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_rendered_file_with_a_broken_policy_inlined_fails_validation_with_the_plugins_message() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let root = workspace_root();
    let policy = |file: &str| std::fs::read_to_string(root.join("policies").join(file)).unwrap();
    // One plugin alone in its file each (Envoy stops at the first refusal anyway): llm-metrics is
    // FAIL_OPEN, tenant-budget FAIL_CLOSED; measured alike, the whole file is refused.
    let cases = [
        (
            "gateway",
            "PLUGIN_CONFIG",
            r#""path_prefixes": ["v1/"]"#,
            policy("llm-metrics.demo.json").replace(r#""path_prefixes": ["/v1/"]"#, r#""path_prefixes": ["v1/"]"#),
            ["llm-metrics: configuration refused: path_prefixes[0]: must start with '/'", "Unable to create Wasm plugin sluice"],
        ),
        (
            "budget-gateway",
            "BUDGET_CONFIG",
            r#""mode": "sloppy""#,
            policy("tenant-budget.example.json").replace(r#""mode": "strict""#, r#""mode": "sloppy""#),
            ["sloppy", "Unable to create Wasm plugin sluice"],
        ),
    ];
    let dir = scratch("broken");
    let outcomes = two_at_a_time(&cases, |(name, placeholder, marker, broken, _)| {
        let gw = gateway(name).expect("a shipped gateway");
        let text = gw.render_with(&root, &[], &[(placeholder, broken)]).unwrap();
        assert!(text.contains(marker), "{name}: the breaking edit is not in the rendered file");
        let path = dir.join(format!("{name}.yaml"));
        std::fs::write(&path, text).unwrap();
        Envoy::validate_in(&path, Some(&root)).map_err(|e| format!("{e:#}"))
    });
    for ((name, placeholder, _, _, expected), outcome) in cases.iter().zip(outcomes) {
        let err = match outcome {
            Ok(()) => panic!("{name}: Envoy validated a file whose {placeholder} its plugin refuses"),
            Err(e) => e,
        };
        for needle in expected {
            assert!(err.contains(needle), "{name}: {needle:?} not in Envoy's output:\n{err}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
