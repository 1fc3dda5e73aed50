//! Cases of the row-wise ops: the norms, the activations, dropout, RoPE, the embedding and the
//! cross-entropy.
#![allow(dead_code)]

use super::*;

pub fn rms_norm<B: AutodiffBackend + kernels::Backend>(dtype: FloatDType, dev: &B::Device) {
    for c in WIDTHS {
        let w = (randn::<B>([1, c], dev) * 0.5).add_scalar(1.0);
        check::<B>(
            &format!("rms_norm [{}, {c}]", rows_for(c)),
            dtype,
            // With one column dx = rstd * g * eps / (x^2 + eps): two terms of size |g| / |x|
            // cancel to ~0, so f32 leaves an absolute error of a few ulp of |g| / |x|, unbounded
            // as |x| -> 0. That case keeps |x| >= 0.5 (random signs) so the bound holds.
            if c == 1 { 1e-5 } else { FLOOR },
            vec![
                if c == 1 {
                    let shape = [rows_for(c), c];
                    let x = randn::<B>(shape, dev).abs().add_scalar(0.5)
                        * randn::<B>(shape, dev).sign();
                    Input {
                        values: x,
                        low_precision: true,
                        needs_grad: true,
                    }
                } else {
                    Input::act([rows_for(c), c], dev)
                },
                Input::master(w),
            ],
            |v| kernels::rms_norm(v[0].clone(), v[1].clone().reshape([c]), 1e-5),
            |v| kernels::rms_norm::reference(v[0].clone(), v[1].clone().reshape([c]), 1e-5),
        );
    }
}

pub fn add_rms_norm<B: AutodiffBackend + kernels::Backend>(dtype: FloatDType, dev: &B::Device) {
    for c in WIDTHS {
        let w = (randn::<B>([1, c], dev) * 0.5).add_scalar(1.0);
        let rows = rows_for(c);
        // Both outputs at once: [sum | normed] side by side, so both gradients paths are checked.
        let both = |s: Tensor<B, 2>, y: Tensor<B, 2>| Tensor::cat(vec![s, y], 1);
        // At width 1 the norm's input x + r must stay away from 0 (see `rms_norm`): both addends
        // take one random sign per row, |x| >= 0.5 and |r| >= 0.25, so |x + r| >= 0.75.
        let inputs = if c == 1 {
            let shape = [rows, c];
            let sign = randn::<B>(shape, dev).sign();
            let away = |at_least: f64| {
                let values = (randn::<B>(shape, dev).abs().add_scalar(at_least)) * sign.clone();
                Input {
                    values,
                    low_precision: true,
                    needs_grad: true,
                }
            };
            vec![away(0.5), away(0.25), Input::master(w)]
        } else {
            vec![
                Input::act([rows, c], dev),
                Input::act([rows, c], dev),
                Input::master(w),
            ]
        };
        check::<B>(
            &format!("add_rms_norm [{rows}, {c}]"),
            dtype,
            // With one column, the bound of `rms_norm`'s width-1 case.
            if c == 1 { 1e-5 } else { FLOOR },
            inputs,
            |v| {
                let (s, y) = kernels::add_rms_norm(
                    v[0].clone(),
                    v[1].clone(),
                    v[2].clone().reshape([c]),
                    1e-5,
                );
                both(s, y)
            },
            |v| {
                let (s, y) = kernels::rms_norm::add_reference(
                    v[0].clone(),
                    v[1].clone(),
                    v[2].clone().reshape([c]),
                    1e-5,
                );
                both(s, y)
            },
        );
        // The model's residual chain: the stream feeds a norm and, deeper in the graph, the next
        // add, so each norm's backward finds the add's gradient already there and adds it in its
        // own kernel (plain norm first, then the fused add's). Not at width 1, where a norm's
        // input near 0 makes dx cancel (see `rms_norm`) and the chain cannot keep inputs away
        // from 0.
        if c == 1 {
            continue;
        }
        let chain = |v: &[Tensor<B, 2>], fused: bool| {
            let w = v[2].clone().reshape([c]);
            let norm = |x: Tensor<B, 2>| {
                if fused {
                    kernels::rms_norm(x, w.clone(), 1e-5)
                } else {
                    kernels::rms_norm::reference(x, w.clone(), 1e-5)
                }
            };
            let add_norm = |x: Tensor<B, 2>, r: Tensor<B, 2>| {
                if fused {
                    kernels::add_rms_norm(x, r, w.clone(), 1e-5)
                } else {
                    kernels::rms_norm::add_reference(x, r, w.clone(), 1e-5)
                }
            };
            let y0 = norm(v[0].clone());
            let (s1, y1) = add_norm(y0.mul_scalar(0.5), v[0].clone());
            let (s2, y2) = add_norm(y1 + v[1].clone(), s1);
            both(s2, y2)
        };
        check::<B>(
            &format!("rms_norm, then add_rms_norm twice [{rows}, {c}]"),
            dtype,
            FLOOR,
            vec![
                Input::act([rows, c], dev),
                Input::act([rows, c], dev),
                Input::master((randn::<B>([1, c], dev) * 0.5).add_scalar(1.0)),
            ],
            |v| chain(&v, true),
            |v| chain(&v, false),
        );
    }
}

pub fn swiglu<B: AutodiffBackend + kernels::Backend>(dtype: FloatDType, dev: &B::Device) {
    for c in WIDTHS {
        let rows = rows_for(c);
        check::<B>(
            &format!("swiglu [{rows}, {c}] x 2"),
            dtype,
            FLOOR,
            vec![Input::act([rows, c], dev), Input::act([rows, c], dev)],
            |v| kernels::swiglu(v[0].clone(), v[1].clone()),
            |v| kernels::activation::swiglu_reference(v[0].clone(), v[1].clone()),
        );
        check::<B>(
            &format!("swiglu_packed [{rows}, 2 x {c}]"),
            dtype,
            FLOOR,
            vec![Input::act([rows, 2 * c], dev)],
            |v| kernels::swiglu_packed(v[0].clone()),
            |v| kernels::activation::swiglu_packed_reference(v[0].clone()),
        );
    }
}

pub fn gelu<B: AutodiffBackend + kernels::Backend>(dtype: FloatDType, dev: &B::Device) {
    for c in WIDTHS {
        let rows = rows_for(c);
        check::<B>(
            &format!("gelu [{rows}, {c}]"),
            dtype,
            FLOOR,
            vec![Input::act([rows, c], dev)],
            |v| kernels::gelu(v[0].clone() * 3.0),
            |v| kernels::activation::gelu_reference(v[0].clone() * 3.0),
        );
        // The tanh approximation, also at inputs past the kernel's clamp of |x| to 10 (where a
        // cube of x in a narrow dtype, or 0 * inf in the derivative, would give inf or NaN).
        for scale in [3.0, 40.0] {
            check::<B>(
                &format!("gelu_tanh [{rows}, {c}] x {scale}"),
                dtype,
                FLOOR,
                vec![Input::act([rows, c], dev)],
                move |v| kernels::gelu_tanh(v[0].clone() * scale),
                move |v| kernels::activation::gelu_tanh_reference(v[0].clone() * scale),
            );
        }
    }
}

/// Dropout with the in-kernel mask against `x * keep_mask` (the host's mask), output and gradient,
/// at every width in [`WIDTHS`] (odd sizes end inside a Philox call's eight entries) and p = 0.1
/// and 0.5; then a transposed 3-D view (read in its logical order), one seed twice (same bits),
/// and two seeds (different masks).
pub fn dropout<B: AutodiffBackend + kernels::Backend>(dtype: FloatDType, dev: &B::Device) {
    use kernels::Dropout;
    for (n, c) in WIDTHS.into_iter().enumerate() {
        let rows = rows_for(c);
        for p in [0.1, 0.5] {
            let d = Dropout::new(p, 0xd0_0000 + n as u64 * 7 + (p * 10.0) as u64);
            check::<B>(
                &format!("dropout [{rows}, {c}] p {p}"),
                dtype,
                FLOOR,
                vec![Input::act([rows, c], dev)],
                |v| kernels::dropout(v[0].clone(), d),
                |v| kernels::dropout::reference(v[0].clone(), d),
            );
        }
    }
    let d = Dropout::new(0.3, 42);
    let x = randn::<B>([6 * 5, 7], dev).reshape([6, 5, 7]).cast(dtype);
    let view = x.clone().swap_dims(0, 2); // [7, 5, 6], not contiguous
    let got = kernels::dropout(view.clone(), d).cast(FloatDType::F32);
    let want = kernels::dropout::reference(view, d).cast(FloatDType::F32);
    let err = max_abs::<B>((got - want).inner().reshape([7, 30]));
    assert_eq!(
        err, 0.0,
        "dropout of a transposed view ({dtype:?}): error {err:e}"
    );

    let bits = |seed: u64| -> Vec<f32> {
        kernels::dropout(x.clone(), Dropout::new(0.3, seed))
            .cast(FloatDType::F32)
            .into_data()
            .to_vec::<f32>()
            .expect("f32")
    };
    let (a, again, other) = (bits(5), bits(5), bits(6));
    assert!(
        a.iter()
            .zip(&again)
            .all(|(x, y)| x.to_bits() == y.to_bits()),
        "dropout ({dtype:?}): one seed gave two different outputs"
    );
    let zeros = |v: &[f32]| v.iter().map(|x| *x == 0.0).collect::<Vec<_>>();
    assert_ne!(
        zeros(&a),
        zeros(&other),
        "dropout ({dtype:?}): seeds 5 and 6 dropped the same entries"
    );
}

/// RoPE on [2, 3, T, head_dim], and on q and k sliced out of a packed [B, T, 3H, hd] projection
/// (a strided view, as a model produces them).
pub fn rope<B: AutodiffBackend + kernels::Backend>(dtype: FloatDType, dev: &B::Device) {
    for (t, hd) in [(1, 2), (7, 8), (33, 64), (5, 6), (17, 128)] {
        let (cos, sin) = kernels::rope::tables::<B>(t + 3, hd, 10_000.0, dev);
        let (b, h) = (2, 3);
        check::<B>(
            &format!("rope [{b}, {h}, {t}, {hd}]"),
            dtype,
            FLOOR,
            vec![
                Input::act([b * h * t, hd], dev),
                Input::constant(cos.clone()),
                Input::constant(sin.clone()),
            ],
            |v| {
                kernels::rope(
                    v[0].clone().reshape([b, h, t, hd]),
                    v[1].clone(),
                    v[2].clone(),
                )
                .reshape([b * h * t, hd])
            },
            |v| {
                kernels::rope::reference(
                    v[0].clone().reshape([b, h, t, hd]),
                    v[1].clone(),
                    v[2].clone(),
                )
                .reshape([b * h * t, hd])
            },
        );
        let strided = move |v: Vec<Tensor<B, 2>>, f: &dyn Fn(Tensor<B, 4>) -> Tensor<B, 4>| {
            // [B, T, 3H, hd] -> [B, 3H, T, hd] -> q and k heads [B, 2H, T, hd], a strided view.
            let qkv = v[0].clone().reshape([b, t, 3 * h, hd]).swap_dims(1, 2);
            let qk = qkv.slice([0..b, 0..2 * h, 0..t, 0..hd]);
            f(qk).reshape([b * 2 * h * t, hd])
        };
        let (c2, s2) = (cos.clone(), sin.clone());
        check::<B>(
            &format!("rope on a strided view [{b}, {}, {t}, {hd}]", 2 * h),
            dtype,
            FLOOR,
            vec![Input::act([b * t, 3 * h * hd], dev)],
            |v| strided(v, &|x| kernels::rope(x, c2.clone(), s2.clone())),
            |v| {
                strided(v, &|x| {
                    kernels::rope::reference(x, cos.clone(), sin.clone())
                })
            },
        );
    }
}

/// Token embedding: the output and the table's gradient, with ids that repeat (rows that gather
/// several positions' gradients), a one-row table, one-column and wide rows, and a vocabulary
/// larger than the positions (rows without gradient).
pub fn embedding<B: AutodiffBackend + kernels::Backend>(dtype: FloatDType, dev: &B::Device) {
    for (vocab, d, batch, seq) in [
        (1, 7, 2, 3),
        (7, 1, 3, 17),
        (50, 123, 3, 17),
        (5, 768, 4, 250),
        (1000, 64, 2, 129),
    ] {
        let n = batch * seq;
        let mut rng = trainer::rng::SplitMix64::new((vocab * 31 + d) as u64);
        let ids: Vec<i64> = (0..n).map(|_| rng.below(vocab) as i64).collect();
        let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [batch, seq]), dev);
        let ids2 = ids.clone();
        check::<B>(
            &format!("embedding [{vocab}, {d}] ids [{batch}, {seq}]"),
            dtype,
            FLOOR,
            vec![Input::act([vocab, d], dev)],
            |x| kernels::embedding(x[0].clone(), ids.clone()).reshape([n, d]),
            |x| kernels::embedding::reference(x[0].clone(), ids2.clone()).reshape([n, d]),
        );
    }
}

pub fn cross_entropy<B: AutodiffBackend + kernels::Backend>(dtype: FloatDType, dev: &B::Device) {
    for v in WIDTHS {
        for z in [0.0, 1e-4] {
            let rows = rows_for(v);
            let tg = targets::<B>(rows, v, dev);
            let tg2 = tg.clone();
            check::<B>(
                &format!("cross_entropy [{rows}, {v}] z_loss {z}"),
                dtype,
                FLOOR,
                vec![Input::act([rows, v], dev)],
                // Logits spread like a trained model's (std 4), so the softmax is not flat.
                |x| kernels::cross_entropy(x[0].clone() * 4.0, tg.clone(), z).reshape([rows, 1]),
                |x| {
                    kernels::cross_entropy::reference(x[0].clone() * 4.0, tg2.clone(), z)
                        .reshape([rows, 1])
                },
            );
        }
        // Logits whose rows are further apart than their length: a column slice of a wider tensor.
        let rows = rows_for(v);
        let tg = targets::<B>(rows, v, dev);
        let tg2 = tg.clone();
        check::<B>(
            &format!(
                "cross_entropy on a column slice [{rows}, {v}] of [{rows}, {}]",
                v + 8
            ),
            dtype,
            FLOOR,
            vec![Input::act([rows, v + 8], dev)],
            |x| {
                kernels::cross_entropy((x[0].clone() * 4.0).slice([0..rows, 0..v]), tg.clone(), 0.0)
                    .reshape([rows, 1])
            },
            |x| {
                kernels::cross_entropy::reference(
                    (x[0].clone() * 4.0).slice([0..rows, 0..v]),
                    tg2.clone(),
                    0.0,
                )
                .reshape([rows, 1])
            },
        );
    }
}
