//! A bounded-memory quantile sketch with relative-error guarantees (DDSketch-style logarithmic
//! buckets), for latencies in microseconds.
//!
//! # Stated error
//!
//! With relative accuracy `α` (default 1 %, [`SketchParams::DEFAULT`]), for `n` added values and
//! `q ∈ [0, 1]`, let `v` be the exact value of rank `⌊q·(n−1)⌋` (0-based) in the sorted samples.
//! Then [`QuantileSketch::quantile`] returns `x` with
//!
//! ```text
//! |x − v| ≤ α·v + ½ µs
//! ```
//!
//! provided (1) `v ≤` [`MAX_VALUE_US`] (larger values are recorded as `MAX_VALUE_US`, one hour) and
//! (2) the sketch has not collapsed ([`QuantileSketch::collapsed`]), or `v` is above its lowest
//! bucket. The ½ µs is the rounding to a whole microsecond: for latencies of a millisecond or more
//! it adds at most 0.05 % to α. Merging sketches keeps the guarantee (buckets add exactly). Zero is
//! exact (its own bucket), and the smallest and largest values are kept exactly, so `q = 0` and
//! `q = 1` are exact.
//!
//! # How
//!
//! With `γ = (1+α)/(1−α)`, a value `v ≥ 1` goes to bucket `i = ⌈log_γ v⌉`, which holds
//! `(γ^(i−1), γ^i]`; the bucket's representative `2γ^i/(γ+1)` is within `α` of everything in it. One
//! hour at 1 % needs 1,093 buckets; a sketch holds at most `max_buckets` (default 1,024: a
//! 7.7 × 10⁸ ratio between the smallest and largest value kept distinct). When a value would need
//! more, the lowest buckets are folded into the lowest kept one — the low quantiles lose accuracy
//! (they can only be over-estimated, and never below the exact minimum), the high quantiles a
//! latency objective reads keep it. Memory is `8 × max_buckets` bytes at most; the encoding is
//! varints over the occupied range only (typically 100–600 bytes for a minute of TTFTs).

use super::codec::{put_varint, Reader};

/// Largest value the sketch distinguishes: one hour in microseconds. Larger values are recorded
/// as this value.
pub const MAX_VALUE_US: u64 = 3_600_000_000;

/// α used internally is this much smaller than the stated one, so that floating-point rounding at a
/// bucket boundary (≈ 10⁻¹³ relative) can never push a result past the stated `α`.
const ALPHA_MARGIN: f64 = 1e-6;

const FORMAT_VERSION: u8 = 1;
const FLAG_COLLAPSED: u8 = 1;

/// Accuracy and size of a sketch. Sketches merge only with sketches of the same parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SketchParams {
    accuracy_bp: u16,
    max_buckets: u16,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SketchError {
    #[error("relative accuracy must be {min}–{max} basis points, got {got}")]
    Accuracy { min: u16, max: u16, got: u16 },
    #[error("max buckets must be {min}–{max}, got {got}")]
    Buckets { min: u16, max: u16, got: u16 },
    #[error("sketches with different parameters cannot be merged ({0:?} vs {1:?})")]
    Incompatible(SketchParams, SketchParams),
}

impl SketchParams {
    /// 0.1 %.
    pub const MIN_ACCURACY_BP: u16 = 10;
    /// 10 %.
    pub const MAX_ACCURACY_BP: u16 = 1000;
    pub const MIN_BUCKETS: u16 = 16;
    pub const MAX_BUCKETS: u16 = 4096;
    /// α = 1 %, at most 1,024 buckets (8 KiB).
    pub const DEFAULT: SketchParams = SketchParams { accuracy_bp: 100, max_buckets: 1024 };

    /// `accuracy_bp`: α in basis points (100 = 1 %).
    pub fn new(accuracy_bp: u16, max_buckets: u16) -> Result<SketchParams, SketchError> {
        if !(Self::MIN_ACCURACY_BP..=Self::MAX_ACCURACY_BP).contains(&accuracy_bp) {
            return Err(SketchError::Accuracy { min: Self::MIN_ACCURACY_BP, max: Self::MAX_ACCURACY_BP, got: accuracy_bp });
        }
        if !(Self::MIN_BUCKETS..=Self::MAX_BUCKETS).contains(&max_buckets) {
            return Err(SketchError::Buckets { min: Self::MIN_BUCKETS, max: Self::MAX_BUCKETS, got: max_buckets });
        }
        Ok(SketchParams { accuracy_bp, max_buckets })
    }

    pub fn accuracy_bp(self) -> u16 {
        self.accuracy_bp
    }

    /// The stated α.
    pub fn relative_accuracy(self) -> f64 {
        f64::from(self.accuracy_bp) / 10_000.0
    }

    pub fn max_buckets(self) -> usize {
        usize::from(self.max_buckets)
    }

    fn ln_gamma(self) -> f64 {
        let a = self.relative_accuracy() * (1.0 - ALPHA_MARGIN);
        ((1.0 + a) / (1.0 - a)).ln()
    }
}

impl Default for SketchParams {
    fn default() -> Self {
        SketchParams::DEFAULT
    }
}

/// The sketch. See the module documentation for its error.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantileSketch {
    params: SketchParams,
    ln_gamma: f64,
    /// `2/(γ+1)`: bucket `i`'s representative is `γ^i × rep_factor`.
    rep_factor: f64,
    /// Index of the bucket of [`MAX_VALUE_US`].
    max_index: u32,
    count: u64,
    zeros: u64,
    min: u64,
    max: u64,
    /// Bucket index of `counts[0]`.
    offset: u32,
    /// Trimmed: empty, or first and last non-zero. At most `max_buckets` long.
    counts: Vec<u64>,
    collapsed: bool,
}

impl Default for QuantileSketch {
    fn default() -> Self {
        QuantileSketch::new(SketchParams::DEFAULT)
    }
}

impl QuantileSketch {
    pub fn new(params: SketchParams) -> QuantileSketch {
        let ln_gamma = params.ln_gamma();
        let gamma = ln_gamma.exp();
        let mut s = QuantileSketch {
            params,
            ln_gamma,
            rep_factor: 2.0 / (gamma + 1.0),
            max_index: 0,
            count: 0,
            zeros: 0,
            min: 0,
            max: 0,
            offset: 0,
            counts: Vec::new(),
            collapsed: false,
        };
        s.max_index = s.index(MAX_VALUE_US);
        s
    }

    /// An empty sketch of the same parameters, without recomputing its constants.
    pub fn empty_like(&self) -> QuantileSketch {
        QuantileSketch { count: 0, zeros: 0, min: 0, max: 0, offset: 0, counts: Vec::new(), collapsed: false, ..*self }
    }

    /// Bucket range in use, `(lowest, highest)` index.
    pub(crate) fn range(&self) -> Option<(u32, u32)> {
        (!self.counts.is_empty()).then(|| (self.offset, self.top()))
    }

    /// Makes room for buckets `lo..=hi` at once (before merging several sketches).
    pub(crate) fn reserve_range(&mut self, lo: u32, hi: u32) {
        let (lo, hi) = match self.range() {
            Some((a, b)) => (a.min(lo), b.max(hi)),
            None => (lo.min(hi), hi.max(lo)),
        };
        if self.range() != Some((lo, hi)) {
            self.reshape(lo, hi);
        }
    }

    pub fn params(&self) -> SketchParams {
        self.params
    }

    /// Number of values added (or merged in).
    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Exact smallest value (after capping at [`MAX_VALUE_US`]).
    pub fn min(&self) -> Option<u64> {
        (self.count > 0).then_some(self.min)
    }

    /// Exact largest value (after capping at [`MAX_VALUE_US`]).
    pub fn max(&self) -> Option<u64> {
        (self.count > 0).then_some(self.max)
    }

    /// Buckets in use (memory is 8 bytes each).
    pub fn bucket_count(&self) -> usize {
        self.counts.len()
    }

    /// Whether low buckets were folded together to stay within `max_buckets` (see the module doc).
    pub fn collapsed(&self) -> bool {
        self.collapsed
    }

    /// Bucket index of `v ≥ 1`: `⌈log_γ v⌉`, at most `max_index`.
    fn index(&self, v: u64) -> u32 {
        let i = ((v as f64).ln() / self.ln_gamma).ceil();
        // `as` saturates; v ≥ 1 so i ≥ 0.
        let i = i as u32;
        if self.max_index > 0 {
            i.min(self.max_index)
        } else {
            i
        }
    }

    fn representative(&self, index: u32) -> u64 {
        let r = (f64::from(index) * self.ln_gamma).exp() * self.rep_factor;
        r.round() as u64
    }

    /// Adds one value (µs).
    pub fn add(&mut self, value_us: u64) {
        self.add_n(value_us, 1);
    }

    /// Adds `n` copies of one value (µs).
    pub fn add_n(&mut self, value_us: u64, n: u64) {
        if n == 0 {
            return;
        }
        let v = value_us.min(MAX_VALUE_US);
        if self.count == 0 {
            self.min = v;
            self.max = v;
        } else {
            self.min = self.min.min(v);
            self.max = self.max.max(v);
        }
        self.count = self.count.saturating_add(n);
        if v == 0 {
            self.zeros = self.zeros.saturating_add(n);
            return;
        }
        let i = self.index(v);
        self.add_at(i, n);
    }

    fn add_at(&mut self, index: u32, n: u64) {
        let in_range = index >= self.offset && ((index - self.offset) as usize) < self.counts.len();
        if !in_range {
            let (lo, hi) = if self.counts.is_empty() {
                (index, index)
            } else {
                let hi = self.top();
                (self.offset.min(index), hi.max(index))
            };
            self.reshape(lo, hi);
        }
        let at = (index.max(self.offset) - self.offset) as usize;
        if let Some(c) = self.counts.get_mut(at) {
            *c = c.saturating_add(n);
        }
    }

    /// Highest bucket index in use (only meaningful when `counts` is not empty).
    fn top(&self) -> u32 {
        self.offset.saturating_add(self.counts.len().saturating_sub(1) as u32)
    }

    /// Makes the buckets cover `lo..=hi`, folding the lowest into the lowest kept when that span is
    /// more than `max_buckets`.
    fn reshape(&mut self, lo: u32, hi: u32) {
        let max = self.params.max_buckets() as u32;
        let lo = if hi - lo >= max {
            self.collapsed = true;
            hi + 1 - max
        } else {
            lo
        };
        let mut counts = vec![0u64; (hi - lo + 1) as usize];
        for (k, c) in self.counts.iter().enumerate() {
            let index = self.offset.saturating_add(k as u32);
            let at = (index.max(lo) - lo) as usize;
            if let Some(slot) = counts.get_mut(at) {
                *slot = slot.saturating_add(*c);
            }
        }
        self.offset = lo;
        self.counts = counts;
    }

    /// Adds every value of `other` (same parameters required).
    pub fn merge(&mut self, other: &QuantileSketch) -> Result<(), SketchError> {
        if other.params != self.params {
            return Err(SketchError::Incompatible(self.params, other.params));
        }
        if other.count == 0 {
            return Ok(());
        }
        if self.count == 0 {
            self.min = other.min;
            self.max = other.max;
        } else {
            self.min = self.min.min(other.min);
            self.max = self.max.max(other.max);
        }
        self.count = self.count.saturating_add(other.count);
        self.zeros = self.zeros.saturating_add(other.zeros);
        self.collapsed |= other.collapsed;
        if !other.counts.is_empty() {
            let (lo, hi) = if self.counts.is_empty() { (other.offset, other.top()) } else { (self.offset.min(other.offset), self.top().max(other.top())) };
            if lo < self.offset || hi > self.top() || self.counts.is_empty() {
                self.reshape(lo, hi);
            }
            for (k, c) in other.counts.iter().enumerate() {
                let index = other.offset.saturating_add(k as u32);
                let at = (index.max(self.offset) - self.offset) as usize;
                if let Some(slot) = self.counts.get_mut(at) {
                    *slot = slot.saturating_add(*c);
                }
            }
        }
        Ok(())
    }

    /// The value at quantile `q ∈ [0, 1]` (rank `⌊q·(n−1)⌋`), in µs; `None` when empty or `q` is
    /// outside `[0, 1]` (or NaN). Error: see the module documentation.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        if self.count == 0 || !(0.0..=1.0).contains(&q) {
            return None;
        }
        let rank = ((q * (self.count - 1) as f64).floor() as u64).min(self.count - 1);
        if rank == 0 {
            return Some(self.min);
        }
        if rank == self.count - 1 {
            return Some(self.max);
        }
        if rank < self.zeros {
            return Some(0);
        }
        let mut seen = self.zeros;
        for (k, c) in self.counts.iter().enumerate() {
            seen = seen.saturating_add(*c);
            if seen > rank {
                let rep = self.representative(self.offset.saturating_add(k as u32));
                return Some(rep.clamp(self.min, self.max));
            }
        }
        Some(self.max)
    }

    /// Compact versioned bytes: version, α (bp), max buckets, flags, then varints: zero count, min,
    /// max, first bucket index, bucket count, counts.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len_hint());
        self.encode_into(&mut out);
        out
    }

    /// About the encoded size (exact for counts below 16,384 a bucket).
    pub(crate) fn encoded_len_hint(&self) -> usize {
        24 + 2 * self.counts.len()
    }

    pub(crate) fn encode_into(&self, out: &mut Vec<u8>) {
        out.push(FORMAT_VERSION);
        out.extend_from_slice(&self.params.accuracy_bp.to_le_bytes());
        out.extend_from_slice(&self.params.max_buckets.to_le_bytes());
        out.push(if self.collapsed { FLAG_COLLAPSED } else { 0 });
        put_varint(out, self.zeros);
        put_varint(out, self.min);
        put_varint(out, self.max);
        put_varint(out, u64::from(self.offset));
        put_varint(out, self.counts.len() as u64);
        for c in &self.counts {
            put_varint(out, *c);
        }
    }

    /// `None` for bytes this version did not write or that are inconsistent.
    pub fn decode(bytes: &[u8]) -> Option<QuantileSketch> {
        let mut r = Reader::new(bytes);
        let s = Self::decode_from(&mut r, None)?;
        r.is_empty().then_some(s)
    }

    /// Decodes one sketch; `template` (an empty sketch) saves recomputing the constants when its
    /// parameters match.
    pub(crate) fn decode_from(r: &mut Reader<'_>, template: Option<&QuantileSketch>) -> Option<QuantileSketch> {
        if r.u8()? != FORMAT_VERSION {
            return None;
        }
        let params = SketchParams::new(r.u16_le()?, r.u16_le()?).ok()?;
        let flags = r.u8()?;
        if flags & !FLAG_COLLAPSED != 0 {
            return None;
        }
        let mut s = match template {
            Some(t) if t.params == params => t.empty_like(),
            _ => QuantileSketch::new(params),
        };
        s.collapsed = flags & FLAG_COLLAPSED != 0;
        s.zeros = r.varint()?;
        s.min = r.varint()?;
        s.max = r.varint()?;
        let offset = u32::try_from(r.varint()?).ok()?;
        let n = usize::try_from(r.varint()?).ok()?;
        if n > params.max_buckets() || s.min > s.max || s.max > MAX_VALUE_US {
            return None;
        }
        if n > 0 && u64::from(offset) + n as u64 - 1 > u64::from(s.max_index) {
            return None;
        }
        let mut counts = Vec::with_capacity(n);
        let mut total = s.zeros;
        for _ in 0..n {
            let c = r.varint()?;
            total = total.checked_add(c)?;
            counts.push(c);
        }
        // Canonical form: no empty buckets at either end.
        let first = counts.iter().position(|c| *c > 0);
        let last = counts.iter().rposition(|c| *c > 0);
        match (first, last) {
            (Some(first), Some(last)) => {
                s.offset = offset.checked_add(u32::try_from(first).ok()?)?;
                counts.truncate(last + 1);
                if first > 0 {
                    counts.drain(..first);
                }
                s.counts = counts;
            }
            _ => {
                s.offset = 0;
                s.counts = Vec::new();
            }
        }
        s.count = total;
        if total == 0 && (s.min != 0 || s.max != 0) {
            return None;
        }
        if s.zeros > 0 && s.min != 0 {
            return None;
        }
        Some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exact(sorted: &[u64], q: f64) -> u64 {
        sorted[((q * (sorted.len() - 1) as f64).floor()) as usize]
    }

    #[test]
    fn small_values_are_exact_and_extremes_are_kept() {
        let mut s = QuantileSketch::default();
        for v in 0..=40u64 {
            s.add(v);
        }
        let sorted: Vec<u64> = (0..=40).collect();
        for q in [0.0, 0.1, 0.25, 0.5, 0.9, 1.0] {
            assert_eq!(s.quantile(q), Some(exact(&sorted, q)), "q={q}");
        }
        assert_eq!(s.quantile(-0.1), None);
        assert_eq!(s.quantile(f64::NAN), None);
        assert_eq!(QuantileSketch::default().quantile(0.5), None);
    }

    #[test]
    fn values_above_an_hour_are_capped() {
        let mut s = QuantileSketch::default();
        s.add(u64::MAX);
        s.add(5_000_000_000);
        assert_eq!(s.quantile(1.0), Some(MAX_VALUE_US));
        assert_eq!(s.count(), 2);
        assert!(!s.collapsed());
    }

    #[test]
    fn a_full_sketch_collapses_its_lowest_buckets_and_keeps_high_quantiles() {
        let params = SketchParams::new(100, 64).unwrap();
        let mut s = QuantileSketch::new(params);
        let mut values = Vec::new();
        for k in 0..2000u64 {
            let v = 1 + k * k * 900; // 1 µs … 3.6 s
            values.push(v);
            s.add(v);
        }
        assert!(s.collapsed());
        assert!(s.bucket_count() <= 64);
        values.sort_unstable();
        let (x, v) = (s.quantile(0.95).unwrap() as f64, exact(&values, 0.95) as f64);
        assert!((x - v).abs() <= 0.01 * v + 0.5, "{x} vs {v}");
        // Low quantiles are over-estimated, never below the exact minimum.
        assert!(s.quantile(0.01).unwrap() >= exact(&values, 0.01));
        assert_eq!(s.quantile(0.0), Some(1));
    }

    #[test]
    fn encoding_round_trips_and_rejects_garbage() {
        let mut s = QuantileSketch::default();
        for v in [0, 1, 250_000, 251_000, 900_000] {
            s.add(v);
        }
        let bytes = s.encode();
        assert_eq!(QuantileSketch::decode(&bytes), Some(s.clone()));
        assert_eq!(QuantileSketch::decode(&QuantileSketch::default().encode()), Some(QuantileSketch::default()));
        assert_eq!(QuantileSketch::decode(b""), None);
        let mut bad = bytes.clone();
        bad[0] = 2;
        assert_eq!(QuantileSketch::decode(&bad), None);
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert_eq!(QuantileSketch::decode(&trailing), None);
        for cut in 0..bytes.len() {
            assert_eq!(QuantileSketch::decode(&bytes[..cut]), None, "cut at {cut}");
        }
    }

    #[test]
    fn merging_needs_equal_parameters() {
        let mut a = QuantileSketch::default();
        let b = QuantileSketch::new(SketchParams::new(200, 1024).unwrap());
        assert!(matches!(a.merge(&b), Err(SketchError::Incompatible(..))));
        assert!(SketchParams::new(5, 1024).is_err());
        assert!(SketchParams::new(100, 8).is_err());
    }
}
