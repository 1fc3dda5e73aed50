//! `metrics.jsonl` (one JSON object per step, plus one per evaluation) and the loss-curve plot.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use plotters::prelude::*;
use serde::{Deserialize, Serialize};

/// One training step.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StepRecord {
    pub step: u64,
    /// Mean training loss of the step's micro-batches (unscaled); `null` in the file when not
    /// finite.
    #[serde(with = "nullable_f64")]
    pub loss: f64,
    pub lr: f64,
    /// Global gradient norm before clipping, with the loss scale divided out; `null` in the file
    /// when not finite (an overflowed, skipped step).
    #[serde(with = "nullable_f64")]
    pub grad_norm: f64,
    /// Precision recipe: "fp32", "bf16", "fp16" or "fp8".
    #[serde(default)]
    pub precision: String,
    /// Factor the loss was multiplied by before this step's backward (1 without loss scaling).
    #[serde(default = "one")]
    pub loss_scale: f64,
    /// This step's gradients overflowed, so the weights and optimizer state were left unchanged.
    #[serde(default)]
    pub skipped: bool,
    /// Skipped (overflowed) steps in the run up to and including this one.
    #[serde(default)]
    pub overflows: u64,
    pub tokens_per_s: f64,
    pub step_ms: f64,
    /// Milliseconds the host took to queue the step's work (batch, forward, backward and, without
    /// loss scaling, the update), waits for the device included. Close to `step_ms`, the step is
    /// bound by the host's launches (or by a wait inside it), not by the GPU.
    #[serde(default)]
    pub host_ms: f64,
    /// Model FLOPs utilisation against the device's peak; absent when the peak is unknown.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub mfu: Option<f64>,
    /// Validation loss, on steps that end with an evaluation.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub val_loss: Option<f64>,
    /// FP8 recipe, on the first step and every `fp8.health_interval` steps: per projection, its
    /// weight (`blocks.N.mlp.fc.weight`), and its input and output gradient in the step's first
    /// micro-batch (`blocks.N.mlp.fc.input`, `blocks.N.mlp.fc.grad_output`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub fp8: Option<Vec<LayerHealth>>,
    /// fp16 and bf16 recipes, on the first step and every `training.numerics_interval` steps: per
    /// projection, how its output gradient (`blocks.N.mlp.fc.grad_output`, first micro-batch) and
    /// its weight gradient (`blocks.N.mlp.fc.weight_grad`) fit the compute format, as the backward
    /// holds them (multiplied by the loss scale).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub numerics: Option<Vec<LayerHealth>>,
    /// Bytes the device's memory pools held at the end of the step (CubeCL's reserved memory, as
    /// PyTorch's `memory_reserved`); absent where the backend does not say.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub memory_reserved: Option<u64>,
}

/// How one projection's weight, input or gradient fits its number format: FP8 as the GEMM
/// quantizes it (`kernels::Fp8Health`), or fp16/bf16 as the backward holds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerHealth {
    pub layer: String,
    /// Largest finite |x|.
    pub amax: f64,
    /// FP8: share of the nonzero values that quantize to zero. fp16/bf16: share of the nonzero
    /// finite values below the format's smallest normal number (held as subnormals, with fewer
    /// significant bits; values that were flushed to zero cannot be told from true zeros, such as
    /// dropout's, and are not counted).
    pub underflow: f64,
    /// FP8: share of values clipped at the format's max. fp16/bf16: share of values that are not
    /// finite (overflowed to inf, or NaN).
    pub saturated: f64,
}

fn one() -> f64 {
    1.0
}

/// `f64` written as `null` when not finite (JSON has no inf or NaN) and read back as NaN.
mod nullable_f64 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_finite() {
            s.serialize_f64(*v)
        } else {
            s.serialize_none()
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
    }
}

/// Appends step records to `metrics.jsonl` and keeps the curves for the plot.
pub struct Metrics {
    path: PathBuf,
    file: File,
    pub train: Vec<(u64, f64)>,
    pub val: Vec<(u64, f64)>,
}

impl Metrics {
    /// Opens `run_dir/metrics.jsonl`. When resuming from step `keep_up_to`, records of later steps
    /// (written after that checkpoint by the interrupted run) are dropped so that the file reads as
    /// one uninterrupted run.
    pub fn open(run_dir: &Path, keep_up_to: Option<u64>) -> Result<Self> {
        let path = run_dir.join("metrics.jsonl");
        let mut train = Vec::new();
        let mut val = Vec::new();
        if let Some(limit) = keep_up_to {
            let mut kept = String::new();
            if path.exists() {
                let f =
                    File::open(&path).with_context(|| format!("cannot read {}", path.display()))?;
                for line in BufReader::new(f).lines() {
                    let line = line?;
                    let Ok(rec) = serde_json::from_str::<StepRecord>(&line) else {
                        continue;
                    };
                    if rec.step <= limit {
                        train.push((rec.step, rec.loss));
                        if let Some(v) = rec.val_loss {
                            val.push((rec.step, v));
                        }
                        kept.push_str(&line);
                        kept.push('\n');
                    }
                }
            }
            crate::fsutil::write_atomic(&path, kept.as_bytes())?;
        } else {
            File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
        }
        let file = OpenOptions::new().append(true).open(&path)?;
        Ok(Self {
            path,
            file,
            train,
            val,
        })
    }

    pub fn record(&mut self, rec: &StepRecord) -> Result<()> {
        let line = serde_json::to_string(rec)?;
        writeln!(self.file, "{line}")
            .with_context(|| format!("cannot append to {}", self.path.display()))?;
        self.file.flush()?;
        self.train.push((rec.step, rec.loss));
        if let Some(v) = rec.val_loss {
            self.val.push((rec.step, v));
        }
        Ok(())
    }

    /// Writes `loss.svg`: training loss per step and validation loss per evaluation.
    pub fn plot(&self, run_dir: &Path, title: &str) -> Result<()> {
        crate::fsutil::replace_with(&run_dir.join("loss.svg"), |tmp| {
            plot_curves(tmp, title, &self.train, &self.val)
        })
    }
}

fn plot_curves(path: &Path, title: &str, train: &[(u64, f64)], val: &[(u64, f64)]) -> Result<()> {
    let finite = |v: &&(u64, f64)| v.1.is_finite();
    let all: Vec<&(u64, f64)> = train.iter().chain(val).filter(finite).collect();
    let max_step = all.iter().map(|p| p.0).max().unwrap_or(1).max(1);
    let (mut lo, mut hi) = all
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), p| (l.min(p.1), h.max(p.1)));
    if all.is_empty() {
        (lo, hi) = (0.0, 1.0);
    }
    let pad = ((hi - lo) * 0.05).max(1e-3);
    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE)
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0u64..max_step, (lo - pad)..(hi + pad))
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss (nats/token)")
        .draw()
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    let blue = RGBColor(70, 110, 200);
    chart
        .draw_series(LineSeries::new(
            train.iter().filter(finite).copied(),
            blue.stroke_width(1),
        ))
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?
        .label("train")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], blue));
    let red = RGBColor(210, 60, 40);
    chart
        .draw_series(LineSeries::new(
            val.iter().filter(finite).copied(),
            red.stroke_width(2),
        ))
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?
        .label("validation")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], red));
    chart
        .draw_series(
            val.iter()
                .filter(finite)
                .map(|&(s, v)| Circle::new((s, v), 3, red.filled())),
        )
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    root.present().map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    Ok(())
}
