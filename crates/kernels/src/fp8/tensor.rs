//! The quantized matrix and the quantizer's entry points (one orientation, or both in one read).

use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::{DType, FloatDType, Int, Tensor, TensorData, TensorPrimitive};

use super::*;
use crate::gemm::GemmOps;

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

/// A quantizer's `(payload, scales)` as the backend ops return them.
pub(crate) type Parts<B> = (IntTensor<B>, FloatTensor<B>);

impl<B: Fp8Ops + GemmOps> Fp8Tensor<B> {
    /// The quantized matrix of a quantizer's `parts` for an `[r, c]` input under `spec`.
    pub(crate) fn from_parts(
        (payload, scales): Parts<B>,
        [r, c]: [usize; 2],
        spec: QuantSpec,
    ) -> Self {
        let (rows, k) = if spec.transpose { (c, r) } else { (r, c) };
        Self {
            payload: Tensor::from_primitive(payload),
            scales: Tensor::from_primitive(TensorPrimitive::Float(scales)),
            rows,
            k,
            spec,
        }
    }

    /// Both orientations of an `[r, c]` input from a pair quantizer's parts under `spec` (as
    /// stored, then transposed).
    pub(crate) fn pair_from_parts(
        (stored, transposed): (Parts<B>, Parts<B>),
        dims: [usize; 2],
        spec: PairSpec,
    ) -> (Self, Self) {
        (
            Self::from_parts(stored, dims, spec.stored()),
            Self::from_parts(transposed, dims, spec.transposed()),
        )
    }

    /// `k` rounded up to a multiple of 128 (the payload's width in codes).
    pub fn k_padded(&self) -> usize {
        self.k.div_ceil(TILE) * TILE
    }

    /// The values the codes stand for, `[rows, k]`, in `dtype` (exact in f32 and bf16).
    pub fn dequantize(&self, dtype: FloatDType) -> Tensor<B, 2> {
        self.dequantize_to(self.k, dtype)
    }

    pub(crate) fn dequantize_to(&self, k_out: usize, dtype: FloatDType) -> Tensor<B, 2> {
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
pub(crate) fn f32_values<B: BurnBackend, const D: usize>(t: Tensor<B, D>, what: &str) -> Vec<f32> {
    t.cast(FloatDType::F32)
        .into_data()
        .to_vec::<f32>()
        .unwrap_or_else(|e| panic!("f32 {what}: {e:?}"))
}

/// Quantizes the 2-D `x` (f32, f16 or bf16) as `spec` says.
pub fn fp8_quantize<B: Fp8Ops + GemmOps>(x: Tensor<B, 2>, spec: QuantSpec) -> Fp8Tensor<B> {
    let dims = x.dims();
    Fp8Tensor::from_parts(
        B::fp8_quantize(x.into_primitive().tensor(), &spec),
        dims,
        spec,
    )
}

/// The path [`fp8_quantize_pair`] takes for `spec` ([`crate::settings::Settings::fp8_pair`],
/// `BURNMIX_FP8_PAIR`, chooses): [`Fp8PairPath::Native`] by default (the CUDA C++ kernel where it
/// applies, the CubeCL one elsewhere), every granularity.
pub fn fp8_pair_path(_spec: &QuantSpec) -> Fp8PairPath {
    crate::settings::read(|s| s.fp8_pair).unwrap_or(Fp8PairPath::Native)
}

/// The path [`fp8_quantize_pair_on`] runs for `x` on `path`: [`Fp8PairPath::Native`] becomes
/// [`Fp8PairPath::Fused`] where the CUDA C++ kernel does not apply (not CUDA, a GPU without FP8
/// conversions, an input other than f32, f16 or bf16).
pub fn fp8_pair_path_run<B: Fp8Ops>(x: &Tensor<B, 2>, path: Fp8PairPath) -> Fp8PairPath {
    let native = || B::fp8_native_supported(&x.clone().into_primitive().tensor());
    if path == Fp8PairPath::Native && !native() {
        Fp8PairPath::Fused
    } else {
        path
    }
}

/// Quantizes the 2-D `x` `[r, c]` in both orientations: `(as stored, transposed)`, the first
/// `[r, c]` quantized along `c` as `spec.stored()` says, the second `[c, r]` along `r` as
/// `spec.transposed()` says (a [`QuantSpec`] scales both alike; its `transpose` is ignored). Each
/// equals the matching [`fp8_quantize`] bit for bit, on the path [`fp8_pair_path`] names. The FP8
/// linear layer uses it for the operands that two of its GEMMs read along different axes (`x`,
/// `dy` and the weight).
pub fn fp8_quantize_pair<B: Fp8Ops + GemmOps>(
    x: Tensor<B, 2>,
    spec: impl Into<PairSpec>,
) -> (Fp8Tensor<B>, Fp8Tensor<B>) {
    let spec = spec.into();
    let path = fp8_pair_path(&spec.spec);
    fp8_quantize_pair_on(x, spec, path)
}

/// [`fp8_quantize_pair`] on a given path.
pub fn fp8_quantize_pair_on<B: Fp8Ops + GemmOps>(
    x: Tensor<B, 2>,
    spec: impl Into<PairSpec>,
    path: Fp8PairPath,
) -> (Fp8Tensor<B>, Fp8Tensor<B>) {
    let spec = spec.into();
    let dims = x.dims();
    let parts = B::fp8_quantize_pair(x.into_primitive().tensor(), &spec, path);
    Fp8Tensor::pair_from_parts(parts, dims, spec)
}
