// FlashAttention backward for Hopper (compute capability 9.0), as FlashAttention-3 builds it: one
// block per block of BN = 128 keys of one (batch, query head), walking the query blocks that see
// them; a producer warp copies with TMA, two consumer warpgroups multiply with `wgmma`, and a
// writer warp adds their dQ parts to an f32 buffer by bulk reductions (`cp.reduce.async.bulk`).
// The CUDA C++ counterpart of the CubeCL dK/dV kernels with the fused dQ (attention/mma/): the
// same gradients, for 16-bit
// inputs at head_dim 64 and 128 without dropout. Compiled at run time by NVRTC for sm_90a (through
// CubeCL, see cuda_source.rs) after common.cuh and dq_cast.cu, with these macros defined before
// all three:
//   HD        head_dim: 64 or 128
//   IS_BF16   1: bf16 inputs and gradients, 0: f16
//   CAUSAL    1: query i sees keys j <= i (aligned at the first position); 0: every key
//   DKV_F32   1: dK and dV are written in f32, one row block per query head (grouped-query
//             attention: the launcher sums each group's heads); 0: in the inputs' dtype
//   ROPE      1: dK is rotated back by RoPE's angle of its key position as it is stored (the
//             gradient of a key that the forward rotated; dQ likewise by the cast, dq_cast.cu),
//             from `cos` and `sin` tables [positions, HD / 2] f32 after dq_acc; 0: as it is.
//             Not with DKV_F32.
//
// Blocks are numbered on a one-dimensional grid, by (batch, head) pair, then key block.
//
// Tensors: q and dout [batch, heads, seq_q, HD], k and v [batch, kv_heads, seq_k, HD] (query head
// h reads k/v head h / group), read through TMA tensor maps (innermost first: HD, seq, heads,
// batch; boxes of 64 columns by a tile's rows, 128-byte swizzle; rows past the end read as zeros);
// lse and delta [batch, heads, seq_q] f32 (the forward's natural log-sum-exp and rowsum(dO * O));
// dk and dv with element strides (b, h, s; the last one 1) at query head h; dq_acc f32, cleared by
// the launcher, in the layout `dq_at` gives (dq_cast.cu), turned into dQ by `flash_dq_hopper`.
//
// Each block holds its keys' K and V (BN x HD each) and a ring of two stages of the query blocks'
// Q and dO (BM x HD each: BM = 128 at head_dim 64, 64 at 128) with their log-sum-exp (times
// log2(e)) and delta rows, which the producer warp copies beside the TMA loads, so that no
// consumer waits for a global load. Consumer warpgroup w owns keys 64w .. 64w + 63 of the block
// and keeps their dK and dV in registers. For each query block:
//   1. S^T = K Q^T and dP^T = V dO^T (`wgmma` m64nBMk16 from shared memory, K-major);
//   2. P^T = exp2(S^T * scale * log2(e) - lse * log2(e)) and dS^T = P^T (dP^T - delta), in
//      registers, the causal mask where the block crosses the diagonal;
//   3. dV += P^T dO and dK += dS^T Q (`wgmma` m64nHDk16, the A operand from registers: the
//      accumulator's fragment of P^T is the A fragment, element for element; dO and Q read
//      transposed, MN-major), dS^T written to shared memory between the two;
//   4. once both warpgroups' halves of dS^T are there, dQ_part = dS K over the block's 128
//      keys: each warpgroup one 64 x 64 part (at head_dim 64 its 64 of the 128 queries, at 128 its
//      64 of the 128 columns), from shared memory read transposed on both sides (`wgmma` m64n64k16);
//   5. the part to shared memory; the writer warp (the producer warpgroup's second) adds it to
//      dq_acc by one bulk reduction, so that the consumers only wait for the previous part's
//      reduction to have read the buffer, and not at all for this one.
// At head_dim 128 (DQ_FIRST) dK is issued after the dQ part instead, so that step 5 runs while dK
// is on the tensor cores.
// At the end dK (times the scale) and dV go to global memory.

#if ROPE && DKV_F32
#error "ROPE takes dK in the inputs' dtype"
#endif

#define BN 128
#if HD == 64
#define BM 128
#else
#define BM 64
#endif
#define THREADS 384
#define KV_BYTES (BN * HD * 2)
#define Q_BYTES (BM * HD * 2)
// One stage of dS^T: BN key rows by BM queries, 16-bit.
#define DS_BYTES (BN * BM * 2)
// One warpgroup's dQ part: 64 x 64 f32.
#define DQ_BYTES (64 * 64 * 4)
// Shared memory from a 1024-byte aligned base: K, V, two stages of Q, two of dO, two of dS^T, a
// dQ part per warpgroup, two stages of a query block's lse and delta rows (BM f32 each), then the
// barriers (K/V full; per stage full and empty), 8 bytes each.
#define SQ_AT (2 * KV_BYTES)
#define SDO_AT (SQ_AT + 2 * Q_BYTES)
#define SDS_AT (SDO_AT + 2 * Q_BYTES)
#define SDQ_AT (SDS_AT + 2 * DS_BYTES)
#define ROWS_AT (SDQ_AT + 2 * DQ_BYTES)
#define BARRIERS_AT (ROWS_AT + 2 * 2 * BM * 4)
#define SMEM_BYTES (BARRIERS_AT + 8 * 5)
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
// Arrivals that complete a stage's full barrier: the producer's expected-bytes arrival and one per
// producer lane once its lse and delta rows are in shared memory.
#define FULL_ARRIVALS 33
// Named barriers (0 is __syncthreads): 3 between both consumer warpgroups; between consumer
// warpgroup w and the writer warp (160 threads), DQ_FULL + w (its part is in shared memory) and
// DQ_EMPTY + w (the previous part's reduction has read it).
#define DQ_FULL 4
#define DQ_EMPTY 6
// Whether dK is issued after the dQ part, so that the part's stores overlap dK's products. Not at
// head_dim 64: there dK's A fragments (dS^T, 32 registers) would stay live across those stores,
// and that order measured the same speed (2026-12-06).
#define DQ_FIRST (HD == 128)

struct Info {
    TensorMap q_map, k_map, v_map, do_map;
    u64 heads;
    u64 group;
    u64 seq_q;
    u64 seq_k;
    // Element strides of dK and dV (batch, head, position).
    u64 dk_b, dk_h, dk_s;
    u64 dv_b, dv_h, dv_s;
    // scale * log2(e) and the scale, f32 bits.
    u64 scale_log2;
    u64 scale;
    // Rows of dq_acc per (batch, head) and column segment: the query blocks times BM.
    u64 rows_pad;
    // Key blocks per (batch, head).
    u64 k_blocks;
};

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 3, 256;\n" ::: "memory"); }
// Named barrier `id` between a consumer warpgroup and the writer warp: waits, or arrives without
// waiting.
__device__ __forceinline__ void writer_sync(u32 id) { asm volatile("bar.sync %0, 160;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void writer_arrive(u32 id) { asm volatile("bar.arrive %0, 160;\n" ::"r"(id) : "memory"); }
// Adds `bytes` of f32 at `src` to `dst` by one bulk reduction (committed).
__device__ __forceinline__ void bulk_add(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
                 "r"(src), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

#if HD == 64
#define wgmma_cols wgmma_rs_n64
#else
#define wgmma_cols wgmma_rs_n128
#endif

// Issues D^T = A_w B^T for warpgroup w's 64 rows of the key tile `a` (K or V) against the BM rows
// of the query tile `b` (Q or dO), both K-major, into `d` (not committed).
__device__ __forceinline__ void issue_rows(float (&d)[BM / 2], u32 a, u32 b, u32 w) {
    issue_kmajor<BN, BM>(d, a + w * (64u * 128u), b);
}

// Issues D += F B: F the 64 x BM fragments (P^T or dS^T), B the query tile (dO or Q, MN-major:
// its 64-column segments are the leading offset apart), not committed.
__device__ __forceinline__ void issue_cols(float (&d)[HD / 2], const u32 (&f)[BM / 16][4], u32 b) {
    fence_regs(d);
    wgmma_fence();
#pragma unroll
    for (int t = 0; t < BM / 16; ++t) wgmma_cols(d, f[t], descriptor(b + (u32)t * 2048u, BM * 128, 1024u));
}

// Issues warpgroup w's dQ part = dS K over the block's BN keys: dS from the dS^T stage `ds` and K
// from `k`, both MN-major (keys are their rows), 64 x 64 into `d` (not committed).
__device__ __forceinline__ void issue_dq(float (&d)[32], u32 ds, u32 k, u32 w) {
#if HD == 64
    const u32 a0 = ds + w * (BN * 128), b0 = k;
#else
    const u32 a0 = ds, b0 = k + w * (BN * 128);
#endif
    fence_regs(d);
    wgmma_fence();
#pragma unroll
    for (int t = 0; t < BN / 16; ++t) {
        const u64 da = descriptor(a0 + (u32)t * 2048u, BN * 128, 1024u);
        const u64 db = descriptor(b0 + (u32)t * 2048u, BN * 128, 1024u);
        wgmma_ss_n64_tt(d, da, db, t > 0 ? 1u : 0u);
    }
}

// Keeps A fragments in their registers until the `wgmma`s that read them have completed.
template <int N>
__device__ __forceinline__ void fence_fragments(u32 (&f)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(f[i][j])::"memory");
}

// `f` in 16 bits as `wgmma`'s A fragments: queries 16t .. 16t + 15 are accumulator groups 2t, 2t + 1.
__device__ __forceinline__ void to_fragments(const float (&s)[BM / 2], u32 (&f)[BM / 16][4]) {
#pragma unroll
    for (int t = 0; t < BM / 16; ++t) {
        f[t][0] = pack(s[8 * t], s[8 * t + 1]);
        f[t][1] = pack(s[8 * t + 2], s[8 * t + 3]);
        f[t][2] = pack(s[8 * t + 4], s[8 * t + 5]);
        f[t][3] = pack(s[8 * t + 6], s[8 * t + 7]);
    }
}

// Writes 64 x HD accumulator rows (times `mul`) to `out` at element strides `rs` (rows) for the
// rows below `rows` (this thread's: r0 and r0 + 8).
__device__ __forceinline__ void store_rows(const float (&a)[HD / 2], void* out, u64 rs, long long r0, long long rows,
                                           u32 col_in, float mul) {
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) {
        const u32 col = (u32)i * 8u + col_in;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const long long r = r0 + 8 * half;
            if (r >= rows) continue;
            const float x = a[i * 4 + 2 * half] * mul, y = a[i * 4 + 2 * half + 1] * mul;
#if DKV_F32
            *reinterpret_cast<float2*>((float*)out + (u64)r * rs + col) = make_float2(x, y);
#else
            *reinterpret_cast<u32*>((unsigned short*)out + (u64)r * rs + col) = pack(x, y);
#endif
        }
    }
}

#if ROPE
// store_rows for dK with RoPE's inverse rotation at the key positions `pos0 + r`: column c < HD / 2
// pairs with c + HD / 2, both held by this thread (`a[i * 4 + ..]` and `a[(i + HD / 16) * 4 + ..]`
// for c = i * 8 + col_in), rotated by the opposite angle: (x1 c + x2 s, x2 c - x1 s).
__device__ __forceinline__ void store_rows_rotated(const float (&a)[HD / 2], void* out, u64 rs, long long r0,
                                                   long long rows, u32 col_in, float mul, const float* cos_t,
                                                   const float* sin_t, u64 pos0) {
#pragma unroll
    for (int i = 0; i < HD / 16; ++i) {
        const u32 col = (u32)i * 8u + col_in;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const long long r = r0 + 8 * half;
            if (r >= rows) continue;
            const u64 at = (pos0 + (u64)r) * (HD / 2) + col;
            const float2 c = *reinterpret_cast<const float2*>(cos_t + at);
            const float2 s = *reinterpret_cast<const float2*>(sin_t + at);
            const int lo = i * 4 + 2 * half, hi = (i + HD / 16) * 4 + 2 * half;
            const float x1 = a[lo] * mul, y1 = a[lo + 1] * mul, x2 = a[hi] * mul, y2 = a[hi + 1] * mul;
            unsigned short* row = (unsigned short*)out + (u64)r * rs;
            *reinterpret_cast<u32*>(row + col) = pack(x1 * c.x + x2 * s.x, y1 * c.y + y2 * s.y);
            *reinterpret_cast<u32*>(row + col + HD / 2) = pack(x2 * c.x - x1 * s.x, y2 * c.y - y1 * s.y);
        }
    }
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS, 1) flash_backward_hopper(
    const unsigned short* __restrict__ q,
    const unsigned short* __restrict__ k,
    const unsigned short* __restrict__ v,
    const unsigned short* __restrict__ dout,
    const float* __restrict__ lse,
    const float* __restrict__ delta,
    void* __restrict__ dk,
    void* __restrict__ dv,
    float* __restrict__ dq_acc,
#if ROPE
    const float* __restrict__ cos_t,
    const float* __restrict__ sin_t,
#endif
    const __grid_constant__ Info info) {
    extern __shared__ unsigned char smem_raw[];
    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const u32 sk = base, sv = base + KV_BYTES;
    auto sq = [&](u32 st) { return base + SQ_AT + st * Q_BYTES; };
    auto sdo = [&](u32 st) { return base + SDO_AT + st * Q_BYTES; };
    auto sds = [&](u32 st) { return base + SDS_AT + st * DS_BYTES; };
    auto sdq = [&](u32 w) { return base + SDQ_AT + w * DQ_BYTES; };
    // Stage st's lse rows (times log2(e)), then its delta rows.
    float* const rows_s = reinterpret_cast<float*>(smem_raw + (ROWS_AT + (base - smem_addr(smem_raw))));
    const u32 bars = base + BARRIERS_AT;
    const u32 kv_full = bars;
    auto full = [&](u32 st) { return bars + 8u * (1u + st); };
    auto empty = [&](u32 st) { return bars + 8u * (3u + st); };
    const u32 tid = threadIdx.x, wg = tid / 128u;

    const long long seq_q = (long long)info.seq_q, seq_k = (long long)info.seq_k;
    // This block's pair and key block (in 32 bits: the launcher's grid is at most 2^31 - 1 blocks).
    const u32 kb = blockIdx.x % (u32)info.k_blocks;
    const u64 bh = blockIdx.x / (u32)info.k_blocks;
    const long long k0 = (long long)kb * BN;
    const u64 h = bh % info.heads, b = bh / info.heads, hk = h / info.group;
    // The query blocks that see this block's keys: under the causal mask, from the one holding
    // query k0 on.
    const long long m_begin = CAUSAL ? k0 / BM : 0, m_end = (seq_q + BM - 1) / BM;
    // The producer and writer warps count in 32 bits (24 registers a thread): query blocks
    // m_begin + i for i below `steps`.
    const u32 steps = m_begin < m_end ? (u32)(m_end - m_begin) : 0u;

    if (tid == 0) {
        bar_init(kv_full, 1);
        for (u32 st = 0; st < 2; ++st) {
            bar_init(full(st), FULL_ARRIVALS);
            // One arrival per consumer warp.
            bar_init(empty(st), 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
        const u32 lane = tid % 32u;
        if (tid < 32u && steps > 0) {
            // The producer warp: lane 0 issues the copies, every lane copies rows.
            if (lane == 0) {
                bar_expect(kv_full, 2 * KV_BYTES);
#pragma unroll
                for (int seg = 0; seg < HD / 64; ++seg) {
                    tma_load(sk + seg * (BN * 128), &info.k_map, kv_full, seg * 64, (int)k0, (int)hk, (int)b);
                    tma_load(sv + seg * (BN * 128), &info.v_map, kv_full, seg * 64, (int)k0, (int)hk, (int)b);
                }
            }
            const float* lse_rows = lse + bh * info.seq_q + m_begin * BM;
            const float* delta_rows = delta + bh * info.seq_q + m_begin * BM;
            int rows_left = (int)(seq_q - m_begin * BM);
            for (u32 i = 0; i < steps; ++i, lse_rows += BM, delta_rows += BM, rows_left -= BM) {
                const u32 st = i & 1u, parity = (i >> 1) & 1u;
                const int m = (int)m_begin + (int)i;
                bar_wait(empty(st), parity ^ 1u);
                if (lane == 0) {
                    bar_expect(full(st), 2 * Q_BYTES);
#pragma unroll
                    for (int seg = 0; seg < HD / 64; ++seg) {
                        tma_load(sq(st) + seg * (BM * 128), &info.q_map, full(st), seg * 64, m * BM, (int)h, (int)b);
                        tma_load(sdo(st) + seg * (BM * 128), &info.do_map, full(st), seg * 64, m * BM, (int)h,
                                 (int)b);
                    }
                }
                // Rows past the end take lse +inf (P = 0) and delta 0.
                float* stage_rows = rows_s + st * (2 * BM);
#pragma unroll
                for (u32 j = 0; j < BM / 32; ++j) {
                    const int r = (int)(lane + 32u * j);
                    stage_rows[r] = r < rows_left ? lse_rows[r] * 1.4426950408889634f : __int_as_float(0x7f800000);
                    stage_rows[BM + r] = r < rows_left ? delta_rows[r] : 0.f;
                }
                bar_arrive(full(st));
            }
        } else if (tid < 64u && steps > 0) {
            // The writer warp: each step's two dQ parts to dq_acc. Warpgroup w's part of query
            // block m is at `part0 + w * part_w + m * BM * 64` (row m * BM is a multiple of 8, so
            // the swizzle leaves the part's first element in place).
            float* part0 = dq_acc + dq_at(bh, (u64)m_begin * BM, 0, info.rows_pad);
#if HD == 64
            const u32 part_w = 64u * 64u;
#else
            const u64 part_w = info.rows_pad * 64u;
#endif
            writer_arrive(DQ_EMPTY);
            writer_arrive(DQ_EMPTY + 1);
            for (u32 i = 0; i < steps; ++i, part0 += BM * 64) {
#pragma unroll
                for (u32 w = 0; w < 2; ++w) {
                    writer_sync(DQ_FULL + w);
                    if (lane == 0) bulk_add(part0 + w * part_w, sdq(w), DQ_BYTES);
                    __syncwarp();
                }
                if (i + 1 < steps) {
                    if (lane == 0) bulk_wait_read();
                    __syncwarp();
                    writer_arrive(DQ_EMPTY);
                    writer_arrive(DQ_EMPTY + 1);
                }
            }
            if (lane == 0) bulk_wait_all();
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
    const u32 w = wg - 1u, t = tid % 128u, warp = t / 32u, lane = tid % 32u;
    const u32 col_in = (lane % 4u) * 2u;
    const float scale_log2 = __uint_as_float((u32)info.scale_log2);
    // This thread's two key rows (`wgmma`'s accumulator layout): r0 holds accumulator elements
    // 4i, 4i + 1, r0 + 8 holds 4i + 2, 4i + 3, at columns 8i + 2 (lane % 4) and the next.
    const u32 r0 = w * 64u + warp * 16u + lane / 4u;
    const long long key0 = k0 + r0, key1 = key0 + 8;

    float dkr[HD / 2], dvr[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) {
        dkr[i] = 0.f;
        dvr[i] = 0.f;
    }
    if (m_begin < m_end) bar_wait(kv_full, 0);
    for (long long m = m_begin, i = 0; m < m_end; ++m, ++i) {
        const u32 st = (u32)(i & 1), parity = (u32)((i >> 1) & 1);
        const long long q0 = m * BM;
        bar_wait(full(st), parity);
        const float* lse_s = rows_s + st * (2 * BM);
        const float* delta_s = lse_s + BM;
        float s[BM / 2], dp[BM / 2];
        issue_rows(s, sk, sq(st), w);
        wgmma_commit();
        issue_rows(dp, sv, sdo(st), w);
        wgmma_commit();
        wgmma_wait<1>();
        fence_regs(s);
#pragma unroll
        for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const u32 c = (u32)j * 8u + col_in + (e & 1);
                s[j * 4 + e] = ex2(fmaf(s[j * 4 + e], scale_log2, -lse_s[c]));
            }
        }
        // The mask, in blocks that cross the diagonal or hold keys past the end: those keys'
        // zero rows would get exp(-lse), infinite where a row's scores are all far below 0, and
        // dQ would take inf * 0.
        if ((CAUSAL && q0 < k0 + BN - 1) || k0 + BN > seq_k) {
#pragma unroll
            for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const long long key = e < 2 ? key0 : key1, query = q0 + j * 8 + col_in + (e & 1);
                    if (key >= seq_k || (CAUSAL && key > query)) s[j * 4 + e] = 0.f;
                }
            }
        }
        wgmma_wait<0>();
        fence_regs(dp);
#pragma unroll
        for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const u32 c = (u32)j * 8u + col_in + (e & 1);
                dp[j * 4 + e] = s[j * 4 + e] * (dp[j * 4 + e] - delta_s[c]);
            }
        }
        u32 pf[BM / 16][4], df[BM / 16][4];
        to_fragments(s, pf);
        to_fragments(dp, df);
        issue_cols(dvr, pf, sdo(st));
#if DQ_FIRST
        wgmma_commit();
#endif
        // dS^T to its stage (read from df before a `wgmma` takes df as its A operand: registers of
        // an uncompleted `wgmma` must not be read).
        // Key row r, query c at segment c / 64, line r, chunk (c % 64) / 8 ^ r % 8.
        {
            const u32 ds = sds((u32)(i & 1));
#pragma unroll
            for (int j = 0; j < BM / 16; ++j) {
#pragma unroll
                for (int x = 0; x < 4; ++x) {
                    const u32 r = r0 + (x & 1) * 8u;
                    const u32 c = (u32)j * 16u + (x >> 1) * 8u + col_in;
                    const u32 at = ds + (c / 64u) * (BN * 128) + r * 128u + ((((c % 64u) / 8u) ^ (r % 8u)) * 16u) +
                                   (c % 8u) * 2u;
                    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(at), "r"(df[j][x]) : "memory");
                }
            }
        }
#if !DQ_FIRST
        issue_cols(dkr, df, sq(st));
        wgmma_commit();
#endif
        fence_async_shared();
        consumers_sync();
        float dq[32];
        issue_dq(dq, sds((u32)(i & 1)), sk, w);
        wgmma_commit();
#if DQ_FIRST
        // dK after the dQ part: once the part is done, it goes out while dK is on the tensor cores.
        issue_cols(dkr, df, sq(st));
        wgmma_commit();
        // dV and the dQ part are done (groups complete in order); dK may still run.
        wgmma_wait<1>();
        fence_regs(dvr);
        fence_regs(dq);
        fence_fragments(pf);
#else
        wgmma_wait<0>();
        fence_regs(dkr);
        fence_regs(dvr);
        fence_regs(dq);
        fence_fragments(pf);
        fence_fragments(df);
        if (lane == 0) bar_arrive(empty(st));
#endif
        // The part to shared memory once the previous part's reduction has read it; the writer
        // warp adds it to dq_acc.
        writer_sync(DQ_EMPTY + w);
        {
            float* part = reinterpret_cast<float*>(smem_raw + (SDQ_AT + (base - smem_addr(smem_raw)))) + w * 64 * 64;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const u32 r = warp * 16u + lane / 4u + 8u * half, c = (u32)j * 8u + col_in;
                    *reinterpret_cast<float2*>(part + r * 64u + (c ^ ((r & 7u) << 3))) =
                        make_float2(dq[j * 4 + 2 * half], dq[j * 4 + 2 * half + 1]);
                }
            }
        }
        fence_async_shared();
        writer_arrive(DQ_FULL + w);
#if DQ_FIRST
        wgmma_wait<0>();
        fence_regs(dkr);
        fence_fragments(df);
        // This step's Q and dO are read (dV and dK done).
        if (lane == 0) bar_arrive(empty(st));
#endif
    }

    const float scale = __uint_as_float((u32)info.scale);
#if ROPE
    store_rows_rotated(dkr, (char*)dk + (b * info.dk_b + h * info.dk_h + (u64)k0 * info.dk_s) * 2, info.dk_s, r0,
                       seq_k - k0, col_in, scale, cos_t, sin_t, (u64)k0);
#else
    store_rows(dkr, (char*)dk + (b * info.dk_b + h * info.dk_h + (u64)k0 * info.dk_s) * (DKV_F32 ? 4 : 2), info.dk_s,
               r0, seq_k - k0, col_in, scale);
#endif
    store_rows(dvr, (char*)dv + (b * info.dv_b + h * info.dv_h + (u64)k0 * info.dv_s) * (DKV_F32 ? 4 : 2), info.dv_s,
               r0, seq_k - k0, col_in, 1.f);
}
