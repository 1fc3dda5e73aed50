//! `train`: trains a GPT from a TOML config.
//!
//! ```text
//! train [CONFIG.toml] [--set key=value]... [--out DIR] [--resume DIR] [--stop-at STEP] [--print-config]
//!       [--nproc-per-node N [--nnodes M --node-rank R --master-addr HOST --master-port PORT]]
//! ```
//!
//! Started with torchrun's variables set (`WORLD_SIZE`, `RANK`, `LOCAL_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`, by torchrun, SLURM or `--nproc-per-node`), it is one rank of a run of one
//! process per GPU.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
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
    /// Start N processes on this node, one per GPU (GPU i for process i), that train together:
    /// each on its share of every batch, gradients averaged through NCCL.
    #[arg(long, value_name = "N")]
    nproc_per_node: Option<usize>,
    /// With --nproc-per-node: the number of nodes (machines) in the run; start one `train` on
    /// each, all with the same --out (on a shared file system) and --master-addr. Default 1.
    #[arg(long, value_name = "M")]
    nnodes: Option<usize>,
    /// With --nproc-per-node and --nnodes: this node's index, 0..M (node 0 holds rank 0).
    #[arg(long, value_name = "R")]
    node_rank: Option<usize>,
    /// With --nproc-per-node: node 0's address, where rank 0 listens for the others (default
    /// 127.0.0.1, for one node).
    #[arg(long, value_name = "HOST")]
    master_addr: Option<String>,
    /// With --nproc-per-node: the port rank 0 listens on (default 29500).
    #[arg(long, value_name = "PORT")]
    master_port: Option<u16>,
}

/// The flags that only the launcher reads (each with a value), left out of its processes' arguments.
const LAUNCHER_FLAGS: [&str; 5] = [
    "--nproc-per-node",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
];

/// `args` without the launcher's flags and their values (`--flag value` or `--flag=value`).
fn without_launcher_flags(
    args: impl Iterator<Item = std::ffi::OsString>,
) -> Vec<std::ffi::OsString> {
    let mut out = Vec::new();
    let mut skip_value = false;
    for a in args {
        if std::mem::take(&mut skip_value) {
            continue;
        }
        let text = a.to_string_lossy();
        if let Some(flag) = LAUNCHER_FLAGS.iter().find(|f| text.starts_with(**f)) {
            if text.len() == flag.len() {
                skip_value = true;
                continue;
            }
            if text[flag.len()..].starts_with('=') {
                continue;
            }
        }
        out.push(a);
    }
    out
}

/// `--nproc-per-node`: starts this node's processes of the run in `run_dir` and waits for them.
fn launch(cli: &Cli, nproc: usize, run_dir: &std::path::Path) -> Result<()> {
    use trainer::parallel::launch::{self, Launch};
    if trainer::parallel::place::Place::from_env()?.is_some() {
        bail!(
            "--nproc-per-node starts one process per GPU itself, but this process already has a place in a run \
             (WORLD_SIZE or SLURM_NTASKS is set: started by torchrun or SLURM?); use one or the other"
        );
    }
    let mut plan = Launch::single_node(nproc);
    plan.nnodes = cli.nnodes.unwrap_or(1);
    plan.node_rank = cli.node_rank.unwrap_or(0);
    if let Some(a) = &cli.master_addr {
        plan.master_addr = a.clone();
    }
    if let Some(p) = cli.master_port {
        plan.master_port = p;
    }
    plan.check()?;
    if plan.nnodes > 1 && cli.out.is_none() && cli.resume.is_none() {
        bail!(
            "--nnodes {}: every node must name the same run directory; give --out DIR (on a file system every node sees)",
            plan.nnodes
        );
    }
    let mut args = without_launcher_flags(std::env::args_os().skip(1));
    if cli.out.is_none() && cli.resume.is_none() {
        // The default directory's time stamp is fixed here, once, for every process.
        args.push("--out".into());
        args.push(run_dir.as_os_str().to_owned());
    }
    let first = plan.node_rank * nproc;
    let (processes, ranks, gpus) = if nproc == 1 {
        (
            "1 process".to_string(),
            format!("rank {first}"),
            "GPU 0".to_string(),
        )
    } else {
        (
            format!("{nproc} processes"),
            format!("ranks {first}..{}", first + nproc),
            format!("GPUs 0..{nproc}"),
        )
    };
    println!(
        "launching {processes} on this node ({ranks} of {}, {gpus}), rendezvous at {}:{}; run directory: {}",
        plan.nnodes * nproc,
        plan.master_addr,
        plan.master_port,
        run_dir.display()
    );
    let program = std::env::current_exe().context("the path of this program")?;
    launch::run(&program, &args, &plan)
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

/// This process's place in a run of processes (torchrun's or SLURM's variables), which needs a
/// run directory every rank names; `None` for a run of one process.
fn rank_place(cli: &Cli) -> Result<Option<trainer::parallel::place::Place>> {
    let place = trainer::parallel::place::Place::from_env()?;
    if let Some(p) = &place {
        if cli.out.is_none() && cli.resume.is_none() {
            bail!(
                "this process is rank {} of a run of {} processes (WORLD_SIZE is set): every rank must name the same \
                 run directory, so give --out DIR (or --resume DIR)",
                p.rank,
                p.world_size
            );
        }
    }
    Ok(place)
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
    if let Some(nproc) = cli.nproc_per_node {
        return launch(&cli, nproc, &run_dir);
    }
    if cli.nnodes.is_some()
        || cli.node_rank.is_some()
        || cli.master_addr.is_some()
        || cli.master_port.is_some()
    {
        bail!("--nnodes, --node-rank, --master-addr and --master-port go with --nproc-per-node");
    }
    let place = rank_place(&cli)?;
    // SIGINT or SIGTERM: a checkpoint at the next step boundary, then exit 0.
    trainer::stop::install_handlers();
    let speaks = place.as_ref().is_none_or(|p| p.rank == 0);
    let rank_prefix = place.as_ref().map_or(String::new(), |p| {
        format!("rank {} of {}: ", p.rank, p.world_size)
    });

    let (selected, note) = device::select(cfg.device)?;
    if let Some(n) = note.filter(|_| speaks) {
        println!("device: {n}");
    }
    let peak = if cfg.training.peak_tflops > 0.0 {
        Some(cfg.training.peak_tflops)
    } else {
        selected.gpu_name().and_then(device::peak_bf16_tflops)
    };
    if speaks {
        println!(
            "device: {}{}",
            selected.describe(),
            peak.map_or(String::new(), |p| format!(", MFU against {p} TFLOP/s"))
        );
        println!("run directory: {}", run_dir.display());
    }
    if speaks && matches!(selected, device::Selected::Cuda { .. }) {
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
        place,
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
            if speaks && !existed && !stepped && run_dir.exists() {
                let _ = std::fs::remove_dir_all(&run_dir);
                return Err(e.context(format!(
                    "{rank_prefix}run {} (removed: it failed before its first step)",
                    run_dir.display()
                )));
            }
            return Err(e.context(format!("{rank_prefix}run {}", run_dir.display())));
        }
    };
    if !speaks {
        return Ok(());
    }
    println!(
        "done: {} steps in {:.1}s (first step {:.1}s) | final loss {:.4} | best val_loss {} | median {} tokens/s{}{}",
        s.steps,
        s.wall_s,
        s.first_step_s,
        s.final_loss,
        s.best_val_loss.map_or("-".into(), |v| format!("{v:.4}")),
        if s.median_tokens_per_s.is_finite() { format!("{:.0}", s.median_tokens_per_s) } else { "-".into() },
        s.peak_memory_reserved.map_or(String::new(), |b| format!(" | peak memory {:.2} GiB", b as f64 / (1u64 << 30) as f64)),
        s.hopper_attention.map_or(String::new(), |h| format!(" | {h}"))
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
