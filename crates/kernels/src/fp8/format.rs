//! FP8 formats, how elements share a scale, and a quantization spec.

use super::kernel;

/// Scales cover 128 elements of the reduction axis (and 128 rows for blocks).
pub const TILE: usize = 128;

/// An FP8 encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// 4 exponent bits, 3 mantissa bits, max 448, no infinity (forward operands).
    E4M3,
    /// 5 exponent bits, 2 mantissa bits, max 57344 (wider range: gradients in the hybrid setting).
    E5M2,
}

impl Fp8Format {
    /// Largest finite value.
    pub fn max(self) -> f32 {
        kernel::max_value(self.consts())
    }
    /// Magnitude above which a scaled value is clipped rather than rounded to the largest code:
    /// the max plus half an ulp of the top binade (E4M3 464, E5M2 61440).
    pub fn clip_threshold(self) -> f32 {
        let c = self.consts();
        self.max() + 2f32.powi(c.max_exp as i32 - c.mant as i32 - 1)
    }
    /// Smallest positive (subnormal) value.
    pub fn smallest_subnormal(self) -> f32 {
        f32::from_bits((128 - self.bias() - self.mantissa_bits()) << 23)
    }
    pub(crate) fn mantissa_bits(self) -> u32 {
        self.consts().mant
    }
    pub(crate) fn bias(self) -> u32 {
        self.consts().bias
    }
    pub(crate) fn max_code(self) -> u8 {
        self.consts().max_code as u8
    }
    pub(crate) fn inf_code(self) -> u8 {
        self.consts().inf_code as u8
    }
    pub(crate) fn max_exponent(self) -> i32 {
        self.consts().max_exp as i32
    }
    pub(crate) fn consts(self) -> kernel::FormatConsts {
        match self {
            Fp8Format::E4M3 => kernel::FormatConsts {
                mant: 3,
                bias: 7,
                max_code: 0x7E,
                inf_code: 0x7F,
                max_exp: 8,
            },
            Fp8Format::E5M2 => kernel::FormatConsts {
                mant: 2,
                bias: 15,
                max_code: 0x7B,
                inf_code: 0x7C,
                max_exp: 15,
            },
        }
    }
}

/// Which elements share a scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Granularity {
    /// One scale per row per 128 elements of `k`: scales `[rows, k_tiles]`.
    Tile1x128,
    /// One scale per 128 x 128 block: scales `[ceil(rows / 128), k_tiles]`.
    Block128,
    /// One scale for the tensor: scales `[1, 1]`.
    Tensor,
}

impl Fp8Granularity {
    /// The code the dequantize and health kernels take at compile time for this granularity.
    pub(crate) fn kernel_code(self) -> u32 {
        match self {
            Fp8Granularity::Tile1x128 => 0,
            Fp8Granularity::Block128 => 1,
            Fp8Granularity::Tensor => 2,
        }
    }
}

/// How to quantize a matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QuantSpec {
    pub format: Fp8Format,
    pub granularity: Fp8Granularity,
    /// Round scales down to powers of two (exact scaling; the default).
    pub pow2: bool,
    /// Quantize the transpose of the input: `[r, c]` becomes `[c, r]` quantized along `r`.
    pub transpose: bool,
}

impl QuantSpec {
    pub fn new(format: Fp8Format, granularity: Fp8Granularity) -> Self {
        Self {
            format,
            granularity,
            pow2: true,
            transpose: false,
        }
    }
    pub fn transposed(mut self, transpose: bool) -> Self {
        self.transpose = transpose;
        self
    }
    pub fn with_pow2(mut self, pow2: bool) -> Self {
        self.pow2 = pow2;
        self
    }
    /// Rows of the scale tensor for a quantized matrix of `rows` rows.
    pub fn scale_rows(&self, rows: usize) -> usize {
        match self.granularity {
            Fp8Granularity::Tile1x128 => rows,
            Fp8Granularity::Block128 => rows.div_ceil(TILE),
            Fp8Granularity::Tensor => 1,
        }
    }
    /// Columns of the scale tensor for a reduction length `k`.
    pub fn scale_cols(&self, k: usize) -> usize {
        match self.granularity {
            Fp8Granularity::Tensor => 1,
            _ => k.div_ceil(TILE),
        }
    }
}

/// How a pair quantizer ([`crate::fp8_quantize_pair`]) scales the two orientations of an `[r, c]`
/// matrix: as `spec` says for the matrix as stored (quantized along `c`), and for its transpose
/// (along `r`) with `spec`'s format and rounding, per 128 x 128 block instead of per 1x128 tile
/// where `transposed_blocks` is set and `spec` has 1x128 tiles (the wgrad operand quantized per
/// block, [`crate::Fp8WgradBlocks`]). `spec.transpose` is ignored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PairSpec {
    pub spec: QuantSpec,
    pub transposed_blocks: bool,
}

impl PairSpec {
    /// The spec of the matrix as stored.
    pub fn stored(&self) -> QuantSpec {
        self.spec.transposed(false)
    }
    /// The spec of the transpose.
    pub fn transposed(&self) -> QuantSpec {
        let mut t = self.spec.transposed(true);
        if self.mixed() {
            t.granularity = Fp8Granularity::Block128;
        }
        t
    }
    /// The spec of one orientation: [`Self::transposed`] if `transpose`, else [`Self::stored`].
    pub fn oriented(&self, transpose: bool) -> QuantSpec {
        if transpose {
            self.transposed()
        } else {
            self.stored()
        }
    }
    /// Whether the two orientations differ in granularity (1x128 tiles as stored, 128 x 128
    /// blocks transposed).
    pub fn mixed(&self) -> bool {
        self.transposed_blocks && self.spec.granularity == Fp8Granularity::Tile1x128
    }
}

impl From<QuantSpec> for PairSpec {
    /// Both orientations scaled alike.
    fn from(spec: QuantSpec) -> Self {
        Self {
            spec,
            transposed_blocks: false,
        }
    }
}
