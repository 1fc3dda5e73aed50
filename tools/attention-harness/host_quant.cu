// Host entry points around the FP8 forward's quantizer (crates/kernels/src/attention/hopper/
// fp8_quantize.cu), built by nvcc into a shared library that fp8_forward.py calls from PyTorch.
// The variant's macros (HD, IS_BF16, ROWS) come from the nvcc command line; QUANT_SOURCE, when
// defined (a quoted path), names another version of fp8_quantize.cu to build instead
// (quantizer_bench.py --against).
#include <cuda.h>
#include <cuda_runtime.h>

#include "../../crates/kernels/src/attention/hopper/common.cuh"
#ifdef QUANT_SOURCE
#include QUANT_SOURCE
#else
#include "../../crates/kernels/src/attention/hopper/fp8_quantize.cu"
#endif

// x [batch, heads, seq, HD] at element strides st (b, h, s); `transposed`: vt (keys = seq rounded
// up to 32) instead of row codes.
extern "C" int quantize(const void* x, void* out, float* scale, u64 batch, u64 heads, u64 seq, const u64* st,
                        int transposed, void* stream) {
    QuantInfo info;
    info.heads = heads;
    info.seq = seq;
    info.blocks = (seq + ROWS - 1) / ROWS;
    info.sb = st[0];
    info.sh = st[1];
    info.ss = st[2];
    info.keys = (seq + 31) / 32 * 32;
    const u64 grid = batch * heads * info.blocks;
    if (transposed)
        attention_fp8_vt<<<(unsigned)grid, QUANT_THREADS, 0, (cudaStream_t)stream>>>(
            (const unsigned short*)x, (unsigned char*)out, scale, info);
    else
        attention_fp8_rows<<<(unsigned)grid, QUANT_THREADS, 0, (cudaStream_t)stream>>>(
            (const unsigned short*)x, (unsigned char*)out, scale, info);
    return (int)cudaGetLastError();
}
