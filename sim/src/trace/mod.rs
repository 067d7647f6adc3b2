//! Trace readers: request arrivals from a trace file, one [`TraceRequest`] per line, streamed.
//!
//! Five formats ([`TraceFormat`]), chosen explicitly or detected from the first non-blank line:
//! the Azure LLM inference trace CSV, RAGPulse JSONL, Mooncake JSONL, sluice's generic JSONL, and
//! sluice's own JSON access log. A first line that could be two formats is refused, never guessed. docs/simulator.md defines the generic format and every rule below.
//!
//! - **Streaming, bounded memory.** [`TraceReader`] reads one line at a time into one buffer whose
//!   capacity never exceeds [`ReaderOptions::max_line_bytes`] (a longer line is an error, not a
//!   bigger buffer) and is cut back to [`RETAINED_BUFFER_BYTES`] after a line longer than that.
//!   Nothing is kept per record but counters ([`TraceStats`]).
//! - **Offsets.** [`TraceRequest::arrival_ns`] is nanoseconds after the trace's first record, in
//!   every format: the first record arrives at 0.
//! - **Order.** The reader does not sort. An arrival before the previous one is an error or is
//!   clamped to the previous arrival ([`OutOfOrder`]); RAGPulse's joined runs are first mapped by a
//!   [`RestartRule`].
//! - **Malformed lines.** Every error carries the 1-based line number, the field when there is one,
//!   and why ([`TraceError`]). [`OnMalformed::Skip`] yields the error, counts it and goes on with
//!   the next line; [`OnMalformed::Fail`] yields it and ends. I/O errors, an unrecognisable first
//!   line and a bad Azure header always end the trace.
//!
//! ```
//! use sluice_sim::trace::{OnMalformed, ReaderOptions, TraceReader};
//!
//! let text = "{\"t_ms\": 0, \"prompt_tokens\": 12}\n{\"t_ms\": 250.5, \"prompt_tokens\": \"x\"}\n{\"t_ms\": 1000, \"prompt_tokens\": 7}\n";
//! let mut reader = TraceReader::new(text.as_bytes(), ReaderOptions { on_malformed: OnMalformed::Skip, ..ReaderOptions::default() });
//! let mut arrivals = Vec::new();
//! for item in &mut reader {
//!     match item {
//!         Ok(request) => arrivals.push(request.arrival_ns),
//!         Err(e) => assert_eq!(e.to_string(), "line 2, field `prompt_tokens`: invalid type: string \"x\", expected u64"),
//!     }
//! }
//! assert_eq!(arrivals, [0, 1_000_000_000]);
//! assert_eq!(reader.stats().malformed, 1);
//! ```

mod access_log;
mod azure;
mod generic;
mod json;
mod line;
mod mooncake;
mod ragpulse;
mod time;

use line::{read_line_capped, Fill};
pub use sluice_core::api::ApiKind;
pub use sluice_core::report::Outcome;
use std::borrow::Cow;
use std::fmt;
use std::io::{self, BufRead};
use std::time::Duration;

/// The default cap on one line: 1 MiB.
pub const DEFAULT_MAX_LINE_BYTES: usize = 1 << 20;

/// The line buffer's capacity is cut back to this after a longer line.
pub const RETAINED_BUFFER_BYTES: usize = 64 << 10;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceRequest {
    /// The 1-based line of the trace it came from.
    pub line: u64,
    /// Nanoseconds after the trace's first record (which is at 0).
    pub arrival_ns: u64,
    /// The tenant (generic `tenant`; access log: llm-metrics' tenant label, `anonymous` → `None`).
    pub tenant: Option<String>,
    /// The API key's id (generic `key`; access log: the budget stamp's `key`).
    pub key: Option<String>,
    /// Who sent it within its key (generic `user`; RAGPulse `session_id`).
    pub user: Option<String>,
    /// The API it speaks; chat completions when the trace does not say.
    pub api: ApiKind,
    /// The model the client asked for.
    pub model: Option<String>,
    /// Prompt tokens. Always present except in access-log lines that do not know them (no
    /// llm-metrics stamp, or a request refused before its body was read).
    pub prompt_tokens: Option<u64>,
    /// The output limit the request set (generic `max_tokens`).
    pub max_output_tokens: Option<u64>,
    /// The output the upstream actually produced (Azure `GeneratedTokens`, RAGPulse
    /// `output_length`, generic `output_tokens`; access log: only for completed requests).
    pub output_tokens: Option<u64>,
    /// Whether the client asked for a stream; `None` when the trace does not say (Azure, RAGPulse),
    /// so that a scenario can choose.
    pub stream: Option<bool>,
    /// The HTTP status the client got when the trace was recorded (access log, generic `status`).
    pub status: Option<u16>,
    /// How the request ended when the trace was recorded (access log, generic `outcome`).
    pub outcome: Option<Outcome>,
    /// The prompt's prefix-cache block ids, in order (Mooncake `hash_ids`); empty when the trace
    /// does not give them.
    pub prefix_blocks: Vec<u64>,
}

impl TraceRequest {
    fn new(api: ApiKind) -> Self {
        TraceRequest {
            line: 0,
            arrival_ns: 0,
            tenant: None,
            key: None,
            user: None,
            api,
            model: None,
            prompt_tokens: None,
            max_output_tokens: None,
            output_tokens: None,
            stream: None,
            status: None,
            outcome: None,
            prefix_blocks: Vec::new(),
        }
    }
}

/// The trace formats read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceFormat {
    /// Azure LLM inference trace CSV: `TIMESTAMP,ContextTokens,GeneratedTokens`.
    Azure,
    /// RAGPulse JSONL: `timestamp` (relative seconds), `input_length`, `output_length`, `session_id`.
    RagPulse,
    /// Mooncake JSONL: `timestamp` (relative milliseconds), `input_length`, `output_length`, `hash_ids`.
    Mooncake,
    /// sluice's generic JSONL (docs/simulator.md).
    Generic,
    /// sluice's JSON access log, with the plugins' stamps.
    AccessLog,
}

impl TraceFormat {
    pub const ALL: [TraceFormat; 5] = [TraceFormat::Azure, TraceFormat::RagPulse, TraceFormat::Mooncake, TraceFormat::Generic, TraceFormat::AccessLog];

    /// `azure`, `ragpulse`, `mooncake`, `generic`, `access-log`.
    pub fn as_str(self) -> &'static str {
        match self {
            TraceFormat::Azure => "azure",
            TraceFormat::RagPulse => "ragpulse",
            TraceFormat::Mooncake => "mooncake",
            TraceFormat::Generic => "generic",
            TraceFormat::AccessLog => "access-log",
        }
    }

    /// The format named by [`TraceFormat::as_str`].
    pub fn from_name(name: &str) -> Option<TraceFormat> {
        TraceFormat::ALL.into_iter().find(|f| f.as_str() == name)
    }

    /// The format of a trace whose first non-blank line is `line`, if it is recognisable.
    ///
    /// A CSV header naming `TIMESTAMP`, `ContextTokens` and `GeneratedTokens` is Azure. A JSON
    /// object with `timestamp` and `input_length` is RAGPulse or Mooncake, which differ in the unit
    /// of `timestamp` (seconds, milliseconds), so they are told apart by what only one of them has:
    /// RAGPulse a `session_id`, `hash_ids` as an object of prompt parts, or a `timestamp` given as a
    /// string; Mooncake `hash_ids` as an array. A line with marks of both
    /// or of neither is refused, naming both and `--format` (a wrong guess would replay the trace
    /// 1,000 times too fast or too slow). With `prompt_tokens` and `t_ms` or `time`, generic; with
    /// `start_time` or `start_epoch` and one of `sluice`, `budget`, `path`, an access log.
    pub fn detect(line: &str) -> Result<TraceFormat, String> {
        let line = line.strip_prefix('\u{feff}').unwrap_or(line).trim();
        if !line.starts_with('{') {
            return if azure::is_header(line) {
                Ok(TraceFormat::Azure)
            } else {
                Err("the first line is neither a JSON object nor an Azure CSV header (`TIMESTAMP,ContextTokens,GeneratedTokens`)".into())
            };
        }
        /// Only the JSON type of a field, whatever its value.
        enum Shape {
            String,
            Array,
            Object,
            Other,
        }
        impl<'de> serde::Deserialize<'de> for Shape {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                Ok(match serde_json::Value::deserialize(d)? {
                    serde_json::Value::String(_) => Shape::String,
                    serde_json::Value::Array(_) => Shape::Array,
                    serde_json::Value::Object(_) => Shape::Object,
                    serde_json::Value::Null | serde_json::Value::Bool(_) | serde_json::Value::Number(_) => Shape::Other,
                })
            }
        }
        #[derive(serde::Deserialize)]
        struct Probe {
            timestamp: Option<Shape>,
            input_length: Option<serde::de::IgnoredAny>,
            hash_ids: Option<Shape>,
            session_id: Option<serde::de::IgnoredAny>,
            prompt_tokens: Option<serde::de::IgnoredAny>,
            t_ms: Option<serde::de::IgnoredAny>,
            time: Option<serde::de::IgnoredAny>,
            start_time: Option<serde::de::IgnoredAny>,
            start_epoch: Option<serde::de::IgnoredAny>,
            sluice: Option<serde::de::IgnoredAny>,
            budget: Option<serde::de::IgnoredAny>,
            path: Option<serde::de::IgnoredAny>,
        }
        let p: Probe = serde_json::from_str(line).map_err(|e| format!("the first line is not a JSON object: {e}"))?;
        if let (Some(timestamp), Some(_)) = (&p.timestamp, &p.input_length) {
            let ragpulse = p.session_id.is_some() || matches!(p.hash_ids, Some(Shape::Object)) || matches!(timestamp, Shape::String);
            let mooncake = matches!(p.hash_ids, Some(Shape::Array));
            return match (ragpulse, mooncake) {
                (true, false) => Ok(TraceFormat::RagPulse),
                (false, true) => Ok(TraceFormat::Mooncake),
                (both, _) => Err(format!(
                    "the first line has `timestamp` and `input_length`, as both RAGPulse (`timestamp` in seconds) and Mooncake \
                     (`timestamp` in milliseconds) do, and {}: choose with `--format ragpulse` or `--format mooncake`",
                    if both {
                        "marks of both (RAGPulse: `session_id`, `hash_ids` as an object or a string `timestamp`; Mooncake: `hash_ids` as an array)"
                    } else {
                        "neither's marks (RAGPulse: `session_id`, `hash_ids` as an object or a string `timestamp`; Mooncake: `hash_ids` as an array)"
                    }
                )),
            };
        }
        if p.prompt_tokens.is_some() && (p.t_ms.is_some() || p.time.is_some()) {
            Ok(TraceFormat::Generic)
        } else if (p.start_time.is_some() || p.start_epoch.is_some()) && (p.sluice.is_some() || p.budget.is_some() || p.path.is_some()) {
            Ok(TraceFormat::AccessLog)
        } else {
            Err("the first line's fields match no format: RAGPulse and Mooncake have `timestamp` and `input_length`; generic JSONL `prompt_tokens` and `t_ms` or `time`; \
                 an access log `start_time` and `sluice`, `budget` or `path`"
                .into())
        }
    }
}

impl fmt::Display for TraceFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What to do with a malformed line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnMalformed {
    /// Yield its error, then end the trace.
    #[default]
    Fail,
    /// Yield its error, count it ([`TraceStats::malformed`]) and go on with the next line.
    Skip,
}

/// What to do with an arrival earlier than the previous record's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutOfOrder {
    /// The line is malformed ([`Problem::OutOfOrder`]), handled by [`OnMalformed`].
    #[default]
    Reject,
    /// The record arrives at the previous record's arrival instead ([`TraceStats::clamped`]).
    Clamp,
}

/// How a RAGPulse timestamp that goes back is read: RAGPulse's published file is two week-long
/// runs joined end to end, each starting again near 0. Any decrease of `timestamp` from one
/// record to the next starts a new run (the runs' own rows are sorted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestartRule {
    /// Run *k* (from 0) starts `k × period` after the first run's zero: the published file's second
    /// run began exactly 604,800 s (7 days) after its first ([`RestartRule::WEEK`], the default). A
    /// restart that would land before the previous arrival (a run longer than the period) is a
    /// malformed line.
    Period(Duration),
    /// The new run's zero is the previous record's arrival.
    AfterLast,
    /// No restarts: a decrease is out of order ([`OutOfOrder`]).
    Off,
}

impl RestartRule {
    /// Runs a week apart, as in RAGPulse's published file.
    pub const WEEK: RestartRule = RestartRule::Period(Duration::from_secs(604_800));
}

impl Default for RestartRule {
    fn default() -> Self {
        RestartRule::WEEK
    }
}

/// How a [`TraceReader`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReaderOptions {
    /// The format; `None` detects it from the first non-blank line ([`TraceFormat::detect`]).
    pub format: Option<TraceFormat>,
    /// Skip malformed lines or stop at the first (the default).
    pub on_malformed: OnMalformed,
    /// Reject arrivals that go back (the default) or clamp them.
    pub out_of_order: OutOfOrder,
    /// How RAGPulse's joined runs are read (ignored for the other formats).
    pub restart: RestartRule,
    /// A longer line (without its newline) is malformed ([`Problem::TooLong`]); the buffer never
    /// grows past this.
    pub max_line_bytes: usize,
}

impl Default for ReaderOptions {
    fn default() -> Self {
        ReaderOptions {
            format: None,
            on_malformed: OnMalformed::default(),
            out_of_order: OutOfOrder::default(),
            restart: RestartRule::default(),
            max_line_bytes: DEFAULT_MAX_LINE_BYTES,
        }
    }
}

/// Why a line could not be read.
#[derive(Debug, thiserror::Error)]
pub enum Problem {
    // The messages of the I/O error and of the problem are in the Display text; they are not also
    // given as `source()`, so that an error chain does not print them twice.
    #[error("read failed: {0}")]
    Io(io::Error),
    #[error("line of {bytes} bytes is longer than the limit of {limit} bytes")]
    TooLong { bytes: u64, limit: usize },
    #[error("not UTF-8: invalid byte at column {column}")]
    NotUtf8 { column: usize },
    #[error("not JSON: {0}")]
    NotJson(String),
    #[error("cannot tell the trace format: {0}")]
    UnknownFormat(String),
    #[error("bad header: {0}")]
    Header(String),
    #[error("missing")]
    Missing,
    #[error("{0}")]
    Invalid(String),
    #[error("arrival {} after the first record is before the previous record's {} (out of order)", Secs(*.arrival_ns), Secs(i128::from(*.previous_ns)))]
    OutOfOrder {
        /// This record's arrival after the trace's first record (negative: before it).
        arrival_ns: i128,
        /// The previous record's arrival.
        previous_ns: u64,
    },
}

/// Nanoseconds shown as seconds.
struct Secs(i128);

impl fmt::Display for Secs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.0 < 0 { "-" } else { "" };
        let ns = self.0.unsigned_abs();
        let (s, frac) = (ns / 1_000_000_000, ns % 1_000_000_000);
        if frac == 0 {
            write!(f, "{sign}{s} s")
        } else {
            let digits = format!("{frac:09}");
            write!(f, "{sign}{s}.{} s", digits.trim_end_matches('0'))
        }
    }
}

/// A malformed line (or a failed read): which line, which field, why.
#[derive(Debug, thiserror::Error)]
#[error("line {line}{}: {problem}", FieldLabel(.field.as_deref()))]
pub struct TraceError {
    /// 1-based.
    pub line: u64,
    /// The field as the trace names it (`prompt_tokens`, `ContextTokens`, `sluice.input_tokens`),
    /// when the problem is one field's.
    pub field: Option<Cow<'static, str>>,
    pub problem: Problem,
}

struct FieldLabel<'a>(Option<&'a str>);

impl fmt::Display for FieldLabel<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(field) => write!(f, ", field `{field}`"),
            None => Ok(()),
        }
    }
}

impl TraceError {
    /// Whether this error ends the trace whatever [`OnMalformed`] says: a failed read, a first line
    /// whose format cannot be told, a bad Azure header.
    pub fn is_fatal(&self) -> bool {
        matches!(self.problem, Problem::Io(_) | Problem::UnknownFormat(_) | Problem::Header(_))
    }
}

/// A line's problem before its line number is known.
#[derive(Debug)]
pub(crate) struct Fault {
    pub(crate) field: Option<Cow<'static, str>>,
    pub(crate) problem: Problem,
}

impl Fault {
    pub(crate) fn line(problem: Problem) -> Fault {
        Fault { field: None, problem }
    }

    pub(crate) fn field(name: &'static str, problem: Problem) -> Fault {
        Fault { field: Some(Cow::Borrowed(name)), problem }
    }

    fn at(self, line: u64) -> TraceError {
        TraceError { line, field: self.field, problem: self.problem }
    }
}

/// The clock a record's time is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clock {
    /// The trace's own relative clock (RAGPulse `timestamp`, generic `t_ms`).
    Relative,
    /// Unix time (Azure `TIMESTAMP` read as UTC, generic `time`, access-log `start_time`).
    Unix,
}

/// A parsed line, before the reader places it in time.
pub(crate) struct Parsed {
    pub(crate) clock: Clock,
    pub(crate) at_ns: i128,
    pub(crate) time_field: &'static str,
    pub(crate) request: TraceRequest,
}

/// A record of the length traces (RAGPulse, Mooncake): a relative `timestamp` in the format's unit
/// (already nanoseconds here) and `input_length` required, `output_length` optional; the format
/// adds what else it knows to the request.
pub(crate) fn length_record(timestamp_ns: Option<i128>, input_length: Option<u64>, output_length: Option<u64>) -> Result<Parsed, Fault> {
    const TIMESTAMP: &str = "timestamp";
    let at_ns = timestamp_ns.ok_or_else(|| Fault::field(TIMESTAMP, Problem::Missing))?;
    let prompt = input_length.ok_or_else(|| Fault::field("input_length", Problem::Missing))?;
    Ok(Parsed {
        clock: Clock::Relative,
        at_ns,
        time_field: TIMESTAMP,
        request: TraceRequest { prompt_tokens: Some(prompt), output_tokens: output_length, ..TraceRequest::new(ApiKind::ChatCompletions) },
    })
}

/// A count of tokens: decimal digits only.
pub(crate) fn parse_count(s: &str) -> Result<u64, Problem> {
    if s.is_empty() {
        return Err(Problem::Missing);
    }
    if !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(Problem::Invalid(format!("expected a non-negative integer, got {s:?}")));
    }
    s.parse().map_err(|_| Problem::Invalid(format!("{s} is too large")))
}

pub(crate) fn parse_api(s: &str) -> Result<ApiKind, Problem> {
    ApiKind::ALL
        .into_iter()
        .find(|k| k.as_str() == s)
        .ok_or_else(|| Problem::Invalid(format!("unknown API {s:?} (chat_completions, completions, responses, messages)")))
}

const OUTCOMES: [Outcome; 5] = [Outcome::Completed, Outcome::ClientDisconnect, Outcome::UpstreamError, Outcome::Refused, Outcome::Deadline];

pub(crate) fn parse_outcome(s: &str) -> Result<Outcome, Problem> {
    OUTCOMES
        .into_iter()
        .find(|o| o.as_str() == s)
        .ok_or_else(|| Problem::Invalid(format!("unknown outcome {s:?} (completed, client_disconnect, upstream_error, refused, deadline)")))
}

/// What a [`TraceReader`] has seen so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TraceStats {
    /// Lines read (every kind below, the Azure header, and the failed line under
    /// [`OnMalformed::Fail`]).
    pub lines: u64,
    /// Records yielded.
    pub records: u64,
    /// Empty or whitespace-only lines, passed over.
    pub blank: u64,
    /// Access-log lines of requests that are not LLM requests (no stamp, not an LLM API path),
    /// passed over.
    pub not_llm: u64,
    /// Malformed lines (yielded as errors).
    pub malformed: u64,
    /// Records moved forward to the previous arrival ([`OutOfOrder::Clamp`]).
    pub clamped: u64,
    /// RAGPulse run restarts applied ([`RestartRule`]).
    pub restarts: u64,
}

/// Where the runs of a RAGPulse trace stand.
#[derive(Debug, Clone, Copy, Default)]
struct Runs {
    /// The current run's zero on the trace's clock.
    base_ns: i128,
    /// The previous record's `timestamp` within its run.
    previous_ns: Option<i128>,
}

/// Reads a trace one line at a time; an iterator of [`TraceRequest`]s and [`TraceError`]s.
pub struct TraceReader<R> {
    src: R,
    buf: Vec<u8>,
    options: ReaderOptions,
    format: Option<TraceFormat>,
    azure: Option<azure::Columns>,
    line: u64,
    done: bool,
    stats: TraceStats,
    /// The clock and time of the first record: every offset is from there.
    origin: Option<(Clock, i128)>,
    /// The previous record's offset.
    last_ns: Option<u64>,
    runs: Runs,
}

impl<R: BufRead> TraceReader<R> {
    pub fn new(src: R, options: ReaderOptions) -> Self {
        TraceReader {
            src,
            buf: Vec::new(),
            options,
            format: options.format,
            azure: None,
            line: 0,
            done: false,
            stats: TraceStats::default(),
            origin: None,
            last_ns: None,
            runs: Runs::default(),
        }
    }

    /// The format: as given, or detected once the first non-blank line was read.
    pub fn format(&self) -> Option<TraceFormat> {
        self.format
    }

    pub fn stats(&self) -> TraceStats {
        self.stats
    }

    /// The first record's time on its clock, in nanoseconds (Unix time, or the trace's relative
    /// clock), once read: what offset 0 is.
    pub fn origin(&self) -> Option<(Clock, i128)> {
        self.origin
    }

    /// The capacity of the line buffer the reader keeps between lines (at most
    /// [`RETAINED_BUFFER_BYTES`]; during one line, at most [`ReaderOptions::max_line_bytes`]).
    pub fn buffer_capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// Reads and handles one line: a record, nothing (blank, header, not an LLM request), or an
    /// error.
    fn step(&mut self, fill: Fill) -> Result<Option<TraceRequest>, TraceError> {
        let line = self.line;
        if let Fill::TooLong { bytes } = fill {
            return Err(Fault::line(Problem::TooLong { bytes, limit: self.options.max_line_bytes }).at(line));
        }
        let text = std::str::from_utf8(&self.buf).map_err(|e| Fault::line(Problem::NotUtf8 { column: e.valid_up_to() + 1 }).at(line))?;
        let text = if line == 1 { text.strip_prefix('\u{feff}').unwrap_or(text) } else { text };
        if text.trim().is_empty() {
            self.stats.blank += 1;
            return Ok(None);
        }
        let format = match self.format {
            Some(format) => format,
            None => {
                let format = TraceFormat::detect(text).map_err(|e| Fault::line(Problem::UnknownFormat(e)).at(line))?;
                self.format = Some(format);
                format
            }
        };
        let parsed = match format {
            TraceFormat::Azure => match &self.azure {
                None => {
                    self.azure = Some(azure::header(text).map_err(|f| f.at(line))?);
                    return Ok(None);
                }
                Some(columns) => azure::parse(text, columns),
            },
            TraceFormat::RagPulse => ragpulse::parse(text),
            TraceFormat::Mooncake => mooncake::parse(text),
            TraceFormat::Generic => generic::parse(text),
            TraceFormat::AccessLog => match access_log::parse(text) {
                Ok(Some(parsed)) => Ok(parsed),
                Ok(None) => {
                    self.stats.not_llm += 1;
                    return Ok(None);
                }
                Err(fault) => Err(fault),
            },
        }
        .map_err(|f| f.at(line))?;
        let arrival_ns = self.place(format, &parsed).map_err(|f| f.at(line))?;
        Ok(Some(TraceRequest { line, arrival_ns, ..parsed.request }))
    }

    /// The record's offset after the first record; the reader's clock state moves only when the
    /// record is accepted.
    fn place(&mut self, format: TraceFormat, parsed: &Parsed) -> Result<u64, Fault> {
        let field = parsed.time_field;
        if let Some((clock, _)) = self.origin {
            if clock != parsed.clock {
                let (was, is) = match clock {
                    Clock::Relative => ("relative (`t_ms`)", "`time`"),
                    Clock::Unix => ("calendar times (`time`)", "`t_ms`"),
                };
                return Err(Fault::field(field, Problem::Invalid(format!("this trace's arrivals are {was}, from its first record: a line cannot give {is}"))));
            }
        }
        let mut runs = self.runs;
        let mut restarted = false;
        let mut at = parsed.at_ns;
        if format == TraceFormat::RagPulse {
            if let Some(previous) = runs.previous_ns.filter(|&p| parsed.at_ns < p) {
                match self.options.restart {
                    RestartRule::Period(period) => {
                        let period = i128::try_from(period.as_nanos()).unwrap_or(i128::MAX);
                        let base = runs.base_ns.saturating_add(period);
                        if base.saturating_add(parsed.at_ns) < runs.base_ns + previous {
                            return Err(Fault::field(
                                field,
                                Problem::Invalid(format!(
                                    "{} is below the previous {}: a new run, but one period ({}) after the last run's start is before the previous arrival",
                                    Secs(parsed.at_ns),
                                    Secs(previous),
                                    Secs(period)
                                )),
                            ));
                        }
                        runs.base_ns = base;
                        restarted = true;
                    }
                    RestartRule::AfterLast => {
                        runs.base_ns += previous;
                        restarted = true;
                    }
                    RestartRule::Off => {}
                }
            }
            runs.previous_ns = Some(parsed.at_ns);
            at = runs.base_ns + parsed.at_ns;
        }
        let origin = self.origin.map_or(at, |(_, origin)| origin);
        let mut offset = at - origin;
        let mut clamped = false;
        if let Some(last) = self.last_ns {
            if offset < i128::from(last) {
                match self.options.out_of_order {
                    OutOfOrder::Reject => return Err(Fault::field(field, Problem::OutOfOrder { arrival_ns: offset, previous_ns: last })),
                    OutOfOrder::Clamp => {
                        offset = i128::from(last);
                        clamped = true;
                    }
                }
            }
        }
        let offset = u64::try_from(offset).map_err(|_| Fault::field(field, Problem::Invalid("arrival too far after the first record".into())))?;
        self.origin = Some((parsed.clock, origin));
        self.last_ns = Some(offset);
        self.runs = runs;
        self.stats.clamped += u64::from(clamped);
        self.stats.restarts += u64::from(restarted);
        Ok(offset)
    }
}

impl<R: BufRead> Iterator for TraceReader<R> {
    type Item = Result<TraceRequest, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        while !self.done {
            let fill = match read_line_capped(&mut self.src, &mut self.buf, self.options.max_line_bytes) {
                Ok(Fill::Eof) => {
                    self.done = true;
                    return None;
                }
                Ok(fill) => fill,
                Err(e) => {
                    self.done = true;
                    return Some(Err(TraceError { line: self.line + 1, field: None, problem: Problem::Io(e) }));
                }
            };
            self.line += 1;
            self.stats.lines += 1;
            let result = self.step(fill);
            if self.buf.capacity() > RETAINED_BUFFER_BYTES {
                self.buf.clear();
                self.buf.shrink_to(RETAINED_BUFFER_BYTES);
            }
            match result {
                Ok(None) => continue,
                Ok(Some(request)) => {
                    self.stats.records += 1;
                    return Some(Ok(request));
                }
                Err(e) => {
                    self.stats.malformed += 1;
                    if e.is_fatal() || self.options.on_malformed == OnMalformed::Fail {
                        self.done = true;
                    }
                    return Some(Err(e));
                }
            }
        }
        None
    }
}

impl<R: BufRead> std::iter::FusedIterator for TraceReader<R> {}
