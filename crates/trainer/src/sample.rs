//! Text generation from a run's checkpoint: the `sample` binary.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use burn::module::AutodiffModule;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use model::Gpt;

use crate::config::Config;
use crate::optim::AdamW;
use crate::{checkpoint, device};

/// What to generate.
#[derive(Debug, Clone)]
pub struct SampleOptions {
    pub run_dir: PathBuf,
    /// Text the generation continues (encoded with the run's tokenizer).
    pub prompt: String,
    pub max_new_tokens: usize,
    /// Softmax temperature; 0 takes the most likely token every time.
    pub temperature: f64,
    /// Sample among the `top_k` most likely tokens only (0: all).
    pub top_k: usize,
    /// Then among the fewest most likely tokens whose probabilities sum to at least `top_p`
    /// (nucleus sampling; 1: all).
    pub top_p: f64,
    /// Continuations of the prompt generated side by side (one batch); one is printed as it
    /// comes, several once they are done.
    pub num_samples: usize,
    pub seed: u64,
    /// Checkpoint step to load (default: the newest).
    pub checkpoint: Option<u64>,
    /// Dtype of the matmuls and activations (default: the run's compute dtype on CUDA, f32
    /// elsewhere).
    pub dtype: Option<FloatDType>,
}

/// What a generation produced.
#[derive(Debug, Clone)]
pub struct Sampled {
    /// The first continuation (without the prompt).
    pub text: String,
    /// Every continuation, the first included.
    pub samples: Vec<String>,
    /// New tokens over every sample.
    pub new_tokens: usize,
    /// New tokens over every sample per second, from the prompt's forward to the last token.
    pub tokens_per_s: f64,
    /// Seconds from the start of the prompt's forward to the first new token (kernels compiled
    /// on first use included).
    pub first_token_s: f64,
    /// Dtype the model computed in.
    pub dtype: FloatDType,
    pub checkpoint: PathBuf,
    pub step: u64,
}

/// The run's config, tokenizer and chosen checkpoint, with clear errors for each missing piece.
fn locate(opts: &SampleOptions) -> Result<(Config, tokenizers::Tokenizer, u64, PathBuf)> {
    let dir = &opts.run_dir;
    if !dir.is_dir() {
        bail!(
            "{}: no such directory; give the run directory that `train` printed (runs/...)",
            dir.display()
        );
    }
    let cfg_path = dir.join("config.toml");
    if !cfg_path.exists() {
        bail!(
            "{}: no config.toml there; is it a run directory?",
            dir.display()
        );
    }
    let cfg = Config::load(&cfg_path, &[])?;
    let tok_path = dir.join("tokenizer.json");
    if !tok_path.exists() {
        bail!(
            "{}: no tokenizer.json there; the run did not get past loading its data",
            dir.display()
        );
    }
    let tok = crate::tokenizer::load(&tok_path)?;
    let list = checkpoint::list(dir)?;
    let (step, path) = match opts.checkpoint {
        None => list.last().cloned().ok_or_else(|| {
            anyhow!(
                "{}: no checkpoint yet in {}; train the run further (checkpoints come every training.checkpoint_interval steps and at the end)",
                dir.display(),
                checkpoint::dir(dir).display()
            )
        })?,
        Some(s) => list.iter().find(|(st, _)| *st == s).cloned().ok_or_else(|| {
            let have: Vec<String> = list.iter().map(|(st, _)| st.to_string()).collect();
            anyhow!(
                "{}: no checkpoint of step {s}; the run has {}",
                dir.display(),
                if have.is_empty() { "none".to_string() } else { format!("steps {}", have.join(", ")) }
            )
        })?,
    };
    Ok((cfg, tok, step, path))
}

/// The prompt's token ids, refusing characters a character-level tokenizer does not know.
fn encode_prompt(tok: &tokenizers::Tokenizer, prompt: &str) -> Result<Vec<u32>> {
    let enc = tok
        .encode(prompt, false)
        .map_err(|e| anyhow!("encoding the prompt: {e}"))?;
    let ids = enc.get_ids().to_vec();
    if let Some(unk) = tok.token_to_id(crate::tokenizer::UNK) {
        let unknown: std::collections::BTreeSet<char> = prompt
            .chars()
            .filter(|c| tok.token_to_id(&c.to_string()).is_none())
            .collect();
        if ids.contains(&unk) && !unknown.is_empty() {
            let list: String = unknown.iter().map(|c| format!("{c:?} ")).collect();
            bail!("the prompt has characters this run's tokenizer never saw: {}; use characters of its training text", list.trim_end());
        }
    }
    if ids.is_empty() {
        bail!("the prompt encodes to no tokens; give at least one character (the default is a newline)");
    }
    Ok(ids)
}

/// Next token from `logits` (one row) with temperature, top-k and top-p (the fewest most likely
/// tokens whose probabilities, after temperature and top-k, sum to at least `top_p`), drawn with
/// `rng`.
pub fn pick(
    logits: &[f32],
    temperature: f64,
    (top_k, top_p): (usize, f64),
    rng: &mut crate::rng::SplitMix64,
) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            )
            .0 as u32
    };
    if temperature <= 0.0 {
        return argmax();
    }
    let mut order: Vec<usize> = (0..logits.len())
        .filter(|&i| logits[i].is_finite())
        .collect();
    if order.is_empty() {
        return argmax();
    }
    let descending = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]);
    if top_k > 0 && top_k < order.len() {
        // The k largest in linear time, then only those sorted.
        order.select_nth_unstable_by(top_k - 1, descending);
        order.truncate(top_k);
    }
    order.sort_by(descending);
    let top = logits[order[0]] as f64;
    let mut weights: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] as f64 - top) / temperature).exp())
        .collect();
    if top_p < 1.0 {
        let total: f64 = weights.iter().sum();
        let mut sum = 0.0;
        let keep = weights
            .iter()
            .position(|w| {
                sum += w;
                sum >= top_p * total
            })
            .map_or(weights.len(), |i| i + 1);
        weights.truncate(keep);
        order.truncate(keep);
    }
    let total: f64 = weights.iter().sum();
    // A uniform draw in [0, 1) from the top 53 bits.
    let mut u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
    for (&i, w) in order.iter().zip(&weights) {
        if u < *w {
            return i as u32;
        }
        u -= w;
    }
    order[order.len() - 1] as u32
}

/// Generates on the device `cfg.device` selects, printing text to `out` as it comes.
pub fn sample(opts: &SampleOptions, out: &mut dyn Write) -> Result<Sampled> {
    let run = locate(opts)?;
    let (selected, note) = device::select(run.0.device)?;
    if let Some(n) = note {
        eprintln!("device: {n}");
    }
    match selected {
        device::Selected::Cuda { index, .. } => {
            // The dtype the run trained in (precision = "auto" is bf16 on CUDA).
            let recipe = run.0.recipe().map_err(|e| anyhow!("{e}"))?;
            let opts = SampleOptions {
                dtype: opts.dtype.or(Some(recipe.compute_dtype())),
                ..opts.clone()
            };
            generate::<crate::CudaBackend>(
                &opts,
                run,
                burn::backend::cuda::CudaDevice::new(index),
                out,
            )
        }
        device::Selected::Wgpu => generate::<crate::WgpuBackend>(
            opts,
            run,
            burn::backend::wgpu::WgpuDevice::DefaultDevice,
            out,
        ),
        device::Selected::Cpu => generate::<crate::CpuBackend>(
            opts,
            run,
            burn::backend::ndarray::NdArrayDevice::Cpu,
            out,
        ),
    }
}

/// [`sample`] on a given backend (in f32 unless `opts.dtype` says otherwise).
pub fn sample_on<B: crate::TrainBackend>(
    opts: &SampleOptions,
    device: B::Device,
    out: &mut dyn Write,
) -> Result<Sampled> {
    generate::<B>(opts, locate(opts)?, device, out)
}

fn generate<B: crate::TrainBackend>(
    opts: &SampleOptions,
    (cfg, tok, step, path): (Config, tokenizers::Tokenizer, u64, PathBuf),
    device: B::Device,
    out: &mut dyn Write,
) -> Result<Sampled> {
    let _drain = crate::DrainOnDrop::<B>(device.clone());
    let (header, values) =
        checkpoint::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let vocab = header.vocab_size;
    let mut opt = AdamW::<B::InnerBackend>::new(cfg.optimizer.clone(), Default::default());
    let (model, _) = checkpoint::apply::<B, _>(
        &path,
        header,
        values,
        (Gpt::<B>::new(&cfg.model, vocab, &device), None),
        &mut opt,
        &cfg.model,
        vocab,
    )?;
    let dtype = opts.dtype.unwrap_or(FloatDType::F32);
    let model = model.valid().compute_copy(dtype);
    let context = cfg.model.context;

    let prompt = encode_prompt(&tok, &opts.prompt)?;
    let n = opts.num_samples.max(1);
    let inner = model.wte.weight.val().device();
    // Row r of a batch holds `rows[r]`, all of one length.
    let ids = |rows: &[Vec<u32>]| {
        let t = rows[0].len();
        let flat: Vec<i64> = rows.iter().flatten().map(|&i| i as i64).collect();
        Tensor::<B::InnerBackend, 2, Int>::from_data(TensorData::new(flat, [rows.len(), t]), &inner)
    };
    // A prompt longer than the context keeps its end.
    let start_window: Vec<u32> = prompt[prompt.len().saturating_sub(context)..].to_vec();
    // Room for the prompt and every new token but the last (never fed back), up to the context.
    let capacity = (start_window.len() + opts.max_new_tokens.max(1) - 1).min(context);
    let mut windows = vec![start_window; n];
    let mut cache = model.decode_cache(n, capacity, &inner);
    let mut picker = Picker::new(opts, n);
    let mut generated: Vec<Vec<u32>> = vec![Vec::with_capacity(opts.max_new_tokens); n];
    let stream = n == 1;
    if stream {
        write!(out, "{}", opts.prompt)?;
    }
    let start = Instant::now();
    let mut first_token_s = 0.0;
    let mut logits = model.decode(ids(&windows), &mut cache);
    for made in 0..opts.max_new_tokens {
        let next = picker.pick(logits)?;
        if made == 0 {
            first_token_s = start.elapsed().as_secs_f64();
        }
        for (r, &token) in next.iter().enumerate() {
            generated[r].push(token);
            windows[r].push(token);
        }
        if stream {
            write!(out, "{}", crate::tokenizer::decode(&tok, &next[..1])?)?;
            out.flush()?;
        }
        if made + 1 == opts.max_new_tokens {
            break;
        }
        if cache.len() == cache.capacity() {
            // The cache holds the whole context: start again from the last half context (rare;
            // each restart costs one prompt-sized forward).
            for w in &mut windows {
                *w = w[w.len() - context / 2..].to_vec();
            }
            cache.clear();
            logits = model.decode(ids(&windows), &mut cache);
        } else {
            let last: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
            logits = model.decode(ids(&last), &mut cache);
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let samples = generated
        .iter()
        .map(|g| crate::tokenizer::decode(&tok, g))
        .collect::<Result<Vec<_>>>()?;
    if stream {
        writeln!(out)?;
    } else {
        for (k, text) in samples.iter().enumerate() {
            writeln!(out, "--- sample {} of {n}\n{}{text}", k + 1, opts.prompt)?;
        }
    }
    let new_tokens = generated.iter().map(Vec::len).sum::<usize>();
    Ok(Sampled {
        text: samples[0].clone(),
        samples,
        new_tokens,
        tokens_per_s: new_tokens as f64 / secs.max(1e-9),
        first_token_s,
        dtype,
        checkpoint: path,
        step,
    })
}

/// How the next tokens are chosen from the logits of a batch.
struct Picker {
    temperature: f64,
    top_k: usize,
    top_p: f64,
    /// One generator per row, so that rows can be drawn in parallel and row 0 draws as a
    /// single sample does.
    rngs: Vec<crate::rng::SplitMix64>,
}

impl Picker {
    fn new(opts: &SampleOptions, rows: usize) -> Self {
        let rngs = (0..rows as u64)
            .map(|r| crate::rng::SplitMix64::new(opts.seed ^ r.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
            .collect();
        Self {
            temperature: opts.temperature,
            top_k: opts.top_k,
            top_p: opts.top_p,
            rngs,
        }
    }

    /// One token per row of `logits` [rows, vocab]. Greedy picks take the argmax on the device
    /// and read back one id a row; sampling reads the logits and draws the rows in parallel.
    fn pick<B: burn::tensor::backend::Backend>(
        &mut self,
        logits: Tensor<B, 2>,
    ) -> Result<Vec<u32>> {
        use rayon::prelude::*;
        let [_, vocab] = logits.dims();
        if self.temperature <= 0.0 {
            let ids = logits.argmax(1).into_data().convert::<i64>();
            let ids = ids.into_vec::<i64>().map_err(|e| anyhow!("{e:?}"))?;
            return Ok(ids.into_iter().map(|i| i as u32).collect());
        }
        let values = logits
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| anyhow!("{e:?}"))?;
        let (temperature, filter) = (self.temperature, (self.top_k, self.top_p));
        Ok(values
            .par_chunks(vocab)
            .zip(self.rngs.par_iter_mut())
            .map(|(row, rng)| pick(row, temperature, filter, rng))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::pick;
    use crate::rng::SplitMix64;

    /// Top-p keeps the fewest most likely tokens that reach it; temperature 0 and top-k as before.
    #[test]
    fn top_p_keeps_the_nucleus() {
        // Probabilities at temperature 1: about 0.64, 0.24, 0.09, 0.03.
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        let draws = |k: usize, p: f64| -> Vec<u32> {
            let mut rng = SplitMix64::new(5);
            let mut seen: Vec<u32> = (0..2000)
                .map(|_| pick(&logits, 1.0, (k, p), &mut rng))
                .collect();
            seen.sort();
            seen.dedup();
            seen
        };
        assert_eq!(draws(0, 0.5), vec![0]);
        assert_eq!(draws(0, 0.8), vec![0, 1]);
        assert_eq!(draws(0, 0.95), vec![0, 1, 2]);
        assert_eq!(draws(0, 1.0), vec![0, 1, 2, 3]);
        assert_eq!(draws(2, 1.0), vec![0, 1]);
        // Top-p among the top-k: 0.64 / 0.88 of the two is below 0.8, so both stay.
        assert_eq!(draws(2, 0.8), vec![0, 1]);
        let mut rng = SplitMix64::new(5);
        assert_eq!(pick(&logits, 0.0, (0, 0.1), &mut rng), 0);
    }
}
