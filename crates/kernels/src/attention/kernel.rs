//! Portable FlashAttention kernels (any CubeCL runtime, f32/f16/bf16 storage, f32 arithmetic).
//!
//! `split` units own one query row (forward, dQ) or one key row (dK/dV), each holding `hd / split`
//! of its columns, its accumulators and the softmax statistics in registers; the cube stages the
//! other operand's tiles through shared memory. The `split` partial dot products of a score meet
//! in shared memory (`split` is 1 up to head_dim 32). Scores never leave the cube. These kernels
//! run everywhere (lavapipe in CI, f32 on CUDA); f16/bf16 on CUDA take the tensor-core kernels in
//! `mma.rs`. The causal mask is a runtime flag, so one compiled kernel serves both masks. With
//! `dropout` (compile-time) every visible probability takes its factor from
//! [`super::dropout::entry_factor`], one Philox call per entry: the forward's softmax sum counts
//! all probabilities and its output the kept ones; the backward scales `dP` by the same factors.
//!
//! Loops over a unit's columns are unrolled (a compile-time length), so the rows stay in registers:
//! on lavapipe runtime-indexed local arrays were ~20x slower, and unrolling 128 columns made
//! llvmpipe compile one kernel for 200 s, hence parts of at most 32 columns. Unrolling also matters
//! for correctness there: llvmpipe silently ends a shader invocation's loops after 65535 iterations
//! in total; an invocation here iterates about `3 * seq + 2 * seq * head_dim / units` times, within
//! that for the sequence lengths CI runs (a few thousand).
//!
//! Layout: every 4-D tensor is `[batch, heads, seq, head_dim]` read through its strides (the last
//! stride is 1), k and v with `heads / group` heads (grouped-query attention: query head `h` reads
//! k/v head `h / group`); `lse` and `delta` are dense f32 `[batch * heads, seq_q]`. The cube grid
//! is `(blocks along the sequence, batch * heads)`, over the query heads in every kernel.

use cubecl::prelude::*;

use super::dropout::entry_factor;
use crate::launch::lanes_sum;
use crate::philox::DropScalars;

/// A finite stand-in for minus infinity: `exp(NEG_BIG - m)` is 0 and `NEG_BIG - NEG_BIG` is 0,
/// never NaN.
#[cube]
pub(crate) fn neg_big() -> f32 {
    f32::new(-1.0e30)
}

/// Whether key `j` is visible from query `i`, with the mask a runtime flag (1: causal), so that
/// one compiled kernel serves both masks.
#[cube]
fn visible_rt(i: usize, j: usize, seq_k: usize, causal: u32) -> bool {
    j < seq_k && (causal == 0 || j <= i)
}

/// Whether key `j` is visible from query `i`.
#[cube]
pub(crate) fn visible(i: usize, j: usize, seq_k: usize, #[comptime] causal: bool) -> bool {
    let mut ok = j < seq_k;
    if comptime!(causal) {
        ok = ok && j <= i;
    }
    ok
}

/// Index of element `(b, h, s, d)` of a `[B, H, S, D]` tensor read through its strides.
#[cube]
fn at<F: CubePrimitive>(t: &Tensor<F>, b: usize, h: usize, s: usize) -> usize {
    b * t.stride(0) + h * t.stride(1) + s * t.stride(2)
}

/// Loads rows `row0 .. row0 + rows` of `t` (batch `b`, head `h`) into `tile` [rows, hd] as f32,
/// zeros past `seq`.
#[cube]
fn stage<F: Float>(
    t: &Tensor<F>,
    tile: &mut SharedMemory<f32>,
    b: usize,
    h: usize,
    row0: usize,
    seq: usize,
    #[comptime] rows: usize,
    #[comptime] hd: usize,
) {
    let mut idx = UNIT_POS as usize;
    while idx < rows * hd {
        let r = idx / hd;
        let d = idx % hd;
        let s = row0 + r;
        let mut value = 0.0f32;
        if s < seq {
            value = f32::cast_from(t[at(t, b, h, s) + d]);
        }
        tile[idx] = value;
        idx += CUBE_DIM as usize;
    }
}

/// Sum over the `split` units of row `row` of their partial dot products for column `c`.
#[cube]
fn gather(
    partials: &SharedMemory<f32>,
    row: usize,
    c: usize,
    #[comptime] split: usize,
    #[comptime] block: usize,
) -> f32 {
    let mut s = 0.0f32;
    #[unroll]
    for p in 0..split {
        s += partials[(row * split + p) * block + c];
    }
    s
}

/// Forward: `out = softmax(scale * q k^T + mask) v` and `lse` per query row, FlashAttention-2
/// order (this cube's query block outer, key blocks inner) with the online-softmax rescale.
#[cube(launch_unchecked)]
#[allow(arithmetic_overflow)]
pub(crate) fn flash_forward<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    scale: f32,
    group: usize,
    #[comptime] hd: usize,
    #[comptime] split: usize,
    #[comptime] block_q: usize,
    #[comptime] block_k: usize,
    causal: u32,
    drop: DropScalars,
    #[comptime] dropout: bool,
    #[define(F)] _dtype: StorageType,
) {
    let part = comptime!(hd / split);
    let heads = q.shape(1);
    let seq_q = q.shape(2);
    let seq_k = k.shape(2);
    let bh = CUBE_POS_Y as usize;
    let (b, h) = (bh / heads, bh % heads);
    // The k/v head this query head shares with its group (itself when `group` is 1).
    let hk = h / group;
    // Largest query blocks first, so causal work (proportional to the block index) is balanced.
    let qb = CUBE_COUNT_X as usize - 1 - CUBE_POS_X as usize;
    let unit = UNIT_POS as usize;
    let row = unit / split;
    let off = (unit % split) * part;
    let i = qb * block_q + row;
    let active = i < seq_q;

    let mut qr = Array::<f32>::new(part);
    let mut acc = Array::<f32>::new(part);
    let qbase = at(q, b, h, i) + off;
    #[unroll]
    for d in 0..part {
        let mut x = 0.0f32;
        if active {
            x = f32::cast_from(q[qbase + d]) * scale;
        }
        qr[d] = x;
        acc[d] = 0.0;
    }
    let mut m = neg_big();
    let mut l = 0.0f32;

    let mut kt = SharedMemory::<f32>::new(block_k * hd);
    let mut vt = SharedMemory::<f32>::new(block_k * hd);
    let mut partials = SharedMemory::<f32>::new(block_q * split * block_k);
    let mut scores = Array::<f32>::new(block_k);

    let mut key_blocks = seq_k.div_ceil(block_k);
    if causal == 1 {
        // Blocks entirely above the diagonal of this query block are skipped.
        let mut last = (qb + 1) * block_q;
        if seq_q < last {
            last = seq_q;
        }
        let needed = last.div_ceil(block_k);
        if needed < key_blocks {
            key_blocks = needed;
        }
    }
    for kb in 0..key_blocks {
        let j0 = kb * block_k;
        sync_cube();
        stage(k, &mut kt, b, hk, j0, seq_k, block_k, hd);
        stage(v, &mut vt, b, hk, j0, seq_k, block_k, hd);
        sync_cube();
        for c in 0..block_k {
            let mut s = 0.0f32;
            #[unroll]
            for d in 0..part {
                s += qr[d] * kt[c * hd + off + d];
            }
            partials[unit * block_k + c] = s;
        }
        sync_cube();

        let mut m_new = m;
        for c in 0..block_k {
            let mut s = gather(&partials, row, c, split, block_k);
            if !visible_rt(i, j0 + c, seq_k, causal) {
                s = neg_big();
            }
            scores[c] = s;
            m_new = f32::max(m_new, s);
        }
        let alpha = (m - m_new).exp();
        l *= alpha;
        #[unroll]
        for d in 0..part {
            acc[d] *= alpha;
        }
        for c in 0..block_k {
            let mut p = 0.0f32;
            if visible_rt(i, j0 + c, seq_k, causal) {
                p = (scores[c] - m_new).exp();
            }
            l += p;
            // The softmax sum counts every probability; the output sees the kept ones, scaled.
            if comptime!(dropout) {
                p *= entry_factor(bh, i, j0 + c, &drop);
            }
            #[unroll]
            for d in 0..part {
                acc[d] += p * vt[c * hd + off + d];
            }
        }
        m = m_new;
    }

    if active {
        let inv = 1.0f32 / l;
        let base = at(out, b, h, i) + off;
        #[unroll]
        for d in 0..part {
            out[base + d] = F::cast_from(acc[d] * inv);
        }
        if off == 0 {
            lse[bh * seq_q + i] = m + l.ln();
        }
    }
}

/// Backward pre-pass: `delta[row] = sum_d dO[row, d] * O[row, d]` in f32 for every `[b, h, s]`
/// row, `split` units per row (adjacent lanes of a plane, summed with shuffles; 1 without plane
/// operations), each taking every `split`-th vector of the row's `per_row`. `zero`: the same
/// units also clear the row of the f32 dQ accumulator `dq_acc` (contiguous `[B, H, S, hd]`) that
/// the fused-dQ kernel then adds to, which saves a fill pass. `o` and `grad` `[B, heads, seq, hd]`
/// are read through their batch, head and position strides (`o_*`, `g_*`, in vectors).
#[cube(launch_unchecked)]
#[allow(arithmetic_overflow)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_delta<F: Float, N: Size>(
    o: &Array<Vector<F, N>>,
    grad: &Array<Vector<F, N>>,
    delta: &mut Array<f32>,
    dq_acc: &mut Array<Vector<f32, N>>,
    rows: usize,
    heads: usize,
    seq: usize,
    o_b: usize,
    o_h: usize,
    o_t: usize,
    g_b: usize,
    g_h: usize,
    g_t: usize,
    #[comptime] per_row: usize,
    #[comptime] split: usize,
    #[comptime] zero: bool,
    #[define(F)] _dtype: StorageType,
) {
    let row = ABSOLUTE_POS / split;
    let part = ABSOLUTE_POS % split;
    // Units past the last row still take part in the shuffles below; they read nothing.
    let active = row < rows;
    let mut sum = 0.0f32;
    if active {
        let i = row % seq;
        let bh = row / seq;
        let (b, h) = (bh / heads, bh % heads);
        let ob = b * o_b + h * o_h + i * o_t;
        let gb = b * g_b + h * g_h + i * g_t;
        #[unroll]
        for c in 0..comptime!(per_row / split) {
            let at = c * split + part;
            let x = Vector::<f32, N>::cast_from(o[ob + at]);
            let y = Vector::<f32, N>::cast_from(grad[gb + at]);
            sum += lanes_sum(x * y);
            if comptime!(zero) {
                dq_acc[row * per_row + at] = Vector::new(0.0);
            }
        }
    }
    if comptime!(split >= 2) {
        sum += plane_shuffle_xor(sum, 1u32);
    }
    if comptime!(split >= 4) {
        sum += plane_shuffle_xor(sum, 2u32);
    }
    if comptime!(split >= 8) {
        sum += plane_shuffle_xor(sum, 4u32);
    }
    if comptime!(split >= 16) {
        sum += plane_shuffle_xor(sum, 8u32);
    }
    if comptime!(split >= 32) {
        sum += plane_shuffle_xor(sum, 16u32);
    }
    if active && part == 0 {
        delta[row] = sum;
    }
}

/// Backward, dQ: `split` units per query row; key blocks staged in shared memory. Recomputes
/// `P = exp(scale * q k^T - lse)`, then `dS = P * (dO v^T - delta)` and `dQ = scale * dS k`.
#[cube(launch_unchecked)]
#[allow(arithmetic_overflow)]
pub(crate) fn flash_backward_dq<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    grad: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<F>,
    scale: f32,
    group: usize,
    #[comptime] hd: usize,
    #[comptime] split: usize,
    #[comptime] block_q: usize,
    #[comptime] block_k: usize,
    causal: u32,
    drop: DropScalars,
    #[comptime] dropout: bool,
    #[define(F)] _dtype: StorageType,
) {
    let part = comptime!(hd / split);
    let heads = q.shape(1);
    let seq_q = q.shape(2);
    let seq_k = k.shape(2);
    let bh = CUBE_POS_Y as usize;
    let (b, h) = (bh / heads, bh % heads);
    let hk = h / group;
    let qb = CUBE_COUNT_X as usize - 1 - CUBE_POS_X as usize;
    let unit = UNIT_POS as usize;
    let row = unit / split;
    let off = (unit % split) * part;
    let i = qb * block_q + row;
    let active = i < seq_q;

    let mut qr = Array::<f32>::new(part);
    let mut gr = Array::<f32>::new(part);
    let mut acc = Array::<f32>::new(part);
    let qbase = at(q, b, h, i) + off;
    let gbase = at(grad, b, h, i) + off;
    #[unroll]
    for d in 0..part {
        let mut x = 0.0f32;
        let mut g = 0.0f32;
        if active {
            x = f32::cast_from(q[qbase + d]) * scale;
            g = f32::cast_from(grad[gbase + d]);
        }
        qr[d] = x;
        gr[d] = g;
        acc[d] = 0.0;
    }
    let mut row_lse = 0.0f32;
    let mut row_delta = 0.0f32;
    if active {
        row_lse = lse[bh * seq_q + i];
        row_delta = delta[bh * seq_q + i];
    }

    let mut kt = SharedMemory::<f32>::new(block_k * hd);
    let mut vt = SharedMemory::<f32>::new(block_k * hd);
    let mut ps = SharedMemory::<f32>::new(block_q * split * block_k);
    let mut pdp = SharedMemory::<f32>::new(block_q * split * block_k);
    let mut key_blocks = seq_k.div_ceil(block_k);
    if causal == 1 {
        let mut last = (qb + 1) * block_q;
        if seq_q < last {
            last = seq_q;
        }
        let needed = last.div_ceil(block_k);
        if needed < key_blocks {
            key_blocks = needed;
        }
    }
    for kb in 0..key_blocks {
        let j0 = kb * block_k;
        sync_cube();
        stage(k, &mut kt, b, hk, j0, seq_k, block_k, hd);
        stage(v, &mut vt, b, hk, j0, seq_k, block_k, hd);
        sync_cube();
        for c in 0..block_k {
            let mut s = 0.0f32;
            let mut dp = 0.0f32;
            #[unroll]
            for d in 0..part {
                s += qr[d] * kt[c * hd + off + d];
                dp += gr[d] * vt[c * hd + off + d];
            }
            ps[unit * block_k + c] = s;
            pdp[unit * block_k + c] = dp;
        }
        sync_cube();
        for c in 0..block_k {
            if active && visible_rt(i, j0 + c, seq_k, causal) {
                let s = gather(&ps, row, c, split, block_k);
                let mut dp = gather(&pdp, row, c, split, block_k);
                let p = (s - row_lse).exp();
                if comptime!(dropout) {
                    // dP of the kept probabilities, through the mask: dP * Z.
                    dp *= entry_factor(bh, i, j0 + c, &drop);
                }
                let ds = p * (dp - row_delta);
                #[unroll]
                for d in 0..part {
                    acc[d] += ds * kt[c * hd + off + d];
                }
            }
        }
    }

    if active {
        let base = at(dq, b, h, i) + off;
        #[unroll]
        for d in 0..part {
            dq[base + d] = F::cast_from(acc[d] * scale);
        }
    }
}

/// Backward, dK and dV: `split` units per key row; query blocks (q, dO, lse, delta) staged in
/// shared memory. `dV = P^T dO`, `dK = scale * dS^T q`.
#[cube(launch_unchecked)]
#[allow(arithmetic_overflow)]
pub(crate) fn flash_backward_dkdv<F: Float, G: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    grad: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<G>,
    dv: &mut Tensor<G>,
    scale: f32,
    group: usize,
    #[comptime] hd: usize,
    #[comptime] split: usize,
    #[comptime] block_q: usize,
    #[comptime] block_k: usize,
    causal: u32,
    drop: DropScalars,
    #[comptime] dropout: bool,
    #[define(F, G)] _dtypes: [StorageType; 2],
) {
    let part = comptime!(hd / split);
    let heads = q.shape(1);
    let seq_q = q.shape(2);
    let seq_k = k.shape(2);
    let bh = CUBE_POS_Y as usize;
    let (b, h) = (bh / heads, bh % heads);
    // Keys and values of the shared head; dK and dV go to this query head's rows of `dk` and `dv`
    // (per query head where `group` > 1, summed over the group afterwards).
    let hk = h / group;
    let kb = CUBE_POS_X as usize;
    let unit = UNIT_POS as usize;
    let row = unit / split;
    let off = (unit % split) * part;
    let j = kb * block_k + row;
    let active = j < seq_k;

    let mut kr = Array::<f32>::new(part);
    let mut vr = Array::<f32>::new(part);
    let mut dk_acc = Array::<f32>::new(part);
    let mut dv_acc = Array::<f32>::new(part);
    let kbase = at(k, b, hk, j) + off;
    let vbase = at(v, b, hk, j) + off;
    #[unroll]
    for d in 0..part {
        let mut x = 0.0f32;
        let mut y = 0.0f32;
        if active {
            x = f32::cast_from(k[kbase + d]) * scale;
            y = f32::cast_from(v[vbase + d]);
        }
        kr[d] = x;
        vr[d] = y;
        dk_acc[d] = 0.0;
        dv_acc[d] = 0.0;
    }

    let mut qt = SharedMemory::<f32>::new(block_q * hd);
    let mut gt = SharedMemory::<f32>::new(block_q * hd);
    let mut lse_t = SharedMemory::<f32>::new(block_q);
    let mut delta_t = SharedMemory::<f32>::new(block_q);
    let mut ps = SharedMemory::<f32>::new(block_k * split * block_q);
    let mut pdp = SharedMemory::<f32>::new(block_k * split * block_q);
    let query_blocks = seq_q.div_ceil(block_q);
    let mut first = 0usize;
    if causal == 1 {
        // Query blocks entirely before this key block see none of its keys.
        first = (kb * block_k) / block_q;
    }
    for qb in first..query_blocks {
        let i0 = qb * block_q;
        sync_cube();
        stage(q, &mut qt, b, h, i0, seq_q, block_q, hd);
        stage(grad, &mut gt, b, h, i0, seq_q, block_q, hd);
        let mut r = unit;
        while r < block_q {
            let mut x = 0.0f32;
            let mut y = 0.0f32;
            if i0 + r < seq_q {
                x = lse[bh * seq_q + i0 + r];
                y = delta[bh * seq_q + i0 + r];
            }
            lse_t[r] = x;
            delta_t[r] = y;
            r += CUBE_DIM as usize;
        }
        sync_cube();
        for r in 0..block_q {
            let mut s = 0.0f32;
            let mut dp = 0.0f32;
            #[unroll]
            for d in 0..part {
                s += kr[d] * qt[r * hd + off + d];
                dp += vr[d] * gt[r * hd + off + d];
            }
            ps[unit * block_q + r] = s;
            pdp[unit * block_q + r] = dp;
        }
        sync_cube();
        for r in 0..block_q {
            let i = i0 + r;
            if active && i < seq_q && visible_rt(i, j, seq_k, causal) {
                let s = gather(&ps, row, r, split, block_q);
                let dp = gather(&pdp, row, r, split, block_q);
                let p = (s - lse_t[r]).exp();
                let mut z = 1.0f32;
                if comptime!(dropout) {
                    z = entry_factor(bh, i, j, &drop);
                }
                let ds = p * (dp * z - delta_t[r]);
                let pz = p * z;
                #[unroll]
                for d in 0..part {
                    dv_acc[d] += pz * gt[r * hd + off + d];
                    dk_acc[d] += ds * qt[r * hd + off + d];
                }
            }
        }
    }

    if active {
        let kb_out = at(dk, b, h, j) + off;
        let vb_out = at(dv, b, h, j) + off;
        #[unroll]
        for d in 0..part {
            dk[kb_out + d] = G::cast_from(dk_acc[d] * scale);
            dv[vb_out + d] = G::cast_from(dv_acc[d]);
        }
    }
}

/// dK or dV of grouped-query attention from the dK/dV kernels' per-query-head rows:
/// `out[b, hk, s, :] = sum over g < group of heads[b, hk * group + g, s, :]`, added in f32 in the
/// order of `g` (deterministic), stored in the output dtype. `heads`: dense f32 `[batch, heads,
/// seq, hd]` (`heads = kv_heads x group`); `out`: `[batch, kv_heads, seq, hd]` with strides that
/// are multiples of `N` and a unit last stride. One unit per vector of `N` elements (`per_row`
/// vectors a row).
#[cube(launch_unchecked)]
pub(crate) fn sum_groups<F: Float, N: Size>(
    heads: &Tensor<Vector<f32, N>>,
    out: &mut Tensor<Vector<F, N>>,
    kv_heads: usize,
    seq: usize,
    group: usize,
    total: usize,
    #[comptime] per_row: usize,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i < total {
        let c = i % per_row;
        let row = i / per_row;
        let s = row % seq;
        let bk = row / seq;
        let (b, hk) = (bk / kv_heads, bk % kv_heads);
        // Query head hk * group + g of batch b is head bk * group + g of the dense buffer.
        let mut acc = Vector::<f32, N>::new(0.0);
        for g in 0..group {
            acc += heads[((bk * group + g) * seq + s) * per_row + c];
        }
        let at =
            (b * out.stride(0) + hk * out.stride(1) + s * out.stride(2)) / out.vector_size() + c;
        out[at] = Vector::cast_from(acc);
    }
}
