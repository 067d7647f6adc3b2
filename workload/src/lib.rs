//! sluice-workload: the workload model `sluice-sim` and `sluice-playground` share, so that one
//! workload replays the same way offline (the production `.wasm` plugins) and in the browser
//! (the same core flows over an in-memory host), and their agreement test compares two hosts, not
//! two copies of the model.
//!
//! - [`upstream`]: how each upstream serves ([`upstream::Upstream`], [`upstream::Incident`], their
//!   defaults and checks), the service times of a request by batch size, and its seeded failure.
//! - [`request`]: the HTTP request a trace line stands for: prompt text and JSON body of its API.
//! - [`draw`]: the reproducible per-request draws (SplitMix64 of seed and trace line).
//! - [`traffic`]: the defaults of requests that do not say (tenant header, users, model, output).
//!
//! Pure Rust over serde and `sluice-core`: it is compiled to wasm32-unknown-unknown for the page.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing))]

pub mod draw;
pub mod request;
pub mod traffic;
pub mod upstream;
