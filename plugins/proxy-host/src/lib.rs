//! The hostcalls the sluice plugins make, with every result handled. The SDK's trait helpers
//! `unwrap()` results and decode header values as UTF-8 with a panic on failure; a panic here would
//! kill the VM for every request on the worker, so this module calls the byte-level hostcalls and
//! decodes lossily.

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType};
pub use sluice_core::headers::HeaderPairs;

pub mod stream;
use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::time::UNIX_EPOCH;

/// Host time in nanoseconds since the Unix epoch (one read per callback of a filter: see
/// [`stream`]). Time only ever comes from the host, so the wasmtime harness can run a virtual clock.
pub fn now_ns() -> u64 {
    stream::now_ns(|| match hostcalls::get_current_time() {
        Ok(t) => t.duration_since(UNIX_EPOCH).map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)).unwrap_or(0),
        Err(status) => {
            log::warn!("proxy_get_current_time_nanoseconds failed: {status:?}");
            0
        }
    })
}

/// The plugin configuration (Envoy `configuration`, Istio `pluginConfig`); `None`, logged, when the
/// host cannot give it. An empty configuration is an empty vector.
pub fn plugin_configuration() -> Option<Vec<u8>> {
    match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
        Ok(bytes) => Some(bytes.unwrap_or_default()),
        Err(status) => {
            log::error!("cannot read the plugin configuration: {status:?}");
            None
        }
    }
}

/// A header value, decoded lossily (non-UTF-8 bytes become U+FFFD rather than an error).
///
/// The SDK's `get_map_value_bytes` panics on a status it does not expect, and Envoy answers
/// `BadArgument` for a map the current callback cannot see (a stream's request headers read from
/// the root's tick): this calls the ABI directly and logs any failure at debug instead.
pub fn header(map: MapType, name: &str) -> Option<String> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: a proxy-wasm ABI 0.2.1 import reading `name` (pointer and length of a live &str) and
    // writing a pointer and a size into the two locals.
    let status = unsafe { proxy_get_header_map_value(map as u32, name.as_ptr(), name.len(), &mut data, &mut size) };
    // SAFETY: `data` and `size` are what the import just wrote.
    let bytes = unsafe { take_returned(status, data, size, &format_args!("header {name}")) }?;
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

/// The bytes a proxy-wasm read import handed back: `None` for `NotFound` and for a failure (logged
/// at debug, naming `what`), empty when it succeeded with no buffer.
///
/// # Safety
/// `data` and `size` are what the import wrote for `status`: on success, a buffer this module's
/// allocator (`proxy_on_memory_allocate`) made for exactly `size` bytes, or null. Ownership of the
/// buffer passes to the returned `Vec`.
unsafe fn take_returned(status: u32, data: *mut u8, size: usize, what: &dyn std::fmt::Display) -> Option<Vec<u8>> {
    if status != STATUS_OK {
        if status != STATUS_NOT_FOUND {
            log::debug!("reading {what} failed: status {status}");
        }
        return None;
    }
    if data.is_null() {
        return Some(Vec::new());
    }
    // SAFETY: the caller's contract: `data` points to `size` initialised bytes this module now owns.
    Some(unsafe { Vec::from_raw_parts(data, size, size) })
}

/// Bytes `[0, size)` of a body buffer (the current chunk when the filter does not buffer).
pub fn body(buffer: BufferType, size: usize) -> Vec<u8> {
    if size == 0 {
        return Vec::new();
    }
    match hostcalls::get_buffer(buffer, 0, size) {
        Ok(Some(bytes)) => bytes,
        Ok(None) => Vec::new(),
        Err(status) => {
            log::debug!("reading body failed: {status:?}");
            Vec::new()
        }
    }
}

/// Appends bytes at the end of the current body chunk of `buffer` (`current_size` bytes long).
pub fn append_body(buffer: BufferType, current_size: usize, bytes: &[u8]) {
    match hostcalls::set_buffer(buffer, current_size, 0, bytes) {
        Ok(()) => composite::body_edited(current_size.saturating_add(bytes.len())),
        Err(status) => log::warn!("appending to a body chunk failed: {status:?}"),
    }
}

/// A property (`["request", "headers", "traceparent"]`, `["xds", "node", "id"]`), decoded lossily.
/// Through the ABI directly, as [`header`]: the SDK's `get_property` panics on a status it does not
/// expect.
pub fn property(path: &[&str]) -> Option<String> {
    // The ABI's path: the segments, each ended by a NUL but the last.
    let mut serialized: Vec<u8> = Vec::with_capacity(path.iter().map(|p| p.len() + 1).sum());
    for (i, segment) in path.iter().enumerate() {
        if i > 0 {
            serialized.push(0);
        }
        serialized.extend_from_slice(segment.as_bytes());
    }
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: a proxy-wasm ABI 0.2.1 import reading `serialized` (a live buffer) and writing a
    // pointer and a size into the two locals.
    let status = unsafe { proxy_get_property(serialized.as_ptr(), serialized.len(), &mut data, &mut size) };
    // SAFETY: `data` and `size` are what the import just wrote.
    let bytes = unsafe { take_returned(status, data, size, &format_args!("property {path:?}")) }?;
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

pub fn set_property(key: &str, value: &[u8]) {
    if let Err(status) = hostcalls::set_property(vec![key], Some(value)) {
        log::warn!("writing filter state {key} failed: {status:?}");
    }
}

/// Envoy metric ids by name, defined lazily once per VM. Label cardinality is bounded by
/// configuration, so the map is bounded too.
#[derive(Default)]
pub struct Metrics {
    /// One map per metric kind, keyed by name: a lookup borrows the name (no allocation per
    /// sample on the hot path; a name is copied once, when first defined).
    ids: [HashMap<String, u32, BuildHasherDefault<NameHasher>>; 3],
}

/// Multiply-rotate hashing of metric names, eight bytes a step. Every sample hashes its name; std's
/// SipHash, keyed against collision flooding, costs several times more in wasm, and these names are
/// built from bounded label sets (a client cannot choose them), so flooding is no concern here.
#[derive(Default)]
pub struct NameHasher(u64);

impl std::hash::Hasher for NameHasher {
    fn write(&mut self, bytes: &[u8]) {
        const K: u64 = 0x517c_c1b7_2722_0a95;
        let mut words = bytes.chunks_exact(8);
        for word in words.by_ref() {
            let mut w = [0u8; 8];
            w.copy_from_slice(word);
            self.0 = (self.0.rotate_left(5) ^ u64::from_le_bytes(w)).wrapping_mul(K);
        }
        for &b in words.remainder() {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(K);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// The map of `kind`; `None` for a kind the SDK may add later (then the sample is dropped).
fn kind_index(kind: MetricType) -> Option<usize> {
    match kind {
        MetricType::Counter => Some(0),
        MetricType::Gauge => Some(1),
        MetricType::Histogram => Some(2),
        _ => None,
    }
}

impl Metrics {
    fn id(&mut self, kind: MetricType, name: &str) -> Option<u32> {
        let ids = self.ids.get_mut(kind_index(kind)?)?;
        if let Some(id) = ids.get(name) {
            return Some(*id);
        }
        match hostcalls::define_metric(kind, name) {
            Ok(id) => {
                ids.insert(name.to_string(), id);
                Some(id)
            }
            Err(status) => {
                log::warn!("defining metric {name} failed: {status:?}");
                None
            }
        }
    }

    /// Adds `value`; a zero only defines the metric (Envoy refuses a zero increment), so the series
    /// exists from the first request on.
    pub fn add(&mut self, kind: MetricType, name: &str, value: i64) {
        if let Some(id) = self.id(kind, name) {
            if value == 0 {
                return;
            }
            if let Err(status) = hostcalls::increment_metric(id, value) {
                log::warn!("incrementing {name} failed: {status:?}");
            }
        }
    }

    /// Sets a gauge to `value`.
    pub fn set_gauge(&mut self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Gauge, name) {
            if let Err(status) = hostcalls::record_metric(id, value) {
                log::warn!("setting {name} failed: {status:?}");
            }
        }
    }

    pub fn record(&mut self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Histogram, name) {
            if let Err(status) = hostcalls::record_metric(id, value) {
                log::warn!("recording {name} failed: {status:?}");
            }
        }
    }
}

/// Replaces bytes `[0, size)` of the current body chunk (the whole chunk when `size` is its length).
pub fn replace_body(buffer: BufferType, size: usize, bytes: &[u8]) {
    match hostcalls::set_buffer(buffer, 0, size, bytes) {
        Ok(()) => composite::body_edited(bytes.len()),
        Err(status) => log::warn!("replacing a body chunk failed: {status:?}"),
    }
}

/// Like [`replace_body`], saying whether the host took it (a caller that must not go on with the
/// old bytes checks this).
pub fn try_replace_body(buffer: BufferType, size: usize, bytes: &[u8]) -> bool {
    match hostcalls::set_buffer(buffer, 0, size, bytes) {
        Ok(()) => {
            composite::body_edited(bytes.len());
            true
        }
        Err(status) => {
            log::warn!("replacing a body failed: {status:?}");
            false
        }
    }
}

pub fn set_header(map: MapType, name: &str, value: Option<&str>) {
    if let Err(status) = hostcalls::set_map_value(map, name, value) {
        log::warn!("setting header {name} failed: {status:?}");
    }
}

/// Records that the gateway answered or ended this request itself (see
/// `sluice_core::contract::GatewayReply`), so every plugin reports it with the same status and
/// outcome. Call before the reply or reset it describes.
pub fn mark_gateway_reply(reply: sluice_core::contract::GatewayReply) {
    set_property(sluice_core::contract::GATEWAY_REPLY_PROPERTY, reply.encode().as_bytes());
}

/// The gateway's own reply to this request, if a sluice plugin recorded one.
pub fn gateway_reply() -> Option<sluice_core::contract::GatewayReply> {
    property(&[sluice_core::contract::GATEWAY_REPLY_PROPERTY]).and_then(|v| sluice_core::contract::GatewayReply::decode(&v))
}

/// A reply the gateway decided on (refusal, deadline): recorded for the other plugins, then sent.
pub fn gateway_local_reply(end: sluice_core::contract::GatewayEnd, status: u32, headers: &[(&str, &str)], body: &[u8]) {
    let code = u16::try_from(status).unwrap_or(500);
    mark_gateway_reply(sluice_core::contract::GatewayReply { status: code, end });
    local_reply(status, headers, body);
}

/// How a request that never saw its last response chunk ended, from Envoy's response code details
/// and flags ([`sluice_core::report::Outcome::of_unended`]). A reply the gateway generated itself is
/// read separately ([`gateway_reply`]) and takes precedence.
pub fn interrupted_outcome() -> sluice_core::report::Outcome {
    let details = property(&["response", "code_details"]).unwrap_or_default();
    sluice_core::report::Outcome::of_unended(&details, response_flags())
}

/// Envoy's response flags (`response.flags`, a bit vector as 8 little-endian bytes); `None` when the
/// host does not provide them.
fn response_flags() -> Option<u64> {
    match hostcalls::get_property(vec!["response", "flags"]) {
        Ok(Some(bytes)) => <[u8; 8]>::try_from(bytes.as_slice()).ok().map(u64::from_le_bytes),
        _ => None,
    }
}

/// Replaces the SDK's panic hook (a bare message) with one that names the plugin and says what a
/// panic costs: the release profile aborts, and Envoy loses this VM for every request on the worker.
/// The plugins deny the usual ways to panic; this is for the ones no lint sees.
pub fn install_panic_hook(plugin: &'static str) {
    std::panic::set_hook(Box::new(move |info| {
        let message = format!("sluice {plugin}: panic, the VM is lost for every request on this worker: {info}");
        // Nothing is left to do if even logging fails.
        let _ = hostcalls::log(proxy_wasm::types::LogLevel::Critical, &message);
    }));
}

/// The `:status` of the callout answer being delivered; 0 when there is none (the call failed or
/// timed out: Envoy then delivers no headers).
pub fn call_status() -> u16 {
    header(MapType::HttpCallResponseHeaders, ":status").and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// Sends a reply from the proxy; the stream goes no further upstream.
pub fn local_reply(status: u32, headers: &[(&str, &str)], body: &[u8]) {
    if let Err(e) = hostcalls::send_http_response(status, headers.to_vec(), Some(body)) {
        log::warn!("sending a local reply failed: {e:?}");
    }
}

/// Lets a paused request continue upstream.
pub fn resume_request() {
    if composite::defer_resume() {
        return;
    }
    if let Err(status) = hostcalls::resume_http_request() {
        log::warn!("resuming the request failed: {status:?}");
    }
}

/// Sets the root's tick period, never below what the filter instance's other sections need
/// ([`composite::set_tick_floor`]): a section that stops its tick does not stop theirs.
pub fn set_tick_period(period: std::time::Duration) -> Result<(), proxy_wasm::types::Status> {
    let period = match composite::tick_floor() {
        Some(floor) if period.is_zero() || period > floor => floor,
        _ => period,
    };
    hostcalls::set_tick_period(period)
}

/// What a filter instance running several sections needs from the hostcalls its sections make:
/// one VM is single-threaded, so these are per-VM cells the instance sets around its calls.
pub mod composite {
    use std::cell::Cell;
    use std::time::Duration;

    thread_local! {
        static BODY_LEN: Cell<Option<usize>> = const { Cell::new(None) };
        static DEFERRING: Cell<bool> = const { Cell::new(false) };
        static RESUME_WANTED: Cell<bool> = const { Cell::new(false) };
        static TICK_FLOOR: Cell<Option<Duration>> = const { Cell::new(None) };
    }

    /// A body chunk was replaced or grown to `len` bytes: the next section reads that many.
    pub(crate) fn body_edited(len: usize) {
        crate::stream::body_changed();
        BODY_LEN.with(|c| c.set(Some(len)));
    }

    /// The current chunk's length if a section changed it since the last call.
    pub fn take_body_len() -> Option<usize> {
        BODY_LEN.with(Cell::take)
    }

    /// While set, a section's request to resume the request is recorded instead of made: the
    /// instance first runs its later sections on the event that was paused.
    pub fn set_deferring(on: bool) {
        DEFERRING.with(|c| c.set(on));
    }

    /// Whether a section asked to resume the request while deferring (cleared by reading).
    pub fn take_resume_wanted() -> bool {
        RESUME_WANTED.with(Cell::take)
    }

    pub(crate) fn defer_resume() -> bool {
        let deferring = DEFERRING.with(Cell::get);
        if deferring {
            RESUME_WANTED.with(|c| c.set(true));
        }
        deferring
    }

    /// The shortest tick some section of the instance always needs (`None`: none does).
    pub fn set_tick_floor(floor: Option<Duration>) {
        TICK_FLOOR.with(|c| c.set(floor));
    }

    pub(crate) fn tick_floor() -> Option<Duration> {
        TICK_FLOOR.with(Cell::get)
    }
}

/// proxy-wasm shared data (one Envoy process, every worker and VM) as a CAS store for
/// `sluice_core::store` (budget ledger, latency windows and breakers, shared counters).
pub struct SharedData;

impl sluice_core::store::SharedStore for SharedData {
    fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, u32), sluice_core::store::StoreError> {
        match hostcalls::get_shared_data(key) {
            Ok((value, cas)) => Ok((value, cas.unwrap_or(0))),
            Err(status) => Err(sluice_core::store::StoreError::Unavailable(format!("{status:?}"))),
        }
    }

    fn set(&mut self, key: &str, value: &[u8], cas: u32) -> Result<(), sluice_core::store::StoreError> {
        let cas = if cas == 0 { None } else { Some(cas) };
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(proxy_wasm::types::Status::CasMismatch) => Err(sluice_core::store::StoreError::CasMismatch),
            Err(status) => Err(sluice_core::store::StoreError::Unavailable(format!("{status:?}"))),
        }
    }
}

// The SDK's wrappers for these panic on any status they do not expect (e.g. a context that ended
// between a tick and the call); the raw imports return the status instead.
#[link(wasm_import_module = "env")]
#[allow(clashing_extern_declarations)]
extern "C" {
    fn proxy_continue_stream(stream_type: u32) -> u32;
    fn proxy_close_stream(stream_type: u32) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_get_header_map_pairs(map_type: u32, return_map_data: *mut *mut u8, return_map_size: *mut usize) -> u32;
    fn proxy_get_property(path_data: *const u8, path_size: usize, return_value_data: *mut *mut u8, return_value_size: *mut usize) -> u32;
    fn proxy_get_header_map_value(map_type: u32, key_data: *const u8, key_size: usize, return_value_data: *mut *mut u8, return_value_size: *mut usize) -> u32;
}

/// The whole header map `map` in one hostcall ([`HeaderPairs`]): a callback that reads several
/// headers, or removes ones that are usually absent, reads this once instead. Empty, logged at
/// debug, when the host cannot give the map or gives bytes that are not the ABI's layout. The SDK's
/// `get_map_bytes` panics on an unexpected status and on a name that is not UTF-8; this reads the
/// raw pairs instead.
pub fn headers(map: MapType) -> HeaderPairs {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: a proxy-wasm ABI 0.2.1 import writing a pointer and a size into the two locals.
    let status = unsafe { proxy_get_header_map_pairs(map as u32, &mut data, &mut size) };
    // SAFETY: `data` and `size` are what the import just wrote.
    let Some(bytes) = (unsafe { take_returned(status, data, size, &"the header map") }) else { return HeaderPairs::default() };
    if bytes.is_empty() {
        return HeaderPairs::default();
    }
    HeaderPairs::parse(bytes).unwrap_or_else(|| {
        log::debug!("the host's header map is not in the ABI's layout ({size} bytes)");
        HeaderPairs::default()
    })
}

const STREAM_RESPONSE: u32 = 1;
const STATUS_OK: u32 = 0;
const STATUS_NOT_FOUND: u32 = 1;

/// Makes `context_id` the stream later hostcalls act on (from the root context, e.g. on a tick).
/// `false`, logged at debug, when the host no longer knows the stream.
pub fn set_effective_context(context_id: u32) -> bool {
    // SAFETY: a proxy-wasm ABI 0.2.1 import taking and returning plain integers.
    let status = unsafe { proxy_set_effective_context(context_id) };
    if status != STATUS_OK {
        log::debug!("proxy_set_effective_context({context_id}) returned status {status}");
    }
    status == STATUS_OK
}

/// Lets a paused response continue to the client.
pub fn resume_response() -> bool {
    // SAFETY: as above.
    let status = unsafe { proxy_continue_stream(STREAM_RESPONSE) };
    if status != STATUS_OK {
        log::warn!("resuming the response failed: status {status}");
    }
    status == STATUS_OK
}

/// Resets the stream (both directions): the only way to end a response whose headers already
/// reached the client.
pub fn reset_stream() -> bool {
    // SAFETY: as above.
    let status = unsafe { proxy_close_stream(STREAM_RESPONSE) };
    if status != STATUS_OK {
        log::warn!("resetting the stream failed: status {status}");
    }
    status == STATUS_OK
}

/// The flows' [`View`](sluice_core::flow::View) of the live stream: one hostcall per read.
pub struct LiveView;

impl sluice_core::flow::View for LiveView {
    fn now(&mut self) -> u64 {
        now_ns()
    }
    fn request_header(&mut self, name: &str) -> Option<String> {
        header(MapType::HttpRequestHeaders, name)
    }
    fn request_header_bytes(&mut self, name: &str) -> Option<Vec<u8>> {
        match hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name) {
            Ok(bytes) => bytes,
            Err(status) => {
                log::debug!("reading header {name} failed: {status:?}");
                None
            }
        }
    }
    fn response_header(&mut self, name: &str) -> Option<String> {
        header(MapType::HttpResponseHeaders, name)
    }
    fn body(&mut self, dir: sluice_core::flow::Dir, size: usize) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Owned(stream::body(body_buffer(dir), size))
    }
    fn property(&mut self, path: &[&str]) -> Option<String> {
        property(path)
    }
    fn gateway_reply(&mut self) -> Option<sluice_core::contract::GatewayReply> {
        gateway_reply()
    }
    fn unended_outcome(&mut self) -> sluice_core::report::Outcome {
        interrupted_outcome()
    }
    fn response_observer(&mut self, kind: sluice_core::api::ApiKind) -> sluice_core::observation::Observer {
        stream::observer(kind)
    }
}

/// A [`View`](sluice_core::flow::View) whose request headers come from one read of the whole map
/// ([`headers`]), for a callback that reads several of them or checks for ones that are usually
/// absent; everything else is read live.
pub struct RequestHeadersView(pub HeaderPairs);

impl sluice_core::flow::View for RequestHeadersView {
    fn now(&mut self) -> u64 {
        now_ns()
    }
    fn request_header(&mut self, name: &str) -> Option<String> {
        self.0.text(name)
    }
    fn request_header_bytes(&mut self, name: &str) -> Option<Vec<u8>> {
        self.0.first(name).map(<[u8]>::to_vec)
    }
    fn response_header(&mut self, name: &str) -> Option<String> {
        LiveView.response_header(name)
    }
    fn body(&mut self, dir: sluice_core::flow::Dir, size: usize) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Owned(LiveView.body(dir, size).into_owned())
    }
    fn property(&mut self, path: &[&str]) -> Option<String> {
        LiveView.property(path)
    }
    fn gateway_reply(&mut self) -> Option<sluice_core::contract::GatewayReply> {
        LiveView.gateway_reply()
    }
    fn unended_outcome(&mut self) -> sluice_core::report::Outcome {
        LiveView.unended_outcome()
    }
    fn response_observer(&mut self, kind: sluice_core::api::ApiKind) -> sluice_core::observation::Observer {
        LiveView.response_observer(kind)
    }
}

fn body_buffer(dir: sluice_core::flow::Dir) -> BufferType {
    match dir {
        sluice_core::flow::Dir::Request => BufferType::HttpRequestBody,
        sluice_core::flow::Dir::Response => BufferType::HttpResponseBody,
    }
}

fn header_map(dir: sluice_core::flow::Dir) -> MapType {
    match dir {
        sluice_core::flow::Dir::Request => MapType::HttpRequestHeaders,
        sluice_core::flow::Dir::Response => MapType::HttpResponseHeaders,
    }
}

/// Applies a flow's effects to the live stream, in order, and empties the list. `body_size` is the
/// size of the current body chunk (0 outside body callbacks).
pub fn apply(effects: &mut sluice_core::flow::Effects, metrics: &mut Metrics, body_size: usize) {
    use sluice_core::flow::{Effect, LogLevel};
    for effect in effects.drain() {
        match effect {
            Effect::Count { name, delta } => metrics.add(MetricType::Counter, &name, delta),
            Effect::GaugeAdd { name, delta } => metrics.add(MetricType::Gauge, &name, delta),
            Effect::GaugeSet { name, value } => metrics.set_gauge(&name, value),
            Effect::Record { name, value } => metrics.record(&name, value),
            Effect::SetState { key, value } => set_property(&key, &value),
            Effect::SetHeader { dir, name, value } => set_header(header_map(dir), &name, value.as_deref()),
            Effect::ReplaceBody { dir, bytes } => replace_body(body_buffer(dir), body_size, &bytes),
            Effect::AppendBody { dir, bytes } => append_body(body_buffer(dir), body_size, &bytes),
            Effect::MarkReply(reply) => mark_gateway_reply(reply),
            Effect::LocalReply { status, headers, body } => {
                let pairs: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                local_reply(status, &pairs, &body);
            }
            Effect::WakeGuard => wake_guard(),
            Effect::Log { level, message } => match level {
                LogLevel::Debug => log::debug!("{message}"),
                LogLevel::Info => log::info!("{message}"),
                LogLevel::Warn => log::warn!("{message}"),
                LogLevel::Error => log::error!("{message}"),
            },
            // A failure is logged by the call.
            Effect::ResumeResponse => {
                resume_response();
            }
            Effect::ResetStream => {
                reset_stream();
            }
            Effect::SetTickPeriod { ms } => {
                if let Err(status) = set_tick_period(std::time::Duration::from_millis(ms)) {
                    log::warn!("cannot change the tick period: {status:?}");
                }
            }
        }
    }
}

/// Wakes latency-guard when it holds this stream (its release address is in filter state);
/// otherwise it notices at its next tick, milliseconds later.
fn wake_guard() {
    use sluice_core::contract::{ReleaseAddress, RELEASE_PROPERTY};
    let Some(release) = property(&[RELEASE_PROPERTY]) else { return };
    let Some(ReleaseAddress { stream, queue, vm_id }) = ReleaseAddress::decode(&release) else { return };
    match hostcalls::resolve_shared_queue(vm_id, queue) {
        Ok(Some(queue_id)) => {
            if let Err(status) = hostcalls::enqueue_shared_queue(queue_id, Some(stream.as_bytes())) {
                log::debug!("waking latency-guard failed: {status:?}");
            }
        }
        Ok(None) | Err(_) => log::debug!("latency-guard's release queue {queue} not found"),
    }
}
