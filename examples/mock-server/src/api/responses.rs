//! OpenAI Responses API: typed events (`event:` + `data:` lines, each with a `sequence_number`),
//! from `response.created` to `response.completed` (or `response.incomplete` when
//! `max_output_tokens` cut the answer), whose `response.usage` carries the token counts.

use super::{Event, Plan};
use serde_json::{json, Value};

/// Takes the next sequence number of the stream.
pub fn next(seq: &mut u64) -> u64 {
    let n = *seq;
    *seq += 1;
    n
}

fn usage(plan: &Plan) -> Value {
    if !plan.usage {
        return Value::Null;
    }
    json!({
        "input_tokens": plan.prompt_tokens,
        "input_tokens_details": {"cached_tokens": plan.cached_tokens},
        "output_tokens": plan.completion_tokens(),
        "output_tokens_details": {"reasoning_tokens": plan.reasoning_tokens},
        "total_tokens": plan.prompt_tokens + plan.completion_tokens(),
    })
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": []})
}

fn message_item(plan: &Plan, status: &str, content: Value) -> Value {
    json!({"id": plan.item_id, "type": "message", "status": status, "role": "assistant", "content": content})
}

/// The `response` object in a given state.
fn response(plan: &Plan, status: &str, output: Value, usage: Value) -> Value {
    let incomplete = if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Value::Null };
    json!({
        "id": plan.id,
        "object": "response",
        "created_at": plan.created,
        "status": status,
        "error": null,
        "incomplete_details": incomplete,
        "instructions": null,
        "max_output_tokens": plan.max_tokens,
        "model": plan.model,
        "output": output,
        "parallel_tool_calls": true,
        "previous_response_id": null,
        "reasoning": {"effort": null, "summary": null},
        "store": false,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": usage,
        "metadata": {},
    })
}

fn final_status(plan: &Plan) -> &'static str {
    if plan.truncated {
        "incomplete"
    } else {
        "completed"
    }
}

pub fn preamble(plan: &Plan, seq: &mut u64) -> Vec<Event> {
    let pending = response(plan, "in_progress", json!([]), Value::Null);
    vec![
        Event::named("response.created", json!({"type": "response.created", "sequence_number": next(seq), "response": pending})),
        Event::named("response.in_progress", json!({"type": "response.in_progress", "sequence_number": next(seq), "response": pending})),
        Event::named(
            "response.output_item.added",
            json!({"type": "response.output_item.added", "sequence_number": next(seq), "output_index": 0,
                   "item": message_item(plan, "in_progress", json!([]))}),
        ),
        Event::named(
            "response.content_part.added",
            json!({"type": "response.content_part.added", "sequence_number": next(seq), "item_id": plan.item_id,
                   "output_index": 0, "content_index": 0, "part": text_part("")}),
        ),
    ]
}

pub fn token(plan: &Plan, text: &str, seq: &mut u64) -> Event {
    Event::named(
        "response.output_text.delta",
        json!({"type": "response.output_text.delta", "sequence_number": next(seq), "item_id": plan.item_id,
               "output_index": 0, "content_index": 0, "delta": text, "logprobs": []}),
    )
}

pub fn epilogue(plan: &Plan, seq: &mut u64) -> Vec<Event> {
    let text = plan.text();
    let item = message_item(plan, final_status(plan), json!([text_part(&text)]));
    let done_type = if plan.truncated { "response.incomplete" } else { "response.completed" };
    vec![
        Event::named(
            "response.output_text.done",
            json!({"type": "response.output_text.done", "sequence_number": next(seq), "item_id": plan.item_id,
                   "output_index": 0, "content_index": 0, "text": text, "logprobs": []}),
        ),
        Event::named(
            "response.content_part.done",
            json!({"type": "response.content_part.done", "sequence_number": next(seq), "item_id": plan.item_id,
                   "output_index": 0, "content_index": 0, "part": text_part(&text)}),
        ),
        Event::named("response.output_item.done", json!({"type": "response.output_item.done", "sequence_number": next(seq), "output_index": 0, "item": item})),
        Event::named(
            done_type,
            json!({"type": done_type, "sequence_number": next(seq),
                   "response": response(plan, final_status(plan), json!([item]), usage(plan))}),
        ),
    ]
}

pub fn full(plan: &Plan) -> Value {
    let item = message_item(plan, final_status(plan), json!([text_part(&plan.text())]));
    response(plan, final_status(plan), json!([item]), usage(plan))
}
