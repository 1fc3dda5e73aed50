//! The MLP's two GEMMs with the GELU in cuBLASLt's epilogue, on `CubeBackend` tensors.

use std::cell::Cell;

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

use crate::gemm::cublaslt::{self, Epilogue, Refused};
use crate::gemm::{Gemm, GemmPath};

/// Whether `engine` runs GEMMs on tensors like `x` on cuBLASLt.
pub(super) fn on_cublaslt<R: CubeRuntime>(x: &CubeTensor<R>, engine: Gemm) -> bool {
    !matches!(crate::gemm::forward::cube_path(x, engine), GemmPath::Burn)
}

/// Whether the GELU goes into the GEMMs' epilogues for tensors like `x`: on cuBLASLt, in f16 and
/// bf16. f32, the accurate reference recipe, keeps the activation kernels' GELU.
fn takes_epilogue<R: CubeRuntime>(x: &CubeTensor<R>, engine: Gemm) -> bool {
    matches!(x.dtype, DType::F16 | DType::BF16) && on_cublaslt(x, engine)
}

thread_local! {
    /// cuBLASLt calls with a GELU epilogue that this thread issued.
    static CALLS: Cell<usize> = const { Cell::new(0) };
}

/// How many GEMMs with the GELU (forward) or its derivative (backward) in cuBLASLt's epilogue the
/// calling thread issued: tests read it to tell the epilogues from the composition's path, which
/// computes the same values.
pub fn calls_on_this_thread() -> usize {
    CALLS.with(|c| c.get())
}

fn issued() {
    CALLS.with(|c| c.set(c.get() + 1));
}

/// What a refused epilogue leaves to the caller: nothing for a problem the epilogue does not
/// apply to, a warning (counted) for one cuBLASLt has no algorithm for.
fn refused(why: Refused, what: &str) {
    if let Refused::Unsupported(why) = why {
        cublaslt::fell_back(format!(
            "kernels::gelu_tanh_mlp: {why}; {what} runs as a GEMM and the activation kernel instead"
        ));
    }
}

/// `gelu_tanh(x w)` and, with `keep_input`, `x w` from one cuBLASLt call, or `None` where cuBLASLt
/// does not take it.
#[allow(clippy::type_complexity)]
pub(super) fn gemm_gelu<R: CubeRuntime>(
    x: &CubeTensor<R>,
    w: &CubeTensor<R>,
    engine: Gemm,
    keep_input: bool,
) -> Option<(CubeTensor<R>, Option<CubeTensor<R>>)> {
    if !takes_epilogue(x, engine) {
        return None;
    }
    let (cx, cw) = (cublaslt::as_cuda(x)?, cublaslt::as_cuda(w)?);
    let epilogue = match keep_input {
        true => Epilogue::GeluAux,
        false => Epilogue::Gelu,
    };
    match cublaslt::gemm_epilogue(cx.clone(), cw.clone(), false, false, epilogue, None) {
        Ok((g, h)) => {
            issued();
            Some((cublaslt::from_cuda(g), h.map(cublaslt::from_cuda)))
        }
        Err(why) => {
            refused(why, "the forward's first projection");
            None
        }
    }
}

/// `(dy w^T) * gelu_tanh'(h)` from one cuBLASLt call, or `None` where cuBLASLt does not take it.
pub(super) fn gemm_dgelu<R: CubeRuntime>(
    dy: &CubeTensor<R>,
    w: &CubeTensor<R>,
    h: &CubeTensor<R>,
    engine: Gemm,
) -> Option<CubeTensor<R>> {
    if !takes_epilogue(dy, engine) {
        return None;
    }
    let (cdy, cw, ch) = (
        cublaslt::as_cuda(dy)?,
        cublaslt::as_cuda(w)?,
        cublaslt::as_cuda(h)?,
    );
    match cublaslt::gemm_epilogue(
        cdy.clone(),
        cw.clone(),
        false,
        true,
        Epilogue::DGelu,
        Some(ch.clone()),
    ) {
        Ok((dh, _)) => {
            issued();
            Some(cublaslt::from_cuda(dh))
        }
        Err(why) => {
            refused(why, "the backward's activation gradient");
            None
        }
    }
}
