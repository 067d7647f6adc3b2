//! sluice's JSON access-log lines, as the shipped gateways write them (`envoy/*.yaml`,
//! `json_format`): `start_time` (and `start_epoch` in the budget gateways), `path`, `status`, and
//! each plugin's stamp as a JSON string — `sluice` (llm-metrics, docs/access-log.md), `budget`
//! (tenant-budget), `route` (model-router). Missing stamps (`null`, `"-"`, absent) leave their
//! fields `None`.

use super::json;
use super::time::{parse_datetime, parse_decimal_seconds, Zone};
use super::{parse_api, parse_outcome, ApiKind, Clock, Fault, Parsed, Problem, TraceRequest};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use sluice_core::report::Outcome;
use std::borrow::Cow;

/// The tenant label llm-metrics writes for a request without a tenant.
const ANONYMOUS: &str = "anonymous";

#[derive(Deserialize)]
struct Line<'a> {
    #[serde(borrow)]
    start_time: Option<Cow<'a, str>>,
    #[serde(borrow)]
    start_epoch: Option<Cow<'a, str>>,
    #[serde(borrow)]
    path: Option<Cow<'a, str>>,
    status: Option<Value>,
    sluice: Option<Value>,
    budget: Option<Value>,
    route: Option<Value>,
}

/// llm-metrics' stamp: the fields read here.
#[derive(Deserialize)]
struct LlmStamp {
    api: Option<String>,
    tenant: Option<String>,
    stream: Option<bool>,
    model: Option<String>,
    status: Option<u16>,
    outcome: Option<String>,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
}

/// tenant-budget's stamp: the fields read here.
#[derive(Deserialize)]
struct BudgetStamp {
    key: Option<String>,
    status: Option<u16>,
    outcome: Option<String>,
}

/// model-router's stamp: the fields read here.
#[derive(Deserialize)]
struct RouteStamp {
    model: Option<String>,
}

/// A plugin's stamp: a JSON string holding a JSON object (what `%FILTER_STATE(…:PLAIN)%` gives),
/// or the object itself; `null`, `""` and `"-"` mean the plugin wrote none.
fn stamp<T: DeserializeOwned>(value: Option<&Value>, name: &'static str) -> Result<Option<T>, Fault> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() || s == "-" => Ok(None),
        Some(Value::String(s)) => json::object::<T>(s, Some(name)).map(Some),
        Some(object @ Value::Object(_)) => serde_path_to_error::deserialize(object)
            .map(Some)
            .map_err(|e| Fault { field: json::field_name(Some(name), &e.path().to_string()), problem: Problem::Invalid(json::bare_message(e.inner())) }),
        Some(_) => Err(Fault::field(name, Problem::Invalid("expected the stamp as a JSON string or object".into()))),
    }
}

/// Envoy's `%RESPONSE_CODE%`: a number (a string in some formats); `0` and `"-"` mean none.
fn envoy_status(value: Option<&Value>) -> Result<Option<u16>, Fault> {
    let bad = || Fault::field("status", Problem::Invalid(format!("expected an HTTP status, got {}", value.map(Value::to_string).unwrap_or_default())));
    let code = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Number(n)) => n.as_u64().ok_or_else(bad)?,
        Some(Value::String(s)) if s.is_empty() || s == "-" => return Ok(None),
        Some(Value::String(s)) => s.parse::<u64>().map_err(|_| bad())?,
        Some(_) => return Err(bad()),
    };
    match u16::try_from(code) {
        Ok(0) => Ok(None),
        Ok(code) => Ok(Some(code)),
        Err(_) => Err(bad()),
    }
}

/// The request of one access-log line; `None` for a line without any stamp whose path is not an
/// LLM API: not an LLM request (a health check, a metrics scrape).
pub(crate) fn parse(line: &str) -> Result<Option<Parsed>, Fault> {
    let l: Line = json::object(line, None)?;
    let llm: Option<LlmStamp> = stamp(l.sluice.as_ref(), "sluice")?;
    let budget: Option<BudgetStamp> = stamp(l.budget.as_ref(), "budget")?;
    let route: Option<RouteStamp> = stamp(l.route.as_ref(), "route")?;
    let path_api = l.path.as_deref().and_then(ApiKind::from_path);
    if llm.is_none() && budget.is_none() && path_api.is_none() {
        return Ok(None);
    }

    let (at_ns, time_field) = match (l.start_time.as_deref().filter(|s| *s != "-"), l.start_epoch.as_deref().filter(|s| *s != "-")) {
        (Some(t), _) => (parse_datetime(t, Zone::Required).map_err(|e| Fault::field("start_time", Problem::Invalid(format!("{t:?}: {e}"))))?, "start_time"),
        (None, Some(t)) => (parse_decimal_seconds(t).map_err(|e| Fault::field("start_epoch", Problem::Invalid(e)))?, "start_epoch"),
        (None, None) => return Err(Fault::field("start_time", Problem::Missing)),
    };

    let mut request = TraceRequest::new(path_api.unwrap_or(ApiKind::ChatCompletions));
    let mut outcome: Option<Outcome> = None;
    if let Some(s) = &llm {
        if let Some(api) = &s.api {
            request.api = parse_api(api).map_err(|e| Fault::field("sluice.api", e))?;
        }
        if let Some(o) = &s.outcome {
            outcome = Some(parse_outcome(o).map_err(|e| Fault::field("sluice.outcome", e))?);
        }
        request.tenant = s.tenant.clone().filter(|t| t != ANONYMOUS);
        request.model = s.model.clone();
        // A request refused before its body was read has a stamp with 0 input tokens and the
        // stream flag unset: neither is known, so neither is reported.
        let body_unseen = outcome == Some(Outcome::Refused) && s.input_tokens == Some(0);
        if !body_unseen {
            request.prompt_tokens = s.input_tokens;
            request.stream = s.stream;
        }
        // Only a completed response's output is the upstream's whole answer.
        if outcome == Some(Outcome::Completed) {
            request.output_tokens = s.output_tokens;
        }
        request.status = s.status.filter(|&c| c != 0);
    }
    if let Some(b) = &budget {
        request.key = b.key.clone();
        if outcome.is_none() {
            if let Some(o) = &b.outcome {
                outcome = Some(parse_outcome(o).map_err(|e| Fault::field("budget.outcome", e))?);
            }
        }
        request.status = request.status.or(b.status.filter(|&c| c != 0));
    }
    if request.model.is_none() {
        request.model = route.and_then(|r| r.model);
    }
    request.status = match request.status {
        Some(code) => Some(code),
        None => envoy_status(l.status.as_ref())?,
    };
    request.outcome = outcome;
    Ok(Some(Parsed { clock: Clock::Unix, at_ns, time_field, request }))
}
