//! llm-metrics in real Envoy: the built `.wasm` in Envoy 1.40 (V8), the shipped `envoy/templates/gateway.yaml`,
//! the mock model server streaming real SSE over real sockets. Every figure is read back from
//! Envoy's own `/stats/prometheus` and JSON access log.
//!
//! The mock sends its role-only chunk together with the response headers and the first content token
//! only after `x-mock-ttft-ms`: a TTFT taken at the first byte would be ≈ 0 ms and fail these tests.
//! Timing tolerance: measured TTFT within [configured, configured + 100 ms]; time per output token
//! within [0.9 × configured, configured + 25 ms] (loopback, a 2-core machine under test load).
//! Token counts and money are exact.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::Value;
use sluice_e2e::gateway::{demo_plugin_config, shipped, start_gateway};
use sluice_e2e::{get, post_json, post_stream, render_config, wait_until, Envoy, MockServer, Tools};
use std::time::Duration;

const CHAT: &str = "/v1/chat/completions";
const USER_TEXT: &str = "Hello there, model.";

/// The mock's prompt-token rule (examples/mock-server/README.md): ceil(chars / 4) + 4 per text unit.
fn mock_prompt_tokens(texts: &[&str]) -> u64 {
    texts.iter().map(|t| (t.chars().count() as u64).div_ceil(4) + 4).sum()
}

fn chat_body(stream: bool, include_usage: bool) -> String {
    serde_json::json!({
        "model": "llama-3-70b",
        "stream": stream,
        "stream_options": if include_usage { serde_json::json!({"include_usage": true}) } else { Value::Null },
        "messages": [{"role": "user", "content": USER_TEXT}],
    })
    .to_string()
}

/// Returns None (test skipped) only when Envoy is not installed and `SLUICE_ENVOY` is unset.
fn envoy_available() -> bool {
    Tools::locate_or_skip().unwrap().is_some()
}

/// The access-log stamps (parsed `sluice` field) of the first `n` log lines.
fn stamps(envoy: &Envoy, n: usize) -> Vec<Value> {
    envoy
        .access_log()
        .wait_for(n, Duration::from_secs(10))
        .unwrap()
        .into_iter()
        .map(|line| {
            let raw = line["sluice"].as_str().unwrap_or_else(|| panic!("no sluice stamp in {line}"));
            serde_json::from_str(raw).unwrap_or_else(|e| panic!("stamp is not JSON ({e}): {raw}"))
        })
        .collect()
}

fn counter(envoy: &Envoy, name: &str, labels: &[(&str, &str)]) -> f64 {
    envoy.metrics().unwrap().value(name, labels).unwrap_or(0.0)
}

#[test]
fn streaming_ttft_tpot_tokens_and_cost_match_the_mock() {
    if !envoy_available() {
        return;
    }
    let mock = MockServer::start(&[]).unwrap();
    let envoy = start_gateway(&mock, &demo_plugin_config().unwrap()).unwrap();
    let (ttft_ms, itl_ms, tokens, requests) = (150u64, 20u64, 12u64, 4usize);
    let headers = [("x-mock-ttft-ms", "150"), ("x-mock-itl-ms", "20"), ("x-mock-tokens", "12"), ("x-model-version", "v2"), ("x-sluice-tenant", "acme")];
    for _ in 0..requests {
        let response = post_stream(envoy.listen_addr(), CHAT, &headers, &chat_body(true, true)).unwrap().collect().unwrap();
        assert_eq!(response.status, 200);
        // The premise of the test: bytes arrive long before the first content token.
        let first_byte = response.head_at.duration_since(response.sent_at);
        let first_token = response.time_to("tok0").unwrap();
        assert!(first_byte < Duration::from_millis(100), "first byte after {first_byte:?}");
        assert!(first_token >= Duration::from_millis(ttft_ms), "first token after {first_token:?}");
        // stream_summary_comment is on in the demo policy: the client can read its own numbers.
        let text = response.text();
        assert!(text.contains("\n: sluice ttft_us="), "no summary comment in {text}");
        assert!(text.contains(" output_tokens=12 "), "summary comment has wrong count: {text}");
    }

    let prompt = mock_prompt_tokens(&[USER_TEXT]);
    for stamp in stamps(&envoy, requests) {
        let ttft_us = stamp["ttft_us"].as_u64().unwrap();
        assert!((ttft_ms * 1000..(ttft_ms + 100) * 1000).contains(&ttft_us), "ttft_us {ttft_us}: {stamp}");
        let tpot_us = stamp["tpot_us"].as_u64().unwrap();
        assert!((itl_ms * 900..(itl_ms + 25) * 1000).contains(&tpot_us), "tpot_us {tpot_us}: {stamp}");
        assert_eq!(stamp["output_tokens"], tokens, "{stamp}");
        assert_eq!(stamp["input_tokens"], prompt, "{stamp}");
        assert_eq!(stamp["usage"], "reported");
        assert_eq!(stamp["content_chunks"], tokens);
        assert_eq!(stamp["finish_reason"], "stop");
        assert_eq!(stamp["outcome"], "completed");
        assert_eq!(stamp["model_version"], "v2");
        assert_eq!(stamp["tenant"], "acme");
        assert_eq!(stamp["turn"], "first");
        assert_eq!(stamp["ctx"], "1k");
    }

    let labels = [("model_version", "v2"), ("tenant", "acme"), ("api", "chat_completions"), ("stream", "true")];
    let ttft = wait_until(Duration::from_secs(10), "TTFT histogram with every request", || {
        Ok(envoy.metrics()?.histogram("sluice_ttft_ms", &labels).filter(|h| h.count == requests as u64))
    })
    .unwrap();
    // 150 ms lands in the (100, 250] bucket; a first-byte TTFT would land at or below 5 ms.
    assert_eq!(ttft.cumulative(100.0), Some(0), "{ttft:?}");
    assert_eq!(ttft.cumulative(250.0), Some(requests as u64), "{ttft:?}");
    let tpot = envoy.metrics().unwrap().histogram("sluice_tpot_us", &labels).unwrap();
    assert_eq!(tpot.count, requests as u64);
    assert_eq!(tpot.cumulative(10_000.0), Some(0), "{tpot:?}");
    assert_eq!(tpot.cumulative(50_000.0), Some(requests as u64), "{tpot:?}");

    let n = requests as f64;
    assert_eq!(counter(&envoy, "sluice_output_tokens_total", &labels), n * tokens as f64);
    assert_eq!(counter(&envoy, "sluice_input_tokens_total", &labels), n * prompt as f64);
    let finished = [("status", "2xx"), ("finish", "stop"), ("usage", "reported"), ("tenant", "acme")];
    assert_eq!(counter(&envoy, "sluice_requests_total", &finished), n);
    // llama-3-70b*: $0.59 / $0.79 per million tokens → integer micro-USD, rounded up per request.
    let per_request = (prompt * 590_000 + tokens * 790_000).div_ceil(1_000_000);
    assert_eq!(counter(&envoy, "sluice_cost_micro_usd_total", &labels), n * per_request as f64);
    // Nothing in flight once every stream has ended.
    assert_eq!(counter(&envoy, "sluice_in_flight", &[("model_version", "v2")]), 0.0);
}

#[test]
fn every_api_kind_streaming_and_not_counts_exactly() {
    if !envoy_available() {
        return;
    }
    let mock = MockServer::start(&[]).unwrap();
    let envoy = start_gateway(&mock, &demo_plugin_config().unwrap()).unwrap();
    let cases: &[(&str, &str, &str)] = &[
        (
            "/v1/chat/completions",
            "chat_completions",
            r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Hello there, model."}],"stream_options":{"include_usage":true}"#,
        ),
        ("/v1/completions", "completions", r#"{"model":"gpt-4o-mini","prompt":"Hello there, model.","stream_options":{"include_usage":true}"#),
        ("/v1/responses", "responses", r#"{"model":"gpt-4o-mini","input":"Hello there, model.""#),
        ("/v1/messages", "messages", r#"{"model":"claude-sonnet-4","max_tokens":100,"messages":[{"role":"user","content":"Hello there, model."}]"#),
    ];
    let prompt = mock_prompt_tokens(&[USER_TEXT]);
    let mut expected = Vec::new();
    for (path, api, body_start) in cases {
        for stream in [true, false] {
            let body = format!("{body_start},\"stream\":{stream}}}");
            let headers = [("x-mock-tokens", "7"), ("x-mock-cached-tokens", "3"), ("x-sluice-tenant", "globex")];
            let response = post_json(envoy.listen_addr(), path, &headers, &body).unwrap();
            assert_eq!(response.status, 200, "{path} stream={stream}: {}", response.text());
            expected.push((*api, stream));
        }
    }
    let stamps = stamps(&envoy, expected.len());
    for (stamp, (api, stream)) in stamps.iter().zip(&expected) {
        assert_eq!(stamp["api"], *api, "{stamp}");
        assert_eq!(stamp["stream"], *stream, "{stamp}");
        assert_eq!(stamp["output_tokens"], 7, "{stamp}");
        assert_eq!(stamp["input_tokens"], prompt, "{stamp}");
        assert_eq!(stamp["cached_input_tokens"], 3, "{stamp}");
        assert_eq!(stamp["usage"], "reported", "{stamp}");
        assert_eq!(stamp["tenant"], "globex");
        assert!(stamp["finish_reason"].is_string(), "{stamp}");
        if *stream {
            assert!(stamp["ttft_us"].is_u64(), "{stamp}");
        } else {
            assert!(stamp["ttft_us"].is_null(), "no TTFT without a stream: {stamp}");
        }
    }
    for (_, api, _) in cases {
        assert_eq!(counter(&envoy, "sluice_output_tokens_total", &[("api", api)]), 14.0, "{api}");
        assert_eq!(counter(&envoy, "sluice_cached_input_tokens_total", &[("api", api)]), 6.0, "{api}");
    }
}

#[test]
fn streams_without_usage_are_counted_per_chunk_and_flagged_estimated() {
    if !envoy_available() {
        return;
    }
    let mock = MockServer::start(&[]).unwrap();
    let envoy = start_gateway(&mock, &demo_plugin_config().unwrap()).unwrap();
    let headers = [("x-mock-tokens", "9"), ("x-mock-usage", "never"), ("x-mock-keepalive", "3"), ("x-mock-ttft-ms", "60")];
    let response = post_json(envoy.listen_addr(), CHAT, &headers, &chat_body(true, false)).unwrap();
    assert_eq!(response.status, 200);
    let stamp = &stamps(&envoy, 1)[0];
    assert_eq!(stamp["usage"], "estimated", "{stamp}");
    assert_eq!(stamp["output_tokens"], 9, "{stamp}");
    // Keep-alive comments before the first token do not count as the first token.
    assert!(stamp["ttft_us"].as_u64().unwrap() >= 60_000, "{stamp}");
    assert_eq!(counter(&envoy, "sluice_requests_total", &[("usage", "estimated")]), 1.0);
}

#[test]
fn interrupted_and_failed_requests_are_reported() {
    if !envoy_available() {
        return;
    }
    let mock = MockServer::start(&[]).unwrap();
    let envoy = start_gateway(&mock, &demo_plugin_config().unwrap()).unwrap();
    let addr = envoy.listen_addr();

    // 1. The client goes away mid-stream.
    let slow = [("x-mock-tokens", "200"), ("x-mock-itl-ms", "20"), ("x-model-version", "v1")];
    let received = post_stream(addr, CHAT, &slow, &chat_body(true, true)).unwrap().abort_after(1200).unwrap();
    assert!(!received.is_empty());
    wait_until(Duration::from_secs(10), "client disconnect counted", || {
        Ok((counter(&envoy, "sluice_client_disconnects_total", &[("model_version", "v1")]) == 1.0).then_some(()))
    })
    .unwrap();

    // 2. The upstream resets the connection after 3 tokens.
    let reset = [("x-mock-tokens", "20"), ("x-mock-fail", "reset-after:3"), ("x-model-version", "v1")];
    let _ = post_stream(addr, CHAT, &reset, &chat_body(true, true)).unwrap().collect();

    // 3. The upstream answers 503.
    let unavailable = [("x-mock-fail", "status:503"), ("x-model-version", "v1")];
    let response = post_json(addr, CHAT, &unavailable, &chat_body(false, false)).unwrap();
    assert_eq!(response.status, 503);

    let stamps = stamps(&envoy, 3);
    let outcome = |i: usize| stamps[i]["outcome"].as_str().unwrap().to_string();
    assert_eq!(outcome(0), "client_disconnect", "{}", stamps[0]);
    assert!(stamps[0]["output_tokens"].as_u64().unwrap() > 0, "tokens seen before the disconnect count: {}", stamps[0]);
    assert_eq!(outcome(1), "upstream_error", "{}", stamps[1]);
    assert_eq!(stamps[1]["output_tokens"], 3, "tokens before the reset count: {}", stamps[1]);
    assert_eq!(stamps[1]["usage"], "estimated");
    assert_eq!(outcome(2), "upstream_error", "{}", stamps[2]);
    assert_eq!(stamps[2]["status"], 503);
    assert_eq!(counter(&envoy, "sluice_upstream_errors_total", &[("model_version", "v1")]), 2.0);
    assert_eq!(counter(&envoy, "sluice_requests_total", &[("status", "5xx")]), 1.0);
    assert_eq!(counter(&envoy, "sluice_in_flight", &[("model_version", "v1")]), 0.0);
}

#[test]
fn other_paths_pass_unmeasured() {
    if !envoy_available() {
        return;
    }
    let mock = MockServer::start(&[]).unwrap();
    let envoy = start_gateway(&mock, &demo_plugin_config().unwrap()).unwrap();
    let response = get(envoy.listen_addr(), "/health").unwrap();
    assert_eq!(response.status, 200);
    let lines = envoy.access_log().wait_for(1, Duration::from_secs(10)).unwrap();
    assert_eq!(lines[0]["sluice"], Value::Null, "a non-LLM request got a stamp: {}", lines[0]);
    assert_eq!(envoy.metrics().unwrap().series("sluice_requests_total").count(), 0);
}

#[test]
fn a_broken_plugin_configuration_is_refused_with_the_field_named() {
    if !envoy_available() {
        return;
    }
    let mock = MockServer::start(&[]).unwrap();
    let err = start_gateway(&mock, r#"{"path_prefixes":["v1/"]}"#).err().expect("Envoy accepted a broken configuration");
    let message = format!("{err:#}");
    assert!(message.contains("path_prefixes[0]: must start with '/'"), "{message}");
}

/// A `floor` filter entry of envoy/bench/native-floor.yaml's FLOOR_FILTERS block, making every call
/// it can (benches/envoy_instructions.py writes one per instance).
const NATIVE_FLOOR_FILTER: &str = "- name: envoy.filters.http.dynamic_modules
  typed_config:
    \"@type\": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter
    dynamic_module_config: { name: sluice, do_not_close: true }
    filter_name: floor
    filter_config: { \"@type\": type.googleapis.com/google.protobuf.StringValue, value: \"hold,chunks,histograms=6,bare_histograms=1,states=4\" }
";

/// The load-bench configs (envoy/bench/) validate. The gateway templates are covered by
/// shipped_configs.rs (their rendered copies validated) and by the tests that start each of them.
#[test]
fn the_bench_envoy_configs_validate() {
    if !envoy_available() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("sluice-validate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut checked = 0;
    for entry in std::fs::read_dir(shipped("envoy/bench")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let wasm = sluice_e2e::tools::wasm_dir().display().to_string();
        let vars = [
            ("ADMIN_PORT", "9901"),
            ("LISTEN_PORT", "10000"),
            ("UPSTREAM_PORT", "18000"),
            ("WASM_DIR", wasm.as_str()),
            ("EXTPROC_PORT", "18100"),
            ("FLOOR_CONFIG", "get_header=1"),
            ("FLOOR_FILTERS", NATIVE_FLOOR_FILTER),
        ];
        let rendered = render_config(&std::fs::read_to_string(&path).unwrap(), &vars).unwrap();
        let out = dir.join(path.file_name().unwrap());
        std::fs::write(&out, rendered).unwrap();
        // The native floor's libsluice.so is loaded from the workspace's target/native.
        Envoy::validate_in(&out, Some(&sluice_e2e::tools::workspace_root())).unwrap_or_else(|e| panic!("{} does not validate: {e:#}", path.display()));
        checked += 1;
    }
    assert!(checked >= 6, "expected the bench configs (none, floor, floor4, lua, extproc, native-floor), checked {checked}");
    let _ = std::fs::remove_dir_all(&dir);
}
