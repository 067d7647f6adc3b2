//! RAGPulse JSONL: `{"timestamp": "82", "input_length": 3112, "output_length": 192, "hash_ids": {…},
//! "session_id": "1757476916095-afhwfadnh5ew"}`.
//!
//! `timestamp` is relative seconds, a JSON string of digits in the published file (a number is
//! accepted too); `session_id` becomes the user. `hash_ids` (prefix-cache block ids) is not read.
//! Runs joined end to end (the timestamp going back) are handled by the reader's
//! [`RestartRule`](super::RestartRule).

use super::json::{self, Seconds};
use super::{ApiKind, Clock, Fault, Parsed, Problem, TraceRequest};
use serde::Deserialize;
use std::borrow::Cow;

pub(crate) const TIMESTAMP: &str = "timestamp";

#[derive(Deserialize)]
struct Line<'a> {
    timestamp: Option<Seconds>,
    input_length: Option<u64>,
    output_length: Option<u64>,
    #[serde(borrow)]
    session_id: Option<Cow<'a, str>>,
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
            user: l.session_id.map(Cow::into_owned),
            prompt_tokens: Some(prompt),
            output_tokens: l.output_length,
            ..TraceRequest::new(ApiKind::ChatCompletions)
        },
    })
}
