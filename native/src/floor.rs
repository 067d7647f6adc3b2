//! The floor filter (`floor`), for the benches only: what Envoy charges for a dynamic-module filter
//! that does no work of its own, and for the calls a sluice request makes of Envoy, made with
//! nothing computed between them. `benches/envoy_instructions.py` runs it beside the native chain
//! (docs/native.md, "The floor under the goal").
//!
//! Its configuration is empty (the filter does nothing: every hook continues) or a comma-separated
//! list of the calls to make:
//!
//! - `hold`: the request headers wait until the whole request body has arrived, which is then read
//!   once (what tenant-budget and the model lift do);
//! - `chunks`: every response chunk is read in place (what the observer does);
//! - `histograms=N`: N histogram values at the end of the stream, each with six labels (what
//!   llm-metrics records: ttft, tpot, decode rate, duration, input and output tokens);
//! - `bare_histograms=N`: N values of a histogram without labels (what the labels cost, beside
//!   `histograms=N`);
//! - `states=N`: N filter-state strings written at the end of the stream (the four stamps).

use crate::filter::{log, BodyKind, BodyStatus, ConfigContext, Envoy, Filter, FilterConfig, HeadersStatus, HistogramId, LogLevel};

/// The filter name (`DynamicModuleFilter.filter_name`).
pub const FILTER_NAME: &str = "floor";
/// The labels of the floor's histogram, as many as llm-metrics' histograms have.
const LABELS: [&str; 6] = ["model_version", "tenant", "api", "ctx", "turn", "stream"];
const LABEL_VALUES: [&str; 6] = ["v1", "tenant-1", "chat", "1k", "first", "true"];
/// Filter-state keys for `states=N` (at most this many).
const STATE_KEYS: [&str; 4] = ["sluice_floor_0", "sluice_floor_1", "sluice_floor_2", "sluice_floor_3"];
/// The most histogram values a request the configuration may ask for.
const MAX_HISTOGRAMS: u32 = 64;

/// What a floor filter does per request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Calls {
    pub hold: bool,
    pub chunks: bool,
    pub histograms: u32,
    pub bare_histograms: u32,
    pub states: u32,
}

/// Reads the configuration (see the module's documentation); refused with the reason.
pub fn parse(config: &[u8]) -> Result<Calls, String> {
    let text = std::str::from_utf8(config).map_err(|_| "filter \"floor\": the configuration is not UTF-8".to_string())?.trim();
    let mut calls = Calls::default();
    if text.is_empty() || text == "{}" {
        return Ok(calls);
    }
    let count = |name: &str, value: &str, max: u32| {
        value.parse::<u32>().ok().filter(|&n| n <= max).ok_or_else(|| format!("filter \"floor\": {name}={value}: a count from 0 to {max}"))
    };
    for item in text.split(',').map(str::trim) {
        match item.split_once('=') {
            None if item == "hold" => calls.hold = true,
            None if item == "chunks" => calls.chunks = true,
            Some(("histograms", n)) => calls.histograms = count("histograms", n, MAX_HISTOGRAMS)?,
            Some(("bare_histograms", n)) => calls.bare_histograms = count("bare_histograms", n, MAX_HISTOGRAMS)?,
            Some(("states", n)) => calls.states = count("states", n, STATE_KEYS.len() as u32)?,
            _ => return Err(format!("filter \"floor\": unknown call {item:?} (hold, chunks, histograms=N, bare_histograms=N, states=N)")),
        }
    }
    Ok(calls)
}

/// A floor filter's configuration.
pub struct FloorConfig {
    calls: Calls,
    histogram: HistogramId,
    bare_histogram: HistogramId,
}

/// Filter `floor` with `config` (see [`parse`]).
pub fn new_config(config: &[u8], context: &mut ConfigContext<'_>) -> Result<FloorConfig, String> {
    let calls = parse(config)?;
    let histogram = context.define_histogram("floor_values", &LABELS).map_err(|e| format!("defining histogram floor_values: {e}"))?;
    let bare_histogram = context.define_histogram("floor_bare_values", &[]).map_err(|e| format!("defining histogram floor_bare_values: {e}"))?;
    Ok(FloorConfig { calls, histogram, bare_histogram })
}

impl FilterConfig for FloorConfig {
    fn new_filter(&self) -> Box<dyn Filter> {
        Box::new(Floor { calls: self.calls, histogram: self.histogram, bare_histogram: self.bare_histogram, response_bytes: 0 })
    }
}

struct Floor {
    calls: Calls,
    histogram: HistogramId,
    bare_histogram: HistogramId,
    response_bytes: u64,
}

impl Filter for Floor {
    fn on_request_headers(&mut self, _envoy: &mut Envoy<'_>, end_of_stream: bool) -> HeadersStatus {
        if self.calls.hold && !end_of_stream {
            return HeadersStatus::StopIteration;
        }
        HeadersStatus::Continue
    }

    fn on_request_body(&mut self, envoy: &mut Envoy<'_>, end_of_stream: bool) -> BodyStatus {
        if !self.calls.hold {
            return BodyStatus::Continue;
        }
        if !end_of_stream {
            return BodyStatus::StopIterationAndBuffer;
        }
        // The whole body, read once, as the budget reads it.
        let _read: usize = envoy.body(BodyKind::BufferedRequest).chunks().iter().map(|c| c.len()).sum();
        BodyStatus::Continue
    }

    fn on_response_body(&mut self, envoy: &mut Envoy<'_>, _end_of_stream: bool) -> BodyStatus {
        if self.calls.chunks {
            self.response_bytes =
                self.response_bytes.saturating_add(envoy.body(BodyKind::ReceivedResponse).chunks().iter().map(|c| c.len() as u64).sum::<u64>());
        }
        BodyStatus::Continue
    }

    fn on_stream_complete(&mut self, envoy: &mut Envoy<'_>) {
        for key in STATE_KEYS.iter().take(self.calls.states as usize) {
            if !envoy.set_filter_state(key, b"{\"floor\":true}") {
                log(LogLevel::Warn, "sluice-native floor: could not set filter state");
            }
        }
        for n in 0..self.calls.histograms {
            if let Err(e) = envoy.record_histogram(self.histogram, &LABEL_VALUES, u64::from(n).saturating_add(self.response_bytes)) {
                log(LogLevel::Warn, &format!("sluice-native floor: histogram floor_values: {e}"));
            }
        }
        for n in 0..self.calls.bare_histograms {
            if let Err(e) = envoy.record_histogram(self.bare_histogram, &[], u64::from(n).saturating_add(self.response_bytes)) {
                log(LogLevel::Warn, &format!("sluice-native floor: histogram floor_bare_values: {e}"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_calls_are_read_and_anything_else_refused() {
        assert_eq!(parse(b""), Ok(Calls::default()));
        assert_eq!(parse(b" {} "), Ok(Calls::default()));
        assert_eq!(parse(b"hold, chunks,histograms=6,states=4"), Ok(Calls { hold: true, chunks: true, histograms: 6, bare_histograms: 0, states: 4 }));
        assert_eq!(parse(b"bare_histograms=6"), Ok(Calls { bare_histograms: 6, ..Calls::default() }));
        assert_eq!(parse(b"states=5"), Err("filter \"floor\": states=5: a count from 0 to 4".to_string()));
        assert_eq!(parse(b"histograms=x"), Err("filter \"floor\": histograms=x: a count from 0 to 64".to_string()));
        assert_eq!(parse(b"shadow"), Err("filter \"floor\": unknown call \"shadow\" (hold, chunks, histograms=N, bare_histograms=N, states=N)".to_string()));
    }
}
