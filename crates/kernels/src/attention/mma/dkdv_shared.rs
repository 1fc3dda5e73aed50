//! What the two dK/dV kernels share: the staging of the cube's keys and the double-buffered walk
//! over the query blocks, the scores of a block transposed, and for the fused dQ, dS^T staged in
//! shared memory and a block's partial dQ added to the f32 accumulator with atomics.

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::super::kernel::{neg_big, visible};
use crate::philox::{factor, half_word, philox, DropScalars};
use crate::pipeline::{commit, wait_block};

use super::fragments::*;

/// `(base, row stride)` of batch `b` and head `h` of a `[batch, heads, seq, head_dim]` tensor, in
/// vectors of `width` (its strides are multiples of `width`).
#[cube]
pub(crate) fn head_rows<F: Float, N: Size>(
    t: &Tensor<Vector<F, N>>,
    b: usize,
    h: usize,
    #[comptime] width: usize,
) -> (usize, usize) {
    (
        (b * t.stride(0) + h * t.stride(1)) / width,
        t.stride(2) / width,
    )
}

/// Copies the cube's `block_k` rows of k and v from key `k0` on into `kt` and `vt` with plain
/// loads and stores; they stay staged while the query blocks pass.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_keys<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    kt: &mut SharedMemory<Vector<F, N>>,
    vt: &mut SharedMemory<Vector<F, N>>,
    b: usize,
    h: usize,
    k0: usize,
    seq_k: usize,
    #[comptime] block_k: usize,
    #[comptime] per_row: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
    #[comptime] threads: usize,
) {
    copy_head_rows(
        k, kt, b, h, k0, seq_k, block_k, per_row, pitch, width, false, threads,
    );
    copy_head_rows(
        v, vt, b, h, k0, seq_k, block_k, per_row, pitch, width, false, threads,
    );
}

/// The query blocks the cube walks, `(first, query_blocks)`: all of them, or under a causal mask
/// those from the one holding the cube's first key `k0` on (earlier ones see none of its keys).
/// Waits for the whole cube (the barriers are initialised and the keys staged before any unit
/// goes on), then starts the copies of the first block into buffer 0. q, dO and their rows'
/// log-sum-exp and delta are double-buffered (`qt`, `gt`: two tiles of `block_q * pitch` vectors;
/// `lse_t`, `delta_t`: two runs of `block_q`): block `qb + 1` is copied (cp.async) while block
/// `qb` is used, see [`next_query_block`]. `qbase`, `qstride`, `gbase`, `gstride`: q's and dO's
/// rows of this batch and head ([`head_rows`]).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn start_query_blocks<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    qt: &mut SharedMemory<Vector<F, N>>,
    gt: &mut SharedMemory<Vector<F, N>>,
    lse_t: &mut SharedMemory<f32>,
    delta_t: &mut SharedMemory<f32>,
    bar0: &Shared<Barrier>,
    bar1: &Shared<Barrier>,
    qbase: usize,
    qstride: usize,
    gbase: usize,
    gstride: usize,
    bh: usize,
    k0: usize,
    seq_q: usize,
    #[comptime] block_q: usize,
    #[comptime] per_row: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
    #[comptime] threads: usize,
    #[comptime] causal: bool,
) -> (usize, usize) {
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
            qt,
            gt,
            lse_t,
            delta_t,
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
            threads,
        );
        commit(bar0, bar1, 0);
    }
    (first, query_blocks)
}

/// Query block `qb` of the walk that [`start_query_blocks`] began: starts the copies of the next
/// block into the other buffer, if there is one, then waits for this block's. Returns `(i0,
/// cur)`: the block's first query row and its buffer (0 or 1).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn next_query_block<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    qt: &mut SharedMemory<Vector<F, N>>,
    gt: &mut SharedMemory<Vector<F, N>>,
    lse_t: &mut SharedMemory<f32>,
    delta_t: &mut SharedMemory<f32>,
    bar0: &Shared<Barrier>,
    bar1: &Shared<Barrier>,
    qbase: usize,
    qstride: usize,
    gbase: usize,
    gstride: usize,
    bh: usize,
    qb: usize,
    first: usize,
    query_blocks: usize,
    seq_q: usize,
    #[comptime] block_q: usize,
    #[comptime] per_row: usize,
    #[comptime] pitch: usize,
    #[comptime] width: usize,
    #[comptime] threads: usize,
) -> (usize, usize) {
    let i0 = qb * block_q;
    let n = qb - first;
    let cur = n % 2;
    if qb + 1 < query_blocks {
        issue_query_block(
            q,
            grad,
            lse,
            delta,
            qt,
            gt,
            lse_t,
            delta_t,
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
            threads,
        );
        commit(bar0, bar1, (n + 1) % 2);
    }
    wait_block(bar0, bar1, n);
    (i0, cur)
}

/// Writes this warp's dS^T tiles (`dp`: rows = its keys from `w0`, columns = queries from vector
/// `c0` of each row, `s_tiles` of 8) to `ds_t` in the input dtype, one A-fragment register (two
/// columns) per store.
#[cube]
pub(crate) fn store_ds_t<F: Float, NA: Size, NC: Size>(
    dp: &Array<Vector<f32, NC>>,
    ds_t: &mut SharedMemory<Vector<F, NA>>,
    w0: usize,
    c0: usize,
    #[comptime] ds_pitch: usize,
    #[comptime] mt: usize,
    #[comptime] s_tiles: usize,
) {
    let lane = lane();
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
                ds_t[row * ds_pitch + c0 + t * 4 + t4] = y;
            }
        }
    }
}

/// Fused dQ of one query block: `dq_acc[i0 + r] += scale * dS k` over the cube's `block_k` keys,
/// added with f32 atomics (other key blocks add theirs): a lane's two neighbouring columns in one
/// vector atomic where `NQ` is 2 (sm_90), else one atomic each. Every atomic computes its own
/// 64-bit address (the index is 32-bit), and the compiler reloads the buffer's base from the
/// constant bank for them when registers are short, so halving their count matters. The `block_q / 16` row tiles and the
/// head_dim columns are split over the warps: `planes / row_tiles` column groups when there are
/// more warps than row tiles, else `row_tiles / planes` row tiles per warp; columns go in chunks
/// of 32 (or 16) so that the accumulators stay small next to dK and dV. `paired`: two row tiles
/// per warp where the warps then still split head_dim into groups of a multiple of 16 (each B
/// fragment read feeds two MMAs; the split backward's layout).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn dq_block_atomic<F: Float, N: Size, NA: Size, NB: Size, NC: Size, NQ: Size>(
    ds_t: &SharedMemory<Vector<F, NA>>,
    kt: &SharedMemory<Vector<F, N>>,
    dq_acc: &mut Tensor<Atomic<Vector<f32, NQ>>>,
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
    #[comptime] paired: bool,
) {
    let lane = lane();
    let (g, t4) = (lane / 4, lane % 4);
    let nq = NQ::value().comptime();
    let row_tiles = comptime!(block_q / 16);
    let qm = comptime!(if row_tiles > planes {
        row_tiles / planes
    } else if paired
        && row_tiles.is_multiple_of(2)
        && planes.is_multiple_of(row_tiles / 2)
        && hd.is_multiple_of(16 * (planes / (row_tiles / 2)))
    {
        2
    } else {
        1
    });
    let row_slots = comptime!(row_tiles / qm);
    let group_cols = comptime!(hd / (planes / row_slots));
    // Chunks of 32 columns, or 16 where 32 does not divide the group (hd 96 over two groups).
    let chunk = comptime!(if group_cols.is_multiple_of(32) {
        32
    } else {
        16
    });
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
                // The warp's first column as the tile offset (in vectors), outside `load_b2`'s
                // division by the width, so that every fragment's address is one base plus a
                // constant.
                let bf =
                    load_b2::<F, N, NB>(kt, col0 / width, kk * 16, pair * 16, pitch, width, false);
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
                        if comptime!(nq == 2) {
                            // One `red.global.add.v2.f32` for the lane's pair of columns.
                            let mut pair = Vector::<f32, NQ>::empty();
                            pair[0] = x[0] * scale;
                            pair[1] = x[1] * scale;
                            dq_acc[at / 2].fetch_add(pair);
                        } else {
                            dq_acc[at].fetch_add(Vector::new(x[0] * scale));
                            dq_acc[at + 1].fetch_add(Vector::new(x[1] * scale));
                        }
                    }
                }
            }
        }
    }
}

/// P^T and dS^T of a warp's transposed score tiles, in place (the dK/dV kernels). `s` holds
/// `S^T = k q^T` and `dp` holds `dP^T = v dO^T` for `mt` row tiles of keys from `key0` and
/// `s_tiles` column tiles of queries from `query0`, whose log-sum-exp and delta sit in `lse_t`
/// and `delta_t` from `lrow` on. `s` becomes P^T (times the dropout mask's factor Z) and `dp`
/// becomes `dS^T = P^T (dP^T Z - delta)`. Pairs past either length or above the diagonal get a
/// large negative score (P = 0, which the positive scale keeps so), tested only when the tiles
/// meet such a pair (uniform across the warp); the scale goes into the exponent's argument (one
/// fused multiply-add an entry).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn transposed_scores<NC: Size>(
    s: &mut Array<Vector<f32, NC>>,
    dp: &mut Array<Vector<f32, NC>>,
    lse_t: &SharedMemory<f32>,
    delta_t: &SharedMemory<f32>,
    lrow: usize,
    key0: usize,
    query0: usize,
    seq_q: usize,
    seq_k: usize,
    scale: f32,
    bh: usize,
    drop: &DropScalars,
    #[comptime] mt: usize,
    #[comptime] s_tiles: usize,
    #[comptime] causal: bool,
    #[comptime] dropout: bool,
) {
    let lane = lane();
    let (g, t4) = (lane / 4, lane % 4);
    let last_key = key0 + comptime!(mt * 16);
    let mut edge = query0 + comptime!(s_tiles * 8) > seq_q || last_key > seq_k;
    if comptime!(causal) {
        edge = edge || last_key > query0 + 1;
    }
    if edge {
        #[unroll]
        for m in 0..mt {
            #[unroll]
            for half in 0..2usize {
                let key = key0 + m * 16 + half * 8 + g;
                #[unroll]
                for t in 0..s_tiles {
                    let at = (m * s_tiles + t) * 2 + half;
                    let mut x = s[at];
                    #[unroll]
                    for e in 0..2usize {
                        let qi = query0 + t * 8 + t4 * 2 + e;
                        if qi >= seq_q || !visible(qi, key, seq_k, causal) {
                            x[e] = neg_big();
                        }
                    }
                    s[at] = x;
                }
            }
        }
    }
    if comptime!(dropout) {
        // The forward's mask drawn again. These tiles are transposed, so a lane's entries of a
        // 16 x 16 tile belong to the forward's lanes 4 (2 t4 + e) + g / 2 for e = 0, 1: two
        // Philox calls per tile.
        let high = g % 2 == 1;
        #[unroll]
        for m in 0..mt {
            let key_tile = u32::cast_from(key0 / 16 + m);
            #[unroll]
            for u in 0..comptime!(s_tiles / 2) {
                #[unroll]
                for e in 0..2usize {
                    let w = philox(
                        u32::cast_from((t4 * 2 + e) * 4 + g / 2),
                        key_tile,
                        u32::cast_from(query0 / 16 + u),
                        u32::cast_from(bh),
                        drop.key0,
                        drop.key1,
                    );
                    #[unroll]
                    for tt in 0..2usize {
                        let col = (u * 2 + tt) * 8 + t4 * 2 + e;
                        let l = lse_t[lrow + col];
                        let d = delta_t[lrow + col];
                        #[unroll]
                        for half in 0..2usize {
                            let at = (m * s_tiles + u * 2 + tt) * 2 + half;
                            let z = factor(half_word(w[tt * 2 + half], high), drop);
                            let mut x = s[at];
                            let mut y = dp[at];
                            let p = (x[e] * scale - l).exp();
                            x[e] = p * z;
                            y[e] = p * (y[e] * z - d);
                            s[at] = x;
                            dp[at] = y;
                        }
                    }
                }
            }
        }
    } else {
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
                        let p = (x[e] * scale - l).exp();
                        x[e] = p;
                        y[e] = p * (y[e] - d);
                        s[at] = x;
                        dp[at] = y;
                    }
                }
            }
        }
    }
}
