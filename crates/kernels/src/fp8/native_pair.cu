// Both orientations of a 2-D matrix quantized to FP8 from one read, with the GPU's own conversion
// instruction (`cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32`, compute capability 8.9+). The CUDA C++
// counterpart of the CubeCL kernel `quantize_pair_tiles` (fp8/kernel.rs): the same tiles, the
// same scales and the same bytes, bit for bit, as the CPU reference (fp8/reference.rs).
//
// Compiled at run time by NVRTC (through CubeCL, see cuda_source.rs) with these macros defined
// before this text:
//   IN_KIND     0: f32 input, 1: f16, 2: bf16
//   VEC         1: rows contiguous and 16-byte aligned, 8 elements loaded per row at once
//   BLOCK       1: one amax per 128x128 block, shared by both orientations
//   GIVEN_AMAX  1: per-tensor scaling, every tile takes amax[0]
//   POW2        1: scales rounded down to powers of two
//   E5M2        1: E5M2 codes, 0: E4M3
//
// Layout (as the CubeCL kernel): the stored matrix is [rows, cols], element (i, j) at
// x[i * stride_i + j * stride_j]. `payload` [rows, col_tiles * 32] holds it quantized along cols,
// `payload_t` [cols, row_tiles * 32] its transpose quantized along rows, four codes per
// little-endian word, zero codes past the matrix. Scales are dequantization factors (1 / s).
// A block of 256 threads covers a 128 x 128 tile, thread t the 8 x 8 values of rows
// 8 (t / 16) .. and columns 8 (t % 16) .., kept in registers (16-bit inputs packed two to a
// register).

typedef unsigned int u32;
typedef unsigned long long u64;

struct Info {
    u64 rows;
    u64 cols;
    u64 stride_i;
    u64 stride_j;
};

#if E5M2
#define MAX_EXP 15u
#define MAX_VALUE 57344.0f
#define INF_CODE 0x7Cu
#else
#define MAX_EXP 8u
#define MAX_VALUE 448.0f
#define INF_CODE 0x7Fu
#endif

#if IN_KIND == 0
typedef float in_t;
#else
typedef unsigned short in_t;
#endif

__device__ __forceinline__ float to_f32(in_t v) {
#if IN_KIND == 0
    return v;
#elif IN_KIND == 1
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
#else
    return __uint_as_float(((u32)v) << 16);
#endif
}

// The value of 16-bit input bits h (in the low half of a word).
__device__ __forceinline__ float half_bits_to_f32(u32 h) {
#if IN_KIND == 1
    return to_f32((in_t)h);
#else
    return __uint_as_float(h << 16);
#endif
}

__device__ __forceinline__ u32 umax(u32 a, u32 b) { return a > b ? a : b; }

// |x| as f32 bits if x is finite and normal, else 0 (the tile amax ignores NaN, infinities and
// subnormals). For non-negative floats, comparing the bits as integers compares the values.
__device__ __forceinline__ u32 amax_term(float x) {
    u32 a = __float_as_uint(x) & 0x7FFFFFFFu;
    return (a - 0x800000u < 0x7F000000u) ? a : 0u;
}

// Whether x is an input the conversion instruction does not encode as the reference does: a
// nonzero f32 subnormal (the reference flushes it to zero) or NaN / an infinity (the instruction
// saturates infinities and drops the sign of NaN).
__device__ __forceinline__ bool special(float x) {
    u32 a = __float_as_uint(x) & 0x7FFFFFFFu;
    return a - 1u < 0x7FFFFFu || a >= 0x7F800000u;
}

// The quantization multiplier s for a tile amax (see reference::scales_for).
__device__ __forceinline__ float multiplier(float amax) {
    float s = 1.0f;
    if (amax > 0.0f) {
#if POW2
        u32 bits = __float_as_uint(amax);
        u32 ea = bits >> 23;
        u32 kb = MAX_EXP + 254u - ea;
        if ((bits & 0x7FFFFFu) > 0x600000u) kb -= 1u;
        kb = kb < 1u ? 1u : kb;
        kb = kb > 253u ? 253u : kb;
        s = __uint_as_float(kb << 23);
#else
        s = MAX_VALUE / amax;
        s = fminf(fmaxf(s, 1.17549435e-38f), __uint_as_float(253u << 23));
#endif
    }
    return s;
}

// The dequantization scale 1 / s (from the bits for powers of two, exact everywhere).
__device__ __forceinline__ float dequant_scale(float s) {
#if POW2
    return __uint_as_float((254u - (__float_as_uint(s) >> 23)) << 23);
#else
    return 1.0f / s;
#endif
}

// Two codes: x0 * s in the low byte, x1 * s in the high byte (round to nearest even, saturating).
__device__ __forceinline__ u32 cvt2(float x0, float x1, float s) {
    unsigned short r;
#if E5M2
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(x1 * s), "f"(x0 * s));
#else
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(x1 * s), "f"(x0 * s));
#endif
    return r;
}

// The code of x * s as the reference writes it, for any x (the slow path of special inputs).
__device__ __forceinline__ u32 code_of(float x, float s) {
    u32 bits = __float_as_uint(x);
    u32 a = bits & 0x7FFFFFFFu;
    u32 sign = (bits >> 31) << 7;
    if (a < 0x800000u) return sign;
    if (a >= 0x7F800000u) return sign | (a == 0x7F800000u ? INF_CODE : 0x7Fu);
    return cvt2(x, 0.0f, s) & 0xFFu;
}

// Four codes in a little-endian word, a in the low byte .. d in the high byte.
__device__ __forceinline__ u32 word_of(float a, float b, float c, float d, float s, bool slow) {
    if (slow) {
        return code_of(a, s) | (code_of(b, s) << 8) | (code_of(c, s) << 16) | (code_of(d, s) << 24);
    }
    return cvt2(a, b, s) | (cvt2(c, d, s) << 16);
}

// At least two blocks a multiprocessor (at most 128 registers a thread).
extern "C" __global__ void __launch_bounds__(256, 2) fp8_quantize_pair_native(
    const in_t* __restrict__ x,
    const float* __restrict__ amax,
    u32* __restrict__ payload,
    float* __restrict__ scales,
    u32* __restrict__ payload_t,
    float* __restrict__ scales_t,
    const __grid_constant__ Info info) {
    __shared__ __align__(16) u32 buf[4096];
    __shared__ u32 maxima[256];

    const u64 rows = info.rows;
    const u64 cols = info.cols;
    const u32 unit = threadIdx.x;
    const u32 cu = unit % 16u;
    const u32 ru = unit / 16u;
    const u32 ct = blockIdx.x;
    const u32 rt = blockIdx.y;
    const u32 col_tiles = gridDim.x;
    const u32 row_tiles = gridDim.y;
    const u64 words = (u64)col_tiles * 32u;
    const u64 words_t = (u64)row_tiles * 32u;
    const u64 row0 = (u64)rt * 128u + ru * 8u;
    const u64 col0 = (u64)ct * 128u + cu * 8u;

    // The thread's values: V(i * 8 + e) is row row0 + i, column col0 + e (0 outside the
    // matrix). 16-bit inputs stay packed two to a register (V(k) unpacks one in one instruction),
    // so that the 64 values take 32 registers and more blocks fit on a multiprocessor.
#if IN_KIND == 0
    float v[64];
#define V(k) v[k]
#else
    u32 v[32];
#define V(k) half_bits_to_f32(((k) & 1) ? (v[(k) >> 1] >> 16) : (v[(k) >> 1] & 0xFFFFu))
#endif
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const u64 row = row0 + i;
#if VEC
        const bool inside = row < rows && col0 < cols;
        const in_t* p = x + row * info.stride_i + col0;
#if IN_KIND == 0
        float4 a = {0.0f, 0.0f, 0.0f, 0.0f};
        float4 b = {0.0f, 0.0f, 0.0f, 0.0f};
        if (inside) {
            a = *reinterpret_cast<const float4*>(p);
            b = *reinterpret_cast<const float4*>(p + 4);
        }
        v[i * 8 + 0] = a.x;
        v[i * 8 + 1] = a.y;
        v[i * 8 + 2] = a.z;
        v[i * 8 + 3] = a.w;
        v[i * 8 + 4] = b.x;
        v[i * 8 + 5] = b.y;
        v[i * 8 + 6] = b.z;
        v[i * 8 + 7] = b.w;
#else
        uint4 a = {0u, 0u, 0u, 0u};
        if (inside) a = *reinterpret_cast<const uint4*>(p);
        v[i * 4 + 0] = a.x;
        v[i * 4 + 1] = a.y;
        v[i * 4 + 2] = a.z;
        v[i * 4 + 3] = a.w;
#endif
#else
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const u64 col = col0 + e;
            const bool inside = row < rows && col < cols;
#if IN_KIND == 0
            v[i * 8 + e] = inside ? x[row * info.stride_i + col * info.stride_j] : 0.0f;
#else
            const u32 h = inside ? (u32)x[row * info.stride_i + col * info.stride_j] : 0u;
            if (e % 2 == 0) {
                v[i * 4 + e / 2] = h;
            } else {
                v[i * 4 + e / 2] |= h << 16;
            }
#endif
        }
#endif
    }

    // Whether any of this thread's values needs the slow encoding (rare: NaN, infinities, f32
    // subnormals); decided per thread, so the fast path has no per-value branch.
    bool slow = false;
#pragma unroll
    for (int k = 0; k < 64; k++) slow |= special(V(k));

    // The amax of each tile this thread's values belong to, as f32 bits.
    u32 m = 0u;
#if GIVEN_AMAX
    m = __float_as_uint(amax[0]);
#else
    // Partial maxima: rows at r * 16 + cu, columns (of thread row ru) at
    // 2048 + ru * 128 + e * 16 + cu for column cu * 8 + e. buf later stages the transposed codes.
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 rm = 0u;
#pragma unroll
        for (int e = 0; e < 8; e++) rm = umax(rm, amax_term(V(i * 8 + e)));
        buf[(ru * 8u + i) * 16u + cu] = rm;
    }
#pragma unroll
    for (int e = 0; e < 8; e++) {
        u32 cm = 0u;
#pragma unroll
        for (int i = 0; i < 8; i++) cm = umax(cm, amax_term(V(i * 8 + e)));
        buf[2048u + ru * 128u + e * 16u + cu] = cm;
    }
    __syncthreads();
    // Threads 0..128 take a row's amax, 128..256 a column's.
    if (unit < 128u) {
#pragma unroll
        for (u32 p = 0; p < 16u; p++) m = umax(m, buf[unit * 16u + ((p + unit) % 16u)]);
    } else {
        const u32 c = unit - 128u;
#pragma unroll
        for (u32 p = 0; p < 16u; p++) m = umax(m, buf[2048u + p * 128u + (c % 8u) * 16u + c / 8u]);
    }
    maxima[unit] = m;
    __syncthreads();
#if BLOCK
    m = 0u;
#pragma unroll 8
    for (u32 r = 0; r < 128u; r++) m = umax(m, maxima[r]);
#endif
#endif
    const bool per_tile = !GIVEN_AMAX && !BLOCK;

    // As stored: words 2 cu, 2 cu + 1 of each of the thread's rows.
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const u64 row = row0 + i;
        if (row < rows) {
            const float s = multiplier(__uint_as_float(per_tile ? maxima[ru * 8u + i] : m));
            uint2 w;
            const int k = i * 8;
            w.x = word_of(V(k), V(k + 1), V(k + 2), V(k + 3), s, slow);
            w.y = word_of(V(k + 4), V(k + 5), V(k + 6), V(k + 7), s, slow);
            *reinterpret_cast<uint2*>(&payload[row * words + ct * 32u + cu * 2u]) = w;
            if (per_tile && cu == 0u) scales[row * col_tiles + ct] = dequant_scale(s);
        }
    }
    // Transposed: column cu * 8 + e's words 2 ru, 2 ru + 1, staged at c * 32 + (word ^ 2 cu)
    // (XOR-swizzled: neither the writes nor the reads below conflict more than 2-way). Every
    // read of the partial maxima in buf came before the last barrier.
#pragma unroll
    for (int e = 0; e < 8; e++) {
        const u32 c = cu * 8u + e;
        const float s = multiplier(__uint_as_float(per_tile ? maxima[128u + c] : m));
        uint2 w;
        w.x = word_of(V(e), V(8 + e), V(16 + e), V(24 + e), s, slow);
        w.y = word_of(V(32 + e), V(40 + e), V(48 + e), V(56 + e), s, slow);
        *reinterpret_cast<uint2*>(&buf[c * 32u + ((ru ^ cu) * 2u)]) = w;
    }
    __syncthreads();
    const u32 lane = unit % 32u;
    const u32 warp = unit / 32u;
#pragma unroll
    for (u32 q = 0; q < 16u; q++) {
        const u32 c = warp * 16u + q;
        const u64 col = (u64)ct * 128u + c;
        if (col < cols) payload_t[col * words_t + rt * 32u + lane] = buf[c * 32u + (lane ^ ((c / 8u) * 2u))];
    }
    if (per_tile && unit >= 128u) {
        const u64 col = (u64)ct * 128u + unit - 128u;
        if (col < cols) scales_t[col * row_tiles + rt] = dequant_scale(multiplier(__uint_as_float(m)));
    }
#if BLOCK
    if (unit == 0u) {
        const float d = dequant_scale(multiplier(__uint_as_float(m)));
        scales[(u64)rt * col_tiles + ct] = d;
        scales_t[(u64)ct * row_tiles + rt] = d;
    }
#endif
#if GIVEN_AMAX
    if (ct == 0u && rt == 0u && unit == 0u) {
        const float d = dequant_scale(multiplier(__uint_as_float(m)));
        scales[0] = d;
        scales_t[0] = d;
    }
#endif
}
