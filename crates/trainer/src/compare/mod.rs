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

//!
//! - [`plan`]: the recipes and the plan's entries;
//! - [`state`]: where an entry stands on disk;
//! - [`verdict`]: the stability verdict of a run;
//! - [`rows`]: the report's row of each entry;
//! - [`plots`] and [`heatmap`]: the curves and the per-layer numerics;
//! - [`report`]: `report.md`, `report.json` and the plots, written together.

pub mod heatmap;
pub mod plan;
pub mod plots;
pub mod report;
pub mod rows;
pub mod state;
pub mod verdict;

#[cfg(test)]
mod testing;

pub use heatmap::{numerics_grid, NumericsGrid};
pub use plan::{entry_dir, Entry, Plan, RecipeSpec, RECIPES};
pub use report::{write_report, Report};
pub use rows::{entry_report, EntryReport};
pub use state::{entry_state, mark_shared, EntryState, ERROR_FILE, SHARED_FILE};
pub use verdict::{stability, Stability, GRAD_SPIKE, GRAD_WINDOW, LOSS_SPIKE, VERDICTS};
