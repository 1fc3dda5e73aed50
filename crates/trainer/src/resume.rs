//! Resuming a run: which checkpoint it continues from, and the rules that keep a resumed run the
//! same run. (The checkpoint file itself, and whether it fits the model, is `checkpoint`'s.)

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

use crate::checkpoint::{self, Header};
use crate::config::Config;

/// Reads the newest of a run directory's checkpoints (`existing`, oldest first, as
/// [`checkpoint::list`] gives them). A damaged newest file is an error that names the previous
/// complete one.
pub fn newest(run_dir: &Path, existing: &[(u64, PathBuf)]) -> Result<(PathBuf, Header, Vec<f32>)> {
    let Some((_, path)) = existing.last() else {
        bail!(
            "--resume {}: no checkpoint in {}; the run stopped before its first checkpoint, start it again",
            run_dir.display(),
            checkpoint::dir(run_dir).display()
        );
    };
    let (header, values) = checkpoint::read(path).map_err(|e| {
        match existing.len().checked_sub(2).map(|i| &existing[i]) {
            Some((step, older)) => e.context(format!(
                "the previous checkpoint (step {step}) is {}; move the damaged one away to resume from it",
                older.display()
            )),
            None => e,
        }
    })?;
    Ok((path.clone(), header, values))
}

/// Whether training `cfg` may continue from a checkpoint with `header`: the batches of a resumed
/// run are functions of the seed, the batch shape and the data, so changing any of them would
/// silently continue a different run; and a recipe switched mid-run is a different experiment
/// (master weights are f32 whatever the recipe). `world`: the GPUs this run trains on (threads of
/// one process or processes). Each GPU reads its own rows of every micro-batch's windows, drawn as
/// one global batch of `GPUs x training.batch_size`, so the run may continue on another number of
/// GPUs as long as that product stays the same (4 GPUs x 8 sequences continue as 2 x 16): it reads
/// the same training data, and the checkpoint (a sharded one too) is read whole and shared out
/// again. What changes with the count: the dropout masks (drawn per GPU), the order in which the
/// mean gradient adds up (rounding), and the validation batches (`training.batch_size` sequences
/// each; the session restarts the best validation loss). The error lists every difference.
pub fn check_continues(
    header: &Header,
    cfg: &Config,
    world: usize,
) -> std::result::Result<(), String> {
    let mut differ = Vec::new();
    if header.seed != cfg.seed {
        differ.push(format!("seed = {} (this run: {})", header.seed, cfg.seed));
    }
    // Checkpoints of runs of processes written before they recorded their world size say 1 GPU;
    // their replicas' checksums (one per rank) tell how many trained.
    let recorded = header.devices.max(header.replica_checksums.len());
    let batch = cfg.training.batch_size;
    if recorded * header.batch_size != world * batch {
        let gpus = |n: usize| format!("{n} GPU{}", if n == 1 { "" } else { "s" });
        differ.push(format!(
            "{} x training.batch_size = {} = {} sequences per micro-batch (this run: {} x {batch} = {}; \
             the GPU count may change when that product does not)",
            gpus(recorded),
            header.batch_size,
            recorded * header.batch_size,
            gpus(world),
            world * batch
        ));
    }
    if header.grad_accum != cfg.training.grad_accum {
        differ.push(format!(
            "training.grad_accum = {} (this run: {})",
            header.grad_accum, cfg.training.grad_accum
        ));
    }
    if header.data != cfg.data {
        differ.push("the [data] section".to_string());
    }
    if header.precision_kind() != cfg.precision {
        differ.push(format!(
            "precision = \"{}\" (this run: \"{}\")",
            header.precision_kind(),
            cfg.precision
        ));
    }
    if differ.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "it was trained with {}; resuming with other values would not continue the same run",
            differ.join(", ")
        ))
    }
}
