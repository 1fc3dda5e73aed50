//! Double-buffered `cp.async` staging shared by the tensor-core kernels (attention, FP8 GEMM):
//! two shared barriers, buffer `i % 2` filled by block `i`'s copies.

// `#[cube]` code: CubeCL expands plain comparisons and arithmetic, not the std helpers clippy
// suggests (`is_multiple_of`, `clamp`, `RangeInclusive::contains`).
#![allow(
    clippy::manual_is_multiple_of,
    clippy::manual_clamp,
    clippy::manual_range_contains
)]

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

/// Makes this unit's pending copies and stores count towards barrier `which` (0 or 1) of the
/// pair, and arrives on it: its phase completes when every unit has arrived and every copy landed.
#[cube]
pub(crate) fn commit(bar0: &Shared<Barrier>, bar1: &Shared<Barrier>, which: usize) {
    if which == 0 {
        bar0.commit_copy_async();
        let _token = bar0.arrive();
    } else {
        bar1.commit_copy_async();
        let _token = bar1.arrive();
    }
}

/// Waits for the copies of block `index`, committed to barrier `index % 2`: its
/// `(index / 2)`-th phase.
#[cube]
pub(crate) fn wait_block(bar0: &Shared<Barrier>, bar1: &Shared<Barrier>, index: usize) {
    let parity = ((index / 2) % 2) as u32;
    if index % 2 == 0 {
        bar0.wait_parity(parity);
    } else {
        bar1.wait_parity(parity);
    }
}
