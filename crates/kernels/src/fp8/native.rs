//! The FP8 quantizer pair in CUDA C++ (`native_pair.cu`): the CubeCL kernel
//! `quantize_pair_tiles`'s tiles and bytes, with the GPU's FP8 conversion instruction in place of
//! the integer encoding that CubeCL 0.10 emits (its E4M3 / E5M2 casts do not saturate, so the
//! CubeCL kernels encode with integer operations, about 25 per value). CUDA, compute capability
//! 8.9+ (Ada, Hopper and later); [`launch_pair`] says where it applies. The same source holds the
//! per-tensor amax of dense tensors ([`tensor_amax_partials`], the CubeCL `tensor_amax`'s
//! counterpart), which every quantizer path that scales per tensor takes where it applies.

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::cuda::CudaRuntime;
use cubecl::ir::{ElemType, FloatKind, StorageType};
use cubecl::prelude::*;

use super::{Fp8Format, Fp8Granularity, PairSpec, QuantSpec};
use crate::cuda_source::{launch, CudaSource};
use crate::gemm::cublaslt::as_cuda as cuda;

const SOURCE: &str = include_str!("native_pair.cu");
const ENTRY: &str = "fp8_quantize_pair_native";
const AMAX_ENTRY: &str = "fp8_tensor_amax_native";
/// The pair kernel's `record_slot` when it records no amax.
const NO_SLOT: u64 = u64::MAX;

/// The kernel's `IN_KIND` for an input dtype it reads (f32, f16, bf16).
fn in_kind(dtype: DType) -> Option<u8> {
    match dtype {
        DType::F32 => Some(0),
        DType::F16 => Some(1),
        DType::BF16 => Some(2),
        _ => None,
    }
}

/// Whether the kernel runs for `x`: an input dtype it reads, on a CUDA GPU with the FP8
/// conversion instructions (compute capability 8.9+, where CubeCL registers FP8 conversions).
pub(crate) fn supported<R: CubeRuntime>(x: &CubeTensor<R>) -> bool {
    in_kind(x.dtype).is_some()
        && cuda(x).is_some_and(|x| {
            let e4m3 = StorageType::Scalar(ElemType::Float(FloatKind::E4M3));
            x.client
                .properties()
                .type_usage(e4m3)
                .contains(cubecl::ir::features::TypeUsage::Conversion)
        })
}

/// Whether `x`'s data starts on a 16-byte boundary (the kernels' 16-byte loads need it).
fn aligned_16<R: CubeRuntime>(x: &CubeTensor<R>) -> bool {
    x.handle.offset_start.unwrap_or(0).is_multiple_of(16)
}

/// What the pair kernel quantizes (`native_pair.cu`'s `PROLOGUE`): its input as it is, or a
/// function of it computed in f32 and rounded to the input's dtype, as the separate kernel that
/// computes that function stores it.
#[derive(Clone, Copy)]
pub(crate) enum Prologue<'a, R: CubeRuntime> {
    /// `x` itself.
    None,
    /// `GELU(x)` (exact, erf form: [`crate::gelu`]).
    Gelu,
    /// The GELU gradient `dy * GELU'(x)`, `dy` stored as `x` is (same dtype, shape and strides).
    GeluGrad(&'a CubeTensor<R>),
    /// SwiGLU of the packed `x` `[rows, 2 * ff]` (gate, then up): `silu(gate) * up`, the stored
    /// matrix `[rows, ff]` of the view (`stride_j` 1, `stride_i` `x`'s row stride).
    Swiglu,
    /// SwiGLU's packed gradient `[rows, 2 * ff]` (gate half, up half) from the packed `x` (the
    /// view: `[rows, 2 * ff]`, `stride_j` 1) and `dy`, dense `[rows, ff]` in `x`'s dtype.
    SwigluGrad(&'a CubeTensor<R>),
}

impl<R: CubeRuntime> Prologue<'_, R> {
    fn code(&self) -> u8 {
        match self {
            Prologue::None => 0,
            Prologue::Gelu => 1,
            Prologue::GeluGrad(_) => 2,
            Prologue::Swiglu => 3,
            Prologue::SwigluGrad(_) => 4,
        }
    }

    /// Whether it is SwiGLU's, which reads the gate and up halves of a packed input.
    fn swiglu(&self) -> bool {
        matches!(self, Prologue::Swiglu | Prologue::SwigluGrad(_))
    }
}

/// The `#define` lines that pick a variant of `native_pair.cu` (its header lists them): input
/// kind, 8-wide loads, the granularities, scale rounding and format of `pair`, and the prologue.
fn defines(in_kind: u8, vec: bool, pair: &PairSpec, prologue: u8) -> String {
    let spec = pair.stored();
    let flags = [
        vec,
        spec.granularity == Fp8Granularity::Block128,
        pair.mixed(),
        spec.granularity == Fp8Granularity::Tensor,
        spec.pow2,
        spec.format == Fp8Format::E5M2,
    ];
    let [vec, block, t_block, given_amax, pow2, e5m2] = flags.map(u8::from);
    format!(
        "#define IN_KIND {in_kind}\n#define VEC {vec}\n#define BLOCK {block}\n\
         #define T_BLOCK {t_block}\n#define GIVEN_AMAX {given_amax}\n#define POW2 {pow2}\n\
         #define E5M2 {e5m2}\n#define PROLOGUE {prologue}\n"
    )
}

/// The stored matrix the pair kernel reads: `[rows, cols]`, element `(i, j)` at
/// `i * stride_i + j * stride_j` of `x`.
pub(crate) struct PairView {
    pub rows: usize,
    pub cols: usize,
    pub stride_i: usize,
    pub stride_j: usize,
}

/// Quantizes `x` in both orientations as `spec` says into `payload`, `scales`, `payload_t`,
/// `scales_t` (shaped and laid out as for the CubeCL kernel `quantize_pair_tiles`, the transpose's
/// scales as for a 128 x 128 block matrix where `spec` mixes granularities; `amax` holds the
/// tensor's amax for per-tensor scaling) with the CUDA C++ kernel, or returns `false` without launching anything
/// where it does not apply: not CUDA, a GPU without FP8 conversions, an input other than f32,
/// f16 or bf16. With per-tensor scaling and `record = Some((buffer, slot))`, the kernel also
/// raises the f32 `buffer[slot]` to `x`'s amax (the largest finite normal `|x|`), in place.
/// With a `prologue`, what it quantizes is that function of `x` (a per-tensor `amax` must then be
/// the function's; a GELU `dy` stored otherwise than `x`, a SwiGLU `dy` other than dense
/// `[rows, ff]` in `x`'s dtype, or a SwiGLU view with `stride_j` other than 1 or an odd number of
/// gradient columns is refused: `false`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_pair<R: CubeRuntime>(
    x: &CubeTensor<R>,
    prologue: Prologue<'_, R>,
    amax: &CubeTensor<R>,
    outputs: [&CubeTensor<R>; 4],
    view: &PairView,
    spec: &PairSpec,
    record: Option<(&CubeTensor<R>, usize)>,
) -> bool {
    if !supported(x) {
        return false;
    }
    // SwiGLU's gate and up columns: the output's, or half the gradient's.
    let ff = match prologue {
        Prologue::SwigluGrad(_) => view.cols / 2,
        _ => view.cols,
    };
    if prologue.swiglu() && (view.stride_j != 1 || view.stride_i < 2 * ff) {
        return false;
    }
    let dy = match prologue {
        Prologue::None | Prologue::Gelu | Prologue::Swiglu => x,
        Prologue::GeluGrad(dy) => {
            let same = dy.dtype == x.dtype
                && dy.meta.shape() == x.meta.shape()
                && dy.meta.strides() == x.meta.strides()
                && aligned_16(dy) == aligned_16(x);
            if !same {
                return false;
            }
            dy
        }
        Prologue::SwigluGrad(dy) => {
            let dense = dy.dtype == x.dtype
                && view.cols.is_multiple_of(2)
                && dy.meta.shape().as_slice() == [view.rows, ff]
                && dy.is_contiguous();
            if !dense {
                return false;
            }
            dy
        }
    };
    let Some(dy) = cuda(dy) else {
        return false;
    };
    let (Some(in_kind), Some(xc), Some(amax)) = (in_kind(x.dtype), cuda(x), cuda(amax)) else {
        return false;
    };
    let (record_buffer, record_slot) = match record {
        Some((buffer, slot)) => match cuda(buffer) {
            Some(buffer) if buffer.dtype == DType::F32 && buffer.is_contiguous() => {
                (buffer, slot as u64)
            }
            _ => return false,
        },
        None => (amax, NO_SLOT),
    };
    let Some(outputs) = outputs
        .into_iter()
        .map(cuda)
        .collect::<Option<Vec<&CubeTensor<CudaRuntime>>>>()
    else {
        return false;
    };
    // 8 values per row at once: 16-byte loads (two for f32) from 16-byte aligned addresses;
    // under SwiGLU's prologues, 8 columns of the gate or up half (and of `dy`) at once.
    let vec = view.stride_j == 1
        && view.cols.is_multiple_of(8)
        && view.stride_i.is_multiple_of(8)
        && aligned_16(x)
        && (!prologue.swiglu() || (ff.is_multiple_of(8) && aligned_16(dy)));
    let defines = defines(in_kind, vec, spec, prologue.code());
    let kernel = CudaSource::new(ENTRY, defines, SOURCE, CubeDim::new_1d(256));
    let mut buffers = vec![
        xc.handle.clone().binding(),
        dy.handle.clone().binding(),
        amax.handle.clone().binding(),
    ];
    buffers.extend(outputs.iter().map(|t| t.handle.clone().binding()));
    buffers.push(record_buffer.handle.clone().binding());
    let mut info = [view.rows, view.cols, view.stride_i, view.stride_j]
        .map(|v| v as u64)
        .to_vec();
    info.push(record_slot);
    let cubes = (
        view.cols.div_ceil(super::TILE) as u32,
        view.rows.div_ceil(super::TILE) as u32,
        1,
    );
    launch(&xc.client, kernel, cubes, buffers, info);
    true
}

/// Per-block maxima of `|x|` (f32 `[blocks]`, their max is `x`'s amax for per-tensor scaling:
/// the largest finite normal `|x|`) from the CUDA C++ kernel, or `None` without launching
/// anything where it does not apply: on the GPUs and dtypes [`supported`] excludes (those the
/// pair kernel does not run on), or where `x` is not dense row-major in whole 16-byte chunks
/// from a 16-byte aligned start.
pub(crate) fn tensor_amax_partials<R: CubeRuntime>(x: &CubeTensor<R>) -> Option<CubeTensor<R>> {
    if !supported(x) || !x.is_contiguous() {
        return None;
    }
    let (in_kind, xc) = (in_kind(x.dtype)?, cuda(x)?);
    let bytes = x.meta.num_elements() * x.dtype.size();
    if bytes == 0 || !bytes.is_multiple_of(16) || !aligned_16(x) {
        return None;
    }
    let chunks = bytes / 16;
    // Four chunks a thread and step, at most 1024 blocks (about 8 a multiprocessor on an H100).
    let blocks = chunks.div_ceil(256 * 4).min(1024);
    let partials = crate::launch::empty(x, vec![blocks], DType::F32);
    let partials_cuda = cuda(&partials)?;
    // Only IN_KIND matters to this entry point; the pair kernel's other macros must be defined.
    let per_tensor = QuantSpec::new(Fp8Format::E4M3, Fp8Granularity::Tensor);
    let defines = defines(in_kind, true, &per_tensor.into(), 0);
    let kernel = CudaSource::new(AMAX_ENTRY, defines, SOURCE, CubeDim::new_1d(256));
    let buffers = vec![
        xc.handle.clone().binding(),
        partials_cuda.handle.clone().binding(),
    ];
    launch(
        &xc.client,
        kernel,
        (blocks as u32, 1, 1),
        buffers,
        vec![chunks as u64],
    );
    Some(partials)
}
