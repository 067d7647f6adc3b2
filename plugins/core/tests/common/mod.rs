//! Realistic upstream payloads and feeding helpers shared by the integration tests.
#![allow(dead_code)]

use sluice_core::api::ApiKind;
use sluice_core::response::{ChunkOutcome, ResponseSummary, StreamObserver};

pub const CHAT_ID: &str = "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT";

/// One OpenAI chat chunk as servers send it (id/object/created/model/system_fingerprint, usage null).
pub fn chat_chunk(delta: &str, finish: Option<&str>) -> String {
    let finish = finish.map_or("null".to_owned(), |f| format!("\"{f}\""));
    format!(
        "data: {{\"id\":\"{CHAT_ID}\",\"object\":\"chat.completion.chunk\",\"created\":1741569952,\
         \"model\":\"gpt-4o-mini-2024-07-18\",\"service_tier\":\"default\",\
         \"system_fingerprint\":\"fp_06737a9306\",\"choices\":[{{\"index\":0,\"delta\":{delta},\
         \"logprobs\":null,\"finish_reason\":{finish}}}],\"usage\":null}}\n\n"
    )
}

pub const CHAT_USAGE: &str = "\"usage\":{\"prompt_tokens\":19,\"completion_tokens\":10,\"total_tokens\":29,\
\"prompt_tokens_details\":{\"cached_tokens\":0,\"audio_tokens\":0},\"completion_tokens_details\":\
{\"reasoning_tokens\":0,\"audio_tokens\":0,\"accepted_prediction_tokens\":0,\"rejected_prediction_tokens\":0}}";

/// The include_usage chunk with the given `choices` JSON (`[]`, `null`, or a non-empty array).
pub fn chat_usage_chunk(choices: &str, usage: &str) -> String {
    format!(
        "data: {{\"id\":\"{CHAT_ID}\",\"object\":\"chat.completion.chunk\",\"created\":1741569952,\
         \"model\":\"gpt-4o-mini-2024-07-18\",\"service_tier\":\"default\",\
         \"system_fingerprint\":\"fp_06737a9306\",\"choices\":{choices},{usage}}}\n\n"
    )
}

/// A full chat stream: role-only chunk, one chunk per token, finish chunk, optional usage, [DONE].
pub fn chat_stream(tokens: &[&str], usage_choices: Option<&str>) -> String {
    let mut s = chat_chunk(r#"{"role":"assistant","content":"","refusal":null}"#, None);
    for t in tokens {
        let delta = serde_json::json!({ "content": t }).to_string();
        s.push_str(&chat_chunk(&delta, None));
    }
    s.push_str(&chat_chunk("{}", Some("stop")));
    if let Some(choices) = usage_choices {
        s.push_str(&chat_usage_chunk(choices, CHAT_USAGE));
    }
    s.push_str("data: [DONE]\n\n");
    s
}

pub const HELLO_TOKENS: [&str; 10] = ["Hello", "!", " How", " can", " I", " assist", " you", " today", "?", " 😊"];

/// A full Anthropic Messages stream with text, as sent by the API (event + data lines, ping).
pub fn anthropic_stream(texts: &[&str]) -> String {
    let mut s = String::from(
        "event: message_start\n\
         data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_01XFDUDYJgAACzvnptvVoYEL\",\"type\":\"message\",\
         \"role\":\"assistant\",\"content\":[],\"model\":\"claude-sonnet-4-5-20250929\",\"stop_reason\":null,\
         \"stop_sequence\":null,\"usage\":{\"input_tokens\":25,\"cache_creation_input_tokens\":100,\
         \"cache_read_input_tokens\":2000,\"output_tokens\":1}}}\n\n\
         event: content_block_start\n\
         data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n\
         event: ping\n\
         data: {\"type\": \"ping\"}\n\n",
    );
    for t in texts {
        let data = serde_json::json!({
            "type": "content_block_delta", "index": 0,
            "delta": { "type": "text_delta", "text": t }
        });
        s.push_str(&format!("event: content_block_delta\ndata: {data}\n\n"));
    }
    s.push_str(
        "event: content_block_stop\n\
         data: {\"type\":\"content_block_stop\",\"index\":0}\n\n\
         event: message_delta\n\
         data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\
         \"usage\":{\"output_tokens\":15}}\n\n\
         event: message_stop\n\
         data: {\"type\":\"message_stop\"}\n\n",
    );
    s
}

/// A Responses API stream (typed events, `event:` lines and `data.type`).
pub fn responses_stream(deltas: &[&str]) -> String {
    let resp = |status: &str, usage: &str| {
        format!(
            "{{\"id\":\"resp_67c9fdcecf488190bdd9a0409de3a1ec\",\"object\":\"response\",\"created_at\":1741290958,\
             \"status\":\"{status}\",\"error\":null,\"incomplete_details\":null,\"instructions\":null,\
             \"max_output_tokens\":null,\"model\":\"gpt-4.1-2025-04-14\",\"output\":[],\
             \"parallel_tool_calls\":true,\"previous_response_id\":null,\"temperature\":1.0,\
             \"text\":{{\"format\":{{\"type\":\"text\"}}}},\"tool_choice\":\"auto\",\"tools\":[],\"top_p\":1.0,\
             \"truncation\":\"disabled\",\"usage\":{usage},\"user\":null,\"metadata\":{{}}}}"
        )
    };
    let mut seq = 0;
    let mut ev = |s: &mut String, ty: &str, body: String| {
        s.push_str(&format!("event: {ty}\ndata: {{\"type\":\"{ty}\",\"sequence_number\":{seq},{body}}}\n\n"));
        seq += 1;
    };
    let mut s = String::new();
    ev(&mut s, "response.created", format!("\"response\":{}", resp("in_progress", "null")));
    ev(&mut s, "response.in_progress", format!("\"response\":{}", resp("in_progress", "null")));
    ev(
        &mut s,
        "response.output_item.added",
        "\"output_index\":0,\"item\":{\"id\":\"msg_67c9fdcf37fc8190ba82116e33fb28c5\",\"type\":\"message\",\
         \"status\":\"in_progress\",\"role\":\"assistant\",\"content\":[]}"
            .to_owned(),
    );
    ev(
        &mut s,
        "response.content_part.added",
        "\"item_id\":\"msg_67c9fdcf37fc8190ba82116e33fb28c5\",\"output_index\":0,\"content_index\":0,\
         \"part\":{\"type\":\"output_text\",\"text\":\"\",\"annotations\":[]}"
            .to_owned(),
    );
    for d in deltas {
        let delta = serde_json::to_string(d).unwrap();
        ev(
            &mut s,
            "response.output_text.delta",
            format!(
                "\"item_id\":\"msg_67c9fdcf37fc8190ba82116e33fb28c5\",\"output_index\":0,\
                 \"content_index\":0,\"delta\":{delta},\"logprobs\":[]"
            ),
        );
    }
    let full: String = deltas.concat();
    let full = serde_json::to_string(&full).unwrap();
    ev(
        &mut s,
        "response.output_text.done",
        format!(
            "\"item_id\":\"msg_67c9fdcf37fc8190ba82116e33fb28c5\",\"output_index\":0,\"content_index\":0,\
             \"text\":{full},\"logprobs\":[]"
        ),
    );
    ev(
        &mut s,
        "response.completed",
        format!(
            "\"response\":{}",
            resp(
                "completed",
                "{\"input_tokens\":37,\"input_tokens_details\":{\"cached_tokens\":12},\
                 \"output_tokens\":11,\"output_tokens_details\":{\"reasoning_tokens\":4},\"total_tokens\":48}"
            )
        ),
    );
    s
}

/// Feed `body` in one push and finish.
pub fn observe_whole(kind: ApiKind, body: &[u8]) -> (Vec<ChunkOutcome>, ResponseSummary) {
    let mut o = StreamObserver::new(kind);
    let outs = vec![o.push(body), o.finish()];
    (outs, o.summary())
}

/// Feed `body` one byte per push and finish.
pub fn observe_bytewise(kind: ApiKind, body: &[u8]) -> (Vec<ChunkOutcome>, ResponseSummary) {
    let mut o = StreamObserver::new(kind);
    let mut outs: Vec<ChunkOutcome> = body.chunks(1).map(|b| o.push(b)).collect();
    outs.push(o.finish());
    (outs, o.summary())
}

/// Feed `body` in the given chunks.
pub fn observe_chunks(kind: ApiKind, chunks: &[&str]) -> (Vec<ChunkOutcome>, ResponseSummary) {
    let mut o = StreamObserver::new(kind);
    let mut outs: Vec<ChunkOutcome> = chunks.iter().map(|c| o.push(c.as_bytes())).collect();
    outs.push(o.finish());
    (outs, o.summary())
}

/// Index of the first outcome with content (the chunk TTFT is measured at).
pub fn first_content(outs: &[ChunkOutcome]) -> Option<usize> {
    outs.iter().position(|o| o.content_events > 0)
}
