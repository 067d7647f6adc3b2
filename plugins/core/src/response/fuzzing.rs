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

/// What a whole stream made of an observer: every push's outcome, the finish's, the summary.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamResult {
    pub outcomes: Vec<ChunkOutcome>,
    pub summary: ResponseSummary,
}

/// Runs `chunks` as one response body through an observer that reads by stencil (the default) and
/// through one that parses every event whole; both must give the same results.
pub fn with_and_without_stencil(kind: ApiKind, chunks: &[&[u8]]) -> (StreamResult, StreamResult) {
    let run = |stencil: bool| {
        let mut observer = StreamObserver::new(kind);
        observer.state.stencil.off = !stencil;
        let mut outcomes: Vec<ChunkOutcome> = chunks.iter().map(|c| observer.push(c)).collect();
        outcomes.push(observer.finish());
        StreamResult { outcomes, summary: observer.summary() }
    };
    (run(true), run(false))
}
