//! Building names and keys on the hot paths. `format!` goes through `core::fmt` (a formatter, a
//! `dyn Write`, padding checks) and costs several times a plain copy in wasm; a metric name or a
//! counter key is only pieces of text and a number or two, so these join them directly.

/// The parts joined, sized once.
pub fn join(parts: &[&str]) -> String {
    let mut out = String::with_capacity(parts.iter().map(|p| p.len()).sum());
    for part in parts {
        out.push_str(part);
    }
    out
}

/// Appends the decimal digits of `n`.
pub fn push_u64(out: &mut String, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        // `n % 10` is a digit.
        if let Some(d) = digits.get_mut(at) {
            *d = b'0' + (n % 10) as u8;
        }
        n /= 10;
        if n == 0 || at == 0 {
            break;
        }
    }
    for &d in digits.get(at..).unwrap_or_default() {
        out.push(char::from(d));
    }
}

/// Appends the two lowercase hex digits of `b`.
pub fn push_hex_byte(out: &mut String, b: u8) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for nibble in [b >> 4, b & 0x0f] {
        out.push(char::from(HEX.get(usize::from(nibble)).copied().unwrap_or(b'0')));
    }
}

/// The decimal digits of `n`.
pub fn u64_text(n: u64) -> String {
    let mut out = String::with_capacity(20);
    push_u64(&mut out, n);
    out
}

/// A JSON string as serde_json writes it: `"` and `\` escaped, control characters as their short
/// escape or `\u00XX`, everything else (non-ASCII included) as is.
pub fn push_json_string(out: &mut String, value: &str) {
    out.push('"');
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                out.push_str("\\u00");
                push_hex_byte(out, u8::try_from(u32::from(c)).unwrap_or(0));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_as_display_writes_them() {
        for n in [0, 1, 9, 10, 99, 100, 12_345, u64::from(u32::MAX), u64::MAX - 1, u64::MAX] {
            assert_eq!(u64_text(n), n.to_string());
        }
        let mut s = String::from("w");
        push_u64(&mut s, 2026);
        assert_eq!(s, "w2026");
    }

    #[test]
    fn strings_are_escaped_as_serde_json_writes_them() {
        for text in ["plain", "quo\"te", "back\\slash", "\u{1}\u{1f}\n\r\t\u{8}\u{c}", "naïve ✓", ""] {
            let mut out = String::new();
            push_json_string(&mut out, text);
            assert_eq!(out, serde_json::to_string(text).unwrap());
        }
    }

    #[test]
    fn parts_are_joined_in_order() {
        assert_eq!(join(&["sluice.", "ttft_ms", ".model_version.v1"]), "sluice.ttft_ms.model_version.v1");
        assert_eq!(join(&[]), "");
    }
}
