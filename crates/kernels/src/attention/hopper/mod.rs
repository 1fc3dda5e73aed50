//! FlashAttention's forward (`forward.cu`, launched here; in FP8 through `fp8.rs`, experimental)
//! and backward (`backward.cu`, see `backward.rs`) on Hopper GPUs (compute capability 9.0) in
//! CUDA C++, sharing the device helpers of `common.cuh`. The forward is built as FlashAttention-3
//! builds it: TMA copies from a producer warp (through the tensor maps of `tensor_map.rs`),
//! warpgroup MMA (`wgmma`) from swizzled shared memory in consumer warpgroups that take turns at
//! the tensor cores.
//! CubeCL 0.10 can express none of these; the kernels are compiled by NVRTC for sm_90a and
//! launched on CubeCL's stream with CubeCL's buffers (see `cuda_source.rs`). The forward computes
//! what the CubeCL kernel `flash_forward_mma` computes (the output and the f32 log-sum-exp the
//! backward recomputes P from) for f16 and bf16 inputs at head_dim 64 and 128 without dropout;
//! every other call, and every GPU other than sm_90, takes the CubeCL kernels, which stay the
//! reference. `BURNMIX_FLASH_HOPPER=off`
//! ([`crate::settings::Settings::flash_hopper`]) turns them all off.

mod backward;
mod fp8;
mod launch;
mod schedule;
mod tensor_map;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;

use super::dims::Dims;
use crate::cuda_source::{device_facts, CudaSource};
use crate::gemm::cublaslt::as_cuda as cuda;
pub(crate) use backward::{applies_backward, backward};
pub(crate) use fp8::{applies_fp8, forward_fp8};
use launch::Launch;
use tensor_map::{MapElement, MapOf, STAND_IN_ADDRESS};

// How often the Hopper kernels ran, and how often one applied but could not run, in this process
// (see `crate::attention::hopper_calls`).
static FORWARD_RUNS: AtomicUsize = AtomicUsize::new(0);
static FORWARD_FP8_RUNS: AtomicUsize = AtomicUsize::new(0);
static BACKWARD_RUNS: AtomicUsize = AtomicUsize::new(0);
static BACKWARD_ROPE_RUNS: AtomicUsize = AtomicUsize::new(0);
static REFUSALS: AtomicUsize = AtomicUsize::new(0);

/// `(forward runs, FP8 forward runs, backward runs, backward runs with RoPE's inverse rotation,
/// refusals)`.
pub(crate) fn calls() -> (usize, usize, usize, usize, usize) {
    let load = |c: &AtomicUsize| c.load(Ordering::Relaxed);
    (
        load(&FORWARD_RUNS),
        load(&FORWARD_FP8_RUNS),
        load(&BACKWARD_RUNS),
        load(&BACKWARD_ROPE_RUNS),
        load(&REFUSALS),
    )
}

/// The Hopper kernels, as a refusal names them.
#[derive(Clone, Copy)]
pub(crate) enum Kernel {
    Forward,
    Backward,
    ForwardFp8,
}

/// A Hopper kernel could not run a call it applies to (the driver refused a tensor map, or the
/// call has more tiles or blocks than the kernel numbers), so the CubeCL kernels run it (the
/// 16-bit forward, for the FP8 one): counted, and said once per process and kernel.
pub(crate) fn refused(kernel: Kernel, why: &str) {
    static WARNED: [AtomicBool; 3] = [
        AtomicBool::new(false),
        AtomicBool::new(false),
        AtomicBool::new(false),
    ];
    REFUSALS.fetch_add(1, Ordering::Relaxed);
    let (what, instead) = match kernel {
        Kernel::Forward => ("forward", "the CubeCL kernels run"),
        Kernel::Backward => ("backward", "the CubeCL kernels run"),
        Kernel::ForwardFp8 => ("FP8 forward", "the 16-bit forward runs"),
    };
    if !WARNED[kernel as usize].swap(true, Ordering::Relaxed) {
        eprintln!(
            "warning: kernels::attention: the Hopper {what} cannot run ({why}); {instead} instead"
        );
    }
}

/// The FP8 forward is on (`BURNMIX_FLASH_FP8`, or the trainer's `fp8.attention`) but a forward
/// does not meet what the FP8 kernel takes (see `runs_on`): it runs without FP8, said once per
/// process, and counted in neither the FP8 runs nor the refusals.
pub(crate) fn fp8_not_applicable() {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if !WARNED.swap(true, Ordering::Relaxed) {
        eprintln!(
            "warning: kernels::attention: the FP8 attention forward is on (BURNMIX_FLASH_FP8 or \
             fp8.attention), but a forward is not one the FP8 kernel takes (f16/bf16, head_dim \
             64 or 128, no dropout, strides TMA can copy, a compute capability 9.0 GPU, the \
             Hopper kernels on): such calls run without FP8"
        );
    }
}

/// The forward's NVRTC source: the shared helpers, then the kernel.
const SOURCE: &str = concat!(include_str!("common.cuh"), include_str!("forward.cu"));
const ENTRY: &str = "flash_forward_hopper";
/// Keys per step.
const BLOCK_K: usize = 128;
/// Rows of the output's TMA boxes: a consumer warpgroup's (the 16-bit forward stores each
/// warpgroup's output from shared memory; the FP8 forward's map goes unused).
const OUT_BOX_ROWS: usize = 64;
/// Key/value blocks in shared memory at once in the FP8 forward, whose tiles take half the bytes:
/// four ran 0.99-1.13x as fast as two on an H100 (docs/results/2026-12-06-fp8-quantizer.md).
const FP8_STAGES: usize = 4;

/// A block's shape at one head_dim: its consumer warpgroups (64 query rows each; one producer
/// warpgroup more) and the key/value blocks in shared memory at once.
struct Shape {
    consumers: usize,
    stages: usize,
}

impl Shape {
    /// Two consumers (128 query rows) at head_dim 128, where each takes 240 registers. Three
    /// (192 rows, 160 registers each) at head_dim 64, except under the causal mask over fewer
    /// than 2048 queries: there the diagonal blocks, half masked, are a larger share of the work
    /// at 192 rows than at 128 (on an H200 at 1024 positions, 201 against 223 TFLOP/s; 358
    /// against 328 without the mask, and 385 against 355 causal at 4096).
    fn at(hd: usize, causal: bool, seq_q: usize) -> Self {
        let consumers = if hd == 64 && !(causal && seq_q < 2048) {
            3
        } else {
            2
        };
        Shape {
            consumers,
            stages: 2,
        }
    }

    /// The same block in the FP8 forward: [`FP8_STAGES`] stages.
    fn fp8(self) -> Self {
        Shape {
            stages: FP8_STAGES,
            ..self
        }
    }

    fn block_q(&self) -> usize {
        64 * self.consumers
    }

    fn threads(&self) -> u32 {
        128 * (self.consumers as u32 + 1)
    }

    /// Dynamic shared memory a block takes: two Q buffers and the stages of K and V (elements
    /// of `size` bytes), their barriers (8 bytes each), plus 1 KB so that the kernel can start
    /// its tiles on 1024-byte boundaries (its swizzle is a function of the address). 193 KB at
    /// head_dim 128 in 16 bits, within the 227 KB a Hopper block may have; 113 KB at most at
    /// head_dim 64; 161 KB at most in FP8 (one-byte elements, [`FP8_STAGES`] stages).
    fn shared_bytes(&self, hd: usize, size: usize) -> usize {
        (2 * self.block_q() + 2 * self.stages * BLOCK_K) * hd * size
            + 8 * (4 + 4 * self.stages)
            + 1024
    }
}

/// Whether `forward` runs for these tensors: see [`runs_on`]; the largest block shape of the
/// head_dim (the one without the mask) must fit in shared memory.
pub(crate) fn applies<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    d: &Dims,
    dropout: bool,
) -> bool {
    runs_on(
        &[q, k, v],
        d,
        dropout,
        Shape::at(d.hd, false, d.seq_q).shared_bytes(d.hd, 2),
    )
}

/// Whether a Hopper attention kernel runs for these tensors (q first): CUDA on a compute
/// capability 9.0 GPU with `shared` bytes of shared memory a block, f16 or bf16, head_dim 64 or
/// 128, some keys, no dropout, the setting on, and what TMA copies: unit last strides, the other
/// strides non-zero multiples of 8 elements (16 bytes) where their dimension has more than one
/// entry, and 16-byte aligned starts.
fn runs_on<R: CubeRuntime>(
    tensors: &[&CubeTensor<R>],
    d: &Dims,
    dropout: bool,
    shared: usize,
) -> bool {
    let q = tensors[0];
    if dropout
        || !(d.hd == 64 || d.hd == 128)
        || d.seq_k == 0
        || !matches!(q.dtype, DType::F16 | DType::BF16)
    {
        return false;
    }
    if !crate::settings::read(|s| s.flash_hopper) {
        return false;
    }
    let Some(qc) = cuda(q) else {
        return false;
    };
    if device_facts(qc).map(|f| f.compute_capability) != Some((9, 0)) {
        return false;
    }
    q.client.properties().hardware.max_shared_memory_size >= shared
        && tensors.iter().all(|t| rows_of_16_bytes(t))
}

/// Whether a `[batch, heads, seq, hd]` tensor of 16-bit values is read and written 16 bytes (8
/// values) at a time along its rows: a unit last stride, the others positive multiples of 8
/// (where their dimension is not 1), and its address a multiple of 16 bytes. The TMA maps of the
/// inputs need it, and so do the 16-byte stores of dQ's cast.
fn rows_of_16_bytes<R: CubeRuntime>(t: &CubeTensor<R>) -> bool {
    let (shape, s) = (t.meta.shape(), t.meta.strides());
    s[3] == 1
        && (0..3).all(|i| shape[i] == 1 || (s[i] > 0 && s[i].is_multiple_of(8)))
        && t.handle.offset_start.unwrap_or(0).is_multiple_of(16)
}

/// The TMA tensor map (but for its address) over a `[batch, heads, seq, hd]` tensor, in boxes of
/// `box_rows` rows.
fn map_of(t: &CubeTensor<CudaRuntime>, box_rows: usize) -> MapOf {
    let element = if t.dtype == DType::BF16 {
        MapElement::Bf16
    } else {
        MapElement::F16
    };
    map_in_boxes(t, box_rows, 64, element)
}

/// The TMA tensor map (but for its address) over a `[batch, heads, rows, cols]` tensor, in boxes
/// of `box_cols` columns by `box_rows` rows.
fn map_in_boxes(
    t: &CubeTensor<CudaRuntime>,
    box_rows: usize,
    box_cols: usize,
    element: MapElement,
) -> MapOf {
    let (dims, s) = (t.meta.shape(), t.meta.strides());
    MapOf {
        device: t.device.index,
        shape: [dims[0], dims[1], dims[2], dims[3]],
        strides: [s[0], s[1], s[2]],
        box_rows: box_rows as u32,
        box_cols: box_cols as u32,
        element,
    }
}

/// The maps encoded at a stand-in address as aligned as the real ones (CubeCL's allocations
/// start at 256-byte multiples, [`runs_on`] checked the inputs' offsets and the output is a fresh
/// allocation): the driver checks shapes, strides and boxes here, so that a refusal falls back
/// before anything is queued.
fn check_maps(maps: &[MapOf]) -> Result<(), String> {
    maps.iter()
        .try_for_each(|m| m.encode(STAND_IN_ADDRESS).map(|_| ()))
}

/// Writes `out` (`[batch, heads, seq_q, hd]`, with the strides and start that [`runs_on`] asks of
/// the inputs, as the caller's fresh tensor has them: the 16-bit forward stores it by TMA) and
/// `lse` (`[batch, heads, seq_q]` f32, contiguous) from q, k, v, where [`applies`] said yes.
/// The launch is queued on CubeCL's device thread (see `launch.rs`) and this returns at once;
/// where the driver refuses a tensor map or the call has 2^32 tiles or more, nothing is queued
/// and the error says why.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    out: &CubeTensor<R>,
    lse: &CubeTensor<R>,
    d: &Dims,
    causal: bool,
    scale: f32,
) -> Result<(), String> {
    let tensors: Option<Vec<&CubeTensor<CudaRuntime>>> =
        [q, k, v, out, lse].into_iter().map(cuda).collect();
    let tensors = tensors.expect("hopper::forward runs only where `applies` said yes (CUDA)");
    let shape = Shape::at(d.hd, causal, d.seq_q);
    // The tensor maps: q in boxes of a block's query rows, k and v in blocks of keys, out in a
    // consumer warpgroup's rows.
    let maps: Vec<MapOf> = tensors[..4]
        .iter()
        .zip([shape.block_q(), BLOCK_K, BLOCK_K, OUT_BOX_ROWS])
        .map(|(t, rows)| map_of(t, rows))
        .collect();
    check_maps(&maps)?;
    let bf16 = q.dtype == DType::BF16;
    let job = ForwardJob {
        tensors: tensors.into_iter().cloned().collect(),
        maps,
        fp8: false,
        bf16,
    };
    job.queue(d, causal, scale)?;
    FORWARD_RUNS.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// forward.cu numbers its tiles in 32 bits: calls of 2^32 tiles or more are refused.
fn check_tiles(d: &Dims, causal: bool) -> Result<(), String> {
    let q_blocks = d.seq_q.div_ceil(Shape::at(d.hd, causal, d.seq_q).block_q());
    let pairs = d.batch * d.heads;
    if q_blocks.saturating_mul(pairs) > u32::MAX as usize {
        return Err(format!(
            "{q_blocks} query blocks x {pairs} (batch, head) pairs: at most 2^32 - 1 tiles"
        ));
    }
    Ok(())
}

/// A forward launch but for its `Info` words and grid: the kernel's tensors in its parameters'
/// order (the four mapped ones first: q, k, v, out), their maps, and the variant.
struct ForwardJob {
    tensors: Vec<CubeTensor<CudaRuntime>>,
    maps: Vec<MapOf>,
    /// e4m3 inputs with block scales (`forward.cu`'s FP8), else 16-bit.
    fp8: bool,
    /// bf16 output (and inputs, when 16-bit), else f16.
    bf16: bool,
}

impl ForwardJob {
    /// Completes the `Info` words (the tile order's section size among them) and queues the
    /// launch; refuses 2^32 tiles or more before anything is queued.
    fn queue(self, d: &Dims, causal: bool, scale: f32) -> Result<(), String> {
        let shape = Shape::at(d.hd, causal, d.seq_q);
        let shape = if self.fp8 { shape.fp8() } else { shape };
        let q_blocks = d.seq_q.div_ceil(shape.block_q());
        let pairs = d.batch * d.heads;
        check_tiles(d, causal)?;
        let so = self.tensors[3].meta.strides();
        let mut words: Vec<u64> = [d.heads, d.group, d.seq_q, d.seq_k, so[0], so[1], so[2]]
            .map(|x| x as u64)
            .to_vec();
        words.push(u64::from((scale * std::f32::consts::LOG2_E).to_bits()));
        // Persistent blocks, one per SM, over q_blocks x (batch x heads) tiles; under the causal
        // mask the tiles go through sections of (batch, head) pairs whose keys and values fit in
        // half of L2, of the size that evens out the blocks' loads (`schedule.rs`).
        let facts =
            device_facts(&self.tensors[0]).ok_or("the driver did not give the GPU's attributes")?;
        // A k/v head's keys and values serve `group` consecutive pairs.
        let size = if self.fp8 { 1 } else { 2 };
        let kv_bytes = (2 * d.seq_k * d.hd * size).div_ceil(d.group.max(1));
        let fits = (facts.l2_bytes as usize / 2 / kv_bytes.max(1)).clamp(1, pairs.max(1));
        let grid = (q_blocks * pairs).min(facts.multiprocessors as usize);
        let section = if causal {
            let tiles = schedule::CausalTiles {
                seq_q: d.seq_q,
                seq_k: d.seq_k,
                block_q: shape.block_q(),
                pairs,
                grid,
            };
            schedule::causal_section(tiles, fits)
        } else {
            fits
        };
        words.extend([q_blocks, pairs, section].map(|x| x as u64));
        // `Info` in forward.cu: the four maps, then these words, in this order.
        debug_assert_eq!(
            words.len(),
            11,
            "forward.cu's Info has 11 words after its maps"
        );
        let defines = format!(
            "#define HD {}\n#define IS_BF16 {}\n#define CAUSAL {}\n#define CONSUMERS {}\n#define STAGES {}\n#define FP8 {}\n",
            d.hd,
            u8::from(self.bf16),
            u8::from(causal),
            shape.consumers,
            shape.stages,
            u8::from(self.fp8)
        );
        let kernel = CudaSource::new(ENTRY, defines, SOURCE, CubeDim::new_1d(shape.threads()))
            .with_shared(shape.shared_bytes(d.hd, size));
        launch::queue(Launch {
            tensors: self.tensors,
            maps: self.maps,
            words,
            kernel,
            cubes: (grid as u32, 1, 1),
        });
        Ok(())
    }
}
