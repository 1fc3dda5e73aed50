//! `sample`: generates text from a run's checkpoint.
//!
//! ```text
//! sample RUN_DIR [--prompt TEXT] [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--num-samples N] [--seed S] [--checkpoint STEP] [--dtype f32|bf16|f16]
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use trainer::sample::{sample, SampleOptions};

/// Generate text with a model trained by `train`: loads the run's newest (or given) checkpoint and
/// tokenizer, continues the prompt one token at a time (keys and values cached, so the cost is
/// linear in the length) on the model's own kernels in the run's compute dtype, and prints the
/// text as it comes.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Cli {
    /// The run directory `train` wrote (runs/...).
    run_dir: PathBuf,
    /// Text to continue.
    #[arg(long, default_value = "\n")]
    prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 500)]
    max_new_tokens: usize,
    /// Softmax temperature (0 = always the most likely token).
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Sample among the K most likely tokens only (0 = all).
    #[arg(long, default_value_t = 200)]
    top_k: usize,
    /// Then among the fewest most likely tokens whose probabilities sum to P (1 = all).
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// Continuations generated side by side, in one batch.
    #[arg(long, default_value_t = 1)]
    num_samples: usize,
    /// Seed of the sampling.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Step of the checkpoint to load (default: the newest).
    #[arg(long, value_name = "STEP")]
    checkpoint: Option<u64>,
    /// Dtype of the matmuls and activations: f32, bf16 or f16 (default: the run's on CUDA, f32
    /// elsewhere).
    #[arg(long, value_name = "DTYPE")]
    dtype: Option<String>,
}

fn main() -> ExitCode {
    trainer::cli_main(|| {
        let cli = Cli::parse();
        kernels::settings::init_from_env().map_err(|e| anyhow::anyhow!("{e}"))?;
        if !(cli.temperature >= 0.0 && cli.temperature.is_finite()) {
            anyhow::bail!(
                "--temperature must be a finite number >= 0, got {}",
                cli.temperature
            );
        }
        if cli.num_samples == 0 {
            anyhow::bail!("--num-samples must be at least 1");
        }
        if !(cli.top_p > 0.0 && cli.top_p <= 1.0) {
            anyhow::bail!("--top-p must be in (0, 1], got {}", cli.top_p);
        }
        let dtype = match cli.dtype.as_deref() {
            None => None,
            Some("f32") => Some(burn::tensor::FloatDType::F32),
            Some("bf16") => Some(burn::tensor::FloatDType::BF16),
            Some("f16") => Some(burn::tensor::FloatDType::F16),
            Some(other) => anyhow::bail!("--dtype must be f32, bf16 or f16, got {other:?}"),
        };
        let opts = SampleOptions {
            run_dir: cli.run_dir,
            prompt: cli.prompt,
            max_new_tokens: cli.max_new_tokens,
            temperature: cli.temperature,
            top_k: cli.top_k,
            top_p: cli.top_p,
            num_samples: cli.num_samples,
            seed: cli.seed,
            checkpoint: cli.checkpoint,
            dtype,
        };
        let s = match sample(&opts, &mut std::io::stdout()) {
            Ok(s) => s,
            // The reader went away (`sample ... | head`): stop quietly, as other Unix tools do.
            Err(e)
                if e.chain().any(|c| {
                    c.downcast_ref::<std::io::Error>()
                        .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
                }) =>
            {
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        eprintln!(
            "{} tokens in {:.2} s ({:.1} tokens/s, {:?}; first token after {:.3} s) from {} (step {})",
            s.new_tokens,
            s.new_tokens as f64 / s.tokens_per_s.max(1e-9),
            s.tokens_per_s,
            s.dtype,
            s.first_token_s,
            s.checkpoint.display(),
            s.step
        );
        Ok(())
    })
}
