//! A GPT-style decoder-only transformer in Burn.
//!
//! Token embedding, rotary position embedding, `n_layer` pre-norm blocks (RMSNorm, causal
//! multi-head or grouped-query self-attention, SwiGLU or GELU MLP), a final RMSNorm and an LM
//! head, optionally tied to the embedding: GPT-2's shape or Llama's. Initialisation follows GPT-2: N(0, 0.02) everywhere, residual projections
//! scaled by 1/sqrt(2 * n_layer).
//!
//! ```no_run
//! use burn::backend::{Autodiff, Wgpu};
//! use burn::tensor::{Int, Tensor};
//! use model::{Gpt, GptConfig};
//!
//! type B = Autodiff<Wgpu>;
//! let device = Default::default();
//! let cfg = GptConfig::default();
//! let gpt = Gpt::<B>::new(&cfg, 65, &device);
//! let ids = Tensor::<B, 2, Int>::zeros([2, 16], &device);
//! let logits = gpt.forward(ids); // [2, 16, 65]
//! ```
//!
//! ## Mixed precision
//!
//! [`Gpt::compute_copy`] returns a copy whose linear layers hold BF16 or F16 weights; its forward
//! runs the matmuls and the activations in that dtype and keeps the numerically sensitive parts in
//! f32: the embedding lookup, RMSNorm statistics (with f32 gains), attention softmax, and the
//! log-softmax and loss. The LM head's logits stay in the compute dtype (the loss reads them in
//! f32; [`Gpt::forward`] returns them cast to f32). The model that created the copy keeps the f32
//! master weights.

pub mod block_hook;
pub mod config;
pub mod decode;
pub mod decode_cache;
pub mod dropout_seeds;
pub mod dtype;
pub mod gpt;
pub mod layers;
pub mod precision;
pub mod recompute;

pub use block_hook::BlockHook;
pub use config::{
    AttentionKind, GemmKind, GptConfig, HeadLossKind, KernelsKind, MlpKind, RecomputeKind,
    RopeScaling, RopeScalingKind,
};
pub use decode_cache::DecodeCache;
pub use gpt::{Gpt, Outside};
pub use precision::{GradFormat, Precision, Probes, PROJECTION_PATHS};
