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
    Event { name: None, data: chunk_text(plan, &choices.to_string(), None) }
}

/// [`chunk_value`] serialised, with `usage` (when usage is on) set to `usage` (`None`: `null`),
/// written directly in the tree's member order (by key): the tree, rebuilt for every chunk, was
/// most of the cost of rendering an answer in the simulator.
fn chunk_text(plan: &Plan, choices: &str, usage: Option<&Value>) -> String {
    let object = if plan.api == Api::Chat { "chat.completion.chunk" } else { "text_completion" };
    let mut out = String::with_capacity(choices.len().saturating_add(plan.id.len()).saturating_add(plan.model.len()).saturating_add(160));
    out.push_str("{\"choices\":");
    out.push_str(choices);
    out.push_str(",\"created\":");
    out.push_str(&plan.created.to_string());
    // Strings escaped by serde_json, as the tree's were (writing a string cannot fail).
    out.push_str(",\"id\":");
    out.push_str(&serde_json::to_string(&plan.id).unwrap_or_default());
    out.push_str(",\"model\":");
    out.push_str(&serde_json::to_string(&plan.model).unwrap_or_default());
    out.push_str(",\"object\":\"");
    out.push_str(object);
    out.push_str("\",\"system_fingerprint\":\"");
    out.push_str(SYSTEM_FINGERPRINT);
    out.push('"');
    if plan.usage {
        out.push_str(",\"usage\":");
        match usage {
            Some(u) => out.push_str(&u.to_string()),
            None => out.push_str("null"),
        }
    }
    out.push('}');
    out
}

/// The chunk envelope as a tree: what [`chunk_text`] writes (compared in the tests).
#[cfg(test)]
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
        events.push(Event { name: None, data: chunk_text(plan, "[]", Some(&plan.openai_usage())) });
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn plan_for(api: Api, model: &str, usage: bool) -> Plan {
        Plan {
            api,
            model: model.to_owned(),
            stream: true,
            tokens: 3,
            truncated: false,
            max_tokens: None,
            prompt_tokens: 12,
            cached_tokens: 2,
            reasoning_tokens: 0,
            usage,
            id: "chatcmpl-\"q\"".to_owned(),
            item_id: "msg-1".to_owned(),
            created: 1_700_000_000,
        }
    }

    /// The envelope written directly is the tree's serialisation, byte for byte: every API, usage
    /// on and off, ids and models that need escaping, the usage chunk.
    #[test]
    fn chunks_written_directly_are_the_trees_bytes() {
        for api in [Api::Chat, Api::Completions] {
            for usage in [false, true] {
                for model in ["llama-3-70b", "m\"odel\\é\u{1}"] {
                    let plan = plan_for(api, model, usage);
                    let choices = json!([{"index": 0, "delta": {"content": "a \"b\""}, "logprobs": null, "finish_reason": null}]);
                    assert_eq!(chunk_text(&plan, &choices.to_string(), None), chunk_value(&plan, choices).to_string());
                    let mut tree = chunk_value(&plan, json!([]));
                    super::super::set(&mut tree, "usage", plan.openai_usage());
                    let expected = if usage { tree.to_string() } else { chunk_value(&plan, json!([])).to_string() };
                    assert_eq!(chunk_text(&plan, "[]", Some(&plan.openai_usage())), expected);
                }
            }
        }
    }
}
