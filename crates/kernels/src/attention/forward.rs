//! The FlashAttention forward's launch on `CubeBackend` tensors, and what the backward's launches
//! share with it: argument checks, block sizes of the portable kernels, output layouts.

use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;

pub(crate) use super::dims::Dims;
use super::kernel::flash_forward;
use super::mma::flash_forward_mma;
use super::tiles::{path, FlashPath, MmaTiles, MAX_HEAD_DIM};
use crate::check::{check_float, check_same_dtype, check_scale, fail};
use crate::dropout::{DropArgs, Dropout};
use crate::launch::{contiguous, empty, vector_width};

/// Checks q `[batch, heads, seq_q, hd]` and k, v `[batch, kv_heads, seq_k, hd]` (one float
/// dtype, `kv_heads` dividing `heads`) and returns their sizes.
pub(crate) fn check_inputs<R: CubeRuntime>(
    op: &str,
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
) -> Dims {
    check_float(op, "q", q.dtype);
    check_same_dtype(op, "q", q.dtype, "k", k.dtype);
    check_same_dtype(op, "q", q.dtype, "v", v.dtype);
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    let (qd, kd, vd) = (qs.as_slice(), ks.as_slice(), vs.as_slice());
    if qd.len() != 4 || kd.len() != 4 || vd.len() != 4 {
        fail(op, format!("q, k, v have shapes {qd:?}, {kd:?}, {vd:?}; each must be [batch, heads, seq, head_dim]"));
    }
    if kd != vd || qd[0] != kd[0] || qd[3] != kd[3] {
        fail(
            op,
            format!("q, k, v have shapes {qd:?}, {kd:?}, {vd:?}; k and v must match, and share batch and head_dim with q"),
        );
    }
    let d = Dims {
        batch: qd[0],
        heads: qd[1],
        kv_heads: kd[1],
        group: super::kv_group(op, qd[1], kd[1]),
        seq_q: qd[2],
        seq_k: kd[2],
        hd: qd[3],
    };
    if d.hd == 0 || d.hd > MAX_HEAD_DIM {
        fail(op, format!("head_dim is {}; supported: 1 to {MAX_HEAD_DIM} (tensor cores for multiples of 16 up to 128)", d.hd));
    }
    if d.seq_k == 0 && d.seq_q > 0 {
        fail(
            op,
            format!("k and v have no positions (shape {kd:?}); every query needs at least one key"),
        );
    }
    let max_y = q.client.properties().hardware.max_cube_count.1 as usize;
    if d.batch * d.heads > max_y {
        fail(
            op,
            format!(
                "batch x heads is {}; this device launches at most {max_y}",
                d.batch * d.heads
            ),
        );
    }
    d
}

/// The kernels' dropout arguments, after checking `p`.
pub(crate) fn drop_args(op: &str, dropout: Option<Dropout>) -> DropArgs {
    crate::dropout::check(op, dropout);
    DropArgs::new(dropout)
}

/// Unit last stride (copied otherwise); other strides are read as they are.
pub(crate) fn rows_readable<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
    if t.meta.strides()[3] == 1 {
        t
    } else {
        contiguous(t)
    }
}

/// A new `[batch, heads, seq, hd]` tensor laid out as `[batch, seq, heads, hd]`: the layout the
/// model's output projection reads, so `swap_dims(1, 2).reshape(..)` after attention is free.
pub(crate) fn empty_bshd<R: CubeRuntime>(
    like: &CubeTensor<R>,
    d: &Dims,
    heads: usize,
    seq: usize,
) -> CubeTensor<R> {
    let t = empty(like, vec![d.batch, seq, heads, d.hd], like.dtype);
    burn_cubecl::ops::permute(t, &[0, 2, 1, 3])
}

/// Units per row of the portable kernels: the fewest (up to 8) that divide head_dim into parts of
/// at most 32 columns (1 if none does). Each unit's columns are unrolled; wider parts made
/// llvmpipe's shader compiler slow (200 s for one kernel at 128 columns).
fn portable_split(hd: usize) -> usize {
    (1..=8)
        .find(|&s| hd.is_multiple_of(s) && hd / s <= 32)
        .unwrap_or(1)
}

/// `(rows per block, units per row)` of the portable kernels: 32 rows, fewer when the staged f32
/// tiles and partial scores would not fit the device's shared memory or the cube would be too big.
pub(crate) fn portable_block<R: CubeRuntime>(q: &CubeTensor<R>, hd: usize) -> (usize, usize) {
    let props = q.client.properties();
    let smem = props.hardware.max_shared_memory_size;
    let max_units = (props.hardware.max_units_per_cube as usize).min(256);
    let split = portable_split(hd);
    let mut rows = 32;
    while rows > 1
        && (2 * rows * hd * 4 + 2 * rows * rows * split * 4 + 2 * rows * 4 > smem
            || rows * split > max_units)
    {
        rows /= 2;
    }
    (rows, split)
}

/// `(out, lse)`: attention output [B, H, Sq, hd] in q's dtype and the f32 log-sum-exp of the
/// scaled scores per query row, [B, H, Sq], from q [B, H, Sq, hd] and k, v [B, Hkv, Sk, hd]
/// (query head `h` attends with k/v head `h / (H / Hkv)`).
pub(crate) fn forward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    causal: bool,
    scale: f32,
    dropout: Option<Dropout>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let d = check_inputs("flash_attention", &q, &k, &v);
    check_scale("flash_attention", scale as f64);
    let drop = drop_args("flash_attention", dropout);
    let (q, k, v) = (rows_readable(q), rows_readable(k), rows_readable(v));
    let out = empty_bshd(&q, &d, d.heads, d.seq_q);
    let lse = empty(&q, vec![d.batch, d.heads, d.seq_q], DType::F32);
    if d.seq_q == 0 || d.batch * d.heads == 0 {
        return (out, lse);
    }
    let client = q.client.clone();
    let dtype: StorageType = q.dtype.into();
    let bh = (d.batch * d.heads) as u32;
    let flash_path = path(&q);
    if crate::settings::read(|s| s.flash_fp8) {
        if flash_path == FlashPath::TensorCores
            && super::hopper::applies_fp8(&q, &k, &v, &d, drop.on)
        {
            match super::hopper::forward_fp8(&q, &k, &v, &out, &lse, &d, causal, scale) {
                Ok(()) => return (out, lse),
                Err(why) => super::hopper::refused(super::hopper::Kernel::ForwardFp8, &why),
            }
        } else {
            super::hopper::fp8_not_applicable();
        }
    }
    if flash_path == FlashPath::TensorCores && super::hopper::applies(&q, &k, &v, &d, drop.on) {
        match super::hopper::forward(&q, &k, &v, &out, &lse, &d, causal, scale) {
            Ok(()) => return (out, lse),
            Err(why) => super::hopper::refused(super::hopper::Kernel::Forward, &why),
        }
    }
    match flash_path {
        FlashPath::TensorCores => {
            // Tiles are copied with cp.async, which moves 4, 8 or 16 bytes: rows whose strides
            // are odd (in elements) are copied to a contiguous layout first.
            let (q, k, v) = if mma_width(&q, &k, &v, None, &d) < 2 {
                (contiguous(q), contiguous(k), contiguous(v))
            } else {
                (q, k, v)
            };
            let width = mma_width(&q, &k, &v, None, &d);
            let tiles = MmaTiles::get(d.hd, causal);
            let ((mt, block_k), planes) = (tiles.fwd, tiles.fwd_planes);
            let block_q = planes * mt * 16;
            let props = client.properties();
            let smem = props.hardware.max_shared_memory_size;
            let stages = tiles.forward_stages(d.hd, q.dtype.size(), smem);
            // The output leaves through shared memory (see `store_rows_staged`): put there by
            // `stmatrix` where the device has it (sm_90), else a pair of elements at a time.
            let stmatrix = tiles.stmatrix && props.features.matmul.stmatrix.contains(&dtype);
            let ow = if stmatrix { 8 } else { 2 };
            unsafe {
                flash_forward_mma::launch_unchecked::<R>(
                    &client,
                    CubeCount::Static(d.seq_q.div_ceil(block_q) as u32, bh, 1),
                    CubeDim::new_2d(32, planes as u32),
                    width,
                    ow,
                    q.into_tensor_arg(),
                    k.into_tensor_arg(),
                    v.into_tensor_arg(),
                    out.clone().into_tensor_arg(),
                    lse.clone().into_tensor_arg(),
                    d.heads,
                    d.group,
                    d.seq_q,
                    d.seq_k,
                    scale,
                    d.hd,
                    planes,
                    mt,
                    block_k,
                    width,
                    causal,
                    stages,
                    ow,
                    stmatrix,
                    drop.scalars(),
                    drop.on,
                    dtype,
                );
            }
        }
        FlashPath::Portable => {
            let (block, split) = portable_block(&q, d.hd);
            unsafe {
                flash_forward::launch_unchecked::<R>(
                    &client,
                    CubeCount::Static(d.seq_q.div_ceil(block) as u32, bh, 1),
                    CubeDim::new_1d((block * split) as u32),
                    q.into_tensor_arg(),
                    k.into_tensor_arg(),
                    v.into_tensor_arg(),
                    out.clone().into_tensor_arg(),
                    lse.clone().into_tensor_arg(),
                    scale,
                    d.group,
                    d.hd,
                    split,
                    block,
                    block,
                    causal as u32,
                    drop.scalars(),
                    drop.on,
                    dtype,
                );
            }
        }
    }
    (out, lse)
}

/// `[B, H, T, hd]` laid out as `[B, T, H, hd]` (the forward's output) -> `[B, T, H hd]`, no copy.
pub(crate) fn merge_heads<R: CubeRuntime>(out: CubeTensor<R>) -> CubeTensor<R> {
    let shape = out.shape();
    let [b, h, t, hd] = [shape[0], shape[1], shape[2], shape[3]];
    let out = burn_cubecl::ops::permute(out, &[0, 2, 1, 3]);
    burn_cubecl::ops::reshape(out, [b, t, h * hd].into())
}

/// Widest vector of `dtypes` along the rows of `[batch, heads, seq, hd]` tensors (unit last
/// stride): it divides `hd` and the first three strides of every tensor in `ts`.
pub(crate) fn row_width<R: CubeRuntime>(
    ts: &[&CubeTensor<R>],
    dtypes: &[DType],
    hd: usize,
) -> usize {
    let mut lens = vec![hd];
    for t in ts {
        lens.extend_from_slice(&t.meta.strides()[..3]);
    }
    vector_width(ts[0], dtypes, &lens)
}

/// Widest vector for the tensor-core kernels' tile loads: divides head_dim and every stride.
pub(crate) fn mma_width<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    grad: Option<&CubeTensor<R>>,
    d: &Dims,
) -> usize {
    let ts: Vec<&CubeTensor<R>> = [Some(q), Some(k), Some(v), grad]
        .into_iter()
        .flatten()
        .collect();
    row_width(&ts, &[q.dtype], d.hd)
}
