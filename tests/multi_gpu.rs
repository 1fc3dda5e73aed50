//! Data parallelism on two GPUs (`training.devices`), against one GPU with the doubled batch.
//! Marked `#[ignore = "needs 2 GPUs"]`: run on a machine with two CUDA GPUs and NCCL with
//! `cargo test --release --test multi_gpu -- --ignored` (or the staged binary, `--ignored`).

mod common;

use common::{master_weights, opts, read_metrics, scratch, serial, tiny_config_on};
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
    let mut cfg = tiny_config_on(DeviceKind::Cuda, 20);
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
        common::assert_losses_agree(
            &format!("{precision}, one GPU against two"),
            &la,
            &lb,
            loss_tol,
        );
        // Final master weights. A lost or doubled gradient would move every weight by about lr
        // per step; rounding moves most weights by a small fraction of lr, and AdamW's normalised
        // update can move a weight whose gradient is near zero by up to lr per step, so the bound
        // is on the mean difference, the largest is printed.
        let lr = one.optimizer.lr;
        let (wa, wb) = (master_weights(&ha, &va), master_weights(&hb, &vb));
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

/// `training.zero = 1` (fp32, bf16, fp16) trains as plain data parallelism does: the same per-step losses, and
/// a final checkpoint (masters and moments assembled from both GPUs' shares) within rounding of the
/// plain run's, every moment included. A run stopped at step 10 and resumed from its checkpoint
/// (each rank taking its share of it again) repeats steps 11 to 20.
#[test]
#[ignore = "needs 2 GPUs"]
fn zero_1_equals_plain_data_parallel() {
    let _guard = serial();
    // As in the two-GPU test: the same arithmetic, with reductions that may add in another order
    // from run to run (atomics), so rounding differences may grow over the steps.
    // With compute copies (bf16, fp16) the owner of a weight hands every rank the copy it casts
    // from its new master, the copy each rank casts for itself without ZeRO. The default model's
    // `[64, 192]` weights have pitched bf16 rows on CUDA, where the owner's copy is dense.
    for (precision, loss_tol, value_tol) in [
        (PrecisionKind::Fp32, 1e-4, 1e-3),
        (PrecisionKind::Bf16, 4.0 * 2f64.powi(-8), 0.1),
        (PrecisionKind::Fp16, 4.0 * 2f64.powi(-11), 0.1),
    ] {
        let mut plain = config(precision, 4, Devices::Count(2));
        plain.training.checkpoint_interval = 10;
        plain.training.keep_checkpoints = 2;
        let mut zero = plain.clone();
        zero.training.zero = 1;
        let (la, ha, va) = train(&plain, &format!("zero_plain_{precision}"));
        let (lb, hb, vb) = train(&zero, &format!("zero_one_{precision}"));
        assert_eq!(
            hb.replica_checksums[0], hb.replica_checksums[1],
            "{precision}: the replicas' compute weights differ"
        );
        let worst = la
            .iter()
            .zip(&lb)
            .map(|(a, b)| (a - b).abs() / a.abs())
            .fold(0f64, f64::max);
        println!("{precision}: ZeRO-1 against plain, largest relative loss difference {worst:.2e}");
        assert_eq!(la.len(), lb.len());
        assert!(
            worst <= loss_tol,
            "{precision}: losses differ by {worst:.2e}"
        );
        // Masters and both moments, element by element, in units of each tensor's scale: a
        // moment or master lost in the gather would be zero or stale, far outside rounding.
        let has =
            |h: &checkpoint::Header| h.params.iter().map(|p| p.has_moments).collect::<Vec<_>>();
        assert!(
            has(&ha).iter().all(|m| *m),
            "{precision}: every parameter has moments"
        );
        assert_eq!(
            has(&ha),
            has(&hb),
            "{precision}: which parameters have moments"
        );
        let (a, b) = (&va, &vb);
        let lr = plain.optimizer.lr as f32;
        let mut at = 0;
        for p in &ha.params {
            let n: usize = p.shape.iter().product();
            for (part, name) in ["value", "m", "v"].iter().enumerate() {
                let (x, y) = (
                    &a[at + part * n..at + (part + 1) * n],
                    &b[at + part * n..at + (part + 1) * n],
                );
                let scale = x
                    .iter()
                    .fold(0f32, |s, v| s.max(v.abs()))
                    .max(f32::MIN_POSITIVE);
                let mean = x.iter().zip(y).map(|(x, y)| (x - y).abs()).sum::<f32>() / n as f32;
                // Masters in units of lr, moments relative to their largest element.
                let unit = if part == 0 { lr } else { scale };
                assert!(
                    mean <= value_tol as f32 * unit,
                    "{precision}: {} {name}: mean difference {mean:.2e} (unit {unit:.2e})",
                    p.name
                );
            }
            at += 3 * n;
        }

        // Stopped at step 10 and resumed: steps 11-20 again from the step-10 checkpoint.
        let dir = scratch(&format!("zero_resume_{precision}"));
        let mut o = opts(dir.clone(), false);
        o.stop_at = Some(10);
        trainer::run(&zero, &cuda(), &o).unwrap_or_else(|e| panic!("{precision}: {e:#}"));
        trainer::run(&zero, &cuda(), &opts(dir.clone(), true))
            .unwrap_or_else(|e| panic!("{precision} resumed: {e:#}"));
        let lr2: Vec<f64> = read_metrics(&dir).iter().map(|r| r.loss).collect();
        assert_eq!(lr2.len(), 20);
        for (step, (a, b)) in lb.iter().zip(&lr2).enumerate() {
            assert!(
                (a - b).abs() <= loss_tol * a.abs(),
                "{precision} step {}: uninterrupted {a}, resumed {b}",
                step + 1
            );
        }
    }
}
