//! Rotary position embedding in the "rotate half" layout (GPT-NeoX, LLaMA): each pair
//! (x[i], x[i + head_dim / 2]) of a [batch, heads, seq, head_dim] tensor is rotated by the angle
//! of its position and frequency, read from `cos`/`sin` tables [positions, head_dim / 2]. Computed
//! in f32; output and gradient in `x`'s dtype. The kernel reads strided `x` (for example q and k
//! sliced out of a fused projection) and writes a dense result.

pub(crate) mod backward;
pub(crate) mod forward;
pub(crate) mod kernel;

use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Int, Tensor};

/// `cos` and `sin` tables [positions, head_dim / 2] (f32) for angles
/// `pos * theta^(-2i / head_dim)`.
pub fn tables<B: BurnBackend>(
    positions: usize,
    head_dim: usize,
    theta: f64,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let inv_freq: Vec<f32> = frequencies(head_dim, theta)
        .into_iter()
        .map(|f| f as f32)
        .collect();
    tables_from_freqs(positions, &inv_freq, device)
}

/// RoPE's rotation frequencies `theta^(-2i / head_dim)` of the `head_dim / 2` pairs of a head, in
/// radians per position.
pub fn frequencies(head_dim: usize, theta: f64) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|i| theta.powf(-(2.0 * i as f64) / head_dim as f64))
        .collect()
}

/// `cos` and `sin` tables [positions, inv_freq.len()] (f32) for angles `pos * inv_freq[i]`: the
/// frequencies of [`tables`] stretched for longer contexts (Llama 3's scaling, for example).
pub fn tables_from_freqs<B: BurnBackend>(
    positions: usize,
    inv_freq: &[f32],
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let half = inv_freq.len();
    let inv_freq = Tensor::<B, 1>::from_data(
        burn::tensor::TensorData::new(inv_freq.to_vec(), [half])
            .convert_dtype(burn::tensor::DType::F32),
        (device, burn::tensor::DType::F32),
    )
    .reshape([1, half]);
    let pos = Tensor::<B, 1, Int>::arange(0..positions as i64, device)
        .float()
        .cast(FloatDType::F32)
        .reshape([positions, 1]);
    let angles = pos * inv_freq; // [positions, half]
    (angles.clone().cos(), angles.sin())
}

/// Plain-Burn RoPE: x [B, H, T, head_dim], tables [>= T, head_dim / 2]; f32 inside, `x`'s dtype
/// out.
pub fn reference<B: BurnBackend>(
    x: Tensor<B, 4>,
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
) -> Tensor<B, 4> {
    let dt = x.dtype();
    let [_, _, t, hd] = x.dims();
    let half = hd / 2;
    let cos = cos
        .cast(FloatDType::F32)
        .slice([0..t, 0..half])
        .reshape([1, 1, t, half]);
    let sin = sin
        .cast(FloatDType::F32)
        .slice([0..t, 0..half])
        .reshape([1, 1, t, half]);
    let mut halves = x.cast(FloatDType::F32).chunk(2, 3);
    let x2 = halves.pop().expect("two halves");
    let x1 = halves.pop().expect("two halves");
    let r1 = x1.clone() * cos.clone() - x2.clone() * sin.clone();
    let r2 = x1 * sin + x2 * cos;
    Tensor::cat(vec![r1, r2], 3).cast(dt)
}

/// RoPE on a backend ([`crate::rope`]). The default runs the reference; `CubeBackend` overrides it
/// with the kernel and `Autodiff` with the kernel and its backward (the inverse rotation).
pub trait RopeOps: BurnBackend {
    fn fused_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        crate::primitive::prim(reference::<Self>(
            crate::primitive::tensor(x),
            crate::primitive::tensor(cos),
            crate::primitive::tensor(sin),
        ))
    }
}

/// The RoPE kernel's launch without autodiff, which the `Autodiff` implementation records.
pub trait RopeKernels: RopeOps {
    /// Rotary embedding, or its inverse (the backward).
    fn rope_rotate(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        inverse: bool,
    ) -> FloatTensor<Self>;
}
