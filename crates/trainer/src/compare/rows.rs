//! One row of the report per entry, read from its run directory: best and final validation
//! loss, speed, loss scale, memory and the stability verdict; then each entry against the fp32
//! entry at the same learning rate and seed.

use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;

use super::plan::Entry;
use super::state::{shared_jobs, ERROR_FILE};
use super::verdict::{stability, Stability};
use crate::metrics::StepRecord;

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

/// Each entry's best validation loss and tokens/s against the fp32 entry at the same learning rate
/// and seed.
pub(super) fn relative_to_fp32(entries: &mut [EntryReport]) {
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
