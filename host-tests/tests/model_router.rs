//! model-router, the built `.wasm`, in the harness with a virtual clock: sticky weighted splits,
//! ramps on the clock, trusted overrides, byte-exact body rewrites, shadow traffic that never reaches
//! the client and its comparison metrics, the shadow concurrency cap and tenant exclusion, passive
//! fallback, and configuration errors. Every figure is exact (or, for splits over many keys, within
//! a stated tolerance of the weights; the hashing is fixed, so the same keys always give the same
//! split).
//!
//! The requested model is given as Envoy's `json_to_metadata` would leave it (property
//! `metadata.filter_metadata.sluice.model`, set on the stream before its headers).
//!
//! Build the plugin first: `cargo build --release --target wasm32-wasip1 -p sluice-model-router`.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, UNIX_EPOCH};

use common::llm::{chat, Call, Delivery};
use common::router::*;
use serde_json::{json, Value};
use sluice_host::{Gateway, HttpReply};

const NS_PER_S: u64 = 1_000_000_000;

fn assert_no_crash(gw: &Gateway) {
    assert_eq!(gw.crashed(), None, "the plugin must never trap");
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Byte equality with a readable failure for large bodies: lengths and the first difference.
fn assert_same_bytes(actual: &[u8], expected: &[u8], what: &str) {
    if actual == expected {
        return;
    }
    let at = actual.iter().zip(expected).position(|(a, b)| a != b).unwrap_or(actual.len().min(expected.len()));
    let show = |b: &[u8]| String::from_utf8_lossy(&b[at.saturating_sub(40)..(at + 80).min(b.len())]).into_owned();
    panic!(
        "{what}: {} bytes, expected {}; first difference at byte {at}:\n  got      …{}…\n  expected …{}…",
        actual.len(),
        expected.len(),
        show(actual),
        show(expected)
    );
}

/// `n` tenants of the form `prefix-0000…`, split by the route `gw` gives them: (on v1, on v2).
fn tenants_by_route(gw: &Gateway, prefix: &str, n: usize) -> (Vec<String>, Vec<String>) {
    let (mut v1, mut v2) = (Vec::new(), Vec::new());
    for i in 0..n {
        let t = format!("{prefix}-{i:04}");
        let r = decide_tenant(gw, &t, &format!("scan-{prefix}-{i}"));
        match r.route() {
            ROUTE_V1 => v1.push(t),
            ROUTE_V2 => v2.push(t),
            other => panic!("unexpected route {other:?}"),
        }
    }
    (v1, v2)
}

// ---------------------------------------------------------------------------------------------
// 1. Stickiness and the weighted split
// ---------------------------------------------------------------------------------------------

#[test]
fn the_same_tenant_gets_the_same_route_every_time_and_on_every_worker() {
    let gw = gateway(&split(90, 10));
    let first = decide_tenant(&gw, "tenant-sticky", "req-sticky-0");
    assert_eq!(first.reason(), "weight");
    let version = match first.route() {
        ROUTE_V1 => "v1",
        ROUTE_V2 => "v2",
        other => panic!("unexpected route {other:?}"),
    };
    assert_eq!(first.version(), version, "route and version header agree");
    for i in 1..100 {
        let r = decide_tenant(&gw, "tenant-sticky", &format!("req-sticky-{i}"));
        assert_eq!((r.route(), r.version(), r.reason()), (first.route(), version, "weight"), "request {i} of the same tenant");
    }
    assert_eq!(gw.counter(&requests_total(MODEL, version, "weight")), Some(100));
    // Another worker, replica or restart: no per-process state or seed.
    let other = gateway(&split(90, 10));
    assert_eq!(decide_tenant(&other, "tenant-sticky", "elsewhere").route(), first.route());
    // The stamp tells the access log the whole decision.
    let upstream = if version == "v1" { V1_UPSTREAM } else { V2_UPSTREAM };
    assert_eq!(
        first.stamp,
        Some(json!({"model": MODEL, "version": version, "reason": "weight", "route": first.route(),
                    "upstream_model": upstream, "shadow": null}))
    );
    assert_no_crash(&gw);
}

#[test]
fn two_thousand_tenants_split_90_10_within_two_points() {
    let gw = gateway(&split(90, 10));
    let (v1, v2) = tenants_by_route(&gw, "tenant", 2000);
    let share = v2.len() as f64 / 2000.0;
    assert!((share - 0.10).abs() <= 0.02, "v2 share {share:.4} ({} of 2000) is not 10 % ± 2 %", v2.len());
    assert_eq!(gw.counter(&requests_total(MODEL, "v1", "weight")), Some(v1.len() as u64));
    assert_eq!(gw.counter(&requests_total(MODEL, "v2", "weight")), Some(v2.len() as u64));
    // Every tenant keeps its version on a second pass.
    for t in v2.iter().take(50) {
        assert_eq!(decide_tenant(&gw, t, "again").route(), ROUTE_V2, "{t}");
    }
    assert_no_crash(&gw);
}

#[test]
fn a_request_without_sticky_key_is_split_on_its_request_id_as_unkeyed() {
    let gw = gateway(&split(50, 50));
    let mut routes = BTreeSet::new();
    for i in 0..40 {
        let id = format!("anon-{i}");
        let a = decide(&gw, &Req::new("x", &id).tenant(None));
        let b = decide(&gw, &Req::new("x", &id).tenant(None));
        assert_eq!(a.reason(), "unkeyed");
        assert_eq!(a.route(), b.route(), "the same request id gets the same version");
        routes.insert(a.route().to_string());
    }
    assert_eq!(routes.len(), 2, "40 request ids at 50/50 reach both versions");
    let total = gw.counter(&requests_total(MODEL, "v1", "unkeyed")).unwrap_or(0) + gw.counter(&requests_total(MODEL, "v2", "unkeyed")).unwrap_or(0);
    assert_eq!(total, 80);
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 2. Ramps on the virtual clock
// ---------------------------------------------------------------------------------------------

/// 2026-12-01T00:00:00Z.
const RAMP_T1: u64 = 1_796_083_200;

/// v1 at a constant 100; v2 at 0, then 5 from T1, 25 from T1 + 30 s, 100 from T1 + 60 s.
fn ramp_policy() -> Value {
    let mut p = split(100, 0);
    p["models"][0]["versions"][1]["ramp"] = json!([
        {"at": "2026-12-01T00:00:00Z", "weight": 5},
        {"at": "2026-12-01T00:00:30Z", "weight": 25},
        {"at": "2026-12-01T00:01:00Z", "weight": 100}
    ]);
    p
}

/// Indexes of `tenants` on v2 now; checks each decision's reason (v2's weight comes from a ramp
/// step, v1's does not).
fn on_v2(gw: &Gateway, tenants: &[String], phase: &str) -> BTreeSet<usize> {
    let mut set = BTreeSet::new();
    for (i, t) in tenants.iter().enumerate() {
        let r = decide_tenant(gw, t, &format!("{phase}-{i}"));
        match (r.route(), r.version()) {
            (ROUTE_V2, "v2") => {
                assert_eq!(r.reason(), "ramp", "{phase}: {t}");
                set.insert(i);
            }
            (ROUTE_V1, "v1") => assert_eq!(r.reason(), "weight", "{phase}: {t}"),
            other => panic!("{phase}: unexpected decision {other:?}"),
        }
    }
    set
}

#[test]
fn a_ramp_moves_tenants_to_v2_at_each_step_by_the_weights_and_only_forward() {
    let gw = gateway_at(&ramp_policy(), UNIX_EPOCH + Duration::from_secs(RAMP_T1 - 10));
    let tenants: Vec<String> = (0..1000).map(|i| format!("org-{i:04}")).collect();

    let before = on_v2(&gw, &tenants, "before");
    assert!(before.is_empty(), "before the first step v2 has weight 0: {} on v2", before.len());
    assert_eq!(gw.counter(&requests_total(MODEL, "v1", "weight")), Some(1000));

    let mut shares = Vec::new();
    let mut previous = before;
    for (advance_s, w2) in [(10, 5.0_f64), (30, 25.0), (30, 100.0)] {
        gw.advance(Duration::from_secs(advance_s)).expect("advance");
        let now = on_v2(&gw, &tenants, &format!("w{w2}"));
        let share = now.len() as f64 / 1000.0;
        let expected = w2 / (100.0 + w2);
        // Three standard deviations of a share over 1,000 keys: ±2.0 points at 5 %, ±3.8 at 20 %.
        let tolerance = 3.0 * (expected * (1.0 - expected) / 1000.0).sqrt();
        assert!((share - expected).abs() <= tolerance, "v2 at weight {w2}: share {share:.3}, expected {expected:.3} ± {tolerance:.3}");
        assert!(previous.is_subset(&now), "raising v2's weight only moves tenants to v2: {:?} left it", previous.difference(&now).collect::<Vec<_>>());
        shares.push(now.len() as u64);
        previous = now;
    }
    let on_v2_total: u64 = shares.iter().sum();
    assert_eq!(gw.counter(&requests_total(MODEL, "v2", "ramp")), Some(on_v2_total));
    assert_eq!(gw.counter(&requests_total(MODEL, "v1", "weight")), Some(1000 + 3000 - on_v2_total));
    assert_eq!(gw.counter(&requests_total(MODEL, "v2", "weight")), None);
    assert_eq!(gw.counter(&requests_total(MODEL, "v1", "ramp")), None);
    assert_no_crash(&gw);
}

#[test]
fn a_ramp_step_takes_effect_at_its_exact_instant() {
    // A tenant that the first step (weight 5) puts on v2.
    let probe = gateway_at(&ramp_policy(), UNIX_EPOCH + Duration::from_secs(RAMP_T1));
    let (_, v2) = tenants_by_route(&probe, "edge", 400);
    let tenant = v2.first().expect("some of 400 tenants are on v2 at weight 5").clone();

    let gw = gateway_at(&ramp_policy(), UNIX_EPOCH + Duration::from_nanos(RAMP_T1 * NS_PER_S - 1));
    let r = decide_tenant(&gw, &tenant, "one-ns-before");
    assert_eq!((r.route(), r.reason()), (ROUTE_V1, "weight"), "1 ns before the step");
    gw.advance(Duration::from_nanos(1)).expect("advance");
    let r = decide_tenant(&gw, &tenant, "at-the-step");
    assert_eq!((r.route(), r.reason()), (ROUTE_V2, "ramp"), "at the step");
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 3. Overrides: the trusted property forces, the client's headers are removed
// ---------------------------------------------------------------------------------------------

#[test]
fn the_trusted_property_forces_the_version_and_client_headers_are_removed_and_ignored() {
    let gw = gateway(&demo_no_shadow());
    let (v1, v2) = tenants_by_route(&gw, "acct", 600);
    let (t1, t2) = (v1[0].clone(), v2.first().expect("1 % of 600 tenants on v2").clone());

    let r = decide(&gw, &Req::new(&t1, "force-1").force("v2"));
    assert_eq!((r.route(), r.version(), r.reason()), (ROUTE_V2, "v2", "override"));
    let r = decide(&gw, &Req::new(&t2, "force-2").force("v1"));
    assert_eq!((r.route(), r.version(), r.reason()), (ROUTE_V1, "v1", "override"));
    assert_eq!(gw.counter(&requests_total(MODEL, "v2", "override")), Some(1));
    assert_eq!(gw.counter(&requests_total(MODEL, "v1", "override")), Some(1));
    // A name that is not a version of the model is ignored: the split decides.
    let r = decide(&gw, &Req::new(&t1, "force-3").force("v9"));
    assert_eq!((r.route(), r.version(), r.reason()), (ROUTE_V1, "v1", "weight"));

    // The client tries every header: they are removed, and the decision is the split's.
    let req = Req::new(&t1, "client-tries")
        .header(CLIENT_OVERRIDE_HEADER, "v2")
        .header(ROUTE_HEADER, ROUTE_V2)
        .header(ROUTE_HEADER, "admin-backdoor")
        .header(VERSION_HEADER, "v2")
        .chat();
    let mut s = req.send(&gw);
    let up = s.upstream_request_headers().expect("headers went upstream");
    assert!(!up.contains(CLIENT_OVERRIDE_HEADER), "client override header removed: {up:?}");
    let r = routed(&s);
    assert_eq!(r.routes, vec![ROUTE_V1.to_string()], "only the router's route header");
    assert_eq!(r.versions, vec!["v1".to_string()], "only the router's version header");
    assert_eq!(r.reason(), "weight");
    // The trusted property still wins when the client also sends headers.
    s.end().expect("end");
    let s = Req::new(&t2, "both").force("v1").header(CLIENT_OVERRIDE_HEADER, "v2").header(ROUTE_HEADER, ROUTE_V2).send(&gw);
    let r = routed(&s);
    assert_eq!((r.route(), r.version(), r.reason()), (ROUTE_V1, "v1", "override"));
    assert!(!s.upstream_request_headers().expect("sent").contains(CLIENT_OVERRIDE_HEADER));
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 4. Body rewrite: only the top-level `model`, every other byte as sent
// ---------------------------------------------------------------------------------------------

/// Sends `template` with `@M@` as the requested model (forced to v2, whose upstream name differs)
/// and checks that the upstream body is the template with `@M@` as v2's upstream name.
fn assert_rewrite(template: &str, chunk: Option<usize>) {
    assert!(template.contains("@M@"));
    let body = template.replace("@M@", &json!(MODEL).to_string());
    let expected = template.replace("@M@", &json!(V2_UPSTREAM).to_string());
    serde_json::from_str::<Value>(&body).unwrap_or_else(|e| panic!("test body is JSON: {e}"));
    let gw = gateway(&demo_no_shadow());
    let mut req = Req::new("acme", "rw").force("v2").body(body.clone());
    req.chunk = chunk;
    let s = req.send(&gw);
    assert_eq!(routed(&s).version(), "v2");
    assert_same_bytes(&s.upstream_request_body(), expected.as_bytes(), "rewritten body");
    let up = s.upstream_request_headers().expect("sent");
    assert!(!up.contains("content-length"), "the body changed length: content-length removed");
    assert_no_crash(&gw);
}

#[test]
fn rewrite_keeps_unicode_and_escapes_byte_for_byte() {
    assert_rewrite(r#"{"model":@M@,"messages":[{"role":"user","content":"Grüße, 世界! 🚀 — \u00e9\ud83d\ude80 \/ \b\f\n\r\t ünïcödé"}],"stream":true}"#, None);
}

#[test]
fn rewrite_leaves_escaped_quotes_in_content_alone() {
    assert_rewrite(
        r#"{"messages":[{"role":"user","content":"He said \"model\": \"gpt-4o\", then \\\"quit\\\" \\"}],"model":@M@,"temperature":0.70,"n":1e0}"#,
        None,
    );
}

#[test]
fn rewrite_ignores_model_in_message_text_and_nested_objects() {
    assert_rewrite(
        r#"{"messages":[{"role":"system","content":"\"model\":\"llama-3-70b\""},{"role":"user","content":"model: llama-3-70b, {\"model\": \"x\"}"}],"metadata":{"model":"llama-3-70b","nested":[{"model":"llama-3-70b"}]},"model":@M@,"tools":[{"type":"function","function":{"name":"model","parameters":{"type":"object","properties":{"model":{"type":"string","enum":["llama-3-70b"]}}}}}]}"#,
        None,
    );
}

#[test]
fn rewrite_of_a_5_mb_message_in_64_kib_chunks() {
    let unit = r#"the model \"llama-3-70b\" said {\"model\":\"llama-3-70b\"} — ü 世界 "#;
    let big = unit.repeat(5 * 1024 * 1024 / unit.len() + 1);
    assert!(big.len() >= 5 * 1024 * 1024);
    let template = format!(r#"{{"model":@M@,"messages":[{{"role":"user","content":"{big}"}}],"stream":false}}"#);
    assert_rewrite(&template, Some(64 * 1024));
}

#[test]
fn rewrite_of_pretty_printed_json_keeps_its_layout() {
    assert_rewrite(
        " \r\n\t{\n  \"messages\" : [\n    {\n      \"role\" : \"user\",\n      \"content\" : \"hi\"\n    }\n  ],\n  \"model\"   :\n      @M@ ,\n  \"stream\" : false\n}\n\n",
        Some(7),
    );
}

#[test]
fn rewrite_sets_every_top_level_duplicate_and_escaped_spellings_of_model() {
    assert_rewrite(r#"{"model":@M@,"messages":[{"role":"user","content":"hi","model":"llama-3-70b"}],"model":@M@}"#, None);
    assert_rewrite(r#"{"mod\u0065l":@M@,"messages":[{"role":"user","content":"hi"}]}"#, None);
}

#[test]
fn a_body_that_is_not_json_is_forwarded_as_sent_and_not_shadowed() {
    let gw = gateway(&demo_shadow_all(8));
    let body = br#"{"model":"llama-3-70b","messages":[{"role":"user","content":"cut off"#.to_vec();
    let s = Req::new("acme", "not-json").force("v2").body(body.clone()).send(&gw);
    assert_eq!(routed(&s).version(), "v2");
    assert_same_bytes(&s.upstream_request_body(), &body, "body as sent");
    gw.advance(ms(20)).expect("tick");
    assert!(gw.http_calls().is_empty(), "no shadow of a body that cannot be rewritten");
    assert!(
        gw.logs_at_least(sluice_host::LogLevel::Warn).iter().any(|l| l.contains("model not rewritten")),
        "{:?}",
        gw.logs_at_least(sluice_host::LogLevel::Warn)
    );
    assert_no_crash(&gw);
}

#[test]
fn no_rewrite_when_the_version_keeps_the_requested_name() {
    let gw = gateway(&demo_no_shadow());
    let body = chat_body(MODEL);
    let s = Req::new("acme", "keep").force("v1").body(body.clone()).send(&gw);
    assert_eq!(routed(&s).version(), "v1");
    assert_same_bytes(&s.upstream_request_body(), body.as_bytes(), "body as sent");
    let up = s.upstream_request_headers().expect("sent");
    assert_eq!(up.get("content-length"), Some(body.len().to_string().as_str()));
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 5. Shadow traffic never alters the client's response
// ---------------------------------------------------------------------------------------------

/// What one played request left: (downstream headers, downstream body, upstream headers,
/// upstream body, the shadow callouts seen at +20 ms).
struct Played {
    down_headers: sluice_host::Headers,
    down_body: Vec<u8>,
    up_headers: sluice_host::Headers,
    up_body: Vec<u8>,
    calls_at_19: usize,
    calls: Vec<sluice_host::HttpCall>,
    version: String,
}

/// Plays the standard streamed chat answer for `req`; answers any shadow at +150 ms with a
/// different text.
fn play(gw: &Gateway, req: &Req) -> Played {
    let mut c = req.call(gw);
    let version = routed(&c.stream).version().to_string();
    c.at(19);
    let calls_at_19 = gw.http_calls().len();
    c.at(20);
    let calls = gw.http_calls();
    c.at(100);
    for call in &calls {
        gw.respond_http_call(call.token, HttpReply::status(200).header("content-type", "application/json").body(chat::response(19, 8))).expect("shadow reply");
    }
    c.sse_headers(120);
    c.body(&chat::timeline(true), Delivery::PerEntry, true);
    c.end();
    Played {
        down_headers: c.stream.downstream_response_headers().expect("response headers reached the client"),
        down_body: c.downstream_body(),
        up_headers: c.stream.upstream_request_headers().expect("request headers went upstream"),
        up_body: c.stream.upstream_request_body(),
        calls_at_19,
        calls,
        version,
    }
}

#[test]
fn a_shadowed_request_reaches_the_client_byte_identical_to_an_unshadowed_one() {
    let req = Req::new("acme", "req-shadow-5").chat();
    let on = gateway(&demo_shadow_all(8));
    let off = gateway(&demo_no_shadow());
    let a = play(&on, &req);
    let b = play(&off, &req);
    assert_eq!(a.version, b.version);
    assert_eq!(a.down_headers, b.down_headers, "client response headers");
    assert_same_bytes(&a.down_body, &b.down_body, "client response body");
    assert_same_bytes(&a.down_body, chat::timeline(true).iter().map(|(_, e)| e.as_str()).collect::<String>().as_bytes(), "client gets the upstream's stream");
    assert_same_bytes(&a.up_body, &b.up_body, "primary request body");
    assert_eq!(b.calls.len(), 0, "no shadow without a shadow configured");
    assert_eq!(a.calls_at_19, 0, "the shadow waits for the root's 20 ms tick");
    assert_eq!(a.calls.len(), 1, "one shadow callout by +20 ms");
    // The primary request goes where it would go anyway.
    for name in [ROUTE_HEADER, VERSION_HEADER, ":path", ":authority", "x-request-id", TENANT_HEADER] {
        assert_eq!(a.up_headers.get(name), b.up_headers.get(name), "upstream header {name}");
    }
    assert_no_crash(&on);
    assert_no_crash(&off);
}

#[test]
fn the_shadow_callout_carries_the_same_body_with_its_model_to_the_configured_cluster() {
    let gw = gateway(&demo_shadow_all(8));
    let req = Req::new("acme", "req-shadow-call").chat();
    let s = req.send(&gw);
    let stamp = routed(&s).stamp.expect("stamp");
    assert_eq!(stamp["shadow"], json!(SHADOW));
    assert!(gw.http_calls().is_empty(), "nothing is sent from the stream itself");
    assert_eq!(gw.tick_period(), Some(ms(20)), "a queued shadow starts the root's tick");
    gw.advance(ms(20)).expect("advance to the tick");
    let calls = gw.http_calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(gw.tick_period(), None, "nothing left to send: the tick stops");
    let call = &calls[0];
    assert_eq!(call.upstream, SHADOW_CLUSTER);
    assert_ne!(call.context_id, s.id(), "sent by the root context, which outlives the stream");
    assert_eq!(call.timeout, Some(Duration::from_secs(300)));
    let mut names = call.headers.names();
    names.sort();
    assert_eq!(
        names,
        [":authority", ":method", ":path", "content-type", "x-request-id", "x-sluice-shadow"],
        "exactly these headers (no client credentials): {:?}",
        call.headers
    );
    assert_eq!(call.headers.get(":method"), Some("POST"));
    assert_eq!(call.headers.get(":path"), Some(chat::PATH));
    assert_eq!(call.headers.get(":authority"), Some(SHADOW_AUTHORITY));
    assert_eq!(call.headers.get("content-type"), Some("application/json"));
    assert_eq!(call.headers.get("x-sluice-shadow"), Some("1"));
    assert_eq!(call.headers.get("x-request-id"), Some("req-shadow-call"));
    assert_same_bytes(&call.body, chat_body(SHADOW_UPSTREAM).as_bytes(), "shadow body");
    // The primary's body is untouched (v1 keeps the requested name) whatever the shadow gets.
    let version = routed(&s).version().to_string();
    let primary_model = if version == "v1" { V1_UPSTREAM } else { V2_UPSTREAM };
    assert_same_bytes(&s.upstream_request_body(), chat_body(primary_model).as_bytes(), "primary body");
    assert_eq!(gw.counter(&shadow_total(&version, SHADOW, "sampled")), Some(1));
    assert_eq!(gw.counter(&shadow_total(&version, SHADOW, "sent")), Some(1));
    assert_no_crash(&gw);
}

#[test]
fn the_shadow_authority_defaults_to_the_cluster_and_the_body_of_a_rewritten_primary_is_the_original() {
    let mut p = demo_shadow_all(8);
    p["models"][0]["shadow"]["version"].as_object_mut().expect("version").remove("authority");
    let gw = gateway(&p);
    // Primary forced to v2 (rewritten); the shadow copy starts from the client's body.
    let s = Req::new("acme", "req-auth").force("v2").chat().send(&gw);
    assert_same_bytes(&s.upstream_request_body(), chat_body(V2_UPSTREAM).as_bytes(), "primary body");
    gw.advance(ms(20)).expect("tick");
    let calls = gw.http_calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].headers.get(":authority"), Some(SHADOW_CLUSTER));
    assert_same_bytes(&calls[0].body, chat_body(SHADOW_UPSTREAM).as_bytes(), "shadow body");
    assert_no_crash(&gw);
}

#[test]
fn shadow_sampling_at_5_percent_is_deterministic_in_the_request_id() {
    let mut p = demo();
    p["models"][0]["shadow"]["max_concurrent"] = json!(100_000);
    let gw = gateway(&p);
    let mut sampled = BTreeSet::new();
    for i in 0..2000 {
        let s = Req::new("acme", &format!("rid-{i}")).chat().send(&gw);
        if routed(&s).stamp.expect("stamp")["shadow"] == json!(SHADOW) {
            sampled.insert(i);
        }
    }
    let share = sampled.len() as f64 / 2000.0;
    assert!((share - 0.05).abs() <= 0.015, "sampled share {share:.4}");
    // Another worker samples the same request ids.
    let other = gateway(&p);
    for i in 0..200 {
        let s = Req::new("acme", &format!("rid-{i}")).chat().send(&other);
        let is = routed(&s).stamp.expect("stamp")["shadow"] == json!(SHADOW);
        assert_eq!(is, sampled.contains(&i), "rid-{i}");
    }
    let counted = gw.counter(&shadow_total("v1", SHADOW, "sampled")).unwrap_or(0) + gw.counter(&shadow_total("v2", SHADOW, "sampled")).unwrap_or(0);
    assert_eq!(counted, sampled.len() as u64);
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 6. Comparison metrics
// ---------------------------------------------------------------------------------------------

/// The text of [`chat::PIECES`] as one string: what the primary's stream says.
fn primary_text() -> String {
    chat::PIECES.concat()
}

/// A non-streamed chat answer saying `text`, with `completion` output tokens and `finish`.
fn shadow_answer(text: &str, completion: u64, finish: &str) -> Vec<u8> {
    let mut v: Value = serde_json::from_str(&chat::response(19, completion)).expect("JSON");
    v["choices"][0]["message"]["content"] = json!(text);
    v["choices"][0]["finish_reason"] = json!(finish);
    v.to_string().into_bytes()
}

/// Plays the standard streamed primary (headers at +120, last byte at +392) of a shadowed request
/// that starts at the gateway's start (so the shadow is sent on the tick at +20 ms).
fn primary_stream(c: &mut Call) {
    c.sse_headers(120);
    c.body(&chat::timeline(true), Delivery::PerEntry, true);
}

/// `sluice.router.compare_total.primary.<p>.shadow.<s>.finish_agree.<agree>`
fn compare_total(primary: &str, agree: bool) -> String {
    format!("{}.finish_agree.{agree}", compare("compare_total", primary, SHADOW))
}

fn compare_metrics(gw: &Gateway) -> Vec<String> {
    metrics_with_prefix(gw, "sluice.router.compare")
}

/// What the router compared for one shadowed request.
#[derive(Debug, PartialEq)]
struct Comparison {
    /// Before the shadow answered (the primary already ended): every compare metric.
    before_shadow: Vec<String>,
    callouts: usize,
    /// `compare_duration_ms`, `compare_ttft_ms`, `compare_output_tokens`: (primary, shadow).
    duration_ms: (Option<Vec<u64>>, Option<Vec<u64>>),
    ttft_ms: (Option<Vec<u64>>, Option<Vec<u64>>),
    output_tokens: (Option<Vec<u64>>, Option<Vec<u64>>),
    /// `compare_total` with finish_agree true / false.
    finish_agree: (Option<u64>, Option<u64>),
    similarity_per_mille: Option<Vec<u64>>,
    errors: (Option<u64>, Option<u64>),
    /// `shadow_total` sent / failed.
    shadow_sent_failed: (Option<u64>, Option<u64>),
    /// The comparison log line's members, as `"name":value` pieces of the line that are missing.
    missing_log_parts: Vec<String>,
    crashed: Option<String>,
}

/// Every API, streamed primary first, then the shadow's whole answer at +700 (sent on the tick at
/// +20 ms): both sides' duration, the primary's TTFT (the shadow's is not observable), output
/// tokens, finish agreement, text similarity, and one log line.
#[test]
fn comparison_when_the_primary_finishes_first_for_every_api() {
    use common::llm::{completions, messages, responses};
    let mut cmpl_stream: Vec<(u64, String)> =
        ["This", " is", " indeed", " a", " test"].iter().enumerate().map(|(i, p)| (90 + 20 * i as u64, completions::text(p, None))).collect();
    cmpl_stream.push((175, completions::text("", Some("length"))));
    cmpl_stream.push((176, completions::usage(5, 5)));
    cmpl_stream.push((177, chat::DONE.to_string()));
    // The shadow's completion says what the stream said.
    let mut cmpl_whole: Value = serde_json::from_str(&completions::response()).expect("JSON");
    cmpl_whole["choices"][0]["text"] = json!("This is indeed a test");
    // (path, streamed body, primary stream, shadow answer, primary duration, TTFT, output tokens,
    //  shadow output tokens, finish reason)
    let cases = [
        (chat::PATH, chat::request(true, true), chat::timeline(true), shadow_answer(&primary_text(), 11, "stop"), 392, 180, 9, 11, "stop"),
        (completions::PATH, completions::request(true), cmpl_stream, cmpl_whole.to_string().into_bytes(), 177, 90, 5, 7, "length"),
        (responses::PATH, responses::request(true), responses::timeline(), responses::response().into_bytes(), 360, 250, 6, 6, "completed"),
        (messages::PATH, messages::request(true), messages::timeline(), messages::response().into_bytes(), 531, 400, 15, 15, "end_turn"),
    ];
    for (path, body, stream, answer, duration, ttft, output, shadow_output, finish) in cases {
        let gw = gateway(&demo_shadow_all(8));
        let id = format!("cmp-primary-first-{}", path.trim_start_matches("/v1/").replace('/', "-"));
        let mut c = Req::new("acme", &id).api(path, &body).call(&gw);
        let p = routed(&c.stream).version().to_string();
        c.sse_headers(stream[0].0);
        c.body(&stream, Delivery::PerEntry, true);
        c.end();
        let before_shadow = compare_metrics(&gw);
        c.at(700);
        let calls = gw.http_calls();
        if let Some(call) = calls.first() {
            gw.respond_http_call(call.token, HttpReply::status(200).header("content-type", "application/json").body(answer)).expect("shadow reply");
        }
        let side = |m: &str, s: &str| compare_side(m, &p, SHADOW, s);
        let both = |m: &str| (gw.histogram(&side(m, "primary")), gw.histogram(&side(m, "shadow")));
        let lines: Vec<String> = gw.logs().into_iter().map(|l| l.message).filter(|m| m.starts_with("shadow comparison ")).collect();
        let parts = [
            format!(r#""request_id":"{id}""#),
            format!(r#""duration_ms":[{duration},680]"#),
            format!(r#""output_tokens":[{output},{shadow_output}]"#),
            r#""similarity_per_mille":1000"#.to_string(),
            format!(r#""finish":["{finish}","{finish}"]"#),
            r#""status":[200,200]"#.to_string(),
        ];
        let got = Comparison {
            before_shadow,
            callouts: calls.len(),
            duration_ms: both("compare_duration_ms"),
            ttft_ms: both("compare_ttft_ms"),
            output_tokens: both("compare_output_tokens"),
            finish_agree: (gw.counter(&compare_total(&p, true)), gw.counter(&compare_total(&p, false))),
            similarity_per_mille: gw.histogram(&compare("compare_similarity_per_mille", &p, SHADOW)),
            errors: (gw.counter(&side("compare_errors_total", "primary")), gw.counter(&side("compare_errors_total", "shadow"))),
            shadow_sent_failed: (gw.counter(&shadow_total(&p, SHADOW, "sent")), gw.counter(&shadow_total(&p, SHADOW, "failed"))),
            missing_log_parts: if lines.len() == 1 {
                parts.iter().filter(|part| !lines[0].contains(part.as_str())).cloned().collect()
            } else {
                vec![format!("one comparison line, not {lines:?}")]
            },
            crashed: gw.crashed(),
        };
        let want = Comparison {
            before_shadow: vec![],
            callouts: 1,
            duration_ms: (Some(vec![duration]), Some(vec![680])), // sent at +20, answered at +700
            ttft_ms: (Some(vec![ttft]), None),
            output_tokens: (Some(vec![output]), Some(vec![shadow_output])),
            finish_agree: (Some(1), None),
            similarity_per_mille: Some(vec![1000]), // the same text
            errors: (None, None),
            shadow_sent_failed: (Some(1), None),
            missing_log_parts: vec![],
            crashed: None,
        };
        assert_eq!(got, want, "{path}");
    }
}

/// The one `shadow comparison {…}` log line.
fn comparison_log_line(gw: &Gateway) -> String {
    let lines: Vec<String> = gw.logs().into_iter().map(|l| l.message).filter(|m| m.starts_with("shadow comparison ")).collect();
    assert_eq!(lines.len(), 1, "one comparison line: {lines:?}");
    lines[0].clone()
}

#[test]
fn the_comparison_log_line_is_one_json_object() {
    let gw = gateway(&demo_shadow_all(8));
    let mut c = Req::new("acme", "cmp-log").chat().call(&gw);
    primary_stream(&mut c);
    c.end();
    c.at(500);
    let calls = gw.http_calls();
    gw.respond_http_call(calls[0].token, HttpReply::status(200).body(shadow_answer(&primary_text(), 11, "stop"))).expect("shadow reply");
    let line = comparison_log_line(&gw);
    let logged: Value =
        serde_json::from_str(line.trim_start_matches("shadow comparison ")).unwrap_or_else(|e| panic!("the comparison line is JSON ({e}): {line}"));
    assert_eq!(logged["request_id"], json!("cmp-log"));
    assert_eq!(logged["finish"], json!(["stop", "stop"]));
    assert_eq!(logged["status"], json!([200, 200]));
    assert_eq!(logged["duration_ms"], json!([392, 480]));
}

#[test]
fn comparison_when_the_shadow_finishes_first() {
    let gw = gateway(&demo_shadow_all(8));
    let mut c = Req::new("acme", "cmp-shadow-first").chat().call(&gw);
    let p = routed(&c.stream).version().to_string();
    c.at(100);
    let calls = gw.http_calls();
    assert_eq!(calls.len(), 1);
    gw.respond_http_call(
        calls[0].token,
        HttpReply::status(200).header("content-type", "application/json").body(shadow_answer("Completely unrelated words appear here", 40, "length")),
    )
    .expect("shadow reply");
    assert!(compare_metrics(&gw).is_empty(), "nothing is compared before the primary ends");
    primary_stream(&mut c);
    c.end();

    let side = |m: &str, s: &str| compare_side(m, &p, SHADOW, s);
    assert_eq!(gw.histogram(&side("compare_duration_ms", "primary")), Some(vec![392]));
    assert_eq!(gw.histogram(&side("compare_duration_ms", "shadow")), Some(vec![80]));
    assert_eq!(gw.histogram(&side("compare_ttft_ms", "primary")), Some(vec![180]));
    assert_eq!(gw.histogram(&side("compare_output_tokens", "primary")), Some(vec![9]));
    assert_eq!(gw.histogram(&side("compare_output_tokens", "shadow")), Some(vec![40]));
    assert_eq!(gw.counter(&compare_total(&p, false)), Some(1));
    assert_eq!(gw.counter(&compare_total(&p, true)), None);
    assert_eq!(gw.histogram(&compare("compare_similarity_per_mille", &p, SHADOW)), Some(vec![0]), "disjoint texts");
    assert_eq!(gw.counter(&side("compare_errors_total", "shadow")), None);
    assert_no_crash(&gw);
}

#[test]
fn a_streamed_shadow_answer_is_compared_like_a_streamed_primary() {
    // The shadow gets the client's body, `"stream": true` included, so it answers with SSE.
    let gw = gateway(&demo_shadow_all(8));
    let mut c = Req::new("acme", "cmp-sse").chat().call(&gw);
    let p = routed(&c.stream).version().to_string();
    primary_stream(&mut c);
    c.end();
    c.at(600);
    let sse: String = chat::timeline(true).into_iter().map(|(_, e)| e).collect();
    let calls = gw.http_calls();
    gw.respond_http_call(calls[0].token, HttpReply::status(200).header("content-type", "text/event-stream").body(sse)).expect("shadow reply");
    let side = |m: &str, s: &str| compare_side(m, &p, SHADOW, s);
    assert_eq!(gw.histogram(&side("compare_output_tokens", "shadow")), Some(vec![9]));
    assert_eq!(gw.histogram(&side("compare_duration_ms", "shadow")), Some(vec![580]));
    assert_eq!(gw.counter(&compare_total(&p, true)), Some(1));
    assert_eq!(gw.histogram(&compare("compare_similarity_per_mille", &p, SHADOW)), Some(vec![1000]));
    assert_no_crash(&gw);
}

/// A non-streamed chat answer of about `kib` KiB of text, with `completion` output tokens.
fn long_answer(kib: usize, completion: u64) -> (String, Vec<u8>) {
    let text = "All work and no play makes Jack a dull boy. ".repeat(kib * 1024 / 44 + 1);
    let body = shadow_answer(&text, completion, "stop");
    (text, body)
}

#[test]
fn a_non_streamed_primary_answer_over_64_kib_keeps_its_output_tokens_and_finish() {
    let gw = gateway(&demo_shadow_all(8));
    let (_, body) = long_answer(100, 25_000);
    let mut c = Req::new("acme", "cmp-long-primary").chat().call(&gw);
    let p = routed(&c.stream).version().to_string();
    c.response_headers(300, "200", "application/json");
    c.body_bytes(300, &body, true);
    c.end();
    assert_same_bytes(&c.downstream_body(), &body, "the client gets the whole answer");
    c.at(400);
    let calls = gw.http_calls();
    gw.respond_http_call(calls[0].token, HttpReply::status(200).body(shadow_answer("short", 2, "stop"))).expect("shadow reply");
    let side = |m: &str, s: &str| compare_side(m, &p, SHADOW, s);
    assert_eq!(gw.histogram(&side("compare_output_tokens", "primary")), Some(vec![25_000]));
    assert_eq!(gw.counter(&compare_total(&p, true)), Some(1), "both finished with stop");
}

#[test]
fn a_shadow_answer_over_256_kib_keeps_its_output_tokens_and_finish() {
    let gw = gateway(&demo_shadow_all(8));
    let (_, body) = long_answer(300, 75_000);
    let mut c = Req::new("acme", "cmp-long-shadow").chat().call(&gw);
    let p = routed(&c.stream).version().to_string();
    primary_stream(&mut c);
    c.end();
    c.at(500);
    let calls = gw.http_calls();
    gw.respond_http_call(calls[0].token, HttpReply::status(200).body(body)).expect("shadow reply");
    let side = |m: &str, s: &str| compare_side(m, &p, SHADOW, s);
    assert_eq!(gw.histogram(&side("compare_output_tokens", "shadow")), Some(vec![75_000]));
    assert_eq!(gw.counter(&compare_total(&p, true)), Some(1), "both finished with stop");
}

#[test]
fn a_failed_shadow_callout_counts_as_failed_and_as_a_shadow_error() {
    let gw = gateway(&demo_shadow_all(8));
    let mut c = Req::new("acme", "cmp-fail").chat().call(&gw);
    let p = routed(&c.stream).version().to_string();
    c.at(50);
    let calls = gw.http_calls();
    assert_eq!(calls.len(), 1);
    gw.fail_http_call(calls[0].token).expect("fail the callout");
    assert_eq!(gw.counter(&shadow_total(&p, SHADOW, "failed")), Some(1));
    primary_stream(&mut c);
    c.end();
    let side = |m: &str, s: &str| compare_side(m, &p, SHADOW, s);
    assert_eq!(gw.counter(&side("compare_errors_total", "shadow")), Some(1));
    assert_eq!(gw.counter(&side("compare_errors_total", "primary")), None);
    assert_eq!(gw.histogram(&side("compare_duration_ms", "shadow")), Some(vec![30]));
    assert_eq!(gw.histogram(&side("compare_output_tokens", "shadow")), Some(vec![0]));
    assert_eq!(gw.counter(&compare_total(&p, false)), Some(1));
    assert_eq!(gw.histogram(&compare("compare_similarity_per_mille", &p, SHADOW)), Some(vec![0]), "no shadow text");
    assert_no_crash(&gw);
}

#[test]
fn a_5xx_shadow_answer_is_a_shadow_error() {
    let gw = gateway(&demo_shadow_all(8));
    let mut c = Req::new("acme", "cmp-503").chat().call(&gw);
    let p = routed(&c.stream).version().to_string();
    primary_stream(&mut c);
    c.end();
    c.at(450);
    let calls = gw.http_calls();
    assert_eq!(calls.len(), 1);
    gw.respond_http_call(
        calls[0].token,
        HttpReply::status(503).header("content-type", "application/json").body(r#"{"error":{"message":"The server is overloaded","type":"server_error"}}"#),
    )
    .expect("shadow reply");
    let side = |m: &str, s: &str| compare_side(m, &p, SHADOW, s);
    assert_eq!(gw.counter(&side("compare_errors_total", "shadow")), Some(1));
    assert_eq!(gw.counter(&side("compare_errors_total", "primary")), None);
    assert_eq!(gw.histogram(&side("compare_duration_ms", "shadow")), Some(vec![430]));
    // `failed` counts callouts that got no answer; a 503 is an answer (an error of the shadow side).
    assert_eq!(gw.counter(&shadow_total(&p, SHADOW, "failed")), None);
    assert_no_crash(&gw);
}

#[test]
fn an_unanswered_shadow_times_out_after_300_s_as_failed() {
    let gw = gateway(&demo_shadow_all(8));
    let mut c = Req::new("acme", "cmp-timeout").chat().call(&gw);
    let p = routed(&c.stream).version().to_string();
    primary_stream(&mut c);
    c.end();
    c.at(20 + 300_000 - 1);
    assert_eq!(gw.counter(&shadow_total(&p, SHADOW, "failed")), None, "still waiting 1 ms before the timeout");
    c.at(20 + 300_000);
    assert_eq!(gw.counter(&shadow_total(&p, SHADOW, "failed")), Some(1));
    assert_eq!(gw.histogram(&compare_side("compare_duration_ms", &p, SHADOW, "shadow")), Some(vec![300_000]));
    assert!(gw.http_calls().is_empty());
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 7. Concurrency cap
// ---------------------------------------------------------------------------------------------

#[test]
fn at_most_max_concurrent_shadows_and_the_rest_skipped_cap() {
    let gw = gateway(&demo_shadow_all(2));
    let mut streams = Vec::new();
    for i in 0..5 {
        streams.push(Req::new("acme", &format!("cap-{i}")).chat().send(&gw));
    }
    let p = routed(&streams[0]).version().to_string();
    assert!(streams.iter().all(|s| routed(s).version() == p), "one tenant, one version");
    assert_eq!(gw.counter(&shadow_total(&p, SHADOW, "sampled")), Some(5));
    assert_eq!(gw.counter(&shadow_total(&p, SHADOW, "skipped_cap")), Some(3));
    assert_eq!(gw.counter(&shadow_total(&p, SHADOW, "sent")), None, "queued, not sent yet");
    gw.advance(ms(20)).expect("tick");
    let calls = gw.http_calls();
    let ids: Vec<_> = calls.iter().map(|c| c.headers.get("x-request-id").unwrap_or_default().to_string()).collect();
    assert_eq!(ids, ["cap-0", "cap-1"], "the first two are shadowed");
    assert_eq!(gw.counter(&shadow_total(&p, SHADOW, "sent")), Some(2));

    // A sixth while two are in flight: skipped too.
    let _s5 = Req::new("acme", "cap-5").chat().send(&gw);
    assert_eq!(gw.counter(&shadow_total(&p, SHADOW, "skipped_cap")), Some(4));
    // One answers: room for one more.
    gw.respond_http_call(calls[0].token, HttpReply::status(200).body(shadow_answer("ok", 1, "stop"))).expect("reply");
    let _s6 = Req::new("acme", "cap-6").chat().send(&gw);
    let _s7 = Req::new("acme", "cap-7").chat().send(&gw);
    assert_eq!(gw.counter(&shadow_total(&p, SHADOW, "sampled")), Some(8));
    assert_eq!(gw.counter(&shadow_total(&p, SHADOW, "skipped_cap")), Some(5));
    gw.advance(ms(20)).expect("tick");
    let ids: Vec<_> = gw.http_calls().iter().map(|c| c.headers.get("x-request-id").unwrap_or_default().to_string()).collect();
    assert_eq!(ids, ["cap-1", "cap-6"]);
    assert_eq!(gw.counter(&shadow_total(&p, SHADOW, "sent")), Some(3));
    // The skipped requests are not compared: their primaries end without a comparison.
    for mut s in streams.into_iter().skip(2) {
        s.response_headers(&[(":status", "200"), ("content-type", "application/json")], false).expect("headers");
        s.response_body(chat::response(19, 9).as_bytes(), true).expect("body");
        s.end().expect("end");
    }
    assert!(compare_metrics(&gw).is_empty());
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 8. Tenant exclusion
// ---------------------------------------------------------------------------------------------

/// The `excluded` counters the plugin defined, whatever their shadow label.
fn excluded_total(gw: &Gateway, primary: &str) -> u64 {
    metrics_with_prefix(gw, &format!("sluice.router.shadow_total.primary.{primary}.shadow."))
        .into_iter()
        .filter(|n| n.ends_with(".result.excluded"))
        .map(|n| gw.counter(&n).unwrap_or(0))
        .sum()
}

#[test]
fn excluded_tenants_and_requests_without_tenant_are_never_shadowed() {
    let gw = gateway(&demo_shadow_all(100));
    let mut versions = BTreeSet::new();
    for (i, tenant) in ["bank-of-x", "bank-", "bank-acme-eu"].iter().enumerate() {
        for j in 0..3 {
            let s = Req::new(tenant, &format!("ex-{i}-{j}")).chat().send(&gw);
            let r = routed(&s);
            assert_eq!(r.stamp.as_ref().expect("stamp")["shadow"], Value::Null, "{tenant}");
            versions.insert(r.version().to_string());
        }
    }
    // No tenant header while exclusions exist: excluded (fail closed). The sticky key falls back to
    // the API key.
    for j in 0..2 {
        let s = Req::new("x", &format!("ex-none-{j}")).tenant(None).header("authorization", "Bearer sk-live-7f3a9c").chat().send(&gw);
        assert_eq!(routed(&s).stamp.expect("stamp")["shadow"], Value::Null);
        versions.insert(routed(&s).version().to_string());
    }
    gw.advance(ms(40)).expect("ticks");
    assert!(gw.http_calls().is_empty(), "no callout for excluded requests");
    let excluded: u64 = versions.iter().map(|v| excluded_total(&gw, v)).sum();
    assert_eq!(excluded, 11);
    for v in &versions {
        assert_eq!(gw.counter(&shadow_total(v, SHADOW, "sampled")), None);
    }
    // Tenants that merely resemble the glob are shadowed.
    for (i, tenant) in ["acme", "banko", "my-bank-x", "Bank-of-x"].iter().enumerate() {
        Req::new(tenant, &format!("in-{i}")).chat().send(&gw);
    }
    gw.advance(ms(20)).expect("tick");
    assert_eq!(gw.http_calls().len(), 4);
    assert_no_crash(&gw);
}

#[test]
fn excluded_is_counted_under_the_shadow_versions_label() {
    let gw = gateway(&demo_shadow_all(8));
    let s = Req::new("bank-of-x", "ex-label").chat().send(&gw);
    let p = routed(&s).version().to_string();
    assert_eq!(gw.counter(&shadow_total(&p, SHADOW, "excluded")), Some(1));
    assert_eq!(gw.counter(&shadow_total(&p, "any", "excluded")), None);
}

#[test]
fn without_exclusions_a_request_without_tenant_is_shadowed() {
    let mut p = demo_shadow_all(8);
    let shadow = p["models"][0]["shadow"].as_object_mut().expect("shadow");
    shadow.remove("exclude_tenants");
    shadow.remove("tenant_header");
    let gw = gateway(&p);
    Req::new("x", "no-tenant").tenant(None).chat().send(&gw);
    Req::new("bank-of-x", "bank").chat().send(&gw);
    gw.advance(ms(20)).expect("tick");
    assert_eq!(gw.http_calls().len(), 2);
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 9. Passive fallback
// ---------------------------------------------------------------------------------------------

#[test]
fn no_healthy_upstream_on_v2_sends_its_tenants_to_v1_for_exactly_10_s() {
    let gw = gateway(&split(90, 10));
    let (v1, v2) = tenants_by_route(&gw, "user", 300);
    assert!(v2.len() >= 10 && v1.len() >= 10);
    let (v2, v1) = (&v2[..10], &v1[..10]);

    // Envoy answers a v2 request itself: the route's cluster has no healthy host.
    let mut s = Req::new(&v2[0], "nhu").send(&gw);
    assert_eq!(routed(&s).route(), ROUTE_V2);
    s.response_headers(&[(":status", "503"), ("content-type", "text/plain")], false).expect("headers");
    s.response_body(b"no healthy upstream", true).expect("body");
    s.set_property(&["response", "code_details"], "no_healthy_upstream");
    s.end().expect("end");
    let marked = gw.now_ns();
    let key = format!("sluice/model-router/unhealthy/{ROUTE_V2}");
    let until = gw.shared_data(&key).expect("the route is marked in shared data");
    assert_eq!(until, (marked + 10 * NS_PER_S).to_le_bytes().to_vec());
    assert_eq!(gw.shared_data(&format!("sluice/model-router/unhealthy/{ROUTE_V1}")), None);

    let check = |phase: &str, fallback: bool| {
        for t in v2 {
            let r = decide_tenant(&gw, t, &format!("{phase}-{t}"));
            if fallback {
                assert_eq!((r.route(), r.version(), r.reason()), (ROUTE_V1, "v1", "fallback"), "{phase}: {t}");
            } else {
                assert_eq!((r.route(), r.version(), r.reason()), (ROUTE_V2, "v2", "weight"), "{phase}: {t}");
            }
        }
        for t in v1 {
            let r = decide_tenant(&gw, t, &format!("{phase}-{t}"));
            assert_eq!((r.route(), r.reason()), (ROUTE_V1, "weight"), "{phase}: v1 tenant {t}");
        }
    };
    check("marked", true);
    gw.advance(Duration::from_nanos(10 * NS_PER_S - 1)).expect("advance");
    check("1 ns before 10 s", true);
    assert_eq!(gw.counter(&requests_total(MODEL, "v1", "fallback")), Some(20));
    gw.advance(Duration::from_nanos(1)).expect("advance");
    check("at 10 s", false);
    assert_eq!(gw.counter(&requests_total(MODEL, "v1", "fallback")), Some(20));
    assert_no_crash(&gw);
}

#[test]
fn other_response_details_do_not_mark_a_route() {
    let gw = gateway(&split(90, 10));
    let (_, v2) = tenants_by_route(&gw, "user", 300);
    for (i, details) in ["via_upstream", "upstream_reset_before_response_started{connection_failure}", "downstream_remote_disconnect"].iter().enumerate() {
        let mut s = Req::new(&v2[0], &format!("d-{i}")).send(&gw);
        s.response_headers(&[(":status", "503")], true).expect("headers");
        s.set_property(&["response", "code_details"], *details);
        s.end().expect("end");
    }
    assert!(gw.shared_data_keys().iter().all(|k| !k.starts_with("sluice/model-router/unhealthy/")), "{:?}", gw.shared_data_keys());
    assert_eq!(decide_tenant(&gw, &v2[0], "after").route(), ROUTE_V2);
    assert_no_crash(&gw);
}

#[test]
fn a_mark_by_another_worker_is_honoured_and_with_every_route_down_nothing_is_routed() {
    let gw = gateway(&split(90, 10));
    let (v1, v2) = tenants_by_route(&gw, "user", 300);
    let until = gw.now_ns() + 5 * NS_PER_S;
    gw.set_shared_data(&format!("sluice/model-router/unhealthy/{ROUTE_V1}"), until.to_le_bytes().to_vec());
    let r = decide_tenant(&gw, &v1[0], "v1-down");
    assert_eq!((r.route(), r.reason()), (ROUTE_V2, "fallback"), "explicit fallback order lists v2");
    gw.set_shared_data(&format!("sluice/model-router/unhealthy/{ROUTE_V2}"), until.to_le_bytes().to_vec());
    let s = Req::new(&v2[0], "all-down").header(ROUTE_HEADER, ROUTE_V2).send(&gw);
    let r = routed(&s);
    assert!(r.routes.is_empty() && r.versions.is_empty(), "no healthy version: no route header: {r:?}");
    assert_eq!(gw.counter(&format!("sluice.router.unrouted_total.reason.no_version.model.{MODEL}")), Some(1));
    assert_no_crash(&gw);
}

// ---------------------------------------------------------------------------------------------
// 10. Configuration errors, unknown models, missing metadata
// ---------------------------------------------------------------------------------------------

#[test]
fn the_demo_policy_loads_as_shipped() {
    let gw = gateway(&demo());
    // No tick while no shadow request waits: an idle tick costs Envoy CPU on every worker.
    assert_eq!(gw.tick_period(), None);
    assert_no_crash(&gw);
}

/// The demo policy changed by `f`.
fn edited(f: impl FnOnce(&mut Value)) -> String {
    let mut p = demo();
    f(&mut p);
    p.to_string()
}

#[test]
fn configuration_errors_are_refused_with_precise_messages() {
    let cases: Vec<(String, &str)> = vec![
        (edited(|p| p["models"] = json!([])), "models: list at least one model"),
        (edited(|p| p["models"][0]["versions"][1]["name"] = json!("v1")), r#"models[0].versions[1].name: version "v1" is listed twice"#),
        (edited(|p| p["models"][0]["versions"][0]["weight"] = json!(1.5)), "models[0].versions[0].weight: must be a whole number 0–1000000, got 1.5"),
        (edited(|p| p["models"][0]["versions"][0]["weight"] = json!(1_000_001)), "models[0].versions[0].weight: must be a whole number 0–1000000, got 1000001"),
        (edited(|p| p["models"][0]["versions"][1]["weight"] = json!(-1)), "models[0].versions[1].weight: must be a whole number 0–1000000, got -1"),
        (
            edited(|p| {
                p["models"][0]["versions"][1]["ramp"] = json!([{"at": "2026-12-01T00:00:00Z", "weight": 5}, {"at": "2026-11-01T00:00:00Z", "weight": 50}])
            }),
            "models[0].versions[1].ramp[1].at: 2026-11-01T00:00:00Z is not after the previous step (2026-12-01T00:00:00Z); steps must be in increasing time",
        ),
        (
            edited(|p| p["models"][0]["versions"][1]["ramp"] = json!([{"at": "2026-12-01 00:00:00", "weight": 5}])),
            r#"models[0].versions[1].ramp[0].at: must be a UTC time YYYY-MM-DDTHH:MM:SSZ between 1970 and 2500, got "2026-12-01 00:00:00""#,
        ),
        (
            edited(|p| {
                p["models"][0]["versions"][0]["weight"] = json!(0);
                p["models"][0]["versions"][1]["weight"] = json!(0);
            }),
            "models[0].versions: every version has weight 0 before any ramp step; at least one must have weight > 0 at all times",
        ),
        (
            edited(|p| p["models"][0]["versions"][0]["route"] = json!("llama v1")),
            r#"models[0].versions[0].route: must be 1–64 of A–Z a–z 0–9 '_' '.' '-', got "llama v1""#,
        ),
        (edited(|p| p["models"][0]["fallback"] = json!(["v1", "v3"])), r#"models[0].fallback[1]: "v3" is not a version of this model"#),
        (edited(|p| p["models"][0]["fallback"] = json!(["v1", "v1"])), r#"models[0].fallback[1]: "v1" is listed twice"#),
        (
            edited(|p| {
                p["models"][0]["shadow"].as_object_mut().expect("shadow").remove("tenant_header");
            }),
            "models[0].shadow.tenant_header: required with exclude_tenants: the header (set by auth in front) that names the tenant",
        ),
        (edited(|p| p["models"][0]["shadow"]["fraction"] = json!(1.5)), "models[0].shadow.fraction: must be 0–1, got 1.5"),
        (edited(|p| p["models"][0]["shadow"]["max_concurrent"] = json!(0)), "models[0].shadow.max_concurrent: must be 1–100000, got 0"),
        (edited(|p| p["models"][0]["shadow"]["version"]["cluster"] = json!("qwen v1")), "models[0].shadow.version.cluster: must not contain whitespace"),
        (
            edited(|p| p["override"]["client_header"] = json!("X-Sluice-Route")),
            r#"override.client_header: "x-sluice-route" is also a header the policy reads or writes; it would be stripped"#,
        ),
        (edited(|p| p["override"] = json!({})), "override: name a trusted property and/or the client_header to strip, or remove override"),
        (edited(|p| p["version_header"] = json!("X-Sluice-Route")), "version_header: must differ from route_header"),
        (edited(|p| p["route_header"] = json!("x route")), r#"route_header: must be an HTTP header name (1–128 token characters), got "x route""#),
        (edited(|p| p["sticky_key"] = json!([])), "sticky_key: list at least one source"),
        (edited(|p| p["sticky_key"] = json!([{"header": "x-a", "api_key": true}])), "sticky_key[0]: set exactly one of header, api_key, property, body_user"),
        (edited(|p| p["sticky_key"] = json!([{"api_key": false}])), "sticky_key[0].api_key: only `true` is meaningful; remove the entry instead"),
        (edited(|p| p["sticky_key"] = json!([{"header": "X-A"}, {"header": "x-a"}])), "sticky_key[1]: the same source is listed twice"),
        (edited(|p| p["sticky_key"] = json!([{"property": ["a", ""]}])), "sticky_key[0].property[1]: must not be empty"),
        (
            edited(|p| {
                let m = p["models"][0].clone();
                p["models"].as_array_mut().expect("models").push(m);
            }),
            r#"models[1].model: "llama-3-70b" is already matched by models[0] (the first match wins)"#,
        ),
        (edited(|p| p["modles"] = json!([])), "unknown field `modles`"),
        (
            edited(|p| {
                p.as_object_mut().expect("policy").remove("models");
            }),
            "missing field `models`",
        ),
        ("{not json".to_string(), "model-router policy is not valid JSON"),
    ];
    for (policy, message) in &cases {
        let error = refusal(policy);
        // A policy that is not JSON makes sluice.wasm's whole configuration not JSON.
        let (words, message) = match serde_json::from_str::<Value>(policy) {
            Err(_) => (common::not_json_refusal("model-router policy refused"), common::not_json_refusal(message)),
            Ok(_) => ("model-router policy refused".to_string(), message.to_string()),
        };
        assert!(error.contains(&words) && error.contains(&message), "policy {policy}\n  expected an error containing {message:?}\n  got {error}");
    }
}

#[test]
fn an_unknown_model_gets_no_routing_headers_and_client_route_headers_are_still_removed() {
    let gw = gateway(&demo_shadow_all(8));
    let body = chat_body("gpt-4o");
    let s = Req::new("acme", "unknown")
        .model(Some("gpt-4o"))
        .header(ROUTE_HEADER, ROUTE_V2)
        .header(VERSION_HEADER, "v2")
        .header(CLIENT_OVERRIDE_HEADER, "v2")
        .body(body.clone())
        .send(&gw);
    let up = s.upstream_request_headers().expect("sent");
    for h in [ROUTE_HEADER, VERSION_HEADER, CLIENT_OVERRIDE_HEADER] {
        assert!(!up.contains(h), "{h} removed: {up:?}");
    }
    assert_eq!(up.get("content-length"), Some(body.len().to_string().as_str()));
    assert_same_bytes(&s.upstream_request_body(), body.as_bytes(), "body untouched");
    assert_eq!(s.filter_state("sluice_route"), None);
    assert_eq!(gw.counter("sluice.router.unrouted_total.reason.unknown_model"), Some(1));
    gw.advance(ms(20)).expect("tick");
    assert!(gw.http_calls().is_empty(), "an unrouted request is not shadowed");
    assert_no_crash(&gw);
}

#[test]
fn a_request_without_model_metadata_is_counted_unrouted_no_model() {
    let gw = gateway(&demo());
    let s = Req::new("acme", "no-model").model(None).header(ROUTE_HEADER, ROUTE_V2).header(CLIENT_OVERRIDE_HEADER, "v2").chat().send(&gw);
    let up = s.upstream_request_headers().expect("sent");
    assert!(!up.contains(ROUTE_HEADER) && !up.contains(VERSION_HEADER) && !up.contains(CLIENT_OVERRIDE_HEADER), "{up:?}");
    assert_same_bytes(&s.upstream_request_body(), chat_body(MODEL).as_bytes(), "body untouched");
    assert_eq!(gw.counter("sluice.router.unrouted_total.reason.no_model"), Some(1));
    assert_eq!(gw.counter("sluice.router.unrouted_total.reason.unknown_model"), None);
    assert!(metrics_with_prefix(&gw, "sluice.router.requests_total").is_empty());
    assert_no_crash(&gw);
}

/// tenant-budget (behind the router) refused the request before the shadow left on the root's
/// tick: the shadow model never sees it, and no comparison waits for it.
#[test]
fn a_request_refused_behind_the_router_is_not_shadowed() {
    let gw = gateway(&demo_shadow_all(8));
    let mut s = Req::new("acme", "refused").force("v2").body(chat_body(MODEL)).send(&gw);
    // What tenant-budget leaves when it answers 429 itself.
    s.set_property(&["sluice_gateway_reply"], "429 refused");
    s.end().expect("end");
    gw.advance(ms(40)).expect("tick");
    assert!(gw.http_calls().is_empty(), "no shadow sent");
    let refused: Vec<String> = gw.metric_names().into_iter().filter(|n| n.contains("shadow_total") && n.ends_with("result.refused")).collect();
    assert_eq!(refused.len(), 1, "{:?}", gw.metric_names());
    assert_eq!(gw.counter(&refused[0]), Some(1));
    assert_no_crash(&gw);

    // Admitted requests are still shadowed.
    let mut t = Req::new("acme", "admitted").force("v2").body(chat_body(MODEL)).send(&gw);
    gw.advance(ms(40)).expect("tick");
    assert_eq!(gw.http_calls().len(), 1);
    t.end().expect("end");
}
