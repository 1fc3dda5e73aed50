//! The embedding on `CubeBackend`: Burn's gather forward; the backward's atomic kernel on CUDA,
//! Burn's select-assign elsewhere.

use burn::tensor::ops::{FloatTensor, FloatTensorOps, IntTensor, ModuleOps};
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::cast;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;

use super::kernel::embedding_grad_kernel;
use crate::check::{check_float, fail};
use crate::launch::contiguous;

/// The table's gradient from `dy [n, d]` and `ids [n]` with the atomic kernel (CUDA).
fn backward_atomic<R: CubeRuntime>(
    dy: CubeTensor<R>,
    ids: CubeTensor<R>,
    vocab: usize,
) -> CubeTensor<R> {
    let dims = dy.shape();
    let (n, d) = (dims[0], dims[1]);
    let dy = contiguous(dy);
    let ids = contiguous(ids);
    let out = burn_cubecl::ops::numeric::zeros::<R>(
        dy.device.clone(),
        Shape::new([vocab, d]),
        DType::F32,
    );
    let total = n * d;
    if total == 0 {
        return out;
    }
    let dim = CubeDim::new_1d(256);
    let count = cubecl::calculate_cube_count_elemwise(&dy.client, total, dim);
    let dtypes = [dy.dtype.into(), ids.dtype.into()];
    // Row strides, not `d`: CUDA may pitch the rows of either tensor.
    let (dy_row, out_row) = (dy.meta.strides()[0], out.meta.strides()[0]);
    if dy.meta.strides()[1] != 1 || out.meta.strides()[1] != 1 || ids.meta.strides()[0] != 1 {
        fail(
            "embedding",
            "the scatter needs unit column strides after the copy".into(),
        );
    }
    embedding_grad_kernel::launch::<R>(
        &dy.client.clone(),
        count,
        dim,
        dy.into_array_arg(),
        ids.into_array_arg(),
        out.clone().into_array_arg(),
        d,
        dy_row,
        out_row,
        total,
        dtypes,
    );
    out
}

impl<R, F, I, BT> super::EmbeddingKernels for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn embedding_scatter_grad(
        dy: FloatTensor<Self>,
        ids: IntTensor<Self>,
        vocab: usize,
        dtype: DType,
    ) -> FloatTensor<Self> {
        let op = "embedding";
        check_float(op, "dy", dy.dtype);
        let (dd, id) = (dy.shape(), ids.shape());
        if dd.num_dims() != 2 || id.num_dims() != 1 || dd[0] != id[0] {
            fail(
                op,
                format!("dy has shape {dd:?} and ids {id:?}; expected [n, d] and [n]"),
            );
        }
        // f32 atomic adds: CUDA has them; other runtimes take Burn's select-assign.
        let cuda = (&dy as &dyn std::any::Any).is::<CubeTensor<CudaRuntime>>();
        let grad = if cuda && crate::settings::read(|s| s.embedding_atomic) {
            backward_atomic(dy, ids, vocab)
        } else {
            let device = Self::float_device(&dy);
            let zeros = Self::float_zeros(Shape::new([vocab, dd[1]]), &device, dy.dtype.into());
            Self::float_select_add(zeros, 0, ids, dy)
        };
        if grad.dtype == dtype {
            grad
        } else {
            cast(grad, dtype)
        }
    }
}

impl<R, F, I, BT> super::EmbeddingOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn fused_embedding(weight: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        <Self as ModuleOps<Self>>::embedding(weight, ids)
    }
}
