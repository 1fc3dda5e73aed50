// Host entry points around the Hopper FlashAttention backward (crates/kernels/src/attention/
// hopper/backward.cu, its cast in dq_cast.cu), built by nvcc into a shared library that
// backward.py calls from PyTorch.
// The variant's macros (HD, IS_BF16, CAUSAL, DKV_F32) come from the nvcc command line.
#include <cuda.h>
#include <cuda_runtime.h>

#include "../../crates/kernels/src/attention/hopper/common.cuh"
#include "../../crates/kernels/src/attention/hopper/dq_cast.cu"
// BACKWARD_SOURCE (backward.py --kernel) builds another version of the kernel file, to compare.
#ifdef BACKWARD_SOURCE
#include BACKWARD_SOURCE
#else
#include "../../crates/kernels/src/attention/hopper/backward.cu"
#endif

#include "tensor_map.h"

extern "C" u64 rows_pad(u64 seq_q) { return (seq_q + BM - 1) / BM * BM; }

// dims: batch, heads, kv_heads, seq_q, seq_k; strides (b, h, s each): q, k, v, dout, dk, dv, dq.
// dq_acc must hold batch * heads * rows_pad(seq_q) * HD zeros.
extern "C" int launch(const void* q, const void* k, const void* v, const void* dout, const float* lse,
                      const float* delta, void* dk, void* dv, float* dq_acc, void* dq, const u64* dims,
                      const u64* st, u32 scale_bits, u32 scale_log2_bits, void* stream) {
    Info info;
    const u64 batch = dims[0], heads = dims[1], kv_heads = dims[2], seq_q = dims[3], seq_k = dims[4];
    int r = encode(&info.q_map, q, heads, seq_q, batch, st[0], st[1], st[2], BM);
    if (!r) r = encode(&info.k_map, k, kv_heads, seq_k, batch, st[3], st[4], st[5], BN);
    if (!r) r = encode(&info.v_map, v, kv_heads, seq_k, batch, st[6], st[7], st[8], BN);
    if (!r) r = encode(&info.do_map, dout, heads, seq_q, batch, st[9], st[10], st[11], BM);
    if (r) return 1000 + r;
    info.heads = heads;
    info.group = heads / kv_heads;
    info.seq_q = seq_q;
    info.seq_k = seq_k;
    info.dk_b = st[12];
    info.dk_h = st[13];
    info.dk_s = st[14];
    info.dv_b = st[15];
    info.dv_h = st[16];
    info.dv_s = st[17];
    info.scale_log2 = scale_log2_bits;
    info.scale = scale_bits;
    info.rows_pad = rows_pad(seq_q);
    info.k_blocks = (seq_k + BN - 1) / BN;
    // The kernel numbers its blocks in 32 bits on a one-dimensional grid (the Rust launcher refuses
    // more too).
    if (info.k_blocks * batch * heads > 0x7fffffffull) return 2000;
    const int smem = SMEM_BYTES + 1024;
    cudaError_t e = cudaFuncSetAttribute(flash_backward_hopper, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return (int)e;
    dim3 grid((unsigned)(info.k_blocks * batch * heads));
    flash_backward_hopper<<<grid, THREADS, smem, (cudaStream_t)stream>>>(
        (const unsigned short*)q, (const unsigned short*)k, (const unsigned short*)v, (const unsigned short*)dout,
        lse, delta, dk, dv, dq_acc, info);
    e = cudaGetLastError();
    if (e != cudaSuccess) return (int)e;
    CastInfo cast;
    cast.heads = heads;
    cast.seq_q = seq_q;
    cast.rows_pad = info.rows_pad;
    cast.dq_b = st[18];
    cast.dq_h = st[19];
    cast.dq_s = st[20];
    cast.scale = scale_bits;
    cast.chunks = batch * heads * seq_q * HD / 8;
    flash_dq_hopper<<<(unsigned)((cast.chunks + 255) / 256), 256, 0, (cudaStream_t)stream>>>(
        dq_acc, (unsigned short*)dq, cast);
    return (int)cudaGetLastError();
}
