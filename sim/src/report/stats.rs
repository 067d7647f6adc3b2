//! The numbers of a report: percentiles, context buckets and the [`Summary`] of a verdict set.

use super::{ReportInput, Source};
use crate::verdict::{Decision, Quality, Verdict};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// The context buckets of prompt tokens, by inclusive upper edge; above the last edge is `>16K`.
pub const CONTEXT_BUCKETS: [(&str, u64); 5] = [("≤1K", 1024), ("≤2K", 2048), ("≤4K", 4096), ("≤8K", 8192), ("≤16K", 16384)];

/// The label of the bucket above the last edge.
pub const CONTEXT_TOP: &str = ">16K";

/// The tenant name of requests without one (llm-metrics' label for them).
pub const ANONYMOUS: &str = "anonymous";

/// The context bucket of a prompt: edges 1024, 2048, … 16384 are inclusive (1024 tokens is `≤1K`,
/// 1025 is `≤2K`).
pub fn context_bucket(prompt_tokens: u64) -> &'static str {
    CONTEXT_BUCKETS.iter().find(|(_, edge)| prompt_tokens <= *edge).map_or(CONTEXT_TOP, |(label, _)| label)
}

/// All bucket labels in order.
pub fn context_labels() -> impl Iterator<Item = &'static str> {
    CONTEXT_BUCKETS.iter().map(|(label, _)| *label).chain(std::iter::once(CONTEXT_TOP))
}

/// The `p`-th percentile (0 < p ≤ 100) of values sorted ascending, by the **nearest-rank** method:
/// the value at rank ⌈p/100 × n⌉ (1-based, at least 1), so every result is one of the values, never
/// an interpolation. An empty set has none. For 1..=100, p50 is 50 and p99 is 99; for
/// [15, 20, 35, 40, 50], p30 is 20 and p50 is 35.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() || !(p > 0.0 && p <= 100.0) {
        return None;
    }
    let n = sorted.len() as f64;
    // p × n first, then / 100: exact for whole percents (0.99 × 100 would round up to 99.000…01).
    let rank = ((p * n / 100.0) - 1e-9).ceil().max(1.0) as usize;
    sorted.get(rank.min(sorted.len()) - 1).copied()
}

/// The finite values, sorted ascending (what [`percentile`] needs).
pub fn sorted(values: impl IntoIterator<Item = f64>) -> Vec<f64> {
    let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    v
}

/// A request's decode speed, tokens/s: (output tokens − 1) over the time after the first token.
/// Streams only (a whole answer has no first-token time), and only when both are positive.
pub fn decode_tokens_per_s(v: &Verdict) -> Option<f64> {
    let ttft = v.ttft_ms?;
    let decode_ms = v.duration_ms - ttft;
    if !v.stream || v.output_tokens < 2 || decode_ms.is_nan() || decode_ms <= 0.0 {
        return None;
    }
    let tps = (v.output_tokens - 1) as f64 / (decode_ms / 1000.0);
    tps.is_finite().then_some(tps)
}

/// USD per million tokens; none without tokens.
pub fn usd_per_mtok(cost_usd: f64, tokens: u64) -> Option<f64> {
    (tokens > 0).then(|| cost_usd / tokens as f64 * 1e6)
}

/// The request's cost, when known and finite.
pub(crate) fn cost(v: &Verdict) -> f64 {
    v.cost_usd.filter(|c| c.is_finite()).unwrap_or(0.0)
}

/// The tenant a report shows for a request.
pub(crate) fn tenant_name(v: &Verdict) -> &str {
    v.tenant.as_deref().unwrap_or(ANONYMOUS)
}

/// Sent upstream (admitted or clamped).
pub(crate) fn is_admitted(v: &Verdict) -> bool {
    v.decision != Decision::Refused
}

/// Requests by decision.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DecisionCounts {
    pub admitted: u64,
    pub clamped: u64,
    pub refused: u64,
}

/// Percentiles of one set of values, ms (none when the set is empty).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    /// How many values there were.
    pub samples: u64,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
}

impl Latency {
    pub fn of(values: impl IntoIterator<Item = f64>) -> Latency {
        let s = sorted(values);
        Latency { samples: s.len() as u64, p50_ms: percentile(&s, 50.0), p99_ms: percentile(&s, 99.0) }
    }
}

/// One model version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VersionSummary {
    pub version: String,
    /// Requests routed to it (refused ones included when they had been routed).
    pub requests: u64,
    /// Of those, sent upstream (admitted or clamped).
    pub admitted: u64,
    /// Of the admitted, outcome `completed`.
    pub completed: u64,
    /// `completed` / `admitted`; none without admitted requests.
    pub availability: Option<f64>,
    pub ttft: Latency,
    pub tpot: Latency,
    /// Median decode speed, tokens/s, of its streams ([`decode_tokens_per_s`]).
    pub decode_tokens_per_s_p50: Option<f64>,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cost_usd: f64,
    /// cost / (input + output tokens) × 1e6.
    pub usd_per_mtok: Option<f64>,
}

/// TTFT of one version within one context bucket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BucketVersion {
    pub version: String,
    /// Requests of this version in the bucket.
    pub requests: u64,
    pub ttft: Latency,
}

/// One context bucket of prompt tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContextSummary {
    /// `≤1K`, `≤2K`, `≤4K`, `≤8K`, `≤16K`, `>16K`.
    pub bucket: String,
    /// All requests whose prompt falls in it.
    pub requests: u64,
    /// Per version that had requests in it, by name.
    pub versions: Vec<BucketVersion>,
}

/// One tenant (`anonymous` for requests without one).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantSummary {
    pub tenant: String,
    pub requests: u64,
    pub refused: u64,
    /// Input + output tokens.
    pub tokens: u64,
    pub spend_usd: f64,
    pub usd_per_mtok: Option<f64>,
}

/// First turns against follow-ups (`turn` = `first` / any other value; requests without a turn are
/// in neither).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TurnSummary {
    pub first_requests: u64,
    pub first_ttft: Latency,
    pub follow_up_requests: u64,
    pub follow_up_ttft: Latency,
}

/// Requests copied to one shadow version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShadowSummary {
    pub version: String,
    pub shadowed: u64,
    /// The same, by the primary version the request went to (`-` when none).
    pub by_primary: BTreeMap<String, u64>,
}

/// What llm-metrics judged of one version's whole answers (2xx, outcome `completed`), from its
/// stamps: the figures of `sluice_quality_*` for the same requests.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct QualitySummary {
    /// llm-metrics' `model_version` label.
    pub version: String,
    /// Whole answers judged.
    pub answers: u64,
    /// Output tokens of those answers: mean, and nearest-rank p50 and p95.
    pub output_tokens_mean: Option<f64>,
    pub output_tokens_p50: Option<f64>,
    pub output_tokens_p95: Option<f64>,
    /// Answers with a repetition figure (10 word trigrams or more).
    pub repetition_answers: u64,
    /// Mean ‰ of repeated trigrams over those answers.
    pub repetition_mean_per_mille: Option<f64>,
    /// Answers with no content event, and their share of `answers`.
    pub empty: u64,
    pub empty_share: Option<f64>,
    /// Answers finished at the token limit, and their share of `answers`.
    pub truncated: u64,
    pub truncated_share: Option<f64>,
    /// Answers by `finish` label.
    pub by_finish: BTreeMap<String, u64>,
}

/// What a report says in numbers: `summary.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub title: String,
    pub source: Source,
    pub requests: u64,
    pub decisions: DecisionCounts,
    /// Admitted or clamped requests with outcome `completed`, over admitted or clamped requests.
    pub availability: Option<f64>,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub spend_usd: f64,
    pub usd_per_mtok: Option<f64>,
    /// The earliest and latest arrival, ms.
    pub first_arrival_ms: Option<f64>,
    pub last_arrival_ms: Option<f64>,
    /// Requests without a model version (refused before routing, or no router).
    pub unrouted: u64,
    /// Refused requests by code (`-` when the verdict names none).
    pub refusals_by_code: BTreeMap<String, u64>,
    /// Refused requests by the plugin that refused them (`-` when unknown).
    pub refusals_by_plugin: BTreeMap<String, u64>,
    /// By version name.
    pub versions: Vec<VersionSummary>,
    /// Every bucket, in order.
    pub context: Vec<ContextSummary>,
    /// By requests, most first (then by name).
    pub tenants: Vec<TenantSummary>,
    pub turns: TurnSummary,
    /// By shadow version name.
    pub shadows: Vec<ShadowSummary>,
    /// Breaker transitions per version.
    pub breaker_transitions: BTreeMap<String, u64>,
    /// Output quality per llm-metrics `model_version`, by name (absent in older summaries).
    #[serde(default)]
    pub quality: Vec<QualitySummary>,
}

#[derive(Default)]
struct QualityAcc {
    output_tokens: Vec<f64>,
    repetition: Vec<f64>,
    empty: u64,
    truncated: u64,
    by_finish: BTreeMap<String, u64>,
}

impl QualityAcc {
    fn add(&mut self, q: &Quality) {
        self.output_tokens.push(q.output_tokens as f64);
        self.repetition.extend(q.repetition_per_mille.map(|r| r as f64));
        self.empty += u64::from(q.empty);
        self.truncated += u64::from(q.truncated);
        *self.by_finish.entry(q.finish.clone()).or_insert(0) += 1;
    }

    fn summary(self, version: &str) -> QualitySummary {
        let answers = self.output_tokens.len() as u64;
        let tokens = sorted(self.output_tokens);
        QualitySummary {
            version: version.to_string(),
            answers,
            output_tokens_mean: mean(&tokens),
            output_tokens_p50: percentile(&tokens, 50.0),
            output_tokens_p95: percentile(&tokens, 95.0),
            repetition_answers: self.repetition.len() as u64,
            repetition_mean_per_mille: mean(&self.repetition),
            empty: self.empty,
            empty_share: ratio(self.empty, answers),
            truncated: self.truncated,
            truncated_share: ratio(self.truncated, answers),
            by_finish: self.by_finish,
        }
    }
}

fn mean(values: &[f64]) -> Option<f64> {
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

#[derive(Default)]
struct VersionAcc {
    requests: u64,
    admitted: u64,
    completed: u64,
    ttft: Vec<f64>,
    tpot: Vec<f64>,
    decode: Vec<f64>,
    input_tokens: u64,
    output_tokens: u64,
    cost: f64,
}

/// One context bucket: its requests, and per version its requests and TTFTs.
#[derive(Default)]
struct BucketAcc<'a> {
    requests: u64,
    versions: BTreeMap<&'a str, (u64, Vec<f64>)>,
}

#[derive(Default)]
struct TenantAcc {
    requests: u64,
    refused: u64,
    tokens: u64,
    spend: f64,
}

pub fn summarize(input: &ReportInput) -> Summary {
    let verdicts = input.verdicts;
    let mut decisions = DecisionCounts::default();
    let (mut admitted, mut completed, mut unrouted) = (0u64, 0u64, 0u64);
    let (mut input_tokens, mut output_tokens, mut spend) = (0u64, 0u64, 0.0f64);
    let (mut first, mut last) = (None::<f64>, None::<f64>);
    let mut by_code = BTreeMap::new();
    let mut by_plugin = BTreeMap::new();
    let mut versions: BTreeMap<&str, VersionAcc> = BTreeMap::new();
    let mut buckets: Vec<BucketAcc> = context_labels().map(|_| BucketAcc::default()).collect();
    let mut tenants: HashMap<&str, TenantAcc> = HashMap::new();
    let (mut first_ttft, mut follow_ttft, mut first_n, mut follow_n) = (Vec::new(), Vec::new(), 0u64, 0u64);
    let mut shadows: BTreeMap<&str, (u64, BTreeMap<String, u64>)> = BTreeMap::new();
    let mut quality: BTreeMap<&str, QualityAcc> = BTreeMap::new();

    for v in verdicts {
        match v.decision {
            Decision::Admitted => decisions.admitted += 1,
            Decision::Clamped => decisions.clamped += 1,
            Decision::Refused => {
                decisions.refused += 1;
                *by_code.entry(v.code.clone().unwrap_or_else(|| "-".into())).or_insert(0) += 1;
                *by_plugin.entry(v.refused_by.clone().unwrap_or_else(|| "-".into())).or_insert(0) += 1;
            }
        }
        let done = v.outcome == "completed";
        if is_admitted(v) {
            admitted += 1;
            completed += u64::from(done);
        }
        input_tokens += v.input_tokens;
        output_tokens += v.output_tokens;
        spend += cost(v);
        if v.arrival_ms.is_finite() {
            first = Some(first.map_or(v.arrival_ms, |f| f.min(v.arrival_ms)));
            last = Some(last.map_or(v.arrival_ms, |l| l.max(v.arrival_ms)));
        }

        let bucket = context_labels().position(|l| l == context_bucket(v.prompt_tokens)).unwrap_or(0);
        if let Some(b) = buckets.get_mut(bucket) {
            b.requests += 1;
        }
        match v.version.as_deref() {
            None => unrouted += 1,
            Some(name) => {
                let acc = versions.entry(name).or_default();
                acc.requests += 1;
                if is_admitted(v) {
                    acc.admitted += 1;
                    acc.completed += u64::from(done);
                }
                acc.ttft.extend(v.ttft_ms);
                acc.tpot.extend(v.tpot_ms);
                acc.decode.extend(decode_tokens_per_s(v));
                acc.input_tokens += v.input_tokens;
                acc.output_tokens += v.output_tokens;
                acc.cost += cost(v);
                if let Some(b) = buckets.get_mut(bucket) {
                    let (n, ttfts) = b.versions.entry(name).or_default();
                    *n += 1;
                    ttfts.extend(v.ttft_ms);
                }
            }
        }

        let t = tenants.entry(tenant_name(v)).or_default();
        t.requests += 1;
        t.refused += u64::from(v.decision == Decision::Refused);
        t.tokens += v.input_tokens + v.output_tokens;
        t.spend += cost(v);

        match v.turn.as_deref() {
            Some("first") => {
                first_n += 1;
                first_ttft.extend(v.ttft_ms);
            }
            Some(_) => {
                follow_n += 1;
                follow_ttft.extend(v.ttft_ms);
            }
            None => {}
        }

        if let Some(shadow) = v.shadow_version.as_deref() {
            let (n, by_primary) = shadows.entry(shadow).or_default();
            *n += 1;
            *by_primary.entry(v.version.clone().unwrap_or_else(|| "-".into())).or_insert(0) += 1;
        }

        if let Some(q) = &v.quality {
            quality.entry(q.model_version.as_str()).or_default().add(q);
        }
    }

    let mut tenants: Vec<TenantSummary> = tenants
        .into_iter()
        .map(|(name, t)| TenantSummary {
            tenant: name.to_string(),
            requests: t.requests,
            refused: t.refused,
            tokens: t.tokens,
            spend_usd: t.spend,
            usd_per_mtok: usd_per_mtok(t.spend, t.tokens),
        })
        .collect();
    tenants.sort_by(|a, b| b.requests.cmp(&a.requests).then_with(|| a.tenant.cmp(&b.tenant)));

    let mut breaker_transitions = BTreeMap::new();
    for t in input.transitions {
        *breaker_transitions.entry(t.version.clone()).or_insert(0) += 1;
    }

    Summary {
        title: input.title.to_string(),
        source: input.source,
        requests: verdicts.len() as u64,
        decisions,
        availability: ratio(completed, admitted),
        input_tokens,
        output_tokens,
        spend_usd: spend,
        usd_per_mtok: usd_per_mtok(spend, input_tokens + output_tokens),
        first_arrival_ms: first,
        last_arrival_ms: last,
        unrouted,
        refusals_by_code: by_code,
        refusals_by_plugin: by_plugin,
        versions: versions
            .into_iter()
            .map(|(name, a)| VersionSummary {
                version: name.to_string(),
                requests: a.requests,
                admitted: a.admitted,
                completed: a.completed,
                availability: ratio(a.completed, a.admitted),
                ttft: Latency::of(a.ttft),
                tpot: Latency::of(a.tpot),
                decode_tokens_per_s_p50: percentile(&sorted(a.decode), 50.0),
                input_tokens: a.input_tokens,
                output_tokens: a.output_tokens,
                cost_usd: a.cost,
                usd_per_mtok: usd_per_mtok(a.cost, a.input_tokens + a.output_tokens),
            })
            .collect(),
        context: context_labels()
            .zip(buckets)
            .map(|(label, b)| ContextSummary {
                bucket: label.to_string(),
                requests: b.requests,
                versions: b
                    .versions
                    .into_iter()
                    .map(|(name, (n, ttfts))| BucketVersion { version: name.to_string(), requests: n, ttft: Latency::of(ttfts) })
                    .collect(),
            })
            .collect(),
        tenants,
        turns: TurnSummary {
            first_requests: first_n,
            first_ttft: Latency::of(first_ttft),
            follow_up_requests: follow_n,
            follow_up_ttft: Latency::of(follow_ttft),
        },
        shadows: shadows.into_iter().map(|(name, (n, by_primary))| ShadowSummary { version: name.to_string(), shadowed: n, by_primary }).collect(),
        breaker_transitions,
        quality: quality.into_iter().map(|(name, acc)| acc.summary(name)).collect(),
    }
}

fn ratio(part: u64, whole: u64) -> Option<f64> {
    (whole > 0).then(|| part as f64 / whole as f64)
}
