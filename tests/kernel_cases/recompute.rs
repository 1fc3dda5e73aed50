//! Cases of the linear layers whose input is recomputed in the backward (`kernels::recompute`):
//! the output and every gradient must equal, bit for bit, those of the composition they replace
//! (the same norm or activation kernel, then `kernels::gemm`), on the same inputs. The recomputed
//! input is written by the same kernel from the same values, so nothing may differ.
#![allow(dead_code)]

use kernels::recompute::Activation;

use super::*;

/// `[rows, width, n]`: one row, odd sizes, rows not a multiple of any tile, a width whose rows are
/// pitched on CUDA.
pub const RECOMPUTE_SIZES: [[usize; 3]; 4] = [[1, 8, 3], [37, 24, 40], [130, 72, 33], [9, 300, 17]];

/// Every op of `kernels::recompute` against its composition, on GEMM engine `engine`, at `sizes`
/// (`[rows, width, n]`, width even).
pub fn recomputed_linear<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    engine: kernels::Gemm,
    sizes: &[[usize; 3]],
) {
    for &[rows, d, n] in sizes {
        let gain = (randn::<B>([1, d], dev) * 0.5).add_scalar(1.0).reshape([d]);
        let w = randn::<B>([d, n], dev).mul_scalar(0.2);
        let (x, r) = (randn::<B>([rows, d], dev), randn::<B>([rows, d], dev));
        let gemm = |a: Tensor<B, 2>, w: Tensor<B, 2>| kernels::gemm(a, w, false, false, engine);
        same(
            &format!("rms_norm_linear [{rows}, {d}] x [{d}, {n}]"),
            dtype,
            vec![x.clone(), gain.clone().reshape([1, d]), w.clone()],
            &[true, false, true],
            |v| {
                let g = v[1].clone().reshape([d]);
                vec![kernels::recompute::rms_norm_linear(
                    v[0].clone(),
                    g,
                    1e-5,
                    v[2].clone(),
                    engine,
                )]
            },
            |v| {
                let g = v[1].clone().reshape([d]);
                vec![gemm(kernels::rms_norm(v[0].clone(), g, 1e-5), v[2].clone())]
            },
        );
        same(
            &format!("add_rms_norm_linear [{rows}, {d}] x [{d}, {n}]"),
            dtype,
            vec![
                x.clone(),
                r.clone(),
                gain.clone().reshape([1, d]),
                w.clone(),
            ],
            &[true, true, false, true],
            |v| {
                let g = v[2].clone().reshape([d]);
                let (s, y) = kernels::recompute::add_rms_norm_linear(
                    v[0].clone(),
                    v[1].clone(),
                    g,
                    1e-5,
                    v[3].clone(),
                    engine,
                );
                vec![s, y]
            },
            |v| {
                let g = v[2].clone().reshape([d]);
                let (s, y) = kernels::add_rms_norm(v[0].clone(), v[1].clone(), g, 1e-5);
                vec![s, gemm(y, v[3].clone())]
            },
        );
        let w_half = randn::<B>([d / 2, n], dev).mul_scalar(0.2);
        for (activation, w) in [
            (Activation::SwigluPacked, &w_half),
            (Activation::Gelu, &w),
            (Activation::GeluTanh, &w),
        ] {
            same(
                &format!("activation_linear {activation:?} [{rows}, {d}]"),
                dtype,
                vec![x.clone(), w.clone()],
                &[true, true],
                |v| {
                    vec![kernels::recompute::activation_linear(
                        v[0].clone(),
                        activation,
                        v[1].clone(),
                        engine,
                    )]
                },
                |v| {
                    let a = match activation {
                        Activation::SwigluPacked => kernels::swiglu_packed(v[0].clone()),
                        Activation::Gelu => kernels::gelu(v[0].clone()),
                        Activation::GeluTanh => kernels::gelu_tanh(v[0].clone()),
                    };
                    vec![gemm(a, v[1].clone())]
                },
            );
        }
    }
}

/// Runs `op` and `composition` on the same leaves (`values`, those marked in `low_precision`
/// cast to `dtype`; the others, a norm's gain, stay f32 as the model's master gain does) and
/// asserts that every output and every leaf's gradient from `sum(output * probe)` are equal.
fn same<B: AutodiffBackend + kernels::Backend>(
    name: &str,
    dtype: FloatDType,
    values: Vec<Tensor<B, 2>>,
    low_precision: &[bool],
    op: impl Fn(&[Tensor<B, 2>]) -> Vec<Tensor<B, 2>>,
    composition: impl Fn(&[Tensor<B, 2>]) -> Vec<Tensor<B, 2>>,
) {
    let run = |f: &dyn Fn(&[Tensor<B, 2>]) -> Vec<Tensor<B, 2>>| {
        let leaves: Vec<Tensor<B, 2>> = values
            .iter()
            .zip(low_precision)
            .map(|(v, &low)| {
                let v = if low {
                    v.clone().cast(dtype)
                } else {
                    v.clone()
                };
                v.detach().require_grad()
            })
            .collect();
        let outs = f(&leaves);
        let mut loss: Option<Tensor<B, 1>> = None;
        for (i, o) in outs.iter().enumerate() {
            // A fixed probe per output, the same in both runs.
            let [m, c] = o.dims();
            let probe = Tensor::<B, 1, Int>::arange(0..(m * c) as i64, &o.device())
                .float()
                .mul_scalar(0.37 + i as f64)
                .sin()
                .reshape([m, c])
                .cast(o.dtype());
            let term = (o.clone() * probe).cast(FloatDType::F32).sum();
            loss = Some(match loss {
                Some(l) => l + term,
                None => term,
            });
        }
        let grads = loss.expect("an output").backward();
        let outs: Vec<Vec<f32>> = outs.into_iter().map(|o| flat(o.inner())).collect();
        let grads: Vec<Vec<f32>> = leaves
            .iter()
            .map(|l| flat(l.grad(&grads).expect("every leaf reaches the output")))
            .collect();
        (outs, grads)
    };
    // A first run lets Burn's autotuned matmul settle on one kernel per shape: the tuning run's
    // result may come from another.
    run(&composition);
    let (outs, grads) = run(&op);
    let (want_outs, want_grads) = run(&composition);
    for (i, (a, b)) in outs.iter().zip(&want_outs).enumerate() {
        assert!(
            bits_equal(a, b),
            "{name} {dtype:?}: output {i} differs from the composition's"
        );
    }
    for (i, (a, b)) in grads.iter().zip(&want_grads).enumerate() {
        assert!(
            bits_equal(a, b),
            "{name} {dtype:?}: the gradient of input {i} differs from the composition's"
        );
    }
}

fn flat<B: burn::tensor::backend::Backend>(t: Tensor<B, 2>) -> Vec<f32> {
    t.cast(FloatDType::F32)
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("f32 data")
}

fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}
