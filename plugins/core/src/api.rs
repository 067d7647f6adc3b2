//! Which LLM API a request speaks, decided from its path.
//!
//! Gateways mount providers under prefixes (`/openai/v1/chat/completions`, `/anthropic/v1/messages`),
//! so only the path's last segments are looked at. The path alone cannot always tell chat from legacy
//! completions; [`crate::request::refine_kind`] settles that from the body.

/// The request/response dialect of an LLM endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApiKind {
    /// OpenAI `POST …/chat/completions` (also vLLM, SGLang, Ollama, most OpenAI-compatible servers).
    ChatCompletions,
    /// OpenAI legacy `POST …/completions`.
    Completions,
    /// OpenAI Responses API `POST …/responses`.
    Responses,
    /// Anthropic Messages API `POST …/messages`.
    AnthropicMessages,
}

impl ApiKind {
    /// All kinds, for iteration in tests, fuzzers and config validation.
    pub const ALL: [ApiKind; 4] = [ApiKind::ChatCompletions, ApiKind::Completions, ApiKind::Responses, ApiKind::AnthropicMessages];

    /// The kind served at `path`, if any.
    ///
    /// The query string and fragment are ignored and trailing slashes are allowed. Matching is on whole
    /// trailing segments: `*/chat/completions`, `*/completions`, `*/responses`, `*/messages`
    /// (e.g. `/v1/messages`, `/openai/v1/chat/completions`). Sub-resources such as
    /// `/v1/messages/count_tokens` or `/v1/responses/{id}` are not generation endpoints and give `None`.
    pub fn from_path(path: &str) -> Option<ApiKind> {
        let end = path.find(['?', '#']).unwrap_or(path.len());
        let path = path.get(..end).unwrap_or(path).trim_end_matches('/');
        let mut segments = path.rsplit('/');
        let last = segments.next()?;
        match last {
            "completions" => {
                if segments.next() == Some("chat") {
                    Some(ApiKind::ChatCompletions)
                } else {
                    Some(ApiKind::Completions)
                }
            }
            "responses" => Some(ApiKind::Responses),
            "messages" => Some(ApiKind::AnthropicMessages),
            _ => None,
        }
    }

    /// Stable label value: `"chat_completions"`, `"completions"`, `"responses"`, `"messages"`.
    pub fn as_str(self) -> &'static str {
        match self {
            ApiKind::ChatCompletions => "chat_completions",
            ApiKind::Completions => "completions",
            ApiKind::Responses => "responses",
            ApiKind::AnthropicMessages => "messages",
        }
    }

    /// The kind whose [`ApiKind::as_str`] is `label`.
    pub fn from_label(label: &str) -> Option<ApiKind> {
        ApiKind::ALL.into_iter().find(|k| k.as_str() == label)
    }
}

impl std::fmt::Display for ApiKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
