//! `compare`: precision recipes (and learning rates, seeds) trained side by side from one config,
//! each as an ordinary run directory, then one report: a table with stability verdicts, overlaid
//! curves and the learning-rate sensitivity plot.
//!
//! Layout of a comparison directory:
//! ```text
//! DIR/runs/<recipe>[-lr<lr>][-seed<seed>]/   one ordinary run each (resume with `train --resume`)
//! DIR/report.md, DIR/report.json             the table and the verdicts
//! DIR/{train_loss,val_loss,grad_norm,loss_scale,lr_sensitivity}.svg
//! ```
//! A finished entry (its `summary.json` at the configured step count) is never trained again; an
//! interrupted one resumes from its newest checkpoint; one that failed keeps its error in
//! `compare-error.txt` and is reported, not retried (delete that file to retry it).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use plotters::prelude::*;
use serde::{Deserialize, Serialize};

use crate::config::Config;
use crate::fsutil::write_atomic;
use crate::metrics::StepRecord;

/// The built-in recipes: name, what it is, and the config overrides it applies.
pub const RECIPES: &[(&str, &str, &[&str])] = &[
    ("fp32", "f32 everywhere", &["precision=fp32"]),
    (
        "bf16",
        "bf16 matmuls and activations, f32 master weights (CUDA)",
        &["precision=bf16"],
    ),
    (
        "fp16",
        "f16 matmuls and activations, f32 master weights, dynamic loss scaling",
        &["precision=fp16", "loss_scale.mode=dynamic"],
    ),
    (
        "fp16-noscale",
        "fp16 without loss scaling",
        &["precision=fp16", "loss_scale.mode=off"],
    ),
    (
        "fp8",
        "projection GEMMs in FP8 (E4M3, 1x128 / 128x128 scales), bf16 elsewhere (CUDA)",
        &["precision=fp8"],
    ),
    (
        "fp8-hybrid",
        "fp8 with E5M2 output gradients",
        &["precision=fp8", "fp8.format=hybrid"],
    ),
    (
        "fp8-tensor",
        "fp8 with one scale per tensor",
        &["precision=fp8", "fp8.scaling=tensor"],
    ),
];

/// One recipe of a comparison: a name and the overrides that make it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecipeSpec {
    pub name: String,
    pub overrides: Vec<String>,
}

impl RecipeSpec {
    /// `NAME` (a built-in recipe) or `NAME:key=value,key=value` (a built-in recipe with extra
    /// overrides, or a new name defined by its overrides alone).
    pub fn parse(text: &str) -> Result<Self> {
        let (name, extra) = match text.split_once(':') {
            Some((n, rest)) => (n.trim(), Some(rest)),
            None => (text.trim(), None),
        };
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            bail!("recipe '{text}': a name is letters, digits, '-', '_' or '.', optionally followed by ':key=value,...'");
        }
        let mut overrides: Vec<String> = match RECIPES.iter().find(|r| r.0 == name) {
            Some(r) => r.2.iter().map(|s| s.to_string()).collect(),
            None if extra.is_none() => bail!(
                "unknown recipe '{name}'; built-in recipes: {} (or define one as NAME:key=value,...; `compare --list` shows what each sets)",
                RECIPES.iter().map(|r| r.0).collect::<Vec<_>>().join(", ")
            ),
            None => Vec::new(),
        };
        if let Some(extra) = extra {
            for ov in extra.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                if !ov.contains('=') {
                    bail!("recipe '{text}': override '{ov}' is not key=value");
                }
                overrides.push(ov.to_string());
            }
            if overrides.is_empty() {
                bail!("recipe '{text}': no overrides after ':'");
            }
        }
        Ok(Self {
            name: name.to_string(),
            overrides,
        })
    }
}

/// What a comparison trains: every recipe at every learning rate and seed (saved as
/// `compare.json` in the comparison directory).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Plan {
    /// The config every entry starts from, as TOML text, and where it came from.
    pub base_toml: String,
    pub origin: String,
    /// Overrides applied to every entry (before the recipe's).
    pub sets: Vec<String>,
    pub recipes: Vec<RecipeSpec>,
    /// Empty: the config's learning rate.
    pub lrs: Vec<f64>,
    /// Empty: the config's seed.
    pub seeds: Vec<u64>,
    pub steps: Option<u64>,
}

/// One run of a comparison.
#[derive(Debug, Clone)]
pub struct Entry {
    pub recipe: String,
    pub lr: f64,
    pub seed: u64,
    pub dir_name: String,
    pub config: Config,
}

impl Plan {
    /// Every entry's config (each validated, so that a bad override stops the comparison before
    /// anything trains).
    pub fn entries(&self) -> Result<Vec<Entry>> {
        if self.recipes.is_empty() {
            bail!("--recipes lists no recipe");
        }
        let mut names: Vec<&str> = self.recipes.iter().map(|r| r.name.as_str()).collect();
        names.sort();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            bail!("recipe '{}' is listed twice", w[0]);
        }
        let lrs: Vec<Option<f64>> = if self.lrs.is_empty() {
            vec![None]
        } else {
            self.lrs.iter().copied().map(Some).collect()
        };
        let seeds: Vec<Option<u64>> = if self.seeds.is_empty() {
            vec![None]
        } else {
            self.seeds.iter().copied().map(Some).collect()
        };
        let mut out = Vec::new();
        for r in &self.recipes {
            for &lr in &lrs {
                for &seed in &seeds {
                    let mut sets = self.sets.clone();
                    sets.extend(r.overrides.iter().cloned());
                    if let Some(lr) = lr {
                        sets.push(format!("optimizer.lr={lr:e}"));
                    }
                    if let Some(seed) = seed {
                        sets.push(format!("seed={seed}"));
                    }
                    if let Some(steps) = self.steps {
                        sets.push(format!("training.steps={steps}"));
                    }
                    let mut dir_name = r.name.clone();
                    if let Some(lr) = lr {
                        let _ = write!(dir_name, "-lr{lr:e}");
                    }
                    if let Some(seed) = seed {
                        let _ = write!(dir_name, "-seed{seed}");
                    }
                    let config = Config::from_toml_str(&self.base_toml, &sets, &self.origin)
                        .with_context(|| {
                            format!(
                                "recipe '{}' (overrides: {})",
                                r.name,
                                r.overrides.join(", ")
                            )
                        })?;
                    out.push(Entry {
                        recipe: r.name.clone(),
                        lr: config.optimizer.lr,
                        seed: config.seed,
                        dir_name,
                        config,
                    });
                }
            }
        }
        Ok(out)
    }
}

/// Where an entry stands on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryState {
    /// Trained to its configured step count.
    Done,
    /// Failed earlier; its error is in `compare-error.txt`.
    Failed,
    /// Has a checkpoint to resume from.
    Resumable,
    /// Nothing to keep: train from the start.
    New,
}

pub const ERROR_FILE: &str = "compare-error.txt";

/// Marks an entry trained while other entries of its comparison ran on the same device
/// (`--jobs K` with K > 1); it holds K.
pub const SHARED_FILE: &str = "compare-shared-device.txt";

/// Records that the entry in `dir` trains beside up to `jobs - 1` others (kept across resumes:
/// its median tokens/s mixes both parts).
pub fn mark_shared(dir: &Path, jobs: usize) -> Result<()> {
    let jobs = jobs.max(shared_jobs(dir).unwrap_or(0));
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let path = dir.join(SHARED_FILE);
    std::fs::write(&path, format!("{jobs}\n"))
        .with_context(|| format!("cannot write {}", path.display()))
}

/// The `--jobs` value an entry was trained under, when it shared the device.
fn shared_jobs(dir: &Path) -> Option<usize> {
    std::fs::read_to_string(dir.join(SHARED_FILE))
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

pub fn entry_state(dir: &Path, cfg: &Config) -> EntryState {
    if dir.join(ERROR_FILE).exists() {
        return EntryState::Failed;
    }
    let steps = std::fs::read_to_string(dir.join("summary.json"))
        .ok()
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
        .and_then(|v| v.get("steps").and_then(|s| s.as_u64()));
    if steps == Some(cfg.training.steps as u64) {
        return EntryState::Done;
    }
    match crate::checkpoint::list(dir) {
        Ok(list) if !list.is_empty() => EntryState::Resumable,
        _ => EntryState::New,
    }
}

/// Stability verdict of one run (defined in `docs/precision.md`, "Comparing recipes").
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Stability {
    /// "stable", "unstable" or "diverged".
    pub verdict: String,
    /// Why, in words ("" when stable).
    pub reason: String,
    /// The first step that made the verdict.
    pub first_bad_step: Option<u64>,
    /// After warm-up: steps whose training loss exceeded 1.5x its running minimum.
    pub loss_spikes: u64,
    /// Steps whose gradient norm exceeded 10x the median of the previous 100 steps' norms.
    pub grad_norm_spikes: u64,
}

/// Training-loss spike threshold, relative to the running minimum after warm-up.
pub const LOSS_SPIKE: f64 = 1.5;
/// Gradient-norm spike threshold, relative to the median of the previous [`GRAD_WINDOW`] norms.
pub const GRAD_SPIKE: f64 = 10.0;
pub const GRAD_WINDOW: usize = 100;

/// The verdict of a run from its step records; `failed` is the run's error, if it stopped with one.
pub fn stability(records: &[StepRecord], warmup_steps: u64, failed: Option<&str>) -> Stability {
    let mut first_bad: Option<u64> = None;
    let mut diverged: Option<String> = None;
    if let Some(r) = records.iter().find(|r| !r.loss.is_finite()) {
        diverged = Some(format!("non-finite training loss at step {}", r.step));
        first_bad = Some(r.step);
    }
    let vals: Vec<(u64, f64)> = records
        .iter()
        .filter_map(|r| r.val_loss.map(|v| (r.step, v)))
        .collect();
    if diverged.is_none() {
        if let Some(&(_, v0)) = vals.first() {
            if let Some(&(s, v)) = vals.iter().skip(1).find(|(_, v)| !v.is_finite() || *v > v0) {
                diverged = Some(format!(
                    "validation loss {v:.4} at step {s} above its first value {v0:.4}"
                ));
                first_bad = Some(s);
            }
        }
    }
    if diverged.is_none() {
        if let Some(why) = failed {
            diverged = Some(format!("the run stopped: {why}"));
            first_bad = records.last().map(|r| r.step);
        }
    }
    let (mut loss_spikes, mut grad_spikes) = (0u64, 0u64);
    let mut first_spike: Option<u64> = None;
    let mut running_min = f64::INFINITY;
    let mut window: std::collections::VecDeque<f64> = std::collections::VecDeque::new();
    for r in records {
        if r.step > warmup_steps && r.loss.is_finite() {
            if running_min.is_finite() && r.loss > LOSS_SPIKE * running_min {
                loss_spikes += 1;
                first_spike.get_or_insert(r.step);
            }
            running_min = running_min.min(r.loss);
        }
        if r.grad_norm.is_finite() && !r.skipped {
            if window.len() >= 10 {
                let mut w: Vec<f64> = window.iter().copied().collect();
                w.sort_by(|a, b| a.total_cmp(b));
                let median = w[w.len() / 2];
                if r.grad_norm > GRAD_SPIKE * median {
                    grad_spikes += 1;
                    first_spike.get_or_insert(r.step);
                }
            }
            window.push_back(r.grad_norm);
            if window.len() > GRAD_WINDOW {
                window.pop_front();
            }
        }
    }
    let (verdict, reason) = match diverged {
        Some(why) => ("diverged", why),
        None if loss_spikes + grad_spikes > 0 => {
            first_bad = first_spike;
            (
                "unstable",
                format!("{loss_spikes} training-loss spikes, {grad_spikes} gradient-norm spikes"),
            )
        }
        None => ("stable", String::new()),
    };
    Stability {
        verdict: verdict.into(),
        reason,
        first_bad_step: first_bad,
        loss_spikes,
        grad_norm_spikes: grad_spikes,
    }
}

/// One row of the report.
#[derive(Debug, Clone, Serialize)]
pub struct EntryReport {
    pub name: String,
    pub recipe: String,
    pub lr: f64,
    pub seed: u64,
    pub steps_done: u64,
    pub steps: u64,
    pub best_val_loss: Option<f64>,
    pub best_val_step: Option<u64>,
    pub final_val_loss: Option<f64>,
    /// Best validation loss minus that of the fp32 entry with the same learning rate and seed.
    pub best_val_vs_fp32: Option<f64>,
    /// Median tokens/s over the steps after the first three.
    pub tokens_per_s: Option<f64>,
    /// Left out when this entry or its fp32 entry shared the device.
    pub tokens_per_s_vs_fp32: Option<f64>,
    /// Set when other entries trained on the same device at the same time (`--jobs K`, K > 1):
    /// then tokens/s measures the shared device, not the recipe.
    pub shared_device_jobs: Option<usize>,
    pub skipped_steps: u64,
    pub loss_scale_min: Option<f64>,
    pub loss_scale_max: Option<f64>,
    /// Largest memory the device's pools held at the end of a step (bytes; see
    /// `StepRecord::memory_reserved`), when the backend reports it.
    pub peak_memory_reserved: Option<u64>,
    pub stability: Stability,
    pub error: Option<String>,
    #[serde(skip)]
    pub records: Vec<StepRecord>,
}

/// Reads one entry's records and makes its row (the fp32 comparisons are filled in later).
pub fn entry_report(dir: &Path, entry: &Entry) -> Result<EntryReport> {
    let records = read_records(&dir.join("metrics.jsonl"))?;
    let error = std::fs::read_to_string(dir.join(ERROR_FILE))
        .ok()
        .map(|s| s.trim().to_string());
    let vals: Vec<(u64, f64)> = records
        .iter()
        .filter_map(|r| r.val_loss.map(|v| (r.step, v)))
        .filter(|v| v.1.is_finite())
        .collect();
    let best = vals.iter().copied().min_by(|a, b| a.1.total_cmp(&b.1));
    let mut tps: Vec<f64> = records
        .iter()
        .filter(|r| r.step > 3 && r.tokens_per_s.is_finite() && r.tokens_per_s > 0.0)
        .map(|r| r.tokens_per_s)
        .collect();
    tps.sort_by(|a, b| a.total_cmp(b));
    let scales: Vec<f64> = records
        .iter()
        .map(|r| r.loss_scale)
        .filter(|s| s.is_finite())
        .collect();
    let scaled = scales.iter().any(|&s| s != 1.0);
    Ok(EntryReport {
        name: entry.dir_name.clone(),
        recipe: entry.recipe.clone(),
        lr: entry.lr,
        seed: entry.seed,
        steps_done: records.last().map_or(0, |r| r.step),
        steps: entry.config.training.steps as u64,
        best_val_loss: best.map(|b| b.1),
        best_val_step: best.map(|b| b.0),
        final_val_loss: vals.last().map(|v| v.1),
        best_val_vs_fp32: None,
        tokens_per_s: (!tps.is_empty()).then(|| tps[tps.len() / 2]),
        tokens_per_s_vs_fp32: None,
        shared_device_jobs: shared_jobs(dir),
        skipped_steps: records.iter().map(|r| r.overflows).max().unwrap_or(0),
        loss_scale_min: scaled.then(|| scales.iter().copied().fold(f64::INFINITY, f64::min)),
        loss_scale_max: scaled.then(|| scales.iter().copied().fold(0.0, f64::max)),
        peak_memory_reserved: records.iter().filter_map(|r| r.memory_reserved).max(),
        stability: stability(
            &records,
            entry.config.schedule.warmup_steps as u64,
            error.as_deref(),
        ),
        error,
        records,
    })
}

fn read_records(path: &Path) -> Result<Vec<StepRecord>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str::<StepRecord>(l).ok())
        .collect())
}

/// The whole report, as written to `report.json`.
#[derive(Debug, Serialize)]
pub struct Report {
    pub config: String,
    pub recipes: Vec<RecipeSpec>,
    pub entries: Vec<EntryReport>,
    pub plots: Vec<String>,
    pub verdicts: String,
}

pub const VERDICTS: &str = "diverged: a non-finite training loss, a run stopped by an error (such as a loss scaler at its floor), \
or a validation loss above the run's first one; unstable: after warm-up, a training loss above 1.5x its running minimum, or a \
gradient norm above 10x the median of the previous 100 steps' norms (spikes counted); stable: neither.";

/// Fills in the comparisons with fp32 and writes `report.md`, `report.json` and the plots.
pub fn write_report(
    dir: &Path,
    origin: &str,
    recipes: &[RecipeSpec],
    mut entries: Vec<EntryReport>,
) -> Result<Report> {
    relative_to_fp32(&mut entries);
    let mut plots = curve_plots(dir, recipes, &entries)?;
    plots.extend(lr_sensitivity_plot(dir, recipes, &entries)?);
    plots.extend(numerics_plots(dir, &entries)?);
    let report = Report {
        config: origin.to_string(),
        recipes: recipes.to_vec(),
        entries,
        plots,
        verdicts: VERDICTS.to_string(),
    };
    write_atomic(
        &dir.join("report.json"),
        serde_json::to_string_pretty(&report)?.as_bytes(),
    )?;
    write_atomic(&dir.join("report.md"), markdown(&report).as_bytes())?;
    Ok(report)
}

/// Each entry's best validation loss and tokens/s against the fp32 entry at the same learning rate
/// and seed.
fn relative_to_fp32(entries: &mut [EntryReport]) {
    // Speed is compared only between entries that had the device to themselves.
    let alone = |e: &EntryReport| e.tokens_per_s.filter(|_| e.shared_device_jobs.is_none());
    let fp32: Vec<(f64, u64, Option<f64>, Option<f64>)> = entries
        .iter()
        .filter(|e| e.recipe == "fp32")
        .map(|e| (e.lr, e.seed, e.best_val_loss, alone(e)))
        .collect();
    for e in entries.iter_mut() {
        if let Some(&(_, _, v, t)) = fp32.iter().find(|f| f.0 == e.lr && f.1 == e.seed) {
            e.best_val_vs_fp32 = e.best_val_loss.zip(v).map(|(a, b)| a - b);
            e.tokens_per_s_vs_fp32 = alone(e).zip(t).map(|(a, b)| a / b);
        }
    }
}

/// Recipe colour: its position in the command's recipe list.
fn recipe_colour(recipes: &[RecipeSpec], recipe: &str) -> RGBColor {
    palette(recipes.iter().position(|r| r.name == recipe).unwrap_or(0))
}

/// The overlaid curves: training and validation loss, gradient norm and, when a recipe scales
/// the loss, the loss scale. Returns the files written.
fn curve_plots(dir: &Path, recipes: &[RecipeSpec], entries: &[EntryReport]) -> Result<Vec<String>> {
    let mut plots = Vec::new();
    let colour = |recipe: &str| recipe_colour(recipes, recipe);
    let series =
        |f: &dyn Fn(&StepRecord) -> Option<f64>| -> Vec<(String, RGBColor, Vec<(f64, f64)>)> {
            entries
                .iter()
                .map(|e| {
                    (
                        e.name.clone(),
                        colour(&e.recipe),
                        e.records
                            .iter()
                            .filter_map(|r| {
                                f(r).filter(|v| v.is_finite()).map(|v| (r.step as f64, v))
                            })
                            .collect(),
                    )
                })
                .collect()
        };
    plot(
        &dir.join("train_loss.svg"),
        "training loss",
        "step",
        "loss (nats/token)",
        &series(&|r| Some(r.loss)),
        false,
    )?;
    plots.push("train_loss.svg".to_string());
    plot(
        &dir.join("val_loss.svg"),
        "validation loss",
        "step",
        "loss (nats/token)",
        &series(&|r| r.val_loss),
        true,
    )?;
    plots.push("val_loss.svg".to_string());
    plot(
        &dir.join("grad_norm.svg"),
        "gradient norm (before clipping)",
        "step",
        "norm",
        &series(&|r| Some(r.grad_norm)),
        false,
    )?;
    plots.push("grad_norm.svg".to_string());
    if entries.iter().any(|e| e.loss_scale_max.is_some()) {
        plot(
            &dir.join("loss_scale.svg"),
            "loss scale (log2)",
            "step",
            "log2(scale)",
            &series(&|r| Some(r.loss_scale.log2())),
            false,
        )?;
        plots.push("loss_scale.svg".to_string());
    }
    Ok(plots)
}

/// With several learning rates: best validation loss (mean over seeds) against log10(lr), one line
/// per recipe (Wortsman et al. 2023). Returns the file written, if any.
fn lr_sensitivity_plot(
    dir: &Path,
    recipes: &[RecipeSpec],
    entries: &[EntryReport],
) -> Result<Option<String>> {
    let mut lrs: Vec<f64> = entries.iter().map(|e| e.lr).collect();
    lrs.sort_by(|a, b| a.total_cmp(b));
    lrs.dedup();
    if lrs.len() < 2 {
        return Ok(None);
    }
    let lines: Vec<(String, RGBColor, Vec<(f64, f64)>)> = recipes
        .iter()
        .map(|r| {
            let pts = lrs
                .iter()
                .filter_map(|&lr| {
                    let v: Vec<f64> = entries
                        .iter()
                        .filter(|e| e.recipe == r.name && e.lr == lr)
                        .filter_map(|e| e.best_val_loss)
                        .collect();
                    (!v.is_empty()).then(|| (lr.log10(), v.iter().sum::<f64>() / v.len() as f64))
                })
                .collect();
            (r.name.clone(), recipe_colour(recipes, &r.name), pts)
        })
        .collect();
    plot(
        &dir.join("lr_sensitivity.svg"),
        "learning-rate sensitivity",
        "log10(learning rate)",
        "best validation loss",
        &lines,
        true,
    )?;
    Ok(Some("lr_sensitivity.svg".to_string()))
}

/// Per-layer numerics of the low-precision entries, as heatmaps: FP8's health records (every
/// `fp8.health_interval` steps), fp16's and bf16's numerics records (every
/// `training.numerics_interval` steps). Returns the files written.
fn numerics_plots(dir: &Path, entries: &[EntryReport]) -> Result<Vec<String>> {
    let mut plots = Vec::new();
    for e in entries {
        if let Some(h) = numerics_grid(&e.records) {
            let file = format!("numerics-{}.svg", e.name);
            let what = if e.records.iter().any(|r| r.fp8.is_some()) {
                "FP8 numerics per tensor (underflow: nonzero values quantized to zero; saturated: clipped)".to_string()
            } else {
                let format = e
                    .records
                    .iter()
                    .find(|r| r.numerics.is_some())
                    .map_or("", |r| r.precision.as_str());
                format!("{format} gradient numerics per tensor (underflow: nonzero values below the smallest normal, loss scale applied; saturated: not finite)")
            };
            heatmaps(&dir.join(&file), &format!("{}: {what}", e.name), &h)?;
            plots.push(file);
        }
    }

    Ok(plots)
}

fn markdown(r: &Report) -> String {
    let f = |v: Option<f64>, p: usize| v.map_or("-".to_string(), |v| format!("{v:.p$}"));
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# Precision comparison\n\nConfig: {}. Recipes:\n",
        r.config
    );
    for rc in &r.recipes {
        let _ = writeln!(s, "- `{}`: {}", rc.name, rc.overrides.join(", "));
    }
    let _ = writeln!(
        s,
        "\n| entry | steps | best val (step) | vs fp32 | final val | tokens/s | vs fp32 | peak memory | skipped | loss scale | verdict | first bad step |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for e in &r.entries {
        let scale = match (e.loss_scale_min, e.loss_scale_max) {
            (Some(a), Some(b)) => format!("{a:.0}-{b:.0}"),
            _ => "-".into(),
        };
        let verdict = if e.stability.reason.is_empty() {
            e.stability.verdict.clone()
        } else {
            format!("{} ({})", e.stability.verdict, e.stability.reason)
        };
        let _ = writeln!(
            s,
            "| {} | {}/{} | {} ({}) | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            e.name,
            e.steps_done,
            e.steps,
            f(e.best_val_loss, 4),
            e.best_val_step.map_or("-".into(), |x| x.to_string()),
            e.best_val_vs_fp32
                .map_or("-".into(), |d| format!("{d:+.4}")),
            f(e.final_val_loss, 4),
            match e.shared_device_jobs {
                Some(_) => format!("{} (shared)", f(e.tokens_per_s, 0)),
                None => f(e.tokens_per_s, 0),
            },
            e.tokens_per_s_vs_fp32
                .map_or("-".into(), |x| format!("{x:.2}x")),
            e.peak_memory_reserved.map_or("-".into(), |b| format!(
                "{:.2} GiB",
                b as f64 / (1u64 << 30) as f64
            )),
            e.skipped_steps,
            scale,
            verdict,
            e.stability
                .first_bad_step
                .map_or("-".into(), |x| x.to_string()),
        );
    }
    if let Some(k) = r.entries.iter().filter_map(|e| e.shared_device_jobs).max() {
        let _ = writeln!(
            s,
            "\n(shared): trained while other entries ran on the same device (`--jobs {k}`), so its \
tokens/s measures the shared device, not the recipe, and has no ratio to fp32. Train with \
`--jobs 1` to compare speed."
        );
    }
    let _ = writeln!(s, "\nVerdicts: {}\n", r.verdicts);
    for p in &r.plots {
        let _ = writeln!(s, "![{p}]({p})");
    }
    s
}

/// Per-layer numerics over training (FP8 health, or fp16/bf16 gradient numerics): one row per
/// tracked tensor (a projection's weight, input, output gradient or weight gradient), one column
/// per step with a record.
#[derive(Debug, PartialEq)]
pub struct NumericsGrid {
    pub rows: Vec<String>,
    pub steps: Vec<u64>,
    /// `[row][column]`: share of nonzero values that quantize to zero (NaN where not recorded).
    pub underflow: Vec<Vec<f64>>,
    /// `[row][column]`: share of values clipped at the format's largest value.
    pub saturated: Vec<Vec<f64>>,
}

/// The per-layer numerics records of a run (`fp8`, or else `numerics`) as a grid, or `None` when
/// it has none.
pub fn numerics_grid(records: &[StepRecord]) -> Option<NumericsGrid> {
    let of = |r: &StepRecord| -> Option<Vec<crate::metrics::LayerHealth>> {
        r.fp8
            .clone()
            .or_else(|| r.numerics.clone())
            .filter(|v| !v.is_empty())
    };
    let with: Vec<(u64, Vec<crate::metrics::LayerHealth>)> = records
        .iter()
        .filter_map(|r| of(r).map(|h| (r.step, h)))
        .collect();
    if with.is_empty() {
        return None;
    }
    let mut rows: Vec<String> = Vec::new();
    for (_, hs) in &with {
        for h in hs {
            if !rows.contains(&h.layer) {
                rows.push(h.layer.clone());
            }
        }
    }
    let steps: Vec<u64> = with.iter().map(|r| r.0).collect();
    let mut underflow = vec![vec![f64::NAN; steps.len()]; rows.len()];
    let mut saturated = vec![vec![f64::NAN; steps.len()]; rows.len()];
    for (c, (_, hs)) in with.iter().enumerate() {
        for h in hs {
            let i = rows.iter().position(|l| l == &h.layer).expect("row");
            underflow[i][c] = h.underflow;
            saturated[i][c] = h.saturated;
        }
    }
    Some(NumericsGrid {
        rows,
        steps,
        underflow,
        saturated,
    })
}

/// Two heatmaps side by side (underflow, saturation), tensors by step, white (0) to red (the
/// largest share in the panel, printed in its title), grey where nothing was recorded.
fn heatmaps(path: &Path, title: &str, g: &NumericsGrid) -> Result<()> {
    let e =
        |e: DrawingAreaErrorKind<std::io::Error>| anyhow::anyhow!("plot {}: {e}", path.display());
    let height = (120 + 14 * g.rows.len()).clamp(300, 2400) as u32;
    crate::fsutil::replace_with(path, |tmp| {
        let root = SVGBackend::new(tmp, (1400, height)).into_drawing_area();
        root.fill(&WHITE).map_err(e)?;
        let root = root.titled(title, ("sans-serif", 20)).map_err(e)?;
        let panels = root.split_evenly((1, 2));
        for (panel, (name, data)) in panels
            .iter()
            .zip([("underflow", &g.underflow), ("saturated", &g.saturated)])
        {
            let max = data
                .iter()
                .flatten()
                .copied()
                .filter(|v| v.is_finite())
                .fold(0.0f64, f64::max);
            let (nr, nc) = (g.rows.len(), g.steps.len());
            let mut chart = ChartBuilder::on(panel)
                .caption(format!("{name} share (max {max:.2e})"), ("sans-serif", 16))
                .margin(8)
                .x_label_area_size(36)
                .y_label_area_size(if name == "underflow" { 230 } else { 10 })
                .build_cartesian_2d(0..nc, 0..nr)
                .map_err(e)?;
            let rows = g.rows.clone();
            let steps = g.steps.clone();
            chart
                .configure_mesh()
                .disable_mesh()
                .x_desc("step")
                .x_labels(nc.min(10))
                .x_label_formatter(&|c| steps.get(*c).map_or(String::new(), |s| s.to_string()))
                .y_labels(nr)
                .y_label_formatter(&|r| {
                    if name == "underflow" {
                        rows.get(nr.saturating_sub(1 + *r))
                            .cloned()
                            .unwrap_or_default()
                    } else {
                        String::new()
                    }
                })
                .label_style(("sans-serif", 11))
                .draw()
                .map_err(e)?;
            chart
                .draw_series(
                    (0..nr)
                        .flat_map(|r| (0..nc).map(move |c| (r, c)))
                        .map(|(r, c)| {
                            let v = data[r][c];
                            let colour = if !v.is_finite() {
                                RGBColor(200, 200, 200)
                            } else {
                                let t = if max > 0.0 {
                                    (v / max).clamp(0.0, 1.0)
                                } else {
                                    0.0
                                };
                                let fade = (255.0 * (1.0 - t)) as u8;
                                RGBColor(255, fade, fade)
                            };
                            // Row 0 at the top.
                            let y = nr - 1 - r;
                            Rectangle::new([(c, y), (c + 1, y + 1)], colour.filled())
                        }),
                )
                .map_err(e)?;
        }
        root.present().map_err(e)?;
        Ok(())
    })
}

fn palette(i: usize) -> RGBColor {
    const P: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];
    P[i % P.len()]
}

/// Overlaid line plots, one series per entry (points marked when `marks`).
fn plot(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(String, RGBColor, Vec<(f64, f64)>)],
    marks: bool,
) -> Result<()> {
    let e =
        |e: DrawingAreaErrorKind<std::io::Error>| anyhow::anyhow!("plot {}: {e}", path.display());
    let pts = series.iter().flat_map(|s| s.2.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    let (px, py) = (((x1 - x0) * 0.03).max(1e-3), ((y1 - y0) * 0.05).max(1e-3));
    crate::fsutil::replace_with(path, |tmp| {
        let root = SVGBackend::new(tmp, (900, 540)).into_drawing_area();
        root.fill(&WHITE).map_err(e)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d((x0 - px)..(x1 + px), (y0 - py)..(y1 + py))
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .draw()
            .map_err(e)?;
        for (name, c, data) in series {
            let c = *c;
            chart
                .draw_series(LineSeries::new(
                    data.iter().copied(),
                    c.stroke_width(if marks { 2 } else { 1 }),
                ))
                .map_err(e)?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
            if marks {
                chart
                    .draw_series(
                        data.iter()
                            .map(|&(x, y)| Circle::new((x, y), 3, c.filled())),
                    )
                    .map_err(e)?;
            }
        }
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()
            .map_err(e)?;
        root.present().map_err(e)?;
        Ok(())
    })
}

/// The run directory of an entry.
pub fn entry_dir(dir: &Path, entry: &Entry) -> PathBuf {
    dir.join("runs").join(&entry.dir_name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::LayerHealth;

    fn rec(step: u64, loss: f64, grad_norm: f64, val: Option<f64>) -> StepRecord {
        StepRecord {
            step,
            loss,
            lr: 1e-3,
            grad_norm,
            precision: "fp16".into(),
            loss_scale: 1.0,
            skipped: false,
            overflows: 0,
            tokens_per_s: 1000.0,
            step_ms: 1.0,
            mfu: None,
            val_loss: val,
            fp8: None,
            numerics: None,
            memory_reserved: None,
        }
    }

    fn smooth(n: u64) -> Vec<StepRecord> {
        (1..=n)
            .map(|s| {
                rec(
                    s,
                    4.0 - s as f64 * 0.01,
                    1.0,
                    (s % 10 == 0).then_some(4.0 - s as f64 * 0.01),
                )
            })
            .collect()
    }

    #[test]
    fn verdicts() {
        let ok = stability(&smooth(200), 20, None);
        assert_eq!((ok.verdict.as_str(), ok.first_bad_step), ("stable", None));

        let mut spike = smooth(200);
        spike[149].loss = 10.0; // step 150
        spike[169].grad_norm = 50.0; // step 170
        let s = stability(&spike, 20, None);
        assert_eq!(
            (
                s.verdict.as_str(),
                s.first_bad_step,
                s.loss_spikes,
                s.grad_norm_spikes
            ),
            ("unstable", Some(150), 1, 1)
        );
        // Inside warm-up a loss above 1.5x the minimum so far is no spike.
        let mut early = smooth(200);
        early[4].loss = 10.0;
        assert_eq!(stability(&early, 20, None).verdict, "stable");

        let mut nan = smooth(200);
        nan[99].loss = f64::NAN;
        let d = stability(&nan, 20, None);
        assert_eq!(
            (d.verdict.as_str(), d.first_bad_step),
            ("diverged", Some(100))
        );

        let mut up = smooth(200);
        up[179].val_loss = Some(4.5); // above the first evaluation (3.9)
        assert_eq!(stability(&up, 20, None).first_bad_step, Some(180));

        let stopped = stability(&smooth(50), 20, Some("the loss scale collapsed"));
        assert_eq!(stopped.verdict, "diverged");
        assert!(stopped.reason.contains("collapsed"));
    }

    #[test]
    fn recipes_parse_or_name_what_is_wrong() {
        assert_eq!(
            RecipeSpec::parse("fp16-noscale").unwrap().overrides,
            ["precision=fp16", "loss_scale.mode=off"]
        );
        let r = RecipeSpec::parse("fp16:loss_scale.init=1024").unwrap();
        assert_eq!(
            r.overrides,
            [
                "precision=fp16",
                "loss_scale.mode=dynamic",
                "loss_scale.init=1024"
            ]
        );
        assert_eq!(
            RecipeSpec::parse("mine:precision=fp16").unwrap().overrides,
            ["precision=fp16"]
        );
        let e = RecipeSpec::parse("fp64").unwrap_err().to_string();
        assert!(
            e.contains("unknown recipe 'fp64'") && e.contains("fp16-noscale"),
            "{e}"
        );
        assert!(RecipeSpec::parse("x:precision")
            .unwrap_err()
            .to_string()
            .contains("'precision' is not key=value"));
        assert!(RecipeSpec::parse("a b").is_err());
    }

    #[test]
    fn fp8_health_becomes_a_heatmap() {
        let mut rs = smooth(30);
        let h = |layer: &str, u: f64| LayerHealth {
            layer: layer.into(),
            amax: 1.0,
            underflow: u,
            saturated: u / 10.0,
        };
        rs[0].fp8 = Some(vec![
            h("blocks.0.attn.qkv.weight", 0.01),
            h("blocks.0.attn.qkv.grad_output", 0.2),
        ]);
        rs[19].fp8 = Some(vec![h("blocks.0.attn.qkv.grad_output", 0.3)]);
        let g = numerics_grid(&rs).expect("grid");
        assert_eq!(
            g.rows,
            ["blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.grad_output"]
        );
        assert_eq!(g.steps, [1, 20]);
        assert_eq!(g.underflow[1], [0.2, 0.3]);
        assert!(g.underflow[0][1].is_nan(), "not recorded at step 20");
        assert!(numerics_grid(&smooth(5)).is_none());
        // fp16/bf16 records make the same grid.
        let mut rs = smooth(3);
        rs[0].numerics = Some(vec![h("blocks.0.mlp.fc.weight_grad", 0.5)]);
        let g16 = numerics_grid(&rs).expect("grid from numerics");
        assert_eq!(g16.rows, ["blocks.0.mlp.fc.weight_grad"]);
        assert_eq!(g16.underflow, [[0.5]]);
        let path = std::env::temp_dir().join(format!("burnmix-heatmap-{}.svg", std::process::id()));
        heatmaps(&path, "test", &g).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.contains("<svg") && svg.contains("<rect") && svg.contains("grad_output"));
        let _ = std::fs::remove_file(&path);
    }
}
