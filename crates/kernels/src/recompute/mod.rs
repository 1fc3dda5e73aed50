//! Linear layers whose input is computed again in the backward instead of kept: the GEMM after an
//! RMSNorm (`x W` with `x = rms_norm(s)`) and the GEMM after an activation (`x = swiglu(h)` or
//! `gelu(h)`). This is selective activation recomputation (`model.recompute = "selective"`).
//!
//! A plain `linear(rms_norm(s), W)` keeps two tensors of the same size for the backward: `s` (the
//! norm's backward reads it) and the norm's output `x` (the weight gradient `x^T dy` reads it). The
//! ops here keep only what the producer's backward keeps anyway (`s`; the activation's input `h`)
//! and, when the weight gradient is taken, run the producer's forward kernel once more on it. That
//! kernel on that input writes the same bits as in the forward, so the gradients are those of the
//! plain composition, bit for bit, at the cost of one memory-bound pass (`x` is `tokens x width`
//! for a norm, `tokens x d_ff` for the activation: the largest tensor of a SwiGLU block).
//!
//! On `Autodiff` over `CubeBackend` the producer and the GEMM are two autodiff nodes, as in the
//! plain composition, the GEMM's state holding the producer's input in place of its own. Every
//! other backend (`NdArray`, and `CubeBackend` without autodiff) runs the plain composition:
//! without a backward there is nothing to keep.

pub(crate) mod backward;

use burn::tensor::ops::FloatTensor;
use burn::tensor::Tensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::activation::{ActivationOps, GeluForm};
use crate::check::fail;
use crate::gemm::{Gemm, GemmOps};
use crate::primitive::{prim, tensor};
use crate::rms_norm::RmsNormOps;

/// The activation before a GEMM whose input is recomputed ([`activation_linear`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `silu(gate) * up` of a packed `[rows, 2 F]` input (gate first): [`crate::swiglu_packed`].
    SwigluPacked,
    /// Exact GELU: [`crate::gelu`].
    Gelu,
    /// GELU's tanh approximation: [`crate::gelu_tanh`].
    GeluTanh,
}

impl Activation {
    /// The GELU's form, or `None` for SwiGLU.
    pub(crate) fn gelu_form(self) -> Option<GeluForm> {
        match self {
            Activation::SwigluPacked => None,
            Activation::Gelu => Some(GeluForm::Exact),
            Activation::GeluTanh => Some(GeluForm::Tanh),
        }
    }
}

/// The ops of this module on a backend. The defaults run the plain composition of the fused ops;
/// `Autodiff` over `CubeBackend` overrides them to keep the producer's input only.
pub trait RecomputeOps: RmsNormOps + ActivationOps + GemmOps {
    /// `(s, rms_norm(s) W)` with `s = x + residual` when `residual` is given (`None` for `s`
    /// otherwise: it is `x`).
    fn fused_rms_norm_linear(
        x: FloatTensor<Self>,
        residual: Option<FloatTensor<Self>>,
        gain: FloatTensor<Self>,
        eps: f64,
        w: FloatTensor<Self>,
        engine: Gemm,
    ) -> (Option<FloatTensor<Self>>, FloatTensor<Self>) {
        let (s, y) = match residual {
            Some(r) => {
                let (s, y) = Self::fused_add_rms_norm(x, r, gain, eps);
                (Some(s), y)
            }
            None => (None, Self::fused_rms_norm(x, gain, eps)),
        };
        (s, Self::gemm(y, w, false, false, engine))
    }

    /// `activation(h) W`.
    fn fused_activation_linear(
        h: FloatTensor<Self>,
        activation: Activation,
        w: FloatTensor<Self>,
        engine: Gemm,
    ) -> FloatTensor<Self> {
        let x = match activation.gelu_form() {
            None => Self::fused_swiglu_packed(h),
            Some(form) => Self::fused_gelu(h, form),
        };
        Self::gemm(x, w, false, false, engine)
    }
}

/// Without autodiff nothing is kept: the plain composition of the kernels.
impl<R, F, I, BT> RecomputeOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
}

/// `rms_norm(x) W` (`x` [rows, d], `gain` [d], `w` [d, n]) -> [rows, n], the norm's output
/// recomputed in the backward instead of kept. Gradients equal those of
/// `linear(rms_norm(x, gain, eps), w)`.
pub fn rms_norm_linear<B: RecomputeOps>(
    x: Tensor<B, 2>,
    gain: Tensor<B, 1>,
    eps: f64,
    w: Tensor<B, 2>,
    engine: Gemm,
) -> Tensor<B, 2> {
    check_norm("rms_norm_linear", &x, None, &gain, &w);
    let (_, y) = B::fused_rms_norm_linear(prim(x), None, prim(gain), eps, prim(w), engine);
    tensor(y)
}

/// Residual add, RMSNorm and a linear layer: `(s, rms_norm(s) W)` with `s = x + residual` (the new
/// residual stream, in `x`'s dtype), the norm's output recomputed in the backward instead of kept.
/// Gradients equal those of `add_rms_norm` followed by `linear`.
pub fn add_rms_norm_linear<B: RecomputeOps>(
    x: Tensor<B, 2>,
    residual: Tensor<B, 2>,
    gain: Tensor<B, 1>,
    eps: f64,
    w: Tensor<B, 2>,
    engine: Gemm,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    check_norm("add_rms_norm_linear", &x, Some(&residual), &gain, &w);
    let (s, y) = B::fused_rms_norm_linear(
        prim(x),
        Some(prim(residual)),
        prim(gain),
        eps,
        prim(w),
        engine,
    );
    (tensor(s.expect("the fused add returns the sum")), tensor(y))
}

/// `activation(h) W` (`h` [rows, 2 F] packed gate and up for SwiGLU, [rows, F] for GELU; `w`
/// [F, n]) -> [rows, n], the activation's output recomputed in the backward instead of kept.
/// Gradients equal those of the activation followed by `linear`.
pub fn activation_linear<B: RecomputeOps>(
    h: Tensor<B, 2>,
    activation: Activation,
    w: Tensor<B, 2>,
    engine: Gemm,
) -> Tensor<B, 2> {
    let op = "activation_linear";
    let [rows, width] = h.dims();
    let f = match activation {
        Activation::SwigluPacked if width % 2 != 0 => fail(
            op,
            format!("h is [{rows}, {width}]; packed SwiGLU needs an even width (gate, then up)"),
        ),
        Activation::SwigluPacked => width / 2,
        Activation::Gelu | Activation::GeluTanh => width,
    };
    let [wk, n] = w.dims();
    if wk != f {
        fail(
            op,
            format!("h is [{rows}, {width}] and w is [{wk}, {n}]; w must be [{f}, n] for {activation:?}"),
        );
    }
    check_dtypes(op, &h, &w);
    tensor(B::fused_activation_linear(
        prim(h),
        activation,
        prim(w),
        engine,
    ))
}

fn check_norm<B: RecomputeOps>(
    op: &str,
    x: &Tensor<B, 2>,
    residual: Option<&Tensor<B, 2>>,
    gain: &Tensor<B, 1>,
    w: &Tensor<B, 2>,
) {
    let [rows, d] = x.dims();
    if let Some(r) = residual {
        if r.dims() != [rows, d] {
            fail(
                op,
                format!(
                    "x is [{rows}, {d}] and residual is {:?}; they must have one shape",
                    r.dims()
                ),
            );
        }
    }
    if gain.dims() != [d] {
        fail(
            op,
            format!(
                "x is [{rows}, {d}] and gain is {:?}; gain must be [{d}]",
                gain.dims()
            ),
        );
    }
    let [wk, n] = w.dims();
    if wk != d {
        fail(
            op,
            format!("x is [{rows}, {d}] and w is [{wk}, {n}]; w must be [{d}, n]"),
        );
    }
    check_dtypes(op, x, w);
}

fn check_dtypes<B: RecomputeOps>(op: &str, x: &Tensor<B, 2>, w: &Tensor<B, 2>) {
    crate::check::check_float(op, "x", x.dtype());
    crate::check::check_same_dtype(op, "x", x.dtype(), "w", w.dtype());
}
