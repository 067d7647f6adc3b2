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

/// A chunk envelope around `choices` (their JSON text); `usage: null` is present exactly when
/// usage is on.
fn chunk(plan: &Plan, choices: &str) -> Event {
    Event { name: None, data: chunk_text(plan, choices, None) }
}

/// `s` as a JSON string, escaped by serde_json as a tree's strings are (writing one cannot fail).
fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// [`chunk_value`] serialised, with `usage` (when usage is on) set to `usage`'s JSON text
/// (`None`: `null`), written directly in the tree's member order (by key): the tree, rebuilt for
/// every chunk, was most of the cost of rendering an answer in the simulator.
fn chunk_text(plan: &Plan, choices: &str, usage: Option<&str>) -> String {
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
            Some(u) => out.push_str(u),
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

// The streamed chunks' `choices` and usage are written as their trees serialise (members by
// key): building a tree per event was most of what the simulator spent on an answer's first and
// last events. The trees themselves are kept in the tests (`tree`), which compare the bytes.

/// The first chat chunk: role only, no content. Sent at once, so it must not count as a token.
pub fn chat_role_chunk(plan: &Plan) -> Event {
    chunk(plan, r#"[{"delta":{"content":"","role":"assistant"},"finish_reason":null,"index":0,"logprobs":null}]"#)
}

pub fn chat_token_chunk(plan: &Plan, text: &str) -> Event {
    let text = json_string(text);
    let mut choices = String::with_capacity(text.len().saturating_add(80));
    choices.push_str(r#"[{"delta":{"content":"#);
    choices.push_str(&text);
    choices.push_str(r#"},"finish_reason":null,"index":0,"logprobs":null}]"#);
    chunk(plan, &choices)
}

pub fn completion_token_chunk(plan: &Plan, text: &str) -> Event {
    let text = json_string(text);
    let mut choices = String::with_capacity(text.len().saturating_add(80));
    choices.push_str(r#"[{"finish_reason":null,"index":0,"logprobs":null,"text":"#);
    choices.push_str(&text);
    choices.push_str("}]");
    chunk(plan, &choices)
}

/// [`Plan::openai_usage`] serialised.
fn usage_text(plan: &Plan) -> String {
    format!(
        r#"{{"completion_tokens":{},"completion_tokens_details":{{"reasoning_tokens":{}}},"prompt_tokens":{},"prompt_tokens_details":{{"cached_tokens":{}}},"total_tokens":{}}}"#,
        plan.completion_tokens(),
        plan.reasoning_tokens,
        plan.prompt_tokens,
        plan.cached_tokens,
        plan.prompt_tokens + plan.completion_tokens(),
    )
}

pub fn epilogue(plan: &Plan) -> Vec<Event> {
    let finish = match (plan.api, plan.truncated) {
        (Api::Chat, false) => r#"[{"delta":{},"finish_reason":"stop","index":0,"logprobs":null}]"#,
        (Api::Chat, true) => r#"[{"delta":{},"finish_reason":"length","index":0,"logprobs":null}]"#,
        (_, false) => r#"[{"finish_reason":"stop","index":0,"logprobs":null,"text":""}]"#,
        (_, true) => r#"[{"finish_reason":"length","index":0,"logprobs":null,"text":""}]"#,
    };
    let mut events = vec![chunk(plan, finish)];
    if plan.usage {
        events.push(Event { name: None, data: chunk_text(plan, "[]", Some(&usage_text(plan))) });
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

    /// The streamed events as trees built them before they were written directly: the bytes the
    /// mock sent, which it must still send.
    mod tree {
        use super::super::{chunk_value, finish_reason, Api, Event, Plan};
        use serde_json::{json, Value};

        fn chunk(plan: &Plan, choices: Value) -> Event {
            Event { name: None, data: chunk_value(plan, choices).to_string() }
        }

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
                super::super::super::set(&mut usage, "usage", plan.openai_usage());
                events.push(Event { name: None, data: usage.to_string() });
            }
            events.push(Event { name: None, data: "[DONE]".into() });
            events
        }
    }

    /// Every streamed event written directly is the tree's, byte for byte: chat and completions,
    /// usage on and off, stopped and cut short, names, ids and texts that need escaping, counts
    /// small and large.
    #[test]
    fn events_written_directly_are_the_trees_bytes() {
        let texts = ["", "tok0 ", "tok1 tok2 tok3 ", "a \"b\" \\ / \n\t\r\u{8}\u{c}\u{1}\u{1f}\u{7f} é 😀 \u{2028}", "\u{0}"];
        let mut compared = 0;
        for api in [Api::Chat, Api::Completions] {
            for usage in [false, true] {
                for truncated in [false, true] {
                    for model in ["llama-3-70b", "m\"odel\\é\u{1}\u{0}"] {
                        for (prompt, cached, reasoning, tokens) in
                            [(0, 0, 0, 0), (12, 2, 0, 3), (123_456, 1_000, 77, 4_096), (u64::MAX / 4, 5, 9, u64::MAX / 4)]
                        {
                            let plan = Plan {
                                truncated,
                                prompt_tokens: prompt,
                                cached_tokens: cached,
                                reasoning_tokens: reasoning,
                                tokens,
                                ..plan_for(api, model, usage)
                            };
                            let mut direct = vec![chat_role_chunk(&plan)];
                            let mut trees = vec![tree::chat_role_chunk(&plan)];
                            for text in texts {
                                direct.push(chat_token_chunk(&plan, text));
                                trees.push(tree::chat_token_chunk(&plan, text));
                                direct.push(completion_token_chunk(&plan, text));
                                trees.push(tree::completion_token_chunk(&plan, text));
                            }
                            direct.extend(epilogue(&plan));
                            trees.extend(tree::epilogue(&plan));
                            assert_eq!(direct, trees, "{api:?} usage {usage} truncated {truncated} {model}");
                            for crlf in [false, true] {
                                let wire = |events: &[Event]| events.iter().flat_map(|e| e.render(crlf)).collect::<Vec<u8>>();
                                assert_eq!(wire(&direct), wire(&trees));
                            }
                            compared += direct.len();
                        }
                    }
                }
            }
        }
        assert!(compared > 300, "{compared}");
    }

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
                    assert_eq!(chunk_text(&plan, "[]", Some(&plan.openai_usage().to_string())), expected);
                }
            }
        }
    }
}
