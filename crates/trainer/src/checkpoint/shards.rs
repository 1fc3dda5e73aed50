//! Sharded checkpoints, written by a run of one process per GPU under ZeRO: each rank writes the
//! parameters it owns (f32 masters and AdamW moments) from its own GPU, so that no rank ever holds
//! the whole state. Under ZeRO-3 every rank owns its rows of every parameter: each entry of its
//! file says which rows of the whole parameter it holds, and reading puts the rows together.
//!
//! Layout of `checkpoints/step_NNNNNNNN.shards/`:
//!
//! ```text
//! rank_00000.ckpt ... rank_WWWWW.ckpt   one per rank, each a checkpoint file of its parameters
//! manifest.json                         the step, the world size, the shard files, every parameter
//!                                       name in module order; written last, by rank 0
//! ```
//!
//! Each shard is written atomically (a temporary file renamed into place); rank 0 writes the
//! manifest once every rank has said its shard is in place, so a directory without a manifest is
//! an unfinished save and is neither listed nor read (the next save removes it). Reading checks
//! every shard's checksum, step and place, and assembles the whole checkpoint in module order:
//! resuming reads a sharded checkpoint as it reads a whole one, and [`consolidate`] writes that
//! whole checkpoint as one file.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

use super::{dir, file, prune, write_module, Header, ParamEntry, RowRange, SaveInfo, ShardOf};
use crate::optim::AdamW;

const MANIFEST: &str = "manifest.json";
const MANIFEST_VERSION: u32 = 1;

/// Directory name of the sharded checkpoint after `step` steps.
pub fn dir_name(step: u64) -> String {
    format!("step_{step:08}.shards")
}

/// File name of rank `rank`'s shard.
fn shard_file(rank: usize) -> String {
    format!("rank_{rank:05}.ckpt")
}

/// What rank 0 writes once every shard is in place.
#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    format_version: u32,
    step: u64,
    world: usize,
    /// The shard files, rank 0's first.
    files: Vec<String>,
    /// Every parameter's name, in module order.
    params: Vec<String>,
}

/// Whether a shard directory is complete (its manifest is in place).
pub fn is_sealed(shards: &Path) -> bool {
    shards.join(MANIFEST).is_file()
}

/// Writes rank `rank`'s shard of the checkpoint of step `info.step`: the parameters in `owned`,
/// with their moments (under ZeRO-3, `rows`: the rows of every parameter that `module` holds).
/// Every rank of the run calls it; then, once all have succeeded, rank 0 calls [`seal`].
pub fn save_shard<AB, M>(
    run_dir: &Path,
    module: &M,
    opt: &AdamW<AB::InnerBackend>,
    info: &SaveInfo<'_>,
    owned: &HashSet<ParamId>,
    rows: Option<&HashMap<ParamId, RowRange>>,
    rank: usize,
) -> Result<PathBuf>
where
    AB: AutodiffBackend,
    M: AutodiffModule<AB>,
{
    let d = dir(run_dir).join(dir_name(info.step));
    std::fs::create_dir_all(&d).with_context(|| format!("cannot create {}", d.display()))?;
    let shard = ShardOf {
        rank,
        world: info.world,
    };
    let path = d.join(shard_file(rank));
    write_module::<AB, M>(&path, module, opt, info, Some(owned), Some(shard), rows)
        .with_context(|| format!("cannot save checkpoint shard {}", path.display()))?;
    Ok(path)
}

/// On rank 0, after every rank's [`save_shard`] of step `step` succeeded: writes the manifest
/// (which makes the checkpoint complete), then keeps only the newest `keep` checkpoints.
pub fn seal<AB, M>(
    run_dir: &Path,
    module: &M,
    step: u64,
    world: usize,
    keep: usize,
) -> Result<PathBuf>
where
    AB: AutodiffBackend,
    M: AutodiffModule<AB>,
{
    let d = dir(run_dir).join(dir_name(step));
    let files: Vec<String> = (0..world).map(shard_file).collect();
    if let Some(missing) = files.iter().find(|f| !d.join(f).is_file()) {
        bail!(
            "checkpoint shard {} is missing although its rank reported it written; the checkpoint of step {step} is incomplete",
            d.join(missing).display()
        );
    }
    let manifest = Manifest {
        format_version: MANIFEST_VERSION,
        step,
        world,
        files,
        params: param_names::<AB, M>(module),
    };
    let json = serde_json::to_vec_pretty(&manifest).expect("a manifest serialises");
    crate::fsutil::write_atomic(&d.join(MANIFEST), &json)
        .with_context(|| format!("cannot write {}", d.join(MANIFEST).display()))?;
    prune(run_dir, keep, &d)?;
    Ok(d)
}

/// Reads a sharded checkpoint as the whole checkpoint it makes up: the first shard's header (with
/// no shard) and every parameter in module order, each from the shard that holds it.
pub fn read(d: &Path) -> Result<(Header, Vec<f32>)> {
    let m = d.join(MANIFEST);
    if !m.is_file() {
        bail!(
            "{} is an unfinished sharded checkpoint: it has no {MANIFEST} (a save that did not complete); use an earlier checkpoint",
            d.display()
        );
    }
    let manifest: Manifest = std::fs::read(&m)
        .with_context(|| format!("cannot read {}", m.display()))
        .and_then(|b| {
            serde_json::from_slice(&b).with_context(|| format!("{} is not a manifest", m.display()))
        })?;
    if manifest.world == 0 || manifest.files.len() != manifest.world {
        bail!(
            "{} lists {} shard files for {} ranks",
            m.display(),
            manifest.files.len(),
            manifest.world
        );
    }
    let mut first: Option<Header> = None;
    // Each parameter's entry and values, by name; ZeRO-3's row shards of each, by name.
    let mut found: HashMap<String, (ParamEntry, Vec<f32>)> = HashMap::new();
    let mut pieces: HashMap<String, Vec<(ParamEntry, Vec<f32>)>> = HashMap::new();
    for (rank, name) in manifest.files.iter().enumerate() {
        let path = d.join(name);
        let (header, values) = file::read(&path)?;
        let want = ShardOf {
            rank,
            world: manifest.world,
        };
        if header.shard != Some(want) || header.step != manifest.step {
            bail!(
                "{} is not rank {rank}'s shard of step {} of {} ranks (it says {:?}, step {})",
                path.display(),
                manifest.step,
                manifest.world,
                header.shard,
                header.step
            );
        }
        if let Some(f) = &first {
            let same = (f.seed, f.optimizer_step, &f.model, f.devices)
                == (
                    header.seed,
                    header.optimizer_step,
                    &header.model,
                    header.devices,
                );
            if !same {
                bail!(
                    "{} belongs to another run or step than rank 0's shard (seed, model, optimizer step or GPU count differ)",
                    path.display()
                );
            }
        }
        let mut at = 0;
        for entry in &header.params {
            let n = entry.stored_values();
            let name = entry.name.clone();
            let values = values[at..at + n].to_vec();
            at += n;
            if entry.rows.is_some() {
                pieces
                    .entry(name)
                    .or_default()
                    .push((entry.clone(), values));
                continue;
            }
            if found
                .insert(name.clone(), (entry.clone(), values))
                .is_some()
            {
                bail!("parameter {name} is in two shards of {}", d.display());
            }
        }
        first.get_or_insert(header);
    }
    for (name, p) in pieces {
        let whole = assemble(&name, p).with_context(|| format!("in {}", d.display()))?;
        if found.insert(name.clone(), whole).is_some() {
            bail!("parameter {name} is in two shards of {}", d.display());
        }
    }
    let mut header = first.expect("at least one shard");
    header.shard = None;
    header.params = Vec::with_capacity(manifest.params.len());
    let mut values = Vec::new();
    for name in &manifest.params {
        let Some((entry, v)) = found.remove(name) else {
            bail!(
                "parameter {name} of {} is in none of its shards",
                d.display()
            );
        };
        header.params.push(entry);
        values.extend(v);
    }
    if let Some(extra) = found.keys().next() {
        bail!(
            "{} holds parameter {extra}, which its manifest does not list",
            d.display()
        );
    }
    Ok((header, values))
}

/// The whole parameter `name` from its ZeRO-3 row shards (each its value, then its moments when
/// it has them): the shards in row order, trimmed to the parameter's rows. They must cover every
/// row once, with the same row width and the same moments.
fn assemble(name: &str, mut pieces: Vec<(ParamEntry, Vec<f32>)>) -> Result<(ParamEntry, Vec<f32>)> {
    pieces.sort_by_key(|(e, _)| e.rows.map_or(0, |r| r.start));
    let first = pieces[0].0.clone();
    let of = first.rows.map_or(0, |r| r.of);
    let row_width: usize = first.shape.iter().skip(1).product();
    let mut next = 0;
    for (e, _) in &pieces {
        let r = e.rows.expect("row shards only");
        let same = r.of == of
            && e.shape.get(1..) == first.shape.get(1..)
            && e.has_moments == first.has_moments;
        if !same || r.start != next || e.shape.is_empty() {
            bail!(
                "the row shards of parameter {name} do not fit together (a shard of rows {}.. of {} shaped {:?}, expected rows {next}.. of {of} shaped like {:?})",
                r.start,
                r.of,
                e.shape,
                first.shape
            );
        }
        next += e.shape[0];
    }
    if next < of {
        bail!("the row shards of parameter {name} hold {next} of its {of} rows");
    }
    // Each shard's payload holds its value, then m and v; the whole one holds each of them
    // whole, trimmed to `of` rows.
    let parts = if first.has_moments { 3 } else { 1 };
    let mut values = Vec::with_capacity(of * row_width * parts);
    for part in 0..parts {
        let mut this: Vec<f32> = Vec::with_capacity(next * row_width);
        for (e, v) in &pieces {
            let n = e.shape[0] * row_width;
            this.extend_from_slice(&v[part * n..(part + 1) * n]);
        }
        values.extend_from_slice(&this[..of * row_width]);
    }
    let mut shape = first.shape.clone();
    shape[0] = of;
    let entry = ParamEntry {
        name: name.to_string(),
        shape,
        has_moments: first.has_moments,
        rows: None,
    };
    Ok((entry, values))
}

/// Writes the whole checkpoint that the sharded checkpoint `shards` makes up as one checkpoint
/// file at `out` (atomically), readable by every tool that reads checkpoints.
pub fn consolidate(shards: &Path, out: &Path) -> Result<Header> {
    let (header, values) = read(shards)?;
    crate::fsutil::replace_with(out, |tmp| file::write(tmp, &header, &values))
        .with_context(|| format!("cannot write {}", out.display()))?;
    Ok(header)
}

/// Every parameter's name (its module path), in module order.
fn param_names<AB: AutodiffBackend, M: AutodiffModule<AB>>(module: &M) -> Vec<String> {
    struct Names {
        path: Vec<String>,
        names: Vec<String>,
    }
    impl<B: burn::tensor::backend::Backend> ModuleVisitor<B> for Names {
        fn enter_module(&mut self, name: &str, _container: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, _param: &Param<Tensor<B, D>>) {
            self.names.push(self.path.join("."));
        }
    }
    let mut n = Names {
        path: Vec::new(),
        names: Vec::new(),
    };
    module.visit(&mut n);
    n.names
}
