//! The four policies as one chain (`sluice_host::Chain`), as the full gateway runs them:
//! latency-guard → model-router → tenant-budget → llm-metrics, one process, one clock. What one
//! filter tells another (filter state, the guard's release queue) must arrive, and a refusal must
//! be one story in every stamp. Every test runs twice: as four filters (one per policy) and as two
//! `sluice.wasm` filters (the guard, then one filter running the three other sections), which must
//! tell the same story.

use std::time::Duration;

use serde_json::Value;
use sluice_host::{Chain, ChainEvent, Headers, StreamId};

use sluice_core::contract::MODEL_METADATA;

/// The two shapes of the full gateway, and the filter position of tenant-budget in each.
fn chains() -> [(&'static str, Chain, usize); 2] {
    [
        ("four filters", Chain::full_gateway().expect("the chain starts"), 2),
        ("guard + one sluice filter", Chain::sluice_gateway().expect("the sluice chain starts"), 1),
    ]
}

fn send(chain: &Chain, tenant: &str, request_id: &str, max_tokens: u64) -> StreamId {
    let body = format!(r#"{{"model":"llama-3-70b","stream":true,"max_tokens":{max_tokens},"messages":[{{"role":"user","content":"hello there"}}]}}"#);
    let stream = chain.stream(&[(&MODEL_METADATA, b"llama-3-70b")]);
    let headers = Headers::from_pairs(&[
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        (":authority", "gateway"),
        (":scheme", "http"),
        ("content-type", "application/json"),
        ("x-sluice-tenant", tenant),
        ("x-request-id", request_id),
        ("content-length", &body.len().to_string()),
    ]);
    chain.request_headers(stream, headers, false).expect("request headers");
    chain.request_body(stream, body.into_bytes(), true).expect("request body");
    stream
}

fn chunk(content: &str) -> Vec<u8> {
    format!("data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"llama-3-70b\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{content}\"}},\"finish_reason\":null}}]}}\n\n").into_bytes()
}

fn end_chunks(prompt: u64, completion: u64) -> Vec<u8> {
    format!(
        "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"llama-3-70b\",\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":\"stop\"}}]}}\n\n\
         data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"llama-3-70b\",\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt},\"completion_tokens\":{completion},\"total_tokens\":{}}}}}\n\ndata: [DONE]\n\n",
        prompt + completion
    )
    .into_bytes()
}

fn stamp(properties: &[(String, Vec<u8>)], name: &str) -> Value {
    let raw = properties.iter().find(|(k, _)| k == name).unwrap_or_else(|| panic!("no {name} stamp in {properties:?}"));
    serde_json::from_slice(&raw.1).unwrap_or_else(|e| panic!("{name} stamp is not JSON: {e}"))
}

fn ended(events: &[ChainEvent], stream: StreamId) -> Vec<(String, Vec<u8>)> {
    events
        .iter()
        .find_map(|e| match e {
            ChainEvent::Ended { stream: s, properties } if *s == stream => Some(properties.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("stream {stream:?} did not end: {events:?}"))
}

#[test]
fn an_admitted_request_passes_every_filter_and_every_stamp_tells_the_same_story() {
    for (shape, chain, budget_filter) in chains() {
        let _ = (shape, budget_filter);
        let t0 = chain.now_ns();
        let stream = send(&chain, "acme", "req-1", 50);
        let events = chain.take_events();
        let upstream = events.iter().find_map(|e| match e {
            ChainEvent::UpstreamRequest { headers, body, .. } => Some((headers.clone(), body.clone())),
            _ => None,
        });
        let (headers, body) = upstream.expect("the request reached the upstream");
        // model-router's decision is on the request as the router filter sees it.
        let route = headers.get("x-sluice-route").expect("model-router wrote its route header").to_string();
        assert!(route == "llama-v1" || route == "llama-v2", "{route}");
        let body: Value = serde_json::from_slice(&body).expect("JSON body upstream");
        assert_eq!(body["stream_options"]["include_usage"], Value::Bool(true), "tenant-budget asks for usage: {body}");

        chain.advance_to(t0 + 120_000_000).expect("advance");
        chain.response_headers(stream, Headers::from_pairs(&[(":status", "200"), ("content-type", "text/event-stream")]), false).expect("headers");
        chain.advance_to(t0 + 180_000_000).expect("advance");
        chain.response_body(stream, chunk("Hi"), false).expect("first token");
        chain.advance_to(t0 + 380_000_000).expect("advance");
        chain.response_body(stream, end_chunks(11, 21), true).expect("end");
        let events = chain.take_events();
        let properties = ended(&events, stream);
        let llm = stamp(&properties, "sluice_llm");
        assert_eq!(llm["status"], 200);
        assert_eq!(llm["outcome"], "completed");
        assert_eq!(llm["output_tokens"], 21);
        assert_eq!(llm["ttft_us"], 180_000, "TTFT at llm-metrics: {llm}");
        let budget = stamp(&properties, "sluice_budget");
        assert_eq!(budget["decision"], "admitted");
        assert_eq!(budget["charged_tokens"], 32);
        let route_stamp = stamp(&properties, "sluice_route");
        let version = route_stamp["version"].as_str().expect("route stamp names the version").to_string();
        assert_eq!(llm["model_version"], version.as_str(), "llm-metrics labels the version model-router chose");
        let latency = stamp(&properties, "sluice_latency");
        assert_eq!(latency["version"], version.as_str());
        assert_eq!(latency["status"], 200);
        assert!(!chain.is_open(stream));
    }
}

#[test]
fn a_refusal_is_answered_by_tenant_budget_never_reaches_the_upstream_and_every_stamp_says_429_or_its_status() {
    for (shape, chain, budget_filter) in chains() {
        let _ = (shape, budget_filter);
        // globex may spend 100,000 tokens a minute; each request holds its prompt and 4,096 output
        // tokens (the policy's cap) until it ends, so the 24th cannot fit.
        let mut admitted = Vec::new();
        let (stream, events) = loop {
            let stream = send(&chain, "globex", &format!("req-{}", admitted.len()), 60_000);
            let events = chain.take_events();
            if events.iter().any(|e| matches!(e, ChainEvent::UpstreamRequest { stream: s, .. } if *s == stream)) {
                admitted.push(stream);
                assert!(admitted.len() < 40, "never refused");
                continue;
            }
            break (stream, events);
        };
        assert_eq!(admitted.len(), 23);
        let (filter, status) = events
            .iter()
            .find_map(|e| match e {
                ChainEvent::LocalReply { filter, reply, .. } => Some((*filter, reply.status)),
                _ => None,
            })
            .expect("a local reply");
        assert_eq!(filter, budget_filter, "{shape}: tenant-budget's filter answers");
        let properties = ended(&events, stream);
        let llm = stamp(&properties, "sluice_llm");
        assert_eq!(llm["status"], status);
        assert_eq!(llm["outcome"], "refused");
        let budget = stamp(&properties, "sluice_budget");
        assert_eq!(budget["decision"], "rejected");
        assert_eq!(budget["reject_code"], "key:globex:minute:total_tokens", "{budget}");
        assert_eq!(budget["status"], status);
        assert_eq!(status, 429);
        assert!(admitted.iter().all(|s| chain.is_open(*s)), "the admitted requests are still in flight");
        assert!(events.iter().any(|e| matches!(e, ChainEvent::ClientHeaders { status: s, .. } if *s == status)));
    }
}

#[test]
fn the_guard_lets_the_response_go_at_the_first_token_through_llm_metrics_queue_not_at_its_next_tick() {
    for (shape, chain, budget_filter) in chains() {
        let _ = (shape, budget_filter);
        let t0 = chain.now_ns();
        let stream = send(&chain, "acme", "req-3", 20);
        chain.take_events();
        chain.response_headers(stream, Headers::from_pairs(&[(":status", "200"), ("content-type", "text/event-stream")]), false).expect("headers");
        // A role-only chunk is no content: the guard keeps holding.
        chain.response_body(stream, b"data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\n".to_vec(), false).expect("role chunk");
        let held = chain.take_events();
        assert!(!held.iter().any(|e| matches!(e, ChainEvent::ClientHeaders { .. })), "released before any content: {held:?}");
        // Off any tick boundary: only the queue can release it at this very instant.
        chain.advance_to(t0 + 73_300_100).expect("advance");
        chain.take_events();
        chain.response_body(stream, chunk("Hi"), false).expect("first token");
        let released = chain.take_events();
        assert!(released.iter().any(|e| matches!(e, ChainEvent::ClientHeaders { status: 200, .. })), "not released at the first token: {released:?}");
        assert_eq!(chain.now_ns(), t0 + 73_300_100);
        chain.response_body(stream, end_chunks(5, 1), true).expect("end");
        let events = chain.take_events();
        let latency = stamp(&ended(&events, stream), "sluice_latency");
        assert_eq!(latency["ttft_ms"], 73);
    }
}

#[test]
fn ticks_of_every_filter_fire_in_time_order_on_the_shared_clock() {
    for (shape, chain, budget_filter) in chains() {
        let _ = (shape, budget_filter);
        let t0 = chain.now_ns();
        chain.advance_to(t0 + Duration::from_secs(2).as_nanos() as u64).expect("advance");
        assert_eq!(chain.now_ns(), t0 + 2_000_000_000);
        for gateway in chain.gateways() {
            assert_eq!(gateway.now_ns(), chain.now_ns(), "every VM reads the one clock");
            assert!(gateway.crashed().is_none());
        }
    }
}
