//! FlashAttention of a packed qkv projection with RoPE on q and k, as one op
//! ([`crate::flash_attention_qkv`]).
//!
//! Taking q, k and v as slices of the projection and rotating q and k separately costs, under
//! autodiff, what Burn's slice backward does for each slice: a zero-filled gradient of the whole
//! projection, the slice's gradient assigned into it, and the three summed (about 30 passes over
//! a `[tokens, head_dim x heads]` tensor where 3 would do, in 8 launches); and the rotated q and k
//! are kept beside the projection, which the v view keeps alive (5 such tensors where 3 would
//! do). This op
//! keeps only the projection (plus the output and log-sum-exp), rotates q and k again in the
//! backward, and writes the projection's gradient in its packed layout in one launch: the inverse
//! rotation of dQ and dK and a copy of dV.

use burn::tensor::TensorMetadata;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use crate::check::{check_float, fail};
use crate::dropout::Dropout;
use crate::launch::{contiguous, empty, vector_width};

/// The dims of a packed projection: (batch, seq, heads, head_dim).
pub(crate) fn packed_dims<R: CubeRuntime>(
    op: &str,
    qkv: &CubeTensor<R>,
    heads: usize,
) -> (usize, usize, usize, usize) {
    check_float(op, "qkv", qkv.dtype);
    let shape = qkv.shape();
    let dims = shape.as_slice();
    if dims.len() != 3
        || heads == 0
        || !dims[2].is_multiple_of(3 * heads)
        || !(dims[2] / (3 * heads)).is_multiple_of(2)
    {
        fail(
            op,
            format!(
                "qkv has shape {dims:?} with {heads} heads; expected [batch, seq, 3 x heads x head_dim] with an even head_dim"
            ),
        );
    }
    (dims[0], dims[1], heads, dims[2] / (3 * heads))
}

/// Part `p` (0: q, 1: k, 2: v) of a contiguous packed `[B, T, 3 H hd]` tensor, as a `[B, H, T,
/// hd]` view (a copy where the device cannot offset a view there).
pub(crate) fn part<R: CubeRuntime>(
    qkv: &CubeTensor<R>,
    (b, t, h, hd): (usize, usize, usize, usize),
    p: usize,
) -> CubeTensor<R> {
    let x = burn_cubecl::ops::reshape(qkv.clone(), [b, t, 3 * h, hd].into());
    let x = burn_cubecl::ops::permute(x, &[0, 2, 1, 3]);
    burn_cubecl::kernel::slice(x, &[0..b, p * h..(p + 1) * h, 0..t, 0..hd])
}

/// Rotated q and k and the v view of a packed projection (made contiguous first if it is not).
#[allow(clippy::type_complexity)]
pub(crate) fn unpack<R: CubeRuntime>(
    op: &str,
    qkv: CubeTensor<R>,
    heads: usize,
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let dims = packed_dims(op, &qkv, heads);
    let qkv = contiguous(qkv);
    let q = crate::rope::forward::rope(part(&qkv, dims, 0), cos.clone(), sin.clone(), false);
    let k = crate::rope::forward::rope(part(&qkv, dims, 1), cos, sin, false);
    let v = part(&qkv, dims, 2);
    (qkv, q, k, v)
}

/// `(out, lse)`: FlashAttention of the packed projection's rotated q, k and its v; `out` is
/// `[B, H, T, hd]` laid out as `[B, T, H, hd]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<R: CubeRuntime>(
    qkv: CubeTensor<R>,
    heads: usize,
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
    causal: bool,
    scale: f32,
    dropout: Option<Dropout>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (_, q, k, v) = unpack("flash_attention_qkv", qkv, heads, cos, sin);
    super::forward::forward(q, k, v, causal, scale, dropout)
}

/// The gradient of the packed projection, `[B, T, 3 H hd]` (contiguous), from the output's
/// gradient `grad` `[B, H, T, hd]` (any strides).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<R: CubeRuntime>(
    qkv: CubeTensor<R>,
    heads: usize,
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    grad: CubeTensor<R>,
    causal: bool,
    scale: f32,
    dropout: Option<Dropout>,
) -> CubeTensor<R> {
    let op = "flash_attention_qkv backward";
    let (b, t, h, hd) = packed_dims(op, &qkv, heads);
    let (qkv, q, k, v) = unpack(op, qkv, heads, cos.clone(), sin.clone());
    let (dq, dk, dv) = super::gradients::backward(q, k, v, out, lse, grad, causal, scale, dropout);
    let dqkv = empty(&qkv, vec![b, t, 3 * h * hd], qkv.dtype);
    if b * t * h == 0 {
        return dqkv;
    }
    // One layout for the three gradients, so that one set of strides reads them all (they share
    // one already: FlashAttention's backward allocates them alike).
    let same = dk.meta.strides() == dq.meta.strides() && dv.meta.strides() == dq.meta.strides();
    let (dq, dk, dv) = if same {
        (dq, dk, dv)
    } else {
        (contiguous(dq), contiguous(dk), contiguous(dv))
    };
    let (cos, sin) = (contiguous(cos), contiguous(sin));
    let s = dq.meta.strides().to_vec();
    let half = hd / 2;
    // Vectors of `n` along the head dim: every offset the kernel forms is a multiple of `n`.
    let n = vector_width(&dqkv, &[qkv.dtype, cos.dtype], &[half, s[0], s[1], s[2]]);
    let total = b * t * 3 * h * (half / n);
    let dim = CubeDim::new_1d(256);
    let count = calculate_cube_count_elemwise(&qkv.client, total, dim);
    let dtypes = [qkv.dtype.into(), cos.dtype.into()];
    pack_grad::launch::<R>(
        &qkv.client.clone(),
        count,
        dim,
        n,
        dq.into_tensor_arg(),
        dk.into_tensor_arg(),
        dv.into_tensor_arg(),
        cos.into_tensor_arg(),
        sin.into_tensor_arg(),
        dqkv.clone().into_tensor_arg(),
        h,
        t,
        half / n,
        s[0] / n,
        s[1] / n,
        s[2] / n,
        total,
        dtypes,
    );
    dqkv
}

/// `dqkv[b, t, p H + h, :]` from part `p`'s gradient at `[b, h, t, :]`: dQ and dK rotated back
/// (by the opposite angle of position `t`), dV copied. One unit per vector of `N` pairs
/// (i, i + half); `half` and the strides are in vectors.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
#[allow(unused_assignments)] // the initial values are the kernel's declarations of x1, x2
fn pack_grad<F: Float, W: Float, N: Size>(
    dq: &Tensor<Vector<F, N>>,
    dk: &Tensor<Vector<F, N>>,
    dv: &Tensor<Vector<F, N>>,
    cos: &Tensor<Vector<W, N>>,
    sin: &Tensor<Vector<W, N>>,
    dqkv: &mut Tensor<Vector<F, N>>,
    heads: usize,
    seq: usize,
    half: usize,
    stride_b: usize,
    stride_h: usize,
    stride_t: usize,
    total: usize,
    #[define(F, W)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i < total {
        let j = i % half;
        let rest = i / half;
        let h3 = rest % (3 * heads);
        let bt = rest / (3 * heads);
        let t = bt % seq;
        let b = bt / seq;
        let p = h3 / heads;
        let h = h3 % heads;
        let src = b * stride_b + h * stride_h + t * stride_t + j;
        let dst = rest * 2 * half + j;
        if p == 2 {
            dqkv[dst] = dv[src];
            dqkv[dst + half] = dv[src + half];
        } else {
            let mut x1 = Vector::<f32, N>::new(0.0);
            let mut x2 = Vector::<f32, N>::new(0.0);
            if p == 0 {
                x1 = Vector::cast_from(dq[src]);
                x2 = Vector::cast_from(dq[src + half]);
            } else {
                x1 = Vector::cast_from(dk[src]);
                x2 = Vector::cast_from(dk[src + half]);
            }
            // The inverse rotation: by -angle.
            let c = Vector::<f32, N>::cast_from(cos[t * half + j]);
            let s = Vector::<f32, N>::cast_from(sin[t * half + j]);
            dqkv[dst] = Vector::cast_from(x1 * c + x2 * s);
            dqkv[dst + half] = Vector::cast_from(x2 * c - x1 * s);
        }
    }
}
