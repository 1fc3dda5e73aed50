//! Conversions between Burn's tensors and the rank-erased primitives that the op traits take:
//! the bottom of the crate, beside `launch.rs` and `check.rs`, which every op imports.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, Shape, Tensor, TensorMetadata, TensorPrimitive};

/// The float primitive inside `t`.
pub(crate) fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// A float primitive as a tensor of rank `D` (its shape must have `D` dimensions).
pub(crate) fn tensor<B: Backend, const D: usize>(p: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

/// A rank-erased primitive as a 2-D tensor [rows, last dim], with its original shape.
pub(crate) fn as_2d<B: Backend>(p: FloatTensor<B>) -> (Tensor<B, 2>, Shape) {
    let shape = p.shape();
    let cols = *shape.as_slice().last().unwrap_or(&1);
    let rows = shape.num_elements().checked_div(cols).unwrap_or(0);
    (
        Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(B::float_reshape(
            p,
            Shape::new([rows, cols]),
        ))),
        shape,
    )
}

/// The inverse of [`as_2d`]: `t` reshaped back to `shape`.
pub(crate) fn from_2d<B: Backend>(t: Tensor<B, 2>, shape: Shape) -> FloatTensor<B> {
    B::float_reshape(prim(t), shape)
}

/// The float dtype of a float tensor's `dtype` (f32 for any dtype that is not a float one).
pub fn float_dtype(dtype: DType) -> FloatDType {
    match dtype {
        DType::F64 => FloatDType::F64,
        DType::F16 => FloatDType::F16,
        DType::BF16 => FloatDType::BF16,
        _ => FloatDType::F32,
    }
}
