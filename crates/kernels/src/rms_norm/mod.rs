//! RMSNorm and fused residual add + RMSNorm.
//!
//! `y = x / sqrt(mean(x^2) + eps) * w` over the last dimension. The statistics, the scaling and the
//! gain are computed in f32 whatever the storage dtype of `x` (f32, f16, bf16) and of `w` (often an
//! f32 master gain beside bf16 activations); `y` has `x`'s dtype. The backward gives `dx` in `x`'s
//! dtype and `dw` in `w`'s, from the per-row `1 / rms` saved by the forward (f32, one per row).

pub(crate) mod backward;
#[cfg(test)]
mod cuda_text;
pub(crate) mod forward;
pub(crate) mod kernel;

use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Tensor};

/// Plain-Burn RMSNorm: what the kernel computes, with ordinary tensor ops (f32 inside, output in
/// `x`'s dtype). Runs on any Burn backend.
pub fn reference<B: BurnBackend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, D> {
    let dt = x.dtype();
    let x = x.cast(FloatDType::F32);
    let ms = x.clone().powi_scalar(2).mean_dim(D - 1);
    let x = x * (ms + eps).sqrt().recip();
    (x * weight.cast(FloatDType::F32).unsqueeze()).cast(dt)
}

/// Plain-Burn residual add + RMSNorm: `(s, reference(s))` with `s = x + residual` in `x`'s dtype.
pub fn add_reference<B: BurnBackend, const D: usize>(
    x: Tensor<B, D>,
    residual: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f64,
) -> (Tensor<B, D>, Tensor<B, D>) {
    let s = x + residual;
    (s.clone(), reference(s, weight, eps))
}

/// RMSNorm on a backend ([`crate::rms_norm`], [`crate::add_rms_norm`]). The defaults run the
/// references; `CubeBackend` overrides them with the kernels and `Autodiff` with the kernels and
/// their backward.
pub trait RmsNormOps: BurnBackend {
    fn fused_rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        let (x, shape) = crate::primitive::as_2d::<Self>(x);
        crate::primitive::from_2d(reference(x, crate::primitive::tensor(weight), eps), shape)
    }

    fn fused_add_rms_norm(
        x: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (x, shape) = crate::primitive::as_2d::<Self>(x);
        let (r, _) = crate::primitive::as_2d::<Self>(residual);
        let (s, y) = add_reference(x, r, crate::primitive::tensor(weight), eps);
        (
            crate::primitive::from_2d(s, shape.clone()),
            crate::primitive::from_2d(y, shape),
        )
    }
}

/// The RMSNorm kernels' launches without autodiff, which the `Autodiff` implementation records.
pub trait RmsNormKernels: RmsNormOps {
    /// `(x + residual if given, y, 1 / rms per row in f32)`
    #[allow(clippy::type_complexity)]
    fn rms_norm_forward(
        x: FloatTensor<Self>,
        residual: Option<FloatTensor<Self>>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> (
        Option<FloatTensor<Self>>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    );
    /// `(dx, dweight)` from the normalised input, the gain, the saved `1 / rms` and `dy`; `dres`,
    /// when given, is another gradient of the input (from its other consumers, such as the next
    /// residual add), added to `dx` in the same pass.
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        dres: Option<FloatTensor<Self>>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}
