//! Kernel-versus-reference cases shared by the wgpu tests (`tests/kernels.rs`) and the CUDA tests
//! (`tests/cuda_kernels.rs`).
//!
//! Each case draws fresh random inputs in f32 and rounds them to the dtype under test. Three runs
//! of the op then see the same values:
//! - `kernel`: the fused kernel in the dtype under test;
//! - `baseline`: the plain-Burn reference in the same dtype;
//! - `exact`: the reference on the same values held in f32.
//!
//! The output and every gradient must satisfy `err(kernel) <= 2 * err(baseline) + atol`, errors
//! measured as the largest absolute difference from `exact` and `atol = 1e-5 * max|exact| + floor`
//! (f32 reduction-order and cancellation noise on O(1) values; `floor` is `FLOOR` = 2e-6 except
//! where a case says why), so the kernel may be no worse than plain Burn in the same precision.
//! Gradients come from `sum(out * probe)` with a random `probe`.
#![allow(dead_code)]

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, FloatDType, Int, Tensor, TensorData};

/// An input of a case: its f32 values and whether it takes the dtype under test (activations)
/// or stays f32 (master gains, RoPE tables).
pub struct Input<B: AutodiffBackend> {
    pub values: Tensor<B, 2>,
    pub low_precision: bool,
    pub needs_grad: bool,
}

impl<B: AutodiffBackend> Input<B> {
    pub fn act(shape: [usize; 2], dev: &B::Device) -> Self {
        Self {
            values: randn(shape, dev),
            low_precision: true,
            needs_grad: true,
        }
    }
    pub fn master(values: Tensor<B, 2>) -> Self {
        Self {
            values,
            low_precision: false,
            needs_grad: true,
        }
    }
    pub fn constant(values: Tensor<B, 2>) -> Self {
        Self {
            values,
            low_precision: false,
            needs_grad: false,
        }
    }
}

pub fn randn<B: AutodiffBackend>(shape: [usize; 2], dev: &B::Device) -> Tensor<B, 2> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), dev)
}

fn max_abs<B: AutodiffBackend>(t: Tensor<B::InnerBackend, 2>) -> f32 {
    t.abs()
        .max()
        .into_scalar()
        .to_string()
        .parse::<f32>()
        .expect("a number")
}

fn to2<B: AutodiffBackend, const D: usize>(
    t: Tensor<B::InnerBackend, D>,
) -> Tensor<B::InnerBackend, 2> {
    let n = t.shape().num_elements();
    t.cast(FloatDType::F32).reshape([1, n])
}

/// Runs `op` three ways on `inputs` (see the module docs) and checks output and gradients.
/// `op` maps the inputs (in their run dtype) to an output of rank 2.
pub fn check<B: AutodiffBackend>(
    name: &str,
    dtype: FloatDType,
    floor: f32,
    inputs: Vec<Input<B>>,
    kernel: impl Fn(Vec<Tensor<B, 2>>) -> Tensor<B, 2>,
    reference: impl Fn(Vec<Tensor<B, 2>>) -> Tensor<B, 2>,
) {
    check_exact(name, dtype, floor, inputs, kernel, &reference, &reference)
}

/// [`check`] with the exact run computed by `exact` (in f32) instead of `reference`: for ops whose
/// reference is not exact in f32 on every device (Burn's f32 matmul runs on TF32 on CUDA).
pub fn check_exact<B: AutodiffBackend>(
    name: &str,
    dtype: FloatDType,
    floor: f32,
    inputs: Vec<Input<B>>,
    kernel: impl Fn(Vec<Tensor<B, 2>>) -> Tensor<B, 2>,
    reference: &dyn Fn(Vec<Tensor<B, 2>>) -> Tensor<B, 2>,
    exact: &dyn Fn(Vec<Tensor<B, 2>>) -> Tensor<B, 2>,
) {
    let dev = inputs[0].values.device();
    // Round once to the dtype under test, so that every run sees the same values.
    let values: Vec<Tensor<B, 2>> = inputs
        .iter()
        .map(|i| {
            if i.low_precision {
                i.values.clone().cast(dtype).cast(FloatDType::F32)
            } else {
                i.values.clone()
            }
        })
        .collect();
    let leaves = |run_dtype: FloatDType| -> Vec<Tensor<B, 2>> {
        values
            .iter()
            .zip(&inputs)
            .map(|(v, i)| {
                let t = if i.low_precision {
                    v.clone().cast(run_dtype)
                } else {
                    v.clone()
                };
                let t = t.detach();
                if i.needs_grad {
                    t.require_grad()
                } else {
                    t
                }
            })
            .collect()
    };
    let run = |f: &dyn Fn(Vec<Tensor<B, 2>>) -> Tensor<B, 2>,
               run_dtype: FloatDType,
               probe: Option<&Tensor<B, 2>>| {
        let xs = leaves(run_dtype);
        let out = f(xs.clone()).cast(FloatDType::F32);
        let probe = probe.cloned().unwrap_or_else(|| randn(out.dims(), &dev));
        let grads = (out.clone() * probe.clone()).sum().backward();
        let gs: Vec<Option<Tensor<B::InnerBackend, 2>>> = xs
            .iter()
            .map(|x| x.grad(&grads).map(|g| g.cast(FloatDType::F32)))
            .collect();
        (out.inner(), gs, probe)
    };
    let (exact_out, exact_grads, probe) = run(exact, FloatDType::F32, None);
    let (k_out, k_grads, _) = run(&kernel, dtype, Some(&probe));
    let (b_out, b_grads, _) = run(reference, dtype, Some(&probe));

    let compare = |what: &str,
                   exact: Tensor<B::InnerBackend, 2>,
                   k: Tensor<B::InnerBackend, 2>,
                   b: Tensor<B::InnerBackend, 2>| {
        assert_eq!(
            exact.dims(),
            k.dims(),
            "{name}: {what} has shape {:?}, expected {:?}",
            k.dims(),
            exact.dims()
        );
        let scale = max_abs::<B>(exact.clone());
        let err_k = max_abs::<B>(k - exact.clone());
        let err_b = max_abs::<B>(b - exact);
        let atol = 1e-5 * scale + floor;
        assert!(
            err_k.is_finite() && err_k <= 2.0 * err_b + atol,
            "{name} ({dtype:?}): {what} error {err_k:e} exceeds 2 x baseline {err_b:e} + {atol:e} (max |exact| {scale:e})"
        );
    };
    compare(
        "output",
        to2::<B, 2>(exact_out),
        to2::<B, 2>(k_out),
        to2::<B, 2>(b_out),
    );
    for (i, ((e, k), b)) in exact_grads
        .into_iter()
        .zip(k_grads)
        .zip(b_grads)
        .enumerate()
    {
        match (e, k, b) {
            (Some(e), Some(k), Some(b)) => compare(&format!("gradient of input {i}"), e, k, b),
            (None, None, None) => {}
            (e, k, _) => panic!(
                "{name}: gradient of input {i} present in exact: {}, kernel: {}",
                e.is_some(),
                k.is_some()
            ),
        }
    }
}

/// Row lengths every row-wise op is tested on: 1, odd, not a multiple of the vector width, large.
/// Absolute error allowed on top of the relative 1e-5.
pub const FLOOR: f32 = 2e-6;

pub const WIDTHS: [usize; 5] = [1, 7, 123, 1000, 4096];

fn rows_for(width: usize) -> usize {
    if width >= 1000 {
        5
    } else {
        37
    }
}

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
        check::<B>(
            &format!("add_rms_norm [{rows}, {c}]"),
            dtype,
            FLOOR,
            vec![
                Input::act([rows, c], dev),
                Input::act([rows, c], dev),
                Input::master(w),
            ],
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

/// Random class indices in [0, classes), with row 1 ignored (-1) when there are 2+ rows.
fn targets<B: AutodiffBackend>(rows: usize, classes: usize, dev: &B::Device) -> Tensor<B, 1, Int> {
    let mut rng = trainer::rng::SplitMix64::new((rows * 31 + classes) as u64);
    let ids: Vec<i64> = (0..rows)
        .map(|r| {
            let id = rng.below(classes) as i64;
            if r == 1 {
                -1
            } else {
                id
            }
        })
        .collect();
    Tensor::from_data(TensorData::new(ids, [rows]), dev)
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

/// The fused AdamW step against the reference arithmetic (f32 master weights; gradient in f32
/// and in `dtype`; compute copy in `dtype`).
pub fn adamw<B: AutodiffBackend>(dtype: FloatDType, dev: &B::Device)
where
    B::InnerBackend: kernels::Backend,
{
    type I<B> = <B as AutodiffBackend>::InnerBackend;
    for n in [1usize, 7, 123, 4096 + 3] {
        let r = |s: f64| randn::<B>([3, n], dev).inner().mul_scalar(s);
        let (p, g, m) = (r(1.0), r(1e-2), r(1e-3));
        let v = r(1e-3).powi_scalar(2);
        let factor = Tensor::<I<B>, 1>::from_floats([0.5], dev);
        for (wd, t) in [(0.0, 1u64), (0.1, 17)] {
            let hp = kernels::AdamWStep {
                lr: 3e-3,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: wd,
                t,
            };
            for g in [g.clone(), g.clone().cast(dtype)] {
                let k = kernels::adamw_step(
                    p.clone(),
                    g.clone(),
                    m.clone(),
                    v.clone(),
                    factor.clone(),
                    &hp,
                    Some(dtype),
                );
                let e = kernels::adamw::reference(
                    p.clone(),
                    g.clone(),
                    m.clone(),
                    v.clone(),
                    factor.clone(),
                    &hp,
                    Some(dtype),
                );
                for (what, a, b) in [
                    ("param", k.param, e.param),
                    ("m", k.m, e.m),
                    ("v", k.v, e.v),
                ] {
                    let scale = max_abs::<B>(b.clone()).max(1e-12);
                    let err = max_abs::<B>(a - b);
                    assert!(
                        err <= 1e-6 * scale,
                        "adamw [3, {n}] {what}: error {err:e} (scale {scale:e})"
                    );
                }
                let (kc, ec) = (
                    k.copy.expect("copy asked for"),
                    e.copy.expect("copy asked for"),
                );
                assert_eq!(kc.dtype(), dtype.into(), "adamw copy dtype");
                let err = max_abs::<B>(kc.cast(FloatDType::F32) - ec.cast(FloatDType::F32));
                // Each copy is its f32 weight rounded once, and the two f32 weights differ only in
                // their last bits, so the copies are at most a rounding step or two apart: allow 4
                // ulps of `dtype` at magnitude 1 (the weights here are below 2).
                let ulp = match dtype {
                    FloatDType::BF16 => 1.0 / 128.0,
                    FloatDType::F16 => 1.0 / 1024.0,
                    _ => 1e-6,
                };
                assert!(err <= ulp * 4.0, "adamw [3, {n}] copy: error {err:e}");
            }
        }
    }
}

/// Random inputs for the element-wise kernels: dense shapes of odd lengths (rows of odd bytes are
/// pitched on CUDA), a transposed view and a column slice. The empty case is [`no_rows`].
fn elementwise_layouts<B: AutodiffBackend>(
    dev: &B::Device,
) -> Vec<(&'static str, Tensor<B::InnerBackend, 2>)> {
    let r = |shape: [usize; 2]| randn::<B>(shape, dev).inner();
    vec![
        ("[1, 1]", r([1, 1])),
        ("[3, 7]", r([3, 7])),
        ("[5, 123]", r([5, 123])),
        ("[3, 4099]", r([3, 4099])),
        ("[64, 768]", r([64, 768])),
        ("[33, 65]^T", r([33, 65]).transpose()),
        ("[10, 100][.., 3..60]", r([10, 100]).slice([0..10, 3..60])),
    ]
}

/// A `[0, 5]` tensor in `dtype`: a view of no rows of a random one. On CUDA its rows are pitched,
/// so its strides are not row-major and the kernels' dense copy of it must launch nothing: CUDA
/// refuses a launch of no cubes (also why this is not a new empty tensor, or a cast of one).
fn no_rows<B: AutodiffBackend>(dtype: FloatDType, dev: &B::Device) -> Tensor<B::InnerBackend, 2> {
    randn::<B>([3, 5], dev)
        .inner()
        .cast(dtype)
        .slice([0..0, 0..5])
}

/// Every pairing of f32 and `dtype` with at least one `dtype` (input and output, or two inputs).
fn dtype_pairs(dtype: FloatDType) -> [(FloatDType, FloatDType); 3] {
    [
        (dtype, dtype),
        (FloatDType::F32, dtype),
        (dtype, FloatDType::F32),
    ]
}

/// `kernels::add_as_f32` (gradient accumulation) against the host's f32 sum of the same values:
/// every pairing of f32 and `dtype` inputs, dense shapes of odd lengths (rows of odd bytes are
/// pitched on CUDA), a transposed view, a column slice, a rank-3 tensor and an empty one. Both
/// inputs are exact in f32, so the one f32 addition must match exactly.
pub fn add_as_f32<B: AutodiffBackend>(dtype: FloatDType, dev: &B::Device)
where
    B::InnerBackend: kernels::Backend,
{
    type I<B> = <B as AutodiffBackend>::InnerBackend;
    let host = |t: Tensor<I<B>, 2>| -> Vec<f32> {
        t.cast(FloatDType::F32).into_data().to_vec::<f32>().unwrap()
    };
    let r = |shape: [usize; 2]| randn::<B>(shape, dev).inner();
    for (what, a) in elementwise_layouts::<B>(dev) {
        let b = r(a.dims());
        for (da, db) in dtype_pairs(dtype) {
            let (a, b) = (a.clone().cast(da), b.clone().cast(db));
            let want: Vec<f32> = host(a.clone())
                .iter()
                .zip(host(b.clone()))
                .map(|(x, y)| x + y)
                .collect();
            let got = kernels::add_as_f32(a, b);
            assert_eq!(
                got.dtype(),
                burn::tensor::DType::F32,
                "add_as_f32 {what}: output dtype"
            );
            assert_eq!(
                host(got),
                want,
                "add_as_f32 {what} ({da:?} + {db:?}) differs from the host's f32 sum"
            );
        }
    }
    // Rank 3: the kernel reads any rank as flat rows.
    let a = r([6, 35]).reshape([2, 3, 35]).cast(dtype);
    let b = r([6, 35]).reshape([2, 3, 35]);
    let want: Vec<f32> = host(a.clone().reshape([6, 35]))
        .iter()
        .zip(host(b.clone().reshape([6, 35])))
        .map(|(x, y)| x + y)
        .collect();
    let got = kernels::add_as_f32(a, b).reshape([6, 35]);
    assert_eq!(host(got), want, "add_as_f32 [2, 3, 35] ({dtype:?} + F32)");
    for (da, db) in dtype_pairs(dtype) {
        let got = kernels::add_as_f32(no_rows::<B>(da, dev), no_rows::<B>(db, dev));
        assert_eq!(
            (got.dims(), got.dtype()),
            ([0, 5], burn::tensor::DType::F32),
            "add_as_f32 of no elements ({da:?} + {db:?})"
        );
    }
}

/// `kernels::scale` (a gradient scaled by a device scalar and cast in one pass) against its
/// plain-Burn reference, which rounds the same f32 product once: equal bits, for every pairing of
/// f32 and `dtype` in and out, dense shapes of odd lengths (pitched rows on CUDA), a transposed
/// view, a column slice and an empty tensor.
pub fn scale<B: AutodiffBackend>(dtype: FloatDType, dev: &B::Device)
where
    B::InnerBackend: kernels::Backend,
{
    type I<B> = <B as AutodiffBackend>::InnerBackend;
    let host = |t: Tensor<I<B>, 2>| -> Vec<f32> {
        t.cast(FloatDType::F32).into_data().to_vec::<f32>().unwrap()
    };
    let cases = elementwise_layouts::<B>(dev);
    for factor in [0.37f32, -3.0e-4] {
        let f = Tensor::<I<B>, 1>::from_floats([factor], dev);
        for (what, x) in &cases {
            for (din, dout) in dtype_pairs(dtype) {
                let x = x.clone().cast(din);
                let got = kernels::scale(x.clone(), f.clone(), dout);
                let want = kernels::reduce::scale_reference(x, f.clone(), dout);
                assert_eq!(got.dtype(), dout.into(), "scale {what}: output dtype");
                assert_eq!(
                    host(got),
                    host(want),
                    "scale {what} by {factor} ({din:?} -> {dout:?}) differs from the reference"
                );
            }
        }
        for (din, dout) in dtype_pairs(dtype) {
            let got = kernels::scale(no_rows::<B>(din, dev), f.clone(), dout);
            assert_eq!(
                (got.dims(), got.dtype()),
                ([0, 5], dout.into()),
                "scale of no elements ({din:?} -> {dout:?})"
            );
        }
    }
}

/// `kernels::sum_f32` against the host's f64 sum of the same values (rounded to `dtype` first):
/// several tensors at once (dense, transposed, a column slice, rank 1, odd lengths), one alone,
/// and none; the kernel adds in f32 in another order, so it may differ by f32 rounding: at most
/// 1e-5 of the sum of magnitudes. The same tensors give the same bits twice.
pub fn sum_f32<B: AutodiffBackend>(dtype: FloatDType, dev: &B::Device)
where
    B::InnerBackend: kernels::Backend,
{
    type I<B> = <B as AutodiffBackend>::InnerBackend;
    let r = |shape: [usize; 2]| randn::<B>(shape, dev).inner().cast(dtype);
    let values = |t: &Tensor<I<B>, 2>| -> Vec<f32> {
        t.clone()
            .cast(FloatDType::F32)
            .into_data()
            .to_vec::<f32>()
            .unwrap()
    };
    let wide = r([10, 100]);
    let tensors: Vec<Tensor<I<B>, 2>> = vec![
        r([1, 1]),
        r([7, 13]),
        r([33, 65]).transpose(),
        wide.slice([0..10, 3..60]),
        r([65, 1000]),
        r([1, 16384]),
    ];
    let check = |what: &str, ts: &[Tensor<I<B>, 2>]| {
        let (mut want, mut mag) = (0f64, 0f64);
        for t in ts {
            for v in values(t) {
                want += v as f64;
                mag += (v as f64).abs();
            }
        }
        let got = kernels::sum_f32(ts.to_vec(), dev);
        let again = kernels::sum_f32(ts.to_vec(), dev);
        let got = got.into_data().to_vec::<f32>().unwrap();
        assert_eq!(got.len(), 1, "sum_f32 {what}: one element");
        let err = (got[0] as f64 - want).abs();
        assert!(
            err <= 1e-5 * mag.max(1e-30),
            "sum_f32 {what} ({dtype:?}): {} against {want} (error {err:e}, magnitudes {mag:e})",
            got[0]
        );
        assert_eq!(
            again.into_data().to_vec::<f32>().unwrap(),
            got,
            "sum_f32 {what} ({dtype:?}): two sums of the same tensors"
        );
    };
    check("all together", &tensors);
    check("[1, 16384]", &tensors[5..]);
    check("[33, 65]^T", &tensors[2..3]);
    let none: Vec<Tensor<I<B>, 2>> = Vec::new();
    assert_eq!(
        kernels::sum_f32(none, dev)
            .into_data()
            .to_vec::<f32>()
            .unwrap(),
        vec![0.0],
        "sum_f32 of nothing"
    );
}

/// `kernels::SumSquares` against the sum of squares in f64 of the same values (already rounded to
/// `dtype`): one tensor at a time and all together, over dense tensors of odd lengths, a
/// transposed view, a column slice, a permuted rank-3 tensor (copied first), rows of 4000 bytes
/// in f32 (pitched on CUDA), a strided vector, and an empty sum; the same sum twice gives the same
/// bits. The kernel sums in f32 in another order than the host, so it may differ by f32 rounding
/// of the total: at most 1e-5 of it.
pub fn sum_squares<B: AutodiffBackend>(dtype: FloatDType, dev: &B::Device)
where
    B::InnerBackend: kernels::Backend,
{
    type I<B> = <B as AutodiffBackend>::InnerBackend;
    let r = |shape: [usize; 2]| randn::<B>(shape, dev).inner().cast(dtype);
    let host = |values: Vec<f32>| -> f64 { values.iter().map(|&v| (v as f64).powi(2)).sum() };
    let host2 = |t: &Tensor<I<B>, 2>| {
        host(
            t.clone()
                .cast(FloatDType::F32)
                .into_data()
                .to_vec::<f32>()
                .unwrap(),
        )
    };
    let wide = r([10, 100]);
    let cube = randn::<B>([15, 7], dev)
        .inner()
        .cast(dtype)
        .reshape([3, 5, 7])
        .permute([2, 0, 1]);
    let cube_sq = host(
        cube.clone()
            .cast(FloatDType::F32)
            .into_data()
            .to_vec::<f32>()
            .unwrap(),
    );
    let vec = r([1, 4099]).reshape([4099]);
    let vec_sq = host2(&vec.clone().reshape([1, 4099]));
    let strided = r([64, 3]).slice([0..64, 1..2]).reshape([64]);
    let strided_sq = host2(&strided.clone().reshape([64, 1]));
    let matrices: Vec<(&str, Tensor<I<B>, 2>)> = vec![
        ("[1, 1]", r([1, 1])),
        ("[7, 13]", r([7, 13])),
        ("[33, 65]^T", r([33, 65]).transpose()),
        ("[10, 100][.., 3..60]", wide.slice([0..10, 3..60])),
        ("[65, 1000]", r([65, 1000])),
    ];
    let check = |what: &str, got: Tensor<I<B>, 1>, want: f64| {
        let got = got.into_data().to_vec::<f32>().unwrap();
        assert_eq!(got.len(), 1, "{what}: one element");
        let err = (got[0] as f64 - want).abs();
        assert!(
            err <= 1e-5 * want.max(1e-30),
            "sum_squares {what} ({dtype:?}): {} against {want} (error {err:e})",
            got[0]
        );
    };
    let mut all = kernels::SumSquares::<I<B>>::new(dev);
    let mut total = 0.0;
    for (what, m) in matrices {
        let want = host2(&m);
        let mut one = kernels::SumSquares::<I<B>>::new(dev);
        one.add(m.clone());
        check(what, one.finish(), want);
        all.add(m);
        total += want;
    }
    for (what, t, want) in [
        ("[4099]", vec, vec_sq),
        ("[64, 3][.., 1]", strided, strided_sq),
    ] {
        let mut one = kernels::SumSquares::<I<B>>::new(dev);
        one.add(t.clone());
        check(what, one.finish(), want);
        all.add(t);
        total += want;
    }
    let mut one = kernels::SumSquares::<I<B>>::new(dev);
    one.add(cube.clone());
    check("[3, 5, 7] permuted", one.finish(), cube_sq);
    all.add(cube);
    total += cube_sq;
    check("all together", all.finish(), total);
    // The partial sums are added in a fixed order: the same tensors give the same bits.
    let many: Vec<Tensor<I<B>, 2>> = (0..6).map(|i| r([40 + i, 3000])).collect();
    let sum_of = || {
        let mut s = kernels::SumSquares::<I<B>>::new(dev);
        for t in &many {
            s.add(t.clone());
        }
        s.finish().into_data().to_vec::<f32>().unwrap()
    };
    assert_eq!(
        sum_of(),
        sum_of(),
        "sum_squares ({dtype:?}): two sums of the same tensors"
    );
    let empty = kernels::SumSquares::<I<B>>::new(dev).finish();
    assert_eq!(
        empty.into_data().to_vec::<f32>().unwrap(),
        vec![0.0],
        "an empty sum"
    );
}

/// `kernels::format_stats` against counts made on the host from the same values (already rounded
/// to `dtype`), and against its plain-Burn reference: magnitudes spread over six decades with
/// zeros, infinities and NaNs planted, over dense tensors of odd lengths, a transposed view, a
/// column slice, a permuted rank-3 tensor, rows of 4000 bytes in f32 (pitched on CUDA), a strided
/// vector, one large enough for hundreds of cubes, and an empty tensor. Maxima and counts are
/// exact, so they must match exactly. The smallest magnitude (6.3e-5) is a normal number in every
/// dtype, so no platform's handling of subnormals enters.
pub fn format_stats<B: AutodiffBackend>(dtype: FloatDType, dev: &B::Device)
where
    B::InnerBackend: kernels::Backend,
{
    type I<B> = <B as AutodiffBackend>::InnerBackend;
    let spread = |shape: [usize; 2]| -> Tensor<I<B>, 2> {
        let n = randn::<B>(shape, dev).inner();
        let e = Tensor::<I<B>, 2>::random(shape, Distribution::Uniform(-4.2, 1.5), dev);
        let mut v = (n.sign() * e.mul_scalar(std::f64::consts::LN_10).exp())
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        let len = v.len();
        for (k, special) in [0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 0.0]
            .into_iter()
            .enumerate()
        {
            if k * 7 < len {
                v[(k * 7919 + 3) % len] = special;
            }
        }
        Tensor::<I<B>, 2>::from_data(TensorData::new(v, shape), dev).cast(dtype)
    };
    let host = |values: Vec<f32>, min_normal: f32| -> kernels::FormatStats {
        let mut s = kernels::FormatStats {
            amax: 0.0,
            below_normal: 0,
            nonzero: 0,
            not_finite: 0,
            elements: values.len() as u64,
        };
        for v in values {
            if !v.is_finite() {
                s.not_finite += 1;
            } else if v != 0.0 {
                s.nonzero += 1;
                s.amax = s.amax.max(v.abs() as f64);
                if v.abs() < min_normal {
                    s.below_normal += 1;
                }
            }
        }
        s
    };
    let values = |t: Tensor<I<B>, 2>| t.cast(FloatDType::F32).into_data().to_vec::<f32>().unwrap();
    let rows = |t: Tensor<I<B>, 2>| t.into_data().to_vec::<f32>().unwrap();
    let cube = spread([15, 7]).reshape([3, 5, 7]).permute([2, 0, 1]);
    let cube_values = values(cube.clone().reshape([7, 15]));
    let wide = spread([10, 100]);
    let strided = spread([64, 3]).slice([0..64, 1..2]);
    let cases: Vec<(&str, Tensor<I<B>, 2>)> = vec![
        ("[1, 1]", spread([1, 1])),
        ("[7, 13]", spread([7, 13])),
        ("[33, 65]^T", spread([33, 65]).transpose()),
        ("[10, 100][.., 3..60]", wide.slice([0..10, 3..60])),
        ("[65, 1000]", spread([65, 1000])),
        ("[300, 4001]", spread([300, 4001])),
    ];
    for min_normal in [1e-3f32, 0.05] {
        let check = |what: &str, got: kernels::FormatStats, want: kernels::FormatStats| {
            assert_eq!(
                got, want,
                "format_stats {what} ({dtype:?}, min_normal {min_normal}): kernel against host"
            );
        };
        for (what, t) in &cases {
            let want = host(values(t.clone()), min_normal);
            let n = t.shape().num_elements();
            let got = kernels::format_stats(t.clone(), min_normal as f64);
            check(what, kernels::FormatStats::from_rows(&rows(got), n), want);
            let reference = kernels::format_stats::reference(t.clone(), min_normal as f64);
            check(
                &format!("{what} (reference)"),
                kernels::FormatStats::from_rows(&rows(reference), n),
                want,
            );
        }
        let want = host(cube_values.clone(), min_normal);
        let got = kernels::format_stats(cube.clone(), min_normal as f64);
        check(
            "[3, 5, 7] permuted",
            kernels::FormatStats::from_rows(&rows(got), 105),
            want,
        );
        let vec = strided.clone().reshape([64]);
        let want = host(values(strided.clone()), min_normal);
        let got = kernels::format_stats(vec, min_normal as f64);
        check(
            "[64, 3][.., 1] as a vector",
            kernels::FormatStats::from_rows(&rows(got), 64),
            want,
        );
    }
    // A view of no rows (a new empty tensor would launch fill and cast kernels of no cubes, which
    // CUDA refuses).
    let empty = spread([3, 5]).slice([0..0, 0..5]);
    let got = kernels::FormatStats::from_rows(&rows(kernels::format_stats(empty, 1e-3)), 0);
    assert_eq!(
        (got.amax, got.nonzero, got.not_finite, got.underflow()),
        (0.0, 0, 0, 0.0),
        "format_stats of an empty tensor ({dtype:?})"
    );
}

/// `kernels::format_probe` under `Autodiff`: the forward is the identity, the gradient reaches the
/// input unchanged, and the backward records the statistics of the gradient that flowed through
/// the probe (here `dy`, planted with an infinity and a zero), equal to `kernels::format_stats` of
/// it, under the probe's name and with its element count.
pub fn format_probe<B: AutodiffBackend + kernels::Backend>(dtype: FloatDType, dev: &B::Device)
where
    B::InnerBackend: kernels::Backend,
{
    type I<B> = <B as AutodiffBackend>::InnerBackend;
    assert!(<B as kernels::FormatStatsOps>::format_probe_records());
    let sink = kernels::format_stats::format_sink();
    let probe = kernels::FormatProbe {
        name: "p".to_string(),
        min_normal: 1e-2,
        sink: sink.clone(),
    };
    let x = randn::<B>([33, 65], dev).cast(dtype).require_grad();
    let mut dy = randn::<B>([33, 65], dev)
        .inner()
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    dy[5] = f32::INFINITY;
    dy[70] = 0.0;
    dy[71] = 1e-3;
    let dy = Tensor::<I<B>, 2>::from_data(TensorData::new(dy, [33, 65]), dev).cast(dtype);
    let y = kernels::format_probe(x.clone(), &probe);
    let out = y
        .clone()
        .inner()
        .cast(FloatDType::F32)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let xs = x
        .clone()
        .inner()
        .cast(FloatDType::F32)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(out, xs, "format_probe forward ({dtype:?}): the identity");
    let grads = (y * Tensor::<B, 2>::from_inner(dy.clone()))
        .sum()
        .backward();
    let dx = x.grad(&grads).unwrap().cast(FloatDType::F32);
    let want = dy.clone().cast(FloatDType::F32);
    let (dx, want) = (
        dx.into_data().to_vec::<f32>().unwrap(),
        want.into_data().to_vec::<f32>().unwrap(),
    );
    assert!(
        dx.iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "format_probe ({dtype:?}): the gradient passes unchanged"
    );
    let records = kernels::format_stats::take_records::<I<B>>(&sink);
    assert_eq!(records.len(), 1, "format_probe ({dtype:?}): one record");
    let (name, recorded, elements) = records.into_iter().next().unwrap();
    assert_eq!((name.as_str(), elements), ("p", 33 * 65));
    let rows = |t: Tensor<I<B>, 2>| t.into_data().to_vec::<f32>().unwrap();
    let got = kernels::FormatStats::from_rows(&rows(recorded), elements);
    let want = kernels::FormatStats::from_rows(&rows(kernels::format_stats(dy, 1e-2)), elements);
    assert_eq!(
        got, want,
        "format_probe ({dtype:?}): the gradient's statistics"
    );
    assert_eq!((got.not_finite, got.below_normal > 0), (1, true));
    assert!(
        sink.lock().unwrap().is_empty(),
        "take_records empties the sink"
    );
}

/// FlashAttention output and dQ, dK, dV against the naive formula, full and causal, for every
/// `(batch, heads, seq, head_dim)` in `shapes`, plus a case with fewer queries than keys. Full
/// attention uses a custom scale (0.3), causal the default `1 / sqrt(head_dim)`. The floor is
/// `4e-5 * sqrt(seq_k / 32)` (3.2e-4 at 2048 keys): in f32 the baseline *is* the exact run, and
/// summing seq_k terms in another order (online softmax, blocks), with the cancellation in
/// `dS = P * (dP - delta)`, leaves f32 rounding noise that grows like the square root of the number
/// of terms (seen on CUDA at 2048 keys: 1.2e-4 on a dQ of max 9.4, 2.1e-4 on a dK of max 10.5).
///
/// `exact_by_sums`: compute the f32 runs of the reference with broadcast products and sums instead
/// of matmuls. On CUDA, Burn's f32 matmul runs on TF32 tensor cores (~1e-3 relative error), which
/// is no exact reference for an f32 kernel.
pub fn flash_attention<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    shapes: &[(usize, usize, usize, usize)],
    exact_by_sums: bool,
) {
    attention_cases::<B>(
        dtype,
        dev,
        shapes,
        exact_by_sums,
        &[(false, None), (true, None)],
    );
}

/// [`flash_attention`]'s checks for each `(causal, dropout p)` of `variants` (with dropout,
/// [`kernels::flash_attention_dropout`] against the naive formula with the host's mask, a seed per
/// case, and the floor divided by the keep probability).
fn attention_cases<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    shapes: &[(usize, usize, usize, usize)],
    exact_by_sums: bool,
    variants: &[(bool, Option<f64>)],
) {
    let mut cases: Vec<(usize, usize, usize, usize, usize)> = shapes
        .iter()
        .map(|&(b, h, s, hd)| (b, h, s, s, hd))
        .collect();
    cases.push((1, 2, 17, 40, 64));
    for (n, (b, h, sq, sk, hd)) in cases.into_iter().enumerate() {
        for &(causal, p) in variants {
            let drop = p.map(|p| {
                let seed = 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(n as u64 * 4 + 1 + causal as u64)
                    ^ (p * 1e3) as u64;
                kernels::Dropout::new(p, seed)
            });
            let (op, tag) = match p {
                Some(p) => ("flash_attention_dropout", format!(" p {p}")),
                None => ("flash_attention", String::new()),
            };
            let started = std::time::Instant::now();
            let scale = if causal { None } else { Some(0.3) };
            let (rq, rk) = (b * h * sq, b * h * sk);
            check::<B>(
                &format!("{op} q [{b}, {h}, {sq}, {hd}] k/v seq {sk} causal {causal}{tag}"),
                dtype,
                4e-5 * (sk as f32 / 32.0).sqrt().max(1.0) / (1.0 - p.unwrap_or(0.0) as f32),
                vec![
                    Input::act([rq, hd], dev),
                    Input::act([rk, hd], dev),
                    Input::act([rk, hd], dev),
                ],
                |v| {
                    let q = v[0].clone().reshape([b, h, sq, hd]);
                    let k = v[1].clone().reshape([b, h, sk, hd]);
                    let val = v[2].clone().reshape([b, h, sk, hd]);
                    match drop {
                        Some(d) => kernels::flash_attention_dropout(q, k, val, causal, scale, d),
                        None => kernels::flash_attention(q, k, val, causal, scale),
                    }
                    .reshape([rq, hd])
                },
                |v| {
                    let q = v[0].clone().reshape([b, h, sq, hd]);
                    let k = v[1].clone().reshape([b, h, sk, hd]);
                    let val = v[2].clone().reshape([b, h, sk, hd]);
                    if exact_by_sums && q.dtype() == burn::tensor::DType::F32 {
                        attention_by_sums_dropout(q, k, val, causal, scale, drop).reshape([rq, hd])
                    } else {
                        match drop {
                            Some(d) => {
                                kernels::attention::reference_dropout(q, k, val, causal, scale, d)
                            }
                            None => kernels::attention::reference(q, k, val, causal, scale),
                        }
                        .reshape([rq, hd])
                    }
                },
            );
            eprintln!(
                "{op} [{b}, {h}, {sq}/{sk}, {hd}] causal {causal}{tag} {dtype:?}: {:.1?}",
                started.elapsed()
            );
        }
    }
}

/// FlashAttention with dropout inside the kernels against the naive formula with the host's mask
/// ([`kernels::attention::dropout::keep_mask`]): output and dQ, dK, dV, full and causal, p = 0.2
/// and 0.5, a fresh seed per case, for every `(batch, heads, seq, head_dim)` in `shapes` plus 17
/// queries against 40 keys. A kernel whose mask differed from the host's in one entry in a
/// thousand would fail: a dropped probability changes its row's output by about `p / seq` of the
/// row's scale, far above the floor. Then: one seed gives the same output twice, bit for bit, and
/// another seed another output.
pub fn flash_attention_dropout<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    shapes: &[(usize, usize, usize, usize)],
    exact_by_sums: bool,
) {
    use kernels::Dropout;
    attention_cases::<B>(
        dtype,
        dev,
        shapes,
        exact_by_sums,
        &[(false, Some(0.2)), (true, Some(0.2)), (true, Some(0.5))],
    );

    // Same seed, same bits; another seed, another output.
    let (b, h, s, hd) = (1, 2, 40, 64);
    let r = || {
        randn::<B>([b * h * s, hd], dev)
            .reshape([b, h, s, hd])
            .cast(dtype)
    };
    let (q, k, v) = (r(), r(), r());
    let run = |seed: u64| {
        kernels::flash_attention_dropout(
            q.clone(),
            k.clone(),
            v.clone(),
            true,
            None,
            Dropout::new(0.3, seed),
        )
        .cast(FloatDType::F32)
        .into_data()
        .to_vec::<f32>()
        .expect("f32 output")
    };
    let (a, again, other) = (run(11), run(11), run(12));
    assert!(
        a.iter()
            .zip(&again)
            .all(|(x, y)| x.to_bits() == y.to_bits()),
        "flash_attention_dropout ({dtype:?}): one seed gave two different outputs"
    );
    let differ = a.iter().zip(&other).filter(|(x, y)| x != y).count();
    assert!(
        differ > a.len() / 2,
        "flash_attention_dropout ({dtype:?}): seeds 11 and 12 gave outputs differing in only {differ} of {} values",
        a.len()
    );
}

/// RoPE + FlashAttention of a packed qkv projection ([`kernels::flash_attention_qkv`]) against
/// slicing, [`kernels::rope::reference`] and the naive attention, output and the projection's
/// gradient: full (scale 0.3) and causal, without and with dropout (p = 0.2), at each `(batch,
/// seq, heads, head_dim)` of `shapes`.
pub fn flash_attention_qkv<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    shapes: &[(usize, usize, usize, usize)],
    exact_by_sums: bool,
) {
    for (n, &(b, t, h, hd)) in shapes.iter().enumerate() {
        let (cos, sin) = kernels::rope::tables::<B>(t + 3, hd, 10_000.0, dev);
        for (causal, p) in [(false, None), (true, None), (true, Some(0.2))] {
            let started = std::time::Instant::now();
            let scale = if causal { None } else { Some(0.3) };
            let dropout = p.map(|p| kernels::Dropout::new(p, 0xabc0 + n as u64));
            check::<B>(
                &format!(
                    "flash_attention_qkv [{b}, {t}, 3 x {h} x {hd}] causal {causal} dropout {p:?}"
                ),
                dtype,
                4e-5 * (t as f32 / 32.0).sqrt().max(1.0) / (1.0 - p.unwrap_or(0.0) as f32),
                vec![
                    Input::act([b * t, 3 * h * hd], dev),
                    Input::constant(cos.clone()),
                    Input::constant(sin.clone()),
                ],
                |v| {
                    let qkv = v[0].clone().reshape([b, t, 3 * h * hd]);
                    let (c, s) = (v[1].clone(), v[2].clone());
                    kernels::flash_attention_qkv(qkv, h, c, s, causal, scale, dropout)
                        .reshape([b * t, h * hd])
                },
                |v| {
                    let qkv = v[0].clone().reshape([b, t, 3 * h * hd]);
                    let (c, s) = (v[1].clone(), v[2].clone());
                    if exact_by_sums && qkv.dtype() == burn::tensor::DType::F32 {
                        let x = qkv.reshape([b, t, 3 * h, hd]).swap_dims(1, 2);
                        let part =
                            |i: usize| x.clone().slice([0..b, i * h..(i + 1) * h, 0..t, 0..hd]);
                        let q = kernels::rope::reference(part(0), c.clone(), s.clone());
                        let k = kernels::rope::reference(part(1), c, s);
                        attention_by_sums_dropout(q, k, part(2), causal, scale, dropout)
                            .swap_dims(1, 2)
                            .reshape([b * t, h * hd])
                    } else {
                        kernels::attention::reference_qkv(qkv, h, c, s, causal, scale, dropout)
                            .reshape([b * t, h * hd])
                    }
                },
            );
            eprintln!(
                "flash_attention_qkv [{b}, {t}, {h}, {hd}] causal {causal} dropout {p:?} {dtype:?}: {:.1?}",
                started.elapsed()
            );
        }
    }
}

/// The naive attention formula with every product as a broadcast multiply and a sum (f32
/// accumulation in Burn's reductions, no matmul).
pub fn attention_by_sums<B: burn::tensor::backend::Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    causal: bool,
    scale: Option<f64>,
) -> Tensor<B, 4> {
    attention_by_sums_dropout(q, k, v, causal, scale, None)
}

/// [`attention_by_sums`] with the probabilities multiplied by the host's dropout mask.
pub fn attention_by_sums_dropout<B: burn::tensor::backend::Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    causal: bool,
    scale: Option<f64>,
    dropout: Option<kernels::Dropout>,
) -> Tensor<B, 4> {
    let [b, h, sq, hd] = q.dims();
    let sk = k.dims()[2];
    let scale = scale.unwrap_or_else(|| kernels::attention::default_scale(hd));
    let scores: Tensor<B, 4> = (q.unsqueeze_dim::<5>(3) * k.unsqueeze_dim::<5>(2))
        .sum_dim(4)
        .reshape([b, h, sq, sk])
        * scale;
    let scores = if causal {
        let dev = scores.device();
        let rows = Tensor::<B, 1, Int>::arange(0..sq as i64, &dev).reshape([sq, 1]);
        let cols = Tensor::<B, 1, Int>::arange(0..sk as i64, &dev).reshape([1, sk]);
        scores.mask_fill(
            cols.greater(rows).reshape([1, 1, sq, sk]),
            f32::NEG_INFINITY,
        )
    } else {
        scores
    };
    let mut p = burn::tensor::activation::softmax(scores, 3);
    if let Some(d) = dropout {
        let mask = kernels::attention::dropout::keep_mask::<B>(d, [b, h, sq, sk], &p.device());
        let mask = mask.cast(p.dtype());
        p = p * mask;
    }
    (p.unsqueeze_dim::<5>(4) * v.unsqueeze_dim::<5>(2))
        .sum_dim(3)
        .reshape([b, h, sq, hd])
}

/// FlashAttention on q, k, v sliced out of one packed `[B, S, 3H, hd]` projection (strided views,
/// as the model produces them). `exact_by_sums`: as in [`flash_attention`] (the f32 reference on
/// CUDA must not go through TF32 matmuls).
pub fn flash_attention_strided<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
) {
    flash_attention_strided_with::<B>(dtype, dev, false)
}

/// [`flash_attention_strided`] with the choice of exact reference.
pub fn flash_attention_strided_with<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    exact_by_sums: bool,
) {
    let (b, h, s, hd) = (2, 3, 77, 64);
    let heads = move |v: &Tensor<B, 2>, i: usize| {
        v.clone().reshape([b, s, 3 * h, hd]).swap_dims(1, 2).slice([
            0..b,
            i * h..(i + 1) * h,
            0..s,
            0..hd,
        ])
    };
    for causal in [false, true] {
        check::<B>(
            &format!("flash_attention on strided q/k/v [{b}, {h}, {s}, {hd}] causal {causal}"),
            dtype,
            1e-5,
            vec![Input::act([b * s, 3 * h * hd], dev)],
            |v| {
                kernels::flash_attention(
                    heads(&v[0], 0),
                    heads(&v[0], 1),
                    heads(&v[0], 2),
                    causal,
                    None,
                )
                .reshape([b * h * s, hd])
            },
            |v| {
                let (q, k, val) = (heads(&v[0], 0), heads(&v[0], 1), heads(&v[0], 2));
                if exact_by_sums && q.dtype() == burn::tensor::DType::F32 {
                    attention_by_sums(q, k, val, causal, None).reshape([b * h * s, hd])
                } else {
                    kernels::attention::reference(q, k, val, causal, None).reshape([b * h * s, hd])
                }
            },
        );
    }
}

/// The forward's log-sum-exp against the naive one on the same (rounded) values in f32
/// (`exact_by_sums`: with broadcast products and sums instead of matmuls, see [`flash_attention`]).
pub fn flash_attention_lse<B: AutodiffBackend>(
    dtype: FloatDType,
    dev: &B::Device,
    exact_by_sums: bool,
) where
    B::InnerBackend: kernels::KernelOps,
{
    type I<B> = <B as AutodiffBackend>::InnerBackend;
    for (b, h, s, hd) in [(2, 3, 1, 64), (2, 3, 17, 128), (1, 2, 1000, 64)] {
        for causal in [false, true] {
            let r = || {
                randn::<B>([b * h * s, hd], dev)
                    .inner()
                    .reshape([b, h, s, hd])
                    .cast(dtype)
                    .cast(FloatDType::F32)
            };
            let (q, k, v) = (r(), r(), r());
            let (_, lse) = kernels::flash_attention_with_lse(
                q.clone().cast(dtype),
                k.clone().cast(dtype),
                v.cast(dtype),
                causal,
                None,
            );
            let scale = kernels::attention::default_scale(hd);
            let mut scores: Tensor<I<B>, 4> = if exact_by_sums {
                (q.unsqueeze_dim::<5>(3) * k.unsqueeze_dim::<5>(2))
                    .sum_dim(4)
                    .reshape([b, h, s, s])
                    * scale
            } else {
                q.matmul(k.swap_dims(2, 3)) * scale
            };
            if causal {
                let rows = Tensor::<I<B>, 1, Int>::arange(0..s as i64, dev).reshape([s, 1]);
                let cols = Tensor::<I<B>, 1, Int>::arange(0..s as i64, dev).reshape([1, s]);
                scores =
                    scores.mask_fill(cols.greater(rows).reshape([1, 1, s, s]), f32::NEG_INFINITY);
            }
            let m = scores.clone().max_dim(3);
            let exact = ((scores - m.clone()).exp().sum_dim(3).log() + m).reshape([b, h, s]);
            let n = b * h * s;
            let mag = max_abs::<B>(to2::<B, 3>(exact.clone()));
            let err = max_abs::<B>(to2::<B, 3>(lse - exact));
            assert!(
                err <= 1e-5 * mag + 1e-5,
                "flash_attention lse [{b}, {h}, {s}, {hd}] causal {causal} ({dtype:?}): error {err:e} over {n} rows (max |lse| {mag:e})"
            );
        }
    }
}

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
            check_exact::<B>(
                &format!(
                    "linear_cross_entropy [{rows}, {d}] x [{classes}, {d}]^T, chunk {chunk_rows:?}, z_loss {z}, w {} {}",
                    if w_low { "low precision" } else { "f32" },
                    if w_transposed { "(transposed view)" } else { "" }
                ),
                dtype,
                FLOOR,
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
