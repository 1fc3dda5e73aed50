//! Activations: SwiGLU (`silu(gate) * up`, gate and up as two tensors or packed in one) and GELU,
//! exact (erf) or its tanh approximation. Computed in f32 whatever the storage dtype; outputs and
//! gradients in the input's.

pub(crate) mod backward;
pub(crate) mod forward;
pub(crate) mod kernel;

use burn::tensor::activation::silu;
use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Tensor};

/// Plain-Burn SwiGLU, `silu(gate) * up` computed in f32, returned in `gate`'s dtype.
pub fn swiglu_reference<B: BurnBackend, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
) -> Tensor<B, D> {
    let dt = gate.dtype();
    (silu(gate.cast(FloatDType::F32)) * up.cast(FloatDType::F32)).cast(dt)
}

/// Plain-Burn SwiGLU of a packed `[.., 2 * F]` tensor (gate half first) -> `[.., F]`.
pub fn swiglu_packed_reference<B: BurnBackend, const D: usize>(
    gate_up: Tensor<B, D>,
) -> Tensor<B, D> {
    let mut halves = gate_up.chunk(2, D - 1);
    let up = halves.pop().expect("two halves");
    let gate = halves.pop().expect("two halves");
    swiglu_reference(gate, up)
}

/// Plain-Burn exact GELU, `x * (1 + erf(x / sqrt 2)) / 2`, computed in f32 and returned in `x`'s
/// dtype, written with `erf` so that autodiff differentiates the function itself.
///
/// Burn's own `gelu` is not used: in Burn 0.21 its forward is the erf form but its backward is
/// the derivative of the tanh approximation (about 1e-3 off), and that backward cubes `x` in the
/// input dtype, which overflows f16 beyond |x| = 40.
pub fn gelu_reference<B: BurnBackend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let dt = x.dtype();
    let x = x.cast(FloatDType::F32);
    let cdf = (x.clone() * core::f64::consts::FRAC_1_SQRT_2)
        .erf()
        .add_scalar(1.0)
        .mul_scalar(0.5);
    (x * cdf).cast(dt)
}

/// Which GELU: the exact `x * Phi(x)` (PyTorch's `gelu`) or the tanh approximation
/// `x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) / 2` (PyTorch's `gelu(approximate="tanh")`,
/// GPT-2's own activation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum GeluForm {
    /// `x * Phi(x)` with `erf`.
    #[default]
    Exact,
    /// The tanh approximation.
    Tanh,
}

/// Plain-Burn GELU, tanh approximation, computed in f32 and returned in `x`'s dtype (autodiff
/// differentiates the function itself). `x^3` is taken in f32: finite for every f16 input and for
/// bf16 inputs below about 7e12 in magnitude.
pub fn gelu_tanh_reference<B: BurnBackend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let dt = x.dtype();
    let x = x.cast(FloatDType::F32);
    // sqrt(2 / pi)
    let k = (2.0 / core::f64::consts::PI).sqrt();
    let cube = x.clone() * x.clone() * x.clone();
    let inner = (x.clone() + cube.mul_scalar(0.044_715)).mul_scalar(k);
    let half_one_plus_t = inner.tanh().add_scalar(1.0).mul_scalar(0.5);
    (x * half_one_plus_t).cast(dt)
}

/// Plain-Burn GELU of the given form: [`gelu_reference`] or [`gelu_tanh_reference`].
pub fn gelu_form_reference<B: BurnBackend, const D: usize>(
    x: Tensor<B, D>,
    form: GeluForm,
) -> Tensor<B, D> {
    match form {
        GeluForm::Exact => gelu_reference(x),
        GeluForm::Tanh => gelu_tanh_reference(x),
    }
}

/// SwiGLU and GELU on a backend ([`crate::swiglu`], [`crate::swiglu_packed`], [`crate::gelu`],
/// [`crate::gelu_tanh`]).
/// The defaults run the references; `CubeBackend` overrides them with the kernels and `Autodiff`
/// with the kernels and their backward.
pub trait ActivationOps: BurnBackend {
    fn fused_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let (g, shape) = crate::primitive::as_2d::<Self>(gate);
        let (u, _) = crate::primitive::as_2d::<Self>(up);
        crate::primitive::from_2d(swiglu_reference(g, u), shape)
    }

    fn fused_swiglu_packed(gate_up: FloatTensor<Self>) -> FloatTensor<Self> {
        let (gu, shape) = crate::primitive::as_2d::<Self>(gate_up);
        let mut dims = shape.as_slice().to_vec();
        if let Some(last) = dims.last_mut() {
            *last /= 2;
        }
        crate::primitive::from_2d(swiglu_packed_reference(gu), burn::tensor::Shape::from(dims))
    }

    fn fused_gelu(x: FloatTensor<Self>, form: GeluForm) -> FloatTensor<Self> {
        let (x, shape) = crate::primitive::as_2d::<Self>(x);
        crate::primitive::from_2d(gelu_form_reference(x, form), shape)
    }
}

/// The activation kernels' launches without autodiff, which the `Autodiff` implementation records.
pub trait ActivationKernels: ActivationOps {
    /// SwiGLU of `gate` and `up`, or of the packed `gate` when `up` is `None`.
    fn swiglu_forward(gate: FloatTensor<Self>, up: Option<FloatTensor<Self>>) -> FloatTensor<Self>;
    /// Gradients of [`ActivationKernels::swiglu_forward`], packed `[.., 2 * F]` (gate half, up
    /// half).
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: Option<FloatTensor<Self>>,
        dy: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
    /// GELU of the given form.
    fn gelu_form_forward(x: FloatTensor<Self>, form: GeluForm) -> FloatTensor<Self>;
    /// `dy * GELU'(x)` of the given form.
    fn gelu_form_backward(
        x: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        form: GeluForm,
    ) -> FloatTensor<Self>;
}
