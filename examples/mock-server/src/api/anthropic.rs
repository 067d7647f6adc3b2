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
        super::set(&mut delta, "usage", json!({"output_tokens": plan.completion_tokens()}));
    }
    vec![
        Event::named("content_block_stop", json!({"type": "content_block_stop", "index": 0})),
        Event::named("message_delta", delta),
        Event::named("message_stop", json!({"type": "message_stop"})),
    ]
}

pub fn full(plan: &Plan) -> Value {
    message(plan, json!([{"type": "text", "text": plan.text()}]), json!(stop_reason(plan)), plan.completion_tokens())
}
