//! The mean cross-entropy of a linear layer's output, without its logits:
//! `mean_r CE(x_r W^T, t_r)` for `x` [rows, d], `W` [classes, d] (an LM head, or a tied embedding).
//!
//! An LM head's logits are the largest tensors of a language model's step (GPT-2 at 16 x 1024
//! tokens: [16384, 50304] bf16, 1.65 GB, and as much again for their gradient). Here they exist
//! only a chunk of rows at a time. Each chunk's logits go straight through the cross-entropy
//! forward and backward kernels, and the chunk's input and weight gradients are taken at once:
//! `dx_c = dlogits_c W` and `dW += dlogits_c^T x_c`, accumulated in f32 straight from the GEMM
//! ([`crate::gemm::gemm_f32`]). What lives from the forward to the backward is `dx` [rows, d] and
//! `dW` [classes, d], both f32, which the backward only scales by the loss's gradient. The arithmetic is
//! the one of the unchunked loss (the same GEMMs, f32 accumulation, and the kernels' f32 softmax);
//! only the logits gradient is formed per unit loss weight and scaled at the end, so its
//! low-precision values do not depend on a loss scale.
//!
//! Without autodiff (evaluation) only the loss is computed, chunk by chunk.

use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{FloatDType, Int, Tensor, TensorMetadata};

use super::CrossEntropyKernels;
use crate::gemm::{Gemm, GemmOps};
use crate::primitive::float_dtype;
use crate::reduce::ReduceOps;

/// The fewest bytes of logits one chunk may take when [`LinearCrossEntropy::chunk_rows`] is
/// `None`: 256 MiB, 2668 rows of GPT-2's 50304 classes in bf16. What a chunk takes on a device is
/// [`pooled_chunk_bytes`] where CubeCL's pools say more.
pub const DEFAULT_CHUNK_BYTES: usize = 256 << 20;

/// The bytes of logits a chunk takes on a CubeCL device whose largest memory page is `max_page`
/// bytes: the largest allocation CubeCL 0.10's pools place in pages shared with other tensors, a
/// 64th of the largest page (a 256th of the device's memory on CUDA: about 580 MB on an H200,
/// about 330 MB on an H100), and at least [`DEFAULT_CHUNK_BYTES`]. A larger one takes a page of
/// its own, a quarter of the largest (about 9 GB on an H200). Fewer, larger chunks run the head's
/// GEMMs longer and read and write the f32 weight gradient fewer times: on an H200, GPT-2 at 16 x
/// 1024 tokens runs 3 chunks of 5504 rows instead of 7 of 2368, 2.2% more tokens/s for 0.55 GiB
/// more.
pub fn pooled_chunk_bytes(max_page: u64) -> usize {
    ((max_page / 64) as usize).max(DEFAULT_CHUNK_BYTES)
}

/// Options of [`crate::linear_cross_entropy`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearCrossEntropy {
    /// Weight of `z_loss * lse^2` added to each row's loss (0: none).
    pub z_loss: f64,
    /// Engine of the GEMMs.
    pub gemm: Gemm,
    /// Rows per chunk; `None` takes the most rows whose logits fit the backend's chunk bytes
    /// ([`pooled_chunk_bytes`] on a CubeCL device).
    pub chunk_rows: Option<usize>,
}

impl Default for LinearCrossEntropy {
    fn default() -> Self {
        Self {
            z_loss: 0.0,
            gemm: Gemm::Auto,
            chunk_rows: None,
        }
    }
}

/// Rows per chunk for `rows` rows of `classes` logits of `elem_bytes` each: at most `given` (or
/// what fits `chunk_bytes`), the chunks as even as possible, in multiples of 64 rows where that
/// stays within the limit.
pub fn chunk_rows(
    rows: usize,
    classes: usize,
    elem_bytes: usize,
    given: Option<usize>,
    chunk_bytes: usize,
) -> usize {
    let limit = given
        .unwrap_or_else(|| chunk_bytes / (classes * elem_bytes).max(1))
        .clamp(1, rows.max(1));
    let even = rows.max(1).div_ceil(rows.max(1).div_ceil(limit));
    let rounded = even.next_multiple_of(64);
    if rounded <= limit {
        rounded
    } else {
        even
    }
}

/// The plain-Burn reference: all logits `x w^T` in `x`'s dtype (Burn's matmul), the reference
/// cross-entropy in f32, the mean over rows. `[1]` f32.
pub fn reference<B: BurnBackend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    z_loss: f64,
) -> Tensor<B, 1> {
    let w = w.cast(float_dtype(x.dtype()));
    let logits = crate::gemm::reference(x, w, false, true);
    super::reference(logits, targets, z_loss).mean()
}

/// The chunked loss on a kernels backend: the mean loss (`[1]` f32) and, for the gradients asked
/// for, those of the summed loss (unit weight per row), both in f32 straight from their GEMMs:
/// `dx` [rows, d] and `dw` [classes, d]. (Kept in f32, the gradient is rounded to `x`'s dtype once,
/// after its scaling.)
#[allow(clippy::type_complexity)]
pub(crate) fn chunked<B: CrossEntropyKernels + GemmOps + ReduceOps>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    targets: IntTensor<B>,
    opts: LinearCrossEntropy,
    need_dx: bool,
    need_dw: bool,
) -> (
    FloatTensor<B>,
    Option<FloatTensor<B>>,
    Option<FloatTensor<B>>,
) {
    let x = crate::primitive::tensor::<B, 2>(x);
    let w = crate::primitive::tensor::<B, 2>(w);
    let targets = Tensor::<B, 1, Int>::from_primitive(targets);
    let device = x.device();
    let [rows, d] = x.dims();
    let [classes, _] = w.dims();
    let dtype = x.dtype();
    // The GEMMs take both operands in x's dtype: a wider weight (an f32 master) is cast once.
    let w = if w.dtype() == dtype {
        w
    } else {
        w.cast(float_dtype(dtype))
    };
    let chunk_bytes = B::logits_chunk_bytes(&crate::primitive::prim(x.clone()));
    let chunk = chunk_rows(rows, classes, dtype.size(), opts.chunk_rows, chunk_bytes);
    let (z, gemm) = (opts.z_loss, opts.gemm);
    let mut losses = Vec::with_capacity(rows.div_ceil(chunk));
    let mut dxs = Vec::new();
    let mut dw: Option<FloatTensor<B>> = None;
    // The weight of each row's loss in the gradients: 1 (the backward scales by the mean's).
    let mut ones: Option<Tensor<B, 1>> = None;
    for start in (0..rows).step_by(chunk) {
        let end = (start + chunk).min(rows);
        let xc = x.clone().narrow(0, start, end - start);
        let tc = targets.clone().narrow(0, start, end - start);
        let logits = B::gemm(
            crate::primitive::prim(xc.clone()),
            crate::primitive::prim(w.clone()),
            false,
            true,
            gemm,
        );
        let (loss, lse) = B::cross_entropy_forward(logits.clone(), tc.clone().into_primitive(), z);
        losses.push(crate::primitive::tensor::<B, 1>(loss));
        if !(need_dx || need_dw) {
            continue;
        }
        let unit = ones
            .get_or_insert_with(|| Tensor::<B, 1>::ones([chunk], &device).cast(FloatDType::F32))
            .clone()
            .narrow(0, 0, end - start);
        let dlogits = B::cross_entropy_backward(
            logits,
            tc.into_primitive(),
            lse,
            crate::primitive::prim(unit),
            z,
        );
        if need_dx {
            dxs.push(crate::primitive::tensor::<B, 2>(B::gemm_f32(
                dlogits.clone(),
                crate::primitive::prim(w.clone()),
                false,
                false,
                None,
                gemm,
            )));
        }
        if need_dw {
            dw = Some(B::gemm_f32(
                dlogits,
                crate::primitive::prim(xc),
                true,
                false,
                dw,
                gemm,
            ));
        }
    }
    // The mean of the rows' losses: one kernel's partial sums per chunk, one cube's fixed-order
    // total (a full-tensor mean of the concatenated rows would copy them and reduce in one unit).
    let losses = losses.into_iter().map(crate::primitive::prim).collect();
    let loss =
        crate::primitive::tensor::<B, 1>(B::sum_f32(losses, &device)).div_scalar(rows as f64);
    let dx = need_dx.then(|| crate::primitive::prim(Tensor::cat(dxs, 0)));
    debug_assert!(dx
        .as_ref()
        .is_none_or(|t| t.shape().as_slice() == [rows, d]));
    (crate::primitive::prim(loss), dx, dw)
}
