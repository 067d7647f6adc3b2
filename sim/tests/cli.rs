//! The `sluice-sim` binary as a script runs it: outputs, exit codes (0 done, 1 failed, 2 bad flags,
//! scenario or policy, 3 bad trace, 4 compare found differences) and what stderr says.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use sluice_sim::verdict::{Decision, Verdict};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

fn repo_str(path: &str) -> String {
    repo(path).canonicalize().unwrap().to_string_lossy().into_owned()
}

/// A fresh, empty directory for one test.
fn workdir(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("sim-cli").join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn sim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sluice-sim")).args(args).output().unwrap()
}

fn code(out: &Output) -> i32 {
    out.status.code().expect("exited, not killed")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_string_lossy().into_owned()
}

fn verdicts(dir: &Path) -> Vec<Verdict> {
    let text = std::fs::read_to_string(dir.join("verdicts.jsonl")).unwrap();
    text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect()
}

fn json_file(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Asserts the three outputs of a run are there, and returns the verdicts.
fn outputs(dir: &Path, requests: usize) -> Vec<Verdict> {
    let v = verdicts(dir);
    assert_eq!(v.len(), requests, "one verdicts.jsonl line per request");
    let lines = std::fs::read_to_string(dir.join("verdicts.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), requests);
    assert!(lines.ends_with('\n'));
    let summary = json_file(&dir.join("summary.json"));
    assert_eq!(summary["requests"], requests as u64, "{summary}");
    assert_eq!(summary["source"], "simulated");
    let html = std::fs::read_to_string(dir.join("report.html")).unwrap();
    assert!(html.contains("<html") && html.trim_end().ends_with("</html>"), "report.html is a whole page");
    v
}

/// A scenario with llm-metrics alone (the shipped demo policy, by absolute path).
fn metrics_scenario(dir: &Path) -> String {
    let s = json!({ "plugins": { "llm_metrics": repo_str("policies/llm-metrics.demo.json") } });
    write(dir, "metrics.scenario.json", &s.to_string())
}

const AZURE: &str = "sim/traces/azure-2023-conv/azure-2023-conv.first-2000.csv";

// ---------------------------------------------------------------------------------------------
// run
// ---------------------------------------------------------------------------------------------

#[test]
fn run_on_the_generic_example() {
    let dir = workdir("run_generic");
    let out_dir = dir.join("out");
    let out = sim(&[
        "run",
        "--scenario",
        &repo_str("examples/sim/demo.scenario.json"),
        "--trace",
        &repo_str("sim/traces/generic/example.jsonl"),
        "--out",
        out_dir.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    // Five lines, one blank: four requests, by their line numbers.
    let v = outputs(&out_dir, 4);
    let mut lines: Vec<u64> = v.iter().map(|v| v.line).collect();
    lines.sort_unstable();
    assert_eq!(lines, [1, 2, 4, 5]);
    let l1 = v.iter().find(|v| v.line == 1).unwrap();
    assert_eq!((l1.tenant.as_deref(), l1.user.as_deref(), l1.prompt_tokens, l1.stream), (Some("acme"), Some("u-17"), 812, true));
    let l4 = v.iter().find(|v| v.line == 4).unwrap();
    assert_eq!((l4.api.as_str(), l4.arrival_ms), ("messages", 980.0));
}

#[test]
fn run_on_an_azure_slice_with_limit() {
    let dir = workdir("run_azure");
    let out_dir = dir.join("out");
    let out = sim(&[
        "run",
        "--scenario",
        &repo_str("examples/sim/demo.scenario.json"),
        "--trace",
        &repo_str(AZURE),
        "--limit",
        "120",
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let v = outputs(&out_dir, 120);
    let mut lines: Vec<u64> = v.iter().map(|v| v.line).collect();
    lines.sort_unstable();
    // The header is line 1: the first 120 requests are lines 2–121.
    assert_eq!(lines, (2..=121).collect::<Vec<_>>());
    // The first row: 374 prompt tokens, 44 generated; the demo's traffic streams and asks for
    // exactly the output ("max_tokens": "output").
    let first = v.iter().find(|v| v.line == 2).unwrap();
    assert_eq!((first.prompt_tokens, first.stream, first.arrival_ms), (374, true, 0.0));
    assert_eq!(first.output_tokens, 44, "{first:#?}");
    // Not quiet: the closing line says what was done.
    assert!(stderr(&out).contains("120 requests"), "{}", stderr(&out));
}

#[test]
fn run_with_no_report_writes_verdicts_only() {
    let dir = workdir("run_no_report");
    let out_dir = dir.join("out");
    let scenario = metrics_scenario(&dir);
    let out = sim(&["run", "--scenario", &scenario, "--trace", &repo_str(AZURE), "--limit", "30", "--out", out_dir.to_str().unwrap(), "-q", "--no-report"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(verdicts(&out_dir).len(), 30);
    assert!(!out_dir.join("summary.json").exists() && !out_dir.join("report.html").exists());
}

/// A scenario in which key `k1` sends everything and may send one request a minute.
fn one_request_a_minute(dir: &Path) -> String {
    let s = json!({
        "plugins": {
            "tenant_budget": {
                "identity": { "header": "x-sluice-tenant" },
                "orgs": [{ "id": "o", "teams": [{ "id": "t", "keys": [{ "id": "k1", "budgets": [{ "window": "minute", "requests": 1 }] }] }] }]
            },
            "llm_metrics": repo_str("policies/llm-metrics.demo.json")
        },
        "traffic": { "tenants": [{ "name": "k1" }] }
    });
    write(dir, "one-a-minute.json", &s.to_string())
}

#[test]
fn budget_windows_follow_the_traces_own_clock_unless_told_otherwise() {
    let dir = workdir("start_time");
    let scenario = one_request_a_minute(&dir);
    let admitted = |out_dir: &Path| {
        let v = verdicts(out_dir);
        assert_eq!(v.len(), 100);
        for v in v.iter().filter(|v| v.decision != Decision::Admitted) {
            assert_eq!((v.status, v.code.as_deref()), (429, Some("key:k1:minute:requests")), "{v:#?}");
        }
        let mut lines: Vec<u64> = v.iter().filter(|v| v.decision == Decision::Admitted).map(|v| v.line).collect();
        lines.sort_unstable();
        lines
    };
    // The Azure slice starts at 2023-11-16 18:15:46.6805900 UTC: by default the budget's minute
    // rolls 13.3194100 s into the replay, so the first request and the first one at or after that
    // offset are admitted.
    let rows = std::fs::read_to_string(repo(AZURE)).unwrap();
    let first_after_roll =
        rows.lines().enumerate().skip(1).find(|(_, row)| row.split(',').next().unwrap() >= "2023-11-16 18:16:00").map(|(i, _)| i as u64 + 1).unwrap();
    assert!(first_after_roll < 102, "within the first 100 requests (line {first_after_roll})");
    let out = sim(&["run", "--scenario", &scenario, "--trace", &repo_str(AZURE), "--limit", "100", "--out", dir.join("own").to_str().unwrap(), "-q"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(admitted(&dir.join("own")), [2, first_after_roll]);
    // Told to start at 18:16:00.000: the next minute starts after the first 100 requests (21 s).
    let out = sim(&[
        "run",
        "--scenario",
        &scenario,
        "--trace",
        &repo_str(AZURE),
        "--limit",
        "100",
        "--start-unix-ms",
        "1700158560000",
        "--out",
        dir.join("told").to_str().unwrap(),
        "-q",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(admitted(&dir.join("told")), [2]);
}

#[test]
fn limit_zero_replays_nothing() {
    let dir = workdir("limit_zero");
    let out_dir = dir.join("out");
    let scenario = metrics_scenario(&dir);
    let out = sim(&["run", "--scenario", &scenario, "--trace", &repo_str(AZURE), "--limit", "0", "--out", out_dir.to_str().unwrap(), "-q"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(verdicts(&out_dir).len(), 0);
}

#[test]
fn help_mentions_every_flag() {
    let top = sim(&["--help"]);
    assert_eq!(code(&top), 0);
    let text = String::from_utf8_lossy(&top.stdout);
    for word in ["run", "compare", "observe", "Exit codes"] {
        assert!(text.contains(word), "sluice-sim --help lacks {word}:\n{text}");
    }
    let trace_flags = ["--trace", "--format", "--on-malformed", "--out-of-order", "--limit"];
    let run_flags = ["--wasm-dir", "--start-unix-ms", "--time-scale", "--quiet", "--no-report"];
    let cases: [(&str, Vec<&str>); 3] = [
        ("run", [&trace_flags[..], &run_flags[..], &["--scenario", "--out"]].concat()),
        ("compare", [&trace_flags[..], &run_flags[..], &["--a", "--b", "--out", "--fail-on-difference"]].concat()),
        ("observe", vec!["--access-log", "--out", "--skip-malformed"]),
    ];
    for (command, flags) in cases {
        let out = sim(&[command, "--help"]);
        assert_eq!(code(&out), 0);
        let text = String::from_utf8_lossy(&out.stdout);
        for flag in flags {
            assert!(text.contains(&format!("{flag} ")) || text.contains(&format!("{flag}\n")), "sluice-sim {command} --help lacks {flag}:\n{text}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Bad traces (exit 3)
// ---------------------------------------------------------------------------------------------

const TRACE_WITH_BAD_LINE_3: &str = "{\"t_ms\": 0, \"prompt_tokens\": 12}\n{\"t_ms\": 5, \"prompt_tokens\": 12}\n{\"t_ms\": 7, \"prompt_tokens\": \"zz\"}\n{\"t_ms\": 9, \"prompt_tokens\": 12}\n";

#[test]
fn a_malformed_line_fails_with_its_line_number() {
    let dir = workdir("malformed_fail");
    let out_dir = dir.join("out");
    let trace = write(&dir, "trace.jsonl", TRACE_WITH_BAD_LINE_3);
    let out = sim(&["run", "--scenario", &metrics_scenario(&dir), "--trace", &trace, "--out", out_dir.to_str().unwrap(), "-q"]);
    assert_eq!(code(&out), 3, "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("line 3, field `prompt_tokens`"), "{err}");
}

#[test]
fn a_malformed_line_is_skipped_and_reported() {
    let dir = workdir("malformed_skip");
    let out_dir = dir.join("out");
    let trace = write(&dir, "trace.jsonl", TRACE_WITH_BAD_LINE_3);
    let out = sim(&["run", "--scenario", &metrics_scenario(&dir), "--trace", &trace, "--out", out_dir.to_str().unwrap(), "-q", "--on-malformed", "skip"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(stderr(&out).contains("line 3, field `prompt_tokens`"), "{}", stderr(&out));
    let mut lines: Vec<u64> = outputs(&out_dir, 3).iter().map(|v| v.line).collect();
    lines.sort_unstable();
    assert_eq!(lines, [1, 2, 4]);
}

#[test]
fn a_malformed_first_line_fails_too() {
    let dir = workdir("malformed_first");
    let out_dir = dir.join("out");
    // Detected as generic (t_ms and prompt_tokens are there); the value is wrong.
    let trace = write(&dir, "trace.jsonl", "{\"t_ms\": 0, \"prompt_tokens\": \"12x\"}\n{\"t_ms\": 5, \"prompt_tokens\": 12}\n");
    let out = sim(&["run", "--scenario", &metrics_scenario(&dir), "--trace", &trace, "--out", out_dir.to_str().unwrap(), "-q"]);
    assert!(stderr(&out).contains("line 1, field `prompt_tokens`"), "{}", stderr(&out));
    assert_eq!(code(&out), 3, "{}", stderr(&out));
}

#[test]
fn a_missing_trace_is_exit_3() {
    let dir = workdir("missing_trace");
    let out = sim(&[
        "run",
        "--scenario",
        &metrics_scenario(&dir),
        "--trace",
        dir.join("nope.jsonl").to_str().unwrap(),
        "--out",
        dir.join("out").to_str().unwrap(),
        "-q",
    ]);
    assert_eq!(code(&out), 3, "{}", stderr(&out));
    assert!(stderr(&out).contains("nope.jsonl"), "{}", stderr(&out));
}

// ---------------------------------------------------------------------------------------------
// Bad scenarios and policies (exit 2)
// ---------------------------------------------------------------------------------------------

fn run_scenario(dir: &Path, scenario: &Value) -> Output {
    let path = write(dir, "bad.scenario.json", &scenario.to_string());
    sim(&["run", "--scenario", &path, "--trace", &repo_str("sim/traces/generic/example.jsonl"), "--out", dir.join("out").to_str().unwrap(), "-q"])
}

#[test]
fn a_misspelled_scenario_field_names_its_path() {
    let dir = workdir("scenario_typo");
    let metrics = repo_str("policies/llm-metrics.demo.json");
    let out = run_scenario(&dir, &json!({ "plugins": { "llm_metrics": metrics }, "upstream": { "llama-v1": { "max_bach": 4 } } }));
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(stderr(&out).contains("field `upstream.llama-v1.max_bach`"), "{}", stderr(&out));
    let out = run_scenario(&dir, &json!({ "plugins": { "llm_metrics": metrics }, "traffic": { "tenant_heder": "x-tenant" } }));
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(stderr(&out).contains("field `traffic.tenant_heder`"), "{}", stderr(&out));
    let out = run_scenario(&dir, &json!({ "plugins": { "llm_metrics": metrics }, "incidents": [{ "upstream": "v1", "from_s": 5, "to_s": 1 }] }));
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(stderr(&out).contains("field `incidents[0].to_s`"), "{}", stderr(&out));
    let out = sim(&[
        "run",
        "--scenario",
        &write(&dir, "ok.scenario.json", &json!({ "plugins": { "llm_metrics": metrics } }).to_string()),
        "--trace",
        &repo_str("sim/traces/generic/example.jsonl"),
        "--out",
        dir.join("out").to_str().unwrap(),
        "--time-scale",
        "0",
    ]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(stderr(&out).contains("--time-scale"), "{}", stderr(&out));
}

#[test]
fn a_policy_the_plugin_refuses_is_exit_2_with_the_plugins_message() {
    let dir = workdir("policy_refused");
    let out = run_scenario(
        &dir,
        &json!({
            "plugins": {
                "tenant_budget": {
                    "mode": "strict",
                    "identity": { "header": "x-sluice-tenant" },
                    "orgs": [{ "id": "o", "teams": [{ "id": "t", "keys": [{ "id": "k1" }] }] }],
                    "bogus_field": 1
                },
                "llm_metrics": repo_str("policies/llm-metrics.demo.json")
            }
        }),
    );
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    let err = stderr(&out);
    // tenant-budget's own words, from its log.
    assert!(err.contains("tenant-budget policy refused"), "{err}");
    assert!(err.contains("unknown field `bogus_field`"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// compare
// ---------------------------------------------------------------------------------------------

/// The size of the body the simulator sends for a streamed chat request of `prompt` tokens, output
/// limit `max_tokens` and user `u1` (the mock counts 4 characters a token after 4 per message).
fn chat_body_bytes(prompt: u64, max_tokens: u64) -> u64 {
    let text = "x".repeat(((prompt - 4) * 4) as usize);
    json!({"model": "llama-3-70b", "messages": [{"role": "user", "content": text}], "stream": true, "max_tokens": max_tokens, "user": "u1"}).to_string().len()
        as u64
}

fn budget_scenario(dir: &Path, name: &str, tokens: u64) -> String {
    let s = json!({
        "name": format!("{name}'s budget"),
        "plugins": {
            "tenant_budget": {
                "mode": "strict",
                "identity": { "header": "x-sluice-tenant" },
                "orgs": [{ "id": "o", "teams": [{ "id": "t", "keys": [{ "id": "k1", "budgets": [{ "window": "minute", "tokens": tokens }] }] }] }]
            },
            "llm_metrics": repo_str("policies/llm-metrics.demo.json")
        }
    });
    write(dir, &format!("{name}.json"), &s.to_string())
}

#[test]
fn compare_lists_exactly_the_requests_a_budget_change_refuses() {
    let dir = workdir("compare");
    // Six requests at once from key k1: prompt 100, limit 200, 50 produced.
    let line = |t: u64| {
        format!(
            "{{\"t_ms\": {t}, \"tenant\": \"k1\", \"user\": \"u1\", \"prompt_tokens\": 100, \"max_tokens\": 200, \"output_tokens\": 50, \"stream\": true}}\n"
        )
    };
    let trace = write(&dir, "trace.jsonl", &(0..6).map(|_| line(0)).collect::<String>());
    // Strict mode reserves the body's bytes + the output limit: today's budget holds all six, the
    // proposal three and a half.
    let reservation = chat_body_bytes(100, 200) + 200;
    let a = budget_scenario(&dir, "today", 10 * reservation);
    let b = budget_scenario(&dir, "proposal", 3 * reservation + reservation / 2);
    let out_dir = dir.join("out");
    let args = ["compare", "--a", &a, "--b", &b, "--trace", &trace, "--out", out_dir.to_str().unwrap(), "-q"];
    let out = sim(&args);
    assert_eq!(code(&out), 0, "differences alone do not fail without --fail-on-difference: {}", stderr(&out));
    assert!(stderr(&out).contains("3 of 6 requests get a different verdict"), "{}", stderr(&out));
    let va = outputs(&out_dir.join("a"), 6);
    let vb = outputs(&out_dir.join("b"), 6);
    assert!(va.iter().all(|v| v.decision == Decision::Admitted));
    assert_eq!(vb.iter().filter(|v| v.decision == Decision::Refused).count(), 3);
    // Each side is titled by its scenario's name, not its file's stem.
    let page = std::fs::read_to_string(out_dir.join("compare.html")).unwrap();
    assert!(page.contains("today&#39;s budget") || page.contains("today's budget"), "{page}");
    assert!(page.contains("proposal&#39;s budget") || page.contains("proposal's budget"));

    let c = json_file(&out_dir.join("compare.json"));
    assert_eq!((c["a_requests"].as_u64(), c["b_requests"].as_u64(), c["paired"].as_u64(), c["agree"].as_u64()), (Some(6), Some(6), Some(6), Some(3)), "{c:#}");
    let differing: Vec<u64> = c["differences"].as_array().unwrap().iter().map(|d| d["line"].as_u64().unwrap()).collect();
    assert_eq!(differing, [4, 5, 6], "the fourth request on is refused by the smaller budget");
    for d in c["differences"].as_array().unwrap() {
        assert_eq!((d["a"]["decision"].as_str(), d["a"]["code"].as_str()), (Some("admitted"), None), "{d:#}");
        assert_eq!((d["b"]["decision"].as_str(), d["b"]["code"].as_str()), (Some("refused"), Some("key:k1:minute:total_tokens")), "{d:#}");
        assert_eq!(d["tenant"], "k1");
    }
    let changes = c["decision_changes"].as_array().unwrap();
    assert!(changes.contains(&json!({"a": "admitted", "b": "admitted", "requests": 3})), "{changes:?}");
    assert!(changes.contains(&json!({"a": "admitted", "b": "refused", "requests": 3})), "{changes:?}");
    assert_eq!(changes.len(), 2);

    let gated = sim(&[&args[..], &["--fail-on-difference"]].concat());
    assert_eq!(code(&gated), 4, "{}", stderr(&gated));
    // The same scenario on both sides: no difference, even with the gate.
    let same = sim(&["compare", "--a", &a, "--b", &a, "--trace", &trace, "--out", dir.join("same").to_str().unwrap(), "-q", "--fail-on-difference"]);
    assert_eq!(code(&same), 0, "{}", stderr(&same));
    assert_eq!(json_file(&dir.join("same/compare.json"))["differences"], json!([]));
}

// ---------------------------------------------------------------------------------------------
// observe
// ---------------------------------------------------------------------------------------------

#[test]
fn observe_a_fleet_access_log() {
    let dir = workdir("observe");
    let out_dir = dir.join("out");
    let out = sim(&["observe", "--access-log", &repo_str("sim/traces/access-log/fleet-e2e.log"), "--out", out_dir.to_str().unwrap()]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(stderr(&out).contains("40 requests read (0 malformed lines skipped)"), "{}", stderr(&out));
    let v = verdicts(&out_dir);
    assert_eq!(v.len(), 40);
    assert_eq!(v.iter().filter(|v| v.decision == Decision::Refused).map(|v| v.line).collect::<Vec<_>>(), [11]);
    let summary = json_file(&out_dir.join("summary.json"));
    assert_eq!((summary["requests"].as_u64(), summary["source"].as_str()), (Some(40), Some("observed")));
    assert_eq!(summary["decisions"], json!({"admitted": 39, "clamped": 0, "refused": 1}));
    // The 39 whole answers' stamps (written before repetition was stamped): 6 of 2 tokens, 33 of 5.
    let q = &summary["quality"][0];
    assert_eq!((q["version"].as_str(), q["answers"].as_u64(), summary["quality"].as_array().map(Vec::len)), (Some("llama-3-70b"), Some(39), Some(1)));
    assert!((q["output_tokens_mean"].as_f64().unwrap() - 177.0 / 39.0).abs() < 1e-9);
    assert_eq!((q["output_tokens_p50"].as_f64(), q["output_tokens_p95"].as_f64()), (Some(5.0), Some(5.0)));
    assert_eq!((q["repetition_answers"].as_u64(), &q["repetition_mean_per_mille"]), (Some(0), &Value::Null));
    assert_eq!((q["empty"].as_u64(), q["truncated"].as_u64(), &q["by_finish"]), (Some(0), Some(0), &json!({"stop": 39})));
    let html = std::fs::read_to_string(out_dir.join("report.html")).unwrap();
    assert!(html.contains("</html>") && html.contains(r#"<h2 id="quality">Output quality</h2>"#));
}

#[test]
fn observe_a_malformed_access_log() {
    let dir = workdir("observe_malformed");
    let mut log = std::fs::read_to_string(repo("sim/traces/access-log/fleet-e2e.log")).unwrap();
    let second = log.find('\n').unwrap() + 1;
    log.insert_str(second, "{\"start_time\": \"not a time\", \"path\": \"/v1/chat/completions\"}\n");
    let path = write(&dir, "access.log", &log);
    let out = sim(&["observe", "--access-log", &path, "--out", dir.join("out").to_str().unwrap()]);
    assert_eq!(code(&out), 3, "{}", stderr(&out));
    assert!(stderr(&out).contains("line 2"), "{}", stderr(&out));
    let out = sim(&["observe", "--access-log", &path, "--out", dir.join("skip").to_str().unwrap(), "--skip-malformed"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(stderr(&out).contains("40 requests read (1 malformed lines skipped)"), "{}", stderr(&out));
    assert_eq!(verdicts(&dir.join("skip")).len(), 40);
}

/// The bundled RAGPulse slice: its `session_id` is the user, its week restart is honoured, and a
/// session's requests stick to one version (model-router's sticky key is the user first in the
/// fidelity scenario; here the demo's tenant-first key, so the user only names the request).
#[test]
fn run_on_the_ragpulse_slice() {
    let dir = workdir("run_ragpulse");
    let out_dir = dir.join("out");
    let out = sim(&[
        "run",
        "--scenario",
        &repo_str("examples/sim/demo.scenario.json"),
        "--trace",
        &repo_str("sim/traces/ragpulse/0_trace.rows-3700-3900.jsonl"),
        "--limit",
        "120",
        "--out",
        out_dir.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let v = outputs(&out_dir, 120);
    let first = v.iter().find(|v| v.line == 1).unwrap();
    assert_eq!((first.user.as_deref(), first.prompt_tokens, first.arrival_ms), (Some("1758071689502-um59j3d3rqdo"), 3129, 0.0));
    // Line 101 starts the second week-long run: 9,864 s after line 1 (docs/simulator.md).
    let restart = v.iter().find(|v| v.line == 101).unwrap();
    assert_eq!(restart.arrival_ms, 9_864_000.0);
    assert!(v.iter().all(|v| v.status == 200 || v.decision == Decision::Refused), "every request answered or refused");
}

/// A real gateway's access log as the trace: what the gateway saw, replayed under another policy.
#[test]
fn run_on_an_access_log() {
    let dir = workdir("run_access_log");
    let out_dir = dir.join("out");
    let out = sim(&[
        "run",
        "--scenario",
        &repo_str("examples/sim/demo.scenario.json"),
        "--trace",
        &repo_str("sim/traces/access-log/fleet-e2e.log"),
        "--out-of-order",
        "clamp",
        "--on-malformed",
        "skip",
        "--out",
        out_dir.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let v = verdicts(&out_dir);
    assert_eq!(v.len(), 40, "every line of the log is a request");
    // The log's keys (`k` 33 times, `lim` 7) become the tenant header; neither is a key of the
    // demo's budget policy, whose unknown keys are refused 401 `unknown_key`.
    let by_key = |k: &str| v.iter().filter(|v| v.key.as_deref() == Some(k) && v.tenant.as_deref() == Some(k)).count();
    assert_eq!((by_key("k"), by_key("lim")), (33, 7));
    for r in &v {
        assert_eq!(
            (r.decision, r.code.as_deref(), r.status, r.refused_by.as_deref()),
            (Decision::Refused, Some("unknown_key"), 401, Some("tenant-budget")),
            "line {}",
            r.line
        );
    }
}

/// Requests whose first token comes after latency-guard's TTFT deadline (both versions' upstreams
/// take 2.5 s; the demo guard's deadline is 2 s): the guard answers 504 at the deadline, so no
/// token reaches the client and the verdict has no TTFT — also when the upstream's first piece is
/// the next event after the guard's tick ended the stream (no sample in between: `--no-report`
/// takes none). With and without the report, the verdicts are the same bytes.
#[test]
fn a_stream_ended_at_its_deadline_has_no_ttft_with_or_without_samples() {
    let dir = workdir("deadline_no_ttft");
    let slow = json!({ "ttft_base_ms": 2500, "tpot_ms": 20, "max_batch": 8 });
    let s = json!({
        "plugins": {
            "latency_guard": repo_str("policies/latency-guard.demo.json"),
            "model_router": repo_str("policies/model-router.demo.json"),
            "llm_metrics": repo_str("policies/llm-metrics.demo.json")
        },
        "traffic": { "tenants": [{ "name": "acme" }], "model": "llama-3-70b", "stream": true },
        "upstream": { "llama-v1": slow, "llama-v2": slow, "qwen_v1": slow },
        "sample_every_ms": 1000
    });
    let scenario = write(&dir, "slow.scenario.json", &s.to_string());
    let trace =
        write(&dir, "trace.jsonl", &(0..5).map(|i| format!("{{\"t_ms\": {}, \"prompt_tokens\": 100, \"output_tokens\": 20}}\n", i * 100)).collect::<String>());
    let mut texts = Vec::new();
    for (name, extra) in [("report", None), ("no-report", Some("--no-report"))] {
        let out_dir = dir.join(name);
        let mut args = vec!["run", "--scenario", &scenario, "--trace", &trace, "--out", out_dir.to_str().unwrap(), "-q"];
        args.extend(extra);
        let out = sim(&args);
        assert_eq!(code(&out), 0, "{}", stderr(&out));
        for v in verdicts(&out_dir) {
            assert_eq!((v.status, v.outcome.as_str(), v.ttft_ms), (504, "deadline", None), "{name}: line {}", v.line);
        }
        texts.push(std::fs::read_to_string(out_dir.join("verdicts.jsonl")).unwrap());
    }
    assert_eq!(texts[0], texts[1]);
}
