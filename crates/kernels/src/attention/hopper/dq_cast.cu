// The second kernel of the Hopper FlashAttention backward (backward.cu): dQ from the f32 sums the
// first kernel adds into dq_acc, and the layout of those sums. Compiled at run time by NVRTC for
// sm_90a after common.cuh, alone (the cast needs only these three macros, so it is compiled once per
// head_dim, dtype and ROPE) or before backward.cu (which adds its parts at `dq_at`):
//   HD        head_dim: 64 or 128
//   IS_BF16   1: bf16 dQ, 0: f16
//   ROPE      1: dQ is rotated back by RoPE's angle of its query position as it is stored (the
//             gradient of a query that the forward rotated), from `cos` and `sin` tables
//             [positions, HD / 2] f32; 0: stored as it is

// Where dQ's f32 element (row, column) of (batch, head) pair `bh` sits in dq_acc: in HD / 64
// column segments of rows_pad rows by 64 columns, each row's 8-column chunks swizzled by the row
// (chunk ^ row % 8), so that the consumers' writes of a part to shared memory, in this layout,
// avoid bank conflicts and each part is one contiguous 16 KB range.
__device__ __forceinline__ u64 dq_at(u64 bh, u64 row, u32 col, u64 rows_pad) {
    const u64 seg = col / 64u, c = col % 64u;
    return ((bh * (HD / 64) + seg) * rows_pad + row) * 64u + (c ^ ((row & 7u) << 3));
}

// dQ from dq_acc: dq [batch, heads, seq_q, HD] at element strides (b, h, s; the last one 1, each
// a multiple of 8, the address 16-byte aligned: the launcher checks) = scale * the f32 sums, one
// 8-column chunk a thread (with ROPE, a chunk of the first half of the columns and its partner
// chunk HD / 2 further): two 16-byte loads a chunk (a chunk stays whole under dq_at's swizzle) and
// one 16-byte store.
struct CastInfo {
    u64 heads, seq_q, rows_pad;
    u64 dq_b, dq_h, dq_s;
    // The scale, f32 bits.
    u64 scale;
    // The threads: batch * heads * seq_q * HD / 8 (with ROPE, / 16).
    u64 chunks;
};

// Eight f32 sums from dq_acc at `at`, times `scale`.
__device__ __forceinline__ void sums8(const float* at, float scale, float (&x)[8]) {
    const float4 a = reinterpret_cast<const float4*>(at)[0], b = reinterpret_cast<const float4*>(at)[1];
    x[0] = a.x * scale, x[1] = a.y * scale, x[2] = a.z * scale, x[3] = a.w * scale;
    x[4] = b.x * scale, x[5] = b.y * scale, x[6] = b.z * scale, x[7] = b.w * scale;
}

// Eight 16-bit values at `at` (16-byte aligned).
__device__ __forceinline__ void store8(unsigned short* at, const float (&x)[8]) {
    uint4 out;
    out.x = pack(x[0], x[1]);
    out.y = pack(x[2], x[3]);
    out.z = pack(x[4], x[5]);
    out.w = pack(x[6], x[7]);
    *reinterpret_cast<uint4*>(at) = out;
}

#if ROPE
// The inverse rotation (by the opposite angle) of the eight pairs (x1[e], x2[e]) of columns
// `col + e` and `col + e + HD / 2` at position `pos`: (x1 c + x2 s, x2 c - x1 s), with c and s
// from the tables' row `pos` ([positions, HD / 2] f32, columns `col` 16-byte aligned).
__device__ __forceinline__ void rotate_back8(float (&x1)[8], float (&x2)[8], const float* cos_t, const float* sin_t,
                                             u64 pos, u32 col) {
    const float4* c4 = reinterpret_cast<const float4*>(cos_t + pos * (HD / 2) + col);
    const float4* s4 = reinterpret_cast<const float4*>(sin_t + pos * (HD / 2) + col);
    const float4 ca = c4[0], cb = c4[1], sa = s4[0], sb = s4[1];
    const float c[8] = {ca.x, ca.y, ca.z, ca.w, cb.x, cb.y, cb.z, cb.w};
    const float s[8] = {sa.x, sa.y, sa.z, sa.w, sb.x, sb.y, sb.z, sb.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float a = x1[e], b = x2[e];
        x1[e] = a * c[e] + b * s[e];
        x2[e] = b * c[e] - a * s[e];
    }
}
#endif

extern "C" __global__ void flash_dq_hopper(const float* __restrict__ dq_acc, unsigned short* __restrict__ dq,
#if ROPE
                                           const float* __restrict__ cos_t, const float* __restrict__ sin_t,
#endif
                                           const __grid_constant__ CastInfo info) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= info.chunks) return;
    const float scale = __uint_as_float((u32)info.scale);
#if ROPE
    const u32 per_row = HD / 16;
#else
    const u32 per_row = HD / 8;
#endif
    const u32 col = (u32)(i % per_row) * 8u;
    const u64 row = (i / per_row) % info.seq_q, bh = i / per_row / info.seq_q;
    const u64 h = bh % info.heads, b = bh / info.heads;
    unsigned short* out = dq + b * info.dq_b + h * info.dq_h + row * info.dq_s;
    float x[8];
    sums8(dq_acc + dq_at(bh, row, col, info.rows_pad), scale, x);
#if ROPE
    float y[8];
    sums8(dq_acc + dq_at(bh, row, col + HD / 2, info.rows_pad), scale, y);
    rotate_back8(x, y, cos_t, sin_t, row, col);
    store8(out + col + HD / 2, y);
#endif
    store8(out + col, x);
}
