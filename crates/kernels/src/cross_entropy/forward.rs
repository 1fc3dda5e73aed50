//! Launches of the cross-entropy kernels on `CubeBackend` tensors.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use super::kernel::{ce_bwd, ce_fwd};
use crate::check::{check_float, fail};
use crate::launch::{
    contiguous, empty, max_cubes_x, max_units, reduce_slots, use_planes, vector_width,
};

fn check<R: CubeRuntime>(
    op: &str,
    logits: &CubeTensor<R>,
    targets: &CubeTensor<R>,
) -> (usize, usize) {
    check_float(op, "logits", logits.dtype);
    let ls = logits.shape();
    let ts = targets.shape();
    if ls.num_dims() != 2 {
        fail(
            op,
            format!(
                "logits have shape {:?}; expected [rows, classes]",
                ls.as_slice()
            ),
        );
    }
    if ts.as_slice() != [ls[0]] {
        fail(
            op,
            format!(
                "targets have shape {:?}; expected [{}], one class index per row of logits {:?}",
                ts.as_slice(),
                ls[0],
                ls.as_slice()
            ),
        );
    }
    if !matches!(
        targets.dtype,
        DType::I32 | DType::I64 | DType::U32 | DType::U64
    ) {
        fail(
            op,
            format!(
                "targets have dtype {:?}; expected an integer dtype",
                targets.dtype
            ),
        );
    }
    (ls[0], ls[1])
}

/// Logits whose rows are dense (unit column stride) are read in place, whatever their row stride:
/// CUDA pads the rows of large allocations (a bf16 row of 50304 to 50432 elements), and copying
/// such a tensor to dense costs more than the loss itself. Anything else is copied first.
fn rows_in_place<R: CubeRuntime>(logits: CubeTensor<R>) -> (CubeTensor<R>, usize) {
    let strides = logits
        .meta
        .strides()
        .iter()
        .copied()
        .collect::<Vec<usize>>();
    if strides.len() == 2 && strides[1] == 1 && strides[0] >= logits.meta.shape()[1] {
        let s = strides[0];
        (logits, s)
    } else {
        let l = contiguous(logits);
        let s = l.meta.shape()[1];
        (l, s)
    }
}

/// Per-row `(loss, lse)`, both f32 [rows].
pub(crate) fn forward<R: CubeRuntime>(
    logits: CubeTensor<R>,
    targets: CubeTensor<R>,
    z_loss: f64,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (rows, cols) = check("cross_entropy", &logits, &targets);
    let (logits, stride) = rows_in_place(logits);
    let targets = contiguous(targets);
    let loss = empty(&logits, vec![rows], DType::F32);
    let lse = empty(&logits, vec![rows], DType::F32);
    if rows == 0 {
        return (loss, lse);
    }
    if cols == 0 {
        fail("cross_entropy", "logits have 0 classes".into());
    }
    let n = vector_width(&logits, &[logits.dtype], &[cols, stride]);
    // One cube per row: 256 units stream a 50k-wide row in ~25 vector loads each; short rows use
    // smaller cubes so that few units idle.
    let units = (cols / n)
        .next_power_of_two()
        .clamp(32, 256.min(max_units(&logits)));
    let plane = use_planes(&logits, units);
    let cubes = rows.min(max_cubes_x(&logits));
    let dtypes = [logits.dtype.into(), targets.dtype.into()];
    ce_fwd::launch::<R>(
        &logits.client.clone(),
        CubeCount::Static(cubes as u32, 1, 1),
        CubeDim::new_1d(units as u32),
        n,
        logits.into_array_arg(),
        targets.into_array_arg(),
        loss.clone().into_array_arg(),
        lse.clone().into_array_arg(),
        rows,
        cols / n,
        stride / n,
        z_loss as f32,
        reduce_slots(units, plane),
        plane,
        dtypes,
    );
    (loss, lse)
}

/// Gradient of the per-row losses with respect to the logits, in the logits' dtype.
pub(crate) fn backward<R: CubeRuntime>(
    logits: CubeTensor<R>,
    targets: CubeTensor<R>,
    lse: CubeTensor<R>,
    dloss: CubeTensor<R>,
    z_loss: f64,
) -> CubeTensor<R> {
    let (rows, cols) = check("cross_entropy backward", &logits, &targets);
    let (logits, stride) = rows_in_place(logits);
    let targets = contiguous(targets);
    let dloss = contiguous(burn_cubecl::kernel::cast(dloss, DType::F32));
    let d = empty(&logits, vec![rows, cols], logits.dtype);
    let n = vector_width(&logits, &[logits.dtype], &[cols, stride]);
    let total = rows * cols / n;
    if total == 0 {
        return d;
    }
    let dim = CubeDim::new_1d(256);
    let count = calculate_cube_count_elemwise(&logits.client, total, dim);
    let dtypes = [logits.dtype.into(), targets.dtype.into()];
    ce_bwd::launch::<R>(
        &logits.client.clone(),
        count,
        dim,
        n,
        logits.into_array_arg(),
        targets.into_array_arg(),
        lse.into_array_arg(),
        dloss.into_array_arg(),
        d.clone().into_array_arg(),
        cols / n,
        stride / n,
        total,
        z_loss as f32,
        dtypes,
    );
    d
}

impl<R, F, I, BT> super::CrossEntropyKernels for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn cross_entropy_forward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        z_loss: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        forward(logits, targets, z_loss)
    }
    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
        z_loss: f64,
    ) -> FloatTensor<Self> {
        backward(logits, targets, lse, dloss, z_loss)
    }
    fn logits_chunk_bytes(x: &FloatTensor<Self>) -> usize {
        super::linear::pooled_chunk_bytes(x.client.properties().memory.max_page_size)
    }
}

impl<R, F, I, BT> super::CrossEntropyOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn fused_linear_cross_entropy(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
        opts: super::LinearCrossEntropy,
    ) -> FloatTensor<Self> {
        super::linear::chunked::<Self>(x, w, targets, opts, false, false).0
    }

    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        z_loss: f64,
    ) -> FloatTensor<Self> {
        forward(logits, targets, z_loss).0
    }
}
