//! What the sluice plugins tell each other about one request, in one place so every side agrees:
//! the Envoy filter-state keys they write and read, and how a reply the gateway generated itself is
//! recorded so that every plugin reports that request with the same status and outcome.
//!
//! Filter state is per request and visible to every filter of the chain (`set_property` /
//! `get_property` with the key as the only path segment); a value must be non-empty (Envoy 1.40
//! reads an empty value back as absent).

/// llm-metrics → latency-guard: `"0"` while a stream waits for its first content token, then the
/// token's host time in ns (or the end of a stream that had none); [`FirstTokenMark`].
pub const FIRST_TOKEN_PROPERTY: &str = "sluice_first_token";
/// latency-guard → llm-metrics, on a stream the guard holds: `<context id> <queue name> <vm id>`,
/// the per-VM shared queue llm-metrics wakes the guard through at the first token; [`ReleaseAddress`].
pub const RELEASE_PROPERTY: &str = "sluice_latency_release";
/// latency-guard → the sluice filters behind it in its VM: `<vm token> <key>`, where the stream's
/// shared response observer is kept ([`crate::observation`]); a filter of another VM (another
/// token) shares only among its own sections.
pub const OBSERVATION_PROPERTY: &str = "sluice_observation";
/// latency-guard → model-router: versions to avoid and their fallbacks, `v1>v2,v3>`;
/// [`encode_avoid_list`], [`decode_avoid_list`].
pub const AVOID_PROPERTY: &str = "sluice_latency_avoid";
/// Where the gateway's lift of the request body (Envoy's `json_to_metadata` in the shipped
/// gateways, `sluice-body-metadata` natively) puts the body's `model`: Envoy routes on headers,
/// before a filter can see the body, so latency-guard and model-router read it here.
pub const MODEL_METADATA: [&str; 4] = ["metadata", "filter_metadata", "sluice", "model"];
/// Where the same lift puts the body's `user` (model-router's `{"body_user": true}` sticky source).
pub const USER_METADATA: [&str; 4] = ["metadata", "filter_metadata", "sluice", "user"];
/// model-router's decision and access-log stamp (JSON with at least `version`; [`route_version`]).
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

/// The value of [`FIRST_TOKEN_PROPERTY`] as latency-guard reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirstTokenMark {
    /// No mark: llm-metrics is not behind the guard, or does not measure this response.
    Absent,
    /// `"0"`: llm-metrics watches the stream; no content token yet.
    Waiting,
    /// The first content token's host time, ns (or the end of a stream that had none).
    At(u64),
    /// Anything else: neither waiting nor a time.
    Unreadable,
}

impl FirstTokenMark {
    /// What llm-metrics writes while a stream waits for its first content token.
    pub const WAITING: &'static [u8] = b"0";

    /// What llm-metrics writes at the first content token (host time, ns).
    pub fn at(ns: u64) -> String {
        ns.to_string()
    }

    pub fn parse(value: Option<&str>) -> FirstTokenMark {
        match value {
            None => FirstTokenMark::Absent,
            Some("0") => FirstTokenMark::Waiting,
            Some(v) => v.parse::<u64>().ok().filter(|&t| t > 0).map_or(FirstTokenMark::Unreadable, FirstTokenMark::At),
        }
    }
}

/// Where llm-metrics wakes latency-guard for a held stream ([`RELEASE_PROPERTY`]):
/// `<context id> <queue name> <vm id>`. The vm id may be empty (Istio gives plugins none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReleaseAddress<'a> {
    /// The guard's context id of the stream, sent on the queue as the wake-up message.
    pub stream: &'a str,
    pub queue: &'a str,
    pub vm_id: &'a str,
}

impl<'a> ReleaseAddress<'a> {
    pub fn encode(&self) -> String {
        format!("{} {} {}", self.stream, self.queue, self.vm_id)
    }

    /// `None` unless the value has all three parts (the last one may be empty).
    pub fn decode(value: &'a str) -> Option<ReleaseAddress<'a>> {
        let mut parts = value.splitn(3, ' ');
        Some(ReleaseAddress { stream: parts.next()?, queue: parts.next()?, vm_id: parts.next()? })
    }
}

/// At most this many entries of an avoid list are read: more versions than any policy names.
pub const MAX_AVOIDED_VERSIONS: usize = 64;

/// latency-guard's avoid list ([`AVOID_PROPERTY`]) from `(version, fallback)` pairs, the fallback
/// empty when the version has none: `v1>v2,v3>`. Empty when nothing is to be avoided (the guard
/// then writes nothing: an empty value reads back as absent anyway).
pub fn encode_avoid_list<'a>(entries: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut out = String::new();
    for (version, fallback) in entries {
        if !out.is_empty() {
            out.push(',');
        }
        out.push_str(version);
        out.push('>');
        out.push_str(fallback);
    }
    out
}

/// model-router's reading of the avoid list: `(version, fallback)` pairs, the fallback empty when
/// none is named; empty entries skipped, at most [`MAX_AVOIDED_VERSIONS`].
pub fn decode_avoid_list(value: &str) -> Vec<(String, String)> {
    value
        .split(',')
        .filter(|e| !e.is_empty())
        .take(MAX_AVOIDED_VERSIONS)
        .map(|e| match e.split_once('>') {
            Some((v, f)) => (v.to_string(), f.to_string()),
            None => (e.to_string(), String::new()),
        })
        .collect()
}

/// The version model-router chose, from its decision ([`ROUTE_PROPERTY`], JSON with `version`).
pub fn route_version(decision: &str) -> Option<String> {
    // The guard reads it on every request: core's scanner reads the one member without building
    // the decision's tree (a tree was ≈ 5,600 instructions a request); a text it is not sure of
    // goes to the tree, which decides as before.
    if let Some(version) = scanned_route_version(decision) {
        return version;
    }
    // From the bytes, as core reads all its JSON: one serde_json reader type in each .wasm.
    let v: serde_json::Value = serde_json::from_slice(decision.as_bytes()).ok()?;
    v.get("version").and_then(serde_json::Value::as_str).map(str::to_string)
}

/// [`route_version`] by the scanner: `None` when the scanner gives up (not an object, a repeated
/// `version`, anything it is not sure of), else what the tree would say.
fn scanned_route_version(decision: &str) -> Option<Option<String>> {
    let mut sc = crate::scan::Scanner::new(decision);
    let mut version = None;
    let mut seen = 0u32;
    sc.object(|sc, key| {
        if key.is("version") {
            crate::scan::first_time(&mut seen, 1)?;
            // A string is the version; null or any other value is none.
            version = match sc.opt_string() {
                Ok(v) => v.map(|v| v.text().into_owned()),
                Err(()) => sc.value().map(|_| None)?,
            };
        } else {
            sc.value()?;
        }
        Some(())
    })?;
    sc.at_end().then_some(version)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
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

    #[test]
    fn the_first_token_mark_reads_back_what_llm_metrics_writes() {
        let waiting = std::str::from_utf8(FirstTokenMark::WAITING).unwrap();
        assert_eq!(FirstTokenMark::parse(Some(waiting)), FirstTokenMark::Waiting);
        assert_eq!(FirstTokenMark::parse(Some(&FirstTokenMark::at(1_234_567))), FirstTokenMark::At(1_234_567));
        assert_eq!(FirstTokenMark::parse(None), FirstTokenMark::Absent);
        for bad in ["", "-1", "x", "1.5", " 12"] {
            assert_eq!(FirstTokenMark::parse(Some(bad)), FirstTokenMark::Unreadable, "{bad:?}");
        }
    }

    #[test]
    fn a_release_address_round_trips_also_with_an_empty_vm_id() {
        for (stream, queue, vm_id) in [("17", "sluice_latency_release_3", "sluice"), ("2", "q", "")] {
            let a = ReleaseAddress { stream, queue, vm_id };
            assert_eq!(ReleaseAddress::decode(&a.encode()), Some(a));
        }
        assert_eq!(ReleaseAddress::decode("17 queue"), None);
        assert_eq!(ReleaseAddress::decode(""), None);
    }

    #[test]
    fn the_avoid_list_round_trips_and_is_bounded() {
        let entries = [("v1", "v2"), ("v3", "")];
        let text = encode_avoid_list(entries);
        assert_eq!(text, "v1>v2,v3>");
        assert_eq!(decode_avoid_list(&text), vec![("v1".to_string(), "v2".to_string()), ("v3".to_string(), String::new())]);
        assert_eq!(encode_avoid_list([]), "");
        assert_eq!(decode_avoid_list(",,v4,"), vec![("v4".to_string(), String::new())]);
        let many: Vec<String> = (0..100).map(|i| format!("v{i}>")).collect();
        assert_eq!(decode_avoid_list(&many.join(",")).len(), MAX_AVOIDED_VERSIONS);
    }

    #[test]
    fn the_route_version_is_read_from_the_decision() {
        assert_eq!(route_version(r#"{"model":"llama","version":"v2","reason":"weight"}"#).as_deref(), Some("v2"));
        assert_eq!(route_version(r#"{"version":null}"#), None);
        assert_eq!(route_version("not json"), None);
    }

    /// The scanner's read of the decision says what the tree says, and gives way to it where it is
    /// not sure (a repeated member: the tree keeps the last).
    #[test]
    fn the_scanned_route_version_agrees_with_the_tree() {
        let tree = |d: &str| -> Option<String> {
            let v: serde_json::Value = serde_json::from_str(d).ok()?;
            v.get("version").and_then(serde_json::Value::as_str).map(str::to_string)
        };
        let texts = [
            r#"{"model":"llama","version":"v2","reason":"weight"}"#,
            r#" { "version" : "v\u0032" } "#,
            r#"{"version":"v\"1"}"#,
            r#"{"version":null}"#,
            r#"{"version":7}"#,
            r#"{"version":{"a":[1,"v"]}}"#,
            r#"{"version":["v1"]}"#,
            r#"{"reason":"weight"}"#,
            r#"{}"#,
            r#"{"version":"v1","version":"v2"}"#,
            r#"{"version":"v1","version":null}"#,
            r#"{"version":"v1"} x"#,
            r#"{"version":"v1""#,
            r#"{"version":"v1",}"#,
            r#"["version","v1"]"#,
            r#""v1""#,
            "null",
            "",
            r#"{"\u0076ersion":"v3"}"#,
            r#"{"version":"\ud83d\ude00"}"#,
            r#"{"version":"v1","n":1e400}"#,
        ];
        for text in texts {
            assert_eq!(route_version(text), tree(text), "{text}");
        }
        // The scanner decided these itself (no tree).
        assert_eq!(scanned_route_version(r#"{"version":"v2","x":[1,{"y":null}]}"#), Some(Some("v2".into())));
        assert_eq!(scanned_route_version(r#"{"version":7}"#), Some(None));
        assert_eq!(scanned_route_version(r#"{"version":"v1","version":"v2"}"#), None);
    }
}
