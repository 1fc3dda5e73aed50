//! The tensor-core FlashAttention backward kernels: dQ, dK/dV, and the f32-to-input dQ cast.

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::super::kernel::{neg_big, visible};
use crate::philox::{factor, half_word, philox};
use crate::pipeline::{commit, wait_block};

use super::fragments::*;

/// Tensor-core dQ. Grid `(query blocks, batch * heads)`, cube `(32, planes)`; each warp owns
/// `16 * mt` query rows; q and dO stay staged in shared memory, k/v blocks stream through.
/// Under a causal mask a warp skips the key blocks wholly above its rows' diagonal.
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
    key0: u32,
    key1: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] dropout: bool,
    #[define(F)] _dtype: StorageType,
) {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let size!(NA) = def.vector_size(cmma::MatrixIdent::A);
    let size!(NB) = def.vector_size(cmma::MatrixIdent::B);
    let size!(NC) = def.vector_size(cmma::MatrixIdent::Accumulator);

    let lane = lane();
    let g = lane / 4;
    let bh = CUBE_POS_Y as usize;
    let (b, h) = (bh / heads, bh % heads);
    let block_q = comptime!(planes * mt * 16);
    let q0 = (CUBE_COUNT_X as usize - 1 - CUBE_POS_X as usize) * block_q;
    let w0 = UNIT_POS_Y as usize * comptime!(mt * 16);
    let pitch = comptime!((hd + 8) / width);
    let per_row = comptime!(hd / width);
    // K and V are double-buffered (a third buffer would cost hd 128 its second cube per SM).
    let tile = comptime!(block_k * pitch);
    let threads = comptime!(planes * 32);
    let mut qt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(block_q * pitch), ALIGN);
    let mut gt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(block_q * pitch), ALIGN);
    let mut kt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * tile), ALIGN);
    let mut vt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * tile), ALIGN);
    let bar0 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let bar1 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let bar2 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let kv = kv_source(k, v, b, h, seq_k, width);
    let blocks = key_blocks(q0, seq_q, seq_k, block_q, block_k, causal);
    // q and dO are copied with the first key block (their copies complete with its barrier).
    if blocks > 0 {
        copy_head_rows(
            q, &mut qt, b, h, q0, seq_q, block_q, per_row, pitch, width, true, threads,
        );
        copy_head_rows(
            grad, &mut gt, b, h, q0, seq_q, block_q, per_row, pitch, width, true, threads,
        );
    }

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

    // The barriers are initialised before any unit commits to them.
    sync_cube();
    kv_ring_start(
        k, v, &mut kt, &mut vt, &kv, &bar0, &bar1, &bar2, blocks, block_k, per_row, pitch, width,
        threads, 2usize,
    );
    for kb in 0..blocks {
        let j0 = kb * block_k;
        let cur = kv_ring_next(
            k, v, &mut kt, &mut vt, &kv, &bar0, &bar1, &bar2, kb, blocks, block_k, per_row, pitch,
            width, threads, 2usize,
        );

        // Under a causal mask, blocks wholly above this warp's diagonal add nothing.
        if rows_see(j0, q0 + w0, comptime!(mt * 16), causal) {
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

            // dS = P * (dP - delta), P = exp(scale * S - lse), in place of S; masked scores
            // become a large negative value (the scale is positive), so P and dS are 0 there.
            if edge_block(q0 + w0, j0, seq_k, block_k, causal) {
                mask_scores::<NC>(&mut s, q0 + w0, j0, seq_k, mt, s_tiles, causal);
            }
            if comptime!(dropout) {
                // dS = P * (dP * Z - delta): dP of the kept probabilities goes through the
                // forward's mask, drawn again (one Philox call per lane and 16 x 16 tile, as the
                // forward).
                #[unroll]
                for m in 0..mt {
                    let query_tile = u32::cast_from((q0 + w0) / 16 + m);
                    #[unroll]
                    for u in 0..comptime!(s_tiles / 2) {
                        let w = philox(
                            u32::cast_from(lane),
                            u32::cast_from(j0 / 16 + u),
                            query_tile,
                            u32::cast_from(bh),
                            key0,
                            key1,
                        );
                        #[unroll]
                        for half in 0..2usize {
                            let r = m * 2 + half;
                            #[unroll]
                            for tt in 0..2usize {
                                let at = (m * s_tiles + u * 2 + tt) * 2 + half;
                                let word = w[half * 2 + tt];
                                let mut x = s[at];
                                let y = dp[at];
                                #[unroll]
                                for e in 0..2usize {
                                    let z = factor(half_word(word, e == 1), threshold, keep_scale);
                                    x[e] = (x[e] * scale - lse_r[r]).exp() * (y[e] * z - d_r[r]);
                                }
                                s[at] = x;
                            }
                        }
                    }
                }
            } else {
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
                                x[e] = (x[e] * scale - lse_r[r]).exp() * (y[e] - d_r[r]);
                            }
                            s[at] = x;
                        }
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
        }
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

/// Writes this warp's dS^T tiles (`dp`: rows = its keys from `w0`, columns = queries from vector
/// `c0` of each row, `s_tiles` of 8) to `ds_t` in the input dtype, one A-fragment register (two
/// columns) per store.
#[cube]
fn store_ds_t<F: Float, NA: Size, NC: Size>(
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
fn dq_block_atomic<F: Float, N: Size, NA: Size, NB: Size, NC: Size, NQ: Size>(
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

/// `dq[b, h, s, :] = acc[b, h, s, :]` in the output dtype (`acc`: contiguous f32, `dq`: any
/// strides that are multiples of `N`, unit last stride), one unit per vector of `N` elements
/// (`per_row` vectors a row).
#[cube(launch_unchecked)]
pub(crate) fn dq_from_f32<F: Float, N: Size>(
    acc: &Tensor<Vector<f32, N>>,
    dq: &mut Tensor<Vector<F, N>>,
    heads: usize,
    seq: usize,
    #[comptime] per_row: usize,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i < acc.len() {
        let c = i % per_row;
        let row = i / per_row;
        let s = row % seq;
        let bh = row / seq;
        let (b, h) = (bh / heads, bh % heads);
        let at = (b * dq.stride(0) + h * dq.stride(1) + s * dq.stride(2)) / dq.vector_size() + c;
        dq[at] = Vector::cast_from(acc[i]);
    }
}

/// Tensor-core dK and dV. Grid `(key blocks, batch * heads)`, cube `(32, planes)`; each warp owns
/// `16 * mt` key rows (k and v stay staged) and walks the query blocks, computing the transposed
/// products `S^T = k q^T`, `dP^T = v dO^T`, then `dV += P^T dO`, `dK += dS^T q` with P^T and
/// dS^T taken from registers. Under a causal mask a warp skips the query blocks that end before
/// its first key.
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(arithmetic_overflow)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_backward_dkdv_mma<F: Float, N: Size, NQ: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    dq_acc: &mut Tensor<Atomic<Vector<f32, NQ>>>,
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
    key0: u32,
    key1: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] dropout: bool,
    #[define(F)] _dtype: StorageType,
) {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let size!(NA) = def.vector_size(cmma::MatrixIdent::A);
    let size!(NB) = def.vector_size(cmma::MatrixIdent::B);
    let size!(NC) = def.vector_size(cmma::MatrixIdent::Accumulator);

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
    copy_head_rows(
        k,
        &mut kt,
        b,
        h,
        k0,
        seq_k,
        block_k,
        per_row,
        pitch,
        width,
        false,
        comptime!(planes * 32),
    );
    copy_head_rows(
        v,
        &mut vt,
        b,
        h,
        k0,
        seq_k,
        block_k,
        per_row,
        pitch,
        width,
        false,
        comptime!(planes * 32),
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
            comptime!(planes * 32),
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
                comptime!(planes * 32),
            );
            commit(&bar0, &bar1, (n + 1) % 2);
        }
        wait_block(&bar0, &bar1, n);
        let lrow = cur * block_q;

        // Under a causal mask, a query block wholly before this warp's first key adds nothing;
        // with the fused dQ the warp's dS^T rows are then zero (`dp` stays zero).
        let mut dp = zeros::<NC>(comptime!(mt * s_tiles * 2));
        if rows_see(k0 + w0, i0, block_q, causal) {
            // S^T = k q^T and dP^T = v dO^T (rows: keys, columns: queries).
            let mut s = zeros::<NC>(comptime!(mt * s_tiles * 2));
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

            transposed_scores::<NC>(
                &mut s,
                &mut dp,
                &lse_t,
                &delta_t,
                lrow,
                k0 + w0,
                i0,
                seq_q,
                seq_k,
                scale,
                bh,
                key0,
                key1,
                threshold,
                keep_scale,
                mt,
                s_tiles,
                causal,
                dropout,
            );
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
        }
        if comptime!(fuse_dq) {
            store_ds_t::<F, NA, NC>(&dp, &mut ds_t, w0, 0, ds_pitch, mt, s_tiles);
            sync_cube();
            dq_block_atomic::<F, N, NA, NB, NC, NQ>(
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
                false,
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

/// Tensor-core dK, dV and dQ with each query block's work split over the warps in three layouts
/// (FlashAttention-2's). Grid `(key blocks, batch * heads)`, cube `(32, planes)`; a cube owns
/// `block_k = planes * mt * 16` keys (k and v stay staged) and walks `block_q`-query blocks:
///
/// - `S^T = k q^T`, `dP^T = v dO^T`: the warps form a `key_warps x 2 / mt` grid (`key_warps =
///   block_k / 32`), 32 keys by `block_q * mt / 2` queries each; P^T and dS^T go to shared
///   memory in the input dtype.
/// - `dV += P^T dO`, `dK += dS^T q`: the same grid over keys and head_dim columns, 32 keys by
///   `hd * mt / 2` columns each, accumulated in registers over the query blocks.
/// - `dQ += dS k` where `fused_dq`: [`dq_block_atomic`], added to an f32 buffer with atomics;
///   otherwise the separate dQ kernel computes dQ.
///
/// Against [`flash_backward_dkdv_mma`], where a warp owns whole key rows (all head_dim columns of
/// dK and dV, so at hd 128 one row tile of 16 keys for 128 f32 accumulators a lane), each warp
/// here owns two row tiles, so every B fragment read from shared memory feeds two MMAs, at the
/// cost of the trip of P^T and dS^T through shared memory. Under a causal mask a warp whose keys
/// all come after its queries leaves its part of P^T and dS^T zero.
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(arithmetic_overflow)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_backward_split_mma<F: Float, N: Size, NQ: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    dq_acc: &mut Tensor<Atomic<Vector<f32, NQ>>>,
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
    #[comptime] fused_dq: bool,
    key0: u32,
    key1: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] dropout: bool,
    #[define(F)] _dtype: StorageType,
) {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let size!(NA) = def.vector_size(cmma::MatrixIdent::A);
    let size!(NB) = def.vector_size(cmma::MatrixIdent::B);
    let size!(NC) = def.vector_size(cmma::MatrixIdent::Accumulator);

    let bh = CUBE_POS_Y as usize;
    let (b, h) = (bh / heads, bh % heads);
    let block_k = comptime!(planes * mt * 16);
    let k0 = CUBE_POS_X as usize * block_k;
    // Two row tiles (32 keys) per warp in both layouts; the other warp index splits the block's
    // queries (scores) or head_dim (dK, dV).
    let key_warps = comptime!(block_k / 32);
    let split = comptime!(planes / key_warps);
    let sq = comptime!(block_q / split);
    let oc = comptime!(hd / split);
    let warp = UNIT_POS_Y as usize;
    let kr0 = (warp % key_warps) * 32;
    let side = warp / key_warps;
    let (qc0, hc0) = (side * sq, side * oc);
    let pitch = comptime!((hd + 8) / width);
    let per_row = comptime!(hd / width);
    let threads = comptime!(planes * 32);
    let tile = comptime!(block_q * pitch);
    let mut kt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(block_k * pitch), ALIGN);
    let mut vt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(block_k * pitch), ALIGN);
    let mut qt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * tile), ALIGN);
    let mut gt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * tile), ALIGN);
    let mut lse_t = SharedMemory::<f32>::new_aligned(comptime!(2 * block_q), ALIGN);
    let mut delta_t = SharedMemory::<f32>::new_aligned(comptime!(2 * block_q), ALIGN);
    // P^T and dS^T of the current block (keys x queries, pairs of columns per vector as in an A
    // fragment register), rows padded by 8 elements as the other tiles.
    let ds_pitch = comptime!((block_q + 8) / 2);
    let mut p_t = SharedMemory::<Vector<F, NA>>::new_aligned(comptime!(block_k * ds_pitch), ALIGN);
    let mut ds_t = SharedMemory::<Vector<F, NA>>::new_aligned(comptime!(block_k * ds_pitch), ALIGN);
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
    copy_head_rows(
        k, &mut kt, b, h, k0, seq_k, block_k, per_row, pitch, width, false, threads,
    );
    copy_head_rows(
        v, &mut vt, b, h, k0, seq_k, block_k, per_row, pitch, width, false, threads,
    );

    let s_tiles = comptime!(sq / 8);
    let o_tiles = comptime!(oc / 8);
    let mut dk_acc = zeros::<NC>(comptime!(2 * o_tiles * 2));
    let mut dv_acc = zeros::<NC>(comptime!(2 * o_tiles * 2));

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
            threads,
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
                threads,
            );
            commit(&bar0, &bar1, (n + 1) % 2);
        }
        wait_block(&bar0, &bar1, n);
        // This warp's queries: columns `qc0 ..` of the block.
        let lrow = cur * block_q + qc0;
        let j0 = i0 + qc0;

        let mut s = zeros::<NC>(comptime!(2 * s_tiles * 2));
        let mut dp = zeros::<NC>(comptime!(2 * s_tiles * 2));
        if rows_see(k0 + kr0, j0, sq, causal) {
            block_product::<F, N, NA, NB, NC>(
                &kt,
                kr0,
                &qt,
                cur * tile + qc0 * pitch,
                &mut s,
                comptime!(hd / 16),
                s_tiles,
                2usize,
                pitch,
                width,
                true,
            );
            block_product::<F, N, NA, NB, NC>(
                &vt,
                kr0,
                &gt,
                cur * tile + qc0 * pitch,
                &mut dp,
                comptime!(hd / 16),
                s_tiles,
                2usize,
                pitch,
                width,
                true,
            );

            transposed_scores::<NC>(
                &mut s,
                &mut dp,
                &lse_t,
                &delta_t,
                lrow,
                k0 + kr0,
                j0,
                seq_q,
                seq_k,
                scale,
                bh,
                key0,
                key1,
                threshold,
                keep_scale,
                2usize,
                s_tiles,
                causal,
                dropout,
            );
        }
        store_ds_t::<F, NA, NC>(&s, &mut p_t, kr0, qc0 / 2, ds_pitch, 2usize, s_tiles);
        store_ds_t::<F, NA, NC>(&dp, &mut ds_t, kr0, qc0 / 2, ds_pitch, 2usize, s_tiles);
        sync_cube();

        // dV += P^T dO, dK += dS^T q: this warp's keys and head_dim columns `hc0 ..`.
        tile_product::<F, NA, N, NA, NB, NC>(
            &p_t,
            kr0,
            &gt,
            cur * tile + hc0 / width,
            &mut dv_acc,
            comptime!(block_q / 16),
            o_tiles,
            2usize,
            ds_pitch,
            2usize,
            pitch,
            width,
            false,
        );
        tile_product::<F, NA, N, NA, NB, NC>(
            &ds_t,
            kr0,
            &qt,
            cur * tile + hc0 / width,
            &mut dk_acc,
            comptime!(block_q / 16),
            o_tiles,
            2usize,
            ds_pitch,
            2usize,
            pitch,
            width,
            false,
        );
        if comptime!(fused_dq) {
            dq_block_atomic::<F, N, NA, NB, NC, NQ>(
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
                true,
            );
        }
        sync_cube();
    }

    store_rows::<F, NC>(
        &dk_acc,
        dk,
        b * dk.stride(0) + h * dk.stride(1) + hc0,
        k0 + kr0,
        seq_k,
        scale,
        2usize,
        oc,
    );
    store_rows::<F, NC>(
        &dv_acc,
        dv,
        b * dv.stride(0) + h * dv.stride(1) + hc0,
        k0 + kr0,
        seq_k,
        1.0,
        2usize,
        oc,
    );
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
fn transposed_scores<NC: Size>(
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
    seed0: u32,
    seed1: u32,
    threshold: u32,
    keep_scale: f32,
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
                        seed0,
                        seed1,
                    );
                    #[unroll]
                    for tt in 0..2usize {
                        let col = (u * 2 + tt) * 8 + t4 * 2 + e;
                        let l = lse_t[lrow + col];
                        let d = delta_t[lrow + col];
                        #[unroll]
                        for half in 0..2usize {
                            let at = (m * s_tiles + u * 2 + tt) * 2 + half;
                            let z =
                                factor(half_word(w[tt * 2 + half], high), threshold, keep_scale);
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
