//! One stream's deadlines in the latency guard: when its response headers are held, when they are
//! released, and what the guard does when the TTFT or total deadline passes.
//!
//! [`StreamWatch`] is the per-stream state; its [`Phase`] says where the stream is. The plugin feeds
//! it the events it gets from the host (response headers, llm-metrics' first-token mark, a response
//! chunk, a tick, the stream's end), each with the host time in nanoseconds, and applies the
//! [`Effect`]s that come back in order. Nothing here reads a clock or calls the host.
//!
//! ```text
//! AwaitingHeaders ── headers, mark "0" ──► Held ── mark <t> ──► Streaming ◄── headers, not held ── AwaitingHeaders
//!   │                                       │                    │
//!   │ TTFT or total deadline                │ deadline           ├── TTFT deadline (not held: unmarked) ──► Reset(ttft)
//!   └──────────────► Replied(kind): 504 ◄───┘                    ├── total deadline, no chunk in CHUNK_WAIT ──► Reset(total)
//!                                                                └── chunk past the total deadline ──► Cut: error event,
//!                                                                    reset END_GRACE later, later chunks dropped
//! ```

use crate::api::ApiKind;
use crate::contract::{GatewayEnd, GatewayReply};
use crate::reply::error_body;
use crate::timing::StreamTiming;

/// The tick's shortest period while streams are watched, so a deadline fires at most this late
/// (Envoy 1.40 delivers a 1 ms tick every 3–4 ms).
pub const TICK_NS: u64 = 1_000_000;
/// The tick while nothing is watched: only open breakers need looking at. Also the longest the
/// tick waits while streams are watched (deadlines are computed exactly, so only the breakers'
/// sweep depends on it). Every tick costs Envoy a callback into the VM and the sweep's hostcalls:
/// an idle 1 ms tick cost ≈ 4 % of a core across a 2-worker Envoy, a 100 ms one ≈ 0.1–0.2 % of a
/// core per worker (measured with no traffic), so it is one second.
pub const IDLE_TICK_NS: u64 = 1_000_000_000;
/// How often a held stream is looked at when nothing may wake the guard at its first token
/// (llm-metrics finds no release queue, or is an older one): with a release queue this is a
/// fallback only, so it need not run every millisecond. Without one it is [`TICK_NS`].
pub const HELD_POLL_NS: u64 = 10_000_000;
/// After the error event that ends a stream at its total deadline, the stream is reset this much
/// later, so the event is written to the client before the reset.
pub const END_GRACE_NS: u64 = 20_000_000;
/// At the total deadline of a stream whose headers went out, the guard waits this long for a chunk
/// to carry the error event; a stream that sends nothing in that time is reset.
pub const CHUNK_WAIT_NS: u64 = 500_000_000;

/// Which deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadlineKind {
    /// Time to first content token.
    Ttft,
    /// The whole response.
    Total,
}

impl DeadlineKind {
    /// The `kind` label and the `x-sluice-deadline` value.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadlineKind::Ttft => "ttft",
            DeadlineKind::Total => "total",
        }
    }
}

/// A deadline that fired, and what the guard did about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fired {
    /// 504 at the TTFT deadline: nothing had reached the client.
    TtftReply,
    /// Reset at the TTFT deadline: headers had gone out (a stream llm-metrics did not mark).
    TtftReset,
    /// 504 at the total deadline: nothing had reached the client.
    TotalReply,
    /// The first chunk after the total deadline became an error event; reset shortly after.
    TotalEvent,
    /// Reset at the total deadline: headers had gone out and no chunk came to carry the event.
    TotalReset,
}

impl Fired {
    pub fn kind(self) -> DeadlineKind {
        match self {
            Fired::TtftReply | Fired::TtftReset => DeadlineKind::Ttft,
            Fired::TotalReply | Fired::TotalEvent | Fired::TotalReset => DeadlineKind::Total,
        }
    }

    /// The `action` label of `sluice.latency.deadline_total`.
    pub fn action(self) -> &'static str {
        match self {
            Fired::TtftReply | Fired::TotalReply => "reply_504",
            Fired::TtftReset | Fired::TotalReset => "reset",
            Fired::TotalEvent => "error_event",
        }
    }

    fn replied(kind: DeadlineKind) -> Fired {
        match kind {
            DeadlineKind::Ttft => Fired::TtftReply,
            DeadlineKind::Total => Fired::TotalReply,
        }
    }

    fn reset(kind: DeadlineKind) -> Fired {
        match kind {
            DeadlineKind::Ttft => Fired::TtftReset,
            DeadlineKind::Total => Fired::TotalReset,
        }
    }
}

/// Where a watched stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Admitted; the upstream's response headers have not arrived.
    AwaitingHeaders,
    /// Response headers held until llm-metrics marks the first content token: nothing has reached
    /// the client, so a deadline can still be a clean 504.
    Held,
    /// Response headers reached the client (released, or never held).
    Streaming {
        /// Past the total deadline, waiting until then for a chunk to carry the error event.
        chunk_wait_until_ns: Option<u64>,
    },
    /// A deadline fired while nothing had reached the client: answered 504.
    Replied(DeadlineKind),
    /// A deadline fired after the headers went out, with no chunk to carry an event: reset.
    Reset(DeadlineKind),
    /// The total deadline's error event went out; every later chunk is emptied.
    Cut {
        /// The stream is reset at this time (`None` once it was).
        reset_at_ns: Option<u64>,
    },
}

/// llm-metrics' first-token mark, as the guard reads it (defined with the other filter-state contracts).
pub use crate::contract::FirstTokenMark;

/// What the plugin does, in the order given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// Pause the response headers (and tell llm-metrics where to wake the guard).
    Hold,
    /// A stream that could be held but llm-metrics does not mark it: not held, so a TTFT deadline
    /// can only reset it (worth a warning).
    Unmarked,
    /// Resume the held response: headers and the chunks Envoy buffered behind them.
    Release,
    /// The stream's TTFT into its version's window now (once per stream), so a TTFT regression
    /// reaches the breaker without waiting for the end of every generation.
    RecordTtft { ttft_us: u64 },
    /// Past the total deadline: the guard waits until then for a chunk to carry the error event.
    AwaitChunk { until_ns: u64 },
    /// Answer 504 in the API's error shape ([`reply_504_body`]).
    Reply504 { kind: DeadlineKind, deadline_ms: u64 },
    /// Record the reply the client gets, for every plugin's report (one request, one story).
    MarkReply(GatewayReply),
    /// Reset the stream.
    Reset,
    /// Replace this chunk with the deadline's error event ([`error_event`]).
    ErrorEvent { kind: DeadlineKind, deadline_ms: u64 },
    /// Empty this chunk: the stream was cut by its error event.
    DropChunk,
    /// Count the deadline (`sluice.latency.deadline_total`, `kind` and `action` from [`Fired`]).
    CountFired(Fired),
    /// Log the deadline with the time since the request started.
    LogFired { fired: Fired, deadline_ms: u64, after_ms: u64 },
    /// Something is due sooner than the tick may think: re-time it.
    Reschedule,
}

/// The effects of one event; usually none, never more than a handful.
pub type Effects = Vec<Effect>;

/// What the end of a watched stream reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    pub fired: Option<Fired>,
    /// The TTFT of the stream's stamp, µs: at a TTFT deadline that fired, the deadline.
    pub ttft_us: Option<u64>,
    /// The TTFT for the window at the end; `None` when it went in at the first token.
    pub window_ttft_us: Option<u64>,
}

/// One admitted stream's deadlines and phase.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamWatch {
    start_ns: u64,
    /// Cleared once the whole response has passed the guard.
    ttft_deadline_ns: Option<u64>,
    total_deadline_ns: Option<u64>,
    /// A content token passed (the TTFT deadline no longer applies).
    first_token_ns: Option<u64>,
    /// The TTFT went into the window at the first token (not again at the end).
    ttft_recorded: bool,
    /// Status of the upstream's response headers (what the client sees once they are released).
    status: u16,
    phase: Phase,
}

impl StreamWatch {
    /// A request admitted at `start_ns` with the version's deadlines (ns after the start).
    /// `stream`: whether the request asked for a stream (`None`: unknown, treated as one). A whole
    /// answer has no first token before its end: only the total deadline applies to it.
    pub fn new(start_ns: u64, ttft_deadline_ns: Option<u64>, total_deadline_ns: Option<u64>, stream: Option<bool>) -> Self {
        let at = |d: Option<u64>| d.map(|d| start_ns.saturating_add(d));
        StreamWatch {
            start_ns,
            ttft_deadline_ns: if stream == Some(false) { None } else { at(ttft_deadline_ns) },
            total_deadline_ns: at(total_deadline_ns),
            first_token_ns: None,
            ttft_recorded: false,
            status: 0,
            phase: Phase::AwaitingHeaders,
        }
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    pub fn is_held(&self) -> bool {
        self.phase == Phase::Held
    }

    /// The deadline that fired, if one did.
    pub fn fired(&self) -> Option<Fired> {
        match self.phase {
            Phase::Replied(kind) => Some(Fired::replied(kind)),
            Phase::Reset(kind) => Some(Fired::reset(kind)),
            Phase::Cut { .. } => Some(Fired::TotalEvent),
            Phase::AwaitingHeaders | Phase::Held | Phase::Streaming { .. } => None,
        }
    }

    pub fn first_token_ns(&self) -> Option<u64> {
        self.first_token_ns
    }

    /// The TTFT deadline, ms after the start (0 without one).
    pub fn ttft_ms(&self) -> u64 {
        self.ttft_deadline_ns.map(|d| d.saturating_sub(self.start_ns) / 1_000_000).unwrap_or(0)
    }

    /// The total deadline, ms after the start (0 without one).
    pub fn total_ms(&self) -> u64 {
        self.total_deadline_ns.map(|d| d.saturating_sub(self.start_ns) / 1_000_000).unwrap_or(0)
    }

    fn deadline_ms(&self, kind: DeadlineKind) -> u64 {
        match kind {
            DeadlineKind::Ttft => self.ttft_ms(),
            DeadlineKind::Total => self.total_ms(),
        }
    }

    /// When the tick next has something to do for this stream; `None` when only its end is left.
    /// `release_queue`: whether llm-metrics can wake the guard at a held stream's first token.
    pub fn next_due_ns(&self, now: u64, release_queue: bool) -> Option<u64> {
        let poll = self.is_held().then(|| now.saturating_add(held_poll_ns(release_queue)));
        [poll, self.due_ns()].into_iter().flatten().min()
    }

    /// [`Self::next_due_ns`] without a held stream's poll: the next deadline or reset, a time that
    /// changes only when the stream does (not with `now`), so a watch list can keep it in order.
    pub fn due_ns(&self) -> Option<u64> {
        let chunk_wait = match self.phase {
            Phase::Cut { reset_at_ns } => return reset_at_ns,
            Phase::Replied(_) | Phase::Reset(_) => return None,
            Phase::Streaming { chunk_wait_until_ns } => chunk_wait_until_ns,
            Phase::AwaitingHeaders | Phase::Held => None,
        };
        let ttft = self.ttft_deadline_ns.filter(|_| self.first_token_ns.is_none());
        let total = chunk_wait.or(self.total_deadline_ns);
        [ttft, total].into_iter().flatten().min()
    }

    /// Whether a tick at `now` can act on this stream: a held stream is polled at every tick, any
    /// other only once something it waits for is due ([`Self::next_due_ns`]). A tick of a stream
    /// that is not due returns no effects and changes nothing, so a worker's tick visits only the
    /// due ones (a stream that waits for nothing but its end was visited at every tick).
    pub fn tick_due(&self, now: u64) -> bool {
        self.is_held() || self.due_ns().is_some_and(|due| due <= now)
    }

    /// The upstream's response headers: `status`, whether the body is an event stream, whether
    /// the headers are the whole response. `mark` reads llm-metrics' first-token mark; it is read
    /// only when the stream could be held (a TTFT deadline, a 2xx event stream with a body).
    pub fn on_response_headers(&mut self, status: u16, event_stream: bool, end_of_stream: bool, mark: impl FnOnce() -> FirstTokenMark) -> Effects {
        let mut effects = Effects::new();
        self.status = status;
        let fired = self.fired().is_some();
        // Headers that already went out (a second header event) are not taken back.
        let unsent = matches!(self.phase, Phase::AwaitingHeaders | Phase::Held);
        let wants_hold = self.ttft_deadline_ns.is_some() && event_stream && !end_of_stream && (200..300).contains(&status);
        if wants_hold && self.first_token_ns.is_none() && unsent {
            match mark() {
                // llm-metrics is behind the guard and waits for the first token: hold until it has.
                FirstTokenMark::Waiting => {
                    self.phase = Phase::Held;
                    return vec![Effect::Hold, Effect::Reschedule];
                }
                FirstTokenMark::Absent => effects.push(Effect::Unmarked),
                FirstTokenMark::At(_) | FirstTokenMark::Unreadable => {}
            }
        }
        if !fired {
            let chunk_wait_until_ns = match self.phase {
                Phase::Streaming { chunk_wait_until_ns } => chunk_wait_until_ns,
                _ => None,
            };
            self.phase = Phase::Streaming { chunk_wait_until_ns };
        }
        if end_of_stream {
            self.response_complete();
        }
        effects
    }

    /// llm-metrics' mark as read for a held stream (woken through the release queue, or polled by
    /// the tick): released at its first token.
    pub fn on_first_token_mark(&mut self, mark: FirstTokenMark) -> Effects {
        match (self.phase, mark) {
            (Phase::Held, FirstTokenMark::At(first)) => {
                self.phase = Phase::Streaming { chunk_wait_until_ns: None };
                self.first_token_ns = Some(first);
                let mut effects = vec![Effect::Release];
                effects.extend(self.record_ttft(first));
                effects
            }
            _ => Effects::new(),
        }
    }

    /// A response chunk at `now`. `observe` reads the chunk and says whether it carried content; it
    /// is not called for a chunk that is dropped (the stream was cut by its error event).
    /// `event_stream`: the response is an event stream (an error event can ride on the chunk).
    pub fn on_response_body(&mut self, now: u64, event_stream: bool, end_of_stream: bool, observe: impl FnOnce() -> bool) -> Effects {
        if let Phase::Cut { .. } = self.phase {
            // Nothing after the error event reaches the client.
            return vec![Effect::DropChunk];
        }
        let mut effects = Effects::new();
        if observe() {
            // Not held (no llm-metrics mark): the guard's own observation is the first token.
            let first = *self.first_token_ns.get_or_insert(now);
            effects.extend(self.record_ttft(first));
        }
        let past_total = self.fired().is_none() && self.total_deadline_ns.is_some_and(|d| now >= d) && !end_of_stream;
        if past_total && event_stream {
            effects.push(Effect::ErrorEvent { kind: DeadlineKind::Total, deadline_ms: self.total_ms() });
            effects.push(Effect::MarkReply(self.deadline_reply()));
            self.phase = Phase::Cut { reset_at_ns: Some(now.saturating_add(END_GRACE_NS)) };
            effects.push(Effect::CountFired(Fired::TotalEvent));
            effects.push(Effect::Reschedule);
        }
        if end_of_stream {
            self.response_complete();
        }
        effects
    }

    /// A tick at `now`. `mark`: llm-metrics' mark, read for a held stream ([`Self::is_held`]);
    /// `None` otherwise. Every effect acts on this stream: the caller makes it the effective
    /// context first.
    pub fn on_tick(&mut self, now: u64, mark: Option<FirstTokenMark>) -> Effects {
        match self.phase {
            Phase::Cut { reset_at_ns: Some(at) } => {
                if now < at {
                    return Effects::new();
                }
                self.phase = Phase::Cut { reset_at_ns: None };
                return vec![Effect::Reset];
            }
            Phase::Cut { reset_at_ns: None } | Phase::Replied(_) | Phase::Reset(_) => return Effects::new(),
            Phase::Held => {
                let released = self.on_first_token_mark(mark.unwrap_or(FirstTokenMark::Absent));
                if !released.is_empty() {
                    return released;
                }
            }
            Phase::AwaitingHeaders | Phase::Streaming { .. } => {}
        }
        let ttft_due = self.first_token_ns.is_none() && self.ttft_deadline_ns.is_some_and(|d| now >= d);
        let total_due = self.total_deadline_ns.is_some_and(|d| now >= d);
        if !ttft_due && !total_due {
            return Effects::new();
        }
        let headers_out = if let Phase::Streaming { chunk_wait_until_ns } = self.phase {
            if !ttft_due {
                // Headers went out: the error event needs a chunk to ride on (the body callback
                // puts it there); a stream that stays silent is reset.
                match chunk_wait_until_ns {
                    None => {
                        let until_ns = now.saturating_add(CHUNK_WAIT_NS);
                        self.phase = Phase::Streaming { chunk_wait_until_ns: Some(until_ns) };
                        return vec![Effect::AwaitChunk { until_ns }];
                    }
                    Some(until) if now < until => return Effects::new(),
                    Some(_) => {}
                }
            }
            true
        } else {
            false
        };
        let kind = if ttft_due { DeadlineKind::Ttft } else { DeadlineKind::Total };
        let deadline_ms = self.deadline_ms(kind);
        let (fired, mut effects) = if headers_out {
            // Headers went out and no data is flowing to carry an error event: all that is left.
            self.phase = Phase::Reset(kind);
            (Fired::reset(kind), vec![Effect::MarkReply(self.deadline_reply()), Effect::Reset])
        } else {
            // Nothing has reached the client: a clean 504 (Envoy resets the upstream request).
            self.phase = Phase::Replied(kind);
            (Fired::replied(kind), vec![Effect::Reply504 { kind, deadline_ms }])
        };
        let after_ms = now.saturating_sub(self.start_ns) / 1_000_000;
        effects.push(Effect::LogFired { fired, deadline_ms, after_ms });
        effects.push(Effect::CountFired(fired));
        effects
    }

    /// The stream's end (its access log). `timing`: the guard's own reading of the stream, which
    /// takes llm-metrics' first-token mark when that is earlier (the guard sees the token later
    /// while it holds the headers); a stream without content has no TTFT, whatever released it.
    pub fn end(self, timing: &mut StreamTiming) -> Finished {
        if let Some(first) = self.first_token_ns {
            if timing.first_content_ns.is_some_and(|t| first < t) {
                timing.first_content_ns = Some(first);
            }
        }
        let fired = self.fired();
        let ttft_us = match fired {
            // The TTFT is at least the deadline; the window sees the deadline.
            Some(Fired::TtftReply | Fired::TtftReset) => self.ttft_deadline_ns.map(|d| d.saturating_sub(self.start_ns) / 1000),
            _ => timing.ttft_ns().map(|v| v / 1000),
        };
        Finished { fired, ttft_us, window_ttft_us: if self.ttft_recorded { None } else { ttft_us } }
    }

    /// The whole response has passed; the stream may still be logged much later (a client that
    /// reads slowly): a deadline now would reset a complete answer and sample it as an error.
    fn response_complete(&mut self) {
        self.ttft_deadline_ns = None;
        self.total_deadline_ns = None;
    }

    fn record_ttft(&mut self, first_ns: u64) -> Option<Effect> {
        if self.ttft_recorded {
            return None;
        }
        self.ttft_recorded = true;
        Some(Effect::RecordTtft { ttft_us: first_ns.saturating_sub(self.start_ns) / 1000 })
    }

    fn deadline_reply(&self) -> GatewayReply {
        GatewayReply { status: self.status, end: GatewayEnd::Deadline }
    }
}

/// How long after a tick a held stream is looked at again: [`HELD_POLL_NS`] when the host wakes
/// the guard at its first token (the look is a fallback), else [`TICK_NS`].
pub fn held_poll_ns(woken_at_first_token: bool) -> u64 {
    if woken_at_first_token {
        HELD_POLL_NS
    } else {
        TICK_NS
    }
}

/// The tick period, ms, when the earliest thing due on this worker is at `due` (a deadline, a
/// reset, a held stream's poll): rounded up to whole milliseconds so nothing fires early, between
/// [`TICK_NS`] and [`IDLE_TICK_NS`] (the idle tick when nothing is due).
pub fn tick_period_ms(now: u64, due: impl IntoIterator<Item = u64>) -> u64 {
    let next = due.into_iter().fold(now.saturating_add(IDLE_TICK_NS), u64::min);
    next.saturating_sub(now).div_ceil(1_000_000).clamp(TICK_NS / 1_000_000, IDLE_TICK_NS / 1_000_000)
}

/// The body of the 504 sent at a deadline that fired before anything reached the client.
pub fn reply_504_body(api: ApiKind, kind: DeadlineKind, version: &str, deadline_ms: u64) -> String {
    let which = kind.as_str();
    let what = match kind {
        DeadlineKind::Ttft => "the first token",
        DeadlineKind::Total => "the response",
    };
    let message = format!("sluice latency-guard: {what} of model version {version} did not arrive within the {which} deadline of {deadline_ms} ms");
    error_body(Some(api), &message, "timeout", &format!("{which}_deadline_exceeded"))
}

/// The SSE event that ends a stream at a deadline: the API's own error event (Anthropic `event:
/// error`), or an OpenAI-style `error` chunk followed by `[DONE]` so clients stop reading.
pub fn error_event(api: ApiKind, kind: DeadlineKind, deadline_ms: u64) -> String {
    let which = kind.as_str();
    let message = format!("sluice latency-guard: {which} deadline of {deadline_ms} ms exceeded; the response was cut here");
    let body = error_body(Some(api), &message, "timeout", &format!("{which}_deadline_exceeded"));
    match api {
        ApiKind::AnthropicMessages => format!("event: error\ndata: {body}\n\n"),
        ApiKind::Responses => {
            let event = serde_json::json!({"type": "error", "code": format!("{which}_deadline_exceeded"), "message": message, "param": null});
            format!("event: error\ndata: {event}\n\n")
        }
        ApiKind::ChatCompletions | ApiKind::Completions => format!("data: {body}\n\ndata: [DONE]\n\n"),
    }
}
