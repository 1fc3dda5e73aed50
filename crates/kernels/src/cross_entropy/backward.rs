//! Cross-entropy under `Autodiff`: the state is the logits, the targets and the f32 log-sum-exp.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::{FloatTensor, IntTensor};

use burn::tensor::{DType, FloatDType, TensorMetadata};

use super::linear::{chunked, LinearCrossEntropy};
use super::CrossEntropyKernels;
use crate::gemm::GemmOps;
use crate::primitive::float_dtype;
use crate::reduce::ReduceOps;

#[derive(Debug)]
struct CrossEntropyBackward;

impl<B: CrossEntropyKernels + GemmOps + ReduceOps> Backward<B, 1> for CrossEntropyBackward {
    /// (logits, targets, lse, z_loss)
    type State = (FloatTensor<B>, IntTensor<B>, FloatTensor<B>, f64);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let dloss = grads.consume::<B>(&ops.node);
        let (logits, targets, lse, z) = ops.state;
        if let Some(node) = node {
            grads.register::<B>(
                node.id,
                B::cross_entropy_backward(logits, targets, lse, dloss, z),
            );
        }
    }
}

pub(crate) fn cross_entropy<B: CrossEntropyKernels + GemmOps + ReduceOps, C: CheckpointStrategy>(
    logits: FloatTensor<Autodiff<B, C>>,
    targets: IntTensor<Autodiff<B, C>>,
    z_loss: f64,
) -> FloatTensor<Autodiff<B, C>> {
    let (loss, lse) = B::cross_entropy_forward(logits.primitive.clone(), targets.clone(), z_loss);
    match CrossEntropyBackward
        .prepare::<C>([logits.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((logits.primitive, targets, lse, z_loss), loss),
        OpsKind::UnTracked(prep) => prep.finish(loss),
    }
}

/// [`crate::linear_cross_entropy`]: the gradients were taken in the forward, per unit loss
/// weight; the backward scales them by the mean loss's gradient.
#[derive(Debug)]
struct LinearCrossEntropyBackward;

impl<B: CrossEntropyKernels + GemmOps + ReduceOps> Backward<B, 2> for LinearCrossEntropyBackward {
    /// (dx and dw of the summed loss, both f32; rows; x's and w's dtypes)
    type State = (
        Option<FloatTensor<B>>,
        Option<FloatTensor<B>>,
        usize,
        DType,
        DType,
    );

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let (dx, dw, rows, x_dtype, w_dtype) = ops.state;
        // d(mean)/d(row) = g / rows, applied as each gradient is cast to its input's dtype (one
        // pass each).
        let scale = crate::primitive::tensor::<B, 1>(grads.consume::<B>(&ops.node))
            .cast(FloatDType::F32)
            .div_scalar(rows as f64);
        if let (Some(node), Some(dx)) = (node_x, dx) {
            let dx = B::scale_cast(
                dx,
                crate::primitive::prim(scale.clone()),
                float_dtype(x_dtype),
            );
            grads.register::<B>(node.id, dx);
        }
        if let (Some(node), Some(dw)) = (node_w, dw) {
            let dw = B::scale_cast(dw, crate::primitive::prim(scale), float_dtype(w_dtype));
            grads.register::<B>(node.id, dw);
        }
    }
}

pub(crate) fn linear_cross_entropy<
    B: CrossEntropyKernels + GemmOps + ReduceOps,
    C: CheckpointStrategy,
>(
    x: FloatTensor<Autodiff<B, C>>,
    w: FloatTensor<Autodiff<B, C>>,
    targets: IntTensor<Autodiff<B, C>>,
    opts: LinearCrossEntropy,
) -> FloatTensor<Autodiff<B, C>> {
    let need_dx = !x.node.requirement.is_none();
    let need_dw = !w.node.requirement.is_none();
    let rows = x.primitive.shape()[0];
    let dtypes = (x.primitive.dtype(), w.primitive.dtype());
    match LinearCrossEntropyBackward
        .prepare::<C>([x.node.clone(), w.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (loss, dx, dw) =
                chunked::<B>(x.primitive, w.primitive, targets, opts, need_dx, need_dw);
            prep.finish((dx, dw, rows, dtypes.0, dtypes.1), loss)
        }
        OpsKind::UnTracked(prep) => {
            prep.finish(chunked::<B>(x.primitive, w.primitive, targets, opts, false, false).0)
        }
    }
}

impl<B: CrossEntropyKernels + GemmOps + ReduceOps, C: CheckpointStrategy> super::CrossEntropyOps
    for Autodiff<B, C>
{
    fn fused_linear_cross_entropy(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
        opts: LinearCrossEntropy,
    ) -> FloatTensor<Self> {
        linear_cross_entropy::<B, C>(x, w, targets, opts)
    }

    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        z_loss: f64,
    ) -> FloatTensor<Self> {
        cross_entropy::<B, C>(logits, targets, z_loss)
    }
}
