//! TMA tensor maps (CUDA's `CUtensorMap`) over attention's q, k, v (and dO in the backward) for the
//! Hopper kernels: the 128 bytes from which a kernel's bulk copies read a tensor's address, shape,
//! strides and box, encoded on the host by the driver and passed to the kernel by value.

use cudarc::driver::sys;

use crate::cuda_context::with_primary_context;

/// A device address as aligned as any the Hopper kernels pass (CubeCL's allocations start at
/// 256-byte multiples): the caller encodes each map at it first, so that the driver's checks of
/// shapes, strides and boxes are answered before the launch is queued.
pub(super) const STAND_IN_ADDRESS: u64 = 1 << 20;

/// The element type of a mapped tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum MapElement {
    F16,
    Bf16,
    /// FP8 e4m3 codes, mapped as bytes.
    E4m3,
}

impl MapElement {
    fn bytes(self) -> u64 {
        match self {
            MapElement::F16 | MapElement::Bf16 => 2,
            MapElement::E4m3 => 1,
        }
    }
}

/// A tensor map but for its address: over a `[batch, heads, seq, cols]` tensor with element
/// strides `strides` (batch, heads, seq; the last dimension contiguous), copied in boxes of
/// `box_cols` columns by `box_rows` rows with the swizzle of the box's row width (128 or 64 bytes:
/// the layout `wgmma` reads); rows past `seq` and columns past `cols` read as zeros. The 16-bit
/// kernels take boxes of 64 columns; the FP8 forward's byte boxes are head_dim (q, k) or 128 keys
/// (v transposed) wide.
pub(super) struct MapOf {
    /// The CUDA device (index) that holds the tensor.
    pub(super) device: usize,
    pub(super) shape: [usize; 4],
    pub(super) strides: [usize; 3],
    pub(super) box_rows: u32,
    pub(super) box_cols: u32,
    pub(super) element: MapElement,
}

impl MapOf {
    /// The map at device address `ptr`: its 16 words, as the kernel's `TensorMap`, or the
    /// driver's refusal.
    pub(super) fn encode(&self, ptr: u64) -> Result<[u64; 16], String> {
        with_primary_context(self.device, || encode(ptr, self))?
    }
}

fn encode(ptr: u64, map: &MapOf) -> Result<[u64; 16], String> {
    let (shape, strides, rows, cols) = (map.shape, map.strides, map.box_rows, map.box_cols);
    let size = map.element.bytes();
    let [batch, heads, seq, hd] = shape;
    // Innermost first: hd, seq, heads, batch. A dimension of size 1 is never stepped, so its
    // stride may be anything the driver accepts: the extent of the ones inside it.
    let dims = [hd as u64, seq as u64, heads as u64, batch as u64];
    let mut bytes = [
        strides[2] as u64 * size,
        strides[1] as u64 * size,
        strides[0] as u64 * size,
    ];
    let mut extent = hd as u64 * size;
    for (i, stride) in bytes.iter_mut().enumerate() {
        if dims[i + 1] == 1 {
            *stride = extent.next_multiple_of(16);
        }
        extent = extent.max(*stride * dims[i + 1]);
    }
    let boxes = [cols, rows, 1, 1];
    let unit = [1u32; 4];
    let data = match map.element {
        MapElement::Bf16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        MapElement::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        MapElement::E4m3 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
    };
    let swizzle = match u64::from(cols) * size {
        64 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
        128 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        bytes => {
            return Err(format!(
            "a box row of {bytes} bytes ({cols} columns): the kernels take rows of 64 or 128 bytes"
        ))
        }
    };
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: every array holds the rank's (4, or 3 for the strides) entries the driver reads;
    // encoding only writes `map` and does not touch the device memory at `ptr`.
    let result = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            data,
            4,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            bytes.as_ptr(),
            boxes.as_ptr(),
            unit.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if result != sys::CUresult::CUDA_SUCCESS {
        return Err(format!(
            "cuTensorMapEncodeTiled refused shape {shape:?}, element strides {strides:?}, box {cols} x {rows}: {result:?}"
        ));
    }
    Ok(map.opaque)
}
