//! Small helpers for reading untrusted JSON without panicking or allocating needlessly.

use serde_json::Value;

/// `v[key]` as a string, if it is one.
pub(crate) fn str_at<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

/// `v[key]` as a non-empty string.
pub(crate) fn nonempty_str_at<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    str_at(v, key).filter(|s| !s.is_empty())
}

/// `v[key]` as an unsigned integer; negative or fractional values are treated as absent.
pub(crate) fn u64_at(v: &Value, key: &str) -> Option<u64> {
    v.get(key).and_then(Value::as_u64)
}

/// `v[outer][inner]` as an unsigned integer (e.g. `prompt_tokens_details.cached_tokens`).
pub(crate) fn u64_at2(v: &Value, outer: &str, inner: &str) -> Option<u64> {
    v.get(outer).and_then(|o| u64_at(o, inner))
}

/// Number of Unicode scalar values in `s`.
pub(crate) fn chars(s: &str) -> u64 {
    s.chars().count() as u64
}

/// Characters of `v` serialised as compact JSON, counted without building the string.
pub(crate) fn json_chars(v: &Value) -> u64 {
    struct CharCounter(u64);
    impl std::io::Write for CharCounter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            // serde_json writes valid UTF-8; count the bytes that start a character.
            let starts = buf.iter().filter(|&&b| (b & 0xC0) != 0x80).count() as u64;
            self.0 = self.0.saturating_add(starts);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut counter = CharCounter(0);
    match serde_json::to_writer(&mut counter, v) {
        Ok(()) => counter.0,
        Err(_) => 0,
    }
}

/// Tokens estimated from characters: ⌈chars / 4⌉ (≈ 4 characters per token for English BPE vocabularies).
pub(crate) fn tokens_from_chars(chars: u64) -> u64 {
    chars.div_ceil(4)
}

/// Longest prefix of `s` no longer than `max` bytes that ends on a character boundary.
pub(crate) fn truncate_utf8(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while end > 0 && !s.is_char_boundary(end) {
        end -= 1;
    }
    s.get(..end).unwrap_or_default().to_owned()
}

/// Message of an error object in any of the shapes LLM APIs use:
/// `{"error":{"message":…,"type":…}}`, `{"error":"…"}`, `{"type":"error","message":…,"code":…}` and
/// Anthropic's `{"type":"error","error":{"type":…,"message":…}}`. Prefers the message, then type/code.
pub(crate) fn error_message(v: &Value) -> Option<&str> {
    match v.get("error") {
        Some(Value::String(s)) if !s.is_empty() => return Some(s),
        Some(e @ Value::Object(_)) => {
            return nonempty_str_at(e, "message").or_else(|| nonempty_str_at(e, "type")).or_else(|| nonempty_str_at(e, "code")).or(Some("error"));
        }
        _ => {}
    }
    if str_at(v, "type") == Some("error") {
        return nonempty_str_at(v, "message").or_else(|| nonempty_str_at(v, "code")).or(Some("error"));
    }
    None
}

/// Deserializes a configuration document. On failure the message starts with the path of the
/// offending member (`versions[0].breaker: unknown field ...`), which serde alone does not give.
pub fn parse_config<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        if path.is_empty() || path == "." {
            e.inner().to_string()
        } else {
            format!("{path}: {}", e.inner())
        }
    })?;
    // Trailing characters after the document are an error too.
    de.end().map_err(|e| e.to_string())?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn truncate_respects_char_boundaries() {
        assert_eq!(truncate_utf8("héllo", 2), "h");
        assert_eq!(truncate_utf8("héllo", 3), "hé");
        assert_eq!(truncate_utf8("abc", 10), "abc");
    }

    #[test]
    fn json_chars_counts_characters_not_bytes() {
        assert_eq!(json_chars(&json!("é")), 3);
        assert_eq!(json_chars(&json!({"a":1})), 7);
    }

    #[test]
    fn error_shapes() {
        assert_eq!(error_message(&json!({"error":{"message":"m","type":"t"}})), Some("m"));
        assert_eq!(error_message(&json!({"error":{"type":"t"}})), Some("t"));
        assert_eq!(error_message(&json!({"error":"boom"})), Some("boom"));
        assert_eq!(error_message(&json!({"error":null})), None);
        assert_eq!(error_message(&json!({"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}})), Some("Overloaded"));
        assert_eq!(error_message(&json!({"type":"error","code":"rate_limit","message":""})), Some("rate_limit"));
    }
}
