//! One JSON object per line, deserialized into a typed struct with the failing field named.

use super::{Fault, Problem};
use serde::de::{self, Deserialize, Deserializer, Visitor};
use serde_json::error::Category;
use std::borrow::Cow;
use std::fmt;

/// serde_json appends ` at line L column C`; every line is its own document, so only the column
/// means something here.
pub(crate) fn bare_message(e: &serde_json::Error) -> String {
    let text = e.to_string();
    match text.rfind(" at line ") {
        Some(i) => text.get(..i).unwrap_or(&text).to_string(),
        None => text,
    }
}

/// The name of the field at `path` (serde_path_to_error's, `.` for the root), inside `stamp`.
pub(crate) fn field_name(stamp: Option<&'static str>, path: &str) -> Option<Cow<'static, str>> {
    match (stamp, path) {
        (None, "." | "") => None,
        (Some(stamp), "." | "") => Some(Cow::Borrowed(stamp)),
        (None, path) => Some(Cow::Owned(path.to_string())),
        (Some(stamp), path) => Some(Cow::Owned(format!("{stamp}.{path}"))),
    }
}

/// Deserializes `line`, which must hold exactly one JSON object. A data error names its field; in
/// a plugin's stamp (`stamp` is its access-log field, `sluice`), as `sluice.input_tokens`.
pub(crate) fn object<'a, T: Deserialize<'a>>(line: &'a str, stamp: Option<&'static str>) -> Result<T, Fault> {
    let not_json = |message: String| Fault { field: stamp.map(Cow::Borrowed), problem: Problem::NotJson(message) };
    if !line.trim_start().starts_with('{') {
        return Err(not_json("expected a JSON object (`{…}`)".into()));
    }
    let mut de = serde_json::Deserializer::from_str(line);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        match inner.classify() {
            Category::Data => Fault { field: field_name(stamp, &path), problem: Problem::Invalid(bare_message(&inner)) },
            Category::Syntax | Category::Eof | Category::Io => not_json(format!("{} (column {})", bare_message(&inner), inner.column())),
        }
    })?;
    de.end().map_err(|e| not_json(format!("{} (column {})", bare_message(&e), e.column())))?;
    Ok(value)
}

/// A time as nanoseconds, from JSON decimal seconds given as a string (`"604453"`, RAGPulse's
/// form) or as a non-negative number.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Seconds(pub i128);

impl<'de> Deserialize<'de> for Seconds {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Seconds;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("non-negative seconds, as a string of decimal digits or a number")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Seconds, E> {
                super::time::parse_decimal_seconds(s).map(Seconds).map_err(E::custom)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Seconds, E> {
                Ok(Seconds(i128::from(v) * 1_000_000_000))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Seconds, E> {
                u64::try_from(v).map_err(|_| E::custom(format!("negative seconds {v}"))).and_then(|v| self.visit_u64(v))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Seconds, E> {
                nonnegative_scaled(v, 1e9).map(Seconds).ok_or_else(|| E::custom(format!("seconds {v} are not a finite non-negative number")))
            }
        }
        d.deserialize_any(V)
    }
}

/// A time as nanoseconds, from a JSON number of milliseconds (integer: exact; fractional: the
/// nearest nanosecond of its `f64` value).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Millis(pub i128);

impl<'de> Deserialize<'de> for Millis {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Millis;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("milliseconds as a non-negative JSON number")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Millis, E> {
                Ok(Millis(i128::from(v) * 1_000_000))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Millis, E> {
                u64::try_from(v).map_err(|_| E::custom(format!("negative milliseconds {v}"))).and_then(|v| self.visit_u64(v))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Millis, E> {
                nonnegative_scaled(v, 1e6).map(Millis).ok_or_else(|| E::custom(format!("milliseconds {v} are not a finite non-negative number")))
            }
        }
        d.deserialize_any(V)
    }
}

/// `v × scale` rounded to an integer, when `v` is finite and non-negative and the result fits.
fn nonnegative_scaled(v: f64, scale: f64) -> Option<i128> {
    let scaled = (v * scale).round();
    // Far beyond any trace (292 years of nanoseconds), and within i64.
    (v.is_finite() && v >= 0.0 && scaled < 9.2e18).then_some(scaled as i128)
}
