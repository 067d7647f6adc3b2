//! Configuration errors name the member they are about (`versions[0].breaker: …`). sluice-core
//! finds that path after the fact, from serde_json's error position (`json::parse_config`); these
//! tests hold it to what a deserializer that tracks the path as it goes (`serde_path_to_error`)
//! says, over every shipped policy broken in every place: each value replaced by one of the wrong
//! type, each member removed, an unknown member added to each object, the text cut at every byte,
//! and stray characters put anywhere.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde::de::DeserializeOwned;
use serde_json::Value;
use sluice_core::budget::policy::PolicyConfig;
use sluice_core::flow::metrics::config::Config as MetricsConfig;
use sluice_core::json::{parse_config, parse_config_at};
use sluice_core::latency::policy::LatencyPolicyConfig;
use sluice_core::routing::policy::RoutingConfig;

/// The message a path-tracking deserializer gives: `path: error`, or the error alone at the top.
fn tracked<T: DeserializeOwned>(bytes: &[u8]) -> Result<(), String> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let parsed: Result<T, _> = serde_path_to_error::deserialize(&mut de);
    match parsed {
        Ok(_) => de.end().map_err(|e| e.to_string()),
        // A broken text is located by its line and column alone (sluice-core's choice: the tracked
        // path there names a member not read yet, `?`).
        Err(e) if e.inner().classify() != serde_json::error::Category::Data => Err(e.inner().to_string()),
        Err(e) => {
            let path = e.path().to_string();
            // As sluice-core's parse_config said it while it used this deserializer.
            Err(if path.is_empty() || path == "." { e.inner().to_string() } else { format!("{path}: {}", e.inner()) })
        }
    }
}

fn agree<T: DeserializeOwned>(text: &str, checked: &mut Checked) {
    let ours = parse_config::<T>(text.as_bytes()).map(|_| ());
    let theirs = tracked::<T>(text.as_bytes());
    if ours != theirs {
        let near = theirs.as_ref().err().and_then(|e| e.rsplit_once("column ")).and_then(|(_, c)| c.parse::<usize>().ok()).unwrap_or(0);
        let from = text.floor_char_boundary(near.saturating_sub(60));
        let to = text.ceil_char_boundary((near + 20).min(text.len()));
        panic!("paths differ\n  ours:   {ours:?}\n  theirs: {theirs:?}\n  near the column: {:?}\non the document:\n{text}", &text[from..to]);
    }
    match parse_config_at::<T>(text.as_bytes()) {
        Ok(_) => checked.valid += 1,
        Err(e) if !e.path.is_empty() => checked.with_path += 1,
        Err(_) => checked.without_path += 1,
    }
}

#[derive(Debug, Default)]
struct Checked {
    valid: usize,
    with_path: usize,
    without_path: usize,
}

/// Every JSON pointer of `v` with its value.
fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
    out.push(at.clone());
    match v {
        Value::Object(map) => map.iter().for_each(|(k, v)| pointers(v, format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")), out)),
        Value::Array(items) => items.iter().enumerate().for_each(|(i, v)| pointers(v, format!("{at}/{i}"), out)),
        _ => {}
    }
}

/// Both layouts: one line (columns far into it) and pretty (errors on later lines).
fn layouts(v: &Value) -> [String; 2] {
    [v.to_string(), serde_json::to_string_pretty(v).unwrap()]
}

fn break_everywhere<T: DeserializeOwned>(file: &str) -> Checked {
    let text = std::fs::read_to_string(format!("{}/../../policies/{file}", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    let mut checked = Checked::default();
    let mut all = Vec::new();
    pointers(&doc, String::new(), &mut all);
    let wrong: [Value; 9] = [
        Value::from("a string"),
        Value::from(-1),
        Value::from(1.5),
        Value::from(0),
        Value::from(u64::MAX),
        Value::Null,
        Value::Bool(true),
        serde_json::json!([]),
        serde_json::json!({"unknown_member": 1}),
    ];
    for pointer in &all {
        for replacement in &wrong {
            let mut broken = doc.clone();
            *broken.pointer_mut(pointer).unwrap() = replacement.clone();
            layouts(&broken).iter().for_each(|t| agree::<T>(t, &mut checked));
        }
        if let Some((parent, last)) = pointer.rsplit_once('/') {
            let mut broken = doc.clone();
            match broken.pointer_mut(parent).unwrap() {
                Value::Object(map) => {
                    map.remove(last);
                }
                Value::Array(items) => {
                    items.remove(last.parse::<usize>().unwrap());
                }
                _ => unreachable!(),
            }
            layouts(&broken).iter().for_each(|t| agree::<T>(t, &mut checked));
        }
        let mut broken = doc.clone();
        if let Some(Value::Object(map)) = broken.pointer_mut(pointer) {
            map.insert("not_a_field".into(), Value::from(1));
            layouts(&broken).iter().for_each(|t| agree::<T>(t, &mut checked));
        }
    }
    // The text cut at every byte, and a stray character at every byte: mostly broken texts (no
    // path), some still well formed with a member that is not one (a quote moved).
    let t = doc.to_string();
    for cut in (0..t.len()).filter(|&i| t.is_char_boundary(i)) {
        agree::<T>(&t[..cut], &mut checked);
        for stray in ["x", "}", "\""] {
            agree::<T>(&format!("{}{stray}{}", &t[..cut], &t[cut..]), &mut checked);
        }
    }
    checked
}

/// [`break_everywhere`] on each file, each broken into hundreds of documents of both kinds.
fn break_each<T: DeserializeOwned>(files: &[&str]) {
    for file in files {
        let checked = break_everywhere::<T>(file);
        assert!(checked.with_path > 500 && checked.without_path > 500 && checked.valid > 0, "{file}: {checked:?}");
    }
}

#[test]
fn paths_agree_with_a_tracking_deserializer_on_broken_latency_policies() {
    break_each::<LatencyPolicyConfig>(&["latency-guard.example.json", "latency-guard.demo.json", "latency-guard.e2e.json"]);
}

#[test]
fn paths_agree_with_a_tracking_deserializer_on_broken_routing_policies() {
    break_each::<RoutingConfig>(&["model-router.demo.json", "model-router.latency-e2e.json"]);
}

#[test]
fn paths_agree_with_a_tracking_deserializer_on_broken_budget_policies() {
    break_each::<PolicyConfig>(&["tenant-budget.example.json", "tenant-budget.full.json", "tenant-budget.fleet.json"]);
}

#[test]
fn paths_agree_with_a_tracking_deserializer_on_broken_metrics_settings() {
    let checked = break_everywhere::<MetricsConfig>("llm-metrics.demo.json");
    assert!(checked.with_path > 20 && checked.valid > 0, "{checked:?}");
}

#[test]
fn repeated_members_and_keys_with_escapes() {
    let mut checked = Checked::default();
    for text in [
        r#"{"versions": [], "versions": []}"#,
        r#"{"versions": [{"name": "v1", "name": "v2"}]}"#,
        r#"{"versions": [{"na\u006de": 1}]}"#,
        r#"{"vers\u0069ons": {}}"#,
        "{\"versions\"\n:\n[\n{\n\"name\"\n:\n7\n}\n]\n}",
        r#"{"versions": [{"name": "v1"}, {"name": "v2"}] , }"#,
        "",
        "[]",
        "  {  }  x",
    ] {
        agree::<LatencyPolicyConfig>(text, &mut checked);
        agree::<RoutingConfig>(text, &mut checked);
    }
}
