//! The tensor-core dK/dV kernel in whole-row layouts: each warp owns whole key rows (all head_dim
//! columns of dK and dV).

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use crate::philox::DropScalars;

use super::dkdv_shared::{
    dq_block_atomic, head_rows, next_query_block, stage_keys, start_query_blocks, store_ds_t,
    transposed_scores,
};
use super::fragments::*;

/// Tensor-core dK and dV. Grid `(key blocks, batch * heads)`, cube `(32, planes)`; each warp owns
/// `16 * mt` key rows (k and v stay staged) and walks the query blocks, computing the transposed
/// products `S^T = k q^T`, `dP^T = v dO^T`, then `dV += P^T dO`, `dK += dS^T q` with P^T and
/// dS^T taken from registers. Under a causal mask a warp skips the query blocks that end before
/// its first key. k and v are read at the head `h / group` that query head `h` shares; dK and dV
/// are written at `h` in `G` (the input dtype, or f32 rows per query head under grouped-query
/// attention, which the launcher sums over the group).
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(arithmetic_overflow)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_backward_dkdv_mma<F: Float, G: Float, N: Size, NQ: Size>(
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
    #[comptime] fuse_dq: bool,
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
    let w0 = UNIT_POS_Y as usize * comptime!(mt * 16);
    let pitch = comptime!((hd + 8) / width);
    let per_row = comptime!(hd / width);
    let threads = comptime!(planes * 32);
    // q, dO and their rows' lse, delta are double-buffered (see `start_query_blocks`).
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

    let s_tiles = comptime!(block_q / 8);
    let o_tiles = comptime!(hd / 8);
    let mut dk_acc = zeros::<NC>(comptime!(mt * o_tiles * 2));
    let mut dv_acc = zeros::<NC>(comptime!(mt * o_tiles * 2));

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
                &drop,
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

    store_rows::<G, NC>(
        &dk_acc,
        dk,
        b * dk.stride(0) + h * dk.stride(1),
        k0 + w0,
        seq_k,
        scale,
        mt,
        hd,
    );
    store_rows::<G, NC>(
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
