//! The tensor-core FlashAttention forward kernel.

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::super::kernel::neg_big;
use crate::philox::{factor, half_word, philox, DropScalars};

use super::fragments::*;

/// How far (in the exponent's units) a row's maximum may rise above the reference the forward
/// takes its probabilities against before the reference moves: probabilities stay below
/// e^8 (about 3000), far inside f32 and the f16/bf16 range of the `P v` product's operand.
/// With dropout the slack is 0 (probabilities at most 1), since the kept ones are also
/// multiplied by `1 / (1 - p)`.
const RESCALE_SLACK: f32 = 8.0;

/// Tensor-core forward. Grid `(query blocks, batch * heads)`, cube `(32, planes)`; each warp
/// owns `16 * mt` query rows. Strides of q/k/v are in vectors of `width`; `out` is written in
/// vectors of `ow` (`NO`: 8 with `stmatrix`, else 2), its strides in elements. Query blocks run last-first so that causal's
/// longest rows start first. Under a causal mask a warp skips the key blocks that lie wholly above its own rows' diagonal (the
/// cube walks the blocks its last row needs), while still taking part in the block copies. K and
/// V stream through a ring of `stages` buffers (see [`kv_ring_start`]); the query tile is copied
/// with the first block.
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(arithmetic_overflow)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_forward_mma<F: Float, N: Size, NO: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, NO>>,
    lse: &mut Tensor<f32>,
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
    #[comptime] stages: usize,
    #[comptime] ow: usize,
    #[comptime] stmatrix: bool,
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
    let t4 = lane % 4;
    let bh = CUBE_POS_Y as usize;
    let (b, h) = (bh / heads, bh % heads);
    let block_q = comptime!(planes * mt * 16);
    let q0 = (CUBE_COUNT_X as usize - 1 - CUBE_POS_X as usize) * block_q;
    let w0 = UNIT_POS_Y as usize * comptime!(mt * 16);
    let pitch = comptime!((hd + 8) / width);
    let per_row = comptime!(hd / width);
    let tile = comptime!(block_k * pitch);
    let threads = comptime!(planes * 32);
    let mut qt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(block_q * pitch), ALIGN);
    let mut kt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(stages * tile), ALIGN);
    let mut vt = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(stages * tile), ALIGN);
    let bar0 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let bar1 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let bar2 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    // The output rows on their way out (see `store_rows_staged`).
    let mut ot =
        SharedMemory::<Vector<F, NO>>::new_aligned(comptime!(block_q * ((hd + 8) / ow)), ALIGN);
    // Keys and values of the head this query head shares with its group (`group` query heads per
    // k/v head; 1 without grouping).
    let kv = kv_source(k, v, b, h / group, seq_k, width);

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
    // With dropout the reference maximum moves with every rise (kept probabilities are also
    // multiplied by `1 / (1 - p)`), see `RESCALE_SLACK`.
    let slack = if comptime!(dropout) {
        0.0f32
    } else {
        RESCALE_SLACK
    };

    let blocks = key_blocks(q0, seq_q, seq_k, block_q, block_k, causal);
    // The barriers are initialised before any unit commits to them.
    sync_cube();
    if blocks > 0 {
        copy_head_rows(
            q, &mut qt, b, h, q0, seq_q, block_q, per_row, pitch, width, true, threads,
        );
    }
    kv_ring_start(
        k, v, &mut kt, &mut vt, &kv, &bar0, &bar1, &bar2, blocks, block_k, per_row, pitch, width,
        threads, stages,
    );
    for kb in 0..blocks {
        let j0 = kb * block_k;
        let cur = kv_ring_next(
            k, v, &mut kt, &mut vt, &kv, &bar0, &bar1, &bar2, kb, blocks, block_k, per_row, pitch,
            width, threads, stages,
        );
        if rows_see(j0, q0 + w0, comptime!(mt * 16), causal) {
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
            rescale_rows::<NC>(
                &mut s,
                &mut o_acc,
                &mut m_run,
                &mut l_run,
                q0 + w0,
                j0,
                seq_k,
                scale,
                slack,
                mt,
                s_tiles,
                o_tiles,
                block_k,
                causal,
            );
            probabilities::<NC>(
                &mut s,
                &m_run,
                &mut l_run,
                scale,
                q0 + w0,
                j0,
                bh,
                &drop,
                mt,
                s_tiles,
                dropout,
            );
            // O += P v, P from registers.
            scores_product::<F, N, NA, NB, NC>(
                &s, &vt, cur, &mut o_acc, s_tiles, o_tiles, mt, pitch, width,
            );
        }
        // Every warp is done with this buffer before the next iteration refills it.
        sync_cube();
    }

    // O / l and the log-sum-exp, l summed over the four lanes of each row.
    #[unroll]
    for m in 0..mt {
        #[unroll]
        for half in 0..2usize {
            let r = m * 2 + half;
            let mut l = l_run[r];
            l += plane_shuffle_xor(l, 1);
            l += plane_shuffle_xor(l, 2);
            l_run[r] = l;
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
    store_rows_staged::<F, NA, NC, NO>(
        &o_acc,
        &mut ot,
        out,
        b * out.stride(0) + h * out.stride(1),
        q0 + w0,
        w0,
        seq_q,
        mt,
        hd,
        ow,
        stmatrix,
    );
}

/// The mask where this warp's rows meet the block's edge (past `seq_k` or, causal, above the
/// diagonal; the test is uniform across the warp), then the online softmax's lazy rescale: a
/// row's reference maximum `m_run` moves (and its output is rescaled) only when the block's
/// maximum exceeds it by more than `slack`, checked once for the whole warp; otherwise the
/// probabilities are taken against the old reference, so they may reach e^slack. O, the sum and
/// the log-sum-exp all use the same reference, so the result is the same. Scores stay unscaled
/// (the scale is positive, so it commutes with the maximum); it goes into the exponent's argument.
#[cube]
#[allow(clippy::too_many_arguments)]
fn rescale_rows<NC: Size>(
    s: &mut Array<Vector<f32, NC>>,
    o_acc: &mut Array<Vector<f32, NC>>,
    m_run: &mut Array<f32>,
    l_run: &mut Array<f32>,
    row0: usize,
    j0: usize,
    seq_k: usize,
    scale: f32,
    slack: f32,
    #[comptime] mt: usize,
    #[comptime] s_tiles: usize,
    #[comptime] o_tiles: usize,
    #[comptime] block_k: usize,
    #[comptime] causal: bool,
) {
    if edge_block(row0, j0, seq_k, block_k, causal) {
        mask_scores::<NC>(s, row0, j0, seq_k, mt, s_tiles, causal);
    }
    let mut block_max = Array::<f32>::new(comptime!(mt * 2));
    let mut grow = false;
    #[unroll]
    for m in 0..mt {
        #[unroll]
        for half in 0..2usize {
            let r = m * 2 + half;
            let mut mx = neg_big();
            #[unroll]
            for t in 0..s_tiles {
                let x = s[(m * s_tiles + t) * 2 + half];
                mx = f32::max(mx, f32::max(x[0], x[1]));
            }
            mx = f32::max(mx, plane_shuffle_xor(mx, 1));
            mx = f32::max(mx, plane_shuffle_xor(mx, 2));
            mx *= scale;
            block_max[r] = mx;
            grow = grow || mx > m_run[r] + slack;
        }
    }
    if plane_any(grow) {
        #[unroll]
        for m in 0..mt {
            #[unroll]
            for half in 0..2usize {
                let r = m * 2 + half;
                let m_new = f32::max(m_run[r], block_max[r]);
                let alpha = (m_run[r] - m_new).exp();
                l_run[r] *= alpha;
                m_run[r] = m_new;
                #[unroll]
                for t in 0..o_tiles {
                    let at = (m * o_tiles + t) * 2 + half;
                    o_acc[at] = o_acc[at] * Vector::new(alpha);
                }
            }
        }
    }
}

/// `P = exp(scale * S - m_run)` in place; each lane adds its own entries to `l_run` (the four
/// lanes of a row are added once, after the last block). With dropout, `P v` then takes the
/// kept probabilities, scaled (the row sums count them all): one Philox call per lane and 16 x
/// 16 tile gives its eight entries (see `dropout`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn probabilities<NC: Size>(
    s: &mut Array<Vector<f32, NC>>,
    m_run: &Array<f32>,
    l_run: &mut Array<f32>,
    scale: f32,
    row0: usize,
    j0: usize,
    bh: usize,
    drop: &DropScalars,
    #[comptime] mt: usize,
    #[comptime] s_tiles: usize,
    #[comptime] dropout: bool,
) {
    #[unroll]
    for m in 0..mt {
        #[unroll]
        for half in 0..2usize {
            let r = m * 2 + half;
            let mut sum = 0.0f32;
            #[unroll]
            for t in 0..s_tiles {
                let at = (m * s_tiles + t) * 2 + half;
                let mut x = s[at];
                #[unroll]
                for e in 0..2usize {
                    let p = (x[e] * scale - m_run[r]).exp();
                    x[e] = p;
                    sum += p;
                }
                s[at] = x;
            }
            l_run[r] += sum;
        }
    }
    if comptime!(dropout) {
        let lane = lane();
        #[unroll]
        for m in 0..mt {
            let query_tile = u32::cast_from(row0 / 16 + m);
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
                    #[unroll]
                    for tt in 0..2usize {
                        let at = (m * s_tiles + u * 2 + tt) * 2 + half;
                        let word = w[half * 2 + tt];
                        let mut x = s[at];
                        x[0] = x[0] * factor(half_word(word, false), drop);
                        x[1] = x[1] * factor(half_word(word, true), drop);
                        s[at] = x;
                    }
                }
            }
        }
    }
}
