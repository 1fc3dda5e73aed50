//! FP8 quantize / dequantize kernels. The encoding is done with integer operations on the f32 bits
//! (round to nearest even, saturating), so every backend (CUDA, wgpu/lavapipe) gives the same bytes
//! as the CPU reference in [`super::reference`].
//!
//! Layout: the quantized matrix is `[rows, k]`, row-major along the reduction axis `k`, padded with
//! zero codes to a multiple of 128; four codes per little-endian u32 word. A cube is 32 x 8 units:
//! unit x owns word x (codes 4x..4x+3) of a 128-wide K tile. For 1x128 tiles unit y owns one row;
//! for 128x128 blocks the cube owns the block and unit y rows y, y + 8, ..., y + 120. Per-tensor
//! scaling first takes the tensor's amax in a separate grid-stride pass over its stored layout.

// `#[cube]` code: CubeCL expands plain comparisons and arithmetic, not the std helpers clippy
// suggests (`is_multiple_of`, `clamp`, `RangeInclusive::contains`, `div_ceil`).
#![allow(
    clippy::manual_is_multiple_of,
    clippy::manual_clamp,
    clippy::manual_range_contains,
    clippy::manual_div_ceil
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

/// The code (sign in bit 7) of `x * scale`; NaN -> NaN, inf -> the format's inf code, |x| below
/// the smallest f32 normal -> 0 with x's sign: the same bytes as `reference::encode`, without
/// branches. `y = |x| * scale` is rounded to nearest-even on the format's grid in one of two ways,
/// and the right one selected:
/// - normal range (`y` >= the format's smallest normal): adding `half - 1` plus the lowest kept
///   mantissa bit to the f32 bits and dropping the low `23 - mant` bits rounds the mantissa to
///   nearest-even (a carry moves into the exponent, as it should); re-biasing the exponent gives
///   the code, capped at the largest finite one (saturation);
/// - subnormal range: `y * 2^(bias - 1 + mant)` is the code as a real number below `2^mant`;
///   adding `2^23` makes the f32 addition round it to an integer, nearest-even, which the low bits
///   then hold. A `y` that rounds up to the smallest normal gives its code, `2^mant`.
#[cube]
fn encode(x: f32, scale: f32, #[comptime] f: FormatConsts) -> u32 {
    let m = comptime!(f.mant);
    let shift = comptime!(23 - m);
    let bits = u32::reinterpret(x);
    let a = bits & 0x7FFF_FFFFu32;
    let y = u32::reinterpret(f32::reinterpret(a) * scale);
    let rounded = (y + comptime!((1u32 << (22 - m)) - 1) + ((y >> shift) & 1u32)) >> shift;
    let normal_code = rounded - comptime!((127 - f.bias) << m);
    let normal = select(
        normal_code > comptime!(f.max_code),
        comptime!(f.max_code),
        normal_code,
    );
    let sub = u32::reinterpret(
        f32::reinterpret(y) * f32::new(comptime!(f32::from_bits((126 + f.bias + m) << 23)))
            + f32::new(8_388_608.0),
    ) - 0x4B00_0000u32;
    let mut mag = select(y < comptime!((128 - f.bias) << 23), sub, normal);
    mag = select(a < 0x80_0000u32, 0u32, mag);
    mag = select(
        a >= 0x7F80_0000u32,
        select(a == 0x7F80_0000u32, comptime!(f.inf_code), 0x7Fu32),
        mag,
    );
    ((bits >> 31) << 7) | mag
}

/// Four codes packed into a little-endian word (`a` in the low byte, `d` in the high byte), each
/// the [`encode`] of its value with multiplier `scale`.
#[cube]
fn encode_word(a: f32, b: f32, c: f32, d: f32, scale: f32, #[comptime] f: FormatConsts) -> u32 {
    encode(a, scale, f)
        | (encode(b, scale, f) << 8u32)
        | (encode(c, scale, f) << 16u32)
        | (encode(d, scale, f) << 24u32)
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

/// The dequantization scale of the elements of row `i` in K tile `kt` (scales `[_, k_tiles]`)
/// by `granularity` (see `Fp8Granularity::kernel_code`): 0 one per 1x128 tile, 1 one per
/// 128x128 block, 2 one per tensor.
#[cube]
fn tile_scale(
    scales: &Array<f32>,
    i: usize,
    kt: usize,
    k_tiles: usize,
    #[comptime] granularity: u32,
) -> f32 {
    let mut d = scales[0usize];
    if comptime!(granularity == 0) {
        d = scales[i * k_tiles + kt];
    } else if comptime!(granularity == 1) {
        d = scales[(i / 128) * k_tiles + kt];
    }
    d
}

/// Where the quantizers write the scale of row (1x128) or row block (128x128) `r` in K tile `kt`
/// of a matrix of `rows` rows and `k_tiles` K tiles: the layout cuBLASLt's block-scaled FP8 GEMM
/// reads (`gemm::cublaslt::Fp8Scales`), so that the GEMM takes the quantizer's buffer as it is.
/// 1x128: `[k_tiles, rows]`, rows contiguous; 128x128 (`block`): `[row_blocks, k_tiles4]`, K
/// contiguous, `k_tiles4` the tile count rounded up to a multiple of 4 (see [`zero_block_pad`]).
/// The launchers hand the buffer on as a `[rows or row_blocks, k_tiles]` view of it
/// (`forward::scales_output`).
#[cube]
pub(crate) fn scale_at(
    r: usize,
    kt: usize,
    rows: usize,
    k_tiles: usize,
    #[comptime] block: bool,
) -> usize {
    let mut at = kt * rows + r;
    if comptime!(block) {
        at = r * block_pad(k_tiles) + kt;
    }
    at
}

/// `k_tiles` rounded up to a multiple of 4: the row length of 128x128 block scales.
#[cube]
fn block_pad(k_tiles: usize) -> usize {
    (k_tiles + 3) / 4 * 4
}

/// Zeroes the padding after the last K tile of row block `rb`'s 128x128 scales (see
/// [`scale_at`]); the unit that writes that row's last scale calls it.
#[cube]
fn zero_block_pad(scales: &mut Array<f32>, rb: usize, k_tiles: usize) {
    let row_len = block_pad(k_tiles);
    for c in k_tiles..row_len {
        scales[rb * row_len + c] = 0.0f32;
    }
}

/// The largest finite value of the format.
pub(crate) fn max_value(f: FormatConsts) -> f32 {
    (1.0 + ((f.max_code & ((1 << f.mant) - 1)) as f32) / (1 << f.mant) as f32)
        * (2.0f32).powi(f.max_exp as i32)
}

/// Codes `j0 .. j0 + 4` of row `i` of the logical `[rows, k]` input into `vals[at .. at + 4]` (0
/// outside). `vec4`: `x` is read as 4-element vectors (`stride_j` = 1, `k` and `stride_i`
/// multiples of 4), one load; otherwise element by element with the strides.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load4<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    vals: &mut Array<f32>,
    at: usize,
    i: usize,
    j0: usize,
    rows: usize,
    k: usize,
    stride_i: usize,
    stride_j: usize,
    #[comptime] vec4: bool,
) {
    if comptime!(vec4) {
        if i < rows && j0 < k {
            let v = x[(i * stride_i + j0) / 4];
            #[unroll]
            for e in 0..4usize {
                vals[at + e] = f32::cast_from(v[e]);
            }
        } else {
            #[unroll]
            for e in 0..4usize {
                vals[at + e] = 0.0f32;
            }
        }
    } else {
        #[unroll]
        for e in 0..4usize {
            let j = j0 + e;
            let mut v = 0.0f32;
            if i < rows && j < k {
                v = f32::cast_from(x[i * stride_i + j * stride_j][0usize]);
            }
            vals[at + e] = v;
        }
    }
}

/// The max of `local` over the units of a tile, for a 32 x 8 cube: the 32 units of a row (1x128
/// tiles) or all 256 (128x128 `block`). `plane`: 32-unit planes, one per row of the cube (a
/// plane max, and for blocks one exchange through shared memory); otherwise a shared-memory tree.
#[cube]
#[allow(unused_assignments)]
fn tile_max(local: f32, #[comptime] block: bool, #[comptime] plane: bool) -> f32 {
    let x_unit = UNIT_POS_X as usize;
    let y_unit = UNIT_POS_Y as usize;
    let mut result = 0.0f32;
    if comptime!(plane) {
        let m = plane_max(local);
        result = m;
        if comptime!(block) {
            let mut smem = SharedMemory::<f32>::new(8usize);
            if x_unit == 0 {
                smem[y_unit] = m;
            }
            sync_cube();
            #[unroll]
            for w in 0..8usize {
                result = f32::max(result, smem[w]);
            }
        }
    } else {
        let mut smem = SharedMemory::<f32>::new(256usize);
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
        result = smem[base];
    }
    result
}

/// Quantizes the logical `[rows, k]` view `x[i * stride_i + j * stride_j]` (strides select the
/// matrix or its transpose) into `payload` `[rows, words]` and dequantization `scales` in the
/// layout [`scale_at`] gives (the one cuBLASLt reads). With `given_amax` every tile uses
/// `amax[0]` (per-tensor scaling).
///
/// A 32 x 8 cube: unit (x, y) holds codes `4x .. 4x + 4` of a 128-wide K tile of row `y` (1x128)
/// or of rows `y, y + 8, ..., y + 120` (128x128 `block`). Each value is loaded once (`vec4`: as
/// one 4-element vector) and kept in registers for the tile's amax ([`tile_max`]) and the
/// encoding.
#[cube(launch)]
#[allow(clippy::too_many_arguments, unused_assignments)]
pub(crate) fn quantize<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    amax: &Array<f32>,
    payload: &mut Array<u32>,
    scales: &mut Array<f32>,
    rows: usize,
    k: usize,
    stride_i: usize,
    stride_j: usize,
    words: usize,
    #[comptime] block: bool,
    #[comptime] given_amax: bool,
    #[comptime] pow2: bool,
    #[comptime] vec4: bool,
    #[comptime] plane: bool,
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

    let mut vals = Array::<f32>::new(comptime!(reps * 4));
    let mut local = 0.0f32;
    #[unroll]
    for r in 0..reps {
        load4::<F, N>(
            x,
            &mut vals,
            r * 4,
            row0 + r * 8,
            j0,
            rows,
            k,
            stride_i,
            stride_j,
            vec4,
        );
        if !comptime!(given_amax) {
            #[unroll]
            for e in 0..4usize {
                local = f32::max(local, amax_term(vals[r * 4 + e]));
            }
        }
    }
    let mut tile_amax = 0.0f32;
    if comptime!(given_amax) {
        tile_amax = amax[0usize];
    } else {
        tile_amax = tile_max(local, block, plane);
    }
    let s = multiplier(tile_amax, f, pow2);
    let d = dequant_scale(s, pow2);

    #[unroll]
    for r in 0..reps {
        let i = row0 + r * 8;
        if i < rows {
            let v = r * 4;
            payload[i * words + kt * 32 + x_unit] =
                encode_word(vals[v], vals[v + 1], vals[v + 2], vals[v + 3], s, f);
        }
    }
    let k_tiles = CUBE_COUNT_X as usize;
    if !comptime!(given_amax) && x_unit == 0 {
        if comptime!(block) {
            if y_unit == 0 {
                let rb = CUBE_POS_Y as usize;
                scales[scale_at(rb, kt, rows, k_tiles, true)] = d;
                if kt + 1 == k_tiles {
                    zero_block_pad(scales, rb, k_tiles);
                }
            }
        } else if row0 < rows {
            scales[scale_at(row0, kt, rows, k_tiles, false)] = d;
        }
    }
    if comptime!(given_amax) && CUBE_POS_X == 0 && CUBE_POS_Y == 0 && UNIT_POS == 0 {
        scales[0usize] = d;
    }
}

/// [`quantize`] for a logical `[rows, k]` view with `stride_i` = 1 (the transpose of a row-major
/// `[k, rows]` matrix), 1x128 tiles or a given amax. A 32 x 8 cube covers 32 rows of the view and
/// one 128-wide K tile: unit (x, y) holds codes `16y .. 16y + 16` of row x, so the 32 units of a
/// plane read 32 adjacent elements of one stored row (one coalesced load) where [`quantize`]'s
/// mapping reads 32 stored rows. A row's tile amax goes through shared memory across the 8
/// planes; each unit encodes its 16 codes into 4 words, which go through shared memory too, so
/// that each plane stores 4 rows of 32 adjacent words. The grid's x walks the view's row blocks
/// (adjacent column blocks of the same stored rows), its y the K tiles.
#[cube(launch)]
#[allow(clippy::too_many_arguments, unused_assignments)]
pub(crate) fn quantize_cols<F: Float>(
    x: &Array<F>,
    amax: &Array<f32>,
    payload: &mut Array<u32>,
    scales: &mut Array<f32>,
    rows: usize,
    k: usize,
    stride_j: usize,
    words: usize,
    k_tiles: usize,
    #[comptime] given_amax: bool,
    #[comptime] pow2: bool,
    #[comptime] f: FormatConsts,
    #[define(F)] _dtype: StorageType,
) {
    let lane = UNIT_POS_X as usize;
    let part = UNIT_POS_Y as usize;
    let kt = CUBE_POS_Y as usize;
    let row0 = CUBE_POS_X as usize * 32;
    let i = row0 + lane;
    let jb = kt * 128 + part * 16;

    let mut vals = Array::<f32>::new(16usize);
    let mut local = 0.0f32;
    #[unroll]
    for t in 0..16usize {
        let j = jb + t;
        let mut v = 0.0f32;
        if i < rows && j < k {
            v = f32::cast_from(x[i + j * stride_j]);
        }
        vals[t] = v;
        local = f32::max(local, amax_term(v));
    }
    let mut tile_amax = 0.0f32;
    if comptime!(given_amax) {
        tile_amax = amax[0usize];
    } else {
        let mut smem = SharedMemory::<f32>::new(256usize);
        smem[part * 32 + lane] = local;
        sync_cube();
        #[unroll]
        for p in 0..8usize {
            tile_amax = f32::max(tile_amax, smem[p * 32 + lane]);
        }
    }
    let s = multiplier(tile_amax, f, pow2);
    let d = dequant_scale(s, pow2);
    // Row `lane`'s 32 words at `lane * 33 ..` (the padding keeps both passes free of bank
    // conflicts).
    let mut staged = SharedMemory::<u32>::new(comptime!(32usize * 33));
    #[unroll]
    for q in 0..4usize {
        let v = q * 4;
        staged[lane * 33 + part * 4 + q] =
            encode_word(vals[v], vals[v + 1], vals[v + 2], vals[v + 3], s, f);
    }
    if !comptime!(given_amax) && part == 0 && i < rows {
        scales[scale_at(i, kt, rows, k_tiles, false)] = d;
    }
    sync_cube();
    #[unroll]
    for r in 0..4usize {
        let row = part * 4 + r;
        if row0 + row < rows {
            payload[(row0 + row) * words + kt * 32 + lane] = staged[row * 33 + lane];
        }
    }
    if comptime!(given_amax) && CUBE_POS_X == 0 && CUBE_POS_Y == 0 && UNIT_POS == 0 {
        scales[0usize] = d;
    }
}

/// Quantizes a stored `[rows, cols]` matrix `x[i * stride_i + j * stride_j]` in both orientations
/// from one read: `payload` / `scales` quantized along `cols` (as [`quantize`] does with the
/// strides as given) and `payload_t` / `scales_t` its transpose `[cols, rows]` quantized along
/// `rows` (as [`quantize`] does with the strides swapped). Tiles: 1x128 in each orientation (a
/// row's 128-column tile as stored, a column's 128-row tile for the transpose), one 128x128
/// `block` amax that both orientations share, or `amax[0]` for every tile (`given_amax`:
/// per-tensor scaling).
///
/// A cube of 256 units covers a 128 x 128 tile of the stored matrix, unit `t` the 8 x 8 block of
/// rows `8 (t / 16) ..` and columns `8 (t % 16) ..`, loaded as vectors of `width` elements when the
/// rows are contiguous (16 bytes of bf16 on CUDA) and kept in registers.
/// - Tile amaxes go through shared memory: each unit writes the maxima of its 8 rows and of its 8
///   columns, then 128 units take a row's maximum and 128 a column's (no planes, so every backend
///   runs the same code); a block's amax is the largest row maximum.
/// - Stored codes: each unit encodes 2 words of each of its rows (adjacent units write a row's
///   128 bytes).
/// - Transposed codes: a unit's 8 rows of a column are 2 whole words of the transposed row; they
///   are staged in shared memory (word index XOR-swizzled by the column's unit, so that neither
///   the writes nor the reads conflict more than 2-way) and each plane then stores whole
///   128-byte rows of the transpose.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn quantize_pair_tiles<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    amax: &Array<f32>,
    payload: &mut Array<u32>,
    scales: &mut Array<f32>,
    payload_t: &mut Array<u32>,
    scales_t: &mut Array<f32>,
    rows: usize,
    cols: usize,
    stride_i: usize,
    stride_j: usize,
    #[comptime] width: usize,
    #[comptime] block: bool,
    #[comptime] given_amax: bool,
    #[comptime] pow2: bool,
    #[comptime] f: FormatConsts,
    #[define(F)] _dtype: StorageType,
) {
    let unit = UNIT_POS as usize;
    let cu = unit % 16;
    let ru = unit / 16;
    let ct = CUBE_POS_X as usize;
    let rt = CUBE_POS_Y as usize;
    let col_tiles = CUBE_COUNT_X as usize;
    let row_tiles = CUBE_COUNT_Y as usize;
    let words = col_tiles * 32;
    let words_t = row_tiles * 32;
    let row0 = rt * 128 + ru * 8;
    let col0 = ct * 128 + cu * 8;

    // vals[i * 8 + e]: row `row0 + i`, column `col0 + e` (0 outside the matrix).
    let mut vals = Array::<f32>::new(64usize);
    #[unroll]
    for i in 0..8usize {
        let row = row0 + i;
        if comptime!(width > 1) {
            #[unroll]
            for g in 0..comptime!(8 / width) {
                let col = col0 + g * width;
                if row < rows && col < cols {
                    let v = x[(row * stride_i + col) / width];
                    #[unroll]
                    for e in 0..width {
                        vals[i * 8 + g * width + e] = f32::cast_from(v[e]);
                    }
                } else {
                    #[unroll]
                    for e in 0..width {
                        vals[i * 8 + g * width + e] = 0.0f32;
                    }
                }
            }
        } else {
            #[unroll]
            for e in 0..8usize {
                let col = col0 + e;
                let mut v = 0.0f32;
                if row < rows && col < cols {
                    v = f32::cast_from(x[row * stride_i + col * stride_j][0usize]);
                }
                vals[i * 8 + e] = v;
            }
        }
    }

    // Partial maxima as f32 bits: rows at `r * 16 + cu`, columns (of unit row `ru`) at
    // `2048 + ru * 128 + e * 16 + cu` for column `cu * 8 + e`. The buffer later stages the
    // transposed codes.
    let mut buf = SharedMemory::<u32>::new(4096usize);
    let mut maxima = SharedMemory::<f32>::new(256usize);
    let mut m = 0.0f32;
    if comptime!(given_amax) {
        m = amax[0usize];
    } else {
        #[unroll]
        for i in 0..8usize {
            let mut rm = 0.0f32;
            #[unroll]
            for e in 0..8usize {
                rm = f32::max(rm, amax_term(vals[i * 8 + e]));
            }
            buf[(ru * 8 + i) * 16 + cu] = u32::reinterpret(rm);
        }
        #[unroll]
        for e in 0..8usize {
            let mut cm = 0.0f32;
            #[unroll]
            for i in 0..8usize {
                cm = f32::max(cm, amax_term(vals[i * 8 + e]));
            }
            buf[2048 + ru * 128 + e * 16 + cu] = u32::reinterpret(cm);
        }
        sync_cube();
        // This unit's row (units 0..128) or column (128..256) amax, kept in `m`.
        if unit < 128 {
            // Row `unit`, its 16 partials read in a rotated order (fewer bank conflicts).
            for p in 0..16usize {
                let q = (p + unit) % 16;
                m = f32::max(m, f32::reinterpret(buf[unit * 16 + q]));
            }
        } else {
            let c = unit - 128;
            for p in 0..16usize {
                m = f32::max(
                    m,
                    f32::reinterpret(buf[2048 + p * 128 + (c % 8) * 16 + c / 8]),
                );
            }
        }
        maxima[unit] = m;
        sync_cube();
        if comptime!(block) {
            // The 128x128 block's amax: the largest of its rows' (broadcast reads).
            m = 0.0f32;
            for r in 0..128usize {
                m = f32::max(m, maxima[r]);
            }
        }
    }

    // As stored: words `2 cu`, `2 cu + 1` of each of the unit's rows.
    #[unroll]
    for i in 0..8usize {
        let row = row0 + i;
        if row < rows {
            let mut t = m;
            if comptime!(!given_amax && !block) {
                t = maxima[ru * 8 + i];
            }
            let s = multiplier(t, f, pow2);
            let v = i * 8;
            let at = row * words + ct * 32 + cu * 2;
            payload[at] = encode_word(vals[v], vals[v + 1], vals[v + 2], vals[v + 3], s, f);
            payload[at + 1] = encode_word(vals[v + 4], vals[v + 5], vals[v + 6], vals[v + 7], s, f);
            if comptime!(!given_amax && !block) && cu == 0 {
                scales[scale_at(row, ct, rows, col_tiles, false)] = dequant_scale(s, pow2);
            }
        }
    }
    // Transposed: column `cu * 8 + e`'s words `2 ru`, `2 ru + 1`, staged at
    // `c * 32 + (word ^ 2 cu)`.
    #[unroll]
    for e in 0..8usize {
        let c = cu * 8 + e;
        let mut t = m;
        if comptime!(!given_amax && !block) {
            t = maxima[128 + c];
        }
        let s = multiplier(t, f, pow2);
        let w0 = encode_word(vals[e], vals[8 + e], vals[16 + e], vals[24 + e], s, f);
        let w1 = encode_word(vals[32 + e], vals[40 + e], vals[48 + e], vals[56 + e], s, f);
        buf[c * 32 + ((ru * 2) ^ (cu * 2))] = w0;
        buf[c * 32 + ((ru * 2 + 1) ^ (cu * 2))] = w1;
    }
    sync_cube();
    let lane = unit % 32;
    let warp = unit / 32;
    #[unroll]
    for q in 0..16usize {
        let c = warp * 16 + q;
        let col = ct * 128 + c;
        if col < cols {
            payload_t[col * words_t + rt * 32 + lane] = buf[c * 32 + (lane ^ ((c / 8) * 2))];
        }
    }
    if comptime!(!given_amax && !block) && unit >= 128 {
        let col = ct * 128 + unit - 128;
        if col < cols {
            scales_t[scale_at(col, rt, cols, row_tiles, false)] =
                dequant_scale(multiplier(m, f, pow2), pow2);
        }
    }
    if comptime!(block) && unit == 0 {
        let d = dequant_scale(multiplier(m, f, pow2), pow2);
        scales[scale_at(rt, ct, rows, col_tiles, true)] = d;
        scales_t[scale_at(ct, rt, cols, row_tiles, true)] = d;
        if ct + 1 == col_tiles {
            zero_block_pad(scales, rt, col_tiles);
        }
        if rt + 1 == row_tiles {
            zero_block_pad(scales_t, ct, row_tiles);
        }
    }
    if comptime!(given_amax) && ct == 0 && rt == 0 && unit == 0 {
        let d = dequant_scale(multiplier(m, f, pow2), pow2);
        scales[0usize] = d;
        scales_t[0usize] = d;
    }
}

/// `partials[CUBE_POS]` = the largest finite normal `|x|` ([`amax_term`]) over this cube's share
/// of `x`, read as `launch::FlatRead` describes (the amax of a matrix does not depend on its
/// orientation, so per-tensor scaling reads the stored layout, as vectors when dense).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn tensor_amax<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    partials: &mut Array<f32>,
    total: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
    #[comptime] dense: bool,
    #[comptime] slots: usize,
    #[comptime] plane: bool,
    #[define(F)] _dtype: StorageType,
) {
    let step = CUBE_COUNT * CUBE_DIM as usize;
    let mut local = 0.0f32;
    let mut i = ABSOLUTE_POS;
    while i < total {
        let v = Vector::<f32, N>::cast_from(
            x[crate::launch::flat_index(i, cols, row_stride, col_stride, dense)],
        );
        #[unroll]
        for l in 0..v.size() {
            local = f32::max(local, amax_term(v[l]));
        }
        i += step;
    }
    let mut smem = SharedMemory::<f32>::new(slots);
    let m = crate::launch::cube_max(local, &mut smem, plane);
    if UNIT_POS == 0 {
        partials[CUBE_POS] = m;
    }
}

/// `partials[CUBE_POS]` = `[amax, nonzero, underflow, saturated]` over this cube's share of the
/// logical `[rows, k]` view `x[i * stride_i + j * stride_j]` and its quantization (`payload`
/// `[rows, words]`, dequantization `scales` by `granularity`: 0 per 1x128 tile, 1 per 128x128
/// block, 2 per tensor), one word (4 codes) per unit and step of a grid-stride loop:
/// - amax: the largest finite `|x|`;
/// - nonzero: finite nonzero values;
/// - underflow: finite nonzero values whose code is a zero;
/// - saturated: finite values above `clip` (the format's clip threshold) times their tile's
///   dequantization scale.
///
/// Decided on the bits of the value cast to f32; counts kept in f32, exact below 2^24 per cube.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn health<F: Float>(
    x: &Array<F>,
    payload: &Array<u32>,
    scales: &Array<f32>,
    partials: &mut Array<f32>,
    rows: usize,
    k: usize,
    stride_i: usize,
    stride_j: usize,
    words: usize,
    clip: f32,
    #[comptime] granularity: u32,
    #[comptime] slots: usize,
    #[comptime] plane: bool,
    #[define(F)] _dtype: StorageType,
) {
    let total = rows * words;
    let k_tiles = words / 32;
    let step = CUBE_COUNT * CUBE_DIM as usize;
    let mut amax = 0.0f32;
    let mut nonzero = 0.0f32;
    let mut under = 0.0f32;
    let mut sat = 0.0f32;
    let mut w = ABSOLUTE_POS;
    while w < total {
        let i = w / words;
        let wj = w % words;
        let limit = tile_scale(scales, i, wj / 32, k_tiles, granularity) * clip;
        let word = payload[w];
        #[unroll]
        for e in 0..4u32 {
            let j = wj * 4 + e as usize;
            if j < k {
                let a = u32::reinterpret(f32::cast_from(x[i * stride_i + j * stride_j]))
                    & 0x7FFF_FFFFu32;
                let finite = a < 0x7F80_0000u32;
                let m = f32::reinterpret(a);
                let nz = finite && a != 0u32;
                amax = select(finite, f32::max(amax, m), amax);
                nonzero += select(nz, 1.0f32, 0.0f32);
                under += select(
                    nz && ((word >> (e * 8u32)) & 0x7Fu32) == 0u32,
                    1.0f32,
                    0.0f32,
                );
                sat += select(finite && m > limit, 1.0f32, 0.0f32);
            }
        }
        w += step;
    }
    let mut smem = SharedMemory::<f32>::new(slots);
    let amax = crate::launch::cube_max(amax, &mut smem, plane);
    let nonzero = crate::launch::cube_sum(nonzero, &mut smem, plane);
    let under = crate::launch::cube_sum(under, &mut smem, plane);
    let sat = crate::launch::cube_sum(sat, &mut smem, plane);
    if UNIT_POS == 0 {
        let row = CUBE_POS * 4;
        partials[row] = amax;
        partials[row + 1] = nonzero;
        partials[row + 2] = under;
        partials[row + 3] = sat;
    }
}

/// Dequantizes `[rows, words * 4]` codes into `out` `[rows, k_out]` (`k_out` = k, or the padded
/// width): one unit per word.
#[cube(launch)]
pub(crate) fn dequantize<F: Float>(
    payload: &Array<u32>,
    scales: &Array<f32>,
    out: &mut Array<F>,
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
        let d = tile_scale(scales, i, wj / 32, words / 32, granularity);
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
