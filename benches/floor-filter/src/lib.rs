//! The cheapest useful wasm filter: one response header per request. `benches/envoy_load.py` runs
//! it beside sluice so every figure sits next to what merely being a wasm filter costs (the VM
//! crossing per callback), not next to zero.
//!
//! Its plugin configuration may also ask for extra hostcalls of one kind per request
//! (`get_header=32`, `set_property=32`, …; see [`Kind`]): `benches/envoy_hostcalls.py` runs one
//! configuration per kind and divides the added CPU by the count, which gives what one hostcall of
//! each kind costs Envoy — the unit the plugins' own costs are made of. `tick=N` instead sets a
//! root tick every N ms that does nothing: what a timer costs an idle worker.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MapType, MetricType};
use std::rc::Rc;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// The hostcalls the bench can repeat, each made where a plugin makes it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// One request header by name (`get_header_map_value`), at the request headers.
    GetHeader,
    /// Every request header in one call (`get_header_map_pairs`), at the request headers.
    GetHeaders,
    /// `get_current_time_nanoseconds`, at the request headers.
    Now,
    /// A stream property (`request.path`), at the response headers.
    GetProperty,
    /// A filter-state write (`set_property`), at the response headers.
    SetProperty,
    /// A counter increment of one defined counter, at the response headers.
    Counter,
    /// A histogram sample of one defined histogram, at the response headers.
    Histogram,
    /// A shared-data read of one small key, at the response headers.
    SharedGet,
    /// A shared-data write of one small key (no CAS), at the response headers.
    SharedSet,
}

impl Kind {
    fn parse(name: &str) -> Option<Kind> {
        Some(match name {
            "get_header" => Kind::GetHeader,
            "get_headers" => Kind::GetHeaders,
            "now" => Kind::Now,
            "get_property" => Kind::GetProperty,
            "set_property" => Kind::SetProperty,
            "counter" => Kind::Counter,
            "histogram" => Kind::Histogram,
            "shared_get" => Kind::SharedGet,
            "shared_set" => Kind::SharedSet,
            _ => return None,
        })
    }

    fn at_request(self) -> bool {
        matches!(self, Kind::GetHeader | Kind::GetHeaders | Kind::Now)
    }
}

/// What each request does beyond the one header: `count` hostcalls of `kind`.
#[derive(Clone, Copy)]
struct Extra {
    kind: Kind,
    count: u32,
    counter: u32,
    histogram: u32,
}

#[derive(Default)]
struct Root {
    extra: Option<Rc<Extra>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let text = match hostcalls::get_buffer(proxy_wasm::types::BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(Some(bytes)) => String::from_utf8_lossy(&bytes).trim().to_string(),
            _ => String::new(),
        };
        if text.is_empty() {
            return true;
        }
        let Some((name, count)) = text.split_once('=') else {
            log::error!("floor: configuration is `kind=count`, got {text:?}");
            return false;
        };
        if name.trim() == "tick" {
            let Ok(period_ms) = count.trim().parse::<u64>() else {
                log::error!("floor: tick period in {text:?} is not a number of ms");
                return false;
            };
            return hostcalls::set_tick_period(std::time::Duration::from_millis(period_ms)).is_ok();
        }
        let (Some(kind), Ok(count)) = (Kind::parse(name.trim()), count.trim().parse::<u32>()) else {
            log::error!("floor: unknown kind or count in {text:?}");
            return false;
        };
        let (Ok(counter), Ok(histogram)) =
            (hostcalls::define_metric(MetricType::Counter, "floor.calls"), hostcalls::define_metric(MetricType::Histogram, "floor.sample"))
        else {
            return false;
        };
        // Shared data is read back from a key that exists, as a plugin's counters are.
        let _ = hostcalls::set_shared_data("floor/key", Some(b"12345"), None);
        self.extra = Some(Rc::new(Extra { kind, count, counter, histogram }));
        true
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Floor { extra: self.extra.clone() }))
    }
}

struct Floor {
    extra: Option<Rc<Extra>>,
}

impl Context for Floor {}

impl Floor {
    /// The results are ignored on purpose: the bench measures the calls, not what they return.
    fn repeat(&self, at_request: bool) {
        let Some(extra) = self.extra.as_deref() else { return };
        if extra.kind.at_request() != at_request {
            return;
        }
        for i in 0..extra.count {
            match extra.kind {
                Kind::GetHeader => drop(hostcalls::get_map_value(MapType::HttpRequestHeaders, ":path")),
                Kind::GetHeaders => drop(hostcalls::get_map(MapType::HttpRequestHeaders)),
                Kind::Now => drop(hostcalls::get_current_time()),
                Kind::GetProperty => drop(hostcalls::get_property(vec!["request", "path"])),
                Kind::SetProperty => drop(hostcalls::set_property(vec!["floor_state"], Some(if i % 2 == 0 { b"a" } else { b"b" }))),
                Kind::Counter => drop(hostcalls::increment_metric(extra.counter, 1)),
                Kind::Histogram => drop(hostcalls::record_metric(extra.histogram, u64::from(i))),
                Kind::SharedGet => drop(hostcalls::get_shared_data("floor/key")),
                Kind::SharedSet => drop(hostcalls::set_shared_data("floor/key", Some(b"12345"), None)),
            }
        }
    }
}

impl HttpContext for Floor {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        self.repeat(true);
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        self.repeat(false);
        // The hostcall's result is ignored on purpose: a bench filter has nothing to do on failure.
        let _ = hostcalls::add_map_value(MapType::HttpResponseHeaders, "x-floor", "1");
        Action::Continue
    }
}
