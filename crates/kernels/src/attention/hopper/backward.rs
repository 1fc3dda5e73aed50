//! FlashAttention's backward on Hopper GPUs in CUDA C++ (`backward.cu`), built as
//! FlashAttention-3 builds it: a block per 128 keys of one (batch, query head) walks the query
//! blocks that see them, with TMA copies from a producer warp and `wgmma` in two consumer
//! warpgroups; dQ is added to an f32 buffer by bulk reductions and cast by a second kernel. It
//! computes what the CubeCL tensor-core backward with the fused dQ computes, for f16 and bf16 at
//! head_dim 64 and 128 without dropout, after the same delta pre-pass; like that fused dQ, the
//! order of dQ's f32 additions varies from run to run. Every other call, and every call under a
//! `BURNMIX_FLASH_TILES` override (which tunes the CubeCL kernels; `dq=separate` asks for the
//! deterministic dQ), takes the CubeCL kernels.

use std::sync::atomic::Ordering;

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;

use super::launch::{self, Launch};
use super::{
    check_maps, map_of, rows_of_16_bytes, runs_on, Dims, BACKWARD_ROPE_RUNS, BACKWARD_RUNS,
};
use crate::cuda_source::{launch as launch_cuda, CudaSource};
use crate::gemm::cublaslt::as_cuda as cuda;

/// The backward's NVRTC source: the shared helpers, dQ's layout (and its cast), then the kernel.
const SOURCE: &str = concat!(
    include_str!("common.cuh"),
    include_str!("dq_cast.cu"),
    include_str!("backward.cu")
);
/// The cast's NVRTC source: the shared helpers and the cast alone, so that it compiles once per
/// head_dim and dtype, and quickly.
const CAST_SOURCE: &str = concat!(include_str!("common.cuh"), include_str!("dq_cast.cu"));
const ENTRY: &str = "flash_backward_hopper";
/// The kernel that turns the f32 dQ sums into dQ.
const CAST_ENTRY: &str = "flash_dq_hopper";
/// Keys per block.
const BLOCK_K: usize = 128;
/// Threads per block: a producer warpgroup and two consumer warpgroups.
const THREADS: u32 = 384;
/// `Info` in backward.cu: four tensor maps of 16 words, then this many words.
const INFO_WORDS: usize = 14;

/// Query rows per step: 128 at head_dim 64, 64 at 128 (where each consumer thread keeps 128 f32
/// accumulators of dK and dV).
fn block_q(hd: usize) -> usize {
    if hd == 64 {
        128
    } else {
        64
    }
}

/// Dynamic shared memory a block takes (backward.cu's `SMEM_BYTES` plus 1 KB for the 1024-byte
/// alignment of its tiles): K and V, two stages of Q and of dO, two stages of dS^T, two f32 dQ
/// parts of 64 x 64, two stages of lse and delta rows, five barriers. 195 KB at head_dim 64,
/// 194 KB at 128.
fn shared_bytes(hd: usize) -> usize {
    let bq = block_q(hd);
    2 * BLOCK_K * hd * 2
        + 4 * bq * hd * 2
        + 2 * BLOCK_K * bq * 2
        + 2 * 64 * 64 * 4
        + 4 * bq * 4
        + 8 * 5
        + 1024
}

/// Whether [`backward`] runs for these tensors: the conditions of [`runs_on`], which the output
/// gradient must meet too, and no `BURNMIX_FLASH_TILES` override.
pub(crate) fn applies_backward<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    grad: &CubeTensor<R>,
    d: &Dims,
    dropout: bool,
) -> bool {
    crate::settings::read(|s| s.flash_tiles.is_none())
        && runs_on(&[q, k, v, grad], d, dropout, shared_bytes(d.hd))
}

/// Writes dq (`[batch, heads, seq_q, hd]`), dk and dv (`[batch, kv_heads, seq_k, hd]` in the
/// inputs' dtype, or under grouping f32 `[batch, heads, seq_k, hd]`, one row block per query
/// head), each with a unit last stride, from the inputs, the output gradient `grad`, the
/// forward's log-sum-exp and the pre-pass's `delta` (f32 `[batch, heads, seq_q]`, contiguous,
/// queued by `delta` once the tensor maps are accepted; given dQ's f32 sums, it also clears
/// them), where [`applies_backward`] said yes. Given RoPE's `cos` and `sin` tables (`rope`: f32
/// `[>= seq, hd / 2]`, contiguous; dK and dV in the inputs' dtype), dQ and dK are rotated back by
/// the angles of their positions as they are stored: the gradients of the unrotated q and k. The
/// launches are queued and this returns at once; where the driver refuses a tensor map, or dQ's
/// strides or address do not allow the cast's 16-byte stores, nothing is queued (`delta` is not
/// called) and the error says why.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    grad: &CubeTensor<R>,
    lse: &CubeTensor<R>,
    delta: impl FnOnce(Option<&CubeTensor<R>>) -> CubeTensor<R>,
    grads: [&CubeTensor<R>; 3],
    rope: Option<[&CubeTensor<R>; 2]>,
    d: &Dims,
    causal: bool,
    scale: f32,
) -> Result<(), String> {
    let [dq, dk, dv] = grads;
    let bq = block_q(d.hd);
    let maps: Vec<_> = [(q, bq), (k, BLOCK_K), (v, BLOCK_K), (grad, bq)]
        .into_iter()
        .map(|(t, rows)| cuda(t).map(|t| map_of(t, rows)))
        .collect::<Option<_>>()
        .expect("hopper::backward runs only where `applies_backward` said yes (CUDA)");
    check_maps(&maps)?;
    let sq = dq.meta.strides();
    if !rows_of_16_bytes(dq) {
        return Err(format!(
            "dQ's strides {sq:?} (offset {} bytes) do not allow 16-byte stores of 8 columns",
            dq.handle.offset_start.unwrap_or(0)
        ));
    }
    let (k_blocks, pairs) = (d.seq_k.div_ceil(BLOCK_K), d.batch * d.heads);
    // backward.cu numbers its blocks in 32 bits, on a one-dimensional grid.
    if k_blocks.saturating_mul(pairs) > i32::MAX as usize {
        return Err(format!(
            "{k_blocks} key blocks x {pairs} (batch, head) pairs: at most 2^31 - 1 blocks"
        ));
    }
    // dQ's f32 sums: per (batch, head), head_dim / 64 column segments of the query rows rounded
    // up to whole blocks, cleared. Without padded rows they are as many as the delta pre-pass's
    // rows times head_dim, and the pre-pass clears them as it reads (a clear needs no layout);
    // otherwise a fill does.
    let rows_pad = d.seq_q.div_ceil(bq) * bq;
    let acc_shape = [d.batch * d.heads * rows_pad * d.hd];
    let (dq_acc, delta) = if rows_pad == d.seq_q {
        let acc = crate::launch::empty(q, acc_shape.to_vec(), DType::F32);
        let delta = delta(Some(&acc));
        (acc, delta)
    } else {
        let acc =
            burn_cubecl::ops::numeric::zeros::<R>(q.device.clone(), acc_shape.into(), DType::F32);
        (acc, delta(None))
    };
    // The tables follow dq_acc in both kernels' parameters (backward.cu's and the cast's `ROPE`).
    let tables: Vec<CubeTensor<CudaRuntime>> = rope
        .into_iter()
        .flatten()
        .map(|t| cuda(t).cloned().expect("CUDA tensors"))
        .collect();
    let tensors: Vec<CubeTensor<CudaRuntime>> = [q, k, v, grad, lse, &delta, dk, dv, &dq_acc]
        .into_iter()
        .map(|t| cuda(t).cloned().expect("CUDA tensors"))
        .chain(tables.iter().cloned())
        .collect();
    let (sk, sv) = (dk.meta.strides(), dv.meta.strides());
    let mut words: Vec<u64> = [d.heads, d.group, d.seq_q, d.seq_k]
        .into_iter()
        .chain([sk[0], sk[1], sk[2], sv[0], sv[1], sv[2]])
        .map(|x| x as u64)
        .collect();
    words.push(u64::from((scale * std::f32::consts::LOG2_E).to_bits()));
    words.push(u64::from(scale.to_bits()));
    words.push(rows_pad as u64);
    words.push(k_blocks as u64);
    debug_assert_eq!(words.len(), INFO_WORDS, "backward.cu's Info words");
    let cast_defines = format!(
        "#define HD {}\n#define IS_BF16 {}\n#define ROPE {}\n",
        d.hd,
        u8::from(q.dtype == DType::BF16),
        u8::from(rope.is_some())
    );
    let defines = format!(
        "{cast_defines}#define CAUSAL {}\n#define DKV_F32 {}\n",
        u8::from(causal),
        u8::from(dk.dtype == DType::F32)
    );
    let kernel = CudaSource::new(ENTRY, defines, SOURCE, CubeDim::new_1d(THREADS))
        .with_shared(shared_bytes(d.hd));
    // By pair, then key block.
    let cubes = ((k_blocks * pairs) as u32, 1, 1);
    launch::queue(Launch {
        tensors,
        maps,
        words,
        kernel,
        cubes,
    });

    // dQ = scale * the sums, eight columns a thread (with RoPE, eight pairs of columns);
    // queued after the kernel on the same stream.
    let dq_cuda = cuda(dq).expect("CUDA tensors");
    let acc_cuda = cuda(&dq_acc).expect("CUDA tensors");
    let columns_per_thread = if rope.is_some() { 16 } else { 8 };
    let chunks = d.batch * d.heads * d.seq_q * d.hd / columns_per_thread;
    let info = [d.heads, d.seq_q, rows_pad, sq[0], sq[1], sq[2]]
        .map(|x| x as u64)
        .into_iter()
        .chain([u64::from(scale.to_bits()), chunks as u64])
        .collect();
    let cast = CudaSource::new(CAST_ENTRY, cast_defines, CAST_SOURCE, CubeDim::new_1d(256));
    launch_cuda(
        &dq_cuda.client,
        cast,
        (chunks.div_ceil(256) as u32, 1, 1),
        [acc_cuda, dq_cuda]
            .into_iter()
            .chain(&tables)
            .map(|t| t.handle.clone().binding())
            .collect(),
        info,
    );
    BACKWARD_RUNS.fetch_add(1, Ordering::Relaxed);
    if rope.is_some() {
        BACKWARD_ROPE_RUNS.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}
