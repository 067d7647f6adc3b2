//! sluice llm-metrics: a proxy-wasm HTTP filter that measures every LLM request passing through
//! Envoy — time to first content token, time per output token, decode tokens/s, duration, token
//! counts, cost — as Envoy metrics with bounded labels, plus a per-request access-log stamp.
//!
//! It is the sluice engine (`sluice-engine`) built with one section, configured with llm-metrics'
//! policy unwrapped; every rule is in `sluice_core::flow::metrics`. It never buffers a stream and
//! never delays a request.

pub use sluice_core::contract::FIRST_TOKEN_PROPERTY;
/// The configuration lives in core with the flow; re-exported under its old path.
pub use sluice_core::flow::metrics::config;

proxy_wasm::main! {{
    sluice_engine::start_llm_metrics();
}}
