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
fn train_without_drivers(dir: &PathBuf, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_train"))
        .args(args)
        .current_dir(dir)
        .env("VK_ICD_FILENAMES", "/nonexistent")
        .env("VK_DRIVER_FILES", "/nonexistent")
        .env("PATH", "/nonexistent")
        .output()
        .expect("run train")
}

#[test]
fn auto_device_falls_back_to_the_cpu_and_learns() {
    let dir = scratch("auto");
    let out = train_without_drivers(&dir, &["--set", "training.steps=20", "--set", "training.eval_interval=0", "--out", "run"]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "train failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("using the CPU"), "the log says why the CPU was chosen:\n{stdout}");
    let losses: Vec<f64> = std::fs::read_to_string(dir.join("run/metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json")["loss"].as_f64().expect("loss"))
        .collect();
    assert_eq!(losses.len(), 20);
    assert!(losses[19] < losses[0] - 0.5, "the CPU run learns: {losses:?}");

    // `sample` continues a prompt from the run's checkpoint.
    let sample = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_sample"))
            .args(args)
            .current_dir(&dir)
            .env("VK_ICD_FILENAMES", "/nonexistent")
            .env("VK_DRIVER_FILES", "/nonexistent")
            .env("PATH", "/nonexistent")
            .output()
            .expect("run sample")
    };
    let out = sample(&["run", "--prompt", "The ", "--max-new-tokens", "40", "--seed", "3"]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "sample failed:\n{stdout}\n{stderr}");
    assert!(stdout.starts_with("The "), "the prompt comes first: {stdout:?}");
    assert!(stdout.trim_end().chars().count() > "The ".len() + 10, "text was generated: {stdout:?}");
    assert!(stderr.contains("40 tokens in") && stderr.contains("tokens/s"), "{stderr}");
    // The same seed gives the same text; greedy decoding is deterministic too.
    let again = sample(&["run", "--prompt", "The ", "--max-new-tokens", "40", "--seed", "3"]);
    assert_eq!(String::from_utf8_lossy(&again.stdout), stdout, "same seed, same text");

    // Clear errors: a prompt character the tokenizer never saw, a missing checkpoint, not a run.
    let out = sample(&["run", "--prompt", "\u{1F600}"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("characters this run's tokenizer never saw"), "{stderr}");
    let out = sample(&["run", "--checkpoint", "7"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no checkpoint of step 7; the run has steps 20"), "{stderr}");
    std::fs::create_dir_all(dir.join("empty")).unwrap();
    let out = sample(&["empty"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no config.toml there; is it a run directory?"), "{stderr}");
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
    assert!(lines[0].starts_with("error: device = \"wgpu\" but wgpu found no usable adapter"), "{stderr}");
    assert!(lines[0].contains("mesa-vulkan-drivers"), "the error names the fix: {stderr}");
    assert!(!stderr.contains("panicked") && !stderr.contains("backtrace"), "{stderr}");
    assert!(!dir.join("run").exists(), "no run directory is left behind");
}

#[test]
fn cpu_device_refuses_low_precision_with_one_line() {
    let dir = scratch("cpu-bf16");
    let out = train_without_drivers(&dir, &["--set", "device=\"cpu\"", "--set", "precision=\"bf16\"", "--out", "run"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("precision = \"bf16\" needs a GPU"), "{stderr}");
}
