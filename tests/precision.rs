//! Precision recipes on wgpu (lavapipe runs f16; it has no bf16, see tests/cuda.rs for BF16):
//! FP16 trains, master weights stay f32 while the compute copy is f16, overflowing steps are
//! skipped with the weights and optimizer state untouched, the loss scale backs off and grows, and
//! checkpoints carry the scaler state.

mod common;

use burn::optim::GradientsParams;
use burn::tensor::{DType, FloatDType, Int, Tensor};
use common::{opts, param_dtypes, read_metrics, scratch, tiny_config, B};
use model::Gpt;
use trainer::checkpoint;
use trainer::config::{LossScaleMode, PrecisionKind};
use trainer::device::Selected;

fn fp16_config(steps: usize) -> trainer::Config {
    let mut cfg = tiny_config(steps);
    cfg.precision = PrecisionKind::Fp16;
    cfg
}

#[test]
fn master_weights_stay_f32_while_the_compute_copy_is_f16() {
    if !common::needs_wgpu() {
        return;
    }
    let _guard = common::serial();
    let cfg = tiny_config(1);
    let device = common::device();
    <B as burn::tensor::backend::Backend>::seed(&device, 7);
    let master = Gpt::<B>::new(&cfg.model, 40, &device);
    let copy = master.compute_copy(FloatDType::F16);

    assert!(param_dtypes(&master).iter().all(|(_, d)| *d == DType::F32));
    let copy_types = param_dtypes(&copy);
    // The projections (the model's own list) compute in f16; everything else stays f32.
    let projections: Vec<String> = copy.projections().into_iter().map(|(n, _)| n).collect();
    assert_eq!(projections.len(), 4 * cfg.model.n_layer);
    for (name, d) in &copy_types {
        let low = projections
            .iter()
            .any(|p| name.starts_with(&format!("{p}.")));
        let want = if low { DType::F16 } else { DType::F32 };
        assert_eq!(*d, want, "{name}");
    }
    assert!(copy_types.iter().any(|(_, d)| *d == DType::F16));

    // Same parameter ids, so the copy's gradients address the master's parameters.
    let ids = |m: &Gpt<B>| m.blocks[0].attn.qkv.weight.id;
    assert_eq!(ids(&master), ids(&copy));

    // Forward: f32 logits and loss, close to the f32 model's.
    let x = Tensor::<B, 2, Int>::from_ints(
        [[1, 5, 9, 2, 33, 7, 0, 12], [3, 3, 8, 1, 39, 20, 11, 4]],
        &device,
    );
    let y = Tensor::<B, 2, Int>::from_ints(
        [[5, 9, 2, 33, 7, 0, 12, 6], [3, 8, 1, 39, 20, 11, 4, 2]],
        &device,
    );
    let logits = copy.forward(x.clone());
    assert_eq!(logits.dtype(), DType::F32);
    let loss16 = Gpt::<B>::loss(logits, y.clone());
    let loss32 = master.forward_loss(x, y);
    let (l16, l32): (f32, f32) = (loss16.clone().into_scalar(), loss32.into_scalar());
    assert!(
        (l16 - l32).abs() < 5e-3 * l32.abs(),
        "f16 loss {l16} vs f32 loss {l32}"
    );

    // Backward: the linear weights' gradients come back f16 under the master ids, the embedding's
    // and the norm gains' f32; after the cast every gradient the optimizer sees is f32.
    let mut grads = GradientsParams::from_grads(loss16.backward(), &copy);
    let qkv = master.blocks[0].attn.qkv.weight.id;
    assert_eq!(
        grads.get::<common::Inner, 2>(qkv).unwrap().dtype(),
        DType::F16
    );
    assert_eq!(
        grads
            .get::<common::Inner, 2>(master.wte.weight.id)
            .unwrap()
            .dtype(),
        DType::F32
    );
    trainer::optim::grads_to_f32::<B, _>(&master, &mut grads);
    assert_eq!(
        grads.get::<common::Inner, 2>(qkv).unwrap().dtype(),
        DType::F32
    );
    assert_eq!(
        grads.len(),
        param_dtypes(&master).len(),
        "every parameter gets a gradient"
    );
}

/// Copies of every gradient of `m`'s parameters in `grads`, cast to `dtype` (or as they are).
fn copy_grads(m: &Gpt<B>, grads: &GradientsParams, dtype: Option<FloatDType>) -> GradientsParams {
    struct Copy<'a> {
        from: &'a GradientsParams,
        to: GradientsParams,
        dtype: Option<FloatDType>,
    }
    impl burn::module::ModuleVisitor<B> for Copy<'_> {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<B, D>>) {
            if let Some(g) = self.from.get::<common::Inner, D>(p.id) {
                let g = match self.dtype {
                    Some(dt) => g.cast(dt),
                    None => g,
                };
                self.to.register::<common::Inner, D>(p.id, g);
            }
        }
    }
    let mut v = Copy {
        from: grads,
        to: GradientsParams::new(),
        dtype,
    };
    burn::module::Module::visit(m, &mut v);
    v.to
}

/// Every parameter value of `m`, flattened in visiting order.
fn param_values(m: &Gpt<B>) -> Vec<f32> {
    struct V(Vec<f32>);
    impl burn::module::ModuleVisitor<B> for V {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<B, D>>) {
            let t = p.val().inner().cast(FloatDType::F32);
            self.0.extend(t.into_data().to_vec::<f32>().unwrap());
        }
    }
    let mut v = V(Vec::new());
    burn::module::Module::visit(m, &mut v);
    v.0
}

/// The optimizer takes the f16 gradients of the compute copy as they arrive, without a cast pass:
/// the global norm and the AdamW step (fused kernel and plain ops) on them match the same on their
/// f32 casts, and `accumulate_grads` sums micro-batches in f32, exactly as cast-then-add would.
#[test]
fn optimizer_reads_f16_gradients_as_their_f32_casts() {
    if !common::needs_wgpu() {
        return;
    }
    use trainer::optim::{accumulate_grads, AdamW};
    type I = common::Inner;
    let _guard = common::serial();
    let cfg = tiny_config(1);
    let device = common::device();
    <B as burn::tensor::backend::Backend>::seed(&device, 11);
    let master = Gpt::<B>::new(&cfg.model, 40, &device);
    let copy = master.compute_copy(FloatDType::F16);
    let grads_of = |x: [[i32; 8]; 2], y: [[i32; 8]; 2]| {
        let x = Tensor::<B, 2, Int>::from_ints(x, &device);
        let y = Tensor::<B, 2, Int>::from_ints(y, &device);
        let loss = Gpt::<B>::loss(copy.forward(x), y).mul_scalar(64.0);
        GradientsParams::from_grads(loss.backward(), &copy)
    };
    let g1 = grads_of(
        [[1, 5, 9, 2, 33, 7, 0, 12], [3, 3, 8, 1, 39, 20, 11, 4]],
        [[5, 9, 2, 33, 7, 0, 12, 6], [3, 8, 1, 39, 20, 11, 4, 2]],
    );
    let g2 = grads_of(
        [[14, 2, 2, 30, 8, 17, 5, 1], [0, 9, 36, 6, 6, 21, 3, 10]],
        [[2, 2, 30, 8, 17, 5, 1, 25], [9, 36, 6, 6, 21, 3, 10, 7]],
    );
    let qkv = master.blocks[0].attn.qkv.weight.id;
    let wte = master.wte.weight.id;
    assert_eq!(g1.get::<I, 2>(qkv).unwrap().dtype(), DType::F16);
    let g1_32 = copy_grads(&master, &g1, Some(FloatDType::F32));

    // The norm: one f32 sum of squares of the same values either way, in another order at most.
    let norm_of =
        |g: &GradientsParams| -> f32 { AdamW::<I>::grad_norm::<B, _>(&master, g).into_scalar() };
    let (n16, n32) = (norm_of(&g1), norm_of(&g1_32));
    assert!(
        (n16 - n32).abs() <= 1e-5 * n32 && n32 > 0.0,
        "norm of the f16 gradients {n16} against their f32 casts {n32}"
    );

    // Micro-batches summed in f32: f16 + f16, then f32 + f16; exact, as cast-then-add.
    let sum = accumulate_grads::<B, _>(
        &master,
        copy_grads(&master, &g1, None),
        copy_grads(&master, &g2, None),
    );
    let sum = accumulate_grads::<B, _>(&master, sum, copy_grads(&master, &g2, None));
    let as_f32 = |g: &GradientsParams, id| -> Tensor<I, 2> {
        g.get::<I, 2>(id).unwrap().cast(FloatDType::F32)
    };
    for (name, id) in [("qkv", qkv), ("wte", wte)] {
        let got = sum.get::<I, 2>(id).unwrap();
        assert_eq!(got.dtype(), DType::F32, "{name}: the sum's dtype");
        let want = as_f32(&g1, id) + as_f32(&g2, id) + as_f32(&g2, id);
        assert_eq!(
            got.into_data().to_vec::<f32>().unwrap(),
            want.into_data().to_vec::<f32>().unwrap(),
            "{name}: accumulated gradients differ from cast-then-add"
        );
    }
    assert_eq!(sum.len(), g1.len(), "every parameter keeps its gradient");

    // One AdamW step (loss scale 64, clipping on) from either set: the same update.
    for fused in [false, true] {
        let step = |g: GradientsParams, norm: f32| {
            let mut opt = AdamW::<I>::new(cfg.optimizer.clone(), Default::default());
            if fused {
                opt = opt.with_fused(None);
            }
            let norm = Tensor::<I, 1>::from_floats([norm], &device);
            param_values(&opt.step::<B, _>(1e-2, master.clone(), g, norm, 64.0))
        };
        let a = step(copy_grads(&master, &g1, None), n16);
        let b = step(copy_grads(&master, &g1_32, None), n16);
        assert_eq!(a.len(), b.len());
        let err = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            err == 0.0,
            "fused {fused}: the step from f16 gradients differs from the f32 one by {err}"
        );
    }
}

#[test]
fn fp16_run_trains_with_dynamic_loss_scaling() {
    if !common::needs_wgpu() {
        return;
    }
    let _guard = common::serial();
    let dir = scratch("fp16_trains");
    let cfg = fp16_config(60);
    let s = trainer::run(&cfg, &Selected::Wgpu, &opts(dir.clone(), false)).unwrap();
    let m = read_metrics(&dir);
    assert_eq!(m.len(), 60);
    let first: f64 = m[..5].iter().map(|r| r.loss).sum::<f64>() / 5.0;
    let last: f64 = m[55..].iter().map(|r| r.loss).sum::<f64>() / 5.0;
    assert!(last < first - 0.8, "fp16 loss went from {first} to {last}");
    // The scale starts at 2^16 and has no time to grow (growth_interval 2000). A step whose scaled
    // gradient overflows f16 is skipped and halves the scale; in this tiny model that can happen
    // once or twice early on, depending on the rounding of the f16 path.
    let skipped: Vec<u64> = m.iter().filter(|r| r.skipped).map(|r| r.step).collect();
    assert!(skipped.len() <= 2, "skipped steps {skipped:?}");
    assert!(m.iter().all(|r| r.precision == "fp16"));
    let expected_scale = 65536.0 / 2f64.powi(skipped.len() as i32);
    assert_eq!(
        m.last().unwrap().loss_scale,
        expected_scale,
        "scale after skips at {skipped:?}"
    );
    assert_eq!(s.precision.kind(), trainer::precision::PrecisionKind::Fp16);
    assert_eq!(
        (s.skipped_steps, s.final_loss_scale),
        (skipped.len() as u64, expected_scale)
    );
    let saved: trainer::precision::Recipe =
        serde_json::from_str(&std::fs::read_to_string(dir.join("precision.json")).unwrap())
            .unwrap();
    assert_eq!(saved, cfg.recipe().unwrap());
    // The checkpoint's master weights are f32 values, and it records the recipe and the scaler.
    let (h, _) =
        checkpoint::read(&dir.join("checkpoints").join(checkpoint::file_name(60))).unwrap();
    assert_eq!(h.precision_kind(), trainer::precision::PrecisionKind::Fp16);
    assert_eq!(h.loss_scaler.unwrap().scale, expected_scale);
}

#[test]
fn overflowing_step_is_skipped_with_weights_and_moments_untouched() {
    if !common::needs_wgpu() {
        return;
    }
    let _guard = common::serial();
    let dir = scratch("fp16_skip");
    let mut cfg = fp16_config(6);
    cfg.loss_scale.init = 1024.0;
    cfg.training.checkpoint_interval = 1;
    cfg.training.keep_checkpoints = 10;
    let mut o = opts(dir.clone(), false);
    o.poison_steps = vec![4];
    trainer::run(&cfg, &Selected::Wgpu, &o).unwrap();

    let ck = |step| {
        checkpoint::read(&dir.join("checkpoints").join(checkpoint::file_name(step))).unwrap()
    };
    let (h3, v3) = ck(3);
    let (h4, v4) = ck(4);
    let (h5, v5) = ck(5);
    // Step 4 changed nothing: weights and moments bit-identical, AdamW's counter unchanged.
    assert_eq!(v3.len(), v4.len());
    assert!(
        v3.iter().zip(&v4).all(|(a, b)| a.to_bits() == b.to_bits()),
        "step 4 changed the state"
    );
    assert_eq!(
        (h3.optimizer_step, h4.optimizer_step, h5.optimizer_step),
        (3, 3, 4)
    );
    assert_ne!(v4, v5, "step 5 trained");
    // The scale halved and the overflow was counted.
    let (s3, s4) = (h3.loss_scaler.unwrap(), h4.loss_scaler.unwrap());
    assert_eq!((s3.scale, s3.overflows), (1024.0, 0));
    assert_eq!((s4.scale, s4.overflows), (512.0, 1));

    let m = read_metrics(&dir);
    let skipped: Vec<u64> = m.iter().filter(|r| r.skipped).map(|r| r.step).collect();
    assert_eq!(skipped, vec![4]);
    assert!(
        m[3].grad_norm.is_nan(),
        "the skipped step's norm is recorded as null"
    );
    let scales: Vec<f64> = m.iter().map(|r| r.loss_scale).collect();
    assert_eq!(scales, vec![1024.0, 1024.0, 1024.0, 1024.0, 512.0, 512.0]);
    let overflows: Vec<u64> = m.iter().map(|r| r.overflows).collect();
    assert_eq!(overflows, vec![0, 0, 0, 1, 1, 1]);
    let raw = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    assert!(raw.lines().nth(3).unwrap().contains("\"grad_norm\":null"));
}

#[test]
fn loss_scale_grows_after_clean_steps_and_backs_off_from_natural_overflow() {
    if !common::needs_wgpu() {
        return;
    }
    let _guard = common::serial();
    // Growth: x2 after every 3 clean steps.
    let dir = scratch("fp16_growth");
    let mut cfg = fp16_config(8);
    cfg.loss_scale.init = 256.0;
    cfg.loss_scale.growth_interval = 3;
    trainer::run(&cfg, &Selected::Wgpu, &opts(dir.clone(), false)).unwrap();
    let scales: Vec<f64> = read_metrics(&dir).iter().map(|r| r.loss_scale).collect();
    assert_eq!(
        scales,
        vec![256.0, 256.0, 256.0, 512.0, 512.0, 512.0, 1024.0, 1024.0]
    );

    // A scale far too large for f16 (2^40): the f16 backward overflows, the steps are skipped and
    // the scale halves until the gradients fit, then training proceeds.
    let dir = scratch("fp16_backoff");
    let mut cfg = fp16_config(40);
    cfg.loss_scale.init = 2f64.powi(40);
    cfg.loss_scale.max = 2f64.powi(40);
    let s = trainer::run(&cfg, &Selected::Wgpu, &opts(dir.clone(), false)).unwrap();
    let m = read_metrics(&dir);
    assert!(m[0].skipped && m[0].loss_scale == 2f64.powi(40));
    let n_skipped = m.iter().filter(|r| r.skipped).count();
    assert!((5..40).contains(&n_skipped), "{n_skipped} skipped");
    // Skips come first and halve the scale each time; once it fits, the steps apply.
    let first_clean = m.iter().position(|r| !r.skipped).unwrap();
    assert!(m[..first_clean].iter().all(|r| r.skipped));
    for w in m[..=first_clean].windows(2) {
        assert_eq!(w[1].loss_scale, w[0].loss_scale / 2.0);
    }
    assert_eq!(s.skipped_steps as usize, n_skipped);
    assert!(
        m.last().unwrap().loss < m[first_clean].loss - 0.3,
        "trained after backing off"
    );
}

#[test]
fn scaler_state_round_trips_through_checkpoints() {
    if !common::needs_wgpu() {
        return;
    }
    let _guard = common::serial();
    let mut cfg = fp16_config(10);
    cfg.loss_scale.init = 512.0;
    cfg.loss_scale.growth_interval = 3;
    cfg.training.checkpoint_interval = 3;
    let poison = vec![2, 8];

    let full = scratch("fp16_resume_full");
    let mut o = opts(full.clone(), false);
    o.poison_steps = poison.clone();
    trainer::run(&cfg, &Selected::Wgpu, &o).unwrap();

    let split = scratch("fp16_resume_split");
    let mut first = opts(split.clone(), false);
    first.poison_steps = poison.clone();
    // Stopped after step 4 the scale (256) differs from init and growth is one clean step away,
    // so a lost scale or growth counter would change the resumed run's scale path.
    first.stop_at = Some(4);
    trainer::run(&cfg, &Selected::Wgpu, &first).unwrap();
    let mut second = opts(split.clone(), true);
    second.poison_steps = poison;
    trainer::run(&cfg, &Selected::Wgpu, &second).unwrap();

    let (a, b) = (read_metrics(&full), read_metrics(&split));
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(
            (x.step, x.loss_scale, x.skipped, x.overflows),
            (y.step, y.loss_scale, y.skipped, y.overflows)
        );
        // As in training.rs: equal up to f32 rounding (a reduction may add in another order
        // from one run to the next), relative to the loss.
        assert!(
            (x.loss - y.loss).abs() <= 1e-5 * x.loss.abs().max(1.0),
            "step {}: {} vs {}",
            x.step,
            x.loss,
            y.loss
        );
    }
    // Scale path: 512 at step 1; the overflow at step 2 halves it; three clean steps (3, 4, 5)
    // double it from step 6; the overflow at step 8 halves it again before growth is due.
    let scales: Vec<f64> = a.iter().map(|r| r.loss_scale).collect();
    assert_eq!(
        scales,
        vec![512.0, 512.0, 256.0, 256.0, 256.0, 512.0, 512.0, 512.0, 256.0, 256.0]
    );
    let last = |d: &std::path::Path| {
        checkpoint::read(&d.join("checkpoints").join(checkpoint::file_name(10))).unwrap()
    };
    let ((ha, va), (hb, vb)) = (last(&full), last(&split));
    assert_eq!(ha.loss_scaler, hb.loss_scaler);
    assert_eq!(ha.optimizer_step, 8);
    let max_diff = va
        .iter()
        .zip(&vb)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    // The forward and backward compute in f16, and a reduction may add in another order from one
    // run to the next: each of the 8 applied AdamW steps can then move a weight by about
    // lr x f16's epsilon (2^-10) more or less. A lost weight, moment or step counter moves it by a
    // sizeable fraction of lr per step instead, far above this bound.
    let tol = 8.0 * cfg.optimizer.lr as f32 * 4.0 * 2f32.powi(-10);
    assert!(
        max_diff < tol,
        "final weights or moments differ by {max_diff} (bound {tol})"
    );
}

#[test]
fn overflow_without_scaling_or_at_the_floor_stops_the_run() {
    if !common::needs_wgpu() {
        return;
    }
    let _guard = common::serial();
    // Loss scaling off: a non-finite gradient is divergence.
    let dir = scratch("fp16_off_poison");
    let mut cfg = fp16_config(4);
    cfg.loss_scale.mode = LossScaleMode::Off;
    let mut o = opts(dir.clone(), false);
    o.poison_steps = vec![2];
    let e = trainer::run(&cfg, &Selected::Wgpu, &o)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("diverged at step 2") && e.contains("loss_scale.mode"),
        "{e}"
    );

    // Dynamic scaling already at its floor: the scale has collapsed, stop.
    let dir = scratch("fp16_floor");
    let mut cfg = fp16_config(4);
    cfg.loss_scale.init = 4.0;
    cfg.loss_scale.min = 2.0;
    cfg.training.checkpoint_interval = 1;
    let mut o = opts(dir.clone(), false);
    o.poison_steps = vec![2, 3];
    let e = trainer::run(&cfg, &Selected::Wgpu, &o)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("step 3") && e.contains("floor") && e.contains("loss_scale.min = 2"),
        "{e}"
    );
    // Nothing of the failed step was saved: the newest checkpoint is step 2's, after the skip.
    assert_eq!(read_metrics(&dir).len(), 2);
    let newest = checkpoint::list(&dir).unwrap().pop().unwrap();
    assert_eq!(newest.0, 2);
    let s = checkpoint::read(&newest.1).unwrap().0.loss_scaler.unwrap();
    assert_eq!((s.scale, s.overflows), (2.0, 1));
}

#[test]
fn precision_config_errors_name_the_key() {
    if !common::needs_wgpu() {
        return;
    }
    let e = trainer::Config::from_toml_str("precision = \"fp4\"", &[], "t.toml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("precision") && e.contains("fp16"), "{e}");
    let e = trainer::Config::from_toml_str(
        "precision = \"fp32\"\n[loss_scale]\nmode = \"dynamic\"",
        &[],
        "t.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("loss_scale.mode") && e.contains("fp16"), "{e}");
    // "auto" accepts it (bf16 on CUDA may scale), and a run where it resolves to fp32 refuses it
    // at start, naming the resolution.
    let mut cfg = tiny_config(2);
    cfg.precision = PrecisionKind::Auto;
    cfg.loss_scale.mode = trainer::config::LossScaleMode::Dynamic;
    cfg.validate().expect("auto validates as bf16");
    let dir = scratch("auto_dynamic_cpu");
    let e = trainer::run(&cfg, &Selected::Cpu, &opts(dir.join("run"), false))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("precision = \"auto\" is \"fp32\"") && e.contains("loss_scale.mode"),
        "{e}"
    );
    assert!(!dir.join("run").exists());
    let e = trainer::Config::from_toml_str(
        "precision = \"fp16\"\n[loss_scale]\ngrowth_interval = 0",
        &[],
        "t.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("loss_scale.growth_interval"), "{e}");
    let e = trainer::Config::from_toml_str(
        "precision = \"fp16\"\n[loss_scale]\ninit = 1e9",
        &[],
        "t.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("min <= init <= max"), "{e}");
    // bf16 on wgpu is refused before anything is written.
    let dir = scratch("bf16_wgpu");
    let mut cfg = tiny_config(2);
    cfg.precision = PrecisionKind::Bf16;
    let e = trainer::run(&cfg, &Selected::Wgpu, &opts(dir.join("run"), false))
        .unwrap_err()
        .to_string();
    assert!(e.contains("bf16") && e.contains("CUDA"), "{e}");
    assert!(!dir.join("run").exists());
    // Resuming with another recipe is refused.
    let dir = scratch("precision_switch");
    let cfg = tiny_config(2);
    trainer::run(&cfg, &Selected::Wgpu, &opts(dir.clone(), false)).unwrap();
    let mut other = cfg.clone();
    other.precision = PrecisionKind::Fp16;
    other.training.steps = 4;
    let e = trainer::run(&other, &Selected::Wgpu, &opts(dir, true))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("precision = \"fp32\"") && e.contains("this run: \"fp16\""),
        "{e}"
    );
}

#[test]
fn f16_gelu_gradient_stays_finite_at_large_inputs() {
    if !common::needs_wgpu() {
        return;
    }
    use burn::tensor::activation::gelu;
    let device = common::device();
    let xs = [-60.0f32, -41.0, -5.0, -0.5, 0.0, 0.7, 3.0, 41.0, 60.0];
    let grad_of = |f: &dyn Fn(Tensor<B, 1>) -> Tensor<B, 1>, dt: FloatDType| -> Vec<f32> {
        let x = Tensor::<B, 1>::from_floats(xs, &device)
            .cast(dt)
            .require_grad();
        let g = f(x.clone()).cast(FloatDType::F32).sum().backward();
        x.grad(&g)
            .unwrap()
            .cast(FloatDType::F32)
            .into_data()
            .into_vec::<f32>()
            .unwrap()
    };
    // The hazard: Burn's GELU backward in f16 gives NaN where x^3 overflows (|x| > 40).
    let raw = grad_of(&|x| gelu(x), FloatDType::F16);
    assert!(
        raw[7].is_nan() || raw[8].is_nan(),
        "Burn's f16 GELU backward no longer overflows: {raw:?}"
    );
    // The model's GELU (reference and fused): finite everywhere and within f16 rounding of the
    // f32 gradient of the same exact GELU.
    let reference = grad_of(&|x| kernels::activation::gelu_reference(x), FloatDType::F32);
    for (name, f) in [
        (
            "reference",
            &(|x| kernels::activation::gelu_reference(x)) as &dyn Fn(Tensor<B, 1>) -> Tensor<B, 1>,
        ),
        ("fused", &|x| kernels::gelu(x)),
    ] {
        let safe = grad_of(f, FloatDType::F16);
        for ((s, r), x) in safe.iter().zip(&reference).zip(xs) {
            assert!(
                s.is_finite() && (s - r).abs() <= 2e-3 * r.abs().max(1.0),
                "{name} x = {x}: {s} vs f32 {r}"
            );
        }
    }
    // Burn's GELU differentiates the tanh approximation, not its own (erf) forward: 1e-3 off.
    let burn_f32 = grad_of(&|x| gelu(x), FloatDType::F32);
    let worst = burn_f32
        .iter()
        .zip(&reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst > 1e-4, "Burn's GELU gradient now matches the exact one ({worst}); the reference could use it again");
    // SiLU (the SwiGLU gate) has no such hazard in f16.
    let silu = burn::tensor::activation::silu;
    let reference = grad_of(&|x| silu(x), FloatDType::F32);
    let half = grad_of(&|x| silu(x), FloatDType::F16);
    for ((s, r), x) in half.iter().zip(&reference).zip(xs) {
        assert!(
            s.is_finite() && (s - r).abs() <= 2e-3 * r.abs().max(1.0),
            "silu x = {x}: {s} vs f32 {r}"
        );
    }
}

#[test]
fn fp16_numerics_measure_every_projections_scaled_gradients() {
    if !common::needs_wgpu() {
        return;
    }
    let _guard = common::serial();
    // One step at two static loss scales: the backward's values scale exactly with the loss
    // (powers of two, far from f16's limits), so the recorded amax of every output and weight
    // gradient does too. Reference and fused kernels both tap every projection.
    let run = |kernels: model::KernelsKind, scale: f64| {
        let dir = scratch(&format!("fp16_numerics_{kernels:?}_{scale}"));
        let mut cfg = fp16_config(3);
        cfg.model.kernels = kernels;
        cfg.loss_scale.mode = LossScaleMode::Static;
        cfg.loss_scale.init = scale;
        cfg.training.numerics_interval = 2;
        trainer::run(&cfg, &Selected::Wgpu, &opts(dir.clone(), false)).unwrap();
        read_metrics(&dir)
    };
    for kernels in [model::KernelsKind::Reference, model::KernelsKind::Fused] {
        let low = run(kernels, 256.0);
        // Step 1 and every second step.
        let with: Vec<u64> = low
            .iter()
            .filter(|r| r.numerics.is_some())
            .map(|r| r.step)
            .collect();
        assert_eq!(with, [1, 2], "{kernels:?}");
        let h = low[0].numerics.as_ref().unwrap();
        let mut names: Vec<&str> = h.iter().map(|l| l.layer.as_str()).collect();
        names.sort();
        let mut expected = Vec::new();
        for i in 0..2 {
            for p in ["attn.proj", "attn.qkv", "mlp.fc", "mlp.proj"] {
                for what in ["grad_output", "weight_grad"] {
                    expected.push(format!("blocks.{i}.{p}.{what}"));
                }
            }
        }
        expected.sort();
        assert_eq!(names, expected, "{kernels:?}");
        for l in h {
            assert!(l.amax.is_finite() && l.amax > 0.0, "{l:?}");
            assert!((0.0..=1.0).contains(&l.underflow), "{l:?}");
            assert_eq!(l.saturated, 0.0, "{l:?}");
        }
        let high = run(kernels, 4096.0);
        for (a, b) in h.iter().zip(high[0].numerics.as_ref().unwrap()) {
            assert_eq!(a.layer, b.layer);
            let ratio = b.amax / a.amax;
            assert!(
                (ratio - 16.0).abs() < 16.0 * 1e-3,
                "{kernels:?} {}: amax {} at scale 256, {} at 4096",
                a.layer,
                a.amax,
                b.amax
            );
        }
    }
    // fp32 records none.
    let dir = scratch("fp32_no_numerics");
    let mut cfg = tiny_config(2);
    cfg.training.numerics_interval = 1;
    trainer::run(&cfg, &Selected::Wgpu, &opts(dir.clone(), false)).unwrap();
    assert!(read_metrics(&dir).iter().all(|r| r.numerics.is_none()));
}
