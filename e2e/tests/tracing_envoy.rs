//! Tracing in real Envoy: the full gateway (`envoy/templates/full-gateway.yaml`) rendered with
//! tracing on (`sluice_envoy_render::Tracing`, what `cargo xtask render --otlp` writes), Envoy's
//! OpenTelemetry tracer exporting over OTLP/HTTP to a receiver that decodes the export with the
//! official OTLP definitions (`sluice_e2e::otlp`).
//!
//! Every request sent — streamed and whole requests of each API kind, a 429 over budget, a guard
//! 504 at the TTFT deadline, a client that disconnects mid-stream — has exactly one span, found by
//! the request id Envoy puts on it (`guid:x-request-id`), and each sluice attribute on the span is
//! the value of the same request's access-log stamps (tokens, TTFT, cost, version, decisions);
//! an attribute whose stamp field is null is absent from the span. A client's `traceparent` is
//! continued, and a shadow request carries its primary's trace context. Skipped when Envoy is not
//! installed (unless `SLUICE_ENVOY`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use sluice_e2e::access_log::stamp;
use sluice_e2e::gateway::{full_gateway_policy, start_full_gateway_with, FullGateway};
use sluice_e2e::otlp::{OtlpReceiver, ReceivedSpan};
use sluice_e2e::{post_json, post_stream, wait_until, Checks, Tools};
use sluice_envoy_render::{Tracing, SPAN_ATTRIBUTES};
use std::collections::BTreeMap;
use std::time::Duration;

/// What Envoy's UUID request-id extension makes of an id it traces: the 14th hex digit `9`
/// ("sampled"). The test sends version-4 UUIDs and finds them again under this form.
fn traced_form(id: &str) -> String {
    let mut b = id.as_bytes().to_vec();
    b[14] = b'9';
    String::from_utf8(b).unwrap()
}

fn request_id(n: u32) -> String {
    format!("{n:08x}-5eed-4000-8000-{n:012x}")
}

/// The router policy of the full gateway with every eligible request shadowed, so that the shadow's
/// trace context can be checked on any request.
fn router_policy_shadowing_all() -> String {
    let mut policy: Value = serde_json::from_str(&full_gateway_policy("ROUTER_CONFIG").unwrap()).unwrap();
    policy["models"][0]["shadow"]["fraction"] = json!(1.0);
    policy.to_string()
}

fn start(otlp: &OtlpReceiver) -> Option<FullGateway> {
    Tools::locate_or_skip().unwrap()?;
    let tracing = Tracing { host: "127.0.0.1".into(), port: otlp.port(), sampling_percent: 100.0 };
    let gateway = sluice_envoy_render::gateway("full-gateway").unwrap();
    let vars = tracing.vars(&gateway.sections());
    let vars: Vec<(&str, &str)> = vars.iter().map(|(n, v)| (*n, v.as_str())).collect();
    let router = router_policy_shadowing_all();
    Some(start_full_gateway_with(&["--tokens", "6", "--ttft-ms", "40"], &[("ROUTER_CONFIG", router.as_str())], &vars).unwrap())
}

/// One request of the test: how it is sent and what its span must say beyond the stamps.
struct Case {
    name: &'static str,
    id: String,
    /// The request's `max_tokens` (or `max_output_tokens`), as `gen_ai.request.max_tokens`.
    max_tokens: Option<u64>,
    /// llm-metrics reports the request before Envoy finishes its span. Not so for a request that
    /// ends without its response passing through (a guard's deadline 504, a client gone): llm-metrics
    /// learns of those at `on_log`, after the span, so its response attributes are absent.
    reported_before_span: bool,
}

/// llm-metrics' attributes written when it reports the request.
const RESPONSE_ATTRIBUTES: [&str; 8] = [
    "gen_ai.response.model",
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
    "gen_ai.response.finish_reasons",
    "gen_ai.response.time_to_first_chunk",
    "sluice.tpot_us",
    "sluice.cost_micro_usd",
    "sluice.outcome",
];

/// `us` µs as the decimal seconds the span carries (`0.033766`).
fn seconds(us: u64) -> String {
    format!("{}.{:06}", us / 1_000_000, us % 1_000_000)
}

/// A stamp field as span text: strings as they are, numbers in decimal; null or absent → `None`.
fn field(stamp: &Value, name: &str) -> Option<String> {
    match &stamp[name] {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// Every sluice attribute the span must carry, from the request's stamps: `None` where the span
/// must not have it.
fn expected(line: &Value, case: &Case) -> BTreeMap<&'static str, Option<String>> {
    let get = |f: &str| stamp(line, f).unwrap().unwrap_or(Value::Null);
    let (llm, route, budget, latency) = (get("sluice"), get("route"), get("budget"), get("latency"));
    let api = field(&llm, "api");
    let operation = api.as_deref().map(|a| if a == "completions" { "text_completion" } else { "chat" }.to_string());
    let provider = api.as_deref().map(|a| if a == "messages" { "anthropic" } else { "openai" }.to_string());
    // The guard writes its outcome on the span only when it ended the request itself.
    let guard_outcome = field(&latency, "outcome").filter(|o| ["ttft", "total", "shed_in_flight", "shed_breaker_open"].contains(&o.as_str()));
    let mut e = BTreeMap::new();
    e.insert("gen_ai.operation.name", operation);
    e.insert("gen_ai.provider.name", provider);
    e.insert("gen_ai.request.model", field(&llm, "model"));
    // Read from the request body with its model: absent when the body was not inspected.
    e.insert("gen_ai.request.max_tokens", case.max_tokens.filter(|_| field(&llm, "model").is_some()).map(|m| m.to_string()));
    e.insert("sluice.api", api);
    e.insert("sluice.model_version", field(&llm, "model_version"));
    e.insert("sluice.tenant", field(&llm, "tenant"));
    e.insert("gen_ai.response.model", field(&llm, "response_model"));
    e.insert("gen_ai.usage.input_tokens", field(&llm, "input_tokens"));
    e.insert("gen_ai.usage.output_tokens", field(&llm, "output_tokens"));
    e.insert("gen_ai.response.finish_reasons", field(&llm, "finish_reason"));
    e.insert("gen_ai.response.time_to_first_chunk", llm["ttft_us"].as_u64().map(seconds));
    e.insert("sluice.tpot_us", field(&llm, "tpot_us"));
    e.insert("sluice.cost_micro_usd", field(&llm, "cost_micro_usd"));
    e.insert("sluice.outcome", field(&llm, "outcome"));
    e.insert("sluice.route.reason", field(&route, "reason"));
    e.insert("sluice.shadow", field(&route, "shadow"));
    e.insert("sluice.budget.decision", field(&budget, "decision"));
    e.insert("sluice.budget.code", field(&budget, "reject_code"));
    e.insert("sluice.guard.class", field(&latency, "class"));
    e.insert("sluice.guard.outcome", guard_outcome);
    if !case.reported_before_span {
        for name in RESPONSE_ATTRIBUTES {
            e.insert(name, None);
        }
    }
    e
}

fn chat(stream: bool, content: &str) -> String {
    json!({"model": "llama-3-70b", "stream": stream, "max_tokens": 64, "messages": [{"role": "user", "content": content}]}).to_string()
}

#[test]
fn every_request_has_one_span_whose_sluice_attributes_are_its_stamps() {
    let otlp = OtlpReceiver::start().unwrap();
    let Some(gw) = start(&otlp) else { return };
    let addr = gw.envoy.listen_addr();
    let mut cases: Vec<Case> = Vec::new();
    let mut n = 0u32;
    let mut next_id = || {
        n += 1;
        request_id(n)
    };

    // Streamed and whole requests of each API kind: (names, path, body and its max tokens).
    type Body = fn(bool) -> (String, u64);
    let kinds: [([&'static str; 2], &str, Body); 4] = [
        (["chat streamed", "chat whole"], "/v1/chat/completions", |s| (chat(s, "Hello, chat"), 64)),
        (["completions streamed", "completions whole"], "/v1/completions", |s| {
            (json!({"model": "llama-3-70b", "stream": s, "max_tokens": 32, "prompt": "Hello"}).to_string(), 32)
        }),
        (["responses streamed", "responses whole"], "/v1/responses", |s| {
            (json!({"model": "llama-3-70b", "stream": s, "max_output_tokens": 48, "input": "Hello"}).to_string(), 48)
        }),
        (["messages streamed", "messages whole"], "/v1/messages", |s| {
            (json!({"model": "llama-3-70b", "stream": s, "max_tokens": 100, "messages": [{"role": "user", "content": "Hello"}]}).to_string(), 100)
        }),
    ];
    for (names, path, body) in kinds {
        for (name, stream) in names.into_iter().zip([true, false]) {
            let id = next_id();
            let (body, max_tokens) = body(stream);
            let h = [("x-sluice-tenant", "acme"), ("x-request-id", id.as_str())];
            let resp = post_json(addr, path, &h, &body).unwrap();
            assert_eq!(resp.status, 200, "{name}: {}", resp.text());
            cases.push(Case { name, id, max_tokens: Some(max_tokens), reported_before_span: true });
        }
    }

    // Over its key's budget: tenant-budget answers 429 (globex's minute budget is 100,000 tokens).
    let id = next_id();
    let over = chat(true, &"budget ".repeat(120_000 / 7));
    let resp = post_json(addr, "/v1/chat/completions", &[("x-sluice-tenant", "globex"), ("x-request-id", id.as_str())], &over).unwrap();
    assert_eq!(resp.status, 429, "{}", resp.text());
    cases.push(Case { name: "429 over budget", id, max_tokens: Some(64), reported_before_span: true });

    // Stalled past the guard's TTFT deadline (2 s in latency-guard.demo.json): 504.
    let id = next_id();
    let h = [("x-sluice-tenant", "acme"), ("x-request-id", id.as_str()), ("x-mock-ttft-ms", "5000")];
    let resp = post_json(addr, "/v1/chat/completions", &h, &chat(true, "Are you there?")).unwrap();
    assert_eq!(resp.status, 504, "{}", resp.text());
    cases.push(Case { name: "504 ttft deadline", id, max_tokens: Some(64), reported_before_span: false });

    // A client that leaves after the first bytes of a slow stream.
    let id = next_id();
    let h = [("x-sluice-tenant", "acme"), ("x-request-id", id.as_str()), ("x-mock-tokens", "40"), ("x-mock-itl-ms", "100")];
    let stream = post_stream(addr, "/v1/chat/completions", &h, &chat(true, "Tell me a long story")).unwrap();
    stream.abort_after(1).unwrap();
    cases.push(Case { name: "client disconnect", id, max_tokens: Some(64), reported_before_span: false });

    // A client's own trace context.
    let id = next_id();
    let (client_trace, client_span) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let traceparent_sent = format!("00-{client_trace}-{client_span}-01");
    let h = [("x-sluice-tenant", "acme"), ("x-request-id", id.as_str()), ("traceparent", traceparent_sent.as_str())];
    let resp = post_json(addr, "/v1/chat/completions", &h, &chat(false, "Continue my trace")).unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
    cases.push(Case { name: "client traceparent", id: id.clone(), max_tokens: Some(64), reported_before_span: true });
    let continued_id = traced_form(&id);

    // Every request's span, by the request id Envoy tags it with.
    let ids: Vec<String> = cases.iter().map(|c| traced_form(&c.id)).collect();
    let spans = wait_until(Duration::from_secs(20), "a span for every request", || {
        let spans = otlp.spans();
        let found = ids.iter().filter(|id| spans.iter().any(|s| s.attr("guid:x-request-id") == Some(id.as_str()))).count();
        Ok((found == ids.len()).then_some(spans))
    });
    let spans: Vec<ReceivedSpan> = match spans {
        Ok(s) => s,
        Err(e) => {
            panic!("{e:#}\nreceived {} spans in {} exports, errors {:?}\n{}", otlp.spans().len(), otlp.exports(), otlp.errors(), gw.envoy.stderr_tail(30))
        }
    };

    let mut c = Checks::default();
    c.that(otlp.errors().is_empty(), format!("the receiver could not take some exports: {:?}", otlp.errors()));
    for (case, id) in cases.iter().zip(&ids) {
        let mine: Vec<&ReceivedSpan> = spans.iter().filter(|s| s.attr("guid:x-request-id") == Some(id.as_str())).collect();
        c.eq(&format!("{}: spans", case.name), &json!(mine.len()), json!(1));
        let Some(span) = mine.first() else { continue };
        c.eq(&format!("{}: service", case.name), &json!(span.service), json!("sluice-gateway"));
        let line = gw.envoy.access_log().wait_for_request(id, Duration::from_secs(10)).unwrap();
        for (name, want) in expected(&line, case) {
            c.eq(&format!("{}: {name}", case.name), &json!(span.attr(name)), json!(want));
        }
        // Only attributes sluice documents, under its names.
        for name in span.attributes.keys().filter(|k| k.starts_with("gen_ai.") || k.starts_with("sluice.")) {
            c.that(SPAN_ATTRIBUTES.iter().any(|(a, _)| a == name), format!("{}: undocumented attribute {name}", case.name));
        }
    }

    // The client's trace is continued: same trace id, the client's span as parent.
    if let Some(span) = spans.iter().find(|s| s.attr("guid:x-request-id") == Some(continued_id.as_str())) {
        c.eq("continued trace id", &json!(span.trace_id), json!(client_trace));
        c.eq("continued parent span", &json!(span.parent_span_id), json!(client_span));
    }

    // Shadows: each carries its primary's x-request-id; the shadow of the request with a client
    // trace context carries that context (same trace as the primary's span, the client's span as
    // parent); the others carry none (Envoy gives a filter no way to read the gateway span's own
    // context, see sluice_core::flow::router::TRACE_HEADERS).
    let shadow_heads = wait_until(Duration::from_secs(10), "the shadow of the traced request", || {
        let heads = gw.shadow.heads()?;
        Ok(heads.iter().any(|h| h.request_id.as_deref() == Some(continued_id.as_str())).then_some(heads))
    })
    .unwrap();
    let refused_id = traced_form(&cases.iter().find(|c| c.name == "429 over budget").unwrap().id);
    c.that(!shadow_heads.iter().any(|h| h.request_id.as_deref() == Some(refused_id.as_str())), "the refused request's shadow reached the shadow model".into());
    // Every span that names a shadow has one at the shadow model (the mock's own control calls
    // carry no request id).
    for span in spans.iter().filter(|s| s.attr("sluice.shadow").is_some()) {
        let id = span.attr("guid:x-request-id").unwrap_or("?");
        c.that(shadow_heads.iter().any(|h| h.request_id.as_deref() == Some(id)), format!("{id}: its span names a shadow the shadow model never saw"));
    }
    for head in shadow_heads.iter().filter(|h| h.path.starts_with("/v1/")) {
        let Some(primary) = head.request_id.as_deref().and_then(|id| spans.iter().find(|s| s.attr("guid:x-request-id") == Some(id))) else {
            c.that(false, format!("a shadow with no primary span: {} {:?}", head.path, head.request_id));
            continue;
        };
        let id = primary.attr("guid:x-request-id").unwrap_or("?");
        let traceparent = head.values("traceparent").first().map(|t| t.to_string());
        if id == continued_id {
            c.eq("shadow traceparent", &json!(traceparent), json!(traceparent_sent));
            c.eq("shadow trace = primary's trace", &json!(traceparent.as_deref().and_then(|t| t.split('-').nth(1))), json!(primary.trace_id));
        } else {
            c.eq(&format!("shadow of {id}: traceparent"), &json!(traceparent), json!(null));
        }
    }
    c.done(&format!("{} spans received in {} exports", spans.len(), otlp.exports()));
}

/// The attribute list the renderer writes custom tags for is the one sluice's sections write.
#[test]
fn the_rendered_custom_tags_are_the_attributes_sluice_writes() {
    use sluice_core::span::{Section, ATTRIBUTES};
    let core: Vec<(&str, &str)> = ATTRIBUTES
        .iter()
        .map(|a| {
            let section = match a.section {
                Section::LlmMetrics => "llm_metrics",
                Section::ModelRouter => "model_router",
                Section::TenantBudget => "tenant_budget",
                Section::LatencyGuard => "latency_guard",
            };
            (a.name, section)
        })
        .collect();
    assert_eq!(core, SPAN_ATTRIBUTES.to_vec());
    // A gateway with llm-metrics alone tags only llm-metrics' attributes.
    let tracing = Tracing::parse("127.0.0.1:4318").unwrap();
    let [(_, block), (_, cluster)] = tracing.vars(&["llm_metrics"]);
    assert!(block.contains("%FILTER_STATE(wasm.sluice_span.gen_ai.usage.output_tokens:PLAIN)%"), "{block}");
    assert!(!block.contains("sluice.budget.decision"), "{block}");
    assert!(cluster.contains("port_value: 4318"), "{cluster}");
}
