// Host entry point around the Hopper FlashAttention forward (crates/kernels/src/attention/
// hopper/forward.cu), built by nvcc into a shared library that harness.py calls from PyTorch. The
// variant's macros (HD, IS_BF16, CAUSAL, CONSUMERS, STAGES) come from the nvcc command line.
#include <cuda.h>
#include <cuda_runtime.h>

#include "../../crates/kernels/src/attention/hopper/common.cuh"
// FORWARD_SOURCE (harness.py --kernel) builds another version of the kernel file, to compare.
#ifdef FORWARD_SOURCE
#include FORWARD_SOURCE
#else
#include "../../crates/kernels/src/attention/hopper/forward.cu"
#endif

#include "tensor_map.h"

// dims: batch, heads, kv_heads, seq_q, seq_k; strides: q, k, v, out (b, h, s each); section: the
// (batch, head) pairs of a section of the causal tile order (schedule.py computes the launcher's).
extern "C" int launch(const void* q, const void* k, const void* v, void* o, float* lse, const u64* dims,
                      const u64* st, u64 scale_bits, u64 section, void* stream) {
    Info info;
    const u64 batch = dims[0], heads = dims[1], kv_heads = dims[2], seq_q = dims[3], seq_k = dims[4];
    int r = encode(&info.q_map, q, heads, seq_q, batch, st[0], st[1], st[2], BR);
    if (!r) r = encode(&info.k_map, k, kv_heads, seq_k, batch, st[3], st[4], st[5], BC);
    if (!r) r = encode(&info.v_map, v, kv_heads, seq_k, batch, st[6], st[7], st[8], BC);
    if (!r) r = encode(&info.o_map, o, heads, seq_q, batch, st[9], st[10], st[11], 64);
    if (r) return 1000 + r;
    info.heads = heads;
    info.group = heads / kv_heads;
    info.seq_q = seq_q;
    info.seq_k = seq_k;
    info.o_b = st[9];
    info.o_h = st[10];
    info.o_s = st[11];
    info.scale_log2 = scale_bits;
    // Persistent blocks, one per SM.
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    info.q_blocks = (seq_q + BR - 1) / BR;
    info.bh_count = batch * heads;
    info.section = section < 1 ? 1 : (section > info.bh_count ? info.bh_count : section);
    const u64 tiles = info.q_blocks * info.bh_count;
    const int grid = tiles < (u64)sms ? (int)tiles : sms;
    const int smem = SMEM_BYTES + 1024;
    cudaError_t e = cudaFuncSetAttribute(flash_forward_hopper, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return (int)e;
    flash_forward_hopper<<<grid, THREADS, smem, (cudaStream_t)stream>>>(
        (const unsigned short*)q, (const unsigned short*)k, (const unsigned short*)v, (unsigned short*)o, lse, info);
    return (int)cudaGetLastError();
}
