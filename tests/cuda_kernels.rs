//! Fused kernels against their plain-Burn references on CUDA, in f32, f16 and bf16 (the same cases
//! as `tests/kernels.rs`, which runs f32 and f16 on wgpu). CUDA allocates odd row lengths pitched,
//! so these also check the kernels' handling of strides.

mod kernel_cases;

use burn::backend::cuda::CudaDevice;
use burn::backend::{Autodiff, Cuda};
use burn::tensor::FloatDType;

type B = Autodiff<Cuda>;

macro_rules! cases {
    ($($name:ident => $test:ident),*) => {
        $(
            #[test]
            #[ignore = "needs CUDA"]
            fn $test() {
                for dtype in [FloatDType::F32, FloatDType::F16, FloatDType::BF16] {
                    kernel_cases::$name::<B>(dtype, &CudaDevice::default());
                }
            }
        )*
    };
}

cases!(
    rms_norm => cuda_rms_norm,
    add_rms_norm => cuda_add_rms_norm,
    swiglu => cuda_swiglu,
    gelu => cuda_gelu,
    rope => cuda_rope,
    cross_entropy => cuda_cross_entropy,
    adamw => cuda_adamw
);
