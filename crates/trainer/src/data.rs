//! The token stream, its train/validation split and the random windows drawn from it.
//!
//! Windows are a pure function of (seed, step, micro-batch), so a resumed run reads exactly the
//! batches the uninterrupted run would have read, with no sampler state to save.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use tokenizers::Tokenizer;

use crate::config::{Config, TextSource, TokenizerKind};
use crate::rng::SplitMix64;
use crate::{corpus, tokenizer};

/// Seed of the embedded corpus: the same text for every run, whatever its `seed`.
pub const EMBEDDED_CORPUS_SEED: u64 = 0x5EED;

const TRAIN_STREAM: u64 = 1;
const VAL_STREAM: u64 = 2;

/// Tokenized corpus split into training and validation tokens.
pub struct Dataset {
    pub train: Vec<u32>,
    pub val: Vec<u32>,
    pub tokenizer: Tokenizer,
    /// Where the text came from, for the log.
    pub description: String,
}

impl Dataset {
    /// Reads or generates the text, builds or loads the tokenizer, tokenizes and splits.
    /// `existing_tokenizer` (a resumed run's `tokenizer.json`) takes precedence over training one.
    pub fn build(cfg: &Config, existing_tokenizer: Option<&Path>) -> Result<Self> {
        let d = &cfg.data;
        let (text, description) = match d.source {
            TextSource::Embedded => (
                corpus::generate(EMBEDDED_CORPUS_SEED, d.embedded_chars),
                "embedded corpus".to_string(),
            ),
            TextSource::File => {
                let path = PathBuf::from(&d.path);
                if !path.is_file() {
                    let cwd = std::env::current_dir()
                        .map(|p| p.display().to_string())
                        .unwrap_or_default();
                    bail!(
                        "data.path = {:?}: no such file (relative paths start from the current directory, {cwd}); \
                         point it at a UTF-8 text file with --set data.path=FILE",
                        d.path
                    );
                }
                let text = std::fs::read_to_string(&path).with_context(|| {
                    format!("data.path = {:?}: cannot read it as UTF-8 text", d.path)
                })?;
                (text, path.display().to_string())
            }
        };
        if text.is_empty() {
            bail!("the training text ({description}) is empty");
        }
        // The held-out text is the end of the corpus; a trained tokenizer only sees the rest.
        let cut = split_point(&text, d.val_fraction);
        let tok = match (existing_tokenizer, d.tokenizer) {
            (Some(p), _) => tokenizer::load(p)?,
            (None, TokenizerKind::Char) => tokenizer::char_level(&text)?,
            (None, TokenizerKind::Bpe) => tokenizer::train_bpe(&text[..cut], d.bpe_vocab_size)?,
            (None, TokenizerKind::File) => tokenizer::load(&PathBuf::from(&d.tokenizer_path))
                .with_context(|| "data.tokenizer_path")?,
        };
        let train = tokenizer::encode_corpus(&tok, &text[..cut])?;
        let val = tokenizer::encode_corpus(&tok, &text[cut..])?;
        let need = cfg.model.context + 1;
        if train.len() < need || val.len() < need {
            let (short, advice) = if train.len() < need {
                ("training", "use more text or a shorter model.context")
            } else {
                (
                    "validation",
                    "use more text, a shorter model.context or a larger data.val_fraction",
                )
            };
            bail!(
                "{description} gives {} training and {} validation tokens; the {short} split is shorter than one window \
                 (model.context + 1 = {need} tokens): {advice}",
                train.len(),
                val.len()
            );
        }
        Ok(Self {
            train,
            val,
            tokenizer: tok,
            description,
        })
    }

    /// Tokenizer vocabulary size (added tokens included).
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Largest token id in either split, plus one.
    pub fn max_id_bound(&self) -> usize {
        self.train
            .iter()
            .chain(&self.val)
            .copied()
            .max()
            .map_or(0, |m| m as usize + 1)
    }

    /// The `index`-th training micro-batch: inputs and next-token targets, each [batch, context].
    pub fn train_batch<B: Backend>(
        &self,
        seed: u64,
        index: u64,
        batch: usize,
        context: usize,
        device: &B::Device,
    ) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
        windows(
            &self.train,
            SplitMix64::for_stream(seed, TRAIN_STREAM, index),
            batch,
            context,
            device,
        )
    }

    /// Rows `rows` of the `index`-th training micro-batch of `global` sequences (one rank's part
    /// of a data-parallel step, see [`crate::parallel::rows`]): the same windows the whole batch
    /// has in those rows.
    pub fn train_batch_rows<B: Backend>(
        &self,
        seed: u64,
        index: u64,
        global: usize,
        rows: std::ops::Range<usize>,
        context: usize,
        device: &B::Device,
    ) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
        let starts = window_starts(
            SplitMix64::for_stream(seed, TRAIN_STREAM, index),
            self.train.len(),
            global,
            context,
        );
        gather(&self.train, &starts[rows], context, device)
    }

    /// The `index`-th validation batch (the same windows at every evaluation).
    pub fn val_batch<B: Backend>(
        &self,
        seed: u64,
        index: u64,
        batch: usize,
        context: usize,
        device: &B::Device,
    ) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
        windows(
            &self.val,
            SplitMix64::for_stream(seed, VAL_STREAM, index),
            batch,
            context,
            device,
        )
    }
}

/// Byte offset (on a char boundary) where the validation part begins.
pub fn split_point(text: &str, val_fraction: f64) -> usize {
    let mut cut = ((text.len() as f64) * (1.0 - val_fraction)) as usize;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    cut
}

/// Start offsets of `batch` random windows of `context + 1` tokens in a stream of `len` tokens.
pub fn window_starts(mut rng: SplitMix64, len: usize, batch: usize, context: usize) -> Vec<usize> {
    (0..batch).map(|_| rng.below(len - context)).collect()
}

fn windows<B: Backend>(
    tokens: &[u32],
    rng: SplitMix64,
    batch: usize,
    context: usize,
    device: &B::Device,
) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    let starts = window_starts(rng, tokens.len(), batch, context);
    gather(tokens, &starts, context, device)
}

/// Inputs and next-token targets of the windows starting at `starts`, each [starts, context].
fn gather<B: Backend>(
    tokens: &[u32],
    starts: &[usize],
    context: usize,
    device: &B::Device,
) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    let batch = starts.len();
    let mut x = Vec::with_capacity(batch * context);
    let mut y = Vec::with_capacity(batch * context);
    for &s in starts {
        x.extend(tokens[s..s + context].iter().map(|&t| t as i64));
        y.extend(tokens[s + 1..s + context + 1].iter().map(|&t| t as i64));
    }
    let x = Tensor::from_data(TensorData::new(x, [batch, context]), device);
    let y = Tensor::from_data(TensorData::new(y, [batch, context]), device);
    (x, y)
}
