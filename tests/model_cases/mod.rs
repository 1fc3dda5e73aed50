//! Model-equivalence cases shared by the wgpu tests (`tests/fused_model.rs`) and the CUDA tests
//! (`tests/cuda/model.rs`): every `kernels` x `attention` x MLP combination of the model against
//! the reference model (`kernels = "reference"`, `attention = "plain"`), at awkward shapes.
//!
//! **Loss and gradients.** For one batch and one set of weights, three runs:
//! - `exact`: the reference model in f32;
//! - `baseline`: the reference model in the dtype under test;
//! - `candidate`: the combination in the dtype under test.
//!
//! The loss and every parameter gradient must satisfy `err(candidate) <= 2 * err(baseline) + atol`,
//! errors being the largest absolute difference from `exact` and
//! `atol = max(32 u, 1e-4) max|exact|`, where `u` is the unit roundoff of the exact run's matrix
//! products: 2^-24 for f32, and 2^-11 on CUDA, whose f32 matmuls run on TF32 tensor cores; 1e-4 is
//! the f32 reduction-order noise of gradients through two layers (the kernel tests allow 1e-5 per
//! op). So a combination may be no worse than the reference model in the same precision, up to a
//! few roundings of the exact run itself. In f32 the baseline is the exact run, so only `atol`
//! remains.
//!
//! **Training.** 50 steps of each combination must track the reference run of the same precision:
//! at every step `|loss(candidate) - loss(reference)| <= 2 * drift + 0.01 * loss`, where `drift`
//! is the largest step-wise distance of the reference run in a low precision (f16; bf16 too on
//! CUDA) from the reference run in f32 on the same device: how far rounding alone moves a run of
//! 50 steps there. The reference must learn.
#![allow(dead_code)]

pub mod decode;
pub mod fp8_mlp;
pub mod recompute;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use model::config::{AttentionKind, GemmKind, KernelsKind, MlpKind};
use model::{Gpt, GptConfig};

/// Batch, sequence length, heads (of 64) and vocabulary of a case.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub vocab: usize,
}

/// The shape of the cases: an odd vocabulary, a sequence length that is not a power of two and
/// spans more than two key blocks of the attention kernels, three heads.
pub const AWKWARD: Shape = Shape {
    batch: 3,
    seq: 67,
    heads: 3,
    vocab: 67,
};

/// The shape of `configs/shakespeare_char.toml` (6 heads of 64, 256 positions, 65 characters
/// padded to 66) at a smaller batch.
pub const SHAKESPEARE: Shape = Shape {
    batch: 8,
    seq: 256,
    heads: 6,
    vocab: 66,
};

/// One point of the matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Combo {
    pub kernels: KernelsKind,
    pub attention: AttentionKind,
    pub gemm: GemmKind,
}

/// The reference model: the reference ops, plain attention, Burn's matmul.
pub const REFERENCE: Combo = Combo {
    kernels: KernelsKind::Reference,
    attention: AttentionKind::Plain,
    gemm: GemmKind::Burn,
};

/// The fused ops' CPU versions (they run their references there), with the GEMMs through
/// `kernels::gemm`, as selective recomputation's are.
pub const FUSED_CPU: Combo = Combo {
    kernels: KernelsKind::Fused,
    attention: AttentionKind::Flash,
    gemm: GemmKind::Auto,
};

/// Every `kernels` x `attention` combination except the reference itself.
pub fn combos() -> Vec<Combo> {
    let mut out = Vec::new();
    for kernels in [KernelsKind::Reference, KernelsKind::Fused] {
        for attention in [AttentionKind::Plain, AttentionKind::Flash] {
            if (kernels, attention) != (KernelsKind::Reference, AttentionKind::Plain) {
                out.push(Combo {
                    kernels,
                    attention,
                    gemm: GemmKind::Burn,
                });
            }
        }
    }
    out
}

/// Every `kernels` x `attention` combination, the reference's too, with the GEMMs on `gemm`.
pub fn combos_on(gemm: GemmKind) -> Vec<Combo> {
    let mut out = vec![Combo {
        kernels: KernelsKind::Reference,
        attention: AttentionKind::Plain,
        gemm,
    }];
    out.extend(combos().into_iter().map(|c| Combo { gemm, ..c }));
    out
}

/// The model of the cases: `shape.heads` heads of 64 (the head width of every shipped config), two
/// layers. GELU with tied embeddings and no bias, as `shakespeare_char`; SwiGLU with an untied LM
/// head, biases and z-loss, so that every parameter kind and loss term is covered. The weights
/// are drawn wider than the default initialisation so that attention is far from uniform.
pub fn model_config(mlp: MlpKind, shape: Shape) -> GptConfig {
    let swiglu = mlp == MlpKind::Swiglu;
    GptConfig {
        n_layer: 2,
        n_head: shape.heads,
        d_model: 64 * shape.heads,
        context: shape.seq,
        mlp,
        tie_embeddings: !swiglu,
        bias: swiglu,
        z_loss: if swiglu { 1e-4 } else { 0.0 },
        init_std: 0.08,
        // The reference model: plain Burn ops and Burn's matmul (the defaults are "auto").
        kernels: KernelsKind::Reference,
        attention: AttentionKind::Plain,
        gemm: GemmKind::Burn,
        ..GptConfig::default()
    }
}

/// `model` switched to `combo`.
pub fn with_combo<B: AutodiffBackend>(model: &Gpt<B>, combo: Combo) -> Gpt<B> {
    let mut m = model.clone();
    m.config.kernels = combo.kernels;
    m.config.attention = combo.attention;
    m.config.gemm = combo.gemm;
    m
}

/// Random token ids [b, t] below `vocab`.
pub fn ids<B: AutodiffBackend>(
    b: usize,
    t: usize,
    vocab: usize,
    seed: u64,
    dev: &B::Device,
) -> Tensor<B, 2, Int> {
    let mut r = trainer::rng::SplitMix64::new(seed);
    let v: Vec<i64> = (0..b * t).map(|_| r.below(vocab) as i64).collect();
    Tensor::from_data(TensorData::new(v, [b, t]), dev)
}

/// Loss and every parameter gradient (by parameter path, as f32 values) of `model` computing in
/// `dtype` on one batch.
pub fn loss_and_grads<B: AutodiffBackend + kernels::Backend>(
    model: &Gpt<B>,
    dtype: FloatDType,
    x: &Tensor<B, 2, Int>,
    y: &Tensor<B, 2, Int>,
) -> (f64, Vec<(String, Vec<f32>)>) {
    let copy = model.compute_copy(dtype);
    let loss = copy.forward_loss(x.clone(), y.clone());
    let value = loss
        .clone()
        .into_data()
        .convert::<f64>()
        .into_vec::<f64>()
        .unwrap()[0];
    let grads = GradientsParams::from_grads(loss.backward(), &copy);
    (value, named_grads(&copy, &grads))
}

/// Every parameter gradient of `model` in `grads`, by parameter path, as f32 values; panics
/// naming a parameter without one.
pub fn named_grads<B: AutodiffBackend>(
    model: &Gpt<B>,
    grads: &GradientsParams,
) -> Vec<(String, Vec<f32>)> {
    struct Named<'a, B: AutodiffBackend> {
        grads: &'a GradientsParams,
        path: Vec<String>,
        out: Vec<(String, Vec<f32>)>,
        _b: std::marker::PhantomData<B>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Named<'_, B> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            let name = self.path.join(".");
            let g = self
                .grads
                .get::<B::InnerBackend, D>(p.id)
                .unwrap_or_else(|| panic!("{name} has no gradient"));
            self.out.push((
                name,
                g.cast(FloatDType::F32)
                    .into_data()
                    .convert::<f32>()
                    .into_vec()
                    .unwrap(),
            ));
        }
    }
    let mut v = Named::<B> {
        grads,
        path: Vec::new(),
        out: Vec::new(),
        _b: std::marker::PhantomData,
    };
    model.visit(&mut v);
    v.out
}

pub fn max_abs(v: &[f32]) -> f64 {
    v.iter().fold(0.0f64, |m, x| m.max(x.abs() as f64))
}

pub fn max_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0.0f64, |m, (x, y)| {
        let d = (*x as f64 - *y as f64).abs();
        if d.is_nan() {
            f64::INFINITY
        } else {
            m.max(d)
        }
    })
}

/// One compared quantity: `err(candidate) <= 2 * err(baseline) + atol`.
struct Compared {
    what: String,
    err_c: f64,
    err_b: f64,
    scale: f64,
}

impl Compared {
    fn atol(&self, u: f64) -> f64 {
        (32.0 * u).max(1e-4) * self.scale
    }
    fn ok(&self, u: f64) -> bool {
        self.err_c.is_finite() && self.err_c <= 2.0 * self.err_b + self.atol(u)
    }
}

/// The loss-and-gradient checks of every combination with `mlp` in `dtype` at `shape` on `dev`.
/// `u` is the unit roundoff of the exact (f32) run's matmuls on this device (see the module docs).
/// Prints one line per combination (its worst quantity), then fails listing every quantity out of
/// tolerance.
pub fn equivalence<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    u: f64,
    mlp: MlpKind,
    shape: Shape,
    dev: &B::Device,
) {
    equivalence_of::<B>(&combos(), dtype, u, mlp, shape, dev)
}

/// [`equivalence`] for the combinations `candidates`.
pub fn equivalence_of<B: AutodiffBackend + kernels::Backend>(
    candidates: &[Combo],
    dtype: FloatDType,
    u: f64,
    mlp: MlpKind,
    shape: Shape,
    dev: &B::Device,
) {
    let mut failures = Vec::new();
    {
        let cfg = model_config(mlp, shape);
        let reference = Gpt::<B>::new(&cfg, shape.vocab, dev);
        let seed = 17 + shape.seq as u64 + (mlp == MlpKind::Swiglu) as u64;
        let (x, y) = (
            ids::<B>(shape.batch, shape.seq, shape.vocab, seed, dev),
            ids::<B>(shape.batch, shape.seq, shape.vocab, seed + 1, dev),
        );
        let (exact_loss, exact) = loss_and_grads(&reference, FloatDType::F32, &x, &y);
        let (base_loss, base) = loss_and_grads(&reference, dtype, &x, &y);
        for &combo in candidates {
            let (cand_loss, cand) = loss_and_grads(&with_combo(&reference, combo), dtype, &x, &y);
            let name = format!(
                "{mlp:?} {:?}+{:?} gemm {:?} {dtype:?}",
                combo.kernels, combo.attention, combo.gemm
            );
            let mut rows = vec![Compared {
                what: "loss".into(),
                err_c: (cand_loss - exact_loss).abs(),
                err_b: (base_loss - exact_loss).abs(),
                scale: exact_loss.abs(),
            }];
            assert_eq!(
                cand.len(),
                exact.len(),
                "{name}: the same parameters get gradients"
            );
            for (((p, e), (_, c)), (_, b)) in exact.iter().zip(&cand).zip(&base) {
                rows.push(Compared {
                    what: p.clone(),
                    err_c: max_diff(c, e),
                    err_b: max_diff(b, e),
                    scale: max_abs(e),
                });
            }
            let worst = rows
                .iter()
                .max_by(|a, b| {
                    let r =
                        |q: &Compared| q.err_c / (2.0 * q.err_b + q.atol(u)).max(f64::MIN_POSITIVE);
                    r(a).partial_cmp(&r(b))
                        .unwrap_or(std::cmp::Ordering::Greater)
                })
                .expect("rows");
            println!(
                "{name}: loss {cand_loss:.6} (reference {base_loss:.6}, f32 {exact_loss:.6}); worst {}: err {:.3e} vs baseline {:.3e} + atol {:.3e} (max |exact| {:.3e})",
                worst.what,
                worst.err_c,
                worst.err_b,
                worst.atol(u),
                worst.scale
            );
            for q in rows.iter().filter(|q| !q.ok(u)) {
                failures.push(format!(
                    "{name}: {} error {:.3e} exceeds 2 x baseline {:.3e} + {:.3e} (max |exact| {:.3e})",
                    q.what,
                    q.err_c,
                    q.err_b,
                    q.atol(u),
                    q.scale
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} quantities out of tolerance:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The training config of the 50-step runs: the tests' tiny run with the case's model shape.
pub fn training_config(
    mlp: MlpKind,
    combo: Combo,
    precision: trainer::config::PrecisionKind,
    device: trainer::config::DeviceKind,
) -> trainer::Config {
    let mut cfg = crate::common::tiny_config(50);
    cfg.device = device;
    cfg.precision = precision;
    cfg.model = model_config(mlp, AWKWARD);
    cfg.model.init_std = 0.02;
    cfg.model.vocab_size = AWKWARD.vocab;
    cfg.model.kernels = combo.kernels;
    cfg.model.attention = combo.attention;
    cfg.model.gemm = combo.gemm;
    cfg.optimizer.lr = 1e-3;
    cfg.schedule.warmup_steps = 10;
    cfg.schedule.min_lr = 1e-4;
    cfg.training.batch_size = 4;
    cfg
}

/// Losses of a 50-step run of `cfg` in the fresh directory `dir`.
pub fn train_losses(
    cfg: &trainer::Config,
    device: &trainer::device::Selected,
    dir: std::path::PathBuf,
) -> Vec<f64> {
    trainer::run(cfg, device, &crate::common::opts(dir.clone(), false))
        .unwrap_or_else(|e| panic!("training run failed: {e:#}"));
    crate::common::read_metrics(&dir)
        .iter()
        .map(|r| r.loss)
        .collect()
}

/// 50 training steps of every combination with `mlp` in `precision` against the reference run of
/// that precision (see the module docs). `noise_precisions` are the low precisions whose reference
/// runs measure the rounding drift on this device (fp16 on wgpu; bf16 and fp16 on CUDA). `scratch`
/// gives a fresh directory per run.
pub fn training_tracks(
    mlp: MlpKind,
    precision: trainer::config::PrecisionKind,
    noise_precisions: &[trainer::config::PrecisionKind],
    device_kind: trainer::config::DeviceKind,
    device: &trainer::device::Selected,
    scratch: &dyn Fn(&str) -> std::path::PathBuf,
) {
    use trainer::config::PrecisionKind;
    let reference = Combo {
        kernels: KernelsKind::Reference,
        attention: AttentionKind::Plain,
        gemm: GemmKind::Burn,
    };
    let run = |combo: Combo, p: PrecisionKind| {
        let dir = scratch(&format!(
            "track_{mlp:?}_{:?}_{:?}_{}_{}",
            combo.kernels, combo.attention, p, precision
        ));
        train_losses(&training_config(mlp, combo, p, device_kind), device, dir)
    };
    let f32_reference = run(reference, PrecisionKind::Fp32);
    let mut noise = 0.0f64;
    let mut reference_run = f32_reference.clone();
    for &p in noise_precisions {
        let r = run(reference, p);
        noise = noise.max(max_step_diff(&r, &f32_reference));
        if p == precision {
            reference_run = r;
        }
    }
    if precision != PrecisionKind::Fp32 && !noise_precisions.contains(&precision) {
        reference_run = run(reference, precision);
    }
    let tail = |l: &[f64]| l[l.len() - 5..].iter().sum::<f64>() / 5.0;
    let mut failures = Vec::new();
    if !(tail(&reference_run) < reference_run[0] - 0.5) {
        failures.push(format!(
            "{mlp:?} reference {}: did not learn: {reference_run:?}",
            precision
        ));
    }
    for combo in combos() {
        let losses = run(combo, precision);
        let name = format!(
            "{mlp:?} {:?}+{:?} {}",
            combo.kernels, combo.attention, precision
        );
        assert_eq!(losses.len(), reference_run.len(), "{name}: steps");
        let mut worst = (0usize, 0.0f64, 0.0f64);
        for (step, (a, b)) in reference_run.iter().zip(&losses).enumerate() {
            let d = (a - b).abs();
            let bound = 2.0 * noise + 0.01 * a.abs();
            if !(d <= bound) {
                failures.push(format!(
                    "{name} step {}: loss {b} vs reference {a} (allowed {bound:.4})",
                    step + 1
                ));
            }
            if !(d <= worst.1) {
                worst = (step + 1, d, bound);
            }
        }
        println!(
            "{name}: final loss {:.4} (reference {:.4}); largest step difference {:.4} at step {} (allowed {:.4}, rounding drift {noise:.4})",
            tail(&losses),
            tail(&reference_run),
            worst.1,
            worst.0,
            worst.2
        );
    }
    assert!(
        failures.is_empty(),
        "{} steps out of tolerance:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn max_step_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).fold(0.0, |m, (x, y)| m.max((x - y).abs()))
}

/// The model's plain attention after RoPE, with q and k rotated by the fused kernel (`fused`) or
/// by its reference: x [B * T, 3 * H * hd] (a packed projection) -> [B * T, H * hd]. The fused
/// kernel reads q and k strided out of the projection into dense tensors, as the model does.
pub fn plain_attention_after_rope<B: AutodiffBackend + kernels::Backend>(
    x: Tensor<B, 2>,
    shape: [usize; 4],
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
    fused: bool,
) -> Tensor<B, 2> {
    use burn::tensor::activation::softmax;
    use burn::tensor::Bool;
    let [b, h, t, hd] = shape;
    let qkv = x.reshape([b, t, 3 * h, hd]).swap_dims(1, 2);
    let (q, k) = (
        qkv.clone().slice([0..b, 0..h, 0..t, 0..hd]),
        qkv.clone().slice([0..b, h..2 * h, 0..t, 0..hd]),
    );
    let (q, k) = if fused {
        (
            kernels::rope(q, cos.clone(), sin.clone()),
            kernels::rope(k, cos, sin),
        )
    } else {
        (
            kernels::rope::reference(q, cos.clone(), sin.clone()),
            kernels::rope::reference(k, cos, sin),
        )
    };
    let v = qkv.slice([0..b, 2 * h..3 * h, 0..t, 0..hd]);
    let dev = v.device();
    let above = Tensor::<B, 2, Bool>::tril_mask([t, t], 0, &dev);
    let mask = Tensor::<B, 2>::zeros([t, t], &dev)
        .mask_fill(above, -1e9)
        .reshape([1, 1, t, t]);
    let scale = (hd as f64).powf(-0.5);
    let scores = q
        .mul_scalar(scale)
        .matmul(k.swap_dims(2, 3))
        .cast(FloatDType::F32)
        + mask;
    let probs = softmax(scores, 3).cast(v.dtype());
    probs.matmul(v).swap_dims(1, 2).reshape([b * t, h * hd])
}
