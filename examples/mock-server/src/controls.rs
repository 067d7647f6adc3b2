//! Per-request behaviour of the mock: the CLI sets defaults, `x-mock-*` request headers override
//! them for one request. Headers are the control channel because they pass through Envoy
//! unchanged, so an end-to-end test can script the upstream from the client side.

use std::time::Duration;

/// Server-wide defaults, from the command line.
#[derive(Debug, Clone)]
pub struct Defaults {
    /// Model reported in responses; `None` echoes the request's `model`.
    pub model_name: Option<String>,
    pub ttft: Duration,
    pub itl: Duration,
    pub tokens: u64,
    /// Value of the `x-mock-served-by` response header.
    pub served_by: String,
}

impl Default for Defaults {
    fn default() -> Self {
        Defaults { model_name: None, ttft: Duration::ZERO, itl: Duration::ZERO, tokens: 16, served_by: "mock".into() }
    }
}

/// Whether usage is reported (`x-mock-usage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageMode {
    /// Chat and legacy completions streams: as `stream_options.include_usage` asks; everything else: yes.
    Auto,
    Always,
    Never,
}

/// A scripted failure (`x-mock-fail`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Answer with this status and an API-style JSON error body, before any streaming.
    Status(u16),
    /// Close the TCP connection after this many content tokens, without ending the chunked body.
    ResetAfter(u64),
    /// Send the API's SSE error event after this many content tokens, then end the body cleanly.
    ErrorEventAfter(u64),
    /// Close the connection as soon as the request head is read, before its body and any answer.
    ResetOnHead,
    /// Read half of the announced request body, then close the connection without answering.
    ResetInBody,
    /// After this many content tokens, send the first half of the next token's event, then close.
    ResetInside(u64),
    /// Send everything but the stream's last event (`data: [DONE]`, `message_stop`,
    /// `response.completed`), then end the body cleanly.
    NoTerminal,
    /// Send everything but the stream's last event, then close the connection (no final chunk).
    ResetBeforeTerminal,
}

/// Everything that shapes one response.
#[derive(Debug, Clone)]
pub struct Controls {
    pub ttft: Duration,
    pub itl: Duration,
    pub tokens: u64,
    pub usage: UsageMode,
    pub keepalives: u64,
    pub fail: Option<Failure>,
    pub cached_tokens: u64,
    pub reasoning_tokens: u64,
    pub crlf: bool,
    /// Split each SSE event into HTTP chunks of at most this many bytes.
    pub split: Option<usize>,
    pub served_by: String,
}

/// Upper bounds that keep a typo in a test header from hanging a connection for hours or
/// allocating gigabytes.
const MAX_DELAY_MS: u64 = 600_000;
const MAX_TOKENS: u64 = 1_000_000;
const MAX_KEEPALIVES: u64 = 10_000;

impl Controls {
    /// Applies the `x-mock-*` headers found by `header` over `defaults`. A header with a value the
    /// mock cannot understand is an error (the caller answers 400) rather than silently ignored,
    /// so a mistyped test fails loudly.
    pub fn from_headers<'a>(defaults: &Defaults, header: impl Fn(&str) -> Option<&'a str>) -> Result<Controls, String> {
        let num = |name: &str, max: u64| -> Result<Option<u64>, String> {
            match header(name) {
                None => Ok(None),
                Some(v) => match v.trim().parse::<u64>() {
                    Ok(n) if n <= max => Ok(Some(n)),
                    _ => Err(format!("{name}: expected an integer from 0 to {max}, got {v:?}")),
                },
            }
        };
        let ms = |name: &str, default: Duration| -> Result<Duration, String> { Ok(num(name, MAX_DELAY_MS)?.map(Duration::from_millis).unwrap_or(default)) };
        let usage = match header("x-mock-usage").map(|v| v.trim().to_ascii_lowercase()) {
            None => UsageMode::Auto,
            Some(v) => match v.as_str() {
                "auto" => UsageMode::Auto,
                "always" => UsageMode::Always,
                "never" => UsageMode::Never,
                _ => return Err(format!("x-mock-usage: expected auto, always or never, got {v:?}")),
            },
        };
        let fail = header("x-mock-fail").map(parse_failure).transpose()?;
        let split = match num("x-mock-split", MAX_TOKENS)? {
            Some(0) => return Err("x-mock-split: must be at least 1".into()),
            Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
            None => None,
        };
        let crlf = match header("x-mock-crlf").map(str::trim) {
            None | Some("0") | Some("false") => false,
            Some("1") | Some("true") => true,
            Some(v) => return Err(format!("x-mock-crlf: expected 0 or 1, got {v:?}")),
        };
        Ok(Controls {
            ttft: ms("x-mock-ttft-ms", defaults.ttft)?,
            itl: ms("x-mock-itl-ms", defaults.itl)?,
            tokens: num("x-mock-tokens", MAX_TOKENS)?.unwrap_or(defaults.tokens),
            usage,
            keepalives: num("x-mock-keepalive", MAX_KEEPALIVES)?.unwrap_or(0),
            fail,
            cached_tokens: num("x-mock-cached-tokens", u64::from(u32::MAX))?.unwrap_or(0),
            reasoning_tokens: num("x-mock-reasoning-tokens", u64::from(u32::MAX))?.unwrap_or(0),
            crlf,
            split,
            served_by: header("x-mock-version").map(str::to_string).unwrap_or_else(|| defaults.served_by.clone()),
        })
    }
}

/// Parses `status:N`, `reset-after:N`, `error-event-after:N`, `reset-inside:N`, `reset-on-head`,
/// `reset-in-body`, `no-terminal` or `reset-before-terminal`.
fn parse_failure(v: &str) -> Result<Failure, String> {
    let err = || {
        format!(
            "x-mock-fail: expected status:N, reset-after:N, error-event-after:N, reset-inside:N, reset-on-head, reset-in-body, no-terminal or reset-before-terminal, got {v:?}"
        )
    };
    match v.trim() {
        "reset-on-head" => return Ok(Failure::ResetOnHead),
        "reset-in-body" => return Ok(Failure::ResetInBody),
        "no-terminal" => return Ok(Failure::NoTerminal),
        "reset-before-terminal" => return Ok(Failure::ResetBeforeTerminal),
        _ => {}
    }
    let (kind, n) = v.trim().split_once(':').ok_or_else(err)?;
    let n: u64 = n.trim().parse().map_err(|_| err())?;
    match kind.trim() {
        "status" => match u16::try_from(n) {
            Ok(s) if (400..=599).contains(&s) => Ok(Failure::Status(s)),
            _ => Err(format!("x-mock-fail: status must be 400..=599, got {n}")),
        },
        "reset-after" => Ok(Failure::ResetAfter(n)),
        "error-event-after" => Ok(Failure::ErrorEventAfter(n)),
        "reset-inside" => Ok(Failure::ResetInside(n)),
        _ => Err(err()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    fn with(headers: &[(&'static str, &'static str)]) -> Result<Controls, String> {
        let h = headers.to_vec();
        Controls::from_headers(&Defaults::default(), move |n| h.iter().find(|(k, _)| *k == n).map(|(_, v)| *v))
    }

    #[test]
    fn defaults_apply_without_headers() {
        let c = with(&[]).unwrap();
        assert_eq!((c.tokens, c.usage, c.fail, c.crlf, c.split), (16, UsageMode::Auto, None, false, None));
        assert_eq!(c.served_by, "mock");
    }

    #[test]
    fn headers_override() {
        let c = with(&[
            ("x-mock-ttft-ms", "250"),
            ("x-mock-tokens", "3"),
            ("x-mock-usage", "never"),
            ("x-mock-fail", "reset-after:2"),
            ("x-mock-crlf", "1"),
            ("x-mock-split", "7"),
            ("x-mock-version", "v2"),
        ])
        .unwrap();
        assert_eq!(c.ttft, Duration::from_millis(250));
        assert_eq!((c.tokens, c.usage, c.fail), (3, UsageMode::Never, Some(Failure::ResetAfter(2))));
        assert_eq!((c.crlf, c.split, c.served_by.as_str()), (true, Some(7), "v2"));
    }

    #[test]
    fn bad_values_are_errors() {
        for h in [
            ("x-mock-tokens", "-1"),
            ("x-mock-ttft-ms", "soon"),
            ("x-mock-usage", "sometimes"),
            ("x-mock-fail", "status:200"),
            ("x-mock-fail", "explode"),
            ("x-mock-split", "0"),
            ("x-mock-crlf", "yes"),
            ("x-mock-fail", "reset-inside"),
            ("x-mock-fail", "no-terminal:1"),
        ] {
            assert!(with(&[h]).is_err(), "{h:?}");
        }
    }

    #[test]
    fn transport_failures_parse() {
        for (v, want) in [
            ("reset-on-head", Failure::ResetOnHead),
            ("reset-in-body", Failure::ResetInBody),
            ("reset-inside:3", Failure::ResetInside(3)),
            (" no-terminal ", Failure::NoTerminal),
            ("reset-before-terminal", Failure::ResetBeforeTerminal),
        ] {
            assert_eq!(with(&[("x-mock-fail", v)]).unwrap().fail, Some(want), "{v}");
        }
    }
}
