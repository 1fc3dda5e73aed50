//! Token embedding: rows of a `[vocab, d]` table gathered by `[batch, seq]` ids. Its backward adds
//! each position's output gradient into the table row of its id: on CUDA one kernel of f32 atomic
//! adds (Burn's select-assign, the reference, is a scatter that took 5.3 ms per `gpt2_small` step
//! on an H100); on other backends, where f32 atomic adds are not available everywhere, the
//! reference. The forward is Burn's gather on every backend.

pub(crate) mod backward;
pub(crate) mod forward;
pub(crate) mod kernel;

use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Tensor};

/// `weight[ids]`: `[vocab, d]` and `[batch, seq]` -> `[batch, seq, d]` (Burn's `embedding`, whose
/// backward is Burn's select-assign).
pub fn reference<B: BurnBackend>(weight: Tensor<B, 2>, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
    burn::tensor::module::embedding(weight, ids)
}

/// The embedding op (see the module docs). The default is the reference.
pub trait EmbeddingOps: BurnBackend {
    /// `weight [vocab, d]`, `ids [batch, seq]` -> `[batch, seq, d]`.
    fn fused_embedding(weight: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        crate::primitive::prim(reference::<Self>(
            crate::primitive::tensor(weight),
            Tensor::from_primitive(ids),
        ))
    }
}

/// The backward's launch on a backend with kernels.
pub trait EmbeddingKernels: EmbeddingOps {
    /// The table's gradient `[vocab, d]` in `dtype` from the output gradient `dy [n, d]` and the
    /// ids `[n]`: `sum of dy[i] over the i with ids[i] = v` in row `v` (accumulated in f32).
    fn embedding_scatter_grad(
        dy: FloatTensor<Self>,
        ids: IntTensor<Self>,
        vocab: usize,
        dtype: burn::tensor::DType,
    ) -> FloatTensor<Self>;
}
