//! A rolling window of request latencies for one model version: `N` time slots (e.g. 6 × 10 s for
//! 60 s), each with a [`QuantileSketch`] of TTFT, one of time per output token, and request/error
//! counters. Slots are addressed by `now_ns / slot_ns`, so every Envoy worker agrees on them; a slot
//! left from an earlier turn of the ring is reset lazily when it is next written, and skipped when
//! read. Memory is bounded by `N × 2 × max_buckets`.
//!
//! A snapshot merges the slots of the last `N` slot periods, the current (partial) one included:
//! it covers between `(N−1) × slot` and `N × slot` of history.
//!
//! The window is shared by every worker through a [`SharedStore`] value updated with
//! compare-and-swap ([`update`]), like the budget ledger.
//!
//! A window remembers when it was last emptied ([`WindowStats::started_ns`]): a half-open breaker
//! judges its probes only on a window emptied since it started probing. Without that, a worker that
//! read the window a moment before another worker emptied it (the breaker's state and the window
//! are two shared values, written one after the other) would judge the probes on the samples that
//! opened the breaker.

use super::codec::{put_varint, Reader};
use super::sketch::{QuantileSketch, SketchParams};
use super::UpdateError;
use crate::store::{cas_update, SharedStore, Step, StoreError, Updated};

const FORMAT_VERSION: u8 = 3;

/// Most slots a window may have.
pub const MAX_SLOTS: u8 = 60;

/// Geometry of a window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowConfig {
    slots: u8,
    slot_ns: u64,
    sketch: SketchParams,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WindowConfigError {
    #[error("slots must be 1–{MAX_SLOTS}, got {0}")]
    Slots(u32),
    #[error("the slot length must be at least 1 ms, got {0} ns")]
    SlotLength(u64),
}

impl WindowConfig {
    /// A window of `slots` slots of `slot_ns` each.
    pub fn new(slots: u32, slot_ns: u64, sketch: SketchParams) -> Result<WindowConfig, WindowConfigError> {
        let slots = match u8::try_from(slots) {
            Ok(s) if (1..=MAX_SLOTS).contains(&s) => s,
            _ => return Err(WindowConfigError::Slots(slots)),
        };
        if slot_ns < 1_000_000 {
            return Err(WindowConfigError::SlotLength(slot_ns));
        }
        Ok(WindowConfig { slots, slot_ns, sketch })
    }

    pub fn slots(&self) -> u32 {
        u32::from(self.slots)
    }

    pub fn slot_ns(&self) -> u64 {
        self.slot_ns
    }

    /// `slots × slot_ns`.
    pub fn window_ns(&self) -> u64 {
        self.slot_ns.saturating_mul(u64::from(self.slots))
    }

    pub fn sketch(&self) -> SketchParams {
        self.sketch
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Slot {
    /// Absolute slot number (`now_ns / slot_ns`) the data belongs to.
    epoch: u64,
    requests: u64,
    errors: u64,
    ttft: QuantileSketch,
    tpot: QuantileSketch,
}

impl Slot {
    fn new(epoch: u64, empty: &QuantileSketch) -> Slot {
        Slot { epoch, requests: 0, errors: 0, ttft: empty.empty_like(), tpot: empty.empty_like() }
    }

    /// Holds anything: finished requests, or TTFTs of requests still streaming.
    fn used(&self) -> bool {
        self.requests > 0 || self.ttft.count() > 0
    }
}

/// The window. See the module documentation.
#[derive(Debug, Clone, PartialEq)]
pub struct RollingWindow {
    config: WindowConfig,
    /// When the window was last emptied ([`reset_since`]); 0 when never.
    started_ns: u64,
    slots: Vec<Slot>,
}

/// What a window holds at one moment. `WindowStats::default()` is an empty window: what to pass
/// the breaker at admission, where only time can change its state (open → half-open).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct WindowStats {
    /// Requests recorded.
    pub samples: u64,
    /// Of which failed.
    pub errors: u64,
    /// `errors × 1000 / samples`, rounded down (0 without samples). Display only: the breaker
    /// compares `errors` and `samples` exactly.
    pub error_rate_per_mille: u64,
    /// Time to first token, µs.
    pub ttft: QuantileSketch,
    /// Time per output token, µs.
    pub tpot: QuantileSketch,
    /// The window's nominal length.
    pub window_ns: u64,
    /// When the window was last emptied (0: never): it holds nothing recorded before.
    pub started_ns: u64,
}

impl WindowStats {
    /// TTFT at quantile `q` (µs); `None` without TTFT samples.
    pub fn ttft_quantile(&self, q: f64) -> Option<u64> {
        self.ttft.quantile(q)
    }

    /// Time per output token at quantile `q` (µs); `None` without samples.
    pub fn tpot_quantile(&self, q: f64) -> Option<u64> {
        self.tpot.quantile(q)
    }
}

impl RollingWindow {
    pub fn new(config: WindowConfig) -> RollingWindow {
        RollingWindow::started_at(config, 0)
    }

    /// An empty window emptied at `started_ns`.
    pub fn started_at(config: WindowConfig, started_ns: u64) -> RollingWindow {
        let empty = QuantileSketch::new(config.sketch);
        RollingWindow { config, started_ns, slots: (0..config.slots).map(|_| Slot::new(0, &empty)).collect() }
    }

    fn empty_sketch(&self) -> QuantileSketch {
        match self.slots.first() {
            Some(slot) => slot.ttft.empty_like(),
            None => QuantileSketch::new(self.config.sketch),
        }
    }

    pub fn config(&self) -> &WindowConfig {
        &self.config
    }

    fn epoch(&self, now_ns: u64) -> u64 {
        now_ns / self.config.slot_ns.max(1)
    }

    /// The slot `now_ns` belongs to, emptied first when it still holds an older period; `None` when
    /// the ring has already reused it for a later period (a clock that went backwards).
    fn slot_at(&mut self, now_ns: u64) -> Option<&mut Slot> {
        let epoch = self.epoch(now_ns);
        let n = u64::from(self.config.slots).max(1);
        let empty = self.empty_sketch();
        let slot = self.slots.get_mut((epoch % n) as usize)?;
        if slot.epoch < epoch || (!slot.used() && slot.epoch != epoch) {
            *slot = Slot::new(epoch, &empty);
        } else if slot.epoch > epoch {
            return None;
        }
        Some(slot)
    }

    /// Records the TTFT of a request still streaming, at its first token, so the breaker sees it
    /// without waiting for the end of the generation. The request itself is counted by [`record`]
    /// at its end (without the TTFT again). `false` as for [`record`].
    ///
    /// [`record`]: RollingWindow::record
    pub fn record_ttft(&mut self, now_ns: u64, ttft_us: u64) -> bool {
        let Some(slot) = self.slot_at(now_ns) else { return false };
        slot.ttft.add(ttft_us);
        true
    }

    /// Records one finished request. Returns `false` (and records nothing) when `now_ns` falls in a
    /// slot the ring has already reused for a later period (a clock that went backwards).
    pub fn record(&mut self, now_ns: u64, ttft_us: Option<u64>, tpot_us: Option<u64>, error: bool) -> bool {
        let Some(slot) = self.slot_at(now_ns) else { return false };
        slot.requests = slot.requests.saturating_add(1);
        if error {
            slot.errors = slot.errors.saturating_add(1);
        }
        if let Some(v) = ttft_us {
            slot.ttft.add(v);
        }
        if let Some(v) = tpot_us {
            slot.tpot.add(v);
        }
        true
    }

    /// Merges the slots inside the window ending at `now_ns`.
    pub fn snapshot(&self, now_ns: u64) -> WindowStats {
        let epoch = self.epoch(now_ns);
        let n = u64::from(self.config.slots);
        let empty = self.empty_sketch();
        let mut stats = WindowStats {
            samples: 0,
            errors: 0,
            error_rate_per_mille: 0,
            ttft: empty.empty_like(),
            tpot: empty,
            window_ns: self.config.window_ns(),
            started_ns: self.started_ns,
        };
        // The slot just after `now` counts too: another worker may have read the clock a moment later.
        let inside = |s: &&Slot| s.used() && s.epoch.saturating_add(n) > epoch && s.epoch <= epoch.saturating_add(1);
        // One allocation per merged sketch: reserve the union of the slots' ranges first.
        let union =
            |pick: fn(&Slot) -> &QuantileSketch| self.slots.iter().filter(inside).filter_map(|s| pick(s).range()).reduce(|a, b| (a.0.min(b.0), a.1.max(b.1)));
        if let Some((lo, hi)) = union(|s| &s.ttft) {
            stats.ttft.reserve_range(lo, hi);
        }
        if let Some((lo, hi)) = union(|s| &s.tpot) {
            stats.tpot.reserve_range(lo, hi);
        }
        for slot in self.slots.iter().filter(inside) {
            stats.samples = stats.samples.saturating_add(slot.requests);
            stats.errors = stats.errors.saturating_add(slot.errors);
            // Same parameters by construction; a mismatch cannot happen and would only lose data.
            let _ = stats.ttft.merge(&slot.ttft);
            let _ = stats.tpot.merge(&slot.tpot);
        }
        if stats.samples > 0 {
            stats.error_rate_per_mille = u64::try_from(u128::from(stats.errors) * 1000 / u128::from(stats.samples)).unwrap_or(u64::MAX);
        }
        stats
    }

    /// Version, slot count, slot length, sketch parameters, when it was emptied; then per slot:
    /// epoch, 0 for an empty slot or requests + 1 followed by errors and the two sketches.
    pub fn encode(&self) -> Vec<u8> {
        let hint: usize = self.slots.iter().map(|s| 24 + s.ttft.encoded_len_hint() + s.tpot.encoded_len_hint()).sum();
        let mut out = Vec::with_capacity(16 + hint);
        out.push(FORMAT_VERSION);
        out.push(self.config.slots);
        out.extend_from_slice(&self.config.slot_ns.to_le_bytes());
        out.extend_from_slice(&self.config.sketch.accuracy_bp().to_le_bytes());
        out.extend_from_slice(&(self.config.sketch.max_buckets() as u16).to_le_bytes());
        put_varint(&mut out, self.started_ns);
        for slot in &self.slots {
            put_varint(&mut out, slot.epoch);
            // 0: an empty slot; else requests + 1, then the rest (a slot may hold TTFTs of
            // requests still streaming and no finished request yet).
            if slot.used() {
                put_varint(&mut out, slot.requests.saturating_add(1));
                put_varint(&mut out, slot.errors);
                slot.ttft.encode_into(&mut out);
                slot.tpot.encode_into(&mut out);
            } else {
                put_varint(&mut out, 0);
            }
        }
        out
    }

    /// `None` for bytes this version did not write or that are inconsistent.
    pub fn decode(bytes: &[u8]) -> Option<RollingWindow> {
        let mut r = Reader::new(bytes);
        if r.u8()? != FORMAT_VERSION {
            return None;
        }
        let slots = r.u8()?;
        let slot_ns = r.u64_le()?;
        let sketch = SketchParams::new(r.u16_le()?, r.u16_le()?).ok()?;
        let config = WindowConfig::new(u32::from(slots), slot_ns, sketch).ok()?;
        let started_ns = r.varint()?;
        let mut window = RollingWindow { config, started_ns, slots: Vec::with_capacity(usize::from(slots)) };
        let empty = QuantileSketch::new(sketch);
        for _ in 0..slots {
            let epoch = r.varint()?;
            let marker = r.varint()?;
            let mut slot = Slot::new(epoch, &empty);
            if marker > 0 {
                let requests = marker - 1;
                slot.requests = requests;
                slot.errors = r.varint()?;
                slot.ttft = QuantileSketch::decode_from(&mut r, Some(&empty))?;
                slot.tpot = QuantileSketch::decode_from(&mut r, Some(&empty))?;
                if slot.errors > requests || slot.ttft.params() != sketch || slot.tpot.params() != sketch {
                    return None;
                }
            }
            window.slots.push(slot);
        }
        r.is_empty().then_some(window)
    }
}

/// The stored window; a fresh one when absent, unreadable or of another geometry (the policy
/// changed: it starts over).
fn decode_or_fresh(bytes: Option<&[u8]>, config: &WindowConfig) -> RollingWindow {
    bytes.and_then(RollingWindow::decode).filter(|w| w.config == *config).unwrap_or_else(|| RollingWindow::new(*config))
}

/// The windows a worker last wrote, each with the bytes it wrote: when the store still holds those
/// bytes at its next update (no other worker wrote in between), the window is taken as it is
/// instead of decoded again — a decode of a minute of latencies is tens of thousands of
/// instructions, and a guarded request updates its version's window twice. Bytes equal to the ones
/// written decode to the window written, so what an update computes does not change. One entry a
/// key: the windows a policy names (its versions with a breaker).
#[derive(Debug, Default)]
pub struct WindowCache {
    written: crate::vecmap::VecMap<String, Option<(Vec<u8>, RollingWindow)>>,
}

impl WindowCache {
    /// [`update`], through this cache: the snapshot at `now_ns` of the window as written.
    #[allow(clippy::too_many_arguments)]
    pub fn update(
        &mut self,
        store: &mut dyn SharedStore,
        key: &str,
        config: &WindowConfig,
        now_ns: u64,
        ttft_us: Option<u64>,
        tpot_us: Option<u64>,
        error: bool,
    ) -> Result<WindowStats, UpdateError> {
        let written = self.write(store, key, config, &mut |w| w.record(now_ns, ttft_us, tpot_us, error))?;
        Ok(self.keep(key, written, now_ns))
    }

    /// [`update_ttft`], through this cache: the snapshot at `now_ns` of the window as written.
    pub fn update_ttft(
        &mut self,
        store: &mut dyn SharedStore,
        key: &str,
        config: &WindowConfig,
        now_ns: u64,
        ttft_us: u64,
    ) -> Result<WindowStats, UpdateError> {
        let written = self.write(store, key, config, &mut |w| w.record_ttft(now_ns, ttft_us))?;
        Ok(self.keep(key, written, now_ns))
    }

    /// [`cas_update`] of the shared window with `record` (`false`: nothing changed, nothing
    /// written): the window, with the bytes written (none when nothing was). A missing key is
    /// created empty first (see [`ensure`] for why that should have happened already). The
    /// cached window is taken out as it is used: a write that fails leaves nothing cached.
    fn write(
        &mut self,
        store: &mut dyn SharedStore,
        key: &str,
        config: &WindowConfig,
        // Not generic: one copy of the update's code for its four callers (the playground's page).
        record: &mut dyn FnMut(&mut RollingWindow) -> bool,
    ) -> Result<(Option<Vec<u8>>, RollingWindow), UpdateError> {
        let cached = &mut self.written;
        let written = cas_update(store, key, |bytes| {
            let Some(bytes) = bytes else { return Step::Create(RollingWindow::new(*config).encode()) };
            let mut window = match cached.get_mut(key).and_then(Option::take) {
                Some((was, window)) if was == bytes && window.config == *config => window,
                _ => decode_or_fresh(Some(bytes), config),
            };
            if record(&mut window) {
                let encoded = window.encode();
                Step::Write(encoded.clone(), (Some(encoded), window))
            } else {
                Step::Stop((None, window))
            }
        })?;
        match written {
            Updated::Written(entry) | Updated::Stopped(entry) => Ok(entry),
        }
    }

    /// Keeps `window` as `key`'s when it was written (the store's bytes are otherwise not known
    /// here); its snapshot at `now_ns`.
    fn keep(&mut self, key: &str, (bytes, window): (Option<Vec<u8>>, RollingWindow), now_ns: u64) -> WindowStats {
        let stats = window.snapshot(now_ns);
        let entry = bytes.map(|bytes| (bytes, window));
        match self.written.get_mut(key) {
            Some(slot) => *slot = entry,
            None => {
                self.written.insert(key.to_string(), entry);
            }
        }
        stats
    }
}

/// Reads the shared window (a fresh one when absent, unreadable or of another geometry).
pub fn read(store: &mut dyn SharedStore, key: &str, config: &WindowConfig) -> Result<RollingWindow, StoreError> {
    Ok(decode_or_fresh(store.get(key)?.0.as_deref(), config))
}

/// Creates the shared window if it does not exist; `true` when it did. Call at configure time,
/// before traffic: the store cannot make a *create* conditional (Envoy accepts any CAS token for a
/// missing key), so two first updates racing on a missing key could lose a sample. With the key
/// created up front every later update is a real CAS.
pub fn ensure(store: &mut dyn SharedStore, key: &str, config: &WindowConfig) -> Result<bool, StoreError> {
    if let (None, _) = store.get(key)? {
        store.set(key, &RollingWindow::new(*config).encode(), 0)?;
        return Ok(true);
    }
    Ok(false)
}

/// Records one finished request into the shared window with [`cas_update`]. Returns the window as
/// written (snapshot it for the breaker).
pub fn update(
    store: &mut dyn SharedStore,
    key: &str,
    config: &WindowConfig,
    now_ns: u64,
    ttft_us: Option<u64>,
    tpot_us: Option<u64>,
    error: bool,
) -> Result<RollingWindow, UpdateError> {
    Ok(WindowCache::default().write(store, key, config, &mut |w| w.record(now_ns, ttft_us, tpot_us, error))?.1)
}

/// [`RollingWindow::record_ttft`] into the shared window, with compare-and-swap as [`update`].
pub fn update_ttft(store: &mut dyn SharedStore, key: &str, config: &WindowConfig, now_ns: u64, ttft_us: u64) -> Result<RollingWindow, UpdateError> {
    Ok(WindowCache::default().write(store, key, config, &mut |w| w.record_ttft(now_ns, ttft_us))?.1)
}

/// Empties the shared window as of `since_ns` (the breaker asks for it when it starts probing, so
/// that the probes are judged on their own), unless it was already emptied at or after that time:
/// the worker whose transition it was and any worker that finds the window stale may both call
/// it, and a sample recorded between the two calls is kept.
pub fn reset_since(store: &mut dyn SharedStore, key: &str, config: &WindowConfig, since_ns: u64) -> Result<(), UpdateError> {
    let fresh = || RollingWindow::started_at(*config, since_ns).encode();
    cas_update(store, key, |bytes| {
        let Some(bytes) = bytes else { return Step::Create(fresh()) };
        if decode_or_fresh(Some(bytes), config).started_ns >= since_ns {
            Step::Stop(())
        } else {
            Step::Write(fresh(), ())
        }
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    const S: u64 = 1_000_000_000;
    const MS: u64 = 1_000_000;

    fn config() -> WindowConfig {
        WindowConfig::new(6, 10 * S, SketchParams::DEFAULT).unwrap()
    }

    #[test]
    fn old_slots_leave_the_window_and_are_reset_lazily() {
        let mut w = RollingWindow::new(config());
        let t0 = 1_000 * S;
        for i in 0..10 {
            assert!(w.record(t0 + i, Some(100_000), Some(20_000), i == 0));
        }
        let s = w.snapshot(t0);
        assert_eq!((s.samples, s.errors, s.error_rate_per_mille), (10, 1, 100));
        // 50 s later: same window; 60 s later: the first slot has left it.
        assert_eq!(w.snapshot(t0 + 59 * S).samples, 10);
        assert_eq!(w.snapshot(t0 + 60 * S).samples, 0);
        // Writing into the ring position again resets it.
        assert!(w.record(t0 + 60 * S, Some(1), None, false));
        let s = w.snapshot(t0 + 60 * S);
        assert_eq!((s.samples, s.errors, s.ttft.count(), s.tpot.count()), (1, 0, 1, 0));
        // A sample from a period the ring already reused is dropped.
        assert!(!w.record(t0, Some(1), None, false));
    }

    #[test]
    fn a_snapshot_is_the_sketch_of_the_values_inside_the_window() {
        let mut w = RollingWindow::new(config());
        let mut inside = QuantileSketch::default();
        let t0 = 3_000 * S;
        for i in 0..900u64 {
            let v = 1 + (i * 7919) % 2_000_000 * (1 + i % 5);
            let now = t0 + i * 100 * MS;
            w.record(now, Some(v), None, false);
            if now >= t0 + 30 * S {
                inside.add(v);
            }
        }
        // At 89.9 s the window holds slots 30–89.9 s.
        assert_eq!(w.snapshot(t0 + 89_900 * MS).ttft, inside);
    }

    #[test]
    fn encoding_round_trips_and_rejects_garbage() {
        let mut w = RollingWindow::new(config());
        let t0 = 77 * S;
        for i in 0..100u64 {
            w.record(t0 + i * S / 2, Some(200_000 + i * 1000), Some(30_000), i % 7 == 0);
        }
        let bytes = w.encode();
        assert_eq!(RollingWindow::decode(&bytes), Some(w.clone()));
        for cut in 0..bytes.len() {
            assert_eq!(RollingWindow::decode(&bytes[..cut]), None, "cut at {cut}");
        }
        assert_eq!(RollingWindow::decode(&[1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 100, 0, 0, 4]), None);
    }

    #[test]
    fn shared_updates_accumulate_and_a_changed_geometry_starts_over() {
        let mut store = MemoryStore::default();
        let c = config();
        for i in 0..5 {
            update(&mut store, "k", &c, 100 * S + i, Some(1000), Some(10), false).unwrap();
        }
        assert_eq!(read(&mut store, "k", &c).unwrap().snapshot(100 * S).samples, 5);
        let other = WindowConfig::new(12, 5 * S, SketchParams::DEFAULT).unwrap();
        assert_eq!(read(&mut store, "k", &other).unwrap().snapshot(100 * S).samples, 0);
        reset_since(&mut store, "k", &c, 100 * S).unwrap();
        let emptied = read(&mut store, "k", &c).unwrap().snapshot(100 * S);
        assert_eq!((emptied.samples, emptied.started_ns), (0, 100 * S));
    }

    #[test]
    fn a_reset_as_of_a_time_the_window_was_already_emptied_keeps_what_came_after() {
        let mut store = MemoryStore::default();
        let c = config();
        update(&mut store, "k", &c, 100 * S, Some(1000), None, false).unwrap();
        reset_since(&mut store, "k", &c, 101 * S).unwrap();
        update(&mut store, "k", &c, 101 * S + MS, Some(2000), None, false).unwrap();
        // A second worker asking for the same reset (or an older one) changes nothing.
        reset_since(&mut store, "k", &c, 101 * S).unwrap();
        reset_since(&mut store, "k", &c, 100 * S).unwrap();
        let s = read(&mut store, "k", &c).unwrap().snapshot(101 * S + MS);
        assert_eq!((s.samples, s.started_ns), (1, 101 * S));
        // A later probing period empties it again.
        reset_since(&mut store, "k", &c, 150 * S).unwrap();
        let s = read(&mut store, "k", &c).unwrap().snapshot(150 * S);
        assert_eq!((s.samples, s.started_ns), (0, 150 * S));
    }

    #[test]
    fn early_ttfts_count_for_the_quantile_not_as_requests_and_survive_encoding() {
        let mut store = MemoryStore::default();
        let c = config();
        let t0 = 500 * S;
        // Three streams past their first token, none finished: TTFTs in, no request yet.
        for (i, ttft) in [100_000u64, 200_000, 900_000].into_iter().enumerate() {
            update_ttft(&mut store, "k", &c, t0 + i as u64, ttft).unwrap();
        }
        let w = read(&mut store, "k", &c).unwrap();
        let s = w.snapshot(t0);
        assert_eq!((s.samples, s.errors, s.ttft.count()), (0, 0, 3));
        assert!(s.ttft_quantile(1.0).unwrap().abs_diff(900_000) <= 9_000);
        assert_eq!(RollingWindow::decode(&w.encode()), Some(w.clone()));
        // They finish (TTFT not given again): requests counted, TTFTs unchanged.
        for i in 0..3 {
            update(&mut store, "k", &c, t0 + 5 * S + i, None, Some(20_000), i == 2).unwrap();
        }
        let s = read(&mut store, "k", &c).unwrap().snapshot(t0 + 5 * S);
        assert_eq!((s.samples, s.errors, s.ttft.count(), s.tpot.count()), (3, 1, 3, 3));
        // A slot holding only early TTFTs leaves the window like any other.
        assert_eq!(read(&mut store, "k", &c).unwrap().snapshot(t0 + 70 * S).ttft.count(), 0);
    }

    /// A worker updating through its cache, another writing the same key uncached in between, the
    /// window emptied, its geometry changed: every snapshot and every stored byte is what the same
    /// updates made without any cache give. A cache that reused its window without comparing the
    /// bytes would lose the other worker's samples and fail here.
    #[test]
    fn a_cached_update_writes_and_sees_what_an_uncached_one_does() {
        let (c, other_geometry) = (config(), WindowConfig::new(3, 10 * S, SketchParams::DEFAULT).unwrap());
        let (mut cached_store, mut plain_store) = (MemoryStore::default(), MemoryStore::default());
        let mut cache = WindowCache::default();
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut draw = |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        let t0 = 1_000 * S;
        for step in 0..4_000u64 {
            let now = t0 + step * 37 * MS;
            let config = if step >= 3_000 { other_geometry } else { c };
            let (ttft, tpot) = (1_000 + draw(2_000_000), 500 + draw(90_000));
            match draw(10) {
                // Another worker's write: the cache's bytes are no longer the store's.
                0 => {
                    for store in [&mut cached_store, &mut plain_store] {
                        update(store, "k", &config, now, Some(ttft), None, false).unwrap();
                    }
                }
                1 if step % 500 == 1 => {
                    for store in [&mut cached_store, &mut plain_store] {
                        reset_since(store, "k", &config, now).unwrap();
                    }
                }
                2 | 3 => {
                    let seen = cache.update_ttft(&mut cached_store, "k", &config, now, ttft).unwrap();
                    let plain = update_ttft(&mut plain_store, "k", &config, now, ttft).unwrap().snapshot(now);
                    assert_eq!(seen, plain, "step {step}");
                }
                _ => {
                    let error = draw(20) == 0;
                    let seen = cache.update(&mut cached_store, "k", &config, now, Some(ttft), Some(tpot), error).unwrap();
                    let plain = update(&mut plain_store, "k", &config, now, Some(ttft), Some(tpot), error).unwrap().snapshot(now);
                    assert_eq!(seen, plain, "step {step}");
                }
            }
            assert_eq!(cached_store.get("k").unwrap().0, plain_store.get("k").unwrap().0, "step {step}");
        }
        let last = read(&mut cached_store, "k", &other_geometry).unwrap();
        assert!(last.snapshot(t0 + 4_000 * 37 * MS).samples > 0);
    }
}
