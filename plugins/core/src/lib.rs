//! Host-agnostic logic of the sluice proxy-wasm LLM filters.
//!
//! Everything here is pure: no proxy-wasm, no clock, no threads. A plugin hands this crate the bytes
//! and timestamps the host gives it and acts on what comes back, so the same code runs in Envoy, in
//! the wasmtime harness and natively in tests and benches.
//!
//! - [`sse`]: incremental, memory-bounded Server-Sent Events framer.
//! - [`budget`]: per-tenant budgets: policy, windows, CAS ledger, admission and settlement.
//! - [`store`]: the shared CAS store trait, its in-memory versions, the one compare-and-swap loop
//!   ([`store::cas_update`]) and the shared counters built on it.
//! - [`api`]: which LLM API a request speaks, from its path.
//! - [`contract`]: the filter-state keys the plugins share, and the record of a reply the gateway
//!   generated itself.
//! - [`request`]: model, stream flags, limits and a prompt-size estimate from a request body.
//! - [`usage`]: token usage, normalised across OpenAI and Anthropic.
//! - [`response`]: streaming and non-streaming response inspection (content, usage, errors).
//! - [`observation`]: one response observer shared by the policies that read the same stream.
//! - [`price`]: validated price table, glob lookup and integer micro-USD cost.
//! - [`reply`]: error bodies of replies sluice sends itself, in the API's own error shape.
//! - [`report`]: what a finished request becomes: labelled metric samples and the access-log stamp.
//! - [`metrics`]: the catalogue of metric names: one constructor per family of every plugin, and
//!   the table of families (kind, labels, unit) the tests check against `envoy/` and `docs/`.
//! - [`rewrite`]: request body edits (inject `include_usage`, cap output tokens) and the SSE filter
//!   that hides the injected usage from the client.
//! - [`identity`]: API-key hashing and extraction, claims from a verified JWT payload.
//! - [`timing`]: TTFT / TPOT / tokens-per-second arithmetic on host timestamps.
//! - [`routing`]: model-version routing: sticky weighted splits, canary ramps, fallback, shadow
//!   sampling, and the similarity score of shadow comparisons.
//! - [`latency`]: latency guard: quantile sketch, rolling latency windows, SLO circuit breaker,
//!   priority shedding and the latency-guard policy.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing))]

pub mod api;
pub mod budget;
pub mod contract;
pub mod flow;
pub mod headers;
pub mod identity;
pub mod latency;
pub mod metrics;
pub mod observation;
pub mod price;
pub mod quality;
pub mod reply;
pub mod report;
pub mod request;
pub mod response;
pub mod rewrite;
pub mod routing;
pub(crate) mod scan;
pub mod sort;
pub mod span;
pub mod sse;
pub mod store;
pub mod text;
pub mod timing;
pub mod usage;
pub mod vecmap;

pub mod json;
