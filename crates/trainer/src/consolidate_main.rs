//! `consolidate`: turns a sharded checkpoint into one checkpoint file.
//!
//! ```text
//! consolidate SHARDS_DIR [--out FILE]
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::Parser;

/// Write the checkpoint that a sharded checkpoint makes up (`checkpoints/step_N.shards/`, written
/// by a run of one process per GPU under ZeRO, each rank its own parameters) as one checkpoint
/// file, which `train --resume`, `sample` and `compare` read like any other. The shards are
/// checked (checksums, step, every parameter in exactly one shard) and left in place.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Cli {
    /// The sharded checkpoint's directory (RUN/checkpoints/step_NNNNNNNN.shards).
    shards: PathBuf,
    /// Where to write the checkpoint (default: step_NNNNNNNN.ckpt beside the directory). An
    /// existing file is not overwritten.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

fn main() -> ExitCode {
    trainer::cli_main(|| {
        let cli = Cli::parse();
        if !cli.shards.is_dir() {
            bail!(
                "{} is not a directory: give a sharded checkpoint's directory (RUN/checkpoints/step_NNNNNNNN.shards)",
                cli.shards.display()
            );
        }
        let out = match cli.out {
            Some(out) => out,
            None => {
                let name = cli
                    .shards
                    .file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_suffix(".shards"))
                    .with_context(|| {
                        format!(
                            "{} is not named step_NNNNNNNN.shards; give --out FILE",
                            cli.shards.display()
                        )
                    })?;
                cli.shards.with_file_name(format!("{name}.ckpt"))
            }
        };
        if out.exists() {
            bail!(
                "{} already exists; remove it or give another --out",
                out.display()
            );
        }
        let header = trainer::checkpoint::shards::consolidate(&cli.shards, &out)?;
        eprintln!(
            "wrote {} (step {}, {} parameters, trained on {} GPUs)",
            out.display(),
            header.step,
            header.params.len(),
            header.devices
        );
        Ok(())
    })
}
