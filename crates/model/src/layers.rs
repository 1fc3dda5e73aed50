//! The building blocks of the decoder: linear, embedding, RMSNorm, rotary embedding.
//!
//! Each is written with plain Burn ops so that the fused kernels of `kernels` can replace one op at
//! a time behind the model's `kernels` switch.

use burn::module::{Module, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Distribution, FloatDType, Int, Tensor, TensorPrimitive};

use crate::precision::Projection;

/// `y = x W + b` with `W` stored as [d_in, d_out].
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    /// [d_in, d_out]
    pub weight: Param<Tensor<B, 2>>,
    /// [d_out]
    pub bias: Option<Param<Tensor<B, 1>>>,
}

impl<B: Backend> Linear<B> {
    /// Weights drawn from N(0, std^2), bias zero.
    pub fn new(d_in: usize, d_out: usize, bias: bool, std: f64, device: &B::Device) -> Self {
        let weight = Tensor::random([d_in, d_out], Distribution::Normal(0.0, std), device);
        let bias = bias.then(|| Param::from_tensor(Tensor::zeros([d_out], device)));
        Self {
            weight: Param::from_tensor(weight),
            bias,
        }
    }

    /// [.., d_in] -> [.., d_out], in the dtype of the weight (`x` must have it too).
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        burn::tensor::module::linear(x, self.weight.val(), self.bias.as_ref().map(|b| b.val()))
    }

    /// The same layer with its weight and bias cast to `dtype` as new leaf tensors (same parameter
    /// ids, detached from `self`): gradients of a forward through the copy land on the copy.
    pub fn compute_copy(&self, dtype: FloatDType) -> Self {
        self.compute_copy_with(dtype, &|_| None)
    }

    /// [`Linear::compute_copy`], taking a parameter's copy from `cached` when it has one (already
    /// in `dtype`, e.g. written by a fused optimizer step) instead of casting.
    pub fn compute_copy_with(
        &self,
        dtype: FloatDType,
        cached: &dyn Fn(ParamId) -> Option<FloatTensor<B>>,
    ) -> Self {
        fn copy<B: Backend, const D: usize>(
            p: &Param<Tensor<B, D>>,
            dtype: FloatDType,
            cached: &dyn Fn(ParamId) -> Option<FloatTensor<B>>,
        ) -> Param<Tensor<B, D>> {
            let id = p.id;
            p.clone().map(|t| match cached(id) {
                Some(c) => Tensor::<B, D>::from_primitive(TensorPrimitive::Float(c))
                    .detach()
                    .require_grad(),
                None => t.cast(dtype).detach().require_grad(),
            })
        }
        Self {
            weight: copy(&self.weight, dtype, cached),
            bias: self.bias.as_ref().map(|b| copy(b, dtype, cached)),
        }
    }

    /// Ids of the parameters [`Linear::compute_copy`] casts.
    pub fn param_ids(&self) -> Vec<ParamId> {
        std::iter::once(self.weight.id)
            .chain(self.bias.as_ref().map(|b| b.id))
            .collect()
    }
}

impl<B: kernels::Backend> Linear<B> {
    /// [`Linear::forward`] with its GEMMs on `gemm` (`Burn` is exactly [`Linear::forward`]). The
    /// bias is added in the weight's dtype.
    pub fn forward_mixed<const D: usize>(
        &self,
        x: Tensor<B, D>,
        gemm: kernels::Gemm,
    ) -> Tensor<B, D> {
        if gemm == kernels::Gemm::Burn {
            return self.forward(x);
        }
        let y = kernels::linear(x, self.weight.val(), gemm);
        match &self.bias {
            Some(b) => y + b.val().unsqueeze(),
            None => y,
        }
    }

    /// The layer as a projection of a forward of some [`crate::Precision`]: in FP8 when it says
    /// so (recording the FP8 health of the operands into its probe), else
    /// [`Linear::forward_mixed`]; with a probe on the output's gradient when it has one.
    pub(crate) fn forward_projection<const D: usize>(
        &self,
        x: Tensor<B, D>,
        p: &Projection,
    ) -> Tensor<B, D> {
        let y = match &p.fp8 {
            Some(cfg) => self.forward_fp8(x, cfg, p),
            None => self.forward_mixed(x, p.gemm),
        };
        probed(y, p)
    }

    /// This layer as projection `path` ([`crate::PROJECTION_PATHS`]) of a one-block model under
    /// `precision`: in FP8 when `precision` runs that projection in FP8. For measuring one
    /// projection alone (the trainer's `fp8.projections = "auto"`).
    pub fn forward_as_projection<const D: usize>(
        &self,
        x: Tensor<B, D>,
        precision: &crate::Precision,
        path: &str,
    ) -> Tensor<B, D> {
        self.forward_projection(x, &precision.projection(0, 1, path))
    }

    /// The pre-norm and this projection after it, on the fused kernels: `(s, norm(s) W + b)` with
    /// `s = delta + x` (the residual add inside the norm's kernel) when `delta` is given, else
    /// `s = x`. With `recompute`, the norm's output is computed again in the backward instead of
    /// kept (`kernels::recompute`), except in an FP8 projection, which keeps its input's FP8
    /// codes for the weight gradient instead.
    pub(crate) fn forward_after_norm(
        &self,
        norm: &RmsNorm<B>,
        x: Tensor<B, 3>,
        delta: Option<Tensor<B, 3>>,
        p: &Projection,
        recompute: bool,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        if !recompute || p.fp8.is_some() {
            let (s, h) = match delta {
                Some(delta) => norm.forward_add(delta, x),
                None => (x.clone(), norm.forward_fused(x)),
            };
            return (s, self.forward_projection(h, p));
        }
        let [b, t, d] = x.dims();
        let (gain, w) = (norm.weight.val(), self.weight.val());
        let x2 = x.clone().reshape([b * t, d]);
        let (s, y) = match delta {
            Some(delta) => {
                let (s, y) = kernels::recompute::add_rms_norm_linear(
                    delta.reshape([b * t, d]),
                    x2,
                    gain,
                    norm.eps,
                    w,
                    p.gemm,
                );
                (s.reshape([b, t, d]), y)
            }
            None => (
                x,
                kernels::recompute::rms_norm_linear(x2, gain, norm.eps, w, p.gemm),
            ),
        };
        (s, self.biased_probed(y, [b, t], p))
    }

    /// `activation(h) W + b` on the fused kernels (`h` packed gate and up for SwiGLU). With
    /// `recompute`, the activation's output is computed again in the backward instead of kept,
    /// except in an FP8 projection (which keeps its input's FP8 codes).
    pub(crate) fn forward_after_activation(
        &self,
        h: Tensor<B, 3>,
        activation: kernels::recompute::Activation,
        p: &Projection,
        recompute: bool,
    ) -> Tensor<B, 3> {
        use kernels::recompute::Activation;
        if !recompute || p.fp8.is_some() {
            let x = match activation {
                Activation::SwigluPacked => kernels::swiglu_packed(h),
                Activation::Gelu => kernels::gelu(h),
                Activation::GeluTanh => kernels::gelu_tanh(h),
            };
            return self.forward_projection(x, p);
        }
        let [b, t, width] = h.dims();
        let y = kernels::recompute::activation_linear(
            h.reshape([b * t, width]),
            activation,
            self.weight.val(),
            p.gemm,
        );
        self.biased_probed(y, [b, t], p)
    }

    /// `y` [B T, n] as [B, T, n], plus the bias (in the weight's dtype), probed as `p` says.
    fn biased_probed(&self, y: Tensor<B, 2>, [b, t]: [usize; 2], p: &Projection) -> Tensor<B, 3> {
        let n = y.dims()[1];
        let y = y.reshape([b, t, n]);
        let y = match &self.bias {
            Some(bias) => y + bias.val().unsqueeze(),
            None => y,
        };
        probed(y, p)
    }

    /// The GEMMs in FP8 (`kernels::fp8_linear_scaled`, with the projection's health probe and
    /// scale site), the bias added in the weight's dtype.
    fn forward_fp8<const D: usize>(
        &self,
        x: Tensor<B, D>,
        cfg: &kernels::Fp8LinearConfig,
        p: &Projection,
    ) -> Tensor<B, D> {
        let dims = x.dims();
        let d_in = dims[D - 1];
        let rows = dims[..D - 1].iter().product::<usize>();
        let w = self.weight.val();
        let d_out = w.dims()[1];
        let (probe, site) = (p.fp8_probe.as_ref(), p.fp8_site.as_ref());
        let y = kernels::fp8_linear_scaled(x.reshape([rows, d_in]), w, cfg, probe, site);
        let y = match &self.bias {
            Some(b) => y + b.val().unsqueeze::<2>(),
            None => y,
        };
        let mut out = dims;
        out[D - 1] = d_out;
        y.reshape(out)
    }
}

/// `y` with the probe on its gradient that `p` has, if any.
fn probed<B: kernels::Backend, const D: usize>(y: Tensor<B, D>, p: &Projection) -> Tensor<B, D> {
    match &p.grad_probe {
        Some(probe) => kernels::format_probe(y, probe),
        None => y,
    }
}

/// Token embedding table.
#[derive(Module, Debug)]
pub struct Embedding<B: Backend> {
    /// [vocab, d_model]
    pub weight: Param<Tensor<B, 2>>,
}

impl<B: Backend> Embedding<B> {
    pub fn new(vocab: usize, d_model: usize, std: f64, device: &B::Device) -> Self {
        let weight = Tensor::random([vocab, d_model], Distribution::Normal(0.0, std), device);
        Self {
            weight: Param::from_tensor(weight),
        }
    }

    /// [B, T] token ids -> [B, T, d_model]
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        burn::tensor::module::embedding(self.weight.val(), ids)
    }
}

/// Root-mean-square normalisation with a learned gain (no bias, no mean subtraction).
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// [d_model], initialised to ones.
    pub weight: Param<Tensor<B, 1>>,
    #[module(skip)]
    pub eps: f64,
}

impl<B: Backend> RmsNorm<B> {
    pub fn new(d_model: usize, eps: f64, device: &B::Device) -> Self {
        Self {
            weight: Param::from_tensor(Tensor::ones([d_model], device)),
            eps,
        }
    }

    /// [.., d] -> [.., d]: `x / sqrt(mean(x^2) + eps) * w`, computed in f32 (statistics, scaling
    /// and gain) and returned in the dtype of `x`; plain Burn ops.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        kernels::rms_norm::reference(x, self.weight.val(), self.eps)
    }
}

impl<B: kernels::Backend> RmsNorm<B> {
    /// [`RmsNorm::forward`] through the fused kernel.
    pub fn forward_fused<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        kernels::rms_norm(x, self.weight.val(), self.eps)
    }

    /// `(x + residual, norm(x + residual))` in one fused kernel.
    pub fn forward_add<const D: usize>(
        &self,
        x: Tensor<B, D>,
        residual: Tensor<B, D>,
    ) -> (Tensor<B, D>, Tensor<B, D>) {
        kernels::add_rms_norm(x, residual, self.weight.val(), self.eps)
    }
}

/// Cosine and sine tables of the rotary position embedding for `t` positions, each
/// [1, 1, t, head_dim / 2] (f32), for the frequencies `theta^(-2i / head_dim)`.
pub fn rope_tables<B: Backend>(
    t: usize,
    head_dim: usize,
    theta: f64,
    device: &B::Device,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let inv_freq: Vec<f32> = kernels::rope::frequencies(head_dim, theta)
        .into_iter()
        .map(|f| f as f32)
        .collect();
    rope_tables_from_freqs(t, &inv_freq, device)
}

/// [`rope_tables`] for any inverse frequencies (`inv_freq.len()` = head_dim / 2), e.g. from
/// [`crate::RopeScaling::inv_freq`]: `kernels::rope::tables_from_freqs` in the layout of
/// [`apply_rope`].
pub fn rope_tables_from_freqs<B: Backend>(
    t: usize,
    inv_freq: &[f32],
    device: &B::Device,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let half = inv_freq.len();
    let (cos, sin) = kernels::rope::tables_from_freqs::<B>(t, inv_freq, device);
    (cos.reshape([1, 1, t, half]), sin.reshape([1, 1, t, half]))
}

/// Rotates each (x[i], x[i + half]) pair of the last dimension by its position's angle (the
/// "rotate half" layout of GPT-NeoX and LLaMA). x: [B, H, T, head_dim].
pub fn apply_rope<B: Backend>(
    x: Tensor<B, 4>,
    cos: &Tensor<B, 4>,
    sin: &Tensor<B, 4>,
) -> Tensor<B, 4> {
    let mut halves = x.chunk(2, 3);
    let x2 = halves.pop().expect("two halves");
    let x1 = halves.pop().expect("two halves");
    let r1 = x1.clone() * cos.clone() - x2.clone() * sin.clone();
    let r2 = x1 * sin.clone() + x2 * cos.clone();
    Tensor::cat(vec![r1, r2], 3)
}
