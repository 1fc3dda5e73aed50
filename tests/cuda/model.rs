//! The model-equivalence matrix on CUDA (see `tests/model_cases`): every `kernels` x `attention`
//! combination with either MLP against the reference model in f32, bf16 and f16, loss and every
//! gradient, at an awkward shape and at `shakespeare_char`'s, and 50 training steps of each
//! tracking the reference run.

use crate::common;
use crate::kernel_cases::{check, Input, FLOOR};
use crate::model_cases::{self, AWKWARD, SHAKESPEARE};

use burn::backend::cuda::CudaDevice;
use burn::backend::{Autodiff, Cuda};
use burn::tensor::FloatDType;
use model::config::{GemmKind, MlpKind};
use trainer::config::{DeviceKind, PrecisionKind};

type B = Autodiff<Cuda>;

/// Unit roundoff of CUDA's f32 matmuls, which run on TF32 tensor cores (10 explicit mantissa bits).
const TF32_UNIT_ROUNDOFF: f64 = 1.0 / 2048.0;

macro_rules! equivalence {
    ($($test:ident => $dtype:ident, $mlp:ident, $shape:ident;)*) => {
        $(
            #[test]
            #[ignore = "needs CUDA"]
            fn $test() {
                let _guard = common::serial();
                model_cases::equivalence::<B>(FloatDType::$dtype, TF32_UNIT_ROUNDOFF, MlpKind::$mlp, $shape, &CudaDevice::default());
            }
        )*
    };
}

equivalence! {
    cuda_model_equivalence_f32_gelu => F32, Gelu, AWKWARD;
    cuda_model_equivalence_f32_swiglu => F32, Swiglu, AWKWARD;
    cuda_model_equivalence_bf16_gelu => BF16, Gelu, AWKWARD;
    cuda_model_equivalence_bf16_swiglu => BF16, Swiglu, AWKWARD;
    cuda_model_equivalence_f16_gelu => F16, Gelu, AWKWARD;
    cuda_model_equivalence_f16_swiglu => F16, Swiglu, AWKWARD;
    cuda_model_equivalence_bf16_gelu_shakespeare_shape => BF16, Gelu, SHAKESPEARE;
    cuda_model_equivalence_bf16_gelu_tanh => BF16, GeluTanh, AWKWARD;
    cuda_model_equivalence_f16_gelu_tanh => F16, GeluTanh, AWKWARD;
}

macro_rules! equivalence_cublaslt {
    ($($test:ident => $dtype:ident, $mlp:ident, $shape:ident;)*) => {
        $(
            /// Every `kernels` x `attention` combination with the GEMMs on cuBLASLt against the
            /// reference model on Burn's matmul.
            #[test]
            #[ignore = "needs CUDA"]
            fn $test() {
                let _guard = common::serial();
                let epilogues = kernels::mlp::epilogue_calls_on_this_thread();
                model_cases::equivalence_of::<B>(
                    &model_cases::combos_on(GemmKind::Cublaslt),
                    FloatDType::$dtype,
                    TF32_UNIT_ROUNDOFF,
                    MlpKind::$mlp,
                    $shape,
                    &CudaDevice::default(),
                );
                crate::kernels::no_fallbacks("the models with their GEMMs on cuBLASLt");
                // The tanh-GELU blocks (no biases) run their MLP with the GELU in the GEMMs'
                // epilogues.
                if MlpKind::$mlp == MlpKind::GeluTanh {
                    assert!(
                        kernels::mlp::epilogue_calls_on_this_thread() > epilogues,
                        "the tanh-GELU models never ran the MLP's GEMM epilogues"
                    );
                }
            }
        )*
    };
}

equivalence_cublaslt! {
    cuda_model_equivalence_cublaslt_f32_swiglu => F32, Swiglu, AWKWARD;
    cuda_model_equivalence_cublaslt_bf16_gelu => BF16, Gelu, AWKWARD;
    cuda_model_equivalence_cublaslt_bf16_swiglu => BF16, Swiglu, AWKWARD;
    cuda_model_equivalence_cublaslt_f16_gelu => F16, Gelu, AWKWARD;
    cuda_model_equivalence_cublaslt_bf16_gelu_tanh => BF16, GeluTanh, AWKWARD;
    cuda_model_equivalence_cublaslt_f16_gelu_tanh => F16, GeluTanh, AWKWARD;
}

macro_rules! tracks {
    ($($test:ident => $precision:ident, $mlp:ident;)*) => {
        $(
            #[test]
            #[ignore = "needs CUDA"]
            fn $test() {
                let _guard = common::serial();
                let device = trainer::device::Selected::Cuda { index: 0, name: "test".into() };
                model_cases::training_tracks(
                    MlpKind::$mlp,
                    PrecisionKind::$precision,
                    &[PrecisionKind::Bf16, PrecisionKind::Fp16],
                    DeviceKind::Cuda,
                    &device,
                    &|name| common::scratch(&format!("cuda_{name}")),
                );
            }
        )*
    };
}

tracks! {
    cuda_model_training_tracks_fp32_gelu => Fp32, Gelu;
    cuda_model_training_tracks_fp32_swiglu => Fp32, Swiglu;
    cuda_model_training_tracks_bf16_gelu => Bf16, Gelu;
    cuda_model_training_tracks_bf16_swiglu => Bf16, Swiglu;
    cuda_model_training_tracks_fp16_gelu => Fp16, Gelu;
    cuda_model_training_tracks_fp16_swiglu => Fp16, Swiglu;
}

/// The model's plain attention on q and k rotated by the fused RoPE kernel against the same with
/// the reference RoPE, output and the packed projection's gradient; the shapes of the model cases
/// and of `shakespeare_char` (6 heads of 64, 256 positions, batch 64).
#[test]
#[ignore = "needs CUDA"]
fn cuda_plain_attention_after_fused_rope() {
    let dev = CudaDevice::default();
    for dtype in [FloatDType::BF16, FloatDType::F16] {
        for [b, h, t, hd] in [[2, 3, 67, 64], [64, 6, 256, 64]] {
            let (cos, sin) = kernels::rope::tables::<B>(t, hd, 10_000.0, &dev);
            let (c2, s2) = (cos.clone(), sin.clone());
            check::<B>(
                &format!("plain attention after RoPE [{b}, {h}, {t}, {hd}]"),
                dtype,
                FLOOR,
                vec![Input::act([b * t, 3 * h * hd], &dev)],
                |v| {
                    model_cases::plain_attention_after_rope(
                        v[0].clone(),
                        [b, h, t, hd],
                        c2.clone(),
                        s2.clone(),
                        true,
                    )
                },
                |v| {
                    model_cases::plain_attention_after_rope(
                        v[0].clone(),
                        [b, h, t, hd],
                        cos.clone(),
                        sin.clone(),
                        false,
                    )
                },
            );
        }
    }
}

/// `model.recompute = "full"` and `"selective"` against `"none"` (see
/// `tests/model_cases/recompute.rs`): the fused kernels and FlashAttention with dropout in bf16
/// and f32, and multi-query attention (3 query heads over 1 key/value head) in bf16; within twice
/// the run-to-run difference of the fused dQ's atomics plus a few roundings.
#[test]
#[ignore = "needs CUDA"]
fn cuda_recompute_matches_none() {
    use model::config::{AttentionKind, KernelsKind};
    use model_cases::recompute::{recompute_matches, Case};
    let _guard = common::serial();
    let fused = model_cases::Combo {
        kernels: KernelsKind::Fused,
        attention: AttentionKind::Flash,
        gemm: GemmKind::Cublaslt,
    };
    for (dtype, kv_heads, dropout) in [
        (FloatDType::BF16, AWKWARD.heads, 0.1),
        (FloatDType::F32, AWKWARD.heads, 0.1),
        (FloatDType::BF16, 1, 0.0),
    ] {
        for mlp in [MlpKind::Gelu, MlpKind::Swiglu] {
            let case = Case {
                mlp,
                combo: fused,
                dtype,
                dropout,
                kv_heads,
                shape: AWKWARD,
            };
            recompute_matches::<B>(case, &[], &CudaDevice::default());
        }
    }
}

/// `Gpt::decode` (generation with a KV cache written in place: FlashAttention over a view of the
/// cache, cuBLASLt GEMMs of a few rows) against the full forward (`tests/model_cases/decode.rs`),
/// with the fused kernels and either attention, in f32, bf16 and f16, with grouped-query attention
/// and without.
#[test]
#[ignore = "needs CUDA"]
fn cuda_decode_matches_the_full_forward() {
    use model::config::{AttentionKind, KernelsKind};
    let _guard = common::serial();
    let dev = CudaDevice::default();
    model_cases::decode::each::<Cuda>(
        &[
            (KernelsKind::Fused, AttentionKind::Flash, MlpKind::Swiglu, 2),
            (KernelsKind::Fused, AttentionKind::Flash, MlpKind::Gelu, 4),
            (KernelsKind::Fused, AttentionKind::Plain, MlpKind::Swiglu, 1),
            (
                KernelsKind::Reference,
                AttentionKind::Plain,
                MlpKind::Gelu,
                2,
            ),
        ],
        &[FloatDType::F32, FloatDType::BF16, FloatDType::F16],
        TF32_UNIT_ROUNDOFF,
        &dev,
    );
}

/// With the fused kernels and FP8 projections, the MLP as one op (the activation's output and
/// gradient quantized in the CUDA C++ kernel; GELU and SwiGLU blocks) against the MLP composed of
/// separate ops, at `shakespeare_char`'s shape (every FP8 GEMM on cuBLASLt): loss and every
/// gradient within a relative RMS difference of 2% (the two compute the activation with their own
/// `exp` and reciprocal or division; a value one bf16 unit apart moves its FP8 code at most one
/// step), with tile scales and with delayed per-tensor scaling (the kernel then also records the
/// activation's amaxes). With `BURNMIX_FP8_PAIR=fused` the activation's kernel runs in both: the
/// loss bit for bit, the gradients within 0.5% (the tied embedding's gradient sums with atomic
/// additions, in an order that varies). SwiGLU blocks also with `BURNMIX_FP8_SWIGLU_PRODUCER=off`
/// (SwiGLU's kernel, then the pair quantizer): the same bounds as with `fused`.
#[test]
#[ignore = "needs CUDA"]
fn cuda_fp8_mlp_in_the_model() {
    let _guard = common::serial();
    let dev = CudaDevice::default();
    // Each of `mlps` with tile and delayed scaling, the loss `exact` or within `tolerance`.
    let each = |mlps: &[MlpKind], exact: bool, tolerance: f64| {
        for &mlp in mlps {
            for delayed in [false, true] {
                model_cases::fp8_mlp::fused_mlp_matches_composed::<B>(
                    mlp,
                    FloatDType::BF16,
                    SHAKESPEARE,
                    delayed,
                    exact,
                    tolerance,
                    &dev,
                );
            }
        }
    };
    // The SwiGLU producer off: SwiGLU's kernel and the native pair quantizer in both, so the
    // loss bit for bit.
    let producer_off = kernels::settings::scoped(|s| s.fp8_swiglu_producer = false);
    each(&[MlpKind::Swiglu], true, 0.005);
    drop(producer_off);
    // As blocks run by default (GELU's and SwiGLU's producers on).
    each(&[MlpKind::Gelu, MlpKind::Swiglu], false, 0.02);
    let _settings = kernels::settings::scoped(|s| s.fp8_pair = Some(kernels::Fp8PairPath::Fused));
    each(&[MlpKind::Gelu, MlpKind::Swiglu], true, 0.005);
}
