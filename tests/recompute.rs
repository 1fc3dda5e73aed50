//! `model.recompute = "full"` and `"selective"` against `"none"` (the cases of
//! `tests/model_cases/recompute.rs`, which the CUDA suite runs too): the loss and every gradient
//! with every block recomputed, and with every second one. On the CPU (Burn's ndarray backend, f32,
//! multi-query attention) full recomputation on the reference ops and plain attention, and selective
//! recomputation on the fused ops' CPU versions, bit for bit; on wgpu (lavapipe in CI) with the fused kernels and
//! FlashAttention, dropout on, in f32 and f16.

mod common;
mod model_cases;

use burn::backend::ndarray::NdArrayDevice;
use burn::backend::{Autodiff, NdArray};
use burn::tensor::FloatDType;
use model::config::{AttentionKind, GemmKind, KernelsKind, MlpKind, RecomputeKind};
use model_cases::recompute::{recompute_matches, Case};
use model_cases::{Combo, AWKWARD, FUSED_CPU, REFERENCE};

const FUSED_FLASH: Combo = Combo {
    kernels: KernelsKind::Fused,
    attention: AttentionKind::Flash,
    gemm: GemmKind::Burn,
};

#[test]
fn recompute_matches_none_bit_for_bit_on_the_cpu() {
    let _guard = common::serial();
    // Full recomputation on the fused ops' CPU versions adds a stream's gradients in another
    // order: within the tolerance there.
    for (mlp, combo, exact) in [
        (MlpKind::Gelu, REFERENCE, RecomputeKind::Full),
        (MlpKind::Swiglu, REFERENCE, RecomputeKind::Full),
        (MlpKind::Gelu, FUSED_CPU, RecomputeKind::Selective),
        (MlpKind::Swiglu, FUSED_CPU, RecomputeKind::Selective),
    ] {
        let case = Case {
            mlp,
            combo,
            dtype: FloatDType::F32,
            dropout: 0.0,
            kv_heads: 1,
            shape: AWKWARD,
        };
        recompute_matches::<Autodiff<NdArray>>(case, &[exact], &NdArrayDevice::Cpu);
    }
}

#[test]
fn recompute_matches_none_with_the_fused_kernels_and_dropout() {
    if !common::needs_wgpu() {
        return;
    }
    let _guard = common::serial();
    for dtype in [FloatDType::F32, FloatDType::F16] {
        for mlp in [MlpKind::Gelu, MlpKind::Swiglu] {
            let case = Case {
                mlp,
                combo: FUSED_FLASH,
                dtype,
                dropout: 0.1,
                kv_heads: AWKWARD.heads,
                shape: AWKWARD,
            };
            recompute_matches::<common::B>(case, &[], &common::device());
        }
    }
}
