//! Model hyper-parameters: the `[model]` section of a training config.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Writes a unit variant of a config enum under the value its key takes in a config file, as
/// serde spells it (`rename_all`), so that each name is written once, in the enum's attributes.
pub fn write_config_value<T: Serialize>(v: &T, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => f.pad(&s),
        _ => Err(fmt::Error),
    }
}

/// `Display` as the config value ([`write_config_value`]).
#[macro_export]
macro_rules! display_as_config_value {
    ($($t:ty),+ $(,)?) => {$(
        impl ::std::fmt::Display for $t {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                $crate::config::write_config_value(self, f)
            }
        }
    )+};
}

display_as_config_value!(
    RecomputeKind,
    MlpKind,
    AttentionKind,
    KernelsKind,
    GemmKind,
    HeadLossKind,
    RopeScalingKind
);

/// Which feed-forward block each transformer layer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MlpKind {
    /// `proj(silu(x W_gate) * (x W_up))`, as in LLaMA.
    Swiglu,
    /// `proj(gelu(x W_fc))` with the exact (erf) GELU.
    Gelu,
    /// `proj(gelu(x W_fc))` with GELU's tanh approximation (GPT-2's own; `"gelu_tanh"`).
    #[serde(rename = "gelu_tanh")]
    GeluTanh,
}

/// How attention is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionKind {
    /// `flash` (with or without dropout); the trainer resolves it to `plain` on the CPU backend.
    Auto,
    /// Plain Burn ops: scores, causal mask, softmax, weighted sum. Materialises [B, H, T, T].
    Plain,
    /// `kernels::flash_attention`: tiled, online softmax, backward recomputing the probabilities;
    /// memory linear in T. With `dropout > 0` the kernels drop probabilities themselves
    /// (`kernels::flash_attention_dropout`, a Philox mask drawn again in the backward).
    Flash,
}

/// Which implementation the memory-bound ops (norms, activations, RoPE, loss) use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KernelsKind {
    /// `fused`: the fused kernels where the backend has them (CubeCL backends: CUDA, wgpu), and
    /// their plain-Burn references elsewhere (a backend's `kernels::Backend` defaults).
    Auto,
    /// Ordinary Burn tensor ops (the references of `crates/kernels`).
    Reference,
    /// The fused CubeCL kernels of `crates/kernels`: RMSNorm with the residual add, SwiGLU/GELU,
    /// RoPE, cross-entropy from low-precision logits (and, in the trainer, the fused AdamW step).
    Fused,
}

/// Which engine runs the linear layers' GEMMs (see `kernels::gemm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GemmKind {
    /// cuBLASLt on CUDA (when the library loads), Burn's matmul elsewhere.
    Auto,
    /// cuBLASLt; needs CUDA and libcublasLt.
    Cublaslt,
    /// Burn's matmul on every backend.
    Burn,
}

impl GemmKind {
    /// The engine of `kernels::gemm`.
    pub fn engine(self) -> kernels::Gemm {
        match self {
            GemmKind::Auto => kernels::Gemm::Auto,
            GemmKind::Cublaslt => kernels::Gemm::CublasLt,
            GemmKind::Burn => kernels::Gemm::Burn,
        }
    }
}

/// How the fused kernels take the LM head's loss (`kernels = "fused"`; the reference kernels
/// always form the logits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HeadLossKind {
    /// `kernels::linear_cross_entropy`: the logits a chunk of rows at a time (at most 256 MiB),
    /// their gradients taken in the forward; the full [tokens, vocab] logits never exist.
    Chunked,
    /// All logits in the compute dtype, then the fused cross-entropy: as fast or slightly faster,
    /// but the logits and their gradient each take tokens x vocab x 2 bytes.
    Logits,
}

/// What the backward recomputes instead of keeping (`model.recompute`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RecomputeKind {
    /// Every block's activations are kept from the forward for the backward.
    None,
    /// A recomputed block keeps the outputs of its GEMMs and attention, but not those of its
    /// norms and activation: the backward runs the norm's or activation's kernel again on the
    /// input it keeps anyway, for the weight gradient of the projection after it
    /// (`kernels::recompute`). Needs the fused kernels.
    Selective,
    /// A recomputed block keeps only its input: the forward runs it without autodiff, and the
    /// backward runs it again, with autodiff, just before its gradients are taken.
    Full,
}

/// Which stretch of RoPE's frequencies `[model.rope_scaling]` applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeScalingKind {
    /// The frequencies `theta^(-2i / head_dim)` as they are.
    None,
    /// Llama 3.1's: wavelengths longer than `original_context / low_freq_factor` are divided by
    /// `factor`, those shorter than `original_context / high_freq_factor` kept, and the ones
    /// between interpolated smoothly (as Hugging Face `transformers`' `rope_type = "llama3"`).
    Llama3,
}

/// `[model.rope_scaling]`: Llama 3.2 1B and 3B use `kind = "llama3"`, `factor = 32`,
/// `low_freq_factor = 1`, `high_freq_factor = 4`, `original_context = 8192`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RopeScaling {
    pub kind: RopeScalingKind,
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    /// The context the unscaled frequencies were trained at.
    pub original_context: usize,
}

impl Default for RopeScaling {
    fn default() -> Self {
        Self {
            kind: RopeScalingKind::None,
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 8192,
        }
    }
}

impl RopeScaling {
    /// The rotation frequencies of the `head_dim / 2` pairs of a head, in radians per position.
    pub fn inv_freq(&self, head_dim: usize, theta: f64) -> Vec<f32> {
        let (old, low, high) = (
            self.original_context as f64,
            self.low_freq_factor,
            self.high_freq_factor,
        );
        kernels::rope::frequencies(head_dim, theta)
            .into_iter()
            .map(|f| {
                let scaled = match self.kind {
                    RopeScalingKind::None => f,
                    RopeScalingKind::Llama3 => {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < old / high {
                            f
                        } else if wavelen > old / low {
                            f / self.factor
                        } else {
                            let smooth = (old / wavelen - low) / (high - low);
                            (1.0 - smooth) * f / self.factor + smooth * f
                        }
                    }
                };
                scaled as f32
            })
            .collect()
    }

    fn validate(&self) -> Result<(), String> {
        if self.kind == RopeScalingKind::None {
            return Ok(());
        }
        if !(self.factor >= 1.0) {
            return Err(format!(
                "model.rope_scaling.factor must be >= 1, got {}",
                self.factor
            ));
        }
        if !(self.low_freq_factor > 0.0 && self.high_freq_factor > self.low_freq_factor) {
            return Err(format!(
                "model.rope_scaling needs 0 < low_freq_factor < high_freq_factor, got {} and {}",
                self.low_freq_factor, self.high_freq_factor
            ));
        }
        if self.original_context == 0 {
            return Err("model.rope_scaling.original_context must be at least 1, got 0".into());
        }
        Ok(())
    }
}

/// Shape and details of the GPT-style decoder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GptConfig {
    /// Vocabulary size of the embedding and LM head. 0 takes the tokenizer's size; a larger value
    /// pads the vocabulary (e.g. 50304 for GPT-2's 50257, a multiple of 64 for faster matmuls).
    pub vocab_size: usize,
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// Number of attention (query) heads; must divide `d_model`, and `d_model / n_head` must be
    /// even (RoPE).
    pub n_head: usize,
    /// Number of key/value heads: `n_head` (or 0) is multi-head attention, fewer is grouped-query
    /// attention (each key/value head serves `n_head / n_kv_head` query heads; Llama 3 uses 8),
    /// 1 is multi-query attention. Must divide `n_head`.
    pub n_kv_head: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Longest sequence the model is trained on (tokens per window).
    pub context: usize,
    /// Feed-forward block: "swiglu", "gelu" (exact) or "gelu_tanh" (the tanh approximation).
    pub mlp: MlpKind,
    /// Hidden width of the feed-forward block; 0 picks 4 * d_model for GELU and 8/3 * d_model
    /// rounded up to a multiple of `multiple_of` for SwiGLU (the same parameter count).
    pub d_ff: usize,
    /// What SwiGLU's automatic `d_ff` is rounded up to a multiple of (Llama uses 256; 64 by
    /// default). Ignored when `d_ff` is set.
    pub multiple_of: usize,
    /// Dropout probability on attention weights and on each residual branch (0 disables it).
    pub dropout: f64,
    /// Share the token-embedding matrix with the LM head.
    pub tie_embeddings: bool,
    /// Add biases to the linear layers.
    pub bias: bool,
    /// RoPE base frequency (10000 in GPT-NeoX and Llama 2, 500000 in Llama 3).
    pub rope_theta: f64,
    /// How RoPE's frequencies are stretched for contexts longer than trained on (`[model.rope_scaling]`).
    pub rope_scaling: RopeScaling,
    /// Epsilon of RMSNorm.
    pub norm_eps: f64,
    /// Standard deviation of the normal initialisation (residual projections are further scaled by
    /// 1/sqrt(2 * n_layer), as in GPT-2).
    pub init_std: f64,
    /// Attention implementation: "auto" (= "flash"; the trainer picks "plain" on the CPU backend),
    /// "plain" or "flash" (with or without dropout).
    pub attention: AttentionKind,
    /// Implementation of the memory-bound ops: "auto" (= "fused"), "reference" (plain Burn) or
    /// "fused" (CubeCL kernels where the backend has them, the references elsewhere).
    pub kernels: KernelsKind,
    /// Weight of the z-loss term `z_loss * log(Z)^2` added to each token's cross-entropy, which
    /// keeps the softmax normaliser near 1 (PaLM uses 1e-4); 0 disables it.
    pub z_loss: f64,
    /// Engine of the linear layers' and the LM head's GEMMs: "burn" (Burn's matmul), "cublaslt"
    /// (NVIDIA cuBLASLt, CUDA only) or "auto" (cuBLASLt on CUDA, Burn's matmul elsewhere).
    pub gemm: GemmKind,
    /// Activation recomputation: "none", "selective" or "full" (see [`RecomputeKind`]): trades
    /// work in the backward for activations' memory.
    pub recompute: RecomputeKind,
    /// With `recompute = "selective"` or `"full"`: which blocks are recomputed, every k-th from the
    /// first (1: all of them; 2: blocks 0, 2, 4, ...); the others keep their activations.
    pub recompute_every: usize,
    /// How the fused kernels take the LM head's loss: "chunked" (the logits a chunk of rows at a
    /// time, never all at once: GPT-2's [16 x 1024, 50304] bf16 logits are 1.65 GB, and as much
    /// again for their gradient) or "logits" (all at once).
    pub head_loss: HeadLossKind,
    /// With `head_loss = "chunked"`: rows (tokens) of logits per chunk; 0 lets the kernels pick
    /// (`kernels::cross_entropy::linear::pooled_chunk_bytes`: a 256th of the GPU's memory, at
    /// least 256 MiB of logits). Larger chunks run the head's GEMMs longer and read and write the
    /// f32 weight gradient fewer times, for more memory.
    pub head_chunk_rows: usize,
    /// A Hugging Face `LlamaForCausalLM` directory (safetensors and `config.json`) that a fresh
    /// run's weights are read from instead of drawn; empty: drawn from the seed. The trainer
    /// reads it (`trainer::interop::init_from`); the model ignores it.
    pub init_from: String,
}

impl Default for GptConfig {
    fn default() -> Self {
        Self {
            vocab_size: 0,
            n_layer: 2,
            n_head: 4,
            n_kv_head: 0,
            d_model: 64,
            context: 64,
            mlp: MlpKind::Swiglu,
            d_ff: 0,
            multiple_of: 64,
            dropout: 0.0,
            tie_embeddings: true,
            bias: false,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::default(),
            norm_eps: 1e-5,
            init_std: 0.02,
            attention: AttentionKind::Auto,
            kernels: KernelsKind::Auto,
            z_loss: 0.0,
            gemm: GemmKind::Auto,
            head_loss: HeadLossKind::Chunked,
            head_chunk_rows: 0,
            init_from: String::new(),
            recompute: RecomputeKind::None,
            recompute_every: 1,
        }
    }
}

impl GptConfig {
    /// The same config with `attention` and `kernels` resolved from `"auto"` (see [`AttentionKind`]
    /// and [`KernelsKind`]); [`crate::Gpt::new`] resolves its config this way.
    pub fn resolved(&self) -> Self {
        let mut c = self.clone();
        c.attention = self.attention_resolved();
        if c.kernels == KernelsKind::Auto {
            c.kernels = KernelsKind::Fused;
        }
        c
    }

    /// `attention` with `"auto"` resolved: flash, whose kernels also draw the dropout mask.
    pub fn attention_resolved(&self) -> AttentionKind {
        match self.attention {
            AttentionKind::Auto => AttentionKind::Flash,
            kind => kind,
        }
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_head.max(1)
    }

    /// Number of key/value heads (`n_kv_head`, or `n_head` when 0).
    pub fn kv_heads(&self) -> usize {
        if self.n_kv_head == 0 {
            self.n_head
        } else {
            self.n_kv_head
        }
    }

    /// Whether block `layer` is recomputed in the backward (`recompute`, `recompute_every`).
    pub fn recomputes(&self, layer: usize) -> bool {
        self.recompute == RecomputeKind::Full && layer.is_multiple_of(self.recompute_every.max(1))
    }

    /// Whether block `layer` recomputes its norms' and activation's outputs
    /// (`recompute = "selective"`, `recompute_every`).
    pub fn recomputes_selectively(&self, layer: usize) -> bool {
        self.recompute == RecomputeKind::Selective
            && layer.is_multiple_of(self.recompute_every.max(1))
    }

    /// Width of the packed q, k, v projection: `(n_head + 2 * kv_heads) * head_dim`.
    pub fn qkv_width(&self) -> usize {
        (self.n_head + 2 * self.kv_heads()) * self.head_dim()
    }

    /// Resolved hidden width of the feed-forward block.
    pub fn ff_width(&self) -> usize {
        if self.d_ff > 0 {
            return self.d_ff;
        }
        match self.mlp {
            MlpKind::Gelu | MlpKind::GeluTanh => 4 * self.d_model,
            MlpKind::Swiglu => {
                let m = self.multiple_of.max(1);
                (8 * self.d_model / 3).div_ceil(m) * m
            }
        }
    }

    /// Checks the configuration; each error names the `model.*` key and what would be valid.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("model.n_layer", self.n_layer),
            ("model.n_head", self.n_head),
            ("model.d_model", self.d_model),
            ("model.context", self.context),
        ];
        for (key, v) in positive {
            if v == 0 {
                return Err(format!("{key} must be at least 1, got 0"));
            }
        }
        if !self.d_model.is_multiple_of(self.n_head) {
            return Err(format!(
                "model.n_head = {} does not divide model.d_model = {}; choose a head count that divides the width (e.g. {})",
                self.n_head,
                self.d_model,
                divisors(self.d_model)
            ));
        }
        if !self.n_head.is_multiple_of(self.kv_heads()) {
            return Err(format!(
                "model.n_kv_head = {} does not divide model.n_head = {}; choose a key/value head count that divides the query heads (e.g. {})",
                self.n_kv_head,
                self.n_head,
                divisors(self.n_head)
            ));
        }
        if self.multiple_of == 0 {
            return Err("model.multiple_of must be at least 1, got 0".into());
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(format!(
                "model.d_model / model.n_head = {} must be even for rotary embeddings",
                self.head_dim()
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!(
                "model.dropout must be in [0, 1), got {}",
                self.dropout
            ));
        }
        if !(self.rope_theta > 1.0) {
            return Err(format!(
                "model.rope_theta must be > 1, got {}",
                self.rope_theta
            ));
        }
        self.rope_scaling.validate()?;
        if self.recompute_every == 0 {
            return Err(
                "model.recompute_every must be at least 1 (1 recomputes every block), got 0".into(),
            );
        }
        if self.recompute == RecomputeKind::Selective && self.kernels == KernelsKind::Reference {
            return Err(
                "model.recompute = \"selective\" recomputes the outputs of the fused norm and activation kernels, \
                 so it needs model.kernels = \"fused\" or \"auto\", got \"reference\"; with the reference ops use recompute = \"full\""
                    .into(),
            );
        }
        if !(self.norm_eps > 0.0) {
            return Err(format!("model.norm_eps must be > 0, got {}", self.norm_eps));
        }
        if !(self.z_loss >= 0.0 && self.z_loss.is_finite()) {
            return Err(format!("model.z_loss must be >= 0, got {}", self.z_loss));
        }
        if !(self.init_std > 0.0) {
            return Err(format!("model.init_std must be > 0, got {}", self.init_std));
        }
        Ok(())
    }

    /// Number of trainable parameters (the tied LM head counted once).
    pub fn num_params(&self, vocab: usize) -> usize {
        let d = self.d_model;
        let ff = self.ff_width();
        let b = self.bias as usize;
        let qkv = self.qkv_width();
        let attn = d * qkv + qkv * b + d * d + d * b;
        let mlp = match self.mlp {
            MlpKind::Gelu | MlpKind::GeluTanh => d * ff + ff * b + ff * d + d * b,
            MlpKind::Swiglu => d * 2 * ff + 2 * ff * b + ff * d + d * b,
        };
        let block = attn + mlp + 2 * d;
        let head = if self.tie_embeddings { 0 } else { d * vocab };
        vocab * d + self.n_layer * block + d + head
    }

    /// Training FLOPs per token by the standard estimate (PaLM appendix B, nanoGPT):
    /// 6 per parameter plus 12 * layers * width * context for attention.
    pub fn flops_per_token(&self, vocab: usize) -> f64 {
        6.0 * self.num_params(vocab) as f64
            + 12.0 * (self.n_layer * self.d_model * self.context) as f64
    }
}

fn divisors(n: usize) -> String {
    let list: Vec<String> = (1..=n.min(64))
        .filter(|&h| n.is_multiple_of(h))
        .map(|h| h.to_string())
        .collect();
    list.join(", ")
}
