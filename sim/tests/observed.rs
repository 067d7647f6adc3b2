//! A real gateway's access log read into verdicts: values of specific lines of the sample logs in
//! `sim/traces/access-log/`, the decision rules on hand-written lines, and errors with line numbers.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use sluice_sim::observed::{read_access_log, ObservedError, MAX_LINE_BYTES};
use sluice_sim::report::{render_html, summarize, ReportInput, Source};
use sluice_sim::verdict::{Decision, Verdict};
use std::io::{BufReader, Cursor};
use std::path::Path;

fn read_file(name: &str) -> Vec<Verdict> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/access-log").join(name);
    let file = std::fs::File::open(&path).unwrap();
    read_access_log(BufReader::new(file)).collect::<Result<Vec<_>, _>>().unwrap()
}

fn read_text(text: &str) -> Vec<Result<Verdict, ObservedError>> {
    read_access_log(Cursor::new(text.as_bytes().to_vec())).collect()
}

fn line(verdicts: &[Verdict], n: u64) -> &Verdict {
    verdicts.iter().find(|v| v.line == n).unwrap_or_else(|| panic!("no verdict of line {n}"))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn fleet_log_lines() {
    let v = read_file("fleet-e2e.log");
    assert_eq!(v.len(), 40);
    assert_eq!(v.iter().map(|v| v.line).collect::<Vec<_>>(), (1..=40).collect::<Vec<_>>());

    // Line 1: a whole answer on key `lim`, the trace's origin.
    let l1 = line(&v, 1);
    assert_eq!(l1.arrival_ms, 0.0);
    assert_eq!(l1.decision, Decision::Admitted);
    assert_eq!(l1.key.as_deref(), Some("lim"));
    assert_eq!(l1.tenant, None, "llm-metrics' `anonymous` is no tenant");
    assert_eq!(l1.version.as_deref(), Some("llama-3-70b"), "no route stamp: llm-metrics' model_version");
    assert_eq!(l1.route_reason, None);
    assert!(!l1.stream);
    assert_eq!((l1.input_tokens, l1.output_tokens, l1.prompt_tokens), (5, 2, 5));
    assert_eq!(l1.ttft_ms, None);
    assert!(close(l1.duration_ms, 10.125), "{}", l1.duration_ms);
    assert!(close(l1.cost_usd.unwrap(), 5e-6));
    assert_eq!((l1.status, l1.outcome.as_str()), (200, "completed"));
    assert_eq!((l1.ctx.as_deref(), l1.turn.as_deref()), (Some("1k"), Some("first")));
    assert_eq!(l1.api, "chat_completions");
    assert_eq!(l1.model.as_deref(), Some("llama-3-70b"));
    assert_eq!(l1.upstream_concurrency, None);
    // The stamps are kept as written (here JSON strings holding JSON).
    assert_eq!(l1.stamps.budget.as_ref().unwrap().value()["ledger_hold"], "e3b0c44218ed08b3e271b1b0-2-18ed08b4396811a8");
    assert_eq!(l1.stamps.sluice.as_ref().unwrap().value()["content_chunks"], 1);
    assert!(l1.stamps.route.is_none() && l1.stamps.latency.is_none());

    // Line 2 started 38 ms after line 1; line 3 1 ms after (lines are written when requests end).
    assert_eq!(line(&v, 2).arrival_ms, 38.0);
    let l3 = line(&v, 3);
    assert_eq!(l3.arrival_ms, 1.0);
    assert!(l3.stream);
    assert_eq!(l3.key.as_deref(), Some("k"));
    assert!(close(l3.ttft_ms.unwrap(), 11.686));
    assert!(close(l3.tpot_ms.unwrap(), 9.541));
    assert!(close(l3.duration_ms, 50.110));

    // Line 11: refused by tenant-budget before its body was read.
    let l11 = line(&v, 11);
    assert_eq!(l11.decision, Decision::Refused);
    assert_eq!(l11.code.as_deref(), Some("key:lim:day:requests"));
    assert_eq!(l11.refused_by.as_deref(), Some("tenant-budget"));
    assert_eq!((l11.status, l11.outcome.as_str()), (429, "refused"));
    assert_eq!(l11.version, None, "model_version `unknown` is no version");
    assert_eq!((l11.ctx.as_deref(), l11.turn.as_deref()), (None, None));
    assert_eq!(l11.cost_usd, None);
    assert_eq!(l11.model, None);
    assert_eq!(l11.arrival_ms, 119.0);

    assert_eq!(line(&v, 40).arrival_ms, 541.0);
    assert_eq!(v.iter().filter(|v| v.decision == Decision::Refused).map(|v| v.line).collect::<Vec<_>>(), [11]);
}

#[test]
fn fleet_log_summary() {
    let v = read_file("fleet-e2e.log");
    let s = summarize(&ReportInput { title: "fleet", source: Source::Observed, verdicts: &v, samples: &[], transitions: &[] });
    assert_eq!(s.requests, 40);
    assert_eq!((s.decisions.admitted, s.decisions.clamped, s.decisions.refused), (39, 0, 1));
    assert_eq!(s.refusals_by_code.get("key:lim:day:requests"), Some(&1));
    assert_eq!(s.refusals_by_plugin.get("tenant-budget"), Some(&1));
    assert_eq!(s.availability, Some(1.0));
    assert_eq!((s.input_tokens, s.output_tokens), (228, 177));
    assert!(close(s.spend_usd, 294e-6), "{}", s.spend_usd);
    assert_eq!(s.unrouted, 1);
    assert_eq!(s.versions.len(), 1);
    let ver = &s.versions[0];
    assert_eq!((ver.version.as_str(), ver.requests, ver.admitted, ver.completed), ("llama-3-70b", 39, 39, 39));
    // 33 streams: nearest rank 17 and 33 of their sorted TTFTs.
    assert_eq!(ver.ttft.samples, 33);
    assert!(close(ver.ttft.p50_ms.unwrap(), 1.574));
    assert!(close(ver.ttft.p99_ms.unwrap(), 19.862));
    assert_eq!(s.tenants.len(), 1);
    assert_eq!((s.tenants[0].tenant.as_str(), s.tenants[0].requests, s.tenants[0].refused), ("anonymous", 40, 1));
    assert_eq!(s.last_arrival_ms, Some(541.0));
}

#[test]
fn latency_demo_line() {
    let v = read_file("latency-demo.log");
    assert_eq!(v.len(), 1);
    let l = &v[0];
    assert_eq!(l.line, 1);
    assert_eq!(l.arrival_ms, 0.0);
    assert_eq!(l.decision, Decision::Admitted);
    assert_eq!(l.version.as_deref(), Some("v1"), "the route stamp's version");
    assert_eq!(l.route_reason.as_deref(), Some("weight"));
    assert_eq!(l.shadow_version, None);
    assert_eq!(l.tenant.as_deref(), Some("acme"));
    assert_eq!(l.key, None);
    assert!(l.stream);
    assert!(close(l.ttft_ms.unwrap(), 182.822));
    assert!(close(l.tpot_ms.unwrap(), 25.295));
    assert!(close(l.duration_ms, 764.890));
    assert_eq!((l.input_tokens, l.output_tokens), (6, 24));
    assert!(close(l.cost_usd.unwrap(), 23e-6));
    assert_eq!(l.stamps.latency.as_ref().unwrap().value()["class"], "interactive");
    assert_eq!(l.stamps.route.as_ref().unwrap().value()["route"], "llama-v1");
    assert_eq!((l.code.as_deref(), l.refused_by.as_deref()), (None, None));
}

/// A line with the given stamps (objects, embedded as written).
fn log_line(start: &str, stamps: &str) -> String {
    format!(r#"{{"start_time":"{start}","path":"/v1/chat/completions","status":200{stamps}}}"#)
}

#[test]
fn decisions_from_stamps() {
    let text = [
        // Shed by latency-guard: stamps as objects rather than strings.
        log_line(
            "2026-01-01T00:00:00.000Z",
            r#","latency":{"version":"v2","outcome":"shed_breaker_open","status":503,"ttft_ms":null},"sluice":{"outcome":"refused","status":503,"model_version":"v2","tenant":"acme"}"#,
        ),
        // Clamped by tenant-budget, routed with a shadow.
        log_line(
            "2026-01-01T00:00:01.250Z",
            r#","budget":"{\"decision\":\"clamped\",\"key\":\"acme-k\",\"status\":200}","route":"{\"version\":\"v1\",\"reason\":\"sticky\",\"shadow\":\"qwen-v1\"}","sluice":"{\"outcome\":\"completed\",\"status\":200,\"input_tokens\":2000,\"output_tokens\":10,\"stream\":true,\"ttft_us\":50000,\"duration_us\":140000,\"cost_micro_usd\":1500000}""#,
        ),
        // Started before the first line (Envoy logs at the end): a negative arrival; `-` stamps.
        log_line("2025-12-31T23:59:59.500Z", r#","budget":"-","route":null,"sluice":"{\"outcome\":\"upstream_error\",\"status\":502}""#),
        // Not an LLM request: passed over.
        r#"{"start_time":"2026-01-01T00:00:02Z","path":"/healthz","status":200}"#.to_string(),
        // An offset and no stamps at all, on an LLM path: Envoy's status says what happened.
        r#"{"start_time":"2026-01-01T01:00:03+01:00","path":"/v1/messages","status":"503"}"#.to_string(),
    ]
    .join("\n");
    let v: Vec<Verdict> = read_text(&text).into_iter().collect::<Result<_, _>>().unwrap();
    assert_eq!(v.iter().map(|v| v.line).collect::<Vec<_>>(), [1, 2, 3, 5]);

    assert_eq!(v[0].decision, Decision::Refused);
    assert_eq!(v[0].code.as_deref(), Some("shed_breaker_open"));
    assert_eq!(v[0].refused_by.as_deref(), Some("latency-guard"));
    assert_eq!((v[0].status, v[0].version.as_deref(), v[0].tenant.as_deref()), (503, Some("v2"), Some("acme")));

    assert_eq!(v[1].decision, Decision::Clamped);
    assert_eq!(v[1].arrival_ms, 1250.0);
    assert_eq!((v[1].key.as_deref(), v[1].version.as_deref()), (Some("acme-k"), Some("v1")));
    assert_eq!((v[1].route_reason.as_deref(), v[1].shadow_version.as_deref()), (Some("sticky"), Some("qwen-v1")));
    assert_eq!(v[1].cost_usd, Some(1.5));
    assert_eq!((v[1].ttft_ms, v[1].duration_ms), (Some(50.0), 140.0));
    assert_eq!(v[1].code, None);

    assert_eq!(v[2].arrival_ms, -500.0);
    assert_eq!((v[2].decision, v[2].outcome.as_str(), v[2].status), (Decision::Admitted, "upstream_error", 502));
    assert!(v[2].stamps.budget.is_none() && v[2].stamps.route.is_none());

    assert_eq!(v[3].arrival_ms, 3000.0, "01:00:03+01:00 is 00:00:03Z");
    assert_eq!((v[3].api.as_str(), v[3].status, v[3].outcome.as_str()), ("messages", 503, "upstream_error"));
}

#[test]
fn malformed_lines_report_their_line_number() {
    let good = log_line("2026-01-01T00:00:00Z", r#","sluice":"{\"outcome\":\"completed\",\"status\":200}""#);
    let bad_stamp = log_line("2026-01-01T00:00:01Z", r#","sluice":"{\"ttft_us\":\"soon\"}""#);
    let bad_time = log_line("2026-13-01T00:00:01Z", r#","sluice":"{}""#);
    let text =
        format!("{good}\n\nnot json at all\n{bad_stamp}\r\n{bad_time}\n{good}\n{{\"sluice\":\"{{\\\"status\\\":200}}\",\"path\":\"/v1/completions\"}}\n");
    let items = read_text(&text);
    let errors: Vec<(u64, String)> = items.iter().filter_map(|i| i.as_ref().err()).map(|e| (e.line, e.to_string())).collect();
    let lines: Vec<u64> = items.iter().filter_map(|i| i.as_ref().ok()).map(|v| v.line).collect();
    assert_eq!(lines, [1, 6], "reading goes on after a malformed line; blank line 2 is skipped");
    assert_eq!(errors.iter().map(|e| e.0).collect::<Vec<_>>(), [3, 4, 5, 7]);
    assert!(errors[0].1.starts_with("line 3: not JSON"), "{}", errors[0].1);
    assert!(errors[1].1.starts_with("line 4: field `sluice.ttft_us`: expected a non-negative integer"), "{}", errors[1].1);
    assert!(errors[2].1.starts_with("line 5: field `start_time`"), "{}", errors[2].1);
    assert!(errors[3].1.starts_with("line 7: field `start_time`: missing"), "{}", errors[3].1);
}

#[test]
fn an_overlong_line_is_an_error_and_the_next_line_is_read() {
    let good = log_line("2026-01-01T00:00:00Z", r#","sluice":"{\"status\":200}""#);
    let long = format!(r#"{{"pad":"{}"}}"#, "x".repeat(MAX_LINE_BYTES + 10));
    let text = format!("{long}\n{good}\n");
    let items = read_text(&text);
    assert_eq!(items.len(), 2);
    let e = items[0].as_ref().unwrap_err();
    assert_eq!(e.line, 1);
    assert!(e.why.contains("longer than"), "{}", e.why);
    assert_eq!(items[1].as_ref().unwrap().line, 2);
}

#[test]
fn a_stamp_that_is_not_an_object_is_an_error() {
    let text = log_line("2026-01-01T00:00:00Z", r#","budget":"[1,2]""#);
    let items = read_text(&text);
    let e = items[0].as_ref().unwrap_err();
    assert_eq!(e.to_string(), "line 1: field `budget`: the stamp is not a JSON object");
}

/// An llm-metrics stamp (as an object) with the fields the quality figures read.
fn quality_line(second: u32, (version, status, outcome): (&str, u16, &str), output: u64, finish: &str, chunks: &str, repetition: &str) -> String {
    log_line(
        &format!("2026-01-01T00:00:{second:02}.000Z"),
        &format!(
            r#","sluice":{{"model_version":"{version}","status":{status},"outcome":"{outcome}","output_tokens":{output},"finish_reason":{finish},"content_chunks":{chunks},"repetition_per_mille":{repetition}}}"#
        ),
    )
}

/// Per version, exactly what llm-metrics' `sluice_quality_*` would count for the same stamps:
/// whole answers only (2xx and `completed`), the stamp's output tokens, finish reason, content
/// chunks and repetition figure.
#[test]
fn quality_per_version_from_the_stamps() {
    let text = [
        quality_line(0, ("v1", 200, "completed"), 100, r#""stop""#, "100", "0"),
        quality_line(1, ("v1", 200, "completed"), 300, r#""length""#, "300", "500"),
        // Empty: no content event; under 10 trigrams, so no repetition figure.
        quality_line(2, ("v1", 200, "completed"), 0, r#""stop""#, "0", "null"),
        // No finish reason: label `none`.
        quality_line(3, ("v1", 200, "completed"), 20, "null", "20", "100"),
        // Not whole answers: an upstream error, a client that left, a refusal, a deadline after a 200.
        quality_line(4, ("v1", 502, "upstream_error"), 7, "null", "0", "null"),
        quality_line(5, ("v1", 200, "client_disconnect"), 50, "null", "50", "900"),
        quality_line(6, ("v2", 429, "refused"), 0, "null", "0", "null"),
        quality_line(7, ("v2", 200, "deadline"), 30, "null", "30", "800"),
        quality_line(8, ("v2", 200, "completed"), 64, r#""max_tokens""#, "64", "974"),
        // A stamp older than the quality fields: judged, not empty, no figure.
        log_line("2026-01-01T00:00:09.000Z", r#","sluice":{"model_version":"v2","status":200,"outcome":"completed","output_tokens":10}"#),
        // 206 is a 2xx; an unknown finish reason is `other`, and not a truncation.
        quality_line(10, ("v2", 206, "completed"), 12, r#""weird""#, "12", r#""-""#),
        // No llm-metrics stamp: nothing to judge.
        log_line("2026-01-01T00:00:11.000Z", r#","route":{"version":"v2"}"#),
    ]
    .join("\n");
    let v: Vec<Verdict> = read_text(&text).into_iter().collect::<Result<_, _>>().unwrap();
    assert_eq!(v.len(), 12);
    let judged: Vec<u64> = v.iter().filter(|v| v.quality.is_some()).map(|v| v.line).collect();
    assert_eq!(judged, [1, 2, 3, 4, 9, 10, 11]);
    let l3 = v[2].quality.as_ref().unwrap();
    assert!(l3.empty && !l3.truncated && l3.repetition_per_mille.is_none());
    assert_eq!(v[1].quality.as_ref().unwrap().finish, "length");
    assert!(v[1].quality.as_ref().unwrap().truncated);
    assert!(!v[9].quality.as_ref().unwrap().empty, "no content_chunks: not known to be empty");

    let s = summarize(&ReportInput { title: "quality", source: Source::Observed, verdicts: &v, samples: &[], transitions: &[] });
    assert_eq!(s.quality.len(), 2);
    let (q1, q2) = (&s.quality[0], &s.quality[1]);
    assert_eq!((q1.version.as_str(), q1.answers), ("v1", 4));
    // Output tokens 0, 20, 100, 300: mean 105; nearest rank 2 of 4 → 20, rank 4 → 300.
    assert_eq!((q1.output_tokens_mean, q1.output_tokens_p50, q1.output_tokens_p95), (Some(105.0), Some(20.0), Some(300.0)));
    // Figures 0, 500, 100 (the empty answer has none): mean 200.
    assert_eq!((q1.repetition_answers, q1.repetition_mean_per_mille), (3, Some(200.0)));
    assert_eq!((q1.empty, q1.empty_share, q1.truncated, q1.truncated_share), (1, Some(0.25), 1, Some(0.25)));
    assert_eq!(q1.by_finish.iter().map(|(k, n)| (k.as_str(), *n)).collect::<Vec<_>>(), [("length", 1), ("none", 1), ("stop", 2)]);

    assert_eq!((q2.version.as_str(), q2.answers), ("v2", 3));
    // 10, 12, 64: mean 28.67; rank 2 of 3 → 12, rank 3 → 64.
    assert!(close(q2.output_tokens_mean.unwrap(), 86.0 / 3.0));
    assert_eq!((q2.output_tokens_p50, q2.output_tokens_p95), (Some(12.0), Some(64.0)));
    assert_eq!((q2.repetition_answers, q2.repetition_mean_per_mille), (1, Some(974.0)));
    assert_eq!((q2.empty, q2.empty_share, q2.truncated), (0, Some(0.0), 1));
    assert!(close(q2.truncated_share.unwrap(), 1.0 / 3.0));
    assert_eq!(q2.by_finish.iter().map(|(k, n)| (k.as_str(), *n)).collect::<Vec<_>>(), [("max_tokens", 1), ("none", 1), ("other", 1)]);

    // The page's row of each version.
    let html = render_html(&ReportInput { title: "quality", source: Source::Observed, verdicts: &v, samples: &[], transitions: &[] }, &s);
    let options = roxmltree::ParsingOptions { allow_dtd: true, ..roxmltree::ParsingOptions::default() };
    let doc = roxmltree::Document::parse_with_options(&html, options).unwrap();
    let rows: Vec<Vec<String>> = doc
        .descendants()
        .filter(|n| n.tag_name().name() == "tr")
        .map(|tr| tr.children().filter(|c| c.tag_name().name() == "td").map(|td| td.text().unwrap_or_default().to_string()).collect::<Vec<_>>())
        .filter(|cells| cells.len() == 9)
        .collect();
    assert_eq!(rows[0], ["v1", "4", "105.0", "20.0", "300.0", "3", "200.0", "1 (25.00%)", "1 (25.00%)"]);
    assert_eq!(rows[1], ["v2", "3", "28.7", "12.0", "64.0", "1", "974.0", "0 (0.00%)", "1 (33.33%)"]);
    assert!(!html.contains("Simulated answers are the mock"), "the mock's note is for simulations only");
}

#[test]
fn a_quality_field_of_the_wrong_type_names_itself() {
    let text = quality_line(0, ("v1", 200, "completed"), 10, r#""stop""#, "10", r#""many""#);
    let e = read_text(&text).into_iter().next().unwrap().unwrap_err();
    assert_eq!(e.line, 1);
    assert!(e.to_string().contains("field `sluice.repetition_per_mille`"), "{e}");
}
