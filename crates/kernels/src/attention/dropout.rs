//! Dropout on the attention probabilities inside the FlashAttention kernels.
//!
//! Every probability's keep decision is a pure function of a 64-bit seed and its position
//! `(batch * heads index, query i, key j)`, drawn from the counter-based generator Philox4x32-10
//! (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC 2011). The
//! forward draws it where it computes the probabilities; the backward draws it again rather than
//! reading a stored mask, so dropout adds no `seq x seq` state and two runs with one seed drop the
//! same entries on any runtime.
//!
//! **Where each draw lives.** One Philox call gives four 32-bit words, eight 16-bit draws. They
//! serve the eight entries a tensor-core lane holds in a 16 x 16 tile of scores (the m16n8
//! accumulator layout: lane `4g + t` holds rows `g`, `g + 8` and columns `2t, 2t + 1` of each
//! 8-column half), so the forward makes one call per lane and tile. For entry `(i, j)`:
//!
//! - counter `(lane, j / 16, i / 16, bh)` with `lane = 4 (i % 8) + (j % 8) / 2`, key = the seed;
//! - word `2 ((i % 16) / 8) + (j % 16) / 8`, its low 16 bits for even `j`, high for odd `j`;
//! - kept when that draw `r` satisfies `r >= round(p * 65536)`; a kept probability is scaled by
//!   `65536 / (65536 - round(p * 65536))`, the inverse of the realised keep rate, so the output's
//!   expectation is the attention without dropout. `p` acts in steps of 1/65536.
//!
//! [`keep_mask`] computes the same function on the host, which the references and tests use.

use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::{Tensor, TensorData};
use cubecl::prelude::*;

/// Philox4x32's round multipliers and Weyl key increments (Random123's constants).
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Dropout inside [`crate::flash_attention_dropout`]: probability `p` of zeroing each attention
/// probability, and the seed of its mask. One seed gives one mask; give each layer, micro-batch
/// and step its own.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionDropout {
    /// In [0, 1); applied in steps of 1/65536.
    pub p: f64,
    pub seed: u64,
}

impl AttentionDropout {
    pub fn new(p: f64, seed: u64) -> Self {
        Self { p, seed }
    }

    /// Why `p` is unusable, if it is.
    pub(crate) fn problem(&self) -> Option<String> {
        (!(0.0..1.0).contains(&self.p))
            .then(|| format!("dropout p is {}; it must be in [0, 1)", self.p))
    }

    /// Draws (16-bit) below this are dropped: `round(p * 65536)`, at most 65535.
    pub fn threshold(&self) -> u32 {
        ((self.p * 65536.0).round() as u32).min(65535)
    }

    /// The probability that an entry is kept, `1 - threshold / 65536`.
    pub fn keep_probability(&self) -> f64 {
        (65536 - self.threshold()) as f64 / 65536.0
    }

    /// The factor of a kept entry, `1 / keep_probability`.
    pub fn keep_scale(&self) -> f32 {
        (65536.0 / (65536 - self.threshold()) as f64) as f32
    }

    /// Whether any entry can be dropped (`p` rounds to at least 1/65536).
    pub fn is_active(&self) -> bool {
        self.threshold() > 0
    }

    /// The seed as Philox's two key words.
    pub(crate) fn key(&self) -> (u32, u32) {
        (self.seed as u32, (self.seed >> 32) as u32)
    }
}

/// The kernels' dropout arguments: key words, threshold, keep scale; zeros when off.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DropArgs {
    pub on: bool,
    pub key0: u32,
    pub key1: u32,
    pub threshold: u32,
    pub scale: f32,
}

impl DropArgs {
    pub(crate) fn new(dropout: Option<AttentionDropout>) -> Self {
        match dropout.filter(AttentionDropout::is_active) {
            Some(d) => {
                let (key0, key1) = d.key();
                Self {
                    on: true,
                    key0,
                    key1,
                    threshold: d.threshold(),
                    scale: d.keep_scale(),
                }
            }
            None => Self {
                on: false,
                key0: 0,
                key1: 0,
                threshold: 0,
                scale: 1.0,
            },
        }
    }
}

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

/// The 16-bit draw of entry `(bh, i, j)` (see the module documentation), on the host.
pub fn draw(seed: u64, bh: usize, i: usize, j: usize) -> u32 {
    let lane = (i % 8) * 4 + (j % 8) / 2;
    let words = philox4x32_10(
        [lane as u32, (j / 16) as u32, (i / 16) as u32, bh as u32],
        [seed as u32, (seed >> 32) as u32],
    );
    let word = words[((i % 16) / 8) * 2 + (j % 16) / 8];
    if j.is_multiple_of(2) {
        word & 0xffff
    } else {
        word >> 16
    }
}

/// The dropout factors of `[batch, heads, seq_q, seq_k]` attention probabilities, computed on the
/// host: 0 where an entry is dropped, [`AttentionDropout::keep_scale`] where it is kept. What the
/// kernels apply, for references and tests (it materialises the `seq_q x seq_k` mask).
pub fn keep_mask<B: BurnBackend>(
    dropout: AttentionDropout,
    shape: [usize; 4],
    device: &B::Device,
) -> Tensor<B, 4> {
    let [batch, heads, sq, sk] = shape;
    let (threshold, scale) = (dropout.threshold(), dropout.keep_scale());
    let mut values = Vec::with_capacity(batch * heads * sq * sk);
    for bh in 0..batch * heads {
        for i in 0..sq {
            for j in 0..sk {
                let kept = draw(dropout.seed, bh, i, j) >= threshold;
                values.push(if kept { scale } else { 0.0 });
            }
        }
    }
    Tensor::from_data(TensorData::new(values, shape), device)
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

/// The factor of a 16-bit draw: `scale` when kept (`draw >= threshold`), else 0.
#[cube]
pub(crate) fn factor(draw: u32, threshold: u32, scale: f32) -> f32 {
    let mut f = 0.0f32;
    if draw >= threshold {
        f = scale;
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

/// The dropout factor of entry `(bh, i, j)` with one Philox call of its own (the portable
/// kernels; the tensor-core kernels share a call between a lane's entries of a tile).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn entry_factor(
    bh: usize,
    i: usize,
    j: usize,
    key0: u32,
    key1: u32,
    threshold: u32,
    scale: f32,
) -> f32 {
    let lane = u32::cast_from((i % 8) * 4 + (j % 8) / 2);
    let w = philox(
        lane,
        u32::cast_from(j / 16),
        u32::cast_from(i / 16),
        u32::cast_from(bh),
        key0,
        key1,
    );
    let at = ((i % 16) / 8) * 2 + (j % 16) / 8;
    // Picked by comparisons: a runtime index into a local array is slow on some runtimes.
    let mut word = w[0];
    if at == 1 {
        word = w[1];
    }
    if at == 2 {
        word = w[2];
    }
    if at == 3 {
        word = w[3];
    }
    factor(half_word(word, j % 2 == 1), threshold, scale)
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

    #[test]
    fn threshold_and_scale_follow_p() {
        let d = AttentionDropout::new(0.2, 7);
        assert_eq!(d.threshold(), 13107);
        assert!((d.keep_probability() - 0.8).abs() < 1e-5);
        assert!((d.keep_scale() as f64 * d.keep_probability() - 1.0).abs() < 1e-6);
        assert!(!AttentionDropout::new(0.0, 7).is_active());
        assert!(!AttentionDropout::new(1e-6, 7).is_active());
        assert_eq!(AttentionDropout::new(0.9999999, 7).threshold(), 65535);
        for bad in [-0.1, 1.0, 1.5, f64::NAN] {
            assert!(AttentionDropout::new(bad, 7).problem().is_some(), "{bad}");
        }
        assert!(AttentionDropout::new(0.5, 7).problem().is_none());
    }

    /// Every 16-bit draw of a region is used once: the eight draws of a Philox call go to eight
    /// distinct entries, and no two entries share a (counter, word, half).
    #[test]
    fn entries_map_to_distinct_draws() {
        let mut seen = std::collections::HashSet::new();
        for i in 0..48 {
            for j in 0..48 {
                let lane = (i % 8) * 4 + (j % 8) / 2;
                let word = ((i % 16) / 8) * 2 + (j % 16) / 8;
                assert!(
                    seen.insert((lane, j / 16, i / 16, word, j % 2)),
                    "({i}, {j})"
                );
            }
        }
    }

    /// The keep rate is within 5 standard deviations of `1 - p` over whole masks and along single
    /// rows and columns, for several `p`; neighbouring entries, heads and seeds are uncorrelated.
    #[test]
    fn masks_have_the_expected_statistics() {
        let (sq, sk, heads) = (256usize, 256usize, 4usize);
        for p in [0.1, 0.2, 0.5, 0.9] {
            let d = AttentionDropout::new(p, 0x5eed_0000_0000_0001 + (p * 100.0) as u64);
            let t = d.threshold();
            let kept: Vec<bool> = (0..heads)
                .flat_map(|bh| {
                    (0..sq).flat_map(move |i| (0..sk).map(move |j| draw(d.seed, bh, i, j) >= t))
                })
                .collect();
            let q = d.keep_probability();
            let within = |hits: usize, n: usize, what: &str| {
                let mean = n as f64 * q;
                let sd = (n as f64 * q * (1.0 - q)).sqrt();
                assert!(
                    (hits as f64 - mean).abs() <= 5.0 * sd,
                    "p {p}, {what}: {hits} kept of {n}, expected {mean:.0} +- {sd:.0}"
                );
            };
            within(
                kept.iter().filter(|&&k| k).count(),
                kept.len(),
                "whole mask",
            );
            for i in [0, 7, 8, 15, 100] {
                let row = &kept[i * sk..(i + 1) * sk];
                within(row.iter().filter(|&&k| k).count(), sk, &format!("row {i}"));
            }
            for j in [0, 1, 9, 200] {
                let n = (0..sq).filter(|&i| kept[i * sk + j]).count();
                within(n, sq, &format!("column {j}"));
            }
            // Pairs (entry, right neighbour), (entry, entry 8 rows down), (head 0, head 1) and
            // (seed, seed + 1): both kept about q^2 of the time.
            let other = AttentionDropout::new(p, d.seed + 1);
            let pair = |a: &dyn Fn(usize, usize) -> bool, b: &dyn Fn(usize, usize) -> bool| {
                let (mut both, mut n) = (0usize, 0usize);
                for i in 0..sq - 8 {
                    for j in 0..sk - 1 {
                        both += (a(i, j) && b(i, j)) as usize;
                        n += 1;
                    }
                }
                (both, n)
            };
            let k0 = |i: usize, j: usize| kept[i * sk + j];
            let cases: [(&str, (usize, usize)); 4] = [
                ("right", pair(&k0, &|i, j| kept[i * sk + j + 1])),
                ("down 8", pair(&k0, &|i, j| kept[(i + 8) * sk + j])),
                ("next head", pair(&k0, &|i, j| kept[sq * sk + i * sk + j])),
                (
                    "next seed",
                    pair(&k0, &|i, j| draw(other.seed, 0, i, j) >= t),
                ),
            ];
            for (what, (both, n)) in cases {
                let (mean, var) = (n as f64 * q * q, n as f64 * q * q * (1.0 - q * q));
                assert!(
                    (both as f64 - mean).abs() <= 5.0 * var.sqrt(),
                    "p {p}, {what}: both kept {both} of {n}, expected {mean:.0}"
                );
            }
        }
    }
}
