//! llm-metrics on a response that ends with trailers: the last body callback has no
//! `end_of_stream`, the trailers callback ends the response. An HTTP/2 upstream ends a stream so,
//! and Envoy's decompressor filter (in front of the plugins in the shipped gateways) adds trailers
//! to every response it decodes. The response is complete at the trailers — not a client
//! disconnect at teardown, and its duration ends there. Found in real Envoy by
//! `e2e/tests/faults_envoy.rs` (gzip / br / zstd answers stamped `client_disconnect`).
//!
//! Build the plugin first: `cargo build --release --target wasm32-wasip1 -p sluice-llm-metrics`.

mod common;

use common::llm::{chat, gateway, headers, Call, Delivery, Labels, ACME_V2};
use serde_json::json;

#[test]
fn a_stream_ending_with_trailers_is_complete_at_the_trailers() {
    let gw = gateway();
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(true, false));
    c.sse_headers(5);
    c.body(&[(10, chat::role()), (20, chat::content("Hi")), (30, chat::content(" there")), (40, chat::finish("stop"))], Delivery::PerEntry, false);
    c.at(50);
    c.stream.response_trailers(&[("grpc-status", "0")]).expect("response trailers");
    // Envoy logs the request later: nothing may change by then.
    c.at(90);
    c.end();
    let l = Labels::new("chat_completions");
    assert_eq!(gw.counter(&l.name("client_disconnects_total")), None);
    assert_eq!(gw.counter(&l.requests_total("2xx", "stop", "estimated")), Some(1));
    assert_eq!(gw.histogram(&l.name("request_duration_ms")), Some(vec![50]));
    let stamp = c.stamp();
    assert_eq!((stamp["status"].clone(), stamp["outcome"].clone(), stamp["output_tokens"].clone()), (json!(200), json!("completed"), json!(2)));
    assert_eq!(stamp["ttft_us"], json!(20_000));
    assert_eq!(gw.gauge("sluice.in_flight.model_version.v2"), Some(0));
}

#[test]
fn a_whole_answer_ending_with_trailers_is_read_at_the_trailers() {
    let gw = gateway();
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(false, false));
    c.response_headers(5, "200", "application/json");
    let body = json!({"id": "x", "object": "chat.completion", "model": chat::MODEL, "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}],
                      "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}});
    c.body_bytes(10, body.to_string().as_bytes(), false);
    c.at(12);
    c.stream.response_trailers(&[("x-envoy-decompressor-gzip-compressed-bytes", "40")]).expect("response trailers");
    c.at(60);
    c.end();
    let l = Labels::new("chat_completions").stream(false);
    assert_eq!(gw.counter(&l.name("client_disconnects_total")), None);
    assert_eq!(gw.histogram(&l.name("request_duration_ms")), Some(vec![12]));
    let stamp = c.stamp();
    assert_eq!(
        (stamp["outcome"].clone(), stamp["usage"].clone(), stamp["input_tokens"].clone(), stamp["output_tokens"].clone()),
        (json!("completed"), json!("reported"), json!(9), json!(3))
    );
}

/// The stream's end never reaches the plugin (Envoy 1.40 drops trailers a filter nearer the
/// upstream added, for the filters before one that still holds the response), but Envoy saw the
/// answer through: `via_upstream` with no response flag. Completed, not a client disconnect.
#[test]
fn a_stream_whose_end_never_reached_the_plugin_is_complete_when_envoy_flags_nothing() {
    let gw = gateway();
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(true, false));
    c.sse_headers(5);
    c.body(&[(10, chat::role()), (20, chat::content("Hi")), (30, chat::finish("stop"))], Delivery::PerEntry, false);
    c.stream.set_property(&["response", "code_details"], "via_upstream");
    c.stream.set_property(&["response", "flags"], 0u64.to_le_bytes().to_vec());
    c.at(40);
    c.end();
    let l = Labels::new("chat_completions");
    assert_eq!(gw.counter(&l.name("client_disconnects_total")), None);
    let stamp = c.stamp();
    assert_eq!((stamp["outcome"].clone(), stamp["output_tokens"].clone()), (json!("completed"), json!(1)));
}

/// The same, with Envoy's downstream-termination flag (`DC`, bit 14): the client went away.
#[test]
fn a_stream_cut_with_a_response_flag_stays_a_client_disconnect() {
    let gw = gateway();
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(true, false));
    c.sse_headers(5);
    c.body(&[(10, chat::role()), (20, chat::content("Hi"))], Delivery::PerEntry, false);
    c.stream.set_property(&["response", "code_details"], "via_upstream");
    c.stream.set_property(&["response", "flags"], (1u64 << 14).to_le_bytes().to_vec());
    c.at(40);
    c.end();
    let l = Labels::new("chat_completions");
    assert_eq!(gw.counter(&l.name("client_disconnects_total")), Some(1));
    assert_eq!(c.stamp()["outcome"], json!("client_disconnect"));
}
