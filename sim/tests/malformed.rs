//! Malformed lines: reported with their line number, field and reason, skipped or fatal by policy.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use sluice_sim::trace::{OnMalformed, ReaderOptions, TraceError, TraceFormat, TraceReader, TraceStats, RETAINED_BUFFER_BYTES};
use std::io::{self, BufReader, Read};

/// (line, field, the error's text contains) per error; the lines of the records.
type Errors = Vec<(u64, Option<String>, String)>;

fn run(bytes: &[u8], options: ReaderOptions) -> (Vec<u64>, Errors, TraceStats) {
    let mut reader = TraceReader::new(bytes, options);
    let (mut records, mut errors) = (Vec::new(), Vec::new());
    for item in &mut reader {
        match item {
            Ok(r) => records.push(r.line),
            Err(e) => errors.push((e.line, e.field.as_deref().map(str::to_string), e.to_string())),
        }
    }
    (records, errors, reader.stats())
}

fn skip() -> ReaderOptions {
    ReaderOptions { on_malformed: OnMalformed::Skip, ..ReaderOptions::default() }
}

fn fail() -> ReaderOptions {
    ReaderOptions { on_malformed: OnMalformed::Fail, ..ReaderOptions::default() }
}

/// Checks each error's line and field and that its text contains the reason.
fn check(errors: &Errors, want: &[(u64, Option<&str>, &str)]) {
    assert_eq!(errors.len(), want.len(), "{errors:#?}");
    for (got, want) in errors.iter().zip(want) {
        assert_eq!((got.0, got.1.as_deref()), (want.0, want.1), "{got:?}");
        assert!(got.2.contains(want.2), "{:?} does not contain {:?}", got.2, want.2);
        assert!(got.2.starts_with(&format!("line {}", want.0)), "{}", got.2);
    }
}

fn generic_trace() -> Vec<u8> {
    let mut t = Vec::new();
    let lines: [&[u8]; 17] = [
        br#"{"t_ms": 100, "prompt_tokens": 10}"#,
        br#"{"t_ms": 1, "prompt_tokens": "12x"}"#,
        br#"{"t_ms": 2}"#,
        br#"{"time": "2025-02-30T00:00:00Z", "prompt_tokens": 1}"#,
        b"{\"t_ms\": 3, \"user\": \"\xff\", \"prompt_tokens\": 1}",
        br#"{"t_ms": 4, "prompt_tokens": 1, "model": "a very long model name, longer than the 96 bytes this test allows a line to be"}"#,
        br#"{"t_ms": 5, "prompt_tokens": "#,
        br#"{"t_ms": 6, "prompt_tokens": 2} trailing"#,
        br#"[6, 2]"#,
        br#"{"t_ms": 7, "prompt_tokens": 3, "api": "chat"}"#,
        br#"{"t_ms": 8, "time": "2025-01-01T00:00:00Z", "prompt_tokens": 1}"#,
        br#"{"time": "2025-01-01T00:00:00Z", "prompt_tokens": 1}"#,
        br#"{"t_ms": -1, "prompt_tokens": 1}"#,
        br#"{"t_ms": 9, "prompt_tokens": 1.5}"#,
        br#"{"t_ms": 10, "prompt_tokens": 4, "stream": "yes"}"#,
        br#"{"t_ms": 0.5, "prompt_tokens": 1}"#,
        br#"{"t_ms": 110, "prompt_tokens": 5, "outcome": "completed"}"#,
    ];
    for line in lines {
        t.extend_from_slice(line);
        t.push(b'\n');
    }
    t
}

#[test]
fn generic_malformed_lines_skipped() {
    let (records, errors, stats) = run(&generic_trace(), ReaderOptions { max_line_bytes: 96, ..skip() });
    assert_eq!(records, [1, 17]);
    check(
        &errors,
        &[
            (2, Some("prompt_tokens"), "invalid type: string \"12x\", expected u64"),
            (3, Some("prompt_tokens"), "missing"),
            (4, Some("time"), "day 30 does not exist in 2025-02"),
            (5, None, "not UTF-8: invalid byte at column 22"),
            (6, None, "line of 122 bytes is longer than the limit of 96 bytes"),
            (7, None, "not JSON: EOF while parsing a value (column 29)"),
            (8, None, "not JSON: trailing characters (column 33)"),
            (9, None, "not JSON: expected a JSON object"),
            (10, Some("api"), "unknown API \"chat\""),
            (11, Some("time"), "not both"),
            (12, Some("time"), "this trace's arrivals are relative (`t_ms`), from its first record: a line cannot give `time`"),
            (13, Some("t_ms"), "negative milliseconds -1"),
            (14, Some("prompt_tokens"), "invalid type: floating point `1.5`, expected u64"),
            (15, Some("stream"), "invalid type: string \"yes\", expected a boolean"),
            (16, Some("t_ms"), "arrival -0.0995 s after the first record is before the previous record's 0 s (out of order)"),
        ],
    );
    assert_eq!(stats, TraceStats { lines: 17, records: 2, malformed: 15, ..TraceStats::default() });
    // The messages docs/simulator.md shows, exactly.
    let text: Vec<&str> = errors.iter().map(|e| e.2.as_str()).collect();
    for shown in [
        r#"line 2, field `prompt_tokens`: invalid type: string "12x", expected u64"#,
        "line 3, field `prompt_tokens`: missing",
        r#"line 4, field `time`: "2025-02-30T00:00:00Z": day 30 does not exist in 2025-02"#,
        "line 5: not UTF-8: invalid byte at column 22",
        "line 7: not JSON: EOF while parsing a value (column 29)",
        "line 16, field `t_ms`: arrival -0.0995 s after the first record is before the previous record's 0 s (out of order)",
    ] {
        assert!(text.contains(&shown), "{shown:?} not in {text:#?}");
    }
}

#[test]
fn generic_malformed_line_fatal() {
    let (records, errors, stats) = run(&generic_trace(), fail());
    assert_eq!(records, [1]);
    check(&errors, &[(2, Some("prompt_tokens"), "expected u64")]);
    assert_eq!(stats, TraceStats { lines: 2, records: 1, malformed: 1, ..TraceStats::default() });
    // Each kind of error stops the trace at its own line.
    let trace = generic_trace();
    let lines: Vec<&[u8]> = trace.split(|&b| b == b'\n').collect();
    for bad in 2..=16 {
        let mut text = lines[0].to_vec();
        text.push(b'\n');
        text.extend_from_slice(lines[bad - 1]);
        text.extend_from_slice(b"\n{\"t_ms\": 200, \"prompt_tokens\": 1}\n");
        let (records, errors, _) = run(&text, ReaderOptions { max_line_bytes: 96, ..fail() });
        assert_eq!(records, [1], "line {bad}: {errors:?}");
        assert_eq!(errors.len(), 1, "line {bad}: {errors:?}");
        assert_eq!(errors[0].0, 2, "{errors:?}");
    }
}

const AZURE: &[u8] = b"TIMESTAMP,ContextTokens,GeneratedTokens\r
2023-11-16 18:15:46.6805900,374,44\r
2023-11-16 18:15:47.0000000,3x4,44\r
2023-11-16 18:15:48.0000000,374\r
2023-11-16 25:15:48.0000000,374,1\r
2023-11-16 18:15:49.0000000,,1\r
2023-11-16 18:15:49.1234567890,1,1\r
2023-11-16 18:15:50.0000000,5,-1\r
2023-11-16 18:15:50.0000000,5,\xe9\r
2023-11-16 18:15:51.0000000,6,7";

#[test]
fn azure_malformed_lines() {
    let (records, errors, stats) = run(AZURE, skip());
    assert_eq!(records, [2, 10]);
    check(
        &errors,
        &[
            (3, Some("ContextTokens"), "expected a non-negative integer, got \"3x4\""),
            (4, None, "2 fields, the header has 3"),
            (5, Some("TIMESTAMP"), "time 25:15 does not exist"),
            (6, Some("ContextTokens"), "missing"),
            (7, Some("TIMESTAMP"), "more than 9 fractional digits"),
            (8, Some("GeneratedTokens"), "got \"-1\""),
            (9, None, "not UTF-8: invalid byte at column 31"),
        ],
    );
    assert_eq!(stats, TraceStats { lines: 10, records: 2, malformed: 7, ..TraceStats::default() });
    let (records, errors, _) = run(AZURE, fail());
    assert_eq!(records, [2]);
    check(&errors, &[(3, Some("ContextTokens"), "3x4")]);
}

#[test]
fn ragpulse_malformed_lines() {
    let text = br#"{"timestamp": "10", "input_length": 1, "output_length": 1, "session_id": "a"}
{"timestamp": "1x", "input_length": 1}
{"timestamp": 12, "output_length": 3}
{"timestamp": "13", "input_length": -4}
{"input_length": 4}
{"timestamp": "14.5", "input_length": 5, "hash_ids": {"sys_prompt": [1, 2]}}
"#;
    let (records, errors, _) = run(text, skip());
    assert_eq!(records, [1, 6]);
    check(
        &errors,
        &[
            (2, Some("timestamp"), "expected non-negative decimal seconds, got \"1x\""),
            (3, Some("input_length"), "missing"),
            (4, Some("input_length"), "invalid value: integer `-4`, expected u64"),
            (5, Some("timestamp"), "missing"),
        ],
    );
    let (records, errors, _) = run(text, fail());
    assert_eq!((records.as_slice(), errors.len(), errors[0].0), (&[1u64][..], 1, 2));
}

#[test]
fn access_log_malformed_lines() {
    let text = br#"{"start_time":"2026-12-01T04:10:07.707Z","path":"/v1/chat/completions","sluice":"{\"input_tokens\":3}"}
{"start_time":"2026-12-01T04:10:07.708Z","path":"/v1/chat/completions","sluice":"{not json"}
{"start_time":"2026-12-01T04:10:07.709Z","path":"/v1/chat/completions","sluice":"{\"input_tokens\":\"x\"}"}
{"start_time":"2026-12-01 04:10:07","path":"/v1/chat/completions","sluice":"{}"}
{"start_time":"2026-12-01T04:10:07.710Z","path":"/v1/chat/completions","sluice":"{\"outcome\":\"weird\"}"}
{"path":"/v1/chat/completions","sluice":"{}"}
{"start_time":"2026-12-01T04:10:07.711Z","path":"/v1/messages","status":"abc"}
{"start_time":"2026-12-01T04:10:07.712Z","path":"/v1/messages","sluice":17}
{"start_time":"2026-12-01T04:10:07.713Z","path":"/v1/chat/completions","status":200}
"#;
    let (records, errors, stats) = run(text, skip());
    assert_eq!(records, [1, 9]);
    check(
        &errors,
        &[
            (2, Some("sluice"), "not JSON: key must be a string (column 2)"),
            (3, Some("sluice.input_tokens"), "invalid type: string \"x\", expected u64"),
            (4, Some("start_time"), "missing the UTC offset"),
            (5, Some("sluice.outcome"), "unknown outcome \"weird\""),
            (6, Some("start_time"), "missing"),
            (7, Some("status"), "expected an HTTP status, got \"abc\""),
            (8, Some("sluice"), "expected the stamp as a JSON string or object"),
        ],
    );
    assert_eq!(stats.malformed, 7);
}

#[test]
fn over_long_line_with_the_default_cap() {
    // A 2 MiB line between two good ones: an error, and the buffer does not keep its size.
    let mut text = b"{\"t_ms\": 0, \"prompt_tokens\": 1}\n{\"t_ms\": 1, \"prompt_tokens\": 1, \"model\": \"".to_vec();
    text.resize(text.len() + (2 << 20), b'x');
    text.extend_from_slice(b"\"}\n{\"t_ms\": 2, \"prompt_tokens\": 2}\n");
    let mut reader = TraceReader::new(BufReader::new(&text[..]), skip());
    assert_eq!(reader.next().unwrap().unwrap().line, 1);
    let e = reader.next().unwrap().unwrap_err();
    assert_eq!(e.line, 2);
    assert_eq!(e.to_string(), "line 2: line of 2097196 bytes is longer than the limit of 1048576 bytes");
    assert!(reader.buffer_capacity() <= RETAINED_BUFFER_BYTES, "{}", reader.buffer_capacity());
    assert_eq!(reader.next().unwrap().unwrap().line, 3);
    assert!(reader.next().is_none());

    let mut reader = TraceReader::new(BufReader::new(&text[..]), fail());
    assert!(reader.next().unwrap().is_ok());
    assert_eq!(reader.next().unwrap().unwrap_err().line, 2);
    assert!(reader.next().is_none());
}

#[test]
fn fatal_errors_end_the_trace_even_when_skipping() {
    // An Azure trace must start with its header.
    let options = ReaderOptions { format: Some(TraceFormat::Azure), ..skip() };
    let (records, errors, _) = run(b"2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:47.6805900,374,44\n", options);
    assert!(records.is_empty());
    check(&errors, &[(1, None, "bad header: an Azure trace starts with the header `TIMESTAMP,ContextTokens,GeneratedTokens`")]);

    // A first line whose format cannot be told.
    let (records, errors, _) = run(b"\n{\"when\": 1}\n{\"t_ms\": 0, \"prompt_tokens\": 1}\n", skip());
    assert!(records.is_empty());
    check(&errors, &[(2, None, "cannot tell the trace format")]);

    // A failed read: the line it was reading.
    struct Broken(usize);
    impl Read for Broken {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            let line = b"{\"t_ms\": 0, \"prompt_tokens\": 1}\n";
            if self.0 == 0 {
                return Err(io::Error::other("disk on fire"));
            }
            self.0 -= 1;
            out[..line.len()].copy_from_slice(line);
            Ok(line.len())
        }
    }
    let mut reader = TraceReader::new(BufReader::with_capacity(64, Broken(2)), skip());
    assert_eq!(reader.by_ref().take(2).filter(Result::is_ok).count(), 2);
    let e: TraceError = reader.next().unwrap().unwrap_err();
    assert!(e.is_fatal());
    assert_eq!(e.to_string(), "line 3: read failed: disk on fire");
    assert!(reader.next().is_none());
}
