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

impl Verdict {
    /// Appends the verdict's JSON (what `serde_json` writes for it) and a newline to `out`, the
    /// stamps' texts copied as they are: they were checked when read, and `Stamp`'s `Serialize`
    /// checks them again.
    pub fn write_line(&mut self, out: &mut Vec<u8>) -> serde_json::Result<()> {
        let stamps = std::mem::take(&mut self.stamps);
        let start = out.len();
        let written = serde_json::to_writer(&mut *out, &*self);
        self.stamps = stamps;
        written?;
        // The stamps are the last member: `…,"stamps":{}}` becomes `…,"stamps":{<the stamps>}}`.
        let Some(head) = out.len().checked_sub(3).filter(|at| *at >= start && out.get(*at..) == Some(b"{}}")) else {
            out.truncate(start);
            serde_json::to_writer(&mut *out, &*self)?;
            out.push(b'\n');
            return Ok(());
        };
        out.truncate(head.saturating_add(1));
        let mut first = true;
        for (name, stamp) in
            [("sluice", &self.stamps.sluice), ("budget", &self.stamps.budget), ("route", &self.stamps.route), ("latency", &self.stamps.latency)]
        {
            let Some(stamp) = stamp else { continue };
            if !first {
                out.push(b',');
            }
            first = false;
            out.push(b'"');
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b"\":");
            out.extend_from_slice(stamp.text().as_bytes());
        }
        out.extend_from_slice(b"}}\n");
        Ok(())
    }
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

/// One plugin's stamp: its JSON text as the plugin wrote it (checked to be one JSON value when
/// read), written out as it is. A verdict reads a few members of each stamp; parsing all four
/// into trees, each member an allocation, and serialising them again was a tenth of a replay's
/// time, and checking them with serde_json then reading the members in a second pass a twentieth.
#[derive(Debug, Clone)]
pub struct Stamp(Box<str>);

impl Stamp {
    /// The stamp in `bytes`, when they are JSON.
    pub fn parse(bytes: &[u8]) -> Option<Stamp> {
        Stamp::parse_reading(bytes, []).map(|(stamp, [])| stamp)
    }

    /// The stamp in `bytes`, when they are JSON, with its top-level members named `keys` (as
    /// [`Stamp::members`] gives them), in one pass over the text where sluice-core's scanner is
    /// sure of it (every stamp sluice writes), else checked and read by serde_json.
    pub fn parse_reading<const N: usize>(bytes: &[u8], keys: [&str; N]) -> Option<(Stamp, [Option<Value>; N])> {
        // The text without the whitespace around it, as serde_json's raw values keep it.
        let text = std::str::from_utf8(bytes).ok()?.trim_matches([' ', '\t', '\n', '\r']);
        read_members(text, keys).map(|members| (Stamp(text.into()), members))
    }

    /// A stamp holding `value`.
    pub fn from_value(value: &Value) -> Option<Stamp> {
        serde_json::to_string(value).ok().map(|text| Stamp(text.into()))
    }

    /// The stamp's JSON text.
    pub fn text(&self) -> &str {
        &self.0
    }

    /// The stamp as a tree.
    pub fn value(&self) -> Value {
        serde_json::from_str(&self.0).unwrap_or(Value::Null)
    }

    /// The top-level members named `keys`, as a tree of the stamp would give them (the last of a
    /// repeated key); `None` for an absent key or a stamp that is not an object. One pass, only
    /// the members asked for built, where core's scanner reads the text (else serde_json's tree).
    pub fn members<const N: usize>(&self, keys: [&str; N]) -> [Option<Value>; N] {
        // The text was checked as JSON when the stamp was made: `None` does not happen.
        read_members(&self.0, keys).unwrap_or_else(|| std::array::from_fn(|_| None))
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

/// The top-level members named `keys` of the JSON text `text` (none of a text that is not an
/// object), read by core's scanner where it is sure of the text (every stamp sluice writes), else
/// from serde_json's tree; `None` when `text` is not JSON.
fn read_members<const N: usize>(text: &str, keys: [&str; N]) -> Option<[Option<Value>; N]> {
    if let Some(raw) = sluice_core::json::object_members(text, keys) {
        return Some(raw.map(|member| member.map(member_value)));
    }
    let tree: Value = serde_json::from_str(text).ok()?;
    Some(keys.map(|key| tree.get(key).cloned()))
}

/// A member's JSON text (checked by the scanner) as a tree: the stamps' plain strings and
/// unsigned integers without serde_json's parser.
fn member_value(raw: &str) -> Value {
    let bytes = raw.as_bytes();
    if let [b'"', inner @ .., b'"'] = bytes {
        if !inner.contains(&b'\\') {
            if let Some(text) = raw.get(1..raw.len() - 1) {
                return Value::String(text.to_string());
            }
        }
    } else if !bytes.is_empty() && bytes.iter().all(u8::is_ascii_digit) && (bytes.len() == 1 || bytes.first() != Some(&b'0')) {
        if let Ok(n) = raw.parse::<u64>() {
            return Value::from(n);
        }
    }
    serde_json::from_str(raw).unwrap_or(Value::Null)
}

/// Written as its text, checked again (`RawValue`): the verdict lines the simulator writes by the
/// thousand take [`Verdict::write_line`], which writes the text without that second check.
impl Serialize for Stamp {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        RawValue::from_string(self.0.to_string()).map_err(serde::ser::Error::custom)?.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Stamp {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Stamp, D::Error> {
        let raw = Box::<RawValue>::deserialize(deserializer)?;
        Ok(Stamp(raw.get().into()))
    }
}

/// Two stamps are equal when their JSON is, whatever its spacing or member order.
impl PartialEq for Stamp {
    fn eq(&self, other: &Stamp) -> bool {
        self.0 == other.0 || self.value() == other.value()
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
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
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

    /// A verdict line is what serde_json writes for the verdict, whichever stamps it has (none,
    /// some, all four; objects, other JSON values, texts the scanner leaves to serde_json), and it
    /// reads back as the same verdict.
    #[test]
    fn a_verdict_line_is_the_verdicts_json() {
        let head = r#"{"line":2,"arrival_ms":0.0,"tenant":"t","key":"t","user":null,"api":"chat_completions","model":"m","prompt_tokens":374,"stream":true,"decision":"admitted","status":200,"code":null,"refused_by":null,"outcome":"completed","version":"v1","route_reason":"weight","shadow_version":null,"ttft_ms":71.166,"tpot_ms":22.0,"duration_ms":1017.166,"input_tokens":374,"output_tokens":44,"cost_usd":0.000256,"ctx":"1k","turn":"first","upstream_concurrency":1,"stamps":{}}"#;
        let base: Verdict = serde_json::from_str(head).unwrap();
        let texts = [r#"{"status":200,"outcome":"completed","ttft_us":71166}"#, r#"{"k\u0065y":"a","n":[1,{"x":null}]}"#, "[1,2]", r#""text""#, " { } "];
        let stamp = |i: usize| Stamp::parse(texts[i % texts.len()].as_bytes()).unwrap();
        let mut cases = vec![Stamps::default()];
        for mask in 1u8..16 {
            let pick = |bit: u8, i: usize| (mask & bit != 0).then(|| stamp(i + usize::from(mask)));
            cases.push(Stamps { sluice: pick(1, 0), budget: pick(2, 1), route: pick(4, 2), latency: pick(8, 3) });
        }
        for stamps in cases {
            let mut verdict = Verdict { stamps, ..base.clone() };
            let mut line = b"before".to_vec();
            verdict.write_line(&mut line).unwrap();
            let want = format!("before{}\n", serde_json::to_string(&verdict).unwrap());
            assert_eq!(String::from_utf8(line.clone()).unwrap(), want);
            assert_eq!(serde_json::from_slice::<Verdict>(&line[6..]).unwrap(), verdict);
        }
    }

    /// Read in one pass, a stamp's members are what a tree of it holds, for the texts the scanner
    /// reads and for those it leaves to serde_json; what is not JSON is no stamp.
    #[test]
    fn a_stamp_read_in_one_pass_gives_the_trees_members() {
        let keys = ["status", "outcome", "n", "big", "neg", "esc", "absent"];
        for text in [
            r#"{"status":200,"outcome":"completed","n":0,"big":18446744073709551616,"neg":-3,"esc":"a\"b\u00e9"}"#,
            r#"{"status":200,"st\u0061tus":201,"outcome":"x"}"#,
            r#"{"status":1,"status":2,"outcome":"\ud83d\ude00"}"#,
            r#"{"n":1.5e3,"big":1e400}"#,
            "[1]",
            "null",
        ] {
            let tree: Option<Value> = serde_json::from_str(text).ok();
            match Stamp::parse_reading(text.as_bytes(), keys) {
                Some((stamp, members)) => {
                    let tree = tree.unwrap();
                    assert_eq!(stamp.text(), text);
                    for (key, member) in keys.iter().zip(&members) {
                        assert_eq!(member.as_ref(), tree.get(key), "{key} of {text}");
                    }
                    assert_eq!(stamp.members(keys), members);
                }
                None => assert!(tree.is_none(), "{text} is JSON"),
            }
        }
        assert!(Stamp::parse_reading(b"{\"status\":2", ["status"]).is_none());
        assert!(Stamp::parse_reading(b"{\"status\":\"\xff\"}", ["status"]).is_none());
    }
}
