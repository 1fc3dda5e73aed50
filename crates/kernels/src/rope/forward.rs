//! Launch of the RoPE kernel on `CubeBackend` tensors.

use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorMetadata;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use super::kernel::rope_kernel;
use crate::check::{check_float, check_same_dtype, fail};
use crate::launch::{contiguous, empty, vector_width};

/// Rotates `x` [B, H, T, head_dim] by the tables `cos`, `sin` [>= T, head_dim / 2] (by the opposite
/// angle when `inverse`). The result is dense.
pub(crate) fn rope<R: CubeRuntime>(
    x: CubeTensor<R>,
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
    inverse: bool,
) -> CubeTensor<R> {
    let op = "rope";
    check_float(op, "x", x.dtype);
    let shape = x.shape();
    let dims = shape.as_slice();
    if dims.len() != 4 {
        fail(
            op,
            format!("x has shape {dims:?}; expected [batch, heads, seq, head_dim]"),
        );
    }
    let (b, h, t, hd) = (dims[0], dims[1], dims[2], dims[3]);
    if hd % 2 != 0 {
        fail(
            op,
            format!("head_dim is {hd}; it must be even (pairs (i, i + head_dim / 2) are rotated)"),
        );
    }
    let half = hd / 2;
    check_tables(op, &cos, &sin, t, half);
    // Strided reads need a unit last stride; anything else is copied to dense first.
    let x = if x.meta.strides()[3] == 1 {
        x
    } else {
        contiguous(x)
    };
    let cos = contiguous(cos);
    let sin = contiguous(sin);
    let strides = x.meta.strides().iter().copied().collect::<Vec<usize>>();
    let out = empty(&x, dims.to_vec(), x.dtype);
    let n = vector_width(
        &x,
        &[x.dtype, cos.dtype],
        &[half, strides[0], strides[1], strides[2]],
    );
    let total = b * h * t * half / n;
    if total == 0 {
        return out;
    }
    let dim = CubeDim::new_1d(256);
    let count = calculate_cube_count_elemwise(&x.client, total, dim);
    let dtypes = [x.dtype.into(), cos.dtype.into()];
    rope_kernel::launch::<R>(
        &x.client.clone(),
        count,
        dim,
        n,
        x.into_array_arg(),
        cos.into_array_arg(),
        sin.into_array_arg(),
        out.clone().into_array_arg(),
        h,
        t,
        half / n,
        strides[0] / n,
        strides[1] / n,
        strides[2] / n,
        total,
        inverse,
        dtypes,
    );
    out
}

/// Checks that `cos` and `sin` are float tables `[positions >= seq, half]` of one dtype.
pub(crate) fn check_tables<R: CubeRuntime>(
    op: &str,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    seq: usize,
    half: usize,
) {
    check_float(op, "cos", cos.dtype);
    check_same_dtype(op, "cos", cos.dtype, "sin", sin.dtype);
    for (name, table) in [("cos", cos), ("sin", sin)] {
        let td = table.shape();
        let td = td.as_slice();
        if td.len() != 2 || td[1] != half || td[0] < seq {
            fail(
                op,
                format!("{name} has shape {td:?}; expected [positions >= {seq}, {half}] for {seq} positions of head_dim {}", 2 * half),
            );
        }
    }
}

impl<R, F, I, BT> super::RopeKernels for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn rope_rotate(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        inverse: bool,
    ) -> FloatTensor<Self> {
        rope(x, cos, sin, inverse)
    }
}

impl<R, F, I, BT> super::RopeOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn fused_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rope(x, cos, sin, false)
    }
}
