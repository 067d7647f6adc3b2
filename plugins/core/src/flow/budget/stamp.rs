//! tenant-budget's access-log stamp: a JSON object in filter state, written whole at each decision.
//!
//! Written directly as text: the fields are known, so no map is built per request. The bytes are
//! the ones a `serde_json::Map` (sorted keys, compact) of the same fields gives — access-log
//! parsers and the harness compare them — which the tests check.

/// The stamp's fields, declared (and written) in the byte order of their names.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Stamp {
    pub charged_micro_usd: Option<u64>,
    pub charged_tokens: Option<u64>,
    pub decision: Option<&'static str>,
    pub input_tokens: Option<u64>,
    pub key: Option<String>,
    pub ledger: Option<&'static str>,
    pub ledger_hold: Option<String>,
    pub org: Option<String>,
    pub outcome: Option<&'static str>,
    pub output_tokens: Option<u64>,
    pub reject_code: Option<String>,
    pub reserved_input_tokens: Option<u64>,
    pub reserved_micro_usd: Option<u64>,
    pub reserved_output_tokens: Option<u64>,
    pub reserved_tokens: Option<u64>,
    pub status: Option<u32>,
    pub team: Option<String>,
    pub usage: Option<&'static str>,
}

/// Appends `"name":` (a separator first unless the object is still empty).
fn name(out: &mut String, name: &str) {
    if out.len() > 1 {
        out.push(',');
    }
    out.push('"');
    out.push_str(name);
    out.push_str("\":");
}

fn number(out: &mut String, field: &str, value: Option<u64>) {
    if let Some(v) = value {
        name(out, field);
        crate::text::push_u64(out, v);
    }
}

fn text(out: &mut String, field: &str, value: Option<&str>) {
    if let Some(v) = value {
        name(out, field);
        escape(out, v);
    }
}

use crate::text::push_json_string as escape;

impl Stamp {
    pub fn to_json(&self) -> String {
        let mut out = String::with_capacity(256);
        out.push('{');
        number(&mut out, "charged_micro_usd", self.charged_micro_usd);
        number(&mut out, "charged_tokens", self.charged_tokens);
        text(&mut out, "decision", self.decision);
        number(&mut out, "input_tokens", self.input_tokens);
        text(&mut out, "key", self.key.as_deref());
        text(&mut out, "ledger", self.ledger);
        text(&mut out, "ledger_hold", self.ledger_hold.as_deref());
        text(&mut out, "org", self.org.as_deref());
        text(&mut out, "outcome", self.outcome);
        number(&mut out, "output_tokens", self.output_tokens);
        text(&mut out, "reject_code", self.reject_code.as_deref());
        number(&mut out, "reserved_input_tokens", self.reserved_input_tokens);
        number(&mut out, "reserved_micro_usd", self.reserved_micro_usd);
        number(&mut out, "reserved_output_tokens", self.reserved_output_tokens);
        number(&mut out, "reserved_tokens", self.reserved_tokens);
        number(&mut out, "status", self.status.map(u64::from));
        text(&mut out, "team", self.team.as_deref());
        text(&mut out, "usage", self.usage);
        out.push('}');
        out
    }
}

#[cfg(test)]
mod tests {
    use super::Stamp;
    use serde_json::{Map, Value};

    /// What the adapter wrote before: a serde_json map of the same fields.
    fn via_map(s: &Stamp) -> String {
        let mut m = Map::new();
        let mut num = |k: &str, v: Option<u64>| {
            if let Some(v) = v {
                m.insert(k.into(), v.into());
            }
        };
        num("charged_micro_usd", s.charged_micro_usd);
        num("charged_tokens", s.charged_tokens);
        num("input_tokens", s.input_tokens);
        num("output_tokens", s.output_tokens);
        num("reserved_input_tokens", s.reserved_input_tokens);
        num("reserved_micro_usd", s.reserved_micro_usd);
        num("reserved_output_tokens", s.reserved_output_tokens);
        num("reserved_tokens", s.reserved_tokens);
        num("status", s.status.map(u64::from));
        let mut txt = |k: &str, v: Option<&str>| {
            if let Some(v) = v {
                m.insert(k.into(), v.into());
            }
        };
        txt("decision", s.decision);
        txt("key", s.key.as_deref());
        txt("ledger", s.ledger);
        txt("ledger_hold", s.ledger_hold.as_deref());
        txt("org", s.org.as_deref());
        txt("outcome", s.outcome);
        txt("reject_code", s.reject_code.as_deref());
        txt("team", s.team.as_deref());
        txt("usage", s.usage);
        Value::Object(m).to_string()
    }

    #[test]
    fn the_stamp_is_byte_for_byte_what_a_serde_json_map_writes() {
        let empty = Stamp::default();
        assert_eq!(empty.to_json(), "{}");
        assert_eq!(empty.to_json(), via_map(&empty));
        let rejected =
            Stamp { decision: Some("rejected"), reject_code: Some("unknown_key".into()), status: Some(401), outcome: Some("refused"), ..Stamp::default() };
        assert_eq!(rejected.to_json(), r#"{"decision":"rejected","outcome":"refused","reject_code":"unknown_key","status":401}"#);
        let full = Stamp {
            charged_micro_usd: Some(138),
            charged_tokens: Some(0),
            decision: Some("clamped"),
            input_tokens: Some(u64::MAX),
            key: Some("k\"\\\n\t\u{1}\u{7f}é✓".into()),
            ledger: Some("redis"),
            ledger_hold: Some("abc-1-2".into()),
            org: Some("o\r\u{8}\u{c}".into()),
            outcome: Some("completed"),
            output_tokens: Some(7),
            reject_code: Some("c".into()),
            reserved_input_tokens: Some(1),
            reserved_micro_usd: Some(2),
            reserved_output_tokens: Some(3),
            reserved_tokens: Some(4),
            status: Some(200),
            team: Some("t/\u{1f}".into()),
            usage: Some("reported"),
        };
        assert_eq!(full.to_json(), via_map(&full));
    }
}
