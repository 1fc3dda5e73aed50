//! The report of a comparison: `report.json`, `report.md` (the table with the verdicts) and the
//! plots.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Result;
use serde::Serialize;

use super::heatmap::numerics_plots;
use super::plan::RecipeSpec;
use super::plots::{curve_plots, lr_sensitivity_plot};
use super::rows::{relative_to_fp32, EntryReport};
use super::verdict::VERDICTS;
use crate::fsutil::write_atomic;

/// The whole report, as written to `report.json`.
#[derive(Debug, Serialize)]
pub struct Report {
    pub config: String,
    pub recipes: Vec<RecipeSpec>,
    pub entries: Vec<EntryReport>,
    pub plots: Vec<String>,
    pub verdicts: String,
}

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

/// The table and the verdicts, as markdown.
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
