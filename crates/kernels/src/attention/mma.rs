//! Tensor-core FlashAttention kernels (CUDA, f16/bf16 inputs, f32 accumulation).
//!
//! Every cube has `planes` warps; each warp owns 16 rows (queries in the forward and dQ kernels,
//! keys in the dK/dV kernel) and runs the block products with the warp-level
//! `mma.sync.m16n8k16` instruction (CubeCL's manual MMA), holding accumulators in registers.
//! Operands are staged in shared memory: K/V (or Q/dO) tiles are loaded by the whole cube with
//! 128-bit global loads; the probabilities P and dS go through a small per-warp buffer to become
//! the A operand of the next product (values cast to the input dtype, as FlashAttention-2 does).
//! Rows of shared tiles are padded by 8 elements (16 bytes) so that the fragment loads of the
//! eight row groups of a warp fall in different banks.
//!
//! Fragment positions come from `MmaDefinition::position_of_nth`. The forward's row statistics use
//! the m16n8 accumulator layout of PTX: the lanes sharing a row are the four lanes of a quad
//! (`lane ^ 1`, `lane ^ 2`), and a lane's elements lie in rows `r` and `r + 8`.

use cubecl::prelude::*;

use super::kernel::{neg_big, visible};

/// Loads `rows` rows of `hd` elements starting at sequence row `row0` from `t` (base offset
/// `base` and row stride `row_stride`, both in vectors of `width`) into `tile` with row pitch
/// `pitch` (elements); rows past `seq` are zero.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_rows<F: Float, N: Size>(
    t: &Tensor<Vector<F, N>>,
    tile: &mut SharedMemory<F>,
    base: usize,
    row_stride: usize,
    row0: usize,
    seq: usize,
    #[comptime] rows: usize,
    #[comptime] hd: usize,
    #[comptime] width: usize,
    #[comptime] pitch: usize,
) {
    let per_row = comptime!(hd / width);
    let mut idx = UNIT_POS as usize;
    while idx < rows * per_row {
        let r = idx / per_row;
        let c = idx % per_row;
        let s = row0 + r;
        let dst = r * pitch + c * width;
        if s < seq {
            let x = t[base + s * row_stride + c];
            #[unroll]
            for e in 0..width {
                tile[dst + e] = x[e];
            }
        } else {
            #[unroll]
            for e in 0..width {
                tile[dst + e] = F::new(0.0);
            }
        }
        idx += CUBE_DIM as usize;
    }
}

/// A-operand fragment (16 x 16, row-major in `tile`) with its top-left corner at (`row0`, `col0`).
#[cube]
fn frag_a<F: Float, NA: Size>(tile: &SharedMemory<F>, row0: usize, col0: usize, #[comptime] pitch: usize) -> Array<Vector<F, NA>> {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let lane = UNIT_POS_PLANE;
    let count = def.elems_per_lane(cmma::MatrixIdent::A);
    let width = def.vector_size(cmma::MatrixIdent::A);
    let vectors = comptime!(count / width);
    let mut regs = Array::<Vector<F, NA>>::new(vectors);
    #[unroll]
    for i in 0..vectors {
        let mut reg = Vector::empty();
        #[unroll]
        for e in 0..width {
            let (r, c) = def.position_of_nth(lane, (i * width + e) as u32, cmma::MatrixIdent::A);
            reg[e] = tile[(row0 + usize::cast_from(r)) * pitch + col0 + usize::cast_from(c)];
        }
        regs[i] = reg;
    }
    regs
}

/// B-operand fragment (16 x 8). `transposed`: B[k][n] = tile[n0 + n][k0 + k] (a row-major tile
/// of the rows being multiplied against, like K in `q k^T`); otherwise B[k][n] = tile[k0 + k][n0 + n].
#[cube]
fn frag_b<F: Float, NB: Size>(
    tile: &SharedMemory<F>,
    k0: usize,
    n0: usize,
    #[comptime] pitch: usize,
    #[comptime] transposed: bool,
) -> Array<Vector<F, NB>> {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let lane = UNIT_POS_PLANE;
    let count = def.elems_per_lane(cmma::MatrixIdent::B);
    let width = def.vector_size(cmma::MatrixIdent::B);
    let vectors = comptime!(count / width);
    let mut regs = Array::<Vector<F, NB>>::new(vectors);
    #[unroll]
    for i in 0..vectors {
        let mut reg = Vector::empty();
        #[unroll]
        for e in 0..width {
            let (r, c) = def.position_of_nth(lane, (i * width + e) as u32, cmma::MatrixIdent::B);
            let (r, c) = (usize::cast_from(r), usize::cast_from(c));
            if comptime!(transposed) {
                reg[e] = tile[(n0 + c) * pitch + k0 + r];
            } else {
                reg[e] = tile[(k0 + r) * pitch + n0 + c];
            }
        }
        regs[i] = reg;
    }
    regs
}

/// `acc[tile] += a * b` for the accumulator tile starting at vector `offset`.
#[cube]
fn mma<F: Float, NA: Size, NB: Size, NC: Size>(
    a: &Array<Vector<F, NA>>,
    b: &Array<Vector<F, NB>>,
    acc: &mut Array<Vector<f32, NC>>,
    offset: usize,
) {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let vectors = def.vectors_per_lane(cmma::MatrixIdent::Accumulator);
    let mut c = Array::<Vector<f32, NC>>::new(vectors);
    #[unroll]
    for i in 0..vectors {
        c[i] = acc[offset + i];
    }
    let d = def.execute(a, b, &c);
    #[unroll]
    for i in 0..vectors {
        acc[offset + i] = d[i];
    }
}

/// Copies fragment `index` (of `vectors` vectors) out of a flat array of fragments.
#[cube]
fn part<F: Float, NA: Size>(all: &Array<Vector<F, NA>>, index: usize, #[comptime] vectors: usize) -> Array<Vector<F, NA>> {
    let mut out = Array::<Vector<F, NA>>::new(vectors);
    #[unroll]
    for i in 0..vectors {
        out[i] = all[index * vectors + i];
    }
    out
}

/// Tensor-core forward. Grid `(query blocks, batch * heads)`, cube `(32, planes)`; each warp
/// owns 16 query rows. Strides of q/k/v are in vectors of `width`, those of `out` in elements.
#[cube(launch_unchecked)]
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
    #[comptime] block_k: usize,
    #[comptime] width: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let size!(NA) = def.vector_size(cmma::MatrixIdent::A);
    let size!(NB) = def.vector_size(cmma::MatrixIdent::B);
    let size!(NC) = def.vector_size(cmma::MatrixIdent::Accumulator);
    let va = def.vectors_per_lane(cmma::MatrixIdent::A);
    let vc = def.vectors_per_lane(cmma::MatrixIdent::Accumulator);
    let nc = def.vector_size(cmma::MatrixIdent::Accumulator);

    let lane = UNIT_POS_PLANE;
    let plane = UNIT_POS_Y as usize;
    let bh = CUBE_POS_Y as usize;
    let (b, h) = (bh / heads, bh % heads);
    let block_q = comptime!(planes * 16);
    let qb = CUBE_COUNT_X as usize - 1 - CUBE_POS_X as usize;
    let q0 = qb * block_q;
    let my0 = q0 + plane * 16;

    let pitch = comptime!(hd + 8);
    let ppitch = comptime!(block_k + 8);
    let rows_kt = comptime!(if block_k > block_q { block_k } else { block_q });
    let mut kt = SharedMemory::<F>::new(comptime!(rows_kt * pitch));
    let mut vt = SharedMemory::<F>::new(comptime!(block_k * pitch));
    let mut pt = SharedMemory::<F>::new(comptime!(planes * 16 * ppitch));

    // This warp's Q rows as A fragments, one per 16 columns of head_dim, kept in registers.
    let ksteps = comptime!(hd / 16);
    stage_rows(q, &mut kt, (b * q.stride(0) + h * q.stride(1)) / width, q.stride(2) / width, q0, seq_q, block_q, hd, width, pitch);
    sync_cube();
    let mut qa = Array::<Vector<F, NA>>::new(comptime!(ksteps * va));
    #[unroll]
    for kk in 0..ksteps {
        let f = frag_a::<F, NA>(&kt, plane * 16, kk * 16, pitch);
        #[unroll]
        for i in 0..va {
            qa[kk * va + i] = f[i];
        }
    }

    let s_tiles = comptime!(block_k / 8);
    let o_tiles = comptime!(hd / 8);
    let p_steps = comptime!(block_k / 16);
    let mut o_acc = Array::<Vector<f32, NC>>::new(comptime!(o_tiles * vc));
    #[unroll]
    for i in 0..comptime!(o_tiles * vc) {
        o_acc[i] = Vector::new(0.0);
    }
    let mut m_lo = neg_big();
    let mut m_hi = neg_big();
    let mut l_lo = 0.0f32;
    let mut l_hi = 0.0f32;

    let mut key_blocks = seq_k.div_ceil(block_k);
    if comptime!(causal) {
        let mut last = q0 + block_q;
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
        stage_rows(k, &mut kt, (b * k.stride(0) + h * k.stride(1)) / width, k.stride(2) / width, j0, seq_k, block_k, hd, width, pitch);
        stage_rows(v, &mut vt, (b * v.stride(0) + h * v.stride(1)) / width, v.stride(2) / width, j0, seq_k, block_k, hd, width, pitch);
        sync_cube();

        // S = Q K^T for this warp's 16 rows and the block's keys.
        let mut s_acc = Array::<Vector<f32, NC>>::new(comptime!(s_tiles * vc));
        #[unroll]
        for i in 0..comptime!(s_tiles * vc) {
            s_acc[i] = Vector::new(0.0);
        }
        #[unroll]
        for kk in 0..ksteps {
            let a = part::<F, NA>(&qa, kk, va);
            #[unroll]
            for t in 0..s_tiles {
                let bf = frag_b::<F, NB>(&kt, kk * 16, t * 8, pitch, true);
                mma::<F, NA, NB, NC>(&a, &bf, &mut s_acc, t * vc);
            }
        }

        // Masked, scaled scores and the new row maxima.
        let mut mx_lo = m_lo;
        let mut mx_hi = m_hi;
        #[unroll]
        for t in 0..s_tiles {
            #[unroll]
            for i in 0..vc {
                let mut x = s_acc[t * vc + i];
                #[unroll]
                for e in 0..nc {
                    let (r, c) = def.position_of_nth(lane, (i * nc + e) as u32, cmma::MatrixIdent::Accumulator);
                    let (r, c) = (usize::cast_from(r), usize::cast_from(c));
                    let mut s = x[e] * scale;
                    if !visible(my0 + r, j0 + t * 8 + c, seq_k, causal) {
                        s = neg_big();
                    }
                    x[e] = s;
                    if r < 8 {
                        mx_lo = f32::max(mx_lo, s);
                    } else {
                        mx_hi = f32::max(mx_hi, s);
                    }
                }
                s_acc[t * vc + i] = x;
            }
        }
        mx_lo = f32::max(mx_lo, plane_shuffle_xor(mx_lo, 1));
        mx_lo = f32::max(mx_lo, plane_shuffle_xor(mx_lo, 2));
        mx_hi = f32::max(mx_hi, plane_shuffle_xor(mx_hi, 1));
        mx_hi = f32::max(mx_hi, plane_shuffle_xor(mx_hi, 2));

        // P = exp(S - max) into the warp's staging rows; row sums.
        let mut sum_lo = 0.0f32;
        let mut sum_hi = 0.0f32;
        #[unroll]
        for t in 0..s_tiles {
            #[unroll]
            for i in 0..vc {
                let x = s_acc[t * vc + i];
                #[unroll]
                for e in 0..nc {
                    let (r, c) = def.position_of_nth(lane, (i * nc + e) as u32, cmma::MatrixIdent::Accumulator);
                    let (r, c) = (usize::cast_from(r), usize::cast_from(c));
                    let p = (x[e] - select(r < 8, mx_lo, mx_hi)).exp();
                    if r < 8 {
                        sum_lo += p;
                    } else {
                        sum_hi += p;
                    }
                    pt[(plane * 16 + r) * ppitch + t * 8 + c] = F::cast_from(p);
                }
            }
        }
        sum_lo += plane_shuffle_xor(sum_lo, 1);
        sum_lo += plane_shuffle_xor(sum_lo, 2);
        sum_hi += plane_shuffle_xor(sum_hi, 1);
        sum_hi += plane_shuffle_xor(sum_hi, 2);
        let alpha_lo = (m_lo - mx_lo).exp();
        let alpha_hi = (m_hi - mx_hi).exp();
        l_lo = l_lo * alpha_lo + sum_lo;
        l_hi = l_hi * alpha_hi + sum_hi;
        m_lo = mx_lo;
        m_hi = mx_hi;
        #[unroll]
        for t in 0..o_tiles {
            #[unroll]
            for i in 0..vc {
                let mut x = o_acc[t * vc + i];
                #[unroll]
                for e in 0..nc {
                    let (r, _c) = def.position_of_nth(lane, (i * nc + e) as u32, cmma::MatrixIdent::Accumulator);
                    x[e] *= select(r < 8, alpha_lo, alpha_hi);
                }
                o_acc[t * vc + i] = x;
            }
        }
        sync_plane();

        // O += P V.
        let mut pa = Array::<Vector<F, NA>>::new(comptime!(p_steps * va));
        #[unroll]
        for kk in 0..p_steps {
            let f = frag_a::<F, NA>(&pt, plane * 16, kk * 16, ppitch);
            #[unroll]
            for i in 0..va {
                pa[kk * va + i] = f[i];
            }
        }
        #[unroll]
        for kk in 0..p_steps {
            let a = part::<F, NA>(&pa, kk, va);
            #[unroll]
            for t in 0..o_tiles {
                let bf = frag_b::<F, NB>(&vt, kk * 16, t * 8, pitch, false);
                mma::<F, NA, NB, NC>(&a, &bf, &mut o_acc, t * vc);
            }
        }
    }

    let inv_lo = 1.0f32 / l_lo;
    let inv_hi = 1.0f32 / l_hi;
    let obase = b * out.stride(0) + h * out.stride(1);
    let os = out.stride(2);
    #[unroll]
    for t in 0..o_tiles {
        #[unroll]
        for i in 0..vc {
            let x = o_acc[t * vc + i];
            #[unroll]
            for e in 0..nc {
                let (r, c) = def.position_of_nth(lane, (i * nc + e) as u32, cmma::MatrixIdent::Accumulator);
                let (r, c) = (usize::cast_from(r), usize::cast_from(c));
                let row = my0 + r;
                if row < seq_q {
                    out[obase + row * os + t * 8 + c] = F::cast_from(x[e] * select(r < 8, inv_lo, inv_hi));
                    if t == 0 && c == 0 {
                        lse[bh * seq_q + row] = select(r < 8, m_lo + l_lo.ln(), m_hi + l_hi.ln());
                    }
                }
            }
        }
    }
}

/// Tensor-core dQ. Grid `(query blocks, batch * heads)`, cube `(32, planes)`; each warp owns 16
/// query rows and keeps their q and dO fragments in registers.
#[cube(launch_unchecked)]
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
    #[comptime] block_k: usize,
    #[comptime] width: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let size!(NA) = def.vector_size(cmma::MatrixIdent::A);
    let size!(NB) = def.vector_size(cmma::MatrixIdent::B);
    let size!(NC) = def.vector_size(cmma::MatrixIdent::Accumulator);
    let va = def.vectors_per_lane(cmma::MatrixIdent::A);
    let vc = def.vectors_per_lane(cmma::MatrixIdent::Accumulator);
    let nc = def.vector_size(cmma::MatrixIdent::Accumulator);

    let lane = UNIT_POS_PLANE;
    let plane = UNIT_POS_Y as usize;
    let bh = CUBE_POS_Y as usize;
    let (b, h) = (bh / heads, bh % heads);
    let block_q = comptime!(planes * 16);
    let qb = CUBE_COUNT_X as usize - 1 - CUBE_POS_X as usize;
    let q0 = qb * block_q;
    let my0 = q0 + plane * 16;

    let pitch = comptime!(hd + 8);
    let ppitch = comptime!(block_k + 8);
    let rows_kt = comptime!(if block_k > block_q { block_k } else { block_q });
    let mut kt = SharedMemory::<F>::new(comptime!(rows_kt * pitch));
    let mut vt = SharedMemory::<F>::new(comptime!(rows_kt * pitch));
    let mut pt = SharedMemory::<F>::new(comptime!(planes * 16 * ppitch));

    let ksteps = comptime!(hd / 16);
    stage_rows(q, &mut kt, (b * q.stride(0) + h * q.stride(1)) / width, q.stride(2) / width, q0, seq_q, block_q, hd, width, pitch);
    stage_rows(grad, &mut vt, (b * grad.stride(0) + h * grad.stride(1)) / width, grad.stride(2) / width, q0, seq_q, block_q, hd, width, pitch);
    sync_cube();
    let mut qa = Array::<Vector<F, NA>>::new(comptime!(ksteps * va));
    let mut ga = Array::<Vector<F, NA>>::new(comptime!(ksteps * va));
    #[unroll]
    for kk in 0..ksteps {
        let f = frag_a::<F, NA>(&kt, plane * 16, kk * 16, pitch);
        let g = frag_a::<F, NA>(&vt, plane * 16, kk * 16, pitch);
        #[unroll]
        for i in 0..va {
            qa[kk * va + i] = f[i];
            ga[kk * va + i] = g[i];
        }
    }
    // This lane's two rows: their log-sum-exp and delta.
    let mut lse_lo = 0.0f32;
    let mut lse_hi = 0.0f32;
    let mut d_lo = 0.0f32;
    let mut d_hi = 0.0f32;
    #[unroll]
    for i in 0..vc {
        #[unroll]
        for e in 0..nc {
            let (r, _c) = def.position_of_nth(lane, (i * nc + e) as u32, cmma::MatrixIdent::Accumulator);
            let row = my0 + usize::cast_from(r);
            if row < seq_q {
                if r < 8 {
                    lse_lo = lse[bh * seq_q + row];
                    d_lo = delta[bh * seq_q + row];
                } else {
                    lse_hi = lse[bh * seq_q + row];
                    d_hi = delta[bh * seq_q + row];
                }
            }
        }
    }

    let s_tiles = comptime!(block_k / 8);
    let o_tiles = comptime!(hd / 8);
    let p_steps = comptime!(block_k / 16);
    let mut dq_acc = Array::<Vector<f32, NC>>::new(comptime!(o_tiles * vc));
    #[unroll]
    for i in 0..comptime!(o_tiles * vc) {
        dq_acc[i] = Vector::new(0.0);
    }

    let mut key_blocks = seq_k.div_ceil(block_k);
    if comptime!(causal) {
        let mut last = q0 + block_q;
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
        stage_rows(k, &mut kt, (b * k.stride(0) + h * k.stride(1)) / width, k.stride(2) / width, j0, seq_k, block_k, hd, width, pitch);
        stage_rows(v, &mut vt, (b * v.stride(0) + h * v.stride(1)) / width, v.stride(2) / width, j0, seq_k, block_k, hd, width, pitch);
        sync_cube();

        let mut s_acc = Array::<Vector<f32, NC>>::new(comptime!(s_tiles * vc));
        let mut dp_acc = Array::<Vector<f32, NC>>::new(comptime!(s_tiles * vc));
        #[unroll]
        for i in 0..comptime!(s_tiles * vc) {
            s_acc[i] = Vector::new(0.0);
            dp_acc[i] = Vector::new(0.0);
        }
        #[unroll]
        for kk in 0..ksteps {
            let a = part::<F, NA>(&qa, kk, va);
            let g = part::<F, NA>(&ga, kk, va);
            #[unroll]
            for t in 0..s_tiles {
                let bk = frag_b::<F, NB>(&kt, kk * 16, t * 8, pitch, true);
                mma::<F, NA, NB, NC>(&a, &bk, &mut s_acc, t * vc);
                let bv = frag_b::<F, NB>(&vt, kk * 16, t * 8, pitch, true);
                mma::<F, NA, NB, NC>(&g, &bv, &mut dp_acc, t * vc);
            }
        }
        // dS = P * (dP - delta), P = exp(scale * S - lse), into the warp's staging rows.
        #[unroll]
        for t in 0..s_tiles {
            #[unroll]
            for i in 0..vc {
                let x = s_acc[t * vc + i];
                let y = dp_acc[t * vc + i];
                #[unroll]
                for e in 0..nc {
                    let (r, c) = def.position_of_nth(lane, (i * nc + e) as u32, cmma::MatrixIdent::Accumulator);
                    let (r, c) = (usize::cast_from(r), usize::cast_from(c));
                    let mut ds = 0.0f32;
                    if visible(my0 + r, j0 + t * 8 + c, seq_k, causal) {
                        let p = (x[e] * scale - select(r < 8, lse_lo, lse_hi)).exp();
                        ds = p * (y[e] - select(r < 8, d_lo, d_hi));
                    }
                    pt[(plane * 16 + r) * ppitch + t * 8 + c] = F::cast_from(ds);
                }
            }
        }
        sync_plane();
        // dQ += dS K.
        #[unroll]
        for kk in 0..p_steps {
            let a = frag_a::<F, NA>(&pt, plane * 16, kk * 16, ppitch);
            #[unroll]
            for t in 0..o_tiles {
                let bk = frag_b::<F, NB>(&kt, kk * 16, t * 8, pitch, false);
                mma::<F, NA, NB, NC>(&a, &bk, &mut dq_acc, t * vc);
            }
        }
    }

    let obase = b * dq.stride(0) + h * dq.stride(1);
    let os = dq.stride(2);
    #[unroll]
    for t in 0..o_tiles {
        #[unroll]
        for i in 0..vc {
            let x = dq_acc[t * vc + i];
            #[unroll]
            for e in 0..nc {
                let (r, c) = def.position_of_nth(lane, (i * nc + e) as u32, cmma::MatrixIdent::Accumulator);
                let (r, c) = (usize::cast_from(r), usize::cast_from(c));
                let row = my0 + r;
                if row < seq_q {
                    dq[obase + row * os + t * 8 + c] = F::cast_from(x[e] * scale);
                }
            }
        }
    }
}

/// Tensor-core dK and dV. Grid `(key blocks, batch * heads)`, cube `(32, planes)`; each warp owns
/// 16 key rows (K and V stay in shared memory) and walks the query blocks, computing the
/// transposed products `S^T = K q^T`, `dP^T = V dO^T`, then `dV += P^T dO`, `dK += dS^T q`.
#[cube(launch_unchecked)]
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
    heads: usize,
    seq_q: usize,
    seq_k: usize,
    scale: f32,
    #[comptime] hd: usize,
    #[comptime] planes: usize,
    #[comptime] block_q: usize,
    #[comptime] width: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let size!(NA) = def.vector_size(cmma::MatrixIdent::A);
    let size!(NB) = def.vector_size(cmma::MatrixIdent::B);
    let size!(NC) = def.vector_size(cmma::MatrixIdent::Accumulator);
    let vc = def.vectors_per_lane(cmma::MatrixIdent::Accumulator);
    let nc = def.vector_size(cmma::MatrixIdent::Accumulator);

    let lane = UNIT_POS_PLANE;
    let plane = UNIT_POS_Y as usize;
    let bh = CUBE_POS_Y as usize;
    let (b, h) = (bh / heads, bh % heads);
    let block_k = comptime!(planes * 16);
    let kb = CUBE_POS_X as usize;
    let k0 = kb * block_k;
    let my0 = k0 + plane * 16;

    let pitch = comptime!(hd + 8);
    let spitch = comptime!(block_q + 8);
    let mut kt = SharedMemory::<F>::new(comptime!(block_k * pitch));
    let mut vt = SharedMemory::<F>::new(comptime!(block_k * pitch));
    let mut qt = SharedMemory::<F>::new(comptime!(block_q * pitch));
    let mut gt = SharedMemory::<F>::new(comptime!(block_q * pitch));
    let mut st = SharedMemory::<F>::new(comptime!(planes * 16 * spitch));
    let mut lse_t = SharedMemory::<f32>::new(block_q);
    let mut delta_t = SharedMemory::<f32>::new(block_q);

    stage_rows(k, &mut kt, (b * k.stride(0) + h * k.stride(1)) / width, k.stride(2) / width, k0, seq_k, block_k, hd, width, pitch);
    stage_rows(v, &mut vt, (b * v.stride(0) + h * v.stride(1)) / width, v.stride(2) / width, k0, seq_k, block_k, hd, width, pitch);

    let ksteps = comptime!(hd / 16);
    let s_tiles = comptime!(block_q / 8);
    let o_tiles = comptime!(hd / 8);
    let p_steps = comptime!(block_q / 16);
    let mut dk_acc = Array::<Vector<f32, NC>>::new(comptime!(o_tiles * vc));
    let mut dv_acc = Array::<Vector<f32, NC>>::new(comptime!(o_tiles * vc));
    #[unroll]
    for i in 0..comptime!(o_tiles * vc) {
        dk_acc[i] = Vector::new(0.0);
        dv_acc[i] = Vector::new(0.0);
    }

    let query_blocks = seq_q.div_ceil(block_q);
    let mut first = 0usize;
    if comptime!(causal) {
        first = k0 / block_q;
    }
    for qb in first..query_blocks {
        let i0 = qb * block_q;
        sync_cube();
        stage_rows(q, &mut qt, (b * q.stride(0) + h * q.stride(1)) / width, q.stride(2) / width, i0, seq_q, block_q, hd, width, pitch);
        stage_rows(grad, &mut gt, (b * grad.stride(0) + h * grad.stride(1)) / width, grad.stride(2) / width, i0, seq_q, block_q, hd, width, pitch);
        let mut r = UNIT_POS as usize;
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

        let mut s_acc = Array::<Vector<f32, NC>>::new(comptime!(s_tiles * vc));
        let mut dp_acc = Array::<Vector<f32, NC>>::new(comptime!(s_tiles * vc));
        #[unroll]
        for i in 0..comptime!(s_tiles * vc) {
            s_acc[i] = Vector::new(0.0);
            dp_acc[i] = Vector::new(0.0);
        }
        #[unroll]
        for kk in 0..ksteps {
            let a = frag_a::<F, NA>(&kt, plane * 16, kk * 16, pitch);
            let g = frag_a::<F, NA>(&vt, plane * 16, kk * 16, pitch);
            #[unroll]
            for t in 0..s_tiles {
                let bq = frag_b::<F, NB>(&qt, kk * 16, t * 8, pitch, true);
                mma::<F, NA, NB, NC>(&a, &bq, &mut s_acc, t * vc);
                let bg = frag_b::<F, NB>(&gt, kk * 16, t * 8, pitch, true);
                mma::<F, NA, NB, NC>(&g, &bg, &mut dp_acc, t * vc);
            }
        }
        // P^T (into the staging rows) and dS^T (kept in dp_acc); rows are keys, columns queries.
        #[unroll]
        for t in 0..s_tiles {
            #[unroll]
            for i in 0..vc {
                let x = s_acc[t * vc + i];
                let mut y = dp_acc[t * vc + i];
                #[unroll]
                for e in 0..nc {
                    let (r, c) = def.position_of_nth(lane, (i * nc + e) as u32, cmma::MatrixIdent::Accumulator);
                    let (r, c) = (usize::cast_from(r), usize::cast_from(c));
                    let col = t * 8 + c;
                    let mut p = 0.0f32;
                    if i0 + col < seq_q && visible(i0 + col, my0 + r, seq_k, causal) {
                        p = (x[e] * scale - lse_t[col]).exp();
                    }
                    y[e] = p * (y[e] - delta_t[col]);
                    st[(plane * 16 + r) * spitch + col] = F::cast_from(p);
                }
                dp_acc[t * vc + i] = y;
            }
        }
        sync_plane();
        // dV += P^T dO.
        #[unroll]
        for kk in 0..p_steps {
            let a = frag_a::<F, NA>(&st, plane * 16, kk * 16, spitch);
            #[unroll]
            for t in 0..o_tiles {
                let bg = frag_b::<F, NB>(&gt, kk * 16, t * 8, pitch, false);
                mma::<F, NA, NB, NC>(&a, &bg, &mut dv_acc, t * vc);
            }
        }
        sync_plane();
        #[unroll]
        for t in 0..s_tiles {
            #[unroll]
            for i in 0..vc {
                let y = dp_acc[t * vc + i];
                #[unroll]
                for e in 0..nc {
                    let (r, c) = def.position_of_nth(lane, (i * nc + e) as u32, cmma::MatrixIdent::Accumulator);
                    let (r, c) = (usize::cast_from(r), usize::cast_from(c));
                    st[(plane * 16 + r) * spitch + t * 8 + c] = F::cast_from(y[e]);
                }
            }
        }
        sync_plane();
        // dK += dS^T q.
        #[unroll]
        for kk in 0..p_steps {
            let a = frag_a::<F, NA>(&st, plane * 16, kk * 16, spitch);
            #[unroll]
            for t in 0..o_tiles {
                let bq = frag_b::<F, NB>(&qt, kk * 16, t * 8, pitch, false);
                mma::<F, NA, NB, NC>(&a, &bq, &mut dk_acc, t * vc);
            }
        }
    }

    let kbase = b * dk.stride(0) + h * dk.stride(1);
    let ks = dk.stride(2);
    let vbase = b * dv.stride(0) + h * dv.stride(1);
    let vs = dv.stride(2);
    #[unroll]
    for t in 0..o_tiles {
        #[unroll]
        for i in 0..vc {
            let x = dk_acc[t * vc + i];
            let y = dv_acc[t * vc + i];
            #[unroll]
            for e in 0..nc {
                let (r, c) = def.position_of_nth(lane, (i * nc + e) as u32, cmma::MatrixIdent::Accumulator);
                let (r, c) = (usize::cast_from(r), usize::cast_from(c));
                let row = my0 + r;
                if row < seq_k {
                    dk[kbase + row * ks + t * 8 + c] = F::cast_from(x[e] * scale);
                    dv[vbase + row * vs + t * 8 + c] = F::cast_from(y[e]);
                }
            }
        }
    }
}
