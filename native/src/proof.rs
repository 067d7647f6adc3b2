//! The proof filter: one measurable thing per event and no sluice policy yet, to show the binding
//! works in the real Envoy (tests/envoy.rs).
//!
//! - request headers: reads `:path`, sets request header `x-sluice-native: 1` (the upstream sees it);
//!   a request for [`REFUSE_PATH`] is answered locally with a 429 and never reaches the upstream;
//! - response headers: adds `x-sluice-native-seen: <path>`;
//! - response body: counts its bytes, read in place;
//! - stream complete: writes the count to filter state [`BYTES_FILTER_STATE`] (for the access log),
//!   adds 1 to counter `native_streams{filter}` and records the count in histogram
//!   `native_response_body_bytes{filter}` (with `metrics_namespace: sluice`, Prometheus shows
//!   `envoy_sluice_native_streams{filter="proof"}`).
//!
//! `proof-hold` does the same and also holds the request headers until the whole request body has
//! been read, then sets `x-sluice-native-request-body-bytes: <n>` on them — the headers changed
//! after the body was read, in the same filter, which proxy-wasm needs a second filter for.

use crate::filter::{log, BodyKind, BodyStatus, ConfigContext, CounterId, Envoy, Filter, FilterConfig, HeadersStatus, HistogramId, LogLevel};

/// The filter names this module answers to (`DynamicModuleFilter.filter_name`).
pub const FILTER_NAMES: &[&str] = &["proof", "proof-hold"];
/// The filter state key of the response body byte count.
pub const BYTES_FILTER_STATE: &str = "sluice_native_bytes";
/// A request for this path is refused locally.
pub const REFUSE_PATH: &[u8] = b"/sluice-native/refuse";

/// The configuration of one proof filter.
pub struct ProofConfig {
    name: &'static str,
    hold_request_for_body: bool,
    streams: CounterId,
    body_bytes: HistogramId,
}

/// Accepts filter `name` with an empty configuration (no bytes, or `{}` — an empty
/// `google.protobuf.Struct` arrives as JSON); anything else is refused with the reason.
pub fn new_config(name: &[u8], config: &[u8], context: &mut ConfigContext<'_>) -> Result<ProofConfig, String> {
    let name = validate(name, config)?;
    let streams = context.define_counter("native_streams", &["filter"]).map_err(|e| format!("defining counter native_streams: {e}"))?;
    let body_bytes =
        context.define_histogram("native_response_body_bytes", &["filter"]).map_err(|e| format!("defining histogram native_response_body_bytes: {e}"))?;
    Ok(ProofConfig { name, hold_request_for_body: name == "proof-hold", streams, body_bytes })
}

/// The known filter name, if `name` is one and `config` is empty; the reason otherwise.
fn validate(name: &[u8], config: &[u8]) -> Result<&'static str, String> {
    let Some(&name) = FILTER_NAMES.iter().find(|known| known.as_bytes() == name) else {
        return Err(format!("unknown filter_name {:?} (this module has: {})", String::from_utf8_lossy(name), crate::FILTER_NAMES.join(", ")));
    };
    crate::filter::no_configuration(name, config, " yet")?;
    Ok(name)
}

impl FilterConfig for ProofConfig {
    fn new_filter(&self) -> Box<dyn Filter> {
        Box::new(ProofFilter {
            name: self.name,
            hold_request_for_body: self.hold_request_for_body,
            streams: self.streams,
            body_bytes: self.body_bytes,
            path: Vec::new(),
            request_body_bytes: 0,
            response_body_bytes: 0,
        })
    }
}

struct ProofFilter {
    name: &'static str,
    hold_request_for_body: bool,
    streams: CounterId,
    body_bytes: HistogramId,
    path: Vec<u8>,
    request_body_bytes: u64,
    response_body_bytes: u64,
}

impl Filter for ProofFilter {
    fn on_request_headers(&mut self, envoy: &mut Envoy<'_>, end_of_stream: bool) -> HeadersStatus {
        let mut headers = envoy.request_headers();
        self.path = headers.get(":path").map(<[u8]>::to_vec).unwrap_or_default();
        #[cfg(feature = "panic-probe")]
        if headers.get("x-sluice-native-panic").is_some() {
            panic_probe();
        }
        if self.path == REFUSE_PATH {
            envoy.send_response(429, &[("x-sluice-native-refused", b"1")], b"refused by sluice-native\n", "sluice_native_refused");
            return HeadersStatus::StopIteration;
        }
        headers.set("x-sluice-native", b"1");
        if self.hold_request_for_body && !end_of_stream {
            return HeadersStatus::StopIteration;
        }
        HeadersStatus::Continue
    }

    fn on_request_body(&mut self, envoy: &mut Envoy<'_>, end_of_stream: bool) -> BodyStatus {
        if !self.hold_request_for_body {
            return BodyStatus::Continue;
        }
        self.request_body_bytes += envoy.body(BodyKind::ReceivedRequest).len() as u64;
        if !end_of_stream {
            return BodyStatus::StopIterationAndBuffer;
        }
        envoy.request_headers().set("x-sluice-native-request-body-bytes", self.request_body_bytes.to_string().as_bytes());
        BodyStatus::Continue
    }

    fn on_response_headers(&mut self, envoy: &mut Envoy<'_>, _end_of_stream: bool) -> HeadersStatus {
        envoy.response_headers().add("x-sluice-native-seen", &self.path);
        HeadersStatus::Continue
    }

    fn on_response_body(&mut self, envoy: &mut Envoy<'_>, _end_of_stream: bool) -> BodyStatus {
        self.response_body_bytes += envoy.body(BodyKind::ReceivedResponse).len() as u64;
        BodyStatus::Continue
    }

    fn on_stream_complete(&mut self, envoy: &mut Envoy<'_>) {
        if !envoy.set_filter_state(BYTES_FILTER_STATE, self.response_body_bytes.to_string().as_bytes()) {
            log(LogLevel::Warn, "sluice-native: could not set filter state sluice_native_bytes");
        }
        if let Err(e) = envoy.increment_counter(self.streams, &[self.name], 1) {
            log(LogLevel::Warn, &format!("sluice-native: counter native_streams: {e}"));
        }
        if let Err(e) = envoy.record_histogram(self.body_bytes, &[self.name], self.response_body_bytes) {
            log(LogLevel::Warn, &format!("sluice-native: histogram native_response_body_bytes: {e}"));
        }
    }
}

/// The `panic-probe` feature's deliberate panic.
#[cfg(feature = "panic-probe")]
#[allow(clippy::panic)]
fn panic_probe() -> ! {
    panic!("sluice-native panic probe: the request carries x-sluice-native-panic")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_names_with_empty_configs_are_accepted() {
        assert_eq!(validate(b"proof", b""), Ok("proof"));
        assert_eq!(validate(b"proof", b" {} \n"), Ok("proof"));
        assert_eq!(validate(b"proof-hold", b"{}"), Ok("proof-hold"));
    }

    #[test]
    fn anything_else_is_refused_with_the_reason() {
        assert_eq!(
            validate(b"router", b""),
            Err("unknown filter_name \"router\" (this module has: sluice, sluice-body-metadata, proof, proof-hold, floor)".to_string())
        );
        assert_eq!(validate(b"proof", br#"{"model":"x"}"#), Err(r#"filter "proof" takes no configuration yet; got 13 bytes: "{\"model\":\"x\"}""#.to_string()));
    }
}
