//! Sums in f32 over tensors of any float dtype, shape and layout, outside autodiff (the
//! optimizer's side and the loss):
//!
//! - [`crate::add_as_f32`]: `f32(a) + f32(b)` in one pass, accumulating gradients over
//!   micro-batches (no cast of its own for a bf16 or f16 gradient);
//! - [`crate::scale`]: `x * factor[0]` in f32, cast to a dtype in the same pass (the LM head's
//!   gradients scaled by the loss's factor);
//! - [`crate::sum_f32`] and [`SumSquares`]: the sum (of squares) of every element of many
//!   tensors, read once each into per-cube partial sums that one cube adds in a fixed order (the
//!   loss mean; the global gradient norm that clipping needs).

pub(crate) mod forward;
pub(crate) mod kernel;

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Tensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

/// Plain-Burn `f32(a) + f32(b)` (tensors of one shape, any float dtypes).
pub fn add_as_f32_reference<B: BurnBackend, const D: usize>(
    a: Tensor<B, D>,
    b: Tensor<B, D>,
) -> Tensor<B, D> {
    a.cast(FloatDType::F32) + b.cast(FloatDType::F32)
}

/// Plain-Burn `x * factor[0]` in f32, cast to `dtype`.
pub fn scale_reference<B: BurnBackend, const D: usize>(
    x: Tensor<B, D>,
    factor: Tensor<B, 1>,
    dtype: FloatDType,
) -> Tensor<B, D> {
    if x.shape().num_elements() == 0 {
        // Burn refuses to broadcast the factor against an empty tensor.
        return x.cast(dtype);
    }
    (x.cast(FloatDType::F32) * factor.cast(FloatDType::F32).reshape([1; D])).cast(dtype)
}

/// Plain-Burn sum of every element of `tensors`, in f32, as a one-element tensor (0 when they hold
/// no element).
pub fn sum_f32_reference<B: BurnBackend>(
    tensors: Vec<FloatTensor<B>>,
    device: &B::Device,
) -> Tensor<B, 1> {
    sum_reference(tensors, device, |t| t)
}

/// The sum over `tensors` of `f` of each one's elements in f32, as a one-element tensor.
fn sum_reference<B: BurnBackend>(
    tensors: Vec<FloatTensor<B>>,
    device: &B::Device,
    f: impl Fn(Tensor<B, 2>) -> Tensor<B, 2>,
) -> Tensor<B, 1> {
    let mut acc = Tensor::<B, 1>::zeros([1], (device, burn::tensor::DType::F32));
    for t in tensors {
        let (t, _) = crate::primitive::as_2d::<B>(t);
        acc = acc + f(t.cast(FloatDType::F32)).sum();
    }
    acc
}

/// Plain-Burn sum of squares of every element of `tensors`, in f32, as a one-element tensor (0
/// when they hold no element).
pub fn sum_squares_reference<B: BurnBackend>(
    tensors: Vec<FloatTensor<B>>,
    device: &B::Device,
) -> Tensor<B, 1> {
    sum_reference(tensors, device, |t| t.powi_scalar(2))
}

/// The sums on a backend. The defaults run the references; `CubeBackend` overrides them with
/// the kernels. They work on the optimizer's tensors, so `Autodiff` keeps the defaults.
pub trait ReduceOps: BurnBackend {
    /// `f32(a) + f32(b)` ([`crate::add_as_f32`]); the default runs [`add_as_f32_reference`].
    fn add_as_f32(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        let (a, shape) = crate::primitive::as_2d::<Self>(a);
        let (b, _) = crate::primitive::as_2d::<Self>(b);
        crate::primitive::from_2d(add_as_f32_reference(a, b), shape)
    }

    /// `x * factor[0]` in f32, stored in `dtype` ([`crate::scale`]); the default runs
    /// [`scale_reference`].
    fn scale_cast(
        x: FloatTensor<Self>,
        factor: FloatTensor<Self>,
        dtype: FloatDType,
    ) -> FloatTensor<Self> {
        let (x, shape) = crate::primitive::as_2d::<Self>(x);
        crate::primitive::from_2d(
            scale_reference(x, crate::primitive::tensor(factor), dtype),
            shape,
        )
    }

    /// The sum of every element of `tensors` on `device`, in f32, `[1]` ([`crate::sum_f32`]); the
    /// default runs [`sum_f32_reference`].
    fn sum_f32(tensors: Vec<FloatTensor<Self>>, device: &Self::Device) -> FloatTensor<Self> {
        crate::primitive::prim(sum_f32_reference::<Self>(tensors, device))
    }

    /// The sum of squares of every element of `tensors` on `device` ([`crate::SumSquares`]); the
    /// default runs [`sum_squares_reference`].
    fn sum_squares(tensors: Vec<FloatTensor<Self>>, device: &Self::Device) -> FloatTensor<Self> {
        crate::primitive::prim(sum_squares_reference::<Self>(tensors, device))
    }
}

impl<R, F, I, BT, C> ReduceOps for Autodiff<CubeBackend<R, F, I, BT>, C>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    C: CheckpointStrategy,
{
}

/// The sum of squares of many tensors' elements (for example the global gradient norm of
/// clipping: `sqrt` of it over all gradients), in f32, as a one-element device tensor. Tensors of
/// any rank, float dtype and layout are added one by one; on `CubeBackend` each is read once by
/// one kernel launch writing per-cube partial sums, and [`SumSquares::finish`] adds those up,
/// instead of a square, a sum and an add per tensor. Works on non-autodiff tensors (the
/// optimizer's side).
///
/// ```no_run
/// use burn::backend::Wgpu;
/// use burn::tensor::Tensor;
///
/// let dev = Default::default();
/// let a = Tensor::<Wgpu, 2>::ones([3, 4], &dev);
/// let b = Tensor::<Wgpu, 1>::ones([5], &dev);
/// let mut sq = kernels::SumSquares::new(&dev);
/// sq.add(a);
/// sq.add(b);
/// let norm = sq.finish().sqrt(); // [sqrt(17)]
/// ```
pub struct SumSquares<B: ReduceOps> {
    device: B::Device,
    tensors: Vec<FloatTensor<B>>,
}

impl<B: ReduceOps> SumSquares<B> {
    /// An empty sum on `device`.
    pub fn new(device: &B::Device) -> Self {
        Self {
            device: device.clone(),
            tensors: Vec::new(),
        }
    }

    /// Adds the squares of `t`'s elements.
    pub fn add<const D: usize>(&mut self, t: Tensor<B, D>) {
        self.tensors.push(crate::primitive::prim(t));
    }

    /// The sum, `[1]` in f32 (0 when nothing was added).
    pub fn finish(self) -> Tensor<B, 1> {
        crate::primitive::tensor(B::sum_squares(self.tensors, &self.device))
    }
}
