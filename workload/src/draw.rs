//! Reproducible draws: each is a function of (seed, trace line) alone, so a request draws the same
//! user, tenant and upstream error whatever order requests run in, in the simulator and the
//! playground alike.

/// Mixed into the seed for the upstream's error draw, so that it is independent of the draw that
/// picks the tenant and user of the same line.
pub const ERROR_SALT: u64 = 0x5eed_e770;

/// SplitMix64 of (seed, n): a reproducible draw per request, whatever order requests run in.
pub fn mix(seed: u64, n: u64) -> u64 {
    let mut z = seed.wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15)).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A draw in [0, 1): the top 53 bits of `x`, every value an exact f64.
pub fn unit(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix_is_splitmix64() {
        // SplitMix64's reference outputs for the state 0 stepped once and twice (seed 0, n 0 and 1).
        assert_eq!(mix(0, 0), 0xe220_a839_7b1d_cdaf);
        assert_eq!(mix(0, 1), 0x6e78_9e6a_a1b9_65f4);
        // (seed, n) enters only as seed + n·γ: the same state, the same draw.
        assert_eq!(mix(0x9e37_79b9_7f4a_7c15, 0), mix(0, 1));
        assert_eq!(mix(7, 3), mix(7, 3));
        assert_ne!(mix(7, 3), mix(8, 3));
    }

    #[test]
    fn unit_keeps_the_top_53_bits() {
        assert_eq!(unit(0), 0.0);
        assert_eq!(unit(1 << 63), 0.5);
        assert_eq!(unit(3 << 62), 0.75);
        // The low 11 bits are dropped; the largest draw stays below 1.
        assert_eq!(unit((1 << 11) - 1), 0.0);
        assert_eq!(unit(u64::MAX), 1.0 - 1.0 / (1u64 << 53) as f64);
    }
}
