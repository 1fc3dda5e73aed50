//! The embedding backward's kernel: one unit per element of the output gradient.

use cubecl::prelude::*;

/// `out[ids[i], j] += dy[i, j]` with f32 atomic adds; `out` zeroed `[vocab, d]`. Rows are
/// addressed through their strides (`dy_row`, `out_row`): CUDA pitches rows whose byte length is
/// not a multiple of its pitch alignment. Positions with the same id add into the same row in an
/// order that varies between runs (f32 sums, so the last bits may differ).
#[cube(launch)]
pub(crate) fn embedding_grad_kernel<F: Float, I: Int>(
    dy: &Array<F>,
    ids: &Array<I>,
    out: &mut Array<Atomic<f32>>,
    d: usize,
    dy_row: usize,
    out_row: usize,
    total: usize,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i < total {
        let row = i / d;
        let col = i % d;
        let id = usize::cast_from(ids[row]);
        out[id * out_row + col].fetch_add(f32::cast_from(dy[row * dy_row + col]));
    }
}
