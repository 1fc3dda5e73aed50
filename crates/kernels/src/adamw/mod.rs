//! Fused AdamW step over f32 master weights that also writes the low-precision compute copy.
//!
//! Decoupled weight decay as in PyTorch's `AdamW`: `p <- p (1 - lr wd) - lr / (1 - b1^t) * m /
//! (sqrt(v / (1 - b2^t)) + eps)`, with the gradient multiplied first by a device scalar `factor`
//! (for example `1 / loss_scale * clip_coefficient`, so that unscaling and clipping cost no pass).
//! One kernel reads `p`, `g`, `m`, `v` once and writes `p`, `m`, `v` and, when asked, `p` cast to
//! the compute dtype (bf16 or f16) for the next forward.
//!
//! [`crate::add_as_f32`] accumulates gradients over micro-batches: the sum of two gradients of
//! any float dtypes, in f32, in one pass (no cast of its own for a bf16 or f16 gradient).
//!
//! [`crate::SumSquares`] gives the global gradient norm that clipping needs: the sum of squares of
//! many tensors (any shapes, dtypes and layouts) in one read of each, as a one-element f32 device
//! tensor.

pub(crate) mod forward;
pub(crate) mod kernel;

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Tensor};

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

/// Plain-Burn `f32(a) + f32(b)` (tensors of one shape, any float dtypes).
pub fn add_as_f32_reference<B: BurnBackend, const D: usize>(
    a: Tensor<B, D>,
    b: Tensor<B, D>,
) -> Tensor<B, D> {
    a.cast(FloatDType::F32) + b.cast(FloatDType::F32)
}

/// Plain-Burn `x * factor[0]` in f32, cast to `dtype`.
pub fn scale_reference<B: BurnBackend, const D: usize>(
    x: Tensor<B, D>,
    factor: Tensor<B, 1>,
    dtype: FloatDType,
) -> Tensor<B, D> {
    if x.shape().num_elements() == 0 {
        // Burn refuses to broadcast the factor against an empty tensor.
        return x.cast(dtype);
    }
    (x.cast(FloatDType::F32) * factor.cast(FloatDType::F32).reshape([1; D])).cast(dtype)
}

/// Plain-Burn sum of every element of `tensors`, in f32, as a one-element tensor (0 when they hold
/// no element).
pub fn sum_f32_reference<B: BurnBackend>(
    tensors: Vec<FloatTensor<B>>,
    device: &B::Device,
) -> Tensor<B, 1> {
    sum_reference(tensors, device, |t| t)
}

/// The sum over `tensors` of `f` of each one's elements in f32, as a one-element tensor.
fn sum_reference<B: BurnBackend>(
    tensors: Vec<FloatTensor<B>>,
    device: &B::Device,
    f: impl Fn(Tensor<B, 2>) -> Tensor<B, 2>,
) -> Tensor<B, 1> {
    let mut acc = Tensor::<B, 1>::zeros([1], (device, burn::tensor::DType::F32));
    for t in tensors {
        let (t, _) = crate::as_2d::<B>(t);
        acc = acc + f(t.cast(FloatDType::F32)).sum();
    }
    acc
}

/// Plain-Burn sum of squares of every element of `tensors`, in f32, as a one-element tensor (0
/// when they hold no element).
pub fn sum_squares_reference<B: BurnBackend>(
    tensors: Vec<FloatTensor<B>>,
    device: &B::Device,
) -> Tensor<B, 1> {
    sum_reference(tensors, device, |t| t.powi_scalar(2))
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
        let (p, shape) = crate::as_2d::<Self>(param);
        let (g, _) = crate::as_2d::<Self>(grad);
        let (m, _) = crate::as_2d::<Self>(m);
        let (v, _) = crate::as_2d::<Self>(v);
        let out = reference(p, g, m, v, crate::tensor(factor), hp, copy_dtype);
        (
            crate::from_2d(out.param, shape.clone()),
            crate::from_2d(out.m, shape.clone()),
            crate::from_2d(out.v, shape.clone()),
            out.copy.map(|c| crate::from_2d(c, shape)),
        )
    }

    /// `f32(a) + f32(b)` ([`crate::add_as_f32`]); the default runs [`add_as_f32_reference`].
    fn add_as_f32(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        let (a, shape) = crate::as_2d::<Self>(a);
        let (b, _) = crate::as_2d::<Self>(b);
        crate::from_2d(add_as_f32_reference(a, b), shape)
    }

    /// `x * factor[0]` in f32, stored in `dtype` ([`crate::scale`]); the default runs
    /// [`scale_reference`].
    fn scale_cast(
        x: FloatTensor<Self>,
        factor: FloatTensor<Self>,
        dtype: FloatDType,
    ) -> FloatTensor<Self> {
        let (x, shape) = crate::as_2d::<Self>(x);
        crate::from_2d(scale_reference(x, crate::tensor(factor), dtype), shape)
    }

    /// The sum of every element of `tensors` on `device`, in f32, `[1]` ([`crate::sum_f32`]); the
    /// default runs [`sum_f32_reference`].
    fn sum_f32(tensors: Vec<FloatTensor<Self>>, device: &Self::Device) -> FloatTensor<Self> {
        crate::prim(sum_f32_reference::<Self>(tensors, device))
    }

    /// The sum of squares of every element of `tensors` on `device` ([`crate::SumSquares`]); the
    /// default runs [`sum_squares_reference`].
    fn sum_squares(tensors: Vec<FloatTensor<Self>>, device: &Self::Device) -> FloatTensor<Self> {
        crate::prim(sum_squares_reference::<Self>(tensors, device))
    }
}

impl<B: crate::KernelOps, C: CheckpointStrategy> AdamWOps for Autodiff<B, C> {}
