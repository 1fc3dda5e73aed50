//! FlashAttention's forward on Hopper GPUs (compute capability 9.0) in CUDA C++ (`forward.cu`):
//! warpgroup MMA (`wgmma`) from 128-byte-swizzled shared memory, which CubeCL 0.10 cannot
//! express, compiled by NVRTC for sm_90a and launched on CubeCL's stream with CubeCL's buffers
//! (see `cuda_source.rs`). It computes what the CubeCL kernel `flash_forward_mma` computes (the
//! output and the f32 log-sum-exp the backward recomputes P from) for f16 and bf16 inputs at
//! head_dim 64 and 128 without dropout; every other call, and every GPU other than sm_90, takes
//! the CubeCL kernels, which stay the reference. `BURNMIX_FLASH_HOPPER=off`
//! ([`crate::settings::Settings::flash_hopper`]) turns it off.

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;

use super::dims::Dims;
use crate::cuda_source::{compute_capability, launch, CudaSource};
use crate::gemm::cublaslt::as_cuda as cuda;

const SOURCE: &str = include_str!("forward.cu");
const ENTRY: &str = "flash_forward_hopper";
/// Query rows a block owns (two warpgroups of 64) and keys per step; threads a block.
const BLOCK_Q: usize = 128;
const BLOCK_K: usize = 128;
const THREADS: u32 = 256;
/// Key/value blocks in shared memory at once.
const STAGES: usize = 3;

/// Dynamic shared memory a block takes: Q and the stages of K and V (16-bit), plus 1 KB so that
/// the kernel can start its tiles on 1024-byte boundaries (its swizzle is a function of the
/// address). 225 KB at head_dim 128, within the 227 KB a Hopper block may have.
fn shared_bytes(hd: usize) -> usize {
    (BLOCK_Q + 2 * STAGES * BLOCK_K) * hd * 2 + 1024
}

/// Whether `forward` runs for these tensors: CUDA on a compute capability 9.0 GPU with enough
/// shared memory, f16 or bf16, head_dim 64 or 128, no dropout, the setting on, and every row
/// start 16-byte aligned (the kernel copies 16 bytes at a time): unit last strides, the other
/// strides multiples of 8 elements and 16-byte aligned starts.
pub(crate) fn applies<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    d: &Dims,
    dropout: bool,
) -> bool {
    if dropout || !(d.hd == 64 || d.hd == 128) || !matches!(q.dtype, DType::F16 | DType::BF16) {
        return false;
    }
    if !crate::settings::read(|s| s.flash_hopper) {
        return false;
    }
    let Some(qc) = cuda(q) else {
        return false;
    };
    if compute_capability(qc) != Some((9, 0)) {
        return false;
    }
    let smem = q.client.properties().hardware.max_shared_memory_size;
    smem >= shared_bytes(d.hd)
        && [q, k, v].iter().all(|t| {
            let s = t.meta.strides();
            s[3] == 1
                && s[..3].iter().all(|x| x.is_multiple_of(8))
                && t.handle.offset_start.unwrap_or(0).is_multiple_of(16)
        })
}

/// Writes `out` (`[batch, heads, seq_q, hd]`, any strides with a unit last one and even others)
/// and `lse` (`[batch, heads, seq_q]` f32, contiguous) from q, k, v, where [`applies`] said yes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    out: &CubeTensor<R>,
    lse: &CubeTensor<R>,
    d: &Dims,
    causal: bool,
    scale: f32,
) {
    let tensors: Option<Vec<&CubeTensor<CudaRuntime>>> =
        [q, k, v, out, lse].into_iter().map(cuda).collect();
    let tensors = tensors.expect("hopper::forward runs only where `applies` said yes (CUDA)");
    let defines = format!(
        "#define HD {}\n#define IS_BF16 {}\n#define CAUSAL {}\n",
        d.hd,
        u8::from(q.dtype == DType::BF16),
        u8::from(causal)
    );
    let kernel = CudaSource::new(ENTRY, defines, SOURCE, CubeDim::new_1d(THREADS))
        .with_shared(shared_bytes(d.hd));
    let buffers = tensors.iter().map(|t| t.handle.clone().binding()).collect();
    let strides = |t: &CubeTensor<CudaRuntime>| {
        let s = t.meta.strides();
        [s[0] as u64, s[1] as u64, s[2] as u64]
    };
    let mut info = vec![
        d.heads as u64,
        d.group as u64,
        d.seq_q as u64,
        d.seq_k as u64,
    ];
    for t in &tensors[..4] {
        info.extend(strides(t));
    }
    info.push(u64::from((scale * std::f32::consts::LOG2_E).to_bits()));
    let cubes = (
        d.seq_q.div_ceil(BLOCK_Q) as u32,
        (d.batch * d.heads) as u32,
        1,
    );
    launch(&tensors[0].client, kernel, cubes, buffers, info);
}
