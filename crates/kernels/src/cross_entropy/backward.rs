//! Cross-entropy under `Autodiff`: the state is the logits, the targets and the f32 log-sum-exp.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::{FloatTensor, IntTensor};

use crate::KernelOps;

#[derive(Debug)]
struct CrossEntropyBackward;

impl<B: KernelOps> Backward<B, 1> for CrossEntropyBackward {
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

pub(crate) fn cross_entropy<B: KernelOps, C: CheckpointStrategy>(
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

impl<B: crate::KernelOps, C: CheckpointStrategy> super::CrossEntropyOps for Autodiff<B, C> {
    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        z_loss: f64,
    ) -> FloatTensor<Self> {
        cross_entropy::<B, C>(logits, targets, z_loss)
    }
}
