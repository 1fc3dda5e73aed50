// FlashAttention forward for Hopper (compute capability 9.0), as FlashAttention-3 builds it: TMA
// copies by a producer warp, warpgroup MMA (`wgmma`) from shared memory in consumer warpgroups
// that take the producer's registers, the online softmax in registers with P fed back to the
// tensor cores from registers, and the consumers' GEMMs issued in turn so that one warpgroup's
// softmax runs while another's products are on the tensor cores. The CUDA C++ counterpart of the
// CubeCL kernel `flash_forward_mma` (attention/mma/forward.rs): the same inputs, output and
// log-sum-exp, for 16-bit inputs (or, with FP8, their e4m3 copies) at head_dim 64 and 128 without
// dropout. Compiled at run time by
// NVRTC for sm_90a (through CubeCL, see cuda_source.rs) with these macros defined before this
// text:
//   HD        head_dim: 64 or 128
//   IS_BF16   1: bf16 output (and inputs, without FP8), 0: f16
//   CAUSAL    1: query i sees keys j <= i (aligned at the first position, as PyTorch's
//             `is_causal`); 0: every key
//   CONSUMERS consumer warpgroups, each of 64 query rows (2 or 3)
//   STAGES    key/value blocks in shared memory at once (the launcher takes 2; 4 with FP8)
//   FP8       1: e4m3 inputs with block scales (see "FP8" below; its tiles, boxes, swizzle and
//             products differ from the 16-bit ones described next); 0 or undefined: 16-bit
//
// Tensors: q [batch, heads, seq_q, HD], k and v [batch, kv_heads, seq_k, HD] (query head h reads
// k/v head h / group), each read through a TMA tensor map the launcher encodes (innermost first:
// HD, seq, heads, batch; boxes of 64 columns by a tile's rows, 128-byte swizzle; rows past the end
// read as zeros); out [batch, heads, seq_q, HD] (element strides, the last one 1; in 16 bits
// written through its own map, boxes of 64 columns by 64 rows, rows past the end dropped) and lse
// [batch, heads, seq_q] (f32, contiguous): the natural log-sum-exp of each query row's scaled
// scores, which the backward recomputes P from.
//
// The work is split into tiles of BR = 64 * CONSUMERS query rows of one (batch, head), each
// walking the key/value blocks of BC = 128 keys; blocks are persistent (one per SM) and take the
// tiles in turn (see `Tile`). A block's first warpgroup is the producer: one thread copies each
// tile's Q into one of two buffers (the next tile's Q lands while the current one finishes) and
// each key/value block into a ring of STAGES stages (a "full" barrier per buffer and stage that
// the copy completes, an "empty" barrier that the consumers release), and the warpgroup gives up
// its registers (`setmaxnreg`) to the consumers. Tiles are in the layout `wgmma` reads with the 128-byte swizzle (what TMA writes):
// each is split into HD / 64 column segments of 64 elements, a segment's rows are consecutive
// 128-byte lines, and the 16-byte chunk c of row r sits at chunk c ^ (r % 8) of its line. Each
// consumer warpgroup:
//   1. S = Q K^T: HD / 16 `wgmma` m64n128k16 from shared memory (both operands K-major);
//   2. the online softmax on S in registers (scores scaled by scale * log2(e), exp2 through
//      `ex2.approx`), rescaling the output accumulator when a row's maximum grows;
//   3. O += P V: P converted to 16 bits in the registers `wgmma` takes its A operand from (the
//      accumulator's fragment of S is the A fragment of P, element for element), V from shared
//      memory read transposed (MN-major), BC / 16 `wgmma` m64nHDk16.
// Block j + 1's scores and block j's P V are issued together, and the warpgroups issue their
// products in turn (named barriers), so the tensor cores take one warpgroup's products while the
// others compute their softmax. (ptxas places the wait for P V before block j + 1's softmax, to
// interleave the conversion to P with the exponentials, so a softmax does not overlap its own
// warpgroup's P V; a wait kept after the softmax measured no faster.) Across tiles: a tile's last
// P V and the next tile's first scores are issued together, and the tile's output is written
// while those scores run: in 16 bits, each consumer puts its rows in its share of the tile's Q
// buffer (which its scores are done with; `stmatrix`, in the layout of the output's tensor map)
// and one of its threads stores them by TMA, so that its warps go on at once; the buffer goes
// back to the producer after the next tile's first softmax, once the store has read it. (FP8's
// Q buffer is half the output's size: it stores its output from registers.)
//
// FP8 (FlashAttention-3's recipe, block scales): q, k [.., seq, HD] and vt [batch, kv_heads, HD,
// keys] in e4m3, vt being V transposed with its keys padded to a multiple of 32 (zeros) and put in
// the order `to_fragments` gives P in: within each 32 keys, position 16h + 4t + e (h < 2, t < 4,
// e < 4) holds key 16h + 8(e / 2) + 2t + e % 2. Each tensor has an f32 scale (the value of a code
// of 1) per block: q per 64 rows, k and vt per 128 keys, of each (batch, head), laid out [batch,
// heads, blocks]. Both products take e4m3 operands K-major (`wgmma` m64nNk32): S = Q K^T, its
// scale q_scale * k_scale folded into the softmax's; P = exp2(. - max + 8), in [0, 256] so that
// small terms keep e4m3's precision, converted to e4m3 in registers; O += P V^T's keys. The
// accumulator O is kept in units of the current key block's v scale: the rescale by the softmax's
// alpha also takes the ratio of consecutive blocks' v scales, and the end multiplies by the last.

// This text follows common.cuh (the shared helpers) in one source.

#ifndef FP8
#define FP8 0
#endif

#define BR (64 * CONSUMERS)
#define BC 128
#define THREADS (128 * (CONSUMERS + 1))
#if FP8
// One segment of HD-byte rows (Q, K) or of BC-byte rows (V^T); P's fragments cover 32 keys.
#define ELT_BYTES 1
#define SEGMENTS 1
#define P_STEPS (BC / 32)
#else
#define ELT_BYTES 2
#define SEGMENTS (HD / 64)
#define P_STEPS (BC / 16)
#endif
#define Q_BYTES (BR * HD * ELT_BYTES)
#define KV_BYTES (BC * HD * ELT_BYTES)
// Shared memory from a 1024-byte aligned base: two Q buffers (a block's next tile is copied while
// it finishes the current one; in 16 bits a tile's buffer also holds its output on the way to the
// TMA store), the K stages, the V stages, then the barriers (per Q buffer full and empty; per
// stage k full, k empty, v full, v empty), 8 bytes each.
#define BARRIERS_AT (2 * Q_BYTES + 2 * STAGES * KV_BYTES)
#define SMEM_BYTES (BARRIERS_AT + 8 * (4 + 4 * STAGES))
// Registers a thread keeps after the hand-over: the producer's few, the consumers' share of the
// rest of the 64K (the launch gives each thread 65536 / THREADS, rounded down to 8).
#if CONSUMERS == 2
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
#else
#define PRODUCER_REGS 32
#define CONSUMER_REGS 160
#endif

struct Info {
    TensorMap q_map, k_map, v_map, o_map;
    u64 heads;
    u64 group;
    u64 seq_q;
    u64 seq_k;
    u64 o_b, o_h, o_s;
    // scale * log2(e), f32 bits.
    u64 scale_log2;
    // Query blocks per (batch, head), batch * heads, and the (batch, head) pairs a section of
    // the tile order holds (see `Tile`).
    u64 q_blocks, bh_count, section;
};

// One tile of the work: a block of BR query rows of one (batch, head). Blocks are persistent:
// in round n, block i takes tile n * gridDim.x + i. Without the mask, the tiles go by (batch,
// head) pair, then by query block. Under the causal mask, where tiles' work differs, they go
// through sections of `section` pairs whose keys and values fit in L2 together, and within a
// section by query block, the ones with the most keys (the last) first, then by pair; and block
// i takes tile n * gridDim.x + gridDim.x - 1 - i in odd rounds, so that a block that took one of
// the heavier tiles of a round takes one of the lighter ones of the next.
struct Tile {
    u64 b, h;
    long long q0;
    // Key blocks the tile reads.
    long long blocks;

    // Round n's tile for this block, or `tiles` (none) past the end.
    static __device__ __forceinline__ u64 index(u64 n, u64 tiles) {
        const u64 i = (CAUSAL && (n & 1)) ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
        const u64 t = n * gridDim.x + i;
        return t < tiles ? t : tiles;
    }

    // In 32 bits: the launcher refuses 2^32 tiles or more, and a 64-bit division takes many
    // times the instructions of a 32-bit one (at every tile's start: six under the causal mask,
    // four without).
    __device__ __forceinline__ Tile(u64 tile, const Info& info) {
        const u32 t = (u32)tile, q_blocks = (u32)info.q_blocks, heads = (u32)info.heads;
#if CAUSAL
        const u32 section = (u32)info.section, bh_count = (u32)info.bh_count;
        const u32 per_section = section * q_blocks;
        const u32 sec = t / per_section, r = t - sec * per_section;
        const u32 first = sec * section;
        const u32 len = bh_count - first < section ? bh_count - first : section;
        const u32 qi = r / len, bh = first + (r - qi * len);
#else
        const u32 bh = t / q_blocks, qi = t - bh * q_blocks;
#endif
        const u32 qb = CAUSAL ? q_blocks - 1 - qi : qi;
        b = bh / heads;
        h = bh - (u32)b * heads;
        q0 = (long long)qb * BR;
        const long long seq_k = (long long)info.seq_k;
        blocks = (seq_k + BC - 1) / BC;
        if (CAUSAL) {
            const long long seen = (q0 + BR - 1) / BC + 1;
            blocks = blocks < seen ? blocks : seen;
        }
    }
};

// The consumers' turns at the tensor cores: named barrier 1 + i is consumer i's turn, which the
// consumer before it grants after issuing its products.
__device__ __forceinline__ void turn_wait(u32 consumer) {
    asm volatile("bar.sync %0, 256;\n" ::"r"(1u + consumer) : "memory");
}
__device__ __forceinline__ void turn_grant(u32 consumer) {
    asm volatile("bar.arrive %0, 256;\n" ::"r"(1u + consumer) : "memory");
}

// Consumer `cw`'s own named barrier over its four warps: id 8 + cw, clear of 0 (`__syncthreads`)
// and the turns' 1 ..= CONSUMERS.
__device__ __forceinline__ void group_sync(u32 cw) { asm volatile("bar.sync %0, 128;\n" ::"r"(8u + cw) : "memory"); }

#if HD == 64 && FP8
#define wgmma_pv wgmma_rs_e4m3_n64
#elif FP8
#define wgmma_pv wgmma_rs_e4m3_n128
#elif HD == 64
#define wgmma_pv wgmma_rs_n64
#else
#define wgmma_pv wgmma_rs_n128
#endif

// Issues S = Q K^T for consumer warpgroup `cw`'s 64 query rows against the BC keys of `k_tile`
// (both K-major), into `s` (not committed). The first product overwrites `s`: nothing writes it
// before, as ptxas serializes the products where other instructions write a product's registers
// while another's are in flight (the last step issues these after a P V).
__device__ __forceinline__ void issue_scores(float (&s)[BC / 2], u32 sq, u32 k_tile, u32 cw) {
#if FP8
    // Rows of HD bytes, k steps of 32 of them; the 64-byte swizzle at head_dim 64.
    fence_regs(s);
    wgmma_fence();
    const u32 a = sq + cw * (64u * HD);
#pragma unroll
    for (int t = 0; t < HD / 32; ++t) {
        const u32 within = (u32)t * 32u;
#if HD == 128
        wgmma_ss_e4m3_n128(s, descriptor(a + within, 16u, 1024u), descriptor(k_tile + within, 16u, 1024u),
                           t > 0 ? 1u : 0u);
#else
        wgmma_ss_e4m3_n128(s, descriptor_64b(a + within, 16u, 512u), descriptor_64b(k_tile + within, 16u, 512u),
                           t > 0 ? 1u : 0u);
#endif
    }
#else
    issue_kmajor<BR, BC>(s, sq + cw * (64u * 128u), k_tile);
#endif
}

// Issues O += P V for the BC keys of `v_tile`, P from registers (not committed). 16-bit: V
// MN-major (its 64-column segments the leading offset apart); FP8: V^T, K-major (HD rows of BC
// bytes).
__device__ __forceinline__ void issue_pv(float (&o)[HD / 2], const u32 (&p)[P_STEPS][4], u32 v_tile) {
    fence_regs(o);
    wgmma_fence();
#pragma unroll
    for (int t = 0; t < P_STEPS; ++t) {
#if FP8
        // Keys 32t .. 32t + 31: 32 bytes into each row.
        wgmma_pv(o, p[t], descriptor(v_tile + (u32)t * 32u, 16u, 1024u));
#else
        // Keys 16t .. 16t + 15: two 8-row groups of 1024 bytes.
        wgmma_pv(o, p[t], descriptor(v_tile + (u32)t * 2048u, BC * 128, 1024u));
#endif
    }
}

// The scores of keys at or past seq_k, and under the causal mask of keys after their query row,
// to -inf (a block that needs it: at the end of the keys or on the diagonal). This thread's score
// s[4i + e] is key kv0 + col_in + 8i + (e & 1) of row e < 2 ? row0 : row1; each row's first key
// it must not see, less kv0 + col_in and clamped to 0 ..= BC, makes every test one 32-bit compare
// against a constant (64-bit tests take several instructions a score).
__device__ __forceinline__ void mask_scores(float (&s)[BC / 2], long long kv0, long long seq_k, long long row0,
                                            long long row1, u32 col_in) {
    int limit[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        long long end = seq_k;
        if (CAUSAL) end = min(end, (r == 0 ? row0 : row1) + 1);
        limit[r] = (int)max(0ll, min((long long)BC, end - kv0 - (long long)col_in));
    }
#pragma unroll
    for (int i = 0; i < BC / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            if (i * 8 + (e & 1) >= limit[e >> 1]) s[i * 4 + e] = __int_as_float(0xff800000);
        }
    }
}

// The online softmax's step over one block of scores, for this thread's two rows: the new
// maxima (of the scores times scale * log2(e), over the row's four lanes) into m, s turned into
// exp2(s * scale_log2 - m) (FP8: exp2(. - m + 8)), the factors that rescale what the old maxima
// weighted into alpha, and this thread's share of the new terms into sum.
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
#if FP8
        u[r] -= 8.f;
#endif
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

#if FP8
// P in e4m3 as `wgmma`'s A fragments: keys 32t .. 32t + 31 are accumulator groups 4t .. 4t + 3.
// A register holds four keys of one row: row0's keys 2c, 2c + 1, 8 + 2c, 9 + 2c (c = lane % 4),
// then row1's, then row0's 16 keys on, then row1's; the fragment takes them as keys 4c .. 4c + 3
// (16 on), which is the order vt's keys are stored in.
__device__ __forceinline__ void to_fragments(const float (&s)[BC / 2], u32 (&p)[P_STEPS][4]) {
#pragma unroll
    for (int t = 0; t < P_STEPS; ++t) {
        const float* g = s + 16 * t;
        p[t][0] = pack_e4m3(g[0], g[1], g[4], g[5]);
        p[t][1] = pack_e4m3(g[2], g[3], g[6], g[7]);
        p[t][2] = pack_e4m3(g[8], g[9], g[12], g[13]);
        p[t][3] = pack_e4m3(g[10], g[11], g[14], g[15]);
    }
}
#else
// P in 16 bits as `wgmma`'s A fragments: keys 16t .. 16t + 15 are accumulator groups 2t, 2t + 1.
__device__ __forceinline__ void to_fragments(const float (&s)[BC / 2], u32 (&p)[P_STEPS][4]) {
#pragma unroll
    for (int t = 0; t < P_STEPS; ++t) {
        p[t][0] = pack(s[8 * t], s[8 * t + 1]);
        p[t][1] = pack(s[8 * t + 2], s[8 * t + 3]);
        p[t][2] = pack(s[8 * t + 4], s[8 * t + 5]);
        p[t][3] = pack(s[8 * t + 6], s[8 * t + 7]);
    }
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS, 1) flash_forward_hopper(
    const unsigned short* __restrict__ q,
    const unsigned short* __restrict__ k,
    const unsigned short* __restrict__ v,
    unsigned short* __restrict__ out,
    float* __restrict__ lse,
#if FP8
    const float* __restrict__ q_scale,
    const float* __restrict__ k_scale,
    const float* __restrict__ v_scale,
#endif
    const __grid_constant__ Info info) {
    extern __shared__ unsigned char smem_raw[];
    // The swizzle is a function of the address bits: tiles start on 1024-byte boundaries.
    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    // A block's n-th tile uses Q buffer n % 2; key/value block i of all it reads, stage i % STAGES.
    auto sq = [&](u32 buf) { return base + buf * Q_BYTES; };
    const u32 sk = base + 2 * Q_BYTES, sv = sk + STAGES * KV_BYTES;
    const u32 bars = base + BARRIERS_AT;
    auto q_full = [&](u32 buf) { return bars + 8u * buf; };
    auto q_empty = [&](u32 buf) { return bars + 8u * (2u + buf); };
    auto k_full = [&](u32 st) { return bars + 8u * (4u + st); };
    auto k_empty = [&](u32 st) { return bars + 8u * (4u + STAGES + st); };
    auto v_full = [&](u32 st) { return bars + 8u * (4u + 2 * STAGES + st); };
    auto v_empty = [&](u32 st) { return bars + 8u * (4u + 3 * STAGES + st); };
    const u64 tiles = info.q_blocks * info.bh_count;
    const u32 tid = threadIdx.x, wg = tid / 128u;

    if (tid == 0) {
        for (u32 buf = 0; buf < 2; ++buf) {
            bar_init(q_full(buf), 1);
            bar_init(q_empty(buf), 4 * CONSUMERS);
        }
        for (u32 st = 0; st < STAGES; ++st) {
            bar_init(k_full(st), 1);
            bar_init(v_full(st), 1);
            // One arrival per consumer warp.
            bar_init(k_empty(st), 4 * CONSUMERS);
            bar_init(v_empty(st), 4 * CONSUMERS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
        if (tid == 0) {
            u64 kv = 0;
            for (u32 n = 0; Tile::index(n, tiles) < tiles; ++n) {
                const u64 t = Tile::index(n, tiles);
                const Tile tile(t, info);
                const int hq = (int)tile.h, hk = (int)(tile.h / info.group), bb = (int)tile.b;
                const u32 buf = n % 2u;
                bar_wait(q_empty(buf), ((n / 2u) & 1u) ^ 1u);
                bar_expect(q_full(buf), Q_BYTES);
#pragma unroll
                for (int seg = 0; seg < SEGMENTS; ++seg)
                    tma_load(sq(buf) + seg * (BR * 128), &info.q_map, q_full(buf), seg * 64, (int)tile.q0, hq, bb);
                for (long long j = 0; j < tile.blocks; ++j, ++kv) {
                    const u32 st = (u32)(kv % STAGES), parity = (u32)((kv / STAGES) & 1);
                    bar_wait(k_empty(st), parity ^ 1u);
                    bar_expect(k_full(st), KV_BYTES);
#pragma unroll
                    for (int seg = 0; seg < SEGMENTS; ++seg)
                        tma_load(sk + st * KV_BYTES + seg * (BC * 128), &info.k_map, k_full(st), seg * 64,
                                 (int)(j * BC), hk, bb);
                    bar_wait(v_empty(st), parity ^ 1u);
                    bar_expect(v_full(st), KV_BYTES);
#if FP8
                    // V^T: the block's BC keys of all HD rows.
                    tma_load(sv + st * KV_BYTES, &info.v_map, v_full(st), (int)(j * BC), 0, hk, bb);
#else
#pragma unroll
                    for (int seg = 0; seg < HD / 64; ++seg)
                        tma_load(sv + st * KV_BYTES + seg * (BC * 128), &info.v_map, v_full(st), seg * 64,
                                 (int)(j * BC), hk, bb);
#endif
                }
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
    const u32 cw = wg - 1u, warp = (tid / 32u) % 4u, lane = tid % 32u;
    const u32 next = (cw + 1u) % CONSUMERS;
    const u32 col_in = (lane % 4u) * 2u;
    const float scale_log2 = __uint_as_float((u32)info.scale_log2);
    const float neg_inf = __int_as_float(0xff800000);
    const long long seq_q = (long long)info.seq_q, seq_k = (long long)info.seq_k;
    // This warp is done reading a buffer or stage.
    auto release = [&](u32 bar) {
        if (lane == 0) bar_arrive(bar);
    };
    // The first turn is the first consumer's: the last one grants it.
    if (cw == CONSUMERS - 1) turn_grant(0);

    // The scores of a tile's first key block are issued before the tile starts: by the previous
    // tile's last step, beside its last P V, so that they run while that tile's output is
    // written (see below); the first tile's here. Every block has a tile (the grid is at most
    // the tiles).
    float s[BC / 2] = {};
    u32 p[P_STEPS][4];
    bar_wait(q_full(0), 0);
    bar_wait(k_full(0), 0);
    turn_wait(cw);
    issue_scores(s, sq(0), sk, cw);
    wgmma_commit();
    turn_grant(next);
    wgmma_wait<0>();

    u64 kv = 0;
    for (u32 n = 0; Tile::index(n, tiles) < tiles; ++n) {
        const Tile tile(Tile::index(n, tiles), info);
        const long long q0 = tile.q0, blocks = tile.blocks;
        const bool last_tile = Tile::index(n + 1, tiles) == tiles;
        const u32 buf = n % 2u, q_tile = sq(buf);
        // This thread's two rows of the warpgroup's 64 (`wgmma`'s accumulator layout): row0
        // holds accumulator elements 4i, 4i + 1, row1 = row0 + 8 holds 4i + 2, 4i + 3, at
        // columns 8i + 2 (lane % 4) and the next.
        const long long row0 = q0 + cw * 64u + warp * 16u + lane / 4u, row1 = row0 + 8;
        // Whether block j's scores need the mask.
        auto masked = [&](long long j) { return (j + 1) * BC > seq_k || (CAUSAL && (j + 1) * BC - 1 > q0); };
        auto stage = [&](long long j) { return (u32)((kv + (u64)j) % STAGES); };
        auto parity = [&](long long j) { return (u32)(((kv + (u64)j) / STAGES) & 1); };

        float o[HD / 2];
#if FP8
        // This warpgroup's q scale (its 64 rows are one scale block; a warpgroup past the end
        // takes the last) and its (batch, kv head)'s k and v scales; `v_now` is the one O is
        // kept in units of.
        const u64 kv_heads = info.heads / info.group, k_scale_blocks = (info.seq_k + BC - 1) / BC;
        const u64 q_scale_blocks = (info.seq_q + 63) / 64;
        const u64 q_block = min((u64)q0 / 64u + cw, q_scale_blocks - 1);
        const float q_scaled = scale_log2 * q_scale[(tile.b * info.heads + tile.h) * q_scale_blocks + q_block];
        const float* ks = k_scale + (tile.b * kv_heads + tile.h / info.group) * k_scale_blocks;
        const float* vs = v_scale + (tile.b * kv_heads + tile.h / info.group) * k_scale_blocks;
        float v_now = vs[0];
        // Block j's factor from scores to the softmax's exponent.
        auto block_scale = [&](long long j) { return q_scaled * ks[j]; };
#else
        auto block_scale = [&](long long) { return scale_log2; };
#endif
        // Running maxima (of the scores times scale * log2(e)) and this thread's partial sums.
        float m[2] = {neg_inf, neg_inf}, l[2] = {0.f, 0.f}, alpha[2], sum[2];

        fence_regs(s);
#pragma unroll
        for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
        release(k_empty(stage(0)));
#if FP8
        if (blocks == 1) release(q_empty(buf));
#endif
        if (masked(0)) mask_scores(s, 0, seq_k, row0, row1, col_in);
        softmax_step(s, block_scale(0), m, alpha, sum);
#if !FP8
        // The previous tile's output left its Q buffer (staged there for the TMA store): the
        // buffer takes the tile after this one.
        if (n > 0) {
            if (warp == 0 && lane == 0) bulk_wait_read();
            __syncwarp();
            release(q_empty(buf ^ 1u));
        }
#endif
        l[0] = sum[0];
        l[1] = sum[1];
        to_fragments(s, p);

        // The tile's output and log-sum-exp, once its last P V is done.
        auto write_tile = [&]() {
            float inv[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
                l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
#if FP8
                inv[r] = l[r] > 0.f ? v_now / l[r] : 0.f;
#else
                inv[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
#endif
            }
#if FP8
            // Each row's address once: its stores (columns 8i + col_in) then take constant offsets.
            unsigned short* op = out + tile.b * info.o_b + tile.h * info.o_h + col_in;
            if (row0 < seq_q) {
                u32* dst = reinterpret_cast<u32*>(op + (u64)row0 * info.o_s);
#pragma unroll
                for (int i = 0; i < HD / 8; ++i) dst[i * 4] = pack(o[i * 4] * inv[0], o[i * 4 + 1] * inv[0]);
            }
            if (row1 < seq_q) {
                u32* dst = reinterpret_cast<u32*>(op + (u64)row1 * info.o_s);
#pragma unroll
                for (int i = 0; i < HD / 8; ++i) dst[i * 4] = pack(o[i * 4 + 2] * inv[1], o[i * 4 + 3] * inv[1]);
            }
#else
            // The output in 16 bits into this warpgroup's 64 rows of the tile's Q buffer (its
            // scores are done), in the layout of the tensor map's boxes (128-byte swizzle), by
            // `stmatrix`: a lane gives the row address of matrix lane / 8 (rows 0-7 or 8-15 of
            // the warp's 16, columns 8i or 8(i + 1)), each register one matrix's pair. Then one
            // thread stores the boxes by TMA, rows past seq_q dropped.
            {
                const u32 mat = lane / 8u, r = warp * 16u + (mat & 1u) * 8u + lane % 8u;
                const u32 rows_at = q_tile + cw * (64u * 128u) + r * 128u;
#pragma unroll
                for (int i = 0; i < HD / 8; i += 2) {
                    const u32 cb = (u32)i + (mat >> 1), seg = cb / 8u, chunk = cb % 8u;
                    const u32 addr = rows_at + seg * (BR * 128u) + ((chunk ^ (r % 8u)) * 16u);
                    const u32 x0 = pack(o[i * 4] * inv[0], o[i * 4 + 1] * inv[0]);
                    const u32 x1 = pack(o[i * 4 + 2] * inv[1], o[i * 4 + 3] * inv[1]);
                    const u32 x2 = pack(o[i * 4 + 4] * inv[0], o[i * 4 + 5] * inv[0]);
                    const u32 x3 = pack(o[i * 4 + 6] * inv[1], o[i * 4 + 7] * inv[1]);
                    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                                 "r"(x0), "r"(x1), "r"(x2), "r"(x3)
                                 : "memory");
                }
                fence_async_shared();
                group_sync(cw);
                if (warp == 0 && lane == 0) {
#pragma unroll
                    for (int seg = 0; seg < HD / 64; ++seg)
                        tma_store(&info.o_map, q_tile + seg * (BR * 128u) + cw * (64u * 128u), seg * 64,
                                  (int)(q0 + cw * 64u), (int)tile.h, (int)tile.b);
                }
            }
#endif
            if (lane % 4u == 0u) {
                const float ln2 = 0.6931471805599453f;
                float* lp = lse + (tile.b * info.heads + tile.h) * info.seq_q;
#if FP8
                // P carried a factor 2^8.
                if (row0 < seq_q) lp[row0] = (m[0] + lg2(l[0]) - 8.f) * ln2;
                if (row1 < seq_q) lp[row1] = (m[1] + lg2(l[1]) - 8.f) * ln2;
#else
                if (row0 < seq_q) lp[row0] = (m[0] + lg2(l[0])) * ln2;
                if (row1 < seq_q) lp[row1] = (m[1] + lg2(l[1])) * ln2;
#endif
            }
        };

        // Iteration j: block j + 1's scores and block j's P V on the tensor cores together,
        // then block j + 1's softmax.
        for (long long j = 0; j < blocks; ++j) {
            const u32 st = stage(j);
            if (j + 1 < blocks) {
                const u32 st1 = stage(j + 1);
                // Read while the products run.
                const float next_scale = block_scale(j + 1);
#if FP8
                const float v_next = vs[j + 1];
#endif
                bar_wait(k_full(st1), parity(j + 1));
                bar_wait(v_full(st), parity(j));
                turn_wait(cw);
                issue_scores(s, q_tile, sk + st1 * KV_BYTES, cw);
                wgmma_commit();
                issue_pv(o, p, sv + st * KV_BYTES);
                wgmma_commit();
                turn_grant(next);
                wgmma_wait<1>();
                fence_regs(s);
                release(k_empty(st1));
#if FP8
                // The tile's last scores are done: its Q buffer takes the tile after next.
                if (j + 2 == blocks) release(q_empty(buf));
#endif
                if (masked(j + 1)) mask_scores(s, (j + 1) * BC, seq_k, row0, row1, col_in);
                softmax_step(s, next_scale, m, alpha, sum);
                wgmma_wait<0>();
                fence_regs(o);
                release(v_empty(st));
#if FP8
                // O from block j's v units to block j + 1's.
                const float v_ratio = v_now / v_next;
                v_now = v_next;
                l[0] = l[0] * alpha[0] + sum[0];
                l[1] = l[1] * alpha[1] + sum[1];
                alpha[0] *= v_ratio;
                alpha[1] *= v_ratio;
#endif
#pragma unroll
                for (int i = 0; i < HD / 8; ++i) {
                    o[i * 4] *= alpha[0];
                    o[i * 4 + 1] *= alpha[0];
                    o[i * 4 + 2] *= alpha[1];
                    o[i * 4 + 3] *= alpha[1];
                }
#if !FP8
                l[0] = l[0] * alpha[0] + sum[0];
                l[1] = l[1] * alpha[1] + sum[1];
#endif
                to_fragments(s, p);
            } else {
                // The next tile's first scores: its Q buffer and the stage after this one. After
                // the last tile the products still run, on the other Q buffer (nothing writes it
                // any more: the producer has no tile to load, and in 16 bits this tile's output
                // goes to this tile's buffer while they may run) and this stage, as a `wgmma`
                // issued in a branch of its own would be serialized by ptxas; their scores are
                // dropped.
                const u32 next_buf = (n + 1u) % 2u, next_st = stage(j + 1);
                if (!last_tile) {
                    bar_wait(q_full(next_buf), ((n + 1u) / 2u) & 1u);
                    bar_wait(k_full(next_st), parity(j + 1));
                }
                bar_wait(v_full(st), parity(j));
                turn_wait(cw);
                issue_pv(o, p, sv + st * KV_BYTES);
                wgmma_commit();
                issue_scores(s, sq(next_buf), sk + (last_tile ? st : next_st) * KV_BYTES, cw);
                wgmma_commit();
                // The last consumer's very last grant would open a turn nobody takes.
                if (!(last_tile && cw == CONSUMERS - 1)) turn_grant(next);
                wgmma_wait<1>();
                fence_regs(o);
                release(v_empty(st));
                write_tile();
                wgmma_wait<0>();
                fence_regs(s);
            }
        }
        kv += (u64)blocks;

    }
#if !FP8
    if (warp == 0 && lane == 0) bulk_wait_all();
#endif
}
