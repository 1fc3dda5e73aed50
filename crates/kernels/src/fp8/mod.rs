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
//!
//! **MLP** ([`fp8_mlp_scaled`], [`fp8_gelu_mlp`]): `act(x w_fc) w_proj` (GELU, or SwiGLU of a
//! packed gate and up) with its four FP8 linear GEMMs, the activation's output and, in the
//! backward, its gradient quantized by the kernel that computes them (`producer.rs`) instead of
//! written in the compute dtype and quantized by a separate pass.

pub(crate) mod backward;
mod delayed;
mod format;
pub(crate) mod forward;
mod gemm;
mod health;
pub(crate) mod kernel;
mod linear;
mod mlp;
pub(crate) mod mma;
mod native;
pub(crate) mod path;
mod producer;
pub mod reference;
mod tensor;

pub use delayed::{role, Fp8AmaxHistory, Fp8AmaxHistoryState, Fp8Record, Fp8ScaleSite};
pub use format::{Fp8Format, Fp8Granularity, PairSpec, QuantSpec, TILE};
pub(crate) use gemm::mma_shape;
pub use gemm::{fp8_gemm, fp8_gemm_on, fp8_gemm_path};
pub use health::{fp8_health, fp8_health_pending, fp8_health_pending_at, Fp8Health, PendingHealth};
pub use linear::{
    fp8_linear, fp8_linear_probed, fp8_linear_scaled, Fp8LinearConfig, Fp8Probe, Fp8WgradBlocks,
};
pub use mlp::{fp8_gelu_mlp, fp8_gelu_mlp_scaled, fp8_mlp_scaled};
pub use mma::MmaShape;
pub use path::{Fp8GemmPath, Fp8PairPath};
pub use producer::{fp8_act_quantize_pair, fp8_gelu_quantize_pair, Fp8MlpActivation};
pub(crate) use tensor::{f32_values, words_of};
pub use tensor::{
    fp8_pair_path, fp8_pair_path_run, fp8_quantize, fp8_quantize_pair, fp8_quantize_pair_on,
    words_of_tensor, Fp8Tensor,
};

use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, FloatDType, Int, Tensor, TensorData, TensorPrimitive};

use crate::gemm::GemmOps;

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
        reference_quantize::<Self>(x, spec, None)
    }

    /// `((payload, scales), (payload, scales))` of [`fp8_quantize_pair`], from one kernel when
    /// `path` asks for it and the backend has one (two [`Self::fp8_quantize`] calls by default).
    #[allow(clippy::type_complexity)]
    fn fp8_quantize_pair(
        x: FloatTensor<Self>,
        spec: &PairSpec,
        _path: Fp8PairPath,
    ) -> (
        (IntTensor<Self>, FloatTensor<Self>),
        (IntTensor<Self>, FloatTensor<Self>),
    ) {
        let stored = Self::fp8_quantize(x.clone(), &spec.stored());
        (stored, Self::fp8_quantize(x, &spec.transposed()))
    }

    /// `[1]` f32: the amax per-tensor scaling takes of the float `x`, its largest finite normal
    /// `|x|` (0 if none; the CPU reference by default).
    fn fp8_tensor_amax(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let t = Tensor::<Self, 2>::from_primitive(TensorPrimitive::Float(x));
        let device = t.device();
        let amax = reference::tensor_amax(&f32_values(t, "data"));
        crate::primitive::prim(Tensor::<Self, 1>::from_data(
            TensorData::new(vec![amax], [1]),
            (&device, DType::F32),
        ))
    }

    /// [`Self::fp8_quantize`] under a per-tensor `spec`, scaled for the given `amax` (f32, the
    /// amax in its first element) instead of `x`'s own (delayed scaling; the CPU reference by
    /// default).
    fn fp8_quantize_given(
        x: FloatTensor<Self>,
        spec: &QuantSpec,
        amax: FloatTensor<Self>,
    ) -> (IntTensor<Self>, FloatTensor<Self>) {
        let amax = f32_values(crate::primitive::tensor::<Self, 1>(amax), "amax");
        reference_quantize::<Self>(x, spec, Some(amax[0]))
    }

    /// [`Self::fp8_quantize_pair`] under a per-tensor `spec`, scaled for the given `amax` (f32,
    /// the amax in its first element). With `record = Some((buffer, slot))` a backend may also raise the f32
    /// `buffer[slot]` to `x`'s amax in place, from the same read, and say so with `true` (the
    /// CUDA C++ kernel does); with `false` nothing was recorded (by default: two
    /// [`Self::fp8_quantize_given`] calls).
    #[allow(clippy::type_complexity)]
    fn fp8_quantize_pair_given(
        x: FloatTensor<Self>,
        spec: &QuantSpec,
        _path: Fp8PairPath,
        amax: FloatTensor<Self>,
        _record: Option<(FloatTensor<Self>, usize)>,
    ) -> (
        (
            (IntTensor<Self>, FloatTensor<Self>),
            (IntTensor<Self>, FloatTensor<Self>),
        ),
        bool,
    ) {
        let stored = Self::fp8_quantize_given(x.clone(), &spec.transposed(false), amax.clone());
        let transposed = Self::fp8_quantize_given(x, &spec.transposed(true), amax);
        ((stored, transposed), false)
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
        let scales = f32_values(crate::primitive::tensor::<Self, 2>(scales), "scales");
        let full = reference::dequantize(&words, &scales, rows, width * 4, spec);
        let values: Vec<f32> = full
            .chunks(width * 4)
            .flat_map(|row| row[..k_out].iter().copied())
            .collect();
        crate::primitive::prim(
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
        let scales = f32_values(crate::primitive::tensor::<Self, 2>(scales), "scales");
        let rows = reference::health_rows(&data, r, c, spec, &words, &scales);
        let n = rows.len() / 4;
        crate::primitive::prim(Tensor::<Self, 2>::from_data(
            TensorData::new(rows, [n, 4]),
            (&device, DType::F32),
        ))
    }

    /// `act` of the 2-D `h` (with `dy`, its gradient with respect to `h`; for SwiGLU `h` is the
    /// packed `[t, 2 * ff]` and `dy` `[t, ff]`), rounded to `h`'s dtype and quantized in both
    /// orientations as [`Self::fp8_quantize_pair`] quantizes it under `spec`, by one kernel that
    /// reads `h` (and `dy`) once; `None` where the backend has no such kernel (the default), and
    /// the caller runs the activation and the quantizer pair. Per-tensor scaling needs
    /// `given = Some((amax, record))`: the amax to scale by (f32, the amax first) and, as in
    /// [`Self::fp8_quantize_pair_given`], where to record the values' own amax (`true` beside the
    /// pair when it did).
    #[allow(clippy::type_complexity)]
    fn fp8_act_quantize_pair(
        _h: FloatTensor<Self>,
        _dy: Option<FloatTensor<Self>>,
        _act: Fp8MlpActivation,
        _spec: &PairSpec,
        _given: Option<(FloatTensor<Self>, Option<(FloatTensor<Self>, usize)>)>,
    ) -> Option<(
        (
            (IntTensor<Self>, FloatTensor<Self>),
            (IntTensor<Self>, FloatTensor<Self>),
        ),
        bool,
    )> {
        None
    }

    /// [`fp8_mlp_scaled`] as one op, or `None` where the backend has none (the default): the
    /// free function then composes [`fp8_linear_scaled`], the activation ([`crate::gelu`] or
    /// [`crate::swiglu_packed`]) and [`fp8_linear_scaled`].
    fn fp8_mlp(
        _x: FloatTensor<Self>,
        _w_fc: FloatTensor<Self>,
        _w_proj: FloatTensor<Self>,
        _act: Fp8MlpActivation,
        _cfg: &Fp8LinearConfig,
        _sites: Option<(Fp8ScaleSite, Fp8ScaleSite)>,
    ) -> Option<FloatTensor<Self>> {
        None
    }

    /// Whether [`Fp8PairPath::Native`] runs its own kernel for the float tensor `x` (else it
    /// runs [`Fp8PairPath::Fused`]).
    fn fp8_native_supported(_x: &FloatTensor<Self>) -> bool {
        false
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

    /// [`fp8_linear`]; by default its forward only (backends without autodiff), recording no
    /// amax. `probe` receives the input's health and, under `Autodiff`, the output gradient's in
    /// the backward; with a `site`, per-tensor scales come from its amax history
    /// ([`fp8_linear_scaled`]).
    fn fp8_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        cfg: &Fp8LinearConfig,
        probe: Option<Fp8Probe>,
        site: Option<Fp8ScaleSite>,
    ) -> FloatTensor<Self>
    where
        Self: Fp8Ops + GemmOps,
    {
        let x = crate::primitive::tensor::<Self, 2>(x);
        if let Some(p) = &probe {
            p.record_input(x.clone(), cfg, site.as_ref());
        }
        crate::primitive::prim(backward::fprop::<Self>(
            x,
            crate::primitive::tensor(w),
            cfg,
            site.as_ref(),
        ))
    }
}

/// `(payload, scales)` of the 2-D `x` from the CPU reference codec (scaled for `given_amax` when
/// given, per-tensor specs only), on `x`'s device: the quantizers' default.
fn reference_quantize<B: BurnBackend>(
    x: FloatTensor<B>,
    spec: &QuantSpec,
    given_amax: Option<f32>,
) -> (IntTensor<B>, FloatTensor<B>) {
    let t = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(x));
    let [r, c] = t.dims();
    let device = t.device();
    let data = f32_values(t, "data");
    let (words, scales) = match given_amax {
        Some(amax) => reference::quantize_with_amax(&data, r, c, spec, amax),
        None => reference::quantize(&data, r, c, spec),
    };
    let (rows, k) = if spec.transpose { (c, r) } else { (r, c) };
    let width = k.div_ceil(TILE) * TILE / 4;
    let words: Vec<i32> = words.into_iter().map(|w| w as i32).collect();
    let payload = Tensor::<B, 2, Int>::from_data(TensorData::new(words, [rows, width]), &device);
    let shape = [spec.scale_rows(rows), spec.scale_cols(k)];
    let scales = Tensor::<B, 2>::from_data(TensorData::new(scales, shape), (&device, DType::F32));
    (payload.into_primitive(), crate::primitive::prim(scales))
}
