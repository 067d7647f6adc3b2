//! Price table validation, glob lookup and integer cost arithmetic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use sluice_core::price::{glob_match, ModelPrice, PriceEntry, PriceError, PriceTable};
use sluice_core::usage::Usage;

fn entry(model: &str, input: f64, output: f64) -> PriceEntry {
    PriceEntry {
        model: model.into(),
        price: ModelPrice {
            input_usd_per_mtok: input,
            output_usd_per_mtok: output,
            cached_input_usd_per_mtok: None,
            cache_creation_input_usd_per_mtok: None,
            reasoning_usd_per_mtok: None,
        },
    }
}

#[test]
fn globs() {
    let cases = [
        ("gpt-4o*", "gpt-4o", true),
        ("gpt-4o*", "gpt-4o-mini-2024-07-18", true),
        ("gpt-4o*", "gpt-4", false),
        ("*", "", true),
        ("", "", true),
        ("", "a", false),
        ("?", "", false),
        ("?", "é", true),
        ("??", "é", false),
        ("claude-*-4-5*", "claude-sonnet-4-5-20250929", true),
        ("claude-*-4-5*", "claude-sonnet-4-20250514", false),
        ("*mini", "gpt-4o-mini", true),
        ("*mini", "gpt-4o-mini-2024", false),
        ("a*b*c", "aXXbYYbZZc", true),
        ("a*b*c", "aXXcYYb", false),
        ("o?-mini", "o3-mini", true),
        ("o?-mini", "o33-mini", false),
        ("*é?", "caféx", true),
        ("**a**", "bab", true),
        ("GPT-4o", "gpt-4o", false),
    ];
    for (p, t, want) in cases {
        assert_eq!(glob_match(p, t), want, "{p:?} vs {t:?}");
    }
}

#[test]
fn glob_worst_case_is_not_exponential() {
    let pattern = "*a".repeat(50) + "b";
    let text = "a".repeat(10_000);
    assert!(!glob_match(&pattern, &text));
}

#[test]
fn first_matching_entry_wins() {
    let t = PriceTable::new(vec![entry("gpt-4o-mini*", 0.15, 0.6), entry("gpt-4o*", 2.5, 10.0)]).unwrap();
    assert_eq!(t.lookup("gpt-4o-mini-2024-07-18").unwrap().input_usd_per_mtok, 0.15);
    assert_eq!(t.lookup("gpt-4o-2024-08-06").unwrap().input_usd_per_mtok, 2.5);
    assert!(t.lookup("claude-3").is_none());
    assert_eq!(t.cost_micro_usd("claude-3", &Usage::default()), None);
    assert_eq!(t.len(), 2);
}

#[test]
fn cost_basic_and_rounding_up() {
    let t = PriceTable::new(vec![entry("gpt-4o*", 2.5, 10.0)]).unwrap();
    let u = Usage { input_tokens: 1000, output_tokens: 500, ..Usage::default() };
    // 1000 × 2.5 + 500 × 10 = 7500 micro-USD exactly.
    assert_eq!(t.cost_micro_usd("gpt-4o", &u), Some(7500));
    // 1 input token = 2.5 micro-USD → rounded up to 3.
    let one = Usage { input_tokens: 1, ..Usage::default() };
    assert_eq!(t.cost_micro_usd("gpt-4o", &one), Some(3));
    assert_eq!(t.cost_micro_usd("gpt-4o", &Usage::default()), Some(0));
}

#[test]
fn rounding_happens_once_on_the_sum() {
    // 0.15 and 0.6 USD/Mtok: 1 input + 1 output = 0.75 micro-USD → 1, not ceil(0.15)+ceil(0.6) = 2.
    let t = PriceTable::new(vec![entry("m", 0.15, 0.6)]).unwrap();
    let u = Usage { input_tokens: 1, output_tokens: 1, ..Usage::default() };
    assert_eq!(t.cost_micro_usd("m", &u), Some(1));
}

#[test]
fn price_conversion_rounds_to_nearest_micro() {
    // 0.0000004 USD/Mtok rounds to 0 µUSD/Mtok; 0.0000006 rounds to 1.
    let t = PriceTable::new(vec![entry("a", 0.000_000_4, 0.0), entry("b", 0.000_000_6, 0.0)]).unwrap();
    let u = Usage { input_tokens: 1_000_000, ..Usage::default() };
    assert_eq!(t.cost_micro_usd("a", &u), Some(0));
    assert_eq!(t.cost_micro_usd("b", &u), Some(1));
    let (_, ints) = t.lookup_entry("b").unwrap();
    assert_eq!(ints.input, 1);
}

#[test]
fn cache_and_reasoning_split() {
    let t = PriceTable::from_json(
        r#"[{"model":"claude-sonnet-4*","input_usd_per_mtok":3,"output_usd_per_mtok":15,
             "cached_input_usd_per_mtok":0.3,"cache_creation_input_usd_per_mtok":3.75,
             "reasoning_usd_per_mtok":20}]"#,
    )
    .unwrap();
    let u = Usage { input_tokens: 25 + 2000 + 100, output_tokens: 300, cached_input_tokens: 2000, cache_creation_input_tokens: 100, reasoning_tokens: 100 };
    // 25×3 + 2000×0.3 + 100×3.75 + 200×15 + 100×20 = 75 + 600 + 375 + 3000 + 2000
    assert_eq!(t.cost_micro_usd("claude-sonnet-4-5", &u), Some(6050));
}

#[test]
fn optional_prices_default_to_input_and_output() {
    let t = PriceTable::new(vec![entry("m", 2.0, 8.0)]).unwrap();
    let u = Usage { input_tokens: 100, output_tokens: 10, cached_input_tokens: 60, cache_creation_input_tokens: 40, reasoning_tokens: 5 };
    assert_eq!(t.cost_micro_usd("m", &u), Some(100 * 2 + 10 * 8));
}

#[test]
fn inconsistent_parts_are_clamped() {
    let t =
        PriceTable::from_json(r#"[{"model":"m","input_usd_per_mtok":1,"output_usd_per_mtok":1,"cached_input_usd_per_mtok":0,"reasoning_usd_per_mtok":100}]"#)
            .unwrap();
    // cached > input and reasoning > output: billed as 10 cached (free) and 5 reasoning.
    let u = Usage { input_tokens: 10, output_tokens: 5, cached_input_tokens: 50, cache_creation_input_tokens: 7, reasoning_tokens: 9 };
    assert_eq!(t.cost_micro_usd("m", &u), Some(500));
}

#[test]
fn huge_usage_does_not_overflow() {
    let t = PriceTable::new(vec![entry("m", 1_000_000.0, 1_000_000.0)]).unwrap();
    let u = Usage { input_tokens: u64::MAX, output_tokens: u64::MAX, ..Usage::default() };
    assert_eq!(t.cost_micro_usd("m", &u), Some(u64::MAX));
}

#[test]
fn validation_errors_name_the_field() {
    let err = PriceTable::new(vec![entry("a", 1.0, 1.0), entry("b", 1.0, 1.0), entry("c", 1.0, -1.0)]).unwrap_err();
    assert_eq!(err.to_string(), "prices[2].output_usd_per_mtok: must be a finite number >= 0, got -1");
    let err = PriceTable::new(vec![entry("a", f64::NAN, 1.0)]).unwrap_err();
    assert_eq!(err.to_string(), "prices[0].input_usd_per_mtok: must be a finite number >= 0, got NaN");
    let err = PriceTable::new(vec![entry("a", f64::INFINITY, 1.0)]).unwrap_err();
    assert_eq!(err.to_string(), "prices[0].input_usd_per_mtok: must be a finite number >= 0, got inf");
    let err = PriceTable::new(vec![entry("a", 1.0, 1_000_001.0)]).unwrap_err();
    assert_eq!(err.to_string(), "prices[0].output_usd_per_mtok: must be <= 1000000, got 1000001");
    let err = PriceTable::new(vec![entry("", 1.0, 1.0)]).unwrap_err();
    assert_eq!(err, PriceError::Invalid { index: 0, field: "model", message: "must be a non-empty glob".into() });
    let mut e = entry("a", 1.0, 1.0);
    e.price.reasoning_usd_per_mtok = Some(-0.5);
    assert_eq!(PriceTable::new(vec![e]).unwrap_err().to_string(), "prices[0].reasoning_usd_per_mtok: must be a finite number >= 0, got -0.5");
}

#[test]
fn json_shape() {
    let t = PriceTable::from_json(r#"[{"model":"gpt-4o*","input_usd_per_mtok":2.5,"output_usd_per_mtok":10}]"#).unwrap();
    assert_eq!(t.lookup("gpt-4o").unwrap(), &entry("gpt-4o*", 2.5, 10.0).price);
    let err = PriceTable::from_json(r#"[{"model":"m","input_usd_per_mtok":1,"output_usd_per_mtok":1,"inptu":3}]"#).unwrap_err();
    assert!(err.to_string().contains("unknown field `inptu`"), "{err}");
    let err = PriceTable::from_json(r#"[{"model":"m","input_usd_per_mtok":1}]"#).unwrap_err();
    assert!(err.to_string().contains("output_usd_per_mtok"), "{err}");
    let err = serde_json::from_str::<ModelPrice>(r#"{"input_usd_per_mtok":1,"output_usd_per_mtok":1,"extra":1}"#).unwrap_err();
    assert!(err.to_string().contains("unknown field `extra`"), "{err}");
    assert!(matches!(PriceTable::from_json("{}"), Err(PriceError::Json(_))));
    let p: ModelPrice = serde_json::from_str(r#"{"input_usd_per_mtok":1,"output_usd_per_mtok":2}"#).unwrap();
    assert_eq!(p.output_usd_per_mtok, 2.0);
}
