//! The FP8 MLP, `gelu(x w_fc) w_proj`, as one op: the four GEMMs of its two projections in FP8
//! as [`fp8_linear`] runs them, with GELU's output quantized by the kernel that computes it and,
//! in the backward, GELU's gradient quantized by the kernel that computes it (`producer.rs`).
//!
//! Composed of [`fp8_linear`], [`crate::gelu`] and [`fp8_linear`], the same values take two more
//! passes over the largest activation of the block, `[t, ff]`, each way: GELU writes its output in
//! the compute dtype and a quantizer pair reads it back (forward), and GELU's backward writes the
//! gradient that the first projection's quantizer pair reads back (backward).
//!
//! What the backward keeps: `x^T` and `gelu(h)^T` as FP8 codes (for the weight gradients), the
//! weights as FP8 codes (for the input gradients) and `h = x w_fc` (for GELU's gradient), as the
//! composition keeps them.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Tensor};

use super::backward::float_dtype;
use super::producer::fp8_gelu_quantize_pair as gelu_quantize_pair;
use super::Fp8Tensor;
use super::{fp8_gemm, fp8_linear, fp8_quantize, fp8_quantize_pair, Fp8LinearConfig, Fp8Ops};
use crate::activation::ActivationKernels;
use crate::gemm::GemmOps;
use crate::primitive::{prim, tensor};

/// `gelu(x w_fc) w_proj` for `x [t, d]`, `w_fc [d, ff]`, `w_proj [ff, out]` (one dtype), in
/// `x`'s dtype, with exact (erf) GELU and the GEMMs in FP8 as `cfg` says. Under `Autodiff` the
/// backward gives the gradients of all three.
///
/// With every GEMM in FP8 and tile scales (`cfg.fprop`, `dgrad`, `wgrad`, not `per_tensor`), on a
/// backend with the fused op (`CubeBackend`, `Autodiff` over it), GELU's output and gradient are
/// quantized by the kernel that computes them (see the module docs); otherwise, and on other
/// backends, this is `fp8_linear(gelu(fp8_linear(x, w_fc)), w_proj)`. Either way the values are
/// those of that composition: bit for bit where the GELU kernel runs in both, to a unit in the
/// last place of `x`'s dtype before quantizing where the CUDA C++ kernel computes GELU.
pub fn fp8_gelu_mlp<B: crate::Backend>(
    x: Tensor<B, 2>,
    w_fc: Tensor<B, 2>,
    w_proj: Tensor<B, 2>,
    cfg: &Fp8LinearConfig,
) -> Tensor<B, 2> {
    let ([t, d], [fc_in, ff], [proj_in, _]) = (x.dims(), w_fc.dims(), w_proj.dims());
    if fc_in != d || proj_in != ff {
        panic!(
            "kernels::fp8_gelu_mlp: x is [{t}, {d}], w_fc {:?} and w_proj {:?}; expected \
             w_fc [{d}, ff] and w_proj [ff, out]",
            w_fc.dims(),
            w_proj.dims()
        );
    }
    if x.dtype() != w_fc.dtype() || x.dtype() != w_proj.dtype() {
        panic!(
            "kernels::fp8_gelu_mlp: x is {:?}, w_fc {:?} and w_proj {:?}; cast them to one dtype",
            x.dtype(),
            w_fc.dtype(),
            w_proj.dtype()
        );
    }
    if fused(cfg) {
        if let Some(y) = B::fp8_gelu_mlp(
            prim(x.clone()),
            prim(w_fc.clone()),
            prim(w_proj.clone()),
            cfg,
        ) {
            return tensor(y);
        }
    }
    fp8_linear(crate::gelu(fp8_linear(x, w_fc, cfg)), w_proj, cfg)
}

/// Whether [`fp8_gelu_mlp`] runs as one op under `cfg`: every GEMM in FP8, scales per tile.
fn fused(cfg: &Fp8LinearConfig) -> bool {
    cfg.fprop && cfg.dgrad && cfg.wgrad && !cfg.per_tensor
}

/// What the backward keeps (see the module docs).
#[derive(Clone, Debug)]
struct Saved<B: Fp8Ops + GemmOps> {
    /// `x^T` quantized along `t`.
    x_t: Fp8Tensor<B>,
    /// `w_fc` quantized along `ff` (128 x 128 blocks).
    w_fc: Fp8Tensor<B>,
    /// `x w_fc`, GELU's input.
    h: Tensor<B, 2>,
    /// `gelu(h)^T` quantized along `t`.
    a_t: Fp8Tensor<B>,
    /// `w_proj` quantized along `out`.
    w_proj: Fp8Tensor<B>,
    /// The dtypes of `x`, `w_fc` and `w_proj`.
    dtypes: [FloatDType; 3],
}

/// The forward with what the backward keeps (every GEMM in FP8, [`fused`]).
fn forward<B: Fp8Ops + GemmOps + ActivationKernels>(
    x: Tensor<B, 2>,
    w_fc: Tensor<B, 2>,
    w_proj: Tensor<B, 2>,
    cfg: &Fp8LinearConfig,
) -> (Tensor<B, 2>, Saved<B>) {
    let out = float_dtype(x.dtype());
    let dtypes = [out, float_dtype(w_fc.dtype()), float_dtype(w_proj.dtype())];
    let (x_q, x_t) = fp8_quantize_pair(x, cfg.act_spec(false));
    let (w_fc_q, w_fc_t) = fp8_quantize_pair(w_fc, cfg.weight_spec(false));
    let h = fp8_gemm(&x_q, &w_fc_t, out);
    let (a_q, a_t) = gelu_quantize_pair(h.clone(), None, cfg.act_spec(false));
    let (w_proj_q, w_proj_t) = fp8_quantize_pair(w_proj, cfg.weight_spec(false));
    let y = fp8_gemm(&a_q, &w_proj_t, out);
    let saved = Saved {
        x_t,
        w_fc: w_fc_q,
        h,
        a_t,
        w_proj: w_proj_q,
        dtypes,
    };
    (y, saved)
}

/// The forward alone (nothing kept: evaluation, or a backend without autodiff).
pub(crate) fn fprop<B: Fp8Ops + GemmOps + ActivationKernels>(
    x: Tensor<B, 2>,
    w_fc: Tensor<B, 2>,
    w_proj: Tensor<B, 2>,
    cfg: &Fp8LinearConfig,
) -> Tensor<B, 2> {
    let out = float_dtype(x.dtype());
    let x_q = fp8_quantize(x, cfg.act_spec(false));
    let h = fp8_gemm(&x_q, &fp8_quantize(w_fc, cfg.weight_spec(true)), out);
    let (a_q, _) = gelu_quantize_pair(h, None, cfg.act_spec(false));
    fp8_gemm(&a_q, &fp8_quantize(w_proj, cfg.weight_spec(true)), out)
}

/// `[dx, dw_fc, dw_proj]` from the output gradient `dy`, each in its input's dtype.
fn backward<B: Fp8Ops + GemmOps + ActivationKernels>(
    saved: Saved<B>,
    dy: Tensor<B, 2>,
    cfg: &Fp8LinearConfig,
) -> [Tensor<B, 2>; 3] {
    let [x_dtype, fc_dtype, proj_dtype] = saved.dtypes;
    let (dy_q, dy_t) = fp8_quantize_pair(dy.cast(x_dtype), cfg.grad_spec(false));
    let da = fp8_gemm(&dy_q, &saved.w_proj, x_dtype);
    let dw_proj = fp8_gemm(&saved.a_t, &dy_t, proj_dtype);
    let (dh_q, dh_t) = gelu_quantize_pair(saved.h, Some(da), cfg.grad_spec(false));
    let dx = fp8_gemm(&dh_q, &saved.w_fc, x_dtype);
    let dw_fc = fp8_gemm(&saved.x_t, &dh_t, fc_dtype);
    [dx, dw_fc, dw_proj]
}

#[derive(Debug)]
struct Fp8GeluMlpBackward;

impl<B: Fp8Ops + GemmOps + ActivationKernels> Backward<B, 3> for Fp8GeluMlpBackward {
    type State = (Saved<B>, Fp8LinearConfig);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = tensor(grads.consume::<B>(&ops.node));
        let (saved, cfg) = ops.state;
        let gradients = backward(saved, dy, &cfg);
        for (node, g) in ops.parents.into_iter().zip(gradients) {
            if let Some(node) = node {
                grads.register::<B>(node.id, prim(g));
            }
        }
    }
}

/// [`fp8_gelu_mlp`] under `Autodiff` over `B` (every GEMM in FP8, [`fused`]).
pub(crate) fn autodiff<B: Fp8Ops + GemmOps + ActivationKernels, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    w_fc: FloatTensor<Autodiff<B, C>>,
    w_proj: FloatTensor<Autodiff<B, C>>,
    cfg: &Fp8LinearConfig,
) -> FloatTensor<Autodiff<B, C>> {
    let nodes = [x.node.clone(), w_fc.node.clone(), w_proj.node.clone()];
    let (x, w_fc, w_proj) = (
        tensor(x.primitive),
        tensor(w_fc.primitive),
        tensor(w_proj.primitive),
    );
    match Fp8GeluMlpBackward
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (y, saved) = forward::<B>(x, w_fc, w_proj, cfg);
            prep.finish((saved, *cfg), prim(y))
        }
        OpsKind::UnTracked(prep) => prep.finish(prim(fprop::<B>(x, w_fc, w_proj, cfg))),
    }
}
