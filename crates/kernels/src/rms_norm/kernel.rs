//! RMSNorm kernels: the forward holds each row in registers so that `x` is read once, the backward
//! reads its row twice (the second time from cache); statistics, gain and gradients in f32 whatever
//! the storage dtypes. A row belongs either to one plane (`row_plane`:
//! the cube is `(plane size, rows per cube)`, a row's sums are one `plane_sum`, several rows per
//! cube keep many loads in flight) or to a whole one-dimensional cube (long rows: the sums go
//! through shared memory). Either way the rows are walked grid-stride.

use cubecl::prelude::*;

use crate::launch::{cube_sum, lanes_sum};

/// `y = x * rstd * w` with `rstd = 1 / sqrt(mean(x^2) + eps)` per row. With `residual`, the
/// normalised row is `s = x + r` (rounded to `F`, as the residual stream stores it), written to
/// `sum`; otherwise `r` and `sum` are not touched.
#[cube(launch)]
pub(crate) fn rms_norm_fwd<F: Float, W: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    r: &Array<Vector<F, N>>,
    w: &Array<Vector<W, N>>,
    y: &mut Array<Vector<F, N>>,
    sum: &mut Array<Vector<F, N>>,
    rstd: &mut Array<f32>,
    rows: usize,
    row_vecs: usize,
    eps: f32,
    #[comptime] per_unit: usize,
    #[comptime] slots: usize,
    #[comptime] residual: bool,
    #[comptime] plane: bool,
    #[comptime] row_plane: bool,
    #[define(F, W)] _dtypes: [StorageType; 2],
) {
    let unit = UNIT_POS_X as usize;
    let units = CUBE_DIM_X as usize;
    let mut smem = SharedMemory::<f32>::new(slots);
    let mut regs = Array::<Vector<f32, N>>::new(per_unit);
    let cols = (row_vecs * x.vector_size()) as f32;
    let mut row = CUBE_POS * CUBE_DIM_Y as usize + UNIT_POS_Y as usize;
    while row < rows {
        let base = row * row_vecs;
        let mut sq = 0.0f32;
        #[unroll]
        for i in 0..per_unit {
            let c = unit + i * units;
            let mut v = Vector::<f32, N>::new(0.0);
            if c < row_vecs {
                v = Vector::cast_from(x[base + c]);
                if comptime!(residual) {
                    let s = Vector::<F, N>::cast_from(v + Vector::cast_from(r[base + c]));
                    sum[base + c] = s;
                    v = Vector::cast_from(s);
                }
            }
            regs[i] = v;
            sq += lanes_sum(v * v);
        }
        let total = if comptime!(row_plane) {
            plane_sum(sq)
        } else {
            cube_sum(sq, &mut smem, plane)
        };
        let inv = f32::inverse_sqrt(total / cols + eps);
        if unit == 0 {
            rstd[row] = inv;
        }
        #[unroll]
        for i in 0..per_unit {
            let c = unit + i * units;
            if c < row_vecs {
                let g = Vector::<f32, N>::cast_from(w[c]);
                y[base + c] = Vector::cast_from(regs[i] * g * Vector::new(inv));
            }
        }
        row += CUBE_COUNT * CUBE_DIM_Y as usize;
    }
}

/// Gradients of `y = x * rstd * w` for the rows of one walker (a cube, or a plane of one with
/// `row_plane`; walker `j` takes rows `j, j + walkers, ...`):
/// `dx = rstd * (g - x * rstd^2 * mean(g * x))` with `g = dy * w`, in `F`; the cube's share of
/// `dw = sum_rows dy * x * rstd` goes, in f32, to row `CUBE_POS` of `dw_part` [cubes, cols].
/// With `add_res`, `dres` (another gradient of `x`, from its other consumers) is added to `dx` in
/// f32 before the one rounding to `F`; otherwise `dres` is never read.
/// The second pass reads the row again (the first brought it into cache) rather than keeping it,
/// and with `row_plane` each unit keeps its weight-gradient sums in shared memory (`dw_slots`
/// vectors, which then sum the planes' shares) rather than in registers: registers bound how many
/// of these cubes an SM holds, and a unit's sums would take 24 of them at width 768. One-row cubes
/// keep the sums in registers (their rows may be too long for shared memory).
#[cube(launch)]
pub(crate) fn rms_norm_bwd<F: Float, W: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    w: &Array<Vector<W, N>>,
    rstd: &Array<f32>,
    dy: &Array<Vector<F, N>>,
    dres: &Array<Vector<F, N>>,
    dx: &mut Array<Vector<F, N>>,
    dw_part: &mut Array<Vector<f32, N>>,
    rows: usize,
    row_vecs: usize,
    #[comptime] per_unit: usize,
    #[comptime] slots: usize,
    #[comptime] plane: bool,
    #[comptime] row_plane: bool,
    #[comptime] dw_slots: usize,
    #[comptime] add_res: bool,
    #[define(F, W)] _dtypes: [StorageType; 2],
) {
    let unit = UNIT_POS_X as usize;
    let units = CUBE_DIM_X as usize;
    let y = UNIT_POS_Y as usize;
    let mut smem = SharedMemory::<f32>::new(slots);
    // The weight-gradient sums of this unit's columns: with `row_plane` in shared memory, slot
    // `mine + i * units`; otherwise in registers, `regs[i]`. The other array is declared with one
    // element and never used.
    let mut shared = SharedMemory::<Vector<f32, N>>::new(dw_slots);
    let mut regs = Array::<Vector<f32, N>>::new(comptime!(if row_plane { 1 } else { per_unit }));
    let mine = y * per_unit * units + unit;
    #[unroll]
    for i in 0..per_unit {
        if comptime!(row_plane) {
            shared[mine + i * units] = Vector::new(0.0);
        } else {
            regs[i] = Vector::new(0.0);
        }
    }
    let cols = (row_vecs * x.vector_size()) as f32;
    let walker = CUBE_POS * CUBE_DIM_Y as usize + y;
    let mut row = walker;
    while row < rows {
        let base = row * row_vecs;
        let inv = rstd[row];
        let mut dot = 0.0f32;
        #[unroll]
        for i in 0..per_unit {
            let c = unit + i * units;
            if c < row_vecs {
                let xv = Vector::<f32, N>::cast_from(x[base + c]);
                let d = Vector::<f32, N>::cast_from(dy[base + c]);
                let part = d * xv * Vector::new(inv);
                if comptime!(row_plane) {
                    shared[mine + i * units] += part;
                } else {
                    regs[i] += part;
                }
                dot += lanes_sum(d * Vector::cast_from(w[c]) * xv);
            }
        }
        let total = if comptime!(row_plane) {
            plane_sum(dot)
        } else {
            cube_sum(dot, &mut smem, plane)
        };
        let k = inv * inv * inv * total / cols;
        // Not unrolled: unrolled, the compiler loads every vector of the row's x, dy, dres and w at
        // once (80 registers a unit at width 768 in bf16, six of these cubes an SM); rolled, 40
        // (twelve cubes an SM).
        for i in 0..per_unit {
            let c = unit + i * units;
            if c < row_vecs {
                let xv = Vector::<f32, N>::cast_from(x[base + c]);
                let gv = Vector::<f32, N>::cast_from(dy[base + c]) * Vector::cast_from(w[c]);
                let mut d = gv * Vector::new(inv) - xv * Vector::new(k);
                if comptime!(add_res) {
                    d += Vector::<f32, N>::cast_from(dres[base + c]);
                }
                dx[base + c] = Vector::cast_from(d);
            }
        }
        row += CUBE_COUNT * CUBE_DIM_Y as usize;
    }
    let out = CUBE_POS * row_vecs;
    if comptime!(row_plane) {
        // Each plane's share is at [plane][i][lane]; the cube's units sum over the planes.
        sync_cube();
        let planes = CUBE_DIM_Y as usize;
        let mut j = y * units + unit;
        while j < per_unit * units {
            // j = i * units + lane is column c = lane + i * units: the same index.
            let c = j;
            if c < row_vecs {
                let mut acc = Vector::<f32, N>::new(0.0);
                for p in 0..planes {
                    acc += shared[p * per_unit * units + j];
                }
                dw_part[out + c] = acc;
            }
            j += planes * units;
        }
    } else {
        #[unroll]
        for i in 0..per_unit {
            let c = unit + i * units;
            if c < row_vecs {
                dw_part[out + c] = regs[i];
            }
        }
    }
}
