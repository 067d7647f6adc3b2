//! The bookkeeping of HTTP and gRPC callouts: what the plugin asked for, which context is waiting,
//! and when each call times out. The hostcalls are in [`http_callouts`](super::http_callouts) and
//! [`grpc`](super::grpc); the test answers through [`Gateway`](crate::Gateway).

use std::collections::BTreeMap;
use std::time::Duration;

use crate::headers::Headers;

/// An HTTP callout (`proxy_http_call`) waiting for its reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpCall {
    pub token: u32,
    /// The context that made the call and will get the reply.
    pub context_id: u32,
    /// The Envoy cluster.
    pub upstream: String,
    pub headers: Headers,
    pub body: Vec<u8>,
    pub trailers: Headers,
    /// `None` when the plugin passed 0.
    pub timeout: Option<Duration>,
    pub(crate) deadline_ns: Option<u64>,
}

/// A reply the test gives to an [`HttpCall`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HttpReply {
    pub headers: Headers,
    pub body: Vec<u8>,
    pub trailers: Headers,
}

impl HttpReply {
    /// A reply with `:status` set.
    pub fn status(code: u16) -> Self {
        Self { headers: Headers::from_pairs(&[(":status", code.to_string())]), ..Self::default() }
    }

    pub fn header(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        self.headers.add(name.as_bytes(), value.as_ref());
        self
    }

    pub fn body(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.body = body.into();
        self
    }

    pub fn trailer(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        self.trailers.add(name.as_bytes(), value.as_ref());
        self
    }
}

/// What the plugin can read while `proxy_on_http_call_response` runs.
pub(crate) type CalloutReply = HttpReply;

/// Unary call or bidirectional stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GrpcKind {
    Call,
    Stream,
}

/// A gRPC call (`proxy_grpc_call`) or stream (`proxy_grpc_stream`) that is still open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrpcCall {
    pub token: u32,
    pub context_id: u32,
    pub kind: GrpcKind,
    pub upstream: String,
    pub service: String,
    pub method: String,
    pub initial_metadata: Headers,
    /// The request message of a call, or every message sent on a stream.
    pub messages: Vec<Vec<u8>>,
    pub timeout: Option<Duration>,
    /// The plugin half-closed the stream (`proxy_grpc_close`, or `end_stream` on a send).
    pub closed_by_plugin: bool,
    pub(crate) deadline_ns: Option<u64>,
}

/// Something due at a virtual time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Timeout {
    Http(u32),
    Grpc(u32),
}

/// Every callout in flight. Tokens are unique across HTTP and gRPC.
#[derive(Clone, Debug, Default)]
pub(crate) struct Callouts {
    last_token: u32,
    pub http: BTreeMap<u32, HttpCall>,
    pub grpc: BTreeMap<u32, GrpcCall>,
}

impl Callouts {
    pub fn next_token(&mut self) -> u32 {
        self.last_token += 1;
        self.last_token
    }

    /// The earliest callout deadline.
    pub fn next_deadline(&self) -> Option<(u64, Timeout)> {
        let http = self.http.values().filter_map(|c| c.deadline_ns.map(|d| (d, Timeout::Http(c.token))));
        let grpc = self.grpc.values().filter_map(|c| c.deadline_ns.map(|d| (d, Timeout::Grpc(c.token))));
        http.chain(grpc).min()
    }
}

/// Deadline of a call made at `now_ns` with a timeout in milliseconds (0: none).
pub(crate) fn deadline(now_ns: u64, timeout_ms: u32) -> (Option<Duration>, Option<u64>) {
    if timeout_ms == 0 {
        return (None, None);
    }
    let timeout = Duration::from_millis(u64::from(timeout_ms));
    (Some(timeout), Some(now_ns + u64::from(timeout_ms) * 1_000_000))
}
