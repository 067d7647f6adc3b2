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

    fn encode_into(&self, out: &mut Vec<u8>) {
        put_varint(out, self.epoch);
        // 0: an empty slot; else requests + 1, then the rest (a slot may hold TTFTs of
        // requests still streaming and no finished request yet).
        if self.used() {
            put_varint(out, self.requests.saturating_add(1));
            put_varint(out, self.errors);
            self.ttft.encode_into(out);
            self.tpot.encode_into(out);
        } else {
            put_varint(out, 0);
        }
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
        stats.error_rate_per_mille = error_rate_per_mille(stats.errors, stats.samples);
        stats
    }

    /// Version, slot count, slot length, sketch parameters, when it was emptied; then per slot:
    /// epoch, 0 for an empty slot or requests + 1 followed by errors and the two sketches.
    pub fn encode(&self) -> Vec<u8> {
        self.encode_with_part_ends().0
    }

    /// [`encode`](RollingWindow::encode), with where its parts end in it: the header, then each
    /// slot.
    fn encode_with_part_ends(&self) -> (Vec<u8>, Vec<usize>) {
        let hint: usize = self.slots.iter().map(|s| 24 + s.ttft.encoded_len_hint() + s.tpot.encoded_len_hint()).sum();
        let mut out = Vec::with_capacity(16 + hint);
        out.push(FORMAT_VERSION);
        out.push(self.config.slots);
        out.extend_from_slice(&self.config.slot_ns.to_le_bytes());
        out.extend_from_slice(&self.config.sketch.accuracy_bp().to_le_bytes());
        out.extend_from_slice(&(self.config.sketch.max_buckets() as u16).to_le_bytes());
        put_varint(&mut out, self.started_ns);
        let mut ends = Vec::with_capacity(self.slots.len() + 1);
        ends.push(out.len());
        for slot in &self.slots {
            slot.encode_into(&mut out);
            ends.push(out.len());
        }
        (out, ends)
    }

    /// The ring position `now_ns`'s slot has (what [`record`](RollingWindow::record) writes).
    fn slot_index(&self, now_ns: u64) -> usize {
        (self.epoch(now_ns) % u64::from(self.config.slots).max(1)) as usize
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

/// What one update of a window records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sample {
    /// The TTFT of a request still streaming, at its first token ([`RollingWindow::record_ttft`]).
    Ttft(u64),
    /// A finished request ([`RollingWindow::record`]).
    Finished { ttft_us: Option<u64>, tpot_us: Option<u64>, error: bool },
}

impl Sample {
    fn record(self, window: &mut RollingWindow, now_ns: u64) -> bool {
        match self {
            Sample::Ttft(ttft_us) => window.record_ttft(now_ns, ttft_us),
            Sample::Finished { ttft_us, tpot_us, error } => window.record(now_ns, ttft_us, tpot_us, error),
        }
    }

    /// Adds what [`Sample::record`] put in a slot inside the window to the window's snapshot.
    fn add_to(self, stats: &mut WindowStats) {
        let (ttft_us, tpot_us) = match self {
            Sample::Ttft(ttft_us) => (Some(ttft_us), None),
            Sample::Finished { ttft_us, tpot_us, error } => {
                stats.samples = stats.samples.saturating_add(1);
                if error {
                    stats.errors = stats.errors.saturating_add(1);
                }
                stats.error_rate_per_mille = error_rate_per_mille(stats.errors, stats.samples);
                (ttft_us, tpot_us)
            }
        };
        if let Some(v) = ttft_us {
            stats.ttft.add(v);
        }
        if let Some(v) = tpot_us {
            stats.tpot.add(v);
        }
    }
}

fn error_rate_per_mille(errors: u64, samples: u64) -> u64 {
    match samples {
        0 => 0,
        n => u64::try_from(u128::from(errors) * 1000 / u128::from(n)).unwrap_or(u64::MAX),
    }
}

/// The windows a worker last wrote, each with the bytes it wrote: when the store still holds those
/// bytes at its next update (no other worker wrote in between), the window is taken as it is
/// instead of decoded again — a decode of a minute of latencies is tens of thousands of
/// instructions, and a guarded request updates its version's window twice. Bytes equal to the ones
/// written decode to the window written, so what an update computes does not change. One entry a
/// key: the windows a policy names (its versions with a breaker).
///
/// An update taken from the cache changes one slot: only that slot's bytes are encoded again, and
/// the snapshot the last update returned takes the sample in (when it was taken in the same slot
/// period: the same slots are inside) instead of merging every slot again. The two were 8.5 % of
/// the simulator's instructions over the Azure hour at 16 tokens an event.
#[derive(Debug, Default)]
pub struct WindowCache {
    entries: crate::vecmap::VecMap<String, Entry>,
    /// The bytes a window had before its last update (kept for their allocation).
    spare_bytes: Vec<u8>,
}

#[derive(Debug, Default)]
struct Entry {
    /// The window as this worker last wrote it; none when its last update wrote nothing or failed.
    written: Option<Written>,
    /// The snapshot the last update returned.
    stats: WindowStats,
    /// The slot period `stats` was taken in, when it is the snapshot of `written`'s window.
    stats_epoch: Option<u64>,
}

#[derive(Debug)]
struct Written {
    bytes: Vec<u8>,
    /// Where the header and then each slot end in `bytes`.
    part_ends: Vec<usize>,
    window: RollingWindow,
}

impl Written {
    fn new(window: RollingWindow) -> Written {
        let (bytes, part_ends) = window.encode_with_part_ends();
        Written { bytes, part_ends, window }
    }

    /// Encodes slot `k` again into `bytes`, in place of what it was.
    fn reencode_slot(&mut self, k: usize, scratch: &mut Vec<u8>) -> Option<()> {
        let (start, end) = (*self.part_ends.get(k)?, *self.part_ends.get(k + 1)?);
        scratch.clear();
        scratch.extend_from_slice(self.bytes.get(..start)?);
        self.window.slots.get(k)?.encode_into(scratch);
        let grown = scratch.len().wrapping_sub(end);
        scratch.extend_from_slice(self.bytes.get(end..)?);
        std::mem::swap(&mut self.bytes, scratch);
        for e in self.part_ends.get_mut(k + 1..)? {
            *e = e.wrapping_add(grown);
        }
        Some(())
    }
}

impl WindowCache {
    /// [`update`], through this cache: the snapshot at `now_ns` of the window as written.
    pub fn update(&mut self, store: &mut dyn SharedStore, key: &str, config: &WindowConfig, now_ns: u64, sample: Sample) -> Result<&WindowStats, UpdateError> {
        let entry = self.entries.get_or_insert_with_borrowed(key, Entry::default);
        let (stats_epoch, scratch) = (entry.stats_epoch.take(), &mut self.spare_bytes);
        let cached = &mut entry.written;
        let (written, from_cache) = write(store, key, |bytes| {
            let Some(bytes) = bytes else { return Step::Create(RollingWindow::new(*config).encode()) };
            let (mut written, from_cache) = match cached.take() {
                Some(w) if w.bytes == bytes && w.window.config == *config => (w, true),
                _ => (Written::new(decode_or_fresh(Some(bytes), config)), false),
            };
            if !sample.record(&mut written.window, now_ns) {
                return Step::Stop((Err(written.window), from_cache));
            }
            let k = written.window.slot_index(now_ns);
            if !from_cache || written.reencode_slot(k, scratch).is_none() {
                written = Written::new(written.window);
            }
            Step::Write(written.bytes.clone(), (Ok(written), from_cache))
        })?;
        let window = match &written {
            Ok(w) => &w.window,
            Err(window) => window,
        };
        let epoch = window.epoch(now_ns);
        // Taking the sample in gives what merging the slots again does, folded buckets included:
        // a fold only raises the lowest bucket kept, whichever sketch folds first.
        if from_cache && written.is_ok() && stats_epoch == Some(epoch) {
            sample.add_to(&mut entry.stats);
        } else {
            entry.stats = window.snapshot(now_ns);
        }
        (entry.written, entry.stats_epoch) = match written {
            Ok(w) => (Some(w), Some(epoch)),
            Err(_) => (None, None),
        };
        Ok(&entry.stats)
    }
}

/// [`cas_update`] of the shared window with `step`, which sees the stored bytes. A missing key is
/// created empty first (see [`ensure`] for why that should have happened already).
fn write<T>(store: &mut dyn SharedStore, key: &str, step: impl FnMut(Option<&[u8]>) -> Step<T, T>) -> Result<T, UpdateError> {
    match cas_update(store, key, step)? {
        Updated::Written(t) | Updated::Stopped(t) => Ok(t),
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
    record_uncached(store, key, config, now_ns, Sample::Finished { ttft_us, tpot_us, error })
}

/// [`RollingWindow::record_ttft`] into the shared window, with compare-and-swap as [`update`].
pub fn update_ttft(store: &mut dyn SharedStore, key: &str, config: &WindowConfig, now_ns: u64, ttft_us: u64) -> Result<RollingWindow, UpdateError> {
    record_uncached(store, key, config, now_ns, Sample::Ttft(ttft_us))
}

/// `sample` recorded into the shared window with [`cas_update`]: the window as written.
fn record_uncached(store: &mut dyn SharedStore, key: &str, config: &WindowConfig, now_ns: u64, sample: Sample) -> Result<RollingWindow, UpdateError> {
    write(store, key, |bytes| {
        let Some(bytes) = bytes else { return Step::Create(RollingWindow::new(*config).encode()) };
        let mut window = decode_or_fresh(Some(bytes), config);
        if sample.record(&mut window, now_ns) {
            Step::Write(window.encode(), window)
        } else {
            Step::Stop(window)
        }
    })
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
        cached_and_uncached_updates_agree(SketchParams::DEFAULT);
    }

    /// The same where almost every sketch folds its lowest buckets (16 buckets at 1 % span a
    /// ratio of 1.4, the values 2,000): a snapshot takes a sample in as a merge of the slots
    /// would fold it.
    #[test]
    fn a_cached_update_of_folding_sketches_sees_what_an_uncached_one_does() {
        cached_and_uncached_updates_agree(SketchParams::new(100, 16).unwrap());
    }

    fn cached_and_uncached_updates_agree(sketch: SketchParams) {
        let c = WindowConfig::new(6, 10 * S, sketch).unwrap();
        let other_geometry = WindowConfig::new(3, 10 * S, sketch).unwrap();
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
                    let seen = cache.update(&mut cached_store, "k", &config, now, Sample::Ttft(ttft)).unwrap().clone();
                    let plain = update_ttft(&mut plain_store, "k", &config, now, ttft).unwrap().snapshot(now);
                    assert_eq!(seen, plain, "step {step}");
                }
                _ => {
                    let error = draw(20) == 0;
                    let sample = Sample::Finished { ttft_us: Some(ttft), tpot_us: Some(tpot), error };
                    let seen = cache.update(&mut cached_store, "k", &config, now, sample).unwrap().clone();
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
