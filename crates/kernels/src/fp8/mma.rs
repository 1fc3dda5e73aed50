//! FP8 GEMM on tensor cores (CUDA sm_89+): `mma.sync` m16n8k32 with E4M3 operands and f32
//! accumulators, per-tile scales applied when partial sums are promoted every 128 of K.
//!
//! Opt-in: it runs with `BURNMIX_FP8_GEMM=mma` (see [`crate::settings::Settings::fp8_gemm`]) or
//! [`crate::fp8_gemm_on`]; `tests/cuda/kernels.rs::cuda_fp8_gemm_mma` checks it against the
//! dequantize path (passes on an H100).
//!
//! **Speed:** on Hopper (sm_90) `mma.sync` with E4M3 operands is emulated by the compiler
//! (operands converted to FP16, FP16 MMAs), so this kernel is ALU-bound at ~120 TFLOP/s on an H100
//! (0.44x Burn's bf16 matmul at 8192^3; `docs/results/2026-11-23-night-fp8.md`). Hopper's FP8
//! tensor cores need `wgmma`, which CubeCL 0.10 does not expose. The instruction is native on Ada
//! (sm_89).
//!
//! **Cube shape** ([`MmaShape`]): `wm x wn` warps; each warp computes `16 mt` rows by `8 nt`
//! columns, so a cube computes `BM = 16 mt wm` rows by `BN = 8 nt wn` columns. The default for the
//! H100 is 8 warps (4 x 2) of 32 x 64: a 128 x 128 output tile. Why:
//! - a warp's `mt` A fragments and `nt / 2` B fragment pairs feed `mt nt` MMAs per 32-deep step
//!   (2 + 4 `ldmatrix.x4` for 16 MMAs at 2 x 8), enough reuse to keep shared memory off the
//!   critical path;
//! - the accumulators cost `4 mt nt` f32 registers twice (the running sum and the partial sum of
//!   the current 128-wide K tile, which must stay separate until its scales are known): 128 at
//!   2 x 8, which leaves room for fragments and addresses under the 255-register limit;
//!   4 x 8 per warp would need 256 for the accumulators alone;
//! - the staged K tiles (`BM + BN` rows x 128 codes, rows padded to 144 bytes, two buffers) take
//!   74 KB at 128 x 128, so the 228 KB of an SM would hold three cubes; registers (256 threads x
//!   255, as measured) allow one, and the `cp.async` double buffer hides the global loads behind
//!   the MMAs of the previous tile instead.
//!
//! **Pipeline:** per 128-wide K tile, both operand tiles are copied with `cp.async` into one of
//! two buffers while the other is used (completion tracked by two shared barriers, as in the
//! attention kernels); four k-steps of 32 accumulate into `part`, then
//! `acc += part * sa[row] * sb[block]`.
//!
//! **Fragments:** the m16n8k32 E4M3 A/B register layouts are byte-for-byte those of m16n8k16
//! f16, so the operands are loaded with `ldmatrix` on a 2-byte view of the codes (`Vector<f16, 8>`
//! rows of 16 bytes: CubeCL emits the `.b8` form, sm_100+, for 1-byte element types) and each
//! 32-bit register is reinterpreted as four E4M3 values.

use cubecl::e4m3;
use cubecl::prelude::barrier::{copy_async, Barrier};
use cubecl::prelude::*;
use half::f16;

use crate::pipeline::{commit, wait_block};

/// Vectors (16 bytes = 16 codes) per staged tile row: 128 codes.
const ROW_VECS: usize = 8;
/// Padded row pitch of the staged tiles, in vectors: the 8 rows an `ldmatrix` phase reads fall
/// in distinct banks (144 bytes = 36 words, 4 banks apart).
const PITCH: usize = 9;

/// Cube shape of the tensor-core FP8 GEMM: `wm x wn` warps of `16 mt` rows by `8 nt` columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MmaShape {
    pub wm: usize,
    pub wn: usize,
    pub mt: usize,
    pub nt: usize,
}

/// `wm,wn,mt,nt`, as [`MmaShape::parse`] reads it.
impl std::fmt::Display for MmaShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{},{},{},{}", self.wm, self.wn, self.mt, self.nt)
    }
}

impl MmaShape {
    /// 8 warps of 32 x 64: a 128 x 128 output tile (see the module notes).
    pub const DEFAULT: MmaShape = MmaShape {
        wm: 4,
        wn: 2,
        mt: 2,
        nt: 8,
    };

    /// Output rows per cube.
    pub fn block_m(&self) -> usize {
        16 * self.mt * self.wm
    }

    /// Output columns per cube.
    pub fn block_n(&self) -> usize {
        8 * self.nt * self.wn
    }

    /// Why this shape cannot run, if it cannot: `mt` 1 or 2, `nt` even (B fragments come in pairs),
    /// a warp's columns inside one 128-column scale block, at most 1024 threads, accumulators that
    /// fit in registers and staged tiles that fit in shared memory.
    pub fn check(&self) -> Result<(), String> {
        let MmaShape { wm, wn, mt, nt } = *self;
        if wm == 0 || wn == 0 || nt == 0 || nt % 2 != 0 || !(mt == 1 || mt == 2) {
            return Err(format!("{self:?}: wm, wn must be >= 1, mt 1 or 2, nt even"));
        }
        if 128 % (8 * nt) != 0 {
            return Err(format!(
                "{self:?}: a warp's 8 nt columns must divide 128 (nt = 2, 4, 8 or 16)"
            ));
        }
        if wm * wn > 32 {
            return Err(format!("{self:?}: at most 32 warps per cube"));
        }
        if 8 * mt * nt > 160 {
            return Err(format!(
                "{self:?}: 8 mt nt = {} accumulator registers, at most 160",
                8 * mt * nt
            ));
        }
        let smem = 2 * (self.block_m() + self.block_n()) * PITCH * 16;
        if smem > 200 * 1024 {
            return Err(format!(
                "{self:?}: {smem} bytes of staged tiles, at most 200 KiB"
            ));
        }
        Ok(())
    }

    /// Parses `wm,wn,mt,nt` (the `BURNMIX_FP8_MMA_SHAPE` override).
    pub fn parse(s: &str) -> Result<MmaShape, String> {
        let v: Vec<usize> = s
            .split(',')
            .map(|x| {
                x.trim()
                    .parse::<usize>()
                    .map_err(|_| format!("{s:?}: expected four integers wm,wn,mt,nt"))
            })
            .collect::<Result<_, _>>()?;
        match v[..] {
            [wm, wn, mt, nt] => {
                let shape = MmaShape { wm, wn, mt, nt };
                shape.check()?;
                Ok(shape)
            }
            _ => Err(format!("{s:?}: expected four integers wm,wn,mt,nt")),
        }
    }
}

/// Copies rows `row0 ..` (`rows` of them, `ROW_VECS` vectors each, from K tile `kt`) of a
/// payload into a staged tile at vector `off` with `cp.async`, `threads` units sharing the work;
/// rows past `limit` are zeroed.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage<NV: Size>(
    t: &Array<Vector<f16, NV>>,
    tile: &mut SharedMemory<Vector<f16, NV>>,
    off: usize,
    row0: usize,
    limit: usize,
    row_vecs: usize,
    kt: usize,
    #[comptime] rows: usize,
    #[comptime] threads: usize,
) {
    let unit = UNIT_POS as usize;
    #[unroll]
    for i in 0..comptime!(rows * ROW_VECS).div_ceil(threads) {
        let idx = unit + i * threads;
        if idx < comptime!(rows * ROW_VECS) {
            let r = idx / ROW_VECS;
            let c = idx % ROW_VECS;
            let dst = off + r * PITCH + c;
            if row0 + r < limit {
                let src = (row0 + r) * row_vecs + kt * ROW_VECS + c;
                copy_async::<Vector<f16, NV>>(
                    &t.slice(src, src + 1),
                    &mut tile.slice_mut(dst, dst + 1),
                    8u32,
                );
            } else {
                tile[dst] = Vector::new(f16::new(0.0));
            }
        }
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_mma<O: Float, NV: Size>(
    a: &Array<Vector<f16, NV>>,
    b: &Array<Vector<f16, NV>>,
    sa: &Array<f32>,
    sb: &Array<f32>,
    out: &mut Array<O>,
    m: usize,
    n: usize,
    k_tiles: usize,
    #[comptime] wm: usize,
    #[comptime] wn: usize,
    #[comptime] mt: usize,
    #[comptime] nt: usize,
    #[comptime] a_per_tensor: bool,
    #[comptime] b_per_tensor: bool,
    #[define(O)] _o: StorageType,
) {
    let def = cmma::MmaDefinition::<e4m3, e4m3, f32>::new(16usize, 8usize, 32usize);
    let def16 = cmma::MmaDefinition::<f16, f16, f32>::new(16usize, 8usize, 16usize);
    let size!(NA) = def.vector_size(cmma::MatrixIdent::A);
    let size!(NB) = def.vector_size(cmma::MatrixIdent::B);
    let size!(NC) = def.vector_size(cmma::MatrixIdent::Accumulator);
    let size!(NR) = def16.vector_size(cmma::MatrixIdent::A);

    let bm = comptime!(16 * mt * wm);
    let bn = comptime!(8 * nt * wn);
    let a_size = comptime!(bm * PITCH);
    let b_size = comptime!(bn * PITCH);
    let tiles = comptime!(mt * nt);

    // The cube is (32, warps): x is the lane (UNIT_POS_PLANE would cost a modulo by the
    // run-time `warpSize` in CUDA).
    let lane = UNIT_POS_X as usize;
    let warp = UNIT_POS_Y as usize;
    let threads = comptime!(32 * wm * wn);
    let wr = warp % wm;
    let wc = warp / wm;
    let m0 = CUBE_POS_X as usize * bm;
    let n0 = CUBE_POS_Y as usize * bn;
    let wr0 = wr * comptime!(16 * mt);
    let wc0 = wc * comptime!(8 * nt);
    let row_vecs = k_tiles * ROW_VECS;
    // This lane's ldmatrix row addresses (in vectors) within a warp's A and B tiles.
    let a_lane = (wr0 + lane % 16) * PITCH + lane / 16;
    let b_lane = (wc0 + (lane / 16) * 8 + lane % 8) * PITCH + (lane / 8) % 2;

    let mut at = SharedMemory::<Vector<f16, NV>>::new_aligned(comptime!(2 * bm * PITCH), 16usize);
    let mut bt = SharedMemory::<Vector<f16, NV>>::new_aligned(comptime!(2 * bn * PITCH), 16usize);
    let bar0 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let bar1 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    sync_cube();

    let mut acc = Array::<Vector<f32, NC>>::new(comptime!(tiles * 2));
    let mut part = Array::<Vector<f32, NC>>::new(comptime!(tiles * 2));
    #[unroll]
    for i in 0..comptime!(tiles * 2) {
        acc[i] = Vector::new(0.0);
    }
    // This lane's accumulator rows: row tile t, rows g and g + 8.
    let g = lane / 4;
    // The 128-column scale block of this warp's columns.
    let b_block = (n0 + wc0) / 128;

    if k_tiles > 0 {
        stage::<NV>(a, &mut at, 0, m0, m, row_vecs, 0, bm, threads);
        stage::<NV>(b, &mut bt, 0, n0, n, row_vecs, 0, bn, threads);
        commit(&bar0, &bar1, 0);
    }
    for kt in 0..k_tiles {
        if kt + 1 < k_tiles {
            let nxt = (kt + 1) % 2;
            stage::<NV>(
                a,
                &mut at,
                nxt * a_size,
                m0,
                m,
                row_vecs,
                kt + 1,
                bm,
                threads,
            );
            stage::<NV>(
                b,
                &mut bt,
                nxt * b_size,
                n0,
                n,
                row_vecs,
                kt + 1,
                bn,
                threads,
            );
            commit(&bar0, &bar1, nxt);
        }
        wait_block(&bar0, &bar1, kt);
        let a_off = (kt % 2) * a_size;
        let b_off = (kt % 2) * b_size;

        #[unroll]
        for i in 0..comptime!(tiles * 2) {
            part[i] = Vector::new(0.0);
        }
        #[unroll]
        for j in 0..4usize {
            // A (per row tile, one array each: the MMA takes whole arrays, and copying E4M3
            // vectors between arrays costs byte shuffles): lanes 0-15 give rows 0-15 at codes
            // 32j..32j+15, lanes 16-31 the next 16 codes.
            let mut af0 = Array::<Vector<e4m3, NA>>::new(4usize);
            let mut af1 = Array::<Vector<e4m3, NA>>::new(4usize);
            let ai = a_off + a_lane + j * 2;
            let raw0 = def16.load_matrix::<Vector<f16, NV>, NR>(
                &at.slice(ai, ai + 1),
                cmma::MatrixIdent::A,
                4usize,
                false,
            );
            #[unroll]
            for i in 0..4usize {
                af0[i] = Vector::<e4m3, NA>::reinterpret(raw0[i]);
            }
            if comptime!(mt == 2) {
                let ai1 = ai + comptime!(16 * PITCH);
                let raw1 = def16.load_matrix::<Vector<f16, NV>, NR>(
                    &at.slice(ai1, ai1 + 1),
                    cmma::MatrixIdent::A,
                    4usize,
                    false,
                );
                #[unroll]
                for i in 0..4usize {
                    af1[i] = Vector::<e4m3, NA>::reinterpret(raw1[i]);
                }
            }
            #[unroll]
            for pair in 0..comptime!(nt / 2) {
                // B: matrix q of the x4 load is column tile 2 pair + q / 2, code half q % 2.
                let bi = b_off + b_lane + comptime!(pair * 16 * PITCH) + j * 2;
                let raw_b = def16.load_matrix::<Vector<f16, NV>, NR>(
                    &bt.slice(bi, bi + 1),
                    cmma::MatrixIdent::B,
                    4usize,
                    false,
                );
                #[unroll]
                for half in 0..2usize {
                    let mut bf = Array::<Vector<e4m3, NB>>::new(2usize);
                    bf[0] = Vector::<e4m3, NB>::reinterpret(raw_b[half * 2]);
                    bf[1] = Vector::<e4m3, NB>::reinterpret(raw_b[half * 2 + 1]);
                    let t = pair * 2 + half;
                    let mut c = Array::<Vector<f32, NC>>::new(2usize);
                    c[0] = part[t * 2];
                    c[1] = part[t * 2 + 1];
                    let d = def.execute(&af0, &bf, &c);
                    part[t * 2] = d[0];
                    part[t * 2 + 1] = d[1];
                    if comptime!(mt == 2) {
                        let t1 = t + nt;
                        let mut c1 = Array::<Vector<f32, NC>>::new(2usize);
                        c1[0] = part[t1 * 2];
                        c1[1] = part[t1 * 2 + 1];
                        let d1 = def.execute(&af1, &bf, &c1);
                        part[t1 * 2] = d1[0];
                        part[t1 * 2 + 1] = d1[1];
                    }
                }
            }
        }

        // Promote: acc += part * sa[row, kt] * sb[block, kt].
        let mut s_b = sb[0usize];
        if !comptime!(b_per_tensor) && n0 + wc0 < n {
            s_b = sb[b_block * k_tiles + kt];
        }
        #[unroll]
        for r in 0..mt {
            let row_lo = m0 + wr0 + r * 16 + g;
            let row_hi = row_lo + 8;
            let mut s_lo = 0.0f32;
            let mut s_hi = 0.0f32;
            if comptime!(a_per_tensor) {
                s_lo = sa[0usize];
                s_hi = s_lo;
            } else {
                if row_lo < m {
                    s_lo = sa[row_lo * k_tiles + kt];
                }
                if row_hi < m {
                    s_hi = sa[row_hi * k_tiles + kt];
                }
            }
            let f_lo = Vector::<f32, NC>::new(s_lo * s_b);
            let f_hi = Vector::<f32, NC>::new(s_hi * s_b);
            #[unroll]
            for c in 0..nt {
                let t = r * nt + c;
                acc[t * 2] = fma(part[t * 2], f_lo, acc[t * 2]);
                acc[t * 2 + 1] = fma(part[t * 2 + 1], f_hi, acc[t * 2 + 1]);
            }
        }
        // Every warp is done with this buffer before the next iteration refills it.
        sync_cube();
    }

    // Accumulator vector 2t holds (row g, columns 2 (lane % 4) + {0, 1}) of tile t, vector
    // 2t + 1 the same columns of row g + 8.
    let col_in = 2 * (lane % 4);
    #[unroll]
    for r in 0..mt {
        let row_lo = m0 + wr0 + r * 16 + g;
        let row_hi = row_lo + 8;
        #[unroll]
        for c in 0..nt {
            let t = r * nt + c;
            let col = n0 + wc0 + c * 8 + col_in;
            let lo = acc[t * 2];
            let hi = acc[t * 2 + 1];
            #[unroll]
            for e in 0..2usize {
                if col + e < n {
                    if row_lo < m {
                        out[row_lo * n + col + e] = O::cast_from(lo[e]);
                    }
                    if row_hi < m {
                        out[row_hi * n + col + e] = O::cast_from(hi[e]);
                    }
                }
            }
        }
    }
}
