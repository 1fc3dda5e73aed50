//! The building blocks of the tensor-core kernels: staging, `ldmatrix` fragments, MMA block
//! products, masking and the block loops shared by the forward and the backward.

use cubecl::prelude::barrier::{copy_async, Barrier};
use cubecl::prelude::*;

use crate::pipeline::{commit_ring, wait_ring};

use super::super::kernel::{neg_big, visible};

/// Shared-memory alignment of the staged tiles (`ldmatrix` reads 16-byte rows).
pub(crate) const ALIGN: usize = 16;

/// This unit's index in its two-dimensional cube (`(32, planes)` in the tensor-core kernels):
/// `UNIT_POS` without its `z` term, which the compiler otherwise re-reads from a special
/// register at every use inside a loop once registers run short (the dK/dV kernel at head_dim 64
/// spent 7% of its warps' stall samples waiting for that read at the top of its query-block loop).
#[cube]
pub(crate) fn cube_unit() -> usize {
    lane() + UNIT_POS_Y as usize * 32
}

/// This unit's lane in its warp. The tensor-core kernels' cubes are one warp wide (`(32,
/// warps)`), so the lane is the unit's x position; read so, the generated code takes it from
/// `threadIdx.x` with a known range (`UNIT_POS_PLANE` derives it from the unit's global index
/// modulo the runtime warp size), which lets the compiler fold more of each fragment's address.
#[cube]
pub(crate) fn lane() -> usize {
    UNIT_POS_X as usize % 32
}

/// Copies rows `row0 .. row0 + rows` of `t` (base offset `base`, row stride `row_stride`, both in
/// vectors; `per_row` vectors make one row of head_dim) into `tile` from vector `off` on, rows
/// `pitch` vectors apart; rows past `seq` are zero. `asynchronous`: with `cp.async` (one vector of
/// `width` elements each), completion tracked by [`crate::pipeline::commit`]; otherwise with plain
/// loads and stores. `threads`: the cube's units, all of which take part.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy_rows<F: Float, N: Size>(
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
    #[comptime] threads: usize,
) {
    let total = comptime!(rows * per_row);
    if comptime!(threads.is_multiple_of(per_row) && total.is_multiple_of(threads)) {
        // Each unit copies one column (vector) of every `threads / per_row`-th row: the loop is
        // unrolled and the addresses step by constants.
        let c = cube_unit() % per_row;
        let r0 = cube_unit() / per_row;
        #[unroll]
        for i in 0..comptime!(total / threads) {
            copy_vector(
                t,
                tile,
                off,
                base,
                row_stride,
                row0,
                seq,
                r0 + i * comptime!(threads / per_row),
                c,
                pitch,
                width,
                asynchronous,
            );
        }
    } else {
        let mut idx = cube_unit();
        while idx < total {
            copy_vector(
                t,
                tile,
                off,
                base,
                row_stride,
                row0,
                seq,
                idx / per_row,
                idx % per_row,
                pitch,
                width,
                asynchronous,
            );
            idx += CUBE_DIM as usize;
        }
    }
}

/// [`copy_rows`] of batch `b` and head `h` of a `[batch, heads, seq, head_dim]` tensor (any
/// strides that are multiples of `width`, unit last stride) into `tile` from vector 0 on.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy_head_rows<F: Float, N: Size>(
    t: &Tensor<Vector<F, N>>,
    tile: &mut SharedMemory<Vector<F, N>>,
    b: usize,
    h: usize,
    row0: usize,
    seq: usize,
    #[comptime] rows: usize,
    #[comptime] per_row: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
    #[comptime] asynchronous: bool,
    #[comptime] threads: usize,
) {
    copy_rows(
        t,
        tile,
        0,
        (b * t.stride(0) + h * t.stride(1)) / width,
        t.stride(2) / width,
        row0,
        seq,
        rows,
        per_row,
        pitch,
        width,
        asynchronous,
        threads,
    );
}

/// Vector `c` of tile row `r` (tensor row `row0 + r`, zero past `seq`) for [`copy_rows`].
#[cube]
#[allow(clippy::too_many_arguments)]
fn copy_vector<F: Float, N: Size>(
    t: &Tensor<Vector<F, N>>,
    tile: &mut SharedMemory<Vector<F, N>>,
    off: usize,
    base: usize,
    row_stride: usize,
    row0: usize,
    seq: usize,
    r: usize,
    c: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
    #[comptime] asynchronous: bool,
) {
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
}

/// Where the key and value rows of this cube's batch and head are: base offsets and row strides
/// in vectors, and the number of keys.
#[derive(CubeType)]
pub(crate) struct KvSource {
    pub kbase: usize,
    pub kstride: usize,
    pub vbase: usize,
    pub vstride: usize,
    pub seq_k: usize,
}

/// The [`KvSource`] of batch `b` and head `h` of `k` and `v` (strides in vectors of `width`).
#[cube]
pub(crate) fn kv_source<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    b: usize,
    h: usize,
    seq_k: usize,
    #[comptime] width: usize,
) -> KvSource {
    KvSource {
        kbase: (b * k.stride(0) + h * k.stride(1)) / width,
        kstride: k.stride(2) / width,
        vbase: (b * v.stride(0) + h * v.stride(1)) / width,
        vstride: v.stride(2) / width,
        seq_k,
    }
}

/// The key/value ring of the forward and dQ kernels: `stages` (2 or 3) buffers of `block_k` rows
/// in `kt` and `vt`, `block_k * pitch` vectors each; key block `i` goes to buffer `i % stages`, its
/// copies tracked by barrier `i % stages` (see [`crate::pipeline::wait_ring`]). Starts the copies
/// of the first `stages - 1` blocks (those that exist); any copy this unit issued before (the
/// resident query tiles) completes with block 0's.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn kv_ring_start<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    kt: &mut SharedMemory<Vector<F, N>>,
    vt: &mut SharedMemory<Vector<F, N>>,
    kv: &KvSource,
    bar0: &Shared<Barrier>,
    bar1: &Shared<Barrier>,
    bar2: &Shared<Barrier>,
    blocks: usize,
    #[comptime] block_k: usize,
    #[comptime] per_row: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
    #[comptime] threads: usize,
    #[comptime] stages: usize,
) {
    #[unroll]
    for i in 0..comptime!(stages - 1) {
        if i < blocks {
            issue_kv(
                k,
                v,
                kt,
                vt,
                kv,
                i * comptime!(block_k * pitch),
                i * block_k,
                block_k,
                per_row,
                pitch,
                width,
                threads,
            );
            commit_ring(bar0, bar1, bar2, i);
        }
    }
}

/// Step `kb` of the ring of [`kv_ring_start`]: starts the copies of block `kb + stages - 1` (if it
/// exists) into the buffer block `kb - 1` used (every warp is done with it: the caller syncs the
/// cube at the end of each step), then waits for block `kb`'s copies. Returns the vector offset of
/// block `kb`'s buffer.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn kv_ring_next<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    kt: &mut SharedMemory<Vector<F, N>>,
    vt: &mut SharedMemory<Vector<F, N>>,
    kv: &KvSource,
    bar0: &Shared<Barrier>,
    bar1: &Shared<Barrier>,
    bar2: &Shared<Barrier>,
    kb: usize,
    blocks: usize,
    #[comptime] block_k: usize,
    #[comptime] per_row: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
    #[comptime] threads: usize,
    #[comptime] stages: usize,
) -> usize {
    let tile = comptime!(block_k * pitch);
    let ahead = kb + comptime!(stages - 1);
    if ahead < blocks {
        let which = ahead % stages;
        issue_kv(
            k,
            v,
            kt,
            vt,
            kv,
            which * tile,
            ahead * block_k,
            block_k,
            per_row,
            pitch,
            width,
            threads,
        );
        commit_ring(bar0, bar1, bar2, which);
    }
    wait_ring(bar0, bar1, bar2, kb, stages);
    (kb % stages) * tile
}

/// Starts the copies (cp.async) of the key and value rows `j0 ..` into the buffers at vector
/// `off` of `kt` and `vt` by the cube's `threads` units; rows past the last key are zero.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn issue_kv<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    kt: &mut SharedMemory<Vector<F, N>>,
    vt: &mut SharedMemory<Vector<F, N>>,
    kv: &KvSource,
    off: usize,
    j0: usize,
    #[comptime] block_k: usize,
    #[comptime] per_row: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
    #[comptime] threads: usize,
) {
    copy_rows(
        k, kt, off, kv.kbase, kv.kstride, j0, kv.seq_k, block_k, per_row, pitch, width, true,
        threads,
    );
    copy_rows(
        v, vt, off, kv.vbase, kv.vstride, j0, kv.seq_k, block_k, per_row, pitch, width, true,
        threads,
    );
}

/// A fragment (16 x 16) of a row-major tile, top-left corner at (`row0`, `col0`), by one
/// `ldmatrix.x4`: lane `l` gives the address of row `l % 16`, columns `8 * (l / 16) ..`.
#[cube]
pub(crate) fn load_a<F: Float, N: Size, NA: Size>(
    tile: &SharedMemory<Vector<F, N>>,
    row0: usize,
    col0: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
) -> Array<Vector<F, NA>> {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let lane = lane();
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
/// lanes `8i .. 8i + 7` address the rows (k) of 8 x 8 matrix `i` = (m half `i % 2`, k half
/// `i / 2`).
#[cube]
pub(crate) fn load_a_t<F: Float, N: Size, NA: Size>(
    tile: &SharedMemory<Vector<F, N>>,
    row0: usize,
    col0: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
) -> Array<Vector<F, NA>> {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let lane = lane();
    let (r8, i) = (lane % 8, lane / 8);
    // `row0` is a multiple of `width` (and `width` divides 8): dividing it apart keeps the
    // lane's part a constant offset, so the compiler folds a runtime `row0` into one base
    // address instead of holding one address per fragment.
    let at = (col0 + (i / 2) * 8 + r8) * pitch + row0 / width + (i % 2) * comptime!(8 / width);
    def.load_matrix::<Vector<F, N>, NA>(&tile.slice(at, at + 1), cmma::MatrixIdent::A, 4usize, true)
}

/// B fragments (16 x 8) of the two 8-column tiles `n0 ..` and `n0 + 8 ..` of the product's
/// columns, reduction rows `k0 .. k0 + 16`, of the tile starting at vector `off`, by one
/// `ldmatrix.x4`; vectors 0-1 are the first tile's, 2-3 the second's. `n_rows`: the tile stores B
/// transposed (`B[k][n] = tile[n][k]`, like k in `q k^T`), read as is; otherwise
/// `B[k][n] = tile[k][n]` (like v in `P v`), read with `.trans`.
#[cube]
pub(crate) fn load_b2<F: Float, N: Size, NB: Size>(
    tile: &SharedMemory<Vector<F, N>>,
    off: usize,
    k0: usize,
    n0: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
    #[comptime] n_rows: bool,
) -> Array<Vector<F, NB>> {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let lane = lane();
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
pub(crate) fn part<E: Scalar, NA: Size>(
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
pub(crate) fn mma<F: Float, NA: Size, NB: Size, NC: Size>(
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
pub(crate) fn zeros<NC: Size>(#[comptime] len: usize) -> Array<Vector<f32, NC>> {
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
pub(crate) fn mma_pair<F: Float, NA: Size, NB: Size, NC: Size>(
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
pub(crate) fn scores_as_a<F: Float, NA: Size, NC: Size>(
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
pub(crate) fn rows_as_a<F: Float, N: Size, NA: Size>(
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
pub(crate) fn block_product<F: Float, N: Size, NA: Size, NB: Size, NC: Size>(
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
    tile_product::<F, N, N, NA, NB, NC>(
        a_tile, row0, b_tile, b_off, acc, steps, tiles, mt, pitch, width, pitch, width, n_rows,
    );
}

/// [`block_product`] with an A tile of its own vector type, pitch and width (`a_pitch` vectors of
/// `a_width` elements a row), such as the P^T and dS^T tiles of the split backward, which hold
/// pairs of elements.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn tile_product<F: Float, NT: Size, N: Size, NA: Size, NB: Size, NC: Size>(
    a_tile: &SharedMemory<Vector<F, NT>>,
    row0: usize,
    b_tile: &SharedMemory<Vector<F, N>>,
    b_off: usize,
    acc: &mut Array<Vector<f32, NC>>,
    #[comptime] steps: usize,
    #[comptime] tiles: usize,
    #[comptime] mt: usize,
    #[comptime] a_pitch: usize,
    #[comptime] a_width: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
    #[comptime] n_rows: bool,
) {
    #[unroll]
    for kk in 0..steps {
        let a = rows_as_a::<F, NT, NA>(a_tile, row0, kk, mt, a_pitch, a_width);
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
pub(crate) fn scores_product<F: Float, N: Size, NA: Size, NB: Size, NC: Size>(
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
pub(crate) fn store_rows<F: Float, NC: Size>(
    acc: &Array<Vector<f32, NC>>,
    out: &mut Tensor<F>,
    base: usize,
    row0: usize,
    seq: usize,
    factor: f32,
    #[comptime] mt: usize,
    #[comptime] hd: usize,
) {
    let lane = lane();
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

/// Writes accumulators (`mt` row tiles of `hd / 8` column tiles) to this warp's rows `row0 ..` of
/// `out` (vectors of `ow` elements; `base` and the strides in elements), rows below `seq`, through
/// rows `w0 ..` of `stage` (`(hd + 8) / ow` vectors a row). The warp first puts its rows there,
/// with `stmatrix` (one instruction per 16 x 16 block; `ow` = 8) or else one pair of elements per
/// lane and tile (`ow` = 2); then it writes whole rows, consecutive lanes to consecutive vectors,
/// so that each store instruction covers 128 contiguous bytes or more (a lane's own pairs would
/// make each store 8 rows of 16 bytes). Only this warp's rows of `stage` are used.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn store_rows_staged<F: Float, NA: Size, NC: Size, NO: Size>(
    acc: &Array<Vector<f32, NC>>,
    stage: &mut SharedMemory<Vector<F, NO>>,
    out: &mut Tensor<Vector<F, NO>>,
    base: usize,
    row0: usize,
    w0: usize,
    seq: usize,
    #[comptime] mt: usize,
    #[comptime] hd: usize,
    #[comptime] ow: usize,
    #[comptime] stmatrix: bool,
) {
    let lane = lane();
    let tiles = comptime!(hd / 8);
    let pitch = comptime!((hd + 8) / ow);
    if comptime!(stmatrix) {
        // Matrix i of the x4 store: rows `8 (i % 2) ..` and columns `8 (i / 2) ..` of the 16 x 16
        // block (accumulator tile `2 p + i / 2`, half `i % 2`); lane `l` addresses its row
        // `l % 8`, as `load_a` does for the A fragments.
        let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
        #[unroll]
        for m in 0..mt {
            #[unroll]
            for p in 0..comptime!(tiles / 2) {
                let mut regs = Array::<Vector<F, NA>>::new(4usize);
                #[unroll]
                for i in 0..4usize {
                    let x = acc[(m * tiles + p * 2 + i / 2) * 2 + i % 2];
                    let mut y = Vector::<F, NA>::empty();
                    y[0] = F::cast_from(x[0]);
                    y[1] = F::cast_from(x[1]);
                    regs[i] = y;
                }
                let at = (w0 + m * 16 + lane % 16) * pitch + (p * 16 + (lane / 16) * 8) / ow;
                def.store_matrix::<Vector<F, NO>, NA>(
                    &mut stage.slice_mut(at, at + 1),
                    &regs,
                    cmma::MatrixIdent::A,
                    4usize,
                    false,
                );
            }
        }
    } else {
        let (g, t4) = (lane / 4, lane % 4);
        #[unroll]
        for m in 0..mt {
            #[unroll]
            for half in 0..2usize {
                let row = w0 + m * 16 + half * 8 + g;
                #[unroll]
                for t in 0..tiles {
                    let x = acc[(m * tiles + t) * 2 + half];
                    let mut y = Vector::<F, NO>::empty();
                    y[0] = F::cast_from(x[0]);
                    y[1] = F::cast_from(x[1]);
                    stage[row * pitch + t * 4 + t4] = y;
                }
            }
        }
    }
    sync_plane();
    let per_row = comptime!(hd / ow);
    let rs = out.stride(2) / ow;
    let at0 = base / ow;
    #[unroll]
    for i in 0..comptime!(mt * 16 * hd / ow / 32) {
        let idx = i * 32 + lane;
        let (r, c) = (idx / per_row, idx % per_row);
        if row0 + r < seq {
            out[at0 + (row0 + r) * rs + c] = stage[(w0 + r) * pitch + c];
        }
    }
}

/// Starts the copies of query block rows `i0 ..` into buffer `which` (0 or 1) of the dK/dV
/// kernel: q and dO rows, and the log-sum-exp and delta of those rows (`rows0` is the first row of
/// this batch and head in `lse` and `delta`); rows past `seq_q` are zero.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn issue_query_block<F: Float, N: Size>(
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
    #[comptime] threads: usize,
) {
    let off = which * comptime!(block_q * pitch);
    copy_rows(
        q, qt, off, qbase, qstride, i0, seq_q, block_q, per_row, pitch, width, true, threads,
    );
    copy_rows(
        grad, gt, off, gbase, gstride, i0, seq_q, block_q, per_row, pitch, width, true, threads,
    );
    let mut r = cube_unit();
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
pub(crate) fn edge_block(
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
pub(crate) fn mask_scores<NC: Size>(
    s: &mut Array<Vector<f32, NC>>,
    row0: usize,
    j0: usize,
    seq_k: usize,
    #[comptime] mt: usize,
    #[comptime] s_tiles: usize,
    #[comptime] causal: bool,
) {
    let lane = lane();
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

/// Whether any of the query rows `row0 .. row0 + rows` sees a key from `key0` on: always without a
/// causal mask; under it, unless every key from `key0` lies above the last row's diagonal. The
/// forward and dQ ask it for a warp's rows and a key block (a warp skips the blocks its cube still
/// walks for its later rows), the dK/dV kernel for a query block and a warp's first key. Uniform
/// across the warp.
#[cube]
pub(crate) fn rows_see(
    key0: usize,
    row0: usize,
    #[comptime] rows: usize,
    #[comptime] causal: bool,
) -> bool {
    let mut sees = true;
    if comptime!(causal) {
        sees = key0 < row0 + rows;
    }
    sees
}

/// Number of key blocks a query block starting at `q0` (of `block_q` rows) visits.
#[cube]
pub(crate) fn key_blocks(
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
