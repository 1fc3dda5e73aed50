//! Multi-buffered `cp.async` staging shared by the tensor-core kernels (attention, FP8 GEMM):
//! two or three shared barriers, buffer `i % stages` filled by block `i`'s copies.

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

/// [`commit`] over a ring of three barriers: `which` is 0, 1 or 2.
#[cube]
pub(crate) fn commit_ring(
    bar0: &Shared<Barrier>,
    bar1: &Shared<Barrier>,
    bar2: &Shared<Barrier>,
    which: usize,
) {
    if which == 2 {
        bar2.commit_copy_async();
        let _token = bar2.arrive();
    } else {
        commit(bar0, bar1, which);
    }
}

/// Waits for the copies of block `index` in a ring of `stages` (2 or 3) buffers, committed to
/// barrier `index % stages`: its `(index / stages)`-th phase. With 2 stages `bar2` is unused.
#[cube]
pub(crate) fn wait_ring(
    bar0: &Shared<Barrier>,
    bar1: &Shared<Barrier>,
    bar2: &Shared<Barrier>,
    index: usize,
    #[comptime] stages: usize,
) {
    if comptime!(stages == 2) {
        wait_block(bar0, bar1, index);
    } else {
        let parity = ((index / stages) % 2) as u32;
        let which = index % stages;
        if which == 0 {
            bar0.wait_parity(parity);
        } else if which == 1 {
            bar1.wait_parity(parity);
        } else {
            bar2.wait_parity(parity);
        }
    }
}
