//! FP8 GEMM on tensor cores (CUDA sm_89+): `mma.sync` m16n8k32 with E4M3 operands and f32
//! accumulators, per-tile scales applied when partial sums are promoted every 128 of K.
//!
//! **Opt-in and not yet validated on a GPU**: it runs only with `BURNMIX_FP8_GEMM=mma`
//! (see [`super::GEMM_ENV`]); `tests/cuda_kernels.rs::cuda_fp8_gemm_mma` checks it against the
//! dequantize path.
//!
//! Cube: 4 warps; a cube computes a 64 x 64 output tile, each warp 16 rows x 64 columns (8 MMA
//! column tiles). Per 128-wide K tile: both operand tiles (64 rows x 128 codes) are staged in
//! shared memory (rows padded to 144 bytes: the 8 rows an `ldmatrix` phase reads fall in distinct
//! banks), four k-steps of 32 accumulate into `part`, then `acc += part * sa[row] * sb`.
//!
//! Fragments: the m16n8k32 E4M3 A/B register layouts are byte-for-byte those of m16n8k16 f16, so
//! the operands are loaded with `ldmatrix` on a 2-byte view of the codes (`Vector<f16, 8>` rows of
//! 16 bytes: CubeCL emits the `.b8` form, sm_100+, for 1-byte element types) and each 32-bit
//! register is reinterpreted as four E4M3 values.

use cubecl::e4m3;
use cubecl::prelude::*;
use half::f16;

/// Vectors (16 bytes = 16 codes) per staged tile row: 128 codes.
const ROW_VECS: usize = 8;
/// Padded row pitch of the staged tiles, in vectors.
const PITCH: usize = 9;
/// Rows of a staged tile (A: output rows of the cube, B: output columns).
const TILE_ROWS: usize = 64;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_mma<O: Float, NV: Size>(
    a: &Tensor<Vector<f16, NV>>,
    b: &Tensor<Vector<f16, NV>>,
    sa: &Tensor<f32>,
    sb: &Tensor<f32>,
    out: &mut Tensor<O>,
    m: usize,
    n: usize,
    k_tiles: usize,
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

    let lane = UNIT_POS_PLANE as usize;
    let warp = UNIT_POS_Y as usize;
    let tid = warp * 32 + lane;
    let m0 = CUBE_POS_X as usize * TILE_ROWS;
    let n0 = CUBE_POS_Y as usize * TILE_ROWS;
    let row_vecs = k_tiles * ROW_VECS;

    let mut sa_tile = SharedMemory::<Vector<f16, NV>>::new_aligned(comptime!(TILE_ROWS * PITCH), 16usize);
    let mut sb_tile = SharedMemory::<Vector<f16, NV>>::new_aligned(comptime!(TILE_ROWS * PITCH), 16usize);

    let mut acc = Array::<Vector<f32, NC>>::new(16usize);
    let mut part = Array::<Vector<f32, NC>>::new(16usize);
    #[unroll]
    for i in 0..16usize {
        acc[i] = Vector::new(0.0);
    }
    // The two output rows of this lane's accumulators.
    let g = lane / 4;
    let row_lo = m0 + warp * 16 + g;
    let row_hi = row_lo + 8;

    for kt in 0..k_tiles {
        // Stage both 64 x 128-code tiles: 512 vectors each, four per unit; rows past m / n are zero.
        #[unroll]
        for i in 0..4usize {
            let idx = tid + i * 128;
            let r = idx / ROW_VECS;
            let c = idx % ROW_VECS;
            let mut va = Vector::<f16, NV>::new(f16::new(0.0));
            let mut vb = Vector::<f16, NV>::new(f16::new(0.0));
            if m0 + r < m {
                va = a[(m0 + r) * row_vecs + kt * ROW_VECS + c];
            }
            if n0 + r < n {
                vb = b[(n0 + r) * row_vecs + kt * ROW_VECS + c];
            }
            sa_tile[r * PITCH + c] = va;
            sb_tile[r * PITCH + c] = vb;
        }
        sync_cube();

        #[unroll]
        for i in 0..16usize {
            part[i] = Vector::new(0.0);
        }
        #[unroll]
        for j in 0..4usize {
            // A: lanes 0-15 give rows 0-15 at codes 32j..32j+15, lanes 16-31 the next 16 codes.
            let at = (warp * 16 + lane % 16) * PITCH + j * 2 + lane / 16;
            let raw_a = def16.load_matrix::<Vector<f16, NV>, NR>(&sa_tile.slice(at, at + 1), cmma::MatrixIdent::A, 4usize, false);
            let mut af = Array::<Vector<e4m3, NA>>::new(4usize);
            #[unroll]
            for r in 0..4usize {
                af[r] = Vector::<e4m3, NA>::reinterpret(raw_a[r]);
            }
            #[unroll]
            for pair in 0..4usize {
                // B: matrix q of the x4 load is column tile 2 * pair + q / 2, code half q % 2.
                let q = lane / 8;
                let bt = (pair * 16 + (q / 2) * 8 + lane % 8) * PITCH + j * 2 + q % 2;
                let raw_b = def16.load_matrix::<Vector<f16, NV>, NR>(&sb_tile.slice(bt, bt + 1), cmma::MatrixIdent::B, 4usize, false);
                #[unroll]
                for half in 0..2usize {
                    let mut bf = Array::<Vector<e4m3, NB>>::new(2usize);
                    bf[0] = Vector::<e4m3, NB>::reinterpret(raw_b[half * 2]);
                    bf[1] = Vector::<e4m3, NB>::reinterpret(raw_b[half * 2 + 1]);
                    let t = pair * 2 + half;
                    let mut c = Array::<Vector<f32, NC>>::new(2usize);
                    c[0] = part[t * 2];
                    c[1] = part[t * 2 + 1];
                    let d = def.execute(&af, &bf, &c);
                    part[t * 2] = d[0];
                    part[t * 2 + 1] = d[1];
                }
            }
        }

        // Promote: acc += part * sa[row, kt] * sb[block, kt].
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
        let mut s_b = sb[0usize];
        if !comptime!(b_per_tensor) {
            s_b = sb[(n0 / 128) * k_tiles + kt];
        }
        let f_lo = Vector::<f32, NC>::new(s_lo * s_b);
        let f_hi = Vector::<f32, NC>::new(s_hi * s_b);
        #[unroll]
        for t in 0..8usize {
            acc[t * 2] += part[t * 2] * f_lo;
            acc[t * 2 + 1] += part[t * 2 + 1] * f_hi;
        }
        sync_cube();
    }

    // Accumulator vector 2t holds (row g, columns 2 * (lane % 4) + {0, 1}) of column tile t,
    // vector 2t + 1 the same columns of row g + 8.
    let col_in = 2 * (lane % 4);
    #[unroll]
    for t in 0..8usize {
        let col = n0 + t * 8 + col_in;
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
