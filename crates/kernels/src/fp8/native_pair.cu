// Both orientations of a 2-D matrix quantized to FP8 from one read, with the GPU's own conversion
// instruction (`cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32`, compute capability 8.9+). The CUDA C++
// counterpart of the CubeCL kernel `quantize_pair_tiles` (fp8/kernel.rs): the same tiles, the
// same scales and the same bytes, bit for bit, as the CPU reference (fp8/reference.rs).
//
// Compiled at run time by NVRTC (through CubeCL, see cuda_source.rs) with these macros defined
// before this text:
//   IN_KIND     0: f32 input, 1: f16, 2: bf16
//   VEC         1: rows contiguous and 16-byte aligned, a thread's 8 elements of a row read
//               with 16-byte loads (one for 16-bit inputs, two for f32)
//   BLOCK       1: one amax per 128x128 block, shared by both orientations
//   T_BLOCK     1 (with 1x128 tiles: BLOCK and GIVEN_AMAX 0): the transpose takes one scale per
//               128x128 block, the tile's amax, laid out as with BLOCK; the matrix as stored keeps
//               its 1x128 scales (a wgrad operand quantized per block, see fp8/format.rs PairSpec)
//   GIVEN_AMAX  1: per-tensor scaling, every tile takes amax[0]; unless info.record_slot is
//               NO_SLOT, the kernel also records x's amax (its largest finite normal |x|, as
//               the reference takes it) into record[info.record_slot] (f32 bits, atomic max over
//               the blocks: the slot only grows), for delayed scaling (fp8/delayed.rs)
//   POW2        1: scales rounded down to powers of two
//   E5M2        1: E5M2 codes, 0: E4M3
//   PROLOGUE    what is quantized: 0: x itself; 1: GELU(x); 2: the GELU gradient dy * GELU'(x),
//               dy read beside x (same view). 1 and 2 compute in f32 as the CubeCL kernel
//               `gelu_narrow` (activation/kernel.rs) does and round to the input format, so
//               the codes are those of the GELU kernel's output quantized (the GELU of the
//               FP8 MLP, fp8/mlp.rs, whose producer writes FP8 directly); 3: SwiGLU of a
//               packed input, silu(gate) * up, where the stored matrix [rows, cols] is the output
//               and x holds gate at x[i * stride_i + j] and up at x[i * stride_i + cols + j];
//               4: SwiGLU's gradient, the stored matrix [rows, cols] the packed gradient (gate
//               half, then up half, ff = cols / 2 columns each), from x as for 3 (gate and up,
//               ff columns each) and dy dense [rows, ff]. 3 and 4 take stride_j = 1 and compute
//               in f32 as the CubeCL kernels `swiglu_fwd` / `swiglu_bwd` do (without fast math)
//
// Layout (as the CubeCL kernel): the stored matrix is [rows, cols], element (i, j) at
// x[i * stride_i + j * stride_j]. `payload` [rows, col_tiles * 32] holds it quantized along cols,
// `payload_t` [cols, row_tiles * 32] its transpose quantized along rows, four codes per
// little-endian word, zero codes past the matrix. Scales are dequantization factors (1 / s),
// laid out as cuBLASLt reads them (see block_pad below).
//
// A block of 256 threads covers a 128 x 128 tile, thread t the 8 x 8 values of rows
// 8 (t / 16) .. and columns 8 (t % 16) .., kept in registers as loaded (16-bit inputs two to a
// word). The fast path, taken by every tile without NaN or infinities:
//   1. tile maxima from the bits: for non-negative floats, comparing the bits as integers
//      compares the values, so each thread takes |x| with a mask and the maxima of its rows and
//      columns with integer max (two 16-bit values at once), and the block reduces the
//      partial maxima through shared memory;
//   2. multipliers: with 1x128 tiles, each row's and column's multiplier is computed once (by
//      one of 128 threads, for two rows or columns with 16-bit inputs) into shared memory, with
//      its scale (under T_BLOCK the columns take the tile's one multiplier instead); with one
//      amax a block or a tensor, every thread computes the one multiplier;
//   3. codes: x * s (flushing f32 subnormals to zero, as the reference does) converted two at a
//      time; rows written directly, the transpose staged in shared memory and written by rows.
// A tile with NaN or an infinity (which the conversion instruction encodes differently from the
// reference, and which the tile maxima skip) takes `slow_tile`, value by value.

typedef unsigned int u32;
typedef unsigned long long u64;

struct Info {
    u64 rows;
    u64 cols;
    u64 stride_i;
    u64 stride_j;
    u64 record_slot;
};

// `record_slot` when the kernel records no amax.
#define NO_SLOT 0xFFFFFFFFFFFFFFFFull

#if E5M2
#define MAX_EXP 15u
#define MAX_VALUE 57344.0f
#define INF_CODE 0x7Cu
#else
#define MAX_EXP 8u
#define MAX_VALUE 448.0f
#define INF_CODE 0x7Fu
#endif

// WORD_VALUES: input values a 32-bit word holds; ABS_MASK clears their signs; NONFINITE: the
// smallest |x| bits of an infinity or NaN in the input format.
#if IN_KIND == 0
typedef float in_t;
#define WORD_VALUES 1
#define ABS_MASK 0x7FFFFFFFu
#define NONFINITE 0x7F800000u
#else
typedef unsigned short in_t;
#define WORD_VALUES 2
#define ABS_MASK 0x7FFF7FFFu
#if IN_KIND == 1
#define NONFINITE 0x7C00u
#else
#define NONFINITE 0x7F80u
#endif
#endif
// Words holding one of a thread's rows (8 values), and the thread's 64 values.
#define ROW_WORDS (8 / WORD_VALUES)
#define WORDS (64 / WORD_VALUES)
// Stride, in words, of the row partial maxima in shared memory: a warp's writes do not conflict
// for 16-bit inputs (its two thread rows 80 words apart) and its 16-byte reads never do.
#define ROW_PART_STRIDE 20u

// Shared memory: `stage` holds the partial maxima, then the transposed codes (4096 words).
__shared__ __align__(16) u32 stage[4608];
__shared__ float row_mult[128];
__shared__ float col_mult[128];
__shared__ u32 warp_max[8];
__shared__ u32 maxima[256];

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

// The maximum of each value of two words (each 16-bit half apart for 16-bit inputs).
__device__ __forceinline__ u32 word_max(u32 a, u32 b) {
#if WORD_VALUES == 2
#if __CUDA_ARCH__ >= 900
    u32 r;
    asm("max.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
#else
    return __vmaxu2(a, b);
#endif
#else
    return umax(a, b);
#endif
}

// The larger of a word's values (the word itself for f32).
__device__ __forceinline__ u32 word_top(u32 a) {
#if WORD_VALUES == 2
    return umax(a & 0xFFFFu, a >> 16);
#else
    return a;
#endif
}

// The tile amax, as f32, for the largest |x| bits of a tile's finite values in the input format.
// The reference's amax skips f32 subnormals: a tile whose largest value is one has amax 0.
__device__ __forceinline__ float amax_of_bits(u32 h) {
#if IN_KIND == 0
    const u32 b = h;
#elif IN_KIND == 1
    const u32 b = __float_as_uint(half_bits_to_f32(h));
#else
    const u32 b = h << 16;
#endif
    return __uint_as_float(b < 0x800000u ? 0u : b);
}

// |x| as f32 bits if x is finite and normal, else 0 (the reference's amax term).
__device__ __forceinline__ u32 amax_term(float x) {
    u32 a = __float_as_uint(x) & 0x7FFFFFFFu;
    return (a - 0x800000u < 0x7F000000u) ? a : 0u;
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

// x * s rounded to nearest, f32 subnormal inputs (and products) flushed to zero of x's sign: the
// reference encodes an f32 subnormal input as a zero code.
__device__ __forceinline__ float scaled(float x, float s) {
    float r;
    asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(s));
    return r;
}

// Two codes: x0 * s in the low byte, x1 * s in the high byte (round to nearest even, saturating;
// x0, x1 finite).
__device__ __forceinline__ u32 cvt2(float x0, float x1, float s) {
    const float y0 = scaled(x0, s);
    const float y1 = scaled(x1, s);
    unsigned short r;
#if E5M2
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(y1), "f"(y0));
#else
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(y1), "f"(y0));
#endif
    return r;
}

// Four codes in a little-endian word, a in the low byte .. d in the high byte (all finite).
__device__ __forceinline__ u32 word_of(float a, float b, float c, float d, float s) {
    return __byte_perm(cvt2(a, b, s), cvt2(c, d, s), 0x5410);
}

// The code of x * s as the reference writes it, for any x.
__device__ __forceinline__ u32 code_of(float x, float s) {
    u32 bits = __float_as_uint(x);
    u32 a = bits & 0x7FFFFFFFu;
    u32 sign = (bits >> 31) << 7;
    if (a < 0x800000u) return sign;
    if (a >= 0x7F800000u) return sign | (a == 0x7F800000u ? INF_CODE : 0x7Fu);
    return cvt2(x, 0.0f, s) & 0xFFu;
}

__device__ __forceinline__ u32 word_of_any(float a, float b, float c, float d, float s) {
    return code_of(a, s) | (code_of(b, s) << 8) | (code_of(c, s) << 16) | (code_of(d, s) << 24);
}

// ---------------------------------------------------------------------------------------------
// The prologue (PROLOGUE above): exact GELU in f32 with the normal tail by Abramowitz and Stegun
// 7.1.26, as `normal_cdf_and_gauss` in activation/kernel.rs computes it (with the approximate
// reciprocal and exponential that kernel's fast math allows).

// (Phi(v), exp(-v^2 / 2)).
__device__ __forceinline__ float2 normal_cdf_and_gauss(float v) {
    const float a = fabsf(v) * 0.70710678f;
    const float t = __fdividef(1.0f, 1.0f + 0.3275911f * a);
    const float poly = ((((1.0614054f * t - 1.453152f) * t + 1.4214137f) * t - 0.28449674f) * t + 0.2548296f) * t;
    const float gauss = __expf(-(a * a));
    const float tail = 0.5f * poly * gauss;
    return make_float2(v < 0.0f ? tail : 1.0f - tail, gauss);
}

// The f32 value rounded to nearest even in the input format, as bits in the low bits of a word.
__device__ __forceinline__ u32 to_in_bits(float f) {
#if IN_KIND == 0
    return __float_as_uint(f);
#else
    unsigned short h;
#if IN_KIND == 1
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
    return h;
#endif
}

// What the kernel quantizes for an input value x (and gradient value d), before rounding to the
// input format.
__device__ __forceinline__ float prologue(float x, float d) {
#if PROLOGUE == 1
    return x * normal_cdf_and_gauss(x).x;
#elif PROLOGUE == 2
    const float2 cg = normal_cdf_and_gauss(x);
    // 1 / sqrt(2 pi)
    return d * (cg.x + x * (0.3989423f * cg.y));
#else
    return x;
#endif
}

#if WORD_VALUES == 2
// Two f32 values rounded to nearest even in the 16-bit input format, `lo` in the low half.
__device__ __forceinline__ u32 pack_in_bits(float lo, float hi) {
    u32 r;
#if IN_KIND == 1
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}
#endif

// The prologue on a word of input bits (WORD_VALUES values) and the gradient's word beside it.
__device__ __forceinline__ u32 prologue_word(u32 xw, u32 dw) {
#if PROLOGUE == 0
    return xw;
#elif WORD_VALUES == 2
    const float lo = prologue(half_bits_to_f32(xw & 0xFFFFu), half_bits_to_f32(dw & 0xFFFFu));
    const float hi = prologue(half_bits_to_f32(xw >> 16), half_bits_to_f32(dw >> 16));
    return pack_in_bits(lo, hi);
#else
    return to_in_bits(prologue(__uint_as_float(xw), __uint_as_float(dw)));
#endif
}

#if PROLOGUE >= 3
// SwiGLU (PROLOGUE 3 and 4), as `swiglu_fwd` and `swiglu_bwd` (activation/kernel.rs) compute it:
// s = sigmoid(g) = 1 / (1 + exp(0 - g)); silu(g) * u = g * s * u; the gate's gradient
// d * u * s * (1 + g * (1 - s)); the up half's d * g * s.
__device__ __forceinline__ float sigmoid_of(float g) { return 1.0f / (1.0f + expf(0.0f - g)); }

// What is quantized from gate g, up u and gradient d; `up_half`: a column of the up half of the
// gradient (PROLOGUE 4), which reads no u.
__device__ __forceinline__ float swiglu_prologue(float g, float u, float d, bool up_half) {
    const float s = sigmoid_of(g);
#if PROLOGUE == 3
    return g * s * u;
#else
    return up_half ? d * g * s : d * u * s * (1.0f + g * (1.0f - s));
#endif
}

// The SwiGLU prologue on the words of gate, up and gradient at the same columns.
__device__ __forceinline__ u32 swiglu_word(u32 gw, u32 uw, u32 dw, bool up_half) {
#if WORD_VALUES == 2
    const float lo = swiglu_prologue(half_bits_to_f32(gw & 0xFFFFu), half_bits_to_f32(uw & 0xFFFFu),
                                     half_bits_to_f32(dw & 0xFFFFu), up_half);
    const float hi = swiglu_prologue(half_bits_to_f32(gw >> 16), half_bits_to_f32(uw >> 16),
                                     half_bits_to_f32(dw >> 16), up_half);
    return pack_in_bits(lo, hi);
#else
    return to_in_bits(swiglu_prologue(__uint_as_float(gw), __uint_as_float(uw), __uint_as_float(dw), up_half));
#endif
}

// Columns of the gate (and of the up) half of x: the output's for 3, half the gradient's for 4.
__device__ __forceinline__ u64 swiglu_ff(const Info& info) {
    return PROLOGUE == 3 ? info.cols : info.cols / 2u;
}
#endif

// Element (row, col) of what is quantized (x after the prologue), as f32, or 0 outside the matrix.
__device__ __forceinline__ float element(const in_t* x, const in_t* dy, const Info& info, u64 row, u64 col) {
    if (row >= info.rows || col >= info.cols) return 0.0f;
#if PROLOGUE == 0
    return to_f32(x[row * info.stride_i + col * info.stride_j]);
#else
#if PROLOGUE >= 3
    const u64 ff = swiglu_ff(info);
    const bool up_half = PROLOGUE == 4 && col >= ff;
    const u64 c = up_half ? col - ff : col;
    const u64 at = row * info.stride_i + c;
    const float g = to_f32(x[at]);
    const float u = up_half ? 0.0f : to_f32(x[at + ff]);
    const float d = PROLOGUE == 4 ? to_f32(dy[row * ff + c]) : 0.0f;
    const float p = swiglu_prologue(g, u, d, up_half);
#else
    const u64 at = row * info.stride_i + col * info.stride_j;
    const float p = prologue(to_f32(x[at]), PROLOGUE == 2 ? to_f32(dy[at]) : 0.0f);
#endif
#if IN_KIND == 0
    return p;
#else
    return half_bits_to_f32(to_in_bits(p));
#endif
#endif
}

// The transposed codes staged in `stage` (column c's words at c * 32 + (word ^ 2 (c / 8))) to
// payload_t, a warp writing a column's 128 codes at a time.
__device__ __forceinline__ void write_transposed(u32* __restrict__ payload_t, const Info& info) {
    const u32 lane = threadIdx.x % 32u;
    const u32 warp = threadIdx.x / 32u;
    const u64 words_t = (u64)gridDim.y * 32u;
#pragma unroll
    for (u32 q = 0; q < 16u; q++) {
        const u32 c = warp * 16u + q;
        const u64 col = (u64)blockIdx.x * 128u + c;
        if (col < info.cols) {
            payload_t[col * words_t + blockIdx.y * 32u + lane] = stage[c * 32u + (lane ^ ((c / 8u) * 2u))];
        }
    }
}

// The scales are laid out as cuBLASLt's block-scaled FP8 GEMM reads them (as the CubeCL
// kernels write them, see scale_at in fp8/kernel.rs). 1x128: the scale of row r in K tile kt at
// kt * rows + r. 128x128: row block rb's scales contiguous, rows of block_pad(k_tiles), the
// padding zeroed.
__device__ __forceinline__ u64 block_pad(u64 k_tiles) { return (k_tiles + 3u) / 4u * 4u; }

// Dequantization scale d of this block's tile in a 128x128 block layout for a matrix of `tiles`
// K tiles a row block, at row block `rb` and K tile `kt`: the padding of the row (from `tiles`
// to block_pad(tiles)) is zeroed by the block of the last K tile. One thread calls it.
__device__ __forceinline__ void write_block_scale(float* __restrict__ scales, u64 tiles, u64 rb, u64 kt, float d) {
    const u64 row_len = block_pad(tiles);
    scales[rb * row_len + kt] = d;
    if (kt + 1u == tiles) {
        for (u64 c = tiles; c < row_len; c++) scales[rb * row_len + c] = 0.0f;
    }
}

// The scale of a tile quantized with one multiplier s: its 128x128 block's, or the tensor's
// (written once).
__device__ __forceinline__ void write_tile_scale(float* __restrict__ scales, float* __restrict__ scales_t, float s) {
#if BLOCK
    if (threadIdx.x == 0u) {
        const float d = dequant_scale(s);
        write_block_scale(scales, gridDim.x, blockIdx.y, blockIdx.x, d);
        write_block_scale(scales_t, gridDim.y, blockIdx.x, blockIdx.y, d);
    }
#elif GIVEN_AMAX
    if (blockIdx.x == 0u && blockIdx.y == 0u && threadIdx.x == 0u) {
        const float d = dequant_scale(s);
        scales[0] = d;
        scales_t[0] = d;
    }
#endif
}

// Block-wide: records the largest of the warps' maxima in `warp_max` (f32 bits of finite normal
// |x|, written before the last barrier) into record[info.record_slot] (GIVEN_AMAX).
__device__ __forceinline__ void record_amax(u32* record, const Info& info) {
    if (threadIdx.x == 0u && info.record_slot != NO_SLOT) {
        u32 b = 0u;
#pragma unroll
        for (int w = 0; w < 8; w++) b = umax(b, warp_max[w]);
        if (b != 0u) atomicMax(record + info.record_slot, b);
    }
}

// The tile of this block when it holds NaN or an infinity, one value at a time: the tile maxima
// skip them, and their codes are the reference's (the conversion instruction saturates
// infinities and drops the sign of NaN). Called by every thread of the block; reads x again.
__device__ __noinline__ void slow_tile(
    const in_t* __restrict__ x,
    const in_t* __restrict__ dy,
    const float* __restrict__ amax,
    u32* __restrict__ payload,
    float* __restrict__ scales,
    u32* __restrict__ payload_t,
    float* __restrict__ scales_t,
    u32* record,
    const Info info) {
    const u32 unit = threadIdx.x;
    const u32 cu = unit % 16u;
    const u32 ru = unit / 16u;
    const u32 ct = blockIdx.x;
    const u32 col_tiles = gridDim.x;
    const u64 words = (u64)col_tiles * 32u;
    const u64 row0 = (u64)blockIdx.y * 128u + ru * 8u;
    const u64 col0 = (u64)ct * 128u + cu * 8u;
    const bool per_tile = !GIVEN_AMAX && !BLOCK;
    // The transpose's multiplier under T_BLOCK.
    float s_t = 1.0f;

    u32 m = 0u;
#if GIVEN_AMAX
    m = __float_as_uint(amax[0]);
    // The tile's amax for the record, skipping NaN and infinities as the reference does (every
    // write of `warp_max` in the caller came before its last barrier).
    u32 t = 0u;
    for (int i = 0; i < 8; i++)
        for (int e = 0; e < 8; e++) t = umax(t, amax_term(element(x, dy, info, row0 + i, col0 + e)));
    t = __reduce_max_sync(0xFFFFFFFFu, t);
    if (unit % 32u == 0u) warp_max[unit / 32u] = t;
    __syncthreads();
    record_amax(record, info);
#else
    // Partial maxima: rows at r * 16 + cu, columns (of thread row ru) at
    // 2048 + ru * 128 + e * 16 + cu for column cu * 8 + e.
    for (int i = 0; i < 8; i++) {
        u32 rm = 0u;
        for (int e = 0; e < 8; e++) rm = umax(rm, amax_term(element(x, dy, info, row0 + i, col0 + e)));
        stage[(ru * 8u + i) * 16u + cu] = rm;
    }
    for (int e = 0; e < 8; e++) {
        u32 cm = 0u;
        for (int i = 0; i < 8; i++) cm = umax(cm, amax_term(element(x, dy, info, row0 + i, col0 + e)));
        stage[2048u + ru * 128u + e * 16u + cu] = cm;
    }
    __syncthreads();
    // Threads 0..128 take a row's amax, 128..256 a column's.
    if (unit < 128u) {
        for (u32 p = 0; p < 16u; p++) m = umax(m, stage[unit * 16u + p]);
    } else {
        const u32 c = unit - 128u;
        for (u32 p = 0; p < 16u; p++) m = umax(m, stage[2048u + p * 128u + (c % 8u) * 16u + c / 8u]);
    }
    maxima[unit] = m;
    __syncthreads();
#if BLOCK || T_BLOCK
    // The tile's amax: the largest row amax.
    u32 tile_m = 0u;
    for (u32 r = 0; r < 128u; r++) tile_m = umax(tile_m, maxima[r]);
#endif
#if BLOCK
    m = tile_m;
#elif T_BLOCK
    s_t = multiplier(__uint_as_float(tile_m));
#endif
#endif
    const float s_all = multiplier(__uint_as_float(m));

    for (int i = 0; i < 8; i++) {
        const u64 row = row0 + i;
        if (row < info.rows) {
            const float s = per_tile ? multiplier(__uint_as_float(maxima[ru * 8u + i])) : s_all;
            float r[8];
            for (int e = 0; e < 8; e++) r[e] = element(x, dy, info, row, col0 + e);
            uint2 w;
            w.x = word_of_any(r[0], r[1], r[2], r[3], s);
            w.y = word_of_any(r[4], r[5], r[6], r[7], s);
            *reinterpret_cast<uint2*>(&payload[row * words + ct * 32u + cu * 2u]) = w;
            if (per_tile && cu == 0u) scales[(u64)ct * info.rows + row] = dequant_scale(s);
        }
    }
    // Every read of the partial maxima in `stage` came before the last barrier.
    for (int e = 0; e < 8; e++) {
        const u32 c = cu * 8u + e;
        const float s = !per_tile ? s_all : T_BLOCK ? s_t : multiplier(__uint_as_float(maxima[128u + c]));
        float r[8];
        for (int i = 0; i < 8; i++) r[i] = element(x, dy, info, row0 + i, col0 + e);
        uint2 w;
        w.x = word_of_any(r[0], r[1], r[2], r[3], s);
        w.y = word_of_any(r[4], r[5], r[6], r[7], s);
        *reinterpret_cast<uint2*>(&stage[c * 32u + ((ru ^ cu) * 2u)]) = w;
    }
    __syncthreads();
    write_transposed(payload_t, info);
    if (per_tile && !T_BLOCK && unit >= 128u) {
        const u64 col = (u64)ct * 128u + unit - 128u;
        if (col < info.cols) scales_t[(u64)blockIdx.y * info.cols + col] = dequant_scale(multiplier(__uint_as_float(m)));
    }
#if T_BLOCK
    if (unit == 0u) write_block_scale(scales_t, gridDim.y, blockIdx.x, blockIdx.y, dequant_scale(s_t));
#endif
    write_tile_scale(scales, scales_t, s_all);
}

// Where the column partial maxima start in `stage` (after the row partial maxima).
#define COL_PART 2560u

// Blocks a multiprocessor holds at least (64 registers a thread for 16-bit inputs; with the GELU
// prologue, which makes the kernel compute-bound, two blocks a multiprocessor measured slower).
#if IN_KIND == 0
#define MIN_BLOCKS 2
#else
#define MIN_BLOCKS 4
#endif

extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) fp8_quantize_pair_native(
    const in_t* __restrict__ x,
    const in_t* __restrict__ dy,
    const float* __restrict__ amax,
    u32* __restrict__ payload,
    float* __restrict__ scales,
    u32* __restrict__ payload_t,
    float* __restrict__ scales_t,
    u32* record,
    const __grid_constant__ Info info) {
    const u64 rows = info.rows;
    const u64 cols = info.cols;
    const u32 unit = threadIdx.x;
    const u32 cu = unit % 16u;
    const u32 ru = unit / 16u;
    const u32 ct = blockIdx.x;
    const u32 rt = blockIdx.y;
    const u32 col_tiles = gridDim.x;
    const u64 words = (u64)col_tiles * 32u;
    const u64 row0 = (u64)rt * 128u + ru * 8u;
    const u64 col0 = (u64)ct * 128u + cu * 8u;
    const bool per_tile = !GIVEN_AMAX && !BLOCK;

    // The thread's values as loaded (after the prologue): row row0 + i in words i * ROW_WORDS ..
    // (for 16-bit inputs, column col0 + e in the low half of word e / 2 for even e, the high half
    // for odd e); 0 outside the matrix. V(k) is value k = i * 8 + e as f32.
    u32 v[WORDS];
#if IN_KIND == 0
#define V(k) __uint_as_float(v[k])
#else
#define V(k) half_bits_to_f32(((k) & 1) ? (v[(k) >> 1] >> 16) : (v[(k) >> 1] & 0xFFFFu))
#endif
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const u64 row = row0 + i;
#if VEC && PROLOGUE >= 3
        // SwiGLU: the chunk's 8 columns lie in one half (ff is a multiple of 8 where VEC is set).
        const bool inside = row < rows && col0 < cols;
        const u64 ff = swiglu_ff(info);
        const bool up_half = PROLOGUE == 4 && col0 >= ff;
        const u64 c = up_half ? col0 - ff : col0;
        const uint4* gp = reinterpret_cast<const uint4*>(x + row * info.stride_i + c);
        const uint4* upp = reinterpret_cast<const uint4*>(x + row * info.stride_i + ff + c);
#if PROLOGUE == 4
        const uint4* dp = reinterpret_cast<const uint4*>(dy + row * ff + c);
#endif
#pragma unroll
        for (int h = 0; h < ROW_WORDS / 4; h++) {
            uint4 a = {0u, 0u, 0u, 0u};
            if (inside) {
                const uint4 g = gp[h];
                const uint4 u = up_half ? g : upp[h];
                uint4 d = {0u, 0u, 0u, 0u};
#if PROLOGUE == 4
                d = dp[h];
#endif
                a.x = swiglu_word(g.x, u.x, d.x, up_half);
                a.y = swiglu_word(g.y, u.y, d.y, up_half);
                a.z = swiglu_word(g.z, u.z, d.z, up_half);
                a.w = swiglu_word(g.w, u.w, d.w, up_half);
            }
            v[i * ROW_WORDS + h * 4 + 0] = a.x;
            v[i * ROW_WORDS + h * 4 + 1] = a.y;
            v[i * ROW_WORDS + h * 4 + 2] = a.z;
            v[i * ROW_WORDS + h * 4 + 3] = a.w;
        }
#elif VEC
        const uint4* p = reinterpret_cast<const uint4*>(x + row * info.stride_i + col0);
        const bool inside = row < rows && col0 < cols;
#pragma unroll
        for (int h = 0; h < ROW_WORDS / 4; h++) {
            uint4 a = {0u, 0u, 0u, 0u};
            if (inside) {
                a = p[h];
#if PROLOGUE != 0
                uint4 d = {0u, 0u, 0u, 0u};
#if PROLOGUE == 2
                d = reinterpret_cast<const uint4*>(dy + row * info.stride_i + col0)[h];
#endif
                a.x = prologue_word(a.x, d.x);
                a.y = prologue_word(a.y, d.y);
                a.z = prologue_word(a.z, d.z);
                a.w = prologue_word(a.w, d.w);
#endif
            }
            v[i * ROW_WORDS + h * 4 + 0] = a.x;
            v[i * ROW_WORDS + h * 4 + 1] = a.y;
            v[i * ROW_WORDS + h * 4 + 2] = a.z;
            v[i * ROW_WORDS + h * 4 + 3] = a.w;
        }
#else
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const u64 col = col0 + e;
            const bool inside = row < rows && col < cols;
#if PROLOGUE == 0
#if IN_KIND == 0
            const u32 bits = inside ? __float_as_uint(x[row * info.stride_i + col * info.stride_j]) : 0u;
#else
            const u32 bits = inside ? (u32)x[row * info.stride_i + col * info.stride_j] : 0u;
#endif
#else
            const u32 bits = inside ? to_in_bits(element(x, dy, info, row, col)) : 0u;
#endif
#if IN_KIND == 0
            v[i * 8 + e] = bits;
#else
            const u32 h = bits;
            if (e % 2 == 0) {
                v[i * 4 + e / 2] = h;
            } else {
                v[i * 4 + e / 2] |= h << 16;
            }
#endif
        }
#endif
    }

    // 1. The maxima of |x| as integers: of each row's words and of each column word.
    u32 row_max[8];
    u32 col_max[ROW_WORDS];
#pragma unroll
    for (int q = 0; q < ROW_WORDS; q++) col_max[q] = 0u;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        row_max[i] = 0u;
#pragma unroll
        for (int q = 0; q < ROW_WORDS; q++) {
            const u32 a = v[i * ROW_WORDS + q] & ABS_MASK;
            row_max[i] = word_max(row_max[i], a);
            col_max[q] = word_max(col_max[q], a);
        }
    }
    u32 top = 0u;
#pragma unroll
    for (int q = 0; q < ROW_WORDS; q++) top = word_max(top, col_max[q]);
    top = word_top(top);

#if GIVEN_AMAX
    // For the record: the warp's largest |x| as f32 bits (read only if the tile is finite).
    const u32 warp_top = __reduce_max_sync(0xFFFFFFFFu, top);
    if (unit % 32u == 0u) warp_max[unit / 32u] = __float_as_uint(amax_of_bits(warp_top));
#elif BLOCK
    const u32 warp_top = __reduce_max_sync(0xFFFFFFFFu, top);
    if (unit % 32u == 0u) warp_max[unit / 32u] = warp_top;
#else
    // Row partial maxima, a word for rows WORD_VALUES (ru * ROW_WORDS + j) ..: at
    // (ru * ROW_WORDS + j) * ROW_PART_STRIDE + cu. Column partial maxima, a word for columns
    // WORD_VALUES (cu * ROW_WORDS + q) ..: at COL_PART + ru * 16 ROW_WORDS + cu * ROW_WORDS + q.
#pragma unroll
    for (int j = 0; j < ROW_WORDS; j++) {
#if WORD_VALUES == 2
        const u32 r = word_max(__byte_perm(row_max[2 * j], row_max[2 * j + 1], 0x5410),
                               __byte_perm(row_max[2 * j], row_max[2 * j + 1], 0x7632));
#else
        const u32 r = row_max[j];
#endif
        stage[(ru * ROW_WORDS + j) * ROW_PART_STRIDE + cu] = r;
    }
    uint4* col_part = reinterpret_cast<uint4*>(&stage[COL_PART + ru * (16u * ROW_WORDS) + cu * ROW_WORDS]);
#pragma unroll
    for (int h = 0; h < ROW_WORDS / 4; h++) {
        uint4 a;
        a.x = col_max[h * 4 + 0];
        a.y = col_max[h * 4 + 1];
        a.z = col_max[h * 4 + 2];
        a.w = col_max[h * 4 + 3];
        col_part[h] = a;
    }
#if T_BLOCK
    const u32 warp_top = __reduce_max_sync(0xFFFFFFFFu, top);
    if (unit % 32u == 0u) warp_max[unit / 32u] = warp_top;
#endif
#endif
    if (__syncthreads_or(top >= NONFINITE)) {
        slow_tile(x, dy, amax, payload, scales, payload_t, scales_t, record, info);
        return;
    }

    // 2. The multipliers.
    float s_all = 1.0f;
#if GIVEN_AMAX
    s_all = multiplier(amax[0]);
    record_amax(record, info);
#elif BLOCK
    u32 m = 0u;
#pragma unroll
    for (int w = 0; w < 8; w++) m = umax(m, warp_max[w]);
    s_all = multiplier(amax_of_bits(m));
#else
    // Thread w < 16 ROW_WORDS reduces row word w, the next 16 ROW_WORDS threads column word w
    // (none under T_BLOCK, where every column takes the tile's multiplier).
    const u32 lines = 16u * ROW_WORDS;
    if (unit < (T_BLOCK ? 1u : 2u) * lines) {
        const bool is_row = unit < lines;
        const u32 w = is_row ? unit : unit - lines;
        u32 m = 0u;
        if (is_row) {
            const uint4* part = reinterpret_cast<const uint4*>(&stage[w * ROW_PART_STRIDE]);
#pragma unroll
            for (int h = 0; h < 4; h++) {
                const uint4 a = part[h];
                m = word_max(word_max(m, a.x), word_max(a.y, word_max(a.z, a.w)));
            }
        } else {
#pragma unroll
            for (u32 p = 0; p < 16u; p++) m = word_max(m, stage[COL_PART + p * (16u * ROW_WORDS) + w]);
        }
#pragma unroll
        for (u32 h = 0; h < WORD_VALUES; h++) {
            const float s = multiplier(amax_of_bits(WORD_VALUES == 2 ? (m >> (16u * h)) & 0xFFFFu : m));
            const u32 k = w * WORD_VALUES + h;
            if (is_row) {
                row_mult[k] = s;
                const u64 row = (u64)rt * 128u + k;
                if (row < rows) scales[(u64)ct * rows + row] = dequant_scale(s);
            } else {
                col_mult[k] = s;
                const u64 col = (u64)ct * 128u + k;
                if (col < cols) scales_t[(u64)rt * cols + col] = dequant_scale(s);
            }
        }
    }
    __syncthreads();
#if T_BLOCK
    u32 tile_top = 0u;
#pragma unroll
    for (int w = 0; w < 8; w++) tile_top = umax(tile_top, warp_max[w]);
    const float s_t = multiplier(amax_of_bits(tile_top));
#endif
#endif

    // 3. The codes. As stored: words 2 cu, 2 cu + 1 of each of the thread's rows.
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const u64 row = row0 + i;
        if (row < rows) {
            const float s = per_tile ? row_mult[ru * 8u + i] : s_all;
            const int k = i * 8;
            uint2 w;
            w.x = word_of(V(k), V(k + 1), V(k + 2), V(k + 3), s);
            w.y = word_of(V(k + 4), V(k + 5), V(k + 6), V(k + 7), s);
            *reinterpret_cast<uint2*>(&payload[row * words + ct * 32u + cu * 2u]) = w;
        }
    }
    // Transposed: column cu * 8 + e's words 2 ru, 2 ru + 1, staged at c * 32 + (word ^ 2 cu)
    // (XOR-swizzled: neither the writes nor the reads of write_transposed conflict more than
    // 2-way). Every read of the partial maxima in `stage` came before the last barrier.
#pragma unroll
    for (int e = 0; e < 8; e++) {
        const u32 c = cu * 8u + e;
#if T_BLOCK
        const float s = s_t;
#else
        const float s = per_tile ? col_mult[c] : s_all;
#endif
        uint2 w;
        w.x = word_of(V(e), V(8 + e), V(16 + e), V(24 + e), s);
        w.y = word_of(V(32 + e), V(40 + e), V(48 + e), V(56 + e), s);
        *reinterpret_cast<uint2*>(&stage[c * 32u + ((ru ^ cu) * 2u)]) = w;
    }
    __syncthreads();
    write_transposed(payload_t, info);
#if T_BLOCK
    if (unit == 0u) write_block_scale(scales_t, gridDim.y, ct, rt, dequant_scale(s_t));
#endif
    write_tile_scale(scales, scales_t, s_all);
}

// ---------------------------------------------------------------------------------------------
// The amax of a whole tensor, for per-tensor scaling (GIVEN_AMAX above): the CUDA C++ counterpart
// of the CubeCL kernel `tensor_amax` (fp8/kernel.rs), for a dense tensor read in 16-byte chunks
// (IN_KIND only matters here). Block b writes the largest finite normal |x| of its chunks to
// partials[b]; their max is the tensor's amax. As in the pair kernel, |x| comes from the bits by
// a mask and integer max, two 16-bit values at once; a thread that met NaN or an infinity takes
// its chunks again value by value, skipping them.

struct AmaxInfo {
    u64 chunks;
};

// |x| of a chunk's values, folded to one word by word_max.
__device__ __forceinline__ u32 chunk_max(uint4 a) {
    return word_max(word_max(a.x & ABS_MASK, a.y & ABS_MASK), word_max(a.z & ABS_MASK, a.w & ABS_MASK));
}

// The reference's amax term of a word's values (NaN, infinities and f32 subnormals skipped).
__device__ __forceinline__ u32 word_amax_terms(u32 w) {
#if WORD_VALUES == 2
    return umax(amax_term(half_bits_to_f32(w & 0xFFFFu)), amax_term(half_bits_to_f32(w >> 16)));
#else
    return amax_term(__uint_as_float(w));
#endif
}

extern "C" __global__ void __launch_bounds__(256) fp8_tensor_amax_native(
    const uint4* __restrict__ x,
    float* __restrict__ partials,
    const __grid_constant__ AmaxInfo info) {
    const u64 step = (u64)gridDim.x * 256u;
    const u64 first = (u64)blockIdx.x * 256u + threadIdx.x;
    u32 m = 0u;
    u64 c = first;
    // Four chunks in flight a thread.
    for (; c + 3u * step < info.chunks; c += 4u * step) {
        uint4 a[4];
#pragma unroll
        for (int k = 0; k < 4; k++) a[k] = x[c + k * step];
#pragma unroll
        for (int k = 0; k < 4; k++) m = word_max(m, chunk_max(a[k]));
    }
    for (; c < info.chunks; c += step) m = word_max(m, chunk_max(x[c]));
    const u32 top = word_top(m);
    u32 bits = __float_as_uint(amax_of_bits(top));
    if (top >= NONFINITE) {
        bits = 0u;
        for (u64 d = first; d < info.chunks; d += step) {
            const uint4 a = x[d];
            bits = umax(umax(word_amax_terms(a.x), word_amax_terms(a.y)),
                        umax(bits, umax(word_amax_terms(a.z), word_amax_terms(a.w))));
        }
    }
    bits = __reduce_max_sync(0xFFFFFFFFu, bits);
    if (threadIdx.x % 32u == 0u) warp_max[threadIdx.x / 32u] = bits;
    __syncthreads();
    if (threadIdx.x == 0u) {
        u32 b = 0u;
#pragma unroll
        for (int w = 0; w < 8; w++) b = umax(b, warp_max[w]);
        partials[blockIdx.x] = __uint_as_float(b);
    }
}
