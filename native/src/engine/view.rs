//! What the flows read of a stream natively ([`View`]), and the host clock.

use std::borrow::Cow;
use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use sluice_core::api::ApiKind;
use sluice_core::contract::{GatewayReply, GATEWAY_REPLY_PROPERTY};
use sluice_core::flow::{Dir, View};
use sluice_core::observation::{Observer, SharedSlot};
use sluice_core::report::Outcome;

use sluice_core::budget::policy::LedgerConfig;

use crate::filter::{Attribute, BodyKind, CalloutError, CalloutRequest, ConfigHost, Envoy};

/// The prefix Envoy's wasm filter gives the filter state a plugin writes (`set_property(["k"])` is
/// filter state `wasm.k`, and `get_property(["k"])` reads it back). The native host writes and reads
/// the same keys, so access-log formats (`%FILTER_STATE(wasm.sluice_llm:PLAIN)%`) and the
/// hand-offs between policies stay what they are with `sluice.wasm`.
pub const STATE_PREFIX: &str = "wasm.";

/// Host time in ns since the Unix epoch, as proxy-wasm's clock gives it: the wall clock read once
/// when the module is first asked, then advanced by the monotonic clock, so a duration between two
/// events never jumps with a wall-clock step.
pub fn now_ns() -> u64 {
    static START: OnceLock<(Instant, u64)> = OnceLock::new();
    let (start, epoch_ns) = START.get_or_init(|| {
        let epoch_ns = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)).unwrap_or(0);
        (Instant::now(), epoch_ns)
    });
    let elapsed = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
    epoch_ns.saturating_add(elapsed)
}

/// The filter-state key a policy's property `key` lives under.
pub fn state_key(key: &str) -> String {
    let mut full = String::with_capacity(STATE_PREFIX.len() + key.len());
    full.push_str(STATE_PREFIX);
    full.push_str(key);
    full
}

/// The body chunk of the current event, read once for every section of the filter, into a buffer
/// the stream keeps from event to event (no allocation per event once it is large enough).
#[derive(Debug, Default)]
pub struct Chunk {
    bytes: Vec<u8>,
    /// `bytes` holds this event's chunk.
    read: bool,
    /// This event's chunk size, once asked for.
    size: Option<usize>,
}

/// The most a stream's chunk buffer keeps between events: a larger one (a big non-streamed body)
/// is let go, so a stream holds at most this much for it while idle.
const KEPT_CHUNK_CAPACITY: usize = 64 * 1024;

impl Chunk {
    /// Forgets what was read (a new event, or a section edited the chunk).
    pub fn forget(&mut self) {
        self.read = false;
        self.size = None;
        if self.bytes.capacity() > KEPT_CHUNK_CAPACITY {
            self.bytes = Vec::new();
        }
    }

    /// The size of this event's `kind` body chunk, asked of Envoy once per event.
    pub fn size(&mut self, envoy: &Envoy<'_>, kind: BodyKind) -> usize {
        *self.size.get_or_insert_with(|| envoy.body(kind).len())
    }
}

/// A flow's view of the stream during one hook.
pub struct NativeView<'v, 'e> {
    pub envoy: &'v mut Envoy<'e>,
    pub now: u64,
    /// The stream's shared response observer, when the filter runs several sections.
    pub shared: Option<&'v SharedSlot>,
    pub chunk: &'v mut Chunk,
    /// The request body the filter holds (headers waiting for a budget's decision): what a
    /// section reads as the request body instead of the current chunk.
    pub held: Option<&'v [u8]>,
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

impl View for NativeView<'_, '_> {
    fn now(&mut self) -> u64 {
        self.now
    }

    fn request_header(&mut self, name: &str) -> Option<String> {
        self.envoy.request_headers().get(name).map(text)
    }

    fn request_header_bytes(&mut self, name: &str) -> Option<Vec<u8>> {
        self.envoy.request_headers().get(name).map(<[u8]>::to_vec)
    }

    fn response_header(&mut self, name: &str) -> Option<String> {
        self.envoy.response_headers().get(name).map(text)
    }

    fn body(&mut self, dir: Dir, size: usize) -> Cow<'_, [u8]> {
        if let (Dir::Request, Some(held)) = (dir, self.held) {
            return Cow::Borrowed(held.get(..size.min(held.len())).unwrap_or_default());
        }
        if !self.chunk.read {
            let kind = match dir {
                Dir::Request => BodyKind::ReceivedRequest,
                Dir::Response => BodyKind::ReceivedResponse,
            };
            self.chunk.bytes.clear();
            self.envoy.body(kind).copy_into(&mut self.chunk.bytes);
            self.chunk.read = true;
        }
        let bytes = self.chunk.bytes.as_slice();
        Cow::Borrowed(bytes.get(..size.min(bytes.len())).unwrap_or_default())
    }

    /// The property paths sluice's policies read, answered from what the ABI offers: a single
    /// segment is another policy's filter state, `request.headers.<name>` a request header,
    /// `metadata.filter_metadata.<ns>.<key>` dynamic metadata, and `response.code_details` the
    /// stream attribute. Anything else is absent natively (logged at debug).
    fn property(&mut self, path: &[&str]) -> Option<String> {
        match path {
            [key] => self.envoy.filter_state(&state_key(key)).map(text),
            ["request", "headers", name] => self.request_header(name),
            ["metadata", "filter_metadata", namespace, key] => self.envoy.dynamic_metadata_string(namespace, key).map(text),
            ["response", "code_details"] => self.envoy.attribute_string(Attribute::ResponseCodeDetails).map(text),
            _ => {
                if crate::filter::log_enabled(crate::filter::LogLevel::Debug) {
                    crate::filter::log(crate::filter::LogLevel::Debug, &format!("sluice: property {path:?} has no native source; read as absent"));
                }
                None
            }
        }
    }

    fn gateway_reply(&mut self) -> Option<GatewayReply> {
        let value = self.envoy.filter_state(&state_key(GATEWAY_REPLY_PROPERTY))?;
        GatewayReply::decode(&String::from_utf8_lossy(value))
    }

    fn unended_outcome(&mut self) -> Outcome {
        let details = self.envoy.attribute_string(Attribute::ResponseCodeDetails).map(text).unwrap_or_default();
        Outcome::of_unended(&details, self.envoy.attribute_int(Attribute::ResponseFlags))
    }

    fn response_observer(&mut self, kind: ApiKind) -> Observer {
        match self.shared {
            Some(slot) => Observer::join(slot, kind),
            None => Observer::own(kind),
        }
    }
}

/// The view a budget's request-body event gets: the held body, and nothing else (the event reads
/// only that), so the stream handle is free for the body's replacement ([`EnvoyBudgetHost`]).
pub struct HeldBody<'v> {
    pub body: &'v [u8],
    pub now: u64,
}

impl View for HeldBody<'_> {
    fn now(&mut self) -> u64 {
        self.now
    }
    fn request_header(&mut self, _name: &str) -> Option<String> {
        None
    }
    fn response_header(&mut self, _name: &str) -> Option<String> {
        None
    }
    fn body(&mut self, _dir: Dir, size: usize) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.body.get(..size.min(self.body.len())).unwrap_or_default())
    }
    fn property(&mut self, _path: &[&str]) -> Option<String> {
        None
    }
    fn gateway_reply(&mut self) -> Option<GatewayReply> {
        None
    }
    fn unended_outcome(&mut self) -> Outcome {
        Outcome::Completed
    }
}

/// What tenant-budget asks of a stream natively: its held request body replaced in place, and a
/// Redis ledger's reservation sent as the stream's callout (its answer comes to the stream's
/// `on_callout_done`, on its worker, while the request waits).
pub struct EnvoyBudgetHost<'v, 'e> {
    pub envoy: &'v mut Envoy<'e>,
    /// The bytes the budget put in place of the request body, for the held copy the sections
    /// behind it read.
    pub replaced: Option<Vec<u8>>,
}

impl sluice_core::flow::budget::BudgetHost for EnvoyBudgetHost<'_, '_> {
    fn ledger_call(&mut self, ledger: &LedgerConfig, path: &str, body: &[u8]) -> Result<u32, String> {
        ledger_call(ledger, path, body, |request| self.envoy.http_callout(request))
    }

    fn replace_request_body(&mut self, _size: usize, bytes: &[u8]) -> bool {
        let replaced = replace_request_body(self.envoy, bytes);
        if replaced {
            self.replaced = Some(bytes.to_vec());
        }
        replaced
    }
}

/// Replaces the whole request body the filter holds by `bytes`: what Envoy buffered is drained and
/// the bytes go in the current piece, in a body hook; outside one (a callout's answer, all of the
/// body buffered) they go in Envoy's buffer. Whether Envoy took them.
pub fn replace_request_body(envoy: &mut Envoy<'_>, bytes: &[u8]) -> bool {
    let buffered_ok = envoy.body(BodyKind::BufferedRequest).is_empty() || envoy.drain_body(BodyKind::BufferedRequest, usize::MAX);
    if !buffered_ok {
        return false;
    }
    if envoy.drain_body(BodyKind::ReceivedRequest, usize::MAX) {
        envoy.append_body(BodyKind::ReceivedRequest, bytes)
    } else {
        envoy.append_body(BodyKind::BufferedRequest, bytes)
    }
}

/// One call to the Redis ledger service (`POST path`, JSON `body`), as sluice.wasm sends it, through
/// `send` (a stream's callout, or the configuration's): the callout's token for the flow.
pub fn ledger_call(ledger: &LedgerConfig, path: &str, body: &[u8], send: impl FnOnce(&CalloutRequest<'_>) -> Result<u64, CalloutError>) -> Result<u32, String> {
    let cluster = ledger.cluster.as_deref().unwrap_or_default();
    let headers: [(&str, &[u8]); 4] =
        [(":method", b"POST"), (":path", path.as_bytes()), (":authority", ledger.authority.as_bytes()), ("content-type", b"application/json")];
    let request = CalloutRequest { cluster, headers: &headers, body, timeout_ms: u64::from(ledger.timeout_ms) };
    let id = send(&request).map_err(|e| e.to_string())?;
    // Envoy numbers callouts with a counter per stream and per configuration: a token past u32
    // would take four billion callouts of one configuration.
    u32::try_from(id).map_err(|_| format!("callout id {id} is past the flows' 32-bit tokens"))
}

/// The budget's host on the main thread (its settlement tick, the answers to settlements): ledger
/// calls are the configuration's callouts; there is no request body there.
pub struct ConfigBudgetHost<'v, 'c> {
    pub config: &'v mut ConfigHost<'c>,
}

impl sluice_core::flow::budget::BudgetHost for ConfigBudgetHost<'_, '_> {
    fn ledger_call(&mut self, ledger: &LedgerConfig, path: &str, body: &[u8]) -> Result<u32, String> {
        ledger_call(ledger, path, body, |request| self.config.http_callout(request))
    }

    fn replace_request_body(&mut self, _size: usize, _bytes: &[u8]) -> bool {
        false
    }
}
