//! FlashAttention under `Autodiff`: the state is q, k, v, the output and the f32 log-sum-exp
//! (O(seq) per row, no seq x seq tensor); the backward recomputes the probabilities block by block.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorMetadata};

use super::AttentionKernels;
use crate::dropout::Dropout;

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

impl<B: AttentionKernels> Backward<B, 3> for FlashAttentionBackward {
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

pub(crate) fn flash_attention<B: AttentionKernels, C: CheckpointStrategy>(
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

#[derive(Debug)]
struct FlashQkvBackward;

/// (rotated projection, cos, sin, out, lse, (heads, kv_heads), causal, scale, dropout)
type QkvState<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    (usize, usize),
    bool,
    f32,
    Option<Dropout>,
);

impl<B: AttentionKernels> Backward<B, 1> for FlashQkvBackward {
    type State = QkvState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (rotated, cos, sin, out, lse, (heads, kv_heads), causal, scale, dropout) = ops.state;
        let Some(node) = node else { return };
        // [B, T, H hd] -> [B, H, T, hd], as views.
        let s = out.shape();
        let (b, h, t, hd) = (s[0], s[1], s[2], s[3]);
        let grad = B::float_cast(grad, rotated.dtype().into());
        let grad = B::float_permute(
            B::float_reshape(grad, Shape::new([b, t, h, hd])),
            &[0, 2, 1, 3],
        );
        let dqkv = B::flash_attention_qkv_backward(
            rotated, heads, kv_heads, cos, sin, out, lse, grad, causal, scale, dropout,
        );
        grads.register::<B>(node.id, dqkv);
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_attention_qkv<B: AttentionKernels, C: CheckpointStrategy>(
    qkv: FloatTensor<Autodiff<B, C>>,
    heads: usize,
    kv_heads: usize,
    cos: FloatTensor<Autodiff<B, C>>,
    sin: FloatTensor<Autodiff<B, C>>,
    causal: bool,
    scale: f32,
    dropout: Option<Dropout>,
) -> FloatTensor<Autodiff<B, C>> {
    // The projection itself goes to the forward, so that q and k can be rotated in its buffer.
    let (out, lse, rotated) = B::flash_attention_qkv_forward(
        qkv.primitive,
        heads,
        kv_heads,
        cos.primitive.clone(),
        sin.primitive.clone(),
        causal,
        scale,
        dropout,
    );
    let s = out.shape();
    let (b, h, t, hd) = (s[0], s[1], s[2], s[3]);
    // The output is laid out [B, T, H, hd]: merging the heads is a view.
    let y = B::float_reshape(
        B::float_permute(out.clone(), &[0, 2, 1, 3]),
        Shape::new([b, t, h * hd]),
    );
    match FlashQkvBackward
        .prepare::<C>([qkv.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            (
                rotated,
                cos.primitive,
                sin.primitive,
                out,
                lse,
                (heads, kv_heads),
                causal,
                scale,
                dropout,
            ),
            y,
        ),
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}

impl<B: AttentionKernels, C: CheckpointStrategy> super::AttentionOps for Autodiff<B, C> {
    fn fused_flash_attention_qkv(
        qkv: FloatTensor<Self>,
        heads: usize,
        kv_heads: usize,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        causal: bool,
        scale: f64,
        dropout: Option<Dropout>,
    ) -> FloatTensor<Self> {
        flash_attention_qkv::<B, C>(
            qkv,
            heads,
            kv_heads,
            cos,
            sin,
            causal,
            scale as f32,
            dropout,
        )
    }
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
