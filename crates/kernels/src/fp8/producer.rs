//! Quantization inside the kernel that produces the values (the kernel's launch on `CubeBackend`
//! is `forward.rs`'s `act_quantize_pair_native`): an MLP activation's output and gradient (GELU,
//! or SwiGLU of a packed gate and up) written as FP8 codes in both orientations (with their 1x128
//! or 128x128 scales) by one kernel that reads the activation's input (and the incoming gradient)
//! once, instead of the activation's kernel writing them in the compute dtype and a quantizer
//! pair reading them back.
//!
//! The codes are those of the activation kernel's output quantized by [`fp8_quantize_pair`]: the
//! fused kernel computes the activation in f32 as the activation's kernel does and rounds to the
//! input's dtype before quantizing (where the two compile `exp` and the reciprocal or division
//! differently, a value may differ by one unit in the last place of the compute dtype).
//! Per-tensor scaling takes the amax of a delayed-scaling history
//! (`Fp8ScaleSite::quantize_act_pair`), and the kernel records the values' own from its read.
//! Where the fused kernel does not run (not CUDA, a GPU without FP8 conversions, per-tensor
//! scaling without a history, a strided input, `BURNMIX_FP8_PAIR` other than `native`, and for
//! SwiGLU `BURNMIX_FP8_SWIGLU_PRODUCER=off`), [`fp8_act_quantize_pair`] runs the activation's
//! kernel and the quantizer pair.

use burn::tensor::Tensor;

use super::{fp8_pair_path, fp8_quantize_pair, Fp8Ops, Fp8PairPath, Fp8Tensor, PairSpec};
use crate::activation::{ActivationKernels, GeluForm};
use crate::gemm::GemmOps;
use crate::primitive::{prim, tensor};

/// The activation between the two projections of an FP8 MLP, which can quantize its own output
/// and gradient ([`fp8_act_quantize_pair`], [`super::fp8_mlp_scaled`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8MlpActivation {
    /// Exact (erf) GELU of `h [t, ff]`: the output and gradient are `[t, ff]`.
    Gelu,
    /// SwiGLU of a packed `h [t, 2 * ff]` (gate, then up): the output `silu(gate) * up` is
    /// `[t, ff]`, the gradient `[t, 2 * ff]` (gate half, then up half), as
    /// [`crate::swiglu_packed`] computes them.
    SwigluPacked,
}

impl Fp8MlpActivation {
    /// The shape of the activation's output (without `dy`) or of its gradient with respect to its
    /// input `h` (with `dy`), for `h` shaped `h_dims`.
    pub fn out_dims(self, h_dims: [usize; 2], gradient: bool) -> [usize; 2] {
        match (self, gradient) {
            (Fp8MlpActivation::SwigluPacked, false) => [h_dims[0], h_dims[1] / 2],
            _ => h_dims,
        }
    }
}

/// `GELU(h)` (with `dy`: `dy * GELU'(h)`) in `h`'s dtype, quantized in both orientations as
/// [`fp8_quantize_pair`] quantizes it under `spec`: [`fp8_act_quantize_pair`] for GELU.
pub fn fp8_gelu_quantize_pair<B: Fp8Ops + GemmOps + ActivationKernels>(
    h: Tensor<B, 2>,
    dy: Option<Tensor<B, 2>>,
    spec: impl Into<PairSpec>,
) -> (Fp8Tensor<B>, Fp8Tensor<B>) {
    fp8_act_quantize_pair(h, dy, Fp8MlpActivation::Gelu, spec)
}

/// `act(h)` (with `dy`: the gradient with respect to `h`) in `h`'s dtype, quantized in both
/// orientations as [`fp8_quantize_pair`] quantizes it under `spec`: `(as stored, transposed)`.
/// From one kernel where the backend has it ([`Fp8Ops::fp8_act_quantize_pair`]) and
/// [`fp8_pair_path`] is [`Fp8PairPath::Native`], else the activation's kernel and the quantizer
/// pair. For SwiGLU, `h` is the packed `[t, 2 * ff]` and `dy` is `[t, ff]`.
pub fn fp8_act_quantize_pair<B: Fp8Ops + GemmOps + ActivationKernels>(
    h: Tensor<B, 2>,
    dy: Option<Tensor<B, 2>>,
    act: Fp8MlpActivation,
    spec: impl Into<PairSpec>,
) -> (Fp8Tensor<B>, Fp8Tensor<B>) {
    let spec = spec.into();
    let dims = act.out_dims(h.dims(), dy.is_some());
    if fp8_pair_path(&spec.spec) == Fp8PairPath::Native {
        let fused =
            B::fp8_act_quantize_pair(prim(h.clone()), dy.clone().map(prim), act, &spec, None);
        if let Some((parts, _)) = fused {
            return Fp8Tensor::pair_from_parts(parts, dims, spec);
        }
    }
    fp8_quantize_pair(act_values(h, dy, act), spec)
}

/// `act(h)`, or with `dy` its gradient with respect to `h`, in `h`'s dtype, from the activation's
/// kernels.
pub(crate) fn act_values<B: ActivationKernels>(
    h: Tensor<B, 2>,
    dy: Option<Tensor<B, 2>>,
    act: Fp8MlpActivation,
) -> Tensor<B, 2> {
    let dtype = h.dtype();
    tensor(match (act, dy) {
        (Fp8MlpActivation::Gelu, Some(dy)) => {
            B::gelu_form_backward(prim(h), prim(dy.cast(dtype)), GeluForm::Exact)
        }
        (Fp8MlpActivation::Gelu, None) => B::gelu_form_forward(prim(h), GeluForm::Exact),
        (Fp8MlpActivation::SwigluPacked, Some(dy)) => {
            B::swiglu_backward(prim(h), None, prim(dy.cast(dtype)))
        }
        (Fp8MlpActivation::SwigluPacked, None) => B::swiglu_forward(prim(h), None),
    })
}
