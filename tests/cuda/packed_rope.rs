//! Where `flash_attention_qkv` rotates its packed projection: in the projection's own buffer when
//! nothing else holds it, even while the cuBLASLt GEMM that writes it is still queued on CubeCL's
//! device thread (which holds the buffer until it issues the GEMM), and into a new tensor when the
//! caller keeps the projection; both give the same numbers.

use burn::backend::cuda::CudaDevice;
use burn::backend::{Autodiff, Cuda};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, FloatDType, Int, Tensor};
use kernels::attention::packed_rotations;

use crate::kernels::no_fallbacks;

type B = Autodiff<Cuda>;

const BATCH: usize = 2;
const SEQ: usize = 64;
const HEADS: usize = 4;
const HEAD_DIM: usize = 64;
const WIDTH: usize = 256;

/// The packed projection `x w^T` on cuBLASLt, as `[BATCH, SEQ, 3 HEADS HEAD_DIM]`.
fn project(x: &Tensor<B, 2>, w: &Tensor<B, 2>) -> Tensor<B, 3> {
    kernels::gemm(x.clone(), w.clone(), false, true, kernels::Gemm::CublasLt).reshape([
        BATCH,
        SEQ,
        3 * HEADS * HEAD_DIM,
    ])
}

/// Attention over the projection, and the gradients of `x` and `w` through it.
fn attend(
    qkv: Tensor<B, 3>,
    x: &Tensor<B, 2>,
    w: &Tensor<B, 2>,
    dev: &CudaDevice,
) -> [Vec<f32>; 3] {
    let (cos, sin) = kernels::rope::tables::<B>(SEQ, HEAD_DIM, 10_000.0, dev);
    let out = kernels::flash_attention_qkv(qkv, HEADS, HEADS, cos, sin, true, None, None);
    let flat = out.clone().reshape([BATCH * SEQ, HEADS * HEAD_DIM]);
    let grads = (out * out_weights(dev)).sum().backward();
    let dx = x.grad(&grads).expect("x's gradient");
    let dw = w.grad(&grads).expect("w's gradient");
    [values(flat), values(dx), values(dw)]
}

/// A tensor's values in f32.
fn values<BB: Backend, const D: usize>(t: Tensor<BB, D>) -> Vec<f32> {
    t.cast(FloatDType::F32).into_data().to_vec::<f32>().unwrap()
}

/// Fixed weights for the output's sum, so that every output entry's gradient differs.
fn out_weights(dev: &CudaDevice) -> Tensor<B, 3> {
    Tensor::<B, 1, Int>::arange(0..(BATCH * SEQ * HEADS * HEAD_DIM) as i64, dev)
        .float()
        .reshape([BATCH, SEQ, HEADS * HEAD_DIM])
        .div_scalar(1000.0)
        .sin()
        .cast(FloatDType::BF16)
}

#[test]
#[ignore = "needs CUDA"]
fn cuda_packed_rope_in_place_after_queued_gemm() {
    // In the `stream` order a GEMM holds its output until the GPU ran it (rotated into a copy).
    let _settings =
        kernels::settings::scoped(|s| s.gemm_order = kernels::settings::GemmOrder::Same);
    let dev = CudaDevice::default();
    let normal = Distribution::Normal(0.0, 1.0);
    let x = Tensor::<B, 2>::random([BATCH * SEQ, WIDTH], normal, &dev)
        .cast(FloatDType::BF16)
        .require_grad();
    let w = Tensor::<B, 2>::random([3 * HEADS * HEAD_DIM, WIDTH], normal, &dev)
        .mul_scalar(0.05)
        .cast(FloatDType::BF16)
        .require_grad();
    // A problem's first cuBLASLt call waits for the device thread; its later calls are queued.
    let warm_up = attend(project(&x, &w), &x, &w, &dev);

    let before = packed_rotations();
    let in_place = attend(project(&x, &w), &x, &w, &dev);
    let after = packed_rotations().since(before);
    assert_eq!(
        (after.in_place, after.copied),
        (1, 0),
        "a projection nothing else holds, its GEMM queued, should be rotated in place: {after:?}"
    );

    let before = packed_rotations();
    let qkv = project(&x, &w);
    let held = qkv.clone();
    let copied = attend(qkv, &x, &w, &dev);
    let after = packed_rotations().since(before);
    assert_eq!(
        (after.in_place, after.copied),
        (0, 1),
        "a projection the caller keeps should be rotated into a new tensor: {after:?}"
    );
    // The kept projection is unrotated: the GEMM's product, as a fresh one is.
    assert_eq!(values(held), values(project(&x, &w)));

    for (name, (a, b)) in ["output", "dx", "dw"]
        .into_iter()
        .zip(in_place.iter().zip(&copied))
    {
        assert_eq!(a, b, "{name}: in place and into a copy differ");
    }
    for (name, (a, b)) in ["output", "dx", "dw"]
        .into_iter()
        .zip(in_place.iter().zip(&warm_up))
    {
        assert_eq!(a, b, "{name}: the first and the queued GEMM's runs differ");
    }
    no_fallbacks("the packed projections");
}
