//! The Azure LLM inference trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`).
//!
//! The header names the columns (in any order, any case; other columns are ignored). Fields are
//! not quoted. `TIMESTAMP` is a calendar time with up to 9 fractional digits and no zone (the 2023
//! traces: read as UTC) or a UTC offset (the 2024 traces' `+00:00`).

use super::time::{parse_datetime, Zone};
use super::{parse_count, ApiKind, Clock, Fault, Parsed, Problem, TraceRequest};

pub(crate) const TIMESTAMP: &str = "TIMESTAMP";
const CONTEXT: &str = "ContextTokens";
const GENERATED: &str = "GeneratedTokens";

/// Where the columns are, from the header.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Columns {
    count: usize,
    timestamp: usize,
    context: usize,
    generated: usize,
}

/// Whether `line` is an Azure header (it names the three columns).
pub(crate) fn is_header(line: &str) -> bool {
    header(line).is_ok()
}

pub(crate) fn header(line: &str) -> Result<Columns, Fault> {
    let mut found = [None; 3];
    let mut count = 0;
    for (i, name) in line.split(',').enumerate() {
        count += 1;
        let name = name.trim();
        for (slot, wanted) in found.iter_mut().zip([TIMESTAMP, CONTEXT, GENERATED]) {
            if name.eq_ignore_ascii_case(wanted) {
                *slot = Some(i);
            }
        }
    }
    match found {
        [Some(timestamp), Some(context), Some(generated)] => Ok(Columns { count, timestamp, context, generated }),
        _ => Err(Fault::line(Problem::Header(format!("an Azure trace starts with the header `{TIMESTAMP},{CONTEXT},{GENERATED}`, not {line:?}")))),
    }
}

pub(crate) fn parse(line: &str, columns: &Columns) -> Result<Parsed, Fault> {
    let (mut timestamp, mut context, mut generated) = (None, None, None);
    let mut count = 0;
    for (i, field) in line.split(',').enumerate() {
        count += 1;
        let field = field.trim();
        if i == columns.timestamp {
            timestamp = Some(field);
        } else if i == columns.context {
            context = Some(field);
        } else if i == columns.generated {
            generated = Some(field);
        }
    }
    if count != columns.count {
        return Err(Fault::line(Problem::Invalid(format!("{count} fields, the header has {}", columns.count))));
    }
    let (Some(timestamp), Some(context), Some(generated)) = (timestamp, context, generated) else {
        return Err(Fault::line(Problem::Invalid("missing columns".into())));
    };
    let at_ns = parse_datetime(timestamp, Zone::Optional).map_err(|e| Fault::field(TIMESTAMP, Problem::Invalid(format!("{timestamp:?}: {e}"))))?;
    let prompt = parse_count(context).map_err(|e| Fault::field(CONTEXT, e))?;
    let output = parse_count(generated).map_err(|e| Fault::field(GENERATED, e))?;
    Ok(Parsed {
        clock: Clock::Unix,
        at_ns,
        time_field: TIMESTAMP,
        request: TraceRequest { prompt_tokens: Some(prompt), output_tokens: Some(output), ..TraceRequest::new(ApiKind::ChatCompletions) },
    })
}
