//! Launches of the FlashAttention kernels on `CubeBackend` tensors: argument checks, the choice
//! between the tensor-core and the portable kernels, block sizes, output layouts.

use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::ir::features::MmaConfig;
use cubecl::prelude::*;

use super::kernel::{flash_backward_dkdv, flash_backward_dq, flash_delta, flash_forward};
use super::mma::{flash_backward_dkdv_mma, flash_backward_dq_mma, flash_forward_mma};
use crate::check::{check_float, check_same_dtype, fail};
use crate::launch::{contiguous, empty, vector_width};

/// Largest head dimension the kernels accept (the portable kernels keep a row in registers).
pub const MAX_HEAD_DIM: usize = 256;
/// Warps per cube of the tensor-core kernels.
const PLANES: usize = 4;

/// Tile shapes of the tensor-core kernels: row tiles of 16 per warp (`mt`, so a cube owns
/// `PLANES * mt * 16` rows) and the depth of the blocks streamed past them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MmaTiles {
    /// Forward: query row tiles per warp, keys per block.
    pub fwd: (usize, usize),
    /// dQ: query row tiles per warp, keys per block.
    pub dq: (usize, usize),
    /// dK/dV: key row tiles per warp, queries per block.
    pub dkdv: (usize, usize),
}

/// Environment variable that overrides [`MmaTiles`] for tuning (read by `attention_bench`
/// sweeps): `fwd=MTxBLOCK,dq=MTxBLOCK,dkdv=MTxBLOCK`, any subset, e.g. `fwd=2x64,dkdv=1x32`.
pub const TILES_ENV: &str = "BURNMIX_FLASH_TILES";

impl MmaTiles {
    /// Defaults for the H100, per head_dim, from `attention_bench` sweeps at S = 4096 (see
    /// docs/results.md). Two row tiles per warp halve the shared-memory reads per MMA (see
    /// `mma.rs`). The block depths are set by registers: the forward keeps O (2 x 16 x hd f32)
    /// and only 16 keys of S per block, because with 32 keys at hd 128 the kernel hit 255
    /// registers and spilled (Nsight Compute: local-memory stalls on half of all cycles), and
    /// 16 was faster at hd 64 as well. dQ and dK/dV hold two accumulators the size of O (or dQ
    /// and S, dP): shallow blocks (16) keep them in registers, and the row tiles are the best
    /// measured pair per head_dim.
    fn for_head_dim(hd: usize) -> Self {
        if hd > 64 {
            MmaTiles { fwd: (2, 16), dq: (2, 16), dkdv: (1, 64) }
        } else {
            MmaTiles { fwd: (2, 16), dq: (1, 16), dkdv: (2, 16) }
        }
    }

    /// The defaults, with any override from [`TILES_ENV`].
    pub(crate) fn get(hd: usize) -> Self {
        let mut tiles = Self::for_head_dim(hd);
        if let Ok(spec) = std::env::var(TILES_ENV) {
            if let Err(e) = tiles.apply(&spec) {
                panic!("{TILES_ENV}={spec:?}: {e}");
            }
        }
        tiles
    }

    /// Applies `fwd=2x64,dq=1x32,...`: row tiles 1, 2 or 4; block depth a multiple of 16 from 16 to 128.
    fn apply(&mut self, spec: &str) -> Result<(), String> {
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, value) = item.split_once('=').ok_or_else(|| format!("`{item}` is not NAME=MTxBLOCK"))?;
            let (mt, block) = value.split_once('x').ok_or_else(|| format!("`{value}` is not MTxBLOCK (e.g. 2x64)"))?;
            let mt: usize = mt.parse().map_err(|_| format!("row tiles `{mt}` is not a number"))?;
            let block: usize = block.parse().map_err(|_| format!("block `{block}` is not a number"))?;
            if ![1, 2, 4].contains(&mt) || block % 16 != 0 || !(16..=128).contains(&block) {
                return Err(format!("`{item}`: row tiles must be 1, 2 or 4 and the block a multiple of 16 from 16 to 128"));
            }
            match name {
                "fwd" => self.fwd = (mt, block),
                "dq" => self.dq = (mt, block),
                "dkdv" => self.dkdv = (mt, block),
                _ => return Err(format!("unknown kernel `{name}`; expected fwd, dq or dkdv")),
            }
        }
        Ok(())
    }
}

/// Which kernels run for a given input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashPath {
    /// Warp-level `mma.sync` m16n8k16 (f16/bf16 on CUDA, head_dim a multiple of 16 up to 128).
    TensorCores,
    /// One unit per row, f32 FMA (every runtime and dtype).
    Portable,
}

impl std::fmt::Display for FlashPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FlashPath::TensorCores => "tensor cores (mma.sync m16n8k16)",
            FlashPath::Portable => "portable (f32 FMA)",
        })
    }
}

/// The path [`forward`] and [`backward`] take for `q`.
pub(crate) fn path<R: CubeRuntime>(q: &CubeTensor<R>) -> FlashPath {
    let hd = q.meta.shape()[q.meta.num_dims() - 1];
    let props = q.client.properties();
    let low = matches!(q.dtype, DType::F16 | DType::BF16);
    let warp32 = props.hardware.plane_size_min == 32 && props.hardware.plane_size_max == 32;
    let mma = low
        && warp32
        && props.features.matmul.mma.contains(&MmaConfig {
            a_type: q.dtype.into(),
            b_type: q.dtype.into(),
            cd_type: DType::F32.into(),
            m: 16,
            n: 8,
            k: 16,
        });
    if mma && hd % 16 == 0 && hd <= 128 { FlashPath::TensorCores } else { FlashPath::Portable }
}

struct Dims {
    batch: usize,
    heads: usize,
    seq_q: usize,
    seq_k: usize,
    hd: usize,
}

fn check_inputs<R: CubeRuntime>(op: &str, q: &CubeTensor<R>, k: &CubeTensor<R>, v: &CubeTensor<R>) -> Dims {
    check_float(op, "q", q.dtype);
    check_same_dtype(op, "q", q.dtype, "k", k.dtype);
    check_same_dtype(op, "q", q.dtype, "v", v.dtype);
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    let (qd, kd, vd) = (qs.as_slice(), ks.as_slice(), vs.as_slice());
    if qd.len() != 4 || kd.len() != 4 || vd.len() != 4 {
        fail(op, format!("q, k, v have shapes {qd:?}, {kd:?}, {vd:?}; each must be [batch, heads, seq, head_dim]"));
    }
    if kd != vd || qd[0] != kd[0] || qd[1] != kd[1] || qd[3] != kd[3] {
        fail(
            op,
            format!("q, k, v have shapes {qd:?}, {kd:?}, {vd:?}; k and v must match, and share batch, heads and head_dim with q"),
        );
    }
    let d = Dims { batch: qd[0], heads: qd[1], seq_q: qd[2], seq_k: kd[2], hd: qd[3] };
    if d.hd == 0 || d.hd > MAX_HEAD_DIM {
        fail(op, format!("head_dim is {}; supported: 1 to {MAX_HEAD_DIM} (tensor cores for multiples of 16 up to 128)", d.hd));
    }
    if d.seq_k == 0 && d.seq_q > 0 {
        fail(op, format!("k and v have no positions (shape {kd:?}); every query needs at least one key"));
    }
    let max_y = q.client.properties().hardware.max_cube_count.1 as usize;
    if d.batch * d.heads > max_y {
        fail(op, format!("batch x heads is {}; this device launches at most {max_y}", d.batch * d.heads));
    }
    d
}

/// Unit last stride (copied otherwise); other strides are read as they are.
fn rows_readable<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
    if t.meta.strides()[3] == 1 { t } else { contiguous(t) }
}

/// A new `[batch, heads, seq, hd]` tensor laid out as `[batch, seq, heads, hd]`: the layout the
/// model's output projection reads, so `swap_dims(1, 2).reshape(..)` after attention is free.
fn empty_bshd<R: CubeRuntime>(like: &CubeTensor<R>, d: &Dims, seq: usize) -> CubeTensor<R> {
    let t = empty(like, vec![d.batch, seq, d.heads, d.hd], like.dtype);
    burn_cubecl::ops::permute(t, &[0, 2, 1, 3])
}

/// Units per row of the portable kernels: the fewest (up to 8) that divide head_dim into parts of
/// at most 32 columns (1 if none does). Each unit's columns are unrolled; wider parts made
/// llvmpipe's shader compiler slow (200 s for one kernel at 128 columns).
fn portable_split(hd: usize) -> usize {
    (1..=8).find(|s| hd % s == 0 && hd / s <= 32).unwrap_or(1)
}

/// `(rows per block, units per row)` of the portable kernels: 32 rows, fewer when the staged f32
/// tiles and partial scores would not fit the device's shared memory or the cube would be too big.
fn portable_block<R: CubeRuntime>(q: &CubeTensor<R>, hd: usize) -> (usize, usize) {
    let props = q.client.properties();
    let smem = props.hardware.max_shared_memory_size;
    let max_units = (props.hardware.max_units_per_cube as usize).min(256);
    let split = portable_split(hd);
    let mut rows = 32;
    while rows > 1 && (2 * rows * hd * 4 + 2 * rows * rows * split * 4 + 2 * rows * 4 > smem || rows * split > max_units) {
        rows /= 2;
    }
    (rows, split)
}

/// `(out, lse)`: attention output [B, H, Sq, hd] in q's dtype and the f32 log-sum-exp of the
/// scaled scores per query row, [B, H, Sq].
pub(crate) fn forward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    causal: bool,
    scale: f32,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let d = check_inputs("flash_attention", &q, &k, &v);
    let (q, k, v) = (rows_readable(q), rows_readable(k), rows_readable(v));
    let out = empty_bshd(&q, &d, d.seq_q);
    let lse = empty(&q, vec![d.batch, d.heads, d.seq_q], DType::F32);
    if d.seq_q == 0 || d.batch * d.heads == 0 {
        return (out, lse);
    }
    let client = q.client.clone();
    let dtype: StorageType = q.dtype.into();
    let bh = (d.batch * d.heads) as u32;
    match path(&q) {
        FlashPath::TensorCores => {
            // Tiles are copied with cp.async, which moves 4, 8 or 16 bytes: rows whose strides
            // are odd (in elements) are copied to a contiguous layout first.
            let (q, k, v) = if mma_width(&q, &k, &v, None, &d) < 2 { (contiguous(q), contiguous(k), contiguous(v)) } else { (q, k, v) };
            let width = mma_width(&q, &k, &v, None, &d);
            let (mt, block_k) = MmaTiles::get(d.hd).fwd;
            let block_q = PLANES * mt * 16;
            unsafe {
                flash_forward_mma::launch_unchecked::<R>(
                    &client,
                    CubeCount::Static(d.seq_q.div_ceil(block_q) as u32, bh, 1),
                    CubeDim::new_2d(32, PLANES as u32),
                    width,
                    q.into_tensor_arg(),
                    k.into_tensor_arg(),
                    v.into_tensor_arg(),
                    out.clone().into_tensor_arg(),
                    lse.clone().into_tensor_arg(),
                    d.heads,
                    d.seq_q,
                    d.seq_k,
                    scale,
                    d.hd,
                    PLANES,
                    mt,
                    block_k,
                    width,
                    causal,
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
                    d.hd,
                    split,
                    block,
                    block,
                    causal as u32,
                    dtype,
                );
            }
        }
    }
    (out, lse)
}

/// Widest vector for the tensor-core kernels' tile loads: divides head_dim and every stride.
fn mma_width<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    grad: Option<&CubeTensor<R>>,
    d: &Dims,
) -> usize {
    let mut lens = vec![d.hd];
    for t in [Some(q), Some(k), Some(v), grad].into_iter().flatten() {
        lens.extend_from_slice(&t.meta.strides()[..3]);
    }
    vector_width(q, &[q.dtype], &lens)
}

/// `(dq, dk, dv)` from the inputs, the forward's output and log-sum-exp, and the output gradient.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    grad: CubeTensor<R>,
    causal: bool,
    scale: f32,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let op = "flash_attention backward";
    let d = check_inputs(op, &q, &k, &v);
    check_same_dtype(op, "q", q.dtype, "output gradient", grad.dtype);
    if grad.shape().as_slice() != q.shape().as_slice() {
        fail(op, format!("output gradient has shape {:?}; expected {:?}", grad.shape().as_slice(), q.shape().as_slice()));
    }
    let (q, k, v) = (rows_readable(q), rows_readable(k), rows_readable(v));
    let (out, grad, lse) = (rows_readable(out), rows_readable(grad), contiguous(lse));
    let dq = empty_bshd(&q, &d, d.seq_q);
    if d.seq_q == 0 || d.batch * d.heads == 0 {
        // No queries: k and v received no attention, so their gradients are zero.
        let zeros = |t: &CubeTensor<R>| burn_cubecl::ops::numeric::zeros::<R>(t.device.clone(), t.shape(), t.dtype);
        return (dq, zeros(&k), zeros(&v));
    }
    let dk = empty_bshd(&k, &d, d.seq_k);
    let dv = empty_bshd(&v, &d, d.seq_k);
    let client = q.client.clone();
    let dtype: StorageType = q.dtype.into();
    let bh = (d.batch * d.heads) as u32;

    // Pre-pass: delta = rowsum(dO * O), f32 [B * H * Sq].
    let rows = d.batch * d.heads * d.seq_q;
    let delta = empty(&q, vec![d.batch, d.heads, d.seq_q], DType::F32);
    unsafe {
        flash_delta::launch_unchecked::<R>(
            &client,
            CubeCount::Static(rows.div_ceil(256) as u32, 1, 1),
            CubeDim::new_1d(256),
            out.into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            rows,
            d.hd,
            dtype,
        );
    }

    match path(&q) {
        FlashPath::TensorCores => {
            let (q, k, v, grad) = if mma_width(&q, &k, &v, Some(&grad), &d) < 2 {
                (contiguous(q), contiguous(k), contiguous(v), contiguous(grad))
            } else {
                (q, k, v, grad)
            };
            let width = mma_width(&q, &k, &v, Some(&grad), &d);
            let tiles = MmaTiles::get(d.hd);
            let (mt, block_k) = tiles.dq;
            unsafe {
                flash_backward_dq_mma::launch_unchecked::<R>(
                    &client,
                    CubeCount::Static(d.seq_q.div_ceil(PLANES * mt * 16) as u32, bh, 1),
                    CubeDim::new_2d(32, PLANES as u32),
                    width,
                    q.clone().into_tensor_arg(),
                    k.clone().into_tensor_arg(),
                    v.clone().into_tensor_arg(),
                    grad.clone().into_tensor_arg(),
                    lse.clone().into_tensor_arg(),
                    delta.clone().into_tensor_arg(),
                    dq.clone().into_tensor_arg(),
                    d.heads,
                    d.seq_q,
                    d.seq_k,
                    scale,
                    d.hd,
                    PLANES,
                    mt,
                    block_k,
                    width,
                    causal,
                    dtype,
                );
            }
            let (mt, block_q) = tiles.dkdv;
            unsafe {
                flash_backward_dkdv_mma::launch_unchecked::<R>(
                    &client,
                    CubeCount::Static(d.seq_k.div_ceil(PLANES * mt * 16) as u32, bh, 1),
                    CubeDim::new_2d(32, PLANES as u32),
                    width,
                    q.into_tensor_arg(),
                    k.into_tensor_arg(),
                    v.into_tensor_arg(),
                    grad.into_tensor_arg(),
                    lse.into_tensor_arg(),
                    delta.into_tensor_arg(),
                    dk.clone().into_tensor_arg(),
                    dv.clone().into_tensor_arg(),
                    d.heads,
                    d.seq_q,
                    d.seq_k,
                    scale,
                    d.hd,
                    PLANES,
                    mt,
                    block_q,
                    width,
                    causal,
                    dtype,
                );
            }
        }
        FlashPath::Portable => {
            let (block, split) = portable_block(&q, d.hd);
            unsafe {
                flash_backward_dq::launch_unchecked::<R>(
                    &client,
                    CubeCount::Static(d.seq_q.div_ceil(block) as u32, bh, 1),
                    CubeDim::new_1d((block * split) as u32),
                    q.clone().into_tensor_arg(),
                    k.clone().into_tensor_arg(),
                    v.clone().into_tensor_arg(),
                    grad.clone().into_tensor_arg(),
                    lse.clone().into_tensor_arg(),
                    delta.clone().into_tensor_arg(),
                    dq.clone().into_tensor_arg(),
                    scale,
                    d.hd,
                    split,
                    block,
                    block,
                    causal as u32,
                    dtype,
                );
            }
            unsafe {
                flash_backward_dkdv::launch_unchecked::<R>(
                    &client,
                    CubeCount::Static(d.seq_k.div_ceil(block) as u32, bh, 1),
                    CubeDim::new_1d((block * split) as u32),
                    q.into_tensor_arg(),
                    k.into_tensor_arg(),
                    v.into_tensor_arg(),
                    grad.into_tensor_arg(),
                    lse.into_tensor_arg(),
                    delta.into_tensor_arg(),
                    dk.clone().into_tensor_arg(),
                    dv.clone().into_tensor_arg(),
                    scale,
                    d.hd,
                    split,
                    block,
                    block,
                    causal as u32,
                    dtype,
                );
            }
        }
    }
    (dq, dk, dv)
}

#[cfg(test)]
mod tests {
    use super::MmaTiles;

    #[test]
    fn tile_override_parses_and_rejects_bad_specs() {
        let mut t = MmaTiles::for_head_dim(128);
        t.apply("fwd=1x64, dkdv=2x16").unwrap();
        assert_eq!(t, MmaTiles { fwd: (1, 64), dkdv: (2, 16), ..MmaTiles::for_head_dim(128) });
        for bad in ["fwd=3x64", "fwd=2x24", "fwd=2x256", "fwd=2", "bwd=1x64", "fwd"] {
            let err = MmaTiles::for_head_dim(64).apply(bad).unwrap_err();
            assert!(!err.is_empty(), "{bad}");
        }
    }
}
