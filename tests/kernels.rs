//! Fused kernels against their plain-Burn references on wgpu (lavapipe in CI), in f32 and f16;
//! skipped, each saying so, where wgpu has no adapter.
//! The same cases run on CUDA in f32, f16 and bf16 in `tests/cuda/kernels.rs`.

mod common;
mod kernel_cases;

use burn::tensor::FloatDType;
use common::{device, B};
use kernel_cases::GemmBaseline;

macro_rules! cases {
    ($($name:ident),*) => {
        $(
            #[test]
            fn $name() {
                if !common::needs_wgpu() {
                    return;
                }
                for dtype in [FloatDType::F32, FloatDType::F16] {
                    kernel_cases::$name::<B>(dtype, &device());
                }
            }
        )*
    };
}

cases!(
    rms_norm,
    add_rms_norm,
    swiglu,
    gelu,
    rope,
    cross_entropy,
    embedding,
    adamw,
    add_as_f32,
    scale,
    sum_f32,
    sum_squares,
    format_stats,
    format_probe,
    dropout,
    flash_attention_strided
);

/// The chunked LM-head loss: the first three cases of the CUDA suite's (Burn autotunes its matmul
/// for every new shape, seconds each on lavapipe).
#[test]
fn linear_cross_entropy() {
    if !common::needs_wgpu() {
        return;
    }
    for dtype in [FloatDType::F32, FloatDType::F16] {
        kernel_cases::linear_cross_entropy_cases::<B>(
            dtype,
            &device(),
            &kernel_cases::LINEAR_CE_CASES[..3],
        );
    }
}

/// The f32-output GEMM with and without an accumulator (Burn's matmul here).
#[test]
fn gemm_f32() {
    if !common::needs_wgpu() {
        return;
    }
    for dtype in [FloatDType::F32, FloatDType::F16] {
        kernel_cases::gemm_f32::<B>(
            dtype,
            &device(),
            kernels::Gemm::Auto,
            &[[7, 13, 5], [64, 100, 33]],
        );
    }
}

#[test]
fn linear_cross_entropy_refuses_mismatched_widths() {
    if !common::needs_wgpu() {
        return;
    }
    common::assert_panics_with(
        "kernels::linear_cross_entropy: x is [4, 8] and w is [5, 6]",
        || {
            let dev = device();
            let x = burn::tensor::Tensor::<B, 2>::zeros([4, 8], &dev);
            let w = burn::tensor::Tensor::<B, 2>::zeros([5, 6], &dev);
            let t = burn::tensor::Tensor::<B, 1, burn::tensor::Int>::zeros([4], &dev);
            let _ = kernels::linear_cross_entropy(x, w, t, Default::default());
        },
    );
}

#[test]
fn format_stats_refuses_a_negative_threshold() {
    if !common::needs_wgpu() {
        return;
    }
    common::assert_panics_with(
        "kernels::format_stats: min_normal is -1; it must be finite and not negative",
        || {
            let dev = device();
            let x = burn::tensor::Tensor::<B, 2>::zeros([3, 8], &dev);
            let _ = kernels::format_stats(x, -1.0);
        },
    );
}

/// The linear layers whose input is recomputed in the backward equal their compositions bit for
/// bit (the portable GEMM; few sizes, as for `gemm`).
#[test]
fn recomputed_linear() {
    if !common::needs_wgpu() {
        return;
    }
    for dtype in [FloatDType::F32, FloatDType::F16] {
        kernel_cases::recomputed_linear::<B>(
            dtype,
            &device(),
            kernels::Gemm::Auto,
            &kernel_cases::RECOMPUTE_SIZES[1..3],
        );
    }
}

/// The GELU MLP op on the portable path (its composition) against the reference: two sizes, as
/// for `gemm` (the CUDA suite runs the epilogues at every size).
#[test]
fn gelu_tanh_mlp() {
    if !common::needs_wgpu() {
        return;
    }
    for dtype in [FloatDType::F32, FloatDType::F16] {
        kernel_cases::gelu_tanh_mlp::<B>(
            dtype,
            &device(),
            kernels::Gemm::Auto,
            &kernel_cases::MLP_SIZES[..2],
        );
    }
}

/// The portable GEMM path (`Gemm::Auto` resolves to Burn's matmul on wgpu) and its backward: the
/// transpose flags and the gradient formulas. Few sizes, because Burn autotunes its matmul for
/// every new shape and layout, which takes seconds each on lavapipe; the CUDA suite runs them all.
#[test]
fn gemm() {
    if !common::needs_wgpu() {
        return;
    }
    kernel_cases::gemm::<B>(
        FloatDType::F32,
        &device(),
        kernels::Gemm::Auto,
        GemmBaseline::BurnMatmul,
        &[[7, 13, 5], [123, 64, 77]],
    );
    kernel_cases::gemm::<B>(
        FloatDType::F16,
        &device(),
        kernels::Gemm::Auto,
        GemmBaseline::BurnMatmul,
        &[[7, 13, 5]],
    );
    kernel_cases::gemm_strided::<B>(
        FloatDType::F32,
        &device(),
        kernels::Gemm::Auto,
        GemmBaseline::BurnMatmul,
    );
    let probe = burn::tensor::Tensor::<B, 2>::zeros([1, 1], &device());
    assert_eq!(
        kernels::gemm::gemm_path(&probe, kernels::Gemm::Auto),
        kernels::GemmPath::Burn
    );
}

#[test]
fn gemm_cublaslt_refuses_wgpu_tensors() {
    if !common::needs_wgpu() {
        return;
    }
    common::assert_panics_with("kernels::gemm: Gemm::CublasLt needs CUDA tensors", || {
        let dev = device();
        let a = burn::tensor::Tensor::<B, 2>::zeros([3, 8], &dev);
        let _ = kernels::gemm(a.clone(), a, false, true, kernels::Gemm::CublasLt);
    });
}

#[test]
fn gemm_refuses_mismatched_inner_dimensions() {
    if !common::needs_wgpu() {
        return;
    }
    common::assert_panics_with(
        "kernels::gemm: op(a) is [3, 8] and op(b) is [3, 8]: their inner dimensions 8 and 3 differ",
        || {
            let dev = device();
            let a = burn::tensor::Tensor::<B, 2>::zeros([3, 8], &dev);
            let _ = kernels::gemm(a.clone(), a, false, false, kernels::Gemm::Auto);
        },
    );
}

#[test]
fn flash_attention_lse() {
    if !common::needs_wgpu() {
        return;
    }
    for dtype in [FloatDType::F32, FloatDType::F16] {
        kernel_cases::flash_attention_lse::<B>(dtype, &device(), false);
    }
}

/// Sequence lengths 1, 17, 128, 1000, 2048 at head dims 64 and 128; batch and heads above 1 where
/// lavapipe's speed allows.
#[test]
fn flash_attention() {
    if !common::needs_wgpu() {
        return;
    }
    let shapes = [
        (2, 3, 1, 64),
        (2, 3, 17, 128),
        (2, 2, 128, 64),
        (1, 2, 128, 128),
        (1, 1, 1000, 64),
        (1, 1, 1000, 128),
        (1, 1, 2048, 64),
    ];
    for dtype in [FloatDType::F32, FloatDType::F16] {
        kernel_cases::flash_attention::<B>(dtype, &device(), &shapes, false);
    }
}

/// Dropout inside the portable kernels against the naive formula with the host's mask.
#[test]
fn flash_attention_dropout() {
    if !common::needs_wgpu() {
        return;
    }
    let shapes = [(2, 3, 17, 64), (1, 2, 128, 64), (1, 1, 300, 32)];
    for dtype in [FloatDType::F32, FloatDType::F16] {
        kernel_cases::flash_attention_dropout::<B>(dtype, &device(), &shapes, false);
    }
}

/// RoPE + FlashAttention of a packed projection, its gradient written packed (portable kernels).
#[test]
fn flash_attention_qkv() {
    if !common::needs_wgpu() {
        return;
    }
    let shapes = [(2, 17, 3, 64), (1, 40, 2, 32), (2, 5, 1, 16)];
    for dtype in [FloatDType::F32, FloatDType::F16] {
        kernel_cases::flash_attention_qkv::<B>(dtype, &device(), &shapes, false);
    }
}

/// Grouped-query attention on the portable kernels: 6 query heads over 2 and over 1 k/v heads
/// (and 3 over 1 at head_dim 8), odd lengths, fewer queries than keys; output and dQ, dK, dV, full
/// and causal, with and without dropout. (No case of a single causal query: its dQ is exactly 0,
/// and with dropout the kernels' `delta` from the rounded output leaves f16 rounding there, as
/// without grouping.)
#[test]
fn flash_attention_gqa() {
    if !common::needs_wgpu() {
        return;
    }
    let cases = [
        (2, 6, 2, 37, 37, 32),
        (1, 6, 1, 37, 37, 64),
        (1, 6, 2, 17, 40, 16),
        (2, 3, 1, 5, 9, 8),
    ];
    for dtype in [FloatDType::F32, FloatDType::F16] {
        kernel_cases::flash_attention_gqa::<B>(dtype, &device(), &cases, false);
    }
}

/// The packed projection with fewer k/v heads than q heads (`[B, T, (H + 2 Hkv) hd]`).
#[test]
fn flash_attention_qkv_gqa() {
    if !common::needs_wgpu() {
        return;
    }
    let shapes = [(2, 37, 6, 2, 32), (1, 19, 6, 1, 16)];
    for dtype in [FloatDType::F32, FloatDType::F16] {
        kernel_cases::flash_attention_qkv_gqa::<B>(dtype, &device(), &shapes, false);
    }
}

#[test]
fn flash_attention_refuses_kv_heads_not_dividing_heads() {
    if !common::needs_wgpu() {
        return;
    }
    common::assert_panics_with(
        "kernels::flash_attention: k has 4 heads, which does not divide q's 6",
        || {
            let dev = device();
            let q = burn::tensor::Tensor::<B, 4>::zeros([1, 6, 8, 16], &dev);
            let k = burn::tensor::Tensor::<B, 4>::zeros([1, 4, 8, 16], &dev);
            let _ = kernels::flash_attention(q, k.clone(), k, false, None);
        },
    );
    common::assert_panics_with(
        "kernels::flash_attention_qkv: k has 4 heads, which does not divide q's 6",
        || {
            let dev = device();
            let qkv = burn::tensor::Tensor::<B, 3>::zeros([1, 8, (6 + 2 * 4) * 16], &dev);
            let (cos, sin) = kernels::rope::tables::<B>(8, 16, 10_000.0, &dev);
            let _ = kernels::flash_attention_qkv(qkv, 6, 4, cos, sin, true, None, None);
        },
    );
}

/// The references refuse the same (Burn's CPU backend runs them).
#[test]
fn flash_attention_reference_refuses_kv_heads_not_dividing_heads() {
    type Cpu = burn::backend::NdArray;
    common::assert_panics_with(
        "kernels::flash_attention: k has 4 heads, which does not divide q's 6",
        || {
            let dev = Default::default();
            let q = burn::tensor::Tensor::<Cpu, 4>::zeros([1, 6, 8, 16], &dev);
            let k = burn::tensor::Tensor::<Cpu, 4>::zeros([1, 4, 8, 16], &dev);
            let _ = kernels::flash_attention(q, k.clone(), k, false, None);
        },
    );
}

#[test]
fn flash_attention_refuses_dropout_of_one() {
    if !common::needs_wgpu() {
        return;
    }
    common::assert_panics_with(
        "kernels::flash_attention: dropout p is 1; it must be in [0, 1)",
        || {
            let dev = device();
            let q = burn::tensor::Tensor::<B, 4>::zeros([1, 2, 8, 16], &dev);
            let d = kernels::Dropout::new(1.0, 3);
            let _ = kernels::flash_attention_dropout(q.clone(), q.clone(), q, false, None, d);
        },
    );
}

#[test]
fn flash_attention_refuses_a_negative_scale() {
    if !common::needs_wgpu() {
        return;
    }
    common::assert_panics_with(
        "kernels::flash_attention: the softmax scale is -0.25; it must be a positive, finite number",
        || {
        let dev = device();
        let q = burn::tensor::Tensor::<B, 4>::zeros([1, 2, 8, 16], &dev);
        let _ = kernels::flash_attention(q.clone(), q.clone(), q, false, Some(-0.25));
        },
    );
}

#[test]
fn flash_attention_refuses_mismatched_head_dims() {
    if !common::needs_wgpu() {
        return;
    }
    common::assert_panics_with(
        "kernels::flash_attention: q, k, v have shapes [1, 2, 8, 16], [1, 2, 8, 32], [1, 2, 8, 32]",
        || {
            let dev = device();
            let q = burn::tensor::Tensor::<B, 4>::zeros([1, 2, 8, 16], &dev);
            let k = burn::tensor::Tensor::<B, 4>::zeros([1, 2, 8, 32], &dev);
            let _ = kernels::flash_attention(q, k.clone(), k, false, None);
        },
    );
}

#[test]
fn rms_norm_refuses_a_mismatched_weight() {
    if !common::needs_wgpu() {
        return;
    }
    common::assert_panics_with(
        "kernels::rms_norm: weight has shape [5]; it must be [8]",
        || {
            let dev = device();
            let x = burn::tensor::Tensor::<B, 2>::zeros([3, 8], &dev);
            let w = burn::tensor::Tensor::<B, 1>::ones([5], &dev);
            let _ = kernels::rms_norm(x, w, 1e-5);
        },
    );
}

#[test]
fn rope_refuses_an_odd_head_dim() {
    if !common::needs_wgpu() {
        return;
    }
    common::assert_panics_with("kernels::rope: head_dim is 7; it must be even", || {
        let dev = device();
        let x = burn::tensor::Tensor::<B, 4>::zeros([1, 2, 3, 7], &dev);
        let (cos, sin) = kernels::rope::tables::<B>(3, 8, 10_000.0, &dev);
        let _ = kernels::rope(x, cos, sin);
    });
}

#[test]
fn cross_entropy_refuses_mismatched_targets() {
    if !common::needs_wgpu() {
        return;
    }
    common::assert_panics_with(
        "kernels::cross_entropy: targets have shape [4]; expected [3]",
        || {
            let dev = device();
            let logits = burn::tensor::Tensor::<B, 2>::zeros([3, 10], &dev);
            let targets = burn::tensor::Tensor::<B, 1, burn::tensor::Int>::zeros([4], &dev);
            let _ = kernels::cross_entropy(logits, targets, 0.0);
        },
    );
}

/// Values from a fixed linear congruential sequence: `n` integers in -7..=7 over 4 (each exact in
/// e4m3 under the scale 1.75 / 448 = 2^-8), every `block`-th row of `cols` starting with 1.75 so
/// that each block of rows has that scale.
fn fp8_exact_values(n: usize, cols: usize, block: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|i| {
            if i % (block * cols) == 0 {
                return 1.75;
            }
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % 15) as f32 / 4.0 - 1.75
        })
        .collect()
}

/// The FP8 attention forward's reference (`kernels::attention::reference_fp8`, what the CUDA suite
/// holds the FP8 kernel to) on Burn's CPU backend: `fp8_blocks` keeps each value within e4m3's
/// rounding under its own block's scale, and on inputs that quantize exactly the output differs
/// from exact attention by P's e4m3 rounding only (and does differ), the log-sum-exp not at all.
#[test]
fn fp8_attention_reference_on_the_cpu() {
    use burn::tensor::{Distribution, Tensor, TensorData};
    type Cpu = burn::backend::NdArray;
    let dev = Default::default();
    let to_vec = |t: Tensor<Cpu, 4>| t.into_data().convert::<f32>().into_vec::<f32>().unwrap();

    // [1, 2, 200, 16] in blocks of 64 rows: the second block 1000x smaller than the others, the
    // third of head 1 zeros, the fourth partial.
    let (heads, seq, hd, rows) = (2, 200, 16, 64);
    let mut factor = vec![1f32; heads * seq];
    for h in 0..heads {
        for r in 0..seq {
            factor[h * seq + r] = match r / rows {
                1 => 1e-3,
                2 if h == 1 => 0.0,
                _ => 1.0,
            };
        }
    }
    let factor = Tensor::<Cpu, 4>::from_data(TensorData::new(factor, [1, heads, seq, 1]), &dev);
    let x = Tensor::<Cpu, 4>::random([1, heads, seq, hd], Distribution::Normal(0.0, 1.0), &dev)
        * factor;
    let y = to_vec(kernels::attention::fp8_blocks(x.clone(), rows));
    let x = to_vec(x);
    let mut changed = 0;
    for (p, pair) in x.chunks(seq * hd).enumerate() {
        for (b, block) in pair.chunks(rows * hd).enumerate() {
            let scale = block.iter().fold(0f32, |m, v| m.max(v.abs())) / 448.0;
            for (i, &v) in block.iter().enumerate() {
                let got = y[p * seq * hd + b * rows * hd + i];
                // Half an ulp: 2^-4 relative among e4m3's normals, 2^-10 of the scale below them.
                let bound = (v.abs() * 2f32.powi(-4)).max(scale * 2f32.powi(-10)) * 1.0001;
                assert!(
                    (got - v).abs() <= bound,
                    "fp8_blocks: pair {p}, block {b}, element {i}: {v} became {got} (bound {bound:e})"
                );
                changed += usize::from(got != v);
            }
        }
    }
    assert!(changed > 0, "fp8_blocks changed no value of normal inputs");

    for causal in [false, true] {
        let (b, h, kv_heads, s) = (2, 4, 2, 100);
        let q = fp8_exact_values(b * h * s * hd, hd, 64, 1 + causal as u64);
        let k = fp8_exact_values(b * kv_heads * s * hd, hd, 128, 3);
        let v = fp8_exact_values(b * kv_heads * s * hd, hd, 128, 4);
        let q = Tensor::<Cpu, 4>::from_data(TensorData::new(q, [b, h, s, hd]), &dev);
        let k = Tensor::<Cpu, 4>::from_data(TensorData::new(k, [b, kv_heads, s, hd]), &dev);
        let v = Tensor::<Cpu, 4>::from_data(TensorData::new(v, [b, kv_heads, s, hd]), &dev);
        let (out, lse) =
            kernels::attention::reference_fp8(q.clone(), k.clone(), v.clone(), causal, None);
        let exact = kernels::attention::reference(q.clone(), k.clone(), v, causal, None);
        let exact_lse = kernels::attention::reference_lse(q, k, causal, None);
        let diff = to_vec(out - exact).iter().fold(0f32, |m, d| m.max(d.abs()));
        // Each term of P off by at most 2^-4 of itself, the values at most 1.75.
        assert!(
            diff > 0.0 && diff <= 1.75 * 2f32.powi(-4),
            "reference_fp8 (causal {causal}) differs from exact attention by {diff}: expected P's \
             e4m3 rounding only, (0, {}]",
            1.75 * 2f32.powi(-4)
        );
        let lse_diff = (lse - exact_lse).abs().max().into_scalar();
        assert!(
            lse_diff <= 1e-5,
            "reference_fp8 (causal {causal}): its lse is off by {lse_diff}"
        );
    }
}
