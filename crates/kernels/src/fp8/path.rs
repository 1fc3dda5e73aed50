//! The paths an FP8 quantization pair and an FP8 GEMM can take (chosen in `tensor.rs` and
//! `gemm.rs`, named by the settings).

/// How [`fp8_quantize_pair`](super::fp8_quantize_pair) runs. On every path, per-tensor scaling
/// takes the tensor's amax from the CUDA C++ kernel where it applies (dense inputs on the GPUs
/// of [`Fp8PairPath::Native`]) and from a CubeCL pass elsewhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8PairPath {
    /// One kernel in CUDA C++ reads `x` once and writes both orientations, encoding with the
    /// GPU's FP8 conversion instruction (CUDA, compute capability 8.9+; f32, f16 or bf16 input).
    /// Elsewhere the [`Fp8PairPath::Fused`] kernel runs.
    Native,
    /// One CubeCL kernel reads `x` once and writes both orientations, encoding with integer
    /// operations (`CubeBackend` on every GPU; elsewhere, for matrices beyond its launch grid and
    /// for a pair whose orientations differ in granularity ([`super::PairSpec::mixed`]), two
    /// passes).
    Fused,
    /// Two quantizer passes, one per orientation.
    Separate,
}

/// How [`fp8_gemm`](super::fp8_gemm) runs.
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
