//! Reading one line at a time into a buffer that never grows past a cap.

use std::io::{self, BufRead};

/// What [`read_line_capped`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Fill {
    /// End of input: no byte was read.
    Eof,
    /// A line (without its `\n` and a `\r` before it) is in the buffer.
    Line,
    /// The line had `bytes` bytes (without its `\n`), more than the cap: it was read to its end and
    /// thrown away, and the buffer is empty.
    TooLong { bytes: u64 },
}

/// Reads the next line into `buf` (cleared first). The buffer's capacity never exceeds `max`: a
/// longer line is consumed up to its newline without being kept. A last line without a newline is
/// a line.
pub(crate) fn read_line_capped<R: BufRead>(src: &mut R, buf: &mut Vec<u8>, max: usize) -> io::Result<Fill> {
    buf.clear();
    let mut total: u64 = 0;
    let mut any = false;
    let mut too_long = false;
    loop {
        let (used, done) = {
            let available = match src.fill_buf() {
                Ok(bytes) => bytes,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if available.is_empty() {
                break;
            }
            any = true;
            let (chunk, used, done) = match available.iter().position(|&b| b == b'\n') {
                Some(i) => (available.get(..i).unwrap_or(available), i + 1, true),
                None => (available, available.len(), false),
            };
            total += chunk.len() as u64;
            if !too_long {
                let needed = buf.len() + chunk.len();
                if needed > max {
                    too_long = true;
                    buf.clear();
                } else {
                    if needed > buf.capacity() {
                        // Grow geometrically, but never past the cap.
                        let target = needed.max(buf.capacity().saturating_mul(2)).min(max);
                        buf.reserve_exact(target - buf.len());
                    }
                    buf.extend_from_slice(chunk);
                }
            }
            (used, done)
        };
        src.consume(used);
        if done {
            break;
        }
    }
    if !any {
        return Ok(Fill::Eof);
    }
    if too_long {
        return Ok(Fill::TooLong { bytes: total });
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    Ok(Fill::Line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufReader;

    #[test]
    fn lines_crlf_last_line_and_cap() {
        let text = b"ab\r\ncdef\n\nlast";
        let mut src = BufReader::with_capacity(3, &text[..]);
        let mut buf = Vec::new();
        let mut got = Vec::new();
        loop {
            match read_line_capped(&mut src, &mut buf, 3) {
                Ok(Fill::Eof) => break,
                Ok(Fill::Line) => got.push(String::from_utf8(buf.clone()).unwrap_or_default()),
                Ok(Fill::TooLong { bytes }) => got.push(format!("<{bytes}>")),
                Err(e) => got.push(format!("{e}")),
            }
            assert!(buf.capacity() <= 3, "capacity {}", buf.capacity());
        }
        // "ab\r" is 3 bytes before the newline: within the cap; "cdef" and "last" are not.
        assert_eq!(got, vec!["ab", "<4>", "", "<4>"]);
    }
}
