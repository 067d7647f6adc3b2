//! Criterion benchmarks of `sluice-core` stream observation: MB/s over realistic 1000-token
//! OpenAI chat and Anthropic streams fed one chunk per event, and ns per chunk.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sluice_core::api::ApiKind;
use sluice_core::response::StreamObserver;
use std::hint::black_box;

const TOKENS: usize = 1000;
const WORDS: [&str; 8] = [" the", " model", " answers", " quickly", ",", " and", " tokens", " flow"];

/// One SSE event per chunk, as an upstream flushing per token sends them.
fn openai_chat_chunks() -> Vec<Vec<u8>> {
    let head = r#"data: {"id":"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT","object":"chat.completion.chunk","created":1741569952,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_06737a9306","choices":[{"index":0,"delta":"#;
    let mut chunks =
        vec![format!("{head}{{\"role\":\"assistant\",\"content\":\"\",\"refusal\":null}},\"logprobs\":null,\"finish_reason\":null}}],\"usage\":null}}\n\n")];
    for i in 0..TOKENS {
        chunks.push(format!("{head}{{\"content\":\"{}\"}},\"logprobs\":null,\"finish_reason\":null}}],\"usage\":null}}\n\n", WORDS[i % WORDS.len()]));
    }
    chunks.push(format!("{head}{{}},\"logprobs\":null,\"finish_reason\":\"stop\"}}],\"usage\":null}}\n\n"));
    chunks.push(r#"data: {"id":"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT","object":"chat.completion.chunk","created":1741569952,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_06737a9306","choices":[],"usage":{"prompt_tokens":19,"completion_tokens":1000,"total_tokens":1019,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}

"#.to_owned());
    chunks.push("data: [DONE]\n\n".to_owned());
    chunks.into_iter().map(String::into_bytes).collect()
}

fn anthropic_chunks() -> Vec<Vec<u8>> {
    let mut chunks = vec![
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_01XFDUDYJgAACzvnptvVoYEL\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"claude-sonnet-4-5-20250929\",\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":25,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":0,\"output_tokens\":1}}}\n\n".to_owned(),
        "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n".to_owned(),
        "event: ping\ndata: {\"type\": \"ping\"}\n\n".to_owned(),
    ];
    for i in 0..TOKENS {
        chunks.push(format!(
            "event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":\"{}\"}}}}\n\n",
            WORDS[i % WORDS.len()]
        ));
    }
    chunks.push("event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n".to_owned());
    chunks.push("event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":1000}}\n\n".to_owned());
    chunks.push("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n".to_owned());
    chunks.into_iter().map(String::into_bytes).collect()
}

fn observe(kind: ApiKind, chunks: &[Vec<u8>]) -> u64 {
    let mut o = StreamObserver::new(kind);
    for c in chunks {
        black_box(o.push(black_box(c)));
    }
    o.finish();
    let s = o.summary();
    assert_eq!(s.content_chunks, TOKENS as u64);
    s.usage.output_tokens
}

fn streams(c: &mut Criterion) {
    for (name, kind, chunks) in
        [("openai_chat_1000_tokens", ApiKind::ChatCompletions, openai_chat_chunks()), ("anthropic_1000_tokens", ApiKind::AnthropicMessages, anthropic_chunks())]
    {
        let bytes: usize = chunks.iter().map(Vec::len).sum();
        let mut g = c.benchmark_group("stream_bytes");
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_function(name, |b| b.iter(|| observe(kind, &chunks)));
        g.finish();

        // Same work, reported per chunk: the cost added to each body callback.
        let mut g = c.benchmark_group("stream_chunks");
        g.throughput(Throughput::Elements(chunks.len() as u64));
        g.bench_function(name, |b| b.iter(|| observe(kind, &chunks)));
        g.finish();
    }

    // One event split byte-by-byte: the framer's worst case for carry-over.
    let chunks = openai_chat_chunks();
    let event = &chunks[1];
    let mut g = c.benchmark_group("split_event");
    g.throughput(Throughput::Bytes(event.len() as u64));
    g.bench_function("openai_chunk_bytewise", |b| {
        b.iter(|| {
            let mut o = StreamObserver::new(ApiKind::ChatCompletions);
            for byte in event.chunks(1) {
                black_box(o.push(byte));
            }
            o.summary().content_chunks
        })
    });
    g.finish();
}

criterion_group!(benches, streams);
criterion_main!(benches);
