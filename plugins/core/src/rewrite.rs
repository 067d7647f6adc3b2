//! Request body rewrites (inject `stream_options.include_usage`, cap the output limit) and the SSE
//! filter that hides the injected usage from the client again ([`UsageChunkStripper`]).
//!
//! Both edit the raw bytes in place instead of re-serialising JSON: a body is parsed only to *decide*
//! (syntax is validated with serde_json, members are located by a small scanner), then the few bytes
//! that must change are replaced. Everything else — key order, whitespace, number spelling (`1e400`,
//! integers beyond 64 bits, `1.0`), string escapes — stays byte for byte what the client sent, so no
//! serde_json feature (`preserve_order`, `arbitrary_precision`) is needed and no value can be
//! corrupted by a round-trip.

use crate::api::ApiKind;
use crate::request;
use crate::response::ValidatedJson;
use crate::sse::{bounded_growth, find_line_end};
use serde::de::IgnoredAny;

/// Result of rewriting a request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRewrite {
    /// The body to send upstream: the original bytes with only the edited members changed or added.
    pub body: Vec<u8>,
    /// `stream_options.include_usage` was set to `true` by sluice (it was absent, `false` or `null`):
    /// strip the usage from the response with [`UsageChunkStripper`] so the client sees the stream it
    /// asked for.
    pub injected_include_usage: bool,
    /// The output limit written into the body (the value passed in), if any.
    pub max_output_tokens_set: Option<u64>,
    /// `body` differs from the input (when `false`, the original body can be left alone).
    pub changed: bool,
}

/// Why a request body could not be rewritten. The body is then forwarded unchanged or refused,
/// whichever the plugin's failure mode says.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum RewriteError {
    /// The body is not valid JSON (message from the parser, with line and column).
    #[error("request body is not valid JSON: {0}")]
    NotJson(String),
    /// The body is JSON but not an object.
    #[error("request body is not a JSON object")]
    NotObject,
}

/// Rewrite a request body for the API `kind` (pass the kind after [`crate::request::refine_kind`],
/// e.g. from [`crate::request::inspect_request_with_kind`]).
///
/// - `inject_include_usage`: for [`ApiKind::ChatCompletions`] and [`ApiKind::Completions`] requests
///   with `"stream": true` whose `stream_options.include_usage` is not `true`, set it to `true`
///   (other `stream_options` members are kept; a `null` or absent `stream_options` becomes
///   `{"include_usage":true}`). Never for other kinds or non-streaming requests, nor when
///   `stream_options` has another type (the upstream rejects such a request anyway).
/// - `max_output_tokens`: write the output limit member for the kind — chat: `max_completion_tokens`
///   and/or `max_tokens`, every one of the two the body already has, else `max_tokens`; completions
///   and Anthropic: `max_tokens`; Responses: `max_output_tokens`. The caller has already taken the
///   minimum with the requested limit ([`crate::request::RequestInfo::max_output_tokens`]).
///
/// When a key occurs more than once at the top level, decisions follow the *last* occurrence (as
/// serde_json, Python and Go do) and edits apply to *every* occurrence, so an upstream that keeps the
/// first one is capped too. New members are appended after the last member, compact
/// (`,"max_tokens":100`). Keys spelled with escapes (`"max\u005ftokens"`) are recognised.
///
/// Numbers the client sent are never reinterpreted: the body is validated syntactically, so `1e400`
/// or a 30-digit integer elsewhere in it is kept as written and is not an error.
pub fn rewrite_request(kind: ApiKind, body: &[u8], inject_include_usage: bool, max_output_tokens: Option<u64>) -> Result<RequestRewrite, RewriteError> {
    validate_object_text(body)?;
    let open = skip_ws(body, 0);
    if body.get(open) != Some(&b'{') {
        return Err(RewriteError::NotObject);
    }
    let obj = scan_object(body, open).ok_or_else(|| RewriteError::NotJson("unbalanced JSON object".to_owned()))?;

    let mut edits: Vec<Edit> = Vec::new();
    let mut appended: Vec<(&str, Vec<u8>)> = Vec::new();

    let mut injected = false;
    if inject_include_usage && matches!(kind, ApiKind::ChatCompletions | ApiKind::Completions) && obj.last_value(body, "stream") == Some(b"true".as_slice()) {
        let wants = match obj.last(body, "stream_options") {
            None => true,
            Some(m) => match body.get(m.value_start) {
                Some(b'n') => true, // null
                Some(b'{') => {
                    let inner = scan_object(body, m.value_start);
                    inner.is_some_and(|o| o.last_value(body, "include_usage") != Some(b"true"))
                }
                _ => false,
            },
        };
        if wants {
            injected = true;
            let mut found = false;
            for m in obj.members.iter().filter(|m| m.key_is(body, "stream_options")) {
                found = true;
                let replacement = match scan_object(body, m.value_start) {
                    Some(inner) => set_member(body, &inner, "include_usage", b"true"),
                    None => br#"{"include_usage":true}"#.to_vec(),
                };
                edits.push(Edit::new(m.value_start, m.value_end, replacement));
            }
            if !found {
                appended.push(("stream_options", br#"{"include_usage":true}"#.to_vec()));
            }
        }
    }

    if let Some(limit) = max_output_tokens {
        let value = limit.to_string().into_bytes();
        let (keys, default): (&[&str], &str) = match kind {
            ApiKind::ChatCompletions => (&["max_completion_tokens", "max_tokens"], "max_tokens"),
            ApiKind::Completions | ApiKind::AnthropicMessages => (&["max_tokens"], "max_tokens"),
            ApiKind::Responses => (&["max_output_tokens"], "max_output_tokens"),
        };
        let mut found = false;
        for m in &obj.members {
            if keys.iter().any(|k| m.key_is(body, k)) {
                found = true;
                edits.push(Edit::new(m.value_start, m.value_end, value.clone()));
            }
        }
        if !found {
            appended.push((default, value));
        }
    }

    if !appended.is_empty() {
        let mut text = Vec::new();
        let mut need_comma = !obj.members.is_empty();
        for (key, value) in appended {
            if need_comma {
                text.push(b',');
            }
            need_comma = true;
            push_member(&mut text, key, &value);
        }
        let at = obj.insert_pos();
        edits.push(Edit::new(at, at, text));
    }

    let out = apply_edits(body, 0, body.len(), edits);
    request::remember_rewrite(body, &out, |info| {
        info.include_usage |= injected;
        if max_output_tokens.is_some() {
            info.max_output_tokens = max_output_tokens;
        }
    });
    Ok(RequestRewrite { changed: out != body, body: out, injected_include_usage: injected, max_output_tokens_set: max_output_tokens })
}

/// The body with the top-level string member `key` set to `value` (every occurrence; appended when
/// absent), every other byte kept — e.g. the `model` a router sends to the chosen version.
pub fn set_top_level_string(body: &[u8], key: &str, value: &str) -> Result<Vec<u8>, RewriteError> {
    validate_object_text(body)?;
    let open = skip_ws(body, 0);
    if body.get(open) != Some(&b'{') {
        return Err(RewriteError::NotObject);
    }
    let obj = scan_object(body, open).ok_or_else(|| RewriteError::NotJson("unbalanced JSON object".to_owned()))?;
    let encoded = serde_json::to_string(value).map_err(|e| RewriteError::NotJson(e.to_string()))?;
    let mut out = body.get(..open).unwrap_or_default().to_vec();
    out.extend_from_slice(&set_member(body, &obj, key, encoded.as_bytes()));
    out.extend_from_slice(body.get(obj.close.saturating_add(1)..).unwrap_or_default());
    // The only member the inspection reads that is set this way.
    if key == "model" {
        request::remember_rewrite(body, &out, |info| info.model = Some(value.to_owned()));
    }
    Ok(out)
}

/// Checks that `body` is JSON text (UTF-8 included: serde_json does not check it inside strings it
/// skips), unless it is the body just inspected as a JSON object, which is.
fn validate_object_text(body: &[u8]) -> Result<(), RewriteError> {
    if request::known_object(body) {
        return Ok(());
    }
    std::str::from_utf8(body).map_err(|e| RewriteError::NotJson(e.to_string()))?;
    // From the bytes, as core reads all its JSON: one serde_json reader type in each .wasm.
    serde_json::from_slice::<IgnoredAny>(body).map_err(|e| RewriteError::NotJson(e.to_string()))?;
    Ok(())
}

/// The object at `obj` (in `s`) with every `key` member set to `value`, or `key` appended.
fn set_member(s: &[u8], obj: &Object, key: &str, value: &[u8]) -> Vec<u8> {
    let mut edits: Vec<Edit> = obj.members.iter().filter(|m| m.key_is(s, key)).map(|m| Edit::new(m.value_start, m.value_end, value.to_vec())).collect();
    if edits.is_empty() {
        let mut text = Vec::new();
        if !obj.members.is_empty() {
            text.push(b',');
        }
        push_member(&mut text, key, value);
        let at = obj.insert_pos();
        edits.push(Edit::new(at, at, text));
    }
    apply_edits(s, obj.open, obj.close.saturating_add(1), edits)
}

/// `"key":value` (the keys used here need no escaping).
fn push_member(out: &mut Vec<u8>, key: &str, value: &[u8]) {
    out.push(b'"');
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(b"\":");
    out.extend_from_slice(value);
}

// ---------------------------------------------------------------------------------------------------
// Usage stripping on the response stream.
// ---------------------------------------------------------------------------------------------------

/// Streaming filter for an OpenAI chat/completions SSE stream whose `include_usage` sluice injected:
/// the client sees the stream it asked for.
///
/// - An event whose data is a JSON object with a non-null `usage` and empty, `null` or absent
///   `choices` (the usage chunk) is removed entirely, its blank line included.
/// - From every other event, top-level `usage` members are removed from the raw text (`,"usage":null`,
///   `"usage": null,` …), the rest of the event byte for byte as sent. This covers both the
///   `"usage":null` servers put in every chunk and a non-null usage riding on a chunk with choices.
///   Only events with a single `data:` line are edited this way (a JSON split over several `data:`
///   lines is passed as is, unless it is a usage chunk to remove).
/// - Everything else passes byte for byte: comments, `[DONE]`, events without data or with data that
///   is not a JSON object, and line endings (LF, CRLF, CR, also split across chunks).
///
/// Complete events are emitted as soon as their blank line arrives; only the unfinished last event is
/// held, up to `max_event_bytes`. An event longer than that is passed through unmodified (counted in
/// [`Self::overflowed_events`]), wherever the chunk boundaries fall, so memory stays bounded.
///
/// Feed the upstream chunks to the response observer *before* this filter: the observer needs the
/// usage this filter removes.
#[derive(Debug, Clone)]
pub struct UsageChunkStripper {
    max_event_bytes: usize,
    /// Bytes of the unfinished current event (empty in pass-through).
    held: Vec<u8>,
    /// The current event outgrew the cap: its bytes go out as they come until its blank line.
    passthrough: bool,
    /// The current line has at least one byte (so a line end does not end the event).
    line_nonempty: bool,
    pending_cr: PendingCr,
    /// No event has been completed yet (a UTF-8 BOM may start the first line).
    at_stream_start: bool,
    removed: u64,
    stripped: u64,
    overflowed: u64,
}

/// The last byte seen was a CR line end: an LF at the start of the next chunk completes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PendingCr {
    None,
    /// Inside the current event.
    InEvent,
    /// The CR ended an event (its blank line); `removed` tells whether that event was dropped, in
    /// which case the LF goes too.
    AfterEvent {
        removed: bool,
    },
}

/// What to do with one complete event.
enum Verdict {
    Keep,
    Remove,
    /// Replace the bytes `start..end` of the event with `json`.
    Replace {
        start: usize,
        end: usize,
        json: Vec<u8>,
    },
}

impl Verdict {
    /// The bytes `range` of the event removed (an empty vector allocates nothing).
    fn cut(range: std::ops::Range<usize>) -> Self {
        Verdict::Replace { start: range.start, end: range.end, json: Vec::new() }
    }
}

impl UsageChunkStripper {
    /// A stripper that holds at most `max_event_bytes` of an unfinished event
    /// ([`crate::sse::DEFAULT_MAX_EVENT_BYTES`] is a good value).
    pub fn new(max_event_bytes: usize) -> Self {
        Self {
            max_event_bytes,
            held: Vec::new(),
            passthrough: false,
            line_nonempty: false,
            pending_cr: PendingCr::None,
            at_stream_start: true,
            removed: 0,
            stripped: 0,
            overflowed: 0,
        }
    }

    /// Feed one upstream body chunk; returns the bytes to send downstream now.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        self.push_knowing(chunk, None)
    }

    /// [`Self::push`], taking `known`'s word that the texts it holds are valid JSON (the observer
    /// of the same stream read them: [`crate::response::StreamObserver::keep_validated`]).
    pub fn push_knowing(&mut self, chunk: &[u8], known: Option<&ValidatedJson>) -> Vec<u8> {
        let mut out = Vec::with_capacity(chunk.len().saturating_add(self.held.len()));
        if chunk.is_empty() {
            return out;
        }
        let mut rest = chunk;
        let mut scan_from = 0;
        match std::mem::replace(&mut self.pending_cr, PendingCr::None) {
            PendingCr::AfterEvent { removed } if rest.first() == Some(&b'\n') => {
                if !removed {
                    out.push(b'\n');
                }
                rest = rest.get(1..).unwrap_or_default();
            }
            // The LF completes a CRLF inside the current event: it is event bytes, not a line end.
            PendingCr::InEvent if rest.first() == Some(&b'\n') => scan_from = 1,
            _ => {}
        }

        let mut event_start = 0;
        let mut pos = scan_from;
        while let Some(found) = find_line_end(rest.get(pos..).unwrap_or_default()) {
            let at = pos.saturating_add(found);
            let blank = !self.line_nonempty && found == 0;
            let (term_len, cr_at_end) = match (rest.get(at), rest.get(at.saturating_add(1))) {
                (Some(b'\r'), Some(b'\n')) => (2, false),
                (Some(b'\r'), None) => (1, true),
                _ => (1, false),
            };
            pos = at.saturating_add(term_len);
            self.line_nonempty = false;
            if blank {
                let event = rest.get(event_start..pos).unwrap_or_default();
                let removed = self.complete_event(event, term_len, known, &mut out);
                event_start = pos;
                if cr_at_end {
                    self.pending_cr = PendingCr::AfterEvent { removed };
                }
            } else if cr_at_end {
                self.pending_cr = PendingCr::InEvent;
            }
        }
        if pos < rest.len() {
            self.line_nonempty = true;
        }
        self.hold(rest.get(event_start..).unwrap_or_default(), &mut out);
        out
    }

    /// [`Self::push`], answering `None` when the bytes to send are the chunk itself, unchanged.
    ///
    /// Most chunks are whole content events naming no `usage`, between events: those are passed
    /// without framing or copying them (one scan of the chunk).
    pub fn push_changed(&mut self, chunk: &[u8]) -> Option<Vec<u8>> {
        self.push_changed_knowing(chunk, None)
    }

    /// [`Self::push_changed`] with [`Self::push_knowing`]'s `known`.
    pub fn push_changed_knowing(&mut self, chunk: &[u8], known: Option<&ValidatedJson>) -> Option<Vec<u8>> {
        let between_events = self.held.is_empty() && !self.passthrough && !self.line_nonempty && self.pending_cr == PendingCr::None;
        if between_events && chunk.len() <= self.max_event_bytes {
            if let Some(cut) = vouched_trailing_null_usage(chunk, known) {
                // The observer read this chunk's one event and vouched for its only `usage` being
                // the trailing null one: the member is cut with nothing else looked at.
                return self.send_whole_event(chunk, Verdict::cut(cut));
            }
            if chunk.ends_with(b"\n\n") {
                let scan = scan_chunk(chunk);
                if !scan.cr {
                    let Some(first_hint) = scan.first_hint else {
                        // Whole events ended by LF line ends only, none over the cap, none naming
                        // `usage`: every one is kept as it is, and the stripper ends between events again.
                        self.at_stream_start = false;
                        return None;
                    };
                    if !scan.blank_line_inside && chunk.first() != Some(&b'\n') {
                        // One whole event (the usual chunk): judged as `push` would judge it, without
                        // framing it or searching it again.
                        let verdict = judge_hinted(chunk, self.at_stream_start, known, first_hint);
                        return self.send_whole_event(chunk, verdict);
                    }
                }
            }
        }
        let out = self.push_knowing(chunk, known);
        (out != chunk).then_some(out)
    }

    /// End of stream: returns whatever is held back, unmodified (an event without its blank line is
    /// not complete), and resets the stripper for reuse (counters are kept).
    pub fn finish(&mut self) -> Vec<u8> {
        let out = std::mem::take(&mut self.held);
        self.passthrough = false;
        self.line_nonempty = false;
        self.pending_cr = PendingCr::None;
        self.at_stream_start = true;
        out
    }

    /// Usage chunks removed entirely.
    pub fn removed_usage_events(&self) -> u64 {
        self.removed
    }

    /// Events kept with their `usage` member(s) cut out.
    pub fn stripped_usage_members(&self) -> u64 {
        self.stripped
    }

    /// Events longer than the cap, passed through unmodified.
    pub fn overflowed_events(&self) -> u64 {
        self.overflowed
    }

    /// Bytes currently held back; never more than the cap given to [`Self::new`].
    pub fn held_bytes(&self) -> usize {
        self.held.len()
    }

    /// Keep the unfinished tail of the current event (or pass it on if the event is over the cap).
    fn hold(&mut self, tail: &[u8], out: &mut Vec<u8>) {
        if tail.is_empty() {
            return;
        }
        if self.passthrough {
            out.extend_from_slice(tail);
            return;
        }
        if self.held.len().saturating_add(tail.len()) > self.max_event_bytes {
            self.overflowed = self.overflowed.saturating_add(1);
            self.passthrough = true;
            self.at_stream_start = false;
            out.append(&mut self.held);
            out.extend_from_slice(tail);
            return;
        }
        let extra = bounded_growth(self.held.capacity(), self.held.len(), tail.len(), self.max_event_bytes);
        self.held.reserve_exact(extra);
        self.held.extend_from_slice(tail);
    }

    /// The current event ends with `tail` (its blank line included, whose line end is
    /// `blank_term_len` bytes). Returns whether it was removed.
    fn complete_event(&mut self, tail: &[u8], blank_term_len: usize, known: Option<&ValidatedJson>, out: &mut Vec<u8>) -> bool {
        let at_start = std::mem::replace(&mut self.at_stream_start, false);
        if self.passthrough {
            self.passthrough = false;
            out.extend_from_slice(tail);
            return false;
        }
        let mut held = std::mem::take(&mut self.held);
        let event: &[u8] = if held.is_empty() {
            tail
        } else {
            held.extend_from_slice(tail);
            &held
        };
        let mut removed = false;
        // The blank line's own line end is not counted: a CRLF split across chunks puts only its CR
        // in the event, so counting it would make the verdict depend on where chunks end (found by
        // fuzz/fuzz_targets/usage_stripper.rs).
        if event.len().saturating_sub(blank_term_len) > self.max_event_bytes {
            self.overflowed = self.overflowed.saturating_add(1);
            out.extend_from_slice(event);
        } else {
            removed = self.apply(event, judge_event(event, at_start, known), out);
        }
        // Give the allocation back (it never grew past the cap plus one chunk's tail).
        held.clear();
        if held.capacity() <= self.max_event_bytes {
            self.held = held;
        }
        removed
    }

    /// A chunk that is one whole event, judged: `None` when it goes on unchanged; the stripper is
    /// between events after it.
    fn send_whole_event(&mut self, chunk: &[u8], verdict: Verdict) -> Option<Vec<u8>> {
        self.at_stream_start = false;
        if matches!(verdict, Verdict::Keep) {
            return None;
        }
        let mut out = Vec::with_capacity(chunk.len());
        self.apply(chunk, verdict, &mut out);
        Some(out)
    }

    /// Sends `event` on as `verdict` says, counting it. Returns whether it was removed.
    fn apply(&mut self, event: &[u8], verdict: Verdict, out: &mut Vec<u8>) -> bool {
        match verdict {
            Verdict::Keep => out.extend_from_slice(event),
            Verdict::Remove => {
                self.removed = self.removed.saturating_add(1);
                return true;
            }
            Verdict::Replace { start, end, json } => {
                self.stripped = self.stripped.saturating_add(1);
                out.extend_from_slice(event.get(..start).unwrap_or_default());
                out.extend_from_slice(&json);
                out.extend_from_slice(event.get(end..).unwrap_or_default());
            }
        }
        false
    }
}

/// Decide what happens to one complete event (raw bytes, blank line included).
fn judge_event(event: &[u8], at_stream_start: bool, known: Option<&ValidatedJson>) -> Verdict {
    // An event the observer read by stencil and vouched for: its one `usage` is the trailing null.
    if let Some(cut) = vouched_trailing_null_usage(event, known) {
        return Verdict::cut(cut);
    }
    // Most events are content chunks with no `usage` member: a key spells `usage` either plainly or
    // with a `\u` escape, so an event with neither is kept without parsing it.
    match first_usage_hint(event) {
        None => Verdict::Keep,
        Some(first_hint) => judge_hinted(event, at_stream_start, known, first_hint),
    }
}

/// [`judge_event`] on an event where `usage` or a `\u` escape first occurs at `first_hint`.
fn judge_hinted(event: &[u8], at_stream_start: bool, known: Option<&ValidatedJson>, first_hint: usize) -> Verdict {
    // Most events have one data line: it is kept apart, a vector only made for a second.
    let mut first_line: Option<(usize, usize)> = None;
    let mut more_lines: Vec<(usize, usize)> = Vec::new();
    let mut line_start = 0;
    if at_stream_start && event.starts_with(b"\xEF\xBB\xBF") {
        line_start = 3;
    }
    while let Some(found) = find_line_end(event.get(line_start..).unwrap_or_default()) {
        let line_end = line_start.saturating_add(found);
        let line = event.get(line_start..line_end).unwrap_or_default();
        if let Some(value) = data_value(line) {
            let range = (line_start.saturating_add(value), line_end);
            match first_line {
                None => first_line = Some(range),
                Some(first) => {
                    if more_lines.is_empty() {
                        more_lines.push(first);
                    }
                    more_lines.push(range);
                }
            }
        }
        let term_len = match (event.get(line_end), event.get(line_end.saturating_add(1))) {
            (Some(b'\r'), Some(b'\n')) => 2,
            _ => 1,
        };
        line_start = line_end.saturating_add(term_len);
    }
    let joined;
    let (data, single): (&[u8], Option<(usize, usize)>) = match (first_line, more_lines.as_slice()) {
        (None, _) => return Verdict::Keep,
        (Some((start, end)), []) => (event.get(start..end).unwrap_or_default(), Some((start, end))),
        (Some(_), many) => {
            let mut buf = Vec::new();
            for (i, (start, end)) in many.iter().enumerate() {
                if i > 0 {
                    buf.push(b'\n');
                }
                buf.extend_from_slice(event.get(*start..*end).unwrap_or_default());
            }
            joined = buf;
            (&joined, None)
        }
    };
    // The observer's word for the text, or serde_json's: valid JSON either way.
    let valid = known.is_some_and(|k| k.contains(data)) || serde_json::from_slice::<IgnoredAny>(data).is_ok();
    if !valid {
        return Verdict::Keep;
    }
    if let Some((start, _)) = single {
        if let Some(cut) = trailing_null_usage(data, first_hint.checked_sub(start)) {
            return Verdict::cut(start.saturating_add(cut.start)..start.saturating_add(cut.end));
        }
    }
    judge_scanned(data, single)
}

/// How the usual chunk of a stream with `include_usage` on ends.
pub(crate) const TRAILING_NULL_USAGE: &[u8] = b",\"usage\":null}";

/// When `event` is exactly one `data:` line and its blank line, the line's text one `known`
/// vouches has only the trailing null `usage` ([`ValidatedJson::vouches_sole_null_usage`]): the cut
/// of that member and the comma before it in `event`, as [`trailing_null_usage`] makes it, without
/// reading the event.
pub fn vouched_trailing_null_usage(event: &[u8], known: Option<&ValidatedJson>) -> Option<std::ops::Range<usize>> {
    // Nothing held (a stream without the member): nothing to look at.
    let known = known.filter(|k| !k.is_empty())?;
    let line = event.strip_suffix(b"\n\n")?;
    let start = data_value(line)?;
    let data = line.get(start..)?;
    if !known.vouches_sole_null_usage(data) {
        return None;
    }
    // Vouched for: the text's first hint is its trailing member's `usage`.
    let cut = trailing_null_usage(data, data.len().checked_sub(TRAILING_NULL_USAGE.len().saturating_sub(2)))?;
    Some(start.saturating_add(cut.start)..start.saturating_add(cut.end))
}

/// The usual shape of a chunk of a stream whose `include_usage` the budget turned on, decided
/// without scanning its members: valid JSON (checked before) ending in `,"usage":null}` right after
/// a value, naming `usage` nowhere else (and no `\u` escape that could spell it): the first hint in
/// `data` ([`first_usage_hint`], `first_hint`) is the tail's own `usage`. That member is then the
/// object's only `usage`, at the top level (the last member before the final `}`), and
/// [`judge_scanned`] would cut exactly those bytes: the member with the comma before it.
pub(crate) fn trailing_null_usage(data: &[u8], first_hint: Option<usize>) -> Option<std::ops::Range<usize>> {
    let head = data.strip_suffix(TRAILING_NULL_USAGE)?;
    // `,"` then `usage`: no hint can start in the head and run into the tail.
    if head.last().is_none_or(|b| is_ws(*b)) || first_hint != Some(head.len().saturating_add(2)) {
        return None;
    }
    // The member and the comma before it; the object's closing brace stays.
    Some(head.len()..data.len().saturating_sub(1))
}

/// [`judge_event`] on an event's valid JSON `data` (its data lines joined), by scanning the object.
fn judge_scanned(data: &[u8], single_line: Option<(usize, usize)>) -> Verdict {
    let open = skip_ws(data, 0);
    if data.get(open) != Some(&b'{') {
        return Verdict::Keep;
    }
    let Some(obj) = scan_object(data, open) else {
        return Verdict::Keep;
    };
    let Some(usage) = obj.last_value(data, "usage") else {
        return Verdict::Keep;
    };
    let no_choices = match obj.last_value(data, "choices") {
        None => true,
        Some(v) => v == b"null" || is_empty_array(v),
    };
    if usage != b"null" && no_choices {
        return Verdict::Remove;
    }
    let Some((start, end)) = single_line else {
        return Verdict::Keep;
    };
    Verdict::Replace { start, end, json: remove_members(data, &obj, "usage") }
}

/// Where `usage` or a `\\u` escape first occurs in `event`. Natively two substring searches
/// (SIMD); in wasm, which has no SIMD here, one pass over the bytes is fewer instructions (fuel
/// measured: `host-tests/examples/profile.rs`), so the wasm build keeps [`bytewise::first_usage_hint`].
#[cfg(not(target_arch = "wasm32"))]
pub(crate) fn first_usage_hint(event: &[u8]) -> Option<usize> {
    // Finders built once: building one per search was a third of the searches' time on events of a
    // few hundred bytes (the simulator's profile).
    static USAGE: std::sync::LazyLock<memchr::memmem::Finder<'static>> = std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"usage"));
    let word = USAGE.find(event);
    let before = event.get(..word.unwrap_or(event.len())).unwrap_or_default();
    let escape = memchr::memchr_iter(b'\\', before).find(|&i| event.get(i.saturating_add(1)) == Some(&b'u'));
    escape.or(word)
}

/// What [`UsageChunkStripper::push_changed`] learns of a chunk before framing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ChunkScan {
    /// A CR anywhere (its line ends need the framing of [`UsageChunkStripper::push`]).
    cr: bool,
    /// [`first_usage_hint`] of the chunk.
    first_hint: Option<usize>,
    /// A blank line (`\n\n`) before the chunk's last two bytes: more than one event.
    blank_line_inside: bool,
}

#[cfg(not(target_arch = "wasm32"))]
fn scan_chunk(bytes: &[u8]) -> ChunkScan {
    // Built once, as `first_usage_hint`'s.
    static BLANK_LINE: std::sync::LazyLock<memchr::memmem::Finder<'static>> = std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\n\n"));
    // A pair starting before the last two bytes: all but the last byte.
    let inside = bytes.get(..bytes.len().saturating_sub(1)).unwrap_or_default();
    ChunkScan { cr: memchr::memchr(b'\r', bytes).is_some(), first_hint: first_usage_hint(bytes), blank_line_inside: BLANK_LINE.find(inside).is_some() }
}

#[cfg(target_arch = "wasm32")]
pub(crate) use bytewise::first_usage_hint;
#[cfg(target_arch = "wasm32")]
use bytewise::scan_chunk;

/// The one-pass forms of the two searches: the wasm build's, and the native tests' reference.
#[cfg(any(target_arch = "wasm32", test))]
mod bytewise {
    pub(crate) fn first_usage_hint(event: &[u8]) -> Option<usize> {
        let mut i = 0usize;
        while let Some(&b) = event.get(i) {
            let next = event.get(i.saturating_add(1)).copied();
            if (b == b'u' && event.get(i.saturating_add(1)..i.saturating_add(5)) == Some(b"sage")) || (b == b'\\' && next == Some(b'u')) {
                return Some(i);
            }
            i = i.saturating_add(1);
        }
        None
    }

    /// [`super::scan_chunk`] in one pass.
    pub(super) fn scan_chunk(bytes: &[u8]) -> super::ChunkScan {
        let mut scan = super::ChunkScan { cr: false, first_hint: None, blank_line_inside: false };
        let inside = bytes.len().saturating_sub(2);
        for (i, &b) in bytes.iter().enumerate() {
            match b {
                b'\r' => return super::ChunkScan { cr: true, ..scan },
                b'u' if scan.first_hint.is_none() && bytes.get(i.saturating_add(1)..i.saturating_add(5)) == Some(b"sage") => scan.first_hint = Some(i),
                b'\\' if scan.first_hint.is_none() && bytes.get(i.saturating_add(1)) == Some(&b'u') => scan.first_hint = Some(i),
                b'\n' if i < inside && bytes.get(i.saturating_add(1)) == Some(&b'\n') => scan.blank_line_inside = true,
                _ => {}
            }
        }
        scan
    }
}

/// Offset of the value of a `data` field line (`data:x`, `data: x`, or a bare `data`), else `None`.
fn data_value(line: &[u8]) -> Option<usize> {
    let rest = line.strip_prefix(b"data")?;
    match rest.first() {
        None => Some(4),
        Some(b':') => Some(if rest.get(1) == Some(&b' ') { 6 } else { 5 }),
        Some(_) => None,
    }
}

fn is_empty_array(v: &[u8]) -> bool {
    v.first() == Some(&b'[') && skip_ws(v, 1).saturating_add(1) == v.len() && v.last() == Some(&b']')
}

/// `json` (an object) without any top-level `key` member, separators tidied: a member is removed
/// with the separator before it (`,"usage":null`), or, when first, with the one after it.
///
/// `scanned` is `json`'s top-level object as the caller scanned it. A stream's content chunks name
/// `"usage":null` once each (the gateway asked for usage), so the one member is cut from that scan
/// directly; only an object naming the key more than once is scanned again, a member per round.
fn remove_members(json: &[u8], scanned: &Object, key: &str) -> Vec<u8> {
    let mut named = scanned.members.iter().enumerate().filter(|(_, m)| m.key_is(json, key));
    if let (Some((i, _)), None) = (named.next(), named.next()) {
        if let Some(range) = member_range(&scanned.members, i).filter(|r| r.start < r.end && r.end <= json.len()) {
            let mut out = Vec::with_capacity(json.len().saturating_sub(range.len()));
            out.extend_from_slice(json.get(..range.start).unwrap_or_default());
            out.extend_from_slice(json.get(range.end..).unwrap_or_default());
            return out;
        }
    }
    let mut text = json.to_vec();
    // One member per round; a round can only remove, so this ends (bounded by the member count).
    loop {
        let open = skip_ws(&text, 0);
        let Some(obj) = scan_object(&text, open) else {
            return text;
        };
        let Some(i) = obj.members.iter().position(|m| m.key_is(&text, key)) else {
            return text;
        };
        let Some(range) = member_range(&obj.members, i) else {
            return text;
        };
        if range.start >= range.end || range.end > text.len() {
            return text;
        }
        text.drain(range);
    }
}

/// The bytes that go with member `i`: from the end of the value before it, or, when it is first,
/// up to the next member's key (its separator with it).
fn member_range(members: &[Member], i: usize) -> Option<std::ops::Range<usize>> {
    match (i.checked_sub(1).and_then(|p| members.get(p)), members.get(i), members.get(i.saturating_add(1))) {
        (Some(prev), Some(m), _) => Some(prev.value_end..m.value_end),
        (None, Some(m), Some(next)) => Some(m.key_start..next.key_start),
        (None, Some(m), None) => Some(m.key_start..m.value_end),
        (_, None, _) => None,
    }
}

// ---------------------------------------------------------------------------------------------------
// A minimal scanner over JSON that serde_json has already validated. It never panics on any input
// (it returns `None` where the text is not what it expects) and is iterative, so depth is no issue.
// ---------------------------------------------------------------------------------------------------

/// One `"key": value` member of an object, as byte offsets into the text.
#[derive(Debug, Clone, Copy)]
struct Member {
    /// The opening quote of the key.
    key_start: usize,
    /// One past the closing quote of the key.
    key_end: usize,
    value_start: usize,
    value_end: usize,
}

impl Member {
    /// The key, unescaped, equals `want`.
    fn key_is(&self, s: &[u8], want: &str) -> bool {
        let Some(raw) = s.get(self.key_start..self.key_end) else {
            return false;
        };
        let inner = raw.get(1..raw.len().saturating_sub(1)).unwrap_or_default();
        if !inner.contains(&b'\\') {
            return inner == want.as_bytes();
        }
        serde_json::from_slice::<String>(raw).is_ok_and(|k| k == want)
    }
}

/// The members of an object and where its braces are.
#[derive(Debug, Clone)]
struct Object {
    open: usize,
    close: usize,
    members: Vec<Member>,
}

impl Object {
    /// The last member named `key`.
    fn last(&self, s: &[u8], key: &str) -> Option<Member> {
        self.members.iter().rev().find(|m| m.key_is(s, key)).copied()
    }

    /// The raw value text of the last member named `key`.
    fn last_value<'a>(&self, s: &'a [u8], key: &str) -> Option<&'a [u8]> {
        self.last(s, key).and_then(|m| s.get(m.value_start..m.value_end))
    }

    /// Where a new member goes: right after the last value, or after `{` when empty.
    fn insert_pos(&self) -> usize {
        self.members.last().map_or(self.open.saturating_add(1), |m| m.value_end)
    }
}

/// JSON's whitespace.
pub(crate) fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

fn skip_ws(s: &[u8], mut i: usize) -> usize {
    while s.get(i).copied().is_some_and(is_ws) {
        i = i.saturating_add(1);
    }
    i
}

/// The first `"` or `\\` in `bytes`: natively memchr's vector search (a request's prompt is one long
/// string the budget's rewrite skips), in wasm a plain loop.
#[cfg(not(target_arch = "wasm32"))]
fn quote_or_backslash(bytes: &[u8]) -> Option<usize> {
    memchr::memchr2(b'"', b'\\', bytes)
}

#[cfg(target_arch = "wasm32")]
fn quote_or_backslash(bytes: &[u8]) -> Option<usize> {
    bytes.iter().position(|&b| b == b'"' || b == b'\\')
}

/// `s[i]` is `"`: the index one past the closing quote.
fn string_end(s: &[u8], i: usize) -> Option<usize> {
    let mut j = i.saturating_add(1);
    loop {
        let k = quote_or_backslash(s.get(j..)?)?;
        let at = j.saturating_add(k);
        if s.get(at) == Some(&b'\\') {
            j = at.saturating_add(2);
        } else {
            return Some(at.saturating_add(1));
        }
    }
}

/// The index one past the value starting at `s[i]`.
fn value_end(s: &[u8], i: usize) -> Option<usize> {
    match s.get(i)? {
        b'"' => string_end(s, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match s.get(j)? {
                    b'"' => {
                        j = string_end(s, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth = depth.saturating_add(1),
                    b'}' | b']' => {
                        depth = depth.checked_sub(1)?;
                        if depth == 0 {
                            return Some(j.saturating_add(1));
                        }
                    }
                    _ => {}
                }
                j = j.saturating_add(1);
            }
        }
        _ => {
            // Number or literal: runs to the next delimiter.
            let rest = s.get(i..)?;
            let len = rest.iter().position(|&b| matches!(b, b',' | b'}' | b']') || is_ws(b)).unwrap_or(rest.len());
            (len > 0).then(|| i.saturating_add(len))
        }
    }
}

/// The object whose `{` is at `s[open]`.
fn scan_object(s: &[u8], open: usize) -> Option<Object> {
    if s.get(open) != Some(&b'{') {
        return None;
    }
    let mut members = Vec::new();
    let mut i = skip_ws(s, open.saturating_add(1));
    if s.get(i) == Some(&b'}') {
        return Some(Object { open, close: i, members });
    }
    loop {
        if s.get(i) != Some(&b'"') {
            return None;
        }
        let key_start = i;
        let key_end = string_end(s, i)?;
        i = skip_ws(s, key_end);
        if s.get(i) != Some(&b':') {
            return None;
        }
        let value_start = skip_ws(s, i.saturating_add(1));
        let value_end = value_end(s, value_start)?;
        members.push(Member { key_start, key_end, value_start, value_end });
        i = skip_ws(s, value_end);
        match s.get(i)? {
            b',' => i = skip_ws(s, i.saturating_add(1)),
            b'}' => return Some(Object { open, close: i, members }),
            _ => return None,
        }
    }
}

/// Replace `start..end` with `text`.
struct Edit {
    start: usize,
    end: usize,
    text: Vec<u8>,
}

impl Edit {
    fn new(start: usize, end: usize, text: Vec<u8>) -> Self {
        Self { start, end, text }
    }
}

/// `s[from..to]` with the (non-overlapping) edits applied; edits outside the range are ignored.
fn apply_edits(s: &[u8], from: usize, to: usize, edits: Vec<Edit>) -> Vec<u8> {
    // Stably by (start, end): by end, then by start, through the sort instance core shares
    // (crate::sort), not a copy of the standard library's sort for `Edit`.
    let edits = if edits.is_sorted_by_key(|e| (e.start, e.end)) {
        edits
    } else {
        crate::sort::stable_by_key(crate::sort::stable_by_key(edits, |e| e.end as u64), |e| e.start as u64)
    };
    let extra: usize = edits.iter().map(|e| e.text.len()).sum();
    let mut out = Vec::with_capacity(to.saturating_sub(from).saturating_add(extra));
    let mut at = from;
    for e in edits {
        if e.start < at || e.end < e.start || e.end > to {
            continue;
        }
        out.extend_from_slice(s.get(at..e.start).unwrap_or_default());
        out.extend_from_slice(&e.text);
        at = e.end;
    }
    out.extend_from_slice(s.get(at..to).unwrap_or_default());
    out
}

#[cfg(test)]
mod usage_hint_tests {
    #[test]
    fn the_usage_hint_finds_the_word_and_any_unicode_escape() {
        for (event, want) in [
            (&b"data: {\"usage\":null}"[..], true),
            (b"data: {\"us\\u0061ge\":{}}", true),
            (b"data: {\"choices\":[{\"delta\":{\"content\":\"usag\"}}]}", false),
            (b"data: {\"a\":\"line\\nbreak\"}", false),
            (b"usage", true),
            (b"usag", false),
            (b"", false),
        ] {
            assert_eq!(super::first_usage_hint(event).is_some(), want, "{}", String::from_utf8_lossy(event));
            assert_eq!(super::bytewise::first_usage_hint(event).is_some(), want, "{}", String::from_utf8_lossy(event));
        }
    }

    proptest::proptest! {
        /// The native searches and the wasm build's one pass agree on any bytes.
        #[test]
        fn both_forms_of_the_searches_agree(bytes in proptest::collection::vec(proptest::prop_oneof![proptest::sample::select(b"usage\\\r\n{}\" ".to_vec()), proptest::num::u8::ANY], 0..64)) {
            proptest::prop_assert_eq!(super::first_usage_hint(&bytes), super::bytewise::first_usage_hint(&bytes));
            let (native, one_pass) = (super::scan_chunk(&bytes), super::bytewise::scan_chunk(&bytes));
            // The one pass stops at a CR: the rest is not needed then.
            proptest::prop_assert_eq!(native.cr, one_pass.cr);
            if !native.cr {
                proptest::prop_assert_eq!(native, one_pass);
            }
        }
    }
}

#[cfg(test)]
mod fast_path_tests {
    use super::*;
    use proptest::prelude::*;

    fn replaced(v: Verdict) -> Option<Vec<u8>> {
        match v {
            Verdict::Replace { json, .. } => Some(json),
            _ => None,
        }
    }

    /// A JSON value: scalars, strings that may spell `usage` or hold escapes, nested objects.
    fn value() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<i32>().prop_map(serde_json::Value::from),
            "[a-z\\\"u ]{0,8}".prop_map(serde_json::Value::from),
            Just(serde_json::Value::from("usage")),
        ];
        leaf.prop_recursive(3, 12, 3, |inner| {
            prop::collection::vec(("[a-z]{1,5}|usage", inner), 0..3).prop_map(|m| serde_json::Value::Object(m.into_iter().collect()))
        })
    }

    proptest! {
        /// Whatever the members before it, an object ending in `,"usage":null}` is cut exactly as
        /// the scanning path cuts it; and the fast path declines whatever it cannot decide alone.
        #[test]
        fn the_trailing_null_usage_fast_path_agrees_with_the_scan(members in prop::collection::vec(("[a-z]{1,6}|usage", value()), 0..4), space in prop::bool::ANY) {
            let mut text = String::from("{");
            for (i, (k, v)) in members.iter().enumerate() {
                if i > 0 {
                    text.push(',');
                }
                text.push_str(&serde_json::to_string(k).unwrap());
                text.push(':');
                text.push_str(&v.to_string());
                if space {
                    text.push(' ');
                }
            }
            text.push_str(if members.is_empty() { "\"usage\":null}" } else { ",\"usage\":null}" });
            let data = text.as_bytes();
            prop_assume!(serde_json::from_slice::<IgnoredAny>(data).is_ok());
            let scanned = replaced(judge_scanned(data, Some((0, data.len()))));
            if let Some(fast) = without_trailing_null_usage(data) {
                prop_assert_eq!(Some(fast), scanned, "{}", text);
            }
        }
    }

    /// The fast path's cut applied to `data`: the bytes it leaves.
    fn without_trailing_null_usage(data: &[u8]) -> Option<Vec<u8>> {
        let cut = trailing_null_usage(data, first_usage_hint(data))?;
        let mut out = data.get(..cut.start)?.to_vec();
        out.extend_from_slice(data.get(cut.end..)?);
        Some(out)
    }

    #[test]
    fn the_fast_path_takes_the_usual_chunk_and_declines_the_rest() {
        let usual = br#"{"id":"c1","choices":[{"index":0,"delta":{"content":"tok1 "}}],"usage":null}"#;
        assert_eq!(without_trailing_null_usage(usual).as_deref(), Some(&br#"{"id":"c1","choices":[{"index":0,"delta":{"content":"tok1 "}}]}"#[..]));
        for declined in [
            &br#"{"usage":null}"#[..],
            br#"{"a":1 ,"usage":null}"#,
            br#"{"usage":1,"usage":null}"#,
            br#"{"a":"usage","usage":null}"#,
            br#"{"usage":1,"usage":null}"#,
            br#"{"a":1,"usage":null} "#,
        ] {
            assert_eq!(without_trailing_null_usage(declined), None, "{}", String::from_utf8_lossy(declined));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scanner_finds_members() {
        let s = br#" { "a" : 1 , "b\"c":[1,{"x":"}"}], "d":{"e":null} ,"f":"\\"} "#;
        let obj = scan_object(s, 1).unwrap();
        let keys: Vec<_> = obj.members.iter().map(|m| std::str::from_utf8(&s[m.key_start..m.key_end]).unwrap()).collect();
        assert_eq!(keys, [r#""a""#, r#""b\"c""#, r#""d""#, r#""f""#]);
        assert_eq!(obj.last_value(s, "a"), Some(&b"1"[..]));
        assert_eq!(obj.last_value(s, "b\"c"), Some(&br#"[1,{"x":"}"}]"#[..]));
        assert_eq!(obj.last_value(s, "f"), Some(&br#""\\""#[..]));
        assert_eq!(s[obj.close], b'}');
    }

    #[test]
    fn scanner_rejects_garbage_without_panicking() {
        for s in [&b"{"[..], b"{\"a", b"{\"a\":", b"{\"a\":1", b"{\"a\" 1}", b"{1:2}", b"{\"a\":[}"] {
            assert!(scan_object(s, 0).is_none(), "{s:?}");
        }
    }

    #[test]
    fn empty_array_detection() {
        assert!(is_empty_array(b"[]"));
        assert!(is_empty_array(b"[ \n ]"));
        assert!(!is_empty_array(b"[1]"));
        assert!(!is_empty_array(b"["));
        assert!(!is_empty_array(b"null"));
    }
}
