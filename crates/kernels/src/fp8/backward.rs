//! The FP8 linear layer: fprop, dgrad and wgrad GEMMs, and its `Autodiff` node.
//!
//! For `y = x w` with `x [t, in]`, `w [in, out]`, each GEMM quantizes its operands along its own
//! reduction axis:
//! - fprop `y = x w`: `x` per row per 128 of `in`, `w^T` per 128 x 128 block;
//! - dgrad `dx = dy w^T`: `dy` per row per 128 of `out`, `w` per block (the same codes as fprop's,
//!   transposed);
//! - wgrad `dw = x^T dy`: `x^T` and `dy^T` per row per 128 tokens, or one of them per 128 x 128
//!   block ([`super::Fp8WgradBlocks`]).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;
use burn::tensor::ops::IntTensor;
use burn::tensor::{FloatDType, Tensor, TensorMetadata, TensorPrimitive};

use super::delayed::role::{GRAD_OUTPUT, INPUT, WEIGHT};
use super::delayed::{quantize_at, quantize_pair_at};
use super::Fp8Ops;
use super::{
    fp8_gemm, fp8_quantize, Fp8LinearConfig, Fp8Probe, Fp8Record, Fp8ScaleSite, Fp8Tensor,
    QuantSpec,
};
use crate::gemm::GemmOps;
use crate::primitive::float_dtype;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

/// `y = x w` (fprop), in FP8 when `cfg.fprop`; an untracked forward, recording no amax.
pub(crate) fn fprop<B: Fp8Ops + GemmOps>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    cfg: &Fp8LinearConfig,
    site: Option<&Fp8ScaleSite>,
) -> Tensor<B, 2> {
    if !cfg.fprop {
        return x.matmul(w);
    }
    let out = float_dtype(x.dtype());
    let a = quantize_at(x, cfg.act_spec(false), site, INPUT, Fp8Record::No);
    let b = quantize_at(w, cfg.weight_spec(true), site, WEIGHT, Fp8Record::No);
    fp8_gemm(&a, &b, out)
}

/// What the backward keeps of an operand: the tensor, or (when the backward GEMM that reads it
/// runs in FP8) its codes in the orientation that GEMM reads, quantized in the forward together
/// with the forward's own operand.
#[derive(Clone, Debug)]
pub(crate) enum Saved<B: Fp8Ops + GemmOps> {
    Plain(Tensor<B, 2>),
    Fp8(Fp8Tensor<B>),
}

impl<B: Fp8Ops + GemmOps> Saved<B> {
    /// The operand quantized as `spec` says (quantized now if it was kept as a tensor).
    fn fp8(self, spec: QuantSpec) -> Fp8Tensor<B> {
        match self {
            Saved::Fp8(q) => {
                debug_assert_eq!(q.spec, spec);
                q
            }
            Saved::Plain(t) => fp8_quantize(t, spec),
        }
    }
    /// The tensor (kept whenever a backward GEMM that reads it is not in FP8).
    fn plain(self) -> Tensor<B, 2> {
        match self {
            Saved::Plain(t) => t,
            Saved::Fp8(_) => unreachable!("an operand kept in FP8 feeds an FP8 GEMM only"),
        }
    }
}

/// `y = x w` (fprop) and what the backward needs of `x` and `w`. With fprop and wgrad in FP8,
/// `x` is quantized in both orientations in one pass (`x` for fprop, `x^T` kept for wgrad); with
/// fprop and dgrad in FP8, the weight likewise (`w^T` for fprop, `w` kept for dgrad).
pub(crate) fn fprop_saved<B: Fp8Ops + GemmOps>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    cfg: &Fp8LinearConfig,
    site: Option<&Fp8ScaleSite>,
) -> (Tensor<B, 2>, Saved<B>, Saved<B>) {
    let rec = Fp8Record::Yes;
    if !cfg.fprop {
        return (
            x.clone().matmul(w.clone()),
            Saved::Plain(x),
            Saved::Plain(w),
        );
    }
    let out = float_dtype(x.dtype());
    let (a, x_saved) = if cfg.wgrad {
        let (a, a_t) = quantize_pair_at(x, cfg.act_pair(), site, INPUT, rec);
        (a, Saved::Fp8(a_t))
    } else {
        let a = quantize_at(x.clone(), cfg.act_spec(false), site, INPUT, rec);
        (a, Saved::Plain(x))
    };
    let (b, w_saved) = if cfg.dgrad {
        let (w_q, w_t) = quantize_pair_at(w, cfg.weight_spec(false).into(), site, WEIGHT, rec);
        (w_t, Saved::Fp8(w_q))
    } else {
        let b = quantize_at(w.clone(), cfg.weight_spec(true), site, WEIGHT, rec);
        (b, Saved::Plain(w))
    };
    (fp8_gemm(&a, &b, out), x_saved, w_saved)
}

/// `(dx, dw)` of `y = x w` (dgrad, wgrad), each in FP8 when configured, from what
/// [`fprop_saved`] kept; `dx` in `x_dtype`, `dw` in `w_dtype`. With both in FP8, `dy` is quantized
/// in both orientations in one pass. With a `site`, `dy` is scaled from its history (and records
/// its amax); an operand kept as a tensor is quantized here with its own amax.
pub(crate) fn backward<B: Fp8Ops + GemmOps>(
    x: Saved<B>,
    w: Saved<B>,
    dy: Tensor<B, 2>,
    cfg: &Fp8LinearConfig,
    (x_dtype, w_dtype): (FloatDType, FloatDType),
    site: Option<&Fp8ScaleSite>,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let dy = dy.cast(x_dtype);
    let rec = Fp8Record::Yes;
    let (dy_a, dy_b) = match (cfg.dgrad, cfg.wgrad) {
        (true, true) => {
            let (a, b) = quantize_pair_at(dy.clone(), cfg.grad_pair(), site, GRAD_OUTPUT, rec);
            (Some(a), Some(b))
        }
        (true, false) => {
            let a = quantize_at(dy.clone(), cfg.grad_spec(false), site, GRAD_OUTPUT, rec);
            (Some(a), None)
        }
        (false, true) => {
            let b = quantize_at(dy.clone(), cfg.grad_spec(true), site, GRAD_OUTPUT, rec);
            (None, Some(b))
        }
        (false, false) => (None, None),
    };
    let dx = match dy_a {
        Some(a) => fp8_gemm(&a, &w.fp8(cfg.weight_spec(false)), x_dtype),
        None => dy.clone().matmul(w.plain().transpose()),
    };
    let dw = match dy_b {
        Some(b) => fp8_gemm(&x.fp8(cfg.act_spec(true)), &b, w_dtype),
        None => x.plain().transpose().matmul(dy).cast(w_dtype),
    };
    (dx, dw)
}

#[derive(Debug)]
struct Fp8LinearBackward;

impl<B: Fp8Ops + GemmOps> Backward<B, 2> for Fp8LinearBackward {
    /// (x, w as the backward needs them, their dtypes, config, health probe, scale site)
    type State = (
        Saved<B>,
        Saved<B>,
        (FloatDType, FloatDType),
        Fp8LinearConfig,
        Option<Fp8Probe>,
        Option<Fp8ScaleSite>,
    );

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (x, w, dtypes, cfg, probe, site) = ops.state;
        let dy = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(dy));
        if let Some(p) = &probe {
            p.record(GRAD_OUTPUT, dy.clone(), cfg.grad_spec(false), site.as_ref());
        }
        let (dx, dw) = backward(x, w, dy, &cfg, dtypes, site.as_ref());
        if let Some(node) = node_x {
            grads.register::<B>(node.id, dx.into_primitive().tensor());
        }
        if let Some(node) = node_w {
            grads.register::<B>(node.id, dw.into_primitive().tensor());
        }
    }
}

pub(crate) fn fp8_linear<B: Fp8Ops + GemmOps, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    w: FloatTensor<Autodiff<B, C>>,
    cfg: &Fp8LinearConfig,
    probe: Option<Fp8Probe>,
    site: Option<Fp8ScaleSite>,
) -> FloatTensor<Autodiff<B, C>> {
    let t = |p: FloatTensor<B>| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(p));
    if let Some(p) = &probe {
        p.record_input(t(x.primitive.clone()), cfg, site.as_ref());
    }
    match Fp8LinearBackward
        .prepare::<C>([x.node.clone(), w.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let dtypes = (
                float_dtype(x.primitive.dtype()),
                float_dtype(w.primitive.dtype()),
            );
            let (y, x_saved, w_saved) =
                fprop_saved(t(x.primitive), t(w.primitive), cfg, site.as_ref());
            prep.finish(
                (x_saved, w_saved, dtypes, *cfg, probe, site),
                y.into_primitive().tensor(),
            )
        }
        OpsKind::UnTracked(prep) => prep.finish(
            fprop(t(x.primitive), t(w.primitive), cfg, site.as_ref())
                .into_primitive()
                .tensor(),
        ),
    }
}

#[allow(clippy::too_many_arguments)]
impl<R, F, I, BT, C> Fp8Ops for Autodiff<CubeBackend<R, F, I, BT>, C>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    C: CheckpointStrategy,
{
    fn fp8_quantize(
        x: FloatTensor<Self>,
        spec: &super::QuantSpec,
    ) -> (IntTensor<Self>, FloatTensor<Self>) {
        let (payload, scales) = CubeBackend::<R, F, I, BT>::fp8_quantize(x.primitive, spec);
        (
            payload,
            <Self as burn::tensor::backend::AutodiffBackend>::from_inner(scales),
        )
    }
    fn fp8_quantize_pair(
        x: FloatTensor<Self>,
        spec: &super::PairSpec,
        path: super::Fp8PairPath,
    ) -> (
        (IntTensor<Self>, FloatTensor<Self>),
        (IntTensor<Self>, FloatTensor<Self>),
    ) {
        use burn::tensor::backend::AutodiffBackend;
        let ((p, s), (pt, st)) =
            CubeBackend::<R, F, I, BT>::fp8_quantize_pair(x.primitive, spec, path);
        ((p, Self::from_inner(s)), (pt, Self::from_inner(st)))
    }
    fn fp8_dequantize(
        payload: IntTensor<Self>,
        scales: FloatTensor<Self>,
        rows: usize,
        k_out: usize,
        spec: &super::QuantSpec,
        dtype: FloatDType,
    ) -> FloatTensor<Self> {
        let out = CubeBackend::<R, F, I, BT>::fp8_dequantize(
            payload,
            scales.primitive,
            rows,
            k_out,
            spec,
            dtype,
        );
        <Self as burn::tensor::backend::AutodiffBackend>::from_inner(out)
    }
    fn fp8_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        cfg: &Fp8LinearConfig,
        probe: Option<Fp8Probe>,
        site: Option<Fp8ScaleSite>,
    ) -> FloatTensor<Self> {
        fp8_linear::<CubeBackend<R, F, I, BT>, C>(x, w, cfg, probe, site)
    }
    fn fp8_health_partials(
        x: FloatTensor<Self>,
        payload: IntTensor<Self>,
        scales: FloatTensor<Self>,
        spec: &super::QuantSpec,
    ) -> FloatTensor<Self> {
        use burn::tensor::backend::AutodiffBackend;
        Self::from_inner(CubeBackend::<R, F, I, BT>::fp8_health_partials(
            x.primitive,
            payload,
            scales.primitive,
            spec,
        ))
    }
    fn fp8_mlp(
        x: FloatTensor<Self>,
        w_fc: FloatTensor<Self>,
        w_proj: FloatTensor<Self>,
        act: super::Fp8MlpActivation,
        cfg: &Fp8LinearConfig,
        sites: Option<(Fp8ScaleSite, Fp8ScaleSite)>,
    ) -> Option<FloatTensor<Self>> {
        Some(super::mlp::autodiff::<CubeBackend<R, F, I, BT>, C>(
            x, w_fc, w_proj, act, cfg, sites,
        ))
    }
    fn fp8_native_supported(x: &FloatTensor<Self>) -> bool {
        CubeBackend::<R, F, I, BT>::fp8_native_supported(&x.primitive)
    }
    fn fp8_mma_supported(payload: &IntTensor<Self>) -> bool {
        CubeBackend::<R, F, I, BT>::fp8_mma_supported(payload)
    }
    fn fp8_cublaslt_supported(payload: &IntTensor<Self>) -> bool {
        CubeBackend::<R, F, I, BT>::fp8_cublaslt_supported(payload)
    }
    fn fp8_gemm_mma(
        a: IntTensor<Self>,
        sa: FloatTensor<Self>,
        a_spec: &super::QuantSpec,
        b: IntTensor<Self>,
        sb: FloatTensor<Self>,
        b_spec: &super::QuantSpec,
        m: usize,
        n: usize,
        out: FloatDType,
    ) -> Option<FloatTensor<Self>> {
        CubeBackend::<R, F, I, BT>::fp8_gemm_mma(
            a,
            sa.primitive,
            a_spec,
            b,
            sb.primitive,
            b_spec,
            m,
            n,
            out,
        )
        .map(<Self as burn::tensor::backend::AutodiffBackend>::from_inner)
    }
    fn fp8_gemm_cublaslt(
        a: IntTensor<Self>,
        sa: FloatTensor<Self>,
        a_spec: &super::QuantSpec,
        b: IntTensor<Self>,
        sb: FloatTensor<Self>,
        b_spec: &super::QuantSpec,
        m: usize,
        n: usize,
        out: FloatDType,
    ) -> Option<FloatTensor<Self>> {
        CubeBackend::<R, F, I, BT>::fp8_gemm_cublaslt(
            a,
            sa.primitive,
            a_spec,
            b,
            sb.primitive,
            b_spec,
            m,
            n,
            out,
        )
        .map(<Self as burn::tensor::backend::AutodiffBackend>::from_inner)
    }
}
