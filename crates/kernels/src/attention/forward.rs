//! Launches of the FlashAttention kernels on `CubeBackend` tensors: argument checks, the choice
//! between the tensor-core and the portable kernels, block sizes, output layouts.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::ir::features::{AtomicUsage, MmaConfig};
use cubecl::ir::{ElemType, FloatKind, Type};
use cubecl::prelude::*;

use super::kernel::{flash_backward_dkdv, flash_backward_dq, flash_delta, flash_forward};
use super::mma::{
    dq_from_f32, flash_backward_dkdv_mma, flash_backward_dq_mma, flash_backward_split_mma,
    flash_forward_mma,
};
use crate::check::{check_float, check_same_dtype, check_scale, fail};
use crate::dropout::{DropArgs, Dropout};
use crate::launch::{contiguous, empty, plane_size, use_planes, vector_width};

/// Largest head dimension the kernels accept (the portable kernels keep a row in registers).
pub const MAX_HEAD_DIM: usize = 256;
/// Warps per cube of the tensor-core kernels unless [`MmaTiles`] says otherwise.
const PLANES: usize = 4;
/// Key/value buffers of the tensor-core forward unless [`MmaTiles`] says otherwise: each block is
/// copied one block ahead of its use. Three buffers (two ahead) measured the same on an H100 (see
/// docs/results.md, 2026-11-27 (day)) and would cost hd 128 its second cube per SM next to the
/// output's staging rows.
const FWD_STAGES: usize = 2;

/// Tile shapes of the tensor-core kernels: row tiles of 16 per warp (`mt`, so a cube owns
/// `planes * mt * 16` rows), the depth of the blocks streamed past them, the warps per cube, and
/// where dQ is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MmaTiles {
    /// Forward: query row tiles per warp, keys per block.
    pub fwd: (usize, usize),
    /// dQ: query row tiles per warp, keys per block.
    pub dq: (usize, usize),
    /// dK/dV: key row tiles per warp, queries per block.
    pub dkdv: (usize, usize),
    /// Warps per cube of the forward, dQ and dK/dV kernels (a cube owns `planes * mt * 16` rows).
    pub fwd_planes: usize,
    pub dq_planes: usize,
    pub dkdv_planes: usize,
    /// Key/value buffers of the forward's ring (2 or 3): blocks copied `fwd_stages - 1` ahead.
    pub fwd_stages: usize,
    /// The forward stages its output with `stmatrix` where the device has it (sm_90); off, a
    /// pair of elements per lane and tile (the path of devices without it).
    pub stmatrix: bool,
    /// dQ inside the dK/dV kernel (`dS k` from a shared-memory dS, added to an f32 buffer with
    /// atomics) instead of the separate dQ kernel, which recomputes `q k^T` and `dO v^T`.
    pub fused_dq: bool,
    /// The dK/dV kernel splits each query block's work over its warps in FlashAttention-2's
    /// layouts (`flash_backward_split_mma`: 32 keys a warp, P^T and dS^T through shared memory;
    /// dQ there where `fused_dq`) instead of giving each warp whole key rows.
    pub split_bwd: bool,
}

impl MmaTiles {
    /// Defaults per head_dim and mask, from `attention_bench` sweeps (see docs/results.md,
    /// 2026-11-23 (later), 2026-11-26 (late), 2026-11-27 and 2026-11-27 (final)). Two row tiles
    /// per warp halve the shared-memory reads per MMA (see `mma/fragments.rs`); 32-key forward
    /// blocks beat 16 (hd 128: 222 against 178 TFLOP/s on an H100) and matched 48 and 64 within
    /// the run-to-run spread. Forward blocks: 128 keys at hd 64 (H100, three alternated runs,
    /// 2026-11-27 (late)): 7-10% over 32 without a mask at S = 1024 to 8192, 4-10% with the
    /// causal mask from S = 2048 on, equal at causal S = 1024; 64 and 96 fell between. At hd 128,
    /// 32 keys: 48 and 64 lost 15-25% there (the score tile next to 128 output accumulators a
    /// lane).
    ///
    /// **Backward at hd 128** (and other multiples of 32 but 64): FlashAttention-2's split warp
    /// layouts with dQ fused, 8-warp cubes of 128 keys (32 a warp), 64-query blocks, with either
    /// mask. H100, 2026-11-27 (final): causal S = 4096 217-219 TFLOP/s against 192-194 for the
    /// whole-row layout with the separate dQ kernel (the previous default), S = 1024 144-150
    /// against 136-140; without the mask 248-251 against 217-218. The split layout's 4-warp
    /// causal cubes lost (121-123 and 170-171). Other multiples of 16 keep the whole-row layout
    /// with the separate dQ kernel (2 x 32) and dK/dV cubes of one row tile per warp.
    ///
    /// **At hd 64** the fused dQ in the whole-row layout wins (193 against 177): 8 warps x 2 row
    /// tiles = 256 keys per cube, 32-query blocks; the split layout lost (causal S = 4096 188
    /// against 227). **Causal masks** take its dK/dV cubes of 4 warps (half the keys per cube): a
    /// key block's work shrinks with its position (it meets only the queries at or after it),
    /// and smaller cubes even out the tail. H200, S = 1024: hd 64 backward 110.6-111.2 TFLOP/s
    /// with 8 warps against 121.7-121.8 with 4 (SDPA: 153.7); without the mask 4 warps lost 2-4%
    /// at S = 4096, so full attention keeps 8.
    fn for_head_dim(hd: usize, causal: bool) -> Self {
        let dkdv_planes = if causal { 4 } else { 8 };
        if hd == 64 {
            MmaTiles {
                fwd: (2, 128),
                dq: (2, 32),
                dkdv: (2, 32),
                fwd_planes: PLANES,
                dq_planes: PLANES,
                dkdv_planes,
                fwd_stages: FWD_STAGES,
                stmatrix: true,
                fused_dq: true,
                split_bwd: false,
            }
        } else {
            // The split layout halves head_dim between two warps of a key group.
            let split = hd.is_multiple_of(32);
            MmaTiles {
                fwd: (2, 32),
                dq: (2, 32),
                dkdv: (1, 64),
                fwd_planes: PLANES,
                dq_planes: PLANES,
                dkdv_planes: if split { 8 } else { dkdv_planes },
                fwd_stages: FWD_STAGES,
                stmatrix: true,
                fused_dq: split,
                split_bwd: split,
            }
        }
    }

    /// The defaults, with any override from [`crate::settings::Settings::flash_tiles`].
    pub(crate) fn get(hd: usize, causal: bool) -> Self {
        let mut tiles = Self::for_head_dim(hd, causal);
        crate::settings::read(|s| {
            if let Some(t) = &s.flash_tiles {
                // Checked when the setting was made (`check_tiles`).
                if let Err(e) = tiles.apply(t.spec()) {
                    panic!("flash tiles {:?}: {e}", t.spec());
                }
            }
        });
        tiles
    }

    /// Applies `fwd=2x64,dq=1x32,...`: row tiles 1, 2 or 4; block depth a multiple of 16 from 16
    /// to 128; `NAME=MTxBLOCKxWARPS` also sets the kernel's warps per cube (4 or 8); `dq=fused` or
    /// `dq=separate` chooses where dQ is computed; `stages=2` or `3` sets the forward's key/value
    /// buffers; `stmatrix=off` stages the forward's output without `stmatrix`; `bwd=split` runs
    /// the dK/dV kernel in FlashAttention-2's warp layouts (with the fused or the separate dQ),
    /// `bwd=rows` with whole key rows per warp.
    fn apply(&mut self, spec: &str) -> Result<(), String> {
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, value) = item
                .split_once('=')
                .ok_or_else(|| format!("`{item}` is not NAME=MTxBLOCK"))?;
            if name == "dq" && (value == "fused" || value == "separate") {
                self.fused_dq = value == "fused";
                continue;
            }
            if name == "bwd" {
                self.split_bwd = match value {
                    "split" => true,
                    "rows" => false,
                    _ => {
                        return Err(format!(
                            "`{item}`: the backward layout must be `split` or `rows`"
                        ))
                    }
                };
                continue;
            }
            if name == "stmatrix" && (value == "on" || value == "off") {
                self.stmatrix = value == "on";
                continue;
            }
            if name == "stages" {
                self.fwd_stages = match value {
                    "2" => 2,
                    "3" => 3,
                    _ => return Err(format!("`{item}`: the forward's stages must be 2 or 3")),
                };
                continue;
            }
            let parts: Vec<&str> = value.split('x').collect();
            if parts.len() != 2 && parts.len() != 3 {
                let fused = if name == "dq" {
                    ", `fused` or `separate`"
                } else {
                    ""
                };
                return Err(format!(
                    "`{value}` is not MTxBLOCK or MTxBLOCKxWARPS (e.g. 2x64 or 1x64x8){fused}"
                ));
            }
            let num = |what: &str, x: &str| {
                x.parse::<usize>()
                    .map_err(|_| format!("{what} `{x}` is not a number"))
            };
            let (mt, block) = (num("row tiles", parts[0])?, num("block", parts[1])?);
            if ![1, 2, 4].contains(&mt) || block % 16 != 0 || !(16..=128).contains(&block) {
                return Err(format!("`{item}`: row tiles must be 1, 2 or 4 and the block a multiple of 16 from 16 to 128"));
            }
            let warps = match parts.get(2) {
                Some(w) => {
                    let w = num("warps", w)?;
                    if w != 4 && w != 8 {
                        return Err(format!("`{item}`: warps must be 4 or 8"));
                    }
                    w
                }
                None => PLANES,
            };
            match name {
                "fwd" => (self.fwd, self.fwd_planes) = ((mt, block), warps),
                "dq" => (self.dq, self.dq_planes) = ((mt, block), warps),
                "dkdv" => (self.dkdv, self.dkdv_planes) = ((mt, block), warps),
                _ => {
                    return Err(format!(
                        "unknown setting `{name}`; expected fwd, dq, dkdv, stages, stmatrix or bwd"
                    ))
                }
            }
        }
        Ok(())
    }

    /// The forward's key/value buffers: `fwd_stages`, or 2 where a third would not fit the cube's
    /// `smem` bytes of shared memory (large overridden tiles) with `elem`-byte elements.
    pub(crate) fn forward_stages(&self, hd: usize, elem: usize, smem: usize) -> usize {
        let ((mt, block_k), pitch) = (self.fwd, hd + 8);
        let bytes = |stages: usize| {
            (2 * self.fwd_planes * mt * 16 + 2 * stages * block_k) * pitch * elem + 64
        };
        if self.fwd_stages > 2 && bytes(self.fwd_stages) > smem {
            2
        } else {
            self.fwd_stages
        }
    }

    /// Why the backward cannot run with these dK/dV tiles at `hd`, if it cannot: the split
    /// layout gives each warp 32 keys, and the fused dQ's warps split the query block's 16-row
    /// tiles and head_dim into column groups of a multiple of 16.
    pub(crate) fn backward_problem(&self, hd: usize) -> Option<String> {
        let (row_tiles, planes) = (self.dkdv.1 / 16, self.dkdv_planes);
        if self.split_bwd {
            // 32 keys a warp: `planes * mt / 2` key warps, `2 / mt` query (column) groups.
            let (mt, block_q) = self.dkdv;
            let groups = if mt <= 2 { 2 / mt } else { 0 };
            if groups == 0
                || !block_q.is_multiple_of(16 * groups)
                || !hd.is_multiple_of(16 * groups)
            {
                return Some(format!(
                    "bwd=split gives each warp 32 keys: dkdv's row tiles must be 1 or 2, and with 1 the query block \
                     ({block_q}) and head_dim ({hd}) must split into two groups of a multiple of 16"
                ));
            }
        }
        if !self.fused_dq {
            return None;
        }
        let ok = if row_tiles >= planes {
            row_tiles % planes == 0
        } else {
            planes.is_multiple_of(row_tiles) && (hd / (planes / row_tiles)).is_multiple_of(16)
        };
        (!ok).then(|| {
            format!(
                "dq=fused needs the dK/dV query block's {row_tiles} row tiles of 16 and its {planes} warps to divide one another, \
                 with head_dim {hd} split into column groups of a multiple of 16"
            )
        })
    }
}

/// Checks a tile override (see [`crate::settings::FlashTiles`]) without applying it.
pub(crate) fn check_tiles(spec: &str) -> Result<(), String> {
    MmaTiles::for_head_dim(128, false).apply(spec)
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
    let warp32 = plane_size(q) == 32;
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
    if mma && hd.is_multiple_of(16) && hd <= 128 {
        FlashPath::TensorCores
    } else {
        FlashPath::Portable
    }
}

struct Dims {
    batch: usize,
    heads: usize,
    seq_q: usize,
    seq_k: usize,
    hd: usize,
}

fn check_inputs<R: CubeRuntime>(
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
    if kd != vd || qd[0] != kd[0] || qd[1] != kd[1] || qd[3] != kd[3] {
        fail(
            op,
            format!("q, k, v have shapes {qd:?}, {kd:?}, {vd:?}; k and v must match, and share batch, heads and head_dim with q"),
        );
    }
    let d = Dims {
        batch: qd[0],
        heads: qd[1],
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
fn drop_args(op: &str, dropout: Option<Dropout>) -> DropArgs {
    crate::dropout::check(op, dropout);
    DropArgs::new(dropout)
}

/// Unit last stride (copied otherwise); other strides are read as they are.
fn rows_readable<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
    if t.meta.strides()[3] == 1 {
        t
    } else {
        contiguous(t)
    }
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
    (1..=8)
        .find(|&s| hd.is_multiple_of(s) && hd / s <= 32)
        .unwrap_or(1)
}

/// `(rows per block, units per row)` of the portable kernels: 32 rows, fewer when the staged f32
/// tiles and partial scores would not fit the device's shared memory or the cube would be too big.
fn portable_block<R: CubeRuntime>(q: &CubeTensor<R>, hd: usize) -> (usize, usize) {
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
/// scaled scores per query row, [B, H, Sq].
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
                    drop.key0,
                    drop.key1,
                    drop.threshold,
                    drop.scale,
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
                    d.hd,
                    split,
                    block,
                    block,
                    causal as u32,
                    drop.key0,
                    drop.key1,
                    drop.threshold,
                    drop.scale,
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
fn row_width<R: CubeRuntime>(ts: &[&CubeTensor<R>], dtypes: &[DType], hd: usize) -> usize {
    let mut lens = vec![hd];
    for t in ts {
        lens.extend_from_slice(&t.meta.strides()[..3]);
    }
    vector_width(ts[0], dtypes, &lens)
}

/// Widest vector for the tensor-core kernels' tile loads: divides head_dim and every stride.
fn mma_width<R: CubeRuntime>(
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
    dropout: Option<Dropout>,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let op = "flash_attention backward";
    let d = check_inputs(op, &q, &k, &v);
    check_scale(op, scale as f64);
    let drop = drop_args(op, dropout);
    check_same_dtype(op, "q", q.dtype, "output gradient", grad.dtype);
    if grad.shape().as_slice() != q.shape().as_slice() {
        fail(
            op,
            format!(
                "output gradient has shape {:?}; expected {:?}",
                grad.shape().as_slice(),
                q.shape().as_slice()
            ),
        );
    }
    let (q, k, v) = (rows_readable(q), rows_readable(k), rows_readable(v));
    let (out, grad, lse) = (rows_readable(out), rows_readable(grad), contiguous(lse));
    let dq = empty_bshd(&q, &d, d.seq_q);
    if d.seq_q == 0 || d.batch * d.heads == 0 {
        // No queries: k and v received no attention, so their gradients are zero.
        let zeros = |t: &CubeTensor<R>| {
            burn_cubecl::ops::numeric::zeros::<R>(t.device.clone(), t.shape(), t.dtype)
        };
        return (dq, zeros(&k), zeros(&v));
    }
    let dk = empty_bshd(&k, &d, d.seq_k);
    let dv = empty_bshd(&v, &d, d.seq_k);
    let client = q.client.clone();
    let dtype: StorageType = q.dtype.into();
    let bh = (d.batch * d.heads) as u32;

    let flash_path = path(&q);
    let tiles = MmaTiles::get(d.hd, causal);
    let fused_dq = flash_path == FlashPath::TensorCores && tiles.fused_dq;
    // The fused dQ accumulates in f32 through atomics from every key block's cube; the delta
    // pre-pass clears it.
    let dq_acc = if fused_dq {
        empty(&q, vec![d.batch, d.heads, d.seq_q, d.hd], DType::F32)
    } else {
        empty(&q, vec![4], DType::F32)
    };

    // Pre-pass: delta = rowsum(dO * O), f32 [B * H * Sq].
    let rows = d.batch * d.heads * d.seq_q;
    let delta = empty(&q, vec![d.batch, d.heads, d.seq_q], DType::F32);
    {
        let width = row_width(&[&out, &grad], &[q.dtype, DType::F32], d.hd);
        let per_row = d.hd / width;
        let plane = plane_size(&q) as usize;
        let split = if use_planes(&q, 256) {
            (1usize << per_row.trailing_zeros()).min(plane)
        } else {
            1
        };
        unsafe {
            flash_delta::launch_unchecked::<R>(
                &client,
                CubeCount::Static((rows * split).div_ceil(256) as u32, 1, 1),
                CubeDim::new_1d(256),
                width,
                out.into_tensor_arg(),
                grad.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                dq_acc.clone().into_tensor_arg(),
                rows,
                per_row,
                split,
                fused_dq,
                dtype,
            );
        }
    }

    match flash_path {
        FlashPath::TensorCores => {
            let (q, k, v, grad) = if mma_width(&q, &k, &v, Some(&grad), &d) < 2 {
                (
                    contiguous(q),
                    contiguous(k),
                    contiguous(v),
                    contiguous(grad),
                )
            } else {
                (q, k, v, grad)
            };
            let width = mma_width(&q, &k, &v, Some(&grad), &d);
            if let Some(problem) = tiles.backward_problem(d.hd) {
                fail(
                    op,
                    format!(
                        "flash tiles setting ({}): {problem} (tiles {tiles:?})",
                        crate::settings::FLASH_TILES_ENV
                    ),
                );
            }
            let (mt, block_k) = tiles.dq;
            if !tiles.fused_dq {
                unsafe {
                    flash_backward_dq_mma::launch_unchecked::<R>(
                        &client,
                        CubeCount::Static(
                            d.seq_q.div_ceil(tiles.dq_planes * mt * 16) as u32,
                            bh,
                            1,
                        ),
                        CubeDim::new_2d(32, tiles.dq_planes as u32),
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
                        tiles.dq_planes,
                        mt,
                        block_k,
                        width,
                        causal,
                        drop.key0,
                        drop.key1,
                        drop.threshold,
                        drop.scale,
                        drop.on,
                        dtype,
                    );
                }
            }
            let (mt, block_q) = tiles.dkdv;
            let planes = tiles.dkdv_planes;
            let count = CubeCount::Static(d.seq_k.div_ceil(planes * mt * 16) as u32, bh, 1);
            let dim = CubeDim::new_2d(32, planes as u32);
            // The fused dQ adds a lane's pair of f32 columns with one vector atomic where the
            // device has them (sm_90).
            let pair_atomics =
                Type::new(StorageType::Atomic(ElemType::Float(FloatKind::F32))).with_vector_size(2);
            let nq = if client
                .properties()
                .features
                .atomic_type_usage(pair_atomics)
                .contains(AtomicUsage::Add)
            {
                2
            } else {
                1
            };
            // Both dK/dV kernels take the same arguments.
            macro_rules! launch_dkdv {
                ($kernel:ident) => {
                    unsafe {
                        $kernel::launch_unchecked::<R>(
                            &client,
                            count,
                            dim,
                            width,
                            nq,
                            q.into_tensor_arg(),
                            k.into_tensor_arg(),
                            v.into_tensor_arg(),
                            grad.into_tensor_arg(),
                            lse.into_tensor_arg(),
                            delta.into_tensor_arg(),
                            dk.clone().into_tensor_arg(),
                            dv.clone().into_tensor_arg(),
                            dq_acc.clone().into_tensor_arg(),
                            d.heads,
                            d.seq_q,
                            d.seq_k,
                            scale,
                            d.hd,
                            planes,
                            mt,
                            block_q,
                            width,
                            causal,
                            tiles.fused_dq,
                            drop.key0,
                            drop.key1,
                            drop.threshold,
                            drop.scale,
                            drop.on,
                            dtype,
                        )
                    }
                };
            }
            if tiles.split_bwd {
                launch_dkdv!(flash_backward_split_mma);
            } else {
                launch_dkdv!(flash_backward_dkdv_mma);
            }
            if tiles.fused_dq {
                let width = row_width(&[&dq], &[dq.dtype, DType::F32], d.hd);
                let n = d.batch * d.heads * d.seq_q * d.hd / width;
                unsafe {
                    dq_from_f32::launch_unchecked::<R>(
                        &client,
                        CubeCount::Static(n.div_ceil(256) as u32, 1, 1),
                        CubeDim::new_1d(256),
                        width,
                        dq_acc.into_tensor_arg(),
                        dq.clone().into_tensor_arg(),
                        d.heads,
                        d.seq_q,
                        d.hd / width,
                        dtype,
                    );
                }
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
                    drop.key0,
                    drop.key1,
                    drop.threshold,
                    drop.scale,
                    drop.on,
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
                    drop.key0,
                    drop.key1,
                    drop.threshold,
                    drop.scale,
                    drop.on,
                    dtype,
                );
            }
        }
    }
    (dq, dk, dv)
}

impl<R, F, I, BT> super::AttentionKernels for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: f32,
        dropout: Option<Dropout>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        forward(q, k, v, causal, scale, dropout)
    }
    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        causal: bool,
        scale: f32,
        dropout: Option<Dropout>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        backward(q, k, v, out, lse, grad, causal, scale, dropout)
    }
    fn flash_attention_qkv_forward(
        qkv: FloatTensor<Self>,
        heads: usize,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        causal: bool,
        scale: f32,
        dropout: Option<Dropout>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        super::packed::forward(qkv, heads, cos, sin, causal, scale, dropout)
    }
    fn flash_attention_qkv_backward(
        qkv: FloatTensor<Self>,
        heads: usize,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        causal: bool,
        scale: f32,
        dropout: Option<Dropout>,
    ) -> FloatTensor<Self> {
        super::packed::backward(qkv, heads, cos, sin, out, lse, grad, causal, scale, dropout)
    }
}

impl<R, F, I, BT> super::AttentionOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn fused_flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: f64,
        dropout: Option<Dropout>,
    ) -> FloatTensor<Self> {
        forward(q, k, v, causal, scale as f32, dropout).0
    }
    fn fused_flash_attention_qkv(
        qkv: FloatTensor<Self>,
        heads: usize,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        causal: bool,
        scale: f64,
        dropout: Option<Dropout>,
    ) -> FloatTensor<Self> {
        let (out, _) = super::packed::forward(qkv, heads, cos, sin, causal, scale as f32, dropout);
        merge_heads(out)
    }
    fn flash_path(q: &FloatTensor<Self>) -> Option<FlashPath> {
        Some(path(q))
    }
}

#[cfg(test)]
mod tests {
    use super::MmaTiles;

    #[test]
    fn default_tiles_can_run_at_every_tensor_core_head_dim() {
        for hd in (16..=128).step_by(16) {
            for causal in [false, true] {
                let t = MmaTiles::for_head_dim(hd, causal);
                assert!(
                    t.backward_problem(hd).is_none(),
                    "hd {hd}, causal {causal}: {t:?}"
                );
            }
        }
    }

    #[test]
    fn tile_override_parses_and_rejects_bad_specs() {
        let mut t = MmaTiles::for_head_dim(128, false);
        t.apply("fwd=1x64, dkdv=2x16, bwd=rows, dq=separate")
            .unwrap();
        assert_eq!(
            t,
            MmaTiles {
                fwd: (1, 64),
                dkdv: (2, 16),
                dkdv_planes: 4,
                fused_dq: false,
                split_bwd: false,
                ..MmaTiles::for_head_dim(128, false)
            }
        );
        t.apply("dq=fused,dkdv=1x64x8").unwrap();
        assert!(t.fused_dq);
        assert_eq!((t.dkdv, t.dkdv_planes), ((1, 64), 8));
        assert_eq!(t.backward_problem(128), None);
        // 8 warps over one 16-row tile: column groups of 8 at head_dim 64.
        t.apply("dkdv=1x16x8").unwrap();
        assert!(t.backward_problem(64).is_some());
        assert_eq!(t.backward_problem(128), None);
        t.apply("dq=separate").unwrap();
        assert!(!t.fused_dq);
        t.apply("fwd=1x32x8").unwrap();
        assert_eq!((t.fwd, t.fwd_planes, t.dq_planes), ((1, 32), 8, 4));
        assert_eq!(t.fwd_stages, 2);
        t.apply("stages=3").unwrap();
        assert_eq!(t.fwd_stages, 3);
        // 8 warps x 16 query and output rows and 3 x 2 blocks of 32 key/value rows, 136 bf16
        // each: 119 KiB.
        assert_eq!(t.forward_stages(128, 2, 227 * 1024), 3);
        assert_eq!(t.forward_stages(128, 2, 100 * 1024), 2);
        t.apply("stages=2").unwrap();
        assert_eq!(t.fwd_stages, 2);
        assert!(t.stmatrix);
        t.apply("stmatrix=off").unwrap();
        assert!(!t.stmatrix);
        // The split backward with the fused dQ is hd 128's default (and that of multiples of 32
        // but 64), in 8-warp cubes with either mask; other head dims keep whole key rows.
        for causal in [false, true] {
            for hd in [96, 128] {
                let t = MmaTiles::for_head_dim(hd, causal);
                assert!(t.split_bwd && t.fused_dq && t.dkdv_planes == 8);
                assert_eq!(t.backward_problem(hd), None);
            }
            for hd in [16, 48, 64, 80] {
                let t = MmaTiles::for_head_dim(hd, causal);
                assert!(!t.split_bwd);
                assert_eq!(t.backward_problem(hd), None);
            }
        }
        // `bwd=split` keeps the default or chosen dQ.
        let mut t = MmaTiles::for_head_dim(128, false);
        t.apply("bwd=rows,dq=separate").unwrap();
        t.apply("bwd=split").unwrap();
        assert!(t.split_bwd && !t.fused_dq);
        assert_eq!(t.backward_problem(128), None);
        t.apply("dq=fused").unwrap();
        assert!(t.split_bwd && t.fused_dq);
        assert_eq!(t.backward_problem(128), None);
        assert_eq!(t.backward_problem(64), None);
        t.apply("dkdv=4x64x8").unwrap();
        assert!(t.backward_problem(128).is_some());
        t.apply("dq=separate").unwrap();
        assert!(t.backward_problem(128).is_some());
        t.apply("dkdv=1x48x8").unwrap();
        assert!(t.backward_problem(128).is_some());
        t.apply("bwd=rows,dq=separate").unwrap();
        assert!(!t.split_bwd && !t.fused_dq);
        assert_eq!(t.backward_problem(128), None);
        for bad in [
            "fwd=3x64",
            "fwd=2x24",
            "fwd=2x256",
            "fwd=2",
            "bwd=1x64",
            "bwd=fa2",
            "fwd",
            "fwd=1x64x6",
            "stages=4",
            "stages=",
            "stmatrix=no",
            "dkdv=1x64x8x2",
            "dq=atomic",
        ] {
            let err = MmaTiles::for_head_dim(64, false).apply(bad).unwrap_err();
            assert!(!err.is_empty(), "{bad}");
        }
    }
}
