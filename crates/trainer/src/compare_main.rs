//! `compare`: precision recipes side by side from one config, with a report.
//!
//! ```text
//! compare [CONFIG.toml] --recipes fp32,bf16,fp16 [--lrs 3e-4,1e-3] [--seeds 1,2] [--steps N]
//!         [--set key=value]... [--out DIR] [--jobs K]
//! compare --list
//! compare --report DIR
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Parser;
use trainer::compare::{self, EntryState, Plan, RecipeSpec};
use trainer::{device, RunOptions};

/// Train precision recipes side by side and report their stability and speed.
///
/// Every entry is an ordinary run directory under DIR/runs/ (same config, data and schedule; only
/// the recipe, learning rate and seed differ). Running the same command again trains only what is
/// missing: finished entries are kept, interrupted ones resume from their newest checkpoint.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Cli {
    /// TOML config file (default: the built-in configs/default.toml).
    config: Option<PathBuf>,
    /// Recipes, comma-separated: built-in names (see --list) or NAME:key=value,... (a built-in
    /// recipe with extra overrides, or a new one).
    #[arg(long, value_name = "LIST")]
    recipes: Option<String>,
    /// Peak learning rates, comma-separated (default: the config's).
    #[arg(long, value_delimiter = ',', value_name = "LR,...")]
    lrs: Vec<f64>,
    /// Seeds, comma-separated (default: the config's).
    #[arg(long, value_delimiter = ',', value_name = "SEED,...")]
    seeds: Vec<u64>,
    /// Optimizer steps of every entry (default: the config's training.steps).
    #[arg(long)]
    steps: Option<u64>,
    /// Override one config key for every entry (repeatable), as for `train`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Comparison directory (default: runs/compare-<config name>).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Train K entries at once, each in its own process (on one GPU: they share it, so their
    /// tokens/s are not speed figures). Each entry's output goes to DIR/logs/<entry>.log.
    #[arg(long, default_value_t = 1, value_name = "K")]
    jobs: usize,
    /// Train only the entry of this name and write no report (what --jobs runs in each process).
    #[arg(long, hide = true, value_name = "ENTRY")]
    only: Option<String>,
    /// With --only: other entries train on the device at the same time.
    #[arg(long, hide = true, requires = "only")]
    shared_device: bool,
    /// List the built-in recipes and what each sets, and exit.
    #[arg(long)]
    list: bool,
    /// Re-render the report of the comparison in DIR from what is there, training nothing.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["config", "recipes", "lrs", "seeds", "steps", "set", "out", "jobs"])]
    report: Option<PathBuf>,
}

/// Splits a recipe list at the commas that separate recipes (a recipe's own overrides follow ':'
/// and are separated by commas too: `fp16,mine:precision=fp16,loss_scale.init=1024,bf16`).
fn split_recipes(list: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for part in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let is_override = part.contains('=') && !part.contains(':');
        match out.last_mut() {
            Some(last) if is_override && last.contains(':') => {
                last.push(',');
                last.push_str(part);
            }
            _ => out.push(part.to_string()),
        }
    }
    out
}

const PLAN_FILE: &str = "compare.json";

fn real_main() -> Result<()> {
    let cli = Cli::parse();
    if cli.list {
        println!(
            "built-in recipes (use as --recipes NAME, or NAME:key=value,... to add overrides):"
        );
        for (name, what, sets) in compare::RECIPES {
            println!("  {name:<13} {what}\n  {:<13} sets {}", "", sets.join(", "));
        }
        return Ok(());
    }
    let (dir, plan) = load_plan(&cli)?;
    let entries = plan.entries()?;
    if let Some(lr) = plan.lrs.iter().find(|lr| !(lr.is_finite() && **lr > 0.0)) {
        bail!("--lrs: {lr} is not a positive learning rate");
    }

    if cli.jobs == 0 {
        bail!("--jobs must be at least 1");
    }
    if let Some(only) = &cli.only {
        if !entries.iter().any(|e| &e.dir_name == only) {
            bail!("--only {only}: no such entry");
        }
    }

    if cli.report.is_none() {
        // The kernels' switches (BURNMIX_* variables): a bad value stops the comparison here
        // rather than failing every entry.
        kernels::settings::init_from_env().map_err(|e| anyhow::anyhow!("{e}"))?;
        save_plan(&cli, &dir, &plan)?;
        train_entries(&cli, &dir, &entries)?;
    }
    if cli.only.is_some() {
        return Ok(());
    }
    let reports = entries
        .iter()
        .map(|e| compare::entry_report(&compare::entry_dir(&dir, e), e))
        .collect::<Result<Vec<_>>>()?;
    let report = compare::write_report(&dir, &plan.origin, &plan.recipes, reports)?;
    for e in &report.entries {
        println!(
            "{:<28} best val {:>8} | {:>9} tokens/s{} | {}",
            e.name,
            e.best_val_loss.map_or("-".into(), |v| format!("{v:.4}")),
            e.tokens_per_s.map_or("-".into(), |v| format!("{v:.0}")),
            if e.shared_device_jobs.is_some() {
                " (shared device)"
            } else {
                ""
            },
            e.stability.verdict
        );
    }
    println!(
        "report: {0}/report.md, {0}/report.json, plots: {1}",
        dir.display(),
        report.plots.join(", ")
    );
    Ok(())
}

/// The comparison's plan: read back from `--report DIR`, or built from the arguments.
fn load_plan(cli: &Cli) -> Result<(PathBuf, Plan)> {
    Ok(match &cli.report {
        Some(dir) => {
            let path = dir.join(PLAN_FILE);
            let text = std::fs::read_to_string(&path).with_context(|| {
                format!(
                    "--report {}: no {PLAN_FILE} there; is it a comparison directory?",
                    dir.display()
                )
            })?;
            let plan: Plan = serde_json::from_str(&text)
                .with_context(|| format!("{} is not a comparison plan", path.display()))?;
            (dir.clone(), plan)
        }
        None => {
            let Some(list) = &cli.recipes else {
                bail!("--recipes is required (e.g. --recipes fp32,bf16,fp16); `compare --list` shows the built-in recipes")
            };
            let (base_toml, origin, name) = match &cli.config {
                Some(p) => {
                    let text = std::fs::read_to_string(p)
                        .with_context(|| format!("cannot read config {}", p.display()))?;
                    let stem = p
                        .file_stem()
                        .map(|s| s.to_string_lossy().to_string())
                        .unwrap_or("run".into());
                    (text, p.display().to_string(), stem)
                }
                None => (
                    trainer::config::DEFAULT_TOML.to_string(),
                    "built-in default config".to_string(),
                    "default".to_string(),
                ),
            };
            let dir = cli
                .out
                .clone()
                .unwrap_or_else(|| PathBuf::from("runs").join(format!("compare-{name}")));
            let plan = Plan {
                base_toml,
                origin,
                sets: cli.set.clone(),
                recipes: split_recipes(list)
                    .iter()
                    .map(|r| RecipeSpec::parse(r))
                    .collect::<Result<_>>()?,
                lrs: cli.lrs.clone(),
                seeds: cli.seeds.clone(),
                steps: cli.steps,
            };
            (dir, plan)
        }
    })
}

/// Writes the plan to `DIR/compare.json`, refusing a directory that holds a comparison with
/// another config, `--set` or `--steps`.
fn save_plan(cli: &Cli, dir: &std::path::Path, plan: &Plan) -> Result<()> {
    let path = dir.join(PLAN_FILE);
    // (An entry's own process, under --jobs, finds the plan its parent wrote.)
    if let (None, Ok(text)) = (&cli.only, std::fs::read_to_string(&path)) {
        let old: Plan = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a comparison plan", path.display()))?;
        let same =
            old.base_toml == plan.base_toml && old.sets == plan.sets && old.steps == plan.steps;
        if !same {
            bail!(
                "{} holds a comparison with another config, --set or --steps; use another --out, or the same arguments to continue it",
                dir.display()
            );
        }
    }
    if cli.only.is_none() {
        std::fs::create_dir_all(dir.join("runs"))
            .with_context(|| format!("cannot create {}", dir.display()))?;
        std::fs::write(&path, serde_json::to_string_pretty(plan)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// Trains every entry that is not done, each in a child process (`compare --only ENTRY`): one
/// after another with its output here, or `--jobs` at once with their output in `DIR/logs/`.
fn train_entries(cli: &Cli, dir: &std::path::Path, entries: &[compare::Entry]) -> Result<()> {
    let (selected, note) = device::select(entries[0].config.device)?;
    if let Some(n) = note {
        println!("device: {n}");
    }
    println!("device: {}", selected.describe());
    if cli.only.is_none() {
        println!(
            "comparison directory: {} ({} entries)",
            dir.display(),
            entries.len()
        );
    }
    // An entry's own process trains its entry itself.
    let jobs = if cli.only.is_some() { 1 } else { cli.jobs };
    let mut pool = Pool::new(dir, jobs);
    // Entries share the device when more than one is left to train and K > 1 run at once (an
    // entry's own process is told by its parent).
    // Each entry's state, read once: an entry changes only when this loop reaches it.
    let states: Vec<_> = entries
        .iter()
        .map(|e| {
            let run_dir = compare::entry_dir(dir, e);
            let state = compare::entry_state(&run_dir, &e.config);
            (run_dir, state)
        })
        .collect();
    let pending = states
        .iter()
        .filter(|(_, s)| matches!(s, EntryState::New | EntryState::Resumable))
        .count();
    let shared = cli.shared_device || (jobs > 1 && pending > 1);
    let announce = cli.only.is_some() || jobs > 1;
    for (i, (e, (run_dir, state))) in entries.iter().zip(states).enumerate() {
        if cli.only.as_ref().is_some_and(|o| o != &e.dir_name) {
            continue;
        }
        let tag = format!("[{}/{}] {}", i + 1, entries.len(), e.dir_name);
        match state {
            EntryState::Done => {
                println!("{tag}: done earlier");
                continue;
            }
            EntryState::Failed => {
                println!(
                    "{tag}: failed earlier (see {}; delete it to retry)",
                    run_dir.join(compare::ERROR_FILE).display()
                );
                continue;
            }
            // (One at a time, the entry's own process says it, when it starts.)
            EntryState::Resumable if announce => println!("{tag}: resuming"),
            EntryState::Resumable => {}
            EntryState::New => {
                if run_dir.exists() {
                    std::fs::remove_dir_all(&run_dir)
                        .with_context(|| format!("cannot clear {}", run_dir.display()))?;
                }
                if announce {
                    println!("{tag}: training");
                }
            }
        }
        if shared {
            compare::mark_shared(&run_dir, cli.jobs)?;
        }
        if cli.only.is_some() {
            train_here(&tag, e, &run_dir, state, &selected)?;
        } else {
            // Each entry in a process of its own, even one at a time: its peak memory, compile
            // time and tokens/s are then its own, not shaped by the pools and caches the entries
            // before it left behind.
            pool.spawn(&tag, &e.dir_name, &run_dir, shared)?;
        }
    }
    pool.wait_all()
}

/// Trains one entry in this process; an error is kept in the entry's `compare-error.txt`.
fn train_here(
    tag: &str,
    e: &compare::Entry,
    run_dir: &std::path::Path,
    state: EntryState,
    selected: &device::Selected,
) -> Result<()> {
    let opts = RunOptions {
        run_dir: run_dir.to_path_buf(),
        resume: state == EntryState::Resumable,
        device_name: selected.describe(),
        peak_tflops: None,
        verbose: true,
        stop_at: None,
        poison_steps: Vec::new(),
        place: None,
    };
    match trainer::run(&e.config, selected, &opts) {
        Ok(s) => println!(
            "{tag}: {} steps, best val_loss {}, median {} tokens/s",
            s.steps,
            s.best_val_loss.map_or("-".into(), |v| format!("{v:.4}")),
            if s.median_tokens_per_s.is_finite() {
                format!("{:.0}", s.median_tokens_per_s)
            } else {
                "-".into()
            }
        ),
        Err(err) => {
            let msg = format!("{err:#}");
            println!("{tag}: failed: {msg}");
            std::fs::create_dir_all(run_dir)?;
            std::fs::write(run_dir.join(compare::ERROR_FILE), &msg)?;
        }
    }
    Ok(())
}

/// Entries trained in child processes, at most `jobs` at once.
struct Pool {
    logs: std::path::PathBuf,
    jobs: usize,
    running: Vec<(String, std::path::PathBuf, std::process::Child)>,
}

impl Pool {
    fn new(dir: &std::path::Path, jobs: usize) -> Self {
        Self {
            logs: dir.join("logs"),
            jobs,
            running: Vec::new(),
        }
    }

    /// Starts `compare --only NAME` with this process's arguments, once a slot is free.
    fn spawn(
        &mut self,
        tag: &str,
        name: &str,
        run_dir: &std::path::Path,
        shared: bool,
    ) -> Result<()> {
        while self.running.len() >= self.jobs {
            self.reap(true)?;
        }
        let mut command = std::process::Command::new(std::env::current_exe()?);
        command
            .args(std::env::args_os().skip(1))
            .args(["--only", name])
            .args(shared.then_some("--shared-device"));
        if self.jobs > 1 {
            std::fs::create_dir_all(&self.logs)?;
            let log_path = self.logs.join(format!("{name}.log"));
            let log = std::fs::File::create(&log_path)
                .with_context(|| format!("cannot create {}", log_path.display()))?;
            command.stdout(log.try_clone()?).stderr(log);
            println!(
                "{tag}: started in its own process (log: {})",
                log_path.display()
            );
        }
        let child = command.spawn().context("cannot start a compare process")?;
        self.running
            .push((tag.to_string(), run_dir.to_path_buf(), child));
        Ok(())
    }

    /// Collects finished children (waiting for one when `block`).
    fn reap(&mut self, block: bool) -> Result<()> {
        loop {
            let mut i = 0;
            let mut reaped = false;
            while i < self.running.len() {
                if let Some(status) = self.running[i].2.try_wait()? {
                    let (tag, run_dir, _) = self.running.remove(i);
                    if status.success() {
                        println!("{tag}: finished");
                    } else {
                        // A child that died without recording why (killed, crashed): say so.
                        let err = run_dir.join(compare::ERROR_FILE);
                        if !err.exists() && status.code().is_some() {
                            std::fs::create_dir_all(&run_dir)?;
                            std::fs::write(
                                &err,
                                format!("the entry's process exited with {status}; see its log"),
                            )?;
                        }
                        println!("{tag}: failed ({status})");
                    }
                    reaped = true;
                } else {
                    i += 1;
                }
            }
            if reaped || !block || self.running.is_empty() {
                return Ok(());
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }

    fn wait_all(&mut self) -> Result<()> {
        while !self.running.is_empty() {
            self.reap(true)?;
        }
        Ok(())
    }
}

fn main() -> ExitCode {
    trainer::cli_main(real_main)
}

#[cfg(test)]
mod tests {
    use super::split_recipes;

    #[test]
    fn recipe_lists_split_at_recipes_not_at_their_overrides() {
        assert_eq!(split_recipes("fp32, bf16"), ["fp32", "bf16"]);
        assert_eq!(
            split_recipes("fp16,mine:precision=fp16,loss_scale.init=1024,bf16"),
            ["fp16", "mine:precision=fp16,loss_scale.init=1024", "bf16"]
        );
    }
}
