//! The measurement flow's rules as effect lists: what a host must do, in order, for each event.

use super::config::Settings;
use super::*;
use crate::contract::{GatewayEnd, GatewayReply};
use crate::flow::FixedView;

const MS: u64 = 1_000_000;

fn policy(config: &str) -> MetricsPolicy {
    MetricsPolicy::new(Settings::parse(config.as_bytes()).unwrap())
}

fn chat_view(body: &str) -> FixedView {
    FixedView {
        request_headers: vec![(":path".into(), "/v1/chat/completions".into()), ("x-sluice-tenant".into(), "acme".into())],
        request_body: body.as_bytes().to_vec(),
        ..FixedView::default()
    }
}

fn names(fx: &Effects) -> Vec<String> {
    fx.0.iter()
        .map(|e| match e {
            Effect::Count { name, delta } => format!("count {name} {delta}"),
            Effect::GaugeAdd { name, delta } => format!("gauge {name} {delta}"),
            Effect::Record { name, value } => format!("record {name} {value}"),
            Effect::SetState { key, value } => format!("state {key}={}", String::from_utf8_lossy(value)),
            Effect::WakeGuard => "wake".into(),
            other => format!("{other:?}"),
        })
        .collect()
}

fn stamp(fx: &Effects, key: &str) -> serde_json::Value {
    fx.0.iter()
        .find_map(|e| match e {
            Effect::SetState { key: k, value } if k == key => Some(serde_json::from_slice(value).unwrap()),
            _ => None,
        })
        .expect("a stamp")
}

#[test]
fn a_path_the_configuration_does_not_want_is_not_measured_and_costs_no_effect() {
    let mut p = policy(r#"{"path_prefixes":["/v1/"]}"#);
    let mut view = FixedView { request_headers: vec![(":path".into(), "/healthz".into())], ..FixedView::default() };
    let (mut flow, mut fx) = (MetricsFlow::default(), Effects::default());
    flow.on_request_headers(&mut p, &mut view, 0, &mut fx);
    view.now_ns = 5 * MS;
    flow.on_log(&mut p, &mut view, &mut fx);
    assert!(!flow.is_measured());
    assert!(fx.is_empty(), "{:?}", fx);
}

#[test]
fn a_stream_marks_waiting_then_its_first_content_token_then_reports_once() {
    let mut p = policy(r#"{"tenant":{"header":"x-sluice-tenant"},"tenants":["acme"]}"#);
    let body = r#"{"model":"m1","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let mut view = chat_view(body);
    let (mut flow, mut fx) = (MetricsFlow::default(), Effects::default());
    flow.on_request_headers(&mut p, &mut view, 0, &mut fx);
    assert!(fx.is_empty(), "no model-version header: in flight only once the body names the model");
    flow.on_request_body(&mut p, &mut view, body.len(), true, &mut fx);
    assert_eq!(names(&fx), ["gauge sluice.in_flight.model_version.m1 1"]);
    fx.clear();

    view.response_headers = vec![(":status".into(), "200".into()), ("content-type".into(), "text/event-stream".into())];
    view.now_ns = MS;
    flow.on_response_headers(&mut p, &mut view, false, &mut fx);
    assert_eq!(names(&fx), ["state sluice_first_token=0"]);
    fx.clear();

    // A role-only first chunk is no content token: nothing marked.
    view.response_body = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\n".to_vec();
    let n = view.response_body.len();
    flow.on_response_body(&mut p, &mut view, n, false, 40 * MS, &mut fx);
    assert!(fx.is_empty(), "{:?}", fx);
    view.response_body = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n".to_vec();
    let n = view.response_body.len();
    flow.on_response_body(&mut p, &mut view, n, false, 50 * MS, &mut fx);
    assert_eq!(names(&fx), [format!("state sluice_first_token={}", 50 * MS), "wake".into()]);
    assert_eq!(flow.first_content_ns(), Some(50 * MS));
    fx.clear();

    view.response_body = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n".to_vec();
    let n = view.response_body.len();
    flow.on_response_body(&mut p, &mut view, n, true, 70 * MS, &mut fx);
    let s = stamp(&fx, "sluice_llm");
    assert_eq!((s["status"].as_u64(), s["outcome"].as_str(), s["tenant"].as_str()), (Some(200), Some("completed"), Some("acme")));
    assert_eq!((s["ttft_us"].as_u64(), s["output_tokens"].as_u64(), s["duration_us"].as_u64()), (Some(50_000), Some(2), Some(70_000)));
    let listed = names(&fx);
    assert!(
        listed.contains(&"record sluice.ttft_ms.model_version.m1.tenant.acme.api.chat_completions.ctx.1k.turn.first.stream.true 50".to_string()),
        "{listed:?}"
    );
    fx.clear();

    // The teardown after a reported request only leaves the in-flight gauge.
    view.now_ns = 80 * MS;
    flow.on_log(&mut p, &mut view, &mut fx);
    assert_eq!(names(&fx), ["gauge sluice.in_flight.model_version.m1 -1"]);
}

#[test]
fn a_gateway_refusal_is_reported_with_the_gateways_status_whatever_the_headers_said() {
    let mut p = policy("{}");
    let mut view = chat_view(r#"{"model":"m1","messages":[]}"#);
    view.request_headers.push(("x-model-version".into(), "v2".into()));
    let (mut flow, mut fx) = (MetricsFlow::default(), Effects::default());
    flow.on_request_headers(&mut p, &mut view, 0, &mut fx);
    assert_eq!(names(&fx), ["gauge sluice.in_flight.model_version.v2 1"], "the header names the version before the body");
    fx.clear();
    view.gateway_reply = Some(GatewayReply { status: 429, end: GatewayEnd::Refused });
    view.response_headers = vec![(":status".into(), "200".into()), ("content-type".into(), "application/json".into())];
    view.now_ns = 2 * MS;
    flow.on_response_headers(&mut p, &mut view, true, &mut fx);
    let s = stamp(&fx, "sluice_llm");
    assert_eq!((s["status"].as_u64(), s["outcome"].as_str()), (Some(429), Some("refused")));
    assert!(names(&fx).iter().any(|n| n.starts_with("count sluice.gateway_replies_total.") && n.contains("refused")), "{:?}", names(&fx));
}

/// The body of a reply the gateway sent itself is the gateway's error, not the upstream's: the stamp
/// says `upstream_error: null`, as the native module (which never sees that body) does.
#[test]
fn a_gateway_refusals_own_error_body_is_not_reported_as_an_upstream_error() {
    let mut p = policy("{}");
    let body = r#"{"model":"m1","messages":[]}"#;
    let mut view = chat_view(body);
    let (mut flow, mut fx) = (MetricsFlow::default(), Effects::default());
    flow.on_request_headers(&mut p, &mut view, 0, &mut fx);
    flow.on_request_body(&mut p, &mut view, body.len(), true, &mut fx);
    view.gateway_reply = Some(GatewayReply { status: 429, end: GatewayEnd::Refused });
    view.response_headers = vec![(":status".into(), "429".into()), ("content-type".into(), "application/json".into())];
    view.now_ns = 2 * MS;
    flow.on_response_headers(&mut p, &mut view, false, &mut fx);
    view.response_body = br#"{"error":{"message":"sluice: budget exhausted","type":"rate_limit_exceeded","code":"key:k1:day:tokens"}}"#.to_vec();
    let n = view.response_body.len();
    flow.on_response_body(&mut p, &mut view, n, true, 3 * MS, &mut fx);
    let s = stamp(&fx, "sluice_llm");
    assert_eq!((s["status"].as_u64(), s["outcome"].as_str()), (Some(429), Some("refused")));
    assert!(s["upstream_error"].is_null(), "{s}");
}

#[test]
fn a_stream_the_client_left_is_reported_at_teardown_with_the_hosts_outcome() {
    let mut p = policy("{}");
    let body = r#"{"model":"m1","stream":true,"messages":[]}"#;
    let mut view = chat_view(body);
    let (mut flow, mut fx) = (MetricsFlow::default(), Effects::default());
    flow.on_request_headers(&mut p, &mut view, 0, &mut fx);
    flow.on_request_body(&mut p, &mut view, body.len(), true, &mut fx);
    view.response_headers = vec![(":status".into(), "200".into()), ("content-type".into(), "text/event-stream".into())];
    view.now_ns = MS;
    flow.on_response_headers(&mut p, &mut view, false, &mut fx);
    // A last event without its blank line still counts at teardown.
    view.response_body = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"}}]}".to_vec();
    let n = view.response_body.len();
    flow.on_response_body(&mut p, &mut view, n, false, 3 * MS, &mut fx);
    fx.clear();
    view.unended = Outcome::ClientDisconnect;
    view.now_ns = 9 * MS;
    flow.on_log(&mut p, &mut view, &mut fx);
    let s = stamp(&fx, "sluice_llm");
    assert_eq!((s["outcome"].as_str(), s["output_tokens"].as_u64()), (Some("client_disconnect"), Some(1)));
    assert_eq!(names(&fx).last().map(String::as_str), Some("gauge sluice.in_flight.model_version.m1 -1"));
}

#[test]
fn request_bodies_past_the_cap_or_encoded_are_counted_as_uninspected() {
    let mut p = policy(r#"{"max_request_body_bytes":16}"#);
    let body = r#"{"model":"m1","messages":[{"role":"user","content":"a long prompt"}]}"#;
    let mut view = chat_view(body);
    let (mut flow, mut fx) = (MetricsFlow::default(), Effects::default());
    flow.on_request_headers(&mut p, &mut view, 0, &mut fx);
    flow.on_request_body(&mut p, &mut view, body.len(), true, &mut fx);
    assert_eq!(names(&fx), ["count sluice.request_body_uninspected_total.reason.too_large 1", "gauge sluice.in_flight.model_version.unknown 1"]);

    let mut view = chat_view(body);
    view.request_headers.push(("content-encoding".into(), "gzip".into()));
    let (mut flow, mut fx) = (MetricsFlow::default(), Effects::default());
    flow.on_request_headers(&mut p, &mut view, 0, &mut fx);
    flow.on_request_body(&mut p, &mut view, body.len(), true, &mut fx);
    assert_eq!(names(&fx), ["count sluice.request_body_uninspected_total.reason.encoded 1", "gauge sluice.in_flight.model_version.unknown 1"]);
}

#[test]
fn the_summary_comment_is_appended_to_the_last_chunk_after_a_separator() {
    let mut p = policy(r#"{"stream_summary_comment":true}"#);
    let body = r#"{"model":"m1","stream":true,"messages":[]}"#;
    let mut view = chat_view(body);
    let (mut flow, mut fx) = (MetricsFlow::default(), Effects::default());
    flow.on_request_headers(&mut p, &mut view, 0, &mut fx);
    flow.on_request_body(&mut p, &mut view, body.len(), true, &mut fx);
    view.response_headers = vec![(":status".into(), "200".into()), ("content-type".into(), "text/event-stream".into())];
    view.now_ns = MS;
    flow.on_response_headers(&mut p, &mut view, false, &mut fx);
    fx.clear();
    // The stream ends mid-event: the comment must not be glued to it.
    view.response_body = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"}}]}".to_vec();
    let n = view.response_body.len();
    flow.on_response_body(&mut p, &mut view, n, true, 4 * MS, &mut fx);
    let appended = fx.0.iter().find_map(|e| match e {
        Effect::AppendBody { dir: Dir::Response, bytes } => Some(String::from_utf8_lossy(bytes).into_owned()),
        _ => None,
    });
    assert_eq!(appended.as_deref(), Some("\n\n: sluice ttft_us=4000 tpot_us=- output_tokens=1 input_tokens=0 usage=estimated\n\n"));
}

/// For a host that keeps no counter or histogram, the same request gives the same stamp and
/// gauges, and not one count or record: the effects are the counting host's with those taken out.
#[test]
fn a_host_without_counters_gets_the_same_stamp_and_gauges_and_no_counts() {
    let run = |mut fx: Effects| -> Vec<String> {
        let mut p = policy(r#"{"tenant":{"header":"x-sluice-tenant"},"tenants":["acme"]}"#);
        let body = r#"{"model":"m1","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
        let mut view = chat_view(body);
        let mut flow = MetricsFlow::default();
        flow.on_request_headers(&mut p, &mut view, 0, &mut fx);
        flow.on_request_body(&mut p, &mut view, body.len(), true, &mut fx);
        view.response_headers = vec![(":status".into(), "200".into()), ("content-type".into(), "text/event-stream".into())];
        view.now_ns = MS;
        flow.on_response_headers(&mut p, &mut view, false, &mut fx);
        view.response_body =
            b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello there\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n".to_vec();
        let n = view.response_body.len();
        flow.on_response_body(&mut p, &mut view, n, true, 70 * MS, &mut fx);
        view.now_ns = 80 * MS;
        flow.on_log(&mut p, &mut view, &mut fx);
        names(&fx)
    };
    let counting = run(Effects::default());
    let without = run(Effects::without_counters());
    assert!(counting.iter().any(|e| e.starts_with("count ")) && counting.iter().any(|e| e.starts_with("record ")), "{counting:?}");
    let expected: Vec<String> = counting.into_iter().filter(|e| !e.starts_with("count ") && !e.starts_with("record ")).collect();
    assert_eq!(without, expected);
    assert!(expected.iter().any(|e| e.starts_with("state sluice_llm=")) && expected.iter().any(|e| e.starts_with("gauge ")), "{expected:?}");

    // Pushed by any flow, counts and records are dropped; the rest is kept.
    let mut fx = Effects::without_counters();
    fx.count("sluice.shed_total", 1);
    fx.push(Effect::Record { name: "sluice.x".into(), value: 3 });
    fx.push(Effect::GaugeAdd { name: "sluice.in_flight".into(), delta: 1 });
    fx.set_state("k", "v");
    assert_eq!(names(&fx), ["gauge sluice.in_flight 1", "state k=v"]);
}
