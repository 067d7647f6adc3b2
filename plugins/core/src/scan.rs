//! A strict, borrowing JSON scanner for the per-event hot path: it walks one event's JSON once,
//! validating as it goes, and hands out the raw text of the members a caller asks for — no
//! allocation, no tree. It accepts a subset of JSON: anything it is not sure of (a surrogate escape,
//! an escaped key, nesting deeper than [`MAX_DEPTH`]) makes it give up (`None`), and the caller then
//! takes the general `serde_json::Value` path. So whatever it accepts, serde_json accepts too and
//! reads the same way; the tests and the fuzz targets hold it to that.

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

    pub(crate) fn is_empty(&self) -> bool {
        self.inner.is_empty()
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

/// Characters of valid UTF-8: the bytes that start one.
fn utf8_chars(bytes: &[u8]) -> u64 {
    bytes.iter().filter(|&&b| b & 0xC0 != 0x80).count() as u64
}

/// A cursor over one JSON text.
pub(crate) struct Scanner<'a> {
    s: &'a [u8],
    i: usize,
    depth: u32,
}

impl<'a> Scanner<'a> {
    pub(crate) fn new(s: &'a [u8]) -> Self {
        Self { s, i: 0, depth: 0 }
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
        // The text came from a `&str`, or is checked here when it did not.
        if !escaped && std::str::from_utf8(inner).is_err() {
            return None;
        }
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

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`
    fn number(&mut self) -> Option<()> {
        if self.peek() == Some(b'-') {
            self.i = self.i.saturating_add(1);
        }
        match self.peek()? {
            b'0' => self.i = self.i.saturating_add(1),
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.i = self.i.saturating_add(1);
            self.digits1()?;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.i = self.i.saturating_add(1);
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.i = self.i.saturating_add(1);
            }
            self.digits1()?;
        }
        Some(())
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

    fn skips(text: &str) -> bool {
        let mut sc = Scanner::new(text.as_bytes());
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
        ];
        for text in cases {
            if skips(text) {
                assert!(serde_json::from_str::<serde_json::Value>(text).is_ok(), "the scanner accepts {text:?}, serde_json does not");
            }
        }
        for ok in ["0", "-12e+3", "{\"a\":[{\"b\":null}]}", "\"a\\u00e9\"", " [ 1 , \"x\" ] "] {
            assert!(skips(ok), "{ok}");
        }
        for refused in ["01", "1.", "[1,]", "{\"a\":1,}", "\"\\x\"", "\"tab\there\"", "\"\\u+123\""] {
            assert!(!skips(refused), "{refused}");
        }
    }

    #[test]
    fn characters_of_escaped_and_plain_strings() {
        for text in ["\"héllo\"", "\"a\\nb\\u00e9\\\"\"", "\"\"", "\"😊 x\""] {
            let mut sc = Scanner::new(text.as_bytes());
            let raw = sc.string().expect("a string");
            let decoded: String = serde_json::from_str(text).expect("valid");
            assert_eq!(raw.chars(), decoded.chars().count() as u64, "{text}");
            assert_eq!(raw.text(), decoded, "{text}");
        }
    }
}
