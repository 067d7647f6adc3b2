//! The host side of every proxy-wasm 0.2.1 import, one function per hostcall, grouped by subject.
//! Each submodule owns the piece of [`HostState`](crate::state::HostState) its hostcalls work on
//! and registers its functions with [`add_to_linker`].

use wasmtime::{Linker, Result};

use crate::state::HostState;

pub(crate) mod buffers;
pub(crate) mod callouts;
pub(crate) mod clock;
pub(crate) mod context;
pub(crate) mod grpc;
pub(crate) mod http_callouts;
pub(crate) mod logging;
pub(crate) mod maps;
pub(crate) mod metrics;
pub(crate) mod properties;
pub(crate) mod queues;
pub(crate) mod shared_data;
pub(crate) mod streams;
pub(crate) mod timers;

/// Module name of every proxy-wasm import.
pub(crate) const MODULE: &str = "env";

/// Defines every hostcall in `linker`.
pub(crate) fn add_to_linker(linker: &mut Linker<HostState>) -> Result<()> {
    logging::add_to_linker(linker)?;
    clock::add_to_linker(linker)?;
    timers::add_to_linker(linker)?;
    maps::add_to_linker(linker)?;
    buffers::add_to_linker(linker)?;
    properties::add_to_linker(linker)?;
    shared_data::add_to_linker(linker)?;
    queues::add_to_linker(linker)?;
    metrics::add_to_linker(linker)?;
    http_callouts::add_to_linker(linker)?;
    grpc::add_to_linker(linker)?;
    streams::add_to_linker(linker)?;
    context::add_to_linker(linker)?;
    Ok(())
}
