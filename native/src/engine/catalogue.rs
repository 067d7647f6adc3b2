//! sluice's metric families as Envoy's labelled metrics.
//!
//! The flows name a sample the way proxy-wasm needs it, flat: `sluice.ttft_ms.model_version.v2.
//! tenant.acme…` (`sluice_core::metrics`), and `sluice.wasm`'s gateways turn the `.<key>.<value>`
//! pairs into labels with `stats_tags` regexes. The dynamic-module ABI has labelled metrics
//! instead, defined when the filter configuration is made (names and label *names*), recorded with
//! label *values*. So this module defines every family of the configured policies once per
//! configuration, from core's catalogue ([`FAMILIES`]), and maps each flat sample back to its
//! family and label values. Envoy stores them under the dynamic modules' custom stat namespace
//! (`dynamicmodulescustom.sluice.ttft_ms` with tags), which `/stats/prometheus` prints without
//! the namespace and without `envoy_`, as it prints `wasmcustom.`: `sluice_ttft_ms_bucket{
//! model_version="v2",tenant="acme",…}` — the series `sluice.wasm` gives, so dashboards and alerts
//! read both hosts alike (tests/envoy.rs compares the two on the same requests).
//!
//! Mapping a flat name back is a hash lookup per dot of the name and a split: some 2,700
//! instructions for a per-request name, about thirty of which a request records. So each thread
//! keeps what the names it has seen resolved to ([`record`](Catalogue::record)): a name seen before
//! costs one hash of it and one comparison.
//!
//! Envoy 1.40's ABI has no handle for one series: every labelled call resolves the label values to
//! a tagged stat name again (≈ 4,400 instructions inside Envoy, most of a request's metric cost).
//! So a batched catalogue ([`Catalogue::define`] with `batched`) holds every counter and gauge
//! change in the recording thread's shard, summed per series, until the configuration's next
//! [`flush`](Catalogue::flush) on Envoy's main thread: one call per series and thread per flush
//! instead of one per sample (a counter's zero, which only makes its series appear, is held once
//! per thread too). Histograms are not held (the ABI records one value per call). Gauge sets are
//! numbered across threads and flushed in that order, so the last set wins as if each had been
//! sent at once.

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use sluice_core::metrics::{Family, MetricKind, Plugin, FAMILIES};

use crate::filter::{ConfigContext, CounterId, GaugeId, HistogramId, Metrics, MetricsError};

/// The most labels a family has (`sluice.requests_total`: nine).
const MAX_LABELS: usize = 12;

/// tenant-budget's Redis-ledger families, defined only when a budget has a Redis ledger: a family
/// without labels exists from its definition on — `ledger_up` would read 0 (down) on a gateway that
/// has no ledger.
const LEDGER_FAMILIES: &str = "sluice.budget.ledger_";

/// The most names a thread caches for one catalogue. The flows bound every label value before it
/// reaches a name (`LabelBound`, sanitized policy names), so a configuration has a bounded set of
/// series and this is only a safety net: past it, names are resolved on every record, uncached.
const CACHE_BOUND: usize = 4096;

/// The number of the next catalogue made: a thread's cache is per catalogue number, so one
/// configuration never gets another's ids (a reload defines the same names again, with new ids).
static NEXT_NUMBER: AtomicU64 = AtomicU64::new(1);

/// One defined metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricId {
    Counter(CounterId),
    Gauge(GaugeId),
    Histogram(HistogramId),
}

/// One label-name list of a family, as defined in Envoy.
#[derive(Debug)]
struct Variant {
    keys: Vec<&'static str>,
    id: MetricId,
}

/// The families of one filter configuration, by flat base name (`sluice.ttft_ms`).
#[derive(Debug)]
pub struct Catalogue {
    families: HashMap<&'static str, Vec<Variant>>,
    /// Unique in the process: the key of this catalogue's cache in each thread.
    number: u64,
    /// Held only by the catalogue: a thread's cache of a catalogue that is gone (its `Weak` dead)
    /// is dropped when the thread next meets a new catalogue.
    alive: Arc<()>,
    /// Counter and gauge changes held until the next flush; `None`: every sample is sent at once.
    batch: Option<Batch>,
}

/// The changes a batched catalogue holds, one shard per thread that records.
#[derive(Debug, Default)]
struct Batch {
    /// Every thread's shard, registered by the thread's first record.
    shards: Mutex<Vec<Arc<Shard>>>,
    /// Set by a record that left a change to send; cleared by the flush that takes them.
    unsent: AtomicBool,
    /// The number of the next gauge set, across threads.
    sets: AtomicU64,
}

/// One thread's held changes, one entry per series it has held a change for ([`Resolved::slot`]).
/// Locked by its thread for each held change and by the flush: uncontended but for the flush.
#[derive(Debug, Default)]
struct Shard(Mutex<Vec<Unsent>>);

#[derive(Debug)]
struct Unsent {
    id: MetricId,
    values: Arc<[Box<str>]>,
    change: Change,
    /// A flush has sent this series: it exists in Envoy, so additions that cancel out can stay.
    made: bool,
}

/// A series' change since the last flush.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    None,
    /// A counter's increments, summed.
    Count(u64),
    /// A gauge's additions, summed.
    Delta(i64),
    /// A gauge's last set (and what was added after it), numbered in [`Batch::sets`]' order.
    Set {
        order: u64,
        value: u64,
    },
}

impl Change {
    /// This change followed by `sample` (on a counter if `counter`), `order` the number a set
    /// takes; `None` for a sample no change holds (a histogram's value, a counter going down).
    fn then(self, counter: bool, sample: Sample, order: impl FnOnce() -> u64) -> Option<Change> {
        Some(match (counter, self, sample) {
            (true, Change::Count(sum), Sample::Add(delta)) => Change::Count(sum.saturating_add(u64::try_from(delta).ok()?)),
            (true, Change::None, Sample::Add(delta)) => Change::Count(u64::try_from(delta).ok()?),
            (true, _, _) => return None,
            (false, Change::Delta(sum), Sample::Add(delta)) => Change::Delta(sum.saturating_add(delta)),
            (false, Change::None | Change::Count(_), Sample::Add(delta)) => Change::Delta(delta),
            (false, Change::Set { order, value }, Sample::Add(delta)) => Change::Set { order, value: value.saturating_add_signed(delta) },
            // A set replaces whatever this thread held before it.
            (false, _, Sample::Set(value)) => Change::Set { order: order(), value },
        })
    }
}

/// What a flat name resolved to, as a thread caches it.
#[derive(Debug)]
struct Resolved {
    id: MetricId,
    /// The label values, one per key of the variant.
    values: Arc<[Box<str>]>,
    /// A call for this series succeeded on this thread, so the series exists in Envoy's store
    /// (shared by all threads) and adding zero to it would change nothing.
    created: bool,
    /// Where this thread's [`Shard`] holds the series' changes, once it has held one.
    slot: Option<usize>,
}

/// One thread's resolutions for one catalogue.
struct ThreadCache {
    number: u64,
    alive: Weak<()>,
    names: HashMap<Box<str>, Resolved, BuildHasherDefault<NameHasher>>,
    /// This thread's shard of the catalogue's [`Batch`], registered there.
    shard: Option<Arc<Shard>>,
}

thread_local! {
    /// Per thread, so the workers' hot path takes no lock; a few entries (one per live
    /// configuration this thread records for), searched in order.
    static CACHES: RefCell<Vec<ThreadCache>> = const { RefCell::new(Vec::new()) };
}

/// The cache's hasher: multiply-and-fold over eight-byte words. SipHash's resistance to chosen keys
/// is not needed (a name's label values are bounded by the flows, not chosen freely by clients)
/// and costs several times as much on a ~100-byte name.
#[derive(Clone, Copy)]
struct NameHasher(u64);

impl Default for NameHasher {
    fn default() -> Self {
        // Digits of pi: any odd non-zero start.
        NameHasher(0x243f_6a88_85a3_08d3)
    }
}

impl NameHasher {
    /// One word into the state: the 128-bit product's halves xored carry every input bit into
    /// every output bit (hashbrown takes the bucket from the low bits, the tag from the high).
    fn mix(&mut self, word: u64) {
        let product = u128::from(self.0 ^ word) * 0x9e37_79b9_7f4a_7c15;
        self.0 = (product as u64) ^ ((product >> 64) as u64);
    }
}

impl Hasher for NameHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for word in &mut words {
            self.mix(u64::from_le_bytes(word.try_into().unwrap_or_default()));
        }
        let tail = words.remainder();
        if !tail.is_empty() {
            // At most seven bytes: the last byte holds their count, so `ab` and `ab\0` differ.
            let mut word = [0u8; 8];
            word.iter_mut().zip(tail).for_each(|(w, b)| *w = *b);
            word[7] = tail.len() as u8;
            self.mix(u64::from_le_bytes(word));
        }
    }

    fn write_u8(&mut self, byte: u8) {
        // `str`'s `Hash` ends with one: skip `write`'s tail handling.
        self.mix(u64::from(byte));
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// The label-name lists a family's series carry: `a|b|c` is one label whose key is one of them (a
/// budget's level), `k?` a label only some series have.
fn variants(family: &Family) -> Vec<Vec<&'static str>> {
    let mut lists: Vec<Vec<&'static str>> = vec![Vec::new()];
    for label in family.labels {
        if let Some(optional) = label.strip_suffix('?') {
            let with: Vec<Vec<&'static str>> = lists
                .iter()
                .map(|l| {
                    let mut l = l.clone();
                    l.push(optional);
                    l
                })
                .collect();
            lists.extend(with);
        } else {
            let choices: Vec<&'static str> = label.split('|').collect();
            lists = lists
                .iter()
                .flat_map(|l| {
                    choices.iter().map(move |choice| {
                        let mut l = l.clone();
                        l.push(choice);
                        l
                    })
                })
                .collect();
        }
    }
    lists
}

impl Catalogue {
    /// Defines every family of `plugins` in the configuration being made (the Redis ledger's with
    /// `ledger`); `batched`: counter and gauge changes wait for [`flush`](Catalogue::flush), which
    /// the configuration then calls on the main thread whenever [`has_unsent`](Catalogue::has_unsent).
    pub fn define(context: &mut ConfigContext<'_>, plugins: &[Plugin], ledger: bool, batched: bool) -> Result<Catalogue, String> {
        let mut families: HashMap<&'static str, Vec<Variant>> = HashMap::new();
        for family in FAMILIES.iter().filter(|f| plugins.contains(&f.plugin) && (ledger || !f.name.starts_with(LEDGER_FAMILIES))) {
            for keys in variants(family) {
                let defined: Result<MetricId, MetricsError> = match family.kind {
                    MetricKind::Counter => context.define_counter(family.name, &keys).map(MetricId::Counter),
                    MetricKind::Gauge => context.define_gauge(family.name, &keys).map(MetricId::Gauge),
                    MetricKind::Histogram => context.define_histogram(family.name, &keys).map(MetricId::Histogram),
                };
                let id = defined.map_err(|e| format!("defining metric {} {{{}}}: {e}", family.name, keys.join(",")))?;
                families.entry(family.name).or_default().push(Variant { keys, id });
            }
        }
        Ok(Catalogue::of(families, batched))
    }

    fn of(families: HashMap<&'static str, Vec<Variant>>, batched: bool) -> Catalogue {
        Catalogue { families, number: NEXT_NUMBER.fetch_add(1, Ordering::Relaxed), alive: Arc::new(()), batch: batched.then(Batch::default) }
    }

    /// Whether a change waits for [`flush`](Catalogue::flush).
    pub fn has_unsent(&self) -> bool {
        self.batch.as_ref().is_some_and(|b| b.unsent.load(Ordering::Acquire))
    }

    /// Sends every held change through `envoy` (the configuration, on Envoy's main thread): each
    /// series' summed counts and gauge additions, then the gauge sets in the order they were made.
    /// What Envoy refused, worded for a log line.
    pub fn flush(&self, envoy: &mut dyn Metrics) -> Vec<String> {
        let Some(batch) = &self.batch else { return Vec::new() };
        // Cleared first: a change held while this runs sets it again for the next flush.
        batch.unsent.store(false, Ordering::Release);
        let shards: Vec<Arc<Shard>> = batch.shards.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let mut taken: Vec<Unsent> = Vec::new();
        for shard in shards {
            // Taken out under the lock, sent without it: the thread's records never wait on Envoy.
            let mut unsent = shard.0.lock().unwrap_or_else(PoisonError::into_inner);
            // Additions that cancel out change nothing, once the series exists (a gauge that went
            // up and down again before its first flush still shows, at zero, as with wasm).
            for series in unsent.iter_mut().filter(|u| !(u.change == Change::None || u.made && u.change == Change::Delta(0))) {
                series.made = true;
                taken.push(Unsent {
                    id: series.id,
                    values: Arc::clone(&series.values),
                    change: std::mem::replace(&mut series.change, Change::None),
                    made: true,
                });
            }
        }
        // Counts and additions commute; sets go last, in their order, so the last one wins.
        taken.sort_by_key(|series| match series.change {
            Change::Set { order, .. } => (1, order),
            _ => (0, 0),
        });
        let mut refused = Vec::new();
        for Unsent { id, values, change, .. } in taken {
            let mut labels = [""; MAX_LABELS];
            let labels = label_values(&values, &mut labels);
            let result = match (id, change) {
                (MetricId::Counter(id), Change::Count(by)) => envoy.increment_counter(id, labels, by),
                (MetricId::Gauge(id), Change::Delta(delta)) => envoy.add_gauge(id, labels, delta),
                (MetricId::Gauge(id), Change::Set { value, .. }) => envoy.set_gauge(id, labels, value),
                _ => continue,
            };
            if let Err(e) = result {
                refused.push(format!("metric {id:?} {{{}}}: {e}", labels.join(",")));
            }
        }
        refused
    }

    /// The metric and label values of flat sample name `name`; `None` for a name of no defined
    /// family (a family of a policy not configured, or a name core's catalogue does not list).
    pub fn resolve<'n>(&self, name: &'n str, values: &mut [&'n str; MAX_LABELS]) -> Option<(MetricId, usize)> {
        // The base name ends at one of the dots (or the end); the rest is `.key.value` pairs.
        let ends = name.match_indices('.').map(|(i, _)| i).chain(std::iter::once(name.len()));
        for end in ends {
            let Some(variants) = name.get(..end).and_then(|base| self.families.get(base)) else { continue };
            let rest = name.get(end..).unwrap_or_default();
            let mut keys: [&str; MAX_LABELS] = [""; MAX_LABELS];
            let mut count = 0;
            let mut parts = rest.split('.').skip(1);
            let mut well_formed = true;
            while let Some(key) = parts.next() {
                let (Some(value), Some(key_slot), Some(value_slot)) = (parts.next(), keys.get_mut(count), values.get_mut(count)) else {
                    well_formed = false;
                    break;
                };
                *key_slot = key;
                *value_slot = value;
                count += 1;
            }
            if !well_formed {
                continue;
            }
            let keys = keys.get(..count).unwrap_or_default();
            if let Some(variant) = variants.iter().find(|v| v.keys.as_slice() == keys) {
                return Some((variant.id, count));
            }
        }
        None
    }

    /// Records one flow sample: `delta` for a counter or gauge, `value` for a histogram.
    ///
    /// Through this thread's cache; uncached when the cache is full, or not there (the thread is
    /// tearing its thread-locals down, or this is a record inside a record: neither happens in
    /// Envoy, and neither may panic).
    pub fn record(&self, envoy: &mut dyn Metrics, name: &str, sample: Sample) -> Result<(), String> {
        let cached = CACHES.try_with(|caches| caches.try_borrow_mut().ok().and_then(|mut caches| self.record_cached(&mut caches, envoy, name, sample)));
        match cached.ok().flatten() {
            Some(result) => result,
            None => self.record_uncached(envoy, name, sample),
        }
    }

    /// [`record`](Catalogue::record) through `caches` (this thread's); `None` if the name is not
    /// cached and the cache is full.
    fn record_cached(&self, caches: &mut Vec<ThreadCache>, envoy: &mut dyn Metrics, name: &str, sample: Sample) -> Option<Result<(), String>> {
        let at = match caches.iter().position(|c| c.number == self.number) {
            Some(at) => at,
            None => {
                // A catalogue this thread has not recorded for: a new configuration, maybe
                // replacing one whose cache can go.
                caches.retain(|c| c.alive.strong_count() > 0);
                let shard = self.batch.as_ref().map(|batch| {
                    let shard = Arc::new(Shard::default());
                    batch.shards.lock().unwrap_or_else(PoisonError::into_inner).push(Arc::clone(&shard));
                    shard
                });
                caches.push(ThreadCache { number: self.number, alive: Arc::downgrade(&self.alive), names: HashMap::default(), shard });
                caches.len() - 1
            }
        };
        let cache = caches.get_mut(at)?;
        let held = self.batch.as_ref().zip(cache.shard.as_deref());
        if let Some(resolved) = cache.names.get_mut(name) {
            return Some(send_cached(envoy, name, resolved, sample, held));
        }
        if cache.names.len() >= CACHE_BOUND {
            return None;
        }
        let mut values = [""; MAX_LABELS];
        // A name of no family is not cached: it fails each time, as uncached.
        let Some((id, count)) = self.resolve(name, &mut values) else {
            return Some(Err(unknown(name)));
        };
        let values = values.iter().take(count).map(|v| Box::<str>::from(*v)).collect();
        let resolved = cache.names.entry(Box::from(name)).or_insert(Resolved { id, values, created: false, slot: None });
        Some(send_cached(envoy, name, resolved, sample, held))
    }

    fn record_uncached(&self, envoy: &mut dyn Metrics, name: &str, sample: Sample) -> Result<(), String> {
        let mut values = [""; MAX_LABELS];
        let Some((id, count)) = self.resolve(name, &mut values) else {
            return Err(unknown(name));
        };
        send(envoy, name, id, values.get(..count).unwrap_or_default(), sample)
    }
}

fn unknown(name: &str) -> String {
    format!("metric {name} is not one of the configured families")
}

/// Sends `sample` of a cached series, unless it is a counter's zero for a series this thread has
/// already created: the zero is there only to create the series (so it shows from the first
/// request); skipping it later never changes a value. With `held` (a batched catalogue and this
/// thread's shard), a counter's or gauge's change is held for the next flush instead; the rest
/// reaches Envoy now (a histogram counts each record).
fn send_cached(envoy: &mut dyn Metrics, name: &str, resolved: &mut Resolved, sample: Sample, held: Option<(&Batch, &Shard)>) -> Result<(), String> {
    if resolved.created && matches!((resolved.id, sample), (MetricId::Counter(_), Sample::Add(0))) {
        return Ok(());
    }
    if let Some((batch, shard)) = held {
        if hold(batch, shard, resolved, sample) {
            // The flush makes the series (a zero included): later zeros can be skipped already.
            resolved.created = true;
            return Ok(());
        }
    }
    let mut labels = [""; MAX_LABELS];
    let result = send(envoy, name, resolved.id, label_values(&resolved.values, &mut labels), sample);
    resolved.created |= result.is_ok();
    result
}

/// A series' label values as the ABI takes them, borrowed into `slots` (at most [`MAX_LABELS`]).
fn label_values<'v>(values: &'v [Box<str>], slots: &'v mut [&'v str; MAX_LABELS]) -> &'v [&'v str] {
    slots.iter_mut().zip(values).for_each(|(slot, value)| *slot = value);
    slots.get(..values.len()).unwrap_or_default()
}

/// Holds `sample`'s change to a series in `shard` for the next flush; false if no change holds it
/// (a histogram's value, a counter going down: sent now, refused or recorded there).
fn hold(batch: &Batch, shard: &Shard, resolved: &mut Resolved, sample: Sample) -> bool {
    let counter = match resolved.id {
        MetricId::Counter(_) => true,
        MetricId::Gauge(_) => false,
        MetricId::Histogram(_) => return false,
    };
    let mut unsent = shard.0.lock().unwrap_or_else(PoisonError::into_inner);
    let slot = match resolved.slot {
        Some(slot) if slot < unsent.len() => slot,
        _ => {
            unsent.push(Unsent { id: resolved.id, values: Arc::clone(&resolved.values), change: Change::None, made: false });
            let slot = unsent.len() - 1;
            resolved.slot = Some(slot);
            slot
        }
    };
    let Some(series) = unsent.get_mut(slot) else { return false };
    let Some(change) = series.change.then(counter, sample, || batch.sets.fetch_add(1, Ordering::Relaxed)) else { return false };
    series.change = change;
    batch.unsent.store(true, Ordering::Release);
    true
}

/// Sends `sample` of metric `id`, series `labels`, to Envoy.
fn send(envoy: &mut dyn Metrics, name: &str, id: MetricId, labels: &[&str], sample: Sample) -> Result<(), String> {
    let result = match (id, sample) {
        // A zero defines the series (it then exists from the first request on, as with wasm).
        (MetricId::Counter(id), Sample::Add(delta)) => match u64::try_from(delta) {
            Ok(by) => envoy.increment_counter(id, labels, by),
            Err(_) => return Err(format!("counter {name} cannot go down by {delta}")),
        },
        (MetricId::Gauge(id), Sample::Add(delta)) => envoy.add_gauge(id, labels, delta),
        (MetricId::Gauge(id), Sample::Set(value)) => envoy.set_gauge(id, labels, value),
        (MetricId::Histogram(id), Sample::Set(value)) => envoy.record_histogram(id, labels, value),
        _ => return Err(format!("metric {name} is not of the kind the sample is ({sample:?})")),
    };
    result.map_err(|e| format!("metric {name}: {e}"))
}

/// What a flow sample does to its metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sample {
    /// Add to a counter or gauge.
    Add(i64),
    /// Set a gauge, or record a histogram value.
    Set(u64),
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)] // A test fails by panicking.
mod tests {
    use super::*;
    use crate::filter::{GaugeId, HistogramId};

    /// A catalogue with made-up ids, as `define` would build it (no Envoy in a unit test).
    fn catalogue(plugins: &[Plugin]) -> Catalogue {
        numbered(plugins, 0)
    }

    /// A catalogue whose made-up ids start after `first`.
    fn numbered(plugins: &[Plugin], first: usize) -> Catalogue {
        let mut families: HashMap<&'static str, Vec<Variant>> = HashMap::new();
        let mut next = first;
        for family in FAMILIES.iter().filter(|f| plugins.contains(&f.plugin)) {
            for keys in variants(family) {
                next += 1;
                let id = match family.kind {
                    MetricKind::Counter => MetricId::Counter(CounterId::for_tests(next)),
                    MetricKind::Gauge => MetricId::Gauge(GaugeId::for_tests(next)),
                    MetricKind::Histogram => MetricId::Histogram(HistogramId::for_tests(next)),
                };
                families.entry(family.name).or_default().push(Variant { keys, id });
            }
        }
        Catalogue::of(families, false)
    }

    /// One call a [`Recorder`] saw: the metric, its label values, the number given.
    type Call = (MetricId, Vec<String>, i128);

    /// A fake Envoy that keeps every metric call.
    #[derive(Default)]
    struct Recorder(Vec<Call>);

    impl Recorder {
        fn keep(&mut self, id: MetricId, labels: &[&str], value: i128) -> Result<(), MetricsError> {
            self.0.push((id, labels.iter().map(|l| l.to_string()).collect(), value));
            Ok(())
        }
    }

    impl Metrics for Recorder {
        fn increment_counter(&mut self, id: CounterId, labels: &[&str], by: u64) -> Result<(), MetricsError> {
            self.keep(MetricId::Counter(id), labels, by.into())
        }
        fn record_histogram(&mut self, id: HistogramId, labels: &[&str], value: u64) -> Result<(), MetricsError> {
            self.keep(MetricId::Histogram(id), labels, value.into())
        }
        fn add_gauge(&mut self, id: GaugeId, labels: &[&str], delta: i64) -> Result<(), MetricsError> {
            self.keep(MetricId::Gauge(id), labels, delta.into())
        }
        fn set_gauge(&mut self, id: GaugeId, labels: &[&str], value: u64) -> Result<(), MetricsError> {
            self.keep(MetricId::Gauge(id), labels, value.into())
        }
    }

    /// What `name` resolves to without the cache: the call a record of it makes.
    fn uncached(c: &Catalogue, name: &str) -> Option<(MetricId, Vec<String>)> {
        let mut values = [""; MAX_LABELS];
        c.resolve(name, &mut values).map(|(id, n)| (id, values.iter().take(n).map(|v| v.to_string()).collect()))
    }

    /// A sample of the metric's kind that is never skipped.
    fn sample_of(id: MetricId) -> Sample {
        match id {
            MetricId::Counter(_) | MetricId::Gauge(_) => Sample::Add(3),
            MetricId::Histogram(_) => Sample::Set(3),
        }
    }

    /// The entries this thread caches for `c`.
    fn cached_names(c: &Catalogue) -> usize {
        CACHES.with(|caches| caches.borrow().iter().find(|t| t.number == c.number).map_or(0, |t| t.names.len()))
    }

    /// The per-request labels the tests' names carry.
    fn six_labels() -> sluice_core::report::Labels {
        sluice_core::report::Labels {
            model_version: "v2".into(),
            tenant: "acme".into(),
            api: "chat_completions".into(),
            ctx: "1k".into(),
            turn: "first".into(),
            stream: "true".into(),
        }
    }

    /// One name of every family, built by core's constructors.
    fn constructor_names() -> Vec<String> {
        use sluice_core::budget::policy::CounterSpec;
        use sluice_core::budget::{Level, Limit, Window};
        use sluice_core::contract::GatewayEnd;
        use sluice_core::latency::deadline::Fired;
        use sluice_core::latency::{Priority, State};
        use sluice_core::metrics as m;
        let labels = six_labels();
        let s = m::RequestSeries::new(&labels);
        let spec = |level, owner: &str, window, limit| CounterSpec {
            store_key: "k".into(),
            remote_name: "k".into(),
            level,
            owner: owner.into(),
            window,
            limit,
            soft_limit: None,
            code: "c".into(),
            per_identity: false,
        };
        let charge = m::ChargeSeries::new("k1", "search", "acme", "v2");
        let pair = m::ShadowPair::new("llama-v1", "qwen-v1");
        let tokens = Limit::Tokens { limit: 100, input_weight: 1, output_weight: 1 };
        vec![
            m::requests_total(&s, 200, Some("stop"), true),
            m::ttft_ms(&s),
            m::tpot_us(&s),
            m::decode_tokens_per_s(&s),
            m::request_duration_ms(&s),
            m::input_tokens(&s),
            m::output_tokens(&s),
            m::input_tokens_total(&s),
            m::output_tokens_total(&s),
            m::cached_input_tokens_total(&s),
            m::reasoning_tokens_total(&s),
            m::cost_micro_usd_total(&s),
            m::client_disconnects_total(&s),
            m::upstream_errors_total(&s),
            m::gateway_replies_total(&s, GatewayEnd::Refused),
            m::gateway_replies_total(&s, GatewayEnd::Deadline),
            m::in_flight("v2"),
            m::request_body_uninspected_total(m::UninspectedReason::TooLarge).to_string(),
            m::quality_repetition_per_mille("v2"),
            m::quality_output_tokens("v2", "stop"),
            m::quality_degenerate_answers_total("v2", m::Degenerate::Truncated),
            m::budget_remaining(&spec(Level::Team, "search", Window::Minute, tokens)),
            m::budget_remaining(&spec(Level::Org, "acme", Window::Month { reset_day: 1 }, Limit::MicroUsd(5))),
            m::budget_charged_tokens_total(&charge),
            m::budget_charged_micro_usd_total(&charge),
            m::budget_rejections_total("k1", "over_budget"),
            m::budget_clamps_total("k1"),
            m::budget_overestimate_tokens("k1"),
            m::budget_soft_limit_crossings_total(&spec(Level::Key, "k1", Window::Day, Limit::Requests(10))),
            m::budget_ledger_calls_total(m::LedgerCall::Settle, m::LedgerResult::Timeout).to_string(),
            m::budget_ledger_latency_ms(m::LedgerCall::WriteBack).to_string(),
            m::budget_ledger_up().to_string(),
            m::budget_ledger_fallback_total(m::LedgerFallback::Local).to_string(),
            m::budget_ledger_settlements_dropped_total().to_string(),
            m::router_requests_total("llama", "llama-v2", sluice_core::routing::Reason::Fallback),
            m::router_unrouted_total(m::Unrouted::NoModel).into_owned(),
            m::router_unrouted_total(m::Unrouted::NoVersion { model: "llama" }).into_owned(),
            m::router_shadow_total(&pair, m::ShadowResult::SkippedCap),
            m::router_compare_duration_ms(&pair, m::Side::Shadow),
            m::router_compare_ttft_ms(&pair),
            m::router_compare_output_tokens(&pair, m::Side::Primary),
            m::router_compare_errors_total(&pair, m::Side::Shadow),
            m::router_compare_total(&pair, true),
            m::router_compare_similarity_per_mille(&pair),
            m::latency_requests_total("llama-v1", "interactive", "client_disconnect"),
            m::latency_deadline_total("llama-v1", Fired::TtftReply),
            m::latency_shed_total("llama-v1", Priority::Sheddable, m::ShedReason::BreakerOpen),
            m::latency_fallback_unavailable_total("llama-v1", Priority::Critical),
            m::latency_probes_total("llama-v1"),
            m::latency_output_capped_total("llama-v1"),
            m::latency_breaker_transitions_total("llama-v1", State::HalfOpen),
            m::latency_breaker_state("llama-v1"),
            m::latency_in_flight("llama-v1"),
        ]
    }

    const ALL: &[Plugin] = &[Plugin::LlmMetrics, Plugin::TenantBudget, Plugin::ModelRouter, Plugin::LatencyGuard];

    fn resolved(c: &Catalogue, name: &str) -> Option<Vec<String>> {
        let mut values = [""; MAX_LABELS];
        c.resolve(name, &mut values).map(|(_, n)| values.iter().take(n).map(|v| v.to_string()).collect())
    }

    #[test]
    fn variants_expand_alternatives_and_optional_labels() {
        let remaining = FAMILIES.iter().find(|f| f.name == "sluice.budget.remaining").map(variants);
        assert_eq!(remaining, Some(vec![vec!["org", "window", "unit"], vec!["team", "window", "unit"], vec!["key", "window", "unit"]]));
        let unrouted = FAMILIES.iter().find(|f| f.name == "sluice.router.unrouted_total").map(variants);
        assert_eq!(unrouted, Some(vec![vec!["reason"], vec!["reason", "model"]]));
        assert!(FAMILIES.iter().all(|f| variants(f).iter().all(|v| v.len() <= MAX_LABELS)));
    }

    #[test]
    fn flat_names_map_back_to_their_family_and_values() {
        let c = catalogue(&[Plugin::LlmMetrics, Plugin::TenantBudget]);
        let six = ".model_version.v2.tenant.acme.api.chat_completions.ctx.1k.turn.first.stream.true";
        assert_eq!(resolved(&c, &format!("sluice.ttft_ms{six}")), Some(["v2", "acme", "chat_completions", "1k", "first", "true"].map(String::from).to_vec()));
        // A family whose name is another's prefix, and one whose name has two dots.
        assert_eq!(resolved(&c, &format!("sluice.output_tokens_total{six}")).map(|v| v.len()), Some(6));
        assert_eq!(resolved(&c, "sluice.quality.output_tokens.model_version.v2.finish.stop"), Some(vec!["v2".to_string(), "stop".to_string()]));
        assert_eq!(resolved(&c, "sluice.budget.remaining.team.ml.window.day.unit.tokens"), Some(["ml", "day", "tokens"].map(String::from).to_vec()));
        assert_eq!(resolved(&c, "sluice.budget.ledger_up"), Some(Vec::new()));
        assert_eq!(resolved(&c, "sluice.request_body_uninspected_total.reason.encoded"), Some(vec!["encoded".to_string()]));
    }

    #[test]
    fn names_of_no_defined_family_are_not_resolved() {
        let c = catalogue(&[Plugin::LlmMetrics]);
        assert_eq!(resolved(&c, "sluice.router.requests_total.model.m.version.v.reason.r"), None, "model-router is not configured");
        assert_eq!(resolved(&c, "sluice.ttft_ms.model_version.v2"), None, "labels missing");
        assert_eq!(resolved(&c, "sluice.in_flight.model_version"), None, "a key without its value");
        assert_eq!(resolved(&c, "sluice.nothing"), None);
    }

    #[test]
    fn every_constructor_name_of_core_resolves() {
        // The names core's constructors build for the per-request families, through a record.
        let c = catalogue(&[Plugin::LlmMetrics, Plugin::TenantBudget, Plugin::ModelRouter, Plugin::LatencyGuard]);
        let labels = six_labels();
        let series = sluice_core::metrics::RequestSeries::new(&labels);
        for name in [
            sluice_core::metrics::requests_total(&series, 200, Some("stop"), true),
            sluice_core::metrics::ttft_ms(&series),
            sluice_core::metrics::gateway_replies_total(&series, sluice_core::contract::GatewayEnd::Refused),
            sluice_core::metrics::in_flight("v2"),
        ] {
            assert!(resolved(&c, &name).is_some(), "{name}");
        }
    }

    #[test]
    fn every_family_resolves_alike_cached_and_uncached() {
        let c = catalogue(ALL);
        let names = constructor_names();
        // Every family of core's catalogue has its name here.
        for family in FAMILIES {
            assert!(names.iter().any(|n| uncached(&c, n).is_some() && n.starts_with(family.name)), "{}", family.name);
        }
        for name in &names {
            let expected = uncached(&c, name).unwrap_or_else(|| panic!("{name} does not resolve"));
            let sample = sample_of(expected.0);
            let mut envoy = Recorder::default();
            // The first record resolves and caches; the second is served by the cache.
            c.record(&mut envoy, name, sample).unwrap();
            c.record(&mut envoy, name, sample).unwrap();
            let call = (expected.0, expected.1, 3);
            assert_eq!(envoy.0, vec![call.clone(), call], "{name}");
        }
        assert_eq!(cached_names(&c), names.len());
    }

    #[test]
    fn a_counters_zero_reaches_envoy_once_per_series() {
        let c = catalogue(ALL);
        let mut envoy = Recorder::default();
        let name = "sluice.budget.clamps_total.key.k1";
        let id = uncached(&c, name).map(|(id, _)| id).unwrap();
        let call = |by| (id, vec!["k1".to_string()], by);
        c.record(&mut envoy, name, Sample::Add(0)).unwrap();
        assert_eq!(envoy.0, vec![call(0)], "the first zero creates the series");
        c.record(&mut envoy, name, Sample::Add(0)).unwrap();
        assert_eq!(envoy.0, vec![call(0)], "a second zero changes nothing");
        c.record(&mut envoy, name, Sample::Add(2)).unwrap();
        c.record(&mut envoy, name, Sample::Add(0)).unwrap();
        c.record(&mut envoy, name, Sample::Add(2)).unwrap();
        assert_eq!(envoy.0, vec![call(0), call(2), call(2)], "non-zero adds always reach Envoy");
        // Another series of the family is created by its own first zero.
        c.record(&mut envoy, "sluice.budget.clamps_total.key.k2", Sample::Add(0)).unwrap();
        assert_eq!(envoy.0.len(), 4);

        // Gauges and histograms are never skipped, zero or not.
        let gauge = "sluice.in_flight.model_version.v2";
        let histogram = "sluice.budget.overestimate_tokens.key.k1";
        let mut envoy = Recorder::default();
        for _ in 0..2 {
            c.record(&mut envoy, gauge, Sample::Add(0)).unwrap();
            c.record(&mut envoy, gauge, Sample::Set(0)).unwrap();
            c.record(&mut envoy, histogram, Sample::Set(0)).unwrap();
        }
        assert_eq!(envoy.0.len(), 6);
    }

    #[test]
    fn a_failed_call_does_not_count_as_the_series_created() {
        struct Refusing;
        impl Metrics for Refusing {
            fn increment_counter(&mut self, _: CounterId, _: &[&str], _: u64) -> Result<(), MetricsError> {
                Err(MetricsError::Frozen)
            }
            fn record_histogram(&mut self, _: HistogramId, _: &[&str], _: u64) -> Result<(), MetricsError> {
                Err(MetricsError::Frozen)
            }
            fn add_gauge(&mut self, _: GaugeId, _: &[&str], _: i64) -> Result<(), MetricsError> {
                Err(MetricsError::Frozen)
            }
            fn set_gauge(&mut self, _: GaugeId, _: &[&str], _: u64) -> Result<(), MetricsError> {
                Err(MetricsError::Frozen)
            }
        }
        let c = catalogue(ALL);
        let name = "sluice.budget.clamps_total.key.k1";
        assert!(c.record(&mut Refusing, name, Sample::Add(0)).is_err());
        let mut envoy = Recorder::default();
        c.record(&mut envoy, name, Sample::Add(0)).unwrap();
        assert_eq!(envoy.0.len(), 1);
    }

    #[test]
    fn catalogues_never_share_cached_ids() {
        // Two configurations (a reload) define the same names with other ids.
        let (old, new) = (numbered(ALL, 0), numbered(ALL, 10_000));
        for name in constructor_names() {
            let (old_id, new_id) = (uncached(&old, &name).unwrap().0, uncached(&new, &name).unwrap().0);
            assert_ne!(old_id, new_id);
            let mut envoy = Recorder::default();
            for _ in 0..2 {
                old.record(&mut envoy, &name, sample_of(old_id)).unwrap();
                new.record(&mut envoy, &name, sample_of(new_id)).unwrap();
            }
            let ids: Vec<MetricId> = envoy.0.iter().map(|(id, _, _)| *id).collect();
            assert_eq!(ids, vec![old_id, new_id, old_id, new_id], "{name}");
        }
        // A catalogue's zero does not count as another's series created.
        let name = "sluice.budget.clamps_total.key.k9";
        let mut envoy = Recorder::default();
        old.record(&mut envoy, name, Sample::Add(0)).unwrap();
        new.record(&mut envoy, name, Sample::Add(0)).unwrap();
        assert_eq!(envoy.0.len(), 2);
    }

    #[test]
    fn a_dropped_catalogues_cache_goes_when_the_thread_meets_a_new_one() {
        let count = || CACHES.with(|caches| caches.borrow().len());
        let before = count();
        let old = catalogue(ALL);
        old.record(&mut Recorder::default(), "sluice.budget.ledger_up", Sample::Set(1)).unwrap();
        assert_eq!(count(), before + 1);
        drop(old);
        let new = catalogue(ALL);
        new.record(&mut Recorder::default(), "sluice.budget.ledger_up", Sample::Set(1)).unwrap();
        assert_eq!(count(), before + 1);
    }

    #[test]
    fn names_resolve_past_the_cache_bound() {
        let c = catalogue(ALL);
        let mut envoy = Recorder::default();
        let key = |n: usize| format!("sluice.budget.clamps_total.key.k{n}");
        for n in 0..CACHE_BOUND + 10 {
            c.record(&mut envoy, &key(n), Sample::Add(0)).unwrap();
        }
        assert_eq!(cached_names(&c), CACHE_BOUND);
        // Past the bound, every record is resolved (and its zeros sent: no entry remembers them).
        let last = key(CACHE_BOUND + 9);
        c.record(&mut envoy, &last, Sample::Add(0)).unwrap();
        c.record(&mut envoy, &last, Sample::Add(5)).unwrap();
        assert_eq!(envoy.0.len(), CACHE_BOUND + 12);
        let tail: Vec<&Call> = envoy.0.iter().rev().take(2).collect();
        assert_eq!(
            tail.iter().map(|(_, labels, by)| (labels.clone(), *by)).collect::<Vec<_>>(),
            vec![(vec![format!("k{}", CACHE_BOUND + 9)], 5), (vec![format!("k{}", CACHE_BOUND + 9)], 0)]
        );
        // Names that do not resolve are refused, and not cached.
        assert!(c.record(&mut envoy, "sluice.nothing", Sample::Add(1)).is_err());
        let fresh = catalogue(ALL);
        assert!(fresh.record(&mut envoy, "sluice.nothing", Sample::Add(1)).is_err());
        assert!(fresh.record(&mut envoy, "sluice.ttft_ms.model_version.v2", Sample::Set(1)).is_err());
        assert_eq!(cached_names(&fresh), 0);
    }

    #[test]
    fn the_name_hasher_tells_lengths_and_tails_apart() {
        use std::hash::BuildHasher;
        let hash = |s: &str| BuildHasherDefault::<NameHasher>::default().hash_one(s);
        assert_ne!(hash("ab"), hash("ab\0"));
        assert_ne!(hash("sluice.in_flight.model_version.v1"), hash("sluice.in_flight.model_version.v2"));
        assert_ne!(hash("12345678"), hash("1234567"));
    }

    /// A batched catalogue of every family, as `define` with `batched` builds it.
    fn batched() -> Catalogue {
        let mut c = catalogue(ALL);
        c.batch = Some(Batch::default());
        c
    }

    /// The calls since the last look, emptied.
    fn seen(envoy: &mut Recorder) -> Vec<(Vec<String>, i128)> {
        envoy.0.drain(..).map(|(_, labels, value)| (labels, value)).collect()
    }

    #[test]
    fn batched_counts_reach_envoy_summed_once_per_flush() {
        let c = batched();
        let name = sluice_core::metrics::requests_total(&sluice_core::metrics::RequestSeries::new(&six_labels()), 200, Some("stop"), true);
        let values = uncached(&c, &name).unwrap().1;
        let mut envoy = Recorder::default();
        assert!(!c.has_unsent());
        // Every change waits, summed.
        for _ in 0..5 {
            c.record(&mut envoy, &name, Sample::Add(2)).unwrap();
        }
        c.record(&mut envoy, &name, Sample::Add(0)).unwrap();
        assert!(envoy.0.is_empty(), "a count was sent before the flush: {:?}", envoy.0);
        assert!(c.has_unsent());
        assert!(c.flush(&mut envoy).is_empty());
        assert_eq!(seen(&mut envoy), vec![(values.clone(), 10)]);
        assert!(!c.has_unsent());
        // Nothing held, nothing sent; then the next changes only.
        assert!(c.flush(&mut envoy).is_empty());
        assert!(envoy.0.is_empty());
        c.record(&mut envoy, &name, Sample::Add(7)).unwrap();
        assert!(envoy.0.is_empty());
        c.flush(&mut envoy);
        assert_eq!(seen(&mut envoy), vec![(values, 7)]);
        // A counter going down is refused at once, as unbatched.
        assert!(c.record(&mut envoy, &name, Sample::Add(-1)).is_err());
        assert!(!c.has_unsent());
        // A series' zero is held once (the flush makes the series), then skipped.
        let other = sluice_core::metrics::client_disconnects_total(&sluice_core::metrics::RequestSeries::new(&six_labels()));
        c.record(&mut envoy, &other, Sample::Add(0)).unwrap();
        c.flush(&mut envoy);
        assert_eq!(seen(&mut envoy).iter().map(|(_, v)| *v).collect::<Vec<_>>(), vec![0]);
        c.record(&mut envoy, &other, Sample::Add(0)).unwrap();
        assert!(!c.has_unsent());
    }

    #[test]
    fn histograms_are_never_held_and_gauge_additions_are_summed() {
        let c = batched();
        let series = sluice_core::metrics::RequestSeries::new(&six_labels());
        let (ttft, in_flight) = (sluice_core::metrics::ttft_ms(&series), sluice_core::metrics::in_flight("v2"));
        let mut envoy = Recorder::default();
        for value in [5, 9, 5] {
            c.record(&mut envoy, &ttft, Sample::Set(value)).unwrap();
        }
        assert_eq!(seen(&mut envoy).iter().map(|(_, v)| *v).collect::<Vec<_>>(), vec![5, 9, 5]);
        for delta in [1, 1, -1, 1, -1] {
            c.record(&mut envoy, &in_flight, Sample::Add(delta)).unwrap();
        }
        assert!(envoy.0.is_empty());
        c.flush(&mut envoy);
        assert_eq!(seen(&mut envoy), vec![(vec!["v2".to_string()], 1)]);
        c.record(&mut envoy, &in_flight, Sample::Add(2)).unwrap();
        c.record(&mut envoy, &in_flight, Sample::Add(-2)).unwrap();
        c.flush(&mut envoy);
        assert!(envoy.0.is_empty(), "additions that cancel out were sent: {:?}", envoy.0);
        // Before its first flush a series is made even when they cancel out (it shows at zero).
        let other = sluice_core::metrics::in_flight("v9");
        c.record(&mut envoy, &other, Sample::Add(1)).unwrap();
        c.record(&mut envoy, &other, Sample::Add(-1)).unwrap();
        c.flush(&mut envoy);
        assert_eq!(seen(&mut envoy), vec![(vec!["v9".to_string()], 0)]);
        c.record(&mut envoy, &in_flight, Sample::Add(-1)).unwrap();
        c.flush(&mut envoy);
        assert_eq!(seen(&mut envoy), vec![(vec!["v2".to_string()], -1)]);
    }

    #[test]
    fn held_gauge_sets_of_several_threads_flush_in_the_order_they_were_made() {
        let c = Arc::new(batched());
        let name = sluice_core::metrics::latency_breaker_state("v1");
        let mut envoy = Recorder::default();
        let set_on_a_new_thread = |value: u64| {
            let (c, name) = (Arc::clone(&c), name.clone());
            std::thread::spawn(move || c.record(&mut Recorder::default(), &name, Sample::Set(value)).unwrap()).join().unwrap();
        };
        // This thread's shard is registered first; each round's later set is on the other side.
        c.record(&mut envoy, &name, Sample::Set(5)).unwrap();
        set_on_a_new_thread(7);
        assert!(envoy.0.is_empty(), "a gauge set was sent before the flush");
        c.flush(&mut envoy);
        assert_eq!(seen(&mut envoy).last().map(|(_, v)| *v), Some(7));
        set_on_a_new_thread(9);
        c.record(&mut envoy, &name, Sample::Set(4)).unwrap();
        c.record(&mut envoy, &name, Sample::Add(1)).unwrap();
        c.flush(&mut envoy);
        assert_eq!(seen(&mut envoy), vec![(vec!["v1".to_string()], 9), (vec!["v1".to_string()], 5)]);
    }

    #[test]
    fn counts_held_by_several_threads_all_reach_envoy() {
        let c = Arc::new(batched());
        let name = sluice_core::metrics::input_tokens_total(&sluice_core::metrics::RequestSeries::new(&six_labels()));
        let workers: Vec<_> = (0..4)
            .map(|_| {
                let (c, name) = (Arc::clone(&c), name.clone());
                std::thread::spawn(move || {
                    let mut envoy = Recorder::default();
                    for _ in 0..1000 {
                        c.record(&mut envoy, &name, Sample::Add(3)).unwrap();
                    }
                    envoy.0.iter().map(|(_, _, v)| *v).sum::<i128>()
                })
            })
            .collect();
        let sent_at_once: i128 = workers.into_iter().map(|w| w.join().unwrap()).sum();
        let mut envoy = Recorder::default();
        c.flush(&mut envoy);
        let flushed: i128 = envoy.0.iter().map(|(_, _, v)| *v).sum();
        assert_eq!(sent_at_once, 0);
        assert_eq!(flushed, 4 * 1000 * 3);
        assert_eq!(envoy.0.len(), 4, "one call per thread's series");
    }
}
