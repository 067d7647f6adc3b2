//! Small helpers for reading untrusted JSON without panicking or allocating needlessly.

use serde::de::{self, DeserializeSeed, Deserializer, EnumAccess, Unexpected, VariantAccess, Visitor};
use serde_json::Value;
use std::fmt;

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

/// The texts of the top-level members named `keys` of the JSON object `text` (the last of a
/// repeated key, as a tree keeps it; `None` for an absent one), once the whole of `text` is
/// checked to be that one object: one pass, nothing built. `None` when `text` is not an object or
/// the scanner is not sure of it (an escaped key, a surrogate escape, deep nesting, a number near
/// `f64`'s range): the caller then asks serde_json, which reads what this reads wherever this
/// answers. For readers of sluice's own stamps (the simulator reads four a request).
#[cfg(feature = "object-members")]
pub fn object_members<'a, const N: usize>(text: &'a str, keys: [&str; N]) -> Option<[Option<&'a str>; N]> {
    let mut found: [Option<&'a str>; N] = [None; N];
    let mut scanner = crate::scan::Scanner::new(text);
    scanner.object(|sc, key| {
        let raw = sc.value()?;
        if let Some(slot) = keys.iter().position(|k| key.is(k)).and_then(|i| found.get_mut(i)) {
            let start = (raw.as_ptr() as usize).checked_sub(text.as_ptr() as usize)?;
            *slot = Some(text.get(start..start.checked_add(raw.len())?)?);
        }
        Some(())
    })?;
    scanner.at_end().then_some(found)
}

/// Deserializes a configuration document. On failure the message starts with the path of the
/// offending member (`versions[0].breaker: unknown field ...`), which serde alone does not give.
pub fn parse_config<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    parse_config_at(bytes).map_err(|e| e.to_string())
}

/// A configuration document that did not deserialize: serde_json's error and the path of the
/// member it is about (empty for the document itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigJsonError {
    /// `versions[0].breaker.p95_ttft_ms`; empty for the document itself, and for a text that is
    /// not JSON (its message gives the line and column).
    pub path: String,
    /// serde_json's message, with its line and column.
    pub message: String,
}

impl std::fmt::Display for ConfigJsonError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// [`parse_config`], with the path apart from the message.
///
/// The path is found after the fact, from the error's line and column: the text is walked up to
/// that point, and the members and elements open there are the path. A deserializer that tracks
/// the path as it goes (`serde_path_to_error`, used before) wraps every configuration type's
/// deserialization in its own: 90 KB of `sluice.wasm` (7 %) and 88 KiB of the playground's page. The
/// paths are the ones it gave, held to that by `tests/config_paths.rs` over every shipped policy
/// broken in every place.
pub fn parse_config_at<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ConfigJsonError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = T::deserialize(&mut de).map_err(|e| {
        let message = e.to_string();
        ConfigJsonError { path: error_path(bytes, &e, &message), message }
    })?;
    // Trailing characters after the document are an error too, of the document.
    de.end().map_err(|e| ConfigJsonError { path: String::new(), message: e.to_string() })?;
    Ok(value)
}

/// Where `text` stands at serde_json's error `e` (whose text is `message`): the keys and indexes
/// open there.
fn error_path(text: &[u8], e: &serde_json::Error, message: &str) -> String {
    if e.line() == 0 {
        return String::new();
    }
    // A broken text is located by the line and column alone: where it broke, the member being
    // read is not known yet (a key not read, a value not begun).
    if e.classify() != serde_json::error::Category::Data {
        return String::new();
    }
    let offset = byte_offset(text, e.line(), e.column());
    let frames = PathWalk::up_to(text, offset);
    // A repeated field is refused by its object once the key is read: the key is not the path. A
    // name that is not one of an enum's variants is the enum's own error, where the key was the
    // variant's name. (serde's derive words both; tests/config_paths.rs sees a change.)
    let duplicate = message.starts_with("duplicate field");
    let not_a_variant = message.starts_with("unknown variant");
    // A value of the wrong type is refused as it starts: an element begun but not entered.
    let element_begins = text.get(offset..).and_then(|rest| rest.iter().find(|b| !b.is_ascii_whitespace())).is_some_and(|&b| b != b']');
    let mut path = String::new();
    let last = frames.len().saturating_sub(1);
    for (i, frame) in frames.iter().enumerate() {
        let innermost = i == last;
        let segment = match frame {
            Frame::Object { key, phase } => match (phase, innermost) {
                (ObjectPhase::Key, _) => None,
                (ObjectPhase::Value, true) if duplicate || not_a_variant => None,
                (ObjectPhase::AfterValue, true) if duplicate => None,
                _ => key.clone(),
            },
            Frame::Array { index, phase } => match (phase, innermost) {
                (ArrayPhase::Element, true) if element_begins => Some(format!("[{index}]")),
                (ArrayPhase::Element, _) => None,
                _ => Some(format!("[{index}]")),
            },
        };
        if let Some(segment) = segment {
            if !path.is_empty() && !segment.starts_with('[') {
                path.push('.');
            }
            path.push_str(&segment);
        }
    }
    path
}

/// The byte offset of serde_json's 1-based line and its column (bytes into the line).
fn byte_offset(text: &[u8], line: usize, column: usize) -> usize {
    let mut line_start = 0usize;
    let mut lines = 1usize;
    for (i, &b) in text.iter().enumerate() {
        if lines == line {
            break;
        }
        if b == b'\n' {
            lines = lines.saturating_add(1);
            line_start = i.saturating_add(1);
        }
    }
    line_start.saturating_add(column).min(text.len())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ObjectPhase {
    /// Before a key (after `{` or a comma).
    Key,
    /// The key read, its value not finished.
    Value,
    /// The value finished, before a comma or `}`.
    AfterValue,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ArrayPhase {
    /// Before an element (after `[` or a comma).
    Element,
    /// Inside an element.
    InElement,
    /// The element finished, before a comma or `]`.
    AfterElement,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Frame {
    Object { key: Option<String>, phase: ObjectPhase },
    Array { index: usize, phase: ArrayPhase },
}

/// The containers open at a point of a JSON text, found by a lenient walk: only what comes before
/// the point is read, and it may be broken there.
struct PathWalk<'a> {
    s: &'a [u8],
    i: usize,
    frames: Vec<Frame>,
}

impl<'a> PathWalk<'a> {
    fn up_to(text: &'a [u8], offset: usize) -> Vec<Frame> {
        let mut walk = PathWalk { s: text.get(..offset).unwrap_or(text), i: 0, frames: Vec::new() };
        walk.run();
        walk.frames
    }

    fn run(&mut self) {
        while let Some(&b) = self.s.get(self.i) {
            match b {
                b' ' | b'\t' | b'\n' | b'\r' => self.i = self.i.saturating_add(1),
                b'{' => {
                    self.start_value();
                    self.frames.push(Frame::Object { key: None, phase: ObjectPhase::Key });
                    self.i = self.i.saturating_add(1);
                }
                b'[' => {
                    self.start_value();
                    self.frames.push(Frame::Array { index: 0, phase: ArrayPhase::Element });
                    self.i = self.i.saturating_add(1);
                }
                b'}' | b']' => {
                    self.frames.pop();
                    self.end_value();
                    self.i = self.i.saturating_add(1);
                }
                b',' => {
                    match self.frames.last_mut() {
                        Some(Frame::Object { key, phase }) => {
                            *key = None;
                            *phase = ObjectPhase::Key;
                        }
                        Some(Frame::Array { index, phase }) => {
                            *index = index.saturating_add(1);
                            *phase = ArrayPhase::Element;
                        }
                        None => {}
                    }
                    self.i = self.i.saturating_add(1);
                }
                b':' => self.i = self.i.saturating_add(1),
                b'"' => {
                    let start = self.i;
                    let (end, closed) = self.string_end(start);
                    let is_key = matches!(self.frames.last(), Some(Frame::Object { phase: ObjectPhase::Key, .. }));
                    if is_key {
                        let raw = self.s.get(start..end).unwrap_or_default();
                        // A key cut off by the point is still the key being read.
                        let name = serde_json::from_slice::<String>(raw)
                            .unwrap_or_else(|_| String::from_utf8_lossy(raw.get(1..).unwrap_or_default()).trim_end_matches('"').to_string());
                        if let Some(Frame::Object { key, phase }) = self.frames.last_mut() {
                            *key = Some(name);
                            *phase = ObjectPhase::Value;
                        }
                    } else {
                        self.start_value();
                        if closed {
                            self.end_value();
                        }
                    }
                    self.i = end.max(self.i.saturating_add(1));
                }
                _ => {
                    // A number or a literal: its bytes up to a delimiter.
                    let start = self.i;
                    while self.s.get(self.i).is_some_and(|b| !matches!(b, b',' | b'}' | b']' | b':' | b'"' | b'{' | b'[' | b' ' | b'\t' | b'\n' | b'\r')) {
                        self.i = self.i.saturating_add(1);
                    }
                    self.start_value();
                    // Finished only if something follows it before the point.
                    if self.i < self.s.len() || self.i == start {
                        self.end_value();
                    }
                    if self.i == start {
                        self.i = self.i.saturating_add(1);
                    }
                }
            }
        }
    }

    /// Index just past the string starting at `start` (a quote), and whether its closing quote
    /// comes before the end of the text.
    fn string_end(&self, start: usize) -> (usize, bool) {
        let mut j = start.saturating_add(1);
        while let Some(&b) = self.s.get(j) {
            match b {
                b'\\' => j = j.saturating_add(2),
                b'"' => return (j.saturating_add(1), true),
                _ => j = j.saturating_add(1),
            }
        }
        (self.s.len(), false)
    }

    /// A value begins in the innermost container.
    fn start_value(&mut self) {
        if let Some(Frame::Array { phase, .. }) = self.frames.last_mut() {
            *phase = ArrayPhase::InElement;
        }
    }

    /// The innermost container's current value is finished.
    fn end_value(&mut self) {
        match self.frames.last_mut() {
            Some(Frame::Object { phase, .. }) if *phase == ObjectPhase::Value => *phase = ObjectPhase::AfterValue,
            Some(Frame::Array { phase, .. }) => *phase = ArrayPhase::AfterElement,
            Some(Frame::Object { .. }) | None => {}
        }
    }
}

/// A unit-only enum's variant as serde's derive reads it: its name, or serde_json's externally
/// tagged form `{"name": null}`; the index of the name in `variants`. The configuration's unit
/// enums share this one deserializer (each derive was its own, with its own reader of the tag:
/// ≈ 1 KB of the playground's page each), with the derive's words (tests/unit_enums.rs).
pub(crate) fn unit_variant<'de, D: Deserializer<'de>>(d: D, name: &'static str, variants: &'static [&'static str]) -> Result<usize, D::Error> {
    d.deserialize_enum(name, variants, UnitEnum { name, variants })
}

/// `impl Deserialize` of a unit-only enum through [`unit_variant`]: `Type { Variant = "name", … }`,
/// the names in the order of the variants (the order serde's refusals list them in).
macro_rules! unit_enum_deserialize {
    ($ty:ident { $($variant:ident = $name:literal),+ $(,)? }) => {
        impl<'de> serde::Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                const ALL: &[$ty] = &[$($ty::$variant),+];
                let i = $crate::json::unit_variant(d, stringify!($ty), &[$($name),+])?;
                // An index of the names, which are as many as ALL.
                ALL.get(i).copied().ok_or_else(|| <D::Error as serde::de::Error>::custom(concat!("no variant of ", stringify!($ty))))
            }
        }
    };
}
pub(crate) use unit_enum_deserialize;

struct UnitEnum {
    name: &'static str,
    variants: &'static [&'static str],
}

impl<'de> Visitor<'de> for UnitEnum {
    type Value = usize;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "enum {}", self.name)
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<usize, A::Error> {
        let (i, variant) = data.variant_seed(VariantName(self.variants))?;
        variant.unit_variant()?;
        Ok(i)
    }
}

/// The tag: a variant's name (or, from a deserializer that gives one, its index).
pub(crate) struct VariantName(pub(crate) &'static [&'static str]);

impl<'de> DeserializeSeed<'de> for VariantName {
    type Value = usize;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<usize, D::Error> {
        d.deserialize_identifier(self)
    }
}

impl<'de> Visitor<'de> for VariantName {
    type Value = usize;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("variant identifier")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<usize, E> {
        match usize::try_from(v) {
            Ok(i) if i < self.0.len() => Ok(i),
            _ => Err(E::invalid_value(Unexpected::Unsigned(v), &format!("variant index 0 <= i < {}", self.0.len()).as_str())),
        }
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<usize, E> {
        self.0.iter().position(|n| *n == v).ok_or_else(|| E::unknown_variant(v, self.0))
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<usize, E> {
        self.0.iter().position(|n| n.as_bytes() == v).ok_or_else(|| E::unknown_variant(&String::from_utf8_lossy(v), self.0))
    }
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

    /// Texts built from members that may repeat, with escapes, nested values, floats and a
    /// spacing: wherever `object_members` answers, serde_json takes the text as the same object
    /// and gives each wanted member the same value; where serde_json refuses the text,
    /// `object_members` does too.
    #[cfg(feature = "object-members")]
    mod object_members_agrees_with_the_tree {
        use super::super::object_members;
        use proptest::prelude::*;
        use serde_json::Value;

        fn member_value() -> impl Strategy<Value = String> {
            let leaf = prop_oneof![
                Just("null".to_string()),
                Just("true".to_string()),
                any::<i64>().prop_map(|n| n.to_string()),
                any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(|f| Value::from(f).to_string()),
                "[a-z\\\"\\u{e9} ]{0,6}".prop_map(|t| Value::from(t).to_string()),
                Just("\"\\u00e9\\n\"".to_string()),
                Just("1e400".to_string()),
                Just("\"\\ud83d\\ude00\"".to_string()),
                Just("01".to_string()),
                Just("\"open".to_string()),
            ];
            leaf.prop_recursive(3, 10, 3, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..3).prop_map(|v| format!("[{}]", v.join(","))),
                    prop::collection::vec(("[a-c]", inner), 0..3)
                        .prop_map(|m| format!("{{{}}}", m.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect::<Vec<_>>().join(","))),
                ]
            })
        }

        proptest! {
            #[test]
            fn members_and_refusals(members in prop::collection::vec(("a|b|c|d|\\u0061", member_value()), 0..6), space in any::<bool>(), tail in prop_oneof![Just(""), Just(" "), Just(" x"), Just("}")]) {
                let sep = if space { " , " } else { "," };
                let text = format!("{{{}}}{tail}", members.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect::<Vec<_>>().join(sep));
                let keys = ["a", "b", "c", "z"];
                let tree = serde_json::from_str::<Value>(&text);
                match object_members(&text, keys) {
                    Some(found) => {
                        let tree = tree.map_err(|e| TestCaseError::fail(format!("{text}: the scanner answered, serde refused: {e}")))?;
                        for (key, raw) in keys.iter().zip(found) {
                            let read = raw.map(|r| serde_json::from_str::<Value>(r).unwrap());
                            prop_assert_eq!(read.as_ref(), tree.get(key), "{} in {}", key, text);
                        }
                    }
                    // Declined: fine whatever serde says, but an escaped key, a surrogate, a huge
                    // number or bad JSON must be what made it decline.
                    None => prop_assert!(tree.is_err() || text.contains('\\') || text.contains("1e400"), "declined {}", text),
                }
            }
        }

        #[test]
        fn not_an_object_is_none() {
            for text in ["[1]", "\"a\"", "7", "null", "", "{\"a\":1", "{\"a\":1}{}"] {
                assert_eq!(object_members(text, ["a"]), None, "{text}");
            }
            assert_eq!(object_members(r#" {"a":1,"b":{"a":2},"a":[3]} "#, ["a", "b"]), Some([Some("[3]"), Some(r#"{"a":2}"#)]));
        }
    }
}
