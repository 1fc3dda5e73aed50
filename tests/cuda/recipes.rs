//! The same end-to-end checks on CUDA. Run on a GPU machine with `cargo test -- --include-ignored`.

use crate::common;

use burn::backend::cuda::CudaDevice;
use burn::backend::Cuda;
use burn::tensor::{Int, Tensor, TensorData};
use common::{opts, read_metrics, scratch, tiny_config};
use model::{Gpt, GptConfig};
use trainer::config::{DeviceKind, LossScaleMode, PrecisionKind};
use trainer::device::Selected;

fn cuda() -> Selected {
    Selected::Cuda {
        index: 0,
        name: "test".into(),
    }
}

/// Changing the last token of the second sequence moves its logits and nothing else, for every
/// GEMM engine, kernel set and attention, at awkward lengths.
#[test]
#[ignore = "needs CUDA"]
fn cuda_causality_at_awkward_lengths() {
    use model::{AttentionKind, GemmKind, KernelsKind};
    let dev = CudaDevice::new(0);
    let mut failures = Vec::new();
    for gemm in [GemmKind::Burn, GemmKind::Cublaslt] {
        for kernels in [KernelsKind::Reference, KernelsKind::Fused] {
            for attention in [AttentionKind::Plain, AttentionKind::Flash] {
                let cfg = GptConfig {
                    n_layer: 2,
                    n_head: 3,
                    d_model: 48,
                    context: 130,
                    dropout: 0.0,
                    gemm,
                    kernels,
                    attention,
                    ..GptConfig::default()
                };
                let what = format!("{gemm:?} GEMMs, {kernels:?} kernels, {attention:?} attention");
                failures.extend(
                    causality(&cfg, &dev)
                        .into_iter()
                        .map(|f| format!("{what}: {f}")),
                );
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    crate::kernels::no_fallbacks("the models with their GEMMs on cuBLASLt");
}

/// The causality check of one model: what failed, if anything.
fn causality(cfg: &GptConfig, dev: &CudaDevice) -> Vec<String> {
    let gpt = Gpt::<Cuda>::new(cfg, 71, dev);
    let mut r = trainer::rng::SplitMix64::new(9);
    let mut failures = Vec::new();
    for t in [1usize, 7, 123] {
        let ids: Vec<i64> = (0..2 * t).map(|_| r.below(71) as i64).collect();
        let mut changed = ids.clone();
        changed[2 * t - 1] = (changed[2 * t - 1] + 1) % 71; // last token of the second row
        let run = |v: Vec<i64>| -> Vec<f32> {
            let x = Tensor::<Cuda, 2, Int>::from_data(TensorData::new(v, [2, t]), dev);
            gpt.forward(x).into_data().into_vec().unwrap()
        };
        let (a, c) = (run(ids), run(changed));
        assert_eq!(a.len(), 2 * t * 71);
        if !a.iter().chain(&c).all(|x| x.is_finite()) {
            failures.push(format!("T={t}: non-finite logits"));
            continue;
        }
        // Row 0 and the first t-1 positions of row 1 are unchanged; the last position changes.
        let cut = (2 * t - 1) * 71;
        let moved = |range: std::ops::Range<usize>| {
            a[range.clone()]
                .iter()
                .zip(&c[range])
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max)
        };
        let (before, at) = (moved(0..cut), moved(cut..a.len()));
        if before >= 1e-5 {
            failures.push(format!("T={t}: earlier logits moved by {before}"));
        }
        if at <= 1e-4 {
            failures.push(format!("T={t}: the changed position's logits did not move"));
        }
    }
    failures
}

#[test]
#[ignore = "needs CUDA"]
fn cuda_training_loss_decreases_and_resume_matches() {
    training_loss_decreases_and_resume_matches(model::AttentionKind::Plain, "cuda");
}

/// As above in bf16 with the fused ops and flash attention: every dropout mask is drawn in a kernel
/// (the elementwise one and the tensor-core attention's, head_dim 16). The GEMMs' algorithms are
/// timed (`BURNMIX_GEMM_ALGO=timed`), and the run's directory keeps their record.
#[test]
#[ignore = "needs CUDA"]
fn cuda_training_with_flash_dropout_resume_matches() {
    let _timed = kernels::settings::scoped(|s| s.gemm_algo = kernels::settings::GemmAlgo::Timed);
    let run_dir =
        training_loss_decreases_and_resume_matches(model::AttentionKind::Flash, "cuda_flash");
    let record = std::fs::read_to_string(run_dir.join("gemm_algorithms.txt"))
        .expect("the run's record of timed GEMM algorithms");
    let version = kernels::gemm::cublaslt_status().expect("cuBLASLt loads");
    assert!(
        record.starts_with("# burnmix GEMM algorithms")
            && record.contains(&format!("\ncublaslt {version}\n")),
        "{record}"
    );
    assert!(
        record.lines().count() > 2,
        "no algorithm recorded:\n{record}"
    );
}

/// Returns the directory of the run stopped and resumed.
fn training_loss_decreases_and_resume_matches(
    attention: model::AttentionKind,
    tag: &str,
) -> std::path::PathBuf {
    let _guard = common::serial();
    let mut cfg = tiny_config(40);
    cfg.device = DeviceKind::Cuda;
    cfg.model.dropout = 0.1;
    cfg.model.attention = attention;
    if attention == model::AttentionKind::Flash {
        cfg.precision = trainer::config::PrecisionKind::Bf16;
        cfg.model.kernels = model::KernelsKind::Fused;
    }
    cfg.training.checkpoint_interval = 10;
    cfg.training.eval_interval = 20;

    let full = scratch(&format!("{tag}_full"));
    trainer::run(&cfg, &cuda(), &opts(full.clone(), false)).unwrap();
    let a = read_metrics(&full);
    let first: f64 = a[..5].iter().map(|r| r.loss).sum::<f64>() / 5.0;
    let last: f64 = a[35..].iter().map(|r| r.loss).sum::<f64>() / 5.0;
    assert!(last < first - 0.8, "loss went from {first} to {last}");

    let split = scratch(&format!("{tag}_split"));
    let mut o = opts(split.clone(), false);
    o.stop_at = Some(20);
    trainer::run(&cfg, &cuda(), &o).unwrap();
    let s = trainer::run(&cfg, &cuda(), &opts(split.clone(), true)).unwrap();
    assert_eq!(s.resumed_from, Some(20));
    let b = read_metrics(&split);
    assert_eq!(b.len(), 40);
    for (x, y) in a.iter().zip(&b) {
        let tol = 1e-4 * x.loss.abs().max(1.0);
        assert!(
            (x.loss - y.loss).abs() <= tol,
            "step {}: {} vs resumed {}",
            x.step,
            x.loss,
            y.loss
        );
    }
    split
}

/// Mean loss of the last five steps of a run's metrics.
fn tail_loss(dir: &std::path::Path) -> f64 {
    let m = read_metrics(dir);
    m[m.len() - 5..].iter().map(|r| r.loss).sum::<f64>() / 5.0
}

#[test]
#[ignore = "needs CUDA"]
fn cuda_bf16_and_fp16_train_like_fp32_over_f32_master_weights() {
    use burn::backend::Autodiff;
    use burn::optim::GradientsParams;
    use burn::tensor::{DType, FloatDType};
    type AB = Autodiff<Cuda>;
    let _guard = common::serial();

    // The BF16 compute copy: linear weights bf16, embedding and norm gains f32, master all f32;
    // gradients come back bf16 under the master's ids and reach the optimizer as f32.
    let dev = CudaDevice::new(0);
    let cfg = tiny_config(40);
    let master = Gpt::<AB>::new(&cfg.model, 40, &dev);
    let copy = master.compute_copy(FloatDType::BF16);
    assert!(common::param_dtypes(&master)
        .iter()
        .all(|(_, d)| *d == DType::F32));
    let low = common::param_dtypes(&copy)
        .iter()
        .filter(|(_, d)| *d == DType::BF16)
        .count();
    assert_eq!(
        low,
        4 * cfg.model.n_layer,
        "qkv, attn proj, fc and mlp proj of every block"
    );
    let x = Tensor::<AB, 2, Int>::from_ints([[1, 5, 9, 2, 33, 7, 0, 12]], &dev);
    let y = Tensor::<AB, 2, Int>::from_ints([[5, 9, 2, 33, 7, 0, 12, 6]], &dev);
    let loss = copy.forward_loss(x.clone(), y.clone());
    assert_eq!(loss.dtype(), DType::F32);
    let l32: f32 = master.forward_loss(x, y).into_scalar();
    let l16: f32 = loss.clone().into_scalar();
    assert!(
        (l16 - l32).abs() < 2e-2 * l32.abs(),
        "bf16 loss {l16} vs f32 {l32}"
    );
    let mut grads = GradientsParams::from_grads(loss.backward(), &copy);
    let qkv = master.blocks[0].attn.qkv.weight.id;
    assert_eq!(grads.get::<Cuda, 2>(qkv).unwrap().dtype(), DType::BF16);
    trainer::optim::grads_to_f32::<AB, _>(&master, &mut grads);
    assert_eq!(grads.get::<Cuda, 2>(qkv).unwrap().dtype(), DType::F32);

    // The three recipes train the tiny model to about the same loss.
    let mut tails = Vec::new();
    for p in [
        PrecisionKind::Fp32,
        PrecisionKind::Bf16,
        PrecisionKind::Fp16,
    ] {
        let mut c = tiny_config(40);
        c.device = DeviceKind::Cuda;
        c.precision = p;
        let dir = scratch(&format!("cuda_recipe_{p}"));
        let s = trainer::run(&c, &cuda(), &opts(dir.clone(), false)).unwrap();
        assert_eq!((s.precision.kind(), s.skipped_steps), (p, 0));
        tails.push(tail_loss(&dir));
    }
    let (f32_tail, bf16_tail, fp16_tail) = (tails[0], tails[1], tails[2]);
    assert!(f32_tail < 3.2, "fp32 did not train: {f32_tail}");
    assert!(
        (bf16_tail - f32_tail).abs() < 0.1,
        "bf16 {bf16_tail} vs fp32 {f32_tail}"
    );
    assert!(
        (fp16_tail - f32_tail).abs() < 0.1,
        "fp16 {fp16_tail} vs fp32 {f32_tail}"
    );
}

#[test]
#[ignore = "needs CUDA"]
fn cuda_bf16_overflow_skips_and_scaler_round_trips() {
    use trainer::checkpoint;
    let _guard = common::serial();
    let mut cfg = tiny_config(8);
    cfg.device = DeviceKind::Cuda;
    cfg.precision = PrecisionKind::Bf16;
    cfg.loss_scale.mode = LossScaleMode::Dynamic;
    cfg.loss_scale.init = 1024.0;
    cfg.loss_scale.growth_interval = 3;
    cfg.training.checkpoint_interval = 1;
    cfg.training.keep_checkpoints = 20;
    let poison = vec![4];

    let full = scratch("cuda_bf16_skip_full");
    let mut o = opts(full.clone(), false);
    o.poison_steps = poison.clone();
    trainer::run(&cfg, &cuda(), &o).unwrap();
    let ck = |step| {
        checkpoint::read(&full.join("checkpoints").join(checkpoint::file_name(step))).unwrap()
    };
    let ((h3, v3), (h4, v4)) = (ck(3), ck(4));
    assert!(
        v3.iter().zip(&v4).all(|(a, b)| a.to_bits() == b.to_bits()),
        "the skipped step changed the state"
    );
    assert_eq!((h3.optimizer_step, h4.optimizer_step), (3, 3));
    assert_eq!(
        h4.loss_scaler.as_ref().unwrap().scale,
        1024.0,
        "grew to 2048 after step 3, halved at 4"
    );
    let scales: Vec<f64> = read_metrics(&full).iter().map(|r| r.loss_scale).collect();
    assert_eq!(
        scales,
        vec![1024.0, 1024.0, 1024.0, 2048.0, 1024.0, 1024.0, 1024.0, 2048.0]
    );

    let split = scratch("cuda_bf16_skip_split");
    let mut first = opts(split.clone(), false);
    first.poison_steps = poison.clone();
    first.stop_at = Some(5);
    trainer::run(&cfg, &cuda(), &first).unwrap();
    let mut second = opts(split.clone(), true);
    second.poison_steps = poison;
    trainer::run(&cfg, &cuda(), &second).unwrap();
    let (a, b) = (read_metrics(&full), read_metrics(&split));
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(
            (x.loss_scale, x.skipped, x.overflows),
            (y.loss_scale, y.skipped, y.overflows),
            "step {}",
            x.step
        );
        assert!(
            (x.loss - y.loss).abs() <= 1e-4 * x.loss.abs().max(1.0),
            "step {}: {} vs {}",
            x.step,
            x.loss,
            y.loss
        );
    }
}

/// `fp8.attention` runs the attention forward in FP8 on a Hopper GPU, and the run's summary counts
/// the Hopper kernels' calls: without it, 16-bit forwards only; with it, every forward in FP8, the
/// backward in 16 bits, nothing refused.
#[test]
#[ignore = "needs CUDA"]
fn cuda_fp8_attention_in_training() {
    let _guard = common::serial();
    let run = |fp8_attention: bool| {
        let mut cfg = tiny_config(6);
        cfg.device = DeviceKind::Cuda;
        cfg.precision = PrecisionKind::Fp8;
        cfg.fp8.attention = fp8_attention;
        cfg.model.kernels = model::KernelsKind::Fused;
        cfg.model.attention = model::AttentionKind::Flash;
        // head_dim 64, as the Hopper kernels take.
        cfg.model.d_model = 128;
        cfg.model.context = 64;
        let dir = scratch(&format!("cuda_fp8_attention_{fp8_attention}"));
        trainer::run(&cfg, &cuda(), &opts(dir, false)).unwrap()
    };
    let Some(off) = run(false).hopper_attention else {
        eprintln!(
            "the Hopper attention kernels do not run on this GPU: fp8.attention is not tested"
        );
        return;
    };
    assert!(
        off.forward > 0 && off.backward > 0 && off.forward_fp8 == 0 && off.refused == 0,
        "without fp8.attention: {off:?}"
    );
    let on = run(true)
        .hopper_attention
        .expect("the Hopper kernels ran without fp8.attention, so with it too");
    assert!(
        on.forward == 0 && on.forward_fp8 >= on.backward && on.backward > 0 && on.refused == 0,
        "with fp8.attention: {on:?}"
    );
}
