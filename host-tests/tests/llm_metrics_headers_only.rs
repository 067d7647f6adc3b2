//! llm-metrics on a response that ends with its headers (`end_of_stream` on the response headers:
//! another filter's empty local reply, a 204): the response is complete there, no body callback
//! follows, and it must not be counted as a client disconnect: a 5xx is an upstream error, as with
//! a body (the plugin cannot tell a local reply from the upstream's). Found in real Envoy by
//! `e2e/tests/lifecycle_envoy.rs`: a trapping wasm filter behind llm-metrics answers 503 without a
//! body, which llm-metrics stamped `client_disconnect`.
//!
//! Build the plugin first: `cargo build --release --target wasm32-wasip1 -p sluice-llm-metrics`.

mod common;

use common::llm::{chat, gateway, headers, Call, Labels, ACME_V2};
use serde_json::json;

#[test]
fn a_response_ending_with_its_headers_ends_there_and_is_no_client_disconnect() {
    let gw = gateway();
    let mut c = Call::start(&gw, &headers(chat::PATH, &ACME_V2), &chat::request(true, true));
    c.at(3);
    c.stream.response_headers(&[(":status", "503"), ("content-length", "0")], true).expect("response headers");
    // Envoy logs the request later: nothing may change by then.
    c.at(5);
    c.end();
    let l = Labels::new("chat_completions").stream(false);
    assert_eq!(gw.counter(&l.name("client_disconnects_total")), None);
    assert_eq!(gw.counter(&l.name("upstream_errors_total")), Some(1));
    assert_eq!(gw.counter(&l.requests_total("5xx", "none", "estimated")), Some(1));
    assert_eq!(gw.histogram(&l.name("request_duration_ms")), Some(vec![3]));
    let stamp = c.stamp();
    assert_eq!((stamp["status"].clone(), stamp["outcome"].clone()), (json!(503), json!("upstream_error")));
    assert_eq!(gw.gauge("sluice.in_flight.model_version.v2"), Some(0));
}
