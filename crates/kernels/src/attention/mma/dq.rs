//! The tensor-core dQ kernel (the deterministic path: dQ in a kernel of its own) and the cast of
//! the fused dQ's f32 accumulator to the input dtype.

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use crate::philox::{factor, half_word, philox, DropScalars};

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
    group: usize,
    seq_q: usize,
    seq_k: usize,
    scale: f32,
    #[comptime] hd: usize,
    #[comptime] planes: usize,
    #[comptime] mt: usize,
    #[comptime] block_k: usize,
    #[comptime] width: usize,
    #[comptime] causal: bool,
    drop: DropScalars,
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
    // The k/v head shared by this query head's group.
    let kv = kv_source(k, v, b, h / group, seq_k, width);
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
                            drop.key0,
                            drop.key1,
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
                                    let z = factor(half_word(word, e == 1), &drop);
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
