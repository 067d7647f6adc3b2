//! What the flows read of a stream natively ([`View`]), and the host clock.

use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use sluice_core::api::ApiKind;
use sluice_core::contract::{GatewayReply, GATEWAY_REPLY_PROPERTY};
use sluice_core::flow::{Dir, View};
use sluice_core::observation::{Observer, SharedSlot};
use sluice_core::report::Outcome;

use crate::filter::{Attribute, BodyKind, Envoy};

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

/// The body chunk of the current event, read once for every section of the filter.
#[derive(Debug, Default)]
pub struct Chunk {
    bytes: Option<Vec<u8>>,
}

impl Chunk {
    /// Forgets what was read (a new event, or a section edited the chunk).
    pub fn forget(&mut self) {
        self.bytes = None;
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

    fn body(&mut self, dir: Dir, size: usize) -> Vec<u8> {
        if let (Dir::Request, Some(held)) = (dir, self.held) {
            return held.get(..size.min(held.len())).unwrap_or_default().to_vec();
        }
        let bytes = match &self.chunk.bytes {
            Some(bytes) => bytes,
            None => {
                let kind = match dir {
                    Dir::Request => BodyKind::ReceivedRequest,
                    Dir::Response => BodyKind::ReceivedResponse,
                };
                self.chunk.bytes.insert(self.envoy.body(kind).to_vec())
            }
        };
        bytes.get(..size.min(bytes.len())).unwrap_or_default().to_vec()
    }

    /// The property paths sluice's policies read, answered from what the ABI offers: a single
    /// segment is another policy's filter state, `request.headers.<name>` a request header,
    /// `metadata.filter_metadata.<ns>.<key>` dynamic metadata, and `response.code_details` the
    /// stream attribute. Anything else is absent natively (logged at debug).
    fn property(&mut self, path: &[String]) -> Option<String> {
        let segments: Vec<&str> = path.iter().map(String::as_str).collect();
        match segments.as_slice() {
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
    fn body(&mut self, _dir: Dir, size: usize) -> Vec<u8> {
        self.body.get(..size.min(self.body.len())).unwrap_or_default().to_vec()
    }
    fn property(&mut self, _path: &[String]) -> Option<String> {
        None
    }
    fn gateway_reply(&mut self) -> Option<GatewayReply> {
        None
    }
    fn unended_outcome(&mut self) -> Outcome {
        Outcome::Completed
    }
}

/// What tenant-budget asks of the host natively: its held request body replaced in place (the
/// earlier pieces Envoy buffered, then the last one); no ledger callouts (local mode only).
pub struct EnvoyBudgetHost<'v, 'e> {
    pub envoy: &'v mut Envoy<'e>,
    /// The bytes the budget put in place of the request body, for the held copy the sections
    /// behind it read.
    pub replaced: Option<Vec<u8>>,
}

impl sluice_core::flow::budget::BudgetHost for EnvoyBudgetHost<'_, '_> {
    fn ledger_call(&mut self, _ledger: &sluice_core::budget::policy::LedgerConfig, _path: &str, _body: &[u8]) -> Result<u32, String> {
        // Refused at configuration time (a ledger policy is not accepted natively yet).
        Err("the native module has no ledger callouts yet".to_string())
    }

    fn replace_request_body(&mut self, _size: usize, bytes: &[u8]) -> bool {
        let buffered_ok = self.envoy.body(BodyKind::BufferedRequest).is_empty() || self.envoy.drain_body(BodyKind::BufferedRequest, usize::MAX);
        let replaced = buffered_ok && self.envoy.drain_body(BodyKind::ReceivedRequest, usize::MAX) && self.envoy.append_body(BodyKind::ReceivedRequest, bytes);
        if replaced {
            self.replaced = Some(bytes.to_vec());
        }
        replaced
    }
}
