//! Error replies sluice sends to clients itself (429, 503, 504, …), in the error shape of the API the
//! client speaks, so SDKs raise their usual typed errors.

use crate::api::ApiKind;
use serde_json::json;

/// The JSON body of an error reply: OpenAI style `{"error":{"message","type","code"}}`, or Anthropic
/// style `{"type":"error","error":{"type","message"}}` on the Messages API.
pub fn error_body(kind: Option<ApiKind>, message: &str, error_type: &str, code: &str) -> String {
    let value = match kind {
        Some(ApiKind::AnthropicMessages) => json!({
            "type": "error",
            "error": { "type": anthropic_type(error_type), "message": message, "sluice_code": code },
        }),
        _ => json!({ "error": { "message": message, "type": error_type, "code": code } }),
    };
    value.to_string()
}

/// Anthropic clients switch on a fixed set of error types; map sluice's onto them.
fn anthropic_type(error_type: &str) -> &'static str {
    match error_type {
        "budget_exceeded" | "rate_limit_exceeded" => "rate_limit_error",
        "authentication_error" => "authentication_error",
        "invalid_request_error" => "invalid_request_error",
        "request_too_large" => "request_too_large",
        "overloaded" => "overloaded_error",
        "timeout" => "timeout_error",
        _ => "api_error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_shapes_follow_the_api() {
        let openai: serde_json::Value =
            serde_json::from_str(&error_body(Some(ApiKind::ChatCompletions), "no \"budget\"", "budget_exceeded", "key:k:minute:tokens")).unwrap();
        assert_eq!(openai["error"]["message"], "no \"budget\"");
        assert_eq!(openai["error"]["type"], "budget_exceeded");
        assert_eq!(openai["error"]["code"], "key:k:minute:tokens");
        let anthropic: serde_json::Value = serde_json::from_str(&error_body(Some(ApiKind::AnthropicMessages), "m", "budget_exceeded", "c")).unwrap();
        assert_eq!(anthropic["type"], "error");
        assert_eq!(anthropic["error"]["type"], "rate_limit_error");
    }
}
