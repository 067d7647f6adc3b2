//! Incremental Server-Sent Events framer following the WHATWG EventSource parsing rules.
//!
//! Body chunks arrive with arbitrary boundaries: one chunk may hold many events, and one event (or one
//! line, or a CR/LF pair) may be split across many chunks. The framer carries only the unfinished part
//! of the current event, capped at `max_event_bytes`; an event that would exceed the cap is dropped and
//! the framer resyncs at the next blank line, so memory stays bounded whatever the upstream sends.

/// Default cap on the bytes one event may carry over between chunks: its unfinished raw line
/// (field name included) plus the data and event-type values gathered so far. Events that would
/// exceed it are discarded and counted, and the framer resyncs at the next blank line.
///
/// 256 KiB is far above any real LLM stream event (a few hundred bytes; a final usage or tool-call
/// chunk rarely exceeds a few KiB) while keeping the worst case per stream small.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 256 * 1024;

/// One dispatched SSE event.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent {
    /// Value of the last `event:` line, if any (the spec's default type "message" is left as `None`).
    pub event: Option<String>,
    /// All `data:` lines of the event joined by `'\n'`.
    pub data: String,
}

/// Incremental SSE parser; see the module docs.
#[derive(Debug, Clone)]
pub struct SseFramer {
    max_event_bytes: usize,
    /// Bytes of a line whose terminator has not arrived yet.
    line: Vec<u8>,
    /// The current (non-empty) line is being skipped because its event overflowed.
    skipping_line: bool,
    /// The current event overflowed: ignore lines until the next blank line.
    discarding: bool,
    /// The previous chunk ended in CR: an LF at the start of the next chunk belongs to it.
    pending_cr: bool,
    /// No line has been completed yet (a leading UTF-8 BOM is stripped from the first line).
    at_stream_start: bool,
    event_type: Option<String>,
    data: String,
    has_data: bool,
    comments: u64,
    overflowed: u64,
}

impl Default for SseFramer {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_EVENT_BYTES)
    }
}

impl SseFramer {
    /// A framer that carries at most `max_event_bytes` of one event between chunks.
    pub fn new(max_event_bytes: usize) -> Self {
        Self {
            max_event_bytes,
            line: Vec::new(),
            skipping_line: false,
            discarding: false,
            pending_cr: false,
            at_stream_start: true,
            event_type: None,
            data: String::new(),
            has_data: false,
            comments: 0,
            overflowed: 0,
        }
    }

    /// Feed one body chunk; calls `on_event` for each complete event (dispatched at a blank line).
    ///
    /// Comments (lines starting with `:`) are counted, not dispatched. Events with no `data:` line are
    /// not dispatched (per spec). Lines end in LF, CRLF or CR, including a CR at the end of one chunk
    /// followed by LF at the start of the next (one line end, not two). Non-UTF-8 bytes are replaced
    /// with U+FFFD.
    pub fn push(&mut self, chunk: &[u8], on_event: &mut dyn FnMut(SseEvent)) {
        self.push_borrowed(chunk, &mut |ev: &mut SseEvent| on_event(std::mem::take(ev)));
    }

    /// [`Self::push`] for a receiver that only reads each event: the framer keeps its buffer, so the
    /// hot path allocates nothing per event.
    pub fn push_borrowed(&mut self, chunk: &[u8], on_event: &mut dyn FnMut(&mut SseEvent)) {
        let mut rest = chunk;
        if self.pending_cr {
            if let Some((&first, tail)) = rest.split_first() {
                self.pending_cr = false;
                if first == b'\n' {
                    rest = tail;
                }
            }
        }
        while let Some(pos) = find_line_end(rest) {
            let line = rest.get(..pos).unwrap_or_default();
            // Length of the terminator: CRLF is one line end; a CR at the very end of the chunk may be
            // the first half of a CRLF split across chunks.
            let term_len = match (rest.get(pos), rest.get(pos.saturating_add(1))) {
                (Some(b'\r'), Some(b'\n')) => 2,
                (Some(b'\r'), None) => {
                    self.pending_cr = true;
                    1
                }
                _ => 1,
            };
            self.complete_line(line, on_event);
            rest = rest.get(pos.saturating_add(term_len)..).unwrap_or_default();
        }
        self.carry(rest);
    }

    /// End of stream: dispatch a pending event that had data but no terminating blank line (lenient,
    /// since servers do this), then reset for reuse.
    pub fn finish(&mut self, on_event: &mut dyn FnMut(SseEvent)) {
        self.finish_borrowed(&mut |ev: &mut SseEvent| on_event(std::mem::take(ev)));
    }

    /// [`Self::finish`] for a receiver that only reads the event.
    pub fn finish_borrowed(&mut self, on_event: &mut dyn FnMut(&mut SseEvent)) {
        if !self.skipping_line && !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.process_line(&line, on_event);
        }
        if !self.discarding {
            self.dispatch(on_event);
        }
        self.line.clear();
        self.skipping_line = false;
        self.discarding = false;
        self.pending_cr = false;
        self.event_type = None;
        self.data.clear();
        self.has_data = false;
    }

    /// Number of comment lines (`:` …, typically keep-alives) seen so far.
    pub fn comments_seen(&self) -> u64 {
        self.comments
    }

    /// Events discarded because they exceeded the cap; after an overflow the framer resyncs at the
    /// next blank line.
    pub fn overflowed_events(&self) -> u64 {
        self.overflowed
    }

    /// Bytes currently carried for the unfinished event; never exceeds the cap given to [`Self::new`].
    pub fn buffered_bytes(&self) -> usize {
        self.line.len().saturating_add(self.data.len()).saturating_add(self.event_type.as_ref().map_or(0, String::len))
    }

    /// The cap given to [`Self::new`].
    pub fn max_event_bytes(&self) -> usize {
        self.max_event_bytes
    }

    /// Keep the start of a line whose terminator is in a later chunk.
    fn carry(&mut self, rest: &[u8]) {
        if rest.is_empty() || self.skipping_line {
            return;
        }
        if self.discarding {
            // A non-empty line inside a discarded event: nothing to keep, just remember it is not blank.
            self.skipping_line = true;
            return;
        }
        if self.buffered_bytes().saturating_add(rest.len()) > self.max_event_bytes {
            self.overflow();
            self.skipping_line = true;
            return;
        }
        let extra = bounded_growth(self.line.capacity(), self.line.len(), rest.len(), self.max_event_bytes);
        self.line.reserve_exact(extra);
        self.line.extend_from_slice(rest);
    }

    fn complete_line(&mut self, tail: &[u8], on_event: &mut dyn FnMut(&mut SseEvent)) {
        if self.skipping_line {
            // The line was non-empty and belongs to a discarded event.
            self.skipping_line = false;
            self.line.clear();
            return;
        }
        // The whole raw line counts against the cap whether or not it was split across chunks, so
        // where the chunk boundaries fall never changes which events are kept.
        if !self.discarding && self.buffered_bytes().saturating_add(tail.len()) > self.max_event_bytes {
            self.overflow();
            return;
        }
        if self.line.is_empty() {
            self.process_line(tail, on_event);
            return;
        }
        let mut line = std::mem::take(&mut self.line);
        line.extend_from_slice(tail);
        self.process_line(&line, on_event);
        // Give the allocation back so a split line does not cost an allocation every time.
        line.clear();
        self.line = line;
    }

    fn process_line(&mut self, line: &[u8], on_event: &mut dyn FnMut(&mut SseEvent)) {
        let mut line = line;
        if self.at_stream_start {
            self.at_stream_start = false;
            line = line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(line);
        }
        if line.is_empty() {
            if self.discarding {
                self.discarding = false;
            } else {
                self.dispatch(on_event);
            }
            return;
        }
        if self.discarding {
            return;
        }
        if line.first() == Some(&b':') {
            self.comments = self.comments.saturating_add(1);
            return;
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => {
                let value = line.get(colon.saturating_add(1)..).unwrap_or_default();
                (line.get(..colon).unwrap_or_default(), value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &b""[..]),
        };
        match field {
            b"data" => {
                let value = utf8_lossy(value);
                let sep = usize::from(self.has_data);
                let needed = self.buffered_bytes().saturating_add(value.len()).saturating_add(sep);
                if needed > self.max_event_bytes {
                    self.overflow();
                    return;
                }
                let extra = bounded_growth(self.data.capacity(), self.data.len(), value.len().saturating_add(sep), self.max_event_bytes);
                self.data.reserve_exact(extra);
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(&value);
                self.has_data = true;
            }
            b"event" => {
                let value = utf8_lossy(value);
                let old = self.event_type.as_ref().map_or(0, String::len);
                let needed = self.buffered_bytes().saturating_sub(old).saturating_add(value.len());
                if needed > self.max_event_bytes {
                    self.overflow();
                    return;
                }
                self.event_type = Some(value.into_owned());
            }
            // `id` and `retry` matter to a reconnecting browser, not to a proxy; unknown fields are
            // ignored per spec.
            _ => {}
        }
    }

    /// Hands the event over; a receiver that only borrows it leaves its buffer to be reused.
    fn dispatch(&mut self, on_event: &mut dyn FnMut(&mut SseEvent)) {
        let event = self.event_type.take();
        if self.has_data {
            self.has_data = false;
            let mut ev = SseEvent { event, data: std::mem::take(&mut self.data) };
            on_event(&mut ev);
            ev.data.clear();
            self.data = ev.data;
        }
    }

    fn overflow(&mut self) {
        self.overflowed = self.overflowed.saturating_add(1);
        // A first line dropped for its size still was the first line: a BOM on the next one is
        // content, not a marker to strip (else a BOM-only line ended the discarded event, or not,
        // depending on whether it arrived whole; found by fuzz/fuzz_targets/sse_stream.rs).
        self.at_stream_start = false;
        self.discarding = true;
        self.line.clear();
        self.data.clear();
        self.event_type = None;
        self.has_data = false;
    }
}

/// `String::from_utf8_lossy`, with the common case — valid UTF-8 — checked by `from_utf8`, whose
/// ASCII fast path is several times quicker than the lossy decoder's byte-by-byte walk.
fn utf8_lossy(bytes: &[u8]) -> std::borrow::Cow<'_, str> {
    match std::str::from_utf8(bytes) {
        Ok(text) => std::borrow::Cow::Borrowed(text),
        Err(_) => String::from_utf8_lossy(bytes),
    }
}

/// How much to `reserve_exact` so `additional` more bytes fit: amortised doubling like `Vec`, but
/// never past `max` (the cap), so capacity, not just length, stays bounded.
pub(crate) fn bounded_growth(capacity: usize, len: usize, additional: usize, max: usize) -> usize {
    let needed = len.saturating_add(additional);
    if needed <= capacity {
        return 0;
    }
    let target = capacity.saturating_mul(2).max(64).min(max).max(needed);
    target.saturating_sub(len)
}

/// Position of the first CR or LF in `haystack`: the framer's hot loop (SSE payloads are mostly
/// long JSON lines). Natively memchr's vector search (several times faster on the simulator's
/// profile); in wasm, which has no SIMD here, [`find_line_end_wordwise`].
#[cfg(not(target_arch = "wasm32"))]
pub(crate) fn find_line_end(haystack: &[u8]) -> Option<usize> {
    memchr::memchr2(b'\n', b'\r', haystack)
}

#[cfg(target_arch = "wasm32")]
pub(crate) use find_line_end_wordwise as find_line_end;

/// [`find_line_end`] a word at a time (8 bytes per step), the lowest byte [`bytes_equal`] flags
/// being always a real CR or LF.
#[cfg(any(target_arch = "wasm32", test))]
pub(crate) fn find_line_end_wordwise(haystack: &[u8]) -> Option<usize> {
    let (words, tail) = haystack.as_chunks::<8>();
    for (i, word) in words.iter().enumerate() {
        let v = u64::from_le_bytes(*word);
        let found = bytes_equal(v, b'\n') | bytes_equal(v, b'\r');
        if found != 0 {
            return Some(i.saturating_mul(8).saturating_add((found.trailing_zeros() / 8) as usize));
        }
    }
    let offset = haystack.len().saturating_sub(tail.len());
    tail.iter().position(|&b| b == b'\n' || b == b'\r').map(|p| offset.saturating_add(p))
}

/// The bytes of `word` (eight, little-endian) equal to `byte`, flagged by their high bit (the
/// classic "has zero byte" trick). A flag can be false only *above* a real match within the word,
/// so the lowest flagged byte is always exact.
pub(crate) fn bytes_equal(word: u64, byte: u8) -> u64 {
    const LO: u64 = 0x0101_0101_0101_0101;
    const HI: u64 = 0x8080_8080_8080_8080;
    let x = word ^ LO.wrapping_mul(u64::from(byte));
    x.wrapping_sub(LO) & !x & HI
}

/// The last (up to) four bytes of a stream: enough to tell whether it ended on an event boundary,
/// so lines appended to a stream (a summary comment, an error event) start a new event.
#[derive(Debug, Default, Clone, Copy)]
pub struct StreamTail {
    bytes: [u8; 4],
    len: usize,
}

impl StreamTail {
    pub fn push(&mut self, chunk: &[u8]) {
        for &b in chunk.iter().skip(chunk.len().saturating_sub(4)) {
            if self.len < 4 {
                self.len += 1;
            } else {
                self.bytes.rotate_left(1);
            }
            if let Some(slot) = self.bytes.get_mut(self.len - 1) {
                *slot = b;
            }
        }
    }

    /// What must come before appended SSE lines so they start a new event: nothing after a blank
    /// line, one line end after a complete line, two after an unterminated line. Servers do end
    /// streams without the final blank line; appending blindly would glue the comment onto data.
    pub fn separator_before_new_event(&self) -> &'static str {
        let tail = self.bytes.get(..self.len).unwrap_or_default();
        if tail.is_empty() || tail.ends_with(b"\n\n") || tail.ends_with(b"\r\r") || tail.ends_with(b"\r\n\r\n") {
            ""
        } else if tail.ends_with(b"\n") || tail.ends_with(b"\r") {
            "\n"
        } else {
            "\n\n"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(h: &[u8]) -> Option<usize> {
        h.iter().position(|&b| b == b'\n' || b == b'\r')
    }

    #[test]
    fn find_line_end_matches_naive_search() {
        let mut seed = 0x1234_5678_u32;
        for len in 0..70 {
            for _ in 0..200 {
                let buf: Vec<u8> = (0..len)
                    .map(|_| {
                        seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
                        // Bias towards bytes near CR/LF and high bytes to stress the bit trick.
                        match (seed >> 16) % 8 {
                            0 => b'\n',
                            1 => b'\r',
                            2 => 0x0b,
                            3 => 0x8d,
                            4 => 0x0c,
                            _ => (seed >> 8) as u8 | 0x20,
                        }
                    })
                    .collect();
                assert_eq!(find_line_end(&buf), naive(&buf), "{buf:?}");
                assert_eq!(find_line_end_wordwise(&buf), naive(&buf), "{buf:?}");
            }
        }
    }

    #[test]
    fn capacity_stays_within_cap() {
        let cap = 1000;
        let mut f = SseFramer::new(cap);
        for _ in 0..999 {
            f.push(b"y", &mut |_| {});
        }
        assert!(f.line.capacity() <= cap, "{}", f.line.capacity());
        let mut f = SseFramer::new(cap);
        for _ in 0..140 {
            f.push(b"data: 12345\n", &mut |_| {});
        }
        assert!(f.data.capacity() <= cap, "{}", f.data.capacity());
        assert_eq!(bounded_growth(0, 0, 10, 5), 10, "never less than needed");
    }

    #[test]
    fn find_line_end_every_position() {
        for len in 1..40 {
            for pos in 0..len {
                for &t in b"\r\n" {
                    let mut buf = vec![b'a'; len];
                    buf[pos] = t;
                    assert_eq!(find_line_end(&buf), Some(pos));
                }
            }
            assert_eq!(find_line_end(&vec![0xffu8; len]), None);
        }
    }
}

#[cfg(test)]
mod stream_tail_tests {
    use super::StreamTail;

    fn separator(chunks: &[&[u8]]) -> &'static str {
        let mut tail = StreamTail::default();
        for c in chunks {
            tail.push(c);
        }
        tail.separator_before_new_event()
    }

    #[test]
    fn appended_lines_always_start_a_new_event() {
        assert_eq!(separator(&[]), "");
        assert_eq!(separator(&[b"data: [DONE]\n\n"]), "");
        assert_eq!(separator(&[b"data: x\r\n\r\n"]), "");
        assert_eq!(separator(&[b"data: x\r\r"]), "");
        assert_eq!(separator(&[b"data: x\n"]), "\n");
        assert_eq!(separator(&[b"data: x\r\n"]), "\n");
        assert_eq!(separator(&[b"data: x"]), "\n\n");
        // The boundary is found across chunk edges, including empty chunks.
        assert_eq!(separator(&[b"data: x\n", b"\n", b""]), "");
        assert_eq!(separator(&[b"data: x\r\n\r", b"\n"]), "");
        assert_eq!(separator(&[b"\n\n", b"da", b"ta"]), "\n\n");
    }
}
