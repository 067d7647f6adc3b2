//! Reports: a verdict set (simulated, or read from a real access log by [`crate::observed`]) becomes
//! a [`Summary`] (numbers, serialisable as `summary.json`) and one self-contained HTML page (inline
//! CSS and SVG, no script, nothing fetched); two verdict sets of the same trace become a
//! [`Comparison`] and a side-by-side page. docs/simulator.md ("Reports") describes each section.

mod compare;
mod html;
mod stats;
mod svg;

pub use compare::{compare, Comparison, DecisionChange, Difference, Side};
pub use html::{render_compare_html, render_html, MAX_LISTED_DIFFERENCES};
pub use stats::{
    context_bucket, context_labels, decode_tokens_per_s, percentile, sorted, summarize, usd_per_mtok, BucketVersion, ContextSummary, DecisionCounts, Latency,
    QualitySummary, ShadowSummary, Summary, TenantSummary, TurnSummary, VersionSummary, ANONYMOUS, CONTEXT_BUCKETS, CONTEXT_TOP,
};

use crate::verdict::{Sample, Transition, Verdict};
use serde::{Deserialize, Serialize};

/// Where the verdicts came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// The simulator's: what the policies would have done.
    Simulated,
    /// A real gateway's access log: what happened.
    Observed,
}

/// Everything one report is made from.
#[derive(Debug, Clone, Copy)]
pub struct ReportInput<'a> {
    pub title: &'a str,
    pub source: Source,
    pub verdicts: &'a [Verdict],
    /// State over time (simulation only; empty for an access log).
    pub samples: &'a [Sample],
    pub transitions: &'a [Transition],
}
