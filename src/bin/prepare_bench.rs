//! `prepare` throughput beside Python's tokenizers on the same text, tokenizer and thread count.
//!
//! Writes a text file of `--mb` MB (the generated corpus: blank-line-separated paragraphs, as
//! `prepare` cuts documents), takes `--tokenizer` or trains a byte-level BPE of `--bpe-vocab`
//! tokens on its first 20 MB, then times `prepare` on it with `--threads` threads (reading,
//! tokenizing and writing the shards: all of it) and, unless `--no-peer`,
//! `tools/peers/tokenize_bench.py` (Hugging Face `tokenizers`' `encode_batch` with the same
//! tokenizer and threads; `tiktoken` where it is installed, with its own GPT-2 vocabulary), which
//! time tokenizing alone. Prints a table of MB/s and tokens/s with the ratio to ours, a row as each
//! tool finishes.
//!
//! `cargo run --release --bin prepare_bench -- [--mb 1000] [--threads N] [--tokenizer FILE]`

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;

#[derive(Parser)]
#[command(about = "prepare's throughput beside Python's tokenizers")]
struct Args {
    /// MB of generated text.
    #[arg(long, default_value_t = 1000)]
    mb: usize,
    /// Threads for every tool (default: every core).
    #[arg(long)]
    threads: Option<usize>,
    /// A tokenizer.json (default: a BPE trained on the text's first 20 MB).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Vocabulary of the trained BPE.
    #[arg(long, default_value_t = 8192)]
    bpe_vocab: usize,
    /// Where the text, tokenizer and shards go.
    #[arg(long, default_value = "/tmp/prepare_bench")]
    work: PathBuf,
    /// Skip the Python peers.
    #[arg(long)]
    no_peer: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    std::fs::create_dir_all(&args.work)?;
    let text_path = args.work.join(format!("corpus_{}mb.txt", args.mb));
    if !text_path.exists() {
        let t = Instant::now();
        let text = trainer::corpus::generate(11, args.mb * 1_000_000);
        std::fs::write(&text_path, &text)?;
        eprintln!(
            "wrote {} in {:.1} s",
            text_path.display(),
            t.elapsed().as_secs_f64()
        );
    }
    let tok_path = match &args.tokenizer {
        Some(p) => p.clone(),
        None => {
            let p = args.work.join(format!("bpe_{}.json", args.bpe_vocab));
            if !p.exists() {
                let spec = vec![text_path.to_string_lossy().into_owned()];
                let sample = trainer::prepare::sample_text(&spec, "text", 20)?;
                let mut tok = trainer::tokenizer::train_bpe(&sample, args.bpe_vocab)?;
                tok.add_special_tokens(vec![tokenizers::AddedToken::from("<|endoftext|>", true)])
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                trainer::tokenizer::save(&tok, &p)?;
            }
            p
        }
    };
    let tok = trainer::tokenizer::load(&tok_path)?;
    let out = args.work.join("shards");
    let _ = std::fs::remove_dir_all(&out);
    let plan = trainer::prepare::Plan {
        inputs: vec![text_path.to_string_lossy().into_owned()],
        out,
        field: "text".into(),
        val_every: 100,
        chunk_bytes: 64_000_000,
        eot: "<|endoftext|>".into(),
        progress: false,
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("a thread pool")?;
    let t = Instant::now();
    let done = pool.install(|| trainer::prepare::prepare(&plan, &tok))?;
    let secs = t.elapsed().as_secs_f64();
    let mb = done.text_bytes as f64 / 1e6;
    let tokens = (done.train_tokens + done.val_tokens) as f64;
    let ours = mb / secs;
    println!(
        "\n{:.0} MB of text, {} threads, tokenizer {} ({} tokens in the vocabulary)\n",
        mb,
        threads,
        tok_path.display(),
        tok.get_vocab_size(true)
    );
    println!("| tool | MB/s | tokens/s | ours / theirs (MB/s) |");
    println!("|---|---|---|---|");
    // Each row as soon as its tool has finished, so that a run stopped by a time limit keeps
    // what it measured.
    let row = |name: &str, m: f64, t: f64| {
        println!("| {name} | {m:.1} | {t:.3e} | {:.2}x |", ours / m);
    };
    row(
        "burnmix prepare (read, tokenize, write)",
        ours,
        tokens / secs,
    );
    if !args.no_peer {
        // The repository's copy: the working directory's when run from its root (as on a
        // machine that only has the binary), else the one it was built from.
        let local = PathBuf::from("tools/peers/tokenize_bench.py");
        let script = if local.exists() {
            local
        } else {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tools/peers/tokenize_bench.py"
            ))
        };
        let mut peer = Command::new("python3")
            .arg(script)
            .args(["--text", &text_path.to_string_lossy()])
            .args(["--tokenizer", &tok_path.to_string_lossy()])
            .args(["--threads", &threads.to_string()])
            .env("PYTHONUNBUFFERED", "1")
            .stdout(Stdio::piped())
            .spawn()
            .context("running python3 tools/peers/tokenize_bench.py")?;
        let stdout = peer.stdout.take().context("the Python peer's output")?;
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            let v: serde_json::Value = serde_json::from_str(&line)
                .with_context(|| format!("the Python peer printed `{line}`"))?;
            let name = v["peer"].as_str().unwrap_or("?");
            match (v["mb_s"].as_f64(), v["tokens_s"].as_f64()) {
                (Some(m), Some(t)) => row(name, m, t),
                _ => println!("{name}: not run ({})", v["skipped"].as_str().unwrap_or("?")),
            }
        }
        let status = peer.wait()?;
        if !status.success() {
            bail!("the Python peer failed ({status}); its errors are above");
        }
    }
    Ok(())
}
