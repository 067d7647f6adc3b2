//! tenant-budget's `unknown` (`{"action": "reject"}` or `{"action": "default", "key": …}`): every
//! form serde's internally tagged derive accepted, and its refusals word for word with their line,
//! column and path, as the derive gave them (recorded from it before the deserializer was written
//! by hand, policy.rs `tagged`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use sluice_core::budget::Policy;

/// A policy whose `unknown` is `value`, then `after`: what follows the member decides where
/// serde_json dates a refusal found once the member is read.
fn policy(value: &str, after: &str) -> String {
    format!(r#"{{"identity":{{"header":"x"}},"unknown":{value}{after}"orgs":[{{"id":"o","teams":[{{"id":"t","keys":[{{"id":"k"}},{{"id":"nobody"}}]}}]}}]}}"#)
}

/// The same policy with `unknown` its last member, the object closing on the next line.
fn last(value: &str) -> String {
    format!(
        r#"{{"identity":{{"header":"x"}},"orgs":[{{"id":"o","teams":[{{"id":"t","keys":[{{"id":"k"}},{{"id":"nobody"}}]}}]}}],"unknown":{value}
}}"#
    )
}

fn outcome(text: &str) -> String {
    match Policy::from_json(text.as_bytes()) {
        Ok(p) => match p.unknown_default {
            None => "reject".to_string(),
            Some(i) => format!("default {}", p.keys[i].id),
        },
        Err(e) => e.to_string(),
    }
}

fn outcomes(value: &str) -> [String; 3] {
    [outcome(&policy(value, ",")), outcome(&policy(value, " ,\n  ")), outcome(&last(value))]
}

/// Each value of `unknown`, and what the policy became in the three places [`outcomes`] puts it.
const CASES: &[(&str, [&str; 3])] = &[
    (r#"{"action":"reject"}"#, [r#"reject"#, r#"reject"#, r#"reject"#]),
    (r#"{"action":"default","key":"nobody"}"#, [r#"default nobody"#, r#"default nobody"#, r#"default nobody"#]),
    (r#"{"key":"nobody","action":"default"}"#, [r#"default nobody"#, r#"default nobody"#, r#"default nobody"#]),
    (r#"{"action":"reject","key":"nobody","extra":[1,{"a":null}]}"#, [r#"reject"#, r#"reject"#, r#"reject"#]),
    (
        r#"{"action":"default","key":"nobody","extra":1}"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: unknown field `extra`, expected `key` at line 1 column 82"#,
            r#"tenant-budget policy is not valid JSON: unknown: unknown field `extra`, expected `key` at line 1 column 83"#,
            r#"tenant-budget policy is not valid JSON: unknown field `extra`, expected `key` at line 2 column 1"#,
        ],
    ),
    (
        r#"{"extra":1,"action":"default","key":"nobody"}"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: unknown field `extra`, expected `key` at line 1 column 82"#,
            r#"tenant-budget policy is not valid JSON: unknown: unknown field `extra`, expected `key` at line 1 column 83"#,
            r#"tenant-budget policy is not valid JSON: unknown field `extra`, expected `key` at line 2 column 1"#,
        ],
    ),
    (
        r#"{"action":"default"}"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: missing field `key` at line 1 column 57"#,
            r#"tenant-budget policy is not valid JSON: unknown: missing field `key` at line 1 column 58"#,
            r#"tenant-budget policy is not valid JSON: missing field `key` at line 2 column 1"#,
        ],
    ),
    (
        r#"{"action":"default","key":"nobody","key":"k"}"#,
        [
            r#"tenant-budget policy is not valid JSON: duplicate field `key` at line 1 column 82"#,
            r#"tenant-budget policy is not valid JSON: duplicate field `key` at line 1 column 83"#,
            r#"tenant-budget policy is not valid JSON: duplicate field `key` at line 2 column 1"#,
        ],
    ),
    (
        r#"{"action":"default","action":"default","key":"nobody"}"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: duplicate field `action` at line 1 column 65"#,
            r#"tenant-budget policy is not valid JSON: unknown: duplicate field `action` at line 1 column 65"#,
            r#"tenant-budget policy is not valid JSON: unknown: duplicate field `action` at line 1 column 142"#,
        ],
    ),
    (
        r#"{"action":"reject","action":"reject"}"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: duplicate field `action` at line 1 column 64"#,
            r#"tenant-budget policy is not valid JSON: unknown: duplicate field `action` at line 1 column 64"#,
            r#"tenant-budget policy is not valid JSON: unknown: duplicate field `action` at line 1 column 141"#,
        ],
    ),
    (
        r#"{"action":"nope","key":"nobody"}"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown.action: unknown variant `nope`, expected `reject` or `default` at line 1 column 53"#,
            r#"tenant-budget policy is not valid JSON: unknown.action: unknown variant `nope`, expected `reject` or `default` at line 1 column 53"#,
            r#"tenant-budget policy is not valid JSON: unknown.action: unknown variant `nope`, expected `reject` or `default` at line 1 column 130"#,
        ],
    ),
    (
        r#"{"action":1}"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown.action: invalid type: integer `1`, expected variant identifier at line 1 column 48"#,
            r#"tenant-budget policy is not valid JSON: unknown.action: invalid type: integer `1`, expected variant identifier at line 1 column 48"#,
            r#"tenant-budget policy is not valid JSON: unknown.action: invalid type: integer `1`, expected variant identifier at line 1 column 125"#,
        ],
    ),
    (
        r#"{"action":null}"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown.action: invalid type: null, expected variant identifier at line 1 column 51"#,
            r#"tenant-budget policy is not valid JSON: unknown.action: invalid type: null, expected variant identifier at line 1 column 51"#,
            r#"tenant-budget policy is not valid JSON: unknown.action: invalid type: null, expected variant identifier at line 1 column 128"#,
        ],
    ),
    (
        r#"{"action":["default"]}"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown.action: invalid type: sequence, expected variant identifier at line 1 column 47"#,
            r#"tenant-budget policy is not valid JSON: unknown.action: invalid type: sequence, expected variant identifier at line 1 column 47"#,
            r#"tenant-budget policy is not valid JSON: unknown.action: invalid type: sequence, expected variant identifier at line 1 column 124"#,
        ],
    ),
    (
        r#"{"key":"nobody"}"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: missing field `action` at line 1 column 53"#,
            r#"tenant-budget policy is not valid JSON: unknown: missing field `action` at line 1 column 53"#,
            r#"tenant-budget policy is not valid JSON: unknown: missing field `action` at line 1 column 130"#,
        ],
    ),
    (
        r#"{}"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: missing field `action` at line 1 column 39"#,
            r#"tenant-budget policy is not valid JSON: unknown: missing field `action` at line 1 column 39"#,
            r#"tenant-budget policy is not valid JSON: unknown: missing field `action` at line 1 column 116"#,
        ],
    ),
    (
        r#"{"action":"default","key":5}"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: integer `5`, expected a string at line 1 column 65"#,
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: integer `5`, expected a string at line 1 column 66"#,
            r#"tenant-budget policy is not valid JSON: invalid type: integer `5`, expected a string at line 2 column 1"#,
        ],
    ),
    (
        r#"{"action":"default","key":-5}"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: integer `-5`, expected a string at line 1 column 66"#,
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: integer `-5`, expected a string at line 1 column 67"#,
            r#"tenant-budget policy is not valid JSON: invalid type: integer `-5`, expected a string at line 2 column 1"#,
        ],
    ),
    (
        r#"{"action":"default","key":1.5}"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: floating point `1.5`, expected a string at line 1 column 67"#,
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: floating point `1.5`, expected a string at line 1 column 68"#,
            r#"tenant-budget policy is not valid JSON: invalid type: floating point `1.5`, expected a string at line 2 column 1"#,
        ],
    ),
    (
        r#"{"action":"default","key":true}"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: boolean `true`, expected a string at line 1 column 68"#,
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: boolean `true`, expected a string at line 1 column 69"#,
            r#"tenant-budget policy is not valid JSON: invalid type: boolean `true`, expected a string at line 2 column 1"#,
        ],
    ),
    (
        r#"{"action":"default","key":null}"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: null, expected a string at line 1 column 68"#,
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: null, expected a string at line 1 column 69"#,
            r#"tenant-budget policy is not valid JSON: invalid type: null, expected a string at line 2 column 1"#,
        ],
    ),
    (
        r#"{"action":"default","key":[]}"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: sequence, expected a string at line 1 column 66"#,
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: sequence, expected a string at line 1 column 67"#,
            r#"tenant-budget policy is not valid JSON: invalid type: sequence, expected a string at line 2 column 1"#,
        ],
    ),
    (
        r#"{"action":"default","key":{}}"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: map, expected a string at line 1 column 66"#,
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: map, expected a string at line 1 column 67"#,
            r#"tenant-budget policy is not valid JSON: invalid type: map, expected a string at line 2 column 1"#,
        ],
    ),
    (r#"{"action":"default","key":"\u006eobody"}"#, [r#"default nobody"#, r#"default nobody"#, r#"default nobody"#]),
    (
        r#"{"action":"Default","key":"nobody"}"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown.action: unknown variant `Default`, expected `reject` or `default` at line 1 column 56"#,
            r#"tenant-budget policy is not valid JSON: unknown.action: unknown variant `Default`, expected `reject` or `default` at line 1 column 56"#,
            r#"tenant-budget policy is not valid JSON: unknown.action: unknown variant `Default`, expected `reject` or `default` at line 1 column 133"#,
        ],
    ),
    (
        r#"{"action":"default","key":"missing"}"#,
        [
            r#"unknown.key: "missing" is not a key of the policy"#,
            r#"unknown.key: "missing" is not a key of the policy"#,
            r#"unknown.key: "missing" is not a key of the policy"#,
        ],
    ),
    (r#"["reject"]"#, [r#"reject"#, r#"reject"#, r#"reject"#]),
    (
        r#"["reject","x",{"y":1}]"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: invalid length 2, expected 0 elements in sequence at line 1 column 59"#,
            r#"tenant-budget policy is not valid JSON: unknown: invalid length 2, expected 0 elements in sequence at line 1 column 60"#,
            r#"tenant-budget policy is not valid JSON: invalid length 2, expected 0 elements in sequence at line 2 column 1"#,
        ],
    ),
    (r#"["default","nobody"]"#, [r#"default nobody"#, r#"default nobody"#, r#"default nobody"#]),
    (
        r#"["default"]"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: invalid length 0, expected struct variant UnknownConfig::Default with 1 element at line 1 column 48"#,
            r#"tenant-budget policy is not valid JSON: unknown: invalid length 0, expected struct variant UnknownConfig::Default with 1 element at line 1 column 49"#,
            r#"tenant-budget policy is not valid JSON: invalid length 0, expected struct variant UnknownConfig::Default with 1 element at line 2 column 1"#,
        ],
    ),
    (
        r#"["default","nobody","again"]"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: invalid length 2, expected 1 element in sequence at line 1 column 65"#,
            r#"tenant-budget policy is not valid JSON: unknown: invalid length 2, expected 1 element in sequence at line 1 column 66"#,
            r#"tenant-budget policy is not valid JSON: invalid length 2, expected 1 element in sequence at line 2 column 1"#,
        ],
    ),
    (
        r#"["default",7]"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: integer `7`, expected a string at line 1 column 50"#,
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: integer `7`, expected a string at line 1 column 51"#,
            r#"tenant-budget policy is not valid JSON: invalid type: integer `7`, expected a string at line 2 column 1"#,
        ],
    ),
    (
        r#"["nope"]"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown[0]: unknown variant `nope`, expected `reject` or `default` at line 1 column 44"#,
            r#"tenant-budget policy is not valid JSON: unknown[0]: unknown variant `nope`, expected `reject` or `default` at line 1 column 44"#,
            r#"tenant-budget policy is not valid JSON: unknown[0]: unknown variant `nope`, expected `reject` or `default` at line 1 column 121"#,
        ],
    ),
    (
        r#"[]"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: missing field `action` at line 1 column 39"#,
            r#"tenant-budget policy is not valid JSON: unknown: missing field `action` at line 1 column 39"#,
            r#"tenant-budget policy is not valid JSON: unknown: missing field `action` at line 1 column 116"#,
        ],
    ),
    (
        r#"[1]"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown[0]: invalid type: integer `1`, expected variant identifier at line 1 column 39"#,
            r#"tenant-budget policy is not valid JSON: unknown[0]: invalid type: integer `1`, expected variant identifier at line 1 column 39"#,
            r#"tenant-budget policy is not valid JSON: unknown[0]: invalid type: integer `1`, expected variant identifier at line 1 column 116"#,
        ],
    ),
    (
        r#""reject""#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: string "reject", expected internally tagged enum UnknownConfig at line 1 column 45"#,
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: string "reject", expected internally tagged enum UnknownConfig at line 1 column 45"#,
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: string "reject", expected internally tagged enum UnknownConfig at line 1 column 122"#,
        ],
    ),
    (
        r#"null"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: null, expected internally tagged enum UnknownConfig at line 1 column 41"#,
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: null, expected internally tagged enum UnknownConfig at line 1 column 41"#,
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: null, expected internally tagged enum UnknownConfig at line 1 column 118"#,
        ],
    ),
    (
        r#"5"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: integer `5`, expected internally tagged enum UnknownConfig at line 1 column 38"#,
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: integer `5`, expected internally tagged enum UnknownConfig at line 1 column 38"#,
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: integer `5`, expected internally tagged enum UnknownConfig at line 1 column 115"#,
        ],
    ),
    (
        r#"true"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: boolean `true`, expected internally tagged enum UnknownConfig at line 1 column 41"#,
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: boolean `true`, expected internally tagged enum UnknownConfig at line 1 column 41"#,
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: boolean `true`, expected internally tagged enum UnknownConfig at line 1 column 118"#,
        ],
    ),
    (
        r#"{"action":"reject","x":[1,2"#,
        [
            r#"tenant-budget policy is not valid JSON: expected `,` or `]` at line 1 column 72"#,
            r#"tenant-budget policy is not valid JSON: expected `,` or `]` at line 2 column 9"#,
            r#"tenant-budget policy is not valid JSON: expected `,` or `]` at line 2 column 1"#,
        ],
    ),
    (
        r#"{"action":"default","key":"nobody""#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: unknown field `orgs`, expected `key` at line 1 column 149"#,
            r#"tenant-budget policy is not valid JSON: unknown: unknown field `orgs`, expected `key` at line 2 column 79"#,
            r#"tenant-budget policy is not valid JSON: EOF while parsing an object at line 2 column 1"#,
        ],
    ),
    (
        r#"{"action":"default",
  "key": 5 }"#,
        [
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: integer `5`, expected a string at line 2 column 12"#,
            r#"tenant-budget policy is not valid JSON: unknown: invalid type: integer `5`, expected a string at line 2 column 13"#,
            r#"tenant-budget policy is not valid JSON: invalid type: integer `5`, expected a string at line 3 column 1"#,
        ],
    ),
];

#[test]
fn unknown_reads_and_refuses_as_the_derive_did() {
    for (value, expected) in CASES {
        assert_eq!(outcomes(value), expected.map(String::from), "unknown: {value}");
    }
}

#[test]
fn nesting_past_serde_jsons_limit_is_refused_even_where_reject_ignores_the_member() {
    let deep = format!(r#"{{"action":"reject","x":{}{}}}"#, "[".repeat(130), "]".repeat(130));
    for (got, column) in outcomes(&deep).iter().zip([186, 186, 263]) {
        assert_eq!(got, &format!("tenant-budget policy is not valid JSON: recursion limit exceeded at line 1 column {column}"));
    }
}
