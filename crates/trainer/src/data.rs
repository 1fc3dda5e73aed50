//! The token stream, its train/validation split and the random windows drawn from it: text
//! tokenized at start and held in memory, or token shards read a window at a time
//! (`crate::tokens`).
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
use crate::tokens::{self, ShardSet, Tokens};
use crate::{corpus, tokenizer};

/// Seed of the embedded corpus: the same text for every run, whatever its `seed`.
pub const EMBEDDED_CORPUS_SEED: u64 = 0x5EED;

const TRAIN_STREAM: u64 = 1;
const VAL_STREAM: u64 = 2;

/// Tokenized corpus split into training and validation tokens.
pub struct Dataset {
    pub train: Tokens,
    pub val: Tokens,
    pub tokenizer: Tokenizer,
    /// Where the text came from, for the log.
    pub description: String,
}

impl Dataset {
    /// Reads or generates the text, builds or loads the tokenizer, tokenizes and splits.
    /// `existing_tokenizer` (a resumed run's `tokenizer.json`) takes precedence over training one.
    pub fn build(cfg: &Config, existing_tokenizer: Option<&Path>) -> Result<Self> {
        let d = &cfg.data;
        if d.source == TextSource::Shards {
            return Self::shards(cfg, existing_tokenizer);
        }
        let (text, description) = match d.source {
            TextSource::Shards => unreachable!("read above"),
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
        let train = Tokens::Memory(tokenizer::encode_corpus(&tok, &text[..cut])?);
        let val = Tokens::Memory(tokenizer::encode_corpus(&tok, &text[cut..])?);
        check_lengths(&train, &val, cfg.model.context, &description)?;
        Ok(Self {
            train,
            val,
            tokenizer: tok,
            description,
        })
    }

    /// The token shards of `data.path` and `data.val_path`, opened for reading, with the tokenizer
    /// they were made with (a resumed run's copy, or `data.tokenizer_path`): ours must record
    /// that tokenizer's hash.
    fn shards(cfg: &Config, existing_tokenizer: Option<&Path>) -> Result<Self> {
        let d = &cfg.data;
        let train_files = tokens::resolve(&d.path, "train", "data.path")?;
        let val_files = if d.val_path.is_empty() {
            tokens::resolve(&d.path, "val", "data.path (for the validation shards)")?
        } else {
            tokens::resolve(&d.val_path, "val", "data.val_path")?
        };
        if let Some(both) = train_files.iter().find(|f| val_files.contains(f)) {
            bail!(
                "{} is among both the training and the validation shards; set data.val_path to other files",
                both.display()
            );
        }
        let tok_path =
            existing_tokenizer.map_or_else(|| PathBuf::from(&d.tokenizer_path), Path::to_path_buf);
        let tok = tokenizer::load(&tok_path).context("data.tokenizer_path")?;
        let want = tokenizer::hash(&tok)?;
        let (train, val) = (ShardSet::open(&train_files)?, ShardSet::open(&val_files)?);
        let mut kind = None;
        for set in [&train, &val] {
            let (k, hash) = set.kind_and_hash()?;
            if hash.is_some_and(|h| h != want) {
                bail!(
                    "{} was made with another tokenizer than {} (the tokenizer hash in its header differs); use the tokenizer.json that `prepare` wrote beside it",
                    set.paths().next().expect("a shard").display(),
                    tok_path.display()
                );
            }
            kind = Some(k);
            set.check_ids_below(tok.get_vocab_size(true), &tok_path)?;
        }
        let description = format!(
            "{} {} file(s) ({} train, {} val) under {}",
            train_files.len() + val_files.len(),
            kind.expect("two sets"),
            train_files.len(),
            val_files.len(),
            d.path
        );
        let (train, val) = (Tokens::Mapped(train), Tokens::Mapped(val));
        check_lengths(&train, &val, cfg.model.context, &description)?;
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

    /// Largest token id in either split, plus one (shards of ours record it in their headers;
    /// others are read once).
    pub fn max_id_bound(&self) -> usize {
        self.train.max_id_bound().max(self.val.max_id_bound())
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

/// An error unless both splits hold at least one window (`context + 1` tokens).
fn check_lengths(train: &Tokens, val: &Tokens, context: usize, description: &str) -> Result<()> {
    let need = context + 1;
    if train.len() < need || val.len() < need {
        let shards = matches!(train, Tokens::Mapped(_));
        let (short, advice) = match (train.len() < need, shards) {
            (true, _) => ("training", "use more text or a shorter model.context"),
            (false, false) => (
                "validation",
                "use more text, a shorter model.context or a larger data.val_fraction",
            ),
            (false, true) => (
                "validation",
                "prepare with a smaller --val-every, point data.val_path at more shards, or use a shorter model.context",
            ),
        };
        bail!(
                "{description} gives {} training and {} validation tokens; the {short} split is shorter than one window \
                 (model.context + 1 = {need} tokens): {advice}",
                train.len(),
                val.len()
            );
    }
    Ok(())
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
    tokens: &Tokens,
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
    tokens: &Tokens,
    starts: &[usize],
    context: usize,
    device: &B::Device,
) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    let batch = starts.len();
    let mut x = Vec::with_capacity(batch * context);
    let mut y = Vec::with_capacity(batch * context);
    let mut window = Vec::with_capacity(context + 1);
    for &s in starts {
        window.clear();
        tokens.extend_window(s, context + 1, &mut window);
        x.extend_from_slice(&window[..context]);
        y.extend_from_slice(&window[1..]);
    }
    let x = Tensor::from_data(TensorData::new(x, [batch, context]), device);
    let y = Tensor::from_data(TensorData::new(y, [batch, context]), device);
    (x, y)
}
