//! The request a trace line stands for: its path and JSON body, with a prompt text of the size the
//! trace gives. The simulator sends these bytes through the plugins (and a replay against real
//! Envoy sends the same); the playground hands the same body to core's request inspection, so both
//! size, clamp and charge the same request.

use sluice_core::api::ApiKind;

/// What the prompt text is cut from: plain words, 4 characters a token as the mock counts them.
const WORDS: &str = "the quick brown fox jumps over the lazy dog while sluice counts every token ";

/// Characters of the prompt text for `prompt_tokens`: the mock counts 4 characters a token plus
/// 4 tokens per message, so the text is 4 × (prompt_tokens − 4) characters (none below 5 tokens).
pub fn prompt_chars(prompt_tokens: u64) -> u64 {
    prompt_tokens.saturating_sub(4).saturating_mul(4)
}

/// The prompt text that the mock counts as `prompt_tokens` tokens, cut from `filler`, which grows
/// as needed and is reused across requests (one allocation for the whole run).
pub fn prompt_text(filler: &mut String, prompt_tokens: u64) -> &str {
    let chars = usize::try_from(prompt_chars(prompt_tokens)).unwrap_or(usize::MAX);
    while filler.len() < chars {
        filler.push_str(WORDS);
    }
    filler.get(..chars).unwrap_or_default()
}

/// The path and JSON body of a request of `api`: the prompt `text` as the API carries it, `stream`,
/// the output limit in the API's field (`max_output_tokens` for responses; Anthropic requires one,
/// 4096 when none is given) and `user` where the API has the field (not Anthropic's). The bytes are
/// those `json!` and serde_json's `to_string` would give (members in key order), written directly:
/// a `Value` of the prompt, serialized, copied and escape-scanned the prompt once more per request
/// (a fifth of the simulator's request path on long prompts).
pub fn request_body(api: ApiKind, model: &str, text: &str, stream: bool, max_tokens: Option<u64>, user: Option<&str>) -> (&'static str, Vec<u8>) {
    let (path, prompt_field) = match api {
        ApiKind::ChatCompletions => ("/v1/chat/completions", "messages"),
        ApiKind::Completions => ("/v1/completions", "prompt"),
        ApiKind::Responses => ("/v1/responses", "input"),
        ApiKind::AnthropicMessages => ("/v1/messages", "messages"),
    };
    let limit = match api {
        // Anthropic requires max_tokens.
        ApiKind::AnthropicMessages => Some(max_tokens.unwrap_or(4096)),
        _ => max_tokens,
    };
    let limit_field = if api == ApiKind::Responses { "max_output_tokens" } else { "max_tokens" };
    let user = user.filter(|_| api != ApiKind::AnthropicMessages);
    let mut members: Vec<(&str, Member<'_>)> = vec![
        ("model", Member::Text(model)),
        (prompt_field, if prompt_field == "messages" { Member::Message(text) } else { Member::Text(text) }),
        ("stream", Member::Bool(stream)),
    ];
    if let Some(max) = limit {
        members.push((limit_field, Member::Number(max)));
    }
    if let Some(user) = user {
        members.push(("user", Member::Text(user)));
    }
    // serde_json's map orders keys (no `preserve_order`): the same order here. At most five
    // members with distinct keys: an insertion sort, not a copy of the standard library's sort
    // for this element type (≈ 4 KB of the playground's page).
    for i in 1..members.len() {
        let mut j = i;
        while j > 0 && members.get(j - 1).map(|m| m.0) > members.get(j).map(|m| m.0) {
            members.swap(j - 1, j);
            j -= 1;
        }
    }
    let mut out = Vec::with_capacity(text.len().saturating_add(model.len()).saturating_add(160));
    out.push(b'{');
    for (i, (key, member)) in members.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        push_json_string(&mut out, key);
        out.push(b':');
        match member {
            Member::Text(t) => push_json_string(&mut out, t),
            Member::Message(t) => {
                out.extend_from_slice(br#"[{"content":"#);
                push_json_string(&mut out, t);
                out.extend_from_slice(br#","role":"user"}]"#);
            }
            Member::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
            Member::Number(n) => out.extend_from_slice(n.to_string().as_bytes()),
        }
    }
    out.push(b'}');
    (path, out)
}

/// A member of a request body.
enum Member<'a> {
    Text(&'a str),
    /// The prompt as one user message.
    Message(&'a str),
    Bool(bool),
    Number(u64),
}

/// Appends `text` as a JSON string. Text that needs no escape (every prompt cut from [`WORDS`]) is
/// copied as it is; the check has no early exit, so it compiles to a vector loop.
fn push_json_string(out: &mut Vec<u8>, text: &str) {
    let needs_escape = text.bytes().fold(false, |any, b| any | (b < 0x20) | (b == b'"') | (b == b'\\'));
    if needs_escape {
        // Writing a string into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, text);
        return;
    }
    out.push(b'"');
    out.extend_from_slice(text.as_bytes());
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    #[test]
    fn prompt_text_is_four_characters_a_token_less_the_message_overhead() {
        assert_eq!([0, 4, 5, 104].map(prompt_chars), [0, 0, 4, 400]);
        let mut filler = String::new();
        assert_eq!(prompt_text(&mut filler, 3), "");
        assert_eq!(prompt_text(&mut filler, 14), "the quick brown fox jumps over the lazy ");
        // The filler grows by whole copies of its words and is reused.
        assert_eq!(filler.len(), 76);
        assert_eq!(prompt_text(&mut filler, 18), "the quick brown fox jumps over the lazy dog while sluice");
        assert_eq!(filler.len(), 76);
        assert_eq!(prompt_text(&mut filler, 24), "the quick brown fox jumps over the lazy dog while sluice counts every token the ");
        assert_eq!(filler.len(), 152);
        assert_eq!(prompt_text(&mut filler, 104).len(), 400);
        assert_eq!(filler.len(), 456);
        assert_eq!(prompt_text(&mut filler, 5), "the ");
    }

    #[test]
    fn each_api_gets_its_own_body_and_path() {
        let request_body = |api, model, text, stream, max_tokens, user| {
            let (path, bytes) = request_body(api, model, text, stream, max_tokens, user);
            (path, serde_json::from_slice::<Value>(&bytes).unwrap())
        };
        let (path, body) = request_body(ApiKind::ChatCompletions, "m", "hi", true, Some(100), Some("u1"));
        assert_eq!(path, "/v1/chat/completions");
        assert_eq!(body, json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true, "max_tokens": 100, "user": "u1"}));
        let (path, body) = request_body(ApiKind::Completions, "m", "hi", false, None, Some("u1"));
        assert_eq!(path, "/v1/completions");
        assert_eq!(body, json!({"model": "m", "prompt": "hi", "stream": false, "user": "u1"}));
        let (path, body) = request_body(ApiKind::Responses, "m", "hi", true, Some(7), None);
        assert_eq!(path, "/v1/responses");
        assert_eq!(body, json!({"model": "m", "input": "hi", "stream": true, "max_output_tokens": 7}));
        // Anthropic: a limit always, 4096 when the request has none; no user field.
        let (path, body) = request_body(ApiKind::AnthropicMessages, "m", "hi", true, None, Some("u1"));
        assert_eq!(path, "/v1/messages");
        assert_eq!(body, json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true, "max_tokens": 4096}));
        let (_, body) = request_body(ApiKind::AnthropicMessages, "m", "hi", false, Some(64), None);
        assert_eq!(body["max_tokens"], 64);
    }

    /// The body as `json!` writes it (how the simulator built it before this crate): the body
    /// above must serialize to the same bytes, since a replay against real Envoy sends them.
    fn with_json_macro(api: ApiKind, model: &str, text: &str, stream: bool, max_tokens: Option<u64>, user: Option<&str>) -> Value {
        let mut body = match api {
            ApiKind::ChatCompletions => json!({"model": model, "messages": [{"role": "user", "content": text}], "stream": stream}),
            ApiKind::Completions => json!({"model": model, "prompt": text, "stream": stream}),
            ApiKind::Responses => json!({"model": model, "input": text, "stream": stream}),
            ApiKind::AnthropicMessages => {
                json!({"model": model, "messages": [{"role": "user", "content": text}], "stream": stream, "max_tokens": max_tokens.unwrap_or(4096)})
            }
        };
        let obj = body.as_object_mut().unwrap();
        if let Some(max) = max_tokens {
            obj.insert(if api == ApiKind::Responses { "max_output_tokens" } else { "max_tokens" }.into(), json!(max));
        }
        if let Some(user) = user.filter(|_| api != ApiKind::AnthropicMessages) {
            obj.insert("user".into(), json!(user));
        }
        body
    }

    #[test]
    fn bodies_are_byte_for_byte_what_json_macro_writes() {
        for api in [ApiKind::ChatCompletions, ApiKind::Completions, ApiKind::Responses, ApiKind::AnthropicMessages] {
            for stream in [true, false] {
                for max_tokens in [None, Some(0), Some(512)] {
                    for user in [None, Some("acme-u7")] {
                        for text in ["a \"quoted\" prompt", "plain words ", "tab\tnewline\n back\\slash \u{1} é ✓ \u{7f}", ""] {
                            let (_, body) = request_body(api, "llama-3-70b", text, stream, max_tokens, user);
                            let expected = with_json_macro(api, "llama-3-70b", text, stream, max_tokens, user);
                            assert_eq!(
                                String::from_utf8(body).unwrap(),
                                expected.to_string(),
                                "{api:?} stream {stream} max {max_tokens:?} user {user:?} {text:?}"
                            );
                        }
                    }
                }
            }
        }
    }
}
