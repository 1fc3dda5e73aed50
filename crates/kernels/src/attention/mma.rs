//! Tensor-core FlashAttention kernels (CUDA, f16/bf16 inputs, f32 accumulation).
//!
//! Every cube has `planes` warps; each warp owns `mt` tiles of 16 rows (queries in the forward
//! and dQ kernels, keys in the dK/dV kernel) and runs the block products with the warp-level
//! `mma.sync.m16n8k16` instruction (CubeCL's manual MMA), holding accumulators in registers.
//!
//! - **Staging:** tiles of q, k, v, dO are copied from global memory by the whole cube with
//!   vector loads and stored whole into shared memory, rows padded by 8 elements (16 bytes) so
//!   that the eight row addresses of an `ldmatrix` phase fall in different banks.
//! - **Fragments:** A and B operands come out of shared memory with `ldmatrix` (`.x4`: one
//!   instruction gives a 16x16 A fragment or the B fragments of two 8-column tiles; `.trans` when
//!   the tile is stored with the reduction dimension along its rows, as v in `P v`).
//! - **P and dS stay in registers:** the m16n8 accumulator layout of two neighbouring 8-column
//!   tiles is the m16k16 A-operand layout, so a score tile becomes the A operand of the next
//!   product by a cast to the input dtype (as FlashAttention-2 does), with no shared-memory trip.
//! - **Why `mt` row tiles per warp:** a B fragment loaded from shared memory feeds `mt` MMAs. With
//!   one tile per warp, a cube reads `1/16` byte of shared memory per flop, which at the H100's
//!   tensor rate (about 2048 dense f16 flops per SM per clock) is the whole shared-memory
//!   bandwidth (128 bytes per clock); two tiles halve that.
//!
//! Register layout (PTX m16n8k16, lane = 4 * g + t): an accumulator tile holds rows `g` (vector 0)
//! and `g + 8` (vector 1), columns `2t, 2t + 1`; an A fragment holds (row, columns) `(g, 2t..)`,
//! `(g + 8, 2t..)`, `(g, 8 + 2t..)`, `(g + 8, 8 + 2t..)` in its four vectors. The lanes sharing a
//! row are the four of a quad (`lane ^ 1`, `lane ^ 2`).
//!
//! Accumulator arrays are indexed `((m * tiles + t) * 2 + half)` for row tile `m`, 8-column tile
//! `t` and row half `half` (rows `g` or `g + 8`); every index is a compile-time constant after
//! unrolling, so they live in registers.

use cubecl::prelude::barrier::{copy_async, Barrier};
use cubecl::prelude::*;

use super::kernel::{neg_big, visible};
use crate::pipeline::{commit, wait_block};

/// Shared-memory alignment of the staged tiles (`ldmatrix` reads 16-byte rows).
const ALIGN: usize = 16;

/// Copies rows `row0 .. row0 + rows` of `t` (base offset `base`, row stride `row_stride`, both in
/// vectors; `per_row` vectors make one row of head_dim) into `tile` from vector `off` on, rows
/// `pitch` vectors apart; rows past `seq` are zero. `asynchronous`: with `cp.async` (one vector of
/// `width` elements each), completion tracked by [`commit`]; otherwise with plain loads and stores.
#[cube]
#[allow(clippy::too_many_arguments)]
fn copy_rows<F: Float, N: Size>(
    t: &Tensor<Vector<F, N>>,
    tile: &mut SharedMemory<Vector<F, N>>,
    off: usize,
    base: usize,
    row_stride: usize,
    row0: usize,
    seq: usize,
    #[comptime] rows: usize,
    #[comptime] per_row: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
    #[comptime] asynchronous: bool,
) {
    let mut idx = UNIT_POS as usize;
    while idx < comptime!(rows * per_row) {
        let r = idx / per_row;
        let c = idx % per_row;
        let s = row0 + r;
        let dst = off + r * pitch + c;
        if s < seq {
            let src = base + s * row_stride + c;
            if comptime!(asynchronous) {
                copy_async::<Vector<F, N>>(
                    &t.slice(src, src + 1),
                    &mut tile.slice_mut(dst, dst + 1),
                    comptime!(width as u32),
                );
            } else {
                tile[dst] = t[src];
            }
        } else {
            tile[dst] = Vector::new(F::new(0.0));
        }
        idx += CUBE_DIM as usize;
    }
}

/// A fragment (16 x 16) of a row-major tile, top-left corner at (`row0`, `col0`), by one
/// `ldmatrix.x4`: lane `l` gives the address of row `l % 16`, columns `8 * (l / 16) ..`.
#[cube]
fn load_a<F: Float, N: Size, NA: Size>(
    tile: &SharedMemory<Vector<F, N>>,
    row0: usize,
    col0: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
) -> Array<Vector<F, NA>> {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let lane = UNIT_POS_PLANE as usize;
    let at = (row0 + lane % 16) * pitch + (col0 + (lane / 16) * 8) / width;
    def.load_matrix::<Vector<F, N>, NA>(
        &tile.slice(at, at + 1),
        cmma::MatrixIdent::A,
        4usize,
        false,
    )
}

/// A fragment (16 x 16) of a tile that stores A transposed (`A[m][k] = tile[k][m]`, like dS^T in
/// the fused dQ product), top-left corner of A at (`row0`, `col0`), by one `ldmatrix.x4.trans`:
/// lanes `8i .. 8i + 7` address the rows (k) of 8 x 8 matrix `i` = (m half `i % 2`, k half `i / 2`).
#[cube]
fn load_a_t<F: Float, N: Size, NA: Size>(
    tile: &SharedMemory<Vector<F, N>>,
    row0: usize,
    col0: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
) -> Array<Vector<F, NA>> {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let lane = UNIT_POS_PLANE as usize;
    let (r8, i) = (lane % 8, lane / 8);
    let at = (col0 + (i / 2) * 8 + r8) * pitch + (row0 + (i % 2) * 8) / width;
    def.load_matrix::<Vector<F, N>, NA>(&tile.slice(at, at + 1), cmma::MatrixIdent::A, 4usize, true)
}

/// B fragments (16 x 8) of the two 8-column tiles `n0 ..` and `n0 + 8 ..` of the product's
/// columns, reduction rows `k0 .. k0 + 16`, of the tile starting at vector `off`, by one `ldmatrix.x4`; vectors 0-1 are the first tile's,
/// 2-3 the second's. `n_rows`: the tile stores B transposed (`B[k][n] = tile[n][k]`, like k in
/// `q k^T`), read as is; otherwise `B[k][n] = tile[k][n]` (like v in `P v`), read with `.trans`.
#[cube]
fn load_b2<F: Float, N: Size, NB: Size>(
    tile: &SharedMemory<Vector<F, N>>,
    off: usize,
    k0: usize,
    n0: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
    #[comptime] n_rows: bool,
) -> Array<Vector<F, NB>> {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let lane = UNIT_POS_PLANE as usize;
    // Lanes 8i .. 8i + 7 address the rows of 8 x 8 matrix i: (n tile i / 2, k half i % 2).
    let (r8, i) = (lane % 8, lane / 8);
    let mut at = off + (k0 + (i % 2) * 8 + r8) * pitch + (n0 + (i / 2) * 8) / width;
    if comptime!(n_rows) {
        at = off + (n0 + (i / 2) * 8 + r8) * pitch + (k0 + (i % 2) * 8) / width;
    }
    def.load_matrix::<Vector<F, N>, NB>(
        &tile.slice(at, at + 1),
        cmma::MatrixIdent::B,
        4usize,
        comptime!(!n_rows),
    )
}

/// Vectors `index * vectors ..` of a flat array of fragments.
#[cube]
fn part<E: Scalar, NA: Size>(
    all: &Array<Vector<E, NA>>,
    index: usize,
    #[comptime] vectors: usize,
) -> Array<Vector<E, NA>> {
    let mut out = Array::<Vector<E, NA>>::new(vectors);
    #[unroll]
    for i in 0..vectors {
        out[i] = all[index * vectors + i];
    }
    out
}

/// `acc[offset .. offset + 2] += a * b` (one m16n8k16 product).
#[cube]
fn mma<F: Float, NA: Size, NB: Size, NC: Size>(
    a: &Array<Vector<F, NA>>,
    b: &Array<Vector<F, NB>>,
    acc: &mut Array<Vector<f32, NC>>,
    offset: usize,
) {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let mut c = Array::<Vector<f32, NC>>::new(2usize);
    c[0] = acc[offset];
    c[1] = acc[offset + 1];
    let d = def.execute(a, b, &c);
    acc[offset] = d[0];
    acc[offset + 1] = d[1];
}

/// Zeroed accumulators: `len` vectors.
#[cube]
fn zeros<NC: Size>(#[comptime] len: usize) -> Array<Vector<f32, NC>> {
    let mut acc = Array::<Vector<f32, NC>>::new(len);
    #[unroll]
    for i in 0..len {
        acc[i] = Vector::new(0.0);
    }
    acc
}

/// `acc += a_m * B` over a 16-deep reduction step for every row tile `m` and the two column
/// tiles `pair * 2, pair * 2 + 1` whose B fragments are `b` (from [`load_b2`]). `a` holds the
/// `mt` A fragments (4 vectors each), `tiles` column tiles per row tile in `acc`.
#[cube]
fn mma_pair<F: Float, NA: Size, NB: Size, NC: Size>(
    a: &Array<Vector<F, NA>>,
    b: &Array<Vector<F, NB>>,
    acc: &mut Array<Vector<f32, NC>>,
    pair: usize,
    #[comptime] mt: usize,
    #[comptime] tiles: usize,
) {
    #[unroll]
    for half in 0..2usize {
        let bf = part::<F, NB>(b, half, 2usize);
        #[unroll]
        for m in 0..mt {
            let af = part::<F, NA>(a, m, 4usize);
            mma::<F, NA, NB, NC>(&af, &bf, acc, ((m * tiles) + pair * 2 + half) * 2);
        }
    }
}

/// The A fragments (for every row tile) of reduction step `kk` taken from f32 score tiles
/// `2 kk` and `2 kk + 1` in registers, cast to the input dtype.
#[cube]
fn scores_as_a<F: Float, NA: Size, NC: Size>(
    s: &Array<Vector<f32, NC>>,
    kk: usize,
    #[comptime] mt: usize,
    #[comptime] tiles: usize,
) -> Array<Vector<F, NA>> {
    let mut out = Array::<Vector<F, NA>>::new(comptime!(mt * 4));
    #[unroll]
    for m in 0..mt {
        #[unroll]
        for j in 0..4usize {
            // A vectors 0, 1: rows g, g + 8 of tile 2 kk; 2, 3: of tile 2 kk + 1.
            let x = s[(m * tiles + 2 * kk + j / 2) * 2 + j % 2];
            let mut y = Vector::<F, NA>::empty();
            y[0] = F::cast_from(x[0]);
            y[1] = F::cast_from(x[1]);
            out[m * 4 + j] = y;
        }
    }
    out
}

/// The `mt` A fragments of reduction step `kk` of this warp's rows (`row0 ..`) of a staged tile.
#[cube]
fn rows_as_a<F: Float, N: Size, NA: Size>(
    tile: &SharedMemory<Vector<F, N>>,
    row0: usize,
    kk: usize,
    #[comptime] mt: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
) -> Array<Vector<F, NA>> {
    let mut out = Array::<Vector<F, NA>>::new(comptime!(mt * 4));
    #[unroll]
    for m in 0..mt {
        let f = load_a::<F, N, NA>(tile, row0 + m * 16, kk * 16, pitch, width);
        #[unroll]
        for i in 0..4usize {
            out[m * 4 + i] = f[i];
        }
    }
    out
}

/// `acc += A B` over `steps` 16-deep reduction steps for `mt` row tiles and `tiles` column tiles,
/// A from this warp's rows of `a_tile`, B from the tile at vector `b_off` of `b_tile` (see
/// [`load_b2`] for `n_rows`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn block_product<F: Float, N: Size, NA: Size, NB: Size, NC: Size>(
    a_tile: &SharedMemory<Vector<F, N>>,
    row0: usize,
    b_tile: &SharedMemory<Vector<F, N>>,
    b_off: usize,
    acc: &mut Array<Vector<f32, NC>>,
    #[comptime] steps: usize,
    #[comptime] tiles: usize,
    #[comptime] mt: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
    #[comptime] n_rows: bool,
) {
    #[unroll]
    for kk in 0..steps {
        let a = rows_as_a::<F, N, NA>(a_tile, row0, kk, mt, pitch, width);
        #[unroll]
        for pair in 0..comptime!(tiles / 2) {
            let b = load_b2::<F, N, NB>(b_tile, b_off, kk * 16, pair * 16, pitch, width, n_rows);
            mma_pair::<F, NA, NB, NC>(&a, &b, acc, pair, mt, tiles);
        }
    }
}

/// `acc += S B` where the A operand S is `s` (f32 score tiles in registers, `s_tiles` per row
/// tile), and B comes from the tile at vector `b_off` of `b_tile`, with the reduction along its
/// rows (`.trans` loads).
#[cube]
#[allow(clippy::too_many_arguments)]
fn scores_product<F: Float, N: Size, NA: Size, NB: Size, NC: Size>(
    s: &Array<Vector<f32, NC>>,
    b_tile: &SharedMemory<Vector<F, N>>,
    b_off: usize,
    acc: &mut Array<Vector<f32, NC>>,
    #[comptime] s_tiles: usize,
    #[comptime] tiles: usize,
    #[comptime] mt: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
) {
    #[unroll]
    for kk in 0..comptime!(s_tiles / 2) {
        let a = scores_as_a::<F, NA, NC>(s, kk, mt, s_tiles);
        #[unroll]
        for pair in 0..comptime!(tiles / 2) {
            let b = load_b2::<F, N, NB>(b_tile, b_off, kk * 16, pair * 16, pitch, width, false);
            mma_pair::<F, NA, NB, NC>(&a, &b, acc, pair, mt, tiles);
        }
    }
}

/// Writes accumulators (`mt` row tiles of `hd / 8` column tiles) times `factor` to rows
/// `row0 ..` of `out` (element strides), rows below `seq`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_rows<F: Float, NC: Size>(
    acc: &Array<Vector<f32, NC>>,
    out: &mut Tensor<F>,
    base: usize,
    row0: usize,
    seq: usize,
    factor: f32,
    #[comptime] mt: usize,
    #[comptime] hd: usize,
) {
    let lane = UNIT_POS_PLANE as usize;
    let (g, t4) = (lane / 4, lane % 4);
    let tiles = comptime!(hd / 8);
    let rs = out.stride(2);
    #[unroll]
    for m in 0..mt {
        #[unroll]
        for half in 0..2usize {
            let row = row0 + m * 16 + half * 8 + g;
            if row < seq {
                #[unroll]
                for t in 0..tiles {
                    let x = acc[(m * tiles + t) * 2 + half];
                    let at = base + row * rs + t * 8 + t4 * 2;
                    out[at] = F::cast_from(x[0] * factor);
                    out[at + 1] = F::cast_from(x[1] * factor);
                }
            }
        }
    }
}

/// Starts the copies of query block rows `i0 ..` into buffer `which` (0 or 1) of the dK/dV
/// kernel: q and dO rows, and the log-sum-exp and delta of those rows (`rows0` is the first row of
/// this batch and head in `lse` and `delta`); rows past `seq_q` are zero.
#[cube]
#[allow(clippy::too_many_arguments)]
fn issue_query_block<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    qt: &mut SharedMemory<Vector<F, N>>,
    gt: &mut SharedMemory<Vector<F, N>>,
    lse_t: &mut SharedMemory<f32>,
    delta_t: &mut SharedMemory<f32>,
    which: usize,
    qbase: usize,
    qstride: usize,
    gbase: usize,
    gstride: usize,
    rows0: usize,
    i0: usize,
    seq_q: usize,
    #[comptime] block_q: usize,
    #[comptime] per_row: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
) {
    let off = which * comptime!(block_q * pitch);
    copy_rows(
        q, qt, off, qbase, qstride, i0, seq_q, block_q, per_row, pitch, width, true,
    );
    copy_rows(
        grad, gt, off, gbase, gstride, i0, seq_q, block_q, per_row, pitch, width, true,
    );
    let mut r = UNIT_POS as usize;
    while r < block_q {
        let dst = which * block_q + r;
        if i0 + r < seq_q {
            let src = rows0 + i0 + r;
            copy_async::<f32>(
                &lse.slice(src, src + 1),
                &mut lse_t.slice_mut(dst, dst + 1),
                1u32,
            );
            copy_async::<f32>(
                &delta.slice(src, src + 1),
                &mut delta_t.slice_mut(dst, dst + 1),
                1u32,
            );
        } else {
            lse_t[dst] = 0.0;
            delta_t[dst] = 0.0;
        }
        r += CUBE_DIM as usize;
    }
}

/// Whether the keys `j0 .. j0 + block_k` meet a masked position for query rows from `row0` on:
/// keys past `seq_k`, or (causal) keys past the first row. Uniform across a warp.
#[cube]
fn edge_block(
    row0: usize,
    j0: usize,
    seq_k: usize,
    #[comptime] block_k: usize,
    #[comptime] causal: bool,
) -> bool {
    let mut edge = j0 + block_k > seq_k;
    if comptime!(causal) {
        edge = edge || j0 + block_k > row0 + 1;
    }
    edge
}

/// Sets the (scaled) scores `s` of rows `row0 ..` and keys `j0 ..` that are not visible to a
/// large negative value (`exp` of it minus any row maximum is 0). `s_tiles` key tiles per row tile.
#[cube]
fn mask_scores<NC: Size>(
    s: &mut Array<Vector<f32, NC>>,
    row0: usize,
    j0: usize,
    seq_k: usize,
    #[comptime] mt: usize,
    #[comptime] s_tiles: usize,
    #[comptime] causal: bool,
) {
    let lane = UNIT_POS_PLANE as usize;
    let (g, t4) = (lane / 4, lane % 4);
    #[unroll]
    for m in 0..mt {
        #[unroll]
        for half in 0..2usize {
            let row = row0 + m * 16 + half * 8 + g;
            #[unroll]
            for t in 0..s_tiles {
                let at = (m * s_tiles + t) * 2 + half;
                let mut x = s[at];
                #[unroll]
                for e in 0..2usize {
                    if !visible(row, j0 + t * 8 + t4 * 2 + e, seq_k, causal) {
                        x[e] = neg_big();
                    }
                }
                s[at] = x;
            }
        }
    }
}

/// Number of key blocks a query block starting at `q0` (of `block_q` rows) visits.
#[cube]
fn key_blocks(
    q0: usize,
    seq_q: usize,
    seq_k: usize,
    #[comptime] block_q: usize,
    #[comptime] block_k: usize,
    #[comptime] causal: bool,
) -> usize {
    let mut blocks = seq_k.div_ceil(block_k);
    if comptime!(causal) {
        let mut last = q0 + block_q;
        if seq_q < last {
            last = seq_q;
        }
        let needed = last.div_ceil(block_k);
        if needed < blocks {
            blocks = needed;
        }
    }
    blocks
}

/// Tensor-core forward. Grid `(query blocks, batch * heads)`, cube `(32, planes)`; each warp
/// owns `16 * mt` query rows. Strides of q/k/v are in vectors of `width`, those of `out` in
/// elements. Query blocks run last-first so that causal's longest rows start first.
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(arithmetic_overflow)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_forward_mma<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    heads: usize,
    seq_q: usize,
    seq_k: usize,
    scale: f32,
    #[comptime] hd: usize,
    #[comptime] planes: usize,
    #[comptime] mt: usize,
    #[comptime] block_k: usize,
    #[comptime] width: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let size!(NA) = def.vector_size(cmma::MatrixIdent::A);
    let size!(NB) = def.vector_size(cmma::MatrixIdent::B);
    let size!(NC) = def.vector_size(cmma::MatrixIdent::Accumulator);

    let lane = UNIT_POS_PLANE as usize;
    let (g, t4) = (lane / 4, lane % 4);
    let bh = CUBE_POS_Y as usize;
    let (b, h) = (bh / heads, bh % heads);
    let block_q = comptime!(planes * mt * 16);
    let q0 = (CUBE_COUNT_X as usize - 1 - CUBE_POS_X as usize) * block_q;
    let w0 = UNIT_POS_Y as usize * comptime!(mt * 16);
    let pitch = comptime!((hd + 8) / width);
    let per_row = comptime!(hd / width);
    // K and V are double-buffered: block kb + 1 is copied (cp.async) while block kb is used.
    let tile = comptime!(block_k * pitch);
    let mut qt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(block_q * pitch), ALIGN);
    let mut kt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * tile), ALIGN);
    let mut vt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * tile), ALIGN);
    let bar0 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let bar1 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    copy_rows(
        q,
        &mut qt,
        0,
        (b * q.stride(0) + h * q.stride(1)) / width,
        q.stride(2) / width,
        q0,
        seq_q,
        block_q,
        per_row,
        pitch,
        width,
        false,
    );
    let (kbase, kstride) = (
        (b * k.stride(0) + h * k.stride(1)) / width,
        k.stride(2) / width,
    );
    let (vbase, vstride) = (
        (b * v.stride(0) + h * v.stride(1)) / width,
        v.stride(2) / width,
    );

    let s_tiles = comptime!(block_k / 8);
    let o_tiles = comptime!(hd / 8);
    let mut o_acc = zeros::<NC>(comptime!(mt * o_tiles * 2));
    let mut m_run = Array::<f32>::new(comptime!(mt * 2));
    let mut l_run = Array::<f32>::new(comptime!(mt * 2));
    #[unroll]
    for i in 0..comptime!(mt * 2) {
        m_run[i] = neg_big();
        l_run[i] = 0.0;
    }

    let blocks = key_blocks(q0, seq_q, seq_k, block_q, block_k, causal);
    sync_cube();
    if blocks > 0 {
        copy_rows(
            k, &mut kt, 0, kbase, kstride, 0, seq_k, block_k, per_row, pitch, width, true,
        );
        copy_rows(
            v, &mut vt, 0, vbase, vstride, 0, seq_k, block_k, per_row, pitch, width, true,
        );
        commit(&bar0, &bar1, 0);
    }
    for kb in 0..blocks {
        let j0 = kb * block_k;
        let cur = (kb % 2) * tile;
        if kb + 1 < blocks {
            let next = ((kb + 1) % 2) * tile;
            copy_rows(
                k,
                &mut kt,
                next,
                kbase,
                kstride,
                j0 + block_k,
                seq_k,
                block_k,
                per_row,
                pitch,
                width,
                true,
            );
            copy_rows(
                v,
                &mut vt,
                next,
                vbase,
                vstride,
                j0 + block_k,
                seq_k,
                block_k,
                per_row,
                pitch,
                width,
                true,
            );
            commit(&bar0, &bar1, (kb + 1) % 2);
        }
        wait_block(&bar0, &bar1, kb);

        // S = q k^T for this warp's rows and the block's keys.
        let mut s = zeros::<NC>(comptime!(mt * s_tiles * 2));
        block_product::<F, N, NA, NB, NC>(
            &qt,
            w0,
            &kt,
            cur,
            &mut s,
            comptime!(hd / 16),
            s_tiles,
            mt,
            pitch,
            width,
            true,
        );

        // Scaled scores; the mask only where this warp's rows meet the block's edge (past seq_k
        // or, causal, above the diagonal): the test is uniform across the warp.
        #[unroll]
        for i in 0..comptime!(mt * s_tiles * 2) {
            s[i] = s[i] * Vector::new(scale);
        }
        if edge_block(q0 + w0, j0, seq_k, block_k, causal) {
            mask_scores::<NC>(&mut s, q0 + w0, j0, seq_k, mt, s_tiles, causal);
        }

        // Online softmax, one register row (half of a row tile) at a time.
        #[unroll]
        for m in 0..mt {
            #[unroll]
            for half in 0..2usize {
                let r = m * 2 + half;
                let mut mx = m_run[r];
                #[unroll]
                for t in 0..s_tiles {
                    let x = s[(m * s_tiles + t) * 2 + half];
                    mx = f32::max(mx, f32::max(x[0], x[1]));
                }
                mx = f32::max(mx, plane_shuffle_xor(mx, 1));
                mx = f32::max(mx, plane_shuffle_xor(mx, 2));
                let mut sum = 0.0f32;
                #[unroll]
                for t in 0..s_tiles {
                    let at = (m * s_tiles + t) * 2 + half;
                    let mut x = s[at];
                    #[unroll]
                    for e in 0..2usize {
                        let p = (x[e] - mx).exp();
                        x[e] = p;
                        sum += p;
                    }
                    s[at] = x;
                }
                sum += plane_shuffle_xor(sum, 1);
                sum += plane_shuffle_xor(sum, 2);
                let alpha = (m_run[r] - mx).exp();
                l_run[r] = l_run[r] * alpha + sum;
                m_run[r] = mx;
                #[unroll]
                for t in 0..o_tiles {
                    let at = (m * o_tiles + t) * 2 + half;
                    o_acc[at] = o_acc[at] * Vector::new(alpha);
                }
            }
        }

        // O += P v, P from registers.
        scores_product::<F, N, NA, NB, NC>(
            &s, &vt, cur, &mut o_acc, s_tiles, o_tiles, mt, pitch, width,
        );
        // Every warp is done with this buffer before the next iteration refills it.
        sync_cube();
    }

    // O / l and the log-sum-exp.
    #[unroll]
    for m in 0..mt {
        #[unroll]
        for half in 0..2usize {
            let r = m * 2 + half;
            let inv = 1.0f32 / l_run[r];
            #[unroll]
            for t in 0..o_tiles {
                let at = (m * o_tiles + t) * 2 + half;
                o_acc[at] = o_acc[at] * Vector::new(inv);
            }
            let row = q0 + w0 + m * 16 + half * 8 + g;
            if t4 == 0 && row < seq_q {
                lse[bh * seq_q + row] = m_run[r] + l_run[r].ln();
            }
        }
    }
    store_rows::<F, NC>(
        &o_acc,
        out,
        b * out.stride(0) + h * out.stride(1),
        q0 + w0,
        seq_q,
        1.0,
        mt,
        hd,
    );
}

/// Tensor-core dQ. Grid `(query blocks, batch * heads)`, cube `(32, planes)`; each warp owns
/// `16 * mt` query rows; q and dO stay staged in shared memory, k/v blocks stream through.
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(arithmetic_overflow)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_backward_dq_mma<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<F>,
    heads: usize,
    seq_q: usize,
    seq_k: usize,
    scale: f32,
    #[comptime] hd: usize,
    #[comptime] planes: usize,
    #[comptime] mt: usize,
    #[comptime] block_k: usize,
    #[comptime] width: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let size!(NA) = def.vector_size(cmma::MatrixIdent::A);
    let size!(NB) = def.vector_size(cmma::MatrixIdent::B);
    let size!(NC) = def.vector_size(cmma::MatrixIdent::Accumulator);

    let lane = UNIT_POS_PLANE as usize;
    let g = lane / 4;
    let bh = CUBE_POS_Y as usize;
    let (b, h) = (bh / heads, bh % heads);
    let block_q = comptime!(planes * mt * 16);
    let q0 = (CUBE_COUNT_X as usize - 1 - CUBE_POS_X as usize) * block_q;
    let w0 = UNIT_POS_Y as usize * comptime!(mt * 16);
    let pitch = comptime!((hd + 8) / width);
    let per_row = comptime!(hd / width);
    // K and V are double-buffered: block kb + 1 is copied (cp.async) while block kb is used.
    let tile = comptime!(block_k * pitch);
    let mut qt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(block_q * pitch), ALIGN);
    let mut gt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(block_q * pitch), ALIGN);
    let mut kt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * tile), ALIGN);
    let mut vt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * tile), ALIGN);
    let bar0 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let bar1 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let (kbase, kstride) = (
        (b * k.stride(0) + h * k.stride(1)) / width,
        k.stride(2) / width,
    );
    let (vbase, vstride) = (
        (b * v.stride(0) + h * v.stride(1)) / width,
        v.stride(2) / width,
    );
    copy_rows(
        q,
        &mut qt,
        0,
        (b * q.stride(0) + h * q.stride(1)) / width,
        q.stride(2) / width,
        q0,
        seq_q,
        block_q,
        per_row,
        pitch,
        width,
        false,
    );
    copy_rows(
        grad,
        &mut gt,
        0,
        (b * grad.stride(0) + h * grad.stride(1)) / width,
        grad.stride(2) / width,
        q0,
        seq_q,
        block_q,
        per_row,
        pitch,
        width,
        false,
    );

    // The log-sum-exp and delta of this lane's rows.
    let mut lse_r = Array::<f32>::new(comptime!(mt * 2));
    let mut d_r = Array::<f32>::new(comptime!(mt * 2));
    #[unroll]
    for m in 0..mt {
        #[unroll]
        for half in 0..2usize {
            let row = q0 + w0 + m * 16 + half * 8 + g;
            let mut x = 0.0f32;
            let mut y = 0.0f32;
            if row < seq_q {
                x = lse[bh * seq_q + row];
                y = delta[bh * seq_q + row];
            }
            lse_r[m * 2 + half] = x;
            d_r[m * 2 + half] = y;
        }
    }

    let s_tiles = comptime!(block_k / 8);
    let o_tiles = comptime!(hd / 8);
    let mut dq_acc = zeros::<NC>(comptime!(mt * o_tiles * 2));

    let blocks = key_blocks(q0, seq_q, seq_k, block_q, block_k, causal);
    sync_cube();
    if blocks > 0 {
        copy_rows(
            k, &mut kt, 0, kbase, kstride, 0, seq_k, block_k, per_row, pitch, width, true,
        );
        copy_rows(
            v, &mut vt, 0, vbase, vstride, 0, seq_k, block_k, per_row, pitch, width, true,
        );
        commit(&bar0, &bar1, 0);
    }
    for kb in 0..blocks {
        let j0 = kb * block_k;
        let cur = (kb % 2) * tile;
        if kb + 1 < blocks {
            let next = ((kb + 1) % 2) * tile;
            copy_rows(
                k,
                &mut kt,
                next,
                kbase,
                kstride,
                j0 + block_k,
                seq_k,
                block_k,
                per_row,
                pitch,
                width,
                true,
            );
            copy_rows(
                v,
                &mut vt,
                next,
                vbase,
                vstride,
                j0 + block_k,
                seq_k,
                block_k,
                per_row,
                pitch,
                width,
                true,
            );
            commit(&bar0, &bar1, (kb + 1) % 2);
        }
        wait_block(&bar0, &bar1, kb);

        // S = q k^T and dP = dO v^T.
        let mut s = zeros::<NC>(comptime!(mt * s_tiles * 2));
        let mut dp = zeros::<NC>(comptime!(mt * s_tiles * 2));
        block_product::<F, N, NA, NB, NC>(
            &qt,
            w0,
            &kt,
            cur,
            &mut s,
            comptime!(hd / 16),
            s_tiles,
            mt,
            pitch,
            width,
            true,
        );
        block_product::<F, N, NA, NB, NC>(
            &gt,
            w0,
            &vt,
            cur,
            &mut dp,
            comptime!(hd / 16),
            s_tiles,
            mt,
            pitch,
            width,
            true,
        );

        // dS = P * (dP - delta), P = exp(scale * S - lse), in place of S; masked scores become a
        // large negative value, so P and dS are 0 there.
        #[unroll]
        for i in 0..comptime!(mt * s_tiles * 2) {
            s[i] = s[i] * Vector::new(scale);
        }
        if edge_block(q0 + w0, j0, seq_k, block_k, causal) {
            mask_scores::<NC>(&mut s, q0 + w0, j0, seq_k, mt, s_tiles, causal);
        }
        #[unroll]
        for m in 0..mt {
            #[unroll]
            for half in 0..2usize {
                let r = m * 2 + half;
                #[unroll]
                for t in 0..s_tiles {
                    let at = (m * s_tiles + t) * 2 + half;
                    let mut x = s[at];
                    let y = dp[at];
                    #[unroll]
                    for e in 0..2usize {
                        x[e] = (x[e] - lse_r[r]).exp() * (y[e] - d_r[r]);
                    }
                    s[at] = x;
                }
            }
        }

        // dQ += dS k.
        scores_product::<F, N, NA, NB, NC>(
            &s,
            &kt,
            cur,
            &mut dq_acc,
            s_tiles,
            o_tiles,
            mt,
            pitch,
            width,
        );
        sync_cube();
    }

    store_rows::<F, NC>(
        &dq_acc,
        dq,
        b * dq.stride(0) + h * dq.stride(1),
        q0 + w0,
        seq_q,
        scale,
        mt,
        hd,
    );
}

/// Writes this warp's dS^T tiles (`dp`: rows = its keys from `w0`, columns = the block's queries)
/// to `ds_t` in the input dtype, one A-fragment register (two columns) per store.
#[cube]
fn store_ds_t<F: Float, NA: Size, NC: Size>(
    dp: &Array<Vector<f32, NC>>,
    ds_t: &mut SharedMemory<Vector<F, NA>>,
    w0: usize,
    #[comptime] ds_pitch: usize,
    #[comptime] mt: usize,
    #[comptime] s_tiles: usize,
) {
    let lane = UNIT_POS_PLANE as usize;
    let (g, t4) = (lane / 4, lane % 4);
    #[unroll]
    for m in 0..mt {
        #[unroll]
        for half in 0..2usize {
            let row = w0 + m * 16 + half * 8 + g;
            #[unroll]
            for t in 0..s_tiles {
                let x = dp[(m * s_tiles + t) * 2 + half];
                let mut y = Vector::<F, NA>::empty();
                y[0] = F::cast_from(x[0]);
                y[1] = F::cast_from(x[1]);
                ds_t[row * ds_pitch + t * 4 + t4] = y;
            }
        }
    }
}

/// Fused dQ of one query block: `dq_acc[i0 + r] += scale * dS k` over the cube's `block_k` keys,
/// added with f32 atomics (other key blocks add theirs). The `block_q / 16` row tiles and the
/// head_dim columns are split over the warps: `planes / row_tiles` column groups when there are
/// more warps than row tiles, else `row_tiles / planes` row tiles per warp; columns go in chunks
/// of up to 32 so that the accumulators stay small next to dK and dV.
#[cube]
#[allow(clippy::too_many_arguments)]
fn dq_block_atomic<F: Float, N: Size, NA: Size, NB: Size, NC: Size>(
    ds_t: &SharedMemory<Vector<F, NA>>,
    kt: &SharedMemory<Vector<F, N>>,
    dq_acc: &mut Tensor<Atomic<f32>>,
    base: usize,
    i0: usize,
    seq_q: usize,
    scale: f32,
    #[comptime] hd: usize,
    #[comptime] planes: usize,
    #[comptime] block_q: usize,
    #[comptime] block_k: usize,
    #[comptime] ds_pitch: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
) {
    let lane = UNIT_POS_PLANE as usize;
    let (g, t4) = (lane / 4, lane % 4);
    let row_tiles = comptime!(block_q / 16);
    let qm = comptime!(if row_tiles > planes {
        row_tiles / planes
    } else {
        1
    });
    let row_slots = comptime!(row_tiles / qm);
    let group_cols = comptime!(hd / (planes / row_slots));
    let chunk = comptime!(if group_cols > 32 { 32 } else { group_cols });
    let ctiles = comptime!(chunk / 8);
    let warp = UNIT_POS_Y as usize;
    let r0 = (warp % row_slots) * comptime!(qm * 16);
    let c0 = (warp / row_slots) * group_cols;
    for c in 0..comptime!(group_cols / chunk) {
        let col0 = c0 + c * chunk;
        let mut acc = zeros::<NC>(comptime!(qm * ctiles * 2));
        #[unroll]
        for kk in 0..comptime!(block_k / 16) {
            let mut a = Array::<Vector<F, NA>>::new(comptime!(qm * 4));
            #[unroll]
            for m in 0..qm {
                let f = load_a_t::<F, NA, NA>(ds_t, r0 + m * 16, kk * 16, ds_pitch, 2usize);
                #[unroll]
                for i in 0..4usize {
                    a[m * 4 + i] = f[i];
                }
            }
            #[unroll]
            for pair in 0..comptime!(ctiles / 2) {
                let bf = load_b2::<F, N, NB>(kt, 0, kk * 16, col0 + pair * 16, pitch, width, false);
                mma_pair::<F, NA, NB, NC>(&a, &bf, &mut acc, pair, qm, ctiles);
            }
        }
        #[unroll]
        for m in 0..qm {
            #[unroll]
            for half in 0..2usize {
                let row = i0 + r0 + m * 16 + half * 8 + g;
                if row < seq_q {
                    #[unroll]
                    for t in 0..ctiles {
                        let x = acc[(m * ctiles + t) * 2 + half];
                        let at = base + row * hd + col0 + t * 8 + t4 * 2;
                        dq_acc[at].fetch_add(x[0] * scale);
                        dq_acc[at + 1].fetch_add(x[1] * scale);
                    }
                }
            }
        }
    }
}

/// `dq[b, h, s, :] = acc[b, h, s, :]` in the output dtype (`acc`: contiguous f32, `dq`: any
/// strides with unit last stride). One unit per element.
#[cube(launch_unchecked)]
pub(crate) fn dq_from_f32<F: Float>(
    acc: &Tensor<f32>,
    dq: &mut Tensor<F>,
    heads: usize,
    seq: usize,
    #[comptime] hd: usize,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i < acc.len() {
        let d = i % hd;
        let row = i / hd;
        let s = row % seq;
        let bh = row / seq;
        let (b, h) = (bh / heads, bh % heads);
        dq[b * dq.stride(0) + h * dq.stride(1) + s * dq.stride(2) + d] = F::cast_from(acc[i]);
    }
}

/// Tensor-core dK and dV. Grid `(key blocks, batch * heads)`, cube `(32, planes)`; each warp owns
/// `16 * mt` key rows (k and v stay staged) and walks the query blocks, computing the transposed
/// products `S^T = k q^T`, `dP^T = v dO^T`, then `dV += P^T dO`, `dK += dS^T q` with P^T and
/// dS^T taken from registers.
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(arithmetic_overflow)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_backward_dkdv_mma<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    dq_acc: &mut Tensor<Atomic<f32>>,
    heads: usize,
    seq_q: usize,
    seq_k: usize,
    scale: f32,
    #[comptime] hd: usize,
    #[comptime] planes: usize,
    #[comptime] mt: usize,
    #[comptime] block_q: usize,
    #[comptime] width: usize,
    #[comptime] causal: bool,
    #[comptime] fuse_dq: bool,
    #[define(F)] _dtype: StorageType,
) {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let size!(NA) = def.vector_size(cmma::MatrixIdent::A);
    let size!(NB) = def.vector_size(cmma::MatrixIdent::B);
    let size!(NC) = def.vector_size(cmma::MatrixIdent::Accumulator);

    let lane = UNIT_POS_PLANE as usize;
    let (g, t4) = (lane / 4, lane % 4);
    let bh = CUBE_POS_Y as usize;
    let (b, h) = (bh / heads, bh % heads);
    let block_k = comptime!(planes * mt * 16);
    let k0 = CUBE_POS_X as usize * block_k;
    let w0 = UNIT_POS_Y as usize * comptime!(mt * 16);
    let pitch = comptime!((hd + 8) / width);
    let per_row = comptime!(hd / width);
    // q, dO and their rows' lse, delta are double-buffered: block qb + 1 is copied (cp.async)
    // while block qb is used.
    let tile = comptime!(block_q * pitch);
    let mut kt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(block_k * pitch), ALIGN);
    let mut vt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(block_k * pitch), ALIGN);
    let mut qt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * tile), ALIGN);
    let mut gt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * tile), ALIGN);
    let mut lse_t = SharedMemory::<f32>::new_aligned(comptime!(2 * block_q), ALIGN);
    let mut delta_t = SharedMemory::<f32>::new_aligned(comptime!(2 * block_q), ALIGN);
    // Fused dQ: this block's dS^T (keys x queries, in the input dtype, pairs of columns per
    // vector as in an A fragment register), rows padded by 8 elements as the other tiles.
    let ds_pitch = comptime!((block_q + 8) / 2);
    let mut ds_t = SharedMemory::<Vector<F, NA>>::new_aligned(
        comptime!(if fuse_dq { block_k * ds_pitch } else { 1 }),
        ALIGN,
    );
    let bar0 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let bar1 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let (qbase, qstride) = (
        (b * q.stride(0) + h * q.stride(1)) / width,
        q.stride(2) / width,
    );
    let (gbase, gstride) = (
        (b * grad.stride(0) + h * grad.stride(1)) / width,
        grad.stride(2) / width,
    );
    copy_rows(
        k,
        &mut kt,
        0,
        (b * k.stride(0) + h * k.stride(1)) / width,
        k.stride(2) / width,
        k0,
        seq_k,
        block_k,
        per_row,
        pitch,
        width,
        false,
    );
    copy_rows(
        v,
        &mut vt,
        0,
        (b * v.stride(0) + h * v.stride(1)) / width,
        v.stride(2) / width,
        k0,
        seq_k,
        block_k,
        per_row,
        pitch,
        width,
        false,
    );

    let s_tiles = comptime!(block_q / 8);
    let o_tiles = comptime!(hd / 8);
    let mut dk_acc = zeros::<NC>(comptime!(mt * o_tiles * 2));
    let mut dv_acc = zeros::<NC>(comptime!(mt * o_tiles * 2));

    let query_blocks = seq_q.div_ceil(block_q);
    let mut first = 0usize;
    if comptime!(causal) {
        first = k0 / block_q;
    }
    sync_cube();
    if first < query_blocks {
        issue_query_block(
            q,
            grad,
            lse,
            delta,
            &mut qt,
            &mut gt,
            &mut lse_t,
            &mut delta_t,
            0,
            qbase,
            qstride,
            gbase,
            gstride,
            bh * seq_q,
            first * block_q,
            seq_q,
            block_q,
            per_row,
            pitch,
            width,
        );
        commit(&bar0, &bar1, 0);
    }
    for qb in first..query_blocks {
        let i0 = qb * block_q;
        let n = qb - first;
        let cur = n % 2;
        if qb + 1 < query_blocks {
            issue_query_block(
                q,
                grad,
                lse,
                delta,
                &mut qt,
                &mut gt,
                &mut lse_t,
                &mut delta_t,
                (n + 1) % 2,
                qbase,
                qstride,
                gbase,
                gstride,
                bh * seq_q,
                i0 + block_q,
                seq_q,
                block_q,
                per_row,
                pitch,
                width,
            );
            commit(&bar0, &bar1, (n + 1) % 2);
        }
        wait_block(&bar0, &bar1, n);
        let lrow = cur * block_q;

        // S^T = k q^T and dP^T = v dO^T (rows: keys, columns: queries).
        let mut s = zeros::<NC>(comptime!(mt * s_tiles * 2));
        let mut dp = zeros::<NC>(comptime!(mt * s_tiles * 2));
        block_product::<F, N, NA, NB, NC>(
            &kt,
            w0,
            &qt,
            cur * tile,
            &mut s,
            comptime!(hd / 16),
            s_tiles,
            mt,
            pitch,
            width,
            true,
        );
        block_product::<F, N, NA, NB, NC>(
            &vt,
            w0,
            &gt,
            cur * tile,
            &mut dp,
            comptime!(hd / 16),
            s_tiles,
            mt,
            pitch,
            width,
            true,
        );

        // P^T in place of S^T, dS^T in place of dP^T. Scores of (query, key) pairs past either
        // length or above the diagonal become a large negative value (P = 0), tested only in
        // blocks that meet such a pair (uniform across the warp).
        #[unroll]
        for i in 0..comptime!(mt * s_tiles * 2) {
            s[i] = s[i] * Vector::new(scale);
        }
        let last_key = k0 + w0 + comptime!(mt * 16);
        let mut edge = i0 + block_q > seq_q || last_key > seq_k;
        if comptime!(causal) {
            edge = edge || last_key > i0 + 1;
        }
        if edge {
            #[unroll]
            for m in 0..mt {
                #[unroll]
                for half in 0..2usize {
                    let key = k0 + w0 + m * 16 + half * 8 + g;
                    #[unroll]
                    for t in 0..s_tiles {
                        let at = (m * s_tiles + t) * 2 + half;
                        let mut x = s[at];
                        #[unroll]
                        for e in 0..2usize {
                            let qi = i0 + t * 8 + t4 * 2 + e;
                            if qi >= seq_q || !visible(qi, key, seq_k, causal) {
                                x[e] = neg_big();
                            }
                        }
                        s[at] = x;
                    }
                }
            }
        }
        #[unroll]
        for t in 0..s_tiles {
            #[unroll]
            for e in 0..2usize {
                let col = t * 8 + t4 * 2 + e;
                let l = lse_t[lrow + col];
                let d = delta_t[lrow + col];
                #[unroll]
                for m in 0..mt {
                    #[unroll]
                    for half in 0..2usize {
                        let at = (m * s_tiles + t) * 2 + half;
                        let mut x = s[at];
                        let mut y = dp[at];
                        let p = (x[e] - l).exp();
                        x[e] = p;
                        y[e] = p * (y[e] - d);
                        s[at] = x;
                        dp[at] = y;
                    }
                }
            }
        }

        // dV += P^T dO, dK += dS^T q.
        scores_product::<F, N, NA, NB, NC>(
            &s,
            &gt,
            cur * tile,
            &mut dv_acc,
            s_tiles,
            o_tiles,
            mt,
            pitch,
            width,
        );
        scores_product::<F, N, NA, NB, NC>(
            &dp,
            &qt,
            cur * tile,
            &mut dk_acc,
            s_tiles,
            o_tiles,
            mt,
            pitch,
            width,
        );
        if comptime!(fuse_dq) {
            store_ds_t::<F, NA, NC>(&dp, &mut ds_t, w0, ds_pitch, mt, s_tiles);
            sync_cube();
            dq_block_atomic::<F, N, NA, NB, NC>(
                &ds_t,
                &kt,
                dq_acc,
                bh * seq_q * hd,
                i0,
                seq_q,
                scale,
                hd,
                planes,
                block_q,
                block_k,
                ds_pitch,
                pitch,
                width,
            );
        }
        sync_cube();
    }

    store_rows::<F, NC>(
        &dk_acc,
        dk,
        b * dk.stride(0) + h * dk.stride(1),
        k0 + w0,
        seq_k,
        scale,
        mt,
        hd,
    );
    store_rows::<F, NC>(
        &dv_acc,
        dv,
        b * dv.stride(0) + h * dv.stride(1),
        k0 + w0,
        seq_k,
        1.0,
        mt,
        hd,
    );
}
