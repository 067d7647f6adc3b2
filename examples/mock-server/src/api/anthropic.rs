//! Anthropic Messages: `event:` + `data:` pairs in the documented order — `message_start` (usage
//! with input and cache tokens, `output_tokens: 1`), `content_block_start`, `ping`,
//! `content_block_delta` per token, `content_block_stop`, `message_delta` (stop reason and the
//! cumulative `output_tokens`), `message_stop`.

use super::{Event, Plan};
use serde_json::{json, Value};

fn stop_reason(plan: &Plan) -> &'static str {
    if plan.truncated {
        "max_tokens"
    } else {
        "end_turn"
    }
}

/// Anthropic reports cache reads separately from (not inside) `input_tokens`.
fn usage(plan: &Plan, output_tokens: u64) -> Value {
    json!({
        "input_tokens": plan.prompt_tokens.saturating_sub(plan.cached_tokens),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": plan.cached_tokens,
        "output_tokens": output_tokens,
    })
}

fn message(plan: &Plan, content: Value, stop_reason: Value, output_tokens: u64) -> Value {
    let mut m = json!({
        "id": plan.id,
        "type": "message",
        "role": "assistant",
        "model": plan.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": null,
    });
    if plan.usage {
        super::set(&mut m, "usage", usage(plan, output_tokens));
    }
    m
}

// The streamed events are written as their trees serialise (members by key): building a tree per
// event was most of what the simulator spent on an answer's first and last events. The trees
// themselves are kept in the tests (`tree`), which compare the bytes.

/// `s` as a JSON string, escaped by serde_json as a tree's strings are (writing one cannot fail).
fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

pub fn preamble(plan: &Plan) -> Vec<Event> {
    let (id, model) = (json_string(&plan.id), json_string(&plan.model));
    let mut start = String::with_capacity(id.len().saturating_add(model.len()).saturating_add(256));
    start.push_str(r#"{"message":{"content":[],"id":"#);
    start.push_str(&id);
    start.push_str(r#","model":"#);
    start.push_str(&model);
    start.push_str(r#","role":"assistant","stop_reason":null,"stop_sequence":null,"type":"message""#);
    if plan.usage {
        start.push_str(&format!(
            r#","usage":{{"cache_creation_input_tokens":0,"cache_read_input_tokens":{},"input_tokens":{},"output_tokens":1}}"#,
            plan.cached_tokens,
            plan.prompt_tokens.saturating_sub(plan.cached_tokens),
        ));
    }
    start.push_str(r#"},"type":"message_start"}"#);
    vec![
        Event { name: Some("message_start"), data: start },
        Event { name: Some("content_block_start"), data: r#"{"content_block":{"text":"","type":"text"},"index":0,"type":"content_block_start"}"#.into() },
        Event { name: Some("ping"), data: r#"{"type":"ping"}"#.into() },
    ]
}

pub fn token(text: &str) -> Event {
    let text = json_string(text);
    let mut data = String::with_capacity(text.len().saturating_add(80));
    data.push_str(r#"{"delta":{"text":"#);
    data.push_str(&text);
    data.push_str(r#","type":"text_delta"},"index":0,"type":"content_block_delta"}"#);
    Event { name: Some("content_block_delta"), data }
}

pub fn epilogue(plan: &Plan) -> Vec<Event> {
    let mut delta = format!(r#"{{"delta":{{"stop_reason":"{}","stop_sequence":null}},"type":"message_delta""#, stop_reason(plan));
    if plan.usage {
        delta.push_str(&format!(r#","usage":{{"output_tokens":{}}}"#, plan.completion_tokens()));
    }
    delta.push('}');
    vec![
        Event { name: Some("content_block_stop"), data: r#"{"index":0,"type":"content_block_stop"}"#.into() },
        Event { name: Some("message_delta"), data: delta },
        Event { name: Some("message_stop"), data: r#"{"type":"message_stop"}"#.into() },
    ]
}

pub fn full(plan: &Plan) -> Value {
    message(plan, json!([{"type": "text", "text": plan.text()}]), json!(stop_reason(plan)), plan.completion_tokens())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::api::Api;

    /// The streamed events as trees built them before they were written directly: the bytes the
    /// mock sent, which it must still send.
    mod tree {
        use super::super::{message, stop_reason, Event, Plan};
        use serde_json::{json, Value};

        pub fn preamble(plan: &Plan) -> Vec<Event> {
            vec![
                Event::named("message_start", json!({"type": "message_start", "message": message(plan, json!([]), Value::Null, 1)})),
                Event::named("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})),
                Event::named("ping", json!({"type": "ping"})),
            ]
        }

        pub fn token(text: &str) -> Event {
            Event::named("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}))
        }

        pub fn epilogue(plan: &Plan) -> Vec<Event> {
            let mut delta = json!({"type": "message_delta", "delta": {"stop_reason": stop_reason(plan), "stop_sequence": null}});
            if plan.usage {
                super::super::super::set(&mut delta, "usage", json!({"output_tokens": plan.completion_tokens()}));
            }
            vec![
                Event::named("content_block_stop", json!({"type": "content_block_stop", "index": 0})),
                Event::named("message_delta", delta),
                Event::named("message_stop", json!({"type": "message_stop"})),
            ]
        }
    }

    /// Every streamed event written directly is the tree's, byte for byte: usage on and off,
    /// stopped and cut short, names, ids and texts that need escaping, cached tokens above and
    /// below the prompt's, counts small and large.
    #[test]
    fn events_written_directly_are_the_trees_bytes() {
        let texts = ["", "tok0 ", "tok1 tok2 tok3 ", "a \"b\" \\ / \n\t\r\u{8}\u{c}\u{1}\u{1f}\u{7f} é 😀 \u{2028}", "\u{0}"];
        let mut compared = 0;
        for usage in [false, true] {
            for truncated in [false, true] {
                for (model, id) in [("claude-3", "msg_00ff"), ("m\"odel\\é\u{1}\u{0}", "msg_\"q\"\u{2}")] {
                    for (prompt, cached, reasoning, tokens) in
                        [(0, 0, 0, 0), (12, 2, 0, 3), (5, 9, 1, 7), (123_456, 1_000, 77, 4_096), (u64::MAX / 4, 5, 9, u64::MAX / 4)]
                    {
                        let plan = Plan {
                            api: Api::Messages,
                            model: model.to_owned(),
                            stream: true,
                            tokens,
                            truncated,
                            max_tokens: None,
                            prompt_tokens: prompt,
                            cached_tokens: cached,
                            reasoning_tokens: reasoning,
                            usage,
                            id: id.to_owned(),
                            item_id: "msg-1".to_owned(),
                            created: 1_700_000_000,
                        };
                        let mut direct = preamble(&plan);
                        let mut trees = tree::preamble(&plan);
                        for text in texts {
                            direct.push(token(text));
                            trees.push(tree::token(text));
                        }
                        direct.extend(epilogue(&plan));
                        trees.extend(tree::epilogue(&plan));
                        assert_eq!(direct, trees, "usage {usage} truncated {truncated} {model}");
                        for crlf in [false, true] {
                            let wire = |events: &[Event]| events.iter().flat_map(|e| e.render(crlf)).collect::<Vec<u8>>();
                            assert_eq!(wire(&direct), wire(&trees));
                        }
                        compared += direct.len();
                    }
                }
            }
        }
        assert!(compared > 200, "{compared}");
    }
}
