//! Where a run reports: console lines that do not tear the progress bar, the step and
//! evaluation lines, `metrics.jsonl` and the loss plot.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::Result;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::RunOptions;
use crate::metrics::{Metrics, StepRecord};
use crate::numerics;
use crate::precision::LossScaler;

/// Console output that does not tear the progress bar.
pub(super) struct Console {
    pub bar: Option<ProgressBar>,
    pub verbose: bool,
}

impl Console {
    pub fn line(&self, s: &str) {
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
pub(super) fn progress_bar(opts: &RunOptions, steps: u64, position: u64) -> Option<ProgressBar> {
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

/// Where a run reports: console lines, `metrics.jsonl` and the loss plot (`metrics` is `None` on
/// the ranks of a run of processes that write nothing: all but rank 0).
pub(super) struct Logger {
    pub console: Console,
    pub metrics: Option<Metrics>,
    pub run_dir: PathBuf,
    pub plot_title: String,
}

impl Logger {
    pub fn line(&self, s: &str) {
        self.console.line(s);
    }

    /// Records a step in `metrics.jsonl` and prints its lines: the step line (when `log_line`),
    /// FP8 health or numerics, and the evaluation (which also redraws the plot).
    pub fn step(
        &mut self,
        r: &StepRecord,
        steps: u64,
        log_line: bool,
        scaler: &LossScaler,
        best_val: Option<f64>,
    ) -> Result<()> {
        if let Some(m) = &mut self.metrics {
            m.record(r)?;
        }
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
            if let Some(m) = &self.metrics {
                m.plot(&self.run_dir, &self.plot_title)?;
            }
        }
        Ok(())
    }
}

/// `x` in a few digits: 1.23M, 4.5k, 678.
pub(super) fn human(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// The log line of a ZeRO run: the stage, and how many parameters each rank (`names`) owns.
pub(super) fn zero_line(
    shard: &crate::parallel::zero::Shard,
    split: &crate::parallel::zero::Split,
    names: impl Iterator<Item = String>,
) -> String {
    let shares = names
        .zip(&split.owned)
        .map(|(name, n)| format!("{name} {}", human(*n as f64)))
        .collect::<Vec<_>>()
        .join(", ");
    if shard.stage == 3 {
        let fp8 = shard.row_shards().map_or(0, |r| r.fp8_wire_len());
        let wire = match fp8 {
            0 => String::new(),
            n => format!(
                "; the weights of the {n} projections computing in FP8 with block scales travel as FP8 codes \
                 and 128 x 128 block scales (half the bytes of bf16)"
            ),
        };
        return format!(
            "ZeRO-3: each GPU keeps its rows of every one of the {} parameters ({shares}): f32 master weights, \
             AdamW moments, gradients and compute copy; each block's weights are gathered just before it runs \
             (again for its backward with model.recompute = \"full\") and its gradients reduce-scattered as the \
             backward leaves it{wire}",
            human(split.total as f64),
        );
    }
    let kept = if shard.stage == 2 {
        "the f32 master weights, AdamW moments and averaged gradients"
    } else {
        "the f32 master weights and AdamW moments"
    };
    format!(
        "ZeRO-{}: each GPU keeps {kept} of its share of the {} parameters ({shares}); \
         the other weights it holds only as the compute copy",
        shard.stage,
        human(split.total as f64),
    )
}
