//! The simulator's trace reader (sim/src/trace) on any bytes, in every format (given or detected)
//! and every option, read through a `BufRead` of fuzzer-chosen capacity.
//!
//! Checks the reader's documented promises besides never panicking: the first record arrives at
//! 0 and arrivals never go back; the line buffer never exceeds `max_line_bytes`; the record count
//! in the stats is the number yielded; and how the input is cut into reads changes nothing.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_core_fuzz::trace::{OnMalformed, OutOfOrder, ReaderOptions, RestartRule, TraceFormat, TraceReader};
use std::io::BufReader;
use std::time::Duration;

fn read(body: &[u8], options: ReaderOptions, capacity: usize) -> Vec<String> {
    let mut reader = TraceReader::new(BufReader::with_capacity(capacity, body), options);
    let mut items = Vec::new();
    let (mut records, mut last) = (0u64, None::<u64>);
    // Every item consumes at least one line; the bound stops a reader that would not end.
    for _ in 0..=body.len() + 1 {
        let Some(item) = reader.next() else { break };
        assert!(reader.buffer_capacity() <= options.max_line_bytes, "line buffer {} > {}", reader.buffer_capacity(), options.max_line_bytes);
        match item {
            Ok(r) => {
                match last {
                    None => assert_eq!(r.arrival_ns, 0, "the first record must arrive at 0"),
                    Some(prev) => assert!(r.arrival_ns >= prev, "arrival went back: {} after {prev}", r.arrival_ns),
                }
                last = Some(r.arrival_ns);
                records += 1;
                items.push(format!("{r:?}"));
            }
            Err(e) => items.push(format!("error {e}")),
        }
    }
    assert!(reader.next().is_none(), "the reader did not end");
    assert_eq!(reader.stats().records, records, "stats.records");
    items
}

fuzz_target!(|data: &[u8]| {
    let [a, b, body @ ..] = data else { return };
    let (a, b) = (*a, *b);
    let format = match a & 7 {
        0..=3 => Some(TraceFormat::ALL[usize::from(a & 3)]),
        _ => None,
    };
    let on_malformed = if a & 8 == 0 { OnMalformed::Skip } else { OnMalformed::Fail };
    let out_of_order = if a & 16 == 0 { OutOfOrder::Clamp } else { OutOfOrder::Reject };
    let restart = match (a >> 5) & 3 {
        0 => RestartRule::Period(Duration::from_secs(604_800)),
        1 => RestartRule::AfterLast,
        2 => RestartRule::Off,
        _ => RestartRule::Period(Duration::from_nanos(u64::MAX)),
    };
    let max_line_bytes = if b & 0x80 == 0 { 16 + usize::from(b) * 8 } else { 1 << 20 };
    let options = ReaderOptions { format, on_malformed, out_of_order, restart, max_line_bytes };
    let small = read(body, options, 1 + usize::from(b & 7));
    let large = read(body, options, 8192);
    assert_eq!(small, large, "the result depends on how the input is read");
    if let Ok(text) = std::str::from_utf8(body) {
        let _ = TraceFormat::detect(text.lines().next().unwrap_or_default());
    }
});
