// The harness hosts' TMA tensor maps (host.cu, backward_host.cu), encoded as the Rust launcher's
// tensor_map.rs encodes them. Included after the kernel file, which defines HD, IS_BF16 and
// TensorMap.

// A tensor map over t [batch, heads, seq, HD] (element strides sb, sh, ss), boxes of 64 columns by
// `rows` rows, 128-byte swizzle.
static int encode(TensorMap* map, const void* t, u64 heads, u64 seq, u64 batch, u64 sb, u64 sh, u64 ss, u32 rows) {
    cuuint64_t dims[4] = {HD, seq, heads, batch};
    cuuint64_t strides[3] = {ss * 2, sh * 2, sb * 2};
    cuuint32_t box[4] = {64, rows, 1, 1};
    cuuint32_t unit[4] = {1, 1, 1, 1};
    CUresult r = cuTensorMapEncodeTiled(
        (CUtensorMap*)map, IS_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
        const_cast<void*>(t), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
        CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return (int)r;
}

