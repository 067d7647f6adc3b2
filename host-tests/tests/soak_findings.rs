//! What the soak (`e2e/src/soak.rs`) found in real Envoy, held here under the virtual clock: an
//! Anthropic stream reports its input in `message_start`, before any content, and tenant-budget and
//! llm-metrics must read that alike.
//!
//! - a 504 at the TTFT deadline after `message_start` charges nothing (as before the first token of
//!   any other stream), though the input count is known;
//! - an error event inside a 200 stream is an upstream error in tenant-budget's stamp, as in
//!   llm-metrics';
//! - a stream cut after `message_start` is measured by llm-metrics with the input the upstream
//!   reported, the figure tenant-budget charges, not the request-body estimate.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::budget::*;
use common::llm::{messages, Call, Delivery};
use serde_json::{json, Value};

/// The first three events of `messages::timeline()`: `message_start` (25 input, 1000 cache-read
/// tokens), `content_block_start`, `ping`.
fn preamble() -> Vec<(u64, String)> {
    messages::timeline().into_iter().take(3).collect()
}

fn anthropic_key() -> Vec<(&'static str, &'static str)> {
    key_headers(messages::PATH, "search-prod")
}

fn stream_policy() -> Value {
    policy(json!([]), json!([]), json!([{"window": "minute", "tokens": 100_000}]))
}

#[test]
fn a_guard_deadline_after_message_start_but_before_any_content_charges_nothing() {
    let gw = gateway(&stream_policy());
    let mut c = Call::start(&gw, &anthropic_key(), &messages::request(true));
    c.sse_headers(120);
    c.body(&preamble(), Delivery::PerEntry, false);
    c.at(2000);
    c.stream.set_property(&["sluice_gateway_reply"], "504 deadline");
    c.stream.upstream_reset().unwrap();
    let s = stamp(&c.stream);
    assert_eq!(
        (s["status"].clone(), s["outcome"].clone(), s["charged_tokens"].clone(), s["charged_micro_usd"].clone()),
        (json!(504), json!("deadline"), json!(0), json!(0)),
        "{s}"
    );
    assert_eq!(used_reserved(&gw, "key", "search-prod", 0), (0, 0));
}

#[test]
fn an_error_event_in_a_200_stream_is_an_upstream_error_in_the_budget_stamp() {
    let gw = gateway(&stream_policy());
    let mut c = Call::start(&gw, &anthropic_key(), &messages::request(true));
    c.sse_headers(120);
    let mut t: Vec<(u64, String)> = messages::timeline().into_iter().take(5).collect();
    t.push((500, messages::event("error", json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}))));
    c.body(&t, Delivery::PerEntry, true);
    let s = stamp(&c.stream);
    assert_eq!((s["status"].clone(), s["outcome"].clone(), s["usage"].clone()), (json!(200), json!("upstream_error"), json!("estimated")), "{s}");
    // What passed is charged: message_start's input (with the cache reads) and the two deltas.
    assert_eq!(s["input_tokens"], json!(1025), "{s}");
}

#[test]
fn llm_metrics_measures_a_cut_anthropic_stream_with_the_input_it_reported() {
    let gw = common::llm::gateway();
    let mut c = Call::start(&gw, &common::llm::headers(messages::PATH, &[]), &messages::request(true));
    c.sse_headers(120);
    let t: Vec<(u64, String)> = messages::timeline().into_iter().take(5).collect();
    c.body(&t, Delivery::PerEntry, false);
    c.at(600);
    c.stream.client_reset().unwrap();
    let s = c.stamp();
    assert_eq!((s["outcome"].clone(), s["usage"].clone(), s["input_tokens"].clone()), (json!("client_disconnect"), json!("estimated"), json!(1025)), "{s}");
}
