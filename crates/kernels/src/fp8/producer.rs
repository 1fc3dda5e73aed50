//! Quantization inside the kernel that produces the values: GELU's output and GELU's gradient
//! written as FP8 codes in both orientations (with their 1x128 or 128x128 scales) by one kernel
//! that reads the GELU input (and the incoming gradient) once, instead of the GELU kernel writing
//! them in the compute dtype and a quantizer pair reading them back.
//!
//! The codes are those of the GELU kernel's output quantized by [`fp8_quantize_pair`]: the fused
//! kernel computes GELU in f32 as the GELU kernel does and rounds to the input's dtype before
//! quantizing (where the two compile `exp` and the reciprocal differently, a value may differ by
//! one unit in the last place of the compute dtype). Per-tensor scaling takes the amax of a
//! delayed-scaling history (`Fp8ScaleSite::quantize_gelu_pair`), and the kernel records the
//! values' own from its read. Where the fused kernel does not run (not CUDA, a GPU without FP8
//! conversions, per-tensor scaling without a history, a strided input,
//! `BURNMIX_FP8_PAIR` other than `native`), [`fp8_gelu_quantize_pair`] runs the GELU kernel and
//! the quantizer pair.

use burn::tensor::{DType, Tensor, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

use super::forward::{scales_output, Quantized};
use super::native::{launch_pair, PairView, Prologue};
use super::{fp8_pair_path, fp8_quantize_pair, Fp8Granularity, Fp8Ops, Fp8PairPath, Fp8Tensor};
use super::{QuantSpec, TILE};
use crate::activation::ActivationKernels;
use crate::gemm::GemmOps;
use crate::launch::empty;
use crate::primitive::{prim, tensor};

/// `GELU(h)` (with `dy`: `dy * GELU'(h)`) in `h`'s dtype, quantized in both orientations as
/// [`fp8_quantize_pair`] quantizes it under `spec`: `(as stored, transposed)`. From one kernel
/// where the backend has it ([`Fp8Ops::fp8_gelu_quantize_pair`]) and [`fp8_pair_path`] is
/// [`Fp8PairPath::Native`], else the GELU kernel and the quantizer pair.
pub fn fp8_gelu_quantize_pair<B: Fp8Ops + GemmOps + ActivationKernels>(
    h: Tensor<B, 2>,
    dy: Option<Tensor<B, 2>>,
    spec: QuantSpec,
) -> (Fp8Tensor<B>, Fp8Tensor<B>) {
    let dims = h.dims();
    if fp8_pair_path(&spec) == Fp8PairPath::Native {
        let fused = B::fp8_gelu_quantize_pair(prim(h.clone()), dy.clone().map(prim), &spec, None);
        if let Some((parts, _)) = fused {
            return Fp8Tensor::pair_from_parts(parts, dims, spec);
        }
    }
    fp8_quantize_pair(gelu_values(h, dy), spec)
}

/// `GELU(h)`, or with `dy` the gradient `dy * GELU'(h)`, in `h`'s dtype, from GELU's kernels.
pub(crate) fn gelu_values<B: ActivationKernels>(
    h: Tensor<B, 2>,
    dy: Option<Tensor<B, 2>>,
) -> Tensor<B, 2> {
    let dtype = h.dtype();
    tensor(match dy {
        Some(dy) => B::gelu_erf_backward(prim(h), prim(dy.cast(dtype))),
        None => B::gelu_erf_forward(prim(h)),
    })
}

/// [`Fp8Ops::fp8_gelu_quantize_pair`] on `CubeBackend`: the CUDA C++ pair kernel with its GELU
/// prologue, or `None` where it does not run (see the module docs; per-tensor scaling without a
/// given amax).
#[allow(clippy::type_complexity)]
pub(crate) fn gelu_quantize_pair_native<R: CubeRuntime>(
    h: CubeTensor<R>,
    dy: Option<CubeTensor<R>>,
    spec: &QuantSpec,
    given: Option<(CubeTensor<R>, Option<(CubeTensor<R>, usize)>)>,
) -> Option<((Quantized<R>, Quantized<R>), bool)> {
    if !super::native::supported(&h) {
        return None;
    }
    let spec = spec.transposed(false);
    let dims = h.shape().as_slice().to_vec();
    let per_tensor = spec.granularity == Fp8Granularity::Tensor;
    if dims.len() != 2 || per_tensor != given.is_some() || !h.is_contiguous() {
        return None;
    }
    let dy = match dy {
        Some(dy) => {
            let dy = crate::launch::contiguous(burn_cubecl::kernel::cast(dy, h.dtype));
            if dy.shape().as_slice() != dims.as_slice() {
                return None;
            }
            Some(dy)
        }
        None => None,
    };
    let (rows, cols) = (dims[0], dims[1]);
    let (row_tiles, col_tiles) = (rows.div_ceil(TILE), cols.div_ceil(TILE));
    if rows == 0 || cols == 0 || row_tiles > 65535 || col_tiles > crate::launch::max_cubes_x(&h) {
        return None;
    }
    let transposed = spec.transposed(true);
    let payload = empty(&h, vec![rows, col_tiles * TILE / 4], DType::I32);
    let scales = scales_output(&h, &spec, rows, cols);
    let payload_t = empty(&h, vec![cols, row_tiles * TILE / 4], DType::I32);
    let scales_t = scales_output(&h, &transposed, cols, rows);
    // Tiles and blocks take their own amax: the kernel reads it for per-tensor scaling only.
    let (amax, record) = match given {
        Some((amax, record)) => (crate::launch::contiguous(amax), record),
        None => (empty(&h, vec![1], DType::F32), None),
    };
    let view = PairView {
        rows,
        cols,
        stride_i: cols,
        stride_j: 1,
    };
    let prologue = match &dy {
        Some(dy) => Prologue::GeluGrad(dy),
        None => Prologue::Gelu,
    };
    let outputs = [&payload, &scales, &payload_t, &scales_t];
    let record = record.as_ref().map(|(buffer, slot)| (buffer, *slot));
    let recorded = record.is_some();
    launch_pair(&h, prologue, &amax, outputs, &view, &spec, record)
        .then_some((((payload, scales), (payload_t, scales_t)), recorded))
}
