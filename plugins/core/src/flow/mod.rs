//! Flows: each policy's request life as a state machine in core.
//!
//! A flow has a phase enum (no flags) and one method per event the host delivers — request
//! headers, a request body chunk, response headers, a response body chunk, trailers, a tick, a
//! callout's answer, the end. Each method takes the host time, reads what it needs through a
//! [`View`] (headers, the current body chunk, properties — lazily, so a host pays only for what
//! is read), and pushes [`Effect`]s for the host to apply in order. Nothing here calls a host.
//!
//! Hosts only read, call and apply: the proxy-wasm adapters, the harness, the simulator and the
//! playground drive the same flows, so a rule lives in exactly one place and is tested natively
//! (each flow's tests assert exact effect lists).

pub mod budget;
pub mod guard;
pub mod metrics;
pub mod router;
pub mod sections;

use crate::api::ApiKind;
use crate::contract::GatewayReply;
use crate::observation::Observer;
use crate::report::Outcome;

/// Which side of the exchange a header map or body belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    Request,
    Response,
}

/// [`View::property`] at a configured path (the policies keep their paths as owned segments): the
/// segments borrowed in place, no vector a read.
pub fn property_at(view: &mut dyn View, path: &[String]) -> Option<String> {
    let mut segments = [""; 8];
    if path.len() > segments.len() {
        return view.property(&path.iter().map(String::as_str).collect::<Vec<_>>());
    }
    for (slot, segment) in segments.iter_mut().zip(path) {
        *slot = segment;
    }
    view.property(segments.get(..path.len()).unwrap_or_default())
}

/// What a flow may read from the host. A proxy-wasm host answers with a hostcall per read (or
/// from a snapshot it already took); tests answer from maps ([`FixedView`]).
pub trait View {
    /// Host time, ns. Events that always need it take it as an argument; this is for the ones
    /// that need it only sometimes (a response ending with its headers, a teardown), so a host
    /// pays the read only then.
    fn now(&mut self) -> u64;
    fn request_header(&mut self, name: &str) -> Option<String>;
    /// A request header's value as the bytes the client sent (a sticky key hashes them; text
    /// would replace bytes that are not UTF-8).
    fn request_header_bytes(&mut self, name: &str) -> Option<Vec<u8>> {
        self.request_header(name).map(String::into_bytes)
    }
    fn response_header(&mut self, name: &str) -> Option<String>;
    /// The first `size` bytes of the current body chunk of `dir` (the host announced the size):
    /// borrowed where the host holds them (the memory host, the native module's chunk read once),
    /// a copy where it must fetch them (a proxy-wasm hostcall).
    fn body(&mut self, dir: Dir, size: usize) -> std::borrow::Cow<'_, [u8]>;
    /// A host property (filter state, request attributes), as text.
    fn property(&mut self, path: &[&str]) -> Option<String>;
    /// The reply the gateway itself gave this request, if a sluice policy recorded one.
    fn gateway_reply(&mut self) -> Option<GatewayReply>;
    /// How a request that never saw its last response chunk ended (Envoy's response code details
    /// and flags, [`Outcome::of_unended`]).
    fn unended_outcome(&mut self) -> Outcome;
    /// The observer a policy reads this stream's response with. A host running several policies on
    /// one stream hands each a reader of one shared observer ([`crate::observation`]), so the
    /// stream is framed and scanned once; alone, a policy observes it itself.
    fn response_observer(&mut self, kind: ApiKind) -> Observer {
        Observer::own(kind)
    }
}

/// Log levels of [`Effect::Log`] (core has no logger).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    Debug,
    Info,
    Warn,
    Error,
}

/// What a host does on a flow's behalf, in the order pushed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Add `delta` to a counter (a zero only defines it, so the series exists from the start).
    Count { name: String, delta: i64 },
    /// Add `delta` to a gauge.
    GaugeAdd { name: String, delta: i64 },
    /// Set a gauge.
    GaugeSet { name: String, value: u64 },
    /// Record a histogram sample.
    Record { name: String, value: u64 },
    /// Write filter state `key` (stamps for the access log, hand-offs between filters).
    SetState { key: String, value: Vec<u8> },
    /// Set (`Some`) or remove (`None`) a header of `dir`.
    SetHeader { dir: Dir, name: String, value: Option<String> },
    /// Replace the current body chunk of `dir`.
    ReplaceBody { dir: Dir, bytes: Vec<u8> },
    /// Append to the current body chunk of `dir`.
    AppendBody { dir: Dir, bytes: Vec<u8> },
    /// Record the reply the gateway gives or the end it imposes, for every policy's report.
    MarkReply(GatewayReply),
    /// Answer the client from the gateway; the request goes no further upstream.
    LocalReply { status: u32, headers: Vec<(String, String)>, body: Vec<u8> },
    /// The first content token was marked: wake the latency guard holding this stream's response.
    WakeGuard,
    /// Log a line.
    Log { level: LogLevel, message: String },
    /// Let the response this stream paused (latency-guard's held headers) continue to the client,
    /// with what the proxy buffered behind it.
    ResumeResponse,
    /// Reset the stream (both directions): the only way to end a response whose headers already
    /// reached the client.
    ResetStream,
    /// Set the VM's tick period, ms (latency-guard's tick follows what is due next).
    SetTickPeriod { ms: u64 },
}

/// What the host returns to the proxy for a header or body event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Verdict {
    #[default]
    Continue,
    Pause,
}

/// The effects of one event, in order. A host keeps one and clears it after applying, so the hot
/// path allocates no list per event. The second field is set by [`Effects::without_counters`].
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Effects(pub Vec<Effect>, bool);

impl Effects {
    /// Effects for a host that keeps no counter and no histogram (the memory host: the simulator
    /// and the playground read stamps, gauges and logs): [`Effect::Count`] and [`Effect::Record`]
    /// are dropped as they are pushed, and the flows skip building the samples only they carry
    /// (llm-metrics' per-request series, ≈ 6,000 instructions a request). Gauges stay: breaker
    /// states and budgets remaining are read from them.
    pub fn without_counters() -> Effects {
        Effects(Vec::new(), true)
    }

    /// Whether [`Effect::Count`] and [`Effect::Record`] reach the host (see [`Self::without_counters`]).
    pub fn keeps_counters(&self) -> bool {
        !self.1
    }

    pub fn push(&mut self, effect: Effect) {
        if self.1 && matches!(effect, Effect::Count { .. } | Effect::Record { .. }) {
            return;
        }
        self.0.push(effect);
    }

    pub fn count(&mut self, name: impl Into<String>, delta: i64) {
        if self.1 {
            return;
        }
        self.0.push(Effect::Count { name: name.into(), delta });
    }

    pub fn log(&mut self, level: LogLevel, message: impl Into<String>) {
        self.0.push(Effect::Log { level, message: message.into() });
    }

    pub fn set_state(&mut self, key: &str, value: impl Into<Vec<u8>>) {
        self.0.push(Effect::SetState { key: key.to_string(), value: value.into() });
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }

    /// Takes the effects out, leaving the list empty (its capacity stays with the caller's copy).
    pub fn drain(&mut self) -> std::vec::Drain<'_, Effect> {
        self.0.drain(..)
    }
}

/// A [`View`] over fixed values, for native tests and the hosts that hold a request in memory.
#[derive(Debug, Default, Clone)]
pub struct FixedView {
    pub request_headers: Vec<(String, String)>,
    pub response_headers: Vec<(String, String)>,
    pub request_body: Vec<u8>,
    pub response_body: Vec<u8>,
    pub properties: Vec<(Vec<String>, String)>,
    pub gateway_reply: Option<GatewayReply>,
    pub unended: Outcome,
    /// What [`View::now`] answers.
    pub now_ns: u64,
}

impl FixedView {
    fn find(pairs: &[(String, String)], name: &str) -> Option<String> {
        pairs.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.clone())
    }
}

impl View for FixedView {
    fn now(&mut self) -> u64 {
        self.now_ns
    }
    fn request_header(&mut self, name: &str) -> Option<String> {
        Self::find(&self.request_headers, name)
    }
    fn response_header(&mut self, name: &str) -> Option<String> {
        Self::find(&self.response_headers, name)
    }
    fn body(&mut self, dir: Dir, size: usize) -> std::borrow::Cow<'_, [u8]> {
        let body = match dir {
            Dir::Request => &self.request_body,
            Dir::Response => &self.response_body,
        };
        std::borrow::Cow::Borrowed(body.get(..size.min(body.len())).unwrap_or_default())
    }
    fn property(&mut self, path: &[&str]) -> Option<String> {
        self.properties.iter().find(|(p, _)| p.iter().map(String::as_str).eq(path.iter().copied())).map(|(_, v)| v.clone())
    }
    fn gateway_reply(&mut self) -> Option<GatewayReply> {
        self.gateway_reply
    }
    fn unended_outcome(&mut self) -> Outcome {
        self.unended
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A configured path reads the property at exactly those segments, at any length (past the
    /// eight borrowed in place too), and no other.
    #[test]
    fn a_configured_path_reads_its_property() {
        let long: Vec<String> = (0..11).map(|i| format!("s{i}")).collect();
        let mut view = FixedView {
            properties: vec![
                (vec!["metadata".into(), "filter_metadata".into(), "sluice".into(), "tenant".into()], "acme".into()),
                (long.clone(), "deep".into()),
                (long[..8].to_vec(), "eight".into()),
            ],
            ..FixedView::default()
        };
        let path = |segments: &[&str]| segments.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(property_at(&mut view, &path(&["metadata", "filter_metadata", "sluice", "tenant"])).as_deref(), Some("acme"));
        assert_eq!(property_at(&mut view, &long).as_deref(), Some("deep"));
        assert_eq!(property_at(&mut view, &long[..8]).as_deref(), Some("eight"));
        assert_eq!(property_at(&mut view, &long[..9]), None);
        assert_eq!(property_at(&mut view, &path(&["metadata", "filter_metadata", "sluice"])), None);
        assert_eq!(property_at(&mut view, &[]), None);
    }
}
