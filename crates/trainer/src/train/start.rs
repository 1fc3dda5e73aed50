//! What a session does before its first step: the memory estimate and check, the data and the
//! vocabulary, and restoring a checkpoint.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use burn::tensor::FloatDType;
use model::Gpt;

use super::log::Console;
use super::RunOptions;
use crate::checkpoint;
use crate::config::Config;
use crate::data::Dataset;
use crate::memory_plan::{self, MemoryPlan};
use crate::optim::AdamW;
use crate::parallel::fsdp::RowShards;

/// Prints the memory estimate per GPU and, on CUDA with `training.memory_check`, stops the run
/// before anything is allocated when a device has less free.
pub(super) fn check_memory<D>(
    cfg: &Config,
    opts: &RunOptions,
    vocab: usize,
    compute_dtype: FloatDType,
    devices: &[(D, usize)],
    console: &Console,
) -> Result<()> {
    let compute_bytes = if compute_dtype == FloatDType::F32 {
        4
    } else {
        2
    };
    // The GPUs that share the state: a run of processes has one device per process.
    let gpus = opts.place.as_ref().map_or(devices.len(), |p| p.world_size);
    let plan = MemoryPlan::estimate(cfg, vocab, compute_bytes, gpus);
    let cuda = opts.device_name.starts_with("CUDA");
    let free = devices
        .iter()
        .filter(|_| cuda)
        .filter_map(|(_, index)| memory_plan::cuda_free_bytes(*index).map(|f| (*index, f)))
        .min_by_key(|(_, f)| *f);
    match free {
        Some((index, bytes)) => {
            console.line(&format!(
                "memory estimate: {}; {:.1} GiB free on CUDA device {index}",
                plan.describe(),
                bytes as f64 / (1u64 << 30) as f64
            ));
            if cfg.training.memory_check {
                plan.check(bytes, cfg, gpus)?;
            }
        }
        None => console.line(&format!("memory estimate: {}", plan.describe())),
    }
    Ok(())
}

/// The data and tokenizer (a resumed run reuses its saved tokenizer) and the model's vocabulary
/// size. Creates the run directory once the data is usable, so a bad data path leaves no empty
/// run directory behind. `writes`: whether this rank saves the tokenizer (rank 0 of a run of
/// processes).
pub(super) fn load_data(
    cfg: &Config,
    opts: &RunOptions,
    writes: bool,
    console: &Console,
) -> Result<(Dataset, usize)> {
    let run_dir = &opts.run_dir;
    let tok_path = run_dir.join("tokenizer.json");
    let t_data = Instant::now();
    let reuse = (opts.resume && tok_path.exists()).then_some(tok_path.as_path());
    let data = Dataset::build(cfg, reuse)?;
    std::fs::create_dir_all(run_dir)
        .with_context(|| format!("cannot create run directory {}", run_dir.display()))?;
    if reuse.is_none() && writes {
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

/// Restores the newest of `existing` checkpoints into the model and optimizer; under ZeRO-3
/// (`rows`) the model is cut to this rank's rows and so are the values read into it.
pub(super) fn resume<B: crate::TrainBackend>(
    opts: &RunOptions,
    existing: &[(u64, PathBuf)],
    (model, rows): (Gpt<B>, Option<&RowShards>),
    opt: &mut AdamW<B::InnerBackend>,
    cfg: &Config,
    vocab: usize,
    console: &Console,
) -> Result<(Gpt<B>, checkpoint::Restored)> {
    let (path, header, values) = crate::resume::newest(&opts.run_dir, existing)?;
    let world = match &opts.place {
        Some(place) => place.world_size,
        None => cfg.training.devices.count().unwrap_or(1),
    };
    crate::resume::check_continues(&header, cfg, world).map_err(|why| {
        anyhow::anyhow!("checkpoint {} does not fit this run: {why}", path.display())
    })?;
    // On another GPU count the batch size changed with it, and so did the validation batches
    // (`training.batch_size` sequences each): the best validation loss so far measured others.
    let other_eval = header.batch_size != cfg.training.batch_size;
    let was_batch = header.batch_size;
    let ranges = rows.map(RowShards::ranges);
    let into = (model, ranges.as_ref());
    let (model, mut restored) =
        checkpoint::apply::<B, _>(&path, header, values, into, opt, &cfg.model, vocab)?;
    console.line(&format!(
        "resumed from {} (step {})",
        restored.path.display(),
        restored.step
    ));
    if other_eval && restored.best_val_loss.take().is_some() {
        console.line(&format!(
            "validation batches now hold {} sequences (they held {was_batch}): the best validation loss starts afresh",
            cfg.training.batch_size
        ));
    }
    Ok((model, restored))
}
