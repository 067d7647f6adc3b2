//! The fast (typed, borrowing) event parses against the general `Value` path, for the fuzz targets.
//! Compiled only with the `fuzzing` feature.

use super::{ChunkOutcome, ResponseSummary, StreamObserver};
use crate::api::ApiKind;

/// What one path made of one event.
#[derive(Debug, Clone, PartialEq)]
pub struct PathResult {
    pub outcome: ChunkOutcome,
    pub summary: ResponseSummary,
}

/// Runs one event's (trimmed) data through the kind's fast path, on a fresh observer state, and
/// through the general path on another. `None` when the fast path declined the event (then only the
/// general path ever sees it); otherwise both results, which must be equal.
pub fn fast_and_value_paths(kind: ApiKind, event: Option<&str>, data: &str) -> Option<(PathResult, PathResult)> {
    let mut fast = StreamObserver::new(kind);
    let mut slow = StreamObserver::new(kind);
    let (mut out_f, mut out_s) = (ChunkOutcome::default(), ChunkOutcome::default());
    let taken = match kind {
        ApiKind::ChatCompletions | ApiKind::Completions => fast.state.openai_fast(data, &mut out_f),
        ApiKind::AnthropicMessages => fast.state.anthropic_fast(data, event, &mut out_f),
        ApiKind::Responses => false,
    };
    if !taken {
        return None;
    }
    slow.state.value_path(data, event, &mut out_s);
    Some((PathResult { outcome: out_f, summary: fast.summary() }, PathResult { outcome: out_s, summary: slow.summary() }))
}
