//! `cp.async` staging shared by the tensor-core kernels (attention, FP8 GEMM): double-buffered
//! with two shared barriers (buffer `i % 2` filled by block `i`'s copies), or triple-buffered with
//! three (buffer `i % 3`) where a kernel works on one block while the next two load.

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

/// Three-stage variant of [`commit`]: barrier `which` (0, 1 or 2) of the triple, for pipelines
/// that keep two blocks in flight while a third is used.
#[cube]
pub(crate) fn commit3(
    bar0: &Shared<Barrier>,
    bar1: &Shared<Barrier>,
    bar2: &Shared<Barrier>,
    which: usize,
) {
    if which == 0 {
        bar0.commit_copy_async();
        let _token = bar0.arrive();
    } else if which == 1 {
        bar1.commit_copy_async();
        let _token = bar1.arrive();
    } else {
        bar2.commit_copy_async();
        let _token = bar2.arrive();
    }
}

/// Three-stage variant of [`wait_block`]: block `index` was committed to barrier `index % 3`,
/// whose `(index / 3)`-th phase it completes.
#[cube]
pub(crate) fn wait_block3(
    bar0: &Shared<Barrier>,
    bar1: &Shared<Barrier>,
    bar2: &Shared<Barrier>,
    index: usize,
) {
    let parity = ((index / 3) % 2) as u32;
    let which = index % 3;
    if which == 0 {
        bar0.wait_parity(parity);
    } else if which == 1 {
        bar1.wait_parity(parity);
    } else {
        bar2.wait_parity(parity);
    }
}
