//! What the sluice plugins tell each other about one request, in one place so every side agrees:
//! the Envoy filter-state keys they write and read, and how a reply the gateway generated itself is
//! recorded so that every plugin reports that request with the same status and outcome.
//!
//! Filter state is per request and visible to every filter of the chain (`set_property` /
//! `get_property` with the key as the only path segment); a value must be non-empty (Envoy 1.40
//! reads an empty value back as absent).

/// llm-metrics → latency-guard: `"0"` while a stream waits for its first content token, then the
/// token's host time in ns (or the end of a stream that had none).
pub const FIRST_TOKEN_PROPERTY: &str = "sluice_first_token";
/// latency-guard → llm-metrics, on a stream the guard holds: `<context id> <queue name> <vm id>`,
/// the per-VM shared queue llm-metrics wakes the guard through at the first token.
pub const RELEASE_PROPERTY: &str = "sluice_latency_release";
/// latency-guard → model-router: versions to avoid and their fallbacks, `v1>v2,v3>`.
pub const AVOID_PROPERTY: &str = "sluice_latency_avoid";
/// model-router's decision and access-log stamp (JSON with at least `version`).
pub const ROUTE_PROPERTY: &str = "sluice_route";
/// Whichever plugin answers a request itself (refusal or deadline) writes [`GatewayReply`] here
/// before it replies.
pub const GATEWAY_REPLY_PROPERTY: &str = "sluice_gateway_reply";

/// model-router's mark on the shadow copies it sends (`x-sluice-shadow: 1`), which tells the shadow's
/// upstream that its answer goes nowhere.
pub const SHADOW_HEADER: &str = "x-sluice-shadow";

/// Headers only sluice writes — the shadow mark, and the response headers the plugins add
/// (tenant-budget's soft-limit warning and clamp, latency-guard's deadline and refusal) — that a
/// client may send on a request: model-router removes them from every request (with its configured
/// route, version and override headers), so none reaches an upstream as if sluice had written it.
pub const CLIENT_FORBIDDEN_HEADERS: &[&str] =
    &[SHADOW_HEADER, "x-sluice-budget-warning", "x-sluice-clamped-max-tokens", "x-sluice-deadline", "x-sluice-refused-by"];

/// Why the gateway ended a request itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatewayEnd {
    /// Refused before the upstream answered: a budget (401/400/413/415/429/503) or latency-guard's
    /// shedding and open breaker (503).
    Refused,
    /// latency-guard's deadline: a 504 before anything reached the client, or a stream ended with
    /// an error event (the client saw 200) or reset.
    Deadline,
}

impl GatewayEnd {
    pub fn as_str(self) -> &'static str {
        match self {
            GatewayEnd::Refused => "refused",
            GatewayEnd::Deadline => "deadline",
        }
    }
}

/// A request the gateway answered or ended itself: the status the client got, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatewayReply {
    pub status: u16,
    pub end: GatewayEnd,
}

impl GatewayReply {
    /// `"<status> <refused|deadline>"`.
    pub fn encode(&self) -> String {
        format!("{} {}", self.status, self.end.as_str())
    }

    /// The value read back from [`GATEWAY_REPLY_PROPERTY`]; `None` for anything else.
    pub fn decode(value: &str) -> Option<GatewayReply> {
        let (status, end) = value.trim().split_once(' ')?;
        let status: u16 = status.parse().ok()?;
        if !(100..=599).contains(&status) {
            return None;
        }
        let end = match end {
            "refused" => GatewayEnd::Refused,
            "deadline" => GatewayEnd::Deadline,
            _ => return None,
        };
        Some(GatewayReply { status, end })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gateway_reply_round_trips_and_rejects_garbage() {
        for reply in [
            GatewayReply { status: 504, end: GatewayEnd::Deadline },
            GatewayReply { status: 200, end: GatewayEnd::Deadline },
            GatewayReply { status: 429, end: GatewayEnd::Refused },
        ] {
            assert_eq!(GatewayReply::decode(&reply.encode()), Some(reply));
        }
        for bad in ["", "504", "504 late", "x refused", "99 refused", "600 refused", "429refused"] {
            assert_eq!(GatewayReply::decode(bad), None, "{bad:?}");
        }
    }
}
