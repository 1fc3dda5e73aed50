//! FlashAttention: `softmax(scale * q k^T + mask) v` without a `seq x seq` tensor, forward and
//! backward, on tensors `[batch, heads, seq, head_dim]`.
//!
//! **Forward** (FlashAttention-2 order): a cube owns a block of query rows and walks the key/value
//! blocks, keeping the running row maximum and sum and rescaling its f32 output accumulator when
//! the maximum grows (online softmax). Scores live in registers only. With `causal`, key blocks
//! above the diagonal are skipped (query `i` sees keys `j <= i`, aligned at the first position as
//! in PyTorch's `is_causal`). Besides the output it returns the f32 log-sum-exp of every query row.
//!
//! **Backward**: a pre-pass computes `delta = rowsum(dO * O)`; then one kernel walks key blocks per
//! query block for dQ, and another walks query blocks per key block for dK and dV. Both recompute
//! `P = exp(scale * q k^T - lse)` block by block from the saved log-sum-exp, so nothing of size
//! `seq x seq` is stored between forward and backward or rebuilt in memory. Splitting dQ from dK/dV
//! costs a second recomputation of `q k^T` and `dO v^T` but needs no atomics, so gradients are
//! deterministic and the same code runs on every runtime.
//!
//! On tensor cores the dK/dV kernel also computes dQ (FlashAttention-2's scheme): each cube
//! stages its dS tile in shared memory, multiplies it by its keys and adds the partial dQ to an
//! f32 buffer with atomics (on sm_90 one vector atomic for a lane's two neighbouring columns),
//! which saves the separate kernel's two recomputed products. The order of those f32 additions
//! varies from run to run, so dQ can differ in its last bits between identical runs;
//! `BURNMIX_FLASH_TILES=dq=separate` ([`crate::settings::Settings::flash_tiles`]) selects the
//! deterministic dQ kernel. Head dims that are multiples of 16 but not of 32 use it too.
//!
//! Two dK/dV layouts: at head_dim 64 each warp owns whole key rows (all head_dim columns of dK
//! and dV, two 16-key row tiles), `mma::flash_backward_dkdv_mma`; at 128 (and the other multiples
//! of 32) the kernel runs in FlashAttention-2's warp layouts (`mma::flash_backward_split_mma`):
//! each query block's scores, dK/dV products and dQ product are split over the warps in grids of
//! their own, with P^T and dS^T passed through shared memory, so that every warp owns 32 keys and
//! each B fragment feeds two MMAs (one row tile of 16 keys would hold 128 f32 accumulators a
//! lane at hd 128). On an H100 at hd 128 the split layout is 3-13% faster than whole rows with
//! the causal mask and 10-15% without it (docs/results/2026-11-27-final.md, "The hd 128
//! backward's layouts, swept");
//! `BURNMIX_FLASH_TILES=bwd=rows` or `bwd=split` chooses either at any head_dim.
//!
//! **On Hopper** (sm_90), f16/bf16 at head_dim 64 and 128 without dropout run kernels in CUDA C++
//! on TMA and warpgroup MMA instead (`hopper/`): the forward, and the backward unless a
//! `BURNMIX_FLASH_TILES` override is set. That backward's dK/dV blocks also compute dQ, added to
//! f32 by bulk reductions, so its dQ too can differ in its last bits between runs;
//! `BURNMIX_FLASH_HOPPER=off` selects the kernels below.
//!
//! **Kernels**: f16/bf16 on CUDA with head_dim a multiple of 16 up to 128 run on tensor cores
//! (warp-level `mma.sync` m16n8k16, f32 accumulation, see `mma/`); everything else (f32, wgpu,
//! other head dims up to [`MAX_HEAD_DIM`]) runs the portable kernels, one unit per row with f32
//! arithmetic. [`flash_attention_path`](crate::flash_attention_path) says which one a tensor gets.
//! Gradients and outputs are in the input dtype; any sequence length works (partial blocks are
//! masked); `k`/`v` may have a different length from `q`.
//!
//! **Grouped-query attention** (GQA; MQA with one k/v head): `k` and `v` may have fewer heads
//! than `q`, `[batch, kv_heads, seq_k, head_dim]` with `kv_heads` dividing `heads`; query head `h`
//! attends with k/v head `h / (heads / kv_heads)`, as Hugging Face's `repeat_kv` and PyTorch's
//! `scaled_dot_product_attention(enable_gqa=True)` do. K and V are not repeated in memory: every
//! kernel keeps its grid over the query heads and reads the keys and values of the shared head
//! (the group size is a runtime argument, 1 without grouping). dK and dV are the sums over each
//! group's query heads: the dK/dV kernels write one f32 row block per query head (as
//! FlashAttention-2 does), and `kernel::sum_groups` adds each group's in f32, in a fixed order, and
//! casts to the input dtype. Without grouping the kernels write dK and dV directly, as before. The
//! dropout mask stays a function of the query head (`batch * heads + h`). [`reference`] and the
//! other references repeat k and v over the group with ordinary tensor ops ([`repeat_kv`]), so
//! their gradients come back summed over the group.

pub(crate) mod backward;
mod cube;
mod dims;
pub mod dropout;
pub(crate) mod forward;
mod fp8_reference;
pub(crate) mod gradients;
mod hopper;
pub(crate) mod kernel;
pub(crate) mod mma;
pub(crate) mod packed;
pub(crate) mod tiles;

use crate::dropout::Dropout;
pub use fp8_reference::{fp8_blocks, reference_fp8};
pub(crate) use tiles::check_tiles;
pub use tiles::{FlashPath, MAX_HEAD_DIM};

use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Bool, Int, Tensor};

/// How often the Hopper attention kernels ran in this process (compute capability 9.0, f16/bf16,
/// head_dim 64 or 128, no dropout; see `hopper/`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HopperCalls {
    /// Forwards the Hopper kernel ran in 16 bits.
    pub forward: usize,
    /// Forwards the Hopper kernel ran in FP8 (`BURNMIX_FLASH_FP8=on`, experimental).
    pub forward_fp8: usize,
    /// Backwards the Hopper kernel ran.
    pub backward: usize,
    /// Of those, backwards of [`crate::flash_attention_qkv`] that wrote the packed projection's
    /// gradient themselves, dQ and dK rotated back by RoPE as they were stored (no separate pass).
    pub backward_rope: usize,
    /// Calls a Hopper kernel applied to but could not run, which the CubeCL kernels ran instead
    /// (a warning says why, once): 0 unless the driver refused a tensor map.
    pub refused: usize,
}

impl HopperCalls {
    /// The calls made since `earlier` was read (the counts are the process's, every thread's).
    pub fn since(self, earlier: HopperCalls) -> HopperCalls {
        HopperCalls {
            forward: self.forward.saturating_sub(earlier.forward),
            forward_fp8: self.forward_fp8.saturating_sub(earlier.forward_fp8),
            backward: self.backward.saturating_sub(earlier.backward),
            backward_rope: self.backward_rope.saturating_sub(earlier.backward_rope),
            refused: self.refused.saturating_sub(earlier.refused),
        }
    }

    /// Whether no Hopper kernel ran (nor was refused).
    pub fn is_empty(&self) -> bool {
        self.forward + self.forward_fp8 + self.backward + self.refused == 0
    }
}

/// The counts of [`HopperCalls`] so far, in this process.
pub fn hopper_calls() -> HopperCalls {
    let (forward, forward_fp8, backward, backward_rope, refused) = hopper::calls();
    HopperCalls {
        forward,
        forward_fp8,
        backward,
        backward_rope,
        refused,
    }
}

/// How [`crate::flash_attention_qkv`] rotated its packed projections by RoPE in this process
/// (every thread's): in the projection's own buffer, when nothing else held it, or into a new
/// tensor (one more pass over the value heads and a tensor the size of the projection).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedRotations {
    /// Rotated in the projection's own buffer.
    pub in_place: usize,
    /// Rotated into a new tensor, the projection being held elsewhere.
    pub copied: usize,
}

impl PackedRotations {
    /// The rotations made since `earlier` was read.
    pub fn since(self, earlier: PackedRotations) -> PackedRotations {
        PackedRotations {
            in_place: self.in_place.saturating_sub(earlier.in_place),
            copied: self.copied.saturating_sub(earlier.copied),
        }
    }
}

/// The counts of [`PackedRotations`] so far, in this process.
pub fn packed_rotations() -> PackedRotations {
    let (in_place, copied) = packed::rotations();
    PackedRotations { in_place, copied }
}

/// Query heads per key/value head, `heads / kv_heads`; refused (naming both counts) unless
/// `kv_heads` divides `heads`.
#[track_caller]
pub(crate) fn kv_group(op: &str, heads: usize, kv_heads: usize) -> usize {
    if kv_heads == 0 && heads == 0 {
        return 1;
    }
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        crate::check::fail(
            op,
            format!(
                "k has {kv_heads} heads, which does not divide q's {heads} (grouped-query attention \
                 shares each k/v head among heads / kv_heads query heads)"
            ),
        );
    }
    heads / kv_heads
}

/// Key or value heads `[batch, kv_heads, seq, head_dim]` repeated for grouped-query attention:
/// `[batch, heads, seq, head_dim]`, head `h` a copy of head `h / (heads / kv_heads)` (Hugging
/// Face's `repeat_kv`). A no-op when `kv_heads == heads`. Under autodiff its gradient is the sum
/// over each group.
pub fn repeat_kv<B: BurnBackend>(x: Tensor<B, 4>, heads: usize) -> Tensor<B, 4> {
    let [b, hkv, s, d] = x.dims();
    let group = kv_group("flash_attention", heads, hkv);
    if group == 1 {
        return x;
    }
    // [b, hkv, s, d] -> [b, hkv, group, s, d] -> [b, heads, s, d]
    x.unsqueeze_dim::<5>(2)
        .expand([b, hkv, group, s, d])
        .reshape([b, heads, s, d])
}

/// The softmax scale used when none is given: `1 / sqrt(head_dim)`.
pub fn default_scale(head_dim: usize) -> f64 {
    1.0 / (head_dim as f64).sqrt()
}

/// Scaled scores `scale * q k^T` with the causal mask applied (-inf above the diagonal); `k`
/// may have fewer heads than `q` (repeated over the group first).
fn masked_scores<B: BurnBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    causal: bool,
    scale: f64,
) -> Tensor<B, 4> {
    let [_, h, sq, _] = q.dims();
    let sk = k.dims()[2];
    let k = repeat_kv(k, h);
    let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(scale);
    if causal {
        let dev = scores.device();
        let rows = Tensor::<B, 1, Int>::arange(0..sq as i64, &dev).reshape([sq, 1]);
        let cols = Tensor::<B, 1, Int>::arange(0..sk as i64, &dev).reshape([1, sk]);
        let mask: Tensor<B, 2, Bool> = cols.greater(rows);
        scores.mask_fill(mask.reshape([1, 1, sq, sk]), f32::NEG_INFINITY)
    } else {
        scores
    }
}

/// Plain-Burn attention by the naive formula, computed in the inputs' dtype (it materialises the
/// `[batch, heads, seq_q, seq_k]` scores). `q` is `[batch, heads, seq_q, head_dim]`, `k` and `v`
/// `[batch, kv_heads, seq_k, head_dim]` with `kv_heads` dividing `heads` (repeated over the
/// group, [`repeat_kv`]). `scale` defaults to `1 / sqrt(head_dim)`.
pub fn reference<B: BurnBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    causal: bool,
    scale: Option<f64>,
) -> Tensor<B, 4> {
    let [_, h, _, hd] = q.dims();
    let scale = scale.unwrap_or_else(|| default_scale(hd));
    let p = burn::tensor::activation::softmax(masked_scores(q, k, causal, scale), 3);
    p.matmul(repeat_kv(v, h))
}

/// [`reference`] with dropout on the probabilities: `(softmax(scores) * mask) v`, `mask` the
/// factors [`dropout::keep_mask`] draws on the host (0 or the keep scale), as the kernels apply
/// them, per query head. It materialises the scores and the mask.
pub fn reference_dropout<B: BurnBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    causal: bool,
    scale: Option<f64>,
    dropout: Dropout,
) -> Tensor<B, 4> {
    let [b, h, sq, hd] = q.dims();
    let sk = k.dims()[2];
    let scale = scale.unwrap_or_else(|| default_scale(hd));
    let p = burn::tensor::activation::softmax(masked_scores(q, k, causal, scale), 3);
    let mask = dropout::keep_mask::<B>(dropout, [b, h, sq, sk], &p.device()).cast(p.dtype());
    (p * mask).matmul(repeat_kv(v, h))
}

/// Plain-Burn [`crate::flash_attention_qkv`]: q, k and v sliced out of the packed projection
/// `qkv` `[batch, seq, (heads + 2 x kv_heads) x head_dim]` (q's heads, then k's, then v's), RoPE
/// on q and k ([`crate::rope::reference`]), [`reference`] or [`reference_dropout`], the heads
/// merged back: `[batch, seq, heads x head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn reference_qkv<B: BurnBackend>(
    qkv: Tensor<B, 3>,
    heads: usize,
    kv_heads: usize,
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
    causal: bool,
    scale: Option<f64>,
    dropout: Option<Dropout>,
) -> Tensor<B, 3> {
    let [b, t, width] = qkv.dims();
    let all = heads + 2 * kv_heads;
    let hd = width / all;
    // [b, t, all heads, hd] -> [b, all heads, t, hd]
    let x = qkv.reshape([b, t, all, hd]).swap_dims(1, 2);
    let part = |from: usize, n: usize| x.clone().slice([0..b, from..from + n, 0..t, 0..hd]);
    let q = crate::rope::reference(part(0, heads), cos.clone(), sin.clone());
    let k = crate::rope::reference(part(heads, kv_heads), cos, sin);
    let v = part(heads + kv_heads, kv_heads);
    let o = match dropout.filter(Dropout::is_active) {
        Some(d) => reference_dropout(q, k, v, causal, scale, d),
        None => reference(q, k, v, causal, scale),
    };
    o.swap_dims(1, 2).reshape([b, t, heads * hd])
}

/// Log-sum-exp over keys of the scaled, masked scores, `[batch, heads, seq_q]`, by the naive
/// formula in the inputs' dtype (`k` may have fewer heads, as in [`reference`]).
pub fn reference_lse<B: BurnBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    causal: bool,
    scale: Option<f64>,
) -> Tensor<B, 3> {
    let scale = scale.unwrap_or_else(|| default_scale(q.dims()[3]));
    let s = masked_scores(q, k, causal, scale);
    let m = s.clone().max_dim(3);
    let lse = (s - m.clone()).exp().sum_dim(3).log() + m;
    lse.squeeze_dim::<3>(3)
}

/// FlashAttention on a backend ([`crate::flash_attention`]). The defaults run the reference;
/// `CubeBackend` overrides them with the kernels and `Autodiff` with the kernels and their
/// backward.
pub trait AttentionOps: BurnBackend {
    fn fused_flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: f64,
        dropout: Option<Dropout>,
    ) -> FloatTensor<Self> {
        let (q, k, v) = (
            crate::primitive::tensor(q),
            crate::primitive::tensor(k),
            crate::primitive::tensor(v),
        );
        crate::primitive::prim(match dropout.filter(Dropout::is_active) {
            Some(d) => reference_dropout::<Self>(q, k, v, causal, Some(scale), d),
            None => reference::<Self>(q, k, v, causal, Some(scale)),
        })
    }

    /// [`crate::flash_attention_qkv`]: `[batch, seq, heads x head_dim]` from the packed projection
    /// `[batch, seq, (heads + 2 x kv_heads) x head_dim]`.
    #[allow(clippy::too_many_arguments)]
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
        crate::primitive::prim(reference_qkv::<Self>(
            crate::primitive::tensor(qkv),
            heads,
            kv_heads,
            crate::primitive::tensor(cos),
            crate::primitive::tensor(sin),
            causal,
            Some(scale),
            dropout,
        ))
    }

    /// The FlashAttention kernels `q` would run on; `None` where the reference runs.
    fn flash_path(_q: &FloatTensor<Self>) -> Option<FlashPath> {
        None
    }
}

/// The FlashAttention kernels' launches without autodiff, which the `Autodiff` implementation
/// records.
pub trait AttentionKernels: AttentionOps {
    /// `(out, lse)` of FlashAttention (lse f32 `[batch, heads, seq_q]`, over all probabilities
    /// whether dropped or not); `k`, `v` may have fewer heads than `q` (a divisor of its count).
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: f32,
        dropout: Option<Dropout>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// `(dq, dk, dv)` of FlashAttention from the forward's output and log-sum-exp; `dropout` must
    /// be the forward's. `dk` and `dv` have k's and v's shapes (under grouped-query attention the
    /// sums over each group's query heads).
    #[allow(clippy::too_many_arguments)]
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
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
    /// `(out, lse, rotated)` of [`crate::flash_attention_qkv`]: `out` `[batch, heads, seq,
    /// head_dim]` (laid out as `[batch, seq, heads, head_dim]`), and the projection with q and k
    /// rotated (in `qkv`'s buffer when nothing else holds it), which the backward takes.
    #[allow(clippy::too_many_arguments)]
    fn flash_attention_qkv_forward(
        qkv: FloatTensor<Self>,
        heads: usize,
        kv_heads: usize,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        causal: bool,
        scale: f32,
        dropout: Option<Dropout>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
    /// The packed projection's gradient `[batch, seq, (heads + 2 x kv_heads) x head_dim]` from
    /// the forward's rotated projection, output and log-sum-exp and the output gradient `[batch,
    /// heads, seq, head_dim]`.
    #[allow(clippy::too_many_arguments)]
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
    ) -> FloatTensor<Self>;
}
