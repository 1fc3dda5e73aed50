//! How a forward computes, as one value: the compute dtype, the GEMM engine, the FP8 projections
//! and what a measuring step records. The trainer resolves it once per run from its precision
//! recipe (nothing in it says "auto") and passes it to every training forward
//! ([`crate::Gpt::forward_loss_in`]); [`crate::Gpt::precision`] gives a model's own.

use burn::tensor::FloatDType;
use kernels::ProbeSink;

/// Module paths of a block's projections, relative to the block, in module order.
pub const PROJECTION_PATHS: [&str; 4] = ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"];

/// A forward's precision.
#[derive(Clone, Debug)]
pub struct Precision {
    /// Dtype of the matmuls and activations: the compute copy's ([`crate::Gpt::compute_copy`]).
    pub dtype: FloatDType,
    /// The engine of the projections' and the LM head's GEMMs.
    pub gemm: kernels::Gemm,
    /// When set, the attention and MLP projections run their GEMMs in FP8 (the embedding, the LM
    /// head, the norms and attention do not).
    pub fp8: Option<kernels::Fp8LinearConfig>,
    /// With `fp8`, the first and the last this many blocks keep their projections in the compute
    /// dtype (0: every block in FP8).
    pub fp8_edge_blocks: usize,
    /// With `fp8`, the projections (paths within a block, [`PROJECTION_PATHS`]) that keep the
    /// compute dtype in every block (empty: all four run in FP8).
    pub fp8_compute_paths: Vec<String>,
    /// With per-tensor FP8 scaling: the amax histories the projections take their scales from
    /// (delayed scaling, `blocks.N.attn.qkv.input` and so on); none: each tensor's own amax.
    pub fp8_history: Option<kernels::Fp8AmaxHistory>,
    /// What this forward measures.
    pub probes: Probes,
}

/// What a forward records, by projection (`blocks.N.attn.qkv`, `blocks.N.mlp.proj`, ...): all into
/// sinks of one type, [`ProbeSink`].
#[derive(Clone, Debug, Default)]
pub struct Probes {
    /// The FP8 projections record the FP8 health of their input (`{name}.input`) and, in the
    /// backward, of their output gradient (`{name}.grad_output`): `kernels::fp8::PendingHealth`
    /// samples.
    pub fp8_health: Option<ProbeSink>,
    /// Every projection's output gradient is measured in the backward (`{name}`), against a format
    /// whose smallest normal number is `min_normal`: `kernels::format_probe` samples.
    pub grad_format: Option<GradFormat>,
}

/// Where and against what the gradients' format statistics are taken.
#[derive(Clone, Debug)]
pub struct GradFormat {
    pub sink: ProbeSink,
    pub min_normal: f64,
}

impl Precision {
    /// `dtype` and `gemm`, without FP8 or probes.
    pub fn new(dtype: FloatDType, gemm: kernels::Gemm) -> Self {
        Self {
            dtype,
            gemm,
            fp8: None,
            fp8_edge_blocks: 0,
            fp8_compute_paths: Vec::new(),
            fp8_history: None,
            probes: Probes::default(),
        }
    }

    /// The FP8 settings block `layer` of `n_layer` runs its projections with: none for the edge
    /// blocks that `fp8_edge_blocks` keeps in the compute dtype.
    pub fn fp8_in_block(&self, layer: usize, n_layer: usize) -> Option<kernels::Fp8LinearConfig> {
        let edge = self.fp8_edge_blocks;
        self.fp8.filter(|_| layer >= edge && layer + edge < n_layer)
    }

    /// The FP8 settings projection `path` ([`PROJECTION_PATHS`]) of block `layer` runs with: those
    /// of its block, unless `fp8_compute_paths` keeps the projection in the compute dtype.
    pub fn fp8_at(
        &self,
        layer: usize,
        n_layer: usize,
        path: &str,
    ) -> Option<kernels::Fp8LinearConfig> {
        let kept = self.fp8_compute_paths.iter().any(|p| p == path);
        self.fp8_in_block(layer, n_layer).filter(|_| !kept)
    }

    /// The part of this precision that projection `path` of block `layer` (of `n_layer`) runs
    /// with (probes named `blocks.{layer}.{path}`).
    pub(crate) fn projection(&self, layer: usize, n_layer: usize, path: &str) -> Projection {
        let name = || format!("blocks.{layer}.{path}");
        let fp8 = self.fp8_at(layer, n_layer, path);
        Projection {
            gemm: self.gemm,
            fp8,
            fp8_site: match (&fp8, &self.fp8_history) {
                (Some(cfg), Some(history)) if cfg.per_tensor => Some(history.site(name())),
                _ => None,
            },
            fp8_probe: match (&fp8, &self.probes.fp8_health) {
                (Some(_), Some(sink)) => Some(kernels::Fp8Probe {
                    name: name(),
                    sink: sink.clone(),
                }),
                _ => None,
            },
            grad_probe: self
                .probes
                .grad_format
                .as_ref()
                .map(|g| kernels::FormatProbe {
                    name: name(),
                    min_normal: g.min_normal,
                    sink: g.sink.clone(),
                }),
        }
    }
}

/// How one projection runs: its GEMM engine, FP8 with its health probe, and the probe on its
/// output gradient.
pub(crate) struct Projection {
    pub gemm: kernels::Gemm,
    pub fp8: Option<kernels::Fp8LinearConfig>,
    /// Where the projection's per-tensor FP8 scales come from (delayed scaling).
    pub fp8_site: Option<kernels::Fp8ScaleSite>,
    pub fp8_probe: Option<kernels::Fp8Probe>,
    pub grad_probe: Option<kernels::FormatProbe>,
}
