//! The FlashAttention ops on `CubeBackend`: the launches of `forward.rs`, `gradients.rs` and
//! `packed.rs` behind the op traits.

use burn::tensor::ops::FloatTensor;
use burn_cubecl::CubeRuntime;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};

use super::forward::{forward, merge_heads};
use super::gradients::backward;
use super::tiles::{path, FlashPath};
use crate::dropout::Dropout;

impl<R, F, I, BT> super::AttentionKernels for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: f32,
        dropout: Option<Dropout>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        forward(q, k, v, causal, scale, dropout)
    }
    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        causal: bool,
        scale: f32,
        dropout: Option<Dropout>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        backward(q, k, v, out, lse, grad, causal, scale, dropout)
    }
    fn flash_attention_qkv_forward(
        qkv: FloatTensor<Self>,
        heads: usize,
        kv_heads: usize,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        causal: bool,
        scale: f32,
        dropout: Option<Dropout>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        super::packed::forward(qkv, heads, kv_heads, cos, sin, causal, scale, dropout)
    }
    fn flash_attention_qkv_backward(
        rotated: FloatTensor<Self>,
        heads: usize,
        kv_heads: usize,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        causal: bool,
        scale: f32,
        dropout: Option<Dropout>,
    ) -> FloatTensor<Self> {
        super::packed::backward(
            rotated, heads, kv_heads, cos, sin, out, lse, grad, causal, scale, dropout,
        )
    }
}

impl<R, F, I, BT> super::AttentionOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn fused_flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: f64,
        dropout: Option<Dropout>,
    ) -> FloatTensor<Self> {
        forward(q, k, v, causal, scale as f32, dropout).0
    }
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
        let (out, _, _) = super::packed::forward(
            qkv,
            heads,
            kv_heads,
            cos,
            sin,
            causal,
            scale as f32,
            dropout,
        );
        merge_heads(out)
    }
    fn flash_path(q: &FloatTensor<Self>) -> Option<FlashPath> {
        Some(path(q))
    }
}
