//! The counter-based generator Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random
//! numbers: as easy as 1, 2, 3", SC 2011), on the host and inside kernels, and the 16-bit draws
//! the dropout masks compare with their threshold. A draw is a pure function of a 128-bit counter
//! and a 64-bit key, so a kernel's backward draws its forward's mask again instead of storing it.

use cubecl::prelude::*;

/// Philox4x32's round multipliers and Weyl key increments (Random123's constants).
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox4x32-10 of `counter` under `key`, on the host.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let [mut x0, mut x1, mut x2, mut x3] = counter;
    let [mut k0, mut k1] = key;
    for _ in 0..10 {
        let p0 = u64::from(M0) * u64::from(x0);
        let p1 = u64::from(M1) * u64::from(x2);
        (x0, x1, x2, x3) = (
            (p1 >> 32) as u32 ^ x1 ^ k0,
            p1 as u32,
            (p0 >> 32) as u32 ^ x3 ^ k1,
            p0 as u32,
        );
        k0 = k0.wrapping_add(W0);
        k1 = k1.wrapping_add(W1);
    }
    [x0, x1, x2, x3]
}

/// Philox4x32-10 of `(c0, c1, c2, c3)` under `(k0, k1)`: four words.
#[cube]
pub(crate) fn philox(c0: u32, c1: u32, c2: u32, c3: u32, k0: u32, k1: u32) -> Array<u32> {
    let mut x0 = c0;
    let mut x1 = c1;
    let mut x2 = c2;
    let mut x3 = c3;
    let mut key0 = k0;
    let mut key1 = k1;
    // The constants M0, M1, W0, W1 (literals: the kernel takes them as constants).
    let m0 = 0xD251_1F53u32;
    let m1 = 0xCD9E_8D57u32;
    #[unroll]
    for _ in 0..10u32 {
        let hi0 = x0.mul_hi(m0);
        let lo0 = x0 * m0;
        let hi1 = x2.mul_hi(m1);
        let lo1 = x2 * m1;
        x0 = hi1 ^ x1 ^ key0;
        x1 = lo1;
        x2 = hi0 ^ x3 ^ key1;
        x3 = lo0;
        key0 += 0x9E37_79B9u32;
        key1 += 0xBB67_AE85u32;
    }
    let mut out = Array::<u32>::new(4usize);
    out[0] = x0;
    out[1] = x1;
    out[2] = x2;
    out[3] = x3;
    out
}

/// A dropout mask's values inside a kernel, one launch argument: the seed as Philox's two key
/// words, the threshold a 16-bit draw must reach for its entry to be kept, and a kept entry's
/// factor. Built on the host by [`crate::dropout::DropArgs::scalars`]; whether dropout is on at
/// all is a separate compile-time argument of each kernel.
#[derive(CubeLaunch, CubeType, Clone, Copy)]
pub(crate) struct DropScalars {
    pub key0: u32,
    pub key1: u32,
    /// `round(p * 65536)`: draws below it are dropped.
    pub threshold: u32,
    /// `1 / keep probability`, the factor of a kept entry.
    pub keep_scale: f32,
}

/// The factor of a 16-bit draw: `drop.keep_scale` when kept (`draw >= drop.threshold`), else 0.
#[cube]
pub(crate) fn factor(draw: u32, drop: &DropScalars) -> f32 {
    let mut f = 0.0f32;
    if draw >= drop.threshold {
        f = drop.keep_scale;
    }
    f
}

/// The low (`high` false) or high 16 bits of `word`.
#[cube]
pub(crate) fn half_word(word: u32, high: bool) -> u32 {
    let mut r = word & 0xffffu32;
    if high {
        r = word >> 16u32;
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's published known-answer vectors (its `kat_vectors` file).
    #[test]
    fn philox_matches_known_answers() {
        assert_eq!(
            philox4x32_10([0, 0, 0, 0], [0, 0]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0]
            ),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }
}
