//! Launches of the activation kernels on `CubeBackend` tensors.

use burn::tensor::ops::FloatTensor;
use burn::tensor::DType;
use burn::tensor::TensorMetadata;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use super::kernel::{gelu_exact, gelu_narrow, swiglu_bwd, swiglu_fwd};
use super::GeluForm;
use crate::check::{check_float, check_same_dtype, fail};
use crate::launch::{contiguous, empty, vector_width};
use crate::rms_norm::forward::rows_cols;

/// Where the gate and up halves live: two dense tensors, or one packed `[.., 2 * cols]` tensor.
#[allow(clippy::large_enum_variant)] // short-lived, one per launch
pub(crate) enum GateUp<R: CubeRuntime> {
    Split {
        gate: CubeTensor<R>,
        up: CubeTensor<R>,
    },
    Packed(CubeTensor<R>),
}

struct Layout<R: CubeRuntime> {
    gate: CubeTensor<R>,
    up: CubeTensor<R>,
    out_shape: Vec<usize>,
    rows: usize,
    cols: usize,
    /// Element offsets of the halves and the row stride of their storage.
    gate_offset: usize,
    up_offset: usize,
    row_stride: usize,
}

fn layout<R: CubeRuntime>(op: &str, gu: GateUp<R>) -> Layout<R> {
    match gu {
        GateUp::Split { gate, up } => {
            check_float(op, "gate", gate.dtype);
            check_same_dtype(op, "gate", gate.dtype, "up", up.dtype);
            if gate.shape() != up.shape() {
                fail(
                    op,
                    format!(
                        "gate has shape {:?} but up has {:?}; they must match",
                        gate.shape().as_slice(),
                        up.shape().as_slice()
                    ),
                );
            }
            let shape = gate.shape();
            let (rows, cols) = rows_cols(&shape);
            Layout {
                gate: contiguous(gate),
                up: contiguous(up),
                out_shape: shape.as_slice().to_vec(),
                rows,
                cols,
                gate_offset: 0,
                up_offset: 0,
                row_stride: cols,
            }
        }
        GateUp::Packed(gu) => {
            check_float(op, "input", gu.dtype);
            let shape = gu.shape();
            let (rows, width) = rows_cols(&shape);
            if width % 2 != 0 {
                fail(op, format!("packed input has shape {:?}; its last dimension must be even (gate half, then up half)", shape.as_slice()));
            }
            let mut out_shape = shape.as_slice().to_vec();
            *out_shape.last_mut().expect("rank >= 1") = width / 2;
            let gu = contiguous(gu);
            Layout {
                gate: gu.clone(),
                up: gu,
                out_shape,
                rows,
                cols: width / 2,
                gate_offset: 0,
                up_offset: width / 2,
                row_stride: width,
            }
        }
    }
}

fn grid<R: CubeRuntime>(t: &CubeTensor<R>, total: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new_1d(256);
    (
        calculate_cube_count_elemwise(&t.client, total.max(1), dim),
        dim,
    )
}

/// `silu(gate) * up`, `[.., cols]`.
pub(crate) fn swiglu_forward<R: CubeRuntime>(gu: GateUp<R>) -> CubeTensor<R> {
    let l = layout("swiglu", gu);
    let out = empty(&l.gate, l.out_shape.clone(), l.gate.dtype);
    let n = vector_width(&l.gate, &[l.gate.dtype], &[l.cols]);
    let total = l.rows * l.cols / n;
    if total == 0 {
        return out;
    }
    let (count, dim) = grid(&l.gate, total);
    let dtype = l.gate.dtype;
    swiglu_fwd::launch::<R>(
        &l.gate.client.clone(),
        count,
        dim,
        n,
        l.gate.into_array_arg(),
        l.up.into_array_arg(),
        out.clone().into_array_arg(),
        l.cols / n,
        l.gate_offset / n,
        l.up_offset / n,
        l.row_stride / n,
        total,
        dtype.into(),
    );
    out
}

/// Gradients of [`swiglu_forward`] as one dense `[.., 2 * cols]` tensor (gate half, up half).
pub(crate) fn swiglu_backward<R: CubeRuntime>(gu: GateUp<R>, dy: CubeTensor<R>) -> CubeTensor<R> {
    let l = layout("swiglu backward", gu);
    let dtype = l.gate.dtype;
    let dy = contiguous(burn_cubecl::kernel::cast(dy, dtype));
    let mut shape = l.out_shape.clone();
    *shape.last_mut().expect("rank >= 1") *= 2;
    let d = empty(&l.gate, shape, dtype);
    let n = vector_width(&l.gate, &[dtype], &[l.cols]);
    let total = l.rows * l.cols / n;
    if total == 0 {
        return d;
    }
    let (count, dim) = grid(&l.gate, total);
    swiglu_bwd::launch::<R>(
        &l.gate.client.clone(),
        count,
        dim,
        n,
        l.gate.into_array_arg(),
        l.up.into_array_arg(),
        dy.into_array_arg(),
        d.clone().into_array_arg(),
        l.cols / n,
        l.gate_offset / n,
        l.up_offset / n,
        l.row_stride / n,
        total,
        dtype.into(),
    );
    d
}

fn flat_width<R: CubeRuntime>(x: &CubeTensor<R>) -> (usize, usize) {
    let (_, cols) = rows_cols(&x.shape());
    let n = vector_width(x, &[x.dtype], &[cols]);
    (n, x.shape().num_elements() / n)
}

/// Vectors per unit of the f16/bf16 GELU kernels.
const NARROW_PER_UNIT: usize = 4;

/// Whether GELU runs [`gelu_narrow`] (f16 and bf16 storage, where an approximation of `erf` to
/// 1.5e-7 is far below the storage's rounding) rather than [`gelu_exact`] with `erf` itself.
fn narrow(dtype: DType) -> bool {
    dtype.size() < 4
}

/// GELU of `x` in the given form, or with `dy` its gradient `dy * GELU'(x)`, in `x`'s dtype.
pub(crate) fn gelu<R: CubeRuntime>(
    x: CubeTensor<R>,
    dy: Option<CubeTensor<R>>,
    form: GeluForm,
) -> CubeTensor<R> {
    check_float("gelu", "x", x.dtype);
    let x = contiguous(x);
    let backward = dy.is_some();
    let tanh = form == GeluForm::Tanh;
    // The forward reads no gradient: `x` stands in for it.
    let dy = match dy {
        Some(dy) => contiguous(burn_cubecl::kernel::cast(dy, x.dtype)),
        None => x.clone(),
    };
    let out = empty(&x, x.shape().as_slice().to_vec(), x.dtype);
    let (n, total) = flat_width(&x);
    if total == 0 {
        return out;
    }
    let dtype = x.dtype;
    let client = x.client.clone();
    if narrow(dtype) {
        let (count, dim) = grid(&x, total.div_ceil(NARROW_PER_UNIT));
        // SAFETY: `total` vectors of `x`, `dy` and `out` (same shape, contiguous); the kernel
        // masks the units past them.
        unsafe {
            gelu_narrow::launch_unchecked::<R>(
                &client,
                count,
                dim,
                n,
                x.into_array_arg(),
                dy.into_array_arg(),
                out.clone().into_array_arg(),
                total,
                NARROW_PER_UNIT,
                backward,
                tanh,
                dtype.into(),
            )
        };
    } else {
        let (count, dim) = grid(&x, total);
        gelu_exact::launch::<R>(
            &client,
            count,
            dim,
            n,
            x.into_array_arg(),
            dy.into_array_arg(),
            out.clone().into_array_arg(),
            total,
            backward,
            tanh,
            dtype.into(),
        );
    }
    out
}

fn gate_up<R: CubeRuntime>(gate: CubeTensor<R>, up: Option<CubeTensor<R>>) -> GateUp<R> {
    match up {
        Some(up) => GateUp::Split { gate, up },
        None => GateUp::Packed(gate),
    }
}

impl<R, F, I, BT> super::ActivationKernels for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn swiglu_forward(gate: FloatTensor<Self>, up: Option<FloatTensor<Self>>) -> FloatTensor<Self> {
        swiglu_forward(gate_up(gate, up))
    }
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: Option<FloatTensor<Self>>,
        dy: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        swiglu_backward(gate_up(gate, up), dy)
    }
    fn gelu_form_forward(x: FloatTensor<Self>, form: GeluForm) -> FloatTensor<Self> {
        gelu(x, None, form)
    }
    fn gelu_form_backward(
        x: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        form: GeluForm,
    ) -> FloatTensor<Self> {
        gelu(x, Some(dy), form)
    }
}

impl<R, F, I, BT> super::ActivationOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn fused_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        swiglu_forward(gate_up(gate, Some(up)))
    }
    fn fused_swiglu_packed(gate_up_packed: FloatTensor<Self>) -> FloatTensor<Self> {
        swiglu_forward(gate_up(gate_up_packed, None))
    }
    fn fused_gelu(x: FloatTensor<Self>, form: GeluForm) -> FloatTensor<Self> {
        gelu(x, None, form)
    }
}
