//! FP8 cases shared by `tests/fp8.rs` (wgpu / lavapipe) and `tests/cuda/kernels.rs` (CUDA).
#![allow(dead_code)]

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, FloatDType, Tensor, TensorData};
use kernels::fp8::reference;
use kernels::{
    fp8_gemm, fp8_gemm_on, fp8_linear, fp8_quantize, fp8_quantize_pair_on, Fp8Format, Fp8GemmPath,
    Fp8Granularity, Fp8LinearConfig, Fp8PairPath, Fp8Tensor, Fp8WgradBlocks, PairSpec, QuantSpec,
};

pub mod mlp;
pub mod wire;

/// Deterministic pseudo-random values, so that failures reproduce.
pub use trainer::rng::SplitMix64 as Rng;

/// Roughly standard normal (a sum of four uniforms).
pub fn normal(rng: &mut Rng) -> f32 {
    (0..4).map(|_| rng.unit() as f32).sum::<f32>() * 1.732 - 3.464
}

/// Matrices that exercise the quantizer: per-row magnitudes spanning many octaves, outliers, an
/// all-zero tile, f32 subnormals, NaN and +-inf (when `nonfinite`), values exactly at code ties.
pub fn adversarial(rows: usize, cols: usize, seed: u64, nonfinite: bool) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let mut v = vec![0.0f32; rows * cols];
    for r in 0..rows {
        let mag = 2f32.powi((rng.next_u32() % 40) as i32 - 20);
        for c in 0..cols {
            v[r * cols + c] = normal(&mut rng) * mag;
        }
    }
    let mut put = |i: usize, x: f32| {
        if i < v.len() {
            v[i] = x;
        }
    };
    // outliers
    put(3, 3.0e4);
    put(cols + 5, -7.5e3);
    // subnormals and tiny normals
    put(1, 1.0e-39);
    put(2, -3.0e-41);
    put(7, f32::MIN_POSITIVE);
    // ties of the E4M3 grid at scale 1 (1 + 1/16 lies halfway between 1 and 1.125)
    put(9, 1.0625);
    put(10, -1.1875);
    if nonfinite {
        put(11, f32::NAN);
        put(12, f32::INFINITY);
        put(2 * cols + 1, f32::NEG_INFINITY);
    }
    // Row 3: amax 256 gives the power-of-two E4M3 scale 1, so exact ties of the E4M3 grid stay
    // ties: 1 + 1/16 (between 1 and 1.125), 2 + 1/8, and 3.5 subnormal units (2^-9 each).
    if rows > 3 && cols >= 5 {
        for c in 0..cols {
            v[3 * cols + c] = normal(&mut rng) * 0.1;
        }
        for (c, t) in [256.0, 1.0625, -1.1875, 2.125, 0.006_835_937_5]
            .into_iter()
            .enumerate()
        {
            v[3 * cols + c] = t;
        }
    }
    // an all-zero 1x128 tile (row 1, columns 128..256) and an all-zero row
    if rows > 1 && cols > 128 {
        for c in 128..cols.min(256) {
            v[cols + c] = 0.0;
        }
    }
    if rows > 4 {
        for c in 0..cols {
            v[4 * cols + c] = 0.0;
        }
    }
    v
}

pub fn specs() -> Vec<QuantSpec> {
    let mut out = Vec::new();
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        for granularity in [
            Fp8Granularity::Tile1x128,
            Fp8Granularity::Block128,
            Fp8Granularity::Tensor,
        ] {
            for pow2 in [true, false] {
                for transpose in [false, true] {
                    out.push(QuantSpec {
                        format,
                        granularity,
                        pow2,
                        transpose,
                    });
                }
            }
        }
    }
    out
}

/// [`adversarial`] values as a `[rows, cols]` tensor in `dtype`, and those values after the
/// dtype's rounding, on the host (what the CPU reference is given).
fn adversarial_tensor<B: kernels::Backend>(
    rows: usize,
    cols: usize,
    seed: u64,
    dtype: FloatDType,
    dev: &B::Device,
) -> (Tensor<B, 2>, Vec<f32>) {
    let nonfinite = dtype == FloatDType::F32;
    let data = adversarial(rows, cols, seed, nonfinite);
    let x = Tensor::<B, 2>::from_data(
        TensorData::new(data, [rows, cols]),
        (dev, burn::tensor::DType::F32),
    )
    .cast(dtype);
    let rounded = host(x.clone());
    (x, rounded)
}

/// Payload and scales of the quantizer kernels, bit for bit against the CPU reference, for every
/// format, granularity, scale rounding and orientation; input in `dtype` (the reference gets the
/// same dtype-rounded values).
pub fn quantizer_bit_identical<B: kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    shapes: &[(usize, usize)],
) {
    for (n, &(rows, cols)) in shapes.iter().enumerate() {
        let (x, rounded) = adversarial_tensor::<B>(rows, cols, 11 + n as u64, dtype, dev);
        for spec in specs() {
            let ctx = format!("{dtype:?} [{rows}, {cols}] {spec:?}");
            let q = fp8_quantize(x.clone(), spec);
            assert_matches_reference(&q, &rounded, rows, cols, &spec, &ctx);
        }
    }
}

/// A one-read [`kernels::fp8_quantize_pair`] kernel (`path`: `Native` or `Fused`), bit for bit
/// against the CPU reference in both orientations, for every format, granularity and scale
/// rounding, and 1x128 tiles with the transpose per 128 x 128 block ([`PairSpec::mixed`]), of the
/// matrix and of its transposed view (strided reads); input in `dtype`.
pub fn quantize_pair_bit_identical<B: kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    shapes: &[(usize, usize)],
    path: Fp8PairPath,
) {
    let pairs = specs()
        .into_iter()
        .filter(|s| !s.transpose)
        .flat_map(|spec| {
            let mixed = PairSpec {
                spec,
                transposed_blocks: true,
            };
            let alike = PairSpec::from(spec);
            if mixed.mixed() {
                vec![alike, mixed]
            } else {
                vec![alike]
            }
        });
    let pairs: Vec<PairSpec> = pairs.collect();
    for (n, &(rows, cols)) in shapes.iter().enumerate() {
        let (x, rounded) = adversarial_tensor::<B>(rows, cols, 11 + n as u64, dtype, dev);
        for &pair in &pairs {
            let ctx = format!("fp8_quantize_pair {path:?} {dtype:?} [{rows}, {cols}] {pair:?}");
            let check = |q: &Fp8Tensor<B>, spec: QuantSpec, what: &str| {
                assert_matches_reference(q, &rounded, rows, cols, &spec, &format!("{ctx}{what}"));
            };
            let (stored, transposed) = fp8_quantize_pair_on(x.clone(), pair, path);
            check(&stored, pair.stored(), ", as stored");
            check(&transposed, pair.transposed(), ", transposed");
            let (stored, transposed) = fp8_quantize_pair_on(x.clone().transpose(), pair, path);
            let of_view = " of the transposed view";
            check(
                &stored,
                pair.stored().transposed(true),
                &format!("{of_view}, as stored"),
            );
            check(
                &transposed,
                pair.transposed().transposed(false),
                &format!("{of_view}, transposed"),
            );
        }
    }
}

/// Delayed per-tensor scaling ([`kernels::Fp8AmaxHistory`], history of 2 steps) on the backend's
/// pair path ([`kernels::fp8_pair_path`]: on CUDA the C++ kernel, which records the amax from its
/// own read) and single quantizer, bit for bit against the CPU reference scaled for the amax the
/// history should hold: a site's first step takes its tensor's own amax; later steps the largest
/// recorded amax of the last two steps, whatever the tensor (values above it saturate); within a
/// step every quantization takes the same scale; an evaluation (`Fp8Record::No`) records nothing;
/// the oldest step leaves the history; two sites keep apart; the health probe at a site
/// ([`kernels::fp8_health_pending_at`]) counts the values above the history's amax as saturated.
/// Input in `dtype`: x/2, then x (larger, saturating) and x/8 (smaller), NaN and infinities
/// included for f32.
pub fn delayed_scaling<B: kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    shapes: &[(usize, usize)],
) {
    use kernels::{Fp8AmaxHistory, Fp8Record};
    for (n, &(rows, cols)) in shapes.iter().enumerate() {
        let (x, _) = adversarial_tensor::<B>(rows, cols, 31 + n as u64, dtype, dev);
        let scaled = |f: f32| {
            let t = x.clone().mul_scalar(f);
            let h = host(t.clone());
            (t, h)
        };
        // x itself is the largest: f16 inputs near its largest value would overflow at 2x.
        let (small, plain, big) = (scaled(0.125), scaled(0.5), (x.clone(), host(x.clone())));
        let amax = |h: &[f32]| reference::tensor_amax(h);
        let (a_small, a_plain, a_big) = (amax(&small.1), amax(&plain.1), amax(&big.1));
        assert!(
            a_small < a_plain && a_plain < a_big,
            "[{rows}, {cols}]: distinct amaxes {a_small} {a_plain} {a_big}"
        );
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            for pow2 in [true, false] {
                let spec = QuantSpec {
                    format,
                    granularity: Fp8Granularity::Tensor,
                    pow2,
                    transpose: false,
                };
                let ctx = format!("delayed {dtype:?} [{rows}, {cols}] {format:?} pow2 {pow2}");
                let history = Fp8AmaxHistory::new(2);
                let (site, other) = (history.site("a"), history.site("b"));
                // Quantizes `t` at site `a` in both orientations, checked against the reference
                // scaled for `want` (None: the tensor's own amax).
                let pair = |t: &(Tensor<B, 2>, Vec<f32>), rec, want: Option<f32>, what: &str| {
                    let (s, tr) = site.quantize_pair("x", t.0.clone(), spec, rec);
                    let c = format!("{ctx}: {what}");
                    assert_matches_scaled(&s, &t.1, [rows, cols], &spec, want, &c);
                    let spec_t = spec.transposed(true);
                    assert_matches_scaled(&tr, &t.1, [rows, cols], &spec_t, want, &c);
                };
                let single = |t: &(Tensor<B, 2>, Vec<f32>), want: Option<f32>, what: &str| {
                    let q = other.quantize("x", t.0.clone(), spec, Fp8Record::Yes);
                    let c = format!("{ctx}: site b, {what}");
                    assert_matches_scaled(&q, &t.1, [rows, cols], &spec, want, &c);
                };
                // Step 1: no history, each tensor its own amax.
                pair(&plain, Fp8Record::Yes, None, "step 1");
                single(&small, None, "step 1");
                history.advance();
                // Step 2: everything at `a` scales by step 1's amax; the larger tensor saturates.
                pair(&big, Fp8Record::Yes, Some(a_plain), "step 2, larger");
                pair(&small, Fp8Record::Yes, Some(a_plain), "step 2, smaller");
                single(&big, Some(a_small), "step 2");
                // The health probe sees what the GEMM quantizes: at `b`, the larger tensor scaled
                // by the smaller's amax saturates (and probing records nothing).
                let probed =
                    kernels::fp8_health_pending_at(big.0.clone(), spec, Some((&other, "x")))
                        .resolve();
                let (words, scales) =
                    reference::quantize_with_amax(&big.1, rows, cols, &spec, a_small);
                let rows_want = reference::health_rows(&big.1, rows, cols, &spec, &words, &scales);
                let want = kernels::Fp8Health::from_rows(&rows_want, rows * cols);
                assert_eq!(probed, want, "{ctx}: health at b, step 2");
                assert!(
                    probed.saturated > 0.0,
                    "{ctx}: values above the history's amax saturate"
                );
                history.advance();
                // Step 3: the largest of steps 1 and 2.
                pair(&small, Fp8Record::Yes, Some(a_big), "step 3");
                single(&small, Some(a_big), "step 3");
                history.advance();
                // Step 4: steps 2 and 3 (larger and smaller at `a`); the evaluation records nothing.
                pair(&small, Fp8Record::Yes, Some(a_big), "step 4");
                pair(&big, Fp8Record::No, Some(a_big), "step 4, evaluation");
                single(&small, Some(a_big), "step 4");
                history.advance();
                // Step 5: steps 3 and 4, the smaller only: step 2 has left the history.
                pair(&plain, Fp8Record::No, Some(a_small), "step 5");
                single(&plain, Some(a_small), "step 5");
                assert_eq!(history.steps(), 4, "{ctx}: steps");
            }
        }
    }
}

/// FP8 health ([`kernels::fp8_health`]: the quantizer, then one kernel over the values and codes)
/// against the CPU reference, exactly, for every specification, of the matrix and of its
/// transposed view quantized the other way round (the same logical matrix); then against scales
/// shrunk 4x, so that the saturated count is exercised too.
pub fn health_matches_reference<B: kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    shapes: &[(usize, usize)],
) {
    use burn::tensor::TensorPrimitive;
    use kernels::Fp8Health;
    for (n, &(rows, cols)) in shapes.iter().enumerate() {
        let (x, rounded) = adversarial_tensor::<B>(rows, cols, 31 + n as u64, dtype, dev);
        let elements = rows * cols;
        for spec in specs() {
            let ctx = format!("fp8_health {dtype:?} [{rows}, {cols}] {spec:?}");
            let want =
                Fp8Health::from_rows(&reference::health(&rounded, rows, cols, &spec), elements);
            assert_eq!(kernels::fp8_health(x.clone(), spec), want, "{ctx}");
            let flipped = spec.transposed(!spec.transpose);
            assert_eq!(
                kernels::fp8_health(x.clone().transpose(), flipped),
                want,
                "{ctx}, of the transposed view"
            );
            let q = fp8_quantize(x.clone(), spec);
            let small = q.scales.clone().mul_scalar(0.25);
            let got = B::fp8_health_partials(
                x.clone().into_primitive().tensor(),
                q.payload.clone().into_primitive(),
                small.clone().into_primitive().tensor(),
                &spec,
            );
            let got = Fp8Health::from_rows(
                &host(Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(got))),
                elements,
            );
            let want = Fp8Health::from_rows(
                &reference::health_rows(
                    &rounded,
                    rows,
                    cols,
                    &spec,
                    &kernels::fp8::words_of_tensor(&q.payload),
                    &host(small),
                ),
                elements,
            );
            assert_eq!(got, want, "{ctx}, scales shrunk 4x");
            assert!(
                want.saturated > 0.0,
                "{ctx}: scales shrunk 4x saturate nothing, so this check cannot fail"
            );
        }
    }
}

/// `q` against the CPU reference's quantization of the row-major `[rows, cols]` `data` under
/// `spec` (payload and scales bit for bit, then the dequantized values).
fn assert_matches_reference<B: kernels::Backend>(
    q: &kernels::Fp8Tensor<B>,
    data: &[f32],
    rows: usize,
    cols: usize,
    spec: &QuantSpec,
    ctx: &str,
) {
    assert_matches_scaled(q, data, [rows, cols], spec, None, ctx);
}

/// [`assert_matches_reference`], against the reference scaled for `given_amax` when given
/// (per-tensor delayed scaling).
fn assert_matches_scaled<B: kernels::Backend>(
    q: &kernels::Fp8Tensor<B>,
    data: &[f32],
    [rows, cols]: [usize; 2],
    spec: &QuantSpec,
    given_amax: Option<f32>,
    ctx: &str,
) {
    let (words, scales) = match given_amax {
        Some(amax) => reference::quantize_with_amax(data, rows, cols, spec, amax),
        None => reference::quantize(data, rows, cols, spec),
    };
    assert_eq!(q.spec.granularity, spec.granularity, "{ctx}: granularity");
    let got_words = kernels::fp8::words_of_tensor(&q.payload);
    let got_scales = q.scales.clone().into_data().to_vec::<f32>().unwrap();
    assert_eq!(got_scales.len(), scales.len(), "{ctx}: scale count");
    for (i, (g, r)) in got_scales.iter().zip(&scales).enumerate() {
        assert_eq!(
            g.to_bits(),
            r.to_bits(),
            "{ctx}: scale {i}: kernel {g:e}, reference {r:e}"
        );
    }
    assert_eq!(got_words.len(), words.len(), "{ctx}: payload words");
    if let Some(i) = got_words.iter().zip(&words).position(|(g, r)| g != r) {
        panic!(
            "{ctx}: payload word {i} (row {}, codes {}..): kernel {:08x}, reference {:08x}",
            i / (words.len() / q.rows.max(1)),
            4 * (i % (words.len() / q.rows.max(1))),
            got_words[i],
            words[i]
        );
    }
    // Dequantization: kernel against reference, exact.
    let deq = q
        .dequantize(FloatDType::F32)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let want = reference::dequantize(&words, &scales, q.rows, q.k, spec);
    for (i, (g, r)) in deq.iter().zip(&want).enumerate() {
        assert!(
            g.to_bits() == r.to_bits() || (g.is_nan() && r.is_nan()),
            "{ctx}: dequantized {i}: kernel {g:e}, reference {r:e}"
        );
    }
}

/// The FP8 GEMM on `path` against the dequantized operands multiplied in f64 on the host, for
/// E4M3 and E5M2 left operands, tile and per-tensor scales (the tensor-core path takes the E4M3
/// pairs only).
pub fn gemm_against_dequantized<B: kernels::Backend>(
    dev: &B::Device,
    out: FloatDType,
    shapes: &[(usize, usize, usize)],
    path: Fp8GemmPath,
) {
    for &(m, n, k) in shapes {
        let a = Tensor::<B, 2>::random([m, k], Distribution::Normal(0.0, 1.0), dev);
        let b = Tensor::<B, 2>::random([n, k], Distribution::Normal(0.0, 3.0), dev);
        let cases = [
            (
                Fp8Format::E4M3,
                Fp8Format::E4M3,
                Fp8Granularity::Tile1x128,
                Fp8Granularity::Block128,
            ),
            (
                Fp8Format::E5M2,
                Fp8Format::E4M3,
                Fp8Granularity::Tile1x128,
                Fp8Granularity::Block128,
            ),
            (
                Fp8Format::E4M3,
                Fp8Format::E4M3,
                Fp8Granularity::Tensor,
                Fp8Granularity::Tensor,
            ),
        ];
        for (fa, fb, ga, gb) in cases {
            let qa = fp8_quantize(a.clone(), QuantSpec::new(fa, ga));
            let qb = fp8_quantize(b.clone(), QuantSpec::new(fb, gb));
            let Some(y) = fp8_gemm_on(&qa, &qb, out, path) else {
                // The documented refusals: mma.sync takes E4M3 only; cuBLASLt needs m and n
                // multiples of 8.
                let mma_refuses = path == Fp8GemmPath::TensorCores && fa != Fp8Format::E4M3;
                let cublaslt_refuses = path == Fp8GemmPath::CublasLt && (m % 8 != 0 || n % 8 != 0);
                assert!(
                    mma_refuses || cublaslt_refuses,
                    "{path:?} does not apply to {fa:?} x {fb:?} at [{m}, {n}, {k}]"
                );
                continue;
            };
            let y = y.cast(FloatDType::F32).into_data().to_vec::<f32>().unwrap();
            let da = qa
                .dequantize(FloatDType::F32)
                .into_data()
                .to_vec::<f32>()
                .unwrap();
            let db = qb
                .dequantize(FloatDType::F32)
                .into_data()
                .to_vec::<f32>()
                .unwrap();
            // Tolerance: f32 accumulation of k exact products (|err| <= k * eps * sum|a||b|), plus
            // the output rounding (bf16: 2^-8 relative).
            let round = if out == FloatDType::BF16 {
                2f64.powi(-8)
            } else if out == FloatDType::F16 {
                2f64.powi(-11)
            } else {
                0.0
            };
            for i in 0..m {
                for j in 0..n {
                    let (mut s, mut sa) = (0f64, 0f64);
                    for t in 0..k {
                        let p = da[i * k + t] as f64 * db[j * k + t] as f64;
                        s += p;
                        sa += p.abs();
                    }
                    // Tensor cores: FP8 MMA may accumulate with fewer than f32's 24 bits (about 14
                    // on Hopper, DeepSeek-V3 reports) within each 128-wide K tile before promotion.
                    // `mma.sync` (k = 32 per instruction) stays within one such rounding of sa.
                    // cuBLASLt's wgmma kernels carry the narrow accumulator across a whole
                    // 128-wide scale block: up to 128 additions, each off by up to 2^-13 of the
                    // running sum, whose errors add like a random walk (sqrt of the count; seen on
                    // an H100: 0.045 on a sum of |products| of ~250 at k = 129, 1.3x the single
                    // rounding). A wrong block scale is still caught: it moves a whole block's
                    // partial sum, not a 2^-13 fraction of it.
                    let mma = match path {
                        Fp8GemmPath::TensorCores => 2f64.powi(-13) * sa,
                        Fp8GemmPath::CublasLt => 2f64.powi(-13) * (k.min(128) as f64).sqrt() * sa,
                        _ => 0.0,
                    };
                    let tol = k as f64 * 1.2e-7 * sa + mma + round * s.abs() + 1e-30;
                    let g = y[i * n + j] as f64;
                    assert!((g - s).abs() <= tol, "fp8_gemm {path:?} [{m}, {n}, {k}] {fa:?}x{fb:?} {ga:?}/{gb:?} -> {out:?} at ({i}, {j}): {g} vs {s} (tol {tol:e})");
                }
            }
        }
    }
}

fn host<Bk: burn::tensor::backend::Backend>(t: Tensor<Bk, 2>) -> Vec<f32> {
    t.cast(FloatDType::F32).into_data().to_vec::<f32>().unwrap()
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| ((*g - *w) as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// The FP8 linear layer under autodiff:
/// 1. wiring: y, dx and dw equal the FP8 GEMMs of the operands quantized as documented (exact);
/// 2. quality: against the same layer in f32, relative RMS error of y, dx, dw below a bound from
///    the formats' rounding: a code's relative error is at most 2^-(m+1) (2^-4 for E4M3, 2^-3 for
///    E5M2) and about a third of that in RMS; a product of two quantized operands about 1.5x; for
///    sums of many terms of random sign the relative RMS error stays near that: ~0.04 with E4M3
///    operands, ~0.06 with E5M2 gradients (measured on lavapipe: 0.037-0.038 and 0.058-0.061), so
///    the bounds 0.06 and 0.12 leave 1.5-2x headroom;
/// 3. with one backward pass off, that pass is the plain matmul and the other the FP8 GEMM, exactly;
/// 4. with every pass off, the plain matmul exactly.
pub fn linear<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    shapes: &[(usize, usize, usize)],
) where
    B::InnerBackend: kernels::Backend,
{
    for &(t, d_in, d_out) in shapes {
        let x0 = Tensor::<B, 2>::random([t, d_in], Distribution::Normal(0.0, 1.0), dev);
        let w0 = Tensor::<B, 2>::random([d_in, d_out], Distribution::Normal(0.0, 0.02), dev);
        let dy0 =
            Tensor::<B::InnerBackend, 2>::random([t, d_out], Distribution::Normal(0.0, 1e-3), dev);
        // f32 baseline
        let (xf, wf) = (x0.clone().require_grad(), w0.clone().require_grad());
        let yf = xf.clone().matmul(wf.clone());
        let gf = (yf.clone() * Tensor::from_inner(dy0.clone()))
            .sum()
            .backward();
        let (yf, dxf, dwf) = (
            host(yf.inner()),
            host(xf.grad(&gf).unwrap()),
            host(wf.grad(&gf).unwrap()),
        );
        // Each wgrad operand with block scales too (1D x 2D wgrad GEMMs).
        let cases = [
            (false, Fp8WgradBlocks::Neither),
            (true, Fp8WgradBlocks::Neither),
            (false, Fp8WgradBlocks::Input),
            (true, Fp8WgradBlocks::Input),
            (true, Fp8WgradBlocks::GradOutput),
        ];
        for (hybrid, wgrad_blocks) in cases {
            let cfg = Fp8LinearConfig {
                grad_format: if hybrid {
                    Fp8Format::E5M2
                } else {
                    Fp8Format::E4M3
                },
                wgrad_blocks,
                ..Default::default()
            };
            let x = x0.clone().cast(dtype).detach().require_grad();
            let w = w0.clone().cast(dtype).detach().require_grad();
            let y = fp8_linear(x.clone(), w.clone(), &cfg);
            let dy = Tensor::<B, 2>::from_inner(dy0.clone().cast(dtype));
            let g = (y.clone() * dy).sum().backward();
            let (dx, dw) = (x.grad(&g).unwrap(), w.grad(&g).unwrap());
            let ctx = format!(
                "fp8_linear {dtype:?} [{t}, {d_in}] x [{d_in}, {d_out}] hybrid={hybrid} {wgrad_blocks:?}"
            );
            // 1. wiring, on the inner backend
            let (xi, wi, dyi) = (
                x.clone().inner(),
                w.clone().inner(),
                dy0.clone().cast(dtype),
            );
            let want_y = fp8_gemm(
                &fp8_quantize(xi.clone(), cfg.act_spec(false)),
                &fp8_quantize(wi.clone(), cfg.weight_spec(true)),
                dtype,
            );
            let want_dx = fp8_gemm(
                &fp8_quantize(dyi.clone(), cfg.grad_spec(false)),
                &fp8_quantize(wi.clone(), cfg.weight_spec(false)),
                dtype,
            );
            let want_dw = fp8_gemm(
                &fp8_quantize(xi.clone(), cfg.act_spec(true)),
                &fp8_quantize(dyi.clone(), cfg.grad_spec(true)),
                dtype,
            );
            assert_eq!(
                host(y.clone().inner()),
                host(want_y),
                "{ctx}: y is not the FP8 fprop GEMM"
            );
            assert_eq!(
                host(dx.clone()),
                host(want_dx),
                "{ctx}: dx is not the FP8 dgrad GEMM"
            );
            assert_eq!(
                host(dw.clone()),
                host(want_dw),
                "{ctx}: dw is not the FP8 wgrad GEMM"
            );
            // 2. quality against f32
            let (ey, edx, edw) = (
                rel_err(&host(y.inner()), &yf),
                rel_err(&host(dx), &dxf),
                rel_err(&host(dw), &dwf),
            );
            let bound_g = if hybrid { 0.12 } else { 0.06 };
            eprintln!("{ctx}: relative RMS error vs f32: y {ey:.4}, dx {edx:.4}, dw {edw:.4}");
            assert!(ey <= 0.06, "{ctx}: y relative RMS error {ey:.4} > 0.06");
            assert!(
                edx <= bound_g,
                "{ctx}: dx relative RMS error {edx:.4} > {bound_g}"
            );
            assert!(
                edw <= bound_g,
                "{ctx}: dw relative RMS error {edw:.4} > {bound_g}"
            );
        }
        linear_one_pass_off::<B>(dtype, &x0, &w0, &dy0);
        // 4. all passes off: plain matmuls
        let off = Fp8LinearConfig {
            fprop: false,
            dgrad: false,
            wgrad: false,
            ..Default::default()
        };
        let x = x0.clone().cast(dtype).detach().require_grad();
        let w = w0.clone().cast(dtype).detach().require_grad();
        let y = fp8_linear(x.clone(), w.clone(), &off);
        let plain = x.clone().inner().matmul(w.clone().inner());
        assert_eq!(
            host(y.inner()),
            host(plain),
            "fp8_linear with every pass off must be the plain matmul"
        );
    }
}

/// Case 3 of [`linear`]: with one backward pass off, that pass is the plain matmul and the other
/// the FP8 GEMM, exactly (wgrad alone quantizes `dy` for its transposed use only).
fn linear_one_pass_off<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    x0: &Tensor<B, 2>,
    w0: &Tensor<B, 2>,
    dy0: &Tensor<B::InnerBackend, 2>,
) where
    B::InnerBackend: kernels::Backend,
{
    let ([t, d_in], d_out) = (x0.dims(), w0.dims()[1]);
    let cases = [
        (false, true, Fp8WgradBlocks::Neither),
        (false, true, Fp8WgradBlocks::Input),
        (false, true, Fp8WgradBlocks::GradOutput),
        (true, false, Fp8WgradBlocks::Neither),
    ];
    for (dgrad, wgrad, wgrad_blocks) in cases {
        let cfg = Fp8LinearConfig {
            dgrad,
            wgrad,
            wgrad_blocks,
            ..Default::default()
        };
        let x = x0.clone().cast(dtype).detach().require_grad();
        let w = w0.clone().cast(dtype).detach().require_grad();
        let y = fp8_linear(x.clone(), w.clone(), &cfg);
        let dy = Tensor::<B, 2>::from_inner(dy0.clone().cast(dtype));
        let g = (y * dy).sum().backward();
        let (dx, dw) = (x.grad(&g).unwrap(), w.grad(&g).unwrap());
        let (xi, wi, dyi) = (x.inner(), w.inner(), dy0.clone().cast(dtype));
        let want_dx = if dgrad {
            fp8_gemm(
                &fp8_quantize(dyi.clone(), cfg.grad_spec(false)),
                &fp8_quantize(wi.clone(), cfg.weight_spec(false)),
                dtype,
            )
        } else {
            dyi.clone().matmul(wi.clone().transpose())
        };
        let want_dw = if wgrad {
            fp8_gemm(
                &fp8_quantize(xi.clone(), cfg.act_spec(true)),
                &fp8_quantize(dyi.clone(), cfg.grad_spec(true)),
                dtype,
            )
        } else {
            xi.transpose().matmul(dyi).cast(dtype)
        };
        let ctx = format!("fp8_linear {dtype:?} [{t}, {d_in}] x [{d_in}, {d_out}] dgrad={dgrad} wgrad={wgrad} {wgrad_blocks:?}");
        assert_eq!(host(dx), host(want_dx), "{ctx}: dx");
        assert_eq!(host(dw), host(want_dw), "{ctx}: dw");
    }
}
