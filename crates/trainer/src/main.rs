//! `train`: trains a GPT from a TOML config.
//!
//! ```text
//! train [CONFIG.toml] [--set key=value]... [--out DIR] [--resume DIR] [--stop-at STEP] [--print-config]
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Result};
use clap::Parser;
use trainer::config::Config;
use trainer::{device, RunOptions};

/// Train a GPT-style transformer with Burn.
///
/// With no CONFIG, trains the built-in default (configs/default.toml): a tiny model on an embedded
/// corpus, about a minute on a CPU.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Cli {
    /// TOML config file (default: the built-in configs/default.toml).
    config: Option<PathBuf>,
    /// Override one config key, e.g. --set training.steps=100 --set model.mlp=gelu (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Run directory (default: runs/<config name>-<UTC time>).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Continue the run in DIR from its newest checkpoint (uses DIR/config.toml plus any --set).
    #[arg(long, value_name = "DIR", conflicts_with_all = ["config", "out"])]
    resume: Option<PathBuf>,
    /// Stop (with a checkpoint) once the run has completed this many steps; continue later with
    /// --resume. The schedule still runs to training.steps.
    #[arg(long, value_name = "STEP")]
    stop_at: Option<u64>,
    /// Print the resolved config as TOML and exit.
    #[arg(long)]
    print_config: bool,
}

/// `YYYYMMDD-HHMMSS` in UTC: the default run directory's suffix.
fn utc_stamp() -> String {
    let t = time::OffsetDateTime::now_utc();
    format!(
        "{:04}{:02}{:02}-{:02}{:02}{:02}",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

fn real_main() -> Result<()> {
    let cli = Cli::parse();
    let (cfg, run_dir, resume) = match &cli.resume {
        Some(dir) => {
            let path = dir.join("config.toml");
            if !path.exists() {
                bail!(
                    "--resume {}: no config.toml there; is it a run directory?",
                    dir.display()
                );
            }
            (Config::load(&path, &cli.set)?, dir.clone(), true)
        }
        None => {
            let (cfg, name) = match &cli.config {
                Some(p) => {
                    let stem = p
                        .file_stem()
                        .map(|s| s.to_string_lossy().to_string())
                        .unwrap_or("run".into());
                    (Config::load(p, &cli.set)?, stem)
                }
                None => (
                    Config::from_toml_str(
                        trainer::config::DEFAULT_TOML,
                        &cli.set,
                        "built-in default config",
                    )?,
                    "default".into(),
                ),
            };
            let dir = cli
                .out
                .clone()
                .unwrap_or_else(|| PathBuf::from("runs").join(format!("{name}-{}", utc_stamp())));
            (cfg, dir, false)
        }
    };
    if cli.print_config {
        print!("{}", cfg.to_toml());
        return Ok(());
    }

    let (selected, note) = device::select(cfg.device)?;
    if let Some(n) = note {
        println!("device: {n}");
    }
    let peak = if cfg.training.peak_tflops > 0.0 {
        Some(cfg.training.peak_tflops)
    } else {
        selected.gpu_name().and_then(device::peak_bf16_tflops)
    };
    println!(
        "device: {}{}",
        selected.describe(),
        peak.map_or(String::new(), |p| format!(", MFU against {p} TFLOP/s"))
    );
    println!("run directory: {}", run_dir.display());
    if matches!(selected, device::Selected::Cuda { .. }) {
        if cfg!(feature = "autotune") {
            println!(
                "note: CUDA kernels are compiled and Burn's matmuls and reductions autotuned at the first use of each \
                 shape; on a new GPU the first step can take minutes. Both are cached (under target/ when run inside \
                 the repository, see cubecl.toml)."
            );
        } else {
            println!(
                "note: CUDA kernels are compiled at the first use of each shape (seconds on a new GPU) and cached \
                 (under target/ when run inside the repository, see cubecl.toml). Built without autotune: \
                 `--features autotune` gives about 9% more tokens/s after a first step of a minute or more."
            );
        }
    }
    let opts = RunOptions {
        run_dir: run_dir.clone(),
        resume,
        device_name: selected.describe(),
        peak_tflops: peak,
        verbose: true,
        stop_at: cli.stop_at,
        poison_steps: Vec::new(),
    };
    let existed = run_dir.exists();
    let s = match trainer::run(&cfg, &selected, &opts) {
        Ok(s) => s,
        Err(e) => {
            // A new run that failed before its first step has nothing worth keeping: remove the
            // directory rather than leave one that looks like a run.
            let stepped = std::fs::read_to_string(run_dir.join("metrics.jsonl"))
                .map(|m| !m.trim().is_empty())
                .unwrap_or(false);
            if !existed && !stepped && run_dir.exists() {
                let _ = std::fs::remove_dir_all(&run_dir);
                return Err(e.context(format!(
                    "run {} (removed: it failed before its first step)",
                    run_dir.display()
                )));
            }
            return Err(e.context(format!("run {}", run_dir.display())));
        }
    };
    println!(
        "done: {} steps in {:.1}s (first step {:.1}s) | final loss {:.4} | best val_loss {} | median {} tokens/s{}",
        s.steps,
        s.wall_s,
        s.first_step_s,
        s.final_loss,
        s.best_val_loss.map_or("-".into(), |v| format!("{v:.4}")),
        if s.median_tokens_per_s.is_finite() { format!("{:.0}", s.median_tokens_per_s) } else { "-".into() },
        s.peak_memory_reserved.map_or(String::new(), |b| format!(" | peak memory {:.2} GiB", b as f64 / (1u64 << 30) as f64))
    );
    println!(
        "metrics: {0}/metrics.jsonl, plot: {0}/loss.svg, checkpoints: {0}/checkpoints/",
        run_dir.display()
    );
    Ok(())
}

fn main() -> ExitCode {
    trainer::cli_main(real_main)
}
