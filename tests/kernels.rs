//! Fused kernels against their plain-Burn references on wgpu (lavapipe in CI), in f32 and f16.
//! The same cases run on CUDA in f32, f16 and bf16 in `tests/cuda_kernels.rs`.

mod common;
mod kernel_cases;

use burn::tensor::FloatDType;
use common::{device, B};

macro_rules! cases {
    ($($name:ident),*) => {
        $(
            #[test]
            fn $name() {
                for dtype in [FloatDType::F32, FloatDType::F16] {
                    kernel_cases::$name::<B>(dtype, &device());
                }
            }
        )*
    };
}

cases!(rms_norm, add_rms_norm, swiglu, gelu, rope, cross_entropy, adamw);

#[test]
#[should_panic(expected = "kernels::rms_norm: weight has shape [5]; it must be [8]")]
fn rms_norm_refuses_a_mismatched_weight() {
    let dev = device();
    let x = burn::tensor::Tensor::<B, 2>::zeros([3, 8], &dev);
    let w = burn::tensor::Tensor::<B, 1>::ones([5], &dev);
    let _ = kernels::rms_norm(x, w, 1e-5);
}

#[test]
#[should_panic(expected = "kernels::rope: head_dim is 7; it must be even")]
fn rope_refuses_an_odd_head_dim() {
    let dev = device();
    let x = burn::tensor::Tensor::<B, 4>::zeros([1, 2, 3, 7], &dev);
    let (cos, sin) = kernels::rope::tables::<B>(3, 8, 10_000.0, &dev);
    let _ = kernels::rope(x, cos, sin);
}

#[test]
#[should_panic(expected = "kernels::cross_entropy: targets have shape [4]; expected [3]")]
fn cross_entropy_refuses_mismatched_targets() {
    let dev = device();
    let logits = burn::tensor::Tensor::<B, 2>::zeros([3, 10], &dev);
    let targets = burn::tensor::Tensor::<B, 1, burn::tensor::Int>::zeros([4], &dev);
    let _ = kernels::cross_entropy(logits, targets, 0.0);
}
