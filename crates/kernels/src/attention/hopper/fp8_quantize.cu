// The inputs of the FP8 Hopper forward (forward.cu with FP8=1) from 16-bit q, k, v: e4m3 codes
// and one f32 scale per block of rows of each (batch, head), scale = amax / 448 (1 for a block of
// zeros), code = value x (1 / scale) rounded to nearest (saturated; the reciprocal rounded once,
// each product rounded once, as PyTorch's `x * torch.reciprocal(scale)`). Compiled at run time by NVRTC for
// sm_90a after common.cuh, with these macros:
//   HD        head_dim: 64 or 128
//   IS_BF16   1: bf16 inputs, 0: f16
//   ROWS      rows a scale covers: 64 (q) or 128 (k, v)
// `attention_fp8_rows` writes codes [batch, heads, seq, HD] (contiguous) for q and k;
// `attention_fp8_vt` writes v's codes transposed, vt [batch, kv_heads, HD, keys] (keys = seq
// rounded up to 32, the keys past seq zero), each 32 keys in the order forward.cu's
// `to_fragments` gives P in. Both take scales [batch, heads, blocks] and one block of 256
// threads for each (batch, head) pair and block of rows, on a one-dimensional grid.

#define QUANT_THREADS 256
// 16-byte chunks (8 elements) a thread loads.
#define CHUNKS (ROWS * HD / 8 / QUANT_THREADS)

struct QuantInfo {
    // Heads of the tensor, its rows, blocks of ROWS rows per (batch, head) pair.
    u64 heads, seq, blocks;
    // Element strides of the input (batch, head, row; the last one 1).
    u64 sb, sh, ss;
    // vt's row length (keys); unused by the rows kernel.
    u64 keys;
};

__device__ __forceinline__ float to_f32(unsigned short x) {
#if IS_BF16
    return __uint_as_float((u32)x << 16);
#else
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(x));
    return r;
#endif
}

// Loads this thread's chunks of the block (rows past seq as zeros) and returns the block's scale,
// which thread 0 also stores.
__device__ __forceinline__ float load_block(const unsigned short* __restrict__ x, float* __restrict__ scale,
                                            const QuantInfo& info, u64 bh, u64 block, uint4 (&v)[CHUNKS]) {
    __shared__ float warp_max[QUANT_THREADS / 32];
    const u64 b = bh / info.heads, h = bh % info.heads;
    const unsigned short* base = x + b * info.sb + h * info.sh;
    float amax = 0.f;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const u32 i = (u32)c * QUANT_THREADS + threadIdx.x;
        const u64 row = block * ROWS + i / (HD / 8);
        v[c] = make_uint4(0u, 0u, 0u, 0u);
        if (row < info.seq) v[c] = *reinterpret_cast<const uint4*>(base + row * info.ss + (i % (HD / 8)) * 8u);
        const u32 w[4] = {v[c].x, v[c].y, v[c].z, v[c].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            amax = fmaxf(amax, fabsf(to_f32((unsigned short)(w[e] & 0xFFFFu))));
            amax = fmaxf(amax, fabsf(to_f32((unsigned short)(w[e] >> 16))));
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (threadIdx.x % 32u == 0u) warp_max[threadIdx.x / 32u] = amax;
    __syncthreads();
    amax = warp_max[0];
#pragma unroll
    for (int i = 1; i < QUANT_THREADS / 32; ++i) amax = fmaxf(amax, warp_max[i]);
    const float s = amax > 0.f ? __fdiv_rn(amax, 448.f) : 1.f;
    if (threadIdx.x == 0) scale[bh * info.blocks + block] = s;
    return s;
}

// A chunk's eight values as eight codes (the first in the low byte); `inv` is 1 / scale.
__device__ __forceinline__ uint2 codes(const uint4& v, float inv) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    float f[8];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        f[2 * e] = __fmul_rn(to_f32((unsigned short)(w[e] & 0xFFFFu)), inv);
        f[2 * e + 1] = __fmul_rn(to_f32((unsigned short)(w[e] >> 16)), inv);
    }
    return make_uint2(pack_e4m3(f[0], f[1], f[2], f[3]), pack_e4m3(f[4], f[5], f[6], f[7]));
}

extern "C" __global__ void __launch_bounds__(QUANT_THREADS) attention_fp8_rows(
    const unsigned short* __restrict__ x, unsigned char* __restrict__ out, float* __restrict__ scale,
    const __grid_constant__ QuantInfo info) {
    const u64 bh = blockIdx.x / info.blocks, block = blockIdx.x % info.blocks;
    uint4 v[CHUNKS];
    const float inv = __frcp_rn(load_block(x, scale, info, bh, block, v));
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const u32 i = (u32)c * QUANT_THREADS + threadIdx.x;
        const u64 row = block * ROWS + i / (HD / 8);
        if (row < info.seq)
            *reinterpret_cast<uint2*>(out + (bh * info.seq + row) * HD + (i % (HD / 8)) * 8u) = codes(v[c], inv);
    }
}

// Where key r (< 32) of a 32-key group sits in vt's row: the inverse of forward.cu's order
// (position 16h + 4t + e holds key 16h + 8(e / 2) + 2t + e % 2).
__device__ __forceinline__ u32 vt_position(u32 r) {
    return (r & 16u) | (((r & 7u) >> 1) << 2) | (((r >> 3) & 1u) << 1) | (r & 1u);
}

// The 4-byte word of its tile row that vt row `row`'s keys 4w .. 4w + 3 are kept in: w XOR a
// value of (row / 8) that differs between the HD / 8 rows a warp's threads write at once (each a
// chunk's first column) and, at head_dim 64, keeps the two 8-row groups of one key pair's words
// apart, so that neither the byte stores nor the word loads of a warp meet in a bank.
__device__ __forceinline__ u32 tile_word(u32 row, u32 w) {
    return w ^ (((row / 8u) * (128u / HD)) & (ROWS / 4u - 1u));
}

extern "C" __global__ void __launch_bounds__(QUANT_THREADS) attention_fp8_vt(
    const unsigned short* __restrict__ x, unsigned char* __restrict__ vt, float* __restrict__ scale,
    const __grid_constant__ QuantInfo info) {
    // The block's codes transposed: HD rows of ROWS keys, in vt's order, each row's words
    // permuted by `tile_word`.
    __shared__ __align__(16) unsigned char tile[HD * ROWS];
    const u64 bh = blockIdx.x / info.blocks, block = blockIdx.x % info.blocks;
    uint4 v[CHUNKS];
    const float inv = __frcp_rn(load_block(x, scale, info, bh, block, v));
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const u32 i = (u32)c * QUANT_THREADS + threadIdx.x;
        const u32 key = i / (HD / 8), col = (i % (HD / 8)) * 8u;
        const u32 at = (key & ~31u) | vt_position(key & 31u);
        const uint2 q = codes(v[c], inv);
#pragma unroll
        for (int e = 0; e < 8; ++e)
            tile[(col + e) * ROWS + tile_word(col + e, at / 4u) * 4u + at % 4u] =
                (unsigned char)((e < 4 ? q.x : q.y) >> (8 * (e % 4)));
    }
    __syncthreads();
    // A word (4 keys) a thread, a warp a row's ROWS keys; vt's rows end at `keys` (a multiple of 32).
    const u64 first = block * ROWS;
    for (u32 i = threadIdx.x; i < HD * ROWS / 4; i += QUANT_THREADS) {
        const u32 row = i / (ROWS / 4), w = i % (ROWS / 4);
        if (first + w * 4u < info.keys)
            *reinterpret_cast<u32*>(vt + (bh * HD + row) * info.keys + first + w * 4u) =
                *reinterpret_cast<const u32*>(tile + row * ROWS + tile_word(row, w) * 4u);
    }
}
