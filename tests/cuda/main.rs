//! Every test that needs CUDA, in one binary: `tools/cuda-suite` builds it and runs each test in
//! its own process, side by side. The tests are marked `#[ignore = "needs CUDA"]`, so
//! `cargo test --workspace` on a machine without CUDA skips them.
//! - `kernels`: the fused kernels, FlashAttention and FP8 against their references in f32, f16
//!   and bf16 (CUDA pitches odd row lengths and uses 128-bit vectors and tensor cores);
//! - `gemm_record`: the record of timed GEMM algorithms read back (a part of a `kernels` test);
//! - `packed_rope`: where the packed projection's RoPE is applied (in its own buffer or a copy);
//! - `model`: the model-equivalence matrix (every `kernels` x `attention` x MLP combination);
//! - `recipes`: training, resume and the BF16/FP16 recipes end to end.

#[path = "../common/mod.rs"]
mod common;
#[path = "../fp8_cases/mod.rs"]
mod fp8_cases;
#[path = "../kernel_cases/mod.rs"]
mod kernel_cases;
#[path = "../model_cases/mod.rs"]
mod model_cases;

mod fp8;
mod gemm_record;
mod kernels;
mod model;
mod packed_rope;
mod recipes;
