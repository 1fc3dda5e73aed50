//! The training loop, generic over the autodiff backend.

use std::collections::HashSet;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use burn::module::AutodiffModule;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::Backend;
use burn::tensor::FloatDType;
use burn::tensor::Tensor;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use model::Gpt;
use serde::Serialize;

use crate::checkpoint;
use crate::config::Config;
use crate::data::Dataset;
use crate::fsutil::write_atomic;
use crate::metrics::{Metrics, StepRecord};
use crate::optim::{grads_to_f32, poison_grads, AdamW};
use crate::precision::{LossScaler, Recipe, Verdict};
use crate::rng::SplitMix64;
use crate::schedule::lr_at;

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

fn human(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// One log line on an FP8 health or fp16/bf16 numerics step: the worst underflow and saturation
/// (or overflow) shares and where.
fn health_line(what: &str, done: u64, steps: u64, h: &[crate::metrics::LayerHealth]) -> String {
    let worst = |f: fn(&crate::metrics::LayerHealth) -> f64| match h
        .iter()
        .max_by(|a, b| f(a).total_cmp(&f(b)))
    {
        Some(l) if f(l) > 0.0 => format!("{:.3}% ({})", 100.0 * f(l), l.layer),
        _ => "0".to_string(),
    };
    format!(
        "{what:<5} {done:>6}/{steps} | worst underflow {} | worst saturation {} | {} tensors (metrics.jsonl)",
        worst(|l| l.underflow),
        worst(|l| l.saturated),
        h.len()
    )
}

/// FP8 health of every projection weight as the fprop GEMM quantizes it (128x128 blocks, or per
/// tensor), from the master weights cast to the compute dtype (`blocks.N.attn.qkv.weight`, ...).
fn fp8_weight_health<B: crate::TrainBackend>(
    model: &Gpt<B>,
    dtype: FloatDType,
    cfg: &kernels::Fp8LinearConfig,
) -> Vec<crate::metrics::LayerHealth> {
    model
        .projections()
        .into_iter()
        .map(|(name, lin)| {
            let h =
                kernels::fp8_health(lin.weight.val().inner().cast(dtype), cfg.weight_spec(true));
            crate::metrics::LayerHealth {
                layer: format!("{name}.weight"),
                amax: h.amax,
                underflow: h.underflow,
                saturated: h.saturated,
            }
        })
        .collect()
}

/// Mean validation loss over `training.eval_batches` fixed batches, without autodiff.
pub fn evaluate<B: crate::TrainBackend>(model: &Gpt<B>, data: &Dataset, cfg: &Config) -> f64 {
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
        let l = m.forward_loss_with(x, y, 0.0);
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

/// Trains as configured. Writes `config.toml`, `tokenizer.json`, `metrics.jsonl`, `loss.svg`,
/// `checkpoints/` and `summary.json` into the run directory.
pub fn train<B: crate::TrainBackend>(
    cfg: &Config,
    device: B::Device,
    opts: &RunOptions,
) -> Result<Summary> {
    let _drain = crate::DrainOnDrop::<B>(device.clone());
    let run_dir = &opts.run_dir;
    let existing = checkpoint::list(run_dir)?;
    if !opts.resume && !existing.is_empty() {
        bail!(
            "{} already holds checkpoints of a run; continue it with --resume {0} or choose another --out",
            run_dir.display()
        );
    }
    let tok_path = run_dir.join("tokenizer.json");
    let console = Console {
        bar: None,
        verbose: opts.verbose,
    };

    // Data and tokenizer. A resumed run reuses its saved tokenizer.
    let t_data = Instant::now();
    let reuse = (opts.resume && tok_path.exists()).then_some(tok_path.as_path());
    let data = Dataset::build(cfg, reuse)?;
    // Created once the data is usable, so a bad data path leaves no empty run directory behind.
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

    // Model and optimizer, from the seed; then the checkpoint if resuming.
    B::seed(&device, cfg.seed);
    let mut model = Gpt::<B>::new(&cfg.model, vocab, &device);
    let recipe = cfg.recipe();
    let compute_dtype = recipe.compute_dtype();
    let fp8_linear = recipe.fp8_linear();
    let mut opt = AdamW::<B::InnerBackend>::new(cfg.optimizer.clone(), no_decay_ids(&model, cfg));
    if cfg.model.kernels == model::config::KernelsKind::Fused {
        // The fused step also writes the next step's compute copy of the cast weights.
        let copy =
            (compute_dtype != FloatDType::F32).then(|| (compute_dtype, model.compute_copy_ids()));
        opt = opt.with_fused(copy);
    }
    let mut scaler = LossScaler::new(recipe.loss_scaling().clone());
    let mut start_step = 0u64;
    let mut best_val: Option<f64> = None;
    let mut elapsed_before = 0.0;
    let mut resumed_from = None;
    if opts.resume {
        let Some((_, path)) = existing.last() else {
            bail!(
                "--resume {}: no checkpoint in {}; the run stopped before its first checkpoint, start it again",
                run_dir.display(),
                checkpoint::dir(run_dir).display()
            );
        };
        let (header, values) = checkpoint::read(path).map_err(|e| {
            // A damaged newest checkpoint: say where the previous complete one is.
            match existing.len().checked_sub(2).map(|i| &existing[i]) {
                Some((step, older)) => e.context(format!(
                    "the previous checkpoint (step {step}) is {}; move the damaged one away to resume from it",
                    older.display()
                )),
                None => e,
            }
        })?;
        let (m, restored) =
            checkpoint::apply::<B, _>(path, header, values, model, &mut opt, cfg, vocab)?;
        model = m;
        start_step = restored.step;
        best_val = restored.best_val_loss;
        elapsed_before = restored.elapsed_s;
        resumed_from = Some(restored.step);
        if let Some(state) = restored.loss_scaler {
            if let Some(note) = scaler.restore(state, restored.precision.as_ref()) {
                console.line(&note);
            }
        }
        console.line(&format!(
            "resumed from {} (step {})",
            restored.path.display(),
            restored.step
        ));
    }
    // Written once the checkpoint (if any) has been accepted, so a refused --set never replaces the
    // run's config.
    write_atomic(&run_dir.join("config.toml"), cfg.to_toml().as_bytes())?;
    write_atomic(
        &run_dir.join("precision.json"),
        serde_json::to_string_pretty(&recipe)?.as_bytes(),
    )?;
    let mut metrics = Metrics::open(run_dir, opts.resume.then_some(start_step))?;

    let params = cfg.model.num_params(vocab);
    let flops_per_token = cfg.model.flops_per_token(vocab);
    let tokens_per_step = cfg.tokens_per_step();
    let steps = cfg.training.steps as u64;
    console.line(&format!(
        "model: {} parameters ({} layers, {} heads, width {}, context {}, {:?} MLP; {:?} kernels, {:?} attention); {} tokens/step; device {}",
        human(params as f64),
        cfg.model.n_layer,
        cfg.model.n_head,
        cfg.model.d_model,
        cfg.model.context,
        cfg.model.mlp,
        cfg.model.kernels,
        cfg.model.attention,
        tokens_per_step,
        opts.device_name
    ));
    console.line(&format!("precision: {}", recipe.describe()));
    {
        let probe = burn::tensor::Tensor::<B, 2>::zeros(
            [1, 1],
            (&device, burn::tensor::DType::from(compute_dtype)),
        );
        console.line(&format!(
            "GEMMs: {} (model.gemm = \"{}\")",
            kernels::gemm::gemm_path(&probe, cfg.model.gemm.engine()),
            cfg.model.gemm.name()
        ));
        if let Recipe::Fp8(_) = &recipe {
            console.line(&format!("FP8 GEMMs: {}", fp8_gemm_path_name::<B>(&device)));
        }
    }
    if start_step >= steps {
        console.line(&format!(
            "nothing to do: the run already has {start_step} of {steps} steps"
        ));
    }

    let bar = if opts.verbose && std::io::stderr().is_terminal() {
        let b = ProgressBar::with_draw_target(Some(steps), ProgressDrawTarget::stderr());
        b.set_style(
            ProgressStyle::with_template(
                "{bar:30.cyan/blue} {pos}/{len} steps [{elapsed_precise} < {eta_precise}] {msg}",
            )
            .expect("valid template"),
        );
        b.set_position(start_step);
        Some(b)
    } else {
        None
    };
    let console = Console {
        bar,
        verbose: opts.verbose,
    };

    let plot_title = format!(
        "{} ({})",
        run_dir
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default(),
        opts.device_name
    );
    let session_start = Instant::now();
    let mut tok_rates = Vec::new();
    let mut first_step_s = f64::NAN;
    let mut last_loss = f64::NAN;
    let mut last_val = None;
    let mut completed = start_step;
    let mut peak_memory: Option<u64> = None;
    let accum = cfg.training.grad_accum;
    let end = opts.stop_at.map_or(steps, |s| s.min(steps));
    for step in start_step..end {
        if step == start_step && !opts.device_name.starts_with("CPU") {
            console.line(&format!(
                "step {}: compiling the GPU kernels at this model's shapes (once per shape)...",
                step + 1
            ));
        }
        let t0 = Instant::now();
        let lr = lr_at(cfg, step as usize);
        // Dropout masks depend only on (seed, step), like the batches, so a resumed run repeats them.
        B::seed(
            &device,
            SplitMix64::for_stream(cfg.seed, 3, step).next_u64(),
        );

        // The compute copy (weights cast to the compute dtype once per step; the master itself
        // for fp32) runs forward and backward; its gradients arrive under the master's ids.
        // With the fused optimizer the copies written by the last step are reused (a resumed or
        // first step, or one after a skipped step with no copies, casts).
        // FP8 health steps: the projections also record their inputs' FP8 health.
        let health_step = match &recipe {
            Recipe::Fp8(r) => {
                r.fp8.health_interval > 0 && ((step + 1) % r.fp8.health_interval == 0 || step == 0)
            }
            _ => false,
        };
        let probe = health_step.then(|| std::sync::Arc::new(std::sync::Mutex::new(Vec::new())));
        // fp16 and bf16 numerics steps: the projections tap their output gradients, and the
        // weight gradients are measured before they are cast to f32 (first micro-batch only).
        let numerics_step = !matches!(recipe, Recipe::Fp8(_))
            && compute_dtype != FloatDType::F32
            && cfg.training.numerics_interval > 0
            && ((step + 1) % cfg.training.numerics_interval == 0 || step == 0);
        let taps = numerics_step.then(model::layers::grad_taps);
        let mut numerics_stats: Vec<(String, Tensor<B::InnerBackend, 1>)> = Vec::new();
        let compute = model
            .compute_copy_with(compute_dtype, &|id| {
                opt.copies.get(&id).map(|c| B::from_inner(c.clone()))
            })
            .with_fp8(fp8_linear)
            .with_fp8_probe(probe.clone())
            .with_grad_taps(taps.clone());
        let scale = scaler.scale();
        let mut loss_sum: Option<Tensor<B::InnerBackend, 1>> = None;
        let mut micro_grads = |index: u64| {
            let (x, y) = data.train_batch::<B>(
                cfg.seed,
                index,
                cfg.training.batch_size,
                cfg.model.context,
                &device,
            );
            let loss = compute.forward_loss(x, y);
            model::dtype::debug_assert_dtype(&loss, FloatDType::F32, "loss");
            let l = loss.clone().inner();
            loss_sum = Some(match loss_sum.take() {
                Some(s) => s + l,
                None => l,
            });
            let factor = scale / accum as f64;
            let loss = if factor == 1.0 {
                loss
            } else {
                loss.mul_scalar(factor)
            };
            let raw = loss.backward();
            if let Some(taps) = &taps {
                let tapped = model::layers::take_taps::<B>(taps);
                if numerics_stats.is_empty() {
                    for (name, tap) in tapped {
                        if let Some(g) = tap.grad(&raw) {
                            let s = crate::numerics::stats(g, compute_dtype);
                            numerics_stats.push((format!("{name}.grad_output"), s));
                        }
                    }
                }
            }
            let mut g = GradientsParams::from_grads(raw, &compute);
            if taps.is_some()
                && !numerics_stats
                    .iter()
                    .any(|(n, _)| n.ends_with(".weight_grad"))
            {
                for (name, lin) in compute.projections() {
                    if let Some(w) = g.get::<B::InnerBackend, 2>(lin.weight.id) {
                        let s = crate::numerics::stats(w, compute_dtype);
                        numerics_stats.push((format!("{name}.weight_grad"), s));
                    }
                }
            }
            grads_to_f32::<B, _>(&model, &mut g);
            g
        };
        let mut grads = if accum == 1 {
            micro_grads(step)
        } else {
            let mut acc = GradientsAccumulator::<Gpt<B>>::new();
            for micro in 0..accum {
                acc.accumulate(&model, micro_grads(step * accum as u64 + micro as u64));
            }
            acc.grads()
        };
        drop(compute);
        let numerics = taps
            .is_some()
            .then(|| crate::numerics::read(numerics_stats));
        if opts.poison_steps.contains(&(step + 1)) {
            poison_grads::<B, _>(&model, &mut grads);
        }
        let scaled_norm = AdamW::<B::InnerBackend>::grad_norm::<B, _>(&model, &grads);

        // One read-back per step: [mean loss, scaled grad norm]. It tells whether the gradients are
        // finite (a single inf or NaN makes the norm non-finite), and it synchronises, so the
        // timing is real.
        let loss_mean = loss_sum
            .expect("at least one micro-batch")
            .div_scalar(accum as f64);
        let stats = Tensor::cat(vec![loss_mean, scaled_norm.clone()], 0);
        // Without loss scaling a non-finite step ends the run and nothing of it is kept (the last
        // checkpoint stays as it was), so the update is queued before the read-back: the GPU runs
        // it while the host waits, instead of idling while the host queues it afterwards. With
        // loss scaling the verdict decides whether the update runs at all.
        let mut update = Some((grads, scaled_norm));
        if scaler.setting.is_off() {
            let (grads, norm) = update.take().expect("not taken yet");
            model = opt.step::<B, _>(lr, model, grads, norm, scale);
        }
        let stats: Vec<f64> = stats
            .into_data()
            .convert::<f64>()
            .into_vec()
            .expect("f64 stats");
        let (loss, grad_norm) = (stats[0], stats[1] / scale);
        let finite = loss.is_finite() && grad_norm.is_finite();
        let skipped = match scaler.update(finite, step + 1) {
            Verdict::Apply => {
                if let Some((grads, norm)) = update {
                    model = opt.step::<B, _>(lr, model, grads, norm, scale);
                }
                false
            }
            Verdict::Skip => true,
            Verdict::Stop(why) if scaler.setting.is_off() => {
                let hint = if recipe.name() == "fp16" {
                    "; FP16 without loss scaling overflows easily: set loss_scale.mode = \"dynamic\""
                } else {
                    ""
                };
                bail!(
                    "training diverged at step {}: loss {loss}, gradient norm {grad_norm} ({why}); no checkpoint was written for it. \
                     Lower optimizer.lr or check the data{hint}",
                    step + 1
                );
            }
            Verdict::Stop(why) => bail!("{why}; no checkpoint was written for step {}", step + 1),
        };
        let dt = t0.elapsed().as_secs_f64();
        let memory_reserved = B::memory_reserved(&device);
        peak_memory = peak_memory.max(memory_reserved);
        if step == start_step {
            first_step_s = dt;
        }
        let tps = tokens_per_step as f64 / dt;
        if step >= start_step + 3 {
            tok_rates.push(tps);
        }
        let mfu = opts.peak_tflops.map(|p| flops_per_token * tps / (p * 1e12));
        last_loss = loss;
        let done = step + 1;
        completed = done;

        let is_last = done == steps;
        let session_end = done == end;
        let eval_now = is_last
            || (cfg.training.eval_interval > 0 && done % cfg.training.eval_interval as u64 == 0);
        let val_loss = eval_now.then(|| {
            evaluate(
                &model.compute_copy(compute_dtype).with_fp8(fp8_linear),
                &data,
                cfg,
            )
        });
        let fp8_health = match (health_step, fp8_linear) {
            (true, Some(lin)) => {
                let mut all = fp8_weight_health(&model, compute_dtype, &lin);
                // Inputs and output gradients: the first micro-batch's entry per layer.
                let recorded = probe
                    .map(|p| std::mem::take(&mut *p.lock().unwrap_or_else(|e| e.into_inner())))
                    .unwrap_or_default();
                let mut seen = HashSet::new();
                for (layer, h) in recorded {
                    if seen.insert(layer.clone()) {
                        all.push(crate::metrics::LayerHealth {
                            layer,
                            amax: h.amax,
                            underflow: h.underflow,
                            saturated: h.saturated,
                        });
                    }
                }
                Some(all)
            }
            _ => None,
        };
        if let Some(v) = val_loss {
            best_val = Some(best_val.map_or(v, |b: f64| b.min(v)));
            last_val = Some(v);
        }
        metrics.record(&StepRecord {
            step: done,
            loss,
            lr,
            grad_norm,
            precision: recipe.name().to_string(),
            loss_scale: scale,
            skipped,
            overflows: scaler.state.overflows,
            tokens_per_s: tps,
            step_ms: dt * 1e3,
            mfu,
            val_loss,
            fp8: fp8_health.clone(),
            numerics: numerics.clone(),
            memory_reserved,
        })?;

        if done % cfg.training.log_interval as u64 == 0 || is_last || done == start_step + 1 {
            let mfu_s = mfu.map_or("-".to_string(), |m| format!("{:.1}%", m * 100.0));
            let scaling = if scaler.setting.is_off() {
                String::new()
            } else {
                format!(" | scale {scale} | skipped {}", scaler.state.overflows)
            };
            console.line(&format!(
                "step {done:>6}/{steps} | loss {loss:.4} | lr {lr:.2e} | grad-norm {grad_norm:.3}{scaling} | {} tok/s | MFU {mfu_s} | {:.0} ms/step",
                human(tps),
                dt * 1e3
            ));
        }
        if let Some(h) = &fp8_health {
            console.line(&health_line("fp8  ", done, steps, h));
        }
        if let Some(h) = &numerics {
            console.line(&health_line(recipe.name(), done, steps, h));
        }
        if let Some(v) = val_loss {
            console.line(&format!(
                "eval  {done:>6}/{steps} | val_loss {v:.4} | best {:.4}",
                best_val.unwrap_or(v)
            ));
            metrics.plot(run_dir, &plot_title)?;
        }
        let ckpt_now = is_last
            || session_end
            || (cfg.training.checkpoint_interval > 0
                && done % cfg.training.checkpoint_interval as u64 == 0);
        if ckpt_now {
            let elapsed = elapsed_before + session_start.elapsed().as_secs_f64();
            checkpoint::save::<B, _>(
                run_dir,
                &model,
                &opt,
                cfg,
                vocab,
                done,
                best_val,
                elapsed,
                cfg.training.keep_checkpoints,
                (&recipe, &scaler.state),
            )?;
        }
        if let Some(b) = &console.bar {
            b.set_position(done);
            b.set_message(format!("loss {loss:.4}"));
        }
    }
    if let Some(b) = &console.bar {
        b.finish_and_clear();
    }
    metrics.plot(run_dir, &plot_title)?;

    tok_rates.sort_by(|a, b| a.partial_cmp(b).expect("finite rates"));
    let summary = Summary {
        steps: completed,
        final_loss: last_loss,
        best_val_loss: best_val,
        final_val_loss: last_val,
        wall_s: elapsed_before + session_start.elapsed().as_secs_f64(),
        median_tokens_per_s: tok_rates
            .get(tok_rates.len() / 2)
            .copied()
            .unwrap_or(f64::NAN),
        first_step_s,
        params,
        device: opts.device_name.clone(),
        resumed_from,
        precision: recipe.clone(),
        skipped_steps: scaler.state.overflows,
        final_loss_scale: scaler.scale(),
        peak_memory_reserved: peak_memory,
    };
    write_atomic(
        &run_dir.join("summary.json"),
        serde_json::to_string_pretty(&summary)?.as_bytes(),
    )?;
    Ok(summary)
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
