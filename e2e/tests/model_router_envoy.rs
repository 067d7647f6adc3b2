//! model-router in real Envoy (`envoy/templates/router-gateway.yaml`): two mock upstream clusters answering as
//! different versions plus a shadow cluster; the split, stickiness, routing to the right cluster,
//! the body's `model` rewritten, clients unable to pick their version, and a shadow run whose
//! comparison metrics appear in `/stats/prometheus` while the client receives exactly the primary's
//! stream.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use sluice_e2e::gateway::{demo_plugin_config, shipped, yaml_string_body};
use sluice_e2e::{post_json, wait_until, Envoy, MockServer, Tools};
use std::collections::BTreeMap;
use std::time::Duration;

const CHAT: &str = "/v1/chat/completions";

struct Upstreams {
    v1: MockServer,
    v2: MockServer,
    shadow: MockServer,
}

fn upstreams() -> Upstreams {
    let start = |name: &str| MockServer::start(&["--served-by", name, "--tokens", "6"]).unwrap();
    Upstreams { v1: start("llama-v1"), v2: start("llama-v2"), shadow: start("qwen-v1") }
}

fn router_policy(v2_weight: u64, shadow_fraction: f64) -> String {
    json!({
        "sticky_key": [{"header": "x-sluice-tenant"}],
        "override": {"property": ["metadata", "filter_metadata", "sluice_trusted", "force_version"], "client_header": "x-sluice-force-version"},
        "models": [{
            "model": "llama-3-70b",
            "versions": [
                {"name": "v1", "weight": 100 - v2_weight, "upstream_model": "llama-3-70b", "route": "llama-v1"},
                {"name": "v2", "weight": v2_weight, "upstream_model": "llama-3-70b-v2", "route": "llama-v2"}
            ],
            "shadow": {
                "version": {"name": "qwen-v1", "upstream_model": "qwen-72b", "route": "qwen-v1", "cluster": "qwen_v1", "authority": "qwen.internal"},
                "fraction": shadow_fraction, "max_concurrent": 64, "exclude_tenants": ["bank-*"], "tenant_header": "x-sluice-tenant"
            }
        }]
    })
    .to_string()
}

fn start(up: &Upstreams, policy: &str) -> Envoy {
    let mut metrics: Value = serde_json::from_str(&demo_plugin_config().unwrap()).unwrap();
    metrics["stream_summary_comment"] = json!(false);
    let (p1, p2, p3) = (up.v1.port().to_string(), up.v2.port().to_string(), up.shadow.port().to_string());
    let (router, metrics) = (yaml_string_body(policy), yaml_string_body(&metrics.to_string()));
    Envoy::start(
        &shipped("envoy/templates/router-gateway.yaml"),
        &[
            ("UPSTREAM_PORT", p1.as_str()),
            ("UPSTREAM_PORT_V2", p2.as_str()),
            ("SHADOW_PORT", p3.as_str()),
            ("ROUTER_CONFIG", router.as_str()),
            ("PLUGIN_CONFIG", metrics.as_str()),
        ],
    )
    .unwrap()
}

fn body(stream: bool) -> String {
    json!({"model": "llama-3-70b", "stream": stream, "messages": [{"role": "user", "content": "Which version are you?"}]}).to_string()
}

fn ask(envoy: &Envoy, tenant: &str, extra: &[(&str, &str)], stream: bool) -> (String, Value) {
    let mut headers = vec![("content-type", "application/json"), ("x-sluice-tenant", tenant)];
    headers.extend_from_slice(extra);
    let r = post_json(envoy.listen_addr(), CHAT, &headers, &body(stream)).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let served_by = r.header("x-mock-served-by").unwrap_or_default().to_string();
    let model = if stream {
        // The model of the first event.
        let text = r.text();
        let first = text.lines().find_map(|l| l.strip_prefix("data: ")).unwrap_or("{}");
        serde_json::from_str::<Value>(first).unwrap_or(Value::Null)["model"].clone()
    } else {
        r.json().unwrap()["model"].clone()
    };
    (served_by, model)
}

#[test]
fn split_is_sticky_routed_to_the_right_cluster_and_model_rewritten() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let up = upstreams();
    let envoy = start(&up, &router_policy(30, 0.0));
    let tenants: Vec<String> = (0..200).map(|i| format!("tenant-{i}")).collect();
    let mut assigned = BTreeMap::new();
    for tenant in &tenants {
        let (served_by, model) = ask(&envoy, tenant, &[], false);
        // The cluster that answered is the version's, and it was asked for its upstream model.
        match served_by.as_str() {
            "llama-v1" => assert_eq!(model, "llama-3-70b"),
            "llama-v2" => assert_eq!(model, "llama-3-70b-v2"),
            other => panic!("answered by {other:?}"),
        }
        assigned.insert(tenant.clone(), served_by);
    }
    let v2 = assigned.values().filter(|s| *s == "llama-v2").count();
    // 30 % of 200 keys; binomial σ ≈ 6.5, so ±20 is > 3σ.
    assert!((40..=80).contains(&v2), "v2 got {v2} of 200 tenants at weight 30");
    // Sticky: the same tenants again, streaming this time, land on the same version.
    for tenant in tenants.iter().take(50) {
        let (served_by, _) = ask(&envoy, tenant, &[], true);
        assert_eq!(&served_by, &assigned[tenant], "{tenant} moved");
    }
    // A client cannot choose: its route and override headers are removed before routing.
    for tenant in tenants.iter().filter(|t| assigned[*t] == "llama-v1").take(10) {
        let (served_by, _) = ask(&envoy, tenant, &[("x-sluice-route", "llama-v2"), ("x-sluice-force-version", "v2"), ("x-model-version", "v2")], false);
        assert_eq!(served_by, "llama-v1", "{tenant}: a client header changed the route");
    }
    // Decisions are counted per version and reason.
    let m = envoy.metrics().unwrap();
    let count = |v: &str| m.value("sluice_router_requests_total", &[("model", "llama-3-70b"), ("version", v), ("reason", "weight")]).unwrap_or(0.0);
    assert_eq!(count("v1") + count("v2"), 260.0);
    assert_eq!(count("v2"), (v2 + tenants.iter().take(50).filter(|t| assigned[*t] == "llama-v2").count()) as f64);
    // llm-metrics labels by the version the router chose.
    let lines = envoy.access_log().wait_for(260, Duration::from_secs(10)).unwrap();
    for line in &lines {
        let route: Value = serde_json::from_str(line["route"].as_str().unwrap()).unwrap();
        let llm: Value = serde_json::from_str(line["sluice"].as_str().unwrap()).unwrap();
        assert_eq!(llm["model_version"], route["version"], "{line}");
    }
}

#[test]
fn shadow_answers_are_compared_and_never_reach_the_client() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let up = upstreams();
    let envoy = start(&up, &router_policy(0, 1.0));
    let direct = {
        let r = post_json(up.v1.addr(), CHAT, &[("content-type", "application/json")], &body(true)).unwrap();
        normalize(&r.text())
    };
    for i in 0..10 {
        let tenant = format!("tenant-{i}");
        let r = post_json(envoy.listen_addr(), CHAT, &[("content-type", "application/json"), ("x-sluice-tenant", &tenant)], &body(true)).unwrap();
        assert_eq!(r.header("x-mock-served-by"), Some("llama-v1"));
        assert_eq!(normalize(&r.text()), direct, "the client's stream changed");
    }
    // An excluded tenant is never shadowed.
    for i in 0..5 {
        ask(&envoy, &format!("bank-{i}"), &[], true);
    }
    let labels = [("primary", "v1"), ("shadow", "qwen-v1")];
    // Counters are immediate; histograms appear at Envoy's next stats flush.
    let compared = wait_until(Duration::from_secs(15), "10 shadow comparisons", || {
        let m = envoy.metrics()?;
        let n = m.value("sluice_router_compare_total", &labels).unwrap_or(0.0);
        let h = m.histogram("sluice_router_compare_similarity_per_mille", &labels).map_or(0, |h| h.count);
        Ok((n >= 10.0 && h >= 10).then_some(m))
    })
    .unwrap();
    assert_eq!(compared.value("sluice_router_compare_total", &[("primary", "v1"), ("finish_agree", "true")]), Some(10.0));
    assert_eq!(compared.value("sluice_router_shadow_total", &[("result", "sent")]), Some(10.0));
    assert_eq!(compared.value("sluice_router_shadow_total", &[("result", "excluded")]), Some(5.0));
    let similarity = compared.histogram("sluice_router_compare_similarity_per_mille", &labels).unwrap();
    // Both mocks answer "tok0 … tok5": identical texts.
    assert_eq!(similarity.count, 10);
    assert_eq!(similarity.cumulative(990.0), Some(0), "{similarity:?}");
    let tokens = compared.histogram("sluice_router_compare_output_tokens", &[("side", "shadow")]).unwrap();
    assert_eq!(tokens.count, 10);
    // The shadow cluster was asked for its own model, marked as shadow traffic, never for bank-*.
    let shadowed = up.shadow.requests().unwrap();
    assert_eq!(shadowed.len(), 10);
    assert!(shadowed.iter().all(|r| r.model.as_deref() == Some("qwen-72b")), "{shadowed:?}");
}

/// Blanks ids and timestamps so two answers of the same mock compare equal.
fn normalize(sse: &str) -> String {
    sse.lines()
        .map(|line| match line.strip_prefix("data: ").and_then(|d| serde_json::from_str::<Value>(d).ok()) {
            Some(mut v) => {
                for key in ["id", "created"] {
                    if v.get(key).is_some() {
                        v[key] = "X".into();
                    }
                }
                format!("data: {v}")
            }
            None => line.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn a_request_body_over_a_mebibyte_is_routed_by_its_model() {
    // json_to_metadata holds the headers while it reads the body, under the stream's buffer limit
    // (the listener's 1 MiB by default, past which Envoy itself answers 413); the gateway's buffer
    // filter in front of it raises that limit to 9 MiB, as tenant-budget's gateways allow.
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let up = upstreams();
    // Every key on v2: a request reaches llama-v2, asked for llama-3-70b-v2, only if its body's
    // model was read and routed (the default route is v1's cluster).
    let envoy = start(&up, &router_policy(100, 0.0));
    for size in [2_000_000usize, 5_000_000] {
        let body = json!({"model": "llama-3-70b", "stream": false, "messages": [{"role": "user", "content": "a ".repeat(size / 2)}]}).to_string();
        let r = post_json(envoy.listen_addr(), CHAT, &[("content-type", "application/json"), ("x-sluice-tenant", "tenant-1")], &body).unwrap();
        assert_eq!(r.status, 200, "{size} bytes: {}", r.text());
        assert_eq!(r.header("x-mock-served-by"), Some("llama-v2"), "{size} bytes");
        assert_eq!(r.json().unwrap()["model"], "llama-3-70b-v2", "{size} bytes");
    }
}
