//! The CPU reference of the FP8 quantizer: the same encoding, rounding and scale rules as the
//! kernels, written with plain Rust integer and float operations. The kernels must match it bit for
//! bit (payload and scales); it also serves backends without the kernels.

use super::{Fp8Format, Fp8Granularity, QuantSpec, TILE};

/// `f32::MIN_POSITIVE`: inputs of smaller magnitude (f32 subnormals) quantize to zero, so that a
/// device that flushes subnormals gives the same bytes.
const MIN_NORMAL_BITS: u32 = 0x0080_0000;

/// The FP8 code (sign in bit 7) of `x * scale`, rounded to nearest-even and saturated to the
/// largest finite value; NaN gives the NaN code, +-inf gives +-inf in E5M2 and NaN in E4M3
/// (which has no infinity).
pub fn encode(x: f32, scale: f32, format: Fp8Format) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 31) << 7) as u8;
    let a = bits & 0x7FFF_FFFF;
    let mag = if a > 0x7F80_0000 {
        0x7F
    } else if a == 0x7F80_0000 {
        format.inf_code()
    } else if a < MIN_NORMAL_BITS {
        0
    } else {
        encode_positive((f32::from_bits(a) * scale).to_bits(), format)
    };
    sign | mag
}

/// The magnitude code of a finite non-negative f32 given by its bits.
fn encode_positive(y: u32, format: Fp8Format) -> u8 {
    let m = format.mantissa_bits();
    let ef = y >> 23; // biased f32 exponent
    let mant = y & 0x7F_FFFF;
    let first_normal = 128 - format.bias(); // f32 biased exponent of the format's smallest normal
    let code = if ef >= first_normal {
        let mut code = ((ef - (127 - format.bias())) << m) | (mant >> (23 - m));
        let rem = mant & ((1 << (23 - m)) - 1);
        let half = 1 << (22 - m);
        if rem > half || (rem == half && code & 1 == 1) {
            code += 1;
        }
        code.min(format.max_code() as u32)
    } else if ef == 0 {
        0
    } else {
        // Subnormal target: units of the smallest subnormal, 2^(emin - m).
        let shift = (first_normal - ef) + (23 - m);
        if shift > 24 {
            0
        } else {
            let full = (1 << 23) | mant;
            let mut q = full >> shift;
            let rem = full & ((1 << shift) - 1);
            let half = 1 << (shift - 1);
            if rem > half || (rem == half && q & 1 == 1) {
                q += 1;
            }
            q
        }
    };
    code as u8
}

/// The value of an FP8 code (exact in f32).
pub fn decode(code: u8, format: Fp8Format) -> f32 {
    let m = format.mantissa_bits();
    let mag = (code & 0x7F) as u32;
    let e = mag >> m;
    let mm = mag & ((1 << m) - 1);
    let v = match format {
        Fp8Format::E4M3 if mag == 0x7F => f32::NAN,
        Fp8Format::E5M2 if e == 31 => {
            if mm == 0 {
                f32::INFINITY
            } else {
                f32::NAN
            }
        }
        _ if e == 0 => mm as f32 * format.smallest_subnormal(),
        _ => f32::from_bits(((e + 127 - format.bias()) << 23) | (mm << (23 - m))),
    };
    if code & 0x80 != 0 {
        -v
    } else {
        v
    }
}

/// `|x|` when it is a finite f32 normal number, else 0: what the amax of a tile is taken over.
pub fn amax_term(x: f32) -> f32 {
    let a = x.abs();
    if (f32::MIN_POSITIVE..=f32::MAX).contains(&a) {
        a
    } else {
        0.0
    }
}

/// `(quantization multiplier, dequantization scale)` for a tile whose amax is `amax`:
/// with `pow2`, the largest power of two `s` with `amax * s <= format max` (computed from the bits,
/// exact), else `format max / amax`; both clamped to [2^-126, 2^126]; 1 for an all-zero tile.
pub fn scales_for(amax: f32, format: Fp8Format, pow2: bool) -> (f32, f32) {
    if amax <= 0.0 {
        return (1.0, 1.0);
    }
    if pow2 {
        let bits = amax.to_bits();
        let ea = (bits >> 23) as i32;
        let k = format.max_exponent() + 127 - ea - if bits & 0x7F_FFFF > 0x60_0000 { 1 } else { 0 };
        let k = k.clamp(-126, 126);
        (
            f32::from_bits(((k + 127) as u32) << 23),
            f32::from_bits(((127 - k) as u32) << 23),
        )
    } else {
        let s = (format.max() / amax).clamp(f32::from_bits(1 << 23), f32::from_bits(253 << 23));
        (s, 1.0 / s)
    }
}

/// Where in the scales of a `[rows, k]` matrix quantized with `granularity` (`k_tiles` =
/// ceil(k / 128) scale columns per scale row) the scale of element `(i, j)` lies.
fn scale_index(granularity: Fp8Granularity, i: usize, j: usize, k_tiles: usize) -> usize {
    match granularity {
        Fp8Granularity::Tile1x128 => i * k_tiles + j / TILE,
        Fp8Granularity::Block128 => (i / TILE) * k_tiles + j / TILE,
        Fp8Granularity::Tensor => 0,
    }
}

/// Quantizes a row-major `[rows_in, cols_in]` f32 matrix as the kernels do: returns the payload
/// words (4 codes per little-endian u32, rows of `k_pad / 4` words) and the dequantization scales.
/// With `spec.transpose` the quantized matrix is the transpose (`[cols_in, rows_in]`).
pub fn quantize(
    data: &[f32],
    rows_in: usize,
    cols_in: usize,
    spec: &QuantSpec,
) -> (Vec<u32>, Vec<f32>) {
    quantize_scaled(data, rows_in, cols_in, spec, None)
}

/// [`quantize`] with per-tensor `spec` (panics otherwise), scaled for `amax` instead of the
/// data's own (delayed scaling: values above it saturate).
pub fn quantize_with_amax(
    data: &[f32],
    rows_in: usize,
    cols_in: usize,
    spec: &QuantSpec,
    amax: f32,
) -> (Vec<u32>, Vec<f32>) {
    assert_eq!(
        spec.granularity,
        Fp8Granularity::Tensor,
        "quantize reference: a given amax needs per-tensor scaling"
    );
    quantize_scaled(data, rows_in, cols_in, spec, Some(amax))
}

/// The amax per-tensor scaling takes of `data`: its largest finite normal `|x|` (0 if none).
pub fn tensor_amax(data: &[f32]) -> f32 {
    data.iter().fold(0.0f32, |m, &x| m.max(amax_term(x)))
}

fn quantize_scaled(
    data: &[f32],
    rows_in: usize,
    cols_in: usize,
    spec: &QuantSpec,
    given_amax: Option<f32>,
) -> (Vec<u32>, Vec<f32>) {
    assert_eq!(
        data.len(),
        rows_in * cols_in,
        "quantize reference: data length"
    );
    let (rows, k) = if spec.transpose {
        (cols_in, rows_in)
    } else {
        (rows_in, cols_in)
    };
    let at = |i: usize, j: usize| {
        if spec.transpose {
            data[j * cols_in + i]
        } else {
            data[i * cols_in + j]
        }
    };
    let k_tiles = k.div_ceil(TILE);
    let words = k_tiles * TILE / 4;
    let mut amax = vec![0.0f32; spec.scale_rows(rows) * spec.scale_cols(k)];
    let tile_index = |i: usize, j: usize| scale_index(spec.granularity, i, j, k_tiles);
    for i in 0..rows {
        for j in 0..k {
            let t = tile_index(i, j);
            amax[t] = amax[t].max(amax_term(at(i, j)));
        }
    }
    if let Some(given) = given_amax {
        amax.fill(given);
    }
    let factors: Vec<(f32, f32)> = amax
        .iter()
        .map(|&a| scales_for(a, spec.format, spec.pow2))
        .collect();
    let mut payload = vec![0u32; rows * words];
    for i in 0..rows {
        for j in 0..k {
            let code = encode(at(i, j), factors[tile_index(i, j)].0, spec.format);
            payload[i * words + j / 4] |= (code as u32) << (8 * (j % 4));
        }
    }
    (payload, factors.iter().map(|f| f.1).collect())
}

/// The dequantized `[rows, k]` matrix of a payload and scales made by [`quantize`].
pub fn dequantize(
    payload: &[u32],
    scales: &[f32],
    rows: usize,
    k: usize,
    spec: &QuantSpec,
) -> Vec<f32> {
    let k_tiles = k.div_ceil(TILE);
    let words = k_tiles * TILE / 4;
    let mut out = Vec::with_capacity(rows * k);
    for i in 0..rows {
        for j in 0..k {
            let code = (payload[i * words + j / 4] >> (8 * (j % 4))) as u8;
            let s = scales[scale_index(spec.granularity, i, j, k_tiles)];
            out.push(decode(code, spec.format) * s);
        }
    }
    out
}

/// Partial health rows `[amax, nonzero, underflow, saturated]` of the row-major `[r, c]` `data`
/// quantized as `spec` says (see [`super::Fp8Health`] and [`health_rows`]).
pub fn health(data: &[f32], r: usize, c: usize, spec: &QuantSpec) -> Vec<f32> {
    let (payload, scales) = quantize(data, r, c, spec);
    health_rows(data, r, c, spec, &payload, &scales)
}

/// Partial health rows `[amax, nonzero, underflow, saturated]` of the row-major `[r, c]` `data`
/// against its quantization `(payload, scales)` under `spec` (the view `spec.transpose` picks):
/// the largest finite `|x|`, the finite nonzero values, those whose code is a zero, and the finite
/// values above the format's clip threshold times their tile's dequantization scale. One row per
/// 2^20 elements (so that f32 counts stay exact), at least one.
pub fn health_rows(
    data: &[f32],
    r: usize,
    c: usize,
    spec: &QuantSpec,
    payload: &[u32],
    scales: &[f32],
) -> Vec<f32> {
    let (rows, k) = if spec.transpose { (c, r) } else { (r, c) };
    let k_tiles = k.div_ceil(TILE);
    let words = k_tiles * TILE / 4;
    let clip = spec.format.clip_threshold();
    let chunk = 1 << 20;
    let mut out = Vec::new();
    let mut row = [0f32; 4];
    for n in 0..rows * k {
        let (i, j) = (n / k, n % k);
        let x = if spec.transpose {
            data[j * c + i]
        } else {
            data[i * c + j]
        };
        let code = (payload[i * words + j / 4] >> (8 * (j % 4))) as u8;
        let d = scales[scale_index(spec.granularity, i, j, k_tiles)];
        if x.is_finite() {
            let a = x.abs();
            row[0] = row[0].max(a);
            if a != 0.0 {
                row[1] += 1.0;
                if code & 0x7F == 0 {
                    row[2] += 1.0;
                }
            }
            if a > d * clip {
                row[3] += 1.0;
            }
        }
        if (n + 1) % chunk == 0 {
            out.extend_from_slice(&row);
            row = [0f32; 4];
        }
    }
    if out.is_empty() || (rows * k) % chunk != 0 {
        out.extend_from_slice(&row);
    }
    out
}
