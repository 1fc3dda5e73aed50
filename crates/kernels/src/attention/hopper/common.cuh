// Device helpers shared by the Hopper attention kernels (forward.cu, backward.cu): TMA copies,
// mbarriers, warpgroup MMA (`wgmma`) and its shared-memory descriptors, 16-bit and e4m3 conversions. The
// kernel files follow this text in one NVRTC source; HD and IS_BF16 are defined before it.

typedef unsigned int u32;
typedef unsigned long long u64;

#if IS_BF16
#define ELT "bf16"
#define CVT_PAIR "cvt.rn.bf16x2.f32"
#else
#define ELT "f16"
#define CVT_PAIR "cvt.rn.f16x2.f32"
#endif

// A TMA tensor map (CUtensorMap): 128 opaque bytes, 64-byte aligned.
struct __align__(64) TensorMap {
    u64 words[16];
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

// Four f32 values as one word of e4m3 values (saturated to +-448), `a` in the low byte.
__device__ __forceinline__ u32 pack_e4m3(float a, float b, float c, float d) {
    u32 r;
    asm("{\n.reg .b16 lo, hi;\ncvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\ncvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
        "mov.b32 %0, {lo, hi};\n}\n"
        : "=r"(r)
        : "f"(a), "f"(b), "f"(c), "f"(d));
    return r;
}

// mbarriers in shared memory: the producer's copies complete the "full" ones (the expected byte
// count set by its arrival), the consumers' arrivals the "empty" ones.
__device__ __forceinline__ void bar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the barrier's phase of this parity has completed (a fresh barrier counts the phase
// before its first, parity 1, as completed).
__device__ __forceinline__ void bar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

// One TMA copy of a box of `map` at coordinates (column, row, head, batch) into shared memory at
// `dst`, completing `bar` with its bytes.
__device__ __forceinline__ void tma_load(u32 dst, const TensorMap* map, u32 bar, int col, int row, int head,
                                         int batch) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
        "%5}], [%6];\n" ::"r"(dst),
        "l"((u64)map), "r"(col), "r"(row), "r"(head), "r"(batch), "r"(bar)
        : "memory");
}

// One TMA store of a box of `map` at (column, row, head, batch) from shared memory at `src`, as
// this thread's bulk group (committed).
__device__ __forceinline__ void tma_store(const TensorMap* map, u32 src, int col, int row, int head, int batch) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                     (u64)map),
                 "r"(src), "r"(col), "r"(row), "r"(head), "r"(batch)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Orders this thread's shared-memory writes before later reads by the async proxy (`wgmma`
// operands, bulk copies).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Waits until this thread's bulk groups have read their shared memory, or have completed.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

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

// The same with the 64-byte swizzle (tiles of 64-byte rows: 8-row groups of 512 bytes).
__device__ __forceinline__ u64 descriptor_64b(u32 addr, u32 leading, u32 stride) {
    return (descriptor(addr, leading, stride) & ~(3ull << 62)) | (2ull << 62);
}

// The accumulator operands of a m64nN `wgmma` (N / 2 f32 registers a thread), for the asm
// statements below; their operand numbers are 0 .. N / 2 - 1.
#define D_REGS_32 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define D_REGS_64 \
    D_REGS_32, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), \
        "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), \
        "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), \
        "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), \
        "+f"(d[63])
// Their text in the instruction.
#define D_TEXT_32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define D_TEXT_64 \
    D_TEXT_32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

// D (+)= A B, m64nNk16, f32 accumulators, 16-bit inputs. `ss`: A and B from shared memory
// through descriptors, K-major (`_kk`) or both MN-major, read transposed (`_tt`); `accumulate`
// 0 overwrites D. `rs`: A from registers (the fragments of a 64-row accumulator, see
// `to_fragments`), B MN-major from shared memory; always accumulates.
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], u64 a, u64 b, u32 accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." ELT "." ELT " {" D_TEXT_64 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : D_REGS_64
                 : "l"(a), "l"(b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], u64 a, u64 b, u32 accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." ELT "." ELT " {" D_TEXT_32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : D_REGS_32
                 : "l"(a), "l"(b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_ss_n64_tt(float (&d)[32], u64 a, u64 b, u32 accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." ELT "." ELT " {" D_TEXT_32 "}, %32, %33, p, 1, 1, 1, 1;\n}\n"
                 : D_REGS_32
                 : "l"(a), "l"(b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const u32 (&a)[4], u64 b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." ELT "." ELT " {" D_TEXT_32 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : D_REGS_32
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1u));
}

__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const u32 (&a)[4], u64 b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." ELT "." ELT " {" D_TEXT_64 "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : D_REGS_64
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1u));
}

// D (+)= A B, m64nNk32, f32 accumulators, e4m3 inputs (FP8 takes K-major operands only). `ss`:
// both from shared memory, `accumulate` 0 overwrites D; `rs`: A from registers (four e4m3 a
// register, see forward.cu's `to_fragments`), always accumulates.
__device__ __forceinline__ void wgmma_ss_e4m3_n128(float (&d)[64], u64 a, u64 b, u32 accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" D_TEXT_64 "}, %64, %65, p, 1, 1;\n}\n"
                 : D_REGS_64
                 : "l"(a), "l"(b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_rs_e4m3_n64(float (&d)[32], const u32 (&a)[4], u64 b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {" D_TEXT_32 "}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
                 : D_REGS_32
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1u));
}

__device__ __forceinline__ void wgmma_rs_e4m3_n128(float (&d)[64], const u32 (&a)[4], u64 b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" D_TEXT_64 "}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
                 : D_REGS_64
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1u));
}

// The m64nNk16 products from shared memory by D's size (N = 128 or 64), for `issue_kmajor`.
__device__ __forceinline__ void wgmma_ss(float (&d)[64], u64 a, u64 b, u32 accumulate) {
    wgmma_ss_n128(d, a, b, accumulate);
}
__device__ __forceinline__ void wgmma_ss(float (&d)[32], u64 a, u64 b, u32 accumulate) {
    wgmma_ss_n64(d, a, b, accumulate);
}

// Issues D = A B^T over HD columns into `d` (not committed): A the 64 rows at `a` of a tile of
// A_ROWS rows, B the tile of B_ROWS rows at `b` (D's N), both K-major with the 128-byte swizzle,
// each tile HD / 64 segments of 64 columns one after the other.
template <int A_ROWS, int B_ROWS>
__device__ __forceinline__ void issue_kmajor(float (&d)[B_ROWS / 2], u32 a, u32 b) {
    fence_regs(d);
    wgmma_fence();
#pragma unroll
    for (int t = 0; t < HD / 16; ++t) {
        // k steps of 16 columns (32 bytes) within a 128-byte segment.
        const u32 seg = (u32)t / 4u, within = ((u32)t % 4u) * 32u;
        const u64 da = descriptor(a + seg * (A_ROWS * 128) + within, 16u, 1024u);
        const u64 db = descriptor(b + seg * (B_ROWS * 128) + within, 16u, 1024u);
        wgmma_ss(d, da, db, t > 0 ? 1u : 0u);
    }
}
