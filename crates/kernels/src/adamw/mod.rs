//! Fused AdamW step over f32 master weights that also writes the low-precision compute copy.
//!
//! Decoupled weight decay as in PyTorch's `AdamW`: `p <- p (1 - lr wd) - lr / (1 - b1^t) * m /
//! (sqrt(v / (1 - b2^t)) + eps)`, with the gradient multiplied first by a device scalar `factor`
//! (for example `1 / loss_scale * clip_coefficient`, so that unscaling and clipping cost no pass).
//! One kernel reads `p`, `g`, `m`, `v` once and writes `p`, `m`, `v` and, when asked, `p` cast to
//! the compute dtype (bf16 or f16) for the next forward.
//!
//! The gradients' other f32 arithmetic (accumulation over micro-batches, the global norm) is in
//! [`reduce`](crate::reduce).

pub(crate) mod forward;
pub(crate) mod kernel;

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Tensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

/// Hyper-parameters of one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Decoupled weight decay (0 for parameters that are not decayed).
    pub weight_decay: f64,
    /// The step number `t` >= 1, for the bias corrections.
    pub t: u64,
}

impl AdamWStep {
    pub(crate) fn bias_corrections(&self) -> (f64, f64) {
        let t = self.t.max(1) as i32;
        (1.0 - self.beta1.powi(t), 1.0 - self.beta2.powi(t))
    }
}

/// What one step produces: new master weight and moments (f32), and the compute copy if asked.
#[derive(Debug, Clone)]
pub struct AdamWOutput<B: BurnBackend, const D: usize> {
    pub param: Tensor<B, D>,
    pub m: Tensor<B, D>,
    pub v: Tensor<B, D>,
    pub copy: Option<Tensor<B, D>>,
}

/// Plain-Burn AdamW step with the same arithmetic (f32).
pub fn reference<B: BurnBackend, const D: usize>(
    param: Tensor<B, D>,
    grad: Tensor<B, D>,
    m: Tensor<B, D>,
    v: Tensor<B, D>,
    factor: Tensor<B, 1>,
    hp: &AdamWStep,
    copy_dtype: Option<FloatDType>,
) -> AdamWOutput<B, D> {
    let (bc1, bc2) = hp.bias_corrections();
    let g = grad.cast(FloatDType::F32) * factor.reshape([1; D]);
    let m = m.mul_scalar(hp.beta1) + g.clone().mul_scalar(1.0 - hp.beta1);
    let v = v.mul_scalar(hp.beta2) + g.powi_scalar(2).mul_scalar(1.0 - hp.beta2);
    let mut p = param;
    if hp.weight_decay > 0.0 {
        p = p.mul_scalar(1.0 - hp.lr * hp.weight_decay);
    }
    let denom = v.clone().sqrt().div_scalar(bc2.sqrt()).add_scalar(hp.eps);
    let p = p - (m.clone() / denom).mul_scalar(hp.lr / bc1);
    let copy = copy_dtype.map(|dt| p.clone().cast(dt));
    AdamWOutput {
        param: p,
        m,
        v,
        copy,
    }
}

/// The fused AdamW step on a backend ([`crate::adamw_step`]). The default runs the reference;
/// `CubeBackend` overrides it with the kernel. It works on the optimizer's tensors, so `Autodiff`
/// keeps the default (the trainer calls it on the inner backend).
pub trait AdamWOps: BurnBackend {
    #[allow(clippy::type_complexity)]
    fn fused_adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        factor: FloatTensor<Self>,
        hp: &AdamWStep,
        copy_dtype: Option<FloatDType>,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
    ) {
        let (p, shape) = crate::primitive::as_2d::<Self>(param);
        let (g, _) = crate::primitive::as_2d::<Self>(grad);
        let (m, _) = crate::primitive::as_2d::<Self>(m);
        let (v, _) = crate::primitive::as_2d::<Self>(v);
        let out = reference(p, g, m, v, crate::primitive::tensor(factor), hp, copy_dtype);
        (
            crate::primitive::from_2d(out.param, shape.clone()),
            crate::primitive::from_2d(out.m, shape.clone()),
            crate::primitive::from_2d(out.v, shape.clone()),
            out.copy.map(|c| crate::primitive::from_2d(c, shape)),
        )
    }
}

impl<R, F, I, BT, C> AdamWOps for Autodiff<CubeBackend<R, F, I, BT>, C>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    C: CheckpointStrategy,
{
}
