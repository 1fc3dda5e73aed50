//! Argument checks shared by the launchers: what was given, what is supported.

use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

/// Panics with a message naming the op: `kernels::<op>: <msg>`.
#[track_caller]
pub(crate) fn fail(op: &str, msg: String) -> ! {
    panic!("kernels::{op}: {msg}")
}

/// The kernels read and write f32, f16 and bf16 (bf16 only where the device has it: CUDA).
#[track_caller]
pub(crate) fn check_float(op: &str, what: &str, dtype: DType) {
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        fail(
            op,
            format!("{what} has dtype {dtype:?}; supported: F32, F16, BF16"),
        );
    }
}

#[track_caller]
pub(crate) fn check_same_dtype(op: &str, a: &str, da: DType, b: &str, db: DType) {
    if da != db {
        fail(
            op,
            format!(
                "{a} is {da:?} but {b} is {db:?}; they must have the same dtype (cast one first)"
            ),
        );
    }
}

/// Fails unless the attention softmax scale is positive and finite (the FlashAttention kernels
/// take the row maximum of the unscaled scores).
#[track_caller]
pub(crate) fn check_scale(op: &str, scale: f64) {
    if !(scale > 0.0 && scale.is_finite()) {
        fail(
            op,
            format!("the softmax scale is {scale}; it must be a positive, finite number (the usual one is 1 / sqrt(head_dim))"),
        );
    }
}

/// Refuses a `factor` that is not one element.
pub(crate) fn check_factor<R: CubeRuntime>(op: &str, factor: &CubeTensor<R>) {
    if factor.shape().num_elements() != 1 {
        fail(
            op,
            format!(
                "factor has shape {:?}; expected one element",
                factor.shape().as_slice()
            ),
        );
    }
}
