//! sluice model-router: a proxy-wasm HTTP filter that assigns each LLM request to a version of the
//! model it asks for — sticky per user by consistent hashing, weighted, with ramps, trusted
//! overrides and fallback — and optionally sends a sample to a shadow version whose answer is
//! compared with the primary's and never reaches the client.
//!
//! It is the sluice engine (`sluice-engine`) built with one section, configured with model-router's
//! policy unwrapped; every rule is in `sluice_core::flow::router` (docs/model-router.md).

proxy_wasm::main! {{
    sluice_engine::start_model_router();
}}
