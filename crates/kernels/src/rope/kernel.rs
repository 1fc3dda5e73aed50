//! Rotary embedding kernel: each unit rotates a vector of (x[i], x[i + half]) pairs; and the
//! rotation itself ([`angle`], [`rotate_pair`]), which the packed attention kernels share.

use cubecl::prelude::*;

/// `out[b, h, t, i] = x1 cos - x2 sin`, `out[b, h, t, i + half] = x1 sin + x2 cos` with
/// `x1 = x[b, h, t, i]`, `x2 = x[b, h, t, i + half]` and the angle of position `t`, pair `i`.
/// `x` is read through its strides (in vectors), so a transposed view of a fused qkv projection
/// needs no copy; `out` is dense `[B, H, T, head_dim]`. `inverse` rotates by the opposite angle,
/// which is the backward (the rotation is orthogonal).
#[cube(launch)]
pub(crate) fn rope_kernel<F: Float, W: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    cos: &Array<Vector<W, N>>,
    sin: &Array<Vector<W, N>>,
    out: &mut Array<Vector<F, N>>,
    heads: usize,
    seq: usize,
    half: usize,
    stride_b: usize,
    stride_h: usize,
    stride_t: usize,
    total: usize,
    #[comptime] inverse: bool,
    #[define(F, W)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i < total {
        let j = i % half;
        let rest = i / half;
        let t = rest % seq;
        let bh = rest / seq;
        let h = bh % heads;
        let b = bh / heads;
        let src = b * stride_b + h * stride_h + t * stride_t + j;
        let x1 = Vector::<f32, N>::cast_from(x[src]);
        let x2 = Vector::<f32, N>::cast_from(x[src + half]);
        let (c, s) = angle(cos, sin, t * half + j, inverse);
        let (y1, y2) = rotate_pair(x1, x2, c, s);
        let dst = rest * 2 * half + j;
        out[dst] = Vector::cast_from(y1);
        out[dst + half] = Vector::cast_from(y2);
    }
}

/// The cosine and sine, in f32, at `at` of the `cos` and `sin` tables; `inverse` negates the sine:
/// the rotation by the opposite angle, which is the backward (the rotation is orthogonal).
#[cube]
pub(crate) fn angle<W: Float, N: Size>(
    cos: &Array<Vector<W, N>>,
    sin: &Array<Vector<W, N>>,
    at: usize,
    #[comptime] inverse: bool,
) -> (Vector<f32, N>, Vector<f32, N>) {
    let c = Vector::<f32, N>::cast_from(cos[at]);
    let mut s = Vector::<f32, N>::cast_from(sin[at]);
    if comptime!(inverse) {
        // `0 - s`: CubeCL's CUDA back end has no unary minus on vectors.
        s = Vector::new(0.0) - s;
    }
    (c, s)
}

/// The pair `(x1, x2)` rotated by the angle whose cosine and sine are `c` and `s`:
/// `(x1 c - x2 s, x1 s + x2 c)`.
#[cube]
pub(crate) fn rotate_pair<N: Size>(
    x1: Vector<f32, N>,
    x2: Vector<f32, N>,
    c: Vector<f32, N>,
    s: Vector<f32, N>,
) -> (Vector<f32, N>, Vector<f32, N>) {
    (x1 * c - x2 * s, x1 * s + x2 * c)
}
