//! Metrics: counters, gauges and histograms the plugin defines by name. Defining a name twice
//! returns the same id. Histograms keep every recorded sample so tests can assert exact values.
//!
//! As in Envoy: a counter only grows (a negative increment is `BadArgument`, a record adds), a
//! gauge is set by record and moved by increment, a histogram only records.

use wasmtime::{Caller, Linker, Result};

use super::MODULE;
use crate::abi::{reply, HostcallResult, MetricType, Status};
use crate::guest;
use crate::state::HostState;

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Value {
    Counter(u64),
    Gauge(i64),
    Histogram(Vec<u64>),
}

#[derive(Clone, Debug)]
struct Metric {
    name: String,
    value: Value,
    /// A gauge whose name starts with the watched prefix: its changes are kept.
    watched: bool,
}

/// A watched gauge that took a new value ([`crate::PluginSpec::watch_gauges`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GaugeChange {
    /// Virtual time of the change, ns since the epoch.
    pub at_ns: u64,
    pub name: String,
    pub from: i64,
    pub to: i64,
}

/// Every metric of the VM; the id of a metric is its index plus one.
#[derive(Clone, Debug, Default)]
pub(crate) struct Metrics {
    metrics: Vec<Metric>,
    watch_prefix: Option<String>,
    /// Changes of watched gauges, in order: one per change of value, so as many as the plugin's
    /// state changes (a breaker's transitions), not as its traffic.
    changes: Vec<GaugeChange>,
}

impl Metrics {
    /// Keeps the changes of every gauge whose name starts with `prefix`.
    pub fn watch_gauges(&mut self, prefix: &str) {
        self.watch_prefix = Some(prefix.to_owned());
    }

    pub fn gauge_changes(&self) -> &[GaugeChange] {
        &self.changes
    }

    pub fn define(&mut self, kind: MetricType, name: &str) -> u32 {
        let existing = self.metrics.iter().position(|m| m.name == name && Self::kind_of(&m.value) == kind);
        let index = existing.unwrap_or_else(|| {
            let value = match kind {
                MetricType::Counter => Value::Counter(0),
                MetricType::Gauge => Value::Gauge(0),
                MetricType::Histogram => Value::Histogram(Vec::new()),
            };
            let watched = kind == MetricType::Gauge && self.watch_prefix.as_deref().is_some_and(|p| name.starts_with(p));
            self.metrics.push(Metric { name: name.to_owned(), value, watched });
            self.metrics.len() - 1
        });
        u32::try_from(index + 1).unwrap_or(u32::MAX)
    }

    fn kind_of(value: &Value) -> MetricType {
        match value {
            Value::Counter(_) => MetricType::Counter,
            Value::Gauge(_) => MetricType::Gauge,
            Value::Histogram(_) => MetricType::Histogram,
        }
    }

    fn get_mut(&mut self, id: u32) -> Result<&mut Value, Status> {
        let index = (id as usize).checked_sub(1).ok_or(Status::NotFound)?;
        self.metrics.get_mut(index).map(|m| &mut m.value).ok_or(Status::NotFound)
    }

    /// Applies `change` to metric `id`, keeping the gauge's change when it is watched.
    fn update(&mut self, id: u32, now_ns: u64, change: impl FnOnce(&mut Value) -> Result<(), Status>) -> Result<(), Status> {
        let index = (id as usize).checked_sub(1).ok_or(Status::NotFound)?;
        let metric = self.metrics.get_mut(index).ok_or(Status::NotFound)?;
        let before = match metric.value {
            Value::Gauge(v) if metric.watched => Some(v),
            _ => None,
        };
        change(&mut metric.value)?;
        if let (Some(from), Value::Gauge(to)) = (before, &metric.value) {
            if from != *to {
                self.changes.push(GaugeChange { at_ns: now_ns, name: metric.name.clone(), from, to: *to });
            }
        }
        Ok(())
    }

    pub fn increment(&mut self, id: u32, offset: i64, now_ns: u64) -> Result<(), Status> {
        self.update(id, now_ns, |value| Self::add(value, offset))
    }

    fn add(value: &mut Value, offset: i64) -> Result<(), Status> {
        match value {
            Value::Counter(v) => {
                let offset = u64::try_from(offset).map_err(|_| Status::BadArgument)?;
                *v = v.saturating_add(offset);
            }
            Value::Gauge(v) => *v = v.saturating_add(offset),
            Value::Histogram(_) => return Err(Status::BadArgument),
        }
        Ok(())
    }

    pub fn record(&mut self, id: u32, value: u64, now_ns: u64) -> Result<(), Status> {
        self.update(id, now_ns, |metric| {
            match metric {
                Value::Counter(v) => *v = v.saturating_add(value),
                Value::Gauge(v) => *v = value as i64,
                Value::Histogram(samples) => samples.push(value),
            }
            Ok(())
        })
    }

    pub fn read(&mut self, id: u32) -> Result<u64, Status> {
        match self.get_mut(id)? {
            Value::Counter(v) => Ok(*v),
            Value::Gauge(v) => Ok(*v as u64),
            Value::Histogram(_) => Err(Status::BadArgument),
        }
    }

    /// The metric called `name` of kind `kind`.
    pub fn find(&self, kind: MetricType, name: &str) -> Option<&Value> {
        self.metrics.iter().find(|m| m.name == name && Self::kind_of(&m.value) == kind).map(|m| &m.value)
    }

    /// Every defined name, in definition order.
    pub fn names(&self) -> Vec<String> {
        self.metrics.iter().map(|m| m.name.clone()).collect()
    }
}

pub(super) fn add_to_linker(linker: &mut Linker<HostState>) -> Result<()> {
    linker.func_wrap(MODULE, "proxy_define_metric", proxy_define_metric)?;
    linker.func_wrap(MODULE, "proxy_increment_metric", proxy_increment_metric)?;
    linker.func_wrap(MODULE, "proxy_record_metric", proxy_record_metric)?;
    linker.func_wrap(MODULE, "proxy_get_metric", proxy_get_metric)?;
    Ok(())
}

fn proxy_define_metric(mut caller: Caller<'_, HostState>, kind: u32, name_ptr: u32, name_len: u32, id_out: u32) -> HostcallResult {
    let Some(kind) = MetricType::from_code(kind) else {
        return reply(Status::BadArgument);
    };
    let (guest, state) = guest::view(&mut caller);
    let name = guest.str(name_ptr, name_len)?;
    let id = state.metrics.define(kind, &name);
    guest::write_u32(&mut caller, id_out, id)?;
    reply(Status::Ok)
}

fn proxy_increment_metric(mut caller: Caller<'_, HostState>, id: u32, offset: i64) -> HostcallResult {
    let state = caller.data_mut();
    let now_ns = state.clock.now_ns();
    match state.metrics.increment(id, offset, now_ns) {
        Ok(()) => reply(Status::Ok),
        Err(status) => reply(status),
    }
}

fn proxy_record_metric(mut caller: Caller<'_, HostState>, id: u32, value: u64) -> HostcallResult {
    let state = caller.data_mut();
    let now_ns = state.clock.now_ns();
    match state.metrics.record(id, value, now_ns) {
        Ok(()) => reply(Status::Ok),
        Err(status) => reply(status),
    }
}

fn proxy_get_metric(mut caller: Caller<'_, HostState>, id: u32, value_out: u32) -> HostcallResult {
    match caller.data_mut().metrics.read(id) {
        Ok(value) => {
            guest::write_u64(&mut caller, value_out, value)?;
            reply(Status::Ok)
        }
        Err(status) => reply(status),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_follow_envoy_rules() {
        let mut m = Metrics::default();
        let c = m.define(MetricType::Counter, "c");
        assert_eq!(m.define(MetricType::Counter, "c"), c);
        let g = m.define(MetricType::Gauge, "g");
        let h = m.define(MetricType::Histogram, "h");
        m.increment(c, 2, 0).unwrap();
        m.record(c, 3, 0).unwrap();
        assert_eq!(m.increment(c, -1, 0), Err(Status::BadArgument));
        m.increment(g, -5, 0).unwrap();
        assert_eq!(m.find(MetricType::Gauge, "g"), Some(&Value::Gauge(-5)));
        m.record(h, 7, 0).unwrap();
        m.record(h, 7, 0).unwrap();
        assert_eq!(m.find(MetricType::Histogram, "h"), Some(&Value::Histogram(vec![7, 7])));
        assert_eq!(m.read(c), Ok(5));
        assert_eq!(m.read(h), Err(Status::BadArgument));
        assert_eq!(m.increment(99, 1, 0), Err(Status::NotFound));
    }

    #[test]
    fn a_watched_gauge_keeps_each_change_of_value_with_its_time() {
        let mut m = Metrics::default();
        m.watch_gauges("breaker.");
        let b = m.define(MetricType::Gauge, "breaker.v1");
        let other = m.define(MetricType::Gauge, "in_flight.v1");
        let c = m.define(MetricType::Counter, "breaker.transitions");
        m.record(b, 0, 10).unwrap(); // no change
        m.record(b, 1, 20).unwrap();
        m.record(b, 1, 30).unwrap(); // the same value again
        m.increment(b, 1, 40).unwrap();
        m.record(b, 0, 50).unwrap();
        m.record(other, 3, 60).unwrap();
        m.increment(c, 1, 70).unwrap();
        let seen: Vec<(u64, i64, i64)> = m.gauge_changes().iter().map(|c| (c.at_ns, c.from, c.to)).collect();
        assert_eq!(seen, [(20, 0, 1), (40, 1, 2), (50, 2, 0)]);
        assert!(m.gauge_changes().iter().all(|c| c.name == "breaker.v1"));
    }
}
