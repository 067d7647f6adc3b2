//! The modelled upstream: per version a batch of at most `max_batch` running requests and a FIFO
//! queue behind it; time to first token from the queue wait, a fixed part and the prefill of the
//! prompt; time per output token from the batch size (the formulas and draws are
//! `sluice_workload::upstream`'s, shared with the playground). The bytes it answers with are the
//! mock server's (`sluice-mock-server`'s renderers), so the simulator and the mock behind real
//! Envoy speak the same streams.

use std::collections::VecDeque;

use sluice_mock_server::api::{error_body, Api, Body, Plan};
use sluice_mock_server::controls::{Controls, UsageMode};

/// What one request is answered with, decided when it starts being served.
#[derive(Debug, Clone, PartialEq)]
pub struct Service {
    /// Time to first token from the moment the request reached the upstream (queue wait included), ns.
    pub ttft_ns: u64,
    /// Gap between content tokens, ns.
    pub itl_ns: u64,
    /// Content tokens it will send.
    pub tokens: u64,
    /// An error status instead of an answer.
    pub fail: Option<u16>,
    /// Requests running at the version when it started (itself included).
    pub running: u32,
}

/// One version's batch and queue.
#[derive(Debug, Default)]
pub struct VersionLoad {
    pub running: u32,
    pub queue: VecDeque<u64>,
}

/// The mock's controls for a request: its tokens and timing (the sim plays the timing itself).
pub fn controls(tokens: u64) -> Controls {
    Controls {
        ttft: std::time::Duration::ZERO,
        itl: std::time::Duration::ZERO,
        tokens,
        usage: UsageMode::Auto,
        keepalives: 0,
        fail: None,
        cached_tokens: 0,
        reasoning_tokens: 0,
        crlf: false,
        split: None,
        served_by: "sim".into(),
    }
}

/// The API of a request path, as the mock reads it.
pub fn api_of(path: &str) -> Option<Api> {
    Api::from_path(path)
}

/// A planned answer: what the upstream sends and when (offsets from the start of service, ns).
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// The whole body: the pieces one after the other, rendered into one buffer (a buffer a piece
    /// was a twentieth of a 16-token replay's allocations).
    pub body: Vec<u8>,
    /// Each piece's time and where it ends in `body`; the last one ends the response.
    pub pieces: Vec<(u64, usize)>,
}

impl Answer {
    /// Piece `n`'s bytes.
    pub fn piece(&self, n: usize) -> Option<&[u8]> {
        let end = self.pieces.get(n)?.1;
        let start = n.checked_sub(1).and_then(|p| self.pieces.get(p)).map_or(0, |(_, end)| *end);
        self.body.get(start..end)
    }

    /// An answer of one piece.
    fn whole(status: u16, headers: Vec<(String, String)>, at: u64, body: Vec<u8>) -> Answer {
        let pieces = vec![(at, body.len())];
        Answer { status, headers, body, pieces }
    }
}

/// Renders the answer to `body` on `path` given `service`, with tokens batched into chunks of
/// `chunk_ns` of time (the first token always alone, exactly at the TTFT).
pub fn answer(path: &str, body: &Body, service: &Service, chunk_ns: u64, tokens_per_event: u64) -> Answer {
    let Some(api) = api_of(path) else {
        return error_answer(path, 404, "unknown path", service);
    };
    if let Some(status) = service.fail {
        return error_answer(path, status, "upstream error (simulated)", service);
    }
    let plan = match Plan::of_body(api, body, &controls(service.tokens), None) {
        Ok(plan) => plan,
        Err(message) => return error_answer(path, 400, &message, service),
    };
    let end_ns = service.ttft_ns + service.itl_ns * plan.tokens.saturating_sub(1);
    if !plan.stream {
        let body = plan.full_body().to_string().into_bytes();
        return Answer::whole(200, vec![("content-type".into(), "application/json".into())], end_ns, body);
    }
    let mut seq = 0;
    let per_event = tokens_per_event.max(1);
    let template = plan.token_template();
    // The body's bytes reserved once: the events' (the first token alone, then `per_event` an
    // event) and a few hundred for the preamble and the epilogue.
    let events = usize::try_from(plan.tokens.saturating_sub(1).div_ceil(per_event)).unwrap_or(0).saturating_add(1);
    let mut bytes = Vec::with_capacity(template.size_hint(per_event).saturating_mul(events).saturating_add(1024));
    let mut pieces: Vec<(u64, usize)> = Vec::new();
    for event in plan.preamble(&mut seq) {
        event.render_into(false, &mut bytes);
    }
    if !bytes.is_empty() {
        pieces.push((0, bytes.len()));
    }
    // Chunk 0 is the first token alone; chunk k ≥ 1 holds the tokens whose offset after the first
    // lies in ((k − 1)·chunk, k·chunk], sent when its last token is due.
    let mut current: Option<(u64, u64)> = None;
    let mut i = 0;
    while i < plan.tokens {
        // The first token alone, at the TTFT; then events of `per_event` tokens, each sent when
        // its last token is due.
        let n = if i == 0 { 1 } else { per_event.min(plan.tokens - i) };
        let last = i + n - 1;
        let at = service.ttft_ns + service.itl_ns * last;
        let chunk = if i == 0 { 0 } else { (at - service.ttft_ns).div_ceil(chunk_ns.max(1)) };
        match &mut current {
            Some((k, t)) if *k == chunk => *t = at,
            _ => {
                if let Some((_, t)) = current.take() {
                    pieces.push((t, bytes.len()));
                }
                current = Some((chunk, at));
            }
        }
        template.render(&plan, i, n, &mut seq, &mut bytes);
        i += n;
    }
    // The epilogue ends the last chunk, written into it.
    let t = current.map_or(end_ns, |(_, t)| t);
    for event in plan.epilogue(&mut seq) {
        event.render_into(false, &mut bytes);
    }
    pieces.push((t, bytes.len()));
    Answer { status: 200, headers: vec![("content-type".into(), "text/event-stream".into()), ("cache-control".into(), "no-cache".into())], body: bytes, pieces }
}

fn error_answer(path: &str, status: u16, message: &str, service: &Service) -> Answer {
    let body = error_body(path, status, message).to_string().into_bytes();
    // The engine sets a failing request's TTFT to the fixed part alone: refused without prefill.
    Answer::whole(status, vec![("content-type".into(), "application/json".into())], service.ttft_ns, body)
}
