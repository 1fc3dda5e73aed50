//! `export`: a run's checkpoint as a Hugging Face `LlamaForCausalLM` directory.
//!
//! ```text
//! export RUN_DIR OUT_DIR [--checkpoint STEP] [--dtype bf16|f32]
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::bail;
use clap::{Parser, ValueEnum};

/// Write a run's newest checkpoint (or --checkpoint STEP) as `model.safetensors` (split into
/// several files above 5 GB, with their index), `config.json` and `generation_config.json` for
/// Hugging Face's `LlamaForCausalLM`, with the run's `tokenizer.json`: what `transformers`, vLLM
/// and llama.cpp's converter read. Models in the Llama layout only (SwiGLU, RMSNorm, RoPE, with
/// or without grouped-query attention and tied embeddings). `model.init_from = "OUT_DIR"` starts
/// a run from such a directory.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Cli {
    /// The run directory (it holds checkpoints/ and tokenizer.json).
    run: PathBuf,
    /// Where the Hugging Face files go (created; existing files of the same names are replaced).
    out: PathBuf,
    /// The checkpoint's step (default: the newest).
    #[arg(long, value_name = "STEP")]
    checkpoint: Option<u64>,
    /// The weights' dtype in the files.
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: Dtype,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Dtype {
    Bf16,
    F32,
}

fn main() -> ExitCode {
    trainer::cli_main(|| {
        let cli = Cli::parse();
        if !cli.run.is_dir() {
            bail!("{} is not a run directory", cli.run.display());
        }
        let dtype = match cli.dtype {
            Dtype::Bf16 => trainer::interop::ExportDtype::Bf16,
            Dtype::F32 => trainer::interop::ExportDtype::F32,
        };
        let done = trainer::interop::export(&cli.run, &cli.out, cli.checkpoint, dtype)?;
        println!(
            "step {}: {} tensors in {} file(s) under {} (LlamaForCausalLM)",
            done.step,
            done.tensors,
            done.files.len(),
            cli.out.display()
        );
        Ok(())
    })
}
