//! Mooncake JSONL (kvcache-ai/Mooncake, the FAST '25 traces): `{"timestamp": 27482,
//! "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 2353]}`.
//!
//! `timestamp` is milliseconds after the trace's start, a JSON number; `hash_ids` are the prompt's
//! prefix-cache block ids, kept on the record ([`TraceRequest::prefix_blocks`]) for a prefix-cache
//! model. No user or tenant: every request is anonymous unless the scenario assigns one.

use super::json::{self, Millis};
use super::{ApiKind, Clock, Fault, Parsed, Problem, TraceRequest};
use serde::Deserialize;

pub(crate) const TIMESTAMP: &str = "timestamp";

#[derive(Deserialize)]
struct Line {
    timestamp: Option<Millis>,
    input_length: Option<u64>,
    output_length: Option<u64>,
    hash_ids: Option<Vec<u64>>,
}

pub(crate) fn parse(line: &str) -> Result<Parsed, Fault> {
    let l: Line = json::object(line, None)?;
    let at = l.timestamp.ok_or_else(|| Fault::field(TIMESTAMP, Problem::Missing))?;
    let prompt = l.input_length.ok_or_else(|| Fault::field("input_length", Problem::Missing))?;
    Ok(Parsed {
        clock: Clock::Relative,
        at_ns: at.0,
        time_field: TIMESTAMP,
        request: TraceRequest {
            prompt_tokens: Some(prompt),
            output_tokens: l.output_length,
            prefix_blocks: l.hash_ids.unwrap_or_default(),
            ..TraceRequest::new(ApiKind::ChatCompletions)
        },
    })
}
