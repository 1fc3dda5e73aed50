//! Checkpoints: the model, the optimizer state and the run's position in one self-checking file.
//!
//! Layout of `checkpoints/step_NNNNNNNN.ckpt`:
//!
//! ```text
//! b"BMXCKPT1" | header length: u64 LE | header: JSON | tensors: f32 LE, in header order | CRC32 of all before: u32 LE
//! ```
//!
//! A checkpoint is written to a hidden temporary file, flushed to disk, then renamed into place, so
//! a file with the final name is always complete; a crash leaves at most a stray temporary file,
//! which the next save removes. Loading verifies the CRC and refuses a damaged file or one whose
//! model shape differs from the config, saying which.
//!
//! Batches, dropout masks and the learning rate are pure functions of (seed, step), so `step` is
//! all the data-loader and RNG position a resumed run needs.
//!
//! A run of one process per GPU under ZeRO writes sharded checkpoints instead
//! (`checkpoints/step_NNNNNNNN.shards/`, [`shards`]): each rank its own parameters in this format,
//! then rank 0 a manifest. [`list`] and [`read`] take either form; a sharded one reads as the
//! whole checkpoint it makes up.

mod file;
pub mod shards;

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use model::GptConfig;
use serde::{Deserialize, Serialize};

use crate::config::{Config, DataConfig};
use crate::host_copy;
use crate::optim::{to_prim, to_tensor, with_grad, AdamW, Moments};
use crate::precision::{PrecisionKind, Recipe, ScalerState};

const FORMAT_VERSION: u32 = 1;

/// One parameter as stored.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ParamEntry {
    /// Module path, e.g. `blocks.0.attn.qkv.weight`.
    pub name: String,
    pub shape: Vec<usize>,
    /// Whether AdamW moments (m, v) follow the value.
    pub has_moments: bool,
    /// In a ZeRO-3 shard: which rows of the whole parameter these are (`shape` is the shard's,
    /// padded with zero rows past the parameter's end). Absent for a whole parameter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<RowRange>,
}

impl ParamEntry {
    /// The f32 values the payload holds for this parameter: its value, then m and v when it has
    /// moments.
    pub fn stored_values(&self) -> usize {
        self.shape.iter().product::<usize>() * if self.has_moments { 3 } else { 1 }
    }
}

/// Rows `start ..` of a whole parameter of `of` rows: a ZeRO-3 rank's row shard.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct RowRange {
    pub start: usize,
    pub of: usize,
}

/// Everything in a checkpoint besides the tensor payload.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Header {
    pub format_version: u32,
    /// Optimizer steps completed.
    pub step: u64,
    pub seed: u64,
    /// What decides the batch stream besides the seed; a resumed run must use the same.
    pub batch_size: usize,
    pub grad_accum: usize,
    pub data: DataConfig,
    pub model: GptConfig,
    pub vocab_size: usize,
    /// AdamW's bias-correction step counter.
    pub optimizer_step: u64,
    pub best_val_loss: Option<f64>,
    /// Training wall time so far, seconds.
    pub elapsed_s: f64,
    /// Precision recipe of the run (absent in checkpoints written before recipes existed: fp32).
    #[serde(default)]
    pub precision: Option<Recipe>,
    /// Loss-scaler state after `step` steps.
    #[serde(default)]
    pub loss_scaler: Option<ScalerState>,
    /// FP8 delayed scaling (`fp8.amax_history`): rank 0's amax histories after `step` steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_amax_history: Option<AmaxHistoryRecord>,
    /// GPUs the run trains on (`training.devices`); each computes its share of every batch.
    #[serde(default = "one")]
    pub devices: usize,
    /// A data-parallel run: the CRC-32 of each rank's weights when this checkpoint was written
    /// (rank 0's are the ones saved, or under ZeRO each owner's share); equal when the replicas
    /// stayed identical.
    #[serde(default)]
    pub replica_checksums: Vec<u32>,
    /// A shard of a sharded checkpoint ([`shards`]): whose, of how many. `None` for a whole
    /// checkpoint (and for the whole that a sharded one reads as).
    #[serde(default)]
    pub shard: Option<ShardOf>,
    pub params: Vec<ParamEntry>,
}

/// The FP8 amax histories of delayed scaling (`kernels::Fp8AmaxHistoryState`): per projection
/// tensor (`blocks.N.attn.qkv.input`, ...), its amaxes of the last `len` steps, oldest first.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct AmaxHistoryRecord {
    pub len: usize,
    pub steps: u64,
    pub sites: Vec<(String, Vec<f32>)>,
}

impl From<kernels::Fp8AmaxHistoryState> for AmaxHistoryRecord {
    fn from(s: kernels::Fp8AmaxHistoryState) -> Self {
        Self {
            len: s.len,
            steps: s.steps,
            sites: s.sites,
        }
    }
}

impl From<&AmaxHistoryRecord> for kernels::Fp8AmaxHistoryState {
    fn from(r: &AmaxHistoryRecord) -> Self {
        Self {
            len: r.len,
            steps: r.steps,
            sites: r.sites.clone(),
        }
    }
}

/// Rank `rank`'s shard of a checkpoint of `world` ranks.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct ShardOf {
    pub rank: usize,
    pub world: usize,
}

/// What a checkpoint records besides the model and optimizer state.
pub struct SaveInfo<'a> {
    pub cfg: &'a Config,
    pub vocab_size: usize,
    /// Optimizer steps completed.
    pub step: u64,
    pub best_val_loss: Option<f64>,
    /// Training wall time so far, seconds.
    pub elapsed_s: f64,
    pub precision: (&'a Recipe, &'a ScalerState),
    /// A data-parallel run: each rank's weights checksum, rank 0's first.
    pub replica_checksums: &'a [u32],
    /// How many GPUs train (threads of one process, or processes); each reads its share of every
    /// batch.
    pub world: usize,
    /// FP8 delayed scaling: rank 0's amax histories.
    pub fp8_amax_history: Option<&'a AmaxHistoryRecord>,
}

fn one() -> usize {
    1
}

impl Header {
    /// The precision the checkpoint was trained with.
    pub fn precision_kind(&self) -> PrecisionKind {
        self.precision
            .as_ref()
            .map_or(PrecisionKind::Fp32, Recipe::kind)
    }
}

/// Run position restored from a checkpoint.
#[derive(Debug, Clone)]
pub struct Restored {
    pub step: u64,
    pub best_val_loss: Option<f64>,
    pub elapsed_s: f64,
    pub loss_scaler: Option<ScalerState>,
    /// FP8 delayed scaling: the amax histories.
    pub fp8_amax_history: Option<AmaxHistoryRecord>,
    /// The recipe the checkpoint was trained with.
    pub precision: Option<Recipe>,
    pub path: PathBuf,
}

/// `checkpoints/` inside a run directory.
pub fn dir(run_dir: &Path) -> PathBuf {
    run_dir.join("checkpoints")
}

/// File name of the checkpoint after `step` steps.
pub fn file_name(step: u64) -> String {
    format!("step_{step:08}.ckpt")
}

/// Complete checkpoints in a run directory, oldest first.
pub fn list(run_dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let d = dir(run_dir);
    let mut out = Vec::new();
    if !d.exists() {
        return Ok(out);
    }
    for entry in fs::read_dir(&d).with_context(|| format!("cannot list {}", d.display()))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix("step_") else {
            continue;
        };
        let step = match (rest.strip_suffix(".ckpt"), rest.strip_suffix(".shards")) {
            (Some(step), _) => step,
            // A sharded checkpoint is complete once its manifest is in place.
            (None, Some(step)) if shards::is_sealed(&entry.path()) => step,
            _ => continue,
        };
        if let Ok(step) = step.parse::<u64>() {
            out.push((step, entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// Visits the parameters (those in `only`, when given) in module order: the first pass records
/// each one's entry for the header; the second, given the file's writer, writes each one's value
/// and moments, a piece of a tensor at a time.
struct Collect<'a, B: Backend> {
    path: Vec<String>,
    opt: &'a AdamW<B>,
    only: Option<&'a HashSet<ParamId>>,
    rows: Option<&'a HashMap<ParamId, RowRange>>,
    entries: Vec<ParamEntry>,
    out: Option<file::Writer>,
    /// The second pass's first write error (later tensors are skipped).
    error: Option<io::Error>,
}

impl<B: Backend> Collect<'_, B> {
    /// Writes `t`'s values as f32, read from the device in pieces ([`crate::host_copy`]).
    fn write<const D: usize>(&mut self, t: Tensor<B, D>) {
        let (Some(out), None) = (self.out.as_mut(), &self.error) else {
            return;
        };
        if let Err(e) = host_copy::read_pieces(t, |piece| out.values(piece)) {
            self.error = Some(e);
        }
    }
}

impl<AB: AutodiffBackend> ModuleVisitor<AB> for Collect<'_, AB::InnerBackend> {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
        if self.only.is_some_and(|only| !only.contains(&param.id)) {
            return;
        }
        let value = param.val().inner();
        let moments = self.opt.moments.get(&param.id);
        if self.out.is_none() {
            self.entries.push(ParamEntry {
                // The path's last element is the field holding this parameter.
                name: self.path.join("."),
                shape: value.dims().to_vec(),
                has_moments: moments.is_some(),
                rows: self.rows.and_then(|r| r.get(&param.id)).copied(),
            });
            return;
        }
        self.write(value);
        if let Some(m) = moments {
            self.write(to_tensor::<AB::InnerBackend, D>(&m.m));
            self.write(to_tensor::<AB::InnerBackend, D>(&m.v));
        }
    }
}

/// Writes a checkpoint atomically and keeps only the newest `keep` complete ones.
pub fn save<AB, M>(
    run_dir: &Path,
    module: &M,
    opt: &AdamW<AB::InnerBackend>,
    info: &SaveInfo<'_>,
    keep: usize,
) -> Result<PathBuf>
where
    AB: AutodiffBackend,
    M: AutodiffModule<AB>,
{
    let d = dir(run_dir);
    fs::create_dir_all(&d).with_context(|| format!("cannot create {}", d.display()))?;
    let final_path = d.join(file_name(info.step));
    write_module::<AB, M>(&final_path, module, opt, info, None, None, None)
        .with_context(|| format!("cannot save checkpoint {}", final_path.display()))?;
    prune(run_dir, keep, &final_path)?;
    Ok(final_path)
}

/// Writes a checkpoint of `module` and `opt` to `path` atomically, streaming each tensor in pieces
/// (only the parameters in `only`, when given; `shard` records whose shard that is, and `rows`
/// which rows of each parameter it holds under ZeRO-3).
fn write_module<AB, M>(
    path: &Path,
    module: &M,
    opt: &AdamW<AB::InnerBackend>,
    info: &SaveInfo<'_>,
    only: Option<&HashSet<ParamId>>,
    shard: Option<ShardOf>,
    rows: Option<&HashMap<ParamId, RowRange>>,
) -> Result<()>
where
    AB: AutodiffBackend,
    M: AutodiffModule<AB>,
{
    let mut c = Collect::<AB::InnerBackend> {
        path: Vec::new(),
        opt,
        only,
        rows,
        entries: Vec::new(),
        out: None,
        error: None,
    };
    module.visit(&mut c);
    let cfg = info.cfg;
    let header = Header {
        format_version: FORMAT_VERSION,
        step: info.step,
        seed: cfg.seed,
        batch_size: cfg.training.batch_size,
        grad_accum: cfg.training.grad_accum,
        data: cfg.data.clone(),
        model: cfg.model.clone(),
        vocab_size: info.vocab_size,
        optimizer_step: opt.step,
        best_val_loss: info.best_val_loss,
        elapsed_s: info.elapsed_s,
        precision: Some(info.precision.0.clone()),
        loss_scaler: Some(info.precision.1.clone()),
        fp8_amax_history: info.fp8_amax_history.cloned(),
        devices: info.world,
        replica_checksums: info.replica_checksums.to_vec(),
        shard,
        params: std::mem::take(&mut c.entries),
    };
    crate::fsutil::replace_with(path, |tmp| {
        c.out = Some(file::Writer::create(tmp, &header)?);
        module.visit(&mut c);
        let out = c.out.take().expect("the writer stays until the pass ends");
        c.error
            .take()
            .map_or(Ok(()), Err)
            .and_then(|()| out.finish())
            .with_context(|| format!("cannot write {}", tmp.display()))
    })
}

/// After `written` (a checkpoint file or a sealed shard directory) is in place: removes stray
/// temporaries of crashed saves, shard directories that never got their manifest and are older
/// than `written`, and the checkpoints of every step but the newest `keep` (each step's every
/// form: its file and its shard directory); `written` itself always stays.
pub(crate) fn prune(run_dir: &Path, keep: usize, written: &Path) -> Result<()> {
    let d = dir(run_dir);
    let tmp = crate::fsutil::temp_path(written);
    let all = list(run_dir)?;
    let newest = all.last().map_or(0, |(s, _)| *s);
    for entry in fs::read_dir(&d)?.flatten() {
        let n = entry.file_name().to_string_lossy().to_string();
        if n.starts_with('.') && n.ends_with(".tmp") && entry.path() != tmp {
            let _ = fs::remove_file(entry.path());
        }
        let unsealed_step = n
            .strip_prefix("step_")
            .and_then(|r| r.strip_suffix(".shards"))
            .and_then(|s| s.parse::<u64>().ok())
            .filter(|_| !shards::is_sealed(&entry.path()));
        if unsealed_step.is_some_and(|s| s < newest) {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
    let mut steps: Vec<u64> = all.iter().map(|(s, _)| *s).collect();
    steps.dedup();
    let kept = &steps[steps.len().saturating_sub(keep.max(1))..];
    for (step, p) in &all {
        if kept.contains(step) || p == written {
            continue;
        }
        let _ = if p.is_dir() {
            fs::remove_dir_all(p)
        } else {
            fs::remove_file(p)
        };
    }
    Ok(())
}

/// Reads and verifies a checkpoint (a file, or a sharded checkpoint's directory, which reads as
/// the whole checkpoint its shards make up); returns its header and tensor payload.
pub fn read(path: &Path) -> Result<(Header, Vec<f32>)> {
    if path.is_dir() {
        return shards::read(path);
    }
    file::read(path)
}

/// Writes values from a checkpoint into the module's parameters, in module order, checking each
/// name and shape; returns the parameter ids in that order and the moments read. With `rows`, a
/// parameter found there is a row shard of the whole one (ZeRO-3): it receives those rows of the
/// checkpoint's values, zero rows where they run out, and its moments likewise.
struct Restore<'a, B: Backend> {
    path: Vec<String>,
    header: &'a Header,
    values: &'a [f32],
    rows: Option<&'a HashMap<ParamId, RowRange>>,
    cursor: usize,
    index: usize,
    moments: Vec<(ParamId, Moments<B>)>,
    error: Option<String>,
}

impl<B: Backend> Restore<'_, B> {
    /// The next whole value of shape `whole`, or with `cut` (its first row and row count) those
    /// rows of it, zero rows where the value's run out; cut on the host, so that only the rows
    /// reach the device.
    fn take<const D: usize>(
        &mut self,
        whole: &[usize],
        cut: Option<(usize, usize)>,
        device: &B::Device,
    ) -> Tensor<B, D> {
        let n: usize = whole.iter().product();
        let value = &self.values[self.cursor..self.cursor + n];
        self.cursor += n;
        let Some((start, count)) = cut else {
            return Tensor::from_data(TensorData::new(value.to_vec(), whole.to_vec()), device);
        };
        let per_row: usize = whole[1..].iter().product();
        let have = whole[0].saturating_sub(start).min(count);
        let mut v = vec![0f32; count * per_row];
        // A rank whose rows all lie past the parameter's end (`have` 0) keeps only padding.
        if have > 0 {
            v[..have * per_row].copy_from_slice(&value[start * per_row..(start + have) * per_row]);
        }
        let mut shape = whole.to_vec();
        shape[0] = count;
        Tensor::from_data(TensorData::new(v, shape), device)
    }
}

impl<AB: AutodiffBackend> ModuleMapper<AB> for Restore<'_, AB::InnerBackend> {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.pop();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        if self.error.is_some() {
            return param;
        }
        let name = self.path.join(".");
        let (id, tensor, mapper) = param.consume();
        // A row shard's whole shape, and its rows.
        let range = self.rows.and_then(|r| r.get(&id));
        let cut = range.map(|r| (r.start, tensor.dims()[0]));
        let mut shape = tensor.dims().to_vec();
        if let Some(r) = range {
            shape[0] = r.of;
        }
        let Some(entry) = self.header.params.get(self.index) else {
            self.error = Some(format!(
                "the model has more parameters than the checkpoint's {}",
                self.header.params.len()
            ));
            return Param::from_mapped_value(id, tensor, mapper);
        };
        if entry.name != name || entry.shape != shape {
            self.error = Some(format!(
                "parameter {} is `{}` {:?} in the checkpoint but `{}` {:?} in the model",
                self.index, entry.name, entry.shape, name, shape
            ));
            return Param::from_mapped_value(id, tensor, mapper);
        }
        self.index += 1;
        let device = tensor.clone().inner().device();
        let value = self.take::<D>(&shape, cut, &device);
        if entry.has_moments {
            let m = to_prim(self.take::<D>(&shape, cut, &device));
            let v = to_prim(self.take::<D>(&shape, cut, &device));
            self.moments.push((id, Moments { m, v }));
        }
        let out = with_grad(Tensor::<AB, D>::from_inner(value), tensor.is_require_grad());
        Param::from_mapped_value(id, out, mapper)
    }
}

/// Writes a checkpoint read by [`read`] (from `path`) into `module` and `opt`, after checking that
/// it holds a model of this configuration and vocabulary. (Whether training may continue from it
/// is `crate::resume`'s question.) With `rows` (ZeRO-3: `RowShards::ranges`), `module` is cut
/// to a rank's row shards, which receive their rows of the whole values, moments included.
pub fn apply<AB, M>(
    path: &Path,
    header: Header,
    values: Vec<f32>,
    (module, rows): (M, Option<&HashMap<ParamId, RowRange>>),
    opt: &mut AdamW<AB::InnerBackend>,
    model: &GptConfig,
    vocab_size: usize,
) -> Result<(M, Restored)>
where
    AB: AutodiffBackend,
    M: AutodiffModule<AB>,
{
    let incompatible =
        |why: String| anyhow!("checkpoint {} does not fit this run: {why}", path.display());
    // The vocabulary is compared below; where a fresh run's weights came from is not the model.
    let mut saved = header.model.clone();
    (saved.vocab_size, saved.init_from) = (0, String::new());
    let mut ours = model.clone();
    (ours.vocab_size, ours.init_from) = (0, String::new());
    if saved != ours {
        let a = toml::to_string(&saved).unwrap_or_default();
        let b = toml::to_string(&ours).unwrap_or_default();
        let diff: Vec<String> = a
            .lines()
            .zip(b.lines())
            .filter(|(x, y)| x != y)
            .map(|(x, y)| format!("checkpoint `{x}` vs config `{y}`"))
            .collect();
        return Err(incompatible(format!(
            "the [model] section differs: {}",
            diff.join("; ")
        )));
    }
    if header.vocab_size != vocab_size {
        return Err(incompatible(format!(
            "vocabulary of {} tokens in the checkpoint, {vocab_size} in this run",
            header.vocab_size
        )));
    }
    let mut r = Restore::<AB::InnerBackend> {
        path: Vec::new(),
        header: &header,
        values: &values,
        rows,
        cursor: 0,
        index: 0,
        moments: Vec::new(),
        error: None,
    };
    let module = module.map(&mut r);
    if let Some(e) = r.error {
        return Err(incompatible(e));
    }
    if r.index != header.params.len() {
        return Err(incompatible(format!(
            "the checkpoint holds {} parameters, the model {}",
            header.params.len(),
            r.index
        )));
    }
    opt.moments = r.moments.into_iter().collect();
    opt.step = header.optimizer_step;
    Ok((
        module,
        Restored {
            step: header.step,
            best_val_loss: header.best_val_loss,
            elapsed_s: header.elapsed_s,
            loss_scaler: header.loss_scaler.clone(),
            fp8_amax_history: header.fp8_amax_history.clone(),
            precision: header.precision.clone(),
            path: path.to_path_buf(),
        },
    ))
}
