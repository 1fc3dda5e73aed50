//! Model shapes, causality and parameter count, on the test device (wgpu, else the CPU).
//!
//! Burn's generator is one per process: a test that reseeds it and compares outputs would see
//! the draws of a test running beside it. Every test here that draws from it (a model's random
//! initialisation, Burn's dropout) holds `common::serial()`.

mod common;
mod model_cases;

use burn::module::Module;
use burn::tensor::{Int, Tensor, TensorData};
use common::{device, Inner};
use model::{Gpt, GptConfig, MlpKind};

fn random_ids(b: usize, t: usize, vocab: usize, seed: u64) -> Vec<i64> {
    let mut r = trainer::rng::SplitMix64::new(seed);
    (0..b * t).map(|_| r.below(vocab) as i64).collect()
}

fn small(mlp: MlpKind, tie: bool) -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 4,
        d_model: 32,
        context: 24,
        mlp,
        tie_embeddings: tie,
        kernels: model::KernelsKind::Reference,
        attention: model::AttentionKind::Plain,
        ..GptConfig::default()
    }
}

#[test]
fn logits_have_batch_time_vocab_shape() {
    let _guard = common::serial();
    common::on_test_backend!(|Inner, dev| {
        for (mlp, tie) in [
            (MlpKind::Swiglu, true),
            (MlpKind::Gelu, false),
            (MlpKind::GeluTanh, false),
        ] {
            let cfg = small(mlp, tie);
            let gpt = Gpt::<Inner>::new(&cfg, 37, &dev);
            let ids = Tensor::<Inner, 2, Int>::from_data(
                TensorData::new(random_ids(3, 11, 37, 1), [3, 11]),
                &dev,
            );
            let logits = gpt.forward(ids);
            assert_eq!(logits.dims(), [3, 11, 37]);
            let v: Vec<f32> = logits.into_data().into_vec().unwrap();
            assert!(v.iter().all(|x| x.is_finite()));
            // The parameter count the MFU estimate uses is the model's real one.
            assert_eq!(gpt.num_params(), cfg.num_params(37), "{mlp:?} tie={tie}");
        }
    });
}

#[test]
fn a_future_token_cannot_change_an_earlier_logit() {
    let _guard = common::serial();
    common::on_test_backend!(|Inner, dev| {
        let cfg = small(MlpKind::Swiglu, true);
        let gpt = Gpt::<Inner>::new(&cfg, 50, &dev);
        let t = 20;
        let ids = random_ids(2, t, 50, 7);
        for k in [0usize, 7, 19] {
            let mut changed = ids.clone();
            for b in 0..2 {
                changed[b * t + k] = (changed[b * t + k] + 13) % 50;
            }
            let run = |v: Vec<i64>| -> Vec<f32> {
                let x = Tensor::<Inner, 2, Int>::from_data(TensorData::new(v, [2, t]), &dev);
                gpt.forward(x).into_data().into_vec().unwrap()
            };
            let a = run(ids.clone());
            let c = run(changed);
            for b in 0..2 {
                for pos in 0..t {
                    let row = |v: &Vec<f32>| v[(b * t + pos) * 50..(b * t + pos + 1) * 50].to_vec();
                    let diff = row(&a)
                        .iter()
                        .zip(row(&c))
                        .map(|(x, y)| (x - y).abs())
                        .fold(0f32, f32::max);
                    if pos < k {
                        assert!(
                            diff < 1e-5,
                            "position {pos} changed by {diff} when token {k} changed"
                        );
                    } else if pos == k {
                        assert!(diff > 1e-4, "position {k}'s own logits did not change");
                    }
                }
            }
        }
    });
}

#[test]
fn residual_projections_get_scaled_init() {
    let _guard = common::serial();
    common::on_test_backend!(|Inner, dev| {
        let cfg = GptConfig {
            n_layer: 8,
            n_head: 2,
            d_model: 64,
            ..GptConfig::default()
        };
        <Inner as burn::tensor::backend::Backend>::seed(&dev, 3);
        let gpt = Gpt::<Inner>::new(&cfg, 40, &dev);
        let std_of = |t: Tensor<Inner, 2>| -> f64 {
            let v: Vec<f32> = t.into_data().into_vec().unwrap();
            let n = v.len() as f64;
            let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
            (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt()
        };
        let qkv = std_of(gpt.blocks[0].attn.qkv.weight.val());
        let proj = std_of(gpt.blocks[0].attn.proj.weight.val());
        assert!((qkv - 0.02).abs() < 0.002, "qkv std {qkv}");
        let want = 0.02 / (16f64).sqrt();
        assert!(
            (proj - want).abs() < 0.1 * want,
            "proj std {proj}, want {want}"
        );
        assert_eq!(gpt.num_params(), cfg.num_params(40));
    });
}

#[test]
fn longer_than_context_is_refused_with_the_key() {
    let _guard = common::serial();
    common::on_test_backend!(|Inner, dev| {
        let cfg = small(MlpKind::Gelu, true);
        let gpt = Gpt::<Inner>::new(&cfg, 10, &dev);
        let ids = Tensor::<Inner, 2, Int>::zeros([1, 25], &dev);
        let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| gpt.forward(ids)))
            .unwrap_err();
        let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains("model.context"), "{msg}");
    });
}

#[test]
fn rope_scores_depend_only_on_relative_position() {
    common::on_test_backend!(|Inner, dev| {
        // The same q at every position and the same k at every position: after RoPE, q_i . k_j must be
        // a function of i - j alone, and for i = j equal to the plain dot product.
        let (t, hd) = (12, 8);
        let mut r = trainer::rng::SplitMix64::new(4);
        let mut vecn = || -> Vec<f32> {
            (0..hd)
                .map(|_| r.below(1000) as f32 / 500.0 - 1.0)
                .collect()
        };
        let (q0, k0) = (vecn(), vecn());
        let tile = |v: &Vec<f32>| -> Tensor<Inner, 4> {
            let data: Vec<f32> = (0..t).flat_map(|_| v.clone()).collect();
            Tensor::from_data(TensorData::new(data, [1, 1, t, hd]), &dev)
        };
        let (cos, sin) = model::layers::rope_tables::<Inner>(t, hd, 10000.0, &dev);
        let q = model::layers::apply_rope(tile(&q0), &cos, &sin);
        let k = model::layers::apply_rope(tile(&k0), &cos, &sin);
        let s: Vec<f32> = q.matmul(k.swap_dims(2, 3)).into_data().into_vec().unwrap(); // [t, t]
        let plain: f32 = q0.iter().zip(&k0).map(|(a, b)| a * b).sum();
        for i in 0..t {
            assert!(
                (s[i * t + i] - plain).abs() < 1e-4,
                "q_{i}.k_{i} = {} but q.k = {plain}",
                s[i * t + i]
            );
            for j in 0..t {
                if i >= 1 && j >= 1 {
                    let d = (s[i * t + j] - s[(i - 1) * t + (j - 1)]).abs();
                    assert!(
                        d < 1e-4,
                        "score({i},{j}) differs from score({},{}) by {d}",
                        i - 1,
                        j - 1
                    );
                }
            }
        }
        // And it does depend on the offset (RoPE is not the identity).
        assert!((s[5] - s[0]).abs() > 1e-3);
    });
}

/// `Gpt::decode` (the KV cache of `sample`) on the reference model: a prompt and then one token
/// at a time give the logits of `forward` on the whole sequence (`tests/model_cases/decode.rs`),
/// for tied and untied heads, with 1, 2 and 4 key/value heads, on Burn's CPU backend.
#[test]
fn decode_matches_the_full_forward() {
    use burn::backend::NdArray;
    use model::{AttentionKind, KernelsKind};
    let (reference, plain) = (KernelsKind::Reference, AttentionKind::Plain);
    model_cases::decode::each::<NdArray>(
        &[
            (reference, plain, MlpKind::Swiglu, 4),
            (reference, plain, MlpKind::Gelu, 2),
            (reference, plain, MlpKind::Swiglu, 1),
        ],
        &[burn::tensor::FloatDType::F32],
        f64::powi(2.0, -24),
        &Default::default(),
    );
}

/// With `attention = "flash"` and dropout, the kernels drop attention probabilities from the
/// model's dropout seed: with Burn's generator (the residual dropout) reseeded alike, one dropout
/// seed gives the same logits twice and another seed other logits; the masks also change from one
/// forward to the next.
#[test]
fn flash_dropout_follows_the_model_dropout_seed() {
    if !common::needs_wgpu() {
        return;
    }
    let _guard = common::serial();
    use burn::tensor::backend::Backend;
    let dev = device();
    let cfg = GptConfig {
        attention: model::AttentionKind::Flash,
        dropout: 0.3,
        ..small(MlpKind::Swiglu, true)
    };
    type A = burn::backend::Autodiff<Inner>;
    A::seed(&dev, 1);
    let mut gpt = Gpt::<A>::new(&cfg, 50, &dev);
    let ids =
        Tensor::<A, 2, Int>::from_data(TensorData::new(random_ids(2, 20, 50, 3), [2, 20]), &dev);
    let mut run = |dropout_seed: Option<u64>| -> Vec<f32> {
        if let Some(s) = dropout_seed {
            gpt.set_dropout_seed(s);
        }
        A::seed(&dev, 99);
        gpt.forward(ids.clone()).into_data().into_vec().unwrap()
    };
    let a = run(Some(5));
    let again = run(Some(5));
    let next_forward = run(None);
    let other = run(Some(6));
    assert_eq!(a, again, "one dropout seed gave two different outputs");
    assert_ne!(
        a, next_forward,
        "the second forward after a seed reused the first one's masks"
    );
    assert_ne!(a, other, "dropout seeds 5 and 6 gave the same outputs");
}

/// With the fused ops and flash attention every dropout mask is drawn in the kernels from the
/// model's dropout seed, so Burn's generator does not matter: one dropout seed, whatever Burn's
/// seed, gives the same logits; the gradients flow through the same masks (finite, and equal too).
#[test]
fn fused_dropout_depends_only_on_the_model_dropout_seed() {
    if !common::needs_wgpu() {
        return;
    }
    let _guard = common::serial();
    use burn::tensor::backend::Backend;
    let dev = device();
    let cfg = GptConfig {
        attention: model::AttentionKind::Flash,
        kernels: model::KernelsKind::Fused,
        dropout: 0.3,
        ..small(MlpKind::Gelu, false)
    };
    type A = burn::backend::Autodiff<Inner>;
    A::seed(&dev, 1);
    let mut gpt = Gpt::<A>::new(&cfg, 50, &dev);
    let ids =
        Tensor::<A, 2, Int>::from_data(TensorData::new(random_ids(2, 20, 50, 4), [2, 20]), &dev);
    let mut run = |dropout_seed: u64, burn_seed: u64| -> (Vec<f32>, Vec<f32>) {
        gpt.set_dropout_seed(dropout_seed);
        A::seed(&dev, burn_seed);
        let logits = gpt.forward(ids.clone());
        let grads = logits.clone().sum().backward();
        let g = gpt.wte.weight.grad(&grads).expect("embedding gradient");
        (
            logits.into_data().into_vec().unwrap(),
            g.into_data().into_vec().unwrap(),
        )
    };
    let (a, ga) = run(5, 10);
    let (b, gb) = run(5, 11);
    let (c, _) = run(6, 10);
    assert_eq!(a, b, "Burn's seed changed the fused model's dropout");
    assert_eq!(ga, gb, "Burn's seed changed the fused model's gradients");
    assert!(ga.iter().all(|x| x.is_finite()));
    assert_ne!(a, c, "dropout seeds 5 and 6 gave the same logits");
}

/// With the fused kernels and FP8 projections, the MLP as one op (`kernels::fp8_mlp_scaled`,
/// GELU and SwiGLU) gives the loss and gradients of the MLP composed of separate ops, bit for bit
/// here (the activation's kernel runs in both on wgpu), with tile scales and with delayed
/// per-tensor scaling.
#[test]
fn fp8_mlp_in_the_model_is_the_composition() {
    // Its models' initialisation draws from Burn's generator.
    let _guard = common::serial();
    for mlp in [MlpKind::Gelu, MlpKind::Swiglu] {
        for delayed in [false, true] {
            model_cases::fp8_mlp::fused_mlp_matches_composed::<common::B>(
                mlp,
                burn::tensor::FloatDType::F32,
                model_cases::AWKWARD,
                delayed,
                true,
                0.0,
                &device(),
            );
        }
    }
}
