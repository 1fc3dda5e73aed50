//! The GPT-style decoder: embedding, N pre-norm blocks, final norm, LM head.

use burn::module::{Module, ParamId};
use burn::nn::{Dropout, DropoutConfig};
use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Bool, FloatDType, Int, Tensor};

use crate::config::{AttentionKind, GptConfig, HeadLossKind, KernelsKind, MlpKind};
use crate::dropout_seeds::{mix64, DropoutSeeds};
use crate::dtype::debug_assert_dtype;
use crate::layers::{apply_rope, rope_tables_from_freqs, Embedding, Linear, RmsNorm};
use crate::precision::{Precision, Projection, PROJECTION_PATHS};

/// Score given to masked (future) positions: finite, because WGSL has no infinity literal, and far
/// enough below any real score that its softmax weight is exactly 0 in f32.
pub(crate) const MASKED: f32 = -1e9;

/// Causal self-attention with rotary position embeddings: multi-head, or grouped-query where
/// `n_kv_head < n_head` (each key/value head serves `n_head / n_kv_head` query heads).
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// [d_model, (n_head + 2 * n_kv_head) * head_dim]: the q, k and v projections side by side.
    pub qkv: Linear<B>,
    /// [d_model, d_model]: the output (residual) projection.
    pub proj: Linear<B>,
    pub attn_dropout: Dropout,
    pub resid_dropout: Dropout,
    #[module(skip)]
    pub n_head: usize,
    #[module(skip)]
    pub n_kv_head: usize,
}

impl<B: Backend> Attention<B> {
    fn new(cfg: &GptConfig, device: &B::Device) -> Self {
        let d = cfg.d_model;
        let resid_std = cfg.init_std / (2.0 * cfg.n_layer as f64).sqrt();
        Self {
            qkv: Linear::new(d, cfg.qkv_width(), cfg.bias, cfg.init_std, device),
            proj: Linear::new(d, d, cfg.bias, resid_std, device),
            attn_dropout: DropoutConfig::new(cfg.dropout).init(),
            resid_dropout: DropoutConfig::new(cfg.dropout).init(),
            n_head: cfg.n_head,
            n_kv_head: cfg.kv_heads(),
        }
    }
}

impl<B: kernels::Backend> Attention<B> {
    /// x: [B, T, d] -> [B, T, d]; `layer` numbers the block (it keys the dropout masks).
    fn forward(&self, x: Tensor<B, 3>, ctx: &Ctx<B>, layer: usize) -> Tensor<B, 3> {
        let qkv = self
            .qkv
            .forward_projection(x, &ctx.projection(layer, "attn.qkv"));
        self.attend(qkv, ctx, layer)
    }

    /// The attention and output projection of the packed q/k/v projection `qkv`
    /// [B, T, (H + 2 Hkv) hd] -> [B, T, d].
    fn attend(&self, qkv: Tensor<B, 3>, ctx: &Ctx<B>, layer: usize) -> Tensor<B, 3> {
        if let Some(cache) = ctx.decode {
            return self.attend_cached(qkv, ctx, layer, cache);
        }
        let [b, t, _] = qkv.dims();
        let (h, hkv) = (self.n_head, self.n_kv_head);
        let d = self.proj.weight.dims()[1];
        let hd = d / h;
        let scale = (hd as f64).powf(-0.5);
        if let (AttentionKind::Flash, RopeTables::Fused { cos, sin }) = (ctx.attention, &ctx.tables)
        {
            // RoPE and FlashAttention on the packed projection as one op, whose backward writes
            // the projection's gradient packed (slices would each zero-fill a whole one).
            let y = kernels::flash_attention_qkv(
                qkv,
                h,
                hkv,
                cos.clone(),
                sin.clone(),
                true,
                Some(scale),
                ctx.attention_dropout(layer),
            );
            return ctx.dropout(
                &self.resid_dropout,
                self.proj
                    .forward_projection(y, &ctx.projection(layer, "attn.proj")),
                layer,
                Site::AttentionOut,
            );
        }
        let (q, k, v) = self.rotated(qkv, &ctx.tables);

        if ctx.attention == AttentionKind::Flash {
            // f32 softmax statistics inside the kernel; the output is laid out [B, T, H, hd], so
            // the reshape below is free. Dropout on the probabilities happens inside the kernels.
            let y = match ctx.attention_dropout(layer) {
                Some(d) => kernels::flash_attention_dropout(q, k, v, true, Some(scale), d),
                None => kernels::flash_attention(q, k, v, true, Some(scale)),
            };
            let y = y.swap_dims(1, 2).reshape([b, t, d]);
            return ctx.dropout(
                &self.resid_dropout,
                self.proj
                    .forward_projection(y, &ctx.projection(layer, "attn.proj")),
                layer,
                Site::AttentionOut,
            );
        }
        // [B, H, T, T] scores, scaled, masked and normalised in f32; the additive mask is 0 on and
        // below the diagonal, MASKED above. The probabilities return to the compute dtype for P V.
        // q is scaled before the product so that large scores cannot overflow f16 in the matmul.
        let (k, v) = (repeat_kv(k, h / hkv), repeat_kv(v, h / hkv));
        let scores = q
            .mul_scalar(scale)
            .matmul(k.swap_dims(2, 3))
            .cast(FloatDType::F32)
            + ctx
                .causal_mask
                .clone()
                .expect("plain attention's context has the mask");
        let probs = self
            .attn_dropout
            .forward(softmax(scores, 3))
            .cast(v.dtype());
        let y = probs.matmul(v); // [B, H, T, hd]
        let y = y.swap_dims(1, 2).reshape([b, t, d]);
        ctx.dropout(
            &self.resid_dropout,
            self.proj
                .forward_projection(y, &ctx.projection(layer, "attn.proj")),
            layer,
            Site::AttentionOut,
        )
    }
}

impl<B: kernels::Backend> Attention<B> {
    /// The packed projection `qkv` [B, T, (H + 2 Hkv) hd] split into q [B, H, T, hd] and k, v
    /// [B, Hkv, T, hd], q and k rotated with `tables` (one row per position of `qkv`).
    pub(crate) fn rotated(
        &self,
        qkv: Tensor<B, 3>,
        tables: &RopeTables<B>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
        let [b, t, _] = qkv.dims();
        let (h, hkv) = (self.n_head, self.n_kv_head);
        let hd = self.proj.weight.dims()[1] / h;
        // [B, T, (H + 2 Hkv) hd] -> [B, H + 2 Hkv, T, hd]; heads 0..H are q, then Hkv of k, then
        // Hkv of v.
        let qkv = qkv.reshape([b, t, h + 2 * hkv, hd]).swap_dims(1, 2);
        let (kh, vh) = (h..h + hkv, h + hkv..h + 2 * hkv);
        match tables {
            RopeTables::Reference { cos, sin } => {
                let q = qkv.clone().slice([0..b, 0..h, 0..t, 0..hd]);
                let k = qkv.clone().slice([0..b, kh, 0..t, 0..hd]);
                let v = qkv.slice([0..b, vh, 0..t, 0..hd]);
                (apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
            }
            RopeTables::Fused { cos, sin } => {
                // The kernel reads q and k strided out of the projection and writes each to its own
                // dense tensor. Rotating both in one launch and chunking the result would hand the
                // attention matmuls views with a gap between batch entries, which Burn 0.21's CUDA
                // matmul multiplies wrongly (docs/results/2026-11-23-late.md, "shakespeare_char on
                // CUDA (H200): the matrix and the bar", the fused + plain fault).
                let q = kernels::rope(
                    qkv.clone().slice([0..b, 0..h, 0..t, 0..hd]),
                    cos.clone(),
                    sin.clone(),
                );
                let k = kernels::rope(
                    qkv.clone().slice([0..b, kh, 0..t, 0..hd]),
                    cos.clone(),
                    sin.clone(),
                );
                (q, k, qkv.slice([0..b, vh, 0..t, 0..hd]))
            }
        }
    }
}

/// `x` [B, Hkv, T, hd] with each head repeated `group` times in a row, [B, Hkv * group, T, hd]:
/// query head `h` of grouped-query attention meets key/value head `h / group`. The identity when
/// `group` is 1.
pub(crate) fn repeat_kv<B: Backend>(x: Tensor<B, 4>, group: usize) -> Tensor<B, 4> {
    if group == 1 {
        return x;
    }
    let [b, hkv, t, hd] = x.dims();
    x.unsqueeze_dim::<5>(2)
        .expand([b, hkv, group, t, hd])
        .reshape([b, hkv * group, t, hd])
}

/// Feed-forward block, SwiGLU or GELU.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// GELU: [d, ff]. SwiGLU: [d, 2 * ff], gate then up.
    pub fc: Linear<B>,
    /// [ff, d]: the residual projection.
    pub proj: Linear<B>,
    pub dropout: Dropout,
    #[module(skip)]
    pub kind: MlpKind,
}

impl<B: Backend> Mlp<B> {
    fn new(cfg: &GptConfig, device: &B::Device) -> Self {
        let (d, ff) = (cfg.d_model, cfg.ff_width());
        let fc_out = match cfg.mlp {
            MlpKind::Gelu | MlpKind::GeluTanh => ff,
            MlpKind::Swiglu => 2 * ff,
        };
        let resid_std = cfg.init_std / (2.0 * cfg.n_layer as f64).sqrt();
        Self {
            fc: Linear::new(d, fc_out, cfg.bias, cfg.init_std, device),
            proj: Linear::new(ff, d, cfg.bias, resid_std, device),
            dropout: DropoutConfig::new(cfg.dropout).init(),
            kind: cfg.mlp,
        }
    }
}

impl<B: kernels::Backend> Mlp<B> {
    /// The feed-forward block on plain Burn ops (the activations' references), before its
    /// dropout; `fc` and `proj`: how the two projections run.
    fn forward(&self, x: Tensor<B, 3>, fc: &Projection, proj: &Projection) -> Tensor<B, 3> {
        let h = self.fc.forward_projection(x, fc);
        let h = match self.kind {
            MlpKind::Gelu => kernels::activation::gelu_reference(h),
            MlpKind::GeluTanh => kernels::activation::gelu_tanh_reference(h),
            MlpKind::Swiglu => kernels::activation::swiglu_packed_reference(h),
        };
        self.proj.forward_projection(h, proj)
    }

    /// The fused activation kernel and the residual projection on the output `h` of `fc`, before
    /// the dropout; with `recompute`, the activation's output is not kept for the backward.
    fn activate_project(
        &self,
        h: Tensor<B, 3>,
        proj: &Projection,
        recompute: bool,
    ) -> Tensor<B, 3> {
        let activation = match self.kind {
            MlpKind::Gelu => kernels::recompute::Activation::Gelu,
            MlpKind::GeluTanh => kernels::recompute::Activation::GeluTanh,
            MlpKind::Swiglu => kernels::recompute::Activation::SwigluPacked,
        };
        self.proj
            .forward_after_activation(h, activation, proj, recompute)
    }

    /// The activation of `kernels::fp8_mlp_scaled` for this block, if that op has it: the exact
    /// GELU and packed SwiGLU; not GELU's tanh approximation, whose block runs its projections in
    /// FP8 apart and the activation in its own kernel.
    fn fp8_activation(&self) -> Option<kernels::Fp8MlpActivation> {
        match self.kind {
            MlpKind::Gelu => Some(kernels::Fp8MlpActivation::Gelu),
            MlpKind::Swiglu => Some(kernels::Fp8MlpActivation::SwigluPacked),
            MlpKind::GeluTanh => None,
        }
    }

    /// Whether `fc`, the activation and `proj` run as one op (`kernels::fp8_mlp_scaled`, which
    /// quantizes the activation's output and gradient in the kernels that compute them): a block
    /// whose activation that op has ([`Mlp::fp8_activation`]), without biases, whose two
    /// projections run in FP8 with the same settings (and both with or both without a
    /// delayed-scaling site) and measure nothing this step (FP8 health and gradient formats are
    /// measured on the projections run apart).
    fn fused_fp8(&self, fc: &Projection, proj: &Projection) -> bool {
        let unprobed = |p: &Projection| p.fp8_probe.is_none() && p.grad_probe.is_none();
        self.fp8_activation().is_some()
            && self.fc.bias.is_none()
            && self.proj.bias.is_none()
            && fc.fp8.is_some()
            && fc.fp8 == proj.fp8
            && fc.fp8_site.is_some() == proj.fp8_site.is_some()
            && unprobed(fc)
            && unprobed(proj)
    }

    /// Whether `fc`, GELU's tanh approximation and `proj` run as one op
    /// (`kernels::gelu_tanh_mlp`, which puts the GELU and its derivative into cuBLASLt's GEMM
    /// epilogues): a tanh-GELU block without biases whose two projections run on the same GEMM
    /// engine, not Burn's matmul, neither in FP8 nor measured this step, and whose activation is
    /// kept (not `recompute`d).
    fn fused_gelu_tanh(&self, fc: &Projection, proj: &Projection, recompute: bool) -> bool {
        let plain = |p: &Projection| p.fp8.is_none() && p.grad_probe.is_none();
        self.kind == MlpKind::GeluTanh
            && !recompute
            && self.fc.bias.is_none()
            && self.proj.bias.is_none()
            && plain(fc)
            && plain(proj)
            && fc.gemm == proj.gemm
            && fc.gemm != kernels::Gemm::Burn
    }

    /// `gelu_tanh(n W_fc) W_proj` on the normed input `n` as one op (see
    /// [`Mlp::fused_gelu_tanh`]).
    fn forward_gelu_tanh(&self, n: Tensor<B, 3>, fc: &Projection) -> Tensor<B, 3> {
        let [b, t, d] = n.dims();
        let (w_fc, w_proj) = (self.fc.weight.val(), self.proj.weight.val());
        let y = kernels::gelu_tanh_mlp(n.reshape([b * t, d]), w_fc, w_proj, fc.gemm);
        let out = y.dims()[1];
        y.reshape([b, t, out])
    }

    /// `act(n W_fc) W_proj` on the normed input `n` as one FP8 op (see [`Mlp::fused_fp8`]).
    fn forward_fp8(&self, n: Tensor<B, 3>, fc: &Projection, proj: &Projection) -> Tensor<B, 3> {
        let cfg = fc.fp8.expect("an FP8 projection");
        let [b, t, d] = n.dims();
        let (w_fc, w_proj) = (self.fc.weight.val(), self.proj.weight.val());
        let sites = fc.fp8_site.as_ref().zip(proj.fp8_site.as_ref());
        let act = self
            .fp8_activation()
            .expect("fused_fp8 takes only the activations fp8_mlp_scaled has");
        let n = n.reshape([b * t, d]);
        let y = kernels::fp8_mlp_scaled(n, w_fc, w_proj, act, &cfg, sites);
        let out = y.dims()[1];
        y.reshape([b, t, out])
    }
}

/// A block's projection layers, by reference (`block_projections!(b)`) or mutable reference
/// (`block_projections!(b, mut)`), in the order of [`PROJECTION_PATHS`].
macro_rules! block_projections {
    ($b:expr $(, $m:tt)?) => {
        [
            &$($m)? $b.attn.qkv,
            &$($m)? $b.attn.proj,
            &$($m)? $b.mlp.fc,
            &$($m)? $b.mlp.proj,
        ]
    };
}

/// Block `i`'s projections with their module paths (`blocks.{i}.attn.qkv`, ...).
fn named_projections<L>(i: usize, layers: [L; 4]) -> impl Iterator<Item = (String, L)> {
    PROJECTION_PATHS
        .iter()
        .zip(layers)
        .map(move |(name, l)| (format!("blocks.{i}.{name}"), l))
}

/// Pre-norm transformer block: `x + attn(norm(x))`, then `x + mlp(norm(x))`.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub norm1: RmsNorm<B>,
    pub attn: Attention<B>,
    pub norm2: RmsNorm<B>,
    pub mlp: Mlp<B>,
}

impl<B: Backend> Block<B> {
    fn new(cfg: &GptConfig, device: &B::Device) -> Self {
        Self {
            norm1: RmsNorm::new(cfg.d_model, cfg.norm_eps, device),
            attn: Attention::new(cfg, device),
            norm2: RmsNorm::new(cfg.d_model, cfg.norm_eps, device),
            mlp: Mlp::new(cfg, device),
        }
    }
}

impl<B: kernels::Backend> Block<B> {
    /// Plain Burn: `x + attn(norm1(x))`, then `x + mlp(norm2(x))`.
    fn forward(&self, x: Tensor<B, 3>, ctx: &Ctx<B>, layer: usize) -> Tensor<B, 3> {
        let x = x.clone() + self.attn.forward(self.norm1.forward(x), ctx, layer);
        let (fc, proj) = ctx.mlp_projections(layer);
        let m = self.mlp.forward(self.norm2.forward(x.clone()), &fc, &proj);
        x + ctx.dropout(&self.mlp.dropout, m, layer, Site::MlpOut)
    }

    /// One block on the residual stream `s`: [`Block::forward_fused`] with the fused kernels, else
    /// [`Block::forward`].
    pub(crate) fn step(&self, s: Stream<B>, ctx: &Ctx<B>, layer: usize, fused: bool) -> Stream<B> {
        if fused {
            let (x, delta) = self.forward_fused(s.x, s.pending, ctx, layer);
            Stream {
                x,
                pending: Some(delta),
            }
        } else {
            Stream {
                x: self.forward(s.x, ctx, layer),
                pending: None,
            }
        }
    }

    /// Fused kernels: each residual add happens inside the following norm's kernel. Takes the
    /// residual stream and the previous block's MLP output not yet added to it; returns the same
    /// pair for the next block (or the final norm).
    fn forward_fused(
        &self,
        x: Tensor<B, 3>,
        pending: Option<Tensor<B, 3>>,
        ctx: &Ctx<B>,
        layer: usize,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        // With selective recomputation the norms' and the activation's outputs are computed
        // again in the backward instead of kept.
        let selective = ctx.selective(layer);
        let qkv = ctx.projection(layer, "attn.qkv");
        let (x, qkv) = self
            .attn
            .qkv
            .forward_after_norm(&self.norm1, x, pending, &qkv, selective);
        let a = self.attn.attend(qkv, ctx, layer);
        let (fc, proj) = ctx.mlp_projections(layer);
        let (x, m) = if self.mlp.fused_fp8(&fc, &proj) {
            let (x, n) = self.norm2.forward_add(a, x);
            (x, self.mlp.forward_fp8(n, &fc, &proj))
        } else if self.mlp.fused_gelu_tanh(&fc, &proj, selective) {
            let (x, n) = self.norm2.forward_add(a, x);
            (x, self.mlp.forward_gelu_tanh(n, &fc))
        } else {
            let (x, h) = self
                .mlp
                .fc
                .forward_after_norm(&self.norm2, x, Some(a), &fc, selective);
            (x, self.mlp.activate_project(h, &proj, selective))
        };
        (x, ctx.dropout(&self.mlp.dropout, m, layer, Site::MlpOut))
    }
}

/// The residual stream between blocks: with the fused kernels, the stream and the previous
/// block's MLP output not yet added to it (the next norm's kernel adds it); else the stream alone.
#[derive(Clone)]
pub(crate) struct Stream<B: Backend> {
    pub x: Tensor<B, 3>,
    pub pending: Option<Tensor<B, 3>>,
}

/// RoPE tables in the layout each implementation takes.
pub(crate) enum RopeTables<B: Backend> {
    /// [1, 1, T, head_dim / 2] each, in the compute dtype.
    Reference {
        cos: Tensor<B, 4>,
        sin: Tensor<B, 4>,
    },
    /// [T, head_dim / 2] each, f32 (the kernel rotates in f32).
    Fused {
        cos: Tensor<B, 2>,
        sin: Tensor<B, 2>,
    },
}

/// What every layer of one forward shares: RoPE tables, the causal mask, the attention kind, the
/// forward's precision and the seed of its in-kernel dropout masks.
pub(crate) struct Ctx<'a, B: Backend> {
    pub(crate) tables: RopeTables<B>,
    /// [1, 1, T, T] ([1, 1, T, capacity] while generating), f32: 0 where a query may attend,
    /// MASKED where it may not; only where plain attention runs (FlashAttention masks inside its
    /// kernels).
    pub(crate) causal_mask: Option<Tensor<B, 4>>,
    pub(crate) attention: AttentionKind,
    pub(crate) precision: &'a Precision,
    /// `(p, seed)` when training with dropout.
    pub(crate) masks: Option<(f64, u64)>,
    /// Whether the embedding's and residual branches' dropout runs in the kernels
    /// (`kernels::dropout`: with the fused ops and flash attention, so that every mask is the
    /// kernels') rather than in Burn's `Dropout` modules.
    pub(crate) kernel_dropout: bool,
    /// Per block (one entry for each of the model's blocks), whether it recomputes its norms'
    /// and activation's outputs ([`GptConfig::recomputes_selectively`]).
    pub(crate) selective: Vec<bool>,
    /// While generating: the keys and values of the positions before this forward's, which
    /// the attention extends and attends over ([`crate::decode`]).
    pub(crate) decode: Option<&'a crate::decode_cache::DecodeCache<B>>,
}

/// Where a dropout mask applies; with the block index it keys the mask's seed.
#[derive(Clone, Copy)]
enum Site {
    Embedding = 0,
    Attention = 1,
    AttentionOut = 2,
    MlpOut = 3,
}

impl<B: kernels::Backend> Ctx<'_, B> {
    /// Whether block `layer` recomputes its norms' and activation's outputs in the backward.
    fn selective(&self, layer: usize) -> bool {
        self.selective.get(layer).copied().unwrap_or(false)
    }

    /// How projection `path` of block `layer` runs.
    pub(crate) fn projection(&self, layer: usize, path: &str) -> Projection {
        self.precision.projection(layer, self.selective.len(), path)
    }

    /// How the MLP's two projections of block `layer` run.
    fn mlp_projections(&self, layer: usize) -> (Projection, Projection) {
        (
            self.projection(layer, "mlp.fc"),
            self.projection(layer, "mlp.proj"),
        )
    }

    /// The in-kernel dropout at `site` of block `layer`: a seed of its own per site, block and
    /// forward.
    fn mask(&self, layer: usize, site: Site) -> Option<kernels::Dropout> {
        self.masks.map(|(p, seed)| {
            let at = ((layer as u64 + 1) << 2) | site as u64;
            kernels::Dropout::new(p, mix64(seed ^ mix64(at)))
        })
    }

    /// FlashAttention's dropout in block `layer`.
    fn attention_dropout(&self, layer: usize) -> Option<kernels::Dropout> {
        self.mask(layer, Site::Attention)
    }

    /// `x` through the dropout at `site` of block `layer`: the kernel's with the fused ops and
    /// flash attention, else Burn's `module` (which acts only when training).
    fn dropout<const D: usize>(
        &self,
        module: &Dropout,
        x: Tensor<B, D>,
        layer: usize,
        site: Site,
    ) -> Tensor<B, D> {
        match self.mask(layer, site) {
            Some(d) if self.kernel_dropout => kernels::dropout(x, d),
            _ => module.forward(x),
        }
    }
}

/// Which parameters outside the blocks a forward is about to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outside {
    /// The embedding, for the lookup.
    Embedding,
    /// The final norm's gain and an untied LM head (a tied head reads the embedding, which the
    /// forward passed through the hook for the lookup).
    Head,
}

/// The decoder-only transformer.
#[derive(Module, Debug)]
pub struct Gpt<B: Backend> {
    pub wte: Embedding<B>,
    pub drop: Dropout,
    pub blocks: Vec<Block<B>>,
    pub norm_f: RmsNorm<B>,
    /// Absent when the LM head shares the embedding matrix.
    pub lm_head: Option<Linear<B>>,
    #[module(skip)]
    pub config: GptConfig,
    /// Dtype of the matmuls and activations: F32 for a model made by [`Gpt::new`], BF16 or F16 for
    /// a [`Gpt::compute_copy`].
    #[module(skip)]
    pub compute_dtype: FloatDType,
    /// Seeds of the dropout masks drawn inside the kernels ([`Gpt::set_dropout_seed`]).
    #[module(skip)]
    pub dropout_seeds: DropoutSeeds,
}

impl<B: Backend> Gpt<B> {
    /// A freshly initialised model with `vocab` tokens (the resolved vocabulary size). Weights are
    /// drawn from the backend's RNG: seed it first (`B::seed`) for a reproducible initialisation.
    pub fn new(cfg: &GptConfig, vocab: usize, device: &B::Device) -> Self {
        let mut config = cfg.resolved();
        config.vocab_size = vocab;
        let blocks = (0..cfg.n_layer).map(|_| Block::new(cfg, device)).collect();
        let lm_head = (!cfg.tie_embeddings)
            .then(|| Linear::new(cfg.d_model, vocab, false, cfg.init_std, device));
        Self {
            wte: Embedding::new(vocab, cfg.d_model, cfg.init_std, device),
            drop: DropoutConfig::new(cfg.dropout).init(),
            blocks,
            norm_f: RmsNorm::new(cfg.d_model, cfg.norm_eps, device),
            lm_head,
            config,
            compute_dtype: FloatDType::F32,
            dropout_seeds: DropoutSeeds::default(),
        }
    }

    /// Seeds the dropout masks drawn inside the kernels (with `model.dropout > 0`: FlashAttention's,
    /// and with the fused ops and flash attention the embedding's and residual branches') from
    /// `seed` and the count of training forwards from now on. Training loops call it once per step
    /// with a seed of (run seed, step), so a resumed run draws the masks the uninterrupted one
    /// drew. Without it the masks follow seed 0.
    pub fn set_dropout_seed(&mut self, seed: u64) {
        self.dropout_seeds = DropoutSeeds::new(seed);
    }

    /// A copy that computes in `dtype` (BF16 or F16; F32 returns a plain clone).
    ///
    /// The weights of every linear layer (and an untied LM head) are cast once, here, into new leaf
    /// tensors that keep their parameter ids, so `GradientsParams::from_grads(grads, &copy)` holds
    /// their gradients (in `dtype`) under the ids of `self`'s master weights. The embedding and the
    /// RMSNorm gains are shared with `self` and stay f32: the lookup and the norms run in f32, and
    /// their gradients are f32. A tied LM head casts the embedding to `dtype` once per forward.
    pub fn compute_copy(&self, dtype: FloatDType) -> Self {
        self.compute_copy_with(dtype, &|_| None)
    }

    /// [`Gpt::compute_copy`], taking each weight's copy from `cached` when it has one (already in
    /// `dtype`: the fused AdamW step writes them) instead of casting it again.
    pub fn compute_copy_with(
        &self,
        dtype: FloatDType,
        cached: &dyn Fn(ParamId) -> Option<FloatTensor<B>>,
    ) -> Self {
        if dtype == FloatDType::F32 {
            return self.clone();
        }
        let mut copy = self.clone();
        for (_, lin) in copy.projections_mut() {
            *lin = lin.compute_copy_with(dtype, cached);
        }
        copy.lm_head = copy
            .lm_head
            .as_ref()
            .map(|h| h.compute_copy_with(dtype, cached));
        copy.compute_dtype = dtype;
        copy
    }

    /// The precision of this model's own forwards: its compute dtype and its config's GEMM
    /// engine, without FP8 or probes (the trainer passes the recipe's to
    /// [`Gpt::forward_loss_in`]).
    pub fn precision(&self) -> Precision {
        Precision::new(self.compute_dtype, self.config.gemm.engine())
    }

    /// Whether the memory-bound ops run the fused kernels (`model.kernels` other than
    /// "reference"; [`Gpt::new`] resolved "auto" to "fused").
    pub(crate) fn fused(&self) -> bool {
        self.config.kernels != KernelsKind::Reference
    }

    /// RoPE's inverse frequencies (`model.rope_theta`, stretched by `model.rope_scaling`).
    pub(crate) fn rope_freqs(&self) -> Vec<f32> {
        self.config
            .rope_scaling
            .inv_freq(self.config.head_dim(), self.config.rope_theta)
    }

    /// The attention and MLP projections of every block with their module paths
    /// (`blocks.N.attn.qkv`, `blocks.N.attn.proj`, `blocks.N.mlp.fc`, `blocks.N.mlp.proj`): the
    /// layers the compute copy casts and the FP8 recipe runs in FP8.
    pub fn projections(&self) -> Vec<(String, &Linear<B>)> {
        let blocks = self.blocks.iter().enumerate();
        blocks
            .flat_map(|(i, b)| named_projections(i, block_projections!(b)))
            .collect()
    }

    /// The projections that run in FP8 under `precision` ([`Precision::fp8_at`]), with the FP8
    /// settings each runs with.
    pub fn fp8_projections(
        &self,
        precision: &Precision,
    ) -> Vec<(String, &Linear<B>, kernels::Fp8LinearConfig)> {
        let n_layer = self.blocks.len();
        let blocks = self.blocks.iter().enumerate();
        blocks
            .flat_map(|(i, b)| {
                named_projections(i, block_projections!(b))
                    .zip(PROJECTION_PATHS)
                    .filter_map(move |((n, l), path)| {
                        Some((n, l, precision.fp8_at(i, n_layer, path)?))
                    })
            })
            .collect()
    }

    /// [`Gpt::projections`], mutable.
    pub fn projections_mut(&mut self) -> Vec<(String, &mut Linear<B>)> {
        let blocks = self.blocks.iter_mut().enumerate();
        blocks
            .flat_map(|(i, b)| named_projections(i, block_projections!(b, mut)))
            .collect()
    }

    /// Ids of the parameters [`Gpt::compute_copy`] casts to the compute dtype.
    pub fn compute_copy_ids(&self) -> std::collections::HashSet<ParamId> {
        let mut ids = std::collections::HashSet::new();
        for (_, l) in self.projections() {
            ids.extend(l.param_ids());
        }
        if let Some(h) = &self.lm_head {
            ids.extend(h.param_ids());
        }
        ids
    }
}

impl<B: kernels::Backend> Gpt<B> {
    /// Token ids [B, T] (T <= context) -> logits [B, T, vocab], always f32 (the LM head's matmul
    /// runs in the compute dtype, its output is cast to f32).
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.logits(ids).cast(FloatDType::F32)
    }

    /// Token ids [B, T] -> logits [B, T, vocab] in the compute dtype.
    fn logits(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let precision = self.precision();
        let x = self.final_hidden(ids, &precision);
        self.head(x, precision.gemm)
    }

    /// Token ids [B, T] -> the final norm's output [B, T, d] in the compute dtype.
    fn final_hidden(&self, ids: Tensor<B, 2, Int>, precision: &Precision) -> Tensor<B, 3> {
        let masks = self.masks(&ids.device());
        let ctx = self.ctx(&ids, precision, masks);
        let mut s = self.embed(ids, &ctx);
        for (layer, block) in self.blocks.iter().enumerate() {
            s = block.step(s, &ctx, layer, self.fused());
            debug_assert_dtype(&s.x, self.compute_dtype, "residual stream after a block");
        }
        self.final_norm(s)
    }

    /// `(p, seed)` of the next training forward's dropout masks: with `model.dropout > 0` and
    /// autodiff (Burn's `Dropout` modules act only with autodiff; the kernels' dropout does the
    /// same), else none.
    pub(crate) fn masks(&self, device: &B::Device) -> Option<(f64, u64)> {
        (self.config.dropout > 0.0 && B::ad_enabled(device))
            .then(|| (self.config.dropout, self.dropout_seeds.next_forward()))
    }

    /// What every layer of a forward of `ids` [B, T] shares, with dropout `masks`.
    pub(crate) fn ctx<'a>(
        &self,
        ids: &Tensor<B, 2, Int>,
        precision: &'a Precision,
        masks: Option<(f64, u64)>,
    ) -> Ctx<'a, B> {
        let [_, t] = ids.dims();
        assert!(
            t <= self.config.context,
            "sequence of {t} tokens is longer than model.context = {}",
            self.config.context
        );
        let device = ids.device();
        let dt = self.compute_dtype;
        let inv_freq = self.rope_freqs();
        let fused = self.fused();
        let tables = if fused {
            let (cos, sin) = kernels::rope::tables_from_freqs::<B>(t, &inv_freq, &device);
            RopeTables::Fused { cos, sin }
        } else {
            let (cos, sin) = rope_tables_from_freqs::<B>(t, &inv_freq, &device);
            RopeTables::Reference {
                cos: cos.cast(dt),
                sin: sin.cast(dt),
            }
        };
        let attention = self.config.attention_resolved();
        // Burn's tril_mask is true outside the lower triangle, i.e. at the future keys (j > i).
        let causal_mask = (attention == AttentionKind::Plain).then(|| {
            let above = Tensor::<B, 2, Bool>::tril_mask([t, t], 0, &device);
            Tensor::<B, 2>::zeros([t, t], &device)
                .mask_fill(above, MASKED)
                .reshape([1, 1, t, t])
        });
        Ctx {
            tables,
            causal_mask,
            attention,
            precision,
            masks,
            kernel_dropout: fused && attention == AttentionKind::Flash,
            selective: (0..self.config.n_layer)
                .map(|l| self.config.recomputes_selectively(l))
                .collect(),
            decode: None,
        }
    }

    /// The embedding of `ids` as the residual stream entering the first block, in the compute
    /// dtype. The lookup reads the f32 table; with the fused kernels its backward scatters with
    /// the kernels' atomic adds (CUDA).
    pub(crate) fn embed(&self, ids: Tensor<B, 2, Int>, ctx: &Ctx<B>) -> Stream<B> {
        let emb = if self.fused() {
            kernels::embedding(self.wte.weight.val(), ids)
        } else {
            self.wte.forward(ids)
        };
        let x = ctx.dropout(&self.drop, emb.cast(self.compute_dtype), 0, Site::Embedding);
        Stream { x, pending: None }
    }

    /// The final norm of the stream leaving the last block: [B, T, d].
    pub(crate) fn final_norm(&self, s: Stream<B>) -> Tensor<B, 3> {
        match (s.pending, self.fused()) {
            (Some(delta), _) => self.norm_f.forward_add(delta, s.x).1,
            (None, true) => self.norm_f.forward_fused(s.x),
            (None, false) => self.norm_f.forward(s.x),
        }
    }

    /// The LM head: the final norm's output [B, T, d] -> logits [B, T, vocab].
    pub(crate) fn head(&self, x: Tensor<B, 3>, gemm: kernels::Gemm) -> Tensor<B, 3> {
        let dt = self.compute_dtype;
        let logits = match (&self.lm_head, gemm) {
            (Some(head), gemm) => head.forward_mixed(x, gemm),
            (None, kernels::Gemm::Burn) => {
                x.matmul(self.wte.weight.val().cast(dt).transpose().unsqueeze())
            }
            (None, gemm) => {
                // x [B, T, d] times the embedding [V, d] transposed, read in place by the GEMM.
                let [b, t, d] = x.dims();
                let v = self.wte.weight.dims()[0];
                kernels::gemm(
                    x.reshape([b * t, d]),
                    self.wte.weight.val().cast(dt),
                    false,
                    true,
                    gemm,
                )
                .reshape([b, t, v])
            }
        };
        debug_assert_dtype(&logits, dt, "LM head output");
        logits
    }

    /// The LM head's weight as [vocab, d] (the tied embedding, or a transposed view of the head's
    /// [d, vocab] weight), when `kernels::linear_cross_entropy` can take it: a head without a
    /// bias (the LM head runs neither FP8 nor probes).
    fn head_rows(&self) -> Option<Tensor<B, 2>> {
        match &self.lm_head {
            None => Some(self.wte.weight.val()),
            Some(h) if h.bias.is_none() => Some(h.weight.val().transpose()),
            Some(_) => None,
        }
    }

    /// Mean next-token cross-entropy (natural log) of `logits` [B, T, V] against `targets` [B, T].
    /// Computed in f32: the logits are cast first if they are not.
    pub fn loss(logits: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let [b, t, v] = logits.dims();
        kernels::cross_entropy::reference_log_softmax(
            logits.reshape([b * t, v]),
            targets.reshape([b * t]),
        )
    }

    /// Forward and loss in one call: ids and targets [B, T] -> scalar loss [1], the mean
    /// cross-entropy plus `model.z_loss * log(Z)^2` per token when that is set, at the model's own
    /// [`Gpt::precision`].
    ///
    /// With `kernels = "fused"` the logits stay in the compute dtype and the fused cross-entropy
    /// reads them directly (f32 inside), keeping only a per-token log-sum-exp for the backward.
    pub fn forward_loss(&self, ids: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        self.forward_loss_at(ids, targets, &self.precision(), self.config.z_loss)
    }

    /// [`Gpt::forward_loss`] at `precision` (a training step's: the recipe's GEMM engine, FP8
    /// projections and probes).
    pub fn forward_loss_in(
        &self,
        ids: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
        precision: &Precision,
    ) -> Tensor<B, 1> {
        self.forward_loss_at(ids, targets, precision, self.config.z_loss)
    }

    /// [`Gpt::forward_loss_in`] with the z-loss weight `z` (0 gives the plain cross-entropy, as
    /// evaluation reports it).
    pub fn forward_loss_with(
        &self,
        ids: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
        precision: &Precision,
        z: f64,
    ) -> Tensor<B, 1> {
        self.forward_loss_at(ids, targets, precision, z)
    }

    fn forward_loss_at(
        &self,
        ids: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
        precision: &Precision,
        z: f64,
    ) -> Tensor<B, 1> {
        self.forward_loss_through(ids, targets, precision, z, None)
    }

    /// [`Gpt::forward_loss_with`], each block first passed through `hook` where there is one
    /// ([`crate::block_hook`]).
    pub(crate) fn forward_loss_through(
        &self,
        ids: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
        precision: &Precision,
        z: f64,
        hook: Option<&dyn crate::BlockHook<B>>,
    ) -> Tensor<B, 1> {
        let masks = self.masks(&ids.device());
        let ctx = self.ctx(&ids, precision, masks);
        let mut embedding = hook.and_then(|h| h.outside(self, Outside::Embedding, None));
        let mut s = embedding.as_ref().unwrap_or(self).embed(ids, &ctx);
        if self.lm_head.is_some() {
            // An untied embedding is read by the lookup alone.
            embedding = None;
        }
        for (layer, block) in self.blocks.iter().enumerate() {
            // The deepest tensor entering the block: with the fused kernels, the previous block's
            // MLP output not yet added to the stream.
            let entering = s.pending.as_ref().unwrap_or(&s.x);
            let hooked = hook.map(|h| h.block(layer, block, entering));
            let block = hooked.as_ref().unwrap_or(block);
            s = block.step(s, &ctx, layer, self.fused());
            debug_assert_dtype(&s.x, self.compute_dtype, "residual stream after a block");
        }
        // The final norm's and LM head's parameters as the hook hands them over, just before they
        // run (a tied head reads the embedding handed over for the lookup).
        let base = embedding.as_ref().unwrap_or(self);
        let entering = s.pending.as_ref().unwrap_or(&s.x);
        let head = hook.and_then(|h| h.outside(base, Outside::Head, Some(entering)));
        head.as_ref()
            .unwrap_or(base)
            .loss_from(s, targets, precision, z)
    }

    /// The loss of the stream leaving the last block against `targets` [B, T]: final norm, LM
    /// head and cross-entropy (with the z-loss weight `z`).
    pub(crate) fn loss_from(
        &self,
        s: Stream<B>,
        targets: Tensor<B, 2, Int>,
        precision: &Precision,
        z: f64,
    ) -> Tensor<B, 1> {
        let x = self.final_norm(s);
        let [b, t, d] = x.dims();
        if !self.fused() {
            let logits = self.head(x, precision.gemm);
            let v = logits.dims()[2];
            return if z > 0.0 {
                kernels::cross_entropy::reference(
                    logits.reshape([b * t, v]),
                    targets.reshape([b * t]),
                    z,
                )
                .mean()
            } else {
                Self::loss(logits, targets)
            };
        }
        if let (HeadLossKind::Chunked, Some(w)) = (self.config.head_loss, self.head_rows()) {
            let opts = kernels::cross_entropy::LinearCrossEntropy {
                z_loss: z,
                gemm: precision.gemm,
                chunk_rows: (self.config.head_chunk_rows > 0)
                    .then_some(self.config.head_chunk_rows),
            };
            return kernels::linear_cross_entropy(
                x.reshape([b * t, d]),
                w,
                targets.reshape([b * t]),
                opts,
            );
        }
        let logits = self.head(x, precision.gemm);
        let v = logits.dims()[2];
        kernels::cross_entropy(logits.reshape([b * t, v]), targets.reshape([b * t]), z).mean()
    }
}
