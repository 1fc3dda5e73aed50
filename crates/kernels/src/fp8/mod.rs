//! FP8 quantization with fine-grained scales, FP8 GEMM and an FP8 linear layer (experimental).
//!
//! **Quantizer** ([`fp8_quantize`]): a 2-D matrix (or its transpose) is quantized along its
//! reduction axis `k` with one scale per tile:
//! - [`Fp8Granularity::Tile1x128`]: per row per 128 columns (activations and gradients);
//! - [`Fp8Granularity::Block128`]: per 128 x 128 block (weights: the same codes serve the matrix
//!   and its transpose);
//! - [`Fp8Granularity::Tensor`]: one scale for the whole tensor (per-tensor current scaling).
//!
//! The scale comes from the tile's amax (the largest finite |x|): `s = max / amax`, by default
//! rounded down to a power of two so that scaling is exact. Codes are rounded to nearest-even and
//! saturate at the format's largest finite value. On purpose:
//! - an all-zero tile gets scale 1 and zero codes;
//! - NaN inputs give NaN codes and infinities give +-inf (E5M2) or NaN (E4M3, which has no inf),
//!   so a non-finite value shows up in the GEMM output instead of being clipped; they do not enter
//!   the amax, so the rest of the tile keeps its resolution;
//! - f32 subnormal inputs (|x| < 1.2e-38) quantize to zero, on every device.
//!
//! The payload is stored as an Int tensor `[rows, k_pad / 4]` whose elements hold four codes in
//! little-endian byte order (Burn has no FP8 dtype; `k_pad` is `k` rounded up to 128, padded with
//! zero codes), the scales as an f32 tensor of *dequantization* factors (`1 / s`). The kernels
//! encode with integer operations on the f32 bits, so every backend produces the same bytes as the
//! CPU [`reference`]. (With `pow2 = false` the scale is `max / amax`, a division: bit-identical
//! where division is correctly rounded, as on CUDA and lavapipe; WGSL allows 2.5 ulp.)
//!
//! **GEMM** ([`fp8_gemm`]): `a [m, k] x b [n, k]^T -> [m, n]`, both operands quantized along `k`.
//! [`Fp8GemmPath::CublasLt`] (cuBLASLt's block-scaled FP8 GEMM) is the default on Hopper GPUs
//! (CUDA, cuBLASLt 12.9+) and forced with `BURNMIX_FP8_GEMM=cublaslt`.
//! [`Fp8GemmPath::Dequantize`] (the default elsewhere, the reference, and what takes the operands
//! cuBLASLt refuses) expands the codes times their scales into bf16 (bf16 output, power-of-two
//! scales) or f32, exactly, and multiplies with Burn's matmul (f32 accumulation): the products are
//! the FP8 products, the speed is not FP8 tensor-core speed. [`Fp8GemmPath::TensorCores`]
//! (`mma.sync` m16n8k32 on E4M3, CUDA sm_89+; correct on an H100, but emulated and slower than
//! bf16 there) is opt-in with `BURNMIX_FP8_GEMM=mma`. [`fp8_gemm_path`] says which path a pair of
//! operands takes and [`fp8_gemm_on`] forces one.
//!
//! **Linear** ([`fp8_linear`]): `x [t, in] w [in, out]` with the fprop, dgrad and wgrad GEMMs in
//! FP8, each operand quantized along its own reduction axis (see [`Fp8LinearConfig`]).

pub(crate) mod backward;
pub(crate) mod forward;
pub(crate) mod kernel;
mod mma;
pub use mma::MmaShape;
pub mod reference;

use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, FloatDType, Int, Tensor, TensorData, TensorPrimitive};

use crate::settings::Fp8GemmChoice;
use crate::Backend;

/// Scales cover 128 elements of the reduction axis (and 128 rows for blocks).
pub const TILE: usize = 128;

/// The tensor-core GEMM's cube shape ([`crate::settings::Settings::fp8_mma_shape`], else
/// [`MmaShape::DEFAULT`]).
pub(crate) fn mma_shape() -> MmaShape {
    crate::settings::read(|s| s.fp8_mma_shape).unwrap_or(MmaShape::DEFAULT)
}

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

/// A quantized matrix `[rows, k]` (see the module docs for the layout).
#[derive(Clone, Debug)]
pub struct Fp8Tensor<B: BurnBackend> {
    /// `[rows, k_pad / 4]`: four little-endian codes per element.
    pub payload: Tensor<B, 2, Int>,
    /// f32 dequantization factors (see [`QuantSpec::scale_rows`], [`QuantSpec::scale_cols`]).
    pub scales: Tensor<B, 2>,
    pub rows: usize,
    pub k: usize,
    pub spec: QuantSpec,
}

impl<B: Backend> Fp8Tensor<B> {
    /// `k` rounded up to a multiple of 128 (the payload's width in codes).
    pub fn k_padded(&self) -> usize {
        self.k.div_ceil(TILE) * TILE
    }

    /// The values the codes stand for, `[rows, k]`, in `dtype` (exact in f32 and bf16).
    pub fn dequantize(&self, dtype: FloatDType) -> Tensor<B, 2> {
        self.dequantize_to(self.k, dtype)
    }

    fn dequantize_to(&self, k_out: usize, dtype: FloatDType) -> Tensor<B, 2> {
        let p = B::fp8_dequantize(
            self.payload.clone().into_primitive(),
            self.scales.clone().into_primitive().tensor(),
            self.rows,
            k_out,
            &self.spec,
            dtype,
        );
        Tensor::from_primitive(TensorPrimitive::Float(p))
    }

    /// The codes on the host, row-major `[rows, k_pad]`.
    pub fn codes(&self) -> Vec<u8> {
        words_of_tensor(&self.payload)
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect()
    }
}

/// The payload words of a payload tensor, on the host.
pub fn words_of_tensor<B: BurnBackend>(payload: &Tensor<B, 2, Int>) -> Vec<u32> {
    words_of(payload.clone().into_data())
}

/// The payload words of an Int tensor's data, whatever its integer dtype.
pub(crate) fn words_of(data: TensorData) -> Vec<u32> {
    match data.dtype {
        DType::U32 => data.to_vec::<u32>().expect("u32 payload"),
        DType::I32 => data
            .to_vec::<i32>()
            .expect("i32 payload")
            .into_iter()
            .map(|w| w as u32)
            .collect(),
        DType::I64 => data
            .to_vec::<i64>()
            .expect("i64 payload")
            .into_iter()
            .map(|w| w as u32)
            .collect(),
        other => panic!(
            "kernels::fp8: a payload tensor has dtype {other:?}; expected a 32-bit integer tensor"
        ),
    }
}

/// The values of a float tensor on the host as f32, row-major (`what` names it if they cannot be
/// read).
fn f32_values<B: BurnBackend, const D: usize>(t: Tensor<B, D>, what: &str) -> Vec<f32> {
    t.cast(FloatDType::F32)
        .into_data()
        .to_vec::<f32>()
        .unwrap_or_else(|e| panic!("f32 {what}: {e:?}"))
}

/// Quantizes the 2-D `x` (f32, f16 or bf16) as `spec` says.
pub fn fp8_quantize<B: Backend>(x: Tensor<B, 2>, spec: QuantSpec) -> Fp8Tensor<B> {
    let [r, c] = x.dims();
    let (rows, k) = if spec.transpose { (c, r) } else { (r, c) };
    let (payload, scales) = B::fp8_quantize(x.into_primitive().tensor(), &spec);
    Fp8Tensor {
        payload: Tensor::from_primitive(payload),
        scales: Tensor::from_primitive(TensorPrimitive::Float(scales)),
        rows,
        k,
        spec,
    }
}

/// How [`fp8_quantize_pair`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8PairPath {
    /// One kernel reads `x` once and writes both orientations (`CubeBackend`; elsewhere, and for
    /// matrices beyond its launch grid, two passes).
    Fused,
    /// Two quantizer passes, one per orientation.
    Separate,
}

/// The path [`fp8_quantize_pair`] takes for `spec` ([`crate::settings::Settings::fp8_pair`],
/// `BURNMIX_FP8_PAIR`, chooses): by default fused for 128x128 blocks and per-tensor scales, and
/// two passes for 1x128 tiles, where the fused kernel measured slower on an H200 (see
/// `docs/results.md`).
pub fn fp8_pair_path(spec: &QuantSpec) -> Fp8PairPath {
    match crate::settings::read(|s| s.fp8_pair) {
        Some(path) => path,
        None if spec.granularity == Fp8Granularity::Tile1x128 => Fp8PairPath::Separate,
        None => Fp8PairPath::Fused,
    }
}

/// Quantizes the 2-D `x` `[r, c]` in both orientations: `(as stored, transposed)`, the first
/// `[r, c]` quantized along `c` as `spec.transposed(false)` says, the second `[c, r]` along `r` as
/// `spec.transposed(true)` says (`spec.transpose` itself is ignored). Each equals the matching
/// [`fp8_quantize`] bit for bit, on the path [`fp8_pair_path`] names. The FP8 linear layer uses it
/// for the operands that two of its GEMMs read along different axes (`x`, `dy` and the weight).
pub fn fp8_quantize_pair<B: Backend>(
    x: Tensor<B, 2>,
    spec: QuantSpec,
) -> (Fp8Tensor<B>, Fp8Tensor<B>) {
    let path = fp8_pair_path(&spec);
    fp8_quantize_pair_on(x, spec, path)
}

/// [`fp8_quantize_pair`] on a given path.
pub fn fp8_quantize_pair_on<B: Backend>(
    x: Tensor<B, 2>,
    spec: QuantSpec,
    path: Fp8PairPath,
) -> (Fp8Tensor<B>, Fp8Tensor<B>) {
    let [r, c] = x.dims();
    let fused = path == Fp8PairPath::Fused;
    let ((p, s), (pt, st)) = B::fp8_quantize_pair(x.into_primitive().tensor(), &spec, fused);
    let q = |payload, scales, rows, k, spec| Fp8Tensor {
        payload: Tensor::from_primitive(payload),
        scales: Tensor::from_primitive(TensorPrimitive::Float(scales)),
        rows,
        k,
        spec,
    };
    (
        q(p, s, r, c, spec.transposed(false)),
        q(pt, st, c, r, spec.transposed(true)),
    )
}

/// How [`fp8_gemm`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8GemmPath {
    /// Codes times scales expanded exactly to bf16 or f32, then Burn's matmul (f32 accumulation).
    Dequantize,
    /// `mma.sync` m16n8k32 on E4M3 codes, f32 accumulation, scales applied every 128 of K
    /// (opt-in: [`crate::settings::Settings::fp8_gemm`]).
    TensorCores,
    /// NVIDIA cuBLASLt's FP8 GEMM with the 1x128 / 128x128 block scales (or per-tensor scales)
    /// applied by cuBLASLt (CUDA, cuBLASLt >= 12.9 for block scales, Hopper; the default there).
    /// Needs m and n multiples of 8, not both operands E5M2 and not both 128x128 blocks; other
    /// operands take the dequantize path.
    CublasLt,
}

/// The path [`fp8_gemm`] tries first for these operands on this backend
/// ([`crate::settings::Settings::fp8_gemm`], `BURNMIX_FP8_GEMM`, chooses):
/// - unset or `auto`: cuBLASLt where the device has its block-scaled FP8 GEMM (CUDA, Hopper,
///   cuBLASLt 12.9+), else the dequantize path;
/// - `cublaslt`: cuBLASLt wherever it applies;
/// - `mma`: the `mma.sync` tensor-core kernel where the device has it and both operands are E4M3
///   with 1x128 (or per-tensor) scales for `a` and 128x128 (or per-tensor) for `b`;
/// - `dequantize`: the dequantize path (the reference).
///
/// Operands a path does not take (shapes, formats) are computed on the dequantize path.
pub fn fp8_gemm_path<B: Backend>(a: &Fp8Tensor<B>, b: &Fp8Tensor<B>) -> Fp8GemmPath {
    match crate::settings::read(|s| s.fp8_gemm) {
        Fp8GemmChoice::Path(Fp8GemmPath::TensorCores) if mma_applies(a, b) => {
            Fp8GemmPath::TensorCores
        }
        Fp8GemmChoice::Path(Fp8GemmPath::TensorCores | Fp8GemmPath::Dequantize) => {
            Fp8GemmPath::Dequantize
        }
        Fp8GemmChoice::Path(Fp8GemmPath::CublasLt) => Fp8GemmPath::CublasLt,
        Fp8GemmChoice::Auto => {
            if B::fp8_cublaslt_supported(&a.payload.clone().into_primitive()) {
                Fp8GemmPath::CublasLt
            } else {
                Fp8GemmPath::Dequantize
            }
        }
    }
}

fn mma_applies<B: Backend>(a: &Fp8Tensor<B>, b: &Fp8Tensor<B>) -> bool {
    let e4m3 = a.spec.format == Fp8Format::E4M3 && b.spec.format == Fp8Format::E4M3;
    let tiles = matches!(
        a.spec.granularity,
        Fp8Granularity::Tile1x128 | Fp8Granularity::Tensor
    ) && matches!(
        b.spec.granularity,
        Fp8Granularity::Block128 | Fp8Granularity::Tensor
    );
    e4m3 && tiles && B::fp8_mma_supported(&a.payload.clone().into_primitive())
}

/// [`Backend::fp8_gemm_mma`] and [`Backend::fp8_gemm_cublaslt`].
type Fp8GemmFn<B> = fn(
    IntTensor<B>,
    FloatTensor<B>,
    &QuantSpec,
    IntTensor<B>,
    FloatTensor<B>,
    &QuantSpec,
    usize,
    usize,
    FloatDType,
) -> Option<FloatTensor<B>>;

/// `a [m, k] x b [n, k]^T -> [m, n]` in `out` dtype, from two matrices quantized along the same
/// `k`, on the path [`fp8_gemm_path`] names.
pub fn fp8_gemm<B: Backend>(a: &Fp8Tensor<B>, b: &Fp8Tensor<B>, out: FloatDType) -> Tensor<B, 2> {
    let path = fp8_gemm_path(a, b);
    // cuBLASLt's constraints (shapes, formats) are checked by trying; what it does not take is
    // computed on the dequantize path.
    fp8_gemm_on(a, b, out, path)
        .or_else(|| fp8_gemm_on(a, b, out, Fp8GemmPath::Dequantize))
        .expect("the dequantize path applies to every pair of operands")
}

/// [`fp8_gemm`] on a given path; `None` when the path does not apply to these operands here.
pub fn fp8_gemm_on<B: Backend>(
    a: &Fp8Tensor<B>,
    b: &Fp8Tensor<B>,
    out: FloatDType,
    path: Fp8GemmPath,
) -> Option<Tensor<B, 2>> {
    if a.k != b.k {
        panic!(
            "kernels::fp8_gemm: a is [{}, {}] and b is [{}, {}] (both [rows, k]); their reduction lengths k must match",
            a.rows, a.k, b.rows, b.k
        );
    }
    // The two FP8 tensor-core paths take the same operands.
    let fp8_path = match path {
        Fp8GemmPath::TensorCores => Some(B::fp8_gemm_mma as Fp8GemmFn<B>),
        Fp8GemmPath::CublasLt => Some(B::fp8_gemm_cublaslt as Fp8GemmFn<B>),
        Fp8GemmPath::Dequantize => None,
    };
    match fp8_path {
        Some(gemm) => gemm(
            a.payload.clone().into_primitive(),
            a.scales.clone().into_primitive().tensor(),
            &a.spec,
            b.payload.clone().into_primitive(),
            b.scales.clone().into_primitive().tensor(),
            &b.spec,
            a.rows,
            b.rows,
            out,
        )
        .map(|c| Tensor::from_primitive(TensorPrimitive::Float(c))),
        None => {
            // Code x power-of-two scale is exact in bf16; other scales need f32.
            let bf16 = out == FloatDType::BF16 && a.spec.pow2 && b.spec.pow2;
            let compute = if bf16 {
                FloatDType::BF16
            } else {
                FloatDType::F32
            };
            let k_pad = a.k_padded();
            let da = a.dequantize_to(k_pad, compute);
            let db = b.dequantize_to(k_pad, compute);
            Some(da.matmul(db.transpose()).cast(out))
        }
    }
}

/// Which GEMMs of an FP8 linear layer run in FP8, and how operands are scaled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fp8LinearConfig {
    /// `y = x w`.
    pub fprop: bool,
    /// `dx = dy w^T`.
    pub dgrad: bool,
    /// `dw = x^T dy`.
    pub wgrad: bool,
    /// Format of `x` and `w`.
    pub forward_format: Fp8Format,
    /// Format of `dy` (E5M2 in the "hybrid" setting).
    pub grad_format: Fp8Format,
    /// Tiles (1x128 activations and gradients, 128x128 weights) or one scale per tensor.
    pub per_tensor: bool,
    /// Power-of-two scales.
    pub pow2: bool,
}

impl Default for Fp8LinearConfig {
    fn default() -> Self {
        Self {
            fprop: true,
            dgrad: true,
            wgrad: true,
            forward_format: Fp8Format::E4M3,
            grad_format: Fp8Format::E4M3,
            per_tensor: false,
            pow2: true,
        }
    }
}

impl Fp8LinearConfig {
    /// Spec of an activation (`x`) operand.
    pub fn act_spec(&self, transpose: bool) -> QuantSpec {
        self.spec(self.forward_format, Fp8Granularity::Tile1x128, transpose)
    }
    /// Spec of the weight operand.
    pub fn weight_spec(&self, transpose: bool) -> QuantSpec {
        self.spec(self.forward_format, Fp8Granularity::Block128, transpose)
    }
    /// Spec of an output-gradient (`dy`) operand.
    pub fn grad_spec(&self, transpose: bool) -> QuantSpec {
        self.spec(self.grad_format, Fp8Granularity::Tile1x128, transpose)
    }
    fn spec(&self, format: Fp8Format, tiles: Fp8Granularity, transpose: bool) -> QuantSpec {
        let granularity = if self.per_tensor {
            Fp8Granularity::Tensor
        } else {
            tiles
        };
        QuantSpec {
            format,
            granularity,
            pow2: self.pow2,
            transpose,
        }
    }
}

/// Where FP8 health samples go: `(name, health)` entries, appended as they are measured; each
/// health stays on the device until [`PendingHealth::resolve`] reads it.
pub type HealthSink = std::sync::Arc<std::sync::Mutex<Vec<(String, PendingHealth)>>>;

/// A layer's handle on a [`HealthSink`]: [`fp8_linear_probed`] records its input as `{name}.input`
/// and, under `Autodiff`, its output gradient as `{name}.grad_output`, each as the GEMM that
/// consumes it quantizes it.
#[derive(Clone, Debug)]
pub struct Fp8Probe {
    pub name: String,
    pub sink: HealthSink,
}

impl Fp8Probe {
    pub(crate) fn record<B: Backend>(&self, what: &str, x: Tensor<B, 2>, spec: QuantSpec) {
        let health = fp8_health_pending(x, spec);
        if let Ok(mut sink) = self.sink.lock() {
            sink.push((format!("{}.{what}", self.name), health));
        }
    }
}

/// `x [t, in] w [in, out] -> [t, out]` with the GEMMs `cfg` selects in FP8 (output in `x`'s dtype;
/// `x` and `w` must share a dtype). Under `Autodiff` the backward runs dgrad and wgrad as
/// configured.
pub fn fp8_linear<B: Backend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    cfg: &Fp8LinearConfig,
) -> Tensor<B, 2> {
    fp8_linear_probed(x, w, cfg, None)
}

/// [`fp8_linear`], recording the FP8 health of the input (and, under `Autodiff`, of the output
/// gradient) into `probe` when given. Each sample costs a quantization and a few reductions.
pub fn fp8_linear_probed<B: Backend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    cfg: &Fp8LinearConfig,
    probe: Option<&Fp8Probe>,
) -> Tensor<B, 2> {
    let [t, d_in] = x.dims();
    let [w_in, _] = w.dims();
    if d_in != w_in {
        panic!(
            "kernels::fp8_linear: x is [{t}, {d_in}] but w is {:?}; w must be [{d_in}, out]",
            w.dims()
        );
    }
    if x.dtype() != w.dtype() {
        panic!(
            "kernels::fp8_linear: x is {:?} but w is {:?}; cast one first",
            x.dtype(),
            w.dtype()
        );
    }
    if let Some(p) = probe {
        p.record("input", x.clone().detach(), cfg.act_spec(false));
    }
    Tensor::from_primitive(TensorPrimitive::Float(B::fp8_linear(
        x.into_primitive().tensor(),
        w.into_primitive().tensor(),
        cfg,
        probe.cloned(),
    )))
}

/// How well a tensor fits its FP8 format under a quantization spec.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fp8Health {
    /// Largest finite |x|.
    pub amax: f64,
    /// Share of the nonzero finite values that quantize to zero.
    pub underflow: f64,
    /// Share of the finite values clipped at the largest code of their tile (beyond the max by more
    /// than half an ulp). Zero by construction under current (amax) scaling, which maps the amax to
    /// at most the max; nonzero only from non-finite inputs' neighbours or future delayed scaling.
    pub saturated: f64,
}

impl Fp8Health {
    /// Combines partial rows `[amax, nonzero, underflow, saturated]` (as
    /// [`Fp8Ops::fp8_health_partials`] returns them) of a tensor of `elements` elements.
    pub fn from_rows(rows: &[f32], elements: usize) -> Self {
        let (mut amax, mut nonzero, mut under, mut sat) = (0f64, 0f64, 0f64, 0f64);
        for r in rows.chunks_exact(4) {
            amax = amax.max(r[0] as f64);
            nonzero += r[1] as f64;
            under += r[2] as f64;
            sat += r[3] as f64;
        }
        Fp8Health {
            amax,
            underflow: under / nonzero.max(1.0),
            saturated: sat / (elements.max(1) as f64),
        }
    }
}

/// An [`Fp8Health`] measured on the device and not read yet: [`PendingHealth::resolve`] reads it
/// (a small transfer, which waits for the work queued before it).
pub struct PendingHealth(Box<dyn FnOnce() -> Fp8Health + Send>);

impl PendingHealth {
    /// Reads the health back.
    pub fn resolve(self) -> Fp8Health {
        (self.0)()
    }
}

impl std::fmt::Debug for PendingHealth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PendingHealth")
    }
}

/// [`Fp8Health`] of the 2-D `x` quantized as `spec` says: the quantizer, then one kernel that
/// reads `x` and the codes once ([`Fp8Ops::fp8_health_partials`]); reading the result back waits
/// for the device.
pub fn fp8_health<B: Backend>(x: Tensor<B, 2>, spec: QuantSpec) -> Fp8Health {
    fp8_health_pending(x, spec).resolve()
}

/// [`fp8_health`] without waiting: the work is queued and the result read when resolved (the FP8
/// layers record their operands' health this way in the middle of a step).
pub fn fp8_health_pending<B: Backend>(x: Tensor<B, 2>, spec: QuantSpec) -> PendingHealth {
    let [r, c] = x.dims();
    let q = fp8_quantize(x.clone(), spec);
    let rows = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(B::fp8_health_partials(
        x.into_primitive().tensor(),
        q.payload.into_primitive(),
        q.scales.into_primitive().tensor(),
        &spec,
    )));
    PendingHealth(Box::new(move || {
        let rows = rows
            .cast(FloatDType::F32)
            .into_data()
            .to_vec::<f32>()
            .unwrap_or_default();
        Fp8Health::from_rows(&rows, r * c)
    }))
}

/// The FP8 ops on a backend ([`fp8_quantize`], [`fp8_gemm`], [`fp8_linear`]). The defaults run
/// the CPU reference codec and report the device paths as absent; `CubeBackend` overrides them
/// with the quantizer kernels and the tensor-core and cuBLASLt GEMMs, and `Autodiff` records the
/// FP8 linear layer's backward.
pub trait Fp8Ops: BurnBackend {
    /// `(payload, scales)` of [`fp8_quantize`] for a 2-D `x` (the CPU reference by default).
    fn fp8_quantize(
        x: FloatTensor<Self>,
        spec: &QuantSpec,
    ) -> (IntTensor<Self>, FloatTensor<Self>) {
        let t = Tensor::<Self, 2>::from_primitive(TensorPrimitive::Float(x));
        let [r, c] = t.dims();
        let device = t.device();
        let data = f32_values(t, "data");
        let (words, scales) = reference::quantize(&data, r, c, spec);
        let (rows, k) = if spec.transpose { (c, r) } else { (r, c) };
        let width = k.div_ceil(TILE) * TILE / 4;
        let words: Vec<i32> = words.into_iter().map(|w| w as i32).collect();
        let payload =
            Tensor::<Self, 2, Int>::from_data(TensorData::new(words, [rows, width]), &device);
        let shape = [spec.scale_rows(rows), spec.scale_cols(k)];
        let scales =
            Tensor::<Self, 2>::from_data(TensorData::new(scales, shape), (&device, DType::F32));
        (payload.into_primitive(), crate::prim(scales))
    }

    /// `((payload, scales), (payload, scales))` of [`fp8_quantize_pair`], from one kernel when
    /// `fused` and the backend has it (two [`Self::fp8_quantize`] calls by default).
    #[allow(clippy::type_complexity)]
    fn fp8_quantize_pair(
        x: FloatTensor<Self>,
        spec: &QuantSpec,
        _fused: bool,
    ) -> (
        (IntTensor<Self>, FloatTensor<Self>),
        (IntTensor<Self>, FloatTensor<Self>),
    ) {
        let stored = Self::fp8_quantize(x.clone(), &spec.transposed(false));
        (stored, Self::fp8_quantize(x, &spec.transposed(true)))
    }

    /// `[rows, k_out]` values of an FP8 payload in `dtype` (the CPU reference by default).
    fn fp8_dequantize(
        payload: IntTensor<Self>,
        scales: FloatTensor<Self>,
        rows: usize,
        k_out: usize,
        spec: &QuantSpec,
        dtype: FloatDType,
    ) -> FloatTensor<Self> {
        let payload = Tensor::<Self, 2, Int>::from_primitive(payload);
        let device = payload.device();
        let width = payload.dims()[1];
        let words = words_of(payload.into_data());
        let scales = f32_values(crate::tensor::<Self, 2>(scales), "scales");
        let full = reference::dequantize(&words, &scales, rows, width * 4, spec);
        let values: Vec<f32> = full
            .chunks(width * 4)
            .flat_map(|row| row[..k_out].iter().copied())
            .collect();
        crate::prim(
            Tensor::<Self, 2>::from_data(
                TensorData::new(values, [rows, k_out]),
                (&device, DType::F32),
            )
            .cast(dtype),
        )
    }

    /// Partial rows `[amax, nonzero, underflow, saturated]` (f32, `[n, 4]`) of the 2-D `x`
    /// against its quantization `(payload, scales)` under `spec` (see [`Fp8Health`]; the CPU
    /// [`reference::health_rows`] by default).
    fn fp8_health_partials(
        x: FloatTensor<Self>,
        payload: IntTensor<Self>,
        scales: FloatTensor<Self>,
        spec: &QuantSpec,
    ) -> FloatTensor<Self> {
        let t = Tensor::<Self, 2>::from_primitive(TensorPrimitive::Float(x));
        let [r, c] = t.dims();
        let device = t.device();
        let data = f32_values(t, "data");
        let words = words_of(Tensor::<Self, 2, Int>::from_primitive(payload).into_data());
        let scales = f32_values(crate::tensor::<Self, 2>(scales), "scales");
        let rows = reference::health_rows(&data, r, c, spec, &words, &scales);
        let n = rows.len() / 4;
        crate::prim(Tensor::<Self, 2>::from_data(
            TensorData::new(rows, [n, 4]),
            (&device, DType::F32),
        ))
    }

    /// Whether the device has the FP8 tensor-core GEMM.
    fn fp8_mma_supported(_payload: &IntTensor<Self>) -> bool {
        false
    }

    /// The FP8 tensor-core GEMM `[m, k] x [n, k]^T`, or `None` where it does not apply.
    #[allow(clippy::too_many_arguments)]
    fn fp8_gemm_mma(
        _a: IntTensor<Self>,
        _sa: FloatTensor<Self>,
        _a_spec: &QuantSpec,
        _b: IntTensor<Self>,
        _sb: FloatTensor<Self>,
        _b_spec: &QuantSpec,
        _m: usize,
        _n: usize,
        _out: FloatDType,
    ) -> Option<FloatTensor<Self>> {
        None
    }

    /// Whether the device has cuBLASLt's block-scaled FP8 GEMM (CUDA, Hopper, cuBLASLt 12.9+).
    fn fp8_cublaslt_supported(_payload: &IntTensor<Self>) -> bool {
        false
    }

    /// The FP8 GEMM `[m, k] x [n, k]^T` on cuBLASLt, or `None` where it does not apply.
    #[allow(clippy::too_many_arguments)]
    fn fp8_gemm_cublaslt(
        _a: IntTensor<Self>,
        _sa: FloatTensor<Self>,
        _a_spec: &QuantSpec,
        _b: IntTensor<Self>,
        _sb: FloatTensor<Self>,
        _b_spec: &QuantSpec,
        _m: usize,
        _n: usize,
        _out: FloatDType,
    ) -> Option<FloatTensor<Self>> {
        None
    }

    /// [`fp8_linear`]; by default its forward only (backends without autodiff). Under `Autodiff`,
    /// `probe` receives the output gradient's health in the backward.
    fn fp8_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        cfg: &Fp8LinearConfig,
        _probe: Option<Fp8Probe>,
    ) -> FloatTensor<Self>
    where
        Self: Backend,
    {
        crate::prim(backward::fprop::<Self>(
            crate::tensor(x),
            crate::tensor(w),
            cfg,
        ))
    }
}
