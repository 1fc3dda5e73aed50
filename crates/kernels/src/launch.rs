//! Shared launch helpers: contiguous inputs, output allocation, vector widths, cube reductions.

use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::calculate_cube_count_elemwise;
use cubecl::features::Plane;
use cubecl::prelude::*;

/// The tensor with exact row-major strides (a no-op when it already has them; CUDA's pitched
/// allocations of odd row lengths are copied). A tensor of no elements with other strides (a view
/// of no rows of a pitched one) becomes a new empty one: its copy would launch no cubes, which CUDA
/// refuses.
pub(crate) fn contiguous<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
    if t.meta.num_elements() == 0 && !t.is_contiguous() {
        return empty(&t, t.meta.shape().as_slice().to_vec(), t.dtype);
    }
    into_contiguous(t)
}

/// A new dense row-major tensor on `like`'s device. The kernels index with 32 bits, so larger
/// tensors are refused.
pub(crate) fn empty<R: CubeRuntime>(
    like: &CubeTensor<R>,
    shape: Vec<usize>,
    dtype: DType,
) -> CubeTensor<R> {
    let n: usize = shape.iter().product();
    if n > u32::MAX as usize {
        panic!("kernels: a tensor of shape {shape:?} has {n} elements; the kernels support at most 2^32 - 1");
    }
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        shape.into(),
        dtype,
    )
}

/// Widest vector (elements per load) the device supports for `dtype` that divides every length
/// in `lens`: 128-bit loads on CUDA (4 x f32, 8 x bf16), at most 4 on wgpu, 1 when nothing else
/// fits.
pub(crate) fn vector_width<R: CubeRuntime>(
    t: &CubeTensor<R>,
    dtypes: &[DType],
    lens: &[usize],
) -> usize {
    let mut best = 1;
    let widest = dtypes
        .iter()
        .map(|d| {
            t.client
                .io_optimized_vector_sizes(d.size())
                .max()
                .unwrap_or(1)
        })
        .min()
        .unwrap_or(1);
    let mut n = 2;
    while n <= widest {
        if lens.iter().all(|l| l % n == 0) {
            best = n;
        }
        n *= 2;
    }
    best
}

/// How a reduction over every element of a tensor reads it: a dense tensor as `total` vectors of
/// `width` elements; a matrix with other strides (CUDA's pitched rows, transposed views) or a
/// strided vector in place, element `i` at [`flat_index`]; anything else after a copy.
pub(crate) struct FlatRead<R: CubeRuntime> {
    pub x: CubeTensor<R>,
    pub dense: bool,
    pub width: usize,
    pub total: usize,
    pub cols: usize,
    pub strides: [usize; 2],
}

/// The [`FlatRead`] of `x` (`x` holds at least one element).
pub(crate) fn flat_read<R: CubeRuntime>(x: CubeTensor<R>) -> FlatRead<R> {
    let dims = x.meta.shape().as_slice().to_vec();
    let numel: usize = dims.iter().product();
    let x = if x.is_contiguous() || dims.len() <= 2 {
        x
    } else {
        contiguous(x)
    };
    let strides = x.meta.strides().to_vec();
    let (dense, width, total, cols, strides) = if x.is_contiguous() {
        let width = vector_width(&x, &[x.dtype], &[numel]);
        (true, width, numel / width, 1, [0, 0])
    } else if dims.len() == 2 {
        (false, 1, numel, dims[1], [strides[0], strides[1]])
    } else {
        (false, 1, numel, numel, [0, strides[0]])
    };
    FlatRead {
        x,
        dense,
        width,
        total,
        cols,
        strides,
    }
}

/// Where a [`FlatRead`] finds its `i`-th vector.
#[cube]
pub(crate) fn flat_index(
    i: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
    #[comptime] dense: bool,
) -> usize {
    if comptime!(dense) {
        i
    } else {
        (i / cols) * row_stride + (i % cols) * col_stride
    }
}

/// The device's plane (warp) size when it has one fixed size (32 on CUDA), else 0.
pub(crate) fn plane_size<R: CubeRuntime>(t: &CubeTensor<R>) -> u32 {
    let hw = &t.client.properties().hardware;
    if hw.plane_size_min == hw.plane_size_max {
        hw.plane_size_min
    } else {
        0
    }
}

/// Whether a cube of `units` can reduce with plane (warp) operations: the device has them (CUDA
/// yes, lavapipe no) and a fixed plane size of at least 8 that divides the cube. Otherwise the
/// reductions use the shared-memory tree.
pub(crate) fn use_planes<R: CubeRuntime>(t: &CubeTensor<R>, units: usize) -> bool {
    let plane = plane_size(t) as usize;
    t.client.properties().features.plane.contains(Plane::Ops)
        && plane >= 8
        && units.is_multiple_of(plane)
}

/// Most units the device runs in one cube.
pub(crate) fn max_units<R: CubeRuntime>(t: &CubeTensor<R>) -> usize {
    t.client.properties().hardware.max_units_per_cube as usize
}

/// Most cubes along x of a launch grid.
pub(crate) fn max_cubes_x<R: CubeRuntime>(t: &CubeTensor<R>) -> usize {
    t.client.properties().hardware.max_cube_count.0 as usize
}

/// Streaming multiprocessors (or a guess of 64 when the device does not say).
pub(crate) fn num_sms<R: CubeRuntime>(t: &CubeTensor<R>) -> usize {
    t.client
        .properties()
        .hardware
        .num_streaming_multiprocessors
        .unwrap_or(64) as usize
}

/// Units per cube and vectors per unit for a row-per-cube kernel over `row_vecs` vectors: the cube
/// is a power of two between 32 and the device's limit, large enough that each unit holds at most
/// `max_per_unit` vectors of the row in registers. `None` if the row is too long for that.
pub(crate) fn row_split(
    row_vecs: usize,
    max_units: usize,
    max_per_unit: usize,
) -> Option<(usize, usize)> {
    let max_units = max_units.clamp(32, 1024);
    let mut units = 32;
    while units < max_units && units * max_per_unit < row_vecs {
        units *= 2;
    }
    // Prefer fewer vectors per unit while the cube stays at most 256 units.
    while units < 256.min(max_units) && units < row_vecs {
        units *= 2;
    }
    let per_unit = row_vecs.div_ceil(units).max(1);
    (per_unit <= max_per_unit).then_some((units, per_unit))
}

/// Sum of `value` over all units of the cube, returned to every unit. `smem` needs one slot per
/// unit (tree) or per plane (`plane`). The cube size must be a power of two.
#[cube]
pub(crate) fn cube_sum(value: f32, smem: &mut SharedMemory<f32>, #[comptime] plane: bool) -> f32 {
    let unit = UNIT_POS as usize;
    let mut result = 0.0f32;
    if comptime!(plane) {
        let partial = plane_sum(value);
        if UNIT_POS_PLANE == 0 {
            smem[unit / PLANE_DIM as usize] = partial;
        }
        sync_cube();
        let planes = CUBE_DIM.div_ceil(PLANE_DIM) as usize;
        for i in 0..planes {
            result += smem[i];
        }
        sync_cube();
    } else {
        smem[unit] = value;
        sync_cube();
        let mut stride = CUBE_DIM as usize / 2;
        while stride > 0 {
            if unit < stride {
                smem[unit] += smem[unit + stride];
            }
            sync_cube();
            stride /= 2;
        }
        result = smem[0];
        sync_cube();
    }
    result
}

/// Maximum of `value` over all units of the cube, returned to every unit (see [`cube_sum`]).
#[cube]
pub(crate) fn cube_max(value: f32, smem: &mut SharedMemory<f32>, #[comptime] plane: bool) -> f32 {
    let unit = UNIT_POS as usize;
    let mut result = value;
    if comptime!(plane) {
        let partial = plane_max(value);
        if UNIT_POS_PLANE == 0 {
            smem[unit / PLANE_DIM as usize] = partial;
        }
        sync_cube();
        let planes = CUBE_DIM.div_ceil(PLANE_DIM) as usize;
        for i in 0..planes {
            result = f32::max(result, smem[i]);
        }
        sync_cube();
    } else {
        smem[unit] = value;
        sync_cube();
        let mut stride = CUBE_DIM as usize / 2;
        while stride > 0 {
            if unit < stride {
                smem[unit] = f32::max(smem[unit], smem[unit + stride]);
            }
            sync_cube();
            stride /= 2;
        }
        result = smem[0];
        sync_cube();
    }
    result
}

/// Sum of the lanes of a vector.
#[cube]
pub(crate) fn lanes_sum<N: Size>(v: Vector<f32, N>) -> f32 {
    let mut s = 0.0f32;
    #[unroll]
    for i in 0..v.size() {
        s += v[i];
    }
    s
}

/// Shared-memory slots [`cube_sum`] / [`cube_max`] need for a cube of `units`.
pub(crate) fn reduce_slots(units: usize, plane: bool) -> usize {
    if plane {
        units.div_ceil(8)
    } else {
        units
    }
}

/// Column vectors per cube of [`column_sum`].
const SUM_LANES: usize = 8;
/// Units down the rows per column vector in [`column_sum`].
const SUM_DEPTH: usize = 32;

/// Column sums of a dense f32 `[rows, cols]` tensor. A cube takes `lanes` column vectors; for
/// each, `depth` units sum every `depth`-th row, then one unit adds their partial sums from
/// shared memory. (One unit per column vector walking every row was latency-bound: 120 µs for the
/// `[528, 768]` RMSNorm gain partials on an H200.)
#[cube(launch)]
fn column_sum<N: Size>(
    input: &Array<Vector<f32, N>>,
    output: &mut Array<Vector<f32, N>>,
    rows: usize,
    row_vecs: usize,
    #[comptime] lanes: usize,
    #[comptime] depth: usize,
) {
    let x = UNIT_POS_X as usize;
    let y = UNIT_POS_Y as usize;
    let c = CUBE_POS * lanes + x;
    let mut partial = SharedMemory::<Vector<f32, N>>::new(comptime!(lanes * depth));
    let mut acc = Vector::<f32, N>::new(0.0);
    if c < row_vecs {
        let mut r = y;
        while r < rows {
            acc += input[r * row_vecs + c];
            r += depth;
        }
    }
    partial[y * lanes + x] = acc;
    sync_cube();
    if y == 0 && c < row_vecs {
        let mut total = Vector::<f32, N>::new(0.0);
        for i in 0..depth {
            total += partial[i * lanes + x];
        }
        output[c] = total;
    }
}

/// `t.sum_dim(0)` of a dense f32 `[rows, cols]` tensor, as a `[cols]` tensor.
pub(crate) fn sum_rows<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
    let dims = t.meta.shape().as_slice().to_vec();
    let (rows, cols) = (dims[0], dims[1]);
    let out = empty(&t, vec![cols], DType::F32);
    if cols == 0 {
        return out;
    }
    let n = vector_width(&t, &[DType::F32], &[cols]);
    let row_vecs = cols / n;
    let cubes = row_vecs.div_ceil(SUM_LANES);
    let client = t.client.clone();
    column_sum::launch::<R>(
        &client,
        CubeCount::Static(cubes as u32, 1, 1),
        CubeDim::new_2d(SUM_LANES as u32, SUM_DEPTH as u32),
        n,
        t.into_array_arg(),
        out.clone().into_array_arg(),
        rows,
        row_vecs,
        SUM_LANES,
        SUM_DEPTH,
    );
    out
}

/// How an element-wise kernel over a tensor of `like`'s shape runs: `n` elements a vector (the
/// widest that suits every one of `dtypes` and divides the last dimension), `total` vectors, one
/// unit each in cubes of 256.
pub(crate) struct Elementwise {
    pub n: usize,
    pub total: usize,
    pub count: CubeCount,
    pub dim: CubeDim,
}

/// The [`Elementwise`] launch over `like`'s shape, or `None` when it holds no element.
pub(crate) fn elementwise<R: CubeRuntime>(
    like: &CubeTensor<R>,
    dtypes: &[DType],
) -> Option<Elementwise> {
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
