//! The seeds of the dropout masks that the kernels draw: one per training forward, from the
//! step's seed and the count of forwards, so that a run (or a recomputed block) draws the same
//! masks again from the same seed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// SplitMix64's finaliser: a bijective mix of the 64 bits.
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Seeds of the dropout masks drawn inside the kernels (with `model.dropout > 0`: FlashAttention's,
/// and with the fused ops and flash attention the embedding's and residual branches'): forward
/// number `n` since [`Gpt::set_dropout_seed`] draws its masks from `(seed, n, layer)`, so the masks
/// of a step repeat when its seed and forwards do. Clones share the count.
#[derive(Clone, Debug, Default)]
pub struct DropoutSeeds {
    seed: u64,
    forwards: Arc<AtomicU64>,
}

impl DropoutSeeds {
    pub(crate) fn new(seed: u64) -> Self {
        Self {
            seed,
            forwards: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The seed of the next forward's masks.
    pub(crate) fn next_forward(&self) -> u64 {
        let n = self.forwards.fetch_add(1, Ordering::Relaxed);
        mix64(self.seed ^ mix64(n))
    }
}
