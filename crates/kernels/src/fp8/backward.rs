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
use burn::tensor::{DType, FloatDType, Tensor, TensorPrimitive};

use super::{fp8_gemm, fp8_quantize, Fp8LinearConfig, Fp8Probe};
use crate::{Backend, KernelOps};

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
pub(crate) fn fprop<B: Backend>(
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

/// `(dx, dw)` of `y = x w` (dgrad, wgrad), each in FP8 when configured.
pub(crate) fn backward<B: Backend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    dy: Tensor<B, 2>,
    cfg: &Fp8LinearConfig,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let (x_dtype, w_dtype) = (float_dtype(x.dtype()), float_dtype(w.dtype()));
    let dy = dy.cast(x_dtype);
    let dx = if cfg.dgrad {
        let a = fp8_quantize(dy.clone(), cfg.grad_spec(false));
        let b = fp8_quantize(w.clone(), cfg.weight_spec(false));
        fp8_gemm(&a, &b, x_dtype)
    } else {
        dy.clone().matmul(w.transpose())
    };
    let dw = if cfg.wgrad {
        let a = fp8_quantize(x, cfg.act_spec(true));
        let b = fp8_quantize(dy, cfg.grad_spec(true));
        fp8_gemm(&a, &b, w_dtype)
    } else {
        x.transpose().matmul(dy).cast(w_dtype)
    };
    (dx, dw)
}

#[derive(Debug)]
struct Fp8LinearBackward;

impl<B: KernelOps> Backward<B, 2> for Fp8LinearBackward {
    /// (x, w, config, health probe)
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        Fp8LinearConfig,
        Option<Fp8Probe>,
    );

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (x, w, cfg, probe) = ops.state;
        let t = |p: FloatTensor<B>| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(p));
        let dy = t(dy);
        if let Some(p) = &probe {
            p.record("grad_output", dy.clone(), cfg.grad_spec(false));
        }
        let (dx, dw) = backward(t(x), t(w), dy, &cfg);
        if let Some(node) = node_x {
            grads.register::<B>(node.id, dx.into_primitive().tensor());
        }
        if let Some(node) = node_w {
            grads.register::<B>(node.id, dw.into_primitive().tensor());
        }
    }
}

pub(crate) fn fp8_linear<B: KernelOps, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    w: FloatTensor<Autodiff<B, C>>,
    cfg: &Fp8LinearConfig,
    probe: Option<Fp8Probe>,
) -> FloatTensor<Autodiff<B, C>> {
    let t = |p: FloatTensor<B>| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(p));
    let y = fprop(t(x.primitive.clone()), t(w.primitive.clone()), cfg)
        .into_primitive()
        .tensor();
    match Fp8LinearBackward
        .prepare::<C>([x.node.clone(), w.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((x.primitive, w.primitive, *cfg, probe), y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}

#[allow(clippy::too_many_arguments)]
impl<B: crate::KernelOps, C: CheckpointStrategy> super::Fp8Ops for Autodiff<B, C> {
    fn fp8_quantize(
        x: FloatTensor<Self>,
        spec: &super::QuantSpec,
    ) -> (IntTensor<Self>, FloatTensor<Self>) {
        let (payload, scales) = B::fp8_quantize(x.primitive, spec);
        (
            payload,
            <Self as burn::tensor::backend::AutodiffBackend>::from_inner(scales),
        )
    }
    fn fp8_dequantize(
        payload: IntTensor<Self>,
        scales: FloatTensor<Self>,
        rows: usize,
        k_out: usize,
        spec: &super::QuantSpec,
        dtype: FloatDType,
    ) -> FloatTensor<Self> {
        let out = B::fp8_dequantize(payload, scales.primitive, rows, k_out, spec, dtype);
        <Self as burn::tensor::backend::AutodiffBackend>::from_inner(out)
    }
    fn fp8_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        cfg: &Fp8LinearConfig,
        probe: Option<Fp8Probe>,
    ) -> FloatTensor<Self> {
        fp8_linear::<B, C>(x, w, cfg, probe)
    }
    fn fp8_mma_supported(payload: &IntTensor<Self>) -> bool {
        B::fp8_mma_supported(payload)
    }
    fn fp8_cublaslt_supported(payload: &IntTensor<Self>) -> bool {
        B::fp8_cublaslt_supported(payload)
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
        B::fp8_gemm_mma(a, sa.primitive, a_spec, b, sb.primitive, b_spec, m, n, out)
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
        B::fp8_gemm_cublaslt(a, sa.primitive, a_spec, b, sb.primitive, b_spec, m, n, out)
            .map(<Self as burn::tensor::backend::AutodiffBackend>::from_inner)
    }
}
