//! The shipped rules and alerts in a real Prometheus scraping the full gateway in real Envoy.
//!
//! `envoy/templates/full-gateway.yaml` with the example policies (model-router's split changed to
//! 50/50 with every request shadowed, so both versions and the shadow comparisons have traffic),
//! three mocks answering with a 150 ms TTFT and 15 ms between tokens, and `prometheus` scraping
//! Envoy's `/stats/prometheus` every second with `observability/prometheus/sluice-rules.yaml` and
//! `sluice-alerts.yaml` loaded, evaluated every second. Streaming traffic from the four keys of
//! `policies/tenant-budget.full.json`, first turns and follow-ups, prompts in the 1k, 2k and 4k
//! context buckets, and two requests over key globex's minute budget (429). Then, through
//! Prometheus' HTTP API: the target is up; Prometheus holds exactly the `sluice_*` series Envoy
//! exports, with the shipped labels and TTFT buckets; every rule evaluates without error; the key
//! rules agree with the traffic (TTFT quantiles inside the mock's bucket, availability 1 despite the
//! 429, $/MTok within what the policy's prices give each request, budgets equal to Envoy's gauges,
//! breakers closed, nothing in flight); no alert is pending. Skipped when Envoy is not installed
//! (unless `SLUICE_ENVOY` is set); Prometheus is required then.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Map, Value};
use sluice_e2e::access_log::stamp;
use sluice_e2e::gateway::{full_gateway_policy, shipped, start_full_gateway, FullGateway};
use sluice_e2e::prometheus_server::{PrometheusServer, ScrapeConfig};
use sluice_e2e::{post_json, post_stream, wait_until, Tools};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const CHAT: &str = "/v1/chat/completions";
const TTFT_MS: u64 = 150;
const ITL_MS: u64 = 15;
const TOKENS: u64 = 8;
/// The keys of policies/tenant-budget.full.json (each is also the tenant header's value).
const KEYS: [&str; 4] = ["acme", "globex", "bank-emea", "batch-nightly"];

type Labels = Map<String, Value>;

/// Failed checks, reported together.
#[derive(Default)]
struct Checks(Vec<String>);

impl Checks {
    fn that(&mut self, ok: bool, what: String) {
        if !ok {
            self.0.push(what);
        }
    }
}

fn label<'a>(l: &'a Labels, name: &str) -> &'a str {
    l.get(name).and_then(Value::as_str).unwrap_or("")
}

/// A chat body: `chars` characters of prompt (the mock reports chars/4 + 4 tokens per message),
/// as a first turn or as a follow-up after an assistant message.
fn chat(chars: usize, follow_up: bool) -> String {
    let prompt = "x".repeat(chars);
    let messages = if follow_up {
        json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": prompt}])
    } else {
        json!([{"role": "user", "content": prompt}])
    };
    json!({"model": "llama-3-70b", "stream": true, "stream_options": {"include_usage": true}, "messages": messages}).to_string()
}

fn stream(gw: &FullGateway, key: &str, id: &str, body: &str) {
    let h = [("x-sluice-tenant", key), ("x-request-id", id)];
    let r = post_stream(gw.envoy.listen_addr(), CHAT, &h, body).unwrap().collect().unwrap();
    assert_eq!(r.status, 200, "{id}: {}", r.text());
    assert!(r.complete && r.text().contains("data: [DONE]"), "{id}: {}", r.text());
}

/// The buckets the gateway template sets for the histogram with `prefix`, as Envoy prints `le`.
fn shipped_buckets(prefix: &str) -> BTreeSet<String> {
    let yaml = std::fs::read_to_string(shipped("envoy/templates/full-gateway.yaml")).unwrap();
    let mut lines = yaml.lines().skip_while(|l| !l.contains(&format!("prefix: {prefix} }}")));
    lines.next().unwrap_or_else(|| panic!("no bucket settings for {prefix}"));
    let buckets = lines.next().and_then(|l| l.split_once('[')).and_then(|(_, r)| r.split_once(']')).map(|(b, _)| b).unwrap();
    buckets.split(',').map(|b| b.trim().to_string()).chain(["+Inf".to_string()]).collect()
}

/// Larger than key globex's 100,000 tokens a minute: strict mode reserves the body's bytes.
fn over_budget_body() -> String {
    chat(120_000, false)
}

/// Price of `llama-3-70b*` in the llm-metrics policy: (input, output) micro-USD per million tokens.
fn llama_prices() -> (u64, u64) {
    let policy: Value = serde_json::from_str(&full_gateway_policy("PLUGIN_CONFIG").unwrap()).unwrap();
    let p = policy["prices"].as_array().unwrap().iter().find(|p| p["model"] == "llama-3-70b*").unwrap();
    let micro = |v: &Value| (v.as_f64().unwrap() * 1e6).round() as u64;
    (micro(&p["input_usd_per_mtok"]), micro(&p["output_usd_per_mtok"]))
}

/// Rules in a rule file, by kind: lines `- record:` and `- alert:`.
fn count_rules(path: &PathBuf) -> (usize, usize) {
    let text = std::fs::read_to_string(path).unwrap();
    let count = |kind: &str| text.lines().filter(|l| l.trim_start().starts_with(&format!("- {kind}:"))).count();
    (count("record"), count("alert"))
}

#[test]
fn prometheus_scrapes_the_full_gateway_and_every_shipped_rule_agrees_with_the_traffic() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let started = Instant::now();
    let mut router: Value = serde_json::from_str(&full_gateway_policy("ROUTER_CONFIG").unwrap()).unwrap();
    router["models"][0]["versions"][0]["weight"] = json!(50);
    router["models"][0]["versions"][1]["weight"] = json!(50);
    router["models"][0]["shadow"]["fraction"] = json!(1.0);
    let (ttft, itl, tokens) = (TTFT_MS.to_string(), ITL_MS.to_string(), TOKENS.to_string());
    let gw = start_full_gateway(&["--tokens", &tokens, "--ttft-ms", &ttft, "--itl-ms", &itl], &[("ROUTER_CONFIG", &router.to_string())]).unwrap();
    let rule_files =
        vec![PathBuf::from(shipped("observability/prometheus/sluice-rules.yaml")), PathBuf::from(shipped("observability/prometheus/sluice-alerts.yaml"))];
    let prom = PrometheusServer::start(&ScrapeConfig {
        target: gw.envoy.admin_addr(),
        metrics_path: "/stats/prometheus".into(),
        interval_s: 1,
        rule_files: rule_files.clone(),
    })
    .unwrap();
    let q = |expr: &str| prom.query(expr).unwrap_or_else(|e| panic!("{e:#}\nPrometheus log:\n{}", prom.log_tail(20)));
    let scalar = |expr: &str| q(expr).first().map(|(_, v)| *v);

    // Wave 1 creates every series wave 2 adds to — both turns, and each key (so each version its
    // split sends it to) in every context bucket: Prometheus must have scraped them before wave 2,
    // since rate() counts only increases between two samples. (A series first seen in wave 2 could
    // get all its requests between two scrapes: no increase, a NaN quantile.)
    let mut sent = 0;
    for key in KEYS {
        for (chars, follow_up) in [(200, false), (200, true), (6_000, false), (12_000, false)] {
            stream(&gw, key, &format!("w1-{key}-{chars}-{follow_up}"), &chat(chars, follow_up));
            sent += 1;
        }
    }
    // A refusal in each wave, so the 4xx series exists before the second one (rate() needs it).
    let over_budget = |id: &str| {
        let r = post_json(gw.envoy.listen_addr(), CHAT, &[("x-sluice-tenant", "globex"), ("x-request-id", id)], &over_budget_body()).unwrap();
        assert_eq!(r.status, 429, "{}", r.text());
    };
    over_budget("w1-over-budget");
    let seen = |n: usize| move || Ok((scalar("sum(sluice_ttft_ms_count)") == Some(n as f64)).then_some(()));
    wait_until(Duration::from_secs(15), "Prometheus to scrape wave 1", seen(sent)).unwrap();

    // Wave 2: each key in its own thread, prompts in the 1k, 2k and 4k buckets, both turns.
    std::thread::scope(|s| {
        for key in KEYS {
            let gw = &gw;
            s.spawn(move || {
                for chars in [200, 6_000, 12_000] {
                    for follow_up in [false, true] {
                        stream(gw, key, &format!("w2-{key}-{chars}-{follow_up}"), &chat(chars, follow_up));
                    }
                }
            });
        }
    });
    sent += KEYS.len() * 6;
    over_budget("w2-over-budget");
    let requests = sent + 2;

    // Every request and every TTFT sample scraped, then every rule evaluated once more after that.
    wait_until(Duration::from_secs(15), "Prometheus to scrape wave 2", || {
        Ok((scalar("sum(sluice_requests_total)") == Some(requests as f64) && scalar("sum(sluice_ttft_ms_count)") == Some(sent as f64)).then_some(()))
    })
    .unwrap();
    let scraped_at = scalar("time()").unwrap();
    wait_until(Duration::from_secs(10), "a rule evaluation after the last scrape", || {
        Ok(scalar("min(timestamp(model_version:sluice_requests:rate5m))").is_some_and(|t| t > scraped_at + 1.0).then_some(()))
    })
    .unwrap();

    let mut c = Checks::default();

    // The target.
    let targets = prom.api("/api/v1/targets").unwrap();
    let active = targets["activeTargets"].as_array().cloned().unwrap_or_default();
    c.that(active.len() == 1, format!("one active target: {targets}"));
    for t in &active {
        c.that(t["health"] == "up" && t["lastError"] == "", format!("target not up: {t}"));
        c.that(t["scrapeUrl"].as_str().is_some_and(|u| u.ends_with("/stats/prometheus")), format!("scrape URL: {t}"));
    }

    // The series: exactly those Envoy exports now, same names and label sets.
    let envoy_series = || -> BTreeSet<String> {
        let m = gw.envoy.metrics().unwrap();
        m.samples.iter().filter(|s| s.name.starts_with("sluice_")).map(|s| format!("{}{:?}", s.name, s.labels)).collect()
    };
    let prom_series = || -> BTreeSet<String> {
        prom.series(r#"{__name__=~"sluice_.*"}"#)
            .unwrap()
            .iter()
            .map(|l| {
                let name = label(l, "__name__").to_string();
                let rest: BTreeMap<String, String> = l
                    .iter()
                    .filter(|(k, _)| !["__name__", "job", "instance"].contains(&k.as_str()))
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string()))
                    .collect();
                format!("{name}{rest:?}")
            })
            .collect()
    };
    // Shadow comparisons land when the shadow's answer does: compare once both sides settle.
    let same = wait_until(Duration::from_secs(10), "Prometheus' sluice series to equal Envoy's", || {
        let (e, p) = (envoy_series(), prom_series());
        Ok((e == p).then_some(e.len()))
    });
    let series_count = match same {
        Ok(n) => n,
        Err(e) => {
            let (ev, p) = (envoy_series(), prom_series());
            let only_envoy: Vec<_> = ev.difference(&p).take(10).collect();
            let only_prom: Vec<_> = p.difference(&ev).take(10).collect();
            c.that(false, format!("{e:#}: only in Envoy {only_envoy:?}, only in Prometheus {only_prom:?}"));
            p.len()
        }
    };

    let ttft_buckets = prom.series("sluice_ttft_ms_bucket").unwrap();
    let le: BTreeSet<String> = ttft_buckets.iter().map(|l| label(l, "le").to_string()).collect();
    c.that(
        le == shipped_buckets("wasmcustom.sluice.ttft_ms"),
        format!("sluice_ttft_ms le values {le:?}, shipped {:?}", shipped_buckets("wasmcustom.sluice.ttft_ms")),
    );
    for l in &ttft_buckets {
        let names: BTreeSet<&str> = l.keys().map(String::as_str).collect();
        let want = ["__name__", "api", "ctx", "instance", "job", "le", "model_version", "stream", "tenant", "turn"];
        c.that(names == want.into_iter().collect(), format!("sluice_ttft_ms_bucket labels {names:?}"));
    }
    let values = |metric: &str, name: &str| -> BTreeSet<String> { prom.series(metric).unwrap().iter().map(|l| label(l, name).to_string()).collect() };
    let versions = values("sluice_ttft_ms_count", "model_version");
    c.that(versions == ["v1", "v2"].map(String::from).into(), format!("model_version values {versions:?} (the 50/50 split sends the four keys to both)"));
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    c.that(values("sluice_ttft_ms_count", "ctx") == set(&["1k", "2k", "4k"]), format!("ctx values {:?}", values("sluice_ttft_ms_count", "ctx")));
    c.that(values("sluice_ttft_ms_count", "turn") == set(&["first", "follow_up"]), format!("turn values {:?}", values("sluice_ttft_ms_count", "turn")));
    // The tenant label: the policy's named tenants, everyone else `other`.
    c.that(
        values("sluice_requests_total", "tenant") == set(&["acme", "globex", "other"]),
        format!("tenant values {:?}", values("sluice_requests_total", "tenant")),
    );
    c.that(values("sluice_requests_total", "status") == set(&["2xx", "4xx"]), format!("status values {:?}", values("sluice_requests_total", "status")));
    c.that(values("sluice_budget_remaining", "key").is_superset(&set(&KEYS)), format!("budget keys {:?}", values("sluice_budget_remaining", "key")));
    c.that(values("sluice_latency_breaker_state", "version").contains("v1"), "no breaker state for v1".into());
    c.that(
        values("sluice_router_compare_total", "shadow") == set(&["qwen-72b-v1"]),
        format!("compare shadows {:?}", values("sluice_router_compare_total", "shadow")),
    );

    // Every rule evaluated without error.
    let rules = prom.api("/api/v1/rules").unwrap();
    let (mut recorded, mut alerting, mut unhealthy) = (0, 0, Vec::new());
    for group in rules["groups"].as_array().cloned().unwrap_or_default() {
        for rule in group["rules"].as_array().cloned().unwrap_or_default() {
            match rule["type"].as_str() {
                Some("recording") => recorded += 1,
                Some("alerting") => alerting += 1,
                _ => {}
            }
            if rule["health"] != "ok" || rule["lastError"].as_str().is_some_and(|e| !e.is_empty()) {
                unhealthy.push(format!("{} {}: {} {}", group["name"], rule["name"], rule["health"], rule["lastError"]));
            }
        }
    }
    let in_files = rule_files.iter().map(count_rules).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    c.that((recorded, alerting) == in_files, format!("Prometheus loaded {recorded} recording and {alerting} alerting rules, the files hold {in_files:?}"));
    c.that(unhealthy.is_empty(), format!("rules not healthy: {unhealthy:?}"));

    // TTFT: every quantile in the bucket holding the mock's 150 ms (tests allow +100 ms: (100, 250]).
    let in_ttft_bucket = |v: f64| v > 0.1 && v <= 0.25;
    let mut figures = Vec::new();
    for rule in [
        "model_version:sluice_ttft_seconds:p50_5m",
        "model_version:sluice_ttft_seconds:p99_5m",
        "model_version_ctx:sluice_ttft_seconds:p99_5m",
        "model_version_turn:sluice_ttft_seconds:p50_5m",
    ] {
        let got = q(rule);
        let want = if rule.starts_with("model_version:") {
            versions.len()
        } else if rule.contains("ctx") {
            6
        } else {
            4
        };
        c.that(got.len() == want, format!("{rule}: {} series, want {want} (versions × buckets)", got.len()));
        for (l, v) in &got {
            c.that(in_ttft_bucket(*v), format!("{rule}{l:?} = {v} s, not in (0.1, 0.25]"));
            figures.push(format!(
                "{rule}{{{}}} = {v:.4}",
                l.iter().filter(|(k, _)| *k != "__name__").map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
            ));
        }
    }
    // Time per output token 15 ms (tolerance 0.9× to +25 ms): inside (10, 50] ms; decode 1/TPOT.
    for (rule, lo, hi) in [("model_version:sluice_tpot_seconds:p50_5m", 0.01, 0.05), ("model_version:sluice_decode_tokens_per_s:p50_5m", 20.0, 100.0)] {
        let got = q(rule);
        c.that(got.len() == versions.len(), format!("{rule}: {got:?}"));
        for (l, v) in &got {
            c.that(*v > lo && *v <= hi, format!("{rule}{l:?} = {v}, not in ({lo}, {hi}]"));
            figures.push(format!("{rule}{{model_version={}}} = {v:.4}", label(l, "model_version")));
        }
    }
    // Availability 1 and no TTFT SLO errors on both (healthy) versions; the 429 is not a failure.
    for rule in [
        "model_version:sluice_availability:ratio_rate5m",
        "model_version:sluice_requests_errors:ratio_rate1h",
        "model_version:sluice_ttft_slo_errors:ratio_rate5m",
    ] {
        let want = if rule.contains("availability") { 1.0 } else { 0.0 };
        let got = q(rule);
        c.that(got.len() == versions.len() && got.iter().all(|(_, v)| *v == want), format!("{rule} = {got:?}, want {want} per version"));
    }
    c.that(
        q("sum(model_version_status:sluice_requests:rate5m{status=\"4xx\"})").first().is_some_and(|(_, v)| *v > 0.0),
        "the 429 is not in the 4xx rate".into(),
    );

    // $/MTok: a ratio of rates is a weighted mean of the requests' own ratios, so it lies between
    // the cheapest and dearest request priced at the policy's prices (each rounded up to a micro-USD).
    let (p_in, p_out) = llama_prices();
    let log = gw.envoy.access_log().wait_for(requests, Duration::from_secs(10)).unwrap();
    let mut per_request: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for line in &log {
        let Some(s) = stamp(line, "sluice").unwrap() else { continue };
        let (tin, tout) = (s["input_tokens"].as_u64().unwrap_or(0), s["output_tokens"].as_u64().unwrap_or(0));
        if s["status"] != 200 || tin + tout == 0 {
            continue;
        }
        let cost = (tin * p_in + tout * p_out).div_ceil(1_000_000);
        c.that(s["cost_micro_usd"] == cost, format!("stamp cost {} for {tin}+{tout} tokens, the policy gives {cost}", s["cost_micro_usd"]));
        per_request.entry(s["model_version"].as_str().unwrap_or("").to_string()).or_default().push(cost as f64 / (tin + tout) as f64);
    }
    for (l, v) in q("model_version:sluice_cost_usd_per_mtok:ratio_rate5m") {
        let version = label(&l, "model_version").to_string();
        let r = per_request.get(&version).cloned().unwrap_or_default();
        let (lo, hi) = (r.iter().cloned().fold(f64::INFINITY, f64::min), r.iter().cloned().fold(0.0, f64::max));
        c.that(v >= lo - 1e-12 && v <= hi + 1e-12, format!("$/MTok of {version} = {v}, the requests' own range [{lo}, {hi}]"));
        figures.push(format!("model_version:sluice_cost_usd_per_mtok:ratio_rate5m{{model_version={version}}} = {v:.4} (requests {lo:.4}..{hi:.4})"));
    }

    // Budgets: the recorded minimum equals the gauge Envoy shows now (one Envoy).
    let envoy_metrics = gw.envoy.metrics().unwrap();
    let gauges: BTreeMap<String, f64> =
        envoy_metrics.samples.iter().filter(|s| s.name == "sluice_budget_remaining").map(|s| (format!("{:?}", s.labels), s.value)).collect();
    let recorded_budgets: BTreeMap<String, f64> = q("owner_window_unit:sluice_budget_remaining:min")
        .into_iter()
        .map(|(l, v)| {
            let labels: BTreeMap<String, String> =
                l.iter().filter(|(k, _)| *k != "__name__").map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string())).collect();
            (format!("{labels:?}"), v)
        })
        .collect();
    c.that(recorded_budgets == gauges, format!("recorded budgets {recorded_budgets:?}\nEnvoy's gauges {gauges:?}"));

    // Guard and in-flight: breakers closed, nothing in flight once the traffic is over.
    let breakers = q("version:sluice_latency_breaker_state:max");
    c.that(!breakers.is_empty() && breakers.iter().all(|(_, v)| *v == 0.0), format!("breakers {breakers:?}"));
    for rule in ["model_version:sluice_in_flight:sum", "version:sluice_latency_in_flight:sum"] {
        let got = q(rule);
        c.that(!got.is_empty() && got.iter().all(|(_, v)| *v == 0.0), format!("{rule} = {got:?}"));
    }
    let throughput = q("model_version:sluice_output_tokens:rate5m");
    c.that(throughput.len() == versions.len() && throughput.iter().all(|(_, v)| *v > 0.0), format!("output tokens/s {throughput:?}"));

    // Shadows: the same mock behind both sides, so finishes agree and texts match.
    let compared = q("primary_shadow:sluice_router_compare:rate1h");
    c.that(!compared.is_empty() && compared.iter().all(|(_, v)| *v > 0.0), format!("comparisons {compared:?}"));
    let disagree = q("primary_shadow:sluice_router_compare_finish_disagree:ratio_rate1h");
    c.that(!disagree.is_empty() && disagree.iter().all(|(_, v)| *v == 0.0), format!("finish disagreement {disagree:?}"));
    let similarity = q("primary_shadow:sluice_router_compare_similarity_ratio:p50_1h");
    c.that(!similarity.is_empty() && similarity.iter().all(|(_, v)| *v > 0.99 && *v <= 1.0), format!("similarity {similarity:?}"));

    // Healthy traffic: no alert even pending.
    let alerts = prom.api("/api/v1/alerts").unwrap();
    c.that(alerts["alerts"].as_array().is_some_and(Vec::is_empty), format!("alerts: {alerts}"));

    eprintln!(
        "prometheus_live: {requests} requests ({sent} streamed, 2 refused 429), {series_count} sluice series in Prometheus = Envoy's, \
         {recorded} recording + {alerting} alerting rules healthy, {:.1} s in all",
        started.elapsed().as_secs_f64()
    );
    for f in &figures {
        eprintln!("  {f}");
    }
    assert!(c.0.is_empty(), "{} failed check(s):\n  {}\nPrometheus log:\n{}", c.0.len(), c.0.join("\n  "), prom.log_tail(20));
}
