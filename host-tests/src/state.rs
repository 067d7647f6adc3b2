//! Everything the host knows, kept in the wasmtime `Store` (`Store<HostState>`): one value per
//! gateway, no globals, so any number of gateways run side by side on different threads.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use wasmtime_wasi::p1::WasiP1Ctx;
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;

use crate::abi::LogLevel;
use crate::guest::GuestExports;
use crate::headers::Headers;
use crate::hostcalls::callouts::{CalloutReply, Callouts};
use crate::hostcalls::clock::VirtualClock;
use crate::hostcalls::metrics::Metrics;
use crate::hostcalls::properties::Properties;
use crate::hostcalls::queues::Queues;
use crate::hostcalls::shared_data::SharedData;
use crate::hostcalls::timers::Timer;

/// State several VMs of one process share (a [`crate::Chain`]); a lone gateway has its own.
pub(crate) type Shared<T> = Arc<Mutex<T>>;

/// Locks `m`; a panic elsewhere while it was held leaves the data as it was, which is still usable.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The context id of the plugin's root context. Stream contexts count up from the next one.
pub(crate) const ROOT_CONTEXT: u32 = 1;

/// One line the plugin logged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogLine {
    pub level: LogLevel,
    /// The context that was active (root or a stream).
    pub context_id: u32,
    pub message: String,
    /// Virtual time of the line, ns since the epoch.
    pub at_ns: u64,
}

/// A response the plugin sent itself with `proxy_send_local_response`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u32,
    /// Envoy's `response_code_details`; empty when the plugin passed none.
    pub details: String,
    pub body: Vec<u8>,
    pub headers: Headers,
    /// The gRPC status, when the plugin asked for a gRPC reply (`-1` means none).
    pub grpc_status: i32,
}

/// What the configuration of the plugin says about itself (Envoy's `PluginConfig`).
#[derive(Clone, Debug)]
pub(crate) struct PluginInfo {
    pub name: String,
    pub root_id: String,
    pub vm_id: String,
    pub configuration: Vec<u8>,
    pub vm_configuration: Vec<u8>,
    pub log_level: LogLevel,
}

/// One direction of an HTTP stream as the plugin and the peer see it.
///
/// `headers`, `body` and `trailers` are what the plugin currently sees and may change; `sent_*`
/// is what has gone past the plugin to the other side (upstream for the request, the client for
/// the response).
#[derive(Clone, Debug, Default)]
pub(crate) struct Direction {
    pub headers: Headers,
    pub trailers: Headers,
    /// Body bytes the plugin holds: the current chunk, or everything buffered since it paused.
    pub body: Vec<u8>,
    pub headers_seen: bool,
    pub trailers_seen: bool,
    /// The plugin returned Pause and has not resumed yet.
    pub paused: bool,
    pub sent_headers: Option<Headers>,
    pub sent_body: Vec<u8>,
    pub sent_trailers: Option<Headers>,
    /// A chain took `sent_headers` on to the next filter.
    pub headers_forwarded: bool,
}

impl Direction {
    /// Lets everything held so far pass: headers (once), buffered body, trailers (once).
    pub fn release(&mut self) {
        self.paused = false;
        if self.headers_seen && self.sent_headers.is_none() {
            self.sent_headers = Some(self.headers.clone());
        }
        self.sent_body.append(&mut self.body);
        if self.trailers_seen && self.sent_trailers.is_none() {
            self.sent_trailers = Some(self.trailers.clone());
        }
    }
}

/// Where an HTTP stream is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Events are delivered to the plugin.
    Open,
    /// The plugin answered with a local reply or closed the stream: later events are dropped.
    Stopped,
    /// `proxy_on_delete` has run: the context no longer exists.
    Finished,
}

/// The host side of one HTTP stream context.
#[derive(Clone, Debug)]
pub(crate) struct HttpStream {
    /// Whether `proxy_on_context_create` has run (it runs lazily, on the first event, like Envoy).
    pub created: bool,
    pub phase: Phase,
    pub request: Direction,
    pub response: Direction,
    /// Filter state and attributes of this stream; in a chain every filter's context of the
    /// stream holds the same one, as Envoy's filter state is per stream, not per filter.
    pub properties: Shared<Properties>,
    pub local_reply: Option<LocalReply>,
    pub closed_by_plugin: bool,
    /// Virtual time of the first event (the `request.time` property).
    pub started_ns: u64,
}

impl HttpStream {
    pub fn new() -> Self {
        Self {
            created: false,
            phase: Phase::Open,
            request: Direction::default(),
            response: Direction::default(),
            properties: Shared::default(),
            local_reply: None,
            closed_by_plugin: false,
            started_ns: 0,
        }
    }
}

/// Work a hostcall asks for that must run after the current callback returns (Envoy posts it to
/// the worker's event loop; calling back into the plugin from inside a hostcall would re-enter it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Deferred {
    /// `vm` is the index of the VM that owns the queue in its process (0 for a lone gateway).
    QueueReady { vm: u32, context_id: u32, queue_id: u32 },
}

/// Data that exists only while one callback runs: the reply of the callout being delivered, the
/// gRPC message or metadata, and the gRPC status.
#[derive(Debug, Default)]
pub(crate) struct CallbackData {
    pub http_reply: Option<CalloutReply>,
    pub grpc_message: Option<Vec<u8>>,
    pub grpc_metadata: Option<Headers>,
    pub grpc_status: Option<(u32, String)>,
}

/// The whole host state of one gateway (one plugin VM).
pub(crate) struct HostState {
    pub wasi: WasiP1Ctx,
    /// What the plugin wrote to stderr (Rust panic messages land here without a panic hook).
    pub stderr: MemoryOutputPipe,
    pub clock: VirtualClock,
    pub plugin: PluginInfo,
    /// The context the plugin is acting for: set before each callback and by
    /// `proxy_set_effective_context`.
    pub effective_context: u32,
    /// Hostcalls made so far (counted by a call hook, for the profile).
    pub hostcalls: u64,
    next_context_id: u32,
    pub logs: Vec<LogLine>,
    pub streams: BTreeMap<u32, HttpStream>,
    /// Properties set on the root context, or given by the test for every stream.
    pub properties: Properties,
    pub metrics: Metrics,
    /// This VM's index in its process (0 for a lone gateway; a chain's filter order otherwise).
    pub vm: u32,
    pub shared_data: Shared<SharedData>,
    pub queues: Shared<Queues>,
    pub callouts: Callouts,
    pub timer: Timer,
    pub callback: CallbackData,
    /// Work for after the callback, for whichever VM of the process it concerns.
    pub deferred: Shared<VecDeque<Deferred>>,
    /// Streams whose flow changed outside their own callbacks (resumed, replied, closed): a chain
    /// moves what they let go on to the next filter.
    pub touched: Vec<u32>,
    /// Log lines below this level are dropped instead of kept (the simulator keeps warnings only).
    pub keep_logs_from: LogLevel,
    /// Kept lines are also printed to stderr (tests show them on failure; the simulator does not).
    pub echo_logs: bool,
    /// How many times the plugin called `proxy_done`.
    pub done_calls: u32,
    /// The plugin's memory and allocator, once the VM is instantiated.
    pub guest: GuestExports,
    /// The buffer values returned to the plugin are put together in, kept between hostcalls.
    pub scratch: Vec<u8>,
}

impl HostState {
    pub fn new(wasi: WasiP1Ctx, stderr: MemoryOutputPipe, clock: VirtualClock, plugin: PluginInfo) -> Self {
        Self {
            wasi,
            stderr,
            clock,
            plugin,
            effective_context: ROOT_CONTEXT,
            hostcalls: 0,
            next_context_id: ROOT_CONTEXT + 1,
            logs: Vec::new(),
            streams: BTreeMap::new(),
            properties: Properties::default(),
            metrics: Metrics::default(),
            vm: 0,
            shared_data: Shared::default(),
            queues: Shared::default(),
            callouts: Callouts::default(),
            timer: Timer::default(),
            callback: CallbackData::default(),
            deferred: Shared::default(),
            touched: Vec::new(),
            keep_logs_from: LogLevel::Trace,
            echo_logs: true,
            done_calls: 0,
            guest: GuestExports::default(),
            scratch: Vec::new(),
        }
    }

    /// Registers a new HTTP stream and returns its context id.
    pub fn new_stream(&mut self) -> u32 {
        let id = self.next_context_id;
        self.next_context_id += 1;
        self.streams.insert(id, HttpStream::new());
        id
    }

    /// The stream the plugin is acting for, if the effective context is a live stream.
    pub fn current_stream(&self) -> Option<&HttpStream> {
        self.streams.get(&self.effective_context).filter(|s| s.phase != Phase::Finished)
    }

    /// Mutable [`HostState::current_stream`].
    pub fn current_stream_mut(&mut self) -> Option<&mut HttpStream> {
        self.streams.get_mut(&self.effective_context).filter(|s| s.phase != Phase::Finished)
    }

    /// Whether `context_id` names the root or a live stream.
    pub fn context_exists(&self, context_id: u32) -> bool {
        context_id == ROOT_CONTEXT || self.streams.get(&context_id).is_some_and(|s| s.created && s.phase != Phase::Finished)
    }
}
