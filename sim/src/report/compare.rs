//! Two verdict sets of the same trace (two scenarios), request by request.

use crate::verdict::{Decision, Verdict};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, HashSet};

/// What one side said about a request, in the fields compared.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Side {
    pub decision: Decision,
    pub code: Option<String>,
    pub version: Option<String>,
    pub shadow_version: Option<String>,
}

impl Side {
    fn of(v: &Verdict) -> Side {
        Side { decision: v.decision, code: v.code.clone(), version: v.version.clone(), shadow_version: v.shadow_version.clone() }
    }
}

/// A request the two sides treated differently.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Difference {
    pub line: u64,
    /// Side a's arrival, ms.
    pub arrival_ms: f64,
    pub tenant: Option<String>,
    pub a: Side,
    pub b: Side,
}

/// How many requests went from decision `a` to decision `b`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DecisionChange {
    pub a: Decision,
    pub b: Decision,
    pub requests: u64,
}

/// The comparison of two verdict sets paired by trace line.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    pub a_requests: u64,
    pub b_requests: u64,
    /// Lines present on both sides.
    pub paired: u64,
    /// Paired requests with the same decision, code, version and shadow version.
    pub agree: u64,
    /// Lines on one side only (a trace line the other scenario did not replay), ascending.
    pub only_in_a: Vec<u64>,
    pub only_in_b: Vec<u64>,
    /// Paired requests by (a's decision, b's decision), including the unchanged ones.
    pub decision_changes: Vec<DecisionChange>,
    /// Every paired request that differs, by line.
    pub differences: Vec<Difference>,
}

/// Pairs the verdicts by `line` (a line seen twice on one side counts its first verdict) and lists
/// every request whose decision, code, version or shadow version differs.
pub fn compare(a: &[Verdict], b: &[Verdict]) -> Comparison {
    let mut by_line: HashMap<u64, &Verdict> = HashMap::with_capacity(b.len());
    for v in b {
        by_line.entry(v.line).or_insert(v);
    }
    let mut seen_a: HashSet<u64> = HashSet::with_capacity(a.len());
    let (mut paired, mut agree) = (0u64, 0u64);
    let mut only_in_a = Vec::new();
    let mut changes: BTreeMap<(Decision, Decision), u64> = BTreeMap::new();
    let mut differences = Vec::new();
    for va in a {
        if !seen_a.insert(va.line) {
            continue;
        }
        let Some(vb) = by_line.get(&va.line) else {
            only_in_a.push(va.line);
            continue;
        };
        paired += 1;
        *changes.entry((va.decision, vb.decision)).or_insert(0) += 1;
        let (sa, sb) = (Side::of(va), Side::of(vb));
        if sa == sb {
            agree += 1;
        } else {
            differences.push(Difference { line: va.line, arrival_ms: va.arrival_ms, tenant: va.tenant.clone(), a: sa, b: sb });
        }
    }
    let mut only_in_b: Vec<u64> = by_line.keys().copied().filter(|line| !seen_a.contains(line)).collect();
    only_in_a.sort_unstable();
    only_in_b.sort_unstable();
    differences.sort_by_key(|d| d.line);
    Comparison {
        a_requests: a.len() as u64,
        b_requests: b.len() as u64,
        paired,
        agree,
        only_in_a,
        only_in_b,
        decision_changes: changes.into_iter().map(|((a, b), requests)| DecisionChange { a, b, requests }).collect(),
        differences,
    }
}
