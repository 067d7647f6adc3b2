//! latency-guard in real Envoy (`envoy/latency-gateway.yaml`): json_to_metadata → latency-guard →
//! model-router → llm-metrics → router, two mock clusters (v1, its fallback v2).
//!
//! - a stalled upstream (headers and role chunk sent, no token) is answered 504 at the TTFT
//!   deadline, because the guard held the response headers;
//! - a healthy stream is released at its first token, its TTFT at the client barely moved;
//! - a stream past its total deadline ends with an error event;
//! - the SLO scenario: v1's TTFT goes from fast to slow mid-test, the breaker opens within its
//!   window, critical and standard tenants move to v2, sheddable ones get 503 with `retry-after`;
//!   v1 recovers, probes pass, the breaker closes and traffic returns. The timeline is printed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use sluice_e2e::gateway::{demo_plugin_config, shipped, yaml_string_body};
use sluice_e2e::{post_json, post_stream, Envoy, MockServer};
use std::time::{Duration, Instant};

const CHAT: &str = "/v1/chat/completions";

struct Gateway {
    _v1: MockServer,
    _v2: MockServer,
    envoy: Envoy,
}

fn start() -> Gateway {
    let v1 = MockServer::start(&["--served-by", "llama-v1", "--tokens", "6", "--ttft-ms", "40"]).unwrap();
    let v2 = MockServer::start(&["--served-by", "llama-v2", "--tokens", "6", "--ttft-ms", "40"]).unwrap();
    let mut metrics: Value = serde_json::from_str(&demo_plugin_config().unwrap()).unwrap();
    metrics["stream_summary_comment"] = json!(false);
    let read = |p: &str| std::fs::read_to_string(shipped(p)).unwrap();
    let (p1, p2) = (v1.port().to_string(), v2.port().to_string());
    let guard = yaml_string_body(&read("policies/latency-guard.e2e.json"));
    let router = yaml_string_body(&read("policies/model-router.latency-e2e.json"));
    let metrics = yaml_string_body(&metrics.to_string());
    let envoy = Envoy::start(
        &shipped("envoy/latency-gateway.yaml"),
        &[
            ("UPSTREAM_PORT", p1.as_str()),
            ("UPSTREAM_PORT_V2", p2.as_str()),
            // No shadow in this policy; the cluster needs a port all the same.
            ("SHADOW_PORT", p2.as_str()),
            ("LATENCY_CONFIG", guard.as_str()),
            ("ROUTER_CONFIG", router.as_str()),
            ("PLUGIN_CONFIG", metrics.as_str()),
        ],
    )
    .unwrap();
    Gateway { _v1: v1, _v2: v2, envoy }
}

fn body(stream: bool) -> String {
    json!({"model": "llama-3-70b", "stream": stream, "messages": [{"role": "user", "content": "How fast are you today?"}]})
        .to_string()
}

fn headers<'a>(tenant: &'a str, extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut h = vec![("content-type", "application/json"), ("x-sluice-tenant", tenant)];
    h.extend_from_slice(extra);
    h
}

#[test]
fn stalled_upstream_is_answered_504_at_the_ttft_deadline_and_healthy_streams_pass() {
    let gw = start();
    // Healthy: released at the first token.
    let t = Instant::now();
    let ok = post_stream(gw.envoy.listen_addr(), CHAT, &headers("std-a", &[("x-mock-ttft-ms", "150")]), &body(true))
        .unwrap()
        .collect()
        .unwrap();
    assert_eq!(ok.status, 200, "{}", ok.text());
    assert!(ok.complete);
    let head = ok.head_at.duration_since(ok.sent_at);
    println!("healthy stream: head after {head:?}, complete after {:?}", t.elapsed());
    assert!(head >= Duration::from_millis(150), "headers must wait for the first token (held), got {head:?}");
    assert!(ok.text().contains("[DONE]"));

    // Stalled: headers and the role chunk sent at once, the first token only after 5 s.
    let t = Instant::now();
    let stalled = post_json(gw.envoy.listen_addr(), CHAT, &headers("std-a", &[("x-mock-ttft-ms", "5000")]), &body(true)).unwrap();
    let took = t.elapsed();
    println!("stalled stream: {} after {took:?}: {}", stalled.status, stalled.text());
    assert_eq!(stalled.status, 504, "{}", stalled.text());
    assert!(took >= Duration::from_millis(1000) && took < Duration::from_millis(2500), "{took:?}");
    let err: Value = stalled.json().unwrap();
    assert_eq!(err["error"]["code"], "ttft_deadline_exceeded");
    assert!(err["error"]["message"].as_str().unwrap().contains("1000 ms"), "{err}");
    drop(gw);
}
