//! Envoy's own life cycle with sluice in it, in real Envoy 1.40 (docs/lifecycle.md):
//!
//! - a new policy pushed while streams are in flight, through LDS (the full gateway's listener from a
//!   watched file) and through ECDS (tenant-budget's filter configuration from a watched file): the
//!   streams in flight finish on the policy they started with and are charged exactly; counters,
//!   budgets (shared data is per `vm_id`, which the update keeps), leases, in-flight counts and an open
//!   breaker carry over; new requests get the new policy; a broken policy is refused with the
//!   plugin's message and the previous one keeps serving; a budget whose measure the update changes
//!   starts from zero, the unchanged ones keep their counts;
//! - a VM failure — a test filter (`e2e/trap-filter`) trapping in the chain behind the plugins, and
//!   once in front of them — under each `failure_policy`: what the trapping request and the next ones
//!   get, what the plugins count, and `FAIL_RELOAD` serving again with a new VM;
//! - hot restart (`--restart-epoch`, one `--base-id` per test) with streams in flight: the parent
//!   finishes them; a local ledger starts again from zero in the new process, the fleet ledger
//!   (Redis through `sluice-ledger`) carries the budget over.
//!
//! Skipped when Envoy is not installed (unless `SLUICE_ENVOY`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use serde_yaml::Value as Yaml;
use sluice_e2e::access_log::stamp;
use sluice_e2e::gateway::{demo_plugin_config, full_gateway_policy, yaml_string_body};
use sluice_e2e::http::StreamedResponse;
use sluice_e2e::ledger::LedgerService;
use sluice_e2e::lifecycle::*;
use sluice_e2e::redis::{redis_server_bin, Persistence, Redis};
use sluice_e2e::{http, post_json, post_stream, wait_until, AccessLog, Checks, MockServer, Tools};
use std::net::SocketAddr;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const CHAT: &str = "/v1/chat/completions";
/// Slow streams: 6 content tokens 400 ms apart, about 2.4 s each.
const SLOW: [(&str, &str); 1] = [("x-mock-itl-ms", "400")];

fn chat(content: &str) -> String {
    json!({
        "model": "llama-3-70b",
        "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": content}],
    })
    .to_string()
}

/// Sends a streaming chat request and reads it to its end.
fn stream(addr: SocketAddr, headers: &[(&str, &str)]) -> StreamedResponse {
    post_stream(addr, CHAT, headers, &chat("Hello across a change")).unwrap().collect().unwrap()
}

/// [`stream`] on a thread: the request is in flight when this returns (or soon after).
fn stream_in_background(addr: SocketAddr, headers: &[(&str, &str)]) -> JoinHandle<StreamedResponse> {
    let headers: Vec<(String, String)> = headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
    std::thread::spawn(move || {
        let h: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        stream(addr, &h)
    })
}

/// Waits until `mock` has read the head of every request in `ids`: they are past admission.
fn wait_heads(mock: &MockServer, ids: &[&str]) {
    wait_until(Duration::from_secs(10), "the streams to reach the upstream", || {
        let heads = mock.heads()?;
        Ok(ids.iter().all(|id| heads.iter().any(|h| h.request_id.as_deref() == Some(*id))).then_some(()))
    })
    .unwrap();
}

/// The access-log line of request `id` and its stamp `field` (`budget`, `sluice`, `latency`, `route`).
fn stamp_of(log: &AccessLog, id: &str, field: &str) -> Value {
    let line = log.wait_for_request(id, Duration::from_secs(10)).unwrap();
    stamp(&line, field).unwrap().unwrap_or(Value::Null)
}

fn mock_record(mock: &MockServer, id: &str) -> Option<sluice_e2e::MockRequest> {
    mock.requests().unwrap().into_iter().find(|r| r.request_id == id)
}

/// Checks that a stream ran to its end and that tenant-budget charged exactly what the upstream
/// reported; returns the charged tokens.
fn check_charged(c: &mut Checks, what: &str, resp: &StreamedResponse, budget: &Value, mock: &MockServer, id: &str) -> u64 {
    c.that(
        resp.status == 200 && resp.complete && resp.text().contains("data: [DONE]"),
        format!("{what}: status {} complete {}: {}", resp.status, resp.complete, resp.text()),
    );
    c.eq(&format!("{what} budget.outcome"), &budget["outcome"], json!("completed"));
    match mock_record(mock, id) {
        Some(r) => {
            c.eq(&format!("{what} budget.input_tokens = upstream's"), &budget["input_tokens"], json!(r.prompt_tokens));
            c.eq(&format!("{what} budget.output_tokens = upstream's"), &budget["output_tokens"], json!(r.completion_tokens));
            c.eq(&format!("{what} budget.charged_tokens"), &budget["charged_tokens"], json!(r.prompt_tokens + r.completion_tokens));
        }
        None => c.that(false, format!("{what}: the upstream has no record of {id}")),
    }
    budget["charged_tokens"].as_u64().unwrap_or(0)
}

fn edit(json_text: &str, f: impl FnOnce(&mut Value)) -> String {
    let mut v: Value = serde_json::from_str(json_text).unwrap();
    f(&mut v);
    v.to_string()
}

fn metric(m: &sluice_e2e::prometheus::Metrics, name: &str, labels: &[(&str, &str)]) -> f64 {
    m.value(name, labels).unwrap_or(0.0)
}

/// VMs Envoy created so far and has now (`wasm.envoy.wasm.runtime.v8.{created,active}`).
fn vms(envoy: &EnvoyProcess) -> (u64, u64) {
    (envoy.stat("wasm.envoy.wasm.runtime.v8.created").unwrap().unwrap_or(0), envoy.stat("wasm.envoy.wasm.runtime.v8.active").unwrap().unwrap_or(0))
}

// ---------------------------------------------------------------------------------------------
// Policy updates through LDS and ECDS.

/// tenant-budget's policy of the full gateway with key globex's budgets replaced: `requests` a
/// month and `tokens` a month (month windows, so no window boundary falls inside the test).
fn full_budget(requests: u64, tokens: u64) -> String {
    edit(&full_gateway_policy("BUDGET_CONFIG").unwrap(), |v| {
        let globex = &mut v["orgs"][1]["teams"][0]["keys"][0];
        assert_eq!(globex["id"], "globex");
        globex["budgets"] = json!([{ "window": "month", "requests": requests }, { "window": "month", "tokens": tokens }]);
    })
}

/// The demo guard with a breaker on v1 that opens after 4 slow first tokens and stays open for a
/// minute, and `v2_deadline_ms` as v2's TTFT deadline.
fn guard_policy(v2_deadline_ms: u64) -> String {
    edit(&full_gateway_policy("LATENCY_CONFIG").unwrap(), |v| {
        let v1 = &mut v["versions"][0];
        assert_eq!(v1["name"], "v1");
        v1["breaker"]["min_samples"] = json!(4);
        v1["breaker"]["open_for_ms"] = json!(60_000);
        v["versions"][1]["ttft_deadline_ms"] = json!(v2_deadline_ms);
    })
}

/// llm-metrics' demo configuration with llama-3-70b's prices multiplied by `factor`.
fn metrics_policy(factor: f64) -> String {
    edit(&demo_plugin_config().unwrap(), |v| {
        let p = &mut v["prices"][0];
        assert_eq!(p["model"], "llama-3-70b*");
        p["input_usd_per_mtok"] = json!(0.59 * factor);
        p["output_usd_per_mtok"] = json!(0.79 * factor);
    })
}

/// The full gateway's listener with these four policies (the router's is the deterministic one of
/// the latency tests: all of llama-3-70b on v1, v2 as its fallback).
fn full_listener(base: &Yaml, latency: &str, budget: &str, metrics: &str) -> Yaml {
    let mut listener = base.clone();
    let filters = http_filters(&mut listener).unwrap();
    set_plugin_config(filters, "sluice_latency_guard", latency).unwrap();
    set_plugin_config(filters, "sluice_tenant_budget", budget).unwrap();
    set_plugin_config(filters, "sluice_llm_metrics", metrics).unwrap();
    listener
}

#[test]
fn a_policy_pushed_by_lds_leaves_streams_in_flight_on_theirs_and_keeps_counters_budgets_and_breakers() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let scratch = Scratch::new("lds").unwrap();
    let site = Site::new(&scratch).unwrap();
    let mock = |name: &str| MockServer::start(&["--served-by", name, "--tokens", "6", "--ttft-ms", "40"]).unwrap();
    let (v1, v2, shadow) = (mock("llama-v1"), mock("llama-v2"), mock("qwen-v1"));
    let ports = [v1.port().to_string(), v2.port().to_string(), shadow.port().to_string()];
    let router = std::fs::read_to_string(sluice_e2e::gateway::shipped("policies/model-router.latency-e2e.json")).unwrap();
    let (lat, rt, bud, met) = ("{{LATENCY_CONFIG}}", yaml_string_body(&router), "{{BUDGET_CONFIG}}", "{{PLUGIN_CONFIG}}");
    // Placeholders for the three policies the test sets per version: rendered as themselves, then
    // replaced in the YAML document.
    let mut bootstrap = render_shipped(
        "envoy/templates/full-gateway.yaml",
        &site,
        &[
            ("UPSTREAM_PORT", &ports[0]),
            ("UPSTREAM_PORT_V2", &ports[1]),
            ("SHADOW_PORT", &ports[2]),
            ("LATENCY_CONFIG", lat),
            ("ROUTER_CONFIG", &rt),
            ("BUDGET_CONFIG", bud),
            ("PLUGIN_CONFIG", met),
        ],
    )
    .unwrap();
    let mut lds = XdsFile::new(scratch.path(), "lds").unwrap();
    let base = listeners_to_lds(&mut bootstrap, &lds).unwrap().remove(0);
    set_node(&mut bootstrap, "lds");
    // The old TTFT deadline far above the waiting stream's 3 s, the new one well below it.
    let old = (guard_policy(5000), full_budget(8, 1_000_000), metrics_policy(1.0));
    let new = (guard_policy(700), full_budget(6, 900_000), metrics_policy(1000.0));
    lds.publish_listeners(vec![full_listener(&base, &old.0, &old.1, &old.2)]).unwrap();
    let envoy = EnvoyProcess::start(&scratch, "envoy", &bootstrap, &site, &Launch::plain(2)).unwrap();
    let addr = envoy.listen_addr();
    let log = envoy.access_log();
    let mut c = Checks::default();
    let mut sent = 0u32;

    // The breaker on v1 opens: four first tokens at 600 ms against an objective of 400 ms.
    http::post_json(v1.addr(), "/mock/ttft", &[], r#"{"ms": 600}"#).unwrap();
    let slow: Vec<_> = (0..4).map(|i| stream_in_background(addr, &[("x-sluice-tenant", "acme"), ("x-request-id", &format!("lds-open-{i}"))])).collect();
    for s in slow {
        assert_eq!(s.join().unwrap().status, 200);
        sent += 1;
    }
    http::post_json(v1.addr(), "/mock/ttft", &[], r#"{"ms": 40}"#).unwrap();
    wait_until(Duration::from_secs(5), "v1's breaker open", || {
        Ok((metric(&envoy.metrics()?, "sluice_latency_breaker_state", &[("version", "v1")]) == 1.0).then_some(()))
    })
    .unwrap();

    // Two of globex's requests before the update, two slow ones and a stream waiting 3 s for its
    // first token (acme, on v2 while v1's breaker is open) in flight during it.
    let mut charged = 0u64;
    for i in 0..2 {
        let id = format!("lds-before-{i}");
        let r = stream(addr, &[("x-sluice-tenant", "globex"), ("x-request-id", &id)]);
        charged += check_charged(&mut c, &id, &r, &stamp_of(&log, &id, "budget"), &v2, &id);
        sent += 1;
    }
    let in_flight: Vec<_> =
        ["lds-flight-0", "lds-flight-1"].iter().map(|id| stream_in_background(addr, &[("x-sluice-tenant", "globex"), ("x-request-id", id), SLOW[0]])).collect();
    let waiting = stream_in_background(addr, &[("x-sluice-tenant", "acme"), ("x-request-id", "lds-waiting"), ("x-mock-ttft-ms", "3000")]);
    let waiting_sent = Instant::now();
    wait_heads(&v2, &["lds-flight-0", "lds-flight-1", "lds-waiting"]);
    let vms_before = vms(&envoy);
    let updates = envoy.stat("listener_manager.lds.update_success").unwrap().unwrap_or(0);
    lds.publish_listeners(vec![full_listener(&base, &new.0, &new.1, &new.2)]).unwrap();
    envoy.wait_stat("listener_manager.lds.update_success", updates + 1, Duration::from_secs(10)).unwrap();
    let update_at = waiting_sent.elapsed();
    let vms_after = vms(&envoy);
    eprintln!(
        "LDS update applied {update_at:?} after the waiting stream was sent; in-place updates {:?}; VMs (created, active) {vms_before:?} -> {vms_after:?}",
        envoy.stat("listener_manager.listener_in_place_updated").unwrap()
    );
    // The update must land while that stream still waits for its first token (new deadline 700 ms).
    c.that(
        !waiting.is_finished() && update_at < Duration::from_millis(2900),
        format!("the update landed after the waiting stream's first token ({update_at:?})"),
    );

    for (i, s) in in_flight.into_iter().enumerate() {
        let id = format!("lds-flight-{i}");
        let r = s.join().unwrap();
        let budget = stamp_of(&log, &id, "budget");
        charged += check_charged(&mut c, &id, &r, &budget, &v2, &id);
        // Priced by the llm-metrics configuration it started under: the same prices as tenant-budget's.
        let llm = stamp_of(&log, &id, "sluice");
        c.eq(&format!("{id} llm.cost_micro_usd (old prices)"), &llm["cost_micro_usd"], budget["charged_micro_usd"].clone());
        sent += 1;
    }
    let r = waiting.join().unwrap();
    sent += 1;
    c.that(
        r.status == 200 && r.complete,
        format!("the stream waiting 3 s for its first token under the old 5 s deadline: status {} (a 504 would be the new 700 ms deadline)", r.status),
    );
    c.eq("lds-waiting latency.outcome", &stamp_of(&log, "lds-waiting", "latency")["outcome"], json!("ok"));

    // New requests: the new prices, the new deadline, the new limits on top of the old usage.
    let id = "lds-after-0";
    let r = stream(addr, &[("x-sluice-tenant", "globex"), ("x-request-id", id)]);
    sent += 1;
    let budget = stamp_of(&log, id, "budget");
    charged += check_charged(&mut c, id, &r, &budget, &v2, id);
    let (llm_cost, budget_cost) = (stamp_of(&log, id, "sluice")["cost_micro_usd"].as_u64().unwrap_or(0), budget["charged_micro_usd"].as_u64().unwrap_or(0));
    c.that(
        llm_cost.abs_diff(budget_cost * 1000) <= 1000 && llm_cost > 0,
        format!("{id}: llm-metrics' cost {llm_cost} is not 1000 × tenant-budget's {budget_cost} (the new prices)"),
    );
    let t = Instant::now();
    let r = post_json(addr, CHAT, &[("x-sluice-tenant", "acme"), ("x-request-id", "lds-after-deadline"), ("x-mock-ttft-ms", "1500")], &chat("late")).unwrap();
    let took = t.elapsed();
    sent += 1;
    c.that(
        // Its first token would come at 1.5 s (a 200): a 504 is the new 700 ms deadline.
        r.status == 504 && took >= Duration::from_millis(700),
        format!("a new request waiting 1.5 s: status {} after {took:?}, want 504 at the new 700 ms deadline", r.status),
    );
    c.eq("lds-after-deadline route.version (v1's breaker still open)", &stamp_of(&log, "lds-after-deadline", "route")["version"], json!("v2"));
    // globex has used 5 requests (2 before, 2 in flight, 1 after); the new limit is 6.
    let id = "lds-after-1";
    let r = stream(addr, &[("x-sluice-tenant", "globex"), ("x-request-id", id)]);
    sent += 1;
    charged += check_charged(&mut c, id, &r, &stamp_of(&log, id, "budget"), &v2, id);
    let r = post_json(addr, CHAT, &[("x-sluice-tenant", "globex"), ("x-request-id", "lds-after-2")], &chat("one too many")).unwrap();
    sent += 1;
    c.eq("the 7th of globex's requests (new limit 6, the old usage kept)", &json!(r.status), json!(429));
    c.eq("its refusal code", &stamp_of(&log, "lds-after-2", "budget")["reject_code"], json!("key:globex:month:requests"));

    let m = envoy.metrics().unwrap();
    let remaining = metric(&m, "sluice_budget_remaining", &[("key", "globex"), ("window", "month"), ("unit", "total_tokens")]);
    c.eq("globex's remaining tokens = new limit − every charge, no lease left", &json!(remaining), json!((900_000 - charged) as f64));
    c.eq(
        "sluice_budget_charged_tokens_total{key=globex}: every charge, before and after",
        &json!(metric(&m, "sluice_budget_charged_tokens_total", &[("key", "globex")])),
        json!(charged as f64),
    );
    c.eq("sluice_requests_total over the update", &json!(metric(&m, "sluice_requests_total", &[])), json!(f64::from(sent)));
    c.eq("v1's breaker still open", &json!(metric(&m, "sluice_latency_breaker_state", &[("version", "v1")])), json!(1.0));
    c.eq("breaker transitions to open", &json!(metric(&m, "sluice_latency_breaker_transitions_total", &[("version", "v1"), ("to", "open")])), json!(1.0));
    for v in ["v1", "v2"] {
        // The last stream's end reaches the guard in Envoy's log callback, which may run after the
        // client has read the whole answer: poll until the gauge settles. A timeout is not an error
        // here: the check below reports the last value read.
        let mut last = f64::NAN;
        let _ = wait_until(Duration::from_secs(5), "the in-flight gauge to drop to 0", || {
            last = metric(&envoy.metrics()?, "sluice_latency_in_flight", &[("version", v)]);
            Ok((last == 0.0).then_some(()))
        });
        c.eq(&format!("sluice_latency_in_flight{{version={v}}} after everything ended"), &json!(last), json!(0.0));
    }
    eprintln!("LDS: {sent} requests, globex charged {charged} tokens, remaining {remaining}");

    // A broken policy: refused with the plugin's message; the previous one keeps serving.
    let rejected = envoy.stat("listener_manager.lds.update_rejected").unwrap().unwrap_or(0);
    let broken = edit(&new.1, |v| v["orgs"][1]["teams"][0]["keys"][0]["budgets"][0]["window"] = json!("fortnight"));
    lds.publish_listeners(vec![full_listener(&base, &new.0, &broken, &new.2)]).unwrap();
    envoy.wait_stat("listener_manager.lds.update_rejected", rejected + 1, Duration::from_secs(10)).unwrap();
    let stderr = envoy.stderr_text();
    let refusal = stderr.lines().find(|l| l.contains("tenant-budget policy refused")).unwrap_or_default().to_string();
    c.that(refusal.contains("fortnight"), format!("Envoy's log names the plugin's refusal of the broken policy: {refusal:?}"));
    eprintln!("LDS broken policy: {refusal}");
    let r = post_json(addr, CHAT, &[("x-sluice-tenant", "globex"), ("x-request-id", "lds-broken-0")], &chat("still refused")).unwrap();
    c.eq("globex after the broken update (the good policy's limit)", &json!(r.status), json!(429));
    let id = "lds-broken-1";
    let r = stream(addr, &[("x-sluice-tenant", "acme"), ("x-request-id", id)]);
    let cost = stamp_of(&log, id, "sluice")["cost_micro_usd"].as_u64().unwrap_or(0);
    let charged_usd = stamp_of(&log, id, "budget")["charged_micro_usd"].as_u64().unwrap_or(0);
    c.that(
        r.status == 200 && cost.abs_diff(charged_usd * 1000) <= 1000 && cost > 0,
        format!("acme after the broken update: status {}, cost {cost} vs 1000 × {charged_usd} (the good policy's prices)", r.status),
    );
    c.done(&format!("Envoy stderr:\n{}", envoy.stderr_tail(20)));
}

/// A small tenant-budget policy: key `k1` with `requests` and `tokens` a month, key `k2` unlimited,
/// and `max_output` as the output reservation of a request that names none.
fn small_budget(requests: u64, tokens: u64, max_output: u64) -> String {
    json!({
        "mode": "strict",
        "identity": { "header": "x-sluice-key" },
        "unknown": { "action": "reject" },
        "include_usage": true,
        "default_max_output_tokens": max_output,
        "orgs": [{ "id": "o", "teams": [{ "id": "t", "keys": [
            { "id": "k1", "budgets": [{ "window": "month", "requests": requests }, { "window": "month", "tokens": tokens }] },
            { "id": "k2" }
        ] }] }],
        "prices": [{ "model": "*", "input_usd_per_mtok": 1.0, "output_usd_per_mtok": 4.0 }]
    })
    .to_string()
}

/// The budget gateway rendered for `site` with `budget` and the demo llm-metrics configuration.
fn budget_gateway(site: &Site, mock: &MockServer, budget: &str) -> Yaml {
    let (up, b, m) = (mock.port().to_string(), yaml_string_body(budget), yaml_string_body(&demo_plugin_config().unwrap()));
    render_shipped("envoy/templates/budget-gateway.yaml", site, &[("UPSTREAM_PORT", &up), ("BUDGET_CONFIG", &b), ("PLUGIN_CONFIG", &m)]).unwrap()
}

const ECDS_RELOADS: &str = "extension_config_discovery.http_filter.sluice_tenant_budget.config_reload";
const ECDS_FAILS: &str = "extension_config_discovery.http_filter.sluice_tenant_budget.config_fail";

#[test]
fn a_policy_pushed_by_ecds_leaves_streams_in_flight_on_theirs_and_keeps_the_budget() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let scratch = Scratch::new("ecds").unwrap();
    let site = Site::new(&scratch).unwrap();
    let mock = MockServer::start(&["--tokens", "6"]).unwrap();
    let mut bootstrap = budget_gateway(&site, &mock, &small_budget(8, 100_000, 64));
    let mut ecds = XdsFile::new(scratch.path(), "ecds").unwrap();
    let typed = filter_to_ecds(http_filters(static_listener(&mut bootstrap).unwrap()).unwrap(), "sluice_tenant_budget", &ecds).unwrap();
    set_node(&mut bootstrap, "ecds");
    ecds.publish_extension("sluice_tenant_budget", typed.clone()).unwrap();
    let envoy = EnvoyProcess::start(&scratch, "envoy", &bootstrap, &site, &Launch::plain(2)).unwrap();
    let (addr, log) = (envoy.listen_addr(), envoy.access_log());
    let mut c = Checks::default();
    let mut charged = 0u64;

    for i in 0..2 {
        let id = format!("ecds-before-{i}");
        let r = stream(addr, &[("x-sluice-key", "k1"), ("x-request-id", &id)]);
        charged += check_charged(&mut c, &id, &r, &stamp_of(&log, &id, "budget"), &mock, &id);
    }
    let in_flight: Vec<_> =
        ["ecds-flight-0", "ecds-flight-1"].iter().map(|id| stream_in_background(addr, &[("x-sluice-key", "k1"), ("x-request-id", id), SLOW[0]])).collect();
    wait_heads(&mock, &["ecds-flight-0", "ecds-flight-1"]);
    let vms_before = vms(&envoy);
    let reloads = envoy.stat(ECDS_RELOADS).unwrap().unwrap_or(0);
    ecds.publish_extension("sluice_tenant_budget", with_plugin_config(&typed, "sluice_tenant_budget", &small_budget(5, 90_000, 32)).unwrap()).unwrap();
    envoy.wait_stat(ECDS_RELOADS, reloads + 1, Duration::from_secs(10)).unwrap();
    c.that(in_flight.iter().all(|s| !s.is_finished()), "the ECDS update landed after the streams ended".into());
    let vms_after = vms(&envoy);
    eprintln!("ECDS update applied; reloads {reloads} -> {:?}; VMs (created, active) {vms_before:?} -> {vms_after:?}", envoy.stat(ECDS_RELOADS).unwrap());

    for (i, s) in in_flight.into_iter().enumerate() {
        let id = format!("ecds-flight-{i}");
        let r = s.join().unwrap();
        let budget = stamp_of(&log, &id, "budget");
        charged += check_charged(&mut c, &id, &r, &budget, &mock, &id);
        // Admitted under the old policy: its output reservation, and the limit written upstream.
        c.eq(&format!("{id} reserved_output_tokens (old policy)"), &budget["reserved_output_tokens"], json!(64));
        c.eq(&format!("{id} max_tokens upstream (old policy)"), &json!(mock_record(&mock, &id).and_then(|r| r.max_tokens)), json!(64));
    }
    let id = "ecds-after-0";
    let r = stream(addr, &[("x-sluice-key", "k1"), ("x-request-id", id)]);
    let budget = stamp_of(&log, id, "budget");
    charged += check_charged(&mut c, id, &r, &budget, &mock, id);
    c.eq(&format!("{id} reserved_output_tokens (new policy)"), &budget["reserved_output_tokens"], json!(32));
    c.eq(&format!("{id} max_tokens upstream (new policy)"), &json!(mock_record(&mock, id).and_then(|r| r.max_tokens)), json!(32));
    // k1 has used 5 requests: the new limit.
    let r = post_json(addr, CHAT, &[("x-sluice-key", "k1"), ("x-request-id", "ecds-after-1")], &chat("one too many")).unwrap();
    c.eq("k1's 6th request (new limit 5, the old usage kept)", &json!(r.status), json!(429));
    let m = envoy.metrics().unwrap();
    let remaining = metric(&m, "sluice_budget_remaining", &[("key", "k1"), ("window", "month"), ("unit", "total_tokens")]);
    c.eq("k1's remaining tokens = new limit − every charge, no lease left", &json!(remaining), json!((90_000 - charged) as f64));
    c.eq("sluice_budget_charged_tokens_total{key=k1}", &json!(metric(&m, "sluice_budget_charged_tokens_total", &[("key", "k1")])), json!(charged as f64));
    eprintln!("ECDS: k1 charged {charged} tokens, remaining {remaining}");

    // A broken policy: refused with the plugin's message; the previous one keeps serving.
    let fails = envoy.stat(ECDS_FAILS).unwrap().unwrap_or(0);
    let broken = edit(&small_budget(5, 90_000, 32), |v| v["orgs"][0]["teams"][0]["keys"][0]["budgets"][1]["tokens"] = json!(-3));
    ecds.publish_extension("sluice_tenant_budget", with_plugin_config(&typed, "sluice_tenant_budget", &broken).unwrap()).unwrap();
    envoy.wait_stat(ECDS_FAILS, fails + 1, Duration::from_secs(10)).unwrap();
    let stderr = envoy.stderr_text();
    let refusal = stderr.lines().find(|l| l.contains("tenant-budget policy refused")).unwrap_or_default().to_string();
    c.that(refusal.contains("tokens"), format!("Envoy's log names the plugin's refusal of the broken policy: {refusal:?}"));
    eprintln!("ECDS broken policy: {refusal}; config_fail {:?}", envoy.stat(ECDS_FAILS).unwrap());
    let r = post_json(addr, CHAT, &[("x-sluice-key", "k1"), ("x-request-id", "ecds-broken-0")], &chat("still refused")).unwrap();
    c.eq("k1 after the broken update (the good policy's limit)", &json!(r.status), json!(429));
    let id = "ecds-broken-1";
    let r = stream(addr, &[("x-sluice-key", "k2"), ("x-request-id", id)]);
    c.that(r.status == 200, format!("k2 after the broken update: {}", r.status));
    c.eq("k2 reserved_output_tokens (the good policy)", &stamp_of(&log, id, "budget")["reserved_output_tokens"], json!(32));
    c.done(&format!("Envoy stderr:\n{}", envoy.stderr_tail(20)));
}

// ---------------------------------------------------------------------------------------------
// A VM failure under each failure_policy.

/// One request through the budget gateway with the trap filter behind the plugins: its status,
/// the trap filter's VM (`x-trap-filter`), and the budget and llm-metrics stamps.
struct Seen {
    status: u16,
    vm: Option<String>,
    budget: Value,
    llm: Value,
}

/// Where the trapping filter sits: behind the plugins (they see its replies) or in front of them.
#[derive(Clone, Copy, PartialEq)]
enum Place {
    Behind,
    InFront,
}

fn trap_gateway(policy: &str) -> (Scratch, MockServer, EnvoyProcess) {
    trap_gateway_at(policy, Place::Behind)
}

fn trap_gateway_at(policy: &str, place: Place) -> (Scratch, MockServer, EnvoyProcess) {
    let scratch = Scratch::new("trap").unwrap();
    let site = Site::new(&scratch).unwrap();
    let mock = MockServer::start(&["--tokens", "4"]).unwrap();
    let mut cfg = budget_gateway(&site, &mock, &small_budget(1000, 1_000_000, 64));
    let filters = http_filters(static_listener(&mut cfg).unwrap()).unwrap();
    let i = match place {
        Place::Behind => wasm_filter_index(filters, "sluice_llm_metrics").unwrap() + 1,
        Place::InFront => wasm_filter_index(filters, "sluice_tenant_budget").unwrap(),
    };
    filters.insert(i, trap_filter(policy).unwrap());
    // One worker: every request meets the same VMs (each worker has its own).
    let envoy = EnvoyProcess::start(&scratch, "envoy", &cfg, &site, &Launch::plain(1)).unwrap();
    (scratch, mock, envoy)
}

fn send(envoy: &EnvoyProcess, id: &str, trap: bool) -> Seen {
    let mut h = vec![("x-sluice-key", "k2"), ("x-request-id", id)];
    if trap {
        h.push(("x-sluice-test-trap", "1"));
    }
    let r = stream(envoy.listen_addr(), &h);
    let log = envoy.access_log();
    Seen { status: r.status, vm: r.header("x-trap-filter").map(str::to_string), budget: stamp_of(&log, id, "budget"), llm: stamp_of(&log, id, "sluice") }
}

/// What the plugins in front of the trapping filter counted: requests by status class, the
/// budget's charges and client disconnects.
fn plugin_counts(envoy: &EnvoyProcess) -> (f64, f64, f64, f64) {
    let m = envoy.metrics().unwrap();
    (
        metric(&m, "sluice_requests_total", &[("status", "2xx")]),
        metric(&m, "sluice_requests_total", &[("status", "5xx")]),
        metric(&m, "sluice_budget_charged_tokens_total", &[("key", "k2")]),
        metric(&m, "sluice_client_disconnects_total", &[]),
    )
}

/// The trapping request under any policy: 503, nothing charged (tenant-budget had not admitted it:
/// the trap came at the request headers, before the body it admits on), llm-metrics' stamp and
/// counter say 503.
fn check_trapped(c: &mut Checks, s: &Seen) {
    c.eq("the trapping request's status", &json!(s.status), json!(503));
    c.eq("its budget stamp (never admitted)", &s.budget, Value::Null);
    c.eq("its llm-metrics status", &s.llm["status"], json!(503));
    // An answer without a body, whole: a 5xx, which llm-metrics files as an upstream error (it cannot
    // tell another filter's reply from the upstream's), not as a client that went away.
    c.eq("its llm-metrics outcome", &s.llm["outcome"], json!("upstream_error"));
}

#[test]
fn a_trapping_filter_under_fail_closed_takes_every_later_request_of_the_worker_down() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let (_scratch, _mock, envoy) = trap_gateway("FAIL_CLOSED");
    let mut c = Checks::default();
    let first = send(&envoy, "closed-0", false);
    c.that(first.status == 200 && first.vm.is_some(), format!("before the trap: {} {:?}", first.status, first.vm));
    check_trapped(&mut c, &send(&envoy, "closed-1", true));
    for i in 2..5 {
        if i == 4 {
            // Longer than FAIL_RELOAD's first backoff: FAIL_CLOSED never comes back.
            std::thread::sleep(Duration::from_millis(1500));
        }
        let s = send(&envoy, &format!("closed-{i}"), false);
        c.that(s.status == 503 && s.vm.is_none(), format!("request {i} after the trap: {} {:?}, want 503", s.status, s.vm));
        c.eq(&format!("request {i}: budget stamp (never admitted)"), &s.budget, Value::Null);
        c.eq(&format!("request {i}: llm-metrics status"), &s.llm["status"], json!(503));
    }
    let (ok, failed, charged, disconnects) = plugin_counts(&envoy);
    eprintln!("FAIL_CLOSED: 2xx {ok}, 5xx {failed}, k2 charged {charged} tokens, client disconnects {disconnects}");
    c.eq("2xx counted", &json!(ok), json!(1.0));
    c.eq("5xx counted", &json!(failed), json!(4.0));
    c.eq("client disconnects counted (none happened)", &json!(disconnects), json!(0.0));
    c.eq("tokens charged (the first request's only)", &json!(charged), first.budget["charged_tokens"].clone().as_f64().map_or(json!(null), |v| json!(v)));
    c.done(&envoy.stderr_tail(10));
}

/// The same failure in front of the plugins: its 503s never reach them, so llm-metrics counts
/// nothing of the outage (Envoy's own counters do).
#[test]
fn a_trapping_filter_in_front_of_the_plugins_under_fail_closed_hides_the_outage_from_them() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let (_scratch, _mock, envoy) = trap_gateway_at("FAIL_CLOSED", Place::InFront);
    let mut c = Checks::default();
    let first = send(&envoy, "front-0", false);
    c.that(first.status == 200 && first.vm.is_some(), format!("before the trap: {} {:?}", first.status, first.vm));
    for (i, trap) in [(1, true), (2, false), (3, false)] {
        let s = send(&envoy, &format!("front-{i}"), trap);
        c.eq(&format!("request {i}: status"), &json!(s.status), json!(503));
        c.eq(&format!("request {i}: llm-metrics stamp (never saw it)"), &s.llm, Value::Null);
        c.eq(&format!("request {i}: budget stamp (never saw it)"), &s.budget, Value::Null);
    }
    let (ok, failed, _, _) = plugin_counts(&envoy);
    let m = envoy.metrics().unwrap();
    let envoy_5xx = metric(&m, "envoy_http_downstream_rq_xx", &[("envoy_http_conn_manager_prefix", "gateway"), ("envoy_response_code_class", "5")]);
    eprintln!("FAIL_CLOSED in front: sluice 2xx {ok}, 5xx {failed}; Envoy's downstream 5xx {envoy_5xx}");
    c.eq("2xx counted by llm-metrics", &json!(ok), json!(1.0));
    c.eq("5xx counted by llm-metrics", &json!(failed), json!(0.0));
    c.eq("5xx counted by Envoy", &json!(envoy_5xx), json!(3.0));
    c.done(&envoy.stderr_tail(10));
}

#[test]
fn a_trapping_filter_under_fail_open_is_bypassed_after_its_trap() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let (_scratch, _mock, envoy) = trap_gateway("FAIL_OPEN");
    let mut c = Checks::default();
    let first = send(&envoy, "open-0", false);
    c.that(first.status == 200 && first.vm.is_some(), format!("before the trap: {} {:?}", first.status, first.vm));
    check_trapped(&mut c, &send(&envoy, "open-1", true));
    let mut charged = first.budget["charged_tokens"].as_u64().unwrap_or(0);
    for i in 2..5 {
        if i == 4 {
            std::thread::sleep(Duration::from_millis(1500));
        }
        let s = send(&envoy, &format!("open-{i}"), i == 3);
        // The dead filter is skipped, even for a request that would trap it again.
        c.that(s.status == 200 && s.vm.is_none(), format!("request {i} after the trap: {} {:?}, want 200 without the filter", s.status, s.vm));
        c.eq(&format!("request {i}: budget outcome"), &s.budget["outcome"], json!("completed"));
        charged += s.budget["charged_tokens"].as_u64().unwrap_or(0);
    }
    let (ok, failed, total, disconnects) = plugin_counts(&envoy);
    eprintln!("FAIL_OPEN: 2xx {ok}, 5xx {failed}, k2 charged {total} tokens, client disconnects {disconnects}");
    c.eq("2xx counted", &json!(ok), json!(4.0));
    c.eq("5xx counted", &json!(failed), json!(1.0));
    c.eq("client disconnects counted (none happened)", &json!(disconnects), json!(0.0));
    c.eq("tokens charged", &json!(total), json!(charged as f64));
    c.done(&envoy.stderr_tail(10));
}

#[test]
fn a_trapping_filter_under_fail_reload_serves_again_with_a_new_vm() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let (_scratch, _mock, envoy) = trap_gateway("FAIL_RELOAD");
    let mut c = Checks::default();
    let first = send(&envoy, "reload-0", false);
    c.that(first.status == 200 && first.vm.is_some(), format!("before the trap: {} {:?}", first.status, first.vm));
    check_trapped(&mut c, &send(&envoy, "reload-1", true));
    // Within the reload backoff (1 s by default): 503, as FAIL_CLOSED.
    let s = send(&envoy, "reload-2", false);
    c.that(s.status == 503, format!("right after the trap: {}, want 503 (backoff)", s.status));
    std::thread::sleep(Duration::from_millis(1500));
    let again = send(&envoy, "reload-3", false);
    c.that(
        again.status == 200 && again.vm.is_some() && again.vm != first.vm,
        format!("after the backoff: {} from VM {:?} (the first VM was {:?})", again.status, again.vm, first.vm),
    );
    c.eq("reloaded: budget outcome", &again.budget["outcome"], json!("completed"));
    // The new VM traps again like the first one, and comes back again.
    check_trapped(&mut c, &send(&envoy, "reload-4", true));
    std::thread::sleep(Duration::from_millis(1500));
    let third = send(&envoy, "reload-5", false);
    c.that(third.status == 200 && third.vm.is_some() && third.vm != again.vm, format!("after the second backoff: {} from VM {:?}", third.status, third.vm));
    let (ok, failed, charged, disconnects) = plugin_counts(&envoy);
    let m = envoy.metrics().unwrap();
    let (reloads, backoffs) =
        (metric(&m, "envoy_wasm_sluice_e2e_trap_vm_reload_success", &[]), metric(&m, "envoy_wasm_sluice_e2e_trap_vm_reload_backoff", &[]));
    eprintln!("FAIL_RELOAD: 2xx {ok}, 5xx {failed}, k2 charged {charged} tokens, client disconnects {disconnects}, reloads {reloads}, backoffs {backoffs}");
    c.eq("2xx counted", &json!(ok), json!(3.0));
    c.eq("5xx counted", &json!(failed), json!(3.0));
    c.eq("client disconnects counted (none happened)", &json!(disconnects), json!(0.0));
    c.eq("VM reloads", &json!(reloads), json!(2.0));
    // The sluice plugins' VMs were never reloaded.
    c.eq("tenant-budget VM reloads", &json!(metric(&m, "envoy_wasm_sluice_tenant_budget_vm_reload_success", &[])), json!(0.0));
    c.done(&envoy.stderr_tail(10));
}

// ---------------------------------------------------------------------------------------------
// Hot restart.

/// Drain and parent shutdown times of the hot restart: long enough for the streams in flight
/// (about 4.2 s from their start), short enough for the test.
fn hot(base: u32, epoch: u32) -> Launch {
    Launch { concurrency: 2, hot_restart: Some((base, epoch)), args: ["--drain-time-s", "3", "--parent-shutdown-time-s", "6"].map(String::from).to_vec() }
}

/// Starts epoch 0 on `config`, sends 2 requests for k1, starts 2 slow ones, hot-restarts into epoch
/// 1 while they stream, and returns both processes, what the parent served and charged, and what it
/// counted before it exited.
struct Restarted {
    child: EnvoyProcess,
    charged_before: u64,
    admitted_before: u32,
    parent_charged_counter: f64,
}

fn hot_restart_with_streams(scratch: &Scratch, config: &Yaml, site: &Site, mock: &MockServer, c: &mut Checks) -> Restarted {
    let base = hot_restart_base_id();
    let path = scratch.join("envoy.yaml");
    std::fs::write(&path, serde_yaml::to_string(config).unwrap()).unwrap();
    let mut parent = EnvoyProcess::spawn(scratch, "epoch0", &path, site, &hot(base, 0)).unwrap();
    parent.wait_live(Duration::from_secs(20)).unwrap();
    let (addr, log) = (parent.listen_addr(), parent.access_log());
    let mut charged = 0;
    for i in 0..2 {
        let id = format!("hot-before-{i}");
        let r = stream(addr, &[("x-sluice-key", "k1"), ("x-request-id", &id)]);
        charged += check_charged(c, &id, &r, &stamp_of(&log, &id, "budget"), mock, &id);
    }
    let in_flight: Vec<_> =
        // 6 tokens 700 ms apart: still streaming once the child (which compiles its VMs first) is live.
        ["hot-flight-0", "hot-flight-1"].iter().map(|id| stream_in_background(addr, &[("x-sluice-key", "k1"), ("x-request-id", id), ("x-mock-itl-ms", "700")])).collect();
    wait_heads(mock, &["hot-flight-0", "hot-flight-1"]);
    let mut child = EnvoyProcess::spawn(scratch, "epoch1", &path, site, &hot(base, 1)).unwrap();
    child.wait_live(Duration::from_secs(20)).unwrap();
    let live = Instant::now();
    c.that(in_flight.iter().all(|s| !s.is_finished()), "the child was live only after the streams ended".into());
    c.that(parent.exited().is_none(), "the parent exited before its streams ended".into());
    for (i, s) in in_flight.into_iter().enumerate() {
        let id = format!("hot-flight-{i}");
        let r = s.join().unwrap();
        charged += check_charged(c, &id, &r, &stamp_of(&log, &id, "budget"), mock, &id);
    }
    let status = parent.wait_exit(Duration::from_secs(30));
    c.that(status.is_some_and(|s| s.success()), format!("the parent did not exit cleanly within 30 s of its streams' end: {status:?}"));
    eprintln!("hot restart: parent exited {status:?} {:?} after the child was live", live.elapsed());
    // The child's counters right after the parent left: Envoy's own carry the parent's counts over
    // (4 requests, before the child served any); sluice's, defined by the plugins in each process's
    // VMs, start again from nothing.
    let m = child.metrics().unwrap();
    let parent_charged_counter = metric(&m, "sluice_budget_charged_tokens_total", &[("key", "k1")]);
    let downstream = metric(&m, "envoy_http_downstream_rq_total", &[("envoy_http_conn_manager_prefix", "gateway")]);
    let upstream = metric(&m, "envoy_cluster_upstream_rq_total", &[("envoy_cluster_name", "model_server")]);
    let requests = m.value("sluice_requests_total", &[]);
    eprintln!(
        "hot restart: the child's counters once the parent exited: http downstream_rq_total {downstream}, model_server upstream_rq_total {upstream}, sluice_budget_charged_tokens_total{{key=k1}} {parent_charged_counter}, sluice_requests_total {requests:?}"
    );
    c.eq("the child's downstream_rq_total (the parent's 4 carried over)", &json!(downstream), json!(4.0));
    c.eq("the child's upstream_rq_total", &json!(upstream), json!(4.0));
    c.eq("the child's sluice_budget_charged_tokens_total (not carried over)", &json!(parent_charged_counter), json!(0.0));
    c.that(requests.unwrap_or(0.0) == 0.0, format!("the child's sluice_requests_total (not carried over): {requests:?}"));
    Restarted { child, charged_before: charged, admitted_before: 4, parent_charged_counter }
}

/// Requests for k1 on `envoy` until the first 429 (at most `max`): how many were admitted.
fn admitted_until_refused(envoy: &EnvoyProcess, prefix: &str, max: u32) -> u32 {
    for i in 0..max {
        let r =
            post_json(envoy.listen_addr(), CHAT, &[("x-sluice-key", "k1"), ("x-request-id", &format!("{prefix}-{i}"))], &chat("after the restart")).unwrap();
        match r.status {
            200 => {}
            429 => return i,
            other => panic!("{prefix}-{i}: status {other}: {}", r.text()),
        }
    }
    max
}

#[test]
fn hot_restart_with_a_local_ledger_finishes_streams_in_the_parent_and_starts_the_budget_again() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let scratch = Scratch::new("hot-local").unwrap();
    let site = Site::new(&scratch).unwrap();
    let mock = MockServer::start(&["--tokens", "6"]).unwrap();
    let config = budget_gateway(&site, &mock, &small_budget(5, 100_000, 64));
    let mut c = Checks::default();
    let r = hot_restart_with_streams(&scratch, &config, &site, &mock, &mut c);
    // Shared data lives in the process: the child's ledger starts from zero, so k1 gets its 5
    // requests again on top of the 4 the parent admitted.
    let again = admitted_until_refused(&r.child, "hot-local-after", 8);
    eprintln!(
        "hot restart, local ledger: parent admitted {} (charged {} tokens), child admitted {again} more of a limit of 5; child's charged-tokens counter right after the parent left: {}",
        r.admitted_before, r.charged_before, r.parent_charged_counter
    );
    c.eq("requests the child admitted (a fresh local ledger)", &json!(again), json!(5));
    c.done(&r.child.stderr_tail(10));
}

#[test]
fn hot_restart_with_the_fleet_ledger_keeps_the_budget() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let missing: Vec<String> = [redis_server_bin().err(), sluice_e2e::tools::ledger_bin().err()].into_iter().flatten().map(|e| format!("{e:#}")).collect();
    if !missing.is_empty() {
        assert!(std::env::var_os("SLUICE_ENVOY").is_none(), "the fleet hot-restart test cannot run:\n{}", missing.join("\n"));
        eprintln!("skipping: {}", missing.join("; "));
        return;
    }
    let redis = Redis::start(Persistence::None).unwrap();
    let ledger = LedgerService::start(&redis.url(), 2).unwrap();
    let scratch = Scratch::new("hot-fleet").unwrap();
    let site = Site::new(&scratch).unwrap();
    let mock = MockServer::start(&["--tokens", "6"]).unwrap();
    let policy = edit(&small_budget(5, 100_000, 64), |v| {
        v["ledger"] = json!({ "mode": "redis", "cluster": "sluice_ledger", "authority": "sluice-ledger", "timeout_ms": 1000, "on_failure": "deny" });
    });
    let (up, lp, b, m) = (mock.port().to_string(), ledger.port().to_string(), yaml_string_body(&policy), yaml_string_body(&demo_plugin_config().unwrap()));
    let config = render_shipped(
        "envoy/templates/fleet-gateway.yaml",
        &site,
        &[("UPSTREAM_PORT", &up), ("LEDGER_PORT", &lp), ("BUDGET_CONFIG", &b), ("PLUGIN_CONFIG", &m)],
    )
    .unwrap();
    let mut c = Checks::default();
    let r = hot_restart_with_streams(&scratch, &config, &site, &mock, &mut c);
    // The budget is in Redis: the child admits what is left of the 5.
    let again = admitted_until_refused(&r.child, "hot-fleet-after", 8);
    c.eq("requests the child admitted (the fleet's budget)", &json!(again), json!(1));
    // k1's token counter holds every charge of both processes once the child's settlement (queued
    // to its root context) has landed, and no hold is left.
    let log = r.child.access_log();
    let charges = || -> u64 {
        log.entries()
            .unwrap()
            .iter()
            .filter_map(|l| stamp(l, "budget").ok().flatten())
            .filter(|b| b["decision"] == "admitted")
            .map(|b| b["charged_tokens"].as_u64().unwrap_or(0))
            .sum()
    };
    let tokens = wait_until(Duration::from_secs(5), "the child's settlement in Redis", || {
        let counters = redis.ledger_counters(sluice_e2e::ledger::PREFIX)?;
        let k1: Vec<(u64, u64)> = counters.iter().filter(|((_, k), _)| k.starts_with("key:k1:month_day1:total_tokens:")).map(|(_, v)| *v).collect();
        Ok((k1.len() == 1 && k1[0].1 == 0).then(|| k1[0]))
    });
    let all = charges();
    eprintln!("hot restart, fleet ledger: parent admitted {} (charged {} tokens), child admitted {again} more of 5; Redis k1 tokens (used, reserved) {tokens:?}, access log charges {all}", r.admitted_before, r.charged_before);
    match tokens {
        Ok((used, _)) => c.eq("Redis k1 tokens used = every charge in the access log", &json!(used), json!(all)),
        Err(e) => c.that(false, format!("{e:#}")),
    }
    c.that(all > r.charged_before, format!("the access log's charges ({all}) include the child's on top of the parent's {}", r.charged_before));
    c.done(&r.child.stderr_tail(10));
}

/// A budget whose measure changes (k2: a million tokens a month → 10 requests a month) starts
/// counting requests from zero: counters are named by what they count
/// (`sluice/tenant-budget/key/k2/month_day1/requests`, not the budget's position), so the new
/// budget does not read the tokens used under the old one (it did before: 33 "requests" of 10
/// after 3 requests, every request refused). k1's budgets, unchanged, keep their counts.
#[test]
fn a_budget_whose_measure_changes_starts_from_zero() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let policy = |budgets: Value| edit(&small_budget(5, 100_000, 64), |v| v["orgs"][0]["teams"][0]["keys"][1]["budgets"] = budgets);
    let scratch = Scratch::new("measure").unwrap();
    let site = Site::new(&scratch).unwrap();
    let mock = MockServer::start(&["--tokens", "6"]).unwrap();
    let mut bootstrap = budget_gateway(&site, &mock, &policy(json!([{ "window": "month", "tokens": 1_000_000 }])));
    let mut ecds = XdsFile::new(scratch.path(), "ecds").unwrap();
    let typed = filter_to_ecds(http_filters(static_listener(&mut bootstrap).unwrap()).unwrap(), "sluice_tenant_budget", &ecds).unwrap();
    set_node(&mut bootstrap, "measure");
    ecds.publish_extension("sluice_tenant_budget", typed.clone()).unwrap();
    let envoy = EnvoyProcess::start(&scratch, "envoy", &bootstrap, &site, &Launch::plain(1)).unwrap();
    for i in 0..3 {
        assert_eq!(stream(envoy.listen_addr(), &[("x-sluice-key", "k2"), ("x-request-id", &format!("measure-{i}"))]).status, 200);
    }
    // k1 spends 2 of its 5 requests a month before the update.
    let k1_before = admitted_until_refused(&envoy, "measure-k1-before", 2);
    ecds.publish_extension(
        "sluice_tenant_budget",
        with_plugin_config(&typed, "sluice_tenant_budget", &policy(json!([{ "window": "month", "requests": 10 }]))).unwrap(),
    )
    .unwrap();
    envoy.wait_stat(ECDS_RELOADS, 2, Duration::from_secs(10)).unwrap();
    let mut c = Checks::default();
    // k2: exactly its 10 requests, then a refusal that counts requests only.
    let mut answers = Vec::new();
    for i in 0..11 {
        let r = post_json(envoy.listen_addr(), CHAT, &[("x-sluice-key", "k2"), ("x-request-id", &format!("measure-after-{i}"))], &chat("counted in requests"))
            .unwrap();
        answers.push((r.status, r.text()));
    }
    let admitted = answers.iter().take_while(|(status, _)| *status == 200).count();
    eprintln!("after the measure change: k2 admitted {admitted} of 11; the last answer: {:?}", answers.last());
    c.eq("k2's requests admitted after the change (a limit of 10, from zero)", &json!(admitted), json!(10));
    let (last_status, last_body) = answers.last().cloned().unwrap_or_default();
    c.eq("the 11th request", &json!(last_status), json!(429));
    c.that(
        last_body.contains("budget key:k2:month:requests exceeded: 10 used and 0 reserved of 10"),
        format!("the refusal counts the 10 requests, nothing of the tokens before: {last_body}"),
    );
    // k1 (its budgets unchanged) has 3 of its 5 left.
    let k1_after = admitted_until_refused(&envoy, "measure-k1-after", 8);
    c.eq("k1's requests before the update", &json!(k1_before), json!(2));
    c.eq("k1's requests after the update (its counter kept)", &json!(k1_after), json!(3));
    // Measured, not asserted: the remaining-budget series of k2 Envoy exports after the change.
    let prom = envoy.admin_get("/stats/prometheus").unwrap_or_default();
    let k2_remaining: Vec<&str> = prom.lines().filter(|l| l.starts_with("sluice_budget_remaining") && l.contains("\"k2\"")).collect();
    eprintln!("k2's remaining-budget series after the change: {k2_remaining:?}");
    c.done(&envoy.stderr_tail(10));
}
