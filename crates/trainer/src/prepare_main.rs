//! `prepare`: text, JSON Lines and Parquet to token shards for `data.source = "shards"`.
//!
//! ```text
//! prepare INPUT... --out DIR (--tokenizer tokenizer.json | --bpe-vocab N) [--field text]
//!         [--val-every 100] [--chunk-mb 256] [--eot "<|endoftext|>"]
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{anyhow, bail, Context};
use clap::Parser;

/// Tokenize text files (each blank-line-separated paragraph a document), JSON Lines files
/// (`.jsonl` / `.json`, each line a document) and Parquet files (`.parquet`, each row a document)
/// into token shards: `train_NNNNN.bin` and
/// `val_NNNNN.bin` in OUT with the `tokenizer.json` they were made with. Train on them with
/// `--set data.source=shards --set data.path=OUT --set data.tokenizer=file --set
/// data.tokenizer_path=OUT/tokenizer.json`. Stopped and started again, it keeps the shards it
/// finished.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Cli {
    /// Files, directories (every file under them) or glob patterns.
    #[arg(required = true)]
    inputs: Vec<String>,
    /// Where the shards go.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// A Hugging Face tokenizer.json (GPT-2's, Llama 3's, ...).
    #[arg(long, value_name = "FILE", conflicts_with = "bpe_vocab")]
    tokenizer: Option<PathBuf>,
    /// Train a byte-level BPE of this many tokens on the first --sample-mb MB of the inputs.
    #[arg(long, value_name = "N")]
    bpe_vocab: Option<usize>,
    /// MB of text the BPE is trained on.
    #[arg(long, default_value_t = 100)]
    sample_mb: usize,
    /// The field holding a JSON line's text, or the column holding a Parquet row's.
    #[arg(long, default_value = "text")]
    field: String,
    /// Every N-th document goes to validation.
    #[arg(long, default_value_t = 100)]
    val_every: usize,
    /// About this many MB of text per shard.
    #[arg(long, default_value_t = 256)]
    chunk_mb: usize,
    /// The end-of-text token that follows every document (added to a trained BPE).
    #[arg(long, default_value = "<|endoftext|>")]
    eot: String,
}

fn main() -> ExitCode {
    trainer::cli_main(|| {
        let cli = Cli::parse();
        let tok = match (&cli.tokenizer, cli.bpe_vocab) {
            (Some(path), _) => trainer::tokenizer::load(path)?,
            (None, Some(vocab)) => {
                let sample = trainer::prepare::sample_text(&cli.inputs, &cli.field, cli.sample_mb)?;
                let mut tok = trainer::tokenizer::train_bpe(&sample, vocab)
                    .context("training the BPE on the sample")?;
                tok.add_special_tokens(vec![tokenizers::AddedToken::from(cli.eot.clone(), true)])
                    .map_err(|e| anyhow!("adding {:?} to the BPE: {e}", cli.eot))?;
                tok
            }
            (None, None) => bail!("give --tokenizer tokenizer.json, or --bpe-vocab N to train one"),
        };
        let plan = trainer::prepare::Plan {
            inputs: cli.inputs,
            out: cli.out.clone(),
            field: cli.field,
            val_every: cli.val_every,
            chunk_bytes: cli.chunk_mb.max(1) as u64 * 1_000_000,
            eot: cli.eot,
            progress: true,
        };
        let t = std::time::Instant::now();
        let done = trainer::prepare::prepare(&plan, &tok).map_err(|e| anyhow!("{e:#}"))?;
        let secs = t.elapsed().as_secs_f64();
        println!(
            "{} documents, {:.1} MB of text: {} training and {} validation tokens in {} shard(s) ({} kept from an earlier run) in {}; {:.1} MB/s",
            done.documents,
            done.text_bytes as f64 / 1e6,
            done.train_tokens,
            done.val_tokens,
            done.written + done.skipped,
            done.skipped,
            cli.out.display(),
            done.text_bytes as f64 / 1e6 / secs.max(1e-9)
        );
        Ok(())
    })
}
