//! `sluice-host`: a [wasmtime] host for the proxy-wasm ABI 0.2.1 with a virtual clock, for fast,
//! deterministic, exact-timing tests of the built sluice `.wasm` plugins.
//!
//! ```no_run
//! use std::time::Duration;
//! use sluice_host::{workspace_wasm, Action, Gateway};
//!
//! # fn main() -> anyhow::Result<()> {
//! let gw = Gateway::load(workspace_wasm("sluice_llm_metrics"), r#"{}"#)?;
//! let mut s = gw.stream();
//! assert_eq!(s.request_headers(&[(":method", "POST"), (":path", "/v1/chat/completions")], false)?, Action::Continue);
//! s.request_body(br#"{"model":"m","stream":true}"#, true)?;
//! gw.advance(Duration::from_millis(180))?;
//! s.response_headers(&[(":status", "200"), ("content-type", "text/event-stream")], false)?;
//! s.response_body(b"data: {}\n\n", true)?;
//! s.end()?;
//! println!("{:?} {:?}", gw.histogram("sluice.ttft_ms"), s.downstream_body());
//! # Ok(()) }
//! ```
//!
//! Layout: [`abi`] is the ABI vocabulary and wire format; `hostcalls` holds one function per
//! import, grouped by subject (logging, clock, timers, maps, buffers, properties, shared data,
//! queues, metrics, HTTP and gRPC callouts, stream control, contexts); `state` is everything the
//! host keeps, all of it inside the wasmtime `Store`; [`Gateway`] runs the VM lifecycle and the
//! clock; [`Stream`] drives one HTTP stream.

pub mod abi;
mod chain;
mod coverage;
mod gateway;
mod guest;
mod headers;
mod hostcalls;
mod state;
mod stream;

use std::path::PathBuf;

pub use abi::{Action, LogLevel, MetricType, Status};
pub use chain::{Chain, ChainEvent, IdHasher, IdMap, StreamId, FULL_GATEWAY, SLUICE_GATEWAY};
pub use coverage::unimplemented_imports;
pub use gateway::{CallProfile, Gateway, Plugin, PluginSpec};
pub use headers::Headers;
pub use hostcalls::callouts::{GrpcCall, GrpcKind, HttpCall, HttpReply};
pub use hostcalls::clock::DEFAULT_EPOCH_NS;
pub use hostcalls::metrics::GaugeChange;
pub use state::{LocalReply, LogLine};
pub use stream::Stream;

/// The workspace's target directory (`<workspace>/target`), found from this crate's manifest
/// directory, or `CARGO_TARGET_DIR` when set.
pub fn workspace_target_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(dir);
    }
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest_dir.parent().map_or_else(|| manifest_dir.join("target"), |workspace| workspace.join("target"))
}

/// Where the workspace build puts plugin `name` (e.g. `sluice_llm_metrics`):
/// `<workspace>/target/wasm32-wasip1/release/<name>.wasm`.
pub fn workspace_wasm(name: &str) -> PathBuf {
    workspace_target_dir().join("wasm32-wasip1").join("release").join(format!("{name}.wasm"))
}
