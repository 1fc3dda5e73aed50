//! Cases of the GEMMs and the chunked LM-head loss.
#![allow(dead_code)]

use super::*;

/// `op(a) op(b)` as broadcast products summed in f32: exact up to f32 summation on every device.
pub fn gemm_exact<B: AutodiffBackend>(
    a: Tensor<B, 2>,
    b: Tensor<B, 2>,
    trans_a: bool,
    trans_b: bool,
) -> Tensor<B, 2> {
    let a = if trans_a { a.transpose() } else { a };
    let b = if trans_b { b.transpose() } else { b };
    let [m, k] = a.dims();
    let n = b.dims()[1];
    (a.reshape([m, k, 1]) * b.reshape([1, k, n]))
        .sum_dim(1)
        .reshape([m, n])
}

/// Problem sizes `[m, k, n]` of the GEMM cases: 1, odd, not multiples of any tile, a long K, and
/// rows whose byte length is not a multiple of 512 (pitched on CUDA).
pub const GEMM_SIZES: [[usize; 3]; 6] = [
    [1, 1, 1],
    [7, 13, 5],
    [123, 64, 77],
    [64, 1000, 33],
    [300, 128, 257],
    [17, 96, 1],
];

/// What the GEMM cases hold a GEMM's error against: it may be at most twice the baseline's error
/// (both measured against the f32 product), plus the f32 floor of [`check`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmBaseline {
    /// Burn's matmul (and its backward) in the dtype under test: a GEMM as accurate as Burn's.
    BurnMatmul,
    /// The f32 product rounded once to the dtype under test: a GEMM that accumulates in f32 and
    /// rounds once, as cuBLASLt does. Runs no matmul, so Burn autotunes none either (on CUDA each
    /// new matmul shape costs seconds of NVRTC compilation in bf16 and f16).
    ExactRounded,
}

impl GemmBaseline {
    pub fn run<B: AutodiffBackend>(
        self,
        dtype: FloatDType,
        a: Tensor<B, 2>,
        b: Tensor<B, 2>,
        trans_a: bool,
        trans_b: bool,
    ) -> Tensor<B, 2> {
        match self {
            GemmBaseline::BurnMatmul => kernels::gemm::reference(a, b, trans_a, trans_b),
            GemmBaseline::ExactRounded => gemm_exact(
                a.cast(FloatDType::F32),
                b.cast(FloatDType::F32),
                trans_a,
                trans_b,
            )
            .cast(dtype),
        }
    }
}

/// [`kernels::gemm`] on `engine` against `baseline`, for every transpose combination and each of
/// `sizes` (such as [`GEMM_SIZES`]); operands are stored as the flags say (`a` is [k, m] when
/// transposed).
pub fn gemm<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    engine: kernels::Gemm,
    baseline: GemmBaseline,
    sizes: &[[usize; 3]],
) {
    for &[m, k, n] in sizes {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            let sa = if ta { [k, m] } else { [m, k] };
            let sb = if tb { [n, k] } else { [k, n] };
            check_exact::<B>(
                &format!("gemm [m, k, n] = [{m}, {k}, {n}], trans ({ta}, {tb}), {engine:?}"),
                dtype,
                FLOOR,
                vec![Input::act(sa, dev), Input::act(sb, dev)],
                |v| kernels::gemm(v[0].clone(), v[1].clone(), ta, tb, engine),
                &|v| baseline.run(dtype, v[0].clone(), v[1].clone(), ta, tb),
                &|v| gemm_exact(v[0].clone(), v[1].clone(), ta, tb),
            );
        }
    }
}

/// Problem sizes `[m, k, n]` for [`gemm_rounding`]: small outputs over short and long K, where
/// cuBLASLt's heuristic picks split-K (the first is the chunk GEMM of `linear_cross_entropy`'s
/// transposed-weight case, where it split K = 32 88 ways).
pub const GEMM_SPLIT_K_SIZES: [[usize; 3]; 5] = [
    [64, 32, 301],
    [130, 32, 301],
    [16, 4096, 24],
    [96, 2048, 80],
    [1, 8192, 64],
];

/// [`kernels::gemm`] in f16 or bf16 entry by entry against the f32 product: every entry within
/// one unit in the last place of the dtype (twice what rounding an f32 sum once costs) plus a
/// margin for the f32 sums' own rounding, `16 sqrt(k) eps_f32 sqrt(sum (a b)^2)` (sixteen times
/// the typical error of a sum of `k` rounded terms; the worst-case `k eps sum|a b|` would exceed
/// a unit in the last place at long K and hide the error looked for). A GEMM that adds split-K
/// partial sums in the output's precision misses that on many entries while its largest error
/// over the whole output can stay within twice a once-rounded baseline's. Every transpose flag,
/// each operand stored as the flag says or as a transposed view of the other layout (pitched
/// rows on CUDA).
pub fn gemm_rounding<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    engine: kernels::Gemm,
    sizes: &[[usize; 3]],
) {
    let ulp = match dtype {
        FloatDType::BF16 => 2f32.powi(-7),
        FloatDType::F16 => 2f32.powi(-10),
        other => panic!("gemm_rounding covers f16 and bf16, not {other:?}"),
    };
    // An operand of logical shape `shape`, stored so, or as a transposed view of its transpose.
    let operand = |shape: [usize; 2], view: bool| -> Tensor<B, 2> {
        if view {
            randn::<B>([shape[1], shape[0]], dev)
                .cast(dtype)
                .transpose()
        } else {
            randn::<B>(shape, dev).cast(dtype)
        }
    };
    let host = |t: Tensor<B, 2>| -> Vec<f32> {
        t.cast(FloatDType::F32)
            .into_data()
            .convert::<f32>()
            .to_vec()
            .expect("f32 values")
    };
    for &[m, k, n] in sizes {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            for (va, vb) in [(false, false), (false, true), (true, false), (true, true)] {
                let a = operand(if ta { [k, m] } else { [m, k] }, va);
                let b = operand(if tb { [n, k] } else { [k, n] }, vb);
                let got = host(kernels::gemm(a.clone(), b.clone(), ta, tb, engine));
                let (af, bf) = (a.cast(FloatDType::F32), b.cast(FloatDType::F32));
                let exact = host(gemm_exact(af.clone(), bf.clone(), ta, tb));
                let squares = host(gemm_exact(af.clone() * af, bf.clone() * bf, ta, tb));
                let f32_scale = 16.0 * (k as f32).sqrt() * f32::EPSILON;
                let mut bad = 0usize;
                let mut worst = (0.0f32, 0usize);
                for (i, ((g, e), s)) in got.iter().zip(&exact).zip(&squares).enumerate() {
                    let bound = ulp * e.abs() + f32_scale * s.sqrt();
                    let ratio = (g - e).abs() / bound.max(f32::MIN_POSITIVE);
                    if !(ratio <= 1.0) {
                        bad += 1;
                    }
                    if !(ratio <= worst.0) {
                        worst = (ratio, i);
                    }
                }
                let (w, i) = worst;
                assert!(
                    bad == 0,
                    "gemm [m, k, n] = [{m}, {k}, {n}], trans ({ta}, {tb}), transposed views ({va}, {vb}), {dtype:?}, {engine:?}: {bad} of {} entries further than one unit in the last place from the f32 product; the worst, entry {i}, {} against {} ({w:.1}x its bound)",
                    got.len(),
                    got[i],
                    exact[i],
                );
            }
        }
    }
}

/// [`kernels::gemm`] on operands that are views: a column slice of a wider matrix (leading
/// dimension larger than the row), a transposed view read with the opposite flag, and a view with
/// a non-unit inner stride (copied first); plus [`kernels::linear`] on a rank-3 input.
pub fn gemm_strided<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    engine: kernels::Gemm,
    baseline: GemmBaseline,
) {
    let (m, k, n) = (37, 70, 45);
    // a = wide[:, 3..3 + k], b = (stored [n, k])^T used with trans_b = false.
    check_exact::<B>(
        &format!("gemm of a column slice and a transposed view, {engine:?}"),
        dtype,
        FLOOR,
        vec![Input::act([m, k + 9], dev), Input::act([n, k], dev)],
        |v| {
            kernels::gemm(
                v[0].clone().slice([0..m, 3..3 + k]),
                v[1].clone().transpose(),
                false,
                false,
                engine,
            )
        },
        &|v| {
            baseline.run(
                dtype,
                v[0].clone().slice([0..m, 3..3 + k]),
                v[1].clone().transpose(),
                false,
                false,
            )
        },
        &|v| {
            gemm_exact(
                v[0].clone().slice([0..m, 3..3 + k]),
                v[1].clone().transpose(),
                false,
                false,
            )
        },
    );
    // Every other column of a [m, 2k] matrix: inner stride 2.
    let every_other = |t: Tensor<B, 2>| {
        t.reshape([m, k, 2])
            .slice([0..m, 0..k, 0..1])
            .reshape([m, k])
    };
    check_exact::<B>(
        &format!("gemm of a view with inner stride 2, {engine:?}"),
        dtype,
        FLOOR,
        vec![Input::act([m, 2 * k], dev), Input::act([k, n], dev)],
        |v| {
            kernels::gemm(
                every_other(v[0].clone()),
                v[1].clone(),
                false,
                false,
                engine,
            )
        },
        &|v| baseline.run(dtype, every_other(v[0].clone()), v[1].clone(), false, false),
        &|v| gemm_exact(every_other(v[0].clone()), v[1].clone(), false, false),
    );
    // linear over [2, 19, k] -> [2, 19, n], compared as [38, n].
    check_exact::<B>(
        &format!("linear of a rank-3 input, {engine:?}"),
        dtype,
        FLOOR,
        vec![Input::act([38, k], dev), Input::act([k, n], dev)],
        |v| {
            kernels::linear(v[0].clone().reshape([2, 19, k]), v[1].clone(), engine).reshape([38, n])
        },
        &|v| baseline.run(dtype, v[0].clone(), v[1].clone(), false, false),
        &|v| gemm_exact(v[0].clone(), v[1].clone(), false, false),
    );
}

/// [`kernels::linear_cross_entropy`] against the mean cross-entropy of all logits formed at once,
/// in chunks of several sizes (one row, ragged last chunks, one chunk), with z-loss, an ignored
/// row, a weight in f32 beside low-precision activations (cast inside), and the weight as a
/// transposed view. The baseline forms the logits as an f32 product rounded once to the dtype
/// under test (as a GEMM accumulating in f32 does), so no matmul is autotuned.
pub fn linear_cross_entropy<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
) {
    linear_cross_entropy_cases::<B>(dtype, dev, &LINEAR_CE_CASES);
}

/// (rows, d, classes, chunk rows, z-loss) of [`linear_cross_entropy`] (wgpu runs the first
/// three). Each gradient entry is a sum over the classes of rounded products, whose largest error
/// over a few entries varies a lot from draw to draw: the cases keep a few hundred gradient
/// entries or more, so that the comparison with the baseline's error (a different draw of
/// roundings) measures the op, not luck.
pub const LINEAR_CE_CASES: [(usize, usize, usize, Option<usize>, f64); 6] = [
    (37, 24, 50, Some(8), 0.0),
    (16, 32, 130, Some(1), 1e-4),
    (64, 16, 7, None, 0.0),
    (37, 24, 50, Some(37), 1e-4),
    (130, 32, 301, Some(64), 0.0),
    // GPT-2's vocabulary: rows of 50304 logits, as in the model's LM head.
    (48, 16, 50304, Some(32), 1e-4),
];

/// [`linear_cross_entropy`] on `cases`.
pub fn linear_cross_entropy_cases<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    cases: &[(usize, usize, usize, Option<usize>, f64)],
) {
    use kernels::cross_entropy::LinearCrossEntropy;
    let fallbacks = kernels::gemm::cublaslt_fallbacks_on_this_thread();
    let round = move |t: Tensor<B, 2>| t.cast(dtype).cast(FloatDType::F32);
    for &(rows, d, classes, chunk_rows, z) in cases {
        for (w_low, w_transposed) in [(true, false), (false, false), (true, true)] {
            let tg = targets::<B>(rows, classes, dev);
            let opts = LinearCrossEntropy {
                z_loss: z,
                gemm: kernels::Gemm::Auto,
                chunk_rows,
            };
            // w as the op takes it: [classes, d], or a transposed view of a [d, classes] tensor.
            let w_of = move |t: Tensor<B, 2>| if w_transposed { t.transpose() } else { t };
            let w_shape = if w_transposed {
                [d, classes]
            } else {
                [classes, d]
            };
            // Scaled so that the logits spread like a trained model's (std about 4).
            let scale = 4.0 / (d as f64).sqrt();
            let w_input = if w_low {
                Input::act(w_shape, dev)
            } else {
                Input::master(randn(w_shape, dev))
            };
            let tg1 = tg.clone();
            // The baseline, like the op, takes the weight in the dtype under test.
            let logits_loss = move |x: Tensor<B, 2>, w: Tensor<B, 2>, run: FloatDType| {
                let w = if run == FloatDType::F32 { w } else { round(w) };
                let logits = gemm_exact(
                    x.cast(FloatDType::F32),
                    w.cast(FloatDType::F32),
                    false,
                    true,
                );
                let logits = if run == FloatDType::F32 {
                    logits
                } else {
                    round(logits)
                };
                kernels::cross_entropy::reference(logits, tg1.clone(), z)
                    .mean()
                    .reshape([1, 1])
            };
            let (l1, l2) = (logits_loss.clone(), logits_loss);
            // Summed terms: the loss over every logit, x's gradient over the classes, w's over
            // the rows.
            check_reducing::<B>(
                &format!(
                    "linear_cross_entropy [{rows}, {d}] x [{classes}, {d}]^T, chunk {chunk_rows:?}, z_loss {z}, w {} {}",
                    if w_low { "low precision" } else { "f32" },
                    if w_transposed { "(transposed view)" } else { "" }
                ),
                dtype,
                FLOOR,
                &[rows * classes, classes, rows],
                vec![Input::act([rows, d], dev), w_input],
                |v| {
                    kernels::linear_cross_entropy(
                        v[0].clone() * scale,
                        w_of(v[1].clone()),
                        tg.clone(),
                        opts,
                    )
                    .reshape([1, 1])
                },
                &|v| l1(v[0].clone() * scale, w_of(v[1].clone()), dtype),
                &|v| l2(v[0].clone() * scale, w_of(v[1].clone()), FloatDType::F32),
            );
        }
    }
    assert_eq!(
        kernels::gemm::cublaslt_fallbacks_on_this_thread(),
        fallbacks,
        "a cuBLASLt GEMM of linear_cross_entropy fell back to Burn's matmul"
    );
}

/// [`kernels::gemm::gemm_f32`]: every transpose combination, with and without an accumulator,
/// against the f32 product of the same (rounded) values. The bound is the standard one for a sum
/// of `k` products in f32: `k * eps * sum|a||b|` (products of f16/bf16 values are exact in f32).
/// An accumulator that another tensor still holds must come back added to, and unchanged where it
/// is held.
pub fn gemm_f32<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    engine: kernels::Gemm,
    sizes: &[[usize; 3]],
) where
    B::InnerBackend: kernels::Backend,
{
    type I<B> = <B as AutodiffBackend>::InnerBackend;
    for &[m, k, n] in sizes {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            for with_acc in [false, true] {
                let sa = if ta { [k, m] } else { [m, k] };
                let sb = if tb { [n, k] } else { [k, n] };
                let a = randn::<B>(sa, dev).inner().cast(dtype);
                let b = randn::<B>(sb, dev).inner().cast(dtype);
                let acc = randn::<B>([m, n], dev).inner();
                let held = acc.clone();
                let before = acc.clone().into_data();
                let got = kernels::gemm::gemm_f32::<I<B>>(
                    a.clone(),
                    b.clone(),
                    ta,
                    tb,
                    with_acc.then(|| acc.clone()),
                    engine,
                );
                drop(acc);
                let (af, bf) = (a.cast(FloatDType::F32), b.cast(FloatDType::F32));
                let view = |t: Tensor<I<B>, 2>, tr: bool| if tr { t.transpose() } else { t };
                let exact_of = |a: Tensor<I<B>, 2>, b: Tensor<I<B>, 2>| {
                    let a = view(a, ta);
                    let b = view(b, tb);
                    (a.reshape([m, k, 1]) * b.reshape([1, k, n]))
                        .sum_dim(1)
                        .reshape([m, n])
                };
                let mut exact = exact_of(af.clone(), bf.clone());
                let abs = exact_of(af.abs(), bf.abs());
                if with_acc {
                    exact = exact + held.clone();
                }
                let bound = k as f32 * f32::EPSILON * max_abs::<B>(abs) + FLOOR;
                let err = max_abs::<B>(got.clone() - exact);
                let name = format!(
                    "gemm_f32 [m, k, n] = [{m}, {k}, {n}] {dtype:?}, trans ({ta}, {tb}), acc {with_acc}, {engine:?}"
                );
                assert_eq!(
                    got.dtype(),
                    burn::tensor::DType::F32,
                    "{name}: output dtype"
                );
                assert!(err <= bound, "{name}: error {err:e} > bound {bound:e}");
                // The accumulator's other holder still sees its old values.
                held.into_data().assert_eq(&before, true);
            }
        }
    }
}

/// Sizes `[t, d, ff, out]` of the GELU MLP cases: odd rows and widths, `ff` a multiple of 8
/// (cuBLASLt's GELU epilogues take it) and one that is not (the composition's path); one size
/// twice, so that a problem cuBLASLt has planned runs again on new buffers.
pub const MLP_SIZES: [[usize; 4]; 5] = [
    [7, 13, 24, 5],
    [37, 64, 40, 33],
    [130, 96, 256, 80],
    [9, 24, 30, 17],
    [37, 64, 40, 33],
];

/// [`kernels::gelu_tanh_mlp`] on `engine`, output and the gradients of `x`, `w_fc` and `w_proj`,
/// against its composition in the dtype under test (the baseline) and the f32 products with the
/// tanh GELU's reference (exact), at each of `sizes` ([`MLP_SIZES`]). The weights are drawn with
/// standard deviation `1 / sqrt(fan-in)`, so that `x w_fc` is O(1), where GELU curves.
pub fn gelu_tanh_mlp<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    engine: kernels::Gemm,
    sizes: &[[usize; 4]],
) {
    use kernels::activation::gelu_tanh_reference;
    let weight = |shape: [usize; 2]| Input {
        values: randn::<B>(shape, dev) / (shape[0] as f64).sqrt(),
        low_precision: true,
        needs_grad: true,
    };
    for &[t, d, ff, out] in sizes {
        check_reducing::<B>(
            &format!("gelu_tanh_mlp [t, d, ff, out] = [{t}, {d}, {ff}, {out}], {engine:?}"),
            dtype,
            FLOOR,
            // Terms summed into the output and into each gradient.
            &[d + ff, ff + out, t + out, t],
            vec![Input::act([t, d], dev), weight([d, ff]), weight([ff, out])],
            |v| kernels::gelu_tanh_mlp(v[0].clone(), v[1].clone(), v[2].clone(), engine),
            &|v| kernels::mlp::composed(v[0].clone(), v[1].clone(), v[2].clone(), engine),
            &|v| {
                let h = gemm_exact(v[0].clone(), v[1].clone(), false, false);
                gemm_exact(gelu_tanh_reference(h), v[2].clone(), false, false)
            },
        );
    }
}

/// [`kernels::gelu_tanh_mlp`] without autodiff (on the inner backend: on cuBLASLt the GELU alone
/// in the first GEMM's epilogue) against the same op under autodiff at `[t, d, ff, out]`: the
/// two GEMMs and the GELU from the same accumulator, so the outputs may differ only where two
/// algorithms sum in different orders: a rounding of `gelu(h)` and one of the output, each at most
/// a unit in the last place (2u).
pub fn gelu_tanh_mlp_inference<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    [t, d, ff, out]: [usize; 4],
) where
    B::InnerBackend: kernels::Backend,
{
    let engine = kernels::Gemm::Auto;
    // Tracked: the op keeps the pre-activation for a backward (the GELU and its input written).
    let x = randn::<B>([t, d], dev).cast(dtype).require_grad();
    let w_fc = (randn::<B>([d, ff], dev) / (d as f64).sqrt()).cast(dtype);
    let w_proj = (randn::<B>([ff, out], dev) / (ff as f64).sqrt()).cast(dtype);
    let tracked = kernels::gelu_tanh_mlp(x.clone(), w_fc.clone(), w_proj.clone(), engine);
    let alone = kernels::gelu_tanh_mlp(x.inner(), w_fc.inner(), w_proj.inner(), engine);
    let tracked = tracked.inner().cast(FloatDType::F32);
    let scale = max_abs::<B>(tracked.clone());
    let err = max_abs::<B>(alone.cast(FloatDType::F32) - tracked);
    let bound = 4.0 * unit_roundoff(dtype) * scale + FLOOR;
    assert!(
        err <= bound,
        "gelu_tanh_mlp [{t}, {d}, {ff}, {out}] ({dtype:?}) without autodiff differs from the op under autodiff by {err:e} (bound {bound:e}, max |y| {scale:e})"
    );
}
