//! The training loop, generic over the autodiff backend.
//!
//! [`train`] is the loop: [`Session::open`] sets the run up (or resumes it), then every step is
//! [`Session::step`] (forward and backward of the compute copy, loss scaling, the update) and
//! [`Session::finish_step`] (evaluation, metrics, log lines, checkpoint); [`Session::close`]
//! writes the summary.

use std::collections::HashSet;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use model::Gpt;
use serde::Serialize;

mod parallel;

use crate::checkpoint;
use crate::config::{Config, Resolved};
use crate::data::Dataset;
use crate::fsutil::write_atomic;
use crate::metrics::{LayerHealth, Metrics, StepRecord};
use crate::numerics::{self, Probes};
use crate::optim::{accumulate_grads, grads_to_f32, poison_grads, AdamW};
use crate::precision::{LossScaler, Recipe, Verdict};
use crate::rng::SplitMix64;
use crate::schedule::lr_at;

/// The random stream of the dropout masks drawn inside the kernels (stream 3 seeds Burn's).
const KERNEL_DROPOUT_STREAM: u64 = 5;

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
    // Every device's queue is drained on the way out (declared first, dropped last).
    let _drains: Vec<_> = devices
        .iter()
        .map(|(d, _)| crate::DrainOnDrop::<B>(d.clone()))
        .collect();
    let (mut session, mut model) = Session::<B>::open(run, devices, opts)?;
    let end = opts.stop_at.map_or(session.steps, |s| s.min(session.steps));
    for step in session.start_step..end {
        if step == session.start_step && !opts.device_name.starts_with("CPU") {
            session.log.line(&format!(
                "step {}: compiling the GPU kernels at this model's shapes (once per shape)...",
                step + 1
            ));
        }
        let outcome;
        (model, outcome) = session.step(model, step)?;
        session.finish_step(&model, step, end, outcome)?;
    }
    session.close()
}

/// A run being trained: what it trains on and with, and how far it got. The model itself is
/// passed in and out of each step, which consumes it (the optimizer updates it in place).
struct Session<'a, B: crate::TrainBackend> {
    cfg: &'a Config,
    opts: &'a RunOptions,
    device: B::Device,
    /// Shared with the other ranks' threads in a data-parallel run.
    data: std::sync::Arc<Dataset>,
    vocab: usize,
    opt: AdamW<B::InnerBackend>,
    scaler: LossScaler,
    recipe: Recipe,
    compute_dtype: FloatDType,
    /// The GEMM engine, resolved for the device.
    gemm: kernels::Gemm,
    fp8_linear: Option<kernels::Fp8LinearConfig>,
    log: Logger,
    /// `training.steps`: where the schedule ends.
    steps: u64,
    /// The first step of this session (the checkpoint's step when resuming).
    start_step: u64,
    progress: Progress,
    /// A data-parallel run: the other ranks (the session's model and optimizer are rank 0's).
    ranks: Option<parallel::Ranks<B>>,
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
    first_step_s: f64,
    /// Tokens/s of this session's steps after the first three.
    tok_rates: Vec<f64>,
    peak_memory: Option<u64>,
}

/// What one step did, for the bookkeeping after it.
struct StepOutcome {
    loss: f64,
    /// Unscaled (`NaN` or inf when the gradients overflowed).
    grad_norm: f64,
    lr: f64,
    scale: f64,
    skipped: bool,
    seconds: f64,
    memory_reserved: Option<u64>,
    /// A data-parallel run: every rank's reserved memory, rank 0 first (empty otherwise).
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
        opts: &'a RunOptions,
    ) -> Result<(Self, Gpt<B>)> {
        let device = devices[0].0.clone();
        let cfg = &run.config;
        let run_dir = &opts.run_dir;
        let existing = checkpoint::list(run_dir)?;
        if !opts.resume && !existing.is_empty() {
            bail!(
                "{} already holds checkpoints of a run; continue it with --resume {0} or choose another --out",
                run_dir.display()
            );
        }
        let console = Console {
            bar: None,
            verbose: opts.verbose,
        };
        let (data, vocab) = load_data(cfg, opts, &console)?;

        B::seed(&device, cfg.seed);
        let model = Gpt::<B>::new(&cfg.model, vocab, &device);
        let recipe = run.recipe.clone();
        let compute_dtype = recipe.compute_dtype();
        let mut opt =
            AdamW::<B::InnerBackend>::new(cfg.optimizer.clone(), no_decay_ids(&model, cfg));
        if cfg.model.kernels == model::config::KernelsKind::Fused {
            // The fused step also writes the next step's compute copy of the cast weights.
            opt = opt.with_fused(copied_weights(&model, compute_dtype));
        }
        let mut scaler = LossScaler::new(recipe.loss_scaling().clone());
        let mut progress = Progress {
            completed: 0,
            best_val: None,
            last_val: None,
            last_loss: f64::NAN,
            resumed_from: None,
            elapsed_before: 0.0,
            session_start: Instant::now(),
            first_step_s: f64::NAN,
            tok_rates: Vec::new(),
            peak_memory: None,
        };
        let (mut model, start_step) = if opts.resume {
            let (model, restored) =
                resume::<B>(opts, &existing, model, &mut opt, cfg, vocab, &console)?;
            if let Some(state) = restored.loss_scaler {
                if let Some(note) = scaler.restore(state, restored.precision.as_ref()) {
                    console.line(&note);
                }
            }
            progress.best_val = restored.best_val_loss;
            progress.elapsed_before = restored.elapsed_s;
            progress.resumed_from = Some(restored.step);
            (model, restored.step)
        } else {
            (model, 0)
        };
        progress.completed = start_step;
        write_atomic(&run_dir.join("config.toml"), cfg.to_toml().as_bytes())?;
        write_atomic(
            &run_dir.join("precision.json"),
            serde_json::to_string_pretty(&recipe)?.as_bytes(),
        )?;
        let metrics = Metrics::open(run_dir, opts.resume.then_some(start_step))?;
        let plot_title = format!(
            "{} ({})",
            run_dir
                .file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_default(),
            opts.device_name
        );
        let mut session = Session {
            cfg,
            opts,
            device,
            data: std::sync::Arc::new(data),
            vocab,
            opt,
            scaler,
            fp8_linear: recipe.fp8_linear(),
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
            ranks: None,
        };
        // Data parallelism: the other ranks start as copies of rank 0 (fresh or resumed), each
        // in its own thread.
        if devices.len() > 1 {
            let (devices, gpus): (Vec<_>, Vec<_>) = devices.into_iter().unzip();
            let ranks = parallel::Ranks::start(&session, devices, gpus, &model);
            // ZeRO-1: rank 0 takes its share once every other rank has copied the whole state.
            if let Some((shard, _)) = &ranks.zero {
                model = shard.take_share::<B, _>(model, &mut session.opt);
            }
            session.ranks = Some(ranks);
        }
        session.describe();
        session.log.console.bar = progress_bar(opts, session.steps, start_step);
        Ok((session, model))
    }

    /// The set-up lines of the log: the model, the recipe and the GEMM paths.
    fn describe(&self) {
        let (cfg, console) = (self.cfg, &self.log.console);
        console.line(&format!(
            "model: {} parameters ({} layers, {} heads, width {}, context {}, {:?} MLP; {:?} kernels, {:?} attention); {} tokens/step; device {}",
            human(cfg.model.num_params(self.vocab) as f64),
            cfg.model.n_layer,
            cfg.model.n_head,
            cfg.model.d_model,
            cfg.model.context,
            cfg.model.mlp,
            cfg.model.kernels,
            cfg.model.attention,
            cfg.tokens_per_step(),
            self.opts.device_name
        ));
        console.line(&format!("precision: {}", self.recipe.describe()));
        if let Some(r) = &self.ranks {
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
            if let Some((_, split)) = &r.zero {
                console.line(&format!(
                    "ZeRO-1: each GPU keeps the f32 master weights and AdamW moments of its share of the {} parameters ({}); \
                     the other weights it holds only as the compute copy",
                    human(split.total as f64),
                    r.gpus
                        .iter()
                        .zip(&split.owned)
                        .map(|(g, n)| format!("GPU {g} {}", human(*n as f64)))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        }
        let probe = Tensor::<B, 2>::zeros(
            [1, 1],
            (&self.device, burn::tensor::DType::from(self.compute_dtype)),
        );
        console.line(&format!(
            "GEMMs: {} (model.gemm = \"{}\")",
            kernels::gemm::gemm_path(&probe, cfg.model.gemm.engine()),
            cfg.model.gemm
        ));
        if let Recipe::Fp8(_) = &self.recipe {
            console.line(&format!(
                "FP8 GEMMs: {}",
                fp8_gemm_path_name::<B>(&self.device)
            ));
        }
        if self.start_step >= self.steps {
            console.line(&format!(
                "nothing to do: the run already has {} of {} steps",
                self.start_step, self.steps
            ));
        }
    }

    /// One optimizer step: forward and backward of `training.grad_accum` micro-batches on the
    /// compute copy, then the update, unless the loss scaler skips the step or stops the run.
    fn step(&mut self, model: Gpt<B>, step: u64) -> Result<(Gpt<B>, StepOutcome)> {
        let t0 = Instant::now();
        if self.ranks.is_some() {
            return self.step_parallel(model, step);
        }
        let (cfg, accum) = (self.cfg, self.cfg.training.grad_accum);
        let lr = lr_at(cfg, step as usize);
        // Dropout masks depend only on (seed, step), like the batches, so a resumed run repeats
        // them: Burn's dropout draws from the backend's generator, the kernels' from the model's
        // dropout seed.
        B::seed(
            &self.device,
            SplitMix64::for_stream(cfg.seed, 3, step).next_u64(),
        );
        let probes = Probes::for_step(&self.recipe, cfg, step);
        let ctx = self.ctx();
        let mut compute = ctx.compute_copy(&model, &self.opt);
        compute.set_dropout_seed(
            SplitMix64::for_stream(cfg.seed, KERNEL_DROPOUT_STREAM, step).next_u64(),
        );
        let scale = self.scaler.scale();
        let mut micro = MicroBatches {
            loss_sum: None,
            numerics: Vec::new(),
        };
        let rank = Rank::whole(&self.device);
        let mut grads = ctx.backward(&model, &compute, &rank, step, scale, &probes, &mut micro);
        drop(compute);
        let numerics = probes
            .taps
            .is_some()
            .then(|| numerics::read(micro.numerics));
        if self.opts.poison_steps.contains(&(step + 1)) {
            poison_grads::<B, _>(&model, &mut grads);
        }
        let scaled_norm = AdamW::<B::InnerBackend>::grad_norm::<B, _>(&model, &grads);

        // One read-back per step: [mean loss, scaled grad norm]. It tells whether the gradients are
        // finite (a single inf or NaN makes the norm non-finite), and it synchronises, so the
        // timing is real.
        let loss_mean = micro
            .loss_sum
            .expect("at least one micro-batch")
            .div_scalar(accum as f64);
        let stats = Tensor::cat(vec![loss_mean, scaled_norm.clone()], 0);
        // Without loss scaling a non-finite step ends the run and nothing of it is kept (the last
        // checkpoint stays as it was), so the update is queued before the read-back: the GPU runs
        // it while the host waits, instead of idling while the host queues it afterwards. With
        // loss scaling the verdict decides whether the update runs at all.
        let (mut model, mut held) = (model, Some((grads, scaled_norm)));
        if self.scaler.setting.is_off() {
            let (grads, norm) = held.take().expect("not taken yet");
            model = self.opt.step::<B, _>(lr, model, grads, norm, scale);
        }
        let (loss, grad_norm, finite) = read_stats(stats, scale);
        let skipped = match self.scaler.update(finite, step + 1) {
            Verdict::Apply => {
                if let Some((grads, norm)) = held {
                    model = self.opt.step::<B, _>(lr, model, grads, norm, scale);
                }
                false
            }
            Verdict::Skip => true,
            Verdict::Stop(why) => bail!(self.stop_message(step, loss, grad_norm, &why)),
        };
        let outcome = StepOutcome {
            loss,
            grad_norm,
            lr,
            scale,
            skipped,
            seconds: t0.elapsed().as_secs_f64(),
            memory_reserved: B::memory_reserved(&self.device),
            memory_per_rank: Vec::new(),
            numerics,
            fp8_probe: probes.fp8,
        };
        Ok((model, outcome))
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

    /// What the forward and backward of a step read (shared by the ranks of a data-parallel run).
    fn ctx(&self) -> StepCtx<'_> {
        StepCtx {
            cfg: self.cfg,
            data: &self.data,
            compute_dtype: self.compute_dtype,
            gemm: self.gemm,
            fp8_linear: self.fp8_linear,
        }
    }

    /// After step `step` (0-based) of a session ending at `end`: evaluation, metrics, log lines,
    /// plot, checkpoint and progress bar.
    fn finish_step(&mut self, model: &Gpt<B>, step: u64, end: u64, o: StepOutcome) -> Result<()> {
        let cfg = self.cfg;
        let done = step + 1;
        let p = &mut self.progress;
        if step == self.start_step {
            p.first_step_s = o.seconds;
        }
        p.peak_memory = p.peak_memory.max(o.memory_reserved);
        let tps = cfg.tokens_per_step() as f64 / o.seconds;
        if step >= self.start_step + 3 {
            p.tok_rates.push(tps);
        }
        let gpus = self.ranks.as_ref().map_or(1, |r| r.gpus.len()) as f64;
        let mfu = self
            .opts
            .peak_tflops
            .map(|peak| cfg.model.flops_per_token(self.vocab) * tps / (gpus * peak * 1e12));
        p.last_loss = o.loss;
        p.completed = done;

        let is_last = done == self.steps;
        let eval_now = is_last
            || (cfg.training.eval_interval > 0
                && done.is_multiple_of(cfg.training.eval_interval as u64));
        let val_loss = eval_now.then(|| {
            let precision = model::Precision {
                fp8: self.fp8_linear,
                ..model::Precision::new(self.compute_dtype, self.gemm)
            };
            evaluate(
                &model.compute_copy(self.compute_dtype),
                &precision,
                &self.data,
                cfg,
            )
        });
        if let Some(v) = val_loss {
            p.best_val = Some(p.best_val.map_or(v, |b: f64| b.min(v)));
            p.last_val = Some(v);
        }
        let fp8 = match (&o.fp8_probe, &self.fp8_linear) {
            (Some(probe), Some(lin)) => {
                Some(numerics::fp8_health(model, self.compute_dtype, lin, probe))
            }
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
            mfu,
            val_loss,
            fp8,
            numerics: o.numerics,
            memory_reserved: o.memory_reserved,
        };
        let log_line = done.is_multiple_of(cfg.training.log_interval as u64)
            || is_last
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

        let ckpt_now = is_last
            || done == end
            || (cfg.training.checkpoint_interval > 0
                && done.is_multiple_of(cfg.training.checkpoint_interval as u64));
        if ckpt_now {
            self.checkpoint(model, done)?;
        }
        if let Some(b) = &self.log.console.bar {
            b.set_position(done);
            b.set_message(format!("loss {:.4}", o.loss));
        }
        Ok(())
    }

    /// A data-parallel run's log line of every GPU's reserved memory (rank 0 first).
    fn log_memory(&self, done: u64, memory: &[Option<u64>]) {
        let Some(r) = &self.ranks else { return };
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
    /// checksum, and an error (after writing rank 0's) when the replicas differ.
    fn checkpoint(&self, model: &Gpt<B>, done: u64) -> Result<()> {
        let cfg = self.cfg;
        let checksums = self
            .ranks
            .as_ref()
            .map(|r| r.checksums(model, &self.opt))
            .unwrap_or_default();
        // ZeRO-1: the whole masters and moments, gathered on rank 0 for the file.
        let whole = self.ranks.as_ref().and_then(|r| r.gather(model, &self.opt));
        let (model, opt) = match &whole {
            Some((m, o)) => (m, o),
            None => (model, &self.opt),
        };
        let p = &self.progress;
        let elapsed = p.elapsed_before + p.session_start.elapsed().as_secs_f64();
        checkpoint::save::<B, _>(
            &self.opts.run_dir,
            model,
            opt,
            cfg,
            self.vocab,
            done,
            p.best_val,
            elapsed,
            cfg.training.keep_checkpoints,
            (&self.recipe, &self.scaler.state),
            &checksums,
        )?;
        if let Some(r) = checksums.iter().position(|c| *c != checksums[0]) {
            bail!(
                "the replicas diverged: after step {done} the weights of rank {r} (CUDA GPU {}) differ from rank 0's \
                 (CRC-32 {:08x} against {:08x}); the checkpoint holds rank 0's weights",
                self.ranks.as_ref().map_or(0, |x| x.gpus[r]),
                checksums[r],
                checksums[0]
            );
        }
        Ok(())
    }

    /// Ends the session: the final plot and `summary.json`.
    fn close(self) -> Result<Summary> {
        if let Some(b) = &self.log.console.bar {
            b.finish_and_clear();
        }
        self.log
            .metrics
            .plot(&self.log.run_dir, &self.log.plot_title)?;
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
        };
        write_atomic(
            &self.opts.run_dir.join("summary.json"),
            serde_json::to_string_pretty(&summary)?.as_bytes(),
        )?;
        Ok(summary)
    }
}

/// What the forward and backward of a step read: the config, the data and the recipe's dtypes.
/// Shared by the ranks of a data-parallel run, each on its own device.
struct StepCtx<'a> {
    cfg: &'a Config,
    data: &'a Dataset,
    compute_dtype: FloatDType,
    gemm: kernels::Gemm,
    fp8_linear: Option<kernels::Fp8LinearConfig>,
}

/// The device a step's forward and backward run on, and which rank of how many it is (`None`:
/// the run's only device, which reads whole micro-batches).
struct Rank<'a, B: Backend> {
    device: &'a B::Device,
    of: Option<(usize, usize)>,
}

impl<'a, B: Backend> Rank<'a, B> {
    fn whole(device: &'a B::Device) -> Self {
        Rank { device, of: None }
    }
}

impl StepCtx<'_> {
    /// The compute copy (weights cast to the compute dtype once per step; the master itself for
    /// fp32) that runs forward and backward; its gradients arrive under the master's ids. With
    /// the fused optimizer the copies written by the last step are reused (a resumed or first
    /// step, or one after a skipped step with no copies, casts).
    fn compute_copy<B: crate::TrainBackend>(
        &self,
        model: &Gpt<B>,
        opt: &AdamW<B::InnerBackend>,
    ) -> Gpt<B> {
        model.compute_copy_with(self.compute_dtype, &|id| {
            opt.copies.get(&id).map(|c| B::from_inner(c.clone()))
        })
    }

    /// The precision of this step's forwards: the recipe's, with the step's probes.
    fn precision(&self, probes: &Probes) -> model::Precision {
        model::Precision {
            dtype: self.compute_dtype,
            gemm: self.gemm,
            fp8: self.fp8_linear,
            probes: probes.for_model(self.compute_dtype),
        }
    }

    /// Forward and backward of the step's `training.grad_accum` micro-batches: their gradients
    /// under the master's ids. One micro-batch's stay in the dtypes they arrive in; several are
    /// summed in f32 ([`accumulate_grads`], the cast in the same pass); a data-parallel rank's are
    /// f32 for the mean over ranks.
    fn backward<B: crate::TrainBackend>(
        &self,
        model: &Gpt<B>,
        compute: &Gpt<B>,
        rank: &Rank<'_, B>,
        step: u64,
        scale: f64,
        probes: &Probes,
        micro: &mut MicroBatches<B>,
    ) -> GradientsParams {
        let accum = self.cfg.training.grad_accum as u64;
        let mut grads = (0..accum)
            .map(|m| self.micro_batch(compute, rank, step * accum + m, scale, probes, micro))
            .reduce(|sum, g| accumulate_grads::<B, _>(model, sum, g))
            .expect("grad_accum >= 1");
        // The norm and the AdamW kernel read bf16 and f16 gradients themselves (in f32); only the
        // data-parallel mean runs on f32 gradients.
        if rank.of.is_some() {
            grads_to_f32::<B, _>(model, &mut grads);
        }
        grads
    }

    /// Forward and backward of micro-batch `index` on the compute copy: adds its loss to
    /// `micro.loss_sum` and returns its gradients under the master's ids, each in the dtype its
    /// weight computes in (bf16 or f16 for the weights with a low-precision copy, f32 for the
    /// rest). On a numerics step, the first micro-batch's output and weight gradients are
    /// measured into `micro.numerics`. A rank of a data-parallel run reads its rows of the
    /// micro-batch.
    fn micro_batch<B: crate::TrainBackend>(
        &self,
        compute: &Gpt<B>,
        rank: &Rank<'_, B>,
        index: u64,
        scale: f64,
        probes: &Probes,
        micro: &mut MicroBatches<B>,
    ) -> GradientsParams {
        let cfg = self.cfg;
        let batch = cfg.training.batch_size;
        let (x, y) = match rank.of {
            None => {
                self.data
                    .train_batch::<B>(cfg.seed, index, batch, cfg.model.context, rank.device)
            }
            Some((r, ranks)) => self.data.train_batch_rows::<B>(
                cfg.seed,
                index,
                batch * ranks,
                crate::parallel::rows(r, batch),
                cfg.model.context,
                rank.device,
            ),
        };
        let loss = compute.forward_loss_in(x, y, &self.precision(probes));
        model::dtype::debug_assert_dtype(&loss, FloatDType::F32, "loss");
        let l = loss.clone().inner();
        micro.loss_sum = Some(match micro.loss_sum.take() {
            Some(s) => s + l,
            None => l,
        });
        let factor = scale / cfg.training.grad_accum as f64;
        let loss = if factor == 1.0 {
            loss
        } else {
            loss.mul_scalar(factor)
        };
        let raw = loss.backward();
        let measure = probes.taps.is_some() && micro.numerics.is_empty();
        if let Some(taps) = &probes.taps {
            // Taken on every micro-batch, so the sink does not keep later ones' records. The
            // backward made them from the last layer to the first: listed in forward order.
            let recorded = kernels::format_stats::take_records::<B::InnerBackend>(taps);
            if measure {
                for (name, rows, elements) in recorded.into_iter().rev() {
                    let s = numerics::Pending { rows, elements };
                    micro.numerics.push((format!("{name}.grad_output"), s));
                }
            }
        }
        let g = GradientsParams::from_grads(raw, compute);
        if measure {
            for (name, lin) in compute.projections() {
                if let Some(w) = g.get::<B::InnerBackend, 2>(lin.weight.id) {
                    let s = numerics::stats(w, self.compute_dtype);
                    micro.numerics.push((format!("{name}.weight_grad"), s));
                }
            }
        }
        g
    }
}

/// The step's one read-back, [mean loss, scaled gradient norm]: the loss, the true gradient norm,
/// and whether both are finite.
fn read_stats<B: Backend>(stats: Tensor<B, 1>, scale: f64) -> (f64, f64, bool) {
    let stats: Vec<f64> = stats
        .into_data()
        .convert::<f64>()
        .into_vec()
        .expect("f64 stats");
    let (loss, grad_norm) = (stats[0], stats[1] / scale);
    (loss, grad_norm, loss.is_finite() && grad_norm.is_finite())
}

/// What the micro-batches of one step gather: their summed loss and, on a numerics step, the
/// first micro-batch's gradient statistics (still on the device).
struct MicroBatches<B: crate::TrainBackend> {
    loss_sum: Option<Tensor<B::InnerBackend, 1>>,
    numerics: Vec<(String, numerics::Pending<B::InnerBackend>)>,
}

/// The data and tokenizer (a resumed run reuses its saved tokenizer) and the model's vocabulary
/// size. Creates the run directory once the data is usable, so a bad data path leaves no empty
/// run directory behind.
fn load_data(cfg: &Config, opts: &RunOptions, console: &Console) -> Result<(Dataset, usize)> {
    let run_dir = &opts.run_dir;
    let tok_path = run_dir.join("tokenizer.json");
    let t_data = Instant::now();
    let reuse = (opts.resume && tok_path.exists()).then_some(tok_path.as_path());
    let data = Dataset::build(cfg, reuse)?;
    std::fs::create_dir_all(run_dir)
        .with_context(|| format!("cannot create run directory {}", run_dir.display()))?;
    if reuse.is_none() {
        crate::tokenizer::save(&data.tokenizer, &tok_path)?;
    }
    let tok_vocab = data.vocab_size().max(data.max_id_bound());
    let vocab = if cfg.model.vocab_size == 0 {
        tok_vocab
    } else {
        cfg.model.vocab_size
    };
    if vocab < tok_vocab {
        bail!(
            "model.vocab_size = {} is smaller than the tokenizer's {tok_vocab} tokens; use 0 (take the tokenizer's) or at least {tok_vocab}",
            cfg.model.vocab_size
        );
    }
    console.line(&format!(
        "data: {} -> {} train / {} val tokens, vocabulary {} (model {vocab}), {:.1}s",
        data.description,
        data.train.len(),
        data.val.len(),
        data.vocab_size(),
        t_data.elapsed().as_secs_f64()
    ));
    Ok((data, vocab))
}

/// Restores the newest of `existing` checkpoints into the model and optimizer.
fn resume<B: crate::TrainBackend>(
    opts: &RunOptions,
    existing: &[(u64, PathBuf)],
    model: Gpt<B>,
    opt: &mut AdamW<B::InnerBackend>,
    cfg: &Config,
    vocab: usize,
    console: &Console,
) -> Result<(Gpt<B>, checkpoint::Restored)> {
    let (path, header, values) = crate::resume::newest(&opts.run_dir, existing)?;
    crate::resume::check_continues(&header, cfg).map_err(|why| {
        anyhow::anyhow!("checkpoint {} does not fit this run: {why}", path.display())
    })?;
    let (model, restored) =
        checkpoint::apply::<B, _>(&path, header, values, model, opt, &cfg.model, vocab)?;
    console.line(&format!(
        "resumed from {} (step {})",
        restored.path.display(),
        restored.step
    ));
    Ok((model, restored))
}

/// Console output that does not tear the progress bar.
struct Console {
    bar: Option<ProgressBar>,
    verbose: bool,
}

impl Console {
    fn line(&self, s: &str) {
        if !self.verbose {
            return;
        }
        match &self.bar {
            Some(b) => b.println(s),
            None => println!("{s}"),
        }
    }
}

/// A progress bar with ETA on stderr, when it is a terminal and the run is verbose.
fn progress_bar(opts: &RunOptions, steps: u64, position: u64) -> Option<ProgressBar> {
    if !(opts.verbose && std::io::stderr().is_terminal()) {
        return None;
    }
    let b = ProgressBar::with_draw_target(Some(steps), ProgressDrawTarget::stderr());
    b.set_style(
        ProgressStyle::with_template(
            "{bar:30.cyan/blue} {pos}/{len} steps [{elapsed_precise} < {eta_precise}] {msg}",
        )
        .expect("valid template"),
    );
    b.set_position(position);
    Some(b)
}

/// Where a run reports: console lines, `metrics.jsonl` and the loss plot.
struct Logger {
    console: Console,
    metrics: Metrics,
    run_dir: PathBuf,
    plot_title: String,
}

impl Logger {
    fn line(&self, s: &str) {
        self.console.line(s);
    }

    /// Records a step in `metrics.jsonl` and prints its lines: the step line (when `log_line`),
    /// FP8 health or numerics, and the evaluation (which also redraws the plot).
    fn step(
        &mut self,
        r: &StepRecord,
        steps: u64,
        log_line: bool,
        scaler: &LossScaler,
        best_val: Option<f64>,
    ) -> Result<()> {
        self.metrics.record(r)?;
        let done = r.step;
        if log_line {
            let mfu = r
                .mfu
                .map_or("-".to_string(), |m| format!("{:.1}%", m * 100.0));
            let scaling = if scaler.setting.is_off() {
                String::new()
            } else {
                format!(" | scale {} | skipped {}", r.loss_scale, r.overflows)
            };
            self.line(&format!(
                "step {done:>6}/{steps} | loss {:.4} | lr {:.2e} | grad-norm {:.3}{scaling} | {} tok/s | MFU {mfu} | {:.0} ms/step",
                r.loss,
                r.lr,
                r.grad_norm,
                human(r.tokens_per_s),
                r.step_ms
            ));
        }
        if let Some(h) = &r.fp8 {
            self.line(&numerics::health_line("fp8  ", done, steps, h));
        }
        if let Some(h) = &r.numerics {
            self.line(&numerics::health_line(&r.precision, done, steps, h));
        }
        if let Some(v) = r.val_loss {
            self.line(&format!(
                "eval  {done:>6}/{steps} | val_loss {v:.4} | best {:.4}",
                best_val.unwrap_or(v)
            ));
            self.metrics.plot(&self.run_dir, &self.plot_title)?;
        }
        Ok(())
    }
}

fn human(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// Mean validation loss over `training.eval_batches` fixed batches, without autodiff.
pub fn evaluate<B: crate::TrainBackend>(
    model: &Gpt<B>,
    precision: &model::Precision,
    data: &Dataset,
    cfg: &Config,
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
        let l = m.forward_loss_with(x, y, precision, 0.0);
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

/// The weights that train through a copy in the compute dtype, with that dtype (none in f32).
fn copied_weights<B: Backend>(
    model: &Gpt<B>,
    compute_dtype: FloatDType,
) -> Option<(FloatDType, HashSet<burn::module::ParamId>)> {
    (compute_dtype != FloatDType::F32).then(|| (compute_dtype, model.compute_copy_ids()))
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
