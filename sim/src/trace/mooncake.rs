//! Mooncake JSONL (kvcache-ai/Mooncake, the FAST '25 traces): `{"timestamp": 27482,
//! "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 2353]}`.
//!
//! `timestamp` is milliseconds after the trace's start, a JSON number; `hash_ids` are the prompt's
//! prefix-cache block ids, kept on the record ([`TraceRequest::prefix_blocks`]) for a prefix-cache
//! model. No user or tenant: every request is anonymous unless the scenario assigns one.

use super::json::{self, Millis};
use super::{length_record, Fault, Parsed};
use serde::Deserialize;

#[derive(Deserialize)]
struct Line {
    timestamp: Option<Millis>,
    input_length: Option<u64>,
    output_length: Option<u64>,
    hash_ids: Option<Vec<u64>>,
}

pub(crate) fn parse(line: &str) -> Result<Parsed, Fault> {
    let l: Line = json::object(line, None)?;
    let mut parsed = length_record(l.timestamp.map(|t| t.0), l.input_length, l.output_length)?;
    parsed.request.prefix_blocks = l.hash_ids.unwrap_or_default();
    Ok(parsed)
}
