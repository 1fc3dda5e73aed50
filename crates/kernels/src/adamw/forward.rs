//! Launches on `CubeBackend` tensors: the fused AdamW step, the gradient sum and scale, and the
//! sums (of squares) over many tensors.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use super::kernel::{
    adamw_kernel, add_as_f32_kernel, scale_kernel, sum_squares_kernel, AdamWScalarsLaunch,
};
use super::AdamWStep;
use crate::check::{check_float, fail};
use crate::launch::{
    contiguous, empty, flat_read, num_sms, reduce_slots, use_planes, vector_width, FlatRead,
};

/// How an element-wise kernel over a tensor of `like`'s shape runs: `n` elements a vector (the
/// widest that suits every one of `dtypes` and divides the last dimension), `total` vectors, one
/// unit each in cubes of 256.
struct Elementwise {
    n: usize,
    total: usize,
    count: CubeCount,
    dim: CubeDim,
}

/// The [`Elementwise`] launch over `like`'s shape, or `None` when it holds no element.
fn elementwise<R: CubeRuntime>(like: &CubeTensor<R>, dtypes: &[DType]) -> Option<Elementwise> {
    let shape = like.shape();
    let numel = shape.num_elements();
    let last = *shape.as_slice().last().unwrap_or(&1);
    let n = vector_width(like, dtypes, &[last, numel]);
    let total = numel / n;
    if total == 0 {
        return None;
    }
    let dim = CubeDim::new_1d(256);
    let count = calculate_cube_count_elemwise(&like.client, total, dim);
    Some(Elementwise {
        n,
        total,
        count,
        dim,
    })
}

/// Refuses a `factor` that is not one element.
fn check_factor<R: CubeRuntime>(op: &str, factor: &CubeTensor<R>) {
    if factor.shape().num_elements() != 1 {
        fail(
            op,
            format!(
                "factor has shape {:?}; expected one element",
                factor.shape().as_slice()
            ),
        );
    }
}

/// `(param, m, v, copy)` after one step; see [`super::reference`].
pub(crate) fn step<R: CubeRuntime>(
    param: CubeTensor<R>,
    grad: CubeTensor<R>,
    m: CubeTensor<R>,
    v: CubeTensor<R>,
    factor: CubeTensor<R>,
    hp: &AdamWStep,
    copy_dtype: Option<DType>,
) -> (
    CubeTensor<R>,
    CubeTensor<R>,
    CubeTensor<R>,
    Option<CubeTensor<R>>,
) {
    let op = "adamw_step";
    let shape = param.shape();
    for (name, t) in [("param", &param), ("m", &m), ("v", &v)] {
        if t.dtype != DType::F32 {
            fail(
                op,
                format!(
                    "{name} has dtype {:?}; master weights and moments must be F32",
                    t.dtype
                ),
            );
        }
    }
    check_float(op, "grad", grad.dtype);
    for (name, t) in [("grad", &grad), ("m", &m), ("v", &v)] {
        if t.shape() != shape {
            fail(
                op,
                format!(
                    "{name} has shape {:?} but param has {:?}",
                    t.shape().as_slice(),
                    shape.as_slice()
                ),
            );
        }
    }
    check_factor(op, &factor);
    if let Some(dt) = copy_dtype {
        check_float(op, "copy dtype", dt);
    }
    let (param, grad, m, v) = (
        contiguous(param),
        contiguous(grad),
        contiguous(m),
        contiguous(v),
    );
    let factor = contiguous(burn_cubecl::kernel::cast(factor, DType::F32));
    let dims = shape.as_slice().to_vec();
    let p_out = empty(&param, dims.clone(), DType::F32);
    let m_out = empty(&param, dims.clone(), DType::F32);
    let v_out = empty(&param, dims.clone(), DType::F32);
    let copy = copy_dtype.map(|dt| empty(&param, dims.clone(), dt));
    // Without a copy the kernel never touches that argument: a one-element stand-in fills it.
    let copy_arg = copy
        .clone()
        .unwrap_or_else(|| empty(&param, vec![1], DType::F32));
    let Some(e) = elementwise(&param, &[DType::F32, grad.dtype, copy_arg.dtype]) else {
        return (p_out, m_out, v_out, copy);
    };
    let (bc1, bc2) = hp.bias_corrections();
    let scalars = AdamWScalarsLaunch::new(
        hp.beta1 as f32,
        hp.beta2 as f32,
        hp.eps as f32,
        (hp.lr / bc1) as f32,
        (1.0 / bc2.sqrt()) as f32,
        (1.0 - hp.lr * hp.weight_decay) as f32,
    );
    let dtypes = [grad.dtype.into(), copy_arg.dtype.into()];
    adamw_kernel::launch::<R>(
        &param.client.clone(),
        e.count,
        e.dim,
        e.n,
        param.into_tensor_arg(),
        grad.into_tensor_arg(),
        m.into_tensor_arg(),
        v.into_tensor_arg(),
        factor.into_tensor_arg(),
        p_out.clone().into_tensor_arg(),
        m_out.clone().into_tensor_arg(),
        v_out.clone().into_tensor_arg(),
        copy_arg.into_tensor_arg(),
        scalars,
        e.total,
        copy.is_some(),
        dtypes,
    );
    (p_out, m_out, v_out, copy)
}

/// `f32(a) + f32(b)` in one pass; see [`super::add_as_f32_reference`].
pub(crate) fn add_as_f32<R: CubeRuntime>(a: CubeTensor<R>, b: CubeTensor<R>) -> CubeTensor<R> {
    // `kernels::add_as_f32` has checked that the shapes match.
    let op = "add_as_f32";
    check_float(op, "a", a.dtype);
    check_float(op, "b", b.dtype);
    let shape = a.shape();
    let (a, b) = (contiguous(a), contiguous(b));
    let out = empty(&a, shape.as_slice().to_vec(), DType::F32);
    let Some(e) = elementwise(&a, &[DType::F32, a.dtype, b.dtype]) else {
        return out;
    };
    let dtypes = [a.dtype.into(), b.dtype.into()];
    add_as_f32_kernel::launch::<R>(
        &a.client.clone(),
        e.count,
        e.dim,
        e.n,
        a.into_tensor_arg(),
        b.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        e.total,
        dtypes,
    );
    out
}

/// Units per cube of the sum of squares (and of `format_stats`).
pub(crate) const SUM_UNITS: usize = 256;

/// Cubes of a reduction over `read`: at least four vectors per unit, at most four cubes per SM.
pub(crate) fn flat_cubes<R: CubeRuntime>(read: &FlatRead<R>) -> usize {
    read.total
        .div_ceil(SUM_UNITS * 4)
        .clamp(1, 4 * num_sms(&read.x))
}

/// `x * factor[0]` in `dtype` in one pass; see [`super::scale_reference`].
pub(crate) fn scale<R: CubeRuntime>(
    x: CubeTensor<R>,
    factor: CubeTensor<R>,
    dtype: DType,
) -> CubeTensor<R> {
    let op = "scale";
    check_float(op, "x", x.dtype);
    check_float(op, "output dtype", dtype);
    check_factor(op, &factor);
    let shape = x.shape();
    let x = contiguous(x);
    let factor = contiguous(burn_cubecl::kernel::cast(factor, DType::F32));
    let out = empty(&x, shape.as_slice().to_vec(), dtype);
    let Some(e) = elementwise(&x, &[x.dtype, dtype]) else {
        return out;
    };
    let dtypes = [x.dtype.into(), dtype.into()];
    scale_kernel::launch::<R>(
        &x.client.clone(),
        e.count,
        e.dim,
        e.n,
        x.into_tensor_arg(),
        factor.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        e.total,
        dtypes,
    );
    out
}

/// Launches the sum-of-squares kernel (a plain sum without `square`) over `read` in `cubes`
/// cubes, writing their partial sums from `out[slot]` on.
fn launch_sum<R: CubeRuntime>(
    read: FlatRead<R>,
    out: &CubeTensor<R>,
    slot: usize,
    cubes: usize,
    square: bool,
) {
    let plane = use_planes(&read.x, SUM_UNITS);
    let dtype = read.x.dtype;
    sum_squares_kernel::launch::<R>(
        &read.x.client.clone(),
        CubeCount::Static(cubes as u32, 1, 1),
        CubeDim::new_1d(SUM_UNITS as u32),
        read.width,
        read.x.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        read.total,
        read.cols,
        read.strides[0],
        read.strides[1],
        slot,
        read.dense,
        reduce_slots(SUM_UNITS, plane),
        plane,
        square,
        dtype.into(),
    );
}

/// The sum of the squares (of the values without `square`) of every element of `tensors`, `[1]`
/// in f32, or `None` when they hold no element: each tensor, read as its [`FlatRead`] says, into
/// per-cube partial sums, then one cube adds those in a fixed order (the same values give the
/// same bits).
pub(crate) fn total<R: CubeRuntime>(
    tensors: Vec<CubeTensor<R>>,
    square: bool,
) -> Option<CubeTensor<R>> {
    let op = if square { "sum_squares" } else { "sum_f32" };
    let mut launches = Vec::new();
    let mut slots = 0;
    for x in tensors {
        check_float(op, "tensor", x.dtype);
        if x.shape().num_elements() == 0 {
            continue;
        }
        let read = flat_read(x);
        let cubes = flat_cubes(&read);
        launches.push((read, slots, cubes));
        slots += cubes;
    }
    let first = &launches.first()?.0.x;
    let partials = empty(first, vec![slots], DType::F32);
    let out = empty(first, vec![1], DType::F32);
    for (read, slot, cubes) in launches {
        launch_sum(read, &partials, slot, cubes, square);
    }
    launch_sum(flat_read(partials), &out, 0, 1, false);
    Some(out)
}

impl<R, F, I, BT> super::AdamWOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    #[allow(clippy::type_complexity)]
    fn fused_adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        factor: FloatTensor<Self>,
        hp: &AdamWStep,
        copy_dtype: Option<burn::tensor::FloatDType>,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
    ) {
        step(param, grad, m, v, factor, hp, copy_dtype.map(Into::into))
    }

    fn add_as_f32(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        add_as_f32(a, b)
    }

    fn scale_cast(
        x: FloatTensor<Self>,
        factor: FloatTensor<Self>,
        dtype: burn::tensor::FloatDType,
    ) -> FloatTensor<Self> {
        scale(x, factor, dtype.into())
    }

    fn sum_squares(tensors: Vec<FloatTensor<Self>>, device: &Self::Device) -> FloatTensor<Self> {
        total(tensors, true).unwrap_or_else(|| zero::<Self>(device))
    }

    fn sum_f32(tensors: Vec<FloatTensor<Self>>, device: &Self::Device) -> FloatTensor<Self> {
        total(tensors, false).unwrap_or_else(|| zero::<Self>(device))
    }
}

/// `[0.0]` in f32 on `device`: the sum of nothing.
fn zero<B: burn::tensor::backend::Backend>(device: &B::Device) -> FloatTensor<B> {
    burn::tensor::Tensor::<B, 1>::zeros([1], (device, DType::F32))
        .into_primitive()
        .tensor()
}
