//! Security boundaries of the shipped gateways, in real Envoy (issue 14, item 5; the threat model is
//! docs/security.md, which names these tests):
//!
//! - identity: a client cannot be charged, classified or labelled as another tenant or key through
//!   any identity source the shipped policies use — the trusted tenant header (`x-sluice-tenant`,
//!   which the demo gateways let a client set: the deployment's auth filter must overwrite it) in
//!   duplicated, case- and whitespace-varied forms; a forged JWT payload header with no jwt_authn in
//!   front; another tenant's API key under another header name; `authorization: Bearer` with odd
//!   spacing. What the gateway did is read from the budget stamp's `key`, the other stamps and the
//!   charged counters, and refused requests are looked for at the upstream (the mock records every
//!   request head it reads, with its headers).
//! - API keys are never written: distinctive keys (admitted, refused, malformed, with broken bodies,
//!   upstream errors and resets) are looked for in Envoy's log output (plugins at debug), the access
//!   log, `/stats/prometheus`, `/stats`, every response the client got and every header and ledger
//!   record the upstream got; the key may reach the upstream only in the header the client sent it
//!   in, for a request the gateway admitted.
//! - label injection: tenant, model, version and user values with Prometheus syntax, Envoy tag
//!   separators, spaces and unicode leave `/stats/prometheus` parseable with every sluice label
//!   value inside `[A-Za-z0-9_-]` and within its bound, and mint no metric name.
//! - internal headers (`x-sluice-route`, `x-model-version`, `x-sluice-force-version`,
//!   `x-sluice-shadow`, …) sent by a client never reach the upstream and change no decision.
//! - shadows: with every request shadowed, the client's bytes come from the primary — when the shadow
//!   answers first and when the shadow's cluster is down.
//!
//! Skipped when Envoy is not installed (unless `SLUICE_ENVOY`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use sluice_core::identity::sha256_hex;
use sluice_e2e::access_log::stamp;
use sluice_e2e::gateway::{full_gateway_policy, shipped, start_budget_gateway, start_full_gateway, yaml_string_body, FullGateway};
use sluice_e2e::{base64url, get, post_stream, wait_until, Checks, Connection, Envoy, MockHead, MockServer, StreamedResponse, Tools};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

const CHAT: &str = "/v1/chat/completions";
const MESSAGES: &str = "/v1/messages";

fn chat(stream: bool, model: &str, content: &str) -> String {
    json!({
        "model": model,
        "stream": stream,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": content}],
    })
    .to_string()
}

/// Sends one request on a new connection, headers written exactly as given (names, case,
/// duplicates, whitespace), and reads the whole response.
fn send(envoy: &Envoy, path: &str, headers: &[(&str, &str)], body: &str) -> StreamedResponse {
    post_stream(envoy.listen_addr(), path, headers, body).unwrap().collect().unwrap()
}

/// The access-log line of request `id` and the stamps in it (`budget`, `sluice`, `route`, `latency`).
struct Line {
    line: Value,
}

impl Line {
    fn of(envoy: &Envoy, id: &str) -> Line {
        Line { line: envoy.access_log().wait_for_request(id, Duration::from_secs(10)).unwrap() }
    }
    fn stamp(&self, field: &str) -> Value {
        stamp(&self.line, field).unwrap().unwrap_or(Value::Null)
    }
}

/// (request id, identity header lines, the key it must be charged to — `None`: refused 401).
type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, Option<&'a str>);
/// (request id, path, headers, body, whether the gateway admits it).
type KeyRequest<'a> = (&'a str, &'a str, Vec<(&'a str, &'a str)>, &'a str, bool);

fn heads_of<'a>(heads: &'a [MockHead], id: &str) -> Vec<&'a MockHead> {
    heads.iter().filter(|h| h.request_id.as_deref() == Some(id)).collect()
}

/// Every mock head of the full gateway's two model versions.
fn primary_heads(gw: &FullGateway) -> Vec<MockHead> {
    let mut heads = gw.v1.heads().unwrap();
    heads.extend(gw.v2.heads().unwrap());
    heads
}

/// `sluice_budget_charged_tokens_total` per `key`.
fn charged_by_key(envoy: &Envoy) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for s in envoy.metrics().unwrap().series("sluice_budget_charged_tokens_total") {
        *out.entry(s.labels.get("key").cloned().unwrap_or_default()).or_insert(0.0) += s.value;
    }
    out
}

/// latency-guard's class of each tenant of policies/latency-guard.demo.json.
fn demo_class(tenant: &str) -> &'static str {
    match tenant {
        "acme" => "interactive",
        t if t.starts_with("bank-") => "interactive",
        t if t.starts_with("batch-") => "batch",
        _ => "standard",
    }
}

// ---------------------------------------------------------------------------------------------
// Identity
// ---------------------------------------------------------------------------------------------

/// The full gateway names the tenant by `x-sluice-tenant` for all four plugins
/// (policies/*.full.json / *.demo.json). No auth filter is in front, so a client *chooses* its
/// tenant here by design — the deployment's auth filter must overwrite the header (docs/security.md).
/// What holds without it: a header name in any case is the same header, surrounding spaces and tabs
/// are trimmed, the value is then matched exactly (case, commas, inner spaces refused), and a request
/// carrying the header twice is refused, so no copy can pick a more favourable tenant for one plugin
/// than another.
#[test]
fn tenant_header_variants_name_one_tenant_for_every_plugin_or_are_refused() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let gw = start_full_gateway(&["--tokens", "4"], &[]).unwrap();
    // (request id, tenant header lines, the key it must be charged to — None: refused 401).
    let cases: Vec<Case> = vec![
        ("id-plain", vec![("x-sluice-tenant", "globex")], Some("globex")),
        ("id-upper-name", vec![("X-SLUICE-TENANT", "globex")], Some("globex")),
        ("id-mixed-name", vec![("X-Sluice-Tenant", "globex")], Some("globex")),
        ("id-spaces-tabs", vec![("x-sluice-tenant", " \t globex \t ")], Some("globex")),
        ("id-value-case", vec![("x-sluice-tenant", "GLOBEX")], None),
        ("id-value-mixed-case", vec![("x-sluice-tenant", "Acme")], None),
        ("id-comma-list", vec![("x-sluice-tenant", "globex,acme")], None),
        ("id-comma-space-list", vec![("x-sluice-tenant", "globex, acme")], None),
        ("id-inner-space", vec![("x-sluice-tenant", "glo bex")], None),
        ("id-empty", vec![("x-sluice-tenant", "")], None),
        ("id-unicode-lookalike", vec![("x-sluice-tenant", "acmе")], None), // Cyrillic е
        // Two copies: refused, whichever comes first and whatever their case.
        ("id-dup-globex-acme", vec![("x-sluice-tenant", "globex"), ("x-sluice-tenant", "acme")], None),
        ("id-dup-acme-globex", vec![("x-sluice-tenant", "acme"), ("x-sluice-tenant", "globex")], None),
        ("id-dup-case", vec![("x-sluice-tenant", "globex"), ("X-Sluice-Tenant", "acme")], None),
        ("id-dup-same", vec![("x-sluice-tenant", "acme"), ("x-sluice-tenant", "acme")], None),
        ("id-dup-empty-first", vec![("x-sluice-tenant", ""), ("x-sluice-tenant", "acme")], None),
    ];
    let mut c = Checks::default();
    let mut stamped: BTreeMap<String, u64> = BTreeMap::new();
    for (id, tenant_headers, want) in &cases {
        let mut h = vec![("x-request-id", *id)];
        h.extend(tenant_headers.iter().copied());
        let resp = send(&gw.envoy, CHAT, &h, &chat(false, "llama-3-70b", "who am I"));
        let line = Line::of(&gw.envoy, id);
        let (budget, llm, latency) = (line.stamp("budget"), line.stamp("sluice"), line.stamp("latency"));
        let upstream = heads_of(&primary_heads(&gw), id).len();
        match want {
            Some(key) => {
                c.eq(&format!("{id}: status"), &json!(resp.status), json!(200));
                c.eq(&format!("{id}: budget.key"), &budget["key"], json!(key));
                c.eq(&format!("{id}: llm.tenant"), &llm["tenant"], json!(key));
                c.eq(&format!("{id}: latency.class"), &latency["class"], json!(demo_class(key)));
                c.eq(&format!("{id}: upstream heads"), &json!(upstream), json!(1));
                *stamped.entry((*key).to_string()).or_insert(0) += budget["charged_tokens"].as_u64().unwrap_or(0);
            }
            None => {
                c.eq(&format!("{id}: status"), &json!(resp.status), json!(401));
                let body: Value = serde_json::from_slice(&resp.body()).unwrap_or(Value::Null);
                c.that(
                    body["error"]["code"] == json!("unknown_key") || body["error"]["code"] == json!("ambiguous_identity"),
                    format!("{id}: error code: {body}"),
                );
                c.eq(&format!("{id}: budget.decision"), &budget["decision"], json!("rejected"));
                c.that(budget.get("key").is_none(), format!("{id}: a refused request is stamped with a key: {budget}"));
                c.eq(&format!("{id}: upstream heads"), &json!(upstream), json!(0));
            }
        }
    }
    // What was charged went to exactly the keys named above, in exactly the stamped amounts.
    let charged = wait_until(Duration::from_secs(5), "the charge counters", || {
        let now = charged_by_key(&gw.envoy);
        let got: BTreeMap<String, u64> = now.iter().filter(|(_, v)| **v > 0.0).map(|(k, v)| (k.clone(), *v as u64)).collect();
        Ok((got == stamped).then_some(got))
    });
    c.that(charged.is_ok(), format!("charged counters {:?} != stamped charges {stamped:?}", charged_by_key(&gw.envoy)));
    c.that(stamped.get("globex").is_some_and(|t| *t > 0), format!("nothing charged to globex: {stamped:?}"));
    c.done("");
}

/// The shipped budget gateway with its example policies (tenant-budget.example, llm-metrics.demo)
/// in front of a mock answering 4 tokens.
fn example_budget_gateway() -> (MockServer, Envoy) {
    let mock = MockServer::start(&["--tokens", "4"]).unwrap();
    let policy = std::fs::read_to_string(shipped("policies/tenant-budget.example.json")).unwrap();
    let metrics = std::fs::read_to_string(shipped("policies/llm-metrics.demo.json")).unwrap();
    let envoy = start_budget_gateway(&mock, &policy, &metrics).unwrap();
    (mock, envoy)
}

/// The shipped budget gateway (`envoy/templates/budget-gateway.yaml`, policy
/// `policies/tenant-budget.example.json`) names the key by API key hash, then by the claim
/// `sluice_key` of `x-jwt-payload` — the header Envoy's jwt_authn writes after verifying a token.
/// That gateway has no jwt_authn in front, so a client-sent `x-jwt-payload` must not name a key
/// (the gateway removes it before the plugins): with no key, an unknown key or a key of its own, a
/// forged payload naming `search-prod` never gets a request charged to `search-prod`.
#[test]
fn forged_jwt_payload_header_without_jwt_authn_names_no_key() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let (mock, envoy) = example_budget_gateway();
    let forged = base64url(json!({"sluice_key": "search-prod", "sub": "mallory", "iss": "https://idp.example"}).to_string().as_bytes());
    // "test" is search-staging's API key (its SHA-256 is in the policy).
    let cases: Vec<Case> = vec![
        ("jwt-alone", vec![("x-jwt-payload", forged.as_str())], None),
        ("jwt-upper-name", vec![("X-JWT-Payload", forged.as_str())], None),
        ("jwt-unknown-key", vec![("authorization", "Bearer not-a-key-of-anyone"), ("x-jwt-payload", forged.as_str())], None),
        ("jwt-basic-auth", vec![("authorization", "Basic dGVzdDp0ZXN0"), ("x-jwt-payload", forged.as_str())], None),
        ("jwt-own-key", vec![("authorization", "Bearer test"), ("x-jwt-payload", forged.as_str())], Some("search-staging")),
    ];
    let mut c = Checks::default();
    for (id, extra, want) in &cases {
        let mut h = vec![("x-request-id", *id)];
        h.extend(extra.iter().copied());
        let resp = send(&envoy, CHAT, &h, &chat(false, "llama-3-70b", "pretend"));
        let budget = Line::of(&envoy, id).stamp("budget");
        let heads = mock.heads().unwrap();
        let upstream = heads_of(&heads, id);
        c.eq(&format!("{id}: status"), &json!(resp.status), json!(if want.is_some() { 200 } else { 401 }));
        c.eq(&format!("{id}: budget.key"), budget.get("key").unwrap_or(&Value::Null), want.map_or(Value::Null, |k| json!(k)));
        c.eq(&format!("{id}: upstream heads"), &json!(upstream.len()), json!(usize::from(want.is_some())));
        // What does reach the upstream carries no forged payload either.
        for head in upstream {
            c.that(head.values("x-jwt-payload").is_empty(), format!("{id}: the upstream got x-jwt-payload: {:?}", head.headers));
        }
    }
    let charged = charged_by_key(&envoy);
    c.that(charged.get("search-prod").copied().unwrap_or(0.0) == 0.0, format!("search-prod was charged: {charged:?}"));
    c.done(&format!("Envoy stderr:\n{}", envoy.stderr_tail(20)));
}

/// The same gateway's API-key source: `authorization: Bearer` with odd spacing and case still names
/// the key whose hash matches; the key under any other header name, without the scheme, joined
/// to the scheme, or followed by more text names none; `authorization` wins over `x-api-key`
/// (documented order), so sending another key beside one's own is charged to one's own; two
/// `authorization` lines are refused.
#[test]
fn api_key_spacing_and_header_names_resolve_only_the_documented_sources() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let (mock, envoy) = example_budget_gateway();
    let staging = Some("search-staging");
    let cases: Vec<Case> = vec![
        ("key-plain", vec![("authorization", "Bearer test")], staging),
        ("key-many-spaces", vec![("authorization", "Bearer      test   ")], staging),
        ("key-tabs", vec![("authorization", "bearer\t\ttest\t")], staging),
        ("key-leading-ws", vec![("authorization", " \tBEARER test")], staging),
        ("key-upper-name", vec![("AUTHORIZATION", "Bearer test")], staging),
        ("key-x-api-key", vec![("x-api-key", "  test ")], staging),
        ("key-x-api-key-upper", vec![("X-API-KEY", "test")], staging),
        ("key-joined", vec![("authorization", "Bearertest")], None),
        ("key-no-scheme", vec![("authorization", "test")], None),
        ("key-trailing-text", vec![("authorization", "Bearer test extra")], None),
        ("key-value-case", vec![("authorization", "Bearer TEST")], None),
        ("key-other-name-1", vec![("api-key", "test")], None),
        ("key-other-name-2", vec![("x-sluice-key", "test")], None),
        ("key-other-name-3", vec![("proxy-authorization", "Bearer test")], None),
        ("key-other-name-4", vec![("x-api-token", "test")], None),
        ("key-unknown-bearer-then-x-api-key", vec![("authorization", "Bearer nobody"), ("x-api-key", "test")], None),
        ("key-own-bearer-other-x-api-key", vec![("authorization", "Bearer test"), ("x-api-key", "someone-elses-key")], staging),
        ("key-two-authorization-lines", vec![("authorization", "Bearer nobody"), ("authorization", "Bearer test")], None),
        ("key-two-authorization-lines-same", vec![("authorization", "Bearer test"), ("authorization", "Bearer test")], None),
    ];
    let mut c = Checks::default();
    for (id, extra, want) in &cases {
        // model-router's headers too: with no router in this gateway, nothing would overwrite them.
        let mut h = vec![("x-request-id", *id), ("x-model-version", "v-forged"), ("x-sluice-route", "llama-v2")];
        h.extend(extra.iter().copied());
        let resp = send(&envoy, CHAT, &h, &chat(false, "llama-3-70b", "key check"));
        let line = Line::of(&envoy, id);
        let budget = line.stamp("budget");
        let heads = mock.heads().unwrap();
        let upstream = heads_of(&heads, id);
        c.eq(&format!("{id}: status"), &json!(resp.status), json!(if want.is_some() { 200 } else { 401 }));
        c.eq(&format!("{id}: budget.key"), budget.get("key").unwrap_or(&Value::Null), want.map_or(Value::Null, |k| json!(k)));
        c.eq(&format!("{id}: upstream heads"), &json!(upstream.len()), json!(usize::from(want.is_some())));
        // Admitted: labelled by the body's model; refused before the body: by nothing — never the forgery.
        let version = line.stamp("sluice")["model_version"].clone();
        c.that(if want.is_some() { version == json!("llama-3-70b") } else { version != json!("v-forged") }, format!("{id}: llm.model_version {version}"));
        for head in upstream {
            for name in ["x-model-version", "x-sluice-route"] {
                c.that(head.values(name).is_empty(), format!("{id}: the client's {name} reached the upstream: {:?}", head.values(name)));
            }
        }
    }
    c.done("");
}

// ---------------------------------------------------------------------------------------------
// API keys are never written
// ---------------------------------------------------------------------------------------------

const KEY_ALPHA: &str = "sk-sluicetest-alpha-Q7x2Vb9LmZp4";
const KEY_TINY: &str = "sk-sluicetest-tiny-R3n8Kd1WqYs6";
const KEY_UNKNOWN: &str = "sk-sluicetest-unknown-H5c0Tj7PfXa2";
/// Distinctive parts of every test key: none may appear anywhere the gateway writes.
const MARKERS: &[&str] = &["Q7x2Vb9LmZp4", "R3n8Kd1WqYs6", "H5c0Tj7PfXa2", "M9w4Ge6UoBz1", "sluicetest"];

/// tenant-budget naming keys by API key hash (and per-identity budgets by it), llm-metrics behind it;
/// Envoy with the plugins' log level at debug, so everything they log is in the file searched.
#[test]
fn api_keys_appear_nowhere_the_gateway_writes() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let mock = MockServer::start(&["--tokens", "6"]).unwrap();
    let policy = json!({
        "mode": "strict",
        "identity": {"api_key": true, "per_identity": {"api_key": true}},
        "unknown": {"action": "reject"},
        "default_max_output_tokens": 64,
        "prices": [{"model": "*", "input_usd_per_mtok": 1.0, "output_usd_per_mtok": 2.0}],
        "orgs": [{"id": "org-a", "teams": [{"id": "team-a", "keys": [
            {"id": "alpha", "api_key_sha256": sha256_hex(KEY_ALPHA.as_bytes()),
             "budgets": [{"window": "minute", "tokens": 1000000}],
             "identity_budgets": [{"window": "minute", "requests": 1000}]},
            {"id": "tiny", "api_key_sha256": sha256_hex(KEY_TINY.as_bytes()), "budgets": [{"window": "minute", "requests": 1}]}
        ]}]}]
    })
    .to_string();
    let metrics = std::fs::read_to_string(shipped("policies/llm-metrics.demo.json")).unwrap();
    let upstream = mock.port().to_string();
    let (budget, metrics_yaml) = (yaml_string_body(&policy), yaml_string_body(&metrics));
    let envoy = Envoy::start_with_args(
        &shipped("envoy/templates/budget-gateway.yaml"),
        &[("UPSTREAM_PORT", upstream.as_str()), ("BUDGET_CONFIG", budget.as_str()), ("PLUGIN_CONFIG", metrics_yaml.as_str())],
        &["--component-log-level", "wasm:debug"],
    )
    .unwrap();
    let bearer = |k: &str| format!("Bearer {k}");
    let (alpha, tiny, unknown) = (bearer(KEY_ALPHA), bearer(KEY_TINY), bearer(KEY_UNKNOWN));
    let long_key = format!("Bearer {}{}", KEY_ALPHA, "x".repeat(1100));
    let spaced_key = format!("Bearer {KEY_ALPHA} M9w4Ge6UoBz1");
    let unicode_key = format!("Bearer {KEY_ALPHA}é");
    let token_scheme = format!("Token {KEY_ALPHA}");
    let (alpha, tiny, unknown, long_key, spaced_key, unicode_key) =
        (alpha.as_str(), tiny.as_str(), unknown.as_str(), long_key.as_str(), spaced_key.as_str(), unicode_key.as_str());
    let ok = chat(false, "llama-3-70b", "keys stay secret");
    let streamed = chat(true, "llama-3-70b", "keys stay secret, streamed");
    let anthropic = json!({"model": "claude-3-5-sonnet", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let (ok, streamed, anthropic) = (ok.as_str(), streamed.as_str(), anthropic.as_str());
    // (request id, path, headers, body, whether the gateway admits it)
    let requests: Vec<KeyRequest> = vec![
        ("k-alpha", CHAT, vec![("authorization", alpha)], ok, true),
        ("k-alpha-stream", CHAT, vec![("authorization", alpha)], streamed, true),
        ("k-alpha-x-api-key", MESSAGES, vec![("x-api-key", KEY_ALPHA), ("anthropic-version", "2023-06-01")], anthropic, true),
        ("k-alpha-upstream-500", CHAT, vec![("authorization", alpha), ("x-mock-fail", "status:500")], ok, true),
        ("k-alpha-upstream-reset", CHAT, vec![("authorization", alpha), ("x-mock-fail", "reset-after:2")], streamed, true),
        ("k-alpha-not-json", CHAT, vec![("authorization", alpha)], "{not json", false),
        ("k-alpha-no-body", CHAT, vec![("authorization", alpha)], "", false),
        ("k-alpha-gzip", CHAT, vec![("authorization", alpha), ("content-encoding", "gzip")], ok, false),
        ("k-tiny-1", CHAT, vec![("authorization", tiny)], ok, true),
        ("k-tiny-2", CHAT, vec![("authorization", tiny)], ok, false),
        ("k-unknown", CHAT, vec![("authorization", unknown)], ok, false),
        ("k-unknown-x-api-key", MESSAGES, vec![("x-api-key", KEY_UNKNOWN)], anthropic, false),
        ("k-too-long", CHAT, vec![("authorization", long_key)], ok, false),
        ("k-inner-space", CHAT, vec![("authorization", spaced_key)], ok, false),
        ("k-unicode", CHAT, vec![("authorization", unicode_key)], ok, false),
        ("k-wrong-scheme", CHAT, vec![("authorization", token_scheme.as_str())], ok, false),
    ];
    let mut c = Checks::default();
    let mut client_saw = String::new();
    for (id, path, extra, body, admitted) in &requests {
        let mut h = vec![("x-request-id", *id)];
        h.extend(extra.iter().copied());
        let resp = send(&envoy, path, &h, body);
        let good = (200..300).contains(&resp.status) || id.contains("upstream");
        c.that(good == *admitted, format!("{id}: status {} but admitted = {admitted}: {}", resp.status, resp.text()));
        client_saw.push_str(&format!("{id} {}\n", resp.status));
        for (n, v) in &resp.headers {
            client_saw.push_str(&format!("{n}: {v}\n"));
        }
        client_saw.push_str(&resp.text());
        client_saw.push('\n');
    }
    envoy.access_log().wait_for(requests.len(), Duration::from_secs(10)).unwrap();
    // Let the stats flush (1 s) and the log flush (100 ms) catch up with the last request.
    std::thread::sleep(Duration::from_millis(1200));

    let stderr = std::fs::read_to_string(envoy.dir().join("envoy.stderr")).unwrap();
    let written: Vec<(&str, String)> = vec![
        ("Envoy's log output", stderr.clone()),
        ("the access log", std::fs::read_to_string(envoy.access_log().path()).unwrap()),
        ("/stats/prometheus", envoy.stats_prometheus().unwrap()),
        ("/stats", envoy.admin_get("/stats").unwrap()),
        ("/stats?format=json", envoy.admin_get("/stats?format=json").unwrap()),
        ("what the client got", client_saw),
        ("the upstream's ledger", get(mock.addr(), "/mock/requests").unwrap().text()),
    ];
    for (place, text) in &written {
        for m in MARKERS {
            if let Some(at) = text.find(m) {
                let start = text[..at].char_indices().rev().nth(80).map_or(0, |(i, _)| i);
                let context: String = text[start..].chars().take(200).collect();
                c.that(false, format!("{place} holds key material {m:?}: …{context}…"));
            }
        }
    }
    // The test can fail: the plugins did log at debug, and the files are not empty.
    c.that(stderr.contains("sluice"), format!("no plugin log line in Envoy's output:\n{stderr}"));

    // The upstream: the key only in the header the client sent it in, only for admitted requests.
    // The mock also records the test's own reads of it (`/mock/…`): only inference requests count.
    let heads: Vec<MockHead> = mock.heads().unwrap().into_iter().filter(|h| h.path.starts_with("/v1/")).collect();
    for head in &heads {
        let id = head.request_id.clone().unwrap_or_default();
        let admitted = requests.iter().any(|(rid, _, _, _, a)| *rid == id && *a);
        c.that(admitted, format!("the upstream got a head of a request the gateway refused: {id}"));
        let sent: Vec<(&str, &str)> = requests.iter().find(|(rid, ..)| *rid == id).map(|r| r.2.clone()).unwrap_or_default();
        c.that(MARKERS.iter().all(|m| !head.path.contains(m)), format!("{id}: key in the upstream path {}", head.path));
        for (name, value) in &head.headers {
            if MARKERS.iter().any(|m| value.contains(m) || name.contains(m)) {
                let as_sent = sent.iter().any(|(n, v)| n.eq_ignore_ascii_case(name) && v.trim() == value);
                c.that(as_sent && (name == "authorization" || name == "x-api-key"), format!("{id}: key material in upstream header {name}: {value}"));
            }
        }
    }
    c.eq("upstream heads", &json!(heads.len()), json!(requests.iter().filter(|r| r.4).count()));
    c.done(&format!("access log dir: {}", envoy.dir().display()));
}

// ---------------------------------------------------------------------------------------------
// Label injection
// ---------------------------------------------------------------------------------------------

/// Values that try to break out of a Prometheus label (`"`, `}`, `{`, `\n`, `=`, `,`) or to add an
/// Envoy tag (`.tenant.x`), plus spaces and unicode. Each contains `evil`, so a metric *name*
/// holding one is easy to spot.
const INJECTIONS: &[&str] = &[
    "evil\"} 1\nsluice_forged{a=\"b",
    "evil}",
    "evil{x=\"y\"}",
    "evil=1,tenant=acme",
    "evil.tenant.acme.model_version.v1",
    "evil model",
    "evil-ünïcødé-模型",
    "evil\ttab",
    "evil\\\"",
];

/// Envoy's `--concurrency` in the e2e harness: one VM per worker.
const WORKERS: usize = 2;

fn is_label_safe(v: &str) -> bool {
    !v.is_empty() && v.len() <= 64 && v.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// Checks a scrape: parseable, every `sluice_*` label value (but `le`) inside `[A-Za-z0-9_-]`, no
/// metric name holding an injected value; returns the distinct values of each label.
fn check_scrape(c: &mut Checks, text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut values: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let metrics = match sluice_e2e::prometheus::Metrics::parse(text) {
        Ok(m) => m,
        Err(e) => {
            c.that(false, format!("/stats/prometheus does not parse: {e:#}"));
            return values;
        }
    };
    for s in metrics.samples.iter().filter(|s| s.name.starts_with("sluice_")) {
        c.that(!s.name.contains("evil") && !s.name.contains("forged"), format!("a metric name holds an injected value: {}", s.name));
        for (k, v) in &s.labels {
            if k != "le" {
                c.that(is_label_safe(v), format!("{}: label {k}={v:?} outside [A-Za-z0-9_-]{{1,64}}", s.name));
                values.entry(k.clone()).or_default().insert(v.clone());
            }
        }
    }
    c.that(!text.lines().any(|l| l.starts_with("sluice_forged")), "a forged series is in the exposition".into());
    values
}

/// The budget gateway with charges labelled by `model_version` (configured `v1` + 2 dynamic) and
/// llm-metrics' `tenant` (`acme` only) and `model_version` (`v1` + 2 dynamic), every unknown key
/// charged to a default key so that injected requests are admitted and charged.
#[test]
fn injected_label_values_stay_inside_the_charset_and_the_bounds() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let mock = MockServer::start(&["--tokens", "3"]).unwrap();
    let policy = json!({
        "identity": {"header": "x-sluice-key"},
        "unknown": {"action": "default", "key": "fallback"},
        "default_max_output_tokens": 16,
        "model_versions": ["v1"],
        "max_dynamic_model_versions": 2,
        "orgs": [{"id": "org-x", "teams": [{"id": "team-x", "keys": [{"id": "named"}, {"id": "fallback"}]}]}]
    })
    .to_string();
    let metrics = json!({
        "path_prefixes": ["/v1/"],
        "model_version_header": "x-model-version",
        "model_versions": ["v1"],
        "max_dynamic_model_versions": 2,
        "tenant": {"header": "x-sluice-tenant"},
        "tenants": ["acme"]
    })
    .to_string();
    let envoy = start_budget_gateway(&mock, &policy, &metrics).unwrap();
    let mut c = Checks::default();
    let mut n = 0;
    for v in INJECTIONS {
        // Header values cannot hold control characters: those go in the body only.
        let header_safe: String = v.chars().filter(|c| !c.is_control()).collect();
        for (tenant, version, model, user) in [
            (header_safe.as_str(), "v1", "llama-3-70b", "u"),
            ("acme", header_safe.as_str(), "llama-3-70b", "u"),
            ("acme", "", *v, *v),
            (header_safe.as_str(), header_safe.as_str(), *v, *v),
        ] {
            n += 1;
            let id = format!("inject-{n}");
            let mut h = vec![("x-request-id", id.as_str()), ("x-sluice-tenant", tenant), ("x-sluice-key", tenant)];
            if !version.is_empty() {
                h.push(("x-model-version", version));
            }
            let body = json!({"model": model, "user": user, "max_tokens": 8, "messages": [{"role": "user", "content": *v}]}).to_string();
            let resp = send(&envoy, CHAT, &h, &body);
            c.that(resp.status == 200, format!("{id}: status {} {}", resp.status, resp.text()));
        }
    }
    envoy.access_log().wait_for(n, Duration::from_secs(10)).unwrap();
    std::thread::sleep(Duration::from_millis(1200));
    let text = envoy.stats_prometheus().unwrap();
    let values = check_scrape(&mut c, &text);
    let allowed_tenants: BTreeSet<String> = ["acme", "other", "anonymous"].iter().map(|s| s.to_string()).collect();
    let tenants = values.get("tenant").cloned().unwrap_or_default();
    c.that(tenants.is_subset(&allowed_tenants) && tenants.contains("other"), format!("tenant labels {tenants:?}"));
    // Per metric: v1, the dynamic versions, `other`. The dynamic set is each plugin's own, per VM
    // (first come first served), and Envoy runs one VM per worker: at most 2 × 2 here.
    let metrics = sluice_e2e::prometheus::Metrics::parse(&text).unwrap();
    let mut per_name: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for s in metrics.samples.iter().filter(|s| s.name.starts_with("sluice_")) {
        if let Some(v) = s.labels.get("model_version") {
            per_name.entry(s.name.as_str()).or_default().insert(v.as_str());
        }
    }
    for (name, versions) in &per_name {
        let dynamic = versions.iter().filter(|v| !["v1", "other"].contains(*v)).count();
        c.that(dynamic <= 2 * WORKERS, format!("{name}: model_version labels beyond the bound: {versions:?}"));
    }
    let versions = values.get("model_version").cloned().unwrap_or_default();
    c.that(versions.contains("other"), format!("no version fell to `other`, so the bound was not reached: {versions:?}"));
    let keys = values.get("key").cloned().unwrap_or_default();
    c.that(keys.iter().all(|k| k == "named" || k == "fallback"), format!("key labels {keys:?}"));
    c.that(charged_by_key(&envoy).get("fallback").is_some_and(|t| *t > 0.0), "the injected requests were not charged".into());
    c.done("");
}

/// The full gateway with its shipped policies, but for tenant-budget's, which charges unknown
/// tenants to a default key so that injected tenants get past it: tenants, models, versions and
/// users with injected values pass every plugin's labels (the router's `model` and `version`, the
/// guard's `class`, the budget's `key`, llm-metrics' labels) without leaving the charset, minting a
/// name, or passing their bound.
#[test]
fn injected_values_through_the_full_chain_leave_the_exposition_well_formed() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let budget = json!({
        "identity": {"header": "x-sluice-tenant"},
        "unknown": {"action": "default", "key": "anyone"},
        "default_max_output_tokens": 16,
        "orgs": [{"id": "org-x", "teams": [{"id": "team-x", "keys": [{"id": "acme", "budgets": [{"window": "minute", "tokens": 1000000}]}, {"id": "anyone"}]}]}]
    })
    .to_string();
    let gw = start_full_gateway(&["--tokens", "3"], &[("BUDGET_CONFIG", budget.as_str())]).unwrap();
    let mut c = Checks::default();
    let mut n = 0;
    for v in INJECTIONS {
        let header_safe: String = v.chars().filter(|c| !c.is_control()).collect();
        for (tenant, model) in [(header_safe.as_str(), "llama-3-70b"), ("acme", *v), (header_safe.as_str(), *v)] {
            n += 1;
            let id = format!("full-inject-{n}");
            let h = [("x-request-id", id.as_str()), ("x-sluice-tenant", tenant), ("x-model-version", header_safe.as_str())];
            let body = json!({"model": model, "user": *v, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}).to_string();
            let resp = send(&gw.envoy, CHAT, &h, &body);
            c.that(resp.status == 200, format!("{id}: status {} {}", resp.status, resp.text()));
        }
    }
    gw.envoy.access_log().wait_for(n, Duration::from_secs(10)).unwrap();
    std::thread::sleep(Duration::from_millis(1200));
    let values = check_scrape(&mut c, &gw.envoy.stats_prometheus().unwrap());
    let bounded = |label: &str, allowed: &[&str]| {
        let got = values.get(label).cloned().unwrap_or_default();
        (got.iter().all(|v| allowed.contains(&v.as_str())), got)
    };
    for (label, allowed) in [
        ("tenant", &["acme", "globex", "other", "anonymous"][..]),
        ("class", &["interactive", "batch", "standard"][..]),
        ("version", &["v1", "v2"][..]),
        ("model", &["llama-3-70b"][..]),
        ("key", &["acme", "anyone"][..]),
    ] {
        let (ok, got) = bounded(label, allowed);
        c.that(ok, format!("{label} labels outside {allowed:?}: {got:?}"));
    }
    c.that(charged_by_key(&gw.envoy).get("anyone").is_some_and(|t| *t > 0.0), "the injected tenants were not charged".into());
    // The injected tenants did reach the labels — as `other`.
    c.that(values.get("tenant").is_some_and(|t| t.contains("other")), format!("no tenant labelled `other`: {:?}", values.get("tenant")));
    // llm-metrics' model_version: v1, v2, at most 16 dynamic (the demo config), other.
    let versions = values.get("model_version").cloned().unwrap_or_default();
    c.that(versions.len() <= 2 + 16 * WORKERS + 1, format!("model_version labels: {versions:?}"));
    c.done("");
}

// ---------------------------------------------------------------------------------------------
// Internal headers
// ---------------------------------------------------------------------------------------------

/// Every internal header a plugin writes or reads for a decision, with client values.
fn forged_internal_headers(route: &'static str, version: &'static str) -> Vec<(&'static str, &'static str)> {
    vec![
        ("x-sluice-route", route),
        ("X-Sluice-Route", route),
        ("x-model-version", version),
        ("X-Model-Version", "v9"),
        ("x-sluice-force-version", version),
        ("x-sluice-shadow", "1"),
        ("x-sluice-budget-warning", "forged"),
        ("x-sluice-clamped-max-tokens", "1"),
        ("x-sluice-deadline", "forged"),
        ("x-sluice-refused-by", "forged"),
    ]
}

/// Internal headers that only a plugin may write on the upstream request, and the values it wrote.
const WRITTEN_BY_THE_ROUTER: &[&str] = &["x-sluice-route", "x-model-version"];
/// Internal headers no upstream request of a client may carry.
const NEVER_UPSTREAM: &[&str] =
    &["x-sluice-force-version", "x-sluice-shadow", "x-sluice-budget-warning", "x-sluice-clamped-max-tokens", "x-sluice-deadline", "x-sluice-refused-by"];

#[test]
fn client_internal_headers_never_reach_the_upstream_nor_change_a_decision() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let gw = start_full_gateway(&["--tokens", "4"], &[]).unwrap();
    let mut c = Checks::default();
    for tenant in ["acme", "globex", "batch-nightly"] {
        for stream in [false, true] {
            let base_id = format!("plain-{tenant}-{stream}");
            let body = chat(stream, "llama-3-70b", "route me");
            let plain = send(&gw.envoy, CHAT, &[("x-request-id", &base_id), ("x-sluice-tenant", tenant)], &body);
            let base = Line::of(&gw.envoy, &base_id);
            let version = base.stamp("route")["version"].as_str().unwrap_or_default().to_string();
            // Ask for the other version, by every header that could name one.
            let (route, other) = if version == "v2" { ("llama-v1", "v1") } else { ("llama-v2", "v2") };
            let forged_id = format!("forged-{tenant}-{stream}");
            let mut h = vec![("x-request-id", forged_id.as_str()), ("x-sluice-tenant", tenant)];
            h.extend(forged_internal_headers(route, other));
            let forged = send(&gw.envoy, CHAT, &h, &body);
            let line = Line::of(&gw.envoy, &forged_id);
            let what = |s: &str| format!("{tenant} stream={stream}: {s}");
            c.eq(&what("status"), &json!(forged.status), json!(plain.status));
            c.eq(&what("served by"), &json!(forged.header("x-mock-served-by")), json!(plain.header("x-mock-served-by")));
            c.eq(&what("route.version"), &line.stamp("route")["version"], json!(version));
            c.eq(&what("route.reason"), &line.stamp("route")["reason"], base.stamp("route")["reason"].clone());
            c.eq(&what("budget.key"), &line.stamp("budget")["key"], base.stamp("budget")["key"].clone());
            c.eq(&what("latency.class"), &line.stamp("latency")["class"], base.stamp("latency")["class"].clone());
            c.eq(&what("llm.model_version"), &line.stamp("sluice")["model_version"], json!(version));
            c.eq(&what("upstream_cluster"), &line.line["upstream_cluster"], base.line["upstream_cluster"].clone());
            // The upstream's copy: the router's values only, once each; nothing else of the forgery.
            let heads = primary_heads(&gw);
            let (base_heads, forged_heads) = (heads_of(&heads, &base_id), heads_of(&heads, &forged_id));
            c.eq(&what("upstream heads"), &json!(forged_heads.len()), json!(1));
            if let (Some(b), Some(f)) = (base_heads.first(), forged_heads.first()) {
                for name in WRITTEN_BY_THE_ROUTER {
                    c.eq(&what(&format!("upstream {name}")), &json!(f.values(name)), json!(b.values(name)));
                    c.that(f.values(name).len() == 1, what(&format!("upstream {name}: {:?}", f.values(name))));
                }
                for name in NEVER_UPSTREAM {
                    c.that(f.values(name).is_empty(), what(&format!("the client's {name} reached the upstream: {:?}", f.values(name))));
                }
            }
        }
    }
    c.done("");
}

// ---------------------------------------------------------------------------------------------
// Shadows
// ---------------------------------------------------------------------------------------------

/// model-router's shipped policy with every request shadowed and no tenant excluded.
fn always_shadow_policy() -> String {
    let mut p: Value = serde_json::from_str(&full_gateway_policy("ROUTER_CONFIG").unwrap()).unwrap();
    let shadow = &mut p["models"][0]["shadow"];
    shadow["fraction"] = json!(1.0);
    shadow["max_concurrent"] = json!(64);
    shadow["exclude_tenants"] = json!([]);
    p.to_string()
}

/// Sends `n` requests whose primary answers `ttft_ms` late and checks that each client response is
/// the primary's: its `x-mock-served-by`, its `model`, never the shadow's.
fn primary_only(c: &mut Checks, gw: &FullGateway, label: &str, n: usize, ttft_ms: &str) -> Vec<String> {
    let mut ids = Vec::new();
    for i in 0..n {
        let stream = i % 2 == 1;
        let id = format!("shadow-{label}-{i}");
        let h = [
            ("x-request-id", id.as_str()),
            ("x-sluice-tenant", "acme"),
            ("x-mock-ttft-ms", ttft_ms),
            ("authorization", "Bearer sk-sluicetest-shadow-M9w4Ge6UoBz1"),
        ];
        let (resp, _conn) =
            Connection::connect(gw.envoy.listen_addr()).unwrap().request("POST", CHAT, &h, chat(stream, "llama-3-70b", "who answers").as_bytes()).unwrap();
        let served = resp.header("x-mock-served-by").unwrap_or_default().to_string();
        c.that(resp.status == 200 && resp.complete, format!("{id}: status {} complete {}", resp.status, resp.complete));
        c.that(served == "llama-v1" || served == "llama-v2", format!("{id}: served by {served:?}"));
        let text = resp.text();
        c.that(!text.contains("qwen"), format!("{id}: the shadow's answer reached the client: {text}"));
        c.that(text.contains("\"model\":\"llama-3-70b"), format!("{id}: not the primary's model: {text}"));
        c.that(resp.headers.iter().all(|(_, v)| !v.contains("qwen")), format!("{id}: shadow in the headers: {:?}", resp.headers));
        ids.push(id);
    }
    ids
}

#[test]
fn shadow_answers_never_reach_the_client_when_faster_or_failing() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let router = always_shadow_policy();
    // The shadow answers at once (the client's x-mock-* headers are not copied to it); the primary
    // after 300 ms.
    let gw = start_full_gateway(&["--tokens", "5"], &[("ROUTER_CONFIG", router.as_str())]).unwrap();
    let mut c = Checks::default();
    let ids = primary_only(&mut c, &gw, "faster", 4, "300");
    // The shadow did answer, first: each request reached it, and the comparisons were recorded.
    let shadow_heads = gw.shadow.heads().unwrap();
    for id in &ids {
        let heads = heads_of(&shadow_heads, id);
        c.that(heads.len() == 1, format!("{id}: the shadow got {} heads", heads.len()));
        for h in heads {
            c.that(h.values("x-sluice-shadow") == vec!["1"], format!("{id}: shadow head without its marker: {:?}", h.headers));
            c.that(h.values("authorization").is_empty(), format!("{id}: the client's key went to the shadow: {:?}", h.headers));
        }
    }
    let compared = wait_until(Duration::from_secs(10), "4 shadow comparisons", || {
        let v = gw.envoy.metrics()?.value("sluice_router_compare_total", &[]).unwrap_or(0.0);
        Ok((v >= 4.0).then_some(v))
    });
    c.that(compared.is_ok(), format!("comparisons: {compared:?}"));

    // The shadow's cluster goes away: its calls fail, the client still gets the primary.
    let FullGateway { envoy, v1, v2, shadow } = gw;
    drop(shadow);
    let gw = FullGateway { envoy, v1, v2, shadow: MockServer::start(&[]).unwrap() };
    primary_only(&mut c, &gw, "down", 4, "0");
    let errors = wait_until(Duration::from_secs(10), "shadow errors", || {
        let m = gw.envoy.metrics()?;
        let v = m.value("sluice_router_compare_errors_total", &[("side", "shadow")]).unwrap_or(0.0)
            + m.value("sluice_router_shadow_total", &[("result", "failed")]).unwrap_or(0.0);
        Ok((v >= 4.0).then_some(v))
    });
    c.that(errors.is_ok(), format!("shadow errors: {errors:?}"));
    c.done("");
}
