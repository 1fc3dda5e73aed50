// FlashAttention forward for Hopper (compute capability 9.0): warpgroup MMA (`wgmma`) from
// shared memory, the online softmax in registers, P fed back to the tensor cores from registers.
// The CUDA C++ counterpart of the CubeCL kernel `flash_forward_mma` (attention/mma/forward.rs):
// the same inputs, output and log-sum-exp, for 16-bit inputs at head_dim 64 and 128 without
// dropout. Compiled at run time by NVRTC for sm_90a (through CubeCL, see cuda_source.rs) with
// these macros defined before this text:
//   HD        head_dim: 64 or 128
//   IS_BF16   1: bf16 inputs and output, 0: f16
//   CAUSAL    1: query i sees keys j <= i (aligned at the first position, as PyTorch's
//             `is_causal`); 0: every key
//
// Tensors (element strides, the last dimension contiguous): q [batch, heads, seq_q, HD],
// k and v [batch, kv_heads, seq_k, HD] (query head h reads k/v head h / group), out
// [batch, heads, seq_q, HD] and lse [batch, heads, seq_q] (f32, contiguous): the natural
// log-sum-exp of each query row's scaled scores, which the backward recomputes P from.
//
// A block of 256 threads (two warpgroups) owns BR = 128 query rows, each warpgroup 64 of them,
// and walks the key/value blocks of BC = 128 keys. Q and three stages of K and V live in shared
// memory in the layout `wgmma` reads with its 128-byte swizzle: each tile is split into HD / 64
// column segments of 64 elements (128 bytes a row), a segment's rows are consecutive 128-byte
// lines, and the 16-byte chunk c of row r sits at chunk c ^ (r % 8) of its line. Every thread
// copies (cp.async, 16 bytes each); block j + 2's copies are in flight while blocks j and j + 1
// are computed. Each warpgroup:
//   1. S = Q K^T: HD / 16 `wgmma` m64n128k16 from shared memory (both operands K-major);
//   2. the online softmax on S in registers (scores scaled by scale * log2(e), exp2 through
//      `ex2.approx`), rescaling the output accumulator when a row's maximum grows;
//   3. O += P V: P converted to 16 bits in the registers `wgmma` takes its A operand from (the
//      accumulator's fragment of S is the A fragment of P, element for element), V from shared
//      memory read transposed (MN-major), BC / 16 `wgmma` m64nHDk16.
// Steps 1 and 3 of consecutive blocks overlap (FlashAttention-3's intra-warpgroup pipelining):
// block j + 1's scores and block j's P V are issued together, and block j + 1's softmax runs
// while P V is still on the tensor cores; only the rescaling of O waits for it.

typedef unsigned int u32;
typedef unsigned long long u64;

#if IS_BF16
#define ELT "bf16"
#define CVT_PAIR "cvt.rn.bf16x2.f32"
#else
#define ELT "f16"
#define CVT_PAIR "cvt.rn.f16x2.f32"
#endif

#define BR 128
#define BC 128
#define THREADS 256
// 128-byte column segments per row of a tile.
#define SEGS (HD / 64)
#define Q_BYTES (BR * HD * 2)
#define KV_BYTES (BC * HD * 2)
// K/V stages: block j + 2 is copied while block j + 1's scores and block j's P V are computed.
#define STAGES 3
#define SMEM_BYTES (Q_BYTES + 2 * STAGES * KV_BYTES)

struct Info {
    u64 heads;
    u64 group;
    u64 seq_q;
    u64 seq_k;
    u64 q_b, q_h, q_s;
    u64 k_b, k_h, k_s;
    u64 v_b, v_h, v_s;
    u64 o_b, o_h, o_s;
    // scale * log2(e), f32 bits.
    u64 scale_log2;
};

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{\n.reg .u64 a;\ncvta.to.shared.u64 a, %1;\ncvt.u32.u64 %0, a;\n}\n" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ float ex2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ float lg2(float x) {
    float r;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// Two f32 values as one word of 16-bit values, `lo` in the low half.
__device__ __forceinline__ u32 pack(float lo, float hi) {
    u32 r;
    asm(CVT_PAIR " %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, u32 bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
// Shared memory written through the generic proxy (cp.async) and read next by `wgmma` (the async
// proxy): each writer fences before the barrier that publishes it.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Keeps the compiler from reading or moving accumulator registers across a `wgmma` wait.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// A `wgmma` shared-memory matrix descriptor with the 128-byte swizzle: start address, leading and
// stride byte offsets (each in units of 16 bytes). K-major operands (Q, K) step by 8-row groups
// of 1024 bytes (the stride offset; their leading offset is unused); the MN-major operand (V)
// also steps by 64-column segments (the leading offset).
__device__ __forceinline__ u64 descriptor(u32 addr, u32 leading, u32 stride) {
    return (u64)((addr >> 4) & 0x3FFFu) | ((u64)((leading >> 4) & 0x3FFFu) << 16) |
           ((u64)((stride >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], u64 a, u64 b, u32 accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." ELT "." ELT " {"
        "%0, %1, %2, %3, %4, %5, %6, %7, "
        "%8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, "
        "%24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, "
        "%56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const u32 (&a)[4], u64 b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." ELT "." ELT " {"
        "%0, %1, %2, %3, %4, %5, %6, %7, "
        "%8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, "
        "%24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1u));
}

__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const u32 (&a)[4], u64 b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." ELT "." ELT " {"
        "%0, %1, %2, %3, %4, %5, %6, %7, "
        "%8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, "
        "%24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, "
        "%56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1u));
}

#if HD == 64
#define wgmma_pv wgmma_rs_n64
#else
#define wgmma_pv wgmma_rs_n128
#endif

// Copies rows [0, ROWS) of a [rows, HD] tile (row stride `stride` elements) to `dst` in the
// swizzled layout, 16 bytes a copy; rows at or past `valid` are filled with zeros.
template <int ROWS>
__device__ __forceinline__ void load_tile(u32 dst, const unsigned short* src, u64 stride, long long valid) {
    constexpr int CHUNKS = HD / 8;
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / THREADS; ++i) {
        const int idx = (int)threadIdx.x + i * THREADS;
        const int r = idx / CHUNKS, c = idx % CHUNKS;
        const u32 d = dst + (u32)(c / 8) * (ROWS * 128) + (u32)r * 128u + ((u32)((c % 8) ^ (r & 7)) << 4);
        const bool inside = r < valid;
        cp_async_16(d, inside ? (const void*)(src + (u64)r * stride + (u64)c * 8u) : (const void*)src, inside ? 16u : 0u);
    }
}

// Issues S = Q K^T for this warpgroup's 64 query rows against the BC keys of `k_tile` (both
// K-major), into `s` (not committed).
__device__ __forceinline__ void issue_scores(float (&s)[BC / 2], u32 sq, u32 k_tile, u32 wg) {
#pragma unroll
    for (int i = 0; i < BC / 2; ++i) s[i] = 0.f;
    fence_regs(s);
    wgmma_fence();
#pragma unroll
    for (int t = 0; t < HD / 16; ++t) {
        // k steps of 16 columns (32 bytes) within a 128-byte segment.
        const u32 seg = (u32)t / 4u, within = ((u32)t % 4u) * 32u;
        const u64 da = descriptor(sq + seg * (BR * 128) + wg * (64 * 128) + within, 16u, 1024u);
        const u64 db = descriptor(k_tile + seg * (BC * 128) + within, 16u, 1024u);
        wgmma_ss_n128(s, da, db, t > 0 ? 1u : 0u);
    }
}

// Issues O += P V for the BC keys of `v_tile` (MN-major: its 64-column segments are the leading
// offset apart), P from registers (not committed).
__device__ __forceinline__ void issue_pv(float (&o)[HD / 2], const u32 (&p)[BC / 16][4], u32 v_tile) {
    fence_regs(o);
    wgmma_fence();
#pragma unroll
    for (int t = 0; t < BC / 16; ++t) {
        // Keys 16t .. 16t + 15: two 8-row groups of 1024 bytes.
        wgmma_pv(o, p[t], descriptor(v_tile + (u32)t * 2048u, BC * 128, 1024u));
    }
}

// The scores of keys at or past seq_k, and under the causal mask of keys after their query row,
// to -inf (a block that needs it: at the end of the keys or on the diagonal).
__device__ __forceinline__ void mask_scores(float (&s)[BC / 2], long long kv0, long long seq_k, long long row0,
                                            long long row1, u32 col_in) {
#pragma unroll
    for (int i = 0; i < BC / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const long long col = kv0 + i * 8 + col_in + (e & 1);
            const long long row = e < 2 ? row0 : row1;
            if (col >= seq_k || (CAUSAL && col > row)) s[i * 4 + e] = __int_as_float(0xff800000);
        }
    }
}

// The online softmax's step over one block of scores, for this thread's two rows: the new
// maxima (of the scores times scale * log2(e), over the row's four lanes) into m, s turned into
// exp2(s * scale_log2 - m), the factors that rescale what the old maxima weighted into alpha, and
// this thread's share of the new terms into sum.
__device__ __forceinline__ void softmax_step(float (&s)[BC / 2], float scale_log2, float (&m)[2], float (&alpha)[2],
                                             float (&sum)[2]) {
    const float neg_inf = __int_as_float(0xff800000);
    float x[2] = {neg_inf, neg_inf};
#pragma unroll
    for (int i = 0; i < BC / 8; ++i) {
        x[0] = fmaxf(x[0], fmaxf(s[i * 4], s[i * 4 + 1]));
        x[1] = fmaxf(x[1], fmaxf(s[i * 4 + 2], s[i * 4 + 3]));
    }
    float u[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        x[r] = fmaxf(x[r], __shfl_xor_sync(0xffffffffu, x[r], 1));
        x[r] = fmaxf(x[r], __shfl_xor_sync(0xffffffffu, x[r], 2));
        const float n = fmaxf(m[r], x[r] * scale_log2);
        // A row with no visible key yet keeps the maximum -inf: subtract 0 from its -inf scores.
        u[r] = n == neg_inf ? 0.f : n;
        alpha[r] = ex2(m[r] - u[r]);
        m[r] = n;
        sum[r] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < BC / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[i * 4 + e] = ex2(fmaf(s[i * 4 + e], scale_log2, -u[e >> 1]));
            sum[e >> 1] += s[i * 4 + e];
        }
    }
}

// P in 16 bits as `wgmma`'s A fragments: keys 16t .. 16t + 15 are accumulator groups 2t, 2t + 1.
__device__ __forceinline__ void to_fragments(const float (&s)[BC / 2], u32 (&p)[BC / 16][4]) {
#pragma unroll
    for (int t = 0; t < BC / 16; ++t) {
        p[t][0] = pack(s[8 * t], s[8 * t + 1]);
        p[t][1] = pack(s[8 * t + 2], s[8 * t + 3]);
        p[t][2] = pack(s[8 * t + 4], s[8 * t + 5]);
        p[t][3] = pack(s[8 * t + 6], s[8 * t + 7]);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) flash_forward_hopper(
    const unsigned short* __restrict__ q,
    const unsigned short* __restrict__ k,
    const unsigned short* __restrict__ v,
    unsigned short* __restrict__ out,
    float* __restrict__ lse,
    const __grid_constant__ Info info) {
    extern __shared__ unsigned char smem_raw[];
    // The swizzle is a function of the address bits: tiles start on 1024-byte boundaries.
    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const u32 sq = base;
    // Block j's keys and values: stage j % STAGES.
    const u32 sk = base + Q_BYTES, sv = sk + STAGES * KV_BYTES;

    const u64 bh = blockIdx.y;
    const u64 h = bh % info.heads, b = bh / info.heads;
    const u64 kvh = h / info.group;
    // Under the causal mask the last query blocks have the most keys: they start first.
    const u32 qb = CAUSAL ? gridDim.x - 1u - blockIdx.x : blockIdx.x;
    const long long q0 = (long long)qb * BR;
    const long long seq_q = (long long)info.seq_q, seq_k = (long long)info.seq_k;
    const unsigned short* qp = q + b * info.q_b + h * info.q_h + (u64)q0 * info.q_s;
    const unsigned short* kp = k + b * info.k_b + kvh * info.k_h;
    const unsigned short* vp = v + b * info.v_b + kvh * info.v_h;

    long long blocks = (seq_k + BC - 1) / BC;
    if (CAUSAL) {
        const long long seen = (q0 + BR - 1) / BC + 1;
        blocks = blocks < seen ? blocks : seen;
    }

    const u32 tid = threadIdx.x, wg = tid / 128u, warp = (tid / 32u) % 4u, lane = tid % 32u;
    // This thread's two rows of the warpgroup's 64 (`wgmma`'s accumulator layout): row0 holds
    // accumulator elements 4i, 4i + 1, row1 = row0 + 8 holds 4i + 2, 4i + 3, at columns
    // 8i + 2 (lane % 4) and the next.
    const long long row0 = q0 + wg * 64u + warp * 16u + lane / 4u, row1 = row0 + 8;
    const u32 col_in = (lane % 4u) * 2u;
    const float scale_log2 = __uint_as_float((u32)info.scale_log2);
    const float neg_inf = __int_as_float(0xff800000);
    // Whether block j's scores need the mask.
    auto masked = [&](long long j) { return (j + 1) * BC > seq_k || (CAUSAL && (j + 1) * BC - 1 > q0); };
    auto load_block = [&](long long j) {
        const u32 st = (u32)(j % STAGES);
        const long long kv0 = j * BC;
        load_tile<BC>(sk + st * KV_BYTES, kp + (u64)kv0 * info.k_s, info.k_s, seq_k - kv0);
        load_tile<BC>(sv + st * KV_BYTES, vp + (u64)kv0 * info.v_s, info.v_s, seq_k - kv0);
        cp_async_commit();
    };

    // Q and block 0 in one group, block 1 in the next.
    load_tile<BR>(sq, qp, info.q_s, seq_q - q0);
    load_block(0);
    if (blocks > 1) {
        load_block(1);
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    fence_proxy_async();
    __syncthreads();

    float s[BC / 2];
    float o[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
    u32 p[BC / 16][4];
    // Running maxima (of the scores times scale * log2(e)) and this thread's partial sums.
    float m[2] = {neg_inf, neg_inf}, l[2] = {0.f, 0.f}, alpha[2], sum[2];

    issue_scores(s, sq, sk, wg);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s);
    if (masked(0)) mask_scores(s, 0, seq_k, row0, row1, col_in);
    softmax_step(s, scale_log2, m, alpha, sum);
    l[0] = sum[0];
    l[1] = sum[1];
    to_fragments(s, p);

    // Iteration j: block j + 1's scores and block j's P V on the tensor cores together, then
    // block j + 1's softmax while P V finishes.
    for (long long j = 0; j < blocks; ++j) {
        const u32 st = (u32)(j % STAGES);
        if (j + 1 < blocks) {
            cp_async_wait<0>();
            fence_proxy_async();
            // Block j + 1 has landed for every thread, and every thread is done with block
            // j - 1, whose stage block j + 2 takes.
            __syncthreads();
            if (j + 2 < blocks) load_block(j + 2);
            issue_scores(s, sq, sk + (u32)((j + 1) % STAGES) * KV_BYTES, wg);
            wgmma_commit();
            issue_pv(o, p, sv + st * KV_BYTES);
            wgmma_commit();
            wgmma_wait<1>();
            fence_regs(s);
            if (masked(j + 1)) mask_scores(s, (j + 1) * BC, seq_k, row0, row1, col_in);
            softmax_step(s, scale_log2, m, alpha, sum);
            wgmma_wait<0>();
            fence_regs(o);
#pragma unroll
            for (int i = 0; i < HD / 8; ++i) {
                o[i * 4] *= alpha[0];
                o[i * 4 + 1] *= alpha[0];
                o[i * 4 + 2] *= alpha[1];
                o[i * 4 + 3] *= alpha[1];
            }
            l[0] = l[0] * alpha[0] + sum[0];
            l[1] = l[1] * alpha[1] + sum[1];
            to_fragments(s, p);
        } else {
            issue_pv(o, p, sv + st * KV_BYTES);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(o);
        }
    }

    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        inv[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
    }
    unsigned short* op = out + b * info.o_b + h * info.o_h;
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) {
        const u32 col = (u32)i * 8u + col_in;
        if (row0 < seq_q)
            *reinterpret_cast<u32*>(op + (u64)row0 * info.o_s + col) = pack(o[i * 4] * inv[0], o[i * 4 + 1] * inv[0]);
        if (row1 < seq_q)
            *reinterpret_cast<u32*>(op + (u64)row1 * info.o_s + col) = pack(o[i * 4 + 2] * inv[1], o[i * 4 + 3] * inv[1]);
    }
    if (lane % 4u == 0u) {
        const float ln2 = 0.6931471805599453f;
        float* lp = lse + bh * info.seq_q;
        if (row0 < seq_q) lp[row0] = (m[0] + lg2(l[0])) * ln2;
        if (row1 < seq_q) lp[row1] = (m[1] + lg2(l[1])) * ln2;
    }
}
