//! Token usage as reported by the upstream, normalised so OpenAI and Anthropic numbers mean the same.
//!
//! OpenAI's prompt count already includes cached tokens; Anthropic's `input_tokens` excludes cache
//! reads and cache writes. Sluice always stores the OpenAI meaning (all prompt tokens) in
//! [`Usage::input_tokens`] and keeps the cached / cache-creation parts separately for pricing.

use crate::json::{u64_at, u64_at2};
use serde_json::Value;

/// Token counts of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// All prompt tokens, including cached and cache-creation tokens (Anthropic `input_tokens +
    /// cache_read_input_tokens + cache_creation_input_tokens`; OpenAI `prompt_tokens` / `input_tokens`).
    pub input_tokens: u64,
    /// All generated tokens, including reasoning tokens.
    pub output_tokens: u64,
    /// Prompt tokens served from the provider's cache (OpenAI `*_tokens_details.cached_tokens`,
    /// Anthropic `cache_read_input_tokens`).
    pub cached_input_tokens: u64,
    /// Prompt tokens written to the cache (Anthropic only).
    pub cache_creation_input_tokens: u64,
    /// Reasoning tokens, a part of `output_tokens`.
    pub reasoning_tokens: u64,
}

impl Usage {
    /// `input_tokens + output_tokens`.
    pub fn total_tokens(&self) -> u64 {
        self.input_tokens.saturating_add(self.output_tokens)
    }

    /// Parse an OpenAI usage object. Accepts both the chat/completions names (`prompt_tokens`,
    /// `completion_tokens`, `prompt_tokens_details`, `completion_tokens_details`) and the Responses
    /// names (`input_tokens`, `output_tokens`, `input_tokens_details`, `output_tokens_details`), since
    /// compatible servers mix them. `None` if `v` is not an object or has neither count.
    pub fn from_openai(v: &Value) -> Option<Usage> {
        if !v.is_object() {
            return None;
        }
        let input = u64_at(v, "prompt_tokens").or_else(|| u64_at(v, "input_tokens"));
        let output = u64_at(v, "completion_tokens").or_else(|| u64_at(v, "output_tokens"));
        if input.is_none() && output.is_none() {
            return None;
        }
        Some(Usage {
            input_tokens: input.unwrap_or(0),
            output_tokens: output.unwrap_or(0),
            cached_input_tokens: u64_at2(v, "prompt_tokens_details", "cached_tokens")
                .or_else(|| u64_at2(v, "input_tokens_details", "cached_tokens"))
                .unwrap_or(0),
            cache_creation_input_tokens: 0,
            reasoning_tokens: u64_at2(v, "completion_tokens_details", "reasoning_tokens")
                .or_else(|| u64_at2(v, "output_tokens_details", "reasoning_tokens"))
                .unwrap_or(0),
        })
    }

    /// [`Usage::from_openai`] of the JSON text `raw`: read by core's scanner without building a tree
    /// (the observer reads one such object an answer: its tree was ≈ 5,400 instructions), by the tree
    /// where the scanner is not sure (a repeated member, a signed, fractional or exponent number).
    pub fn from_openai_text(raw: &[u8]) -> Option<Usage> {
        let text = std::str::from_utf8(raw).ok()?;
        match scanned_openai(text) {
            Some(usage) => usage,
            None => serde_json::from_slice::<Value>(raw).ok().as_ref().and_then(Usage::from_openai),
        }
    }

    /// Parse an Anthropic usage object (`input_tokens`, `output_tokens`, `cache_read_input_tokens`,
    /// `cache_creation_input_tokens`), normalising `input_tokens` to include the cache parts.
    /// `None` if `v` is not an object or has no count at all.
    pub fn from_anthropic(v: &Value) -> Option<Usage> {
        let parts = AnthropicUsage::from_json(v)?;
        Some(parts.normalised())
    }
}

/// Anthropic usage fields as sent, each optional, so partial updates (`message_delta`) can be merged
/// into what `message_start` reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct AnthropicUsage {
    pub input: Option<u64>,
    pub output: Option<u64>,
    pub cache_read: Option<u64>,
    pub cache_creation: Option<u64>,
}

impl AnthropicUsage {
    pub(crate) fn from_json(v: &Value) -> Option<Self> {
        if !v.is_object() {
            return None;
        }
        let u = AnthropicUsage {
            input: u64_at(v, "input_tokens"),
            output: u64_at(v, "output_tokens"),
            cache_read: u64_at(v, "cache_read_input_tokens"),
            cache_creation: u64_at(v, "cache_creation_input_tokens"),
        };
        if u == AnthropicUsage::default() {
            return None;
        }
        Some(u)
    }

    /// Fields present in `newer` replace ours: Anthropic's counts are cumulative, never deltas.
    pub(crate) fn merge(&mut self, newer: AnthropicUsage) {
        self.input = newer.input.or(self.input);
        self.output = newer.output.or(self.output);
        self.cache_read = newer.cache_read.or(self.cache_read);
        self.cache_creation = newer.cache_creation.or(self.cache_creation);
    }

    pub(crate) fn normalised(&self) -> Usage {
        let cache_read = self.cache_read.unwrap_or(0);
        let cache_creation = self.cache_creation.unwrap_or(0);
        Usage {
            input_tokens: self.input.unwrap_or(0).saturating_add(cache_read).saturating_add(cache_creation),
            output_tokens: self.output.unwrap_or(0),
            cached_input_tokens: cache_read,
            cache_creation_input_tokens: cache_creation,
            reasoning_tokens: 0,
        }
    }
}

/// The counts [`Usage::from_openai`] reads, in its order of preference.
const OPENAI_COUNTS: [&str; 4] = ["prompt_tokens", "input_tokens", "completion_tokens", "output_tokens"];
/// The detail objects it reads, with the one member it takes from each.
const OPENAI_DETAILS: [(&str, &str); 4] = [
    ("prompt_tokens_details", "cached_tokens"),
    ("input_tokens_details", "cached_tokens"),
    ("completion_tokens_details", "reasoning_tokens"),
    ("output_tokens_details", "reasoning_tokens"),
];

/// [`Usage::from_openai`] by the scanner: `None` when it gives up, else what the tree would say.
fn scanned_openai(text: &str) -> Option<Option<Usage>> {
    use crate::scan::{first_time, Scanner};
    // The four counts, then the four details' members.
    let mut found = [None::<u64>; 8];
    let mut seen = 0u32;
    let mut sc = Scanner::new(text);
    sc.object(|sc, key| {
        if let Some(i) = OPENAI_COUNTS.iter().position(|k| key.is(k)) {
            first_time(&mut seen, 1 << i)?;
            *found.get_mut(i)? = scanned_u64(sc)?;
        } else if let Some(i) = OPENAI_DETAILS.iter().position(|(k, _)| key.is(k)) {
            first_time(&mut seen, 1 << (i + 4))?;
            let (_, inner) = OPENAI_DETAILS.get(i)?;
            let start = sc.position();
            let value = sc.value()?;
            // A member of anything but an object is none, as `Value::get` gives.
            if value.first() == Some(&b'{') {
                let mut nested = Scanner::at(text, start);
                let mut inner_seen = 0u32;
                let mut count = None;
                nested.object(|nested, key| {
                    if key.is(inner) {
                        first_time(&mut inner_seen, 1)?;
                        count = scanned_u64(nested)?;
                    } else {
                        nested.value()?;
                    }
                    Some(())
                })?;
                *found.get_mut(i + 4)? = count;
            }
        } else {
            sc.value()?;
        }
        Some(())
    })?;
    if !sc.at_end() {
        return None;
    }
    let [prompt, input, completion, output, prompt_cached, input_cached, completion_reasoning, output_reasoning] = found;
    let (input, output) = (prompt.or(input), completion.or(output));
    if input.is_none() && output.is_none() {
        return Some(None);
    }
    Some(Some(Usage {
        input_tokens: input.unwrap_or(0),
        output_tokens: output.unwrap_or(0),
        cached_input_tokens: prompt_cached.or(input_cached).unwrap_or(0),
        cache_creation_input_tokens: 0,
        reasoning_tokens: completion_reasoning.or(output_reasoning).unwrap_or(0),
    }))
}

/// The next value as `Value::as_u64` reads it: `Some(Some(n))` for an unsigned integer that fits,
/// `Some(None)` for anything that is not a number or an integer past `u64::MAX` (the tree holds
/// those as floats); `None` (give up) for a number with a sign, a fraction or an exponent.
fn scanned_u64(sc: &mut crate::scan::Scanner<'_>) -> Option<Option<u64>> {
    let raw = sc.value()?;
    match raw.first() {
        Some(b'0'..=b'9') if raw.iter().all(u8::is_ascii_digit) => Some(std::str::from_utf8(raw).ok().and_then(|t| t.parse::<u64>().ok())),
        Some(b'0'..=b'9' | b'-') => None,
        _ => Some(None),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    /// A member value of the kinds a usage object meets, and of the kinds the scanner gives way on.
    fn value() -> impl Strategy<Value = String> {
        prop_oneof![
            (0u64..5000).prop_map(|n| n.to_string()),
            Just("18446744073709551615".to_string()),
            Just("18446744073709551616".to_string()),
            Just("0".to_string()),
            Just("-0".to_string()),
            Just("-3".to_string()),
            Just("12.0".to_string()),
            Just("1e3".to_string()),
            Just("null".to_string()),
            Just("true".to_string()),
            Just("\"12\"".to_string()),
            Just("[1,2]".to_string()),
        ]
    }

    const KEYS: [&str; 9] = [
        "prompt_tokens",
        "input_tokens",
        "completion_tokens",
        "output_tokens",
        "total_tokens",
        "cached_tokens",
        "reasoning_tokens",
        "accepted_prediction_tokens",
        "prompt_tokens\\u0020",
    ];
    const DETAILS: [&str; 4] = ["prompt_tokens_details", "input_tokens_details", "completion_tokens_details", "output_tokens_details"];

    fn object(members: Vec<(String, String)>, space: bool) -> String {
        let sep = if space { ", " } else { "," };
        let body: Vec<String> = members.into_iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
        format!("{{{}}}", body.join(sep))
    }

    fn member() -> impl Strategy<Value = (String, String)> {
        let flat = (prop::sample::select(KEYS.to_vec()), value()).prop_map(|(k, v)| (k.to_string(), v));
        let nested_member = (prop::sample::select(KEYS.to_vec()), value()).prop_map(|(k, v)| (k.to_string(), v));
        let details = (prop::sample::select(DETAILS.to_vec()), prop::collection::vec(nested_member, 0..4), any::<bool>(), any::<bool>())
            .prop_map(|(k, members, space, not_object)| (k.to_string(), if not_object { "7".to_string() } else { object(members, space) }));
        prop_oneof![3 => flat, 1 => details]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]
        /// Read from the text, a usage object gives what its tree gives, for every mix of members,
        /// repeats, nested details and values (including those the scanner leaves to the tree).
        #[test]
        fn a_usage_read_from_its_text_is_the_one_read_from_its_tree(members in prop::collection::vec(member(), 0..8), space in any::<bool>(), trailing in prop::sample::select(vec!["", " ", "\n", " x", ","])) {
            let text = format!("{}{trailing}", object(members, space));
            let tree = serde_json::from_str::<Value>(&text).ok();
            let expected = tree.as_ref().and_then(Usage::from_openai);
            prop_assert_eq!(Usage::from_openai_text(text.as_bytes()), expected, "{}", text);
        }
    }

    /// The usual report is read by the scanner itself, not handed to the tree.
    #[test]
    fn the_usual_report_is_scanned() {
        let text = r#"{"prompt_tokens":374,"completion_tokens":44,"total_tokens":418,"prompt_tokens_details":{"cached_tokens":128},"completion_tokens_details":{"reasoning_tokens":7,"accepted_prediction_tokens":0}}"#;
        let usage = Usage { input_tokens: 374, output_tokens: 44, cached_input_tokens: 128, cache_creation_input_tokens: 0, reasoning_tokens: 7 };
        assert_eq!(scanned_openai(text), Some(Some(usage)));
        assert_eq!(scanned_openai(r#"{"total_tokens":3}"#), Some(None));
        // Left to the tree: a repeated count, a signed or fractional number.
        assert_eq!(scanned_openai(r#"{"prompt_tokens":1,"prompt_tokens":2}"#), None);
        assert_eq!(scanned_openai(r#"{"prompt_tokens":-1}"#), None);
        assert_eq!(scanned_openai(r#"{"prompt_tokens":1.0}"#), None);
        assert_eq!(Usage::from_openai_text(r#"{"prompt_tokens":1,"prompt_tokens":2}"#.as_bytes()).map(|u| u.input_tokens), Some(2));
    }
}
