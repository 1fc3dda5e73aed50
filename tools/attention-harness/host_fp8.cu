// Host entry point around the Hopper FlashAttention forward built with FP8=1 (e4m3 inputs with
// block scales, bf16 output; crates/kernels/src/attention/hopper/forward.cu), built by nvcc into
// a shared library that fp8_forward.py calls from PyTorch. The variant's macros (HD, CAUSAL,
// CONSUMERS, STAGES; FP8 and IS_BF16 are 1) come from the nvcc command line.
#include <cuda.h>
#include <cuda_runtime.h>

#include "../../crates/kernels/src/attention/hopper/common.cuh"
#include "../../crates/kernels/src/attention/hopper/forward.cu"

// A tensor map over a 4-dimensional byte tensor (dims innermost first, strides of dims 1..3 in
// bytes), boxes of box0 x box1, with the swizzle of box0-byte rows (64 or 128).
static int encode_bytes(TensorMap* map, const void* t, const u64 (&dims)[4], const u64 (&strides)[3], u32 box0,
                        u32 box1) {
    cuuint64_t d[4] = {dims[0], dims[1], dims[2], dims[3]};
    cuuint64_t s[3] = {strides[0], strides[1], strides[2]};
    cuuint32_t box[4] = {box0, box1, 1, 1};
    cuuint32_t unit[4] = {1, 1, 1, 1};
    CUresult r = cuTensorMapEncodeTiled(
        (CUtensorMap*)map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<void*>(t), d, s, box, unit,
        CU_TENSOR_MAP_INTERLEAVE_NONE, box0 == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
        CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return (int)r;
}

// q [batch, heads, seq_q, HD] and k [batch, kv_heads, seq_k, HD] e4m3, contiguous; vt [batch,
// kv_heads, HD, keys] e4m3, contiguous (keys: seq_k rounded up to 32, in the kernel's order);
// scales f32 [batch, heads or kv_heads, blocks]. dims: batch, heads, kv_heads, seq_q, seq_k, keys;
// o_strides: out's (b, h, s) in elements.
extern "C" int launch(const void* q, const void* k, const void* vt, void* o, float* lse, const float* q_scale,
                      const float* k_scale, const float* v_scale, const u64* dims, const u64* o_strides,
                      u64 scale_bits, u64 section, void* stream) {
    // info.o_map stays unset: the FP8 forward stores its output from registers.
    Info info;
    const u64 batch = dims[0], heads = dims[1], kv_heads = dims[2], seq_q = dims[3], seq_k = dims[4], keys = dims[5];
    int r = encode_bytes(&info.q_map, q, {HD, seq_q, heads, batch}, {HD, seq_q * HD, heads * seq_q * HD}, HD, BR);
    if (!r)
        r = encode_bytes(&info.k_map, k, {HD, seq_k, kv_heads, batch}, {HD, seq_k * HD, kv_heads * seq_k * HD}, HD,
                         BC);
    if (!r)
        r = encode_bytes(&info.v_map, vt, {keys, HD, kv_heads, batch}, {keys, HD * keys, kv_heads * HD * keys}, BC,
                         HD);
    if (r) return 1000 + r;
    info.heads = heads;
    info.group = heads / kv_heads;
    info.seq_q = seq_q;
    info.seq_k = seq_k;
    info.o_b = o_strides[0];
    info.o_h = o_strides[1];
    info.o_s = o_strides[2];
    info.scale_log2 = scale_bits;
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
        (const unsigned short*)q, (const unsigned short*)k, (const unsigned short*)vt, (unsigned short*)o, lse, q_scale,
        k_scale, v_scale, info);
    return (int)cudaGetLastError();
}
