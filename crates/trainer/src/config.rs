//! Training configuration: one TOML file, then `--set key=value` overrides, checked strictly.
//!
//! Every section and key is optional (missing keys take the defaults below, which together are the
//! built-in default run); unknown keys, wrong types and impossible values are errors that name the
//! key.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use model::GptConfig;
use serde::{Deserialize, Serialize};

/// The built-in default configuration, identical to `configs/default.toml`.
pub const DEFAULT_TOML: &str = include_str!("../../../configs/default.toml");

// The `device` key belongs to the device module.
pub use crate::device::DeviceKind;

/// Where the training text comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TextSource {
    /// A synthetic corpus generated in process from the seed (needs no file).
    Embedded,
    /// The UTF-8 text file at `data.path`.
    File,
    /// Token shards (`prepare`'s, llm.c's or nanoGPT's), read a window at a time: `data.path` and
    /// `data.val_path`.
    Shards,
}

/// How text becomes tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenizerKind {
    /// One token per character seen in the corpus.
    Char,
    /// Byte-level BPE trained on the training split with `data.bpe_vocab_size` tokens.
    Bpe,
    /// A Hugging Face `tokenizer.json` at `data.tokenizer_path`.
    File,
}

model::display_as_config_value!(TextSource, TokenizerKind);

/// `[data]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// "embedded" (generated in process), "file" or "shards".
    pub source: TextSource,
    /// Text file when `source = "file"`; with `source = "shards"`, the training shards: a
    /// directory (its `.bin` files whose names contain "train"), a file or a glob pattern.
    /// Relative paths are resolved against the current directory.
    pub path: String,
    /// With `source = "shards"`, the validation shards (as `path`); empty: the `.bin` files
    /// whose names contain "val" in `path`'s directory.
    pub val_path: String,
    /// Characters of embedded corpus to generate.
    pub embedded_chars: usize,
    /// "char", "bpe" or "file".
    pub tokenizer: TokenizerKind,
    /// Vocabulary size of the BPE tokenizer trained when `tokenizer = "bpe"` (at least 260).
    pub bpe_vocab_size: usize,
    /// `tokenizer.json` to load when `tokenizer = "file"`.
    pub tokenizer_path: String,
    /// Share of the tokens (taken from the end of the text) held out for validation.
    pub val_fraction: f64,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            source: TextSource::Embedded,
            path: String::new(),
            val_path: String::new(),
            embedded_chars: 400_000,
            tokenizer: TokenizerKind::Char,
            bpe_vocab_size: 1024,
            tokenizer_path: String::new(),
            val_fraction: 0.1,
        }
    }
}

/// `[optimizer]`: AdamW with decoupled weight decay and global-norm gradient clipping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerConfig {
    /// Peak learning rate (reached at the end of warm-up).
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Decoupled weight decay, applied to matrices (not to norm gains or biases).
    pub weight_decay: f64,
    /// Also decay the embedding matrix (and the tied LM head).
    pub decay_embeddings: bool,
    /// Clip the global gradient norm to this value; 0 disables clipping.
    pub grad_clip: f64,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
            decay_embeddings: false,
            grad_clip: 1.0,
        }
    }
}

/// `[schedule]`: linear warm-up from 0, then cosine decay to `min_lr`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScheduleConfig {
    /// Steps of linear warm-up.
    pub warmup_steps: usize,
    /// Learning rate at the end of the decay (and after it).
    pub min_lr: f64,
    /// Step at which the cosine reaches `min_lr`; 0 means `training.steps`.
    pub decay_steps: usize,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        Self {
            warmup_steps: 20,
            min_lr: 3e-4,
            decay_steps: 0,
        }
    }
}

/// `[training]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainingConfig {
    /// Optimizer steps.
    pub steps: usize,
    /// Sequences per micro-batch.
    pub batch_size: usize,
    /// Micro-batches accumulated per optimizer step.
    pub grad_accum: usize,
    /// Evaluate every this many steps (and at the last step); 0 evaluates only at the end.
    pub eval_interval: usize,
    /// Validation batches per evaluation.
    pub eval_batches: usize,
    /// Print a log line every this many steps.
    pub log_interval: usize,
    /// Write a checkpoint every this many steps (and at the last step); 0 writes only the last.
    pub checkpoint_interval: usize,
    /// Complete checkpoints kept on disk (older ones are deleted); at least 1.
    pub keep_checkpoints: usize,
    /// Peak dense BF16 TFLOP/s of the device, for MFU; 0 looks the GPU up by name.
    pub peak_tflops: f64,
    /// fp16 and bf16 recipes: on the first step and every this many steps, record in
    /// `metrics.jsonl` how each projection's output gradient and weight gradient fit the compute
    /// format (underflow and overflow shares, amax); 0 turns it off. FP8 has `fp8.health_interval`.
    pub numerics_interval: u64,
    /// GPUs to train on, one replica each (data parallelism, CUDA only): a count (the first N
    /// GPUs), "all", or a list of GPU indices. Every GPU computes `batch_size x grad_accum`
    /// sequences per step, so a step takes `devices` times the tokens of one GPU.
    pub devices: Devices,
    /// ZeRO stage with several GPUs: 0 keeps the whole optimizer state on every GPU; 1 shards the
    /// f32 master weights and AdamW moments across them (each GPU updates its share, then sends
    /// the others the new compute weights): less memory per GPU, more communication per step;
    /// 2 (processes) also keeps only each GPU's share of the averaged gradients; 3 (processes,
    /// FSDP) shards the weights too, gathering each block just before it runs.
    pub zero: u8,
    /// Runs of one process per GPU with `zero` 0 or 1: the gradients are averaged in buckets of
    /// about this many MB (f32) while the backward still runs, each bucket as soon as the
    /// backward has finished with its blocks; 0 averages them one tensor at a time after the
    /// backward. See `parallel::overlap` for when a step falls back to the latter.
    pub bucket_mb: f64,
    /// With several GPUs: seconds a step (or the replicas' start, or a checkpoint's gathering) may
    /// take before the run stops with an error naming the ranks that had not finished (a GPU or
    /// an NCCL call that stopped responding would otherwise hang the run). 0: 20 times the slowest
    /// step but the first, at least 5 minutes. Until a step after the first has finished, at least
    /// 30 minutes whatever the setting (the first step compiles every kernel).
    pub step_timeout_s: u64,
    /// Before the first step, estimate the memory the run needs on each GPU and stop with what
    /// to change when a CUDA device has less free (see `memory_plan`); false skips the check
    /// (the estimate is still printed).
    pub memory_check: bool,
    /// Read each step's statistics (loss, gradient norm) one step late, once the next step is
    /// queued, so that the GPU never waits for the host between steps; steps whose result the
    /// host needs at once (evaluation, checkpoint, numerics probes, loss scaling, several GPUs)
    /// are read at once whatever the setting. false reads every step at once (a comparison).
    pub read_back_late: bool,
}

/// `training.devices`: which GPUs a run trains on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Devices {
    /// The first N GPUs (1: the run's device alone).
    Count(usize),
    /// Every GPU the process can see.
    All,
    /// These GPU indices.
    List(Vec<usize>),
}

impl Devices {
    /// How many GPUs, where the config says without looking at the machine ("all" does not).
    pub fn count(&self) -> Option<usize> {
        match self {
            Devices::Count(n) => Some(*n),
            Devices::All => None,
            Devices::List(l) => Some(l.len()),
        }
    }

    /// `training.devices = 1`: the run's device alone, wherever it is.
    pub fn is_single(&self) -> bool {
        *self == Devices::Count(1)
    }

    /// The GPU indices, given the number of GPUs the process sees; errors name the key.
    pub fn indices(&self, available: usize) -> std::result::Result<Vec<usize>, String> {
        let list = match self {
            Devices::Count(n) => {
                if *n > available {
                    return Err(format!(
                        "training.devices = {n}, but this machine has {available} CUDA GPU{} visible; use at most {available}, or \"all\"",
                        if available == 1 { "" } else { "s" }
                    ));
                }
                (0..*n).collect()
            }
            Devices::All => (0..available).collect(),
            Devices::List(l) => {
                if let Some(bad) = l.iter().find(|&&i| i >= available) {
                    return Err(format!(
                        "training.devices lists GPU {bad}, but this machine has {available} CUDA GPU{} visible (indices 0 to {})",
                        if available == 1 { "" } else { "s" },
                        available.saturating_sub(1)
                    ));
                }
                l.clone()
            }
        };
        if list.is_empty() {
            return Err("training.devices = \"all\", but no CUDA GPU is visible".into());
        }
        Ok(list)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        match self {
            Devices::Count(0) => Err(
                "training.devices must be at least 1, \"all\", or a list of GPU indices, got 0"
                    .into(),
            ),
            Devices::List(l) if l.is_empty() => {
                Err("training.devices = []: list at least one GPU index, e.g. [0, 1]".into())
            }
            Devices::List(l) => {
                let mut seen = std::collections::HashSet::new();
                match l.iter().find(|i| !seen.insert(**i)) {
                    Some(dup) => Err(format!(
                        "training.devices lists GPU {dup} twice; each GPU holds one replica"
                    )),
                    None => Ok(()),
                }
            }
            _ => Ok(()),
        }
    }
}

impl std::fmt::Display for Devices {
    /// As the config value: `2`, `"all"`, `[0, 1]`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Devices::Count(n) => write!(f, "{n}"),
            Devices::All => f.write_str("\"all\""),
            Devices::List(l) => write!(f, "{l:?}"),
        }
    }
}

impl Serialize for Devices {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Devices::Count(n) => s.serialize_u64(*n as u64),
            Devices::All => s.serialize_str("all"),
            Devices::List(l) => l.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Devices {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Devices;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a number of GPUs (1, 2, ...), \"all\", or a list of GPU indices such as [0, 1]")
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<Devices, E> {
                usize::try_from(v)
                    .map(Devices::Count)
                    .map_err(|_| E::custom(format!("expected a number of GPUs (1, 2, ...), \"all\", or a list of GPU indices such as [0, 1], got {v}")))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<Devices, E> {
                Ok(Devices::Count(v as usize))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<Devices, E> {
                if v == "all" {
                    Ok(Devices::All)
                } else {
                    Err(E::custom(format!("expected a number of GPUs (1, 2, ...), \"all\", or a list of GPU indices such as [0, 1], got \"{v}\"")))
                }
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<Devices, A::Error> {
                let mut l = Vec::new();
                while let Some(i) = seq.next_element::<usize>()? {
                    l.push(i);
                }
                Ok(Devices::List(l))
            }
        }
        d.deserialize_any(V)
    }
}

impl Default for TrainingConfig {
    fn default() -> Self {
        Self {
            steps: 150,
            batch_size: 16,
            grad_accum: 1,
            eval_interval: 50,
            eval_batches: 8,
            log_interval: 10,
            checkpoint_interval: 50,
            keep_checkpoints: 2,
            peak_tflops: 0.0,
            numerics_interval: 100,
            devices: Devices::Count(1),
            zero: 0,
            bucket_mb: 25.0,
            step_timeout_s: 0,
            memory_check: true,
            read_back_late: true,
        }
    }
}

// The `precision`, `[loss_scale]` and `[fp8]` sections belong to the precision module.
pub use crate::precision::{
    Fp8ComputeKind, Fp8Config, Fp8FormatKind, Fp8Projections, Fp8ScalingKind, Fp8WgradBlocksKind,
    LossScaleConfig, LossScaleMode, PrecisionKind,
};

/// A whole training run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Seeds the initialisation, the data windows and dropout.
    pub seed: u64,
    /// "auto", "cuda" or "wgpu".
    pub device: DeviceKind,
    /// "fp32", "bf16", "fp16" or "fp8" (see `precision.rs`).
    pub precision: PrecisionKind,
    pub model: GptConfig,
    pub data: DataConfig,
    pub optimizer: OptimizerConfig,
    pub schedule: ScheduleConfig,
    pub training: TrainingConfig,
    pub loss_scale: LossScaleConfig,
    /// Settings of `precision = "fp8"`.
    pub fp8: Fp8Config,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            seed: 1337,
            device: DeviceKind::Auto,
            precision: PrecisionKind::Auto,
            model: GptConfig::default(),
            data: DataConfig::default(),
            optimizer: OptimizerConfig::default(),
            schedule: ScheduleConfig::default(),
            training: TrainingConfig::default(),
            loss_scale: LossScaleConfig::default(),
            fp8: Fp8Config::default(),
        }
    }
}

/// What a run trains with on its device (see [`Config::resolve`]).
#[derive(Debug, Clone)]
pub struct Resolved {
    /// Every device-dependent `"auto"` decided.
    pub config: Config,
    pub recipe: crate::precision::Recipe,
    /// The forwards' precision from the recipe: compute dtype, GEMM engine (resolved for the
    /// device), FP8 projections; no probes (a measuring step adds its own).
    pub precision: model::Precision,
    /// The CUDA GPUs `training.devices` names, rank 0 first (several: a data-parallel run); empty
    /// for `training.devices = 1`, the run's own device.
    pub ranks: Vec<usize>,
}

impl Config {
    /// The config with each device-dependent `"auto"` resolved for `device`: `precision` (bf16 on
    /// CUDA, fp32 elsewhere), `model.kernels` (fused on a GPU, the plain-Burn references on the CPU
    /// backend) and `model.attention` (flash on a GPU, plain on the CPU backend).
    /// `model.gemm = "auto"` is resolved in [`Resolved::precision`].
    pub fn for_device(&self, device: &crate::device::Selected) -> Config {
        use crate::device::Selected;
        use model::{AttentionKind, KernelsKind};
        let mut c = self.clone();
        if c.precision == PrecisionKind::Auto {
            c.precision = match device {
                Selected::Cuda { .. } => PrecisionKind::Bf16,
                Selected::Wgpu | Selected::Cpu => PrecisionKind::Fp32,
            };
        }
        if matches!(device, Selected::Cpu) {
            if c.model.kernels == KernelsKind::Auto {
                c.model.kernels = KernelsKind::Reference;
            }
            if c.model.attention == AttentionKind::Auto {
                c.model.attention = AttentionKind::Plain;
            }
        }
        c.model = c.model.resolved();
        c
    }

    /// The built-in default run.
    pub fn builtin() -> Self {
        Self::from_toml_str(DEFAULT_TOML, &[], "built-in default")
            .expect("the built-in default config is valid")
    }

    /// Reads a config file and applies `key=value` overrides.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config file {}", path.display()))?;
        Self::from_toml_str(&text, overrides, &path.display().to_string())
    }

    /// Parses TOML text (`origin` names it in errors), applies overrides, validates.
    pub fn from_toml_str(text: &str, overrides: &[String], origin: &str) -> Result<Self> {
        let mut value: toml::Table =
            toml::from_str(text).map_err(|e| anyhow!("{origin} is not valid TOML: {e}"))?;
        for ov in overrides {
            apply_override(&mut value, ov)?;
        }
        let de = toml::Value::Table(value);
        let cfg: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner().message().trim().to_string();
            if path == "." || path.is_empty() {
                anyhow!("{origin}: {inner}")
            } else {
                anyhow!("{origin}: key `{path}`: {inner}")
            }
        })?;
        cfg.validate().map_err(|e| anyhow!("{origin}: {e}"))?;
        Ok(cfg)
    }

    /// The config as TOML text (every key, resolved).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("config serialises to TOML")
    }

    /// Checks values that parse but cannot work; errors name the key and what is allowed.
    pub fn validate(&self) -> std::result::Result<(), String> {
        self.model.validate()?;
        let d = &self.data;
        if d.source == TextSource::File && d.path.is_empty() {
            return Err("data.source = \"file\" needs data.path, the text file to train on".into());
        }
        if d.source == TextSource::Shards {
            if d.path.is_empty() {
                return Err("data.source = \"shards\" needs data.path: a directory of token shards (prepare's train_*.bin and val_*.bin), a file or a glob pattern".into());
            }
            if d.val_path.is_empty() && !std::path::Path::new(&d.path).is_dir() {
                return Err("data.source = \"shards\" with data.path a file or pattern needs data.val_path, the validation shards".into());
            }
            if d.tokenizer != TokenizerKind::File {
                return Err("data.source = \"shards\" needs the tokenizer the shards were made with: data.tokenizer = \"file\" and data.tokenizer_path (prepare writes tokenizer.json beside its shards)".into());
            }
        }
        if d.source == TextSource::Embedded && d.embedded_chars < 10_000 {
            return Err(format!(
                "data.embedded_chars must be at least 10000, got {}",
                d.embedded_chars
            ));
        }
        if d.tokenizer == TokenizerKind::File && d.tokenizer_path.is_empty() {
            return Err(
                "data.tokenizer = \"file\" needs data.tokenizer_path, a tokenizer.json".into(),
            );
        }
        if d.tokenizer == TokenizerKind::Bpe && !(260..=1_000_000).contains(&d.bpe_vocab_size) {
            return Err(format!(
                "data.bpe_vocab_size must be between 260 (the 256 bytes plus a few merges) and 1000000, got {}",
                d.bpe_vocab_size
            ));
        }
        if !(d.val_fraction > 0.0 && d.val_fraction < 0.5) {
            return Err(format!(
                "data.val_fraction must be in (0, 0.5), got {}",
                d.val_fraction
            ));
        }
        let o = &self.optimizer;
        if !(o.lr > 0.0 && o.lr.is_finite()) {
            return Err(format!(
                "optimizer.lr must be a positive number, got {}",
                o.lr
            ));
        }
        for (key, b) in [("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(format!("{key} must be in [0, 1), got {b}"));
            }
        }
        if !(o.eps > 0.0) {
            return Err(format!("optimizer.eps must be > 0, got {}", o.eps));
        }
        if !(o.weight_decay >= 0.0) {
            return Err(format!(
                "optimizer.weight_decay must be >= 0, got {}",
                o.weight_decay
            ));
        }
        if !(o.grad_clip >= 0.0) {
            return Err(format!(
                "optimizer.grad_clip must be >= 0 (0 disables clipping), got {}",
                o.grad_clip
            ));
        }
        let s = &self.schedule;
        if !(s.min_lr >= 0.0 && s.min_lr <= o.lr) {
            return Err(format!(
                "schedule.min_lr must be between 0 and optimizer.lr = {}, got {}",
                o.lr, s.min_lr
            ));
        }
        if s.decay_steps != 0 && s.decay_steps <= s.warmup_steps {
            return Err(format!(
                "schedule.decay_steps = {} must be above schedule.warmup_steps = {} (or 0 for training.steps)",
                s.decay_steps, s.warmup_steps
            ));
        }
        let t = &self.training;
        for (key, v) in [
            ("training.steps", t.steps),
            ("training.batch_size", t.batch_size),
            ("training.grad_accum", t.grad_accum),
            ("training.eval_batches", t.eval_batches),
            ("training.log_interval", t.log_interval),
            ("training.keep_checkpoints", t.keep_checkpoints),
        ] {
            if v == 0 {
                return Err(format!("{key} must be at least 1, got 0"));
            }
        }
        t.devices.validate()?;
        self.validate_zero()?;
        if !(t.bucket_mb.is_finite() && t.bucket_mb >= 0.0) {
            return Err(format!(
                "training.bucket_mb must be a size in MB >= 0 (0 averages the gradients after the backward, one tensor at a time), got {}",
                t.bucket_mb
            ));
        }
        if !(t.peak_tflops >= 0.0) {
            return Err(format!(
                "training.peak_tflops must be >= 0 (0 looks it up), got {}",
                t.peak_tflops
            ));
        }
        if self.precision != PrecisionKind::Fp8 && self.fp8 != Fp8Config::default() {
            return Err(format!(
                "the [fp8] section only applies to precision = \"fp8\" (precision is \"{}\"); remove it or set precision = \"fp8\"",
                self.precision
            ));
        }
        let (edge, layers) = (self.fp8.bf16_edge_blocks, self.model.n_layer);
        if 2 * edge >= layers && edge > 0 {
            return Err(format!(
                "fp8.bf16_edge_blocks = {edge} keeps every one of the model's {layers} blocks (model.n_layer) in bf16; at most {} leaves a block in FP8",
                (layers.max(1) - 1) / 2
            ));
        }
        if self.fp8.gather_codes {
            let f = &self.fp8;
            if self.training.zero != 3 {
                return Err(format!(
                    "fp8.gather_codes = true all-gathers ZeRO-3's FP8 weights as FP8 codes; it needs training.zero = 3 (zero is {})",
                    self.training.zero
                ));
            }
            if f.scaling != Fp8ScalingKind::Tile || !f.pow2_scales {
                return Err("fp8.gather_codes = true needs fp8.scaling = \"tile\" with fp8.pow2_scales = true (block scales that are powers of two, which no rank has to agree on); per-tensor or other scales gather the weights in the compute dtype".into());
            }
            if !(f.fprop && f.dgrad) {
                return Err("fp8.gather_codes = true needs fp8.fprop and fp8.dgrad (the weight's two GEMMs in FP8): a weight that a GEMM takes in the compute dtype would lose what its FP8 codes drop".into());
            }
        }
        self.recipe()?;
        Ok(())
    }

    /// `training.zero`: 0, 1, 2 or 3 (whether the run has the GPUs and the mode a stage needs is
    /// [`Config::check_zero`]'s, once the run's world is known).
    fn validate_zero(&self) -> std::result::Result<(), String> {
        match self.training.zero {
            0..=3 => Ok(()),
            z => Err(format!(
                "training.zero must be 0 (every GPU keeps the whole optimizer state), 1 (ZeRO-1: the f32 masters and AdamW \
                 moments sharded across the GPUs), 2 (ZeRO-2: the gradients too; runs of one process per GPU) or 3 (ZeRO-3, \
                 FSDP: the weights too, each block gathered as it runs; runs of one process per GPU), got {z}"
            )),
        }
    }

    /// Whether `training.zero` fits a run of `world` GPUs, in processes of their own
    /// (`processes`) or in threads of one process: ZeRO needs several GPUs, and ZeRO-2 reduces
    /// each gradient onto one rank, which Burn's collectives between threads cannot (they only
    /// all-reduce).
    pub fn check_zero(&self, world: usize, processes: bool) -> std::result::Result<(), String> {
        let z = self.training.zero;
        if z > 0 && world < 2 {
            let how = if z >= 2 {
                "train --nproc-per-node 2"
            } else {
                "train --nproc-per-node 2, or training.devices = 2"
            };
            return Err(format!(
                "training.zero = {z} shards the optimizer state across the GPUs of a data-parallel run, but this run trains on one GPU; \
                 train on several ({how}) or set training.zero = 0"
            ));
        }
        if z >= 2 && !processes {
            return Err(format!(
                "training.zero = {z} (ZeRO-{z}) needs a run of one process per GPU: start it with train --nproc-per-node {world} \
                 (and training.devices = 1); the {world} GPUs of training.devices share gradients through in-process collectives \
                 that only all-reduce, so they take training.zero = 0 or 1"
            ));
        }
        Ok(())
    }

    /// The precision recipe of `precision`, `[loss_scale]` and `[fp8]` (`precision = "auto"` as
    /// bf16); an error names the setting a recipe refuses.
    pub fn recipe(&self) -> std::result::Result<crate::precision::Recipe, String> {
        crate::precision::Recipe::resolve_with_fp8(self.precision, &self.loss_scale, &self.fp8)
    }

    /// What a run on `device` trains with: the config with every device-dependent `"auto"`
    /// decided ([`Config::for_device`]) and checked against what the device can run, and its
    /// precision recipe, built once. Errors name the key and what would work instead.
    pub fn resolve(&self, device: &crate::device::Selected) -> Result<Resolved> {
        let config = self.for_device(device);
        if config.precision != self.precision {
            // "auto" was validated as bf16; the recipe it resolved to may refuse other settings.
            config.validate().map_err(|e| {
                anyhow!(
                    "precision = \"auto\" is \"{}\" on {}: {e}",
                    config.precision,
                    device.describe()
                )
            })?;
        }
        config.check_device(device)?;
        let recipe = config.recipe().map_err(|e| anyhow!(e))?;
        let mut config = config;
        let ranks = if config.training.devices.is_single() {
            Vec::new()
        } else {
            let available = crate::parallel::cuda_device_count()?;
            let ranks = config
                .training
                .devices
                .indices(available)
                .map_err(|e| anyhow!(e))?;
            if ranks.len() > 1 {
                crate::parallel::check_nccl(ranks.len())?;
            }
            // The run's config records the GPUs it trained on ("all" becomes the list).
            if config.training.devices == Devices::All {
                config.training.devices = Devices::List(ranks.clone());
            }
            ranks
        };
        let precision = model::Precision {
            fp8: recipe.fp8_linear(),
            fp8_edge_blocks: config.fp8.bf16_edge_blocks,
            // "auto" is measured when the run starts (`crate::fp8_policy`), which replaces this.
            fp8_compute_paths: match config.fp8.projections.is_auto() {
                true => Vec::new(),
                false => config.fp8.projections.compute_paths(),
            },
            ..model::Precision::new(
                recipe.compute_dtype(),
                gemm_engine(config.model.gemm, device),
            )
        };
        Ok(Resolved {
            config,
            recipe,
            precision,
            ranks,
        })
    }

    /// Settings the device cannot run (the config is resolved for it).
    fn check_device(&self, device: &crate::device::Selected) -> Result<()> {
        use crate::device::Selected;
        if !self.training.devices.is_single() && !matches!(device, Selected::Cuda { .. }) {
            bail!(
                "training.devices = {} names CUDA GPUs (several train through NCCL), but this run is on {}. \
                 Use training.devices = 1 here, or device = \"cuda\"",
                self.training.devices,
                device.describe()
            );
        }
        match device {
            Selected::Cuda { .. } => {}
            Selected::Wgpu => {
                if self.model.gemm == model::GemmKind::Cublaslt {
                    bail!("model.gemm = \"cublaslt\" needs CUDA, but this run is on wgpu. Use model.gemm = \"auto\" or \"burn\" here, or device = \"cuda\"");
                }
                if self.precision == PrecisionKind::Fp8 && self.fp8.compute == Fp8ComputeKind::Bf16
                {
                    bail!(
                        "precision = \"fp8\" computes outside the FP8 GEMMs in bf16, which needs CUDA: wgpu has no bf16 type. \
                         Set fp8.compute = \"f32\" here, or device = \"cuda\""
                    );
                }
                if self.precision == PrecisionKind::Bf16 {
                    bail!(
                        "precision = \"bf16\" needs CUDA: wgpu has no bf16 type. Use precision = \"fp16\" or \"fp32\" here, or device = \"cuda\""
                    );
                }
            }
            Selected::Cpu => {
                if self.precision != PrecisionKind::Fp32 {
                    bail!(
                        "precision = \"{}\" needs a GPU; the CPU backend trains in fp32. Use precision = \"fp32\" here, or device = \"cuda\" / \"wgpu\"",
                        self.precision
                    );
                }
                if self.model.gemm == model::GemmKind::Cublaslt {
                    bail!("model.gemm = \"cublaslt\" needs CUDA, but this run is on the CPU. Use model.gemm = \"auto\" or \"burn\" here");
                }
            }
        }
        let m = &self.model;
        let seeded_masks = m.kernels != model::KernelsKind::Reference
            && m.attention_resolved() == model::AttentionKind::Flash;
        // Selective recomputation runs no dropout again: only a block run a second time needs
        // the masks of its first run.
        if m.recompute == model::RecomputeKind::Full && m.dropout > 0.0 && !seeded_masks {
            bail!(
                "model.recompute = \"{}\" with model.dropout = {} needs the dropout masks the kernels draw from a seed (model.kernels = \"fused\" and model.attention = \"flash\", on a GPU), \
                 so that a block run again draws the masks of its first run; here kernels = \"{}\" and attention = \"{}\". Set model.dropout = 0, or model.recompute = \"none\" or \"selective\"",
                m.recompute,
                m.dropout,
                m.kernels,
                m.attention
            );
        }
        Ok(())
    }

    /// Step at which the cosine decay ends.
    pub fn decay_steps(&self) -> usize {
        if self.schedule.decay_steps == 0 {
            self.training.steps
        } else {
            self.schedule.decay_steps
        }
    }

    /// Tokens consumed by one optimizer step, over every GPU (`training.devices = "all"` counts
    /// as one until [`Config::resolve`] has listed the GPUs).
    pub fn tokens_per_step(&self) -> usize {
        self.tokens_per_step_per_device() * self.training.devices.count().unwrap_or(1)
    }

    /// Tokens one GPU computes per optimizer step.
    pub fn tokens_per_step_per_device(&self) -> usize {
        self.training.batch_size * self.training.grad_accum * self.model.context
    }
}

/// Applies one `section.key=value` override to the TOML tree. The value is read as a TOML value
/// (`3e-4`, `true`, `"gelu"`, `[1, 2]`); anything that is not valid TOML is taken as a string, so
/// `--set model.mlp=gelu` works without quotes.
pub fn apply_override(root: &mut toml::Table, ov: &str) -> Result<()> {
    let (key, raw) = ov.split_once('=').ok_or_else(|| {
        anyhow!("--set {ov:?}: expected key=value, e.g. --set training.steps=100")
    })?;
    let key = key.trim();
    if key.is_empty() {
        bail!("--set {ov:?}: the key is empty");
    }
    let raw = raw.trim();
    let value = match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t.remove("v").expect("parsed key v"),
        Err(_) => toml::Value::String(raw.to_string()),
    };
    let parts: Vec<&str> = key.split('.').collect();
    let mut table = root;
    for part in &parts[..parts.len() - 1] {
        let entry = table
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(Default::default()));
        table = entry
            .as_table_mut()
            .ok_or_else(|| anyhow!("--set {key}: `{part}` is a value, not a section"))?;
    }
    table.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

/// The GEMM engine `gemm` names on `device`: "auto" is cuBLASLt on CUDA where the library loads,
/// Burn's matmul elsewhere (what `kernels::Gemm::Auto` would choose for every tensor).
fn gemm_engine(gemm: model::GemmKind, device: &crate::device::Selected) -> kernels::Gemm {
    use crate::device::Selected;
    match (gemm, device) {
        (model::GemmKind::Burn, _) => kernels::Gemm::Burn,
        (model::GemmKind::Cublaslt, _) => kernels::Gemm::CublasLt,
        (model::GemmKind::Auto, Selected::Cuda { .. }) => match kernels::gemm::cublaslt_status() {
            Ok(_) => kernels::Gemm::CublasLt,
            Err(_) => kernels::Gemm::Burn,
        },
        (model::GemmKind::Auto, Selected::Wgpu | Selected::Cpu) => kernels::Gemm::Burn,
    }
}
