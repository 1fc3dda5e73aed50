//! The FP8 linear layer: fprop, dgrad and wgrad GEMMs, and its `Autodiff` node.
//!
//! For `y = x w` with `x [t, in]`, `w [in, out]`, each GEMM quantizes its operands along its own
//! reduction axis:
//! - fprop `y = x w`: `x` per row per 128 of `in`, `w^T` per 128 x 128 block;
//! - dgrad `dx = dy w^T`: `dy` per row per 128 of `out`, `w` per block (the same codes as fprop's,
//!   transposed);
//! - wgrad `dw = x^T dy`: `x^T` and `dy^T` per row per 128 tokens.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;
use burn::tensor::ops::IntTensor;
use burn::tensor::{DType, FloatDType, Tensor, TensorMetadata, TensorPrimitive};

use super::Fp8Ops;
use super::{
    fp8_gemm, fp8_quantize, fp8_quantize_pair, Fp8LinearConfig, Fp8Probe, Fp8Tensor, QuantSpec,
};
use crate::gemm::GemmOps;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

/// The float dtype of a float tensor.
pub(crate) fn float_dtype(d: DType) -> FloatDType {
    match d {
        DType::F64 => FloatDType::F64,
        DType::F16 => FloatDType::F16,
        DType::BF16 => FloatDType::BF16,
        _ => FloatDType::F32,
    }
}

/// `y = x w` (fprop), in FP8 when `cfg.fprop`.
pub(crate) fn fprop<B: Fp8Ops + GemmOps>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    cfg: &Fp8LinearConfig,
) -> Tensor<B, 2> {
    if !cfg.fprop {
        return x.matmul(w);
    }
    let out = float_dtype(x.dtype());
    let a = fp8_quantize(x, cfg.act_spec(false));
    let b = fp8_quantize(w, cfg.weight_spec(true));
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
) -> (Tensor<B, 2>, Saved<B>, Saved<B>) {
    if !cfg.fprop {
        return (
            x.clone().matmul(w.clone()),
            Saved::Plain(x),
            Saved::Plain(w),
        );
    }
    let out = float_dtype(x.dtype());
    let (a, x_saved) = if cfg.wgrad {
        let (a, a_t) = fp8_quantize_pair(x, cfg.act_spec(false));
        (a, Saved::Fp8(a_t))
    } else {
        (
            fp8_quantize(x.clone(), cfg.act_spec(false)),
            Saved::Plain(x),
        )
    };
    let (b, w_saved) = if cfg.dgrad {
        let (w_q, w_t) = fp8_quantize_pair(w, cfg.weight_spec(false));
        (w_t, Saved::Fp8(w_q))
    } else {
        (
            fp8_quantize(w.clone(), cfg.weight_spec(true)),
            Saved::Plain(w),
        )
    };
    (fp8_gemm(&a, &b, out), x_saved, w_saved)
}

/// `(dx, dw)` of `y = x w` (dgrad, wgrad), each in FP8 when configured, from what
/// [`fprop_saved`] kept; `dx` in `x_dtype`, `dw` in `w_dtype`. With both in FP8, `dy` is quantized
/// in both orientations in one pass.
pub(crate) fn backward<B: Fp8Ops + GemmOps>(
    x: Saved<B>,
    w: Saved<B>,
    dy: Tensor<B, 2>,
    cfg: &Fp8LinearConfig,
    x_dtype: FloatDType,
    w_dtype: FloatDType,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let dy = dy.cast(x_dtype);
    let (dy_a, dy_b) = match (cfg.dgrad, cfg.wgrad) {
        (true, true) => {
            let (a, b) = fp8_quantize_pair(dy.clone(), cfg.grad_spec(false));
            (Some(a), Some(b))
        }
        (true, false) => (Some(fp8_quantize(dy.clone(), cfg.grad_spec(false))), None),
        (false, true) => (None, Some(fp8_quantize(dy.clone(), cfg.grad_spec(true)))),
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
    /// (x, w as the backward needs them, their dtypes, config, health probe)
    type State = (
        Saved<B>,
        Saved<B>,
        (FloatDType, FloatDType),
        Fp8LinearConfig,
        Option<Fp8Probe>,
    );

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (x, w, (x_dtype, w_dtype), cfg, probe) = ops.state;
        let dy = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(dy));
        if let Some(p) = &probe {
            p.record("grad_output", dy.clone(), cfg.grad_spec(false));
        }
        let (dx, dw) = backward(x, w, dy, &cfg, x_dtype, w_dtype);
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
) -> FloatTensor<Autodiff<B, C>> {
    let t = |p: FloatTensor<B>| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(p));
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
            let (y, x_saved, w_saved) = fprop_saved(t(x.primitive), t(w.primitive), cfg);
            prep.finish(
                (x_saved, w_saved, dtypes, *cfg, probe),
                y.into_primitive().tensor(),
            )
        }
        OpsKind::UnTracked(prep) => prep.finish(
            fprop(t(x.primitive), t(w.primitive), cfg)
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
        spec: &super::QuantSpec,
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
    ) -> FloatTensor<Self> {
        fp8_linear::<CubeBackend<R, F, I, BT>, C>(x, w, cfg, probe)
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
