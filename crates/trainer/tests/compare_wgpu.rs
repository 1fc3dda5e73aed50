//! `compare` on wgpu (lavapipe in CI): the CPU bar of the compare command. Three recipes whose
//! verdicts are known in advance: fp32 and fp16 with dynamic loss scaling stay stable, and fp16
//! without loss scaling at a learning rate of 100 must diverge. The report has each with its
//! verdict, the stable ones with their best validation loss and tokens/s; the loss-scale plot and
//! fp16's per-layer numerics heatmap appear; the same command again trains nothing.
//!
//! Why the overflow recipe diverges on every machine: AdamW's first step moves every weight by
//! about the learning rate (4.8 at step 1 of the 20-step warm-up), so at step 2 the SwiGLU
//! product alone is about (4.8 * 4.8 * sqrt(64))^2 = 3e4 and the down projection multiplies it by
//! another 4.8 * sqrt(d_ff) > 50: far past f16's largest value, 65504. Without loss scaling a
//! non-finite step stops the run, and a stopped run is "diverged". The stable ones train 8 steps
//! inside the warm-up, where the verdicts' spikes cannot count and the validation loss falls.

use std::process::Command;

/// Whether wgpu has an adapter here (cubecl-wgpu panics without one, a panic caught here). Without
/// one the test says in one line that it was skipped, unless `BURNMIX_REQUIRE_WGPU=1` (set by CI),
/// where it fails.
fn wgpu_or_skip(test: &str) -> bool {
    if std::panic::catch_unwind(trainer::wgpu_probe).is_ok_and(|code| code == 0) {
        return true;
    }
    if std::env::var("BURNMIX_REQUIRE_WGPU").is_ok_and(|v| v == "1") {
        panic!("{test} needs a wgpu adapter and none was found (BURNMIX_REQUIRE_WGPU=1)");
    }
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "skipped {test}: it trains on wgpu and wgpu found no adapter (install a Vulkan driver, \
         e.g. Debian's mesa-vulkan-drivers; BURNMIX_REQUIRE_WGPU=1 fails instead)"
    );
    false
}

#[test]
fn compare_fp32_and_fp16_on_wgpu() {
    if !wgpu_or_skip("compare_fp32_and_fp16_on_wgpu") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("burnmix-compare-wgpu-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let args = [
        "--recipes",
        "fp32,fp16,fp16-overflow:precision=fp16,loss_scale.mode=off,optimizer.lr=100",
        "--steps",
        "8",
        "--set",
        "device=wgpu",
        "--set",
        "training.eval_interval=4",
        "--set",
        "training.eval_batches=2",
        "--out",
        "cmp",
    ];
    let run = || {
        Command::new(env!("CARGO_BIN_EXE_compare"))
            .args(args)
            .current_dir(&dir)
            .output()
            .expect("run compare")
    };
    let out = run();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "compare failed:\n{stdout}\n{stderr}");
    let report: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("cmp/report.json")).expect("report.json"),
    )
    .expect("json");
    let rows = report["entries"].as_array().expect("entries");
    assert_eq!(
        rows.iter()
            .map(|r| r["recipe"].as_str().unwrap())
            .collect::<Vec<_>>(),
        ["fp32", "fp16", "fp16-overflow"]
    );
    let verdict = |r: &serde_json::Value| r["stability"]["verdict"].as_str().unwrap().to_string();
    for r in &rows[..2] {
        assert_eq!(verdict(r), "stable", "{r}");
        assert_eq!(r["steps_done"].as_u64(), Some(8), "{r}");
        assert!(
            r["best_val_loss"].as_f64().is_some_and(|v| v.is_finite()),
            "{r}"
        );
        assert!(r["tokens_per_s"].as_f64().is_some_and(|v| v > 0.0), "{r}");
    }
    // fp16 without loss scaling overflows, and the run stops with the trainer's error, kept as the
    // entry's error and given as the verdict's reason.
    let overflow = &rows[2];
    assert_eq!(verdict(overflow), "diverged", "{overflow}");
    let reason = overflow["stability"]["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("the run stopped: training diverged at step ")
            && reason.contains("gradients are not finite")
            && reason.contains("loss scaling is off"),
        "{reason}"
    );
    assert!(overflow["error"].as_str().is_some(), "{overflow}");
    assert!(overflow["best_val_loss"].is_null(), "{overflow}");
    // fp16 runs with dynamic loss scaling; its best validation loss is compared with fp32's.
    assert!(
        rows[1]["loss_scale_max"].as_f64().is_some_and(|s| s > 1.0),
        "{}",
        rows[1]
    );
    assert!(rows[1]["best_val_vs_fp32"].as_f64().is_some());
    // One entry at a time: the speed ratio is given, and no entry is marked as sharing the device.
    assert!(
        rows[1]["tokens_per_s_vs_fp32"].as_f64().is_some(),
        "{}",
        rows[1]
    );
    assert!(rows.iter().all(|r| r["shared_device_jobs"].is_null()));
    for svg in [
        "train_loss.svg",
        "val_loss.svg",
        "grad_norm.svg",
        "loss_scale.svg",
        // fp16's per-layer gradient numerics (recorded on step 1).
        "numerics-fp16.svg",
    ] {
        assert!(
            std::fs::read_to_string(dir.join("cmp").join(svg))
                .unwrap_or_default()
                .contains("<svg"),
            "{svg}"
        );
    }
    let md = std::fs::read_to_string(dir.join("cmp/report.md")).unwrap();
    assert!(md.contains("| fp16 |"), "{md}");
    assert!(md.contains("| fp16-overflow |"), "{md}");
    assert!(md.contains("| diverged (the run stopped: "), "{md}");

    let out = run();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert_eq!(
        stdout.matches("done earlier").count(),
        2,
        "the second run trains nothing:\n{stdout}"
    );
    assert_eq!(
        stdout.matches("fp16-overflow: failed earlier").count(),
        1,
        "a failed entry is reported, not retried:\n{stdout}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
