//! sluice latency-guard: per-tenant-class latency policies in Envoy — TTFT and total deadlines, an
//! SLO circuit breaker per model version with fallback through model-router, and priority shedding
//! against per-version in-flight limits.
//!
//! It is the sluice engine (`sluice-engine`) built with one section, configured with latency-guard's
//! policy unwrapped; every rule is in `sluice_core::flow::guard` (docs/latency-guard.md).

pub use sluice_core::contract::{AVOID_PROPERTY, FIRST_TOKEN_PROPERTY, RELEASE_PROPERTY};

proxy_wasm::main! {{
    sluice_engine::start_latency_guard();
}}
