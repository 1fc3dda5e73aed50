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

use crate::dropout::Dropout;
pub use crate::philox::philox4x32_10;
use crate::philox::{factor, half_word, philox, DropScalars};

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
/// host: 0 where an entry is dropped, [`Dropout::keep_scale`] where it is kept. What the
/// kernels apply, for references and tests (it materialises the `seq_q x seq_k` mask).
pub fn keep_mask<B: BurnBackend>(
    dropout: Dropout,
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

/// The dropout factor of entry `(bh, i, j)` with one Philox call of its own (the portable
/// kernels; the tensor-core kernels share a call between a lane's entries of a tile).
#[cube]
pub(crate) fn entry_factor(bh: usize, i: usize, j: usize, drop: &DropScalars) -> f32 {
    let lane = u32::cast_from((i % 8) * 4 + (j % 8) / 2);
    let w = philox(
        lane,
        u32::cast_from(j / 16),
        u32::cast_from(i / 16),
        u32::cast_from(bh),
        drop.key0,
        drop.key1,
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
    factor(half_word(word, j % 2 == 1), drop)
}

#[cfg(test)]
mod tests {
    use super::*;

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
            let d = Dropout::new(p, 0x5eed_0000_0000_0001 + (p * 100.0) as u64);
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
            let other = Dropout::new(p, d.seed + 1);
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
