//! FlashAttention of a packed qkv projection with RoPE on q and k, as one op
//! ([`crate::flash_attention_qkv`]).
//!
//! Taking q, k and v as slices of the projection and rotating q and k separately costs, under
//! autodiff, what Burn's slice backward does for each slice: a zero-filled gradient of the whole
//! projection, the slice's gradient assigned into it, and the three summed (about 30 passes over
//! a `[tokens, head_dim x heads]` tensor where 3 would do, in 8 launches); and the rotated q and k
//! are kept beside the projection, which the v view keeps alive (5 such tensors where 3 would
//! do). This op rotates q and k inside the projection (in its own buffer when nothing else holds
//! it: one pass, no new tensor), attends over views of it, keeps only it (plus the output and
//! log-sum-exp) for the backward, which rotates nothing again, and writes the projection's
//! gradient in its packed layout: on Hopper GPUs the attention backward stores dQ, dK and dV into
//! it directly, dQ and dK rotated back as they are stored; elsewhere one launch after the
//! backward does the inverse rotation of dQ and dK and copies dV.
//!
//! The projection holds `heads` query heads, then `kv_heads` key heads, then `kv_heads` value
//! heads (grouped-query attention where `kv_heads < heads`; see [`super`]).

use std::sync::atomic::{AtomicUsize, Ordering};

use burn::tensor::TensorMetadata;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use crate::check::{check_float, fail};
use crate::dropout::Dropout;
use crate::launch::{contiguous, empty, vector_width};
use crate::rope::kernel::{angle, rotate_pair};

/// The sizes of a packed projection `[batch, seq, (heads + 2 kv_heads) hd]`.
#[derive(Clone, Copy)]
pub(crate) struct Packed {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub hd: usize,
}

impl Packed {
    /// Heads of all three parts together.
    fn all_heads(&self) -> usize {
        self.heads + 2 * self.kv_heads
    }
}

/// The sizes of a packed projection, checked: rank 3, `kv_heads` dividing `heads`, the last dim
/// `heads + 2 kv_heads` times an even head_dim.
pub(crate) fn packed_dims<R: CubeRuntime>(
    op: &str,
    qkv: &CubeTensor<R>,
    heads: usize,
    kv_heads: usize,
) -> Packed {
    check_float(op, "qkv", qkv.dtype);
    let shape = qkv.shape();
    let dims = shape.as_slice();
    let all = heads + 2 * kv_heads;
    if dims.len() != 3
        || heads == 0
        || !dims[2].is_multiple_of(all)
        || !(dims[2] / all).is_multiple_of(2)
    {
        fail(
            op,
            format!(
                "qkv has shape {dims:?} with {heads} query and {kv_heads} key/value heads; expected [batch, seq, (heads + 2 x kv_heads) x head_dim] with an even head_dim"
            ),
        );
    }
    super::kv_group(op, heads, kv_heads);
    Packed {
        batch: dims[0],
        seq: dims[1],
        heads,
        kv_heads,
        hd: dims[2] / all,
    }
}

/// Heads `first .. first + n` of a contiguous packed `[B, T, (H + 2 Hkv) hd]` tensor, as a `[B, n,
/// T, hd]` view (a copy where the device cannot offset a view there): q is heads `0 .. H`, k
/// `H .. H + Hkv`, v `H + Hkv .. H + 2 Hkv`.
pub(crate) fn part<R: CubeRuntime>(
    qkv: &CubeTensor<R>,
    p: Packed,
    first: usize,
    n: usize,
) -> CubeTensor<R> {
    let (b, t, hd) = (p.batch, p.seq, p.hd);
    let x = burn_cubecl::ops::reshape(qkv.clone(), [b, t, p.all_heads(), hd].into());
    let x = burn_cubecl::ops::permute(x, &[0, 2, 1, 3]);
    burn_cubecl::kernel::slice(x, &[0..b, first..first + n, 0..t, 0..hd])
}

/// Rotations by [`rotate`] in the projection's own buffer, and into a new tensor, in this process.
static ROTATED_IN_PLACE: AtomicUsize = AtomicUsize::new(0);
static ROTATED_INTO_COPY: AtomicUsize = AtomicUsize::new(0);

/// How many packed projections were rotated in their own buffer and how many into a new tensor,
/// in this process (every thread's).
pub(crate) fn rotations() -> (usize, usize) {
    (
        ROTATED_IN_PLACE.load(Ordering::Relaxed),
        ROTATED_INTO_COPY.load(Ordering::Relaxed),
    )
}

/// The packed projection with RoPE applied to its query and key heads, its value heads as they
/// are: rotated in `qkv`'s own buffer when nothing else holds it (the projection is consumed; a
/// GEMM still queued to write it is issued first, see `can_mut_once_issued`), else written to a
/// new contiguous tensor in one pass (q and k rotated, v copied). The backward takes this tensor
/// and rotates nothing again.
pub(crate) fn rotate<R: CubeRuntime>(
    op: &str,
    qkv: CubeTensor<R>,
    p: Packed,
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
) -> CubeTensor<R> {
    let half = p.hd / 2;
    crate::rope::forward::check_tables(op, &cos, &sin, p.seq, half);
    let qkv = contiguous(qkv);
    let (cos, sin) = (contiguous(cos), contiguous(sin));
    let in_place = crate::gemm::cublaslt::can_mut_once_issued(&qkv);
    // A new tensor's rows are dense (`empty`): a CUDA allocation of the runtime's own choosing may
    // pitch them, which the kernels' flat indices do not follow.
    let out = if in_place {
        qkv.clone()
    } else {
        empty(&qkv, qkv.shape().as_slice().to_vec(), qkv.dtype)
    };
    // In place only the rotated heads are visited; into a new tensor every head (v's copied).
    let rotated_heads = p.heads + p.kv_heads;
    let visited = if in_place {
        rotated_heads
    } else {
        p.all_heads()
    };
    let n = vector_width(&qkv, &[qkv.dtype, cos.dtype], &[half]);
    let total = p.batch * p.seq * visited * (half / n);
    if total == 0 {
        return out;
    }
    let dim = CubeDim::new_1d(256);
    let count = calculate_cube_count_elemwise(&qkv.client, total, dim);
    let dtypes = [qkv.dtype.into(), cos.dtype.into()];
    let client = qkv.client.clone();
    if in_place {
        ROTATED_IN_PLACE.fetch_add(1, Ordering::Relaxed);
        rotate_packed_in_place::launch::<R>(
            &client,
            count,
            dim,
            n,
            out.clone().into_array_arg(),
            cos.into_array_arg(),
            sin.into_array_arg(),
            rotated_heads,
            p.all_heads(),
            p.seq,
            half / n,
            total,
            dtypes,
        );
    } else {
        ROTATED_INTO_COPY.fetch_add(1, Ordering::Relaxed);
        rotate_packed::launch::<R>(
            &client,
            count,
            dim,
            n,
            qkv.into_array_arg(),
            out.clone().into_array_arg(),
            cos.into_array_arg(),
            sin.into_array_arg(),
            rotated_heads,
            p.all_heads(),
            p.seq,
            half / n,
            total,
            dtypes,
        );
    }
    out
}

/// The q, k and v views `[B, heads, T, hd]` (k and v with `kv_heads`) of a contiguous packed
/// projection.
fn views<R: CubeRuntime>(
    qkv: &CubeTensor<R>,
    p: Packed,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    (
        part(qkv, p, 0, p.heads),
        part(qkv, p, p.heads, p.kv_heads),
        part(qkv, p, p.heads + p.kv_heads, p.kv_heads),
    )
}

/// The q, k and v views of a new packed gradient `dqkv` that a kernel may write into: `None`
/// where a part's byte offsets are not at the device's memory alignment, since a slice there
/// would be a copy (see [`part`]).
fn writable_parts<R: CubeRuntime>(dqkv: &CubeTensor<R>, p: Packed) -> Option<[CubeTensor<R>; 3]> {
    let alignment = dqkv.client.properties().memory.alignment;
    let head_bytes = (p.hd * dqkv.dtype.size()) as u64;
    let all = p.all_heads() as u64;
    let parts = [
        (0, p.heads),
        (p.heads, p.kv_heads),
        (p.heads + p.kv_heads, p.kv_heads),
    ];
    let in_place = parts.iter().all(|&(first, n)| {
        let (start, end) = (first as u64, all - (first + n) as u64);
        (start * head_bytes).is_multiple_of(alignment)
            && (end * head_bytes).is_multiple_of(alignment)
    });
    in_place.then(|| parts.map(|(first, n)| part(dqkv, p, first, n)))
}

/// `(out, lse, rotated)`: FlashAttention of the packed projection's rotated q, k and its v; `out`
/// is `[B, H, T, hd]` laid out as `[B, T, H, hd]`; `rotated` is the projection with q and k
/// rotated ([`rotate`]), which the backward takes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<R: CubeRuntime>(
    qkv: CubeTensor<R>,
    heads: usize,
    kv_heads: usize,
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
    causal: bool,
    scale: f32,
    dropout: Option<Dropout>,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let op = "flash_attention_qkv";
    let p = packed_dims(op, &qkv, heads, kv_heads);
    let rotated = rotate(op, qkv, p, cos, sin);
    let (q, k, v) = views(&rotated, p);
    let (out, lse) = super::forward::forward(q, k, v, causal, scale, dropout);
    (out, lse, rotated)
}

/// The gradient of the packed projection, `[B, T, (H + 2 Hkv) hd]` (contiguous), from the
/// forward's `rotated` projection, output and log-sum-exp and the output's gradient `grad`
/// `[B, H, T, hd]` (any strides).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<R: CubeRuntime>(
    rotated: CubeTensor<R>,
    heads: usize,
    kv_heads: usize,
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
    let p = packed_dims(op, &rotated, heads, kv_heads);
    let (b, t, hd) = (p.batch, p.seq, p.hd);
    crate::rope::forward::check_tables(op, &cos, &sin, t, hd / 2);
    let qkv = contiguous(rotated);
    let (q, k, v) = views(&qkv, p);
    let dqkv = empty(&qkv, vec![b, t, p.all_heads() * hd], qkv.dtype);
    let (cos, sin) = (contiguous(cos), contiguous(sin));
    // The Hopper backward writes the parts of dqkv itself, dQ and dK rotated back as it stores
    // them, where it applies and the parts are views of dqkv's buffer.
    if dropout.is_none() {
        if let Some(parts) = writable_parts(&dqkv, p) {
            let into = super::gradients::backward_rotated_into(
                [&q, &k, &v],
                &out,
                &lse,
                &grad,
                parts.each_ref(),
                [&cos, &sin],
                causal,
                scale,
            );
            if into {
                return dqkv;
            }
        }
    }
    let (dq, dk, dv) = super::gradients::backward(q, k, v, out, lse, grad, causal, scale, dropout);
    if b * t * heads == 0 {
        return dqkv;
    }
    // One layout for dK and dV, so that one set of strides reads both (they share one already:
    // FlashAttention's backward allocates them alike); dQ has strides of its own (it has more
    // heads under grouped-query attention).
    let (dk, dv) = if dk.meta.strides() == dv.meta.strides() {
        (dk, dv)
    } else {
        (contiguous(dk), contiguous(dv))
    };
    let (sq, skv) = (dq.meta.strides().to_vec(), dk.meta.strides().to_vec());
    let half = hd / 2;
    // Vectors of `n` along the head dim: every offset the kernel forms is a multiple of `n`.
    let lens = [half, sq[0], sq[1], sq[2], skv[0], skv[1], skv[2]];
    let n = vector_width(&dqkv, &[qkv.dtype, cos.dtype], &lens);
    let total = b * t * p.all_heads() * (half / n);
    let dim = CubeDim::new_1d(256);
    let count = calculate_cube_count_elemwise(&qkv.client, total, dim);
    let dtypes = [qkv.dtype.into(), cos.dtype.into()];
    pack_grad::launch::<R>(
        &qkv.client.clone(),
        count,
        dim,
        n,
        dq.into_array_arg(),
        dk.into_array_arg(),
        dv.into_array_arg(),
        cos.into_array_arg(),
        sin.into_array_arg(),
        dqkv.clone().into_array_arg(),
        heads,
        kv_heads,
        t,
        half / n,
        sq[0] / n,
        sq[1] / n,
        sq[2] / n,
        skv[0] / n,
        skv[1] / n,
        skv[2] / n,
        total,
        dtypes,
    );
    dqkv
}

/// `dqkv[b, t, c, :]` for packed head `c` (query heads `0 .. heads`, then `kv_heads` key heads,
/// then `kv_heads` value heads) from its part's gradient at `[b, head, t, :]`: dQ and dK rotated
/// back (by the opposite angle of position `t`), dV copied. One unit per vector of `N` pairs
/// (i, i + half); `half` and the strides are in vectors (`q_*`: dQ's, `kv_*`: dK's and dV's).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
#[allow(unused_assignments)] // the initial values are the kernel's declarations of x1, x2
fn pack_grad<F: Float, W: Float, N: Size>(
    dq: &Array<Vector<F, N>>,
    dk: &Array<Vector<F, N>>,
    dv: &Array<Vector<F, N>>,
    cos: &Array<Vector<W, N>>,
    sin: &Array<Vector<W, N>>,
    dqkv: &mut Array<Vector<F, N>>,
    heads: usize,
    kv_heads: usize,
    seq: usize,
    half: usize,
    q_b: usize,
    q_h: usize,
    q_t: usize,
    kv_b: usize,
    kv_h: usize,
    kv_t: usize,
    total: usize,
    #[define(F, W)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i < total {
        let j = i % half;
        let rest = i / half;
        let all = heads + 2 * kv_heads;
        let c = rest % all;
        let bt = rest / all;
        let t = bt % seq;
        let b = bt / seq;
        let dst = rest * 2 * half + j;
        if c >= heads + kv_heads {
            let src = b * kv_b + (c - heads - kv_heads) * kv_h + t * kv_t + j;
            dqkv[dst] = dv[src];
            dqkv[dst + half] = dv[src + half];
        } else {
            let mut x1 = Vector::<f32, N>::new(0.0);
            let mut x2 = Vector::<f32, N>::new(0.0);
            if c < heads {
                let src = b * q_b + c * q_h + t * q_t + j;
                x1 = Vector::cast_from(dq[src]);
                x2 = Vector::cast_from(dq[src + half]);
            } else {
                let src = b * kv_b + (c - heads) * kv_h + t * kv_t + j;
                x1 = Vector::cast_from(dk[src]);
                x2 = Vector::cast_from(dk[src + half]);
            }
            // The inverse rotation: by -angle.
            let (cv, sv) = angle(cos, sin, t * half + j, true);
            let (y1, y2) = rotate_pair(x1, x2, cv, sv);
            dqkv[dst] = Vector::cast_from(y1);
            dqkv[dst + half] = Vector::cast_from(y2);
        }
    }
}

/// RoPE on the query and key heads of a packed projection `[B, T, all_heads hd]`, in place: one
/// unit per vector of `N` pairs (i, i + half) of rotated head `c` (the first `rotated_heads`: q's,
/// then k's) at token (b, t). `half` is in vectors.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn rotate_packed_in_place<F: Float, W: Float, N: Size>(
    qkv: &mut Array<Vector<F, N>>,
    cos: &Array<Vector<W, N>>,
    sin: &Array<Vector<W, N>>,
    rotated_heads: usize,
    all_heads: usize,
    seq: usize,
    half: usize,
    total: usize,
    #[define(F, W)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i < total {
        let j = i % half;
        let rest = i / half;
        let c = rest % rotated_heads;
        let bt = rest / rotated_heads;
        let t = bt % seq;
        let at = (bt * all_heads + c) * 2 * half + j;
        let x1 = Vector::<f32, N>::cast_from(qkv[at]);
        let x2 = Vector::<f32, N>::cast_from(qkv[at + half]);
        let (cv, sv) = angle(cos, sin, t * half + j, false);
        let (y1, y2) = rotate_pair(x1, x2, cv, sv);
        qkv[at] = Vector::cast_from(y1);
        qkv[at + half] = Vector::cast_from(y2);
    }
}

/// [`rotate_packed_in_place`] into a new dense tensor `out`: every head `c` of `all_heads` at token
/// (b, t), the first `rotated_heads` rotated, the others (v's) copied.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn rotate_packed<F: Float, W: Float, N: Size>(
    qkv: &Array<Vector<F, N>>,
    out: &mut Array<Vector<F, N>>,
    cos: &Array<Vector<W, N>>,
    sin: &Array<Vector<W, N>>,
    rotated_heads: usize,
    all_heads: usize,
    seq: usize,
    half: usize,
    total: usize,
    #[define(F, W)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i < total {
        let j = i % half;
        let rest = i / half;
        let c = rest % all_heads;
        let t = (rest / all_heads) % seq;
        let at = rest * 2 * half + j;
        if c < rotated_heads {
            let x1 = Vector::<f32, N>::cast_from(qkv[at]);
            let x2 = Vector::<f32, N>::cast_from(qkv[at + half]);
            let (cv, sv) = angle(cos, sin, t * half + j, false);
            let (y1, y2) = rotate_pair(x1, x2, cv, sv);
            out[at] = Vector::cast_from(y1);
            out[at + half] = Vector::cast_from(y2);
        } else {
            out[at] = qkv[at];
            out[at + half] = qkv[at + half];
        }
    }
}
