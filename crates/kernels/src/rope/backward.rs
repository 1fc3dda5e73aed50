//! RoPE under `Autodiff`: the gradient is the inverse rotation of the output gradient, so nothing
//! but the tables is kept.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;

use super::RopeKernels;

#[derive(Debug)]
struct RopeBackward;

impl<B: RopeKernels> Backward<B, 1> for RopeBackward {
    /// (cos, sin, dtype of x)
    type State = (FloatTensor<B>, FloatTensor<B>, burn::tensor::DType);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (cos, sin, dtype) = ops.state;
        if let Some(node) = node {
            let dy = B::float_cast(dy, dtype.into());
            grads.register::<B>(node.id, B::rope_rotate(dy, cos, sin, true));
        }
    }
}

/// Rotary embedding of an autodiff tensor; the tables are constants (no gradient).
pub(crate) fn rope<B: RopeKernels, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    cos: FloatTensor<Autodiff<B, C>>,
    sin: FloatTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    use burn::tensor::TensorMetadata;
    let dtype = x.primitive.dtype();
    let out = B::rope_rotate(
        x.primitive,
        cos.primitive.clone(),
        sin.primitive.clone(),
        false,
    );
    match RopeBackward
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((cos.primitive, sin.primitive, dtype), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

impl<B: RopeKernels, C: CheckpointStrategy> super::RopeOps for Autodiff<B, C> {
    fn fused_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rope::<B, C>(x, cos, sin)
    }
}
