//! [`super::GemmOps`] on `CubeBackend`: cuBLASLt for CUDA tensors, Burn's matmul otherwise.

use burn::tensor::ops::FloatTensor;
use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::cuda::CudaRuntime;

use super::{burn_only, cublaslt, Gemm, GemmPath};
use crate::check::fail;

/// `a` and `b` as CUDA tensors when `engine` sends them to cuBLASLt, `None` for Burn's matmul:
/// `engine` is `Burn`, or they are not CUDA tensors (an error for an explicit `CublasLt`, as is an
/// explicit `CublasLt` without the library).
fn cublaslt_operands<'t, R: CubeRuntime>(
    op: &str,
    a: &'t CubeTensor<R>,
    b: &'t CubeTensor<R>,
    engine: Gemm,
) -> Option<(&'t CubeTensor<CudaRuntime>, &'t CubeTensor<CudaRuntime>)> {
    if engine == Gemm::Burn {
        return None;
    }
    let (Some(ca), Some(cb)) = (cublaslt::as_cuda(a), cublaslt::as_cuda(b)) else {
        burn_only(engine, a.dtype);
        return None;
    };
    if engine == Gemm::CublasLt {
        if let Err(why) = cublaslt::library() {
            fail(op, format!("Gemm::CublasLt: {why}"));
        }
    }
    Some((ca, cb))
}

/// [`super::GemmOps::gemm`] on `CubeBackend`: cuBLASLt for CUDA tensors unless `engine` is `Burn`.
pub(crate) fn cube<R, F, I, BT>(
    a: CubeTensor<R>,
    b: CubeTensor<R>,
    trans_a: bool,
    trans_b: bool,
    engine: Gemm,
) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    if let Some((ca, cb)) = cublaslt_operands("gemm", &a, &b, engine) {
        match cublaslt::gemm(ca.clone(), cb.clone(), trans_a, trans_b) {
            Ok(out) => return cublaslt::from_cuda(out),
            Err(cublaslt::Refused::Unsupported(why)) => cublaslt::fell_back(format!(
                "kernels::gemm: {why}; this GEMM runs on Burn's matmul instead"
            )),
            Err(cublaslt::Refused::NotApplicable) => {}
        }
    }
    crate::primitive::prim(super::reference::<CubeBackend<R, F, I, BT>>(
        crate::primitive::tensor(a),
        crate::primitive::tensor(b),
        trans_a,
        trans_b,
    ))
}

/// [`super::GemmOps::gemm_f32`] on `CubeBackend`: cuBLASLt for CUDA tensors unless `engine` is
/// `Burn`.
pub(crate) fn cube_f32<R, F, I, BT>(
    a: CubeTensor<R>,
    b: CubeTensor<R>,
    trans_a: bool,
    trans_b: bool,
    mut acc: Option<CubeTensor<R>>,
    engine: Gemm,
) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    if let Some((ca, cb)) = cublaslt_operands("gemm_f32", &a, &b, engine) {
        // The accumulator is on the same runtime as `a`: CUDA.
        let cacc = acc
            .take()
            .map(|c| cublaslt::into_cuda(c).expect("the accumulator is on a's runtime: CUDA"));
        // An accumulator something else still holds is not written in place: the product is
        // added to it instead.
        let shared = cacc.as_ref().is_some_and(|c| !c.can_mut());
        let (into, add) = if shared { (None, cacc) } else { (cacc, None) };
        match cublaslt::gemm_f32(ca.clone(), cb.clone(), trans_a, trans_b, into) {
            Ok(out) => {
                let out = crate::primitive::tensor::<CubeBackend<R, F, I, BT>, 2>(
                    cublaslt::from_cuda(out),
                );
                return crate::primitive::prim(match add {
                    Some(c) => crate::primitive::tensor(cublaslt::from_cuda(c)) + out,
                    None => out,
                });
            }
            Err((why, back)) => {
                if let cublaslt::Refused::Unsupported(why) = why {
                    cublaslt::fell_back(format!(
                        "kernels::gemm_f32: {why}; this GEMM runs on Burn's matmul instead"
                    ));
                }
                acc = back.or(add).map(cublaslt::from_cuda);
            }
        }
    }
    crate::primitive::prim(super::reference_f32::<CubeBackend<R, F, I, BT>>(
        crate::primitive::tensor(a),
        crate::primitive::tensor(b),
        trans_a,
        trans_b,
        acc.map(crate::primitive::tensor),
    ))
}

/// [`super::GemmOps::gemm_path`] on `CubeBackend`.
pub(crate) fn cube_path<R: CubeRuntime>(a: &CubeTensor<R>, engine: Gemm) -> GemmPath {
    if engine == Gemm::Burn {
        return GemmPath::Burn;
    }
    if cublaslt::as_cuda(a).is_none() {
        return burn_only(engine, a.dtype);
    }
    if !matches!(a.dtype, DType::F32 | DType::F16 | DType::BF16) {
        return GemmPath::Burn;
    }
    match cublaslt::library() {
        Ok(_) => match cublaslt::effective_order() {
            cublaslt::Order::Host => GemmPath::CublasLtHostSync,
            cublaslt::Order::Stream => GemmPath::CublasLtStreamOrdered,
            cublaslt::Order::Same => GemmPath::CublasLtSameStream,
        },
        Err(why) if engine == Gemm::CublasLt => fail("gemm", format!("Gemm::CublasLt: {why}")),
        Err(_) => GemmPath::Burn,
    }
}

impl<R, F, I, BT> super::GemmOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn gemm(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        trans_a: bool,
        trans_b: bool,
        engine: Gemm,
    ) -> FloatTensor<Self> {
        cube::<R, F, I, BT>(a, b, trans_a, trans_b, engine)
    }
    fn gemm_f32(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        trans_a: bool,
        trans_b: bool,
        acc: Option<FloatTensor<Self>>,
        engine: Gemm,
    ) -> FloatTensor<Self> {
        cube_f32::<R, F, I, BT>(a, b, trans_a, trans_b, acc, engine)
    }
    fn gemm_path(a: &FloatTensor<Self>, engine: Gemm) -> GemmPath {
        cube_path(a, engine)
    }
}
