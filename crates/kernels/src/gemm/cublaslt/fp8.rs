//! The FP8 GEMM on cuBLASLt: operands with per-tensor, 1x128 or 128x128 block scales.

use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cudarc::cublaslt::sys;

use super::device::device;
use super::job::{Job, QueuedFallback};
use super::order::fp8_order;
use super::problem::{data_type, dims2, Layout, Problem};
use super::queue::execute;
use super::{library, Refused};

/// How an FP8 operand's scales are laid out for cuBLASLt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fp8Scales {
    /// One f32 scale for the matrix (`SCALAR_32F`).
    Tensor,
    /// Per row per 128 of k (`VEC128_32F`): f32 `[k_tiles, rows]`, rows contiguous.
    Vec128,
    /// Per 128 x 128 block (`BLK128x128_32F`): f32 `[ceil(rows / 128), k_tiles4]`, k contiguous,
    /// `k_tiles4` the tile count rounded up to a multiple of 4 (zero-padded).
    Blk128,
}

impl Fp8Scales {
    /// The length of a row of 128 x 128 block scales ([`Fp8Scales::Blk128`]) for `k_tiles`
    /// tiles of k: rounded up to a multiple of 4, the padding zeroed.
    pub(crate) fn block_row_len(k_tiles: usize) -> usize {
        k_tiles.div_ceil(4) * 4
    }
}

/// One FP8 operand in cuBLASLt's terms: payload words `[rows, k_pad / 4]` (four E4M3 or E5M2
/// codes each, little-endian, so the bytes are the row-major `[rows, k_pad]` codes) and its scales,
/// already in the layout `scales` names.
pub(crate) struct Fp8Operand {
    pub payload: CubeTensor<CudaRuntime>,
    pub scales: CubeTensor<CudaRuntime>,
    pub e5m2: bool,
    pub layout: Fp8Scales,
    pub rows: usize,
}

/// The first cuBLASLt version with 1x128 and 128x128 FP8 block scaling (12.9, Hopper).
const BLOCK_SCALING_VERSION: usize = 120900;

/// Whether cuBLASLt's 1x128 / 128x128 block-scaled FP8 GEMM runs on `t`'s device: CUDA, a
/// cuBLASLt that has it (12.9+), and a Hopper GPU (compute capability 9.x; cuBLASLt scales FP8
/// blocks this way on Hopper only).
pub(crate) fn fp8_block_scaling_supported(t: &CubeTensor<CudaRuntime>) -> bool {
    if !library().is_ok_and(|v| v >= BLOCK_SCALING_VERSION) {
        return false;
    }
    let state = device(t.device.index);
    let state = state.lock().unwrap_or_else(|p| p.into_inner());
    state.as_ref().is_ok_and(|d| d.major == 9)
}

/// `a [m, k] x b [n, k]^T -> [m, n]` in `out` on cuBLASLt's FP8 tensor cores, both operands
/// quantized along k (padded to `k_pad`, a multiple of 128, with zero codes); or why not.
///
/// cuBLASLt's FP8 GEMM on Hopper takes the "TN" form: its A (our `b`) transposed and its B (our
/// `a`) not, both with k contiguous, which is how the payloads are stored. Its requirements,
/// checked here: not both operands E5M2; not both 128x128 blocks; either both scaled per tensor or
/// both by tiles/blocks (cuBLASLt >= 12.9); m and n multiples of 8; rows of 16-byte multiples.
///
/// `fallback` computes the product into the output it is given another way: a problem that has
/// run here before is queued without waiting (see `queue::execute`), and if cuBLASLt fails it
/// after all, `fallback` runs on the device thread in its place.
pub(crate) fn fp8_gemm(
    a: Fp8Operand,
    b: Fp8Operand,
    k_pad: usize,
    out: DType,
    fallback: Box<dyn FnOnce(CubeTensor<CudaRuntime>) -> Result<(), String> + Send>,
) -> Result<CubeTensor<CudaRuntime>, Refused> {
    use sys::cublasLtMatmulMatrixScale_t::*;
    use sys::cudaDataType::*;
    let Some((dt_out, _)) = data_type(out) else {
        return Err(Refused::NotApplicable);
    };
    let version = library().map_err(|_| Refused::NotApplicable)?;
    let (m, n) = (a.rows, b.rows);
    let block = a.layout != Fp8Scales::Tensor;
    if (a.e5m2 && b.e5m2)
        || (a.layout == Fp8Scales::Blk128 && b.layout == Fp8Scales::Blk128)
        || (a.layout == Fp8Scales::Tensor) != (b.layout == Fp8Scales::Tensor)
        || (block && version < BLOCK_SCALING_VERSION)
        || m == 0
        || n == 0
        || m % 8 != 0
        || n % 8 != 0
        || k_pad == 0
        || !k_pad.is_multiple_of(128)
        || a.payload.device != b.payload.device
    {
        return Err(Refused::NotApplicable);
    }
    // The scales must be exactly what cuBLASLt reads for the layout, densely stored.
    let tiles = k_pad / 128;
    for t in [&a, &b] {
        let want = match t.layout {
            Fp8Scales::Tensor => [1, 1],
            Fp8Scales::Vec128 => [tiles, t.rows],
            Fp8Scales::Blk128 => [t.rows.div_ceil(128), Fp8Scales::block_row_len(tiles)],
        };
        let (shape, strides) = dims2(&t.scales);
        // (The stride of a length-1 axis is never used.)
        let dense = (shape[1] == 1 || strides[1] == 1) && (shape[0] == 1 || strides[0] == want[1]);
        if t.payload.meta.shape()[0] != t.rows
            || shape != want
            || !dense
            || t.scales.dtype != DType::F32
        {
            return Err(Refused::Unsupported(format!(
                "FP8 operand of {} rows: payload {:?}, {:?} scales {:?} with strides {:?} ({:?}); expected f32 scales {want:?}, dense",
                t.rows,
                t.payload.meta.shape(),
                t.layout,
                shape,
                strides,
                t.scales.dtype
            )));
        }
    }
    let codes =
        |t: &Fp8Operand, trans: bool| -> Result<(CubeTensor<CudaRuntime>, Layout), Refused> {
            let t_payload = if t.payload.meta.strides()[1] == 1 {
                t.payload.clone()
            } else {
                into_contiguous(t.payload.clone())
            };
            let words = t_payload.meta.strides()[0];
            if t_payload.meta.shape()[1] * 4 != k_pad
                || (words * 4) % 16 != 0
                || t.payload.dtype.size() != 4
            {
                return Err(Refused::Unsupported(format!(
                    "FP8 payload {:?} of {:?} (strides {:?}) is not [rows, {}] 32-bit words",
                    t_payload.meta.shape(),
                    t_payload.dtype,
                    t_payload.meta.strides(),
                    k_pad / 4
                )));
            }
            Ok((
                t_payload,
                Layout {
                    rows: t.rows,
                    cols: k_pad,
                    ld: words * 4,
                    trans,
                },
            ))
        };
    let (pa, la) = codes(&a, false)?;
    let (pb, lb) = codes(&b, true)?;
    let mode = |l: Fp8Scales| match l {
        Fp8Scales::Tensor => CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F,
        Fp8Scales::Vec128 => CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
        Fp8Scales::Blk128 => CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
    };
    let format = |e5m2: bool| if e5m2 { CUDA_R_8F_E5M2 } else { CUDA_R_8F_E4M3 };
    let c = empty_device_contiguous_dtype(
        pa.client.clone(),
        pa.device.clone(),
        Shape::new([m, n]),
        out,
    );
    let problem = Problem {
        types: [format(b.e5m2), format(a.e5m2), dt_out],
        compute: sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        scale_modes: Some([mode(b.layout), mode(a.layout)]),
        m,
        n,
        k: k_pad,
        a: la,
        b: lb,
        align: [0; 3],
        epilogue: super::Epilogue::None,
    };
    execute(Job {
        a: pa,
        b: pb,
        out: c.clone(),
        scales: Some((a.scales.clone(), b.scales.clone())),
        aux: None,
        problem,
        fallback: QueuedFallback::Compute(fallback),
        beta: 0.0,
        order: fp8_order(),
        caller: std::thread::current().id(),
    })?;
    Ok(c)
}
