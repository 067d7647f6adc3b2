//! Stream timing: pure arithmetic on nanosecond timestamps supplied by the host.
//!
//! The plugin reads the host clock (`proxy_get_current_time_nanoseconds`) and passes the value in;
//! nothing here reads a clock, which is what lets the harness run a virtual one. Timestamps that go
//! backwards (a misbehaving host) saturate to zero-length intervals instead of wrapping.

const NANOS_PER_SEC: u128 = 1_000_000_000;

/// When a request started and when its content arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StreamTiming {
    /// Request start (headers seen).
    pub start_ns: u64,
    /// First chunk that carried content.
    pub first_content_ns: Option<u64>,
    /// Latest chunk that carried content.
    pub last_content_ns: Option<u64>,
    /// Content events seen.
    pub content_events: u64,
}

impl StreamTiming {
    /// Timing of a request that started at `start_ns`.
    pub fn new(start_ns: u64) -> Self {
        Self { start_ns, ..Self::default() }
    }

    /// A chunk with `events` content events arrived at `now_ns`; chunks without content are ignored.
    pub fn on_content(&mut self, now_ns: u64, events: u32) {
        if events == 0 {
            return;
        }
        self.first_content_ns.get_or_insert(now_ns);
        self.last_content_ns = Some(self.last_content_ns.map_or(now_ns, |l| l.max(now_ns)));
        self.content_events = self.content_events.saturating_add(u64::from(events));
    }

    /// Time to first token: first content − start.
    pub fn ttft_ns(&self) -> Option<u64> {
        self.first_content_ns.map(|f| f.saturating_sub(self.start_ns))
    }

    /// Decode span: last content − first content, when there was content.
    fn decode_span_ns(&self) -> Option<u64> {
        Some(self.last_content_ns?.saturating_sub(self.first_content_ns?))
    }

    /// Time per output token after the first: (last − first) / (output_tokens − 1).
    /// `None` with fewer than 2 tokens, or when all content arrived at one instant (a single chunk
    /// says nothing about per-token speed).
    pub fn tpot_ns(&self, output_tokens: u64) -> Option<u64> {
        let span = self.decode_span_ns().filter(|&s| s > 0)?;
        let gaps = output_tokens.checked_sub(1).filter(|&g| g > 0)?;
        Some(span / gaps)
    }

    /// Decode speed in tokens per second: (output_tokens − 1) / (last − first), rounded down.
    /// `None` with fewer than 2 tokens or a zero-length decode span.
    pub fn decode_tokens_per_s(&self, output_tokens: u64) -> Option<u64> {
        let span = self.decode_span_ns().filter(|&s| s > 0)?;
        let gaps = output_tokens.checked_sub(1).filter(|&g| g > 0)?;
        let rate = u128::from(gaps) * NANOS_PER_SEC / u128::from(span);
        Some(u64::try_from(rate).unwrap_or(u64::MAX))
    }

    /// Total request duration: end − start.
    pub fn duration_ns(&self, end_ns: u64) -> u64 {
        end_ns.saturating_sub(self.start_ns)
    }
}
