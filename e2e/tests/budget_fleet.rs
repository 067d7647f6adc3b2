//! Scratch: buffer-filter measurement (to be folded into the fleet tests).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use sluice_e2e::gateway::{demo_plugin_config, shipped, start_budget_gateway, start_full_gateway, yaml_string_body};
use sluice_e2e::ledger::LedgerService;
use sluice_e2e::redis::{Persistence, Redis};
use sluice_e2e::{Connection, Envoy, MockServer, Tools};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const CHAT: &str = "/v1/chat/completions";

fn metrics_config() -> String {
    let mut v: Value = serde_json::from_str(&demo_plugin_config().unwrap()).unwrap();
    v["stream_summary_comment"] = json!(false);
    v.to_string()
}

fn fleet_template(buffer: bool) -> String {
    let t = std::fs::read_to_string(shipped("envoy/fleet-gateway.yaml")).unwrap();
    if buffer {
        return t;
    }
    let start = t.find("          # Holds the request (headers and body)").unwrap();
    let end = t[start..].find("max_request_bytes: 9437184\n").unwrap() + start + "max_request_bytes: 9437184\n".len();
    let out = format!("{}{}", &t[..start], &t[end..]);
    assert!(!out.contains("envoy.filters.http.buffer"));
    out
}

fn start_fleet_envoy(template: &str, mock: &MockServer, ledger_port: u16, policy: &str) -> Envoy {
    let upstream = mock.port().to_string();
    let ledger = ledger_port.to_string();
    let budget = yaml_string_body(policy);
    let metrics = yaml_string_body(&metrics_config());
    Envoy::start(
        template,
        &[
            ("UPSTREAM_PORT", upstream.as_str()),
            ("LEDGER_PORT", ledger.as_str()),
            ("BUDGET_CONFIG", budget.as_str()),
            ("PLUGIN_CONFIG", metrics.as_str()),
        ],
    )
    .unwrap()
}

fn chat_body(max_tokens: u64) -> String {
    json!({"model": "llama-3-70b", "stream": true, "max_tokens": max_tokens,
           "messages": [{"role": "user", "content": "Hello"}]})
    .to_string()
}

fn send(addr: SocketAddr, id: &str, headers: &[(&str, &str)], body: &str, pause: Duration) -> (u16, String) {
    let mut h = vec![("x-request-id", id)];
    h.extend_from_slice(headers);
    let s = Connection::connect(addr).unwrap().send_with_pause("POST", CHAT, &h, body.as_bytes(), pause).unwrap();
    let r = s.collect().unwrap();
    (r.status, r.text())
}

/// Connections accepted and heads of `id`, after the refused request (settled a moment).
fn seen(mocks: &[&MockServer], before: &[u64], id: &str) -> (u64, Vec<String>) {
    std::thread::sleep(Duration::from_millis(300));
    let mut conns = 0;
    let mut heads = Vec::new();
    for (m, b) in mocks.iter().zip(before) {
        // The read-back itself is one connection.
        conns += m.connections_accepted().unwrap() - b - 1;
        for h in m.heads().unwrap() {
            if h.request_id.as_deref() == Some(id) {
                heads.push(h.body.clone());
            }
        }
    }
    (conns, heads)
}

fn policy(ledger: bool) -> String {
    let mut p = json!({
        "mode": "strict",
        "identity": {"header": "x-sluice-key"},
        "include_usage": true,
        "default_max_output_tokens": 64,
        "orgs": [{"id": "o", "teams": [{"id": "t", "keys": [
            {"id": "open", "budgets": [{"window": "minute", "tokens": 1000000}]},
            {"id": "tight", "budgets": [{"window": "minute", "tokens": 100}]}]}]}]
    });
    if ledger {
        p["ledger"] = json!({"mode": "redis", "cluster": "sluice_ledger", "timeout_ms": 250, "on_failure": "deny"});
    }
    p.to_string()
}

#[test]
fn measure_buffer() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let redis = Redis::start(Persistence::None).unwrap();
    let ledger = LedgerService::start(&redis.url(), 1).unwrap();
    let mut rows = Vec::new();
    for (name, buffer) in [("fleet (buffer)", true), ("fleet (no buffer)", false)] {
        let mock = MockServer::start(&["--tokens", "4"]).unwrap();
        let t0 = Instant::now();
        let envoy = start_fleet_envoy(&fleet_template(buffer), &mock, ledger.port(), &policy(true));
        let started = t0.elapsed();
        for (case, warm, pause) in [("cold", false, 0), ("warm", true, 0), ("split", true, 200)] {
            if warm {
                let (st, _) = send(envoy.listen_addr(), &format!("{name}-{case}-ok"), &[("x-sluice-key", "open")], &chat_body(8), Duration::ZERO);
                assert_eq!(st, 200);
            }
            let before = [mock.connections_accepted().unwrap()];
            let id = format!("{name}-{case}-refused");
            let (st, body) = send(envoy.listen_addr(), &id, &[("x-sluice-key", "tight")], &chat_body(2000), Duration::from_millis(pause));
            let (c, h) = seen(&[&mock], &before, &id);
            rows.push(format!("{name:<20} {case:<6} status {st} conns {c} heads {h:?} (envoy start {started:?}) {}", &body[..body.len().min(80)]));
        }
    }
    for (name, case_gw) in [("budget-gateway", 0), ("full-gateway", 1)] {
        let mut _keep: Vec<MockServer> = Vec::new();
        let (envoy, mocks): (Envoy, Vec<MockServer>) = if case_gw == 0 {
            let mock = MockServer::start(&["--tokens", "4"]).unwrap();
            let e = start_budget_gateway(&mock, &policy(false), &metrics_config()).unwrap();
            (e, vec![mock])
        } else {
            let gw = start_full_gateway(&["--tokens", "4"], &[]).unwrap();
            (gw.envoy, vec![gw.v1, gw.v2, gw.shadow])
        };
        let refs: Vec<&MockServer> = mocks.iter().collect();
        let (okh, badh, bad_body): (Vec<(&str, &str)>, Vec<(&str, &str)>, String) = if case_gw == 0 {
            (vec![("x-sluice-key", "open")], vec![("x-sluice-key", "tight")], chat_body(2000))
        } else {
            (vec![("x-sluice-tenant", "acme")], vec![("x-sluice-tenant", "globex")],
             json!({"model": "llama-3-70b", "stream": true, "messages": [{"role": "user", "content": "budget ".repeat(120_000 / 7)}]}).to_string())
        };
        for (case, warm, pause) in [("cold", false, 0), ("warm", true, 0), ("split", true, 200)] {
            if warm {
                let (st, _) = send(envoy.listen_addr(), &format!("{name}-{case}-ok"), &okh, &chat_body(8), Duration::ZERO);
                assert_eq!(st, 200);
            }
            let before: Vec<u64> = refs.iter().map(|m| m.connections_accepted().unwrap()).collect();
            let id = format!("{name}-{case}-refused");
            let (st, body) = send(envoy.listen_addr(), &id, &badh, &bad_body, Duration::from_millis(pause));
            let (c, h) = seen(&refs, &before, &id);
            rows.push(format!("{name:<20} {case:<6} status {st} conns {c} heads {h:?} {}", &body[..body.len().min(80)]));
        }
    }
    for r in rows {
        println!("{r}");
    }
}
