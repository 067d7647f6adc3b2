//! The safe filter API: what an in-module filter implements. The hooks in `abi` call these methods,
//! each under `catch_unwind`, with an [`Envoy`] handle valid for that call only.

pub use crate::abi::{
    log, log_enabled, Attribute, Body, BodyKind, CalloutAnswer, CalloutError, CalloutRequest, ConfigContext, ConfigHost, ConfigScheduler, CounterId, Envoy,
    GaugeId, HeaderMap, HistogramId, LogLevel, Metrics, MetricsError, Scheduler,
};

/// What a headers hook tells Envoy (`FilterHeadersStatus`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadersStatus {
    /// Pass the headers on to the next filter.
    Continue,
    /// Hold the headers; this filter still gets the body (and may change the headers while
    /// reading it) and continues by returning `Continue` from a body hook.
    StopIteration,
    /// Hold the headers and buffer the body without calling this filter's body hooks.
    StopAllIterationAndBuffer,
}

/// What a body hook tells Envoy (`FilterDataStatus`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyStatus {
    /// Pass the data (and held headers) on.
    Continue,
    /// Hold the data and buffer it; the next call sees more (`BodyKind::Buffered…` has it all).
    StopIterationAndBuffer,
    /// Hold without buffering.
    StopIterationNoBuffer,
}

/// One HTTP stream's filter, made by [`FilterConfig::new_filter`]. Every method has a default that
/// continues, so a filter implements only the events it needs.
pub trait Filter {
    /// The request headers arrived (`end_of_stream`: the request has no body).
    fn on_request_headers(&mut self, _envoy: &mut Envoy<'_>, _end_of_stream: bool) -> HeadersStatus {
        HeadersStatus::Continue
    }

    /// A piece of the request body arrived (`BodyKind::ReceivedRequest`).
    fn on_request_body(&mut self, _envoy: &mut Envoy<'_>, _end_of_stream: bool) -> BodyStatus {
        BodyStatus::Continue
    }

    /// The response headers arrived.
    fn on_response_headers(&mut self, _envoy: &mut Envoy<'_>, _end_of_stream: bool) -> HeadersStatus {
        HeadersStatus::Continue
    }

    /// A piece of the response body arrived (`BodyKind::ReceivedResponse`).
    fn on_response_body(&mut self, _envoy: &mut Envoy<'_>, _end_of_stream: bool) -> BodyStatus {
        BodyStatus::Continue
    }

    /// The response trailers arrived (they end the response: no body event with end of stream
    /// follows).
    fn on_response_trailers(&mut self, _envoy: &mut Envoy<'_>) {}

    /// The stream is over; called before Envoy writes the access logs.
    fn on_stream_complete(&mut self, _envoy: &mut Envoy<'_>) {}

    /// An event committed through the stream's [`Scheduler`] (on the stream's worker).
    fn on_scheduled(&mut self, _envoy: &mut Envoy<'_>, _event: u64) {}

    /// The answer to callout `id` this stream sent ([`Envoy::http_callout`]), on its worker.
    fn on_callout_done(&mut self, _envoy: &mut Envoy<'_>, _id: u64, _answer: &CalloutAnswer) {}
}

/// A validated filter configuration: made on Envoy's main thread, shared by the workers, each of
/// which asks it for one [`Filter`] per stream.
pub trait FilterConfig: Send + Sync {
    /// The filter of a new stream.
    fn new_filter(&self) -> Box<dyn Filter>;

    /// An event committed through the configuration's [`ConfigScheduler`], on Envoy's main thread.
    fn on_scheduled(&self, _config: &mut ConfigHost<'_>, _event: u64) {}

    /// The answer to configuration callout `id` ([`ConfigHost::http_callout`]), on the main thread.
    fn on_callout_done(&self, _config: &mut ConfigHost<'_>, _id: u64, _answer: &CalloutAnswer) {}

    /// Envoy is destroying the configuration (after every stream of it), with its metrics still
    /// usable through `config`: the last chance to send what the configuration holds. On the main
    /// thread, unless Envoy lets go of the configuration inside a [`ConfigScheduler`]'s commit.
    fn on_destroy(&self, _config: &mut ConfigHost<'_>) {}
}

/// Accepts the configuration of a filter that takes none: no bytes, or `{}` (an empty
/// `google.protobuf.Struct` arrives as JSON). Anything else is refused, naming `filter`, with
/// `why` after "takes no configuration", the size and the first 80 characters.
pub fn no_configuration(filter: &str, config: &[u8], why: &str) -> Result<(), String> {
    let trimmed = config.trim_ascii();
    if trimmed.is_empty() || trimmed == b"{}" {
        return Ok(());
    }
    let shown: String = String::from_utf8_lossy(trimmed).chars().take(80).collect();
    Err(format!("filter {filter:?} takes no configuration{why}; got {} bytes: {shown:?}", config.len()))
}

/// The buffer limit a filter of the module raises a stream's to when it holds the request body:
/// 9 MiB, what the wasm gateways' `buffer` filter allows (`max_request_bytes: 9437184`), above
/// tenant-budget's own 8 MiB bound so that the budget answers an oversized body itself. Without it
/// Envoy's default (the listener's 1 MiB) answers 413 to any longer body the module holds.
pub const HELD_BODY_BUFFER_LIMIT: u64 = 9 * 1024 * 1024;
