//! The `sluice` filter: sluice's engine natively, the third host of the policies' core flows
//! (`sluice_core::flow`) beside `sluice.wasm` (`plugins/engine`) and the playground. It reads what
//! Envoy gives through the ABI, calls the flows and applies their effects; every rule is in core.
//!
//! Its configuration is `sluice.wasm`'s, parsed by the same code (`sluice_core::flow::sections`):
//! one section per policy, the same schema, the same refusals in the same words. Sections run in
//! pipeline order on the request, reversed on the response, as `plugins/engine/src/composite.rs`
//! runs them — in one hook call each, with the chunk read once for every section and, when there
//! are several, one shared response observer per stream (`sluice_core::observation`).
//!
//! Differences from the proxy-wasm host, each because of what the ABI is:
//! - state a worker's VM kept for itself (llm-metrics' bounded label sets) is one per process,
//!   behind a mutex, shared by every worker: one bound for the process instead of one per worker;
//! - filter state keys are written and read with the `wasm.` prefix Envoy's wasm filter gives them
//!   ([`view::STATE_PREFIX`]), so access-log formats and the other filters read the same keys;
//! - metrics are Envoy's labelled metrics, defined at configuration time ([`catalogue`]).
//!
//! Supported so far: `llm_metrics`. A configuration naming another section is refused, naming it.

pub mod catalogue;
pub mod view;

use std::sync::{Arc, Mutex, PoisonError};

use sluice_core::flow::metrics::{MetricsFlow, MetricsPolicy};
use sluice_core::flow::sections::{self, ConfigError, Policy};
use sluice_core::flow::{Dir, Effect, Effects, LogLevel as FlowLogLevel};
use sluice_core::metrics::Plugin;
use sluice_core::observation::{shared_slot, SharedSlot};

use crate::filter::{log, BodyKind, BodyStatus, ConfigContext, Envoy, Filter, FilterConfig, HeadersStatus, LogLevel};
use catalogue::{Catalogue, Sample};
use view::{now_ns, state_key, Chunk, NativeView};

/// The filter name this module runs the engine under (`DynamicModuleFilter.filter_name`).
pub const FILTER_NAME: &str = "sluice";

/// One configured section, shared by every stream of every worker.
enum SectionConfig {
    Metrics(Arc<Mutex<MetricsPolicy>>),
}

/// The validated configuration of one `sluice` filter.
pub struct EngineConfig {
    inner: Arc<Inner>,
}

struct Inner {
    /// In pipeline (request) order.
    sections: Vec<SectionConfig>,
    catalogue: Catalogue,
}

/// Parses `config` as `sluice.wasm` does and defines the configured policies' metrics; the reason,
/// worded as `sluice.wasm` logs it, when refused.
pub fn new_config(config: &[u8], context: &mut ConfigContext<'_>) -> Result<EngineConfig, String> {
    let policies = sections::parse_sections(config).map_err(|e| match e {
        // Worded by the policy itself, naming its section.
        ConfigError::Section { .. } => e.to_string(),
        _ => format!("sluice: configuration refused: {e}"),
    })?;
    let mut configured = Vec::with_capacity(policies.len());
    let mut plugins = Vec::with_capacity(policies.len());
    for policy in policies {
        match policy {
            Policy::LlmMetrics(p) => {
                log(LogLevel::Info, &format!("sluice llm-metrics: configured ({} price entries)", p.settings.prices.len()));
                configured.push(SectionConfig::Metrics(Arc::new(Mutex::new(*p))));
                plugins.push(Plugin::LlmMetrics);
            }
            Policy::LatencyGuard(_) | Policy::ModelRouter(_) | Policy::TenantBudget(_) => {
                let section = match policy {
                    Policy::LatencyGuard(_) => "latency_guard",
                    Policy::ModelRouter(_) => "model_router",
                    _ => "tenant_budget",
                };
                return Err(format!("sluice: configuration refused: section `{section}` is not supported by the native module yet (use sluice.wasm for it)"));
            }
        }
    }
    let catalogue = Catalogue::define(context, &plugins)?;
    Ok(EngineConfig { inner: Arc::new(Inner { sections: configured, catalogue }) })
}

impl FilterConfig for EngineConfig {
    fn new_filter(&self) -> Box<dyn Filter> {
        let sections = self
            .inner
            .sections
            .iter()
            .map(|section| match section {
                SectionConfig::Metrics(policy) => Section::Metrics { policy: Arc::clone(policy), flow: MetricsFlow::default() },
            })
            .collect::<Vec<_>>();
        // Several sections read the response through one observer, as one VM's sections do.
        let shared = (sections.len() > 1).then(shared_slot);
        Box::new(Stream { inner: Arc::clone(&self.inner), sections, shared, effects: Effects::default(), chunk: Chunk::default() })
    }
}

/// One section's stream.
enum Section {
    Metrics { policy: Arc<Mutex<MetricsPolicy>>, flow: MetricsFlow },
}

/// The engine's stream: the sections' flows and what one hook shares between them.
struct Stream {
    inner: Arc<Inner>,
    sections: Vec<Section>,
    shared: Option<SharedSlot>,
    /// Reused by every event, so the hot path allocates no effect list.
    effects: Effects,
    chunk: Chunk,
}

/// A policy's state, even if a panic elsewhere poisoned its lock (the state is a label bound and
/// counters: a half-made update is still a valid state).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A response event, for the sections in reverse order.
#[derive(Clone, Copy)]
enum ResponseEvent {
    Headers { end_of_stream: bool },
    Body { end_of_stream: bool },
    Trailers,
    Log,
}

impl Stream {
    /// Runs a request event through the sections in pipeline order.
    fn request_headers(&mut self, envoy: &mut Envoy<'_>) {
        let now = now_ns();
        self.chunk.forget();
        for i in 0..self.sections.len() {
            let Some(section) = self.sections.get_mut(i) else { continue };
            let mut view = NativeView { envoy, now, shared: self.shared.as_ref(), chunk: &mut self.chunk };
            match section {
                Section::Metrics { policy, flow } => flow.on_request_headers(&mut lock(policy), &mut view, now, &mut self.effects),
            }
            apply(envoy, &self.inner.catalogue, &mut self.effects, &mut self.chunk);
        }
    }

    fn request_body(&mut self, envoy: &mut Envoy<'_>, end_of_stream: bool) {
        self.chunk.forget();
        let now = now_ns();
        for i in 0..self.sections.len() {
            let size = envoy.body(BodyKind::ReceivedRequest).len();
            let Some(section) = self.sections.get_mut(i) else { continue };
            let mut view = NativeView { envoy, now, shared: self.shared.as_ref(), chunk: &mut self.chunk };
            match section {
                Section::Metrics { policy, flow } => {
                    if flow.is_measured() {
                        flow.on_request_body(&mut lock(policy), &mut view, size, end_of_stream, &mut self.effects);
                    }
                }
            }
            apply(envoy, &self.inner.catalogue, &mut self.effects, &mut self.chunk);
        }
    }

    fn response(&mut self, envoy: &mut Envoy<'_>, event: ResponseEvent) {
        self.chunk.forget();
        let now = now_ns();
        for i in (0..self.sections.len()).rev() {
            let size = match event {
                ResponseEvent::Body { .. } => envoy.body(BodyKind::ReceivedResponse).len(),
                _ => 0,
            };
            let Some(section) = self.sections.get_mut(i) else { continue };
            let mut view = NativeView { envoy, now, shared: self.shared.as_ref(), chunk: &mut self.chunk };
            let fx = &mut self.effects;
            match section {
                Section::Metrics { policy, flow } => {
                    if flow.is_measured() {
                        let policy = &mut lock(policy);
                        match event {
                            ResponseEvent::Headers { end_of_stream } => flow.on_response_headers(policy, &mut view, end_of_stream, fx),
                            ResponseEvent::Body { end_of_stream } => flow.on_response_body(policy, &mut view, size, end_of_stream, now, fx),
                            ResponseEvent::Trailers => flow.on_response_trailers(policy, &mut view, now, fx),
                            ResponseEvent::Log => flow.on_log(policy, &mut view, fx),
                        }
                    }
                }
            }
            apply(envoy, &self.inner.catalogue, &mut self.effects, &mut self.chunk);
        }
    }
}

impl Filter for Stream {
    fn on_request_headers(&mut self, envoy: &mut Envoy<'_>, _end_of_stream: bool) -> HeadersStatus {
        self.request_headers(envoy);
        HeadersStatus::Continue
    }

    fn on_request_body(&mut self, envoy: &mut Envoy<'_>, end_of_stream: bool) -> BodyStatus {
        self.request_body(envoy, end_of_stream);
        BodyStatus::Continue
    }

    fn on_response_headers(&mut self, envoy: &mut Envoy<'_>, end_of_stream: bool) -> HeadersStatus {
        self.response(envoy, ResponseEvent::Headers { end_of_stream });
        HeadersStatus::Continue
    }

    fn on_response_body(&mut self, envoy: &mut Envoy<'_>, end_of_stream: bool) -> BodyStatus {
        self.response(envoy, ResponseEvent::Body { end_of_stream });
        BodyStatus::Continue
    }

    fn on_response_trailers(&mut self, envoy: &mut Envoy<'_>) {
        self.response(envoy, ResponseEvent::Trailers);
    }

    fn on_stream_complete(&mut self, envoy: &mut Envoy<'_>) {
        self.response(envoy, ResponseEvent::Log);
    }
}

fn received(dir: Dir) -> BodyKind {
    match dir {
        Dir::Request => BodyKind::ReceivedRequest,
        Dir::Response => BodyKind::ReceivedResponse,
    }
}

/// Applies a flow's effects to the stream, in order, and empties the list.
fn apply(envoy: &mut Envoy<'_>, catalogue: &Catalogue, effects: &mut Effects, chunk: &mut Chunk) {
    for effect in effects.drain() {
        let failed = match effect {
            Effect::Count { name, delta } | Effect::GaugeAdd { name, delta } => catalogue.record(envoy, &name, Sample::Add(delta)).err(),
            Effect::GaugeSet { name, value } | Effect::Record { name, value } => catalogue.record(envoy, &name, Sample::Set(value)).err(),
            Effect::SetState { key, value } => (!envoy.set_filter_state(&state_key(&key), &value)).then(|| format!("writing filter state {key} failed")),
            Effect::SetHeader { dir, name, value } => {
                let mut headers = match dir {
                    Dir::Request => envoy.request_headers(),
                    Dir::Response => envoy.response_headers(),
                };
                let done = match value {
                    Some(value) => headers.set(&name, value.as_bytes()),
                    None => headers.remove(&name),
                };
                (!done).then(|| format!("setting header {name} failed"))
            }
            Effect::ReplaceBody { dir, bytes } => {
                chunk.forget();
                let kind = received(dir);
                (!(envoy.drain_body(kind, usize::MAX) && envoy.append_body(kind, &bytes))).then(|| "replacing a body chunk failed".to_string())
            }
            Effect::AppendBody { dir, bytes } => {
                chunk.forget();
                (!envoy.append_body(received(dir), &bytes)).then(|| "appending to a body chunk failed".to_string())
            }
            Effect::MarkReply(reply) => {
                let key = state_key(sluice_core::contract::GATEWAY_REPLY_PROPERTY);
                (!envoy.set_filter_state(&key, reply.encode().as_bytes())).then(|| "marking the gateway reply failed".to_string())
            }
            Effect::LocalReply { status, headers, body } => {
                let pairs: Vec<(&str, &[u8])> = headers.iter().map(|(k, v)| (k.as_str(), v.as_bytes())).collect();
                envoy.send_response(status, &pairs, &body, "sluice");
                None
            }
            Effect::Log { level, message } => {
                let level = match level {
                    FlowLogLevel::Debug => LogLevel::Debug,
                    FlowLogLevel::Info => LogLevel::Info,
                    FlowLogLevel::Warn => LogLevel::Warn,
                    FlowLogLevel::Error => LogLevel::Error,
                };
                log(level, &message);
                None
            }
            // Effects of sections this host does not run yet (latency-guard's hold and tick):
            // nothing asks for them while only llm-metrics is configured.
            Effect::WakeGuard | Effect::ResumeResponse | Effect::ResetStream | Effect::SetTickPeriod { .. } => None,
        };
        if let Some(problem) = failed {
            log(LogLevel::Warn, &format!("sluice: {problem}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_keys_are_the_wasm_filters() {
        assert_eq!(state_key("sluice_llm"), "wasm.sluice_llm");
    }

    #[test]
    fn time_moves_forward_from_the_wall_clock() {
        let a = now_ns();
        let b = now_ns();
        assert!(b >= a);
        // After 2020-01-01: the epoch, not the process start.
        assert!(a > 1_577_836_800_000_000_000);
    }
}
