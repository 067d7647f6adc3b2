//! The configuration's unit-only enums (tenant-budget's `mode`, `ledger.mode`, `ledger.on_failure`,
//! a budget's `window` and `count`; latency-guard's class `priority` and `while_open` actions):
//! every form serde's derive accepted — the variant's name, and serde_json's externally tagged
//! `{"name": null}` — and its refusals word for word with their path, line and column, as the
//! derive gave them (recorded from it before the enums shared one deserializer, json::unit_variant).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use sluice_core::budget::policy::PolicyConfig;
use sluice_core::json::parse_config_at;
use sluice_core::latency::policy::LatencyPolicyConfig;

/// Where each enum is written: a document with `@` where the value goes.
const PLACES: &[&str] = &[
    r#"{"mode":@,"identity":{"header":"x"},"orgs":[]}"#,
    r#"{"identity":{"header":"x"},"ledger":{"mode":@},"orgs":[]}"#,
    r#"{"identity":{"header":"x"},"ledger":{"on_failure":@ },"orgs":[]}"#,
    r#"{"identity":{"header":"x"},"orgs":[{"id":"o","budgets":[{"window":@,"tokens":1}]}]}"#,
    r#"{"identity":{"header":"x"},"orgs":[{"id":"o","budgets":[{"window":"day","count":@}]}]}"#,
    r#"{"classes":[{"name":"c","priority":@}],"versions":[]}"#,
    r#"{"versions":[{"name":"v","breaker":{"objective":{"ttft_ms":1},"fallback":"w","while_open":{"standard":@}}}]}"#,
];

/// Each place's enum's first and second variant names.
const NAMES: &[(&str, &str)] = &[
    ("strict", "estimate"),
    ("local", "redis"),
    ("deny", "local"),
    ("minute", "month"),
    ("total", "output"),
    ("critical", "sheddable"),
    ("fallback", "reject"),
];

fn values(first: &str, second: &str) -> Vec<String> {
    let mut v: Vec<String> = [
        "\"{1}\"",
        "\"{2}\"",
        "{\"{2}\":null}",
        "{ \"{1}\" : null }",
        "{\"{1}\":1}",
        "{\"{1}\":null,\"{2}\":null}",
        "{\"bogus\":null}",
        "{}",
        "\"bogus\"",
        "\"\"",
        "5",
        "-1",
        "1.5",
        "null",
        "true",
        "[]",
        "[\"{1}\"]",
        "{\"{1}\"}",
        "\"{1}",
        "\"\\u0073x\"",
    ]
    .iter()
    .map(|t| t.replace("{1}", first).replace("{2}", second))
    .collect();
    v.push(format!("\"{}\"", first.to_uppercase()));
    v
}

fn outcome(place: usize, text: &str) -> String {
    let r = if place < 5 {
        parse_config_at::<PolicyConfig>(text.as_bytes()).map(|c| match place {
            0 => format!("{:?}", c.mode),
            1 => format!("{:?}", c.ledger.mode),
            2 => format!("{:?}", c.ledger.on_failure),
            3 => format!("{:?}", c.orgs[0].budgets[0].window),
            _ => format!("{:?}", c.orgs[0].budgets[0].count),
        })
    } else {
        parse_config_at::<LatencyPolicyConfig>(text.as_bytes()).map(|c| match place {
            5 => format!("{:?}", c.classes[0].priority),
            _ => format!("{:?}", c.versions[0].breaker.as_ref().map(|b| b.while_open.standard)),
        })
    };
    r.unwrap_or_else(|e| format!("error: {e}"))
}

#[test]
fn unit_enums_read_and_refuse_as_the_derive_did() {
    let mut expected = EXPECTED.iter();
    for (place, (doc, (first, second))) in PLACES.iter().zip(NAMES).enumerate() {
        for value in values(first, second) {
            let Some(&(p, v, want)) = expected.next() else { panic!("no expectation for {place} {value}") };
            assert_eq!((p, v), (place, value.as_str()));
            assert_eq!(outcome(place, &doc.replace('@', &value)), want, "{value} in {doc}");
        }
    }
    assert!(expected.next().is_none());
}

/// Each place, value and what the document became.
const EXPECTED: &[(usize, &str, &str)] = &[
    (0, r#""strict""#, r#"Strict"#),
    (0, r#""estimate""#, r#"Estimate"#),
    (0, r#"{"estimate":null}"#, r#"Estimate"#),
    (0, r#"{ "strict" : null }"#, r#"Strict"#),
    (0, r#"{"strict":1}"#, r#"error: mode.strict: invalid type: integer `1`, expected unit at line 1 column 19"#),
    (0, r#"{"strict":null,"estimate":null}"#, r#"error: expected value at line 1 column 22"#),
    (0, r#"{"bogus":null}"#, r#"error: mode: unknown variant `bogus`, expected `strict` or `estimate` at line 1 column 16"#),
    (0, r#"{}"#, r#"error: expected value at line 1 column 10"#),
    (0, r#""bogus""#, r#"error: mode: unknown variant `bogus`, expected `strict` or `estimate` at line 1 column 15"#),
    (0, r#""""#, r#"error: mode: unknown variant ``, expected `strict` or `estimate` at line 1 column 10"#),
    (0, r#"5"#, r#"error: expected value at line 1 column 9"#),
    (0, r#"-1"#, r#"error: expected value at line 1 column 9"#),
    (0, r#"1.5"#, r#"error: expected value at line 1 column 9"#),
    (0, r#"null"#, r#"error: expected value at line 1 column 9"#),
    (0, r#"true"#, r#"error: expected value at line 1 column 9"#),
    (0, r#"[]"#, r#"error: expected value at line 1 column 9"#),
    (0, r#"["strict"]"#, r#"error: expected value at line 1 column 9"#),
    (0, r#"{"strict"}"#, r#"error: expected `:` at line 1 column 18"#),
    (0, r#""strict"#, r#"error: mode: unknown variant `strict,`, expected `strict` or `estimate` at line 1 column 17"#),
    (0, r#""\u0073x""#, r#"error: mode: unknown variant `sx`, expected `strict` or `estimate` at line 1 column 17"#),
    (0, r#""STRICT""#, r#"error: mode: unknown variant `STRICT`, expected `strict` or `estimate` at line 1 column 16"#),
    (1, r#""local""#, r#"Local"#),
    (1, r#""redis""#, r#"Redis"#),
    (1, r#"{"redis":null}"#, r#"Redis"#),
    (1, r#"{ "local" : null }"#, r#"Local"#),
    (1, r#"{"local":1}"#, r#"error: ledger.mode.local: invalid type: integer `1`, expected unit at line 1 column 54"#),
    (1, r#"{"local":null,"redis":null}"#, r#"error: expected value at line 1 column 57"#),
    (1, r#"{"bogus":null}"#, r#"error: ledger.mode: unknown variant `bogus`, expected `local` or `redis` at line 1 column 52"#),
    (1, r#"{}"#, r#"error: expected value at line 1 column 46"#),
    (1, r#""bogus""#, r#"error: ledger.mode: unknown variant `bogus`, expected `local` or `redis` at line 1 column 51"#),
    (1, r#""""#, r#"error: ledger.mode: unknown variant ``, expected `local` or `redis` at line 1 column 46"#),
    (1, r#"5"#, r#"error: expected value at line 1 column 45"#),
    (1, r#"-1"#, r#"error: expected value at line 1 column 45"#),
    (1, r#"1.5"#, r#"error: expected value at line 1 column 45"#),
    (1, r#"null"#, r#"error: expected value at line 1 column 45"#),
    (1, r#"true"#, r#"error: expected value at line 1 column 45"#),
    (1, r#"[]"#, r#"error: expected value at line 1 column 45"#),
    (1, r#"["local"]"#, r#"error: expected value at line 1 column 45"#),
    (1, r#"{"local"}"#, r#"error: expected `:` at line 1 column 53"#),
    (1, r#""local"#, r#"error: ledger.mode: unknown variant `local},`, expected `local` or `redis` at line 1 column 53"#),
    (1, r#""\u0073x""#, r#"error: ledger.mode: unknown variant `sx`, expected `local` or `redis` at line 1 column 53"#),
    (1, r#""LOCAL""#, r#"error: ledger.mode: unknown variant `LOCAL`, expected `local` or `redis` at line 1 column 51"#),
    (2, r#""deny""#, r#"Deny"#),
    (2, r#""local""#, r#"Local"#),
    (2, r#"{"local":null}"#, r#"Local"#),
    (2, r#"{ "deny" : null }"#, r#"Deny"#),
    (2, r#"{"deny":1}"#, r#"error: ledger.on_failure.deny: invalid type: integer `1`, expected unit at line 1 column 59"#),
    (2, r#"{"deny":null,"local":null}"#, r#"error: expected value at line 1 column 62"#),
    (2, r#"{"bogus":null}"#, r#"error: ledger.on_failure: unknown variant `bogus`, expected one of `deny`, `allow`, `local` at line 1 column 58"#),
    (2, r#"{}"#, r#"error: expected value at line 1 column 52"#),
    (2, r#""bogus""#, r#"error: ledger.on_failure: unknown variant `bogus`, expected one of `deny`, `allow`, `local` at line 1 column 57"#),
    (2, r#""""#, r#"error: ledger.on_failure: unknown variant ``, expected one of `deny`, `allow`, `local` at line 1 column 52"#),
    (2, r#"5"#, r#"error: expected value at line 1 column 51"#),
    (2, r#"-1"#, r#"error: expected value at line 1 column 51"#),
    (2, r#"1.5"#, r#"error: expected value at line 1 column 51"#),
    (2, r#"null"#, r#"error: expected value at line 1 column 51"#),
    (2, r#"true"#, r#"error: expected value at line 1 column 51"#),
    (2, r#"[]"#, r#"error: expected value at line 1 column 51"#),
    (2, r#"["deny"]"#, r#"error: expected value at line 1 column 51"#),
    (2, r#"{"deny"}"#, r#"error: expected `:` at line 1 column 58"#),
    (2, r#""deny"#, r#"error: ledger.on_failure: unknown variant `deny },`, expected one of `deny`, `allow`, `local` at line 1 column 59"#),
    (2, r#""\u0073x""#, r#"error: ledger.on_failure: unknown variant `sx`, expected one of `deny`, `allow`, `local` at line 1 column 59"#),
    (2, r#""DENY""#, r#"error: ledger.on_failure: unknown variant `DENY`, expected one of `deny`, `allow`, `local` at line 1 column 56"#),
    (3, r#""minute""#, r#"Minute"#),
    (3, r#""month""#, r#"Month"#),
    (3, r#"{"month":null}"#, r#"Month"#),
    (3, r#"{ "minute" : null }"#, r#"Minute"#),
    (3, r#"{"minute":1}"#, r#"error: orgs[0].budgets[0].window.minute: invalid type: integer `1`, expected unit at line 1 column 77"#),
    (3, r#"{"minute":null,"month":null}"#, r#"error: expected value at line 1 column 80"#),
    (
        3,
        r#"{"bogus":null}"#,
        r#"error: orgs[0].budgets[0].window: unknown variant `bogus`, expected one of `minute`, `hour`, `day`, `month` at line 1 column 74"#,
    ),
    (3, r#"{}"#, r#"error: expected value at line 1 column 68"#),
    (3, r#""bogus""#, r#"error: orgs[0].budgets[0].window: unknown variant `bogus`, expected one of `minute`, `hour`, `day`, `month` at line 1 column 73"#),
    (3, r#""""#, r#"error: orgs[0].budgets[0].window: unknown variant ``, expected one of `minute`, `hour`, `day`, `month` at line 1 column 68"#),
    (3, r#"5"#, r#"error: expected value at line 1 column 67"#),
    (3, r#"-1"#, r#"error: expected value at line 1 column 67"#),
    (3, r#"1.5"#, r#"error: expected value at line 1 column 67"#),
    (3, r#"null"#, r#"error: expected value at line 1 column 67"#),
    (3, r#"true"#, r#"error: expected value at line 1 column 67"#),
    (3, r#"[]"#, r#"error: expected value at line 1 column 67"#),
    (3, r#"["minute"]"#, r#"error: expected value at line 1 column 67"#),
    (3, r#"{"minute"}"#, r#"error: expected `:` at line 1 column 76"#),
    (3, r#""minute"#, r#"error: orgs[0].budgets[0].window: unknown variant `minute,`, expected one of `minute`, `hour`, `day`, `month` at line 1 column 75"#),
    (3, r#""\u0073x""#, r#"error: orgs[0].budgets[0].window: unknown variant `sx`, expected one of `minute`, `hour`, `day`, `month` at line 1 column 75"#),
    (3, r#""MINUTE""#, r#"error: orgs[0].budgets[0].window: unknown variant `MINUTE`, expected one of `minute`, `hour`, `day`, `month` at line 1 column 74"#),
    (4, r#""total""#, r#"Some(Total)"#),
    (4, r#""output""#, r#"Some(Output)"#),
    (4, r#"{"output":null}"#, r#"Some(Output)"#),
    (4, r#"{ "total" : null }"#, r#"Some(Total)"#),
    (4, r#"{"total":1}"#, r#"error: orgs[0].budgets[0].count.total: invalid type: integer `1`, expected unit at line 1 column 90"#),
    (4, r#"{"total":null,"output":null}"#, r#"error: expected value at line 1 column 93"#),
    (4, r#"{"bogus":null}"#, r#"error: orgs[0].budgets[0].count: unknown variant `bogus`, expected one of `total`, `input`, `output` at line 1 column 88"#),
    (4, r#"{}"#, r#"error: expected value at line 1 column 82"#),
    (4, r#""bogus""#, r#"error: orgs[0].budgets[0].count: unknown variant `bogus`, expected one of `total`, `input`, `output` at line 1 column 87"#),
    (4, r#""""#, r#"error: orgs[0].budgets[0].count: unknown variant ``, expected one of `total`, `input`, `output` at line 1 column 82"#),
    (4, r#"5"#, r#"error: expected value at line 1 column 81"#),
    (4, r#"-1"#, r#"error: expected value at line 1 column 81"#),
    (4, r#"1.5"#, r#"error: expected value at line 1 column 81"#),
    (4, r#"null"#, r#"None"#),
    (4, r#"true"#, r#"error: expected value at line 1 column 81"#),
    (4, r#"[]"#, r#"error: expected value at line 1 column 81"#),
    (4, r#"["total"]"#, r#"error: expected value at line 1 column 81"#),
    (4, r#"{"total"}"#, r#"error: expected `:` at line 1 column 89"#),
    (4, r#""total"#, r#"error: EOF while parsing a string at line 1 column 91"#),
    (4, r#""\u0073x""#, r#"error: orgs[0].budgets[0].count: unknown variant `sx`, expected one of `total`, `input`, `output` at line 1 column 89"#),
    (4, r#""TOTAL""#, r#"error: orgs[0].budgets[0].count: unknown variant `TOTAL`, expected one of `total`, `input`, `output` at line 1 column 87"#),
    (5, r#""critical""#, r#"Critical"#),
    (5, r#""sheddable""#, r#"Sheddable"#),
    (5, r#"{"sheddable":null}"#, r#"Sheddable"#),
    (5, r#"{ "critical" : null }"#, r#"Critical"#),
    (5, r#"{"critical":1}"#, r#"error: classes[0].priority.critical: invalid type: integer `1`, expected unit at line 1 column 48"#),
    (5, r#"{"critical":null,"sheddable":null}"#, r#"error: expected value at line 1 column 51"#),
    (5, r#"{"bogus":null}"#, r#"error: classes[0].priority: unknown variant `bogus`, expected one of `critical`, `standard`, `sheddable` at line 1 column 43"#),
    (5, r#"{}"#, r#"error: expected value at line 1 column 37"#),
    (5, r#""bogus""#, r#"error: classes[0].priority: unknown variant `bogus`, expected one of `critical`, `standard`, `sheddable` at line 1 column 42"#),
    (5, r#""""#, r#"error: classes[0].priority: unknown variant ``, expected one of `critical`, `standard`, `sheddable` at line 1 column 37"#),
    (5, r#"5"#, r#"error: expected value at line 1 column 36"#),
    (5, r#"-1"#, r#"error: expected value at line 1 column 36"#),
    (5, r#"1.5"#, r#"error: expected value at line 1 column 36"#),
    (5, r#"null"#, r#"error: expected value at line 1 column 36"#),
    (5, r#"true"#, r#"error: expected value at line 1 column 36"#),
    (5, r#"[]"#, r#"error: expected value at line 1 column 36"#),
    (5, r#"["critical"]"#, r#"error: expected value at line 1 column 36"#),
    (5, r#"{"critical"}"#, r#"error: expected `:` at line 1 column 47"#),
    (
        5,
        r#""critical"#,
        r#"error: classes[0].priority: unknown variant `critical}],`, expected one of `critical`, `standard`, `sheddable` at line 1 column 48"#,
    ),
    (5, r#""\u0073x""#, r#"error: classes[0].priority: unknown variant `sx`, expected one of `critical`, `standard`, `sheddable` at line 1 column 44"#),
    (5, r#""CRITICAL""#, r#"error: classes[0].priority: unknown variant `CRITICAL`, expected one of `critical`, `standard`, `sheddable` at line 1 column 45"#),
    (6, r#""fallback""#, r#"error: versions[0].breaker: missing field `window_s` at line 1 column 114"#),
    (6, r#""reject""#, r#"error: versions[0].breaker: missing field `window_s` at line 1 column 112"#),
    (6, r#"{"reject":null}"#, r#"error: versions[0].breaker: missing field `window_s` at line 1 column 119"#),
    (6, r#"{ "fallback" : null }"#, r#"error: versions[0].breaker: missing field `window_s` at line 1 column 125"#),
    (6, r#"{"fallback":1}"#, r#"error: versions[0].breaker.while_open.standard.fallback: invalid type: integer `1`, expected unit at line 1 column 115"#),
    (6, r#"{"fallback":null,"reject":null}"#, r#"error: expected value at line 1 column 118"#),
    (
        6,
        r#"{"bogus":null}"#,
        r#"error: versions[0].breaker.while_open.standard: unknown variant `bogus`, expected `fallback` or `reject` at line 1 column 110"#,
    ),
    (6, r#"{}"#, r#"error: expected value at line 1 column 104"#),
    (6, r#""bogus""#, r#"error: versions[0].breaker.while_open.standard: unknown variant `bogus`, expected `fallback` or `reject` at line 1 column 109"#),
    (6, r#""""#, r#"error: versions[0].breaker.while_open.standard: unknown variant ``, expected `fallback` or `reject` at line 1 column 104"#),
    (6, r#"5"#, r#"error: expected value at line 1 column 103"#),
    (6, r#"-1"#, r#"error: expected value at line 1 column 103"#),
    (6, r#"1.5"#, r#"error: expected value at line 1 column 103"#),
    (6, r#"null"#, r#"error: versions[0].breaker: missing field `window_s` at line 1 column 108"#),
    (6, r#"true"#, r#"error: expected value at line 1 column 103"#),
    (6, r#"[]"#, r#"error: expected value at line 1 column 103"#),
    (6, r#"["fallback"]"#, r#"error: expected value at line 1 column 103"#),
    (6, r#"{"fallback"}"#, r#"error: expected `:` at line 1 column 114"#),
    (6, r#""fallback"#, r#"error: EOF while parsing a string at line 1 column 116"#),
    (6, r#""\u0073x""#, r#"error: versions[0].breaker.while_open.standard: unknown variant `sx`, expected `fallback` or `reject` at line 1 column 111"#),
    (6, r#""FALLBACK""#, r#"error: versions[0].breaker.while_open.standard: unknown variant `FALLBACK`, expected `fallback` or `reject` at line 1 column 112"#),
];
