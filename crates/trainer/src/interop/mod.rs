//! Hugging Face checkpoints both ways: [`export`] writes a run's checkpoint as a
//! `LlamaForCausalLM` directory (`model.safetensors`, sharded above 5 GB, `config.json`,
//! `generation_config.json`, the run's `tokenizer.json`), and [`init_from`] starts a model from
//! such a directory (`model.init_from`), checking every name and shape.
//!
//! - `llama.rs`: the names, layouts and `config.json`.

pub mod llama;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use burn::module::{ModuleMapper, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use model::Gpt;
use safetensors::{Dtype, SafeTensors};

use crate::checkpoint;
use llama::Named;

/// Largest safetensors file written before the weights are split into several (as
/// `transformers`' default `max_shard_size`).
const SHARD_BYTES: usize = 5_000_000_000;

/// The weights' dtype in the exported files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportDtype {
    Bf16,
    F32,
}

impl ExportDtype {
    fn torch_name(self) -> &'static str {
        match self {
            ExportDtype::Bf16 => "bfloat16",
            ExportDtype::F32 => "float32",
        }
    }

    fn bytes(self, values: &[f32]) -> Vec<u8> {
        match self {
            ExportDtype::Bf16 => values
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
            ExportDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }
}

/// What [`export`] wrote.
#[derive(Debug, Clone)]
pub struct Exported {
    pub step: u64,
    pub tensors: usize,
    pub files: Vec<PathBuf>,
}

/// Writes the checkpoint of `run_dir` after `step` (the newest without) into `out_dir` as a
/// `LlamaForCausalLM` directory, weights in `dtype`. A model without a Llama equivalent (the
/// GELU MLP, biases) is refused, saying why.
pub fn export(
    run_dir: &Path,
    out_dir: &Path,
    step: Option<u64>,
    dtype: ExportDtype,
) -> Result<Exported> {
    let all = checkpoint::list(run_dir)?;
    let (step, path) = match step {
        Some(s) => all
            .into_iter()
            .find(|(k, _)| *k == s)
            .ok_or_else(|| anyhow!("{} has no checkpoint of step {s}", run_dir.display()))?,
        None => all
            .into_iter()
            .last()
            .ok_or_else(|| anyhow!("{} has no checkpoint", run_dir.display()))?,
    };
    let (header, values) = checkpoint::read(&path)?;
    llama::check_layout(&header.model)?;
    let mut params = Vec::with_capacity(header.params.len());
    let mut at = 0;
    for p in &header.params {
        let n: usize = p.shape.iter().product();
        params.push(Named {
            name: p.name.clone(),
            shape: p.shape.clone(),
            values: values[at..at + n].to_vec(),
        });
        at += if p.has_moments { 3 * n } else { n };
    }
    let tensors = llama::to_llama(&header.model, params)?;
    std::fs::create_dir_all(out_dir)
        .with_context(|| format!("cannot create {}", out_dir.display()))?;
    remove_old_weights(out_dir)?;
    let files = write_safetensors(out_dir, &tensors, dtype)?;
    let config = llama::config_json(&header.model, header.vocab_size, dtype.torch_name());
    write_json(&out_dir.join("config.json"), &config)?;
    let tokenizer = run_dir.join("tokenizer.json");
    let mut generation = serde_json::json!({ "_from_model_config": true });
    if tokenizer.exists() {
        std::fs::copy(&tokenizer, out_dir.join("tokenizer.json"))
            .with_context(|| format!("copying {}", tokenizer.display()))?;
        if let Ok(tok) = crate::tokenizer::load(&tokenizer) {
            // GPT-2's and prepare's end of text, Llama 3's, Llama 2's.
            let eos = ["<|endoftext|>", "<|end_of_text|>", "</s>"]
                .iter()
                .find_map(|t| tok.token_to_id(t));
            if let Some(eos) = eos {
                generation["eos_token_id"] = eos.into();
            }
        }
    }
    write_json(&out_dir.join("generation_config.json"), &generation)?;
    Ok(Exported {
        step,
        tensors: tensors.len(),
        files,
    })
}

/// Removes an earlier export's weights from `dir` (its safetensors files and their index), so
/// that none of them is read with the new ones.
fn remove_old_weights(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let path = entry?.path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let weights = name.ends_with(".safetensors") || name == "model.safetensors.index.json";
        if name.starts_with("model") && weights {
            std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    Ok(())
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).expect("JSON serialises");
    crate::fsutil::write_atomic(path, text.as_bytes())
}

/// `tensors` in one `model.safetensors`, or in `model-0000k-of-0000n.safetensors` files of at
/// most [`SHARD_BYTES`] with `model.safetensors.index.json`; the files written.
fn write_safetensors(dir: &Path, tensors: &[Named], dtype: ExportDtype) -> Result<Vec<PathBuf>> {
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone(), dtype.bytes(&t.values)))
        .collect();
    let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0;
    for (i, (_, _, bytes)) in data.iter().enumerate() {
        if size + bytes.len() > SHARD_BYTES && !groups.last().expect("a group").is_empty() {
            groups.push(Vec::new());
            size = 0;
        }
        size += bytes.len();
        groups.last_mut().expect("a group").push(i);
    }
    let st_dtype = match dtype {
        ExportDtype::Bf16 => Dtype::BF16,
        ExportDtype::F32 => Dtype::F32,
    };
    let n = groups.len();
    let mut files = Vec::new();
    let mut weight_map = serde_json::Map::new();
    for (k, group) in groups.iter().enumerate() {
        let name = if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", k + 1)
        };
        let views = group
            .iter()
            .map(|&i| {
                let (tname, shape, bytes) = &data[i];
                weight_map.insert(tname.clone(), name.clone().into());
                safetensors::tensor::TensorView::new(st_dtype, shape.clone(), bytes)
                    .map(|v| (tname.clone(), v))
                    .map_err(|e| anyhow!("tensor {tname}: {e}"))
            })
            .collect::<Result<Vec<_>>>()?;
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        let path = dir.join(&name);
        let tmp = dir.join(format!("{name}.partial"));
        safetensors::serialize_to_file(views, Some(meta), &tmp)
            .map_err(|e| anyhow!("writing {}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))?;
        files.push(path);
    }
    if n > 1 {
        let total: usize = data.iter().map(|d| d.2.len()).sum();
        let index = serde_json::json!({
            "metadata": { "total_size": total },
            "weight_map": weight_map,
        });
        write_json(&dir.join("model.safetensors.index.json"), &index)?;
    }
    Ok(files)
}

/// The tensors of a Hugging Face directory's safetensors files (one, or those its index names),
/// read as f32 on demand.
pub struct LlamaDir {
    dir: PathBuf,
    config: serde_json::Value,
    /// Each file, memory-mapped (a model of many gigabytes is not copied into memory whole).
    files: Vec<(PathBuf, memmap2::Mmap)>,
    /// Tensor name -> index into `files`.
    by_name: HashMap<String, usize>,
}

impl LlamaDir {
    /// Opens `dir`: its `config.json` and every safetensors file of its weights.
    pub fn open(dir: &Path) -> Result<Self> {
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path)
            .with_context(|| format!("model.init_from: cannot read {}", config_path.display()))?;
        let config: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not JSON", config_path.display()))?;
        let index = dir.join("model.safetensors.index.json");
        let names: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index)?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: not JSON", index.display()))?;
            let mut files: Vec<String> = v["weight_map"]
                .as_object()
                .with_context(|| format!("{}: no weight_map", index.display()))?
                .values()
                .filter_map(|f| f.as_str().map(str::to_string))
                .collect();
            files.sort();
            files.dedup();
            files.into_iter().map(|f| dir.join(f)).collect()
        } else {
            let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
                .with_context(|| format!("cannot list {}", dir.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
                .collect();
            files.sort();
            files
        };
        if names.is_empty() {
            bail!(
                "model.init_from = {:?}: no .safetensors file there",
                dir.display().to_string()
            );
        }
        let mut files = Vec::new();
        let mut by_name = HashMap::new();
        for path in names {
            let file = std::fs::File::open(&path)
                .with_context(|| format!("cannot open {}", path.display()))?;
            // SAFETY: the file is only read, while this directory is being loaded.
            let bytes = unsafe { memmap2::Mmap::map(&file) }
                .with_context(|| format!("cannot map {}", path.display()))?;
            let st = SafeTensors::deserialize(&bytes)
                .map_err(|e| anyhow!("{}: not a safetensors file ({e})", path.display()))?;
            for name in st.names() {
                by_name.insert(name.to_string(), files.len());
            }
            files.push((path, bytes));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            files,
            by_name,
        })
    }

    /// Tensor `name` as f32 values, after checking its shape is `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let &k = self.by_name.get(name).ok_or_else(|| {
            anyhow!(
                "{}: no tensor {name} in its safetensors files",
                self.dir.display()
            )
        })?;
        let (path, bytes) = &self.files[k];
        let st = SafeTensors::deserialize(bytes).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        let t = st
            .tensor(name)
            .map_err(|e| anyhow!("{}: {e}", path.display()))?;
        if t.shape() != shape {
            bail!(
                "{}: tensor {name} is {:?}, this run's model needs {shape:?}",
                path.display(),
                t.shape()
            );
        }
        let data = t.data();
        Ok(match t.dtype() {
            Dtype::F32 => data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::BF16 => data
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F16 => data
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => bail!(
                "{}: tensor {name} is {other:?} (f32, bf16 or f16 are read)",
                path.display()
            ),
        })
    }

    /// The directory's `config.json`.
    pub fn config(&self) -> &serde_json::Value {
        &self.config
    }
}

/// `model` with every parameter read from the Hugging Face directory `dir` (`model.init_from`):
/// its `config.json` must describe this model (the first difference is an error naming both
/// keys), and every tensor must be there with its shape (the first missing or misshapen one is
/// an error naming it).
pub fn init_from<AB: AutodiffBackend>(model: Gpt<AB>, dir: &Path) -> Result<Gpt<AB>> {
    let hf = LlamaDir::open(dir)?;
    let cfg = model.config.clone();
    llama::check_layout(&cfg)?;
    let vocab = model.wte.weight.dims()[0];
    llama::check_config(hf.config(), &cfg, vocab)
        .with_context(|| format!("model.init_from = {:?}", dir.display().to_string()))?;
    let mut mapper = Load {
        hf: &hf,
        cfg: &cfg,
        path: Vec::new(),
        error: None,
    };
    let model = burn::module::Module::map(model, &mut mapper);
    match mapper.error {
        Some(e) => Err(e.context(format!("model.init_from = {:?}", dir.display().to_string()))),
        None => Ok(model),
    }
}

/// Reads each parameter, by its module path, from a Hugging Face directory.
struct Load<'a> {
    hf: &'a LlamaDir,
    cfg: &'a model::config::GptConfig,
    path: Vec<String>,
    error: Option<anyhow::Error>,
}

impl<AB: AutodiffBackend> ModuleMapper<AB> for Load<'_> {
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
        let shape = tensor.dims().to_vec();
        let mut get = |n: &str, s: &[usize]| self.hf.get(n, s);
        match llama::from_llama(self.cfg, &name, &shape, &mut get) {
            Ok(values) => {
                let grad = tensor.is_require_grad();
                let device = tensor.device();
                let t = Tensor::<AB, D>::from_data(TensorData::new(values, shape), &device)
                    .cast(tensor.dtype());
                let t = if grad { t.require_grad() } else { t };
                Param::from_mapped_value(id, t, mapper)
            }
            Err(e) => {
                self.error = Some(e);
                Param::from_mapped_value(id, tensor, mapper)
            }
        }
    }
}
