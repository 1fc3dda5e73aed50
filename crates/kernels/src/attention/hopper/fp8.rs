//! The Hopper forward in FP8 (experimental; `BURNMIX_FLASH_FP8=on`,
//! [`crate::settings::Settings::flash_fp8`]): FlashAttention-3's recipe with block scales. q, k
//! and v (16-bit) are quantized to e4m3 by `fp8_quantize.cu`, one f32 scale per 64 query rows or
//! 128 keys of each (batch, head), v transposed with its keys in the order the kernel's P
//! fragments take them; then `forward.cu` built with `FP8` runs both products on e4m3 operands
//! and writes the output in the input dtype and the f32 log-sum-exp, as the 16-bit forward does,
//! so that the 16-bit backward takes them unchanged (the backward stays in 16 bits).

use std::sync::atomic::Ordering;

use burn::tensor::DType;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;

use super::{
    check_maps, check_tiles, cuda, map_in_boxes, map_of, runs_on, Dims, ForwardJob, MapElement,
    Shape, BLOCK_K, FORWARD_FP8_RUNS, OUT_BOX_ROWS,
};
use crate::attention::fp8_reference::{KEY_SCALE_ROWS, Q_SCALE_ROWS};
use crate::cuda_source::{launch as launch_cuda, CudaSource};

/// The quantizer's NVRTC source: the shared helpers, then its two kernels.
const QUANTIZE_SOURCE: &str = concat!(include_str!("common.cuh"), include_str!("fp8_quantize.cu"));
// A k or v scale covers one key block of `forward.cu` (a q scale one consumer warpgroup's rows).
const _: () = assert!(KEY_SCALE_ROWS == BLOCK_K);
/// Threads of a quantizer block (`QUANT_THREADS`).
const QUANT_THREADS: u32 = 256;

/// Whether [`forward_fp8`] runs for these tensors: the setting on, and what the 16-bit Hopper
/// forward takes (see `runs_on`), with the FP8 block's shared memory.
pub(crate) fn applies_fp8<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    d: &Dims,
    dropout: bool,
) -> bool {
    crate::settings::read(|s| s.flash_fp8)
        && runs_on(
            &[q, k, v],
            d,
            dropout,
            Shape::at(d.hd, false, d.seq_q).fp8().shared_bytes(d.hd, 1),
        )
}

/// Writes `out` and `lse` as `super::forward` does, through e4m3 copies of q, k and v, where
/// [`applies_fp8`] said yes. Nothing is queued where the driver refuses a tensor map or the call
/// has 2^32 tiles or more; the error says why.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_fp8<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    out: &CubeTensor<R>,
    lse: &CubeTensor<R>,
    d: &Dims,
    causal: bool,
    scale: f32,
) -> Result<(), String> {
    fn on_cuda<R: CubeRuntime>(t: &CubeTensor<R>) -> &CubeTensor<CudaRuntime> {
        cuda(t).expect("hopper::forward_fp8 runs only where `applies_fp8` said yes (CUDA)")
    }
    let (q, k, v, out, lse) = (
        on_cuda(q),
        on_cuda(k),
        on_cuda(v),
        on_cuda(out),
        on_cuda(lse),
    );
    let kv_heads = d.heads / d.group;
    let q_blocks = d.seq_q.div_ceil(Q_SCALE_ROWS);
    let k_blocks = d.seq_k.div_ceil(KEY_SCALE_ROWS);
    // The quantizer's grids: one block per (batch, head) pair and block of rows.
    let quantizer_blocks = d.batch * d.heads * q_blocks.max(k_blocks);
    if quantizer_blocks > i32::MAX as usize {
        return Err(format!(
            "{quantizer_blocks} quantizer blocks: at most 2^31 - 1"
        ));
    }
    // v's keys rounded up to 32 (whole groups of the kernel's key order; 32-byte rows).
    let keys = d.seq_k.div_ceil(32) * 32;
    let alloc = |shape: Vec<usize>, dtype| {
        empty_device_contiguous_dtype(q.client.clone(), q.device.clone(), shape.into(), dtype)
    };
    let q8 = alloc(vec![d.batch, d.heads, d.seq_q, d.hd], DType::U8);
    let k8 = alloc(vec![d.batch, kv_heads, d.seq_k, d.hd], DType::U8);
    let vt8 = alloc(vec![d.batch, kv_heads, d.hd, keys], DType::U8);
    let q_scale = alloc(vec![d.batch, d.heads, q_blocks], DType::F32);
    let k_scale = alloc(vec![d.batch, kv_heads, k_blocks], DType::F32);
    let v_scale = alloc(vec![d.batch, kv_heads, k_blocks], DType::F32);
    let shape = Shape::at(d.hd, causal, d.seq_q);
    let e4m3 = MapElement::E4m3;
    let maps = vec![
        map_in_boxes(&q8, shape.block_q(), d.hd, e4m3),
        map_in_boxes(&k8, BLOCK_K, d.hd, e4m3),
        map_in_boxes(&vt8, d.hd, BLOCK_K, e4m3),
        // `Info` holds the output's map too; the FP8 forward stores its output directly.
        map_of(out, OUT_BOX_ROWS),
    ];
    check_maps(&maps)?;
    // Refused before anything is launched (`ForwardJob::queue` checks again).
    check_tiles(d, causal)?;
    let bf16 = q.dtype == DType::BF16;
    quantize(q, &q8, &q_scale, Q_SCALE_ROWS, false, bf16);
    quantize(k, &k8, &k_scale, KEY_SCALE_ROWS, false, bf16);
    quantize(v, &vt8, &v_scale, KEY_SCALE_ROWS, true, bf16);
    let job = ForwardJob {
        tensors: vec![
            q8,
            k8,
            vt8,
            out.clone(),
            lse.clone(),
            q_scale,
            k_scale,
            v_scale,
        ],
        maps,
        fp8: true,
        bf16,
    };
    job.queue(d, causal, scale)?;
    FORWARD_FP8_RUNS.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// Launches `fp8_quantize.cu` on `x` `[batch, heads, seq, hd]` (16-bit, unit last stride, the
/// others multiples of 8): codes into `codes` (`transposed`: v's layout) and one scale per block
/// of `rows` rows into `scales`.
fn quantize(
    x: &CubeTensor<CudaRuntime>,
    codes: &CubeTensor<CudaRuntime>,
    scales: &CubeTensor<CudaRuntime>,
    rows: usize,
    transposed: bool,
    bf16: bool,
) {
    let (shape, strides) = (x.meta.shape(), x.meta.strides());
    let (heads, seq, hd) = (shape[1], shape[2], shape[3]);
    let blocks = seq.div_ceil(rows);
    let keys = seq.div_ceil(32) * 32;
    // `QuantInfo`: heads, seq, blocks, the strides, keys.
    let info = [heads, seq, blocks, strides[0], strides[1], strides[2], keys]
        .map(|x| x as u64)
        .to_vec();
    let defines = format!(
        "#define HD {hd}\n#define IS_BF16 {}\n#define ROWS {rows}\n",
        u8::from(bf16)
    );
    let entry = if transposed {
        "attention_fp8_vt"
    } else {
        "attention_fp8_rows"
    };
    let kernel = CudaSource::new(
        entry,
        defines,
        QUANTIZE_SOURCE,
        CubeDim::new_1d(QUANT_THREADS),
    );
    let grid = shape[0] * heads * blocks;
    launch_cuda(
        &x.client,
        kernel,
        (grid as u32, 1, 1),
        vec![
            x.handle.clone().binding(),
            codes.handle.clone().binding(),
            scales.handle.clone().binding(),
        ],
        info,
    );
}
