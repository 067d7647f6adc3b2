//! sluice-sim: the offline policy simulator. It replays a trace of requests through the production
//! plugins' `.wasm` files (run by `sluice-host` on a virtual clock) against a modelled upstream and
//! reports what the policies would have done (docs/simulator.md).
//!
//! [`trace`] reads traces, [`verdict`] is what is said about each request, [`report`] turns
//! verdicts into a summary and an HTML report, [`observed`] reads a real gateway's access log into
//! the same verdicts.

pub mod engine;
pub mod gateway;
pub mod observed;
pub mod report;
pub mod scenario;
pub mod trace;
pub mod upstream;
pub mod verdict;
