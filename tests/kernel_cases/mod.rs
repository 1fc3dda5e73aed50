//! Kernel-versus-reference cases shared by the wgpu tests (`tests/kernels.rs`) and the CUDA tests
//! (`tests/cuda/kernels.rs`).
//!
//! Each case draws fresh random inputs in f32 and rounds them to the dtype under test. Three runs
//! of the op then see the same values:
//! - `kernel`: the fused kernel in the dtype under test;
//! - `baseline`: the plain-Burn reference in the same dtype;
//! - `exact`: the reference on the same values held in f32.
//!
//! The output and every gradient must satisfy `err(kernel) <= 2 * err(baseline) + atol`, errors
//! measured as the largest absolute difference from `exact` and
//! `atol = (1e-5 + u) * max|exact| + floor`, so the kernel may be no worse than plain Burn in the
//! same precision:
//! - `1e-5 * max|exact|` and `floor` (`FLOOR` = 2e-6 except where a case says why): f32
//!   reduction-order and cancellation noise on O(1) values;
//! - `u * max|exact|`, with `u` the unit roundoff of the dtype under test (2^-11 for f16, 2^-8 for
//!   bf16, 0 for f32): one rounding of the largest value. The kernel and the baseline round at
//!   different points (the kernel keeps f32 where the baseline stores the dtype), so on a small
//!   case whose baseline happens to land close to `exact` the ratio alone would fail a kernel
//!   whose error is itself below one rounding.
//! - for long reductions ([`check_reducing`]), `2 * 2^-24 * sqrt(n) * max|exact|` for `n` summed
//!   terms: in f32 the baseline is the exact run itself, so the two runs' summation orders are
//!   all that separates kernel and exact.
//!
//! Gradients come from `sum(out * probe)` with a random `probe`.
#![allow(dead_code)]

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, FloatDType, Int, Tensor, TensorData};

mod attention;
mod format;
mod gemm;
mod norms;
mod optimizer;
mod recompute;

pub use attention::*;
pub use format::*;
pub use gemm::*;
pub use norms::*;
pub use optimizer::*;
pub use recompute::*;

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

/// The unit roundoff of `dtype` (half the gap between 1 and the next value); 0 for f32, whose
/// noise the `1e-5` term of the tolerance covers.
fn unit_roundoff(dtype: FloatDType) -> f32 {
    match dtype {
        FloatDType::F16 => 2f32.powi(-11),
        FloatDType::BF16 => 2f32.powi(-8),
        _ => 0.0,
    }
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
    check_reducing(name, dtype, floor, &[], inputs, kernel, reference, exact)
}

/// The typical relative error of an `n`-term f32 sum, `2^-24 sqrt(n)`, counted twice: the
/// kernel and the f32 "exact" run each sum in their own order. In f32 the baseline *is* the exact
/// run (error 0), so for a long reduction this noise is all the comparison can allow.
fn f32_sum_noise(n: usize) -> f32 {
    2.0 * 2f32.powi(-24) * (n as f32).sqrt()
}

/// [`check_exact`] for an op whose output and gradients are long reductions:
/// `reductions[0]` is the number of terms summed into each output entry and `reductions[i + 1]`
/// into each entry of input `i`'s gradient (missing entries: 1), each adding
/// [`f32_sum_noise`] to the relative allowance.
#[allow(clippy::too_many_arguments)]
pub fn check_reducing<B: AutodiffBackend>(
    name: &str,
    dtype: FloatDType,
    floor: f32,
    reductions: &[usize],
    inputs: Vec<Input<B>>,
    kernel: impl Fn(Vec<Tensor<B, 2>>) -> Tensor<B, 2>,
    reference: &dyn Fn(Vec<Tensor<B, 2>>) -> Tensor<B, 2>,
    exact: &dyn Fn(Vec<Tensor<B, 2>>) -> Tensor<B, 2>,
) {
    let sum_noise = |i: usize| f32_sum_noise(reductions.get(i).copied().unwrap_or(1));
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
                   noise: f32,
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
        let atol = (1e-5 + unit_roundoff(dtype) + noise) * scale + floor;
        assert!(
            err_k.is_finite() && err_k <= 2.0 * err_b + atol,
            "{name} ({dtype:?}): {what} error {err_k:e} exceeds 2 x baseline {err_b:e} + {atol:e} (max |exact| {scale:e})"
        );
    };
    compare(
        "output",
        sum_noise(0),
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
            (Some(e), Some(k), Some(b)) => {
                compare(&format!("gradient of input {i}"), sum_noise(i + 1), e, k, b)
            }
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
