//! The tensor-core dK/dV kernel in FlashAttention-2's split warp layouts: each query block's
//! products are split over the warps, with P^T and dS^T passed through shared memory.

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use crate::philox::DropScalars;

use super::dkdv_shared::{
    dq_block_atomic, head_rows, next_query_block, stage_keys, start_query_blocks, store_ds_t,
    transposed_scores,
};
use super::fragments::*;

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
/// all come after its queries leaves its part of P^T and dS^T zero. Grouped-query attention: as
/// in [`flash_backward_dkdv_mma`] (k, v at head `h / group`; dK, dV at `h` in `G`).
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(arithmetic_overflow)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_backward_split_mma<F: Float, G: Float, N: Size, NQ: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<G>,
    dv: &mut Tensor<G>,
    dq_acc: &mut Tensor<Atomic<Vector<f32, NQ>>>,
    heads: usize,
    group: usize,
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
    drop: DropScalars,
    #[comptime] dropout: bool,
    #[define(F, G)] _dtypes: [StorageType; 2],
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
    let (qbase, qstride) = head_rows(q, b, h, width);
    let (gbase, gstride) = head_rows(grad, b, h, width);
    // Keys and values of the head shared by this query head's group.
    stage_keys(
        k,
        v,
        &mut kt,
        &mut vt,
        b,
        h / group,
        k0,
        seq_k,
        block_k,
        per_row,
        pitch,
        width,
        threads,
    );

    let s_tiles = comptime!(sq / 8);
    let o_tiles = comptime!(oc / 8);
    let mut dk_acc = zeros::<NC>(comptime!(2 * o_tiles * 2));
    let mut dv_acc = zeros::<NC>(comptime!(2 * o_tiles * 2));

    let (first, query_blocks) = start_query_blocks(
        q,
        grad,
        lse,
        delta,
        &mut qt,
        &mut gt,
        &mut lse_t,
        &mut delta_t,
        &bar0,
        &bar1,
        qbase,
        qstride,
        gbase,
        gstride,
        bh,
        k0,
        seq_q,
        block_q,
        per_row,
        pitch,
        width,
        threads,
        causal,
    );
    for qb in first..query_blocks {
        let (i0, cur) = next_query_block(
            q,
            grad,
            lse,
            delta,
            &mut qt,
            &mut gt,
            &mut lse_t,
            &mut delta_t,
            &bar0,
            &bar1,
            qbase,
            qstride,
            gbase,
            gstride,
            bh,
            qb,
            first,
            query_blocks,
            seq_q,
            block_q,
            per_row,
            pitch,
            width,
            threads,
        );
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
                &drop,
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

    store_rows::<G, NC>(
        &dk_acc,
        dk,
        b * dk.stride(0) + h * dk.stride(1) + hc0,
        k0 + kr0,
        seq_k,
        scale,
        2usize,
        oc,
    );
    store_rows::<G, NC>(
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
