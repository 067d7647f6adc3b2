//! sluice's generic JSONL trace (defined in docs/simulator.md):
//! `{"t_ms": 1500, "tenant": "acme", "key": "k1", "user": "u7", "api": "chat_completions",
//! "model": "llama-3-70b", "prompt_tokens": 812, "max_tokens": 256, "output_tokens": 190, "stream": true}`.

use super::json::{self, Millis};
use super::time::{parse_datetime, Zone};
use super::{parse_api, parse_outcome, ApiKind, Clock, Fault, Parsed, Problem, TraceRequest};
use serde::Deserialize;
use std::borrow::Cow;

#[derive(Deserialize)]
struct Line<'a> {
    t_ms: Option<Millis>,
    #[serde(borrow)]
    time: Option<Cow<'a, str>>,
    #[serde(borrow)]
    tenant: Option<Cow<'a, str>>,
    #[serde(borrow)]
    key: Option<Cow<'a, str>>,
    #[serde(borrow)]
    user: Option<Cow<'a, str>>,
    #[serde(borrow)]
    api: Option<Cow<'a, str>>,
    #[serde(borrow)]
    model: Option<Cow<'a, str>>,
    prompt_tokens: Option<u64>,
    max_tokens: Option<u64>,
    output_tokens: Option<u64>,
    stream: Option<bool>,
    status: Option<u16>,
    #[serde(borrow)]
    outcome: Option<Cow<'a, str>>,
}

pub(crate) fn parse(line: &str) -> Result<Parsed, Fault> {
    let l: Line = json::object(line, None)?;
    let (clock, at_ns, time_field) = match (l.t_ms, l.time) {
        (Some(ms), None) => (Clock::Relative, ms.0, "t_ms"),
        (None, Some(time)) => {
            let at = parse_datetime(&time, Zone::Required).map_err(|e| Fault::field("time", Problem::Invalid(format!("{time:?}: {e}"))))?;
            (Clock::Unix, at, "time")
        }
        (Some(_), Some(_)) => return Err(Fault::field("time", Problem::Invalid("give the arrival as `t_ms` or as `time`, not both".into()))),
        (None, None) => return Err(Fault::field("t_ms", Problem::Missing)),
    };
    let prompt = l.prompt_tokens.ok_or_else(|| Fault::field("prompt_tokens", Problem::Missing))?;
    let api = match l.api {
        Some(api) => parse_api(&api).map_err(|e| Fault::field("api", e))?,
        None => ApiKind::ChatCompletions,
    };
    let outcome = match l.outcome {
        Some(outcome) => Some(parse_outcome(&outcome).map_err(|e| Fault::field("outcome", e))?),
        None => None,
    };
    Ok(Parsed {
        clock,
        at_ns,
        time_field,
        request: TraceRequest {
            tenant: l.tenant.map(Cow::into_owned),
            key: l.key.map(Cow::into_owned),
            user: l.user.map(Cow::into_owned),
            model: l.model.map(Cow::into_owned),
            prompt_tokens: Some(prompt),
            max_output_tokens: l.max_tokens,
            output_tokens: l.output_tokens,
            stream: l.stream,
            status: l.status,
            outcome,
            ..TraceRequest::new(api)
        },
    })
}
