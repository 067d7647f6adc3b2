//! "What happened": a real gateway's JSON access log (the `json_format` of `envoy/templates/*.yaml`)
//! read into the same [`Verdict`]s the simulator writes, so one report renders both.
//!
//! Streamed: one line at a time in one buffer capped at [`MAX_LINE_BYTES`]. Each plugin's stamp
//! (`sluice`, `budget`, `route`, `latency`) may be a JSON string holding a JSON object (what
//! `%FILTER_STATE(…:PLAIN)%` prints) or the object itself; `null`, `""`, `"-"` and absent mean the
//! plugin wrote none. docs/simulator.md ("Reports") has the field mapping.

use crate::verdict::{Decision, Quality, Stamp, Stamps, Verdict};
use serde_json::{Map, Value};
use sluice_core::api::ApiKind;
use std::io::{self, BufRead};

/// The longest line read; a longer one is an error (and skipped), not a bigger buffer.
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// The buffer is cut back to this after a longer line.
const RETAINED_BUFFER_BYTES: usize = 64 << 10;

/// A line that could not be read as a request.
#[derive(Debug, thiserror::Error)]
#[error("line {line}: {why}")]
pub struct ObservedError {
    /// 1-based.
    pub line: u64,
    pub why: String,
}

/// The verdicts of an access log, in file order. Blank lines and lines that are no LLM request (no
/// stamp and a path that is not an LLM API: health checks, scrapes) are passed over. A malformed line
/// yields its error and reading goes on; an I/O error ends the iterator.
pub fn read_access_log<R: BufRead>(r: R) -> impl Iterator<Item = Result<Verdict, ObservedError>> {
    Reader { r, buf: Vec::new(), line: 0, origin_ns: None, done: false }
}

struct Reader<R> {
    r: R,
    buf: Vec<u8>,
    line: u64,
    /// The first request's start, ns: arrivals are counted from it.
    origin_ns: Option<i128>,
    done: bool,
}

enum Fill {
    Line,
    TooLong,
    Eof,
}

/// Reads one line (without its `\n`) into `buf`, storing at most `cap` bytes; the rest of a longer
/// line is consumed and dropped.
fn read_capped<R: BufRead>(r: &mut R, buf: &mut Vec<u8>, cap: usize) -> io::Result<Fill> {
    let (mut any, mut too_long) = (false, false);
    loop {
        let available = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if available.is_empty() {
            return Ok(if !any {
                Fill::Eof
            } else if too_long {
                Fill::TooLong
            } else {
                Fill::Line
            });
        }
        any = true;
        let (chunk, end) = match available.iter().position(|&b| b == b'\n') {
            Some(i) => (available.get(..i).unwrap_or_default(), Some(i + 1)),
            None => (available, None),
        };
        if !too_long {
            if buf.len() + chunk.len() > cap {
                too_long = true;
            } else {
                buf.extend_from_slice(chunk);
            }
        }
        let used = end.unwrap_or(available.len());
        r.consume(used);
        if end.is_some() {
            return Ok(if too_long { Fill::TooLong } else { Fill::Line });
        }
    }
}

impl<R: BufRead> Iterator for Reader<R> {
    type Item = Result<Verdict, ObservedError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if self.done {
                return None;
            }
            self.buf.clear();
            if self.buf.capacity() > RETAINED_BUFFER_BYTES {
                self.buf.shrink_to(RETAINED_BUFFER_BYTES);
            }
            self.line += 1;
            let line = self.line;
            let fail = |why: String| Some(Err(ObservedError { line, why }));
            match read_capped(&mut self.r, &mut self.buf, MAX_LINE_BYTES) {
                Err(e) => {
                    self.done = true;
                    return fail(format!("reading failed: {e}"));
                }
                Ok(Fill::Eof) => {
                    self.done = true;
                    return None;
                }
                Ok(Fill::TooLong) => return fail(format!("longer than {MAX_LINE_BYTES} bytes")),
                Ok(Fill::Line) => {}
            }
            let Ok(text) = std::str::from_utf8(&self.buf) else { return fail("not UTF-8".into()) };
            let text = if line == 1 { text.trim_start_matches('\u{feff}') } else { text };
            let text = text.trim();
            if text.is_empty() {
                continue;
            }
            match parse(text, line) {
                Ok(None) => continue,
                Ok(Some((start_ns, mut verdict))) => {
                    let origin = *self.origin_ns.get_or_insert(start_ns);
                    // Envoy writes a line when its request ends: a later line may have started
                    // earlier than the first, and then arrives before 0.
                    verdict.arrival_ms = (start_ns - origin) as f64 / 1e6;
                    return Some(Ok(verdict));
                }
                Err(why) => return fail(why),
            }
        }
    }
}

/// A stamp as the access log printed it.
fn stamp(value: Option<&Value>, name: &str) -> Result<Option<Map<String, Value>>, String> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.trim().is_empty() || s == "-" => Ok(None),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(m)) => Ok(Some(m)),
            Ok(Value::Null) => Ok(None),
            Ok(_) => Err(format!("field `{name}`: the stamp is not a JSON object")),
            Err(e) => Err(format!("field `{name}`: the stamp is not JSON: {e}")),
        },
        Some(Value::Object(m)) => Ok(Some(m.clone())),
        Some(other) => Err(format!("field `{name}`: expected the stamp as a JSON string or object, got {other}")),
    }
}

/// One field of one stamp; `null` and `"-"` are absent.
struct Fields<'a> {
    name: &'static str,
    map: Option<&'a Map<String, Value>>,
}

impl<'a> Fields<'a> {
    fn get(&self, field: &str) -> Option<&'a Value> {
        self.map?.get(field).filter(|v| !v.is_null() && v.as_str() != Some("-"))
    }
    fn bad(&self, field: &str, want: &str, got: &Value) -> String {
        format!("field `{}.{field}`: expected {want}, got {got}", self.name)
    }
    fn str(&self, field: &str) -> Result<Option<String>, String> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(self.bad(field, "a string", v)),
        }
    }
    fn u64(&self, field: &str) -> Result<Option<u64>, String> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| self.bad(field, "a non-negative integer", v)),
        }
    }
    fn bool(&self, field: &str) -> Result<Option<bool>, String> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.bad(field, "true or false", v)),
        }
    }
    fn status(&self, field: &str) -> Result<Option<u16>, String> {
        match self.u64(field)? {
            None | Some(0) => Ok(None),
            Some(c) => u16::try_from(c).map(Some).map_err(|_| format!("field `{}.{field}`: {c} is not an HTTP status", self.name)),
        }
    }
}

/// llm-metrics' label for "not known" (`model_version`, `ctx`, `turn` of a request refused early).
fn known(label: Option<String>) -> Option<String> {
    label.filter(|l| l != "unknown")
}

/// Envoy's own `%RESPONSE_CODE%`: a number, or a string in some formats.
fn envoy_status(value: Option<&Value>) -> Result<Option<u16>, String> {
    let code = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Number(n)) => n.as_u64(),
        Some(Value::String(s)) if s.is_empty() || s == "-" => return Ok(None),
        Some(Value::String(s)) => s.parse::<u64>().ok(),
        Some(_) => None,
    };
    match code.map(u16::try_from) {
        Some(Ok(0)) => Ok(None),
        Some(Ok(c)) => Ok(Some(c)),
        _ => Err(format!("field `status`: expected an HTTP status, got {}", value.map(Value::to_string).unwrap_or_default())),
    }
}

/// µs → ms.
fn us_to_ms(us: Option<u64>) -> Option<f64> {
    us.map(|v| v as f64 / 1000.0)
}

/// One line: its start (Unix ns) and verdict (arrival not yet set); `None` for a line that is no
/// LLM request.
fn parse(text: &str, line: u64) -> Result<Option<(i128, Verdict)>, String> {
    let l: Map<String, Value> = match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => m,
        Ok(_) => return Err("not a JSON object".into()),
        Err(e) => return Err(format!("not JSON: {e}")),
    };
    let sluice = stamp(l.get("sluice"), "sluice")?;
    let budget = stamp(l.get("budget"), "budget")?;
    let route = stamp(l.get("route"), "route")?;
    let latency = stamp(l.get("latency"), "latency")?;
    let path = l.get("path").and_then(Value::as_str);
    let path_api = path.and_then(ApiKind::from_path);
    if sluice.is_none() && budget.is_none() && route.is_none() && latency.is_none() && path_api.is_none() {
        return Ok(None);
    }

    let text_field = |name: &str| l.get(name).and_then(Value::as_str).filter(|s| !s.is_empty() && *s != "-");
    let start_ns = match (text_field("start_time"), text_field("start_epoch"), l.get("start_epoch").and_then(Value::as_f64)) {
        (Some(t), _, _) => parse_rfc3339(t).map_err(|e| format!("field `start_time`: {t:?}: {e}"))?,
        (None, Some(t), _) => parse_decimal_seconds(t).map_err(|e| format!("field `start_epoch`: {t:?}: {e}"))?,
        (None, None, Some(secs)) if secs.is_finite() && secs >= 0.0 => (secs * 1e9).round() as i128,
        _ => return Err("field `start_time`: missing (and no `start_epoch`)".into()),
    };

    let s = Fields { name: "sluice", map: sluice.as_ref() };
    let b = Fields { name: "budget", map: budget.as_ref() };
    let r = Fields { name: "route", map: route.as_ref() };
    let g = Fields { name: "latency", map: latency.as_ref() };

    let budget_decision = b.str("decision")?;
    let latency_outcome = g.str("outcome")?;
    let sluice_outcome = s.str("outcome")?;
    let shed = latency_outcome.as_deref().filter(|o| o.starts_with("shed_"));
    let budget_refused = budget_decision.as_deref() == Some("rejected");
    let decision = if budget_refused || shed.is_some() || sluice_outcome.as_deref() == Some("refused") {
        Decision::Refused
    } else if budget_decision.as_deref() == Some("clamped") {
        Decision::Clamped
    } else {
        Decision::Admitted
    };
    let (code, refused_by) = if budget_refused {
        (b.str("reject_code")?, Some("tenant-budget".to_string()))
    } else if let Some(shed) = shed {
        (Some(shed.to_string()), Some("latency-guard".to_string()))
    } else {
        (None, None)
    };

    let status = match s.status("status")?.or(b.status("status")?).or(g.status("status")?) {
        Some(c) => Some(c),
        None => envoy_status(l.get("status"))?,
    };
    // llm-metrics' outcome, else tenant-budget's (the same names); else what the status says.
    let outcome = match sluice_outcome.or(b.str("outcome")?) {
        Some(o) => o,
        None if decision == Decision::Refused => "refused".into(),
        None => match status {
            None => "client_disconnect".into(),
            Some(c) if c < 400 => "completed".into(),
            Some(_) => "upstream_error".into(),
        },
    };
    let api = match s.str("api")? {
        Some(api) => api,
        None => path_api.unwrap_or(ApiKind::ChatCompletions).as_str().to_string(),
    };
    let input_tokens = s.u64("input_tokens")?.unwrap_or(0);
    let duration_ms = match us_to_ms(s.u64("duration_us")?) {
        Some(d) => d,
        None => l.get("duration_ms").and_then(Value::as_f64).filter(|d| d.is_finite()).unwrap_or(0.0),
    };

    // Only llm-metrics' stamp (type-checked like every field): the quality series are its own.
    let quality = match (s.str("model_version")?, s.u64("status")?, s.str("outcome")?) {
        (Some(version), Some(status), Some(outcome)) => Quality::judge(
            &version,
            status,
            &outcome,
            s.u64("output_tokens")?.unwrap_or(0),
            s.str("finish_reason")?.as_deref(),
            s.u64("content_chunks")?,
            s.u64("repetition_per_mille")?,
        ),
        _ => None,
    };
    let verdict = Verdict {
        line,
        arrival_ms: 0.0,
        tenant: s.str("tenant")?.filter(|t| t != crate::report::ANONYMOUS),
        key: b.str("key")?,
        user: None,
        api,
        model: match s.str("model")? {
            Some(m) => Some(m),
            None => r.str("model")?,
        },
        prompt_tokens: input_tokens,
        stream: s.bool("stream")?.unwrap_or(false),
        decision,
        status: status.unwrap_or(0),
        code,
        refused_by,
        outcome,
        version: match r.str("version")? {
            Some(v) => Some(v),
            None => known(s.str("model_version")?),
        },
        route_reason: r.str("reason")?,
        shadow_version: r.str("shadow")?,
        ttft_ms: us_to_ms(s.u64("ttft_us")?),
        tpot_ms: us_to_ms(s.u64("tpot_us")?),
        duration_ms,
        input_tokens,
        output_tokens: s.u64("output_tokens")?.unwrap_or(0),
        cost_usd: s.u64("cost_micro_usd")?.map(|c| c as f64 / 1e6),
        ctx: known(s.str("ctx")?),
        turn: known(s.str("turn")?),
        quality,
        upstream_concurrency: None,
        upstream: None,
        stamps: Stamps {
            sluice: sluice.and_then(|m| Stamp::from_value(&Value::Object(m))),
            budget: budget.and_then(|m| Stamp::from_value(&Value::Object(m))),
            route: route.and_then(|m| Stamp::from_value(&Value::Object(m))),
            latency: latency.and_then(|m| Stamp::from_value(&Value::Object(m))),
        },
    };
    Ok(Some((start_ns, verdict)))
}

/// Days from 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Fixed-width decimal digits.
fn digits(s: &str, what: &str) -> Result<i64, String> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("expected digits for the {what}"));
    }
    s.parse::<i64>().map_err(|_| format!("bad {what}"))
}

/// Up to 9 fractional digits → nanoseconds, exactly.
fn fraction_ns(frac: &str) -> Result<i128, String> {
    if frac.is_empty() || frac.len() > 9 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return Err("expected 1 to 9 fractional digits".into());
    }
    let padded = format!("{frac:0<9}");
    padded.parse::<i128>().map_err(|_| "bad fraction".into())
}

/// Envoy's `%START_TIME%`: `YYYY-MM-DDTHH:MM:SS[.fraction](Z|±HH:MM)` → Unix ns.
fn parse_rfc3339(s: &str) -> Result<i128, String> {
    let part = |range: std::ops::Range<usize>, what: &str| s.get(range).ok_or_else(|| format!("too short for the {what}")).and_then(|p| digits(p, what));
    let (year, month, day) = (part(0..4, "year")?, part(5..7, "month")?, part(8..10, "day")?);
    let (hour, minute, second) = (part(11..13, "hour")?, part(14..16, "minute")?, part(17..19, "second")?);
    let seps = [(4, b'-'), (7, b'-'), (13, b':'), (16, b':')];
    if seps.iter().any(|&(i, c)| s.as_bytes().get(i) != Some(&c)) || !matches!(s.as_bytes().get(10), Some(b'T' | b't' | b' ')) {
        return Err("expected YYYY-MM-DDTHH:MM:SS".into());
    }
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 || second > 59 {
        return Err("a field is out of range".into());
    }
    let rest = s.get(19..).unwrap_or_default();
    let (frac, zone) = match rest.strip_prefix('.') {
        Some(r) => {
            let end = r.find(|c: char| !c.is_ascii_digit()).unwrap_or(r.len());
            (fraction_ns(r.get(..end).unwrap_or_default())?, r.get(end..).unwrap_or_default())
        }
        None => (0, rest),
    };
    let offset_s: i64 = match zone {
        "Z" | "z" => 0,
        z if z.len() == 6 && z.as_bytes().get(3) == Some(&b':') => {
            let sign = match z.as_bytes().first() {
                Some(b'+') => 1,
                Some(b'-') => -1,
                _ => return Err("expected a UTC offset (Z or ±HH:MM)".into()),
            };
            let (h, m) = (digits(z.get(1..3).unwrap_or_default(), "offset")?, digits(z.get(4..6).unwrap_or_default(), "offset")?);
            sign * (h * 3600 + m * 60)
        }
        _ => return Err("expected a UTC offset (Z or ±HH:MM)".into()),
    };
    let secs = days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second - offset_s;
    Ok(i128::from(secs) * 1_000_000_000 + frac)
}

/// `%START_TIME(%s.%3f)%`: non-negative decimal seconds → ns, exactly.
fn parse_decimal_seconds(s: &str) -> Result<i128, String> {
    let (whole, frac) = s.split_once('.').unwrap_or((s, ""));
    if whole.is_empty() || whole.len() > 18 || !whole.bytes().all(|b| b.is_ascii_digit()) {
        return Err("expected decimal seconds".into());
    }
    let whole: i128 = whole.parse().map_err(|_| "expected decimal seconds".to_string())?;
    let frac = if frac.is_empty() { 0 } else { fraction_ns(frac)? };
    Ok(whole * 1_000_000_000 + frac)
}
