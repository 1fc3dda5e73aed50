//! Precision recipes and loss scaling.
//!
//! A recipe says in which dtype a run computes. Whatever the recipe, the master weights, the AdamW
//! moments, the update, gradient accumulation and the norm are f32, and so are the log-softmax and
//! the loss. The gradients of the compute copy's weights stay in the compute dtype (bf16 or f16):
//! the gradient norm and the AdamW step read them as they are and compute in f32, with
//! `grad_accum` > 1 `kernels::add_as_f32` sums the micro-batches into f32, and several GPUs cast
//! them to f32 for their mean. The LM head's logits are in the compute dtype. See
//! `docs/precision.md` for every op.
//!
//! | recipe | matmuls and activations | loss scaling by default |
//! |--------|-------------------------|-------------------------|
//! | `fp32` | f32                     | off (not allowed)       |
//! | `bf16` | bf16                    | off (dynamic or static allowed) |
//! | `fp16` | f16                     | dynamic                 |
//! | `fp8`  | FP8 GEMMs in the attention and MLP projections (fine-grained scales), bf16 (or f32) elsewhere | off (the scales adapt) |
//!
//! Loss scaling multiplies the loss by `S` before backward so that small gradients do not flush to
//! zero in f16, and divides by `S` (exactly, `S` being a power of two by default) before clipping
//! and the update. [`LossScaler`] decides per step, from the one host read of the gradient norm,
//! whether the step's gradients are finite; a step whose gradients overflowed is skipped: weights,
//! AdamW moments and AdamW's step counter stay as they were, the batch is consumed and the
//! learning-rate schedule moves on (as PyTorch's `GradScaler` does).

use burn::tensor::FloatDType;
use serde::{Deserialize, Serialize};

/// Compute precision of a run (`precision = "..."`); see [`Recipe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrecisionKind {
    /// `bf16` on CUDA, `fp32` elsewhere (wgpu has no bf16; the CPU backend trains in f32);
    /// resolved when the device is known (`Config::for_device`).
    Auto,
    /// f32 everywhere.
    Fp32,
    /// bf16 matmuls and activations, f32 master weights.
    Bf16,
    /// f16 matmuls and activations, f32 master weights, dynamic loss scaling by default.
    Fp16,
    /// Experimental: the attention and MLP projections' GEMMs in FP8 with fine-grained scales
    /// (`[fp8]`), bf16 elsewhere, f32 master weights.
    Fp8,
}

/// `loss_scale.mode`
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LossScaleMode {
    /// Dynamic for fp16, off for fp32 and bf16.
    Auto,
    Off,
    /// A fixed scale, `loss_scale.init`.
    Static,
    /// Back off on overflow, grow after `growth_interval` clean steps.
    Dynamic,
}

model::display_as_config_value!(
    PrecisionKind,
    LossScaleMode,
    Fp8FormatKind,
    Fp8ScalingKind,
    Fp8ComputeKind,
    Fp8WgradBlocksKind
);

/// `fp8.format`
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fp8FormatKind {
    /// E4M3 for every operand.
    E4m3,
    /// E4M3 for activations and weights, E5M2 (wider range) for output gradients.
    Hybrid,
}

/// `fp8.scaling`
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fp8ScalingKind {
    /// One scale per 1x`tile` slice of activations and gradients, per `tile`x`tile` weight block.
    Tile,
    /// One scale per tensor: the tensor's own amax (current scaling), or with
    /// `fp8.amax_history` the largest amax of the last steps (delayed scaling).
    Tensor,
}

/// `fp8.wgrad_blocks`: with `scaling = "tile"`, which operand of each weight-gradient GEMM
/// `dW = x^T dy` takes one scale per `tile` x `tile` block instead of one per `tile` tokens of
/// each feature (cuBLASLt's block-scaled GEMM with two per-tile operands runs at about 0.7x the
/// speed of one with a block-scaled operand on Hopper).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fp8WgradBlocksKind {
    /// Both per tile, as fprop's activations and dgrad's output gradients.
    None,
    /// The layer input `x^T`, quantized per block in the same pass as `x` for fprop.
    Input,
    /// The output gradient `dy^T`.
    GradOutput,
}

/// `fp8.compute`: the dtype of everything that is not an FP8 GEMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fp8ComputeKind {
    Bf16,
    /// f32: for devices without bf16 (wgpu) and for isolating the FP8 GEMMs' effect.
    F32,
}

/// `[fp8]`: settings of `precision = "fp8"` (experimental).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Fp8Config {
    pub format: Fp8FormatKind,
    pub scaling: Fp8ScalingKind,
    /// Tile length along the reduction axis (and weight block side). Only 128 is implemented.
    pub tile: usize,
    /// Round scales down to powers of two (exact scaling).
    pub pow2_scales: bool,
    /// With `scaling = "tile"`: which wgrad operand takes 128 x 128 block scales.
    pub wgrad_blocks: Fp8WgradBlocksKind,
    /// Which GEMMs of each projection run in FP8: y = x W, dx = dy W^T, dW = x^T dy.
    pub fprop: bool,
    pub dgrad: bool,
    pub wgrad: bool,
    pub compute: Fp8ComputeKind,
    /// The first and the last this many blocks keep their projections in the compute dtype
    /// (bf16), as is common for the layers nearest the embedding and the head; 0: every block
    /// in FP8.
    pub bf16_edge_blocks: usize,
    /// Which of an FP8 block's projections run in FP8: `"all"`, `"auto"` (each where a
    /// measurement at the run's shapes finds FP8 faster than the compute dtype, decided when the
    /// run starts; `crate::fp8_policy`), or a list of paths (`["mlp.fc", "mlp.proj"]`).
    pub projections: Fp8Projections,
    /// With `scaling = "tensor"`: 0 scales each tensor by its own amax (current scaling, one more
    /// read of it); N >= 1 by the largest amax its projection's tensor had over the last N
    /// optimizer steps (delayed scaling: the amax is recorded as the tensor is quantized).
    pub amax_history: usize,
    /// Log FP8 health (per projection weight, input and output gradient: amax, underflow and
    /// saturation shares) to `metrics.jsonl` on step 1 and every this many steps; 0 turns it off.
    pub health_interval: u64,
    /// Under ZeRO-3 (`training.zero = 3`), all-gather the weights of the FP8 projections as FP8
    /// codes and 128 x 128 block scales (about half of bf16's bytes; needs `scaling = "tile"` and
    /// `pow2_scales`), instead of in the compute dtype (`trainer::parallel::fsdp`).
    pub gather_codes: bool,
    /// Experimental: the attention forward in FP8 too, on Hopper GPUs (e4m3 q, k, v with block
    /// scales, FlashAttention-3's recipe; the backward in the compute dtype): the kernels' setting
    /// `flash_fp8` (`BURNMIX_FLASH_FP8`) for the run.
    pub attention: bool,
}

impl Default for Fp8Config {
    fn default() -> Self {
        Self {
            format: Fp8FormatKind::E4m3,
            scaling: Fp8ScalingKind::Tile,
            tile: 128,
            pow2_scales: true,
            wgrad_blocks: Fp8WgradBlocksKind::Input,
            fprop: true,
            dgrad: true,
            wgrad: true,
            compute: Fp8ComputeKind::Bf16,
            bf16_edge_blocks: 0,
            projections: Fp8Projections::default(),
            amax_history: 0,
            health_interval: 100,
            gather_codes: false,
            attention: false,
        }
    }
}

/// `fp8.projections`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Fp8Projections {
    /// `"all"` or `"auto"`.
    Rule(String),
    /// The projection paths that run in FP8 ([`model::PROJECTION_PATHS`]); the others keep the
    /// compute dtype.
    Paths(Vec<String>),
}

impl Default for Fp8Projections {
    fn default() -> Self {
        Fp8Projections::Rule("all".into())
    }
}

impl Fp8Projections {
    pub fn is_auto(&self) -> bool {
        matches!(self, Fp8Projections::Rule(r) if r == "auto")
    }

    pub fn validate(&self) -> Result<(), String> {
        let valid = model::PROJECTION_PATHS
            .map(|p| format!("\"{p}\""))
            .join(", ");
        match self {
            Fp8Projections::Rule(r) if r == "all" || r == "auto" => Ok(()),
            Fp8Projections::Rule(r) => Err(format!(
                "fp8.projections = \"{r}\" is not valid: \"all\", \"auto\" or a list of projections from {valid}"
            )),
            Fp8Projections::Paths(paths) => {
                for (i, p) in paths.iter().enumerate() {
                    if !model::PROJECTION_PATHS.contains(&p.as_str()) {
                        return Err(format!(
                            "fp8.projections names \"{p}\", which is not a projection; each block has {valid}"
                        ));
                    }
                    if paths[..i].contains(p) {
                        return Err(format!("fp8.projections names \"{p}\" twice"));
                    }
                }
                Ok(())
            }
        }
    }

    /// The projection paths that keep the compute dtype ([`model::Precision::fp8_compute_paths`]):
    /// none for `"all"`, the paths not listed for a list.
    ///
    /// # Panics
    /// For `"auto"`, which is decided by measuring before a run builds its precision.
    pub fn compute_paths(&self) -> Vec<String> {
        match self {
            Fp8Projections::Paths(paths) => model::PROJECTION_PATHS
                .iter()
                .filter(|p| !paths.iter().any(|q| q == *p))
                .map(|p| p.to_string())
                .collect(),
            Fp8Projections::Rule(r) if r == "auto" => {
                panic!("fp8.projections = \"auto\" is decided before the precision is built")
            }
            Fp8Projections::Rule(_) => Vec::new(),
        }
    }
}

/// The longest `fp8.amax_history`.
pub const MAX_AMAX_HISTORY: usize = 1024;

impl Fp8Config {
    pub fn validate(&self) -> Result<(), String> {
        if self.tile != kernels::fp8::TILE {
            return Err(format!(
                "fp8.tile = {} is not supported; the FP8 kernels use tiles of {}",
                self.tile,
                kernels::fp8::TILE
            ));
        }
        if self.amax_history > 0 && self.scaling != Fp8ScalingKind::Tensor {
            return Err(format!(
                "fp8.amax_history = {} needs fp8.scaling = \"tensor\" (scaling is \"tile\", whose scales come from each tile's own amax); set scaling = \"tensor\" or amax_history = 0",
                self.amax_history
            ));
        }
        self.projections.validate()?;
        if self.amax_history > MAX_AMAX_HISTORY {
            return Err(format!(
                "fp8.amax_history = {} is too long; use 1 to {MAX_AMAX_HISTORY} steps (or 0 for current scaling)",
                self.amax_history
            ));
        }
        Ok(())
    }

    /// The amax histories of a run's model replica, for delayed scaling (`amax_history` > 0).
    pub fn amax_history(&self) -> Option<kernels::Fp8AmaxHistory> {
        (self.amax_history > 0).then(|| kernels::Fp8AmaxHistory::new(self.amax_history))
    }

    /// The layer settings the model takes.
    pub fn linear(&self) -> kernels::Fp8LinearConfig {
        kernels::Fp8LinearConfig {
            fprop: self.fprop,
            dgrad: self.dgrad,
            wgrad: self.wgrad,
            forward_format: kernels::Fp8Format::E4M3,
            grad_format: match self.format {
                Fp8FormatKind::E4m3 => kernels::Fp8Format::E4M3,
                Fp8FormatKind::Hybrid => kernels::Fp8Format::E5M2,
            },
            per_tensor: self.scaling == Fp8ScalingKind::Tensor,
            pow2: self.pow2_scales,
            wgrad_blocks: match self.wgrad_blocks {
                Fp8WgradBlocksKind::None => kernels::Fp8WgradBlocks::Neither,
                Fp8WgradBlocksKind::Input => kernels::Fp8WgradBlocks::Input,
                Fp8WgradBlocksKind::GradOutput => kernels::Fp8WgradBlocks::GradOutput,
            },
        }
    }
}

/// `[loss_scale]`: defaults are PyTorch `GradScaler`'s.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LossScaleConfig {
    pub mode: LossScaleMode,
    /// Dynamic: the first step's scale. Static: the scale.
    pub init: f64,
    /// Dynamic: multiply the scale by this after `growth_interval` clean steps in a row.
    pub growth_factor: f64,
    /// Dynamic: multiply the scale by this on overflow.
    pub backoff_factor: f64,
    pub growth_interval: u64,
    /// Dynamic: floor of the scale; an overflow with the scale at the floor stops the run.
    pub min: f64,
    /// Dynamic: ceiling of the scale.
    pub max: f64,
    /// Stop when this many steps in a row overflow.
    pub max_consecutive_skips: u64,
}

impl Default for LossScaleConfig {
    fn default() -> Self {
        Self {
            mode: LossScaleMode::Auto,
            init: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            min: 1.0,
            max: 16_777_216.0,
            max_consecutive_skips: 50,
        }
    }
}

/// How the loss is scaled before backward.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "lowercase")]
pub enum LossScaling {
    /// No scaling: a non-finite gradient stops the run as divergence.
    Off,
    /// A fixed scale; overflowing steps are skipped.
    Static {
        scale: f64,
        max_consecutive_skips: u64,
    },
    /// PyTorch `GradScaler` semantics: back off on overflow, grow after `growth_interval` clean
    /// steps.
    Dynamic {
        init: f64,
        growth_factor: f64,
        backoff_factor: f64,
        growth_interval: u64,
        min: f64,
        max: f64,
        max_consecutive_skips: u64,
    },
}

impl LossScaling {
    /// The explicit setting from the `[loss_scale]` section (`mode = "auto"` resolved by the
    /// recipe).
    fn from_section(c: &LossScaleConfig, mode: LossScaleMode) -> Self {
        match mode {
            LossScaleMode::Off | LossScaleMode::Auto => LossScaling::Off,
            LossScaleMode::Static => LossScaling::Static {
                scale: c.init,
                max_consecutive_skips: c.max_consecutive_skips,
            },
            LossScaleMode::Dynamic => LossScaling::Dynamic {
                init: c.init,
                growth_factor: c.growth_factor,
                backoff_factor: c.backoff_factor,
                growth_interval: c.growth_interval,
                min: c.min,
                max: c.max,
                max_consecutive_skips: c.max_consecutive_skips,
            },
        }
    }

    /// Checks the values; errors name the `[loss_scale]` key and what is allowed.
    pub fn validate(&self) -> Result<(), String> {
        let positive = |key: &str, v: f64| {
            if v > 0.0 && v.is_finite() {
                Ok(())
            } else {
                Err(format!(
                    "loss_scale.{key} must be a positive finite number, got {v}"
                ))
            }
        };
        match *self {
            LossScaling::Off => Ok(()),
            LossScaling::Static {
                scale,
                max_consecutive_skips,
            } => {
                positive("init", scale)?;
                if max_consecutive_skips == 0 {
                    return Err("loss_scale.max_consecutive_skips must be at least 1, got 0".into());
                }
                Ok(())
            }
            LossScaling::Dynamic {
                init,
                growth_factor,
                backoff_factor,
                growth_interval,
                min,
                max,
                max_consecutive_skips,
            } => {
                positive("init", init)?;
                positive("min", min)?;
                positive("max", max)?;
                if !(growth_factor > 1.0 && growth_factor.is_finite()) {
                    return Err(format!(
                        "loss_scale.growth_factor must be above 1, got {growth_factor}"
                    ));
                }
                if !(backoff_factor > 0.0 && backoff_factor < 1.0) {
                    return Err(format!(
                        "loss_scale.backoff_factor must be in (0, 1), got {backoff_factor}"
                    ));
                }
                if growth_interval == 0 {
                    return Err("loss_scale.growth_interval must be at least 1, got 0".into());
                }
                if !(min <= init && init <= max) {
                    return Err(format!(
                        "loss_scale needs min <= init <= max, got min = {min}, init = {init}, max = {max}"
                    ));
                }
                if max_consecutive_skips == 0 {
                    return Err("loss_scale.max_consecutive_skips must be at least 1, got 0".into());
                }
                Ok(())
            }
        }
    }

    /// The scale of the first step.
    pub fn initial_scale(&self) -> f64 {
        match *self {
            LossScaling::Off => 1.0,
            LossScaling::Static { scale, .. } => scale,
            LossScaling::Dynamic { init, .. } => init,
        }
    }

    pub fn is_off(&self) -> bool {
        matches!(self, LossScaling::Off)
    }

    /// One-line description for the log.
    pub fn describe(&self) -> String {
        match *self {
            LossScaling::Off => "no loss scaling".into(),
            LossScaling::Static { scale, .. } => format!("static loss scale {scale}"),
            LossScaling::Dynamic { init, growth_factor, backoff_factor, growth_interval, min, max, .. } => format!(
                "dynamic loss scale from {init} (x{growth_factor} after {growth_interval} clean steps, x{backoff_factor} on overflow, within [{min}, {max}])"
            ),
        }
    }
}

/// FP32 everywhere: the reference recipe.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fp32Recipe;

impl Fp32Recipe {
    pub fn validate(&self) -> Result<(), String> {
        Ok(())
    }
}

/// BF16 matmuls and activations over FP32 master weights. BF16 has f32's exponent range, so loss
/// scaling is off unless asked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Bf16Recipe {
    pub loss_scaling: LossScaling,
}

impl Bf16Recipe {
    pub fn validate(&self) -> Result<(), String> {
        self.loss_scaling.validate()
    }
}

/// FP16 matmuls and activations over FP32 master weights, with dynamic loss scaling by default:
/// without it, gradients below f16's smallest subnormal (6e-8) become zero.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fp16Recipe {
    pub loss_scaling: LossScaling,
}

impl Fp16Recipe {
    pub fn validate(&self) -> Result<(), String> {
        self.loss_scaling.validate()
    }
}

/// Experimental FP8: the attention and MLP projections run their GEMMs in FP8 with fine-grained
/// scales (see `[fp8]` and `kernels::fp8`); embedding, LM head, norms, attention and the loss stay
/// in the compute dtype (bf16 by default) or f32; f32 master weights. Loss scaling is off unless
/// asked for: the per-tile scales already adapt to the gradients' range.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fp8Recipe {
    pub loss_scaling: LossScaling,
    pub fp8: Fp8Config,
}

impl Fp8Recipe {
    pub fn validate(&self) -> Result<(), String> {
        self.loss_scaling.validate()?;
        self.fp8.validate()
    }
}

/// The resolved precision recipe of a run (saved as `precision.json`, in `summary.json`, in each
/// checkpoint and, by name, in every metrics record).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "recipe", rename_all = "lowercase")]
pub enum Recipe {
    Fp32(Fp32Recipe),
    Bf16(Bf16Recipe),
    Fp16(Fp16Recipe),
    Fp8(Fp8Recipe),
}

impl Recipe {
    /// Builds the recipe from the config's `precision` key and `[loss_scale]` section, resolving
    /// `loss_scale.mode = "auto"`, and validates it.
    pub fn resolve(kind: PrecisionKind, ls: &LossScaleConfig) -> Result<Self, String> {
        Self::resolve_with_fp8(kind, ls, &Fp8Config::default())
    }

    /// [`Recipe::resolve`] with the `[fp8]` section (used by `precision = "fp8"`).
    pub fn resolve_with_fp8(
        kind: PrecisionKind,
        ls: &LossScaleConfig,
        fp8: &Fp8Config,
    ) -> Result<Self, String> {
        let recipe = match kind {
            // Before the device is known (config validation), "auto" is checked as bf16, what it
            // resolves to on CUDA; `Config::for_device` resolves it before a run builds its recipe.
            PrecisionKind::Auto => return Self::resolve_with_fp8(PrecisionKind::Bf16, ls, fp8),
            PrecisionKind::Fp32 => {
                if !matches!(ls.mode, LossScaleMode::Auto | LossScaleMode::Off) {
                    return Err(format!(
                        "loss_scale.mode = \"{}\" needs precision = \"fp16\" or \"bf16\"; fp32 gradients do not underflow, use \"auto\" or \"off\"",
                        ls.mode
                    ));
                }
                Recipe::Fp32(Fp32Recipe)
            }
            PrecisionKind::Bf16 => {
                let mode = if ls.mode == LossScaleMode::Auto {
                    LossScaleMode::Off
                } else {
                    ls.mode
                };
                Recipe::Bf16(Bf16Recipe {
                    loss_scaling: LossScaling::from_section(ls, mode),
                })
            }
            PrecisionKind::Fp16 => {
                let mode = if ls.mode == LossScaleMode::Auto {
                    LossScaleMode::Dynamic
                } else {
                    ls.mode
                };
                Recipe::Fp16(Fp16Recipe {
                    loss_scaling: LossScaling::from_section(ls, mode),
                })
            }
            PrecisionKind::Fp8 => {
                let mode = if ls.mode == LossScaleMode::Auto {
                    LossScaleMode::Off
                } else {
                    ls.mode
                };
                Recipe::Fp8(Fp8Recipe {
                    loss_scaling: LossScaling::from_section(ls, mode),
                    fp8: fp8.clone(),
                })
            }
        };
        recipe.validate()?;
        Ok(recipe)
    }

    pub fn validate(&self) -> Result<(), String> {
        match self {
            Recipe::Fp32(r) => r.validate(),
            Recipe::Bf16(r) => r.validate(),
            Recipe::Fp16(r) => r.validate(),
            Recipe::Fp8(r) => r.validate(),
        }
    }

    /// `Fp32`, `Bf16`, `Fp16` or `Fp8` (never `Auto`); displays as the config value.
    pub fn kind(&self) -> PrecisionKind {
        match self {
            Recipe::Fp32(_) => PrecisionKind::Fp32,
            Recipe::Bf16(_) => PrecisionKind::Bf16,
            Recipe::Fp16(_) => PrecisionKind::Fp16,
            Recipe::Fp8(_) => PrecisionKind::Fp8,
        }
    }

    /// Dtype of the matmuls and activations.
    pub fn compute_dtype(&self) -> FloatDType {
        match self {
            Recipe::Fp32(_) => FloatDType::F32,
            Recipe::Bf16(_) => FloatDType::BF16,
            Recipe::Fp16(_) => FloatDType::F16,
            Recipe::Fp8(r) => match r.fp8.compute {
                Fp8ComputeKind::Bf16 => FloatDType::BF16,
                Fp8ComputeKind::F32 => FloatDType::F32,
            },
        }
    }

    /// The projections' FP8 settings (`None` outside the FP8 recipe).
    pub fn fp8_linear(&self) -> Option<kernels::Fp8LinearConfig> {
        match self {
            Recipe::Fp8(r) => Some(r.fp8.linear()),
            _ => None,
        }
    }

    pub fn loss_scaling(&self) -> &LossScaling {
        match self {
            Recipe::Fp32(_) => &LossScaling::Off,
            Recipe::Bf16(r) => &r.loss_scaling,
            Recipe::Fp16(r) => &r.loss_scaling,
            Recipe::Fp8(r) => &r.loss_scaling,
        }
    }

    /// One-line description for the log.
    pub fn describe(&self) -> String {
        match self {
            Recipe::Fp32(_) => "fp32 (f32 compute and weights)".into(),
            Recipe::Fp8(r) => {
                let passes: Vec<&str> = [(r.fp8.fprop, "fprop"), (r.fp8.dgrad, "dgrad"), (r.fp8.wgrad, "wgrad")]
                    .iter()
                    .filter(|p| p.0)
                    .map(|p| p.1)
                    .collect();
                let mut edges = match r.fp8.bf16_edge_blocks {
                    0 => String::new(),
                    n => format!(" except the first and last {n} block(s)"),
                };
                match &r.fp8.projections {
                    Fp8Projections::Paths(p) => edges += &format!(" (only {})", if p.is_empty() { "none".to_string() } else { p.join(", ") }),
                    Fp8Projections::Rule(rule) if rule == "auto" => edges += " (those measured faster in FP8)",
                    Fp8Projections::Rule(_) => {}
                }
                format!(
                    "fp8, experimental (projection GEMMs {}{edges} in FP8: {}, {} scales{}, {} elsewhere; f32 master weights; {})",
                    if passes.is_empty() { "none".to_string() } else { passes.join("+") },
                    match r.fp8.format {
                        Fp8FormatKind::E4m3 => "E4M3",
                        Fp8FormatKind::Hybrid => "hybrid (E4M3, E5M2 output gradients)",
                    },
                    match (r.fp8.scaling, r.fp8.wgrad_blocks) {
                        (Fp8ScalingKind::Tile, Fp8WgradBlocksKind::None) => "1x128 / 128x128 tile",
                        (Fp8ScalingKind::Tile, Fp8WgradBlocksKind::Input) => {
                            "1x128 / 128x128 tile (wgrad's x^T per block)"
                        }
                        (Fp8ScalingKind::Tile, Fp8WgradBlocksKind::GradOutput) => {
                            "1x128 / 128x128 tile (wgrad's dy^T per block)"
                        }
                        (Fp8ScalingKind::Tensor, _) => "per-tensor",
                    },
                    if r.fp8.pow2_scales { " (powers of two)" } else { "" },
                    model::dtype::name(self.compute_dtype()),
                    self.loss_scaling().describe()
                )
            }
            _ => format!(
                "{} ({} matmuls and activations; f32 master weights, optimizer, norms, softmax and loss; {})",
                self.kind(),
                model::dtype::name(self.compute_dtype()),
                self.loss_scaling().describe()
            ),
        }
    }
}

/// Loss-scaler state that a checkpoint keeps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScalerState {
    /// Scale for the next step.
    pub scale: f64,
    /// Clean steps since the scale last changed (dynamic growth counter).
    pub clean_steps: u64,
    /// Steps skipped because their gradients were not finite, over the whole run.
    pub overflows: u64,
    /// Skipped steps in a row up to now.
    pub consecutive_overflows: u64,
}

/// What to do with a step's gradients.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Finite: update the weights.
    Apply,
    /// Overflowed: leave weights and optimizer state as they are.
    Skip,
    /// Cannot go on; the message says why.
    Stop(String),
}

/// Dynamic or static loss scaling driven by one finiteness flag per step.
#[derive(Debug, Clone)]
pub struct LossScaler {
    pub setting: LossScaling,
    pub state: ScalerState,
}

impl LossScaler {
    pub fn new(setting: LossScaling) -> Self {
        let state = ScalerState {
            scale: setting.initial_scale(),
            clean_steps: 0,
            overflows: 0,
            consecutive_overflows: 0,
        };
        Self { setting, state }
    }

    /// Continues from a checkpoint's scaler `state`, saved under the recipe `saved` (absent in
    /// checkpoints older than recipes). With the same loss-scaling settings the state is taken as
    /// is, so the resumed run repeats the uninterrupted one. If `[loss_scale]` changed since, the
    /// new settings start afresh from their initial scale (the overflow count is kept), and the
    /// returned line says so.
    pub fn restore(&mut self, state: ScalerState, saved: Option<&Recipe>) -> Option<String> {
        if saved.map(|r| r.loss_scaling()) == Some(&self.setting) {
            self.state = state;
            return None;
        }
        self.state.overflows = state.overflows;
        Some(format!(
            "loss scaling differs from the checkpoint's; it restarts as {} (the checkpoint's scale was {})",
            self.setting.describe(),
            state.scale
        ))
    }

    /// The factor to multiply this step's loss by.
    pub fn scale(&self) -> f64 {
        self.state.scale
    }

    /// Records whether the gradients of the step were all finite and says what to do with them.
    /// `step` (1-based) only names the step in messages.
    pub fn update(&mut self, finite: bool, step: u64) -> Verdict {
        let s = &mut self.state;
        match self.setting {
            LossScaling::Off => {
                if finite {
                    Verdict::Apply
                } else {
                    Verdict::Stop(format!(
                        "gradients are not finite at step {step} and loss scaling is off"
                    ))
                }
            }
            LossScaling::Static {
                max_consecutive_skips,
                ..
            } => {
                if finite {
                    s.consecutive_overflows = 0;
                    s.clean_steps += 1;
                    return Verdict::Apply;
                }
                s.overflows += 1;
                s.consecutive_overflows += 1;
                if s.consecutive_overflows >= max_consecutive_skips {
                    return Verdict::Stop(format!(
                        "gradients overflowed on {} consecutive steps (up to step {step}) with the static loss scale {} \
                         (loss_scale.max_consecutive_skips = {max_consecutive_skips}); lower loss_scale.init or use mode = \"dynamic\"",
                        s.consecutive_overflows, s.scale
                    ));
                }
                Verdict::Skip
            }
            LossScaling::Dynamic {
                growth_factor,
                backoff_factor,
                growth_interval,
                min,
                max,
                max_consecutive_skips,
                ..
            } => {
                if finite {
                    s.consecutive_overflows = 0;
                    s.clean_steps += 1;
                    if s.clean_steps >= growth_interval {
                        s.scale = (s.scale * growth_factor).min(max);
                        s.clean_steps = 0;
                    }
                    return Verdict::Apply;
                }
                s.overflows += 1;
                s.consecutive_overflows += 1;
                s.clean_steps = 0;
                if s.scale <= min {
                    return Verdict::Stop(format!(
                        "gradients overflowed at step {step} with the loss scale already at its floor loss_scale.min = {min}: \
                         the loss scale has collapsed, so the run is producing inf/NaN gradients that scaling cannot fix \
                         (lower optimizer.lr, or use precision = \"bf16\" or \"fp32\")"
                    ));
                }
                s.scale = (s.scale * backoff_factor).max(min);
                if s.consecutive_overflows >= max_consecutive_skips {
                    return Verdict::Stop(format!(
                        "gradients overflowed on {} consecutive steps (up to step {step}); the loss scale is now {} \
                         (loss_scale.max_consecutive_skips = {max_consecutive_skips})",
                        s.consecutive_overflows, s.scale
                    ));
                }
                Verdict::Skip
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dynamic(interval: u64) -> LossScaling {
        LossScaling::Dynamic {
            init: 1024.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: interval,
            min: 256.0,
            max: 4096.0,
            max_consecutive_skips: 50,
        }
    }

    #[test]
    fn dynamic_scale_grows_backs_off_and_stops_at_the_floor() {
        let mut s = LossScaler::new(dynamic(3));
        for step in 1..=3 {
            assert_eq!(s.update(true, step), Verdict::Apply);
        }
        assert_eq!(s.scale(), 2048.0);
        assert_eq!(s.update(false, 4), Verdict::Skip);
        assert_eq!(
            (s.scale(), s.state.overflows, s.state.clean_steps),
            (1024.0, 1, 0)
        );
        // Growth is capped at max.
        for step in 5..=10 {
            s.update(true, step);
        }
        assert_eq!(s.scale(), 4096.0);
        for step in 11..=12 {
            s.update(true, step);
        }
        assert_eq!(s.scale(), 4096.0);
        // Back off to the floor, then an overflow at the floor stops the run.
        assert_eq!(s.update(false, 13), Verdict::Skip);
        assert_eq!(s.update(false, 14), Verdict::Skip);
        assert_eq!(s.update(false, 15), Verdict::Skip);
        assert_eq!(s.update(false, 16), Verdict::Skip);
        assert_eq!(s.scale(), 256.0);
        match s.update(false, 17) {
            Verdict::Stop(m) => assert!(m.contains("floor") && m.contains("step 17"), "{m}"),
            v => panic!("expected a stop, got {v:?}"),
        }
    }

    #[test]
    fn static_and_off_scaling() {
        let mut s = LossScaler::new(LossScaling::Static {
            scale: 8.0,
            max_consecutive_skips: 2,
        });
        assert_eq!(s.update(false, 1), Verdict::Skip);
        assert_eq!(s.update(true, 2), Verdict::Apply);
        assert_eq!(s.update(false, 3), Verdict::Skip);
        assert!(matches!(s.update(false, 4), Verdict::Stop(_)));
        assert_eq!(s.scale(), 8.0);
        let mut off = LossScaler::new(LossScaling::Off);
        assert_eq!(off.scale(), 1.0);
        assert_eq!(off.update(true, 1), Verdict::Apply);
        assert!(matches!(off.update(false, 2), Verdict::Stop(_)));
    }

    #[test]
    fn restore_takes_the_state_only_under_the_same_settings() {
        let ls = LossScaleConfig::default();
        let fp16 = Recipe::resolve(PrecisionKind::Fp16, &ls).unwrap();
        let saved = ScalerState {
            scale: 512.0,
            clean_steps: 7,
            overflows: 3,
            consecutive_overflows: 0,
        };
        let mut same = LossScaler::new(fp16.loss_scaling().clone());
        assert_eq!(same.restore(saved.clone(), Some(&fp16)), None);
        assert_eq!(same.state, saved);
        // Scaling switched on after an fp16 run without it: start from init, keep the count.
        let off = Recipe::resolve(
            PrecisionKind::Fp16,
            &LossScaleConfig {
                mode: LossScaleMode::Off,
                ..ls.clone()
            },
        )
        .unwrap();
        let mut changed = LossScaler::new(fp16.loss_scaling().clone());
        let note = changed
            .restore(
                ScalerState {
                    scale: 1.0,
                    ..saved.clone()
                },
                Some(&off),
            )
            .unwrap();
        assert!(note.contains("restarts"), "{note}");
        assert_eq!(
            (
                changed.scale(),
                changed.state.clean_steps,
                changed.state.overflows
            ),
            (65536.0, 0, 3)
        );
    }

    #[test]
    fn recipes_resolve_auto_and_refuse_scaling_for_fp32() {
        let ls = LossScaleConfig::default();
        let fp16 = Recipe::resolve(PrecisionKind::Fp16, &ls).unwrap();
        assert!(
            matches!(fp16.loss_scaling(), LossScaling::Dynamic { init, .. } if *init == 65536.0)
        );
        assert_eq!(fp16.compute_dtype(), FloatDType::F16);
        let bf16 = Recipe::resolve(PrecisionKind::Bf16, &ls).unwrap();
        assert!(bf16.loss_scaling().is_off());
        let dynamic = LossScaleConfig {
            mode: LossScaleMode::Dynamic,
            ..LossScaleConfig::default()
        };
        let e = Recipe::resolve(PrecisionKind::Fp32, &dynamic).unwrap_err();
        assert!(e.contains("loss_scale.mode") && e.contains("fp16"), "{e}");
        let bad = LossScaleConfig {
            mode: LossScaleMode::Dynamic,
            backoff_factor: 2.0,
            ..LossScaleConfig::default()
        };
        let e = Recipe::resolve(PrecisionKind::Fp16, &bad).unwrap_err();
        assert!(e.contains("loss_scale.backoff_factor"), "{e}");
    }
}
