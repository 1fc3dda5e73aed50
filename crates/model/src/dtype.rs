//! Dtype boundaries of mixed-precision compute.
//!
//! Burn 0.21 neither checks nor promotes dtypes in binary ops or matmul: an f16 tensor added to an
//! f32 one reads the f32 bytes as f16 and silently returns garbage. The model therefore casts
//! explicitly at every boundary between the compute dtype and its f32 islands, and checks those
//! boundaries with [`debug_assert_dtype`] in debug builds (tests included).

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor};

/// Panics in debug builds when `t` is not of dtype `expected`, naming the boundary `at`.
#[track_caller]
pub fn debug_assert_dtype<B: Backend, const D: usize>(
    t: &Tensor<B, D>,
    expected: FloatDType,
    at: &str,
) {
    if cfg!(debug_assertions) {
        let got = t.dtype();
        assert!(
            got == DType::from(expected),
            "dtype boundary `{at}`: expected {expected:?}, got {got:?} (shape {:?})",
            t.dims()
        );
    }
}

/// Short lower-case name of a float dtype (`f32`, `bf16`, `f16`), as configs and logs spell it.
pub fn name(dt: FloatDType) -> &'static str {
    match dt {
        FloatDType::F64 => "f64",
        FloatDType::F32 | FloatDType::Flex32 => "f32",
        FloatDType::F16 => "f16",
        FloatDType::BF16 => "bf16",
    }
}
