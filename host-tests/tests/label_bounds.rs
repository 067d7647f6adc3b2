//! Every label of every plugin's metrics is bounded: by values the configuration names, a capped
//! set of dynamic values (`other` beyond the cap), or a fixed vocabulary — never by what a client
//! or an upstream sends. For each of the four plugins, one test sends [`REQUESTS`] requests in which
//! every input a client (or an upstream) controls is distinct per request — model-version header,
//! body `model` and `user`, tenant / key / JWT headers, API key, `x-request-id`, the router's
//! override / sticky / route headers, the model and user metadata `json_to_metadata` lifts from the
//! body, paths of the four LLM APIs (and paths that are none of them); and from the upstream side
//! the response `model`, `finish_reason` / `stop_reason` / `status`, error messages and types,
//! statuses 200…503 — and plays each request to its end (complete, upstream error, client
//! disconnect, upstream reset, a reply another plugin generated). Then, from the plugin's
//! `metric_names()`:
//!
//! - every name parses as `<metric>(.<label>.<value>)*` of a metric family the test declares, and
//!   every label value is in that label's declared vocabulary ([`Schema::check`]); the values of a
//!   dynamic label other than its configured names and `other` number at most its cap;
//! - the number of names is at most the bound derived from the configuration: the sum over metric
//!   families of the product of the sizes of their labels' vocabularies ([`Schema::bound`]; a
//!   dynamic label counts `named + cap + 1`);
//! - the number of names did not grow after the first [`CHECKPOINT`] requests: everything else a
//!   request controls (API, status, finish reason, outcome, timing scenario…) cycles with period
//!   [`PERIOD`], so after [`CHECKPOINT`] requests every combination of bounded values has occurred
//!   and only a label minted from client input could still add a name;
//! - no metric name carries a value a client or an upstream sent after the first [`CHECKPOINT`]
//!   requests, and at most the dynamic caps' worth of client values appear at all. Every
//!   client-controlled string of request `i` starts with `qz<i:05>`, which survives the plugins'
//!   label sanitising, so a leak names the request and the input.
//!
//! The product bound is loose by design (it assumes every label combination can occur); the tight
//! guarantees are the per-label vocabularies and caps, and the absence of growth.
//!
//! Build the plugins first: `cargo xtask build`.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::budget::{ANTHROPIC_KEY_SHA256, API_KEY, API_KEY_SHA256};
use common::latency::{self as lat, Exchange, Route};
use serde_json::{json, Value};
use sluice_core::report::KNOWN_FINISH_REASONS;
use sluice_host::{Gateway, HttpReply, Stream};

/// Requests each test sends.
const REQUESTS: usize = 2_000;
/// After this many requests the metric names must be saturated.
const CHECKPOINT: usize = 200;
/// Every bounded choice of request `i` (API, status, outcome, …) is a function of `i % PERIOD`;
/// the dynamic caps fill within the first period, and [`CHECKPOINT`] covers three periods.
const PERIOD: usize = 60;

use sluice_core::contract::{MODEL_METADATA, USER_METADATA};
const FORCE_PROPERTY: [&str; 4] = ["metadata", "filter_metadata", "sluice_trusted", "force_version"];
const GATEWAY_REPLY: &str = "sluice_gateway_reply";
const AVOID: &str = "sluice_latency_avoid";

// =============================================================================================
// The schema: which metric names a plugin may define
// =============================================================================================

/// The vocabulary of one label.
#[derive(Clone, Debug)]
enum Dim {
    /// Exactly these values.
    Fixed(Vec<String>),
    /// The configured names, at most `cap` other values (per VM, shared by every metric carrying
    /// the label), and `other`.
    Bounded { named: Vec<String>, cap: usize },
}

fn fixed<S: AsRef<str>>(values: impl IntoIterator<Item = S>) -> Dim {
    Dim::Fixed(values.into_iter().map(|v| v.as_ref().to_string()).collect())
}

impl Dim {
    fn size(&self) -> usize {
        match self {
            Dim::Fixed(v) => v.len(),
            Dim::Bounded { named, cap } => named.len() + cap + 1,
        }
    }
    fn admits(&self, value: &str) -> bool {
        match self {
            Dim::Fixed(v) => v.iter().any(|x| x == value),
            // Checked over all names at once (the cap is per label, not per name).
            Dim::Bounded { .. } => true,
        }
    }
    fn describe(&self) -> String {
        match self {
            Dim::Fixed(v) => v.len().to_string(),
            Dim::Bounded { named, cap } => {
                format!("({} named + {cap} dynamic + other)", named.len())
            }
        }
    }
}

type Labels = Vec<(&'static str, Dim)>;

/// A metric and the label sequences its names may carry (one per variant).
struct Family {
    metric: String,
    variants: Vec<Labels>,
}

fn family(metric: &str, labels: Labels) -> Family {
    Family { metric: metric.to_string(), variants: vec![labels] }
}

struct Schema {
    plugin: &'static str,
    families: Vec<Family>,
}

impl Schema {
    /// Σ over families and variants of Π of the label vocabularies' sizes.
    fn bound(&self) -> usize {
        self.families.iter().flat_map(|f| &f.variants).map(|v| v.iter().map(|(_, d)| d.size()).product::<usize>()).sum()
    }

    /// The bound, spelled out.
    fn derivation(&self) -> String {
        let mut out = String::new();
        for f in &self.families {
            for v in &f.variants {
                let factors: Vec<String> = v.iter().map(|(k, d)| format!("{k} {}", d.describe())).collect();
                let n: usize = v.iter().map(|(_, d)| d.size()).product();
                out += &format!("  {}: {} = {n}\n", f.metric, if factors.is_empty() { "1".to_string() } else { factors.join(" × ") });
            }
        }
        out += &format!("  total: {}", self.bound());
        out
    }

    /// Checks every name against the schema and every dynamic label against its cap; returns
    /// the distinct values of each label.
    fn check(&self, names: &[String]) -> BTreeMap<&'static str, BTreeSet<String>> {
        let mut values: BTreeMap<&'static str, BTreeSet<String>> = BTreeMap::new();
        let mut dynamic: BTreeMap<&'static str, (usize, BTreeSet<String>)> = BTreeMap::new();
        let mut refused = Vec::new();
        for name in names {
            let fam = self.families.iter().filter(|f| name == &f.metric || name.starts_with(&format!("{}.", f.metric))).max_by_key(|f| f.metric.len());
            let Some(fam) = fam else {
                refused.push(format!("{name}: not a metric the schema declares"));
                continue;
            };
            let rest = name[fam.metric.len()..].trim_start_matches('.');
            let segments: Vec<&str> = if rest.is_empty() { Vec::new() } else { rest.split('.').collect() };
            if !segments.len().is_multiple_of(2) {
                refused.push(format!("{name}: not `.label.value` pairs after {}", fam.metric));
                continue;
            }
            let pairs: Vec<(&str, &str)> = segments.chunks(2).map(|c| (c[0], c[1])).collect();
            let variant = fam.variants.iter().find(|v| v.len() == pairs.len() && v.iter().zip(&pairs).all(|((k, d), (pk, pv))| k == pk && d.admits(pv)));
            let Some(variant) = variant else {
                refused.push(format!("{name}: a label or value {} does not allow", fam.metric));
                continue;
            };
            for ((k, d), (_, v)) in variant.iter().zip(&pairs) {
                values.entry(k).or_default().insert(v.to_string());
                if let Dim::Bounded { named, cap } = d {
                    if *v != "other" && !named.iter().any(|n| n == v) {
                        dynamic.entry(k).or_insert_with(|| (*cap, BTreeSet::new())).1.insert(v.to_string());
                    }
                }
            }
        }
        assert!(
            refused.is_empty(),
            "{}: {} metric names outside the declared schema (an unbounded or undeclared label):\n  {}",
            self.plugin,
            refused.len(),
            refused.iter().take(30).cloned().collect::<Vec<_>>().join("\n  ")
        );
        for (label, (cap, seen)) in &dynamic {
            assert!(seen.len() <= *cap, "{}: label `{label}` has {} dynamic values, more than its cap of {cap}: {seen:?}", self.plugin, seen.len());
        }
        values
    }
}

/// Metric names at the checkpoint and at the end of a run.
struct Run {
    at_checkpoint: Vec<String>,
    at_end: Vec<String>,
    elapsed: Duration,
}

/// `qz<i:05>`, the mark every client- or upstream-controlled string of request `i` starts with.
fn tok(i: usize) -> String {
    format!("qz{i:05}")
}

/// The request indices whose mark `name` contains.
fn marks_in(name: &str) -> Vec<usize> {
    let b = name.as_bytes();
    let mut out = Vec::new();
    let mut k = 0;
    while k + 7 <= b.len() {
        if &b[k..k + 2] == b"qz" && b[k + 2..k + 7].iter().all(u8::is_ascii_digit) {
            out.push(name[k + 2..k + 7].parse().expect("digits"));
            k += 7;
        } else {
            k += 1;
        }
    }
    out
}

/// Runs `one(i)` for every request, reading the metric names at the checkpoint and at the end.
fn run(gw: &Gateway, mut one: impl FnMut(usize)) -> Run {
    let started = Instant::now();
    let mut at_checkpoint = Vec::new();
    for i in 0..REQUESTS {
        one(i);
        if i + 1 == CHECKPOINT {
            at_checkpoint = gw.metric_names();
        }
    }
    assert_eq!(gw.crashed(), None, "the plugin must never trap");
    Run { at_checkpoint, at_end: gw.metric_names(), elapsed: started.elapsed() }
}

/// The assertions every plugin's run must pass; `leak_cap`: how many distinct client values may
/// appear in names at all (the sum of the dynamic caps).
fn assert_bounded(schema: &Schema, run: &Run, leak_cap: usize) {
    let values = schema.check(&run.at_end);
    let bound = schema.bound();
    let per_label: Vec<String> = values.iter().map(|(k, v)| format!("{k} ({}): {}", v.len(), v.iter().cloned().collect::<Vec<_>>().join(" "))).collect();
    println!(
        "{}: {} metric names after {CHECKPOINT} requests, {} after {REQUESTS} ({:.2?}); bound {bound}\n\
         values per label:\n  {}\nbound derivation:\n{}",
        schema.plugin,
        run.at_checkpoint.len(),
        run.at_end.len(),
        run.elapsed,
        per_label.join("\n  "),
        schema.derivation()
    );
    assert!(run.at_end.len() <= bound, "{}: {} metric names, more than the bound {bound} derived from the configuration", schema.plugin, run.at_end.len());
    let before: BTreeSet<&String> = run.at_checkpoint.iter().collect();
    let grown: Vec<&String> = run.at_end.iter().filter(|n| !before.contains(n)).collect();
    assert!(
        grown.is_empty(),
        "{}: the metric names grew from {} to {} after the first {CHECKPOINT} requests; new names \
         (first 20): {:#?}",
        schema.plugin,
        run.at_checkpoint.len(),
        run.at_end.len(),
        grown.iter().take(20).collect::<Vec<_>>()
    );
    let mut leaked: BTreeMap<usize, Vec<&String>> = BTreeMap::new();
    for name in &run.at_end {
        for i in marks_in(name) {
            leaked.entry(i).or_default().push(name);
        }
    }
    let late: Vec<(&usize, &&String)> = leaked.iter().filter(|(i, _)| **i >= CHECKPOINT).map(|(i, n)| (i, &n[0])).take(20).collect();
    assert!(
        late.is_empty(),
        "{}: values sent after the first {CHECKPOINT} requests appear in metric names \
         (request, first name): {late:#?}",
        schema.plugin
    );
    assert!(
        leaked.len() <= leak_cap,
        "{}: values of {} distinct requests appear in metric names, more than the dynamic caps \
         allow ({leak_cap}): {:#?}",
        schema.plugin,
        leaked.len(),
        leaked.iter().map(|(i, n)| (i, n[0])).take(20).collect::<Vec<_>>()
    );
}

// =============================================================================================
// Traffic: request `i`, every client- and upstream-controlled value distinct
// =============================================================================================

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Api {
    Chat,
    Completions,
    Responses,
    Messages,
}

impl Api {
    const ALL: [Api; 4] = [Api::Chat, Api::Completions, Api::Responses, Api::Messages];
    fn tail(self) -> &'static str {
        match self {
            Api::Chat => "chat/completions",
            Api::Completions => "completions",
            Api::Responses => "responses",
            Api::Messages => "messages",
        }
    }
}

/// How the exchange ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    Complete,
    /// The client goes away after the response headers and two body pieces.
    ClientGone,
    /// The upstream resets after the response headers and two body pieces.
    UpstreamReset,
    /// The client goes away before any response.
    ClientGoneEarly,
    /// The upstream resets before any response (Envoy answers 503 itself).
    UpstreamResetEarly,
}

/// What the upstream (and the filters around the plugin) do with request `i`.
#[derive(Clone, Debug)]
struct Upstream {
    status: u16,
    sse: bool,
    /// Body pieces and whether each carries a content token.
    pieces: Vec<(Vec<u8>, bool)>,
    end: End,
    /// A reply another sluice plugin generated (`sluice_gateway_reply`).
    gateway_reply: Option<String>,
    /// Envoy's `response.code_details`.
    code_details: Option<String>,
    /// Response model, finish reason and text, for answers built elsewhere (shadow answers).
    answer: Answer,
}

#[derive(Clone, Debug)]
struct Answer {
    model: String,
    finish: Option<String>,
    usage: Option<(u64, u64)>,
    text: String,
    /// An error event inside a 200 stream.
    error: Option<String>,
}

/// One request as every plugin's neighbours would hand it over.
#[derive(Clone, Debug)]
struct Traffic {
    s: usize,
    t: String,
    /// The API the body speaks (the path may be none of the APIs).
    api: Api,
    path: String,
    headers: Vec<(Vec<u8>, Vec<u8>)>,
    /// `None`: the headers end the request.
    body: Option<Vec<u8>>,
    tenant: Option<Vec<u8>>,
    model_metadata: Option<String>,
    user_metadata: Option<String>,
    force: Option<String>,
    avoid: Option<String>,
    up: Upstream,
}

/// base64url without padding (JWT payloads as jwt_authn forwards them).
fn b64url(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |acc, (k, &b)| acc | (u32::from(b) << (16 - 8 * k)));
        for k in 0..=chunk.len() {
            out.push(A[((n >> (18 - 6 * k)) & 63) as usize] as char);
        }
    }
    out
}

fn request_body(api: Api, model: Option<&str>, t: &str, stream: bool, max_tokens: Option<u64>, follow_up: bool) -> Vec<u8> {
    let user = format!("{t}-user");
    let mut b = match api {
        Api::Chat => {
            let mut messages =
                vec![json!({"role": "system", "content": format!("You help {t}.")}), json!({"role": "user", "content": format!("Hello from {t}!")})];
            if follow_up {
                messages.push(json!({"role": "assistant", "content": format!("Hi {t}")}));
                messages.push(json!({"role": "user", "content": "And then?"}));
            }
            json!({"messages": messages, "user": user, "stream": stream})
        }
        Api::Completions => json!({"prompt": format!("Say {t}"), "user": user, "stream": stream}),
        Api::Responses => {
            let mut v = json!({"input": format!("Tell {t} a joke"), "user": user, "stream": stream});
            if follow_up {
                v["previous_response_id"] = json!(format!("resp_{t}"));
            }
            v
        }
        Api::Messages => {
            let mut messages = vec![json!({"role": "user", "content": format!("Hello from {t}")})];
            if follow_up {
                messages.push(json!({"role": "assistant", "content": format!("Hi {t}")}));
                messages.push(json!({"role": "user", "content": "And then?"}));
            }
            json!({"messages": messages, "metadata": {"user_id": user}, "stream": stream})
        }
    };
    if let Some(m) = model {
        b["model"] = json!(m);
    }
    if let Some(n) = max_tokens {
        let key = match api {
            Api::Responses => "max_output_tokens",
            _ => "max_tokens",
        };
        b[key] = json!(n);
    }
    b.to_string().into_bytes()
}

fn sse_event(v: Value) -> Vec<u8> {
    format!("data: {v}\n\n").into_bytes()
}

fn named_event(ty: &str, v: Value) -> Vec<u8> {
    format!("event: {ty}\ndata: {v}\n\n").into_bytes()
}

/// The streamed answer of `api`, event by event (content events marked).
fn sse_answer(api: Api, a: &Answer) -> Vec<(Vec<u8>, bool)> {
    let texts = ["Hi", " there, ", a.text.as_str()];
    let mut out = Vec::new();
    match api {
        Api::Chat | Api::Completions => {
            let chunk = |choice: Value, usage: Value| {
                sse_event(json!({"id": format!("cmpl-{}", a.text), "object": "chat.completion.chunk",
                    "model": a.model, "choices": [choice], "usage": usage}))
            };
            if api == Api::Chat {
                out.push((chunk(json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}), Value::Null), false));
            }
            for text in texts {
                let choice = match api {
                    Api::Chat => {
                        json!({"index": 0, "delta": {"content": text}, "finish_reason": null})
                    }
                    _ => json!({"index": 0, "text": text, "finish_reason": null}),
                };
                out.push((chunk(choice, Value::Null), true));
            }
            if let Some(e) = &a.error {
                out.push((sse_event(json!({"error": {"message": e, "type": format!("{e}-type"), "code": e}})), false));
            } else {
                let choice = match api {
                    Api::Chat => json!({"index": 0, "delta": {}, "finish_reason": a.finish}),
                    _ => json!({"index": 0, "text": "", "finish_reason": a.finish}),
                };
                out.push((chunk(choice, Value::Null), false));
                if let Some((p, c)) = a.usage {
                    out.push((
                        sse_event(json!({"model": a.model, "choices": [],
                            "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}})),
                        false,
                    ));
                }
            }
            out.push((b"data: [DONE]\n\n".to_vec(), false));
        }
        Api::Responses => {
            out.push((
                named_event(
                    "response.created",
                    json!({"type": "response.created",
                    "response": {"id": format!("resp_{}", a.text), "object": "response", "model": a.model, "status": "in_progress"}}),
                ),
                false,
            ));
            for text in texts {
                out.push((named_event("response.output_text.delta", json!({"type": "response.output_text.delta", "delta": text})), true));
            }
            let mut response = json!({"id": format!("resp_{}", a.text), "object": "response", "model": a.model});
            if let Some((p, c)) = a.usage {
                response["usage"] = json!({"input_tokens": p, "output_tokens": c, "total_tokens": p + c});
            }
            if let Some(e) = &a.error {
                response["status"] = json!("failed");
                response["error"] = json!({"code": format!("{e}-code"), "message": e});
                out.push((named_event("response.failed", json!({"type": "response.failed", "response": response})), false));
            } else {
                if let Some(f) = &a.finish {
                    response["status"] = json!(f);
                    response["incomplete_details"] = json!({"reason": f});
                }
                out.push((named_event("response.completed", json!({"type": "response.completed", "response": response})), false));
            }
        }
        Api::Messages => {
            let input = a.usage.map_or(0, |u| u.0);
            out.push((
                named_event(
                    "message_start",
                    json!({"type": "message_start", "message": {"id": format!("msg_{}", a.text),
                    "type": "message", "role": "assistant", "content": [], "model": a.model, "stop_reason": null,
                    "usage": {"input_tokens": input, "output_tokens": 1}}}),
                ),
                false,
            ));
            out.push((
                named_event("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})),
                false,
            ));
            for text in texts {
                out.push((
                    named_event(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": text}}),
                    ),
                    true,
                ));
            }
            if let Some(e) = &a.error {
                out.push((named_event("error", json!({"type": "error", "error": {"type": format!("{e}_error"), "message": e}})), false));
            } else {
                let mut delta = json!({"type": "message_delta", "delta": {"stop_reason": a.finish, "stop_sequence": null}});
                if let Some((_, c)) = a.usage {
                    delta["usage"] = json!({"output_tokens": c});
                }
                out.push((named_event("message_delta", delta), false));
                out.push((named_event("message_stop", json!({"type": "message_stop"})), false));
            }
        }
    }
    out
}

/// The whole (non-streamed) answer of `api`.
fn whole_answer(api: Api, a: &Answer) -> Vec<u8> {
    let text = format!("Hi there, {}", a.text);
    let v = match api {
        Api::Chat => {
            let mut v = json!({"id": format!("chatcmpl-{}", a.text), "object": "chat.completion", "model": a.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": a.finish}]});
            if let Some((p, c)) = a.usage {
                v["usage"] = json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c});
            }
            v
        }
        Api::Completions => {
            let mut v = json!({"id": format!("cmpl-{}", a.text), "object": "text_completion", "model": a.model,
                "choices": [{"index": 0, "text": text, "finish_reason": a.finish}]});
            if let Some((p, c)) = a.usage {
                v["usage"] = json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c});
            }
            v
        }
        Api::Responses => {
            let mut v = json!({"id": format!("resp_{}", a.text), "object": "response", "model": a.model,
                "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]});
            if let Some(f) = &a.finish {
                v["status"] = json!(f);
            }
            if let Some((p, c)) = a.usage {
                v["usage"] = json!({"input_tokens": p, "output_tokens": c, "total_tokens": p + c});
            }
            v
        }
        Api::Messages => {
            let mut v = json!({"id": format!("msg_{}", a.text), "type": "message", "role": "assistant", "model": a.model,
                "content": [{"type": "text", "text": text}], "stop_reason": a.finish});
            if let Some((p, c)) = a.usage {
                v["usage"] = json!({"input_tokens": p, "output_tokens": c});
            }
            v
        }
    };
    v.to_string().into_bytes()
}

/// An upstream's error body: message, type and code all the upstream's own strings.
fn error_answer(t: &str) -> Vec<u8> {
    json!({"error": {"message": format!("{t} is overloaded, try again"), "type": format!("{t}_error"), "code": format!("{t}-code")}}).to_string().into_bytes()
}

/// Request `i`. Every bounded choice is a function of `s = i % PERIOD` through divisors of
/// `PERIOD` (3, 4, 5 and their products), so it cycles; every string the client or the upstream
/// controls starts with `tok(i)`.
fn traffic(i: usize) -> Traffic {
    let s = i % PERIOD;
    let t = tok(i);
    // No sticky key of any kind: no tenant, no API key, no user.
    let anonymous = s % 15 == 7;

    // The path: the four APIs under several mounts, and (5 requests a period) paths that are no
    // LLM API or lie outside llm-metrics' `path_prefixes`.
    let kind = Api::ALL[s % 4];
    let (api, path) = if s % 12 == 5 {
        match (s / 12) % 3 {
            0 => (Api::Chat, format!("/v1/{t}/embeddings")),
            1 => (Api::Messages, format!("/v1/messages/count_tokens?{t}")),
            // An LLM path outside llm-metrics' `path_prefixes` (the other plugins take it).
            _ => (Api::Chat, format!("/{t}/chat/completions")),
        }
    } else {
        let tail = kind.tail();
        let path = match s % 5 {
            0 => format!("/v1/{tail}"),
            1 => format!("/v1/{t}/{tail}?user={t}"),
            2 => format!("/openai/{t}/v1/{tail}/"),
            3 => format!("/v1/{tail}?api-version={t}#{t}"),
            _ => format!("/openai/v1/{tail}?{t}=%2e%2e/{t}"),
        };
        (kind, path)
    };

    let mut headers: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    let mut h = |k: &str, v: &[u8]| headers.push((k.as_bytes().to_vec(), v.to_vec()));
    h(":method", b"POST");
    h(":path", path.as_bytes());
    h(":authority", b"llm.internal");
    h(":scheme", b"https");
    h("content-type", b"application/json");
    h("user-agent", format!("{t}-agent/1.0").as_bytes());
    if s % 20 != 13 {
        h("x-request-id", format!("{t}-rid").as_bytes());
    }

    // The tenant (llm-metrics' tenant, model-router's sticky key and shadow exclusion, the guard's
    // class), as an auth filter in front would set it — or not.
    let tenant: Option<Vec<u8>> = if anonymous {
        None
    } else {
        match s % 10 {
            0 => Some(b"acme".to_vec()),
            1 => Some(format!("{t}-tenant").into_bytes()),
            2 => None,
            3 => Some(b"   ".to_vec()),
            4 => Some(format!("crit-{t}").into_bytes()),
            5 => Some(format!("std-{t}").into_bytes()),
            6 => Some(format!("batch-{t}").into_bytes()),
            7 => Some(format!("bank-{t}").into_bytes()),
            8 => Some([format!("{t}.evil tenant/é ").as_bytes(), b"\xff\xfe"].concat()),
            _ => Some(b"initech".to_vec()),
        }
    };
    if let Some(v) = &tenant {
        h("x-sluice-tenant", v);
    }

    // The model version header (llm-metrics, tenant-budget; model-router strips it) and the body's
    // model.
    let (mv_header, body_model): (Option<String>, Option<String>) = match s % 12 {
        0 => (Some(format!("{t}-mv")), Some(format!("{t}-model"))),
        1 => (Some("v1".into()), Some(format!("gpt-4o-{t}"))),
        2 => (None, Some(format!("{t}-model"))),
        3 => (Some(format!("{t}.mv/x é")), Some(format!("claude-{t}"))),
        4 => (Some(String::new()), Some(format!("gpt-4o-{t}"))),
        5 => (None, Some("v2".into())),
        6 => (None, None),
        7 => (Some("v2".into()), Some(format!("llama-3-{t}"))),
        8 => (Some(format!("{t}-mv-b")), Some(t.clone())),
        9 => (None, Some(format!("gpt-4o-{t}"))),
        10 => (Some(t.clone()), Some(format!("claude-{t}"))),
        _ => (None, Some(format!("claude-{t}.x/y"))),
    };
    if let Some(v) = &mv_header {
        h("x-model-version", v.as_bytes());
    }

    // Identity for tenant-budget: an API key (known or not), the auth filter's key header, a JWT
    // payload claim; every source that does not name the chosen key carries a random value.
    let id = s % 6;
    if !anonymous {
        match (id, s % 4) {
            (0, _) => h("authorization", format!("Bearer {API_KEY}").as_bytes()),
            (_, 3) => h("authorization", format!("Basic {t}").as_bytes()),
            _ => h("authorization", format!("Bearer sk-{t}").as_bytes()),
        }
        h("x-api-key", format!("{t}-xkey").as_bytes());
    }
    match id {
        1 => h("x-sluice-key", b"search-dev"),
        2 => h("x-sluice-key", b"tiny"),
        5 => h("x-sluice-key", b" search-prod "),
        _ => h("x-sluice-key", format!("{t}-key").as_bytes()),
    }
    // Who the request is within its key (tenant-budget's `identity_budgets`): one user who comes
    // back, everyone else new.
    match s % 5 {
        0 => h("x-user", b"alice"),
        _ => h("x-user", format!("{t}-user").as_bytes()),
    }
    let claim = if id == 3 { "soft".to_string() } else { format!("{t}-claim") };
    h("x-jwt-payload", b64url(json!({"sub": t, "sluice_key": claim}).to_string().as_bytes()).as_bytes());
    // What a client sends to steer model-router (stripped, never honoured).
    h("x-sluice-force-version", format!("{t}-force").as_bytes());
    h("x-sluice-route", format!("{t}-route").as_bytes());

    // The body.
    let stream = s % 3 != 2;
    let max_tokens = [None, Some(16), Some(64), Some(1_000_000), Some(1)][s % 5];
    let follow_up = s % 6 == 1;
    let body = match s % 30 {
        11 => None,
        23 => {
            h("content-encoding", b"gzip");
            Some([b"\x1f\x8b\x08\x00".as_slice(), t.as_bytes()].concat())
        }
        29 => Some(format!("{{\"model\": \"{t}\", not json").into_bytes()),
        _ => Some(request_body(api, body_model.as_deref(), &t, stream, max_tokens, follow_up)),
    };
    if let Some(b) = &body {
        h("content-length", b.len().to_string().as_bytes());
    }

    // Metadata json_to_metadata lifts from the body (model-router, latency-guard), the trusted
    // override (model-router), latency-guard's avoid list (model-router).
    let model_metadata = match s % 20 {
        0 => Some(format!("llama-3-{t}")),
        1 => Some(format!("{t}-model")),
        2 => None,
        3 => Some(format!("gpt-4o-{t}")),
        4 => Some("llama-3-70b".into()),
        5 => Some(format!("mistral-{t}")),
        6 => Some("v1".into()),
        7 => Some("v2".into()),
        8 => Some(String::new()),
        9 => Some(format!("llama-{t}.x/é")),
        10 => Some(format!("gpt-{t}")),
        11 => Some(t.clone()),
        12 => Some(format!("llama-{t}")),
        13 => Some("mistral-large".into()),
        14 => Some("gpt-4o".into()),
        15 => Some(format!("llama-{t}-instruct")),
        16 => Some("v3".into()),
        17 => Some(format!("{t}-v1")),
        18 => Some(format!("llama-3-{t}")),
        _ => Some(format!("gpt-{t}-mini")),
    };
    let user_metadata = (!anonymous && s % 4 != 3).then(|| format!("{t}-user"));
    let force = match s % 5 {
        1 => Some("v2".to_string()),
        2 => Some(format!("{t}-force")),
        4 => Some("g1".into()),
        _ => None,
    };
    let avoid = match s % 15 {
        3 => Some("v1>v2".to_string()),
        8 => Some(format!("{t}>{t}")),
        11 => Some(format!("v1>,v2>{t}")),
        14 => Some("m1>".into()),
        _ => None,
    };

    // The upstream's answer.
    let status = match s % 20 {
        10 => 429,
        11 => 500,
        12 => 503,
        13 => 400,
        14 => 404,
        15 => 502,
        18 => 201,
        19 => 302,
        _ => 200,
    };
    let end = match s % 15 {
        10 | 11 => End::ClientGone,
        12 => End::UpstreamReset,
        13 => End::ClientGoneEarly,
        14 => End::UpstreamResetEarly,
        _ => End::Complete,
    };
    let finish = match (s / 3) % 5 {
        0 => Some(format!("{t}-finish")),
        1 => Some(["stop", "length", "end_turn", "max_output_tokens"][(s / 15) % 4].to_string()),
        2 => None,
        3 => Some(format!("{t} stop\u{0}")),
        _ => Some("stop".to_string()),
    };
    let answer = Answer {
        model: [format!("{t}-rmodel"), format!("gpt-4o-{t}"), format!("claude-{t}")][s % 3].clone(),
        finish,
        usage: (s % 5 != 4).then_some(([19, 1500, 3000, 6000, 12000, 40000][s % 6], 9)),
        text: format!("{t}-text"),
        error: (s % 20 == 17).then(|| format!("{t} upstream exploded")),
    };
    let sse = stream && (200..300).contains(&status);
    let pieces = if sse {
        sse_answer(api, &answer)
    } else if status >= 400 {
        vec![(error_answer(&t), false)]
    } else if status >= 300 {
        vec![(format!("<html>{t} moved</html>").into_bytes(), false)]
    } else {
        vec![(whole_answer(api, &answer), true)]
    };
    let gateway_reply = match s % 30 {
        19 => Some("504 deadline".to_string()),
        25 => Some("429 refused".to_string()),
        _ if s == 37 => Some(format!("{t} refused")),
        _ => None,
    };
    let code_details = (s % 30 == 27).then(|| "via_upstream".to_string());

    Traffic {
        s,
        t,
        api,
        path,
        headers,
        body,
        tenant,
        model_metadata,
        user_metadata,
        force,
        avoid,
        up: Upstream { status, sse, pieces, end, gateway_reply, code_details, answer },
    }
}

/// Sends request `tr` on a new stream: the properties earlier filters set, the headers, the body
/// (in two pieces every other request).
fn send<'g>(gw: &'g Gateway, tr: &Traffic) -> Stream<'g> {
    let mut s = gw.stream();
    if let Some(m) = &tr.model_metadata {
        s.set_property(&MODEL_METADATA, m.as_bytes());
    }
    if let Some(u) = &tr.user_metadata {
        s.set_property(&USER_METADATA, u.as_bytes());
    }
    if let Some(f) = &tr.force {
        s.set_property(&FORCE_PROPERTY, f.as_bytes());
    }
    if let Some(a) = &tr.avoid {
        s.set_property(&[AVOID], a.as_bytes());
    }
    s.request_headers(&tr.headers, tr.body.is_none()).expect("request headers");
    if let Some(body) = &tr.body {
        if tr.s.is_multiple_of(2) && body.len() > 1 {
            let (a, b) = body.split_at(body.len() / 2);
            s.request_body(a, false).expect("request body");
            s.request_body(b, true).expect("request body");
        } else {
            s.request_body(body, true).expect("request body");
        }
    }
    s
}

/// Plays the upstream's answer (and the surrounding filters' parts) to its end, a few ms apart.
fn play(gw: &Gateway, s: &mut Stream<'_>, tr: &Traffic) {
    let up = &tr.up;
    let step = Duration::from_millis(3);
    gw.advance(step).expect("advance");
    if let Some(g) = &up.gateway_reply {
        s.set_property(&[GATEWAY_REPLY], g.as_bytes());
    }
    match up.end {
        End::ClientGoneEarly => return s.client_reset().expect("client reset"),
        End::UpstreamResetEarly => return s.upstream_reset().expect("upstream reset"),
        _ => {}
    }
    let status = up.status.to_string();
    let content_type = if up.sse { "text/event-stream; charset=utf-8" } else { "application/json" };
    let model_header = format!("{}-served", tr.t);
    s.response_headers(
        &[(":status", status.as_str()), ("content-type", content_type), ("x-request-id", model_header.as_str()), ("openai-model", model_header.as_str())],
        false,
    )
    .expect("response headers");
    let n = up.pieces.len();
    for (k, (piece, _)) in up.pieces.iter().enumerate() {
        if up.end != End::Complete && k == 2 {
            break;
        }
        gw.advance(step).expect("advance");
        s.response_body(piece, up.end == End::Complete && k + 1 == n).expect("response body");
    }
    if let Some(d) = &up.code_details {
        s.set_property(&["response", "code_details"], d.as_bytes());
    }
    match up.end {
        End::ClientGone => s.client_reset().expect("client reset"),
        End::UpstreamReset => s.upstream_reset().expect("upstream reset"),
        _ => s.end().expect("end of stream"),
    }
}

// =============================================================================================
// llm-metrics
// =============================================================================================

const LLM_NAMED_VERSIONS: [&str; 2] = ["v1", "v2"];
const LLM_DYNAMIC_VERSIONS: usize = 8;
const LLM_TENANTS: [&str; 2] = ["acme", "initech"];

fn llm_config() -> String {
    json!({
        "path_prefixes": ["/v1/", "/openai/"],
        "tenant": {"header": "x-sluice-tenant"},
        "tenants": LLM_TENANTS,
        "model_versions": LLM_NAMED_VERSIONS,
        "max_dynamic_model_versions": LLM_DYNAMIC_VERSIONS,
        "prices": [
            {"model": "gpt-4o*", "input_usd_per_mtok": 2.5, "output_usd_per_mtok": 10},
            {"model": "claude-*", "input_usd_per_mtok": 3, "output_usd_per_mtok": 15}
        ]
    })
    .to_string()
}

/// llm-metrics' metric families and label vocabularies (plugins/core/src/report.rs and
/// plugins/llm-metrics/src/lib.rs).
fn llm_schema(named: &[&str], cap: usize, tenants: &[&str]) -> Schema {
    let model_version = Dim::Bounded { named: named.iter().map(|s| s.to_string()).collect(), cap };
    let base: Labels = vec![
        ("model_version", model_version.clone()),
        ("tenant", fixed(tenants.iter().copied().chain(["other", "anonymous"]))),
        ("api", fixed(["chat_completions", "completions", "responses", "messages"])),
        ("ctx", fixed(["1k", "2k", "4k", "8k", "16k", "over_16k", "unknown"])),
        ("turn", fixed(["first", "follow_up", "unknown"])),
        ("stream", fixed(["true", "false"])),
    ];
    let mut families: Vec<Family> = [
        "ttft_ms",
        "tpot_us",
        "decode_tokens_per_s",
        "request_duration_ms",
        "input_tokens",
        "output_tokens",
        "input_tokens_total",
        "output_tokens_total",
        "cached_input_tokens_total",
        "reasoning_tokens_total",
        "cost_micro_usd_total",
        "client_disconnects_total",
        "upstream_errors_total",
    ]
    .iter()
    .map(|m| family(&format!("sluice.{m}"), base.clone()))
    .collect();
    let mut requests = base.clone();
    requests.push(("status", fixed(["1xx", "2xx", "3xx", "4xx", "5xx", "none"])));
    requests.push(("finish", fixed(KNOWN_FINISH_REASONS.iter().copied().chain(["none", "other"]))));
    requests.push(("usage", fixed(["reported", "estimated"])));
    families.push(family("sluice.requests_total", requests));
    let mut replies = base.clone();
    replies.push(("reason", fixed(["refused", "deadline"])));
    families.push(family("sluice.gateway_replies_total", replies));
    families.push(family("sluice.in_flight", vec![("model_version", model_version.clone())]));
    families.push(family("sluice.request_body_uninspected_total", vec![("reason", fixed(["malformed", "encoded", "too_large"]))]));
    // What the model wrote: per model version only.
    families.push(family("sluice.quality.repetition_per_mille", vec![("model_version", model_version.clone())]));
    families.push(family(
        "sluice.quality.output_tokens",
        vec![("model_version", model_version.clone()), ("finish", fixed(KNOWN_FINISH_REASONS.iter().copied().chain(["none", "other"])))],
    ));
    families.push(family("sluice.quality.degenerate_answers_total", vec![("model_version", model_version), ("reason", fixed(["empty", "truncated"]))]));
    Schema { plugin: "llm-metrics", families }
}

/// Bound (printed by the test): every per-request metric carries model_version × tenant × api ×
/// ctx × turn × stream = (2 named + 8 dynamic + other) × (2 tenants + other + anonymous) × 4 × 7 ×
/// 3 × 2 = 7392 label tuples; 13 metrics carry only those (96 096), `requests_total` adds status (6)
/// × finish (17 documented + none + other) × usage (2) = 228 (1 685 376), `gateway_replies_total`
/// adds reason (2) (14 784); plus `in_flight` per model version (11) and
/// `request_body_uninspected_total` per reason (3); the quality families per model version (11):
/// repetition (11), output tokens × finish (19: 209), degenerate answers × reason (2: 22): 1 796 512.
/// The tight checks are the label
/// vocabularies: at most 8 dynamic model versions, tenants only `acme`, `initech`, `other`,
/// `anonymous`, finish only the documented reasons, `none` and `other`.
#[test]
fn llm_metrics_labels_stay_bounded_whatever_clients_and_upstreams_send() {
    let gw = Gateway::start(&common::llm::plugin(), common::llm::spec(&llm_config())).expect("llm-metrics starts");
    let result = run(&gw, |i| {
        let tr = traffic(i);
        let mut s = send(&gw, &tr);
        play(&gw, &mut s, &tr);
    });
    let schema = llm_schema(&LLM_NAMED_VERSIONS, LLM_DYNAMIC_VERSIONS, &LLM_TENANTS);
    assert_bounded(&schema, &result, LLM_DYNAMIC_VERSIONS);
}

// =============================================================================================
// tenant-budget
// =============================================================================================

const BUDGET_NAMED_VERSIONS: [&str; 2] = ["v1", "v2"];
const BUDGET_DYNAMIC_VERSIONS: usize = 4;

/// One org, two teams, five keys: `search-prod` (API key, a minute token budget, and 2 requests a
/// minute per identity: the user who comes back is refused), `search-dev` (a USD budget: unpriced
/// models are refused), `tiny` (3 requests a month: refused from the 4th), `soft` (a token budget
/// with a soft limit, soon crossed and then exhausted, clamping on the way), `ops` (no budget of
/// its own); a team budget with a soft limit, a per-identity team budget and an org request
/// budget. Identities (`identity_budgets`) come from the `x-user` header, else the JWT's `sub`.
fn budget_policy() -> Value {
    json!({
        "identity": {
            "api_key": true, "header": "x-sluice-key", "jwt": {"header": "x-jwt-payload", "claim": "sluice_key"},
            "per_identity": {"header": "x-user", "jwt": {"header": "x-jwt-payload", "claim": "sub"}}
        },
        "prices": common::budget::prices(),
        "clamp": {"enabled": true, "min_output_tokens": 8},
        "model_versions": BUDGET_NAMED_VERSIONS,
        "max_dynamic_model_versions": BUDGET_DYNAMIC_VERSIONS,
        "orgs": [{
            "id": "acme",
            "budgets": [{"window": "month", "requests": 10_000_000}],
            "teams": [
                {
                    "id": "search",
                    "budgets": [{"window": "day", "tokens": 5_000_000, "soft_limit_percent": 1}],
                    "identity_budgets": [{"window": "day", "tokens": 1_000_000}],
                    "keys": [
                        {"id": "search-prod", "api_key_sha256": API_KEY_SHA256,
                         "budgets": [{"window": "minute", "tokens": 1_000_000_000}],
                         "identity_budgets": [{"window": "minute", "requests": 2}]},
                        {"id": "search-dev", "api_key_sha256": ANTHROPIC_KEY_SHA256,
                         "budgets": [{"window": "month", "usd": 10_000}]},
                        {"id": "tiny", "budgets": [{"window": "month", "requests": 3}]}
                    ]
                },
                {
                    "id": "labs",
                    "keys": [
                        {"id": "soft", "budgets": [{"window": "month", "tokens": 60_000, "soft_limit_percent": 50}]},
                        {"id": "ops"}
                    ]
                }
            ]
        }]
    })
}

/// tenant-budget's metric families (plugins/core/src/flow/budget/mod.rs), their labels drawn from
/// `policy`: key paths, budget counters and their codes.
fn budget_schema(policy: &Value, named: &[&str], cap: usize) -> Schema {
    let mut keys = Vec::new();
    let mut paths: Vec<Labels> = Vec::new();
    let mut counters: Vec<Labels> = Vec::new();
    let mut codes = Vec::new();
    let mut add_budgets = |level: &'static str, owner: &str, budgets: &Value, per_identity: bool| {
        for b in budgets.as_array().into_iter().flatten() {
            let window = b["window"].as_str().expect("window");
            let measure = if b.get("tokens").is_some() {
                "total_tokens"
            } else if b.get("requests").is_some() {
                "requests"
            } else {
                "micro_usd"
            };
            counters.push(vec![(level, fixed([owner])), ("window", fixed([window])), ("unit", fixed([measure]))]);
            let suffix = if per_identity { "_per_identity" } else { "" };
            codes.push(format!("{level}_{owner}_{window}_{measure}{suffix}").replace(|c: char| !c.is_ascii_alphanumeric() && c != '_' && c != '-', "_"));
        }
    };
    for org in policy["orgs"].as_array().expect("orgs") {
        let o = org["id"].as_str().expect("org id");
        add_budgets("org", o, &org["budgets"], false);
        add_budgets("org", o, &org["identity_budgets"], true);
        for team in org["teams"].as_array().into_iter().flatten() {
            let tm = team["id"].as_str().expect("team id");
            add_budgets("team", tm, &team["budgets"], false);
            add_budgets("team", tm, &team["identity_budgets"], true);
            for key in team["keys"].as_array().into_iter().flatten() {
                let k = key["id"].as_str().expect("key id");
                add_budgets("key", k, &key["budgets"], false);
                add_budgets("key", k, &key["identity_budgets"], true);
                keys.push(k.to_string());
                paths.push(vec![("key", fixed([k])), ("team", fixed([tm])), ("org", fixed([o]))]);
            }
        }
    }
    let model_version = Dim::Bounded { named: named.iter().map(|s| s.to_string()).collect(), cap };
    let charge = |metric: &str| Family {
        metric: metric.to_string(),
        variants: paths
            .iter()
            .map(|p| {
                let mut v = p.clone();
                v.push(("model_version", model_version.clone()));
                v
            })
            .collect(),
    };
    let reasons: Vec<String> = [
        "unknown_key",
        "encoded_body",
        "no_body",
        "body_too_large",
        "malformed_body",
        "unrewritable_body",
        "unpriced_model",
        "budget_store_unavailable",
        "budget_ledger_unavailable",
    ]
    .iter()
    .map(|r| r.to_string())
    .chain(codes)
    .collect();
    Schema {
        plugin: "tenant-budget",
        families: vec![
            family("sluice.budget.rejections_total", vec![("key", fixed(keys.iter().map(String::as_str).chain(["unknown"]))), ("reason", Dim::Fixed(reasons))]),
            family("sluice.budget.clamps_total", vec![("key", fixed(&keys))]),
            charge("sluice.budget.charged_tokens_total"),
            charge("sluice.budget.charged_micro_usd_total"),
            family("sluice.budget.overestimate_tokens", vec![("key", fixed(&keys))]),
            Family { metric: "sluice.budget.remaining".into(), variants: counters.clone() },
            Family { metric: "sluice.budget.soft_limit_crossings_total".into(), variants: counters },
            // The Redis ledger's health and calls.
            family("sluice.budget.ledger_up", vec![]),
            family(
                "sluice.budget.ledger_calls_total",
                vec![("call", fixed(["reserve", "settle", "write_back"])), ("result", fixed(["ok", "timeout", "error"]))],
            ),
            family("sluice.budget.ledger_latency_ms", vec![("call", fixed(["reserve", "settle", "write_back"]))]),
            family("sluice.budget.ledger_fallback_total", vec![("action", fixed(["allow", "local"]))]),
            family("sluice.budget.ledger_settlements_dropped_total", vec![]),
        ],
    }
}

/// `budget_policy` with its counters in Redis, through `sluice-ledger` (played by
/// [`answer_ledger`]); when the ledger does not answer, requests are admitted against the local
/// fallback ledger.
fn budget_policy_redis() -> Value {
    let mut p = budget_policy();
    p["ledger"] = json!({"mode": "redis", "cluster": "sluice_ledger", "timeout_ms": 200,
                         "on_failure": "local", "replicas": 4});
    p
}

/// The ledger service answers every pending call: a reservation is admitted, refused (its first
/// counter, with the service's own figures), failed (timeout) or answered with garbage, by the
/// request's position in the period; a settlement is taken, except that each one fails once for
/// a tenth of the requests (and is retried).
fn answer_ledger(gw: &Gateway, tr: &Traffic, settled_once: &mut BTreeSet<Vec<u8>>) {
    let reply = |v: Value| HttpReply::status(200).header("content-type", "application/json").body(v.to_string());
    // A refusal may come back as a clamped retry: answer until nothing is pending.
    for _ in 0..8 {
        let calls = gw.http_calls();
        if calls.is_empty() {
            return;
        }
        for call in calls {
            let body: Value = serde_json::from_slice(&call.body).unwrap_or(Value::Null);
            let r = match call.headers.get(":path").unwrap_or_default() {
                "/v1/reserve" => {
                    let n = body["counters"].as_array().map_or(0, Vec::len);
                    match tr.s % 10 {
                        1 => Some(reply(json!({"admitted": false, "refused": 0, "used": 999_999,
                                                "reserved": 0, "limit": 1_000}))),
                        2 => None,
                        7 => Some(HttpReply::status(500).body(format!("{} ledger exploded", tr.t).into_bytes())),
                        _ => Some(reply(json!({"admitted": true, "replayed": false,
                            "counters": vec![json!({"used": 0, "reserved": 1}); n]}))),
                    }
                }
                "/v1/settle" => {
                    let n = body["charges"].as_array().map_or(0, Vec::len);
                    if tr.s % 10 == 4 && settled_once.insert(call.body.clone()) {
                        None
                    } else {
                        Some(reply(json!({"settled": true,
                            "counters": vec![json!({"used": 1, "reserved": 0}); n]})))
                    }
                }
                // Several settlements due in one tick: each settled.
                "/v1/settle_batch" => {
                    let items = body["settlements"].as_array().cloned().unwrap_or_default();
                    let results: Vec<Value> = items
                        .iter()
                        .map(|item| {
                            let n = item["charges"].as_array().map_or(0, Vec::len);
                            json!({"status": 200, "answer": {"settled": true, "counters": vec![json!({"used": 1, "reserved": 0}); n]}})
                        })
                        .collect();
                    Some(reply(json!({ "results": results })))
                }
                _ => None,
            };
            match r {
                Some(r) => gw.respond_http_call(call.token, r).expect("answer the ledger call"),
                None => gw.fail_http_call(call.token).expect("fail the ledger call"),
            }
        }
    }
}

/// Bound (printed by the test), from the policy: `rejections_total` key (5 keys + unknown) ×
/// reason (9 fixed codes + 8 budget codes, two of them per-identity) = 102; `clamps_total` and
/// `overestimate_tokens` one per key (5 + 5); the two charge metrics one per key path ×
/// model_version (2 named + 4 dynamic + other = 7): 2 × 35 = 70; `remaining` and
/// `soft_limit_crossings_total` one per budget counter, per-identity ones included (8 + 8); the
/// Redis ledger's `ledger_up` 1, `ledger_calls_total` 3 calls × 3 results = 9,
/// `ledger_latency_ms` 3, `ledger_fallback_total` 2, `ledger_settlements_dropped_total` 1: 214.
/// The tight checks: model_version at most 4 dynamic values, keys only the policy's (and
/// `unknown`), reasons only fixed codes and budget codes, no identity anywhere. The same traffic
/// runs against the local ledger and against the Redis ledger.
#[test]
fn tenant_budget_labels_stay_bounded_whatever_clients_and_upstreams_send() {
    let start = common::budget::at(common::budget::MAR31_120030);
    for policy in [budget_policy(), budget_policy_redis()] {
        let gw = Gateway::start(&common::budget::plugin(), common::budget::spec(&policy.to_string()).start_time(start)).expect("tenant-budget starts");
        let mut settled_once = BTreeSet::new();
        let result = run(&gw, |i| {
            let tr = traffic(i);
            let mut s = send(&gw, &tr);
            answer_ledger(&gw, &tr, &mut settled_once);
            play(&gw, &mut s, &tr);
            // Redis mode: settlements leave from the root's tick.
            gw.advance(Duration::from_millis(25)).expect("advance");
            answer_ledger(&gw, &tr, &mut settled_once);
        });
        let mut schema = budget_schema(&policy, &BUDGET_NAMED_VERSIONS, BUDGET_DYNAMIC_VERSIONS);
        if policy["ledger"]["mode"] == "redis" {
            schema.plugin = "tenant-budget (Redis ledger)";
        }
        assert_bounded(&schema, &result, BUDGET_DYNAMIC_VERSIONS);
    }
}

// =============================================================================================
// model-router
// =============================================================================================

/// Three glob entries: `llama-*` (v1 takes everything, v2 only as fallback or by override; a
/// shadow of every request but the `bank-*` tenants', at most 2 in flight), `gpt-*` (one version:
/// when its route has no healthy upstream nothing is left, `unrouted … no_version`), `mistral-*`
/// (a ramp in the past: reason `ramp`).
fn router_policy() -> Value {
    json!({
        "sticky_key": [
            {"header": "x-sluice-tenant"},
            {"api_key": true},
            {"property": USER_METADATA}
        ],
        "route_header": "x-sluice-route",
        "version_header": "x-model-version",
        "override": {"property": FORCE_PROPERTY, "client_header": "x-sluice-force-version"},
        "models": [
            {
                "model": "llama-*",
                "versions": [
                    {"name": "v1", "weight": 100, "upstream_model": "llama-3-70b", "route": "llama-v1"},
                    {"name": "v2", "weight": 0, "upstream_model": "llama-3-70b-v2", "route": "llama-v2"}
                ],
                "fallback": ["v1", "v2"],
                "shadow": {
                    "version": {"name": "qwen-72b-v1", "upstream_model": "qwen-72b", "route": "qwen-v1",
                                "cluster": "qwen_v1", "authority": "qwen.internal"},
                    "fraction": 1.0,
                    "max_concurrent": 2,
                    "exclude_tenants": ["bank-*"],
                    "tenant_header": "x-sluice-tenant"
                }
            },
            {
                "model": "gpt-*",
                "versions": [{"name": "g1", "weight": 1, "upstream_model": "gpt-4o", "route": "gpt"}]
            },
            {
                "model": "mistral-*",
                "versions": [
                    {"name": "m1", "weight": 1, "upstream_model": "mistral-large", "route": "mistral-1",
                     "ramp": [{"at": "2025-01-01T00:00:00Z", "weight": 100}]},
                    {"name": "m2", "weight": 0, "upstream_model": "mistral-large-2", "route": "mistral-2"}
                ]
            }
        ]
    })
}

fn sanitized(v: &str) -> String {
    v.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '-' { c } else { '_' }).collect()
}

/// model-router's metric families (plugins/model-router/src/lib.rs), labels drawn from `policy`.
fn router_schema(policy: &Value) -> Schema {
    let reasons = fixed(["weight", "ramp", "override", "fallback", "unkeyed"]);
    let mut requests = Vec::new();
    let mut patterns = Vec::new();
    let mut primaries = Vec::new();
    let mut shadows = Vec::new();
    for m in policy["models"].as_array().expect("models") {
        let pattern = sanitized(m["model"].as_str().expect("model"));
        let versions: Vec<String> = m["versions"].as_array().expect("versions").iter().map(|v| sanitized(v["name"].as_str().expect("name"))).collect();
        requests.push(vec![("model", fixed([&pattern])), ("version", Dim::Fixed(versions.clone())), ("reason", reasons.clone())]);
        if let Some(shadow) = m.get("shadow") {
            primaries.extend(versions.iter().cloned());
            shadows.push(sanitized(shadow["version"]["name"].as_str().expect("shadow name")));
        }
        patterns.push(pattern);
    }
    let pair = || -> Labels { vec![("primary", Dim::Fixed(primaries.clone())), ("shadow", Dim::Fixed(shadows.clone()))] };
    let with = |extra: Vec<(&'static str, Dim)>| -> Labels {
        let mut v = pair();
        v.extend(extra);
        v
    };
    let sides = fixed(["primary", "shadow"]);
    Schema {
        plugin: "model-router",
        families: vec![
            Family { metric: "sluice.router.requests_total".into(), variants: requests },
            Family {
                metric: "sluice.router.unrouted_total".into(),
                variants: vec![
                    vec![("reason", fixed(["no_model", "unknown_model"]))],
                    vec![("reason", fixed(["no_version"])), ("model", Dim::Fixed(patterns))],
                ],
            },
            family("sluice.router.shadow_total", with(vec![("result", fixed(["sent", "failed", "sampled", "skipped_cap", "excluded", "refused"]))])),
            family("sluice.router.compare_duration_ms", with(vec![("side", sides.clone())])),
            family("sluice.router.compare_output_tokens", with(vec![("side", sides.clone())])),
            family("sluice.router.compare_errors_total", with(vec![("side", sides)])),
            family("sluice.router.compare_ttft_ms", with(vec![("side", fixed(["primary"]))])),
            family("sluice.router.compare_total", with(vec![("finish_agree", fixed(["true", "false"]))])),
            family("sluice.router.compare_similarity_per_mille", pair()),
        ],
    }
}

/// The shadow upstream answers what is pending: a whole answer with its own model, finish reason
/// and status, or a failed call; for a stretch of each period it answers nothing, so the
/// concurrency cap skips shadows.
fn answer_shadows(gw: &Gateway, tr: &Traffic) {
    if (40..=52).contains(&tr.s) {
        return;
    }
    for (k, call) in gw.http_calls().into_iter().enumerate() {
        let t = format!("{}-shadow{k}", tr.t);
        let answer = Answer {
            model: format!("{t}-model"),
            finish: [Some(format!("{t}-finish")), Some("stop".into()), None][tr.s % 3].clone(),
            usage: Some((19, 9)),
            text: t.clone(),
            error: None,
        };
        match tr.s % 5 {
            3 => gw.fail_http_call(call.token).expect("fail the shadow call"),
            status => {
                let status = [200, 200, 500, 0, 429][status];
                let body = if status == 200 { whole_answer(tr.api, &answer) } else { error_answer(&t) };
                gw.respond_http_call(call.token, HttpReply::status(status).header("content-type", "application/json").body(body))
                    .expect("answer the shadow call");
            }
        }
    }
}

/// Bound (printed by the test), from the policy: `requests_total` per model entry, its versions ×
/// reason (5): (2 + 1 + 2) × 5 = 25; `unrouted_total` 2 reasons + `no_version` × 3 entries = 5;
/// `shadow_total` shadowed versions (2) × shadows (1) × result (6) = 12; the comparison metrics
/// 2 × (2 + 2 + 2 + 1 + 2 + 1) = 20: 62 in all. No label of model-router takes a value from the
/// request: entries, versions and shadows are the policy's.
#[test]
fn model_router_labels_stay_bounded_whatever_clients_and_upstreams_send() {
    let policy = router_policy();
    let gw = Gateway::start(&common::router::plugin(), common::router::spec(&policy.to_string())).expect("model-router starts");
    let result = run(&gw, |i| {
        let mut tr = traffic(i);
        // Once a period, Envoy finds no healthy upstream for the request's route (a `gpt-*` one):
        // that route is skipped for 10 s, so the period's later `gpt-*` requests have no version.
        if tr.s == 30 {
            tr.up.code_details = Some("no_healthy_upstream".into());
        }
        let mut s = send(&gw, &tr);
        play(&gw, &mut s, &tr);
        // The router's 20 ms tick sends the shadow.
        gw.advance(Duration::from_millis(21)).expect("advance");
        answer_shadows(&gw, &tr);
        if tr.s == PERIOD - 1 {
            // The next period starts with every route healthy again.
            gw.advance(Duration::from_millis(10_500)).expect("advance");
        }
    });
    let schema = router_schema(&policy);
    assert_bounded(&schema, &result, 0);
}

// =============================================================================================
// latency-guard
// =============================================================================================

/// Classes `interactive` (critical, `crit-*`), `standard` (`std-*`), `batch` (sheddable,
/// `batch-*`), everyone else `other`; versions `v1` (deadlines, output ceiling, in-flight limit 2,
/// a TTFT breaker failing over to `v2`, open 5 s, then probing with every request), `v2` (a TTFT
/// deadline, in-flight limit 1), `v3` (nothing).
fn guard_policy() -> Value {
    json!({
        "tenant": {"header": "x-sluice-tenant"},
        "classes": [
            {"name": "interactive", "priority": "critical", "tenants": ["crit-*"]},
            {"name": "standard", "priority": "standard", "tenants": ["std-*"]},
            {"name": "batch", "priority": "sheddable", "tenants": ["batch-*"]}
        ],
        "versions": [
            {
                "name": "v1",
                "ttft_deadline_ms": 40,
                "total_deadline_ms": 100,
                "max_output_tokens": 64,
                "in_flight": {"limit": 2},
                "breaker": {
                    "objective": {"percentile": 95, "ttft_ms": 10},
                    "window_s": 1, "slots": 2, "min_samples": 4, "open_for_ms": 5_000,
                    "probe_percent": 100, "probes": 2, "fallback": "v2"
                }
            },
            {"name": "v2", "ttft_deadline_ms": 40, "in_flight": {"limit": 1}},
            {"name": "v3"}
        ]
    })
}

/// latency-guard's metric families (plugins/latency-guard/src/lib.rs), labels drawn from `policy`.
fn guard_schema(policy: &Value) -> Schema {
    let versions = Dim::Fixed(policy["versions"].as_array().expect("versions").iter().map(|v| sanitized(v["name"].as_str().expect("name"))).collect());
    let classes = Dim::Fixed(
        policy["classes"].as_array().expect("classes").iter().map(|c| sanitized(c["name"].as_str().expect("name"))).chain(["other".to_string()]).collect(),
    );
    let priorities = fixed(["critical", "standard", "sheddable"]);
    let v = || ("version", versions.clone());
    Schema {
        plugin: "latency-guard",
        families: vec![
            family(
                "sluice.latency.requests_total",
                vec![v(), ("class", classes), ("outcome", fixed(["ok", "error", "client_disconnect", "ttft", "total", "refused", "deadline"]))],
            ),
            family("sluice.latency.deadline_total", vec![v(), ("kind", fixed(["ttft", "total"])), ("action", fixed(["reply_504", "reset", "error_event"]))]),
            family("sluice.latency.shed_total", vec![v(), ("priority", priorities.clone()), ("reason", fixed(["breaker_open", "in_flight"]))]),
            family("sluice.latency.fallback_unavailable_total", vec![v(), ("priority", priorities)]),
            family("sluice.latency.in_flight", vec![v()]),
            family("sluice.latency.probes_total", vec![v()]),
            family("sluice.latency.output_capped_total", vec![v()]),
            family("sluice.latency.breaker_state", vec![v()]),
            family("sluice.latency.breaker_transitions_total", vec![v(), ("to", fixed(["closed", "open", "half_open"]))]),
        ],
    }
}

/// One step of an exchange, at a millisecond offset from its start.
enum Step {
    Headers(&'static str, bool),
    Piece(Vec<u8>, bool, bool),
    GatewayReply(String),
    ClientGone,
    UpstreamReset,
    End,
}

/// What the upstream does with a guarded request, by the period's phase: slow first tokens while
/// the breaker should open, a mix of failures while it is open, fast answers while it probes and
/// closes.
fn guard_steps(tr: &Traffic) -> Vec<(u64, Step)> {
    let s = tr.s;
    let answer = &tr.up.answer;
    let mut events: Vec<(Vec<u8>, bool)> = sse_answer(tr.api, answer);
    let stream = |first: u64, gap: u64, events: &mut Vec<(Vec<u8>, bool)>| -> Vec<(u64, Step)> {
        let mut out = vec![(1, Step::Headers("200", true))];
        let mut at = 1;
        let mut content_seen = false;
        let n = events.len();
        for (k, (bytes, content)) in events.drain(..).enumerate() {
            if content {
                at = if content_seen { at + gap } else { first };
                content_seen = true;
            }
            out.push((at, Step::Piece(bytes, content, k + 1 == n)));
        }
        out.push((at, Step::End));
        out
    };
    let error = |status: &'static str| -> Vec<(u64, Step)> {
        vec![(2, Step::Headers(status, false)), (3, Step::Piece(error_answer(&tr.t), false, true)), (3, Step::End)]
    };
    let cut = |last: Step, events: &mut Vec<(Vec<u8>, bool)>| -> Vec<(u64, Step)> {
        let mut out = vec![(1, Step::Headers("200", true))];
        for (k, (bytes, content)) in events.drain(..).take(3).enumerate() {
            out.push((1 + 2 * k as u64, Step::Piece(bytes, content, false)));
        }
        out.push((8, last));
        out
    };
    let phase_a = s < 20;
    let phase_b = (20..32).contains(&s);
    match (phase_a, phase_b) {
        // Slow first tokens (the breaker's TTFT objective is 10 ms), a few deadlines.
        (true, _) => match s % 10 {
            7 => stream(45, 2, &mut events),
            9 => cut(Step::ClientGone, &mut events),
            _ => stream(25, 2, &mut events),
        },
        // The breaker is open: every kind of ending.
        (_, true) => match s - 20 {
            0 => error("500"),
            1 => stream(3, 50, &mut events), // past the total deadline: an error event, then a reset
            2 => cut(Step::UpstreamReset, &mut events),
            3 => vec![(45, Step::Headers("200", true)), (45, Step::End)], // no headers by the TTFT deadline: 504
            4 => {
                let whole = whole_answer(tr.api, answer);
                vec![(8, Step::Headers("200", false)), (9, Step::Piece(whole, true, true)), (9, Step::End)]
            }
            5 => vec![
                (0, Step::GatewayReply("429 refused".into())),
                (1, Step::Headers("429", false)),
                (1, Step::Piece(error_answer(&tr.t), false, true)),
                (1, Step::End),
            ],
            6 => {
                // A stream that stalls after its first token: reset 500 ms after the total deadline.
                let mut out = cut(Step::End, &mut events);
                out.last_mut().expect("end").0 = 700;
                out
            }
            7 => error("400"),
            8 => vec![(2, Step::UpstreamReset)],
            9 => vec![(0, Step::GatewayReply("504 deadline".into())), (1, Step::ClientGone)],
            _ => stream(3, 2, &mut events),
        },
        // Fast answers: probes pass, the breaker closes.
        _ => match s % 10 {
            3 => error("503"),
            6 => cut(Step::ClientGone, &mut events),
            _ => stream(3, 2, &mut events),
        },
    }
}

/// Request `tr` as the guard receives it: the route model-router decided (or none), the model in
/// metadata, llm-metrics behind it (waking it through its queue, or not), the body.
fn guard_request(tr: &Traffic) -> lat::Req {
    let s = tr.s;
    let route = match s % 12 {
        0 | 6 | 7 => Route::Version("v1".into()),
        1 | 2 | 9 => Route::Router { preferred: "v1".into() },
        3 => Route::Version(format!("{}-ver", tr.t)),
        4 => Route::Raw(format!("{{\"version\": 7, \"x\": \"{}\"}}", tr.t).into_bytes()),
        5 => Route::Nothing,
        8 => Route::Version("v2".into()),
        10 => Route::Version("v3".into()),
        _ => Route::Raw([b"\xff".as_slice(), tr.t.as_bytes()].concat()),
    };
    let request_id = tr.headers.iter().find(|(k, _)| k == b"x-request-id").map(|(_, v)| String::from_utf8_lossy(v).into_owned()).unwrap_or_default();
    lat::Req {
        tenant: tr.tenant.clone(),
        request_id,
        route,
        metadata: tr.model_metadata.clone(),
        llm_metrics: s % 30 != 29,
        wake: s % 10 != 3,
        path: tr.path.clone(),
        body: tr.body.clone().unwrap_or_else(|| request_body(tr.api, None, &tr.t, true, None, false)),
    }
}

/// Bound (printed by the test), from the policy: `requests_total` version (3) × class (3 + other)
/// × outcome (7) = 84; `deadline_total` 3 × 2 kinds × 3 actions = 18; `shed_total` 3 × 3 priorities
/// × 2 reasons = 18; `fallback_unavailable_total` 3 × 3 = 9; `in_flight`, `probes_total`,
/// `output_capped_total`, `breaker_state` 3 each; `breaker_transitions_total` 3 × 3 = 9: 150. No
/// label of latency-guard takes a value from the request: versions and classes are the policy's.
#[test]
fn latency_guard_labels_stay_bounded_whatever_clients_and_upstreams_send() {
    let policy = guard_policy();
    let gw = lat::gateway(&policy);
    let mut checkpoint = Vec::new();
    let started = Instant::now();
    // Rounds of 4 concurrent requests (the in-flight limits), played in time order.
    for round in 0..REQUESTS / 4 {
        let trs: Vec<Traffic> = (0..4).map(|k| traffic(round * 4 + k)).collect();
        let s = trs[0].s;
        if s == 32 {
            // The breaker's open time passes: it probes (every request, so that nothing depends
            // on the request ids' draws).
            gw.advance(Duration::from_millis(5_300)).expect("advance");
        }
        let mut xs: Vec<Exchange<'_>> = trs.iter().map(|tr| guard_request(tr).send(&gw)).collect();
        let plans: Vec<Vec<(u64, Step)>> = trs.iter().map(guard_steps).collect();
        let mut order: Vec<(u64, usize, usize)> =
            plans.iter().enumerate().flat_map(|(e, p)| p.iter().enumerate().map(move |(k, (ms, _))| (*ms, e, k))).collect();
        order.sort_unstable();
        for (ms, e, k) in order {
            let x = &mut xs[e];
            match &plans[e][k].1 {
                Step::Headers(status, sse) => x.response_headers(ms, status, if *sse { "text/event-stream; charset=utf-8" } else { "application/json" }),
                Step::Piece(bytes, content, end) => x.chunk(ms, bytes, *content, *end),
                Step::GatewayReply(v) => {
                    x.at(ms);
                    x.stream.set_property(&[GATEWAY_REPLY], v.as_bytes());
                }
                Step::ClientGone => {
                    x.at(ms);
                    x.stream.client_reset().expect("client reset");
                }
                Step::UpstreamReset => {
                    x.at(ms);
                    x.stream.upstream_reset().expect("upstream reset");
                }
                Step::End => {
                    x.at(ms);
                    x.end();
                }
            }
        }
        drop(xs);
        gw.advance(Duration::from_millis(2)).expect("advance");
        if s + 4 == PERIOD {
            // The window forgets the period.
            gw.advance(Duration::from_millis(2_000)).expect("advance");
        }
        if (round + 1) * 4 == CHECKPOINT {
            checkpoint = gw.metric_names();
        }
    }
    assert_eq!(gw.crashed(), None, "the plugin must never trap");
    let result = Run { at_checkpoint: checkpoint, at_end: gw.metric_names(), elapsed: started.elapsed() };
    let schema = guard_schema(&policy);
    assert_bounded(&schema, &result, 0);
}
