//! FlashAttention under `Autodiff`: the state is q, k, v, the output and the f32 log-sum-exp
//! (O(seq) per row, no seq x seq tensor); the backward recomputes the probabilities block by block.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorMetadata;

use crate::dropout::Dropout;
use crate::KernelOps;

#[derive(Debug)]
struct FlashAttentionBackward;

/// (q, k, v, out, lse, causal, scale, dropout)
type State<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    bool,
    f32,
    Option<Dropout>,
);

impl<B: KernelOps> Backward<B, 3> for FlashAttentionBackward {
    type State = State<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [nq, nk, nv] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (q, k, v, out, lse, causal, scale, dropout) = ops.state;
        let grad = B::float_cast(grad, q.dtype().into());
        let (dq, dk, dv) =
            B::flash_attention_backward(q, k, v, out, lse, grad, causal, scale, dropout);
        for (node, g) in [(nq, dq), (nk, dk), (nv, dv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

pub(crate) fn flash_attention<B: KernelOps, C: CheckpointStrategy>(
    q: FloatTensor<Autodiff<B, C>>,
    k: FloatTensor<Autodiff<B, C>>,
    v: FloatTensor<Autodiff<B, C>>,
    causal: bool,
    scale: f32,
    dropout: Option<Dropout>,
) -> FloatTensor<Autodiff<B, C>> {
    let (out, lse) = B::flash_attention_forward(
        q.primitive.clone(),
        k.primitive.clone(),
        v.primitive.clone(),
        causal,
        scale,
        dropout,
    );
    match FlashAttentionBackward
        .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            (
                q.primitive,
                k.primitive,
                v.primitive,
                out.clone(),
                lse,
                causal,
                scale,
                dropout,
            ),
            out,
        ),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

impl<B: crate::KernelOps, C: CheckpointStrategy> super::AttentionOps for Autodiff<B, C> {
    fn fused_flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: f64,
        dropout: Option<Dropout>,
    ) -> FloatTensor<Self> {
        flash_attention::<B, C>(q, k, v, causal, scale as f32, dropout)
    }
    fn flash_path(q: &FloatTensor<Self>) -> Option<super::FlashPath> {
        B::flash_path(&q.primitive)
    }
}
