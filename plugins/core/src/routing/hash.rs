//! The fixed hashes behind sticky assignment and shadow sampling.
//!
//! Everything here is a pure function of its input bytes: no per-process seed, no randomness, no
//! libm. Two Envoy replicas, a restarted process, the wasm build and a native test therefore assign
//! the same key to the same version, bit for bit.
//!
//! - Key hash of a version: 64-bit FNV-1a over `key ‖ 0x00 ‖ version name`, finalised with
//!   SplitMix64 ([`splitmix64`]) so that keys differing in one byte spread over all 64 bits.
//! - That hash becomes `u ∈ (0, 1)`: `u = (⌊h / 2¹²⌋ + ½) / 2⁵²` ([`unit_open`]), never 0 or 1
//!   (52 bits, so that `+ ½` stays exact in an `f64`: `u ∈ [2⁻⁵³, 1 − 2⁻⁵³]`).
//! - Weighted rendezvous (highest random weight) score: `w / −ln(u)` ([`score`]). For independent
//!   uniform `u`, `−ln(u)/w` is exponential with rate `w`, so the version with the largest score (the
//!   smallest exponential) wins with probability `w / Σw`. Raising one weight only raises that
//!   version's scores, so keys only move *to* it; lowering one only moves keys *from* it.
//! - `ln` is computed here with IEEE-754 basic operations only ([`ln`]), which Rust never fuses or
//!   reorders, so the result does not depend on the platform's libm.
//! - Shadow sampling hashes the request id with a different separator byte (`0xFF`, which never
//!   appears in a version name) and samples when `⌊h / 2¹¹⌋ / 2⁵³ < fraction`.

/// FNV-1a 64-bit offset basis.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV-1a 64-bit prime.
pub const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// Incremental 64-bit FNV-1a. `Copy`, so a prefix (the sticky key) is hashed once and continued
/// for each version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Self::new()
    }
}

impl Fnv1a {
    pub const fn new() -> Self {
        Self(FNV_OFFSET)
    }

    /// The state after also hashing `bytes`.
    #[must_use]
    pub fn write(self, bytes: &[u8]) -> Self {
        let mut h = self.0;
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(FNV_PRIME);
        }
        Self(h)
    }

    pub fn finish(self) -> u64 {
        self.0
    }
}

/// SplitMix64 output function (Steele, Lea & Flood 2014): add the golden gamma, then the
/// xor-shift-multiply mix. A bijection on `u64`.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Hash of (`key`, `version`): SplitMix64 of FNV-1a over `key ‖ 0x00 ‖ version`.
pub fn key_version_hash(key: &[u8], version: &str) -> u64 {
    version_hash(Fnv1a::new().write(key), version)
}

/// [`key_version_hash`] continued from the FNV state of the key.
pub fn version_hash(key_state: Fnv1a, version: &str) -> u64 {
    splitmix64(key_state.write(&[0]).write(version.as_bytes()).finish())
}

/// Hash of a request id for shadow sampling: SplitMix64 of FNV-1a over `id ‖ 0xFF ‖ "shadow"`.
pub fn shadow_hash(request_id: &[u8]) -> u64 {
    splitmix64(Fnv1a::new().write(request_id).write(&[0xff]).write(b"shadow").finish())
}

/// 2⁻⁵³.
const TWO_POW_M53: f64 = 1.0 / 9_007_199_254_740_992.0;
/// 2⁻⁵².
const TWO_POW_M52: f64 = 1.0 / 4_503_599_627_370_496.0;

/// `u ∈ (0, 1)` from the top 52 bits of `h`: `(⌊h / 2¹²⌋ + ½) / 2⁵²`, exact, in
/// `[2⁻⁵³, 1 − 2⁻⁵³]`: never 0, never 1. (With 53 bits, `2⁵³ − ½` would round up to `2⁵³`, u = 1.)
pub fn unit_open(h: u64) -> f64 {
    ((h >> 12) as f64 + 0.5) * TWO_POW_M52
}

/// `u ∈ [0, 1)` from the top 53 bits of `h`: `⌊h / 2¹¹⌋ / 2⁵³`.
pub fn unit_closed_open(h: u64) -> f64 {
    (h >> 11) as f64 * TWO_POW_M53
}

/// Natural logarithm of a positive, finite, normal `x`, from IEEE basic operations only.
///
/// `x = m·2ᵉ` with `m ∈ (√½, √2]`; `ln m = 2·atanh(s)`, `s = (m−1)/(m+1)`, `|s| < 0.172`, summed to
/// the `s²³` term (remainder below 2⁻⁵⁵ relative). Not a general-purpose `ln`: non-positive,
/// subnormal, infinite or NaN inputs return NaN (callers here only pass [`unit_open`] values).
pub fn ln(x: f64) -> f64 {
    if !(x.is_normal() && x > 0.0) {
        return f64::NAN;
    }
    let bits = x.to_bits();
    let biased = ((bits >> 52) & 0x7ff) as i32;
    let mut e = biased - 1023;
    let mut m = f64::from_bits((bits & 0x000f_ffff_ffff_ffff) | 0x3ff0_0000_0000_0000);
    if m > std::f64::consts::SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    // Horner from the highest odd term down: s·(1 + s²/3 + s⁴/5 + … + s²²/23).
    let mut acc = 0.0;
    let mut k = 23.0;
    while k > 1.0 {
        acc = (acc + 1.0 / k) * s2;
        k -= 2.0;
    }
    2.0 * s * (1.0 + acc) + f64::from(e) * std::f64::consts::LN_2
}

/// Rendezvous score of a version of weight `weight` whose hash with the key is `h`: `w / −ln(u)`.
/// Weight 0 scores 0 (and callers never pick it). Always finite and non-negative.
pub fn score(weight: u64, h: u64) -> f64 {
    if weight == 0 {
        return 0.0;
    }
    let denom = -ln(unit_open(h));
    // u ≤ 1 − 2⁻⁵³, so −ln(u) ≥ 1.1e−16 > 0; the guard only matters if that reasoning breaks.
    if denom.is_nan() || denom <= 0.0 {
        return 0.0;
    }
    weight as f64 / denom
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_known_vectors() {
        assert_eq!(Fnv1a::new().finish(), 0xcbf2_9ce4_8422_2325);
        assert_eq!(Fnv1a::new().write(b"a").finish(), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(Fnv1a::new().write(b"foobar").finish(), 0x8594_4171_f739_67e8);
        // Incremental equals one-shot.
        assert_eq!(Fnv1a::new().write(b"foo").write(b"bar"), Fnv1a::new().write(b"foobar"));
    }

    #[test]
    fn splitmix64_known_vectors() {
        // First outputs of the SplitMix64 generator seeded with 0 (state advances by the gamma).
        assert_eq!(splitmix64(0), 0xe220_a839_7b1d_cdaf);
        assert_eq!(splitmix64(0x9e37_79b9_7f4a_7c15), 0x6e78_9e6a_a1b9_65f4);
    }

    #[test]
    fn key_version_hash_is_pinned() {
        // Pinned so that a change of the hash (which would reshuffle every user) fails a test.
        let h = key_version_hash(b"tenant-acme", "v2");
        let expected = splitmix64(Fnv1a::new().write(b"tenant-acme\0v2").finish());
        assert_eq!(h, expected);
        assert_eq!(version_hash(Fnv1a::new().write(b"tenant-acme"), "v2"), h);
    }

    #[test]
    fn unit_open_never_reaches_the_ends() {
        assert_eq!(unit_open(0), TWO_POW_M53);
        assert_eq!(unit_open(u64::MAX), 1.0 - TWO_POW_M53);
        for h in [0, 1, 2047, 2048, 4095, 4096, u64::MAX - 4096, u64::MAX - 1, u64::MAX] {
            let u = unit_open(h);
            assert!(u > 0.0 && u < 1.0, "{h} → {u}");
            assert!(score(1, h).is_finite() && score(1, h) > 0.0);
            assert!(score(1_000_000, h).is_finite());
        }
        assert_eq!(unit_closed_open(0), 0.0);
        assert!(unit_closed_open(u64::MAX) < 1.0);
    }

    #[test]
    fn ln_matches_std_closely() {
        let mut h = 1u64;
        for _ in 0..100_000 {
            h = splitmix64(h);
            let u = unit_open(h);
            let (ours, std) = (ln(u), u.ln());
            assert!((ours - std).abs() <= 4.0 * f64::EPSILON * std.abs().max(1e-300), "{u}: {ours} vs {std}");
        }
        for x in [unit_open(0), unit_open(u64::MAX), 0.5, 1.0, 2.0, 1e-300, 1e300, std::f64::consts::E] {
            let (ours, std) = (ln(x), x.ln());
            assert!((ours - std).abs() <= 4.0 * f64::EPSILON * std.abs().max(1.0), "{x}: {ours} vs {std}");
        }
        assert_eq!(ln(1.0), 0.0);
        assert!(ln(0.0).is_nan() && ln(-1.0).is_nan() && ln(f64::NAN).is_nan() && ln(f64::INFINITY).is_nan());
    }
}
