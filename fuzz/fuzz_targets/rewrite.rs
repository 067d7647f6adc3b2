//! The byte-exact request rewrite (rewrite.rs `rewrite_request`) against the same edit made on a
//! `serde_json::Value`.
//!
//! rewrite.rs promises: syntax validated by serde_json, only the edited members changed or added,
//! decisions on the last occurrence of a key and edits on every occurrence. So, for every body
//! serde_json accepts as an object:
//! - the rewrite succeeds, and the rewritten body parses to the original `Value` with exactly the
//!   documented members set (`stream_options.include_usage`, the kind's output-limit members);
//! - `injected_include_usage` and `changed` say what happened; with nothing to do the body is the
//!   same bytes;
//! - rewriting the rewritten body again with the same arguments gives the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::{Map, Value};
use sluice_core::api::ApiKind;
use sluice_core::rewrite::rewrite_request;

/// The `Value` the rewrite must produce, and whether include_usage is injected.
fn expected(kind: ApiKind, v: &Value, inject: bool, limit: Option<u64>) -> (Value, bool) {
    let mut out = v.clone();
    let Some(obj) = out.as_object_mut() else { return (out, false) };
    let mut injected = false;
    if inject && matches!(kind, ApiKind::ChatCompletions | ApiKind::Completions) && obj.get("stream") == Some(&Value::Bool(true)) {
        let replacement = match obj.get("stream_options") {
            None | Some(Value::Null) => Some(Map::new()),
            Some(Value::Object(o)) if o.get("include_usage") != Some(&Value::Bool(true)) => Some(o.clone()),
            _ => None,
        };
        if let Some(mut o) = replacement {
            o.insert("include_usage".into(), Value::Bool(true));
            obj.insert("stream_options".into(), Value::Object(o));
            injected = true;
        }
    }
    if let Some(limit) = limit {
        let (keys, default): (&[&str], &str) = match kind {
            ApiKind::ChatCompletions => (&["max_completion_tokens", "max_tokens"], "max_tokens"),
            ApiKind::Completions | ApiKind::AnthropicMessages => (&["max_tokens"], "max_tokens"),
            ApiKind::Responses => (&["max_output_tokens"], "max_output_tokens"),
        };
        let present: Vec<&str> = keys.iter().copied().filter(|k| obj.contains_key(*k)).collect();
        if present.is_empty() {
            obj.insert(default.into(), Value::from(limit));
        }
        for k in present {
            obj.insert(k.into(), Value::from(limit));
        }
    }
    (out, injected)
}

fuzz_target!(|data: &[u8]| {
    let [flags, l0, l1, body @ ..] = data else { return };
    let kind = ApiKind::ALL[usize::from(flags & 3)];
    let inject = flags & 4 != 0;
    let limit = match (flags >> 3) & 3 {
        0 => None,
        1 => Some(u64::from(u16::from_le_bytes([*l0, *l1]))),
        2 => Some(u64::MAX),
        _ => Some(0),
    };
    let result = rewrite_request(kind, body, inject, limit);
    let parsed = serde_json::from_slice::<Value>(body).ok().filter(Value::is_object);
    let Some(v) = parsed else {
        // Bodies serde_json cannot hold as a Value (`1e400`) may still be rewritten; no panic is all.
        if let Ok(r) = result {
            assert_eq!(r.changed, r.body != body);
        }
        return;
    };
    let r = match result {
        Ok(r) => r,
        Err(e) => panic!("serde_json accepts the object, the rewrite refused it: {e}"),
    };
    let (want, injected) = expected(kind, &v, inject, limit);
    assert_eq!(r.injected_include_usage, injected, "injected_include_usage");
    assert_eq!(r.max_output_tokens_set, limit);
    assert_eq!(r.changed, r.body != body, "changed");
    if !injected && limit.is_none() {
        assert_eq!(r.body, body, "nothing to do, yet the bytes changed");
    }
    let got: Value = match serde_json::from_slice(&r.body) {
        Ok(got) => got,
        Err(e) => panic!("the rewritten body is not JSON ({e}): {}", String::from_utf8_lossy(&r.body)),
    };
    assert_eq!(got, want, "rewritten body: {}", String::from_utf8_lossy(&r.body));
    let again = match rewrite_request(kind, &r.body, inject, limit) {
        Ok(again) => again,
        Err(e) => panic!("the rewritten body cannot be rewritten again: {e}"),
    };
    assert_eq!(again.body, r.body, "a second rewrite changed the bytes again");
});
