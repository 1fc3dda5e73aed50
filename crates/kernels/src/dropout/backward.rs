//! Dropout under `Autodiff`: the state is the seed and `p` alone; the backward applies the same
//! mask, drawn again, to the output gradient.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, TensorMetadata};

use super::Dropout;
use super::DropoutKernels;

#[derive(Debug)]
struct DropoutBackward;

impl<B: DropoutKernels> Backward<B, 1> for DropoutBackward {
    /// The mask's parameters and the input's dtype.
    type State = (Dropout, DType);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (dropout, dtype) = ops.state;
        if let Some(node) = node {
            let dy = B::float_cast(dy, dtype.into());
            grads.register::<B>(node.id, B::dropout_apply(dy, dropout));
        }
    }
}

pub(crate) fn dropout<B: DropoutKernels, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    dropout: Dropout,
) -> FloatTensor<Autodiff<B, C>> {
    let dtype = x.primitive.dtype();
    let out = B::dropout_apply(x.primitive.clone(), dropout);
    match DropoutBackward
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((dropout, dtype), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

impl<B: DropoutKernels, C: CheckpointStrategy> super::DropoutOps for Autodiff<B, C> {
    fn fused_dropout(x: FloatTensor<Self>, mask: Dropout) -> FloatTensor<Self> {
        dropout::<B, C>(x, mask)
    }
}
