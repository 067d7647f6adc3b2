//! The rules model-router's adapter used to hold, as exact effect lists.

use super::*;
use crate::contract::GatewayReply;
use crate::flow::FixedView;
use crate::store::MemoryStore;
use serde_json::json;

/// 2026-01-01T00:00:00Z.
const T0: u64 = 1_767_225_600_000_000_000;
const MS: u64 = 1_000_000;
const CHAT: &str = "/v1/chat/completions";
const MODEL: &str = "llama-3-70b";
const SHADOW: &str = "qwen-72b-v1";

fn versions2() -> serde_json::Value {
    json!([
        { "name": "v1", "weight": 100, "upstream_model": "llama-3-70b", "route": "llama-v1" },
        { "name": "v2", "weight": 0, "upstream_model": "llama-3-70b-v2", "route": "llama-v2" }
    ])
}

/// The demo policy's shape: tenant header as sticky key, a trusted override property, a client
/// header to strip; v1 takes every keyed request (v2 has weight 0).
fn router_with(versions: serde_json::Value, fallback: serde_json::Value, shadow: Option<serde_json::Value>) -> Router {
    let mut model = json!({ "model": MODEL, "versions": versions, "fallback": fallback });
    if let Some(s) = shadow {
        model["shadow"] = s;
    }
    let policy = json!({
        "sticky_key": [{ "header": "x-sluice-tenant" }],
        "route_header": "x-sluice-route",
        "version_header": "x-model-version",
        "override": { "property": ["trusted", "force"], "client_header": "x-sluice-force-version" },
        "models": [model],
    });
    Router::new(RoutingPolicy::from_json(policy.to_string().as_bytes()).unwrap())
}

fn shadow_policy(max_concurrent: u32, exclude: &[&str]) -> serde_json::Value {
    let mut s = json!({
        "version": { "name": SHADOW, "upstream_model": "qwen-72b", "route": "qwen-v1", "cluster": "qwen_v1", "authority": "qwen.internal" },
        "fraction": 1.0,
        "max_concurrent": max_concurrent,
    });
    if !exclude.is_empty() {
        s["exclude_tenants"] = json!(exclude);
        s["tenant_header"] = json!("x-sluice-tenant");
    }
    s
}

fn plain_router() -> Router {
    router_with(versions2(), json!(["v1", "v2"]), None)
}

fn shadow_router(max_concurrent: u32) -> Router {
    router_with(versions2(), json!(["v1", "v2"]), Some(shadow_policy(max_concurrent, &[])))
}

/// A chat request from `tenant` asking for [`MODEL`], with `extra` headers.
fn request(tenant: &str, request_id: &str, extra: &[(&str, &str)]) -> FixedView {
    let mut headers = vec![
        (":method", "POST"),
        (":path", CHAT),
        (":authority", "llm.internal"),
        ("content-type", "application/json"),
        ("x-request-id", request_id),
        ("x-sluice-tenant", tenant),
    ];
    headers.extend_from_slice(extra);
    FixedView {
        request_headers: headers.into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        properties: vec![(MODEL_METADATA.map(String::from).to_vec(), MODEL.to_string())],
        ..FixedView::default()
    }
}

fn with_property(mut view: FixedView, path: &[&str], value: &str) -> FixedView {
    view.properties.push((path.iter().map(|s| s.to_string()).collect(), value.to_string()));
    view
}

fn chat_body(model: &str) -> Vec<u8> {
    format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}],"stream":false}}"#).into_bytes()
}

fn chat_answer(text: &str, completion: u64, finish: &str) -> Vec<u8> {
    json!({
        "id": "chatcmpl-1", "object": "chat.completion", "model": "m",
        "choices": [{ "index": 0, "message": { "role": "assistant", "content": text }, "finish_reason": finish }],
        "usage": { "prompt_tokens": 5, "completion_tokens": completion, "total_tokens": 5 + completion }
    })
    .to_string()
    .into_bytes()
}

fn remove(name: &str) -> Effect {
    Effect::SetHeader { dir: Dir::Request, name: name.into(), value: None }
}

fn set(name: &str, value: &str) -> Effect {
    Effect::SetHeader { dir: Dir::Request, name: name.into(), value: Some(value.into()) }
}

fn count(name: &str) -> Effect {
    Effect::Count { name: name.into(), delta: 1 }
}

fn record(name: &str, value: u64) -> Effect {
    Effect::Record { name: name.into(), value }
}

fn stamp(reason: &str, version: &str, shadow: Option<&str>) -> Effect {
    let (route, upstream) = match version {
        "v1" => ("llama-v1", "llama-3-70b"),
        "v2" => ("llama-v2", "llama-3-70b-v2"),
        other => panic!("no version {other}"),
    };
    let shadow = shadow.map_or("null".to_string(), |s| format!("\"{s}\""));
    Effect::SetState {
        key: "sluice_route".into(),
        value: format!(r#"{{"model":"{MODEL}","reason":"{reason}","route":"{route}","shadow":{shadow},"upstream_model":"{upstream}","version":"{version}"}}"#)
            .into_bytes(),
    }
}

fn shadow_total(primary: &str, result: &str) -> String {
    format!("sluice.router.shadow_total.primary.{primary}.shadow.{SHADOW}.result.{result}")
}

/// Runs the request headers (at [`T0`]) and returns their effects.
fn headers(flow: &mut RouterFlow, router: &mut Router, view: &mut FixedView, store: &mut MemoryStore, end_of_stream: bool) -> Vec<Effect> {
    let mut fx = Effects::default();
    flow.on_request_headers(router, view, store, end_of_stream, &mut || T0, &mut fx);
    fx.0
}

fn body(flow: &mut RouterFlow, router: &mut Router, view: &mut FixedView, end_of_stream: bool) -> (Verdict, Vec<Effect>) {
    let mut fx = Effects::default();
    let size = view.request_body.len();
    let verdict = flow.on_request_body(router, view, size, end_of_stream, &mut fx);
    (verdict, fx.0)
}

fn log(flow: &mut RouterFlow, router: &mut Router, view: &mut FixedView, store: &mut MemoryStore, now: u64) -> Vec<Effect> {
    let mut fx = Effects::default();
    flow.on_log(router, view, store, &mut || now, &mut fx);
    fx.0
}

#[test]
fn a_decision_strips_what_the_client_sent_sets_route_and_version_counts_and_stamps() {
    let mut router = plain_router();
    let mut flow = RouterFlow::new(3);
    let mut view = request("acme", "rid-1", &[("x-sluice-route", "llama-v2"), ("x-sluice-force-version", "v2"), ("x-sluice-deadline", "1")]);
    let fx = headers(&mut flow, &mut router, &mut view, &mut MemoryStore::default(), true);
    assert_eq!(
        fx,
        [
            remove("x-sluice-route"),
            remove("x-sluice-force-version"),
            remove("x-sluice-deadline"),
            set("x-sluice-route", "llama-v1"),
            set("x-model-version", "v1"),
            count("sluice.router.requests_total.model.llama-3-70b.version.v1.reason.weight"),
            stamp("weight", "v1", None),
        ]
    );
    assert!(flow.is_routed());
    // v1 keeps the requested name and nothing is shadowed: the body is not needed.
    assert!(!flow.wants_request_body() && !flow.wants_response());
    assert_eq!(log(&mut flow, &mut router, &mut view, &mut MemoryStore::default(), T0), []);
}

#[test]
fn the_trusted_override_forces_a_version_whose_body_is_rewritten_and_a_client_header_is_ignored() {
    let mut router = plain_router();
    let mut flow = RouterFlow::new(3);
    let mut view = with_property(request("", "rid-2", &[("x-model-version", "v1")]), &["trusted", "force"], "v2");
    let fx = headers(&mut flow, &mut router, &mut view, &mut MemoryStore::default(), false);
    assert_eq!(
        fx,
        [
            remove("x-model-version"),
            set("x-sluice-route", "llama-v2"),
            set("x-model-version", "v2"),
            count("sluice.router.requests_total.model.llama-3-70b.version.v2.reason.override"),
            // The body's model changes length.
            remove("content-length"),
            stamp("override", "v2", None),
        ]
    );
    view.request_body = chat_body(MODEL);
    assert_eq!(body(&mut flow, &mut router, &mut view, false), (Verdict::Pause, vec![]), "held until whole");
    let (verdict, fx) = body(&mut flow, &mut router, &mut view, true);
    assert_eq!(verdict, Verdict::Continue);
    assert_eq!(fx, [Effect::ReplaceBody { dir: Dir::Request, bytes: chat_body("llama-3-70b-v2") }]);
}

#[test]
fn requests_that_are_not_routed_are_counted_by_why_and_still_stripped() {
    let mut router = plain_router();
    let store = &mut MemoryStore::default();
    let mut no_model = request("acme", "r", &[("x-sluice-route", "x")]);
    no_model.properties.clear();
    let mut flow = RouterFlow::new(1);
    assert_eq!(headers(&mut flow, &mut router, &mut no_model, store, true), [remove("x-sluice-route"), count("sluice.router.unrouted_total.reason.no_model")]);
    assert!(!flow.is_routed());
    let mut unknown = request("acme", "r", &[]);
    unknown.properties[0].1 = "gpt-4o".into();
    assert_eq!(headers(&mut RouterFlow::new(1), &mut router, &mut unknown, store, true), [count("sluice.router.unrouted_total.reason.unknown_model")]);
    let mut not_llm = request("acme", "r", &[("x-sluice-shadow", "1")]);
    not_llm.request_headers[1].1 = "/healthz".into();
    assert_eq!(headers(&mut RouterFlow::new(1), &mut router, &mut not_llm, store, true), [remove("x-sluice-shadow")]);
    // Every version marked unhealthy: nothing to route to.
    for route in ["llama-v1", "llama-v2"] {
        store.set(&unhealthy_key(route), &store::encode_counter(T0 + 1), 0).unwrap();
    }
    let mut down = request("acme", "r", &[]);
    assert_eq!(
        headers(&mut RouterFlow::new(1), &mut router, &mut down, store, true),
        [count("sluice.router.unrouted_total.reason.no_version.model.llama-3-70b")]
    );
}

/// The version and reason a request got, from its effects.
fn decided(fx: &[Effect]) -> (String, String) {
    let version = fx.iter().find_map(|e| match e {
        Effect::SetHeader { name, value: Some(v), .. } if name == "x-model-version" => Some(v.clone()),
        _ => None,
    });
    let reason = fx.iter().find_map(|e| match e {
        Effect::Count { name, .. } => {
            name.strip_prefix("sluice.router.requests_total.model.llama-3-70b.version.")?.split_once(".reason.").map(|(_, r)| r.to_string())
        }
        _ => None,
    });
    (version.unwrap_or_default(), reason.unwrap_or_default())
}

#[test]
fn latency_guards_avoid_list_merges_with_unhealthy_versions_and_its_preferred_fallback() {
    let versions = json!([
        { "name": "v1", "weight": 100, "upstream_model": "llama-3-70b", "route": "llama-v1" },
        { "name": "v2", "weight": 0, "upstream_model": "llama-3-70b-v2", "route": "llama-v2" },
        { "name": "v3", "weight": 0, "upstream_model": "llama-3-70b-v3", "route": "llama-v3" }
    ]);
    let mut router = router_with(versions, json!(["v1", "v2", "v3"]), None);
    let case = |router: &mut Router, avoid: &str, unhealthy: &[&str]| {
        let mut store = MemoryStore::default();
        for route in unhealthy {
            store.set(&unhealthy_key(route), &store::encode_counter(T0 + 1), 0).unwrap();
        }
        let mut view = with_property(request("acme", "rid", &[]), &[AVOID_PROPERTY], avoid);
        let fx = headers(&mut RouterFlow::new(1), router, &mut view, &mut store, true);
        let (version, reason) = decided(&fx);
        (version, reason, fx)
    };
    // The guard's preferred fallback wins over the router's order…
    let (_, _, fx) = case(&mut router, "v1>v3", &[]);
    assert_eq!(
        fx,
        [
            set("x-sluice-route", "llama-v3"),
            set("x-model-version", "v3"),
            count("sluice.router.requests_total.model.llama-3-70b.version.v3.reason.fallback"),
            Effect::SetState {
                key: "sluice_route".into(),
                value: br#"{"model":"llama-3-70b","reason":"fallback","route":"llama-v3","shadow":null,"upstream_model":"llama-3-70b-v3","version":"v3"}"#
                    .to_vec()
            },
        ]
    );
    let expect = |v: &str, r: &str| (v.to_string(), r.to_string());
    let got = |(v, r, _): (String, String, Vec<Effect>)| (v, r);
    // …without one, or when it is unavailable (unhealthy, avoided too, unknown), the router's order.
    assert_eq!(got(case(&mut router, "v1", &[])), expect("v2", "fallback"));
    assert_eq!(got(case(&mut router, "v1>", &[])), expect("v2", "fallback"));
    assert_eq!(got(case(&mut router, "v1>v3", &["llama-v3"])), expect("v2", "fallback"));
    assert_eq!(got(case(&mut router, "v1>v3,v3", &[])), expect("v2", "fallback"));
    assert_eq!(got(case(&mut router, "v1>v9", &[])), expect("v2", "fallback"));
    // Unhealthy and avoided versions add up.
    assert_eq!(got(case(&mut router, "v1", &["llama-v2"])), expect("v3", "fallback"));
    // A list that leaves nothing: decided as if it were empty (unhealthy versions still count).
    assert_eq!(got(case(&mut router, "v1,v2,v3", &[])), expect("v1", "weight"));
    assert_eq!(got(case(&mut router, "v1,v2,v3", &["llama-v1"])), expect("v2", "fallback"));
    // A mark that has expired is no mark.
    let mut store = MemoryStore::default();
    store.set(&unhealthy_key("llama-v1"), &store::encode_counter(T0), 0).unwrap();
    let fx = headers(&mut RouterFlow::new(1), &mut router, &mut request("acme", "rid", &[]), &mut store, true);
    assert_eq!(decided(&fx), expect("v1", "weight"));
}

#[test]
fn no_healthy_upstream_marks_the_route_for_10_s_and_later_requests_fall_back() {
    let mut router = plain_router();
    let mut store = MemoryStore::default();
    let mut flow = RouterFlow::new(1);
    let mut view = with_property(request("acme", "rid", &[]), &["response", "code_details"], "no_healthy_upstream");
    headers(&mut flow, &mut router, &mut view, &mut store, true);
    let fx = log(&mut flow, &mut router, &mut view, &mut store, T0 + 5 * MS);
    assert_eq!(fx, [Effect::Log { level: LogLevel::Info, message: "route llama-v1 has no healthy upstream: version v1 skipped for 10 s".into() }]);
    assert_eq!(store.get(&unhealthy_key("llama-v1")).unwrap().0, Some(store::encode_counter(T0 + 5 * MS + UNHEALTHY_FOR_NS).to_vec()));
    let fx = headers(&mut RouterFlow::new(2), &mut router, &mut request("acme", "rid2", &[]), &mut store, true);
    assert_eq!(decided(&fx), ("v2".to_string(), "fallback".to_string()));
}

#[test]
fn a_sampled_request_is_queued_sent_and_compared_with_its_primary() {
    let mut router = shadow_router(8);
    let mut flow = RouterFlow::new(1);
    let mut view = request("acme", "rid-s", &[]);
    let fx = headers(&mut flow, &mut router, &mut view, &mut MemoryStore::default(), false);
    assert_eq!(fx.last(), Some(&stamp("weight", "v1", Some(SHADOW))));
    assert!(flow.wants_request_body() && flow.wants_response());
    view.request_body = chat_body(MODEL);
    let (verdict, fx) = body(&mut flow, &mut router, &mut view, true);
    assert_eq!((verdict, fx), (Verdict::Continue, vec![count(&shadow_total("v1", "sampled"))]));
    assert_eq!(router.queued(), 1);
    let jobs = router.take_queued();
    assert_eq!(router.queued(), 0);
    let [job] = jobs.as_slice() else { panic!("one job: {jobs:?}") };
    assert_eq!(job.cluster, "qwen_v1");
    let pairs: Vec<(&str, &str)> = job.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    assert_eq!(
        pairs,
        [
            (":method", "POST"),
            (":path", CHAT),
            (":authority", "qwen.internal"),
            ("content-type", "application/json"),
            ("x-sluice-shadow", "1"),
            ("x-request-id", "rid-s")
        ]
    );
    assert_eq!(job.body, chat_body("qwen-72b"));
    let mut fx = Effects::default();
    router.shadow_sent(7, job.clone(), T0 + 20 * MS, &mut fx);
    assert_eq!(fx.0, [count(&shadow_total("v1", "sent"))]);

    // The primary answers as a whole body at +300 ms: waiting for the shadow.
    view.response_headers = vec![(":status".into(), "200".into()), ("content-type".into(), "application/json".into())];
    view.response_body = chat_answer("Hello there", 2, "stop");
    flow.on_response_headers(&mut router, &mut view, &mut fx);
    let mut fx = Effects::default();
    let size = view.response_body.len();
    flow.on_response_body(&mut router, &mut view, size, true, &mut || T0 + 300 * MS, &mut fx);
    assert_eq!(fx.0, []);
    assert!(!flow.wants_response(), "handed over");
    assert_eq!(log(&mut flow, &mut router, &mut view, &mut MemoryStore::default(), T0 + 301 * MS), [], "offered once");

    // The shadow's answer (500 ms after it was sent) completes the pair.
    let mut fx = Effects::default();
    router.on_shadow_answer(7, 200, &chat_answer("Hello there", 3, "length"), T0 + 520 * MS, &mut fx);
    let pair = ".primary.v1.shadow.qwen-72b-v1";
    assert_eq!(
        fx.0,
        [
            record(&format!("sluice.router.compare_duration_ms{pair}.side.primary"), 300),
            record(&format!("sluice.router.compare_output_tokens{pair}.side.primary"), 2),
            record(&format!("sluice.router.compare_duration_ms{pair}.side.shadow"), 500),
            record(&format!("sluice.router.compare_output_tokens{pair}.side.shadow"), 3),
            count(&format!("sluice.router.compare_total{pair}.finish_agree.false")),
            record(&format!("sluice.router.compare_similarity_per_mille{pair}"), 1000),
            Effect::Log {
                level: LogLevel::Info,
                message: r#"shadow comparison {"duration_ms":[300,500],"finish":["stop","length"],"output_tokens":[2,3],"primary":"v1","request_id":"rid-s","shadow":"qwen-72b-v1","similarity_per_mille":1000,"status":[200,200],"ttft_ms":[null,null]}"#.into()
            },
        ]
    );
    // Nothing is left waiting: a second answer for the token is ignored.
    let mut fx = Effects::default();
    router.on_shadow_answer(7, 200, b"{}", T0 + 600 * MS, &mut fx);
    assert_eq!(fx.0, []);
}

#[test]
fn a_shadow_that_cannot_start_completes_its_comparison_as_a_shadow_error_at_the_primarys_end() {
    let mut router = shadow_router(8);
    let mut flow = RouterFlow::new(1);
    let mut view = request("acme", "rid-f", &[]);
    headers(&mut flow, &mut router, &mut view, &mut MemoryStore::default(), false);
    view.request_body = chat_body(MODEL);
    body(&mut flow, &mut router, &mut view, true);
    let mut fx = Effects::default();
    for job in router.take_queued() {
        router.shadow_not_started(job, "InternalFailure", &mut fx);
    }
    assert_eq!(
        fx.0,
        [
            Effect::Log { level: LogLevel::Warn, message: "shadow request to cluster qwen_v1 failed to start: InternalFailure".into() },
            count(&shadow_total("v1", "failed")),
        ]
    );
    // The primary never saw response headers and ends at teardown: status 0, an error too.
    let fx = log(&mut flow, &mut router, &mut view, &mut MemoryStore::default(), T0 + 40 * MS);
    let pair = ".primary.v1.shadow.qwen-72b-v1";
    assert_eq!(
        fx,
        [
            record(&format!("sluice.router.compare_duration_ms{pair}.side.primary"), 40),
            record(&format!("sluice.router.compare_output_tokens{pair}.side.primary"), 0),
            count(&format!("sluice.router.compare_errors_total{pair}.side.primary")),
            record(&format!("sluice.router.compare_duration_ms{pair}.side.shadow"), 0),
            record(&format!("sluice.router.compare_output_tokens{pair}.side.shadow"), 0),
            count(&format!("sluice.router.compare_errors_total{pair}.side.shadow")),
            count(&format!("sluice.router.compare_total{pair}.finish_agree.true")),
            // Two empty texts are the same text.
            record(&format!("sluice.router.compare_similarity_per_mille{pair}"), 1000),
            Effect::Log {
                level: LogLevel::Info,
                message: r#"shadow comparison {"duration_ms":[40,0],"finish":[null,null],"output_tokens":[0,0],"primary":"v1","request_id":"rid-f","shadow":"qwen-72b-v1","similarity_per_mille":1000,"status":[0,0],"ttft_ms":[null,null]}"#.into()
            },
        ]
    );
}

#[test]
fn a_request_refused_behind_the_router_drops_its_queued_shadow_and_restamps() {
    let mut router = shadow_router(8);
    let mut refused = RouterFlow::new(1);
    let mut view = request("acme", "rid-r", &[]);
    headers(&mut refused, &mut router, &mut view, &mut MemoryStore::default(), false);
    view.request_body = chat_body(MODEL);
    body(&mut refused, &mut router, &mut view, true);
    // Another request's shadow stays queued.
    let mut other = RouterFlow::new(2);
    let mut other_view = request("acme", "rid-o", &[]);
    other_view.request_body = chat_body(MODEL);
    headers(&mut other, &mut router, &mut other_view, &mut MemoryStore::default(), false);
    body(&mut other, &mut router, &mut other_view, true);
    assert_eq!(router.queued(), 2);

    view.gateway_reply = Some(GatewayReply { status: 429, end: GatewayEnd::Refused });
    let fx = log(&mut refused, &mut router, &mut view, &mut MemoryStore::default(), T0 + MS);
    assert_eq!(fx, [count(&shadow_total("v1", "refused")), stamp("weight", "v1", None)]);
    let left = router.take_queued();
    assert_eq!(left.iter().map(|j| j.headers.last().map(|h| h.1.as_str())).collect::<Vec<_>>(), [Some("rid-o")]);

    // A deadline is not a refusal, and a shadow already sent runs on: nothing is dropped.
    let mut fx = Effects::default();
    router.shadow_sent(1, left.into_iter().next().unwrap(), T0, &mut fx);
    other_view.gateway_reply = Some(GatewayReply { status: 429, end: GatewayEnd::Refused });
    let fx = log(&mut other, &mut router, &mut other_view, &mut MemoryStore::default(), T0 + MS);
    assert!(!fx.contains(&count(&shadow_total("v1", "refused"))), "{fx:?}");
    assert!(!fx.iter().any(|e| matches!(e, Effect::SetState { .. })), "{fx:?}");
}

#[test]
fn the_cap_counts_queued_and_in_flight_shadows_and_a_body_that_is_not_json_is_not_shadowed() {
    let mut router = shadow_router(1);
    let mut first = RouterFlow::new(1);
    let mut view = request("acme", "rid-1", &[]);
    view.request_body = chat_body(MODEL);
    headers(&mut first, &mut router, &mut view, &mut MemoryStore::default(), false);
    body(&mut first, &mut router, &mut view, true);
    let mut second = RouterFlow::new(2);
    headers(&mut second, &mut router, &mut view, &mut MemoryStore::default(), false);
    let (_, fx) = body(&mut second, &mut router, &mut view, true);
    assert_eq!(fx, [count(&shadow_total("v1", "sampled")), count(&shadow_total("v1", "skipped_cap")), stamp("weight", "v1", None)]);
    assert!(!second.wants_response());
    // Sent, it still counts.
    let mut fx = Effects::default();
    let job = router.take_queued().into_iter().next().unwrap();
    router.shadow_sent(1, job, T0, &mut fx);
    let mut third = RouterFlow::new(3);
    headers(&mut third, &mut router, &mut view, &mut MemoryStore::default(), false);
    let (_, fx) = body(&mut third, &mut router, &mut view, true);
    assert_eq!(fx[1], count(&shadow_total("v1", "skipped_cap")));

    let mut router = shadow_router(8);
    let mut flow = RouterFlow::new(1);
    let mut view = with_property(request("acme", "rid-nj", &[]), &["trusted", "force"], "v2");
    headers(&mut flow, &mut router, &mut view, &mut MemoryStore::default(), false);
    view.request_body = b"not json {".to_vec();
    let (_, fx) = body(&mut flow, &mut router, &mut view, true);
    assert_eq!(
        fx,
        [
            Effect::Log {
                level: LogLevel::Warn,
                message: "model not rewritten (request body is not valid JSON: expected ident at line 1 column 2); the request goes to llama-v2 as sent".into()
            },
            count(&shadow_total("v2", "sampled")),
            count(&shadow_total("v2", "failed")),
            stamp("override", "v2", None),
        ]
    );
    assert_eq!(router.queued(), 0);
}

#[test]
fn an_excluded_tenant_is_counted_under_the_shadow_versions_label_and_not_shadowed() {
    let mut router = router_with(versions2(), json!(["v1", "v2"]), Some(shadow_policy(8, &["bank-*"])));
    let mut flow = RouterFlow::new(1);
    let fx = headers(&mut flow, &mut router, &mut request("bank-x", "rid-x", &[]), &mut MemoryStore::default(), false);
    assert_eq!(
        fx,
        [
            set("x-sluice-route", "llama-v1"),
            set("x-model-version", "v1"),
            count("sluice.router.requests_total.model.llama-3-70b.version.v1.reason.weight"),
            count(&shadow_total("v1", "excluded")),
            stamp("weight", "v1", None),
        ]
    );
    assert!(!flow.wants_request_body(), "nothing to rewrite or copy");
}

#[test]
fn json_strings_are_escaped_as_serde_json_escapes_them() {
    let mut every: String = (0u8..0x80).map(char::from).collect();
    every.push_str("é\u{2028}\u{feff}😀");
    for s in [every.as_str(), "", "plain", "a\"b\\c/d"] {
        let mut ours = String::new();
        push_json_str(&mut ours, s);
        assert_eq!(ours, serde_json::to_string(s).unwrap(), "{s:?}");
    }
}

#[test]
fn the_stamp_of_a_model_name_with_quotes_and_control_characters_is_the_bytes_it_always_was() {
    let mut router = Router::new(
        RoutingPolicy::from_json(
            json!({
                "sticky_key": [{ "header": "x-sluice-tenant" }],
                "route_header": "x-sluice-route",
                "version_header": "x-model-version",
                "models": [{ "model": "llama-*", "versions": versions2() }],
            })
            .to_string()
            .as_bytes(),
        )
        .unwrap(),
    );
    let mut view = request("acme", "rid-w", &[]);
    view.properties[0].1 = "llama-\"\u{1}\u{7f}é\u{2028}/\\\n\r\t\u{8}\u{c}".into();
    let fx = headers(&mut RouterFlow::new(1), &mut router, &mut view, &mut MemoryStore::default(), true);
    // As the serde_json map wrote it (captured from the adapter before the move).
    let expected = "{\"model\":\"llama-\\\"\\u0001\u{7f}é\u{2028}/\\\\\\n\\r\\t\\b\\f\",\"reason\":\"weight\",\"route\":\"llama-v1\",\"shadow\":null,\"upstream_model\":\"llama-3-70b\",\"version\":\"v1\"}";
    assert_eq!(fx.last(), Some(&Effect::SetState { key: "sluice_route".into(), value: expected.as_bytes().to_vec() }));
}

#[test]
fn a_request_without_an_id_gets_one_from_the_time_and_the_stream() {
    let mut router = shadow_router(8);
    let mut flow = RouterFlow::new(42);
    let mut view = request("acme", "", &[]);
    view.request_body = chat_body(MODEL);
    headers(&mut flow, &mut router, &mut view, &mut MemoryStore::default(), false);
    body(&mut flow, &mut router, &mut view, true);
    let jobs = router.take_queued();
    assert_eq!(jobs[0].headers.last(), Some(&("x-request-id".to_string(), format!("sluice-{T0}-42"))));
}
