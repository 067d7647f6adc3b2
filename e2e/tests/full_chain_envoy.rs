//! The full chain in real Envoy (`envoy/templates/full-gateway.yaml`): json_to_metadata → latency-guard →
//! model-router → tenant-budget → llm-metrics → router, three mock clusters (v1, v2, the shadow),
//! with the example policies `cargo xtask render` inlines (latency-guard.demo, model-router.demo,
//! tenant-budget.full, llm-metrics.demo). Each request is followed into all four access-log stamps,
//! the mock's ledger and `/stats/prometheus`:
//!
//! - a stream through all four plugins: every stamp names the same version, and the budget charges
//!   exactly the tokens llm-metrics measured (and the mock reported); and one stream of each API
//!   kind (chat completions, completions, responses, Anthropic messages), stamped alike;
//! - a request over its key's budget: 429 in OpenAI's error shape, no upstream request;
//! - a stream stalled past the guard's TTFT deadline: 504, and every stamp and the request counter
//!   say so (status 504 / `5xx`, outcome `deadline`, nothing charged, no client disconnect);
//! - a budget refusal as the guard and llm-metrics stamp it: `refused`, status 429.
//!
//! The last two follow the contract of filter state `sluice_gateway_reply` (whichever plugin answers
//! a request itself says so, and the others stamp that answer). Each test collects every failed
//! check and reports them together. Skipped when Envoy is not installed (unless `SLUICE_ENVOY`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use sluice_e2e::access_log::stamp;
use sluice_e2e::gateway::{start_full_gateway, FullGateway};
use sluice_e2e::{post_json, post_stream, wait_until, Checks, MockServer, Tools};
use std::time::{Duration, Instant};

const CHAT: &str = "/v1/chat/completions";
/// The guard's TTFT deadline for both versions in policies/latency-guard.demo.json.
const TTFT_DEADLINE: Duration = Duration::from_millis(2000);

fn start() -> Option<FullGateway> {
    Tools::locate_or_skip().unwrap()?;
    Some(start_full_gateway(&["--tokens", "6", "--ttft-ms", "40"], &[]).unwrap())
}

fn chat(stream: bool, content: &str) -> String {
    json!({
        "model": "llama-3-70b",
        "stream": stream,
        "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null },
        "messages": [{"role": "user", "content": content}],
    })
    .to_string()
}

/// The four stamps of one request, found by its `x-request-id`.
struct Stamps {
    line: Value,
    route: Value,
    latency: Value,
    budget: Value,
    llm: Value,
}

fn stamps(gw: &FullGateway, id: &str) -> Stamps {
    let line = gw.envoy.access_log().wait_for_request(id, Duration::from_secs(10)).unwrap();
    let get = |field: &str| stamp(&line, field).unwrap().unwrap_or(Value::Null);
    Stamps { route: get("route"), latency: get("latency"), budget: get("budget"), llm: get("sluice"), line }
}

fn ledger_has(mock: &MockServer, id: &str) -> bool {
    mock.requests().unwrap().iter().any(|r| r.request_id == id)
}

fn counter(gw: &FullGateway, name: &str, labels: &[(&str, &str)]) -> f64 {
    gw.envoy.metrics().unwrap().value(name, labels).unwrap_or(0.0)
}

/// A prompt whose body is larger than key globex's 100,000 tokens a minute: in strict mode the
/// prompt side of the reservation is the body's size in bytes, so it can never fit.
fn over_budget_body() -> String {
    chat(true, &"budget ".repeat(120_000 / 7))
}

#[test]
fn a_stream_through_all_four_plugins_is_stamped_alike_by_each() {
    let Some(gw) = start() else { return };
    let id = "full-stream-1";
    let h = [("x-sluice-tenant", "acme"), ("x-request-id", id)];
    let resp = post_stream(gw.envoy.listen_addr(), CHAT, &h, &chat(true, "Hello through every plugin")).unwrap().collect().unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert!(resp.complete && resp.text().contains("data: [DONE]"), "{}", resp.text());
    let s = stamps(&gw, id);
    let mut c = Checks::default();

    // One version, named alike by every plugin and served by its cluster.
    let version = s.route["version"].as_str().unwrap_or_default().to_string();
    c.that(version == "v1" || version == "v2", format!("route stamp names no version: {}", s.route));
    c.eq("served by", &json!(resp.header("x-mock-served-by")), json!(format!("llama-{version}")));
    c.eq("latency.version", &s.latency["version"], json!(version));
    c.eq("latency.outcome", &s.latency["outcome"], json!("ok"));
    c.eq("latency.class", &s.latency["class"], json!("interactive"));
    c.eq("llm.model_version", &s.llm["model_version"], json!(version));
    c.eq("llm.status", &s.llm["status"], json!(200));
    c.eq("llm.outcome", &s.llm["outcome"], json!("completed"));
    c.eq("llm.usage", &s.llm["usage"], json!("reported"));
    c.eq("budget.key", &s.budget["key"], json!("acme"));
    c.eq("budget.decision", &s.budget["decision"], json!("admitted"));
    c.eq("budget.outcome", &s.budget["outcome"], json!("completed"));
    c.eq("budget.usage", &s.budget["usage"], json!("reported"));

    // The budget charges exactly what llm-metrics measured, which is what the upstream reported.
    c.eq("budget.input_tokens = llm.input_tokens", &s.budget["input_tokens"], s.llm["input_tokens"].clone());
    c.eq("budget.output_tokens = llm.output_tokens", &s.budget["output_tokens"], s.llm["output_tokens"].clone());
    let sum = s.llm["input_tokens"].as_u64().unwrap_or(0) + s.llm["output_tokens"].as_u64().unwrap_or(0);
    c.eq("budget.charged_tokens", &s.budget["charged_tokens"], json!(sum));
    c.eq("budget.charged_micro_usd = llm.cost_micro_usd", &s.budget["charged_micro_usd"], s.llm["cost_micro_usd"].clone());
    let served = if version == "v2" { &gw.v2 } else { &gw.v1 };
    match served.requests().unwrap().into_iter().find(|r| r.request_id == id) {
        Some(r) => {
            c.eq("llm.input_tokens = mock prompt_tokens", &s.llm["input_tokens"], json!(r.prompt_tokens));
            c.eq("llm.output_tokens = mock completion_tokens", &s.llm["output_tokens"], json!(r.completion_tokens));
            c.that(r.usage_reported, format!("the mock reported no usage: {r:?}"));
        }
        None => c.that(false, format!("the {version} mock has no record of {id}")),
    }

    // The counters, and the budget's overestimate histogram with the buckets the gateway sets.
    c.eq("sluice_requests_total{tenant=acme,status=2xx}", &json!(counter(&gw, "sluice_requests_total", &[("tenant", "acme"), ("status", "2xx")])), json!(1.0));
    let overestimate = wait_until(Duration::from_secs(5), "sluice_budget_overestimate_tokens", || {
        Ok(gw.envoy.metrics()?.histogram("sluice_budget_overestimate_tokens", &[("key", "acme")]).filter(|h| h.count == 1))
    });
    match overestimate {
        Ok(h) => c.that(h.cumulative(4_194_304.0).is_some(), format!("overestimate histogram without the gateway's buckets: {:?}", h.buckets)),
        Err(e) => c.that(false, format!("{e:#}")),
    }
    c.done(&format!("access log: {}", s.line));
}

/// One streamed request of each API kind (OpenAI chat completions, completions and responses,
/// Anthropic messages), all for `llama-3-70b`: each is routed, guarded, charged and measured, and
/// the four stamps agree on the version, the API and the tokens (which are what the mock reported).
#[test]
fn a_stream_of_each_api_kind_through_all_four_plugins_is_stamped_alike_by_each() {
    let Some(gw) = start() else { return };
    let cases = [
        ("/v1/chat/completions", "chat_completions", chat(true, "Hello, chat")),
        (
            "/v1/completions",
            "completions",
            json!({"model": "llama-3-70b", "stream": true, "stream_options": {"include_usage": true}, "prompt": "Hello, completions"}).to_string(),
        ),
        ("/v1/responses", "responses", json!({"model": "llama-3-70b", "stream": true, "input": "Hello, responses"}).to_string()),
        (
            "/v1/messages",
            "messages",
            json!({"model": "llama-3-70b", "stream": true, "max_tokens": 100, "messages": [{"role": "user", "content": "Hello, messages"}]}).to_string(),
        ),
    ];
    let mut c = Checks::default();
    for (path, api, body) in &cases {
        let id = format!("full-api-{api}");
        let h = [("x-sluice-tenant", "acme"), ("x-request-id", id.as_str())];
        let resp = post_stream(gw.envoy.listen_addr(), path, &h, body).unwrap().collect().unwrap();
        if resp.status != 200 || !resp.complete {
            c.that(false, format!("{api}: status {} complete {}: {}", resp.status, resp.complete, resp.text()));
            continue;
        }
        let s = stamps(&gw, &id);
        let version = s.route["version"].as_str().unwrap_or_default().to_string();
        c.that(version == "v1" || version == "v2", format!("{api}: route stamp names no version: {}", s.route));
        c.eq(&format!("{api}: served by"), &json!(resp.header("x-mock-served-by")), json!(format!("llama-{version}")));
        c.eq(&format!("{api}: latency.version"), &s.latency["version"], json!(version));
        c.eq(&format!("{api}: latency.outcome"), &s.latency["outcome"], json!("ok"));
        c.eq(&format!("{api}: llm.api"), &s.llm["api"], json!(api));
        c.eq(&format!("{api}: llm.stream"), &s.llm["stream"], json!(true));
        c.eq(&format!("{api}: llm.model_version"), &s.llm["model_version"], json!(version));
        c.eq(&format!("{api}: llm.outcome"), &s.llm["outcome"], json!("completed"));
        c.eq(&format!("{api}: llm.usage"), &s.llm["usage"], json!("reported"));
        c.eq(&format!("{api}: budget.decision"), &s.budget["decision"], json!("admitted"));
        c.eq(&format!("{api}: budget.outcome"), &s.budget["outcome"], json!("completed"));
        c.eq(&format!("{api}: budget.input_tokens = llm.input_tokens"), &s.budget["input_tokens"], s.llm["input_tokens"].clone());
        c.eq(&format!("{api}: budget.output_tokens = llm.output_tokens"), &s.budget["output_tokens"], s.llm["output_tokens"].clone());
        c.eq(&format!("{api}: budget.charged_micro_usd = llm.cost_micro_usd"), &s.budget["charged_micro_usd"], s.llm["cost_micro_usd"].clone());
        let served = if version == "v2" { &gw.v2 } else { &gw.v1 };
        match served.requests().unwrap().into_iter().find(|r| r.request_id == id) {
            Some(r) => {
                c.eq(&format!("{api}: llm.input_tokens = mock prompt_tokens"), &s.llm["input_tokens"], json!(r.prompt_tokens));
                c.eq(&format!("{api}: llm.output_tokens = mock completion_tokens"), &s.llm["output_tokens"], json!(r.completion_tokens));
            }
            None => c.that(false, format!("{api}: the {version} mock has no record of {id}")),
        }
    }
    c.done("one stream per API kind");
}

#[test]
fn a_request_over_its_keys_budget_is_refused_429_and_reaches_no_upstream() {
    let Some(gw) = start() else { return };
    let id = "full-over-budget-1";
    let h = [("x-sluice-tenant", "globex"), ("x-request-id", id)];
    let resp = post_json(gw.envoy.listen_addr(), CHAT, &h, &over_budget_body()).unwrap();
    assert_eq!(resp.status, 429, "{}", resp.text());
    let mut c = Checks::default();
    // OpenAI's error shape, naming the budget that refused.
    let err = resp.json().unwrap();
    c.eq("error.type", &err["error"]["type"], json!("budget_exceeded"));
    let code = err["error"]["code"].as_str().unwrap_or_default().to_string();
    c.that(code.starts_with("key:globex:minute:"), format!("error.code names key globex's minute budget: {err}"));
    c.that(err["error"]["message"].as_str().is_some_and(|m| m.contains(&code)), format!("error.message names the budget: {err}"));
    c.that(resp.header("retry-after").and_then(|r| r.parse::<u64>().ok()).is_some_and(|r| r >= 1), format!("retry-after: {:?}", resp.header("retry-after")));
    let s = stamps(&gw, id);
    c.eq("access log status", &s.line["status"], json!(429));
    c.eq("budget.decision", &s.budget["decision"], json!("rejected"));
    c.eq("budget.reject_code", &s.budget["reject_code"], json!(code));
    // Neither model version saw the request: the body, held by tenant-budget, never left Envoy.
    for (name, mock) in [("v1", &gw.v1), ("v2", &gw.v2)] {
        c.that(!ledger_has(mock, id), format!("the {name} mock served the refused request"));
        c.eq(&format!("{name} mock requests"), &mock.stats().unwrap()["requests"], json!(0));
    }
    c.eq("sluice_budget_rejections_total{key=globex}", &json!(counter(&gw, "sluice_budget_rejections_total", &[("key", "globex")])), json!(1.0));
    c.done(&format!("access log: {}", s.line));
}

#[test]
fn a_stream_stalled_past_the_ttft_deadline_is_504_in_every_stamp_and_counter() {
    let Some(gw) = start() else { return };
    let id = "full-stalled-1";
    let h = [("x-sluice-tenant", "acme"), ("x-request-id", id), ("x-mock-ttft-ms", "5000")];
    let t = Instant::now();
    let resp = post_json(gw.envoy.listen_addr(), CHAT, &h, &chat(true, "Are you there?")).unwrap();
    let took = t.elapsed();
    assert_eq!(resp.status, 504, "{}", resp.text());
    assert!(took >= TTFT_DEADLINE && took < TTFT_DEADLINE + Duration::from_millis(1500), "504 after {took:?}");
    let mut c = Checks::default();
    c.eq("error.code", &resp.json().unwrap()["error"]["code"], json!("ttft_deadline_exceeded"));
    let s = stamps(&gw, id);
    let version = s.route["version"].as_str().unwrap_or_default().to_string();
    c.eq("access log status", &s.line["status"], json!(504));
    c.eq("latency.status", &s.latency["status"], json!(504));
    c.eq("latency.outcome", &s.latency["outcome"], json!("ttft"));
    c.eq("llm.status", &s.llm["status"], json!(504));
    c.eq("llm.outcome", &s.llm["outcome"], json!("deadline"));
    c.eq("budget.status", &s.budget["status"], json!(504));
    c.eq("budget.outcome", &s.budget["outcome"], json!("deadline"));
    c.eq("budget.charged_tokens", &s.budget["charged_tokens"], json!(0));
    // The request counter files it under the status the client got; nobody disconnected.
    let labels = |status: &'static str| [("tenant", "acme"), ("model_version", version.as_str()), ("status", status)];
    c.eq("sluice_requests_total{status=5xx}", &json!(counter(&gw, "sluice_requests_total", &labels("5xx"))), json!(1.0));
    c.eq("sluice_requests_total{status=2xx}", &json!(counter(&gw, "sluice_requests_total", &labels("2xx"))), json!(0.0));
    c.eq("sluice_client_disconnects_total", &json!(counter(&gw, "sluice_client_disconnects_total", &[])), json!(0.0));
    c.done(&format!("access log: {}", s.line));
}

#[test]
fn a_budget_refusal_is_stamped_refused_429_by_the_guard_and_by_llm_metrics() {
    let Some(gw) = start() else { return };
    let id = "full-refused-1";
    let h = [("x-sluice-tenant", "globex"), ("x-request-id", id)];
    let resp = post_json(gw.envoy.listen_addr(), CHAT, &h, &over_budget_body()).unwrap();
    assert_eq!(resp.status, 429, "{}", resp.text());
    let s = stamps(&gw, id);
    let mut c = Checks::default();
    c.eq("budget.decision", &s.budget["decision"], json!("rejected"));
    c.eq("latency.outcome", &s.latency["outcome"], json!("refused"));
    c.eq("latency.status", &s.latency["status"], json!(429));
    c.eq("llm.status", &s.llm["status"], json!(429));
    c.eq("llm.outcome", &s.llm["outcome"], json!("refused"));
    c.done(&format!("access log: {}", s.line));
}

/// A request body over Envoy's default 1 MiB buffer limit (a long context, base64 images): the
/// gateway's `sluice.request_body_limit` buffer filter, in front of json_to_metadata, raises the
/// request's limit to 9 MiB, so the body is read, routed by its model, admitted by its budget and
/// served — without it Envoy answered 413 itself before any plugin saw the request.
#[test]
fn a_request_body_over_a_mebibyte_is_routed_admitted_and_served() {
    let Some(gw) = start() else { return };
    let id = "full-large-body";
    // batch-nightly counts output tokens only, so a 2 MB prompt fits its budget.
    let h = [("x-sluice-tenant", "batch-nightly"), ("x-request-id", id)];
    let body = chat(false, &"a ".repeat(1_000_000));
    assert!(body.len() > 2_000_000);
    let resp = post_json(gw.envoy.listen_addr(), CHAT, &h, &body).unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
    let s = stamps(&gw, id);
    let mut c = Checks::default();
    let version = s.route["version"].as_str().unwrap_or_default().to_string();
    c.that(version == "v1" || version == "v2", format!("route stamp names no version: {}", s.route));
    c.eq("served by", &json!(resp.header("x-mock-served-by")), json!(format!("llama-{version}")));
    c.eq("budget.decision", &s.budget["decision"], json!("admitted"));
    c.eq("llm.status", &s.llm["status"], json!(200));
    c.eq("latency.outcome", &s.latency["outcome"], json!("ok"));
    let served = if version == "v2" { &gw.v2 } else { &gw.v1 };
    c.that(ledger_has(served, id), format!("the {version} mock has no record of {id}"));
    c.done(&format!("access log: {}", s.line));
}
