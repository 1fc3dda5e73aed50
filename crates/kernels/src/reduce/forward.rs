//! Launches on `CubeBackend` tensors: the f32 sum of two tensors, the scaled cast, and the sums
//! (of squares) over many tensors.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::prelude::*;

use super::kernel::{add_as_f32_kernel, scale_kernel, sum_squares_kernel};
use crate::check::{check_factor, check_float};
use crate::launch::{
    contiguous, elementwise, empty, flat_read, num_sms, reduce_slots, use_planes, FlatRead,
};

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
        a.into_array_arg(),
        b.into_array_arg(),
        out.clone().into_array_arg(),
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
        x.into_array_arg(),
        factor.into_array_arg(),
        out.clone().into_array_arg(),
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
        read.x.into_array_arg(),
        out.clone().into_array_arg(),
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

impl<R, F, I, BT> super::ReduceOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
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
