//! Streaming: a 1,000,000-line generic trace, generated line by line and never held whole, read
//! with a line buffer that stays bounded.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use sluice_sim::trace::{ReaderOptions, TraceReader, RETAINED_BUFFER_BYTES};
use std::io::{self, BufReader, Read, Write};
use std::time::Instant;

const LINES: u64 = 1_000_000;
/// One line of ~200 KiB (under the 1 MiB cap) half-way through: the buffer grows for it and is cut
/// back after it.
const BIG_LINE: u64 = 500_000;

/// Writes trace line `i` (0-based) into `out`.
fn line(i: u64, out: &mut Vec<u8>) {
    out.clear();
    let model = if i == BIG_LINE { "m".repeat(200 << 10) } else { format!("model-{}", i % 3) };
    writeln!(
        out,
        r#"{{"t_ms": {}, "tenant": "t{}", "key": "k{}", "user": "u{}", "model": "{model}", "prompt_tokens": {}, "max_tokens": 256, "output_tokens": {}, "stream": {}}}"#,
        i * 7,
        i % 13,
        i % 5,
        i % 1000,
        100 + i % 4000,
        i % 300,
        i & 1 == 0
    )
    .unwrap();
}

/// The trace as a `Read`: one line generated at a time into a reused buffer.
struct Synthetic {
    next: u64,
    line: Vec<u8>,
    pos: usize,
}

impl Read for Synthetic {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.pos == self.line.len() {
            if self.next == LINES {
                return Ok(0);
            }
            line(self.next, &mut self.line);
            self.next += 1;
            self.pos = 0;
            if self.line.capacity() > 4096 {
                self.line.shrink_to(4096);
            }
        }
        let n = out.len().min(self.line.len() - self.pos);
        out[..n].copy_from_slice(&self.line[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

#[test]
fn a_million_lines_in_bounded_memory() {
    let source = Synthetic { next: 0, line: Vec::new(), pos: 0 };
    let mut reader = TraceReader::new(BufReader::new(source), ReaderOptions::default());
    let started = Instant::now();
    let (mut records, mut prompt_sum, mut output_sum, mut last_arrival, mut max_capacity) = (0u64, 0u64, 0u64, 0u64, 0usize);
    let mut capacity_after_big_line = None;
    for _ in 0..=LINES {
        let Some(item) = reader.next() else { break };
        let r = item.unwrap();
        records += 1;
        prompt_sum += r.prompt_tokens.unwrap();
        output_sum += r.output_tokens.unwrap();
        last_arrival = r.arrival_ns;
        // What the reader keeps between lines.
        max_capacity = max_capacity.max(reader.buffer_capacity());
        if r.line == BIG_LINE + 1 {
            assert_eq!(r.model.as_ref().map(String::len), Some(200 << 10));
            capacity_after_big_line = Some(reader.buffer_capacity());
        }
    }
    let elapsed = started.elapsed();
    assert!(reader.next().is_none());
    let retained = reader.buffer_capacity();

    let expected_prompt: u64 = (0..LINES).map(|i| 100 + i % 4000).sum();
    let expected_output: u64 = (0..LINES).map(|i| i % 300).sum();
    assert_eq!(records, LINES);
    assert_eq!(reader.stats().records, LINES);
    assert_eq!(prompt_sum, expected_prompt);
    assert_eq!(output_sum, expected_output);
    assert_eq!(last_arrival, (LINES - 1) * 7 * 1_000_000);
    assert!(max_capacity <= RETAINED_BUFFER_BYTES, "the line buffer kept {max_capacity} bytes between lines");
    assert!(capacity_after_big_line.is_some_and(|c| c <= RETAINED_BUFFER_BYTES), "{capacity_after_big_line:?}");
    println!(
        "{LINES} lines in {:.2} s: {:.0} lines/s (debug builds are much slower than release); line buffer kept between lines: at most {max_capacity} bytes, {retained} at the end",
        elapsed.as_secs_f64(),
        LINES as f64 / elapsed.as_secs_f64()
    );
}
