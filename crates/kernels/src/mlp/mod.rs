//! The GELU MLP `gelu_tanh(x w_fc) w_proj` as one op, with GELU's tanh approximation inside the
//! GEMMs on cuBLASLt.
//!
//! Composed of a GEMM, the activation kernel and a GEMM, the block's largest activations (`[t,
//! ff]`) take extra passes: the activation reads the pre-activation `h = x w_fc` back and writes
//! `gelu(h)` (forward), and its backward reads the gradient `dg = dy w_proj^T` back with `h` and
//! writes `dh` (backward). On cuBLASLt both go into the GEMMs' epilogues, as Transformer Engine's
//! `LayerNormMLP` does:
//! - forward: `c_fc` writes `gelu(h)` and `h` from its f32 accumulator (`CUBLASLT_EPILOGUE_GELU_AUX`);
//! - backward: `proj`'s input gradient writes `dg * gelu'(h)` from its f32 accumulator, reading
//!   `h` (`CUBLASLT_EPILOGUE_DGELU`).
//!
//! The values are those of the composition up to where it rounds: the composition rounds `h`
//! before the GELU and `dg` before the derivative's product, the epilogues take both from f32.
//! cuBLASLt's GELU is the tanh form, so only [`crate::gelu_tanh`] has this op. The epilogues run
//! in f16 and bf16; f32 (the accurate reference recipe) keeps the activation kernels' GELU, as
//! the composition does.
//!
//! What the backward keeps: `x`, `h` and `gelu(h)` (with the weights), as the composition keeps
//! them. Where cuBLASLt refuses an epilogue (the rows of `h`, `ff` elements, not a multiple of 8;
//! no algorithm), that step runs as the composition does: the GEMM, then the activation kernel
//! (a refused algorithm with a one-line warning, counted in
//! [`crate::gemm::cublaslt_fallbacks_on_this_thread`]). On other backends, and on `CubeBackend`
//! where the GEMMs are not on cuBLASLt, the op is the composition.

mod backward;
mod epilogue;

pub use epilogue::calls_on_this_thread as epilogue_calls_on_this_thread;

use burn::tensor::ops::FloatTensor;
use burn::tensor::Tensor;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::activation::{ActivationKernels, ActivationOps, GeluForm};
use crate::check::{check_float, fail};
use crate::gemm::{Gemm, GemmOps};
use crate::primitive::{prim, tensor};

/// The MLP op on a backend ([`gelu_tanh_mlp`]). The default runs the composition of the crate's
/// GEMM and activation; `CubeBackend` and `Autodiff` over it put the activation into the GEMMs'
/// epilogues on cuBLASLt.
pub trait MlpOps: GemmOps + ActivationOps {
    /// [`gelu_tanh_mlp`]; the composition by default.
    fn fused_gelu_tanh_mlp(
        x: FloatTensor<Self>,
        w_fc: FloatTensor<Self>,
        w_proj: FloatTensor<Self>,
        engine: Gemm,
    ) -> FloatTensor<Self> {
        composition::<Self>(x, w_fc, w_proj, engine)
    }
}

/// `gelu_tanh(x w_fc) w_proj` for `x [t, d]`, `w_fc [d, ff]`, `w_proj [ff, out]` (one float
/// dtype), its GEMMs on `engine`: the GELU MLP without biases as one op (see the module docs).
/// Differentiable; the gradients are those of [`composed`], to the roundings the module docs
/// name.
///
/// # Panics
/// If the shapes do not chain (naming them), or the dtypes differ.
pub fn gelu_tanh_mlp<B: MlpOps>(
    x: Tensor<B, 2>,
    w_fc: Tensor<B, 2>,
    w_proj: Tensor<B, 2>,
    engine: Gemm,
) -> Tensor<B, 2> {
    let op = "gelu_tanh_mlp";
    let ([t, d], [fc_in, ff], [proj_in, out]) = (x.dims(), w_fc.dims(), w_proj.dims());
    if fc_in != d || proj_in != ff {
        fail(
            op,
            format!(
                "x is [{t}, {d}], w_fc [{fc_in}, {ff}] and w_proj [{proj_in}, {out}]; expected w_fc [{d}, ff] and w_proj [ff, out]"
            ),
        );
    }
    check_float(op, "x", x.dtype());
    if x.dtype() != w_fc.dtype() || x.dtype() != w_proj.dtype() {
        fail(
            op,
            format!(
                "x is {:?}, w_fc {:?} and w_proj {:?}; cast them to one dtype",
                x.dtype(),
                w_fc.dtype(),
                w_proj.dtype()
            ),
        );
    }
    tensor(B::fused_gelu_tanh_mlp(
        prim(x),
        prim(w_fc),
        prim(w_proj),
        engine,
    ))
}

/// The composition the op equals: [`crate::gemm`], [`crate::gelu_tanh`], [`crate::gemm`].
pub fn composed<B: GemmOps + ActivationOps>(
    x: Tensor<B, 2>,
    w_fc: Tensor<B, 2>,
    w_proj: Tensor<B, 2>,
    engine: Gemm,
) -> Tensor<B, 2> {
    let h = crate::gemm::gemm(x, w_fc, false, false, engine);
    let g = tensor(B::fused_gelu(prim(h), GeluForm::Tanh));
    crate::gemm::gemm(g, w_proj, false, false, engine)
}

/// [`composed`] on a backend's primitives.
fn composition<B: GemmOps + ActivationOps>(
    x: FloatTensor<B>,
    w_fc: FloatTensor<B>,
    w_proj: FloatTensor<B>,
    engine: Gemm,
) -> FloatTensor<B> {
    prim(composed::<B>(
        tensor(x),
        tensor(w_fc),
        tensor(w_proj),
        engine,
    ))
}

/// The plain-Burn op: Burn's matmul and the tanh GELU's reference.
pub fn reference<B: burn::tensor::backend::Backend>(
    x: Tensor<B, 2>,
    w_fc: Tensor<B, 2>,
    w_proj: Tensor<B, 2>,
) -> Tensor<B, 2> {
    crate::activation::gelu_tanh_reference(x.matmul(w_fc)).matmul(w_proj)
}

/// `gelu_tanh(x w_fc)` and, with `keep_input`, `x w_fc`: on cuBLASLt with the GELU in the
/// epilogue where it takes it, otherwise the GEMM and the activation kernel.
fn fc_forward<R, F, I, BT>(
    x: CubeTensor<R>,
    w_fc: CubeTensor<R>,
    engine: Gemm,
    keep_input: bool,
) -> (CubeTensor<R>, Option<CubeTensor<R>>)
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    if let Some(gh) = epilogue::gemm_gelu(&x, &w_fc, engine, keep_input) {
        return gh;
    }
    type B<R, F, I, BT> = CubeBackend<R, F, I, BT>;
    let h = B::<R, F, I, BT>::gemm(x, w_fc, false, false, engine);
    let g = B::<R, F, I, BT>::gelu_form_forward(h.clone(), GeluForm::Tanh);
    (g, keep_input.then_some(h))
}

/// The op's forward with nothing kept for a backward: on cuBLASLt the GELU alone in the first
/// GEMM's epilogue (the pre-activation is not written).
fn fprop<R, F, I, BT>(
    x: CubeTensor<R>,
    w_fc: CubeTensor<R>,
    w_proj: CubeTensor<R>,
    engine: Gemm,
) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let (g, _) = fc_forward::<R, F, I, BT>(x, w_fc, engine, false);
    CubeBackend::<R, F, I, BT>::gemm(g, w_proj, false, false, engine)
}

impl<R, F, I, BT> MlpOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn fused_gelu_tanh_mlp(
        x: FloatTensor<Self>,
        w_fc: FloatTensor<Self>,
        w_proj: FloatTensor<Self>,
        engine: Gemm,
    ) -> FloatTensor<Self> {
        if !epilogue::on_cublaslt(&x, engine) {
            return composition::<Self>(x, w_fc, w_proj, engine);
        }
        fprop::<R, F, I, BT>(x, w_fc, w_proj, engine)
    }
}
