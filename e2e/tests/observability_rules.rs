//! The shipped Prometheus rules, alerts and Grafana dashboard (`observability/`), offline:
//!
//! - `promtool check rules` on the rule and alert files, and the number of rules it finds equals the
//!   rules this test reads out of them (so the extraction below misses none);
//! - `promtool test rules` on every `observability/prometheus/tests/*.yaml`, and every alert has a
//!   case where it must fire and one where it must not;
//! - every PromQL expression of the dashboard, its template variables replaced by values, is
//!   valid PromQL to `promtool check rules`;
//! - every metric those expressions read is one sluice documents in `docs/*.md` (or a rule the
//!   rules file records), and every label they name is one the `stats_tags` of
//!   `envoy/templates/full-gateway.yaml` produce (or `le`, `job`, `instance`).
//!
//! The promtool parts are skipped when promtool is not installed, unless `SLUICE_ENVOY`,
//! `SLUICE_PROMTOOL` or `SLUICE_PROMETHEUS` is set (as `cargo xtask test` sets the first); the
//! metric and label checks always run.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use sluice_e2e::gateway::shipped;
use sluice_e2e::prometheus_server::promtool_bin;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

const RULES: &str = "observability/prometheus/sluice-rules.yaml";
const ALERTS: &str = "observability/prometheus/sluice-alerts.yaml";
const TESTS: &str = "observability/prometheus/tests";
const DASHBOARD: &str = "observability/grafana/sluice-dashboard.json";

/// Values for the dashboard's template variables: what Grafana would put in their place.
const VARIABLES: [(&str, &str); 5] =
    [("${model_version}", "v1|v2"), ("$model_version", "v1|v2"), ("$tenant", "acme|other"), ("$key", "acme"), ("$__rate_interval", "1m")];

fn promtool() -> Option<PathBuf> {
    match promtool_bin() {
        Ok(p) => Some(p),
        Err(e) if ["SLUICE_ENVOY", "SLUICE_PROMTOOL", "SLUICE_PROMETHEUS"].iter().all(|v| std::env::var_os(v).is_none()) => {
            eprintln!("skipping promtool checks: {e}");
            None
        }
        Err(e) => panic!("{e:#}"),
    }
}

/// Runs promtool with `args`; panics with its output unless it succeeds. Returns stdout + stderr.
fn run_promtool(tool: &Path, args: &[&str]) -> String {
    let out = Command::new(tool).args(args).current_dir(shipped(".")).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "promtool {} failed ({}):\n{text}", args.join(" "), out.status);
    text
}

/// One rule of a rule file: `record` or `alert`, its name, its expression.
#[derive(Debug)]
struct Rule {
    kind: &'static str,
    name: String,
    expr: String,
}

/// The rules of a rule file as this repository writes them: `- record:`/`- alert:` lines, and
/// `expr:` either inline or a block scalar (`|`, `>-`) of the lines indented deeper.
fn rules_of(path: &str) -> Vec<Rule> {
    let text = std::fs::read_to_string(shipped(path)).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let indent = |l: &str| l.len() - l.trim_start().len();
    let mut rules = Vec::new();
    let mut current: Option<(&'static str, String)> = None;
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        for kind in ["record", "alert"] {
            if let Some(name) = t.strip_prefix(&format!("- {kind}:")) {
                current = Some((kind, name.trim().to_string()));
            }
        }
        let Some(rest) = t.strip_prefix("expr:") else { continue };
        let rest = rest.trim();
        let expr = if rest.starts_with('|') || rest.starts_with('>') {
            let block: Vec<&str> = lines[i + 1..].iter().take_while(|l| l.trim().is_empty() || indent(l) > indent(line)).map(|l| l.trim()).collect();
            block.join("\n").trim().to_string()
        } else {
            rest.trim_matches(|c| c == '\'' || c == '"').to_string()
        };
        let (kind, name) = current.take().unwrap_or_else(|| panic!("{path}:{}: expr without a rule name", i + 1));
        rules.push(Rule { kind, name, expr });
    }
    rules
}

/// Every `expr` string anywhere in the dashboard JSON, variables replaced.
fn dashboard_exprs() -> Vec<String> {
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr", Value::String(e)) => out.push(e.clone()),
                        _ => walk(v, out),
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut raw = Vec::new();
    walk(&dashboard(), &mut raw);
    raw.into_iter().map(|e| VARIABLES.iter().fold(e, |e, (var, value)| e.replace(var, value))).collect()
}

fn dashboard() -> Value {
    serde_json::from_str(&std::fs::read_to_string(shipped(DASHBOARD)).unwrap()).unwrap()
}

/// The expression without the contents of its string literals (label values, regexes).
fn without_strings(expr: &str) -> String {
    let mut out = String::new();
    let mut in_string = false;
    for c in expr.chars() {
        if c == '"' {
            in_string = !in_string;
            out.push(c);
        } else if !in_string {
            out.push(c);
        }
    }
    out
}

fn identifiers(expr: &str) -> Vec<String> {
    let code = without_strings(expr);
    let mut ids = Vec::new();
    let mut cur = String::new();
    for c in code.chars().chain([' ']) {
        if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
            cur.push(c);
        } else {
            if cur.chars().next().is_some_and(|f| f.is_ascii_alphabetic() || f == '_') {
                ids.push(cur.clone());
            }
            cur.clear();
        }
    }
    ids
}

/// Label names an expression mentions: in selectors, in by/without/on/ignoring/group_* lists, and
/// label_replace's destination and source.
fn labels_in(expr: &str) -> BTreeSet<String> {
    let code = without_strings(expr);
    let mut labels = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(open) = rest.find('{') {
        let Some(close) = rest[open..].find('}') else { break };
        for m in rest[open + 1..open + close].split(',') {
            let name: String = m.trim().chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            if !name.is_empty() {
                labels.insert(name);
            }
        }
        rest = &rest[open + close..];
    }
    for kw in ["by", "without", "on", "ignoring", "group_left", "group_right"] {
        let mut rest = code.as_str();
        while let Some(at) = rest.find(kw) {
            let before_ok = at == 0 || !rest.as_bytes()[at - 1].is_ascii_alphanumeric() && rest.as_bytes()[at - 1] != b'_';
            let after = rest[at + kw.len()..].trim_start();
            if before_ok && after.starts_with('(') {
                if let Some(close) = after.find(')') {
                    labels.extend(after[1..close].split(',').map(|l| l.trim().to_string()).filter(|l| !l.is_empty()));
                }
            }
            rest = &rest[at + kw.len()..];
        }
    }
    // label_replace(v, "dst", "$1", "src", "re"): the two names are the string literals after the
    // first argument's top-level comma.
    let mut rest = expr;
    while let Some(at) = rest.find("label_replace(") {
        let args = &rest[at + "label_replace(".len()..];
        let mut depth = 0i32;
        let comma = args.char_indices().find(|&(_, c)| {
            depth += match c {
                '(' | '[' | '{' => 1,
                ')' | ']' | '}' => -1,
                _ => 0,
            };
            c == ',' && depth == 0
        });
        let strings: Vec<&str> = comma.map(|(i, _)| args[i..].split('"').collect()).unwrap_or_default();
        if strings.len() > 5 {
            labels.insert(strings[1].to_string());
            labels.insert(strings[5].to_string());
        }
        rest = args;
    }
    labels
}

/// Metric names sluice documents: every backticked `sluice_…` name in docs/*.md, except
/// docs/observability.md, which describes these rules (it names recorded metrics such as
/// `sluice_ttft_seconds` that no plugin exports).
fn documented_metrics() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for entry in std::fs::read_dir(shipped("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "md") || path.file_name().is_some_and(|n| n == "observability.md") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for chunk in text.split('`').skip(1).step_by(2) {
            let name: String = chunk.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            if name.starts_with("sluice_") {
                names.insert(name);
            }
        }
    }
    names
}

/// Label names the shipped gateway's stats_tags produce, plus `le` (histograms) and the target
/// labels Prometheus adds.
fn exported_labels() -> BTreeSet<String> {
    let yaml = std::fs::read_to_string(shipped("envoy/templates/full-gateway.yaml")).unwrap();
    let mut labels: BTreeSet<String> = yaml.lines().filter_map(|l| l.trim().strip_prefix("- tag_name:")).map(|n| n.trim().to_string()).collect();
    labels.extend(["le", "job", "instance"].map(String::from));
    labels
}

#[test]
fn the_rule_and_alert_files_pass_promtool_check_rules() {
    let rules = rules_of(RULES);
    let alerts = rules_of(ALERTS);
    assert!(rules.iter().all(|r| r.kind == "record") && alerts.iter().all(|r| r.kind == "alert"), "recording rules and alerts in their own files");
    let Some(tool) = promtool() else { return };
    for (path, n) in [(RULES, rules.len()), (ALERTS, alerts.len())] {
        let out = run_promtool(&tool, &["check", "rules", path]);
        assert!(out.contains(&format!("SUCCESS: {n} rules found")), "promtool found another number of rules in {path} than the {n} read here:\n{out}");
    }
    // Every alert carries what the docs promise: a severity and both annotations.
    let text = std::fs::read_to_string(shipped(ALERTS)).unwrap();
    for block in text.split("- alert:").skip(1) {
        let name = block.lines().next().unwrap_or("").trim();
        for field in ["severity:", "summary:", "description:"] {
            assert!(block.contains(field), "alert {name} has no {field}");
        }
    }
}

#[test]
fn promtool_unit_tests_pass_and_every_alert_has_cases_that_fire_and_that_do_not() {
    let mut files: Vec<String> =
        std::fs::read_dir(shipped(TESTS)).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n.ends_with(".yaml")).collect();
    files.sort();
    assert!(!files.is_empty(), "no promtool tests in {TESTS}");
    // Which alerts each case expects firing (`exp_alerts:` with entries) or silent (`exp_alerts: []`).
    let (mut fire, mut silent) = (BTreeSet::new(), BTreeSet::new());
    for f in &files {
        let text = std::fs::read_to_string(shipped(&format!("{TESTS}/{f}"))).unwrap();
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        for (i, l) in lines.iter().enumerate() {
            let Some(name) = l.strip_prefix("alertname:") else { continue };
            match lines.get(i + 1) {
                Some(&"exp_alerts: []") => silent.insert(name.trim().to_string()),
                Some(&"exp_alerts:") => fire.insert(name.trim().to_string()),
                other => panic!("{f}: alertname {name} followed by {other:?}"),
            };
        }
    }
    for alert in rules_of(ALERTS) {
        assert!(fire.contains(&alert.name), "no promtool case where {} must fire", alert.name);
        assert!(silent.contains(&alert.name), "no promtool case where {} must not fire", alert.name);
    }
    let Some(tool) = promtool() else { return };
    let paths: Vec<String> = files.iter().map(|f| format!("{TESTS}/{f}")).collect();
    let mut args = vec!["test", "rules"];
    args.extend(paths.iter().map(String::as_str));
    let out = run_promtool(&tool, &args);
    assert_eq!(out.matches("SUCCESS").count(), files.len(), "one SUCCESS per test file:\n{out}");
}

#[test]
fn every_dashboard_query_is_valid_promql() {
    let d = dashboard();
    let vars: BTreeSet<&str> = d["templating"]["list"].as_array().unwrap().iter().filter_map(|v| v["name"].as_str()).collect();
    for want in ["datasource", "model_version", "tenant"] {
        assert!(vars.contains(want), "dashboard variable {want} missing: {vars:?}");
    }
    let ds = d["templating"]["list"].as_array().unwrap().iter().find(|v| v["name"] == "datasource").unwrap();
    assert_eq!((&ds["type"], &ds["query"]), (&json!("datasource"), &json!("prometheus")));
    // Every panel and query reads the chosen data source.
    let panels: Vec<&Value> = d["panels"].as_array().unwrap().iter().filter(|p| p["type"] != "row").collect();
    let mut ids = BTreeSet::new();
    for p in &panels {
        assert!(ids.insert(p["id"].as_i64().unwrap()), "duplicate panel id {}", p["id"]);
        assert_eq!(p["datasource"]["uid"], "${datasource}", "panel {}", p["title"]);
        for t in p["targets"].as_array().unwrap() {
            assert_eq!(t["datasource"]["uid"], "${datasource}", "panel {}", p["title"]);
        }
    }
    let exprs = dashboard_exprs();
    assert!(exprs.len() >= panels.len(), "{} queries for {} panels", exprs.len(), panels.len());
    for e in &exprs {
        assert!(!e.contains('$'), "a template variable this test does not know: {e}");
    }
    let Some(tool) = promtool() else { return };
    // As recording rules, so promtool parses each query as PromQL.
    let rules: Vec<Value> = exprs.iter().enumerate().map(|(i, e)| json!({"record": format!("dashboard:query_{i}"), "expr": e})).collect();
    let file = std::env::temp_dir().join(format!("sluice-dashboard-queries-{}.yaml", std::process::id()));
    std::fs::write(&file, json!({"groups": [{"name": "dashboard", "rules": rules}]}).to_string()).unwrap();
    let out = Command::new(&tool).arg("check").arg("rules").arg(&file).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_file(&file);
    assert!(out.status.success(), "a dashboard query is not valid PromQL:\n{text}");
    assert!(text.contains(&format!("SUCCESS: {} rules found", exprs.len())), "{text}");
}

#[test]
fn every_metric_and_label_used_is_one_sluice_exports() {
    let rules = rules_of(RULES);
    let alerts = rules_of(ALERTS);
    let recorded: BTreeSet<String> = rules.iter().map(|r| r.name.clone()).collect();
    let documented = documented_metrics();
    let labels = exported_labels();
    let mut used = Vec::new();
    used.extend(rules.iter().map(|r| (format!("rule {}", r.name), r.expr.clone())));
    used.extend(alerts.iter().map(|r| (format!("alert {}", r.name), r.expr.clone())));
    used.extend(dashboard_exprs().into_iter().map(|e| ("dashboard".to_string(), e)));
    let mut wrong = Vec::new();
    let mut raw = BTreeSet::new();
    for (what, expr) in &used {
        for id in identifiers(expr) {
            if id.contains(':') {
                if !recorded.contains(&id) {
                    wrong.push(format!("{what}: {id} is recorded by no rule"));
                }
            } else if id.starts_with("sluice_") {
                let base = ["_bucket", "_count", "_sum"].iter().find_map(|s| id.strip_suffix(s).filter(|b| documented.contains(*b))).unwrap_or(&id);
                if !documented.contains(base) {
                    wrong.push(format!("{what}: metric {id} is not documented in docs/*.md"));
                }
                raw.insert(base.to_string());
            }
        }
        for l in labels_in(expr) {
            if !labels.contains(&l) {
                wrong.push(format!("{what}: label {l} is not produced by the gateway's stats_tags"));
            }
        }
    }
    // Labels the alert texts and the dashboard's legends print.
    let alert_text = std::fs::read_to_string(shipped(ALERTS)).unwrap();
    let dash_text = std::fs::read_to_string(shipped(DASHBOARD)).unwrap();
    for part in alert_text.split("$labels.").skip(1).chain(dash_text.split("{{").skip(1)) {
        let name: String = part.trim_start().chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        if !name.is_empty() && !labels.contains(&name) {
            wrong.push(format!("label {name} in an alert text or a legend is not produced by the stats_tags"));
        }
    }
    assert!(wrong.is_empty(), "{} problem(s):\n  {}", wrong.len(), wrong.join("\n  "));
    // The checks have something to check: the metrics the issue names are all read.
    for m in [
        "sluice_ttft_ms",
        "sluice_tpot_us",
        "sluice_decode_tokens_per_s",
        "sluice_cost_micro_usd_total",
        "sluice_requests_total",
        "sluice_in_flight",
        "sluice_latency_in_flight",
        "sluice_budget_remaining",
        "sluice_latency_breaker_state",
        "sluice_router_compare_total",
    ] {
        assert!(raw.contains(m), "{m} is read by no rule, alert or panel");
    }
}
