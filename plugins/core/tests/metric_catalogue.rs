//! The metric catalogue (`sluice_core::metrics`) against what ships with it:
//! - every family's name, for sample label values, is the exact flat name the plugins define, and
//!   Envoy's tag extraction with the `stats_tags` of `envoy/templates/full-gateway.yaml` (and of the
//!   gateway shipping each plugin) splits it into exactly the family's labels, leaving its base name;
//! - every histogram family has its `histogram_bucket_settings` prefix in those gateways, and every
//!   prefix there is a histogram family;
//! - the metric tables of `docs/` list every family, and every metric they list is in the catalogue.
//!
//! Envoy's rule, applied here (`TagExtractorStdRegexImpl::extract`): each `stats_tags` regex is
//! searched in the full stored name (`wasmcustom.` + the plugin's name); on a match the first capture
//! group is cut from the name and the second is the tag's value. Every regex sees the original name;
//! the cuts are applied together at the end. Envoy's default extractors are anchored on other
//! prefixes (`cluster.`, `http.`, `listener.`, …) and never match `wasmcustom.sluice.…`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use regex::Regex;
use sluice_core::budget::policy::CounterSpec;
use sluice_core::budget::{Level, Limit, Window};
use sluice_core::contract::GatewayEnd;
use sluice_core::latency::deadline::Fired;
use sluice_core::latency::{Priority, State};
use sluice_core::metrics::{self as m, Family, MetricKind, Plugin, FAMILIES};
use sluice_core::report::Labels;
use sluice_core::routing::Reason;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").join(path)
}

/// A gateway template: its tag extractors, histogram prefixes, and the plugins it loads.
struct Gateway {
    file: &'static str,
    tags: Vec<(String, Regex)>,
    bucket_prefixes: Vec<String>,
    plugins: BTreeSet<&'static str>,
}

const GATEWAYS: &[&str] = &[
    "envoy/templates/full-gateway.yaml",
    "envoy/templates/gateway.yaml",
    "envoy/templates/budget-gateway.yaml",
    "envoy/templates/fleet-gateway.yaml",
    "envoy/templates/router-gateway.yaml",
    "envoy/templates/latency-gateway.yaml",
];

const PLUGINS: [Plugin; 4] = [Plugin::LlmMetrics, Plugin::TenantBudget, Plugin::ModelRouter, Plugin::LatencyGuard];

fn gateway(file: &'static str) -> Gateway {
    let text = std::fs::read_to_string(repo(file)).unwrap();
    // `{{PLACEHOLDER}}`s (filled by `cargo xtask render`) are not YAML: a line that is only one is
    // a block (tracing, empty unless asked for) and goes; any scalar does for the others.
    let text = Regex::new(r"(?m)^ *\{\{[A-Z0-9_]+\}\} *\n").unwrap().replace_all(&text, "");
    let text = Regex::new(r"\{\{[A-Z0-9_]+\}\}").unwrap().replace_all(&text, "0");
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    let stats = &doc["stats_config"];
    let tags = stats["stats_tags"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|t| (t["tag_name"].as_str().unwrap().to_string(), Regex::new(t["regex"].as_str().unwrap()).unwrap()))
        .collect();
    let bucket_prefixes =
        stats["histogram_bucket_settings"].as_sequence().unwrap().iter().map(|s| s["match"]["prefix"].as_str().unwrap().to_string()).collect();
    let plugins = PLUGINS.iter().map(|p| p.as_str()).filter(|p| text.contains(&format!("sluice_{}.wasm", p.replace('-', "_")))).collect();
    Gateway { file, tags, bucket_prefixes, plugins }
}

/// Envoy's tag extraction: the tags found and the name left once their first groups are cut.
fn extract(gw: &Gateway, stored: &str) -> (BTreeMap<String, String>, String) {
    let mut tags = BTreeMap::new();
    let mut cut = vec![false; stored.len()];
    for (tag, re) in &gw.tags {
        let Some(c) = re.captures(stored) else { continue };
        let (Some(remove), Some(value)) = (c.get(1), c.get(2)) else { panic!("{}: regex of {tag} lacks two groups", gw.file) };
        assert!(tags.insert(tag.clone(), value.as_str().to_string()).is_none(), "{}: tag {tag} twice", gw.file);
        cut[remove.range()].iter_mut().for_each(|b| *b = true);
    }
    let left = stored.char_indices().filter(|(i, _)| !cut[*i]).map(|(_, ch)| ch).collect();
    (tags, left)
}

/// One sample series: the family, the name the constructor built, the exact name the plugins
/// defined before the catalogue (byte for byte), and the labels Envoy must extract.
struct Case {
    family: &'static str,
    built: String,
    expected: &'static str,
    labels: &'static [(&'static str, &'static str)],
}

fn case(family: &'static str, built: impl Into<String>, expected: &'static str, labels: &'static [(&'static str, &'static str)]) -> Case {
    Case { family, built: built.into(), expected, labels }
}

const SIX: &[(&str, &str)] = &[("model_version", "v2"), ("tenant", "acme"), ("api", "chat_completions"), ("ctx", "1k"), ("turn", "first"), ("stream", "true")];
const SIX_NAME: &str = ".model_version.v2.tenant.acme.api.chat_completions.ctx.1k.turn.first.stream.true";

fn spec(level: Level, owner: &str, window: Window, limit: Limit) -> CounterSpec {
    CounterSpec {
        store_key: "k".into(),
        remote_name: "k".into(),
        level,
        owner: owner.into(),
        window,
        limit,
        soft_limit: None,
        code: "c".into(),
        per_identity: false,
    }
}

fn cases() -> Vec<Case> {
    let labels = Labels {
        model_version: "v2".into(),
        tenant: "acme".into(),
        api: "chat_completions".into(),
        ctx: "1k".into(),
        turn: "first".into(),
        stream: "true".into(),
    };
    let s = m::RequestSeries::new(&labels);
    assert_eq!(labels.suffix(), SIX_NAME);
    macro_rules! six {
        ($family:literal, $f:path) => {
            case(
                concat!("sluice.", $family),
                $f(&s),
                concat!("sluice.", $family, ".model_version.v2.tenant.acme.api.chat_completions.ctx.1k.turn.first.stream.true"),
                SIX,
            )
        };
    }
    let charge = m::ChargeSeries::new("k1", "search", "acme", "v2");
    let pair = m::ShadowPair::new("llama-v1", "qwen-v1");
    let tokens = Limit::Tokens { limit: 100, input_weight: 1, output_weight: 1 };
    vec![
        // llm-metrics
        case(
            "sluice.requests_total",
            m::requests_total(&s, 200, Some("stop"), true),
            "sluice.requests_total.model_version.v2.tenant.acme.api.chat_completions.ctx.1k.turn.first.stream.true.status.2xx.finish.stop.usage.reported",
            &[
                ("model_version", "v2"),
                ("tenant", "acme"),
                ("api", "chat_completions"),
                ("ctx", "1k"),
                ("turn", "first"),
                ("stream", "true"),
                ("status", "2xx"),
                ("finish", "stop"),
                ("usage", "reported"),
            ],
        ),
        case(
            "sluice.requests_total",
            m::requests_total(&s, 0, Some("a.b"), false),
            "sluice.requests_total.model_version.v2.tenant.acme.api.chat_completions.ctx.1k.turn.first.stream.true.status.none.finish.other.usage.estimated",
            &[
                ("model_version", "v2"),
                ("tenant", "acme"),
                ("api", "chat_completions"),
                ("ctx", "1k"),
                ("turn", "first"),
                ("stream", "true"),
                ("status", "none"),
                ("finish", "other"),
                ("usage", "estimated"),
            ],
        ),
        six!("ttft_ms", m::ttft_ms),
        six!("tpot_us", m::tpot_us),
        six!("decode_tokens_per_s", m::decode_tokens_per_s),
        six!("request_duration_ms", m::request_duration_ms),
        six!("input_tokens", m::input_tokens),
        six!("output_tokens", m::output_tokens),
        six!("input_tokens_total", m::input_tokens_total),
        six!("output_tokens_total", m::output_tokens_total),
        six!("cached_input_tokens_total", m::cached_input_tokens_total),
        six!("reasoning_tokens_total", m::reasoning_tokens_total),
        six!("cost_micro_usd_total", m::cost_micro_usd_total),
        six!("client_disconnects_total", m::client_disconnects_total),
        six!("upstream_errors_total", m::upstream_errors_total),
        case(
            "sluice.gateway_replies_total",
            m::gateway_replies_total(&s, GatewayEnd::Refused),
            "sluice.gateway_replies_total.model_version.v2.tenant.acme.api.chat_completions.ctx.1k.turn.first.stream.true.reason.refused",
            &[
                ("model_version", "v2"),
                ("tenant", "acme"),
                ("api", "chat_completions"),
                ("ctx", "1k"),
                ("turn", "first"),
                ("stream", "true"),
                ("reason", "refused"),
            ],
        ),
        case(
            "sluice.gateway_replies_total",
            m::gateway_replies_total(&s, GatewayEnd::Deadline),
            "sluice.gateway_replies_total.model_version.v2.tenant.acme.api.chat_completions.ctx.1k.turn.first.stream.true.reason.deadline",
            &[
                ("model_version", "v2"),
                ("tenant", "acme"),
                ("api", "chat_completions"),
                ("ctx", "1k"),
                ("turn", "first"),
                ("stream", "true"),
                ("reason", "deadline"),
            ],
        ),
        case("sluice.in_flight", m::in_flight("v2"), "sluice.in_flight.model_version.v2", &[("model_version", "v2")]),
        case(
            "sluice.quality.repetition_per_mille",
            m::quality_repetition_per_mille("v2"),
            "sluice.quality.repetition_per_mille.model_version.v2",
            &[("model_version", "v2")],
        ),
        case(
            "sluice.quality.output_tokens",
            m::quality_output_tokens("v2", "length"),
            "sluice.quality.output_tokens.model_version.v2.finish.length",
            &[("model_version", "v2"), ("finish", "length")],
        ),
        case(
            "sluice.quality.degenerate_answers_total",
            m::quality_degenerate_answers_total("v2", m::Degenerate::Empty),
            "sluice.quality.degenerate_answers_total.model_version.v2.reason.empty",
            &[("model_version", "v2"), ("reason", "empty")],
        ),
        case(
            "sluice.quality.degenerate_answers_total",
            m::quality_degenerate_answers_total("v2", m::Degenerate::Truncated),
            "sluice.quality.degenerate_answers_total.model_version.v2.reason.truncated",
            &[("model_version", "v2"), ("reason", "truncated")],
        ),
        case(
            "sluice.request_body_uninspected_total",
            m::request_body_uninspected_total(m::UninspectedReason::Malformed),
            "sluice.request_body_uninspected_total.reason.malformed",
            &[("reason", "malformed")],
        ),
        case(
            "sluice.request_body_uninspected_total",
            m::request_body_uninspected_total(m::UninspectedReason::Encoded),
            "sluice.request_body_uninspected_total.reason.encoded",
            &[("reason", "encoded")],
        ),
        case(
            "sluice.request_body_uninspected_total",
            m::request_body_uninspected_total(m::UninspectedReason::TooLarge),
            "sluice.request_body_uninspected_total.reason.too_large",
            &[("reason", "too_large")],
        ),
        // tenant-budget
        case(
            "sluice.budget.remaining",
            m::budget_remaining(&spec(Level::Team, "search", Window::Minute, tokens)),
            "sluice.budget.remaining.team.search.window.minute.unit.total_tokens",
            &[("team", "search"), ("window", "minute"), ("unit", "total_tokens")],
        ),
        case(
            "sluice.budget.remaining",
            m::budget_remaining(&spec(Level::Org, "acme", Window::Month { reset_day: 1 }, Limit::MicroUsd(5))),
            "sluice.budget.remaining.org.acme.window.month.unit.micro_usd",
            &[("org", "acme"), ("window", "month"), ("unit", "micro_usd")],
        ),
        case(
            "sluice.budget.soft_limit_crossings_total",
            m::budget_soft_limit_crossings_total(&spec(Level::Key, "k1", Window::Day, Limit::Requests(10))),
            "sluice.budget.soft_limit_crossings_total.key.k1.window.day.unit.requests",
            &[("key", "k1"), ("window", "day"), ("unit", "requests")],
        ),
        case(
            "sluice.budget.charged_tokens_total",
            m::budget_charged_tokens_total(&charge),
            "sluice.budget.charged_tokens_total.key.k1.team.search.org.acme.model_version.v2",
            &[("key", "k1"), ("team", "search"), ("org", "acme"), ("model_version", "v2")],
        ),
        case(
            "sluice.budget.charged_micro_usd_total",
            m::budget_charged_micro_usd_total(&charge),
            "sluice.budget.charged_micro_usd_total.key.k1.team.search.org.acme.model_version.v2",
            &[("key", "k1"), ("team", "search"), ("org", "acme"), ("model_version", "v2")],
        ),
        case(
            "sluice.budget.rejections_total",
            m::budget_rejections_total("k1", "key_k1_day_total_tokens"),
            "sluice.budget.rejections_total.key.k1.reason.key_k1_day_total_tokens",
            &[("key", "k1"), ("reason", "key_k1_day_total_tokens")],
        ),
        case("sluice.budget.clamps_total", m::budget_clamps_total("k1"), "sluice.budget.clamps_total.key.k1", &[("key", "k1")]),
        case("sluice.budget.overestimate_tokens", m::budget_overestimate_tokens("k1"), "sluice.budget.overestimate_tokens.key.k1", &[("key", "k1")]),
        case(
            "sluice.budget.ledger_calls_total",
            m::budget_ledger_calls_total(m::LedgerCall::Reserve, m::LedgerResult::Timeout),
            "sluice.budget.ledger_calls_total.call.reserve.result.timeout",
            &[("call", "reserve"), ("result", "timeout")],
        ),
        case(
            "sluice.budget.ledger_calls_total",
            m::budget_ledger_calls_total(m::LedgerCall::Settle, m::LedgerResult::Rejected),
            "sluice.budget.ledger_calls_total.call.settle.result.rejected",
            &[("call", "settle"), ("result", "rejected")],
        ),
        case(
            "sluice.budget.ledger_calls_total",
            m::budget_ledger_calls_total(m::LedgerCall::Settle, m::LedgerResult::Ok),
            "sluice.budget.ledger_calls_total.call.settle.result.ok",
            &[("call", "settle"), ("result", "ok")],
        ),
        case(
            "sluice.budget.ledger_calls_total",
            m::budget_ledger_calls_total(m::LedgerCall::Reserve, m::LedgerResult::Error),
            "sluice.budget.ledger_calls_total.call.reserve.result.error",
            &[("call", "reserve"), ("result", "error")],
        ),
        case(
            "sluice.budget.ledger_latency_ms",
            m::budget_ledger_latency_ms(m::LedgerCall::Reserve),
            "sluice.budget.ledger_latency_ms.call.reserve",
            &[("call", "reserve")],
        ),
        case(
            "sluice.budget.ledger_latency_ms",
            m::budget_ledger_latency_ms(m::LedgerCall::Settle),
            "sluice.budget.ledger_latency_ms.call.settle",
            &[("call", "settle")],
        ),
        case(
            "sluice.budget.ledger_latency_ms",
            m::budget_ledger_latency_ms(m::LedgerCall::WriteBack),
            "sluice.budget.ledger_latency_ms.call.write_back",
            &[("call", "write_back")],
        ),
        case(
            "sluice.budget.ledger_calls_total",
            m::budget_ledger_calls_total(m::LedgerCall::WriteBack, m::LedgerResult::Timeout),
            "sluice.budget.ledger_calls_total.call.write_back.result.timeout",
            &[("call", "write_back"), ("result", "timeout")],
        ),
        case("sluice.budget.ledger_up", m::budget_ledger_up(), "sluice.budget.ledger_up", &[]),
        case(
            "sluice.budget.ledger_fallback_total",
            m::budget_ledger_fallback_total(m::LedgerFallback::Allow),
            "sluice.budget.ledger_fallback_total.action.allow",
            &[("action", "allow")],
        ),
        case(
            "sluice.budget.ledger_fallback_total",
            m::budget_ledger_fallback_total(m::LedgerFallback::Local),
            "sluice.budget.ledger_fallback_total.action.local",
            &[("action", "local")],
        ),
        case(
            "sluice.budget.ledger_settlements_dropped_total",
            m::budget_ledger_settlements_dropped_total(),
            "sluice.budget.ledger_settlements_dropped_total",
            &[],
        ),
        // model-router
        case(
            "sluice.router.requests_total",
            m::router_requests_total("llama", "llama-v2", Reason::Fallback),
            "sluice.router.requests_total.model.llama.version.llama-v2.reason.fallback",
            &[("model", "llama"), ("version", "llama-v2"), ("reason", "fallback")],
        ),
        case(
            "sluice.router.unrouted_total",
            m::router_unrouted_total(m::Unrouted::NoModel),
            "sluice.router.unrouted_total.reason.no_model",
            &[("reason", "no_model")],
        ),
        case(
            "sluice.router.unrouted_total",
            m::router_unrouted_total(m::Unrouted::UnknownModel),
            "sluice.router.unrouted_total.reason.unknown_model",
            &[("reason", "unknown_model")],
        ),
        case(
            "sluice.router.unrouted_total",
            m::router_unrouted_total(m::Unrouted::NoVersion { model: "llama-_" }),
            "sluice.router.unrouted_total.reason.no_version.model.llama-_",
            &[("reason", "no_version"), ("model", "llama-_")],
        ),
        case(
            "sluice.router.shadow_total",
            m::router_shadow_total(&pair, m::ShadowResult::SkippedCap),
            "sluice.router.shadow_total.primary.llama-v1.shadow.qwen-v1.result.skipped_cap",
            &[("primary", "llama-v1"), ("shadow", "qwen-v1"), ("result", "skipped_cap")],
        ),
        case(
            "sluice.router.compare_duration_ms",
            m::router_compare_duration_ms(&pair, m::Side::Shadow),
            "sluice.router.compare_duration_ms.primary.llama-v1.shadow.qwen-v1.side.shadow",
            &[("primary", "llama-v1"), ("shadow", "qwen-v1"), ("side", "shadow")],
        ),
        case(
            "sluice.router.compare_ttft_ms",
            m::router_compare_ttft_ms(&pair),
            "sluice.router.compare_ttft_ms.primary.llama-v1.shadow.qwen-v1.side.primary",
            &[("primary", "llama-v1"), ("shadow", "qwen-v1"), ("side", "primary")],
        ),
        case(
            "sluice.router.compare_output_tokens",
            m::router_compare_output_tokens(&pair, m::Side::Primary),
            "sluice.router.compare_output_tokens.primary.llama-v1.shadow.qwen-v1.side.primary",
            &[("primary", "llama-v1"), ("shadow", "qwen-v1"), ("side", "primary")],
        ),
        case(
            "sluice.router.compare_errors_total",
            m::router_compare_errors_total(&pair, m::Side::Shadow),
            "sluice.router.compare_errors_total.primary.llama-v1.shadow.qwen-v1.side.shadow",
            &[("primary", "llama-v1"), ("shadow", "qwen-v1"), ("side", "shadow")],
        ),
        case(
            "sluice.router.compare_total",
            m::router_compare_total(&pair, false),
            "sluice.router.compare_total.primary.llama-v1.shadow.qwen-v1.finish_agree.false",
            &[("primary", "llama-v1"), ("shadow", "qwen-v1"), ("finish_agree", "false")],
        ),
        case(
            "sluice.router.compare_similarity_per_mille",
            m::router_compare_similarity_per_mille(&pair),
            "sluice.router.compare_similarity_per_mille.primary.llama-v1.shadow.qwen-v1",
            &[("primary", "llama-v1"), ("shadow", "qwen-v1")],
        ),
        // latency-guard
        case(
            "sluice.latency.requests_total",
            m::latency_requests_total("llama-v1", "interactive", "client_disconnect"),
            "sluice.latency.requests_total.version.llama-v1.class.interactive.outcome.client_disconnect",
            &[("version", "llama-v1"), ("class", "interactive"), ("outcome", "client_disconnect")],
        ),
        case(
            "sluice.latency.deadline_total",
            m::latency_deadline_total("llama-v1", Fired::TotalEvent),
            "sluice.latency.deadline_total.version.llama-v1.kind.total.action.error_event",
            &[("version", "llama-v1"), ("kind", "total"), ("action", "error_event")],
        ),
        case(
            "sluice.latency.deadline_total",
            m::latency_deadline_total("llama-v1", Fired::TtftReply),
            "sluice.latency.deadline_total.version.llama-v1.kind.ttft.action.reply_504",
            &[("version", "llama-v1"), ("kind", "ttft"), ("action", "reply_504")],
        ),
        case(
            "sluice.latency.shed_total",
            m::latency_shed_total("llama-v1", Priority::Sheddable, m::ShedReason::BreakerOpen),
            "sluice.latency.shed_total.version.llama-v1.priority.sheddable.reason.breaker_open",
            &[("version", "llama-v1"), ("priority", "sheddable"), ("reason", "breaker_open")],
        ),
        case(
            "sluice.latency.shed_total",
            m::latency_shed_total("llama-v1", Priority::Standard, m::ShedReason::InFlight),
            "sluice.latency.shed_total.version.llama-v1.priority.standard.reason.in_flight",
            &[("version", "llama-v1"), ("priority", "standard"), ("reason", "in_flight")],
        ),
        case(
            "sluice.latency.fallback_unavailable_total",
            m::latency_fallback_unavailable_total("llama-v1", Priority::Critical),
            "sluice.latency.fallback_unavailable_total.version.llama-v1.priority.critical",
            &[("version", "llama-v1"), ("priority", "critical")],
        ),
        case("sluice.latency.probes_total", m::latency_probes_total("llama-v1"), "sluice.latency.probes_total.version.llama-v1", &[("version", "llama-v1")]),
        case(
            "sluice.latency.output_capped_total",
            m::latency_output_capped_total("llama-3_1"),
            "sluice.latency.output_capped_total.version.llama-3_1",
            &[("version", "llama-3_1")],
        ),
        case(
            "sluice.latency.breaker_transitions_total",
            m::latency_breaker_transitions_total("llama-v1", State::HalfOpen),
            "sluice.latency.breaker_transitions_total.version.llama-v1.to.half_open",
            &[("version", "llama-v1"), ("to", "half_open")],
        ),
        case("sluice.latency.breaker_state", m::latency_breaker_state("llama-v1"), "sluice.latency.breaker_state.version.llama-v1", &[("version", "llama-v1")]),
        case("sluice.latency.in_flight", m::latency_in_flight("llama-v1"), "sluice.latency.in_flight.version.llama-v1", &[("version", "llama-v1")]),
    ]
}

fn family(name: &str) -> &'static Family {
    m::family_named(name).unwrap_or_else(|| panic!("{name} is not in FAMILIES"))
}

/// Whether a case's label keys, in order, are the family's: `a|b` takes any one of them, `k?` may
/// be absent.
fn keys_match(family: &Family, keys: &[&str]) -> bool {
    let mut keys = keys.iter().map(|k| k.trim_end_matches('?')).peekable();
    for declared in family.labels {
        let optional = declared.ends_with('?');
        let choices: Vec<&str> = declared.trim_end_matches('?').split('|').collect();
        match keys.peek() {
            Some(k) if choices.contains(k) => {
                keys.next();
            }
            _ if optional => {}
            _ => return false,
        }
    }
    keys.next().is_none()
}

#[test]
fn constructors_build_the_names_the_plugins_defined() {
    for c in cases() {
        assert_eq!(c.built, c.expected, "family {}", c.family);
        assert!(c.built.starts_with(c.family), "{} does not start with its family {}", c.built, c.family);
        let f = family(c.family);
        let keys: Vec<&str> = c.labels.iter().map(|(k, _)| *k).collect();
        assert!(keys_match(f, &keys), "{}: labels {keys:?} are not the family's {:?}", c.built, f.labels);
    }
}

#[test]
fn every_family_has_a_sample_and_a_unique_name() {
    let cases = cases();
    let mut seen = BTreeSet::new();
    for f in FAMILIES {
        assert!(seen.insert(f.name), "{} twice in FAMILIES", f.name);
        assert!(f.name.starts_with("sluice."), "{}", f.name);
        assert!(cases.iter().any(|c| c.family == f.name), "{} has no sample case", f.name);
    }
}

/// (a) The stats tags of the gateways split every sample into exactly its labels and leave the
/// family's base name, whose Prometheus form is `sluice_<family>`.
#[test]
fn stats_tags_split_every_name_into_its_labels() {
    let cases = cases();
    let mut checked = 0;
    for file in GATEWAYS {
        let gw = gateway(file);
        let ships = |p: Plugin| file.ends_with("full-gateway.yaml") || gw.plugins.contains(p.as_str());
        for c in cases.iter().filter(|c| ships(family(c.family).plugin)) {
            let f = family(c.family);
            let (tags, left) = extract(&gw, &format!("wasmcustom.{}", c.built));
            let want: BTreeMap<String, String> = c.labels.iter().filter(|(k, _)| !k.ends_with('?')).map(|(k, v)| (k.to_string(), v.to_string())).collect();
            assert_eq!(tags, want, "{file}: labels of {}", c.built);
            if c.labels.iter().all(|(k, _)| !k.ends_with('?')) {
                assert_eq!(left, format!("wasmcustom.{}", f.name), "{file}: {} leaves another name", c.built);
                assert_eq!(f.prometheus_name(), format!("sluice_{}", &f.name["sluice.".len()..].replace('.', "_")));
            }
            checked += 1;
        }
    }
    // Every plugin is in at least the full gateway, so every case was checked at least once.
    assert!(checked >= cases.len(), "{checked} checks for {} cases", cases.len());
}

/// (b) Every histogram family has its bucket prefix in each gateway that ships its plugin (the
/// first prefix matching its names is its own), and every prefix there is a histogram family.
#[test]
fn histograms_have_their_bucket_settings() {
    let cases = cases();
    for file in GATEWAYS {
        let gw = gateway(file);
        let full = file.ends_with("full-gateway.yaml");
        for f in FAMILIES.iter().filter(|f| f.kind == MetricKind::Histogram && (full || gw.plugins.contains(f.plugin.as_str()))) {
            let own = format!("wasmcustom.{}", f.name);
            assert!(gw.bucket_prefixes.contains(&own), "{file}: no histogram_bucket_settings for {}", f.name);
            for c in cases.iter().filter(|c| c.family == f.name) {
                let stored = format!("wasmcustom.{}", c.built);
                let first = gw.bucket_prefixes.iter().find(|p| stored.starts_with(p.as_str()));
                assert_eq!(first, Some(&own), "{file}: {} gets the buckets of another prefix", c.built);
            }
        }
        for prefix in &gw.bucket_prefixes {
            let name = prefix.strip_prefix("wasmcustom.").unwrap_or(prefix);
            assert!(m::family_named(name).is_some_and(|f| f.kind == MetricKind::Histogram), "{file}: bucket prefix {prefix} is no histogram family");
        }
    }
}

/// The Prometheus names in the first column of the metric tables of a doc page.
fn documented(page: &str) -> BTreeSet<String> {
    let text = std::fs::read_to_string(repo(page)).unwrap();
    let name = Regex::new(r"`(sluice_[a-z0-9_]+)").unwrap();
    text.lines()
        .filter(|l| l.starts_with('|'))
        .filter_map(|l| l.split('|').nth(1))
        .flat_map(|cell| name.captures_iter(cell).map(|c| c[1].to_string()).collect::<Vec<_>>())
        .collect()
}

fn page(plugin: Plugin) -> &'static str {
    match plugin {
        Plugin::LlmMetrics => "docs/metrics.md",
        Plugin::TenantBudget => "docs/tenant-budget.md",
        Plugin::ModelRouter => "docs/model-router.md",
        Plugin::LatencyGuard => "docs/latency-guard.md",
    }
}

/// (c) Each family is in the metric table of its plugin's page, and every metric those tables
/// (and docs/metrics.md) list is a family of the catalogue.
#[test]
fn docs_tables_list_exactly_the_catalogue() {
    let catalogue: BTreeSet<String> = FAMILIES.iter().map(Family::prometheus_name).collect();
    for f in FAMILIES {
        assert!(documented(page(f.plugin)).contains(&f.prometheus_name()), "{} is missing from the tables of {}", f.prometheus_name(), page(f.plugin));
    }
    for p in PLUGINS {
        for name in documented(page(p)) {
            assert!(catalogue.contains(&name), "{} documents {name}, which no plugin defines", page(p));
        }
    }
}
