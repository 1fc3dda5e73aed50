//! Launches of the FP8 kernels on `CubeBackend` tensors.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, FloatDType, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::prelude::*;

use super::kernel::{
    dequantize as dequantize_kernel, health as health_kernel, quantize as quantize_kernel,
    quantize_cols, quantize_pair_tiles, tensor_amax,
};
use super::{Fp8Granularity, Fp8PairPath, PairSpec, QuantSpec, TILE};
use crate::check::{check_float, fail};
use crate::launch::empty;

/// Most cubes along y of a launch grid (rows / 8 for 1x128 tiles).
const MAX_CUBES_Y: usize = 65535;

/// `(rows, k, stride_i, stride_j)` of the logical matrix `spec` quantizes.
fn view<R: CubeRuntime>(
    op: &str,
    x: &CubeTensor<R>,
    spec: &QuantSpec,
) -> (usize, usize, usize, usize) {
    let shape = x.shape();
    let dims = shape.as_slice();
    if dims.len() != 2 {
        fail(op, format!("x has shape {dims:?}; expected a 2-D [rows, cols] tensor (flatten leading dimensions first)"));
    }
    let strides = x.meta.strides();
    if spec.transpose {
        (dims[1], dims[0], strides[1], strides[0])
    } else {
        (dims[0], dims[1], strides[0], strides[1])
    }
}

/// What the tile quantizers ([`quantize_kernel`], [`quantize_pair_tiles`]) take beside their
/// outputs, for a 2-D float `x` under a spec: the logical `[rows, k]` view and the compile-time
/// choices that follow from the spec and the device.
struct TileArgs {
    rows: usize,
    k: usize,
    stride_i: usize,
    stride_j: usize,
    /// 128x128 blocks: one amax per cube.
    block: bool,
    /// Per-tensor scaling: every tile takes the tensor's amax (see [`TileArgs::amax`]).
    tensor_scale: bool,
    /// Each unit loads its 4 adjacent elements as one vector: the logical rows are contiguous
    /// and 4-aligned.
    vec4: bool,
    /// Tile amaxes through 32-unit planes (one per row of the 32 x 8 cube).
    plane: bool,
}

impl TileArgs {
    /// Checks that `x` is a float tensor of rank 2 (else fails `op`) and reads its view under
    /// `spec`.
    fn new<R: CubeRuntime>(op: &str, x: &CubeTensor<R>, spec: &QuantSpec) -> Self {
        check_float(op, "x", x.dtype);
        let (rows, k, stride_i, stride_j) = view(op, x, spec);
        Self {
            rows,
            k,
            stride_i,
            stride_j,
            block: spec.granularity == Fp8Granularity::Block128,
            tensor_scale: spec.granularity == Fp8Granularity::Tensor,
            vec4: stride_j == 1
                && crate::launch::vector_width(x, &[x.dtype], &[4, k, stride_i]) == 4,
            plane: crate::launch::use_planes(x, 256) && crate::launch::plane_size(x) == 32,
        }
    }

    /// Elements per load of `x` (the kernels' vector size).
    fn width(&self) -> usize {
        if self.vec4 {
            4
        } else {
            1
        }
    }

    /// The kernels' `amax` input: `[1]` with the amax of `x` for per-tensor scaling (`given`
    /// where the caller gives one), else an unread placeholder.
    fn amax<R: CubeRuntime>(
        &self,
        x: &CubeTensor<R>,
        given: Option<CubeTensor<R>>,
    ) -> CubeTensor<R> {
        match given {
            Some(amax) if self.tensor_scale => crate::launch::contiguous(amax),
            _ if self.tensor_scale => tensor_amax_of(x.clone()),
            _ => empty(x, vec![1], DType::F32),
        }
    }
}

/// Checks that a given per-tensor amax goes with a per-tensor spec and is f32 with at least one
/// element, the amax (else fails `op`).
fn check_given<R: CubeRuntime>(op: &str, spec: &QuantSpec, amax: &CubeTensor<R>) {
    if spec.granularity != Fp8Granularity::Tensor {
        fail(
            op,
            "a given amax needs per-tensor scaling (Fp8Granularity::Tensor)".to_string(),
        );
    }
    if amax.dtype != DType::F32 || amax.shape().num_elements() == 0 {
        fail(
            op,
            format!(
                "the given amax is {:?} of shape {:?}; expected f32, the amax first",
                amax.dtype,
                amax.shape().as_slice()
            ),
        );
    }
}

/// The f32 scales of a `[rows, k]` matrix quantized along `k` under `spec`, as the quantizers
/// write them: a buffer in the layout cuBLASLt's FP8 GEMM reads (see [`scale_at`]), returned as a
/// `[spec.scale_rows(rows), spec.scale_cols(k)]` view of it. 1x128 scales are the transposed view
/// of a dense `[k_tiles, rows]` buffer; 128x128 scales the first `k_tiles` columns of a dense
/// `[row_blocks, k_tiles4]` one. [`cublaslt_scales`] gives back the buffer.
///
/// [`scale_at`]: super::kernel::scale_at
pub(crate) fn scales_output<R: CubeRuntime>(
    like: &CubeTensor<R>,
    spec: &QuantSpec,
    rows: usize,
    k: usize,
) -> CubeTensor<R> {
    let (scale_rows, k_tiles) = (spec.scale_rows(rows), spec.scale_cols(k));
    match spec.granularity {
        Fp8Granularity::Tensor => empty(like, vec![scale_rows, k_tiles], DType::F32),
        Fp8Granularity::Tile1x128 => {
            let mut scales = empty(like, vec![k_tiles, scale_rows], DType::F32);
            scales.meta.swap(0, 1);
            scales
        }
        Fp8Granularity::Block128 => {
            let row_len = crate::gemm::cublaslt::Fp8Scales::block_row_len(k_tiles);
            let mut scales = empty(like, vec![scale_rows, row_len], DType::F32);
            scales.meta.shape_mut()[1] = k_tiles;
            scales
        }
    }
}

/// The buffer behind `scales` (f32, `[rows or row_blocks, k_tiles]`) in the layout cuBLASLt
/// reads for `layout`, when `scales` is a view of one as [`scales_output`] makes them: the
/// quantizers' scales, taken by the GEMM as they are. `None` for scales in another layout (the
/// CPU reference's dense rows, a user's tensor).
fn cublaslt_scales<R: CubeRuntime>(
    scales: &CubeTensor<R>,
    layout: crate::gemm::cublaslt::Fp8Scales,
) -> Option<CubeTensor<R>> {
    use crate::gemm::cublaslt::Fp8Scales;
    if scales.dtype != DType::F32 || scales.meta.num_dims() != 2 {
        return None;
    }
    let [rows, k_tiles] = [scales.meta.shape()[0], scales.meta.shape()[1]];
    let strides = [scales.meta.strides()[0], scales.meta.strides()[1]];
    let mut buffer = scales.clone();
    match layout {
        Fp8Scales::Tensor => (rows * k_tiles == 1).then_some(buffer),
        Fp8Scales::Vec128 => {
            // The transpose of a dense [k_tiles, rows] (a stride of a length-1 axis is unused).
            let dense = (rows == 1 || strides[0] == 1) && (k_tiles == 1 || strides[1] == rows);
            buffer.meta = Box::new(cubecl::zspace::metadata::Metadata::new(
                [k_tiles, rows],
                [rows, 1],
            ));
            dense.then_some(buffer)
        }
        Fp8Scales::Blk128 => {
            // The first k_tiles columns of a dense [row_blocks, k_tiles4].
            let row_len = Fp8Scales::block_row_len(k_tiles);
            let dense = (rows == 1 || strides[0] == row_len) && (k_tiles == 1 || strides[1] == 1);
            let bytes = (rows * row_len * 4) as u64;
            if !dense || buffer.handle.size_in_used() < bytes {
                return None;
            }
            buffer.meta = Box::new(cubecl::zspace::metadata::Metadata::new(
                [rows, row_len],
                [row_len, 1],
            ));
            Some(buffer)
        }
    }
}

/// `(payload [rows, k_pad / 4] as I32 words, f32 dequantization scales)`.
pub(crate) fn quantize<R: CubeRuntime>(
    x: CubeTensor<R>,
    spec: &QuantSpec,
) -> (CubeTensor<R>, CubeTensor<R>) {
    quantize_given(x, spec, None)
}

/// [`quantize`], with per-tensor scaling taking `given_amax` (f32, the amax first)
/// when given.
pub(crate) fn quantize_given<R: CubeRuntime>(
    x: CubeTensor<R>,
    spec: &QuantSpec,
    given_amax: Option<CubeTensor<R>>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let op = "fp8_quantize";
    if let Some(amax) = &given_amax {
        check_given(op, spec, amax);
    }
    let args = TileArgs::new(op, &x, spec);
    let (rows, k) = (args.rows, args.k);
    let k_tiles = k.div_ceil(TILE);
    let words = k_tiles * TILE / 4;
    let payload = empty(&x, vec![rows, words], DType::I32);
    let scales = scales_output(&x, spec, rows, k);
    if rows == 0 || k == 0 {
        // Nothing to scale: the per-tensor scale is 1, as for an all-zero tensor.
        let ones = burn::tensor::Tensor::<CubeBackend<R, f32, i32, u32>, 2>::ones(
            [spec.scale_rows(rows), spec.scale_cols(k)],
            (&x.device, DType::F32),
        );
        return (payload, ones.into_primitive().tensor());
    }
    let row_groups = match spec.granularity {
        Fp8Granularity::Block128 => rows.div_ceil(TILE),
        _ => rows.div_ceil(8),
    };
    if row_groups > MAX_CUBES_Y || k_tiles > crate::launch::max_cubes_x(&x) {
        fail(
            op,
            format!("a [{rows}, {k}] matrix is larger than the quantizer's launch grid supports"),
        );
    }
    let client = x.client.clone();
    let amax = args.amax(&x, given_amax);
    if args.stride_i == 1
        && args.stride_j > 1
        && !args.block
        && k_tiles <= MAX_CUBES_Y
        && rows.div_ceil(32) <= crate::launch::max_cubes_x(&x)
    {
        // The transpose of a row-major matrix: adjacent units read adjacent stored elements.
        let dtype = x.dtype;
        quantize_cols::launch::<R>(
            &client,
            CubeCount::Static(rows.div_ceil(32) as u32, k_tiles as u32, 1),
            CubeDim::new_2d(32, 8),
            x.into_array_arg(),
            amax.into_array_arg(),
            payload.clone().into_array_arg(),
            scales.clone().into_array_arg(),
            rows,
            k,
            args.stride_j,
            words,
            k_tiles,
            args.tensor_scale,
            spec.pow2,
            spec.format.consts(),
            dtype.into(),
        );
        return (payload, scales);
    }
    let dtype = x.dtype;
    quantize_kernel::launch::<R>(
        &client,
        CubeCount::Static(k_tiles as u32, row_groups as u32, 1),
        CubeDim::new_2d(32, 8),
        args.width(),
        x.into_array_arg(),
        amax.into_array_arg(),
        payload.clone().into_array_arg(),
        scales.clone().into_array_arg(),
        rows,
        k,
        args.stride_i,
        args.stride_j,
        words,
        args.block,
        args.tensor_scale,
        spec.pow2,
        args.vec4,
        args.plane,
        spec.format.consts(),
        dtype.into(),
    );
    (payload, scales)
}

/// `(payload, scales)` of a quantized matrix.
pub(crate) type Quantized<R> = (CubeTensor<R>, CubeTensor<R>);

/// `x` quantized as `spec` says along its columns (as stored) and along its rows (its transpose),
/// on `path`: from one read of `x` by the CUDA C++ kernel ([`super::native`], where it applies)
/// or by [`quantize_pair_tiles`] when the grid allows and both orientations share a granularity,
/// else in two passes. The transposed view of a row-major matrix is read element by element
/// (correct, not fast).
pub(crate) fn quantize_pair<R: CubeRuntime>(
    x: CubeTensor<R>,
    spec: &PairSpec,
    path: Fp8PairPath,
) -> (Quantized<R>, Quantized<R>) {
    quantize_pair_given(x, spec, path, None).0
}

/// A per-tensor amax given to [`quantize_pair_given`] (delayed scaling), and where to record
/// `x`'s own amax.
pub(crate) struct GivenAmax<R: CubeRuntime> {
    /// f32: the amax the scale is taken from, in its first element.
    pub amax: CubeTensor<R>,
    /// `(buffer, slot)`: the CUDA C++ kernel raises the f32 `buffer[slot]` to `x`'s amax in place.
    pub record: Option<(CubeTensor<R>, usize)>,
}

/// [`quantize_pair`], with per-tensor scaling taking the amax `given` holds; `true` beside the
/// pair when the kernel also recorded `x`'s amax as `given.record` asks (the CUDA C++ kernel;
/// the other paths record nothing).
pub(crate) fn quantize_pair_given<R: CubeRuntime>(
    x: CubeTensor<R>,
    pair: &PairSpec,
    path: Fp8PairPath,
    given: Option<GivenAmax<R>>,
) -> ((Quantized<R>, Quantized<R>), bool) {
    let spec = pair.stored();
    let (given_amax, record) = match given {
        Some(g) => {
            check_given("fp8_quantize_pair", &spec, &g.amax);
            (Some(g.amax), g.record)
        }
        None => (None, None),
    };
    let fused = path != Fp8PairPath::Separate;
    let args = TileArgs::new("fp8_quantize_pair", &x, &spec);
    let (rows, cols) = (args.rows, args.k);
    // The CubeCL kernel scales both orientations alike: a mixed pair it would run takes two passes.
    let cubecl = path != Fp8PairPath::Native || !super::native::supported(&x);
    if !fused || !pair_grid_fits(&x, rows, cols) || (pair.mixed() && cubecl) {
        return (quantize_separately(x, pair, given_amax), false);
    }
    let (row_tiles, col_tiles) = (rows.div_ceil(TILE), cols.div_ceil(TILE));
    let out = PairOutputs::new(&x, pair, rows, cols);
    let width = if args.stride_j == 1 {
        crate::launch::vector_width(&x, &[x.dtype], &[8, cols, args.stride_i])
    } else {
        1
    };
    let amax = args.amax(&x, given_amax);
    if path == Fp8PairPath::Native {
        let view = super::native::PairView {
            rows,
            cols,
            stride_i: args.stride_i,
            stride_j: args.stride_j,
        };
        let record = record.as_ref().map(|(buffer, slot)| (buffer, *slot));
        let none = super::native::Prologue::None;
        if super::native::launch_pair(&x, none, &amax, out.refs(), &view, pair, record) {
            return (out.into_pair(), record.is_some());
        }
    }
    assert!(
        !pair.mixed(),
        "kernels::fp8_quantize_pair: the CUDA C++ kernel refused a mixed pair it supports"
    );
    let (client, dtype) = (x.client.clone(), x.dtype);
    quantize_pair_tiles::launch::<R>(
        &client,
        CubeCount::Static(col_tiles as u32, row_tiles as u32, 1),
        CubeDim::new_1d(256),
        width,
        x.into_array_arg(),
        amax.into_array_arg(),
        out.payload.clone().into_array_arg(),
        out.scales.clone().into_array_arg(),
        out.payload_t.clone().into_array_arg(),
        out.scales_t.clone().into_array_arg(),
        rows,
        cols,
        args.stride_i,
        args.stride_j,
        width,
        args.block,
        args.tensor_scale,
        spec.pow2,
        spec.format.consts(),
        dtype.into(),
    );
    (out.into_pair(), false)
}

/// Both orientations of `x` as `pair` says, in two passes.
fn quantize_separately<R: CubeRuntime>(
    x: CubeTensor<R>,
    pair: &PairSpec,
    given_amax: Option<CubeTensor<R>>,
) -> (Quantized<R>, Quantized<R>) {
    let t = quantize_given(x.clone(), &pair.transposed(), given_amax.clone());
    (quantize_given(x, &pair.stored(), given_amax), t)
}

/// Whether a pair quantization of a `[rows, cols]` matrix fits one launch's grid (a cube per
/// 128 x 128 tile); an empty matrix does not.
fn pair_grid_fits<R: CubeRuntime>(x: &CubeTensor<R>, rows: usize, cols: usize) -> bool {
    let (row_tiles, col_tiles) = (rows.div_ceil(TILE), cols.div_ceil(TILE));
    rows > 0 && cols > 0 && row_tiles <= MAX_CUBES_Y && col_tiles <= crate::launch::max_cubes_x(x)
}

/// The four outputs of a pair quantization of a `[rows, cols]` matrix under `spec` (quantized
/// along `cols`): codes and scales as stored, and of the transpose.
struct PairOutputs<R: CubeRuntime> {
    payload: CubeTensor<R>,
    scales: CubeTensor<R>,
    payload_t: CubeTensor<R>,
    scales_t: CubeTensor<R>,
}

impl<R: CubeRuntime> PairOutputs<R> {
    fn new(x: &CubeTensor<R>, spec: &PairSpec, rows: usize, cols: usize) -> Self {
        let (row_tiles, col_tiles) = (rows.div_ceil(TILE), cols.div_ceil(TILE));
        Self {
            payload: empty(x, vec![rows, col_tiles * TILE / 4], DType::I32),
            scales: scales_output(x, &spec.stored(), rows, cols),
            payload_t: empty(x, vec![cols, row_tiles * TILE / 4], DType::I32),
            scales_t: scales_output(x, &spec.transposed(), cols, rows),
        }
    }

    /// In the order the CUDA C++ pair kernel takes them.
    fn refs(&self) -> [&CubeTensor<R>; 4] {
        [&self.payload, &self.scales, &self.payload_t, &self.scales_t]
    }

    fn into_pair(self) -> (Quantized<R>, Quantized<R>) {
        ((self.payload, self.scales), (self.payload_t, self.scales_t))
    }
}

/// `[1]`: the largest finite normal `|x|` of `x` (per-tensor scaling): one grid-stride pass over
/// `x`'s stored layout writing per-cube maxima (the CUDA C++ kernel where it applies, else the
/// CubeCL one), then their max.
pub(crate) fn tensor_amax_of<R: CubeRuntime>(x: CubeTensor<R>) -> CubeTensor<R> {
    let partials = match super::native::tensor_amax_partials(&x) {
        Some(partials) => partials,
        None => tensor_amax_partials(x),
    };
    let partials = burn::tensor::Tensor::<CubeBackend<R, f32, i32, u32>, 1>::from_primitive(
        burn::tensor::TensorPrimitive::Float(partials),
    );
    partials.max().into_primitive().tensor()
}

/// Per-cube maxima of the CubeCL kernel `tensor_amax` (f32 `[cubes]`).
fn tensor_amax_partials<R: CubeRuntime>(x: CubeTensor<R>) -> CubeTensor<R> {
    use crate::reduce::forward::{flat_cubes, SUM_UNITS};
    let read = crate::launch::flat_read(x);
    let cubes = flat_cubes(&read);
    let partials = empty(&read.x, vec![cubes], DType::F32);
    let plane = crate::launch::use_planes(&read.x, SUM_UNITS);
    let dtype = read.x.dtype;
    tensor_amax::launch::<R>(
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
        read.dense,
        crate::launch::reduce_slots(SUM_UNITS, plane),
        plane,
        dtype.into(),
    );
    partials
}

/// Per-cube rows `[amax, nonzero, underflow, saturated]` (f32, `[cubes, 4]`) of `x` against its
/// quantization `(payload, scales)` under `spec` (`spec.transpose` picks the view, as for
/// [`quantize`]): one read of `x` and of the codes.
pub(crate) fn health_partials<R: CubeRuntime>(
    x: CubeTensor<R>,
    payload: CubeTensor<R>,
    scales: CubeTensor<R>,
    spec: &QuantSpec,
) -> CubeTensor<R> {
    use crate::reduce::forward::SUM_UNITS;
    let op = "fp8_health";
    check_float(op, "x", x.dtype);
    let (rows, k, stride_i, stride_j) = view(op, &x, spec);
    let payload = crate::launch::contiguous(payload);
    let scales = crate::launch::contiguous(scales);
    let words = payload.shape().as_slice().get(1).copied().unwrap_or(0);
    if payload.shape().as_slice() != [rows, words] || words * 4 < k {
        fail(
            op,
            format!(
                "payload has shape {:?}; expected [{rows}, >= {}] for x's [{rows}, {k}] view",
                payload.shape().as_slice(),
                k.div_ceil(4)
            ),
        );
    }
    let total = rows * words;
    let cubes = total
        .div_ceil(SUM_UNITS * 4)
        .clamp(1, 4 * crate::launch::num_sms(&x));
    let partials = empty(&x, vec![cubes, 4], DType::F32);
    let plane = crate::launch::use_planes(&x, SUM_UNITS);
    let (client, dtype) = (x.client.clone(), x.dtype);
    health_kernel::launch::<R>(
        &client,
        CubeCount::Static(cubes as u32, 1, 1),
        CubeDim::new_1d(SUM_UNITS as u32),
        x.into_array_arg(),
        payload.into_array_arg(),
        scales.into_array_arg(),
        partials.clone().into_array_arg(),
        rows,
        k,
        stride_i,
        stride_j,
        words,
        spec.format.clip_threshold(),
        spec.granularity.kernel_code(),
        crate::launch::reduce_slots(SUM_UNITS, plane),
        plane,
        dtype.into(),
    );
    partials
}

/// `[rows, k_out]` values of a payload in `dtype` (`k_out` <= the padded width).
pub(crate) fn dequantize<R: CubeRuntime>(
    payload: CubeTensor<R>,
    scales: CubeTensor<R>,
    rows: usize,
    k_out: usize,
    spec: &QuantSpec,
    dtype: FloatDType,
) -> CubeTensor<R> {
    let op = "fp8_dequantize";
    let words = payload.shape().as_slice().get(1).copied().unwrap_or(0);
    if payload.shape().as_slice() != [rows, words] || k_out > words * 4 {
        fail(
            op,
            format!(
                "payload has shape {:?}; expected [{rows}, >= {}]",
                payload.shape().as_slice(),
                k_out.div_ceil(4)
            ),
        );
    }
    let payload = crate::launch::contiguous(payload);
    let scales = crate::launch::contiguous(scales);
    let dtype: DType = dtype.into();
    let out = empty(&payload, vec![rows, k_out], dtype);
    let n = rows * words;
    if n == 0 {
        return out;
    }
    let client = payload.client.clone();
    let cubes = n.div_ceil(256);
    let (cx, cy) = if cubes > crate::launch::max_cubes_x(&payload) {
        (65535, cubes.div_ceil(65535))
    } else {
        (cubes, 1)
    };
    dequantize_kernel::launch::<R>(
        &client,
        CubeCount::Static(cx as u32, cy as u32, 1),
        CubeDim::new_1d(256),
        payload.into_array_arg(),
        scales.into_array_arg(),
        out.clone().into_array_arg(),
        rows,
        k_out,
        words,
        spec.granularity.kernel_code(),
        spec.format.consts(),
        dtype.into(),
    );
    out
}

/// Whether the device runs `mma.sync` m16n8k32 on E4M3 (CUDA sm_89+).
pub(crate) fn mma_supported<R: CubeRuntime>(t: &CubeTensor<R>) -> bool {
    use cubecl::ir::features::MmaConfig;
    use cubecl::ir::{ElemType, FloatKind, StorageType as St};
    let props = t.client.properties();
    let e4m3 = St::Scalar(ElemType::Float(FloatKind::E4M3));
    crate::launch::plane_size(t) == 32
        && props.features.matmul.mma.contains(&MmaConfig {
            a_type: e4m3,
            b_type: e4m3,
            cd_type: DType::F32.into(),
            m: 16,
            n: 8,
            k: 32,
        })
}

/// `a [m, k] x b [n, k]^T` on tensor cores, or `None` where that path does not apply (device
/// without E4M3 MMA, or operands other than E4M3 with 1x128 / 128x128 / per-tensor scales).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_mma<R: CubeRuntime>(
    a: CubeTensor<R>,
    sa: CubeTensor<R>,
    a_spec: &QuantSpec,
    b: CubeTensor<R>,
    sb: CubeTensor<R>,
    b_spec: &QuantSpec,
    m: usize,
    n: usize,
    out: FloatDType,
) -> Option<CubeTensor<R>> {
    use super::Fp8Format;
    let fits = a_spec.format == Fp8Format::E4M3
        && b_spec.format == Fp8Format::E4M3
        && matches!(
            a_spec.granularity,
            Fp8Granularity::Tile1x128 | Fp8Granularity::Tensor
        )
        && matches!(
            b_spec.granularity,
            Fp8Granularity::Block128 | Fp8Granularity::Tensor
        );
    let shape = super::mma_shape();
    if !fits || !mma_supported(&a) || n.div_ceil(shape.block_n()) > MAX_CUBES_Y {
        return None;
    }
    let words = a.shape().as_slice()[1];
    let k_tiles = words * 4 / TILE;
    let (a, b, sa, sb) = (
        crate::launch::contiguous(a),
        crate::launch::contiguous(b),
        crate::launch::contiguous(sa),
        crate::launch::contiguous(sb),
    );
    let dtype: DType = out.into();
    let c = empty(&a, vec![m, n], dtype);
    if m == 0 || n == 0 {
        return Some(c);
    }
    let client = a.client.clone();
    unsafe {
        super::mma::gemm_mma::launch_unchecked::<R>(
            &client,
            CubeCount::Static(
                m.div_ceil(shape.block_m()) as u32,
                n.div_ceil(shape.block_n()) as u32,
                1,
            ),
            CubeDim::new_2d(32, (shape.wm * shape.wn) as u32),
            8,
            a.into_array_arg(),
            b.into_array_arg(),
            sa.into_array_arg(),
            sb.into_array_arg(),
            c.clone().into_array_arg(),
            m,
            n,
            k_tiles,
            shape.wm,
            shape.wn,
            shape.mt,
            shape.nt,
            a_spec.granularity == Fp8Granularity::Tensor,
            b_spec.granularity == Fp8Granularity::Tensor,
            dtype.into(),
        );
    }
    Some(c)
}

/// The FP8 GEMM `[m, k] x [n, k]^T` on cuBLASLt (CUDA tensors, cuBLASLt >= 12.9 for tile and block
/// scales), or `None` where it does not apply (another backend or device, shapes or formats
/// cuBLASLt does not take; a refusal for another reason is also printed once).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_cublaslt<R, F, I, BT>(
    a: CubeTensor<R>,
    sa: CubeTensor<R>,
    a_spec: &QuantSpec,
    b: CubeTensor<R>,
    sb: CubeTensor<R>,
    b_spec: &QuantSpec,
    m: usize,
    n: usize,
    out: FloatDType,
) -> Option<CubeTensor<R>>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    use crate::gemm::cublaslt::{
        as_cuda, fell_back, fp8_gemm, from_cuda, Fp8Operand, Fp8Scales, Refused,
    };
    use burn::tensor::{Tensor, TensorPrimitive};
    type Cb<R, F, I, BT> = CubeBackend<R, F, I, BT>;

    let (ca, cb) = (as_cuda(&a)?.clone(), as_cuda(&b)?.clone());
    let k_pad = a.shape().as_slice()[1] * 4;
    let device = a.device.clone();
    // Scales in the layout cuBLASLt reads (see `Fp8Scales`): 1x128 tiles transposed so that rows
    // are contiguous; 128x128 blocks with the tile count padded to a multiple of 4. The
    // quantizers write them so ([`scales_output`]); scales from elsewhere are rearranged here.
    let operand = |payload: CubeTensor<cubecl::cuda::CudaRuntime>,
                   scales: CubeTensor<R>,
                   spec: &QuantSpec,
                   rows: usize|
     -> Option<Fp8Operand> {
        let layout = match spec.granularity {
            Fp8Granularity::Tensor => Fp8Scales::Tensor,
            Fp8Granularity::Tile1x128 => Fp8Scales::Vec128,
            Fp8Granularity::Block128 => Fp8Scales::Blk128,
        };
        let scales = match cublaslt_scales(&scales, layout) {
            Some(buffer) => buffer,
            None => {
                let s =
                    Tensor::<Cb<R, F, I, BT>, 2>::from_primitive(TensorPrimitive::Float(scales))
                        .cast(FloatDType::F32);
                let s = match layout {
                    Fp8Scales::Tensor => s,
                    Fp8Scales::Vec128 => s.transpose(),
                    Fp8Scales::Blk128 => {
                        let [r, l] = s.dims();
                        let l4 = Fp8Scales::block_row_len(l);
                        if l4 > l {
                            Tensor::cat(
                                vec![s, Tensor::zeros([r, l4 - l], (&device, DType::F32))],
                                1,
                            )
                        } else {
                            s
                        }
                    }
                };
                crate::launch::contiguous(s.into_primitive().tensor())
            }
        };
        Some(Fp8Operand {
            payload,
            scales: as_cuda(&scales)?.clone(),
            e5m2: spec.format == super::Fp8Format::E5M2,
            layout,
            rows,
        })
    };
    // What computes the product if the GEMM is queued and cuBLASLt fails it there after all: the
    // operands dequantized (into the output's dtype) and Burn's matmul, on the device thread.
    let fallback = {
        let (a, sa, b, sb) = (a.clone(), sa.clone(), b.clone(), sb.clone());
        let (a_spec, b_spec) = (*a_spec, *b_spec);
        move |c: CubeTensor<cubecl::cuda::CudaRuntime>| -> Result<(), String> {
            let a = dequantize(a, sa, m, k_pad, &a_spec, out);
            let b = dequantize(b, sb, n, k_pad, &b_spec, out);
            burn_cubecl::kernel::matmul::matmul(
                a,
                burn_cubecl::ops::permute(b, &[1, 0]),
                Some(from_cuda::<R>(c)),
                burn_cubecl::kernel::matmul::MatmulStrategy::Cube,
                out.into(),
            )
            .map(|_| ())
            .map_err(|e| format!("{e:?}"))
        }
    };
    let oa = operand(ca, sa, a_spec, m)?;
    let ob = operand(cb, sb, b_spec, n)?;
    match fp8_gemm(oa, ob, k_pad, out.into(), Box::new(fallback)) {
        Ok(c) => Some(from_cuda(c)),
        Err(Refused::Unsupported(why)) => {
            fell_back(format!(
                "kernels::fp8_gemm: {why}; this GEMM takes another path"
            ));
            None
        }
        Err(Refused::NotApplicable) => None,
    }
}

/// [`Fp8Ops::fp8_act_quantize_pair`] on `CubeBackend`: the CUDA C++ pair kernel with the
/// activation's prologue, or `None` where it does not run (see `producer.rs`; per-tensor scaling
/// without a given amax).
#[allow(clippy::type_complexity)]
pub(crate) fn act_quantize_pair_native<R: CubeRuntime>(
    h: CubeTensor<R>,
    dy: Option<CubeTensor<R>>,
    act: super::Fp8MlpActivation,
    spec: &PairSpec,
    given: Option<(CubeTensor<R>, Option<(CubeTensor<R>, usize)>)>,
) -> Option<((Quantized<R>, Quantized<R>), bool)> {
    use super::Fp8MlpActivation::{Gelu, SwigluPacked};
    if !super::native::supported(&h)
        || (act == SwigluPacked && !crate::settings::get().fp8_swiglu_producer)
    {
        return None;
    }
    let dims = h.shape().as_slice().to_vec();
    let per_tensor = spec.spec.granularity == Fp8Granularity::Tensor;
    if dims.len() != 2 || per_tensor != given.is_some() || !h.is_contiguous() {
        return None;
    }
    let (rows, h_cols) = (dims[0], dims[1]);
    if act == SwigluPacked && !h_cols.is_multiple_of(2) {
        return None;
    }
    // What `dy` must be: the activation's output's shape.
    let [_, dy_cols] = act.out_dims([rows, h_cols], false);
    let dy = match dy {
        Some(dy) => {
            let dy = crate::launch::contiguous(burn_cubecl::kernel::cast(dy, h.dtype));
            if dy.shape().as_slice() != [rows, dy_cols] {
                return None;
            }
            Some(dy)
        }
        None => None,
    };
    // The quantized matrix: the output, or the gradient with respect to `h`.
    let [_, cols] = act.out_dims([rows, h_cols], dy.is_some());
    if !pair_grid_fits(&h, rows, cols) {
        return None;
    }
    let out = PairOutputs::new(&h, spec, rows, cols);
    // Tiles and blocks take their own amax: the kernel reads it for per-tensor scaling only.
    let (amax, record) = match given {
        Some((amax, record)) => (crate::launch::contiguous(amax), record),
        None => (empty(&h, vec![1], DType::F32), None),
    };
    let view = super::native::PairView {
        rows,
        cols,
        stride_i: h_cols,
        stride_j: 1,
    };
    let prologue = match (act, &dy) {
        (Gelu, Some(dy)) => super::native::Prologue::GeluGrad(dy),
        (Gelu, None) => super::native::Prologue::Gelu,
        (SwigluPacked, Some(dy)) => super::native::Prologue::SwigluGrad(dy),
        (SwigluPacked, None) => super::native::Prologue::Swiglu,
    };
    let record = record.as_ref().map(|(buffer, slot)| (buffer, *slot));
    let recorded = record.is_some();
    super::native::launch_pair(&h, prologue, &amax, out.refs(), &view, spec, record)
        .then(|| (out.into_pair(), recorded))
}

impl<R, F, I, BT> super::Fp8Ops for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn fp8_quantize(
        x: FloatTensor<Self>,
        spec: &QuantSpec,
    ) -> (IntTensor<Self>, FloatTensor<Self>) {
        quantize(x, spec)
    }
    fn fp8_quantize_pair(
        x: FloatTensor<Self>,
        spec: &PairSpec,
        path: Fp8PairPath,
    ) -> (
        (IntTensor<Self>, FloatTensor<Self>),
        (IntTensor<Self>, FloatTensor<Self>),
    ) {
        quantize_pair(x, spec, path)
    }
    fn fp8_tensor_amax(x: FloatTensor<Self>) -> FloatTensor<Self> {
        check_float("fp8_tensor_amax", "x", x.dtype);
        if x.shape().num_elements() == 0 {
            let zero = burn::tensor::Tensor::<CubeBackend<R, f32, i32, u32>, 1>::zeros(
                [1],
                (&x.device, DType::F32),
            );
            return zero.into_primitive().tensor();
        }
        tensor_amax_of(x)
    }
    fn fp8_quantize_given(
        x: FloatTensor<Self>,
        spec: &QuantSpec,
        amax: FloatTensor<Self>,
    ) -> (IntTensor<Self>, FloatTensor<Self>) {
        quantize_given(x, spec, Some(amax))
    }
    fn fp8_quantize_pair_given(
        x: FloatTensor<Self>,
        spec: &QuantSpec,
        path: Fp8PairPath,
        amax: FloatTensor<Self>,
        record: Option<(FloatTensor<Self>, usize)>,
    ) -> (
        (
            (IntTensor<Self>, FloatTensor<Self>),
            (IntTensor<Self>, FloatTensor<Self>),
        ),
        bool,
    ) {
        let pair = PairSpec::from(*spec);
        quantize_pair_given(x, &pair, path, Some(GivenAmax { amax, record }))
    }
    fn fp8_dequantize(
        payload: IntTensor<Self>,
        scales: FloatTensor<Self>,
        rows: usize,
        k_out: usize,
        spec: &QuantSpec,
        dtype: FloatDType,
    ) -> FloatTensor<Self> {
        dequantize(payload, scales, rows, k_out, spec, dtype)
    }
    fn fp8_health_partials(
        x: FloatTensor<Self>,
        payload: IntTensor<Self>,
        scales: FloatTensor<Self>,
        spec: &QuantSpec,
    ) -> FloatTensor<Self> {
        health_partials(x, payload, scales, spec)
    }
    #[allow(clippy::type_complexity)]
    fn fp8_act_quantize_pair(
        h: FloatTensor<Self>,
        dy: Option<FloatTensor<Self>>,
        act: super::Fp8MlpActivation,
        spec: &PairSpec,
        given: Option<(FloatTensor<Self>, Option<(FloatTensor<Self>, usize)>)>,
    ) -> Option<((Quantized<R>, Quantized<R>), bool)> {
        act_quantize_pair_native(h, dy, act, spec, given)
    }
    fn fp8_mlp(
        x: FloatTensor<Self>,
        w_fc: FloatTensor<Self>,
        w_proj: FloatTensor<Self>,
        act: super::Fp8MlpActivation,
        cfg: &super::Fp8LinearConfig,
        sites: Option<(super::Fp8ScaleSite, super::Fp8ScaleSite)>,
    ) -> Option<FloatTensor<Self>> {
        use crate::primitive::{prim, tensor};
        let (x, w_fc, w_proj) = (tensor(x), tensor(w_fc), tensor(w_proj));
        let sites = sites.as_ref().map(|(fc, proj)| (fc, proj));
        Some(prim(super::mlp::fprop::<Self>(
            x, w_fc, w_proj, act, cfg, sites,
        )))
    }
    fn fp8_native_supported(x: &FloatTensor<Self>) -> bool {
        super::native::supported(x)
    }
    fn fp8_mma_supported(payload: &IntTensor<Self>) -> bool {
        mma_supported(payload)
    }
    fn fp8_gemm_mma(
        a: IntTensor<Self>,
        sa: FloatTensor<Self>,
        a_spec: &QuantSpec,
        b: IntTensor<Self>,
        sb: FloatTensor<Self>,
        b_spec: &QuantSpec,
        m: usize,
        n: usize,
        out: FloatDType,
    ) -> Option<FloatTensor<Self>> {
        gemm_mma(a, sa, a_spec, b, sb, b_spec, m, n, out)
    }
    fn fp8_cublaslt_supported(payload: &IntTensor<Self>) -> bool {
        crate::gemm::cublaslt::as_cuda(payload)
            .is_some_and(crate::gemm::cublaslt::fp8_block_scaling_supported)
    }
    fn fp8_gemm_cublaslt(
        a: IntTensor<Self>,
        sa: FloatTensor<Self>,
        a_spec: &QuantSpec,
        b: IntTensor<Self>,
        sb: FloatTensor<Self>,
        b_spec: &QuantSpec,
        m: usize,
        n: usize,
        out: FloatDType,
    ) -> Option<FloatTensor<Self>> {
        gemm_cublaslt::<R, F, I, BT>(a, sa, a_spec, b, sb, b_spec, m, n, out)
    }
}
