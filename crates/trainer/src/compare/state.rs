//! Where an entry stands on disk: done, failed (its error kept), resumable or new; and whether
//! it trained beside other entries on the same device.

use std::path::Path;

use anyhow::{Context, Result};

use crate::config::Config;

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
pub(super) fn shared_jobs(dir: &Path) -> Option<usize> {
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
