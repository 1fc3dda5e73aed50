//! The model with the engine's kernels against the reference model on wgpu (lavapipe in CI), with
//! the cases of `tests/model_cases` that the CUDA suite runs too: for one batch and one set of
//! weights, every `kernels` x `attention` combination gives the reference's loss and gradients
//! within what rounding in the precision allows; and 50 training steps of every combination track
//! the reference run of the same precision within the drift that rounding alone causes (f32 and
//! fp16; the fused AdamW step also writes the f16 compute copy). The tolerances are derived from
//! the precision, as `tests/model_cases/mod.rs` explains.

mod common;

use burn::tensor::FloatDType;
use common::{device, B};
use model::config::MlpKind;
use trainer::config::{DeviceKind, PrecisionKind};

mod model_cases;

/// The model-equivalence matrix of `tests/model_cases` (which the CUDA suite runs in f32, bf16 and
/// f16): every `kernels` x `attention` combination against the reference model at an awkward
/// shape, loss and every gradient, in f32 and f16 (wgpu has no bf16).
macro_rules! equivalence {
    ($($test:ident => $dtype:ident, $mlp:ident;)*) => {
        $(
            #[test]
            fn $test() {
                let _guard = common::serial();
                // lavapipe's f32 matmuls are true f32.
                model_cases::equivalence::<B>(FloatDType::$dtype, f64::powi(2.0, -24), MlpKind::$mlp, model_cases::AWKWARD, &device());
            }
        )*
    };
}

equivalence! {
    model_equivalence_f32_gelu => F32, Gelu;
    model_equivalence_f32_swiglu => F32, Swiglu;
    model_equivalence_f16_gelu => F16, Gelu;
    model_equivalence_f16_swiglu => F16, Swiglu;
    model_equivalence_f32_gelu_tanh => F32, GeluTanh;
    model_equivalence_f16_gelu_tanh => F16, GeluTanh;
}

/// 50 steps of every combination against the reference run of the same precision; the drift of
/// the reference run in fp16 from the one in f32 measures what rounding alone does on this device.
macro_rules! tracks {
    ($($test:ident => $precision:ident, $mlp:ident;)*) => {
        $(
            #[test]
            fn $test() {
                let _guard = common::serial();
                model_cases::training_tracks(
                    MlpKind::$mlp,
                    PrecisionKind::$precision,
                    &[PrecisionKind::Fp16],
                    DeviceKind::Wgpu,
                    &trainer::device::Selected::Wgpu,
                    &|name| common::scratch(&format!("wgpu_{name}")),
                );
            }
        )*
    };
}

tracks! {
    model_training_tracks_fp32_gelu => Fp32, Gelu;
    model_training_tracks_fp16_swiglu => Fp16, Swiglu;
}

/// `Gpt::decode` (generation with a KV cache written in place) against the full forward
/// (`tests/model_cases/decode.rs`) with the fused kernels and either attention, and with
/// FlashAttention on the reference kernels, in f32 and f16, with grouped-query attention (4 query
/// heads over 2 key/value heads) and without.
#[test]
fn decode_matches_the_full_forward() {
    use model::{AttentionKind, KernelsKind};
    let _guard = common::serial();
    model_cases::decode::each::<common::Inner>(
        &[
            (KernelsKind::Fused, AttentionKind::Flash, MlpKind::Swiglu, 2),
            (KernelsKind::Fused, AttentionKind::Plain, MlpKind::Gelu, 4),
            (
                KernelsKind::Reference,
                AttentionKind::Flash,
                MlpKind::Gelu,
                2,
            ),
        ],
        &[FloatDType::F32, FloatDType::F16],
        f64::powi(2.0, -24),
        &device(),
    );
}
