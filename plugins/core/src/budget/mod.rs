//! Per-tenant token and money budgets: the policy (org → team → key, budgets per level), calendar
//! windows, the CAS ledger of reservations, and admission/settlement of one request.
//!
//! Host-agnostic: the ledger talks to a [`crate::store::SharedStore`] (proxy-wasm shared data in
//! Envoy, [`crate::store::MemoryStore`] in tests), and time is a nanosecond timestamp the caller passes in.

pub mod admission;
pub mod identities;
pub mod ledger;
pub mod policy;
pub mod remote;
pub mod window;

pub use admission::{Admission, AdmitError, Demand, Refusal, RemoteHold, Settlement};
pub use policy::{Level, Limit, Mode, Policy, PolicyError};
pub use window::Window;
