//! The embedding under `Autodiff`: the forward keeps the ids; the backward is the kernels'
//! scatter-add into the table's rows.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Shape, TensorMetadata};

use super::EmbeddingKernels;

#[derive(Debug)]
struct EmbeddingBackward;

impl<B: EmbeddingKernels> Backward<B, 1> for EmbeddingBackward {
    /// (ids flattened to [n], vocabulary, the table's dtype)
    type State = (IntTensor<B>, usize, DType);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (ids, vocab, dtype) = ops.state;
        if let Some(node) = node {
            let shape = dy.shape();
            let d = shape[shape.num_dims() - 1];
            let n = shape.num_elements() / d.max(1);
            let dy = B::float_reshape(dy, Shape::new([n, d]));
            grads.register::<B>(node.id, B::embedding_scatter_grad(dy, ids, vocab, dtype));
        }
    }
}

/// The embedding of an autodiff table; the ids are constants.
pub(crate) fn embedding<B: EmbeddingKernels, C: CheckpointStrategy>(
    weight: FloatTensor<Autodiff<B, C>>,
    ids: IntTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    let table = weight.primitive.shape();
    let (vocab, dtype) = (table[0], weight.primitive.dtype());
    let n = ids.shape().num_elements();
    let flat = B::int_reshape(ids.clone(), Shape::new([n]));
    let out = B::fused_embedding(weight.primitive, ids);
    match EmbeddingBackward
        .prepare::<C>([weight.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((flat, vocab, dtype), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

impl<B: EmbeddingKernels, C: CheckpointStrategy> super::EmbeddingOps for Autodiff<B, C> {
    fn fused_embedding(weight: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        embedding::<B, C>(weight, ids)
    }
}
