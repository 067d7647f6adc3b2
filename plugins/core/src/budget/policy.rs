//! The tenant-budget policy: who a request belongs to (org → team → key) and which budgets apply at
//! each level. Parsed from JSON once, validated, and compiled into flat tables the hot path indexes.

use super::window::Window;
use crate::price::{PriceEntry, PriceTable};
use crate::vecmap::VecMap;
use serde::Deserialize;
use std::collections::BTreeMap;

/// Policy as written by the operator (Envoy `configuration` / Istio `pluginConfig`). See
/// docs/tenant-budget.md and policies/tenant-budget.schema.json.
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    #[serde(default)]
    pub mode: Mode,
    pub identity: IdentityConfig,
    #[serde(default)]
    pub unknown: UnknownConfig,
    pub orgs: Vec<OrgConfig>,
    #[serde(default)]
    pub prices: Vec<PriceEntry>,
    /// Output limit reserved (and written into the request) when neither the request nor the key sets one.
    #[serde(default = "default_max_output_tokens")]
    pub default_max_output_tokens: u64,
    #[serde(default)]
    pub clamp: ClampConfig,
    /// Add `stream_options.include_usage` to OpenAI streaming requests that lack it (and hide the extra
    /// usage chunk from the client), so streams are charged from reported usage.
    #[serde(default = "yes")]
    pub include_usage: bool,
    /// End a stream with an SSE error event once its charge passes what was reserved plus the room
    /// left in its budgets (only reachable in `estimate` mode).
    #[serde(default)]
    pub cut_off_streams: bool,
    /// How long an unsettled reservation holds budget; must exceed the route timeout.
    #[serde(default = "default_ttl")]
    pub reservation_ttl_minutes: u32,
    /// `estimate` mode: reserve the prompt estimate plus this margin.
    #[serde(default = "default_margin")]
    pub estimate_margin_percent: u32,
    #[serde(default = "default_filter_state_key")]
    pub filter_state_key: String,
    /// Request header carrying the model version label of the charge metrics.
    #[serde(default = "default_model_version_header")]
    pub model_version_header: String,
    /// Model versions that always keep their own label on the charge metrics.
    #[serde(default)]
    pub model_versions: Vec<String>,
    /// How many other distinct model versions get their own label (per VM) before `other`: the
    /// version comes from the request, so it must not mint series without bound.
    #[serde(default = "default_max_dynamic_model_versions")]
    pub max_dynamic_model_versions: usize,
    /// Where the counters live: this Envoy process's shared data (`local`), or Redis through the
    /// `sluice-ledger` service (`redis`), shared by every Envoy of a fleet. See docs/ledger.md.
    #[serde(default)]
    pub ledger: LedgerConfig,
    /// Local ledger: how many distinct identities each `identity_budgets` entry tracks per process
    /// (the Redis ledger has no such bound). See docs/tenant-budget.md, "Per-identity budgets".
    #[serde(default = "default_max_local_identities")]
    pub max_local_identities: u32,
}

/// Where the budget counters live.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LedgerConfig {
    #[serde(default)]
    pub mode: LedgerMode,
    /// Redis mode: the Envoy cluster that reaches `sluice-ledger`.
    #[serde(default)]
    pub cluster: Option<String>,
    /// Redis mode: the `:authority` of the calls.
    #[serde(default = "default_ledger_authority")]
    pub authority: String,
    /// Redis mode: how long admission waits for the ledger before the failure policy applies.
    #[serde(default = "default_ledger_timeout_ms")]
    pub timeout_ms: u32,
    /// Redis mode: what a request gets while the ledger is slow or down.
    #[serde(default)]
    pub on_failure: LedgerFailure,
    /// Redis mode, `on_failure: local`: Envoy processes sharing the budgets; the per-process
    /// fallback ledger allows each one `limit / replicas`.
    #[serde(default = "default_replicas")]
    pub replicas: u32,
}

impl LedgerConfig {
    /// Whether the flows ask the Redis ledger service: Redis mode, in a build with feature
    /// `ledger-service` (without it the compiler leaves the service's code out).
    pub fn uses_service(&self) -> bool {
        cfg!(feature = "ledger-service") && self.mode == LedgerMode::Redis
    }
}

impl Default for LedgerConfig {
    fn default() -> Self {
        LedgerConfig {
            mode: LedgerMode::Local,
            cluster: None,
            authority: default_ledger_authority(),
            timeout_ms: default_ledger_timeout_ms(),
            on_failure: LedgerFailure::Deny,
            replicas: default_replicas(),
        }
    }
}

#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "schema", serde(rename_all = "snake_case"))]
pub enum LedgerMode {
    /// This Envoy process's shared data (every worker; not other replicas).
    #[default]
    Local,
    /// Redis through `sluice-ledger`.
    Redis,
}

crate::json::unit_enum_deserialize!(LedgerMode {
    Local = "local",
    Redis = "redis",
});

/// What the Redis ledger's failure (timeout, error, unreachable) means for a request.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "schema", serde(rename_all = "snake_case"))]
pub enum LedgerFailure {
    /// 503 in the API's error shape, `retry-after: 1`.
    #[default]
    Deny,
    /// Admitted without a reservation (and not charged).
    Allow,
    /// The per-process ledger, each limit divided by `replicas`.
    Local,
}

crate::json::unit_enum_deserialize!(LedgerFailure {
    Deny = "deny",
    Allow = "allow",
    Local = "local",
});

/// How the prompt side of a reservation is sized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schema", serde(rename_all = "snake_case"))]
pub enum Mode {
    /// Reserve a true upper bound: the request body's size in bytes (no tokenizer emits more tokens
    /// than the bytes of the text it encodes plus the JSON framing around each message). Zero overshoot.
    #[default]
    Strict,
    /// Reserve the calibrated estimate (≈ 4 characters a token) plus `estimate_margin_percent`;
    /// overshoot is bounded by the estimate's error.
    Estimate,
}

crate::json::unit_enum_deserialize!(Mode {
    Strict = "strict",
    Estimate = "estimate",
});

#[derive(Debug, Deserialize, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct IdentityConfig {
    /// Look up `Authorization: Bearer <key>` / `x-api-key` by SHA-256 in `keys[].api_key_sha256`.
    #[serde(default)]
    pub api_key: bool,
    /// A header written by an authentication filter in front of sluice, naming the key id.
    #[serde(default)]
    pub header: Option<String>,
    /// A claim of the JWT payload that Envoy's jwt_authn filter verified and forwards.
    #[serde(default)]
    pub jwt: Option<JwtConfig>,
    /// Who a request is *within* its key, for `identity_budgets`: the first source present names
    /// the identity (an API key's hash, a header set by a trusted auth filter, a verified JWT
    /// claim such as `sub`). Requests without one share the identity `anonymous`.
    #[serde(default)]
    pub per_identity: Option<PerIdentityConfig>,
}

/// Sources of the per-identity name, tried in this order.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct PerIdentityConfig {
    /// The SHA-256 of `Authorization: Bearer <key>` / `x-api-key`.
    #[serde(default)]
    pub api_key: bool,
    /// A header written by an authentication filter in front of sluice.
    #[serde(default)]
    pub header: Option<String>,
    /// A claim of the payload Envoy's jwt_authn verified and forwards.
    #[serde(default)]
    pub jwt: Option<JwtConfig>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct JwtConfig {
    /// jwt_authn's `forward_payload_header`.
    pub header: String,
    /// Claim (dot path) naming the key id.
    pub claim: String,
}

/// What to do with a request whose key is not in the policy: `{"action": "reject"}` or
/// `{"action": "default", "key": …}`. Read as serde's internally tagged derive
/// (`tag = "action"`, `deny_unknown_fields`) read it, by hand (`tagged`).
#[derive(Debug, Default, Clone, PartialEq)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schema", serde(tag = "action", rename_all = "snake_case", deny_unknown_fields))]
pub enum UnknownConfig {
    #[default]
    Reject,
    /// Charge it to this key of the policy.
    Default { key: String },
}

/// [`UnknownConfig`]'s deserializer. serde's derive of an internally tagged enum buffers the value
/// in its private `Content` type, whose deserializer was 12 KB of the playground's page; this one
/// buffers what the two variants need and keeps the derive's order of reading, so every form it
/// accepted (keys in any order, a sequence `["default", "key"]`, members a `reject` ignores) still
/// is, and every refusal is the same words found at the same place (the checks after the value
/// is read, as the derive's were, so serde_json dates them where it did): tests/unknown_config.rs.
mod tagged {
    use super::UnknownConfig;
    use serde::de::{Deserialize, DeserializeSeed, Deserializer, Error, MapAccess, SeqAccess, Unexpected, Visitor};
    use std::fmt;

    /// The tag's value: a variant's name (the derive's variant identifier).
    enum Action {
        Reject,
        Default,
    }

    const VARIANTS: &[&str] = &["reject", "default"];

    impl<'de> Deserialize<'de> for Action {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            // The unit enums' reader of a variant's name or index (an index of VARIANTS), with the
            // derive's words.
            match crate::json::VariantName(VARIANTS).deserialize(d)? {
                0 => Ok(Action::Reject),
                _ => Ok(Action::Default),
            }
        }
    }

    /// A value besides the tag: a string kept, anything else only what a refusal says of it
    /// (nested members and elements are read, as `Content` read them, and dropped).
    enum Val {
        Str(String),
        Bool(bool),
        Unsigned(u64),
        Signed(i64),
        Float(f64),
        Unit,
        Seq,
        Map,
    }

    impl Val {
        fn unexpected(&self) -> Unexpected<'_> {
            match self {
                Val::Str(s) => Unexpected::Str(s),
                Val::Bool(b) => Unexpected::Bool(*b),
                Val::Unsigned(n) => Unexpected::Unsigned(*n),
                Val::Signed(n) => Unexpected::Signed(*n),
                Val::Float(n) => Unexpected::Float(*n),
                Val::Unit => Unexpected::Unit,
                Val::Seq => Unexpected::Seq,
                Val::Map => Unexpected::Map,
            }
        }

        /// The `String` the derive asked for, or its refusal.
        fn string<E: Error>(self) -> Result<String, E> {
            match self {
                Val::Str(s) => Ok(s),
                other => Err(E::invalid_type(other.unexpected(), &"a string")),
            }
        }
    }

    /// The members or elements besides the tag, in the order written.
    enum Rest {
        Map(Vec<(String, Val)>),
        Seq(Vec<Val>),
    }

    /// What [`Reader`] read: the member (its tag and the rest), or a value inside it.
    enum Read {
        Tagged(Action, Rest),
        Val(Val),
    }

    /// The visitor of the member (`top`) and of every value inside it: one instance of the
    /// deserializer's `deserialize_any` for both.
    #[derive(Clone, Copy)]
    struct Reader {
        top: bool,
    }

    impl Reader {
        /// A scalar: a value inside the member, or the member's refusal (as the derive's visitor,
        /// which took only a map or a sequence).
        fn leaf<E: Error>(self, v: Val) -> Result<Read, E> {
            if self.top {
                Err(E::invalid_type(v.unexpected(), &self))
            } else {
                Ok(Read::Val(v))
            }
        }

        fn val<E: Error>(read: Read) -> Result<Val, E> {
            match read {
                Read::Val(v) => Ok(v),
                // Only the member itself reads as tagged.
                Read::Tagged(..) => Err(E::custom("a tagged value inside `unknown`")),
            }
        }
    }

    impl<'de> DeserializeSeed<'de> for Reader {
        type Value = Read;

        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Read, D::Error> {
            d.deserialize_any(self)
        }
    }

    impl<'de> Visitor<'de> for Reader {
        type Value = Read;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str(if self.top { "internally tagged enum UnknownConfig" } else { "any value" })
        }

        fn visit_bool<E: Error>(self, v: bool) -> Result<Read, E> {
            self.leaf(Val::Bool(v))
        }

        fn visit_u64<E: Error>(self, v: u64) -> Result<Read, E> {
            self.leaf(Val::Unsigned(v))
        }

        fn visit_i64<E: Error>(self, v: i64) -> Result<Read, E> {
            self.leaf(Val::Signed(v))
        }

        fn visit_f64<E: Error>(self, v: f64) -> Result<Read, E> {
            self.leaf(Val::Float(v))
        }

        fn visit_str<E: Error>(self, v: &str) -> Result<Read, E> {
            self.leaf(Val::Str(v.to_owned()))
        }

        fn visit_unit<E: Error>(self) -> Result<Read, E> {
            self.leaf(Val::Unit)
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Read, A::Error> {
            let inner = Reader { top: false };
            if !self.top {
                // Each element through this visitor again: nesting is bounded by serde_json's
                // recursion limit, as it was for `Content`.
                while seq.next_element_seed(inner)?.is_some() {}
                return Ok(Read::Val(Val::Seq));
            }
            let Some(action) = seq.next_element::<Action>()? else {
                return Err(A::Error::missing_field("action"));
            };
            let mut rest = Vec::new();
            while let Some(v) = seq.next_element_seed(inner)? {
                rest.push(Self::val(v)?);
            }
            Ok(Read::Tagged(action, Rest::Seq(rest)))
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Read, A::Error> {
            let inner = Reader { top: false };
            if !self.top {
                while map.next_entry_seed(inner, inner)?.is_some() {}
                return Ok(Read::Val(Val::Map));
            }
            let mut action = None;
            let mut rest = Vec::new();
            while let Some(key) = map.next_key::<String>()? {
                if key == "action" {
                    if action.is_some() {
                        return Err(A::Error::duplicate_field("action"));
                    }
                    action = Some(map.next_value::<Action>()?);
                } else {
                    let value = Self::val(map.next_value_seed(inner)?)?;
                    rest.push((key, value));
                }
            }
            match action {
                Some(action) => Ok(Read::Tagged(action, Rest::Map(rest))),
                None => Err(A::Error::missing_field("action")),
            }
        }
    }

    impl<'de> Deserialize<'de> for UnknownConfig {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            let (action, rest) = match d.deserialize_any(Reader { top: true })? {
                Read::Tagged(action, rest) => (action, rest),
                // The member's reader refuses every value that is not a map or a sequence.
                Read::Val(v) => return Err(D::Error::invalid_type(v.unexpected(), &"internally tagged enum UnknownConfig")),
            };
            // Decided once the value is read, as the derive decided on its buffered `Content`.
            match (action, rest) {
                // A unit variant read from a map ignored the other members.
                (Action::Reject, Rest::Map(_)) => Ok(UnknownConfig::Reject),
                (Action::Reject, Rest::Seq(rest)) if rest.is_empty() => Ok(UnknownConfig::Reject),
                (Action::Reject, Rest::Seq(rest)) => Err(D::Error::invalid_length(rest.len(), &"0 elements in sequence")),
                (Action::Default, Rest::Seq(rest)) => {
                    let count = rest.len();
                    let Some(first) = rest.into_iter().next() else {
                        return Err(D::Error::invalid_length(0, &"struct variant UnknownConfig::Default with 1 element"));
                    };
                    let key = first.string()?;
                    if count > 1 {
                        return Err(D::Error::invalid_length(count, &"1 element in sequence"));
                    }
                    Ok(UnknownConfig::Default { key })
                }
                (Action::Default, Rest::Map(members)) => {
                    let mut key = None;
                    for (name, value) in members {
                        if name != "key" {
                            return Err(D::Error::unknown_field(&name, &["key"]));
                        }
                        if key.is_some() {
                            return Err(D::Error::duplicate_field("key"));
                        }
                        key = Some(value.string()?);
                    }
                    key.map(|key| UnknownConfig::Default { key }).ok_or_else(|| D::Error::missing_field("key"))
                }
            }
        }
    }
}

#[derive(Debug, Deserialize, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ClampConfig {
    /// Lower the request's output limit to what the budget can still pay for, instead of rejecting.
    #[serde(default)]
    pub enabled: bool,
    /// Never clamp below this; reject instead.
    #[serde(default = "default_min_output")]
    pub min_output_tokens: u64,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct OrgConfig {
    pub id: String,
    #[serde(default)]
    pub budgets: Vec<BudgetConfig>,
    /// Budgets every distinct identity (see `identity.per_identity`) under this level gets on its
    /// own, without listing identities.
    #[serde(default)]
    pub identity_budgets: Vec<BudgetConfig>,
    #[serde(default)]
    pub teams: Vec<TeamConfig>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct TeamConfig {
    pub id: String,
    #[serde(default)]
    pub budgets: Vec<BudgetConfig>,
    /// Budgets every distinct identity (see `identity.per_identity`) under this level gets on its
    /// own, without listing identities.
    #[serde(default)]
    pub identity_budgets: Vec<BudgetConfig>,
    #[serde(default)]
    pub keys: Vec<KeyConfig>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct KeyConfig {
    pub id: String,
    #[serde(default)]
    pub api_key_sha256: Option<String>,
    #[serde(default)]
    pub budgets: Vec<BudgetConfig>,
    /// Budgets every distinct identity using this key gets on its own.
    #[serde(default)]
    pub identity_budgets: Vec<BudgetConfig>,
    /// Ceiling on any request's output limit for this key.
    #[serde(default)]
    pub max_output_tokens: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schema", serde(rename_all = "snake_case"))]
pub enum WindowName {
    Minute,
    Hour,
    Day,
    Month,
}

crate::json::unit_enum_deserialize!(WindowName {
    Minute = "minute",
    Hour = "hour",
    Day = "day",
    Month = "month",
});

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schema", serde(rename_all = "snake_case"))]
pub enum Count {
    #[default]
    Total,
    Input,
    Output,
}

crate::json::unit_enum_deserialize!(Count {
    Total = "total",
    Input = "input",
    Output = "output",
});

/// One budget: a window and exactly one of `tokens`, `requests`, `usd`.
#[derive(Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct BudgetConfig {
    pub window: WindowName,
    /// Month windows: the day of the month (1–28) the budget resets, 00:00 UTC.
    #[serde(default)]
    pub reset_day: Option<u8>,
    #[serde(default)]
    pub tokens: Option<u64>,
    /// Which tokens a `tokens` budget counts (default: input + output).
    #[serde(default)]
    pub count: Option<Count>,
    /// Weights for a `tokens` budget (override `count`): charge = input × w_in + output × w_out.
    #[serde(default)]
    pub input_weight: Option<u64>,
    #[serde(default)]
    pub output_weight: Option<u64>,
    #[serde(default)]
    pub requests: Option<u64>,
    #[serde(default)]
    pub usd: Option<f64>,
    /// Announce (header, metric, log) once usage in the window passes this percent of the limit.
    #[serde(default)]
    pub soft_limit_percent: Option<u8>,
}

fn yes() -> bool {
    true
}
fn default_max_output_tokens() -> u64 {
    4096
}
fn default_ttl() -> u32 {
    10
}
fn default_margin() -> u32 {
    10
}
fn default_min_output() -> u64 {
    16
}
fn default_filter_state_key() -> String {
    "sluice_budget".into()
}
fn default_model_version_header() -> String {
    "x-model-version".into()
}
fn default_max_dynamic_model_versions() -> usize {
    8
}
fn default_max_local_identities() -> u32 {
    4096
}
fn default_ledger_authority() -> String {
    "sluice-ledger".into()
}
fn default_ledger_timeout_ms() -> u32 {
    250
}
fn default_replicas() -> u32 {
    1
}
/// Most dynamic model-version labels accepted: each one multiplies the charge series by the keys.
const MAX_DYNAMIC_MODEL_VERSIONS: usize = 256;

/// A compiled policy.
#[derive(Debug)]
pub struct Policy {
    pub mode: Mode,
    pub identity: IdentityConfig,
    pub unknown_default: Option<usize>,
    pub keys: Vec<KeyNode>,
    pub counters: Vec<CounterSpec>,
    pub prices: PriceTable,
    pub default_max_output_tokens: u64,
    pub clamp: ClampConfig,
    pub include_usage: bool,
    pub cut_off_streams: bool,
    pub reservation_ttl_minutes: u32,
    pub estimate_margin_percent: u32,
    pub filter_state_key: String,
    pub model_version_header: String,
    pub model_versions: Vec<String>,
    pub max_dynamic_model_versions: usize,
    pub ledger: LedgerConfig,
    pub max_local_identities: u32,
    key_by_id: BTreeMap<String, usize>,
    key_by_hash: BTreeMap<String, usize>,
}

/// A key and the counters it must fit, org first.
#[derive(Debug, Clone)]
pub struct KeyNode {
    pub id: String,
    pub team: String,
    pub org: String,
    pub counters: Vec<usize>,
    pub max_output_tokens: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Org,
    Team,
    Key,
}

impl Level {
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Org => "org",
            Level::Team => "team",
            Level::Key => "key",
        }
    }
}

/// What a budget counts and up to how much, in integers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Tokens { limit: u64, input_weight: u64, output_weight: u64 },
    Requests(u64),
    MicroUsd(u64),
}

impl Limit {
    pub fn value(&self) -> u64 {
        match self {
            Limit::Tokens { limit, .. } | Limit::Requests(limit) | Limit::MicroUsd(limit) => *limit,
        }
    }

    /// The family of the `x-ratelimit-*-<unit>` headers: `tokens`, `requests` or `micro_usd`.
    pub fn unit(&self) -> &'static str {
        match self {
            Limit::Tokens { .. } => "tokens",
            Limit::Requests(_) => "requests",
            Limit::MicroUsd(_) => "micro_usd",
        }
    }

    /// What the budget counts, precisely enough that two budgets of one owner and window never
    /// share a name: `total_tokens`, `input_tokens`, `output_tokens`, `weighted_tokens`,
    /// `requests`, `micro_usd`. It is the `unit` label of the budget's metrics and the last part
    /// of its code.
    pub fn measure(&self) -> &'static str {
        match self {
            Limit::Tokens { input_weight: 1, output_weight: 1, .. } => "total_tokens",
            Limit::Tokens { input_weight: 1, output_weight: 0, .. } => "input_tokens",
            Limit::Tokens { input_weight: 0, output_weight: 1, .. } => "output_tokens",
            Limit::Tokens { .. } => "weighted_tokens",
            Limit::Requests(_) => "requests",
            Limit::MicroUsd(_) => "micro_usd",
        }
    }

    /// What the budget counts, as part of a counter's name: [`Limit::measure`], and for a weighted
    /// tokens budget its weights too (`weighted_tokens_in1_out4`): budgets weighted differently
    /// count different amounts. The limit is not part of it: a budget whose limit changes keeps its
    /// count.
    pub fn key_part(&self) -> String {
        match self {
            Limit::Tokens { input_weight, output_weight, .. } if self.measure() == "weighted_tokens" => {
                format!("weighted_tokens_in{input_weight}_out{output_weight}")
            }
            other => other.measure().to_string(),
        }
    }

    /// The amount one request of `input`/`output` tokens costing `cost_micro_usd` takes from this budget.
    pub fn amount(&self, input: u64, output: u64, cost_micro_usd: u64) -> u64 {
        match self {
            Limit::Tokens { input_weight, output_weight, .. } => input.saturating_mul(*input_weight).saturating_add(output.saturating_mul(*output_weight)),
            Limit::Requests(_) => 1,
            Limit::MicroUsd(_) => cost_micro_usd,
        }
    }
}

/// The first part of every counter key in Envoy's shared data.
pub const STORE_PREFIX: &str = "sluice/tenant-budget/";

/// The name of a budget's counter, from what it counts and nothing else: its scope (level and
/// owner, and whether it is an `identity_budgets` template), its measure and its window, joined by
/// `sep`: `key<sep>k2<sep>month_day1<sep>requests`. Not its position under its owner, so a budget
/// that is unchanged keeps its counter however the budgets around it are added, removed or
/// reordered, and a budget whose measure or window changes starts a new one from zero (the old one
/// counted something else). Two budgets of one owner never share a name: their codes already differ
/// in window or measure. Every part is letters, digits, `_` or `-` (owner ids are checked at
/// compile), so no separator, `#` or brace appears inside one; the longest (a 64-byte team id, both weights
/// at their maximum, per identity) is 157 bytes, so its Redis key stays under the ledger's 256.
pub fn counter_name(level: Level, owner: &str, window: &Window, limit: &Limit, per_identity: bool, sep: char) -> String {
    let mut buf = [0u8; 4];
    let sep: &str = sep.encode_utf8(&mut buf);
    let mut name = crate::text::join(&[level.as_str(), sep, owner, sep, &window.key_part(), sep, &limit.key_part()]);
    if per_identity {
        name.push_str(sep);
        name.push_str("per_identity");
    }
    name
}

/// One budget of one level: a counter in the shared store.
#[derive(Debug, Clone)]
pub struct CounterSpec {
    /// Shared-data key: [`STORE_PREFIX`] and the [`counter_name`] joined by `/`, e.g.
    /// `sluice/tenant-budget/key/k2/month_day1/requests`.
    pub store_key: String,
    /// The Redis ledger's name of the counter, without its window ([`counter_name`] joined by `:`),
    /// made once here rather than for every request.
    pub remote_name: String,
    pub level: Level,
    pub owner: String,
    pub window: Window,
    pub limit: Limit,
    /// Absolute soft limit, if configured.
    pub soft_limit: Option<u64>,
    /// Stable name of the budget for errors and metrics: `team:search:minute:total_tokens`.
    pub code: String,
    /// A template applied to every identity on its own (`identity_budgets`): the counter is
    /// `store_key#<identity hash>` locally, one Redis key per identity in Redis mode.
    pub per_identity: bool,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PolicyError {
    #[error("tenant-budget policy is not valid JSON: {0}")]
    Json(String),
    #[error("{field}: {problem}")]
    Invalid { field: String, problem: String },
}

fn invalid(field: impl Into<String>, problem: impl Into<String>) -> PolicyError {
    PolicyError::Invalid { field: field.into(), problem: problem.into() }
}

/// Identifiers become parts of metric names and store keys.
fn check_id(field: &str, id: &str) -> Result<(), PolicyError> {
    if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
        return Err(invalid(field, format!("must be 1–64 letters, digits, '-' or '_', got {id:?}")));
    }
    Ok(())
}

/// Largest money budget accepted: $1e9.
const MAX_USD: f64 = 1e9;

impl Policy {
    pub fn from_json(bytes: &[u8]) -> Result<Policy, PolicyError> {
        let config: PolicyConfig = crate::json::parse_config(bytes).map_err(PolicyError::Json)?;
        Policy::compile(config)
    }

    pub fn compile(c: PolicyConfig) -> Result<Policy, PolicyError> {
        if !c.identity.api_key && c.identity.header.is_none() && c.identity.jwt.is_none() {
            return Err(invalid("identity", "name at least one source: api_key, header or jwt"));
        }
        if let Some(h) = &c.identity.header {
            if h.is_empty() {
                return Err(invalid("identity.header", "must not be empty"));
            }
        }
        if let Some(j) = &c.identity.jwt {
            if j.header.is_empty() || j.claim.is_empty() {
                return Err(invalid("identity.jwt", "header and claim must not be empty"));
            }
        }
        if c.cut_off_streams {
            // Refused rather than ignored: an operator who asks for it must not believe it is on.
            return Err(invalid(
                "cut_off_streams",
                "not supported yet: a proxy-wasm filter in Envoy 1.40 cannot end a response it has started cleanly; in strict mode a stream cannot pass its reservation anyway",
            ));
        }
        if !(1..=60).contains(&c.reservation_ttl_minutes) {
            return Err(invalid("reservation_ttl_minutes", format!("must be 1–60, got {}", c.reservation_ttl_minutes)));
        }
        if c.default_max_output_tokens == 0 {
            return Err(invalid("default_max_output_tokens", "must be at least 1"));
        }
        if c.estimate_margin_percent > 1000 {
            return Err(invalid("estimate_margin_percent", format!("at most 1000, got {}", c.estimate_margin_percent)));
        }
        let prices = PriceTable::new(c.prices).map_err(|e| invalid("prices", e.to_string()))?;
        if c.orgs.is_empty() {
            return Err(invalid("orgs", "must list at least one org"));
        }

        let mut counters = Vec::new();
        let mut keys = Vec::new();
        let mut key_by_id = BTreeMap::new();
        let mut key_by_hash = BTreeMap::new();
        let mut seen_levels: VecMap<String, String> = VecMap::new();
        for (oi, org) in c.orgs.iter().enumerate() {
            let of = format!("orgs[{oi}]");
            check_id(&format!("{of}.id"), &org.id)?;
            unique(&mut seen_levels, format!("org:{}", org.id), &of)?;
            let mut org_counters = compile_budgets(&mut counters, &org.budgets, Level::Org, &org.id, &of, false)?;
            org_counters.extend(compile_budgets(&mut counters, &org.identity_budgets, Level::Org, &org.id, &of, true)?);
            for (ti, team) in org.teams.iter().enumerate() {
                let tf = format!("{of}.teams[{ti}]");
                check_id(&format!("{tf}.id"), &team.id)?;
                unique(&mut seen_levels, format!("team:{}", team.id), &tf)?;
                let mut team_counters = compile_budgets(&mut counters, &team.budgets, Level::Team, &team.id, &tf, false)?;
                team_counters.extend(compile_budgets(&mut counters, &team.identity_budgets, Level::Team, &team.id, &tf, true)?);
                for (ki, key) in team.keys.iter().enumerate() {
                    let kf = format!("{tf}.keys[{ki}]");
                    check_id(&format!("{kf}.id"), &key.id)?;
                    if key_by_id.contains_key(&key.id) {
                        return Err(invalid(format!("{kf}.id"), format!("key {:?} is defined twice", key.id)));
                    }
                    let mut own = compile_budgets(&mut counters, &key.budgets, Level::Key, &key.id, &kf, false)?;
                    own.extend(compile_budgets(&mut counters, &key.identity_budgets, Level::Key, &key.id, &kf, true)?);
                    if let Some(hash) = &key.api_key_sha256 {
                        let hash = hash.to_ascii_lowercase();
                        if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
                            return Err(invalid(format!("{kf}.api_key_sha256"), "must be 64 hex digits (the SHA-256 of the key)"));
                        }
                        if key_by_hash.insert(hash, keys.len()).is_some() {
                            return Err(invalid(format!("{kf}.api_key_sha256"), "the same API key hash is used by two keys"));
                        }
                    }
                    if key.max_output_tokens == Some(0) {
                        return Err(invalid(format!("{kf}.max_output_tokens"), "must be at least 1"));
                    }
                    key_by_id.insert(key.id.clone(), keys.len());
                    keys.push(KeyNode {
                        id: key.id.clone(),
                        team: team.id.clone(),
                        org: org.id.clone(),
                        counters: org_counters.iter().chain(&team_counters).chain(&own).copied().collect(),
                        max_output_tokens: key.max_output_tokens,
                    });
                }
            }
        }
        if keys.is_empty() {
            return Err(invalid("orgs", "no keys defined: budgets apply to requests through their key"));
        }
        let unknown_default = match &c.unknown {
            UnknownConfig::Reject => None,
            UnknownConfig::Default { key } => Some(*key_by_id.get(key).ok_or_else(|| invalid("unknown.key", format!("{key:?} is not a key of the policy")))?),
        };
        if c.filter_state_key.is_empty() || !c.filter_state_key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.') {
            return Err(invalid("filter_state_key", format!("must be letters, digits, '_' or '.', got {:?}", c.filter_state_key)));
        }
        if counters.iter().any(|c| c.per_identity) && c.identity.per_identity.is_none() {
            return Err(invalid(
                "identity.per_identity",
                "identity_budgets are configured: name where a request's identity comes from (api_key, header or jwt)",
            ));
        }
        if let Some(p) = &c.identity.per_identity {
            if !p.api_key && p.header.as_deref().is_none_or(str::is_empty) && p.jwt.is_none() {
                return Err(invalid("identity.per_identity", "name at least one source: api_key, header or jwt"));
            }
            if p.jwt.as_ref().is_some_and(|j| j.header.is_empty() || j.claim.is_empty()) {
                return Err(invalid("identity.per_identity.jwt", "header and claim must not be empty"));
            }
        }
        if !(64..=1_000_000).contains(&c.max_local_identities) {
            return Err(invalid("max_local_identities", format!("must be 64–1000000, got {}", c.max_local_identities)));
        }
        if c.ledger.mode == LedgerMode::Redis {
            let cluster_ok = c.ledger.cluster.as_deref().is_some_and(|n| !n.is_empty() && n.len() <= 128 && !n.chars().any(char::is_control));
            if !cluster_ok {
                return Err(invalid("ledger.cluster", "redis mode needs the name of the Envoy cluster that reaches sluice-ledger"));
            }
            if c.ledger.authority.is_empty() || c.ledger.authority.chars().any(|ch| ch.is_control() || ch == ' ') {
                return Err(invalid("ledger.authority", format!("must be a host name, got {:?}", c.ledger.authority)));
            }
        }
        if c.ledger.mode == LedgerMode::Redis {
            if let Some(big) = counters.iter().find(|spec| spec.limit.value() >= super::remote::MAX_EXACT) {
                return Err(invalid(
                    "ledger.mode",
                    format!("the Redis ledger counts exactly up to 2^53; budget {} has a limit of {}", big.code, big.limit.value()),
                ));
            }
        }
        if !(1..=60_000).contains(&c.ledger.timeout_ms) {
            return Err(invalid("ledger.timeout_ms", format!("must be 1–60000, got {}", c.ledger.timeout_ms)));
        }
        if !(1..=10_000).contains(&c.ledger.replicas) {
            return Err(invalid("ledger.replicas", format!("must be 1–10000, got {}", c.ledger.replicas)));
        }
        if c.max_dynamic_model_versions > MAX_DYNAMIC_MODEL_VERSIONS {
            return Err(invalid("max_dynamic_model_versions", format!("at most {MAX_DYNAMIC_MODEL_VERSIONS}, got {}", c.max_dynamic_model_versions)));
        }
        Ok(Policy {
            mode: c.mode,
            identity: c.identity,
            unknown_default,
            keys,
            counters,
            prices,
            default_max_output_tokens: c.default_max_output_tokens,
            clamp: c.clamp,
            include_usage: c.include_usage,
            cut_off_streams: c.cut_off_streams,
            reservation_ttl_minutes: c.reservation_ttl_minutes,
            estimate_margin_percent: c.estimate_margin_percent,
            filter_state_key: c.filter_state_key,
            model_version_header: c.model_version_header.to_ascii_lowercase(),
            model_versions: c.model_versions,
            max_dynamic_model_versions: c.max_dynamic_model_versions,
            ledger: c.ledger,
            max_local_identities: c.max_local_identities,
            key_by_id,
            key_by_hash,
        })
    }

    pub fn key_by_id(&self, id: &str) -> Option<usize> {
        self.key_by_id.get(id).copied()
    }

    /// Key whose `api_key_sha256` is `hash_hex` (lowercase hex).
    pub fn key_by_api_key_hash(&self, hash_hex: &str) -> Option<usize> {
        self.key_by_hash.get(hash_hex).copied()
    }
}

/// `seen` and the budget codes of [`compile_budgets`] are [`VecMap`]s (orgs and teams, one owner's
/// budgets: not many): one B-tree instantiation less in the playground's page.
fn unique(seen: &mut VecMap<String, String>, name: String, field: &str) -> Result<(), PolicyError> {
    if let Some(first) = seen.insert(name.clone(), field.to_string()) {
        return Err(invalid(format!("{field}.id"), format!("{name} is already defined at {first}")));
    }
    Ok(())
}

fn compile_budgets(
    counters: &mut Vec<CounterSpec>,
    budgets: &[BudgetConfig],
    level: Level,
    owner: &str,
    field: &str,
    per_identity: bool,
) -> Result<Vec<usize>, PolicyError> {
    let mut out = Vec::with_capacity(budgets.len());
    let mut codes: VecMap<String, String> = VecMap::new();
    for (bi, b) in budgets.iter().enumerate() {
        let bf = format!("{field}.{}[{bi}]", if per_identity { "identity_budgets" } else { "budgets" });
        let window = match (b.window, b.reset_day) {
            (WindowName::Month, day) => {
                let day = day.unwrap_or(1);
                if !(1..=28).contains(&day) {
                    return Err(invalid(format!("{bf}.reset_day"), format!("must be 1–28 (a day every month has), got {day}")));
                }
                Window::Month { reset_day: day }
            }
            (_, Some(_)) => return Err(invalid(format!("{bf}.reset_day"), "only month windows have a reset day")),
            (WindowName::Minute, None) => Window::Minute,
            (WindowName::Hour, None) => Window::Hour,
            (WindowName::Day, None) => Window::Day,
        };
        let limit = match (b.tokens, b.requests, b.usd) {
            (Some(tokens), None, None) => {
                let (w_in, w_out) = match (b.input_weight, b.output_weight, b.count) {
                    (None, None, count) => match count.unwrap_or_default() {
                        Count::Total => (1, 1),
                        Count::Input => (1, 0),
                        Count::Output => (0, 1),
                    },
                    (w_in, w_out, None) => (w_in.unwrap_or(0), w_out.unwrap_or(0)),
                    (_, _, Some(_)) => return Err(invalid(&bf, "give either count or input_weight/output_weight, not both")),
                };
                if w_in == 0 && w_out == 0 {
                    return Err(invalid(&bf, "weights must not both be 0"));
                }
                Limit::Tokens { limit: tokens, input_weight: w_in, output_weight: w_out }
            }
            (None, Some(requests), None) => Limit::Requests(requests),
            (None, None, Some(usd)) => {
                if !usd.is_finite() || !(0.0..=MAX_USD).contains(&usd) {
                    return Err(invalid(format!("{bf}.usd"), format!("must be a finite amount 0–{MAX_USD}, got {usd}")));
                }
                // Integer micro-USD from here on.
                Limit::MicroUsd((usd * 1_000_000.0).round() as u64)
            }
            _ => return Err(invalid(&bf, "set exactly one of tokens, requests, usd")),
        };
        if !matches!(limit, Limit::Tokens { .. }) && (b.count.is_some() || b.input_weight.is_some() || b.output_weight.is_some()) {
            return Err(invalid(&bf, "count and weights apply to tokens budgets only"));
        }
        let soft_limit = match b.soft_limit_percent {
            None => None,
            Some(p) if (1..=100).contains(&p) => Some(limit.value().saturating_mul(u64::from(p)) / 100),
            Some(p) => return Err(invalid(format!("{bf}.soft_limit_percent"), format!("must be 1–100, got {p}"))),
        };
        let code = format!("{}:{owner}:{}:{}{}", level.as_str(), window.as_str(), limit.measure(), if per_identity { ":per_identity" } else { "" });
        if let Some(first) = codes.insert(code.clone(), bf.clone()) {
            // One of the two never binds (the lower limit always refuses first), or they differ only
            // in weights or reset day; either way metrics and refusals could not tell them apart.
            return Err(invalid(
                &bf,
                format!("{owner} already has a {} budget counting {} ({first}); keep one per window and measure", window.as_str(), limit.measure()),
            ));
        }
        let index = counters.len();
        counters.push(CounterSpec {
            store_key: format!("{STORE_PREFIX}{}", counter_name(level, owner, &window, &limit, per_identity, '/')),
            remote_name: counter_name(level, owner, &window, &limit, per_identity, ':'),
            level,
            owner: owner.to_string(),
            window,
            limit,
            soft_limit,
            code,
            per_identity,
        });
        out.push(index);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compile(key_budgets: serde_json::Value) -> Policy {
        let policy = serde_json::json!({
            "identity": {"header": "x-key"},
            "orgs": [{"id": "o", "teams": [{"id": "t", "keys": [{"id": "k2", "budgets": key_budgets}]}]}]
        });
        Policy::from_json(policy.to_string().as_bytes()).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The store key of the budget of `policy` whose code is `code`.
    fn key_of(policy: &Policy, code: &str) -> String {
        policy.counters.iter().find(|c| c.code == code).map(|c| c.store_key.clone()).unwrap_or_else(|| panic!("no budget {code}"))
    }

    #[test]
    fn a_counter_is_named_by_scope_measure_and_window() {
        let p = compile(serde_json::json!([
            {"window": "month", "requests": 10},
            {"window": "minute", "tokens": 500},
            {"window": "day", "tokens": 9, "input_weight": 1, "output_weight": 4},
            {"window": "hour", "usd": 2.5}
        ]));
        let keys: Vec<&str> = p.counters.iter().map(|c| c.store_key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "sluice/tenant-budget/key/k2/month_day1/requests",
                "sluice/tenant-budget/key/k2/minute/total_tokens",
                "sluice/tenant-budget/key/k2/day/weighted_tokens_in1_out4",
                "sluice/tenant-budget/key/k2/hour/micro_usd",
            ]
        );
        let tokens = Limit::Tokens { limit: 1, input_weight: 1, output_weight: 1 };
        assert_eq!(counter_name(Level::Team, "t", &Window::Month { reset_day: 15 }, &tokens, true, ':'), "team:t:month_day15:total_tokens:per_identity");
    }

    #[test]
    fn a_changed_measure_or_window_names_a_new_counter() {
        let before = key_of(&compile(serde_json::json!([{"window": "month", "tokens": 1_000_000}])), "key:k2:month:total_tokens");
        let changes = [
            (serde_json::json!([{"window": "month", "requests": 10}]), "key:k2:month:requests"),
            (serde_json::json!([{"window": "month", "usd": 10}]), "key:k2:month:micro_usd"),
            (serde_json::json!([{"window": "month", "tokens": 1_000_000, "count": "output"}]), "key:k2:month:output_tokens"),
            (serde_json::json!([{"window": "day", "tokens": 1_000_000}]), "key:k2:day:total_tokens"),
            (serde_json::json!([{"window": "month", "reset_day": 15, "tokens": 1_000_000}]), "key:k2:month:total_tokens"),
        ];
        for (budgets, code) in changes {
            let after = key_of(&compile(budgets.clone()), code);
            assert_ne!(after, before, "{budgets}");
        }
        // Different weights count different amounts.
        let w = |i: u64, o: u64| {
            key_of(&compile(serde_json::json!([{"window": "day", "tokens": 9, "input_weight": i, "output_weight": o}])), "key:k2:day:weighted_tokens")
        };
        assert_ne!(w(1, 4), w(1, 5));
        assert_ne!(w(2, 4), w(1, 4));
    }

    #[test]
    fn an_unchanged_budget_keeps_its_counter_whatever_moves_around_it() {
        let month = serde_json::json!({"window": "month", "tokens": 1_000_000});
        let minute = serde_json::json!({"window": "minute", "requests": 5});
        let day = serde_json::json!({"window": "day", "usd": 3});
        let key = |budgets: serde_json::Value| key_of(&compile(budgets), "key:k2:month:total_tokens");
        let alone = key(serde_json::json!([month]));
        assert_eq!(key(serde_json::json!([minute, month])), alone, "a budget added before it");
        assert_eq!(key(serde_json::json!([month, minute, day])), alone, "budgets added after it");
        assert_eq!(key(serde_json::json!([day, minute, month])), alone, "reordered");
        assert_eq!(key(serde_json::json!([day, month])), key(serde_json::json!([minute, day, month])), "one removed");
        // What is not part of what it counts does not move it: its limit, its soft limit, a reset
        // day of 1 written out.
        assert_eq!(key(serde_json::json!([{"window": "month", "reset_day": 1, "tokens": 5, "soft_limit_percent": 80}])), alone);
        // Weights 1/1 count what `total` counts.
        assert_eq!(key(serde_json::json!([{"window": "month", "tokens": 5, "input_weight": 1, "output_weight": 1}])), alone);
    }

    #[test]
    fn the_longest_counter_name_fits_the_ledger() {
        let owner = "x".repeat(64);
        let limit = Limit::Tokens { limit: 1, input_weight: u64::MAX, output_weight: u64::MAX };
        let name = counter_name(Level::Team, &owner, &Window::Month { reset_day: 28 }, &limit, true, ':');
        assert_eq!(name.len(), 157, "{name}");
        // As the Redis ledger gets it, identity hash and window id added: under its 256 bytes.
        let redis = format!("{name}:{}:w{}", "f".repeat(16), u64::MAX);
        assert_eq!(redis.len(), 196, "{redis}");
        assert!(name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b':'), "{name}");
    }
}
