//! RAGPulse JSONL: `{"timestamp": "82", "input_length": 3112, "output_length": 192, "hash_ids": {…},
//! "session_id": "1757476916095-afhwfadnh5ew"}`.
//!
//! `timestamp` is relative seconds, a JSON string of digits in the published file (a number is
//! accepted too); `session_id` becomes the user. `hash_ids` (prefix-cache block ids) is not read.
//! Runs joined end to end (the timestamp going back) are handled by the reader's
//! [`RestartRule`](super::RestartRule).

use super::json::{self, Seconds};
use super::{length_record, Fault, Parsed};
use serde::Deserialize;
use std::borrow::Cow;

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
    let mut parsed = length_record(l.timestamp.map(|t| t.0), l.input_length, l.output_length)?;
    parsed.request.user = l.session_id.map(Cow::into_owned);
    Ok(parsed)
}
