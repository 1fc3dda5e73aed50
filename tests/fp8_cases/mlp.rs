//! The FP8 MLP (`kernels::fp8_mlp_scaled`, GELU and packed SwiGLU) and the quantizer inside the
//! activation's kernels that it runs (`kernels::fp8_act_quantize_pair`), against their
//! compositions of separate ops.

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, FloatDType, Tensor, TensorData, TensorPrimitive};
use kernels::{
    fp8_act_quantize_pair, fp8_linear, fp8_mlp_scaled, fp8_quantize_pair, Fp8Format,
    Fp8Granularity, Fp8LinearConfig, Fp8MlpActivation, Fp8Tensor, Fp8WgradBlocks, PairSpec,
    QuantSpec,
};

use super::{host, rel_err};

/// The values a quantized matrix stands for, f32 on the host.
fn values<B: kernels::Backend>(q: &Fp8Tensor<B>) -> Vec<f32> {
    host(q.dequantize(FloatDType::F32))
}

/// `(differing, relative RMS difference)` of two value lists: NaN matches NaN and an infinity
/// itself (a mismatch there counts as differing); the RMS is over the finite values.
fn compare(got: &[f32], want: &[f32]) -> (usize, f64) {
    let mut differing = 0;
    let (mut g, mut w) = (Vec::new(), Vec::new());
    for (&a, &b) in got.iter().zip(want) {
        let same = a == b || (a.is_nan() && b.is_nan());
        if !same {
            differing += 1;
        }
        if a.is_finite() && b.is_finite() {
            g.push(a);
            w.push(b);
        }
    }
    (differing, rel_err(&g, &w))
}

/// `[rows, cols]` normal values with standard deviation `std`, in `dtype`; with `nonfinite`, NaN,
/// +inf and -inf on the first three diagonal entries (the kernels' value-by-value tiles).
fn input<B: kernels::Backend>(
    [rows, cols]: [usize; 2],
    std: f64,
    nonfinite: bool,
    dtype: FloatDType,
    dev: &B::Device,
) -> Tensor<B, 2> {
    let t = Tensor::<B, 2>::random([rows, cols], Distribution::Normal(0.0, std), dev);
    if !nonfinite || rows < 3 || cols < 3 {
        return t.cast(dtype);
    }
    let mut v = t.into_data().to_vec::<f32>().unwrap();
    for (i, x) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY]
        .into_iter()
        .enumerate()
    {
        v[i * cols + i] = x;
    }
    Tensor::<B, 2>::from_data(TensorData::new(v, [rows, cols]), dev).cast(dtype)
}

/// The activation's output and gradient quantized by [`fp8_act_quantize_pair`] against the
/// activation kernels' outputs quantized by [`fp8_quantize_pair`], both orientations, 1x128 tiles
/// (E4M3, and E5M2 for the gradient; with the transpose per 128x128 block too) and 128x128
/// blocks, with NaN and infinities in two cases.
/// `(rows, cols)` is the activation's output (GELU's input; SwiGLU's packed input has `2 * cols`
/// columns). With `exact` every value must be equal (the activation's kernel runs in both);
/// otherwise (the CUDA C++ kernel computes the activation itself, rounding to `dtype` as the
/// activation's kernel does, with its own `exp` and reciprocal or division) at most 1% of the
/// values may differ, by a relative RMS of at most 1% over the matrix (one value in a hundred
/// one code step off gives about 0.4%).
pub fn act_quantize_pair_matches<B: kernels::KernelOps>(
    act: Fp8MlpActivation,
    dtype: FloatDType,
    dev: &B::Device,
    shapes: &[(usize, usize)],
    exact: bool,
) {
    let tile = |format| QuantSpec::new(format, Fp8Granularity::Tile1x128);
    let block = QuantSpec::new(Fp8Format::E4M3, Fp8Granularity::Block128);
    let prim = |t: &Tensor<B, 2>| t.clone().into_primitive().tensor();
    for (n, &(rows, cols)) in shapes.iter().enumerate() {
        // NaN and infinities in the second shape and the sixth (the CUDA shapes' widest, read
        // 8 values at a time): the value-by-value tiles of both read paths.
        let nonfinite = n == 1 || n == 5;
        let h_cols = match act {
            Fp8MlpActivation::Gelu => cols,
            Fp8MlpActivation::SwigluPacked => 2 * cols,
        };
        let h = input::<B>([rows, h_cols], 2.0, nonfinite, dtype, dev);
        let dy = input::<B>([rows, cols], 1e-3, false, dtype, dev);
        for backward in [false, true] {
            let want_values = match (act, backward) {
                (Fp8MlpActivation::Gelu, true) => {
                    B::gelu_form_backward(prim(&h), prim(&dy), kernels::activation::GeluForm::Exact)
                }
                (Fp8MlpActivation::Gelu, false) => {
                    B::gelu_form_forward(prim(&h), kernels::activation::GeluForm::Exact)
                }
                (Fp8MlpActivation::SwigluPacked, true) => {
                    B::swiglu_backward(prim(&h), None, prim(&dy))
                }
                (Fp8MlpActivation::SwigluPacked, false) => B::swiglu_forward(prim(&h), None),
            };
            let want_values = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(want_values));
            // 1x128 tiles, with the transpose per 128 x 128 block too (a wgrad operand's pair).
            let formats = if backward {
                [tile(Fp8Format::E4M3), tile(Fp8Format::E5M2), block]
            } else {
                [tile(Fp8Format::E4M3), block, block]
            };
            let transposed_blocks = |spec| PairSpec {
                spec,
                transposed_blocks: true,
            };
            let pairs = formats
                .map(PairSpec::from)
                .into_iter()
                .chain([transposed_blocks(formats[if backward { 1 } else { 0 }])]);
            for spec in pairs {
                let got = fp8_act_quantize_pair(h.clone(), backward.then(|| dy.clone()), act, spec);
                let want = fp8_quantize_pair(want_values.clone(), spec);
                for (side, g, w) in [("stored", &got.0, &want.0), ("transposed", &got.1, &want.1)] {
                    let ctx = format!(
                        "fp8_act_quantize_pair {act:?} {dtype:?} [{rows}, {cols}] \
                         backward={backward} {spec:?} ({side}, nonfinite={nonfinite})"
                    );
                    let (gv, wv) = (values(g), values(w));
                    let (differing, diff) = compare(&gv, &wv);
                    if exact {
                        assert_eq!(differing, 0, "{ctx}: {differing} values differ");
                        continue;
                    }
                    let share = differing as f64 / gv.len().max(1) as f64;
                    assert!(
                        share <= 0.01 && diff <= 0.01,
                        "{ctx}: {differing} of {} values differ ({:.3}%), relative RMS \
                         difference {diff:.5}; at most 1% and 0.01",
                        gv.len(),
                        100.0 * share
                    );
                }
            }
        }
    }
}

/// The FP8 MLP under autodiff against `fp8_linear(act(fp8_linear(x, w_fc)), w_proj)`: the
/// output and the gradients of `x`, `w_fc` and `w_proj`, bit for bit with `exact` (the
/// activation's kernel runs in both), else within a relative RMS difference of 1% (see
/// [`act_quantize_pair_matches`]), for E4M3 and hybrid (E5M2 gradient) settings; and with
/// per-tensor scales (not fused) exactly the composition. Then against the same MLP in f32, within
/// bounds 1.5x those of the FP8 linear layer (`super::linear`), as two FP8 layers compound.
/// `(t, d, ff, out)`: `w_fc` is `[d, ff]` for GELU and `[d, 2 * ff]` for SwiGLU.
pub fn mlp_matches_composition<B: AutodiffBackend + kernels::Backend>(
    act: Fp8MlpActivation,
    dtype: FloatDType,
    dev: &B::Device,
    shapes: &[(usize, usize, usize, usize)],
    exact: bool,
) where
    B::InnerBackend: kernels::Backend,
{
    let activate = |h: Tensor<B, 2>| match act {
        Fp8MlpActivation::Gelu => kernels::gelu(h),
        Fp8MlpActivation::SwigluPacked => kernels::swiglu_packed(h),
    };
    let reference = |h: Tensor<B, 2>| match act {
        Fp8MlpActivation::Gelu => kernels::activation::gelu_reference(h),
        Fp8MlpActivation::SwigluPacked => kernels::activation::swiglu_packed_reference(h),
    };
    for &(t, d, ff, out) in shapes {
        let h_cols = match act {
            Fp8MlpActivation::Gelu => ff,
            Fp8MlpActivation::SwigluPacked => 2 * ff,
        };
        let x0 = Tensor::<B, 2>::random([t, d], Distribution::Normal(0.0, 1.0), dev);
        let fc0 = Tensor::<B, 2>::random([d, h_cols], Distribution::Normal(0.0, 0.05), dev);
        let proj0 = Tensor::<B, 2>::random([ff, out], Distribution::Normal(0.0, 0.05), dev);
        let dy0 = Tensor::<B, 2>::random([t, out], Distribution::Normal(0.0, 1e-3), dev);
        // [y, dx, dw_fc, dw_proj] of `f` on the inputs in `dtype`.
        let run =
            |dtype: FloatDType,
             f: &dyn Fn(Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>) -> Tensor<B, 2>| {
                let leaf = |t: &Tensor<B, 2>| t.clone().cast(dtype).detach().require_grad();
                let (x, fc, proj) = (leaf(&x0), leaf(&fc0), leaf(&proj0));
                let y = f(x.clone(), fc.clone(), proj.clone());
                let g = (y.clone() * dy0.clone().cast(dtype).detach())
                    .sum()
                    .backward();
                [
                    host(y.inner()),
                    host(x.grad(&g).unwrap()),
                    host(fc.grad(&g).unwrap()),
                    host(proj.grad(&g).unwrap()),
                ]
            };
        let reference = run(FloatDType::F32, &|x, fc, proj| {
            reference(x.matmul(fc)).matmul(proj)
        });
        let names = ["y", "dx", "dw_fc", "dw_proj"];
        let cases = [
            (false, false, Fp8WgradBlocks::Neither),
            (true, false, Fp8WgradBlocks::Neither),
            (false, true, Fp8WgradBlocks::Neither),
            (false, false, Fp8WgradBlocks::Input),
            (true, false, Fp8WgradBlocks::Input),
            (true, false, Fp8WgradBlocks::GradOutput),
        ];
        for (hybrid, per_tensor, wgrad_blocks) in cases {
            let cfg = Fp8LinearConfig {
                grad_format: if hybrid {
                    Fp8Format::E5M2
                } else {
                    Fp8Format::E4M3
                },
                per_tensor,
                wgrad_blocks,
                ..Default::default()
            };
            let fused = run(dtype, &|x, fc, proj| {
                fp8_mlp_scaled(x, fc, proj, act, &cfg, None)
            });
            let composed = run(dtype, &|x, fc, proj| {
                fp8_linear(activate(fp8_linear(x, fc, &cfg)), proj, &cfg)
            });
            let ctx = format!(
                "fp8_mlp {act:?} {dtype:?} x [{t}, {d}], w_fc [{d}, {h_cols}], w_proj [{ff}, \
                 {out}], hybrid={hybrid} per_tensor={per_tensor} {wgrad_blocks:?}"
            );
            for ((name, f), c) in names.iter().zip(&fused).zip(&composed) {
                if exact || per_tensor {
                    assert!(
                        f == c,
                        "{ctx}: {name} is not the composition's, bit for bit"
                    );
                    continue;
                }
                let diff = rel_err(f, c);
                eprintln!("{ctx}: {name} relative RMS difference from the composition {diff:.5}");
                assert!(
                    diff <= 0.01,
                    "{ctx}: {name} differs from the composition by {diff:.5} > 0.01"
                );
            }
            let bound = |name: &str| match (name, hybrid) {
                ("y", _) | (_, false) => 0.09,
                _ => 0.18,
            };
            for ((name, f), r) in names.iter().zip(&fused).zip(&reference) {
                let e = rel_err(f, r);
                eprintln!("{ctx}: {name} relative RMS error vs f32 {e:.4}");
                assert!(
                    e <= bound(name),
                    "{ctx}: {name} relative RMS error vs f32 {e:.4} > {}",
                    bound(name)
                );
            }
        }
    }
}
