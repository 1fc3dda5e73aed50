//! The FP8 MLP, `act(x w_fc) w_proj` (GELU, or SwiGLU of a packed gate and up), as one op: the
//! four GEMMs of its two projections in FP8 as [`fp8_linear`] runs them, with the activation's
//! output quantized by the kernel that computes it and, in the backward, the activation's gradient
//! quantized by the kernel that computes it (`producer.rs`).
//!
//! Composed of [`fp8_linear`], the activation ([`crate::gelu`], [`crate::swiglu_packed`]) and
//! [`fp8_linear`], the same values take two more passes over the block's largest activations each
//! way: the activation writes its output (`[t, ff]`) in the compute dtype and a quantizer pair
//! reads it back (forward), and the activation's backward writes the gradient (`[t, ff]`, SwiGLU's
//! `[t, 2 * ff]`) that the first projection's quantizer pair reads back (backward).
//!
//! Under per-tensor scaling with delayed-scaling sites (one per projection, as the layers have),
//! the activation's output and gradient are scaled from their histories (`proj`'s input, `fc`'s
//! output gradient) and the producing kernel records their amaxes from its own read.
//!
//! What the backward keeps: `x^T` and `act(h)^T` as FP8 codes (for the weight gradients), the
//! weights as FP8 codes (for the input gradients) and `h = x w_fc` (for the activation's
//! gradient), as the composition keeps them.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Tensor};

use super::delayed::role::{GRAD_OUTPUT, INPUT, WEIGHT};
use super::delayed::{quantize_at, quantize_pair_at};
use super::producer::{act_values, fp8_act_quantize_pair, Fp8MlpActivation};
use super::{fp8_gemm, fp8_linear_scaled, Fp8Granularity};
use super::{Fp8LinearConfig, Fp8Ops, Fp8Record, Fp8ScaleSite, Fp8Tensor, PairSpec};
use crate::activation::{ActivationKernels, ActivationOps};
use crate::gemm::GemmOps;
use crate::primitive::float_dtype;
use crate::primitive::{prim, tensor};

/// `gelu(x w_fc) w_proj` for `x [t, d]`, `w_fc [d, ff]`, `w_proj [ff, out]` (one dtype), in
/// `x`'s dtype, with exact (erf) GELU and the GEMMs in FP8 as `cfg` says: [`fp8_gelu_mlp_scaled`]
/// without delayed scaling.
pub fn fp8_gelu_mlp<B: Fp8Ops + GemmOps + ActivationOps>(
    x: Tensor<B, 2>,
    w_fc: Tensor<B, 2>,
    w_proj: Tensor<B, 2>,
    cfg: &Fp8LinearConfig,
) -> Tensor<B, 2> {
    fp8_gelu_mlp_scaled(x, w_fc, w_proj, cfg, None)
}

/// [`fp8_gelu_mlp`]; with `cfg.per_tensor` and `sites` (`fc`'s and `proj`'s, as
/// [`fp8_linear_scaled`] takes one), every operand is scaled from its site's amax history:
/// [`fp8_mlp_scaled`] with GELU.
pub fn fp8_gelu_mlp_scaled<B: Fp8Ops + GemmOps + ActivationOps>(
    x: Tensor<B, 2>,
    w_fc: Tensor<B, 2>,
    w_proj: Tensor<B, 2>,
    cfg: &Fp8LinearConfig,
    sites: Option<(&Fp8ScaleSite, &Fp8ScaleSite)>,
) -> Tensor<B, 2> {
    fp8_mlp_scaled(x, w_fc, w_proj, Fp8MlpActivation::Gelu, cfg, sites)
}

/// `act(x w_fc) w_proj` for `x [t, d]`, `w_fc [d, h]`, `w_proj [ff, out]` (one dtype; `h = ff`
/// for GELU, `2 * ff` for SwiGLU's packed gate and up), in `x`'s dtype, with the GEMMs in FP8 as
/// `cfg` says; with `cfg.per_tensor` and `sites` (`fc`'s and `proj`'s, as [`fp8_linear_scaled`]
/// takes one), every operand is scaled from its site's amax history. Under `Autodiff` the
/// backward gives the gradients of all three inputs.
///
/// With every GEMM in FP8 (`cfg.fprop`, `dgrad`, `wgrad`), on a backend with the fused op
/// (`CubeBackend`, `Autodiff` over it), the activation's output and gradient are quantized by the
/// kernel that computes them (see the module docs); otherwise, and on other backends, this is
/// `fp8_linear_scaled(act(fp8_linear_scaled(x, w_fc)), w_proj)`. Either way the values are those
/// of that composition: bit for bit where the activation's kernel runs in both, to a unit in the
/// last place of `x`'s dtype before quantizing where the CUDA C++ kernel computes the activation.
///
/// # Panics
/// If the shapes do not chain (naming them) or the three dtypes differ.
pub fn fp8_mlp_scaled<B: Fp8Ops + GemmOps + ActivationOps>(
    x: Tensor<B, 2>,
    w_fc: Tensor<B, 2>,
    w_proj: Tensor<B, 2>,
    act: Fp8MlpActivation,
    cfg: &Fp8LinearConfig,
    sites: Option<(&Fp8ScaleSite, &Fp8ScaleSite)>,
) -> Tensor<B, 2> {
    let ([t, d], [fc_in, h], [proj_in, _]) = (x.dims(), w_fc.dims(), w_proj.dims());
    let [_, ff] = act.out_dims([t, h], false);
    let packed = act == Fp8MlpActivation::SwigluPacked;
    if fc_in != d || proj_in != ff || (packed && !h.is_multiple_of(2)) {
        let want = match packed {
            true => "w_fc [d, 2 * ff] (gate, then up) and w_proj [ff, out]",
            false => "w_fc [d, ff] and w_proj [ff, out]",
        };
        panic!(
            "kernels::fp8_mlp ({act:?}): x is [{t}, {d}], w_fc {:?} and w_proj {:?}; expected {want}",
            w_fc.dims(),
            w_proj.dims()
        );
    }
    if x.dtype() != w_fc.dtype() || x.dtype() != w_proj.dtype() {
        panic!(
            "kernels::fp8_mlp: x is {:?}, w_fc {:?} and w_proj {:?}; cast them to one dtype",
            x.dtype(),
            w_fc.dtype(),
            w_proj.dtype()
        );
    }
    let sites = sites.filter(|_| cfg.per_tensor);
    if cfg.fprop && cfg.dgrad && cfg.wgrad {
        let owned = sites.map(|(fc, proj)| (fc.clone(), proj.clone()));
        let fused = B::fp8_mlp(
            prim(x.clone()),
            prim(w_fc.clone()),
            prim(w_proj.clone()),
            act,
            cfg,
            owned,
        );
        if let Some(y) = fused {
            return tensor(y);
        }
    }
    let (fc_site, proj_site) = (sites.map(|s| s.0), sites.map(|s| s.1));
    let h = fp8_linear_scaled(x, w_fc, cfg, None, fc_site);
    let a = tensor(match act {
        Fp8MlpActivation::Gelu => B::fused_gelu(prim(h), crate::activation::GeluForm::Exact),
        Fp8MlpActivation::SwigluPacked => B::fused_swiglu_packed(prim(h)),
    });
    fp8_linear_scaled(a, w_proj, cfg, None, proj_site)
}

/// The delayed-scaling sites of `fc` and `proj`.
type Sites = Option<(Fp8ScaleSite, Fp8ScaleSite)>;

/// `act` of `h` (with `dy`, its gradient) quantized in both orientations, scaled as
/// [`quantize_pair_at`].
fn act_pair<B: Fp8Ops + GemmOps + ActivationKernels>(
    h: Tensor<B, 2>,
    dy: Option<Tensor<B, 2>>,
    act: Fp8MlpActivation,
    spec: PairSpec,
    site: Option<&Fp8ScaleSite>,
    role: &str,
) -> (Fp8Tensor<B>, Fp8Tensor<B>) {
    match site {
        Some(site) if spec.spec.granularity == Fp8Granularity::Tensor => {
            site.quantize_act_pair(role, h, dy, act, spec.spec, Fp8Record::Yes)
        }
        _ => fp8_act_quantize_pair(h, dy, act, spec),
    }
}

/// What the backward keeps (see the module docs).
#[derive(Clone, Debug)]
struct Saved<B: Fp8Ops + GemmOps> {
    /// `x^T` quantized along `t`.
    x_t: Fp8Tensor<B>,
    /// `w_fc` quantized along `ff` (128 x 128 blocks).
    w_fc: Fp8Tensor<B>,
    /// `x w_fc`, the activation's input.
    h: Tensor<B, 2>,
    /// `act(h)^T` quantized along `t`.
    a_t: Fp8Tensor<B>,
    /// `w_proj` quantized along `out`.
    w_proj: Fp8Tensor<B>,
    /// The dtypes of `x`, `w_fc` and `w_proj`.
    dtypes: [FloatDType; 3],
    act: Fp8MlpActivation,
    sites: Sites,
}

/// The forward with what the backward keeps (every GEMM in FP8).
fn forward<B: Fp8Ops + GemmOps + ActivationKernels>(
    x: Tensor<B, 2>,
    w_fc: Tensor<B, 2>,
    w_proj: Tensor<B, 2>,
    act: Fp8MlpActivation,
    cfg: &Fp8LinearConfig,
    sites: Sites,
) -> (Tensor<B, 2>, Saved<B>) {
    let out = float_dtype(x.dtype());
    let dtypes = [out, float_dtype(w_fc.dtype()), float_dtype(w_proj.dtype())];
    let (fc, proj) = (sites.as_ref().map(|s| &s.0), sites.as_ref().map(|s| &s.1));
    let (x_q, x_t) = quantize_pair_at(x, cfg.act_pair(), fc, INPUT, Fp8Record::Yes);
    let (w_fc_q, w_fc_t) = quantize_pair_at(
        w_fc,
        cfg.weight_spec(false).into(),
        fc,
        WEIGHT,
        Fp8Record::Yes,
    );
    let h = fp8_gemm(&x_q, &w_fc_t, out);
    let (a_q, a_t) = act_pair(h.clone(), None, act, cfg.act_pair(), proj, INPUT);
    let (w_proj_q, w_proj_t) = quantize_pair_at(
        w_proj,
        cfg.weight_spec(false).into(),
        proj,
        WEIGHT,
        Fp8Record::Yes,
    );
    let y = fp8_gemm(&a_q, &w_proj_t, out);
    let saved = Saved {
        x_t,
        w_fc: w_fc_q,
        h,
        a_t,
        w_proj: w_proj_q,
        dtypes,
        act,
        sites,
    };
    (y, saved)
}

/// The forward alone (nothing kept or recorded: evaluation, or a backend without autodiff).
pub(crate) fn fprop<B: Fp8Ops + GemmOps + ActivationKernels>(
    x: Tensor<B, 2>,
    w_fc: Tensor<B, 2>,
    w_proj: Tensor<B, 2>,
    act: Fp8MlpActivation,
    cfg: &Fp8LinearConfig,
    sites: Option<(&Fp8ScaleSite, &Fp8ScaleSite)>,
) -> Tensor<B, 2> {
    let out = float_dtype(x.dtype());
    let (fc, proj) = (sites.map(|s| s.0), sites.map(|s| s.1));
    let x_q = quantize_at(x, cfg.act_spec(false), fc, INPUT, Fp8Record::No);
    let h = fp8_gemm(
        &x_q,
        &quantize_at(w_fc, cfg.weight_spec(true), fc, WEIGHT, Fp8Record::No),
        out,
    );
    let a_q = match proj {
        // An evaluation forward records no amax; the activation's output then takes the
        // quantizer.
        Some(site) if cfg.per_tensor => {
            let a = act_values(h, None, act);
            site.quantize(INPUT, a, cfg.act_spec(false), Fp8Record::No)
        }
        _ => fp8_act_quantize_pair(h, None, act, cfg.act_spec(false)).0,
    };
    fp8_gemm(
        &a_q,
        &quantize_at(w_proj, cfg.weight_spec(true), proj, WEIGHT, Fp8Record::No),
        out,
    )
}

/// `[dx, dw_fc, dw_proj]` from the output gradient `dy`, each in its input's dtype.
fn backward<B: Fp8Ops + GemmOps + ActivationKernels>(
    saved: Saved<B>,
    dy: Tensor<B, 2>,
    cfg: &Fp8LinearConfig,
) -> [Tensor<B, 2>; 3] {
    let [x_dtype, fc_dtype, proj_dtype] = saved.dtypes;
    let sites = saved.sites.as_ref();
    let (fc, proj) = (sites.map(|s| &s.0), sites.map(|s| &s.1));
    let (dy_q, dy_t) = quantize_pair_at(
        dy.cast(x_dtype),
        cfg.grad_pair(),
        proj,
        GRAD_OUTPUT,
        Fp8Record::Yes,
    );
    let da = fp8_gemm(&dy_q, &saved.w_proj, x_dtype);
    let dw_proj = fp8_gemm(&saved.a_t, &dy_t, proj_dtype);
    let (dh_q, dh_t) = act_pair(
        saved.h,
        Some(da),
        saved.act,
        cfg.grad_pair(),
        fc,
        GRAD_OUTPUT,
    );
    let dx = fp8_gemm(&dh_q, &saved.w_fc, x_dtype);
    let dw_fc = fp8_gemm(&saved.x_t, &dh_t, fc_dtype);
    [dx, dw_fc, dw_proj]
}

#[derive(Debug)]
struct Fp8MlpBackward;

impl<B: Fp8Ops + GemmOps + ActivationKernels> Backward<B, 3> for Fp8MlpBackward {
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

/// [`fp8_mlp_scaled`] under `Autodiff` over `B` (every GEMM in FP8).
pub(crate) fn autodiff<B: Fp8Ops + GemmOps + ActivationKernels, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    w_fc: FloatTensor<Autodiff<B, C>>,
    w_proj: FloatTensor<Autodiff<B, C>>,
    act: Fp8MlpActivation,
    cfg: &Fp8LinearConfig,
    sites: Sites,
) -> FloatTensor<Autodiff<B, C>> {
    let nodes = [x.node.clone(), w_fc.node.clone(), w_proj.node.clone()];
    let (x, w_fc, w_proj) = (
        tensor(x.primitive),
        tensor(w_fc.primitive),
        tensor(w_proj.primitive),
    );
    match Fp8MlpBackward
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (y, saved) = forward::<B>(x, w_fc, w_proj, act, cfg, sites);
            prep.finish((saved, *cfg), prim(y))
        }
        OpsKind::UnTracked(prep) => {
            let sites = sites.as_ref().map(|(fc, proj)| (fc, proj));
            prep.finish(prim(fprop::<B>(x, w_fc, w_proj, act, cfg, sites)))
        }
    }
}
