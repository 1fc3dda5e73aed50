//! Launch of the format statistics on `CubeBackend` tensors.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::prelude::*;

use super::kernel::format_stats_kernel;
use super::COLUMNS;
use crate::check::check_float;
use crate::launch::{empty, flat_read, reduce_slots, use_planes};
use crate::reduce::forward::{flat_cubes, SUM_UNITS};

/// The partial rows of `x`'s statistics, one per cube (`None` when `x` is empty).
pub(crate) fn partial_rows<R: CubeRuntime>(
    x: CubeTensor<R>,
    min_normal: f64,
) -> Option<CubeTensor<R>> {
    check_float("format_stats", "x", x.dtype);
    if x.shape().num_elements() == 0 {
        return None;
    }
    let read = flat_read(x);
    let cubes = flat_cubes(&read);
    let partials = empty(&read.x, vec![cubes, COLUMNS], DType::F32);
    let plane = use_planes(&read.x, SUM_UNITS);
    let dtype = read.x.dtype;
    format_stats_kernel::launch::<R>(
        &read.x.client.clone(),
        CubeCount::Static(cubes as u32, 1, 1),
        CubeDim::new_1d(SUM_UNITS as u32),
        read.width,
        read.x.into_array_arg(),
        partials.clone().into_array_arg(),
        read.total,
        read.cols,
        read.strides[0],
        read.strides[1],
        min_normal as f32,
        read.dense,
        reduce_slots(SUM_UNITS, plane),
        plane,
        dtype.into(),
    );
    Some(partials)
}

impl<R, F, I, BT> super::FormatStatsOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn format_stats(x: FloatTensor<Self>, min_normal: f64) -> FloatTensor<Self> {
        use burn::tensor::Tensor;
        let device = x.device.clone();
        match partial_rows(x, min_normal) {
            Some(p) => p,
            None => Tensor::<Self, 2>::zeros([1, COLUMNS], (&device, DType::F32))
                .into_primitive()
                .tensor(),
        }
    }
}
