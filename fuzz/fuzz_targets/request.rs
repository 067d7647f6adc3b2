//! Request inspection (request.rs) for every API kind against a reading of the same body as a
//! `serde_json::Value`, written here from request.rs's documentation. Whatever parse request.rs
//! uses, it must accept exactly the bodies serde_json accepts as an object, and report the same
//! model, stream flag, include_usage, output limit, end user, message count, tools flag and refined
//! kind; the output-choice count is within its documented bounds; never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use sluice_core::api::ApiKind;
use sluice_core::request::{inspect_request_with_kind, refine_kind, ContextBucket, RequestError, MESSAGE_OVERHEAD_TOKENS};

/// request.rs's refinement rules, restated.
fn expected_kind(kind: ApiKind, v: &Value) -> ApiKind {
    let has_messages = v.get("messages").is_some_and(Value::is_array);
    let has_prompt = v.get("prompt").is_some_and(|p| !p.is_null());
    match kind {
        ApiKind::Completions if has_messages && !has_prompt => ApiKind::ChatCompletions,
        ApiKind::ChatCompletions if has_prompt && !has_messages => ApiKind::Completions,
        other => other,
    }
}

fn nonempty(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).filter(|s| !s.is_empty()).map(str::to_owned)
}

fn check(kind: ApiKind, body: &[u8]) {
    let got = inspect_request_with_kind(kind, body);
    let v = match serde_json::from_slice::<Value>(body) {
        Err(_) => {
            assert!(matches!(got, Err(RequestError::NotJson(_))), "{kind}: serde_json rejects the body, inspection gave {got:?}");
            return;
        }
        Ok(v) if !v.is_object() => {
            assert_eq!(got, Err(RequestError::NotObject), "{kind}: the body is not an object");
            return;
        }
        Ok(v) => v,
    };
    let (refined, info) = match got {
        Ok(x) => x,
        Err(e) => panic!("{kind}: serde_json accepts the object, inspection failed: {e}"),
    };
    assert_eq!(refined, expected_kind(kind, &v), "refined kind");
    assert_eq!(refined, refine_kind(kind, &v), "refine_kind on the Value");
    assert_eq!(info.model.as_deref(), v.get("model").and_then(Value::as_str), "model");
    assert_eq!(info.stream, v.get("stream") == Some(&Value::Bool(true)), "stream");
    let include_usage = v.get("stream_options").and_then(|o| o.get("include_usage")) == Some(&Value::Bool(true));
    assert_eq!(info.include_usage, include_usage, "include_usage");
    let limit_keys: &[&str] = match refined {
        ApiKind::ChatCompletions => &["max_completion_tokens", "max_tokens", "max_output_tokens"],
        ApiKind::Completions | ApiKind::AnthropicMessages => &["max_tokens", "max_completion_tokens", "max_output_tokens"],
        ApiKind::Responses => &["max_output_tokens", "max_completion_tokens", "max_tokens"],
    };
    let limit = limit_keys.iter().find_map(|k| v.get(*k).and_then(Value::as_u64));
    assert_eq!(info.max_output_tokens, limit, "max_output_tokens");
    let user = match refined {
        ApiKind::AnthropicMessages => nonempty(v.get("metadata").and_then(|m| m.get("user_id"))),
        _ => nonempty(v.get("user")),
    };
    assert_eq!(info.user, user, "user");
    let array_len = |key: &str| v.get(key).and_then(Value::as_array).map_or(0, Vec::len);
    let messages = match refined {
        ApiKind::ChatCompletions | ApiKind::AnthropicMessages => array_len("messages"),
        ApiKind::Completions => 1,
        ApiKind::Responses => match v.get("input") {
            Some(Value::String(_)) => 1,
            Some(Value::Array(a)) => a.len(),
            _ => 0,
        },
    };
    assert_eq!(info.message_count as usize, messages, "message_count");
    let has_tools = ["tools", "functions"].iter().any(|k| v.get(*k).is_some_and(|t| !t.is_null()));
    assert_eq!(info.has_tools, has_tools, "has_tools");
    assert!((1..=1 << 20).contains(&info.output_choices), "output_choices {}", info.output_choices);
    if matches!(refined, ApiKind::Responses | ApiKind::AnthropicMessages) {
        assert_eq!(info.output_choices, 1, "output_choices");
    }
    assert!(info.prompt_tokens_estimate >= u64::from(info.message_count).saturating_mul(MESSAGE_OVERHEAD_TOKENS), "estimate below the message overhead");
    let assistant_turn =
        |items: Option<&Value>| items.and_then(Value::as_array).is_some_and(|a| a.iter().any(|m| m.get("role") == Some(&Value::from("assistant"))));
    let follow_up_shown = match refined {
        ApiKind::ChatCompletions | ApiKind::AnthropicMessages => assistant_turn(v.get("messages")),
        ApiKind::Responses => assistant_turn(v.get("input")) || v.get("previous_response_id").is_some_and(|p| !p.is_null()),
        ApiKind::Completions => false,
    };
    if follow_up_shown {
        assert!(info.follow_up, "an assistant turn is a follow-up");
    }
    let _ = ContextBucket::from_tokens(info.prompt_tokens_estimate).as_str();
}

fuzz_target!(|data: &[u8]| {
    for kind in ApiKind::ALL {
        check(kind, data);
    }
    if let Ok(path) = std::str::from_utf8(data) {
        let _ = ApiKind::from_path(path);
    }
});
