//! What the simulator says about each request (one JSON line each) and what it samples over time.
//! The same records describe a real gateway's access log ([`crate::observed`]), so one report
//! renders both "what would have happened" and "what happened".

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;
use sluice_core::report::{finish_label, Outcome, RequestRecord, TRUNCATED_FINISH};

/// What the gateway did with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Hash, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// Sent upstream as the client asked.
    Admitted,
    /// Sent upstream with a lower output limit than the client asked (tenant-budget's clamp).
    Clamped,
    /// Answered by the gateway itself before any upstream saw it (429, 503, …).
    Refused,
}

impl Decision {
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Admitted => "admitted",
            Decision::Clamped => "clamped",
            Decision::Refused => "refused",
        }
    }
}

/// One request's verdict: a line of `verdicts.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// The trace line the request came from (1-based).
    pub line: u64,
    /// Arrival, milliseconds after the trace's first request (after time scaling).
    pub arrival_ms: f64,
    pub tenant: Option<String>,
    pub key: Option<String>,
    pub user: Option<String>,
    /// `chat_completions`, `completions`, `responses`, `messages`.
    pub api: String,
    /// The model the client asked for.
    pub model: Option<String>,
    pub prompt_tokens: u64,
    pub stream: bool,
    pub decision: Decision,
    /// The HTTP status the client got (0: none, the client went away first).
    pub status: u16,
    /// Why it was refused: tenant-budget's code (`key:acme:minute:total_tokens`, `unknown_key`, …)
    /// or latency-guard's (`shed_breaker_open`, `shed_in_flight`).
    pub code: Option<String>,
    /// The plugin that refused it: `tenant-budget` or `latency-guard`.
    pub refused_by: Option<String>,
    /// llm-metrics' outcome: `completed`, `client_disconnect`, `upstream_error`, `refused`, `deadline`.
    pub outcome: String,
    /// The model version it went to (model-router's decision), when it went anywhere.
    pub version: Option<String>,
    /// Why the router chose it (`split`, `sticky`, `fallback`, …), from its stamp.
    pub route_reason: Option<String>,
    /// Whether a shadow copy was sent, and to which version.
    pub shadow_version: Option<String>,
    /// Time to first content token at the gateway, ms.
    pub ttft_ms: Option<f64>,
    /// Time per output token after the first, ms.
    pub tpot_ms: Option<f64>,
    /// Headers in → end of the response, ms.
    pub duration_ms: f64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Cost in USD, when a price matched.
    pub cost_usd: Option<f64>,
    /// The context-length bucket label (`1k`, `2k`, … as llm-metrics labels it).
    pub ctx: Option<String>,
    /// `first` or `follow_up` (llm-metrics' turn label).
    pub turn: Option<String>,
    /// What llm-metrics' stamp says about the answer's text, for the answers it judges (absent
    /// otherwise, and in verdicts written before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quality: Option<Quality>,
    /// Requests in flight at the chosen version when this one was sent upstream (simulation only).
    pub upstream_concurrency: Option<u32>,
    /// What the modelled upstream was to do for this request (simulation only): a replay against
    /// the mock server sends exactly this (`x-mock-*` headers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<UpstreamPlan>,
    /// Each plugin's access-log stamp, as the plugin wrote it: `sluice`, `budget`, `route`, `latency`.
    pub stamps: Stamps,
}

/// One whole answer as llm-metrics judged it (docs/metrics.md, "Output quality"): the figures of
/// its stamp that feed `sluice_quality_*`, so a report counts what those series count.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quality {
    /// llm-metrics' `model_version` label: the label of the quality series.
    pub model_version: String,
    /// The stamp's `output_tokens` (reported, else estimated).
    pub output_tokens: u64,
    /// The `finish` label: a finish reason llm-metrics documents, `none` or `other`.
    pub finish: String,
    /// No content event at all (`content_chunks` 0).
    pub empty: bool,
    /// Finished at the token limit (`length`, `max_tokens`, `max_output_tokens`).
    pub truncated: bool,
    /// ‰ of the answer's word trigrams that repeat an earlier one; none under 10 trigrams.
    pub repetition_per_mille: Option<u64>,
}

impl Quality {
    /// The judgement of an answer from its llm-metrics stamp fields, `None` for an answer the
    /// plugin does not judge. "Whole answer" is the plugin's own test
    /// (`RequestRecord::judges_quality`: a 2xx that completed), not a copy of it.
    pub fn judge(
        model_version: &str,
        status: u64,
        outcome: &str,
        output_tokens: u64,
        finish_reason: Option<&str>,
        content_chunks: Option<u64>,
        repetition_per_mille: Option<u64>,
    ) -> Option<Quality> {
        const OUTCOMES: [Outcome; 5] = [Outcome::Completed, Outcome::ClientDisconnect, Outcome::UpstreamError, Outcome::Refused, Outcome::Deadline];
        let outcome = OUTCOMES.into_iter().find(|o| o.as_str() == outcome)?;
        let record = RequestRecord { status: u16::try_from(status).ok()?, outcome, ..RequestRecord::default() };
        if !record.judges_quality() {
            return None;
        }
        let finish = finish_label(finish_reason);
        Some(Quality {
            model_version: model_version.to_string(),
            output_tokens,
            finish: finish.to_string(),
            // A stamp without `content_chunks` (older than the field) says nothing about emptiness.
            empty: content_chunks == Some(0),
            truncated: TRUNCATED_FINISH.contains(&finish),
            repetition_per_mille,
        })
    }
}

/// The modelled upstream's answer to one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpstreamPlan {
    /// Where it went (the route model-router wrote, else the model).
    pub name: String,
    /// From reaching the upstream to the first token (queue wait included), ms.
    pub ttft_ms: f64,
    /// Between content tokens, ms.
    pub itl_ms: f64,
    /// Content tokens it was to send (the request's limit may cut them).
    pub tokens: u64,
    /// An error status instead of an answer.
    pub fail_status: Option<u16>,
}

/// The plugins' own stamps (the filter-state values the access log prints).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Stamps {
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub sluice: Option<Stamp>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub budget: Option<Stamp>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub route: Option<Stamp>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub latency: Option<Stamp>,
}

/// One plugin's stamp: its JSON text as the plugin wrote it, written out as it is. A verdict
/// reads a few members of each stamp; parsing all four into trees, each member an allocation, and
/// serialising them again was a tenth of a replay's time.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Stamp(Box<RawValue>);

impl Stamp {
    /// The stamp in `bytes`, when they are JSON.
    pub fn parse(bytes: &[u8]) -> Option<Stamp> {
        // UTF-8 checked once here: read from the bytes, serde_json checks each string it reads and
        // then the whole raw text again.
        let text = std::str::from_utf8(bytes).ok()?;
        serde_json::from_str(text).ok().map(Stamp)
    }

    /// A stamp holding `value`.
    pub fn from_value(value: &Value) -> Option<Stamp> {
        serde_json::value::to_raw_value(value).ok().map(Stamp)
    }

    /// The stamp as a tree.
    pub fn value(&self) -> Value {
        serde_json::from_str(self.0.get()).unwrap_or(Value::Null)
    }

    /// The top-level members named `keys`, as a tree of the stamp would give them (the last of a
    /// repeated key); `None` for an absent key or a stamp that is not an object. One pass, only
    /// the members asked for built.
    pub fn members<const N: usize>(&self, keys: [&str; N]) -> [Option<Value>; N] {
        let mut found: [Option<Value>; N] = std::array::from_fn(|_| None);
        let mut de = serde_json::Deserializer::from_str(self.0.get());
        // Not an object (the text is JSON: it was parsed as such): no members.
        let _ = serde::Deserializer::deserialize_any(&mut de, Members { keys: &keys, found: &mut found });
        found
    }

    pub fn u64(&self, key: &str) -> Option<u64> {
        let [v] = self.members([key]);
        v.and_then(|v| v.as_u64())
    }

    pub fn str(&self, key: &str) -> Option<String> {
        let [v] = self.members([key]);
        match v {
            Some(Value::String(s)) => Some(s),
            _ => None,
        }
    }
}

/// Two stamps are equal when their JSON is, whatever its spacing or member order.
impl PartialEq for Stamp {
    fn eq(&self, other: &Stamp) -> bool {
        self.0.get() == other.0.get() || self.value() == other.value()
    }
}

/// A member's key as its index in `keys` (`None`: not wanted), compared where the parser holds it
/// (a `String` a key was an allocation per member).
struct KeyIndex<'k, const N: usize> {
    keys: &'k [&'k str; N],
}

impl<'de, const N: usize> serde::de::DeserializeSeed<'de> for KeyIndex<'_, N> {
    type Value = Option<usize>;

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<Option<usize>, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de, const N: usize> serde::de::Visitor<'de> for KeyIndex<'_, N> {
    type Value = Option<usize>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a member name")
    }

    fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<Option<usize>, E> {
        Ok(self.keys.iter().position(|k| *k == key))
    }
}

/// Reads an object's members named `keys` into `found`, skipping the others unbuilt.
struct Members<'k, 'f, const N: usize> {
    keys: &'k [&'k str; N],
    found: &'f mut [Option<Value>; N],
}

impl<'de, const N: usize> serde::de::Visitor<'de> for Members<'_, '_, N> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(wanted) = map.next_key_seed(KeyIndex { keys: self.keys })? {
            match wanted {
                Some(i) => {
                    let value = map.next_value::<Value>()?;
                    if let Some(slot) = self.found.get_mut(i) {
                        *slot = Some(value);
                    }
                }
                None => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

/// State sampled at fixed virtual-time steps (simulation only; a real access log has none).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Milliseconds after the trace's first request.
    pub t_ms: f64,
    /// latency-guard's breaker state per version: `closed`, `open`, `half_open`.
    pub breakers: Vec<(String, String)>,
    /// Requests in flight upstream per version.
    pub in_flight: Vec<(String, u32)>,
    /// tenant-budget's remaining amount per budget code (its `remaining` gauges).
    pub budgets_remaining: Vec<(String, i64)>,
}

/// A breaker transition, as latency-guard logged or counted it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Transition {
    pub t_ms: f64,
    pub version: String,
    pub from: String,
    pub to: String,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    /// A stamp's members read as a tree of it gives them: the last of a repeated key, an escaped
    /// key decoded, nested values whole, nothing from a stamp that is not an object.
    #[test]
    fn members_are_what_the_parsed_stamp_holds() {
        let text = r#"{"status":200,"outcome":"first","ctx":{"a":[1,2]},"out\u0063ome":"second","n":-3,"f":1.5,"s":null}"#;
        let stamp = Stamp::parse(text.as_bytes()).unwrap();
        let tree: Value = serde_json::from_str(text).unwrap();
        let keys = ["status", "outcome", "ctx", "n", "f", "s", "absent"];
        let members = stamp.members(keys);
        for (key, member) in keys.iter().zip(&members) {
            assert_eq!(member.as_ref(), tree.get(key), "{key}");
        }
        assert_eq!(stamp.str("outcome").as_deref(), Some("second"));
        assert_eq!((stamp.u64("status"), stamp.u64("n"), stamp.u64("f"), stamp.str("status")), (Some(200), None, None, None));
        for not_an_object in ["[1,2]", "\"text\"", "7", "null"] {
            assert_eq!(Stamp::parse(not_an_object.as_bytes()).unwrap().members(["status"]), [None]);
        }
        assert!(Stamp::parse(b"{\"status\":").is_none());
        // Not UTF-8 inside a string: not a stamp.
        assert!(Stamp::parse(b"{\"outcome\":\"\xff\"}").is_none());
        // Written out as the plugin wrote it; equal to the same JSON spaced or ordered otherwise.
        assert_eq!(serde_json::to_string(&stamp).unwrap(), text);
        assert_eq!(Stamp::from_value(&json!({"b": 1, "a": 2})), Stamp::parse(br#"{ "a":2, "b":1 }"#));
    }
}
