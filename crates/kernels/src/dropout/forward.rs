//! The dropout kernel's launch on `CubeBackend` tensors.

use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorMetadata;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use super::kernel::dropout_fwd;
use super::{DropArgs, Dropout};
use crate::check::check_float;
use crate::launch::{contiguous, empty, vector_width};

/// `x * Z` in `x`'s dtype (a contiguous copy of `x` is read if it has other strides).
pub(crate) fn apply<R: CubeRuntime>(x: CubeTensor<R>, dropout: Dropout) -> CubeTensor<R> {
    check_float("dropout", "x", x.dtype);
    let x = contiguous(x);
    let out = empty(&x, x.shape().as_slice().to_vec(), x.dtype);
    let total = x.shape().num_elements();
    if total == 0 {
        return out;
    }
    // Vectors of 1 to 8 entries that divide the tensor and the eight entries of a Philox call.
    let width = vector_width(&x, &[x.dtype], &[total, 8]);
    let vectors = total / width;
    let groups = vectors.div_ceil(8 / width);
    let dim = CubeDim::new_1d(256);
    let count = calculate_cube_count_elemwise(&x.client, groups, dim);
    let dtype = x.dtype;
    dropout_fwd::launch::<R>(
        &x.client.clone(),
        count,
        dim,
        width,
        x.into_array_arg(),
        out.clone().into_array_arg(),
        vectors,
        DropArgs::new(Some(dropout)).scalars(),
        width,
        dtype.into(),
    );
    out
}

impl<R, F, I, BT> super::DropoutKernels for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn dropout_apply(x: FloatTensor<Self>, dropout: Dropout) -> FloatTensor<Self> {
        apply(x, dropout)
    }
}

impl<R, F, I, BT> super::DropoutOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn fused_dropout(x: FloatTensor<Self>, dropout: Dropout) -> FloatTensor<Self> {
        apply(x, dropout)
    }
}
