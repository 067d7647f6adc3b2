//! The typed, borrowing parse of stream events (response.rs `openai_fast`, `anthropic_fast`)
//! against the general `Value` path. The fast path promises to take only shapes it handles exactly
//! as the general path does and to leave everything else to it; so whenever it takes an event whose
//! data serde_json accepts as a `Value`, both must give the same chunk outcome and summary.
//! (Data serde_json rejects — `1e400`, a lone surrogate in a skipped member — the fast path may
//! still read; the general path counts it malformed.)
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_core::api::ApiKind;
use sluice_core::response::fuzzing::fast_and_value_paths;

/// Event types the fast paths look at, and a few they must leave alone.
const EVENTS: [Option<&str>; 8] = [
    None,
    Some("content_block_delta"),
    Some("message_stop"),
    Some("ping"),
    Some("content_block_stop"),
    Some("error"),
    Some("message_delta"),
    Some("message_start"),
];

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else { return };
    let kind = ApiKind::ALL[usize::from(selector & 3)];
    let event = EVENTS[usize::from((selector >> 2) & 7)];
    let Ok(text) = std::str::from_utf8(rest) else { return };
    // As the observer hands it over: trimmed, never empty or `[DONE]`.
    let text = text.trim();
    if text.is_empty() || text == "[DONE]" {
        return;
    }
    let Some((fast, value)) = fast_and_value_paths(kind, event, text) else { return };
    if serde_json::from_str::<serde_json::Value>(text).is_ok() {
        assert_eq!(fast, value, "{kind} fast path disagrees with the Value path on event {event:?}");
    }
});
