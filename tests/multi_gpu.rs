//! Data parallelism on two GPUs (`training.devices`), against one GPU with the doubled batch.
//! Marked `#[ignore = "needs 2 GPUs"]`: run on a machine with two CUDA GPUs and NCCL with
//! `cargo test --release --test multi_gpu -- --ignored` (or the staged binary, `--ignored`).

mod common;

use common::{opts, read_metrics, scratch, serial, tiny_config};
use trainer::checkpoint;
use trainer::config::{Config, DeviceKind, Devices, PrecisionKind};
use trainer::device::Selected;

fn cuda() -> Selected {
    Selected::Cuda {
        index: 0,
        name: "test".into(),
    }
}

fn config(precision: PrecisionKind, batch: usize, devices: Devices) -> Config {
    let mut cfg = tiny_config(20);
    cfg.device = DeviceKind::Cuda;
    cfg.precision = precision;
    // The GPU's own kernels, as a real run uses them.
    cfg.model.kernels = model::KernelsKind::Auto;
    cfg.model.attention = model::AttentionKind::Auto;
    cfg.model.dropout = 0.0;
    cfg.model.d_model = 64;
    cfg.model.context = 64;
    cfg.training.batch_size = batch;
    cfg.training.devices = devices;
    cfg
}

/// Trains `cfg` in a fresh directory: its per-step losses and final checkpoint's header and values.
fn train(cfg: &Config, name: &str) -> (Vec<f64>, checkpoint::Header, Vec<f32>) {
    let dir = scratch(name);
    trainer::run(cfg, &cuda(), &opts(dir.clone(), false))
        .unwrap_or_else(|e| panic!("{name}: {e:#}"));
    let losses = read_metrics(&dir).iter().map(|r| r.loss).collect();
    let (h, v) = checkpoint::read(
        &dir.join("checkpoints")
            .join(checkpoint::file_name(cfg.training.steps as u64)),
    )
    .unwrap();
    (losses, h, v)
}

/// 20 steps on 2 GPUs with 4 sequences each equal 20 steps on one GPU with 8: per-step losses
/// within the precision's rounding, final weights within a small fraction of one AdamW step on
/// average, and the two replicas identical.
#[test]
#[ignore = "needs 2 GPUs"]
fn two_gpus_equal_one_gpu_with_the_doubled_batch() {
    let _guard = serial();
    // Relative loss tolerance: fp32 rounding in a reduction order that differs between a batch of
    // 8 and two of 4; bf16 computes the products in 8-bit mantissas (2^-8), a few units of it.
    // Mean weight difference, in units of lr: f32 rounding, or bf16's (2^-8) in the gradients.
    for (precision, loss_tol, mean_tol) in [
        (PrecisionKind::Fp32, 1e-3, 0.01),
        (PrecisionKind::Bf16, 4.0 * 2f64.powi(-8), 0.1),
    ] {
        let one = config(precision, 8, Devices::Count(1));
        let two = config(precision, 4, Devices::Count(2));
        let (la, ha, va) = train(&one, &format!("dp_one_{precision}"));
        let (lb, hb, vb) = train(&two, &format!("dp_two_{precision}"));
        assert_eq!(ha.devices, 1);
        assert_eq!(hb.devices, 2);
        assert_eq!(hb.replica_checksums.len(), 2);
        assert_eq!(
            hb.replica_checksums[0], hb.replica_checksums[1],
            "{precision}: the replicas differ"
        );
        assert_eq!(la.len(), lb.len());
        let worst = la
            .iter()
            .zip(&lb)
            .map(|(a, b)| (a - b).abs() / a.abs())
            .fold(0f64, f64::max);
        println!("{precision}: largest relative loss difference over 20 steps {worst:.2e}");
        for (step, (a, b)) in la.iter().zip(&lb).enumerate() {
            assert!(
                (a - b).abs() <= loss_tol * a.abs(),
                "{precision} step {}: one GPU {a}, two GPUs {b}",
                step + 1
            );
        }
        // Final master weights. A lost or doubled gradient would move every weight by about lr
        // per step; rounding moves most weights by a small fraction of lr, and AdamW's normalised
        // update can move a weight whose gradient is near zero by up to lr per step, so the bound
        // is on the mean difference, the largest is printed.
        let lr = one.optimizer.lr;
        let (wa, wb) = (weights(&ha, &va), weights(&hb, &vb));
        assert_eq!(wa.len(), wb.len());
        let diffs: Vec<f64> = wa
            .iter()
            .zip(&wb)
            .map(|(a, b)| (a - b).abs() as f64)
            .collect();
        let mean = diffs.iter().sum::<f64>() / diffs.len() as f64;
        let max = diffs.iter().copied().fold(0f64, f64::max);
        println!(
            "{precision}: final weights differ by {mean:.2e} on average, {max:.2e} at most (lr {lr})"
        );
        assert!(
            mean < mean_tol * lr,
            "{precision}: final weights differ by {mean:.2e} on average (lr {lr})"
        );
    }
}

/// The master weights of a checkpoint's values (each parameter's AdamW moments follow its value).
fn weights(h: &checkpoint::Header, values: &[f32]) -> Vec<f32> {
    let mut out = Vec::new();
    let mut at = 0;
    for p in &h.params {
        let n: usize = p.shape.iter().product();
        out.extend_from_slice(&values[at..at + n]);
        at += if p.has_moments { 3 * n } else { n };
    }
    assert_eq!(at, values.len());
    out
}

/// A GPU that is not there is an error before anything trains.
#[test]
#[ignore = "needs 2 GPUs"]
fn a_missing_gpu_is_refused_at_start() {
    let _guard = serial();
    let cfg = config(PrecisionKind::Bf16, 4, Devices::List(vec![0, 64]));
    let dir = scratch("dp_missing");
    let e = format!(
        "{:#}",
        trainer::run(&cfg, &cuda(), &opts(dir.clone(), false)).unwrap_err()
    );
    assert!(
        e.contains("training.devices") && e.contains("GPU 64"),
        "{e}"
    );
    assert!(!dir.join("checkpoints").exists());
}

/// With the gradient norm above `optimizer.grad_clip` on every step, each rank scales its update
/// by the clip factor: the replicas stay bit-identical only if every rank uses the same norm. The
/// model is wide enough (width 256) for Burn's sums of its gradients to span many cubes, which add
/// with atomics on CUDA; fp16 with dynamic loss scaling also takes the held-update path.
#[test]
#[ignore = "needs 2 GPUs"]
fn replicas_stay_identical_while_clipping() {
    let _guard = serial();
    for precision in [PrecisionKind::Bf16, PrecisionKind::Fp16] {
        let mut cfg = config(precision, 4, Devices::Count(2));
        cfg.model.d_model = 256;
        cfg.optimizer.grad_clip = 1e-3;
        cfg.training.checkpoint_interval = 5;
        let (losses, h, _) = train(&cfg, &format!("dp_clipping_{precision}"));
        assert_eq!(losses.len(), 20);
        assert_eq!(h.replica_checksums.len(), 2);
        assert_eq!(
            h.replica_checksums[0], h.replica_checksums[1],
            "{precision}"
        );
    }
}
