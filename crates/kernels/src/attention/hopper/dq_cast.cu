// The second kernel of the Hopper FlashAttention backward (backward.cu): dQ from the f32 sums the
// first kernel adds into dq_acc, and the layout of those sums. Compiled at run time by NVRTC for
// sm_90a after common.cuh, alone (the cast needs only these two macros, so it is compiled once per
// head_dim and dtype) or before backward.cu (which adds its parts at `dq_at`):
//   HD        head_dim: 64 or 128
//   IS_BF16   1: bf16 dQ, 0: f16

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
// 8-column chunk a thread: two 16-byte loads (a chunk stays whole under dq_at's swizzle) and one
// 16-byte store.
struct CastInfo {
    u64 heads, seq_q, rows_pad;
    u64 dq_b, dq_h, dq_s;
    // The scale, f32 bits.
    u64 scale;
    // batch * heads * seq_q * HD / 8.
    u64 chunks;
};

extern "C" __global__ void flash_dq_hopper(const float* __restrict__ dq_acc, unsigned short* __restrict__ dq,
                                           const __grid_constant__ CastInfo info) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= info.chunks) return;
    const u32 col = (u32)(i % (HD / 8)) * 8u;
    const u64 row = (i / (HD / 8)) % info.seq_q, bh = i / (HD / 8) / info.seq_q;
    const u64 h = bh % info.heads, b = bh / info.heads;
    const float scale = __uint_as_float((u32)info.scale);
    const float4* src = reinterpret_cast<const float4*>(dq_acc + dq_at(bh, row, col, info.rows_pad));
    const float4 x = src[0], y = src[1];
    uint4 out;
    out.x = pack(x.x * scale, x.y * scale);
    out.y = pack(x.z * scale, x.w * scale);
    out.z = pack(y.x * scale, y.y * scale);
    out.w = pack(y.z * scale, y.w * scale);
    *reinterpret_cast<uint4*>(dq + b * info.dq_b + h * info.dq_h + row * info.dq_s + col) = out;
}
