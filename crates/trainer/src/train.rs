//! The training loop, generic over the autodiff backend.
//!
//! [`train`] is the loop: [`Session::open`] sets the run up (or resumes it), then
//! [`Session::run_steps`] queues every step (every rank's part of it, `crate::step`), reads its
//! statistics at once or one step late and applies the loss scaler's verdict ([`read_back`]), and
//! finishes it with [`Session::finish_step`] (evaluation, metrics, log lines, checkpoint);
//! [`Session::close`] writes the summary. One device and several train through the
//! same step: one device is a data-parallel group of one (`crate::parallel::group`).

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use burn::module::AutodiffModule;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use model::Gpt;
use serde::Serialize;

mod capture;
mod gemm_algorithms;
mod log;
mod read_back;
mod start;

use self::log::{human, progress_bar, zero_line, Console, Logger};
use self::start::{check_memory, load_data, resume};
use crate::checkpoint;
use crate::config::{Config, Resolved};
use crate::data::Dataset;
use crate::fsutil::write_atomic;
use crate::metrics::{LayerHealth, Metrics, StepRecord};
use crate::numerics;
use crate::optim::AdamW;
use crate::parallel::fsdp::RowShards;
use crate::parallel::group::Group;
use crate::parallel::process::Membership;
use crate::precision::{LossScaler, Recipe};
use crate::step::{copied_weights, StepCtx};
use kernels::collective::ProcessGroup;

/// What the caller chose besides the config.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Run directory: config, tokenizer, metrics, plot, checkpoints.
    pub run_dir: PathBuf,
    /// Continue from the newest checkpoint in `run_dir`.
    pub resume: bool,
    /// Human-readable device, for the log and summary.
    pub device_name: String,
    /// Peak TFLOP/s for MFU, if known.
    pub peak_tflops: Option<f64>,
    /// Print log lines (tests turn this off).
    pub verbose: bool,
    /// Stop after this many completed steps (with a checkpoint) although the schedule runs to
    /// `training.steps`; `--resume` continues from there. `None` runs to the end.
    pub stop_at: Option<u64>,
    /// Fault injection: after the backward of these steps (1-based), one parameter's gradient is
    /// overwritten with inf/NaN, as an overflowing FP16 backward would. Empty for normal runs.
    pub poison_steps: Vec<u64>,
    /// A run of one process per GPU: this process's place in it (from torchrun's or SLURM's
    /// variables, which `train --nproc-per-node` sets for the processes it starts); `None` for a
    /// run of one process.
    pub place: Option<crate::parallel::place::Place>,
}

/// What a finished run reports (also written to `summary.json`).
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// Steps completed when this session ended.
    pub steps: u64,
    pub final_loss: f64,
    pub best_val_loss: Option<f64>,
    pub final_val_loss: Option<f64>,
    /// Training wall time, evaluations and checkpoints included, over all sessions of the run.
    pub wall_s: f64,
    /// Median tokens/s over this session's steps (the first few excluded as warm-up).
    pub median_tokens_per_s: f64,
    /// Duration of this session's first step, which includes compiling (and on CUDA autotuning)
    /// every kernel the step uses unless they were cached by an earlier run.
    pub first_step_s: f64,
    pub params: usize,
    pub device: String,
    pub resumed_from: Option<u64>,
    /// The resolved precision recipe.
    pub precision: Recipe,
    /// Steps skipped because their gradients overflowed, over the whole run.
    pub skipped_steps: u64,
    /// Loss scale after the last step (1 without loss scaling).
    pub final_loss_scale: f64,
    /// Largest memory the device's pools held at the end of a step of this session (bytes), where
    /// the backend says.
    pub peak_memory_reserved: Option<u64>,
    /// Steps of this session whose statistics were read one step late, while the next step was
    /// already queued (`training.read_back_late`).
    pub steps_read_late: u64,
    /// Under ZeRO-3 (a run of processes): the bytes this rank's all-gathers of weights received
    /// in the session's last step (evaluation's excluded).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gathered_bytes_per_step: Option<u64>,
    /// How often the Hopper attention kernels ran while this session trained and evaluated
    /// (CUDA on a compute capability 9.0 GPU); `None` where none ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hopper_attention: Option<HopperAttention>,
}

/// The Hopper attention kernels' calls of a session (`kernels::attention::HopperCalls`), counted
/// over the process: with a thread per GPU, over every rank's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct HopperAttention {
    /// Forwards in 16 bits.
    pub forward: usize,
    /// Forwards in FP8 (`fp8.attention`).
    pub forward_fp8: usize,
    pub backward: usize,
    /// Calls the Hopper kernels applied to but could not run (the CubeCL kernels ran them; a
    /// warning said why).
    pub refused: usize,
}

impl HopperAttention {
    /// The calls since `start`, or `None` if there were none.
    fn since(start: kernels::attention::HopperCalls) -> Option<Self> {
        let c = kernels::attention::hopper_calls().since(start);
        (!c.is_empty()).then_some(HopperAttention {
            forward: c.forward,
            forward_fp8: c.forward_fp8,
            backward: c.backward,
            refused: c.refused,
        })
    }
}

impl std::fmt::Display for HopperAttention {
    /// `Hopper attention: 48 forwards (24 in FP8), 24 backwards[, 2 refused]`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Hopper attention: {} forwards ({} in FP8), {} backwards",
            self.forward + self.forward_fp8,
            self.forward_fp8,
            self.backward
        )?;
        if self.refused > 0 {
            write!(f, ", {} refused", self.refused)?;
        }
        Ok(())
    }
}

/// Rank 0's FP8 amax histories for delayed scaling (`fp8.amax_history` with an FP8 recipe), holding
/// `restored`'s where the run resumes: a resumed run scales as the uninterrupted one would have
/// (the other ranks of a data-parallel run start theirs again).
fn rank0_fp8_history(
    cfg: &Config,
    fp8_linear: Option<kernels::Fp8LinearConfig>,
    restored: Option<&checkpoint::AmaxHistoryRecord>,
) -> Option<kernels::Fp8AmaxHistory> {
    let history = fp8_linear.and_then(|_| cfg.fp8.amax_history())?;
    if let Some(record) = restored {
        history.restore(&record.into());
    }
    Some(history)
}

/// Trains as configured. Writes `config.toml`, `tokenizer.json`, `metrics.jsonl`, `loss.svg`,
/// `checkpoints/` and `summary.json` into the run directory.
pub fn train<B: crate::TrainBackend>(
    run: &Resolved,
    device: B::Device,
    opts: &RunOptions,
) -> Result<Summary> {
    train_on::<B>(run, vec![(device, 0)], opts)
}

/// [`train`] on several devices, one replica each (data parallelism; `devices` pairs each device
/// with its CUDA index, for messages). One device trains as [`train`] does.
pub fn train_on<B: crate::TrainBackend>(
    run: &Resolved,
    devices: Vec<(B::Device, usize)>,
    opts: &RunOptions,
) -> Result<Summary> {
    train_members::<B>(run, devices, None, opts)
}

/// [`train`] as one rank of a run of one process per GPU, joined by `membership`: the same step
/// as every other rank's, on this rank's rows of each global batch, the gradients averaged
/// through NCCL. Rank 0 writes the run's files and prints its progress; the other ranks write
/// nothing and print only errors. Tells the other ranks when it finished.
pub fn train_process<B: crate::TrainBackend>(
    run: &Resolved,
    device: (B::Device, usize),
    membership: Membership,
    opts: &RunOptions,
) -> Result<Summary> {
    let gpu = device.0.clone();
    let summary = train_members::<B>(run, vec![device], Some(membership.group.clone()), opts)?;
    B::sync(&gpu).map_err(|e| anyhow::anyhow!("the GPU's last work failed: {e:?}"))?;
    membership.finish();
    Ok(summary)
}

/// [`train_on`], or with `process` one rank of a run of processes ([`train_process`]).
fn train_members<B: crate::TrainBackend>(
    run: &Resolved,
    devices: Vec<(B::Device, usize)>,
    process: Option<ProcessGroup>,
    opts: &RunOptions,
) -> Result<Summary> {
    // Every device's queue is drained on the way out (declared first, dropped last).
    let _drains: Vec<_> = devices
        .iter()
        .map(|(d, _)| crate::DrainOnDrop::<B>(d.clone()))
        .collect();
    // `fp8.projections = "auto"` is timed on rank 0's device (on every process's own, in a run of
    // several processes) before anything else is built.
    let console = Console {
        bar: None,
        verbose: opts.verbose,
    };
    let timed = crate::fp8_policy::resolve::<B>(run, &devices[0].0, process.as_ref(), &|s| {
        console.line(s)
    })?;
    let run = timed.as_ref().unwrap_or(run);
    let (mut session, model) = Session::<B>::open(run, devices, process, opts)?;
    let end = opts.stop_at.map_or(session.steps, |s| s.min(session.steps));
    session.run_steps(model, end)?;
    session.close()
}

/// A run being trained: what it trains on and with, and how far it got. The model itself is
/// passed in and out of each step, which consumes it (the optimizer updates it in place).
struct Session<'a, B: crate::TrainBackend> {
    cfg: &'a Config,
    opts: &'a RunOptions,
    /// The devices it trains on, rank 0's first (one device is a group of one); the session's
    /// model and optimizer are rank 0's.
    group: Group<B>,
    /// Shared with the other ranks' threads in a data-parallel run.
    data: Arc<Dataset>,
    vocab: usize,
    opt: AdamW<B::InnerBackend>,
    scaler: LossScaler,
    recipe: Recipe,
    compute_dtype: FloatDType,
    /// The GEMM engine, resolved for the device.
    gemm: kernels::Gemm,
    fp8_linear: Option<kernels::Fp8LinearConfig>,
    /// Rank 0's FP8 amax histories (`fp8.amax_history`; each other rank holds its own).
    fp8_history: Option<kernels::Fp8AmaxHistory>,
    log: Logger,
    /// `training.steps`: where the schedule ends.
    steps: u64,
    /// The first step of this session (the checkpoint's step when resuming).
    start_step: u64,
    progress: Progress,
    /// When the last step's statistics were read ([`read_back`]).
    last_read_back: Option<Instant>,
}

/// How far the run got; the checkpoint carries the best validation loss and the wall time of
/// earlier sessions over a resume.
struct Progress {
    completed: u64,
    best_val: Option<f64>,
    last_val: Option<f64>,
    last_loss: f64,
    resumed_from: Option<u64>,
    elapsed_before: f64,
    session_start: Instant,
    /// The Hopper attention kernels' calls when this session started.
    hopper_at_start: kernels::attention::HopperCalls,
    first_step_s: f64,
    /// Tokens/s of this session's steps after the first three.
    tok_rates: Vec<f64>,
    /// Steps of this session read one step late ([`read_back`]).
    read_late: u64,
    peak_memory: Option<u64>,
    /// Bytes this rank's all-gathers received while the last step was queued (a run of
    /// processes).
    gathered_last_step: Option<u64>,
}

impl Progress {
    /// A session that starts now, with nothing done yet.
    fn new() -> Self {
        Progress {
            completed: 0,
            best_val: None,
            last_val: None,
            last_loss: f64::NAN,
            resumed_from: None,
            elapsed_before: 0.0,
            session_start: Instant::now(),
            hopper_at_start: kernels::attention::hopper_calls(),
            first_step_s: f64::NAN,
            tok_rates: Vec::new(),
            read_late: 0,
            peak_memory: None,
            gathered_last_step: None,
        }
    }
}

/// What one step did, for the bookkeeping after it.
struct StepOutcome {
    /// Some rank was asked to stop (SIGINT, SIGTERM): the run ends after this step, with its
    /// checkpoint.
    stop: bool,
    loss: f64,
    /// Unscaled (`NaN` or inf when the gradients overflowed).
    grad_norm: f64,
    lr: f64,
    scale: f64,
    skipped: bool,
    seconds: f64,
    /// Of which the host spent queuing the step's work.
    host_seconds: f64,
    memory_reserved: Option<u64>,
    /// Every rank's reserved memory, rank 0 first (logged for a data-parallel run).
    memory_per_rank: Vec<Option<u64>>,
    /// fp16/bf16 numerics steps: the gradients' numerics.
    numerics: Option<Vec<LayerHealth>>,
    /// FP8 health steps: what the projections recorded while quantizing.
    fp8_probe: Option<kernels::ProbeSink>,
}

impl<'a, B: crate::TrainBackend> Session<'a, B> {
    /// Sets the run up: data and tokenizer, model and optimizer from the seed, then the newest
    /// checkpoint when resuming. Writes `config.toml` and `precision.json` once the checkpoint (if
    /// any) has been accepted, so a refused `--set` never replaces the run's config.
    fn open(
        run: &'a Resolved,
        devices: Vec<(B::Device, usize)>,
        process: Option<ProcessGroup>,
        opts: &'a RunOptions,
    ) -> Result<(Self, Gpt<B>)> {
        let device = devices[0].0.clone();
        let cfg = &run.config;
        let run_dir = &opts.run_dir;
        // Rank 0 of a run of processes writes the run's files and prints; the others read them.
        let writes = process.as_ref().is_none_or(|p| p.rank() == 0);
        let existing = checkpoint::list(run_dir)?;
        if !opts.resume && !existing.is_empty() {
            bail!(
                "{} already holds checkpoints of a run; continue it with --resume {0} or choose another --out",
                run_dir.display()
            );
        }
        let console = Console {
            bar: None,
            verbose: opts.verbose && writes,
        };
        let (data, vocab) = load_data(cfg, opts, writes, &console)?;
        let recipe = run.recipe.clone();
        let compute_dtype = recipe.compute_dtype();
        check_memory(cfg, opts, vocab, compute_dtype, &devices, &console)?;

        B::seed(&device, cfg.seed);
        let model = Gpt::<B>::new(&cfg.model, vocab, &device);
        let model = match (cfg.model.init_from.as_str(), opts.resume) {
            ("", _) | (_, true) => model,
            (dir, false) => {
                let model = crate::interop::init_from(model, std::path::Path::new(dir))?;
                console.line(&format!("weights read from {dir} (model.init_from)"));
                model
            }
        };
        // ZeRO-3 keeps each rank's rows from here on: a checkpoint's rows are read into the cut
        // model, so that no whole state but the freshly built f32 weights is ever on the GPU.
        let row_split = match (&process, cfg.training.zero) {
            (Some(p), 3) => Some(Arc::new(row_split(&model, p, cfg, &recipe, run))),
            _ => None,
        };
        let model = match &row_split {
            Some(rows) => rows.shard(model),
            None => model,
        };
        let mut opt =
            AdamW::<B::InnerBackend>::new(cfg.optimizer.clone(), no_decay_ids(&model, cfg));
        if cfg.model.kernels == model::config::KernelsKind::Fused {
            // The fused step also writes the next step's compute copy of the cast weights.
            opt = opt.with_fused(copied_weights(&model, compute_dtype));
        }
        let mut scaler = LossScaler::new(recipe.loss_scaling().clone());
        let mut progress = Progress::new();
        let mut restored_history = None;
        let (model, start_step) = if opts.resume {
            let into = (model, row_split.as_deref());
            let (model, restored) =
                resume::<B>(opts, &existing, into, &mut opt, cfg, vocab, &console)?;
            if let Some(line) = gemm_algorithms::read(run_dir) {
                console.line(&line);
            }
            if let Some(state) = restored.loss_scaler {
                if let Some(note) = scaler.restore(state, restored.precision.as_ref()) {
                    console.line(&note);
                }
            }
            progress.best_val = restored.best_val_loss;
            progress.elapsed_before = restored.elapsed_s;
            progress.resumed_from = Some(restored.step);
            restored_history = restored.fp8_amax_history;
            (model, restored.step)
        } else {
            (model, 0)
        };
        progress.completed = start_step;
        let metrics = if writes {
            write_atomic(&run_dir.join("config.toml"), cfg.to_toml().as_bytes())?;
            write_atomic(
                &run_dir.join("precision.json"),
                serde_json::to_string_pretty(&recipe)?.as_bytes(),
            )?;
            Some(Metrics::open(run_dir, opts.resume.then_some(start_step))?)
        } else {
            None
        };
        let plot_title = format!(
            "{} ({})",
            run_dir
                .file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_default(),
            opts.device_name
        );
        // Data parallelism: the other ranks start as copies of rank 0 (fresh or resumed), each
        // in its own thread.
        let data = Arc::new(data);
        let fp8_linear = recipe.fp8_linear();
        let fp8_history = rank0_fp8_history(cfg, fp8_linear, restored_history.as_ref());
        let ctx = StepCtx {
            cfg,
            data: &data,
            compute_dtype,
            gemm: run.precision.gemm,
            fp8_linear,
            fp8_history: None,
        };
        let (group, model) = match process {
            Some(p) => Group::start_process(device, p, &ctx, &mut opt, (model, row_split)),
            None => Group::start(devices, &ctx, &mut opt, model),
        };
        let mut session = Session {
            cfg,
            opts,
            group,
            data,
            vocab,
            opt,
            scaler,
            fp8_linear,
            fp8_history,
            recipe,
            compute_dtype,
            gemm: run.precision.gemm,
            log: Logger {
                console,
                metrics,
                run_dir: run_dir.clone(),
                plot_title,
            },
            steps: cfg.training.steps as u64,
            start_step,
            progress,
            last_read_back: None,
        };
        session.describe();
        if writes {
            session.log.console.bar = progress_bar(opts, session.steps, start_step);
        }
        Ok((session, model))
    }

    /// The set-up lines of the log: the model, the recipe and the GEMM paths.
    fn describe(&self) {
        let (cfg, console) = (self.cfg, &self.log.console);
        console.line(&format!(
            "model: {} parameters ({} layers, {} heads{}, width {}, context {}, {:?} MLP; {:?} kernels, {:?} attention); {} tokens/step; device {}",
            human(cfg.model.num_params(self.vocab) as f64),
            cfg.model.n_layer,
            cfg.model.n_head,
            if cfg.model.kv_heads() < cfg.model.n_head {
                format!(" over {} key/value heads", cfg.model.kv_heads())
            } else {
                String::new()
            },
            cfg.model.d_model,
            cfg.model.context,
            cfg.model.mlp,
            cfg.model.kernels,
            cfg.model.attention,
            cfg.tokens_per_step_per_device() * self.group.size(),
            self.opts.device_name
        ));
        console.line(&format!("precision: {}", self.recipe.describe()));
        if let Some(p) = self.group.process() {
            console.line(&format!(
                "data parallel: {} processes, one GPU each (this is rank {}); every step each computes {} tokens ({} sequences x {} micro-batches), gradients averaged through NCCL",
                p.world(),
                p.rank(),
                cfg.tokens_per_step_per_device(),
                cfg.training.batch_size,
                cfg.training.grad_accum
            ));
            let zero = self.group.zero_split().map_or(0, |(shard, _)| shard.stage);
            console.line(&crate::parallel::overlap::describe(cfg, zero));
            if let Some((shard, split)) = self.group.zero_split() {
                let ranks = (0..p.world()).map(|r| format!("rank {r}"));
                console.line(&zero_line(shard, split, ranks));
            }
        }
        if let Some(r) = self.group.data_parallel() {
            console.line(&format!(
                "data parallel: {} GPUs (CUDA {}), one replica each; every step each computes {} tokens ({} sequences x {} micro-batches), gradients averaged through NCCL",
                r.gpus.len(),
                r.gpus
                    .iter()
                    .map(|g| g.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                cfg.tokens_per_step_per_device(),
                cfg.training.batch_size,
                cfg.training.grad_accum
            ));
            if let Some((shard, split)) = &r.zero {
                let gpus = r.gpus.iter().map(|g| format!("GPU {g}"));
                console.line(&zero_line(shard, split, gpus));
            }
        }
        let probe = Tensor::<B, 2>::zeros(
            [1, 1],
            (
                &self.group.device,
                burn::tensor::DType::from(self.compute_dtype),
            ),
        );
        console.line(&format!(
            "GEMMs: {} (model.gemm = \"{}\")",
            kernels::gemm::gemm_path(&probe, cfg.model.gemm.engine()),
            cfg.model.gemm
        ));
        if let Recipe::Fp8(_) = &self.recipe {
            console.line(&format!(
                "FP8 GEMMs: {}",
                fp8_gemm_path_name::<B>(&self.group.device)
            ));
        }
        if self.start_step >= self.steps {
            console.line(&format!(
                "nothing to do: the run already has {} of {} steps",
                self.start_step, self.steps
            ));
        }
    }

    /// Why the run stops at `step` (the loss scaler said so).
    fn stop_message(&self, step: u64, loss: f64, grad_norm: f64, why: &str) -> String {
        if !self.scaler.setting.is_off() {
            return format!("{why}; no checkpoint was written for step {}", step + 1);
        }
        let hint = if matches!(self.recipe, Recipe::Fp16(_)) {
            "; FP16 without loss scaling overflows easily: set loss_scale.mode = \"dynamic\""
        } else {
            ""
        };
        format!(
            "training diverged at step {}: loss {loss}, gradient norm {grad_norm} ({why}); no checkpoint was written for it. \
             Lower optimizer.lr or check the data{hint}",
            step + 1
        )
    }

    /// After step `step` (0-based) of a session ending at `end`: evaluation, metrics, log lines,
    /// plot, checkpoint and progress bar. Returns whether the run was asked to stop here (it
    /// then has this step's checkpoint).
    fn finish_step(&mut self, model: &Gpt<B>, step: u64, end: u64, o: StepOutcome) -> Result<bool> {
        let stop = o.stop;
        let cfg = self.cfg;
        let done = step + 1;
        let p = &mut self.progress;
        if step == self.start_step {
            p.first_step_s = o.seconds;
        }
        p.peak_memory = p.peak_memory.max(o.memory_reserved);
        let tps = (cfg.tokens_per_step_per_device() * self.group.size()) as f64 / o.seconds;
        if step >= self.start_step + 3 {
            p.tok_rates.push(tps);
        }
        let gpus = self.group.size() as f64;
        let mfu = self
            .opts
            .peak_tflops
            .map(|peak| cfg.model.flops_per_token(self.vocab) * tps / (gpus * peak * 1e12));
        p.last_loss = o.loss;
        p.completed = done;

        let eval_now = self.evaluates_at(done);
        // The recipe's precision, without the step's probes.
        let precision = model::Precision {
            fp8: self.fp8_linear,
            fp8_edge_blocks: cfg.fp8.bf16_edge_blocks,
            fp8_compute_paths: cfg.fp8.projections.compute_paths(),
            fp8_history: self.fp8_history.clone(),
            ..model::Precision::new(self.compute_dtype, self.gemm)
        };
        let val_loss = eval_now.then(|| {
            let gathers = self.group.zero().and_then(|z| z.plain_gathers());
            evaluate(
                &model.compute_copy(self.compute_dtype),
                &precision,
                &self.data,
                cfg,
                gathers.as_ref().map(|g| g as &dyn model::BlockHook<_>),
            )
        });
        if let Some(v) = val_loss {
            let p = &mut self.progress;
            p.best_val = Some(p.best_val.map_or(v, |b: f64| b.min(v)));
            p.last_val = Some(v);
        }
        let fp8 = match (&o.fp8_probe, self.fp8_linear) {
            (Some(probe), Some(_)) => Some(numerics::fp8_health(
                model,
                self.compute_dtype,
                &precision,
                probe,
            )),
            _ => None,
        };
        let record = StepRecord {
            step: done,
            loss: o.loss,
            lr: o.lr,
            grad_norm: o.grad_norm,
            precision: self.recipe.kind().to_string(),
            loss_scale: o.scale,
            skipped: o.skipped,
            overflows: self.scaler.state.overflows,
            tokens_per_s: tps,
            step_ms: o.seconds * 1e3,
            host_ms: o.host_seconds * 1e3,
            mfu,
            val_loss,
            fp8,
            numerics: o.numerics,
            memory_reserved: o.memory_reserved,
        };
        let log_line = done.is_multiple_of(cfg.training.log_interval as u64)
            || done == self.steps
            || done == self.start_step + 1;
        self.log.step(
            &record,
            self.steps,
            log_line,
            &self.scaler,
            self.progress.best_val,
        )?;
        if log_line {
            self.log_memory(done, &o.memory_per_rank);
        }
        if done == self.start_step + 1 {
            if let Some(line) = gemm_algorithms::timed_line() {
                self.log.line(&line);
            }
            if self.group.writes() {
                gemm_algorithms::write(&self.opts.run_dir)?;
            }
        }

        let ckpt_now = stop || self.checkpoints_at(done, end);
        if ckpt_now {
            self.checkpoint(model, done)?;
        }
        if let Some(b) = &self.log.console.bar {
            b.set_position(done);
            b.set_message(format!("loss {:.4}", o.loss));
        }
        Ok(stop)
    }

    /// Whether the run evaluates after `done` steps: every `training.eval_interval` and at the
    /// last step.
    fn evaluates_at(&self, done: u64) -> bool {
        let every = self.cfg.training.eval_interval as u64;
        done == self.steps || (every > 0 && done.is_multiple_of(every))
    }

    /// Whether the run writes a checkpoint after `done` steps of a session ending at `end`: every
    /// `training.checkpoint_interval`, at the last step and at the session's end (and when asked to
    /// stop).
    fn checkpoints_at(&self, done: u64, end: u64) -> bool {
        let every = self.cfg.training.checkpoint_interval as u64;
        done == self.steps || done == end || (every > 0 && done.is_multiple_of(every))
    }

    /// A data-parallel run's log line of every GPU's reserved memory (rank 0 first).
    fn log_memory(&self, done: u64, memory: &[Option<u64>]) {
        let Some(r) = self.group.data_parallel() else {
            return;
        };
        let per_gpu: Vec<String> = r
            .gpus
            .iter()
            .zip(memory)
            .map(|(g, m)| match m {
                Some(b) => format!("GPU {g} {:.2} GiB", *b as f64 / (1u64 << 30) as f64),
                None => format!("GPU {g} -"),
            })
            .collect();
        self.log.line(&format!(
            "memory {done:>5}/{} | reserved: {}",
            self.steps,
            per_gpu.join(", ")
        ));
    }

    /// Writes the checkpoint of step `done`; in a data-parallel run, with every rank's weights
    /// checksum, and an error (after writing the checkpoint) when the replicas differ. A run of
    /// processes under ZeRO writes a sharded checkpoint: every rank its share.
    fn checkpoint(&self, model: &Gpt<B>, done: u64) -> Result<()> {
        let cfg = self.cfg;
        let checksums = self.group.checksums(model, &self.opt);
        let p = &self.progress;
        let history = self.fp8_history.as_ref().map(|h| h.state().into());
        let info = checkpoint::SaveInfo {
            cfg,
            vocab_size: self.vocab,
            step: done,
            best_val_loss: p.best_val,
            elapsed_s: p.elapsed_before + p.session_start.elapsed().as_secs_f64(),
            precision: (&self.recipe, &self.scaler.state),
            replica_checksums: &checksums,
            world: self.group.size(),
            fp8_amax_history: history.as_ref(),
        };
        let keep = cfg.training.keep_checkpoints;
        // A run of processes under ZeRO: every rank writes its share.
        let shard = self.group.zero().filter(|_| self.group.process().is_some());
        let sharded = shard.is_some();
        if let Some(shard) = shard {
            self.save_shards(model, shard, &info)?;
        } else if self.group.writes() {
            // ZeRO between threads: the whole masters and moments, gathered on rank 0.
            let whole = self.group.gather(model, &self.opt);
            let (model, opt) = match &whole {
                Some((m, o)) => (m, o),
                None => (model, &self.opt),
            };
            checkpoint::save::<B, _>(&self.opts.run_dir, model, opt, &info, keep)?;
        }
        if self.group.writes() {
            // Problems first met after the first step (an evaluation's) join the record.
            gemm_algorithms::write(&self.opts.run_dir)?;
        }
        // Rank 0 stops the run if the replicas differ (and the others then end with it).
        if let Some(r) = checksums
            .iter()
            .position(|c| *c != checksums[0])
            .filter(|_| self.group.writes())
        {
            let gpu = self
                .group
                .data_parallel()
                .map_or(String::new(), |x| format!(" (CUDA GPU {})", x.gpus[r]));
            let holds = if sharded {
                "each shard of the checkpoint holds its rank's share of the weights"
            } else {
                "the checkpoint holds rank 0's weights"
            };
            bail!(
                "the replicas diverged: after step {done} the weights of rank {r}{gpu} differ from rank 0's \
                 (CRC-32 {:08x} against {:08x}); {holds}",
                checksums[r],
                checksums[0]
            );
        }
        Ok(())
    }

    /// A run of processes under ZeRO: every rank writes its shard of the checkpoint; once all
    /// have (they say so through one all-reduce), rank 0 writes the manifest that completes it.
    fn save_shards(
        &self,
        model: &Gpt<B>,
        shard: &crate::parallel::zero::Shard,
        info: &checkpoint::SaveInfo<'_>,
    ) -> Result<()> {
        let (run_dir, step) = (&self.opts.run_dir, info.step);
        let rows = shard.row_shards().map(|r| r.ranges());
        let wrote = checkpoint::shards::save_shard::<B, _>(
            run_dir,
            model,
            &self.opt,
            info,
            &shard.owned(),
            rows.as_ref(),
            shard.rank,
        );
        let failed = self.group.failed_ranks(wrote.is_err());
        wrote?;
        if !failed.is_empty() {
            let ranks: Vec<String> = failed.iter().map(|r| r.to_string()).collect();
            bail!(
                "rank {} could not write its shard of the checkpoint of step {step}; that checkpoint is incomplete \
                 and will not be resumed from (the previous one stays)",
                ranks.join(", ")
            );
        }
        if self.group.writes() {
            let keep = self.cfg.training.keep_checkpoints;
            checkpoint::shards::seal::<B, _>(run_dir, model, step, info.world, keep)?;
        }
        Ok(())
    }

    /// Ends the session: the final plot and `summary.json`.
    fn close(self) -> Result<Summary> {
        if let Some(b) = &self.log.console.bar {
            b.finish_and_clear();
        }
        if let Some(m) = &self.log.metrics {
            m.plot(&self.log.run_dir, &self.log.plot_title)?;
        }
        let mut p = self.progress;
        p.tok_rates
            .sort_by(|a, b| a.partial_cmp(b).expect("finite rates"));
        let summary = Summary {
            steps: p.completed,
            final_loss: p.last_loss,
            best_val_loss: p.best_val,
            final_val_loss: p.last_val,
            wall_s: p.elapsed_before + p.session_start.elapsed().as_secs_f64(),
            median_tokens_per_s: p
                .tok_rates
                .get(p.tok_rates.len() / 2)
                .copied()
                .unwrap_or(f64::NAN),
            first_step_s: p.first_step_s,
            params: self.cfg.model.num_params(self.vocab),
            device: self.opts.device_name.clone(),
            resumed_from: p.resumed_from,
            precision: self.recipe.clone(),
            skipped_steps: self.scaler.state.overflows,
            final_loss_scale: self.scaler.scale(),
            peak_memory_reserved: p.peak_memory,
            steps_read_late: p.read_late,
            gathered_bytes_per_step: p.gathered_last_step,
            hopper_attention: HopperAttention::since(p.hopper_at_start),
        };
        if self.group.writes() {
            write_atomic(
                &self.opts.run_dir.join("summary.json"),
                serde_json::to_string_pretty(&summary)?.as_bytes(),
            )?;
        }
        Ok(summary)
    }
}

/// How ZeRO-3 splits `model`'s rows for rank `p`: with `fp8.gather_codes`, the weights of the
/// projections that compute in FP8 with block scales are gathered as FP8 codes
/// (`parallel::fsdp::fp8_wire`).
fn row_split<B: Backend>(
    model: &Gpt<B>,
    p: &ProcessGroup,
    cfg: &Config,
    recipe: &Recipe,
    run: &Resolved,
) -> RowShards {
    let precision = model::Precision {
        fp8: recipe.fp8_linear(),
        fp8_edge_blocks: cfg.fp8.bf16_edge_blocks,
        fp8_compute_paths: cfg.fp8.projections.compute_paths(),
        ..model::Precision::new(recipe.compute_dtype(), run.precision.gemm)
    };
    let wire = match cfg.fp8.gather_codes {
        true => crate::parallel::fsdp::fp8_wire(model, &precision),
        false => Default::default(),
    };
    RowShards::new(model, p.rank(), p.world()).with_fp8_wire(wire)
}

/// Mean validation loss over `training.eval_batches` fixed batches, without autodiff. Under
/// ZeRO-3 `gathers` gathers each block (and the parameters outside the blocks) as it runs.
pub fn evaluate<B: crate::TrainBackend>(
    model: &Gpt<B>,
    precision: &model::Precision,
    data: &Dataset,
    cfg: &Config,
    gathers: Option<&dyn model::BlockHook<B::InnerBackend>>,
) -> f64 {
    let m = model.valid();
    let inner_device = m.wte.weight.val().device();
    let mut total: Option<Tensor<B::InnerBackend, 1>> = None;
    for i in 0..cfg.training.eval_batches {
        let (x, y) = data.val_batch::<B::InnerBackend>(
            cfg.seed,
            i as u64,
            cfg.training.batch_size,
            cfg.model.context,
            &inner_device,
        );
        // Plain cross-entropy, without the z-loss term, so that runs compare whatever their z_loss.
        let l = match gathers {
            Some(g) => m.forward_loss_hooked_with(x, y, precision, 0.0, g),
            None => m.forward_loss_with(x, y, precision, 0.0),
        };
        total = Some(match total {
            Some(t) => t + l,
            None => l,
        });
    }
    let sum: f64 = total
        .expect("eval_batches >= 1")
        .into_data()
        .convert::<f64>()
        .into_vec::<f64>()
        .expect("f64")[0];
    sum / cfg.training.eval_batches as f64
}

/// Parameter ids that weight decay skips besides vectors: the embedding (and so the tied head)
/// unless `optimizer.decay_embeddings`.
fn no_decay_ids<B: Backend>(model: &Gpt<B>, cfg: &Config) -> HashSet<burn::module::ParamId> {
    let mut s = HashSet::new();
    if !cfg.optimizer.decay_embeddings {
        s.insert(model.wte.weight.id);
    }
    s
}

/// The path the FP8 recipe's GEMMs take on `device` (see `kernels::fp8_gemm_path`), for the log.
fn fp8_gemm_path_name<B: kernels::Backend>(device: &B::Device) -> &'static str {
    use kernels::{Fp8Format, Fp8GemmPath, Fp8Granularity, QuantSpec};
    let probe = burn::tensor::Tensor::<B, 2>::zeros([8, 128], device);
    let quantize = |g| kernels::fp8_quantize(probe.clone(), QuantSpec::new(Fp8Format::E4M3, g));
    let (a, b) = (
        quantize(Fp8Granularity::Tile1x128),
        quantize(Fp8Granularity::Block128),
    );
    match kernels::fp8_gemm_path(&a, &b) {
        Fp8GemmPath::CublasLt => "cuBLASLt, block scales applied by the GEMM (Hopper)",
        Fp8GemmPath::TensorCores => "mma.sync FP8 tensor-core kernel (BURNMIX_FP8_GEMM=mma)",
        Fp8GemmPath::Dequantize => {
            "dequantized to the compute dtype, then the GEMMs above: FP8 products at that dtype's speed"
        }
    }
}
