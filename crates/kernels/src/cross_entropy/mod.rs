//! Softmax cross-entropy from logits, with the log-sum-exp kept per row and an optional z-loss.
//!
//! Per row `r` of `logits` [rows, classes] with class index `targets[r]`:
//! `loss_r = lse_r - logits[r, target_r] + z_loss * lse_r^2`,
//! `lse_r = log sum_j exp(logits[r, j])`, computed in f32 whatever the logits' dtype. Rows with a
//! negative target are ignored (loss 0, gradient 0); a target >= classes gives a NaN loss and
//! gradient for its row (checking on the host would cost a device-to-host read per call). The
//! forward keeps only `lse` (f32, one per row) beside the logits themselves; the backward rebuilds
//! the probabilities from it, so no [rows, classes] f32 tensor lives from the forward to the
//! backward.

pub(crate) mod backward;
pub(crate) mod forward;
pub(crate) mod kernel;
pub mod linear;

pub use linear::LinearCrossEntropy;

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{FloatDType, Int, Tensor, TensorMetadata};

/// Plain-Burn per-row cross-entropy with z-loss, in f32 (see the module docs).
pub fn reference<B: BurnBackend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    z_loss: f64,
) -> Tensor<B, 1> {
    let logits = logits.cast(FloatDType::F32);
    let [rows, _] = logits.dims();
    let valid = targets.clone().greater_equal_elem(0);
    let safe = targets.clamp_min(0).reshape([rows, 1]);
    // log-sum-exp, stably: max + log(sum(exp(x - max)))
    let max = logits.clone().max_dim(1);
    let lse = (logits.clone() - max.clone()).exp().sum_dim(1).log() + max; // [rows, 1]
    let picked = logits.gather(1, safe);
    let mut loss = lse.clone() - picked;
    if z_loss != 0.0 {
        loss = loss + lse.powi_scalar(2).mul_scalar(z_loss);
    }
    let loss: Tensor<B, 1> = loss.reshape([rows]);
    loss.mask_fill(valid.bool_not(), 0.0)
}

/// Plain-Burn mean cross-entropy as a training loop usually writes it: `log_softmax` and `gather`.
pub fn reference_log_softmax<B: BurnBackend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
) -> Tensor<B, 1> {
    let [rows, _] = logits.dims();
    let logp = log_softmax(logits.cast(FloatDType::F32), 1);
    logp.gather(1, targets.reshape([rows, 1])).mean().neg()
}

/// Cross-entropy on a backend ([`crate::cross_entropy`], [`crate::linear_cross_entropy`]). The
/// defaults run the references; `CubeBackend` overrides them with the kernels and `Autodiff` with
/// the kernels and their backward.
pub trait CrossEntropyOps: BurnBackend {
    /// [`crate::linear_cross_entropy`]: the mean loss, `[1]` f32.
    fn fused_linear_cross_entropy(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
        opts: LinearCrossEntropy,
    ) -> FloatTensor<Self> {
        crate::gemm::burn_only(opts.gemm, x.dtype());
        crate::primitive::prim(linear::reference::<Self>(
            crate::primitive::tensor(x),
            crate::primitive::tensor(w),
            burn::tensor::Tensor::from_primitive(targets),
            opts.z_loss,
        ))
    }

    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        z_loss: f64,
    ) -> FloatTensor<Self> {
        crate::primitive::prim(reference::<Self>(
            crate::primitive::tensor(logits),
            burn::tensor::Tensor::from_primitive(targets),
            z_loss,
        ))
    }
}

/// The cross-entropy kernels' launches without autodiff, which the `Autodiff` implementation
/// records.
pub trait CrossEntropyKernels: CrossEntropyOps {
    /// `(per-row loss, per-row log-sum-exp)`, both f32.
    fn cross_entropy_forward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        z_loss: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
        z_loss: f64,
    ) -> FloatTensor<Self>;
    /// Bytes of logits a chunk of [`crate::linear_cross_entropy`] may take on `x`'s device when
    /// its options give no row count ([`linear::DEFAULT_CHUNK_BYTES`] unless the backend knows
    /// better).
    fn logits_chunk_bytes(_x: &FloatTensor<Self>) -> usize {
        linear::DEFAULT_CHUNK_BYTES
    }
}
