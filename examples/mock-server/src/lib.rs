//! sluice-mock-server: a mock LLM inference server for testing sluice end to end.
//!
//! It speaks plain HTTP/1.1 on `std::net` (a thread per connection, keep-alive, chunked streaming
//! with one HTTP chunk per SSE event) and answers the OpenAI chat completions, legacy completions,
//! Responses and Anthropic Messages APIs with deterministic content. Timing, token counts, usage
//! reporting and failures are scripted per request with `x-mock-*` headers (see [`controls`]),
//! which pass through Envoy, so a test drives the upstream from the client side.
//!
//! Modules: [`http`] reads requests and writes responses, [`controls`] turns headers into
//! behaviour, [`api`] renders each API's payloads, [`server`] ties them together, [`stats`] counts,
//! [`ledger`] records what happened to each request, [`traffic`] every connection and request head
//! that reached the mock (answered or not).

pub mod api;
pub mod controls;
pub mod http;
pub mod ledger;
pub mod server;
pub mod stats;
pub mod traffic;
pub mod wire;

pub use controls::Defaults;
pub use server::{Config, Server};
