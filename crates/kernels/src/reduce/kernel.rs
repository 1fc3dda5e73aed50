//! Sums in f32: of two tensors element by element, of a scaled tensor cast to another dtype, and
//! of every element (or its square) of many tensors into per-cube partial sums.

use cubecl::prelude::*;

/// `out = f32(a) + f32(b)`, element by element: gradient accumulation with the cast to f32 in the
/// same pass.
#[cube(launch)]
pub(crate) fn add_as_f32_kernel<A: Float, G: Float, N: Size>(
    a: &Array<Vector<A, N>>,
    b: &Array<Vector<G, N>>,
    out: &mut Array<Vector<f32, N>>,
    total: usize,
    #[define(A, G)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i < total {
        out[i] = Vector::<f32, N>::cast_from(a[i]) + Vector::<f32, N>::cast_from(b[i]);
    }
}

/// `out = x * factor[0]` in f32, stored in `O`: a gradient scaled by a device scalar and cast in
/// one pass.
#[cube(launch)]
pub(crate) fn scale_kernel<I: Float, O: Float, N: Size>(
    x: &Array<Vector<I, N>>,
    factor: &Array<f32>,
    out: &mut Array<Vector<O, N>>,
    total: usize,
    #[define(I, O)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i < total {
        out[i] = Vector::cast_from(Vector::<f32, N>::cast_from(x[i]) * Vector::new(factor[0]));
    }
}

/// `partials[slot + CUBE_POS]` = the sum of `x^2` (in f32) over this cube's share of `x` (of `x`
/// itself without `square`: one cube then adds up the partial sums).
///
/// `dense`: `x` is read as `total` contiguous vectors. Otherwise (`N` = 1) `x` is a matrix of
/// `cols` columns whose element `(r, c)` is at `r * row_stride + c * col_stride` (CUDA's pitched
/// rows, transposed views): `total` is `rows * cols`. Each unit strides over the elements by the
/// grid's size, then the cube sums its units' partial sums.
#[cube(launch)]
pub(crate) fn sum_squares_kernel<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    partials: &mut Array<f32>,
    total: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
    slot: usize,
    #[comptime] dense: bool,
    #[comptime] slots: usize,
    #[comptime] plane: bool,
    #[comptime] square: bool,
    #[define(F)] _dtype: StorageType,
) {
    let step = CUBE_COUNT * CUBE_DIM as usize;
    let mut acc = 0.0f32;
    let mut i = ABSOLUTE_POS;
    while i < total {
        let index = crate::launch::flat_index(i, cols, row_stride, col_stride, dense);
        let v = Vector::<f32, N>::cast_from(x[index]);
        if comptime!(square) {
            acc += crate::launch::lanes_sum::<N>(v * v);
        } else {
            acc += crate::launch::lanes_sum::<N>(v);
        }
        i += step;
    }
    let mut smem = SharedMemory::<f32>::new(slots);
    let sum = crate::launch::cube_sum(acc, &mut smem, plane);
    if UNIT_POS == 0 {
        partials[slot + CUBE_POS] = sum;
    }
}
