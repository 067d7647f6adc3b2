//! Token usage as reported by the upstream, normalised so OpenAI and Anthropic numbers mean the same.
//!
//! OpenAI's prompt count already includes cached tokens; Anthropic's `input_tokens` excludes cache
//! reads and cache writes. Sluice always stores the OpenAI meaning (all prompt tokens) in
//! [`Usage::input_tokens`] and keeps the cached / cache-creation parts separately for pricing.

use crate::json::{u64_at, u64_at2};
use serde_json::Value;

/// Token counts of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// All prompt tokens, including cached and cache-creation tokens (Anthropic `input_tokens +
    /// cache_read_input_tokens + cache_creation_input_tokens`; OpenAI `prompt_tokens` / `input_tokens`).
    pub input_tokens: u64,
    /// All generated tokens, including reasoning tokens.
    pub output_tokens: u64,
    /// Prompt tokens served from the provider's cache (OpenAI `*_tokens_details.cached_tokens`,
    /// Anthropic `cache_read_input_tokens`).
    pub cached_input_tokens: u64,
    /// Prompt tokens written to the cache (Anthropic only).
    pub cache_creation_input_tokens: u64,
    /// Reasoning tokens, a part of `output_tokens`.
    pub reasoning_tokens: u64,
}

impl Usage {
    /// `input_tokens + output_tokens`.
    pub fn total_tokens(&self) -> u64 {
        self.input_tokens.saturating_add(self.output_tokens)
    }

    /// Parse an OpenAI usage object. Accepts both the chat/completions names (`prompt_tokens`,
    /// `completion_tokens`, `prompt_tokens_details`, `completion_tokens_details`) and the Responses
    /// names (`input_tokens`, `output_tokens`, `input_tokens_details`, `output_tokens_details`), since
    /// compatible servers mix them. `None` if `v` is not an object or has neither count.
    pub fn from_openai(v: &Value) -> Option<Usage> {
        if !v.is_object() {
            return None;
        }
        let input = u64_at(v, "prompt_tokens").or_else(|| u64_at(v, "input_tokens"));
        let output = u64_at(v, "completion_tokens").or_else(|| u64_at(v, "output_tokens"));
        if input.is_none() && output.is_none() {
            return None;
        }
        Some(Usage {
            input_tokens: input.unwrap_or(0),
            output_tokens: output.unwrap_or(0),
            cached_input_tokens: u64_at2(v, "prompt_tokens_details", "cached_tokens")
                .or_else(|| u64_at2(v, "input_tokens_details", "cached_tokens"))
                .unwrap_or(0),
            cache_creation_input_tokens: 0,
            reasoning_tokens: u64_at2(v, "completion_tokens_details", "reasoning_tokens")
                .or_else(|| u64_at2(v, "output_tokens_details", "reasoning_tokens"))
                .unwrap_or(0),
        })
    }

    /// Parse an Anthropic usage object (`input_tokens`, `output_tokens`, `cache_read_input_tokens`,
    /// `cache_creation_input_tokens`), normalising `input_tokens` to include the cache parts.
    /// `None` if `v` is not an object or has no count at all.
    pub fn from_anthropic(v: &Value) -> Option<Usage> {
        let parts = AnthropicUsage::from_json(v)?;
        Some(parts.normalised())
    }
}

/// Anthropic usage fields as sent, each optional, so partial updates (`message_delta`) can be merged
/// into what `message_start` reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct AnthropicUsage {
    pub input: Option<u64>,
    pub output: Option<u64>,
    pub cache_read: Option<u64>,
    pub cache_creation: Option<u64>,
}

impl AnthropicUsage {
    pub(crate) fn from_json(v: &Value) -> Option<Self> {
        if !v.is_object() {
            return None;
        }
        let u = AnthropicUsage {
            input: u64_at(v, "input_tokens"),
            output: u64_at(v, "output_tokens"),
            cache_read: u64_at(v, "cache_read_input_tokens"),
            cache_creation: u64_at(v, "cache_creation_input_tokens"),
        };
        if u == AnthropicUsage::default() {
            return None;
        }
        Some(u)
    }

    /// Fields present in `newer` replace ours: Anthropic's counts are cumulative, never deltas.
    pub(crate) fn merge(&mut self, newer: AnthropicUsage) {
        self.input = newer.input.or(self.input);
        self.output = newer.output.or(self.output);
        self.cache_read = newer.cache_read.or(self.cache_read);
        self.cache_creation = newer.cache_creation.or(self.cache_creation);
    }

    pub(crate) fn normalised(&self) -> Usage {
        let cache_read = self.cache_read.unwrap_or(0);
        let cache_creation = self.cache_creation.unwrap_or(0);
        Usage {
            input_tokens: self.input.unwrap_or(0).saturating_add(cache_read).saturating_add(cache_creation),
            output_tokens: self.output.unwrap_or(0),
            cached_input_tokens: cache_read,
            cache_creation_input_tokens: cache_creation,
            reasoning_tokens: 0,
        }
    }
}
