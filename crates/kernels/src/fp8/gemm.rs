//! The FP8 GEMM: which path a pair of operands takes, and the GEMM on it.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{FloatDType, Tensor, TensorPrimitive};

use super::*;
use crate::gemm::GemmOps;
use crate::settings::Fp8GemmChoice;

/// The tensor-core GEMM's cube shape ([`crate::settings::Settings::fp8_mma_shape`], else
/// [`MmaShape::DEFAULT`]).
pub(crate) fn mma_shape() -> MmaShape {
    crate::settings::read(|s| s.fp8_mma_shape).unwrap_or(MmaShape::DEFAULT)
}

/// The path [`fp8_gemm`] tries first for these operands on this backend
/// ([`crate::settings::Settings::fp8_gemm`], `BURNMIX_FP8_GEMM`, chooses):
/// - unset or `auto`: cuBLASLt where the device has its block-scaled FP8 GEMM (CUDA, Hopper,
///   cuBLASLt 12.9+), else the dequantize path;
/// - `cublaslt`: cuBLASLt wherever it applies;
/// - `mma`: the `mma.sync` tensor-core kernel where the device has it and both operands are E4M3
///   with 1x128 (or per-tensor) scales for `a` and 128x128 (or per-tensor) for `b`;
/// - `dequantize`: the dequantize path (the reference).
///
/// Operands a path does not take (shapes, formats) are computed on the dequantize path.
pub fn fp8_gemm_path<B: Fp8Ops + GemmOps>(a: &Fp8Tensor<B>, b: &Fp8Tensor<B>) -> Fp8GemmPath {
    match crate::settings::read(|s| s.fp8_gemm) {
        Fp8GemmChoice::Path(Fp8GemmPath::TensorCores) if mma_applies(a, b) => {
            Fp8GemmPath::TensorCores
        }
        Fp8GemmChoice::Path(Fp8GemmPath::TensorCores | Fp8GemmPath::Dequantize) => {
            Fp8GemmPath::Dequantize
        }
        Fp8GemmChoice::Path(Fp8GemmPath::CublasLt) => Fp8GemmPath::CublasLt,
        Fp8GemmChoice::Auto => {
            if B::fp8_cublaslt_supported(&a.payload.clone().into_primitive()) {
                Fp8GemmPath::CublasLt
            } else {
                Fp8GemmPath::Dequantize
            }
        }
    }
}

fn mma_applies<B: Fp8Ops + GemmOps>(a: &Fp8Tensor<B>, b: &Fp8Tensor<B>) -> bool {
    let e4m3 = a.spec.format == Fp8Format::E4M3 && b.spec.format == Fp8Format::E4M3;
    let tiles = matches!(
        a.spec.granularity,
        Fp8Granularity::Tile1x128 | Fp8Granularity::Tensor
    ) && matches!(
        b.spec.granularity,
        Fp8Granularity::Block128 | Fp8Granularity::Tensor
    );
    e4m3 && tiles && B::fp8_mma_supported(&a.payload.clone().into_primitive())
}

/// [`Backend::fp8_gemm_mma`] and [`Backend::fp8_gemm_cublaslt`].
type Fp8GemmFn<B> = fn(
    IntTensor<B>,
    FloatTensor<B>,
    &QuantSpec,
    IntTensor<B>,
    FloatTensor<B>,
    &QuantSpec,
    usize,
    usize,
    FloatDType,
) -> Option<FloatTensor<B>>;

/// `a [m, k] x b [n, k]^T -> [m, n]` in `out` dtype, from two matrices quantized along the same
/// `k`, on the path [`fp8_gemm_path`] names.
pub fn fp8_gemm<B: Fp8Ops + GemmOps>(
    a: &Fp8Tensor<B>,
    b: &Fp8Tensor<B>,
    out: FloatDType,
) -> Tensor<B, 2> {
    let path = fp8_gemm_path(a, b);
    // cuBLASLt's constraints (shapes, formats) are checked by trying; what it does not take is
    // computed on the dequantize path.
    fp8_gemm_on(a, b, out, path)
        .or_else(|| fp8_gemm_on(a, b, out, Fp8GemmPath::Dequantize))
        .expect("the dequantize path applies to every pair of operands")
}

/// [`fp8_gemm`] on a given path; `None` when the path does not apply to these operands here.
pub fn fp8_gemm_on<B: Fp8Ops + GemmOps>(
    a: &Fp8Tensor<B>,
    b: &Fp8Tensor<B>,
    out: FloatDType,
    path: Fp8GemmPath,
) -> Option<Tensor<B, 2>> {
    if a.k != b.k {
        panic!(
            "kernels::fp8_gemm: a is [{}, {}] and b is [{}, {}] (both [rows, k]); their reduction lengths k must match",
            a.rows, a.k, b.rows, b.k
        );
    }
    // The two FP8 tensor-core paths take the same operands.
    let fp8_path = match path {
        Fp8GemmPath::TensorCores => Some(B::fp8_gemm_mma as Fp8GemmFn<B>),
        Fp8GemmPath::CublasLt => Some(B::fp8_gemm_cublaslt as Fp8GemmFn<B>),
        Fp8GemmPath::Dequantize => None,
    };
    match fp8_path {
        Some(gemm) => gemm(
            a.payload.clone().into_primitive(),
            a.scales.clone().into_primitive().tensor(),
            &a.spec,
            b.payload.clone().into_primitive(),
            b.scales.clone().into_primitive().tensor(),
            &b.spec,
            a.rows,
            b.rows,
            out,
        )
        .map(|c| Tensor::from_primitive(TensorPrimitive::Float(c))),
        None => {
            // Code x power-of-two scale is exact in bf16; other scales need f32.
            let bf16 = out == FloatDType::BF16 && a.spec.pow2 && b.spec.pow2;
            let compute = if bf16 {
                FloatDType::BF16
            } else {
                FloatDType::F32
            };
            let k_pad = a.k_padded();
            let da = a.dequantize_to(k_pad, compute);
            let db = b.dequantize_to(k_pad, compute);
            Some(da.matmul(db.transpose()).cast(out))
        }
    }
}
