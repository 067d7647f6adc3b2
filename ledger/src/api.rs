//! The wire contract of docs/ledger.md: request bodies, their validation, and the answers.
//!
//! Validation is strict and happens before Redis is touched: unknown members, wrong types, empty or
//! over-long names, control characters, more than [`MAX_COUNTERS`] counters, duplicate counter keys
//! and numbers above [`MAX_AMOUNT`] are all refused with a 400 and a JSON error.

use serde::Deserialize;
use serde_json::{json, Value};

/// Largest amount, limit or charge accepted: 2^53, so that every figure the Lua scripts compare is
/// an integer a Lua number (an IEEE double) holds exactly.
pub const MAX_AMOUNT: u64 = 1 << 53;
/// Most counters one request may touch.
pub const MAX_COUNTERS: usize = 64;
/// Longest request id, in bytes.
pub const MAX_ID_BYTES: usize = 128;
/// Longest tag (org id), in bytes.
pub const MAX_TAG_BYTES: usize = 128;
/// Longest counter key, in bytes.
pub const MAX_KEY_BYTES: usize = 256;
/// Longest hold TTL: 7 days.
pub const MAX_HOLD_TTL_S: u64 = 7 * 24 * 3600;
/// Latest `expire_at_s` accepted (9999-12-31T23:59:59Z); keeps `PEXPIREAT` far from overflow.
pub const MAX_EXPIRE_AT_S: u64 = 253_402_300_799;
/// Largest request body, in bytes (64 counters with 256-byte keys fit in a third of it).
pub const MAX_BODY_BYTES: usize = 64 * 1024;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReserveRequest {
    pub id: String,
    pub tag: String,
    pub hold_ttl_s: u64,
    pub counters: Vec<CounterRequest>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CounterRequest {
    pub key: String,
    pub limit: u64,
    pub amount: u64,
    pub expire_at_s: u64,
}

/// `POST /v1/charge`: what a request admitted without the ledger (the plugin's local fallback)
/// was charged, added to the counters unconditionally.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChargeRequest {
    pub id: String,
    pub tag: String,
    pub counters: Vec<ChargeCounter>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChargeCounter {
    pub key: String,
    pub amount: u64,
    pub expire_at_s: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SettleRequest {
    pub id: String,
    pub tag: String,
    pub charges: Vec<u64>,
}

/// A request the service refuses (HTTP 400).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadRequest {
    /// Machine-readable: `malformed_json`, `invalid_field`, `body_too_large`, `unsupported_media_type`,
    /// `charges_mismatch`.
    pub code: &'static str,
    pub message: String,
}

impl BadRequest {
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        BadRequest { code, message: message.into() }
    }

    fn field(message: impl Into<String>) -> Self {
        BadRequest::new("invalid_field", message)
    }

    pub fn body(&self) -> Value {
        json!({"error": self.code, "message": self.message})
    }
}

fn check_name(what: &str, value: &str, max: usize) -> Result<(), BadRequest> {
    if value.is_empty() {
        return Err(BadRequest::field(format!("{what} is empty")));
    }
    if value.len() > max {
        return Err(BadRequest::field(format!("{what} is {} bytes long, at most {max} allowed", value.len())));
    }
    if value.chars().any(char::is_control) {
        return Err(BadRequest::field(format!("{what} contains a control character")));
    }
    Ok(())
}

fn check_tag(tag: &str) -> Result<(), BadRequest> {
    check_name("tag", tag, MAX_TAG_BYTES)?;
    // The tag sits between `{` and `}` in every key: a brace inside it would change which part of
    // the key Redis Cluster hashes.
    if tag.contains(['{', '}']) {
        return Err(BadRequest::field("tag contains '{' or '}'"));
    }
    Ok(())
}

fn check_amount(what: &str, value: u64) -> Result<(), BadRequest> {
    if value > MAX_AMOUNT {
        return Err(BadRequest::field(format!("{what} is {value}, at most 2^53 = {MAX_AMOUNT} allowed")));
    }
    Ok(())
}

/// What reserve and charge check alike on their counters (`fields` gives a counter's key, amount
/// and `expire_at_s`): 1..=[`MAX_COUNTERS`] of them, valid keys, none twice, bounded numbers.
fn check_counters<C>(counters: &[C], fields: impl Fn(&C) -> (&str, u64, u64)) -> Result<(), BadRequest> {
    if counters.is_empty() || counters.len() > MAX_COUNTERS {
        return Err(BadRequest::field(format!("{} counters, must be 1..={MAX_COUNTERS}", counters.len())));
    }
    for (i, c) in counters.iter().enumerate() {
        let (key, amount, expire_at_s) = fields(c);
        check_name(&format!("counters[{i}].key"), key, MAX_KEY_BYTES)?;
        check_amount(&format!("counters[{i}].amount"), amount)?;
        if expire_at_s > MAX_EXPIRE_AT_S {
            return Err(BadRequest::field(format!("counters[{i}].expire_at_s is {expire_at_s}, at most {MAX_EXPIRE_AT_S} allowed")));
        }
        // A key twice would be checked twice against the same room and held (or charged) twice.
        if counters.iter().take(i).any(|earlier| fields(earlier).0 == key) {
            return Err(BadRequest::field(format!("counters[{i}].key {key:?} appears twice")));
        }
    }
    Ok(())
}

fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, BadRequest> {
    serde_json::from_slice(body).map_err(|e| BadRequest::new("malformed_json", e.to_string()))
}

impl ReserveRequest {
    pub fn parse(body: &[u8]) -> Result<ReserveRequest, BadRequest> {
        let request: ReserveRequest = parse(body)?;
        request.validate()?;
        Ok(request)
    }

    pub fn validate(&self) -> Result<(), BadRequest> {
        check_name("id", &self.id, MAX_ID_BYTES)?;
        check_tag(&self.tag)?;
        if self.hold_ttl_s == 0 || self.hold_ttl_s > MAX_HOLD_TTL_S {
            return Err(BadRequest::field(format!("hold_ttl_s is {}, must be 1..={MAX_HOLD_TTL_S}", self.hold_ttl_s)));
        }
        check_counters(&self.counters, |c| (c.key.as_str(), c.amount, c.expire_at_s))?;
        for (i, c) in self.counters.iter().enumerate() {
            check_amount(&format!("counters[{i}].limit"), c.limit)?;
        }
        Ok(())
    }
}

impl ChargeRequest {
    pub fn parse(body: &[u8]) -> Result<ChargeRequest, BadRequest> {
        let request: ChargeRequest = parse(body)?;
        request.validate()?;
        Ok(request)
    }

    pub fn validate(&self) -> Result<(), BadRequest> {
        check_name("id", &self.id, MAX_ID_BYTES)?;
        check_tag(&self.tag)?;
        check_counters(&self.counters, |c| (c.key.as_str(), c.amount, c.expire_at_s))
    }
}

impl SettleRequest {
    pub fn parse(body: &[u8]) -> Result<SettleRequest, BadRequest> {
        let request: SettleRequest = parse(body)?;
        request.validate()?;
        Ok(request)
    }

    pub fn validate(&self) -> Result<(), BadRequest> {
        check_name("id", &self.id, MAX_ID_BYTES)?;
        check_tag(&self.tag)?;
        if self.charges.is_empty() || self.charges.len() > MAX_COUNTERS {
            return Err(BadRequest::field(format!("{} charges, must be 1..={MAX_COUNTERS}", self.charges.len())));
        }
        for (i, &charge) in self.charges.iter().enumerate() {
            check_amount(&format!("charges[{i}]"), charge)?;
        }
        Ok(())
    }
}

/// Most settlements one `POST /v1/settle_batch` carries (a batch of them fits [`MAX_BODY_BYTES`]).
pub const MAX_BATCH: usize = 256;

/// `POST /v1/settle_batch`: settlements each as `/v1/settle` takes it, judged one by one (one bad
/// item is that item's 400, not the batch's).
#[derive(Debug)]
pub struct SettleBatch {
    pub items: Vec<Result<SettleRequest, BadRequest>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBatch {
    settlements: Vec<Value>,
}

impl SettleBatch {
    /// The batch's shape is checked here (JSON, `settlements` an array of 1..=[`MAX_BATCH`]); each
    /// item is parsed and validated on its own.
    pub fn parse(body: &[u8]) -> Result<SettleBatch, BadRequest> {
        let raw: RawBatch = parse(body)?;
        if raw.settlements.is_empty() || raw.settlements.len() > MAX_BATCH {
            return Err(BadRequest::field(format!("{} settlements, must be 1..={MAX_BATCH}", raw.settlements.len())));
        }
        let items = raw
            .settlements
            .into_iter()
            .map(|item| {
                let request: SettleRequest = serde_json::from_value(item).map_err(|e| BadRequest::new("malformed_json", e.to_string()))?;
                request.validate()?;
                Ok(request)
            })
            .collect();
        Ok(SettleBatch { items })
    }
}

/// One counter's state as answered: `used` and `reserved`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterState {
    pub used: u64,
    pub reserved: u64,
}

/// What a reserve decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReserveOutcome {
    Admitted { replayed: bool, counters: Vec<CounterState> },
    Refused { index: usize, used: u64, reserved: u64, limit: u64 },
    AlreadySettled,
}

/// What a settle decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SettleOutcome {
    Settled {
        counters: Vec<CounterState>,
    },
    AlreadySettled,
    Expired,
    Unknown,
    /// The hold has this many counters, not as many as the charges given (nothing was changed).
    Mismatch {
        held: usize,
    },
}

/// What a charge decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChargeOutcome {
    /// Added; every counter's state afterwards, in request order (0/0 for one whose window is over).
    Charged { counters: Vec<CounterState> },
    /// The id was used already (this charge, a hold or a settlement): nothing changed.
    AlreadyCharged,
}

fn states(counters: &[CounterState]) -> Value {
    Value::Array(counters.iter().map(|c| json!({"used": c.used, "reserved": c.reserved})).collect())
}

impl ReserveOutcome {
    /// The `result` label of the request metric.
    pub fn label(&self) -> &'static str {
        match self {
            ReserveOutcome::Admitted { replayed: false, .. } => "admitted",
            ReserveOutcome::Admitted { replayed: true, .. } => "replayed",
            ReserveOutcome::Refused { .. } => "refused",
            ReserveOutcome::AlreadySettled => "already_settled",
        }
    }

    pub fn body(&self) -> Value {
        match self {
            ReserveOutcome::Admitted { replayed, counters } => json!({"admitted": true, "replayed": replayed, "counters": states(counters)}),
            ReserveOutcome::Refused { index, used, reserved, limit } => {
                json!({"admitted": false, "refused": index, "used": used, "reserved": reserved, "limit": limit})
            }
            ReserveOutcome::AlreadySettled => json!({"admitted": false, "reason": "already_settled"}),
        }
    }
}

impl SettleOutcome {
    pub fn label(&self) -> &'static str {
        match self {
            SettleOutcome::Settled { .. } => "settled",
            SettleOutcome::AlreadySettled => "already_settled",
            SettleOutcome::Expired => "expired",
            SettleOutcome::Unknown => "unknown",
            SettleOutcome::Mismatch { .. } => "bad_request",
        }
    }

    /// The answer body; `Mismatch` is a 400 (see [`BadRequest`]) and answered by the caller.
    pub fn body(&self) -> Value {
        match self {
            SettleOutcome::Settled { counters } => json!({"settled": true, "counters": states(counters)}),
            SettleOutcome::AlreadySettled => json!({"settled": false, "reason": "already_settled"}),
            SettleOutcome::Expired => json!({"settled": false, "reason": "expired"}),
            SettleOutcome::Unknown => json!({"settled": false, "reason": "unknown"}),
            SettleOutcome::Mismatch { held } => {
                json!({"error": "charges_mismatch", "message": format!("the hold has {held} counters")})
            }
        }
    }
}

impl ChargeOutcome {
    pub fn label(&self) -> &'static str {
        match self {
            ChargeOutcome::Charged { .. } => "charged",
            ChargeOutcome::AlreadyCharged => "already_charged",
        }
    }

    pub fn body(&self) -> Value {
        match self {
            ChargeOutcome::Charged { counters } => json!({"charged": true, "counters": states(counters)}),
            ChargeOutcome::AlreadyCharged => json!({"charged": false, "reason": "already_charged"}),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]
    use super::*;

    fn reserve(body: &str) -> Result<ReserveRequest, BadRequest> {
        ReserveRequest::parse(body.as_bytes())
    }

    const GOOD: &str = r#"{"id":"r1","tag":"acme","hold_ttl_s":600,"counters":[{"key":"k:a:0:w1","limit":5000,"amount":1234,"expire_at_s":1775001660}]}"#;

    #[test]
    fn a_good_reserve_parses() {
        let r = reserve(GOOD).unwrap();
        assert_eq!((r.id.as_str(), r.tag.as_str(), r.hold_ttl_s, r.counters.len()), ("r1", "acme", 600, 1));
        assert_eq!(r.counters[0].amount, 1234);
    }

    #[test]
    fn bad_reserves_are_refused_with_their_reason() {
        let cases: &[(&str, &str)] = &[
            ("{", "malformed_json"),
            (r#"{"id":"r1","tag":"acme","hold_ttl_s":600}"#, "malformed_json"),
            (&GOOD.replace("1234", "\"1234\""), "malformed_json"),
            (&GOOD.replace("1234", "-1"), "malformed_json"),
            (&GOOD.replace("1234", "1.5"), "malformed_json"),
            (&GOOD.replace("1234", "18446744073709551616"), "malformed_json"),
            (&GOOD.replace("1234", "1e3"), "malformed_json"),
            (&GOOD.replace("1234", "1e300"), "malformed_json"),
            (&GOOD.replace("\"hold_ttl_s\"", "\"extra\":1,\"hold_ttl_s\""), "malformed_json"),
            (&GOOD.replace("1234", "9007199254740993"), "invalid_field"),
            (&GOOD.replace("5000", "9007199254740993"), "invalid_field"),
            (&GOOD.replace("\"r1\"", "\"\""), "invalid_field"),
            (&GOOD.replace("\"r1\"", "\"r\\u0001\""), "invalid_field"),
            (&GOOD.replace("\"acme\"", "\"a}c\""), "invalid_field"),
            (&GOOD.replace("\"acme\"", &format!("\"{}\"", "a".repeat(129))), "invalid_field"),
            (&GOOD.replace("k:a:0:w1", &"k".repeat(257)), "invalid_field"),
            (&GOOD.replace("600", "0"), "invalid_field"),
            (&GOOD.replace("1775001660", "253402300800"), "invalid_field"),
            (r#"{"id":"r1","tag":"acme","hold_ttl_s":600,"counters":[]}"#, "invalid_field"),
        ];
        for (body, code) in cases {
            assert_eq!(reserve(body).err().map(|e| e.code), Some(*code), "{body}");
        }
        // The most that is accepted.
        assert!(reserve(&GOOD.replace("1234", "9007199254740992")).is_ok());
        let dup = r#"{"id":"r1","tag":"acme","hold_ttl_s":600,"counters":[{"key":"k","limit":5,"amount":1,"expire_at_s":1},{"key":"k","limit":5,"amount":1,"expire_at_s":1}]}"#;
        assert_eq!(reserve(dup).err().map(|e| e.code), Some("invalid_field"));
        let counter = r#"{"key":"KEY","limit":5,"amount":1,"expire_at_s":1}"#;
        let many = |n: usize| {
            let list: Vec<String> = (0..n).map(|i| counter.replace("KEY", &format!("k{i}"))).collect();
            format!(r#"{{"id":"r1","tag":"acme","hold_ttl_s":600,"counters":[{}]}}"#, list.join(","))
        };
        assert!(reserve(&many(64)).is_ok());
        assert_eq!(reserve(&many(65)).err().map(|e| e.code), Some("invalid_field"));
    }

    #[test]
    fn settles_are_validated() {
        assert!(SettleRequest::parse(br#"{"id":"r1","tag":"acme","charges":[812, 0]}"#).is_ok());
        for body in [
            r#"{"id":"r1","tag":"acme","charges":[]}"#,
            r#"{"id":"r1","tag":"acme","charges":[9007199254740993]}"#,
            r#"{"id":"r1","tag":"acme","charges":["1"]}"#,
            r#"{"id":"r1","tag":"","charges":[1]}"#,
            r#"{"id":"r1","tag":"acme","charges":[1],"x":1}"#,
            r#"[1]"#,
        ] {
            assert!(SettleRequest::parse(body.as_bytes()).is_err(), "{body}");
        }
    }

    const GOOD_CHARGE: &str = r#"{"id":"c1","tag":"acme","counters":[{"key":"k:a:0:w1","amount":1234,"expire_at_s":1775001660}]}"#;

    #[test]
    fn charges_are_validated_like_reserves() {
        let c = ChargeRequest::parse(GOOD_CHARGE.as_bytes()).unwrap();
        assert_eq!((c.id.as_str(), c.tag.as_str(), c.counters.len(), c.counters[0].amount), ("c1", "acme", 1, 1234));
        assert!(ChargeRequest::parse(GOOD_CHARGE.replace("1234", "9007199254740992").as_bytes()).is_ok());
        let counter = r#"{"key":"KEY","amount":1,"expire_at_s":1}"#;
        let many = |n: usize| {
            let list: Vec<String> = (0..n).map(|i| counter.replace("KEY", &format!("k{i}"))).collect();
            format!(r#"{{"id":"c1","tag":"acme","counters":[{}]}}"#, list.join(","))
        };
        assert!(ChargeRequest::parse(many(64).as_bytes()).is_ok());
        let dup = format!(r#"{{"id":"c1","tag":"acme","counters":[{counter},{counter}]}}"#);
        let cases: &[(&str, &str)] = &[
            ("{", "malformed_json"),
            (&GOOD_CHARGE.replace("\"tag\"", "\"x\":1,\"tag\""), "malformed_json"),
            (&GOOD_CHARGE.replace("\"amount\"", "\"limit\":5,\"amount\""), "malformed_json"),
            (&GOOD_CHARGE.replace("1234", "-1"), "malformed_json"),
            (r#"{"id":"c1","tag":"acme"}"#, "malformed_json"),
            (r#"{"id":"c1","tag":"acme","counters":[]}"#, "invalid_field"),
            (&many(65), "invalid_field"),
            (&dup, "invalid_field"),
            (&GOOD_CHARGE.replace("1234", "9007199254740993"), "invalid_field"),
            (&GOOD_CHARGE.replace("1775001660", "253402300800"), "invalid_field"),
            (&GOOD_CHARGE.replace("\"c1\"", "\"\""), "invalid_field"),
            (&GOOD_CHARGE.replace("\"c1\"", "\"c\\u0001\""), "invalid_field"),
            (&GOOD_CHARGE.replace("\"c1\"", &format!("\"{}\"", "c".repeat(129))), "invalid_field"),
            (&GOOD_CHARGE.replace("\"acme\"", "\"a{c\""), "invalid_field"),
            (&GOOD_CHARGE.replace("k:a:0:w1", ""), "invalid_field"),
        ];
        for (body, code) in cases {
            assert_eq!(ChargeRequest::parse(body.as_bytes()).err().map(|e| e.code), Some(*code), "{body}");
        }
    }

    #[test]
    fn answers_have_the_contract_shape() {
        let a = ReserveOutcome::Admitted { replayed: false, counters: vec![CounterState { used: 10, reserved: 1244 }] };
        assert_eq!(a.body().to_string(), r#"{"admitted":true,"counters":[{"reserved":1244,"used":10}],"replayed":false}"#);
        let r = ReserveOutcome::Refused { index: 0, used: 4900, reserved: 0, limit: 5000 };
        assert_eq!(r.body(), json!({"admitted": false, "refused": 0, "used": 4900, "reserved": 0, "limit": 5000}));
        assert_eq!(SettleOutcome::Expired.body(), json!({"settled": false, "reason": "expired"}));
        let c = ChargeOutcome::Charged { counters: vec![CounterState { used: 5100, reserved: 0 }] };
        assert_eq!(c.body(), json!({"charged": true, "counters": [{"used": 5100, "reserved": 0}]}));
        assert_eq!(ChargeOutcome::AlreadyCharged.body(), json!({"charged": false, "reason": "already_charged"}));
    }
}
