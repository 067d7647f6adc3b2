//! The engine's configuration, which lives in core (`sluice_core::flow::sections`) so that every
//! host of the engine (this proxy-wasm one and the native module) parses it alike.

pub use sluice_core::flow::sections::*;
