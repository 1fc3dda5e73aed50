//! The memory a run needs on each GPU, estimated from the config before anything is allocated,
//! and checked against what the device has free: a run that cannot fit stops with one line that
//! says by how much and what to change, instead of a CUDA allocation error minutes later.
//!
//! The estimate counts what this trainer keeps, per GPU:
//! - the f32 master weights (4 bytes a parameter) and AdamW's two f32 moments (8), both split
//!   across the GPUs under ZeRO-1;
//! - the compute copy of the weights (2 bytes a parameter in bf16 and fp16, none in fp32);
//! - the gradients: in the compute dtype for one micro-batch on one GPU; summed in f32 over
//!   micro-batches (`training.grad_accum` > 1: 4 bytes a parameter, and the next micro-batch's
//!   in the compute dtype beside them) and for the mean over several GPUs (4 bytes);
//! - the activations the backward reads, per token and block: the block's input and the norms'
//!   inputs and outputs (5 x width), the packed q/k/v projection, the attention output, and the
//!   MLP's projection and activation (3 x d_ff for SwiGLU, 2 x d_ff for GELU), in the compute
//!   dtype; with `model.attention = "plain"` also the `heads x context^2` scores and
//!   probabilities of every sequence. A block that `model.recompute = "selective"` recomputes
//!   keeps neither norm's output nor the activation's (2 x width + d_ff less); one that
//!   `"full"` recomputes keeps only its input (width), plus one block's activations while its
//!   gradients are taken;
//! - the LM head's logits and their gradient (one chunk's each with `head_loss = "chunked"`: 256
//!   MiB, or `head_chunk_rows` rows);
//! - 1 GiB for the CUDA context, cuBLASLt's workspace and kernel modules.
//!
//! The estimate is a lower bound: it leaves out the allocator's pools and fragmentation (CubeCL
//! reserves memory in pages and keeps freed pages for reuse), the temporaries of each kernel and
//! the FP8 recipe's codes and scales. So a run is refused only when the estimate exceeds the free
//! memory; `training.memory_check = false` skips the check.

use std::process::{Command, Stdio};

use anyhow::{bail, Result};

use crate::config::Config;
use model::{AttentionKind, HeadLossKind, MlpKind};

const GIB: f64 = (1u64 << 30) as f64;

/// Bytes a run needs on each GPU, by what holds them.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPlan {
    pub master_weights: u64,
    pub optimizer_state: u64,
    pub compute_copy: u64,
    pub gradients: u64,
    pub activations: u64,
    pub logits: u64,
    pub runtime: u64,
    /// Activation bytes of one sequence of a micro-batch (what lowering the batch saves).
    pub per_sequence: u64,
    /// What the plan was made for.
    vocab: usize,
    compute_bytes: u64,
}

impl MemoryPlan {
    /// The plan of `cfg` with a vocabulary of `vocab`, computing in `compute_bytes`-byte floats,
    /// on each of `gpus` GPUs.
    pub fn estimate(cfg: &Config, vocab: usize, compute_bytes: u64, gpus: usize) -> Self {
        let m = &cfg.model;
        let params = m.num_params(vocab) as u64;
        // ZeRO splits the masters and the moments across the GPUs.
        let shards = if cfg.training.zero >= 1 {
            gpus.max(1) as u64
        } else {
            1
        };
        let (d, ff, t) = (m.d_model as u64, m.ff_width() as u64, m.context as u64);
        let mlp = match m.mlp {
            MlpKind::Swiglu => 3 * ff,
            MlpKind::Gelu | MlpKind::GeluTanh => 2 * ff,
        };
        let per_token_block = (5 * d + m.qkv_width() as u64 + mlp) * compute_bytes
            // the attention's f32 log-sum-exp of every query head
            + 4 * m.n_head as u64;
        // Selective recomputation keeps neither norm's output nor the activation's.
        let selective = (0..m.n_layer)
            .filter(|&l| m.recomputes_selectively(l))
            .count() as u64;
        // A recomputed block keeps only its input (with the fused kernels, the previous block's
        // MLP output already added to it), and one block's activations exist again while its
        // gradients are taken.
        let recomputed = (0..m.n_layer).filter(|&l| m.recomputes(l)).count() as u64;
        let kept = m.n_layer as u64 - recomputed;
        let block_bytes = kept * per_token_block - selective * (2 * d + ff) * compute_bytes
            + recomputed * d * compute_bytes
            + if recomputed > 0 { per_token_block } else { 0 };
        let mut per_sequence = t * (block_bytes + d * compute_bytes);
        if m.attention_resolved() == AttentionKind::Plain {
            // f32 scores and probabilities, and the probabilities in the compute dtype.
            per_sequence += m.n_layer as u64 * m.n_head as u64 * t * t * (8 + compute_bytes);
        }
        let tokens = cfg.training.batch_size as u64 * t;
        let all_logits = tokens * vocab as u64 * compute_bytes;
        let logits = 2 * match m.head_loss {
            HeadLossKind::Chunked => {
                // The kernels' chunk on a GPU of 64 GiB or more is larger (a 256th of its
                // memory); the estimate counts the smallest.
                let given = (m.head_chunk_rows > 0).then_some(m.head_chunk_rows);
                let rows = kernels::cross_entropy::linear::chunk_rows(
                    tokens as usize,
                    vocab,
                    compute_bytes as usize,
                    given,
                    kernels::cross_entropy::linear::DEFAULT_CHUNK_BYTES,
                );
                all_logits.min(rows as u64 * vocab as u64 * compute_bytes)
            }
            HeadLossKind::Logits => all_logits,
        };
        let half = compute_bytes < 4;
        // ZeRO-3 holds 1/N of every weight and gradient, and whole only the weights gathered at
        // once: the parameters outside the blocks (the embedding in f32, an untied head in the
        // compute dtype) and, when every block is recomputed, two blocks' (the one running and
        // the next), else every block's until its backward. In f32 the master shards compute.
        let zero3 = cfg.training.zero == 3 && shards > 1;
        let (embedding, head) = (
            vocab as u64 * d,
            if m.tie_embeddings {
                0
            } else {
                vocab as u64 * d
            },
        );
        let block = params.saturating_sub(embedding + head + d) / m.n_layer.max(1) as u64;
        let gathered_blocks = if recomputed == m.n_layer as u64 {
            2
        } else {
            m.n_layer as u64
        };
        let compute_copy = match (zero3, half) {
            (true, _) => {
                (if half {
                    compute_bytes * params / shards
                } else {
                    0
                }) + 4 * embedding
                    + compute_bytes * (head + gathered_blocks * block)
            }
            (false, true) => compute_bytes * params,
            (false, false) => 0,
        };
        Self {
            master_weights: 4 * params / shards,
            optimizer_state: 8 * params / shards,
            compute_copy,
            gradients: if zero3 {
                // f32 shards (and their sum under accumulation), and one block's whole
                // gradients while they are reduce-scattered.
                let sums = if cfg.training.grad_accum > 1 { 2 } else { 1 };
                4 * (sums * params / shards + block)
            } else if cfg.training.grad_accum > 1 {
                (4 + compute_bytes) * params
            } else if gpus > 1 {
                4 * params
            } else {
                compute_bytes * params
            },
            activations: cfg.training.batch_size as u64 * per_sequence,
            logits,
            runtime: 1 << 30,
            per_sequence,
            vocab,
            compute_bytes,
        }
    }

    pub fn total(&self) -> u64 {
        self.master_weights
            + self.optimizer_state
            + self.compute_copy
            + self.gradients
            + self.activations
            + self.logits
            + self.runtime
    }

    /// One line: the total and its parts.
    pub fn describe(&self) -> String {
        format!(
            "{} per device: master weights {} + AdamW state {} + compute copy {} + gradients {} + activations {} + logits {} + runtime {}",
            size(self.total()),
            size(self.master_weights),
            size(self.optimizer_state),
            size(self.compute_copy),
            size(self.gradients),
            size(self.activations),
            size(self.logits),
            size(self.runtime),
        )
    }

    /// Fails with one line when the plan needs more than `free` bytes: by how much, and what
    /// would make it fit.
    pub fn check(&self, free: u64, cfg: &Config, gpus: usize) -> Result<()> {
        let need = self.total();
        if need <= free {
            return Ok(());
        }
        let short = need - free;
        let mut fixes = Vec::new();
        let batch = cfg.training.batch_size as u64;
        if batch > 1 {
            // Fewer sequences per micro-batch, the same tokens per step through accumulation.
            let fewer = short.div_ceil(self.per_sequence.max(1));
            if fewer < batch {
                let b = batch - fewer;
                fixes.push(format!(
                    "training.batch_size = {b} (each sequence's activations take {:.2} GiB; raise training.grad_accum to keep the tokens per step)",
                    gib(self.per_sequence)
                ));
            } else {
                fixes.push(format!(
                    "a smaller training.batch_size (each sequence's activations take {:.2} GiB)",
                    gib(self.per_sequence)
                ));
            }
        }
        if cfg.model.attention_resolved() == AttentionKind::Plain {
            fixes.push("model.attention = \"flash\" (no context x context scores)".into());
        }
        if cfg.model.recompute != model::RecomputeKind::Full {
            let mut full = cfg.clone();
            full.model.recompute = model::RecomputeKind::Full;
            full.model.recompute_every = 1;
            let with = MemoryPlan::estimate(&full, self.vocab, self.compute_bytes, gpus);
            fixes.push(format!(
                "model.recompute = \"full\" (activations {:.1} GiB instead of {:.1})",
                gib(with.activations),
                gib(self.activations)
            ));
        }
        if cfg.training.zero == 0 || gpus < 2 {
            fixes.push(
                "several GPUs with training.zero = 1 (each keeps 1/N of the master weights and AdamW state)"
                    .into(),
            );
        } else {
            fixes.push("more GPUs (training.devices)".into());
        }
        bail!(
            "the run needs about {:.1} GiB per GPU but the device has {:.1} GiB free ({:.1} GiB short): {}. To fit, try {}. (training.memory_check = false skips this check.)",
            gib(need),
            gib(free),
            gib(short),
            self.describe(),
            fixes.join(", or ")
        )
    }
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / GIB
}

/// `bytes` in GiB (one decimal) from 1 GiB on, else in MiB.
fn size(bytes: u64) -> String {
    if bytes as f64 >= GIB {
        format!("{:.1} GiB", gib(bytes))
    } else {
        format!("{:.0} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

/// Free memory of CUDA device `index` in bytes, from `nvidia-smi`, or `None` where it cannot say.
pub fn cuda_free_bytes(index: usize) -> Option<u64> {
    let out = Command::new("nvidia-smi")
        .args([
            "--query-gpu=memory.free",
            "--format=csv,noheader,nounits",
            "-i",
            &index.to_string(),
        ])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let mib: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().ok()?;
    Some(mib << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(path: &str) -> Config {
        let file = format!("{}/../../configs/{path}", env!("CARGO_MANIFEST_DIR"));
        Config::load(std::path::Path::new(&file), &[]).unwrap()
    }

    #[test]
    fn the_parts_follow_the_parameters_and_the_batch() {
        let cfg = config("llama_1b.toml");
        let plan = MemoryPlan::estimate(&cfg, 128_256, 2, 1);
        let p = cfg.model.num_params(128_256) as u64;
        assert_eq!(plan.master_weights, 4 * p);
        assert_eq!(plan.optimizer_state, 8 * p);
        assert_eq!(plan.compute_copy, 2 * p);
        assert_eq!(plan.activations, 4 * plan.per_sequence);
        // 16 blocks x 2048 tokens x (5 x 2048 + 3072 + 3 x 8192) x 2 bytes, plus the embedding's
        // output and the log-sum-exp.
        let block = (5 * 2048 + 3072 + 3 * 8192) * 2 + 4 * 32;
        assert_eq!(plan.per_sequence, 2048 * (16 * block + 2048 * 2));
        // Full recomputation keeps each block's input, and one block's activations.
        let mut full = cfg.clone();
        full.model.recompute = model::RecomputeKind::Full;
        let less = MemoryPlan::estimate(&full, 128_256, 2, 1);
        assert_eq!(less.per_sequence, 2048 * (16 * 2048 * 2 + block + 2048 * 2));
        // Selective recomputation keeps neither norm's output nor the SwiGLU's.
        let mut selective = cfg.clone();
        selective.model.recompute = model::RecomputeKind::Selective;
        let fewer = MemoryPlan::estimate(&selective, 128_256, 2, 1);
        assert_eq!(
            plan.per_sequence - fewer.per_sequence,
            2048 * 16 * (2 * 2048 + 8192) * 2
        );
        // Gradients summed in f32 over micro-batches, beside the next micro-batch's.
        let mut accum = cfg.clone();
        accum.training.grad_accum = 4;
        assert_eq!(MemoryPlan::estimate(&accum, 128_256, 2, 1).gradients, 6 * p);
        assert_eq!(plan.gradients, 2 * p);
        // ZeRO-1 on 4 GPUs splits the masters and the moments.
        let mut zero = cfg.clone();
        zero.training.zero = 1;
        let split = MemoryPlan::estimate(&zero, 128_256, 2, 4);
        assert_eq!(split.master_weights, p);
        assert_eq!(split.optimizer_state, 2 * p);
    }

    #[test]
    fn a_run_that_cannot_fit_says_by_how_much_and_what_to_change() {
        let cfg = config("llama_8b.toml");
        let plan = MemoryPlan::estimate(&cfg, 128_256, 2, 1);
        plan.check(plan.total(), &cfg, 1).unwrap();
        let free = 80u64 << 30;
        let e = plan.check(free, &cfg, 1).unwrap_err().to_string();
        let short = gib(plan.total() - free);
        assert!(e.contains(&format!("({short:.1} GiB short)")), "{e}");
        assert!(
            e.contains("80.0 GiB free") && e.contains("training.zero = 1"),
            "{e}"
        );
        assert!(e.contains("model.recompute = \"full\""), "{e}");
        assert!(!e.contains('\n'), "one line: {e}");
    }
}
