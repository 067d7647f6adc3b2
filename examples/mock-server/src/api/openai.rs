//! OpenAI chat completions (`chat.completion.chunk`) and legacy completions (`text_completion`):
//! `data:`-only events ending in `data: [DONE]`, with the usage chunk (`choices: []`) just before
//! it when usage is on, and `"usage": null` on every other chunk in that case.

use super::{Api, Event, Plan};
use serde_json::{json, Value};

/// Reported by every OpenAI-style answer, as real servers do.
const SYSTEM_FINGERPRINT: &str = "fp_sluice_mock";

fn finish_reason(plan: &Plan) -> &'static str {
    if plan.truncated {
        "length"
    } else {
        "stop"
    }
}

/// A chunk envelope around `choices`; `usage: null` is present exactly when usage is on.
fn chunk(plan: &Plan, choices: Value) -> Event {
    Event::data(chunk_value(plan, choices))
}

fn chunk_value(plan: &Plan, choices: Value) -> Value {
    let object = if plan.api == Api::Chat { "chat.completion.chunk" } else { "text_completion" };
    let mut v = json!({
        "id": plan.id,
        "object": object,
        "created": plan.created,
        "model": plan.model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": choices,
    });
    if plan.usage {
        super::set(&mut v, "usage", Value::Null);
    }
    v
}

/// The first chat chunk: role only, no content. Sent at once, so it must not count as a token.
pub fn chat_role_chunk(plan: &Plan) -> Event {
    chunk(plan, json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]))
}

pub fn chat_token_chunk(plan: &Plan, text: &str) -> Event {
    chunk(plan, json!([{"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": null}]))
}

pub fn completion_token_chunk(plan: &Plan, text: &str) -> Event {
    chunk(plan, json!([{"index": 0, "text": text, "logprobs": null, "finish_reason": null}]))
}

pub fn epilogue(plan: &Plan) -> Vec<Event> {
    let finish = match plan.api {
        Api::Chat => json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish_reason(plan)}]),
        _ => json!([{"index": 0, "text": "", "logprobs": null, "finish_reason": finish_reason(plan)}]),
    };
    let mut events = vec![chunk(plan, finish)];
    if plan.usage {
        let mut usage = chunk_value(plan, json!([]));
        super::set(&mut usage, "usage", plan.openai_usage());
        events.push(Event::data(usage));
    }
    events.push(Event { name: None, data: "[DONE]".into() });
    events
}

fn full(plan: &Plan, object: &str, choice: Value) -> Value {
    let mut v = json!({
        "id": plan.id,
        "object": object,
        "created": plan.created,
        "model": plan.model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [choice],
    });
    if plan.usage {
        super::set(&mut v, "usage", plan.openai_usage());
    }
    v
}

pub fn chat_full(plan: &Plan) -> Value {
    full(
        plan,
        "chat.completion",
        json!({
            "index": 0,
            "message": {"role": "assistant", "content": plan.text(), "refusal": null},
            "logprobs": null,
            "finish_reason": finish_reason(plan),
        }),
    )
}

pub fn completion_full(plan: &Plan) -> Value {
    full(plan, "text_completion", json!({"index": 0, "text": plan.text(), "logprobs": null, "finish_reason": finish_reason(plan)}))
}
