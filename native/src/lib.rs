//! `libsluice.so`: sluice as an Envoy dynamic module (issue 27): its binding to Envoy 1.40.0's
//! dynamic-module ABI, the engine (filter `sluice`, configured as `sluice.wasm` is; [`engine`]) and
//! the lift of the request body's model into metadata for model-router (filter
//! `sluice-body-metadata`; [`lift`]), a proof filter (`proof`, `proof-hold`; [`proof`]) and the
//! benches' floor (`floor`; [`floor`]).
//!
//! - [`abi`] (private) is the only module with `unsafe` code: the ABI's types, the callbacks the
//!   module calls (resolved by name when Envoy loads it), the event hooks Envoy calls, and safe
//!   types over them ([`filter::Envoy`], [`filter::HeaderMap`], [`filter::Body`],
//!   [`filter::ConfigContext`]). No panic crosses into Envoy (see its docs for the build setting
//!   that takes).
//! - [`filter`] is the safe API an in-module filter implements: [`filter::Filter`],
//!   [`filter::FilterConfig`].
//!
//! Envoy loads it with `dynamic_module_config: { name: sluice, do_not_close: true }` from the
//! directory in `ENVOY_DYNAMIC_MODULES_SEARCH_PATH` (tests/envoy-native.yaml). A native module runs
//! in Envoy's process without a sandbox: a crash in it (not a panic, which is caught) takes Envoy
//! down.
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![deny(unsafe_code)]

mod abi;
pub mod engine;
pub mod filter;
pub mod floor;
pub mod lift;
pub mod proof;

pub use abi::{ABI_VERSION, CALLBACKS_USED, ENVOY_RELEASE};

/// The module's filter configurations by `filter_name`, called from Envoy's
/// `on_http_filter_config_new`; an `Err` is logged and makes Envoy refuse the configuration.
fn new_filter_config(name: &[u8], config: &[u8], context: &mut filter::ConfigContext<'_>) -> Result<Box<dyn filter::FilterConfig>, String> {
    if name == engine::FILTER_NAME.as_bytes() {
        return engine::new_config(config, context).map(|config| Box::new(config) as Box<dyn filter::FilterConfig>);
    }
    if name == lift::FILTER_NAME.as_bytes() {
        return lift::new_config(config).map(|config| Box::new(config) as Box<dyn filter::FilterConfig>);
    }
    if name == floor::FILTER_NAME.as_bytes() {
        return floor::new_config(config, context).map(|config| Box::new(config) as Box<dyn filter::FilterConfig>);
    }
    proof::new_config(name, config, context).map(|config| Box::new(config) as Box<dyn filter::FilterConfig>)
}

/// Every filter name this module answers to.
pub const FILTER_NAMES: &[&str] = &[engine::FILTER_NAME, lift::FILTER_NAME, "proof", "proof-hold", floor::FILTER_NAME];
