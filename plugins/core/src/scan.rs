//! A strict, borrowing JSON scanner for the per-event hot path: it walks one event's JSON once,
//! validating as it goes, and hands out the raw text of the members a caller asks for — no
//! allocation, no tree. It accepts a subset of JSON: anything it is not sure of (a surrogate escape,
//! an escaped key, nesting deeper than [`MAX_DEPTH`]) makes it give up (`None`), and the caller then
//! takes the general `serde_json::Value` path. So whatever it accepts, serde_json accepts too and
//! reads the same way; the tests and the fuzz targets hold it to that.

use crate::sse::bytes_equal;

/// Deeper nesting is left to serde_json (whose own limit is 128).
pub(crate) const MAX_DEPTH: u32 = 32;

/// A JSON string as it appears in the text, quotes excluded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawStr<'a> {
    inner: &'a [u8],
    escaped: bool,
}

impl<'a> RawStr<'a> {
    /// Unicode scalar values of the unescaped string (an escape is one character: surrogate
    /// escapes never get here).
    pub(crate) fn chars(&self) -> u64 {
        if !self.escaped {
            return utf8_chars(self.inner);
        }
        let mut n = 0u64;
        let mut i = 0usize;
        while let Some(&b) = self.inner.get(i) {
            if b == b'\\' {
                i = i.saturating_add(if self.inner.get(i.saturating_add(1)) == Some(&b'u') { 6 } else { 2 });
                n = n.saturating_add(1);
            } else {
                if b & 0xC0 != 0x80 {
                    n = n.saturating_add(1);
                }
                i = i.saturating_add(1);
            }
        }
        n
    }

    /// Hands the string to the repetition measure, decoding escapes only if it has any.
    pub(crate) fn feed(&self, repetition: &mut crate::quality::Repetition) {
        if self.escaped {
            repetition.push_json_escaped(self.inner);
        } else {
            repetition.push_bytes(self.inner);
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.inner.is_empty()
    }

    /// The string's bytes as written (escapes undecoded, quotes excluded).
    pub(crate) fn raw(&self) -> &'a [u8] {
        self.inner
    }

    /// Where the string's first byte (after its opening quote) is in `outer`, the text it was
    /// scanned from; `None` for a string from another text.
    pub(crate) fn offset_in(&self, outer: &[u8]) -> Option<usize> {
        let at = (self.inner.as_ptr() as usize).checked_sub(outer.as_ptr() as usize)?;
        (at.checked_add(self.inner.len())? <= outer.len()).then_some(at)
    }

    /// The string, unescaped when it has to be (the borrowed text otherwise).
    pub(crate) fn text(&self) -> std::borrow::Cow<'a, str> {
        if !self.escaped {
            return String::from_utf8_lossy(self.inner);
        }
        let mut quoted = Vec::with_capacity(self.inner.len().saturating_add(2));
        quoted.push(b'"');
        quoted.extend_from_slice(self.inner);
        quoted.push(b'"');
        std::borrow::Cow::Owned(serde_json::from_slice::<String>(&quoted).unwrap_or_default())
    }

    /// The key equals `want` (an escaped key never gets here: the scanner gives up on one).
    pub(crate) fn is(&self, want: &str) -> bool {
        self.inner == want.as_bytes()
    }
}

/// Length of the leading run of bytes that need no look inside a string: not `"`, not `\\`, not a
/// control byte. Eight bytes per step (the string scan is the event parse's hot loop); the
/// byte-wise tricks flag false positives only above a real match within a word, so the lowest
/// flagged byte is exact.
fn plain_run(bytes: &[u8]) -> usize {
    const LO: u64 = 0x0101_0101_0101_0101;
    const HI: u64 = 0x8080_8080_8080_8080;
    let (words, tail) = bytes.as_chunks::<8>();
    for (i, word) in words.iter().enumerate() {
        let v = u64::from_le_bytes(*word);
        // A byte below 0x20 (the high-bit test keeps bytes ≥ 0x80 out).
        let control = v.wrapping_sub(LO * 0x20) & !v & HI;
        let found = bytes_equal(v, b'"') | bytes_equal(v, b'\\') | control;
        if found != 0 {
            return i.saturating_mul(8).saturating_add((found.trailing_zeros() / 8) as usize);
        }
    }
    let offset = bytes.len().saturating_sub(tail.len());
    offset.saturating_add(tail.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20).unwrap_or(tail.len()))
}

/// Characters of valid UTF-8: the bytes that start one, i.e. all but the continuation bytes
/// (`10xxxxxx`), counted eight at a time (a byte-wise count was a fifth of reading a text).
fn utf8_chars(bytes: &[u8]) -> u64 {
    const HI: u64 = 0x8080_8080_8080_8080;
    let (words, tail) = bytes.as_chunks::<8>();
    let mut continuation = 0u64;
    for word in words {
        let v = u64::from_le_bytes(*word);
        // Bit 7 of each byte set, bit 6 (moved up to 7) clear.
        continuation = continuation.saturating_add(u64::from((v & !(v << 1) & HI).count_ones()));
    }
    let tail = tail.iter().filter(|&&b| b & 0xC0 == 0x80).count() as u64;
    (bytes.len() as u64).saturating_sub(continuation).saturating_sub(tail)
}

/// A cursor over one JSON text.
pub(crate) struct Scanner<'a> {
    s: &'a [u8],
    i: usize,
    depth: u32,
}

impl<'a> Scanner<'a> {
    /// A scanner over `text`: valid UTF-8 already, so strings need no second check.
    pub(crate) fn new(text: &'a str) -> Self {
        Self { s: text.as_bytes(), i: 0, depth: 0 }
    }

    /// A scanner over `text` positioned at byte `at` (a value's start).
    pub(crate) fn at(text: &'a str, at: usize) -> Self {
        Self { s: text.as_bytes(), i: at, depth: 0 }
    }

    /// The byte after what was consumed.
    pub(crate) fn position(&self) -> usize {
        self.i
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i = self.i.saturating_add(1);
        }
    }

    fn eat(&mut self, b: u8) -> Option<()> {
        self.ws();
        (self.peek()? == b).then(|| self.i = self.i.saturating_add(1))
    }

    /// Only whitespace is left.
    pub(crate) fn at_end(&mut self) -> bool {
        self.ws();
        self.i >= self.s.len()
    }

    /// The next value is `null` (consumed if so).
    pub(crate) fn null(&mut self) -> bool {
        self.ws();
        if self.s.get(self.i..self.i.saturating_add(4)) == Some(b"null") && !self.s.get(self.i.saturating_add(4)).is_some_and(u8::is_ascii_alphanumeric) {
            self.i = self.i.saturating_add(4);
            return true;
        }
        false
    }

    /// A string value.
    pub(crate) fn string(&mut self) -> Option<RawStr<'a>> {
        self.ws();
        if self.peek()? != b'"' {
            return None;
        }
        let start = self.i.saturating_add(1);
        let mut j = start;
        let mut escaped = false;
        loop {
            j = j.saturating_add(plain_run(self.s.get(j..)?));
            let b = *self.s.get(j)?;
            match b {
                b'"' => break,
                b'\\' => {
                    escaped = true;
                    match *self.s.get(j.saturating_add(1))? {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => j = j.saturating_add(2),
                        b'u' => {
                            let hex = self.s.get(j.saturating_add(2)..j.saturating_add(6))?;
                            let text = std::str::from_utf8(hex).ok()?;
                            let code = u16::from_str_radix(text, 16).ok()?;
                            // `from_str_radix` takes a sign; JSON does not.
                            if !hex.iter().all(u8::is_ascii_hexdigit) || (0xD800..=0xDFFF).contains(&code) {
                                return None;
                            }
                            j = j.saturating_add(6);
                        }
                        _ => return None,
                    }
                }
                0..=0x1F => return None,
                _ => j = j.saturating_add(1),
            }
        }
        let inner = self.s.get(start..j)?;
        self.i = j.saturating_add(1);
        Some(RawStr { inner, escaped })
    }

    /// A string or `null` (`Ok(None)`); anything else is `Err` (not the shape asked for).
    pub(crate) fn opt_string(&mut self) -> Result<Option<RawStr<'a>>, ()> {
        if self.null() {
            return Ok(None);
        }
        self.string().map(Some).ok_or(())
    }

    /// Walks an object: `member` is called with each key, positioned at its value, and must consume
    /// the value. `None` if the text is not an object or `member` gives up.
    pub(crate) fn object(&mut self, mut member: impl FnMut(&mut Self, RawStr<'a>) -> Option<()>) -> Option<()> {
        self.eat(b'{')?;
        self.enter()?;
        self.ws();
        if self.peek()? == b'}' {
            self.i = self.i.saturating_add(1);
            self.depth = self.depth.saturating_sub(1);
            return Some(());
        }
        loop {
            let key = self.string()?;
            if key.escaped {
                return None;
            }
            self.eat(b':')?;
            member(self, key)?;
            self.ws();
            match self.peek()? {
                b',' => self.i = self.i.saturating_add(1),
                b'}' => {
                    self.i = self.i.saturating_add(1);
                    self.depth = self.depth.saturating_sub(1);
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// Walks an array: `element` is called positioned at each element and must consume it.
    pub(crate) fn array(&mut self, mut element: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.eat(b'[')?;
        self.enter()?;
        self.ws();
        if self.peek()? == b']' {
            self.i = self.i.saturating_add(1);
            self.depth = self.depth.saturating_sub(1);
            return Some(());
        }
        loop {
            element(self)?;
            self.ws();
            match self.peek()? {
                b',' => self.i = self.i.saturating_add(1),
                b']' => {
                    self.i = self.i.saturating_add(1);
                    self.depth = self.depth.saturating_sub(1);
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    fn enter(&mut self) -> Option<()> {
        self.depth = self.depth.saturating_add(1);
        (self.depth <= MAX_DEPTH).then_some(())
    }

    /// Skips any value, validating it; returns its text.
    pub(crate) fn value(&mut self) -> Option<&'a [u8]> {
        self.ws();
        let start = self.i;
        match self.peek()? {
            b'"' => {
                self.string()?;
            }
            b'{' => self.object(|sc, _| sc.value().map(|_| ()))?,
            b'[' => self.array(|sc| sc.value().map(|_| ()))?,
            b't' => self.literal(b"true")?,
            b'f' => self.literal(b"false")?,
            b'n' => self.literal(b"null")?,
            _ => self.number()?,
        }
        self.s.get(start..self.i)
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.i.saturating_add(word.len());
        (self.s.get(self.i..end)? == word).then(|| self.i = end)
    }

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`, below 10^308 in magnitude: serde_json
    /// refuses a number that rounds past `f64::MAX` (`1e400`, a 309-digit integer), so this scanner
    /// gives up on any number that might (an order of magnitude of 308 or more, read from the
    /// digits and the exponent), and the tree decides.
    fn number(&mut self) -> Option<()> {
        if self.peek() == Some(b'-') {
            self.i = self.i.saturating_add(1);
        }
        let integer = self.i;
        match self.peek()? {
            b'0' => self.i = self.i.saturating_add(1),
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        let integer_digits = i64::try_from(self.i.saturating_sub(integer)).unwrap_or(i64::MAX);
        if self.peek() == Some(b'.') {
            self.i = self.i.saturating_add(1);
            self.digits1()?;
        }
        let mut exponent = 0i64;
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.i = self.i.saturating_add(1);
            let negative = self.peek() == Some(b'-');
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.i = self.i.saturating_add(1);
            }
            let digits = self.i;
            self.digits1()?;
            let magnitude = self.s.get(digits..self.i)?.iter().fold(0i64, |n, &d| n.saturating_mul(10).saturating_add(i64::from(d - b'0')));
            exponent = if negative { -magnitude } else { magnitude };
        }
        // At most 10^(integer digits - 1 + exponent), leading zeros of a fraction aside.
        (integer_digits.saturating_sub(1).saturating_add(exponent) < 308).then_some(())
    }

    fn digits(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_digit()) {
            self.i = self.i.saturating_add(1);
        }
    }

    fn digits1(&mut self) -> Option<()> {
        let start = self.i;
        self.digits();
        (self.i > start).then_some(())
    }
}

/// Marks a member as seen; `None` on a repeat (serde's derive refuses duplicate fields, and which
/// copy counts is the general path's business).
pub(crate) fn first_time(seen: &mut u32, bit: u32) -> Option<()> {
    if *seen & bit != 0 {
        return None;
    }
    *seen |= bit;
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Counted eight bytes at a time, the same as `str::chars` at every length and offset.
        #[test]
        fn utf8_chars_counts_what_chars_counts(text in "\\PC{0,40}", skip in 0usize..8) {
            let start = text.char_indices().nth(skip).map_or(text.len(), |(i, _)| i);
            let text = &text[start..];
            prop_assert_eq!(utf8_chars(text.as_bytes()), text.chars().count() as u64);
        }
    }

    fn skips(text: &str) -> bool {
        let mut sc = Scanner::new(text);
        sc.value().is_some() && sc.at_end()
    }

    #[test]
    fn accepts_only_json_that_serde_json_accepts() {
        let cases = [
            "0",
            "-0",
            "1.5",
            "-12e+3",
            "1E5",
            "01",
            "1.",
            ".5",
            "-",
            "+1",
            "1e",
            "true",
            "tru",
            "nul",
            "nullx",
            "\"a\\u00e9\"",
            "\"\\ud83d\\ude00\"",
            "\"\\x\"",
            "\"tab\there\"",
            "[1,2]",
            "[1,]",
            "[,]",
            "{}",
            "{\"a\":1,}",
            "{\"a\" 1}",
            "{\"a\":[{\"b\":null}]}",
            "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]",
            "\"\\u12G4\"",
            "\"\\u+123\"",
            " [ 1 , \"x\" ] ",
            // Out of f64's range: serde_json refuses them.
            "1e400",
            "-1e309",
            "{\"a\":1.7976931348623159e308}",
            "[1e-400, 1.7976931348623157e308]",
            "[1e-400, 9.99e307, 0.5e307]",
        ];
        let long_integer = "9".repeat(309);
        let cases = cases.iter().copied().chain([long_integer.as_str(), &long_integer[1..]]);
        for text in cases {
            if skips(text) {
                assert!(serde_json::from_str::<serde_json::Value>(text).is_ok(), "the scanner accepts {text:?}, serde_json does not");
            }
        }
        for ok in ["0", "-12e+3", "{\"a\":[{\"b\":null}]}", "\"a\\u00e9\"", " [ 1 , \"x\" ] ", "[1e-400, 9.99e307, 0.5e307]", &long_integer[1..]] {
            assert!(skips(ok), "{ok}");
        }
        for refused in ["01", "1.", "[1,]", "{\"a\":1,}", "\"\\x\"", "\"tab\there\"", "\"\\u+123\"", "1e400", "-1e309", "1e308", &long_integer] {
            assert!(!skips(refused), "{refused}");
        }
    }

    #[test]
    fn the_plain_run_stops_at_the_first_quote_backslash_or_control_byte() {
        let mut seed = 0x9E37_79B9_u32;
        for len in 0..40 {
            for _ in 0..300 {
                let bytes: Vec<u8> = (0..len)
                    .map(|_| {
                        seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
                        // Mostly plain bytes, some of each stop byte and some high bytes.
                        match (seed >> 16) % 12 {
                            0 => b'"',
                            1 => b'\\',
                            2 => (seed >> 8) as u8 % 0x20,
                            3 => 0x80 | (seed >> 8) as u8,
                            _ => b'a' + (seed >> 8) as u8 % 26,
                        }
                    })
                    .collect();
                let naive = bytes.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20).unwrap_or(bytes.len());
                assert_eq!(plain_run(&bytes), naive, "{bytes:?}");
            }
        }
    }

    #[test]
    fn characters_of_escaped_and_plain_strings() {
        for text in ["\"héllo\"", "\"a\\nb\\u00e9\\\"\"", "\"\"", "\"😊 x\""] {
            let mut sc = Scanner::new(text);
            let raw = sc.string().expect("a string");
            let decoded: String = serde_json::from_str(text).expect("valid");
            assert_eq!(raw.chars(), decoded.chars().count() as u64, "{text}");
            assert_eq!(raw.text(), decoded, "{text}");
        }
    }
}
