//! The `train` binary as a user meets it on a machine without a GPU driver: with no Vulkan driver
//! visible (`VK_ICD_FILENAMES` pointing nowhere), `device = "auto"` trains on the CPU, and an
//! explicit `device = "wgpu"` is one clear error line, exit code 1, no panic, no run directory.

use std::path::PathBuf;
use std::process::Command;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burnmix-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// `train` with no Vulkan ICD and no NVIDIA tools on the path.
fn train_without_drivers(dir: &std::path::Path, args: &[&str]) -> std::process::Output {
    without_drivers(env!("CARGO_BIN_EXE_train"), dir, args)
}

/// Runs `bin` in `dir` with no Vulkan ICD and no NVIDIA tools on the path.
fn without_drivers(bin: &str, dir: &std::path::Path, args: &[&str]) -> std::process::Output {
    without_drivers_with(bin, dir, args, &[])
}

/// [`without_drivers`] with more environment variables set.
fn without_drivers_with(
    bin: &str,
    dir: &std::path::Path,
    args: &[&str],
    vars: &[(&str, &str)],
) -> std::process::Output {
    Command::new(bin)
        .args(args)
        .current_dir(dir)
        .env("VK_ICD_FILENAMES", "/nonexistent")
        .env("VK_DRIVER_FILES", "/nonexistent")
        .env("PATH", "/nonexistent")
        .envs(vars.iter().copied())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {bin}: {e}"))
}

#[test]
fn auto_device_falls_back_to_the_cpu_and_learns() {
    let dir = scratch("auto");
    let out = train_without_drivers(
        &dir,
        &[
            "--set",
            "training.steps=20",
            "--set",
            "training.eval_interval=0",
            "--out",
            "run",
        ],
    );
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "train failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("using the CPU"),
        "the log says why the CPU was chosen:\n{stdout}"
    );
    let losses: Vec<f64> = std::fs::read_to_string(dir.join("run/metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).expect("json")["loss"]
                .as_f64()
                .expect("loss")
        })
        .collect();
    assert_eq!(losses.len(), 20);
    assert!(
        losses[19] < losses[0] - 0.5,
        "the CPU run learns: {losses:?}"
    );

    // `sample` continues a prompt from the run's checkpoint.
    let sample = |args: &[&str]| without_drivers(env!("CARGO_BIN_EXE_sample"), &dir, args);
    let out = sample(&[
        "run",
        "--prompt",
        "The ",
        "--max-new-tokens",
        "40",
        "--seed",
        "3",
    ]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "sample failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.starts_with("The "),
        "the prompt comes first: {stdout:?}"
    );
    assert!(
        stdout.trim_end().chars().count() > "The ".len() + 10,
        "text was generated: {stdout:?}"
    );
    assert!(
        stderr.contains("40 tokens in") && stderr.contains("tokens/s"),
        "{stderr}"
    );
    // The same seed gives the same text; greedy decoding is deterministic too.
    let again = sample(&[
        "run",
        "--prompt",
        "The ",
        "--max-new-tokens",
        "40",
        "--seed",
        "3",
    ]);
    assert_eq!(
        String::from_utf8_lossy(&again.stdout),
        stdout,
        "same seed, same text"
    );

    // Three samples side by side, each printed after the prompt; the first is the single run's
    // text when greedy (every row takes the most likely token).
    let greedy = |n: &str| {
        sample(&[
            "run",
            "--prompt",
            "The ",
            "--max-new-tokens",
            "30",
            "--temperature",
            "0",
            "--num-samples",
            n,
        ])
    };
    let (one, three) = (greedy("1"), greedy("3"));
    let three_out = String::from_utf8_lossy(&three.stdout);
    assert!(three.status.success(), "{three_out}");
    let texts: Vec<&str> = three_out
        .split("--- sample ")
        .skip(1)
        .map(|s| s.split_once('\n').unwrap().1.trim_end())
        .collect();
    assert_eq!(texts.len(), 3, "{three_out}");
    assert!(
        texts
            .iter()
            .all(|t| *t == String::from_utf8_lossy(&one.stdout).trim_end()),
        "{three_out}"
    );
    assert!(String::from_utf8_lossy(&three.stderr).contains("90 tokens in"));

    // Clear errors: a prompt character the tokenizer never saw, a missing checkpoint, not a run.
    let out = sample(&["run", "--prompt", "\u{1F600}"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("characters this run's tokenizer never saw"),
        "{stderr}"
    );
    let out = sample(&["run", "--checkpoint", "7"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no checkpoint of step 7; the run has steps 20"),
        "{stderr}"
    );
    std::fs::create_dir_all(dir.join("empty")).unwrap();
    let out = sample(&["empty"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no config.toml there; is it a run directory?"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn explicit_wgpu_without_an_adapter_is_one_clear_error() {
    let dir = scratch("wgpu");
    let out = train_without_drivers(&dir, &["--set", "device=\"wgpu\"", "--out", "run"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "exit code 1; stderr:\n{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line of error output:\n{stderr}");
    assert!(
        lines[0].starts_with("error: device = \"wgpu\" but wgpu found no usable adapter"),
        "{stderr}"
    );
    assert!(
        lines[0].contains("mesa-vulkan-drivers"),
        "the error names the fix: {stderr}"
    );
    assert!(
        !stderr.contains("panicked") && !stderr.contains("backtrace"),
        "{stderr}"
    );
    assert!(!dir.join("run").exists(), "no run directory is left behind");
}

#[test]
fn cpu_device_refuses_low_precision_with_one_line() {
    let dir = scratch("cpu-bf16");
    let out = train_without_drivers(
        &dir,
        &[
            "--set",
            "device=\"cpu\"",
            "--set",
            "precision=\"bf16\"",
            "--out",
            "run",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("precision = \"bf16\" needs a GPU"),
        "{stderr}"
    );
}

/// A bad kernel setting in the environment stops the run before it trains, naming the variable
/// and the valid values.
#[test]
fn a_bad_kernel_setting_is_one_clear_error() {
    let dir = scratch("bad-setting");
    let out = without_drivers_with(
        env!("CARGO_BIN_EXE_train"),
        &dir,
        &["--set", "device=\"cpu\"", "--out", "run"],
        &[("BURNMIX_FP8_GEMM", "fast")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with("error: ")
            && stderr
                .contains("BURNMIX_FP8_GEMM: `fast` is not one of auto, cublaslt, mma, dequantize"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!dir.join("run").exists(), "no run directory is left behind");
}

/// `--nproc-per-node 2` starts two ranks; off CUDA a rank refuses with one line naming its rank and
/// the reason, and the launcher's error names the rank that failed first (and stops the other,
/// which may not have printed its own line by then).
#[test]
fn processes_off_cuda_are_one_clear_error_per_rank() {
    let dir = scratch("nproc-cpu");
    let out = train_without_drivers(&dir, &["--set", "device=\"cpu\"", "--nproc-per-node", "2"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(
        stdout.contains("launching 2 processes on this node"),
        "{stdout}"
    );
    assert!(
        stderr.contains("runs of several processes need CUDA GPUs"),
        "{stderr}"
    );
    let first = (0..2)
        .find(|rank| stderr.contains(&format!("error: rank {rank} exited with status 1")))
        .unwrap_or_else(|| panic!("the launcher names the rank that failed: {stderr}"));
    assert!(
        stderr.contains(&format!("rank {first} of 2: ")),
        "the rank that failed first printed its reason: {stderr}"
    );
    assert!(
        stderr.contains("exited with status 1; the other processes of this node were stopped"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        !dir.join("runs").exists(),
        "no run directory is left behind"
    );
}

/// A process started with torchrun's variables but no run directory is told to name one.
#[test]
fn a_rank_without_a_run_directory_is_told_to_name_one() {
    let dir = scratch("rank-no-out");
    let out = without_drivers_with(
        env!("CARGO_BIN_EXE_train"),
        &dir,
        &["--set", "device=\"cpu\""],
        &[
            ("WORLD_SIZE", "2"),
            ("RANK", "1"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("rank 1 of a run of 2 processes") && stderr.contains("--out DIR"),
        "{stderr}"
    );
}

/// SIGTERM (a cluster preempting the job) stops the run at the next step boundary with that
/// step's checkpoint and exit code 0, and `--resume` continues it with unbroken metrics.
#[test]
fn sigterm_checkpoints_the_step_and_exits_zero() {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let dir = scratch("sigterm");
    let run = dir.join("run");
    let mut child = Command::new(env!("CARGO_BIN_EXE_train"))
        .args([
            "--set",
            "device=\"cpu\"",
            "--set",
            "training.steps=100000",
            "--set",
            "training.eval_interval=0",
            "--set",
            "training.checkpoint_interval=0",
            "--out",
            "run",
        ])
        .current_dir(&dir)
        .env("VK_ICD_FILENAMES", "/nonexistent")
        .env("VK_DRIVER_FILES", "/nonexistent")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("train starts");
    let steps_logged =
        || std::fs::read_to_string(run.join("metrics.jsonl")).map_or(0, |m| m.lines().count());
    let start = Instant::now();
    while steps_logged() < 3 {
        if start.elapsed() > Duration::from_secs(600) || child.try_wait().unwrap().is_some() {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "the run did not reach step 3: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: signals a child this test started and has not reaped.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let signalled = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if signalled.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("the run did not stop within 120 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{:?}: {text}", out.status);
    let last = steps_logged() as u64;
    assert!(
        text.contains(&format!("stopped after step {last} as asked")),
        "{text}"
    );
    assert!(run
        .join("checkpoints")
        .join(trainer::checkpoint::file_name(last))
        .exists());
    // Two more steps from there: the metrics read as one run.
    let out = train_without_drivers(
        &dir,
        &["--resume", "run", "--stop-at", &(last + 2).to_string()],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let steps: Vec<u64> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<trainer::metrics::StepRecord>(l)
                .unwrap()
                .step
        })
        .collect();
    assert_eq!(steps, (1..=last + 2).collect::<Vec<_>>());
}

/// `compare` on the CPU: two recipes (a built-in one and one defined by overrides) at two learning
/// rates, two processes at a time, write every entry as a run, the report (markdown, JSON, plots);
/// a second run of the same command trains nothing; an entry that lost its end resumes; bad
/// recipes are refused by name.
#[test]
fn compare_trains_each_entry_once_and_reports() {
    let dir = scratch("compare");
    let compare = |args: &[&str]| without_drivers(env!("CARGO_BIN_EXE_compare"), &dir, args);
    let args = [
        "--recipes",
        "fp32,nodecay:optimizer.weight_decay=0",
        "--lrs",
        "1e-3,3e-3",
        "--steps",
        "6",
        "--set",
        "training.eval_interval=3",
        "--set",
        "training.eval_batches=2",
        "--out",
        "cmp",
        "--jobs",
        "2",
    ];
    let out = compare(&args);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "compare failed:\n{stdout}\n{stderr}");
    let entries = [
        "fp32-lr1e-3",
        "fp32-lr3e-3",
        "nodecay-lr1e-3",
        "nodecay-lr3e-3",
    ];
    for e in entries {
        assert!(
            dir.join("cmp/runs").join(e).join("summary.json").exists(),
            "entry {e} is a finished run:\n{stdout}"
        );
        assert!(stdout.contains(&format!("{e}: finished")), "{stdout}");
        let log = std::fs::read_to_string(dir.join("cmp/logs").join(format!("{e}.log")))
            .expect("entry log");
        assert!(
            log.contains(&format!("{e}: 6 steps, best val_loss")),
            "{log}"
        );
    }
    let report: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("cmp/report.json")).expect("report.json"),
    )
    .expect("json");
    let rows = report["entries"].as_array().expect("entries");
    assert_eq!(rows.len(), 4);
    for r in rows {
        assert!(
            r["best_val_loss"].as_f64().is_some_and(|v| v.is_finite()),
            "{r}"
        );
        assert!(r["tokens_per_s"].as_f64().is_some_and(|v| v > 0.0), "{r}");
        // Six fp32 steps, all inside the 20-step warm-up: no spike can count, and the validation
        // loss falls from step 3 to step 6 at these learning rates.
        assert_eq!(r["stability"]["verdict"].as_str(), Some("stable"), "{r}");
    }
    // The fp32 entries are their own reference; the other recipe is compared with fp32 at its lr.
    assert_eq!(rows[0]["best_val_vs_fp32"].as_f64(), Some(0.0));
    assert!(rows[2]["best_val_vs_fp32"].as_f64().is_some());
    // Under --jobs 2 the entries shared the device: tokens/s is flagged and has no ratio.
    for r in rows {
        assert_eq!(r["shared_device_jobs"].as_u64(), Some(2), "{r}");
        assert!(r["tokens_per_s_vs_fp32"].is_null(), "{r}");
    }
    let md = std::fs::read_to_string(dir.join("cmp/report.md")).expect("report.md");
    for e in entries {
        assert!(md.contains(e), "report.md lists {e}:\n{md}");
    }
    assert!(md.contains("(shared)") && md.contains("--jobs 2"), "{md}");
    for svg in [
        "train_loss.svg",
        "val_loss.svg",
        "grad_norm.svg",
        "lr_sensitivity.svg",
    ] {
        let text = std::fs::read_to_string(dir.join("cmp").join(svg)).unwrap_or_default();
        assert!(text.contains("<svg"), "{svg} is a plot");
    }

    // The same command again trains nothing.
    let metrics = |e: &str| {
        std::fs::read_to_string(dir.join("cmp/runs").join(e).join("metrics.jsonl"))
            .expect("metrics")
    };
    let before = metrics("fp32-lr1e-3");
    let out = compare(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert_eq!(stdout.matches("done earlier").count(), 4, "{stdout}");
    assert!(!stdout.contains("training"), "{stdout}");
    assert_eq!(metrics("fp32-lr1e-3"), before);

    // An entry whose run did not finish resumes from its checkpoint.
    std::fs::remove_file(dir.join("cmp/runs/nodecay-lr3e-3/summary.json")).expect("remove summary");
    let out = compare(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("nodecay-lr3e-3: resuming"), "{stdout}");
    assert!(dir.join("cmp/runs/nodecay-lr3e-3/summary.json").exists());

    // A bad kernel setting stops the comparison before any entry trains (and fails none).
    std::fs::remove_file(dir.join("cmp/runs/nodecay-lr3e-3/summary.json")).expect("remove summary");
    let out = without_drivers_with(
        env!("CARGO_BIN_EXE_compare"),
        &dir,
        &args,
        &[("BURNMIX_GEMM_ORDER", "gpu")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("BURNMIX_GEMM_ORDER: `gpu` is not one of same, stream, host"),
        "{stderr}"
    );
    assert!(!dir
        .join("cmp/runs/nodecay-lr3e-3")
        .join(trainer::compare::ERROR_FILE)
        .exists());

    // Bad recipes: one error line naming the recipe or the key, exit code 1, nothing trained.
    for (recipes, expected) in [
        ("fp32,fp64", "unknown recipe 'fp64'"),
        ("x:optimizer.lrr=1", "optimizer.lrr"),
    ] {
        let out = compare(&["--recipes", recipes, "--steps", "2", "--out", "bad"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.starts_with("error: ") && stderr.contains(expected),
            "{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(
            !dir.join("bad/runs").exists()
                || std::fs::read_dir(dir.join("bad/runs"))
                    .unwrap()
                    .next()
                    .is_none()
        );
    }
}

/// `consolidate` refuses what is not a finished sharded checkpoint with one line each: a path that
/// is not a directory, a directory without its manifest (a save that did not complete), and an
/// existing output file.
#[test]
fn consolidate_refuses_what_is_not_a_finished_sharded_checkpoint() {
    let dir = scratch("consolidate");
    let consolidate =
        |args: &[&str]| without_drivers(env!("CARGO_BIN_EXE_consolidate"), &dir, args);
    let unfinished = dir.join("step_00000010.shards");
    std::fs::create_dir_all(&unfinished).unwrap();
    std::fs::write(dir.join("step_00000010.ckpt"), b"in the way").unwrap();
    for (args, want) in [
        (vec!["missing.shards"], "is not a directory"),
        (
            vec!["step_00000010.shards", "--out", "out.ckpt"],
            "unfinished sharded checkpoint",
        ),
        (vec!["step_00000010.shards"], "already exists"),
    ] {
        let out = consolidate(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            stderr.starts_with("error: ") && stderr.contains(want) && stderr.lines().count() == 1,
            "{args:?}: {stderr}"
        );
    }
    assert!(!dir.join("out.ckpt").exists());
}
