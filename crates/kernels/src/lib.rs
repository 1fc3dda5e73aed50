//! CubeCL kernels for transformer training on Burn.
//!
//! Every kernel comes with a plain-Burn reference that computes the same function with ordinary
//! tensor ops, and is exposed through the [`Backend`] extension trait, implemented for Burn's
//! `CubeBackend` (CUDA, wgpu) and for `Autodiff` over it. Models that do not use the kernels run on
//! any Burn backend through the references.
//!
//! Kernels are added op by op (fused norms and activations, RoPE, the loss, the optimizer step,
//! FlashAttention, FP8 GEMMs); this crate currently holds the extension traits they hang from.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
use burn::tensor::backend::Backend as BurnBackend;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

/// A Burn backend that our kernels are implemented for.
pub trait Backend: BurnBackend {}

/// The autodiff version of [`Backend`]: kernels with their backward passes.
pub trait AutodiffBackend: Backend + burn::tensor::backend::AutodiffBackend {}

impl<R, F, I, BT> Backend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
}

impl<B: Backend, C: CheckpointStrategy> Backend for Autodiff<B, C> {}
impl<B: Backend, C: CheckpointStrategy> AutodiffBackend for Autodiff<B, C> {}
