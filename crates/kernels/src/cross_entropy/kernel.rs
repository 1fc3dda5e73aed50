//! Softmax cross-entropy kernels: the forward reads each row of logits once (online max and sum
//! of exponentials), the backward reads it once more and writes the gradient; both in f32.

use cubecl::prelude::*;

use crate::launch::{cube_max, cube_sum};

/// Per row: `lse = log(sum_j exp(x_j))`, `loss = lse - x[target] + z_loss * lse^2`. Rows whose
/// target is negative are ignored (loss 0). Rows of `logits` are `row_stride` vectors apart.
#[cube(launch)]
pub(crate) fn ce_fwd<F: Float, I: Int, N: Size>(
    logits: &Array<Vector<F, N>>,
    targets: &Array<I>,
    loss: &mut Array<f32>,
    lse: &mut Array<f32>,
    rows: usize,
    row_vecs: usize,
    row_stride: usize,
    z_loss: f32,
    #[comptime] slots: usize,
    #[comptime] plane: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let unit = UNIT_POS as usize;
    let units = CUBE_DIM as usize;
    let width = logits.vector_size();
    let mut smem = SharedMemory::<f32>::new(slots);
    let mut row = CUBE_POS;
    while row < rows {
        let base = row * row_stride;
        // Running maximum and sum of exp(x - max) over this unit's share of the row. The start
        // value stands in for -infinity (WGSL has no infinity literal): exp(-3e38 - m) is 0.
        let mut m = f32::new(-3.0e38);
        let mut s = 0.0f32;
        let mut c = unit;
        while c < row_vecs {
            let v = Vector::<f32, N>::cast_from(logits[base + c]);
            let mut vmax = v[0];
            #[unroll]
            for k in 1..width {
                vmax = f32::max(vmax, v[k]);
            }
            let m_new = f32::max(m, vmax);
            s *= f32::exp(m - m_new);
            #[unroll]
            for k in 0..width {
                s += f32::exp(v[k] - m_new);
            }
            m = m_new;
            c += units;
        }
        let row_max = cube_max(m, &mut smem, plane);
        let total = cube_sum(s * f32::exp(m - row_max), &mut smem, plane);
        if unit == 0 {
            let l = row_max + f32::ln(total);
            lse[row] = l;
            let t = i32::cast_from(targets[row]);
            let mut out = 0.0f32;
            if t >= 0 {
                let tu = usize::cast_from(t);
                if tu < row_vecs * width {
                    let picked = f32::cast_from(logits[base + tu / width][tu % width]);
                    out = l - picked + z_loss * l * l;
                } else {
                    // A class index past the row: NaN, so the error cannot pass unnoticed (sqrt of
                    // a negative number; WGSL has no NaN literal).
                    out = f32::sqrt(-1.0 - l * l);
                }
            }
            loss[row] = out;
        }
        row += CUBE_COUNT;
    }
}

/// `dlogits[r, j] = dloss[r] * (exp(x_j - lse_r) * (1 + 2 z_loss lse_r) - [j == target_r])`, zero
/// for ignored rows; one unit per vector of logits. `dlogits` is dense; `logits` rows are
/// `row_stride` vectors apart (CUDA pads the rows of large allocations).
#[cube(launch)]
pub(crate) fn ce_bwd<F: Float, I: Int, N: Size>(
    logits: &Array<Vector<F, N>>,
    targets: &Array<I>,
    lse: &Array<f32>,
    dloss: &Array<f32>,
    dlogits: &mut Array<Vector<F, N>>,
    row_vecs: usize,
    row_stride: usize,
    total: usize,
    z_loss: f32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i < total {
        let width = logits.vector_size();
        let row = i / row_vecs;
        let col0 = (i % row_vecs) * width;
        let t = i32::cast_from(targets[row]);
        let mut out = Vector::<f32, N>::new(0.0);
        if t >= 0 {
            let l = lse[row];
            let g = dloss[row];
            let src = row * row_stride + i % row_vecs;
            let p = (Vector::<f32, N>::cast_from(logits[src]) - Vector::new(l)).exp();
            out = p * Vector::new(g * (1.0 + 2.0 * z_loss * l));
            let tu = usize::cast_from(t);
            if tu >= col0 && tu < col0 + width {
                out[tu - col0] -= g;
            }
            if tu >= row_vecs * width {
                // Class index past the row (the forward's loss is NaN): NaN gradient too.
                out = Vector::new(f32::sqrt(-1.0 - l * l));
            }
        }
        dlogits[i] = Vector::cast_from(out);
    }
}
