//! FP8 quantize / dequantize kernels. The encoding is done with integer operations on the f32 bits
//! (round to nearest even, saturating), so every backend (CUDA, wgpu/lavapipe) gives the same bytes
//! as the CPU reference in [`super::reference`].
//!
//! Layout: the quantized matrix is `[rows, k]`, row-major along the reduction axis `k`, padded with
//! zero codes to a multiple of 128; four codes per little-endian u32 word. A cube is 32 x 8 units:
//! unit x owns word x (codes 4x..4x+3) of a 128-wide K tile. For 1x128 tiles unit y owns one row;
//! for 128x128 blocks the cube owns the block and unit y rows y, y + 8, ..., y + 120.

// `#[cube]` code: CubeCL expands plain comparisons and arithmetic, not the std helpers clippy
// suggests (`is_multiple_of`, `clamp`, `RangeInclusive::contains`).
#![allow(
    clippy::manual_is_multiple_of,
    clippy::manual_clamp,
    clippy::manual_range_contains
)]

use cubecl::prelude::*;

/// Format constants the kernels take at compile time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct FormatConsts {
    /// Mantissa bits (E4M3: 3, E5M2: 2).
    pub mant: u32,
    /// Exponent bias (7, 15).
    pub bias: u32,
    /// Largest finite magnitude code (0x7E, 0x7B).
    pub max_code: u32,
    /// Magnitude code of an infinite input (E4M3: NaN 0x7F, E5M2: inf 0x7C).
    pub inf_code: u32,
    /// Exponent of the largest finite value (8, 15).
    pub max_exp: u32,
}

/// The magnitude code of `x * scale` (see `reference::encode`): `x` finite and normal.
#[cube]
fn encode_positive(y: u32, #[comptime] f: FormatConsts) -> u32 {
    let m = comptime!(f.mant);
    let first_normal = comptime!(128 - f.bias);
    let ef = y >> 23;
    let mant = y & 0x7F_FFFFu32;
    let mut code = 0u32;
    if ef >= first_normal {
        code = ((ef - comptime!(127 - f.bias)) << m) | (mant >> comptime!(23 - m));
        let rem = mant & comptime!((1u32 << (23 - m)) - 1);
        let half = comptime!(1u32 << (22 - m));
        if rem > half || (rem == half && (code & 1) == 1) {
            code += 1;
        }
        if code > comptime!(f.max_code) {
            code = comptime!(f.max_code);
        }
    } else if ef > 0 {
        let shift = (first_normal - ef) + comptime!(23 - m);
        if shift <= 24 {
            let full = 0x80_0000u32 | mant;
            code = full >> shift;
            let rem = full & ((1u32 << shift) - 1);
            let half = 1u32 << (shift - 1);
            if rem > half || (rem == half && (code & 1) == 1) {
                code += 1;
            }
        }
    }
    code
}

/// The code (sign in bit 7) of `x * scale`; NaN -> NaN, inf -> the format's inf code, |x| below
/// the smallest f32 normal -> 0 with x's sign.
#[cube]
fn encode(x: f32, scale: f32, #[comptime] f: FormatConsts) -> u32 {
    let bits = u32::reinterpret(x);
    let a = bits & 0x7FFF_FFFFu32;
    let mut mag = 0u32;
    if a > 0x7F80_0000u32 {
        mag = 0x7Fu32;
    } else if a == 0x7F80_0000u32 {
        mag = comptime!(f.inf_code);
    } else if a >= 0x80_0000u32 {
        mag = encode_positive(u32::reinterpret(f32::reinterpret(a) * scale), f);
    }
    ((bits >> 31) << 7) | mag
}

/// The value of a code (exact).
#[cube]
pub(crate) fn decode(code: u32, #[comptime] f: FormatConsts) -> f32 {
    let m = comptime!(f.mant);
    let mag = code & 0x7Fu32;
    let e = mag >> m;
    let mm = mag & comptime!((1u32 << m) - 1);
    let mut bits = 0x7FC0_0000u32;
    if comptime!(f.bias == 7) && mag == 0x7Fu32 {
        // NaN (E4M3 has no infinity)
    } else if comptime!(f.bias == 15) && e == 31 {
        bits = select(mm == 0, 0x7F80_0000u32, 0x7FC0_0000u32);
    } else if e == 0 {
        // mm * 2^(1 - bias - m): an exact small integer times a power of two.
        bits = u32::reinterpret(
            f32::cast_from(mm) * f32::new(comptime!(f32::from_bits((128 - f.bias - m) << 23))),
        );
    } else {
        bits = ((e + comptime!(127 - f.bias)) << 23) | (mm << comptime!(23 - m));
    }
    f32::reinterpret(bits | ((code & 0x80u32) << 24))
}

/// `|x|` if finite and normal, else 0 (decided on the bits: CUDA cannot bitcast a constant).
#[cube]
fn amax_term(x: f32) -> f32 {
    let a = u32::reinterpret(x) & 0x7FFF_FFFFu32;
    select(
        a >= 0x80_0000u32 && a <= 0x7F7F_FFFFu32,
        f32::reinterpret(a),
        0.0f32,
    )
}

/// The quantization multiplier for a tile amax (see `reference::scales_for`).
#[cube]
fn multiplier(amax: f32, #[comptime] f: FormatConsts, #[comptime] pow2: bool) -> f32 {
    let mut s = 1.0f32;
    if amax > 0.0 {
        if comptime!(pow2) {
            let bits = u32::reinterpret(amax);
            let ea = bits >> 23;
            // k + 127 = max_exp + 254 - ea - (mantissa > 0.75), clamped to [1, 253].
            let mut kb = comptime!(f.max_exp + 254) - ea;
            if (bits & 0x7F_FFFFu32) > 0x60_0000u32 {
                kb -= 1;
            }
            if kb < 1 {
                kb = 1;
            }
            if kb > 253 {
                kb = 253;
            }
            s = f32::reinterpret(kb << 23);
        } else {
            s = f32::new(comptime!(max_value(f))) / amax;
            s = f32::min(
                f32::max(s, f32::new(comptime!(f32::MIN_POSITIVE))),
                f32::new(comptime!(f32::from_bits(253 << 23))),
            );
        }
    }
    s
}

/// The dequantization scale `1 / s` (from the bits for powers of two, so it is exact everywhere).
#[cube]
fn dequant_scale(s: f32, #[comptime] pow2: bool) -> f32 {
    let mut d = 1.0f32 / s;
    if comptime!(pow2) {
        d = f32::reinterpret((254u32 - (u32::reinterpret(s) >> 23)) << 23);
    }
    d
}

/// The largest finite value of the format.
pub(crate) fn max_value(f: FormatConsts) -> f32 {
    (1.0 + ((f.max_code & ((1 << f.mant) - 1)) as f32) / (1 << f.mant) as f32)
        * (2.0f32).powi(f.max_exp as i32)
}

/// One element of the logical `[rows, k]` input (0 outside).
#[cube]
fn load<F: Float>(
    x: &Tensor<F>,
    i: usize,
    j: usize,
    rows: usize,
    k: usize,
    stride_i: usize,
    stride_j: usize,
) -> f32 {
    let mut v = 0.0f32;
    if i < rows && j < k {
        v = f32::cast_from(x[i * stride_i + j * stride_j]);
    }
    v
}

/// The amax of this unit's tile, for a 32 x 8 cube: unit (x, y) reads codes `j0 .. j0 + 4` of rows
/// `row0` (1x128: one row per y) or `row0, row0 + 8, ..., row0 + 120` (128x128 `block`); then a
/// shared-memory tree over the 32 units of a row, or over all 256 units of the block.
#[cube]
#[allow(clippy::too_many_arguments)]
fn tile_amax_of<F: Float>(
    x: &Tensor<F>,
    row0: usize,
    j0: usize,
    rows: usize,
    k: usize,
    stride_i: usize,
    stride_j: usize,
    #[comptime] block: bool,
) -> f32 {
    let x_unit = UNIT_POS_X as usize;
    let y_unit = UNIT_POS_Y as usize;
    let reps = comptime!(if block { 16usize } else { 1usize });
    let mut smem = SharedMemory::<f32>::new(256usize);
    let mut local = 0.0f32;
    for r in 0..reps {
        #[unroll]
        for e in 0..4u32 {
            local = f32::max(
                local,
                amax_term(load::<F>(
                    x,
                    row0 + r * 8,
                    j0 + e as usize,
                    rows,
                    k,
                    stride_i,
                    stride_j,
                )),
            );
        }
    }
    let slot = y_unit * 32 + x_unit;
    smem[slot] = local;
    sync_cube();
    let mut stride = 16usize;
    let mut base = y_unit * 32;
    let mut pos = x_unit;
    if comptime!(block) {
        stride = 128usize;
        base = 0usize;
        pos = slot;
    }
    while stride > 0usize {
        if pos < stride {
            smem[base + pos] = f32::max(smem[base + pos], smem[base + pos + stride]);
        }
        sync_cube();
        stride /= 2usize;
    }
    smem[base]
}

/// Quantizes the logical `[rows, k]` view `x[i * stride_i + j * stride_j]` (strides select the
/// matrix or its transpose) into `payload` `[rows, words]` and dequantization `scales`
/// (1x128: `[rows, k_tiles]`; 128x128: `[ceil(rows / 128), k_tiles]`; given amax: `[1]`).
/// With `given_amax` every tile uses `amax[0]` (per-tensor scaling).
#[cube(launch)]
pub(crate) fn quantize<F: Float>(
    x: &Tensor<F>,
    amax: &Tensor<f32>,
    payload: &mut Tensor<u32>,
    scales: &mut Tensor<f32>,
    rows: usize,
    k: usize,
    stride_i: usize,
    stride_j: usize,
    words: usize,
    #[comptime] block: bool,
    #[comptime] given_amax: bool,
    #[comptime] pow2: bool,
    #[comptime] f: FormatConsts,
    #[define(F)] _dtype: StorageType,
) {
    let x_unit = UNIT_POS_X as usize;
    let y_unit = UNIT_POS_Y as usize;
    let kt = CUBE_POS_X as usize;
    let j0 = kt * 128 + x_unit * 4;
    let reps = comptime!(if block { 16usize } else { 1usize });
    let rows_per_cube = comptime!(if block { 128usize } else { 8usize });
    let row0 = CUBE_POS_Y as usize * rows_per_cube + y_unit;

    let mut tile_amax = amax[0usize];
    if !comptime!(given_amax) {
        tile_amax = tile_amax_of::<F>(x, row0, j0, rows, k, stride_i, stride_j, block);
    }
    let s = multiplier(tile_amax, f, pow2);
    let d = dequant_scale(s, pow2);

    for r in 0..reps {
        let i = row0 + r * 8;
        if i < rows {
            let mut word = 0u32;
            #[unroll]
            for e in 0..4u32 {
                let code = encode(
                    load::<F>(x, i, j0 + e as usize, rows, k, stride_i, stride_j),
                    s,
                    f,
                );
                word |= code << (e * 8u32);
            }
            payload[i * words + kt * 32 + x_unit] = word;
        }
    }
    if !comptime!(given_amax) && x_unit == 0 {
        if comptime!(block) {
            if y_unit == 0 {
                scales[CUBE_POS_Y as usize * CUBE_COUNT_X as usize + kt] = d;
            }
        } else if row0 < rows {
            scales[row0 * CUBE_COUNT_X as usize + kt] = d;
        }
    }
    if comptime!(given_amax) && CUBE_POS_X == 0 && CUBE_POS_Y == 0 && UNIT_POS == 0 {
        scales[0usize] = d;
    }
}

/// Per-128x128-block amax of the logical `[rows, k]` view (for per-tensor scaling: the launcher
/// takes the max of these).
#[cube(launch)]
pub(crate) fn block_amax<F: Float>(
    x: &Tensor<F>,
    out: &mut Tensor<f32>,
    rows: usize,
    k: usize,
    stride_i: usize,
    stride_j: usize,
    #[define(F)] _dtype: StorageType,
) {
    let j0 = CUBE_POS_X as usize * 128 + UNIT_POS_X as usize * 4;
    let row0 = CUBE_POS_Y as usize * 128 + UNIT_POS_Y as usize;
    let tile = tile_amax_of::<F>(x, row0, j0, rows, k, stride_i, stride_j, true);
    if UNIT_POS == 0 {
        out[CUBE_POS_Y as usize * CUBE_COUNT_X as usize + CUBE_POS_X as usize] = tile;
    }
}

/// Dequantizes `[rows, words * 4]` codes into `out` `[rows, k_out]` (`k_out` = k, or the padded
/// width): one unit per word.
#[cube(launch)]
pub(crate) fn dequantize<F: Float>(
    payload: &Tensor<u32>,
    scales: &Tensor<f32>,
    out: &mut Tensor<F>,
    rows: usize,
    k_out: usize,
    words: usize,
    #[comptime] granularity: u32,
    #[comptime] f: FormatConsts,
    #[define(F)] _dtype: StorageType,
) {
    let w = (CUBE_POS_Y as usize * CUBE_COUNT_X as usize + CUBE_POS_X as usize)
        * CUBE_DIM_X as usize
        + UNIT_POS_X as usize;
    if w < rows * words {
        let i = w / words;
        let wj = w % words;
        let kt = wj / 32;
        let k_tiles = words / 32;
        let mut d = scales[0usize];
        if comptime!(granularity == 0) {
            d = scales[i * k_tiles + kt];
        } else if comptime!(granularity == 1) {
            d = scales[(i / 128) * k_tiles + kt];
        }
        let word = payload[w];
        #[unroll]
        for e in 0..4u32 {
            let j = wj * 4 + e as usize;
            if j < k_out {
                let v = decode((word >> (e * 8u32)) & 0xFFu32, f) * d;
                out[i * k_out + j] = F::cast_from(v);
            }
        }
    }
}
