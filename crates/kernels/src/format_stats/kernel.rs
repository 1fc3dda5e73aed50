//! One read of a tensor, per-cube partial statistics.

use cubecl::prelude::*;

use crate::launch::{cube_max, cube_sum, flat_index};

/// `partials[CUBE_POS]` = `[amax, below normal, nonzero, not finite]` over this cube's share of
/// `x` (read as `launch::FlatRead` describes). Decided on the bits of the value cast to f32:
/// finite when the exponent is not all ones; the counts are kept in f32, exact below 2^24 per
/// cube.
#[cube(launch)]
pub(crate) fn format_stats_kernel<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    partials: &mut Array<f32>,
    total: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
    min_normal: f32,
    #[comptime] dense: bool,
    #[comptime] slots: usize,
    #[comptime] plane: bool,
    #[define(F)] _dtype: StorageType,
) {
    let step = CUBE_COUNT * CUBE_DIM as usize;
    let mut amax = 0.0f32;
    let mut below = 0.0f32;
    let mut nonzero = 0.0f32;
    let mut bad = 0.0f32;
    let mut i = ABSOLUTE_POS;
    while i < total {
        let v = Vector::<f32, N>::cast_from(x[flat_index(i, cols, row_stride, col_stride, dense)]);
        #[unroll]
        for l in 0..v.size() {
            let a = u32::reinterpret(v[l]) & 0x7FFF_FFFFu32;
            let finite = a < 0x7F80_0000u32;
            let m = f32::reinterpret(a);
            let nz = finite && a != 0u32;
            amax = select(finite, f32::max(amax, m), amax);
            nonzero += select(nz, 1.0f32, 0.0f32);
            below += select(nz && m < min_normal, 1.0f32, 0.0f32);
            bad += select(finite, 0.0f32, 1.0f32);
        }
        i += step;
    }
    let mut smem = SharedMemory::<f32>::new(slots);
    let amax = cube_max(amax, &mut smem, plane);
    let below = cube_sum(below, &mut smem, plane);
    let nonzero = cube_sum(nonzero, &mut smem, plane);
    let bad = cube_sum(bad, &mut smem, plane);
    if UNIT_POS == 0 {
        let row = CUBE_POS * 4;
        partials[row] = amax;
        partials[row + 1] = below;
        partials[row + 2] = nonzero;
        partials[row + 3] = bad;
    }
}
