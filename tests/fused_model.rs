//! The model with `kernels = "fused"` against `kernels = "reference"` on wgpu: the same loss and
//! gradients for the same weights, and the same training curve, in f32 and in fp16 (where the
//! fused AdamW step also writes the f16 compute copy).

mod common;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use common::{device, opts, read_metrics, scratch, tiny_config, B};
use model::config::{KernelsKind, MlpKind};
use model::Gpt;

fn ids(b: usize, t: usize, vocab: usize, salt: u64) -> Tensor<B, 2, Int> {
    let v: Vec<i64> = (0..b * t)
        .map(|i| ((i as u64 * 2654435761 + salt * 97) % vocab as u64) as i64)
        .collect();
    Tensor::from_data(TensorData::new(v, [b, t]), &device())
}

/// Every gradient of the model as (id, flat f32 values).
fn grads_of(model: &Gpt<B>, grads: &GradientsParams) -> Vec<(ParamId, Vec<f32>)> {
    struct V<'a> {
        grads: &'a GradientsParams,
        out: Vec<(ParamId, Vec<f32>)>,
    }
    impl ModuleVisitor<B> for V<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            if let Some(g) = self
                .grads
                .get::<<B as AutodiffBackend>::InnerBackend, D>(p.id)
            {
                self.out.push((
                    p.id,
                    g.cast(FloatDType::F32)
                        .into_data()
                        .convert::<f32>()
                        .into_vec()
                        .unwrap(),
                ));
            }
        }
    }
    let mut v = V {
        grads,
        out: Vec::new(),
    };
    model.visit(&mut v);
    v.out
}

/// Loss and gradients of `a` and `b` (compute copies in `dtype`) on the same batch: the losses
/// within 1e-5 (f32) / 2e-2 (f16) relative, every gradient within 1e-4 / 3e-2 of its largest value.
fn assert_same_loss_and_gradients(
    what: &str,
    a: &Gpt<B>,
    b: &Gpt<B>,
    x: &Tensor<B, 2, Int>,
    y: &Tensor<B, 2, Int>,
    dtype: FloatDType,
) {
    let run = |m: &Gpt<B>| {
        let c = m.compute_copy(dtype);
        let loss = c.forward_loss(x.clone(), y.clone());
        let value = loss
            .clone()
            .into_scalar()
            .to_string()
            .parse::<f64>()
            .unwrap();
        let g = GradientsParams::from_grads(loss.backward(), &c);
        (value, grads_of(&c, &g))
    };
    let (la, ga) = run(a);
    let (lb, gb) = run(b);
    let tol = if dtype == FloatDType::F32 { 1e-5 } else { 2e-2 };
    assert!(
        (la - lb).abs() <= tol * la.abs(),
        "{what} {dtype:?}: loss {lb} vs {la}"
    );
    assert_eq!(ga.len(), gb.len(), "same parameters get gradients");
    for ((id, p), (id2, q)) in ga.iter().zip(&gb) {
        assert_eq!(id, id2);
        let scale = p.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
        let err = p
            .iter()
            .zip(q)
            .fold(0.0f32, |m, (u, w)| m.max((u - w).abs()));
        // f32: reduction order only. f16: the kernels keep RoPE, SwiGLU, the loss and the softmax
        // statistics in f32 where the references round, so they may differ by a few f16 ulps.
        let gtol = if dtype == FloatDType::F32 { 1e-4 } else { 3e-2 };
        assert!(
            err <= gtol * scale,
            "{what} {dtype:?}: gradient of {id} differs by {err} (scale {scale})"
        );
    }
}

#[test]
fn fused_and_reference_models_give_the_same_loss_and_gradients() {
    let _guard = common::serial();
    for (mlp, z_loss) in [(MlpKind::Swiglu, 0.0), (MlpKind::Gelu, 1e-4)] {
        let mut cfg = tiny_config(1).model;
        cfg.mlp = mlp;
        cfg.z_loss = z_loss;
        cfg.n_layer = 3;
        let vocab = 61;
        let reference = Gpt::<B>::new(&cfg, vocab, &device());
        let mut fused = reference.clone();
        fused.config.kernels = KernelsKind::Fused;
        let (x, y) = (ids(3, 13, vocab, 1), ids(3, 13, vocab, 2));
        for dtype in [FloatDType::F32, FloatDType::F16] {
            assert_same_loss_and_gradients(
                &format!("{mlp:?} reference vs fused"),
                &reference,
                &fused,
                &x,
                &y,
                dtype,
            );
        }
    }
}

#[test]
fn fused_and_reference_runs_train_to_the_same_losses() {
    let _guard = common::serial();
    for precision in [
        trainer::config::PrecisionKind::Fp32,
        trainer::config::PrecisionKind::Fp16,
    ] {
        let mut losses = Vec::new();
        for kernels in [KernelsKind::Reference, KernelsKind::Fused] {
            let dir = scratch(&format!("fused_vs_reference_{precision:?}_{kernels:?}"));
            let mut cfg = tiny_config(40);
            cfg.precision = precision;
            cfg.model.kernels = kernels;
            trainer::run(
                &cfg,
                &trainer::device::Selected::Wgpu,
                &opts(dir.clone(), false),
            )
            .unwrap();
            losses.push(
                read_metrics(&dir)
                    .iter()
                    .map(|r| r.loss)
                    .collect::<Vec<f64>>(),
            );
        }
        let (r, f) = (&losses[0], &losses[1]);
        assert_eq!(r.len(), f.len());
        let first = r[0];
        let tail = |l: &[f64]| l[35..].iter().sum::<f64>() / 5.0;
        assert!(
            tail(r) < first - 0.5,
            "{precision:?}: the reference run did not learn: {r:?}"
        );
        // f32: the same run up to reduction order. fp16: the paths round differently, so the
        // curves drift apart a little, but both must learn equally well.
        let tol = if precision == trainer::config::PrecisionKind::Fp32 {
            1e-3
        } else {
            0.05
        };
        for (step, (a, b)) in r.iter().zip(f).enumerate() {
            if step < 10 || precision == trainer::config::PrecisionKind::Fp32 {
                assert!(
                    (a - b).abs() <= tol * a.abs().max(1.0),
                    "{precision:?} step {}: fused {b} vs reference {a}",
                    step + 1
                );
            }
        }
        assert!(
            (tail(r) - tail(f)).abs() <= 0.05,
            "{precision:?}: final losses {} (fused) vs {} (reference)",
            tail(f),
            tail(r)
        );
    }
}

/// `attention = "flash"` against `"plain"`: the same loss and gradients for the same weights, with
/// either kernel setting, in f32 and f16.
#[test]
fn flash_and_plain_attention_give_the_same_loss_and_gradients() {
    use model::config::AttentionKind;
    let _guard = common::serial();
    let mut cfg = tiny_config(1).model;
    cfg.n_layer = 2;
    cfg.context = 40;
    let vocab = 61;
    let plain = Gpt::<B>::new(&cfg, vocab, &device());
    // 37 positions: more than one block of the kernels, and not a multiple of one.
    let (x, y) = (ids(2, 37, vocab, 3), ids(2, 37, vocab, 4));
    for kernels in [KernelsKind::Reference, KernelsKind::Fused] {
        let mut plain = plain.clone();
        plain.config.kernels = kernels;
        let mut flash = plain.clone();
        flash.config.attention = AttentionKind::Flash;
        for dtype in [FloatDType::F32, FloatDType::F16] {
            assert_same_loss_and_gradients(
                &format!("{kernels:?} plain vs flash"),
                &plain,
                &flash,
                &x,
                &y,
                dtype,
            );
        }
    }
}

mod model_cases;

/// The model-equivalence matrix of `tests/model_cases` (which the CUDA suite runs in f32, bf16 and
/// f16): every `kernels` x `attention` combination against the reference model at an awkward
/// shape, loss and every gradient, in f32 and f16 (wgpu has no bf16).
macro_rules! equivalence {
    ($($test:ident => $dtype:ident, $mlp:ident;)*) => {
        $(
            #[test]
            fn $test() {
                let _guard = common::serial();
                // lavapipe's f32 matmuls are true f32.
                model_cases::equivalence::<B>(FloatDType::$dtype, f64::powi(2.0, -24), MlpKind::$mlp, model_cases::AWKWARD, &device());
            }
        )*
    };
}

equivalence! {
    model_equivalence_f32_gelu => F32, Gelu;
    model_equivalence_f32_swiglu => F32, Swiglu;
    model_equivalence_f16_gelu => F16, Gelu;
    model_equivalence_f16_swiglu => F16, Swiglu;
}
