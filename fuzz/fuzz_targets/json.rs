//! The JSON readers of sluice-core: `json::parse_config` (every policy's entry point) against
//! `serde_json::from_slice`, and the byte scanner behind `rewrite::set_top_level_string` (the one
//! that locates members for every byte-exact edit) against the same edit on a `Value`.
//!
//! - `parse_config::<Value>` accepts exactly what serde_json accepts and gives the same value;
//! - for every body serde_json accepts as an object, setting each top-level member the body already
//!   has (and one it has not) gives a body that parses to the original with only that member
//!   changed, and the bytes before the object are kept.
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use sluice_core::json::parse_config;
use sluice_core::rewrite::set_top_level_string;

fuzz_target!(|data: &[u8]| {
    let Some((&pick, body)) = data.split_first() else { return };
    let direct = serde_json::from_slice::<Value>(body);
    let via = parse_config::<Value>(body);
    match (&direct, &via) {
        (Ok(a), Ok(b)) => assert_eq!(a, b),
        (Err(_), Err(_)) => {}
        _ => panic!("parse_config and serde_json disagree: {direct:?} vs {via:?}"),
    }
    let Ok(Value::Object(obj)) = direct else {
        let _ = set_top_level_string(body, "model", "m");
        return;
    };
    // The value written: chosen from strings that need escaping.
    let value = ["m", "quote\"back\\slash", "line\nbreak\u{1}", "é😊", ""][usize::from(pick) % 5];
    let mut keys: Vec<String> = obj.keys().filter(|k| k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')).cloned().collect();
    keys.push("sluice_fuzz_absent".into());
    for key in keys {
        let out = match set_top_level_string(body, &key, value) {
            Ok(out) => out,
            Err(e) => panic!("serde_json accepts the object, set_top_level_string refused it: {e}"),
        };
        let mut want = obj.clone();
        want.insert(key.clone(), Value::from(value));
        match serde_json::from_slice::<Value>(&out) {
            Ok(Value::Object(got)) => assert_eq!(got, want, "set {key}: {}", String::from_utf8_lossy(&out)),
            other => panic!("set {key}: not an object any more ({other:?}): {}", String::from_utf8_lossy(&out)),
        }
        let open = body.iter().position(|b| !b" \t\r\n".contains(b)).unwrap_or(0);
        assert_eq!(&out[..open], &body[..open], "bytes before the object changed");
    }
});
