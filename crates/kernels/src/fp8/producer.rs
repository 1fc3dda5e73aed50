//! Quantization inside the kernel that produces the values (the kernel's launch on `CubeBackend`
//! is `forward.rs`'s `gelu_quantize_pair_native`): GELU's output and GELU's gradient
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

use burn::tensor::Tensor;

use super::{fp8_pair_path, fp8_quantize_pair, Fp8Ops, Fp8PairPath, Fp8Tensor, QuantSpec};
use crate::activation::ActivationKernels;
use crate::gemm::GemmOps;
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
