//! Model prices: a validated table looked up by model-name glob, and request cost in integer micro-USD.
//!
//! Prices are configured as USD per million tokens (the unit providers publish) and converted once,
//! at validation, to integer micro-USD per million tokens. Costs are then computed with `u128`
//! integer arithmetic and rounded up to whole micro-USD, so ledgers and counters never see floats.
//!
//! JSON shape of one entry (flat; unknown fields are rejected):
//! `{"model": "gpt-4o*", "input_usd_per_mtok": 2.5, "output_usd_per_mtok": 10,
//!   "cached_input_usd_per_mtok": 1.25}`.

use crate::usage::Usage;

/// Largest accepted price, USD per million tokens: far above any real price, low enough that cost
/// arithmetic cannot overflow.
pub const MAX_USD_PER_MTOK: f64 = 1_000_000.0;

const TOKENS_PER_MTOK: u128 = 1_000_000;

/// Prices of one model family, USD per million tokens.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ModelPrice {
    /// Uncached prompt tokens.
    pub input_usd_per_mtok: f64,
    /// Generated tokens (reasoning too, unless `reasoning_usd_per_mtok` is set).
    pub output_usd_per_mtok: f64,
    /// Prompt tokens read from cache; default: the input price.
    #[serde(default)]
    pub cached_input_usd_per_mtok: Option<f64>,
    /// Prompt tokens written to cache (Anthropic); default: the input price.
    #[serde(default)]
    pub cache_creation_input_usd_per_mtok: Option<f64>,
    /// Reasoning tokens; default: the output price.
    #[serde(default)]
    pub reasoning_usd_per_mtok: Option<f64>,
}

/// One row of a price table: a model-name glob and its prices.
///
/// Deserialises from the flat JSON shape shown in the module docs (serde's `flatten` cannot be
/// combined with `deny_unknown_fields`, so a private flat struct is converted).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(from = "FlatPriceEntry")]
pub struct PriceEntry {
    /// Glob over the model name: `*` any run of characters, `?` exactly one.
    pub model: String,
    /// The prices.
    pub price: ModelPrice,
}

#[derive(serde::Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
struct FlatPriceEntry {
    model: String,
    input_usd_per_mtok: f64,
    output_usd_per_mtok: f64,
    #[serde(default)]
    cached_input_usd_per_mtok: Option<f64>,
    #[serde(default)]
    cache_creation_input_usd_per_mtok: Option<f64>,
    #[serde(default)]
    reasoning_usd_per_mtok: Option<f64>,
}

impl From<FlatPriceEntry> for PriceEntry {
    fn from(f: FlatPriceEntry) -> Self {
        PriceEntry {
            model: f.model,
            price: ModelPrice {
                input_usd_per_mtok: f.input_usd_per_mtok,
                output_usd_per_mtok: f.output_usd_per_mtok,
                cached_input_usd_per_mtok: f.cached_input_usd_per_mtok,
                cache_creation_input_usd_per_mtok: f.cache_creation_input_usd_per_mtok,
                reasoning_usd_per_mtok: f.reasoning_usd_per_mtok,
            },
        }
    }
}

/// Why a price table was rejected. The display names the entry and field, e.g.
/// `prices[2].output_usd_per_mtok: must be a finite number >= 0, got -1`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PriceError {
    /// A field of entry `index` is invalid.
    #[error("prices[{index}].{field}: {message}")]
    Invalid {
        /// Position in the list.
        index: usize,
        /// Field name.
        field: &'static str,
        /// What is wrong, with the offending value.
        message: String,
    },
    /// The JSON could not be parsed into entries.
    #[error("prices: {0}")]
    Json(String),
}

/// Integer prices, micro-USD per million tokens (= USD per token × 10¹²).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntegerPrice {
    /// Uncached input.
    pub input: u64,
    /// Cache reads.
    pub cached_input: u64,
    /// Cache writes.
    pub cache_creation_input: u64,
    /// Non-reasoning output.
    pub output: u64,
    /// Reasoning output.
    pub reasoning: u64,
}

/// Validated price table; the first entry whose glob matches a model wins.
#[derive(Debug, Clone, PartialEq)]
pub struct PriceTable {
    entries: Vec<(PriceEntry, IntegerPrice)>,
}

fn check(index: usize, field: &'static str, v: f64) -> Result<u64, PriceError> {
    if !v.is_finite() || v < 0.0 {
        return Err(PriceError::Invalid { index, field, message: format!("must be a finite number >= 0, got {v}") });
    }
    if v > MAX_USD_PER_MTOK {
        return Err(PriceError::Invalid { index, field, message: format!("must be <= {MAX_USD_PER_MTOK}, got {v}") });
    }
    // In range [0, 1e12], so the cast is exact after rounding.
    Ok((v * 1_000_000.0).round() as u64)
}

impl PriceTable {
    /// Validate entries: globs non-empty, every price finite, >= 0 and <= [`MAX_USD_PER_MTOK`].
    pub fn new(entries: Vec<PriceEntry>) -> Result<Self, PriceError> {
        let mut out = Vec::with_capacity(entries.len());
        for (i, e) in entries.into_iter().enumerate() {
            if e.model.is_empty() {
                return Err(PriceError::Invalid { index: i, field: "model", message: "must be a non-empty glob".to_owned() });
            }
            let p = &e.price;
            let input = check(i, "input_usd_per_mtok", p.input_usd_per_mtok)?;
            let output = check(i, "output_usd_per_mtok", p.output_usd_per_mtok)?;
            let opt = |field, v: Option<f64>, default| match v {
                Some(v) => check(i, field, v),
                None => Ok(default),
            };
            let int = IntegerPrice {
                input,
                output,
                cached_input: opt("cached_input_usd_per_mtok", p.cached_input_usd_per_mtok, input)?,
                cache_creation_input: opt("cache_creation_input_usd_per_mtok", p.cache_creation_input_usd_per_mtok, input)?,
                reasoning: opt("reasoning_usd_per_mtok", p.reasoning_usd_per_mtok, output)?,
            };
            out.push((e, int));
        }
        Ok(Self { entries: out })
    }

    /// Parse and validate a JSON array of entries (shape in the module docs).
    pub fn from_json(json: &str) -> Result<Self, PriceError> {
        let entries: Vec<PriceEntry> = serde_json::from_str(json).map_err(|e| PriceError::Json(e.to_string()))?;
        Self::new(entries)
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// `true` if the table has no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Prices of the first entry whose glob matches `model`.
    pub fn lookup(&self, model: &str) -> Option<&ModelPrice> {
        self.lookup_entry(model).map(|(e, _)| &e.price)
    }

    /// Entry and integer prices of the first entry whose glob matches `model`.
    pub fn lookup_entry(&self, model: &str) -> Option<(&PriceEntry, &IntegerPrice)> {
        self.entries.iter().find(|(e, _)| glob_match(&e.model, model)).map(|(e, p)| (e, p))
    }

    /// Cost of `usage` for `model` in micro-USD, rounded up; `None` when no entry matches.
    ///
    /// Billing split: uncached input (`input - cached - cache_creation`, never negative) at the input
    /// price, cache reads at the cached price, cache writes at the cache-creation price, non-reasoning
    /// output at the output price, reasoning at the reasoning price. Parts larger than their whole are
    /// clamped, so the billed token total always equals `input_tokens + output_tokens`.
    pub fn cost_micro_usd(&self, model: &str, usage: &Usage) -> Option<u64> {
        self.lookup_entry(model).map(|(_, p)| cost_micro_usd(p, usage))
    }
}

/// Cost of `usage` at integer prices `p`, micro-USD rounded up (see [`PriceTable::cost_micro_usd`]).
pub fn cost_micro_usd(p: &IntegerPrice, usage: &Usage) -> u64 {
    let cached = usage.cached_input_tokens.min(usage.input_tokens);
    let creation = usage.cache_creation_input_tokens.min(usage.input_tokens.saturating_sub(cached));
    let uncached = usage.input_tokens.saturating_sub(cached).saturating_sub(creation);
    let reasoning = usage.reasoning_tokens.min(usage.output_tokens);
    let output = usage.output_tokens.saturating_sub(reasoning);
    let parts = [(uncached, p.input), (cached, p.cached_input), (creation, p.cache_creation_input), (output, p.output), (reasoning, p.reasoning)];
    // u64 tokens × price ≤ 1e12 fits in u128 many times over; the sum of five cannot overflow.
    let total: u128 = parts.iter().map(|&(t, price)| u128::from(t) * u128::from(price)).sum();
    u64::try_from(total.div_ceil(TOKENS_PER_MTOK)).unwrap_or(u64::MAX)
}

/// Glob match: `*` matches any run of characters (including none), `?` exactly one character;
/// everything else matches itself, case-sensitively. Iterative with single-star backtracking, so the
/// worst case is O(pattern × text), never exponential.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let p = pattern.as_bytes();
    let t = text.as_bytes();
    let char_len = |i: usize| text.get(i..).and_then(|s| s.chars().next()).map_or(1, char::len_utf8);
    let (mut pi, mut ti) = (0usize, 0usize);
    // Pattern index after the last `*`, and the text index that star currently stops at.
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        match p.get(pi) {
            Some(b'*') => {
                pi += 1;
                star = Some((pi, ti));
                continue;
            }
            Some(b'?') => {
                pi += 1;
                ti = ti.saturating_add(char_len(ti));
                continue;
            }
            Some(c) if t.get(ti) == Some(c) => {
                pi += 1;
                ti += 1;
                continue;
            }
            _ => {}
        }
        // Mismatch: let the last star swallow one more character and retry after it.
        match star {
            Some((sp, st)) => {
                let next = st.saturating_add(char_len(st));
                star = Some((sp, next));
                pi = sp;
                ti = next;
            }
            None => return false,
        }
    }
    while p.get(pi) == Some(&b'*') {
        pi += 1;
    }
    pi == p.len()
}
