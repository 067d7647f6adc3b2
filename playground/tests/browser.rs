//! The page in a real browser: headless Chromium (Debian's `chromium`, installed by `cargo xtask
//! setup`) loads examples/playground/index.html from disk, runs the preloaded example, and the DOM
//! it leaves is read back (`--dump-dom` after the scripts finish in virtual time). The verdict
//! table must hold, tenant by tenant, what the native engine computes for the same example; a
//! policy broken through the URL must show the plugin's own refusal with its field path.
//! Needs `cargo xtask playground` (run by `cargo xtask build`) to have written pkg/.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use sluice_playground::{compile_json, run, RunInput};
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The page's DOM once its run finished (`data-run` is `done` or `error`), loaded from `file://`
/// with `query`. Chromium's virtual time does not wait for the engine's compilation, which on a
/// loaded machine can outlast the budget: so the tests take turns, and a dump taken before the run
/// finished is retried with a larger budget (the assertions are then made on a finished page).
fn dump_dom(query: &str) -> String {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut dom = String::new();
    for budget_ms in [10_000, 30_000, 90_000] {
        dom = dump_dom_once(query, budget_ms);
        if dom.contains("data-run=\"done\"") || dom.contains("data-run=\"error\"") {
            break;
        }
    }
    dom
}

fn dump_dom_once(query: &str, budget_ms: u32) -> String {
    let page = root().join("examples/playground/index.html").canonicalize().unwrap();
    assert!(root().join("examples/playground/pkg/wasm.js").exists(), "the page's engine is not built: run `cargo xtask playground` (cargo xtask build does)");
    let chromium = std::env::var("SLUICE_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    let profile = std::env::temp_dir().join(format!("sluice-playground-chromium-{}-{}", std::process::id(), query.len()));
    std::fs::create_dir_all(&profile).unwrap();
    let out = Command::new(&chromium)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking"])
        .args(["--disable-component-update", "--disable-sync", "--dump-dom"])
        .arg(format!("--virtual-time-budget={budget_ms}"))
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(format!("file://{}{query}", page.display()))
        .output()
        .unwrap_or_else(|e| panic!("{chromium}: {e} (install Debian's chromium: cargo xtask setup)"));
    let _ = std::fs::remove_dir_all(&profile);
    assert!(out.status.success(), "chromium failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// The text of the first element after `marker` (a start-tag fragment), up to its closing tag.
fn text_after<'a>(dom: &'a str, marker: &str, close: &str) -> Option<&'a str> {
    let at = dom.find(marker)?;
    let rest = &dom[at..];
    let start = rest.find('>')? + 1;
    let end = rest[start..].find(close)?;
    Some(&rest[start..start + end])
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", "\"").replace("&#39;", "'").replace("&amp;", "&")
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
fn the_preloaded_example_renders_the_engines_verdicts() {
    let dom = dump_dom("");
    assert!(dom.contains("data-run=\"done\""), "the run did not finish: {}", text_after(&dom, "id=\"load-status\"", "</p>").unwrap_or("?"));
    let expected = run(&example()).unwrap();
    assert!(expected.tenants.len() >= 4);
    for t in &expected.tenants {
        let row = text_after(&dom, &format!("<tr data-tenant=\"{}\"", t.tenant), "</tr>").unwrap_or_else(|| panic!("no row for {}", t.tenant));
        for (class, want) in [("requests", t.requests), ("admitted", t.admitted), ("clamped", t.clamped), ("refused", t.refused), ("tokens", t.charged_tokens)]
        {
            let got = text_after(row, &format!("<td class=\"{class}\""), "</td>").unwrap_or_else(|| panic!("no {class} cell for {}", t.tenant));
            assert_eq!(got, want.to_string(), "{} {class}", t.tenant);
        }
        let refusals = unescape(text_after(row, "<td class=\"refusals\"", "</td>").unwrap());
        let want: Vec<String> = t.refusals.iter().map(|(c, n)| format!("{c}: {n}")).collect();
        assert_eq!(refusals, want.join(", "), "{} refusals", t.tenant);
    }
    // Every chart drew something for the example (it has spend, budgets, refusals, a split and a breaker).
    assert!(!dom.contains("Nothing to show"), "a chart is empty");
    assert_eq!(dom.matches("<svg").count(), 5);
}

#[test]
fn a_broken_policy_shows_the_plugins_refusal_with_its_field() {
    let dom = dump_dom("?case=broken-budget");
    let status = unescape(text_after(&dom, "id=\"status-tenant-budget\"", "</p>").unwrap());
    let expected = "tenant-budget policy refused: orgs[0].budgets[0].reset_day: must be 1–28 (a day every month has), got 31";
    assert_eq!(status, expected);
    // The same text the native binding returns for that policy, and the run refuses to start.
    let mut p: serde_json::Value = serde_json::from_str(&read("policies/tenant-budget.full.json")).unwrap();
    p["orgs"][0]["budgets"][0]["reset_day"] = 31.into();
    let native: serde_json::Value = serde_json::from_str(&compile_json("tenant-budget", &p.to_string())).unwrap();
    assert_eq!(native["log"], expected);
    assert_eq!(unescape(text_after(&dom, "id=\"run-status\"", "</span>").unwrap()), expected);
    assert!(dom.contains("data-run=\"error\""));
    assert!(dom.contains("class=\"status error\""));
}
